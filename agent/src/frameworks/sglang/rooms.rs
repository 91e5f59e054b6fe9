//! The rooms of every watched process, from the bootstrap messages SGLang
//! sends and receives ([`Bootstrap`], parsed from ZMQ messages) and the NIXL
//! handles attributed to them, as lifecycles.
mod dummies;
mod held;
mod runs;
#[cfg(test)]
mod tests;
mod wire;

use std::collections::{HashMap, HashSet, VecDeque};

pub use self::runs::Runs;
pub use self::wire::{Bootstrap, RID_KEPT, Rid, output_rids, pages, parse, pickled_record, scheduler};
use self::wire::{FAILED, SUCCESS};
use self::{
    dummies::Dummies,
    held::{Held, decode, encode, encode_ended},
};
use crate::{
    frameworks::{AdoptedHandle, Claim, HandOver},
    lifecycle::{Observation, Side, Silent, Stage, StageRead},
};

/// SGLang's transfer workers per prefill rank: a room's transfers run on
/// worker `sum(destination ports) % WORKERS`.
const WORKERS: u32 = 4;

/// How many rooms cut short ([`Rooms::cut_short`]) are remembered, across
/// processes: a late transfer follows its room's end within one chunk of
/// its worker, and rooms are cut short rarely.
const CUT_SHORT_KEPT: usize = 64;

/// A live room.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Room {
    /// Which end of it this process is.
    side: Side,
    /// Its scheduler received it (before any destination).
    received: bool,
    /// The NIXL agents of its destinations (one per decode rank that
    /// answered).
    agents: Vec<Box<str>>,
    /// The KV pages of each destination, by its agent (as `agents`), as
    /// far as they were read ([`Bootstrap::Destination`]): a chunk's
    /// transfer writes to its room's pages, which no other live room of
    /// that decode rank has.
    pages: Vec<Runs>,
    /// Its decode ranks: it is bootstrapped once each sent its destination.
    ranks: u32,
    /// How many of them sent a dummy destination ([`Bootstrap::Dummy`]):
    /// answered, with nothing for this rank to write to.
    dummies: u32,
    /// The sum of its destinations' ports: its worker, modulo [`WORKERS`].
    ports: u32,
    /// How many handles were attributed to it (its transfers in the order
    /// its worker created them: per chunk one per rank, the aux last).
    transfers: u32,
    /// Its handles posted and not done, oldest first, with their ordinal
    /// among its transfers (from 1).
    outstanding: Vec<(u64, u32)>,
    /// The rid its scheduler received it with (what an abort or an output
    /// names it by).
    rid: Option<Rid>,
    /// When it was bootstrapped (every decode rank answered), in order
    /// among the process's rooms: with [`Rooms::fifo`], a transfer no page
    /// or thread tells is the earliest's.
    seq: u64,
}

