//! Agent restart safety: the probes and the kernel's in-flight table are
//! pinned in bpffs, so an agent killed or restarted during a stall is
//! followed by one that still reports it, and no request is lost or
//! reported twice across the restart. Real agents, real eBPF, real uprobes
//! on the demo target; the first agent is SIGKILLed, as a crash or an OOM
//! kill would.
use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Demo, Line, METRICS, agent_bin, alerts, pinned_links, require_root, run_to_end, summary, test_bpf_dir,
    test_socket, wait_for,
};

const TIMEOUT: &str = "1s";

fn key_of(alert: &Value) -> String {
    alert["key"].as_str().expect("alert key").to_owned()
}

/// Keys of the alerts of `kind` among `lines`, with how often each came.
fn counted(lines: &[Line], kind: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for (_, alert) in alerts(lines, kind) {
        *counts.entry(key_of(&alert)).or_default() += 1;
    }
    counts
}

/// Kill `agent` the way a crash would: no chance to clean up.
fn crash(agent: Agent) {
    agent.proc.signal(libc::SIGKILL);
    // Its Drop would remove the bpf directory; the test owns that.
    let mut agent = agent;
    agent.bpf_dir = None;
    let _ = agent.proc.wait(Duration::from_secs(5));
}

/// Removes the shared bpf directory when the test ends, pass or fail.
struct Cleanup<'a>(&'a Path);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.0);
    }
}

#[test]
fn a_stall_reported_before_a_crash_is_not_reported_again_and_its_recovery_is() {
    require_root();
    let dir = test_bpf_dir();
    let _cleanup = Cleanup(&dir);
    let mut demo = Demo::builder().rate(500).duration("30s").inject_after("300ms").each_stall("5s").start();
    let pid = demo.proc.pid();
    let (socket, socket_arg) = new_socket();
    let first = Agent::on_pid(pid).bpf_dir(&dir).timeout(TIMEOUT).args(&["--socket", &socket_arg]).watch();
    demo.go();
    let mut seen = Vec::new();
    let stalled = first.wait_alerts("stalled", 4, Duration::from_secs(10), &mut seen);
    assert_eq!(counted(&seen, "stalled").len(), 4, "{stalled:?}");
    let injected = demo.wait_injected(4, &mut Vec::new());
    // Killed once its stall alerts are marked (a kill between an alert and
    // its mark repeats the alert: at-least-once, see docs/restarts.md).
    settle(&socket);
    crash(first);
    assert!(pinned_links(&dir) > 0, "a crashed agent's probes stay attached");

    // Healthy requests go on for a while with no agent; the next starts.
    thread::sleep(Duration::from_millis(500));
    let (socket, socket_arg) = new_socket();
    let second = Agent::on_pid(pid).bpf_dir(&dir).timeout(TIMEOUT).args(&["--socket", &socket_arg]).watch();
    second.proc.wait_stderr("took over the requests in flight", Duration::from_secs(10));
    let mut after = Vec::new();
    // The recovering request comes back 5 s after injection.
    second.wait_alerts("recovered", 1, Duration::from_secs(10), &mut after);
    // Each stall still held has been silent through a whole further
    // timeout in this agent: a stall alert it would repeat is out.
    let held: Vec<String> =
        injected.iter().filter(|(_, pinned)| pinned.stall != "recover").map(|(key, _)| key.clone()).collect();
    held_through_a_timeout(&socket, &held, Duration::from_secs(1));
    let after: Vec<Line> = after.into_iter().chain(second.stop()).collect();

    let restalled = counted(&after, "stalled");
    assert!(
        restalled.is_empty(),
        "stalls already reported were reported again (or healthy requests stalled): {restalled:?}"
    );
    let recovered: Vec<Value> = alerts(&after, "recovered").map(|(_, alert)| alert).collect();
    assert_eq!(recovered.len(), 1, "{recovered:?}");
    let key = key_of(&recovered[0]);
    assert_eq!(injected.get(&key).map(|pinned| pinned.stall.as_str()), Some("recover"), "{recovered:?} {injected:?}");
    assert_eq!(recovered[0]["class"], "transfer_hung", "{}", recovered[0]);
    let stuck = recovered[0]["stuck_ms"].as_u64().expect("stuck_ms");
    assert!((4_500..=6_000).contains(&stuck), "stuck for the whole 5 s hang, across the restart: {}", recovered[0]);

    let summary = summary(&after);
    assert_eq!(summary["stalled"], 0, "{summary}");
    assert_eq!(summary["recovered"], 1, "{summary}");
    assert!(summary["completed"].as_u64().unwrap_or(0) > 500, "healthy requests were followed: {summary}");
    assert!(summary["seen"].as_u64().unwrap_or(0) >= 4, "{summary}");
    // The old probes went without firing on a slot already cleared.
    assert_eq!(summary["lost_events"], 0, "{summary}");
}

