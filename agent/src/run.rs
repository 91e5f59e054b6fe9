//! `stallwatch run`: attach a profile to a process and follow its requests
//! until it exits or the agent is told to stop.
use std::{
    io::Write,
    os::fd::{FromRawFd as _, OwnedFd},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use aya_log::EbpfLogger;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
    time::MissedTickBehavior,
};
use tracing::{info, warn};

use crate::{
    events::{self, EventReader, Skipped},
    export::{
        alert::{AlertWriter, Format},
        clock::{Clock, monotonic_ns},
    },
    lifecycle::{Engine, EngineConfig, Report},
    probes::{KernelCounters, Probes, Profile},
    reactor,
};

pub struct Options {
    pub pid: u32,
    pub profile: Profile,
    pub timeout: Duration,
    pub tick: Duration,
    pub max_tracked: usize,
    pub format: Format,
}

/// How often the kernel's loss counters are checked.
const COUNTER_PERIOD: Duration = Duration::from_secs(1);

pub async fn run(options: Options, out: impl Write) -> Result<()> {
    let Options { pid, profile, timeout, tick, max_tracked, format } = options;
    if timeout < tick {
        bail!("--timeout {timeout:?} is shorter than --tick {tick:?}: raise the timeout or lower the tick");
    }
    // Open the pidfd first: if the pid is reused after an exit, the pidfd
    // still refers to the process we attached to.
    let exited = pidfd(pid)?;
    let mut probes = Probes::load()?;
    let logger = EbpfLogger::init(probes.ebpf_mut()).context("setting up eBPF logging")?;
    let mut logger = reactor::register(logger, "the eBPF log buffer")?;
    let mut reader = EventReader::new(&mut probes)?;
    let slots = probes.attach(pid, &profile)?;

    let clock = Clock::new();
    let mut alerts = AlertWriter::new(out, format, clock);
    alerts.name_process(pid, &process_name(pid));
    let mut engine = Engine::new(EngineConfig {
        timeout_ns: duration_ns(timeout),
        max_tracked,
        tick_ns: duration_ns(tick),
    });
    info!(
        pid,
        profile = %profile.name,
        probes = slots.len(),
        timeout = %humantime::format_duration(timeout),
        "watching"
    );

    let mut ticks = tokio::time::interval(tick);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut counter_ticks = tokio::time::interval(COUNTER_PERIOD);
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut reports = Vec::new();
    let mut reported = KernelCounters::default();
    let mut ingest = Ingest::default();

    loop {
        tokio::select! {
            read = reader.read(|bytes| ingest.record(bytes, &probes, &mut engine, &mut reports)) => read?,
            _ = ticks.tick() => engine.advance(monotonic_ns(), &mut reports),
            _ = counter_ticks.tick() => reported = warn_on_loss(&probes, reported)?,
            ready = exited.readable() => {
                ready.context("waiting on the target's pidfd")?.retain_ready();
                // Everything the process did before it died counts first.
                reader.drain(|bytes| ingest.record(bytes, &probes, &mut engine, &mut reports));
                info!(pid, "target process exited");
                engine.process_exited(pid, monotonic_ns(), &mut reports);
                probes.detach(pid);
                emit(&mut alerts, &mut reports)?;
                break;
            }
            log = logger.readable_mut() => {
                let mut guard = log.context("waiting on the eBPF log buffer")?;
                guard.get_inner_mut().flush();
                guard.clear_ready();
            }
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
        }
        emit(&mut alerts, &mut reports)?;
    }
    reader.drain(|bytes| ingest.record(bytes, &probes, &mut engine, &mut reports));
    engine.advance(monotonic_ns(), &mut reports);
    emit(&mut alerts, &mut reports)?;
    let kernel = probes.counters()?;
    ingest.log();
    alerts.summary(&engine.stats(), &kernel).context("writing the summary")?;
    Ok(())
}

/// Records the ring buffer held that did not become observations.
#[derive(Default)]
struct Ingest {
    undecodable: u64,
    unknown_slot: u64,
    no_stage: u64,
}

impl Ingest {
    fn record(&mut self, bytes: &[u8], probes: &Probes, engine: &mut Engine, reports: &mut Vec<Report>) {
        let event = match events::decode(bytes) {
            Ok(event) => event,
            Err(err) => {
                self.undecodable += 1;
                warn!("{err:#}");
                return;
            }
        };
        match events::observe(&event, probes) {
            Ok(observation) => engine.observe(observation, reports),
            Err(Skipped::UnknownSlot) => self.unknown_slot += 1,
            Err(Skipped::NoStage) => self.no_stage += 1,
        }
    }

    fn log(&self) {
        if self.undecodable + self.unknown_slot + self.no_stage > 0 {
            warn!(
                undecodable = self.undecodable,
                unknown_slot = self.unknown_slot,
                no_stage = self.no_stage,
                "ring-buffer records that did not become lifecycle events"
            );
        }
    }
}

fn emit<W: Write>(alerts: &mut AlertWriter<W>, reports: &mut Vec<Report>) -> Result<()> {
    for report in reports.drain(..) {
        alerts.report(&report).context("writing an alert to stdout")?;
    }
    Ok(())
}

/// Log each new loss the kernel counted, as it happens.
fn warn_on_loss(probes: &Probes, before: KernelCounters) -> Result<KernelCounters> {
    let now = probes.counters()?;
    if now.lost() > before.lost() {
        warn!(
            lost = now.lost() - before.lost(),
            ringbuf_full = now.ringbuf_full,
            read_failed = now.read_failed,
            args_missing = now.args_missing,
            no_slot = now.no_slot,
            "events lost in the kernel"
        );
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
        return Err(err).with_context(|| format!("pidfd_open({pid})"));
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    reactor::register(fd, "the target's pidfd")
}

fn process_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).map_or_else(|_| "?".to_owned(), |s| s.trim().to_owned())
}

fn duration_ns(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}
