//! The Mooncake test target checked on its own, before any profile stands
//! on it: tests/sglang/mooncake runs SGLang 0.5.23's MooncakeKVBootstrapServer,
//! MooncakeKVManager (PREFILL and DECODE), MooncakeKVSender and
//! MooncakeKVReceiver, unchanged from the wheel, over the real Mooncake
//! TransferEngine (mooncake-transfer-engine-non-cuda 0.3.13.post1, TCP on
//! loopback, P2PHANDSHAKE metadata), with one seeded stall per run.
//!
//! Each test asserts what the wire and the engine really do for its seed:
//! the rooms the decodes verified byte for byte, when the prefill's SGLang
//! code failed a room (measured from the chunk it was failing on), which
//! rooms wait behind a hung batch on SGLang's own transfer queue, and, where
//! the engine's busy poll is the whole story, that a thread of the prefill
//! spins while its batch is hung and none does in a healthy idle run.
//! The `watched_*` tests then put the agent on it (`sglang-mooncake`):
//! each seeded stall asserted on its room, as docs/frameworks/
//! sglang-mooncake.md tabulates.
use std::{
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::sglang::{Ipc, Target};

/// The engine build the findings (docs/frameworks/sglang-mooncake.md) were
/// measured on: its BatchDesc and TransferRequest offsets, its Status ABI.
const ENGINE_BUILD_ID: &str = "0dded685e9e28bcea5c6936d879ad41c30f59f01";

/// Set up and running (`--no-wait`).
fn run(fault: &str, extra: &[&str]) -> Target {
    let extra: Vec<&str> = extra.iter().copied().chain(["--no-wait"]).collect();
    Target::mooncake(fault, &extra, Ipc::Pickle)
}

/// The JSON lines the target printed so far with `event`.
fn events(target: &Target, event: &str) -> Vec<Value> {
    target.lines.iter().filter_map(|l| l.json()).filter(|v| v["event"] == event).collect()
}

fn rooms_with(target: &Target, event: &str) -> Vec<u64> {
    events(target, event).iter().map(|v| v["room"].as_u64().expect("room")).collect()
}

/// The decodes' own verdicts: rooms a decode found Success with every
/// page and the aux byte-for-byte as the prefill wrote them.
fn verified(target: &Target) -> Vec<u64> {
    let statuses = events(target, "decode_status");
    statuses
        .iter()
        .filter(|v| v["status"] == "Success" && v["verified"] == true)
        .map(|v| v["room"].as_u64().unwrap())
        .collect()
}

/// `event` for `room`: from the lines already read, else the next ones.
fn room_event(target: &mut Target, event: &str, room: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = events(target, event).into_iter().find(|v| v["room"] == room) {
            return v;
        }
        target.until(event, deadline.saturating_duration_since(Instant::now()));
    }
}

/// The build id `readelf -n` prints for `path`.
fn build_id(path: &str) -> String {
    let out = Command::new("readelf").args(["-n", path]).output().expect("running readelf (binutils)");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: "))
        .unwrap_or_else(|| panic!("no build id in `readelf -n {path}`: {text}"))
        .to_owned()
}

/// CPU ticks (utime + stime) of every thread of `pid` but its main thread.
fn thread_ticks(pid: u32) -> Vec<(u32, u64)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("reading the target's threads");
    let mut ticks = Vec::new();
    for task in tasks.flatten() {
        let Ok(tid) = task.file_name().to_string_lossy().parse::<u32>() else { continue };
        if tid == pid {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        // Fields after the parenthesised comm: state is field 3, utime 14, stime 15.
        let after = &stat[stat.rfind(')').expect("stat has a comm") + 2..];
        let fields: Vec<&str> = after.split_whitespace().collect();
        ticks.push((tid, fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()));
    }
    ticks
}

/// The largest share of one CPU any thread of `pid` other than its main
/// thread (the scheduler loop, which polls by design) used over `over`.
fn busiest_thread(pid: u32, over: Duration) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let before = thread_ticks(pid);
    std::thread::sleep(over);
    let after = thread_ticks(pid);
    let used = |tid: u32, t: u64| before.iter().find(|(b, _)| *b == tid).map_or(0, |(_, b)| t.saturating_sub(*b));
    after.iter().map(|&(tid, t)| used(tid, t) as f64 / hz / over.as_secs_f64()).fold(0.0, f64::max)
}

/// `/proc/PID/stat`'s state letter.
fn state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("reading the decode's stat");
    stat[stat.rfind(')').unwrap() + 2..].chars().next().unwrap()
}

