//! The SGLang test target (tests/sglang: SGLang's real prefill flow, real
//! NIXL over UCX, real ZMQ) watched by the real agent.
//!
//! With the `nixl` profile these assert only what is right already (a
//! hung transfer `transfer_hung`, one to a dead decode `failed`) and one
//! thing it gets wrong, a false `release_lost` for the last handles of
//! every worker that goes idle. The `sglang` profile follows SGLang's rooms
//! from its bootstrap ZMQ traffic and attributes the handles to them: each
//! seeded fault with a native signal is reported on its room, with its
//! class and what it waits on, and a healthy run raises nothing.
//!
//! With the target marking its rooms' stages through the marker library
//! (`--marker`) and the `marker` profile, every seeded fault is reported
//! with its room, and a healthy run with idle workers raises nothing.
use std::{
    collections::HashMap,
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Line, Proc, agent_bin, alerts, marker_lib,
    otlp::{Collector, Span, expected_trace_id},
    require_root, root, run_to_end, summary, test_socket, venv_python, wait_for,
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// The `marker` profile's runs: marks have no polling to wait out.
const MARKED_TIMEOUT: Duration = Duration::from_secs(1);
const LATENESS: Duration = Duration::from_secs(1);

/// prefill.py (and its decode.py ranks), set up and waiting for `go`.
struct Target {
    proc: Proc,
    prefill: u32,
    fault_room: u64,
    lines: Vec<Line>,
}

impl Target {
    fn start(fault: &str, extra: &[&str]) -> Self {
        require_root();
        let proc = Proc::spawn(
            "sglang prefill",
            Command::new(venv_python())
                .arg(root().join("tests/sglang/prefill.py"))
                .args(["--fault", fault, "--count", "12", "--events", "--max-seconds", "60"])
                .args(extra),
        );
        let ready = proc.next_line(Duration::from_secs(30), "ready line");
        let value = ready.json().unwrap_or_else(|| panic!("prefill said: {}", ready.text));
        assert_eq!(value["event"], "ready", "{value}");
        let prefill = value["prefill_pid"].as_u64().expect("prefill_pid") as u32;
        let fault_room = value["fault_room"].as_u64().unwrap_or(0);
        Self { proc, prefill, fault_room, lines: vec![ready] }
    }

    /// Attach the agent (`profile`, 2 s), then let the target run.
    fn watched(fault: &str, profile: &str, extra: &[&str], agent_extra: &[&str]) -> (Self, Agent) {
        let mut target = Self::start(fault, extra);
        let agent = Agent::watch(target.prefill, profile, "2s", agent_extra);
        target.proc.write_line("go");
        (target, agent)
    }

    /// Every room the target requested.
    fn rooms_requested(&self) -> Vec<u64> {
        let rooms = self.lines.iter().filter_map(|line| {
            let value = line.json()?;
            (value["event"] == "request").then(|| value["room"].as_u64().expect("room"))
        });
        rooms.collect()
    }

    /// The target marking its rooms (`--marker`), the agent on the
    /// `marker` profile (1 s).
    fn marked(fault: &str, extra: &[&str]) -> (Self, Agent) {
        let lib = marker_lib();
        let mut args = vec!["--marker", lib.to_str().expect("utf-8 marker path")];
        args.extend_from_slice(extra);
        let mut target = Self::start(fault, &args);
        let agent = Agent::watch(target.prefill, "marker", "1s", &[]);
        target.proc.write_line("go");
        (target, agent)
    }

    /// When the target last marked `room`: its marks precede its `request`
    /// line (enqueued) and its first `chunk` line (transfer_posted).
    fn last_mark(&self, room: u64) -> Instant {
        self.lines
            .iter()
            .filter(|line| {
                line.json().is_some_and(|v| {
                    v["room"] == room && (v["event"] == "request" || (v["event"] == "chunk" && v["chunk"] == 0))
                })
            })
            .map(|line| line.at)
            .max()
            .unwrap_or_else(|| panic!("room {room} was never requested: {:?}", self.lines))
    }

    /// Read lines until one with `event`.
    fn until(&mut self, event: &str, within: Duration) -> Value {
        self.proc.until_event(event, within, &mut self.lines)
    }

    /// The transfers created for `room`: handle (as the agent prints it) ->
    /// when the line was seen.
    fn transfers(&self, room: u64) -> HashMap<String, Instant> {
        self.lines
            .iter()
            .filter_map(|line| {
                let value = line.json()?;
                (value["event"] == "xfer" && value["room"] == room).then(|| {
                    let handle = value["handle"].as_str().expect("handle").trim_start_matches("0x");
                    (format!("{:#x}", u64::from_str_radix(handle, 16).expect("hex handle")), line.at)
                })
            })
            .collect()
    }
}

#[test]
fn a_transfer_hung_on_a_stopped_decode_is_transfer_hung() {
    let (mut target, agent) = Target::watched("hang", "nixl", &[], &[]);
    let holding = target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    assert_eq!(holding["rooms"][room.to_string()], "transferring", "{holding}");
    let hung = target.transfers(room);
    assert_eq!(hung.len(), 1, "one chunk posted before the stall: {hung:?}");
    let mut seen = Vec::new();
    agent.wait_until("a transfer_hung alert", TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").any(|(_, a)| a["class"] == "transfer_hung")
    });
    let stalls: Vec<(Instant, Value)> =
        alerts(&seen, "stalled").filter(|(_, a)| a["class"] == "transfer_hung").collect();
    assert_eq!(stalls.len(), 1, "{seen:?}");
    let (at, alert) = &stalls[0];
    let key = alert["key"].as_str().expect("key");
    let posted = hung.get(key).unwrap_or_else(|| panic!("hung transfer not one of room {room}'s: {alert}"));
    assert_eq!(alert["stage"], "transfer_posted", "{alert}");
    let latency = at.duration_since(*posted);
    assert!(
        latency >= TIMEOUT - Duration::from_millis(50) && latency <= TIMEOUT + LATENESS,
        "{alert} after {latency:?}"
    );
}

