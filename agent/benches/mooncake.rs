//! What the `sglang-mooncake` profile costs an SGLang prefill on Mooncake,
//! side by side in one run, with the process
//! - not watched (off);
//! - under the eBPF object's empty programs on every function the profile
//!   links for the whole run (the kernel's own uprobe cost, the floor for
//!   any watcher of those functions);
//! - watched by the real agent, `stallwatch run --profile sglang-mooncake`
//!   (and by `STALLWATCH_BASELINE_BIN`'s, when set).
//!
//! Two measures:
//! - Mooncake WRITEs (tests/sglang/mooncake/bench_write.py: SGLang's own
//!   MooncakeTransferEngine over the real engine, TCP on loopback, one
//!   `batch_transfer_sync_write` per transfer as SGLang's `_transfer_data`
//!   makes one per chunk and destination), at SGLang's smallest batch (its
//!   aux batch: 2 runs of 64 bytes), a small KV chunk (4 runs of 4 KiB)
//!   and 64 MiB; each configuration's transfers/s against the off run of
//!   its round (median and range), and the writer's CPU per transfer;
//! - the prefill's bootstrap thread (tests/sglang/zmq_rate.py --dialect
//!   mooncake: per round one room's Mooncake destination, 10 frames, and
//!   its status, 3 frames, sent and received with pyzmq as SGLang's
//!   bootstrap thread does), as the CPU time of that thread per round.
//!
//! Every run fails if the functions the floor attaches differ from those
//! the agent's summary lists as `attached: always`.
//!
//! The host's load average is printed with the figures: on a shared host
//! the wall-clock ratios move with it. Figures only, never a pass or fail.
//! `cargo run --release -p xtask -- bench` runs it (as root, with the SGLang
//! venv and its Mooncake layer). Without `--bench` a short smoke run, which
//! fails unless the agent followed every batch and every room.
mod support;

use std::{collections::BTreeSet, fs, path::Path};

use anyhow::{Context as _, Result, bail};
use stallwatch::profile::Profile;
use support::{Agent, Config, Driver, Floor, median};

const PROFILE: &str = "sglang-mooncake";

