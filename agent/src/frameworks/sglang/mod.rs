//! SGLang's rooms, from its bootstrap ZMQ traffic (sglang 0.5.23,
//! `disaggregation/nixl/conn.py` and `common/conn.py`), as lifecycles.
//!
//! A prefill rank receives, on its bootstrap PULL socket, per room and
//! decode rank the room's destination ("TransferInfo": `[b"NixlMsgGuard",
//! room, ip, port, agent name, ...]`, the room as ASCII decimal) and, when
//! the decode gives the room up, `[b"ABORT", room, ...]`; it answers each
//! decode with `[b"KV_STATUS", room, status, ...]` (KVPoll: 0 Failed,
//! 4 Success) once the room's transfers are over. So a room is enqueued
//! when its destination arrives, released when Success is sent, failed
//! when Failed is, aborted at the ABORT. The lifecycle's key is the room
//! and its external id the room in decimal, so its trace id is the room's
//! on every node. A registration (room `b"None"`) is no room.
//!
//! The scheduler's own ZMQ traffic (msgpack IPC, `SGLANG_USE_PICKLE_IPC=0`)
//! starts and ends rooms the decode never hears of: the request it receives
//! (`TokenizedGenerateReqInput`, its `bootstrap_room` and `rid`) starts the
//! room before any destination, an `AbortReq` for its rid aborts it, and
//! its output of the request to the detokenizer (`BatchTokenIDOutput`)
//! fails a room not yet bootstrapped, which the prefill ended itself (its
//! bootstrap timeout).
//!
//! A decode rank is the other end of the same messages: it sends its
//! destination (the decode asks for the room's KV), may send the ABORT,
//! and receives the KV_STATUS. So a process that sends destinations is a
//! decode ([`Side::Decode`]): its room is enqueued when the destination
//! goes out, released or failed when the status comes in, aborted at its
//! ABORT, and a room silent in between waits for its KV
//! (`waiting_for_kv`). Both sides key the room alike, so their spans of
//! one room share its trace.
//!
//! NIXL handles are attributed to rooms by destination: each worker
//! thread names the remote agent of the transfer it creates (a signal on
//! `createXferReq`'s entry) just before the call's handle comes back on
//! the same thread, and a handle to agent A created while exactly one live
//! room of the process lists A among its destinations is that room's. Its
//! lifecycle events then are the room's (so the room is `transfer_posted`
//! from its first posted transfer on, and a hung transfer stalls the room
//! `transfer_hung`), and the handle raises no lifecycle of its own. A
//! handle that cannot be attributed unambiguously stays its own lifecycle.
//!
//! A KV chunk (`makeXferReq`) is told by the first decode page it writes,
//! which is its room's page at the chunk's start (SGLang writes a chunk to
//! `dst_kv_indices[index_slice]`): the live room whose destination lists
//! that page at that decode rank is the chunk's, however many rooms await
//! the rank. A destination's pages are read whole (the optional
//! `zmq_recv_long` signal, up to 4032 pages: [`LongFrames`]), else their
//! first 16 (the first 64 bytes every frame is read with); a chunk that
//! starts past what was read of its room (a room of more than 4032 pages)
//! falls back to its thread's room, or to nobody while several rooms await
//! its decode rank ([`Rooms::unattributed`]). A dummy destination
//! ([`Bootstrap::Dummy`]) is no room of this rank.
//!
//! A room's handles are followed on to their release ([`leaks`]): one its
//! worker left behind, or whose release NIXL refused, unreleased a timeout
//! after, its room ended, is reported once as a leak of that room
//! (`leaked=handle`). The release is probed at its entry, where the
//! handle's status is read, so a transfer that failed is `failed` however
//! soon it is released.
//!
//! [`rooms`] holds the rooms and the bootstrap wire format; this module is
//! SGLang's [`Framework`]: which signals are SGLang's, and how a scheduler's
//! request is paired from its two halves.
pub mod leaks;
mod long;
pub mod rooms;

use std::collections::HashMap;

use tracing::{debug, info, warn};

pub use self::rooms::{Bootstrap, Rid, Rooms, output_rids, parse, pickled_record, room_of, scheduler};
use self::{leaks::Leaks, long::LongFrames};
use super::{
    AdoptedHandle, Claim, Framework, HandOver, TakeOver,
    signals::{Captured, Signal},
    zmq::{Assembler, Direction, Hit, Message},
};
use crate::{
    lifecycle::{Observation, RequestSnapshot, Restored, Side, Silent, Stage, StageRead},
    profile::SignalSpec,
    util::warned::Warned,
};

