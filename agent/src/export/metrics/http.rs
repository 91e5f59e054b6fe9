//! The HTTP side of `/metrics`, `/healthz` and `/readyz`: hyper's
//! HTTP/1.1 server, on a thread and runtime of its own.
//!
//! A scrape is forwarded to the event loop, which owns what it reads (the
//! engine, the kernel maps) and answers with the exposition text
//! ([`Scrape`]); everything else, the HTTP itself and the gzip a scraper
//! asks for (`Accept-Encoding: gzip`, as Prometheus sends it), is done
//! here, so a slow or hostile client costs the event path nothing but
//! that one render. Connections are kept alive between requests, so a
//! scraper reuses one connection from scrape to scrape.
//!
//! `/healthz` answers through the event loop once it runs (a wedged loop
//! fails it, which is what a liveness probe should see); `/readyz` answers
//! from a flag the loop sets once the probes are attached and a previous
//! agent's pinned state is taken over, so a rolling update waits for the
//! hand-over. Until then both answer `503` at once: the HTTP side runs on
//! a thread of its own, because attaching is synchronous work on the
//! agent's single-threaded runtime and would hold every request for its
//! length (seconds on a process with many libraries).
//!
//! The endpoint may listen on every interface, so what a client can hold
//! is bounded: a request head is at most [`MAX_REQUEST`] bytes, a
//! connection waits at most [`IDLE_TIMEOUT`] for its next one, and at most
//! [`MAX_CONNECTIONS`] are open, of which the oldest that is not being
//! answered is closed to make room for a new client ([`Connections`]):
//! idle, half-sent or unread connections never keep a scrape out, however
//! many there are.
use std::{
    convert::Infallible,
    io::Write as _,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    pin::pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result};
use flate2::{Compression, write::GzEncoder};
use http_body_util::Full;
use hyper::{
    HeaderMap, Method, Request, Response, StatusCode,
    body::{Bytes, Incoming},
    header::{self, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::{TcpListener, TcpSocket, TcpStream},
    sync::{mpsc, oneshot},
};
use tracing::{debug, warn};

use crate::util::connections::{Admitted, Connections};

/// The two text formats a scraper can ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text.
    OpenMetrics,
    /// Prometheus text 0.0.4.
    Prometheus,
}

impl Format {
    /// OpenMetrics when the scraper's `Accept` names it (Prometheus does),
    /// the classic format otherwise.
    fn from_accept(accept: &str) -> Self {
        if accept.contains("application/openmetrics-text") { Format::OpenMetrics } else { Format::Prometheus }
    }

    fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// `--metrics-addr`: `PORT` (on 127.0.0.1), `:PORT` (every IPv4
/// interface, as Prometheus's own exporters read `--web.listen-address
/// :9100`) or `ADDRESS:PORT` (`[::]:PORT` for IPv6 too).
pub fn parse_addr(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::new(localhost, port));
    }
    if let Some(port) = text.strip_prefix(':').and_then(|port| port.parse::<u16>().ok()) {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port));
    }
    if let Some(port) = text.strip_prefix("localhost:").and_then(|port| port.parse::<u16>().ok()) {
        return Ok(SocketAddr::new(localhost, port));
    }
    text.parse::<SocketAddr>().map_err(|_| {
        format!(
            "{text:?} is not PORT, :PORT or ADDRESS:PORT (e.g. `9464` for 127.0.0.1:9464, `:9464` for every interface)"
        )
    })
}

/// What a client asked the event loop for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// `/metrics`, in this format.
    Metrics(Format),
    /// `/healthz`: is the loop turning? Any answer says yes.
    Health,
}

/// A request waiting for the event loop's answer.
pub struct Scrape {
    pub ask: Ask,
    reply: oneshot::Sender<String>,
}

impl Scrape {
    pub fn answer(self, body: String) {
        // The client may have gone away; nothing to do then.
        let _ = self.reply.send(body);
    }
}

