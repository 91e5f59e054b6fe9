//! SGLang's own code watched by the real agent: tests/sglang/real runs
//! sglang 0.5.23's NixlKVBootstrapServer, NixlKVManager (PREFILL and
//! DECODE), NixlKVSender and NixlKVReceiver, unchanged from the wheel, over
//! real NIXL (UCX on loopback) and real ZMQ, the tokenizer handing each
//! request to the scheduler with SGLang's own `sock_send` / `sock_recv`
//! (what the target supplies instead of a server is listed in its header),
//! in SGLang's process layout: a main process with the bootstrap server and
//! the tokenizer, a scheduler process per prefill rank retitled
//! `sglang::scheduler...` (tests/sglang/real/launcher.py), the prefill's
//! agent attached as the README says (`--lib libnixl.so --cmdline
//! '^sglang::scheduler'`, kept to the target's cgroup as to a pod's).
//!
//! Each seeded stall is asserted on its room: the class, what it waits on,
//! timed within timeout + 1 s of the room's last activity, and nothing else
//! alerted. Both NIXL builds (nixl-cu12 and nixl-cu13, one libnixl.so
//! build id) and both decode shapes (TP1 instances, one TP2 MLA instance
//! with `required_dst_info_num = 2`) run.
use std::{
    collections::HashMap,
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Line, agent_bin, alerts,
    otlp::{Collector, assert_both_sides_stalled_in_the_rooms_trace},
    run_to_end,
    sglang::{Ipc, Target},
    summary, test_socket,
};

const TIMEOUT: Duration = Duration::from_secs(2);
const LATENESS: Duration = Duration::from_secs(1);
/// How far past its due time the agent may judge a stall (its `silent_ms`
/// past the timeout): a few turns of its loop, which never waits on the
/// evidence it gathers near a stall (linking the progress probes takes the
/// kernel from ms to seconds: an RCU grace period).
const JUDGED_WITHIN: Duration = Duration::from_millis(500);

/// The target with the agent on its prefill (the `sglang` profile, 2 s),
/// running; requests as msgpack.
fn watched(fault: &str, extra: &[&str], agent_extra: &[&str]) -> (Target, Agent) {
    watched_with(fault, extra, agent_extra, Ipc::Msgpack)
}

fn watched_with(fault: &str, extra: &[&str], agent_extra: &[&str], ipc: Ipc) -> (Target, Agent) {
    let mut target = Target::start(fault, extra, ipc);
    let agent = target.watch_and_go("sglang", "2s", agent_extra);
    (target, agent)
}

/// The lines that are alerts (not the summary).
fn alert_lines(lines: &[Line]) -> Vec<Value> {
    lines.iter().filter_map(Line::json).filter(|v| v.get("alert").is_some_and(|a| a != "summary")).collect()
}

/// The rooms the target held, by state (`holding`'s `rooms`): how many
/// are in `state`.
fn held(holding: &Value, state: &str) -> u64 {
    let rooms = holding["rooms"].as_object().unwrap_or_else(|| panic!("no rooms: {holding}"));
    rooms.values().filter(|s| *s == state).count() as u64
}

/// The agent's SIGINT summary of a run whose every room the scheduler
/// received: each room one lifecycle (`seen`), and how each ended.
fn assert_counts(lines: &[Line], rooms: usize, completed: u64, stalled: u64, failed: u64, aborted: u64) {
    let summary = summary(lines);
    let counts = ["seen", "completed", "stalled", "failed", "aborted", "lost_events"].map(|k| summary[k].as_u64());
    let expected = [rooms as u64, completed, stalled, failed, aborted, 0].map(Some);
    assert_eq!(counts, expected, "seen, completed, stalled, failed, aborted, lost: {summary}");
}

/// A healthy run of `rooms` rooms: every room followed as one lifecycle,
/// none alerted, for two timeouts after the last (the workers' last
/// handles stay with them, idle).
fn healthy(rooms: u64, extra: &[&str], ipc: Ipc) {
    let count = rooms.to_string();
    let extra: Vec<&str> = ["--count", &count].into_iter().chain(extra.iter().copied()).collect();
    let (mut target, agent) = watched_with("none", &extra, &[], ipc);
    let done = target.until("done", Duration::from_secs(120));
    assert_eq!((done["completed"].as_u64(), done["verified"].as_u64()), (Some(rooms), Some(rooms)), "{done}");
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    let raised = alert_lines(&lines);
    assert!(raised.is_empty(), "a healthy run raised alerts: {raised:?}");
    // The rooms, each one lifecycle: no handle of theirs counted apart.
    assert_eq!(target.rooms().len() as u64, rooms);
    assert_counts(&lines, target.rooms().len(), rooms, 0, 0, 0);
    assert_eq!(summary(&lines)["in_flight"], 0, "{lines:?}");
    // Each probe's hits, for traps per room (`--nocapture`).
    eprintln!("summary: {}", summary(&lines));
}

#[test]
fn healthy_tp1_and_tp2_rooms_on_nixl_cu13_raise_nothing_and_are_one_lifecycle_each() {
    healthy(12, &["--decode-shape", "mixed", "--nixl", "cu13"], Ipc::Msgpack);
}

#[test]
fn healthy_tp1_rooms_on_nixl_cu12_with_pickled_requests_raise_nothing_and_are_one_lifecycle_each() {
    healthy(12, &["--decode-shape", "tp1", "--nixl", "cu12"], Ipc::Pickle);
}

/// Pickled requests four to a batch (`BatchTokenizedGenerateReqInput`, as
/// SGLang's tokenizer sends a batch): each of its rooms one lifecycle.
#[test]
fn healthy_tp1_rooms_in_pickled_batches_raise_nothing_and_are_one_lifecycle_each() {
    healthy(12, &["--decode-shape", "tp1", "--batch", "4"], Ipc::Pickle);
}

/// A few hundred rooms over TP1 and TP2 decodes, then the workers idle:
/// nothing raised, every room one lifecycle.
#[test]
fn a_healthy_run_of_300_rooms_with_idle_workers_raises_nothing() {
    healthy(300, &["--decode-shape", "mixed"], Ipc::Msgpack);
}

/// `stallwatch profile check sglang --pid PID`'s report.
fn profile_check(pid: u32) -> String {
    let (ok, stdout, stderr) =
        run_to_end(Command::new(agent_bin()).args(["profile", "check", "sglang", "--pid", &pid.to_string()]));
    assert!(ok, "profile check --pid {pid} failed: {stderr}");
    stdout
}

/// The hits of the probes on `pid` whose symbol contains `symbol`, from
/// the summary.
fn hits(summary: &Value, pid: u32, symbol: &str) -> u64 {
    let probes = summary["probes"].as_array().unwrap_or_else(|| panic!("no probes: {summary}"));
    probes
        .iter()
        .filter(|p| p["pid"] == pid && p["symbol"].as_str().is_some_and(|s| s.contains(symbol)))
        .filter_map(|p| p["hits"].as_u64())
        .sum()
}

