//! One line per alert on stdout: human-readable or JSON lines.
//!
//! Alerts are the reports someone must look at: a stall (while it is still
//! stuck), a recovery from one, and the lifecycles that ended badly
//! (failed, process exited, evicted by the tracking cap). Normal ends are
//! only counted, in the summary.
use std::{collections::HashMap, io::Write, time::Duration};

use serde_json::{Map, Value, json};
use tracing::info;

use crate::evidence::status::StatusReads;
use crate::evidence::transport::Evidence;
use crate::export::workload::{Directory, Workload};
use crate::kernel::ring::Losses;
use crate::lifecycle::{Context, EngineStats, Outcome, Report, RequestSnapshot, Stage};
use crate::util::clock::Clock;
use crate::util::text;
use crate::{kernel::ProbeHits, profile::ActivityKind};

/// The `version` of every JSON line (alerts and the summary): a log
/// pipeline parsing them pins it. Fields may be added within a version;
/// one changing meaning or going away bumps it (docs/schema.md).
pub const SCHEMA_VERSION: u32 = 1;

/// A JSON line with its [`SCHEMA_VERSION`] (added after `json!`, whose
/// summary object is at the macro's recursion limit).
fn versioned(mut line: Value) -> Value {
    if let Some(object) = line.as_object_mut() {
        object.insert("version".to_owned(), json!(SCHEMA_VERSION));
    }
    line
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Human,
    Json,
}

/// What the agent's own outputs lost in a run, and the processes it could
/// not watch: the summary's own counts.
#[derive(Debug, Default, Clone, Copy)]
pub struct Shortfalls {
    /// Spans (or the reports they came from) that never reached the OTLP
    /// collector; 0 without OTLP.
    pub export_drops: u64,
    /// Alert lines dropped because stdout did not drain.
    pub alert_lines_dropped: u64,
    /// Alert lines whose write to stdout failed (a full disk, say).
    pub alert_lines_failed: u64,
    /// Processes a selector matched that could not be watched.
    pub refused_processes: u64,
}

pub struct AlertWriter<W> {
    out: W,
    format: Format,
    clock: Clock,
    /// Process names and profiles by pid, taken when a process is attached
    /// (it may be gone by the time its requests are reported).
    names: HashMap<u32, (Box<str>, Box<str>)>,
    /// The watched processes' workloads (pod, container), when known.
    workloads: Option<Directory>,
    /// Set when stdout's reader went away (`| head`): the first write that
    /// finds it closed fails, so the agent stops; later ones (the stop's
    /// own reports and summary) are dropped, so the stop is a clean one.
    closed: bool,
    /// Set once the agent is stopping: a reader found gone then is no
    /// error (nobody is left to tell, and the stop must still hand over).
    stopping: bool,
}

impl<W: Write> AlertWriter<W> {
    pub fn new(out: W, format: Format, clock: Clock) -> Self {
        Self { out, format, clock, names: HashMap::new(), workloads: None, closed: false, stopping: false }
    }

    /// Alerts name the workload (namespace/pod/container, or the container
    /// id) of the process whose request it is.
    pub fn with_workloads(mut self, workloads: Directory) -> Self {
        self.workloads = Some(workloads);
        self
    }

    fn workload(&self, pid: u32) -> Option<std::sync::Arc<Workload>> {
        self.workloads.as_ref()?.get(pid).filter(|w| !w.is_empty())
    }

    /// Whether stdout's reader went away.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The agent is stopping: from now on a closed stdout is not an error.
    /// Without this, a reader gone before anything was written (the
    /// summary is the first write) failed the stop and skipped its
    /// hand-over.
    pub fn stopping(&mut self) {
        self.stopping = true;
    }

    fn write_line(&mut self, line: &str) -> std::io::Result<()> {
        if self.closed {
            return Ok(());
        }
        let written = writeln!(self.out, "{line}").and_then(|()| self.out.flush());
        if written.as_ref().is_err_and(|err| err.kind() == std::io::ErrorKind::BrokenPipe) {
            self.closed = true;
            if self.stopping {
                info!("stdout was closed (its reader went away): the stop's reports and summary are not written");
                return Ok(());
            }
        }
        written
    }

    /// Where the lines go.
    pub fn output(&self) -> &W {
        &self.out
    }

    pub fn output_mut(&mut self) -> &mut W {
        &mut self.out
    }