#[test]
fn a_healthy_run_completes_every_room_verified_on_the_engine_it_was_measured_on_and_idle_workers_stay_idle() {
    let mut target = run("none", &["--count", "12", "--decodes", "2", "--hold"]);
    let engine = target.ready["engine_so"].as_str().expect("engine_so").to_owned();
    assert!(engine.ends_with("/mooncake/engine.so"), "{}", target.ready);
    assert_eq!(build_id(&engine), ENGINE_BUILD_ID, "another engine.so than the findings were measured on: {engine}");
    assert_eq!(target.ready["queue_size"], 4, "SGLang's default SGLANG_DISAGGREGATION_QUEUE_SIZE: {}", target.ready);
    let done = target.until("done", Duration::from_secs(120));
    assert_eq!([&done["completed"], &done["failed"], &done["verified"]], [12, 0, 12], "{done}");
    // Each decode instance's rooms go to the worker SGLang's formula picks
    // from the session the decode's own engine reports (rpc port % 4): the
    // same session string the prefill's engine opens.
    let decodes = target.ready["decodes"].as_array().expect("decodes").clone();
    let mut used = std::collections::BTreeSet::new();
    for bootstrapped in events(&target, "bootstrapped") {
        let room = bootstrapped["room"].as_u64().unwrap();
        let instance =
            events(&target, "request").iter().find(|r| r["room"] == room).expect("request")["instance"].clone();
        let decode = decodes.iter().find(|d| d["instance"] == instance).expect("decode of the instance");
        let session = decode["session"].as_str().expect("session");
        let (host, port) = session.rsplit_once(':').expect("ip:port session");
        assert_eq!(host, "127.0.0.1", "{session}");
        assert_eq!(bootstrapped["worker"], port.parse::<u64>().unwrap() % 4, "room {room}, session {session}");
        used.insert(bootstrapped["worker"].as_u64().unwrap());
    }
    assert!(used.len() <= 2, "two decodes use at most two of the four workers: {used:?}");
    // Held after the last room: the idle workers wait in FastQueue.get and
    // no engine thread spins.
    let busiest = busiest_thread(target.prefill(), Duration::from_secs(2));
    assert!(busiest < 0.10, "a thread of an idle prefill used {:.0}% of a CPU", busiest * 100.0);
    target.proc.write_line("quit");
}

#[test]
fn a_batch_to_a_stopped_decode_fails_its_room_at_mc_transfer_timeout_and_the_rooms_queued_behind_it_wait_for_that() {
    // One transfer worker: every room's chunks queue on it, so the rooms of
    // decodes 1 and 2 sent after the fault wait behind the hung batch.
    let mut target = run("timeout", &["--count", "6", "--decodes", "3", "--queue-size", "1", "--settle", "12"]);
    assert_eq!(target.ready["transfer_timeout"], 5, "{}", target.ready);
    let fault = target.fault_room();
    let stopped = target.until("decode_stopped", Duration::from_secs(60));
    let decode = stopped["pid"].as_u64().unwrap() as u32;
    stallwatch_tests::wait_for("the decode stopped", Duration::from_secs(5), || (state(decode) == 'T').then_some(()));
    target.until("chunk", Duration::from_secs(10));
    // While the batch is hung, the worker's batch_transfer_sync_write spins
    // on getBatchTransferStatus (about 600 000 polls a second, measured).
    let busiest = busiest_thread(target.prefill(), Duration::from_secs(2));
    assert!(busiest > 0.20, "no prefill thread spins on the hung batch: busiest {:.0}%", busiest * 100.0);
    let done = target.until("done", Duration::from_secs(60));
    assert_eq!([&done["completed"], &done["failed"]], [5, 1], "{done}");
    assert_eq!(rooms_with(&target, "failed"), [fault]);
    let failed = &events(&target, "failed")[0];
    assert!(failed["reason"].as_str().unwrap().contains(&format!("Failed to send kv chunk of {fault}")), "{failed}");
    let first_chunk = target.chunk(fault, 0).expect("the fault room's first chunk");
    let failed_at = target.at("failed", fault);
    let took = failed_at - first_chunk;
    assert!(
        (Duration::from_millis(4800)..Duration::from_secs(9)).contains(&took),
        "MC_TRANSFER_TIMEOUT=5 s, the room failed {took:?} after its first chunk"
    );
    // The rooms behind it: sent after the fault, completed only once the
    // hung batch gave up, and verified by their decodes.
    let behind: Vec<u64> = rooms_with(&target, "request").into_iter().filter(|&r| r > fault).collect();
    assert_eq!(behind.len(), 2, "rooms after the fault: {behind:?}");
    for room in &behind {
        let completed = target.at("completed", *room);
        assert!(
            completed >= failed_at - Duration::from_millis(50),
            "room {room} completed before the hung batch failed"
        );
        assert!(target.at("bootstrapped", *room) < failed_at, "room {room} was queued while the batch hung");
    }
    for room in &behind {
        room_event(&mut target, "decode_status", *room);
    }
    assert!(behind.iter().all(|r| verified(&target).contains(r)), "{:?}", verified(&target));
}

#[test]
fn a_decode_stopped_mid_transfer_holds_its_room_and_the_rooms_queued_behind_it_on_the_worker() {
    // The engine's default timeout (30 s) outlives the run: the batch is hung.
    let mut target = run("hang", &["--count", "6", "--decodes", "3", "--queue-size", "1", "--settle", "3"]);
    assert_eq!(target.ready["transfer_timeout"], Value::Null, "{}", target.ready);
    let fault = target.fault_room();
    let started = Instant::now();
    let holding = target.until("holding", Duration::from_secs(60));
    assert!(started.elapsed() < Duration::from_secs(25), "held before the engine's 30 s timeout");
    assert_eq!(holding["rooms"][fault.to_string()], "inflight", "{holding}");
    let queued: Vec<u64> =
        holding["workers"]["0"].as_array().expect("worker 0").iter().map(|r| r.as_u64().unwrap()).collect();
    let behind: Vec<u64> = rooms_with(&target, "request").into_iter().filter(|&r| r > fault).collect();
    assert_eq!(behind.len(), 2, "{behind:?}");
    for room in &behind {
        assert_eq!(holding["rooms"][room.to_string()], "inflight", "{holding}");
        assert!(queued.contains(room), "room {room}'s chunks wait on worker 0: {holding}");
    }
    assert!(rooms_with(&target, "failed").is_empty(), "nothing failed yet: {:?}", target.lines);
    let busiest = busiest_thread(target.prefill(), Duration::from_secs(2));
    assert!(busiest > 0.20, "no prefill thread spins on the hung batch: busiest {:.0}%", busiest * 100.0);
    target.proc.write_line("quit");
}

