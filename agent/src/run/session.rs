//! The session: everything one run holds (the engine, the probes, the
//! kernel's table, the evidence readers, the outputs) and the steps the
//! event loop takes on it: watch and unwatch a process, take over what a
//! previous agent left, read the ring buffer, judge silence, emit reports.
use std::{collections::HashMap, io::Write, os::fd::OwnedFd, time::Duration};

use anyhow::{Context as _, Result};
use stallwatch_common::Event;
use tokio::{io::unix::AsyncFd, sync::mpsc};
use tracing::{error, info, warn};

use super::{
    OnExit,
    ingest::Ingest,
    processes::{Gone, Processes, process_name, shown_name},
    reads::Read,
    rules::ProfileId,
};
use crate::{
    evidence::{
        gate::{Change, Gate, Opener},
        sched::Scheduling,
        status::{StatusReader, StatusReads},
        transport::{self, Tracker},
    },
    export::{
        alert::{AlertWriter, Format, Shortfalls},
        queue::{self, LineQueue},
        telemetry::Telemetry,
    },
    frameworks::{Claim, signals::Signals},
    kernel::{
        KernelCounters, Probes,
        detach::Detacher,
        ring::{EventReader, Losses},
        state::KernelState,
    },
    lifecycle::{Engine, EngineConfig, Observation, Outcome, Report, Restored, Side, Silent, StageRead, Withheld},
    profile::{Profile, plan::Plan},
    util::clock::{Clock, monotonic_ns, process_start_ns},
    util::warned::Warned,
};

/// Everything one run holds, with the steps the loop takes on it.
pub(super) struct Session {
    pub(super) engine: Engine,
    pub(super) transport: Tracker,
    /// Whether a watched process is itself stopped, throttled or not
    /// scheduled, read when its stalls are judged.
    pub(super) sched: Scheduling,
    /// When each process's progress probes are linked.
    pub(super) gate: Gate,
    /// Links them off the loop.
    pub(super) opener: Opener,
    /// Drops the links of processes gone off the loop.
    pub(super) detacher: Detacher,
    /// Alert lines, handed to stdout's writer thread ([`LineQueue`]).
    pub(super) alerts: AlertWriter<LineQueue>,
    /// Dropped alert lines the last warning covered.
    pub(super) alert_drops: Warned,
    /// Alert lines whose write failed, likewise.
    pub(super) alert_failures: Warned,
    pub(super) telemetry: Telemetry,
    pub(super) probes: Probes,
    /// The kernel's in-flight table, kept in step with the reports.
    pub(super) state: KernelState,
    pub(super) reader: EventReader,
    /// Each profile's `[status]`, read for requests whose stall is due; by
    /// [`ProfileId`], as `profiles`.
    status: Vec<Option<StatusReader>>,
    /// The profiles the rules name, by [`ProfileId`].
    pub(super) profiles: Vec<Profile>,
    /// Attached processes: their names and the tasks waiting on their
    /// pidfds.
    pub(super) processes: Processes,
    pub(super) reports: Vec<Report>,
    pub(super) ingest: Ingest,
    /// Where the profiles' `[[signal]]` hits go.
    pub(super) signals: Signals,
    /// The kernel's loss counts the engine was last brought in step with.
    pub(super) synced: Synced,
    /// Processes a selector matched that could not be watched.
    pub(super) refused: u64,
}

/// The kernel counts that say whether the engine is in step with the
/// kernel's in-flight table ([`Session::sync`]).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Synced {
    /// `ringbuf_full` when the engine was last in step (or at start).
    pub(super) ringbuf_full: u64,
    /// `state_full` at start: once it grows, the table may lack a request
    /// the probes saw begin, so one it does not hold is not known to have
    /// ended.
    pub(super) state_full: u64,
}

