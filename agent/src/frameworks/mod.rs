//! What follows a serving framework's own protocol: each framework is a
//! folder here behind one small interface, [`Framework`]: signals in, its
//! requests' lifecycle observations and their context out, and, where a
//! next agent takes its requests over, [`TakeOver`]. [`signals`] routes
//! every signal hit to them and owns the take-over; [`zmq`] reassembles
//! the ZMQ messages that several frameworks' control planes speak.
//!
//! Adding a framework adds a folder and one line in [`all`]; it touches no
//! other framework.
pub mod sglang;
pub mod sglang_mooncake;
pub mod signals;
pub mod strings;
pub mod vllm;
pub mod zmq;

use self::signals::Signal;
use crate::{
    lifecycle::{Observation, RequestSnapshot, Restored, Side, Silent, StageRead},
    profile::{Profile, SignalSpec},
    util::lineage::Lineage,
};

/// A framework's answer about a signal or a request: not its own, or its
/// own with what it makes of it, if anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim<T> {
    /// Another framework's, or none's.
    NotMine,
    /// Its own; what it makes of it (`None`: nothing, or nothing yet).
    Mine(Option<T>),
}

impl<T> Claim<T> {
    /// Its own, with nothing to tell.
    pub const NOTHING: Self = Self::Mine(None);

    /// What its framework made of it, which must be one's.
    #[cfg(test)]
    pub fn expect_mine(self, what: &str) -> Option<T> {
        match self {
            Self::NotMine => panic!("{what}: not the framework's"),
            Self::Mine(made) => made,
        }
    }
}

/// A serving framework's tracker. It sees every signal hit and every
/// probe's lifecycle event of the processes whose profile it follows
/// ([`Framework::follows`]), and may make requests of its own from them
/// (an SGLang room, from its bootstrap messages and the NIXL handles that
/// move its KV). What a next agent takes over of its requests is a
/// capability of its own ([`TakeOver`]).
pub trait Framework {
    /// Its name: the scope of what it says of its requests
    /// ([`crate::lifecycle::Field::scope`]), so a span names a field
    /// `stallwatch.<name>.<field>`.
    fn name(&self) -> &'static str;

    /// Whether a process watched under `profile` is this framework's to
    /// follow (the profile has its signals).
    fn follows(&self, profile: &Profile) -> bool;

    /// A signal hit, read as `spec` says: the observation it completes,
    /// if it is one of this framework's signals and completes one.
    fn signal(&mut self, spec: &SignalSpec, signal: &Signal) -> Claim<Observation>;

    /// A probe's lifecycle event seen on thread `tid`: returned as it is,
    /// made an event of one of this framework's requests, or taken (`None`)
    /// when it is part of a request that ended.
    fn handle(&mut self, tid: u32, observation: Observation) -> Option<Observation>;

    /// Which side of the transfer `pid` serves, as its traffic tells.
    fn side(&self, pid: u32) -> Side;

