//! Reports become OTLP spans.
//!
//! # Span model
//!
//! - **`stallwatch.stall`**, sent the moment the timeout fires
//!   ([`Report::Stalled`]), while the request is still stuck: it starts at
//!   the request's last lifecycle event (when the silence began) and ends
//!   when the stall was detected, with status error and
//!   `stallwatch.stall.class`. One per silence episode.
//! - **`stallwatch.request`**, sent when the lifecycle ends (released,
//!   aborted, failed, process exited, evicted): from the first event seen to
//!   the end, one span event per stage seen (at the stage's kernel
//!   timestamp), `stalled` / `recovered` events for each episode, a span
//!   link to every `stallwatch.stall` span of the lifecycle, and the same
//!   trace id as those. Status error when it failed, or ended while stuck
//!   or with its process gone.
//!
//! Both are root spans (the agent sees no parent); they share a trace id
//! that [`trace_id`] derives from the request, so they meet the spans
//! another node's agent sends for the same external id.
use std::{collections::HashMap, sync::Arc, time::SystemTime};

use opentelemetry::{
    Array, InstrumentationScope, KeyValue, StringValue, Value,
    trace::{Event, Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState},
};
use opentelemetry_sdk::trace::{IdGenerator as _, RandomIdGenerator, SpanData, SpanEvents, SpanLinks};
use sha2::{Digest as _, Sha256};

use crate::{
    evidence::transport::Evidence,
    lifecycle::{Context, Outcome, Report, RequestSnapshot, Stage, StallClass},
    profile::ActivityKind,
    util::clock::Clock,
};

use super::names::{REQUEST_SPAN, STALL_SPAN, attr};
use super::sampling::SpanSampler;

/// Domain prefixes of the trace-id hash; see [`trace_id`].
const EXTERNAL_DOMAIN: &[u8] = b"stallwatch/v1/external\0";
const LOCAL_DOMAIN: &[u8] = b"stallwatch/v1/local\0";

/// The trace id of a request whose probe captured an external id:
/// the first 16 bytes of `SHA-256("stallwatch/v1/external\0" ‖ id)`,
/// `id` as the bytes captured (UTF-8). Every agent that sees the same
/// external id (the prefill and the decode side of one room) derives the
/// same trace id, with no propagation between them.
pub fn external_trace_id(external_id: &str) -> TraceId {
    trace_id_from(Sha256::new().chain_update(EXTERNAL_DOMAIN).chain_update(external_id.as_bytes()))
}

/// The trace id of a request without an external id: the first 16 bytes
/// of `SHA-256("stallwatch/v1/local\0" ‖ host ‖ "\0" ‖ pid ‖ key ‖
/// first_ns)`, the integers big-endian (u32, u64, u64). `first_ns` is the
/// kernel's CLOCK_MONOTONIC time of the first event, so the id is unique to
/// the lifecycle and the same in every span of it.
pub fn local_trace_id(host: &str, pid: u32, key: u64, first_ns: u64) -> TraceId {
    trace_id_from(
        Sha256::new()
            .chain_update(LOCAL_DOMAIN)
            .chain_update(host.as_bytes())
            .chain_update([0])
            .chain_update(pid.to_be_bytes())
            .chain_update(key.to_be_bytes())
            .chain_update(first_ns.to_be_bytes()),
    )
}

/// The trace id of a request: [`external_trace_id`] when it has an
/// external id, else [`local_trace_id`].
pub fn trace_id(host: &str, request: &RequestSnapshot) -> TraceId {
    match &request.external_id {
        Some(id) => external_trace_id(id),
        None => local_trace_id(host, request.pid, request.key, request.first_ns),
    }
}

fn trace_id_from(hash: Sha256) -> TraceId {
    let digest = hash.finalize();
    let mut bytes = [0; 16];
    bytes.copy_from_slice(&digest[..16]);
    // All zeros is the invalid trace id (one chance in 2^128).
    if bytes == [0; 16] {
        bytes[15] = 1;
    }
    TraceId::from_bytes(bytes)
}

/// Most stalled lifecycles remembered for their request span's links; past
/// it (only if `Ended` reports were lost) an arbitrary one is forgotten.
const OPEN_CAP: usize = 1 << 16;

/// A lifecycle that has stalled at least once: what its request span will
/// need when it ends.
struct Open {
    trace_id: TraceId,
    stalls: Vec<SpanContext>,
    events: Vec<Event>,
    last_class: StallClass,
}

