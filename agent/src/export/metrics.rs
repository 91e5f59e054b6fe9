//! The Prometheus `/metrics` endpoint (off unless `--metrics-addr`): the
//! series here, the HTTP side (and `/healthz`, `/readyz`) in [`http`].
//!
//! Values are taken when a scrape arrives, on the event loop (which owns
//! the engine and the kernel maps): the HTTP side only forwards the scrape
//! and writes the answer. The in-flight gauges walk the tracked requests,
//! O(tracked) per scrape.
//!
//! The exposition format is written by `prometheus-client` (the Prometheus
//! project's Rust client): OpenMetrics text when the scraper asks for it
//! (`Accept: application/openmetrics-text`, as Prometheus does), the
//! classic 0.0.4 text format otherwise, with names, types, `_total`
//! suffixes and escaping done by the library.
//!
//! Durations are histograms in seconds (Prometheus base units), beside the
//! serving frameworks' own (`vllm:e2e_request_latency_seconds`,
//! `sglang:queue_time_seconds`): how long stalls lasted, how long requests
//! lived and how long they spent in each stage. Their labels are the
//! bounded enums of the engine (class, outcome, stage), never a request or
//! a process: the series count is fixed (see the metrics table in docs/telemetry.md).
//!
//! The series of what was judged (requests in flight and stalled, stalls,
//! recoveries, durations) carry the `profile` that judged it: one agent
//! watches every framework of its node, each process with its rule's
//! profile; the engine's totals and the agent's own health are the
//! agent's.
mod http;

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    sync::Arc,
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, TypedMetric as _, counter::ConstCounter, gauge::ConstGauge, histogram::Histogram},
    registry::{Registry, Unit},
};
use tracing::{debug, warn};

pub use self::http::{Ask, Format, MetricsServer, Scrape, parse_addr};
use super::otlp::ExportCounts;
use crate::{
    evidence::status::StatusReads,
    export::workload::Directory,
    kernel::ring::Losses,
    lifecycle::{Engine, EngineStats, Outcome, Report, Stage, StallClass},
    util::build_info,
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
/// recoveries, but not by class), and the duration histograms, by the
/// profile that judged them.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// The profile each watched process is watched with.
    profiles: HashMap<u32, Arc<str>>,
    /// What each profile judged, from its first process on (its series
    /// are there, at zero, from then).
    judged: BTreeMap<Arc<str>, Judged>,
}

/// What one profile judged.
#[derive(Debug, Clone, Default)]
struct Judged {
    stalls: [u64; CLASSES],
    recoveries: [u64; CLASSES],
    histograms: Histograms,
}

/// The profile of a request of a process never named (none: every watched
/// process is named before its first event).
const UNKNOWN_PROFILE: &str = "unknown";

/// Stall classes, each with its own series.
const CLASSES: usize = StallClass::ALL.len();

impl Metrics {
    /// `pid` is watched with `profile`: its requests count under it.
    pub fn name_process(&mut self, pid: u32, profile: &str) {
        let profile: Arc<str> = match self.judged.get_key_value(profile) {
            Some((known, _)) => Arc::clone(known),
            None => profile.into(),
        };
        self.judged.entry(Arc::clone(&profile)).or_default();
        self.profiles.insert(pid, profile);
    }

    /// The profile `pid`'s requests count under.
    fn profile(&self, pid: u32) -> Arc<str> {
        self.profiles.get(&pid).cloned().unwrap_or_else(|| UNKNOWN_PROFILE.into())
    }

