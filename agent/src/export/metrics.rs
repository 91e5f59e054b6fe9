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
//!
//! Durations are histograms in seconds (Prometheus base units), beside the
//! serving frameworks' own (`vllm:e2e_request_latency_seconds`,
//! `sglang:queue_time_seconds`): how long stalls lasted, how long requests
//! lived and how long they spent in each stage. Their labels are the
//! bounded enums of the engine (class, outcome, stage), never a request or
//! a process: the series count is fixed (see the metrics table in docs/telemetry.md).
//!
//! `/healthz` answers through the event loop once it runs (a wedged loop
//! fails it, which is what a liveness probe should see); `/readyz` answers
//! from a flag the loop sets once the probes are attached and a previous
//! agent's pinned state is taken over, so a rolling update waits for the
//! hand-over. Until then both answer `503` at once: the HTTP side runs on
//! a thread of its own, because attaching is synchronous work on the
//! agent's single-threaded runtime and would hold every request for its
//! length (seconds on a process with many libraries).
use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, TypedMetric as _, counter::ConstCounter, gauge::ConstGauge, histogram::Histogram},
    registry::{Registry, Unit},
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpSocket, TcpStream},
    sync::{mpsc, oneshot},
};
use tracing::{debug, warn};

use super::otlp::ExportCounts;
use crate::{
    evidence::status::StatusReads,
    export::workload::Directory,
    kernel::ring::Losses,
    lifecycle::{Engine, EngineStats, Outcome, Report, Stage, StallClass},
    util::{
        build_info,
        connections::{Admitted, Connections},
    },
};

/// Buckets of `stallwatch_stall_duration_seconds`: a stall lasts at least
/// the timeout (60 s by default, seconds in tests), and up to hours.
const STALL_BUCKETS: [f64; 13] = [0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 10800.0];
/// Buckets of the request and stage durations: a KV hand-over takes
/// milliseconds, a whole request seconds to minutes.
const REQUEST_BUCKETS: [f64; 17] =
    [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0];

/// The duration histograms, by their label's value. A clone shares the
/// counts (prometheus-client's histograms are reference counted), so a
/// scrape's snapshot takes them without copying.
#[derive(Debug, Clone)]
pub struct Histograms {
    /// How long stalls lasted, by class: from the request's last event to
    /// the event that revived it, or to its end while still stalled.
    stall: [Histogram; CLASSES],
    /// Request lifetimes (first event to end), by outcome.
    request: [Histogram; Outcome::ALL.len()],
    /// Time from a live stage's first event to the next stage's, by the
    /// stage waited in (enqueued: waiting for the peer; transfer_posted:
    /// the transfer; transfer_done: the release), for requests that went on.
    stage: [Histogram; Stage::LIVE.len()],
}

impl Default for Histograms {
    fn default() -> Self {
        Self {
            stall: std::array::from_fn(|_| Histogram::new(STALL_BUCKETS)),
            request: std::array::from_fn(|_| Histogram::new(REQUEST_BUCKETS)),
            stage: std::array::from_fn(|_| Histogram::new(REQUEST_BUCKETS)),
        }
    }
}

fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// Counters kept from the reports themselves (the engine counts stalls and
/// recoveries, but not by class), and the duration histograms.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    stalls: [u64; CLASSES],
    recoveries: [u64; CLASSES],
    histograms: Histograms,
}

/// Stall classes, each with its own series.
const CLASSES: usize = StallClass::ALL.len();

impl Metrics {
    pub fn report(&mut self, report: &Report) {
        match report {
            Report::Stalled { class, .. } => self.stalls[*class as usize] += 1,
            Report::Recovered { class, stuck_ns, .. } => {
                self.recoveries[*class as usize] += 1;
                self.histograms.stall[*class as usize].observe(seconds(*stuck_ns));
            }
            Report::Ended { request, outcome, at_ns } => {
                // Still stalled at its end (evicted, its process gone): the
                // stall lasted until then. A revived one was counted above.
                if let Some(class) = request.stalled {
                    self.histograms.stall[class as usize].observe(seconds(at_ns.saturating_sub(request.last_ns)));
                }
                if let Some(at) = Outcome::ALL.iter().position(|o| o == outcome) {
                    self.histograms.request[at].observe(seconds(at_ns.saturating_sub(request.first_ns)));
                }
                // Each live stage whose next stage was seen: its time.
                let next = [request.stage_ns[1], request.stage_ns[2], request.stage_ns[3].or(Some(*at_ns))];
                for (slot, (from, to)) in request.stage_ns.iter().take(3).zip(next).enumerate() {
                    if let (Some(from), Some(to)) = (from, to) {
                        self.histograms.stage[slot].observe(seconds(to.saturating_sub(*from)));
                    }
                }
            }
        }
    }

