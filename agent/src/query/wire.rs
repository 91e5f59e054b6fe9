//! The wire format between `stallwatch inflight` and a running agent:
//! newline-delimited JSON over the agent's unix socket, one query and one
//! answer per connection.
//!
//! ```text
//! -> {"version":1,"query":"inflight"}
//! <- {"version":1,"agent_pid":4242,"at":"2025-01-01T00:00:00.000Z","timeout_ms":2000,
//!     "processes":[{"pid":4243,"process":"demo-prefill","profile":"demo","in_flight":3,"stalled":2,
//!                   "workload":{"k8s.namespace.name":"llm","k8s.pod.name":"prefill-0",..},
//!                   "transport":{"post":{"total":9,"last_ago_ms":5000},"completion":{..},"progress":{..}}}],
//!     "requests":[{"pid":4243,"process":"demo-prefill","profile":"demo","key":"0x10000000000",
//!                  "workload":{"k8s.namespace.name":"llm","k8s.pod.name":"prefill-0",..},
//!                  "external_id":"room-1099511627776","stage":"enqueued",
//!                  "age_ms":5012,"silent_ms":5012,"class":"waiting_for_peer",
//!                  "transport":{"verdict":"idle","summary":"last post 5.0s ago, ..."}}, ...]}
//! <- {"version":1,"error":"..."}                      (instead, when the query is refused)
//! ```
//!
//! `requests` is sorted by age, oldest first. Names (`stage`, `class`) are
//! the engine's stable names; keys are hex strings as in the alert lines;
//! durations are whole milliseconds as of `at`. Unknown fields are ignored
//! on both sides, so fields can be added without a version bump; a change
//! of meaning bumps [`VERSION`]. `stallwatch inflight --json` prints the
//! answer as it came. `workload` (the watched process's container and
//! pod, keyed as in the alert lines and on spans) is left out when
//! nothing is known of it.
use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use serde::{Deserialize, Serialize};

use crate::{
    evidence::transport::{ProcessTransport, Totals},
    export::workload::Workload,
    lifecycle::{RequestSnapshot, Stage, StallClass},
    profile::ActivityKind,
};

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;

/// What a client asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Query {
    #[serde(default = "version")]
    pub version: u32,
    pub query: QueryKind,
}

fn version() -> u32 {
    VERSION
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueryKind {
    /// Every request in flight.
    Inflight,
}

/// The answer to [`QueryKind::Inflight`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inflight {
    pub version: u32,
    /// The agent that answered.
    pub agent_pid: u32,
    /// Wall-clock time of the snapshot (RFC 3339, UTC): ages are as of then.
    pub at: String,
    /// The agent's `--timeout`: a request silent this long is stalled.
    pub timeout_ms: u64,
    /// Every process the agent watches, whether or not it holds requests.
    pub processes: Vec<Process>,
    /// Every request in flight, oldest first.
    pub requests: Vec<InflightRequest>,
}

/// One watched process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Process {
    pub pid: u32,
    /// Its name when the agent attached (`/proc/PID/comm`).
    pub process: String,
    /// The profile it is watched with (the first rule it matched).
    #[serde(default)]
    pub profile: String,
    /// Requests it holds now.
    pub in_flight: u64,
    /// Of those, the ones stalled.
    pub stalled: u64,
    /// Its container and pod, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
    /// What the transport of this process has done (its `[[activity]]`
    /// probes and lifecycle completions); `null` when its profile has no
    /// transport probes.
    pub transport: Option<TransportEvidence>,
}

/// Per-process transport counts since the agent attached.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportEvidence {
    pub post: ActivityCount,
    pub completion: ActivityCount,
    /// Counted only while the progress probes are attached (near a stall).
    pub progress: ActivityCount,
    /// How long the progress probes have been attached, as of the agent's
    /// last sample; `null`: they are not (no request is near its stall).
    #[serde(default)]
    pub progress_attached_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivityCount {
    pub total: u64,
    /// Since the last call, as of the agent's last sample; `null`: never.
    pub last_ago_ms: Option<u64>,
}