/// How long `/healthz` waits for the event loop: far above a turn of the
/// loop (milliseconds), below a liveness probe's usual timeout.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections open at once, each a task and its buffers. Past it the
/// oldest one not being answered is closed to make room ([`Connections`]).
const MAX_CONNECTIONS: usize = 512;
/// Connections the kernel holds for the accept loop (capped by
/// `net.core.somaxconn`, 4096 by default).
const BACKLOG: u32 = 1024;
/// How long a connection may wait for (or take to send) its next request
/// head. hyper times the two together (its header read timeout starts as
/// soon as a kept-alive connection waits for a request), so this is above
/// the usual scrape intervals (Prometheus's default is a minute) for a
/// scraper to keep its connection from scrape to scrape; slow clients are
/// bounded by the eviction meanwhile, not by this.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// The largest request head read (hyper's smallest buffer): a scraper's
/// is a few hundred bytes; a larger one is answered `431`.
const MAX_REQUEST: usize = 8 * 1024;
/// How long a connection closed to make room may take to finish the
/// answer it is writing, if any; an idle one closes at once.
const CLOSING_TIMEOUT: Duration = Duration::from_secs(2);

/// The listening socket and the queue of scrapes it forwards.
pub struct MetricsServer {
    addr: SocketAddr,
    scrapes: mpsc::Receiver<Scrape>,
    ready: Arc<AtomicBool>,
}

impl MetricsServer {
    /// Listen on `addr` and serve from a thread of its own (a runtime of
    /// its own: see the module's doc), which ends when this is dropped.
    pub async fn bind(addr: SocketAddr) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the metrics endpoint's runtime")?;
        // Registered with that runtime's reactor, which serves it.
        let listener = {
            let _serving = runtime.enter();
            listen(addr)
        }
        .with_context(|| {
            format!("binding the metrics endpoint to {addr} (--metrics-addr): is the port in use, or the address not on this host?")
        })?;
        let addr = listener.local_addr().context("reading the metrics endpoint's address")?;
        let (tx, scrapes) = mpsc::channel(MAX_CONNECTIONS);
        let ready = Arc::new(AtomicBool::new(false));
        let serving = Arc::clone(&ready);
        std::thread::Builder::new()
            .name("metrics-http".to_owned())
            .spawn(move || runtime.block_on(accept(listener, tx, serving)))
            .context("starting the metrics endpoint's thread")?;
        Ok(Self { addr, scrapes, ready })
    }

    /// `/readyz` answers 200 from now on: the probes are attached and a
    /// previous agent's state is taken over.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next scrape to answer.
    pub async fn next(&mut self) -> Option<Scrape> {
        self.scrapes.recv().await
    }
}

/// Listen on `addr` with room for [`BACKLOG`] connections not accepted
/// yet: the default (128) overflows when a burst of clients connects
/// faster than the loop accepts, and a dropped connection's client
/// retries only a second later.
fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }?;
    // As `TcpListener::bind` does: a restarted agent binds its port again
    // at once, whatever connections of the last one linger.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Accept connections until the [`MetricsServer`] is dropped.
async fn accept(listener: TcpListener, scrapes: mpsc::Sender<Scrape>, ready: Arc<AtomicBool>) {
    let connections = Connections::new(MAX_CONNECTIONS);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = scrapes.closed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                debug!("metrics endpoint: accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(admitted) = connections.admit() else {
            debug!(%peer, "metrics endpoint: {MAX_CONNECTIONS} requests are being answered, closing a new connection");
            continue;
        };
        let scrapes = scrapes.clone();
        let ready = Arc::clone(&ready);
        tokio::spawn(async move {
            if let Err(err) = serve(stream, admitted, scrapes, ready).await {
                debug!(%peer, "metrics endpoint: {err:#}");
            }
        });
    }
}

