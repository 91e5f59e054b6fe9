//! When a process's gated transport probes (progress, posts) are linked.
//!
//! UCX's `ucp_worker_progress` is called thousands of times a transfer
//! (non-stop by a thread-pool engine), and a uprobe on it costs the target
//! more than every other probe of the `nixl` profile together. UCX's posts
//! (`ucp_put_nbx` and the like) come once per NIXL descriptor: chunks x KV
//! buffers x page runs, 130 traps a room at 32 layers where the room's own
//! lifecycle takes 15. Both counts matter only to judge a stall
//! (`peer_unresponsive` vs `no_progress`, posts since its last event), so
//! their probes ([`crate::profile::ActivityKind::near_stall_only`]) are
//! linked only while the process holds a request silent for half the
//! timeout or more (stalled or not), and unlinked once it holds none. A
//! stall due on time is then judged on progress and posts counted over
//! about the second half of its silence (the evidence says over how long,
//! see [`crate::evidence::transport`]); a healthy process, whose requests
//! end long before half the timeout, never has them linked.
//!
//! Half: late enough that healthy requests never open the gate, early
//! enough that the window left before the stall (half the timeout) is far
//! longer than the check period and the few ms a link takes, so the verdict
//! rests on seconds of counting at the default 60 s timeout.
//!
//! Linking happens off the event loop ([`Opener`]): linking a probe into a
//! process mid-transfer can take the kernel seconds, and a stall coming due
//! meanwhile must be reported on time, its evidence saying the probe was
//! not on yet ("progress not watched") rather than the alert waiting for
//! it. The loop hands the work to a blocking task and takes the links back
//! as a message; the progress window counts from then.
use std::collections::{HashMap, HashSet};

use tokio::sync::mpsc;
use tracing::{info, warn};

use super::transport::Tracker;
use crate::{
    kernel::{
        Probes,
        detach::Detacher,
        uprobe_link::{Linked, Opening},
    },
    util::clock::monotonic_ns,
};

/// Most time between two checks of who holds a request near its stall.
const MAX_PERIOD_NS: u64 = 250_000_000;

/// The gate's timing.
#[derive(Debug, Clone)]
pub struct Gate {
    /// Silence from which a request opens its process's gate.
    open_after_ns: u64,
    /// Time between checks: an eighth of the timeout, at least a tick and
    /// at most [`MAX_PERIOD_NS`], so the gate opens within an eighth of the
    /// timeout after half of it, leaving at least three eighths to count.
    period_ns: u64,
    next_ns: u64,
}

/// What to do to one process's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Open(u32),
    Close(u32),
}

impl Gate {
    pub fn new(timeout_ns: u64, tick_ns: u64) -> Self {
        let period_ns = (timeout_ns / 8).min(MAX_PERIOD_NS).max(tick_ns);
        Self { open_after_ns: timeout_ns / 2, period_ns, next_ns: 0 }
    }

    /// Whether a check is due at `now_ns`; if it is, the next one is a
    /// period later.
    pub fn due(&mut self, now_ns: u64) -> bool {
        if now_ns < self.next_ns {
            return false;
        }
        self.next_ns = now_ns.saturating_add(self.period_ns);
        true
    }

    /// When the next check is due.
    pub fn next_ns(&self) -> u64 {
        self.next_ns
    }

    /// Requests whose last event is at or before this are in the window.
    pub fn cutoff(&self, now_ns: u64) -> u64 {
        now_ns.saturating_sub(self.open_after_ns)
    }

    /// The gates to open or close: `gates` are the processes with gated
    /// probes and whether theirs is open now, `near_stall` the pids holding
    /// a request silent since [`Self::cutoff`].
    pub fn changes(gates: impl Iterator<Item = (u32, bool)>, near_stall: &HashSet<u32>) -> Vec<Change> {
        let mut changes: Vec<Change> = gates
            .filter_map(|(pid, open)| match (open, near_stall.contains(&pid)) {
                (false, true) => Some(Change::Open(pid)),
                (true, false) => Some(Change::Close(pid)),
                _ => None,
            })
            .collect();
        changes.sort_by_key(|change| match change {
            Change::Open(pid) | Change::Close(pid) => *pid,
        });
        changes
    }
}