impl TransportEvidence {
    fn of(totals: &Totals, at_ns: u64, progress_attached_ns: Option<u64>) -> Self {
        let count = |kind| {
            let activity = totals.get(kind);
            ActivityCount {
                total: activity.calls,
                last_ago_ms: activity.last_ns.map(|ns| ms(at_ns.saturating_sub(ns))),
            }
        };
        Self {
            post: count(ActivityKind::Post),
            completion: count(ActivityKind::Completion),
            progress: count(ActivityKind::Progress),
            progress_attached_ms: progress_attached_ns.map(ms),
        }
    }
}

/// What the transport did since a stalled request's last event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestTransport {
    /// `peer_unresponsive`, `no_progress`, `others_completing` or `idle`.
    pub verdict: String,
    /// "last post 57.0s ago, last completion 57.0s ago, 120000 progress
    /// calls in the last 30.0s, none completed".
    pub summary: String,
}

/// One request in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InflightRequest {
    pub pid: u32,
    pub process: String,
    /// The profile that judges it: its process's.
    #[serde(default)]
    pub profile: String,
    /// Its process's container and pod, where known: on every row, so a
    /// row read alone (`jq '.requests[]'`) names the stuck workload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
    #[serde(with = "hex_key")]
    pub key: u64,
    pub external_id: Option<String>,
    /// Furthest stage reached.
    #[serde(with = "stage_name")]
    pub stage: Stage,
    /// The stages no probe saw, read from the target's memory instead
    /// (the profile's `[status]`): the rest were observed.
    #[serde(default, with = "stage_names")]
    pub inferred: Vec<Stage>,
    /// Since its first lifecycle event.
    pub age_ms: u64,
    /// Since its last lifecycle event.
    pub silent_ms: u64,
    /// Set while it is stalled (silent past the timeout).
    #[serde(with = "class_name")]
    pub class: Option<StallClass>,
    /// Stalled requests of processes with transport probes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<RequestTransport>,
    /// Where it stands, as the signals' trackers know it (an SGLang room:
    /// `handle` and `transfer` of its transfer posted and not done, or
    /// `answered`, `waiting_on` and `behind`), the fields its alert has.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub context: BTreeMap<String, String>,
}

/// A refused query.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub version: u32,
    pub error: String,
}

/// What the agent takes from its engine to answer one inflight query; the
/// rest of the work ([`Snapshot::into_answer`], [`encode`]) happens off
/// the event loop.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub agent_pid: u32,
    pub at: String,
    pub now_ns: u64,
    pub timeout_ns: u64,
    /// Watched processes: their names and profiles.
    pub processes: Vec<(u32, String, String)>,
    /// The workloads of those whose workload is known.
    pub workloads: HashMap<u32, Arc<Workload>>,
    /// In any order.
    pub requests: Vec<RequestSnapshot>,
    /// The transport history of the watched processes that have one: the
    /// evidence of stalled requests is worked out from it off the loop.
    pub transport: Vec<(u32, ProcessTransport)>,
    /// (pid, key) -> what the signals' trackers say of the request, for
    /// those they know.
    pub fields: HashMap<(u32, u64), Vec<(&'static str, String)>>,
}

