//! Transport evidence: what the transport was doing while a request sat
//! silent, from the `[[activity]]` probes of its process (posts, progress
//! calls, completions) and the lifecycle events themselves (every
//! `transfer_done` is a completion, and so is the release of a posted
//! request whose `transfer_done` no probe saw).
//!
//! The kernel keeps per-slot hit counts and last-hit times; the agent
//! samples them once a second into a short history per process, so it can
//! say how many calls happened *since* a request's last event ("120 000
//! progress calls since, none completed") and refine the stall's class with
//! a verdict.
//!
//! Progress and post probes are linked only while a request of their
//! process nears its stall ([`crate::evidence::gate`]), so progress and
//! posts are counted over a *window*: from the later of the request's last
//! event and the moment the probes' current attachment began, to the
//! newest sample. The evidence says how long that window is ("no post in
//! the last 30.0s", "120000 progress calls in the last 30.0s"), never
//! "last post 57 s ago" for a post it could not have seen, and a window
//! shorter than [`Tracker::min_window_ns`] (the probes attached just now,
//! e.g. by an agent that took over a request near its timeout) never
//! yields `no_progress`: zero calls in it prove nothing.
//!
//! Where the stalled transfer's peer is known ([`crate::evidence::peers`]), the
//! verdict is judged per peer first: completions to that peer since say it
//! is alive (`others_completing`), none to it while other peers of the
//! process complete say it is the peer (`peer_unresponsive`); when no peer
//! completed anything, the process's counts decide, except that
//! completions of handles with no known peer never make a known peer that
//! completed nothing `others_completing`.
//!
//! Above all of that, a process that is itself stopped, throttled or not
//! scheduled ([`crate::evidence::sched`]) is `process_stopped`: its
//! transport is silent because it is, and no peer is to blame.
use std::collections::{HashMap, VecDeque};

use anyhow::Result;

use crate::{
    evidence::{peers::PeerCompletions, sched::Halt},
    kernel::{Probes, Role},
    lifecycle::{Observation, Outcome, Report, RequestSnapshot, Stage, StallClass},
    profile::ActivityKind,
};

/// One kind of activity in one process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Activity {
    pub calls: u64,
    pub last_ns: Option<u64>,
}

/// Every kind, indexed by [`ActivityKind`], and which kinds the process
/// has probes of.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    kinds: [Activity; 3],
    /// Bit per [`ActivityKind`]: a probe of the kind was counted.
    probed: u8,
}

impl Totals {
    pub fn get(&self, kind: ActivityKind) -> Activity {
        self.kinds[kind as usize]
    }

    /// Whether the process has a probe of `kind`: without one, its count
    /// says nothing (a Mooncake process has no post probe to count).
    pub fn probed(&self, kind: ActivityKind) -> bool {
        self.probed & (1 << kind as u8) != 0
    }

    #[cfg(test)]
    pub(crate) fn add_for_test(&mut self, kind: ActivityKind, calls: u64, last_ns: Option<u64>) {
        self.add(kind, calls, last_ns);
    }

    fn add(&mut self, kind: ActivityKind, calls: u64, last_ns: Option<u64>) {
        let slot = &mut self.kinds[kind as usize];
        slot.calls += calls;
        slot.last_ns = slot.last_ns.max(last_ns);
        self.probed |= 1 << kind as u8;
    }

    fn set_calls(&mut self, kind: ActivityKind, calls: u64) {
        self.kinds[kind as usize].calls = calls;
    }
}

/// What the transport says about one stalled request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence {
    /// Counts since the process started being watched, and last-seen times.
    pub total: Totals,
    /// Calls since the request's last lifecycle event (at sampling
    /// resolution: the sample at or before that event); progress calls and
    /// posts only over `progress_window_ns`.
    pub since: Totals,
    /// How far back `since` counts progress calls and posts (the kinds
    /// [`ActivityKind::near_stall_only`]): their probes were attached all
    /// through the last this many ns. `None`: none is attached now, and
    /// both counts are 0 for want of one.
    pub progress_window_ns: Option<u64>,
    /// When this was measured (monotonic ns).
    pub at_ns: u64,
    /// The peer of the stalled transfer and the completions per peer since
    /// the request's last event, where the profile names peers.
    pub peer: Option<PeerCompletions>,
    /// How the process itself was held when the stall was judged, if it
    /// was (then the verdict is [`Verdict::ProcessStopped`]).
    pub halt: Option<Halt>,
    pub verdict: Verdict,
}

impl Evidence {
    /// One line for people: "no post in the last 30.0s, last completion
    /// 57.0s ago, 120000 progress calls in the last 30.0s, none
    /// completed"; with a known peer the completions are told per peer:
    /// "none to decode-0 completed, 14 to other peers"; a process held
    /// itself says so first: "process stopped (all 57 threads in state T);
    /// no post ...". Posts are told as far as the window their probes were
    /// on reaches ([`Self::posts`]); a process with no post probe has no
    /// post clause.
    pub fn summary(&self) -> String {
        let completed = match (&self.peer, self.since.get(ActivityKind::Completion).calls) {
            (Some(peer), _) => {
                format!("{} to {} completed, {} to other peers", count(peer.to_peer), peer.peer, count(peer.to_others))
            }
            (None, 0) => "none completed".to_owned(),
            (None, n) => format!("{n} completed"),
        };
        let progress = match self.progress_window_ns {
            Some(ns) => {
                format!("{} progress calls in the last {}", self.since.get(ActivityKind::Progress).calls, seconds(ns))
            }
            None => "progress not watched".to_owned(),
        };
        let halt = self.halt.map(|halt| format!("{}; ", halt.summary())).unwrap_or_default();
        let posts = self.posts().map(|posts| format!("{posts}, ")).unwrap_or_default();
        format!("{halt}{posts}last completion {}, {progress}, {completed}", self.ago(ActivityKind::Completion))
    }