/// Turns reports into spans, remembering the stall spans of the lifecycles
/// still open so their request spans can link to them.
pub struct SpanMaker {
    host: String,
    clock: Clock,
    scope: InstrumentationScope,
    /// Of each watched process: its executable's name and its profile's.
    processes: HashMap<u32, (Arc<str>, Arc<str>)>,
    open: HashMap<(u32, u64), Open>,
    ids: RandomIdGenerator,
    sampler: SpanSampler,
    sampled_out: u64,
}

impl SpanMaker {
    pub fn new(host: String, clock: Clock) -> Self {
        Self {
            host,
            clock,
            scope: InstrumentationScope::builder("stallwatch").with_version(env!("CARGO_PKG_VERSION")).build(),
            processes: HashMap::new(),
            open: HashMap::new(),
            ids: RandomIdGenerator::default(),
            sampler: SpanSampler::default(),
            sampled_out: 0,
        }
    }

    /// Which spans are sent (`OTEL_TRACES_SAMPLER`); every one by default.
    pub fn with_sampler(mut self, sampler: SpanSampler) -> Self {
        self.sampler = sampler;
        self
    }

    /// The executable name (`process.executable.name`) and profile
    /// (`stallwatch.profile`) spans of `pid` carry.
    pub fn name_process(&mut self, pid: u32, executable: &str, profile: &str) {
        self.processes.insert(pid, (executable.into(), profile.into()));
    }

    /// The spans a report calls for (none for a recovery, which becomes an
    /// event of the request span). A stall's span carries the fields `said`
    /// of where it stopped, each as
    /// `stallwatch.<scope>.<name>` ([`crate::lifecycle::Field::attribute`]);
    /// every span carries its native attributes (SGLang's
    /// `bootstrap_room`). Returns whether one is a stall span, which should
    /// be sent at once.
    pub fn push(
        &mut self,
        report: Report,
        evidence: Option<Evidence>,
        said: &Context,
        out: &mut Vec<SpanData>,
    ) -> bool {
        // Every span is made (a stall's context is remembered for its
        // request span's links either way); the sampler then says which
        // are sent.
        let from = out.len();
        let urgent = self.make(report, evidence, said, out);
        let made = out.len() - from;
        let kept: Vec<SpanData> = out.drain(from..).filter(|span| self.sampler.keep(span)).collect();
        self.sampled_out += (made - kept.len()) as u64;
        let sent = !kept.is_empty();
        out.extend(kept);
        urgent && sent
    }

    /// Spans the sampler kept out so far.
    pub fn sampled_out(&self) -> u64 {
        self.sampled_out
    }

