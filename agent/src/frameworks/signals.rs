//! Signals: probe hits that are not lifecycle events (a profile's
//! `[[signal]]` tables). The kernel hands them over as events of stage
//! [`stage::SIGNAL`] without tracking them; here each one is named by its
//! slot's spec and offered to the serving frameworks ([`super::Framework`]),
//! never to the lifecycle engine directly: a framework turns what it reads
//! into its requests' lifecycle observations. `nixl_remote_agent`
//! (createXferReq) and `nixl_dlist_remote_agent` (makeXferReq) also name the
//! peer of the NIXL transfer a thread creates, so [`crate::evidence::peers`]
//! knows every handle's peer, for the verdict per peer. A signal no one
//! takes is only logged (`STALLWATCH_LOG=debug`), which is how a profile
//! author checks what a signal reads.
use std::{collections::HashMap, sync::Arc};

use stallwatch_common::{EXT_ID_LEN, Event, event_flags, stage};
use tracing::{debug, info};

use super::{Framework, HandOver};
use crate::{
    evidence::peers::{PeerCompletions, Peers},
    kernel::{Role, Slot},
    lifecycle::{Observation, RequestSnapshot, Restored, Side, Silent, StageRead},
    profile::{Profile, SignalSpec},
    util::{lineage::Lineage, text},
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
    /// Which of a `pickle` capture's tags the pickle matched (its records
    /// only).
    pub tag: Option<u8>,
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
    /// One chunk of a string a signal's `strings` walk found
    /// ([`super::strings`] puts them together).
    Chunk(super::strings::Chunk),
}

impl Signal {
    pub fn of(event: &Event) -> Self {
        let capture = if event.flags & event_flags::HAS_EXT == 0 {
            Captured::None
        } else if event.flags & event_flags::CHUNK != 0 {
            Captured::Chunk(super::strings::Chunk::of(event))
        } else if event.flags & event_flags::EXT_BYTES != 0 {
            Captured::Bytes(Box::new(event.ext))
        } else {
            let len = event.ext.iter().position(|&b| b == 0).unwrap_or(EXT_ID_LEN);
            Captured::Text(event.ext[..len].into())
        };
        let tag = (event.flags >> event_flags::PICKLE_TAG.trailing_zeros()) & 0b11;
        let tag = (tag != 0).then(|| tag.trailing_zeros() as u8);
        Self { pid: event.pid, tid: event.tid, ts_ns: event.ts_ns, value: event.key, ret: event.ret, capture, tag }
    }
}

/// Whether an event is a signal rather than a lifecycle event.
pub fn is_signal(event: &Event) -> bool {
    event.stage == stage::SIGNAL
}

/// The signals that name the peer of the NIXL transfer a thread creates.
const PEER_SIGNALS: [&str; 3] = ["nixl_remote_agent", "nixl_dlist_remote_agent", "vllm_read"];

/// Hands each signal to the framework it belongs to, and each handle's
/// event to its peer's count.
pub struct Signals {
    /// Signals whose slot is no signal of their process any more (a
    /// previous agent's probes, read after a restart, or a process gone):
    /// their meaning is unknown, so they are dropped, counted.
    pub unrouted: u64,
    peers: Peers,
    frameworks: Vec<Box<dyn Framework>>,
    /// Of each watched process, the frameworks that follow its profile's
    /// signals ([`Framework::follows`]), by place in `frameworks`: only
    /// they hear of its events and answer for its requests (a room a
    /// previous agent followed is adopted by its own backend's tracker
    /// only, an SGLang room on Mooncake is judged by the Mooncake one).
    following: HashMap<u32, Vec<usize>>,
    /// Every place in `frameworks`: those of a process never attached.
    all: Vec<usize>,
}

/// The places of the frameworks that follow `pid` ([`Signals::following`]).
fn of<'a>(following: &'a HashMap<u32, Vec<usize>>, all: &'a [usize], pid: u32) -> &'a [usize] {
    following.get(&pid).map_or(all, Vec::as_slice)
}

impl Signals {
    /// `timeout_ns`: the stall timeout, how far back peers' completions
    /// are needed. Every framework stallwatch knows, each following the
    /// processes whose profile has its signals ([`Signals::attached`]).
    pub fn new(timeout_ns: u64) -> Self {
        Self::with(timeout_ns, super::all())
    }

