//! What watching costs SGLang's own prefill, per request, side by side in
//! one run: tests/sglang/real/prefill.py (sglang 0.5.23's bootstrap server,
//! NixlKVManager and NixlKVSender unchanged from the wheel, real NIXL over
//! UCX on loopback, real ZMQ, TP1 decodes, healthy) serves the same rooms
//! - not watched (off);
//! - watched by `stallwatch run --profile nixl` (the NIXL probes only);
//! - watched by `stallwatch run --profile sglang` (the NIXL probes, the ZMQ
//!   signals and the scheduler-request signal: what an SGLang operator runs).
//!
//! Each run is a fresh target (its set-up is not timed); the CPU time of
//! every thread of the prefill process (schedstat) is taken from `go` to
//! `done`, and divided by the rooms served. The target's own loop (what it
//! supplies instead of SGLang's scheduler) polls between rooms, in every
//! column alike: the difference between columns is the agent's cost, the
//! ratio is diluted by that loop. Configurations alternate run by run;
//! medians are shown.
//!
//! `cargo run --release -p xtask -- bench` runs it (as root, with the SGLang
//! venv). Without `--bench` a smoke version runs (off and sglang, one run
//! each, a few rooms), which fails unless the agent followed every room.
mod support;

use std::{path::Path, time::Instant};

use anyhow::{Context as _, Result, bail};
use support::{Agent, Driver, median};

/// What one run measured.
struct Run {
    /// Prefill CPU (all threads) from `go` to `done`, per room, in us.
    cpu_us: f64,
    /// Wall time from `go` to `done`, per room, in ms.
    wall_ms: f64,
}

/// One run of `rooms` rooms under `profile` (`None`: off).
fn run(python: &Path, rooms: u64, profile: Option<&str>) -> Result<Run> {
    // msgpack: the scheduler-request signal reads the room (SGLang's
    // pickle default gives it nothing to read; see docs). The target is
    // killed with its decodes when the driver is dropped.
    let args = ["--fault", "none", "--count", &rooms.to_string(), "--max-seconds", "300"].map(String::from);
    let (mut driver, ready) =
        Driver::spawn(python, "tests/sglang/real/prefill.py", &args, &[("SGLANG_USE_PICKLE_IPC", "0")])?;
    let pid = ready["prefill_pid"].as_u64().context("ready without prefill_pid")? as u32;
    let agent = profile.map(|profile| Agent::start(&support::agent_bin(), pid, profile)).transpose()?;
    let (cpu_before, started) = (support::cpu_ns(pid)?, Instant::now());
    driver.go()?;
    let done = driver.until("done")?;
    let (cpu, wall) = (support::cpu_ns(pid)? - cpu_before, started.elapsed());
    if done["completed"].as_u64() != Some(rooms) {
        bail!("the SGLang target completed {} of {rooms} rooms: {done}", done["completed"]);
    }
    if let (Some(agent), Some(profile)) = (agent, profile) {
        let summary = agent.stop()?;
        if summary.lost_events > 0 {
            eprintln!("sglang bench: the agent lost {} events", summary.lost_events);
        }
        // The sglang profile follows rooms; nixl's lifecycles are handles.
        if profile == "sglang" && summary.completed < rooms {
            bail!("the sglang agent followed {} of the {rooms} rooms to their end", summary.completed);
        }
    }
    drop(driver);
    Ok(Run { cpu_us: cpu as f64 / 1e3 / rooms as f64, wall_ms: wall.as_secs_f64() * 1e3 / rooms as f64 })
}

fn main() -> Result<()> {
    support::require_root("the SGLang benchmark")?;
    let full = !support::smoke();
    let python = support::sglang_python()?;
    let (runs, rooms) = if full { (3, 300) } else { (1, 20) };
    let columns: &[(&str, Option<&str>)] = if full {
        &[("off", None), ("nixl", Some("nixl")), ("sglang", Some("sglang"))]
    } else {
        &[("off", None), ("sglang", Some("sglang"))]
    };
    let mut measured: Vec<Vec<Run>> = columns.iter().map(|_| Vec::new()).collect();
    for _ in 0..runs {
        for (n, (_, profile)) in columns.iter().enumerate() {
            measured[n].push(run(&python, rooms, *profile)?);
        }
    }
    let smoke = if full { "" } else { " [smoke run: too short for meaningful figures]" };
    println!(
        "SGLang's prefill (sglang 0.5.23, NIXL cu13, TP1 decodes), {rooms} healthy rooms a run, median of {runs} \
         interleaved runs (tests/sglang/real/prefill.py){smoke}:"
    );
    println!(
        "{:<10} {:>14} {:>8} {:>12} {:>18} {:>14}",
        "watched", "CPU us/room", "/off", "+us/room", "spread (min-max)", "wall ms/room"
    );
    let cpu: Vec<Vec<f64>> = measured.iter().map(|runs| runs.iter().map(|r| r.cpu_us).collect()).collect();
    let off = median(&cpu[0]);
    for (n, (name, _)) in columns.iter().enumerate() {
        let (value, wall) = (median(&cpu[n]), median(&measured[n].iter().map(|r| r.wall_ms).collect::<Vec<_>>()));
        let (min, max) = cpu[n].iter().fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
        let spread = format!("{min:.0}-{max:.0}");
        println!("{name:<10} {value:>14.1} {:>7.2}x {:>12.1} {spread:>18} {wall:>14.2}", value / off, value - off);
    }
    Ok(())
}
