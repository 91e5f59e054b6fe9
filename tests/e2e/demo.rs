//! The agent against the real demo target: real eBPF in this kernel, real
//! uprobes on a real process.
use std::{collections::HashMap, process::Command, time::Duration};

use serde_json::Value;
use stallwatch_tests::{Agent, Demo, Injected, Line, agent_bin, alerts, injected, require_root, run_to_end, summary};

const TIMEOUT: Duration = Duration::from_secs(2);
/// How late a stall may be reported, past the timeout (the bound).
const LATENESS: Duration = Duration::from_secs(1);

/// Start the demo, attach the agent, let the demo go.
fn watched(demo_args: &[&str], timeout: &str) -> (Demo, Agent) {
    watched_with(demo_args, timeout, &[])
}

/// [`watched`] with more `stallwatch run` flags.
fn watched_with(demo_args: &[&str], timeout: &str, agent_args: &[&str]) -> (Demo, Agent) {
    require_root();
    let mut demo = Demo::start(demo_args);
    let agent = Agent::watch(demo.proc.pid(), "demo", timeout, agent_args);
    demo.go();
    (demo, agent)
}

fn key_of(alert: &Value) -> String {
    alert["key"].as_str().expect("alert key").to_owned()
}

/// Check every stall alert: for an injected request, of its class, with its
/// room, reported while stuck: after the timeout, within timeout + 1 s of
/// the request's last lifecycle event (the test saw that event's `injected`
/// line just after it happened). Returns how often each key was reported.
fn stalls_on_time(
    agent_lines: &[Line],
    injected: &HashMap<String, Injected>,
    timeout: Duration,
) -> HashMap<String, usize> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (at, alert) in alerts(agent_lines, "stalled") {
        let key = key_of(&alert);
        let pinned = injected.get(&key).unwrap_or_else(|| panic!("stall alert for a healthy request: {alert}"));
        assert_eq!(alert["class"], pinned.stall.as_str(), "{alert}");
        assert_eq!(alert["external_id"], format!("room-{}", u64::from_str_radix(&key[2..], 16).expect("hex key")));
        *seen.entry(key).or_default() += 1;
        let latency = at.duration_since(pinned.at);
        assert!(latency >= timeout - Duration::from_millis(50), "{alert} after {latency:?}");
        assert!(latency <= timeout + LATENESS, "{alert} only after {latency:?}");
        let silent = Duration::from_millis(alert["silent_ms"].as_u64().expect("silent_ms"));
        assert!(silent >= timeout && silent <= timeout + LATENESS, "{alert}");
    }
    seen
}

#[test]
fn every_injected_stall_is_reported_once_with_its_class_while_stuck() {
    let (mut demo, agent) = watched(
        &[
            "--rate",
            "2000",
            "--duration",
            "7s",
            "--inject-after",
            "500ms",
            "--waiting-for-peer",
            "2",
            "--transfer-hung",
            "2",
            "--release-lost",
            "2",
        ],
        "2s",
    );
    // The demo exits at 7 s, so the agent sees its exit and ends by itself.
    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(30));
    let demo_lines = demo.proc.lines_until_exit(Duration::from_secs(5));
    let injected = injected(&demo_lines);
    assert_eq!(injected.len(), 6, "demo said: {demo_lines:?}");

    let seen = stalls_on_time(&agent_lines, &injected, TIMEOUT);
    assert_eq!(seen.len(), 6, "every injected request stalls: {agent_lines:?}");
    assert!(seen.values().all(|&n| n == 1), "each stall is reported exactly once: {seen:?}");

    // The pinned requests were still held when the demo exited.
    let exited: Vec<String> = alerts(&agent_lines, "process_exited").map(|(_, a)| key_of(&a)).collect();
    assert_eq!(exited.len(), 6, "{exited:?}");
    assert!(exited.iter().all(|key| injected.contains_key(key)));

    let summary = summary(&agent_lines);
    assert_eq!(summary["stalled"], 6, "{summary}");
    assert_eq!(summary["lost_events"], 0, "{summary}");
    let _ = demo.proc.wait(Duration::from_secs(5));
}