/// SGLang's own layout at prefill TP2, as an operator meets it: a main
/// process (the bootstrap server and the tokenizer; where `pgrep -f
/// 'sglang.*disaggregation-mode prefill'` lands), two schedulers retitled
/// `sglang::scheduler_TP0` and `_TP1`, each with its own NIXL agent, KV
/// share and rooms, and a detokenizer. `profile check --pid` tells each
/// apart (the main process and the detokenizer not worth watching, each
/// scheduler to be watched with the other); `run --pid` of the main
/// process warns once, naming both schedulers and the selector; the
/// README's selector watches both, and a healthy run over TP1 and TP2
/// decodes raises nothing, each scheduler transferring and following
/// every room.
#[test]
fn a_tp2_prefill_is_told_apart_process_by_process_and_both_schedulers_follow_every_room() {
    let rooms: u64 = 12;
    // A TP2 decode (MLA): decode rank N takes every room's KV from prefill
    // rank N, so both prefill ranks transfer every room. (A TP1 decode of
    // an MLA model takes it from one prefill rank, its destination at the
    // other `is_dummy`, which that rank never transfers nor answers; an
    // MHA model's heterogeneous TP to host memory NIXL refuses.)
    let extra = ["--prefill-tp", "2", "--decode-shape", "tp2", "--count", "12"];
    let mut target = Target::start("none", &extra, Ipc::Msgpack);
    let schedulers = target.schedulers();
    let titles: Vec<&str> = schedulers.iter().map(|(_, title)| title.as_str()).collect();
    assert_eq!(titles, ["sglang::scheduler_TP0", "sglang::scheduler_TP1"], "{}", target.ready);
    let names_both = |text: &str| {
        schedulers.iter().all(|(pid, title)| text.contains(&format!("pid {pid} ({title}: an SGLang scheduler")))
    };
    let main = profile_check(target.prefill());
    assert!(main.contains(&format!("the process: pid {} `", target.prefill())), "{main}");
    assert!(main.contains("SGLang's main process"), "{main}");
    assert!(main.contains("not worth watching: none of the profile's probes fire here; they fire in"), "{main}");
    assert!(names_both(&main), "{main}");
    for (i, (pid, title)) in schedulers.iter().enumerate() {
        let report = profile_check(*pid);
        let (other, other_title) = &schedulers[1 - i];
        assert!(report.contains(&format!("the process: pid {pid} `{title}`: an SGLang scheduler")), "{report}");
        assert!(report.contains("fires here: the transfers, "), "{report}");
        assert!(report.contains(&format!("of the deployment of pid {} `", target.prefill())), "{report}");
        let with =
            format!("watch it with the others, not alone (a request's life also runs in pid {other} ({other_title}: ");
        assert!(report.contains(&with), "{report}");
    }
    let detokenizer = profile_check(target.detokenizer());
    assert!(detokenizer.contains("`sglang::detokenizer`: an SGLang helper process"), "{detokenizer}");
    assert!(detokenizer.contains("not worth watching: none of the profile's probes fire here"), "{detokenizer}");
    // `--pid` of the main process: said once, naming both schedulers.
    let lone = Agent::watch(target.prefill(), "sglang", "2s", &[]);
    lone.proc.wait_stderr("--pid watches one process of a deployment", Duration::from_secs(10));
    let (_, logged) = lone.stop_logged(libc::SIGINT);
    let warnings: Vec<&str> =
        logged.lines().filter(|line| line.contains("--pid watches one process of a deployment")).collect();
    let [warning] = &warnings[..] else { panic!("one warning: {logged}") };
    assert!(names_both(warning) && warning.contains("^sglang::scheduler"), "{warning}");
    // The README's selector: both schedulers, every room each.
    let agent = target.watch_and_go("sglang", "2s", &[]);
    let done = target.until("done", Duration::from_secs(120));
    assert_eq!((done["completed"].as_u64(), done["verified"].as_u64()), (Some(rooms), Some(rooms)), "{done}");
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    let raised = alert_lines(&lines);
    assert!(raised.is_empty(), "a healthy run raised alerts: {raised:?}");
    let summary = summary(&lines);
    for (pid, title) in &schedulers {
        assert!(hits(&summary, *pid, "postXferReq") > 0, "{title} (pid {pid}) posted nothing watched: {summary}");
    }
    assert_eq!(target.rooms().len() as u64, rooms);
    eprintln!("summary: {summary}");
    assert_counts(&lines, 2 * target.rooms().len(), 2 * rooms, 0, 0, 0);
    assert_eq!(summary["in_flight"], 0, "{lines:?}");
}

/// The stalls within timeout + 5 s, then one timeout more for anything
/// else, then the agent's every line.
fn stalls_then_quiet(agent: Agent, n: usize) -> Vec<Line> {
    stalls_then_quiet_logged(agent, n).0
}

/// [`stalls_then_quiet`], and what the agent logged.
fn stalls_then_quiet_logged(agent: Agent, n: usize) -> (Vec<Line>, String) {
    let mut seen = Vec::new();
    agent.wait_until(&format!("{n} stalls"), TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").count() >= n
    });
    std::thread::sleep(TIMEOUT);
    let (lines, logged) = agent.stop_logged(libc::SIGINT);
    seen.extend(lines);
    (seen, logged)
}

/// `alert` came within [timeout, timeout + 1 s] of `since` (less a margin
/// below for an activity the target prints just after it happens).
fn timed_from(alert: &Value, at: Instant, since: Instant, early: Duration) {
    let latency = at.saturating_duration_since(since);
    assert!(latency + early >= TIMEOUT && latency <= TIMEOUT + LATENESS, "{alert} after {latency:?}");
}

