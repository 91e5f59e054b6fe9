//! vLLM's NixlConnector (vllm 0.33.0, `distributed/kv_transfer/kv_connector/
//! v1/nixl/`), pull mode, as lifecycles: read from the wheel and measured
//! on its own classes (docs/frameworks/vllm.md).
//!
//! **Decode.** The decode READs the KV: `make_prepped_xfer("READ", ...,
//! notif_msg=b"<prefill request id>:<consumers>")` (NIXL `makeXferReq`),
//! posts it, polls it, releases it. Each READ is a lifecycle of its own
//! keyed by its handle (the `nixl` profile's probes); here the handle's
//! notification is read as vLLM writes it, so its external id is the
//! prefill's request id (the same trace the prefill's span of that request
//! lands in) and its alert names the consumers and the prefill's agent.
//! The thread making the READ is named by a signal at `makeXferReq`'s
//! entry (`vllm_read`: the op, and the remote agent from the remote dlist
//! handle) before the handle comes back on it. The decode's `genNotif`s
//! (`vllm_notif_sent`) are heartbeats `HB:<id>,<id>...` for requests it
//! waits on, and, for a request it aborts before reading, the notification
//! alone (`<id>:<consumers>`): evidence, counted per request id.
//!
//! **Prefill.** The prefill makes no transfer: it holds the request's KV
//! blocks until every consumer's notification arrives (or its lease
//! expires, in Python, unseen). A request is followed, keyed by its id,
//! from the engine core's output that finishes it with params for a
//! decode to read its blocks ([`outputs`]: the `EngineCoreOutputs` frame
//! the output thread sends, read whole by the kernel at `zmq_msg_send`,
//! `vllm_outputs`). Every notification it reads comes back from NIXL
//! `getNotifs` in an `unordered_map<agent, vector<string>>`, whose strings
//! the kernel walks at the call's return (`vllm_notifs`); a request first
//! named there (its output not seen: an agent started later) is followed
//! from that notification: a heartbeat (the decode waits on it), or one
//! consumer's notification of several (`k/N` answered). It ends released
//! at its last consumer's notification. Its alert says how many consumers
//! answered and what heartbeats came: one held with heartbeats is waited
//! on, one whose heartbeats stopped is abandoned, one no decode ever named
//! was never read (the decode never got it, or notified another id: vLLM
//! PR 36958, whose id shows among the other notifications). With TP > 1
//! the notifications arrive in the worker processes, not the engine core
//! that sent the output: a notification for an id no request of its own
//! process holds goes to the process that holds it.
//!
//! **Push** (`NixlPushConnector`): the prefill WRITEs, its notification
//! `"<decode's request id>:<world size>"` (`push_worker.py`); a WRITE's
//! handle takes that id as its external id. A push decode's `PUSH_REG:`
//! registrations are recognised and left alone. Not exercised by the test
//! target.
use std::collections::{HashMap, HashSet, VecDeque};

use tracing::{info, warn};

mod outputs;

use super::{
    AdoptedHandle, Framework, HandOver,
    signals::{Captured, Signal},
    strings::{Assembler, Whole},
};
use crate::{
    lifecycle::{Observation, RequestSnapshot, Restored, Side, Silent, Stage, StageRead},
    profile::SignalSpec,
    util::{clock::monotonic_ns, warned::Warned},
};

/// NIXL's `nixl_xfer_op_t`: `NIXL_READ`.
const NIXL_READ: u64 = 0;

