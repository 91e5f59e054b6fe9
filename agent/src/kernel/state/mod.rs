//! What outlives the agent: the eBPF maps and probe links pinned in bpffs.
//!
//! An agent restarted during a stall must still report it, and no request
//! may be lost or reported twice across the restart. So the agent pins, under
//! its bpf directory (`--bpf-dir`, one per agent instance, [`pins`]):
//! - `v<layout>/maps/`: the ring buffer, the slot configs, the counters and
//!   the kernel's in-flight table (`INFLIGHT`, kept by the eBPF programs on
//!   every lifecycle event) with the agent's record of which stalls it
//!   already reported (`ALERTED`) and what it knew of the requests it made
//!   itself beyond what `INFLIGHT` has (`CONTEXT`: an SGLang room's
//!   destinations, answers and handles, as its framework serialises it);
//! - `v<layout>/links/`: every uprobe link, so the probes keep recording
//!   into those maps while no agent runs.
//!
//! The next agent reuses the maps, attaches its own probes, then lets the
//! old links go (make before break: no moment without probes), restores the
//! in-flight table into its engine and reads what the ring buffer gathered
//! meanwhile. [`KernelState`] keeps `ALERTED` in step with the alerts, so a
//! stall reported before the restart is not reported again, and its
//! recovery after the restart is.
//!
//! One word per thing, here and in the modules below:
//! - *track*: write a lifecycle event the agent made itself (no probe's)
//!   into `INFLIGHT`, as the eBPF programs' `track` writes the probes'
//!   ([`KernelState::track`], in [`inflight`]);
//! - *live*: the kernel still has an unended entry of this lifecycle, so the
//!   target's memory at its key is still this request's
//!   ([`KernelState::is_live`]);
//! - *withheld*: the events `quiet` probes kept in a live entry instead of
//!   sending them ([`KernelState::withheld`], `InflightEntry::withheld`,
//!   [`crate::lifecycle::Withheld`]);
//! - *pinned context*: what a framework knew of a request it made, in
//!   `CONTEXT` for the next agent ([`KernelState::pin_context`], in
//!   [`context`]; its value type is `stallwatch_common::HeldContext`);
//! - *mark*: a stall reported, in `ALERTED` ([`KernelState::apply`]).
//!
//! [`tables`] reads and writes the three tables; the tests model what the
//! eBPF programs do with them.
use std::collections::HashSet;

use anyhow::Result;
use stallwatch_common::RequestKey;
use tracing::warn;

use crate::{
    lifecycle::{Outcome, Report},
    util::warned::Warned,
};

mod context;
mod inflight;
pub mod pins;
pub mod tables;
#[cfg(test)]
mod tests;

pub use inflight::restored_from;
pub use pins::{BpfDir, DEFAULT_BPF_DIR, OldLink, PINNED_MAPS, clear};
pub use tables::{BpfTables, Tables};

/// The kernel's in-flight table and the agent's record of reported stalls.
pub struct KernelState<T = BpfTables> {
    tables: T,
    /// Requests this agent followed while they had a mark in `ALERTED`
    /// (its own stall alert, or an earlier agent's it took over), and those
    /// it took over ended: the kernel may keep their entry past the end, so
    /// their end must collect it.
    marked: HashSet<(u32, u64)>,
    /// Lifecycle events the agent made (no probe's: an SGLang room's,
    /// from its ZMQ traffic) that could not be tracked in `INFLIGHT`.
    untracked: Missed,
    /// Contexts [`Self::pin_context`] could not write or drop.
    unpinned: Missed,
}

/// Writes to a table that failed: how many, and why the latest did.
#[derive(Default)]
struct Missed {
    count: u64,
    latest: Option<String>,
    warned: Warned,
}

impl Missed {
    fn note(&mut self, why: String) {
        self.count += 1;
        self.latest = Some(why);
    }

    /// How many since the last warning, once per counter period.
    fn news(&mut self) -> Option<u64> {
        self.warned.news(self.count)
    }

    fn latest(&self) -> &str {
        self.latest.as_deref().unwrap_or("")
    }
}

