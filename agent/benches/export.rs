//! Benchmark of OTLP export, against a real collector (rotel, from the test
//! venv) on loopback.
//!
//! Prints, in one run:
//! 1. export throughput in spans/s over gRPC and over HTTP/protobuf: request
//!    spans of synthetic healthy lifecycles (4 stage events, 5 attributes
//!    each), pushed through the agent's queue, export thread and the
//!    `opentelemetry-otlp` exporter into rotel (blackhole exporter), timed
//!    until the collector has acknowledged every one;
//! 2. the event-path cost of export, off and on side by side: the loop's
//!    per-request work (4 observations into the engine, the reports to the
//!    alert writer, the metrics and, when on, the export queue), in ns per
//!    request of the loop thread's CPU time and of wall time (wall time
//!    includes being preempted by the export thread and the collector on
//!    a small machine), timed in chunks that never let the queue fill (so
//!    "on" is the real enqueue cost, not the cheaper drop path); and the
//!    enqueue alone (`OtlpExporter::report`) in ns per report.
//!
//! Run: `cargo bench -p stallwatch --bench export` (about 20 s; needs the
//! venv from `cargo run --release -p xtask -- setup --python`, or
//! `STALLWATCH_ROTEL=/path/to/rotel-agent`). Without `--bench` (as under
//! `cargo test --all-targets`) it runs a short smoke version, which fails
//! without rotel and unless the collector acknowledged every span.
use std::{
    hint::black_box,
    io,
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use stallwatch::{
    export::{
        alert::{AlertWriter, Format},
        metrics::Metrics,
        otlp::{ExportSettings, MAX_IN_FLIGHT, OtlpExporter, OtlpTarget, Protocol},
    },
    lifecycle::{Context, Engine, EngineConfig, Observation, Report, Stage},
    util::clock::Clock,
};

fn main() {
    let full = std::env::args().any(|arg| arg == "--bench");
    let Some(rotel) = rotel_bin() else {
        eprintln!(
            "export bench: no rotel-agent (the OTLP collector it exports to) under the venv (STALLWATCH_VENV): \
             create it with `cargo run --release -p xtask -- setup --python`, or set STALLWATCH_ROTEL"
        );
        std::process::exit(1);
    };
    let spans = if full { 200_000 } else { 5_000 };
    let requests = if full { 400_000 } else { 10_000 };
    let collector = Rotel::start(&rotel);

    println!(
        "export throughput ({spans} request spans, batches of {}, up to {MAX_IN_FLIGHT} requests in flight):",
        ExportSettings::default().max_batch
    );
    let mut rates = Vec::new();
    for (protocol, endpoint) in [
        (Protocol::Grpc, format!("http://127.0.0.1:{}", collector.grpc)),
        (Protocol::HttpProtobuf, format!("http://127.0.0.1:{}/v1/traces", collector.http)),
    ] {
        let (rate, dropped) = throughput(protocol, &endpoint, spans);
        println!("  {:<14} {:>10.0} spans/s   (dropped {dropped})", protocol.as_str(), rate);
        // The smoke run's few spans never fill the queue: a drop is a
        // failed export, and this run would not have measured one.
        assert!(full || dropped == 0, "{}: rotel did not acknowledge {dropped} of {spans} spans", protocol.as_str());
        rates.push(rate);
    }
    println!("  http/protobuf : grpc = {:.2}x", rates[1] / rates[0]);

    println!(
        "event-path cost per request (4 events, engine + alerts + metrics [+ export queue]), {requests} requests:"
    );
    let off = event_path(None, requests);
    let grpc = format!("http://127.0.0.1:{}", collector.grpc);
    let on = event_path(Some(&grpc), requests);
    println!("               {:>14} {:>14}", "thread CPU", "wall");
    println!("  export off   {:>9.0} ns/req {:>9.0} ns/req", off.cpu, off.wall);
    println!("  export on    {:>9.0} ns/req {:>9.0} ns/req   (OTLP/gRPC to rotel)", on.cpu, on.wall);
    println!("  difference   {:>+9.0} ns/req {:>+9.0} ns/req", on.cpu - off.cpu, on.wall - off.wall);
    let enqueue = enqueue_cost(&grpc, requests);
    println!("  enqueue alone (OtlpExporter::report) {enqueue:.0} ns/report (thread CPU)");
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

struct Cost {
    cpu: f64,
    wall: f64,
}

/// ns of thread CPU per `report` call, the queue kept from filling.
fn enqueue_cost(endpoint: &str, n: u64) -> f64 {
    let exporter = exporter(Protocol::Grpc, endpoint);
    let mut busy = Duration::ZERO;
    let mut done = 0;
    let chunk = 1_000;
    let mut reports = Vec::with_capacity(chunk as usize);
    while done < n {
        while exporter.counts().queued > exporter.counts().queue_capacity / 2 {
            thread::sleep(Duration::from_micros(200));
        }
        reports.extend((done..done + chunk).map(ended));
        let started = thread_cpu();
        for report in reports.drain(..) {
            exporter.report(report, None, Context::default());
        }
        busy += thread_cpu() - started;
        done += chunk;
    }
    let counts = exporter.shutdown(Duration::from_secs(5));
    assert_eq!(counts.dropped_queue_full, 0, "{counts:?}");
    busy.as_nanos() as f64 / done as f64
}

/// Spans/s from first enqueue to the last acknowledgement, and drops.
fn throughput(protocol: Protocol, endpoint: &str, n: u64) -> (f64, u64) {
    let exporter = exporter(protocol, endpoint);
    let mut reports = Vec::new();
    let started = Instant::now();
    let mut sent = 0;
    while sent < n {
        // Keep the queue from overflowing: this measures the exporter, not
        // the drop path.
        if exporter.counts().queued > exporter.counts().queue_capacity / 2 {
            thread::sleep(Duration::from_micros(200));
            continue;
        }
        for _ in 0..256.min(n - sent) {
            reports.push(ended(sent));
            sent += 1;
        }
        for report in reports.drain(..) {
            exporter.report(report, None, Context::default());
        }
    }
    while exporter.counts().exported + exporter.counts().dropped() < n {
        assert!(started.elapsed() < Duration::from_secs(120), "export stalled: {:?}", exporter.counts());
        thread::sleep(Duration::from_millis(1));
    }
    let elapsed = started.elapsed();
    let counts = exporter.shutdown(Duration::from_secs(5));
    (counts.exported as f64 / elapsed.as_secs_f64(), counts.dropped())
}

/// Mean ns per request of the event loop's work, with export on or off.
fn event_path(endpoint: Option<&str>, n: u64) -> Cost {
    let exporter = endpoint.map(|endpoint| exporter(Protocol::Grpc, endpoint));
    let mut engine =
        Engine::new(EngineConfig { timeout_ns: 60_000_000_000, max_tracked: 1_000_000, tick_ns: 10_000_000 });
    let mut alerts = AlertWriter::new(io::sink(), Format::Json, Clock::new());
    let mut metrics = Metrics::default();
    let mut reports = Vec::new();
    let (mut cpu, mut wall) = (Duration::ZERO, Duration::ZERO);
    let chunk = 1_000;
    let mut id = 0;
    // Warm-up, untimed.
    let mut run_chunk = |id: &mut u64| {
        for _ in 0..chunk {
            *id += 1;
            let ts = 1_000_000 + *id * 4_000;
            for (i, stage) in
                [Stage::Enqueued, Stage::TransferPosted, Stage::TransferDone, Stage::Released].into_iter().enumerate()
            {
                let external_id = (stage == Stage::Enqueued).then(|| format!("room-{id}").into_boxed_str());
                engine.observe(
                    Observation { pid: 4242, key: *id, stage, ts_ns: ts + i as u64 * 1_000, external_id, ends: None },
                    &mut reports,
                );
            }
            for report in reports.drain(..) {
                alerts.report(&report, None, &Context::default()).expect("sink");
                metrics.report(&report);
                if let Some(exporter) = &exporter {
                    exporter.report(report, None, Context::default());
                }
            }
        }
    };
    for _ in 0..10 {
        run_chunk(&mut id);
    }
    let mut done = 0;
    while done < n {
        if let Some(exporter) = &exporter {
            while exporter.counts().queued > exporter.counts().queue_capacity / 2 {
                thread::sleep(Duration::from_micros(200));
            }
        }
        let (started, started_cpu) = (Instant::now(), thread_cpu());
        run_chunk(&mut id);
        cpu += thread_cpu() - started_cpu;
        wall += started.elapsed();
        done += chunk;
    }
    black_box(&engine);
    if let Some(exporter) = exporter {
        let counts = exporter.shutdown(Duration::from_secs(5));
        assert_eq!(counts.dropped_queue_full, 0, "the chunks are paced so the queue never fills: {counts:?}");
    }
    Cost { cpu: cpu.as_nanos() as f64 / done as f64, wall: wall.as_nanos() as f64 / done as f64 }
}

fn exporter(protocol: Protocol, endpoint: &str) -> OtlpExporter {
    let target = OtlpTarget::new(endpoint.to_owned(), protocol, "bench");
    let exporter = OtlpExporter::start(target, "bench-host".into(), Clock::new(), ExportSettings::default())
        .expect("starting the exporter");
    exporter.name_process(4242, "demo-prefill", "demo");
    exporter
}

/// A healthy lifecycle's end, as the engine reports it.
fn ended(i: u64) -> Report {
    let first = 1_000_000_000 + i * 10_000;
    let request = stallwatch::lifecycle::RequestSnapshot {
        pid: 4242,
        key: i,
        external_id: Some(format!("room-{i}").into()),
        stage: Stage::Released,
        stage_ns: [Some(first), Some(first + 1_000), Some(first + 2_000), Some(first + 3_000)],
        first_ns: first,
        last_ns: first + 3_000,
        stalled: None,
        inferred: Default::default(),
    };
    Report::Ended { request, outcome: stallwatch::lifecycle::Outcome::Released, at_ns: first + 3_000 }
}

fn rotel_bin() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("STALLWATCH_ROTEL") {
        return Some(PathBuf::from(path));
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent()?.to_path_buf();
    let venv = std::env::var_os("STALLWATCH_VENV").map_or_else(|| root.join("target/venv"), |v| root.join(v));
    std::fs::read_dir(venv.join("lib"))
        .ok()?
        .filter_map(Result::ok)
        .map(|python| python.path().join("site-packages/rotel/rotel-agent"))
        .find(|path| path.exists())
}

/// rotel with the blackhole exporter: it receives, decodes and acknowledges.
struct Rotel {
    child: Child,
    grpc: u16,
    http: u16,
    _dir: tempfile::TempDir,
}

impl Rotel {
    fn start(bin: &PathBuf) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let (grpc, http) = (free_port(), free_port());
        let child = Command::new(bin)
            .arg("start")
            .args(["--exporter", "blackhole"])
            .args([
                "--otlp-grpc-endpoint",
                &format!("127.0.0.1:{grpc}"),
                "--otlp-http-endpoint",
                &format!("127.0.0.1:{http}"),
            ])
            .arg("--pid-file")
            .arg(dir.path().join("pid"))
            .arg("--log-file")
            .arg(dir.path().join("log"))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|err| panic!("starting {}: {err}", bin.display()));
        let deadline = Instant::now() + Duration::from_secs(10);
        for port in [grpc, http] {
            while TcpStream::connect(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).is_err() {
                assert!(Instant::now() < deadline, "rotel is not listening on {port}");
                thread::sleep(Duration::from_millis(20));
            }
        }
        Self { child, grpc, http, _dir: dir }
    }
}

impl Drop for Rotel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}