    /// With these frameworks only.
    pub fn with(timeout_ns: u64, mut frameworks: Vec<Box<dyn Framework>>) -> Self {
        for framework in &mut frameworks {
            framework.timeout(timeout_ns);
        }
        let all = (0..frameworks.len()).collect();
        Self { unrouted: 0, peers: Peers::new(timeout_ns), frameworks, following: HashMap::new(), all }
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
        let peer = PEER_SIGNALS.contains(&spec.name.as_str());
        if let (true, Captured::Text(agent)) = (peer, &signal.capture) {
            self.peers.creating(signal.pid, signal.tid, agent);
        }
        for &at in of(&self.following, &self.all, signal.pid) {
            let framework = &mut self.frameworks[at];
            if let Some(observation) = framework.signal(&spec, &signal) {
                if let Some((pid, key, peer)) = framework.started_transfer() {
                    self.peers.started(pid, key, &peer);
                }
                return observation;
            }
        }
        if !peer {
            log(&spec, &signal);
        }
        None
    }

    /// What the engine gets of `event`: a signal's observation, if it
    /// completes one ([`Signals::route`]); a probe's lifecycle event
    /// (`observation`), unless a framework makes it one of its requests'
    /// ([`Framework::handle`]); every handle's event counts for its peer
    /// first ([`Peers::observe`]).
    pub fn consume(
        &mut self,
        event: &Event,
        observation: Option<Observation>,
        slot: Option<&Slot>,
    ) -> Option<Observation> {
        match observation {
            Some(observation) => {
                self.peers.observe(event.tid, &observation);
                let frameworks = &mut self.frameworks;
                of(&self.following, &self.all, observation.pid)
                    .iter()
                    .try_fold(observation, |observation, &at| frameworks[at].handle(event.tid, observation))
            }
            None => self.route(event, slot),
        }
    }

    /// Follow again a request a previous agent followed (what
    /// [`crate::kernel::state::KernelState::track`] kept of it), if it is a
    /// framework's, with what that agent handed over of it (`held`): the
    /// handles that are part of it are its own again, each with its peer.
    /// `Err`: `held` did not read (why); the request is followed knowing
    /// nothing of it.
    pub fn adopt(&mut self, request: &Restored, held: Option<&[u8]>) -> Result<(), String> {
        let mut result = Ok(());
        for &at in of(&self.following, &self.all, request.pid) {
            match self.frameworks[at].adopt(request, held) {
                Ok(handles) => {
                    for handle in handles {
                        self.peers.adopt(request.pid, handle.key, handle.peer.as_deref(), handle.posted);
                    }
                }
                Err(why) => result = Err(why),
            }
        }
        result
    }

    /// What is left of a framework's request that ended while a previous
    /// agent followed it ([`Framework::adopt_ended`]); `false` for a
    /// context no framework takes (stale).
    pub fn adopt_ended(&mut self, pid: u32, key: u64, held: &[u8]) -> bool {
        let frameworks = &mut self.frameworks;
        of(&self.following, &self.all, pid).iter().any(|&at| frameworks[at].adopt_ended(pid, key, held))
    }

    /// Whether the probes' lifecycle (`pid`, `key`) is part of a
    /// framework's request ([`Framework::owns`]).
    pub fn owns(&self, pid: u32, key: u64) -> bool {
        self.each(pid).any(|framework| framework.owns(pid, key))
    }

    /// What changed of the frameworks' requests since the last call, for
    /// the next agent ([`Framework::held`]).
    pub fn held(&mut self) -> Vec<HandOver> {
        let mut out = Vec::new();
        for framework in &mut self.frameworks {
            framework.held(&mut out);
        }
        out
    }

    /// Which side of the transfer `pid` serves, as its frameworks' traffic
    /// tells (a prefill unless one says decode).
    pub fn side(&self, pid: u32) -> Side {
        let decode = self.each(pid).any(|framework| framework.side(pid) == Side::Decode);
        if decode { Side::Decode } else { Side::Prefill }
    }

    /// What an alert of `request` says besides its lifecycle.
    pub fn context(&self, request: &RequestSnapshot) -> Vec<(&'static str, String)> {
        self.each(request.pid).flat_map(|framework| framework.context(request)).collect()
    }

    /// What the target's memory says of a silent request a framework reads
    /// its own way (a room, from its handles); `None` for one whose own
    /// memory `read` reads.
    pub fn read_room(
        &mut self,
        silent: &Silent,
        read: &mut dyn FnMut(&Silent) -> Option<StageRead>,
    ) -> Option<Option<StageRead>> {
        let frameworks = &mut self.frameworks;
        of(&self.following, &self.all, silent.pid).iter().find_map(|&at| frameworks[at].read(silent, read))
    }