/// How one transfer backend's SGLang speaks: the prefix of the names of
/// its profile's signals (so two backends' trackers never take each
/// other's), and how its bootstrap messages read. The rooms, the scheduler
/// messages and the ZMQ reassembly are the same for every backend.
pub struct Dialect {
    pub prefix: &'static str,
    pub parse: fn(&Message) -> Result<Option<Bootstrap>, String>,
    /// Its transfers are NIXL handles whose releases the profile probes,
    /// followed to their release for leaks ([`leaks`]). A backend whose
    /// transfers end otherwise (a Mooncake batch at its free) tells its
    /// own leaks.
    pub leaks: bool,
}

/// SGLang on NIXL: signals named as they are, `NixlMsgGuard`-tagged
/// bootstrap messages.
pub const NIXL: Dialect = Dialect { prefix: "", parse, leaks: true };

/// SGLang's tracker: ZMQ frames made messages, messages made rooms.
pub struct Sglang {
    dialect: Dialect,
    zmq: Assembler,
    /// Long frames read whole, for the messages they are part of.
    long: LongFrames,
    rooms: Rooms,
    /// SGLang messages (by their tag) that did not read as SGLang writes
    /// them, and why the latest did not.
    unparsed: u64,
    last_unparsed: Option<String>,
    /// Garbled frames and unparsed messages the last warning covered.
    warned: Warned,
    /// (pid, tid) -> the half of a scheduler's request receive seen first:
    /// its room (`sglang_request_room`) and its rid (the frame, through
    /// the ZMQ signals) come from the same hit (the frame's
    /// `zmq_msg_close`), as two signals in either order, each with the
    /// same bytes of the frame ([`frame_id`]) ([`Sglang::request`]).
    requests: HashMap<(u32, u32), RequestHalf>,
    /// The rooms' handles until their release, and the leaks among them:
    /// from the agent's timeout on ([`Framework::timeout`]), for a
    /// dialect with [`Dialect::leaks`].
    leaks: Option<Leaks>,
}

/// One half of a request the scheduler received, with the bytes of the
/// frame it was read from that tell it from another request's
/// ([`frame_id`]).
enum RequestHalf {
    Room { room: u64, frame: u64 },
    Rid { rid: Rid, frame: u64 },
}

/// Where in a received request frame the bytes that tell it from the next
/// are: eight bytes of its `rid` (SGLang's rids are 32 random hex digits),
/// past a msgpack `TokenizedGenerateReqInput`'s array16 header (3 bytes),
/// its tag (1 + 25) and the rid's str8 header (2). The kernel reads them
/// as `sglang_request_room`'s `extra` (profile `sglang`), the agent from the
/// frame `zmq_recv` captured: the room and the rid of one receive pair up,
/// and a half whose other was not read (a room past the kernel's msgpack
/// walk: a prompt of more than about 480 tokens) never pairs with the next
/// request's half, whose rid's output would then end the wrong room.
const FRAME_ID_AT: usize = 31;

/// The bytes at [`FRAME_ID_AT`] of a received frame, if it is that long.
fn frame_id(frame: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(frame.get(FRAME_ID_AT..FRAME_ID_AT + 8)?.try_into().ok()?))
}

impl Default for Sglang {
    fn default() -> Self {
        Self::with(NIXL)
    }
}

impl Sglang {
    /// A tracker of SGLang on the backend `dialect` says.
    pub fn with(dialect: Dialect) -> Self {
        Self {
            dialect,
            zmq: Assembler::default(),
            long: LongFrames::default(),
            rooms: Rooms::default(),
            unparsed: 0,
            last_unparsed: None,
            warned: Warned::default(),
            requests: HashMap::new(),
            leaks: None,
        }
    }

    /// The rooms (a backend's tracker attributes its transfers to them).
    pub fn rooms_mut(&mut self) -> &mut Rooms {
        &mut self.rooms
    }

    pub fn rooms(&self) -> &Rooms {
        &self.rooms
    }