/// A decode rank SIGSTOPped as its room's chunks go: the room is
/// `transfer_hung` on the chunk that hangs (its handle, `transfer=N`, the
/// stopped decode as peer), timed from that chunk; the other decode's rooms
/// queued behind it on the same worker (SGLang shards rooms by the sum of
/// their destination ports) are `waiting_for_peer`, `behind` it, waiting
/// on the worker; the stopped decode's later rooms, which the scheduler
/// has but no decode answered, `waiting_for_peer` with `answered=0`.
#[test]
fn a_decode_stopped_mid_transfer_hangs_its_room_and_the_rooms_behind_it_say_so() {
    let (mut target, agent) = watched("hang", &[], &[]);
    let stopped = target.until("decode_stopped", Duration::from_secs(60));
    let (_, peer) = target.decode(stopped["decode"].as_u64().expect("decode"));
    let holding = target.until("holding", Duration::from_secs(60));
    let room = target.fault_room();
    assert_eq!(holding["rooms"][room.to_string()], "inflight", "{holding}");
    let state = |r: &u64| holding["rooms"][r.to_string()].as_str().unwrap_or_default().to_owned();
    let later: Vec<u64> = target.rooms().into_iter().filter(|r| *r > room).collect();
    let behind: Vec<u64> = later.iter().copied().filter(|r| state(r) == "inflight").collect();
    let unanswered: Vec<u64> = later.iter().copied().filter(|r| state(r) == "bootstrapping").collect();
    // Whether the other decode's rooms share the stopped one's worker is
    // up to the ports SGLang's decodes got (its shard is their sum % 4).
    assert!(!unanswered.is_empty(), "{holding}");
    let stalled = 1 + behind.len() + unanswered.len();
    let seen = stalls_then_quiet(agent, stalled);
    let raised = alert_lines(&seen);
    assert_eq!(raised.len(), stalled, "{raised:#?}");
    assert_counts(&seen, target.rooms().len(), held(&holding, "completed"), stalled as u64, 0, 0);
    // Judged when due, though the progress probes were being linked into
    // the prefill (mid-transfer) from half the timeout on.
    for alert in &raised {
        let silent = alert["silent_ms"].as_u64().map(Duration::from_millis);
        assert!(silent.is_some_and(|s| s >= TIMEOUT && s <= TIMEOUT + JUDGED_WITHIN), "{alert}");
    }
    let stall = |r: u64| {
        alerts(&seen, "stalled")
            .find(|(_, a)| a["key"] == format!("{r:#x}").as_str())
            .unwrap_or_else(|| panic!("room {r} not alerted: {raised:#?}"))
    };
    let (at, hung) = stall(room);
    assert_eq!(
        (hung["class"].as_str(), hung["external_id"].as_str()),
        (Some("transfer_hung"), Some(room.to_string().as_str())),
        "{hung}"
    );
    assert_eq!(hung["transport"]["peer"].as_str(), Some(peer.as_str()), "{hung}");
    assert!(hung["handle"].as_str().is_some_and(|h| h.starts_with("0x")), "{hung}");
    assert_ne!(hung["transport"]["verdict"], "others_completing", "{hung}");
    // The stop lands before the room's first chunk or between its chunks
    // (one transfer per chunk to a TP1 decode): the one that hangs is
    // named, and timed from its own post.
    let transfer: u64 = hung["transfer"].as_str().and_then(|t| t.parse().ok()).unwrap_or_else(|| panic!("{hung}"));
    let chunk = target
        .chunk(room, transfer - 1)
        .unwrap_or_else(|| panic!("transfer {transfer} is no chunk of room {room}: {hung}"));
    // The target prints the chunk once posted, and the line reaches the
    // test a little later: the alert, due a timeout after the post itself,
    // can come just under a timeout after the line (1.9993 s once in CI,
    // with the alert's own `silent_ms` 2004). Mooncake's test allows the same.
    timed_from(&hung, at, chunk, Duration::from_millis(300));
    for r in &behind {
        let (at, alert) = stall(*r);
        let waits = (
            alert["class"].as_str(),
            alert["answered"].as_str(),
            alert["behind"].as_str(),
            alert["waiting_on"].as_str(),
        );
        assert_eq!(
            waits,
            (Some("waiting_for_peer"), Some("1/1"), Some(room.to_string().as_str()), Some("worker")),
            "{alert}"
        );
        // Judged by the transfer its worker is stuck on: the stopped decode.
        assert_eq!(alert["transport"]["peer"].as_str(), Some(peer.as_str()), "{alert}");
        timed_from(&alert, at, target.at("bootstrapped", *r), Duration::from_millis(500));
    }
    for r in &unanswered {
        let (at, alert) = stall(*r);
        let waits = (alert["class"].as_str(), alert["answered"].as_str(), alert["waiting_on"].as_str());
        assert_eq!(waits, (Some("waiting_for_peer"), Some("0"), Some("peer")), "{alert}");
        timed_from(&alert, at, target.at("request", *r), Duration::from_millis(200));
    }
}

/// SGLang's default page size (a token a page) with chunked prefill: 22
/// rooms of 3000 pages, each sent in three chunks, live at once to one TP1
/// decode whose free list hands pages out in shuffled runs of 64 (a pool
/// after churn); the last room's decode is stopped once the others
/// concluded, so its first chunk hangs. A chunk past a room's first 16
/// pages is told its room by the room's whole page list (`zmq_recv_long`):
/// no transfer is followed as a lifecycle of its own (`seen` is the rooms,
/// nothing said unattributed), the hung room is `transfer_hung` under its
/// room, and nothing else is alerted.
#[test]
fn every_chunk_of_long_rooms_to_one_decode_is_its_rooms_and_the_hung_one_is_named() {
    const ROOMS: u64 = 22;
    const PAGES: u64 = 3000;
    // The last room (`--room-start` 1000): nothing is issued after it.
    let hung = 1000 + ROOMS - 1;
    let (count, fault_room, per_room) = (ROOMS.to_string(), hung.to_string(), PAGES.to_string());
    // Every room's pages at once, and the warm-up room's.
    let pool = ((ROOMS + 1) * PAGES).to_string();
    let extra = [
        ["--count", &count, "--fault-room", &fault_room, "--decode-shape", "tp1", "--decodes", "1"].as_slice(),
        &["--page-size", "1", "--pages-per-request", &per_room, "--chunks", "3", "--page-bytes", "16"],
        &["--pages", &pool, "--decode-pages", &pool, "--decode-free-runs", "64", "--interval", "0"],
    ]
    .concat();
    let (mut target, agent) = watched("hang", &extra, &[]);
    target.until("decode_stopped", Duration::from_secs(60));
    let holding = target.until("holding", Duration::from_secs(60));
    let rooms = target.rooms();
    assert_eq!(rooms.len() as u64, ROOMS, "{holding}");
    assert_eq!((held(&holding, "completed"), &holding["rooms"][&fault_room]), (ROOMS - 1, &Value::from("inflight")));
    assert!(rooms.iter().filter(|&&r| r != hung).all(|&r| target.chunks(r) == 3), "three chunks a room");
    // How many rooms were live at once: received by the scheduler and not
    // concluded, as the target printed them (in order).
    let when = |event: &str, room: u64| {
        let line = target.lines.iter().find(|l| l.json().is_some_and(|v| v["event"] == event && v["room"] == room));
        line.map(|l| l.at)
    };
    let live_at = |at: Instant| {
        let live =
            |r: &&u64| when("request", **r).is_some_and(|t| t <= at) && when("completed", **r).is_none_or(|t| t > at);
        rooms.iter().filter(live).count()
    };
    let most = rooms.iter().filter_map(|&r| when("request", r)).map(live_at).max();
    assert!(most.is_some_and(|n| n >= 20), "at most {most:?} rooms live at once");
    let (seen, logged) = stalls_then_quiet_logged(agent, 1);
    let raised = alert_lines(&seen);
    let [alert] = &raised[..] else { panic!("one alert, the hung room's: {raised:#?}") };
    let named = (alert["class"].as_str(), alert["external_id"].as_str(), alert["key"].as_str());
    assert_eq!(
        named,
        (Some("transfer_hung"), Some(fault_room.as_str()), Some(format!("{hung:#x}").as_str())),
        "{alert}"
    );
    let transfer: u64 = alert["transfer"].as_str().and_then(|t| t.parse().ok()).unwrap_or_else(|| panic!("{alert}"));
    assert!(target.chunk(hung, transfer - 1).is_some(), "transfer {transfer} is a chunk of room {hung}: {alert}");
    // Every transfer its room's: no handle counted apart, none said unattributed.
    assert_counts(&seen, rooms.len(), ROOMS - 1, 1, 0, 0);
    assert!(!logged.contains("NIXL transfers no SGLang room could be told theirs"), "{logged}");
    let summary = summary(&seen);
    let scheduler = target.schedulers()[0].0;
    eprintln!(
        "zmq_msg_close hits {} (zmq_msg_send {}) for {ROOMS} rooms: {}",
        hits(&summary, scheduler, "zmq_msg_close"),
        hits(&summary, scheduler, "zmq_msg_send"),
        summary["probes"]
    );
}

