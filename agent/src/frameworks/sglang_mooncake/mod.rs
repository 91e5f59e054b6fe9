//! SGLang on its default transfer backend, Mooncake's TransferEngine
//! (sglang 0.5.23 `disaggregation/mooncake/conn.py`, mooncake-transfer-engine
//! 0.3.13.post1): the rooms are SGLang's ([`Sglang`], the same code as on
//! NIXL, reading Mooncake's bootstrap dialect, [`wire`]), their transfers
//! Mooncake's batches.
//!
//! A prefill's transfer worker writes each chunk of a room to each of its
//! decode ranks in one synchronous batch: `submitTransfer` (batch id,
//! requests naming the decode's engine by a segment id), a busy poll of
//! `getBatchTransferStatus` (never probed), `freeBatchID`. No request
//! identity reaches the engine: a batch is a room's through its segment id
//! (the session `"ip:port"` it was opened for, `openSegment`) and the
//! rooms awaiting that session: the one whose destination pages include
//! the page the batch writes, once the decode's KV layout is learnt
//! ([`pages`]); else the thread's room, else the earliest bootstrapped
//! ([`Rooms::handle`](super::sglang::Rooms::handle), [`Rooms::fifo`](super::sglang::Rooms::fifo)). Its submit makes the room
//! `transfer_posted` (silence from then: a batch that never ends leaves
//! the room `transfer_hung`, naming the batch and its peer); a free that
//! succeeds is the room's progress; a free Mooncake refuses (`BatchBusy`:
//! the batch's tasks are not all finished, after a timeout or a failed
//! write) fails the room, and the batch, leaked (it is never freed and
//! may still write into the decode's pages), is a lifecycle of its own
//! that ends `leaked` at once (`leaked=batch`, as a NIXL handle an SGLang
//! worker never releases is `leaked=handle`).
//!
//! Batch ids are `BatchDesc` addresses the allocator hands out again at
//! once: an id is a batch from its submit to its free, and a submit of an
//! id still held (its free missed) starts a new batch.
//!
//! An agent started after a session's `openSegment` does not know its
//! segment id: at the first batch to it, the engine's own table of
//! segments is read from the process ([`segments`]). Where that read
//! fails, the batch is taken as its thread's room's (or the one
//! bootstrapped room's) when that room has a single destination, which
//! names the segment from then on ([`SglangMooncake::learned`]); until
//! then such a batch is its own lifecycle, keyed by its id.
pub mod pages;
pub mod segments;
pub mod wire;

use std::collections::{HashMap, HashSet, VecDeque, hash_map::Entry};

use tracing::{debug, info, warn};

use pages::Layout;

use super::{
    AdoptedHandle, Claim, Framework, HandOver, TakeOver,
    sglang::{Dialect, Sglang},
    signals::{Captured, Signal},
};
use crate::{
    evidence::memory,
    lifecycle::{Observation, Outcome, RequestSnapshot, Restored, Side, Silent, Stage, StageRead},
    profile::SignalSpec,
};

/// The prefix of the `sglang-mooncake` profile's SGLang signals
/// (`mooncake_zmq_recv` ...), so SGLang-on-NIXL's tracker never takes them.
const PREFIX: &str = "mooncake_";

/// A `TransferRequest`'s `target_id` (the segment id), `target_offset`
/// (the address written in the decode) and `length`, in the bytes the
/// `mooncake_submit` signal reads at the first request.
const TARGET_ID_AT: usize = 16;
const TARGET_OFFSET_AT: usize = 24;
const LENGTH_AT: usize = 32;

/// Leaked batches kept for their alert, per process at most (each is a
/// lifecycle that ends as it starts: its alert is written on the same
/// loop turn).
const LEAKS_KEPT: usize = 1024;

/// One batch, from its submit to its free.
struct Batch {
    /// Its room, if one could be told.
    room: Option<u64>,
    /// Its peer, the decode engine's session.
    session: Option<Box<str>>,
    submit_ns: u64,
}

/// A batch whose free Mooncake refused.
struct Leak {
    room: Option<u64>,
    session: Option<Box<str>>,
    submit_ns: u64,
    free_ns: u64,
}