impl Session {
    /// Everything the steps need, around the loaded eBPF object
    /// ([`Probes::load`], which took over a previous agent's pinned maps);
    /// no process is watched yet. Also the stream of watched pids that exit.
    pub(super) fn start(
        profiles: Vec<Profile>,
        limits: EngineConfig,
        format: Format,
        out: impl Write + Send + 'static,
        clock: Clock,
        telemetry: Telemetry,
        mut probes: Probes,
    ) -> Result<(Self, mpsc::UnboundedReceiver<u32>)> {
        probes.set_quiet_gap(limits.timeout_ns / 2);
        let state = probes.kernel_state()?;
        let reader = EventReader::new(&mut probes)?;
        let (processes, exits) = Processes::new();
        let alerts = AlertWriter::new(
            LineQueue::start(out).context("starting the thread that writes alerts to stdout")?,
            format,
            clock,
        )
        .with_workloads(telemetry.workloads());
        let session = Self {
            engine: Engine::new(limits),
            transport: Tracker::new(limits.timeout_ns),
            sched: Scheduling::default(),
            gate: Gate::new(limits.timeout_ns, limits.tick_ns),
            opener: Opener::default(),
            detacher: Detacher::default(),
            alerts,
            alert_drops: Warned::default(),
            alert_failures: Warned::default(),
            telemetry,
            probes,
            state,
            reader,
            status: profiles
                .iter()
                .map(|profile| profile.status.clone().map(|spec| StatusReader::new(spec, profile.complete_at)))
                .collect(),
            signals: Signals::new(limits.timeout_ns),
            profiles,
            processes,
            reports: Vec::new(),
            ingest: Ingest::default(),
            synced: Synced::default(),
            refused: 0,
        };
        Ok((session, exits))
    }

    /// Attach profile `id` to `pid` and learn when it exits.
    /// `plan` is what was read of its objects for that profile
    /// ([`super::reads`]), `exited` its pidfd, opened before that read: if
    /// the pid is reused after an exit, the pidfd still refers to the
    /// process read.
    pub(super) fn watch(&mut self, plan: &Plan, id: ProfileId, exited: AsyncFd<OwnedFd>) -> Result<()> {
        let pid = plan.image.pid;
        if self.processes.contains(pid) {
            return Ok(());
        }
        let profile = &self.profiles[id.0];
        let probes = if self.processes.foreign_build(plan, profile) {
            let probes = self.probes.attach(plan, &profile.without_offsets())?;
            if let Some(status) = &mut self.status[id.0] {
                status.turn_off(pid);
            }
            probes
        } else {
            self.probes.attach(plan, profile)?
        };
        self.signals.attached(pid, &plan.lineage, profile);
        let name = shown_name(pid, &plan.lineage);
        self.alerts.name_process(pid, &name, &profile.name);
        self.telemetry.name_process(pid, &profile.name);
        self.processes.insert(pid, name.clone(), id, exited);
        info!(
            pid,
            process = %crate::util::text::value(&name),
            profile = %profile.name,
            probes,
            timeout = %humantime::format_duration(Duration::from_nanos(self.engine.config().timeout_ns)),
            "watching"
        );
        Ok(())
    }

    /// [`Self::watch`] for discovered processes: one that cannot be
    /// watched (its objects could not be read in time, it lacks a symbol,
    /// it exited meanwhile) is logged once and counted, and the agent goes
    /// on with the others. Whether it is watched.
    pub(super) fn watch_or_log(&mut self, read: Read) -> bool {
        match read.plan.and_then(|(plan, exited)| self.watch(&plan, read.profile, exited)) {
            Ok(()) => true,
            Err(err) => {
                self.refuse(read.pid, &err);
                false
            }
        }
    }

    /// A selected process that cannot be watched: said once, counted in
    /// the summary's `refused_processes`.
    pub(super) fn refuse(&mut self, pid: u32, err: &anyhow::Error) {
        self.refused += 1;
        error!(pid, "not watching: {err:#}");
    }

    /// The profile `pid` is watched with, if it is.
    pub(super) fn profile_of(&self, pid: u32) -> Option<&Profile> {
        self.processes.profile(pid).map(|id| &self.profiles[id.0])
    }

    /// How the `[status]` reads went, over every profile that has one.
    pub(super) fn status_reads(&self) -> Option<StatusReads> {
        let mut readers = self.status.iter().flatten().peekable();
        readers.peek()?;
        Some(readers.map(StatusReader::reads).sum())
    }

    /// One warning a counter period for what the `[status]` reads could not
    /// tell since the last one.
    pub(super) fn warn_status(&mut self) {
        for status in self.status.iter_mut().flatten() {
            status.warn();
        }
    }

