//! `stallwatch run`: attach to one process (`--pid`) or to every process a
//! rule matches, now and later, each with its rule's profile, and follow
//! their requests until told to stop (or, with `--pid`, until that process
//! exits or execs a program the profile does not attach to).
//!
//! [`rules`] says which profile watches which process,
//! [`session`] holds what one run holds and the steps taken on it,
//! [`processes`] the process table, [`ingest`] turns ring-buffer records
//! into observations, [`event_loop`] waits on everything that can wake the
//! agent, one method per arm; [`discovery`] finds the processes to watch,
//! [`reads`] reads their objects off the loop; [`stops`] are the signals
//! that end the agent.
mod deployment;
pub mod discovery;
mod event_loop;
mod ingest;
mod processes;
mod reads;
pub mod rules;
mod session;
mod stops;

use std::{io::Write, path::PathBuf, time::Duration};

use anyhow::{Result, bail};

use self::{
    event_loop::{EventLoop, Watch},
    rules::Rule,
    session::Session,
    stops::Stops,
};
use crate::{
    export::{
        alert::Format,
        telemetry::{Telemetry, TelemetryOptions},
    },
    kernel::{Probes, state::BpfDir},
    lifecycle::EngineConfig,
    profile::plan::Trust,
    query::SocketPlace,
    util::clock::Clock,
};

/// Which processes to watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// This one, with the profile of the first rule it matches; the agent
    /// ends when it exits.
    Pid(u32),
    /// Every process a rule matches, including those started later.
    Discover,
}

pub struct Options {
    pub target: Target,
    /// Which profile watches which process, in order ([`rules`]).
    pub rules: Vec<Rule>,
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
    /// Which filesystems' objects are read besides the host's own
    /// (`--trust-fuse`).
    pub trust: Trust,
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

pub async fn run(options: Options, out: impl Write + Send + 'static) -> Result<()> {
    let Options { target, rules, timeout, tick, max_tracked, format, telemetry, socket, bpf_dir, on_exit, trust } =
        options;
    if timeout < tick {
        bail!("--timeout {timeout:?} is shorter than --tick {tick:?}: raise the timeout or lower the tick");
    }
    // Before anything is created (the bpf and socket directories would
    // then belong to an unprivileged user, and root agents refuse them).
    crate::kernel::caps::require_privileges()?;
    // A stop from here on ends the agent at once, whatever start-up is
    // doing; before anything is attached nothing is left behind.
    let mut stops = Stops::install()?;
    let (rules, profiles) = rules::Rules::new(rules);
    tracing::info!(version = crate::util::build_info::VERSION, rules = %rules.describe_all(), "starting");
    let clock = Clock::new();
    let started = stops
        .unless_stopped("starting", async {
            // Before loading anything: a bad endpoint fails fast.
            let telemetry = Telemetry::start(&telemetry, clock).await?;
            // Before anything is pinned or attached: a socket directory
            // another user could change is refused.
            let socket = SocketPlace::check(&socket)?;
            let bpf_dir = bpf_dir.as_deref().map(BpfDir::open).transpose()?;
            anyhow::Ok((telemetry, socket, load(bpf_dir).await?))
        })
        .await;
    let Some((telemetry, socket, probes)) = started.transpose()? else { return Ok(()) };
    let limits = EngineConfig { timeout_ns: duration_ns(timeout), max_tracked, tick_ns: duration_ns(tick) };
    let (session, exits) = Session::start(profiles, limits, format, out, clock, telemetry, probes)?;
    let Some(event_loop) =
        EventLoop::start(session, exits, Watch { target, rules }, socket, clock, stops, trust).await?
    else {
        return Ok(());
    };
    let (session, ended) = event_loop.run().await;
    if let Err(err) = &ended {
        tracing::error!("the agent stops on an error; its state is left as --on-exit says: {err:#}");
    }
    let finished = session.finish(on_exit);
    ended.and(finished)
}

/// Load the eBPF object on a thread of its own (the verifier takes a
/// second or more on a loaded host), so a stop signal meanwhile is taken
/// at once: the thread is then left to end with the process.
async fn load(bpf_dir: Option<BpfDir>) -> Result<Probes> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("stallwatch-load".into())
        .spawn(move || {
            let _ = tx.send(Probes::load(bpf_dir));
        })
        .map_err(|err| anyhow::anyhow!("starting the thread that loads the eBPF object: {err}"))?;
    rx.await.map_err(|_| anyhow::anyhow!("loading the eBPF object: the loading thread ended without a word"))?
}

/// A duration in nanoseconds, as the engine and the kernel count time;
/// saturated (584 years is as good as forever).
fn duration_ns(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}
