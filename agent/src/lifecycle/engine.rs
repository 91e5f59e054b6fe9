//! The engine: applies observations to lifecycles and turns silence into
//! reports. The rules it follows are listed in the [module docs](super).

use std::collections::{HashSet, VecDeque};

use super::index::{Index, Mixer, PidCounts};
use super::recent::RecentLog;
use super::report::{EngineStats, Observation, Report, RequestSnapshot, Restored, Silent, StageRead, Withheld};
use super::slab::{List, MAX_RECORDS, Place, Record, Slab};
use super::stage::{Outcome, Side, Stage, StallClass};
use super::wheel::Wheel;

/// Most recent request ends remembered for stale-event detection.
pub const RECENT_ENDS: usize = 1 << 16;
/// Fewest, however small `max_tracked` is.
pub const RECENT_ENDS_MIN: usize = 256;
/// Most recent process exits remembered for stale-event detection.
pub const RECENT_EXITS: usize = 4096;

/// What [`Engine::advance_reading`] reads the target's memory with: one
/// batch of silent requests in, an answer per request pushed, in order.
pub type ReadBatch<'a> = dyn FnMut(&[Silent], &mut Vec<Option<StageRead>>) + 'a;

/// What [`Engine::advance_checking`] asks the kernel of a request whose
/// stall is due: the events it holds that the engine was not sent.
pub type CheckWithheld<'a> = dyn FnMut(&Silent) -> Option<Withheld> + 'a;

/// The class of a request alerted at `alerted_ns`: that of the furthest
/// stage first seen by then (enqueued's when none was).
fn class_when(stage_ns: &[Option<u64>; 3], alerted_ns: u64) -> StallClass {
    let stage = [Stage::TransferDone, Stage::TransferPosted, Stage::Enqueued]
        .into_iter()
        .find(|stage| stage_ns[*stage as usize].is_some_and(|ns| ns <= alerted_ns))
        .unwrap_or(Stage::Enqueued);
    StallClass::for_stage(stage).unwrap_or(StallClass::WaitingForPeer)
}

/// Tuning of an [`Engine`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Silence after which a request is stalled. 0 stalls a request at the
    /// first `advance` at or after its last event.
    pub timeout_ns: u64,
    /// Most requests tracked at once; at least 1 is used.
    pub max_tracked: usize,
    /// Timer-wheel granularity; the interval `advance` is meant to be
    /// called at. At least 1 is used.
    pub tick_ns: u64,
}

impl Default for EngineConfig {
    /// 60 s timeout, a million requests, 10 ms ticks.
    fn default() -> Self {
        EngineConfig { timeout_ns: 60_000_000_000, max_tracked: 1_000_000, tick_ns: 10_000_000 }
    }
}

/// The lifecycle engine. Single-threaded and synchronous: the event loop
/// owns it, feeds it observations in arrival order and calls
/// [`advance`](Engine::advance) when [`next_due_ns`](Engine::next_due_ns)
/// says something can be due. See the [module docs](super).
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    slab: Slab,
    index: Index,
    wheel: Wheel,
    /// Requests whose `Stalled` went out, oldest stall first: the first
    /// choice for eviction.
    stalled: List,
    pids: PidCounts,
    ends: RecentLog<(u32, u64)>,
    exits: RecentLog<u32>,
    stats: EngineStats,
    /// Records whose stall is due, in the order they came due, waiting for
    /// [`Engine::advance_reading`] to read them (it reads a bounded number
    /// per call). Off every list meanwhile, and the next choice for
    /// eviction after the stalled; checked against the slab when their turn
    /// comes, since one may have ended, had an event or been reused.
    due: VecDeque<Due>,
    /// Scratch for one call's batch of reads: the records, what the reader
    /// is told of each, its answers.
    batch: Vec<u32>,
    silents: Vec<Silent>,
    answers: Vec<Option<StageRead>>,
    /// Processes that serve the decode side ([`Engine::set_side`]); every
    /// other is a prefill. A handful at most.
    decodes: HashSet<u32>,
    /// Set while [`Engine::observe_carried`] applies a carried time.
    carrying: bool,
}

/// A record the wheel found due, and whose it was.
#[derive(Clone, Copy, Debug)]
struct Due {
    i: u32,
    pid: u32,
    key: u64,
}