/// Processes whose gate failed to open, warned about once each (a retry
/// every period must not flood the log).
#[derive(Debug, Default)]
pub struct Failures(HashMap<u32, String>);

impl Failures {
    /// Whether this failure of `pid` is news (the first, or a different error).
    pub fn is_new(&mut self, pid: u32, error: &str) -> bool {
        self.0.insert(pid, error.to_owned()).as_deref() != Some(error)
    }

    pub fn forget(&mut self, pid: u32) {
        self.0.remove(&pid);
    }
}

/// Gate openings under way off the event loop: each linked on a blocking
/// task, its links coming back through a channel to the loop, which
/// alone changes [`Probes`] and the [`Tracker`].
pub struct Opener {
    tx: mpsc::UnboundedSender<Linked>,
    rx: mpsc::UnboundedReceiver<Linked>,
    failures: Failures,
}

impl Default for Opener {
    fn default() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self { tx, rx, failures: Failures::default() }
    }
}

impl Opener {
    /// Start linking the gated probes (progress, posts) of `pid`, unless there is nothing
    /// to link or an opening of it is under way.
    pub fn open(&mut self, pid: u32, probes: &mut Probes) {
        match probes.begin_opening(pid) {
            Ok(Some(opening)) => self.start(opening, Opening::link),
            Ok(None) => {}
            Err(err) => self.failed(pid, &format!("{err:#}")),
        }
    }