#[test]
fn a_decode_killed_after_answering_fails_its_room_at_once_and_the_other_decode_carries_on() {
    let mut target = run("decode-dies", &["--count", "8", "--decodes", "2", "--settle", "3"]);
    let fault = target.fault_room();
    let killed = target.until("decode_killed", Duration::from_secs(60));
    assert_eq!(killed["room"], fault, "{killed}");
    let holding = target.until("holding", Duration::from_secs(60));
    assert_eq!(rooms_with(&target, "failed"), [fault], "{holding}");
    let took = target.at("failed", fault) - target.at("decode_killed", fault);
    assert!(took < Duration::from_secs(2), "a killed decode fails the batch at once, not at a timeout: {took:?}");
    let failed = &events(&target, "failed")[0];
    assert!(failed["reason"].as_str().unwrap().contains(&format!("Failed to send kv chunk of {fault}")), "{failed}");
    // The dead decode's later room is never answered; the other decode's
    // rooms all complete, verified.
    let own_later: Vec<u64> =
        rooms_with(&target, "request").into_iter().filter(|&r| r > fault && (r - fault).is_multiple_of(2)).collect();
    for room in &own_later {
        assert_eq!(holding["rooms"][room.to_string()], "bootstrapping", "{holding}");
    }
    let completed = rooms_with(&target, "completed");
    assert_eq!(completed.len() + 1 + own_later.len(), 8, "{holding}");
    // Each decode's verdict, which may come after `holding` on a loaded host.
    for room in &completed {
        room_event(&mut target, "decode_status", *room);
    }
    assert!(completed.iter().all(|r| verified(&target).contains(r)), "{:?}", target.lines);
    target.proc.write_line("quit");
}

#[test]
fn a_decode_abort_racing_a_chunk_fails_the_room_on_both_sides() {
    let mut target = run("abort", &["--count", "6", "--decodes", "2"]);
    let fault = target.fault_room();
    let done = target.until("done", Duration::from_secs(60));
    assert_eq!([&done["completed"], &done["failed"], &done["verified"]], [5, 1, 5], "{done}");
    let abort = target.at("decode_abort_sent", fault);
    assert!(target.chunk(fault, 0).expect("first chunk") < abort, "the abort came after the first chunk");
    assert_eq!(rooms_with(&target, "failed"), [fault]);
    // The room's last chunk is handed to the sender only once the prefill's
    // manager has the ABORT (the decode's `abort_sent` line reaches us
    // through the prefill, so it may print after that chunk): it raced the
    // abort and lost, nothing of it was transferred, both sides failed.
    assert!(target.chunk(fault, 1).is_some(), "the last chunk was sent");
    let status = room_event(&mut target, "decode_status", fault);
    assert_eq!(status["status"], "Failed", "{status}");
}

#[test]
fn a_room_whose_decode_never_answers_stays_bootstrapping_with_no_transfer() {
    let mut target = run("no-answer", &["--count", "6", "--decodes", "2", "--settle", "2"]);
    let fault = target.fault_room();
    let holding = target.until("holding", Duration::from_secs(60));
    assert_eq!(holding["rooms"][fault.to_string()], "bootstrapping", "{holding}");
    assert!(!rooms_with(&target, "decode_answered").contains(&fault), "the decode never sent the room's destination");
    assert!(target.chunk(fault, 0).is_none(), "no chunk of an unanswered room");
    let completed = rooms_with(&target, "completed");
    assert_eq!(completed.len(), 5, "{holding}");
    assert!(rooms_with(&target, "failed").is_empty(), "{holding}");
    target.proc.write_line("quit");
}

// ---------------------------------------------------------------------
// The agent on the real target, `sglang-mooncake` profile.
// ---------------------------------------------------------------------

mod watched {
    use std::time::{Duration, Instant};

    use serde_json::Value;
    use stallwatch_tests::{
        Agent, Line, alerts,
        sglang::{Ipc, Target},
        summary,
    };

    pub const TIMEOUT: Duration = Duration::from_secs(2);
    /// How late past timeout an alert may come (the loop's turns, a loaded
    /// two-core machine).
    pub const LATENESS: Duration = Duration::from_millis(1500);

    /// The target set up, the agent on its prefill (`sglang-mooncake`,
    /// 2 s), then `go`; requests handed to the scheduler as msgpack, so a
    /// room starts when the scheduler has it (before any decode answers).
    pub fn watched(fault: &str, extra: &[&str]) -> (Target, Agent) {
        let mut target = Target::mooncake(fault, extra, Ipc::Msgpack);
        let agent = target.watch_and_go("sglang-mooncake", "2s", &[]);
        (target, agent)
    }

    /// The lines that are alerts (not the summary).
    pub fn alert_lines(lines: &[Line]) -> Vec<Value> {
        lines.iter().filter_map(Line::json).filter(|v| v.get("alert").is_some_and(|a| a != "summary")).collect()
    }

    /// The alert of `kind` keyed by `room`.
    pub fn of_room(lines: &[Line], kind: &str, room: u64) -> (Instant, Value) {
        alerts(lines, kind)
            .find(|(_, a)| a["key"] == format!("{room:#x}").as_str())
            .unwrap_or_else(|| panic!("no {kind} alert of room {room}: {:#?}", alert_lines(lines)))
    }

    /// `n` alerts of `kind` within `within`, then one timeout more for
    /// anything else, then the agent's every line.
    pub fn alerts_then_quiet(agent: Agent, kind: &str, n: usize, within: Duration) -> Vec<Line> {
        alerts_then_quiet_logged(agent, kind, n, within).0
    }

