//! OTLP export against a real collector (rotel) on loopback, the agent on
//! the real demo target with real uprobes.
use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Demo, Injected, Line, metric,
    otlp::{Collector, Span, TlsFront, expected_trace_id, http_get},
    require_root, summary,
};

const REQUEST_SPAN: &str = "stallwatch.request";
const STALL_SPAN: &str = "stallwatch.stall";

fn class_of(kind: &str) -> &str {
    if kind == "recover" { "transfer_hung" } else { kind }
}

fn key_of(span: &Span) -> &str {
    span.attr("stallwatch.request.key").unwrap_or_default()
}

fn stall_spans(spans: &[Span]) -> Vec<&Span> {
    spans.iter().filter(|s| s.name == STALL_SPAN).collect()
}

fn request_spans(spans: &[Span]) -> Vec<&Span> {
    spans.iter().filter(|s| s.name == REQUEST_SPAN).collect()
}

/// The checks every request span passes.
fn check_request_span(span: &Span, pid: u32) {
    assert_eq!(span.attr("process.pid"), Some(pid.to_string().as_str()), "{span:#?}");
    assert_eq!(span.attr("process.executable.name"), Some("demo-prefill"), "{span:#?}");
    let key = u64::from_str_radix(key_of(span).trim_start_matches("0x"), 16).expect("hex key");
    let room = format!("room-{key}");
    assert_eq!(span.attr("stallwatch.request.external_id"), Some(room.as_str()), "{span:#?}");
    assert_eq!(span.trace_id, expected_trace_id(&room), "trace id from the external id: {span:#?}");
    let names = span.event_names();
    assert_eq!(names.first(), Some(&"enqueued"), "{span:#?}");
    assert!(span.events.windows(2).all(|w| w[0].1 <= w[1].1), "events in time order: {span:#?}");
    assert_eq!(span.start_unix_nano, span.events[0].1, "the span starts at the first stage: {span:#?}");
    assert!(span.end_unix_nano >= span.start_unix_nano);
}

