//! What workload identity costs the agent: the memory of 1 000 pods'
//! metadata cached (one PodList from a local HTTP server answering as the
//! API server does, the agent's own `Directory` listing and indexing it,
//! then watching, the watch held open without an event),
//! the time of that list and of a cached lookup, and a `/metrics` render
//! with 10 000 per-workload series (`stallwatch_workload_requests_stalled`).
//!
//! With `--bench`, as root, it also runs the real agent (`STALLWATCH_BIN`)
//! on the demo target (`STALLWATCH_DEMO`) moved into a pod's cgroup
//! (`kubepods/burstable/pod<UID>/<ID>`, cgroup v1 `pids`), once with
//! `--kubernetes off` and once listing the same 1 000 pods, and reads each
//! agent's VmRSS once it has named the process.
//!
//! `cargo bench -p stallwatch --bench workload` prints the figures. Under
//! `cargo test --all-targets` it runs a smoke version (50 pods, 100 series)
//! that checks every pod is found and every series rendered; no figure is
//! a pass/fail test.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use stallwatch::{
    export::{
        metrics::{self, Format, Metrics},
        workload::{Directory, Source, Workload},
    },
    lifecycle::{Engine, EngineConfig, StallClass},
};

const PODS: usize = 1_000;
const SERIES: usize = 10_000;
const RENDERS: usize = 20;
const SMOKE_PODS: usize = 50;
const SMOKE_SERIES: usize = 100;
const SMOKE_RENDERS: usize = 2;

fn smoke() -> bool {
    !std::env::args().any(|arg| arg == "--bench")
}

fn container_id(n: usize) -> String {
    format!("{n:016x}").repeat(4)
}

/// A PodList of `pods` pods of a Deployment, two containers each, with the
/// fields a kubelet fills (labels, owner, status) so the text is the size a
/// real one is.
fn pod_list(pods: usize) -> String {
    let items: Vec<serde_json::Value> = (0..pods)
        .map(|n| {
            serde_json::json!({
                "metadata": {
                    "name": format!("prefill-7d9f8-{n:05}"), "namespace": format!("team-{}", n % 20),
                    "uid": format!("{n:08x}-1d2f-4a3b-9c8d-7e6f5a4b3c2d"),
                    "labels": {"app": "prefill", "pod-template-hash": "7d9f8", "app.kubernetes.io/part-of": "llm-serving"},
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "prefill-7d9f8", "uid": "x", "controller": true}]
                },
                "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "sglang", "image": "lmsysorg/sglang:v0.5"}, {"name": "sidecar", "image": "envoy"}]},
                "status": {"phase": "Running", "podIP": "10.0.0.1", "containerStatuses": [
                    {"name": "sglang", "containerID": format!("containerd://{}", container_id(2 * n)), "ready": true, "restartCount": 0},
                    {"name": "sidecar", "containerID": format!("containerd://{}", container_id(2 * n + 1)), "ready": true, "restartCount": 0}
                ]}
            })
        })
        .collect();
    serde_json::json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items})
        .to_string()
}