    /// [`alerts_then_quiet`], and what the agent logged.
    pub fn alerts_then_quiet_logged(agent: Agent, kind: &str, n: usize, within: Duration) -> (Vec<Line>, String) {
        let mut seen = Vec::new();
        agent.wait_until(&format!("{n} {kind}"), within, &mut seen, |seen| alerts(seen, kind).count() >= n);
        std::thread::sleep(TIMEOUT);
        let (lines, logged) = agent.stop_logged(libc::SIGINT);
        seen.extend(lines);
        (seen, logged)
    }

    /// The agent came after the target's warm-up rooms opened every
    /// decode's segment: each was read from the engine's own table in the
    /// prefill, at the first batch to it, none told from a room's status
    /// or left unknown.
    pub fn segments_read_from_the_engine(logged: &str, decodes: usize) {
        // Every decode's, and the prefill engine's own (segment 0).
        assert_eq!(exit_count(logged, "read_segments"), decodes + 1, "{logged}");
        let others = ["tables_unread", "learned_segments", "unknown_segment_batches"].map(|n| exit_count(logged, n));
        assert_eq!(others, [0, 0, 0], "{logged}");
    }

    /// A count of the framework's exit line (`Mooncake batches: ...`).
    pub fn exit_count(logged: &str, name: &str) -> usize {
        let line = logged.lines().find(|l| l.contains("Mooncake batches:")).unwrap_or_else(|| panic!("{logged}"));
        let at = line.find(&format!(" {name}=")).unwrap_or_else(|| panic!("no {name}: {line}"));
        let digits: String = line[at + name.len() + 2..].chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap_or_else(|_| panic!("{name}: {line}"))
    }

    pub fn counts(lines: &[Line]) -> [Option<u64>; 6] {
        let summary = summary(lines);
        ["seen", "completed", "stalled", "failed", "aborted", "lost_events"].map(|k| summary[k].as_u64())
    }
}

use stallwatch_tests::{alerts, summary};
use watched::*;

#[test]
fn watched_a_healthy_run_with_idle_workers_raises_nothing_and_each_room_is_one_lifecycle() {
    let (mut target, agent) = watched("none", &["--count", "12", "--decodes", "2", "--hold"]);
    let done = target.until("done", Duration::from_secs(120));
    assert_eq!([&done["completed"], &done["verified"]], [12, 12], "{done}");
    // Idle workers, then two timeouts more: nothing.
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let (lines, logged) = agent.stop_logged(libc::SIGINT);
    target.proc.write_line("quit");
    eprintln!("{}", summary(&lines));
    assert!(alert_lines(&lines).is_empty(), "a healthy run raised alerts: {:#?}", alert_lines(&lines));
    // Each room one lifecycle, released at its status. The segments the
    // warm-up rooms opened before the agent were read from the engine's
    // table; each decode's KV layout was learnt from rooms' first batches,
    // so a batch is the room whose pages it writes, whatever order SGLang's
    // worker takes rooms in. Until a layout is learnt a batch is the
    // earliest bootstrapped room's: a room taken out of that order then
    // (docs/frameworks/sglang-mooncake.md, "Attribution limits") has
    // batches of their own, completed at their free.
    segments_read_from_the_engine(&logged, 2);
    assert_eq!(exit_count(&logged, "kv_layouts"), 2, "{logged}");
    let [seen, completed, stalled, failed, aborted, lost] = counts(&lines).map(Option::unwrap);
    assert_eq!([completed, stalled, failed, aborted, lost], [seen, 0, 0, 0, 0], "{}", summary(&lines));
    assert!((12..=12 + 2 * 3).contains(&seen), "{}", summary(&lines));
    assert_eq!(summary(&lines)["in_flight"], 0);
    // The TCP transport's progress probe (ClientSession::writeBody, hit per
    // chunk) is linked only near a stall: a healthy run never pays for it.
    let probes = summary(&lines)["probes"].as_array().expect("probes").clone();
    let write_body = probes.iter().find(|p| p["symbol"] == WRITE_BODY).expect("the writeBody probe");
    assert_eq!((&write_body["attached"], &write_body["hits"]), (&"on_demand_idle".into(), &0.into()), "{write_body}");
}

/// Mooncake's TCP transport: a chunk of a request's body written to the
/// peer's socket (the `sglang-mooncake` profile's progress probe).
const WRITE_BODY: &str = "_ZN8mooncake13ClientSession9writeBodyEv";

/// Every point the profile attaches in a process with the engine and
/// libzmq mapped (tests/sglang/mooncake/bench_write.py, held before `go`)
/// begins with an instruction the kernel emulates (a single-stepped one
/// costs ~45 us a hit here), the TCP transport's progress probe too.
#[test]
fn every_sglang_mooncake_probe_lands_on_an_emulated_instruction() {
    use stallwatch_tests::{Proc, agent_bin, run_to_end, sglang_python, wait_for};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut loaded = Proc::spawn(
        "bench_write.py, held before go",
        Command::new(sglang_python()).arg(root.join("tests/sglang/mooncake/bench_write.py")).args(["--count", "1"]),
    );
    let ready = wait_for("the ready line", Duration::from_secs(180), || {
        loaded.lines_now().iter().find_map(|line| line.json().filter(|v| v["event"] == "ready"))
    });
    let pid = ready["pid"].as_u64().expect("pid").to_string();
    let (ok, out, err) =
        run_to_end(Command::new(agent_bin()).args(["profile", "check", "sglang-mooncake", "--pid", &pid]));
    loaded.write_line("quit");
    assert!(ok, "profile check: {err}");
    let points: Vec<&str> = out
        .lines()
        .skip_while(|line| *line != "in the process:")
        .skip(1)
        .take_while(|line| line.starts_with("  line "))
        .collect();
    // freeBatchID, submitTransfer, openSegment, 6 libzmq signals, writeBody.
    assert_eq!(points.len(), 10, "{out}");
    for point in &points {
        assert!(point.contains("(emulated") && !point.contains("single-stepped"), "{point}");
    }
    assert!(points.iter().any(|p| p.contains(WRITE_BODY) && p.contains(": push (emulated")), "{out}");
}