#[test]
fn stalled_spans_arrive_while_stuck_and_lifecycles_when_they_end_grpc() {
    require_root();
    let mut collector = Collector::start();
    let mut demo = Demo::builder().rate(200).duration("6s").inject_after("300ms").each_stall("2500ms").start();
    let pid = demo.proc.pid();
    let endpoint = collector.grpc_endpoint();
    let agent = Agent::watch(pid, "demo", "1s", &["--otlp-endpoint", &endpoint, "--otlp-protocol", "grpc"]);
    demo.go();
    let mut demo_lines = Vec::new();
    let injected = demo.wait_injected(4, &mut demo_lines);

    // Every stuck request's stall span, while it is stuck: the demo is
    // still running (it exits at 6 s) and holds them.
    let spans = collector.wait_for(Duration::from_secs(4), "4 stall spans", |spans| stall_spans(spans).len() >= 4);
    assert!(demo.proc.child.try_wait().expect("try_wait").is_none(), "stall spans must arrive before the demo ends");
    let stalls = stall_spans(&spans);
    assert_eq!(stalls.len(), 4, "one stall span per stuck request: {stalls:#?}");
    for span in &stalls {
        let Injected { stall: kind, room, at: injected_at } =
            injected.get(key_of(span)).unwrap_or_else(|| panic!("stall span for a healthy request: {span:#?}"));
        assert!(span.is_error(), "{span:#?}");
        assert_eq!(span.attr("stallwatch.stall.class"), Some(class_of(kind)), "{span:#?}");
        assert_eq!(span.attr("error.type"), Some(class_of(kind)), "an ERROR span says its error.type: {span:#?}");
        assert!(span.status_message.contains(class_of(kind)), "{span:#?}");
        assert_eq!(span.trace_id, expected_trace_id(room), "{span:#?}");
        assert_eq!(span.attr("stallwatch.request.external_id"), Some(room.as_str()));
        let silent: u64 = span.attr("stallwatch.stall.silent_ms").expect("silent_ms").parse().expect("number");
        assert!((1_000..2_000).contains(&silent), "{span:#?}");
        let latency = span.seen_at.expect("seen").duration_since(*injected_at);
        eprintln!(
            "stall span {} ({}) at the collector {latency:?} after its request's last event (timeout 1 s)",
            key_of(span),
            class_of(kind)
        );
        assert!(
            latency < Duration::from_millis(2_500),
            "stall span {latency:?} after its request's last event: {span:#?}"
        );
        assert_eq!(span.resource.get("service.name").map(String::as_str), Some("stallwatch"));
        assert!(span.resource.get("host.name").is_some_and(|h| !h.is_empty()), "{:?}", span.resource);
    }

    // The demo exits with three requests still pinned; the agent follows.
    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(20));
    demo_lines.extend(demo.proc.lines_until_exit(Duration::from_secs(5)));
    let summary = summary(&agent_lines);
    assert_eq!(summary["export_drops"], 0, "{summary}");
    assert_eq!(summary["stalled"], 4, "{summary}");
    let seen = summary["seen"].as_u64().expect("seen") as usize;
    let spans = collector
        .wait_for(Duration::from_secs(5), "a request span per lifecycle", |spans| request_spans(spans).len() >= seen);
    let requests = request_spans(&spans);
    assert_eq!(requests.len(), seen, "exactly one request span per lifecycle ({summary})");
    for span in &requests {
        check_request_span(span, pid);
    }
    let by_key: HashMap<&str, &Span> = requests.iter().map(|s| (key_of(s), *s)).collect();
    assert_eq!(by_key.len(), requests.len(), "request keys are distinct here");
    let stall_of: HashMap<&str, &Span> = stalls.iter().map(|s| (key_of(s), *s)).collect();
    for (key, Injected { stall: kind, .. }) in &injected {
        let span = by_key.get(key.as_str()).unwrap_or_else(|| panic!("no request span for pinned {key}"));
        let stall = stall_of[key.as_str()];
        assert_eq!(
            span.links,
            vec![(stall.trace_id.clone(), stall.span_id.clone())],
            "linked to its stall span: {span:#?}"
        );
        assert_eq!(span.trace_id, stall.trace_id, "same trace as its stall span");
        assert_eq!(span.attr("stallwatch.stall.class"), Some(class_of(kind)), "{span:#?}");
        assert!(span.event_names().contains(&"stalled"), "{span:#?}");
        if kind == "recover" {
            assert_eq!(span.attr("stallwatch.request.outcome"), Some("released"), "{span:#?}");
            assert!(!span.is_error(), "it recovered and completed: {span:#?}");
            let names = span.event_names();
            for stage in ["transfer_posted", "stalled", "recovered", "transfer_done", "released"] {
                assert!(names.contains(&stage), "{stage} in {names:?}");
            }
            let recovered = span.events.iter().find(|e| e.0 == "recovered").expect("recovered event");
            let stuck: u64 = recovered.2["stallwatch.stall.stuck_ms"].parse().expect("stuck_ms");
            assert!((2_000..3_500).contains(&stuck), "{recovered:?}");
        } else {
            assert_eq!(span.attr("stallwatch.request.outcome"), Some("process_exited"), "{span:#?}");
            assert!(span.is_error(), "it ended stuck: {span:#?}");
            assert_eq!(span.attr("error.type"), Some(class_of(kind)), "{span:#?}");
            assert_eq!(span.event_names().last(), Some(&"process_exited"), "{span:#?}");
        }
    }
    // A healthy one: every stage, no stall, no error.
    let healthy = requests.iter().find(|s| !injected.contains_key(key_of(s))).expect("a healthy request span");
    assert_eq!(healthy.event_names(), ["enqueued", "transfer_posted", "transfer_done", "released"], "{healthy:#?}");
    assert_eq!(healthy.attr("stallwatch.request.outcome"), Some("released"));
    assert_eq!(healthy.attr("stallwatch.request.stage"), Some("released"));
    assert!(
        !healthy.is_error() && healthy.links.is_empty() && healthy.attr("stallwatch.stall.class").is_none(),
        "{healthy:#?}"
    );
    let _ = collector.stop();
}