/// The prefill's request id a vLLM notification names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notif<'a> {
    /// `HB:<id>,<id>,...`: the decode still waits on these.
    Heartbeat(Vec<&'a str>),
    /// `<id>:<consumers>`: one consumer is done with the request (after
    /// its READ, or at an abort before it).
    Consumer { id: &'a str, consumers: u32 },
    /// `PUSH_REG:<msgpack>`: a push-mode decode registering its blocks
    /// (`metadata.py` `PUSH_REG_NOTIF_PREFIX`): no request's end.
    PushRegistration,
}

/// A notification as vLLM 0.33.0 writes it (`pull_worker.py`: the READ's
/// `notif_msg`, the heartbeat in `build_connector_meta`). `complete`: every
/// byte was read; a heartbeat cut short keeps the ids before its cut, a
/// consumer's notification cut short is refused.
pub fn parse(text: &str, complete: bool) -> Result<Notif<'_>, String> {
    if text.starts_with("PUSH_REG:") {
        return Ok(Notif::PushRegistration);
    }
    if let Some(ids) = text.strip_prefix("HB:") {
        let mut ids: Vec<&str> = ids.split(',').collect();
        if !complete {
            ids.pop();
        }
        ids.retain(|id| !id.is_empty());
        return Ok(Notif::Heartbeat(ids));
    }
    if !complete {
        return Err(format!("a notification cut short: {text:?}"));
    }
    let Some((id, consumers)) = text.rsplit_once(':') else {
        return Err(format!("neither `HB:<ids>` nor `<id>:<consumers>`: {text:?}"));
    };
    match consumers.parse::<u32>() {
        Ok(consumers) if consumers > 0 && !id.is_empty() => Ok(Notif::Consumer { id, consumers }),
        _ => Err(format!("`<id>:<consumers>` with no id or no count of consumers: {text:?}")),
    }
}

/// The key of a prefill request followed by its id: FNV-1a of the id,
/// with the top bit set so that it is never a user-space address.
pub fn key_of(id: &str) -> u64 {
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    hash | 1 << 63
}

/// A decode's READ (or a push prefill's WRITE), by its handle.
struct Transfer {
    id: Box<str>,
    /// A READ (pull), else a WRITE (push).
    read: bool,
    consumers: u32,
    agent: Box<str>,
}

/// A request a prefill holds, as its output and notifications tell.
#[derive(Default)]
struct Held {
    /// Seen from the engine's output (else from a notification).
    from_output: bool,
    consumers: Option<u32>,
    answered: u32,
    heartbeats: u32,
    first_beat_ns: u64,
    last_beat_ns: u64,
}

impl Held {
    /// Whether the decode still waits on the request at `now`: its last
    /// heartbeat came within twice the interval its heartbeats keep
    /// (kv_lease_duration/6), or with one heartbeat seen, within the
    /// latter half of the request's silence (`silent_ns`).
    fn waited_on(&self, now: u64, silent_ns: u64) -> bool {
        if self.heartbeats == 0 {
            return false;
        }
        let since = now.saturating_sub(self.last_beat_ns);
        if self.heartbeats == 1 {
            return since <= silent_ns / 2;
        }
        let interval = (self.last_beat_ns - self.first_beat_ns) / u64::from(self.heartbeats - 1);
        since <= 2 * interval + 500_000_000
    }
}

/// What a decode sent of one request id with `genNotif`.
#[derive(Default, Clone, Copy)]
struct Sent {
    heartbeats: u32,
    last_beat_ns: u64,
    /// The notification alone: the decode gave the request up unread.
    aborted: bool,
}

/// The requests ids a process's notifications were last about, at most
/// this many remembered per process.
const RECENT: usize = 8;

#[derive(Default)]
pub struct Vllm {
    strings: Assembler,
    /// (pid, tid) -> the op and remote agent of the transfer the thread
    /// is making.
    creating: HashMap<(u32, u32), (u64, Box<str>)>,
    transfers: HashMap<(u32, u64), Transfer>,
    decodes: HashSet<u32>,
    /// (pid, key of the id) -> the request's id and what is known of it.
    held: HashMap<(u32, u64), (Box<str>, Held)>,
    sent: HashMap<(u32, Box<str>), Sent>,
    /// Per prefill: the latest notifications for requests it was not seen
    /// holding (healthy single-consumer ones, and ids it does not hold).
    unseen: HashMap<u32, VecDeque<Box<str>>>,
    unseen_count: u64,
    /// Requests a decode gave up unread (the notification alone), and the
    /// latest.
    aborts: u64,
    last_abort: Option<String>,
    pending: VecDeque<Observation>,
    /// Engine outputs cut at the capture's bound (outputs past the cut
    /// unknown).
    outputs_cut: u64,
    unparsed: u64,
    last_unparsed: Option<String>,
    warned: Warned,
}

impl Vllm {
    fn unparsed(&mut self, why: String) {
        self.unparsed += 1;
        self.last_unparsed = Some(why);
    }