    /// Take over the requests the kernel's in-flight table holds (a
    /// previous agent's, or begun while none ran). Those of processes gone
    /// meanwhile end `process_exited`, and so do those of a pid reused
    /// since: a process that started after a request's last event is not
    /// the one that held it. Those of live processes this agent does not
    /// watch are dropped.
    pub(super) fn restore(&mut self) -> Result<()> {
        let requests = self.state.snapshot()?;
        let contexts = self.state.pinned_contexts()?;
        if requests.is_empty() {
            for (pid, key) in contexts.into_keys() {
                self.state.pin_context(pid, key, None);
            }
            return Ok(());
        }
        let now = monotonic_ns();
        // pid -> when its process now started (`None`: no such process).
        let mut started: HashMap<u32, Option<u64>> = HashMap::new();
        let (mut taken, mut ended, mut unwatched) = (Vec::new(), Vec::new(), Vec::new());
        // pid -> when its holder is known to have exited.
        let mut exits: HashMap<u32, u64> = HashMap::new();
        for request in requests {
            let pid = request.pid;
            match *started.entry(pid).or_insert_with(|| process_start_ns(pid)) {
                None => {
                    exits.insert(pid, now);
                    ended.push(request);
                }
                Some(start) if request.last_ns < start => {
                    // By the time the pid's new process started.
                    exits.entry(pid).or_insert(start);
                    ended.push(request);
                }
                Some(_) if self.processes.contains(pid) => taken.push(request),
                Some(_) => {
                    if !unwatched.contains(&pid) {
                        unwatched.push(pid);
                    }
                }
            }
        }
        let (reused, gone): (Vec<_>, Vec<_>) =
            exits.keys().partition(|pid| started.get(pid).is_some_and(Option::is_some));
        for pid in gone.iter().chain(&unwatched) {
            self.state.forget_process(*pid)?;
        }
        // The ended first: `process_exited` ends every request the engine
        // holds for the pid, and a reused pid's own requests come next.
        for request in ended {
            self.engine.restore(request, &mut self.reports);
        }
        for (&pid, &exit_ns) in &exits {
            self.engine.process_exited(pid, exit_ns, &mut self.reports);
        }
        // The frameworks take over their own requests and what is left of
        // them; the engine follows the rest.
        let taken_over = self.signals.take_over(taken, contexts, |pid| exits.contains_key(&pid));
        for &(pid, key) in &taken_over.stale {
            self.state.pin_context(pid, key, None);
        }
        let taken_count = taken_over.requests.len();
        for request in taken_over.requests {
            self.engine.restore(request, &mut self.reports);
        }
        // Which side each process serves, as its frameworks' traffic tells:
        // a decode's silent room waits for its KV.
        for pid in self.processes.pids().collect::<Vec<_>>() {
            self.engine.set_side(pid, self.signals.side(pid));
        }
        for pid in unwatched {
            info!(pid, "in-flight requests of a process this agent does not watch are dropped");
        }
        for pid in &reused {
            info!(pid, "in-flight requests of an earlier process with a reused pid end process_exited");
        }
        info!(
            requests = taken_count,
            with_context = taken_over.with_context,
            parts = taken_over.parts,
            leftovers = taken_over.leftovers,
            exited = gone.len(),
            reused = reused.len(),
            "took over the requests in flight in the kernel"
        );
        // Read what the ring buffer gathered before the take-over's reports
        // are applied: a lifecycle that ended while no agent ran leaves the
        // table only once its events are read, so an agent killed now
        // leaves both for the next one, never its events alone (which would
        // read as a new lifecycle and end it twice).
        self.drain();
        self.emit()
    }