#[test]
fn http_export_from_the_environment_with_resource_and_metrics() {
    require_root();
    let mut collector = Collector::start();
    let mut demo =
        Demo::start(&["--rate", "100", "--duration", "5s", "--inject-after", "200ms", "--waiting-for-peer", "1"]);
    let pid = demo.proc.pid();
    let endpoint = collector.http_endpoint();
    let agent = Agent::on_pid(pid)
        .timeout("1s")
        .metrics()
        .env(&[
            // Base URL: the agent appends /v1/traces.
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=stallwatch-test"),
            ("OTEL_SERVICE_NAME", "prefill-watch"),
            ("K8S_NODE_NAME", "gpu-node-7"),
            ("K8S_POD_NAME", "stallwatch-x1"),
        ])
        .watch();
    demo.go();
    let mut demo_lines = Vec::new();
    let injected = demo.wait_injected(1, &mut demo_lines);
    let (key, Injected { room, .. }) = injected.iter().next().expect("one injected");

    let spans =
        collector.wait_for(Duration::from_secs(4), "the stall span over HTTP", |spans| !stall_spans(spans).is_empty());
    assert!(
        demo.proc.child.try_wait().expect("try_wait").is_none(),
        "the stall span must arrive while the demo holds it"
    );
    let stall = stall_spans(&spans)[0].clone();
    assert_eq!(key_of(&stall), key);
    assert!(stall.is_error());
    assert_eq!(stall.attr("stallwatch.stall.class"), Some("waiting_for_peer"));
    assert_eq!(stall.trace_id, expected_trace_id(room));
    let resource = &stall.resource;
    assert_eq!(resource.get("service.name").map(String::as_str), Some("prefill-watch"), "{resource:?}");
    assert_eq!(resource.get("k8s.node.name").map(String::as_str), Some("gpu-node-7"), "{resource:?}");
    // The resource is the watched process's: the agent's own pod is not it.
    assert_eq!(resource.get("k8s.pod.name"), None, "{resource:?}");
    assert_eq!(resource.get("process.pid"), Some(&pid.to_string()), "{resource:?}");

    // The metrics endpoint, scraped while the request is stuck.
    let port = agent.metrics_port();
    let (status, body) = http_get(port, "/metrics", Some("application/openmetrics-text; version=1.0.0"));
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    for line in [
        "stallwatch_stalls_total{profile=\"demo\",class=\"waiting_for_peer\"} 1",
        "stallwatch_requests_stalled{profile=\"demo\",class=\"waiting_for_peer\"} 1",
        "stallwatch_lost_events_total{reason=\"ringbuf_full\"} 0",
        "stallwatch_export_drops_total{reason=\"queue_full\"} 0",
        "# EOF",
    ] {
        assert!(body.lines().any(|l| l == line), "no `{line}` in:\n{body}");
    }
    let enqueued = metric(&body, "stallwatch_requests_in_flight{stage=\"enqueued\"}");
    assert!(enqueued >= 1, "the pinned request is in flight at `enqueued`:\n{body}");
    let exported = metric(&body, "stallwatch_export_spans_total");
    assert!(exported >= 1, "{body}");
    let (_, classic) = http_get(port, "/metrics", None);
    assert!(classic.contains("stallwatch_requests_seen_total ") && !classic.contains("# EOF"), "{classic}");
    assert_eq!(http_get(port, "/nope", None).0, "HTTP/1.1 404 Not Found");
    // Durations in seconds, the build, the agent process; the probes' endpoints.
    assert!(metric(&body, "stallwatch_request_duration_seconds_count{outcome=\"released\"}") >= 1, "{body}");
    assert!(metric(&body, "stallwatch_stage_duration_seconds_count{stage=\"transfer_posted\"}") >= 1, "{body}");
    assert!(body.contains("# UNIT stallwatch_stall_duration_seconds seconds"), "{body}");
    assert!(body.lines().any(|l| l.starts_with("stallwatch_build_info{version=\"") && l.ends_with("} 1")), "{body}");
    for name in [
        "process_cpu_seconds_total ",
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_start_time_seconds ",
    ] {
        assert!(body.lines().any(|l| l.starts_with(name)), "no {name}in:\n{body}");
    }
    assert_eq!(http_get(port, "/healthz", None), ("HTTP/1.1 200 OK".to_owned(), "ok\n".to_owned()));
    assert_eq!(http_get(port, "/readyz", None), ("HTTP/1.1 200 OK".to_owned(), "ready\n".to_owned()));

    let agent_lines = agent.proc.lines_until_exit(Duration::from_secs(20));
    let summary = summary(&agent_lines);
    assert_eq!(summary["export_drops"], 0, "{summary}");
    let seen = summary["seen"].as_u64().expect("seen") as usize;
    let spans =
        collector.wait_for(Duration::from_secs(5), "every request span", |spans| request_spans(spans).len() >= seen);
    let requests = request_spans(&spans);
    assert_eq!(requests.len(), seen);
    for span in &requests {
        check_request_span(span, pid);
    }
    let pinned = requests.iter().find(|s| key_of(s) == key).expect("the pinned request's span");
    assert_eq!(pinned.links, vec![(stall.trace_id.clone(), stall.span_id.clone())]);
    assert_eq!(pinned.attr("stallwatch.request.outcome"), Some("process_exited"));
    let _ = collector.stop();
}

