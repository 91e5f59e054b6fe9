//! What following SGLang's scheduler requests costs the scheduler thread,
//! side by side in one run: tests/sglang/real/recv_cost.py sends
//! `TokenizedGenerateReqInput`s (SGLang 0.5.23's own class and `sock_send`)
//! to a PULL socket whose thread receives them with SGLang's `sock_recv`,
//! and times those calls, with the process
//! - not watched (off);
//! - with the eBPF object's empty programs where the `sglang` profile
//!   attaches (empty): the kernel's uprobe cost on the same frames;
//! - watched by `stallwatch run --profile sglang` (the request read from
//!   the frame in the kernel: the pickle walk, or msgpack's fixed reads).
//!
//! Three workloads: pickle IPC (SGLang's default) with 100 and 4 000 prompt
//! tokens (the walk is bounded: it must not grow with the prompt), and
//! msgpack IPC with 100. Configurations alternate run by run; medians of
//! the time per request received are shown with their ratio to off.
//! `cargo run --release -p xtask -- bench` runs it (as root, with the
//! SGLang venv). Without `--bench` a smoke version runs.
//!
//! Every watched run asks the agent which requests it follows (`stallwatch
//! inflight`, before the target exits: request n's room is 2^62 + n) and
//! fails, after the table, unless it followed every request it was sent,
//! naming the ones it missed. A last check, in the smoke version too, lays
//! msgpack requests out so that each frame ends 0 to 39 bytes before a page
//! never touched (`recv_cost.py --place page-end`: where libzmq's receive
//! buffer now and then puts one, which is how the full run's msgpack rounds
//! used to miss 1 to 3 requests of 3 000) and fails unless the agent
//! followed every one.
mod support;

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use stallwatch::profile::Profile;
use support::{Agent, Driver, Floor, median};

/// Request n's `bootstrap_room` (tests/sglang/real/recv_cost.py).
const ROOM0: u64 = 1 << 62;

/// Who watches the receiver in one column.
enum Watch<'a> {
    Off,
    /// Empty programs where this profile's probes go.
    Empty(&'a Profile),
    /// The agent with the `sglang` profile.
    Sglang,
    /// Another agent binary (`STALLWATCH_BASELINE_BIN`, the build before
    /// a change) with its own `sglang`.
    Baseline(PathBuf),
}

/// What one workload sends.
struct Workload {
    ipc: &'static str,
    tokens: u32,
    /// The frames laid out at a page's end (`--place page-end`), not sent.
    placed: bool,
}

impl Workload {
    fn name(&self) -> String {
        let placed = if self.placed { ", each frame at a page's end" } else { "" };
        format!("{} requests ({} tokens{placed})", self.ipc, self.tokens)
    }
}

/// One run: microseconds per request received, and what the agent missed
/// (watched runs), said.
fn run(workload: &Workload, count: u32, watch: &Watch<'_>) -> Result<(f64, Option<String>)> {
    let python = support::sglang_python()?;
    let mut args = vec!["--count".to_owned(), count.to_string(), "--tokens".to_owned(), workload.tokens.to_string()];
    if workload.placed {
        args.extend(["--place".to_owned(), "page-end".to_owned()]);
    }
    let pickle = if workload.ipc == "pickle" { "1" } else { "0" };
    let (mut driver, ready) =
        Driver::spawn(&python, "tests/sglang/real/recv_cost.py", &args, &[("SGLANG_USE_PICKLE_IPC", pickle)])?;
    let pid = ready["pid"].as_u64().context("pid")? as u32;
    let bin = match watch {
        Watch::Baseline(bin) => bin.clone(),
        _ => support::agent_bin(),
    };
    let (agent, floor) = match watch {
        Watch::Off => (None, None),
        Watch::Empty(profile) => (None, Some(Floor::attach(pid, profile)?)),
        Watch::Sglang | Watch::Baseline(_) => (Some(Agent::start(&bin, pid, "sglang")?), None),
    };
    driver.go()?;
    let result = driver.until("result")?;
    // Which requests the agent follows, asked before the target exits
    // (then they end `process_exited` and leave its table).
    let followed = agent.as_ref().map(|agent| followed(&bin, agent, count)).transpose()?;
    driver.finish();
    drop(floor);
    if result["ipc"] != workload.ipc {
        bail!("the receiver ran {} IPC, not {}: {result}", result["ipc"], workload.ipc);
    }
    let target = ["sent", "received"].map(|k| result[k].as_u64());
    if target[1] != Some(u64::from(count)) || (!workload.placed && target[0] != Some(u64::from(count))) {
        bail!("the target did not send and receive all {count} requests (sent, received): {target:?}");
    }
    let mut gap = None;
    if let (Some(agent), Some(followed)) = (agent, followed) {
        let summary = agent.stop()?;
        let missed: Vec<u64> = (0..u64::from(count)).filter(|n| !followed.contains(&(ROOM0 + n))).collect();
        if !missed.is_empty() || summary.seen != u64::from(count) {
            let target = if workload.placed {
                format!("laid out {}", result["received"])
            } else {
                format!("sent {}, received {}", result["sent"], result["received"])
            };
            gap = Some(format!(
                "the sglang agent followed {} of the {count} {} (its summary: seen {}, lost events {}; the \
                 target: {target}): {}",
                u64::from(count) - missed.len() as u64,
                workload.name(),
                summary.seen,
                summary.lost_events,
                which(&missed, count, &result)
            ));
        }
    }
    let per_request = result["per_request_us"].as_f64().context("per_request_us")?;
    Ok((per_request, gap))
}