#[test]
fn ten_thousand_healthy_requests_raise_no_alert() {
    let (mut demo, agent) = watched(&["--rate", "5000", "--requests", "12000", "--duration", "20s"], "1s");
    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(40));
    let demo_lines = demo.proc.lines_until_exit(Duration::from_secs(5));
    let done = demo_lines.iter().filter_map(Line::json).find(|v| v["event"] == "done").expect("demo done line");
    assert_eq!(done["healthy"], 12000, "{done}");

    let alert_lines: Vec<&Line> =
        agent_lines.iter().filter(|l| l.json().is_some_and(|v| v["alert"] != "summary")).collect();
    assert!(alert_lines.is_empty(), "healthy requests raised alerts: {alert_lines:?}");
    let summary = summary(&agent_lines);
    // Every lifecycle was seen whole: nothing lost, nothing left in flight.
    assert_eq!(summary["seen"], 12000, "{summary}");
    assert_eq!(summary["completed"], 12000, "{summary}");
    assert_eq!(summary["in_flight"], 0, "{summary}");
    assert_eq!(summary["lost_events"], 0, "{summary}");
    // Whole though the kernel sent neither the post nor the done of a
    // request it had seen enqueued a moment before (the profile's `quiet`
    // probes): those came with the release. Only a post or done half the
    // timeout after the request's previous event would have been sent.
    let withheld = summary["withheld"].as_u64().expect("withheld");
    assert!((20_000..=24_000).contains(&withheld), "{summary}");
    let _ = demo.proc.wait(Duration::from_secs(5));
}

#[test]
fn a_stall_that_moves_on_is_reported_recovered() {
    let (mut demo, agent) = watched(
        &["--rate", "500", "--duration", "6s", "--inject-after", "300ms", "--recover", "1", "--recover-after", "3s"],
        "1s",
    );
    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(30));
    let stalled: Vec<Value> = alerts(&agent_lines, "stalled").map(|(_, v)| v).collect();
    let recovered: Vec<Value> = alerts(&agent_lines, "recovered").map(|(_, v)| v).collect();
    assert_eq!(stalled.len(), 1, "{agent_lines:?}");
    assert_eq!(stalled[0]["class"], "transfer_hung");
    assert_eq!(recovered.len(), 1, "{agent_lines:?}");
    assert_eq!(recovered[0]["key"], stalled[0]["key"]);
    // Hung from its post (at ~0.3 s) until ~3.3 s.
    let stuck = recovered[0]["stuck_ms"].as_u64().expect("stuck_ms");
    assert!((2_500..=4_000).contains(&stuck), "{}", recovered[0]);
    let summary = summary(&agent_lines);
    assert_eq!(summary["recovered"], 1, "{summary}");
    assert_eq!(summary["in_flight"], 0, "the recovered request was released: {summary}");
    let _ = demo.proc.wait(Duration::from_secs(5));
}

/// A status poll that polls another transfer from inside (a library
/// calling itself back) holds two calls of one return-probed function on
/// one thread. The inner call polls a hung transfer and answers "in
/// progress" (filtered out at its return); the outer answers done. Given
/// the inner call's arguments, the outer's done would be the hung
/// transfer's and turn its hang into `release_lost`; the outer return is
/// refused instead (its frame is not the one the arguments were saved for)
/// and counted.
#[test]
fn a_nested_status_poll_never_lends_its_arguments_to_the_outer_call() {
    let (mut demo, agent) = watched(
        &[
            "--rate",
            "500",
            "--duration",
            "4s",
            "--inject-after",
            "300ms",
            "--transfer-hung",
            "1",
            "--nested-polls",
            "3",
        ],
        "2s",
    );
    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(30));
    let demo_lines = demo.proc.lines_until_exit(Duration::from_secs(5));
    let injected = injected(&demo_lines);
    let nested = demo_lines.iter().filter_map(Line::json).filter(|v| v["event"] == "nested").count();
    assert_eq!((injected.len(), nested), (1, 3), "demo said: {demo_lines:?}");

    let seen = stalls_on_time(&agent_lines, &injected, TIMEOUT);
    assert_eq!(seen.len(), 1, "the hung transfer stalls as hung: {agent_lines:?}");
    let summary = summary(&agent_lines);
    assert_eq!(summary["stalled"], 1, "{summary}");
    assert_eq!(summary["args_missing"], 3, "each outer done is refused, once: {summary}");
    let _ = demo.proc.wait(Duration::from_secs(5));
}

#[test]
fn failed_and_aborted_requests_end_their_lifecycles() {
    let (mut demo, agent) =
        watched(&["--rate", "1000", "--requests", "500", "--fail", "3", "--abort", "2", "--duration", "10s"], "1s");
    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(30));
    let failed: Vec<Value> = alerts(&agent_lines, "failed").map(|(_, v)| v).collect();
    assert_eq!(failed.len(), 3, "{agent_lines:?}");
    assert!(alerts(&agent_lines, "stalled").next().is_none(), "{agent_lines:?}");
    let summary = summary(&agent_lines);
    assert_eq!(summary["failed"], 3, "{summary}");
    assert_eq!(summary["aborted"], 2, "{summary}");
    assert_eq!(summary["completed"], 495, "{summary}");
    let _ = demo.proc.wait(Duration::from_secs(5));
}

