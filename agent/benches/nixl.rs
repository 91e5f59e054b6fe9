//! Real NIXL transfer throughput, watched and not, side by side in one run:
//! small (4 KiB) and 64 MiB DRAM-to-DRAM WRITEs over UCX on loopback,
//! driven by tests/nixl/driver.py, with the initiator
//! - not watched (off);
//! - under the eBPF object's empty programs on every function the `nixl`
//!   profile probes (the kernel's uprobe floor);
//! - under Debian's bpftrace running the equivalent script (`bpftrace/nixl.bt`);
//! - watched by the real agent, `stallwatch run --profile nixl` (lifecycle
//!   and transport probes, its ring buffer read on its own tick);
//! - and by `STALLWATCH_BASELINE_BIN`, when set (the build before a change).
//!
//! Configurations alternate run by run; the median of the runs is shown.
//! `cargo run --release -p xtask -- bench` runs it (as root, with the venv
//! and bpftrace). Without `--bench` (as under `cargo test --all-targets`)
//! it runs a short smoke version without bpftrace, which fails unless the
//! agent saw the transfers.
mod support;

use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};
use stallwatch::probes::{Profile, resolve::ProcessImage};
use support::{Agent, Bpftrace, Config, Floor, median};

struct Run {
    transfers_per_s: f64,
    gb_per_s: f64,
}

fn run(size: u64, count: u64, config: &Config, profile: &Profile) -> Result<Run> {
    let python = support::venv_python();
    let mut child = Command::new(&python)
        .arg(support::root().join("tests/nixl/driver.py"))
        .args(["--mode", "healthy", "--count", &count.to_string(), "--size", &size.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| {
            format!(
                "starting the NIXL driver with {} (run `cargo run --release -p xtask -- setup --python`)",
                python.display()
            )
        })?;
    let mut stdin = child.stdin.take().context("driver stdin")?;
    let mut lines = BufReader::new(child.stdout.take().context("driver stdout")?).lines();
    let ready: serde_json::Value = serde_json::from_str(&lines.next().context("driver exited before ready")??)?;
    let pid = ready["initiator_pid"].as_u64().context("initiator_pid")? as u32;
    let mut floor = None;
    let mut bpftrace = None;
    let mut agent = None;
    match config {
        Config::Off => {}
        Config::Empty => floor = Some(Floor::attach(pid, profile)?),
        Config::Bpftrace => {
            let image = ProcessImage::read(pid)?;
            let nixl = image.find(Some("libnixl.so"))?.host_path;
            let ucp = image.find(Some("libucp.so"))?.host_path;
            bpftrace = Some(Bpftrace::start("nixl.bt", pid, &[("LIBNIXL", &nixl), ("LIBUCP", &ucp)])?);
        }
        Config::Agent(bin) => agent = Some(Agent::start(bin, pid, "nixl")?),
    }
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
    drop(floor);
    if let Some(bpftrace) = bpftrace {
        bpftrace.stop()?;
    }
    if let Some(agent) = agent {
        let summary = agent.stop()?;
        if summary.seen == 0 {
            bail!("the agent was attached but saw none of the {count} transfers");
        }
        if summary.lost_events > 0 {
            eprintln!("nixl bench: the agent lost {} events", summary.lost_events);
        }
    }
    Ok(Run {
        transfers_per_s: done["transfers_per_s"].as_f64().context("transfers_per_s")?,
        gb_per_s: done["gb_per_s"].as_f64().context("gb_per_s")?,
    })
}

fn main() -> Result<()> {
    support::require_root("the NIXL benchmark")?;
    let full = !support::smoke();
    if !support::venv_python().exists() {
        bail!(
            "no NIXL venv at {}: run `cargo run --release -p xtask -- setup --python`",
            support::venv_python().display()
        );
    }
    let profile = Profile::load("nixl")?;
    let columns = support::columns(full)?;
    // Five: the host's run-to-run spread at 4 KiB is several tenths.
    let runs = if full { 5 } else { 1 };
    let sizes: &[(&str, u64, u64)] = if full {
        &[("4 KiB x 5000", 4096, 5000), ("64 MiB x 40", 64 << 20, 40)]
    } else {
        &[("4 KiB x 200", 4096, 200)]
    };
    let smoke = if full { "" } else { " [smoke run: too short for meaningful figures]" };
    println!(
        "NIXL healthy WRITEs, {runs} interleaved runs, each configuration against the off run beside it, median and range \
         (tests/nixl/driver.py, default UCX transports){smoke}:"
    );
    print!("{:<14} {:>12}", "transfer", "off xfer/s");
    for (name, _) in &columns[1..] {
        print!(" {:>12}", format!("{name}/off"));
    }
    println!(" {:>9}", "off GB/s");
    for (label, size, count) in sizes {
        let mut rate = vec![Vec::new(); columns.len()];
        let mut gb = Vec::new();
        for _ in 0..runs {
            for (n, (_, config)) in columns.iter().enumerate() {
                let result = run(*size, *count, config, &profile)?;
                rate[n].push(result.transfers_per_s);
                if n == 0 {
                    gb.push(result.gb_per_s);
                }
            }
        }
        // Ratios per run: a run is compared with the off run of its own
        // round, minutes apart at most, not with the median of all.
        let ratios: Vec<Vec<f64>> =
            rate[1..].iter().map(|values| values.iter().zip(&rate[0]).map(|(on, off)| on / off).collect()).collect();
        print!("{label:<14} {:>12.0}", median(&rate[0]));
        for values in &ratios {
            print!(" {:>11.2}x", median(values));
        }
        println!(" {:>9.2}", median(&gb));
        print!("{:<27}", "  range over the runs");
        for values in &ratios {
            let (low, high) = values.iter().fold((f64::MAX, f64::MIN), |(low, high), v| (low.min(*v), high.max(*v)));
            print!(" {:>12}", format!("{low:.2}-{high:.2}"));
        }
        println!();
    }
    Ok(())
}
