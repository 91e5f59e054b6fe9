//! The event loop: one `select!` over everything that can wake the agent,
//! each arm a method of [`EventLoop`] that acts on the [`Session`].
//!
//! The ring buffer is read when a stall can be due or [`MAX_UNREAD`] has
//! passed (the programs do not wake the agent per event); after every turn
//! the reports the turn made are emitted and the next wake is set.
use std::{pin::Pin, time::Duration};

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use aya_log::EbpfLogger;
use tokio::{
    io::unix::{AsyncFd, AsyncFdReadyMutGuard},
    sync::mpsc,
    time::{Interval, Sleep},
};
use tracing::{error, info, warn};

use super::{
    Target, deployment,
    discovery::{self, Pending},
    ingest::warn_on_loss,
    processes::Gone,
    reads::{Read, Reads},
    rules::{ProfileId, Rules},
    session::{Session, Synced, withheld_in},
    stops::Stops,
};
use crate::{
    evidence::status,
    export::metrics::Scrape,
    kernel::{KernelCounters, Releasing, detach::Detached, reactor},
    profile::plan::Trust,
    query::{QueryServer, SocketPlace, server::Pending as QueryPending},
    util::{
        clock::{Clock, monotonic_ns},
        text,
    },
};

/// How often the kernel's loss counters and transport counts are sampled.
pub const COUNTER_PERIOD: Duration = Duration::from_secs(1);

/// Longest the ring buffer goes unread while no stall is due: how late a
/// finished request's span, a recovery's alert or a per-peer count can be.
/// The programs do not wake the agent per event (that costs the target
/// more than the event does), and waking only when something can be due
/// spares the idle agent a wake per tick; this bounds the staleness
/// between. `stallwatch inflight` and a metrics scrape read the ring first.
const MAX_UNREAD: Duration = Duration::from_millis(100);

/// Whether the loop goes on after an arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Continue,
    Stop,
}

/// Which processes the agent watches, and with which profile.
pub struct Watch {
    pub target: Target,
    pub rules: Rules,
}

/// What the loop waits on besides the session.
pub struct EventLoop {
    session: Session,
    /// Which profile watches which process.
    rules: Rules,
    /// `--pid`: the agent ends with its target; else processes are found.
    target: Target,
    /// The pids that exit ([`super::processes::Processes::new`]).
    exits: mpsc::UnboundedReceiver<u32>,
    /// Exec notifications (`None`: the target's execs go unnoticed).
    execs: Option<AsyncFd<RingBuf<MapData>>>,
    /// Processes that exec'd and may match a rule once they load their
    /// libraries.
    pending: Pending,
    /// Processes whose objects are being read, to be watched once read.
    reads: Reads,
    queries: QueryServer,
    /// The previous agent's links, being released.
    releasing: Option<Releasing>,
    stops: Stops,
    wake: Pin<Box<Sleep>>,
    counter_ticks: Interval,
    recheck: Interval,
    /// The kernel's loss counters at the last warning.
    reported: KernelCounters,
    unread_ns: u64,
}