    /// One half of a request received on thread `tid`: with the other
    /// half of the same frame already seen on that thread, the room starts;
    /// else this one waits for it (replacing a half whose other never came).
    fn request(&mut self, pid: u32, tid: u32, ts_ns: u64, half: RequestHalf) -> Option<Observation> {
        let (room, rid) = match (self.requests.remove(&(pid, tid)), half) {
            (Some(RequestHalf::Rid { rid, frame: a }), RequestHalf::Room { room, frame: b })
            | (Some(RequestHalf::Room { room, frame: b }), RequestHalf::Rid { rid, frame: a })
                if a == b =>
            {
                (room, rid)
            }
            (before, half) => {
                if before.is_some() {
                    // The other half of the one before never came (its room
                    // was not read): it is dropped, never paired with this
                    // request's ([`FRAME_ID_AT`]).
                    debug!(pid, tid, "a scheduler request's room or rid came without its other half");
                }
                self.requests.insert((pid, tid), half);
                return None;
            }
        };
        self.rooms.observe(pid, ts_ns, &Bootstrap::Request { room, rid })
    }

    fn unparsed(&mut self, why: String) {
        self.unparsed += 1;
        self.last_unparsed = Some(why);
    }
}

impl Framework for Sglang {
    fn signal(&mut self, spec: &SignalSpec, signal: &Signal) -> Claim<Observation> {
        let raw = match &signal.capture {
            Captured::Bytes(bytes) => Some(&**bytes),
            _ => None,
        };
        let Some(name) = spec.name.strip_prefix(self.dialect.prefix) else { return Claim::NotMine };
        let hit = match name {
            "zmq_recv" => Hit::Received {
                head: signal.value,
                size: signal.ret,
                data: match &signal.capture {
                    Captured::Bytes(bytes) => Some(&bytes[..]),
                    // Where 64 bytes could not be read: up to the NUL.
                    Captured::Text(text) => Some(&text[..]),
                    Captured::None | Captured::Chunk(_) => None,
                },
            },
            "zmq_send" => Hit::Send { flags: signal.value, tail: raw },
            // A long frame with more to come, read whole: kept for its message.
            "zmq_recv_long" => {
                if let Captured::Chunk(chunk) = &signal.capture {
                    self.long.chunk(signal.pid, signal.tid, spec.line as u32, chunk);
                }
                return Claim::NOTHING;
            }
            // The remote agent named at createXferReq's entry, or read from
            // the remote dlist handle at makeXferReq's: the same news.
            "nixl_remote_agent" | "nixl_dlist_remote_agent" => {
                if let Captured::Text(agent) = &signal.capture {
                    // makeXferReq's value: its first remote indices (int32s),
                    // the first of which is the chunk's first destination page.
                    let page = (name == "nixl_dlist_remote_agent").then_some(signal.value as u32);
                    self.rooms.creating(signal.pid, signal.tid, agent, page);
                }
                return Claim::NOTHING;
            }
            // The `bootstrap_room` of a request SGLang's scheduler receives.
            "sglang_request_room" => {
                let room = match &signal.capture {
                    Captured::Bytes(bytes) => stallwatch_common::msgpack::uint(&bytes[..]),
                    _ => None,
                };
                return Claim::Mine(match room {
                    Some(room) => {
                        let half = RequestHalf::Room { room, frame: signal.ret as u64 };
                        self.request(signal.pid, signal.tid, signal.ts_ns, half)
                    }
                    None => {
                        self.unparsed(format!(
                            "pid {} thread {}: a request's bootstrap_room is no unsigned integer",
                            signal.pid, signal.tid
                        ));
                        None
                    }
                });
            }
            // A request or an abort the scheduler receives, pickled
            // (SGLang's default IPC): one record per request of a batch.
            // And one rid of a pickled scheduler output.
            "sglang_request_pickle" | "sglang_output_pickle" => {
                let record = match &signal.capture {
                    Captured::Bytes(bytes) => pickled_record(name, signal.tag, &bytes[..]),
                    _ => Err("its record could not be read".to_owned()),
                };
                return Claim::Mine(match record {
                    Ok(bootstrap) => self.rooms.observe(signal.pid, signal.ts_ns, &bootstrap),
                    Err(why) => {
                        self.unparsed(format!("pid {} thread {}: {why}", signal.pid, signal.tid));
                        None
                    }
                });
            }
            // The requests a scheduler output is about (their ends).
            "sglang_output_rids" => {
                let rids = match &signal.capture {
                    Captured::Bytes(bytes) => output_rids(&bytes[..]),
                    _ => Vec::new(),
                };
                return Claim::Mine(self.rooms.observe(signal.pid, signal.ts_ns, &Bootstrap::Output { rids }));
            }
            _ => return Claim::NotMine,
        };
        let Some(message) = self.zmq.hit(signal.pid, signal.tid, signal.ts_ns, hit) else { return Claim::NOTHING };
        let long = (message.direction == Direction::Received).then(|| self.long.take(message.pid, message.tid));
        Claim::Mine(match (self.dialect.parse)(&message) {
            Ok(Some(Bootstrap::Destination { room, port, agent, ranks, pages })) => {
                let pages = long.and_then(|long| self.long.pages(long, &message, &pages)).unwrap_or(pages);
                let to = Bootstrap::Destination { room, port, agent, ranks, pages };
                self.rooms.observe(message.pid, message.ts_ns, &to)
            }
            Ok(Some(Bootstrap::Request { rid, .. })) => {
                // A scheduler message is one frame; one too short to hold
                // the bytes that pair it is no request of SGLang's.
                match message.frames.first().and_then(|frame| frame_id(&frame.bytes)) {
                    Some(frame) => {
                        self.request(message.pid, message.tid, message.ts_ns, RequestHalf::Rid { rid, frame })
                    }
                    None => None,
                }
            }
            Ok(Some(bootstrap)) => self.rooms.observe(message.pid, message.ts_ns, &bootstrap),
            Ok(None) => None,
            Err(why) => {
                self.unparsed(format!("pid {} thread {}: {why}", message.pid, message.tid));
                None
            }
        })
    }

