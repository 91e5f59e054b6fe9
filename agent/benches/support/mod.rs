//! Shared by the benchmarks that attach real probes.
use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use aya::maps::RingBuf;
use stallwatch::probes::{Probes, Profile};

/// Benchmarks load eBPF: without root they stop with the reason.
pub fn require_root(what: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "{what} loads eBPF and needs root: run `cargo run --release -p xtask -- bench` as root \
             (or `-- test`, which runs its smoke version)"
        );
    }
    Ok(())
}

/// `cargo bench` passes `--bench`; without it (`cargo test --all-targets`,
/// which `xtask test` runs) a benchmark runs a short smoke version of
/// itself, which checks that what it timed did happen and fails, never
/// skips, when something it needs is missing.
pub fn smoke() -> bool {
    !std::env::args().any(|arg| arg == "--bench")
}

/// A profile attached as the agent attaches it, with a thread consuming
/// the ring buffer, so emitting events costs what it costs in production.
pub struct Attached {
    _probes: Probes,
    stop: Arc<AtomicBool>,
    drain: Option<JoinHandle<u64>>,
}

impl Attached {
    pub fn new(pid: u32, profile: &Profile) -> Result<Self> {
        let mut probes = Probes::load(None)?;
        let map = probes.ebpf_mut().take_map("EVENTS").context("EVENTS map")?;
        let mut ring = RingBuf::try_from(map)?;
        probes.attach(pid, profile)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let drain = std::thread::spawn(move || {
            let mut events = 0;
            while !stopped.load(Ordering::Relaxed) {
                while ring.next().is_some() {
                    events += 1;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            events
        });
        Ok(Self { _probes: probes, stop, drain: Some(drain) })
    }

    /// Detach and return how many events were read.
    pub fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.drain.take().and_then(|drain| drain.join().ok()).unwrap_or(0)
    }
}