    /// A string the decode sent with `genNotif`.
    fn sent(&mut self, pid: u32, ts_ns: u64, whole: &Whole) {
        let text = String::from_utf8_lossy(&whole.text);
        match parse(&text, whole.complete) {
            Ok(Notif::Heartbeat(ids)) => {
                for id in ids {
                    let sent = self.sent.entry((pid, id.into())).or_default();
                    sent.heartbeats += 1;
                    sent.last_beat_ns = ts_ns;
                }
            }
            Ok(Notif::Consumer { id, .. }) => {
                self.sent.entry((pid, id.into())).or_default().aborted = true;
                self.aborts += 1;
                self.last_abort = Some(format!("pid {pid} request {id}"));
            }
            Ok(Notif::PushRegistration) => {}
            Err(why) => self.unparsed(format!("pid {pid}: genNotif: {why}")),
        }
    }

    /// An engine core's `EngineCoreOutputs` frame: each request it
    /// finishes for a decode to read is held from now.
    fn output(&mut self, pid: u32, ts_ns: u64, whole: &Whole) {
        let outputs = match outputs::read(&whole.text, whole.complete) {
            Ok(outputs) => outputs,
            Err(outputs::NotOutputs::Other) => return,
            Err(outputs::NotOutputs::Unreadable(why)) => {
                self.unparsed(format!("pid {pid}: engine output: {why}"));
                return;
            }
        };
        self.outputs_cut += u64::from(outputs.cut);
        for id in outputs.held {
            let key = (pid, key_of(&id));
            if self.held.contains_key(&key) {
                continue;
            }
            self.pending.push_back(Observation {
                pid,
                key: key.1,
                stage: Stage::Enqueued,
                ts_ns,
                external_id: Some(id.as_str().into()),
                ends: false,
            });
            self.held.insert(key, (id.into(), Held { from_output: true, ..Held::default() }));
        }
    }

    /// The process a notification read in `pid` about request `key` is
    /// for: `pid` when it holds the request (one engine process, TP 1),
    /// else the engine core that sent the request's output (TP > 1: the
    /// workers read the notifications).
    fn holder(&self, pid: u32, key: u64) -> u32 {
        if self.held.contains_key(&(pid, key)) {
            return pid;
        }
        self.held.iter().find(|((_, k), (_, held))| *k == key && held.from_output).map_or(pid, |((p, _), _)| *p)
    }

    /// A string the prefill read with `getNotifs`: the observations it
    /// makes go to `pending`.
    fn received(&mut self, reader: u32, ts_ns: u64, whole: &Whole) {
        let text = String::from_utf8_lossy(&whole.text);
        let observe = |pid: u32, id: &str, stage| Observation {
            pid,
            key: key_of(id),
            stage,
            ts_ns,
            external_id: (stage == Stage::Enqueued).then(|| id.into()),
            ends: false,
        };
        match parse(&text, whole.complete) {
            Ok(Notif::Heartbeat(ids)) => {
                for id in ids {
                    let pid = self.holder(reader, key_of(id));
                    let (_, held) = self.held.entry((pid, key_of(id))).or_insert_with(|| {
                        self.pending.push_back(observe(pid, id, Stage::Enqueued));
                        (id.into(), Held::default())
                    });
                    if held.heartbeats == 0 {
                        held.first_beat_ns = ts_ns;
                    }
                    held.heartbeats += 1;
                    held.last_beat_ns = ts_ns;
                }
            }
            Ok(Notif::Consumer { id, consumers }) => {
                let pid = self.holder(reader, key_of(id));
                let key = (pid, key_of(id));
                let known = self.held.contains_key(&key);
                if !known && consumers == 1 {
                    let recent = self.unseen.entry(reader).or_default();
                    if recent.len() == RECENT {
                        recent.pop_front();
                    }
                    recent.push_back(text.as_ref().into());
                    self.unseen_count += 1;
                    return;
                }
                if !known {
                    // One consumer of several: the others are awaited.
                    self.pending.push_back(observe(pid, id, Stage::Enqueued));
                }
                let (_, held) = self.held.entry(key).or_insert_with(|| (id.into(), Held::default()));
                held.consumers = Some(consumers);
                held.answered += 1;
                if held.answered >= consumers {
                    self.held.remove(&key);
                    self.pending.push_back(observe(pid, id, Stage::Released));
                }
            }
            Ok(Notif::PushRegistration) => {}
            Err(why) => self.unparsed(format!("pid {reader}: getNotifs: {why}")),
        }
    }