    /// A NIXL handle attributed to a room makes the room's event
    /// ([`Rooms::handle`]); its release, to its end, is followed for a
    /// leak ([`Leaks::event`]), which takes the release's return.
    fn handle(&mut self, tid: u32, observation: Observation) -> Option<Observation> {
        let Self { rooms, leaks, .. } = self;
        let Some(leaks) = leaks else { return rooms.handle(tid, observation) };
        let Observation { pid, key, stage, ts_ns, .. } = observation;
        if stage == Stage::Enqueued {
            let creating = rooms.creating_of(pid, tid).map(|(agent, kv)| (Box::<str>::from(agent), kv));
            let made = rooms.handle(tid, observation);
            if let (Some((agent, kv)), Some(room)) = (creating, rooms.attributed_room(pid, key)) {
                leaks.created(pid, tid, key, leaks::Made { room, peer: &agent, kv }, ts_ns);
            }
            return made;
        }
        if leaks.event(pid, key, stage, ts_ns) {
            return None;
        }
        rooms.handle(tid, observation)
    }

    fn timeout(&mut self, timeout_ns: u64) {
        if self.dialect.leaks {
            self.leaks = Some(Leaks::new(timeout_ns));
        }
    }

    /// Handles left unreleased past the timeout are leaks ([`Leaks::expire`]).
    fn expire(&mut self, now_ns: u64) {
        let Self { rooms, leaks, .. } = self;
        if let Some(leaks) = leaks {
            leaks.expire(now_ns, |pid, room| rooms.is_live(pid, room));
        }
    }

    fn next_expiry(&self) -> Option<u64> {
        self.leaks.as_ref()?.next_expiry()
    }

    /// A leaked handle's lifecycle, its start and its end.
    fn pending(&mut self) -> Option<Observation> {
        self.leaks.as_mut()?.pending()
    }

    fn side(&self, pid: u32) -> Side {
        self.rooms.side(pid)
    }