impl Snapshot {
    /// Sort oldest first and convert to the wire form.
    pub fn into_answer(self) -> Inflight {
        let Snapshot {
            agent_pid,
            at,
            now_ns,
            timeout_ns,
            mut processes,
            workloads,
            mut requests,
            transport,
            mut fields,
        } = self;
        let workload = |pid: u32| workloads.get(&pid).map(|workload| Workload::clone(workload));
        requests.sort_unstable_by_key(oldest_first);
        processes.sort_unstable();
        processes.dedup_by_key(|(pid, _, _)| *pid);
        let mut counts: Vec<Process> = processes
            .into_iter()
            .map(|(pid, process, profile)| {
                let transport = transport_of(&transport, pid)
                    .and_then(ProcessTransport::latest)
                    .map(|(totals, at_ns, attached_ns)| TransportEvidence::of(&totals, at_ns, attached_ns));
                Process { pid, workload: workload(pid), process, profile, in_flight: 0, stalled: 0, transport }
            })
            .collect();
        let rows = requests
            .into_iter()
            .map(|request| {
                let evidence = request
                    .stalled
                    .and_then(|class| transport_of(&transport, request.pid)?.evidence(&request, class, None));
                let (process, profile) = match counts.binary_search_by_key(&request.pid, |p| p.pid) {
                    Ok(i) => {
                        let entry = &mut counts[i];
                        entry.in_flight += 1;
                        entry.stalled += u64::from(request.stalled.is_some());
                        (entry.process.clone(), entry.profile.clone())
                    }
                    // A request of a process the agent never named (it
                    // only watches named ones): shown, not counted.
                    Err(_) => ("?".to_owned(), "?".to_owned()),
                };
                InflightRequest {
                    pid: request.pid,
                    process,
                    profile,
                    workload: workload(request.pid),
                    key: request.key,
                    age_ms: ms(request.age_ns(now_ns)),
                    silent_ms: ms(request.silent_ns(now_ns)),
                    external_id: request.external_id.map(String::from),
                    stage: request.stage,
                    inferred: request.inferred.iter().collect(),
                    class: request.stalled,
                    transport: evidence.map(|evidence| RequestTransport {
                        verdict: evidence.verdict.as_str().to_owned(),
                        summary: evidence.summary(),
                    }),
                    context: fields
                        .remove(&(request.pid, request.key))
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(name, value)| (name.to_owned(), value))
                        .collect(),
                }
            })
            .collect();
        Inflight { version: VERSION, agent_pid, at, timeout_ms: ms(timeout_ns), processes: counts, requests: rows }
    }
}

fn transport_of(transport: &[(u32, ProcessTransport)], pid: u32) -> Option<&ProcessTransport> {
    transport.iter().find(|(p, _)| *p == pid).map(|(_, process)| process)
}

/// Oldest first (earliest first event); ties by pid, then key, so the
/// order is the same for the same requests.
fn oldest_first(request: &RequestSnapshot) -> (u64, u32, u64) {
    (request.first_ns, request.pid, request.key)
}

fn ms(ns: u64) -> u64 {
    ns / 1_000_000
}

/// One JSON line, newline included.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these types cannot fail (string keys, no non-finite
    // floats); should it ever, the client gets a refusal it can show.
    let mut line = serde_json::to_vec(value).unwrap_or_else(|err| {
        let reply = ErrorReply { version: VERSION, error: format!("encoding the answer: {err}") };
        serde_json::to_vec(&reply).unwrap_or_default()
    });
    line.push(b'\n');
    line
}

/// An error answer line.
pub fn encode_error(error: &str) -> Vec<u8> {
    encode(&ErrorReply { version: VERSION, error: error.to_owned() })
}

/// Parse a query line (the agent's side).
pub fn decode_query(line: &[u8]) -> Result<Query, String> {
    let query: Query = serde_json::from_slice(line).map_err(|err| format!("unreadable query: {err}"))?;
    if query.version != VERSION {
        return Err(format!(
            "query protocol version {} is not spoken by this agent (version {VERSION}): use the stallwatch binary the agent runs",
            query.version
        ));
    }
    Ok(query)
}

/// Why an answer could not be used (the client's side).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnswerError {
    /// The agent refused the query and said why.
    Refused(String),
    /// The agent speaks another protocol version.
    Version(u32),
    /// Not an answer at all.
    Garbled(String),
}

