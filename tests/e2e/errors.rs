//! Bad input gets a clear error naming the thing and the fix, and a
//! non-zero exit; never a panic or a silent no-op.
use std::{
    ffi::OsStr,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    process::{Child, ChildStderr, Command, Stdio},
};

use stallwatch_tests::{Demo, agent_bin, require_root, root, run_to_end, test_socket, wait_for};

/// Run the agent to its end and return its stderr, asserting it failed
/// without panicking.
fn fails(args: &[&str]) -> String {
    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(args));
    assert!(!ok, "expected failure of {args:?}; stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// A built-in profile's text, as `stallwatch profile show` prints it.
fn stallwatch_profile_text(name: &str) -> String {
    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(["profile", "show", name]));
    assert!(ok, "{stderr}");
    stdout
}

fn profile_file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new().suffix(".toml").tempfile().expect("temp profile");
    file.write_all(text.as_bytes()).expect("writing the temp profile");
    file
}

/// `stallwatch profile check` on a profile of this text: its stderr, the
/// check having failed without panicking.
fn check_fails(text: &str) -> String {
    let file = profile_file(text);
    fails(&["profile", "check", file.path().to_str().expect("utf-8 temp path")])
}

fn watch_with(profile: &str) -> String {
    require_root();
    let demo = Demo::start(&["--duration", "20s"]);
    let file = profile_file(profile);
    let path = file.path().to_str().expect("utf-8 temp path");
    let socket = test_socket();
    let socket = socket.to_str().expect("utf-8 socket path");
    let pid = demo.proc.pid().to_string();
    let stderr =
        fails(&["run", "--pid", &pid, "--profile", path, "--timeout", "1s", "--ephemeral", "--socket", socket]);
    drop(demo);
    stderr
}

#[test]
fn a_pid_that_does_not_exist_is_named() {
    // Above any pid_max, so never a live process.
    let stderr = fails(&["run", "--pid", "4194305", "--profile", "demo"]);
    assert!(stderr.contains("no process with pid 4194305"), "{stderr}");
}

#[test]
fn an_unknown_profile_lists_the_built_ins() {
    let stderr = fails(&["run", "--pid", "1", "--profile", "no-such-profile"]);
    assert!(stderr.contains("no built-in profile named `no-such-profile`"), "{stderr}");
    assert!(stderr.contains("demo"), "{stderr}");
}

#[test]
fn malformed_toml_names_file_and_line() {
    let file = profile_file("name = \"x\"\n\n[[probe]]\nsymbol = \"f\"\nat = \"entry\nevent = \"enqueued\"\n");
    let path = file.path().to_str().expect("utf-8 temp path");
    let stderr = fails(&["profile", "check", path]);
    assert!(stderr.contains(path), "{stderr}");
    assert!(stderr.contains("line 5"), "{stderr}");
}

#[test]
fn an_unknown_event_names_the_probe_line_and_the_valid_events() {
    let stderr = check_fails(
        "[[probe]]\nsymbol = \"a\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n\n[[probe]]\nsymbol = \"b\"\nat = \"entry\"\nevent = \"posted\"\nkey = { from = \"arg0\" }\n",
    );
    assert!(stderr.contains("line 7"), "{stderr}");
    assert!(stderr.contains("unknown lifecycle event \"posted\""), "{stderr}");
    assert!(stderr.contains("\"transfer_posted\""), "{stderr}");
}

#[test]
fn a_missing_symbol_is_named_with_suggestions() {
    let stderr = watch_with(
        "[[probe]]\nsymbol = \"prefill_enqueu\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n",
    );
    assert!(stderr.contains("symbol `prefill_enqueu` not found"), "{stderr}");
    assert!(stderr.contains("did you mean: prefill_enqueue"), "{stderr}");
    assert!(stderr.contains("line 1"), "{stderr}");
}

