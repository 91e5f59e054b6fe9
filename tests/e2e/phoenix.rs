//! The agent's spans in a real trace store: Arize Phoenix 20.26.1 from PyPI
//! (tests/phoenix/requirements.txt, its venv made by `xtask setup --python`),
//! run here with its own SQLite database in a temporary directory, receiving
//! OTLP over HTTP (`/v1/traces` on its web port) and over gRPC. The spans
//! are read back through Phoenix's own REST API
//! (`GET /v1/projects/default/spans`), not from the agent: every span the
//! agent made arrived, each stall span has status ERROR and its
//! `error.type`, and a stalled room's spans (its stall span and its request
//! span) share the trace its external id names. The demo target supplies
//! the stalls (one request waiting for its peer, one never released).
use std::{
    collections::{HashMap, HashSet},
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Demo, Proc,
    otlp::{expected_trace_id, free_port, http_get},
    phoenix_python, require_root, summary,
};

/// A Phoenix server on loopback.
struct Phoenix {
    proc: Proc,
    http_port: u16,
    grpc_port: u16,
    _dir: tempfile::TempDir,
}

impl Phoenix {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("a working directory for Phoenix");
        let (http_port, grpc_port) = (free_port(), free_port());
        let phoenix = phoenix_python().with_file_name("phoenix");
        let mut command = Command::new(&phoenix);
        command
            .arg("serve")
            .env("PHOENIX_HOST", "127.0.0.1")
            .env("PHOENIX_PORT", http_port.to_string())
            .env("PHOENIX_GRPC_PORT", grpc_port.to_string())
            .env("PHOENIX_WORKING_DIR", dir.path())
            // Nothing leaves the machine, and the log stays short.
            .env("PHOENIX_TELEMETRY_ENABLED", "false")
            .env("PHOENIX_LOGGING_LEVEL", "warning")
            .env("PHOENIX_DB_LOGGING_LEVEL", "warning");
        let mut proc = Proc::spawn("phoenix", &mut command);
        let started = Instant::now();
        // Its migrations and start take 10-40 s on a busy machine.
        let deadline = started + Duration::from_secs(180);
        loop {
            let up = std::net::TcpStream::connect(("127.0.0.1", http_port)).is_ok()
                && http_get(http_port, "/healthz", None).0.contains(" 200 ");
            if up {
                break;
            }
            assert!(
                Instant::now() < deadline && proc.child.try_wait().ok().flatten().is_none(),
                "Phoenix ({}) did not come up:\n{}",
                phoenix.display(),
                proc.stderr()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
        eprintln!("Phoenix up in {:?}", started.elapsed());
        Self { proc, http_port, grpc_port, _dir: dir }
    }

    /// Every span of the default project (where spans without an
    /// `openinference.project.name` go), through the REST API's pages.
    fn spans(&self) -> Vec<Value> {
        let mut out = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut path = "/v1/projects/default/spans?limit=1000".to_owned();
            if let Some(cursor) = &cursor {
                path.push_str(&format!("&cursor={cursor}"));
            }
            let (status, body) = http_get(self.http_port, &path, Some("application/json"));
            assert!(status.contains(" 200 "), "{path}: {status}\n{body}");
            let page: Value = serde_json::from_str(&body).unwrap_or_else(|err| panic!("{path}: {err}: {body}"));
            out.extend(page["data"].as_array().expect("data").iter().cloned());
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => return out,
            }
        }
    }
}

impl Drop for Phoenix {
    fn drop(&mut self) {
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
    }
}

/// A span attribute as Phoenix returns it: flat (`"process.pid"`) or
/// nested by its dots (`{"process": {"pid": ...}}`), as text.
fn attr(span: &Value, key: &str) -> Option<String> {
    let attributes = &span["attributes"];
    let value = attributes
        .get(key)
        .cloned()
        .or_else(|| key.split('.').try_fold(attributes, |node, part| node.get(part)).cloned())?;
    Some(match value {
        Value::String(text) => text,
        other => other.to_string(),
    })
}

fn trace_id(span: &Value) -> &str {
    span["context"]["trace_id"].as_str().expect("context.trace_id")
}