    /// The name alerts give `pid`'s process, and the profile that judges
    /// its requests.
    pub fn name_process(&mut self, pid: u32, name: &str, profile: &str) {
        self.names.insert(pid, (name.into(), profile.into()));
    }

    /// Write the alert line a report calls for, if any, with the transport
    /// evidence of its process where there is some.
    pub fn report(&mut self, report: &Report, evidence: Option<&Evidence>, said: &Context) -> std::io::Result<()> {
        let Some(mut alert) = Alert::of(report) else {
            return Ok(());
        };
        alert.evidence = evidence;
        alert.said = said;
        let line = match self.format {
            Format::Human => self.human(&alert),
            Format::Json => self.json(&alert).to_string(),
        };
        self.write_line(&line)
    }

    /// The end-of-run summary, written and returned (to be written
    /// elsewhere if stdout does not take it). `outputs`: what the agent's
    /// own outputs lost, and the processes it could not watch.
    /// Every attached probe's hit count follows (a `PROBE` line each, or a
    /// `probes` array in JSON): a probe that never fired is visible.
    /// `status`: how the reads of the profile's `[status]` went, if it has one.
    pub fn summary(
        &mut self,
        stats: &EngineStats,
        losses: &Losses,
        outputs: &Shortfalls,
        probes: &[ProbeHits],
        status: Option<&StatusReads>,
    ) -> std::io::Result<String> {
        let kernel = &losses.kernel;
        let line = match self.format {
            Format::Human => format!(
                "SUMMARY seen={} restored={} completed={} (unreleased={}) stalled={} recovered={} failed={} aborted={} process_exited={} \
                 evicted={} end_unseen={} lease_expired={} kv_read_after_release={} leaked={} resyncs={} in_flight={} lost_events={} (ringbuf_full={} key_unreadable={} args_missing={} no_slot={} undecodable={}) \
                 ext_unreadable={} stale_events={} duplicate_events={} caught_up_repeats={} export_drops={} alert_lines_dropped={} alert_lines_failed={} \
                 refused_processes={} state_full={} withheld={} caught_up={}",
                stats.seen,
                stats.restored,
                stats.completed,
                stats.completed_unreleased,
                stats.stalled,
                stats.recovered,
                stats.failed,
                stats.aborted,
                stats.process_exited,
                stats.evicted,
                stats.end_unseen,
                stats.lease_expired,
                stats.kv_read_after_release,
                stats.leaked,
                stats.resyncs,
                stats.in_flight,
                losses.lost(),
                kernel.ringbuf_full,
                kernel.key_unreadable,
                kernel.args_missing,
                kernel.no_slot,
                losses.undecodable,
                kernel.ext_unreadable,
                stats.stale_events,
                stats.duplicate_events,
                stats.caught_up_repeats,
                outputs.export_drops,
                outputs.alert_lines_dropped,
                outputs.alert_lines_failed,
                outputs.refused_processes,
                kernel.state_full,
                kernel.withheld,
                stats.caught_up,
            ) + &status
                .map(|r| {
                    format!(
                        " status_reads={} (answered={} not_held={} process_gone={} unreadable={} unrecognised={} off={})",
                        r.total(),
                        r.answered,
                        r.not_held,
                        r.process_gone,
                        r.unreadable,
                        r.unrecognised,
                        r.off
                    )
                })
                .unwrap_or_default()
                + &probes
                .iter()
                .map(|p| {
                    format!(
                        "\nPROBE pid={} role={} hits={} attached={} symbol={}",
                        p.pid,
                        p.role,
                        p.hits,
                        p.attached.as_str(),
                        text::value(&p.symbol)
                    )
                })
                .collect::<String>(),
            Format::Json => versioned(json!({
                "alert": "summary",
                "seen": stats.seen,
                "restored": stats.restored,
                "completed": stats.completed,
                "completed_unreleased": stats.completed_unreleased,
                "stalled": stats.stalled,
                "recovered": stats.recovered,
                "failed": stats.failed,
                "aborted": stats.aborted,
                "process_exited": stats.process_exited,
                "evicted": stats.evicted,
                "end_unseen": stats.end_unseen,
                "lease_expired": stats.lease_expired,
                "kv_read_after_release": stats.kv_read_after_release,
                "leaked": stats.leaked,
                "resyncs": stats.resyncs,
                "in_flight": stats.in_flight,
                "lost_events": losses.lost(),
                "ringbuf_full": kernel.ringbuf_full,
                "key_unreadable": kernel.key_unreadable,
                "args_missing": kernel.args_missing,
                "no_slot": kernel.no_slot,
                "undecodable": losses.undecodable,
                "ext_unreadable": kernel.ext_unreadable,
                "stale_events": stats.stale_events,
                "duplicate_events": stats.duplicate_events,
                "caught_up_repeats": stats.caught_up_repeats,
                "export_drops": outputs.export_drops,
                "alert_lines_dropped": outputs.alert_lines_dropped,
                "alert_lines_failed": outputs.alert_lines_failed,
                "refused_processes": outputs.refused_processes,
                "state_full": kernel.state_full,
                "withheld": kernel.withheld,
                "caught_up": stats.caught_up,
                "status_reads": status.map(status_json),
                "probes": probes.iter().map(probe_json).collect::<Vec<_>>(),
            }))
            .to_string(),
        };
        self.write_line(&line).map(|()| line)
    }