/// A finished handle polled again answers what it answered before: done
/// while the request is held, the error after its failure ended it. The
/// kernel sends neither again (`only_on_change`): a request done and never
/// released is silent however often it is polled, so its stall is
/// reported, and a failure is seen once (no stale event but the release
/// of each failed request, which comes after the failure ended it).
#[test]
fn a_finished_status_polled_again_is_not_sent_again() {
    let (mut demo, agent) = watched(
        &[
            "--rate",
            "1000",
            "--requests",
            "400",
            "--fail",
            "100",
            "--repoll",
            "4",
            "--release-lost",
            "1",
            "--duration",
            "4s",
        ],
        "1s",
    );
    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(30));
    let stalled: Vec<Value> = alerts(&agent_lines, "stalled").map(|(_, v)| v).collect();
    assert_eq!(stalled.len(), 1, "{agent_lines:?}");
    assert_eq!(stalled[0]["class"], "release_lost", "{agent_lines:?}");
    let summary = summary(&agent_lines);
    assert_eq!(summary["completed"], 300, "{summary}");
    assert_eq!(summary["failed"], 100, "{summary}");
    assert_eq!(summary["stale_events"], 100, "{summary}");
    assert_eq!(summary["lost_events"], 0, "{summary}");
    let _ = demo.proc.wait(Duration::from_secs(5));
}

#[test]
fn sigint_prints_the_summary_with_requests_still_stuck() {
    let (_demo, agent) =
        watched(&["--rate", "200", "--duration", "30s", "--inject-after", "100ms", "--waiting-for-peer", "1"], "1s");
    let mut lines = Vec::new();
    agent.wait_alerts("stalled", 1, Duration::from_secs(10), &mut lines);
    lines.extend(agent.stop());
    assert_eq!(alerts(&lines, "stalled").count(), 1, "{lines:?}");
    let summary = summary(&lines);
    assert_eq!(summary["stalled"], 1, "{summary}");
    assert!(summary["in_flight"].as_u64().expect("in_flight") >= 1, "{summary}");
}

#[test]
fn an_unreadable_external_id_loses_no_event() {
    require_root();
    // The demo profile, its external id pointed at `req->id` (a small
    // number, never a readable address): every enqueue is delivered
    // without its room.
    let (ok, shown, stderr) = run_to_end(Command::new(agent_bin()).args(["profile", "show", "demo"]));
    assert!(ok, "{stderr}");
    let room = "external_id = { from = \"arg0\", add = 8 }";
    assert!(shown.contains(room), "{shown}");
    let dir = tempfile::tempdir().expect("temp dir");
    let profile = dir.path().join("unreadable-room.toml");
    std::fs::write(&profile, shown.replace(room, "external_id = { from = \"arg0\", deref = [0] }")).expect("profile");

    let mut demo = Demo::start(&["--rate", "1000", "--requests", "300", "--duration", "10s"]);
    let agent = Agent::watch(demo.proc.pid(), profile.to_str().expect("utf-8 path"), "1s", &[]);
    demo.go();
    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(30));
    let summary = summary(&agent_lines);
    assert_eq!(summary["lost_events"], 0, "an event delivered without its external id is not lost: {summary}");
    assert_eq!(summary["completed"], 300, "every lifecycle was followed: {summary}");
    assert_eq!(summary["ext_unreadable"], 300, "{summary}");
    assert_eq!(summary["key_unreadable"], 0, "{summary}");
    let _ = demo.proc.wait(Duration::from_secs(5));
}