#[test]
fn phoenix_stores_every_span_over_http_and_grpc_stalls_as_errors_rooms_as_traces() {
    require_root();
    let phoenix = Phoenix::start();
    let runs = [
        ("http/protobuf", format!("http://127.0.0.1:{}", phoenix.http_port)),
        ("grpc", format!("http://127.0.0.1:{}", phoenix.grpc_port)),
    ];
    for (protocol, endpoint) in runs {
        let mut demo = Demo::start(&[
            "--rate",
            "100",
            "--duration",
            "3s",
            "--inject-after",
            "300ms",
            "--waiting-for-peer",
            "1",
            "--release-lost",
            "1",
        ]);
        let pid = demo.proc.pid();
        let agent = Agent::on_pid(pid)
            .timeout("1s")
            .env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint), ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)])
            .watch();
        demo.go();
        let mut demo_lines = Vec::new();
        let injected = demo.wait_injected(2, &mut demo_lines);
        let lines = agent.proc.lines_until_exit(Duration::from_secs(30));
        let summary = summary(&lines);
        assert_eq!(summary["export_drops"], 0, "{protocol}: {summary}\n{}", agent.proc.stderr());
        let seen = summary["seen"].as_u64().expect("seen") as usize;
        let stalled = summary["stalled"].as_u64().expect("stalled") as usize;
        assert_eq!(stalled, 2, "{protocol}: {summary}");

        // Phoenix writes what it receives in batches: wait for all of it.
        let ours = |spans: Vec<Value>| -> Vec<Value> {
            spans.into_iter().filter(|s| attr(s, "process.pid").as_deref() == Some(pid.to_string().as_str())).collect()
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let spans = loop {
            let spans = ours(phoenix.spans());
            if spans.len() >= seen + stalled || Instant::now() > deadline {
                break spans;
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        eprintln!("{protocol}: {} spans of pid {pid} in Phoenix ({seen} requests, {stalled} stalls)", spans.len());
        assert_eq!(spans.len(), seen + stalled, "{protocol}: every span the agent made, once");
        let ids: HashSet<&str> = spans.iter().filter_map(|s| s["context"]["span_id"].as_str()).collect();
        assert_eq!(ids.len(), spans.len(), "{protocol}: span ids are distinct");

        let named = |name: &'static str| spans.iter().filter(move |s| s["name"] == name);
        let stall_spans: Vec<&Value> = named("stallwatch.stall").collect();
        assert_eq!(stall_spans.len(), stalled, "{protocol}");
        let mut traces: HashMap<&str, Vec<&Value>> = HashMap::new();
        for span in &spans {
            traces.entry(trace_id(span)).or_default().push(span);
        }
        for stall in &stall_spans {
            let key = attr(stall, "stallwatch.request.key").expect("request key");
            let pinned =
                injected.get(&key).unwrap_or_else(|| panic!("{protocol}: a stall of a healthy request: {stall:#}"));
            assert_eq!(stall["status_code"], "ERROR", "{protocol}: {stall:#}");
            assert_eq!(attr(stall, "error.type").as_deref(), Some(pinned.stall.as_str()), "{protocol}: {stall:#}");
            assert_eq!(trace_id(stall), expected_trace_id(&pinned.room), "{protocol}: the room's trace: {stall:#}");
            // The room's trace holds its stall span and its request span.
            let trace = &traces[trace_id(stall)];
            let names: HashSet<&str> = trace.iter().filter_map(|s| s["name"].as_str()).collect();
            assert_eq!(names, HashSet::from(["stallwatch.stall", "stallwatch.request"]), "{protocol}: {trace:#?}");
            let request = trace.iter().find(|s| s["name"] == "stallwatch.request").expect("request span");
            assert_eq!(request["status_code"], "ERROR", "{protocol}: it ended stuck: {request:#}");
        }
        let healthy = named("stallwatch.request").filter(|s| s["status_code"] != "ERROR").count();
        assert_eq!(healthy, seen - stalled, "{protocol}: every other request span is not an error");
        let _ = demo.proc.wait(Duration::from_secs(5));
    }
}