/// The `decode-dies` seed under `profile`, run until the target holds (its
/// fault room failed in the target): the target, the agent, and when the
/// decode was killed.
fn decode_died(profile: &str) -> (Target, Agent, Instant) {
    let (mut target, agent) = Target::watched("decode-dies", profile, &[], &[]);
    target.until("decode_killed", Duration::from_secs(30));
    let killed_at = target.lines.last().expect("the decode_killed line").at;
    let holding = target.until("holding", Duration::from_secs(30));
    assert_eq!(holding["rooms"][target.fault_room.to_string()], "failed", "{holding}");
    (target, agent, killed_at)
}

#[test]
fn a_transfer_to_a_decode_that_died_is_failed() {
    let (target, agent, killed_at) = decode_died("nixl");
    let room = target.fault_room;
    let transfers = target.transfers(room);
    let mut seen = Vec::new();
    agent.wait_until("a failed alert", Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "failed").next().is_some()
    });
    let failed: Vec<(Instant, Value)> = alerts(&seen, "failed").collect();
    assert_eq!(failed.len(), 1, "{seen:?}");
    let (at, alert) = &failed[0];
    let key = alert["key"].as_str().expect("key");
    assert!(transfers.contains_key(key), "failed transfer not one of room {room}'s {transfers:?}: {alert}");
    // Seen from the post's error, or read from the handle once its
    // silence reaches the timeout: within timeout + 1 s either way.
    let latency = at.duration_since(killed_at);
    assert!(latency <= TIMEOUT + LATENESS, "{alert} after {latency:?}");
}

/// What the `sglang` profile fixes: on a healthy run whose idle workers
/// hold their last handles (done, never released), the `nixl` profile
/// raises `release_lost` for them (the control that shows the healthy run
/// below has such handles to get wrong).
#[test]
fn the_nixl_profile_raises_release_lost_for_the_handles_of_idle_workers() {
    let (mut target, agent) = Target::watched("none", "nixl", &["--hold"], &[]);
    let done = target.until("done", Duration::from_secs(30));
    assert_eq!(done["completed"], 12, "{done}");
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    let lost = alerts(&lines, "stalled").filter(|(_, a)| a["class"] == "release_lost").count();
    assert!(lost >= 1, "no release_lost: {lines:?}");
    assert_eq!(alerts(&lines, "stalled").count(), lost, "{lines:?}");
}