/// SGLang's rooms on Mooncake, and the batches that move their KV.
pub struct SglangMooncake {
    sglang: Sglang,
    /// (pid, segment id) -> the session it was opened for.
    segments: HashMap<(u32, u64), Box<str>>,
    /// (pid, batch id) -> the batch, from its submit to its free.
    batches: HashMap<(u32, u64), Batch>,
    /// (pid, batch id) -> a leaked batch, for its alert.
    leaks: HashMap<(u32, u64), Leak>,
    /// Observations beside the one an event made (a leaked batch's).
    pending: VecDeque<Observation>,
    /// (pid, tid) -> the segment ids of the batches the thread submitted
    /// to segments not known, since its last status send: SGLang's
    /// transfer worker sends a room's status itself, after the room's last
    /// batch, so they were that room's ([`SglangMooncake::concluded`]).
    unknown: HashMap<(u32, u32), Vec<u64>>,
    /// (pid, segment id) the engine's table was read for.
    tried: HashSet<(u32, u64)>,
    /// (pid, segment id) -> the decode's KV layout, learnt from batches:
    /// which room a batch is, by the page it writes.
    layouts: HashMap<(u32, u64), Layout>,
    /// Layouts a batch contradicted, learnt again.
    pub layouts_relearnt: u64,
    /// Segment ids read from the engine's table.
    pub read_segments: u64,
    /// Reads of the engine's table that failed, and the latest reason.
    pub tables_unread: u64,
    table_problem: Option<String>,
    /// Segment ids learnt from a batch, not from their `openSegment` or
    /// the engine's table.
    pub learned: u64,
    /// Batches to a segment id neither `openSegment` nor a room told.
    pub unknown_segment: u64,
    /// Batches leaked (free refused).
    pub leaked: u64,
    /// The batch the last submit started, with its peer, for the transport
    /// evidence per peer ([`Framework::started_transfer`]).
    started: Option<(u32, u64, Box<str>)>,
}

impl Default for SglangMooncake {
    fn default() -> Self {
        let mut sglang = Sglang::with(Dialect { prefix: PREFIX, parse: wire::parse, leaks: false });
        sglang.rooms_mut().fifo = true;
        Self {
            sglang,
            segments: HashMap::new(),
            batches: HashMap::new(),
            leaks: HashMap::new(),
            pending: VecDeque::new(),
            unknown: HashMap::new(),
            tried: HashSet::new(),
            layouts: HashMap::new(),
            layouts_relearnt: 0,
            read_segments: 0,
            tables_unread: 0,
            table_problem: None,
            learned: 0,
            unknown_segment: 0,
            leaked: 0,
            started: None,
        }
    }
}