/// The rooms of every watched process, from destination to conclusion.
#[derive(Default)]
pub struct Rooms {
    /// (pid, room) of every room whose destination arrived and that has
    /// not ended.
    live: HashMap<(u32, u64), Room>,
    /// (pid, tid): the remote agent of the transfer the thread is creating,
    /// and the first remote page it writes, where known.
    creating: HashMap<(u32, u32), (Box<str>, Option<u32>)>,
    /// (pid, handle) -> the room the handle was attributed to, its
    /// ordinal among the room's transfers and the index of its peer among
    /// the room's `agents`, until the handle ends (its events are the
    /// room's, or nobody's once the room ended, never a lifecycle of their
    /// own).
    handles: HashMap<(u32, u64), Attributed>,
    /// (pid, tid) -> the room the thread's last attributed handle was
    /// (a worker transfers one room at a time: its next handle to one of
    /// that room's destinations is that room's too).
    current: HashMap<(u32, u32), u64>,
    /// Processes seen sending a destination: decode ranks.
    decodes: HashSet<u32>,
    /// Handles created while no room could be told theirs (several live
    /// rooms await their decode rank, none by the page written: a chunk
    /// past the pages read of its room, a room of more than 4032 pages):
    /// followed as lifecycles of their own.
    pub unattributed: u64,
    /// Dummy destinations of rooms not live here ([`Dummies`]).
    dummies: Dummies,
    /// (pid, rid) -> the room its scheduler received with that rid, while
    /// the room is live: what an abort names.
    rids: HashMap<(u32, Rid), u64>,
    /// Rooms whose context changed since [`Rooms::held`] last handed it
    /// over (an ended room's: to be dropped).
    dirty: HashSet<(u32, u64)>,
    /// Rooms whose context did not fit what the next agent is handed
    /// ([`CONTEXT_BYTES`](stallwatch_common::CONTEXT_BYTES)): they would be taken over without it.
    pub too_large: u64,
    /// A transfer no page tells and no thread's room takes is the
    /// earliest bootstrapped live room's that awaits its peer and has no
    /// transfer yet (the backend's workers take rooms in order, one
    /// synchronous transfer at a time: Mooncake), not nobody's when
    /// several await that peer (NIXL, where a worker's transfers overlap).
    pub fifo: bool,
    /// The next [`Room::seq`].
    next_seq: u64,
    /// The latest rooms that ended before their transfers did (aborted or
    /// failed, never released: a released room's transfers were all done),
    /// oldest first, at most [`CUT_SHORT_KEPT`]. SGLang's worker checks a
    /// room's status only as it takes the room's next chunk
    /// (`transfer_worker`), so a chunk it took before the end still goes
    /// out after it: that transfer, told by the page it writes, is the
    /// ended room's (nobody's lifecycle), not a live room's nor one of its
    /// own.
    cut_short: VecDeque<CutShort>,
    /// Transfers created after their room was cut short.
    pub late: u64,
    /// The last room a message ended, with what the room forgets as it
    /// ends: for a backend whose worker sends a room's status itself, to
    /// learn which peers that thread wrote to and which shard it works.
    pub last_ended: Option<Ended>,
    /// (pid, sum of a room's destination ports) -> the thread that last
    /// transferred a room with that sum: SGLang puts every room of one sum
    /// on one worker, whatever the number of workers, so a room with no
    /// transfer yet will be that thread's.
    shard_threads: HashMap<(u32, u32), u32>,
    /// Whether a watched process's thread still runs: a room whose
    /// worker thread ended waits on nothing that will come (SGLang's
    /// Mooncake worker raises and ends on any error it did not expect).
    pub threads: ThreadCheck,
}

/// A room a message ended ([`Rooms::last_ended`]).
pub struct Ended {
    pub pid: u32,
    pub room: u64,
    /// Its destinations.
    pub agents: Vec<Box<str>>,
    /// The sum of its destination ports: its worker's shard.
    pub ports: u32,
}

impl Room {
    /// How many of its decode ranks answered, dummies too.
    fn answered(&self) -> usize {
        self.agents.len() + self.dummies as usize
    }

    /// Bootstrapped (every decode rank sent its destination: only a
    /// prefill receives them) with no transfer of its own yet: a transfer
    /// to one of its peers may be its first.
    fn awaits_first_transfer(&self) -> bool {
        self.transfers == 0 && !self.agents.is_empty() && self.answered() >= self.ranks as usize
    }
}

/// A room that ended before its transfers did ([`Rooms::cut_short`]):
/// what tells its late transfers.
struct CutShort {
    pid: u32,
    room: u64,
    agents: Vec<Box<str>>,
    pages: Vec<Runs>,
}

/// Whether thread `tid` of `pid` runs ([`Rooms::threads`]).
pub struct ThreadCheck(pub fn(u32, u32) -> bool);

impl ThreadCheck {
    /// Asked of procfs: a thread that ended has no `/proc/PID/task/TID`;
    /// a process that ended says nothing of its threads (its rooms end
    /// `process_exited`).
    pub const PROCFS: Self = Self(|pid, tid| {
        let process = format!("/proc/{pid}");
        !std::path::Path::new(&process).exists() || std::path::Path::new(&format!("{process}/task/{tid}")).exists()
    });
}

impl Default for ThreadCheck {
    /// [`ThreadCheck::PROCFS`]; in unit tests, whose pids and tids are
    /// made up, every thread runs (a test of an ended worker says so).
    fn default() -> Self {
        if cfg!(test) { Self(|_, _| true) } else { Self::PROCFS }
    }
}

/// A handle attributed to a room: the room, its ordinal among the room's
/// transfers (from 1), and its peer's index among the room's `agents`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Attributed {
    room: u64,
    ordinal: u32,
    agent: Option<u8>,
}