/// A decode killed once its room is bootstrapped: the room's transfer to
/// the dead peer fails, and the room is reported `failed` once, with its
/// room; its later rooms, which the scheduler has and no decode answers,
/// wait on their peer.
#[test]
fn a_decode_killed_after_answering_fails_its_room_once() {
    let (mut target, agent) = watched("decode-dies", &[], &[]);
    target.until("decode_killed", Duration::from_secs(60));
    let killed = target.lines.last().expect("decode_killed").at;
    let holding = target.until("holding", Duration::from_secs(60));
    let room = target.fault_room();
    assert_eq!(holding["rooms"][room.to_string()], "failed", "{holding}");
    let unanswered = target.rooms_in(&holding, "bootstrapping");
    let seen = stalls_then_quiet(agent, unanswered.len());
    let failed: Vec<(Instant, Value)> = alerts(&seen, "failed").collect();
    let [(at, alert)] = &failed[..] else { panic!("one failed alert: {seen:?}") };
    assert_eq!(
        (alert["key"].as_str(), alert["external_id"].as_str()),
        (Some(format!("{room:#x}").as_str()), Some(room.to_string().as_str())),
        "{alert}"
    );
    assert!(at.duration_since(killed) <= TIMEOUT + LATENESS, "{alert}");
    for (_, stall) in alerts(&seen, "stalled") {
        assert!(unanswered.iter().any(|r| stall["key"] == format!("{r:#x}").as_str()), "{stall}");
        assert_eq!(
            (stall["class"].as_str(), stall["answered"].as_str()),
            (Some("waiting_for_peer"), Some("0")),
            "{stall}"
        );
    }
    assert_eq!(alert_lines(&seen).len(), 1 + unanswered.len(), "{seen:?}");
    let completed = held(&holding, "completed");
    assert_counts(&seen, target.rooms().len(), completed, unanswered.len() as u64, 1, 0);
}

/// The decode aborts its room (ABORT frames) as the first chunk lands:
/// the room ends `aborted`, no alert.
#[test]
fn a_decode_abort_racing_a_chunk_ends_its_room_aborted() {
    let (mut target, agent) = watched("abort", &["--hold"], &[]);
    let done = target.until("done", Duration::from_secs(60));
    assert_eq!(done["failed"], 1, "{done}");
    target.at("decode_abort_sent", target.fault_room());
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    assert!(alert_lines(&lines).is_empty(), "{lines:?}");
    let completed = done["completed"].as_u64().expect("completed");
    assert_counts(&lines, target.rooms().len(), completed, 0, 0, 1);
}

/// The room whose decode never sends its destination, with one rank of
/// its decode instance silent: the scheduler has it (its request read
/// from SGLang's own IPC message), so it is `waiting_for_peer` with
/// `answered` = the destinations that came, timed from the room's last
/// activity (`since`: the target's line for it), nothing else alerted.
fn a_room_never_answered(shape: &str, answered: &str, since: impl Fn(&Target, u64) -> Instant) {
    a_room_never_answered_with(shape, &[], Ipc::Msgpack, answered, since)
}

fn a_room_never_answered_with(
    shape: &str,
    extra: &[&str],
    ipc: Ipc,
    answered: &str,
    since: impl Fn(&Target, u64) -> Instant,
) {
    let extra: Vec<&str> = ["--decode-shape", shape].into_iter().chain(extra.iter().copied()).collect();
    let (mut target, agent) = watched_with("no-answer", &extra, &[], ipc);
    let holding = target.until("holding", Duration::from_secs(60));
    let room = target.fault_room();
    assert_eq!(holding["rooms"][room.to_string()], "bootstrapping", "{holding}");
    let seen = stalls_then_quiet(agent, 1);
    let stalls: Vec<(Instant, Value)> = alerts(&seen, "stalled").collect();
    let [(at, alert)] = &stalls[..] else { panic!("one stall: {seen:?}") };
    assert_eq!(
        (alert["key"].as_str(), alert["class"].as_str()),
        (Some(format!("{room:#x}").as_str()), Some("waiting_for_peer")),
        "{alert}"
    );
    assert_eq!((alert["answered"].as_str(), alert["waiting_on"].as_str()), (Some(answered), Some("peer")), "{alert}");
    timed_from(alert, *at, since(&target, room), Duration::from_millis(200));
    assert_eq!(alert_lines(&seen).len(), 1, "{seen:?}");
    assert_counts(&seen, target.rooms().len(), held(&holding, "completed"), 1, 0, 0);
}

/// TP1 decodes: nothing came, timed from the request.
#[test]
fn a_room_whose_tp1_decode_never_answers_waits_for_its_peer() {
    a_room_never_answered("tp1", "0", |target, room| target.at("request", room));
}

/// The same with SGLang's default IPC (pickle): the room is read from the
/// pickled request the scheduler receives.
#[test]
fn a_room_whose_tp1_decode_never_answers_waits_for_its_peer_with_pickled_requests() {
    a_room_never_answered_with("tp1", &[], Ipc::Pickle, "0", |target, room| target.at("request", room));
}

/// Requests handed over four at a time, as SGLang's tokenizer batches them
/// (`BatchTokenizedGenerateReqInput`, pickled): the fault room, wherever it
/// falls in its batch, is read from it.
#[test]
fn a_room_in_a_pickled_batch_whose_tp1_decode_never_answers_waits_for_its_peer() {
    a_room_never_answered_with("tp1", &["--batch", "4"], Ipc::Pickle, "0", |target, room| target.at("request", room));
}

/// A TP2 MLA decode (`required_dst_info_num = 2`) whose rank 0 never
/// answers while rank 1 does: `answered=1/2`, timed from rank 1's
/// destination, the room's last activity.
#[test]
fn a_room_whose_tp2_decode_answers_from_one_rank_only_waits_for_the_other() {
    a_room_never_answered("tp2", "1/2", |target, room| {
        let answered = target.lines.iter().rev().find(|line| {
            line.json().is_some_and(|v| v["event"] == "decode_answered" && v["room"] == room && v["decode"] == 1)
        });
        answered.unwrap_or_else(|| panic!("rank 1 never answered room {room}: {:?}", target.lines)).at
    });
}

/// The prefill's own abort (an `AbortReq` from its tokenizer, taken by the
/// scheduler as `Scheduler.abort_request` does: `sender.abort()`, which
/// sends no ZMQ message to the decode) after the room's first chunk: the
/// room ends `aborted`, never a stall, the others complete.
#[test]
fn a_prefill_abort_racing_a_chunk_ends_its_room_aborted() {
    a_prefill_abort(Ipc::Msgpack);
}

