//! `stallwatch run`: attach a profile to one process (`--pid`) or to every
//! process a selector matches, now and later, and follow their requests
//! until told to stop (or, with `--pid`, until that process exits or execs
//! a program the profile does not attach to).
use std::{
    collections::{HashMap, HashSet},
    io::Write,
    os::fd::{FromRawFd as _, OwnedFd},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use aya::maps::{MapData, RingBuf};
use aya_log::EbpfLogger;
use stallwatch_common::Event;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
    sync::mpsc,
    task::JoinHandle,
};
use tracing::{error, info, warn};

use crate::{
    discovery::{Pending, Selector},
    events::{self, EventReader, Losses},
    export::{
        alert::{AlertWriter, Format},
        clock::{Clock, monotonic_ns, process_start_ns},
        queue::{self, LineQueue},
        telemetry::{Telemetry, TelemetryOptions},
    },
    gate::{Change, Gate, Opener},
    lifecycle::{Engine, EngineConfig, Observation, Report, Restored, Side, Silent, Withheld},
    probes::{
        KernelCounters, Probes, Profile, Releasing,
        resolve::{ElfFile, ProcessImage},
    },
    query::{QueryServer, SocketPlace},
    reactor,
    signals::{self, Signals},
    state::{BpfDir, KernelState},
    status::{self, StatusReader},
    transport::Tracker,
    warned::Warned,
};

/// Which processes to watch.
#[derive(Debug, Clone)]
pub enum Target {
    /// This one; the agent ends when it exits.
    Pid(u32),
    /// Every process matching, including those started later.
    Select(Selector),
}

pub struct Options {
    pub target: Target,
    pub profile: Profile,
    pub timeout: Duration,
    pub tick: Duration,
    pub max_tracked: usize,
    pub format: Format,
    /// OTLP spans and the metrics endpoint (both off by default).
    pub telemetry: TelemetryOptions,
    /// The unix socket `stallwatch inflight` asks (`--socket`).
    pub socket: PathBuf,
    /// Where maps and links are pinned to outlive the agent (`--bpf-dir`);
    /// `None` pins nothing (`--ephemeral`).
    pub bpf_dir: Option<PathBuf>,
    /// What to leave at exit for the next agent (`--on-exit`).
    pub on_exit: OnExit,
}

/// What an agent stopped by a signal leaves pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OnExit {
    /// Leave the probes attached and the in-flight state pinned, for the
    /// next agent to take over (a restart, a rolling update).
    #[default]
    Keep,
    /// Detach every probe and remove the pinned state.
    Detach,
}

/// How often the kernel's loss counters and transport counts are sampled.
const COUNTER_PERIOD: Duration = Duration::from_secs(1);

