//! Process discovery: `stallwatch run` without `--pid` watches every
//! process its selectors match, those running at start and those started
//! later (the exec tracepoint, real eBPF in this kernel), and re-attaches a
//! restarted target; threads its targets kill mid-call leave return
//! probes working.
use std::{process::Command, time::Duration};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Demo, Line, Proc, alerts, require_root, root, run_to_end, summary, test_socket, venv_python,
};

const WAIT: Duration = Duration::from_secs(10);
/// A request that waits for its peer; the duration is this file's own, so
/// the selector below (`--exe` and that duration) watches no other test's
/// demo on a shared host.
const PINNED: &[&str] = &["--rate", "200", "--duration", "31s", "--inject-after", "100ms", "--waiting-for-peer", "1"];

fn stall_of(seen: &[Line], pid: u32) -> Option<Value> {
    alerts(seen, "stalled").map(|(_, v)| v).find(|v| v["pid"] == pid)
}

#[test]
fn running_later_and_restarted_processes_are_all_watched() {
    require_root();
    // One demo runs before the agent starts: found by the scan.
    let mut before = Demo::start(PINNED);
    let agent = Agent::selecting(&["--exe", "demo-prefill", "--cmdline", "duration 31s"]).timeout("1s").discover();
    agent.wait_watching(before.proc.pid());
    before.go();
    let mut seen = Vec::new();
    agent.wait_until("a stall of the first demo", WAIT, &mut seen, |s| stall_of(s, before.proc.pid()).is_some());

    // It dies with its request in flight; a new one starts (a restart):
    // the predecessor's request ends process_exited, the successor is
    // attached through the exec tracepoint and its stall is reported too.
    let first = before.proc.pid();
    before.proc.signal(libc::SIGKILL);
    agent.wait_until("process_exited of the first demo", WAIT, &mut seen, |s| {
        alerts(s, "process_exited").any(|(_, v)| v["pid"] == first)
    });
    let mut after = Demo::start(PINNED);
    agent.wait_watching(after.proc.pid());
    after.go();
    agent.wait_until("a stall of the restarted demo", WAIT, &mut seen, |s| stall_of(s, after.proc.pid()).is_some());

    let first_stall = stall_of(&seen, first).expect("first stall");
    let second_stall = stall_of(&seen, after.proc.pid()).expect("second stall");
    assert_eq!(first_stall["class"], "waiting_for_peer");
    assert_eq!(second_stall["class"], "waiting_for_peer");
    drop(after);
    seen.extend(agent.stop());
    let summary = summary(&seen);
    assert_eq!(summary["stalled"], 2, "{summary}");
    assert!(summary["process_exited"].as_u64().expect("process_exited") >= 1, "{summary}");
}