/// The same with SGLang's default IPC: the `AbortReq` is read pickled.
#[test]
fn a_prefill_abort_racing_a_chunk_ends_its_room_aborted_with_pickled_requests() {
    a_prefill_abort(Ipc::Pickle);
}

fn a_prefill_abort(ipc: Ipc) {
    let (mut target, agent) = watched_with("prefill-abort", &["--hold"], &[], ipc);
    let done = target.until("done", Duration::from_secs(60));
    assert_eq!(done["failed"], 1, "{done}");
    target.at("prefill_abort", target.fault_room());
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    assert!(alert_lines(&lines).is_empty(), "{lines:?}");
    let completed = done["completed"].as_u64().expect("completed");
    assert_counts(&lines, target.rooms().len(), completed, 0, 0, 1);
}

/// The prefill's own bootstrap timeout
/// (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` = 1 s, shorter than the
/// agent's timeout): SGLang fails the room in memory, with no message to
/// its decode, and streams the request's end to its detokenizer; the room
/// ends `failed` at that output, once, never a stall.
#[test]
fn a_room_the_prefill_times_out_itself_ends_failed_never_stalled() {
    a_room_timed_out(Ipc::Msgpack);
}

/// The same with SGLang's default IPC: the request and the output that
/// ends it are read pickled.
#[test]
fn a_room_the_prefill_times_out_itself_ends_failed_never_stalled_with_pickled_requests() {
    a_room_timed_out(Ipc::Pickle);
}

fn a_room_timed_out(ipc: Ipc) {
    let (mut target, agent) = watched_with("bootstrap-timeout", &["--bootstrap-timeout", "1", "--hold"], &[], ipc);
    let done = target.until("done", Duration::from_secs(60));
    assert_eq!(done["failed"], 1, "{done}");
    let room = target.fault_room();
    let failed_at = target.at("failed", room);
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    let failed: Vec<(Instant, Value)> = alerts(&lines, "failed").collect();
    let [(at, alert)] = &failed[..] else { panic!("one failed alert: {lines:?}") };
    assert_eq!(
        (alert["key"].as_str(), alert["external_id"].as_str()),
        (Some(format!("{room:#x}").as_str()), Some(room.to_string().as_str())),
        "{alert}"
    );
    // Reported as it happens, well inside the timeout of the room's request.
    assert!(at.saturating_duration_since(failed_at) <= LATENESS, "{alert}");
    assert!(at.saturating_duration_since(target.at("request", room)) <= TIMEOUT + LATENESS, "{alert}");
    assert_eq!(alert_lines(&lines).len(), 1, "{lines:?}");
    let completed = done["completed"].as_u64().expect("completed");
    assert_counts(&lines, target.rooms().len(), completed, 0, 1, 0);
}

/// Both sides of one hung room, each watched by its own agent: the
/// prefill's room `transfer_hung`, the stopped decode's `waiting_for_kv`
/// (`side=decode`, waiting on the prefill), and both stall spans in the
/// room's one trace, which is how an on-call engineer tells which side
/// stopped.
#[test]
fn both_sides_of_a_hung_room_are_alerted_in_one_trace() {
    let collector = Collector::start();
    let endpoint = collector.http_endpoint();
    let mut target = Target::start("hang", &[], Ipc::Msgpack);
    let prefill = target.watch("sglang", "2s", &["--otlp-endpoint", &endpoint]);
    let decodes: HashMap<u64, u32> = (0..2).map(|i| (i, target.decode(i).0)).collect();
    let decode_agents: Vec<Agent> =
        decodes.values().map(|pid| Agent::watch(*pid, "sglang", "2s", &["--otlp-endpoint", &endpoint])).collect();
    target.proc.write_line("go");
    let stopped = target.until("decode_stopped", Duration::from_secs(60));
    let stopped_pid = decodes[&stopped["decode"].as_u64().expect("decode")];
    let room = target.fault_room();
    let key = format!("{room:#x}");
    let prefill_seen = stalls_then_quiet(prefill, 1);
    let hung = alerts(&prefill_seen, "stalled")
        .map(|(_, a)| a)
        .find(|a| a["key"] == key.as_str())
        .expect("the prefill's stall");
    assert_eq!(hung["class"], "transfer_hung", "{hung}");
    let mut decode_alerts = Vec::new();
    for agent in decode_agents {
        let mut seen = Vec::new();
        std::thread::sleep(TIMEOUT);
        seen.extend(agent.stop());
        decode_alerts.extend(alert_lines(&seen));
    }
    // The stopped decode alone is silent on a room it asked for.
    let waiting: Vec<&Value> = decode_alerts.iter().filter(|a| a["key"] == key.as_str()).collect();
    let [waiting] = &waiting[..] else { panic!("the stopped decode's stall of room {room}: {decode_alerts:#?}") };
    assert_eq!(waiting["pid"], stopped_pid, "{waiting}");
    let side = (waiting["class"].as_str(), waiting["side"].as_str(), waiting["waiting_on"].as_str());
    // The decode is the one stopped: its own agent says it waits on itself.
    assert_eq!(side, (Some("waiting_for_kv"), Some("decode"), Some("self")), "{waiting}");
    assert_eq!(waiting["transport"]["verdict"], "process_stopped", "{waiting}");
    assert_both_sides_stalled_in_the_rooms_trace(collector, room);
}

/// A room the scheduler has and one rank of its TP2 decode answered, its
/// agent SIGKILLed before the room's timeout: the next agent takes it over
/// from the kernel's in-flight table and reports it once, timed from its
/// last activity (before either agent's restart), not from the take-over,
/// still knowing it waits on its other rank (`answered=1/2`).
#[test]
fn a_room_held_across_an_agent_restart_is_reported_once_on_time() {
    const LONGER: Duration = Duration::from_secs(6);
    let mut target = Target::start("no-answer", &["--decode-shape", "tp2"], Ipc::Msgpack);
    let mut first = target.watch_and_go("sglang", "6s", &[]);
    target.until("holding", Duration::from_secs(60));
    let room = target.fault_room();
    let since = target
        .lines
        .iter()
        .rev()
        .find(|line| {
            line.json().is_some_and(|v| v["event"] == "decode_answered" && v["room"] == room && v["decode"] == 1)
        })
        .unwrap_or_else(|| panic!("rank 1 never answered room {room}: {:?}", target.lines))
        .at;
    assert!(
        since.elapsed() < LONGER - Duration::from_secs(2),
        "the room is still short of its timeout: {:?}",
        since.elapsed()
    );
    let dir = first.bpf_dir.take().expect("its own bpf directory");
    first.proc.signal(libc::SIGKILL);
    let _ = first.proc.wait(Duration::from_secs(5));
    let mut second = target.watch("sglang", "6s", &["--bpf-dir", dir.to_str().expect("utf-8 bpf dir")]);
    second.bpf_dir = Some(dir);
    let mut seen = Vec::new();
    second.wait_until("the room's stall", LONGER + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").next().is_some()
    });
    std::thread::sleep(Duration::from_secs(1));
    seen.extend(second.stop());
    let stalls: Vec<(Instant, Value)> = alerts(&seen, "stalled").collect();
    let [(at, alert)] = &stalls[..] else { panic!("one stall, the room's: {seen:?}") };
    assert_eq!(
        (alert["key"].as_str(), alert["class"].as_str()),
        (Some(format!("{room:#x}").as_str()), Some("waiting_for_peer")),
        "{alert}"
    );
    assert_eq!((alert["answered"].as_str(), alert["waiting_on"].as_str()), (Some("1/2"), Some("peer")), "{alert}");
    let latency = at.saturating_duration_since(since);
    assert!(
        latency + Duration::from_millis(200) >= LONGER && latency <= LONGER + LATENESS,
        "{alert} after {latency:?}"
    );
}

