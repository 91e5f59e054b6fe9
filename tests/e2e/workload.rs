//! Which workload is stuck: the demo target moved into a cgroup laid out as
//! the kubelet lays out a pod's container (`kubepods/burstable/pod<UID>/<ID>`,
//! made here in the host's cgroup v1 `pids` hierarchy), and a local HTTP
//! server answering `GET /api/v1/pods` (a PodList) and its `watch=true`
//! (the events since a resource version, then each as it comes) as the API
//! server (behind `kubectl proxy`) does. A pod created after the agent
//! started is named from the watch before its first stall. In-cluster,
//! the same server checks the bearer token and is reached over real TLS
//! (`tls_front.py`, a certificate for 127.0.0.1 from a CA the openssl CLI
//! makes here), with a service account directory (`token`, `ca.crt`) the
//! test writes. The agent must
//! name the pod on its alerts, `inflight` rows, spans (their resource) and
//! metrics; without the API, the container id alone; on an API error (a
//! refusal, an untrusted certificate, no token), that and a warning that
//! names the fix, never a failure.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use serde_json::{Value, json};
use stallwatch_tests::{
    Agent, Demo, agent_bin, alerts, metric,
    otlp::{Collector, TlsFront, http_get},
    require_root, run_to_end,
};

const NAMESPACE: &str = "llm";
const POD: &str = "prefill-7d9f8-abcde";
const NODE: &str = "gpu-node-7";
/// The image the pod's container runs, as its status reports it.
const IMAGE: &str = "registry.example.com/serving/sglang:v0.5.23-cu129";

/// A container id and pod UID unique to this test run.
fn ids(salt: u32) -> (String, String) {
    let seed = u64::from(std::process::id()) << 16 | u64::from(salt);
    let id = format!("{:016x}", seed).repeat(4);
    let uid = format!("{:08x}-1d2f-4a3b-9c8d-{:012x}", salt, seed & 0xffff_ffff_ffff);
    (id, uid)
}

/// The cgroup `kubepods/burstable/pod<UID>/<ID>` in the `pids` hierarchy,
/// with `pid` moved in; removed (after the process is gone) on drop.
struct PodCgroup {
    dirs: Vec<PathBuf>,
}