impl Rooms {
    /// The lifecycle event `bootstrap` stands for, if any: each room starts
    /// once (a destination per decode rank) and ends once (a status per
    /// decode rank, an ABORT racing the status).
    pub fn observe(&mut self, pid: u32, ts_ns: u64, bootstrap: &Bootstrap) -> Option<Observation> {
        let (room, stage) = match *bootstrap {
            Bootstrap::Destination { room, port, ref agent, ranks, ref pages } => {
                let known = self.live.contains_key(&(pid, room));
                self.dirty.insert((pid, room));
                let dummies = if known { 0 } else { self.dummies.take(pid, room) };
                let entry = self.live.entry((pid, room)).or_default();
                // A room its scheduler received moves on at its first
                // destination: what it waited on since arrived.
                let first_answer = entry.received && entry.agents.is_empty();
                entry.agents.push(agent.clone());
                entry.pages.push(Runs::of(pages));
                entry.ports += u32::from(port);
                entry.ranks = ranks;
                entry.dummies += dummies;
                if entry.answered() == ranks as usize {
                    entry.seq = self.next_seq;
                    self.next_seq += 1;
                }
                if known && !first_answer {
                    return None;
                }
                (room, Stage::Enqueued)
            }
            Bootstrap::Dummy { room, ranks } => {
                let Some(entry) = self.live.get_mut(&(pid, room)) else {
                    // Not followed here: remembered, so neither its request
                    // nor a later real destination starts it knowing nothing.
                    self.dummies.answer(pid, room, ranks);
                    return None;
                };
                self.dirty.insert((pid, room));
                entry.dummies += 1;
                entry.ranks = ranks;
                if entry.answered() < ranks as usize || !entry.agents.is_empty() {
                    if entry.answered() == ranks as usize {
                        entry.seq = self.next_seq;
                        self.next_seq += 1;
                    }
                    return None;
                }
                // Every destination a dummy: this rank writes nothing of it
                // and SGLang sends its decodes no status from here (its
                // scheduler had it: it ends, done with).
                tracing::debug!(pid, room, "an SGLang room is nothing of this rank: every destination is a dummy");
                (room, Stage::Released)
            }
            Bootstrap::Asked { room } => {
                self.decodes.insert(pid);
                self.dirty.insert((pid, room));
                let entry = self.live.entry((pid, room)).or_default();
                let moved = entry.received && entry.side == Side::Prefill;
                let new = !entry.received && entry.side == Side::Prefill;
                entry.side = Side::Decode;
                if !(new || moved) {
                    return None;
                }
                (room, Stage::Enqueued)
            }
            Bootstrap::Request { room, ref rid } => {
                // Its rid names it in an abort even when a destination came
                // first (the router tells the decode before the tokenizer
                // hands the request on, so either may arrive first).
                self.rids.insert((pid, rid.clone()), room);
                self.dirty.insert((pid, room));
                if let Some(live) = self.live.get_mut(&(pid, room)) {
                    live.rid = Some(rid.clone());
                    return None;
                }
                if self.dummies.all(pid, room) {
                    // Its every destination was a dummy, before it came.
                    self.rids.remove(&(pid, rid.clone()));
                    self.dirty.remove(&(pid, room));
                    return None;
                }
                let dummies = self.dummies.take(pid, room);
                self.live
                    .insert((pid, room), Room { received: true, rid: Some(rid.clone()), dummies, ..Room::default() });
                (room, Stage::Enqueued)
            }
            Bootstrap::AbortRequest { ref rid } => match self.rids.get(&(pid, rid.clone())) {
                Some(&room) => (room, Stage::Aborted),
                None => return None,
            },
            // A decode streams its requests' tokens as they come: no end.
            Bootstrap::Output { .. } if self.decodes.contains(&pid) => return None,
            Bootstrap::Output { ref rids } => {
                let unanswered = |rid: &Rid| {
                    let room = *self.rids.get(&(pid, rid.clone()))?;
                    let r = self.live.get(&(pid, room))?;
                    (r.answered() == 0 || r.answered() < r.ranks as usize).then_some(room)
                };
                let room = rids.iter().find_map(unanswered)?;
                // Why a room fails, in the debug log: a failure the target
                // never said is the one a false alert would be.
                let r = self.live.get(&(pid, room));
                tracing::debug!(
                    pid,
                    room,
                    answered = r.map_or(0, Room::answered),
                    ranks = r.map_or(0, |r| r.ranks),
                    "an SGLang room fails: its scheduler streamed its output before every decode rank answered"
                );
                (room, Stage::Failed)
            }
            Bootstrap::Abort { room } => (room, Stage::Aborted),
            Bootstrap::Status { room, status: SUCCESS } => (room, Stage::Released),
            Bootstrap::Status { room, status: FAILED } => {
                tracing::debug!(pid, room, "an SGLang room fails: its KV_STATUS Failed");
                (room, Stage::Failed)
            }
            // Bootstrapping .. Transferring: not an end.
            Bootstrap::Status { .. } => return None,
        };
        if stage.is_terminal() {
            // Its rid goes with it, even when it ended before (a failed
            // transfer ends a room with its rid kept until its output).
            self.rids.retain(|(p, _), r| !(*p == pid && *r == room));
            let ended = self.end(pid, room, stage)?;
            self.dirty.insert((pid, room));
            self.last_ended = Some(Ended { pid, room, agents: ended.agents, ports: ended.ports });
        }
        Some(room_observation(pid, room, stage, ts_ns))
    }