#[test]
fn a_library_the_process_has_not_mapped_is_named() {
    let stderr = watch_with(
        "[[probe]]\nobject = \"libnixl.so\"\nsymbol = \"x\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n",
    );
    assert!(stderr.contains("has no file `libnixl.so` mapped"), "{stderr}");
    assert!(stderr.contains("libc.so"), "lists what is mapped: {stderr}");
}

#[test]
fn a_zero_tick_or_timeout_is_refused_before_anything_is_attached() {
    require_root();
    let demo = Demo::start(&["--duration", "20s"]);
    let pid = demo.proc.pid().to_string();
    let socket = test_socket();
    let socket = socket.to_str().expect("utf-8 socket path");
    for (flag, value) in [("--tick", "0s"), ("--timeout", "0ms")] {
        let stderr =
            fails(&["run", "--pid", &pid, "--profile", "demo", "--ephemeral", "--socket", socket, flag, value]);
        assert!(stderr.contains(&format!("invalid value '{value}' for '{flag}")), "{stderr}");
        assert!(stderr.contains("a zero duration would stop the timers"), "{stderr}");
        assert!(!stderr.contains("watching"), "refused before attaching: {stderr}");
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "profile = \"demo\"\nephemeral = true\n\ntick = \"0s\"\n").expect("writing the config");
    let config = config.to_str().expect("utf-8 config path");
    let stderr = fails(&["run", "--config", config, "--pid", &pid, "--socket", socket]);
    assert!(stderr.contains("line 4: tick: a zero duration would stop the timers"), "{stderr}");
    let stderr = fails(&["config", "check", config]);
    assert!(stderr.contains("line 4: tick: a zero duration"), "{stderr}");
}

#[test]
fn pid_zero_is_not_a_process() {
    let stderr = fails(&["run", "--pid", "0", "--profile", "demo", "--ephemeral"]);
    assert!(stderr.contains("pid 0 is not a process id"), "{stderr}");
    assert!(!stderr.contains("pidfd_open"), "no raw syscall error: {stderr}");
}

#[test]
fn a_thread_id_names_its_process() {
    require_root();
    // The demo runs on its main thread only: take one of this process.
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        tx.send(unsafe { libc::gettid() }).expect("sending the tid");
        let _ = stopped.recv();
    });
    let tid = rx.recv().expect("the thread's id").to_string();
    let stderr = fails(&[
        "run",
        "--pid",
        &tid,
        "--profile",
        "demo",
        "--ephemeral",
        "--socket",
        test_socket().to_str().expect("utf-8"),
    ]);
    let me = std::process::id();
    assert!(
        stderr.contains(&format!("pid {tid} is a thread of process {me}, not a process: pass --pid {me}")),
        "{stderr}"
    );
    drop(stop);
    thread.join().expect("thread");
}

