//! Real NIXL transfer throughput with and without stallwatch attached,
//! side by side in one run: small (4 KiB) and 64 MiB DRAM-to-DRAM WRITEs
//! over UCX on loopback, driven by tests/nixl/driver.py.
//!
//! `cargo run --release -p xtask -- bench` runs it (as root, with the venv).
mod support;

use std::{
    io::{BufRead as _, BufReader, Write as _},
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};
use support::Attached;

/// Alternating runs per configuration; the median is reported.
const RUNS: usize = 3;

struct Run {
    transfers_per_s: f64,
    gb_per_s: f64,
    events: u64,
}

fn run(size: u64, count: u64, attach: bool) -> Result<Run> {
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
    let attached = attach.then(|| Attached::new(pid, "nixl")).transpose()?;
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
    println!("NIXL healthy transfers, median of {RUNS} alternating runs (tests/nixl/driver.py, default UCX transports):");
    println!("{:<22} {:>14} {:>14} {:>10} {:>10} {:>8} {:>10}", "transfer", "off: xfer/s", "on: xfer/s", "off: GB/s", "on: GB/s", "on/off", "events/xfer");
    for (label, size, count) in [("4 KiB x 5000", 4096, 5000), ("64 MiB x 40", 64 << 20, 40)] {
        let (mut off, mut on, mut off_gb, mut on_gb, mut events) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0);
        for _ in 0..RUNS {
            let without = run(size, count, false)?;
            let with = run(size, count, true)?;
            off.push(without.transfers_per_s);
            off_gb.push(without.gb_per_s);
            on.push(with.transfers_per_s);
            on_gb.push(with.gb_per_s);
            events += with.events;
        }
        let (off, on) = (median(off), median(on));
        println!(
            "{label:<22} {off:>14.0} {on:>14.0} {:>10.2} {:>10.2} {:>7.2}x {:>10.1}",
            median(off_gb),
            median(on_gb),
            on / off,
            events as f64 / (RUNS as f64 * count as f64)
        );
    }
    Ok(())
}