impl<T: Tables> KernelState<T> {
    pub fn new(tables: T) -> Self {
        Self { tables, marked: HashSet::new(), untracked: Missed::default(), unpinned: Missed::default() }
    }

    /// Warn, once per counter period, of the lifecycles [`Self::track`]
    /// and the contexts [`Self::pin_context`] could not write since the
    /// last warning.
    pub fn warn(&mut self) {
        if let Some(new) = self.untracked.news() {
            warn!(
                new,
                total = self.untracked.count,
                latest = self.untracked.latest(),
                "requests the agent made (SGLang rooms) that the kernel's in-flight table could not hold: they are followed, \
                 but would not survive an agent restart"
            );
        }
        if let Some(new) = self.unpinned.news() {
            warn!(
                new,
                total = self.unpinned.count,
                latest = self.unpinned.latest(),
                "what the agent knew of requests it made (an SGLang room's destinations and handles) could not be pinned \
                 for the next agent: after a restart such a request is taken over knowing nothing of what it waits on"
            );
        }
    }

    /// Keep the kernel's tables in step with a report: mark a stall as
    /// reported, unmark it when it recovers, collect an ended entry the
    /// kernel kept for a mark, drop what the kernel cannot know has ended
    /// (evictions, processes gone).
    pub fn apply(&mut self, report: &Report) -> Result<()> {
        let request = report.request();
        let id = (request.pid, request.key);
        let key = RequestKey { key: request.key, pid: request.pid, _pad: 0 };
        match report {
            Report::Stalled { request, .. } => {
                self.tables.mark(&key, request.last_ns)?;
                self.marked.insert(id);
            }
            Report::Recovered { .. } => {
                // The kernel may already have kept an ended entry: `marked`
                // stays until the end, which collects it.
                self.tables.forget_alerted(&key)?;
            }
            Report::Ended { outcome, .. } => {
                let marked = self.marked.remove(&id);
                if marked {
                    self.tables.forget_alerted(&key)?;
                }
                match outcome {
                    Outcome::Released
                    | Outcome::Completed
                    | Outcome::Aborted
                    | Outcome::Failed
                    | Outcome::LeaseExpired
                    | Outcome::KvReadAfterRelease
                    | Outcome::Leaked => {
                        if request.inferred.contains(request.stage) {
                            // Ended by a read of the target's memory (an
                            // error status, or a done one where done is
                            // complete): the kernel saw no end and still
                            // holds it as live, which the next agent would
                            // take over and end again. Its entry, not a
                            // next lifecycle's.
                            if self.tables.inflight(&key)?.is_some_and(|entry| entry.first_ns <= request.last_ns) {
                                self.tables.forget_inflight(&key)?;
                            }
                        } else if marked {
                            // The kernel already dropped it, unless it kept
                            // it for the stall alert: collect that (not a
                            // next lifecycle of the key that began since).
                            if self.tables.inflight(&key)?.is_some_and(|entry| entry.ended != 0) {
                                self.tables.forget_inflight(&key)?;
                            }
                        }
                    }
                    Outcome::Evicted => self.tables.forget_inflight(&key)?,
                    // The kernel holds none of it (or a later lifecycle of
                    // the key, which is not this one's to drop).
                    Outcome::EndUnseen => {}
                    // Its own entry only: a reused pid's new process may
                    // hold others (`forget_process` drops the rest of an
                    // exited one).
                    Outcome::ProcessExited => {
                        self.tables.forget_inflight(&key)?;
                        self.tables.forget_alerted(&key)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Drop every entry of `pid`: it exited, or this agent does not watch it.
    pub fn forget_process(&mut self, pid: u32) -> Result<()> {
        self.marked.retain(|(marked_pid, _)| *marked_pid != pid);
        for key in self.tables.inflight_keys()?.iter().filter(|key| key.pid == pid) {
            self.tables.forget_inflight(key)?;
        }
        for key in self.tables.alerted_keys()?.iter().filter(|key| key.pid == pid) {
            self.tables.forget_alerted(key)?;
        }
        for key in self.tables.context_keys()?.iter().filter(|key| key.pid == pid) {
            self.tables.forget_context(key)?;
        }
        Ok(())
    }
}