/// The lines that are alerts (not the summary).
fn alert_lines(lines: &[Line]) -> Vec<&Line> {
    lines.iter().filter(|l| l.json().is_some_and(|v| v["alert"] != "summary")).collect()
}

/// Waits for `expected.len()` stalls and checks each: the room as external
/// id and key, the class, within timeout + 1 s of the room's last mark;
/// then that nothing else stalls.
fn assert_marked_stalls(target: &Target, agent: Agent, expected: &[(u64, &str)]) -> Vec<Line> {
    let mut seen = Vec::new();
    let stalls = agent.wait_alerts("stalled", expected.len(), MARKED_TIMEOUT + Duration::from_secs(5), &mut seen);
    for (at, alert) in &stalls {
        let room =
            alert["external_id"].as_str().expect("every marked stall has its room").parse::<u64>().expect("room");
        let (_, class) =
            expected.iter().find(|(r, _)| *r == room).unwrap_or_else(|| panic!("unexpected stall: {alert}"));
        assert_eq!(alert["class"], *class, "{alert}");
        assert_eq!(alert["key"], format!("{room:#x}").as_str(), "{alert}");
        let latency = at.duration_since(target.last_mark(room));
        assert!(
            latency >= MARKED_TIMEOUT - Duration::from_millis(50) && latency <= MARKED_TIMEOUT + LATENESS,
            "{alert} after {latency:?}"
        );
    }
    // A second timeout later, still only these.
    std::thread::sleep(MARKED_TIMEOUT);
    seen.extend(agent.stop());
    assert_eq!(alerts(&seen, "stalled").count(), expected.len(), "{seen:?}");
    seen
}

#[test]
fn marked_healthy_run_with_idle_workers_raises_no_alert() {
    let (mut target, agent) = Target::marked("none", &["--hold"]);
    let done = target.until("done", Duration::from_secs(30));
    assert_eq!(done["completed"], 12, "{done}");
    assert_eq!(done["verified"], 12, "{done}");
    // Two timeouts of idle workers holding finished handles.
    std::thread::sleep(MARKED_TIMEOUT * 2);
    let lines = agent.stop();
    let alert_lines: Vec<&Line> = lines.iter().filter(|l| l.json().is_some_and(|v| v["alert"] != "summary")).collect();
    assert!(alert_lines.is_empty(), "a healthy run raised alerts: {alert_lines:?}");
    let summary = summary(&lines);
    assert_eq!(summary["seen"], 12, "{summary}");
    assert_eq!(summary["completed"], 12, "{summary}");
    assert_eq!(summary["lost_events"], 0, "{summary}");
}

#[test]
fn marked_room_whose_decode_never_answers_is_waiting_for_peer() {
    let (mut target, agent) = Target::marked("no-answer", &[]);
    let holding = target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    assert_eq!(holding["rooms"][room.to_string()], "bootstrapping", "{holding}");
    assert_marked_stalls(&target, agent, &[(room, "waiting_for_peer")]);
}

#[test]
fn marked_rooms_of_a_decode_that_died_are_failed_and_waiting_for_peer() {
    let (mut target, agent) = Target::marked("decode-dies", &[]);
    let holding = target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    let unanswered: Vec<u64> = holding["rooms"]
        .as_object()
        .expect("rooms")
        .iter()
        .filter(|(_, state)| *state == "bootstrapping")
        .map(|(r, _)| r.parse().expect("room"))
        .collect();
    assert_eq!(unanswered.len(), 2, "{holding}");
    let expected: Vec<(u64, &str)> = unanswered.iter().map(|r| (*r, "waiting_for_peer")).collect();
    let seen = assert_marked_stalls(&target, agent, &expected);
    let failed: Vec<Value> = alerts(&seen, "failed").map(|(_, v)| v).collect();
    assert_eq!(failed.len(), 1, "{seen:?}");
    assert_eq!(failed[0]["external_id"], room.to_string().as_str(), "{}", failed[0]);
}