    fn human(&self, alert: &Alert<'_>) -> String {
        let request = alert.request;
        let mut line = format!(
            "{} {:<14} pid={} process={} profile={} key={:#x}",
            self.clock.rfc3339(alert.at_ns),
            alert.kind.to_uppercase(),
            request.pid,
            text::value(self.process_name(request.pid)),
            text::value(self.profile(request.pid)),
            request.key
        );
        if let Some(workload) = self.workload(request.pid) {
            line.push_str(&format!(" workload={}", text::value(&workload.to_string())));
        }
        if let Some(ext) = &request.external_id {
            line.push_str(&format!(" external_id={}", text::value(ext)));
        }
        if let Some(class) = alert.class {
            line.push_str(&format!(" class={class}"));
        }
        line.push_str(&format!(" stage={}", request.stage));
        if let Some((name, ns)) = alert.duration {
            line.push_str(&format!(" {name}={}", seconds(ns)));
        }
        for (stage, ns) in stages(request) {
            line.push_str(&format!(" {stage}={}", self.clock.rfc3339(ns)));
        }
        if !request.inferred.is_empty() {
            line.push_str(&format!(
                " inferred={}",
                request.inferred.iter().map(Stage::as_str).collect::<Vec<_>>().join(",")
            ));
        }
        for (name, value) in alert.said.pairs() {
            line.push_str(&format!(" {name}={}", text::value(value)));
        }
        if let Some(evidence) = alert.evidence {
            line.push_str(&format!(" verdict={}", evidence.verdict.as_str()));
            if let Some(peer) = &evidence.peer {
                line.push_str(&format!(" peer={}", text::value(&peer.peer)));
            }
            line.push_str(&format!(" transport={}", text::value(&evidence.summary())));
        }
        line
    }

    fn json(&self, alert: &Alert<'_>) -> Value {
        let request = alert.request;
        let stages: Map<String, Value> =
            stages(request).map(|(stage, ns)| (stage.to_string(), Value::String(self.clock.rfc3339(ns)))).collect();
        let mut value = json!({
            "ts": self.clock.rfc3339(alert.at_ns),
            "alert": alert.kind,
            "pid": request.pid,
            "process": self.process_name(request.pid),
            "profile": self.profile(request.pid),
            "key": format!("{:#x}", request.key),
            "external_id": request.external_id.as_deref(),
            "stage": request.stage.as_str(),
            "class": alert.class,
            "stages": stages,
            "inferred": request.inferred.iter().map(Stage::as_str).collect::<Vec<_>>(),
        });
        if let Some(object) = value.as_object_mut() {
            if let Some((name, ns)) = alert.duration {
                object.insert(format!("{name}_ms"), json!(ns / 1_000_000));
            }
            if let Some(evidence) = alert.evidence {
                object.insert("transport".to_owned(), evidence_json(evidence));
            }
            for (name, value) in alert.said.pairs() {
                object.insert(name.to_owned(), json!(value));
            }
            if let Some(workload) = self.workload(request.pid) {
                object.insert("workload".to_owned(), json!(*workload));
            }
        }
        versioned(value)
    }

    fn process_name(&self, pid: u32) -> &str {
        self.names.get(&pid).map_or("?", |(name, _)| name)
    }

    fn profile(&self, pid: u32) -> &str {
        self.names.get(&pid).map_or("?", |(_, profile)| profile)
    }
}