/// What an agent's `stallwatch inflight --json` says of each request it
/// follows: its row's `context` (an SGLang room's `answered`,
/// `waiting_on`, `behind`, `handle`, `transfer`), by key.
fn contexts(socket: &std::path::Path) -> HashMap<String, Value> {
    let (ok, stdout, stderr) =
        run_to_end(std::process::Command::new(agent_bin()).arg("inflight").arg("--socket").arg(socket).arg("--json"));
    assert!(ok, "inflight failed: {stderr}");
    let answer: Value = serde_json::from_str(&stdout).unwrap_or_else(|err| panic!("inflight --json ({err}): {stdout}"));
    let rows = answer["requests"].as_array().unwrap_or_else(|| panic!("no requests: {answer}"));
    rows.iter()
        .map(|row| (row["key"].as_str().expect("key").to_owned(), row.get("context").cloned().unwrap_or(Value::Null)))
        .collect()
}

/// The fields of an alert that say what its room waits on: those of the
/// room's `context` (keys as `context` names them).
fn waits_on(alert: &Value, context: &Value) -> Value {
    let keys = context.as_object().map(|c| c.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
    Value::Object(keys.into_iter().filter_map(|k| Some((k.clone(), alert.get(&k)?.clone()))).collect())
}

/// A decode SIGSTOPped mid-transfer, as in
/// `a_decode_stopped_mid_transfer_hangs_its_room_and_the_rooms_behind_it_say_so`,
/// and the prefill's agent SIGKILLed once the target holds, before any
/// stall is due; the next agent, on the same bpf directory, takes the
/// rooms over. Each room's alert says what the first agent knew it waits
/// on (what `stallwatch inflight` showed of it before the kill): the hung
/// room `transfer_hung` on the same handle and chunk (`transfer=N`), its
/// peer the stopped decode; the rooms behind it `answered=1/1`,
/// `behind=ROOM`, `waiting_on=worker`; the unanswered `answered=0`,
/// `waiting_on=peer`; each timed from its own last activity before the
/// restart, within timeout + 1 s, once, nothing else alerted. The stopped
/// decode's agent is restarted alike (both at once): its room is still
/// `waiting_for_kv` with `side=decode`, `waiting_on=prefill`.
#[test]
fn rooms_taken_over_after_an_agent_restart_keep_what_they_wait_on() {
    const LONGER: Duration = Duration::from_secs(12);
    let socket = test_socket();
    let socket_arg = socket.to_str().expect("utf-8 socket").to_owned();
    let decode_socket = test_socket();
    let decode_socket_arg = decode_socket.to_str().expect("utf-8 socket").to_owned();
    let mut target = Target::start("hang", &[], Ipc::Msgpack);
    // The decode the fault stops (rank 0 of instance 0) is watched too.
    let (decode_pid, peer) = target.decode(0);
    let mut first = target.watch("sglang", "12s", &["--socket", &socket_arg]);
    let mut first_decode = Agent::watch(decode_pid, "sglang", "12s", &["--socket", &decode_socket_arg]);
    target.proc.write_line("go");
    let stopped = target.until("decode_stopped", Duration::from_secs(60));
    assert_eq!(stopped["decode"], 0, "{stopped}");
    let holding = target.until("holding", Duration::from_secs(60));
    let room = target.fault_room();
    assert_eq!(holding["rooms"][room.to_string()], "inflight", "{holding}");
    let state = |r: &u64| holding["rooms"][r.to_string()].as_str().unwrap_or_default().to_owned();
    let later: Vec<u64> = target.rooms().into_iter().filter(|r| *r > room).collect();
    let behind: Vec<u64> = later.iter().copied().filter(|r| state(r) == "inflight").collect();
    let unanswered: Vec<u64> = later.iter().copied().filter(|r| state(r) == "bootstrapping").collect();
    assert!(!unanswered.is_empty(), "{holding}");
    let held: Vec<u64> = [room].into_iter().chain(behind.iter().copied()).chain(unanswered.iter().copied()).collect();
    // What the first agent knows each room waits on, all of it read (the
    // query reads the ring buffer first).
    let before = contexts(&socket);
    for r in &held {
        let context = &before[&format!("{r:#x}")];
        assert!(context.as_object().is_some_and(|c| !c.is_empty()), "room {r} has no context: {before:?}");
    }
    // The stopped decode's: the hung room, which it asked for.
    let before_decode = contexts(&decode_socket);
    let side = serde_json::json!({"side": "decode", "waiting_on": "prefill"});
    assert_eq!(before_decode.get(&format!("{room:#x}")), Some(&side), "{before_decode:?}");
    // A turn of their loops to hand what they read over, then a crash.
    std::thread::sleep(Duration::from_millis(300));
    let dir = first.bpf_dir.take().expect("its own bpf directory");
    let decode_dir = first_decode.bpf_dir.take().expect("its own bpf directory");
    for agent in [&mut first, &mut first_decode] {
        agent.proc.signal(libc::SIGKILL);
        let _ = agent.proc.wait(Duration::from_secs(5));
    }
    let killed = Instant::now();
    let since = |r: u64| -> Instant {
        if r == room {
            // The stop lands before the room's first chunk or between its
            // chunks: the one that hangs is named (one transfer per chunk to
            // a TP1 decode), its post the room's last activity.
            let transfer: u64 = before[&format!("{room:#x}")]["transfer"]
                .as_str()
                .and_then(|t| t.parse().ok())
                .unwrap_or_else(|| panic!("the hung room names no transfer: {before:?}"));
            target.chunk(room, transfer - 1).unwrap_or_else(|| panic!("transfer {transfer} is no chunk of room {room}"))
        } else if behind.contains(&r) {
            target.at("bootstrapped", r)
        } else {
            target.at("request", r)
        }
    };
    let earliest = held.iter().map(|r| since(*r)).min().expect("rooms");
    assert!(
        killed.duration_since(earliest) < LONGER - Duration::from_secs(5),
        "no room may be near its timeout at the kill: {:?}",
        killed.duration_since(earliest)
    );
    let dir_arg = dir.to_str().expect("utf-8 bpf dir").to_owned();
    let second_socket = test_socket();
    let second_arg = second_socket.to_str().expect("utf-8 socket").to_owned();
    let decode_dir_arg = decode_dir.to_str().expect("utf-8 bpf dir").to_owned();
    let second_decode_socket = test_socket();
    let second_decode_arg = second_decode_socket.to_str().expect("utf-8 socket").to_owned();
    // Both at once, as a node's agents restart each on its own.
    let (mut second, mut second_decode) = std::thread::scope(|scope| {
        let decode = scope.spawn(|| {
            Agent::watch(decode_pid, "sglang", "12s", &["--bpf-dir", &decode_dir_arg, "--socket", &second_decode_arg])
        });
        let prefill = target.watch("sglang", "12s", &["--bpf-dir", &dir_arg, "--socket", &second_arg]);
        (prefill, decode.join().expect("the decode's agent"))
    });
    second.bpf_dir = Some(dir);
    second_decode.bpf_dir = Some(decode_dir);
    let took_over = killed.elapsed();
    let mut after_decode: Vec<String> = contexts(&second_decode_socket).into_keys().collect();
    let mut followed_decode: Vec<String> = before_decode.keys().cloned().collect();
    after_decode.sort();
    followed_decode.sort();
    assert_eq!(after_decode, followed_decode, "the requests the decode's second agent took over, and its first's");
    // It follows what the first one did, nothing else: no handle of a
    // room (live or ended) taken over as a request of its own.
    let mut after: Vec<String> = contexts(&second_socket).into_keys().collect();
    let mut followed: Vec<String> = before.keys().cloned().collect();
    after.sort();
    followed.sort();
    assert_eq!(after, followed, "the requests the second agent took over, and the first one's");
    let mut seen = Vec::new();
    second.wait_until(&format!("{} stalls", held.len()), LONGER + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").count() >= held.len()
    });
    std::thread::sleep(Duration::from_secs(2));
    seen.extend(second.stop());
    let raised = alert_lines(&seen);
    assert_eq!(raised.len(), held.len(), "{raised:#?}");
    eprintln!("taken over {took_over:?} after the kill; {} rooms held", held.len());
    for r in &held {
        let key = format!("{r:#x}");
        let (at, alert) = alerts(&seen, "stalled")
            .find(|(_, a)| a["key"] == key.as_str())
            .unwrap_or_else(|| panic!("room {r} not alerted: {raised:#?}"));
        let context = &before[&key];
        assert_eq!(&waits_on(&alert, context), context, "room {r}: {alert}");
        let class = if *r == room { "transfer_hung" } else { "waiting_for_peer" };
        assert_eq!(alert["class"].as_str(), Some(class), "{alert}");
        let latency = at.saturating_duration_since(since(*r));
        assert!(
            latency + Duration::from_millis(500) >= LONGER && latency <= LONGER + LATENESS,
            "room {r}: {alert} after {latency:?}"
        );
    }
    let hung = raised.iter().find(|a| a["key"] == format!("{room:#x}").as_str()).expect("the hung room");
    assert_eq!(hung["transport"]["peer"].as_str(), Some(peer.as_str()), "{hung}");
    assert!(hung["handle"].as_str().is_some_and(|h| h.starts_with("0x")), "{hung}");
    for r in &behind {
        assert_eq!(before[&format!("{r:#x}")]["behind"], room.to_string().as_str(), "{before:?}");
    }
    for r in &unanswered {
        assert_eq!(before[&format!("{r:#x}")]["answered"], "0", "{before:?}");
    }
    // The stopped decode's rooms (the hung one, and any whose status the
    // first agent did not see: a receive begun before its probes), each
    // alerted as the first agent would have: waiting for its KV, on the
    // decode side; the hung one timed from when the decode asked for it.
    let mut seen = Vec::new();
    let n = before_decode.len();
    second_decode.wait_until("the decode's stalls", Duration::from_secs(10), &mut seen, |seen| {
        alerts(seen, "stalled").count() >= n
    });
    seen.extend(second_decode.stop());
    let raised = alert_lines(&seen);
    assert_eq!(raised.len(), n, "{raised:#?}");
    for alert in &raised {
        let context = before_decode.get(alert["key"].as_str().expect("key")).unwrap_or_else(|| panic!("{alert}"));
        // Stopped, the decode waits on itself, whatever the first agent
        // read of its traffic before the stop.
        let mut context = context.clone();
        context["waiting_on"] = Value::from("self");
        assert_eq!((waits_on(alert, &context), alert["class"].as_str()), (context, Some("waiting_for_kv")), "{alert}");
        assert_eq!(alert["process_state"], "stopped", "{alert}");
    }
    let waiting = raised.iter().find(|a| a["key"] == format!("{room:#x}").as_str()).expect("the hung room's");
    let asked = target
        .lines
        .iter()
        .find(|line| {
            line.json().is_some_and(|v| v["event"] == "decode_answered" && v["room"] == room && v["decode"] == 0)
        })
        .unwrap_or_else(|| panic!("decode 0 never answered room {room}"))
        .at;
    let (at, _) = alerts(&seen, "stalled").find(|(_, a)| a == waiting).expect("its stall");
    let latency = at.saturating_duration_since(asked);
    assert!(
        latency + Duration::from_millis(500) >= LONGER && latency <= LONGER + LATENESS,
        "{waiting} after {latency:?}"
    );
}