/// `alert` came within [timeout, timeout + lateness] of `since`, less
/// `early` for an activity the target prints just after it happens.
fn timed_from(alert: &Value, at: Instant, since: Instant, early: Duration) {
    let latency = at.saturating_duration_since(since);
    assert!(latency + early >= TIMEOUT && latency <= TIMEOUT + LATENESS, "{alert} after {latency:?}");
}

fn field<'a>(alert: &'a Value, name: &str) -> Option<&'a str> {
    alert[name].as_str()
}

#[test]
fn watched_a_room_whose_decode_never_answers_waits_for_its_peer() {
    let (mut target, agent) = watched("no-answer", &["--count", "6", "--decodes", "2", "--settle", "3"]);
    let fault = target.fault_room();
    let holding = target.until("holding", Duration::from_secs(60));
    assert_eq!(holding["rooms"][fault.to_string()], "bootstrapping", "{holding}");
    let seen = alerts_then_quiet(agent, "stalled", 1, TIMEOUT + Duration::from_secs(5));
    target.proc.write_line("quit");
    let raised = alert_lines(&seen);
    assert_eq!(raised.len(), 1, "{raised:#?}");
    let (at, alert) = of_room(&seen, "stalled", fault);
    assert_eq!(
        (field(&alert, "class"), field(&alert, "answered"), field(&alert, "waiting_on")),
        (Some("waiting_for_peer"), Some("0"), Some("peer")),
        "{alert}"
    );
    assert_eq!(field(&alert, "external_id"), Some(fault.to_string().as_str()), "{alert}");
    timed_from(&alert, at, target.at("request", fault), Duration::from_millis(300));
}

/// One transfer worker, three decodes; the fault room's decode SIGSTOPped
/// as it is bootstrapped: the room is `transfer_hung` on its batch, naming
/// the batch and the stopped decode's session, timed from the batch's
/// submit (its first chunk); the rooms queued behind it on the worker say
/// `behind` it, `waiting_on=worker`, `waiting_for_peer`: those not started
/// with both ranks answered, and one the worker had begun (another
/// decode's room, whose first chunk went before the fault room's and whose
/// next ones are queued behind it) too, with no batch of its own: one hung
/// batch is one `transfer_hung`.
#[test]
fn watched_a_decode_stopped_mid_transfer_hangs_its_room_and_the_rooms_behind_it_say_so() {
    let (mut target, agent) =
        watched("hang", &["--count", "6", "--decodes", "3", "--queue-size", "1", "--settle", "3"]);
    let fault = target.fault_room();
    let stopped = target.until("decode_stopped", Duration::from_secs(60));
    let holding = target.until("holding", Duration::from_secs(60));
    assert_eq!(holding["rooms"][fault.to_string()], "inflight", "{holding}");
    // Every room not concluded waits on the one worker; the rooms after the
    // fault room's are held back until its decode is stopped.
    let open = |r: &u64| {
        *r != fault && !["completed", "failed"].contains(&holding["rooms"][r.to_string()].as_str().unwrap_or(""))
    };
    let behind: Vec<u64> = target.rooms().into_iter().filter(open).collect();
    assert_eq!(behind.iter().filter(|&&r| r > fault).count(), 2, "{holding}");
    // A room the worker took a chunk of (handed to the sender, no longer in
    // the worker's queue) is mid-transfer.
    let queued = |r: u64| {
        let workers = holding["workers"].as_object().expect("workers");
        workers.values().flat_map(|q| q.as_array().expect("a queue")).filter(|q| **q == r).count()
    };
    let begun: Vec<u64> = behind.iter().copied().filter(|&r| target.chunks(r) > queued(r)).collect();
    let stalled = 1 + behind.len();
    let (seen, logged) = alerts_then_quiet_logged(agent, "stalled", stalled, TIMEOUT + Duration::from_secs(8));
    target.proc.write_line("quit");
    let raised = alert_lines(&seen);
    assert_eq!(raised.len(), stalled, "{raised:#?}");
    // Rooms of the three decodes on one worker: each batch its room's,
    // through the segments read from the engine's table.
    segments_read_from_the_engine(&logged, 3);
    let session = {
        let decode = stopped["decode"].as_u64().expect("decode");
        let decodes = target.ready["decodes"].as_array().expect("decodes");
        let d = decodes.iter().find(|d| d["index"] == decode).expect("the stopped decode");
        d["session"].as_str().expect("session").to_owned()
    };
    let (at, hung) = of_room(&seen, "stalled", fault);
    assert_eq!(
        (field(&hung, "class"), field(&hung, "peer")),
        (Some("transfer_hung"), Some(session.as_str())),
        "{hung}"
    );
    assert!(field(&hung, "batch").is_some_and(|b| b.starts_with("0x")), "{hung}");
    // Stopped once bootstrapped, so before its first chunk's batch.
    timed_from(&hung, at, target.chunk(fault, 0).expect("its first chunk"), Duration::from_millis(300));
    for room in &behind {
        let (_, alert) = of_room(&seen, "stalled", *room);
        assert_eq!(
            (field(&alert, "class"), field(&alert, "behind"), field(&alert, "waiting_on")),
            (Some("waiting_for_peer"), Some(fault.to_string().as_str()), Some("worker")),
            "room {room} ({} chunks, {} queued, begun: {}): {alert}",
            target.chunks(*room),
            queued(*room),
            begun.contains(room),
        );
        assert_eq!(field(&alert, "batch"), None, "its next chunk is queued, no batch of its own: {alert}");
    }
}