impl EventLoop {
    /// Attach to the target (or every process a rule matches), take over
    /// what a previous agent left, then serve queries. `None` when a
    /// stop signal came first: the session is dropped then, which detaches
    /// what it attached and leaves a previous agent's state as it was.
    pub async fn start(
        mut session: Session,
        exits: mpsc::UnboundedReceiver<u32>,
        watch: Watch,
        socket: SocketPlace,
        clock: Clock,
        mut stops: Stops,
        trust: Trust,
    ) -> Result<Option<Self>> {
        let logger = EbpfLogger::init(session.probes.ebpf_mut()).context("setting up eBPF logging")?;
        let mut logger = reactor::register(logger, "the eBPF log buffer")?;
        // The programs' own log lines: forwarded as they come, by a task of
        // their own (nothing in the session is needed for them).
        tokio::spawn(async move {
            loop {
                match logger.readable_mut().await {
                    Ok(mut guard) => {
                        guard.get_inner_mut().flush();
                        guard.clear_ready();
                    }
                    Err(err) => {
                        warn!("the eBPF programs' log lines are no longer forwarded: {err:#}");
                        break;
                    }
                }
            }
        });
        let Watch { target, rules } = watch;
        let mut rules = rules.with_pods(session.telemetry.workloads());
        let mut reads = Reads::new(trust);
        let execs = match target {
            Target::Pid(pid) => {
                // First, so an exec during the attach is heard of too.
                let execs = match session.probes.watch_execs() {
                    Ok(ring) => Some(reactor::register(ring, "the EXECS ring buffer")?),
                    Err(err) => {
                        warn!(
                            pid,
                            "an exec of the target will go unnoticed (its old program's requests stay in flight): \
                             {err:#}"
                        );
                        None
                    }
                };
                let id = rules.choose(pid).with_context(|| {
                    format!(
                        "pid {pid} matches no rule ({}): name its profile with --profile",
                        text::value(&rules.describe_all())
                    )
                })?;
                reads.start(pid, id, &session.profiles[id.0])?;
                let Some(read) = stops.unless_stopped("reading the target's objects", reads.next()).await else {
                    return Ok(None);
                };
                let (plan, exited) = read.plan?;
                session.watch(&plan, id, exited)?;
                deployment::warn_if_partial(&session.profiles[id.0], &plan.lineage).await;
                execs
            }
            Target::Discover => {
                // Hear of execs first, so nothing starting during the scan is missed.
                let execs = reactor::register(session.probes.watch_execs()?, "the EXECS ring buffer")?;
                info!(rules = %rules.describe_all(), "discovering processes");
                if rules.selects_by_image() {
                    let pods = session.telemetry.workloads();
                    if stops.unless_stopped("listing the node's pods", pods.listed()).await.is_none() {
                        return Ok(None);
                    }
                }
                for pid in discovery::all_pids()? {
                    if let Some(id) = rules.choose_or_say(pid) {
                        if let Err(err) = reads.start(pid, id, &session.profiles[id.0]) {
                            session.refuse(pid, &err);
                        }
                    }
                }
                // Each read on its own deadline: one process whose files
                // do not answer delays the others by that much at most.
                while !reads.is_empty() {
                    let Some(read) = stops.unless_stopped("reading the selected processes", reads.next()).await else {
                        return Ok(None);
                    };
                    session.watch_or_log(read);
                }
                Some(execs)
            }
        };
        // Ours are attached: what a previous agent's probes recorded is ours
        // to follow, taken over first (its stalls may be near due), then its
        // probes can go. Before the take-over reads the table: a loss from
        // here on is after its view, and brings a resynchronisation.
        let counters = session.probes.counters()?;
        session.synced = Synced { ringbuf_full: counters.ringbuf_full, state_full: counters.state_full };
        session.restore()?;
        let releasing = session.probes.release_old_links()?;
        // After attaching, so a bad profile or pid is reported as such even
        // when another agent serves this socket (a second agent fails here).
        let mut queries = QueryServer::bind(socket, clock)?.with_workloads(session.telemetry.workloads());
        for pid in session.processes.pids() {
            name_for_queries(&mut queries, &session, pid);
        }
        session.transport.sample(&session.probes, monotonic_ns())?;
        // Attached, and a previous agent's requests taken over: a rolling
        // update may now stop the next pod.
        session.telemetry.set_ready();
        let config = session.engine.config();
        let unread_ns = unread_ns(config.timeout_ns, config.tick_ns);
        Ok(Some(Self {
            session,
            rules,
            target,
            exits,
            execs,
            pending: Pending::default(),
            reads,
            queries,
            releasing,
            stops,
            wake: Box::pin(tokio::time::sleep(Duration::ZERO)),
            counter_ticks: tokio::time::interval(COUNTER_PERIOD),
            recheck: tokio::time::interval(Duration::from_nanos(Pending::RECHECK_NS)),
            reported: KernelCounters::default(),
            unread_ns,
        }))
    }

    /// Until stopped (a signal, stdout closed, or with `--pid` the target
    /// gone) or failed; then the session, for [`Session::finish`], which
    /// leaves the state for the next agent whichever way the loop ended,
    /// and how it ended.
    pub async fn run(mut self) -> (Session, Result<()>) {
        let mut ended = self.turns().await;
        // The links of processes gone too: their slots are then free, and
        // none of them still fires when the next agent reuses a slot.
        while self.session.detacher.under_way() > 0 {
            let detached = self.session.detacher.detached().await;
            self.on_detached(&detached);
        }
        // The previous agent's links go before this one's state is left.
        if let Some(mut releasing) = self.releasing.take() {
            let released = releasing.done().await.and_then(|()| self.session.probes.released(releasing));
            if let Err(err) = released {
                ended = ended.and(Err(err.context("releasing the previous agent's links")));
            }
        }
        (self.session, ended)
    }