#[test]
fn marked_hung_room_and_the_rooms_queued_behind_it_are_all_reported() {
    let (mut target, agent) = Target::marked("hang", &[]);
    let holding = target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    let worker = &holding["workers"][0];
    assert_eq!(worker["on"], room, "{holding}");
    // The rooms queued behind the hung one (the healthy decode's among
    // them) were handed to the worker: transfer_hung, like the room it is
    // stuck on; the stopped decode's later rooms were never answered.
    let mut expected = vec![(room, "transfer_hung")];
    for (r, state) in holding["rooms"].as_object().expect("rooms") {
        let r: u64 = r.parse().expect("room");
        match state.as_str() {
            Some("queued") => expected.push((r, "transfer_hung")),
            Some("bootstrapping") => expected.push((r, "waiting_for_peer")),
            _ => {}
        }
    }
    assert!(expected.iter().filter(|(_, c)| *c == "transfer_hung").count() >= 3, "{holding}");
    assert_marked_stalls(&target, agent, &expected);
}

#[test]
fn marked_abort_racing_a_chunk_ends_the_room_aborted() {
    let (mut target, agent) = Target::marked("abort", &[]);
    let holding = target.until("holding", Duration::from_secs(30));
    assert_eq!(holding["rooms"][target.fault_room.to_string()], "failed", "{holding}");
    std::thread::sleep(MARKED_TIMEOUT * 2);
    let lines = agent.stop();
    assert_eq!(alerts(&lines, "stalled").count(), 0, "{lines:?}");
    let summary = summary(&lines);
    assert_eq!(summary["aborted"], 1, "{summary}");
    assert_eq!(summary["completed"], 11, "{summary}");
    assert_eq!(summary["in_flight"], 0, "{summary}");
}

/// A room's request span: keyed by the room, `bootstrap_room` and the
/// room's trace id (as the decode side's agent derives it).
fn room_span(spans: &[Span], room: u64) -> Option<&Span> {
    spans.iter().find(|span| {
        span.name == "stallwatch.request" && span.attr("stallwatch.request.key") == Some(&format!("{room:#x}"))
    })
}

fn assert_room_span(span: &Span, room: u64) {
    assert_eq!(span.attr("bootstrap_room"), Some(room.to_string().as_str()), "{span:?}");
    assert_eq!(span.attr("stallwatch.request.external_id"), Some(room.to_string().as_str()), "{span:?}");
    assert_eq!(span.trace_id, expected_trace_id(&room.to_string()), "{span:?}");
}

/// The `sglang` profile's stalls, each about a room: keyed by it, the
/// room as external id, its class, within timeout + 1 s of `since(room)`.
/// Returns the alert of each room, in the order of `expected`.
fn assert_room_stalls(seen: &[Line], expected: &[(u64, &str)], since: impl Fn(u64) -> Instant) -> Vec<Value> {
    let stalls: Vec<(Instant, Value)> = alerts(seen, "stalled").collect();
    assert_eq!(stalls.len(), expected.len(), "expected stalls of rooms {expected:?}: {seen:?}");
    let mut found = Vec::new();
    for (room, class) in expected {
        let (at, alert) = stalls
            .iter()
            .find(|(_, a)| a["key"] == format!("{room:#x}").as_str())
            .unwrap_or_else(|| panic!("room {room} not alerted: {seen:?}"));
        assert_eq!(alert["external_id"], room.to_string().as_str(), "{alert}");
        assert_eq!(alert["class"], *class, "{alert}");
        let latency = at.duration_since(since(*room));
        assert!(
            latency >= TIMEOUT - Duration::from_millis(50) && latency <= TIMEOUT + LATENESS,
            "{alert} after {latency:?}"
        );
        found.push(alert.clone());
    }
    found
}

#[test]
fn sglang_profile_healthy_run_with_idle_workers_raises_nothing_and_spans_every_room() {
    let mut collector = Collector::start();
    let endpoint = collector.http_endpoint();
    let (mut target, agent) = Target::watched("none", "sglang", &["--hold"], &["--otlp-endpoint", &endpoint]);
    let done = target.until("done", Duration::from_secs(30));
    assert_eq!((done["completed"].as_u64(), done["verified"].as_u64()), (Some(12), Some(12)), "{done}");
    let rooms = target.rooms_requested();
    assert_eq!(rooms.len(), 12, "{:?}", target.lines);
    // Two timeouts of idle workers holding their last handles, done and
    // never released (the `nixl` profile's false `release_lost`, above).
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    let raised = alert_lines(&lines);
    assert!(raised.is_empty(), "a healthy run raised alerts: {raised:?}");
    let summary = summary(&lines);
    assert_eq!((summary["in_flight"].as_u64(), summary["lost_events"].as_u64()), (Some(0), Some(0)), "{summary}");
    let spans = collector.wait_for(Duration::from_secs(5), "a span per room", |spans| {
        rooms.iter().all(|r| room_span(spans, *r).is_some())
    });
    for room in &rooms {
        let span = room_span(&spans, *room).expect("room span");
        assert_room_span(span, *room);
        assert_eq!(span.attr("stallwatch.request.outcome"), Some("released"), "{span:?}");
    }
    let _ = collector.stop();
}

