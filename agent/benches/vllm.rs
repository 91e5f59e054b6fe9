//! vLLM's KV path on real NIXL, watched and not, side by side in one run:
//! the decode's READs (4 KiB and 64 MiB, DRAM to DRAM over UCX on
//! loopback, each made, posted, polled and released with its
//! `"<id>:1"` notification as vLLM's pull worker does) and the prefill's
//! getNotifs loop that reads those notifications (tests/vllm/bench_read.py,
//! NIXL's Python API in vLLM's call shape, not vLLM's classes), with both
//! processes
//! - not watched (off);
//! - under the eBPF object's empty programs on every function the `vllm`
//!   profile links for the whole run (the kernel's uprobe floor);
//! - watched by the real agent, `stallwatch run --profile vllm`, one per
//!   process (the decode's READ handles and genNotif heartbeats, the
//!   prefill's getNotifs map walked at every return).
//!
//! Printed per size: the decode's READs/s (each column against the off run
//! of its round, median and range), and the prefill's time per getNotifs
//! call, empty and with notifications (the kernel's walk of the map), as
//! the target measures it around the call, and its time per send of an
//! EngineCoreOutputs-shaped frame of four outputs (1.3 KB, read whole by
//! the `vllm_outputs` capture). Without `--bench` (as under
//! `cargo test --all-targets`) a short smoke run, which fails unless the
//! agents saw the READs.
mod support;

use anyhow::{Context as _, Result, bail};
use stallwatch::profile::Profile;
use support::{Agent, Config, Driver, Floor, median};

struct Run {
    reads_per_s: f64,
    gb_per_s: f64,
    /// The prefill's ns per getNotifs call: empty, and with notifications.
    empty_ns: f64,
    busy_ns: f64,
    /// The prefill's ns per EngineCoreOutputs-shaped frame sent.
    send_ns: f64,
}

fn run(size: u64, count: u64, config: &Config, profile: &Profile) -> Result<Run> {
    let python = support::venv_python();
    let slots = if size > 1 << 20 { 2 } else { 16 };
    let args =
        ["--count", &count.to_string(), "--size", &size.to_string(), "--slots", &slots.to_string()].map(String::from);
    let (mut driver, ready) = Driver::spawn(&python, "tests/vllm/bench_read.py", &args, &[])?;
    let pids: Vec<u32> = ["decode_pid", "prefill_pid"]
        .iter()
        .map(|name| ready[name].as_u64().map(|pid| pid as u32).with_context(|| format!("no {name}: {ready}")))
        .collect::<Result<_>>()?;
    let mut floors = Vec::new();
    let mut agents = Vec::new();
    match config {
        Config::Off | Config::Bpftrace => {}
        Config::Empty => {
            for pid in &pids {
                floors.push(Floor::attach(*pid, profile)?);
            }
        }
        Config::Agent(bin) => {
            for pid in &pids {
                agents.push(Agent::start(bin, *pid, "vllm")?);
            }
        }
    }
    driver.go()?;
    let done = driver.until("done")?;
    driver.finish();
    drop(floors);
    let mut summaries = agents.into_iter().map(Agent::stop).collect::<Result<Vec<_>>>()?;
    if let Some(decode) = summaries.first_mut()
        && decode.completed < count
    {
        bail!("the decode's agent followed {} of the {count} READs to their release", decode.completed);
    }
    let prefill = &done["prefill"];
    Ok(Run {
        reads_per_s: done["transfers_per_s"].as_f64().context("transfers_per_s")?,
        gb_per_s: done["gb_per_s"].as_f64().context("gb_per_s")?,
        empty_ns: prefill["empty_ns_per_call"].as_f64().context("empty_ns_per_call")?,
        busy_ns: prefill["busy_ns_per_call"].as_f64().context("busy_ns_per_call")?,
        send_ns: prefill["send_ns_per_output"].as_f64().context("send_ns_per_output")?,
    })
}

fn main() -> Result<()> {
    support::require_root("the vLLM benchmark")?;
    let full = !support::smoke();
    let profile = Profile::load("vllm")?;
    // Off, the floor and this build's agent (bpftrace has no script for
    // the map walk, and is left out).
    let columns: Vec<(&str, Config)> =
        support::columns(false)?.into_iter().filter(|(_, config)| !matches!(config, Config::Bpftrace)).collect();
    let runs = if full { 5 } else { 1 };
    let sizes: &[(&str, u64, u64)] = if full {
        &[("4 KiB x 2000", 4096, 2000), ("64 MiB x 20", 64 << 20, 20)]
    } else {
        &[("4 KiB x 100", 4096, 100)]
    };
    let smoke = if full { "" } else { " [smoke run: too short for meaningful figures]" };
    println!(
        "vLLM-shaped NIXL READs (decode) and getNotifs (prefill), {runs} interleaved runs, each configuration \
         against the off run beside it, median and range (tests/vllm/bench_read.py){smoke}:"
    );
    for (label, size, count) in sizes {
        let mut results: Vec<Vec<Run>> = (0..columns.len()).map(|_| Vec::new()).collect();
        for _ in 0..runs {
            for (n, (_, config)) in columns.iter().enumerate() {
                results[n].push(run(*size, *count, config, &profile)?);
            }
        }
        let off = &results[0];
        println!(
            "{label}: off {:.0} READs/s ({:.2} GB/s); prefill getNotifs off: {:.1} us empty, {:.1} us with \
             notifications; engine output send off: {:.1} us",
            median(&off.iter().map(|r| r.reads_per_s).collect::<Vec<_>>()),
            median(&off.iter().map(|r| r.gb_per_s).collect::<Vec<_>>()),
            median(&off.iter().map(|r| r.empty_ns / 1e3).collect::<Vec<_>>()),
            median(&off.iter().map(|r| r.busy_ns / 1e3).collect::<Vec<_>>()),
            median(&off.iter().map(|r| r.send_ns / 1e3).collect::<Vec<_>>()),
        );
        for (n, (name, _)) in columns.iter().enumerate().skip(1) {
            let ratios: Vec<f64> =
                results[n].iter().zip(off).map(|(on, off)| on.reads_per_s / off.reads_per_s).collect();
            let (low, high) = ratios.iter().fold((f64::MAX, f64::MIN), |(low, high), v| (low.min(*v), high.max(*v)));
            println!(
                "  {name:<10} READs {:.2}x ({low:.2}-{high:.2}); prefill getNotifs {:.1} us empty, {:.1} us with \
                 notifications; engine output send {:.1} us",
                median(&ratios),
                median(&results[n].iter().map(|r| r.empty_ns / 1e3).collect::<Vec<_>>()),
                median(&results[n].iter().map(|r| r.busy_ns / 1e3).collect::<Vec<_>>()),
                median(&results[n].iter().map(|r| r.send_ns / 1e3).collect::<Vec<_>>()),
            );
        }
    }
    Ok(())
}