impl std::fmt::Display for AnswerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AnswerError::Refused(error) => write!(f, "the agent refused the query: {error}"),
            AnswerError::Version(v) => write!(
                f,
                "the agent speaks query protocol version {v}, this stallwatch speaks {VERSION}: use the stallwatch binary the agent runs"
            ),
            AnswerError::Garbled(why) => write!(f, "garbled answer: {why}"),
        }
    }
}

impl std::error::Error for AnswerError {}

/// Parse an inflight answer (the whole line, newline optional).
pub fn decode_inflight(answer: &[u8]) -> Result<Inflight, AnswerError> {
    match serde_json::from_slice::<Inflight>(answer) {
        Ok(inflight) if inflight.version == VERSION => Ok(inflight),
        Ok(inflight) => Err(AnswerError::Version(inflight.version)),
        Err(err) => {
            // Not an answer: a refusal, another version, or garbage (tried
            // in that order; these parses only run on the failure path).
            if let Ok(reply) = serde_json::from_slice::<ErrorReply>(answer) {
                return Err(AnswerError::Refused(reply.error));
            }
            #[derive(Deserialize)]
            struct Versioned {
                version: u32,
            }
            match serde_json::from_slice::<Versioned>(answer) {
                Ok(v) if v.version != VERSION => Err(AnswerError::Version(v.version)),
                _ => Err(AnswerError::Garbled(format!("{err} (answer starts {:?})", excerpt(answer)))),
            }
        }
    }
}

fn excerpt(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(60)]);
    text.into_owned()
}

mod hex_key {
    use serde::{Deserialize as _, Deserializer, Serializer, de::Error as _};

    pub fn serialize<S: Serializer>(key: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{key:#x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        let digits =
            text.strip_prefix("0x").ok_or_else(|| D::Error::custom(format!("key {text:?} is not 0x-prefixed hex")))?;
        u64::from_str_radix(digits, 16).map_err(|err| D::Error::custom(format!("key {text:?}: {err}")))
    }
}

mod stage_name {
    use serde::{Deserialize as _, Deserializer, Serializer, de::Error as _};

    use crate::lifecycle::Stage;

    pub fn serialize<S: Serializer>(stage: &Stage, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(stage.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Stage, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        text.parse().map_err(D::Error::custom)
    }
}

mod stage_names {
    use serde::{Deserialize as _, Deserializer, Serializer, de::Error as _, ser::SerializeSeq as _};

    use crate::lifecycle::Stage;

    pub fn serialize<S: Serializer>(stages: &[Stage], s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(stages.len()))?;
        for stage in stages {
            seq.serialize_element(stage.as_str())?;
        }
        seq.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Stage>, D::Error> {
        let names = <Vec<std::borrow::Cow<'de, str>>>::deserialize(d)?;
        names.iter().map(|name| name.parse().map_err(D::Error::custom)).collect()
    }
}

mod class_name {
    use serde::{Deserialize as _, Deserializer, Serializer, de::Error as _};

    use crate::lifecycle::StallClass;