    /// What an alert of `request` says besides its lifecycle (nothing for
    /// a request that is not this framework's).
    fn context(&self, request: &RequestSnapshot) -> Vec<(&'static str, String)>;

    /// What the spans of `request` carry under the framework's own names,
    /// so they and its own spans are found by one query
    /// ([`crate::lifecycle::Context::native`]). Nothing by default.
    fn native(&self, _request: &RequestSnapshot) -> Vec<(&'static str, i64)> {
        Vec::new()
    }

    /// What the target's memory says of a silent request of this
    /// framework's, read its own way (`read` reads one handle's status).
    /// Not its own: [`Claim::NotMine`], read as a handle.
    fn read(&mut self, silent: &Silent, read: &mut dyn FnMut(&Silent) -> Option<StageRead>) -> Claim<StageRead>;

    /// The transfer handle `request` is stalled on, if it is this
    /// framework's request (`Mine(None)`: its, with no transfer out).
    fn stalled_transfer(&self, request: &RequestSnapshot) -> Claim<u64>;

    /// The transfer a request of this framework with none of its own out
    /// waits behind, if it does (an SGLang room queued on its transfer
    /// worker behind another room's hung transfer: that transfer), so its
    /// stall is judged by that transfer's peer, the one the worker is stuck
    /// on, rather than with no peer at all. None by default.
    fn queued_behind(&self, _request: &RequestSnapshot) -> Option<u64> {
        None
    }

    /// The process is gone: what it was in the middle of goes with it.
    fn forget(&mut self, pid: u32);

    /// What a next agent takes over of this framework's requests, if it
    /// hands any over. None by default.
    fn take_over(&mut self) -> Option<&mut dyn TakeOver> {
        None
    }

    /// One warning for what could not be read since the last one (called
    /// once per counter period). Nothing by default.
    fn warn(&mut self) {}

    /// At exit: what it could not do, said once. Nothing by default.
    fn finish(&mut self) {}

    /// An observation made besides the one [`Framework::handle`] or
    /// [`Framework::signal`] returned (a Mooncake batch whose free was
    /// refused fails its room and is a lifecycle of its own, a leak):
    /// taken after each event until `None`.
    fn pending(&mut self) -> Option<Observation> {
        None
    }

    /// The transfer the signal just handed to [`Framework::signal`]
    /// started, with its peer, where the framework tells the peer from its
    /// own traffic rather than a signal naming it (a Mooncake batch: its
    /// segment's session): `(pid, transfer key, peer)`, so
    /// [`crate::evidence::peers`] counts that transfer's completion for
    /// its peer. Taken once, after each signal the framework took.
    fn started_transfer(&mut self) -> Option<(u32, u64, Box<str>)> {
        None
    }

    /// The agent's stall timeout, told once before anything is observed:
    /// for a framework that judges by it (a transfer left unreleased that
    /// long is a leak). Nothing by default.
    fn timeout(&mut self, _timeout_ns: u64) {}

    /// Process `pid` is watched from now; `lineage` is its command line
    /// and its ancestors', for a framework whose configuration is there
    /// (vLLM's KV lease). Nothing by default.
    fn attached(&mut self, _pid: u32, _lineage: &Lineage) {}

    /// Requests the framework ends on its own judgement by `now_ns` (a
    /// lease that ran out): each an observation for
    /// [`Framework::pending`]. Nothing by default.
    fn expire(&mut self, _now_ns: u64) {}

    /// When [`Framework::expire`] next has one to end, for the event loop
    /// to wake then.
    fn next_expiry(&self) -> Option<u64> {
        None
    }
}

/// A framework whose requests a next agent takes over: what it knew of
/// them is pinned for that agent ([`HandOver`]), which adopts them, and
/// the probes' lifecycles that are parts of them are its own, never
/// requests of their own.
pub trait TakeOver {
    /// Follow again a request a previous agent followed, if it is this
    /// framework's, with what that agent handed over of it ([`HandOver`]),
    /// if anything: the transfer handles that are part of it (each then
    /// [`TakeOver::owns`]), or why `held` does not read (the request is
    /// then followed knowing nothing of it).
    fn adopt(&mut self, request: &Restored, held: Option<&[u8]>) -> Result<Vec<AdoptedHandle>, String>;

    /// What is left of a request of this framework that ended while a
    /// previous agent followed it (`held`, handed over under (`pid`,
    /// `key`)): its parts still in flight, which are then its
    /// ([`TakeOver::owns`]). `false`: `held` is no such thing.
    fn adopt_ended(&mut self, pid: u32, key: u64, held: &[u8]) -> bool;

    /// Whether the probes' lifecycle (`pid`, `key`) is part of one of this
    /// framework's requests (an SGLang room's NIXL handle): never a request
    /// of its own, also when taken over from the kernel's table.
    fn owns(&self, pid: u32, key: u64) -> bool;

    /// What changed of its requests since the last call, for the next
    /// agent: each request's context, at most once a call.
    fn held(&mut self, out: &mut Vec<HandOver>);
}

/// What a framework hands the next agent of one of its requests (`pid`,
/// `key`): its context, in bytes the framework reads back
/// ([`TakeOver::adopt`]); `None` once it is no longer held (it ended).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandOver {
    pub pid: u32,
    pub key: u64,
    pub context: Option<Vec<u8>>,
}

/// A transfer handle that is part of a request taken over with its
/// context: its key, its peer (the remote agent it writes to) if known,
/// and whether it was posted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdoptedHandle {
    pub key: u64,
    pub peer: Option<Box<str>>,
    pub posted: bool,
}

/// Every framework stallwatch follows.
pub fn all() -> Vec<Box<dyn Framework>> {
    vec![
        Box::new(sglang::Sglang::default()),
        Box::new(sglang_mooncake::SglangMooncake::default()),
        Box::new(vllm::Vllm::default()),
    ]
}
