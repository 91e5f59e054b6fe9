//! The `vllm` profile on the vLLM target (tests/vllm/): vLLM 0.33.0's
//! NixlPullConnector, scheduler and worker, unchanged from the wheel, in a
//! prefill and a decode engine on CPU, with real NIXL READs over UCX
//! loopback and the real ZMQ side-channel handshake, one agent on each
//! engine. Each test seeds a stall inside vLLM's own classes, checks that
//! it came out as vLLM really behaves (read from what the engines did,
//! their JSON lines, and what vLLM logged: the `target_*` checks, so the
//! agents' verdicts stand on a checked target), then what the agents said.
//!
//! Every run uses a 6 s `kv_lease_duration` (heartbeats every 1 s, each
//! extending the lease to now + 4 s), request 0 healthy first.
//!
//! A healthy run, a request never read and the lease are the real
//! server's tests (tests/e2e/vllm_serve.rs: `vllm serve`, three processes a
//! server, one agent on the node); what stays here is what needs a fault
//! seeded inside vLLM's own classes (a mismatched notification id, a read
//! held while the prefill is stopped, a decode's abort, heartbeats for a
//! held request, a prefill killed mid-read).
use std::time::Duration;

use serde_json::Value;
use stallwatch_tests::{
    Agent, Line, alerts,
    otlp::{Collector, Span, expected_trace_id},
    summary,
    vllm::Target,
};

const LEASE: f64 = 6.0;

fn held_s(freed: &Value) -> f64 {
    freed["held_s"].as_f64().unwrap_or_else(|| panic!("no held_s: {freed}"))
}

/// What vLLM does with each seeded fault, checked in the test that
/// watches it.
fn target_mismatched_notification_leaves_blocks_held_to_the_lease(target: &Target) {
    let received = target.one("received", "req-1");
    assert_eq!(received["kv_matches"], true, "the READ itself succeeds: {received}");
    assert!(
        target.logged("Potentially invalid KV blocks for unrecognized request req-1-x"),
        "the prefill does not know the notified id: {}",
        target.proc.stderr()
    );
    let held = held_s(&target.one("freed", "req-1"));
    assert!(held >= LEASE - 0.2, "req-1 held to its lease despite the read, not {held} s");
    assert!(target.logged("Releasing expired KV blocks for request req-1 which were retrieved by 0"));
}

fn target_heartbeats_keep_a_waiting_request_past_its_lease(target: &Target) {
    let extended = target.events("lease", Some("req-1")).into_iter().filter(|(_, v)| v["extended"] == true).count();
    assert!(extended >= 5, "a heartbeat about every second for 10 s, each extending the lease: {extended}");
    let held = held_s(&target.one("freed", "req-1"));
    assert!(held >= 10.0, "held past the {LEASE} s lease while the decode waited (10 s), not {held} s");
    let received = target.one("received", "req-1");
    assert_eq!(received["kv_matches"], true, "the late read finds the blocks intact: {received}");
    assert!(!target.logged("Releasing expired KV blocks for request req-1"), "the lease never expired");
}

fn target_decode_read_hangs_while_the_prefill_is_stopped(target: &Target) {
    let signal_at = |name: &str| {
        let found = target.events("signal", None).into_iter().find(|(_, v)| v["signal"] == name);
        found.unwrap_or_else(|| panic!("no {name} from the router")).0
    };
    let (stopped, resumed) = (signal_at("SIGSTOP"), signal_at("SIGCONT"));
    let posted = target.events("read_posted", Some("req-1"))[0].0;
    let received = target.events("received", Some("req-1"));
    assert!(stopped < posted, "the READ was posted to a stopped prefill");
    assert!(
        received.len() == 1 && received[0].0 > resumed,
        "the READ completed only after SIGCONT: {:?}",
        received.iter().map(|(_, v)| v.to_string()).collect::<Vec<_>>()
    );
    assert_eq!(received[0].1["kv_matches"], true);
    assert!(held_s(&target.one("freed", "req-1")) >= 4.0);
}

