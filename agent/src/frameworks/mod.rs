//! What follows a serving framework's own protocol: each framework is a
//! folder here behind one small interface, [`Framework`]: signals in, its
//! requests' lifecycle observations and their context out. [`signals`]
//! routes every signal hit to them; [`zmq`] reassembles the ZMQ messages
//! that several frameworks' control planes speak.
//!
//! Adding a framework adds a folder and one line in [`all`]; it touches no
//! other framework.
pub mod sglang;
pub mod signals;
pub mod strings;
pub mod vllm;
pub mod zmq;

use self::signals::Signal;
use crate::{
    lifecycle::{Observation, RequestSnapshot, Restored, Side, Silent, StageRead},
    profile::SignalSpec,
};

/// A serving framework's tracker. It sees every signal hit and every
/// probe's lifecycle event of the watched processes, and may make requests
/// of its own from them (an SGLang room, from its bootstrap messages and
/// the NIXL handles that move its KV).
pub trait Framework {
    /// A signal hit, read as `spec` says: `None` if it is not one of this
    /// framework's signals, else the observation it completes, if any.
    fn signal(&mut self, spec: &SignalSpec, signal: &Signal) -> Option<Option<Observation>>;

    /// A probe's lifecycle event seen on thread `tid`: returned as it is,
    /// made an event of one of this framework's requests, or taken (`None`)
    /// when it is part of a request that ended.
    fn handle(&mut self, tid: u32, observation: Observation) -> Option<Observation>;

    /// Follow again a request a previous agent followed, if it is this
    /// framework's.
    fn adopt(&mut self, request: &Restored);

    /// Which side of the transfer `pid` serves, as its traffic tells.
    fn side(&self, pid: u32) -> Side;

    /// What an alert of `request` says besides its lifecycle (nothing for
    /// a request that is not this framework's).
    fn context(&self, request: &RequestSnapshot) -> Vec<(&'static str, String)>;

    /// What the target's memory says of a silent request this framework
    /// reads its own way (`read` reads one handle's status); `None` for a
    /// request that is not its own.
    fn read(
        &mut self,
        silent: &Silent,
        read: &mut dyn FnMut(&Silent) -> Option<StageRead>,
    ) -> Option<Option<StageRead>>;

    /// The transfer handle `request` is stalled on, if it is this
    /// framework's request (`Some(None)`: its, with no transfer).
    fn stalled_transfer(&self, request: &RequestSnapshot) -> Option<Option<u64>>;

    /// One warning for what could not be read since the last one (called
    /// once per counter period).
    fn warn(&mut self);

    /// The process is gone: what it was in the middle of goes with it.
    fn forget(&mut self, pid: u32);

    /// At exit: what it could not do, said once.
    fn finish(&mut self);

    /// Another observation of the signal or event just handled (one
    /// heartbeat names several requests), in order; `None` once there is
    /// none.
    fn pending(&mut self) -> Option<Observation> {
        None
    }
}

/// Every framework stallwatch follows.
pub fn all() -> Vec<Box<dyn Framework>> {
    vec![Box::new(sglang::Sglang::default()), Box::new(vllm::Vllm::default())]
}
