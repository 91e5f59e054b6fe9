//! OTLP trace export, off the event path.
//!
//! The event loop hands each [`Report`] to [`OtlpExporter::report`], which
//! only moves it into a bounded queue (`try_send`: never waits, never
//! allocates beyond the report itself). A dedicated thread with its own
//! tokio runtime drains the queue, turns reports into spans
//! ([`spans::SpanMaker`]), batches them and sends them with the
//! `opentelemetry-otlp` exporter (gRPC or HTTP/protobuf), which retries
//! with exponential backoff within the export timeout
//! (`OTEL_EXPORTER_OTLP_TIMEOUT`, 10 s by default). A collector that is
//! down or slow therefore costs the event path nothing: the queue fills,
//! further reports are dropped and counted ([`ExportCounts`]), and the agent
//! keeps detecting and alerting.
//!
//! The export thread does not wait on the queue itself: it wakes every
//! [`POLL_INTERVAL`] to drain it, so an enqueue is a lock-free push with
//! no cross-thread wake-up (no syscall on the event path). Only a stall
//! report also rings a [`Notify`], and its span is sent at once; other
//! spans wait up to [`BATCH_DELAY`] or until [`MAX_BATCH`] have gathered.
//!
//! Each span goes out under the resource of the process it is about
//! ([`resources`]): a batch is sent as one request per process in it.
pub mod config;
pub mod connection;
pub mod names;
pub mod resources;
pub mod sampling;
pub mod spans;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
        mpsc as std_mpsc,
    },
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow};
use opentelemetry_sdk::trace::{SpanData, SpanExporter as _};
use tokio::{
    sync::{Notify, mpsc, mpsc::error::TryRecvError, watch},
    task::JoinSet,
    time::Instant,
};
use tracing::{debug, info, warn};

pub use self::config::{OtlpOptions, OtlpTarget, Protocol};
use self::{connection::Connection, resources::Resources, sampling::SpanSampler, spans::SpanMaker};
use crate::util::{
    clock::Clock,
    warned::{Repeated, Say},
};
use crate::{
    evidence::transport::Evidence,
    export::workload::Directory,
    lifecycle::{Context, Report},
};

/// How often a failing export is said again (with the count of batches
/// that failed since): an untrusted collector certificate fails every
/// export, several a second.
const FAILURE_REMINDER: Duration = Duration::from_secs(60);

/// Reports the queue holds; beyond it they are dropped (and counted).
pub const QUEUE_CAPACITY: usize = 16_384;
/// Most spans per export request.
pub const MAX_BATCH: usize = 512;
/// Longest a span waits for its batch to fill (stall spans never wait).
pub const BATCH_DELAY: Duration = Duration::from_millis(500);
/// How often the export thread drains the queue when nothing is urgent.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Export requests under way at once. One at a time, each request waits
/// out the collector's answer: against rotel over gRPC that took ~43 ms a
/// batch of 512 whatever the HTTP/2 window (the 40 ms of a delayed ACK
/// meeting Nagle's algorithm, by its look), 12-25 k spans/s. Several in
/// flight on the one HTTP/2 connection (or HTTP/1.1 pool) keep the link
/// busy meanwhile; a collector that answers at once loses nothing by it.
pub const MAX_IN_FLIGHT: usize = 16;
/// How long the agent waits at exit for queued spans to go out.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// What [`OtlpExporter::start`] needs besides the target.
#[derive(Debug, Clone)]
pub struct ExportSettings {
    pub queue_capacity: usize,
    pub max_batch: usize,
    pub batch_delay: Duration,
    /// The watched processes' workloads: their spans' resources name them.
    pub workloads: Option<Directory>,
    /// `OTEL_TRACES_SAMPLER`: which spans are sent.
    pub sampler: SpanSampler,
}

impl Default for ExportSettings {
    fn default() -> Self {
        Self {
            queue_capacity: QUEUE_CAPACITY,
            max_batch: MAX_BATCH,
            batch_delay: BATCH_DELAY,
            workloads: None,
            sampler: SpanSampler::default(),
        }
    }
}

enum Msg {
    Process(u32, Box<str>, Box<str>),
    /// Evidence is rare (stalls only) and large: boxed; the context is
    /// most often empty (see [`SpanMaker::push`]).
    Report(Report, Option<Box<Evidence>>, Context),
}

#[derive(Default)]
struct Counters {
    exported: AtomicU64,
    queue_full: AtomicU64,
    export_failed: AtomicU64,
    failed_batches: AtomicU64,
    sampled_out: AtomicU64,
}