/// The prefill itself SIGSTOPped (fault `prefill-stops`: its process stops
/// itself, every thread, right after handing the fault room's first chunk
/// to its transfer worker), watched by its own agent and the fault room's
/// decode by another. Every alert the prefill's agent raises, on every
/// request it held at the stop (each of them stalls: nothing moves in a
/// stopped process), says the prefill waits on itself: `process_state`
/// `stopped`, `waiting_on=self`, verdict `process_stopped`, never a peer
/// blamed (`peer_unresponsive`) nor the room alone stuck
/// (`others_completing`), within timeout + 1 s of the stop. The decode's
/// agent, whose process runs, points at the prefill: the fault room
/// `waiting_for_kv`, `side=decode`, `waiting_on=prefill`, never
/// `process_stopped`.
#[test]
fn a_prefill_stopped_itself_says_so_in_every_alert_and_its_decode_points_at_it() {
    let socket = test_socket();
    let socket_arg = socket.to_str().expect("utf-8 socket").to_owned();
    let mut target = Target::start("prefill-stops", &[], Ipc::Msgpack);
    let (decode_pid, _) = target.decode(0);
    // The process that stops itself is the scheduler (its rooms' and
    // transfers' process), which the README's selector watches.
    let (scheduler, _) = target.schedulers()[0];
    let prefill = target.watch("sglang", "2s", &["--socket", &socket_arg]);
    let decode = Agent::watch(decode_pid, "sglang", "2s", &[]);
    target.proc.write_line("go");
    let stopping = target.until("prefill_stopping", Duration::from_secs(60));
    let stopped_at = Instant::now();
    let room = target.fault_room();
    assert_eq!((stopping["room"].as_u64(), stopping["pid"].as_u64()), (Some(room), Some(u64::from(scheduler))));
    let key = format!("{room:#x}");
    // The fault room's stall first; then every request the agent follows
    // (nothing begins or ends in a stopped process) has its own.
    let mut seen = Vec::new();
    prefill.wait_until("the fault room's stall", TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").any(|(_, a)| a["key"] == key.as_str())
    });
    let held = contexts(&socket);
    assert!(held.contains_key(&key), "{held:?}");
    prefill.wait_until(&format!("{} stalls", held.len()), TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").count() >= held.len()
    });
    let mut decode_seen = Vec::new();
    decode.wait_until(
        "the decode's stall of the fault room",
        TIMEOUT + Duration::from_secs(5),
        &mut decode_seen,
        |seen| alerts(seen, "stalled").any(|(_, a)| a["key"] == key.as_str()),
    );
    seen.extend(prefill.stop());
    decode_seen.extend(decode.stop());
    let raised = alert_lines(&seen);
    for alert in &raised {
        eprintln!(
            "prefill stopped: {} {} {} waiting_on={}",
            alert["alert"], alert["key"], alert["class"], alert["waiting_on"]
        );
        // Every alert, a stall or not (a handle the stopped process could
        // not release, judged `leaked` by time), says who stopped.
        assert_eq!(
            (alert["waiting_on"].as_str(), alert["process_state"].as_str()),
            (Some("self"), Some("stopped")),
            "{alert}"
        );
    }
    let stalls: Vec<&Value> = raised.iter().filter(|a| a["alert"] == "stalled").collect();
    let mut alerted: Vec<&str> = stalls.iter().filter_map(|a| a["key"].as_str()).collect();
    alerted.sort_unstable();
    let mut followed: Vec<&str> = held.keys().map(String::as_str).collect();
    followed.sort_unstable();
    assert_eq!(alerted, followed, "each request held at the stop alerted once: {raised:#?}");
    for (at, alert) in alerts(&seen, "stalled") {
        assert_eq!(
            (alert["transport"]["verdict"].as_str(), alert["transport"]["process_state"].as_str()),
            (Some("process_stopped"), Some("stopped")),
            "{alert}"
        );
        assert_eq!(
            (alert["waiting_on"].as_str(), alert["process_state"].as_str()),
            (Some("self"), Some("stopped")),
            "{alert}"
        );
        assert!(alert.get("behind").is_none(), "a stopped worker is nobody's queue: {alert}");
        assert!(
            alert["transport"]["summary"].as_str().is_some_and(|s| s.starts_with("process stopped (all ")),
            "{alert}"
        );
        assert!(at.saturating_duration_since(stopped_at) <= TIMEOUT + LATENESS, "{alert} after the stop");
    }
    // The fault room, mid-way through its chunks, is classed by what it
    // does: a transfer of its own out (the chunk just handed over, if the
    // worker posted it before the stop), or none yet.
    let hung = raised.iter().find(|a| a["key"] == key.as_str()).expect("the fault room");
    assert!(matches!(hung["class"].as_str(), Some("transfer_hung" | "waiting_for_peer")), "{hung}");
    // The decode runs: it points at the prefill.
    let waiting: Vec<Value> = alert_lines(&decode_seen).into_iter().filter(|a| a["key"] == key.as_str()).collect();
    let [waiting] = &waiting[..] else { panic!("the decode's stall of room {room}: {decode_seen:?}") };
    assert_eq!(waiting["pid"], decode_pid, "{waiting}");
    let side = (waiting["class"].as_str(), waiting["side"].as_str(), waiting["waiting_on"].as_str());
    assert_eq!(side, (Some("waiting_for_kv"), Some("decode"), Some("prefill")), "{waiting}");
    for alert in alert_lines(&decode_seen) {
        assert_ne!(alert["transport"]["verdict"], "process_stopped", "{alert}");
        assert!(alert.get("process_state").is_none(), "{alert}");
    }
    // Resumed, it goes on (its teardown is the harness's).
    // SAFETY: kill(2) on the target this test started.
    unsafe { libc::kill(scheduler as i32, libc::SIGCONT) };
}

