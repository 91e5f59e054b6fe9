//! The `marker` and `nixl` profiles on SGLang's own code: tests/sglang/real
//! runs sglang 0.5.23's bootstrap server, NixlKVManager, NixlKVSender and
//! NixlKVReceiver unchanged from the wheel, over real NIXL (UCX on
//! loopback) and real ZMQ (what it supplies instead of a server is listed
//! in its header). The `sglang` profile's own tests are in sglang_real.rs.
//!
//! With the target marking its rooms' stages through the marker library
//! (`--marker`) and the `marker` profile, every seeded fault is reported
//! on its room, and a healthy run with idle workers raises nothing.
//!
//! With the `nixl` profile (transfer handles, no rooms) these assert what
//! it gets right on SGLang (a hung transfer `transfer_hung`, one to a dead
//! decode `failed`) and the one thing it gets wrong there, a false
//! `release_lost` for the last handles of every worker that goes idle: the
//! control for what the `sglang` profile fixes.
use std::{
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Line, Proc, agent_bin, alerts, marker_lib, run_to_end,
    sglang::{Ipc, Target},
    summary, venv_python, wait_for,
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// The `marker` profile's runs: marks have no polling to wait out.
const MARKED_TIMEOUT: Duration = Duration::from_secs(1);
const LATENESS: Duration = Duration::from_secs(1);
/// How long the target may take to reach `done` or `holding` once told `go`.
const RUN: Duration = Duration::from_secs(60);

/// The lines that are alerts (not the summary).
fn alert_lines(lines: &[Line]) -> Vec<Value> {
    lines.iter().filter_map(Line::json).filter(|v| v.get("alert").is_some_and(|a| a != "summary")).collect()
}

/// A decode rank SIGSTOPped as its room's chunks go: with the `nixl`
/// profile, the transfer that hangs is one anonymous handle,
/// `transfer_hung`, timed from its post (after the room's first chunk was
/// handed to SGLang's sender; at the latest its last).
#[test]
fn the_nixl_profile_reports_a_transfer_to_a_stopped_decode_transfer_hung() {
    let mut target = Target::start("hang", &[], Ipc::Msgpack);
    let agent = target.watch_and_go("nixl", "2s", &[]);
    target.until("decode_stopped", RUN);
    let holding = target.until("holding", RUN);
    let room = target.fault_room();
    assert_eq!(holding["rooms"][room.to_string()], "inflight", "{holding}");
    let mut seen = Vec::new();
    agent.wait_until("a transfer_hung alert", TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").any(|(_, a)| a["class"] == "transfer_hung")
    });
    let hung: Vec<(Instant, Value)> = alerts(&seen, "stalled").filter(|(_, a)| a["class"] == "transfer_hung").collect();
    let [(at, alert)] = &hung[..] else { panic!("one transfer_hung alert: {seen:?}") };
    assert_eq!(alert["stage"], "transfer_posted", "{alert}");
    let chunks = target.lines.iter().filter(|l| l.json().is_some_and(|v| v["event"] == "chunk" && v["room"] == room));
    let (first, last) = chunks.fold((None, None), |(first, _), l| (first.or(Some(l.at)), Some(l.at)));
    let (first, last) = (first.expect("the room's first chunk"), last.expect("its last"));
    assert!(at.duration_since(first) + Duration::from_millis(50) >= TIMEOUT, "{alert} too early");
    assert!(at.duration_since(last) <= TIMEOUT + LATENESS, "{alert} too late");
}