impl Counters {
    fn snapshot(&self, queued: u64, capacity: usize) -> ExportCounts {
        ExportCounts {
            exported: self.exported.load(Ordering::Relaxed),
            dropped_queue_full: self.queue_full.load(Ordering::Relaxed),
            dropped_export_failed: self.export_failed.load(Ordering::Relaxed),
            sampled_out: self.sampled_out.load(Ordering::Relaxed),
            failed_batches: self.failed_batches.load(Ordering::Relaxed),
            queued,
            queue_capacity: capacity as u64,
        }
    }
}

/// Export counters, for the metrics and the end-of-run summary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportCounts {
    /// Spans the collector accepted.
    pub exported: u64,
    /// Reports dropped because the queue was full.
    pub dropped_queue_full: u64,
    /// Spans given up on: export failed after its retries, or still queued
    /// when the agent exited and the collector did not take them in time.
    pub dropped_export_failed: u64,
    /// Export requests that failed after their retries.
    pub failed_batches: u64,
    /// Spans the sampler (`OTEL_TRACES_SAMPLER`) kept out: not lost.
    pub sampled_out: u64,
    /// Reports waiting in the queue right now.
    pub queued: u64,
    /// The queue's capacity.
    pub queue_capacity: u64,
}

impl ExportCounts {
    /// Everything that did not reach the collector.
    pub fn dropped(&self) -> u64 {
        self.dropped_queue_full + self.dropped_export_failed
    }
}

/// The event loop's end of the export queue.
pub struct OtlpExporter {
    tx: mpsc::Sender<Msg>,
    /// Rung for stall reports and at exit: the export thread drains now.
    wake: Arc<Notify>,
    counters: Arc<Counters>,
    capacity: usize,
    shutdown: watch::Sender<Option<Instant>>,
    done: std_mpsc::Receiver<()>,
    thread: thread::JoinHandle<()>,
    target: OtlpTarget,
}

impl OtlpExporter {
    /// Build the exporter for `target` on its own thread and return once it
    /// is ready (or failed to build, e.g. an invalid header variable).
    pub fn start(target: OtlpTarget, host: String, clock: Clock, settings: ExportSettings) -> Result<Self> {
        let capacity = settings.queue_capacity.max(1);
        let (tx, rx) = mpsc::channel(capacity);
        let counters = Arc::new(Counters::default());
        let (shutdown, shutdown_rx) = watch::channel(None);
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let (done_tx, done) = std_mpsc::channel();
        let wake = Arc::new(Notify::new());
        let thread_wake = Arc::clone(&wake);
        let thread_counters = Arc::clone(&counters);
        let thread_target = target.clone();
        let thread = thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(err) => {
                        let _ = ready_tx.send(Err(anyhow!(err).context("starting the OTLP export thread's runtime")));
                        return;
                    }
                };
                runtime.block_on(async move {
                    // Building one exporter checks the headers and the
                    // endpoint before the agent goes on.
                    let connection = Connection::open(&thread_target);
                    let resources = match connection.and_then(|c| c.exporter().map(|_| c)) {
                        Ok(connection) => {
                            Resources::new(connection, config::resource(&host), settings.workloads.clone())
                        }
                        Err(err) => {
                            let _ = ready_tx.send(Err(err));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    let pump = Pump {
                        resources,
                        maker: SpanMaker::new(host, clock).with_sampler(settings.sampler.clone()),
                        counters: thread_counters,
                        settings,
                        shutdown: shutdown_rx,
                        target: thread_target,
                        failing: Repeated::new(FAILURE_REMINDER),
                        in_flight: JoinSet::new(),
                        in_flight_spans: 0,
                    };
                    pump.run(rx, thread_wake).await;
                });
                let _ = done_tx.send(());
            })
            .context("spawning the OTLP export thread")?;
        ready_rx.recv().map_err(|_| anyhow!("the OTLP export thread died while starting"))?.with_context(|| {
            format!(
                "setting up OTLP/{} export to {} (from {}): check the endpoint and the OTEL_EXPORTER_OTLP_* variables",
                target.protocol, target.endpoint, target.source
            )
        })?;
        Ok(Self { tx, wake, counters, capacity, shutdown, done, thread, target })
    }

    pub fn target(&self) -> &OtlpTarget {
        &self.target
    }

    /// Tell the span maker the executable name of `pid` and the profile
    /// it is watched with.
    pub fn name_process(&self, pid: u32, executable: &str, profile: &str) {
        if self.tx.try_send(Msg::Process(pid, executable.into(), profile.into())).is_err() {
            debug!(pid, "export queue full: process name not sent");
        }
    }

    /// Queue a report for export; never blocks. A full queue drops it and
    /// counts the drop.
    pub fn report(&self, report: Report, evidence: Option<Evidence>, context: Context) {
        let urgent = matches!(report, Report::Stalled { .. });
        if self.tx.try_send(Msg::Report(report, evidence.map(Box::new), context)).is_err() {
            self.counters.queue_full.fetch_add(1, Ordering::Relaxed);
        } else if urgent {
            self.wake.notify_one();
        }
    }

    pub fn counts(&self) -> ExportCounts {
        let queued = self.capacity.saturating_sub(self.tx.capacity()) as u64;
        self.counters.snapshot(queued, self.capacity)
    }

    /// Send what is queued, waiting at most `grace`, then stop the thread.
    /// What could not be sent in time counts as dropped.
    pub fn shutdown(self, grace: Duration) -> ExportCounts {
        let queued = self.counts().queued;
        let OtlpExporter { tx, wake, counters, capacity, shutdown, done, thread, .. } = self;
        let _ = shutdown.send(Some(Instant::now() + grace));
        // Closing the queue tells the thread to flush and finish.
        drop(tx);
        wake.notify_one();
        // The thread gives up exporting at the deadline; allow it a moment
        // past that to count what it dropped.
        match done.recv_timeout(grace + Duration::from_millis(500)) {
            Ok(()) => {
                let _ = thread.join();
            }
            Err(_) => {
                warn!("the OTLP export thread did not finish in time; {queued} queued reports are lost");
                counters.export_failed.fetch_add(queued, Ordering::Relaxed);
            }
        }
        counters.snapshot(0, capacity)
    }
}