/// One transfer worker; once every earlier room concluded, the fault
/// room's first chunk makes SGLang's worker raise and its thread end (a
/// device fault at the chunk's indices event): the fault room and every
/// room queued on that worker wait for good, no batch, no status. Each is
/// alerted saying it waits on its worker, that the worker `exited`, and
/// its thread id, the one SGLang's dead worker thread had.
#[test]
fn watched_a_transfer_worker_that_dies_leaves_its_rooms_waiting_on_it_and_says_so() {
    let (mut target, agent) =
        watched("worker-dies", &["--count", "6", "--decodes", "2", "--queue-size", "1", "--settle", "3"]);
    let fault = target.fault_room();
    let holding = target.until("holding", Duration::from_secs(60));
    let threads = holding["transfer_threads"].as_object().expect("transfer_threads");
    let dead: Vec<&String> = threads.iter().filter(|(_, alive)| **alive == false).map(|(tid, _)| tid).collect();
    assert_eq!(dead.len(), 1, "SGLang's one worker thread ended: {holding}");
    let open = |r: &u64| !["completed", "failed"].contains(&holding["rooms"][r.to_string()].as_str().unwrap_or(""));
    let waiting: Vec<u64> = target.rooms().into_iter().filter(open).collect();
    assert!(waiting.contains(&fault) && waiting.len() >= 2, "the fault room and a room behind it: {holding}");
    assert!(waiting.iter().all(|&r| r >= fault), "every room before the fault room concluded first: {holding}");
    let seen = alerts_then_quiet(agent, "stalled", waiting.len(), TIMEOUT + Duration::from_secs(8));
    target.proc.write_line("quit");
    let raised = alert_lines(&seen);
    assert_eq!(raised.len(), waiting.len(), "{raised:#?}");
    for room in &waiting {
        let (at, alert) = of_room(&seen, "stalled", *room);
        assert_eq!(
            (field(&alert, "waiting_on"), field(&alert, "worker"), field(&alert, "worker_tid")),
            (Some("worker"), Some("exited"), Some(dead[0].as_str())),
            "room {room}: {alert}"
        );
        assert_eq!(field(&alert, "batch"), None, "no batch of it went: {alert}");
        // Silent since its decode answered (its last activity the agent saw).
        timed_from(&alert, at, target.at("decode_answered", *room), Duration::from_millis(500));
    }
}

/// MC_TRANSFER_TIMEOUT 5 s: the fault room is `transfer_hung` at 2 s, then
/// its batch's free is refused at 5 s: the room `failed` once, and the
/// batch, leaked, is a finding of its own (a `leaked` alert, `leaked=batch`,
/// its room and peer, `release=refused`, `after_ms` from its submit),
/// counted `leaked`; the rooms behind it recover and complete.
#[test]
fn watched_a_batch_that_times_out_fails_its_room_once_and_leaks() {
    let (mut target, agent) =
        watched("timeout", &["--count", "6", "--decodes", "3", "--queue-size", "1", "--settle", "12"]);
    let fault = target.fault_room();
    let done = target.until("done", Duration::from_secs(90));
    assert_eq!([&done["completed"], &done["failed"]], [5, 1], "{done}");
    std::thread::sleep(TIMEOUT);
    let seen = agent.stop();
    let (_, hung) = of_room(&seen, "stalled", fault);
    assert_eq!(field(&hung, "class"), Some("transfer_hung"), "{hung}");
    let failed: Vec<Value> = alerts(&seen, "failed").map(|(_, a)| a).collect();
    let rooms_failed: Vec<&Value> = failed.iter().filter(|a| a["external_id"].is_string()).collect();
    assert_eq!((rooms_failed.len(), failed.len()), (1, 1), "the room fails once: {failed:#?}");
    assert_eq!(rooms_failed[0]["key"], format!("{fault:#x}").as_str(), "{failed:#?}");
    let leaks: Vec<Value> = alerts(&seen, "leaked").map(|(_, a)| a).collect();
    let [leak] = &leaks[..] else { panic!("one leaked batch: {leaks:#?}") };
    assert_eq!((field(leak, "leaked"), field(leak, "release")), (Some("batch"), Some("refused")), "{leak}");
    assert_eq!(field(leak, "room"), Some(fault.to_string().as_str()), "{leak}");
    assert_eq!(field(leak, "batch"), field(&hung, "batch"), "the hung batch leaked: {leak}");
    assert_eq!(field(leak, "peer"), field(&hung, "peer"), "{leak}");
    let after: u64 = field(leak, "after_ms").and_then(|ms| ms.parse().ok()).unwrap_or_else(|| panic!("{leak}"));
    assert!((4800..9000).contains(&after), "refused at MC_TRANSFER_TIMEOUT after its submit: {leak}");
    let [seen_n, completed, _, failed_n, aborted, lost] = counts(&seen).map(Option::unwrap);
    assert_eq!([failed_n, aborted, lost], [1, 0, 0], "the room: {}", summary(&seen));
    assert_eq!(summary(&seen)["leaked"], 1, "its batch: {}", summary(&seen));
    assert_eq!(completed + 2, seen_n, "{}", summary(&seen));
}