    async fn turns(&mut self) -> Result<()> {
        loop {
            let flow = tokio::select! {
                ready = self.session.reader.readable() => {
                    ready?;
                    self.session.drain();
                    Flow::Continue
                }
                () = &mut self.wake => self.on_wake(),
                _ = self.counter_ticks.tick() => self.on_counter_tick()?,
                Some(pid) = self.exits.recv() => self.on_exit(pid),
                pids = next_execs(&mut self.execs) => self.on_execs(pids?)?,
                _ = self.recheck.tick(), if !self.pending.is_empty() => self.on_recheck(),
                read = self.reads.next() => self.on_read(read)?,
                scrape = self.session.telemetry.scrape() => self.on_scrape(scrape),
                query = self.queries.next() => self.on_query(query),
                linked = self.session.opener.linked() => {
                    let session = &mut self.session;
                    session.opener.finish(linked, &mut session.probes, &mut session.transport, &mut session.detacher);
                    Flow::Continue
                }
                detached = self.session.detacher.detached() => self.on_detached(&detached),
                released = released(&mut self.releasing) => self.on_released(released)?,
                signal = self.stops.next() => {
                    info!(signal, "stopping");
                    Flow::Stop
                }
            };
            if flow == Flow::Stop || self.after_turn()? == Flow::Stop {
                return Ok(());
            }
        }
    }

    /// A stall can be due: the clock first, so every event submitted
    /// before it is read before the timers judge silence at it.
    fn on_wake(&mut self) -> Flow {
        let now = monotonic_ns();
        self.session.sync();
        self.session.gate(now);
        self.session.advance(now, status::READS_PER_TICK);
        Flow::Continue
    }

    /// Once a [`COUNTER_PERIOD`]: the warnings that are rate-limited, and a
    /// fresh sample of the transport counts.
    fn on_counter_tick(&mut self) -> Result<Flow> {
        let session = &mut self.session;
        self.reported = warn_on_loss(&session.probes, self.reported)?;
        session.ingest.warn_undecodable();
        session.signals.warn();
        session.state.warn();
        session.warn_alert_drops();
        session.warn_status();
        let now = monotonic_ns();
        session.transport.sample(&session.probes, now)?;
        session.sample_scheduling(now);
        Ok(Flow::Continue)
    }

    /// A watched process exited; with `--pid` the agent ends with it
    /// ([`Session::finish`] reports what the exit ended).
    fn on_exit(&mut self, pid: u32) -> Flow {
        self.session.unwatch(pid, Gone::Exited);
        self.queries.forget_process(pid);
        if self.target == Target::Discover { Flow::Continue } else { Flow::Stop }
    }

    /// Processes exec'd: a watched one's probes and requests went with its
    /// old image; one a rule matches is read to be watched in its new
    /// program, one that may match later waits in `pending`.
    fn on_execs(&mut self, pids: Vec<u32>) -> Result<Flow> {
        for pid in pids {
            let was = self.session.processes.profile(pid);
            if was.is_some() {
                self.session.unwatch(pid, Gone::Exec);
                self.queries.forget_process(pid);
            }
            match (self.target, was) {
                (Target::Discover, _) => match self.rules.choose(pid) {
                    Some(id) => self.read(pid, id),
                    None => self.pending.add(pid, monotonic_ns()),
                },
                // `--pid`: follow the target into its new program if its
                // profile attaches to it ([`Self::on_read`]); else stop, as
                // when it exits.
                (Target::Pid(_), Some(id)) => {
                    if let Err(err) = self.reads.start(pid, id, &self.session.profiles[id.0]) {
                        return self.target_lost(pid, &err);
                    }
                }
                (Target::Pid(_), None) => {}
            }
        }
        Ok(Flow::Continue)
    }

    /// Exec'd processes that may have loaded what a rule looks for; those
    /// that matched none within [`Pending::PATIENCE_NS`] are said once if
    /// they look like serving processes ([`Rules::choose_or_say`]).
    fn on_recheck(&mut self) -> Flow {
        let rules = &mut self.rules;
        let rechecked = self.pending.recheck(monotonic_ns(), |pid| rules.choose(pid));
        for pid in rechecked.expired {
            self.rules.choose_or_say(pid);
        }
        for (pid, id) in rechecked.matched {
            self.read(pid, id);
        }
        Flow::Continue
    }

    /// Begin reading a selected process's objects for profile `id`; one
    /// that cannot even be begun (gone already) is logged and counted as
    /// one that could not be watched.
    fn read(&mut self, pid: u32, id: ProfileId) {
        if let Err(err) = self.reads.start(pid, id, &self.session.profiles[id.0]) {
            self.session.refuse(pid, &err);
        }
    }

    /// A process's objects read: watch it. With `--pid`, a target whose new
    /// program cannot be watched ends the agent, as its exit would.
    fn on_read(&mut self, read: Read) -> Result<Flow> {
        let pid = read.pid;
        if self.target == Target::Discover {
            if self.session.watch_or_log(read) {
                name_for_queries(&mut self.queries, &self.session, pid);
            }
            return Ok(Flow::Continue);
        }
        match read.plan.and_then(|(plan, exited)| self.session.watch(&plan, read.profile, exited)) {
            Ok(()) => {
                name_for_queries(&mut self.queries, &self.session, pid);
                Ok(Flow::Continue)
            }
            Err(err) => self.target_lost(pid, &err),
        }
    }