#[test]
fn sglang_profile_ends_an_aborted_room_aborted_and_raises_nothing() {
    let mut collector = Collector::start();
    let endpoint = collector.http_endpoint();
    let (mut target, agent) = Target::watched("abort", "sglang", &[], &["--otlp-endpoint", &endpoint]);
    let holding = target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    assert_eq!(holding["rooms"][room.to_string()], "failed", "{holding}");
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    // The aborted room's chunk finished and stays with its idle worker:
    // complete at done, as any other handle.
    let raised = alert_lines(&lines);
    assert!(raised.is_empty(), "{raised:?}");
    assert_eq!(summary(&lines)["aborted"], 1, "{lines:?}");
    let spans =
        collector.wait_for(Duration::from_secs(5), "the aborted room's span", |spans| room_span(spans, room).is_some());
    let span = room_span(&spans, room).expect("room span");
    assert_room_span(span, room);
    assert_eq!(span.attr("stallwatch.request.outcome"), Some("aborted"), "{span:?}");
    let _ = collector.stop();
}

/// Two decode ranks per room, one of which never sends the fault room's
/// destination: the room is enqueued at the other's and reported
/// `waiting_for_peer`, saying one rank of two answered.
#[test]
fn sglang_profile_reports_a_room_whose_decode_rank_never_answers_waiting_for_peer() {
    let mut collector = Collector::start();
    let endpoint = collector.http_endpoint();
    let (mut target, agent) =
        Target::watched("no-answer", "sglang", &["--peers", "2"], &["--otlp-endpoint", &endpoint]);
    let holding = target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    assert_eq!(holding["rooms"][room.to_string()], "bootstrapping", "{holding}");
    let mut seen = Vec::new();
    agent.wait_until("a stall", TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").next().is_some()
    });
    std::thread::sleep(TIMEOUT);
    seen.extend(agent.stop());
    let [alert] = &assert_room_stalls(&seen, &[(room, "waiting_for_peer")], |r| target.last_mark(r))[..] else {
        unreachable!()
    };
    assert_eq!(
        (alert["stage"].as_str(), alert["answered"].as_str(), alert["waiting_on"].as_str()),
        (Some("enqueued"), Some("1/2"), Some("peer")),
        "{alert}"
    );
    assert_eq!(alert_lines(&seen).len(), 1, "{seen:?}");
    // Its stall span says so too.
    let spans = collector.wait_for(Duration::from_secs(5), "the room's stall span", |spans| {
        spans
            .iter()
            .any(|s| s.name == "stallwatch.stall" && s.attr("stallwatch.request.key") == Some(&format!("{room:#x}")))
    });
    let stall = spans.iter().find(|s| s.name == "stallwatch.stall").expect("stall span");
    assert_eq!(
        (stall.attr("stallwatch.sglang.answered"), stall.attr("stallwatch.sglang.waiting_on")),
        (Some("1/2"), Some("peer")),
        "{stall:?}"
    );
    assert_eq!(stall.attr("bootstrap_room"), Some(room.to_string().as_str()), "{stall:?}");
    let _ = collector.stop();
}