/// The parts of a report that an alert line shows.
struct Alert<'a> {
    kind: &'static str,
    request: &'a RequestSnapshot,
    class: Option<&'static str>,
    /// ("silent", ns) for a stall, ("stuck", ns) for a recovery.
    duration: Option<(&'static str, u64)>,
    at_ns: u64,
    evidence: Option<&'a Evidence>,
    /// What is said of the request besides its lifecycle (an SGLang
    /// room's hung `handle`, or the room it is queued `behind`).
    said: &'a Context,
}

/// An alert's context until [`AlertWriter::report`] gives its own.
static NOTHING_SAID: Context = Context { fields: Vec::new(), native: Vec::new() };

impl<'a> Alert<'a> {
    fn of(report: &'a Report) -> Option<Self> {
        match report {
            Report::Stalled { request, class, silent_ns, at_ns } => Some(Self {
                kind: "stalled",
                request,
                class: Some(class.as_str()),
                duration: Some(("silent", *silent_ns)),
                at_ns: *at_ns,
                evidence: None,
                said: &NOTHING_SAID,
            }),
            Report::Recovered { request, class, stuck_ns } => Some(Self {
                kind: "recovered",
                request,
                class: Some(class.as_str()),
                duration: Some(("stuck", *stuck_ns)),
                at_ns: request.last_ns,
                evidence: None,
                said: &NOTHING_SAID,
            }),
            Report::Ended { request, outcome, at_ns } => {
                let kind = match outcome {
                    Outcome::Failed => "failed",
                    Outcome::ProcessExited => "process_exited",
                    Outcome::Evicted => "evicted",
                    // Only a reported stall's end is news: the others
                    // are counted (a pause can lose thousands of ends).
                    Outcome::EndUnseen if request.stalled.is_some() => "end_unseen",
                    Outcome::EndUnseen => return None,
                    Outcome::LeaseExpired => "lease_expired",
                    Outcome::KvReadAfterRelease => "kv_read_after_release",
                    // A transfer of an ended request never released: its
                    // own finding, apart from the request's outcome.
                    Outcome::Leaked => "leaked",
                    Outcome::Released | Outcome::Completed | Outcome::Aborted => return None,
                };
                Some(Self {
                    kind,
                    request,
                    class: request.stalled.map(|class| class.as_str()),
                    duration: Some(("age", at_ns.saturating_sub(request.first_ns))),
                    at_ns: *at_ns,
                    evidence: None,
                    said: &NOTHING_SAID,
                })
            }
        }
    }
}

/// One probe of the summary's `probes` (apart from the summary's
/// `json!`, which is at the macro's recursion limit).
fn probe_json(p: &ProbeHits) -> Value {
    json!({"pid": p.pid, "role": p.role, "hits": p.hits, "attached": p.attached.as_str(), "symbol": p.symbol})
}

/// The summary's `status_reads`.
fn status_json(reads: &StatusReads) -> Value {
    json!({
        "total": reads.total(),
        "answered": reads.answered,
        "not_held": reads.not_held,
        "process_gone": reads.process_gone,
        "unreadable": reads.unreadable,
        "unrecognised": reads.unrecognised,
        "off": reads.off,
    })
}

/// `{"verdict": .., "summary": .., "post": {"since": n, "total": n, "last_ago_ms": n|null}, ..}`;
/// `progress` also has `window_ms`: how far back its `since` counts
/// (`null`: no progress probe was attached). `process_state` says how the
/// process itself was held (`stopped`, `throttled`, `not_scheduled`;
/// `null`: it was not), the reason of a `process_stopped` verdict.
fn evidence_json(evidence: &Evidence) -> Value {
    let mut object = Map::new();
    object.insert("verdict".to_owned(), json!(evidence.verdict.as_str()));
    object.insert("process_state".to_owned(), json!(evidence.halt.map(|halt| halt.as_str())));
    object.insert("summary".to_owned(), json!(evidence.summary()));
    for kind in ActivityKind::ALL {
        let total = evidence.total.get(kind);
        object.insert(
            kind.as_str().to_owned(),
            json!({
                "since": evidence.since.get(kind).calls,
                "total": total.calls,
                "last_ago_ms": total.last_ns.map(|ns| evidence.at_ns.saturating_sub(ns) / 1_000_000),
            }),
        );
    }
    if let Some(Value::Object(progress)) = object.get_mut(ActivityKind::Progress.as_str()) {
        progress.insert("window_ms".to_owned(), json!(evidence.progress_window_ns.map(|ns| ns / 1_000_000)));
    }
    object.insert("peer".to_owned(), json!(evidence.peer.as_ref().map(|peer| &*peer.peer)));
    if let (Some(peer), Some(Value::Object(completion))) =
        (&evidence.peer, object.get_mut(ActivityKind::Completion.as_str()))
    {
        completion.insert("to_peer".to_owned(), json!(peer.to_peer));
        completion.insert("to_other_peers".to_owned(), json!(peer.to_others));
    }
    Value::Object(object)
}

