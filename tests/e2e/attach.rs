//! The attach window and a target's new program: probes go live together
//! once all are attached, so attaching to a busy target (at start, at a
//! take-over, at the re-attach of a restarted target) reports no request
//! stalled that was only half seen; and a `--pid` target that execs has
//! the old program's requests ended, then is followed in its new one or
//! let go. Real agents, real eBPF, real uprobes on the demo target running
//! at full speed while the agent attaches.
use std::{
    os::unix::process::CommandExt as _,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{Agent, Demo, Line, Proc, alerts, demo_bin, injected, require_root, summary, test_bpf_dir};

/// `--rate` beyond what the demo can do with its probes hit: it runs
/// flat out, as many requests as possible in flight through the window.
const FLAT_OUT: &str = "1000000";
const TIMEOUT: &str = "1s";
/// Long enough past the timeout for any half-seen request to stall.
const SETTLE: Duration = Duration::from_secs(3);

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
    let agent = Agent::watch(demo.proc.pid(), "demo", TIMEOUT, &["--ephemeral"]);
    thread::sleep(SETTLE);
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
    let mut first = Agent::watch(pid, "demo", TIMEOUT, &["--bpf-dir", &dir_arg]);
    thread::sleep(SETTLE);
    // The second agent takes over this directory, and removes it.
    first.bpf_dir = None;
    assert_clean(&first.stop_with(libc::SIGTERM), "at start-up", 3_000);

    // A rolling update: the next agent attaches its probes while the
    // first one's are live, arms them, then lets the old ones go. It
    // takes over at most the request in progress, and nothing stalls.
    let mut second = Agent::watch(pid, "demo", TIMEOUT, &["--bpf-dir", &dir_arg]);
    second.bpf_dir = Some(dir);
    thread::sleep(SETTLE);
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
    let agent = Agent::discover(&["--exe", "demo-prefill", "--cmdline", &format!("^{marker} ")], "demo", TIMEOUT, &[]);
    agent.wait_watching(first.pid());
    thread::sleep(Duration::from_millis(500));
    // A restart: the target dies and a new one comes up at full speed,
    // attached through the exec tracepoint while it runs.
    let first_pid = first.pid();
    first.signal(libc::SIGKILL);
    agent.proc.wait_stderr(&format!("target process exited pid={first_pid}"), Duration::from_secs(10));
    let second = busy_demo(&marker);
    agent.wait_watching(second.pid());
    thread::sleep(SETTLE);
    let lines = agent.stop();
    drop(second);
    assert_clean(&lines, "at start-up or re-attach", 10_000);
}
