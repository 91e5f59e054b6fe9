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
//! SGLang venv). Without `--bench` a smoke version runs, which fails unless
//! the agent followed every request it was sent.
mod support;

use anyhow::{Context as _, Result, bail};
use stallwatch::profile::Profile;
use support::{Agent, Driver, Floor, median};

/// Who watches the receiver in one column.
enum Watch<'a> {
    Off,
    /// Empty programs where this profile's probes go.
    Empty(&'a Profile),
    /// The agent with the `sglang` profile.
    Sglang,
}

/// What one workload sends.
struct Workload {
    ipc: &'static str,
    tokens: u32,
}

/// One run: microseconds per request received.
fn run(workload: &Workload, count: u32, watch: &Watch<'_>) -> Result<f64> {
    let python = support::sglang_python()?;
    let args = ["--count".to_owned(), count.to_string(), "--tokens".to_owned(), workload.tokens.to_string()];
    let pickle = if workload.ipc == "pickle" { "1" } else { "0" };
    let (mut driver, ready) =
        Driver::spawn(&python, "tests/sglang/real/recv_cost.py", &args, &[("SGLANG_USE_PICKLE_IPC", pickle)])?;
    let pid = ready["pid"].as_u64().context("pid")? as u32;
    let (agent, floor) = match watch {
        Watch::Off => (None, None),
        Watch::Empty(profile) => (None, Some(Floor::attach(pid, profile)?)),
        Watch::Sglang => (Some(Agent::start(&support::agent_bin(), pid, "sglang")?), None),
    };
    driver.go()?;
    let result = driver.until("result")?;
    driver.finish();
    drop(floor);
    if result["ipc"] != workload.ipc {
        bail!("the receiver ran {} IPC, not {}: {result}", result["ipc"], workload.ipc);
    }
    if let Some(agent) = agent {
        let summary = agent.stop()?;
        if summary.lost_events > 0 {
            eprintln!("recv bench: the agent lost {} events", summary.lost_events);
        }
        if summary.seen < u64::from(count) {
            let followed = format!(
                "the sglang agent followed {} of the {count} {} requests ({} tokens)",
                summary.seen, workload.ipc, workload.tokens
            );
            if support::smoke() {
                bail!(followed);
            }
            eprintln!("recv bench: {followed}");
        }
    }
    result["per_request_us"].as_f64().context("per_request_us")
}

fn main() -> Result<()> {
    support::require_root("the scheduler-request benchmark")?;
    let full = !support::smoke();
    let (runs, count) = if full { (5, 3_000) } else { (1, 200) };
    let smoke = if full { "" } else { " [smoke run: too short for meaningful figures]" };
    let profile = Profile::load("sglang")?;
    let columns = [("off", Watch::Off), ("empty", Watch::Empty(&profile)), ("sglang", Watch::Sglang)];
    let workloads = if full {
        vec![
            Workload { ipc: "pickle", tokens: 100 },
            Workload { ipc: "pickle", tokens: 4_000 },
            Workload { ipc: "msgpack", tokens: 100 },
        ]
    } else {
        vec![Workload { ipc: "pickle", tokens: 100 }, Workload { ipc: "msgpack", tokens: 100 }]
    };
    println!(
        "SGLang scheduler requests, {count} received per run with SGLang's sock_recv, median of {runs} interleaved runs \
         (tests/sglang/real/recv_cost.py){smoke}:"
    );
    println!("{:<8} {:>7} {:<8} {:>11} {:>7}", "ipc", "tokens", "watched", "us/request", "/off");
    for workload in &workloads {
        let mut times = vec![Vec::new(); columns.len()];
        for _ in 0..runs {
            for (n, (_, watch)) in columns.iter().enumerate() {
                times[n].push(run(workload, count, watch)?);
            }
        }
        let medians: Vec<f64> = times.iter().map(|t| median(t)).collect();
        for ((name, _), value) in columns.iter().zip(&medians) {
            println!("{:<8} {:>7} {name:<8} {value:>11.1} {:>6.2}x", workload.ipc, workload.tokens, value / medians[0]);
        }
    }
    Ok(())
}