    /// What the peer of `request`'s stalled transfer, and the other peers
    /// of its process, completed since its last event: the transfer is the
    /// request's own handle, or the one a framework says it is stalled on
    /// ([`Framework::stalled_transfer`]), or, for one with none of its own
    /// out, the transfer it waits behind ([`Framework::queued_behind`]: a
    /// worker-wide stall names the peer its worker is stuck on). `None`
    /// when that transfer's peer is unknown.
    pub fn peer_completions(&self, request: &RequestSnapshot) -> Option<PeerCompletions> {
        let handle = match self.stalled_transfer(request) {
            Some(Some(handle)) => handle,
            Some(None) => self.each(request.pid).find_map(|framework| framework.queued_behind(request))?,
            None => request.key,
        };
        self.peers.since(request.pid, handle, request.last_ns)
    }

    /// The transfer handle `request` is stalled on, if a framework follows
    /// it ([`Framework::stalled_transfer`]; `Some(None)`: its, with no
    /// transfer of its own out), `None` for a request no framework follows.
    pub fn stalled_transfer(&self, request: &RequestSnapshot) -> Option<Option<u64>> {
        self.each(request.pid).find_map(|framework| framework.stalled_transfer(request))
    }

    /// One warning for what could not be read since the last one (called
    /// once per counter period, never per message).
    pub fn warn(&mut self) {
        for framework in &mut self.frameworks {
            framework.warn();
        }
    }

    /// The process is gone: what it was in the middle of goes with it.
    pub fn forget(&mut self, pid: u32) {
        self.peers.forget(pid);
        self.following.remove(&pid);
        for framework in &mut self.frameworks {
            framework.forget(pid);
        }
    }

    /// The next observation a framework made of the record just routed
    /// besides the one [`Signals::consume`] returned ([`Framework::pending`]).
    pub fn pending(&mut self) -> Option<Observation> {
        self.frameworks.iter_mut().find_map(|framework| framework.pending())
    }

    /// The frameworks that follow `pid`, in order.
    fn each(&self, pid: u32) -> impl Iterator<Item = &dyn Framework> {
        of(&self.following, &self.all, pid).iter().map(|&at| &*self.frameworks[at])
    }

    /// Process `pid` is watched from now, with `profile`: the frameworks
    /// whose signals it has follow it ([`Framework::attached`]).
    pub fn attached(&mut self, pid: u32, lineage: &Lineage, profile: &Profile) {
        let following: Vec<usize> =
            (0..self.frameworks.len()).filter(|&at| self.frameworks[at].follows(profile)).collect();
        for &at in &following {
            self.frameworks[at].attached(pid, lineage);
        }
        self.following.insert(pid, following);
    }

    /// What the frameworks end on their own by `now_ns`
    /// ([`Framework::expire`]), taken with [`Signals::pending`].
    pub fn expire(&mut self, now_ns: u64) {
        for framework in &mut self.frameworks {
            framework.expire(now_ns);
        }
    }

    /// When a framework next ends one on its own.
    pub fn next_expiry(&self) -> Option<u64> {
        self.frameworks.iter().filter_map(|framework| framework.next_expiry()).min()
    }

    /// At exit: what could not be routed or read, if anything.
    pub fn finish(&mut self) {
        for framework in &mut self.frameworks {
            framework.finish();
        }
        if self.unrouted > 0 {
            info!(
                unrouted = self.unrouted,
                "signals of probes no longer attached were dropped (their meaning is unknown)"
            );
        }
    }
}