    /// Read the ring buffer, and if events were lost since the engine was
    /// last in step with the kernel, resynchronise with the kernel's
    /// in-flight table (see **Resynchronising** in the lifecycle docs)
    /// before anything is judged: a request whose end was lost would read
    /// as stalled, and one whose every event was lost would never be seen.
    /// One read of the loss counters a call; the table only after a loss.
    pub(super) fn sync(&mut self) {
        self.drain();
        let counters = match self.probes.counters() {
            Ok(counters) => counters,
            Err(err) => {
                warn!("reading the kernel's loss counters (lost events cannot be resynchronised): {err:#}");
                return;
            }
        };
        if counters.ringbuf_full <= self.synced.ringbuf_full {
            return;
        }
        // Before the table is read: what the probes do from here on is
        // newer than its view.
        let since = monotonic_ns();
        let table = match self.state.snapshot() {
            Ok(table) => table,
            Err(err) => {
                warn!(
                    "reading the kernel's in-flight table to resynchronise after lost events (retried at the next wake): {err:#}"
                );
                return;
            }
        };
        // Ends submitted while the table was read come through the ring.
        self.drain();
        // A handle that is part of a framework's request (a room's) is
        // that request's, never one of its own the engine never heard of.
        let watched: Vec<Restored> = table.into_iter().filter(|r| self.processes.contains(r.pid)).collect();
        let engine = &self.engine;
        let table = self.signals.resync(watched, |pid, key| engine.get(pid, key).is_some());
        let complete = counters.state_full <= self.synced.state_full && self.state.untracked() == 0;
        let before = self.engine.stats();
        let state = &self.state;
        self.engine.resync(
            since,
            complete,
            &mut |pid, key| state.entry(pid, key).map_err(|_| ()),
            table,
            &mut self.reports,
        );
        let after = self.engine.stats();
        info!(
            lost = counters.ringbuf_full - self.synced.ringbuf_full,
            ended_unseen = after.end_unseen - before.end_unseen,
            taken_over = after.restored - before.restored,
            caught_up = after.caught_up - before.caught_up,
            table_complete = complete,
            "events were lost (the ring buffer was full): resynchronised with the kernel's in-flight table"
        );
        self.synced.ringbuf_full = counters.ringbuf_full;
    }

    /// Read every event the ring buffer holds, each signal to its consumer
    /// and each lifecycle event to the engine. The programs submit without
    /// waking the agent (it costs the target more than the event), so
    /// this runs whenever the loop wakes (see [`Self::next_wake`]); the
    /// kernel wakes [`EventReader::readable`] only when the buffer fills
    /// past a quarter.
    pub(super) fn drain(&mut self) {
        let Session { reader, ingest, transport, engine, reports, signals, probes, state, .. } = self;
        let mut route = |routed: Option<(&Event, Option<Observation>)>| {
            // `None`: the next observation a framework made of the same
            // record, if any (no probe made it).
            let (probed, made) = match routed {
                Some((event, observation)) => {
                    let probed = observation.as_ref().map(|o| o.key);
                    (probed, signals.consume(event, observation, probes.slot(event.slot))?)
                }
                None => (None, signals.pending()?),
            };
            // A lifecycle event no probe made (an SGLang room's): the
            // kernel did not keep it, so the agent does; its side is what
            // its process's traffic says.
            if probed == Some(made.key) {
                return Some((made, Side::Prefill));
            }
            state.track(&made);
            let side = signals.side(made.pid);
            Some((made, side))
        };
        reader.drain(|bytes| ingest.record(bytes, transport, engine, reports, &mut route));
        self.hand_over();
    }

    /// Pin what changed of the frameworks' requests for the next agent:
    /// after each read of the ring buffer and before each turn's reports
    /// go out, each changed request once, so what an agent knew when it
    /// judged a stall is what the next one knows.
    fn hand_over(&mut self) {
        for held in self.signals.held() {
            self.state.pin_context(held.pid, held.key, held.context.as_deref());
        }
    }

    /// When the loop next drains the ring buffer and judges silence: when
    /// the engine can next report a stall, when the gate is next checked
    /// (while any process has gated probes), and `unread_ns` from `now` at
    /// the latest.
    pub(super) fn next_wake(&self, now: u64, unread_ns: u64) -> u64 {
        let mut next = now.saturating_add(unread_ns);
        if let Some(due) = self.engine.next_due_ns(now) {
            next = next.min(due);
        }
        if self.probes.gates().next().is_some() {
            next = next.min(self.gate.next_ns());
        }
        if let Some(expiry) = self.signals.next_expiry() {
            next = next.min(expiry.max(now));
        }
        next
    }