pub async fn run(options: Options, out: impl Write + Send + 'static) -> Result<()> {
    let Options { target, profile, timeout, tick, max_tracked, format, telemetry, socket, bpf_dir, on_exit } = options;
    if timeout < tick {
        bail!("--timeout {timeout:?} is shorter than --tick {tick:?}: raise the timeout or lower the tick");
    }
    // Before anything is created (the bpf and socket directories would
    // then belong to an unprivileged user, and root agents refuse them).
    crate::doctor::require_privileges()?;
    // First: a stop asked for during start-up is taken at the first turn
    // of the loop, never the default death that leaves no summary.
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    // Before loading anything: a bad endpoint fails fast.
    let clock = Clock::new();
    let telemetry = Telemetry::start(&telemetry, clock).await?;
    let workloads = telemetry.workloads();
    // Before anything is pinned or attached: a socket directory another
    // user could change is refused.
    let socket = SocketPlace::check(&socket)?;
    let bpf_dir = bpf_dir.as_deref().map(BpfDir::open).transpose()?;
    let mut probes = Probes::load(bpf_dir)?;
    probes.set_quiet_gap(duration_ns(timeout) / 2);
    let state = probes.kernel_state()?;
    let logger = EbpfLogger::init(probes.ebpf_mut()).context("setting up eBPF logging")?;
    let mut logger = reactor::register(logger, "the eBPF log buffer")?;
    let reader = EventReader::new(&mut probes)?;
    let (exit_tx, mut exits) = mpsc::unbounded_channel();
    let mut session = Session {
        engine: Engine::new(EngineConfig { timeout_ns: duration_ns(timeout), max_tracked, tick_ns: duration_ns(tick) }),
        transport: Tracker::new(duration_ns(timeout)),
        gate: Gate::new(duration_ns(timeout), duration_ns(tick)),
        opener: Opener::default(),
        alerts: AlertWriter::new(
            LineQueue::start(out).context("starting the thread that writes alerts to stdout")?,
            format,
            clock,
        )
        .with_workloads(workloads),
        alert_drops: Warned::default(),
        telemetry,
        probes,
        state,
        reader,
        status: profile.status.clone().map(|spec| StatusReader::new(spec, profile.complete_at)),
        profile,
        watched: HashMap::new(),
        exit_tx,
        reports: Vec::new(),
        ingest: Ingest::default(),
        signals: Signals::new(duration_ns(timeout)),
        synced: Synced::default(),
        foreign_builds: HashSet::new(),
    };

    let (mut execs, selector) = match target {
        Target::Pid(pid) => {
            // First, so an exec during the attach is heard of too.
            let execs = match session.probes.watch_execs() {
                Ok(ring) => Some(reactor::register(ring, "the EXECS ring buffer")?),
                Err(err) => {
                    warn!(
                        pid,
                        "an exec of the target will go unnoticed (its old program's requests stay in flight): {err:#}"
                    );
                    None
                }
            };
            session.watch(pid)?;
            (execs, None)
        }
        Target::Select(selector) => {
            // Hear of execs first, so nothing starting during the scan is missed.
            let execs = reactor::register(session.probes.watch_execs()?, "the EXECS ring buffer")?;
            info!(selector = %selector.describe(), profile = %session.profile.name, "discovering processes");
            for pid in selector.scan()? {
                session.watch_or_log(pid);
            }
            (Some(execs), Some(selector))
        }
    };
    // Ours are attached: what a previous agent's probes recorded is ours to
    // follow, taken over first (its stalls may be near due), then its
    // probes can go. Before the take-over reads the table: a loss from
    // here on is after its view, and brings a resynchronisation.
    let counters = session.probes.counters()?;
    session.synced = Synced { ringbuf_full: counters.ringbuf_full, state_full: counters.state_full };
    session.restore()?;
    let mut releasing = session.probes.release_old_links()?;
    // After attaching, so a bad profile or pid is reported as such even
    // when another agent serves this socket (a second agent fails here).
    let mut queries = QueryServer::bind(socket, clock)?.with_workloads(session.telemetry.workloads());
    for pid in session.watched.keys() {
        queries.name_process(*pid, &process_name(*pid));
    }
    session.transport.sample(&session.probes, monotonic_ns())?;
    // Attached, and a previous agent's requests taken over: a rolling
    // update may now stop the next pod.
    session.telemetry.set_ready();

    let unread_ns = unread_ns(duration_ns(timeout), duration_ns(tick));
    let wake = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(wake);
    let mut counter_ticks = tokio::time::interval(COUNTER_PERIOD);
    let mut recheck = tokio::time::interval(Duration::from_nanos(Pending::RECHECK_NS));
    let mut reported = KernelCounters::default();
    let mut pending = Pending::default();

    loop {
        tokio::select! {
            ready = session.reader.readable() => {
                ready?;
                session.drain();
            }
            () = &mut wake => {
                // The clock first: every event submitted before it is read
                // before the timers judge silence at it.
                let now = monotonic_ns();
                session.sync();
                session.gate(now);
                session.advance(now, status::READS_PER_TICK);
            }
            _ = counter_ticks.tick() => {
                reported = warn_on_loss(&session.probes, reported)?;
                session.ingest.warn_undecodable();
                session.signals.warn();
                session.state.warn();
                session.warn_alert_drops();
                if let Some(status) = &mut session.status {
                    status.warn();
                }
                session.transport.sample(&session.probes, monotonic_ns())?;
            }
            Some(pid) = exits.recv() => {
                session.unwatch(pid, Gone::Exited);
                queries.forget_process(pid);
                if selector.is_none() {
                    // `finish` reports what the exit ended.
                    break;
                }
            }
            ready = readable(&mut execs) => {
                let mut stop = false;
                for pid in drain_execs(ready?) {
                    // An exec replaces the image a watched process had: its
                    // probes and requests went with it.
                    let was_watched = session.watched.contains_key(&pid);
                    if was_watched {
                        session.unwatch(pid, Gone::Exec);
                        queries.forget_process(pid);
                    }
                    match &selector {
                        // A selected process that could not be watched is
                        // logged, not left for the pending arm below.
                        #[expect(clippy::collapsible_match, reason = "the failed watch must not fall through")]
                        Some(selector) if selector.matches(pid) => {
                            if session.watch_or_log(pid) {
                                queries.name_process(pid, &process_name(pid));
                            }
                        }
                        Some(_) => pending.add(pid, monotonic_ns()),
                        // `--pid`: follow the target into its new program
                        // if the profile attaches to it; else stop, as when
                        // it exits.
                        None if was_watched => match session.watch(pid) {
                            Ok(()) => queries.name_process(pid, &process_name(pid)),
                            Err(err) => {
                                error!(
                                    pid,
                                    "not watching the target's new program, stopping as when it exits (to follow a \
                                     process that loads the profile's library after an exec, select it with --exe, \
                                     --lib or --cmdline instead of --pid): {err:#}"
                                );
                                stop = true;
                            }
                        },
                        None => {}
                    }
                }
                if stop {
                    session.emit()?;
                    break;
                }
            }
            _ = recheck.tick(), if !pending.is_empty() => {
                if let Some(selector) = &selector {
                    for pid in pending.recheck(selector, monotonic_ns()) {
                        if session.watch_or_log(pid) {
                            queries.name_process(pid, &process_name(pid));
                        }
                    }
                }
            }
            log = logger.readable_mut() => {
                let mut guard = log.context("waiting on the eBPF log buffer")?;
                guard.get_inner_mut().flush();
                guard.clear_ready();
            }
            scrape = session.telemetry.scrape() => {
                // Counts up to the scrape, not to the last drain.
                session.drain();
                session.telemetry.answer(
                    scrape,
                    &session.engine,
                    &session.probes,
                    session.ingest.undecodable,
                    session.status.as_ref().map(StatusReader::reads),
                    session.alerts.output().dropped(),
                );
            }
            query = queries.next() => {
                // Up to date to the moment asked, not to the last tick, and
                // to what the kernel holds of requests not yet due.
                session.sync();
                session.engine.catch_up(None, &mut withheld_in(&session.state));
                queries.answer(query, &session.engine, &session.transport, &session.signals, monotonic_ns());
            }
            linked = session.opener.linked() => {
                session.opener.finish(linked, &mut session.probes, &mut session.transport);
            }
            released = released(&mut releasing) => {
                released.context("releasing the previous agent's links")?;
                session.probes.released(releasing.take().expect("a release under way"))?;
            }
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
        }
        let closed = match session.emit() {
            Err(err) if !session.alerts.is_closed() => return Err(err),
            Err(_) => true,
            // The writer thread may have found it closed since.
            Ok(()) => session.alerts.output().is_closed(),
        };
        if closed {
            // As a pipeline's writer does at SIGPIPE, but leaving the
            // state for the next agent as a SIGTERM would.
            info!("stdout was closed (its reader went away): stopping");
            break;
        }
        let now = monotonic_ns();
        let next = session.next_wake(now, unread_ns);
        wake.as_mut().reset(tokio::time::Instant::now() + Duration::from_nanos(next.saturating_sub(now)));
    }
    // The previous agent's links go before this one's state is left.
    if let Some(mut releasing) = releasing {
        releasing.done().await.context("releasing the previous agent's links")?;
        session.probes.released(releasing)?;
    }
    session.finish(on_exit)
}