fn target_prefill_killed_mid_read_fails_the_decode_read(target: &Target) {
    let posted = target.events("read_posted", Some("req-1"))[0].0;
    let killed = target.events("signal", None).into_iter().find(|(_, v)| v["signal"] == "SIGKILL");
    let killed = killed.expect("the router killed the prefill").0;
    assert!(posted < killed, "the READ was in flight when the prefill died");
    // What vLLM 0.33.0 does over UCX/TCP 2 s into a hung READ: the READ
    // fails once the prefill's sockets close, the request is reported
    // received-with-error and its blocks are freed on the decode.
    let received = target.events("received", Some("req-1"));
    assert!(
        received.len() == 1 && received[0].0 > killed && received[0].1["failed"] == true,
        "req-1's READ failed after the kill: {:?}",
        received.iter().map(|(_, v)| v.to_string()).collect::<Vec<_>>()
    );
    assert!(target.logged("Skipping KV post-processing for failed request req-1"), "{}", target.proc.stderr());
}

fn target_aborted_decode_request_notifies_the_prefill_without_a_read(target: &Target) {
    assert_eq!(target.one("aborted", "req-1")["role"], "decode");
    assert!(target.events("read_posted", Some("req-1")).is_empty(), "no READ for an aborted request");
    let held = held_s(&target.one("freed", "req-1"));
    assert!(held < LEASE / 2.0, "freed by the abort's notify-only message, not the lease: {held} s");
    assert!(!target.logged("Releasing expired KV blocks for request req-1"));
}

// ---------------------------------------------------------------------
// The agents: one on the prefill, one on
// the decode, each with a 2 s timeout (below the 6 s lease, as the docs
// say it must be).
// ---------------------------------------------------------------------

const AGENT_TIMEOUT: &str = "2s";

/// SIGINT, then its lines up to its summary, with what it logged (its
/// last words at exit among them) as one last line.
fn stop(mut agent: Agent) -> Vec<Line> {
    agent.proc.signal(libc::SIGINT);
    let mut lines = agent.proc.lines_until_exit(Duration::from_secs(20));
    let status = agent.proc.wait(Duration::from_secs(5));
    assert!(status.success(), "agent exited with {status}; stderr:\n{}", agent.proc.stderr());
    lines.push(Line { at: std::time::Instant::now(), text: agent.proc.stderr() });
    lines
}

/// The target with a `vllm` agent on each engine, then run to its end;
/// both agents' lines (prefill's, decode's), stopped, each ending on what
/// it logged.
fn watched(fault: &str, extra: &[&str]) -> (Target, Vec<Line>, Vec<Line>) {
    watched_with(fault, extra, &[])
}

/// [`watched`], with `agent_extra` flags for both agents.
fn watched_with(fault: &str, extra: &[&str], agent_extra: &[&str]) -> (Target, Vec<Line>, Vec<Line>) {
    let mut target = Target::start(fault, &[&["--lease", "6"], extra].concat());
    let prefill = Agent::watch(target.prefill(), "vllm", AGENT_TIMEOUT, agent_extra);
    let decode = Agent::watch(target.decode(), "vllm", AGENT_TIMEOUT, agent_extra);
    target.go();
    target.run_to_done(Duration::from_secs(120));
    // The last stall's judging and the summary.
    std::thread::sleep(Duration::from_millis(500));
    (target, stop(prefill), stop(decode))
}

/// Every alert line but the summary.
fn alert_lines(lines: &[Line]) -> Vec<Value> {
    lines.iter().filter_map(Line::json).filter(|v| v.get("alert").is_some_and(|a| a != "summary")).collect()
}

fn shown(lines: &[Line]) -> String {
    lines.iter().map(|l| l.text.as_str()).collect::<Vec<_>>().join("\n")
}

#[test]
fn a_read_hung_on_a_stopped_prefill_stalls_the_decodes_read_with_the_request_id() {
    let (target, _prefill, decode) = watched("read_hung", &["--hold", "4", "--max-seconds", "12"]);
    target_decode_read_hangs_while_the_prefill_is_stopped(&target);
    let stalled: Vec<Value> = alerts(&decode, "stalled").map(|(_, v)| v).collect();
    assert_eq!(stalled.len(), 1, "decode:\n{}", shown(&decode));
    let alert = &stalled[0];
    assert_eq!(
        (alert["class"].as_str(), alert["external_id"].as_str(), alert["vllm_request_id"].as_str()),
        (Some("transfer_hung"), Some("req-1"), Some("req-1")),
        "{alert}"
    );
    assert_eq!(alert["vllm_consumers"], "1", "{alert}");
    assert_eq!(alert["vllm_transfer"], "READ (decode pulls)", "{alert}");
    // The prefill came back: the READ completed.
    let recovered: Vec<Value> = alerts(&decode, "recovered").map(|(_, v)| v).collect();
    assert_eq!(recovered.len(), 1, "decode:\n{}", shown(&decode));
    assert_eq!(recovered[0]["external_id"], "req-1");
}

