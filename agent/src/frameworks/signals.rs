//! Signals: probe hits that are not lifecycle events (a profile's
//! `[[signal]]` tables). The kernel hands them over as events of stage
//! [`stage::SIGNAL`] without tracking them; here each one is named by its
//! slot's spec and handed to the consumer of that name, never to the
//! lifecycle engine. The consumers: the ZMQ frames of `zmq_recv`,
//! `zmq_data` and `zmq_send` ([`crate::frameworks::zmq`]) make messages, which the
//! SGLang room tracker ([`crate::frameworks::sglang`]) turns into the rooms'
//! lifecycle observations; `nixl_remote_agent` (createXferReq) and
//! `nixl_dlist_remote_agent` (makeXferReq) name the peer of the NIXL
//! transfer a thread creates, so the tracker attributes the handle to its
//! room and [`crate::evidence::peers`] knows every handle's peer, for the verdict
//! per peer. A signal of any other name is only logged
//! (`STALLWATCH_LOG=debug`), which is how a profile author checks what a
//! signal reads.
use std::{collections::HashMap, sync::Arc};

use stallwatch_common::{EXT_ID_LEN, Event, event_flags, stage};
use tracing::{debug, info, warn};

use crate::{
    evidence::peers::{PeerCompletions, Peers},
    frameworks::sglang::{self, Rooms},
    frameworks::zmq::{Assembler, Hit},
    kernel::{Role, Slot},
    lifecycle::{Observation, RequestSnapshot, Restored, Side, Silent, StageRead},
    profile::SignalSpec,
    util::text,
    util::warned::Warned,
};

/// One signal hit, as its consumer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signal {
    pub pid: u32,
    pub tid: u32,
    pub ts_ns: u64,
    /// What the spec's `value` read.
    pub value: u64,
    /// The return value (0 at entry).
    pub ret: i64,
    pub capture: Captured,
}

/// What a signal read at an address besides its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Captured {
    /// Nothing asked for, or it could not be read (the kernel counts that
    /// as `ext_unreadable`).
    None,
    /// A string, up to its NUL (also what `bytes` falls back to where the
    /// whole [`EXT_ID_LEN`] bytes could not be read).
    Text(Box<[u8]>),
    /// [`EXT_ID_LEN`] raw bytes.
    Bytes(Box<[u8; EXT_ID_LEN]>),
}

impl Signal {
    pub fn of(event: &Event) -> Self {
        let capture = if event.flags & event_flags::HAS_EXT == 0 {
            Captured::None
        } else if event.flags & event_flags::EXT_BYTES != 0 {
            Captured::Bytes(Box::new(event.ext))
        } else {
            let len = event.ext.iter().position(|&b| b == 0).unwrap_or(EXT_ID_LEN);
            Captured::Text(event.ext[..len].into())
        };
        Self { pid: event.pid, tid: event.tid, ts_ns: event.ts_ns, value: event.key, ret: event.ret, capture }
    }
}

/// Whether an event is a signal rather than a lifecycle event.
pub fn is_signal(event: &Event) -> bool {
    event.stage == stage::SIGNAL
}

/// Hands each signal to its consumer.
pub struct Signals {
    /// Signals whose slot is no signal of their process any more (a
    /// previous agent's probes, read after a restart, or a process gone):
    /// their meaning is unknown, so they are dropped, counted.
    pub unrouted: u64,
    zmq: Assembler,
    rooms: Rooms,
    peers: Peers,
    /// SGLang messages (by their tag) that did not read as SGLang writes
    /// them, and why the latest did not.
    unparsed: u64,
    last_unparsed: Option<String>,
    /// Garbled frames and unparsed messages the last warning covered.
    warned: Warned,
    /// (pid, tid) -> the half of a scheduler's request receive seen first:
    /// its room (`sglang_request_room`) and its rid (the frame, through
    /// the ZMQ signals) come from the same `zmq_msg_data` return, as two
    /// signals in either order ([`Signals::request`]).
    requests: HashMap<(u32, u32), RequestHalf>,
}

