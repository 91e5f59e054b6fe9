//! The Prometheus `/metrics` endpoint (off unless `--metrics-addr`).
//!
//! Values are taken when a scrape arrives, on the event loop (which owns
//! the engine and the kernel maps): the HTTP side only forwards the scrape
//! and writes the answer, so a slow or hostile client costs the event path
//! nothing but that one render. The in-flight gauges walk the tracked
//! requests, O(tracked) per scrape.
//!
//! The exposition format is written by `prometheus-client` (the Prometheus
//! project's Rust client): OpenMetrics text when the scraper asks for it
//! (`Accept: application/openmetrics-text`, as Prometheus does), the
//! classic 0.0.4 text format otherwise, with names, types, `_total`
//! suffixes and escaping done by the library. The HTTP part is a few lines
//! on tokio: one `GET /metrics`, one response, close.
use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context as _, Result};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    sync::{Semaphore, mpsc, oneshot},
};
use tracing::{debug, warn};

use super::otlp::ExportCounts;
use crate::{
    lifecycle::{Engine, EngineStats, Outcome, Report, Stage, StallClass},
    events::Losses,
    status::StatusReads,
};

/// Counters kept from the reports themselves (the engine counts stalls and
/// recoveries, but not by class).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    stalls: [u64; 3],
    recoveries: [u64; 3],
}

impl Metrics {
    pub fn report(&mut self, report: &Report) {
        match report {
            Report::Stalled { class, .. } => self.stalls[*class as usize] += 1,
            Report::Recovered { class, .. } => self.recoveries[*class as usize] += 1,
            Report::Ended { .. } => {}
        }
    }

    /// Everything a scrape shows, as of now.
    pub fn snapshot(&self, engine: &Engine, losses: Option<Losses>, export: Option<ExportCounts>) -> Snapshot {
        let mut in_flight = [0; 3];
        let mut stalled = [0; 3];
        for request in engine.inflight() {
            if let Some(slot) = request.stage.timestamp_slot().filter(|&slot| slot < 3) {
                in_flight[slot] += 1;
            }
            if let Some(class) = request.stalled {
                stalled[class as usize] += 1;
            }
        }
        Snapshot {
            engine: engine.stats(),
            in_flight,
            stalled,
            stalls: self.stalls,
            recoveries: self.recoveries,
            losses,
            export,
            status_reads: None,
            progress_probes: None,
            alert_lines_dropped: 0,
        }
    }
}