/// The export thread's loop.
struct Pump {
    resources: Resources,
    maker: SpanMaker,
    counters: Arc<Counters>,
    settings: ExportSettings,
    shutdown: watch::Receiver<Option<Instant>>,
    target: OtlpTarget,
    /// Export failures: the first said, then one line a
    /// [`FAILURE_REMINDER`] with their count, and the next success.
    failing: Repeated,
    /// The exports under way: each says how many spans it carries and how
    /// it went.
    in_flight: JoinSet<(u64, Result<(), String>)>,
    in_flight_spans: u64,
}

impl Pump {
    async fn run(mut self, mut rx: mpsc::Receiver<Msg>, wake: Arc<Notify>) {
        let max_batch = self.settings.max_batch.max(1);
        let mut batch = Batch::with_capacity(max_batch);
        let mut flush_at: Option<Instant> = None;
        loop {
            // Never await the queue (that would make every enqueue wake this
            // thread): sleep until the next poll, a stall, or exit.
            tokio::select! {
                () = tokio::time::sleep(POLL_INTERVAL) => {}
                () = wake.notified() => {}
            }
            self.settle_finished();
            let mut urgent = false;
            let mut closed = false;
            loop {
                match rx.try_recv() {
                    Ok(Msg::Process(pid, name, profile)) => {
                        self.maker.name_process(pid, &name, &profile);
                        self.resources.name_process(pid, &name);
                    }
                    Ok(Msg::Report(report, evidence, context)) => {
                        let pid = report.request().pid;
                        urgent |= self.maker.push(report, evidence.map(|e| *e), &context, &mut batch.spans);
                        // The spans it made are the ones past the pids.
                        batch.pids.resize(batch.spans.len(), pid);
                        self.counters.sampled_out.store(self.maker.sampled_out(), Ordering::Relaxed);
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                }
                if batch.spans.len() >= max_batch {
                    self.send(std::mem::replace(&mut batch, Batch::with_capacity(max_batch))).await;
                    flush_at = None;
                }
            }
            if batch.spans.is_empty() {
                flush_at = None;
            } else if urgent || closed || flush_at.is_some_and(|at| at <= Instant::now()) {
                self.send(std::mem::replace(&mut batch, Batch::with_capacity(max_batch))).await;
                flush_at = None;
            } else if flush_at.is_none() {
                flush_at = Some(Instant::now() + self.settings.batch_delay);
            }
            if closed {
                break;
            }
        }
        while self.settle_next().await {}
    }

    /// Send a batch: one request per process in it, each under its
    /// process's resource.
    async fn send(&mut self, batch: Batch) {
        for (pid, spans) in batch.by_process() {
            self.send_process(pid, spans).await;
        }
    }

    /// Start the export of `spans` of `pid`, once fewer than
    /// [`MAX_IN_FLIGHT`] are under way.
    async fn send_process(&mut self, pid: u32, spans: Vec<SpanData>) {
        let n = spans.len() as u64;
        let exporter = match self.resources.exporter(pid) {
            Ok(exporter) => exporter,
            Err(err) => {
                warn!(pid, "OTLP export: {err:#}");
                self.settled(n, Err(err.to_string()));
                return;
            }
        };
        while self.in_flight.len() >= MAX_IN_FLIGHT {
            if !self.settle_next().await {
                break;
            }
        }
        self.in_flight_spans += n;
        let causes = self.resources.causes();
        self.in_flight.spawn(async move {
            let result = exporter.export(spans).await;
            (n, result.map_err(|err| causes.map_or_else(|| err.to_string(), |causes| causes.explain(&err))))
        });
    }

    /// Count the exports that have finished, without waiting.
    fn settle_finished(&mut self) {
        while let Some(done) = self.in_flight.try_join_next() {
            self.joined(done);
        }
    }

    /// Wait for the next export to finish (at exit, no longer than the
    /// grace period: then the rest are given up and counted). False when
    /// none is under way any more.
    async fn settle_next(&mut self) -> bool {
        let mut shutdown = self.shutdown.clone();
        tokio::select! {
            done = self.in_flight.join_next() => match done {
                Some(done) => {
                    self.joined(done);
                    true
                }
                None => false,
            },
            () = until_deadline(&mut shutdown) => {
                self.in_flight.abort_all();
                self.in_flight.detach_all();
                let n = std::mem::take(&mut self.in_flight_spans);
                self.settled(n, Err("the agent is exiting and the grace period ran out".to_owned()));
                false
            }
        }
    }

    fn joined(&mut self, done: Result<(u64, Result<(), String>), tokio::task::JoinError>) {
        match done {
            Ok((n, result)) => {
                self.in_flight_spans -= n;
                self.settled(n, result);
            }
            // Export tasks are only aborted after their spans were counted.
            Err(err) => debug!("OTLP export task ended: {err}"),
        }
    }

    fn settled(&mut self, n: u64, result: Result<(), String>) {
        match result {
            Ok(()) => {
                self.counters.exported.fetch_add(n, Ordering::Relaxed);
                if self.failing.ended() {
                    info!(endpoint = %self.target.endpoint, "OTLP export works again");
                }
            }
            Err(err) => {
                self.counters.export_failed.fetch_add(n, Ordering::Relaxed);
                self.counters.failed_batches.fetch_add(1, Ordering::Relaxed);
                let hint =
                    if self.target.is_tls() { format!("; {}", connection::UNTRUSTED_HINT) } else { String::new() };
                match self.failing.failed(Instant::now().into_std()) {
                    Say::Started => warn!(
                        endpoint = %self.target.endpoint,
                        protocol = %self.target.protocol,
                        spans = n,
                        "OTLP export failed after retries: {err}{hint}; spans are dropped (and counted) until the collector answers"
                    ),
                    Say::Again(batches) => warn!(
                        endpoint = %self.target.endpoint,
                        batches,
                        "OTLP export still failing: {batches} more batches failed in the last {}s: {err}{hint}",
                        FAILURE_REMINDER.as_secs()
                    ),
                    Say::Quiet => debug!(spans = n, "OTLP export failed again: {err}"),
                }
            }
        }
    }
}

/// Spans waiting to be sent, and the process each is about.
struct Batch {
    spans: Vec<SpanData>,
    /// `pids[i]` is the process of `spans[i]`.
    pids: Vec<u32>,
}

impl Batch {
    fn with_capacity(n: usize) -> Self {
        Self { spans: Vec::with_capacity(n), pids: Vec::with_capacity(n) }
    }

    /// The spans by process, each process's in the order they came.
    fn by_process(self) -> Vec<(u32, Vec<SpanData>)> {
        let mut parts: Vec<(u32, Vec<SpanData>)> = Vec::new();
        for (pid, span) in self.pids.into_iter().zip(self.spans) {
            match parts.iter_mut().find(|(p, _)| *p == pid) {
                Some((_, spans)) => spans.push(span),
                None => parts.push((pid, vec![span])),
            }
        }
        parts
    }
}

/// Resolves when a shutdown deadline is set and has passed.
async fn until_deadline(shutdown: &mut watch::Receiver<Option<Instant>>) {
    loop {
        let deadline = *shutdown.borrow_and_update();
        if let Some(at) = deadline {
            tokio::time::sleep_until(at).await;
            return;
        }
        if shutdown.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
