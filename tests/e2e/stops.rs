//! However the agent is stopped it ends the same way: its summary written
//! where it can still go, and its state left for the next agent as
//! `--on-exit` says. A signal whose default would kill it (SIGHUP from a
//! closed terminal, a stray SIGUSR1), a stop during start-up, a stdout on
//! a full disk.
use std::{
    io::{BufRead as _, BufReader, Read as _},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use stallwatch_tests::{
    Agent, Demo, METRICS, agent_bin, pinned_links, require_root, run_to_end, summary, test_bpf_dir, test_socket,
};

/// `stallwatch state clear` on `dir`: whether it found probes to detach.
fn clear(dir: &Path) -> bool {
    let (ok, stdout, stderr) =
        run_to_end(Command::new(agent_bin()).arg("state").arg("clear").arg("--bpf-dir").arg(dir));
    assert!(ok, "state clear --bpf-dir {}: {stderr}", dir.display());
    stdout.contains("probes are detached")
}

#[test]
fn every_signal_that_would_kill_the_agent_ends_it_as_sigterm_does() {
    require_root();
    let demo = Demo::start(&["--duration", "60s"]);
    for (name, signal) in [("SIGHUP", libc::SIGHUP), ("SIGQUIT", libc::SIGQUIT), ("SIGUSR1", libc::SIGUSR1)] {
        let dir = test_bpf_dir();
        let mut agent = Agent::watch(demo.proc.pid(), "demo", "5s", &["--bpf-dir", dir.to_str().expect("utf-8")]);
        agent.bpf_dir = None;
        let (lines, logged) = agent.stop_logged(signal);
        assert_eq!(summary(&lines)["alert"], "summary", "{name}: no summary");
        assert!(
            logged.contains(&format!("signal=\"{name}\"")) || logged.contains(&format!("signal={name}")),
            "{logged}"
        );
        assert!(pinned_links(&dir) > 0, "{name}: the probes were not left for the next agent:\n{logged}");
        assert!(clear(&dir), "{name}: nothing was pinned");
    }
}

#[test]
fn a_stop_during_start_up_ends_the_agent_at_once_and_leaves_nothing_behind() {
    require_root();
    let demo = Demo::start(&["--duration", "60s"]);
    let dir = test_bpf_dir();
    let mut agent = Command::new(agent_bin())
        .args(["run", "--pid", &demo.proc.pid().to_string(), "--profile", "demo", "--bpf-dir"])
        .arg(&dir)
        .arg("--socket")
        .arg(test_socket())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting stallwatch");
    // As soon as it has installed its handlers: its first log line is
    // written after that, before the eBPF object is loaded.
    let mut log = BufReader::new(agent.stderr.take().expect("piped stderr"));
    let mut first = String::new();
    assert!(log.read_line(&mut first).expect("stderr") > 0, "the agent exited at once");
    let sent = Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    let mut rest = String::new();
    log.read_to_string(&mut rest).expect("stderr");
    let status = agent.wait().expect("waiting for stallwatch");
    let took = sent.elapsed();
    eprintln!("stopped {took:?} after SIGTERM during start-up");
    assert!(status.success(), "{status}: {first}{rest}");
    assert!(took < Duration::from_secs(10), "a stop during start-up waited for the start-up: {took:?}");
    if rest.contains("stopped while") {
        // Stopped before watching: nothing attached is left.
        assert!(!rest.contains("watching pid"), "{rest}");
        assert_eq!(pinned_links(&dir), 0, "{rest}");
    }
    let _ = clear(&dir);
}

#[test]
fn a_full_disk_under_stdout_costs_the_lines_not_the_agent_nor_its_state() {
    require_root();
    let dir = test_bpf_dir();
    let mut demo = Demo::start(&["--duration", "60s", "--inject-after", "100ms", "--waiting-for-peer", "1"]);
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").expect("/dev/full");
    let mut agent = Command::new(agent_bin())
        .args(["run", "--pid", &demo.proc.pid().to_string(), "--profile", "demo", "--timeout", "500ms"])
        .args(["--output", "json", "--bpf-dir"])
        .arg(&dir)
        .arg("--socket")
        .arg(test_socket())
        .stdin(Stdio::null())
        .stdout(full)
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting stallwatch");
    let mut log = BufReader::new(agent.stderr.take().expect("piped stderr"));
    let mut stderr = String::new();
    let mut wait_for = |needle: &str| {
        while !stderr.contains(needle) {
            assert!(log.read_line(&mut stderr).expect("stderr") > 0, "the agent exited before `{needle}`:\n{stderr}");
        }
    };
    wait_for("watching");
    demo.go();
    // The stall alert's write fails; the agent goes on and says so.
    wait_for("writing alert lines to stdout fails");
    assert!(agent.try_wait().expect("try_wait").is_none(), "the agent ended:\n{stderr}");
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    log.read_to_string(&mut stderr).expect("stderr");
    let status = agent.wait().expect("waiting for stallwatch");
    assert!(status.success(), "{status}:\n{stderr}");
    // The summary, on stderr since stdout would not take it, counts the
    // lines lost.
    let last: serde_json::Value = stderr
        .lines()
        .find_map(|line| serde_json::from_str::<serde_json::Value>(line).ok().filter(|v| v["alert"] == "summary"))
        .unwrap_or_else(|| panic!("no summary on stderr:\n{stderr}"));
    assert!(last["alert_lines_failed"].as_u64().unwrap_or(0) >= 1, "the stall's line: {last}");
    assert_eq!(last["stalled"], 1, "{last}");
    assert!(stderr.contains("probes left attached"), "--on-exit keep was not honoured:\n{stderr}");
    assert!(pinned_links(&dir) > 0);

    // The next agent takes the stuck request over.
    let mut next = Agent::on_pid(demo.proc.pid()).bpf_dir(&dir).timeout("500ms").watch();
    next.proc.wait_stderr("took over the requests in flight", Duration::from_secs(10));
    next.bpf_dir = None;
    let lines = next.stop_with(libc::SIGTERM);
    assert_eq!(summary(&lines)["restored"], 1, "{}", summary(&lines));
    assert!(clear(&dir));
}

#[test]
fn detaching_gone_processes_and_stopping_the_agent_are_timed() {
    require_root();
    // The real vLLM server's three processes exit together: their probes'
    // links go together, each waiting for the kernel's grace periods
    // (agent/src/kernel/detach.rs). The times are printed, not bounded:
    // they are the kernel's, on a shared host. Nothing pinned
    // (`--ephemeral`): the stop detaches every link of the processes still
    // watched, the slowest stop there is.
    const GROUP: usize = 3;
    const ARGS: &[&str] = &["--rate", "200", "--duration", "41s"];
    let agent = Agent::selecting(&["--cmdline", "demo-prefill .*--duration 41s"])
        .timeout("5s")
        .args(&["--on-exit", "detach", "--ephemeral", METRICS[0], METRICS[1]])
        .discover();
    let mut demos: Vec<Demo> = (0..GROUP * 2).map(|_| Demo::start(ARGS)).collect();
    for demo in &mut demos {
        agent.wait_watching(demo.proc.pid());
        demo.go();
    }
    // Their probes firing (a busy process's links take longest to go).
    agent.wait_completed(200);
    let gone: Vec<Demo> = demos.drain(..GROUP).collect();
    for demo in &gone {
        demo.proc.signal(libc::SIGKILL);
    }
    let pids: Vec<u32> = gone.iter().map(|demo| demo.proc.pid()).collect();
    for mut demo in gone {
        let _ = demo.proc.wait(Duration::from_secs(10));
    }
    let reaped = Instant::now();
    for pid in &pids {
        agent.proc.wait_stderr(&format!("detached pid={pid} links="), Duration::from_secs(60));
    }
    let to_last_detach = reaped.elapsed();
    let logged = agent.proc.stderr();
    let detach_ms: Vec<&str> = logged
        .lines()
        .filter(|line| line.contains("probes of a process gone detached"))
        .filter_map(|line| line.split("pid=").nth(1))
        .collect();
    eprintln!(
        "{GROUP} processes killed together: the last detached {:.0} ms after they were reaped (at most, the \
         check polls every 20 ms); each: {detach_ms:?}",
        to_last_detach.as_secs_f64() * 1e3
    );
    let watched: usize = logged
        .lines()
        .filter(|line| {
            line.contains("watching pid=") && demos.iter().any(|d| line.contains(&format!("pid={} ", d.proc.pid())))
        })
        .filter_map(|line| line.split("probes=").nth(1)?.split_whitespace().next()?.parse::<usize>().ok())
        .sum();
    let stopping = Instant::now();
    let lines = agent.stop_with(libc::SIGTERM);
    let stop = stopping.elapsed();
    eprintln!(
        "SIGTERM to exit with {} processes still watched ({watched} probes), every link detached at the stop: {:.0} ms",
        demos.len(),
        stop.as_secs_f64() * 1e3
    );
    let summary = summary(&lines);
    assert_eq!(summary["alert"], "summary", "{summary}");
    assert_eq!(detach_ms.len(), GROUP, "{logged}");
}