/// One scrape's values.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub engine: EngineStats,
    /// Tracked requests by stage: enqueued, transfer_posted, transfer_done.
    pub in_flight: [u64; 3],
    /// Tracked requests stuck right now, by class.
    pub stalled: [u64; 3],
    pub stalls: [u64; 3],
    pub recoveries: [u64; 3],
    /// `None` when the kernel's counters could not be read.
    pub losses: Option<Losses>,
    pub export: Option<ExportCounts>,
    /// How the reads of the profile's `[status]` went, when it has one.
    pub status_reads: Option<StatusReads>,
    /// Processes whose progress probes are attached now and those whose
    /// are not (attached only near a stall); `None`: no process has any.
    pub progress_probes: Option<[u64; 2]>,
    /// Alert lines dropped because stdout did not drain (the detections
    /// are all here and in the spans; only their human lines are lost).
    pub alert_lines_dropped: u64,
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let gauges = |encoder: &mut DescriptorEncoder, name: &str, help: &str, label: &str, values: &[(&str, u64)]| {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (value_label, value) in values {
                ConstGauge::new(*value).encode(family.encode_family(&[(label, *value_label)])?)?;
            }
            Ok::<(), fmt::Error>(())
        };
        let in_flight: Vec<(&str, u64)> = Stage::LIVE.iter().map(|s| s.as_str()).zip(self.in_flight).collect();
        gauges(&mut encoder, "stallwatch_requests_in_flight", "Requests tracked right now, by furthest stage", "stage", &in_flight)?;
        let classes = || StallClass::ALL.iter().map(|c| c.as_str());
        let stalled: Vec<(&str, u64)> = classes().zip(self.stalled).collect();
        gauges(&mut encoder, "stallwatch_requests_stalled", "Requests stalled right now, by class", "class", &stalled)?;

        let counters = |encoder: &mut DescriptorEncoder, name: &str, help: &str, label: &str, values: &[(&str, u64)]| {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (value_label, value) in values {
                ConstCounter::new(*value).encode(family.encode_family(&[(label, *value_label)])?)?;
            }
            Ok::<(), fmt::Error>(())
        };
        let counter = |encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64| {
            ConstCounter::new(value).encode(encoder.encode_descriptor(name, help, None, MetricType::Counter)?)
        };
        let e = &self.engine;
        counter(&mut encoder, "stallwatch_requests_seen", "Request lifecycles started", e.seen)?;
        counter(
            &mut encoder,
            "stallwatch_requests_restored",
            "Request lifecycles taken over from the kernel's in-flight table at start (a restart)",
            e.restored,
        )?;
        let ended: Vec<(&str, u64)> = Outcome::ALL
            .iter()
            .map(|outcome| {
                let n = match outcome {
                    Outcome::Released => e.completed - e.completed_unreleased,
                    Outcome::Completed => e.completed_unreleased,
                    Outcome::Aborted => e.aborted,
                    Outcome::Failed => e.failed,
                    Outcome::ProcessExited => e.process_exited,
                    Outcome::Evicted => e.evicted,
                    Outcome::EndUnseen => e.end_unseen,
                };
                (outcome.as_str(), n)
            })
            .collect();
        counters(&mut encoder, "stallwatch_requests_ended", "Request lifecycles ended, by outcome", "outcome", &ended)?;
        let stalls: Vec<(&str, u64)> = classes().zip(self.stalls).collect();
        counters(&mut encoder, "stallwatch_stalls", "Stalls reported (silence episodes past the timeout), by class", "class", &stalls)?;
        let recoveries: Vec<(&str, u64)> = classes().zip(self.recoveries).collect();
        counters(&mut encoder, "stallwatch_recoveries", "Stalled requests that moved on, by the class they had", "class", &recoveries)?;
        counters(
            &mut encoder,
            "stallwatch_ignored_events",
            "Lifecycle events the engine ignored, by reason",
            "reason",
            &[
                ("stale", e.stale_events),
                ("duplicate", e.duplicate_events),
                ("caught_up_repeat", e.caught_up_repeats),
            ],
        )?;
        if let Some(losses) = &self.losses {
            let k = &losses.kernel;
            counters(
                &mut encoder,
                "stallwatch_lost_events",
                "Lifecycle events the agent never saw, by reason",
                "reason",
                &[
                    ("ringbuf_full", k.ringbuf_full),
                    ("key_unreadable", k.key_unreadable),
                    ("args_missing", k.args_missing),
                    ("no_slot", k.no_slot),
                    ("undecodable", losses.undecodable),
                ],
            )?;
            counters(
                &mut encoder,
                "stallwatch_unreadable_fields",
                "Events delivered without a field that could not be read, by field",
                "field",
                &[("external_id", k.ext_unreadable)],
            )?;
            counter(
                &mut encoder,
                "stallwatch_state_full",
                "Requests the kernel's in-flight table had no room for (they would not survive a restart)",
                k.state_full,
            )?;
            counter(
                &mut encoder,
                "stallwatch_withheld_events",
                "Events of quiet probes kept in the kernel's in-flight table instead of sent (not lost)",
                k.withheld,
            )?;
        }
        counter(
            &mut encoder,
            "stallwatch_alert_lines_dropped",
            "Alert lines dropped, oldest first, because stdout did not drain (the detections are not lost)",
            self.alert_lines_dropped,
        )?;
        if let Some([attached, detached]) = self.progress_probes {
            gauges(
                &mut encoder,
                "stallwatch_progress_probes",
                "Watched processes by whether their progress probes are attached now (only while a request nears its stall)",
                "state",
                &[("attached", attached), ("detached", detached)],
            )?;
        }
        if let Some(r) = &self.status_reads {
            counters(
                &mut encoder,
                "stallwatch_status_reads",
                "Reads of a request's state in the target's memory (a stall due), by result",
                "result",
                &[
                    ("answered", r.answered),
                    ("not_held", r.not_held),
                    ("process_gone", r.process_gone),
                    ("unreadable", r.unreadable),
                    ("unrecognised", r.unrecognised),
                    ("off", r.off),
                ],
            )?;
        }
        if let Some(x) = &self.export {
            counter(&mut encoder, "stallwatch_export_spans", "Spans the OTLP collector accepted", x.exported)?;
            counters(
                &mut encoder,
                "stallwatch_export_drops",
                "Reports or spans that never reached the OTLP collector, by reason",
                "reason",
                &[("queue_full", x.dropped_queue_full), ("export_failed", x.dropped_export_failed)],
            )?;
            counter(&mut encoder, "stallwatch_export_failed_requests", "OTLP export requests that failed after retries", x.failed_batches)?;
            ConstGauge::new(x.queued).encode(encoder.encode_descriptor(
                "stallwatch_export_queue_length",
                "Reports waiting in the export queue",
                None,
                MetricType::Gauge,
            )?)?;
            ConstGauge::new(x.queue_capacity).encode(encoder.encode_descriptor(
                "stallwatch_export_queue_capacity",
                "Reports the export queue holds before it drops",
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

/// The two text formats a scraper can ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text.
    OpenMetrics,
    /// Prometheus text 0.0.4.
    Prometheus,
}

impl Format {
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

/// The exposition text of a snapshot.
pub fn render(snapshot: Snapshot, format: Format) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(snapshot));
    let mut out = String::new();
    let encoded = match format {
        Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &registry),
        Format::Prometheus => prometheus_client::encoding::prometheus_text::encode(&mut out, &registry),
    };
    // Writing into a String cannot fail; a collector error would be ours.
    if let Err(err) = encoded {
        warn!("encoding the metrics failed: {err}");
    }
    out
}