/// One connection, its requests answered in turn until the client closes
/// it, it stays idle past [`IDLE_TIMEOUT`], or it is closed to make room
/// for a newer one while no request of it is being answered.
async fn serve(
    stream: TcpStream,
    mut place: Admitted,
    scrapes: mpsc::Sender<Scrape>,
    ready: Arc<AtomicBool>,
) -> Result<()> {
    let activity = place.activity();
    let service = service_fn(move |request| {
        let (activity, scrapes, ready) = (activity.clone(), scrapes.clone(), Arc::clone(&ready));
        async move {
            // Answering: never closed to make room until it is answered.
            activity.busy();
            let response = answer(&request, &scrapes, &ready).await;
            activity.idle();
            Ok::<_, Infallible>(response)
        }
    });
    let mut connection = pin!(
        http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(IDLE_TIMEOUT)
            .max_buf_size(MAX_REQUEST)
            .serve_connection(TokioIo::new(stream), service)
    );
    tokio::select! {
        served = connection.as_mut() => return served.context("serving the connection"),
        () = place.evicted() => {}
    }
    debug!("metrics endpoint: closing a connection not being answered, to make room for a newer one");
    // Closes an idle connection at once; one still writing its answer
    // finishes it first.
    connection.as_mut().graceful_shutdown();
    match tokio::time::timeout(CLOSING_TIMEOUT, connection).await {
        Ok(served) => served.context("closing the connection"),
        Err(_) => anyhow::bail!("the client did not read its answer in time"),
    }
}

/// The answer to a whole body of text, of this status.
fn text(status: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    typed(status, "text/plain", body.into())
}

fn typed(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// `/healthz` and `/readyz` before the loop runs.
const NOT_READY: &str = "not ready: attaching the probes and taking over the previous agent's pinned state\n";

/// The answer to a request (`HEAD` is answered as `GET`, and hyper sends
/// only the head: its `Content-Length` too).
async fn answer(
    request: &Request<Incoming>,
    scrapes: &mpsc::Sender<Scrape>,
    ready: &AtomicBool,
) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "only GET (or HEAD)\n");
        response.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    let shutting_down = || text(StatusCode::SERVICE_UNAVAILABLE, "the agent is shutting down\n");
    match request.uri().path() {
        "/metrics" => {
            let accept = request.headers().get(header::ACCEPT).and_then(|value| value.to_str().ok());
            let format = Format::from_accept(accept.unwrap_or_default());
            let (reply, answer) = oneshot::channel();
            if scrapes.send(Scrape { ask: Ask::Metrics(format), reply }).await.is_err() {
                return shutting_down();
            }
            let Ok(body) = answer.await else { return shutting_down() };
            // Compressing into memory fails only short of memory; then
            // the text goes as it is.
            let compressed = accepts_gzip(request.headers())
                .then(|| gzip(body.as_bytes()))
                .and_then(|gzipped| gzipped.map_err(|err| warn!("metrics endpoint: gzip failed: {err}")).ok());
            let mut response = match compressed {
                Some(gzipped) => {
                    let mut response = typed(StatusCode::OK, format.content_type(), gzipped);
                    response.headers_mut().insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
                    response
                }
                None => typed(StatusCode::OK, format.content_type(), body),
            };
            response.headers_mut().insert(header::VARY, HeaderValue::from_static("accept-encoding"));
            response
        }
        // Not asked of the loop before it runs: it is attaching.
        "/healthz" if !ready.load(Ordering::Acquire) => text(StatusCode::SERVICE_UNAVAILABLE, NOT_READY),
        "/healthz" => {
            let (reply, answer) = oneshot::channel();
            let asked = async {
                scrapes.send(Scrape { ask: Ask::Health, reply }).await.ok()?;
                answer.await.ok()
            };
            match tokio::time::timeout(HEALTH_TIMEOUT, asked).await {
                Ok(Some(body)) => text(StatusCode::OK, body),
                Ok(None) => shutting_down(),
                Err(_) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the event loop did not answer within {}s\n", HEALTH_TIMEOUT.as_secs()),
                ),
            }
        }
        "/readyz" if ready.load(Ordering::Acquire) => text(StatusCode::OK, "ready\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, NOT_READY),
        "/" => text(StatusCode::OK, "stallwatch: /metrics, /healthz, /readyz\n"),
        _ => text(StatusCode::NOT_FOUND, "not found: try /metrics, /healthz or /readyz\n"),
    }
}