/// Run `args` with stdout a pipe whose reader is already gone, as in
/// `stallwatch ... | head -1` once head has exited.
fn into_a_closed_pipe(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(agent_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting stallwatch");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("waiting for stallwatch");
    (out.status, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn every_printing_command_stops_quietly_when_its_reader_goes_away() {
    let profile = profile_file(&stallwatch_profile_text("nixl"));
    let path = profile.path().to_str().expect("utf-8 temp path");
    let config = root().join("agent/deploy/base/config.toml");
    let config = config.to_str().expect("utf-8 path");
    for args in [
        ["profile", "check", path].as_slice(),
        &["profile", "show", "nixl"],
        &["profile", "list"],
        &["config", "check", config],
    ] {
        let (status, stderr) = into_a_closed_pipe(args);
        assert!(status.success(), "{args:?}: {status}; stderr:\n{stderr}");
        assert!(stderr.is_empty(), "{args:?} says nothing: {stderr}");
    }
}

/// An agent watching `pid` with `extra` flags whose stdout's reader went
/// away at once, started and attached; its stderr so far, and the rest.
struct Unread {
    agent: Child,
    log: BufReader<ChildStderr>,
    stderr: String,
}

impl Unread {
    fn watch(pid: u32, extra: &[&OsStr]) -> Self {
        let mut agent = Command::new(agent_bin())
            .args(["run", "--pid", &pid.to_string(), "--profile", "demo", "--socket"])
            .arg(test_socket())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting stallwatch");
        drop(agent.stdout.take());
        let mut stderr = String::new();
        let mut log = BufReader::new(agent.stderr.take().expect("piped stderr"));
        while !stderr.contains("watching") {
            assert!(
                log.read_line(&mut stderr).expect("reading the agent's stderr") > 0,
                "the agent exited before watching:\n{stderr}"
            );
        }
        Self { agent, log, stderr }
    }

    /// Wait for its end: it exited 0 with no error, and its whole stderr.
    fn ends_cleanly(mut self) -> String {
        self.log.read_to_string(&mut self.stderr).expect("reading the agent's stderr");
        let status = self.agent.wait().expect("waiting for stallwatch");
        let stderr = self.stderr;
        assert!(status.success(), "{status}; stderr:\n{stderr}");
        assert!(!stderr.contains("error") && !stderr.contains("panicked"), "{stderr}");
        stderr
    }
}

#[test]
fn an_agent_whose_stdout_reader_goes_away_stops_cleanly() {
    require_root();
    let mut demo = Demo::start(&["--duration", "20s", "--inject-after", "100ms", "--waiting-for-peer", "1"]);
    // The request is pinned only once the agent watches, or it would never
    // see it stall and never write.
    let agent = Unread::watch(demo.proc.pid(), &["--timeout".as_ref(), "500ms".as_ref(), "--ephemeral".as_ref()]);
    demo.go();
    // The stall alert is the first write; the agent then stops by itself.
    let stderr = agent.ends_cleanly();
    assert!(stderr.contains("stdout was closed (its reader went away): stopping"), "{stderr}");
}

#[test]
fn a_stop_with_stdout_closed_before_anything_was_written_still_hands_over() {
    require_root();
    let demo = Demo::start(&["--duration", "20s"]);
    let dir = stallwatch_tests::test_bpf_dir();
    let agent =
        Unread::watch(demo.proc.pid(), &["--timeout".as_ref(), "5s".as_ref(), "--bpf-dir".as_ref(), dir.as_os_str()]);
    // Nothing stalls: the summary at the stop is the first write.
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(agent.agent.id() as i32, libc::SIGTERM) };
    let stderr = agent.ends_cleanly();
    let cleared = Command::new(agent_bin()).args(["state", "clear", "--bpf-dir"]).arg(&dir).output();
    assert!(stderr.contains("probes left attached"), "the stop skipped its hand-over:\n{stderr}");
    assert!(cleared.is_ok_and(|out| out.status.success()), "stallwatch state clear --bpf-dir {}", dir.display());
    drop(demo);
}

#[test]
fn a_megabyte_symbol_gets_no_suggestions_and_a_short_error() {
    let symbol = "q".repeat(1 << 20);
    let stderr = watch_with(&format!(
        "[[probe]]\nsymbol = \"{symbol}\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = {{ from = \"arg0\" }}\n"
    ));
    assert!(stderr.contains("no suggestions for a name of 1048576 bytes"), "{}", &stderr[..stderr.len().min(2000)]);
    assert!(stderr.len() < 8192, "the name is not printed whole: {} bytes of stderr", stderr.len());
}

#[test]
fn profile_check_refuses_rules_that_cannot_match_and_double_probes() {
    let never = "[[probe]]\nsymbol = \"kv_transfer_poll\"\nat = \"return\"\nret = \"i32\"\nkey = { from = \"arg0\" }\non_return = [\n  { when = \"== 99999999999999\", event = \"transfer_done\" },\n]\n";
    let stderr = check_fails(never);
    assert!(stderr.contains("line 1 ([[probe]] for `kv_transfer_poll`)"), "{stderr}");
    assert!(stderr.contains("`when = \"== 99999999999999\"` (line 7) never holds"), "{stderr}");

    let twice = "[[probe]]\nsymbol = \"prefill_enqueue\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\", deref = [0] }\n\n[[probe]]\nsymbol = \"prefill_enqueue\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\", deref = [0] }\n";
    let stderr = check_fails(twice);
    assert!(
        stderr.contains(
            "line 7 ([[probe]] for `prefill_enqueue`): the [[probe]] on line 1 probes the same function's entry"
        ),
        "{stderr}"
    );
}

#[test]
fn an_external_id_read_at_the_key_itself_is_refused() {
    let at_key = "[[probe]]\nsymbol = \"prefill_enqueue\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\", deref = [0] }\nexternal_id = { from = \"key\" }\n";
    let stderr = check_fails(at_key);
    assert!(stderr.contains("line 1 ([[probe]] for `prefill_enqueue`)"), "{stderr}");
    assert!(stderr.contains("`external_id = { from = \"key\" }` would read at the address the key holds"), "{stderr}");
}

/// An agent whose stdout is a pipe nobody reads: its alerts fill the pipe,
/// yet it goes on answering `stallwatch inflight` and /metrics, drops the
/// oldest alert lines (counted, never the detections) and stops cleanly.
#[test]
fn an_agent_whose_stdout_nobody_reads_keeps_answering_and_counts_what_it_drops() {
    require_root();
    let mut demo = Demo::start(&["--duration", "60s", "--inject-after", "100ms", "--waiting-for-peer", "3000"]);
    let socket = test_socket();
    let mut agent = Command::new(agent_bin())
        .args(["run", "--pid", &demo.proc.pid().to_string(), "--profile", "demo", "--timeout", "1s", "--ephemeral"])
        .args(["--metrics-addr", "127.0.0.1:0", "--socket"])
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting stallwatch");
    // Held open, never read: a log shipper that stopped draining.
    let _stdout = agent.stdout.take();
    let mut log = BufReader::new(agent.stderr.take().expect("piped stderr"));
    let mut stderr = String::new();
    while !stderr.contains("serving `stallwatch inflight`") {
        assert!(log.read_line(&mut stderr).expect("reading the agent's stderr") > 0, "the agent exited:\n{stderr}");
    }
    let port: u16 = stderr
        .lines()
        .find_map(|line| line.split("addr=127.0.0.1:").nth(1)?.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no metrics address:\n{stderr}"));
    let stderr_lines = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = log.read_to_string(&mut rest);
        rest
    });
    demo.go();
    // 3000 stall alerts: far more than the pipe and the queue hold.
    let dropped = stallwatch_tests::wait_for("alert lines dropped", std::time::Duration::from_secs(30), || {
        let (_, body) = stallwatch_tests::otlp::http_get(port, "/metrics", None);
        Some(stallwatch_tests::metric(&body, "stallwatch_alert_lines_dropped_total")).filter(|&n| n > 0)
    });
    let stalled = || {
        let (ok, stdout, stderr) =
            run_to_end(Command::new(agent_bin()).args(["inflight", "--json", "--socket"]).arg(&socket));
        assert!(ok, "inflight against an agent whose stdout is full: {stderr}");
        let value: serde_json::Value = serde_json::from_str(&stdout).expect("inflight JSON");
        value["requests"].as_array().expect("requests").iter().filter(|r| r["class"] == "waiting_for_peer").count()
    };
    stallwatch_tests::wait_for("3000 stalls in `stallwatch inflight`", std::time::Duration::from_secs(20), || {
        Some(stalled()).filter(|&n| n == 3000)
    });
    let (_, body) = stallwatch_tests::otlp::http_get(port, "/metrics", None);
    assert_eq!(
        stallwatch_tests::metric(&body, "stallwatch_stalls_total{class=\"waiting_for_peer\"}"),
        3000,
        "every detection kept"
    );
    assert!(dropped > 0);
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(agent.id() as i32, libc::SIGINT) };
    let status = agent.wait().expect("waiting for stallwatch");
    let rest = stderr_lines.join().expect("stderr thread");
    assert!(status.success(), "{status}; stderr:\n{stderr}{rest}");
    assert!(rest.contains("stdout is not draining: the oldest alert lines were dropped"), "{rest}");
    assert!(rest.contains("stdout did not take the last alert lines"), "{rest}");
    assert!(!rest.contains("panicked"), "{rest}");
}