    /// The held request a snapshot is, if it is one.
    fn held_of(&self, request: &RequestSnapshot) -> Option<(&str, &Held)> {
        self.held.get(&(request.pid, request.key)).map(|(id, held)| (&**id, held))
    }
}

/// Seconds between two monotonic times, for an alert.
fn secs(from_ns: u64, to_ns: u64) -> String {
    format!("{:.1}", to_ns.saturating_sub(from_ns) as f64 / 1e9)
}

impl Framework for Vllm {
    fn signal(&mut self, spec: &SignalSpec, signal: &Signal) -> Option<Option<Observation>> {
        match spec.name.as_str() {
            "vllm_read" => {
                if let Captured::Text(agent) = &signal.capture {
                    let agent = String::from_utf8_lossy(agent).into();
                    self.creating.insert((signal.pid, signal.tid), (signal.value, agent));
                }
                if signal.value == NIXL_READ {
                    self.decodes.insert(signal.pid);
                }
                Some(None)
            }
            "vllm_notif_sent" | "vllm_notifs" | "vllm_outputs" => {
                if let Captured::Chunk(chunk) = &signal.capture {
                    let slot = spec.line as u32;
                    if let Some(whole) = self.strings.chunk(signal.pid, signal.tid, slot, chunk) {
                        match spec.name.as_str() {
                            "vllm_notifs" => self.received(signal.pid, signal.ts_ns, &whole),
                            "vllm_outputs" => self.output(signal.pid, signal.ts_ns, &whole),
                            _ => {
                                self.decodes.insert(signal.pid);
                                self.sent(signal.pid, signal.ts_ns, &whole);
                            }
                        }
                    }
                }
                Some(self.pending.pop_front())
            }
            _ => None,
        }
    }

    fn pending(&mut self) -> Option<Observation> {
        self.pending.pop_front()
    }

    /// A handle made on a thread that named a vLLM transfer: its
    /// notification read as vLLM writes it, its external id the request id.
    fn handle(&mut self, tid: u32, mut observation: Observation) -> Option<Observation> {
        let key = (observation.pid, observation.key);
        if observation.stage == Stage::Enqueued
            && let Some((op, agent)) = self.creating.remove(&(observation.pid, tid))
            && let Some(notif) = observation.external_id.as_deref()
        {
            // Pull: the decode's READ; push: the prefill's WRITE
            // (`push_worker.py`: `"<remote request id>:<world size>"`).
            let transfer = match parse(notif, true) {
                Ok(Notif::Consumer { id, consumers }) => {
                    Some(Transfer { id: id.into(), read: op == NIXL_READ, consumers, agent })
                }
                _ => None,
            };
            if let Some(transfer) = transfer {
                observation.external_id = Some(transfer.id.clone());
                self.transfers.insert(key, transfer);
            }
        } else if observation.stage.is_terminal() || observation.ends {
            self.transfers.remove(&key);
        }
        Some(observation)
    }

    /// A held request a previous agent followed (its key is its id's) is
    /// followed again, knowing nothing of its consumers and heartbeats: no
    /// context is handed over (`held` is never written for vLLM).
    fn adopt(&mut self, request: &Restored, _held: Option<&[u8]>) -> Result<Vec<AdoptedHandle>, String> {
        if let Some(id) = request.external_id.as_deref()
            && key_of(id) == request.key
        {
            self.held.entry((request.pid, request.key)).or_insert_with(|| (id.into(), Held::default()));
        }
        Ok(Vec::new())
    }

    fn adopt_ended(&mut self, _pid: u32, _key: u64, _held: &[u8]) -> bool {
        false
    }

    /// A READ handle stays a lifecycle of its own (its request id is its
    /// external id), never part of another request.
    fn owns(&self, _pid: u32, _key: u64) -> bool {
        false
    }

    fn held(&mut self, _out: &mut Vec<HandOver>) {}

    fn side(&self, pid: u32) -> Side {
        if self.decodes.contains(&pid) { Side::Decode } else { Side::Prefill }
    }

