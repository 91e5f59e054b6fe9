//! Signals: probe hits that are not lifecycle events (a profile's
//! `[[signal]]` tables). The kernel hands them over as events of stage
//! [`stage::SIGNAL`] without tracking them; here each one is named by its
//! slot's spec and offered to the serving frameworks ([`super::Framework`]),
//! never to the lifecycle engine directly: a framework turns what it reads
//! into its requests' lifecycle observations. A signal whose spec says
//! `peer = true` (NIXL's `createXferReq` and `makeXferReq`) also names the
//! peer of the transfer its thread creates, so [`crate::evidence::peers`]
//! knows every handle's peer, for the verdict per peer. A signal no one
//! takes is only logged (`STALLWATCH_LOG=debug`), which is how a profile
//! author checks what a signal reads. The router also owns the take-over
//! of what the kernel's table holds ([`takeover`]).
mod takeover;

use std::{collections::HashMap, sync::Arc};

use stallwatch_common::{EXT_ID_LEN, Event, event_flags, stage};
use tracing::{debug, info};

pub use self::takeover::TakenOver;
use super::{Claim, Framework, HandOver};
use crate::{
    evidence::peers::{PeerCompletions, Peers},
    kernel::{Role, Slot},
    lifecycle::{Context, Observation, RequestSnapshot, Side, Silent, StageRead},
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
        if let (true, Captured::Text(agent)) = (spec.peer, &signal.capture) {
            self.peers.creating(signal.pid, signal.tid, agent);
        }
        for &at in of(&self.following, &self.all, signal.pid) {
            let framework = &mut self.frameworks[at];
            if let Claim::Mine(observation) = framework.signal(&spec, &signal) {
                if let Some((pid, key, peer)) = framework.started_transfer() {
                    self.peers.started(pid, key, &peer);
                }
                return observation;
            }
        }
        if !spec.peer {
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

    /// What changed of the frameworks' requests since the last call, for
    /// the next agent ([`TakeOver::held`](super::TakeOver::held)).
    pub fn held(&mut self) -> Vec<HandOver> {
        let mut out = Vec::new();
        for take_over in self.frameworks.iter_mut().filter_map(|framework| framework.take_over()) {
            take_over.held(&mut out);
        }
        out
    }

    /// Which side of the transfer `pid` serves, as its frameworks' traffic
    /// tells (a prefill unless one says decode).
    pub fn side(&self, pid: u32) -> Side {
        let decode = self.each(pid).any(|framework| framework.side(pid) == Side::Decode);
        if decode { Side::Decode } else { Side::Prefill }
    }

    /// What the frameworks that follow `request` say of it besides its
    /// lifecycle, each in its own name.
    pub fn context(&self, request: &RequestSnapshot) -> Context {
        let mut context = Context::default();
        for framework in self.each(request.pid) {
            let mut said = Context::said_by(framework.name(), framework.context(request));
            said.native = framework.native(request);
            context.extend(said);
        }
        context
    }

    /// What the target's memory says of a silent request a framework reads
    /// its own way (a room, from its handles); [`Claim::NotMine`] for one
    /// whose own memory `read` reads.
    pub fn read_own(
        &mut self,
        silent: &Silent,
        read: &mut dyn FnMut(&Silent) -> Option<StageRead>,
    ) -> Claim<StageRead> {
        let frameworks = &mut self.frameworks;
        of(&self.following, &self.all, silent.pid)
            .iter()
            .map(|&at| frameworks[at].read(silent, read))
            .find(|claim| matches!(claim, Claim::Mine(_)))
            .unwrap_or(Claim::NotMine)
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
            Claim::Mine(Some(handle)) => handle,
            Claim::Mine(None) => self.each(request.pid).find_map(|framework| framework.queued_behind(request))?,
            Claim::NotMine => request.key,
        };
        self.peers.since(request.pid, handle, request.last_ns)
    }

    /// The transfer handle `request` is stalled on, if a framework follows
    /// it ([`Framework::stalled_transfer`]; `Mine(None)`: its, with no
    /// transfer of its own out).
    pub fn stalled_transfer(&self, request: &RequestSnapshot) -> Claim<u64> {
        self.each(request.pid)
            .map(|framework| framework.stalled_transfer(request))
            .find(|claim| matches!(claim, Claim::Mine(_)))
            .unwrap_or(Claim::NotMine)
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
mod tests;
