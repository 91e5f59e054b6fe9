//! Everything besides the alert lines that reports feed: OTLP spans and the
//! Prometheus metrics. The event loop owns one [`Telemetry`] and calls it
//! with every report; nothing here blocks.
use std::net::SocketAddr;

use anyhow::Result;
use tracing::{info, warn};

use super::{
    metrics::{self, Ask, Metrics, MetricsServer, Scrape},
    otlp::{self, ExportCounts, ExportSettings, OtlpExporter, OtlpOptions, Protocol},
};
use crate::{
    evidence::status::StatusReads,
    evidence::transport::Evidence,
    export::workload::{self, Directory},
    kernel::Probes,
    kernel::ring::Losses,
    lifecycle::{Context, Engine, Report},
    util::clock::Clock,
};

/// The `stallwatch run` flags for spans and metrics.
#[derive(Debug, Clone, Default)]
pub struct TelemetryOptions {
    pub otlp: OtlpOptions,
    /// `--metrics-addr`; `None`: no metrics endpoint.
    pub metrics_addr: Option<SocketAddr>,
    /// `--kubernetes`: where watched processes' pods are looked up.
    pub kubernetes: workload::Source,
}

pub struct Telemetry {
    otlp: Option<OtlpExporter>,
    metrics: Metrics,
    server: Option<MetricsServer>,
    workloads: Directory,
}

impl Telemetry {
    /// Start the exporter and the metrics endpoint the options ask for.
    pub async fn start(options: &TelemetryOptions, clock: Clock) -> Result<Self> {
        let workloads = Directory::new(options.kubernetes.clone())?;
        let env = |name: &str| std::env::var(name).ok();
        if let Some(why) = otlp::sampling::disabled_by(&env)? {
            info!("span export is off: {why}");
        }
        let otlp = match options.otlp.resolve()? {
            Some(target) => {
                if target.protocol == Protocol::HttpProtobuf && target.endpoint.contains(":4317") {
                    warn!(
                        endpoint = %target.endpoint,
                        "OTLP over HTTP to port 4317, the gRPC port by convention: pass --otlp-protocol grpc if the collector speaks gRPC there"
                    );
                }
                let sampler = otlp::sampling::SpanSampler::from_env(&|name: &str| std::env::var(name).ok())?;
                info!(sampler = %sampler.name, "span sampler (OTEL_TRACES_SAMPLER)");
                let settings =
                    ExportSettings { workloads: Some(workloads.clone()), sampler, ..ExportSettings::default() };
                let exporter = OtlpExporter::start(target, otlp::config::host_name(), clock, settings)?;
                let target = exporter.target();
                info!(endpoint = %target.endpoint, protocol = %target.protocol, from = target.source, "exporting spans over OTLP");
                Some(exporter)
            }
            None => None,
        };
        let server = match options.metrics_addr {
            Some(addr) => {
                let server = MetricsServer::bind(addr).await?;
                info!(addr = %server.local_addr(), "serving metrics at /metrics");
                Some(server)
            }
            None => None,
        };
        Ok(Self { otlp, metrics: Metrics::default(), server, workloads })
    }

    /// The watched processes' workloads (alerts name them too).
    pub fn workloads(&self) -> Directory {
        self.workloads.clone()
    }

    /// Name a watched process and the profile it is watched with (spans
    /// carry `process.executable.name` and `stallwatch.profile`, its metric
    /// series `profile`), and look its workload up in the background: the
    /// cgroup at once, the pod from the node's watched pods when
    /// `--kubernetes` names an API (again as they change, while its pod is
    /// not known yet).
    pub fn name_process(&mut self, pid: u32, profile: &str) {
        if let Some(otlp) = &self.otlp {
            otlp.name_process(pid, &executable_name(pid), profile);
        }
        self.metrics.name_process(pid, profile);
        let workloads = self.workloads.clone();
        tokio::spawn(async move {
            workloads.resolve(pid).await;
        });
    }

    /// Count a report and queue it for export, with the transport evidence
    /// a stall carries and its `context`, what is said of where it stopped.
    pub fn report(&mut self, report: Report, evidence: Option<Evidence>, context: Context) {
        self.metrics.report(&report);
        if let Some(otlp) = &self.otlp {
            otlp.report(report, evidence, context);
        }
    }

    /// `/readyz` says ready from now on (no-op without a metrics endpoint).
    pub fn set_ready(&self) {
        if let Some(server) = &self.server {
            server.set_ready();
        }
    }

    /// The next metrics scrape; never resolves without a metrics endpoint.
    pub async fn scrape(&mut self) -> Scrape {
        match &mut self.server {
            Some(server) => match server.next().await {
                Some(scrape) => scrape,
                None => std::future::pending().await,
            },
            None => std::future::pending().await,
        }
    }

    /// Answer a scrape with the current values; `undecodable`: the
    /// ring-buffer records that did not become events so far; `status`:
    /// how the `[status]` reads went, when the profile has one.
    /// `alert_drops`: alert lines dropped because stdout did not drain.
    pub fn answer(
        &self,
        scrape: Scrape,
        engine: &Engine,
        probes: &Probes,
        undecodable: u64,
        status: Option<StatusReads>,
        alert_drops: u64,
    ) {
        let format = match scrape.ask {
            Ask::Metrics(format) => format,
            Ask::Health => return scrape.answer("ok\n".to_owned()),
        };
        let losses = probes
            .counters()
            .map_err(|err| warn!("metrics: {err:#}"))
            .ok()
            .map(|kernel| Losses { kernel, undecodable });
        let export = self.otlp.as_ref().map(OtlpExporter::counts);
        let mut snapshot = self.metrics.snapshot(engine, losses, export);
        snapshot.workload_stalled = self.metrics.workload_stalled(engine, &self.workloads);
        snapshot.status_reads = status;
        snapshot.alert_lines_dropped = alert_drops;
        let mut gates = probes.gates().peekable();
        if gates.peek().is_some() {
            snapshot.progress_probes =
                Some(gates.fold([0, 0], |[on, off], (_, open)| if open { [on + 1, off] } else { [on, off + 1] }));
        }
        scrape.answer(metrics::render(snapshot, format));
    }

    /// Flush and stop the exporter; the export counts, for the summary.
    pub fn finish(self) -> ExportCounts {
        match self.otlp {
            Some(otlp) => {
                let counts = otlp.shutdown(otlp::SHUTDOWN_GRACE);
                info!(exported = counts.exported, dropped = counts.dropped(), "OTLP export finished");
                counts
            }
            None => ExportCounts::default(),
        }
    }
}

/// The base name of `/proc/PID/exe` (the semantic conventions'
/// `process.executable.name`), else the kernel's `comm`.
fn executable_name(pid: u32) -> String {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .and_then(|path| path.file_name().map(|name| name.to_string_lossy().trim_end_matches(" (deleted)").to_owned()))
        .or_else(|| std::fs::read_to_string(format!("/proc/{pid}/comm")).ok().map(|comm| comm.trim().to_owned()))
        .unwrap_or_else(|| "?".to_owned())
}
