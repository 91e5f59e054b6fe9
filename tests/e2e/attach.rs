//! The attach window and a target's new program: probes go live together
//! once all are attached, so attaching to a busy target (at start, at a
//! take-over, at the re-attach of a restarted target) reports no request
//! stalled that was only half seen; and a `--pid` target that execs has
//! the old program's requests ended, then is followed in its new one or
//! let go. Real agents, real eBPF, real uprobes on the demo target running
//! at full speed while the agent attaches.
use std::{
    collections::HashSet,
    os::unix::process::CommandExt as _,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{
    Agent, COMPLETED, Demo, Line, METRICS, Proc, alerts, demo_bin, require_root, summary, test_bpf_dir,
};

/// `--rate` beyond what the demo can do with its probes hit: it runs
/// flat out, as many requests as possible in flight through the window.
const FLAT_OUT: &str = "1000000";
const TIMEOUT: &str = "1s";
/// Long enough past the timeout for any half-seen request to stall.
const SETTLE: Duration = Duration::from_secs(3);
/// Watch the busy target until the agent has followed `min_completed`
/// requests (its metrics say so), and for SETTLE since `since` at least.
/// The rest of the window is the workload: a request half seen at attach
/// would by then be past the timeout and stalled, and nothing marks the
/// absence of a stall but watching for it.
fn settle(agent: &Agent, since: Instant, min_completed: u64) {
    agent.wait_completed(min_completed);
    thread::sleep(SETTLE.saturating_sub(since.elapsed()));
}

/// `extra` and the metrics endpoint.
fn with_metrics<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    extra.iter().copied().chain(METRICS).collect()
}

fn key_of(alert: &Value) -> String {
    alert["key"].as_str().expect("alert key").to_owned()
}

/// The stall alerts among `lines`, for a failure message.
fn stalls(lines: &[Line]) -> Vec<Value> {
    alerts(lines, "stalled").map(|(_, alert)| alert).collect()
}

/// What every agent's summary must say after attaching to a busy demo:
/// nothing stalled or lost, the healthy requests followed, and at most the
/// one request the demo's single thread has in progress still held (no
/// half-seen lifecycle left behind).
fn assert_clean(lines: &[Line], when: &str, min_completed: u64) {
    let summary = summary(lines);
    assert!(stalls(lines).is_empty(), "false stalls {when}: {:?}\n{summary}", stalls(lines));
    assert_eq!(summary["stalled"], 0, "{when}: {summary}");
    assert_eq!(summary["lost_events"], 0, "{when}: {summary}");
    assert!(summary["in_flight"].as_u64().is_some_and(|n| n <= 1), "half-seen requests held {when}: {summary}");
    let completed = summary["completed"].as_u64().unwrap_or(0);
    assert!(completed >= min_completed, "the healthy requests were followed {when}: {summary}");
}

#[test]
fn attaching_to_a_target_running_flat_out_reports_no_false_stall() {
    require_root();
    let mut demo = Demo::start(&["--rate", FLAT_OUT, "--duration", "40s"]);
    demo.go();
    let agent = Agent::watch(demo.proc.pid(), "demo", TIMEOUT, &with_metrics(&["--ephemeral"]));
    settle(&agent, Instant::now(), 10_000);
    assert_clean(&agent.stop(), "at start-up", 10_000);
}

#[test]
fn a_take_over_of_a_busy_target_inherits_no_half_seen_request() {
    require_root();
    // A rate whose events the ring buffer holds while no agent runs
    // between the two (about 40 000 events, 4 a request).
    let mut demo = Demo::start(&["--rate", "3000", "--duration", "40s"]);
    demo.go();
    let pid = demo.proc.pid();
    let dir = test_bpf_dir();
    let dir_arg = dir.to_str().expect("utf-8 dir").to_owned();
    let mut first = Agent::watch(pid, "demo", TIMEOUT, &with_metrics(&["--bpf-dir", &dir_arg]));
    settle(&first, Instant::now(), 3_000);
    // The second agent takes over this directory, and removes it.
    first.bpf_dir = None;
    assert_clean(&first.stop_with(libc::SIGTERM), "at start-up", 3_000);

    // A rolling update: the next agent attaches its probes while the
    // first one's are live, arms them, then lets the old ones go. It
    // takes over at most the request in progress, and nothing stalls.
    let mut second = Agent::watch(pid, "demo", TIMEOUT, &with_metrics(&["--bpf-dir", &dir_arg]));
    second.bpf_dir = Some(dir);
    settle(&second, Instant::now(), 3_000);
    let lines = second.stop_with(libc::SIGTERM);
    let restored = summary(&lines)["restored"].as_u64();
    assert!(restored.is_some_and(|n| n <= 1), "half-seen requests handed over: {}", summary(&lines));
    assert_clean(&lines, "at the take-over", 3_000);
}

/// The demo, started running (no `go` needed) with `argv[0]` set to
/// `marker`, so a discovering agent can select it and no neighbour's demo.
fn busy_demo(marker: &str) -> Proc {
    let mut command = Command::new(demo_bin());
    command.arg0(marker).args(["--rate", FLAT_OUT, "--duration", "40s"]);
    let proc = Proc::spawn("demo-prefill", &mut command);
    let ready = proc.next_line(Duration::from_secs(10), "ready line").json().expect("ready line is JSON");
    assert_eq!(ready["event"], "ready", "{ready}");
    proc
}