#[test]
fn a_stall_that_begins_while_no_agent_runs_is_reported_by_the_next_once() {
    require_root();
    let dir = test_bpf_dir();
    let _cleanup = Cleanup(&dir);
    let mut demo =
        Demo::builder().rate(500).duration("30s").inject_after("1500ms").waiting_for_peer(1).transfer_hung(1).start();
    let pid = demo.proc.pid();
    let first = Agent::on_pid(pid).bpf_dir(&dir).timeout("2s").watch();
    demo.go();
    crash(first);
    let crashed_at = Instant::now();
    // The requests are pinned while no agent runs: the probes it left
    // attached record them.
    let mut demo_lines = Vec::new();
    let injected = demo.wait_injected(2, &mut demo_lines);
    let injected_at = injected.values().map(|pinned| pinned.at).max().expect("injected");
    assert!(injected.values().all(|pinned| pinned.at > crashed_at), "the requests were pinned after the crash");
    // They stay silent past the timeout while no agent runs.
    thread::sleep((injected_at + Duration::from_millis(3500)).saturating_duration_since(Instant::now()));

    let (socket, socket_arg) = new_socket();
    let second = Agent::on_pid(pid).bpf_dir(&dir).timeout("2s").args(&["--socket", &socket_arg]).watch();
    let mut seen = Vec::new();
    let stalls = second.wait_alerts("stalled", 2, Duration::from_secs(5), &mut seen);
    for (at, alert) in &stalls {
        let pinned = injected.get(&key_of(alert)).unwrap_or_else(|| panic!("stall of a healthy request: {alert}"));
        assert_eq!(alert["class"], pinned.stall.as_str(), "{alert}");
        assert!(alert["external_id"].as_str().is_some_and(|id| id.starts_with("room-")), "{alert}");
        // Silent since the request's own last event, before this agent.
        let silent = Duration::from_millis(alert["silent_ms"].as_u64().expect("silent_ms"));
        let since_injection = at.duration_since(injected_at);
        assert!(silent >= Duration::from_millis(3400), "{alert}");
        assert!(silent <= since_injection + Duration::from_millis(100), "{alert} after {since_injection:?}");
    }
    // Held through a further timeout: a stall alert it would repeat is out.
    held_through_a_timeout(&socket, &injected.keys().cloned().collect::<Vec<_>>(), Duration::from_secs(2));
    let lines: Vec<Line> = seen.into_iter().chain(second.stop()).collect();
    let counts = counted(&lines, "stalled");
    assert_eq!(counts.len(), 2, "{counts:?}");
    assert!(counts.values().all(|&n| n == 1), "each stall reported once: {counts:?}");
    assert_eq!(summary(&lines)["lost_events"], 0, "{}", summary(&lines));
}