/// The agent keeps the rooms it follows in the kernel's in-flight table,
/// as the kernel keeps the probes' lifecycles: a room waiting on its peer
/// when the agent is SIGKILLed is taken over by the next agent and
/// reported there, once, when its timeout is up (counted from the room's
/// own last event, before either agent's restart).
#[test]
fn sglang_profile_rooms_in_flight_survive_an_agent_restart() {
    const LONGER: Duration = Duration::from_secs(5);
    let mut target = Target::start("no-answer", &["--peers", "2"]);
    let mut first = Agent::watch(target.prefill, "sglang", "5s", &[]);
    target.proc.write_line("go");
    target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    let since = target.last_mark(room);
    assert!(
        since.elapsed() < LONGER - Duration::from_secs(1),
        "the room is still short of its timeout: {:?}",
        since.elapsed()
    );
    let before = first.proc.lines_now();
    assert_eq!(alert_lines(&before).len(), 0, "{before:?}");
    // Killed as a crash would; the next agent takes its bpf directory over.
    let dir = first.bpf_dir.take().expect("its own bpf directory");
    first.proc.signal(libc::SIGKILL);
    let _ = first.proc.wait(Duration::from_secs(5));
    let mut second = Agent::watch(target.prefill, "sglang", "5s", &["--bpf-dir", dir.to_str().expect("utf-8 bpf dir")]);
    second.bpf_dir = Some(dir);
    second.proc.wait_stderr("took over the requests in flight", Duration::from_secs(10));
    let mut seen = Vec::new();
    second.wait_until("the room's stall", LONGER + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").next().is_some()
    });
    std::thread::sleep(Duration::from_secs(1));
    seen.extend(second.stop());
    let stalls: Vec<(Instant, Value)> = alerts(&seen, "stalled").collect();
    let [(at, alert)] = &stalls[..] else { panic!("one stall, the room's: {seen:?}") };
    assert_eq!(
        (alert["key"].as_str(), alert["external_id"].as_str()),
        (Some(format!("{room:#x}").as_str()), Some(room.to_string().as_str())),
        "{alert}"
    );
    assert_eq!(
        (alert["class"].as_str(), alert["stage"].as_str()),
        (Some("waiting_for_peer"), Some("enqueued")),
        "{alert}"
    );
    // What it waits on died with the first agent.
    assert!(alert["answered"].is_null() && alert["waiting_on"].is_null(), "{alert}");
    let latency = at.duration_since(since);
    assert!(latency >= LONGER - Duration::from_millis(50) && latency <= LONGER + LATENESS, "{alert} after {latency:?}");
}

#[test]
fn sglang_profile_fails_the_room_of_a_decode_that_died() {
    let (target, agent, killed_at) = decode_died("sglang");
    let room = target.fault_room;
    let mut seen = Vec::new();
    agent.wait_until("a failed alert", TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "failed").next().is_some()
    });
    std::thread::sleep(TIMEOUT);
    seen.extend(agent.stop());
    let failed: Vec<(Instant, Value)> = alerts(&seen, "failed").collect();
    assert_eq!(failed.len(), 1, "{seen:?}");
    let (at, alert) = &failed[0];
    assert_eq!(alert["key"], format!("{room:#x}").as_str(), "{alert}");
    assert_eq!(alert["external_id"], room.to_string().as_str(), "{alert}");
    let latency = at.duration_since(killed_at);
    assert!(latency <= TIMEOUT + LATENESS, "{alert} after {latency:?}");
    // Its 2 later rooms were never answered: with one rank a room, no
    // native signal (the marker's case); nothing else is raised.
    assert_eq!(alert_lines(&seen).len(), 1, "{seen:?}");
}