#[test]
fn a_restarted_busy_target_is_re_attached_without_false_stalls() {
    require_root();
    let marker = format!("demo-prefill-attach-test-{}", std::process::id());
    let first = busy_demo(&marker);
    let agent = Agent::selecting(&["--exe", "demo-prefill", "--cmdline", &format!("^{marker} ")])
        .timeout(TIMEOUT)
        .metrics()
        .discover();
    agent.wait_watching(first.pid());
    // The first target's requests are followed before it dies.
    agent.wait_completed(1_000);
    // A restart: the target dies and a new one comes up at full speed,
    // attached through the exec tracepoint while it runs.
    let first_pid = first.pid();
    first.signal(libc::SIGKILL);
    agent.proc.wait_stderr(&format!("target process exited pid={first_pid}"), Duration::from_secs(10));
    let second = busy_demo(&marker);
    agent.wait_watching(second.pid());
    let re_attached = Instant::now();
    let followed = agent.metric(COMPLETED);
    settle(&agent, re_attached, followed + 10_000);
    let lines = agent.stop();
    drop(second);
    assert_clean(&lines, "at start-up or re-attach", 10_000);
}

/// A demo that pins two requests (`waiting_for_peer`, `transfer_hung`),
/// which stall, then execs `then` (a program and its arguments).
fn exec_demo(then: &[&str]) -> Demo {
    let mut args = vec![
        "--rate",
        "500",
        "--duration",
        "30s",
        "--inject-after",
        "100ms",
        "--waiting-for-peer",
        "1",
        "--transfer-hung",
        "1",
        "--exec-after",
        "2500ms",
        "--",
    ];
    args.extend_from_slice(then);
    Demo::start(&args)
}

/// The old program's pinned requests end `process_exited` at its exec,
/// named as the old program, and no others do.
fn assert_old_requests_ended(seen: &[Line], pid: u32, old: &HashSet<String>) {
    let exited: Vec<Value> = alerts(seen, "process_exited").map(|(_, alert)| alert).collect();
    let keys: HashSet<String> = exited.iter().map(key_of).collect();
    assert_eq!(&keys, old, "{exited:?}");
    for alert in &exited {
        assert_eq!(
            (alert["pid"].as_u64(), alert["process"].as_str()),
            (Some(u64::from(pid)), Some("demo-prefill")),
            "{alert}"
        );
    }
}

#[test]
fn an_exec_under_pid_ends_the_old_programs_requests_and_follows_the_new_one() {
    require_root();
    let demo_path = demo_bin();
    let demo_path = demo_path.to_str().expect("utf-8 path");
    // The new program starts once the agent has attached to it (a request
    // it started before the agent read the exec would hit the old probes
    // and end `process_exited` with the old program's: see
    // docs/getting-started.md), then pins one request of its own.
    let (rate, pin) = (["--rate", "500", "--duration", "30s"], ["--inject-after", "3s", "--release-lost", "1"]);
    let new_program: Vec<&str> = [demo_path, "--wait-for-go"].into_iter().chain(rate).chain(pin).collect();
    let mut demo = exec_demo(&new_program);
    let pid = demo.proc.pid();
    let agent = Agent::watch(pid, "demo", TIMEOUT, &["--ephemeral"]);
    demo.go();
    let mut demo_lines = Vec::new();
    let old: HashSet<String> = demo.wait_injected(2, &mut demo_lines).into_keys().collect();
    let mut seen = Vec::new();
    agent.wait_alerts("stalled", 2, Duration::from_secs(10), &mut seen);
    agent.wait_until("the old program's requests ended at its exec", Duration::from_secs(10), &mut seen, |seen| {
        alerts(seen, "process_exited").count() >= 2
    });
    agent.proc.wait_stderr("exec'd a new program", Duration::from_secs(5));
    agent.proc.wait_stderr_lines("stallwatch::run::session: watching", 2, Duration::from_secs(10));
    demo.go();
    // Same pid, new program: attached again, its own stall reported.
    agent.wait_until("a stall of the new program", Duration::from_secs(10), &mut seen, |seen| {
        alerts(seen, "stalled").any(|(_, alert)| alert["class"] == "release_lost")
    });
    let lines: Vec<Line> = seen.into_iter().chain(agent.stop()).collect();
    assert_old_requests_ended(&lines, pid, &old);
    let summary = summary(&lines);
    assert_eq!((summary["stalled"].as_u64(), summary["process_exited"].as_u64()), (Some(3), Some(2)), "{summary}");
    assert_eq!(summary["lost_events"], 0, "{summary}");
}

#[test]
fn an_exec_under_pid_into_a_program_the_profile_does_not_fit_stops_the_agent() {
    require_root();
    let mut demo = exec_demo(&["/bin/sleep", "30"]);
    let pid = demo.proc.pid();
    let mut agent = Agent::watch(pid, "demo", TIMEOUT, &["--ephemeral"]);
    demo.go();
    let mut demo_lines = Vec::new();
    let old: HashSet<String> = demo.wait_injected(2, &mut demo_lines).into_keys().collect();
    // It ends by itself, as when the target exits, with its summary.
    let lines = agent.proc.lines_until_exit(Duration::from_secs(15));
    let status = agent.proc.wait(Duration::from_secs(5));
    assert!(status.success(), "agent exited with {status}; stderr:\n{}", agent.proc.stderr());
    assert_old_requests_ended(&lines, pid, &old);
    let summary = summary(&lines);
    assert_eq!((summary["stalled"].as_u64(), summary["process_exited"].as_u64()), (Some(2), Some(2)), "{summary}");
    let stderr = agent.proc.stderr();
    assert!(
        stderr.contains("exec'd a new program") && stderr.contains("not watching the target's new program"),
        "{stderr}"
    );
    assert!(demo.proc.child.try_wait().expect("try_wait").is_none(), "the target lives on as /bin/sleep");
}