/// One half of a request the scheduler received.
enum RequestHalf {
    Room(u64),
    Rid(sglang::Rid),
}

impl Signals {
    /// `timeout_ns`: the stall timeout, how far back peers' completions
    /// are needed.
    pub fn new(timeout_ns: u64) -> Self {
        Self {
            unrouted: 0,
            zmq: Assembler::default(),
            rooms: Rooms::default(),
            peers: Peers::new(timeout_ns),
            unparsed: 0,
            last_unparsed: None,
            warned: Warned::default(),
            requests: HashMap::new(),
        }
    }

    /// Route one signal event of slot `slot` (`None`: not attached now):
    /// the lifecycle observation it completes, if it does.
    pub fn route(&mut self, event: &Event, slot: Option<&Slot>) -> Option<Observation> {
        let spec: Arc<SignalSpec> = match slot {
            Some(Slot { pid, role: Role::Signal(spec), .. }) if *pid == event.pid => spec.clone(),
            _ => {
                self.unrouted += 1;
                return None;
            }
        };
        let signal = Signal::of(event);
        let raw = match &signal.capture {
            Captured::Bytes(bytes) => Some(&**bytes),
            _ => None,
        };
        let hit = match spec.name.as_str() {
            "zmq_recv" => Hit::Recv { msg: signal.value, size: signal.ret, tail: raw },
            "zmq_send" => Hit::Send { flags: signal.value, tail: raw },
            // The remote agent named at createXferReq's entry, or read from
            // the remote dlist handle at makeXferReq's: the same news.
            "nixl_remote_agent" | "nixl_dlist_remote_agent" => {
                if let Captured::Text(agent) = &signal.capture {
                    // makeXferReq's value: its first remote indices (int32s),
                    // the first of which is the chunk's first destination page.
                    let page = (spec.name == "nixl_dlist_remote_agent").then_some(signal.value as u32);
                    self.rooms.creating(signal.pid, signal.tid, agent, page);
                    self.peers.creating(signal.pid, signal.tid, agent);
                }
                return None;
            }
            // The `bootstrap_room` of a request SGLang's scheduler receives.
            "sglang_request_room" => {
                let room = match &signal.capture {
                    Captured::Bytes(bytes) => stallwatch_common::msgpack::uint(&bytes[..]),
                    _ => None,
                };
                return match room {
                    Some(room) => self.request(signal.pid, signal.tid, signal.ts_ns, RequestHalf::Room(room)),
                    None => {
                        self.unparsed += 1;
                        self.last_unparsed = Some(format!(
                            "pid {} thread {}: a request's bootstrap_room is no unsigned integer",
                            signal.pid, signal.tid
                        ));
                        None
                    }
                };
            }
            // The requests a scheduler output is about (their ends).
            "sglang_output_rids" => {
                let rids = match &signal.capture {
                    Captured::Bytes(bytes) => sglang::output_rids(&bytes[..]),
                    _ => Vec::new(),
                };
                return self.rooms.observe(signal.pid, signal.ts_ns, &sglang::Bootstrap::Output { rids });
            }
            "zmq_data" => Hit::Data {
                msg: signal.value,
                data: match &signal.capture {
                    Captured::Bytes(bytes) => Some(&bytes[..]),
                    // Where 64 bytes could not be read: up to the NUL.
                    Captured::Text(text) => Some(&text[..]),
                    Captured::None => None,
                },
            },
            _ => {
                self.log(&spec, &signal);
                return None;
            }
        };
        let message = self.zmq.hit(signal.pid, signal.tid, signal.ts_ns, hit)?;
        match sglang::parse(&message) {
            Ok(Some(sglang::Bootstrap::Request { rid, .. })) => {
                self.request(message.pid, message.tid, message.ts_ns, RequestHalf::Rid(rid))
            }
            Ok(Some(bootstrap)) => self.rooms.observe(message.pid, message.ts_ns, &bootstrap),
            Ok(None) => None,
            Err(why) => {
                self.unparsed += 1;
                self.last_unparsed = Some(format!("pid {} thread {}: {why}", message.pid, message.tid));
                None
            }
        }
    }

