//! The in-flight protocol, modelled: what the eBPF programs do with the
//! tables and the ring buffer, written out plainly, under the real
//! [`KernelState`] and engine of agents killed and restarted at random.
use std::{cell::RefCell, collections::BTreeMap, collections::HashMap, collections::VecDeque, rc::Rc};

use anyhow::{Result, bail};
use stallwatch_common::{EXT_ID_LEN, HeldContext, InflightEntry, NOT_EMITTED, RequestKey, stage};

use super::{KernelState, Tables};
use crate::{
    kernel::decode,
    lifecycle::{Engine, EngineConfig, Observation, Outcome, Report, Stage, StageRead},
};

/// What the eBPF programs do with the three tables and the ring buffer
/// (`emit` and `track` in ebpf/src/main.rs), written out plainly. It
/// outlives every agent, as the pinned maps do.
#[derive(Default)]
struct Kernel {
    inflight: BTreeMap<(u32, u64), InflightEntry>,
    alerted: BTreeMap<(u32, u64), u64>,
    context: BTreeMap<(u32, u64), HeldContext>,
    ring: VecDeque<Observation>,
    capacity: usize,
}

impl Kernel {
    /// `ends`: the event's slot ends lifecycles at its stage (`ENDS`).
    fn event(&mut self, pid: u32, key: u64, stage: u8, ends: bool, ts: u64) {
        let id = (pid, key);
        self.ring.push_back(Observation {
            pid,
            key,
            stage: decode::stage(stage).expect("stage"),
            ts_ns: ts,
            external_id: None,
            ends: ends.then_some(Outcome::Completed),
        });
        if ends || stage >= stage::FIRST_TERMINAL {
            if self.alerted.contains_key(&id) {
                if let Some(entry) = self.inflight.get_mut(&id) {
                    entry.stage = stage;
                    entry.ended = 1;
                    entry.last_ns = entry.last_ns.max(ts);
                }
            } else {
                self.inflight.remove(&id);
            }
            return;
        }
        if let Some(entry) = self.inflight.get_mut(&id) {
            if entry.ended == 0 {
                entry.last_ns = entry.last_ns.max(ts);
                entry.stage = entry.stage.max(stage);
                if entry.stage_ns[usize::from(stage)] == 0 {
                    entry.stage_ns[usize::from(stage)] = ts;
                }
                return;
            }
        } else if self.inflight.len() >= self.capacity {
            return;
        }
        let mut entry = InflightEntry {
            first_ns: ts,
            last_ns: ts,
            stage_ns: [0; stage::LIVE],
            last_ret: 0,
            last_slot: NOT_EMITTED,
            stage,
            has_ext: 0,
            ended: 0,
            withheld: 0,
            ext: [0; EXT_ID_LEN],
        };
        entry.stage_ns[usize::from(stage)] = ts;
        self.inflight.insert(id, entry);
    }
}

#[derive(Clone, Default)]
struct Shared(Rc<RefCell<Kernel>>);