    fn context(&self, request: &RequestSnapshot) -> Vec<(&'static str, String)> {
        let now = monotonic_ns();
        if let Some(transfer) = self.transfers.get(&(request.pid, request.key)) {
            let mut fields = vec![("vllm_request_id", transfer.id.to_string())];
            let kind = if transfer.read { "READ (decode pulls)" } else { "WRITE (prefill pushes)" };
            fields.push(("vllm_transfer", kind.into()));
            fields.push(("vllm_consumers", transfer.consumers.to_string()));
            fields.push(("vllm_peer_agent", transfer.agent.to_string()));
            if let Some(sent) = self.sent.get(&(request.pid, transfer.id.clone())) {
                fields.push(("vllm_heartbeats_sent", sent.heartbeats.to_string()));
            }
            return fields;
        }
        let Some((id, held)) = self.held_of(request) else { return Vec::new() };
        let answered = match held.consumers {
            Some(n) => format!("{}/{n}", held.answered),
            None => format!("{}/?", held.answered),
        };
        let mut fields = vec![
            ("vllm_request_id", id.to_string()),
            ("vllm_held_since", if held.from_output { "engine output" } else { "first notification" }.into()),
            ("vllm_held_s", secs(request.first_ns, now)),
            ("vllm_consumers_answered", answered),
            ("vllm_heartbeats", held.heartbeats.to_string()),
        ];
        if held.heartbeats > 0 {
            fields.push(("vllm_last_heartbeat_s_ago", secs(held.last_beat_ns, now)));
        }
        let waited_on = held.waited_on(now, now.saturating_sub(request.last_ns));
        let verdict = if waited_on {
            "waited on: the decode still sends heartbeats for it"
        } else if held.heartbeats > 0 {
            "abandoned: its heartbeats stopped"
        } else if held.from_output && held.answered == 0 {
            "never read: no decode has named it (no READ notification, no heartbeat)"
        } else {
            "abandoned: no heartbeat"
        };
        fields.push(("vllm_decode", verdict.into()));
        if let Some(recent) = self.unseen.get(&request.pid).filter(|recent| !recent.is_empty()) {
            let list: Vec<&str> = recent.iter().map(|id| &**id).collect();
            fields.push(("vllm_recent_other_notifications", list.join(" ")));
        }
        fields
    }

    /// Held requests have no memory of their own to read: none.
    fn read(
        &mut self,
        silent: &Silent,
        _read: &mut dyn FnMut(&Silent) -> Option<StageRead>,
    ) -> Option<Option<StageRead>> {
        self.held.contains_key(&(silent.pid, silent.key)).then_some(None)
    }

    fn stalled_transfer(&self, request: &RequestSnapshot) -> Option<Option<u64>> {
        self.held_of(request).map(|_| None)
    }

    fn warn(&mut self) {
        if let Some(new) = self.warned.news(self.unparsed + self.strings.cut) {
            warn!(
                new,
                unparsed = self.unparsed,
                cut_short = self.strings.cut,
                outputs_cut = self.outputs_cut,
                latest = self.last_unparsed.as_deref().unwrap_or_default(),
                "vLLM notifications or engine outputs that could not be read whole (raise the profile's \
                 `strings.bytes` if cut short: an engine output's requests past its cut are not followed)"
            );
        }
    }

    fn forget(&mut self, pid: u32) {
        self.strings.forget(pid);
        self.creating.retain(|(p, _), _| *p != pid);
        self.transfers.retain(|(p, _), _| *p != pid);
        self.held.retain(|(p, _), _| *p != pid);
        self.sent.retain(|(p, _), _| *p != pid);
        self.unseen.remove(&pid);
        self.decodes.remove(&pid);
    }

    fn finish(&mut self) {
        self.warn();
        if self.aborts > 0 {
            info!(
                requests = self.aborts,
                latest = self.last_abort.as_deref().unwrap_or_default(),
                "vLLM decode requests given up unread: the decode sent the prefill their notification alone (an abort)"
            );
        }
        if self.unseen_count > 0 {
            info!(
                notifications = self.unseen_count,
                "vLLM prefill notifications for requests not seen held (a request's only consumer read it before any \
                 heartbeat named it, or an id the prefill does not hold)"
            );
        }
    }
}

#[cfg(test)]
mod tests;