/// Until the release under way, if any, is done; never without one.
async fn released(releasing: &mut Option<Releasing>) -> Result<()> {
    match releasing {
        Some(releasing) => releasing.done().await,
        None => std::future::pending().await,
    }
}

/// Longest the ring buffer goes unread while no stall is due: how late a
/// finished request's span, a recovery's alert or a per-peer count can be.
/// The programs do not wake the agent per event (that costs the target
/// more than the event does), and waking only when something can be due
/// spares the idle agent a wake per tick; this bounds the staleness
/// between. `stallwatch inflight` and a metrics scrape read the ring first.
const MAX_UNREAD: Duration = Duration::from_millis(100);

/// [`MAX_UNREAD`], but never longer than the timeout (a request's first
/// event is then read before its deadline, so its stall is never late) nor
/// shorter than a tick.
fn unread_ns(timeout_ns: u64, tick_ns: u64) -> u64 {
    duration_ns(MAX_UNREAD).min(timeout_ns).max(tick_ns)
}

/// One attached process.
struct Watched {
    /// Its name when attached (an exec changes it).
    name: String,
    exit_waiter: JoinHandle<()>,
}

/// Why a watched process's probes and requests go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gone {
    Exited,
    /// It exec'd a new program: the probes were on the old one.
    Exec,
}

/// Everything one run holds, with the steps the loop takes on it.
struct Session {
    engine: Engine,
    transport: Tracker,
    /// When each process's progress probes are linked.
    gate: Gate,
    /// Links them off the loop.
    opener: Opener,
    /// Alert lines, handed to stdout's writer thread ([`LineQueue`]).
    alerts: AlertWriter<LineQueue>,
    /// Dropped alert lines the last warning covered.
    alert_drops: Warned,
    telemetry: Telemetry,
    probes: Probes,
    /// The kernel's in-flight table, kept in step with the reports.
    state: KernelState,
    reader: EventReader,
    /// The profile's `[status]`, read for requests whose stall is due.
    status: Option<StatusReader>,
    profile: Profile,
    /// Attached processes: their names and the tasks waiting on their
    /// pidfds.
    watched: HashMap<u32, Watched>,
    exit_tx: mpsc::UnboundedSender<u32>,
    reports: Vec<Report>,
    ingest: Ingest,
    /// Where the profile's `[[signal]]` hits go.
    signals: Signals,
    /// The kernel's loss counts the engine was last brought in step with.
    synced: Synced,
    /// Library files (and builds) already warned about as foreign builds.
    foreign_builds: HashSet<(PathBuf, String)>,
}

