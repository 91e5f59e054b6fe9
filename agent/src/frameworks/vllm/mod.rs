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
//! on (naming the decode that sends them, where this agent saw it: queued
//! there, a decode at capacity), one whose heartbeats stopped is abandoned
//! (by a decode that exited, where this agent saw it go), one no decode
//! ever named was never read (the decode never got it, or notified another
//! id: vLLM PR 36958, whose id shows among the other notifications). With
//! TP > 1 the notifications arrive in the worker processes, not the engine
//! core that sent the output: a notification for an id no request of its
//! own process holds goes to the process that holds it.
//!
//! **The lease** ([`lease`]). The prefill frees a request's blocks when
//! the lease its config gives a decode to read them runs out, unread: the
//! agent keeps the same deadline from the request's output and the
//! heartbeats it sees, and ends a request still held past it
//! `lease_expired`. A READ of a request whose KV was freed (past its
//! lease, or released already) is `kv_read_after_release`: on the decode,
//! its READ ends so; on the prefill, its notification is a lifecycle of
//! its own that ends so, in the same trace (the request id). Both sides
//! are seen only where one agent watches both (one node); a decode alone
//! cannot know its prefill's lease.
//!
//! **Push** (`NixlPushConnector`): the prefill WRITEs, its notification
//! `"<decode's request id>:<world size>"` (`push_worker.py`); a WRITE's
//! handle takes that id as its external id. A push decode's `PUSH_REG:`
//! registrations are recognised and left alone. Not exercised by the test
//! target.
use std::collections::{HashMap, HashSet, VecDeque};

use tracing::{info, warn};

mod lease;
mod outputs;
mod recall;

use self::{lease::Lease, recall::Recall};
use super::{
    AdoptedHandle, Claim, Framework, HandOver, TakeOver,
    signals::{Captured, Signal},
    strings::{Assembler, Whole},
};
use crate::{
    lifecycle::{Observation, Outcome, RequestSnapshot, Restored, Side, Silent, Stage, StageRead},
    profile::{Profile, SignalSpec},
    util::{clock::monotonic_ns, lineage::Lineage, warned::Warned},
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
    /// When it was made: a READ made after its prefill freed the KV read
    /// freed blocks. (Its end may well come after the prefill's release:
    /// the READ's own notification releases the request before the
    /// decode releases the READ's handle.)
    made_ns: u64,
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
    /// When the prefill frees its blocks unless a decode reads them: from
    /// its output, moved on by heartbeats ([`lease`]). `None` for one
    /// first seen from a notification (its output's time, where the lease
    /// began, is unknown).
    deadline_ns: Option<u64>,
}

impl Held {
    /// When the agent takes the prefill to have freed it unread: its
    /// lease's deadline and the grace after it ([`LEASE_GRACE_NS`]).
    fn freed_at(&self) -> Option<u64> {
        self.deadline_ns.map(|deadline| deadline.saturating_add(LEASE_GRACE_NS))
    }