impl SglangMooncake {
    /// A batch submitted on thread `signal.tid`: the room's
    /// `transfer_posted`, or the batch's own when no room is its.
    fn submit(&mut self, signal: &Signal) -> Option<Observation> {
        let (pid, tid, batch) = (signal.pid, signal.tid, signal.value);
        let field = |at: usize| match &signal.capture {
            Captured::Bytes(bytes) => Some(u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))),
            _ => None,
        };
        let target = field(TARGET_ID_AT);
        let mut session = target.and_then(|target| self.segments.get(&(pid, target)).cloned());
        if let (None, Some(target)) = (&session, target) {
            // A segment opened before this agent: the engine's table says.
            session = self.session_in_table(pid, target, signal.ret as u64);
        }
        if session.is_none() {
            // The table could not be read: the one peer it can be,
            // of those a room about to transfer awaits that no other
            // segment id names already.
            let mut peers = self.sglang.rooms().guess(pid, tid);
            peers.retain(|peer| !self.segments.iter().any(|(&(p, _), known)| p == pid && known == peer));
            match (target, &peers[..]) {
                (Some(target), [peer]) => {
                    self.segments.insert((pid, target), peer.clone());
                    self.learned += 1;
                    session = Some(peer.clone());
                }
                (target, _) => {
                    self.unknown_segment += 1;
                    if let Some(target) = target {
                        self.unknown.entry((pid, tid)).or_default().push(target);
                    }
                }
            }
        }
        // A batch id still held is a batch whose free was not seen: it is
        // over, and this is the id's next batch.
        if self.batches.remove(&(pid, batch)).is_some() {
            let over = Observation {
                pid,
                key: batch,
                stage: Stage::Released,
                ts_ns: signal.ts_ns,
                external_id: None,
                ends: None,
            };
            let _ = self.sglang.rooms_mut().handle(tid, over);
        }
        let posted = Observation {
            pid,
            key: batch,
            stage: Stage::TransferPosted,
            ts_ns: signal.ts_ns,
            external_id: None,
            ends: None,
        };
        let made = match &session {
            Some(peer) => {
                let page = match (target, field(TARGET_OFFSET_AT), field(LENGTH_AT)) {
                    (Some(target), Some(offset), Some(len)) => self.first_page(pid, target, peer, offset, len),
                    _ => None,
                };
                let rooms = self.sglang.rooms_mut();
                rooms.creating(pid, tid, peer.as_bytes(), page);
                match rooms.handle(tid, Observation { stage: Stage::Enqueued, ..posted.clone() }) {
                    None => rooms.handle(tid, posted.clone()),
                    Some(_) => Some(posted),
                }
            }
            None => Some(posted),
        };
        self.started = session.clone().map(|peer| (pid, batch, peer));
        let room = made.as_ref().filter(|made| made.key != batch).map(|made| made.key);
        self.batches.insert((pid, batch), Batch { room, session, submit_ns: signal.ts_ns });
        made
    }

    /// The page of its decode a batch to segment `target` (the session
    /// `peer`) writes first, its first request at `offset`, `len` bytes
    /// long, by the segment's layout; a batch that can only be its room's
    /// first teaches the layout.
    fn first_page(&mut self, pid: u32, target: u64, peer: &str, offset: u64, len: u64) -> Option<u32> {
        let sole = self.sglang.rooms().sole_first_page(pid, peer);
        let layout = self.layouts.entry((pid, target)).or_default();
        if let Some(page) = sole {
            let before = layout.fitted();
            if layout.learn(offset, page) {
                self.layouts_relearnt += 1;
                debug!(
                    pid,
                    segment = target,
                    ?before,
                    offset,
                    page,
                    "a Mooncake batch contradicted its decode's KV layout"
                );
            } else if before.is_none()
                && let Some(fit) = layout.fitted()
            {
                debug!(pid, segment = target, base = fit.base, item_len = fit.item_len, "a decode's KV layout learnt");
            }
        }
        layout.page(offset, len)
    }

    /// The session of segment `target`, from the table of the engine
    /// whose `TransferMetadata` is at `metadata` (the submit's `extra`),
    /// read once per segment not known: every segment it lists is known
    /// from then on.
    fn session_in_table(&mut self, pid: u32, target: u64, metadata: u64) -> Option<Box<str>> {
        if metadata == 0 || !self.tried.insert((pid, target)) {
            return None;
        }
        match segments::read(metadata, |addr, buf| memory::read(pid, addr, buf)) {
            Ok(table) => {
                let listed = table.len();
                for (id, name) in table {
                    if let Entry::Vacant(vacant) = self.segments.entry((pid, id)) {
                        vacant.insert(name);
                        self.read_segments += 1;
                    }
                }
                debug!(pid, segment = target, listed, "the Mooncake engine's segments read from its table");
            }
            Err(problem) => {
                self.tables_unread += 1;
                if self.tables_unread == 1 {
                    warn!(
                        pid,
                        segment = target,
                        problem,
                        "the Mooncake engine's segment table could not be read: batches to segments opened before \
                         the agent are told from their rooms' statuses instead (counted in the summary)"
                    );
                }
                self.table_problem = Some(format!("process {pid}: {problem}"));
            }
        }
        self.segments.get(&(pid, target)).cloned()
    }

    /// Thread `tid` sent the status of `room` (SGLang's transfer worker
    /// concludes a room on its own thread, after its last batch): the
    /// segments the thread wrote to since its previous status, none known,
    /// were the room's peer's, when the room has one peer and they were
    /// all one segment.
    fn concluded(&mut self, pid: u32, tid: u32, room: u64, peers: &[Box<str>]) {
        let Some(mut targets) = self.unknown.remove(&(pid, tid)) else { return };
        targets.sort_unstable();
        targets.dedup();
        let ([target], [peer]) = (&targets[..], peers) else { return };
        let known = self.segments.iter().any(|(&(p, _), session)| p == pid && session == peer);
        if !known && self.segments.insert((pid, *target), peer.clone()).is_none() {
            self.learned += 1;
            tracing::debug!(
                pid,
                room,
                segment = target,
                peer = &**peer,
                "a Mooncake segment learnt from its room's status"
            );
        }
    }

    /// The leaked batch `key` of `pid`, as its own lifecycle: posted at
    /// its submit, [`Outcome::Leaked`] at the refused free.
    /// (`started`: the batch is its own lifecycle already, from its submit.)
    fn leak(&mut self, pid: u32, key: u64, batch: Batch, free_ns: u64, started: bool) {
        self.leaked += 1;
        if self.leaks.len() >= LEAKS_KEPT {
            self.leaks.clear();
        }
        let Batch { room, session, submit_ns } = batch;
        self.leaks.insert((pid, key), Leak { room, session, submit_ns, free_ns });
        let own = |stage, ts_ns| Observation { pid, key, stage, ts_ns, external_id: None, ends: None };
        if !started {
            self.pending.push_back(own(Stage::TransferPosted, submit_ns));
        }
        self.pending.push_back(Observation { ends: Some(Outcome::Leaked), ..own(Stage::TransferPosted, free_ns) });
    }
}

