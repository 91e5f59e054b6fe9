//! The agent in a time namespace (`unshare --time`): its CLOCK_MONOTONIC is
//! shifted, the kernel's event timestamps are not. Stalls must still be
//! judged on the kernel's clock and printed at the right wall-clock time,
//! and `doctor` says what it found. A real namespace, a real target.
use std::{
    process::Command,
    time::{Duration, SystemTime},
};

use stallwatch_tests::{Demo, Proc, agent_bin, require_root, run_to_end, test_bpf_dir, test_socket};

/// The agent run under `unshare --time --monotonic=OFFSET`.
fn agent_in_time_namespace(offset: &str, pid: u32) -> (Proc, std::path::PathBuf) {
    let dir = test_bpf_dir();
    let proc = Proc::spawn(
        "stallwatch in a time namespace",
        Command::new("unshare")
            .args(["--time", &format!("--monotonic={offset}")])
            .arg(agent_bin())
            .args(["run", "--pid", &pid.to_string(), "--profile", "demo", "--timeout", "1s", "--output", "json"])
            .arg("--socket")
            .arg(test_socket())
            .arg("--bpf-dir")
            .arg(&dir),
    );
    proc.wait_stderr("serving `stallwatch inflight`", Duration::from_secs(30));
    (proc, dir)
}

/// Behind the host (no stall would ever be due) and ahead of it (every
/// time printed would be off by the offset): the pinned request stalls
/// once, on time, stamped with the real time.
#[test]
fn an_agent_in_a_time_namespace_judges_and_prints_on_the_kernels_clock() {
    require_root();
    for offset in ["-300", "300"] {
        let mut demo = Demo::start(&["--duration", "30s", "--inject-after", "500ms", "--waiting-for-peer", "1"]);
        let (agent, dir) = agent_in_time_namespace(offset, demo.proc.pid());
        demo.go();
        let mut seen = Vec::new();
        let alert = loop {
            let line =
                agent.next_line(Duration::from_secs(15), &format!("a stall alert with the clock offset {offset}"));
            if line.json().is_some_and(|value| value["alert"] == "stalled") {
                break line.json().expect("json");
            }
            seen.push(line);
        };
        let ts = humantime::parse_rfc3339(alert["ts"].as_str().expect("ts")).expect("RFC 3339 ts");
        let off = SystemTime::now().duration_since(ts).unwrap_or_else(|err| err.duration());
        // Off by the offset (300 s) without the correction.
        assert!(off < Duration::from_secs(60), "offset {offset}: the alert is stamped {off:?} from now: {alert}");
        assert_eq!(alert["class"], "waiting_for_peer", "{alert}");
        drop(agent);
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn doctor_says_the_time_namespace_offset() {
    let (_, stdout, stderr) =
        run_to_end(Command::new("unshare").args(["--time", "--monotonic=-300"]).arg(agent_bin()).arg("doctor"));
    assert!(stdout.contains("time_namespace") && stdout.contains("-300.000s"), "{stdout}\n{stderr}");
    let (_, stdout, _) = run_to_end(Command::new(agent_bin()).arg("doctor"));
    assert!(stdout.contains("no time-namespace offset"), "{stdout}");
}