    /// Whether its lease ran out by `ts_ns`.
    fn lapsed_by(&self, ts_ns: u64) -> bool {
        self.freed_at().is_some_and(|freed| freed <= ts_ns)
    }

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

/// How long past its deadline a held request is still taken as held: the
/// agent's deadline runs from the output's send, a little after vLLM's
/// stamp, and a step's notifications are taken before its expired leases
/// are reaped.
const LEASE_GRACE_NS: u64 = 100_000_000;

/// A request whose KV its prefill freed.
struct Freed {
    /// The engine process that held it.
    holder: u32,
    at_ns: u64,
    /// Freed at its lease (else released: every consumer had answered).
    by_lease: Option<Lease>,
    /// A READ of it was reported on the prefill already.
    reported: bool,
}

/// A decode that exited while it sent heartbeats for a request: the
/// request's heartbeats stopped because their sender is gone (vLLM frees
/// it at its lease, extended by the last of them), not because the decode
/// gave it up or read it elsewhere.
struct Departed {
    /// The decode's process that sent them (its worker).
    decode: u32,
    at_ns: u64,
}

/// A decode's READ of a request that completed.
struct ReadDone {
    decode: u32,
    at_ns: u64,
}

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
    /// Each watched process's lease, from its lineage.
    leases: HashMap<u32, Lease>,
    freed: Recall<Freed>,
    reads_done: Recall<ReadDone>,
    departed: Recall<Departed>,
    /// Engine outputs cut at the capture's bound (outputs past the cut
    /// unknown).
    outputs_cut: u64,
    /// Engine outputs of a shape not checked ([`outputs::CHECKED_ON`]).
    unknown_shapes: u64,
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
        if let Some(why) = outputs.unknown_shape {
            self.unknown_shapes += 1;
            if self.unknown_shapes == 1 {
                warn!(
                    pid,
                    shape = %why,
                    checked_on = outputs::CHECKED_ON,
                    "vLLM engine outputs of a shape the vllm profile was not checked on: held requests are not \
                     followed from them (a request a decode names is still followed from its notifications); \
                     said once, counted at exit"
                );
            }
        }
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
                ends: None,
            });
            let deadline_ns = Some(ts_ns.saturating_add(self.lease(pid).duration_ns()));
            self.held.insert(key, (id.into(), Held { from_output: true, deadline_ns, ..Held::default() }));
        }
    }

    /// The lease of the process `pid` (vLLM's default until its lineage is
    /// read: a process is attached before its first event).
    fn lease(&self, pid: u32) -> Lease {
        self.leases.get(&pid).cloned().unwrap_or_else(|| Lease::of(&Lineage::default()))
    }

    /// End the held request (`pid`, `key`) at its lease's deadline if that
    /// passed before `ts_ns`: the prefill freed its blocks unread. Whether
    /// it did.
    fn lapse(&mut self, pid: u32, key: u64, ts_ns: u64) -> bool {
        let lapsed = self.held.get(&(pid, key)).filter(|(_, held)| held.lapsed_by(ts_ns));
        let Some(deadline) = lapsed.and_then(|(_, held)| held.deadline_ns) else { return false };
        let Some((id, _)) = self.held.remove(&(pid, key)) else { return false };
        self.pending.push_back(Observation {
            pid,
            key,
            stage: Stage::Enqueued,
            ts_ns: deadline,
            external_id: None,
            ends: Some(Outcome::LeaseExpired),
        });
        let lease = Some(self.lease(pid));
        self.freed.insert(&id, Freed { holder: pid, at_ns: deadline, by_lease: lease, reported: false });
        true
    }

    /// Whether the KV of request `id` was freed before `ts_ns`, as far as
    /// the prefills this agent watches tell.
    fn freed_by(&self, id: &str, ts_ns: u64) -> bool {
        if self.freed.get(id).is_some_and(|freed| freed.at_ns < ts_ns) {
            return true;
        }
        let key = key_of(id);
        self.held.iter().any(|(&(_, k), (_, held))| k == key && held.lapsed_by(ts_ns))
    }

    /// A consumer's notification for request `id`, which the prefill
    /// no longer holds: if it freed the KV, the READ it ends read freed
    /// KV, a lifecycle of its own on the prefill (once per request).
    /// Whether it was one.
    fn read_after_release(&mut self, id: &str, ts_ns: u64) -> bool {
        let Some(freed) = self.freed.get_mut(id).filter(|freed| freed.at_ns <= ts_ns && !freed.reported) else {
            return false;
        };
        freed.reported = true;
        let (pid, key) = (freed.holder, key_of(id));
        let observe = |stage, ends| Observation { pid, key, stage, ts_ns, external_id: Some(id.into()), ends };
        self.pending.push_back(observe(Stage::Enqueued, None));
        self.pending.push_back(observe(Stage::Released, Some(Outcome::KvReadAfterRelease)));
        true
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
            ends: None,
        };
        match parse(&text, whole.complete) {
            Ok(Notif::Heartbeat(ids)) => {
                for id in ids {
                    let pid = self.holder(reader, key_of(id));
                    if self.lapse(pid, key_of(id), ts_ns) || self.freed.get(id).is_some() {
                        // The decode still waits on KV already freed (or
                        // a late heartbeat): its READ, if it comes, is the
                        // alert.
                        continue;
                    }
                    let extension = self.lease(pid).extension_ns();
                    let (_, held) = self.held.entry((pid, key_of(id))).or_insert_with(|| {
                        self.pending.push_back(observe(pid, id, Stage::Enqueued));
                        (id.into(), Held::default())
                    });
                    if held.heartbeats == 0 {
                        held.first_beat_ns = ts_ns;
                    }
                    held.heartbeats += 1;
                    held.last_beat_ns = ts_ns;
                    held.deadline_ns = held.deadline_ns.map(|deadline| deadline.max(ts_ns.saturating_add(extension)));
                }
            }
            Ok(Notif::Consumer { id, consumers }) => {
                let pid = self.holder(reader, key_of(id));
                let key = (pid, key_of(id));
                self.lapse(pid, key.1, ts_ns);
                let known = self.held.contains_key(&key);
                if !known && self.read_after_release(id, ts_ns) {
                    return;
                }
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
                    self.freed.insert(id, Freed { holder: pid, at_ns: ts_ns, by_lease: None, reported: false });
                }
            }
            Ok(Notif::PushRegistration) => {}
            Err(why) => self.unparsed(format!("pid {reader}: getNotifs: {why}")),
        }
    }

    /// What is known of a request's freed KV, for the request that ended
    /// at its lease, the prefill's notification of a READ after it, or
    /// the decode's READ that read it after it was freed.
    fn freed_context(&self, request: &RequestSnapshot) -> Vec<(&'static str, String)> {
        let Some(id) = request.external_id.as_deref() else { return Vec::new() };
        let Some(freed) = self.freed.get(id) else { return Vec::new() };
        let shown = if request.key == key_of(id) {
            freed.by_lease.is_some() || request.first_ns > freed.at_ns
        } else {
            freed.at_ns <= request.last_ns
        };
        if !shown {
            return Vec::new();
        }
        let how = match &freed.by_lease {
            Some(lease) => format!("at its lease: {} s ({}), never read", lease.secs, lease.from),
            None => "released: every consumer had answered".to_owned(),
        };
        let mut fields =
            vec![("vllm_request_id", id.to_owned()), ("vllm_kv_freed", format!("by pid {} {how}", freed.holder))];
        if request.last_ns > freed.at_ns {
            fields.push(("vllm_read_after_freed_s", secs(freed.at_ns, request.last_ns)));
        }
        fields
    }

    /// The decode process this agent saw send heartbeats for request `id`
    /// last (one agent on the node sees both sides).
    fn heartbeater(&self, id: &str) -> Option<u32> {
        self.sent
            .iter()
            .filter(|((_, sent_id), sent)| &**sent_id == id && sent.heartbeats > 0)
            .max_by_key(|(_, sent)| sent.last_beat_ns)
            .map(|((decode, _), _)| *decode)
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
    fn signal(&mut self, spec: &SignalSpec, signal: &Signal) -> Claim<Observation> {
        match spec.name.as_str() {
            "vllm_read" => {
                if let Captured::Text(agent) = &signal.capture {
                    let agent = String::from_utf8_lossy(agent).into();
                    self.creating.insert((signal.pid, signal.tid), (signal.value, agent));
                }
                if signal.value == NIXL_READ {
                    self.decodes.insert(signal.pid);
                }
                Claim::NOTHING
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
                Claim::Mine(self.pending.pop_front())
            }
            _ => Claim::NotMine,
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
                Ok(Notif::Consumer { id, consumers }) => Some(Transfer {
                    id: id.into(),
                    read: op == NIXL_READ,
                    consumers,
                    agent,
                    made_ns: observation.ts_ns,
                }),
                _ => None,
            };
            if let Some(transfer) = transfer {
                observation.external_id = Some(transfer.id.clone());
                self.transfers.insert(key, transfer);
            }
        } else if observation.stage.is_terminal() || observation.ends.is_some() {
            let done = matches!(
                Outcome::of_event(observation.stage, observation.ends),
                Some(Outcome::Released | Outcome::Completed)
            );
            if let Some(transfer) = self.transfers.remove(&key).filter(|transfer| transfer.read && done) {
                if self.freed_by(&transfer.id, transfer.made_ns) {
                    observation.ends = Some(Outcome::KvReadAfterRelease);
                }
                self.reads_done.insert(&transfer.id, ReadDone { decode: key.0, at_ns: observation.ts_ns });
            }
        }
        Some(observation)
    }

    fn name(&self) -> &'static str {
        "vllm"
    }

    /// A profile with vLLM's signals (`vllm_*`).
    fn follows(&self, profile: &Profile) -> bool {
        profile.signals.iter().any(|spec| spec.name.starts_with("vllm_"))
    }

    /// Its held requests, followed again by the next agent.
    fn take_over(&mut self) -> Option<&mut dyn TakeOver> {
        Some(self)
    }

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
        let Some((id, held)) = self.held_of(request) else { return self.freed_context(request) };
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
        if let Some(deadline) = held.deadline_ns {
            let lease = self.lease(request.pid);
            fields.push(("vllm_lease", format!("{} s ({})", lease.secs, lease.from)));
            fields.push(("vllm_lease_left_s", secs(now, deadline)));
        }
        let read = self.reads_done.get(id);
        let reading = self.transfers.iter().find(|(_, transfer)| transfer.read && &*transfer.id == id);
        let waited_on = held.waited_on(now, now.saturating_sub(request.last_ns));
        let verdict = if let Some(read) = read {
            &*format!(
                "read: the decode (pid {}) finished its READ {} s ago, but the prefill has not taken its \
                 notification (its engine core does not step: stopped, or busy?)",
                read.decode,
                secs(read.at_ns, now)
            )
        } else if let Some(((decode, handle), transfer)) = reading {
            &*format!(
                "being read: the decode (pid {decode}) made its READ {} s ago and it has not completed (handle \
                 {handle:#x}: its own alert says where it stopped)",
                secs(transfer.made_ns, now)
            )
        } else if let Some(gone) =
            self.departed.get(id).filter(|gone| held.heartbeats > 0 && held.last_beat_ns <= gone.at_ns)
        {
            &*format!(
                "abandoned: the decode (pid {}) that sent its heartbeats exited {} s ago; the prefill frees it at \
                 its lease",
                gone.decode,
                secs(gone.at_ns, now)
            )
        } else if waited_on {
            match self.heartbeater(id) {
                Some(decode) => &*format!(
                    "waited on: the decode (pid {decode}) still sends heartbeats for it and has not made its READ \
                     (queued: no free sequence slot or KV blocks there?)"
                ),
                None => "waited on: the decode still sends heartbeats for it",
            }
        } else if held.heartbeats > 0 {
            "abandoned: its heartbeats stopped"
        } else if held.from_output && held.answered == 0 {
            "never read: no decode has named it (no READ notification, no heartbeat)"
        } else {
            "abandoned: no heartbeat"
        };
        fields.push(("vllm_decode", verdict.to_owned()));
        if let Some(recent) = self.unseen.get(&request.pid).filter(|recent| !recent.is_empty()) {
            let list: Vec<&str> = recent.iter().map(|id| &**id).collect();
            fields.push(("vllm_recent_other_notifications", list.join(" ")));
        }
        fields
    }

    /// Held requests have no memory of their own to read: none.
    fn read(&mut self, silent: &Silent, _read: &mut dyn FnMut(&Silent) -> Option<StageRead>) -> Claim<StageRead> {
        if self.held.contains_key(&(silent.pid, silent.key)) { Claim::NOTHING } else { Claim::NotMine }
    }

    fn stalled_transfer(&self, request: &RequestSnapshot) -> Claim<u64> {
        if self.held_of(request).is_some() { Claim::NOTHING } else { Claim::NotMine }
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

    /// A process's lease, read from its lineage once (its ancestors'
    /// command lines, as a retitled engine core shows none).
    fn attached(&mut self, pid: u32, lineage: &Lineage) {
        let lease = Lease::of(lineage);
        if let Some(problem) = &lease.problem {
            warn!(pid, problem = %problem, lease_s = lease.secs, "vLLM's --kv-transfer-config could not be read: its default lease assumed");
        }
        self.leases.insert(pid, lease);
    }

    /// Every held request past its lease at `now` ends `lease_expired`.
    fn expire(&mut self, now_ns: u64) {
        let lapsed: Vec<(u32, u64)> =
            self.held.iter().filter(|(_, (_, held))| held.lapsed_by(now_ns)).map(|(&key, _)| key).collect();
        for (pid, key) in lapsed {
            self.lapse(pid, key, now_ns);
        }
    }

    /// The earliest lease to run out. A scan: a prefill holds a few
    /// hundred requests at most, and this runs once a wake.
    fn next_expiry(&self) -> Option<u64> {
        self.held.values().filter_map(|(_, held)| held.freed_at()).min()
    }

    /// A decode's exit is remembered for the requests it sent heartbeats
    /// for (their prefill's alert says why they stopped).
    fn forget(&mut self, pid: u32) {
        if self.decodes.contains(&pid) {
            let at_ns = monotonic_ns();
            for ((decode, id), sent) in &self.sent {
                if *decode == pid && sent.heartbeats > 0 && !sent.aborted {
                    self.departed.insert(id, Departed { decode: pid, at_ns });
                }
            }
        }
        self.strings.forget(pid);
        self.leases.remove(&pid);
        self.creating.retain(|(p, _), _| *p != pid);
        self.transfers.retain(|(p, _), _| *p != pid);
        self.held.retain(|(p, _), _| *p != pid);
        self.sent.retain(|(p, _), _| *p != pid);
        self.unseen.remove(&pid);
        self.decodes.remove(&pid);
    }

    fn finish(&mut self) {
        self.warn();
        if self.unknown_shapes > 0 {
            warn!(
                frames = self.unknown_shapes,
                checked_on = outputs::CHECKED_ON,
                "vLLM engine outputs of a shape the vllm profile was not checked on were not read"
            );
        }
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

impl TakeOver for Vllm {
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
}

#[cfg(test)]
mod tests;