#[test]
fn a_collector_restart_never_stops_alerting_and_later_spans_arrive() {
    require_root();
    let collector = Collector::start();
    let (grpc_port, http_port) = (collector.grpc_port, collector.http_port);
    // The collector goes down once it has spans, before the stalls are
    // injected at 2 s; it comes back once both stalls were alerted, before
    // the recovering one moves on at 5.5 s.
    let mut demo =
        Demo::builder().rate(200).duration("8s").inject_after("2s").transfer_hung(1).recover(1, "3500ms").start();
    let pid = demo.proc.pid();
    let endpoint = collector.grpc_endpoint();
    let agent = Agent::watch(pid, "demo", "1s", &["--otlp-endpoint", &endpoint, "--otlp-protocol", "grpc"]);
    demo.go();
    let mut collector = collector;
    collector.wait_for(Duration::from_secs(3), "spans before the outage", |spans| !request_spans(spans).is_empty());
    let before = collector.stop();
    let killed_at = Instant::now();

    // Down: the agent keeps detecting and alerting on time.
    let mut demo_lines = Vec::new();
    let injected = demo.wait_injected(2, &mut demo_lines);
    for (key, Injected { at, .. }) in &injected {
        assert!(
            *at > killed_at,
            "request {key} was pinned before the outage began: the collector was slow to get spans"
        );
    }
    let mut agent_lines = Vec::new();
    let stalled = agent.wait_alerts("stalled", 2, Duration::from_secs(4), &mut agent_lines);
    for (at, alert) in &stalled {
        let key = alert["key"].as_str().expect("key");
        let Injected { at: injected_at, .. } =
            injected.get(key).unwrap_or_else(|| panic!("stall of a healthy request: {alert}"));
        let latency = at.duration_since(*injected_at);
        assert!(
            latency < Duration::from_secs(2),
            "alert {latency:?} after the request went silent, collector down: {alert}"
        );
    }

    // Up again on the same ports, now that both stalls fired while it was down.
    let mut collector = Collector::start_on(grpc_port, http_port);
    let restarted_at = Instant::now();
    let recovered: Vec<(Instant, Value)> = agent.wait_alerts("recovered", 1, Duration::from_secs(5), &mut agent_lines);
    assert!(recovered[0].0 > restarted_at, "the recovery happens after the restart");
    let recovered_key = recovered[0].1["key"].as_str().expect("key").to_owned();

    // Spans produced after the restart arrive: healthy request spans that
    // started after it, and the recovered request's span linked to the
    // stall span made while the collector was down.
    let spans = collector.wait_for(Duration::from_secs(8), "the recovered request's span", |spans| {
        request_spans(spans).iter().any(|s| key_of(s) == recovered_key)
    });
    let recovered_span =
        request_spans(&spans).into_iter().find(|s| key_of(s) == recovered_key).expect("recovered span").clone();
    assert_eq!(recovered_span.attr("stallwatch.request.outcome"), Some("released"));
    assert_eq!(recovered_span.links.len(), 1, "{recovered_span:#?}");
    assert!(recovered_span.event_names().contains(&"recovered"));
    let restart_unix = unix_nanos_at(restarted_at);
    assert!(
        request_spans(&spans).iter().any(|s| s.start_unix_nano > restart_unix && !injected.contains_key(key_of(s))),
        "healthy requests begun after the restart are exported"
    );

    agent_lines.extend(agent.proc.lines_until_exit(Duration::from_secs(20)));
    let summary = summary(&agent_lines);
    // The engine saw every lifecycle through the outage.
    assert_eq!(summary["lost_events"], 0, "{summary}");
    assert_eq!(summary["stalled"], 2, "{summary}");
    assert_eq!(summary["recovered"], 1, "{summary}");
    let seen = summary["seen"].as_u64().expect("seen");
    let done =
        demo.proc.lines_until_exit(Duration::from_secs(5)).iter().filter_map(Line::json).find(|v| v["event"] == "done");
    let healthy = done.as_ref().and_then(|d| d["healthy"].as_u64()).expect("demo done line");
    assert_eq!(seen, healthy + 2, "{summary}");
    let spans = collector.wait_for(Duration::from_secs(5), "the last spans", |spans| {
        request_spans(spans).iter().any(|s| s.attr("stallwatch.request.outcome") == Some("process_exited"))
    });
    let drops = summary["export_drops"].as_u64().expect("export_drops");
    let delivered = (request_spans(&before).len() + request_spans(&spans).len()) as u64;
    eprintln!(
        "restart: {} request spans before the outage, {} after it, {drops} export drops, {} lifecycles",
        request_spans(&before).len(),
        request_spans(&spans).len(),
        seen
    );
    assert!(
        delivered + drops >= seen,
        "every lifecycle is exported or counted as dropped ({delivered} + {drops} < {seen})"
    );
    let _ = collector.stop();
}