    /// What the frameworks end on their own by `now` (a request past its
    /// lease), to the engine as every framework-made observation goes:
    /// before silence is judged at `now`.
    fn expire(&mut self, now: u64) {
        self.signals.expire(now);
        while let Some(made) = self.signals.pending() {
            self.state.track(&made);
            let side = self.signals.side(made.pid);
            self.ingest.made(made, side, &mut self.transport, &mut self.engine, &mut self.reports);
        }
    }

    /// Keep a recent scheduling sample of each process holding a request
    /// near its stall (silent for half the timeout, as the gate counts),
    /// so its stalls can tell throttling and starvation over a window
    /// ([`crate::evidence::sched`]); once a counter period, off the path
    /// of every event.
    pub(super) fn sample_scheduling(&mut self, now: u64) {
        let near_stall = self.engine.pids_silent_since(self.gate.cutoff(now));
        self.sched.keep_sampling(&near_stall, now);
    }

    /// Link the progress probes of processes that now hold a request near
    /// its stall (off the loop: they come on when [`Opener::linked`]
    /// says), unlink those of processes that hold none (see
    /// [`crate::evidence::gate`]).
    pub(super) fn gate(&mut self, now: u64) {
        if !self.gate.due(now) || self.probes.gates().next().is_none() {
            return;
        }
        let near_stall = self.engine.pids_silent_since(self.gate.cutoff(now));
        for change in Gate::changes(self.probes.gates(), &near_stall) {
            match change {
                Change::Open(pid) => self.opener.open(pid, &mut self.probes),
                Change::Close(pid) => {
                    let links = self.probes.close_gate(pid);
                    self.transport.progress_attached(pid, None);
                    // Detaching a uprobe takes the kernel tens of ms: off
                    // the loop. The slots stay the process's meanwhile
                    // (a closing never frees them), so a hit of a link
                    // still going counts where it belongs.
                    let count = links.len();
                    tokio::task::spawn_blocking(move || drop(links));
                    info!(pid, probes = count, "progress probes detached: no request of the process is near its stall");
                }
            }
        }
    }

    /// Judge silence at `now`: requests whose stall is due are read first
    /// where the profile has a `[status]`, and only while the kernel holds
    /// them live (a released request's memory is not its own any more), at
    /// most `budget` of them (the rest wait for the next calls).
    pub(super) fn advance(&mut self, now: u64, budget: usize) {
        self.expire(now);
        let Session { engine, status, state, reports, signals, processes, .. } = self;
        // What `quiet` probes kept in the kernel's table comes first: a
        // request they moved along is not silent.
        let mut withheld = withheld_in(state);
        if status.iter().all(Option::is_none) {
            let mut unread = |silents: &[Silent], answers: &mut Vec<Option<StageRead>>| {
                answers.extend(silents.iter().map(|_| None));
            };
            engine.advance_checking(now, budget, &mut withheld, &mut unread, reports);
            return;
        }
        let mut read = |silents: &[Silent], answers: &mut Vec<Option<StageRead>>| {
            let holds = |silent: &Silent| state.is_live(silent.pid, silent.key, silent.last_ns);
            let start = answers.len();
            answers.resize(start + silents.len(), None);
            // Each by its process's profile's reader. A room has no memory
            // of its own: its handles have, read one by one (rooms are
            // few); the rest in a batch a profile.
            let mut own: Vec<(Vec<Silent>, Vec<usize>)> = status.iter().map(|_| Default::default()).collect();
            for (n, silent) in silents.iter().enumerate() {
                let Some(id) = processes.profile(silent.pid) else { continue };
                let Some(reader) = &mut status[id.0] else { continue };
                let mut one = |handle: &Silent| {
                    let mut answer = Vec::with_capacity(1);
                    reader.read(std::slice::from_ref(handle), holds, &mut answer);
                    answer.pop().flatten()
                };
                match signals.read_own(silent, &mut one) {
                    Claim::Mine(answer) => answers[start + n] = answer,
                    Claim::NotMine => {
                        own[id.0].0.push(*silent);
                        own[id.0].1.push(start + n);
                    }
                }
            }
            for (reader, (own, at)) in status.iter_mut().zip(own) {
                let Some(reader) = reader.as_mut().filter(|_| !own.is_empty()) else { continue };
                let mut read = Vec::with_capacity(own.len());
                reader.read(&own, holds, &mut read);
                for (at, answer) in at.into_iter().zip(read) {
                    answers[at] = answer;
                }
            }
        };
        engine.advance_checking(now, budget, &mut withheld, &mut read, reports);
    }