    /// Follow `room` again after an agent restart: the previous agent
    /// followed it and the kernel kept it (see
    /// [`crate::kernel::state::KernelState::track`]), and handed over what
    /// it knew of it, `held` ([`Rooms::held`]): its destinations, answers,
    /// rid, worker threads and transfer handles, so its alerts say what
    /// they said ([`Rooms::context`]), its handles are its own again (the
    /// kernel kept them too: [`Rooms::owns`] tells them, so they are not
    /// taken over as lifecycles of their own) and its status, an ABORT or
    /// its rid's abort or output end it as before. Returns its handles, for
    /// their peers. Without `held` (or with one that does not read, `Err`
    /// saying why) nothing of it is known: its alerts say nothing of what it
    /// waits on until a destination of it arrives again. A room followed
    /// already is left as it is.
    pub fn adopt(&mut self, pid: u32, room: u64, held: Option<&[u8]>) -> Result<Vec<AdoptedHandle>, String> {
        if self.live.contains_key(&(pid, room)) {
            return Ok(Vec::new());
        }
        let Some(held) = held else {
            self.live.insert((pid, room), Room::default());
            return Ok(Vec::new());
        };
        let Held { room: mut this, handles, threads, .. } = match decode(held).and_then(|held| match held.ended {
            true => Err("the room ended".to_owned()),
            false => Ok(held),
        }) {
            Ok(held) => held,
            Err(why) => {
                self.live.insert((pid, room), Room::default());
                return Err(why);
            }
        };
        if this.side == Side::Decode {
            self.decodes.insert(pid);
        }
        if let Some(rid) = &this.rid {
            self.rids.insert((pid, rid.clone()), room);
        }
        for tid in threads {
            self.current.insert((pid, tid), room);
        }
        let adopted = handles
            .iter()
            .map(|&(key, attributed)| {
                self.handles.insert((pid, key), Attributed { room, ..attributed });
                AdoptedHandle {
                    key,
                    peer: attributed.agent.and_then(|a| this.agents.get(usize::from(a)).cloned()),
                    posted: this.outstanding.iter().any(|&(h, _)| h == key),
                }
            })
            .collect();
        // Bootstrapped rooms taken over queue in the order they are
        // adopted (the kernel's table keeps no order among them).
        if !this.agents.is_empty() && this.answered() == this.ranks as usize {
            this.seq = self.next_seq;
            self.next_seq += 1;
        }
        self.live.insert((pid, room), this);
        Ok(adopted)
    }

    /// What is left of `room`, which ended while the previous agent
    /// followed it: its handles still in flight (`held`, as [`Rooms::held`]
    /// hands them over), nobody's lifecycles, as they were (a transfer of
    /// it whose done no probe saw is not taken over as a request of its
    /// own). `false`: `held` is no such thing (it is stale).
    pub fn adopt_ended(&mut self, pid: u32, room: u64, held: &[u8]) -> bool {
        match decode(held) {
            Ok(Held { ended: true, handles, .. }) if !self.live.contains_key(&(pid, room)) => {
                for (key, attributed) in handles {
                    self.handles.insert((pid, key), Attributed { room, ..attributed });
                }
                true
            }
            _ => false,
        }
    }

    /// Whether (`pid`, `key`) is a handle attributed to a room, live or
    /// ended: its events are the room's, or nobody's, never a lifecycle of
    /// its own.
    pub fn owns(&self, pid: u32, key: u64) -> bool {
        self.handles.contains_key(&(pid, key))
    }