    /// What the post probes saw, as far as they were on: "3 posts in the
    /// last 30.0s (last 0.4s ago)"; "last post 29.0s ago" (one in the
    /// window, before the request's last event); "no post in the last
    /// 30.0s"; "posts not watched" (their probes are not on). `None`: the
    /// process has no post probe.
    fn posts(&self) -> Option<String> {
        if !self.total.probed(ActivityKind::Post) {
            return None;
        }
        let Some(window_ns) = self.progress_window_ns else { return Some("posts not watched".to_owned()) };
        let last_ns = self.total.get(ActivityKind::Post).last_ns;
        let in_window = last_ns.is_some_and(|ns| ns >= self.at_ns.saturating_sub(window_ns));
        Some(match self.since.get(ActivityKind::Post).calls {
            0 if in_window => format!("last post {}", self.ago(ActivityKind::Post)),
            0 => format!("no post in the last {}", seconds(window_ns)),
            n => format!("{n} posts in the last {} (last {})", seconds(window_ns), self.ago(ActivityKind::Post)),
        })
    }

    /// "57.0s ago" since the last call of `kind`, or "never".
    fn ago(&self, kind: ActivityKind) -> String {
        match self.total.get(kind).last_ns {
            Some(ns) => format!("{} ago", seconds(self.at_ns.saturating_sub(ns))),
            None => "never".to_owned(),
        }
    }
}

/// "none", or the number.
fn count(n: u64) -> String {
    if n == 0 { "none".to_owned() } else { n.to_string() }
}

/// "30.0s".
fn seconds(ns: u64) -> String {
    format!("{:.1}s", ns as f64 / 1e9)
}