/// The kernel counts that say whether the engine is in step with the
/// kernel's in-flight table ([`Session::sync`]).
#[derive(Debug, Default, Clone, Copy)]
struct Synced {
    /// `ringbuf_full` when the engine was last in step (or at start).
    ringbuf_full: u64,
    /// `state_full` at start: once it grows, the table may lack a request
    /// the probes saw begin, so one it does not hold is not known to have
    /// ended.
    state_full: u64,
}

impl Session {
    /// Attach the profile to `pid` and learn when it exits.
    fn watch(&mut self, pid: u32) -> Result<()> {
        if self.watched.contains_key(&pid) {
            return Ok(());
        }
        // Open the pidfd first: if the pid is reused after an exit, the
        // pidfd still refers to the process we attached to.
        let exited = pidfd(pid)?;
        let probes = if self.foreign_build(pid) {
            let probes = self.probes.attach(pid, &self.profile.without_offsets())?;
            if let Some(status) = &mut self.status {
                status.turn_off(pid);
            }
            probes
        } else {
            self.probes.attach(pid, &self.profile)?
        };
        let name = process_name(pid);
        self.alerts.name_process(pid, &name);
        self.telemetry.name_process(pid);
        let exit_tx = self.exit_tx.clone();
        let waiter = tokio::spawn(async move {
            // Readable means exited; an error means it cannot be watched,
            // which is reported the same way rather than lost.
            if let Ok(mut guard) = exited.readable().await {
                guard.retain_ready();
            }
            let _ = exit_tx.send(pid);
        });
        self.watched.insert(pid, Watched { name: name.clone(), exit_waiter: waiter });
        info!(
            pid,
            process = %crate::text::value(&name),
            profile = %self.profile.name,
            probes,
            timeout = %humantime::format_duration(Duration::from_nanos(self.engine.config().timeout_ns)),
            "watching"
        );
        Ok(())
    }

    /// Whether `pid` maps a build of the profile's `[layout]` library that
    /// the profile's offsets were not checked against (another build id,
    /// or none): then nothing is read at those offsets in it, since the
    /// bytes there may be anything (a never-posted handle read as
    /// `release_lost`). Warned about once per library file and build. A
    /// process that does not map the library is not judged here: its
    /// probes on it fail to attach, saying so.
    fn foreign_build(&mut self, pid: u32) -> bool {
        let Some(layout) = &self.profile.layout else { return false };
        let Ok(object) = ProcessImage::read(pid).and_then(|image| image.find(Some(&layout.object))) else {
            return false;
        };
        let build = match ElfFile::open(&object.host_path).and_then(|elf| elf.build_id()) {
            Ok(Some(id)) if layout.knows(&id) => return false,
            Ok(Some(id)) => format!("build id {id}"),
            Ok(None) => "no build id".to_owned(),
            Err(err) => format!("a build id that could not be read ({err:#})"),
        };
        if self.foreign_builds.insert((object.path.clone(), build.clone())) {
            warn!(
                pid,
                library = %crate::text::value(&object.path.display().to_string()),
                "{} has {build}, not a build profile {} (line {} of {}) was checked against ({}): its status reads, \
                 read_status and external ids are off for processes mapping it, their stalls classified by the probes \
                 alone. To use them, check that the build lays its structs out as the profile's offsets say (see \
                 docs/frameworks/nixl.md, \"A library build the profile does not know\"), then add its build id (`readelf -n`) to \
                 `build_ids` in the [layout] of a profile that extends this one",
                layout.object,
                self.profile.name,
                layout.line,
                layout.origin,
                layout.checked
            );
        }
        true
    }

    /// [`Self::watch`] for discovered processes: one that cannot be
    /// attached (it lacks a symbol, it exited meanwhile) is logged, and the
    /// agent goes on with the others.
    fn watch_or_log(&mut self, pid: u32) -> bool {
        match self.watch(pid) {
            Ok(()) => true,
            Err(err) => {
                error!(pid, "not watching: {err:#}");
                false
            }
        }
    }