/// A batch id as alerts show it.
fn hex(id: u64) -> String {
    format!("{id:#x}")
}

impl Framework for SglangMooncake {
    fn signal(&mut self, spec: &SignalSpec, signal: &Signal) -> Claim<Observation> {
        match spec.name.as_str() {
            // TransferEngineImpl::openSegment(name) returned the segment id.
            "mooncake_segment" => {
                if let Captured::Text(session) = &signal.capture {
                    let session = String::from_utf8_lossy(session).into();
                    self.segments.insert((signal.pid, signal.value), session);
                }
                Claim::NOTHING
            }
            "mooncake_submit" => Claim::Mine(self.submit(signal)),
            "mooncake_zmq_send" => {
                // A room's status, sent by its worker thread.
                let Claim::Mine(made) = self.sglang.signal(spec, signal) else { return Claim::NotMine };
                let ended = self.sglang.rooms_mut().last_ended.take();
                if let (Some(end), Some(ended)) = (&made, ended)
                    && (ended.pid, ended.room) == (end.pid, end.key)
                {
                    self.sglang.rooms_mut().worked_by(ended.pid, ended.ports, signal.tid);
                    self.concluded(ended.pid, signal.tid, ended.room, &ended.agents);
                }
                Claim::Mine(made)
            }
            _ => self.sglang.signal(spec, signal),
        }
    }

    /// A batch's free (the profile's `freeBatchID` probe: `released` when
    /// freed, `failed` when refused) is its room's.
    fn handle(&mut self, tid: u32, observation: Observation) -> Option<Observation> {
        let Observation { pid, key, stage, ts_ns, .. } = observation;
        let Some(batch) = self.batches.remove(&(pid, key)) else { return self.sglang.handle(tid, observation) };
        let own = batch.room.is_none();
        match stage {
            // A batch of its own was started by its submit signal, which
            // the agent holds in the kernel's table: its end is the
            // agent's to hold too, so it goes as one the agent made.
            Stage::Released if own => {
                self.pending.push_back(observation);
                None
            }
            // Freed: the room moves on to its next batch (or its status).
            Stage::Released => self
                .sglang
                .rooms_mut()
                .handle(tid, Observation { stage: Stage::TransferDone, ends: Some(Outcome::Completed), ..observation }),
            Stage::Failed if own => {
                self.leak(pid, key, batch, ts_ns, true);
                // Its own lifecycle, started at its submit, ends with the
                // leak's observations.
                None
            }
            Stage::Failed => {
                let room = self.sglang.rooms_mut().handle(tid, observation);
                self.leak(pid, key, batch, ts_ns, false);
                room
            }
            _ => Some(observation),
        }
    }

    fn pending(&mut self) -> Option<Observation> {
        self.pending.pop_front()
    }

    fn follows(&self, profile: &crate::profile::Profile) -> bool {
        self.sglang.follows(profile)
    }

    /// Its rooms, as SGLang's on NIXL: what this agent knew of each is
    /// pinned for the next.
    fn take_over(&mut self) -> Option<&mut dyn TakeOver> {
        Some(self)
    }

    fn side(&self, pid: u32) -> Side {
        self.sglang.side(pid)
    }