    /// Run `link` on `job` on a blocking task, its result sent back.
    fn start<J: Send + 'static>(&self, job: J, link: impl FnOnce(J) -> Linked + Send + 'static) {
        let tx = self.tx.clone();
        tokio::task::spawn_blocking(move || {
            // The loop is gone only when the agent stops: the links then
            // go with the message.
            let _ = tx.send(link(job));
        });
    }

    /// The next opening done; never resolves while none is under way.
    pub async fn linked(&mut self) -> Linked {
        match self.rx.recv().await {
            Some(linked) => linked,
            // Never: `self` holds a sender.
            None => std::future::pending().await,
        }
    }

    /// Take an opening's links: the process's gated probes are on, and
    /// counted from now (the calls made while they were being linked fall
    /// before the window, which is then never longer than the time they
    /// were on). Those of a process detached meanwhile go through
    /// `detacher`, off the loop as its other links did.
    pub fn finish(&mut self, linked: Linked, probes: &mut Probes, transport: &mut Tracker, detacher: &mut Detacher) {
        let (pid, took) = (linked.pid(), linked.took());
        let since = monotonic_ns();
        let sampled = transport.sample(probes, since);
        match probes.end_opening(linked) {
            Ok(None) => {
                self.failures.forget(pid);
                match sampled {
                    Ok(()) => transport.progress_attached(pid, Some(since)),
                    Err(err) => warn!(
                        pid,
                        "sampling transport counts as the progress and post probes came on (their stalls say \
                         progress not watched): {err:#}"
                    ),
                }
                info!(
                    pid,
                    attach_ms = format_args!("{:.1}", took.as_secs_f64() * 1e3),
                    "progress probes attached, with the post probes: a request of the process is near its stall"
                );
            }
            Ok(Some(orphaned)) => detacher.start(orphaned),
            Err(err) => self.failed(pid, &format!("{err:#}")),
        }
    }

    fn failed(&mut self, pid: u32, err: &str) {
        if self.failures.is_new(pid, err) {
            warn!(
                pid,
                "progress and post probes not attached (retried while a request is near its stall; its stalls tell no \
                 no_progress and count no posts): {err}"
            );
        }
    }

    /// The process is gone: a failure of its pid is news again.
    pub fn forget(&mut self, pid: u32) {
        self.failures.forget(pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::{Engine, EngineConfig, Observation, Stage};

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000 * MS;

    #[test]
    fn a_request_opens_its_process_gate_from_half_the_timeout_until_it_ends() {
        let gate = Gate::new(60 * S, 10 * MS);
        let mut engine = Engine::new(EngineConfig { timeout_ns: 60 * S, max_tracked: 100, tick_ns: 10 * MS });
        let mut reports = Vec::new();
        let event = |pid, key, stage, ts_ns| Observation { pid, key, stage, ts_ns, external_id: None, ends: None };
        engine.observe(event(7, 1, Stage::Enqueued, 10 * S), &mut reports);
        engine.observe(event(8, 1, Stage::Enqueued, 30 * S), &mut reports);
        let near = |engine: &Engine, now: u64| engine.pids_silent_since(gate.cutoff(now));
        // Busy but healthy: nothing silent for half the timeout.
        assert!(near(&engine, 39 * S).is_empty());
        assert_eq!(near(&engine, 40 * S), HashSet::from([7]));
        assert_eq!(near(&engine, 60 * S), HashSet::from([7, 8]));
        // Stalled (past the timeout) still holds it open: the stall's
        // evidence stays live for `inflight`.
        engine.advance(75 * S, &mut reports);
        assert!(!reports.is_empty());
        assert_eq!(near(&engine, 75 * S), HashSet::from([7, 8]));
        // An event restarts the silence: 8 moves again.
        engine.observe(event(8, 1, Stage::TransferPosted, 75 * S), &mut reports);
        assert_eq!(near(&engine, 80 * S), HashSet::from([7]));
        engine.observe(event(7, 1, Stage::Released, 80 * S), &mut reports);
        assert!(near(&engine, 100 * S).is_empty());
    }

    #[test]
    fn gates_open_where_a_request_nears_its_stall_and_close_where_none_does() {
        let gates = [(1, false), (2, true), (3, false), (4, true)];
        let near = HashSet::from([1, 2, 9]);
        // 9 has no gated probes (its profile has none, or it is not watched).
        assert_eq!(Gate::changes(gates.into_iter(), &near), [Change::Open(1), Change::Close(4)]);
        assert!(Gate::changes(std::iter::empty(), &near).is_empty());
    }

    #[test]
    fn checks_come_every_eighth_of_the_timeout_within_a_tick_and_a_quarter_second() {
        let period = |timeout_ns, tick_ns| {
            let mut gate = Gate::new(timeout_ns, tick_ns);
            assert!(gate.due(5 * S) && !gate.due(5 * S + 1));
            (gate.next_ns - 5 * S, gate.cutoff(5 * S))
        };
        assert_eq!(period(60 * S, 10 * MS), (250 * MS, 0));
        assert_eq!(period(2 * S, 10 * MS), (250 * MS, 4 * S));
        assert_eq!(period(800 * MS, 10 * MS), (100 * MS, 4_600 * MS));
        assert_eq!(period(40 * MS, 10 * MS), (10 * MS, 4_980 * MS));
    }

    #[test]
    fn a_slow_link_holds_nothing_up_on_the_loop() {
        let runtime =
            tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a current-thread runtime");
        runtime.block_on(async {
            let mut opener = Opener::default();
            // A link the kernel takes 300 ms over (seen up to 1.3 s).
            opener.start(7, |pid| {
                std::thread::sleep(std::time::Duration::from_millis(300));
                Linked::for_test(pid)
            });
            // A stall due 50 ms on is judged on time, the link still under way.
            let due = tokio::time::sleep(std::time::Duration::from_millis(50));
            let started = std::time::Instant::now();
            tokio::select! {
                () = due => {}
                _ = opener.linked() => panic!("the link came back before the stall was due"),
            }
            assert!(started.elapsed() < std::time::Duration::from_millis(250), "{:?}", started.elapsed());
            // Its links come back as a message once made.
            assert_eq!(opener.linked().await.pid(), 7);
        });
    }

    #[test]
    fn a_failure_is_news_once_until_it_changes_or_is_forgotten() {
        let mut failures = Failures::default();
        assert!(failures.is_new(7, "EPERM"));
        assert!(!failures.is_new(7, "EPERM"));
        assert!(failures.is_new(7, "ENOENT"));
        failures.forget(7);
        assert!(failures.is_new(7, "ENOENT"));
    }
}