    /// What changed since the last call, for the next agent: each room
    /// whose context changed, with its context ([`encode`]d); for a room
    /// that ended, its handles still in flight ([`encode_ended`]), or
    /// `None` once none is (or for a context that does not fit, counted in
    /// [`Rooms::too_large`]: it is taken over knowing nothing, as before
    /// this was handed over). At most one per room a call, however often
    /// it changed.
    pub fn held(&mut self, out: &mut Vec<HandOver>) {
        for (pid, room) in std::mem::take(&mut self.dirty) {
            let mut handles: Vec<(u64, Attributed)> = self
                .handles
                .iter()
                .filter(|((p, _), h)| *p == pid && h.room == room)
                .map(|(&(_, key), &h)| (key, h))
                .collect();
            handles.sort_unstable_by_key(|(_, h)| h.ordinal);
            let Some(this) = self.live.get(&(pid, room)) else {
                let context = (!handles.is_empty()).then(|| encode_ended(&handles)).flatten();
                out.push(HandOver { pid, key: room, context });
                continue;
            };
            let context = {
                let mut threads: Vec<u32> =
                    self.current.iter().filter(|((p, _), r)| *p == pid && **r == room).map(|(&(_, t), _)| t).collect();
                threads.sort_unstable();
                let encoded = encode(this, &handles, &threads);
                if encoded.is_none() {
                    self.too_large += 1;
                }
                encoded
            };
            out.push(HandOver { pid, key: room, context });
        }
    }

    /// Which side of its rooms' transfers `pid` serves: a decode once it
    /// sent a destination.
    pub fn side(&self, pid: u32) -> Side {
        if self.decodes.contains(&pid) { Side::Decode } else { Side::Prefill }
    }

    /// Thread `tid` is creating a transfer to the NIXL agent `agent`,
    /// writing first to its KV page `page` where that is known (a prepped
    /// transfer's first remote index: SGLang's remote indices begin with
    /// the chunk's destination pages).
    pub fn creating(&mut self, pid: u32, tid: u32, agent: &[u8], page: Option<u32>) {
        self.creating.insert((pid, tid), (String::from_utf8_lossy(agent).into(), page));
    }

    /// What thread `tid` of `pid` is creating, as its signal named it: the
    /// remote agent, and whether it is a KV chunk (`makeXferReq`, whose
    /// first remote page was read) rather than an aux transfer.
    pub fn creating_of(&self, pid: u32, tid: u32) -> Option<(&str, bool)> {
        self.creating.get(&(pid, tid)).map(|(agent, page)| (&**agent, page.is_some()))
    }

    /// The room handle `key` of `pid` is attributed to, live or ended,
    /// until the handle is done.
    pub fn attributed_room(&self, pid: u32, key: u64) -> Option<u64> {
        self.handles.get(&(pid, key)).map(|attributed| attributed.room)
    }

    /// Whether `room` of `pid` is live (has not ended).
    pub fn is_live(&self, pid: u32, room: u64) -> bool {
        self.live.contains_key(&(pid, room))
    }