    fn name(&self) -> &'static str {
        "sglang"
    }

    /// A room's spans carry its room under the name SGLang's own spans
    /// give it.
    fn native(&self, request: &RequestSnapshot) -> Vec<(&'static str, i64)> {
        let room = room_of(request.key, request.external_id.as_deref()).and_then(|room| i64::try_from(room).ok());
        room.map(|room| ("bootstrap_room", room)).into_iter().collect()
    }

    fn context(&self, request: &RequestSnapshot) -> Vec<(&'static str, String)> {
        match room_of(request.key, request.external_id.as_deref()) {
            Some(room) => self.rooms.context(request.pid, room),
            None => self.leaks.as_ref().map(|leaks| leaks.context(request.pid, request.key)).unwrap_or_default(),
        }
    }

    /// A room has no memory of its own: its handles have ([`Rooms::read`]).
    fn read(&mut self, silent: &Silent, read: &mut dyn FnMut(&Silent) -> Option<StageRead>) -> Claim<StageRead> {
        self.rooms.read(silent, read)
    }

    /// Its rooms: what this agent knew of each is pinned for the next.
    fn take_over(&mut self) -> Option<&mut dyn TakeOver> {
        Some(self)
    }

    /// A room's oldest transfer posted and not done ([`Rooms::hung_handle`]).
    fn stalled_transfer(&self, request: &RequestSnapshot) -> Claim<u64> {
        match room_of(request.key, request.external_id.as_deref()) {
            Some(room) => Claim::Mine(self.rooms.hung_handle(request.pid, room)),
            None => Claim::NotMine,
        }
    }

    /// The hung transfer of the room a room is `behind` on its worker, as
    /// its alert names it ([`Rooms::context`]): read from that context, so
    /// the peer judged is the one of the room the alert names.
    fn queued_behind(&self, request: &RequestSnapshot) -> Option<u64> {
        let room = room_of(request.key, request.external_id.as_deref())?;
        let context = self.rooms.context(request.pid, room);
        let behind = context.into_iter().find_map(|(name, value)| (name == "behind").then_some(value))?;
        self.rooms.hung_handle(request.pid, behind.parse().ok()?)
    }

    /// A profile with this dialect's ZMQ signals (`zmq_recv`, or with its
    /// prefix): so a room a previous agent followed on one backend is not
    /// adopted by another backend's tracker.
    fn follows(&self, profile: &crate::profile::Profile) -> bool {
        profile.signals.iter().any(|spec| spec.name.strip_prefix(self.dialect.prefix) == Some("zmq_recv"))
    }

    fn warn(&mut self) {
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

    fn forget(&mut self, pid: u32) {
        self.requests.retain(|(p, _), _| *p != pid);
        self.zmq.forget(pid);
        self.long.forget(pid);
        self.rooms.forget(pid);
        if let Some(leaks) = &mut self.leaks {
            leaks.forget(pid);
        }
    }

    fn finish(&mut self) {
        self.warn();
        if let Some(leaks) = self.leaks.as_ref().filter(|leaks| leaks.leaked + leaks.untracked > 0) {
            info!(
                leaked_handles = leaks.leaked,
                untracked_handles = leaks.untracked,
                "NIXL handles of SGLang rooms never released once their room ended and their worker moved on (or \
                 their release refused), each alerted `leaked`; handles not followed for leaks (too many unreleased)"
            );
        }
        if self.rooms.late > 0 {
            debug!(
                late = self.rooms.late,
                "NIXL transfers created after their SGLang room was aborted or failed (a chunk its worker had taken \
                 before): each was the room's, no lifecycle of its own"
            );
        }
        if self.rooms.too_large > 0 {
            warn!(
                rooms = self.rooms.too_large,
                "SGLang rooms whose context (destinations, handles) did not fit what is pinned for the next agent: an \
                 agent restarted while they were live would take them over knowing nothing of what they wait on"
            );
        }
        if self.rooms.unattributed > 0 {
            warn!(
                unattributed = self.rooms.unattributed,
                "NIXL transfers no SGLang room could be told theirs (several live rooms awaited their decode rank, and the \
                 page written was none read of any room's destination: all of its pages up to 4032 with \
                 `zmq_recv_long`, else its first 16): each was followed, and counted in `seen`, as a request of its own, \
                 keyed by its handle"
            );
        }
        debug!(
            whole = self.long.whole,
            cut = self.long.cut,
            "SGLang destinations whose pages were read whole; long frames read cut short (past 4032 pages, or a \
             chunk lost): their rooms' pages read as their first 16"
        );
    }
}

impl TakeOver for Sglang {
    /// A room (what [`crate::kernel::state::KernelState::track`] kept of
    /// it), with what the previous agent knew of it: it goes on as it
    /// would have ([`Rooms::adopt`]).
    fn adopt(&mut self, request: &Restored, held: Option<&[u8]>) -> Result<Vec<AdoptedHandle>, String> {
        match room_of(request.key, request.external_id.as_deref()) {
            Some(room) => self.rooms.adopt(request.pid, room, held),
            None => Ok(Vec::new()),
        }
    }

    fn adopt_ended(&mut self, pid: u32, key: u64, held: &[u8]) -> bool {
        self.rooms.adopt_ended(pid, key, held)
    }