    /// One half of a request received on thread `tid`: with the other
    /// half already seen on that thread, the room starts; else this one
    /// waits for it (replacing a half whose other never came).
    fn request(&mut self, pid: u32, tid: u32, ts_ns: u64, half: RequestHalf) -> Option<Observation> {
        let (room, rid) = match (self.requests.remove(&(pid, tid)), half) {
            (Some(RequestHalf::Rid(rid)), RequestHalf::Room(room))
            | (Some(RequestHalf::Room(room)), RequestHalf::Rid(rid)) => (room, rid),
            (_, half) => {
                self.requests.insert((pid, tid), half);
                return None;
            }
        };
        self.rooms.observe(pid, ts_ns, &sglang::Bootstrap::Request { room, rid })
    }

    /// What the engine gets of `event`: a signal's observation, if it
    /// completes one ([`Signals::route`]); a probe's lifecycle event
    /// (`observation`), unless it is a NIXL handle attributed to a room,
    /// which makes it the room's event ([`Rooms::handle`]); every handle's
    /// event counts for its peer first ([`Peers::observe`]).
    pub fn consume(
        &mut self,
        event: &Event,
        observation: Option<Observation>,
        slot: Option<&Slot>,
    ) -> Option<Observation> {
        match observation {
            Some(observation) => {
                self.peers.observe(event.tid, &observation);
                self.rooms.handle(event.tid, observation)
            }
            None => self.route(event, slot),
        }
    }

    /// Follow again a request a previous agent followed, if it is an SGLang
    /// room (what [`crate::kernel::state::KernelState::hold`] kept of it): its
    /// status and abort end it as they would have ([`Rooms::adopt`]).
    pub fn adopt(&mut self, request: &Restored) {
        if let Some(room) = sglang::room_of(request.key, request.external_id.as_deref()) {
            self.rooms.adopt(request.pid, room);
        }
    }

    /// Which side of the transfer `pid` serves, as its SGLang traffic
    /// tells ([`Rooms::side`]).
    pub fn side(&self, pid: u32) -> Side {
        self.rooms.side(pid)
    }

    /// What an alert of `request` says besides its lifecycle, if it is an
    /// SGLang room ([`Rooms::context`]).
    pub fn context(&self, request: &RequestSnapshot) -> Vec<(&'static str, String)> {
        match sglang::room_of(request.key, request.external_id.as_deref()) {
            Some(room) => self.rooms.context(request.pid, room),
            None => Vec::new(),
        }
    }

    /// What the target's memory says of a silent request that is an SGLang
    /// room (read from its handles, see [`Rooms::read`]); `None` for one
    /// that is no room, whose own memory `read` reads.
    pub fn read_room(
        &mut self,
        silent: &Silent,
        read: &mut dyn FnMut(&Silent) -> Option<StageRead>,
    ) -> Option<Option<StageRead>> {
        self.rooms.read(silent, read)
    }

    /// What the peer of `request`'s stalled transfer, and the other peers
    /// of its process, completed since its last event: the transfer is the
    /// request's own handle, or for an SGLang room its oldest transfer
    /// posted and not done ([`Rooms::hung_handle`]). `None` when that
    /// transfer's peer is unknown.
    pub fn peer_completions(&self, request: &RequestSnapshot) -> Option<PeerCompletions> {
        let handle = match sglang::room_of(request.key, request.external_id.as_deref()) {
            Some(room) => self.rooms.hung_handle(request.pid, room)?,
            None => request.key,
        };
        self.peers.since(request.pid, handle, request.last_ns)
    }