    /// Take over the requests the kernel's in-flight table holds (a
    /// previous agent's, or begun while none ran). Those of processes gone
    /// meanwhile end `process_exited`, and so do those of a pid reused
    /// since: a process that started after a request's last event is not
    /// the one that held it. Those of live processes this agent does not
    /// watch are dropped.
    fn restore(&mut self) -> Result<()> {
        let requests = self.state.snapshot()?;
        if requests.is_empty() {
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
                Some(_) if self.watched.contains_key(&pid) => taken.push(request),
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
        let taken_count = taken.len();
        let follows_rooms = self.profile.follows_rooms();
        for request in taken {
            if follows_rooms {
                self.signals.adopt(&request);
            }
            self.engine.restore(request, &mut self.reports);
        }
        for pid in unwatched {
            info!(pid, "in-flight requests of a process this agent does not watch are dropped");
        }
        for pid in &reused {
            info!(pid, "in-flight requests of an earlier process with a reused pid end process_exited");
        }
        info!(
            requests = taken_count,
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
    fn sync(&mut self) {
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
        let table: Vec<Restored> =
            table.into_iter().filter(|request| self.watched.contains_key(&request.pid)).collect();
        if self.profile.follows_rooms() {
            for request in table.iter().filter(|request| self.engine.get(request.pid, request.key).is_none()) {
                self.signals.adopt(request);
            }
        }
        let complete = counters.state_full <= self.synced.state_full && self.state.unheld() == 0;
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
    fn drain(&mut self) {
        let Session { reader, ingest, transport, engine, reports, signals, probes, state, .. } = self;
        let mut route = |event: &Event, observation: Option<Observation>| {
            let probed = observation.as_ref().map(|o| o.key);
            let made = signals.consume(event, observation, probes.slot(event.slot))?;
            // A lifecycle event no probe made (an SGLang room's): the
            // kernel did not keep it, so the agent does; its side is what
            // its process's traffic says.
            if probed == Some(made.key) {
                return Some((made, Side::Prefill));
            }
            state.hold(&made);
            let side = signals.side(made.pid);
            Some((made, side))
        };
        reader.drain(|bytes| ingest.record(bytes, transport, engine, reports, &mut route));
    }

    /// When the loop next drains the ring buffer and judges silence: when
    /// the engine can next report a stall, when the gate is next checked
    /// (while any process has gated probes), and `unread_ns` from `now` at
    /// the latest.
    fn next_wake(&self, now: u64, unread_ns: u64) -> u64 {
        let mut next = now.saturating_add(unread_ns);
        if let Some(due) = self.engine.next_due_ns(now) {
            next = next.min(due);
        }
        if self.probes.gates().next().is_some() {
            next = next.min(self.gate.next_ns());
        }
        next
    }

    /// Link the progress probes of processes that now hold a request near
    /// its stall (off the loop: they come on when [`Opener::linked`]
    /// says), unlink those of processes that hold none (see
    /// [`crate::gate`]).
    fn gate(&mut self, now: u64) {
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
    fn advance(&mut self, now: u64, budget: usize) {
        let Session { engine, status, state, reports, signals, .. } = self;
        // What `quiet` probes kept in the kernel's table comes first: a
        // request they moved along is not silent.
        let mut withheld = withheld_in(state);
        match status {
            Some(status) => engine.advance_checking(
                now,
                budget,
                &mut withheld,
                &mut |silents, answers| {
                    let holds = |silent: &Silent| state.holds(silent.pid, silent.key, silent.last_ns);
                    let start = answers.len();
                    answers.resize(start + silents.len(), None);
                    // A room has no memory of its own: its handles have,
                    // read one by one (rooms are few); the rest in a batch.
                    let (mut own, mut own_at) = (Vec::new(), Vec::new());
                    for (n, silent) in silents.iter().enumerate() {
                        let mut one = |handle: &Silent| {
                            let mut answer = Vec::with_capacity(1);
                            status.read(std::slice::from_ref(handle), holds, &mut answer);
                            answer.pop().flatten()
                        };
                        match signals.read_room(silent, &mut one) {
                            Some(answer) => answers[start + n] = answer,
                            None => {
                                own.push(*silent);
                                own_at.push(start + n);
                            }
                        }
                    }
                    let mut read = Vec::with_capacity(own.len());
                    status.read(&own, holds, &mut read);
                    for (at, answer) in own_at.into_iter().zip(read) {
                        answers[at] = answer;
                    }
                },
                reports,
            ),
            None => engine.advance_checking(
                now,
                budget,
                &mut withheld,
                &mut |silents, answers| answers.extend(silents.iter().map(|_| None)),
                reports,
            ),
        }
    }

    /// The process is gone, or its program is: what it did before counts
    /// first, then every request it still held ends `process_exited`.
    fn unwatch(&mut self, pid: u32, gone: Gone) {
        // Nothing more from its probes: what the ring holds is all there is.
        if let Err(err) = self.probes.disarm(pid) {
            warn!(pid, "silencing the probes of a process going away: {err:#}");
        }
        self.drain();
        match gone {
            Gone::Exited => info!(pid, "target process exited"),
            Gone::Exec => info!(
                pid,
                process = self.watched.get(&pid).map_or("?", |watched| watched.name.as_str()),
                new_program = %process_name(pid),
                "target process exec'd a new program: the old one's requests end process_exited, its probes are detached"
            ),
        }
        self.engine.catch_up(Some(pid), &mut withheld_in(&self.state));
        self.engine.process_exited(pid, monotonic_ns(), &mut self.reports);
        if let Err(err) = self.state.forget_process(pid) {
            warn!(pid, "dropping the kernel's in-flight entries of an exited process: {err:#}");
        }
        self.probes.detach(pid);
        // Its requests' reports carry no transport evidence (only stalls do).
        self.transport.forget(pid);
        self.signals.forget(pid);
        self.opener.forget(pid);
        if let Some(status) = &mut self.status {
            status.forget(pid);
        }
        if let Some(watched) = self.watched.remove(&pid) {
            watched.exit_waiter.abort();
        }
    }

    fn emit(&mut self) -> Result<()> {
        if self.reports.iter().any(|report| matches!(report, Report::Stalled { .. })) {
            // Judge stalls on fresh counts, not the last periodic sample.
            self.transport.sample(&self.probes, monotonic_ns())?;
        }
        for report in self.reports.drain(..) {
            self.transport.observe_end(&report);
            let evidence = self.transport.for_report(&report, |request| self.signals.peer_completions(request));
            let fields = self.signals.context(report.request());
            self.alerts.report(&report, evidence.as_ref(), &fields).context("writing an alert to stdout")?;
            // After the alert: an agent that dies in between reports the
            // stall again rather than never. A failure costs only restart
            // safety for this request, never the alerts: logged, not fatal.
            if let Err(err) = self.state.apply(&report) {
                warn!(pid = report.request().pid, "recording a report in the kernel's in-flight table: {err:#}");
            }
            self.telemetry.report(report, evidence, fields);
        }
        Ok(())
    }

    fn finish(mut self, on_exit: OnExit) -> Result<()> {
        self.alerts.stopping();
        self.sync();
        // Every stall due by now, however many: the loop's latency no
        // longer matters, and this agent's alerts should be complete.
        self.advance(monotonic_ns(), usize::MAX);
        self.emit()?;
        if let Some(status) = &mut self.status {
            status.warn();
        }
        let losses = Losses { kernel: self.probes.counters()?, undecodable: self.ingest.undecodable };
        self.ingest.warn_undecodable();
        self.signals.finish();
        self.warn_alert_drops();
        let export = self.telemetry.finish();
        let alert_drops = self.alerts.output().dropped();
        self.alerts
            .summary(
                &self.engine.stats(),
                &losses,
                export.dropped(),
                alert_drops,
                &self.probes.probe_hits()?,
                self.status.as_ref().map(StatusReader::reads).as_ref(),
            )
            .context("writing the summary")?;
        if let Some(dir) = self.probes.finish(on_exit == OnExit::Keep)? {
            info!(
                dir = %dir.display(),
                "probes left attached and in-flight state pinned for the next agent; `stallwatch state clear` removes them"
            );
        }
        // Last: the hand-over above never waits on a stdout that does not drain.
        let output = self.alerts.output();
        if !output.finish(queue::STOP_GRACE) {
            warn!(
                lines = output.waiting(),
                "stdout did not take the last alert lines (the summary among them) within {:?}: they are not written",
                queue::STOP_GRACE
            );
        }
        Ok(())
    }

    /// One warning a counter period for the alert lines dropped since the
    /// last one, because stdout did not drain.
    fn warn_alert_drops(&mut self) {
        if let Some(new) = self.alert_drops.news(self.alerts.output().dropped()) {
            warn!(
                new,
                total = self.alerts.output().dropped(),
                "stdout is not draining: the oldest alert lines were dropped (detections still go to the metrics, spans, \
                 `stallwatch inflight` and the summary); check what reads the agent's stdout"
            );
        }
    }
}

/// What the engine asks the kernel's table of a request (the events of
/// `quiet` probes it was not sent). A lookup that fails tells nothing, as
/// one that finds nothing: the request is judged by what the engine has.
fn withheld_in(state: &KernelState) -> impl FnMut(&Silent) -> Option<Withheld> + '_ {
    |silent| state.withheld(silent).ok().flatten()
}

/// Wait for exec notifications; never resolves without discovery.
async fn readable(
    execs: &mut Option<AsyncFd<RingBuf<MapData>>>,
) -> Result<tokio::io::unix::AsyncFdReadyMutGuard<'_, RingBuf<MapData>>> {
    match execs {
        Some(execs) => execs.readable_mut().await.context("waiting on the EXECS ring buffer"),
        None => std::future::pending().await,
    }
}

/// The pids in the exec ring buffer, in order, each once.
fn drain_execs(mut guard: tokio::io::unix::AsyncFdReadyMutGuard<'_, RingBuf<MapData>>) -> Vec<u32> {
    let mut pids = Vec::new();
    let ring = guard.get_inner_mut();
    while let Some(item) = ring.next() {
        if let Some(pid) = item.get(..4).and_then(|bytes| bytes.try_into().ok()).map(u32::from_ne_bytes) {
            if !pids.contains(&pid) {
                pids.push(pid);
            }
        }
    }
    guard.clear_ready();
    pids
}

/// Records the ring buffer held that did not become observations: counted
/// (the summary and metrics show them as lost events) and warned about at
/// most once per [`COUNTER_PERIOD`], never once per record, since a whole
/// stream of them (an agent and an eBPF object that disagree) would flood
/// the log and slow the event loop.
#[derive(Default)]
struct Ingest {
    undecodable: u64,
    warned: Warned,
    /// Why the latest one did not decode.
    last_error: Option<String>,
}

impl Ingest {
    fn record(
        &mut self,
        bytes: &[u8],
        transport: &mut Tracker,
        engine: &mut Engine,
        reports: &mut Vec<Report>,
        route: &mut impl FnMut(&Event, Option<Observation>) -> Option<(Observation, Side)>,
    ) {
        match events::decode(bytes) {
            Ok(event) => {
                for earlier in events::withheld(&event) {
                    self.event(&earlier, true, transport, engine, reports, route);
                }
                self.event(&event, false, transport, engine, reports, route);
            }
            Err(err) => {
                self.undecodable += 1;
                self.last_error = Some(format!("{err:#}"));
            }
        }
    }

    /// `carried`: a stage time the record carried besides its own event
    /// (see [`Engine::observe_carried`]).
    fn event(
        &mut self,
        event: &Event,
        carried: bool,
        transport: &mut Tracker,
        engine: &mut Engine,
        reports: &mut Vec<Report>,
        route: &mut impl FnMut(&Event, Option<Observation>) -> Option<(Observation, Side)>,
    ) {
        // A signal is a lifecycle event only once its consumer makes one
        // (an SGLang room's, from its ZMQ messages); a probe's lifecycle
        // event may be another's (a NIXL handle's, its room's).
        let decoded = if signals::is_signal(event) {
            Ok(route(event, None))
        } else {
            events::observe(event).map(|o| route(event, Some(o)))
        };
        match decoded {
            Ok(None) => {}
            Ok(Some((observation, side))) => {
                if side == Side::Decode {
                    engine.set_side(observation.pid, side);
                }
                transport.observe(&observation);
                if carried {
                    engine.observe_carried(observation, reports);
                } else {
                    engine.observe(observation, reports);
                }
            }
            Err(err) => {
                self.undecodable += 1;
                self.last_error = Some(format!("{err:#}"));
            }
        }
    }

    /// One warning for the records that failed since the last one.
    fn warn_undecodable(&mut self) {
        if let Some(new) = self.warned.news(self.undecodable) {
            warn!(
                new,
                undecodable = self.undecodable,
                latest = self.last_error.as_deref().unwrap_or_default(),
                "ring-buffer records that did not become lifecycle events (counted as lost)"
            );
        }
    }
}

/// Log each new loss the kernel counted, as it happens.
fn warn_on_loss(probes: &Probes, before: KernelCounters) -> Result<KernelCounters> {
    let now = probes.counters()?;
    if now.lost() > before.lost() {
        warn!(
            lost = now.lost() - before.lost(),
            ringbuf_full = now.ringbuf_full,
            key_unreadable = now.key_unreadable,
            args_missing = now.args_missing,
            no_slot = now.no_slot,
            "events lost in the kernel"
        );
    }
    if now.ext_unreadable > before.ext_unreadable {
        warn!(
            ext_unreadable = now.ext_unreadable,
            "events delivered without their external id, which could not be read: check the profile's `external_id`"
        );
    }
    if now.state_full > before.state_full {
        warn!(
            state_full = now.state_full,
            "the kernel's in-flight table is full: these requests are followed, but would not survive an agent restart"
        );
    }
    if now.exec_lost > before.exec_lost {
        warn!(exec_lost = now.exec_lost, "exec notifications lost; such processes are found by the next rescan");
    }
    Ok(now)
}

/// A pidfd that becomes readable when `pid` exits.
fn pidfd(pid: u32) -> Result<AsyncFd<OwnedFd>> {
    let raw_pid = libc::pid_t::try_from(pid).with_context(|| format!("pid {pid} is out of range"))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, 0) };
    if fd < 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ESRCH) {
            bail!("no process with pid {pid} (check `ps -p {pid}`)");
        }
        // The kernel refuses (ENOENT, EINVAL on older kernels) a thread
        // that is not its process's main one.
        if let Some(tgid) = thread_group_of(pid) {
            bail!("pid {pid} is a thread of process {tgid}, not a process: pass --pid {tgid}");
        }
        return Err(err).with_context(|| format!("pidfd_open({pid})"));
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    reactor::register(fd, "the target's pidfd")
}