/// The programs wake the agent only past a fill level of the ring buffer;
/// it reads the rest on its tick. At the demo's highest rate a 500 ms tick
/// would let the 4 MiB buffer overflow many times over: the forced wakeup
/// keeps every event, and the stalls among them are still reported on time.
#[test]
fn at_the_highest_rate_nothing_is_lost_and_stalls_are_on_time() {
    let (mut demo, agent) = watched_with(
        &[
            // More than it can do: as fast as it goes.
            "--rate",
            "1000000000",
            "--duration",
            "4s",
            "--inject-after",
            "500ms",
            "--waiting-for-peer",
            "1",
            "--transfer-hung",
            "1",
            "--release-lost",
            "1",
        ],
        "2s",
        &["--tick", "500ms"],
    );
    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(30));
    let demo_lines = demo.proc.lines_until_exit(Duration::from_secs(5));
    let injected = injected(&demo_lines);
    assert_eq!(injected.len(), 3, "demo said: {demo_lines:?}");
    let seen = stalls_on_time(&agent_lines, &injected, TIMEOUT);
    assert_eq!(seen.len(), 3, "every injected request stalls: {agent_lines:?}");

    let done = demo_lines.iter().filter_map(Line::json).find(|v| v["event"] == "done").expect("demo done line");
    let healthy = done["healthy"].as_u64().expect("healthy");
    let summary = summary(&agent_lines);
    assert_eq!(summary["lost_events"], 0, "{summary}");
    assert_eq!(summary["seen"], healthy + 3, "every request seen: {summary}, {done}");
    assert_eq!(summary["completed"], healthy, "{summary}");
    // Four events a request, over 4 s: more per 500 ms tick than the
    // buffer holds (about 35 000), or this would not test the wakeup.
    let per_tick = healthy * 4 / 8;
    assert!(per_tick > 35_000, "the demo ran too slowly to test this: {per_tick} events a tick, {done}");
    let _ = demo.proc.wait(Duration::from_secs(5));
}

/// A profile's `[[signal]]` tables: every hit reaches the agent with the
/// value and the string or raw bytes it read, and none is a lifecycle
/// (the requests it probes are followed as before, none stalls).
#[test]
fn signal_probes_deliver_their_value_and_capture_without_touching_lifecycles() {
    require_root();
    let demo_profile = String::from_utf8(
        Command::new(agent_bin()).args(["profile", "show", "demo"]).output().expect("profile show").stdout,
    )
    .expect("utf-8 profile");
    // prefill_enqueue(const Request *req): the id at offset 0, the room
    // string inlined at 8; the same function as the `enqueued` probe.
    let profile = format!(
        "{demo_profile}\n[[signal]]\nname = \"room_text\"\nsymbol = \"prefill_enqueue\"\nat = \"entry\"\n\
         value = {{ from = \"arg0\", deref = [0] }}\ntext = {{ from = \"arg0\", add = 8 }}\n\n\
         [[signal]]\nname = \"room_bytes\"\nsymbol = \"prefill_enqueue\"\nat = \"entry\"\n\
         value = {{ from = \"arg0\", deref = [0] }}\nbytes = {{ from = \"arg0\", add = 8 }}\n"
    );
    let path = std::env::temp_dir().join(format!("stallwatch-signal-{}.toml", std::process::id()));
    std::fs::write(&path, profile).expect("writing the profile");
    let mut demo = Demo::start(&["--rate", "200", "--duration", "3s"]);
    let agent = Agent::on_pid(demo.proc.pid())
        .profile(path.to_str().expect("utf-8 path"))
        .timeout("1s")
        .env(&[("STALLWATCH_LOG", "stallwatch=debug")])
        .watch();
    demo.go();
    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(30));
    let _ = std::fs::remove_file(&path);
    let stderr = agent.proc.stderr();
    let field = |line: &str, name: &str| {
        let at = line.find(&format!(" {name}="))? + name.len() + 2;
        line[at..].split(' ').next().map(str::to_owned)
    };
    let mut texts = 0;
    let mut raw = 0;
    for line in stderr.lines().filter(|l| l.contains(" signal ") || l.ends_with(" signal")) {
        let value = field(line, "value").unwrap_or_else(|| panic!("no value: {line}"));
        let id = u64::from_str_radix(value.trim_start_matches("0x"), 16).unwrap_or_else(|_| panic!("{line}"));
        let capture = field(line, "capture").unwrap_or_else(|| panic!("no capture: {line}"));
        match field(line, "name").as_deref() {
            Some("room_text") => {
                assert_eq!(capture, format!("room-{id}"), "{line}");
                texts += 1;
            }
            Some("room_bytes") => {
                // 64 raw bytes: the room's text, then its NUL padding.
                let want: String = format!("room-{id}").bytes().map(|b| format!("{b:02x}")).collect();
                assert!(capture.len() == 128 && capture.starts_with(&format!("{want}00")), "{line}");
                raw += 1;
            }
            other => panic!("a signal of no profile table ({other:?}): {line}"),
        }
    }
    let summary = summary(&agent_lines);
    let seen = summary["seen"].as_u64().expect("seen");
    assert!(seen >= 100, "{summary}");
    assert_eq!((texts, raw), (seen, seen), "one signal of each kind per request:\n{stderr}");
    assert_eq!(summary["completed"], seen, "signals are no lifecycles: {summary}");
    assert_eq!(alerts(&agent_lines, "stalled").count(), 0, "{agent_lines:?}");
    let _ = demo.proc.wait(Duration::from_secs(5));
}