/// A signal no framework took, for the profile's author.
fn log(spec: &SignalSpec, signal: &Signal) {
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

/// A capture for a log line: text quoted, bytes in hex.
struct Shown<'a>(&'a Captured);

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Captured::None => f.write_str("none"),
            Captured::Text(bytes) => f.write_str(&text::value(&String::from_utf8_lossy(bytes))),
            Captured::Bytes(bytes) => bytes.iter().try_for_each(|b| write!(f, "{b:02x}")),
            Captured::Chunk(chunk) => write!(
                f,
                "string {} chunk {} of {} bytes: {}",
                chunk.item,
                chunk.index,
                chunk.len,
                text::value(&String::from_utf8_lossy(&chunk.text))
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        frameworks::sglang::{Bootstrap, Sglang},
        profile::resolve::FirstInsn,
    };

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
        // Room 7 awaits its KV at decode-0.
        let mut sglang = Sglang::default();
        sglang
            .rooms_mut()
            .observe(
                9,
                1,
                &Bootstrap::Destination {
                    room: 7,
                    port: 1,
                    agent: "decode-0".into(),
                    ranks: 1,
                    pages: Default::default(),
                },
            )
            .expect("room 7");
        // Room 8, to decode-2 on the same port (so the same transfer
        // worker: SGLang's sum of ports % 4), answered, queued behind it.
        sglang
            .rooms_mut()
            .observe(
                9,
                2,
                &Bootstrap::Destination {
                    room: 8,
                    port: 1,
                    agent: "decode-2".into(),
                    ranks: 1,
                    pages: Default::default(),
                },
            )
            .expect("room 8");
        let mut signals = Signals::with(1_000_000_000, vec![Box::new(sglang)]);
        // Every handle event comes on thread 10 of pid 9.
        let on_thread = event(0, b"");
        let handle = |key, stage, ts_ns| Observation { pid: 9, key, stage, ts_ns, external_id: None, ends: None };
        let consume = |signals: &mut Signals, key, stage, ts_ns| {
            signals.consume(&on_thread, Some(handle(key, stage, ts_ns)), None)
        };
        // The built-in profile's `nixl_remote_agent` signal, as its slot
        // delivers it: both the room tracker and the peers hear of it.
        let spec = Profile::load("sglang")
            .expect("the sglang profile")
            .signals
            .into_iter()
            .find(|spec| spec.name == "nixl_remote_agent")
            .expect("its nixl_remote_agent signal");
        let slot = Slot {
            pid: 9,
            role: Role::Signal(Arc::new(spec)),
            symbol: String::new(),
            object: std::path::PathBuf::new(),
            file_offset: 0,
            first_insn: FirstInsn::Push,
        };
        let name = |signals: &mut Signals, agent: &[u8]| {
            assert_eq!(signals.route(&event(event_flags::HAS_EXT, agent), Some(&slot)), None);
        };
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
        // A room with no transfer of its own, queued on its worker behind
        // room 7's hung one: judged by that transfer's peer (the one its
        // worker is stuck on), as its alert says it is `behind` room 7.
        assert_eq!(
            signals.context(&stalled(8, Some("8"), 25)),
            [("answered", "1/1".to_owned()), ("behind", "7".to_owned()), ("waiting_on", "worker".to_owned())]
        );
        assert_eq!(of(stalled(8, Some("8"), 25)), Some(("decode-0".into(), 0, 1)), "queued behind room 7");
        assert_eq!(of(stalled(6, Some("6"), 25)), None, "no such room");

        // The next agent, handed what this one knew: room 7's hung handle
        // is its own again, with its peer; the others' are not.
        let mut held = signals.held();
        held.sort_by_key(|h| h.key);
        // (Room 8 is handed over too: its context, queued behind room 7.)
        let [HandOver { pid: 9, key: 7, context: Some(context) }, HandOver { pid: 9, key: 8, .. }] = &held[..] else {
            panic!("{held:?}")
        };
        assert!(signals.held().is_empty(), "handed over once");
        let mut next = Signals::with(1_000_000_000, vec![Box::new(Sglang::default())]);
        let sglang = Profile::load("sglang").expect("the sglang profile");
        next.attached(9, &Lineage(Vec::new()), &sglang);
        let restored = |key, external_id: Option<&str>| Restored {
            pid: 9,
            key,
            stage: Stage::TransferPosted,
            ended: false,
            stage_ns: [Some(10), Some(20), None],
            first_ns: 10,
            last_ns: 20,
            external_id: external_id.map(Into::into),
            alerted_ns: None,
        };
        assert_eq!(next.adopt(&restored(7, Some("7")), Some(context)), Ok(()));
        assert!(next.owns(9, 0xa0) && !next.owns(9, 0xc0) && !next.owns(9, 7));
        assert_eq!(next.adopt(&restored(0xc0, None), None), Ok(()), "no room's: nothing to adopt");
        let of = |request| next.peer_completions(&request).map(|p| (p.peer.to_string(), p.to_peer, p.to_others));
        assert_eq!(of(stalled(7, Some("7"), 20)), Some(("decode-0".into(), 0, 0)), "its peer; no completion seen yet");
        assert_eq!(
            next.context(&stalled(7, Some("7"), 20)),
            [("handle", "0xa0".to_owned()), ("transfer", "1".to_owned())]
        );
        let mut other = Signals::with(1, vec![Box::new(Sglang::default())]);
        other.attached(9, &Lineage(Vec::new()), &sglang);
        let err = other.adopt(&restored(8, Some("8")), Some(b"\x01"));
        assert!(err.is_err_and(|why| why.contains("cut short")));
        // A process of a profile without the framework's signals: what a
        // previous agent knew of it is none of that framework's.
        let mut nixl = Signals::with(1, vec![Box::new(Sglang::default())]);
        nixl.attached(9, &Lineage(Vec::new()), &Profile::load("nixl").expect("the nixl profile"));
        assert_eq!(nixl.adopt(&restored(8, Some("8")), Some(b"\x01")), Ok(()), "not read at all");
    }

    #[test]
    fn signals_of_slots_not_attached_as_signals_are_dropped_counted() {
        let mut signals = Signals::new(1_000_000_000);
        assert_eq!(signals.route(&event(0, b""), None), None);
        assert_eq!(signals.unrouted, 1);
    }
}