/// The process a thread id belongs to (`Tgid:` in its status file).
fn thread_group_of(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status.lines().find_map(|line| line.strip_prefix("Tgid:")?.trim().parse().ok()).filter(|&tgid| tgid != tid)
}

/// The process's name (`comm`), as the process set it: any bytes, made
/// UTF-8 (invalid sequences replaced); printed through [`crate::text`].
fn process_name(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/comm")).map_or_else(
        |_| "?".to_owned(),
        |bytes| String::from_utf8_lossy(bytes.strip_suffix(b"\n").unwrap_or(&bytes)).into_owned(),
    )
}

fn duration_ns(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use serde_json::Value;
    use stallwatch_common::{EXT_ID_LEN, Event};

    use super::*;
    use crate::{lifecycle::EngineStats, probes::KernelCounters};

    /// The log lines `f` writes at warn level or above.
    fn warnings(f: impl FnOnce()) -> Vec<String> {
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().expect("log buffer").extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(buffer.0.lock().expect("log buffer").clone()).expect("UTF-8 log");
        text.lines().map(str::to_owned).collect()
    }

    fn bytes_of(event: &Event) -> Vec<u8> {
        // SAFETY: viewing a POD value as its bytes.
        unsafe { std::slice::from_raw_parts((&raw const *event).cast::<u8>(), size_of::<Event>()) }.to_vec()
    }

    #[test]
    fn undecodable_records_are_lost_events_warned_about_once_per_period() {
        let mut ingest = Ingest::default();
        let mut transport = Tracker::new(1_000);
        let mut engine = Engine::new(EngineConfig::default());
        let mut reports = Vec::new();
        let unknown_stage = Event {
            ts_ns: 5,
            key: 7,
            ret: 0,
            pid: 9,
            tid: 9,
            slot: 3,
            flags: 0,
            stage: 200,
            _pad: [0; 7],
            ext: [0; EXT_ID_LEN],
        };
        let logged = warnings(|| {
            for _ in 0..1000 {
                ingest.record(&[0; 8], &mut transport, &mut engine, &mut reports, &mut |_, observation| {
                    observation.map(|o| (o, Side::Prefill))
                });
            }
            ingest.record(
                &bytes_of(&unknown_stage),
                &mut transport,
                &mut engine,
                &mut reports,
                &mut |_, observation| observation.map(|o| (o, Side::Prefill)),
            );
            // Two counter periods: the second has nothing new.
            ingest.warn_undecodable();
            ingest.warn_undecodable();
        });
        assert_eq!(ingest.undecodable, 1001);
        assert_eq!(logged.len(), 1, "one warning, not one per record: {logged:?}");
        assert!(logged[0].contains("undecodable=1001") && logged[0].contains("stage 200"), "{logged:?}");
        assert!(reports.is_empty() && engine.is_empty());

        // The summary counts them as lost events.
        let mut out = Vec::new();
        let losses = Losses {
            kernel: KernelCounters { ringbuf_full: 2, ..KernelCounters::default() },
            undecodable: ingest.undecodable,
        };
        AlertWriter::new(&mut out, Format::Json, Clock::new())
            .summary(&EngineStats::default(), &losses, 0, 0, &[], None)
            .expect("summary");
        let summary: Value = serde_json::from_slice(&out).expect("JSON summary");
        assert_eq!(
            (summary["lost_events"].as_u64(), summary["undecodable"].as_u64()),
            (Some(1003), Some(1001)),
            "{summary}"
        );
    }

    #[test]
    fn the_ring_buffer_is_read_within_the_timeout_and_never_more_often_than_a_tick() {
        const MS: u64 = 1_000_000;
        assert_eq!(unread_ns(60_000 * MS, 10 * MS), 100 * MS);
        // A request's first event is read before its deadline.
        assert_eq!(unread_ns(40 * MS, 10 * MS), 40 * MS);
        assert_eq!(unread_ns(5 * MS, 200 * MS), 200 * MS);
    }
}