/// `--metrics-addr`: `PORT` (on 127.0.0.1) or `ADDRESS:PORT`.
pub fn parse_addr(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
    if let Ok(port) = text.trim_start_matches(':').parse::<u16>() {
        return Ok(SocketAddr::new(localhost, port));
    }
    if let Some(port) = text.strip_prefix("localhost:").and_then(|port| port.parse::<u16>().ok()) {
        return Ok(SocketAddr::new(localhost, port));
    }
    text.parse::<SocketAddr>().map_err(|_| {
        format!("{text:?} is not PORT or ADDRESS:PORT (e.g. `9464` for 127.0.0.1:9464, or `0.0.0.0:9464` for every interface)")
    })
}

/// A scrape waiting for the event loop's answer.
pub struct Scrape {
    pub format: Format,
    reply: oneshot::Sender<String>,
}

impl Scrape {
    pub fn answer(self, body: String) {
        // The client may have gone away; nothing to do then.
        let _ = self.reply.send(body);
    }
}

/// Connections served at once; more are closed at once. Many, so that
/// idle or slow clients (the endpoint may listen on every interface) never
/// hold every slot: each costs a task and a 1 KiB buffer, for at most
/// [`REQUEST_TIMEOUT`].
const MAX_CONNECTIONS: usize = 512;
/// How long a client may take to send its request head: a scraper sends it
/// at once, and this is well under any scrape interval (15 s and up), so a
/// half-sent request frees its slot long before the next scrape.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_REQUEST: usize = 8 * 1024;

/// The listening socket and the queue of scrapes it forwards.
pub struct MetricsServer {
    addr: SocketAddr,
    scrapes: mpsc::Receiver<Scrape>,
}