    fn make(&mut self, report: Report, evidence: Option<Evidence>, said: &Context, out: &mut Vec<SpanData>) -> bool {
        match report {
            Report::Stalled { request, class, silent_ns, at_ns } => {
                let span_id = self.ids.new_span_id();
                let detected = Event::new(
                    "stalled",
                    self.clock.wall(at_ns),
                    vec![
                        KeyValue::new(attr::STALL_CLASS, class.as_str()),
                        KeyValue::new(attr::SILENT_MS, ms(silent_ns)),
                    ],
                    0,
                );
                let open = self.open(&request, class);
                let context = SpanContext::new(open.trace_id, span_id, TraceFlags::SAMPLED, false, TraceState::NONE);
                open.stalls.push(context.clone());
                open.last_class = class;
                open.events.push(detected);
                let mut attributes = self.base(&request, said);
                attributes.push(KeyValue::new(attr::STALL_CLASS, class.as_str()));
                // The semantic conventions' low-cardinality class of the
                // error this span's ERROR status is.
                attributes.push(KeyValue::new(attr::ERROR_TYPE, class.as_str()));
                attributes.push(KeyValue::new(attr::SILENT_MS, ms(silent_ns)));
                if let Some(evidence) = &evidence {
                    attributes.extend(transport_attributes(evidence));
                }
                attributes
                    .extend(said.fields.iter().map(|field| KeyValue::new(field.attribute(), field.value.clone())));
                let status =
                    Status::error(format!("{class}: silent for {:.2}s at {}", silent_ns as f64 / 1e9, request.stage));
                let events = self.stage_events(&request).collect();
                out.push(self.span(
                    context,
                    STALL_SPAN,
                    request.last_ns,
                    at_ns,
                    attributes,
                    events,
                    Vec::new(),
                    status,
                ));
                true
            }
            Report::Recovered { request, class, stuck_ns } => {
                let at = self.clock.wall(request.last_ns);
                self.open(&request, class).events.push(Event::new(
                    "recovered",
                    at,
                    vec![KeyValue::new(attr::STALL_CLASS, class.as_str()), KeyValue::new(attr::STUCK_MS, ms(stuck_ns))],
                    0,
                ));
                false
            }
            Report::Ended { request, outcome, at_ns } => {
                let open = self.open.remove(&(request.pid, request.key));
                let trace_id = open.as_ref().map_or_else(|| trace_id(&self.host, &request), |open| open.trace_id);
                let context =
                    SpanContext::new(trace_id, self.ids.new_span_id(), TraceFlags::SAMPLED, false, TraceState::NONE);
                let mut attributes = self.base(&request, said);
                attributes.push(KeyValue::new(attr::OUTCOME, outcome.as_str()));
                let mut events: Vec<Event> = self.stage_events(&request).collect();
                // A release or a completion at a live stage ends the span
                // at its stage's own event; other ends add theirs.
                if !matches!(outcome, Outcome::Released | Outcome::Completed) {
                    let read = Stage::ALL
                        .iter()
                        .any(|stage| stage.as_str() == outcome.as_str() && request.inferred.contains(*stage));
                    events.push(Event::new(outcome.as_str(), self.clock.wall(at_ns), inferred_mark(read), 0));
                }
                let mut links = Vec::new();
                let class = request.stalled.or(open.as_ref().map(|open| open.last_class));
                if let Some(open) = open {
                    attributes.push(KeyValue::new(attr::STALLS, open.stalls.len() as i64));
                    links.extend(open.stalls.into_iter().map(Link::with_context));
                    events.extend(open.events);
                    events.sort_by_key(|event| event.timestamp);
                }
                if let Some(class) = class {
                    attributes.push(KeyValue::new(attr::STALL_CLASS, class.as_str()));
                }
                let status = match (outcome, request.stalled) {
                    (Outcome::Failed, _) => Status::error(format!("failed after {}", progress(&request))),
                    (Outcome::LeaseExpired, _) => Status::error(format!(
                        "the prefill's lease on the KV ran out at {}: blocks freed, never read",
                        request.stage
                    )),
                    (Outcome::KvReadAfterRelease, _) => {
                        Status::error("KV read after the prefill freed it: the decode may serve another request's KV")
                    }
                    (Outcome::Leaked, _) => {
                        Status::error("a transfer of an ended request never released: its memory is held for good")
                    }
                    (_, Some(class)) => {
                        Status::error(format!("{outcome} while stalled ({class}) at {}", request.stage))
                    }
                    (Outcome::ProcessExited, None) => {
                        Status::error(format!("the process exited with the request at {}", request.stage))
                    }
                    _ => Status::Unset,
                };
                let error_type = match (outcome, request.stalled) {
                    (Outcome::Failed | Outcome::LeaseExpired | Outcome::KvReadAfterRelease | Outcome::Leaked, _) => {
                        Some(outcome.as_str())
                    }
                    (_, Some(class)) => Some(class.as_str()),
                    (Outcome::ProcessExited, None) => Some(outcome.as_str()),
                    _ => None,
                };
                if let Some(error_type) = error_type {
                    attributes.push(KeyValue::new(attr::ERROR_TYPE, error_type));
                }
                let end_ns = at_ns.max(request.last_ns);
                out.push(self.span(context, REQUEST_SPAN, request.first_ns, end_ns, attributes, events, links, status));
                false
            }
        }
    }

    /// The open-lifecycle record of a request, created on its first stall.
    fn open(&mut self, request: &RequestSnapshot, class: StallClass) -> &mut Open {
        let key = (request.pid, request.key);
        if self.open.len() >= OPEN_CAP && !self.open.contains_key(&key) {
            if let Some(victim) = self.open.keys().next().copied() {
                self.open.remove(&victim);
            }
        }
        let host = &self.host;
        self.open.entry(key).or_insert_with(|| Open {
            trace_id: trace_id(host, request),
            stalls: Vec::new(),
            events: Vec::new(),
            last_class: class,
        })
    }