/// A decode killed once its room is bootstrapped: with the `nixl` profile,
/// the transfer to it is `failed`, once, within timeout + 1 s of the kill.
#[test]
fn the_nixl_profile_reports_a_transfer_to_a_decode_that_died_failed() {
    let mut target = Target::start("decode-dies", &[], Ipc::Msgpack);
    let agent = target.watch_and_go("nixl", "2s", &[]);
    target.until("decode_killed", RUN);
    let killed_at = target.lines.last().expect("the decode_killed line").at;
    let holding = target.until("holding", RUN);
    assert_eq!(holding["rooms"][target.fault_room().to_string()], "failed", "{holding}");
    let mut seen = Vec::new();
    agent.wait_until("a failed alert", TIMEOUT + LATENESS, &mut seen, |seen| alerts(seen, "failed").next().is_some());
    std::thread::sleep(TIMEOUT);
    seen.extend(agent.stop());
    let failed: Vec<(Instant, Value)> = alerts(&seen, "failed").collect();
    let [(at, alert)] = &failed[..] else { panic!("one failed alert: {seen:?}") };
    assert!(at.duration_since(killed_at) <= TIMEOUT + LATENESS, "{alert}");
}

/// What the `sglang` profile fixes: on a healthy run whose idle workers
/// hold their last handles (done, never released), the `nixl` profile
/// raises `release_lost` for them, and nothing else.
#[test]
fn the_nixl_profile_raises_release_lost_for_the_handles_of_idle_workers() {
    let mut target = Target::start("none", &["--hold"], Ipc::Msgpack);
    let agent = target.watch_and_go("nixl", "2s", &[]);
    let done = target.until("done", RUN);
    assert_eq!(done["completed"], 12, "{done}");
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    let lost = alerts(&lines, "stalled").filter(|(_, a)| a["class"] == "release_lost").count();
    assert!(lost >= 1, "no release_lost: {lines:?}");
    assert_eq!(alert_lines(&lines).len(), lost, "{lines:?}");
}

/// The target marking its rooms (`--marker`), the agent on the `marker`
/// profile (1 s), running.
fn marked(fault: &str, extra: &[&str]) -> (Target, Agent) {
    let lib = marker_lib();
    let mut args = vec!["--marker", lib.to_str().expect("utf-8 marker path")];
    args.extend_from_slice(extra);
    let mut target = Target::start(fault, &args, Ipc::Msgpack);
    let agent = target.watch_and_go("marker", "1s", &[]);
    (target, agent)
}

/// When the target last marked `room` before it stalled: it marks
/// `enqueued` just before its `request` line and `transfer_posted` just
/// before its first `chunk` line.
fn last_mark(target: &Target, room: u64) -> Instant {
    let requested = target.at("request", room);
    target.chunk(room, 0).map_or(requested, |posted| posted.max(requested))
}

/// Waits for `expected.len()` stalls and checks each: the room as external
/// id and key, the class, within timeout + 1 s of the room's last mark;
/// then that nothing else stalls a timeout later. The agent's every line.
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
        let latency = at.duration_since(last_mark(target, room));
        assert!(
            latency + Duration::from_millis(50) >= MARKED_TIMEOUT && latency <= MARKED_TIMEOUT + LATENESS,
            "{alert} after {latency:?}"
        );
    }
    std::thread::sleep(MARKED_TIMEOUT);
    seen.extend(agent.stop());
    assert_eq!(alerts(&seen, "stalled").count(), expected.len(), "{seen:?}");
    seen
}

#[test]
fn marked_healthy_run_with_idle_workers_raises_no_alert() {
    let (mut target, agent) = marked("none", &["--hold"]);
    let done = target.until("done", RUN);
    assert_eq!((done["completed"].as_u64(), done["verified"].as_u64()), (Some(12), Some(12)), "{done}");
    // Two timeouts of idle workers holding finished handles.
    std::thread::sleep(MARKED_TIMEOUT * 2);
    let lines = agent.stop();
    assert!(alert_lines(&lines).is_empty(), "a healthy run raised alerts: {lines:?}");
    let summary = summary(&lines);
    let counts = (summary["seen"].as_u64(), summary["completed"].as_u64(), summary["lost_events"].as_u64());
    assert_eq!(counts, (Some(12), Some(12), Some(0)), "{summary}");
}

#[test]
fn marked_room_whose_decode_never_answers_is_waiting_for_peer() {
    let (mut target, agent) = marked("no-answer", &[]);
    let holding = target.until("holding", RUN);
    let room = target.fault_room();
    assert_eq!(holding["rooms"][room.to_string()], "bootstrapping", "{holding}");
    let seen = assert_marked_stalls(&target, agent, &[(room, "waiting_for_peer")]);
    assert_eq!(summary(&seen)["completed"], 11, "{seen:?}");
}