    /// SGLang's, on another transfer engine.
    fn name(&self) -> &'static str {
        self.sglang.name()
    }

    fn native(&self, request: &RequestSnapshot) -> Vec<(&'static str, i64)> {
        self.sglang.native(request)
    }

    /// A room's alert names the batch it is stopped on and its peer; a
    /// batch of its own (no room told), its peer; a leaked batch's, that
    /// it leaked, its room and peer, and how long after its submit the
    /// free was refused.
    fn context(&self, request: &RequestSnapshot) -> Vec<(&'static str, String)> {
        let (pid, key) = (request.pid, request.key);
        if request.external_id.is_none() {
            if let Some(leak) = self.leaks.get(&(pid, key)) {
                let mut fields = vec![("leaked", "batch".to_owned()), ("batch", hex(key))];
                fields.extend(leak.room.map(|room| ("room", room.to_string())));
                fields.extend(leak.session.as_ref().map(|peer| ("peer", peer.to_string())));
                fields.push(("release", "refused".to_owned()));
                fields.push(("after_ms", (leak.free_ns.saturating_sub(leak.submit_ns) / 1_000_000).to_string()));
                return fields;
            }
            if let Some(batch) = self.batches.get(&(pid, key)) {
                let mut fields = vec![("batch", hex(key))];
                fields.extend(batch.session.as_ref().map(|peer| ("peer", peer.to_string())));
                return fields;
            }
        }
        let mut fields = Vec::new();
        for (name, value) in self.sglang.context(request) {
            if name != "handle" {
                fields.push((name, value));
                continue;
            }
            let batch = u64::from_str_radix(value.trim_start_matches("0x"), 16).ok();
            let peer = batch.and_then(|batch| self.batches.get(&(pid, batch))?.session.clone());
            fields.push(("batch", value));
            fields.extend(peer.map(|peer| ("peer", peer.to_string())));
        }
        fields
    }

    fn read(&mut self, silent: &Silent, read: &mut dyn FnMut(&Silent) -> Option<StageRead>) -> Claim<StageRead> {
        self.sglang.read(silent, read)
    }

    fn stalled_transfer(&self, request: &RequestSnapshot) -> Claim<u64> {
        self.sglang.stalled_transfer(request)
    }

    fn queued_behind(&self, request: &RequestSnapshot) -> Option<u64> {
        self.sglang.queued_behind(request)
    }

    fn started_transfer(&mut self) -> Option<(u32, u64, Box<str>)> {
        self.started.take()
    }

    fn warn(&mut self) {
        self.sglang.warn();
    }

    fn forget(&mut self, pid: u32) {
        self.sglang.forget(pid);
        self.segments.retain(|(p, _), _| *p != pid);
        self.tried.retain(|(p, _)| *p != pid);
        self.layouts.retain(|(p, _), _| *p != pid);
        self.batches.retain(|(p, _), _| *p != pid);
        self.leaks.retain(|(p, _), _| *p != pid);
    }

    fn finish(&mut self) {
        self.sglang.warn();
        let layouts = self.layouts.values().filter(|layout| layout.fitted().is_some()).count();
        if self.read_segments + self.tables_unread + self.learned + self.unknown_segment + self.leaked > 0 {
            info!(
                read_segments = self.read_segments,
                tables_unread = self.tables_unread,
                table_problem = self.table_problem.as_deref().unwrap_or_default(),
                learned_segments = self.learned,
                unknown_segment_batches = self.unknown_segment,
                kv_layouts = layouts,
                kv_layouts_relearnt = self.layouts_relearnt,
                leaked_batches = self.leaked,
                "Mooncake batches: segment ids read from the engine's table (opened before the agent started), \
                 reads of that table that failed (table_problem: the latest), segment ids learnt from a room \
                 instead, batches to a segment nothing told (each followed as a lifecycle of its own), decodes \
                 whose KV layout was learnt (a batch's room told by the page it writes) and layouts a batch \
                 contradicted, batches whose free Mooncake refused"
            );
        }
    }
}

impl TakeOver for SglangMooncake {
    fn adopt(&mut self, request: &Restored, held: Option<&[u8]>) -> Result<Vec<AdoptedHandle>, String> {
        TakeOver::adopt(&mut self.sglang, request, held)
    }

    fn adopt_ended(&mut self, pid: u32, key: u64, held: &[u8]) -> bool {
        TakeOver::adopt_ended(&mut self.sglang, pid, key, held)
    }

    fn owns(&self, pid: u32, key: u64) -> bool {
        TakeOver::owns(&self.sglang, pid, key)
    }