#[test]
fn sglang_profile_alerts_a_hung_transfer_on_its_room_and_the_rooms_queued_behind_it() {
    let socket = test_socket();
    let socket = socket.to_str().expect("utf-8 socket path");
    let (mut target, agent) = Target::watched("hang", "sglang", &[], &["--socket", socket]);
    let holding = target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    assert_eq!(holding["rooms"][room.to_string()], "transferring", "{holding}");
    let hung = target.transfers(room);
    assert_eq!(hung.len(), 1, "one chunk posted before the stall: {hung:?}");
    let (handle, posted) = hung.iter().next().expect("the hung transfer");
    // The rooms queued behind it on its worker: their destinations arrived,
    // the worker never got to them.
    let queued: Vec<u64> = holding["rooms"]
        .as_object()
        .expect("rooms")
        .iter()
        .filter(|(_, state)| *state == "queued")
        .map(|(r, _)| r.parse().expect("room"))
        .collect();
    assert!(queued.len() >= 3, "{holding}");
    let mut seen = Vec::new();
    agent.wait_until("the stalls", TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").count() > queued.len()
    });
    // `stallwatch inflight` says where each stands, as the alerts do.
    let (ok, answer, stderr) = run_to_end(Command::new(agent_bin()).args(["inflight", "--json", "--socket", socket]));
    assert!(ok, "{stderr}");
    let answer: Value = serde_json::from_str(&answer).expect("inflight --json");
    let row = |r: u64| -> Value {
        let rows = answer["requests"].as_array().expect("requests");
        rows.iter()
            .find(|row| row["key"] == format!("{r:#x}").as_str())
            .cloned()
            .unwrap_or_else(|| panic!("room {r} not in flight: {answer}"))
    };
    assert_eq!(row(room)["context"], serde_json::json!({"handle": handle.as_str(), "transfer": "1"}), "{answer}");
    for r in &queued {
        assert_eq!(row(*r)["context"]["waiting_on"], "worker", "{answer}");
    }
    // A second timeout later: each alerted once, nothing else.
    std::thread::sleep(TIMEOUT);
    seen.extend(agent.stop());
    let mut expected = vec![(room, "transfer_hung")];
    expected.extend(queued.iter().map(|r| (*r, "waiting_for_peer")));
    let found = assert_room_stalls(&seen, &expected, |r| if r == room { *posted } else { target.last_mark(r) });
    let hung_alert = &found[0];
    assert_eq!(hung_alert["stage"], "transfer_posted", "{hung_alert}");
    assert_eq!(
        (hung_alert["handle"].as_str(), hung_alert["transfer"].as_str()),
        (Some(handle.as_str()), Some("1")),
        "{hung_alert}"
    );
    for alert in &found[1..] {
        assert_eq!(alert["stage"], "enqueued", "{alert}");
        let waits = (alert["answered"].as_str(), alert["behind"].as_str(), alert["waiting_on"].as_str());
        assert_eq!(waits, (Some("1/1"), Some(room.to_string().as_str()), Some("worker")), "{alert}");
    }
    assert_eq!(alert_lines(&seen).len(), expected.len(), "{seen:?}");
}

/// The hang fault with every decode on its own worker
/// (`--no-hang-shared-worker`): the stopped decode's transfer hangs while
/// the other decode's rooms keep transferring and complete. Returns the
/// stopped decode's NIXL agent name (from the `ready` line) and the
/// `holding` line, checked: the fault room transferring, a room of the
/// other decode requested after it completed.
fn one_peer_stopped(target: &mut Target) -> (String, Value) {
    let stopped = target.until("decode_stopped", Duration::from_secs(30));
    let index = stopped["decode"].as_u64().expect("decode index");
    let ready = target.lines[0].json().expect("the ready line");
    let decodes = ready["decodes"].as_array().expect("decodes");
    let agent = decodes
        .iter()
        .find(|d| d["index"] == index)
        .and_then(|d| d["agent"].as_str())
        .expect("the stopped decode's agent");
    let holding = target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    assert_eq!(holding["rooms"][room.to_string()], "transferring", "{holding}");
    let healthy_after: Vec<u64> = target
        .lines
        .iter()
        .filter_map(|line| line.json())
        .filter(|v| v["event"] == "request" && v["room"].as_u64() > Some(room) && v["decodes"][0] != index)
        .map(|v| v["room"].as_u64().expect("room"))
        .collect();
    assert!(!healthy_after.is_empty(), "no room of the other decode after the fault: {:?}", target.lines);
    for r in &healthy_after {
        assert_eq!(holding["rooms"][r.to_string()], "completed", "room {r} of the healthy decode: {holding}");
    }
    (agent.to_owned(), holding)
}

/// The `transfer_hung` alert whose key is `key`, within timeout + 5 s.
fn hung_alert(agent: Agent, key: &str) -> Value {
    let mut seen = Vec::new();
    let is_it = |a: &Value| a["class"] == "transfer_hung" && a["key"] == key;
    agent.wait_until("the hung transfer's transfer_hung alert", TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").any(|(_, a)| is_it(&a))
    });
    seen.extend(agent.stop());
    alerts(&seen, "stalled").map(|(_, a)| a).find(is_it).expect("the alert")
}

