//! What the `sglang` profile's ZMQ signals cost SGLang's bootstrap traffic,
//! side by side in one run: tests/sglang/zmq_rate.py sends and receives,
//! per round, one room's destination (11 frames) and its KV_STATUS
//! (5 frames) as SGLang's prefill does, with the process
//! - not watched (off);
//! - watched by `stallwatch run --profile nixl` (its NIXL probes, none on
//!   libzmq: the same agent without the room tracking);
//! - watched by `stallwatch run --profile sglang` (the `nixl` probes plus
//!   the signals on `zmq_msg_recv`, `zmq_msg_data` and `zmq_msg_send`,
//!   frames put together and rooms followed in the agent).
//!
//! Configurations alternate run by run; the median of the runs is shown,
//! as microseconds per round and the cost the signals add per frame.
//! `cargo run --release -p xtask -- bench` runs it (as root, with the
//! venv). Without `--bench` it runs a short smoke version, which fails
//! unless the `sglang` agent followed every room.
mod support;

use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};
use support::{Agent, median};

/// Frames per round: 11 received and 11 sent (the destination), 5 and 5
/// (the status).
const FRAMES_PER_ROUND: f64 = 32.0;

/// One run under `profile` (`None`: off): microseconds per round.
fn run(rounds: u64, profile: Option<&str>) -> Result<f64> {
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
    let agent = profile.map(|profile| Agent::start(&support::agent_bin(), pid, profile)).transpose()?;
    writeln!(stdin, "go")?;
    let done: serde_json::Value = serde_json::from_str(&lines.next().context("driver exited before done")??)?;
    drop(stdin);
    let _ = child.wait();
    if let (Some(agent), Some(profile)) = (agent, profile) {
        let summary = agent.stop()?;
        if summary.lost_events > 0 {
            eprintln!("zmq bench: the agent lost {} events", summary.lost_events);
        }
        if profile == "sglang" && summary.completed < rounds {
            bail!("the sglang agent followed {} of the {rounds} rooms to their end", summary.completed);
        }
    }
    done["us_per_round"].as_f64().context("us_per_round")
}

fn main() -> Result<()> {
    support::require_root("the ZMQ benchmark")?;
    let full = !support::smoke();
    if !support::venv_python().exists() {
        bail!("no venv at {}: run `cargo run --release -p xtask -- setup --python`", support::venv_python().display());
    }
    let (runs, rounds) = if full { (5, 20_000) } else { (1, 500) };
    let smoke = if full { "" } else { " [smoke run: too short for meaningful figures]" };
    let columns: [(&str, Option<&str>); 3] = [("off", None), ("nixl", Some("nixl")), ("sglang", Some("sglang"))];
    let mut us = vec![Vec::new(); columns.len()];
    for _ in 0..runs {
        for (n, (_, profile)) in columns.iter().enumerate() {
            us[n].push(run(rounds, *profile)?);
        }
    }
    let [off, nixl, sglang] = [0, 1, 2].map(|n| median(&us[n]));
    println!(
        "SGLang bootstrap messages, {rounds} rounds of a destination (11 frames) and a KV_STATUS (5), each sent and received, median of {runs} interleaved runs (tests/sglang/zmq_rate.py){smoke}:"
    );
    println!("{:<10} {:>10} {:>8}", "watched", "us/round", "/off");
    for (name, value) in [("off", off), ("nixl", nixl), ("sglang", sglang)] {
        println!("{name:<10} {value:>10.1} {:>7.2}x", value / off);
    }
    println!(
        "the ZMQ signals (sglang - nixl): {:.1} us a round, {:.2} us a frame sent or received",
        sglang - nixl,
        (sglang - nixl) / FRAMES_PER_ROUND
    );
    Ok(())
}