impl MetricsServer {
    /// Listen on `addr` and serve from a task on the current runtime.
    pub async fn bind(addr: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind(addr).await.with_context(|| {
            format!("binding the metrics endpoint to {addr} (--metrics-addr): is the port in use, or the address not on this host?")
        })?;
        let addr = listener.local_addr().context("reading the metrics endpoint's address")?;
        let (tx, scrapes) = mpsc::channel(MAX_CONNECTIONS);
        tokio::spawn(accept(listener, tx));
        Ok(Self { addr, scrapes })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next scrape to answer.
    pub async fn next(&mut self) -> Option<Scrape> {
        self.scrapes.recv().await
    }
}

async fn accept(listener: TcpListener, scrapes: mpsc::Sender<Scrape>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                debug!("metrics endpoint: accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            debug!(%peer, "metrics endpoint: too many connections, closing one");
            continue;
        };
        let scrapes = scrapes.clone();
        tokio::spawn(async move {
            if let Err(err) = serve(stream, scrapes).await {
                debug!(%peer, "metrics endpoint: {err:#}");
            }
            drop(slot);
        });
    }
}

async fn serve(mut stream: TcpStream, scrapes: mpsc::Sender<Scrape>) -> Result<()> {
    let mut request = Vec::with_capacity(1024);
    let head = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let mut buf = [0; 1024];
        loop {
            let n = stream.read(&mut buf).await?;
            request.extend_from_slice(&buf[..n]);
            if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                return Ok::<_, std::io::Error>(Some(end));
            }
            if n == 0 || request.len() > MAX_REQUEST {
                return Ok(None);
            }
        }
    })
    .await;
    let Ok(Ok(Some(end))) = head else {
        return respond(&mut stream, "400 Bad Request", "text/plain", "bad request\n", false).await;
    };
    let head = String::from_utf8_lossy(&request[..end]);
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split_whitespace();
    let (method, path) = (first.next().unwrap_or_default(), first.next().unwrap_or_default());
    let accept = lines
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("accept"))
        .map_or("", |(_, value)| value.trim());
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        return respond(&mut stream, "405 Method Not Allowed", "text/plain", "only GET /metrics\n", false).await;
    }
    match path.split('?').next() {
        Some("/metrics") => {
            let format = Format::from_accept(accept);
            let (reply, answer) = oneshot::channel();
            scrapes.send(Scrape { format, reply }).await.context("the agent is shutting down")?;
            let body = answer.await.context("the agent is shutting down")?;
            respond(&mut stream, "200 OK", format.content_type(), &body, head_only).await
        }
        Some("/") => respond(&mut stream, "200 OK", "text/plain", "stallwatch: metrics at /metrics\n", head_only).await,
        _ => respond(&mut stream, "404 Not Found", "text/plain", "not found: metrics are at /metrics\n", head_only).await,
    }
}

