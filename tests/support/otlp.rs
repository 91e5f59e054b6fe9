//! A real OTLP collector for the tests: rotel (`rotel-agent`, a Rust
//! OpenTelemetry collector shipped in the `rotel` wheel of the test venv)
//! receiving OTLP/gRPC and OTLP/HTTP on loopback ports, with its debug
//! exporter printing every span it received on stdout, which is parsed
//! back into [`Span`](crate::otlp::Span)s here. Nothing here answers the agent in the
//! collector's place.
use std::{
    collections::HashMap,
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use sha2::{Digest as _, Sha256};

use crate::{Line, Proc, root};

/// `rotel-agent` inside the venv's `rotel` package (or `STALLWATCH_ROTEL`).
pub fn rotel_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("STALLWATCH_ROTEL") {
        return PathBuf::from(path);
    }
    let venv = crate::venv_dir();
    let found = std::fs::read_dir(venv.join("lib"))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|python| python.path().join("site-packages/rotel/rotel-agent"))
        .find(|path| path.exists());
    found.unwrap_or_else(|| {
        panic!(
            "no rotel/rotel-agent under {}/lib/python*/site-packages (STALLWATCH_VENV): create the venv with \
             `cargo run --release -p xtask -- setup --python` (tests/nixl/requirements.txt pins rotel)",
            venv.display()
        )
    })
}

/// A free loopback port (bound and released: fine for a test).
pub fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("binding a free port");
    listener.local_addr().expect("local addr").port()
}

