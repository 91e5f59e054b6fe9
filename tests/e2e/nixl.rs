//! The built-in `nixl` profile on real NIXL: two processes doing real
//! DRAM-to-DRAM transfers over UCX on loopback (tests/nixl/driver.py), real
//! faults, the real eBPF object in this kernel.
use std::{
    collections::{HashMap, HashSet},
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Line, Proc, agent_bin, alerts, require_root, root, run_to_end, summary, test_socket, venv_python,
};

const TIMEOUT: Duration = Duration::from_secs(2);
const LATENESS: Duration = Duration::from_secs(1);

/// The driver, connected (warm-up transfer done) and waiting for `go`.
struct Driver {
    proc: Proc,
    initiator: u32,
    lines: Vec<Line>,
}

impl Driver {
    fn start(mode: &str, count: usize, driver_args: &[&str]) -> Self {
        require_root();
        let proc = Proc::spawn(
            "nixl driver",
            Command::new(venv_python())
                .arg(root().join("tests/nixl/driver.py"))
                .args(["--mode", mode, "--count", &count.to_string(), "--max-seconds", "60"])
                .args(driver_args),
        );
        let ready = proc.next_line(Duration::from_secs(30), "ready line");
        let value = ready.json().unwrap_or_else(|| panic!("driver said: {}", ready.text));
        assert_eq!(value["event"], "ready", "{value}");
        let initiator = value["initiator_pid"].as_u64().expect("initiator_pid") as u32;
        Self { proc, initiator, lines: vec![ready] }
    }

    /// Attach the agent, then let the driver run.
    fn watched(mode: &str, count: usize) -> (Self, Agent) {
        Self::watched_with(mode, count, &[], &[])
    }

    /// `driver_args` for the driver, `extra` for the agent.
    fn watched_with(mode: &str, count: usize, driver_args: &[&str], extra: &[&str]) -> (Self, Agent) {
        let mut driver = Self::start(mode, count, driver_args);
        let agent = Agent::watch(driver.initiator, "nixl", "2s", extra);
        driver.proc.write_line("go");
        (driver, agent)
    }

    /// Read driver lines until one with `event`.
    fn until(&mut self, event: &str, within: Duration) -> Value {
        self.proc.until_event(event, within, &mut self.lines)
    }

    /// Requests the driver reported, by handle: (room, when last touched):
    /// the driver's own time just before the call (`before_ns`) where its
    /// line carries one, else when the line arrived, which is after the
    /// call (by 70-140 ms under load, a lower bound too late to time a
    /// stall from).
    fn requests(&self, event: &str) -> HashMap<String, (String, Instant)> {
        self.lines
            .iter()
            .filter_map(|line| {
                let value = line.json()?;
                (value["event"] == event).then(|| {
                    let handle = value["handle"].as_str().expect("handle").to_owned();
                    let at = value["before_ns"].as_u64().map_or(line.at, monotonic_instant);
                    (normalize(&handle), (value["room"].as_str().expect("room").to_owned(), at))
                })
            })
            .collect()
    }
}

/// The `Instant` of a CLOCK_MONOTONIC reading `ns` of another process on
/// this host (Rust's `Instant` is CLOCK_MONOTONIC on Linux).
fn monotonic_instant(ns: u64) -> Instant {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out pointer for the call.
    assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) }, 0, "clock_gettime");
    let (at, now_ns) = (Instant::now(), now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64);
    at.checked_sub(Duration::from_nanos(now_ns.saturating_sub(ns))).expect("a time since boot")
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
        assert!(
            latency >= TIMEOUT - Duration::from_millis(50) && latency <= TIMEOUT + LATENESS,
            "{alert} after {latency:?}"
        );
    }
}

#[test]
fn created_never_posted_is_waiting_for_peer() {
    let (mut driver, agent) = Driver::watched("never-post", 3);
    driver.until("holding", Duration::from_secs(20));
    let mut seen = Vec::new();
    let stalls = agent.wait_alerts("stalled", 3, TIMEOUT + Duration::from_secs(5), &mut seen);
    assert_stalls(&stalls, &driver.requests("created"), "waiting_for_peer");
    let lines = agent.stop();
    seen.extend(lines.iter().cloned());
    assert_eq!(alerts(&seen, "stalled").count(), 3, "each once: {seen:?}");
    // Their handles say NIXL_ERR_NOT_POSTED: created, never posted.
    assert_status_read(&lines, 3);
}