/// A room's NIXL handles never released (`--fault leak`: the target keeps
/// references to the fault room's last handles, its last chunk's and its
/// aux, as a debugger or a kept traceback would, once the room completed;
/// SGLang's worker then moves on to later rooms and drops its own): each
/// handle is reported once, `leaked` (`leaked=handle`, the handle, its room
/// and its peer, `release=never`), a timeout after its worker moved on, and
/// counted in the summary and the metrics. Nothing else is raised: the
/// room completed, and every other worker's last handles, kept by their
/// idle workers, are no leak.
#[test]
fn a_rooms_handles_never_released_are_each_reported_leaked_once_with_its_room_and_peer() {
    // `--hold`: the scheduler stays up after its last room (its handles are
    // judged a timeout after the worker moved on; a process gone takes its
    // handles with it).
    let (mut target, agent) = watched("leak", &["--count", "12", "--hold"], &stallwatch_tests::METRICS);
    let fault = target.fault_room();
    let held = target.until("handles_held", Duration::from_secs(120));
    let strs = |v: &Value| -> Vec<String> {
        v.as_array().unwrap_or_else(|| panic!("{held}")).iter().filter_map(|s| Some(s.as_str()?.to_owned())).collect()
    };
    let (mut handles, agents) = (strs(&held["handles"]), strs(&held["agents"]));
    handles.sort_unstable();
    assert!(!handles.is_empty() && agents.len() == 1, "{held}");
    let done = target.until("done", Duration::from_secs(120));
    assert_eq!(done["completed"].as_u64(), Some(12), "{done}");
    let mut seen = Vec::new();
    agent.wait_until("the leaks", TIMEOUT + Duration::from_secs(10), &mut seen, |seen| {
        alerts(seen, "leaked").count() >= handles.len()
    });
    let ended = |outcome: &str| agent.metric(&format!("stallwatch_requests_ended_total{{outcome=\"{outcome}\"}}"));
    let leaked_metric = ended("leaked");
    // One timeout more: nothing else, no leak twice.
    std::thread::sleep(TIMEOUT + LATENESS);
    seen.extend(agent.stop());
    let leaks: Vec<Value> = alerts(&seen, "leaked").map(|(_, a)| a).collect();
    let mut leaked: Vec<String> = leaks.iter().filter_map(|a| Some(a["handle"].as_str()?.to_owned())).collect();
    leaked.sort_unstable();
    assert_eq!(leaked, handles, "each held handle leaked, once: {leaks:#?}");
    for leak in &leaks {
        let fields = ["leaked", "room", "peer", "release"].map(|f| leak[f].as_str().map(str::to_owned));
        let expected =
            [Some("handle".to_owned()), Some(fault.to_string()), Some(agents[0].clone()), Some("never".into())];
        assert_eq!(fields, expected, "{leak}");
        assert_eq!(leak["key"], leak["handle"], "a lifecycle of its own, keyed by the handle: {leak}");
    }
    let raised = alert_lines(&seen);
    assert_eq!(raised.len(), handles.len(), "only the leaks: {raised:#?}");
    let summary = summary(&seen);
    assert_eq!(summary["leaked"].as_u64(), Some(handles.len() as u64), "{summary}");
    assert_eq!(leaked_metric, handles.len() as u64);
    // Every room one lifecycle, completed; each leak one more, its own.
    assert_eq!(target.rooms().len(), 12);
    let counts = ["seen", "completed", "stalled", "failed", "aborted", "lost_events"].map(|k| summary[k].as_u64());
    assert_eq!(counts, [12 + handles.len() as u64, 12, 0, 0, 0, 0].map(Some), "{summary}");
}