    fn base(&self, request: &RequestSnapshot, said: &Context) -> Vec<KeyValue> {
        let mut attributes = Vec::with_capacity(9);
        attributes.push(KeyValue::new(attr::PROCESS_PID, i64::from(request.pid)));
        if let Some((name, profile)) = self.processes.get(&request.pid) {
            attributes
                .push(KeyValue::new(attr::PROCESS_EXECUTABLE_NAME, Value::String(StringValue::from(Arc::clone(name)))));
            attributes.push(KeyValue::new(attr::PROFILE, Value::String(StringValue::from(Arc::clone(profile)))));
        }
        attributes.push(KeyValue::new(attr::KEY, format!("{:#x}", request.key)));
        if let Some(id) = &request.external_id {
            attributes.push(KeyValue::new(attr::EXTERNAL_ID, id.to_string()));
        }
        attributes.extend(said.native.iter().map(|&(name, value)| KeyValue::new(name, value)));
        attributes.push(KeyValue::new(attr::STAGE, request.stage.as_str()));
        let reached =
            |stage: &Stage| request.stage_at(*stage).is_some() || (stage.is_terminal() && *stage == request.stage);
        let (inferred, observed): (Vec<Stage>, Vec<Stage>) =
            Stage::ALL.into_iter().filter(reached).partition(|stage| request.inferred.contains(*stage));
        attributes.push(KeyValue::new(attr::STAGES_OBSERVED, stage_names(&observed)));
        attributes.push(KeyValue::new(attr::STAGES_INFERRED, stage_names(&inferred)));
        attributes
    }