/// Wall-clock nanoseconds at a test `Instant`.
fn unix_nanos_at(at: Instant) -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock after 1970");
    let ago = Instant::now().saturating_duration_since(at);
    u64::try_from(now.saturating_sub(ago).as_nanos()).expect("fits")
}

#[test]
fn a_dead_collector_costs_counted_drops_not_alerts_http() {
    require_root();
    // Nobody listens there; a short export timeout makes every batch give
    // up quickly.
    let port = stallwatch_tests::otlp::free_port();
    let mut demo =
        Demo::start(&["--rate", "200", "--duration", "4s", "--inject-after", "300ms", "--release-lost", "1"]);
    let endpoint = format!("http://127.0.0.1:{port}");
    let agent = Agent::on_pid(demo.proc.pid())
        .timeout("1s")
        .args(&["--otlp-endpoint", &endpoint, "--otlp-protocol", "http", "--metrics-addr", "127.0.0.1:0"])
        .env(&[("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "300")])
        .watch();
    demo.go();
    let mut demo_lines = Vec::new();
    let injected = demo.wait_injected(1, &mut demo_lines);
    let mut agent_lines = Vec::new();
    let stalled = agent.wait_alerts("stalled", 1, Duration::from_secs(3), &mut agent_lines);
    let (at, alert) = &stalled[0];
    let Injected { at: injected_at, .. } = &injected[alert["key"].as_str().expect("key")];
    assert!(
        at.duration_since(*injected_at) < Duration::from_secs(2),
        "the alert is on time with the collector gone: {alert}"
    );
    let (_, body) = http_get(agent.metrics_port(), "/metrics", None);
    assert!(metric(&body, "stallwatch_export_drops_total{reason=\"export_failed\"}") > 0, "{body}");
    assert_eq!(metric(&body, "stallwatch_export_spans_total"), 0, "{body}");
    agent_lines.extend(agent.proc.lines_until_exit(Duration::from_secs(20)));
    let summary = summary(&agent_lines);
    // Every span the run made (one per lifecycle, one per stall) was given
    // up on and counted, and nothing else was lost.
    let spans = summary["seen"].as_u64().expect("seen") + summary["stalled"].as_u64().expect("stalled");
    assert_eq!(summary["export_drops"].as_u64(), Some(spans), "{summary}");
    assert_eq!(summary["lost_events"], 0, "{summary}");
    assert_eq!(summary["process_exited"], 1, "{summary}");
    let stderr = agent.proc.stderr();
    assert!(stderr.contains("OTLP export failed after retries"), "the failure is logged:\n{stderr}");
    let _ = demo.proc.wait(Duration::from_secs(5));
}

/// A collector that takes connections and requests and never answers
/// (a hung one): its port.
fn silent_collector() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding the silent collector");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            // Read in the background so the client's writes complete, and
            // keep the socket open: the request is taken, no answer comes.
            if let Ok(mut reader) = stream.try_clone() {
                std::thread::spawn(move || std::io::copy(&mut reader, &mut std::io::sink()));
            }
            held.push(stream);
        }
    });
    port
}

