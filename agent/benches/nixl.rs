//! Real NIXL transfer throughput with and without stallwatch attached,
//! side by side in one run: small (4 KiB) and 64 MiB DRAM-to-DRAM WRITEs
//! over UCX on loopback, driven by tests/nixl/driver.py.
//!
//! `cargo run --release -p xtask -- bench` runs it (as root, with the venv).
//! Under `cargo test --all-targets` it runs a smoke version: one run of
//! each configuration with a few small transfers, and it fails unless the
//! attached probes saw them.
mod support;

use std::{
    io::{BufRead as _, BufReader, Write as _},
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};
use stallwatch::probes::Profile;
use support::Attached;

/// Alternating runs per configuration; the median is reported.
const RUNS: usize = 3;
const SIZES: [(&str, u64, u64); 2] = [("4 KiB x 5000", 4096, 5000), ("64 MiB x 40", 64 << 20, 40)];
const SMOKE_SIZES: [(&str, u64, u64); 1] = [("4 KiB x 200", 4096, 200)];

struct Run {
    transfers_per_s: f64,
    gb_per_s: f64,
    events: u64,
}

fn run(size: u64, count: u64, attach: Option<&Profile>) -> Result<Run> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let venv = root.join(std::env::var("STALLWATCH_VENV").unwrap_or_else(|_| "target/venv".into()));
    let python = venv.join("bin/python");
    let mut child = Command::new(&python)
        .arg(root.join("tests/nixl/driver.py"))
        .args(["--mode", "healthy", "--count", &count.to_string(), "--size", &size.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting the NIXL driver with {} (run `cargo run --release -p xtask -- setup --python`)", python.display()))?;
    let mut stdin = child.stdin.take().context("driver stdin")?;
    let mut lines = BufReader::new(child.stdout.take().context("driver stdout")?).lines();
    let ready: serde_json::Value = serde_json::from_str(&lines.next().context("driver exited before ready")??)?;
    let pid = ready["initiator_pid"].as_u64().context("initiator_pid")? as u32;
    let attached = attach.map(|profile| Attached::new(pid, profile)).transpose()?;
    writeln!(stdin, "go")?;
    let done = loop {
        let value: serde_json::Value = serde_json::from_str(&lines.next().context("driver exited before done")??)?;
        match value["event"].as_str() {
            Some("done") => break value,
            Some("error") => bail!("driver failed: {value}"),
            _ => {}
        }
    };
    drop(stdin);
    let _ = child.wait();
    let events = attached.map_or(0, Attached::finish);
    Ok(Run {
        transfers_per_s: done["transfers_per_s"].as_f64().context("transfers_per_s")?,
        gb_per_s: done["gb_per_s"].as_f64().context("gb_per_s")?,
        events,
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> Result<()> {
    support::require_root("the NIXL benchmark")?;
    let smoke = support::smoke();
    let (runs, sizes) = if smoke { (1, &SMOKE_SIZES[..]) } else { (RUNS, &SIZES[..]) };
    let full = Profile::load("nixl")?;
    let lifecycle_only = Profile { activity: Vec::new(), ..full.clone() };
    let configs: [(&str, Option<&Profile>); 3] =
        [("off", None), ("lifecycle", Some(&lifecycle_only)), ("+transport", Some(&full))];
    println!("NIXL healthy transfers, median of {runs} interleaved runs (tests/nixl/driver.py, default UCX transports):");
    println!(
        "{:<14} {:>11} {:>11} {:>11} {:>9} {:>9} {:>9} {:>13}",
        "transfer", "off xfer/s", "lifecycle", "+transport", "off GB/s", "lc/off", "full/off", "events/xfer"
    );
    for &(label, size, count) in sizes {
        let mut rate: [Vec<f64>; 3] = Default::default();
        let mut gb: [Vec<f64>; 3] = Default::default();
        let mut events = 0;
        for _ in 0..runs {
            for (n, (_, profile)) in configs.iter().enumerate() {
                let result = run(size, count, *profile)?;
                rate[n].push(result.transfers_per_s);
                gb[n].push(result.gb_per_s);
                if n == 1 {
                    events += result.events;
                }
            }
        }
        let [off, lifecycle, transport] = rate.map(median);
        println!(
            "{label:<14} {off:>11.0} {lifecycle:>11.0} {transport:>11.0} {:>9.2} {:>8.2}x {:>8.2}x {:>13.1}",
            median(gb[0].clone()),
            lifecycle / off,
            transport / off,
            events as f64 / (runs as f64 * count as f64)
        );
        println!(
            "{:<14} {:>11} {:>11} {:>11} {:>9} GB/s with lifecycle: {:.2}, with transport: {:.2}",
            "", "", "", "", "", median(gb[1].clone()), median(gb[2].clone())
        );
        if smoke && events == 0 {
            bail!("{label}: the lifecycle probes were attached but saw none of the transfers");
        }
    }
    Ok(())
}