    fn owns(&self, pid: u32, key: u64) -> bool {
        self.rooms.owns(pid, key)
    }

    fn held(&mut self, out: &mut Vec<HandOver>) {
        self.rooms.held(out);
    }
}

#[cfg(test)]
mod tests {
    use stallwatch_common::EXT_ID_LEN;

    use super::*;
    use crate::frameworks::strings::Chunk;

    #[test]
    fn a_requests_room_and_rid_pair_up_per_thread_in_either_order_by_their_frame() {
        use crate::lifecycle::Stage;
        let mut sglang = Sglang::default();
        let rid = |r: &[u8], frame| RequestHalf::Rid { rid: r.into(), frame };
        let room = |room, frame| RequestHalf::Room { room, frame };
        assert_eq!(sglang.request(9, 10, 1, room(7, 70)), None, "waits for its rid");
        assert_eq!(sglang.request(9, 11, 2, rid(b"a", 80)), None, "another thread's");
        let started = sglang.request(9, 10, 3, rid(b"b", 70)).expect("room 7 starts");
        assert_eq!((started.key, started.stage, started.ts_ns), (7, Stage::Enqueued, 3));
        let started = sglang.request(9, 11, 4, room(8, 80)).expect("room 8 starts");
        assert_eq!(started.key, 8);
        // A half whose other never came is replaced by the next receive's.
        assert_eq!(sglang.request(9, 10, 5, room(20, 200)), None);
        assert_eq!(sglang.request(9, 10, 6, room(21, 210)), None);
        assert_eq!(sglang.request(9, 10, 7, rid(b"c", 210)).map(|o| o.key), Some(21));
        assert!(sglang.requests.is_empty());
        // A request whose room was not read (its rid alone), then the next
        // one's room and rid: the rid is never that room's.
        assert_eq!(sglang.request(9, 10, 8, rid(b"d", 300)), None);
        assert_eq!(sglang.request(9, 10, 9, room(31, 310)), None, "not request d's room");
        assert_eq!(sglang.request(9, 10, 10, rid(b"e", 310)).map(|o| o.key), Some(31));
        sglang.request(9, 12, 11, room(30, 1));
        sglang.forget(9);
        assert!(sglang.requests.is_empty());
    }

    /// The `sglang` profile's signal `name`.
    fn spec(name: &str) -> SignalSpec {
        let profile = crate::profile::Profile::load("sglang").expect("the sglang profile");
        profile.signals.into_iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no {name}"))
    }

    /// Thread `tid` of pid 1 receives `frames` as pyzmq does, each closed
    /// at `zmq_msg_close`: what `zmq_recv` reads of each (its first 64
    /// bytes, its size, type and flags) and, for a long frame with more to
    /// come, the chunks `zmq_recv_long` reads of it, up to `bound` bytes
    /// (`lengths` says the length the kernel read for it, if not its own).
    /// Returns what the last frame completes.
    fn receive(
        sglang: &mut Sglang,
        tid: u32,
        frames: &[Vec<u8>],
        bound: usize,
        lengths: &[(usize, usize)],
    ) -> Option<Observation> {
        let (recv, long) = (spec("zmq_recv"), spec("zmq_recv_long"));
        let mut observed = None;
        for (n, bytes) in frames.iter().enumerate() {
            let more = n + 1 < frames.len();
            let inline = bytes.len() <= 33;
            let kind = if inline { 101 } else { 102 };
            let head =
                u64::from_le_bytes([0, if inline { bytes.len() as u8 } else { 0 }, kind, u8::from(more), 0, 0, 0, 0]);
            // What the kernel keeps by the signal's `when`.
            let config = long.slot_config();
            if config.filter_rule.holds((head & config.filter_mask) as i64) {
                let len = lengths.iter().find(|(at, _)| *at == n).map_or(bytes.len(), |&(_, len)| len);
                let sent = &bytes[..bytes.len().min(bound)];
                let parts: Vec<&[u8]> = sent.chunks(stallwatch_common::CHUNK_LEN as usize).collect();
                for (index, part) in parts.iter().enumerate() {
                    let chunk = Chunk {
                        len: len as u32,
                        item: 0,
                        index: index as u8,
                        last: index + 1 == parts.len(),
                        text: (*part).into(),
                    };
                    let signal =
                        Signal { pid: 1, tid, ts_ns: 5, value: 0, ret: 0, capture: Captured::Chunk(chunk), tag: None };
                    assert_eq!(sglang.signal(&long, &signal), Claim::NOTHING);
                }
            }
            let mut data = [0u8; EXT_ID_LEN];
            data[..bytes.len().min(EXT_ID_LEN)].copy_from_slice(&bytes[..bytes.len().min(EXT_ID_LEN)]);
            let signal = Signal {
                pid: 1,
                tid,
                ts_ns: 5,
                value: head,
                ret: bytes.len() as i64,
                capture: Captured::Bytes(Box::new(data)),
                tag: None,
            };
            observed = sglang.signal(&recv, &signal).expect_mine("an SGLang signal");
        }
        observed
    }