/// A restart inside the timeout: 40 requests pinned (half never posted,
/// half hung), the agent SIGKILLed a moment later, well before any stall
/// is due, and the next agent started on the same bpf directory. It takes
/// the previous agent's verified programs over (no verifier pass, which
/// alone took 1 to 5 s of a start on this host) and reports every request
/// once, each within the timeout plus 1 s of its own last activity: the
/// restart makes no stall later.
#[test]
fn forty_requests_held_across_a_restart_are_each_reported_within_a_second_of_their_timeout() {
    const HELD: usize = 40;
    const TIMEOUT_3S: Duration = Duration::from_secs(3);
    require_root();
    let dir = test_bpf_dir();
    let _cleanup = Cleanup(&dir);
    let mut demo =
        Demo::builder().rate(500).duration("30s").inject_after("300ms").waiting_for_peer(20).transfer_hung(20).start();
    let pid = demo.proc.pid();
    let first = Agent::on_pid(pid).bpf_dir(&dir).timeout("3s").watch();
    demo.go();
    let injected = demo.wait_injected(HELD, &mut Vec::new());
    crash(first);
    let restarted = Instant::now();
    let second = Agent::on_pid(pid).bpf_dir(&dir).timeout("3s").watch();
    let started = restarted.elapsed();
    second.proc.wait_stderr("taken over from a previous agent of this build", Duration::from_secs(1));
    let mut seen = Vec::new();
    second.wait_alerts("stalled", HELD, TIMEOUT_3S + Duration::from_secs(5), &mut seen);
    let lines: Vec<Line> = seen.into_iter().chain(second.stop()).collect();
    eprintln!("the second agent was watching {started:?} after the first's kill");
    let counts = counted(&lines, "stalled");
    assert_eq!(counts.len(), HELD, "{counts:?}");
    assert!(counts.values().all(|&n| n == 1), "each stall reported once: {counts:?}");
    let mut late = Vec::new();
    for (at, alert) in alerts(&lines, "stalled") {
        let pinned = injected.get(&key_of(&alert)).unwrap_or_else(|| panic!("stall of a healthy request: {alert}"));
        assert_eq!(alert["class"], pinned.stall.as_str(), "{alert}");
        // `at` is when the test read the alert, `pinned.at` when it read
        // the demo's line, just after the request's last event.
        let after = at.saturating_duration_since(pinned.at);
        assert!(
            after + Duration::from_millis(200) >= TIMEOUT_3S,
            "reported before its timeout: {alert} after {after:?}"
        );
        if after > TIMEOUT_3S + Duration::from_secs(1) {
            late.push((after, alert));
        }
    }
    assert!(late.is_empty(), "stalls later than timeout + 1 s across the restart: {late:?}");
    assert_eq!(summary(&lines)["lost_events"], 0, "{}", summary(&lines));
}