    pub fn serialize<S: Serializer>(class: &Option<StallClass>, s: S) -> Result<S::Ok, S::Error> {
        match class {
            Some(class) => s.serialize_str(class.as_str()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<StallClass>, D::Error> {
        let text = <Option<std::borrow::Cow<'de, str>>>::deserialize(d)?;
        text.map(|text| text.parse().map_err(D::Error::custom)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn request(
        pid: u32,
        key: u64,
        stage: Stage,
        first_ns: u64,
        last_ns: u64,
        stalled: Option<StallClass>,
    ) -> RequestSnapshot {
        RequestSnapshot {
            pid,
            key,
            external_id: Some(format!("room-{key}").into()),
            stage,
            stage_ns: [Some(first_ns), None, None, None],
            first_ns,
            last_ns,
            stalled,
            inferred: Default::default(),
        }
    }

    fn snapshot(requests: Vec<RequestSnapshot>) -> Snapshot {
        Snapshot {
            agent_pid: 1,
            at: "2025-01-01T00:00:00.000Z".to_owned(),
            now_ns: 10_000_000_000,
            timeout_ns: 2_000_000_000,
            processes: vec![
                (42, "demo-prefill".to_owned(), "demo".to_owned()),
                (7, "other".to_owned(), "nixl".to_owned()),
            ],
            workloads: HashMap::new(),
            requests,
            transport: Vec::new(),
            fields: HashMap::new(),
        }
    }

    #[test]
    fn a_row_has_the_documented_fields_and_names() {
        let answer = snapshot(vec![request(
            42,
            0x100_0000_0000,
            Stage::TransferPosted,
            4_000_000_000,
            5_500_000_000,
            Some(StallClass::TransferHung),
        )])
        .into_answer();
        let value: Value = serde_json::from_slice(&encode(&answer)).expect("valid JSON");
        assert_eq!(
            value["requests"][0],
            json!({
                "pid": 42,
                "process": "demo-prefill",
                "profile": "demo",
                "key": "0x10000000000",
                "external_id": "room-1099511627776",
                "stage": "transfer_posted",
                "inferred": [],
                "age_ms": 6000,
                "silent_ms": 4500,
                "class": "transfer_hung",
            })
        );
        assert_eq!(value["version"], 1);
        assert_eq!(value["timeout_ms"], 2000);
        assert_eq!(value["at"], "2025-01-01T00:00:00.000Z");
        // Every watched process is listed, holding requests or not, with the
        // transport place reserved and empty.
        assert_eq!(
            value["processes"],
            json!([
                {"pid": 7, "process": "other", "profile": "nixl", "in_flight": 0, "stalled": 0, "transport": null},
                {"pid": 42, "process": "demo-prefill", "profile": "demo", "in_flight": 1, "stalled": 1, "transport": null},
            ])
        );
    }

    #[test]
    fn rows_and_processes_name_their_workload_where_known() {
        let pod = Workload {
            namespace: Some("llm".into()),
            pod: Some("prefill-0".into()),
            container: Some("sglang".into()),
            node: Some("gpu-1".into()),
            ..Workload::default()
        };
        let mut snapshot = snapshot(vec![
            request(42, 1, Stage::Enqueued, 1_000_000_000, 1_000_000_000, None),
            request(7, 2, Stage::Enqueued, 2_000_000_000, 2_000_000_000, None),
        ]);
        snapshot.workloads.insert(42, Arc::new(pod));
        let value: Value = serde_json::from_slice(&encode(&snapshot.into_answer())).expect("valid JSON");
        let named = json!({"k8s.namespace.name": "llm", "k8s.pod.name": "prefill-0",
                           "k8s.container.name": "sglang", "k8s.node.name": "gpu-1"});
        assert_eq!(value["requests"][0]["workload"], named);
        assert_eq!(value["requests"][1].get("workload"), None, "unknown: left out");
        assert_eq!(value["processes"][1]["workload"], named);
        assert_eq!(value["processes"][0].get("workload"), None);
        let answer = decode_inflight(&encode(&value)).expect("decodes");
        assert_eq!(answer.requests[0].workload.as_ref().and_then(|w| w.pod.as_deref()), Some("prefill-0"));
    }

    #[test]
    fn a_rooms_row_says_where_it_stands_and_others_have_no_context() {
        let mut answer = snapshot(vec![
            request(42, 17, Stage::Enqueued, 4_000_000_000, 4_000_000_000, Some(StallClass::WaitingForPeer)),
            request(42, 18, Stage::Enqueued, 4_000_000_000, 4_000_000_000, None),
        ]);
        answer.fields.insert(
            (42, 17),
            vec![("answered", "1/1".to_owned()), ("behind", "16".to_owned()), ("waiting_on", "worker".to_owned())],
        );
        let value: Value = serde_json::from_slice(&encode(&answer.into_answer())).expect("valid JSON");
        assert_eq!(value["requests"][0]["context"], json!({"answered": "1/1", "behind": "16", "waiting_on": "worker"}));
        assert!(value["requests"][1].get("context").is_none(), "{}", value["requests"][1]);
        let decoded = decode_inflight(&encode(&value)).expect("decodes");
        assert_eq!(decoded.requests[0].context.get("waiting_on").map(String::as_str), Some("worker"));
    }

    #[test]
    fn a_healthy_request_has_a_null_class_and_a_missing_external_id_is_null() {
        let mut healthy = request(42, 5, Stage::Enqueued, 9_990_000_000, 9_990_000_000, None);
        healthy.external_id = None;
        let answer = snapshot(vec![healthy]).into_answer();
        let value: Value = serde_json::from_slice(&encode(&answer)).expect("valid JSON");
        assert_eq!(value["requests"][0]["class"], Value::Null);
        assert_eq!(value["requests"][0]["external_id"], Value::Null);
        assert_eq!(value["requests"][0]["age_ms"], 10);
    }

    #[test]
    fn answers_round_trip() {
        let answer = snapshot(vec![
            request(42, u64::MAX, Stage::TransferDone, 1, 2, Some(StallClass::ReleaseLost)),
            request(42, 0, Stage::Enqueued, 3, 4, None),
        ])
        .into_answer();
        let line = encode(&answer);
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1, "one line");
        assert_eq!(decode_inflight(&line), Ok(answer));
    }

    #[test]
    fn sorted_oldest_first_with_ties_broken_by_pid_and_key() {
        let answer = snapshot(vec![
            request(42, 3, Stage::Enqueued, 5_000, 5_000, None),
            request(42, 2, Stage::Enqueued, 1_000, 9_000, None),
            request(7, 9, Stage::Enqueued, 5_000, 5_000, None),
            request(42, 1, Stage::Enqueued, 5_000, 6_000, None),
            request(42, 4, Stage::Enqueued, 9_000_000, 9_000_000, None),
        ])
        .into_answer();
        let order: Vec<(u32, u64)> = answer.requests.iter().map(|r| (r.pid, r.key)).collect();
        assert_eq!(order, [(42, 2), (7, 9), (42, 1), (42, 3), (42, 4)]);
        assert!(answer.requests.windows(2).all(|w| w[0].age_ms >= w[1].age_ms));
    }

    #[test]
    fn a_request_of_an_unnamed_process_is_listed_uncounted() {
        let answer = snapshot(vec![request(99, 1, Stage::Enqueued, 0, 0, None)]).into_answer();
        assert_eq!(answer.requests[0].process, "?");
        assert!(answer.processes.iter().all(|p| p.in_flight == 0));
    }

    #[test]
    fn a_clock_behind_the_events_gives_zero_ages() {
        let mut s = snapshot(vec![request(42, 1, Stage::Enqueued, 20_000_000_000, 20_000_000_000, None)]);
        s.now_ns = 1;
        let answer = s.into_answer();
        assert_eq!((answer.requests[0].age_ms, answer.requests[0].silent_ms), (0, 0));
    }

    #[test]
    fn queries_parse_with_or_without_a_version() {
        let expected = Query { version: 1, query: QueryKind::Inflight };
        assert_eq!(decode_query(br#"{"query":"inflight"}"#), Ok(expected.clone()));
        assert_eq!(decode_query(b"{\"version\":1,\"query\":\"inflight\",\"extra\":true}\n"), Ok(expected.clone()));
        assert_eq!(decode_query(&encode(&expected)), Ok(expected));
    }

    #[test]
    fn bad_queries_are_refused_with_a_reason() {
        let unknown = decode_query(br#"{"query":"everything"}"#).expect_err("unknown query");
        assert!(unknown.contains("unknown variant `everything`") && unknown.contains("inflight"), "{unknown}");
        let garbage = decode_query(b"GET / HTTP/1.1").expect_err("not JSON");
        assert!(garbage.starts_with("unreadable query"), "{garbage}");
        let future = decode_query(br#"{"version":2,"query":"inflight"}"#).expect_err("other version");
        assert!(future.contains("version 2"), "{future}");
    }

    #[test]
    fn refusals_versions_and_garbage_are_told_apart() {
        assert_eq!(decode_inflight(&encode_error("busy")), Err(AnswerError::Refused("busy".to_owned())));
        let mut answer = snapshot(Vec::new()).into_answer();
        answer.version = 2;
        assert_eq!(decode_inflight(&encode(&answer)), Err(AnswerError::Version(2)));
        assert_eq!(decode_inflight(br#"{"version":3,"something":"else"}"#), Err(AnswerError::Version(3)));
        for garbage in [&b"hello"[..], b"", b"{\"version\":1}", b"{\"version\":1,\"requests\":[{\"key\":12}]}"] {
            match decode_inflight(garbage) {
                Err(AnswerError::Garbled(why)) => assert!(why.contains("answer starts"), "{why}"),
                other => panic!("{garbage:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn keys_stages_and_classes_are_checked_when_read() {
        let answer =
            snapshot(vec![request(42, 1, Stage::Enqueued, 0, 0, Some(StallClass::WaitingForPeer))]).into_answer();
        let text = String::from_utf8(encode(&answer)).expect("UTF-8");
        for (good, bad) in [("\"0x1\"", "\"1\""), ("\"enqueued\"", "\"queued\""), ("\"waiting_for_peer\"", "\"stuck\"")]
        {
            let broken = text.replace(good, bad);
            assert!(matches!(decode_inflight(broken.as_bytes()), Err(AnswerError::Garbled(_))), "{broken}");
        }
    }

    #[test]
    fn transport_evidence_is_per_process_and_per_stalled_request() {
        let mut snapshot = snapshot(vec![request(
            42,
            1,
            Stage::TransferPosted,
            1_000_000_000,
            2_000_000_000,
            Some(StallClass::TransferHung),
        )]);
        let mut tracker = crate::evidence::transport::Tracker::new(2_000_000_000);
        let mut totals = Totals::default();
        totals.add_for_test(ActivityKind::Progress, 500, Some(9_000_000_000));
        totals.add_for_test(ActivityKind::Post, 1, Some(2_000_000_000));
        tracker.record_for_test(42, 1_500_000_000, Totals::default());
        tracker.progress_attached(42, Some(1_500_000_000));
        tracker.record_for_test(42, 9_500_000_000, totals);
        snapshot.transport.push((42, tracker.process(42).expect("recorded").clone()));
        let value: Value = serde_json::from_slice(&encode(&snapshot.into_answer())).expect("JSON");
        assert_eq!(
            value["processes"][1]["transport"],
            json!({
                "post": {"total": 1, "last_ago_ms": 7500},
                "completion": {"total": 0, "last_ago_ms": null},
                "progress": {"total": 500, "last_ago_ms": 500},
                "progress_attached_ms": 8000,
            })
        );
        assert_eq!(value["requests"][0]["transport"]["verdict"], "peer_unresponsive");
        assert_eq!(
            value["requests"][0]["transport"]["summary"],
            "last post 7.5s ago, last completion never, 500 progress calls in the last 8.0s, none completed"
        );
    }

    #[test]
    fn fields_from_a_newer_agent_are_ignored() {
        let mut value: Value = serde_json::from_slice(&encode(&snapshot(Vec::new()).into_answer())).expect("JSON");
        value["processes"][0]["transport"] = json!({"post": {"total": 1, "last_ago_ms": 2, "rate": 3}, "completion": {"total": 0, "last_ago_ms": null}, "progress": {"total": 0, "last_ago_ms": null}, "verbs": 1});
        let line = serde_json::to_vec(&value).expect("JSON");
        let answer = decode_inflight(&line).expect("accepted");
        assert_eq!(answer.processes[0].transport.as_ref().map(|t| t.post.total), Some(1));
    }
}