    /// Everything a scrape shows, as of now.
    pub fn snapshot(&self, engine: &Engine, losses: Option<Losses>, export: Option<ExportCounts>) -> Snapshot {
        let mut in_flight = [0; 3];
        let mut stalled = [0; CLASSES];
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
            histograms: self.histograms.clone(),
            process: ProcessStats::read(),
            workload_stalled: Vec::new(),
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
    pub stalled: [u64; CLASSES],
    pub stalls: [u64; CLASSES],
    pub recoveries: [u64; CLASSES],
    /// `None` when the kernel's counters could not be read.
    pub losses: Option<Losses>,
    pub export: Option<ExportCounts>,
    /// How the reads of the profile's `[status]` went, when it has one.
    pub status_reads: Option<StatusReads>,
    /// Processes whose progress probes are attached now and those whose
    /// are not (attached only near a stall); `None`: no process has any.
    pub progress_probes: Option<[u64; 2]>,
    pub histograms: Histograms,
    /// The agent's own process; `None` when /proc/self could not be read.
    pub process: Option<ProcessStats>,
    /// Requests stalled right now by workload and class: one series per
    /// (pod, container, class) with a stall now, none otherwise.
    pub workload_stalled: Vec<WorkloadStalled>,
    /// Alert lines dropped because stdout did not drain (the detections
    /// are all here and in the spans; only their human lines are lost).
    pub alert_lines_dropped: u64,
}

/// Requests of one workload stalled at one class right now.
pub type WorkloadStalled = ([(&'static str, String); 4], StallClass, u64);

/// The stalled requests now, by the workload of their process (processes
/// with no known workload count under empty labels).
pub fn workload_stalled(engine: &Engine, workloads: &Directory) -> Vec<WorkloadStalled> {
    type Key = ([(&'static str, String); 4], usize);
    let mut counts: std::collections::BTreeMap<Key, u64> = std::collections::BTreeMap::new();
    for request in engine.inflight() {
        if let Some(class) = request.stalled {
            let labels = workloads
                .get(request.pid)
                .map(|w| w.labels())
                .unwrap_or_else(|| crate::export::workload::Workload::default().labels());
            *counts.entry((labels, class as usize)).or_default() += 1;
        }
    }
    counts.into_iter().map(|((labels, class), n)| (labels, StallClass::ALL[class], n)).collect()
}

/// The agent process's own resource use, under the names every Prometheus
/// client library exports (`process_*`), read from /proc/self by `procfs`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub open_fds: u64,
    /// `None`: unlimited.
    pub max_fds: Option<u64>,
    pub start_time_seconds: f64,
    pub threads: u64,
}

impl ProcessStats {
    /// As of now; `None` (and a debug line) if /proc/self cannot be read.
    pub fn read() -> Option<Self> {
        let read = || -> procfs::ProcResult<Self> {
            let me = procfs::process::Process::myself()?;
            let stat = me.stat()?;
            let ticks = procfs::ticks_per_second() as f64;
            let boot = procfs::boot_time_secs()? as f64;
            let max_fds = match me.limits()?.max_open_files.soft_limit {
                procfs::process::LimitValue::Value(n) => Some(n),
                procfs::process::LimitValue::Unlimited => None,
            };
            Ok(Self {
                cpu_seconds: (stat.utime + stat.stime) as f64 / ticks,
                resident_bytes: stat.rss * procfs::page_size(),
                virtual_bytes: stat.vsize,
                open_fds: me.fd_count()? as u64,
                max_fds,
                start_time_seconds: boot + stat.starttime as f64 / ticks,
                threads: u64::try_from(stat.num_threads).unwrap_or(0),
            })
        };
        read().map_err(|err| debug!("metrics: reading /proc/self: {err}")).ok()
    }
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
        gauges(
            &mut encoder,
            "stallwatch_requests_in_flight",
            "Requests tracked right now, by furthest stage",
            "stage",
            &in_flight,
        )?;
        let classes = || StallClass::ALL.iter().map(|c| c.as_str());
        let stalled: Vec<(&str, u64)> = classes().zip(self.stalled).collect();
        gauges(&mut encoder, "stallwatch_requests_stalled", "Requests stalled right now, by class", "class", &stalled)?;

        let counters =
            |encoder: &mut DescriptorEncoder, name: &str, help: &str, label: &str, values: &[(&str, u64)]| {
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
                    Outcome::LeaseExpired => e.lease_expired,
                    Outcome::KvReadAfterRelease => e.kv_read_after_release,
                    Outcome::Leaked => e.leaked,
                };
                (outcome.as_str(), n)
            })
            .collect();
        counters(&mut encoder, "stallwatch_requests_ended", "Request lifecycles ended, by outcome", "outcome", &ended)?;
        let stalls: Vec<(&str, u64)> = classes().zip(self.stalls).collect();
        counters(
            &mut encoder,
            "stallwatch_stalls",
            "Stalls reported (silence episodes past the timeout), by class",
            "class",
            &stalls,
        )?;
        let recoveries: Vec<(&str, u64)> = classes().zip(self.recoveries).collect();
        counters(
            &mut encoder,
            "stallwatch_recoveries",
            "Stalled requests that moved on, by the class they had",
            "class",
            &recoveries,
        )?;
        counters(
            &mut encoder,
            "stallwatch_ignored_events",
            "Lifecycle events the engine ignored, by reason",
            "reason",
            &[("stale", e.stale_events), ("duplicate", e.duplicate_events), ("caught_up_repeat", e.caught_up_repeats)],
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
            counter(
                &mut encoder,
                "stallwatch_export_sampled_out",
                "Spans the sampler (OTEL_TRACES_SAMPLER) did not send",
                x.sampled_out,
            )?;
            counters(
                &mut encoder,
                "stallwatch_export_drops",
                "Reports or spans that never reached the OTLP collector, by reason",
                "reason",
                &[("queue_full", x.dropped_queue_full), ("export_failed", x.dropped_export_failed)],
            )?;
            counter(
                &mut encoder,
                "stallwatch_export_failed_requests",
                "OTLP export requests that failed after retries",
                x.failed_batches,
            )?;
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
        let histograms =
            |encoder: &mut DescriptorEncoder, name: &str, help: &str, label: &str, values: &[(&str, &Histogram)]| {
                let mut family = encoder.encode_descriptor(name, help, Some(&Unit::Seconds), Histogram::TYPE)?;
                for (value_label, histogram) in values {
                    histogram.encode(family.encode_family(&[(label, *value_label)])?)?;
                }
                Ok::<(), fmt::Error>(())
            };
        let h = &self.histograms;
        let stall: Vec<(&str, &Histogram)> = classes().zip(&h.stall).collect();
        histograms(
            &mut encoder,
            "stallwatch_stall_duration",
            "How long stalls lasted (last event to the reviving event, or to the end while stalled), by class",
            "class",
            &stall,
        )?;
        let request: Vec<(&str, &Histogram)> = Outcome::ALL.iter().map(|o| o.as_str()).zip(&h.request).collect();
        histograms(
            &mut encoder,
            "stallwatch_request_duration",
            "Request lifetimes (first event to end), by outcome",
            "outcome",
            &request,
        )?;
        let stage: Vec<(&str, &Histogram)> = Stage::LIVE.iter().map(|s| s.as_str()).zip(&h.stage).collect();
        histograms(
            &mut encoder,
            "stallwatch_stage_duration",
            "Time requests spent in a stage before the next one (enqueued: waiting for the peer; transfer_posted: the transfer; transfer_done: the release)",
            "stage",
            &stage,
        )?;
        if !self.workload_stalled.is_empty() {
            let mut family = encoder.encode_descriptor(
                "stallwatch_workload_requests_stalled",
                "Requests stalled right now, by the watched workload (namespace, owner, pod, container) and class",
                None,
                MetricType::Gauge,
            )?;
            for (labels, class, n) in &self.workload_stalled {
                let labels: Vec<(&str, &str)> = labels
                    .iter()
                    .map(|(k, v)| (*k, v.as_str()))
                    .chain(std::iter::once(("class", class.as_str())))
                    .collect();
                ConstGauge::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut info = encoder.encode_descriptor(
            "stallwatch_build_info",
            "The agent's build; always 1",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(1).encode(info.encode_family(&[
            ("version", build_info::VERSION),
            ("commit", build_info::GIT_SHA),
            ("rustc", build_info::RUSTC),
            ("target", build_info::TARGET),
        ])?)?;
        if let Some(p) = &self.process {
            let plain = |encoder: &mut DescriptorEncoder, name: &str, help: &str, unit: Option<&Unit>, value: f64| {
                ConstGauge::new(value).encode(encoder.encode_descriptor(name, help, unit, MetricType::Gauge)?)
            };
            ConstCounter::new(p.cpu_seconds).encode(encoder.encode_descriptor(
                "process_cpu",
                "Total user and system CPU time spent",
                Some(&Unit::Seconds),
                MetricType::Counter,
            )?)?;
            plain(
                &mut encoder,
                "process_resident_memory",
                "Resident memory size",
                Some(&Unit::Bytes),
                p.resident_bytes as f64,
            )?;
            plain(
                &mut encoder,
                "process_virtual_memory",
                "Virtual memory size",
                Some(&Unit::Bytes),
                p.virtual_bytes as f64,
            )?;
            plain(&mut encoder, "process_open_fds", "Open file descriptors", None, p.open_fds as f64)?;
            if let Some(max) = p.max_fds {
                plain(&mut encoder, "process_max_fds", "Most open file descriptors allowed", None, max as f64)?;
            }
            plain(
                &mut encoder,
                "process_start_time",
                "Start time since the Unix epoch",
                Some(&Unit::Seconds),
                p.start_time_seconds,
            )?;
            plain(&mut encoder, "process_threads", "Threads", None, p.threads as f64)?;
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

/// Connections open at once, each a task and a 1 KiB buffer. Past it the
/// oldest one that has not sent its request yet is closed to make room
/// ([`Connections`]): idle or slow clients (the endpoint may listen on
/// every interface) never keep a scrape out, however many they hold.
const MAX_CONNECTIONS: usize = 512;
/// Connections the kernel holds for the accept loop (capped by
/// `net.core.somaxconn`, 4096 by default).
const BACKLOG: u32 = 1024;
/// How long a client may take to send its request head: a scraper sends it
/// at once, and this is well under any scrape interval (15 s and up), so a
/// half-sent request frees its place long before the next scrape.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_REQUEST: usize = 8 * 1024;
/// How long a client may take to read its answer: it holds a place
/// meanwhile, and is no longer idle (it sent its request), so nothing
/// else frees that place.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

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
            if let Err(err) = serve(stream, admitted, scrapes, &ready).await {
                debug!(%peer, "metrics endpoint: {err:#}");
            }
        });
    }
}

/// One connection: its request head read (unless it is closed first to
/// make room for a newer one), answered, closed.
async fn serve(
    mut stream: TcpStream,
    mut place: Admitted,
    scrapes: mpsc::Sender<Scrape>,
    ready: &AtomicBool,
) -> Result<()> {
    let mut request = Vec::with_capacity(1024);
    let head = tokio::select! {
        head = tokio::time::timeout(REQUEST_TIMEOUT, read_head(&mut stream, &mut request)) => head,
        () = place.evicted() => {
            debug!("metrics endpoint: closing a connection that sent nothing, to make room for a newer one");
            return Ok(());
        }
    };
    place.busy();
    let response = match head {
        Ok(Ok(Some(end))) => answer(&String::from_utf8_lossy(&request[..end]), &scrapes, ready).await?,
        _ => Response::text("400 Bad Request", "bad request\n"),
    };
    tokio::time::timeout(WRITE_TIMEOUT, response.write(&mut stream))
        .await
        .context("the client did not read its answer in time")?
}

/// Read up to the end of the request head: its length, or `None` when the
/// client closed first or sent too much.
async fn read_head(stream: &mut TcpStream, request: &mut Vec<u8>) -> std::io::Result<Option<usize>> {
    let mut buf = [0; 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        request.extend_from_slice(&buf[..n]);
        if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            return Ok(Some(end));
        }
        if n == 0 || request.len() > MAX_REQUEST {
            return Ok(None);
        }
    }
}

/// What a request is answered.
struct Response {
    status: &'static str,
    content_type: &'static str,
    body: String,
    /// `HEAD`: the head a `GET` has (its `Content-Length` too), no body.
    head_only: bool,
}

impl Response {
    fn text(status: &'static str, body: impl Into<String>) -> Self {
        Self { status, content_type: "text/plain", body: body.into(), head_only: false }
    }

    async fn write(self, stream: &mut TcpStream) -> Result<()> {
        let Self { status, content_type, body, head_only } = self;
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
}

/// `/healthz` and `/readyz` before the loop runs.
const NOT_READY: &str = "not ready: attaching the probes and taking over the previous agent's pinned state\n";

/// The answer to a request head.
async fn answer(head: &str, scrapes: &mpsc::Sender<Scrape>, ready: &AtomicBool) -> Result<Response> {
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split_whitespace();
    let (method, path) = (first.next().unwrap_or_default(), first.next().unwrap_or_default());
    let accept = lines
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("accept"))
        .map_or("", |(_, value)| value.trim());
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        return Ok(Response::text("405 Method Not Allowed", "only GET (or HEAD)\n"));
    }
    let response = match path.split('?').next() {
        Some("/metrics") => {
            let format = Format::from_accept(accept);
            let (reply, answer) = oneshot::channel();
            scrapes.send(Scrape { ask: Ask::Metrics(format), reply }).await.context("the agent is shutting down")?;
            let body = answer.await.context("the agent is shutting down")?;
            Response { status: "200 OK", content_type: format.content_type(), body, head_only: false }
        }
        // Not asked of the loop before it runs: it is attaching.
        Some("/healthz") if !ready.load(Ordering::Acquire) => Response::text("503 Service Unavailable", NOT_READY),
        Some("/healthz") => {
            let (reply, answer) = oneshot::channel();
            let asked = async {
                scrapes.send(Scrape { ask: Ask::Health, reply }).await.ok()?;
                answer.await.ok()
            };
            match tokio::time::timeout(HEALTH_TIMEOUT, asked).await {
                Ok(Some(body)) => Response::text("200 OK", body),
                Ok(None) => Response::text("503 Service Unavailable", "the agent is shutting down\n"),
                Err(_) => Response::text(
                    "503 Service Unavailable",
                    format!("the event loop did not answer within {}s\n", HEALTH_TIMEOUT.as_secs()),
                ),
            }
        }
        Some("/readyz") if ready.load(Ordering::Acquire) => Response::text("200 OK", "ready\n"),
        Some("/readyz") => Response::text("503 Service Unavailable", NOT_READY),
        Some("/") => Response::text("200 OK", "stallwatch: /metrics, /healthz, /readyz\n"),
        _ => Response::text("404 Not Found", "not found: try /metrics, /healthz or /readyz\n"),
    };
    Ok(Response { head_only, ..response })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::KernelCounters;
    use crate::lifecycle::{EngineConfig, Observation};

    fn engine_with_requests() -> Engine {
        let mut engine = Engine::new(EngineConfig { timeout_ns: 1_000, max_tracked: 100, tick_ns: 10 });
        let mut reports = Vec::new();
        for (key, stage) in [(1, Stage::Enqueued), (2, Stage::TransferPosted), (3, Stage::TransferPosted)] {
            engine.observe(Observation { pid: 1, key, stage, ts_ns: 100, external_id: None, ends: None }, &mut reports);
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
        // A decode's stall has its own class, and series.
        let Report::Stalled { request, silent_ns, at_ns, .. } = stalled.clone() else { unreachable!() };
        metrics.report(&Report::Stalled { request, class: StallClass::WaitingForKv, silent_ns, at_ns });
        let kernel = KernelCounters { ringbuf_full: 4, ext_unreadable: 3, ..KernelCounters::default() };
        let losses = Losses { kernel, undecodable: 5 };
        let export =
            ExportCounts { exported: 10, dropped_queue_full: 2, queue_capacity: 16, ..ExportCounts::default() };
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
            "stallwatch_stalls_total{class=\"waiting_for_kv\"} 1",
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
        assert!(
            !classic.contains("# EOF")
                && !classic.contains("lost_events")
                && !classic.contains("export")
                && !classic.contains("status_reads")
                && !classic.contains("progress_probes"),
            "{classic}"
        );
    }

    #[test]
    fn a_port_alone_is_loopback_and_colon_port_every_interface() {
        assert_eq!(parse_addr("9464"), Ok("127.0.0.1:9464".parse().expect("addr")));
        assert_eq!(parse_addr(":9464"), Ok("0.0.0.0:9464".parse().expect("addr")));
        assert_eq!(parse_addr("localhost:1"), Ok("127.0.0.1:1".parse().expect("addr")));
        assert_eq!(parse_addr("0.0.0.0:9464"), Ok("0.0.0.0:9464".parse().expect("addr")));
        assert_eq!(parse_addr("[::]:9464"), Ok("[::]:9464".parse().expect("addr")));
        assert!(parse_addr("metrics").expect_err("bad").contains("PORT or ADDRESS:PORT"));
    }

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await.expect("write");
        let mut response = String::new();
        stream.read_to_string(&mut response).await.expect("read");
        response
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
        std::io::Write::write_all(&mut stream, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").expect("write");
        let mut response = String::new();
        std::io::Read::read_to_string(&mut stream, &mut response).expect("an answer while the runtime is blocked");
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

    #[test]
    fn durations_are_histograms_in_seconds_by_bounded_labels() {
        let mut engine = Engine::new(EngineConfig { timeout_ns: 1_000_000_000, max_tracked: 100, tick_ns: 10 });
        let mut reports = Vec::new();
        let ms = 1_000_000;
        for (stage, at) in [
            (Stage::Enqueued, 0),
            (Stage::TransferPosted, 3 * ms),
            (Stage::TransferDone, 10 * ms),
            (Stage::Released, 12 * ms),
        ] {
            engine
                .observe(Observation { pid: 1, key: 1, stage, ts_ns: at, external_id: None, ends: None }, &mut reports);
        }
        let mut metrics = Metrics::default();
        for report in &reports {
            metrics.report(report);
        }
        let request = reports.iter().find_map(|r| match r {
            Report::Ended { request, .. } => Some(request.clone()),
            _ => None,
        });
        let request = request.expect("the lifecycle ended");
        // Every outcome has its series (one added to `Outcome` once had
        // none, and its first end panicked the agent).
        let mut outcomes = Metrics::default();
        for outcome in Outcome::ALL {
            outcomes.report(&Report::Ended { request: request.clone(), outcome, at_ns: request.first_ns + 5 * ms });
        }
        let text = render(outcomes.snapshot(&engine, None, None), Format::OpenMetrics);
        for outcome in Outcome::ALL {
            let line = format!("stallwatch_request_duration_seconds_count{{outcome=\"{}\"}} 1", outcome.as_str());
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
        metrics.report(&Report::Recovered { request, class: StallClass::ReleaseLost, stuck_ns: 90_000 * ms });
        let text = render(metrics.snapshot(&engine, None, None), Format::OpenMetrics);
        for line in [
            "# TYPE stallwatch_request_duration_seconds histogram",
            "# UNIT stallwatch_request_duration_seconds seconds",
            "stallwatch_request_duration_seconds_count{outcome=\"released\"} 1",
            "stallwatch_request_duration_seconds_sum{outcome=\"released\"} 0.012",
            "stallwatch_stage_duration_seconds_sum{stage=\"enqueued\"} 0.003",
            "stallwatch_stage_duration_seconds_sum{stage=\"transfer_posted\"} 0.007",
            "stallwatch_stage_duration_seconds_sum{stage=\"transfer_done\"} 0.002",
            "stallwatch_stall_duration_seconds_count{class=\"release_lost\"} 1",
            "stallwatch_stall_duration_seconds_bucket{le=\"60.0\",class=\"release_lost\"} 0",
            "stallwatch_stall_duration_seconds_bucket{le=\"120.0\",class=\"release_lost\"} 1",
            "stallwatch_stall_duration_seconds_count{class=\"waiting_for_peer\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
        assert!(
            text.lines().any(|l| l.starts_with("stallwatch_build_info{version=\"") && l.ends_with("} 1")),
            "{text}"
        );
        assert!(text.lines().any(|l| l.starts_with("process_resident_memory_bytes ")), "{text}");
    }

    #[tokio::test]
    async fn serves_a_scrape_over_http() {
        let mut server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let addr = server.local_addr();
        let client = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text\r\n\r\n")
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