#[test]
fn sigterm_hands_over_a_second_agent_is_refused_and_state_clear_detaches() {
    require_root();
    let dir = test_bpf_dir();
    let _cleanup = Cleanup(&dir);
    let mut demo =
        Demo::builder().rate(200).duration("30s").inject_after("300ms").waiting_for_peer(1).transfer_hung(1).start();
    let pid = demo.proc.pid();
    let mut first = Agent::on_pid(pid).bpf_dir(&dir).timeout(TIMEOUT).watch();
    demo.go();
    let mut seen = Vec::new();
    first.wait_alerts("stalled", 2, Duration::from_secs(10), &mut seen);
    let injected = demo.wait_injected(2, &mut Vec::new());

    // One agent per bpf directory.
    let dir_arg = dir.to_str().expect("utf-8 dir");
    let (ok, _, stderr) = run_to_end(
        Command::new(agent_bin())
            .args(["run", "--pid", &pid.to_string(), "--profile", "demo", "--bpf-dir", dir_arg, "--socket"])
            .arg(test_socket()),
    );
    assert!(!ok, "a second agent on the same bpf directory must fail");
    assert!(
        stderr.contains("another stallwatch agent is using the bpf directory") && stderr.contains(dir_arg),
        "{stderr}"
    );
    let (ok, _, stderr) = run_to_end(Command::new(agent_bin()).args(["state", "clear", "--bpf-dir", dir_arg]));
    assert!(
        !ok && stderr.contains("another stallwatch agent"),
        "state clear must refuse while an agent runs: {stderr}"
    );

    // SIGTERM (a rolling update): the probes stay for the next agent...
    first.bpf_dir = None;
    let lines = first.stop_with(libc::SIGTERM);
    assert!(summary(&lines)["completed"].as_u64().unwrap_or(0) > 0, "{}", summary(&lines));
    assert!(pinned_links(&dir) > 0, "SIGTERM keeps the probes attached for the next agent");

    // ... which takes over both stalls with their own silence, and does not
    // report them again.
    let (socket, socket_arg) = new_socket();
    let mut next = Agent::on_pid(pid).bpf_dir(&dir).timeout(TIMEOUT).args(&["--socket", &socket_arg]).watch();
    next.proc.wait_stderr("took over the requests in flight", Duration::from_secs(10));
    let since: HashMap<&String, Duration> = injected.iter().map(|(key, pinned)| (key, pinned.at.elapsed())).collect();
    let rows = inflight(&socket);
    for (key, pinned) in &injected {
        let row = rows
            .iter()
            .find(|row| row["key"] == key.as_str())
            .unwrap_or_else(|| panic!("{key} was not taken over: {rows:?}"));
        assert_eq!(row["class"], pinned.stall.as_str(), "{row}");
        // Its last event came before the demo said it was pinned.
        let silent = Duration::from_millis(row["silent_ms"].as_u64().expect("silent_ms"));
        assert!(
            silent + Duration::from_millis(5) >= since[key],
            "silent since before the hand-over: {row} vs {:?}",
            since[key]
        );
    }
    held_through_a_timeout(&socket, &injected.keys().cloned().collect::<Vec<_>>(), Duration::from_secs(1));
    next.bpf_dir = None;
    let lines = next.stop_with(libc::SIGTERM);
    let handed = summary(&lines);
    assert_eq!(handed["restored"], 2, "{handed}");
    assert!(counted(&lines, "stalled").is_empty(), "stalls the first agent reported were reported again: {lines:?}");
    assert_eq!(handed["lost_events"], 0, "{handed}");
    assert!(pinned_links(&dir) > 0, "SIGTERM keeps the probes attached for the next agent");

    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(["state", "clear", "--bpf-dir", dir_arg]));
    assert!(ok, "{stderr}");
    assert!(stdout.contains("probes are detached"), "{stdout}");
    assert!(!dir.exists(), "state clear removes the bpf directory");
    let (ok, stdout, _) = run_to_end(Command::new(agent_bin()).args(["state", "clear", "--bpf-dir", dir_arg]));
    assert!(ok && stdout.contains("nothing pinned"), "{stdout}");
    drop(demo);
}

#[test]
fn on_exit_detach_and_ephemeral_leave_nothing_pinned() {
    require_root();
    let mut demo = Demo::start(&["--rate", "200", "--duration", "30s"]);
    let pid = demo.proc.pid();
    demo.go();

    let dir = test_bpf_dir();
    let _cleanup = Cleanup(&dir);
    let agent = Agent::on_pid(pid).bpf_dir(&dir).timeout(TIMEOUT).args(&["--on-exit", "detach"]).watch();
    assert!(pinned_links(&dir) > 0, "links are pinned while the agent runs");
    let held = bpf_objects_of(agent.proc.pid());
    // The check below sees an agent's pins wherever they are.
    assert!(!pinned_of(&held).is_empty(), "the pins of an agent with a --bpf-dir are found: {held:?}");
    let _ = agent.stop_with(libc::SIGTERM);
    assert!(!dir.exists(), "--on-exit detach removes the bpf directory");
    assert_eq!(pinned_of(&held), Vec::<PathBuf>::new(), "--on-exit detach left pins");

    let agent = Agent::watch(pid, "demo", TIMEOUT, &["--ephemeral", METRICS[0], METRICS[1]]);
    let held = bpf_objects_of(agent.proc.pid());
    assert!(held.iter().any(|(kind, _)| kind == "link_id"), "the agent holds its probe links: {held:?}");
    assert_eq!(pinned_of(&held), Vec::<PathBuf>::new(), "--ephemeral pinned its maps or links");
    agent.wait_completed(1);
    let lines = agent.stop();
    assert!(summary(&lines)["completed"].as_u64().unwrap_or(0) > 0, "{}", summary(&lines));
    assert_eq!(pinned_of(&held), Vec::<PathBuf>::new(), "--ephemeral left pins");
}