/// The stall's class refined by the transport's behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Progress is being driven and nothing completes: the peer is gone,
    /// stopped or not making progress of its own.
    PeerUnresponsive,
    /// Nobody is driving the transport's progress engine for this process.
    NoProgress,
    /// Other transfers of the process complete: this request alone is stuck
    /// (its release, completion or destination was lost).
    OthersCompleting,
    /// The process's transport has done nothing since: it is idle.
    Idle,
    /// The process itself is stopped (SIGSTOP, a tracer), throttled by its
    /// cgroup's CPU limit or not scheduled: whatever its transport shows
    /// follows from that, and the request waits on this process, not on a
    /// peer.
    ProcessStopped,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PeerUnresponsive => "peer_unresponsive",
            Self::NoProgress => "no_progress",
            Self::OthersCompleting => "others_completing",
            Self::Idle => "idle",
            Self::ProcessStopped => "process_stopped",
        }
    }

    /// `progress_known`: a progress probe was attached over a window long
    /// enough that no calls in it mean nobody drives progress. `peer`: what
    /// the stalled transfer's peer and the process's other peers completed.
    /// `halted`: the process itself is held ([`Halt`]), which outranks
    /// everything its transport did: a stopped process completes nothing
    /// and drives no progress, which would otherwise read as its peer's
    /// fault.
    fn of(
        class: StallClass,
        since: &Totals,
        progress_known: bool,
        peer: Option<&PeerCompletions>,
        halted: bool,
    ) -> Self {
        if halted {
            return Self::ProcessStopped;
        }
        match peer {
            Some(peer) if peer.to_peer > 0 => return Self::OthersCompleting,
            Some(peer) if peer.to_others > 0 => return Self::PeerUnresponsive,
            _ => {}
        }
        let completions = since.get(ActivityKind::Completion).calls;
        let progress = since.get(ActivityKind::Progress).calls;
        let posts = since.get(ActivityKind::Post).calls;
        if completions > 0 {
            // Where the stalled transfer's peer is known and completed
            // nothing, completions it had no part in say only that others
            // are alive: never that this peer is.
            return if peer.is_some() { Self::PeerUnresponsive } else { Self::OthersCompleting };
        }
        match class {
            StallClass::TransferHung if progress > 0 => Self::PeerUnresponsive,
            StallClass::TransferHung if progress_known => Self::NoProgress,
            _ if progress + posts > 0 => Self::PeerUnresponsive,
            _ => Self::Idle,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at_ns: u64,
    totals: Totals,
}

/// One process's transport history: small (one sample a second for two
/// timeouts), so a copy can be taken off the event loop to judge many
/// requests there.
#[derive(Debug, Clone, Default)]
pub struct ProcessTransport {
    /// Oldest first, at most `keep` long.
    history: VecDeque<Sample>,
    /// Completions seen as lifecycle events.
    done: Activity,
    /// When the gated probes' (progress, posts) current attachment began
    /// (the sample taken as they came on); `None` while none is linked.
    gated_since: Option<u64>,
    /// The shortest progress window that can tell `no_progress`.
    min_window_ns: u64,
    has_activity_probe: bool,
}

impl ProcessTransport {
    /// The evidence for a stalled request of this process, from the newest
    /// sample, judged per peer where `peer` is known; `None` when the
    /// process has no transport probes.
    pub fn evidence(
        &self,
        request: &RequestSnapshot,
        class: StallClass,
        peer: Option<PeerCompletions>,
    ) -> Option<Evidence> {
        self.judged(request, class, peer, None)
    }

    /// [`Self::evidence`], with how the process itself was held (`halt`,
    /// from [`crate::evidence::sched`]), which decides the verdict when
    /// it is held.
    pub fn judged(
        &self,
        request: &RequestSnapshot,
        class: StallClass,
        peer: Option<PeerCompletions>,
        halt: Option<Halt>,
    ) -> Option<Evidence> {
        if !self.has_activity_probe {
            return None;
        }
        let newest = self.history.back()?;
        let before = self.sample_at(request.last_ns)?;
        let total = newest.totals;
        let mut since = Totals::default();
        for kind in ActivityKind::ALL {
            // The sample before the event may be up to a period older than
            // it: calls between the two are no calls since when the newest
            // call of the kind was at or before the event (a worker's
            // previous batch completing just before it submits the one
            // that hangs is no sign that anything completes now).
            let calls = match total.get(kind).last_ns {
                Some(last_ns) if last_ns > request.last_ns => {
                    total.get(kind).calls.saturating_sub(before.totals.get(kind).calls)
                }
                _ => 0,
            };
            since.add(kind, calls, None);
        }
        // Progress and posts only from when their probes went on, if that
        // was later; none without them on.
        let gated = ActivityKind::ALL.into_iter().filter(|kind| kind.near_stall_only());
        let progress_window_ns = match self.gated_since {
            Some(attached_ns) if attached_ns > request.last_ns => {
                let from = self.sample_at(attached_ns)?;
                for kind in gated {
                    since.set_calls(kind, total.get(kind).calls.saturating_sub(from.totals.get(kind).calls));
                }
                Some(newest.at_ns.saturating_sub(from.at_ns))
            }
            Some(_) => Some(newest.at_ns.saturating_sub(before.at_ns)),
            None => {
                for kind in gated {
                    since.set_calls(kind, 0);
                }
                None
            }
        };
        let progress_known = progress_window_ns.is_some_and(|ns| ns >= self.min_window_ns);
        let verdict = Verdict::of(class, &since, progress_known, peer.as_ref(), halt.is_some());
        Some(Evidence { total, since, progress_window_ns, at_ns: newest.at_ns, peer, halt, verdict })
    }

    /// The last sample at or before `at_ns` (samples are in time order:
    /// found by bisection), or the oldest kept.
    fn sample_at(&self, at_ns: u64) -> Option<&Sample> {
        let after = self.history.partition_point(|sample| sample.at_ns <= at_ns);
        self.history.get(after.saturating_sub(1))
    }

    /// The newest totals and when they were sampled, if the process has
    /// transport probes, with how long its gated probes (progress, posts)
    /// had been attached then (`None`: they were not).
    pub fn latest(&self) -> Option<(Totals, u64, Option<u64>)> {
        self.history.back().filter(|_| self.has_activity_probe).map(|sample| {
            (sample.totals, sample.at_ns, self.gated_since.map(|since| sample.at_ns.saturating_sub(since)))
        })
    }
}

/// Per-process transport history. Lifecycle completions are folded into
/// each sample's completion count.
pub struct Tracker {
    processes: HashMap<u32, ProcessTransport>,
    /// How far back samples are kept: a stall is judged against the sample
    /// at its last event, up to one timeout (plus slack) ago.
    keep_ns: u64,
    /// The shortest progress window that can tell `no_progress`: a quarter
    /// of the timeout, at most a second. The gate links the probe at half
    /// the timeout, so a stall judged on time has about half the timeout;
    /// a window shorter than this is one the probe was linked late to
    /// (a take-over near the timeout). UCX progress that is driven at all
    /// is called far more often than once a second.
    min_window_ns: u64,
}

impl Tracker {
    pub fn new(timeout_ns: u64) -> Self {
        Self {
            processes: HashMap::new(),
            keep_ns: timeout_ns.saturating_mul(2).saturating_add(5_000_000_000),
            min_window_ns: (timeout_ns / 4).min(1_000_000_000),
        }
    }

    /// The gated probes (progress, posts) of `pid` were just linked
    /// (`Some`: the time of the sample taken as they came on, from which
    /// they count) or unlinked (`None`).
    pub fn progress_attached(&mut self, pid: u32, since_ns: Option<u64>) {
        let min_window_ns = self.min_window_ns;
        let process = self.processes.entry(pid).or_default();
        process.gated_since = since_ns;
        process.min_window_ns = min_window_ns;
    }

    /// Count a lifecycle completion.
    pub fn observe(&mut self, observation: &Observation) {
        if observation.stage == Stage::TransferDone {
            self.complete(observation.pid, observation.ts_ns);
        }
    }

    /// Count a completion no probe saw, from a request's end: one released
    /// (or read done, where done is complete) after its post without an
    /// observed `transfer_done` finished its transfer unseen, at its
    /// release (the read) at the latest. Profiles that do not
    /// probe status polls (the `nixl` profile reads no getXferStatus) see
    /// most completions only this way; without it a busy transport whose
    /// transfers all complete read "last completion never".
    pub fn observe_end(&mut self, report: &Report) {
        let Report::Ended { request, outcome: Outcome::Released | Outcome::Completed, at_ns } = report else { return };
        let done_seen =
            request.stage_at(Stage::TransferDone).is_some() && !request.inferred.contains(Stage::TransferDone);
        if request.stage_at(Stage::TransferPosted).is_some() && !done_seen {
            self.complete(request.pid, *at_ns);
        }
    }

    fn complete(&mut self, pid: u32, at_ns: u64) {
        let done = &mut self.processes.entry(pid).or_default().done;
        done.calls += 1;
        done.last_ns = done.last_ns.max(Some(at_ns));
    }

    /// Read every activity slot and append a sample per process.
    pub fn sample(&mut self, probes: &Probes, now_ns: u64) -> Result<()> {
        let mut fresh: HashMap<u32, Totals> = HashMap::new();
        for (index, slot) in probes.slots() {
            let Role::Activity(kind) = slot.role else { continue };
            fresh.entry(slot.pid).or_default().add(kind, probes.hits(index)?, probes.last_hit(index)?);
        }
        for (pid, totals) in fresh {
            self.record(pid, now_ns, totals);
        }
        Ok(())
    }

    /// Append one process's sample (probe counts; lifecycle completions are
    /// added here) and drop what is older than `keep_ns` (a progress window
    /// older than that then counts from the oldest sample kept, and says
    /// so by its length).
    fn record(&mut self, pid: u32, now_ns: u64, mut totals: Totals) {
        let keep_ns = self.keep_ns;
        let min_window_ns = self.min_window_ns;
        let process = self.processes.entry(pid).or_default();
        totals.add(ActivityKind::Completion, process.done.calls, process.done.last_ns);
        process.min_window_ns = min_window_ns;
        process.has_activity_probe = true;
        process.history.push_back(Sample { at_ns: now_ns, totals });
        while process.history.front().is_some_and(|s| now_ns.saturating_sub(s.at_ns) > keep_ns) {
            process.history.pop_front();
        }
    }

    /// The evidence for a stalled request, from the newest sample; `None`
    /// when its process has no transport probes.
    pub fn evidence(
        &self,
        request: &RequestSnapshot,
        class: StallClass,
        peer: Option<PeerCompletions>,
    ) -> Option<Evidence> {
        self.processes.get(&request.pid)?.evidence(request, class, peer)
    }

    /// The process is gone: its history goes with it (discovery watches
    /// processes come and go for as long as the agent runs).
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    /// One process's history, to copy off the event loop.
    pub fn process(&self, pid: u32) -> Option<&ProcessTransport> {
        self.processes.get(&pid)
    }

    #[cfg(test)]
    pub(crate) fn record_for_test(&mut self, pid: u32, now_ns: u64, totals: Totals) {
        self.record(pid, now_ns, totals);
    }

    /// The evidence a report's alert carries: stalls only, judged per
    /// peer where `peer_of` knows the stalled transfer's, and on how the
    /// process itself is held (`halt`, [`crate::evidence::sched`]).
    pub fn for_report(
        &self,
        report: &Report,
        peer_of: impl FnOnce(&RequestSnapshot) -> Option<PeerCompletions>,
        halt: Option<Halt>,
    ) -> Option<Evidence> {
        match report {
            Report::Stalled { request, class, .. } => {
                self.processes.get(&request.pid)?.judged(request, *class, peer_of(request), halt)
            }
            _ => None,
        }
    }
}

/// The class of a stall refined by what its framework knows of its
/// transfers (`between_transfers`: a request of a framework's with no
/// transfer of its own out, [`crate::frameworks::Framework::stalled_transfer`]).
/// A request at `transfer_posted` with none out is between its
/// transfers: an SGLang room whose chunk is done and whose next chunk waits
/// on its forward pass or in its worker's queue (behind another room's hung
/// transfer). Nothing of its own hangs, so it is no second `transfer_hung`
/// beside the room whose transfer does: it waits, as a room not started
/// does (`waiting_for_peer`, with what it waits on in its alert's
/// `waiting_on`/`behind`).
pub fn refined_class(class: StallClass, between_transfers: bool) -> StallClass {
    match class {
        StallClass::TransferHung if between_transfers => StallClass::WaitingForPeer,
        _ => class,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::StageSet;

    const S: u64 = 1_000_000_000;

    fn totals(post: u64, completion: u64, progress: u64, last_ns: u64) -> Totals {
        let mut totals = Totals::default();
        totals.add(ActivityKind::Post, post, Some(last_ns));
        totals.add(ActivityKind::Completion, completion, (completion > 0).then_some(last_ns));
        totals.add(ActivityKind::Progress, progress, Some(last_ns));
        totals
    }

    fn stalled(pid: u32, stage: Stage, last_ns: u64) -> RequestSnapshot {
        let mut stage_ns = [None; 4];
        stage_ns[0] = Some(last_ns);
        RequestSnapshot {
            pid,
            key: 1,
            external_id: None,
            stage,
            stage_ns,
            first_ns: last_ns,
            last_ns,
            stalled: None,
            inferred: Default::default(),
        }
    }

    #[test]
    fn a_hung_transfer_with_progress_and_no_completion_blames_the_peer() {
        let mut tracker = Tracker::new(60 * S);
        tracker.progress_attached(7, Some(10 * S));
        tracker.record(7, 10 * S, totals(5, 0, 100, 10 * S));
        tracker.record(7, 11 * S, totals(6, 0, 150, 11 * S));
        tracker.record(7, 80 * S, totals(6, 0, 120_150, 79 * S));
        let evidence =
            tracker.evidence(&stalled(7, Stage::TransferPosted, 11 * S), StallClass::TransferHung, None).unwrap();
        assert_eq!(evidence.verdict, Verdict::PeerUnresponsive);
        assert_eq!(evidence.since.get(ActivityKind::Progress).calls, 120_000);
        assert_eq!(evidence.since.get(ActivityKind::Post).calls, 0);
        assert_eq!(
            evidence.summary(),
            "last post 1.0s ago, last completion never, 120000 progress calls in the last 69.0s, none completed"
        );
    }

    #[test]
    fn no_progress_calls_at_all_is_no_progress() {
        let mut tracker = Tracker::new(60 * S);
        tracker.progress_attached(7, Some(10 * S));
        tracker.record(7, 10 * S, totals(1, 0, 10, 10 * S));
        tracker.record(7, 80 * S, totals(1, 0, 10, 10 * S));
        let evidence =
            tracker.evidence(&stalled(7, Stage::TransferPosted, 10 * S), StallClass::TransferHung, None).unwrap();
        assert_eq!(evidence.verdict, Verdict::NoProgress);
    }

    #[test]
    fn completions_of_other_requests_say_this_one_alone_is_stuck() {
        let mut tracker = Tracker::new(60 * S);
        tracker.record(7, 10 * S, totals(1, 0, 10, 10 * S));
        for n in 0..3 {
            tracker.observe(&Observation {
                pid: 7,
                key: 100 + n,
                stage: Stage::TransferDone,
                ts_ns: 20 * S,
                external_id: None,
                ends: None,
            });
        }
        tracker.record(7, 80 * S, totals(4, 0, 40, 20 * S));
        let evidence =
            tracker.evidence(&stalled(7, Stage::TransferDone, 10 * S), StallClass::ReleaseLost, None).unwrap();
        assert_eq!(evidence.since.get(ActivityKind::Completion).calls, 3);
        assert_eq!(evidence.verdict, Verdict::OthersCompleting);
    }

    /// The end of request `key` of pid 7, released at `at_ns` after the
    /// stages timed in `stage_ns`.
    fn released(key: u64, stage_ns: [Option<u64>; 4], inferred: StageSet, at_ns: u64) -> Report {
        let request =
            RequestSnapshot { key, stage: Stage::Released, stage_ns, inferred, ..stalled(7, Stage::Released, at_ns) };
        Report::Ended { request, outcome: Outcome::Released, at_ns }
    }

    #[test]
    fn a_release_after_a_post_is_a_completion_no_probe_saw_counted_once() {
        let mut tracker = Tracker::new(60 * S);
        tracker.record(7, 10 * S, totals(1, 0, 10, 10 * S));
        let mut done_inferred = StageSet::EMPTY;
        done_inferred.insert(Stage::TransferDone);
        // Done unseen (counted at the release), done inferred from memory
        // (counted), done seen by a probe (counted there, not again), never
        // posted (no transfer to complete).
        tracker.observe_end(&released(1, [Some(S), Some(11 * S), None, Some(20 * S)], StageSet::EMPTY, 20 * S));
        tracker.observe_end(&released(2, [Some(S), Some(11 * S), Some(15 * S), Some(20 * S)], done_inferred, 20 * S));
        tracker.observe(&Observation {
            pid: 7,
            key: 3,
            stage: Stage::TransferDone,
            ts_ns: 19 * S,
            external_id: None,
            ends: None,
        });
        tracker.observe_end(&released(3, [Some(S), Some(11 * S), Some(19 * S), Some(20 * S)], StageSet::EMPTY, 20 * S));
        tracker.observe_end(&released(4, [Some(S), None, None, Some(20 * S)], StageSet::EMPTY, 20 * S));
        tracker.record(7, 80 * S, totals(4, 0, 40, 20 * S));
        let evidence =
            tracker.evidence(&stalled(7, Stage::TransferDone, 10 * S), StallClass::ReleaseLost, None).unwrap();
        assert_eq!(evidence.since.get(ActivityKind::Completion).calls, 3);
        assert_eq!(evidence.total.get(ActivityKind::Completion).last_ns, Some(20 * S));
        assert_eq!(evidence.verdict, Verdict::OthersCompleting);
    }

    /// A transfer to decode-0 hung since 10 s, judged at 70 s (timeout
    /// 60 s), the process having `process_completions` completions since
    /// and `progress` progress calls over the window, its peer's counts
    /// `peer` (`None`: unknown).
    #[test]
    fn calls_between_the_sample_before_an_event_and_the_event_are_not_since() {
        let judged = |completed_at_ns: u64| {
            let mut tracker = Tracker::new(4 * S);
            tracker.record(7, 10 * S, totals(0, 0, 0, 10 * S));
            // One completion after that sample; the request's last event at 10.6 s.
            tracker.record(7, 12 * S, totals(0, 1, 0, completed_at_ns));
            let request = stalled(7, Stage::TransferPosted, 10 * S + 600_000_000);
            tracker.evidence(&request, StallClass::TransferHung, None).unwrap()
        };
        // The worker's previous batch, done just before it submits the one that hangs.
        let before = judged(10 * S + 500_000_000);
        assert_eq!((before.since.get(ActivityKind::Completion).calls, before.verdict), (0, Verdict::Idle));
        assert_eq!(before.total.get(ActivityKind::Completion).calls, 1);
        let after = judged(10 * S + 700_000_000);
        assert_eq!((after.since.get(ActivityKind::Completion).calls, after.verdict), (1, Verdict::OthersCompleting));
    }

    fn judged_with_peer(process_completions: u64, progress: u64, peer: Option<(u64, u64)>) -> Evidence {
        let mut tracker = Tracker::new(60 * S);
        tracker.progress_attached(7, Some(10 * S));
        tracker.record(7, 10 * S, totals(1, 0, 0, 10 * S));
        tracker.record(7, 70 * S, totals(1, process_completions, progress, 60 * S));
        let peer = peer.map(|(to_peer, to_others)| PeerCompletions { peer: "decode-0".into(), to_peer, to_others });
        tracker.evidence(&stalled(7, Stage::TransferPosted, 10 * S), StallClass::TransferHung, peer).unwrap()
    }

    #[test]
    fn with_its_peer_known_a_stall_is_judged_by_what_that_peer_completed() {
        // Other peers complete, this one nothing: the peer, where the
        // process's counts would say the request alone is stuck.
        let evidence = judged_with_peer(14, 500, Some((0, 14)));
        assert_eq!(evidence.verdict, Verdict::PeerUnresponsive);
        assert_eq!(judged_with_peer(14, 500, None).verdict, Verdict::OthersCompleting, "per process");
        assert_eq!(
            evidence.summary(),
            "last post 10.0s ago, last completion 10.0s ago, 500 progress calls in the last 60.0s, none to decode-0 completed, 14 to other peers"
        );
        // Whatever progress did: other peers completing prove it is driven.
        assert_eq!(judged_with_peer(14, 0, Some((0, 14))).verdict, Verdict::PeerUnresponsive);
        // The peer completes other transfers: it is alive, this transfer alone is stuck.
        let evidence = judged_with_peer(3, 500, Some((2, 1)));
        assert_eq!(evidence.verdict, Verdict::OthersCompleting);
        assert!(evidence.summary().ends_with("2 to decode-0 completed, 1 to other peers"), "{}", evidence.summary());
        assert_eq!(judged_with_peer(2, 500, Some((2, 0))).verdict, Verdict::OthersCompleting);
        // No peer completed anything: completions of handles with no known
        // peer never make a peer that completed nothing look alive; progress,
        // or neither, as without a peer.
        assert_eq!(judged_with_peer(5, 500, Some((0, 0))).verdict, Verdict::PeerUnresponsive);
        assert_eq!(judged_with_peer(5, 0, Some((0, 0))).verdict, Verdict::PeerUnresponsive);
        assert_eq!(judged_with_peer(0, 500, Some((0, 0))).verdict, Verdict::PeerUnresponsive);
        assert_eq!(judged_with_peer(0, 0, Some((0, 0))).verdict, Verdict::NoProgress);
        let evidence = judged_with_peer(0, 0, Some((0, 0)));
        assert!(
            evidence.summary().ends_with("none to decode-0 completed, none to other peers"),
            "{}",
            evidence.summary()
        );
        assert_eq!(evidence.peer.as_ref().map(|p| &*p.peer), Some("decode-0"));
    }

    /// The stopped prefill of issue 40: with its own threads stopped, what
    /// its transport shows (a peer that completed nothing while others did,
    /// progress driven before the stop, completions just before it) never
    /// blames a peer, and the summary says why first.
    #[test]
    fn a_process_held_itself_is_process_stopped_whatever_its_transport_shows() {
        let halt = Halt::Stopped { threads: 57 };
        let judged = |process_completions, progress, peer: Option<(u64, u64)>, class, stage| {
            let mut tracker = Tracker::new(60 * S);
            tracker.progress_attached(7, Some(10 * S));
            tracker.record(7, 10 * S, totals(1, 0, 0, 10 * S));
            tracker.record(7, 70 * S, totals(1, process_completions, progress, 60 * S));
            let peer = peer.map(|(to_peer, to_others)| PeerCompletions { peer: "decode-0".into(), to_peer, to_others });
            let report =
                Report::Stalled { request: stalled(7, stage, 10 * S), class, silent_ns: 60 * S, at_ns: 70 * S };
            tracker.for_report(&report, |_| peer, Some(halt)).expect("transport probes")
        };
        for (completions, progress, peer) in
            [(14, 500, Some((0, 14))), (3, 500, Some((2, 1))), (0, 0, None), (5, 9, None)]
        {
            for (class, stage) in [
                (StallClass::TransferHung, Stage::TransferPosted),
                (StallClass::ReleaseLost, Stage::TransferDone),
                (StallClass::WaitingForPeer, Stage::Enqueued),
            ] {
                let evidence = judged(completions, progress, peer, class, stage);
                assert_eq!(evidence.verdict, Verdict::ProcessStopped, "{completions} {progress} {peer:?} {class:?}");
                assert_eq!(evidence.halt, Some(halt));
            }
        }
        let evidence = judged(14, 500, Some((0, 14)), StallClass::TransferHung, Stage::TransferPosted);
        assert_eq!(
            evidence.summary(),
            "process stopped (all 57 threads in state T); last post 10.0s ago, last completion 10.0s ago, 500 \
             progress calls in the last 60.0s, none to decode-0 completed, 14 to other peers"
        );
        assert_eq!(Verdict::ProcessStopped.as_str(), "process_stopped");
        // Not held: judged by its transport as before.
        let mut tracker = Tracker::new(60 * S);
        tracker.record(7, 10 * S, totals(1, 0, 0, 10 * S));
        tracker.record(7, 70 * S, totals(1, 0, 0, 60 * S));
        let request = stalled(7, Stage::TransferPosted, 10 * S);
        let report = Report::Stalled { request, class: StallClass::TransferHung, silent_ns: 60 * S, at_ns: 70 * S };
        let evidence = tracker.for_report(&report, |_| None, None).expect("transport probes");
        assert_ne!(evidence.verdict, Verdict::ProcessStopped);
        assert!(evidence.summary().starts_with("posts not watched, last completion"), "{}", evidence.summary());
    }

    #[test]
    fn a_request_with_no_transfer_of_its_own_out_is_never_transfer_hung() {
        use StallClass::*;
        // A room between its chunks (its framework says none of its own is out).
        assert_eq!(refined_class(TransferHung, true), WaitingForPeer);
        // Its own transfer out, or a request no framework knows: its stage's class.
        assert_eq!(refined_class(TransferHung, false), TransferHung);
        for class in [WaitingForPeer, ReleaseLost, WaitingForKv] {
            assert_eq!(refined_class(class, true), class);
        }
    }

    #[test]
    fn a_process_without_transport_probes_has_no_evidence() {
        let mut tracker = Tracker::new(60 * S);
        tracker.observe(&Observation {
            pid: 8,
            key: 1,
            stage: Stage::TransferDone,
            ts_ns: S,
            external_id: None,
            ends: None,
        });
        assert_eq!(tracker.evidence(&stalled(8, Stage::Enqueued, S), StallClass::WaitingForPeer, None), None);
    }

    #[test]
    fn history_is_bounded_and_an_old_request_uses_the_oldest_sample() {
        let mut tracker = Tracker::new(S);
        tracker.progress_attached(7, Some(0));
        for t in 0..100 {
            tracker.record(7, t * S, totals(0, 0, t * 10, t * S));
        }
        let kept = tracker.processes[&7].history.len();
        assert!(kept <= 8, "{kept}");
        let evidence = tracker.evidence(&stalled(7, Stage::Enqueued, 0), StallClass::WaitingForPeer, None).unwrap();
        assert_eq!(
            evidence.since.get(ActivityKind::Progress).calls,
            990 - tracker.processes[&7].history[0].totals.get(ActivityKind::Progress).calls
        );
        assert_eq!(evidence.verdict, Verdict::PeerUnresponsive);
    }

    /// A hung transfer whose request went silent at 10 s, judged at 70 s
    /// (timeout 60 s), with the process's progress probe linked at `attached`
    /// (`None`: not linked) and `calls` progress calls from then on.
    fn hung_with_probe_from(attached: Option<u64>, calls: u64) -> Evidence {
        let mut tracker = Tracker::new(60 * S);
        // Progress before the probe went on is never counted: its slot's
        // count stood still while it was unlinked.
        tracker.record(7, 10 * S, totals(1, 0, 500, 10 * S));
        if let Some(at) = attached {
            tracker.record(7, at, totals(1, 0, 500, 10 * S));
            tracker.progress_attached(7, Some(at));
        }
        tracker.record(7, 70 * S, totals(1, 0, 500 + calls, 70 * S));
        tracker.evidence(&stalled(7, Stage::TransferPosted, 10 * S), StallClass::TransferHung, None).unwrap()
    }

    #[test]
    fn progress_is_counted_only_over_the_window_its_probe_was_attached_and_says_so() {
        let evidence = hung_with_probe_from(Some(40 * S), 3000);
        assert_eq!(evidence.progress_window_ns, Some(30 * S));
        assert_eq!(evidence.since.get(ActivityKind::Progress).calls, 3000);
        assert_eq!(evidence.verdict, Verdict::PeerUnresponsive);
        assert!(evidence.summary().contains("3000 progress calls in the last 30.0s"), "{}", evidence.summary());

        // Attached since half the timeout and no call: nobody drives UCX.
        let evidence = hung_with_probe_from(Some(40 * S), 0);
        assert_eq!(evidence.verdict, Verdict::NoProgress);
        assert!(evidence.summary().contains("0 progress calls in the last 30.0s"), "{}", evidence.summary());
    }

    #[test]
    fn a_probe_attached_too_late_or_not_at_all_never_claims_no_progress() {
        // Linked 0.5 s before the judgement (the minimum is 1 s here): zero
        // calls in it prove nothing.
        let evidence = hung_with_probe_from(Some(69 * S + S / 2), 0);
        assert_eq!(evidence.progress_window_ns, Some(S / 2));
        assert_eq!(evidence.verdict, Verdict::Idle, "nothing seen, and too short a look to say nobody drives progress");
        let evidence = hung_with_probe_from(None, 0);
        assert_eq!(evidence.progress_window_ns, None);
        assert_ne!(evidence.verdict, Verdict::NoProgress);
        assert!(evidence.summary().contains("progress not watched"), "{}", evidence.summary());

        // A short timeout shortens the minimum with it: a quarter of it.
        let mut tracker = Tracker::new(2 * S);
        tracker.record(7, 0, totals(1, 0, 0, 0));
        tracker.record(7, S, totals(1, 0, 0, 0));
        tracker.progress_attached(7, Some(S));
        tracker.record(7, 2 * S, totals(1, 0, 0, 0));
        let evidence = tracker.evidence(&stalled(7, Stage::TransferPosted, 0), StallClass::TransferHung, None).unwrap();
        assert_eq!((evidence.progress_window_ns, evidence.verdict), (Some(S), Verdict::NoProgress));
    }

    /// A request silent since 10 s, judged at 70 s (timeout 60 s), the
    /// post probes linked at 40 s; before, an earlier opening (5-8 s)
    /// counted 4 posts, the last at 8 s. `posts`: (calls, last) from 40 s.
    fn judged_with_posts(class: StallClass, stage: Stage, posts: Option<(u64, u64)>) -> Evidence {
        let mut tracker = Tracker::new(60 * S);
        let mut old = Totals::default();
        old.add(ActivityKind::Post, 4, Some(8 * S));
        old.add(ActivityKind::Progress, 900, Some(8 * S));
        tracker.record(7, 10 * S, old);
        tracker.record(7, 40 * S, old);
        tracker.progress_attached(7, Some(40 * S));
        let mut now = old;
        if let Some((calls, last_ns)) = posts {
            now.add(ActivityKind::Post, calls, Some(last_ns));
        }
        tracker.record(7, 70 * S, now);
        tracker.evidence(&stalled(7, stage, 10 * S), class, None).unwrap()
    }

    #[test]
    fn posts_are_counted_over_the_window_their_probes_were_on_and_the_summary_says_so() {
        // Posts made near the stall: counted, and they tell a request that
        // waits that the transport is busy with others.
        let evidence = judged_with_posts(StallClass::WaitingForPeer, Stage::Enqueued, Some((3, 69 * S + S / 2)));
        assert_eq!(evidence.since.get(ActivityKind::Post).calls, 3);
        assert_eq!(evidence.verdict, Verdict::PeerUnresponsive);
        assert!(
            evidence.summary().starts_with("3 posts in the last 30.0s (last 0.5s ago), "),
            "{}",
            evidence.summary()
        );
        // None in the window: said over the window, never "last post 62.0s
        // ago" of the earlier opening's post (posts made while the probes
        // were off are not known).
        let evidence = judged_with_posts(StallClass::WaitingForPeer, Stage::Enqueued, None);
        assert_eq!((evidence.since.get(ActivityKind::Post).calls, evidence.verdict), (0, Verdict::Idle));
        assert!(evidence.summary().starts_with("no post in the last 30.0s, "), "{}", evidence.summary());
        // A hung transfer is judged on progress and completions, not posts.
        let evidence = judged_with_posts(StallClass::TransferHung, Stage::TransferPosted, None);
        assert_eq!(evidence.verdict, Verdict::NoProgress);
        // Probes off: nothing claimed, the earlier opening's count not "since".
        let mut tracker = Tracker::new(60 * S);
        tracker.record(7, 10 * S, totals(4, 0, 0, 8 * S));
        tracker.record(7, 70 * S, totals(4, 0, 0, 8 * S));
        let evidence =
            tracker.evidence(&stalled(7, Stage::Enqueued, 10 * S), StallClass::WaitingForPeer, None).unwrap();
        assert_eq!((evidence.since.get(ActivityKind::Post).calls, evidence.progress_window_ns), (0, None));
        assert!(evidence.summary().starts_with("posts not watched, "), "{}", evidence.summary());
    }

    #[test]
    fn a_process_without_post_probes_has_no_post_clause() {
        let mut tracker = Tracker::new(60 * S);
        let mut progress = Totals::default();
        progress.add(ActivityKind::Progress, 10, Some(10 * S));
        tracker.record(7, 10 * S, progress);
        tracker.progress_attached(7, Some(10 * S));
        progress.add(ActivityKind::Progress, 500, Some(60 * S));
        tracker.record(7, 70 * S, progress);
        let evidence =
            tracker.evidence(&stalled(7, Stage::TransferPosted, 10 * S), StallClass::TransferHung, None).unwrap();
        assert_eq!(
            evidence.summary(),
            "last completion never, 500 progress calls in the last 60.0s, none completed",
            "a Mooncake process has no post probe: no post count is claimed"
        );
    }

    #[test]
    fn a_request_silent_since_after_the_probe_went_on_counts_from_its_own_event() {
        let mut tracker = Tracker::new(60 * S);
        tracker.record(7, 5 * S, totals(1, 0, 0, 5 * S));
        tracker.progress_attached(7, Some(5 * S));
        tracker.record(7, 10 * S, totals(1, 0, 700, 10 * S));
        tracker.record(7, 70 * S, totals(1, 0, 1700, 70 * S));
        let evidence =
            tracker.evidence(&stalled(7, Stage::TransferPosted, 10 * S), StallClass::TransferHung, None).unwrap();
        assert_eq!(
            (evidence.progress_window_ns, evidence.since.get(ActivityKind::Progress).calls),
            (Some(60 * S), 1000)
        );

        // Unlinked again: nothing is claimed of progress any more.
        tracker.progress_attached(7, None);
        let evidence =
            tracker.evidence(&stalled(7, Stage::TransferPosted, 10 * S), StallClass::TransferHung, None).unwrap();
        assert_eq!((evidence.progress_window_ns, evidence.since.get(ActivityKind::Progress).calls), (None, 0));
    }
}
