//! What watching the demo target costs it, per probe kind and per request,
//! and what it costs the agent, side by side in one run:
//! 1. per call on `demo-prefill`: unprobed, the eBPF object's empty
//!    programs on the same uprobes (the kernel's floor), Debian's bpftrace
//!    running the equivalent script (`bpftrace/demo.bt`), and the real
//!    agent (`stallwatch run --profile demo`), whose ring buffer is read on
//!    its own tick as in production. Each configuration is attached in turn
//!    within a round, rounds interleaved, the median of the rounds shown;
//! 2. the agent's CPU (all its threads, `/proc/PID/task/*/schedstat`) and
//!    bpftrace's beside it while the demo serves requests at its default
//!    2 000 a second and as fast as it can, with the events the agent read
//!    per second and how many it lost.
//!
//! `cargo run --release -p xtask -- bench` runs it (as root, bpftrace
//! installed). `STALLWATCH_BASELINE_BIN` adds a second agent binary as a
//! column (the build before a change). Without `--bench` (as under
//! `cargo test --all-targets`) it runs a short smoke version, without
//! bpftrace, which fails unless the agent read the demo's requests.
mod support;

use std::{
    io::{BufRead as _, BufReader, Lines, Write as _},
    path::PathBuf,
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use stallwatch::profile::{
    Profile,
    resolve::{ElfFile, ProcessImage},
};
use support::{Agent, Bpftrace, Config, Floor, median};

/// The calls timed per measurement (a whole request is about 7 calls).
const CALLS: u64 = 200_000;
const REQUESTS: u64 = 40_000;
/// Timings per configuration and round; the best is kept.
const REPS: usize = 3;

/// What is timed: the demo's bench command, the function, what it shows.
const FUNCTIONS: [(&str, &str, &str); 4] = [
    ("enqueue", "prefill_enqueue", "entry: key deref + room string, emits"),
    ("post", "kv_transfer_post", "entry: key from an argument, quiet"),
    ("poll", "kv_transfer_poll", "return, saved argument, filtered out"),
    ("request", "(a request)", "enqueue, post, 4 polls (1 done), release"),
];

/// The demo target, paths from `STALLWATCH_DEMO`.
fn demo_path() -> PathBuf {
    support::root().join(std::env::var("STALLWATCH_DEMO").unwrap_or_else(|_| "target/demo/release/demo-prefill".into()))
}

struct Demo {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Demo {
    fn start(args: &[&str]) -> Result<Self> {
        let path = demo_path();
        let mut child = Command::new(&path)
            .arg("--wait-for-go")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| {
                format!("starting {} (build it with `cargo run --release -p xtask -- build`)", path.display())
            })?;
        let stdin = child.stdin.take().context("demo stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("demo stdout")?).lines();
        stdout.next().context("demo exited before ready")??;
        Ok(Self { child, stdin, stdout })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn next_json(&mut self) -> Result<serde_json::Value> {
        let line = self.stdout.next().context("demo exited mid-bench")??;
        serde_json::from_str(&line).with_context(|| format!("demo said {line:?}"))
    }

    /// Mean ns per call of a bench command, best of REPS.
    fn time(&mut self, function: &str, calls: u64) -> Result<f64> {
        let mut best = f64::MAX;
        for _ in 0..REPS {
            writeln!(self.stdin, "{function} {calls}")?;
            let value = self.next_json()?;
            best = best.min(value["ns_per_call"].as_f64().with_context(|| format!("ns_per_call in {value}"))?);
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

/// A configuration attached to a process.
enum Watching {
    Off,
    Empty(Floor),
    Bpftrace(Bpftrace),
    Agent(Agent),
}

impl Watching {
    fn start(config: &Config, pid: u32, profile: &Profile) -> Result<Self> {
        Ok(match config {
            Config::Off => Self::Off,
            Config::Empty => Self::Empty(Floor::attach(pid, profile)?),
            Config::Bpftrace => Self::Bpftrace(Bpftrace::start("demo.bt", pid, &[("DEMO", &demo_path())])?),
            Config::Agent(bin) => Self::Agent(Agent::start(bin, pid, "demo")?),
        })
    }

    fn pid(&self) -> Option<u32> {
        match self {
            Self::Bpftrace(bpftrace) => Some(bpftrace.pid()),
            Self::Agent(agent) => Some(agent.pid()),
            Self::Off | Self::Empty(_) => None,
        }
    }

    /// Stop; (events delivered, events lost) where it says.
    fn stop(self) -> Result<Option<(u64, u64)>> {
        Ok(match self {
            Self::Off => None,
            Self::Empty(floor) => {
                drop(floor);
                None
            }
            Self::Bpftrace(bpftrace) => Some(bpftrace.stop()?),
            // An agent's summary counts requests: 4 events each when healthy.
            Self::Agent(agent) => agent.stop().map(|summary| Some((summary.seen, summary.lost_events)))?,
        })
    }
}

fn main() -> Result<()> {
    support::require_root("the uprobe benchmark")?;
    let full = !support::smoke();
    let columns = support::columns(full)?;
    let rounds = if full { 3 } else { 1 };
    let scale = if full { 1 } else { 20 };
    per_call(&columns, rounds, scale)?;
    agent_cpu(&columns, full)
}

/// Table 1: ns per call above unprobed, per configuration.
fn per_call(columns: &[(&str, Config)], rounds: usize, scale: u64) -> Result<()> {
    let profile = Profile::load("demo")?;
    let mut demo = Demo::start(&["--bench-calls", &CALLS.to_string()])?;
    writeln!(demo.stdin, "go")?;
    let pid = demo.pid();
    let exe = ProcessImage::read(pid)?.find(None)?;
    let elf = ElfFile::open(&exe.host_path)?;
    // ns per call, [column][function][round]
    let mut ns = vec![vec![Vec::new(); FUNCTIONS.len()]; columns.len()];
    for _ in 0..rounds {
        for (c, (_, config)) in columns.iter().enumerate() {
            let watching = Watching::start(config, pid, &profile)?;
            for (f, (function, _, _)) in FUNCTIONS.iter().enumerate() {
                let calls = if *function == "request" { REQUESTS } else { CALLS } / scale;
                ns[c][f].push(demo.time(function, calls)?);
            }
            let delivered = watching.stop()?;
            if let (Some((0, _)), Config::Agent(bin)) = (delivered, config) {
                bail!("{} was attached but saw no request of the demo", bin.display());
            }
        }
    }
    let smoke = if rounds == 1 { " [smoke run: too short for meaningful figures]" } else { "" };
    println!(
        "demo-prefill, ns per call above unprobed (median of {rounds} interleaved rounds, each the best of {REPS} x {} calls){smoke}:",
        CALLS / scale
    );
    let names: Vec<&str> = columns.iter().map(|(name, _)| *name).collect();
    print!("{:<34} {:>9}", "function (first instruction)", "unprobed");
    for name in &names[1..] {
        print!(" {name:>10}");
    }
    for name in &names[2..] {
        print!(" {:>14}", format!("{name}/empty"));
    }
    if let (Some(sw), Some(bt)) =
        (names.iter().position(|n| *n == "stallwatch"), names.iter().position(|n| *n == "bpftrace"))
    {
        print!(" {:>14}", format!("{}/{}", names[sw], names[bt]));
    }
    if names.contains(&"baseline") {
        print!(" {:>14}", "stallwatch/baseline");
    }
    println!();
    for (f, (_, symbol, what)) in FUNCTIONS.iter().enumerate() {
        let off = median(&ns[0][f]);
        let above: Vec<f64> = (1..columns.len()).map(|c| median(&ns[c][f]) - off).collect();
        let label = match elf.resolve(symbol) {
            Ok(resolved) => format!("{symbol} ({})", resolved.first_insn),
            Err(_) => (*symbol).to_owned(),
        };
        print!("{label:<34} {off:>9.1}");
        for value in &above {
            print!(" {value:>10.1}");
        }
        for value in &above[1..] {
            print!(" {:>13.2}x", value / above[0]);
        }
        let at = |name: &str| names.iter().position(|n| *n == name).map(|c| above[c - 1]);
        if let (Some(sw), Some(bt)) = (at("stallwatch"), at("bpftrace")) {
            print!(" {:>13.2}x", sw / bt);
        }
        if let (Some(sw), Some(base)) = (at("stallwatch"), at("baseline")) {
            print!(" {:>13.2}x", sw / base);
        }
        println!("   {what}");
    }
    Ok(())
}

/// Table 2: the watcher's own CPU while the demo serves requests.
fn agent_cpu(columns: &[(&str, Config)], full: bool) -> Result<()> {
    let seconds = if full { 10 } else { 1 };
    let profile = Profile::load("demo")?;
    println!();
    println!("watcher CPU while demo-prefill serves requests for {seconds} s (1 request = 4 events):");
    println!(
        "{:<12} {:<11} {:>10} {:>12} {:>14} {:>14} {:>12}",
        "rate", "watcher", "req/s", "% of a core", "us CPU / req", "events/s read", "events lost"
    );
    // `--rate` far above what one core can do: as fast as it goes.
    for (label, rate) in [("default", 2000), ("highest", 10_000_000)] {
        for (name, config) in columns.iter().filter(|(_, config)| matches!(config, Config::Bpftrace | Config::Agent(_)))
        {
            let mut demo = Demo::start(&["--rate", &rate.to_string(), "--duration", &format!("{seconds}s")])?;
            let watching = Watching::start(config, demo.pid(), &profile)?;
            let watcher = watching.pid().context("a watcher has a pid")?;
            let cpu_before = support::cpu_ns(watcher)?;
            let started = Instant::now();
            writeln!(demo.stdin, "go")?;
            // CPU over most of the run, read while both still run (a
            // `--pid` agent stops by itself when the demo exits).
            thread::sleep(Duration::from_secs_f64(seconds as f64 * 0.9));
            let cpu = (support::cpu_ns(watcher)? - cpu_before) as f64 / 1e9;
            let window = started.elapsed().as_secs_f64();
            let done = loop {
                let value = demo.next_json()?;
                if value["event"] == "done" {
                    break value;
                }
            };
            let wall = started.elapsed().as_secs_f64();
            let requests = done["healthy"].as_u64().context("healthy in done")? as f64;
            let (delivered, lost) = watching.stop()?.unwrap_or_default();
            if requests > 0.0 && delivered == 0 {
                bail!("{name} was attached but saw none of the demo's {requests} requests");
            }
            // bpftrace prints a line per event; the agent counts requests.
            let events = if matches!(config, Config::Agent(_)) { delivered * 4 } else { delivered };
            println!(
                "{:<12} {name:<11} {:>10.0} {:>11.2}% {:>14.2} {:>14.0} {:>12}",
                format!("{label} {}", if rate > 1_000_000 { "max".to_owned() } else { rate.to_string() }),
                requests / wall,
                100.0 * cpu / window,
                1e6 * cpu / (requests * window / wall),
                events as f64 / wall,
                lost
            );
        }
    }
    Ok(())
}