/// A decode killed once its room is bootstrapped: the room's batch fails
/// at once, its free refused: the room `failed` once and the batch leaked;
/// the dead decode's later room waits for its peer.
#[test]
fn watched_a_decode_killed_after_answering_fails_its_room_once_and_leaks_its_batch() {
    let (mut target, agent) = watched("decode-dies", &["--count", "8", "--decodes", "2", "--settle", "3"]);
    let fault = target.fault_room();
    target.until("decode_killed", Duration::from_secs(60));
    let holding = target.until("holding", Duration::from_secs(60));
    let unanswered = target.rooms_in(&holding, "bootstrapping");
    assert!(!unanswered.is_empty(), "{holding}");
    let seen = alerts_then_quiet(agent, "stalled", unanswered.len(), TIMEOUT + Duration::from_secs(5));
    target.proc.write_line("quit");
    // The rooms SGLang failed (the fault room; a room of the other decode
    // whose batch the kill broke too, when it happens): each alerted
    // `failed` once, and each leaked its batch (a `leaked` alert).
    let failed: Vec<Value> = alerts(&seen, "failed").map(|(_, a)| a).collect();
    let mut rooms_failed: Vec<u64> = failed.iter().filter_map(|a| a["external_id"].as_str()?.parse().ok()).collect();
    rooms_failed.sort_unstable();
    assert_eq!(rooms_failed, target.rooms_in(&holding, "failed"), "{failed:#?}\n{holding}");
    assert!(rooms_failed.contains(&fault), "{failed:#?}");
    let leaks: Vec<Value> = alerts(&seen, "leaked").map(|(_, a)| a).collect();
    assert!(leaks.iter().all(|a| field(a, "leaked") == Some("batch")), "{leaks:#?}");
    let leak = leaks.iter().find(|a| field(a, "room") == Some(fault.to_string().as_str()));
    let leak = leak.unwrap_or_else(|| panic!("the fault room's batch leaked: {leaks:#?}"));
    let after: u64 = field(leak, "after_ms").and_then(|ms| ms.parse().ok()).unwrap_or_else(|| panic!("{leak}"));
    assert!(after < 2000, "a dead peer fails the batch at once: {leak}");
    for room in &unanswered {
        let (_, alert) = of_room(&seen, "stalled", *room);
        assert_eq!(
            (field(&alert, "class"), field(&alert, "answered")),
            (Some("waiting_for_peer"), Some("0")),
            "{alert}"
        );
    }
    assert_eq!(leaks.len(), rooms_failed.len(), "{failed:#?}");
    assert_eq!(alert_lines(&seen).len(), 2 * rooms_failed.len() + unanswered.len(), "{:#?}", alert_lines(&seen));
}

/// The decode's ABORT after the room's first chunk: the room ends
/// `aborted` on the prefill, nothing raised.
#[test]
fn watched_a_decode_abort_racing_a_chunk_ends_its_room_aborted() {
    let (mut target, agent) = watched("abort", &["--count", "6", "--decodes", "2", "--hold"]);
    let done = target.until("done", Duration::from_secs(60));
    assert_eq!(done["failed"], 1, "{done}");
    target.at("decode_abort_sent", target.fault_room());
    std::thread::sleep(TIMEOUT * 2 + LATENESS);
    let lines = agent.stop();
    target.proc.write_line("quit");
    assert!(alert_lines(&lines).is_empty(), "{:#?}", alert_lines(&lines));
    let [seen, completed, stalled, failed, aborted, lost] = counts(&lines).map(Option::unwrap);
    assert_eq!([stalled, failed, aborted, lost], [0, 0, 1, 0], "{}", summary(&lines));
    assert_eq!(completed + 1, seen, "{}", summary(&lines));
}

/// Both sides of one hung room, each watched by its own agent on the
/// `sglang-mooncake` profile: the prefill's room `transfer_hung`, the
/// stopped decode's `waiting_for_kv` (`side=decode`, `waiting_on=prefill`:
/// it sent its destination, no status came), both stall spans in the
/// room's one trace.
#[test]
fn watched_both_sides_of_a_hung_room_are_alerted_in_one_trace() {
    use stallwatch_tests::{
        Agent,
        otlp::{Collector, assert_both_sides_stalled_in_the_rooms_trace},
        sglang::{Ipc, Target},
    };
    let collector = Collector::start();
    let endpoint = collector.http_endpoint();
    let mut target = Target::mooncake("hang", &["--count", "6", "--decodes", "2", "--settle", "3"], Ipc::Msgpack);
    let otlp = ["--otlp-endpoint", endpoint.as_str()];
    let prefill = Agent::watch(target.prefill(), "sglang-mooncake", "2s", &otlp);
    let decodes: Vec<u32> = (0..2).map(|i| target.decode_pid(i)).collect();
    let decode_agents: Vec<Agent> =
        decodes.iter().map(|pid| Agent::watch(*pid, "sglang-mooncake", "2s", &otlp)).collect();
    target.proc.write_line("go");
    let stopped = target.until("decode_stopped", Duration::from_secs(60));
    let stopped_pid = decodes[stopped["decode"].as_u64().expect("decode") as usize];
    let room = target.fault_room();
    let key = format!("{room:#x}");
    let prefill_seen = alerts_then_quiet(prefill, "stalled", 1, TIMEOUT + Duration::from_secs(8));
    let (_, hung) = of_room(&prefill_seen, "stalled", room);
    assert_eq!(hung["class"], "transfer_hung", "{hung}");
    let mut decode_alerts = Vec::new();
    for agent in decode_agents {
        decode_alerts.extend(alert_lines(&agent.stop()));
    }
    target.proc.write_line("quit");
    // The stopped decode alone is silent on a room it asked for.
    let waiting: Vec<&Value> = decode_alerts.iter().filter(|a| a["key"] == key.as_str()).collect();
    let [waiting] = &waiting[..] else { panic!("the stopped decode's stall of room {room}: {decode_alerts:#?}") };
    assert_eq!(waiting["pid"], stopped_pid, "{waiting}");
    let side = (field(waiting, "class"), field(waiting, "side"), field(waiting, "waiting_on"));
    // The decode is the one stopped: its own agent says it waits on itself.
    assert_eq!(side, (Some("waiting_for_kv"), Some("decode"), Some("self")), "{waiting}");
    assert_eq!(waiting["transport"]["verdict"], "process_stopped", "{waiting}");
    assert_both_sides_stalled_in_the_rooms_trace(collector, room);
}

