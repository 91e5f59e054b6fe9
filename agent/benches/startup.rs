//! Start-up: how long the real agent takes from its start to watching the
//! demo target, side by side in one run, interleaved round by round:
//! - `cold`: a bpf directory with nothing in it, so the kernel verifies the
//!   lifecycle programs (nearly all of a cold start);
//! - `restart`: the next agent on the same directory, which takes over the
//!   programs and probes the previous one left pinned (a DaemonSet's
//!   rolling update, a crash), with no verifier pass.
//!
//! A restart inside a stall's timeout makes the stall that much later, so
//! the `restart` column is the one the goal (0.3 s) is about.
//!
//! `cargo bench -p stallwatch --bench startup` (as root) with
//! `STALLWATCH_DEMO` set, or `cargo run --release -p xtask -- bench`. Under
//! `cargo test --all-targets` one round runs, and fails unless the cold
//! agent verified the programs and the restarted one took them over.
mod support;

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// What the agent logs when it verified the programs, and when it took a
/// previous agent's over (kernel/programs.rs).
const VERIFIED: &str = "eBPF programs verified and loaded";
const TAKEN_OVER: &str = "eBPF programs taken over";

fn main() -> Result<()> {
    support::require_root("the start-up benchmark")?;
    let rounds = if support::smoke() { 1 } else { 7 };
    let root = support::root();
    let demo =
        root.join(std::env::var("STALLWATCH_DEMO").unwrap_or_else(|_| "target/demo/release/demo-prefill".into()));
    let bin = support::agent_bin();
    let bpf_dir = PathBuf::from("/sys/fs/bpf").join(format!("stallwatch-bench-startup-{}", std::process::id()));
    let mut target = Command::new(&demo)
        .args(["--rate", "200", "--duration", "10min"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| {
            format!("starting {} (build it with `cargo run --release -p xtask -- build`)", demo.display())
        })?;
    let result = rounds_of(&bin, target.id(), &bpf_dir, rounds);
    let _ = target.kill();
    let _ = target.wait();
    let _ = clear(&bin, &bpf_dir);
    let _ = std::fs::remove_dir_all(bpf_dir_socket(&bpf_dir).parent().unwrap_or(Path::new("/nonexistent")));
    let (cold, restart) = result?;
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let column = |name: &str, values: &[Duration]| {
        let figures: Vec<f64> = values.iter().map(ms).collect();
        let max = figures.iter().copied().fold(0.0, f64::max);
        println!(
            "{name:<8} median {:>7.1} ms  max {max:>7.1} ms  ({} rounds)",
            support::median(&figures),
            values.len()
        );
        support::median(&figures)
    };
    println!("start to watching the demo target (one agent at a time, interleaved):");
    let (cold, restart) = (column("cold", &cold), column("restart", &restart));
    println!("restart / cold: {:.3}", restart / cold);
    Ok(())
}

/// `rounds` cold starts, each followed by a restart on its directory.
fn rounds_of(bin: &Path, pid: u32, bpf_dir: &Path, rounds: usize) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let (mut cold, mut restart) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        clear(bin, bpf_dir)?;
        let (took, log) = start_and_stop(bin, pid, bpf_dir)?;
        if !log.contains(VERIFIED) {
            bail!("a cold agent did not verify the programs itself; its log:\n{log}");
        }
        cold.push(took);
        let (took, log) = start_and_stop(bin, pid, bpf_dir)?;
        if !log.contains(TAKEN_OVER) {
            bail!("a restarted agent did not take the pinned programs over; its log:\n{log}");
        }
        restart.push(took);
    }
    Ok((cold, restart))
}

/// Start an agent on `bpf_dir`, time it to its `watching` line, stop it
/// with SIGTERM (leaving its probes pinned for the next); its log.
fn start_and_stop(bin: &Path, pid: u32, bpf_dir: &Path) -> Result<(Duration, String)> {
    let started = Instant::now();
    let mut child = Command::new(bin)
        .args(["run", "--pid", &pid.to_string(), "--profile", "demo", "--timeout", "10min", "--output", "json"])
        .arg("--bpf-dir")
        .arg(bpf_dir)
        .arg("--socket")
        .arg(bpf_dir_socket(bpf_dir))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut stderr = BufReader::new(child.stderr.take().context("agent stderr")?);
    let mut log = String::new();
    let took = loop {
        let mut line = String::new();
        if stderr.read_line(&mut line)? == 0 {
            let status = child.wait()?;
            bail!("the agent ({status}) exited before watching pid {pid}:\n{log}");
        }
        log.push_str(&line);
        if line.contains("watching") {
            break started.elapsed();
        }
    };
    stop(&mut child)?;
    let rest = thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(stderr.get_mut(), &mut rest);
        rest
    });
    let status = child.wait()?;
    log.push_str(&rest.join().unwrap_or_default());
    if !status.success() {
        bail!("the agent ended with {status}:\n{log}");
    }
    Ok((took, log))
}

/// The agent's query socket: in a directory of the bench's own (the agent
/// refuses one that other users can reach), named for the bpf directory.
fn bpf_dir_socket(bpf_dir: &Path) -> PathBuf {
    let name = bpf_dir.file_name().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default();
    std::env::temp_dir().join(name).join("agent.sock")
}

fn stop(child: &mut Child) -> Result<()> {
    // SAFETY: signalling our own child, which we have not reaped yet.
    if unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) } != 0 {
        return Err(std::io::Error::last_os_error()).context("stopping the agent");
    }
    Ok(())
}

/// `stallwatch state clear --bpf-dir DIR`: nothing pinned left.
fn clear(bin: &Path, bpf_dir: &Path) -> Result<()> {
    let status = Command::new(bin)
        .args(["state", "clear", "--bpf-dir"])
        .arg(bpf_dir)
        .stdout(Stdio::null())
        .status()
        .context("running `stallwatch state clear`")?;
    if !status.success() {
        bail!("`stallwatch state clear --bpf-dir {}` failed ({status})", bpf_dir.display());
    }
    Ok(())
}
