//! `stallwatch inflight` end to end with 100 000 requests in flight: the
//! real agent attached to the real demo target holding 100 000 requests
//! pinned (enqueued, never posted, so all stalled), timed from starting
//! the `stallwatch inflight` process to its exit with the whole answer read.
//! Then the agent is SIGKILLed and a second one started on its bpf
//! directory: how long it takes to take the 100 000 over, and how many
//! stalls it reports again (none should be).
//!
//! `cargo run --release -p xtask -- bench` runs it (as root); alone:
//! `cargo bench -p stallwatch --bench inflight` with `STALLWATCH_DEMO` set
//! (the agent is this build's `stallwatch`, or `STALLWATCH_BIN`). Under
//! `cargo test --all-targets` it runs a smoke version: 2 000 pinned, 2
//! queries of each kind, and it fails unless the take-over kept every
//! pinned request and reported none of their stalls again.
mod support;

use std::{
    io::{BufRead as _, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

const PINNED: u64 = 100_000;
const RUNS: usize = 20;
const SMOKE_PINNED: u64 = 2_000;
const SMOKE_RUNS: usize = 2;

fn main() -> Result<()> {
    support::require_root("the inflight benchmark")?;
    let smoke = support::smoke();
    let (pinned, runs) = if smoke { (SMOKE_PINNED, SMOKE_RUNS) } else { (PINNED, RUNS) };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let demo_path =
        root.join(std::env::var("STALLWATCH_DEMO").unwrap_or_else(|_| "target/demo/release/demo-prefill".into()));
    let agent_path = std::env::var_os("STALLWATCH_BIN")
        .map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_stallwatch")), PathBuf::from);
    let dir = std::env::temp_dir().join(format!("stallwatch-bench-inflight-{}", std::process::id()));
    let socket = dir.join("agent.sock");
    let bpf_dir = PathBuf::from(format!("/sys/fs/bpf/stallwatch-bench-inflight-{}", std::process::id()));
    let _cleanup = Removed(bpf_dir.clone());

    // The demo, narrating one `injected` line per pinned request.
    let mut demo = Killed(
        Command::new(&demo_path)
            .args(["--wait-for-go", "--rate", "100", "--duration", "900s", "--inject-after", "0ms"])
            .args(["--waiting-for-peer", &pinned.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| {
                format!("starting {} (build it with `cargo run --release -p xtask -- build`)", demo_path.display())
            })?,
    );
    let mut demo_out = BufReader::new(demo.0.stdout.take().context("demo stdout")?).lines();
    let ready: serde_json::Value = serde_json::from_str(&demo_out.next().context("demo exited before ready")??)?;
    let pid = ready["pid"].as_u64().context("ready line without pid")?.to_string();
    let injected = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&injected);
    thread::spawn(move || {
        for line in demo_out.map_while(Result::ok) {
            if line.contains("\"injected\"") {
                counted.fetch_add(1, Ordering::Relaxed);
            }
        }
    });

    // The agent: stalls after 2 s; its 100 000 alert lines are counted, its
    // query timings (debug) are kept from stderr.
    let (agent, stderr, _) = start_agent(&agent_path, &pid, &socket, &bpf_dir)?;
    wait_for("the agent attached", Duration::from_secs(60), || {
        Ok(stderr.lock().is_ok_and(|lines| lines.iter().any(|l| l.contains("watching"))))
    })?;
    {
        use std::io::Write as _;
        let mut stdin = demo.0.stdin.take().context("demo stdin")?;
        writeln!(stdin, "go")?;
    }
    let started = Instant::now();
    wait_for("the demo to pin every request", Duration::from_secs(120), || {
        Ok(injected.load(Ordering::Relaxed) >= pinned)
    })?;
    let pinned_in = started.elapsed();
    // Until the agent holds all of them, every one stalled (its alerts out).
    wait_for("the agent to hold every pinned request, stalled", Duration::from_secs(120), || {
        let (out, _) = query(&agent_path, &socket, true)?;
        let answer: serde_json::Value = serde_json::from_slice(&out)?;
        let stalled =
            answer["requests"].as_array().map_or(0, |rows| rows.iter().filter(|r| !r["class"].is_null()).count());
        Ok(stalled as u64 >= pinned)
    })?;
    let logged_before = stderr.lock().map_or(0, |lines| lines.len());

    let mut json = Vec::with_capacity(runs);
    let mut bytes = 0;
    let mut rows = 0;
    for _ in 0..runs {
        let (out, took) = query(&agent_path, &socket, true)?;
        bytes = out.len();
        rows = serde_json::from_slice::<serde_json::Value>(&out)?["requests"].as_array().map_or(0, Vec::len);
        json.push(took);
    }
    let mut table = Vec::with_capacity(runs);
    let mut table_bytes = 0;
    for _ in 0..runs {
        let (out, took) = query(&agent_path, &socket, false)?;
        table_bytes = out.len();
        table.push(took);
    }

    // What the agent logged for the timed queries: time on the event loop
    // (the snapshot) and off it (sort + encode on a blocking thread).
    let logged: Vec<String> = stderr.lock().map(|lines| lines[logged_before..].to_vec()).unwrap_or_default();
    let ms = |us: Vec<f64>| us.into_iter().map(|us| us / 1e3).collect::<Vec<_>>();
    let mut on_loop = ms(fields(&logged, "loop_us"));
    let mut encode = ms(fields(&logged, "encode_us"));

    // A crash, then the next agent on the same bpf directory.
    drop(agent);
    let restarted = Instant::now();
    let (second, second_err, stalled_alerts) = start_agent(&agent_path, &pid, &socket, &bpf_dir)?;
    wait_for("the second agent to take over", Duration::from_secs(120), || {
        Ok(second_err.lock().is_ok_and(|lines| lines.iter().any(|l| l.contains("took over the requests in flight"))))
    })?;
    let took_over = restarted.elapsed();
    let taken = fields(&second_err.lock().map(|lines| lines.clone()).unwrap_or_default(), "requests")
        .first()
        .copied()
        .unwrap_or(0.0);
    let (out, _) = query(&agent_path, &socket, true)?;
    let answer: serde_json::Value = serde_json::from_slice(&out)?;
    let still_stalled =
        answer["requests"].as_array().map_or(0, |rows| rows.iter().filter(|r| !r["class"].is_null()).count());
    // Time for a repeated alert to show, had there been one.
    thread::sleep(Duration::from_secs(3));
    let realerted = stalled_alerts.load(Ordering::Relaxed);
    drop(second);
    let _ = std::fs::remove_dir_all(&dir);
    if (rows as u64) < pinned {
        bail!("expected at least {pinned} requests in flight, the agent answered {rows}");
    }

    println!(
        "stallwatch inflight, {rows} requests in flight ({pinned} pinned + healthy ones caught mid-flight; demo pinned them in {pinned_in:.2?})"
    );
    println!("  `stallwatch inflight --json`, {runs} runs end to end (process start to exit, answer read whole):");
    println!(
        "    median {:>8.1} ms   p90 {:>8.1} ms   min {:>8.1} ms   max {:>8.1} ms",
        q(&mut json, 0.5),
        q(&mut json, 0.9),
        q(&mut json, 0.0),
        q(&mut json, 1.0)
    );
    println!(
        "    response {:.1} MB ({bytes} bytes, {:.0} bytes a request)",
        bytes as f64 / 1e6,
        bytes as f64 / rows.max(1) as f64
    );
    println!("  `stallwatch inflight` (table), {runs} runs:");
    println!(
        "    median {:>8.1} ms   p90 {:>8.1} ms   output {:.1} MB",
        q(&mut table, 0.5),
        q(&mut table, 0.9),
        table_bytes as f64 / 1e6
    );
    println!(
        "  restart: a second agent, after a SIGKILL, took over {taken:.0} requests in {:.0} ms (start to ready); \
         {still_stalled} still shown stalled, {realerted} stalls reported again",
        took_over.as_secs_f64() * 1e3
    );
    if !on_loop.is_empty() {
        println!(
            "  agent side, per query: snapshot on the event loop median {:.1} ms (max {:.1} ms); sort + encode off the loop median {:.1} ms",
            q(&mut on_loop, 0.5),
            q(&mut on_loop, 1.0),
            q(&mut encode, 0.5)
        );
    }
    if smoke && ((taken as u64) < pinned || realerted > 0) {
        bail!(
            "the take-over kept {taken:.0} of {pinned} pinned requests and reported {realerted} stalls again (expected all, none)"
        );
    }
    Ok(())
}

/// An agent's stderr, a line each, as it is written.
type Lines = Arc<Mutex<Vec<String>>>;

/// `stallwatch run` on the demo with `bpf_dir`: the child, its stderr
/// lines, and a count of the stall alerts on its stdout.
fn start_agent(
    agent: &PathBuf,
    pid: &str,
    socket: &PathBuf,
    bpf_dir: &PathBuf,
) -> Result<(Killed, Lines, Arc<AtomicU64>)> {
    let mut child = Killed(
        Command::new(agent)
            .args(["run", "--pid", pid, "--profile", "demo", "--timeout", "2s", "--output", "json", "--socket"])
            .arg(socket)
            .arg("--bpf-dir")
            .arg(bpf_dir)
            .env("STALLWATCH_LOG", "info,stallwatch::query=debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", agent.display()))?,
    );
    let stderr = Arc::new(Mutex::new(Vec::<String>::new()));
    let kept = Arc::clone(&stderr);
    let err = BufReader::new(child.0.stderr.take().context("agent stderr")?);
    thread::spawn(move || {
        for line in err.lines().map_while(Result::ok) {
            if let Ok(mut lines) = kept.lock() {
                lines.push(line);
            }
        }
    });
    let stalled = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&stalled);
    let out = BufReader::new(child.0.stdout.take().context("agent stdout")?);
    thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            if line.contains("\"alert\":\"stalled\"") {
                counted.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    Ok((child, stderr, stalled))
}

/// Removes the bench's bpf directory (its pinned probes) at the end.
struct Removed(PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Kill the child when dropped (the benchmark may bail half-way).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One `stallwatch inflight` run: its stdout and how long it took (ms).
fn query(agent: &PathBuf, socket: &PathBuf, json: bool) -> Result<(Vec<u8>, f64)> {
    let mut command = Command::new(agent);
    command.arg("inflight").arg("--socket").arg(socket);
    if json {
        command.arg("--json");
    }
    let started = Instant::now();
    let out = command.output().context("running stallwatch inflight")?;
    let took = started.elapsed().as_secs_f64() * 1e3;
    if !out.status.success() {
        bail!("stallwatch inflight failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((out.stdout, took))
}

fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if done()? {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(200));
    }
    bail!("timed out after {within:?} waiting for {what}")
}

/// The values of `name=N` in the agent's log lines.
fn fields(lines: &[String], name: &str) -> Vec<f64> {
    let needle = format!("{name}=");
    lines
        .iter()
        .filter_map(|line| {
            let at = line.find(&needle)? + needle.len();
            let digits: String = line[at..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<f64>().ok()
        })
        .collect()
}

/// The q-quantile (nearest rank) of `values`.
fn q(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let i = ((values.len() - 1) as f64 * q).round() as usize;
    values[i.min(values.len() - 1)]
}