#[test]
fn state_of_another_layout_is_discarded_with_a_warning() {
    require_root();
    let dir = test_bpf_dir();
    let _cleanup = Cleanup(&dir);
    // What an agent of another pinned layout left (no layout is 0).
    let other = dir.join("v0");
    for sub in ["maps", "links"] {
        std::fs::create_dir_all(other.join(sub)).expect("creating an old layout's directories");
    }
    let mut demo = Demo::start(&["--rate", "200", "--duration", "30s"]);
    let agent = Agent::on_pid(demo.proc.pid()).bpf_dir(&dir).timeout(TIMEOUT).metrics().watch();
    demo.go();
    agent.proc.wait_stderr("discarding state pinned by a stallwatch of another layout", Duration::from_secs(5));
    assert!(!other.exists(), "{} is left", other.display());
    assert!(pinned_links(&dir) > 0, "the agent pins its own layout");
    agent.wait_completed(1);
    let lines = agent.stop();
    assert!(summary(&lines)["completed"].as_u64().unwrap_or(0) > 0, "{}", summary(&lines));
}

/// The BPF objects (`map_id`, `prog_id`, `link_id` and the id) that the
/// file descriptors of process `pid` hold, from `/proc/PID/fdinfo`.
fn bpf_objects_of(pid: u32) -> HashSet<(String, u64)> {
    let dir = format!("/proc/{pid}/fdinfo");
    let fds = std::fs::read_dir(&dir).unwrap_or_else(|err| panic!("listing {dir}: {err}"));
    fds.filter_map(Result::ok)
        .filter_map(|fd| std::fs::read_to_string(fd.path()).ok())
        .flat_map(|info| bpf_ids(&info))
        .collect()
}