    /// One warning for the frames and messages that could not be read
    /// since the last one (called once per counter period, never per
    /// message: a stream of them must not flood the log).
    pub fn warn(&mut self) {
        if let Some(new) = self.warned.news(self.zmq.garbled + self.unparsed) {
            warn!(
                new,
                garbled_frames = self.zmq.garbled,
                unparsed_messages = self.unparsed,
                latest = self.last_unparsed.as_deref().unwrap_or_default(),
                "ZMQ frames or SGLang bootstrap messages that could not be read (their rooms may be missed)"
            );
        }
    }

    /// The process is gone: what it was in the middle of goes with it.
    pub fn forget(&mut self, pid: u32) {
        self.requests.retain(|(p, _), _| *p != pid);
        self.zmq.forget(pid);
        self.rooms.forget(pid);
        self.peers.forget(pid);
    }

    fn log(&self, spec: &SignalSpec, signal: &Signal) {
        debug!(
            name = %spec.name,
            pid = signal.pid,
            tid = signal.tid,
            value = format_args!("{:#x}", signal.value),
            ret = signal.ret,
            capture = %Shown(&signal.capture),
            "signal"
        );
    }

    /// At exit: what could not be routed or read, if anything.
    pub fn finish(&mut self) {
        self.warn();
        if self.unrouted > 0 {
            info!(
                unrouted = self.unrouted,
                "signals of probes no longer attached were dropped (their meaning is unknown)"
            );
        }
        if self.rooms.unattributed > 0 {
            warn!(
                unattributed = self.rooms.unattributed,
                "NIXL transfers no SGLang room could be told theirs (several live rooms awaited their decode rank, and the \
                 page written was none of the first 16 of any room's destination): each was followed, and counted in \
                 `seen`, as a request of its own, keyed by its handle"
            );
        }
    }
}

