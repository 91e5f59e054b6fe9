//! `stallwatch inflight` against a real agent (real eBPF in this kernel,
//! real uprobes) watching the real demo target with pinned requests.
use std::{
    collections::HashMap,
    os::unix::{
        fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _},
        net::UnixListener,
        process::CommandExt as _,
    },
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{Agent, Demo, METRICS, agent_bin, otlp::http_get, require_root, run_to_end};

const TIMEOUT_MS: u64 = 2000;

/// A socket path inside a fresh temp dir, in a subdirectory the agent must
/// create itself.
fn socket_in(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("run").join("agent.sock")
}

fn path_arg(path: &Path) -> &str {
    path.to_str().expect("UTF-8 temp path")
}

/// `stallwatch inflight` to its end: (success, stdout, stderr).
fn inflight(socket: &Path, extra: &[&str]) -> (bool, String, String) {
    run_to_end(Command::new(agent_bin()).args(["inflight", "--socket", path_arg(socket)]).args(extra))
}

/// `stallwatch inflight --json`, which must succeed; its answer.
fn inflight_json(socket: &Path) -> Value {
    let (ok, stdout, stderr) = inflight(socket, &["--json"]);
    assert!(ok, "inflight failed; stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stdout.lines().count(), 1, "one JSON document on one line: {stdout}");
    serde_json::from_str(&stdout).unwrap_or_else(|err| panic!("inflight --json is not JSON ({err}): {stdout}"))
}

fn expected_stage(kind: &str) -> &'static str {
    match kind {
        "waiting_for_peer" => "enqueued",
        "transfer_hung" => "transfer_posted",
        "release_lost" => "transfer_done",
        other => panic!("unexpected stall kind {other}"),
    }
}

fn rows(answer: &Value) -> &Vec<Value> {
    answer["requests"].as_array().unwrap_or_else(|| panic!("no requests array: {answer}"))
}

fn ms(row: &Value, field: &str) -> u64 {
    row[field].as_u64().unwrap_or_else(|| panic!("{field} missing: {row}"))
}

fn assert_oldest_first(answer: &Value) {
    let ages: Vec<u64> = rows(answer).iter().map(|r| ms(r, "age_ms")).collect();
    assert!(ages.windows(2).all(|w| w[0] >= w[1]), "not sorted by age, oldest first: {ages:?}");
}

/// Every row not pinned is a healthy request caught mid-flight: young.
fn assert_healthy_are_short_lived(answer: &Value, pinned: &HashMap<String, String>) {
    for row in rows(answer) {
        let key = row["key"].as_str().expect("hex key");
        if !pinned.contains_key(key) {
            assert!(ms(row, "age_ms") < 1000, "a healthy request lingers: {row}");
            assert_eq!(row["class"], Value::Null, "a healthy request is stalled: {row}");
        }
    }
}