    pub fn report(&mut self, report: &Report) {
        let judged = self.judged.entry(self.profile(report.request().pid)).or_default();
        match report {
            Report::Stalled { class, .. } => judged.stalls[*class as usize] += 1,
            Report::Recovered { class, stuck_ns, .. } => {
                judged.recoveries[*class as usize] += 1;
                judged.histograms.stall[*class as usize].observe(seconds(*stuck_ns));
            }
            Report::Ended { request, outcome, at_ns } => {
                let histograms = &judged.histograms;
                // Still stalled at its end (evicted, its process gone): the
                // stall lasted until then. A revived one was counted above.
                if let Some(class) = request.stalled {
                    histograms.stall[class as usize].observe(seconds(at_ns.saturating_sub(request.last_ns)));
                }
                if let Some(at) = Outcome::ALL.iter().position(|o| o == outcome) {
                    histograms.request[at].observe(seconds(at_ns.saturating_sub(request.first_ns)));
                }
                // Each live stage whose next stage was seen: its time.
                let next = [request.stage_ns[1], request.stage_ns[2], request.stage_ns[3].or(Some(*at_ns))];
                for (slot, (from, to)) in request.stage_ns.iter().take(3).zip(next).enumerate() {
                    if let (Some(from), Some(to)) = (from, to) {
                        histograms.stage[slot].observe(seconds(to.saturating_sub(*from)));
                    }
                }
            }
        }
    }