/// A capture for a log line: text quoted, bytes in hex.
struct Shown<'a>(&'a Captured);

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Captured::None => f.write_str("none"),
            Captured::Text(bytes) => f.write_str(&text::value(&String::from_utf8_lossy(bytes))),
            Captured::Bytes(bytes) => bytes.iter().try_for_each(|b| write!(f, "{b:02x}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(flags: u32, ext: &[u8]) -> Event {
        let mut event = Event {
            ts_ns: 5,
            key: 0x10,
            ret: 3,
            pid: 9,
            tid: 10,
            slot: 0,
            flags,
            stage: stage::SIGNAL,
            _pad: [0; 7],
            ext: [0; EXT_ID_LEN],
        };
        event.ext[..ext.len()].copy_from_slice(ext);
        event
    }

    #[test]
    fn captures_are_text_up_to_nul_raw_bytes_or_nothing() {
        let text = Signal::of(&event(event_flags::HAS_EXT, b"ABORT\0junk"));
        assert_eq!(text.capture, Captured::Text(b"ABORT".as_slice().into()));
        assert_eq!((text.pid, text.tid, text.value, text.ret, text.ts_ns), (9, 10, 0x10, 3, 5));
        let raw = Signal::of(&event(event_flags::HAS_EXT | event_flags::EXT_BYTES, b"KV\0STATUS"));
        let Captured::Bytes(bytes) = raw.capture else { panic!("{raw:?}") };
        assert_eq!(&bytes[..9], b"KV\0STATUS");
        assert_eq!(Signal::of(&event(0, b"ABORT")).capture, Captured::None);
        assert_eq!(Shown(&Captured::Text(b"a b".as_slice().into())).to_string(), text::value("a b"));
        assert!(is_signal(&event(0, b"")));
    }

    #[test]
    fn a_stalled_rooms_peer_is_its_hung_handles_and_a_handles_is_its_own() {
        use crate::lifecycle::Stage::{self, *};
        let mut signals = Signals::new(1_000_000_000);
        // Every handle event comes on thread 10 of pid 9.
        let on_thread = event(0, b"");
        let handle = |key, stage, ts_ns| Observation { pid: 9, key, stage, ts_ns, external_id: None, ends: false };
        let consume = |signals: &mut Signals, key, stage, ts_ns| {
            signals.consume(&on_thread, Some(handle(key, stage, ts_ns)), None)
        };
        // What the route of a `nixl_remote_agent` signal tells both trackers.
        let name = |signals: &mut Signals, agent: &[u8]| {
            signals.rooms.creating(9, 10, agent, None);
            signals.peers.creating(9, 10, agent);
        };
        signals
            .rooms
            .observe(
                9,
                1,
                &sglang::Bootstrap::Destination {
                    room: 7,
                    port: 1,
                    agent: "decode-0".into(),
                    ranks: 1,
                    pages: Default::default(),
                },
            )
            .expect("room 7");
        name(&mut signals, b"decode-0");
        assert_eq!(consume(&mut signals, 0xa0, Enqueued, 10), None, "room 7's");
        assert!(consume(&mut signals, 0xa0, TransferPosted, 20).is_some());
        // Two transfers to decode-1 of no room: one completes (released
        // after its post), one is left hanging.
        for key in [0xb0, 0xc0] {
            name(&mut signals, b"decode-1");
            assert_eq!(consume(&mut signals, key, Enqueued, 21), Some(handle(key, Enqueued, 21)), "its own");
            consume(&mut signals, key, TransferPosted, 25);
        }
        consume(&mut signals, 0xb0, Released, 30);
        let stalled = |key, external_id: Option<&str>, last_ns| RequestSnapshot {
            pid: 9,
            key,
            external_id: external_id.map(Into::into),
            stage: Stage::TransferPosted,
            stage_ns: [Some(last_ns), Some(last_ns), None, None],
            first_ns: last_ns,
            last_ns,
            stalled: None,
            inferred: Default::default(),
        };
        let of = |request| signals.peer_completions(&request).map(|p| (p.peer.to_string(), p.to_peer, p.to_others));
        assert_eq!(of(stalled(7, Some("7"), 20)), Some(("decode-0".into(), 0, 1)), "the room's hung handle's peer");
        assert_eq!(of(stalled(0xc0, None, 25)), Some(("decode-1".into(), 1, 0)), "the handle's own");
        assert_eq!(of(stalled(0xd0, None, 25)), None, "a handle whose peer no thread named");
        assert_eq!(of(stalled(8, Some("8"), 25)), None, "a room with no transfer");
    }

    #[test]
    fn a_requests_room_and_rid_pair_up_per_thread_in_either_order() {
        use crate::lifecycle::Stage;
        let mut signals = Signals::new(1_000_000_000);
        let rid = |r: &[u8]| RequestHalf::Rid(r.into());
        assert_eq!(signals.request(9, 10, 1, RequestHalf::Room(7)), None, "waits for its rid");
        assert_eq!(signals.request(9, 11, 2, rid(b"a")), None, "another thread's");
        let started = signals.request(9, 10, 3, rid(b"b")).expect("room 7 starts");
        assert_eq!((started.key, started.stage, started.ts_ns), (7, Stage::Enqueued, 3));
        let started = signals.request(9, 11, 4, RequestHalf::Room(8)).expect("room 8 starts");
        assert_eq!(started.key, 8);
        // A half whose other never came is replaced by the next receive's.
        assert_eq!(signals.request(9, 10, 5, RequestHalf::Room(20)), None);
        assert_eq!(signals.request(9, 10, 6, RequestHalf::Room(21)), None);
        assert_eq!(signals.request(9, 10, 7, rid(b"c")).map(|o| o.key), Some(21));
        assert!(signals.requests.is_empty());
        signals.request(9, 12, 8, RequestHalf::Room(30));
        signals.forget(9);
        assert!(signals.requests.is_empty());
    }

    #[test]
    fn signals_of_slots_not_attached_as_signals_are_dropped_counted() {
        let mut signals = Signals::new(1_000_000_000);
        assert_eq!(signals.route(&event(0, b""), None), None);
        assert_eq!(signals.unrouted, 1);
    }
}