#[test]
fn pinned_requests_are_listed_with_their_stage_then_their_class_oldest_first() {
    require_root();
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let mut demo = Demo::start(&[
        "--rate",
        "1000",
        "--duration",
        "40s",
        "--inject-after",
        "300ms",
        "--waiting-for-peer",
        "2",
        "--transfer-hung",
        "2",
        "--release-lost",
        "2",
    ]);
    let agent = Agent::watch(demo.proc.pid(), "demo", "2s", &["--socket", path_arg(&socket)]);

    // Root-only: the socket 0600 in a directory the agent made 0700.
    let meta = std::fs::symlink_metadata(&socket).expect("the agent serves its socket");
    assert!(meta.file_type().is_socket(), "{meta:?}");
    assert_eq!(meta.mode() & 0o777, 0o600, "socket mode {:o}", meta.mode() & 0o777);
    let dir_mode = std::fs::metadata(socket.parent().expect("parent")).expect("socket dir").mode() & 0o777;
    assert_eq!(dir_mode, 0o700, "socket dir mode {dir_mode:o}");

    demo.go();
    let pinned: HashMap<String, String> =
        demo.wait_injected(6, &mut Vec::new()).into_iter().map(|(key, pinned)| (key, pinned.stall)).collect();
    let injected_at = Instant::now();

    // Before the timeout: listed at their stage, not stalled yet.
    let answer = inflight_json(&socket);
    assert!(
        injected_at.elapsed() < Duration::from_millis(TIMEOUT_MS),
        "the first query took too long to test anything"
    );
    assert_eq!(answer["version"], 1, "{answer}");
    assert_eq!(answer["timeout_ms"], TIMEOUT_MS, "{answer}");
    let by_key: HashMap<&str, &Value> =
        rows(&answer).iter().map(|r| (r["key"].as_str().expect("hex key"), r)).collect();
    for (key, kind) in &pinned {
        let row =
            by_key.get(key.as_str()).unwrap_or_else(|| panic!("pinned {kind} request {key} not listed: {answer}"));
        assert_eq!(row["stage"], expected_stage(kind), "{row}");
        assert_eq!(row["class"], Value::Null, "not stalled before the timeout: {row}");
        assert_eq!(row["pid"], demo.proc.pid(), "{row}");
        assert_eq!(row["process"], "demo-prefill", "{row}");
        let id = u64::from_str_radix(&key[2..], 16).expect("hex key");
        assert_eq!(row["external_id"], format!("room-{id}"), "{row}");
        assert!(ms(row, "silent_ms") < TIMEOUT_MS && ms(row, "age_ms") >= ms(row, "silent_ms"), "{row}");
    }
    assert_oldest_first(&answer);
    assert_healthy_are_short_lived(&answer, &pinned);

    // After the timeout (the agent has alerted on all six): classified.
    let mut seen = Vec::new();
    agent.wait_alerts("stalled", 6, Duration::from_secs(10), &mut seen);
    let answer = inflight_json(&socket);
    let stalled: Vec<&Value> = rows(&answer).iter().filter(|r| !r["class"].is_null()).collect();
    assert_eq!(stalled.len(), 6, "exactly the pinned requests are stalled: {answer}");
    for row in &stalled {
        let key = row["key"].as_str().expect("hex key");
        let kind = pinned.get(key).unwrap_or_else(|| panic!("a stalled request that was not pinned: {row}"));
        assert_eq!(row["class"], kind.as_str(), "{row}");
        assert_eq!(row["stage"], expected_stage(kind), "{row}");
        assert!(ms(row, "silent_ms") >= TIMEOUT_MS, "{row}");
    }
    // Pinned before any healthy request still in flight: they lead.
    assert!(rows(&answer)[..6].iter().all(|r| !r["class"].is_null()), "{answer}");
    assert_oldest_first(&answer);
    assert_healthy_are_short_lived(&answer, &pinned);
    let processes = answer["processes"].as_array().expect("processes");
    assert_eq!(processes.len(), 1, "{answer}");
    assert_eq!(processes[0]["pid"], demo.proc.pid());
    assert_eq!(processes[0]["stalled"], 6);
    assert!(processes[0]["transport"].is_null(), "no transport evidence is made up: {answer}");

    // The table says the same.
    let (ok, table, stderr) = inflight(&socket, &[]);
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("PID") && lines[0].contains("SILENT") && lines[0].contains("CLASS"), "{table}");
    for (key, kind) in &pinned {
        let line = lines
            .iter()
            .find(|l| l.contains(key.as_str()))
            .unwrap_or_else(|| panic!("{key} not in the table:\n{table}"));
        assert!(line.contains(kind.as_str()) && line.contains(expected_stage(kind)), "{line}");
    }
    assert!(table.contains(", 6 stalled (timeout 2.0s)"), "{table}");
    assert!(table.contains(&format!("pid {} (demo-prefill, profile demo):", demo.proc.pid())), "{table}");

    // Removed when the agent exits.
    let _ = agent.stop();
    assert!(!socket.exists(), "the agent removes its socket on exit");
}

#[test]
fn a_second_agent_on_the_same_socket_fails_and_a_stale_one_is_replaced() {
    require_root();
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let demo = Demo::start(&["--rate", "100", "--duration", "40s"]);
    let pid = demo.proc.pid().to_string();
    let mut first = Agent::watch(demo.proc.pid(), "demo", "2s", &["--socket", path_arg(&socket)]);

    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args([
        "run",
        "--pid",
        &pid,
        "--profile",
        "demo",
        "--socket",
        path_arg(&socket),
    ]));
    assert!(!ok, "a second agent on a live socket must fail; stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("another stallwatch agent is serving")
            && stderr.contains(path_arg(&socket))
            && stderr.contains("--socket"),
        "{stderr}"
    );
    // The first one is unharmed.
    let answer = inflight_json(&socket);
    assert_eq!(answer["processes"][0]["pid"], demo.proc.pid(), "{answer}");

    // Killed without a chance to clean up, it leaves its socket behind; the
    // next agent replaces it.
    first.proc.signal(libc::SIGKILL);
    let _ = first.proc.wait(Duration::from_secs(5));
    assert!(std::fs::symlink_metadata(&socket).is_ok(), "a killed agent leaves its socket");
    let (ok, _, stderr) = inflight(&socket, &[]);
    assert!(!ok && stderr.contains("left over from an agent that is gone"), "{stderr}");
    let second = Agent::watch(demo.proc.pid(), "demo", "2s", &["--socket", path_arg(&socket)]);
    let answer = inflight_json(&socket);
    assert_ne!(answer["agent_pid"], Value::Null);
    assert_eq!(answer["agent_pid"], second.proc.pid(), "the new agent answers: {answer}");
    let _ = second.stop();
}

