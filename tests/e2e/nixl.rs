//! The built-in `nixl` profile on real NIXL: two processes doing real
//! DRAM-to-DRAM transfers over UCX on loopback (tests/nixl/driver.py), real
//! faults, the real eBPF object in this kernel.
use std::{
    collections::HashMap,
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{Agent, Line, Proc, agent_bin, alerts, require_root, root, run_to_end, summary, test_socket, venv_python};

const TIMEOUT: Duration = Duration::from_secs(2);
const LATENESS: Duration = Duration::from_secs(1);

/// The driver, connected (warm-up transfer done) and waiting for `go`.
struct Driver {
    proc: Proc,
    initiator: u32,
    lines: Vec<Line>,
}

impl Driver {
    fn start(mode: &str, count: usize) -> Self {
        require_root();
        let proc = Proc::spawn(
            "nixl driver",
            Command::new(venv_python())
                .arg(root().join("tests/nixl/driver.py"))
                .args(["--mode", mode, "--count", &count.to_string(), "--max-seconds", "60"]),
        );
        let ready = proc.next_line(Duration::from_secs(30), "ready line");
        let value = ready.json().unwrap_or_else(|| panic!("driver said: {}", ready.text));
        assert_eq!(value["event"], "ready", "{value}");
        let initiator = value["initiator_pid"].as_u64().expect("initiator_pid") as u32;
        Self { proc, initiator, lines: vec![ready] }
    }

    /// Attach the agent, then let the driver run.
    fn watched(mode: &str, count: usize) -> (Self, Agent) {
        Self::watched_with(mode, count, &[])
    }

    fn watched_with(mode: &str, count: usize, extra: &[&str]) -> (Self, Agent) {
        let mut driver = Self::start(mode, count);
        let agent = Agent::watch(driver.initiator, "nixl", "2s", extra);
        driver.proc.write_line("go");
        (driver, agent)
    }

    /// Read driver lines until one with `event`.
    fn until(&mut self, event: &str, within: Duration) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let line = self.proc.next_line(deadline.saturating_duration_since(Instant::now()), event);
            let value = line.json();
            self.lines.push(line);
            if let Some(value) = value.filter(|v| v["event"] == event) {
                return value;
            }
        }
    }

    /// Requests the driver reported, by handle: (room, when last touched).
    fn requests(&self, event: &str) -> HashMap<String, (String, Instant)> {
        self.lines
            .iter()
            .filter_map(|line| {
                let value = line.json()?;
                (value["event"] == event).then(|| {
                    let handle = value["handle"].as_str().expect("handle").to_owned();
                    (normalize(&handle), (value["room"].as_str().expect("room").to_owned(), line.at))
                })
            })
            .collect()
    }
}

/// Hex as the agent prints it (`{:#x}`).
fn normalize(hex: &str) -> String {
    format!("{:#x}", u64::from_str_radix(hex.trim_start_matches("0x"), 16).expect("hex handle"))
}

/// Each request of `requests` stalls once with `class`, its room as the
/// external id, after the timeout and no later than timeout + 1 s after the
/// driver last touched it.
fn assert_stalls(stalls: &[(Instant, Value)], requests: &HashMap<String, (String, Instant)>, class: &str) {
    assert_eq!(stalls.len(), requests.len(), "{stalls:?}");
    for (at, alert) in stalls {
        let key = alert["key"].as_str().expect("key");
        let (room, touched) = requests.get(key).unwrap_or_else(|| panic!("stall of an unknown request: {alert}"));
        assert_eq!(alert["class"], class, "{alert}");
        assert_eq!(alert["external_id"], room.as_str(), "{alert}");
        let latency = at.duration_since(*touched);
        assert!(latency >= TIMEOUT - Duration::from_millis(50) && latency <= TIMEOUT + LATENESS, "{alert} after {latency:?}");
    }
}

#[test]
fn created_never_posted_is_waiting_for_peer() {
    let (mut driver, agent) = Driver::watched("never-post", 3);
    driver.until("holding", Duration::from_secs(20));
    let mut seen = Vec::new();
    let stalls = agent.wait_alerts("stalled", 3, TIMEOUT + Duration::from_secs(5), &mut seen);
    assert_stalls(&stalls, &driver.requests("created"), "waiting_for_peer");
    seen.extend(agent.stop());
    assert_eq!(alerts(&seen, "stalled").count(), 3, "each once: {seen:?}");
}