/// The rooms `agent` has in flight once it has read what the target's
/// receives gave it (its ring buffer is read at least every 100 ms).
fn followed(bin: &Path, agent: &Agent, count: u32) -> Result<HashSet<u64>> {
    let mut keys = HashSet::new();
    for _ in 0..30 {
        keys = support::inflight_keys(bin, agent)?.into_iter().collect();
        if keys.len() >= count as usize {
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    Ok(keys)
}

/// Which requests were missed: their numbers (in the order sent), and for
/// laid-out frames how many bytes before the untouched page each ended.
fn which(missed: &[u64], count: u32, result: &Value) -> String {
    if missed.is_empty() {
        return "every room in its table, but its summary counted otherwise".to_owned();
    }
    let shown: Vec<String> = missed.iter().take(20).map(u64::to_string).collect();
    let more = if missed.len() > 20 { format!(" and {} more", missed.len() - 20) } else { String::new() };
    let ends = [missed.first() == Some(&0), missed.last() == Some(&(u64::from(count) - 1))];
    let mut said = format!(
        "request(s) {}{more} missed (first sent: {}, last sent: {})",
        shown.join(", "),
        if ends[0] { "missed" } else { "followed" },
        if ends[1] { "missed" } else { "followed" }
    );
    if let Some(placed) = result["placed"].as_array() {
        // [room, bytes from the frame's end to the page never touched]
        let after = |n: u64| placed.get(n as usize).and_then(|p| p[1].as_u64());
        let missed_at: std::collections::BTreeSet<u64> = missed.iter().filter_map(|&n| after(n)).collect();
        let kept_at: std::collections::BTreeSet<u64> =
            (0..u64::from(count)).filter(|n| !missed.contains(n)).filter_map(after).collect();
        said.push_str(&format!(
            "; missed frames ended {missed_at:?} bytes before the page never touched, followed ones {kept_at:?} \
             (the room is {} bytes before a {}-byte frame's end)",
            result["frame_bytes"].as_u64().unwrap_or(0).saturating_sub(result["room_at"].as_u64().unwrap_or(0)),
            result["frame_bytes"]
        ));
    }
    said
}

fn main() -> Result<()> {
    support::require_root("the scheduler-request benchmark")?;
    let full = !support::smoke();
    let (runs, count) = if full { (5, 3_000) } else { (1, 200) };
    let smoke = if full { "" } else { " [smoke run: too short for meaningful figures]" };
    let profile = Profile::load("sglang")?;
    let mut columns = vec![("off", Watch::Off), ("empty", Watch::Empty(&profile)), ("sglang", Watch::Sglang)];
    if let Some(bin) = support::baseline_bin() {
        columns.push(("sglang@base", Watch::Baseline(bin)));
    }
    let workloads = if full {
        vec![
            Workload { ipc: "pickle", tokens: 100, placed: false },
            Workload { ipc: "pickle", tokens: 4_000, placed: false },
            Workload { ipc: "msgpack", tokens: 100, placed: false },
        ]
    } else {
        vec![
            Workload { ipc: "pickle", tokens: 100, placed: false },
            Workload { ipc: "msgpack", tokens: 100, placed: false },
        ]
    };
    println!(
        "SGLang scheduler requests, {count} received per run with SGLang's sock_recv, median of {runs} interleaved runs \
         (tests/sglang/real/recv_cost.py){smoke}:"
    );
    println!("{:<8} {:>7} {:<8} {:>11} {:>7}", "ipc", "tokens", "watched", "us/request", "/off");
    let mut gaps = Vec::new();
    for workload in &workloads {
        let mut times = vec![Vec::new(); columns.len()];
        let mut missed_runs = 0;
        for _ in 0..runs {
            for (n, (_, watch)) in columns.iter().enumerate() {
                let (time, gap) = run(workload, count, watch)?;
                times[n].push(time);
                if let Some(gap) = gap {
                    eprintln!("recv bench: {gap}");
                    gaps.push(gap);
                    missed_runs += 1;
                }
            }
        }
        let medians: Vec<f64> = times.iter().map(|t| median(t)).collect();
        for ((name, _), value) in columns.iter().zip(&medians) {
            println!("{:<8} {:>7} {name:<8} {value:>11.1} {:>6.2}x", workload.ipc, workload.tokens, value / medians[0]);
        }
        println!("{:<8} {:>7} the agent followed every request in {} of {runs} runs", "", "", runs - missed_runs);
    }
    // Frames laid out at a page's end, 40 positions: every one followed?
    let placed = Workload { ipc: "msgpack", tokens: 100, placed: true };
    let (_, gap) = run(&placed, 200, &Watch::Sglang)?;
    println!(
        "msgpack frames ending 0-39 bytes before a page never touched (200, recv_cost.py --place page-end): {}",
        if gap.is_none() { "every one followed" } else { "some missed (below)" }
    );
    gaps.extend(gap);
    if !gaps.is_empty() {
        bail!("the agent missed requests it was sent:\n{}", gaps.join("\n"));
    }
    Ok(())
}