#[test]
fn sglang_profile_blames_the_stopped_peer_while_the_other_peer_completes() {
    let (mut target, agent) = Target::watched("hang", "sglang", &["--no-hang-shared-worker"], &[]);
    let (stopped, _) = one_peer_stopped(&mut target);
    let room = target.fault_room;
    let alert = hung_alert(agent, &format!("{room:#x}"));
    let transport = &alert["transport"];
    assert_eq!(transport["peer"], stopped.as_str(), "{alert}");
    assert_eq!(transport["verdict"], "peer_unresponsive", "{alert}");
    assert_eq!(transport["completion"]["to_peer"], 0, "{alert}");
    assert!(
        transport["completion"]["to_other_peers"].as_u64() > Some(0),
        "the other decode's transfers complete: {alert}"
    );
    let summary = transport["summary"].as_str().expect("summary");
    assert!(summary.contains(&format!("none to {stopped} completed")), "{alert}");
}

/// The control: the same run shape judged per process (the `nixl`
/// profile names no peer) reads the hung transfer as the one request
/// stuck among others completing, which the test above shows is wrong.
#[test]
fn per_process_the_same_hang_reads_others_completing() {
    let (mut target, agent) = Target::watched("hang", "nixl", &["--no-hang-shared-worker"], &[]);
    one_peer_stopped(&mut target);
    let hung = target.transfers(target.fault_room);
    assert_eq!(hung.len(), 1, "one chunk posted before the stall: {hung:?}");
    let (handle, _) = hung.iter().next().expect("the hung transfer");
    let alert = hung_alert(agent, handle);
    assert!(alert["transport"]["peer"].is_null(), "{alert}");
    assert_eq!(alert["transport"]["verdict"], "others_completing", "{alert}");
}

/// `profile check --pid` on a process that loaded what SGLang loads
/// (pyzmq's libzmq, NIXL): every probe of the `sglang` profile lands on an
/// instruction the kernel emulates (no single step on SGLang's threads),
/// and a probe on one it must single-step (libc's `usleep` begins with
/// `sub $0x28,%rsp` in Debian 12's build) is said to be.
#[test]
fn every_sglang_probe_lands_on_an_emulated_instruction_and_a_single_stepped_one_is_named() {
    let loaded = Proc::spawn(
        "python with zmq and nixl loaded",
        Command::new(venv_python()).args([
            "-c",
            "import sys, zmq; from nixl_cu12._api import nixl_agent, nixl_agent_config; \
             nixl_agent('check', nixl_agent_config(backends=['UCX'])); print('ready', flush=True); sys.stdin.read()",
        ]),
    );
    // NIXL logs to stdout too.
    wait_for("the ready line", Duration::from_secs(30), || {
        loaded.lines_now().iter().any(|line| line.text == "ready").then_some(())
    });
    let check = |profile: &str| {
        let (ok, out, err) = run_to_end(Command::new(agent_bin()).args([
            "profile",
            "check",
            profile,
            "--pid",
            &loaded.pid().to_string(),
        ]));
        assert!(ok, "profile check {profile}: {err}");
        let points: Vec<String> =
            out.lines().skip_while(|line| *line != "in the process:").skip(1).map(str::to_owned).collect();
        assert!(!points.is_empty(), "{out}");
        points
    };
    let points = check("sglang");
    // 6 lifecycle probes, 7 signals, 8 transport probes.
    assert_eq!(points.len(), 21, "{points:#?}");
    for point in &points {
        assert!(point.contains("(emulated") && !point.contains("single-stepped"), "{point}");
    }
    assert!(
        points.iter().any(|p| p.contains("zmq_msg_data at ") && p.contains("relative branch (emulated")),
        "{points:#?}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let profile = dir.path().join("usleep.toml");
    std::fs::write(&profile, "name = \"usleep\"\n[[probe]]\nobject = \"libc.so.6\"\nsymbol = \"usleep\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n")
        .expect("write profile");
    let points = check(profile.to_str().expect("utf-8 path"));
    assert_eq!(points.len(), 1, "{points:#?}");
    assert!(points[0].contains("usleep at ") && points[0].contains("single-stepped (~30 us a hit)"), "{points:#?}");
}