#[test]
fn posted_to_a_stopped_peer_is_transfer_hung() {
    let socket = test_socket();
    let socket_arg = socket.to_str().expect("utf-8 socket path");
    let (mut driver, agent) = Driver::watched_with("hang", 3, &["--socket", socket_arg]);
    driver.until("holding", Duration::from_secs(20));
    let mut seen = Vec::new();
    let stalls = agent.wait_alerts("stalled", 3, TIMEOUT + Duration::from_secs(5), &mut seen);
    assert_stalls(&stalls, &driver.requests("posted"), "transfer_hung");
    for (_, alert) in &stalls {
        assert_eq!(alert["stage"], "transfer_posted", "{alert}");
        // The transport evidence: UCX progress polled all along, the put
        // was posted, nothing completed since.
        let transport = &alert["transport"];
        assert_eq!(transport["verdict"], "peer_unresponsive", "{alert}");
        assert!(transport["progress"]["since"].as_u64().expect("progress since") > 0, "{alert}");
        assert_eq!(transport["completion"]["since"], 0, "{alert}");
        assert!(transport["post"]["total"].as_u64().expect("post total") > 0, "{alert}");
        assert!(transport["summary"].as_str().expect("summary").contains("none completed"), "{alert}");
    }
    // The on-call view shows the same: every hung request with its verdict,
    // and the process's transport counts.
    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(["inflight", "--json", "--socket", socket_arg]));
    assert!(ok, "{stderr}");
    let inflight: Value = serde_json::from_str(&stdout).expect("inflight JSON");
    let requests = inflight["requests"].as_array().expect("requests");
    assert_eq!(requests.len(), 3, "{inflight}");
    for request in requests {
        assert_eq!(request["class"], "transfer_hung", "{request}");
        assert_eq!(request["transport"]["verdict"], "peer_unresponsive", "{request}");
    }
    let process = &inflight["processes"][0];
    assert!(process["transport"]["progress"]["total"].as_u64().expect("progress total") > 0, "{process}");
    assert!(process["transport"]["post"]["total"].as_u64().expect("post total") >= 3, "{process}");
    // The initiator keeps polling getXferStatus (IN_PROG) the whole time:
    // polls are not life, and nothing else is reported.
    std::thread::sleep(Duration::from_secs(1));
    seen.extend(agent.stop());
    assert_eq!(alerts(&seen, "stalled").count(), 3, "{seen:?}");
    assert_eq!(alerts(&seen, "recovered").count(), 0, "{seen:?}");
}

#[test]
fn done_never_released_is_release_lost() {
    let (mut driver, agent) = Driver::watched("no-release", 3);
    driver.until("holding", Duration::from_secs(20));
    let mut seen = Vec::new();
    let stalls = agent.wait_alerts("stalled", 3, TIMEOUT + Duration::from_secs(5), &mut seen);
    assert_stalls(&stalls, &driver.requests("completed"), "release_lost");
    let lines = agent.stop();
    assert_eq!(summary(&lines)["in_flight"], 3, "{lines:?}");
}

#[test]
fn a_killed_initiator_ends_its_requests_process_exited() {
    let (mut driver, agent) = Driver::watched("inflight-kill", 3);
    driver.until("holding", Duration::from_secs(20));
    let posted = driver.requests("posted");
    assert_eq!(posted.len(), 3);
    // SIGKILL the initiator (the driver process itself) with 3 in flight.
    driver.proc.signal(libc::SIGKILL);
    let lines = agent.proc.lines_until_exit(Duration::from_secs(20));
    let exited: Vec<Value> = alerts(&lines, "process_exited").map(|(_, v)| v).collect();
    assert_eq!(exited.len(), 3, "{lines:?}");
    for alert in &exited {
        let key = alert["key"].as_str().expect("key");
        assert!(posted.contains_key(key), "{alert}");
        assert_eq!(alert["stage"], "transfer_posted", "{alert}");
        assert_eq!(alert["external_id"], posted[key].0.as_str(), "{alert}");
    }
    assert_eq!(summary(&lines)["process_exited"], 3);
}

#[test]
fn two_thousand_healthy_transfers_raise_no_alert() {
    let (mut driver, agent) = Driver::watched("healthy", 2000);
    let done = driver.until("done", Duration::from_secs(60));
    assert_eq!(done["transfers"], 2000, "{done}");
    // The driver exits after a healthy run, and the agent with it.
    let lines = agent.proc.lines_until_exit(Duration::from_secs(30));
    let alert_lines: Vec<&Line> = lines.iter().filter(|l| l.json().is_some_and(|v| v["alert"] != "summary")).collect();
    assert!(alert_lines.is_empty(), "healthy transfers raised alerts: {alert_lines:?}");
    let summary = summary(&lines);
    assert_eq!(summary["seen"], 2000, "{summary}");
    assert_eq!(summary["completed"], 2000, "{summary}");
    assert_eq!(summary["lost_events"], 0, "{summary}");

    // Transport probes: UCX really ran under every transfer; the RDMA verbs
    // transports the wheel ships are loaded, attached, and never called
    // (this machine has no RDMA device).
    let hits: HashMap<&str, u64> = summary["probes"]
        .as_array()
        .expect("probes")
        .iter()
        .map(|p| (p["symbol"].as_str().expect("symbol"), p["hits"].as_u64().expect("hits")))
        .collect();
    assert!(hits["ucp_put_nbx"] >= 2000, "{hits:?}");
    assert!(hits["ucp_worker_progress"] > 0, "{hits:?}");
    for verbs in ["uct_rc_verbs_ep_put_zcopy", "uct_rc_verbs_ep_get_zcopy", "uct_rc_mlx5_base_ep_put_zcopy", "uct_rc_mlx5_base_ep_get_zcopy"] {
        assert_eq!(hits.get(verbs), Some(&0), "{verbs} attached with no hits: {hits:?}");
    }
}