#[test]
fn marked_rooms_of_a_decode_that_died_are_failed_and_waiting_for_peer() {
    let (mut target, agent) = marked("decode-dies", &[]);
    let holding = target.until("holding", RUN);
    let room = target.fault_room();
    assert_eq!(holding["rooms"][room.to_string()], "failed", "{holding}");
    let unanswered = target.rooms_in(&holding, "bootstrapping");
    assert!(!unanswered.is_empty(), "the dead decode's later rooms: {holding}");
    let expected: Vec<(u64, &str)> = unanswered.iter().map(|r| (*r, "waiting_for_peer")).collect();
    let seen = assert_marked_stalls(&target, agent, &expected);
    let failed: Vec<Value> = alerts(&seen, "failed").map(|(_, v)| v).collect();
    let [failed] = &failed[..] else { panic!("one failed alert: {seen:?}") };
    assert_eq!(failed["external_id"], room.to_string().as_str(), "{failed}");
    assert_eq!(summary(&seen)["failed"], 1, "{seen:?}");
}

/// The hung room, the rooms whose chunks SGLang queued behind it on the
/// same worker (posted, as marked: `transfer_hung` too) and the stopped
/// decode's rooms that were never answered (`waiting_for_peer`).
#[test]
fn marked_hung_room_and_the_rooms_queued_behind_it_are_all_reported() {
    let (mut target, agent) = marked("hang", &[]);
    let holding = target.until("holding", RUN);
    let room = target.fault_room();
    assert_eq!(holding["rooms"][room.to_string()], "inflight", "{holding}");
    let posted = |r: u64| target.chunk(r, 0).is_some();
    let live = ["bootstrapping", "forward", "inflight"].iter().flat_map(|state| target.rooms_in(&holding, state));
    let expected: Vec<(u64, &str)> =
        live.map(|r| (r, if posted(r) { "transfer_hung" } else { "waiting_for_peer" })).collect();
    assert!(expected.len() >= 2, "the hung room and the stopped decode's later rooms: {holding}");
    assert_marked_stalls(&target, agent, &expected);
}

/// The prefill aborts a room itself (`sender.abort()`, as its scheduler
/// does on an AbortReq) after its first chunk: marked `aborted`, it ends
/// so, and nothing is alerted.
#[test]
fn marked_prefill_abort_ends_the_room_aborted() {
    let (mut target, agent) = marked("prefill-abort", &["--hold"]);
    target.until("prefill_abort", RUN);
    target.until("done", RUN);
    std::thread::sleep(MARKED_TIMEOUT * 2);
    let lines = agent.stop();
    assert!(alert_lines(&lines).is_empty(), "{lines:?}");
    let summary = summary(&lines);
    let counts = (summary["aborted"].as_u64(), summary["completed"].as_u64(), summary["in_flight"].as_u64());
    assert_eq!(counts, (Some(1), Some(11), Some(0)), "{summary}");
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
        let points: Vec<String> = out
            .lines()
            .skip_while(|line| *line != "in the process:")
            .skip(1)
            .take_while(|line| line.starts_with("  line "))
            .map(str::to_owned)
            .collect();
        assert!(!points.is_empty(), "{out}");
        points
    };
    let points = check("sglang");
    // 7 lifecycle probes (`releaseXferReq` twice: at its entry, where the
    // transfer's status is read, and at its return), 9 signals (2 of them
    // the pickled scheduler messages', 1 a destination's page list read
    // whole), 8 transport probes.
    assert_eq!(points.len(), 24, "{points:#?}");
    for point in &points {
        assert!(point.contains("(emulated") && !point.contains("single-stepped"), "{point}");
    }
    assert!(
        points.iter().any(|p| p.contains("zmq_msg_close at ") && p.contains("relative branch (emulated")),
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