    fn stage_events<'a>(&'a self, request: &'a RequestSnapshot) -> impl Iterator<Item = Event> + 'a {
        Stage::ALL.into_iter().filter_map(move |stage| {
            let ns = request.stage_at(stage)?;
            Some(Event::new(stage.as_str(), self.clock.wall(ns), inferred_mark(request.inferred.contains(stage)), 0))
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn span(
        &self,
        span_context: SpanContext,
        name: &'static str,
        start_ns: u64,
        end_ns: u64,
        attributes: Vec<KeyValue>,
        events: Vec<Event>,
        links: Vec<Link>,
        status: Status,
    ) -> SpanData {
        let mut span_events = SpanEvents::default();
        span_events.events = events;
        let mut span_links = SpanLinks::default();
        span_links.links = links;
        let start_time: SystemTime = self.clock.wall(start_ns);
        SpanData {
            span_context,
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: name.into(),
            start_time,
            end_time: self.clock.wall(end_ns).max(start_time),
            attributes,
            dropped_attributes_count: 0,
            events: span_events,
            links: span_links,
            status,
            instrumentation_scope: self.scope.clone(),
        }
    }

    /// Lifecycles that have stalled and not ended (for tests).
    pub fn open_lifecycles(&self) -> usize {
        self.open.len()
    }
}

/// The transport evidence of a stall, as span attributes.
fn transport_attributes(evidence: &Evidence) -> Vec<KeyValue> {
    let since = |kind| evidence.since.get(kind).calls as i64;
    let mut attributes = vec![
        KeyValue::new(attr::TRANSPORT_VERDICT, evidence.verdict.as_str()),
        KeyValue::new(attr::TRANSPORT_SUMMARY, evidence.summary()),
        KeyValue::new(attr::TRANSPORT_POSTS_SINCE, since(ActivityKind::Post)),
        KeyValue::new(attr::TRANSPORT_COMPLETIONS_SINCE, since(ActivityKind::Completion)),
        KeyValue::new(attr::TRANSPORT_PROGRESS_SINCE, since(ActivityKind::Progress)),
    ];
    if let Some(window_ns) = evidence.progress_window_ns {
        attributes.push(KeyValue::new(attr::TRANSPORT_PROGRESS_WINDOW_MS, ms(window_ns)));
    }
    if let Some(halt) = evidence.halt {
        attributes.push(KeyValue::new(attr::TRANSPORT_PROCESS_STATE, halt.as_str()));
    }
    if let Some(peer) = &evidence.peer {
        let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        attributes.extend([
            KeyValue::new(attr::TRANSPORT_PEER, peer.peer.to_string()),
            KeyValue::new(attr::TRANSPORT_PEER_COMPLETIONS_SINCE, count(peer.to_peer)),
            KeyValue::new(attr::TRANSPORT_OTHER_PEERS_COMPLETIONS_SINCE, count(peer.to_others)),
        ]);
    }
    attributes
}

fn ms(ns: u64) -> i64 {
    i64::try_from(ns / 1_000_000).unwrap_or(i64::MAX)
}

/// A string-array attribute value of stage names.
fn stage_names(stages: &[Stage]) -> Value {
    Value::Array(Array::String(stages.iter().map(|stage| StringValue::from(stage.as_str())).collect()))
}

/// The attributes of a stage's span event: `stallwatch.stage.inferred` when
/// its time is a read's, not a probe's.
fn inferred_mark(inferred: bool) -> Vec<KeyValue> {
    if inferred { vec![KeyValue::new(attr::STAGE_INFERRED, true)] } else { Vec::new() }
}

fn progress(request: &RequestSnapshot) -> &'static str {
    request.progress().map_or("no stage", Stage::as_str)
}

#[cfg(test)]
mod tests {
    use opentelemetry::Key;

    use super::*;

    #[test]
    fn external_trace_ids_are_fixed() {
        // Fixed inputs, fixed ids: changing the derivation breaks the
        // joining of two nodes' spans, so it must never change silently.
        // (python3 -c 'import hashlib; print(hashlib.sha256(b"stallwatch/v1/external\0room-1").hexdigest()[:32])')
        assert_eq!(external_trace_id("room-1").to_string(), "354a4a87db332ece49f9a971f8e2c916");
        assert_eq!(external_trace_id("").to_string(), "132c97ae5acdf261570383bccb6a2bf5");
        assert_ne!(external_trace_id("room-1"), external_trace_id("room-2"));
    }

    #[test]
    fn local_trace_ids_are_fixed_and_tell_lifecycles_apart() {
        assert_eq!(local_trace_id("node-a", 4242, 0x10, 1_000).to_string(), "51d020da45cbe1d7cb61ccc7c356b5a7");
        let id = local_trace_id("node-a", 4242, 0x10, 1_000);
        assert_ne!(id, local_trace_id("node-b", 4242, 0x10, 1_000));
        assert_ne!(id, local_trace_id("node-a", 4243, 0x10, 1_000));
        assert_ne!(id, local_trace_id("node-a", 4242, 0x11, 1_000));
        assert_ne!(id, local_trace_id("node-a", 4242, 0x10, 1_001));
    }

    fn snapshot(stage: Stage, external_id: Option<&str>) -> RequestSnapshot {
        let mut stage_ns = [None; 4];
        for s in Stage::ALL {
            if let Some(slot) = s.timestamp_slot().filter(|_| s <= stage) {
                stage_ns[slot] = Some(1_000_000_000 + slot as u64 * 1_000_000);
            }
        }
        let last_ns = stage_ns.iter().flatten().copied().max().unwrap_or(1_000_000_000);
        RequestSnapshot {
            pid: 7,
            key: 0xab,
            external_id: external_id.map(Into::into),
            stage,
            stage_ns,
            first_ns: 1_000_000_000,
            last_ns,
            stalled: None,
            inferred: Default::default(),
        }
    }

    fn attribute(span: &SpanData, key: &'static str) -> Option<String> {
        span.attributes.iter().find(|kv| kv.key == Key::from_static_str(key)).map(|kv| kv.value.to_string())
    }

    #[test]
    fn a_healthy_request_is_one_span_with_its_stage_events() {
        let mut maker = SpanMaker::new("node-a".into(), Clock::new());
        maker.name_process(7, "demo-prefill", "demo");
        let mut spans = Vec::new();
        let request = snapshot(Stage::Released, Some("room-9"));
        let urgent = maker.push(
            Report::Ended { at_ns: request.last_ns, request, outcome: Outcome::Released },
            None,
            &Context::default(),
            &mut spans,
        );
        assert!(!urgent);
        let [span] = spans.as_slice() else { panic!("{spans:?}") };
        assert_eq!(span.name, REQUEST_SPAN);
        assert_eq!(span.span_context.trace_id(), external_trace_id("room-9"));
        assert_eq!(span.status, Status::Unset);
        let names: Vec<&str> = span.events.iter().map(|e| e.name.as_ref()).collect();
        assert_eq!(names, ["enqueued", "transfer_posted", "transfer_done", "released"]);
        assert!(span.events.windows(2).all(|w| w[0].timestamp < w[1].timestamp));
        assert_eq!(attribute(span, attr::PROCESS_PID).as_deref(), Some("7"));
        assert_eq!(attribute(span, attr::PROCESS_EXECUTABLE_NAME).as_deref(), Some("demo-prefill"));
        assert_eq!(attribute(span, attr::KEY).as_deref(), Some("0xab"));
        assert_eq!(attribute(span, attr::EXTERNAL_ID).as_deref(), Some("room-9"));
        assert_eq!(attribute(span, attr::OUTCOME).as_deref(), Some("released"));
        assert_eq!(attribute(span, attr::STALL_CLASS), None);
        assert_eq!(attribute(span, "bootstrap_room"), None, "none said");
        assert!(span.links.is_empty());
        assert_eq!(span.start_time, Clock::new().wall(1_000_000_000).max(span.start_time));
    }

    #[test]
    fn a_request_carries_its_frameworks_native_attributes_and_its_external_ids_trace_id() {
        let mut maker = SpanMaker::new("node-a".into(), Clock::new());
        let mut spans = Vec::new();
        let request = RequestSnapshot { key: 171, ..snapshot(Stage::Released, Some("171")) };
        let said = Context { native: vec![("bootstrap_room", 171)], ..Context::default() };
        maker.push(
            Report::Ended { at_ns: request.last_ns, request, outcome: Outcome::Released },
            None,
            &said,
            &mut spans,
        );
        let [span] = spans.as_slice() else { panic!("{spans:?}") };
        let room =
            span.attributes.iter().find(|kv| kv.key == Key::from_static_str("bootstrap_room")).expect("bootstrap_room");
        assert_eq!(room.value, Value::I64(171));
        assert_eq!(span.span_context.trace_id(), external_trace_id("171"));
    }

    #[test]
    fn a_stall_span_carries_the_transport_evidence() {
        let request = snapshot(Stage::TransferPosted, Some("room-3"));
        let mut tracker = crate::evidence::transport::Tracker::new(2_000_000_000);
        let mut busy = crate::evidence::transport::Totals::default();
        busy.add_for_test(ActivityKind::Progress, 4_000, Some(request.last_ns + 1_900_000_000));
        tracker.record_for_test(7, request.last_ns, crate::evidence::transport::Totals::default());
        tracker.progress_attached(7, Some(request.last_ns));
        tracker.record_for_test(7, request.last_ns + 2_000_000_000, busy);
        let evidence = tracker.evidence(&request, StallClass::TransferHung, None);
        assert!(evidence.is_some());
        let mut maker = SpanMaker::new("node-a".into(), Clock::new());
        let mut spans = Vec::new();
        let at_ns = request.last_ns + 2_000_000_000;
        let said = Context::said_by("sglang", [("handle", "0x7f00".to_owned()), ("transfer", "2".to_owned())]);
        maker.push(
            Report::Stalled { request, class: StallClass::TransferHung, silent_ns: 2_000_000_000, at_ns },
            evidence,
            &said,
            &mut spans,
        );
        let [stall] = spans.as_slice() else { panic!("{spans:?}") };
        // Where its framework says it stopped, in its name.
        assert_eq!(attribute(stall, "stallwatch.sglang.handle").as_deref(), Some("0x7f00"));
        assert_eq!(attribute(stall, "stallwatch.sglang.transfer").as_deref(), Some("2"));
        assert_eq!(attribute(stall, attr::TRANSPORT_VERDICT).as_deref(), Some("peer_unresponsive"));
        assert_eq!(attribute(stall, attr::TRANSPORT_PROGRESS_SINCE).as_deref(), Some("4000"));
        assert_eq!(attribute(stall, attr::TRANSPORT_COMPLETIONS_SINCE).as_deref(), Some("0"));
        assert_eq!(attribute(stall, attr::TRANSPORT_PROGRESS_WINDOW_MS).as_deref(), Some("2000"));
        assert!(
            attribute(stall, attr::TRANSPORT_SUMMARY)
                .is_some_and(|s| s.contains("4000 progress calls in the last 2.0s, none completed"))
        );
        assert_eq!(attribute(stall, attr::TRANSPORT_PEER), None, "no peer known");
    }

    #[test]
    fn a_stall_span_names_the_transfers_peer_where_known() {
        let request = snapshot(Stage::TransferPosted, Some("room-3"));
        let mut tracker = crate::evidence::transport::Tracker::new(2_000_000_000);
        tracker.record_for_test(7, request.last_ns, crate::evidence::transport::Totals::default());
        tracker.record_for_test(7, request.last_ns + 2_000_000_000, crate::evidence::transport::Totals::default());
        let peer = crate::evidence::peers::PeerCompletions { peer: "decode-0".into(), to_peer: 0, to_others: 14 };
        let evidence = tracker.evidence(&request, StallClass::TransferHung, Some(peer));
        let mut maker = SpanMaker::new("node-a".into(), Clock::new());
        let mut spans = Vec::new();
        let at_ns = request.last_ns + 2_000_000_000;
        maker.push(
            Report::Stalled { request, class: StallClass::TransferHung, silent_ns: 2_000_000_000, at_ns },
            evidence,
            &Context::default(),
            &mut spans,
        );
        let [stall] = spans.as_slice() else { panic!("{spans:?}") };
        assert_eq!(attribute(stall, attr::TRANSPORT_PEER).as_deref(), Some("decode-0"));
        assert_eq!(attribute(stall, attr::TRANSPORT_PEER_COMPLETIONS_SINCE).as_deref(), Some("0"));
        assert_eq!(attribute(stall, attr::TRANSPORT_OTHER_PEERS_COMPLETIONS_SINCE).as_deref(), Some("14"));
        assert_eq!(attribute(stall, attr::TRANSPORT_VERDICT).as_deref(), Some("peer_unresponsive"));
        assert_eq!(attribute(stall, attr::TRANSPORT_PROCESS_STATE), None, "not held");
    }

    /// A stopped prefill's stall span says so, as its alert does: the
    /// verdict, the process's state, and `waiting_on=self` among the fields.
    #[test]
    fn a_stall_span_of_a_stopped_process_says_it_waits_on_itself() {
        use crate::evidence::sched::Halt;
        let request = snapshot(Stage::TransferPosted, Some("room-3"));
        let mut tracker = crate::evidence::transport::Tracker::new(2_000_000_000);
        tracker.record_for_test(7, request.last_ns, crate::evidence::transport::Totals::default());
        tracker.record_for_test(7, request.last_ns + 2_000_000_000, crate::evidence::transport::Totals::default());
        let peer = crate::evidence::peers::PeerCompletions { peer: "decode-0".into(), to_peer: 0, to_others: 14 };
        let at_ns = request.last_ns + 2_000_000_000;
        let report = Report::Stalled { request, class: StallClass::TransferHung, silent_ns: 2_000_000_000, at_ns };
        let halt = Halt::Stopped { threads: 12 };
        let evidence = tracker.for_report(&report, |_| Some(peer), Some(halt));
        let mut said = Context::said_by("sglang", [("handle", "0x7f00".to_owned())]);
        said.say_halt(halt.as_str());
        let mut maker = SpanMaker::new("node-a".into(), Clock::new());
        let mut spans = Vec::new();
        maker.push(report, evidence, &said, &mut spans);
        let [stall] = spans.as_slice() else { panic!("{spans:?}") };
        assert_eq!(attribute(stall, attr::TRANSPORT_VERDICT).as_deref(), Some("process_stopped"));
        assert_eq!(attribute(stall, attr::TRANSPORT_PROCESS_STATE).as_deref(), Some("stopped"));
        // The agent's own judgement, in its own name; the framework's stays.
        assert_eq!(attribute(stall, "stallwatch.stall.waiting_on").as_deref(), Some("self"));
        assert_eq!(attribute(stall, "stallwatch.sglang.handle").as_deref(), Some("0x7f00"));
    }

    #[test]
    fn a_stall_is_a_span_at_once_and_the_request_span_links_to_it() {
        let mut maker = SpanMaker::new("node-a".into(), Clock::new());
        let mut spans = Vec::new();
        let mut request = snapshot(Stage::TransferPosted, None);
        let silent_from = request.last_ns;
        request.stalled = Some(StallClass::TransferHung);
        let at_ns = silent_from + 2_000_000_000;
        let stalled = Report::Stalled {
            request: request.clone(),
            class: StallClass::TransferHung,
            silent_ns: 2_000_000_000,
            at_ns,
        };
        assert!(maker.push(stalled, None, &Context::default(), &mut spans), "stall spans are urgent");
        let stall = spans.pop().expect("stall span");
        assert_eq!(stall.name, STALL_SPAN);
        assert!(
            matches!(&stall.status, Status::Error { description } if description.contains("transfer_hung")),
            "{:?}",
            stall.status
        );
        assert_eq!(attribute(&stall, attr::STALL_CLASS).as_deref(), Some("transfer_hung"));
        assert_eq!(attribute(&stall, attr::SILENT_MS).as_deref(), Some("2000"));
        assert_eq!(stall.span_context.trace_id(), local_trace_id("node-a", 7, 0xab, 1_000_000_000));
        assert_eq!(maker.open_lifecycles(), 1);

        // It moves on, then is released.
        request.stalled = None;
        request.last_ns = at_ns + 500_000_000;
        request.stage = Stage::TransferDone;
        request.stage_ns[2] = Some(request.last_ns);
        let recovered =
            Report::Recovered { request: request.clone(), class: StallClass::TransferHung, stuck_ns: 2_500_000_000 };
        assert!(!maker.push(recovered, None, &Context::default(), &mut spans));
        assert!(spans.is_empty(), "a recovery is an event of the request span");
        request.stage = Stage::Released;
        request.last_ns += 1_000_000;
        request.stage_ns[3] = Some(request.last_ns);
        maker.push(
            Report::Ended { at_ns: request.last_ns, request, outcome: Outcome::Released },
            None,
            &Context::default(),
            &mut spans,
        );
        let [span] = spans.as_slice() else { panic!("{spans:?}") };
        assert_eq!(span.span_context.trace_id(), stall.span_context.trace_id());
        assert_eq!(span.links.len(), 1);
        assert_eq!(span.links[0].span_context, stall.span_context);
        let names: Vec<&str> = span.events.iter().map(|e| e.name.as_ref()).collect();
        // The reviving event and the recovery share a timestamp.
        assert_eq!(names, ["enqueued", "transfer_posted", "stalled", "transfer_done", "recovered", "released"]);
        assert_eq!(attribute(span, attr::STALLS).as_deref(), Some("1"));
        assert_eq!(attribute(span, attr::STALL_CLASS).as_deref(), Some("transfer_hung"));
        assert_eq!(span.status, Status::Unset, "it recovered and completed");
        assert_eq!(maker.open_lifecycles(), 0);
    }

    #[test]
    fn spans_say_which_stages_were_observed_and_which_inferred() {
        let mut maker = SpanMaker::new("node-a".into(), Clock::new());
        let mut spans = Vec::new();
        // Posted by a probe, found done in memory when its stall was due.
        let mut request = snapshot(Stage::TransferDone, None);
        request.inferred.insert(Stage::TransferDone);
        let at_ns = request.last_ns + 2_000_000_000;
        request.stalled = Some(StallClass::ReleaseLost);
        maker.push(
            Report::Stalled {
                request: request.clone(),
                class: StallClass::ReleaseLost,
                silent_ns: 2_000_000_000,
                at_ns,
            },
            None,
            &Context::default(),
            &mut spans,
        );
        let stall = spans.pop().expect("stall span");
        assert_eq!(attribute(&stall, attr::STAGES_OBSERVED).as_deref(), Some("[\"enqueued\",\"transfer_posted\"]"));
        assert_eq!(attribute(&stall, attr::STAGES_INFERRED).as_deref(), Some("[\"transfer_done\"]"));
        let marked: Vec<(&str, bool)> = stall
            .events
            .iter()
            .map(|e| (e.name.as_ref(), e.attributes.iter().any(|kv| kv.key.as_str() == attr::STAGE_INFERRED)))
            .collect();
        assert_eq!(marked, [("enqueued", false), ("transfer_posted", false), ("transfer_done", true)]);

        // Another ends failed by a read: the failure is inferred.
        let mut failed = snapshot(Stage::TransferPosted, None);
        failed.key = 0xac;
        failed.stage = Stage::Failed;
        failed.inferred.insert(Stage::Failed);
        maker.push(
            Report::Ended { at_ns: failed.last_ns + 2_000_000_000, request: failed, outcome: Outcome::Failed },
            None,
            &Context::default(),
            &mut spans,
        );
        let [span] = spans.as_slice() else { panic!("{spans:?}") };
        assert_eq!(attribute(span, attr::STAGES_OBSERVED).as_deref(), Some("[\"enqueued\",\"transfer_posted\"]"));
        assert_eq!(attribute(span, attr::STAGES_INFERRED).as_deref(), Some("[\"failed\"]"));
        let last = span.events.last().expect("events");
        assert_eq!((last.name.as_ref(), last.attributes.len()), ("failed", 1));
    }

    #[test]
    fn ending_while_stuck_is_an_error() {
        let mut maker = SpanMaker::new("node-a".into(), Clock::new());
        let mut spans = Vec::new();
        let mut request = snapshot(Stage::Enqueued, Some("room-3"));
        request.stalled = Some(StallClass::WaitingForPeer);
        let at_ns = request.last_ns + 5_000_000_000;
        maker.push(
            Report::Ended { request, outcome: Outcome::ProcessExited, at_ns },
            None,
            &Context::default(),
            &mut spans,
        );
        let [span] = spans.as_slice() else { panic!("{spans:?}") };
        assert!(matches!(&span.status, Status::Error { description } if description.contains("waiting_for_peer")));
        assert_eq!(span.events.last().map(|e| e.name.as_ref()), Some("process_exited"));
        assert_eq!(attribute(span, attr::STALL_CLASS).as_deref(), Some("waiting_for_peer"));
    }
}