#[test]
fn inflight_without_an_agent_names_the_socket_and_what_to_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let (ok, stdout, stderr) = inflight(&socket, &[]);
    assert!(!ok, "{stdout}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains(path_arg(&socket)) && stderr.contains("`stallwatch run` must be running"), "{stderr}");
}

#[test]
fn a_caller_without_root_is_told_it_needs_root() {
    require_root();
    let dir = tempfile::tempdir().expect("temp dir");
    // Let anyone reach the socket's directory: the socket's own mode is
    // what must keep them out.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let socket = dir.path().join("agent.sock");
    let demo = Demo::start(&["--rate", "100", "--duration", "40s"]);
    let agent = Agent::watch(demo.proc.pid(), "demo", "2s", &["--socket", path_arg(&socket)]);
    let (ok, stdout, stderr) =
        run_to_end(Command::new(agent_bin()).args(["inflight", "--socket", path_arg(&socket)]).uid(65534).gid(65534));
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("permission denied") && stderr.contains("root"), "{stderr}");
    let _ = agent.stop();
}

#[test]
fn a_garbled_answer_is_reported_as_such() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("not-an-agent.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    let server = std::thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        let (mut stream, _) = listener.accept().expect("accept");
        let mut query = [0; 256];
        let _ = stream.read(&mut query);
        let _ = stream.write_all(b"SSH-2.0-OpenSSH_9.6\r\n");
    });
    let (ok, _, stderr) = inflight(&socket, &["--json"]);
    assert!(!ok);
    assert!(stderr.contains("garbled answer") && stderr.contains(path_arg(&socket)), "{stderr}");
    let _ = server.join();
}

/// Raise this process's open-file limit to at least `n` (up to its hard
/// limit), for the idle connections a test holds.
fn allow_open_files(n: u64) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0, "getrlimit");
    if limit.rlim_cur < n {
        assert!(limit.rlim_max >= n, "the hard limit on open files ({}) is below {n}", limit.rlim_max);
        limit.rlim_cur = n;
        // SAFETY: setrlimit reads the struct we pass.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0, "setrlimit");
    }
}

/// Issue 41: with 1 000 idle connections held on `/metrics`, 3 scrapes of
/// 7 got an empty reply (512 places, each held 2 s), and `inflight` was
/// refused while 4 idle connections were held on the query socket (4
/// places, 5 s). Idle connections now give way to a new client, so each
/// round, with fresh idle connections held (as many as the agent has
/// places and more), a scrape and a query are answered.
#[test]
fn idle_connections_never_keep_a_scrape_or_an_inflight_query_out() {
    require_root();
    const IDLE_TCP: usize = 1000;
    const IDLE_UNIX: usize = 16;
    allow_open_files(2 * (IDLE_TCP + IDLE_UNIX) as u64 + 256);
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let demo = Demo::start(&["--rate", "100", "--duration", "60s"]);
    let agent = Agent::watch(demo.proc.pid(), "demo", "2s", &[METRICS[0], METRICS[1], "--socket", path_arg(&socket)]);
    let port = agent.metrics_port();
    for round in 0..7 {
        // Held, sending nothing, until the next round's replace them.
        let idle_tcp: Vec<std::net::TcpStream> = (0..IDLE_TCP)
            .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).expect("an idle connection to /metrics"))
            .collect();
        let idle_unix: Vec<std::os::unix::net::UnixStream> = (0..IDLE_UNIX)
            .map(|_| std::os::unix::net::UnixStream::connect(&socket).expect("an idle connection to the socket"))
            .collect();
        let (status, body) = http_get(port, "/metrics", None);
        assert_eq!(status, "HTTP/1.1 200 OK", "round {round}: scrape not answered ({body:?})");
        assert!(body.contains("stallwatch_build_info"), "round {round}: {body}");
        let answer = inflight_json(&socket);
        assert_eq!(answer["agent_pid"], agent.proc.pid(), "round {round}: {answer}");
        drop((idle_tcp, idle_unix));
    }
    let stderr = agent.proc.stderr();
    assert!(!stderr.contains("panicked"), "{stderr}");
}