/// A seeded xorshift die, `roll(n)` in `0..n`: the model tests replay
/// any failing seed exactly, without a crate for randomness.
fn dice(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move |n| {
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        rng.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

fn id(key: &RequestKey) -> (u32, u64) {
    (key.pid, key.key)
}

fn key_of((pid, key): (u32, u64)) -> RequestKey {
    RequestKey { key, pid, _pad: 0 }
}

impl Tables for Shared {
    fn inflight_keys(&self) -> Result<Vec<RequestKey>> {
        Ok(self.0.borrow().inflight.keys().copied().map(key_of).collect())
    }
    fn inflight(&self, key: &RequestKey) -> Result<Option<InflightEntry>> {
        Ok(self.0.borrow().inflight.get(&id(key)).copied())
    }
    fn forget_inflight(&mut self, key: &RequestKey) -> Result<()> {
        self.0.borrow_mut().inflight.remove(&id(key));
        Ok(())
    }
    fn put_inflight(&mut self, key: &RequestKey, entry: &InflightEntry) -> Result<()> {
        let mut kernel = self.0.borrow_mut();
        if !kernel.inflight.contains_key(&id(key)) && kernel.inflight.len() >= kernel.capacity {
            bail!("the table is full");
        }
        kernel.inflight.insert(id(key), *entry);
        Ok(())
    }
    fn alerted_keys(&self) -> Result<Vec<RequestKey>> {
        Ok(self.0.borrow().alerted.keys().copied().map(key_of).collect())
    }
    fn alerted(&self, key: &RequestKey) -> Result<Option<u64>> {
        Ok(self.0.borrow().alerted.get(&id(key)).copied())
    }
    fn mark(&mut self, key: &RequestKey, last_ns: u64) -> Result<()> {
        self.0.borrow_mut().alerted.insert(id(key), last_ns);
        Ok(())
    }
    fn forget_alerted(&mut self, key: &RequestKey) -> Result<()> {
        self.0.borrow_mut().alerted.remove(&id(key));
        Ok(())
    }
    fn context_keys(&self) -> Result<Vec<RequestKey>> {
        Ok(self.0.borrow().context.keys().copied().map(key_of).collect())
    }
    fn context(&self, key: &RequestKey) -> Result<Option<HeldContext>> {
        Ok(self.0.borrow().context.get(&id(key)).copied())
    }
    fn put_context(&mut self, key: &RequestKey, context: &HeldContext) -> Result<()> {
        let mut kernel = self.0.borrow_mut();
        if !kernel.context.contains_key(&id(key)) && kernel.context.len() >= kernel.capacity {
            bail!("the table is full");
        }
        kernel.context.insert(id(key), *context);
        Ok(())
    }
    fn forget_context(&mut self, key: &RequestKey) -> Result<()> {
        self.0.borrow_mut().context.remove(&id(key));
        Ok(())
    }
}

/// One agent: the real engine and the real [`KernelState`] on the model
/// kernel, doing what `run` does (restore at start, then read the ring
/// buffer, tick, and apply every report after it is out).
struct ModelAgent {
    engine: Engine,
    state: KernelState<Shared>,
}

/// Every report any agent made, to find one made twice.
#[derive(Default)]
struct Reported {
    /// (pid, key, first_ns) of each lifecycle ended.
    ended: HashMap<(u32, u64, u64), usize>,
    /// (pid, key, last_ns) of each silence reported.
    stalled: HashMap<(u32, u64, u64), usize>,
    /// Lifecycles ended by a read of the target's memory: failed, and
    /// complete at a done read.
    read_failed: usize,
    read_done: usize,
}

impl ModelAgent {
    fn start(kernel: &Shared, reported: &mut Reported) -> Self {
        let mut agent = Self {
            engine: Engine::new(EngineConfig { timeout_ns: 50, max_tracked: 1 << 20, tick_ns: 1 }),
            state: KernelState::new(kernel.clone()),
        };
        let mut reports = Vec::new();
        for request in agent.state.snapshot().expect("snapshot") {
            agent.engine.restore(request, &mut reports);
        }
        // What the ring buffer gathered is read before any report of
        // the take-over is applied, as `run` does: a lifecycle that
        // ended while no agent ran is collected from the table only
        // once its events are read, never left for the next agent to
        // read as a new one.
        agent.read_into(kernel, &mut reports);
        agent.emit(reports, reported);
        agent
    }

    fn emit(&mut self, reports: Vec<Report>, reported: &mut Reported) {
        for report in reports {
            let r = report.request();
            match &report {
                Report::Ended { .. } => {
                    *reported.ended.entry((r.pid, r.key, r.first_ns)).or_default() += 1;
                    reported.read_failed += usize::from(r.inferred.contains(Stage::Failed));
                    reported.read_done += usize::from(r.inferred.contains(Stage::TransferDone));
                }
                Report::Stalled { .. } => *reported.stalled.entry((r.pid, r.key, r.last_ns)).or_default() += 1,
                Report::Recovered { .. } => {}
            }
            self.state.apply(&report).expect("apply");
        }
    }

    fn read(&mut self, kernel: &Shared, reported: &mut Reported) {
        let mut reports = Vec::new();
        self.read_into(kernel, &mut reports);
        self.emit(reports, reported);
    }

    fn read_into(&mut self, kernel: &Shared, reports: &mut Vec<Report>) {
        while let Some(observation) = kernel.0.borrow_mut().ring.pop_front() {
            self.engine.observe(observation, reports);
        }
    }

    /// A tick, reading the target's memory as `run` does, only for a
    /// request the kernel still holds: key 0x105's memory says its
    /// transfer failed once posted, and the target never releases it;
    /// key 0x104's says done, which completes it (its profile completes
    /// at transfer_done, see [`lazy`]). One read a tick, so requests due
    /// but not read yet (carried over, as at a mass stall) are often
    /// what a killed agent leaves behind.
    fn advance(&mut self, now: u64, reported: &mut Reported) {
        let mut reports = Vec::new();
        let state = &self.state;
        self.engine.advance_reading(
            now,
            1,
            &mut |silents, answers| {
                answers.extend(silents.iter().map(|silent| {
                    let stage = match silent.key {
                        0x105 => Stage::Failed,
                        0x104 => Stage::TransferDone,
                        _ => return None,
                    };
                    let read = silent.stage == Stage::TransferPosted;
                    (read && state.is_live(silent.pid, silent.key, silent.last_ns).expect("is_live"))
                        .then_some(StageRead { stage, ends: lazy(silent.key) && stage == Stage::TransferDone })
                }));
            },
            &mut reports,
        );
        self.emit(reports, reported);
    }
}

/// The lifecycles the agent makes itself (an SGLang room's) are tracked
/// in `INFLIGHT` as the kernel tracks the probes': the same random
/// events, some keys marked alerted, leave the same table written by
/// [`KernelState::track`] as by the model of the eBPF programs; and a
/// full table is counted, not fatal.
#[test]
fn a_lifecycle_the_agent_makes_is_tracked_as_the_kernel_tracks_its_own() {
    use stallwatch_common::stage::{FIRST_TERMINAL, LIVE};
    let mut kept_ended = 0;
    for seed in 1..=20u64 {
        let mut roll = dice(seed);
        let (kernel, tracked) = (Shared::default(), Shared::default());
        let capacity = if seed % 5 == 0 { 2 } else { 1 << 17 };
        kernel.0.borrow_mut().capacity = capacity;
        tracked.0.borrow_mut().capacity = capacity;
        let mut state = KernelState::new(tracked.clone());
        let mut full = 0;
        for step in 0..400u64 {
            let (pid, key) = (1 + roll(2) as u32, 1_000 + roll(4));
            if roll(10) == 0 {
                for table in [&kernel, &tracked] {
                    table.0.borrow_mut().alerted.insert((pid, key), step);
                }
            }
            let stage = if roll(5) == 0 { FIRST_TERMINAL + roll(3) as u8 } else { roll(LIVE as u64) as u8 };
            let ends = stage < FIRST_TERMINAL && roll(8) == 0;
            let ts = 10 * step + roll(15);
            let before = tracked.0.borrow().inflight.len();
            kernel.0.borrow_mut().event(pid, key, stage, ends, ts);
            let observation = Observation {
                pid,
                key,
                stage: decode::stage(stage).expect("stage"),
                ts_ns: ts,
                external_id: Some(key.to_string().into()),
                ends: ends.then_some(Outcome::Completed),
            };
            let untracked = state.untracked();
            state.track(&observation);
            if state.untracked() > untracked {
                assert_eq!(before, capacity, "seed {seed} step {step}: only a full table refuses");
                full += 1;
            }
            kept_ended += tracked.0.borrow().inflight.values().filter(|entry| entry.ended == 1).count();
        }
        // The model keeps no external id: compare the rest, and the id
        // where the agent kept one.
        let ours = tracked.0.borrow().inflight.clone();
        for ((pid, key), entry) in &ours {
            assert_eq!(entry.has_ext, 1);
            assert_eq!(decode::external_id_of(&entry.ext, true).as_deref(), Some(key.to_string().as_str()), "{pid}");
        }
        let normalized: BTreeMap<_, _> = ours
            .into_iter()
            .map(|(id, entry)| (id, InflightEntry { has_ext: 0, ext: [0; EXT_ID_LEN], ..entry }))
            .collect();
        assert_eq!(normalized, kernel.0.borrow().inflight, "seed {seed}");
        assert_eq!(full > 0, capacity == 2, "seed {seed}");
    }
    assert!(kept_ended > 0, "some ended entries were kept for their alert");
}

/// What the agent pins of the requests it made (`CONTEXT`) is what the
/// next agent reads, byte for byte; `None` drops it; a
/// context too large or a full table is counted and leaves nothing
/// stale; an exited process's go with its entries.
#[test]
fn contexts_pinned_are_read_back_and_what_cannot_be_pinned_is_counted() {
    use stallwatch_common::CONTEXT_BYTES;
    let kernel = Shared::default();
    kernel.0.borrow_mut().capacity = 3;
    let mut state = KernelState::new(kernel.clone());
    state.pin_context(4, 1, Some(b"room one"));
    state.pin_context(4, 2, Some(&[7; CONTEXT_BYTES]));
    state.pin_context(5, 1, Some(b""));
    let read = |state: &KernelState<Shared>| {
        let mut contexts: Vec<_> = state.pinned_contexts().expect("contexts").into_iter().collect();
        contexts.sort();
        contexts
    };
    let full = vec![7; CONTEXT_BYTES];
    assert_eq!(read(&state), [((4, 1), b"room one".to_vec()), ((4, 2), full.clone()), ((5, 1), Vec::new())]);
    // Rewritten in place, then dropped.
    state.pin_context(4, 1, Some(b"answered"));
    state.pin_context(5, 1, None);
    state.pin_context(5, 9, None);
    assert_eq!(read(&state), [((4, 1), b"answered".to_vec()), ((4, 2), full)]);
    assert_eq!(state.unpinned.count, 0);
    // Too large: counted, and what was there (no longer true) is gone.
    state.pin_context(4, 2, Some(&[1; CONTEXT_BYTES + 1]));
    assert_eq!((state.unpinned.count, read(&state).len()), (1, 1));
    assert!(
        state.unpinned.latest.as_deref().is_some_and(|why| why.contains("more than the 1016")),
        "{:?}",
        state.unpinned.latest
    );
    // A full table refuses a new request's.
    for key in 10..13 {
        state.pin_context(6, key, Some(b"x"));
    }
    assert_eq!((state.unpinned.count, read(&state).len()), (2, 3));
    state.forget_process(6).expect("forget");
    assert_eq!(read(&state), [((4, 1), b"answered".to_vec())]);
}

/// Keys whose probes end their lifecycles at transfer_done (a profile
/// with `complete_at = "transfer_done"`), released only some time
/// later if ever, as SGLang's handles are.
fn lazy(key: u64) -> bool {
    key >= 0x103
}

/// Random lifecycles of a few keys (reused at once, as NIXL does),
/// random agent ticks and reads, agents SIGKILLed between any two steps
/// and started again, the ring buffer keeping what no agent read: no
/// lifecycle ends twice, no silence is reported twice, and once a
/// running agent has read everything the kernel keeps no ended entry.
#[test]
fn no_request_ends_twice_across_any_number_of_restarts() {
    use stallwatch_common::stage::{ABORTED, ENQUEUED, FAILED, RELEASED, TRANSFER_DONE};
    let mut totals = (0usize, 0usize, 0usize, 0usize, 0usize);
    for seed in 1..=40u64 {
        let mut roll = dice(seed);
        let kernel = Shared::default();
        kernel.0.borrow_mut().capacity = if seed % 4 == 0 { 3 } else { 1 << 17 };
        let mut reported = Reported::default();
        let mut agent = Some(ModelAgent::start(&kernel, &mut reported));
        let mut live: HashMap<(u32, u64), u8> = HashMap::new();
        let mut now = 1_000u64;
        let mut restarts = 0;
        for step in 0..3000 {
            now += 1 + roll(8);
            match roll(100) {
                0..55 => {
                    let id = (1 + roll(2) as u32, 0x100 + roll(6));
                    let stage = match live.get(&id) {
                        // The late release of a lifecycle complete at transfer_done.
                        None if lazy(id.1) && roll(3) == 0 => RELEASED,
                        None => ENQUEUED,
                        Some(&at) => match roll(10) {
                            0..6 => (at + roll(2) as u8).min(TRANSFER_DONE),
                            6..8 => RELEASED,
                            8 => ABORTED,
                            _ => FAILED,
                        },
                    };
                    let ends = lazy(id.1) && stage == TRANSFER_DONE;
                    if stage >= RELEASED || ends {
                        live.remove(&id);
                    } else {
                        live.insert(id, stage);
                    }
                    kernel.0.borrow_mut().event(id.0, id.1, stage, ends, now);
                }
                55..75 => {
                    if let Some(agent) = &mut agent {
                        agent.read(&kernel, &mut reported);
                    }
                }
                75..93 => {
                    if let Some(agent) = &mut agent {
                        agent.advance(now, &mut reported);
                    }
                }
                _ => {
                    agent = match agent {
                        Some(_) => None,
                        None => {
                            restarts += 1;
                            Some(ModelAgent::start(&kernel, &mut reported))
                        }
                    };
                }
            }
            let ctx = format!("seed {seed} step {step}");
            let twice: Vec<_> = reported.ended.iter().filter(|(_, n)| **n > 1).collect();
            assert!(twice.is_empty(), "{ctx}: lifecycles ended twice: {twice:?}");
            let twice: Vec<_> = reported.stalled.iter().filter(|(_, n)| **n > 1).collect();
            assert!(twice.is_empty(), "{ctx}: silences reported twice: {twice:?}");
            if let Some(agent) = &mut agent {
                if kernel.0.borrow().ring.is_empty() {
                    let k = kernel.0.borrow();
                    let ended: Vec<_> = k.inflight.iter().filter(|(_, e)| e.ended != 0).collect();
                    assert!(ended.is_empty(), "{ctx}: ended entries the agent has seen end are kept: {ended:?}");
                    let orphans: Vec<_> =
                        k.alerted.keys().filter(|id| agent.engine.get(id.0, id.1).is_none()).collect();
                    assert!(orphans.is_empty(), "{ctx}: marks of requests no agent follows: {orphans:?}");
                }
            }
        }
        totals.0 += restarts;
        totals.1 += reported.stalled.len();
        totals.2 += reported.ended.len();
        totals.3 += reported.read_failed;
        totals.4 += reported.read_done;
    }
    // The walk really restarted agents with stalls marked, and ended
    // requests by reads.
    assert!(totals.0 > 500 && totals.1 > 500 && totals.2 > 5000 && totals.3 > 20 && totals.4 > 20, "{totals:?}");
}