#[test]
fn an_export_the_collector_never_answers_fails_at_the_per_request_timeout() {
    require_root();
    let port = silent_collector();
    let endpoint = format!("http://127.0.0.1:{port}");
    for protocol in ["http/protobuf", "grpc"] {
        let mut demo = one_stall();
        let agent = Agent::on_pid(demo.proc.pid())
            .timeout("1s")
            .env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
                ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "500"),
                // The stall span is the first and only export.
                ("OTEL_TRACES_SAMPLER", "stallwatch_stalls"),
            ])
            .watch();
        demo.go();
        let mut seen = Vec::new();
        agent.wait_alerts("stalled", 1, Duration::from_secs(10), &mut seen);
        // The stall span goes out at once; with no per-request bound it
        // would wait for an answer for ever, and nothing would be logged.
        let stalled_at = Instant::now();
        let deadline = stalled_at + Duration::from_secs(10);
        while !agent.proc.stderr().contains("OTLP export failed") {
            assert!(Instant::now() < deadline, "{protocol}: no export failure:\n{}", agent.proc.stderr());
            std::thread::sleep(Duration::from_millis(50));
        }
        let waited = stalled_at.elapsed();
        let stderr = agent.proc.stderr();
        let line = stderr.lines().find(|l| l.contains("OTLP export failed")).expect("the error line");
        eprintln!("{protocol}: failed {waited:?} after the stall: {line}");
        assert!(line.to_lowercase().contains("timed out") || line.contains("Timeout expired"), "{protocol}: {line}");
        // 500 ms a request, and the retries end at the same deadline: it
        // waited for the answer, and no longer than about that.
        assert!(waited >= Duration::from_millis(300), "{protocol}: {waited:?}: {line}");
        assert!(waited < Duration::from_secs(4), "{protocol}: {waited:?}: {line}");
        drop(agent);
    }
}

#[test]
fn scrapes_are_answered_with_hundreds_of_idle_connections_open() {
    use std::io::Write as _;
    require_root();
    let mut demo = Demo::start(&["--rate", "100", "--duration", "20s"]);
    let agent = Agent::on_pid(demo.proc.pid()).timeout("1s").metrics().watch();
    demo.go();
    let port = agent.metrics_port();
    // Half-sent requests, held open: a slowloris, or clients that hang.
    let idle: Vec<std::net::TcpStream> = (0..300)
        .map(|n| {
            let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))
                .unwrap_or_else(|err| panic!("idle connection {n}: {err}"));
            stream.write_all(b"GET /metr").expect("half a request");
            stream
        })
        .collect();
    let (status, body) = http_get(port, "/metrics", None);
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    assert!(body.contains("stallwatch_requests_seen_total "), "{body}");
    drop(idle);
    drop(agent);
}

#[test]
fn the_standard_switches_turn_span_export_off() {
    require_root();
    let mut collector = Collector::start();
    let endpoint = collector.http_endpoint();
    for (name, value) in [("OTEL_SDK_DISABLED", "true"), ("OTEL_TRACES_EXPORTER", "none")] {
        let mut demo =
            Demo::start(&["--rate", "200", "--duration", "2s", "--inject-after", "100ms", "--waiting-for-peer", "1"]);
        let agent = Agent::on_pid(demo.proc.pid())
            .timeout("1s")
            .env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint), (name, value)])
            .watch();
        demo.go();
        let lines = agent.proc.lines_until_exit(Duration::from_secs(20));
        let summary = summary(&lines);
        assert!(summary["seen"].as_u64().is_some_and(|n| n > 100), "{summary}");
        let stderr = agent.proc.stderr();
        assert!(stderr.contains(&format!("span export is off: {name}={value}")), "{stderr}");
        assert!(!stderr.contains("exporting spans over OTLP"), "{stderr}");
    }
    // Nothing arrived from either run (a run with export on is the
    // collector's other tests).
    std::thread::sleep(Duration::from_millis(500));
    let arrived = collector.spans().len();
    assert_eq!(arrived, 0, "spans arrived with export off");
    let _ = collector.stop();
}