/// A room held across an agent restart: the fault room's decode never
/// answers; the first agent is SIGKILLed before the room's timeout, the
/// next takes the room over from the kernel's in-flight table and reports
/// it once, timed from the request, not from the take-over.
#[test]
fn watched_a_room_held_across_an_agent_restart_is_reported_once_on_time() {
    use stallwatch_tests::{
        Agent,
        sglang::{Ipc, Target},
    };
    const LONGER: Duration = Duration::from_secs(6);
    let mut target = Target::mooncake("no-answer", &["--count", "6", "--decodes", "2", "--settle", "2"], Ipc::Msgpack);
    let mut first = target.watch_and_go("sglang-mooncake", "6s", &[]);
    target.until("holding", Duration::from_secs(60));
    let room = target.fault_room();
    let since = target.at("request", room);
    assert!(since.elapsed() < LONGER - Duration::from_secs(2), "still short of its timeout: {:?}", since.elapsed());
    let dir = first.bpf_dir.take().expect("its own bpf directory");
    first.proc.signal(libc::SIGKILL);
    let _ = first.proc.wait(Duration::from_secs(5));
    let mut second =
        Agent::watch(target.prefill(), "sglang-mooncake", "6s", &["--bpf-dir", dir.to_str().expect("utf-8 bpf dir")]);
    second.bpf_dir = Some(dir);
    let mut seen = Vec::new();
    second.wait_until("the room's stall", LONGER + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").next().is_some()
    });
    std::thread::sleep(Duration::from_secs(1));
    seen.extend(second.stop());
    target.proc.write_line("quit");
    let stalls: Vec<(Instant, Value)> = alerts(&seen, "stalled").collect();
    let [(at, alert)] = &stalls[..] else { panic!("one stall, the room's: {seen:?}") };
    assert_eq!(
        (alert["key"].as_str(), alert["class"].as_str()),
        (Some(format!("{room:#x}").as_str()), Some("waiting_for_peer")),
        "{alert}"
    );
    let latency = at.saturating_duration_since(since);
    assert!(
        latency + Duration::from_millis(200) >= LONGER && latency <= LONGER + LATENESS,
        "{alert} after {latency:?}"
    );
}

/// A decode stopped before its room's first chunk: the batch's bytes fit
/// in the stopped peer's socket, so nothing is written while the room
/// hangs. Its `transfer_hung` alert says so from the TCP transport's
/// progress probe, linked once the room was silent half the timeout (4 s
/// here, so the probe has two seconds to be linked on a loaded host): no
/// chunk written since, nothing completed to that decode (named by its
/// session) or to any other, and the verdict: `no_progress` over a window
/// long enough to tell, else `idle` (the probe linked late), never one
/// that says bytes or batches moved.
#[test]
fn watched_a_hung_rooms_transport_evidence_says_no_bytes_moved_to_its_stopped_decode() {
    let mut target = Target::mooncake("hang", &["--count", "3", "--decodes", "1", "--queue-size", "1"], Ipc::Msgpack);
    let agent = target.watch_and_go("sglang-mooncake", "4s", &[]);
    let fault = target.fault_room();
    target.until("decode_stopped", Duration::from_secs(60));
    let mut seen = Vec::new();
    let hung = |seen: &[stallwatch_tests::Line]| {
        alerts(seen, "stalled").any(|(_, a)| a["key"] == format!("{fault:#x}").as_str())
    };
    agent.wait_until("the fault room's stall", Duration::from_secs(30), &mut seen, hung);
    seen.extend(agent.stop());
    target.proc.write_line("quit");
    let (_, alert) = of_room(&seen, "stalled", fault);
    eprintln!("{alert}");
    assert_eq!(field(&alert, "class"), Some("transfer_hung"), "{alert}");
    let session = target.ready["decodes"][0]["session"].as_str().expect("the decode's session").to_owned();
    let transport = &alert["transport"];
    assert_eq!(transport["peer"].as_str(), Some(session.as_str()), "{alert}");
    let completion = &transport["completion"];
    assert_eq!((&completion["to_peer"], &completion["to_other_peers"]), (&0.into(), &0.into()), "{alert}");
    assert_eq!(completion["since"], 0, "{alert}");
    let progress = &transport["progress"];
    assert_eq!(progress["since"], 0, "no chunk written since its submit: {alert}");
    let window = progress["window_ms"].as_u64().expect("the progress probe was linked before the stall");
    let verdict = transport["verdict"].as_str().expect("verdict");
    // The window that tells no_progress: a quarter of the timeout.
    if window >= 1_000 {
        assert_eq!(verdict, "no_progress", "{alert}");
    } else {
        assert_eq!(verdict, "idle", "{alert}");
    }
    assert!(
        transport["summary"].as_str().is_some_and(|s| s.contains(&format!("none to {session} completed"))),
        "{alert}"
    );
}