fn bpf_ids(fdinfo: &str) -> Vec<(String, u64)> {
    fdinfo
        .lines()
        .filter_map(|line| {
            let (name, value) = line.split_once(':')?;
            let kind = ["map_id", "prog_id", "link_id"].into_iter().find(|kind| name == *kind)?;
            Some((kind.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

/// Every pin anywhere in bpffs (other agents' too: neighbours run agents
/// on this host) that holds one of `objects`.
fn pinned_of(objects: &HashSet<(String, u64)>) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![PathBuf::from("/sys/fs/bpf")];
    while let Some(dir) = dirs.pop() {
        // Neighbours add and remove pins meanwhile: what vanishes is skipped.
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            match entry.file_type() {
                Ok(kind) if kind.is_dir() => dirs.push(path),
                Ok(_) => {
                    if pinned_object(&path).iter().any(|id| objects.contains(id)) {
                        found.push(path);
                    }
                }
                Err(_) => {}
            }
        }
    }
    found
}

/// What the pin at `path` holds (`BPF_OBJ_GET`, then its fdinfo); nothing
/// for what is not a pin (bpffs's own iterator files) or is gone.
fn pinned_object(path: &Path) -> Vec<(String, u64)> {
    const BPF_OBJ_GET: libc::c_long = 7;
    /// `union bpf_attr` as `BPF_OBJ_GET` reads it.
    #[repr(C)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        _pad: u32,
    }
    let Ok(c_path) = CString::new(path.as_os_str().as_encoded_bytes()) else { return Vec::new() };
    let attr = ObjGet { pathname: c_path.as_ptr() as u64, bpf_fd: 0, file_flags: 0, path_fd: 0, _pad: 0 };
    // SAFETY: bpf(2) reads `attr` (its size given) and the NUL-terminated path it points at.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, &attr, size_of::<ObjGet>()) };
    if fd < 0 {
        return Vec::new();
    }
    // SAFETY: a new descriptor bpf(2) just returned, owned here alone.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))
        .map(|info| bpf_ids(&info))
        .unwrap_or_default()
}

/// A fresh query socket, and it as an argument.
fn new_socket() -> (PathBuf, String) {
    let socket = test_socket();
    let arg = socket.to_str().expect("utf-8 socket").to_owned();
    (socket, arg)
}

/// The requests `stallwatch inflight --json` lists for the agent on
/// `socket`. The agent answers from its event loop, so every alert it
/// printed before it has also been marked in `ALERTED`.
fn inflight(socket: &Path) -> Vec<Value> {
    let (ok, stdout, stderr) =
        run_to_end(Command::new(agent_bin()).arg("inflight").arg("--socket").arg(socket).arg("--json"));
    assert!(ok, "inflight failed: {stderr}");
    let answer: Value = serde_json::from_str(&stdout).unwrap_or_else(|err| panic!("inflight --json ({err}): {stdout}"));
    answer["requests"].as_array().expect("requests").clone()
}

fn inflight_keys(socket: &Path) -> Vec<String> {
    inflight(socket).iter().map(|row| row["key"].as_str().expect("key").to_owned()).collect()
}

/// Wait until the agent on `socket` has marked every stall alert it printed.
fn settle(socket: &Path) {
    inflight(socket);
}

/// Wait until the agent on `socket` has held each of `keys` (all silent past
/// `timeout` already) through a further `timeout` of silence: a stall alert
/// it would repeat has come out by then.
fn held_through_a_timeout(socket: &Path, keys: &[String], timeout: Duration) {
    let silent = |rows: &[Value], key: &String| {
        let row =
            rows.iter().find(|row| row["key"] == key.as_str()).unwrap_or_else(|| panic!("{key} is not held: {rows:?}"));
        Duration::from_millis(row["silent_ms"].as_u64().expect("silent_ms"))
    };
    let rows = inflight(socket);
    let due: Vec<Duration> = keys.iter().map(|key| silent(&rows, key) + timeout).collect();
    wait_for("a further timeout of silence", timeout * 3, || {
        let rows = inflight(socket);
        keys.iter().zip(&due).all(|(key, due)| silent(&rows, key) >= *due).then_some(())
    });
}

#[test]
fn a_stall_taken_over_and_ended_is_not_ended_again_by_a_third_agent() {
    require_root();
    let dir = test_bpf_dir();
    let _cleanup = Cleanup(&dir);
    // Healthy requests stop early, so the third agent finds only what is
    // still pinned.
    let mut demo =
        Demo::builder().rate(1000).requests(200).duration("30s").inject_after("300ms").each_stall("4s").start();
    let pid = demo.proc.pid();
    let (socket, socket_arg) = new_socket();
    let first = Agent::on_pid(pid).bpf_dir(&dir).timeout(TIMEOUT).args(&["--socket", &socket_arg]).watch();
    demo.go();
    let mut seen = Vec::new();
    first.wait_alerts("stalled", 4, Duration::from_secs(10), &mut seen);
    settle(&socket);
    crash(first);

    // The second takes the marked stalls over; the recovering one moves on,
    // is released, and leaves its in-flight list.
    let (socket, socket_arg) = new_socket();
    let second = Agent::on_pid(pid).bpf_dir(&dir).timeout(TIMEOUT).args(&["--socket", &socket_arg]).watch();
    second.proc.wait_stderr("took over the requests in flight", Duration::from_secs(10));
    let mut after = Vec::new();
    let recovered = second.wait_alerts("recovered", 1, Duration::from_secs(10), &mut after);
    let key = key_of(&recovered[0].1);
    wait_for(&format!("the release of the recovered request {key}"), Duration::from_secs(5), || {
        (!inflight_keys(&socket).contains(&key)).then_some(())
    });
    assert_eq!(inflight_keys(&socket).len(), 3, "the three pinned requests are still held");
    crash(second);

    // The third finds the three still pinned, and nothing the second saw end.
    let third = Agent::on_pid(pid).bpf_dir(&dir).timeout(TIMEOUT).watch();
    third.proc.wait_stderr("took over the requests in flight", Duration::from_secs(10));
    let lines = third.stop();
    let summary = summary(&lines);
    assert_eq!(summary["restored"], 3, "{summary}");
    assert_eq!(summary["completed"], 0, "a request the second agent saw end was ended again: {summary}");
    assert_eq!(summary["recovered"], 0, "{summary}");
    assert!(counted(&lines, "stalled").is_empty(), "{lines:?}");
    assert!(counted(&lines, "recovered").is_empty(), "{lines:?}");
    drop(demo);
}

/// Start the demo as pid `pid` (free again after a kill): the kernel hands
/// out the pid after `ns_last_pid`; another process forking meanwhile takes
/// it, so try a few times.
fn demo_as_pid(pid: u32, args: &[&str]) -> Demo {
    for _ in 0..50 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).expect("writing ns_last_pid (root)");
        let demo = Demo::start(args);
        if demo.proc.pid() == pid {
            return demo;
        }
    }
    panic!("could not start a process as pid {pid}");
}