impl Engine {
    /// An engine with `config`, made usable: `max_tracked` and `tick_ns`
    /// are raised to at least 1 (and `max_tracked` capped at 2^32 - 2);
    /// [`config`](Engine::config) returns what is in force.
    pub fn new(config: EngineConfig) -> Self {
        let config = EngineConfig {
            timeout_ns: config.timeout_ns,
            max_tracked: config.max_tracked.clamp(1, MAX_RECORDS),
            tick_ns: config.tick_ns.max(1),
        };
        let mixer = Mixer::new();
        Engine {
            config,
            slab: Slab::new(),
            index: Index::new(mixer),
            wheel: Wheel::new(config.tick_ns, config.timeout_ns),
            stalled: List::new(),
            pids: PidCounts::new(mixer),
            ends: RecentLog::new(config.max_tracked.clamp(RECENT_ENDS_MIN, RECENT_ENDS), mixer),
            exits: RecentLog::new(RECENT_EXITS, mixer),
            stats: EngineStats::default(),
            due: VecDeque::new(),
            batch: Vec::new(),
            silents: Vec::new(),
            answers: Vec::new(),
            decodes: HashSet::new(),
            carrying: false,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Process `pid` serves `side` of the transfer, which names its
    /// requests' stalls ([`StallClass::on_side`]): said by what follows its
    /// framework's protocol, which tells a decode by what it sends. Until
    /// it exits.
    pub fn set_side(&mut self, pid: u32, side: Side) {
        match side {
            Side::Decode => self.decodes.insert(pid),
            Side::Prefill => self.decodes.remove(&pid),
        };
    }

    fn side(&self, pid: u32) -> Side {
        if self.decodes.contains(&pid) { Side::Decode } else { Side::Prefill }
    }

    /// Apply one observation; reports it causes are appended to `out`.
    pub fn observe(&mut self, obs: Observation, out: &mut Vec<Report>) {
        match self.index.find(self.slab.records(), obs.pid, obs.key) {
            Some(i) => self.observe_tracked(i, obs, out),
            None => self.observe_new(obs, out),
        }
    }

    /// [`Engine::observe`] for a stage time a record carried besides its
    /// own event (what `quiet` probes withheld before it, see **Withheld
    /// events**): the kernel never sent it, so if the engine has that
    /// exact time already, it took it from the kernel's table (a catch-up,
    /// a take-over), and the repeat is expected: counted in
    /// `caught_up_repeats`, never in `duplicate_events`, which stays the
    /// sign of an event really delivered twice.
    pub fn observe_carried(&mut self, obs: Observation, out: &mut Vec<Report>) {
        self.carrying = true;
        self.observe(obs, out);
        self.carrying = false;
    }

    /// Take over a request from the kernel's in-flight table (see
    /// [`Restored`] and the **Restoring** rule in the module docs). Meant
    /// for a fresh engine, before observations.
    pub fn restore(&mut self, request: Restored, out: &mut Vec<Report>) {
        let Restored { pid, key, stage, ended, stage_ns, first_ns, last_ns, external_id, alerted_ns } = request;
        if self.index.find(self.slab.records(), pid, key).is_some() {
            self.stats.duplicate_events += 1;
            return;
        }
        let last_ns = last_ns.max(first_ns);
        let alerted_ns = alerted_ns.filter(|ns| (first_ns..=last_ns).contains(ns));
        if let Some(before) = first_ns.checked_sub(1) {
            self.ends.record((pid, key), before);
        }
        if self.slab.len() >= self.config.max_tracked {
            self.evict_one(last_ns, out);
            if self.slab.len() >= self.config.max_tracked {
                debug_assert!(false, "no eviction victim");
                return;
            }
        }
        let released = (stage == Stage::Released).then_some(last_ns);
        let all_ns = [stage_ns[0], stage_ns[1], stage_ns[2], released];
        let record = Record::restored(pid, key, stage, (first_ns, last_ns), all_ns, external_id);
        let Some(i) = self.slab.alloc(record) else {
            self.stats.stale_events += 1;
            return;
        };
        self.index.insert(self.slab.records(), i);
        self.pids.increment(pid);
        self.stats.seen += 1;
        self.stats.restored += 1;
        self.wheel.start(last_ns);

        if let Some(alerted) = alerted_ns {
            let class = class_when(&stage_ns, alerted);
            if last_ns > alerted {
                // It moved on while no agent ran: the recovery is news.
                let next = stage_ns.iter().flatten().copied().filter(|&ns| ns > alerted).min().unwrap_or(last_ns);
                self.stats.recovered += 1;
                out.push(Report::Recovered { request: self.slab.get(i).snapshot(), class, stuck_ns: next - alerted });
            } else {
                // Still inside the silence that was reported: stalled, quietly.
                self.slab.get_mut(i).set_place(Place::Stalled(class));
                self.stalled.push_back(self.slab.records_mut(), i);
            }
        }
        if let Some(outcome) = Outcome::of_event(stage, ended.then_some(Outcome::Completed)) {
            self.end(i, outcome, last_ns, last_ns, out);
        } else if self.slab.get(i).place() == Place::Detached {
            self.arm(i, last_ns);
        }
    }

    /// Put record `i` on the wheel for its timeout after an event at
    /// `last_ns`.
    fn arm(&mut self, i: u32, last_ns: u64) {
        let deadline = last_ns.saturating_add(self.config.timeout_ns);
        self.wheel.insert(self.slab.records_mut(), i, deadline);
    }

    /// Fire every timer due at `now_ns` (monotonic ns, same clock as ts_ns).
    /// Work proportional to the ticks crossed and the timers due, never to
    /// the number of tracked requests.
    pub fn advance(&mut self, now_ns: u64, out: &mut Vec<Report>) {
        self.advance_reading(now_ns, usize::MAX, &mut |batch, answers| answers.extend(batch.iter().map(|_| None)), out);
    }

    /// [`Engine::advance`], reading the state of each request whose stall
    /// is due (see **State reads** in the module docs), at most `budget` of
    /// them per call: the others wait, oldest due first, for the next
    /// calls, so a mass stall costs each tick a bounded amount of reading
    /// and is reported over a few ticks. `read` gets one batch and pushes
    /// an answer per request, in order: the stage the target's memory shows,
    /// `None` when it cannot tell (nothing to read, unreadable, no rule
    /// matched, no longer the same request).
    pub fn advance_reading(&mut self, now_ns: u64, budget: usize, read: &mut ReadBatch<'_>, out: &mut Vec<Report>) {
        self.advance_checking(now_ns, budget, &mut |_| None, read, out);
    }

    /// [`Engine::advance_reading`], asking `withheld` first about each
    /// request whose stall is due (see **Withheld events** in the module
    /// docs): one the kernel saw active since is armed again, one still
    /// silent is read and stalled with what the kernel saw.
    pub fn advance_checking(
        &mut self,
        now_ns: u64,
        budget: usize,
        withheld: &mut CheckWithheld<'_>,
        read: &mut ReadBatch<'_>,
        out: &mut Vec<Report>,
    ) {
        let due = &mut self.due;
        self.wheel.advance(self.slab.records_mut(), now_ns, |recs, i| {
            let r = &recs[i as usize];
            due.push_back(Due { i, pid: r.pid, key: r.key });
        });
        let (mut batch, mut silents, mut answers) =
            (std::mem::take(&mut self.batch), std::mem::take(&mut self.silents), std::mem::take(&mut self.answers));
        batch.clear();
        silents.clear();
        answers.clear();
        while batch.len() < budget {
            let Some(i) = self.pop_due() else {
                break;
            };
            let r = self.slab.get(i);
            // An event came while it waited: due again later (the wheel's
            // own test of silence).
            if now_ns.checked_sub(r.last_ns).is_none_or(|silent| silent < self.config.timeout_ns) {
                let last_ns = r.last_ns;
                self.arm(i, last_ns);
                continue;
            }
            let silent = r.silent();
            let silent = match withheld(&silent) {
                Some(seen) => {
                    let r = self.slab.get_mut(i);
                    r.catch_up(&seen);
                    self.stats.caught_up += 1;
                    if now_ns.saturating_sub(r.last_ns) < self.config.timeout_ns {
                        let last_ns = r.last_ns;
                        self.arm(i, last_ns);
                        continue;
                    }
                    Silent { stage: r.stage(), last_ns: r.last_ns, ..silent }
                }
                None => silent,
            };
            batch.push(i);
            silents.push(silent);
        }
        if !batch.is_empty() {
            read(&silents, &mut answers);
        }
        for (n, &i) in batch.iter().enumerate() {
            if let Some(found) = answers.get(n).copied().flatten() {
                if !self.apply_read(i, found, now_ns, out) {
                    continue;
                }
            }
            self.stall(i, now_ns, out);
        }
        (self.batch, self.silents, self.answers) = (batch, silents, answers);
    }

    /// The oldest entry of the due queue that is still the request it was
    /// queued for: those that ended meanwhile (their record free, or
    /// another request's now) or were stalled by an earlier entry of the
    /// same record are dropped on the way.
    fn pop_due(&mut self) -> Option<u32> {
        while let Some(Due { i, pid, key }) = self.due.pop_front() {
            let r = self.slab.get(i);
            if r.place() == Place::Detached && r.pid == pid && r.key == key {
                return Some(i);
            }
        }
        None
    }

    /// What a read of the target's memory says of the silent record `i`:
    /// a later live stage is inferred (timed at the read, not activity); a
    /// terminal one, or one that ends the lifecycle, ends it at the read.
    /// Returns whether the request is still tracked.
    fn apply_read(&mut self, i: u32, StageRead { stage, ends }: StageRead, now_ns: u64, out: &mut Vec<Report>) -> bool {
        let Some(outcome) = Outcome::of_event(stage, ends.then_some(Outcome::Completed)) else {
            self.slab.get_mut(i).infer_stage(stage, now_ns);
            return true;
        };
        if outcome == Outcome::Completed {
            // An earlier stage than the probes saw says nothing of it:
            // classified by what they saw, as any read of an earlier stage.
            if stage < self.slab.get(i).stage() {
                return true;
            }
            // Timed (and marked inferred) at the read unless a probe saw it.
            self.slab.get_mut(i).infer_stage(stage, now_ns);
            self.end(i, outcome, now_ns, now_ns, out);
            return false;
        }
        self.slab.get_mut(i).set_stage(stage);
        self.end(i, outcome, now_ns, now_ns, out);
        if let Some(Report::Ended { request, .. }) = out.last_mut() {
            request.inferred.insert(stage);
        }
        false
    }

    /// Report the silent record `i` (on no list) stalled, by its stage.
    fn stall(&mut self, i: u32, now_ns: u64, out: &mut Vec<Report>) {
        let side = self.side(self.slab.get(i).pid);
        let r = self.slab.get_mut(i);
        // A tracked record's stage is never terminal, so this is always
        // Some; should that ever break, the request stays visible as
        // stalled (the safe failure) rather than silently unarmed.
        let class = StallClass::on_side(r.stage(), side).unwrap_or(StallClass::ReleaseLost);
        r.set_place(Place::Stalled(class));
        let silent_ns = now_ns.saturating_sub(r.last_ns);
        let request = r.snapshot();
        self.stalled.push_back(self.slab.records_mut(), i);
        self.stats.stalled += 1;
        out.push(Report::Stalled { request, class, silent_ns, at_ns: now_ns });
    }

    /// The process is gone: every request it still held ends with
    /// Outcome::ProcessExited.
    ///
    /// This scans the record store (stopping once it has found as many as
    /// the pid held): exits of traced processes are rare, and a per-pid
    /// list would cost 8 bytes on every request to speed up only this. A pid
    /// that holds nothing returns at once, so hearing of every exit on the
    /// host is cheap. The exit is remembered, so events of the dead process
    /// still in the pipeline (`ts_ns <= now_ns`) are stale rather than
    /// starting lifecycles that could never end.
    pub fn process_exited(&mut self, pid: u32, now_ns: u64, out: &mut Vec<Report>) {
        self.exits.record(pid, now_ns);
        self.decodes.remove(&pid);
        let mut left = self.pids.get(pid);
        if left == 0 {
            return;
        }
        let mut i = 0u32;
        while left > 0 && (i as usize) < self.slab.records().len() {
            let r = self.slab.get(i);
            if r.pid == pid && r.place() != Place::Free {
                let end_ns = r.last_ns.max(now_ns);
                self.end(i, Outcome::ProcessExited, now_ns, end_ns, out);
                left -= 1;
            }
            i += 1;
        }
    }

    /// Bring the tracked requests (of `pid` only, with `Some`) up to what
    /// `withheld` says the kernel holds of them (see **Withheld events** in
    /// the module docs): before a gone process's requests end, so each
    /// ends at the stage it had got to, and before a query lists requests
    /// not yet due. A stalled one is left as it is: its every later event
    /// is sent. A timer re-arms itself lazily from the later `last_ns`.
    pub fn catch_up(&mut self, pid: Option<u32>, withheld: &mut CheckWithheld<'_>) {
        for i in 0..self.slab.records().len() as u32 {
            let r = self.slab.get(i);
            if r.place() == Place::Free || r.stalled().is_some() || pid.is_some_and(|pid| pid != r.pid) {
                continue;
            }
            if let Some(seen) = withheld(&r.silent()) {
                self.slab.get_mut(i).catch_up(&seen);
                self.stats.caught_up += 1;
            }
        }
    }

    /// Bring the engine back in step with the kernel's in-flight table
    /// after events were lost (the ring buffer was full): see
    /// **Resynchronising** in the module docs. `held` answers, for a
    /// tracked request, the kernel's entry of its key now (`Err`: the
    /// table could not be asked, the request is left as it is); `table`
    /// is every entry the kernel held when the caller began to read it, at
    /// `since_ns` or later; `complete`: the table refused no lifecycle
    /// (never full), so one it does not hold has ended. Requests with an
    /// event at or after `since_ns` are newer than the table's view and
    /// left as they are.
    pub fn resync(
        &mut self,
        since_ns: u64,
        complete: bool,
        held: &mut dyn FnMut(u32, u64) -> Result<Option<Restored>, ()>,
        table: Vec<Restored>,
        out: &mut Vec<Report>,
    ) {
        self.stats.resyncs += 1;
        for i in 0..self.slab.records().len() as u32 {
            let r = self.slab.get(i);
            if r.place() == Place::Free || r.last_ns >= since_ns {
                continue;
            }
            let (pid, key, last_ns, stalled) = (r.pid, r.key, r.last_ns, r.stalled().is_some());
            let Ok(entry) = held(pid, key) else { continue };
            match entry {
                // This lifecycle, still live: what the kernel saw since.
                Some(k) if !k.ended && k.first_ns <= last_ns => {
                    if k.last_ns <= last_ns {
                        continue;
                    }
                    if stalled {
                        // Life after a reported silence: its events, in
                        // order, recover it as they would have.
                        let mut seen: Vec<(u64, Stage)> = Stage::LIVE
                            .into_iter()
                            .filter_map(|stage| {
                                k.stage_ns[stage as usize].filter(|&ns| ns > last_ns).map(|ns| (ns, stage))
                            })
                            .collect();
                        if seen.iter().all(|&(ns, _)| ns < k.last_ns) {
                            seen.push((k.last_ns, k.stage));
                        }
                        seen.sort_unstable();
                        for (ts_ns, stage) in seen {
                            let observation = Observation { pid, key, stage, ts_ns, external_id: None, ends: None };
                            self.observe_tracked(i, observation, out);
                        }
                    } else {
                        let seen = Withheld { stage: k.stage, last_ns: k.last_ns, stage_ns: k.stage_ns };
                        self.slab.get_mut(i).catch_up(&seen);
                        self.stats.caught_up += 1;
                    }
                }
                // This lifecycle, ended (kept for a stall alert): its end.
                Some(k) if k.first_ns <= last_ns => {
                    let ts_ns = k.last_ns.max(last_ns);
                    self.observe_tracked(
                        i,
                        Observation {
                            pid,
                            key,
                            stage: k.stage,
                            ts_ns,
                            external_id: None,
                            ends: Some(Outcome::Completed),
                        },
                        out,
                    );
                }
                // A later lifecycle of the key began: this one ended.
                Some(_) => self.end(i, Outcome::EndUnseen, last_ns, last_ns, out),
                None if complete => self.end(i, Outcome::EndUnseen, last_ns, last_ns, out),
                // It may never have had an entry (a full table): left.
                None => {}
            }
        }
        // What the kernel holds that the engine never heard of (its events
        // lost): taken over as at a restart. An entry it ended itself since
        // (released, read, evicted) is a lifecycle already over.
        for request in table {
            let (pid, key) = (request.pid, request.key);
            if request.ended
                || self.index.find(self.slab.records(), pid, key).is_some()
                || self.ended_after(pid, key, request.last_ns)
            {
                continue;
            }
            self.restore(request, out);
        }
    }

    /// Every tracked request (any order); the query layer sorts.
    pub fn inflight(&self) -> impl Iterator<Item = RequestSnapshot> + '_ {
        self.slab.live().map(|(_, r)| r.snapshot())
    }

    /// When the next [`advance`](Engine::advance) can report something, for
    /// a caller that sleeps until then instead of ticking: the next tick
    /// when requests wait for the read budget, else the end of the earliest
    /// tick holding a deadline (see [`Wheel::next_due_ns`]), `None` when
    /// nothing is armed. Events arriving later can only add later
    /// deadlines: a request's deadline is a whole timeout after its event.
    pub fn next_due_ns(&self, now_ns: u64) -> Option<u64> {
        if !self.due.is_empty() {
            return Some(now_ns.saturating_add(self.config.tick_ns));
        }
        self.wheel.next_due_ns()
    }

    /// The pids holding a request silent since `cutoff_ns` or earlier,
    /// stalled or not (for the progress-probe gate). A scan of the record
    /// store: the gate runs it a few times a second, not per event.
    pub fn pids_silent_since(&self, cutoff_ns: u64) -> std::collections::HashSet<u32> {
        self.slab.live().filter(|(_, r)| r.last_ns <= cutoff_ns).map(|(_, r)| r.pid).collect()
    }

    /// Counters, and the number of requests tracked now.
    pub fn stats(&self) -> EngineStats {
        debug_assert_eq!(self.index.len(), self.slab.len());
        EngineStats { in_flight: self.slab.len() as u64, ..self.stats }
    }

    /// The stalled request (pid, key) is of `class`: what its framework
    /// knows refined the class its stage gave it (a room between its
    /// chunks is no `transfer_hung`, [`crate::evidence::transport::refined_class`]),
    /// so its recovery, the kernel's table and `inflight` say what its
    /// alert said. Returns whether it was a stalled request.
    pub fn reclass(&mut self, pid: u32, key: u64, class: StallClass) -> bool {
        let Some(i) = self.index.find(self.slab.records(), pid, key) else { return false };
        let r = self.slab.get_mut(i);
        if r.stalled().is_none() {
            return false;
        }
        r.set_place(Place::Stalled(class));
        true
    }

    /// The tracked request (pid, key), if any.
    pub fn get(&self, pid: u32, key: u64) -> Option<RequestSnapshot> {
        self.index.find(self.slab.records(), pid, key).map(|i| self.slab.get(i).snapshot())
    }

    /// Requests tracked now (the same as `stats().in_flight`).
    pub fn len(&self) -> usize {
        self.slab.len()
    }

    /// Whether no request is tracked.
    pub fn is_empty(&self) -> bool {
        self.slab.len() == 0
    }

    /// An event for an untracked (pid, key).
    fn observe_new(&mut self, obs: Observation, out: &mut Vec<Report>) {
        let Observation { pid, key, stage, ts_ns, external_id, ends } = obs;
        let outcome = Outcome::of_event(stage, ends);
        // Only an event that leaves it live can open a lifecycle: an end
        // of something never tracked carries nothing to report (the
        // release of a lifecycle complete at transfer_done among them).
        if outcome.is_some() || self.ended_after(pid, key, ts_ns) {
            self.stats.stale_events += 1;
            return;
        }
        if self.slab.len() >= self.config.max_tracked {
            self.evict_one(ts_ns, out);
            if self.slab.len() >= self.config.max_tracked {
                // Unreachable: every tracked request is on the wheel, the
                // stalled list or the due queue, so there is always a
                // victim. The cap wins.
                debug_assert!(false, "no eviction victim");
                return;
            }
        }
        let Some(i) = self.slab.alloc(Record::new(pid, key, stage, ts_ns, external_id)) else {
            // Unreachable with max_tracked capped below MAX_RECORDS; if it
            // ever happens the event is dropped, never a panic.
            self.stats.stale_events += 1;
            return;
        };
        self.index.insert(self.slab.records(), i);
        self.pids.increment(pid);
        self.stats.seen += 1;
        self.wheel.start(ts_ns);
        self.arm(i, ts_ns);
    }

    /// An event for the tracked record `i`.
    fn observe_tracked(&mut self, i: u32, obs: Observation, out: &mut Vec<Report>) {
        let Observation { stage, ts_ns, external_id, ends, .. } = obs;
        let outcome = Outcome::of_event(stage, ends);
        let r = self.slab.get(i);
        // Older than this lifecycle and no later than the previous end of
        // the same (pid, key): a straggler of the previous lifecycle that
        // lost the race with this one's first event.
        if ts_ns < r.first_ns && self.ended_after(r.pid, r.key, ts_ns) {
            self.stats.stale_events += 1;
            return;
        }
        if r.stage_ts(stage) == Some(ts_ns) || (stage == r.stage() && ts_ns == r.last_ns) {
            if self.carrying {
                self.stats.caught_up_repeats += 1;
            } else {
                self.stats.duplicate_events += 1;
            }
            return;
        }

        if let Some(outcome) = outcome.filter(|outcome| outcome.is_judgement()) {
            let end_ns = self.slab.get(i).last_ns;
            self.end(i, outcome, ts_ns.max(end_ns), end_ns, out);
            return;
        }
        let r = self.slab.get_mut(i);
        if r.external_id.is_none() {
            r.external_id = external_id;
        }
        let before = r.last_ns;
        r.first_ns = r.first_ns.min(ts_ns);
        r.last_ns = r.last_ns.max(ts_ns);
        r.note_stage_ts(stage, ts_ns);
        r.set_stage(r.stage().max(stage));
        let place = r.place();

        // Life after a reported silence ends the episode. An event dated at
        // or before the last one is late news from inside the silence, not
        // life after it: it is recorded, and the request stays stalled.
        if let Place::Stalled(class) = place {
            if ts_ns > before {
                self.stalled.unlink(self.slab.records_mut(), i);
                self.slab.get_mut(i).set_place(Place::Detached);
                self.stats.recovered += 1;
                out.push(Report::Recovered { request: self.slab.get(i).snapshot(), class, stuck_ns: ts_ns - before });
                if outcome.is_none() {
                    self.arm(i, ts_ns);
                }
            }
        }
        // Otherwise the wheel entry stays where it is: it re-arms itself
        // lazily from `last_ns` when its bucket comes due.

        if let Some(outcome) = outcome {
            let end_ns = self.slab.get(i).last_ns;
            self.end(i, outcome, ts_ns, end_ns, out);
        }
    }

    /// Whether (pid, key) or pid is known to have ended at or after `ts_ns`.
    fn ended_after(&self, pid: u32, key: u64, ts_ns: u64) -> bool {
        self.ends.get((pid, key)).is_some_and(|end| ts_ns <= end)
            || self.exits.get(pid).is_some_and(|exit| ts_ns <= exit)
    }

    /// Make room for one more request: the oldest stall if any (its alert
    /// already went out), else the oldest whose stall is due but not read
    /// yet, else the request silent longest.
    fn evict_one(&mut self, at_ns: u64, out: &mut Vec<Report>) {
        let victim = match self.stalled.first() {
            Some(i) => Some(i),
            None => self.pop_due().or_else(|| self.wheel.oldest(self.slab.records_mut())),
        };
        if let Some(i) = victim {
            let last_ns = self.slab.get(i).last_ns;
            self.end(i, Outcome::Evicted, at_ns.max(last_ns), last_ns, out);
        }
    }

    /// End the tracked record `i`: off its list, out of the index, into the
    /// recent ends (stale before `end_ns`), counted, reported, freed.
    fn end(&mut self, i: u32, outcome: Outcome, at_ns: u64, end_ns: u64, out: &mut Vec<Report>) {
        match self.slab.get(i).place() {
            Place::Wheel => self.wheel.remove(self.slab.records_mut(), i),
            Place::Stalled(_) => {
                // The snapshot below still says stalled: it ended stuck.
                self.stalled.unlink(self.slab.records_mut(), i);
            }
            Place::Detached | Place::Free => {}
        }
        self.index.remove(self.slab.records(), i);
        let r = self.slab.get_mut(i);
        let (pid, key) = (r.pid, r.key);
        let request = RequestSnapshot { external_id: r.external_id.take(), ..r.snapshot() };
        r.set_place(Place::Detached);
        self.slab.free(i);
        self.pids.decrement(pid);
        self.ends.record((pid, key), end_ns);
        let counter = match outcome {
            Outcome::Released => &mut self.stats.completed,
            Outcome::Completed => {
                self.stats.completed_unreleased += 1;
                &mut self.stats.completed
            }
            Outcome::Aborted => &mut self.stats.aborted,
            Outcome::Failed => &mut self.stats.failed,
            Outcome::ProcessExited => &mut self.stats.process_exited,
            Outcome::Evicted => &mut self.stats.evicted,
            Outcome::EndUnseen => &mut self.stats.end_unseen,
            Outcome::LeaseExpired => &mut self.stats.lease_expired,
            Outcome::KvReadAfterRelease => &mut self.stats.kv_read_after_release,
            Outcome::Leaked => &mut self.stats.leaked,
        };
        *counter += 1;
        out.push(Report::Ended { request, outcome, at_ns });
    }
}