/// One run of a driver script watched so: its `done` line, and the CPU
/// time of the watched process from `go` to `done` (ns).
fn drive(
    python: &Path,
    script: &str,
    args: &[String],
    config: &Config,
    profile: &Profile,
    at_least: u64,
) -> Result<(serde_json::Value, u64)> {
    let (mut driver, ready) = Driver::spawn(python, script, args, &[])?;
    let pid = ready["pid"].as_u64().with_context(|| format!("ready without pid: {ready}"))? as u32;
    let (floor, agent) = match config {
        Config::Off | Config::Bpftrace => (None, None),
        Config::Empty => (Some(Floor::attach(pid, profile)?), None),
        Config::Agent(bin) => (None, Some((Agent::start(bin, pid, PROFILE)?, Floor::symbols(pid, profile)?))),
    };
    let cpu_before = support::cpu_ns(pid)?;
    driver.go()?;
    let done = driver.until("done");
    let cpu = support::cpu_ns(pid).map(|after| after - cpu_before).unwrap_or(0);
    driver.finish();
    drop(floor);
    let done = done?;
    if let Some((agent, floor_symbols)) = agent {
        let summary = agent.stop()?;
        // The floor must be the agent's own probe set: the progress probe
        // (linked only near a stall) in neither.
        let linked: BTreeSet<&str> = summary.always_attached.iter().map(|(symbol, _)| symbol.as_str()).collect();
        let floor: BTreeSet<&str> = floor_symbols.iter().map(String::as_str).collect();
        if linked != floor {
            bail!(
                "the empty-program floor would attach other functions than the agent linked for the run: the floor \
                 alone {:?}, the agent alone {:?}; make Floor::points attach what the agent attaches",
                floor.difference(&linked).collect::<Vec<_>>(),
                linked.difference(&floor).collect::<Vec<_>>()
            );
        }
        if summary.lost_events > 0 {
            eprintln!("mooncake bench: the agent lost {} events", summary.lost_events);
        }
        if summary.completed < at_least {
            let followed =
                format!("the agent followed {} of {at_least} lifecycles to their end ({script})", summary.completed);
            // A smoke run checks what was timed happened; a full run on a
            // loaded host may starve the agent, which its figures survive.
            if support::smoke() {
                bail!(followed);
            }
            eprintln!("mooncake bench: {followed}");
        }
    }
    Ok((done, cpu))
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|text| text.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn range(values: &[f64]) -> (f64, f64) {
    values.iter().fold((f64::MAX, f64::MIN), |(low, high), v| (low.min(*v), high.max(*v)))
}

fn main() -> Result<()> {
    support::require_root("the Mooncake benchmark")?;
    let full = !support::smoke();
    let python = support::sglang_python()?;
    let profile = Profile::load(PROFILE)?;
    let columns: Vec<(&str, Config)> =
        support::columns(false)?.into_iter().filter(|(_, config)| !matches!(config, Config::Bpftrace)).collect();
    let runs = if full { 5 } else { 1 };
    // (label, bytes a run, runs a batch, batches)
    let sizes: &[(&str, u64, u64, u64)] = if full {
        &[
            ("2 x 64 B (the aux batch)", 64, 2, 3000),
            ("4 x 4 KiB (a KV chunk)", 4096, 4, 3000),
            ("64 MiB", 64 << 20, 1, 30),
        ]
    } else {
        &[("2 x 64 B (the aux batch)", 64, 2, 100)]
    };
    let smoke = if full { "" } else { " [smoke run: too short for meaningful figures]" };
    println!("host load average at the start (1, 5, 15 min): {}{smoke}", loadavg());
    println!(
        "Mooncake WRITEs, SGLang's MooncakeTransferEngine over TCP loopback, one batch_transfer_sync_write a \
         transfer, {runs} interleaved runs, each configuration against the off run beside it, median and range \
         (tests/sglang/mooncake/bench_write.py):"
    );
    for (label, size, requests, count) in sizes {
        let args = ["--size", &size.to_string(), "--requests", &requests.to_string(), "--count", &count.to_string()]
            .map(String::from);
        let mut rate: Vec<Vec<f64>> = vec![Vec::new(); columns.len()];
        let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); columns.len()];
        for _ in 0..runs {
            for (n, (_, config)) in columns.iter().enumerate() {
                let (done, cpu_ns) =
                    drive(&python, "tests/sglang/mooncake/bench_write.py", &args, config, &profile, *count)?;
                rate[n].push(done["transfers_per_s"].as_f64().context("transfers_per_s")?);
                cpu[n].push(cpu_ns as f64 / 1e3 / *count as f64);
            }
        }
        let off = median(&rate[0]);
        let bytes = (size * requests) as f64;
        println!(
            "{label} x {count}: off {off:.0} transfers/s ({:.3} GB/s), writer CPU {:.1} us a transfer",
            off * bytes / 1e9,
            median(&cpu[0])
        );
        for (n, (name, _)) in columns.iter().enumerate().skip(1) {
            let ratios: Vec<f64> = rate[n].iter().zip(&rate[0]).map(|(on, off)| on / off).collect();
            let (low, high) = range(&ratios);
            println!(
                "  {name:<10} {:.2}x ({low:.2}-{high:.2}), writer CPU {:.1} us a transfer",
                median(&ratios),
                median(&cpu[n])
            );
        }
    }

    let rounds: u64 = if full { 20_000 } else { 500 };
    let args = ["--dialect", "mooncake", "--rounds", &rounds.to_string()].map(String::from);
    let mut thread: Vec<Vec<f64>> = vec![Vec::new(); columns.len()];
    let mut wall: Vec<Vec<f64>> = vec![Vec::new(); columns.len()];
    for _ in 0..runs {
        for (n, (_, config)) in columns.iter().enumerate() {
            // One room a round, released by its status.
            let (done, _) = drive(&python, "tests/sglang/zmq_rate.py", &args, config, &profile, rounds)?;
            thread[n].push(done["cpu_us_per_round"].as_f64().context("cpu_us_per_round")?);
            wall[n].push(done["us_per_round"].as_f64().context("us_per_round")?);
        }
    }
    println!(
        "The prefill's bootstrap thread, {rounds} rounds of a Mooncake destination (10 frames) and status (3), \
         each sent and received, median of {runs} interleaved runs (tests/sglang/zmq_rate.py --dialect mooncake):"
    );
    let (off, empty) = (median(&thread[0]), median(&thread[1]));
    println!("{:<11} {:>14} {:>8} {:>9} {:>16}", "watched", "CPU us/round", "/off", "/empty", "wall us/round");
    for (n, (name, _)) in columns.iter().enumerate() {
        let value = median(&thread[n]);
        println!("{name:<11} {value:>14.1} {:>7.2}x {:>8.2}x {:>16.1}", value / off, value / empty, median(&wall[n]));
    }
    println!("host load average at the end (1, 5, 15 min): {}", loadavg());
    Ok(())
}