#[test]
fn requests_of_a_pid_reused_while_no_agent_ran_end_process_exited() {
    require_root();
    let dir = test_bpf_dir();
    let _cleanup = Cleanup(&dir);
    let mut old =
        Demo::start(&["--rate", "200", "--duration", "30s", "--inject-after", "200ms", "--waiting-for-peer", "2"]);
    let pid = old.proc.pid();
    let first = Agent::on_pid(pid).bpf_dir(&dir).timeout(TIMEOUT).watch();
    old.go();
    let mut seen = Vec::new();
    first.wait_alerts("stalled", 2, Duration::from_secs(10), &mut seen);
    let mut demo_lines = Vec::new();
    let pinned = old.wait_injected(2, &mut demo_lines);
    crash(first);
    old.proc.signal(libc::SIGKILL);
    let _ = old.proc.wait(Duration::from_secs(5));

    // Another process gets the pid; the next agent is told to watch it.
    let mut new = demo_as_pid(pid, &["--rate", "200", "--duration", "30s"]);
    let second = Agent::on_pid(pid).bpf_dir(&dir).timeout(TIMEOUT).metrics().watch();
    new.go();
    // Both stalls end process_exited; so may a healthy request the old
    // process had in flight when it was killed (no agent ran to see it end).
    let mut lines = Vec::new();
    second.wait_until("both stalls ended process_exited", Duration::from_secs(5), &mut lines, |seen| {
        let exited: Vec<String> = alerts(seen, "process_exited").map(|(_, alert)| key_of(&alert)).collect();
        pinned.keys().all(|key| exited.contains(key))
    });
    // The take-over reports before the new process's first request ends.
    second.wait_completed(1);
    let lines: Vec<Line> = lines.into_iter().chain(second.stop()).collect();
    let exited = alerts(&lines, "process_exited").count();
    let summary = summary(&lines);
    assert_eq!(summary["process_exited"], exited as u64, "each reported once: {summary}");
    assert_eq!(summary["stalled"], 0, "the old process's stalls are not the new one's: {summary}");
    assert!(summary["completed"].as_u64().unwrap_or(0) > 0, "the new process is followed: {summary}");
}