/// Whether the client takes a gzip body: `gzip` (or its old name
/// `x-gzip`) among its `Accept-Encoding` codings, with no `q=0`.
fn accepts_gzip(headers: &HeaderMap) -> bool {
    let codings = headers.get_all(header::ACCEPT_ENCODING).into_iter().filter_map(|value| value.to_str().ok());
    codings.flat_map(|value| value.split(',')).any(|coding| {
        let mut parts = coding.split(';').map(str::trim);
        let name = parts.next().unwrap_or_default();
        let weight = parts.find_map(|param| param.strip_prefix("q=")).map_or(Some(1.0), |q| q.parse::<f32>().ok());
        (name.eq_ignore_ascii_case("gzip") || name.eq_ignore_ascii_case("x-gzip")) && weight.is_some_and(|q| q > 0.0)
    })
}

/// `body` gzipped, at the fastest level: exposition text shrinks about
/// tenfold at any, and this thread's CPU is the agent's.
fn gzip(body: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut encoder = GzEncoder::new(Vec::with_capacity(body.len() / 4), Compression::fast());
    encoder.write_all(body)?;
    encoder.finish()
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    #[test]
    fn a_port_alone_is_loopback_and_colon_port_every_interface() {
        assert_eq!(parse_addr("9464"), Ok("127.0.0.1:9464".parse().expect("addr")));
        assert_eq!(parse_addr(":9464"), Ok("0.0.0.0:9464".parse().expect("addr")));
        assert_eq!(parse_addr("localhost:1"), Ok("127.0.0.1:1".parse().expect("addr")));
        assert_eq!(parse_addr("0.0.0.0:9464"), Ok("0.0.0.0:9464".parse().expect("addr")));
        assert_eq!(parse_addr("[::]:9464"), Ok("[::]:9464".parse().expect("addr")));
        assert!(parse_addr("metrics").expect_err("bad").contains("PORT or ADDRESS:PORT"));
    }

    /// One request on a connection of its own, read to the server's close.
    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut response = String::new();
        stream.read_to_string(&mut response).await.expect("read");
        response
    }

    /// One response of a kept-alive connection: its head and its body, as
    /// long as its `Content-Length` says (none after a `HEAD`).
    async fn read_response(stream: &mut TcpStream, head_only: bool) -> (String, Vec<u8>) {
        let mut raw = Vec::new();
        let end = loop {
            if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            let mut byte = [0; 1];
            assert_eq!(stream.read(&mut byte).await.expect("read"), 1, "closed mid-head: {raw:?}");
            raw.push(byte[0]);
        };
        let head = String::from_utf8(raw[..end].to_vec()).expect("a text head");
        let length = head
            .lines()
            .find_map(|line| line.to_ascii_lowercase().strip_prefix("content-length:").map(|n| n.trim().to_owned()))
            .and_then(|n| n.parse::<usize>().ok())
            .expect("a content length");
        let mut body = vec![0; if head_only { 0 } else { length }];
        stream.read_exact(&mut body).await.expect("the body");
        (head, body)
    }

    /// Attaching is synchronous work on the agent's runtime: the endpoint
    /// answers meanwhile. Here the test's runtime, single-threaded as the
    /// agent's, is blocked in a plain socket read, and the answer comes.
    #[tokio::test]
    async fn health_answers_at_once_while_the_agents_runtime_is_blocked() {
        let server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let mut stream = std::net::TcpStream::connect(server.local_addr()).expect("connect");
        // A guard against a hang, not a measure: the answer is immediate.
        stream.set_read_timeout(Some(Duration::from_secs(30))).expect("read timeout");
        std::io::Write::write_all(&mut stream, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .expect("write");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("an answer while the runtime is blocked");
        assert!(response.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{response}");
    }

    #[tokio::test]
    async fn ready_only_once_told_and_live_while_the_loop_answers() {
        let mut server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let addr = server.local_addr();
        // Before the loop runs (it is attaching): both at once, 503.
        for path in ["/readyz", "/healthz"] {
            let before = get(addr, path).await;
            assert!(
                before.starts_with("HTTP/1.1 503 Service Unavailable\r\n") && before.contains("not ready"),
                "{path}: {before}"
            );
        }
        server.set_ready();
        assert!(get(addr, "/readyz").await.ends_with("\r\n\r\nready\n"));
        // /healthz is answered by the loop (here, this test).
        let health = tokio::spawn(get(addr, "/healthz"));
        let ask = server.next().await.expect("a health check");
        assert_eq!(ask.ask, Ask::Health);
        ask.answer("ok\n".into());
        let health = health.await.expect("client");
        assert!(health.starts_with("HTTP/1.1 200 OK\r\n") && health.ends_with("ok\n"), "{health}");
    }

    #[tokio::test]
    async fn serves_a_scrape_over_http() {
        let mut server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let addr = server.local_addr();
        let client = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text\r\nConnection: close\r\n\r\n")
                .await
                .expect("write");
            let mut response = String::new();
            stream.read_to_string(&mut response).await.expect("read");
            response
        });
        let scrape = server.next().await.expect("a scrape");
        assert_eq!(scrape.ask, Ask::Metrics(Format::OpenMetrics));
        scrape.answer("x 1\n# EOF\n".into());
        let response = client.await.expect("client");
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(response.contains("application/openmetrics-text"), "{response}");
        assert!(response.ends_with("\r\n\r\nx 1\n# EOF\n"), "{response}");
    }

    /// A scraper keeps its connection: requests after the first, `HEAD`
    /// among them (a head with the `GET`'s length and no body), are
    /// answered on it, and a bad method is refused without closing it.
    #[tokio::test]
    async fn requests_after_the_first_are_answered_on_the_same_connection() {
        let mut server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let mut stream = TcpStream::connect(server.local_addr()).await.expect("connect");
        for round in ["first", "second"] {
            stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
            let scrape = server.next().await.expect("a scrape");
            assert_eq!(scrape.ask, Ask::Metrics(Format::Prometheus));
            scrape.answer(format!("{round} 1\n"));
            let (head, body) = read_response(&mut stream, false).await;
            assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{round}: {head}");
            assert!(!head.to_ascii_lowercase().contains("connection: close"), "{round}: {head}");
            assert_eq!(body, format!("{round} 1\n").as_bytes());
        }
        stream.write_all(b"HEAD /readyz HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
        let (head, _) = read_response(&mut stream, true).await;
        assert!(head.starts_with("HTTP/1.1 503 ") && head.contains(&format!("{}", NOT_READY.len())), "{head}");
        stream.write_all(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n").await.expect("write");
        let (head, _) = read_response(&mut stream, false).await;
        assert!(head.starts_with("HTTP/1.1 405 ") && head.to_ascii_lowercase().contains("allow: get, head"), "{head}");
        server.set_ready();
        stream.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
        let (head, body) = read_response(&mut stream, false).await;
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert_eq!(body, b"ready\n");
    }

    /// `Accept-Encoding: gzip` (Prometheus sends it) is answered gzipped,
    /// and the text comes back whole; without it, or refused by `q=0`,
    /// the text goes as it is.
    #[tokio::test]
    async fn a_scrape_that_accepts_gzip_is_answered_gzipped() {
        let mut server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let mut stream = TcpStream::connect(server.local_addr()).await.expect("connect");
        let text: String = (0..500)
            .map(|n| format!("stallwatch_requests_ended_total{{outcome=\"released\",n=\"{n}\"}} {n}\n"))
            .collect();
        for (accept_encoding, gzipped) in
            [("gzip", true), ("deflate, gzip;q=0.5", true), ("gzip;q=0", false), ("", false)]
        {
            let header = if accept_encoding.is_empty() {
                String::new()
            } else {
                format!("Accept-Encoding: {accept_encoding}\r\n")
            };
            stream
                .write_all(format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{header}\r\n").as_bytes())
                .await
                .expect("write");
            server.next().await.expect("a scrape").answer(text.clone());
            let (head, body) = read_response(&mut stream, false).await;
            let head = head.to_ascii_lowercase();
            assert!(head.contains("vary: accept-encoding"), "{accept_encoding:?}: {head}");
            assert_eq!(head.contains("content-encoding: gzip"), gzipped, "{accept_encoding:?}: {head}");
            let plain = if gzipped {
                assert!(body.len() < text.len() / 4, "{accept_encoding:?}: {} bytes of {}", body.len(), text.len());
                let mut plain = String::new();
                flate2::read::GzDecoder::new(body.as_slice()).read_to_string(&mut plain).expect("gzip");
                plain
            } else {
                String::from_utf8(body).expect("text")
            };
            assert!(plain == text, "{accept_encoding:?}: the text differs");
        }
    }

    /// A request head past [`MAX_REQUEST`] is refused, not read on.
    #[tokio::test]
    async fn a_request_head_past_the_bound_is_refused() {
        let server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let mut stream = TcpStream::connect(server.local_addr()).await.expect("connect");
        let padding = "x".repeat(MAX_REQUEST);
        let request = format!("GET /readyz HTTP/1.1\r\nHost: x\r\nX-Padding: {padding}\r\n\r\n");
        // The server may close before it has read all of it.
        let _ = stream.write_all(request.as_bytes()).await;
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response).await;
        assert!(response.starts_with("HTTP/1.1 431 "), "{response}");
    }

    #[test]
    fn gzip_is_accepted_by_name_unless_its_weight_is_zero() {
        let accepts = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            for value in values {
                headers.append(header::ACCEPT_ENCODING, HeaderValue::from_str(value).expect("a header value"));
            }
            accepts_gzip(&headers)
        };
        assert!(accepts(&["gzip"]) && accepts(&["GZIP"]) && accepts(&["x-gzip"]));
        assert!(accepts(&["br", "deflate, gzip ; q=0.1"]));
        assert!(!accepts(&[]) && !accepts(&["br, deflate"]) && !accepts(&["gzip;q=0"]) && !accepts(&["gzip;q=0.0"]));
        assert!(!accepts(&["gzipped"]) && !accepts(&["gzip;q=x"]));
    }

    #[tokio::test]
    async fn idle_connections_past_the_limit_never_keep_a_scrape_out() {
        let mut server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let addr = server.local_addr();
        // More than the limit, holding their places and sending nothing.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS + 64 {
            idle.push(TcpStream::connect(addr).await.expect("connect"));
        }
        for _ in 0..3 {
            let client = tokio::spawn(get(addr, "/metrics"));
            let scrape = server.next().await.expect("a scrape");
            scrape.answer("x 1\n".into());
            let response = client.await.expect("client");
            assert!(response.starts_with("HTTP/1.1 200 OK\r\n") && response.ends_with("x 1\n"), "{response}");
        }
        // The oldest idle ones were closed to make room: they read an end.
        let mut first = idle.swap_remove(0);
        let mut byte = [0; 1];
        assert_eq!(first.read(&mut byte).await.expect("read"), 0);
    }
}