#[test]
fn a_prefill_killed_mid_read_fails_the_decodes_read() {
    let (target, _prefill, decode) = watched("prefill_dies", &["--hold", "3", "--max-seconds", "10"]);
    target_prefill_killed_mid_read_fails_the_decode_read(&target);
    let stalled: Vec<Value> = alerts(&decode, "stalled").map(|(_, v)| v).collect();
    assert_eq!(stalled.len(), 1, "hung while the prefill was stopped:\n{}", shown(&decode));
    assert_eq!(
        (stalled[0]["class"].as_str(), stalled[0]["external_id"].as_str()),
        (Some("transfer_hung"), Some("req-1"))
    );
    let failed: Vec<Value> = alerts(&decode, "failed").map(|(_, v)| v).collect();
    assert_eq!(failed.len(), 1, "the READ failed after the kill:\n{}", shown(&decode));
    assert_eq!(failed[0]["external_id"], "req-1", "{}", failed[0]);
}

#[test]
fn heartbeats_keep_a_held_request_waited_on_past_the_timeout() {
    let (target, prefill, decode) = watched("heartbeat", &["--count", "2", "--hold", "10", "--max-seconds", "12"]);
    target_heartbeats_keep_a_waiting_request_past_its_lease(&target);
    // The prefill holds req-1 for 10 s with the decode's heartbeats: past
    // the 2 s timeout it is reported, as waited on, not abandoned.
    let stalled: Vec<Value> = alerts(&prefill, "stalled").map(|(_, v)| v).collect();
    assert_eq!(stalled.len(), 1, "prefill:\n{}", shown(&prefill));
    let alert = &stalled[0];
    assert_eq!(
        (alert["class"].as_str(), alert["external_id"].as_str(), alert["vllm_consumers_answered"].as_str()),
        (Some("waiting_for_peer"), Some("req-1"), Some("0/?")),
        "{alert}"
    );
    assert_eq!(alert["vllm_held_since"], "engine output", "{alert}");
    assert!(alert["vllm_decode"].as_str().is_some_and(|v| v.starts_with("waited on")), "{alert}");
    let beats: u32 = alert["vllm_heartbeats"].as_str().and_then(|n| n.parse().ok()).expect("heartbeats");
    assert!(beats >= 2, "heartbeats seen by the alert: {alert}");
    // Its read at last: the only consumer's notification releases it.
    let recovered: Vec<Value> = alerts(&prefill, "recovered").map(|(_, v)| v).collect();
    assert_eq!(recovered.len(), 1, "prefill:\n{}", shown(&prefill));
    assert_eq!(
        (recovered[0]["external_id"].as_str(), recovered[0]["stage"].as_str()),
        (Some("req-1"), Some("released"))
    );
    assert!(alert_lines(&decode).iter().all(|a| a["alert"] != "stalled"), "decode:\n{}", shown(&decode));
}

/// The prefill's one held request alerted, as the never-read stall: held
/// since its engine output, no consumer answered, no heartbeat, reported
/// within the timeout + 1 s of that output.
fn assert_never_read(prefill: &[Line]) -> Value {
    let stalled: Vec<Value> = alerts(prefill, "stalled").map(|(_, v)| v).collect();
    assert_eq!(stalled.len(), 1, "prefill:\n{}", shown(prefill));
    let alert = stalled[0].clone();
    assert_eq!(
        (alert["class"].as_str(), alert["external_id"].as_str(), alert["vllm_request_id"].as_str()),
        (Some("waiting_for_peer"), Some("req-1"), Some("req-1")),
        "{alert}"
    );
    assert_eq!(
        (
            alert["vllm_held_since"].as_str(),
            alert["vllm_consumers_answered"].as_str(),
            alert["vllm_heartbeats"].as_str()
        ),
        (Some("engine output"), Some("0/?"), Some("0")),
        "{alert}"
    );
    assert!(alert["vllm_decode"].as_str().is_some_and(|v| v.starts_with("never read")), "{alert}");
    let silent = alert["silent_ms"].as_u64().expect("silent_ms");
    assert!((2000..3000).contains(&silent), "reported within timeout + 1 s of its output: {alert}");
    alert
}

