//! The router's side of a take-over: the requests the kernel's in-flight
//! table holds (a previous agent's, or begun while none ran, or read again
//! after lost events) sorted between the frameworks that take over their
//! own ([`TakeOver`]) and the engine, which follows the rest. The session
//! knows no framework's requests: it hands the table here and gets back
//! what the engine is to follow.
use std::collections::HashMap;

use tracing::warn;

use super::{Signals, of};
use crate::{frameworks::TakeOver, lifecycle::Restored};

/// What [`Signals::take_over`] made of the kernel's table at start-up.
#[derive(Debug, Default)]
pub struct TakenOver {
    /// Requests of their own, for the engine to follow on.
    pub requests: Vec<Restored>,
    /// Pinned contexts no framework takes (of requests that ended, in a
    /// process gone, or stale): their pins are to be dropped.
    pub stale: Vec<(u32, u64)>,
    /// Requests adopted with what the previous agent knew of them.
    pub with_context: usize,
    /// The table's lifecycles that are parts of a framework's request.
    pub parts: usize,
    /// What is left of requests that ended while the previous agent
    /// followed them: their parts still in flight.
    pub leftovers: usize,
}

impl Signals {
    /// The take-over capabilities of the frameworks that follow `pid`.
    fn taking_over(&mut self, pid: u32) -> impl Iterator<Item = &mut dyn TakeOver> {
        let places = of(&self.following, &self.all, pid);
        self.frameworks
            .iter_mut()
            .enumerate()
            .filter(|(at, _)| places.contains(at))
            .filter_map(|(_, framework)| framework.take_over())
    }

    /// Whether a framework that follows `pid` takes its requests over:
    /// what the kernel holds of `pid` may then be that framework's.
    fn takes_over(&mut self, pid: u32) -> bool {
        self.taking_over(pid).next().is_some()
    }

    /// Follow again a request a previous agent followed (what
    /// [`crate::kernel::state::KernelState::track`] kept of it), if it is a
    /// framework's, with what that agent handed over of it (`held`): the
    /// handles that are part of it are its own again, each with its peer.
    /// `Err`: `held` did not read (why); the request is followed knowing
    /// nothing of it.
    pub(super) fn adopt(&mut self, request: &Restored, held: Option<&[u8]>) -> Result<(), String> {
        let mut result = Ok(());
        let mut adopted = Vec::new();
        for take_over in self.taking_over(request.pid) {
            match take_over.adopt(request, held) {
                Ok(handles) => adopted.extend(handles),
                Err(why) => result = Err(why),
            }
        }
        for handle in adopted {
            self.peers.adopt(request.pid, handle.key, handle.peer.as_deref(), handle.posted);
        }
        result
    }

    /// Whether the probes' lifecycle (`pid`, `key`) is part of a
    /// framework's request ([`TakeOver::owns`]).
    pub(super) fn owns(&mut self, pid: u32, key: u64) -> bool {
        self.taking_over(pid).any(|take_over| take_over.owns(pid, key))
    }

    /// Take over the requests of live watched processes the kernel's table
    /// held at start-up (`taken`), with the contexts a previous agent
    /// pinned (`contexts`, by (pid, key)); `exited(pid)`: the process that
    /// held `pid`'s requests is gone (what is left of its ended requests
    /// goes with it).
    ///
    /// The frameworks' own requests are adopted first, with what the
    /// previous agent knew of them, so the handles that are parts of them
    /// are known as such and not taken over as requests of their own; then
    /// what is left of their requests that ended (parts still in flight);
    /// then the rest go to the engine.
    pub fn take_over(
        &mut self,
        taken: Vec<Restored>,
        mut contexts: HashMap<(u32, u64), Vec<u8>>,
        exited: impl Fn(u32) -> bool,
    ) -> TakenOver {
        let mut out = TakenOver::default();
        let mut unread = Vec::new();
        for request in &taken {
            if !self.takes_over(request.pid) {
                continue;
            }
            if let Some(held) = contexts.remove(&(request.pid, request.key)) {
                out.with_context += 1;
                if let Err(why) = self.adopt(request, Some(&held)) {
                    unread.push(format!("pid {} key {:#x}: {why}", request.pid, request.key));
                }
            }
        }
        for ((pid, key), held) in contexts {
            let kept = !exited(pid) && self.taking_over(pid).any(|take_over| take_over.adopt_ended(pid, key, &held));
            if kept {
                out.leftovers += 1;
            } else {
                out.stale.push((pid, key));
            }
        }
        for request in taken {
            if self.takes_over(request.pid) {
                if self.owns(request.pid, request.key) {
                    out.parts += 1;
                    continue;
                }
                // Adopted above already, or with nothing known of it.
                let _ = self.adopt(&request, None);
            }
            out.requests.push(request);
        }
        if let Some(first) = unread.first() {
            warn!(
                requests = unread.len(),
                first = %first,
                "what the previous agent knew of some requests could not be read: they are taken over knowing nothing \
                 of what they wait on"
            );
        }
        out
    }

    /// Of the kernel's table read again to resynchronise after lost
    /// events, the requests of their own for the engine: a lifecycle that
    /// is part of a framework's request is that request's, never one the
    /// engine never heard of; a framework's own request the engine does not
    /// know (`known(pid, key)` says which it does) is followed by its
    /// framework again, knowing what this agent knew (nothing is handed
    /// over).
    pub fn resync(&mut self, table: Vec<Restored>, known: impl Fn(u32, u64) -> bool) -> Vec<Restored> {
        let mut own = Vec::with_capacity(table.len());
        for request in table {
            if self.takes_over(request.pid) {
                if self.owns(request.pid, request.key) {
                    continue;
                }
                if !known(request.pid, request.key) {
                    let _ = self.adopt(&request, None);
                }
            }
            own.push(request);
        }
        own
    }
}