impl PodCgroup {
    fn enter(pid: u32, uid: &str, id: &str) -> Self {
        let root = PathBuf::from("/sys/fs/cgroup/pids");
        assert!(
            root.join("cgroup.procs").exists(),
            "no cgroup v1 pids hierarchy at {}: this test lays out a pod's cgroup there",
            root.display()
        );
        let pod = root.join("kubepods/burstable").join(format!("pod{uid}"));
        let container = pod.join(id);
        std::fs::create_dir_all(&container).unwrap_or_else(|err| panic!("creating {}: {err}", container.display()));
        std::fs::write(container.join("cgroup.procs"), pid.to_string()).expect("moving the demo into the pod's cgroup");
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
        assert!(cgroup.contains(&format!("/kubepods/burstable/pod{uid}/{id}")), "{cgroup}");
        Self { dirs: vec![container, pod] }
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        for dir in &self.dirs {
            for _ in 0..50 {
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// The API server stand-in: `GET /api/v1/pods` answers the pods it has
/// (a PodList at its resource version); with `watch=true`, the events
/// after the `resourceVersion` asked for, then each new one as it comes,
/// on a connection held open, as the API server does. With a token to
/// check, 401 to a request without `Authorization: Bearer TOKEN`; when
/// refusing, that status to everything.
struct ApiServer {
    port: u16,
    state: Arc<(Mutex<ApiState>, Condvar)>,
}

#[derive(Default)]
struct ApiState {
    /// The request lines, in order.
    requests: Vec<String>,
    pods: Vec<Value>,
    /// Each event's resource version and line.
    events: Vec<(u64, String)>,
    version: u64,
}

impl ApiServer {
    /// With `pods` at resource version 1.
    fn start(pods: Vec<Value>, token: Option<&'static str>) -> Self {
        Self::serve(pods, token, None)
    }

    fn refusing(status: &'static str, body: String) -> Self {
        Self::serve(Vec::new(), None, Some((status, body)))
    }

    fn serve(pods: Vec<Value>, token: Option<&'static str>, refuse: Option<(&'static str, String)>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding the API server");
        let port = listener.local_addr().expect("addr").port();
        let state = Arc::new((Mutex::new(ApiState { pods, version: 1, ..ApiState::default() }), Condvar::new()));
        let shared = Arc::clone(&state);
        std::thread::spawn(move || {
            // Bounded: the agent lists and watches a few times a test.
            for stream in listener.incoming().take(50) {
                let Ok(stream) = stream else { continue };
                let (state, refuse) = (Arc::clone(&shared), refuse.clone());
                std::thread::spawn(move || Self::answer(stream, &state, token, refuse));
            }
        });
        Self { port, state }
    }

    /// One request: recorded, then answered (a watch until the agent goes).
    fn answer(
        mut stream: TcpStream,
        state: &(Mutex<ApiState>, Condvar),
        token: Option<&str>,
        refuse: Option<(&'static str, String)>,
    ) {
        let mut reader = BufReader::new(stream.try_clone().expect("clone"));
        let mut line = String::new();
        if reader.read_line(&mut line).is_err() {
            return;
        }
        // The rest of the head.
        let mut header = String::new();
        let mut bearer = None;
        while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("authorization") {
                    bearer = value.trim().strip_prefix("Bearer ").map(str::to_owned);
                }
            }
            header.clear();
        }
        let (lock, changed) = state;
        lock.lock().expect("lock").requests.push(line.trim().to_owned());
        changed.notify_all();
        let refused = match (refuse, token) {
            (Some(refusal), _) => Some(refusal),
            (None, Some(token)) if bearer.as_deref() != Some(token) => Some((
                "401 Unauthorized",
                json!({"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401}).to_string(),
            )),
            _ => None,
        };
        let path = line.split_whitespace().nth(1).unwrap_or_default();
        let since = path.split(['?', '&']).find_map(|pair| pair.strip_prefix("resourceVersion="));
        let body = match (refused, since) {
            (Some((status, body)), _) => (status, body),
            (None, Some(since)) => {
                let mut sent: u64 = since.parse().expect("a resourceVersion we gave");
                let _ =
                    write!(stream, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n");
                loop {
                    let mut api = lock.lock().expect("lock");
                    while api.version <= sent {
                        api = changed.wait(api).expect("lock");
                    }
                    let lines: String = api
                        .events
                        .iter()
                        .filter(|(version, _)| *version > sent)
                        .map(|(_, line)| line.as_str())
                        .collect();
                    sent = api.version;
                    drop(api);
                    if stream.write_all(lines.as_bytes()).and_then(|()| stream.flush()).is_err() {
                        return;
                    }
                }
            }
            (None, None) => {
                let api = lock.lock().expect("lock");
                let list = json!({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": api.version.to_string()}, "items": api.pods});
                ("200 OK", list.to_string())
            }
        };
        let (status, body) = body;
        let _ = write!(
            stream,
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    }

    /// A pod added or changed (`ADDED`, `MODIFIED`), to its watchers too.
    fn event(&self, kind: &str, mut pod: Value) {
        let (lock, changed) = &*self.state;
        let mut api = lock.lock().expect("lock");
        api.version += 1;
        pod["metadata"]["resourceVersion"] = json!(api.version.to_string());
        let uid = pod["metadata"]["uid"].clone();
        api.pods.retain(|p| p["metadata"]["uid"] != uid);
        api.pods.push(pod.clone());
        let version = api.version;
        api.events.push((version, format!("{}\n", json!({"type": kind, "object": pod}))));
        changed.notify_all();
    }

    /// Wait until the agent watches.
    fn wait_watch(&self) {
        let (lock, changed) = &*self.state;
        let api = lock.lock().expect("lock");
        let (api, waited) = changed
            .wait_timeout_while(api, Duration::from_secs(10), |api| {
                !api.requests.iter().any(|r| r.contains("watch=true"))
            })
            .expect("lock");
        assert!(!waited.timed_out(), "the agent did not watch the pods within 10 s: {:?}", api.requests);
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<String> {
        self.state.0.lock().expect("lock").requests.clone()
    }
}

/// The list, then the watch from its version, of this node's pods.
fn list_then_watch() -> [String; 2] {
    let pods = format!("GET /api/v1/pods?fieldSelector=spec.nodeName%3D{NODE}");
    [
        format!("{pods} HTTP/1.1"),
        format!("{pods}&watch=true&resourceVersion=1&allowWatchBookmarks=true&timeoutSeconds=290 HTTP/1.1"),
    ]
}

/// A pod of a Deployment `prefill`, service `sglang-prefill` by its
/// `app.kubernetes.io/name` label; its container `sglang`, once started,
/// being `id`.
fn pod(uid: &str, id: Option<&str>) -> Value {
    let statuses: Vec<Value> = id
        .map(|id| json!({"name": "sglang", "containerID": format!("containerd://{id}"), "ready": true, "image": IMAGE}))
        .into_iter()
        .collect();
    json!({
        "metadata": {
            "name": POD, "namespace": NAMESPACE, "uid": uid,
            "labels": {"app.kubernetes.io/name": "sglang-prefill", "app": "prefill", "pod-template-hash": "7d9f8"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "prefill-7d9f8", "uid": "x", "controller": true}]
        },
        "spec": {"nodeName": NODE, "containers": [{"name": "sglang", "image": "sglang"}]},
        "status": {"phase": if id.is_some() { "Running" } else { "Pending" }, "containerStatuses": statuses}
    })
}

fn stalled_demo() -> Demo {
    Demo::start(&["--rate", "100", "--duration", "5s", "--inject-after", "200ms", "--waiting-for-peer", "1"])
}

#[test]
fn alerts_spans_and_metrics_name_the_pod_from_the_api() {
    require_root();
    let (id, uid) = ids(1);
    let mut demo = stalled_demo();
    let pid = demo.proc.pid();
    let _cgroup = PodCgroup::enter(pid, &uid, &id);
    // The pod does not exist yet when the agent starts.
    let api = ApiServer::start(Vec::new(), None);
    let mut collector = Collector::start();
    let endpoint = collector.http_endpoint();
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("run/agent.sock");
    let socket = socket.to_str().expect("UTF-8 temp path");
    let agent = Agent::on_pid(pid)
        .timeout("1s")
        .args(&[
            "--kubernetes",
            &api.url(),
            "--metrics-addr",
            "127.0.0.1:0",
            "--otlp-endpoint",
            &endpoint,
            "--socket",
            socket,
        ])
        .env(&[("K8S_NODE_NAME", NODE), ("K8S_POD_NAME", "stallwatch-x2k4q"), ("K8S_NAMESPACE_NAME", "monitoring")])
        .watch();
    // Created after the agent started: scheduled (its container not
    // started, so no id yet), then started, as the kubelet reports them;
    // the agent names the process from the watch, not at a later list.
    api.wait_watch();
    let created = Instant::now();
    api.event("ADDED", pod(&uid, None));
    api.event("MODIFIED", pod(&uid, Some(&id)));
    agent.proc.wait_stderr(&format!("workload={NAMESPACE}/{POD}/sglang"), Duration::from_secs(10));
    eprintln!("a pod created after the agent started: named {:?} after it was", created.elapsed());
    demo.go();
    let mut seen = Vec::new();
    let stalled = agent.wait_alerts("stalled", 1, Duration::from_secs(10), &mut seen);
    let workload = &stalled[0].1["workload"];
    assert_eq!(workload["k8s.namespace.name"], NAMESPACE, "{}", stalled[0].1);
    assert_eq!(workload["k8s.pod.name"], POD);
    assert_eq!(workload["k8s.container.name"], "sglang");
    assert_eq!(workload["k8s.owner.name"], "prefill", "the Deployment, not its ReplicaSet");
    assert_eq!(workload["k8s.owner.kind"], "Deployment");
    assert_eq!(workload["k8s.node.name"], NODE);
    assert_eq!(workload["container.id"], Value::String(id.clone()));
    assert_eq!(workload["k8s.pod.uid"], Value::String(uid.clone()));

    // The metric names the workload, with bounded labels.
    let (_, body) = http_get(agent.metrics_port(), "/metrics", None);
    let series = format!(
        "stallwatch_workload_requests_stalled{{k8s_namespace_name=\"{NAMESPACE}\",k8s_owner_name=\"prefill\",k8s_pod_name=\"{POD}\",k8s_container_name=\"sglang\",class=\"waiting_for_peer\"}}"
    );
    assert_eq!(metric(&body, &series), 1, "{body}");

    // So does every `inflight` row, in JSON and in the table.
    let (ok, json, stderr) = run_to_end(Command::new(agent_bin()).args(["inflight", "--json", "--socket", socket]));
    assert!(ok, "{stderr}");
    let answer: Value = serde_json::from_str(&json).expect("inflight --json");
    let rows = answer["requests"].as_array().expect("rows");
    assert!(!rows.is_empty(), "{answer}");
    for row in rows {
        assert_eq!(row["workload"], stalled[0].1["workload"], "{row}");
    }
    assert_eq!(answer["processes"][0]["workload"]["k8s.pod.name"], POD, "{answer}");
    let (ok, table, stderr) = run_to_end(Command::new(agent_bin()).args(["inflight", "--socket", socket]));
    assert!(ok, "{stderr}");
    let shown = format!("{NAMESPACE}/{POD}/sglang");
    let header = table.lines().next().expect("header");
    assert!(header.split_whitespace().nth(2) == Some("WORKLOAD"), "{table}");
    assert!(
        table.lines().skip(1).take(rows.len()).all(|line| line.split_whitespace().nth(2) == Some(shown.as_str())),
        "{table}"
    );
    let (process, profile) =
        (rows[0]["process"].as_str().expect("process"), rows[0]["profile"].as_str().expect("profile"));
    assert!(table.contains(&format!("({process}, profile {profile}, {shown})")), "{table}");

    // So does the stall span, as its resource: the watched process's pod,
    // not the agent's own (K8S_POD_NAME).
    let spans = collector
        .wait_for(Duration::from_secs(5), "the stall span", |spans| spans.iter().any(|s| s.name == "stallwatch.stall"));
    let span = spans.iter().find(|s| s.name == "stallwatch.stall").expect("stall span");
    let resource = |key: &str| span.resource.get(key).map(String::as_str);
    assert_eq!(resource("k8s.pod.name"), Some(POD), "{span:#?}");
    assert_eq!(resource("k8s.namespace.name"), Some(NAMESPACE));
    assert_eq!(resource("k8s.container.name"), Some("sglang"));
    assert_eq!(resource("k8s.node.name"), Some(NODE));
    assert_eq!(resource("container.id"), Some(id.as_str()));
    assert_eq!(resource("process.pid"), Some(pid.to_string().as_str()));
    // The workload's own service (its `app.kubernetes.io/name`), the agent
    // as the SDK that saw it.
    assert_eq!(resource("service.name"), Some("sglang-prefill"), "{span:#?}");
    assert_eq!(resource("service.namespace"), Some(NAMESPACE));
    assert_eq!(resource("service.instance.id"), Some(format!("{NAMESPACE}.{POD}.sglang").as_str()));
    assert_eq!(resource("telemetry.sdk.name"), Some("stallwatch"));

    // One list and one watch, of this node's pods only.
    let requests = api.requests();
    assert_eq!(requests, list_then_watch(), "{requests:?}");
    drop(agent);
    let _ = collector.stop();
}

/// A node's agent with rules only (no profile, no selector), one of which
/// selects by the image the pod's container runs: the demo process, in
/// that container and running before the agent, is watched with that
/// rule's profile (the pods are listed before the start-up scan), not with
/// the rule of another image before it; its stall names the profile and
/// the image.
#[test]
fn a_rule_selects_a_process_by_its_containers_image_from_the_api() {
    require_root();
    let (id, uid) = ids(5);
    let mut demo = stalled_demo();
    let pid = demo.proc.pid();
    let _cgroup = PodCgroup::enter(pid, &uid, &id);
    let api = ApiServer::start(vec![pod(&uid, Some(&id))], None);
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("config.toml");
    let rules = "builtin_rules = false\n\n[[rule]]\nprofile = \"nixl\"\nimage = \"^registry\\\\.example\\\\.com/other/\"\n\n\
                 [[rule]]\nprofile = \"demo\"\nimage = \"^registry\\\\.example\\\\.com/serving/sglang:\"\n";
    std::fs::write(&config, rules).expect("config");
    let socket = dir.path().join("agent.sock");
    let mut command = Command::new(agent_bin());
    command
        .arg("run")
        .arg("--config")
        .arg(&config)
        .args(["--kubernetes", &api.url(), "--timeout", "1s", "--output", "json", "--ephemeral", "--socket"])
        .arg(&socket)
        .env("K8S_NODE_NAME", NODE);
    let agent = Agent { proc: stallwatch_tests::Proc::spawn("stallwatch", &mut command), bpf_dir: None };
    let watching = format!("watching pid={pid} ");
    agent.proc.wait_stderr(&watching, Duration::from_secs(30));
    let logged = agent.proc.stderr();
    let line = logged.lines().find(|line| line.contains(&watching)).expect("the watching line");
    assert!(line.contains("profile=demo"), "{line}\n{logged}");
    assert!(!logged.contains("matches several rules"), "{logged}");
    demo.go();
    let mut seen = Vec::new();
    let stalled = agent.wait_alerts("stalled", 1, Duration::from_secs(10), &mut seen);
    let alert = &stalled[0].1;
    assert_eq!((alert["pid"].as_u64(), alert["profile"].as_str()), (Some(u64::from(pid)), Some("demo")), "{alert}");
    assert_eq!(alert["workload"]["container.image.name"], IMAGE, "{alert}");
}

#[test]
fn without_the_api_the_container_id_and_on_its_error_a_warning() {
    require_root();
    // No Kubernetes: the cgroup's ids alone.
    let (id, uid) = ids(2);
    let mut demo = stalled_demo();
    let _cgroup = PodCgroup::enter(demo.proc.pid(), &uid, &id);
    let agent = Agent::watch(demo.proc.pid(), "demo", "1s", &[]);
    demo.go();
    let mut seen = Vec::new();
    let stalled = agent.wait_alerts("stalled", 1, Duration::from_secs(10), &mut seen);
    let workload = stalled[0].1["workload"].as_object().expect("a workload").clone();
    assert_eq!(
        workload.keys().map(String::as_str).collect::<Vec<_>>(),
        ["container.id", "k8s.pod.uid"],
        "{workload:?}"
    );
    assert_eq!(workload["container.id"], Value::String(id));
    drop(agent);

    // The API refuses (no RBAC): the ids all the same, and a warning that
    // says what to grant.
    let (id, uid) = ids(3);
    let mut demo = stalled_demo();
    let _cgroup = PodCgroup::enter(demo.proc.pid(), &uid, &id);
    let api = ApiServer::refusing("403 Forbidden", json!({"kind": "Status", "reason": "Forbidden"}).to_string());
    let agent = Agent::watch(demo.proc.pid(), "demo", "1s", &["--kubernetes", &api.url()]);
    demo.go();
    let mut seen = Vec::new();
    let stalled = agent.wait_alerts("stalled", 1, Duration::from_secs(10), &mut seen);
    assert_eq!(stalled[0].1["workload"]["container.id"], Value::String(id));
    assert!(stalled[0].1["workload"].get("k8s.pod.name").is_none());
    let stderr = agent.proc.stderr();
    assert!(stderr.contains("403 Forbidden") && stderr.contains("ClusterRole"), "{stderr}");

    // A process in no container: no workload, and no error. (If this test
    // itself runs in a container, the demo is in it too: then its id.)
    let own = std::fs::read_to_string("/proc/self/cgroup").expect("own cgroup");
    let in_container =
        own.split(['/', '\n', ':', '-', '.']).any(|w| w.len() == 64 && w.bytes().all(|b| b.is_ascii_hexdigit()));
    let mut demo = stalled_demo();
    let agent = Agent::watch(demo.proc.pid(), "demo", "1s", &["--kubernetes", &api.url()]);
    demo.go();
    let lines = agent.proc.lines_until_exit(Duration::from_secs(20));
    let stalls: Vec<Value> = alerts(&lines, "stalled").map(|(_, v)| v).collect();
    assert!(!stalls.is_empty(), "no stall reported");
    if !in_container {
        assert!(stalls.iter().all(|s| s.get("workload").is_none()), "{stalls:?}");
    }
}

/// The token the in-cluster API server accepts.
const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.stallwatch-test-token.c2lnbmF0dXJl";

/// A service account's directory as the kubelet mounts one (`token`,
/// `ca.crt`, `namespace`), `token` left out when `None`.
fn service_account(dir: &Path, token: Option<&str>, ca: &str) {
    std::fs::create_dir_all(dir).expect("the service account directory");
    if let Some(token) = token {
        std::fs::write(dir.join("token"), token).expect("token");
    }
    std::fs::copy(ca, dir.join("ca.crt")).expect("ca.crt");
    std::fs::write(dir.join("namespace"), "stallwatch").expect("namespace");
}

/// The agent in-cluster (`--kubernetes in-cluster`), the API server's
/// address in the variables Kubernetes sets in every container, and the
/// service account in `account` (through its variable).
fn in_cluster_agent(pid: u32, port: u16, account: &Path) -> Agent {
    let port = port.to_string();
    let account = account.to_str().expect("UTF-8 temp path");
    Agent::on_pid(pid)
        .timeout("1s")
        .args(&["--kubernetes", "in-cluster"])
        .env(&[
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", &port),
            ("STALLWATCH_KUBERNETES_SERVICE_ACCOUNT", account),
            ("K8S_NODE_NAME", NODE),
        ])
        .watch()
}

#[test]
fn in_cluster_the_api_is_asked_over_tls_with_the_service_account_token() {
    require_root();
    let (id, uid) = ids(4);
    let mut demo = stalled_demo();
    let pid = demo.proc.pid();
    let _cgroup = PodCgroup::enter(pid, &uid, &id);
    let api = ApiServer::start(vec![pod(&uid, Some(&id))], Some(TOKEN));
    let front = TlsFront::in_front_of(&[api.port]);
    let dir = tempfile::tempdir().expect("temp dir");
    let account = dir.path().join("serviceaccount");
    service_account(&account, Some(&format!("{TOKEN}\n")), &front.ca());
    let agent = in_cluster_agent(pid, front.ports[0], &account);
    demo.go();
    let mut seen = Vec::new();
    let stalled = agent.wait_alerts("stalled", 1, Duration::from_secs(10), &mut seen);
    let workload = &stalled[0].1["workload"];
    assert_eq!(workload["k8s.pod.name"], POD, "{}\n{}", stalled[0].1, agent.proc.stderr());
    assert_eq!(workload["k8s.namespace.name"], NAMESPACE);
    assert_eq!(workload["k8s.container.name"], "sglang");
    assert_eq!(workload["k8s.owner.name"], "prefill");
    assert_eq!(workload["container.id"], Value::String(id));
    // One list and one watch of this node's pods, over TLS, with the token
    // (the server answers 401 to anything else).
    api.wait_watch();
    let requests = api.requests();
    assert_eq!(requests, list_then_watch(), "{requests:?}");
    assert!(front.received().contains(&format!("authorization: Bearer {TOKEN}\r\n")), "{:?}", front.received());
    let stderr = agent.proc.stderr();
    assert!(!stderr.contains("workload identity:"), "{stderr}");
}

#[test]
fn in_cluster_an_untrusted_server_or_a_missing_or_refused_token_leaves_the_container_id() {
    require_root();
    let api = ApiServer::start(Vec::new(), Some(TOKEN));
    let front = TlsFront::in_front_of(&[api.port]);
    let dir = tempfile::tempdir().expect("temp dir");
    let (wrong_ca, ca) = (front.wrong_ca(), front.ca());
    let cases: [(&str, Option<&str>, &str, &[&str]); 3] = [
        // The server's certificate is not from the service account's CA.
        ("untrusted", Some(TOKEN), &wrong_ca, &["invalid peer certificate", "UnknownIssuer", "ca.crt"]),
        // No token mounted (automountServiceAccountToken: false).
        ("no token", None, &ca, &["token", "No such file", "automountServiceAccountToken"]),
        // A token the server does not accept.
        ("refused", Some("expired"), &ca, &["401 Unauthorized", "token", "read again"]),
    ];
    for (n, (case, token, ca, expected)) in cases.into_iter().enumerate() {
        let (id, uid) = ids(5 + n as u32);
        let mut demo = stalled_demo();
        let pid = demo.proc.pid();
        let _cgroup = PodCgroup::enter(pid, &uid, &id);
        let account = dir.path().join(format!("account-{n}"));
        service_account(&account, token, ca);
        let before = api.requests().len();
        let agent = in_cluster_agent(pid, front.ports[0], &account);
        demo.go();
        let mut seen = Vec::new();
        let stalled = agent.wait_alerts("stalled", 1, Duration::from_secs(10), &mut seen);
        // The watched process is still named by what its cgroup says.
        let workload = stalled[0].1["workload"].as_object().expect("a workload").clone();
        assert_eq!(workload.keys().map(String::as_str).collect::<Vec<_>>(), ["container.id", "k8s.pod.uid"], "{case}");
        assert_eq!(workload["container.id"], Value::String(id), "{case}");
        let stderr = agent.proc.stderr();
        let line =
            stderr.lines().find(|l| l.contains("workload identity:")).unwrap_or_else(|| panic!("{case}: {stderr}"));
        for text in expected {
            assert!(line.contains(text), "{case}: {text:?} not in {line}");
        }
        eprintln!("{case}: {line}");
        // Only the refused token reached the server (again with backoff).
        let asked = api.requests().len() - before;
        assert_eq!(asked > 0, case == "refused", "{case}: {:?}", api.requests());
        drop(agent);
    }
}