async fn respond(stream: &mut TcpStream, status: &str, content_type: &str, body: &str, head_only: bool) -> Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    if !head_only {
        stream.write_all(body.as_bytes()).await?;
    }
    stream.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::{EngineConfig, Observation};
    use crate::probes::KernelCounters;

    fn engine_with_requests() -> Engine {
        let mut engine = Engine::new(EngineConfig { timeout_ns: 1_000, max_tracked: 100, tick_ns: 10 });
        let mut reports = Vec::new();
        for (key, stage) in [(1, Stage::Enqueued), (2, Stage::TransferPosted), (3, Stage::TransferPosted)] {
            engine.observe(Observation { pid: 1, key, stage, ts_ns: 100, external_id: None, ends: false }, &mut reports);
        }
        engine.advance(5_000, &mut reports);
        engine
    }

    #[test]
    fn renders_both_formats_with_labels() {
        let engine = engine_with_requests();
        let mut metrics = Metrics::default();
        let stalled = Report::Stalled {
            request: engine.get(1, 2).expect("tracked"),
            class: StallClass::TransferHung,
            silent_ns: 2,
            at_ns: 3,
        };
        metrics.report(&stalled);
        let kernel = KernelCounters { ringbuf_full: 4, ext_unreadable: 3, ..KernelCounters::default() };
        let losses = Losses { kernel, undecodable: 5 };
        let export = ExportCounts { exported: 10, dropped_queue_full: 2, queue_capacity: 16, ..ExportCounts::default() };
        let mut snapshot = metrics.snapshot(&engine, Some(losses), Some(export));
        snapshot.status_reads = Some(StatusReads { answered: 6, unreadable: 1, ..StatusReads::default() });
        snapshot.progress_probes = Some([1, 2]);
        let open = render(snapshot, Format::OpenMetrics);
        for line in [
            "stallwatch_requests_in_flight{stage=\"transfer_posted\"} 2",
            "stallwatch_requests_in_flight{stage=\"enqueued\"} 1",
            "stallwatch_requests_stalled{class=\"transfer_hung\"} 2",
            "stallwatch_stalls_total{class=\"transfer_hung\"} 1",
            "stallwatch_stalls_total{class=\"release_lost\"} 0",
            "stallwatch_requests_seen_total 3",
            "stallwatch_requests_restored_total 0",
            "stallwatch_state_full_total 0",
            "stallwatch_lost_events_total{reason=\"ringbuf_full\"} 4",
            "stallwatch_lost_events_total{reason=\"key_unreadable\"} 0",
            "stallwatch_lost_events_total{reason=\"undecodable\"} 5",
            "stallwatch_unreadable_fields_total{field=\"external_id\"} 3",
            "stallwatch_export_drops_total{reason=\"queue_full\"} 2",
            "stallwatch_export_spans_total 10",
            "stallwatch_status_reads_total{result=\"answered\"} 6",
            "stallwatch_status_reads_total{result=\"unreadable\"} 1",
            "stallwatch_progress_probes{state=\"attached\"} 1",
            "stallwatch_progress_probes{state=\"detached\"} 2",
            "stallwatch_export_queue_capacity 16",
            "# TYPE stallwatch_stalls counter",
            "# EOF",
        ] {
            assert!(open.lines().any(|l| l == line), "no `{line}` in:\n{open}");
        }
        let classic = render(metrics.snapshot(&engine, None, None), Format::Prometheus);
        assert!(classic.contains("stallwatch_stalls_total{class=\"transfer_hung\"} 1"), "{classic}");
        assert!(!classic.contains("# EOF") && !classic.contains("lost_events") && !classic.contains("export") && !classic.contains("status_reads") && !classic.contains("progress_probes"), "{classic}");
    }

    #[test]
    fn addresses_default_to_loopback() {
        assert_eq!(parse_addr("9464"), Ok("127.0.0.1:9464".parse().expect("addr")));
        assert_eq!(parse_addr(":9464"), Ok("127.0.0.1:9464".parse().expect("addr")));
        assert_eq!(parse_addr("localhost:1"), Ok("127.0.0.1:1".parse().expect("addr")));
        assert_eq!(parse_addr("0.0.0.0:9464"), Ok("0.0.0.0:9464".parse().expect("addr")));
        assert_eq!(parse_addr("[::]:9464"), Ok("[::]:9464".parse().expect("addr")));
        assert!(parse_addr("metrics").expect_err("bad").contains("PORT or ADDRESS:PORT"));
    }

    #[tokio::test]
    async fn serves_a_scrape_over_http() {
        let mut server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let addr = server.local_addr();
        let client = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text\r\n\r\n").await.expect("write");
            let mut response = String::new();
            stream.read_to_string(&mut response).await.expect("read");
            response
        });
        let scrape = server.next().await.expect("a scrape");
        assert_eq!(scrape.format, Format::OpenMetrics);
        scrape.answer("x 1\n# EOF\n".into());
        let response = client.await.expect("client");
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(response.contains("application/openmetrics-text"), "{response}");
        assert!(response.ends_with("\r\n\r\nx 1\n# EOF\n"), "{response}");
    }
}