    /// A NIXL handle's lifecycle event, seen on thread `tid`: the room's
    /// event it is if the handle is a room's, none if it is the handle of a
    /// room that ended, else the handle's own. A handle is attributed when
    /// it is created (`enqueued`), to the one live room whose destinations
    /// include the agent its thread named; its `transfer_posted` and
    /// `transfer_done` are the room's life at `transfer_posted` (a room's
    /// transfers follow one another, so it is mid-transfer until its
    /// status is sent), its `failed` fails the room, its other ends only
    /// end the attribution.
    pub fn handle(&mut self, tid: u32, observation: Observation) -> Option<Observation> {
        let Observation { pid, key, stage, ts_ns, ends, .. } = observation;
        if stage == Stage::Enqueued {
            let creating = self.creating.remove(&(pid, tid));
            let Some((agent, page)) = creating.as_ref() else { return Some(observation) };
            let awaits = |room: &u64| self.live.get(&(pid, *room)).is_some_and(|r| r.agents.contains(agent));
            // The one live room with that page at that decode rank; else the
            // latest room cut short that had it (a late chunk: its page is
            // the only sign, as its thread may be on to another room); else
            // the thread's room (its next transfer after a chunk is that
            // room's aux); else the one room awaiting that rank.
            let by_page = page.and_then(|page| {
                only(self.live.iter().filter_map(|(&(p, room), r)| {
                    (p == pid && writes(&r.agents, &r.pages, agent, page)).then_some(room)
                }))
                .or_else(|| {
                    let mut cut_short = self.cut_short.iter().rev();
                    cut_short.find(|c| c.pid == pid && writes(&c.agents, &c.pages, agent, page)).map(|c| c.room)
                })
            });
            let earliest = || self.fresh(pid, agent).min_by_key(|(_, r)| r.seq).map(|(room, _)| room);
            let thread = || self.current.get(&(pid, tid)).copied().filter(|room| awaits(room));
            let owner = by_page.or_else(thread).or_else(|| {
                if self.fifo {
                    earliest()
                } else {
                    only(self.live.keys().filter(|(p, room)| *p == pid && awaits(room)).map(|(_, room)| *room))
                }
            });
            let Some(room) = owner else {
                self.unattributed += 1;
                return Some(observation);
            };
            if !self.live.contains_key(&(pid, room)) {
                self.late += 1;
            }
            let (ordinal, agent) = self.live.get_mut(&(pid, room)).map_or((0, None), |r| {
                r.transfers += 1;
                (r.transfers, r.agents.iter().position(|a| a == agent).and_then(|a| u8::try_from(a).ok()))
            });
            self.handles.insert((pid, key), Attributed { room, ordinal, agent });
            self.dirty.insert((pid, room));
            if let Some(r) = self.live.get(&(pid, room)) {
                self.shard_threads.insert((pid, r.ports), tid);
            }
            if let Some(previous) = self.current.insert((pid, tid), room).filter(|&previous| previous != room) {
                self.dirty.insert((pid, previous));
            }
            return None;
        }
        let Some(&Attributed { room, ordinal, .. }) = self.handles.get(&(pid, key)) else {
            return Some(observation);
        };
        self.dirty.insert((pid, room));
        if stage.is_terminal() || ends.is_some() {
            self.handles.remove(&(pid, key));
        }
        if let Some(r) = self.live.get_mut(&(pid, room)) {
            r.outstanding.retain(|&(h, _)| h != key);
            if stage == Stage::TransferPosted {
                r.outstanding.push((key, ordinal));
            }
        }
        let live = match stage {
            Stage::TransferPosted | Stage::TransferDone => self.live.contains_key(&(pid, room)),
            Stage::Failed => {
                tracing::debug!(
                    pid,
                    room,
                    handle = format_args!("{key:#x}"),
                    "an SGLang room fails: a transfer of it failed"
                );
                self.end(pid, room, Stage::Failed).is_some()
            }
            _ => false,
        };
        let stage = if stage == Stage::Failed { Stage::Failed } else { Stage::TransferPosted };
        live.then(|| room_observation(pid, room, stage, ts_ns))
    }

    /// `room` of `pid` ended at `stage`: no longer live, and remembered
    /// among the rooms [cut short](Rooms::cut_short) unless released.
    fn end(&mut self, pid: u32, room: u64, stage: Stage) -> Option<Room> {
        let ended = self.live.remove(&(pid, room))?;
        if stage != Stage::Released {
            if self.cut_short.len() == CUT_SHORT_KEPT {
                self.cut_short.pop_front();
            }
            let (agents, pages) = (ended.agents.clone(), ended.pages.clone());
            self.cut_short.push_back(CutShort { pid, room, agents, pages });
        }
        Some(ended)
    }