/// The trace id stallwatch derives from an external id, computed here on
/// its own from the definition in docs/telemetry.md.
pub fn expected_trace_id(external_id: &str) -> String {
    let digest =
        Sha256::new().chain_update(b"stallwatch/v1/external\0").chain_update(external_id.as_bytes()).finalize();
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// One span as the collector printed it.
#[derive(Debug, Clone, Default)]
pub struct Span {
    /// When the test read the span's first line.
    pub seen_at: Option<Instant>,
    pub trace_id: String,
    pub span_id: String,
    pub name: String,
    pub status_code: String,
    pub status_message: String,
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
    pub attributes: HashMap<String, String>,
    /// (name, unix nanos, attributes)
    pub events: Vec<(String, u64, HashMap<String, String>)>,
    /// (trace id, span id)
    pub links: Vec<(String, String)>,
    pub resource: HashMap<String, String>,
}

impl Span {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    pub fn event_names(&self) -> Vec<&str> {
        self.events.iter().map(|(name, _, _)| name.as_str()).collect()
    }

    pub fn is_error(&self) -> bool {
        self.status_code == "STATUS_CODE_ERROR"
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Section {
    None,
    Resource,
    Attributes,
    Events,
    EventAttributes,
    Links,
}

/// Turns the debug exporter's text (the OpenTelemetry Collector's
/// `detailed` layout) back into spans.
#[derive(Default)]
struct Parser {
    resource: HashMap<String, String>,
    current: Option<Span>,
    section: Option<Section>,
    done: Vec<Span>,
}

impl Parser {
    fn line(&mut self, line: &Line) {
        let text = line.text.trim_end();
        let trimmed = text.trim_start();
        if text.starts_with("ResourceSpans #") {
            self.finish();
            self.resource.clear();
            self.section = Some(Section::None);
        } else if text == "Resource attributes:" {
            self.section = Some(Section::Resource);
        } else if text.starts_with("ScopeSpans #") {
            self.finish();
            self.section = Some(Section::None);
        } else if text.starts_with("Span #") {
            self.finish();
            self.current = Some(Span { seen_at: Some(line.at), resource: self.resource.clone(), ..Span::default() });
            self.section = Some(Section::None);
        } else if text == "Attributes:" {
            self.section = Some(Section::Attributes);
        } else if text == "Events:" {
            self.section = Some(Section::Events);
        } else if text == "Links:" {
            self.section = Some(Section::Links);
        } else if let Some(span) = self.current.as_mut() {
            let field = |prefix: &str| {
                trimmed.strip_prefix(prefix).map(|rest| rest.trim_start_matches([' ', ':']).trim().to_owned())
            };
            match self.section {
                Some(Section::None) => {
                    if let Some(v) = field("Trace ID") {
                        span.trace_id = v;
                    } else if let Some(v) = field("Parent ID") {
                        let _ = v;
                    } else if let Some(v) = field("ID") {
                        span.span_id = v;
                    } else if let Some(v) = field("Name") {
                        span.name = v;
                    } else if let Some(v) = field("Status code") {
                        span.status_code = v;
                    } else if let Some(v) = field("Status message") {
                        span.status_message = v;
                    } else if let Some(v) = field("Start time") {
                        span.start_unix_nano = v.parse().unwrap_or_default();
                    } else if let Some(v) = field("End time") {
                        span.end_unix_nano = v.parse().unwrap_or_default();
                    }
                }
                Some(Section::Attributes) => {
                    if let Some((k, v)) = key_value(trimmed) {
                        span.attributes.insert(k, v);
                    }
                }
                Some(Section::Events | Section::EventAttributes) => {
                    if trimmed.starts_with("SpanEvent #") {
                        span.events.push((String::new(), 0, HashMap::new()));
                        self.section = Some(Section::Events);
                    } else if trimmed == "-> Attributes::" {
                        self.section = Some(Section::EventAttributes);
                    } else if let Some(event) = span.events.last_mut() {
                        if let (Some(Section::EventAttributes), Some((k, v))) = (self.section, key_value(trimmed)) {
                            event.2.insert(k, v);
                        } else if let Some(name) = trimmed.strip_prefix("-> Name: ") {
                            event.0 = name.to_owned();
                        } else if let Some(ts) = trimmed.strip_prefix("-> Timestamp: ") {
                            event.1 = ts.parse().unwrap_or_default();
                        }
                    }
                }
                Some(Section::Links) => {
                    if trimmed.starts_with("SpanLink #") {
                        span.links.push((String::new(), String::new()));
                    } else if let Some(link) = span.links.last_mut() {
                        if let Some(id) = trimmed.strip_prefix("-> Trace ID: ") {
                            link.0 = id.to_owned();
                        } else if let Some(id) = trimmed.strip_prefix("-> ID: ") {
                            link.1 = id.to_owned();
                        }
                    }
                }
                Some(Section::Resource) | None => {}
            }
        } else if self.section == Some(Section::Resource) {
            if let Some((k, v)) = key_value(trimmed) {
                self.resource.insert(k, v);
            }
        }
    }

    fn finish(&mut self) {
        if let Some(span) = self.current.take() {
            self.done.push(span);
        }
    }
}

/// `-> key: Str(value)` -> (key, value); `Int(7)` -> "7".
fn key_value(text: &str) -> Option<(String, String)> {
    let rest = text.strip_prefix("-> ")?;
    let (key, value) = rest.split_once(": ")?;
    let value = match value.split_once('(') {
        Some((_, inner)) if value.ends_with(')') => &inner[..inner.len() - 1],
        _ => value,
    };
    Some((key.to_owned(), value.to_owned()))
}

/// A running rotel collector.
pub struct Collector {
    proc: Proc,
    pub grpc_port: u16,
    pub http_port: u16,
    parser: Parser,
    dir: tempfile::TempDir,
}

impl Collector {
    /// Start rotel on two free loopback ports.
    pub fn start() -> Self {
        Self::start_on(free_port(), free_port())
    }

    /// Start rotel on the given loopback ports (a restart reuses them).
    pub fn start_on(grpc_port: u16, http_port: u16) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir for rotel");
        let proc = Proc::spawn(
            "rotel",
            Command::new(rotel_bin())
                .arg("start")
                .args(["--exporter", "blackhole"])
                .args(["--debug-log", "traces", "--debug-log-verbosity", "detailed"])
                .args(["--otlp-grpc-endpoint", &format!("127.0.0.1:{grpc_port}")])
                .args(["--otlp-http-endpoint", &format!("127.0.0.1:{http_port}")])
                .args(["--traces-batch-timeout", "50ms"])
                .arg("--pid-file")
                .arg(dir.path().join("rotel.pid"))
                .arg("--log-file")
                .arg(dir.path().join("rotel.log"))
                .env("NO_COLOR", "1"),
        );
        let collector = Self { proc, grpc_port, http_port, parser: Parser::default(), dir };
        collector.wait_listening(Duration::from_secs(10));
        collector
    }

    fn wait_listening(&self, within: Duration) {
        let deadline = Instant::now() + within;
        for port in [self.grpc_port, self.http_port] {
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
                assert!(
                    Instant::now() < deadline,
                    "rotel is not listening on {addr} after {within:?}; stderr:\n{}",
                    self.proc.stderr()
                );
                thread::sleep(Duration::from_millis(20));
            }
        }
    }

    pub fn grpc_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.grpc_port)
    }

    pub fn http_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    /// Every span received so far. A span printed last is complete once
    /// its batch's output has paused (the debug exporter prints a batch at
    /// once), so this waits a moment for output to settle.
    pub fn spans(&mut self) -> &[Span] {
        loop {
            let lines = self.proc.lines_now();
            if lines.is_empty() {
                thread::sleep(Duration::from_millis(60));
                let more = self.proc.lines_now();
                if more.is_empty() {
                    self.parser.finish();
                    return &self.parser.done;
                }
                for line in &more {
                    self.parser.line(line);
                }
                continue;
            }
            for line in &lines {
                self.parser.line(line);
            }
        }
    }

    /// Wait until `done` holds for the spans received, returning them.
    pub fn wait_for(&mut self, within: Duration, what: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + within;
        loop {
            let spans = self.spans();
            if done(spans) {
                return spans.to_vec();
            }
            if Instant::now() > deadline {
                let names: Vec<String> = spans
                    .iter()
                    .map(|s| format!("{} {} {:?}", s.name, s.status_code, s.attributes.get("stallwatch.request.key")))
                    .collect();
                panic!(
                    "collector: {what} not seen within {within:?}; {} spans so far: {names:#?}\nrotel stderr:\n{}",
                    spans.len(),
                    self.proc.stderr()
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stop the collector (SIGTERM: it prints what it accepted, then its
    /// ports close and the agent finds nobody there) and return every span
    /// it received.
    pub fn stop(mut self) -> Vec<Span> {
        self.proc.signal(libc::SIGTERM);
        let status = self.proc.wait(Duration::from_secs(10));
        assert!(
            status.success() || status.code().is_none(),
            "rotel exited with {status}; stderr:\n{}",
            self.proc.stderr()
        );
        let spans = self.spans().to_vec();
        drop(self.dir);
        spans
    }
}

/// A plain HTTP GET on loopback: (status line, body).
pub fn http_get(port: u16, path: &str, accept: Option<&str>) -> (String, String) {
    use std::io::{Read as _, Write as _};
    let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port))
        .unwrap_or_else(|err| panic!("connecting to 127.0.0.1:{port}: {err}"));
    stream.set_read_timeout(Some(Duration::from_secs(5))).expect("read timeout");
    let accept = accept.map(|a| format!("Accept: {a}\r\n")).unwrap_or_default();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{accept}Connection: close\r\n\r\n")
        .expect("writing the request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("reading the response");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (head.lines().next().unwrap_or_default().to_owned(), body.to_owned())
}

/// A TLS endpoint in front of a [`Collector`] or any plain TCP server
/// (`tls_front.py`, Python's ssl), with a CA and a server certificate for
/// 127.0.0.1 made here by the openssl CLI, and a second CA that signed
/// nothing of it.
pub struct TlsFront {
    proc: Proc,
    pub grpc_port: u16,
    pub http_port: u16,
    /// The TLS port in front of each upstream port, in their order.
    pub ports: Vec<u16>,
    dir: tempfile::TempDir,
}

impl TlsFront {
    /// In front of the collector's gRPC and HTTP ports.
    pub fn start(collector: &Collector) -> Self {
        Self::in_front_of(&[collector.grpc_port, collector.http_port])
    }

    /// In front of these plain TCP ports on 127.0.0.1.
    pub fn in_front_of(upstreams: &[u16]) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir for the certificates");
        let path = |name: &str| dir.path().join(name);
        let openssl = |args: &[&str]| {
            let (ok, _, stderr) = crate::run_to_end(Command::new("openssl").current_dir(dir.path()).args(args));
            assert!(ok, "openssl {args:?}: {stderr}");
        };
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        for ca in ["ca", "wrong-ca"] {
            let (key, crt) = (format!("{ca}.key"), format!("{ca}.crt"));
            let subject = format!("/CN=stallwatch test {ca}");
            openssl(
                &[&["req", "-x509"][..], &ec, &["-keyout", &key, "-out", &crt, "-days", "1", "-subj", &subject]]
                    .concat(),
            );
        }
        std::fs::write(path("san.ext"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n").expect("writing san.ext");
        openssl(
            &[&["req"][..], &ec, &["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]].concat(),
        );
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "san.ext",
            "-out",
            "server.crt",
        ]);
        let ports: Vec<u16> = upstreams.iter().map(|_| free_port()).collect();
        let mut command = Command::new(crate::venv_python());
        command
            .arg(root().join("tests/support/tls_front.py"))
            .args([path("server.crt"), path("server.key"), path("received.log")])
            .args(ports.iter().zip(upstreams).map(|(port, upstream)| format!("{port}:{upstream}")));
        let proc = Proc::spawn("tls_front", &mut command);
        let ready = proc.next_line(Duration::from_secs(10), "tls_front.py's `ready`");
        assert_eq!(ready.text, "ready", "stderr:\n{}", proc.stderr());
        let port = |i: usize| ports.get(i).copied().unwrap_or_default();
        Self { proc, grpc_port: port(0), http_port: port(1), ports, dir }
    }

    pub fn grpc_endpoint(&self) -> String {
        format!("https://127.0.0.1:{}", self.grpc_port)
    }

    pub fn http_endpoint(&self) -> String {
        format!("https://127.0.0.1:{}", self.http_port)
    }

    /// The CA that signed the endpoint's certificate.
    pub fn ca(&self) -> String {
        self.dir.path().join("ca.crt").to_string_lossy().into_owned()
    }

    /// A CA that did not.
    pub fn wrong_ca(&self) -> String {
        self.dir.path().join("wrong-ca.crt").to_string_lossy().into_owned()
    }

    /// What clients sent after the handshakes (HTTP/1.1 heads in clear).
    pub fn received(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(self.dir.path().join("received.log")).unwrap_or_default()).into_owned()
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
    }
}

/// The collector got the stall spans of SGLang room `room` from both sides
/// (within 5 s): every one in the room's trace, the prefill's
/// `transfer_hung` and the decode's `waiting_for_kv` among them. Stops the
/// collector.
pub fn assert_both_sides_stalled_in_the_rooms_trace(mut collector: Collector, room: u64) {
    let key = format!("{room:#x}");
    let of_room = |s: &Span| s.name == "stallwatch.stall" && s.attr("stallwatch.request.key") == Some(&key);
    let spans = collector.wait_for(Duration::from_secs(5), "both sides' stall spans", |spans| {
        spans.iter().filter(|s| of_room(s)).count() >= 2
    });
    let trace = expected_trace_id(&room.to_string());
    let stall_spans: Vec<_> = spans.iter().filter(|s| of_room(s)).collect();
    for span in &stall_spans {
        assert_eq!(span.trace_id, trace, "{span:?}");
    }
    let classes: Vec<_> = stall_spans.iter().filter_map(|s| s.attr("stallwatch.stall.class")).collect();
    assert!(classes.contains(&"transfer_hung") && classes.contains(&"waiting_for_kv"), "{stall_spans:#?}");
    let _ = collector.stop();
}
