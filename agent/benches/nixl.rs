//! Real NIXL transfer throughput, watched and not, side by side in one run:
//! small (4 KiB) and 64 MiB DRAM-to-DRAM WRITEs over UCX on loopback,
//! driven by tests/nixl/driver.py, with the initiator
//! - not watched (off);
//! - under the eBPF object's empty programs on exactly the functions the
//!   agent links for the whole run (the kernel's uprobe floor; not UCX's
//!   progress function, which the agent links only near a stall: the run
//!   checks that the agent's summary lists the same functions);
//! - under Debian's bpftrace running the equivalent script (`bpftrace/nixl.bt`);
//! - watched by the real agent, `stallwatch run --profile nixl` (lifecycle
//!   and transport probes, its ring buffer read on its own tick);
//! - and by `STALLWATCH_BASELINE_BIN`, when set (the build before a change).
//!
//! Configurations alternate run by run; the median of the runs is shown.
//! `cargo run --release -p xtask -- bench` runs it (as root, with the venv
//! and bpftrace). Without `--bench` (as under `cargo test --all-targets`)
//! it runs a short smoke version without bpftrace, which fails unless the
//! agent saw the transfers and attached what the floor attaches. Each size
//! also prints the probe hits a transfer makes, as the agent's summary
//! counts them.
mod support;

use std::{
    collections::BTreeSet,
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};
use stallwatch::profile::{Profile, resolve::ProcessImage};
use support::{Agent, Bpftrace, Config, Floor, median};

struct Run {
    transfers_per_s: f64,
    gb_per_s: f64,
    /// Under the agent: what a transfer hit.
    hits_per_transfer: Option<Hits>,
}

/// The probe hits of one transfer.
struct Hits {
    /// Each probe linked for the whole run, as the agent's summary counts
    /// its hits.
    probes: Vec<(String, f64)>,
    /// The kernel's uprobe hits: the summary counts a return probe's entry
    /// half (which saves its arguments) with it.
    uprobes: f64,
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
        Config::Agent(bin) => agent = Some((Agent::start(bin, pid, "nixl")?, Floor::symbols(pid, profile)?)),
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
    let mut hits_per_transfer = None;
    if let Some((agent, floor_symbols)) = agent {
        let summary = agent.stop()?;
        if summary.seen == 0 {
            bail!("the agent was attached but saw none of the {count} transfers");
        }
        if summary.lost_events > 0 {
            eprintln!("nixl bench: the agent lost {} events", summary.lost_events);
        }
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
        let probes: Vec<(String, f64)> =
            summary.always_attached.into_iter().map(|(symbol, hits)| (symbol, hits as f64 / count as f64)).collect();
        // Each of the floor's attachments is one uprobe of the agent's, hit
        // once per call of its function.
        let calls = |symbol: &str| probes.iter().filter(|(s, _)| s == symbol).map(|(_, per)| *per).fold(0.0, f64::max);
        let uprobes = floor_symbols.iter().map(|symbol| calls(symbol)).sum();
        hits_per_transfer = Some(Hits { probes, uprobes });
    }
    Ok(Run {
        transfers_per_s: done["transfers_per_s"].as_f64().context("transfers_per_s")?,
        gb_per_s: done["gb_per_s"].as_f64().context("gb_per_s")?,
        hits_per_transfer,
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
        let mut hits = None;
        for _ in 0..runs {
            for (n, (_, config)) in columns.iter().enumerate() {
                let result = run(*size, *count, config, &profile)?;
                rate[n].push(result.transfers_per_s);
                if n == 0 {
                    gb.push(result.gb_per_s);
                }
                hits = hits.or(result.hits_per_transfer);
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
        if let Some(Hits { probes: hits, uprobes }) = hits {
            let total: f64 = hits.iter().map(|(_, per)| per).sum();
            let each: Vec<String> = hits
                .iter()
                .filter(|(_, per)| *per > 0.0)
                .map(|(symbol, per)| format!("{} {per:.2}", short(symbol)))
                .collect();
            println!(
                "  per transfer: {total:.2} probe hits as the agent's summary counts them ({}); {uprobes:.2} uprobe hits, \
                 with the entry halves that save a return probe's arguments",
                each.join(", ")
            );
        }
    }
    Ok(())
}

/// A C++ function's own name out of its mangled symbol
/// (`_ZNK9nixlAgent11postXferReqEP..` is `postXferReq`); a C name as it is.
fn short(symbol: &str) -> &str {
    let Some(mut rest) = symbol.strip_prefix("_ZNK").or_else(|| symbol.strip_prefix("_ZN")) else { return symbol };
    let mut name = symbol;
    while let Some(digits) = rest.find(|c: char| !c.is_ascii_digit()).filter(|&n| n > 0) {
        let Ok(len) = rest[..digits].parse::<usize>() else { break };
        let Some(part) = rest.get(digits..digits + len) else { break };
        name = part;
        rest = &rest[digits + len..];
    }
    name
}
