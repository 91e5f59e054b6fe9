//! What the `sglang` profile's ZMQ signals cost SGLang's bootstrap traffic,
//! side by side in one run: tests/sglang/zmq_rate.py sends and receives,
//! per round, one room's destination (11 frames) and its KV_STATUS
//! (5 frames) as SGLang's prefill does, with the process
//! - not watched (off);
//! - with the eBPF object's empty programs where the `sglang` profile
//!   attaches (empty): the kernel's own uprobe cost, the floor for any
//!   watcher of these functions;
//! - watched by `stallwatch run --profile nixl` (its NIXL probes, none on
//!   libzmq: the same agent without the room tracking);
//! - watched by `stallwatch run --profile sglang` (the `nixl` probes plus
//!   the signals on `zmq_msg_close` and `zmq_msg_send`, frames put
//!   together and rooms followed in the agent).
//!
//! Two more columns measure a change against the build before it, in the
//! same run: `STALLWATCH_BASELINE_BIN` (that build's agent, with its own
//! built-in `sglang`) and `STALLWATCH_BASELINE_PROFILE` (that build's
//! `sglang.toml`: empty programs where it attached).
//!
//! Configurations alternate run by run; the median of the runs is shown,
//! wall-clock and as the CPU time of the thread that sends and receives
//! (uprobe traps are handled on the thread that hits them; other load on
//! a shared host changes it far less than the wall-clock),
//! as microseconds per round and the cost the signals add per frame.
//! `cargo run --release -p xtask -- bench` runs it (as root, with the
//! venv). Without `--bench` it runs a short smoke version, which fails
//! unless the `sglang` agent followed every room.
mod support;

use std::{
    io::{BufRead as _, BufReader, Write as _},
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};
use stallwatch::profile::Profile;
use support::{Agent, Floor, median};

/// Who watches the driver in one column.
enum Watch<'a> {
    Off,
    /// Empty programs where this profile's probes go.
    Empty(&'a Profile),
    /// The agent with this profile.
    Agent(&'a str),
    /// Another agent binary (`STALLWATCH_BASELINE_BIN`) with its `sglang`.
    Baseline(PathBuf),
}

/// Frames per round: 11 received and 11 sent (the destination), 5 and 5
/// (the status).
const FRAMES_PER_ROUND: f64 = 32.0;

/// One run watched so: microseconds per round, wall-clock and the
/// driver thread's CPU time.
fn run(rounds: u64, watch: &Watch<'_>) -> Result<(f64, f64)> {
    let python = support::venv_python();
    let mut child = Command::new(&python)
        .arg(support::root().join("tests/sglang/zmq_rate.py"))
        .args(["--rounds", &rounds.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| {
            format!(
                "starting the ZMQ driver with {} (run `cargo run --release -p xtask -- setup --python`)",
                python.display()
            )
        })?;
    let mut stdin = child.stdin.take().context("driver stdin")?;
    let mut lines = BufReader::new(child.stdout.take().context("driver stdout")?).lines();
    let ready: serde_json::Value = serde_json::from_str(&lines.next().context("driver exited before ready")??)?;
    let pid = ready["pid"].as_u64().context("pid")? as u32;
    let (agent, floor) = match watch {
        Watch::Off => (None, None),
        Watch::Empty(profile) => (None, Some(Floor::attach(pid, profile)?)),
        Watch::Agent(profile) => (Some((Agent::start(&support::agent_bin(), pid, profile)?, *profile)), None),
        Watch::Baseline(bin) => (Some((Agent::start(bin, pid, "sglang")?, "sglang")), None),
    };
    writeln!(stdin, "go")?;
    let done: serde_json::Value = serde_json::from_str(&lines.next().context("driver exited before done")??)?;
    drop(stdin);
    let _ = child.wait();
    drop(floor);
    if let Some((agent, profile)) = agent {
        let summary = agent.stop()?;
        let name = match watch {
            Watch::Baseline(_) => "sglang@base",
            _ => profile,
        };
        if summary.lost_events > 0 {
            eprintln!("zmq bench: the {name} agent lost {} events", summary.lost_events);
        }
        if profile == "sglang" && summary.completed < rounds {
            // A smoke run checks the rooms are followed; a full run on a
            // loaded host may starve the agent (its lost events are said
            // above), which its figures survive.
            let followed =
                format!("the {name} agent followed {} of the {rounds} rooms to their end", summary.completed);
            if support::smoke() {
                bail!(followed);
            }
            eprintln!("zmq bench: {followed}");
        }
    }
    Ok((
        done["us_per_round"].as_f64().context("us_per_round")?,
        done["cpu_us_per_round"].as_f64().context("cpu_us_per_round")?,
    ))
}

fn main() -> Result<()> {
    support::require_root("the ZMQ benchmark")?;
    let full = !support::smoke();
    if !support::venv_python().exists() {
        bail!("no venv at {}: run `cargo run --release -p xtask -- setup --python`", support::venv_python().display());
    }
    let (runs, rounds) = if full { (5, 20_000) } else { (1, 500) };
    let smoke = if full { "" } else { " [smoke run: too short for meaningful figures]" };
    let profile = Profile::load("sglang")?;
    let base_profile = std::env::var("STALLWATCH_BASELINE_PROFILE")
        .ok()
        .map(|path| Profile::load(&path).with_context(|| format!("STALLWATCH_BASELINE_PROFILE={path}")))
        .transpose()?;
    let mut columns = vec![
        ("off", Watch::Off),
        ("empty", Watch::Empty(&profile)),
        ("nixl", Watch::Agent("nixl")),
        ("sglang", Watch::Agent("sglang")),
    ];
    if let Some(base_profile) = &base_profile {
        columns.push(("empty@base", Watch::Empty(base_profile)));
    }
    if let Some(bin) = support::baseline_bin() {
        columns.push(("sglang@base", Watch::Baseline(bin)));
    }
    let mut wall = vec![Vec::new(); columns.len()];
    let mut cpu = vec![Vec::new(); columns.len()];
    for _ in 0..runs {
        for (n, (_, watch)) in columns.iter().enumerate() {
            let (w, c) = run(rounds, watch)?;
            wall[n].push(w);
            cpu[n].push(c);
        }
    }
    println!(
        "SGLang bootstrap messages, {rounds} rounds of a destination (11 frames) and a KV_STATUS (5), each sent and received, median of {runs} interleaved runs (tests/sglang/zmq_rate.py){smoke}:"
    );
    for (what, runs) in [("wall-clock", &wall), ("CPU time of the thread that sends and receives", &cpu)] {
        let medians: Vec<f64> = runs.iter().map(|runs| median(runs)).collect();
        let [off, empty, nixl, sglang] = [0, 1, 2, 3].map(|n| medians[n]);
        println!("{what}:");
        println!("{:<11} {:>10} {:>8} {:>9}", "watched", "us/round", "/off", "/empty");
        for ((name, _), value) in columns.iter().zip(&medians) {
            println!("{name:<11} {value:>10.1} {:>7.2}x {:>8.2}x", value / off, value / empty);
        }
        println!(
            "the ZMQ signals (sglang - nixl): {:.1} us a round, {:.2} us a frame sent or received; \
             the kernel's floor for the sglang profile's probes (empty - off): {:.2} us a frame",
            sglang - nixl,
            (sglang - nixl) / FRAMES_PER_ROUND,
            (empty - off) / FRAMES_PER_ROUND
        );
    }
    Ok(())
}