#[test]
fn posted_to_a_stopped_peer_is_transfer_hung() {
    let socket = test_socket();
    let socket_arg = socket.to_str().expect("utf-8 socket path");
    let (mut driver, agent) = Driver::watched_with("hang", 3, &["--status-interval", "0.2"], &["--socket", socket_arg]);
    driver.until("holding", Duration::from_secs(20));
    let mut seen = Vec::new();
    let stalls = agent.wait_alerts("stalled", 3, TIMEOUT + Duration::from_secs(5), &mut seen);
    assert_stalls(&stalls, &driver.requests("posted"), "transfer_hung");
    // The agent links the progress and post probes off its loop, from half
    // the timeout (checked every quarter second); the kernel takes ms to
    // seconds.
    agent.proc.wait_stderr("progress probes attached", Duration::from_secs(10));
    let linking_ms = agent.progress_attach_ms().into_iter().fold(0.0, f64::max);
    for (_, alert) in &stalls {
        assert_eq!(alert["stage"], "transfer_posted", "{alert}");
        // The transport evidence: UCX progress polled all along, no post
        // and nothing completed since.
        let transport = &alert["transport"];
        let summary = transport["summary"].as_str().expect("summary");
        match transport["progress"]["window_ms"].as_u64() {
            // Counted since the probes went on; the evidence says over how
            // long, for progress and posts alike.
            Some(window_ms) => {
                assert_eq!(transport["verdict"], "peer_unresponsive", "{alert}");
                assert!(transport["progress"]["since"].as_u64().expect("progress since") > 0, "{alert}");
                assert!(
                    window_ms <= 1200 && window_ms as f64 + linking_ms >= 500.0,
                    "linked in {linking_ms} ms: {alert}"
                );
                let window = format!("in the last {:.1}s", window_ms as f64 / 1e3);
                assert!(summary.contains(&format!("progress calls {window}")), "{alert}");
                assert!(summary.starts_with(&format!("no post {window}, ")), "{alert}");
            }
            // The stall came due while the kernel was still linking them: it
            // is reported on time all the same, and claims nothing of
            // progress or posts.
            None => {
                assert!(linking_ms >= 500.0, "linked in {linking_ms} ms: {alert}");
                assert_ne!(transport["verdict"], "no_progress", "{alert}");
                assert!(summary.contains("progress not watched"), "{alert}");
                assert!(summary.starts_with("posts not watched, "), "{alert}");
            }
        }
        assert_eq!(transport["completion"]["since"], 0, "{alert}");
        assert_eq!(transport["post"]["since"], 0, "{alert}");
        assert!(summary.contains("none completed"), "{alert}");
    }
    // The on-call view shows the same: every hung request with its verdict,
    // and the process's transport counts.
    let (ok, stdout, stderr) =
        run_to_end(Command::new(agent_bin()).args(["inflight", "--json", "--socket", socket_arg]));
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
    // The hung requests hold the progress and post probes on.
    assert!(
        process["transport"]["progress_attached_ms"].as_u64().expect("progress probe attached") as f64 + linking_ms
            >= 500.0,
        "linked in {linking_ms} ms: {process}"
    );
    // The three puts were posted before the post probes went on: the
    // healthy path (every post before half the timeout) is never counted.
    assert_eq!(process["transport"]["post"]["total"], 0, "{process}");
    // The initiator keeps polling getXferStatus (IN_PROG) the whole time:
    // polls are not life, and nothing else is reported. Two more status
    // lines of the driver: it polled after the stalls were out.
    let polls = |status: &Value| status["polls"].as_u64().expect("polls");
    let before = polls(&driver.until("status", Duration::from_secs(10)));
    let after = polls(&driver.until("status", Duration::from_secs(10)));
    assert!(after > before, "the driver kept polling: {before} -> {after}");
    let lines = agent.stop();
    seen.extend(lines.iter().cloned());
    assert_eq!(alerts(&seen, "stalled").count(), 3, "{seen:?}");
    assert_eq!(alerts(&seen, "recovered").count(), 0, "{seen:?}");
    // Told from memory, with no probe on the poll: the status read when
    // each stall was due said IN_PROG.
    assert_status_read(&lines, 3);
}

