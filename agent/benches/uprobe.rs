//! Per-hit cost of stallwatch's uprobes on the demo target, against the
//! same uprobe running an empty BPF program (the floor), in one run.
//!
//! `cargo run --release -p xtask -- bench` runs it (as root). The demo
//! target times N calls of one lifecycle function per request on its stdin;
//! the cost of a hit is (ns per call probed) - (ns per call unprobed).
//! Under `cargo test --all-targets` it runs a smoke version: fewer calls,
//! one round, and it fails unless the emitting probes delivered events.
mod support;

use std::{
    io::{BufRead as _, BufReader, Write as _},
    num::NonZeroU32,
    path::PathBuf,
    process::{Child, ChildStdin, Command, Stdio},
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf,
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeScope},
    },
};
use stallwatch::probes::{
    Profile,
    resolve::{ElfFile, ProcessImage},
};
use support::Attached;

const CALLS: u64 = 200_000;
const ROUNDS: usize = 5;
const SMOKE_CALLS: u64 = 20_000;

struct Demo {
    child: Child,
    rounds: usize,
    stdin: ChildStdin,
    stdout: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Demo {
    fn start(calls: u64, rounds: usize) -> Result<Self> {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let path = root.join(std::env::var("STALLWATCH_DEMO").unwrap_or_else(|_| "target/demo/release/demo-prefill".into()));
        let mut child = Command::new(&path)
            .args(["--wait-for-go", "--bench-calls", &calls.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} (build it with `cargo run --release -p xtask -- build`)", path.display()))?;
        let stdin = child.stdin.take().context("demo stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("demo stdout")?).lines();
        stdout.next().context("demo exited before ready")??;
        let mut demo = Self { child, rounds, stdin, stdout };
        writeln!(demo.stdin, "go")?;
        Ok(demo)
    }

    /// Mean ns per call of `function`, best of `rounds`.
    fn time(&mut self, function: &str) -> Result<f64> {
        let mut best = f64::MAX;
        for _ in 0..self.rounds {
            writeln!(self.stdin, "{function}")?;
            let line = self.stdout.next().context("demo exited mid-bench")??;
            let value: serde_json::Value = serde_json::from_str(&line)?;
            best = best.min(value["ns_per_call"].as_f64().context("ns_per_call")?);
        }
        Ok(best)
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The empty programs of the eBPF object attached at `symbol`'s entry
/// (and return, for a return probe), for the floor measurement.
fn attach_floor(pid: u32, symbol: &str, at_return: bool) -> Result<Ebpf> {
    let image = ProcessImage::read(pid)?;
    let exe = image.find(None)?;
    let resolved = ElfFile::open(&exe.host_path)?.resolve(symbol)?;
    let mut ebpf = Ebpf::load(stallwatch::probes::ebpf_object())?;
    let scope = UProbeScope::OneProcess(NonZeroU32::new(pid).context("pid 0")?);
    let names: &[&str] = if at_return { &["empty_entry", "empty_return"] } else { &["empty_entry"] };
    for name in names {
        let program: &mut UProbe = ebpf.program_mut(name).context("empty program")?.try_into()?;
        program.load()?;
        program.attach(UProbeAttachLocation::AbsoluteOffset(resolved.file_offset), &exe.host_path, scope)?;
    }
    Ok(ebpf)
}

fn main() -> Result<()> {
    support::require_root("the uprobe benchmark")?;
    let demo_profile = Profile::load("demo")?;
    let smoke = support::smoke();
    let (calls, rounds) = if smoke { (SMOKE_CALLS, 1) } else { (CALLS, ROUNDS) };
    let mut demo = Demo::start(calls, rounds)?;
    let pid = demo.child.id();
    let exe = ProcessImage::read(pid)?.find(None)?;
    let elf = ElfFile::open(&exe.host_path)?;
    println!("uprobe per-hit cost on demo-prefill ({calls} calls, best of {rounds}), ns:");
    println!("{:<32} {:>10} {:>10} {:>10} {:>8}", "probe (first instruction)", "unprobed", "floor", "ours", "ratio");
    let cases = [
        ("enqueue", "prefill_enqueue", false, true, "entry: key deref + room string, emits"),
        ("post", "kv_transfer_post", false, true, "entry: key from arg, emits"),
        ("poll", "kv_transfer_poll", true, false, "return: saved args, filtered out"),
    ];
    for (function, symbol, at_return, emits, what) in cases {
        let insn = elf.resolve(symbol)?.first_insn;
        let base = demo.time(function)?;
        let floor = {
            let _floor = attach_floor(pid, symbol, at_return)?;
            demo.time(function)? - base
        };
        let ours = Attached::new(pid, &demo_profile)?;
        let cost = demo.time(function)? - base;
        let events = ours.finish();
        println!(
            "{:<32} {:>10.1} {:>10.1} {:>10.1} {:>7.2}x   {what}; {events} events read",
            format!("{symbol} ({insn})"),
            base,
            floor,
            cost,
            cost / floor
        );
        if smoke && emits && events == 0 {
            bail!("the {symbol} probe was timed but delivered no event: the measurement is not of stallwatch's probe");
        }
    }
    Ok(())
}