    /// The process is gone, or its program is: what it did before counts
    /// first, then every request it still held ends `process_exited`.
    pub(super) fn unwatch(&mut self, pid: u32, gone: Gone) {
        // Nothing more from its probes: what the ring holds is all there is.
        if let Err(err) = self.probes.disarm(pid) {
            warn!(pid, "silencing the probes of a process going away: {err:#}");
        }
        self.drain();
        match gone {
            Gone::Exited => info!(pid, "target process exited"),
            Gone::Exec => info!(
                pid,
                process = self.processes.name(pid).unwrap_or("?"),
                new_program = %process_name(pid),
                "target process exec'd a new program: the old one's requests end process_exited, its probes are detached"
            ),
        }
        self.engine.catch_up(Some(pid), &mut withheld_in(&self.state));
        self.engine.process_exited(pid, monotonic_ns(), &mut self.reports);
        if let Err(err) = self.state.forget_process(pid) {
            warn!(pid, "dropping the kernel's in-flight entries of an exited process: {err:#}");
        }
        // Its links go off the loop (seconds, at worst): every other
        // process's stalls come due meanwhile.
        self.detacher.start(self.probes.detach(pid));
        // Its requests' reports carry no transport evidence (only stalls do).
        self.transport.forget(pid);
        self.sched.forget(pid);
        self.signals.forget(pid);
        self.opener.forget(pid);
        if let Some(status) = self.processes.profile(pid).and_then(|id| self.status[id.0].as_mut()) {
            status.forget(pid);
        }
        self.processes.remove(pid);
    }

    pub(super) fn emit(&mut self) -> Result<()> {
        self.hand_over();
        if self.reports.iter().any(|report| matches!(report, Report::Stalled { .. })) {
            // Judge stalls on fresh counts, not the last periodic sample.
            self.transport.sample(&self.probes, monotonic_ns())?;
        }
        let now = monotonic_ns();
        for mut report in self.reports.drain(..) {
            self.transport.observe_end(&report);
            // A stall is judged on what its framework knows of its
            // transfers, and on whether its process is itself held (then
            // it waits on itself, whatever its transport and traffic say).
            if let Report::Stalled { request, class, .. } = &mut report {
                let between = self.signals.stalled_transfer(request) == Claim::Mine(None);
                let refined = transport::refined_class(*class, between);
                if refined != *class && self.engine.reclass(request.pid, request.key, refined) {
                    (*class, request.stalled) = (refined, Some(refined));
                }
            }
            // Judged on every alert a lapse of time raises (a stall; a
            // lease or a release that ran out), never on one an event of
            // the process raised: a process that made one is not stopped.
            let halt = match &report {
                Report::Stalled { request, .. }
                | Report::Ended { request, outcome: Outcome::LeaseExpired | Outcome::Leaked, .. } => {
                    self.sched.judge(request.pid, now)
                }
                _ => None,
            };
            let evidence = self.transport.for_report(&report, |request| self.signals.peer_completions(request), halt);
            let mut context = self.signals.context(report.request());
            if let Some(halt) = halt {
                context.say_halt(halt.as_str());
            }
            self.alerts.report(&report, evidence.as_ref(), &context).context("writing an alert to stdout")?;
            // After the alert: an agent that dies in between reports the
            // stall again rather than never. A failure costs only restart
            // safety for this request, never the alerts: logged, not fatal.
            if let Err(err) = self.state.apply(&report) {
                warn!(pid = report.request().pid, "recording a report in the kernel's in-flight table: {err:#}");
            }
            self.telemetry.report(report, evidence, context);
        }
        Ok(())
    }