/// The summary of a `nixl` run: no probe on `getXferStatus` was attached,
/// and `answered` reads of the handles' status told the requests' stages.
fn assert_status_read(lines: &[Line], answered: u64) {
    let summary = summary(lines);
    let probes = summary["probes"].as_array().expect("probes");
    assert!(probes.iter().all(|p| !p["symbol"].as_str().expect("symbol").contains("getXferStatus")), "{summary}");
    assert_eq!(summary["status_reads"]["answered"], answered, "{summary}");
    assert_eq!(summary["status_reads"]["unreadable"], 0, "{summary}");
    assert_eq!(summary["status_reads"]["unrecognised"], 0, "{summary}");
}

/// Posts that return IN_PROG complete in a `getXferStatus` poll, which no
/// probe sees: the handle's status, read when the stall is due, says they
/// finished. The stage is inferred, and every view says so.
#[test]
fn done_never_released_is_release_lost() {
    let socket = test_socket();
    let socket_arg = socket.to_str().expect("utf-8 socket path");
    // tcp and 16 MiB: every post returns IN_PROG, the completion is a
    // poll's (a 4 KiB post over tcp sometimes finishes inside the call).
    let (mut driver, agent) = Driver::watched_with(
        "no-release",
        3,
        &["--ucx-tls", "tcp,self", "--size", "16777216"],
        &["--socket", socket_arg],
    );
    driver.until("holding", Duration::from_secs(20));
    assert_eq!(driver.requests("posted").len(), 3, "{:?}", driver.lines);
    // A post that finished inside the call (it returned DONE: rare, seen
    // in CI beside builds) was seen done by the post's probe; the others
    // finished in a poll, which no probe sees.
    let done_in_post: HashSet<String> = driver
        .lines
        .iter()
        .filter_map(Line::json)
        .filter(|v| v["event"] == "posted" && v["post"] == "DONE")
        .map(|v| v["room"].as_str().expect("room").to_owned())
        .collect();
    assert!(done_in_post.len() < 3, "no post returned IN_PROG, nothing to infer: {:?}", driver.lines);
    let inferred_of = |room: &str| {
        if done_in_post.contains(room) { serde_json::json!([]) } else { serde_json::json!(["transfer_done"]) }
    };
    let mut seen = Vec::new();
    let stalls = agent.wait_alerts("stalled", 3, TIMEOUT + Duration::from_secs(5), &mut seen);
    // Silent since the post: the completion is a poll's, which no probe
    // sees (it is inferred at the read), so a transfer slow under load
    // does not move the stall's due time.
    assert_stalls(&stalls, &driver.requests("posted"), "release_lost");
    for (_, alert) in &stalls {
        let room = alert["external_id"].as_str().expect("external_id");
        assert_eq!(
            (&alert["stage"], &alert["inferred"]),
            (&Value::from("transfer_done"), &inferred_of(room)),
            "{alert}"
        );
        // Observed: created and posted; inferred: done, timed at the read.
        let stages = alert["stages"].as_object().expect("stages");
        assert!(
            ["enqueued", "transfer_posted", "transfer_done"].iter().all(|stage| stages.contains_key(*stage)),
            "{alert}"
        );
    }
    let (ok, stdout, stderr) =
        run_to_end(Command::new(agent_bin()).args(["inflight", "--json", "--socket", socket_arg]));
    assert!(ok, "{stderr}");
    let inflight: Value = serde_json::from_str(&stdout).expect("inflight JSON");
    let requests = inflight["requests"].as_array().expect("requests");
    assert_eq!(requests.len(), 3, "{inflight}");
    for request in requests {
        let room = request["external_id"].as_str().expect("external_id");
        assert_eq!(
            (&request["class"], &request["inferred"]),
            (&Value::from("release_lost"), &inferred_of(room)),
            "{request}"
        );
    }
    let (ok, table, stderr) = run_to_end(Command::new(agent_bin()).args(["inflight", "--socket", socket_arg]));
    assert!(ok, "{stderr}");
    assert_eq!(table.matches("transfer_done (inferred)").count(), 3 - done_in_post.len(), "{table}");
    let lines = agent.stop();
    assert_eq!(summary(&lines)["in_flight"], 3, "{lines:?}");
    assert_status_read(&lines, 3);
}