#[test]
fn a_mismatched_notification_is_the_decodes_read_of_the_other_id() {
    let (target, prefill, decode) = watched("mismatch", &["--count", "2", "--max-seconds", "12"]);
    target_mismatched_notification_leaves_blocks_held_to_the_lease(&target);
    assert!(target.logged("Potentially invalid KV blocks for unrecognized request req-1-x"));
    // The decode READ req-1-x, completed; the prefill read its notification,
    // for an id it was never seen holding (nor was req-1 seen held).
    assert!(alert_lines(&decode).is_empty(), "decode:\n{}", shown(&decode));
    assert_eq!(summary(&decode)["completed"], 2);
    // req-1 was never read under its own id: its alert shows the id that
    // came instead.
    let alert = assert_never_read(&prefill);
    assert_eq!(alert["vllm_recent_other_notifications"], "req-1-x:1", "{alert}");
    let said = prefill.iter().any(|l| l.text.contains("not seen held") && l.text.contains("notifications=1"));
    assert!(said, "req-1-x:1 read, never held:\n{}", shown(&prefill));
}

#[test]
fn a_decode_abort_is_its_notification_alone_and_raises_nothing() {
    let (target, prefill, decode) = watched("decode_abort", &["--count", "2", "--max-seconds", "12"]);
    target_aborted_decode_request_notifies_the_prefill_without_a_read(&target);
    assert!(held_s(&target.one("freed", "req-1")) < LEASE / 2.0);
    assert!(alert_lines(&prefill).is_empty(), "prefill:\n{}", shown(&prefill));
    assert!(alert_lines(&decode).is_empty(), "decode:\n{}", shown(&decode));
    assert_eq!(summary(&prefill)["completed"], 2, "req-1 released by the abort's notification");
    assert_eq!(summary(&decode)["completed"], 1, "req-0's READ only: req-1 had none");
    let said = decode.iter().any(|l| l.text.contains("given up unread") && l.text.contains("request req-1"));
    assert!(said, "the decode's notify-only genNotif of req-1:\n{}", shown(&decode));
}

/// Both sides of one request in one trace: the prefill's held req-1 (its
/// stall and its request span) and the decode's READ of it (its request
/// span), each agent exporting on its own, share the trace id of req-1.
#[test]
fn the_prefills_held_request_and_the_decodes_read_of_it_share_one_trace() {
    let mut collector = Collector::start();
    let endpoint = collector.http_endpoint();
    let (_target, prefill, _decode) = watched_with(
        "heartbeat",
        &["--count", "2", "--hold", "4", "--max-seconds", "12"],
        &["--otlp-endpoint", &endpoint],
    );
    let held = alerts(&prefill, "stalled").map(|(_, v)| v).next().expect("the prefill's held req-1");
    let held_key = held["key"].as_str().expect("key").to_owned();
    let trace = expected_trace_id("req-1");
    let in_trace = |spans: &[Span]| -> Vec<(String, String)> {
        let ours = spans.iter().filter(|s| s.trace_id == trace);
        ours.map(|s| (s.name.clone(), s.attr("stallwatch.request.key").unwrap_or_default().to_owned())).collect()
    };
    let spans = collector.wait_for(Duration::from_secs(10), "both sides' spans of req-1", |spans| {
        let found = in_trace(spans);
        let prefill = found.iter().any(|(name, key)| name == "stallwatch.stall" && *key == held_key);
        let decode = found.iter().any(|(name, key)| name == "stallwatch.request" && *key != held_key);
        prefill && decode
    });
    let found = in_trace(&spans);
    assert!(found.iter().any(|(name, key)| name == "stallwatch.request" && *key == held_key), "{found:?}");
    let _ = collector.stop();
}