    /// The stop: the last reports, the summary, and the state left as
    /// `on_exit` says. Every step is taken whatever the others did: a
    /// stdout that fails (a full disk) costs its lines, counted, never the
    /// hand-over to the next agent; the summary then goes to stderr.
    pub(super) fn finish(mut self, on_exit: OnExit) -> Result<()> {
        self.alerts.stopping();
        self.alerts.output_mut().keep_every_line();
        self.sync();
        // Every stall due by now, however many: the loop's latency no
        // longer matters, and this agent's alerts should be complete.
        self.advance(monotonic_ns(), usize::MAX);
        let mut failures = Vec::new();
        if let Err(err) = self.emit() {
            failures.push(err.context("the last reports"));
        }
        self.warn_status();
        let kernel = self.probes.counters().unwrap_or_else(|err| {
            failures.push(err.context("reading the kernel's loss counters for the summary"));
            KernelCounters::default()
        });
        let probe_hits = self.probes.probe_hits().unwrap_or_else(|err| {
            failures.push(err.context("reading the probes' hit counts for the summary"));
            Vec::new()
        });
        let losses = Losses { kernel, undecodable: self.ingest.undecodable };
        self.ingest.warn_undecodable();
        self.signals.finish();
        self.warn_alert_drops();
        let status = self.status_reads();
        let export = self.telemetry.finish();
        let (failed_before, _) = self.alerts.output().failed();
        let outputs = Shortfalls {
            export_drops: export.dropped(),
            alert_lines_dropped: self.alerts.output().dropped(),
            alert_lines_failed: failed_before,
            refused_processes: self.refused,
        };
        let summary = self.alerts.summary(&self.engine.stats(), &losses, &outputs, &probe_hits, status.as_ref());
        // The hand-over before the wait on stdout: it never waits on a
        // stdout that does not drain, and never depends on one that fails.
        match self.probes.finish(on_exit == OnExit::Keep) {
            Ok(Some(dir)) => info!(
                dir = %dir.display(),
                "probes left attached and in-flight state pinned for the next agent; `stallwatch state clear` removes them"
            ),
            Ok(None) => {}
            Err(err) => failures.push(err.context("leaving the state for the next agent")),
        }
        let output = self.alerts.output();
        let drained = output.finish(queue::STOP_GRACE);
        let (failed, error) = output.failed();
        if !drained || failed > failed_before {
            warn!(
                lines_not_written = output.waiting() as u64 + failed - failed_before,
                error = error.as_deref().unwrap_or("stdout did not drain"),
                "stdout did not take the last alert lines within {:?}: the summary follows here",
                queue::STOP_GRACE
            );
            if let Ok(line) = &summary {
                let mut stderr = std::io::stderr().lock();
                let _ = writeln!(stderr, "{line}");
            }
        }
        if let Err(err) = summary {
            // A closed stdout is no error at the stop ([`AlertWriter::stopping`]).
            failures.push(anyhow::Error::new(err).context("writing the summary"));
        }
        let mut failures = failures.into_iter();
        let Some(first) = failures.next() else { return Ok(()) };
        for other in failures {
            error!("at the stop: {other:#}");
        }
        Err(first.context("stopping"))
    }

    /// One warning a counter period for the alert lines dropped since the
    /// last one (stdout did not drain), and one for those whose write
    /// failed (a full disk under stdout).
    pub(super) fn warn_alert_drops(&mut self) {
        if let Some(new) = self.alert_drops.news(self.alerts.output().dropped()) {
            warn!(
                new,
                total = self.alerts.output().dropped(),
                "stdout is not draining: the oldest alert lines were dropped (detections still go to the metrics, spans, \
                 `stallwatch inflight` and the summary); check what reads the agent's stdout"
            );
        }
        let (failed, error) = self.alerts.output().failed();
        if let Some(new) = self.alert_failures.news(failed) {
            warn!(
                new,
                total = failed,
                error = error.as_deref().unwrap_or_default(),
                "writing alert lines to stdout fails: those lines are lost (detections still go to the metrics, spans, \
                 `stallwatch inflight` and the summary); check where stdout goes (a full disk?)"
            );
        }
    }
}

/// What the engine asks the kernel's table of a request (the events of
/// `quiet` probes it was not sent). A lookup that fails tells nothing, as
/// one that finds nothing: the request is judged by what the engine has.
pub(super) fn withheld_in(state: &KernelState) -> impl FnMut(&Silent) -> Option<Withheld> + '_ {
    |silent| state.withheld(silent).ok().flatten()
}