/// The target dies mid-transfer; the initiator's polls get
/// NIXL_ERR_REMOTE_DISCONNECT and it holds the failed handles. No probe
/// sees the poll: the status read when the stall is due ends each request
/// `failed` (inferred) instead of reporting it hung.
#[test]
fn a_transfer_to_a_killed_peer_is_failed_not_hung() {
    let (mut driver, agent) = Driver::watched("target-kill", 3);
    driver.until("holding", Duration::from_secs(20));
    let failed = driver.requests("failed");
    assert_eq!(failed.len(), 3, "{:?}", driver.lines);
    let mut seen = Vec::new();
    let ends = agent.wait_alerts("failed", 3, TIMEOUT + Duration::from_secs(5), &mut seen);
    for (_, alert) in &ends {
        let key = alert["key"].as_str().expect("key");
        let (room, _) = failed.get(key).unwrap_or_else(|| panic!("failure of an unknown request: {alert}"));
        assert_eq!(
            (&alert["external_id"], &alert["stage"]),
            (&Value::from(room.as_str()), &Value::from("failed")),
            "{alert}"
        );
        assert_eq!(alert["inferred"], serde_json::json!(["failed"]), "{alert}");
    }
    let lines = agent.stop();
    seen.extend(lines.iter().cloned());
    assert_eq!(alerts(&seen, "stalled").count(), 0, "a failed transfer is not a hung one: {seen:?}");
    let summary_value = summary(&lines);
    assert_eq!(
        (&summary_value["failed"], &summary_value["in_flight"]),
        (&Value::from(3), &Value::from(0)),
        "{summary_value}"
    );
    assert_status_read(&lines, 3);
}

/// As above, but the initiator releases each failed handle as soon as its
/// poll answers the error, long before its stall is due: the status read
/// at the release's entry says the transfer failed, so each ends `failed`
/// (seen by a probe, not inferred), never `completed`.
#[test]
fn a_failed_transfer_released_at_once_is_failed_not_completed() {
    let mut driver = Driver::start("fail-release", 3, &[]);
    // A timeout well past the failure (about 1 s after the target dies):
    // nothing here may come from a stall's status read.
    let agent = Agent::watch(driver.initiator, "nixl", "10s", &[]);
    driver.proc.write_line("go");
    driver.until("holding", Duration::from_secs(20));
    let released = driver.requests("released");
    assert_eq!(released.len(), 3, "{:?}", driver.lines);
    let mut seen = Vec::new();
    let ends = agent.wait_alerts("failed", 3, Duration::from_secs(5), &mut seen);
    for (_, alert) in &ends {
        let key = alert["key"].as_str().expect("key");
        let (room, _) = released.get(key).unwrap_or_else(|| panic!("failure of an unknown request: {alert}"));
        assert_eq!(
            (&alert["external_id"], &alert["stage"]),
            (&Value::from(room.as_str()), &Value::from("failed")),
            "{alert}"
        );
        assert_eq!(alert["inferred"], serde_json::json!([]), "seen at the release, not read at a stall: {alert}");
    }
    let lines = agent.stop();
    seen.extend(lines.iter().cloned());
    assert_eq!(alerts(&seen, "stalled").count(), 0, "{seen:?}");
    let summary_value = summary(&lines);
    assert_eq!(
        (&summary_value["failed"], &summary_value["completed"], &summary_value["in_flight"]),
        (&Value::from(3), &Value::from(0), &Value::from(0)),
        "{summary_value}"
    );
}