    fn held(&mut self, out: &mut Vec<HandOver>) {
        TakeOver::held(&mut self.sglang, out);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use stallwatch_common::EXT_ID_LEN;

    use super::*;
    use crate::{frameworks::sglang::Bootstrap, profile::Profile};

    fn spec(name: &str) -> Arc<SignalSpec> {
        let profile = Profile::load("sglang-mooncake").expect("the sglang-mooncake profile");
        Arc::new(profile.signals.into_iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no {name}")))
    }

    fn segment(pid: u32, id: u64, session: &str) -> Signal {
        Signal {
            pid,
            tid: 20,
            ts_ns: 1,
            value: id,
            ret: id as i64,
            capture: Captured::Text(session.as_bytes().into()),
            tag: None,
        }
    }

    /// `submitTransfer(batch)` on `tid` at `ts_ns`, writing to segment `target`.
    fn submit(pid: u32, tid: u32, batch: u64, target: u64, ts_ns: u64) -> Signal {
        let mut bytes = [0u8; EXT_ID_LEN];
        bytes[TARGET_ID_AT..TARGET_ID_AT + 8].copy_from_slice(&target.to_le_bytes());
        Signal { pid, tid, ts_ns, value: batch, ret: 0, capture: Captured::Bytes(Box::new(bytes)), tag: None }
    }

    fn free(pid: u32, batch: u64, stage: Stage, ts_ns: u64) -> Observation {
        Observation { pid, key: batch, stage, ts_ns, external_id: None, ends: None }
    }

    fn destination(room: u64, session: &str) -> Bootstrap {
        let port = wire::session_port(session.as_bytes()).unwrap();
        Bootstrap::Destination { room, port, agent: session.into(), ranks: 1, pages: Default::default() }
    }

    #[test]
    fn batches_are_their_rooms_in_bootstrap_order_and_a_refused_free_fails_the_room_and_leaks_the_batch() {
        let mut mc = SglangMooncake::default();
        let (segment_spec, submit_spec) = (spec("mooncake_segment"), spec("mooncake_submit"));
        let rooms = |mc: &mut SglangMooncake, room, session| {
            mc.sglang.rooms_mut().observe(4, room, &destination(room, session)).expect("a room")
        };
        // Rooms 7, 8 and 9 to the same decode session, one worker.
        for room in [7, 8, 9] {
            rooms(&mut mc, room, "127.0.0.1:15290");
        }
        assert_eq!(mc.signal(&segment_spec, &segment(4, 1, "127.0.0.1:15290")), Claim::NOTHING);
        // Room 7's two chunks reuse one batch id: each submit is its room's post.
        for ts in [10, 20] {
            let posted = mc
                .signal(&submit_spec, &submit(4, 30, 0xb0, 1, ts))
                .expect_mine("a Mooncake signal")
                .expect("room 7's");
            assert_eq!((posted.key, posted.stage, posted.ts_ns), (7, Stage::TransferPosted, ts));
            // The batch and its peer, for the transport evidence per peer; once.
            assert_eq!(mc.started_transfer(), Some((4, 0xb0, "127.0.0.1:15290".into())));
            assert_eq!(mc.started_transfer(), None);
            let freed = mc.handle(30, free(4, 0xb0, Stage::Released, ts + 1)).expect("room 7 moves on");
            assert_eq!((freed.key, freed.stage), (7, Stage::TransferPosted));
        }
        mc.sglang.rooms_mut().observe(4, 25, &Bootstrap::Status { room: 7, status: 4 }).expect("room 7 released");
        // The next batch on the worker is room 8's (the earliest bootstrapped); it hangs.
        let posted =
            mc.signal(&submit_spec, &submit(4, 30, 0xb0, 1, 30)).expect_mine("a Mooncake signal").expect("room 8's");
        assert_eq!(posted.key, 8);
        let field =
            |fields: &[(&str, String)], name: &str| fields.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone());
        let snapshot = |key: u64, external: Option<&str>| RequestSnapshot {
            pid: 4,
            key,
            external_id: external.map(Into::into),
            stage: Stage::TransferPosted,
            stage_ns: [None; 4],
            first_ns: 30,
            last_ns: 30,
            stalled: None,
            inferred: Default::default(),
        };
        let hung = mc.context(&snapshot(8, Some("8")));
        assert_eq!(field(&hung, "batch").as_deref(), Some("0xb0"), "{hung:?}");
        assert_eq!(field(&hung, "peer").as_deref(), Some("127.0.0.1:15290"), "{hung:?}");
        assert_eq!(field(&hung, "handle"), None);
        // Room 9 waits behind it on the same worker.
        let behind = mc.context(&snapshot(9, Some("9")));
        assert_eq!((field(&behind, "behind"), field(&behind, "waiting_on")), (Some("8".into()), Some("worker".into())));
        // Its free refused after the timeout: room 8 fails, once; the batch
        // leaks, a lifecycle of its own from its submit to the refusal.
        let failed = mc.handle(30, free(4, 0xb0, Stage::Failed, 5030)).expect("room 8 fails");
        assert_eq!((failed.key, failed.stage), (8, Stage::Failed));
        let leak: Vec<_> = std::iter::from_fn(|| mc.pending()).map(|o| (o.key, o.stage, o.ts_ns, o.ends)).collect();
        let posted = Stage::TransferPosted;
        assert_eq!(leak, [(0xb0, posted, 30, None), (0xb0, posted, 5030, Some(Outcome::Leaked))]);
        let leaked = mc.context(&snapshot(0xb0, None));
        assert_eq!(field(&leaked, "leaked").as_deref(), Some("batch"), "{leaked:?}");
        assert_eq!(field(&leaked, "room").as_deref(), Some("8"));
        assert_eq!(field(&leaked, "release").as_deref(), Some("refused"));
        assert_eq!(field(&leaked, "after_ms").as_deref(), Some("0"), "5000 ns");
        assert_eq!(
            mc.sglang.rooms_mut().observe(4, 5031, &Bootstrap::Status { room: 8, status: 0 }),
            None,
            "its failed status ends nothing more"
        );
        // A new batch id for room 9 (the leaked one is never freed).
        assert_eq!(
            mc.signal(&submit_spec, &submit(4, 30, 0xc0, 1, 5040)).expect_mine("a Mooncake signal").map(|o| o.key),
            Some(9)
        );
        assert_eq!(mc.leaked, 1);
        mc.forget(4);
        assert!(mc.batches.is_empty() && mc.segments.is_empty() && mc.leaks.is_empty());
    }

    #[test]
    fn a_decodes_kv_layout_learnt_from_first_batches_tells_its_rooms_apart_by_page() {
        const BASE: u64 = 0x7f00_0000_0000;
        const ITEM: u64 = 8192;
        let mut mc = SglangMooncake::default();
        let (segment_spec, submit_spec) = (spec("mooncake_segment"), spec("mooncake_submit"));
        let peer = "127.0.0.1:15290";
        assert_eq!(mc.signal(&segment_spec, &segment(4, 1, peer)), Claim::NOTHING);
        let room = |mc: &mut SglangMooncake, room: u64, pages: &[u32]| {
            let port = wire::session_port(peer.as_bytes()).unwrap();
            let to = Bootstrap::Destination { room, port, agent: peer.into(), ranks: 1, pages: pages.into() };
            mc.sglang.rooms_mut().observe(4, room, &to).expect("a room");
        };
        // A batch on `tid` whose first request writes `run` pages from `page`
        // (or the aux: 64 bytes elsewhere).
        let batch = |tid: u32, batch: u64, page: Option<u32>| {
            let mut signal = submit(4, tid, batch, 1, 10);
            let Captured::Bytes(bytes) = &mut signal.capture else { unreachable!() };
            let (offset, len) = page.map_or((BASE - 4096, 64), |page| (BASE + u64::from(page) * ITEM, 2 * ITEM));
            bytes[TARGET_OFFSET_AT..TARGET_OFFSET_AT + 8].copy_from_slice(&offset.to_le_bytes());
            bytes[LENGTH_AT..LENGTH_AT + 8].copy_from_slice(&len.to_le_bytes());
            signal
        };
        let post = |mc: &mut SglangMooncake, tid, id, page| {
            let made = mc
                .signal(&submit_spec, &batch(tid, id, page))
                .expect_mine("a Mooncake signal")
                .expect("an observation");
            assert_eq!(mc.handle(tid, free(4, id, Stage::Released, 11)).map(|o| o.key), Some(made.key));
            made.key
        };
        // Rooms 5 and 6, one at a time: their first batches can be no other
        // room's, and give the decode's layout.
        for (r, pages) in [(5, [2, 3]), (6, [4, 5])] {
            room(&mut mc, r, &pages);
            assert_eq!(post(&mut mc, 30, 0xa0, Some(pages[0])), r);
            assert_eq!(post(&mut mc, 30, 0xa0, None), r, "its aux, the thread's room");
            mc.sglang.rooms_mut().observe(4, 12, &Bootstrap::Status { room: r, status: 4 }).expect("released");
        }
        assert_eq!(mc.layouts[&(4, 1)].fitted(), Some(pages::Fit { base: BASE, item_len: ITEM }));
        // Rooms 7 then 8 to the same decode; the worker takes 8 first, then
        // interleaves 7's first chunk before 8's second: each batch is the
        // room whose pages it writes, not the earliest bootstrapped or the
        // thread's.
        room(&mut mc, 7, &[10, 11, 12, 13]);
        room(&mut mc, 8, &[20, 21, 22, 23]);
        assert_eq!(post(&mut mc, 30, 0xb0, Some(20)), 8);
        assert_eq!(post(&mut mc, 30, 0xb0, Some(10)), 7);
        assert_eq!(post(&mut mc, 30, 0xb0, Some(22)), 8);
        assert_eq!(mc.layouts_relearnt, 0);
    }

    #[test]
    fn segments_opened_before_the_agent_are_read_from_the_engines_table_in_the_process() {
        // The engine's table, laid out as engine.so's (segments.rs), in this
        // process's memory: metadata -> node(2) -> node(1), each node's
        // descriptor starting with its name.
        let names = ["127.0.0.1:15290", "127.0.0.1:15292"];
        let descs: Vec<[u64; 2]> = names.iter().map(|n| [n.as_ptr() as u64, n.len() as u64]).collect();
        let mut nodes = [[0u64; 3]; 2];
        nodes[0] = [0, 1, descs[0].as_ptr() as u64];
        nodes[1] = [nodes[0].as_ptr() as u64, 2, descs[1].as_ptr() as u64];
        let mut metadata = [0u64; 30];
        metadata[0xe0 / 8] = nodes[1].as_ptr() as u64;
        metadata[0xe8 / 8] = 2;
        let pid = std::process::id();
        let mut mc = SglangMooncake::default();
        let submit_spec = spec("mooncake_submit");
        // Rooms 7 and 8 to two decodes, bootstrapped before any batch: a
        // batch to segment 2 could be either's but for the table.
        for (room, session) in [(7, names[0]), (8, names[1])] {
            mc.sglang.rooms_mut().observe(pid, room, &destination(room, session)).expect("a room");
        }
        let at = |metadata: &[u64; 30]| Signal { ret: metadata.as_ptr() as i64, ..submit(pid, 30, 0xa0, 2, 5) };
        let posted = mc.signal(&submit_spec, &at(&metadata)).expect_mine("a Mooncake signal").expect("room 8's");
        assert_eq!((posted.key, posted.stage), (8, Stage::TransferPosted));
        assert_eq!((mc.read_segments, mc.learned, mc.unknown_segment), (2, 0, 0));
        assert_eq!(mc.segments.get(&(pid, 1)).map(|s| &**s), Some(names[0]));
        // Read once per segment not known: a table that stopped reading
        // (its count now too large) is not read again for a known one.
        metadata[0xe8 / 8] = u64::MAX;
        assert_eq!(mc.handle(30, free(pid, 0xa0, Stage::Released, 6)).map(|o| o.key), Some(8));
        assert_eq!(mc.signal(&submit_spec, &at(&metadata)).expect_mine("a Mooncake signal").map(|o| o.key), Some(8));
        assert_eq!(mc.tables_unread, 0);
        // A segment the table does not list, in a table that cannot be
        // read: counted with its reason, and the batch is its own.
        let unread = Signal { ret: metadata.as_ptr() as i64, ..submit(pid, 31, 0xb0, 9, 7) };
        assert_eq!(mc.signal(&submit_spec, &unread).expect_mine("a Mooncake signal").map(|o| o.key), Some(0xb0));
        assert_eq!((mc.tables_unread, mc.unknown_segment), (1, 1));
        assert!(mc.table_problem.as_deref().is_some_and(|p| p.contains("not the table")), "{:?}", mc.table_problem);
    }

    #[test]
    fn a_segment_opened_before_the_agent_is_learnt_from_the_one_room_it_can_be() {
        let mut mc = SglangMooncake::default();
        let submit_spec = spec("mooncake_submit");
        // No room yet: the batch to unknown segment 3 is its own lifecycle.
        let own =
            mc.signal(&submit_spec, &submit(4, 30, 0xa0, 3, 5)).expect_mine("a Mooncake signal").expect("its own");
        assert_eq!((own.key, own.stage), (0xa0, Stage::TransferPosted));
        assert_eq!(mc.unknown_segment, 1);
        assert_eq!(mc.started_transfer(), None, "no peer known: no transfer for the evidence per peer");
        assert_eq!(mc.handle(30, free(4, 0xa0, Stage::Released, 6)), None, "its end, made by the agent");
        let freed = mc.pending().expect("its own end");
        assert_eq!((freed.key, freed.stage), (0xa0, Stage::Released));
        // One bootstrapped room: segment 3 is its session from now on.
        mc.sglang.rooms_mut().observe(4, 7, &destination(7, "127.0.0.1:15292")).expect("room 7");
        let posted =
            mc.signal(&submit_spec, &submit(4, 30, 0xa0, 3, 8)).expect_mine("a Mooncake signal").expect("room 7's");
        assert_eq!(posted.key, 7);
        assert_eq!((mc.learned, mc.segments.get(&(4, 3)).map(|s| &**s)), (1, Some("127.0.0.1:15292")));
        // A submit of a batch id whose free was missed starts its next batch.
        assert_eq!(
            mc.signal(&submit_spec, &submit(4, 30, 0xa0, 3, 9)).expect_mine("a Mooncake signal").map(|o| o.key),
            Some(7)
        );
        // Signals of other frameworks pass on; NIXL's SGLang takes none of these.
        let nixl_zmq = Profile::load("sglang").unwrap().signals.into_iter().find(|s| s.name == "zmq_recv").unwrap();
        assert_eq!(mc.signal(&nixl_zmq, &submit(4, 30, 0, 0, 10)), Claim::NotMine);
        let mut nixl = Sglang::default();
        assert_eq!(nixl.signal(&submit_spec, &submit(4, 30, 0, 0, 10)), Claim::NotMine);
        assert_eq!(nixl.signal(&spec("mooncake_zmq_recv"), &submit(4, 30, 0, 0, 10)), Claim::NotMine);
        assert!(
            mc.follows(&Profile::load("sglang-mooncake").unwrap()) && !mc.follows(&Profile::load("sglang").unwrap())
        );
        assert!(!nixl.follows(&Profile::load("sglang-mooncake").unwrap()));
    }
}