fn stages(request: &RequestSnapshot) -> impl Iterator<Item = (Stage, u64)> + '_ {
    Stage::ALL.into_iter().filter_map(|stage| Some((stage, request.stage_at(stage)?)))
}

fn seconds(ns: u64) -> String {
    format!("{:.2}s", Duration::from_nanos(ns).as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::{StageSet, StallClass};

    fn release_lost(inferred: StageSet) -> Report {
        let request = RequestSnapshot {
            pid: 7,
            key: 0xab,
            external_id: None,
            stage: Stage::TransferDone,
            stage_ns: [Some(1_000), Some(2_000), Some(9_000), None],
            first_ns: 1_000,
            last_ns: 2_000,
            stalled: Some(StallClass::ReleaseLost),
            inferred,
        };
        Report::Stalled { request, class: StallClass::ReleaseLost, silent_ns: 7_000, at_ns: 9_000 }
    }

    fn line(format: Format, report: &Report) -> String {
        let mut out = Vec::new();
        AlertWriter::new(&mut out, format, Clock::new()).report(report, None, &Context::default()).expect("write");
        String::from_utf8(out).expect("UTF-8")
    }

    #[test]
    fn alerts_carry_their_trackers_fields() {
        let said = Context::said_by("sglang", [("handle", "0x7f00".to_owned()), ("behind", "17".to_owned())]);
        let mut out = Vec::new();
        AlertWriter::new(&mut out, Format::Json, Clock::new())
            .report(&release_lost(StageSet::EMPTY), None, &said)
            .expect("write");
        let json: Value = serde_json::from_slice(&out).expect("JSON");
        assert_eq!((&json["handle"], &json["behind"]), (&json!("0x7f00"), &json!("17")), "{json}");
        assert_eq!(json["version"], json!(SCHEMA_VERSION), "every JSON line says its schema version: {json}");
        let mut out = Vec::new();
        AlertWriter::new(&mut out, Format::Human, Clock::new())
            .report(&release_lost(StageSet::EMPTY), None, &said)
            .expect("write");
        assert!(String::from_utf8(out).expect("UTF-8").contains(" handle=0x7f00 behind=17"));
    }

    #[test]
    fn a_stall_whose_peer_is_known_names_it_with_the_completions_per_peer() {
        let peer = crate::evidence::peers::PeerCompletions { peer: "decode-0".into(), to_peer: 0, to_others: 14 };
        let evidence = Evidence {
            total: Default::default(),
            since: Default::default(),
            progress_window_ns: None,
            at_ns: 9_000,
            peer: Some(peer),
            halt: None,
            verdict: crate::evidence::transport::Verdict::PeerUnresponsive,
        };
        let write = |format| {
            let mut out = Vec::new();
            AlertWriter::new(&mut out, format, Clock::new())
                .report(&release_lost(StageSet::EMPTY), Some(&evidence), &Context::default())
                .expect("write");
            String::from_utf8(out).expect("UTF-8")
        };
        let json: Value = serde_json::from_str(&write(Format::Json)).expect("JSON");
        assert_eq!(json["transport"]["peer"], "decode-0", "{json}");
        assert_eq!(json["transport"]["verdict"], "peer_unresponsive", "{json}");
        assert_eq!(
            (&json["transport"]["completion"]["to_peer"], &json["transport"]["completion"]["to_other_peers"]),
            (&json!(0), &json!(14)),
            "{json}"
        );
        assert!(
            json["transport"]["summary"]
                .as_str()
                .is_some_and(|s| s.ends_with("none to decode-0 completed, 14 to other peers")),
            "{json}"
        );
        let human = write(Format::Human);
        assert!(human.contains(" verdict=peer_unresponsive peer=decode-0 transport="), "{human}");
        // Unknown: null, and no per-peer counts.
        let evidence = Evidence { peer: None, ..evidence.clone() };
        let mut out = Vec::new();
        AlertWriter::new(&mut out, Format::Json, Clock::new())
            .report(&release_lost(StageSet::EMPTY), Some(&evidence), &Context::default())
            .expect("write");
        let json: Value = serde_json::from_slice(&out).expect("JSON");
        assert!(
            json["transport"]["peer"].is_null() && json["transport"]["completion"].get("to_peer").is_none(),
            "{json}"
        );
    }

    #[test]
    fn alerts_say_which_stages_were_inferred() {
        let mut done = StageSet::EMPTY;
        done.insert(Stage::TransferDone);
        let json: Value = serde_json::from_str(&line(Format::Json, &release_lost(done))).expect("JSON");
        assert_eq!(json["inferred"], json!(["transfer_done"]), "{json}");
        assert!(line(Format::Human, &release_lost(done)).trim_end().ends_with(" inferred=transfer_done"));
        // All observed: an empty list, and nothing in the human line.
        let json: Value = serde_json::from_str(&line(Format::Json, &release_lost(StageSet::EMPTY))).expect("JSON");
        assert_eq!(json["inferred"], json!([]), "{json}");
        assert!(!line(Format::Human, &release_lost(StageSet::EMPTY)).contains("inferred"));
    }

    /// A stopped prefill's stall: the verdict and `waiting_on` its agent
    /// sets (the fields as [`Context::say_halt`] leaves
    /// them), in both formats, the peer of its transfer still named (it is
    /// where the transfer goes, not who is blamed).
    #[test]
    fn a_stall_of_a_stopped_process_says_so_and_waits_on_itself() {
        use crate::evidence::{peers::PeerCompletions, sched::Halt, transport::Verdict};
        let halt = Halt::Stopped { threads: 57 };
        let evidence = Evidence {
            total: Default::default(),
            since: Default::default(),
            progress_window_ns: None,
            at_ns: 9_000,
            peer: Some(PeerCompletions { peer: "decode-0".into(), to_peer: 0, to_others: 3 }),
            halt: Some(halt),
            verdict: Verdict::ProcessStopped,
        };
        let mut said = Context::said_by(
            "sglang",
            [("answered", "1/1".to_owned()), ("behind", "17".to_owned()), ("waiting_on", "worker".to_owned())],
        );
        said.say_halt(halt.as_str());
        let write = |format| {
            let mut out = Vec::new();
            AlertWriter::new(&mut out, format, Clock::new())
                .report(&release_lost(StageSet::EMPTY), Some(&evidence), &said)
                .expect("write");
            String::from_utf8(out).expect("UTF-8")
        };
        let json: Value = serde_json::from_str(&write(Format::Json)).expect("JSON");
        assert_eq!(
            (
                &json["transport"]["verdict"],
                &json["transport"]["process_state"],
                &json["waiting_on"],
                &json["process_state"]
            ),
            (&json!("process_stopped"), &json!("stopped"), &json!("self"), &json!("stopped")),
            "{json}"
        );
        assert!(json.get("behind").is_none(), "{json}");
        assert!(
            json["transport"]["summary"]
                .as_str()
                .is_some_and(|s| s.starts_with("process stopped (all 57 threads in state T); ")),
            "{json}"
        );
        let human = write(Format::Human);
        assert!(
            human.contains(" waiting_on=self process_state=stopped verdict=process_stopped peer=decode-0 "),
            "{human}"
        );
        // Not held: `process_state` null.
        let evidence = Evidence { halt: None, verdict: Verdict::PeerUnresponsive, ..evidence.clone() };
        let mut out = Vec::new();
        AlertWriter::new(&mut out, Format::Json, Clock::new())
            .report(&release_lost(StageSet::EMPTY), Some(&evidence), &Context::default())
            .expect("write");
        let json: Value = serde_json::from_slice(&out).expect("JSON");
        assert!(json["transport"]["process_state"].is_null(), "{json}");
    }

    /// stdout with its reader gone.
    struct Closed;

    impl Write for Closed {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_stdout_stops_the_agent_but_not_its_stop() {
        let report = release_lost(StageSet::EMPTY);
        let mut running = AlertWriter::new(Closed, Format::Json, Clock::new());
        assert!(
            running.report(&report, None, &Context::default()).is_err(),
            "the write that finds stdout closed fails, so the agent stops"
        );
        assert!(running.is_closed());
        let mut stopping = AlertWriter::new(Closed, Format::Json, Clock::new());
        stopping.stopping();
        stopping.report(&report, None, &Context::default()).expect("at the stop a closed stdout is no error");
        stopping
            .summary(&EngineStats::default(), &Losses::default(), &Shortfalls::default(), &[], None)
            .expect("nor for the summary");
        assert!(stopping.is_closed());
    }
}