    /// SGLang's destination of `room` to decode agent `d` (a uuid, a long
    /// frame), its `pages` as int32s.
    fn destination(room: u64, pages: &[u32]) -> Vec<Vec<u8>> {
        let pages = pages.iter().flat_map(|p| (*p as i32).to_le_bytes()).collect();
        let text = |t: &str| t.as_bytes().to_vec();
        vec![
            text("NixlMsgGuard"),
            text(&room.to_string()),
            text("127.0.0.1"),
            text("40001"),
            text("8c1f7d1e-5b2a-4c3d-9e8f-0a1b2c3d4e5f"),
            pages,
            text("3"),
            text("1"),
            Vec::new(),
            Vec::new(),
            text("0"),
        ]
    }

    #[test]
    fn a_destinations_pages_are_read_whole_up_to_the_bound_and_only_when_they_agree() {
        let agent = b"8c1f7d1e-5b2a-4c3d-9e8f-0a1b2c3d4e5f";
        // Pages from a free list, last first.
        let pages = |from: u32, n: u32| (from..from + n).rev().collect::<Vec<u32>>();
        // Whose a chunk writing `page` is, made on a thread of no room yet.
        let mut tid = 30;
        let mut chunk = |sglang: &mut Sglang, page| {
            tid += 1;
            sglang.rooms.creating(1, tid, agent, Some(page));
            sglang.handle(tid, handle_event(u64::from(tid), Stage::Enqueued, 6));
            sglang.rooms.attributed_room(1, u64::from(tid))
        };
        let mut sglang = Sglang::default();
        // 3000 pages: read whole.
        let started = receive(&mut sglang, 7, &destination(70, &pages(10_000, 3000)), 16_128, &[]).expect("room 70");
        assert_eq!((started.key, started.stage), (70, Stage::Enqueued));
        assert_eq!(sglang.long.whole, 1);
        // 5000 pages, past the bound: cut short, so its first 16.
        receive(&mut sglang, 7, &destination(71, &pages(20_000, 5000)), 16_128, &[]).expect("room 71");
        assert_eq!(sglang.long.cut, 1);
        // A whole frame whose length is not the frame's: not its pages.
        receive(&mut sglang, 8, &destination(72, &pages(30_000, 100)), 16_128, &[(5, 404)]).expect("room 72");
        assert_eq!(sglang.long.whole, 1);
        assert!(sglang.long.take(1, 7).is_empty() && sglang.long.take(1, 8).is_empty(), "nothing left per thread");
        // Chunks past page 16 among the three rooms to that decode: room
        // 70's by its page; the others' are nobody's, their pages unread.
        assert_eq!(chunk(&mut sglang, 10_000 + 3000 - 1 - 2000), Some(70));
        assert_eq!(chunk(&mut sglang, 10_000), Some(70), "its last page");
        assert_eq!(chunk(&mut sglang, 20_000 + 5000 - 1 - 4000), None);
        assert_eq!(chunk(&mut sglang, 30_000 + 100 - 1 - 50), None);
        assert_eq!((chunk(&mut sglang, 20_000 + 5000 - 1 - 15), sglang.rooms.unattributed), (Some(71), 2));
        // A dummy destination (frame 10 "1", no pages) starts nothing.
        let mut dummy = destination(73, &[]);
        dummy[10] = b"1".to_vec();
        assert_eq!(receive(&mut sglang, 7, &dummy, 16_128, &[]), None);
        assert!(!sglang.rooms.is_live(1, 73));
    }

    const S: u64 = 1_000_000_000;