/// The initiator maps a libnixl.so of a build the profile was not checked
/// against (here: a profile extending `nixl` whose `[layout]` knows only
/// another build id). Nothing is read at the layout's offsets in it: no
/// status read, no external id; the stalls are classified by the probes
/// alone, and one warning names the library, its build id and the fix.
#[test]
fn a_library_build_the_profile_does_not_know_is_read_at_no_offset() {
    let mut profile = tempfile::Builder::new().suffix(".toml").tempfile().expect("temp profile");
    std::io::Write::write_all(
        &mut profile,
        b"extends = \"nixl\"\n[layout]\nobject = \"libnixl.so\"\nbuild_ids = [\"0011223344\"]\nchecked = \"a build this host does not have\"\n",
    )
    .expect("writing the profile");
    let mut driver = Driver::start("never-post", 3, &[]);
    let agent = Agent::watch(driver.initiator, profile.path().to_str().expect("utf-8 path"), "2s", &[]);
    driver.proc.write_line("go");
    driver.until("holding", Duration::from_secs(20));
    let mut seen = Vec::new();
    let stalls = agent.wait_alerts("stalled", 3, TIMEOUT + Duration::from_secs(5), &mut seen);
    let created = driver.requests("created");
    for (_, alert) in &stalls {
        assert!(created.contains_key(alert["key"].as_str().expect("key")), "{alert}");
        assert_eq!(alert["class"], "waiting_for_peer", "{alert}");
        assert_eq!(alert["external_id"], Value::Null, "the id lies at an offset of the layout: not read: {alert}");
        assert_eq!(alert["inferred"], serde_json::json!([]), "{alert}");
    }
    let stderr = agent.proc.stderr();
    let lines = agent.stop();
    let status = &summary(&lines)["status_reads"];
    assert_eq!((&status["off"], &status["answered"]), (&Value::from(3), &Value::from(0)), "{status}");
    assert_eq!(stderr.matches("has build id").count(), 1, "one warning: {stderr}");
    assert!(
        stderr.contains("libnixl.so has build id") && stderr.contains("build_ids") && stderr.contains("[layout]"),
        "{stderr}"
    );
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
    let (mut driver, agent) = Driver::watched_with("healthy", 2000, &["--ucx-tls", "tcp,cma,self"], &[]);
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

    // Transport probes: UCX progress is called thousands of times a second
    // here and `ucp_put_nbx` once per transfer, but no request came near
    // its stall: neither probe was ever attached, and the run paid for the
    // NIXL lifecycle probes alone. The RDMA verbs transports the wheel
    // ships are loaded and resolved, on demand as well (the driver's
    // UCX_TLS leaves them out, on any host).
    let probes = summary["probes"].as_array().expect("probes");
    let hits: HashMap<&str, u64> =
        probes.iter().map(|p| (p["symbol"].as_str().expect("symbol"), p["hits"].as_u64().expect("hits"))).collect();
    assert_eq!((hits["ucp_put_nbx"], hits["ucp_worker_progress"]), (0, 0), "{hits:?}");
    for probe in probes {
        let on_demand = probe["role"] == "post" || probe["role"] == "progress";
        assert_eq!(probe["attached"], if on_demand { "on_demand_idle" } else { "always" }, "{probe}");
    }
    let lifecycle = probes.iter().filter(|p| p["role"] == "lifecycle").map(|p| p["hits"].as_u64().expect("hits"));
    assert!(lifecycle.sum::<u64>() >= 2000 * 4, "create, post (twice) and release each: {hits:?}");
    for verbs in [
        "uct_rc_verbs_ep_put_zcopy",
        "uct_rc_verbs_ep_get_zcopy",
        "uct_rc_mlx5_base_ep_put_zcopy",
        "uct_rc_mlx5_base_ep_get_zcopy",
    ] {
        assert_eq!(hits.get(verbs), Some(&0), "{verbs} attached with no hits: {hits:?}");
    }
    // Healthy transfers end before their stall is due: none is read.
    assert_eq!(summary["status_reads"]["total"], 0, "{summary}");
}