#[test]
fn a_process_exiting_holds_back_no_other_process_stall() {
    require_root();
    // Detaching a process's probes waits for the kernel's grace periods
    // (~0.1 s a link, seconds at worst): done on the event loop, one
    // process exiting made another's stall, due meanwhile, late. Each
    // round: two demos, one with a request waiting for its peer (due
    // ~1.1 s after `go`), the other killed just before that stall is due.
    const ROUNDS: usize = 5;
    const TIMEOUT_MS: u64 = 1000;
    // A duration of their own: `--exe demo-prefill` would watch other
    // tests' demos too, on a shared host.
    const STALLED: &[&str] =
        &["--rate", "200", "--duration", "37s", "--inject-after", "100ms", "--waiting-for-peer", "1"];
    const HEALTHY: &[&str] = &["--rate", "200", "--duration", "37s"];
    let agent = Agent::selecting(&["--cmdline", "demo-prefill .*--duration 37s"]).timeout("1s").discover();
    let mut seen = Vec::new();
    let (mut late_ms, mut stalls, mut gone) = (Vec::new(), Vec::new(), Vec::new());
    let mut still = None;
    for round in 0..ROUNDS {
        let mut stalled = Demo::start(STALLED);
        let mut exiting = Demo::start(HEALTHY);
        agent.wait_watching(stalled.proc.pid());
        agent.wait_watching(exiting.proc.pid());
        stalled.go();
        exiting.go();
        std::thread::sleep(Duration::from_millis(1_000));
        exiting.proc.signal(libc::SIGKILL);
        gone.push(exiting.proc.pid());
        let pid = stalled.proc.pid();
        agent.wait_until("the stall of the demo still running", WAIT, &mut seen, |s| stall_of(s, pid).is_some());
        let stall = stall_of(&seen, pid).expect("the stall");
        let silent = stall["silent_ms"].as_u64().expect("silent_ms");
        late_ms.push(silent.saturating_sub(TIMEOUT_MS));
        eprintln!("stall lateness (silent_ms - timeout): {} ms", silent.saturating_sub(TIMEOUT_MS));
        stalls.push(stall);
        drop(exiting);
        // The last round's is still watched at the hand-over below.
        if round + 1 < ROUNDS {
            drop(stalled);
            gone.push(pid);
        } else {
            still = Some(stalled);
        }
    }
    let stderr = agent.proc.stderr();
    let detach_ms: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("probes of a process gone detached"))
        .filter_map(|line| line.split("detach_ms=").nth(1))
        .map(|rest| rest.split_whitespace().next().unwrap_or(rest))
        .collect();
    eprintln!("stall lateness per round, ms: {late_ms:?}; detach_ms of the processes gone: {detach_ms:?}");
    for stall in &stalls {
        assert_eq!(stall["class"], "waiting_for_peer", "{stall}");
        // Within timeout + 1 s of its last event, the bound (the
        // figures measured are printed, not bounded tighter).
        assert!(stall["silent_ms"].as_u64().expect("silent_ms") < TIMEOUT_MS + 1_000, "{late_ms:?}: {stall}");
    }
    // The gone processes' probes did go (off the loop, with a word).
    for pid in &gone {
        agent.proc.wait_stderr(&format!("pid={pid} links="), WAIT);
    }
    // A hand-over (SIGTERM keeps the probes for the next agent) keeps the
    // links of the process still running, none of a process gone.
    let still = still.expect("the last round's demo");
    let mut agent = agent;
    let dir = agent.bpf_dir.take().expect("the agent's bpf directory");
    seen.extend(agent.stop_with(libc::SIGTERM));
    let pins: Vec<String> = std::fs::read_dir(&dir)
        .map(|layouts| {
            layouts
                .filter_map(Result::ok)
                .filter_map(|layout| std::fs::read_dir(layout.path().join("links")).ok())
                .flatten()
                .filter_map(Result::ok)
                .map(|pin| pin.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    let live = format!("-pid{}-", still.proc.pid());
    assert!(!pins.is_empty() && pins.iter().all(|pin| pin.contains(&live)), "{live}: {pins:?}");
    assert_eq!(summary(&seen)["stalled"], ROUNDS as u64, "{}", summary(&seen));
}

#[test]
fn a_library_loaded_after_exec_is_found_and_watched() {
    require_root();
    // Python exec's first and imports NIXL (dlopen of libnixl.so) later:
    // the exec alone does not match `--lib`, the re-check after it does.
    let agent = Agent::selecting(&["--lib", "libnixl.so", "--cmdline", "driver\\.py --mode"])
        .profile("nixl")
        .timeout("2s")
        .discover();
    let mut driver = Proc::spawn(
        "nixl driver",
        Command::new(venv_python()).arg(root().join("tests/nixl/driver.py")).args([
            "--mode",
            "never-post",
            "--count",
            "2",
            "--max-seconds",
            "60",
        ]),
    );
    let ready = driver.next_line(Duration::from_secs(30), "ready line").json().expect("ready JSON");
    let initiator = ready["initiator_pid"].as_u64().expect("initiator_pid") as u32;
    agent.wait_watching(initiator);
    driver.write_line("go");
    let mut seen = Vec::new();
    let stalls = agent.wait_alerts("stalled", 2, Duration::from_secs(10), &mut seen);
    for (_, stall) in &stalls {
        assert_eq!(stall["pid"], initiator, "{stall}");
        assert_eq!(stall["class"], "waiting_for_peer", "{stall}");
    }
    seen.extend(agent.stop());
    assert_eq!(summary(&seen)["stalled"], 2);
}

#[test]
fn selectors_that_match_nothing_yet_still_run_and_a_bad_one_is_refused() {
    require_root();
    let socket = test_socket();
    let socket = socket.to_str().expect("utf-8 socket path");
    let agent =
        Agent::selecting(&["--exe", "no-such-program-here"]).timeout("1s").args(&["--socket", socket]).discover();
    // Still running after its first scan: it answers, watching nothing yet.
    let (ok, answer, stderr) =
        run_to_end(Command::new(stallwatch_tests::agent_bin()).args(["inflight", "--json", "--socket", socket]));
    assert!(
        ok,
        "the agent no longer answers after a scan that matched nothing: {stderr}\nagent:\n{}",
        agent.proc.stderr()
    );
    let answer: Value = serde_json::from_str(&answer).expect("inflight --json");
    assert_eq!(
        (answer["processes"].as_array().map(Vec::len), answer["requests"].as_array().map(Vec::len)),
        (Some(0), Some(0)),
        "{answer}"
    );
    let lines = agent.stop();
    assert_eq!(summary(&lines)["seen"], 0);
    let out = Command::new(stallwatch_tests::agent_bin())
        .args(["run", "--cmdline", "(", "--profile", "demo"])
        .output()
        .expect("running the agent");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not a valid regular expression"), "{stderr}");
}

/// The demo's next JSON line whose `event` is `kind`.
fn demo_event(demo: &Demo, kind: &str) -> Value {
    loop {
        let line = demo.proc.next_line(WAIT, &format!("the demo's `{kind}` line"));
        if let Some(value) = line.json().filter(|value| value["event"] == kind) {
            return value;
        }
    }
}

#[test]
fn threads_killed_inside_a_return_probed_function_do_not_disable_return_probes() {
    require_root();
    // The kernel keeps the arguments a return probe reads (`kv_transfer_poll`'s
    // key) from its entry to its return, in a map of this many entries. A
    // call that never returns (its thread killed inside) never takes its
    // entry out.
    const SAVED_CAPACITY: u64 = 16_384;
    const THREADS: u64 = 2_000;
    let threads = THREADS.to_string();
    let agent = Agent::selecting(&["--exe", "demo-prefill", "--cmdline", "stuck-in-poll"]).timeout("1s").discover();
    let mut killed_inside = 0;
    while killed_inside <= SAVED_CAPACITY {
        let mut demo = Demo::start(&["--stuck-in-poll", &threads, "--rate", "100", "--duration", "60s"]);
        agent.wait_watching(demo.proc.pid());
        demo.go();
        let stuck = demo_event(&demo, "stuck");
        assert_eq!(stuck["threads"], THREADS, "{stuck}");
        demo.proc.signal(libc::SIGKILL);
        let _ = demo.proc.wait(WAIT);
        killed_inside += THREADS;
    }
    // A demo after them: its polls' returns still read their key, so its
    // done transfer is seen done (a lost `transfer_done` would make the
    // stall `transfer_hung`) and no event is lost.
    let mut last = Demo::start(&[
        "--stuck-in-poll",
        "1",
        "--rate",
        "200",
        "--duration",
        "30s",
        "--inject-after",
        "300ms",
        "--release-lost",
        "1",
    ]);
    let pid = last.proc.pid();
    agent.wait_watching(pid);
    last.go();
    let mut seen = Vec::new();
    agent.wait_until("the last demo's stall", WAIT, &mut seen, |s| stall_of(s, pid).is_some());
    let stall = stall_of(&seen, pid).expect("stall");
    drop(last);
    seen.extend(agent.stop());
    let summary = summary(&seen);
    assert_eq!(
        summary["args_missing"], 0,
        "after {killed_inside} threads died inside `kv_transfer_poll`, return probes lost events for want of their saved \
         arguments: {summary}"
    );
    assert_eq!(stall["class"], "release_lost", "{stall}");
    assert_eq!(summary["lost_events"], 0, "{summary}");
    assert!(summary["completed"].as_u64().unwrap_or(0) > 100, "the last demo's healthy requests completed: {summary}");
}