#[test]
fn stalls_only_sends_every_stalled_request_and_none_of_the_healthy() {
    require_root();
    let mut collector = Collector::start();
    let endpoint = collector.http_endpoint();
    let mut demo =
        Demo::builder().rate(200).duration("4s").inject_after("200ms").waiting_for_peer(1).recover(1, "1500ms").start();
    let agent = Agent::on_pid(demo.proc.pid())
        .timeout("1s")
        .metrics()
        .env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint), ("OTEL_TRACES_SAMPLER", "stallwatch_stalls")])
        .watch();
    demo.go();
    let mut demo_lines = Vec::new();
    let injected = demo.wait_injected(2, &mut demo_lines);
    collector.wait_for(Duration::from_secs(5), "2 stall spans", |spans| stall_spans(spans).len() >= 2);
    let port = agent.metrics_port();
    // The healthy requests' spans were made and kept out, and counted.
    let (_, body) = http_get(port, "/metrics", None);
    assert!(metric(&body, "stallwatch_export_sampled_out_total") > 100, "{body}");
    let lines = agent.proc.lines_until_exit(Duration::from_secs(20));
    let summary = summary(&lines);
    let seen = summary["seen"].as_u64().expect("seen");
    assert!(seen > 300, "{summary}");
    // The stalled requests' request spans: the one pinned to the end and
    // the one that recovered; no healthy one.
    collector.wait_for(Duration::from_secs(5), "2 request spans", |spans| request_spans(spans).len() >= 2);
    // Anything else would have come in the same flush at exit.
    std::thread::sleep(Duration::from_millis(500));
    let spans = collector.spans().to_vec();
    let requests: std::collections::BTreeSet<&str> = request_spans(&spans).into_iter().map(key_of).collect();
    let pinned: std::collections::BTreeSet<&str> = injected.keys().map(String::as_str).collect();
    assert_eq!(requests, pinned, "exactly the stalled requests' spans ({seen} requests seen)");
    let stderr = agent.proc.stderr();
    assert!(stderr.contains("sampler=stallwatch_stalls (0)"), "{stderr}");
    let _ = collector.stop();
}

#[test]
fn a_sampler_it_cannot_honour_stops_the_agent_and_config_check() {
    use std::process::Command;
    let (ok, _, stderr) = stallwatch_tests::run_to_end(
        Command::new(stallwatch_tests::agent_bin())
            .args(["run", "--pid", "1", "--profile", "demo", "--otlp-endpoint", "http://127.0.0.1:4318"])
            .env("OTEL_TRACES_SAMPLER", "jaeger_remote"),
    );
    assert!(!ok && stderr.contains("OTEL_TRACES_SAMPLER=\"jaeger_remote\" is not supported"), "{stderr}");
    let (ok, _, stderr) = stallwatch_tests::run_to_end(
        Command::new(stallwatch_tests::agent_bin())
            .args(["config", "check", "--profile", "demo"])
            .env("OTEL_TRACES_SAMPLER", "traceidratio")
            .env("OTEL_TRACES_SAMPLER_ARG", "lots"),
    );
    assert!(!ok && stderr.contains("OTEL_TRACES_SAMPLER_ARG=\"lots\" is not a ratio"), "{stderr}");
    let (ok, stdout, stderr) = stallwatch_tests::run_to_end(
        Command::new(stallwatch_tests::agent_bin())
            .args(["config", "check", "--profile", "demo", "--otlp-endpoint", "http://127.0.0.1:4318"])
            .env("OTEL_SDK_DISABLED", "true"),
    );
    assert!(ok, "{stderr}");
    assert!(stdout.contains("otlp         off (OTEL_SDK_DISABLED=true)"), "{stdout}");
    let (ok, _, stderr) = stallwatch_tests::run_to_end(
        Command::new(stallwatch_tests::agent_bin())
            .args(["config", "check", "--profile", "demo", "--otlp-endpoint", "http://127.0.0.1:4318"])
            .env("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant"),
    );
    assert!(!ok && stderr.contains("`x-tenant` is not KEY=VALUE"), "{stderr}");
}