    /// `--pid`: the target exec'd a program the profile cannot watch.
    fn target_lost(&mut self, pid: u32, err: &anyhow::Error) -> Result<Flow> {
        error!(
            pid,
            "not watching the target's new program, stopping as when it exits (to follow a process that loads the \
             profile's library after an exec, select it with --exe, --lib or --cmdline instead of --pid): {err:#}"
        );
        self.session.emit()?;
        Ok(Flow::Stop)
    }

    /// A metrics scrape: counts up to the scrape, not to the last drain.
    fn on_scrape(&mut self, scrape: Scrape) -> Flow {
        let session = &mut self.session;
        session.drain();
        session.telemetry.answer(
            scrape,
            &session.engine,
            &session.probes,
            session.ingest.undecodable,
            session.status_reads(),
            session.alerts.output().dropped(),
        );
        Flow::Continue
    }

    /// `stallwatch inflight`: up to date to the moment asked, not to the
    /// last tick, and to what the kernel holds of requests not yet due.
    fn on_query(&mut self, query: QueryPending) -> Flow {
        let session = &mut self.session;
        session.sync();
        session.engine.catch_up(None, &mut withheld_in(&session.state));
        self.queries.answer(query, &session.engine, &session.transport, &session.signals, monotonic_ns());
        Flow::Continue
    }

    /// The links of a process gone are: its slots are free.
    fn on_detached(&mut self, detached: &Detached) -> Flow {
        self.session.probes.detached(detached);
        info!(
            pid = detached.pid(),
            links = detached.links(),
            detach_ms = format_args!("{:.1}", detached.took().as_secs_f64() * 1e3),
            "probes of a process gone detached"
        );
        Flow::Continue
    }

    fn on_released(&mut self, released: Result<()>) -> Result<Flow> {
        released.context("releasing the previous agent's links")?;
        self.session.probes.released(self.releasing.take().expect("a release under way"))?;
        Ok(Flow::Continue)
    }

    /// After every arm: emit the turn's reports, stop if stdout is gone,
    /// and set the next wake.
    fn after_turn(&mut self) -> Result<Flow> {
        let session = &mut self.session;
        let closed = match session.emit() {
            Err(err) if !session.alerts.is_closed() => return Err(err),
            Err(_) => true,
            // The writer thread may have found it closed since.
            Ok(()) => session.alerts.output().is_closed(),
        };
        if closed {
            // As a pipeline's writer does at SIGPIPE, but leaving the state
            // for the next agent as a SIGTERM would.
            info!("stdout was closed (its reader went away): stopping");
            return Ok(Flow::Stop);
        }
        let now = monotonic_ns();
        let next = session.next_wake(now, self.unread_ns);
        self.wake.as_mut().reset(tokio::time::Instant::now() + Duration::from_nanos(next.saturating_sub(now)));
        Ok(Flow::Continue)
    }
}

/// Tell the query server a watched process's name and profile.
fn name_for_queries(queries: &mut QueryServer, session: &Session, pid: u32) {
    let profile = session.profile_of(pid).map_or("?", |profile| profile.name.as_str());
    queries.name_process(pid, session.processes.name(pid).unwrap_or("?"), profile);
}

/// Until the release under way, if any, is done; never without one.
async fn released(releasing: &mut Option<Releasing>) -> Result<()> {
    match releasing {
        Some(releasing) => releasing.done().await,
        None => std::future::pending().await,
    }
}

/// The next exec notifications, each pid once and in order; never resolves
/// without an exec ring buffer.
async fn next_execs(execs: &mut Option<AsyncFd<RingBuf<MapData>>>) -> Result<Vec<u32>> {
    match execs {
        Some(execs) => Ok(drain_execs(execs.readable_mut().await.context("waiting on the EXECS ring buffer")?)),
        None => std::future::pending().await,
    }
}

/// The pids in the exec ring buffer, in order, each once.
fn drain_execs(mut guard: AsyncFdReadyMutGuard<'_, RingBuf<MapData>>) -> Vec<u32> {
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

/// [`MAX_UNREAD`], but never longer than the timeout (a request's first
/// event is then read before its deadline, so its stall is never late) nor
/// shorter than a tick.
fn unread_ns(timeout_ns: u64, tick_ns: u64) -> u64 {
    super::duration_ns(MAX_UNREAD).min(timeout_ns).max(tick_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_buffer_is_read_within_the_timeout_and_never_more_often_than_a_tick() {
        const MS: u64 = 1_000_000;
        assert_eq!(unread_ns(60_000 * MS, 10 * MS), 100 * MS);
        // A request's first event is read before its deadline.
        assert_eq!(unread_ns(40 * MS, 10 * MS), 40 * MS);
        assert_eq!(unread_ns(5 * MS, 200 * MS), 200 * MS);
    }
}