    /// Everything a scrape shows, as of now.
    pub fn snapshot(&self, engine: &Engine, losses: Option<Losses>, export: Option<ExportCounts>) -> Snapshot {
        let mut profiles: BTreeMap<Arc<str>, ProfileSeries> = self
            .judged
            .iter()
            .map(|(name, judged)| {
                let series = ProfileSeries {
                    in_flight: [0; 3],
                    stalled: [0; CLASSES],
                    stalls: judged.stalls,
                    recoveries: judged.recoveries,
                    histograms: judged.histograms.clone(),
                };
                (Arc::clone(name), series)
            })
            .collect();
        for request in engine.inflight() {
            let series = profiles.entry(self.profile(request.pid)).or_default();
            if let Some(slot) = request.stage.timestamp_slot().filter(|&slot| slot < 3) {
                series.in_flight[slot] += 1;
            }
            if let Some(class) = request.stalled {
                series.stalled[class as usize] += 1;
            }
        }
        Snapshot {
            engine: engine.stats(),
            profiles: profiles.into_iter().collect(),
            losses,
            export,
            status_reads: None,
            progress_probes: None,
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
    /// What each profile judged, by its name.
    pub profiles: Vec<(Arc<str>, ProfileSeries)>,
    /// `None` when the kernel's counters could not be read.
    pub losses: Option<Losses>,
    pub export: Option<ExportCounts>,
    /// How the reads of the profile's `[status]` went, when it has one.
    pub status_reads: Option<StatusReads>,
    /// Processes whose progress probes are attached now and those whose
    /// are not (attached only near a stall); `None`: no process has any.
    pub progress_probes: Option<[u64; 2]>,
    /// The agent's own process; `None` when /proc/self could not be read.
    pub process: Option<ProcessStats>,
    /// Requests stalled right now by workload and class: one series per
    /// (pod, container, class) with a stall now, none otherwise.
    pub workload_stalled: Vec<WorkloadStalled>,
    /// Alert lines dropped because stdout did not drain (the detections
    /// are all here and in the spans; only their human lines are lost).
    pub alert_lines_dropped: u64,
}

/// One profile's series in a scrape.
#[derive(Debug, Clone, Default)]
pub struct ProfileSeries {
    /// Tracked requests by stage: enqueued, transfer_posted, transfer_done.
    pub in_flight: [u64; 3],
    /// Tracked requests stuck right now, by class.
    pub stalled: [u64; CLASSES],
    pub stalls: [u64; CLASSES],
    pub recoveries: [u64; CLASSES],
    pub histograms: Histograms,
}

/// Requests of one workload stalled at one class right now, and the
/// profile that judged them.
pub type WorkloadStalled = ([(&'static str, String); 4], Arc<str>, StallClass, u64);

impl Metrics {
    /// The stalled requests now, by the workload of their process
    /// (processes with no known workload count under empty labels) and
    /// their profile.
    pub fn workload_stalled(&self, engine: &Engine, workloads: &Directory) -> Vec<WorkloadStalled> {
        type Key = ([(&'static str, String); 4], Arc<str>, usize);
        let mut counts: BTreeMap<Key, u64> = BTreeMap::new();
        for request in engine.inflight() {
            if let Some(class) = request.stalled {
                let labels = workloads
                    .get(request.pid)
                    .map(|w| w.labels())
                    .unwrap_or_else(|| crate::export::workload::Workload::default().labels());
                *counts.entry((labels, self.profile(request.pid), class as usize)).or_default() += 1;
            }
        }
        counts.into_iter().map(|((labels, profile, class), n)| (labels, profile, StallClass::ALL[class], n)).collect()
    }
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
        // A family of one profile-labelled series per (profile, value
        // label): `values` picks a profile's values, by label.
        let judged = |encoder: &mut DescriptorEncoder,
                      kind: MetricType,
                      name: &str,
                      help: &str,
                      label: &str,
                      values: &dyn Fn(&ProfileSeries) -> Vec<(&'static str, u64)>| {
            let mut family = encoder.encode_descriptor(name, help, None, kind)?;
            for (profile, series) in &self.profiles {
                for (value_label, value) in values(series) {
                    let labels = [("profile", &**profile), (label, value_label)];
                    match kind {
                        MetricType::Counter => ConstCounter::new(value).encode(family.encode_family(&labels)?)?,
                        _ => ConstGauge::new(value).encode(family.encode_family(&labels)?)?,
                    }
                }
            }
            Ok::<(), fmt::Error>(())
        };
        let classes = || StallClass::ALL.iter().map(|c| c.as_str());
        let stages = || Stage::LIVE.iter().map(|s| s.as_str());
        judged(
            &mut encoder,
            MetricType::Gauge,
            "stallwatch_requests_in_flight",
            "Requests tracked right now, by profile and furthest stage",
            "stage",
            &|series| stages().zip(series.in_flight).collect(),
        )?;
        judged(
            &mut encoder,
            MetricType::Gauge,
            "stallwatch_requests_stalled",
            "Requests stalled right now, by profile and class",
            "class",
            &|series| classes().zip(series.stalled).collect(),
        )?;

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
        judged(
            &mut encoder,
            MetricType::Counter,
            "stallwatch_stalls",
            "Stalls reported (silence episodes past the timeout), by profile and class",
            "class",
            &|series| classes().zip(series.stalls).collect(),
        )?;
        judged(
            &mut encoder,
            MetricType::Counter,
            "stallwatch_recoveries",
            "Stalled requests that moved on, by profile and the class they had",
            "class",
            &|series| classes().zip(series.recoveries).collect(),
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
        let histograms = |encoder: &mut DescriptorEncoder,
                          name: &str,
                          help: &str,
                          label: &str,
                          values: &dyn Fn(&Histograms) -> Vec<(&'static str, Histogram)>| {
            let mut family = encoder.encode_descriptor(name, help, Some(&Unit::Seconds), Histogram::TYPE)?;
            for (profile, series) in &self.profiles {
                for (value_label, histogram) in values(&series.histograms) {
                    histogram.encode(family.encode_family(&[("profile", &**profile), (label, value_label)])?)?;
                }
            }
            Ok::<(), fmt::Error>(())
        };
        histograms(
            &mut encoder,
            "stallwatch_stall_duration",
            "How long stalls lasted (last event to the reviving event, or to the end while stalled), by profile and class",
            "class",
            &|h| classes().zip(h.stall.iter().cloned()).collect(),
        )?;
        histograms(
            &mut encoder,
            "stallwatch_request_duration",
            "Request lifetimes (first event to end), by profile and outcome",
            "outcome",
            &|h| Outcome::ALL.iter().map(|o| o.as_str()).zip(h.request.iter().cloned()).collect(),
        )?;
        histograms(
            &mut encoder,
            "stallwatch_stage_duration",
            "Time requests spent in a stage before the next one (enqueued: waiting for the peer; transfer_posted: the transfer; transfer_done: the release), by profile and stage",
            "stage",
            &|h| stages().zip(h.stage.iter().cloned()).collect(),
        )?;
        if !self.workload_stalled.is_empty() {
            let mut family = encoder.encode_descriptor(
                "stallwatch_workload_requests_stalled",
                "Requests stalled right now, by the watched workload (namespace, owner, pod, container), profile and class",
                None,
                MetricType::Gauge,
            )?;
            for (labels, profile, class, n) in &self.workload_stalled {
                let labels: Vec<(&str, &str)> = labels
                    .iter()
                    .map(|(k, v)| (*k, v.as_str()))
                    .chain([("profile", &**profile), ("class", class.as_str())])
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
        metrics.name_process(1, "demo");
        // A profile whose processes judged nothing yet has its series, at zero.
        metrics.name_process(2, "nixl");
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
            "stallwatch_requests_in_flight{profile=\"demo\",stage=\"transfer_posted\"} 2",
            "stallwatch_requests_in_flight{profile=\"demo\",stage=\"enqueued\"} 1",
            "stallwatch_requests_in_flight{profile=\"nixl\",stage=\"enqueued\"} 0",
            "stallwatch_requests_stalled{profile=\"demo\",class=\"transfer_hung\"} 2",
            "stallwatch_stalls_total{profile=\"demo\",class=\"transfer_hung\"} 1",
            "stallwatch_stalls_total{profile=\"demo\",class=\"release_lost\"} 0",
            "stallwatch_stalls_total{profile=\"demo\",class=\"waiting_for_kv\"} 1",
            "stallwatch_stalls_total{profile=\"nixl\",class=\"waiting_for_kv\"} 0",
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
        assert!(classic.contains("stallwatch_stalls_total{profile=\"demo\",class=\"transfer_hung\"} 1"), "{classic}");
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
        metrics.name_process(1, "demo");
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
        outcomes.name_process(1, "demo");
        for outcome in Outcome::ALL {
            outcomes.report(&Report::Ended { request: request.clone(), outcome, at_ns: request.first_ns + 5 * ms });
        }
        let text = render(outcomes.snapshot(&engine, None, None), Format::OpenMetrics);
        for outcome in Outcome::ALL {
            let line = format!(
                "stallwatch_request_duration_seconds_count{{profile=\"demo\",outcome=\"{}\"}} 1",
                outcome.as_str()
            );
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
        metrics.report(&Report::Recovered { request, class: StallClass::ReleaseLost, stuck_ns: 90_000 * ms });
        let text = render(metrics.snapshot(&engine, None, None), Format::OpenMetrics);
        for line in [
            "# TYPE stallwatch_request_duration_seconds histogram",
            "# UNIT stallwatch_request_duration_seconds seconds",
            "stallwatch_request_duration_seconds_count{profile=\"demo\",outcome=\"released\"} 1",
            "stallwatch_request_duration_seconds_sum{profile=\"demo\",outcome=\"released\"} 0.012",
            "stallwatch_stage_duration_seconds_sum{profile=\"demo\",stage=\"enqueued\"} 0.003",
            "stallwatch_stage_duration_seconds_sum{profile=\"demo\",stage=\"transfer_posted\"} 0.007",
            "stallwatch_stage_duration_seconds_sum{profile=\"demo\",stage=\"transfer_done\"} 0.002",
            "stallwatch_stall_duration_seconds_count{profile=\"demo\",class=\"release_lost\"} 1",
            "stallwatch_stall_duration_seconds_bucket{le=\"60.0\",profile=\"demo\",class=\"release_lost\"} 0",
            "stallwatch_stall_duration_seconds_bucket{le=\"120.0\",profile=\"demo\",class=\"release_lost\"} 1",
            "stallwatch_stall_duration_seconds_count{profile=\"demo\",class=\"waiting_for_peer\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
        assert!(
            text.lines().any(|l| l.starts_with("stallwatch_build_info{version=\"") && l.ends_with("} 1")),
            "{text}"
        );
        assert!(text.lines().any(|l| l.starts_with("process_resident_memory_bytes ")), "{text}");
    }
}