/// The demo with one request pinned at `enqueued`, stalled after 1 s.
fn one_stall() -> Demo {
    Demo::start(&["--rate", "100", "--duration", "5s", "--inject-after", "200ms", "--waiting-for-peer", "1"])
}

#[test]
fn tls_export_trusts_the_ca_file_or_the_system_roots_and_sends_the_headers() {
    require_root();
    let mut collector = Collector::start();
    let front = TlsFront::start(&collector);
    let ca = front.ca();
    // gRPC trusting OTEL_EXPORTER_OTLP_CERTIFICATE; HTTP trusting the
    // system's roots, here the file SSL_CERT_FILE names.
    let runs = [
        ("grpc", front.grpc_endpoint(), ("OTEL_EXPORTER_OTLP_CERTIFICATE", ca.as_str())),
        ("http/protobuf", front.http_endpoint(), ("SSL_CERT_FILE", ca.as_str())),
    ];
    for (protocol, endpoint, trust) in runs {
        let mut demo = one_stall();
        let pid = demo.proc.pid();
        let agent = Agent::on_pid(pid)
            .timeout("1s")
            .env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
                ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=stallwatch-tls"),
                trust,
            ])
            .watch();
        demo.go();
        let spans =
            collector.wait_for(Duration::from_secs(10), &format!("the stall span over TLS ({protocol})"), |spans| {
                stall_spans(spans).iter().any(|s| s.resource.get("process.pid") == Some(&pid.to_string()))
            });
        let stall = stall_spans(&spans).into_iter().find(|s| s.resource.get("process.pid") == Some(&pid.to_string()));
        assert_eq!(stall.and_then(|s| s.attr("stallwatch.stall.class")), Some("waiting_for_peer"));
        let stderr = agent.proc.stderr();
        assert!(!stderr.contains("OTLP export failed"), "{protocol}: {stderr}");
        drop(agent);
    }
    // HTTP/1.1 inside TLS: the header went out on every export request.
    let received = front.received();
    assert!(received.contains("x-tenant: stallwatch-tls\r\n"), "{received:?}");
    let _ = collector.stop();
}

#[test]
fn an_untrusted_collector_certificate_is_an_error_that_names_the_fix() {
    require_root();
    let mut collector = Collector::start();
    let front = TlsFront::start(&collector);
    for (protocol, endpoint) in [("grpc", front.grpc_endpoint()), ("http/protobuf", front.http_endpoint())] {
        let mut demo = one_stall();
        let agent = Agent::on_pid(demo.proc.pid())
            .timeout("1s")
            .env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
                ("OTEL_EXPORTER_OTLP_CERTIFICATE", &front.wrong_ca()),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "1000"),
                // Not the system's roots either.
                ("SSL_CERT_FILE", &front.wrong_ca()),
            ])
            .watch();
        demo.go();
        let mut seen = Vec::new();
        agent.wait_alerts("stalled", 1, Duration::from_secs(10), &mut seen);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !agent.proc.stderr().contains("OTLP export failed") {
            assert!(Instant::now() < deadline, "{protocol}: no export error:\n{}", agent.proc.stderr());
            std::thread::sleep(Duration::from_millis(100));
        }
        let stderr = agent.proc.stderr();
        let line = stderr.lines().find(|l| l.contains("OTLP export failed")).expect("the error line");
        assert!(line.contains("OTEL_EXPORTER_OTLP_CERTIFICATE"), "{protocol}: {line}");
        // Why, not only a hint: rustls's verdict on the certificate.
        assert!(line.contains("UnknownIssuer"), "{protocol}: the cause is lost: {line}");
        eprintln!("{protocol}: {line}");
        // Said once, by the agent: not an ERROR line of the TLS library's
        // per refused handshake (each export's retries make several).
        assert!(!stderr.contains("rustls_platform_verifier"), "{protocol}: {stderr}");
        assert_eq!(stderr.matches("OTLP export failed").count(), 1, "{protocol}: {stderr}");
        drop(agent);
    }
    assert!(stall_spans(collector.spans()).is_empty(), "nothing may pass an untrusted certificate");
    let _ = collector.stop();
}