    /// The live rooms of `pid` bootstrapped, awaiting `agent`, with no
    /// transfer yet: those a transfer to `agent` may be the first of.
    fn fresh<'a>(&'a self, pid: u32, agent: &'a str) -> impl Iterator<Item = (u64, &'a Room)> + 'a {
        self.live
            .iter()
            .filter(move |&(&(p, _), r)| {
                p == pid && r.awaits_first_transfer() && r.agents.iter().any(|a| &**a == agent)
            })
            .map(|(&(_, room), r)| (room, r))
    }

    /// The first KV page at `agent` of the one room a transfer to `agent`
    /// can only be the first transfer of: none while a room of `pid`
    /// awaiting `agent` has had a transfer (this may be its next chunk,
    /// whichever thread it is on: a worker interleaves rooms), or when no
    /// room or several are fresh for it.
    pub fn sole_first_page(&self, pid: u32, agent: &str) -> Option<u32> {
        let awaits = |r: &Room| r.agents.iter().any(|a| &**a == agent);
        if self.live.iter().any(|(&(p, _), r)| p == pid && r.transfers > 0 && awaits(r)) {
            return None;
        }
        let (_, r) = only(self.fresh(pid, agent))?;
        let at = r.agents.iter().position(|a| &**a == agent)?;
        r.pages.get(at)?.first()
    }

    /// Thread `tid` worked a room of the shard `ports` (sent its status,
    /// for a backend whose worker does): the shard's worker, as if it had
    /// been seen transferring one of its rooms. A shard's first room may
    /// have had no transfer told its own (its peer's segment not known).
    pub fn worked_by(&mut self, pid: u32, ports: u32, tid: u32) {
        self.shard_threads.insert((pid, ports), tid);
    }

    /// The peers a transfer on thread `tid` to a peer not known by name
    /// may be writing to (for a backend that names peers by ids learnt at
    /// a call this agent may have missed): the destinations of the thread's
    /// room while it is live, else those of every live bootstrapped room
    /// of the process that has no transfer yet (the thread is starting one
    /// of them).
    pub fn guess(&self, pid: u32, tid: u32) -> Vec<Box<str>> {
        if let Some(r) = self.current.get(&(pid, tid)).and_then(|&room| self.live.get(&(pid, room))) {
            return r.agents.clone();
        }
        let mut peers: Vec<Box<str>> = self
            .live
            .iter()
            .filter(|&(&(p, _), r)| p == pid && r.awaits_first_transfer())
            .flat_map(|(_, r)| r.agents.iter().cloned())
            .collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// What an alert of `room` says besides its lifecycle. A room with a
    /// transfer posted and not done names its oldest: `handle`, and
    /// `transfer`, its ordinal among the room's transfers (the chunk that
    /// stopped: per chunk one per decode rank, the aux last). A room with
    /// no transfer yet says how many of its decode ranks sent their
    /// destination, `answered` ("1/2"), and what it waits on, `waiting_on`:
    /// `peer` while one has not; `worker` when another room of its worker
    /// (by `sum(destination ports) % 4`) has a transfer posted and not done
    /// (the worker is stuck on that room, named `behind`, so this one waits
    /// in its queue, not for its peer); else `prefill` (bootstrapped: its
    /// forward pass or its worker's queue); `worker` with `worker=exited`
    /// and its `worker_tid` when the thread its shard's rooms ran on has
    /// ended. A room between its transfers
    /// (some done, none outstanding) says `behind` and `waiting_on` alone:
    /// its next chunk waits on the same worker or forward pass.
    pub fn context(&self, pid: u32, room: u64) -> Vec<(&'static str, String)> {
        let Some(this) = self.live.get(&(pid, room)) else { return Vec::new() };
        let decode = ("side", Side::Decode.as_str().to_owned());
        if this.side == Side::Decode {
            return vec![decode, ("waiting_on", "prefill".to_owned())];
        }
        if this.received && self.decodes.contains(&pid) {
            // A decode's scheduler has it; the decode has not asked for its
            // KV yet (its own memory, or the prefill's bootstrap info).
            return vec![decode, ("asked", "no".to_owned())];
        }
        if let Some((handle, ordinal)) = this.outstanding.first() {
            return vec![("handle", format!("{handle:#x}")), ("transfer", ordinal.to_string())];
        }
        if this.received && this.agents.is_empty() {
            // Its scheduler has it; no decode rank has answered.
            return vec![("answered", "0".to_owned()), ("waiting_on", "peer".to_owned())];
        }
        // Adopted after a restart with nothing known.
        if this.agents.is_empty() {
            return Vec::new();
        }
        // Between its transfers (none outstanding), a room waits as one not
        // started whose ranks all answered: on its worker or its prefill.
        let mut fields = Vec::new();
        if this.transfers == 0 {
            let answered = this.answered();
            fields.push(("answered", format!("{answered}/{}", this.ranks)));
            if answered < this.ranks as usize {
                fields.push(("waiting_on", "peer".to_owned()));
                return fields;
            }
        }
        // Its worker: by SGLang's formula with its default worker count,
        // or the thread its shard's rooms ran on (any worker count).
        let thread = self.shard_threads.get(&(pid, this.ports));
        if let Some(&tid) = thread.filter(|&&tid| !(self.threads.0)(pid, tid)) {
            fields.extend([
                ("waiting_on", "worker".to_owned()),
                ("worker", "exited".to_owned()),
                ("worker_tid", tid.to_string()),
            ]);
            return fields;
        }
        let on_its_worker = |other: &u64, r: &Room| {
            r.ports % WORKERS == this.ports % WORKERS
                || thread.is_some_and(|&tid| self.current.get(&(pid, tid)) == Some(other))
        };
        let blocking = self.live.iter().filter(|((p, other), r)| {
            *p == pid && *other != room && !r.outstanding.is_empty() && on_its_worker(other, r)
        });
        match blocking.map(|((_, other), _)| *other).min() {
            Some(other) => fields.extend([("behind", other.to_string()), ("waiting_on", "worker".to_owned())]),
            None => fields.push(("waiting_on", "prefill".to_owned())),
        }
        fields
    }

    /// What the target's memory says of the silent room `silent` (`None`:
    /// it is no live room), read from its transfers' handles, since a room
    /// has no memory of its own to read: the oldest posted and not seen
    /// done first (`read` reads one handle as the profile's `[status]`
    /// does). A handle read done is no longer outstanding, and the next is
    /// read; one failed fails the room (it is no longer live here either:
    /// a dead decode's status may never be sent); one in progress, or
    /// unreadable, leaves the room as the probes saw it (`transfer_hung`
    /// on that handle). A room whose posted transfers are all done, its
    /// status never sent, reads `transfer_done` (never complete: a room is
    /// complete at its status). A room with no transfer posted reads
    /// nothing.
    pub fn read(&mut self, silent: &Silent, read: &mut dyn FnMut(&Silent) -> Option<StageRead>) -> Claim<StageRead> {
        let Some(room) = self.live.get_mut(&(silent.pid, silent.key)) else { return Claim::NotMine };
        if room.outstanding.is_empty() {
            return Claim::NOTHING;
        }
        self.dirty.insert((silent.pid, silent.key));
        while let Some(&(handle, _)) = room.outstanding.first() {
            match read(&Silent { key: handle, stage: Stage::TransferPosted, ..*silent }) {
                Some(StageRead { stage: Stage::TransferDone, .. }) => {
                    room.outstanding.remove(0);
                }
                Some(StageRead { stage: Stage::Failed, .. }) => {
                    tracing::debug!(
                        pid = silent.pid,
                        room = silent.key,
                        handle = format_args!("{handle:#x}"),
                        "an SGLang room fails: its silent transfer's status read an error"
                    );
                    self.end(silent.pid, silent.key, Stage::Failed);
                    return Claim::Mine(Some(StageRead { stage: Stage::Failed, ends: false }));
                }
                _ => return Claim::NOTHING,
            }
        }
        Claim::Mine(Some(StageRead { stage: Stage::TransferDone, ends: false }))
    }

    /// The room's oldest transfer posted and not done, the one its stall
    /// is on (what [`Rooms::context`] names as `handle`).
    pub fn hung_handle(&self, pid: u32, room: u64) -> Option<u64> {
        self.live.get(&(pid, room))?.outstanding.first().map(|&(handle, _)| handle)
    }

    /// The process is gone (its rooms end `process_exited` in the engine).
    pub fn forget(&mut self, pid: u32) {
        self.live.retain(|(p, _), _| *p != pid);
        self.creating.retain(|(p, _), _| *p != pid);
        self.handles.retain(|(p, _), _| *p != pid);
        self.current.retain(|(p, _), _| *p != pid);
        self.shard_threads.retain(|(p, _), _| *p != pid);
        self.decodes.remove(&pid);
        self.rids.retain(|(p, _), _| *p != pid);
        self.cut_short.retain(|c| c.pid != pid);
        self.dummies.forget(pid);
        // The kernel's tables drop all of the process's.
        self.dirty.retain(|(p, _)| *p != pid);
    }
}

/// Whether a room with destinations `agents` and their `pages` (as far as
/// read) has `page` at `agent`: a chunk writing it is that room's.
fn writes(agents: &[Box<str>], pages: &[Runs], agent: &str, page: u32) -> bool {
    agents.iter().zip(pages).any(|(a, pages)| &**a == agent && pages.contains(page))
}

/// The one item of `items`, if there is exactly one.
fn only<T>(mut items: impl Iterator<Item = T>) -> Option<T> {
    match (items.next(), items.next()) {
        (Some(item), None) => Some(item),
        _ => None,
    }
}

/// An event of `room`: keyed by the room, its external id the room in
/// decimal.
fn room_observation(pid: u32, room: u64, stage: Stage, ts_ns: u64) -> Observation {
    Observation { pid, key: room, stage, ts_ns, external_id: Some(room.to_string().into()), ends: None }
}

/// Whether a request is an SGLang room: keyed by its room, its external id
/// the room in decimal (as [`Rooms`] and the `marker` profile make them).
pub fn room_of(key: u64, external_id: Option<&str>) -> Option<u64> {
    external_id.and_then(|id| id.parse::<u64>().ok()).filter(|&room| room == key)
}