/// stderr's reader gone (a closed pipe) loses the logs, not the agent: it
/// watches, alerts on stdout and stops with its summary, exit 0.
#[test]
fn an_agent_whose_stderr_is_gone_runs_and_stops_cleanly() {
    require_root();
    let mut demo = Demo::start(&["--duration", "30s", "--inject-after", "1s", "--waiting-for-peer", "1"]);
    let socket = test_socket();
    let mut agent = Command::new(agent_bin())
        .args(["run", "--pid", &demo.proc.pid().to_string(), "--profile", "demo", "--timeout", "500ms", "--ephemeral"])
        .args(["--output", "json", "--socket"])
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting stallwatch");
    drop(agent.stderr.take());
    let mut out = BufReader::new(agent.stdout.take().expect("piped stdout"));
    // Attached once it serves its socket (its "watching" line goes nowhere).
    wait_for("the agent's query socket", std::time::Duration::from_secs(30), || socket.exists().then_some(()));
    demo.go();
    let mut line = String::new();
    assert!(out.read_line(&mut line).expect("reading stdout") > 0, "the agent exited: {:?}", agent.wait());
    assert!(line.contains("\"alert\":\"stalled\""), "{line}");
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(agent.id() as i32, libc::SIGINT) };
    let mut rest = String::new();
    out.read_to_string(&mut rest).expect("reading stdout");
    let status = agent.wait().expect("waiting for stallwatch");
    assert!(status.success(), "{status}: {rest}");
    assert!(rest.contains("\"alert\":\"summary\""), "{rest}");
}