    /// Rooms 7 and 8 to decode agent `dec` (pages 0.. and 100..), as a
    /// NIXL tracker with a 2 s timeout sees them.
    fn two_rooms() -> Sglang {
        let mut sglang = Sglang::default();
        sglang.timeout(2 * S);
        for (room, page) in [(7, 0), (8, 100)] {
            let to = Bootstrap::Destination { room, port: 9000, agent: "dec".into(), ranks: 1, pages: [page].into() };
            sglang.rooms.observe(1, 1, &to).expect("a room");
        }
        sglang
    }

    fn handle_event(key: u64, stage: Stage, ts_ns: u64) -> Observation {
        Observation { pid: 1, key, stage, ts_ns, external_id: None, ends: None }
    }

    /// Thread 10 creates handle `key` writing `page` (a KV chunk) or none
    /// (an aux transfer) to `dec`.
    fn create(sglang: &mut Sglang, key: u64, page: Option<u32>, ts_ns: u64) -> Option<Observation> {
        sglang.rooms.creating(1, 10, b"dec", page);
        sglang.handle(10, handle_event(key, Stage::Enqueued, ts_ns))
    }

    #[test]
    fn a_rooms_handle_its_worker_left_behind_unreleased_leaks_once_naming_room_and_peer() {
        let mut sglang = two_rooms();
        assert_eq!(create(&mut sglang, 0xa, Some(0), S), None, "room 7's chunk");
        let done = Observation {
            ends: Some(crate::lifecycle::Outcome::Completed),
            ..handle_event(0xa, Stage::TransferDone, S)
        };
        assert_eq!(sglang.handle(10, done).map(|o| (o.key, o.stage)), Some((7, Stage::TransferPosted)));
        sglang.rooms.observe(1, 2 * S, &Bootstrap::Status { room: 7, status: 4 }).expect("room 7 released");
        // Idle: its last handle stays with the worker, no leak.
        sglang.expire(10 * S);
        assert_eq!((sglang.pending(), sglang.next_expiry()), (None, None));
        // The worker takes room 8's chunk without releasing 0xa.
        assert_eq!(create(&mut sglang, 0xb, Some(100), 11 * S), None, "room 8's");
        assert_eq!(sglang.next_expiry(), Some(13 * S));
        sglang.expire(13 * S);
        let leak: Vec<_> = std::iter::from_fn(|| sglang.pending()).map(|o| (o.key, o.stage, o.ends)).collect();
        let leaked = Some(crate::lifecycle::Outcome::Leaked);
        assert_eq!(leak, [(0xa, Stage::TransferDone, None), (0xa, Stage::TransferDone, leaked)]);
        let snapshot = RequestSnapshot {
            pid: 1,
            key: 0xa,
            external_id: None,
            stage: Stage::TransferDone,
            stage_ns: [None; 4],
            first_ns: S,
            last_ns: S,
            stalled: None,
            inferred: Default::default(),
        };
        let context = sglang.context(&snapshot);
        let field = |name: &str| context.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str());
        assert_eq!(
            ["leaked", "handle", "room", "peer", "release"].map(field),
            [Some("handle"), Some("0xa"), Some("7"), Some("dec"), Some("never")]
        );
        sglang.expire(100 * S);
        assert_eq!(sglang.pending(), None, "once");
    }

    #[test]
    fn a_failed_transfer_released_fails_its_room_and_the_releases_return_is_nobodys() {
        let mut sglang = two_rooms();
        create(&mut sglang, 0xa, Some(0), S);
        assert_eq!(sglang.handle(10, handle_event(0xa, Stage::TransferPosted, S + 1)).map(|o| o.key), Some(7));
        // Released soon after its last poll answered an error: the status
        // read at the release's entry says failed.
        let failed = sglang.handle(10, handle_event(0xa, Stage::Failed, S + 2)).expect("room 7 fails");
        assert_eq!((failed.key, failed.stage), (7, Stage::Failed));
        // The release's return (NIXL released it) is the tracker's.
        assert_eq!(sglang.handle(10, handle_event(0xa, Stage::Released, S + 3)), None);
        // A release NIXL refused is no event of anybody's either.
        create(&mut sglang, 0xb, Some(100), 2 * S);
        assert_eq!(sglang.handle(10, handle_event(0xb, Stage::Released, 3 * S)), None, "room 8 goes on");
        assert_eq!(sglang.handle(10, handle_event(0xb, Stage::TransferPosted, 3 * S + 1)), None, "refused");
        assert_eq!(sglang.next_expiry(), Some(5 * S + 1));
    }
}
