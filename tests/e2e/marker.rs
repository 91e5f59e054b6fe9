//! The marker library (common/marker) and the built-in `marker` profile: a
//! real process calling `stallwatch_mark(room, event)` through the Python
//! wrapper, the real agent attached with real uprobes.
use std::{collections::HashMap, process::Command, time::Duration};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Proc, agent_bin, alerts, marker_lib, require_root, root, run_to_end, summary, test_socket, venv_python,
};

const TIMEOUT: Duration = Duration::from_secs(1);
const LATENESS: Duration = Duration::from_secs(1);
const STAGES: [&str; 6] = ["enqueued", "transfer_posted", "transfer_done", "released", "aborted", "failed"];

#[test]
fn marked_stages_are_lifecycles_keyed_by_room_and_unfinished_rooms_stall() {
    require_root();
    let mut driver = Proc::spawn(
        "marker driver",
        Command::new(venv_python()).arg(root().join("tests/marker/driver.py")).arg(marker_lib()),
    );
    let ready = driver.next_line(Duration::from_secs(10), "ready line").json().expect("ready line is JSON");
    let pid = ready["pid"].as_u64().expect("pid") as u32;
    let socket = test_socket();
    let socket_arg = socket.to_str().expect("utf-8 socket path");
    let agent = Agent::watch(pid, "marker", "1s", &["--socket", socket_arg]);
    // Every stage function is probed at its first instruction, a nop the
    // kernel emulates (the cheapest kind of probed instruction).
    let stderr = agent.proc.stderr();
    for stage in STAGES {
        let symbol = format!("symbol=stallwatch_mark_{stage} ");
        let attached = stderr.lines().find(|l| l.contains("probe attached") && l.contains(&symbol));
        let attached = attached.unwrap_or_else(|| panic!("no probe on stallwatch_mark_{stage}:\n{stderr}"));
        assert!(attached.contains("first_insn=nop (emulated"), "{attached}");
    }

    driver.write_line("go");
    let marked = driver.next_line(Duration::from_secs(10), "marked line");
    assert_eq!(marked.json().expect("marked line is JSON")["event"], "marked", "{}", marked.text);

    // The rooms the driver left unfinished stall, each at its own stage,
    // keyed by the room, its decimal text the external id.
    let stalled_rooms: HashMap<u64, (&str, &str)> = HashMap::from([
        ((1 << 63) - 1, ("waiting_for_peer", "enqueued")),
        (7003, ("transfer_hung", "transfer_posted")),
        (7004, ("release_lost", "transfer_done")),
    ]);
    let mut seen = Vec::new();
    let stalls = agent.wait_alerts("stalled", 3, TIMEOUT + Duration::from_secs(5), &mut seen);
    for (at, alert) in &stalls {
        let room = stalled_rooms
            .keys()
            .find(|room| alert["key"] == format!("{room:#x}").as_str())
            .unwrap_or_else(|| panic!("stall of an unexpected request: {alert}"));
        let (class, stage) = stalled_rooms[room];
        assert_eq!(alert["class"], class, "{alert}");
        assert_eq!(alert["stage"], stage, "{alert}");
        assert_eq!(alert["external_id"], room.to_string().as_str(), "{alert}");
        let latency = at.duration_since(marked.at);
        assert!(
            latency >= TIMEOUT - Duration::from_millis(50) && latency <= TIMEOUT + LATENESS,
            "{alert} after {latency:?}"
        );
    }
    let (ok, stdout, stderr) =
        run_to_end(Command::new(agent_bin()).args(["inflight", "--json", "--socket", socket_arg]));
    assert!(ok, "{stderr}");
    let inflight: Value = serde_json::from_str(&stdout).expect("inflight JSON");
    let mut held: Vec<(String, String)> = inflight["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .map(|r| {
            (r["external_id"].as_str().expect("external_id").to_owned(), r["stage"].as_str().expect("stage").to_owned())
        })
        .collect();
    held.sort();
    let mut expected: Vec<(String, String)> =
        stalled_rooms.iter().map(|(room, (_, stage))| (room.to_string(), (*stage).to_owned())).collect();
    expected.sort();
    assert_eq!(held, expected, "{inflight}");

    seen.extend(agent.stop());
    let failed: Vec<Value> = alerts(&seen, "failed").map(|(_, v)| v).collect();
    assert_eq!(failed.len(), 1, "{seen:?}");
    assert_eq!(failed[0]["external_id"], "7006", "{}", failed[0]);
    let summary = summary(&seen);
    assert_eq!(summary["seen"], 6, "{summary}");
    assert_eq!(summary["completed"], 1, "{summary}");
    assert_eq!(summary["aborted"], 1, "{summary}");
    assert_eq!(summary["failed"], 1, "{summary}");
    assert_eq!(summary["in_flight"], 3, "{summary}");
    assert_eq!(summary["lost_events"], 0, "{summary}");
    assert_eq!(alerts(&seen, "stalled").count(), 3, "each stall once: {seen:?}");
}