/// Serve `body` to every list on a loopback port, a thread a connection
/// (a client may connect and send its request later: the in-process
/// directories' watches, whose runtime runs only in `block_on`); a watch
/// is held open with no event (the pods do not change).
fn serve(body: String) -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding the API server")?;
    let port = listener.local_addr()?.port();
    let body = Arc::new(body);
    std::thread::spawn(move || {
        for stream in listener.incoming().take(32) {
            let Ok(mut stream) = stream else { continue };
            let body = Arc::clone(&body);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let (mut line, mut request) = (String::new(), String::new());
                while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                    request.push_str(&line);
                    line.clear();
                }
                if request.contains("watch=true") {
                    let _ = write!(stream, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n");
                    // Held open until the bench ends.
                    loop {
                        std::thread::park();
                    }
                }
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    Ok(port)
}

/// This process's resident memory, from /proc/self/statm.
fn rss_bytes() -> Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm.split_whitespace().nth(1).context("statm")?.parse()?;
    Ok(pages * 4096)
}

fn main() -> Result<()> {
    let smoke = smoke();
    let (pods, series, renders) =
        if smoke { (SMOKE_PODS, SMOKE_SERIES, SMOKE_RENDERS) } else { (PODS, SERIES, RENDERS) };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;

    // Pods: one list, indexed; then every container found from the cache.
    let body = pod_list(pods);
    let port = serve(body.clone())?;
    let source = Source::parse(&format!("http://127.0.0.1:{port}"), Some("gpu-node-1".into()), None)?;
    // Its watch runs on the runtime, while the runtime runs.
    let directory = runtime.block_on(async { Directory::new(source.clone()) })?;
    let ids = |n: usize| Workload { container_id: Some(container_id(n)), ..Workload::default() };
    let started = Instant::now();
    let first = runtime.block_on(directory.lookup(ids(0)));
    let list = started.elapsed();
    ensure!(first.pod.as_deref() == Some("prefill-7d9f8-00000"), "the first container's pod: {first:?}");
    // Memory: the RSS growth of COPIES more directories each holding the
    // whole list, divided by COPIES (one list's transient parse reuses the
    // memory the last one freed, so one alone would show nothing).
    const COPIES: usize = 8;
    let before = rss_bytes()?;
    let mut copies = Vec::with_capacity(COPIES);
    for _ in 0..COPIES {
        let copy = runtime.block_on(async { Directory::new(source.clone()) })?;
        ensure!(runtime.block_on(copy.lookup(ids(1))).pod.is_some(), "a copy found its pod");
        copies.push(copy);
    }
    let after = rss_bytes()?;
    let cached = after.saturating_sub(before) / COPIES as u64;
    let started = Instant::now();
    let mut found = 0;
    for n in 0..2 * pods {
        found += usize::from(runtime.block_on(directory.lookup(ids(n))).pod.is_some());
    }
    let lookups = started.elapsed();
    ensure!(found == 2 * pods, "{found} of {} containers found", 2 * pods);
    ensure!(directory.lists() == 1, "one list for every lookup, not {}", directory.lists());

    // A scrape with `series` per-workload series.
    let engine = Engine::new(EngineConfig { timeout_ns: 1_000_000_000, max_tracked: 16, tick_ns: 10_000_000 });
    let workloads: Vec<metrics::WorkloadStalled> = (0..series)
        .map(|n| {
            let w = Workload {
                namespace: Some(format!("team-{}", n % 20)),
                owner: Some("prefill".into()),
                pod: Some(format!("prefill-7d9f8-{n:05}")),
                container: Some("sglang".into()),
                ..Workload::default()
            };
            (w.labels(), "sglang".into(), StallClass::ALL[n % 3], 1)
        })
        .collect();
    let mut times = Vec::with_capacity(renders);
    let mut bytes = 0;
    for _ in 0..renders {
        let mut snapshot = Metrics::default().snapshot(&engine, None, None);
        snapshot.workload_stalled = workloads.clone();
        let started = Instant::now();
        let text = metrics::render(snapshot, Format::OpenMetrics);
        times.push(started.elapsed());
        bytes = text.len();
        ensure!(
            text.lines().filter(|l| l.starts_with("stallwatch_workload_requests_stalled{")).count() == series,
            "every per-workload series rendered"
        );
    }
    times.sort();
    let median = times[times.len() / 2];

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("workload identity ({pods} pods, {} containers, PodList {} KiB):", 2 * pods, body.len() / 1024);
    println!("  list + index over loopback HTTP: {:.1} ms", ms(list));
    println!(
        "  resident memory of the cached metadata: {:.2} MiB ({} bytes per pod; RSS growth of {COPIES} copies / {COPIES})",
        cached as f64 / (1 << 20) as f64,
        cached / pods as u64
    );
    println!("  cached lookup: {:.2} us each ({} lookups)", lookups.as_secs_f64() * 1e6 / (2 * pods) as f64, 2 * pods);
    println!(
        "/metrics render with {series} per-workload series: median {:.2} ms of {renders} ({} KiB)",
        ms(median),
        bytes / 1024
    );
    if !smoke {
        agent_rss(port)?;
    }
    Ok(())
}

/// A child killed (and reaped) when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The real agent's resident memory on a process in pod 7's container,
/// with Kubernetes off and with the API at `port` (the 1 000 pods).
fn agent_rss(port: u16) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("agent RSS: skipped (the real agent loads eBPF: run as root)");
        return Ok(());
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let built = |var: &str, default: &str| std::env::var_os(var).map_or_else(|| root.join(default), PathBuf::from);
    let (agent, demo) = (
        built("STALLWATCH_BIN", "target/release/stallwatch"),
        built("STALLWATCH_DEMO", "target/demo/release/demo-prefill"),
    );
    let (uid, id) = (format!("{:08x}-1d2f-4a3b-9c8d-7e6f5a4b3c2d", 7), container_id(14));
    let pod = PathBuf::from("/sys/fs/cgroup/pids/kubepods/burstable").join(format!("pod{uid}"));
    let container = pod.join(&id);
    std::fs::create_dir_all(&container).with_context(|| format!("creating the cgroup {}", container.display()))?;
    let mut figures = Vec::new();
    {
        let mut target = Killed(
            Command::new(&demo)
                .args(["--wait-for-go", "--rate", "100", "--duration", "10min"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .with_context(|| format!("starting {}", demo.display()))?,
        );
        let mut ready = String::new();
        BufReader::new(target.0.stdout.take().context("demo stdout")?).read_line(&mut ready)?;
        ensure!(ready.contains("ready"), "the demo's first line: {ready}");
        let pid = target.0.id();
        std::fs::write(container.join("cgroup.procs"), pid.to_string()).context("moving the demo into the pod")?;
        for (label, kubernetes) in
            [("--kubernetes off", "off".to_owned()), ("1 000 pods cached", format!("http://127.0.0.1:{port}"))]
        {
            let dir = tempfile::tempdir()?;
            let mut child = Killed(
                Command::new(&agent)
                    .args(["run", "--pid", &pid.to_string(), "--profile", "demo", "--ephemeral", "--output", "json"])
                    .args(["--kubernetes", &kubernetes, "--socket"])
                    .arg(dir.path().join("run/agent.sock"))
                    .env("K8S_NODE_NAME", "gpu-node-1")
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .with_context(|| format!("starting {}", agent.display()))?,
            );
            let log = Arc::new(Mutex::new(String::new()));
            let mut stderr = BufReader::new(child.0.stderr.take().context("agent stderr")?);
            let keep = Arc::clone(&log);
            std::thread::spawn(move || {
                let mut line = String::new();
                while stderr.read_line(&mut line).is_ok_and(|n| n > 0) {
                    keep.lock().expect("log").push_str(&line);
                    line.clear();
                }
            });
            // Named: the `workload` line (with the pod when listed).
            let deadline = Instant::now() + Duration::from_secs(30);
            let named = loop {
                let text = log.lock().expect("log").clone();
                // With the API, the line that names the pod (one with the
                // container id alone may come first).
                let pod = if kubernetes == "off" { "workload" } else { "prefill-7d9f8-00007" };
                if let Some(line) = text.lines().find(|l| l.contains("workload") && l.contains(pod)) {
                    break line.to_owned();
                }
                if Instant::now() > deadline || child.0.try_wait()?.is_some() {
                    bail!("{label}: the agent named no workload:\n{text}");
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            if kubernetes != "off" {
                ensure!(named.contains("prefill-7d9f8-00007"), "{label}: the pod was not named: {named}");
            }
            std::thread::sleep(Duration::from_secs(3));
            let status = std::fs::read_to_string(format!("/proc/{}/status", child.0.id()))?;
            let kib: u64 = status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
                .context("VmRSS")?;
            figures.push((label, kib));
        }
    }
    for dir in [&container, &pod] {
        for _ in 0..50 {
            if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    for (label, kib) in &figures {
        println!("agent RSS, {label}: {:.1} MiB", *kib as f64 / 1024.0);
    }
    Ok(())
}