/// Something endless given as a profile or config file is refused after
/// reading a bounded amount, with an error that says what and why.
#[test]
fn an_endless_config_or_profile_file_is_refused_quickly() {
    for args in [
        ["config", "check", "/dev/zero"].as_slice(),
        &["profile", "check", "/dev/zero"],
        &["run", "--pid", "1", "--profile", "/dev/zero"],
    ] {
        // A read of /dev/zero to its end never returns: that it returns at
        // all is the test (no wall-clock bound).
        let stderr = fails(args);
        assert!(
            stderr.contains("/dev/zero holds more than 4096 KiB") && stderr.contains("check the path"),
            "{args:?}: {stderr}"
        );
    }
}

/// An unprivileged `run` fails before it creates anything: a bpf or
/// socket directory it made would be its user's, and every root agent on
/// the node would then refuse it.
#[test]
fn an_unprivileged_run_fails_before_creating_anything() {
    require_root();
    let demo = Demo::start(&["--duration", "20s"]);
    let tag = format!("stallwatch-unprivileged-{}", std::process::id());
    let bpf_dir = std::path::Path::new("/sys/fs/bpf").join(&tag);
    let socket_dir = std::env::temp_dir().join(&tag);
    let (ok, _, stderr) = run_to_end(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"])
            .arg(agent_bin())
            .args(["run", "--pid", &demo.proc.pid().to_string(), "--profile", "demo", "--bpf-dir"])
            .arg(&bpf_dir)
            .arg("--socket")
            .arg(socket_dir.join("s.sock")),
    );
    let created = (bpf_dir.exists(), socket_dir.exists());
    let _ = std::fs::remove_dir_all(&bpf_dir);
    let _ = std::fs::remove_dir_all(&socket_dir);
    assert!(!ok, "{stderr}");
    assert!(stderr.contains("not enough privileges") && stderr.contains("nothing was created"), "{stderr}");
    assert_eq!(created, (false, false), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
