//! Tests of the lifecycle engine. Most assert the exact reports a sequence
//! produces; the randomized ones compare the engine with a naive model of
//! the rules (a scan over a `BTreeMap`) and check the invariants under a
//! tight memory cap.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::slab::Record;
use super::*;

const ENQ: Stage = Stage::Enqueued;
const POST: Stage = Stage::TransferPosted;
const DONE: Stage = Stage::TransferDone;
const REL: Stage = Stage::Released;
const ABORT: Stage = Stage::Aborted;
const FAIL: Stage = Stage::Failed;

const WFP: StallClass = StallClass::WaitingForPeer;
const HUNG: StallClass = StallClass::TransferHung;
const LOST: StallClass = StallClass::ReleaseLost;

/// Timeout 1000 ns, tick 10 ns: small numbers keep the expectations legible.
const TIMEOUT: u64 = 1000;
const TICK: u64 = 10;

struct H {
    e: Engine,
}

impl H {
    fn new() -> H {
        H::with(TIMEOUT, TICK, 1000)
    }

    fn with(timeout_ns: u64, tick_ns: u64, max_tracked: usize) -> H {
        H { e: Engine::new(EngineConfig { timeout_ns, max_tracked, tick_ns }) }
    }

    fn obs(&mut self, pid: u32, key: u64, stage: Stage, ts_ns: u64) -> Vec<Report> {
        self.obs_ext(pid, key, stage, ts_ns, None)
    }

    fn obs_ext(&mut self, pid: u32, key: u64, stage: Stage, ts_ns: u64, ext: Option<&str>) -> Vec<Report> {
        let mut out = Vec::new();
        self.e.observe(Observation { pid, key, stage, ts_ns, external_id: ext.map(Into::into), ends: None }, &mut out);
        out
    }

    fn adv(&mut self, now_ns: u64) -> Vec<Report> {
        let mut out = Vec::new();
        self.e.advance(now_ns, &mut out);
        out
    }

    fn exit(&mut self, pid: u32, now_ns: u64) -> Vec<Report> {
        let mut out = Vec::new();
        self.e.process_exited(pid, now_ns, &mut out);
        out
    }

    fn restore(&mut self, request: Restored) -> Vec<Report> {
        let mut out = Vec::new();
        self.e.restore(request, &mut out);
        out
    }

    fn get(&self, pid: u32, key: u64) -> Option<RequestSnapshot> {
        self.e.get(pid, key)
    }

    fn stats(&self) -> EngineStats {
        self.e.stats()
    }
}

/// A snapshot without external id.
fn snap(
    pid: u32,
    key: u64,
    stage: Stage,
    stage_ns: [Option<u64>; 4],
    first_ns: u64,
    last_ns: u64,
    stalled: Option<StallClass>,
) -> RequestSnapshot {
    RequestSnapshot {
        pid,
        key,
        external_id: None,
        stage,
        stage_ns,
        first_ns,
        last_ns,
        stalled,
        inferred: StageSet::EMPTY,
    }
}

fn stalled(request: RequestSnapshot, class: StallClass, silent_ns: u64, at_ns: u64) -> Report {
    Report::Stalled { request, class, silent_ns, at_ns }
}

fn recovered(request: RequestSnapshot, class: StallClass, stuck_ns: u64) -> Report {
    Report::Recovered { request, class, stuck_ns }
}

fn ended(request: RequestSnapshot, outcome: Outcome, at_ns: u64) -> Report {
    Report::Ended { request, outcome, at_ns }
}

fn by_key(mut reports: Vec<Report>) -> Vec<Report> {
    reports.sort_by_key(|r| (r.request().pid, r.request().key));
    reports
}

fn stats(f: impl FnOnce(&mut EngineStats)) -> EngineStats {
    let mut s = EngineStats::default();
    f(&mut s);
    s
}

// ---------------------------------------------------------------- names

#[test]
fn stage_names_round_trip() {
    let names = ["enqueued", "transfer_posted", "transfer_done", "released", "aborted", "failed"];
    for (stage, name) in Stage::ALL.into_iter().zip(names) {
        assert_eq!(stage.as_str(), name);
        assert_eq!(stage.to_string(), name);
        assert_eq!(name.parse::<Stage>(), Ok(stage));
    }
    assert_eq!(Stage::ALL.map(Stage::is_terminal), [false, false, false, true, true, true]);
    let mut sorted = Stage::ALL;
    sorted.sort();
    assert_eq!(sorted, Stage::ALL, "ALL is in order of progress");
    assert_eq!(Stage::ALL.map(|s| s as usize), [0, 1, 2, 3, 4, 5]);
}

#[test]
fn stage_parse_error_lists_the_valid_names() {
    let err = "posted".parse::<Stage>().unwrap_err();
    assert_eq!(err, UnknownStage("posted".into()));
    assert_eq!(
        err.to_string(),
        "unknown lifecycle stage \"posted\"; expected one of: enqueued, transfer_posted, \
         transfer_done, released, aborted, failed"
    );
    assert!("Enqueued".parse::<Stage>().is_err(), "names are exact");
    assert!("".parse::<Stage>().is_err());
}

#[test]
fn class_and_outcome_names() {
    assert_eq!(
        StallClass::ALL.map(StallClass::as_str),
        ["waiting_for_peer", "transfer_hung", "release_lost", "waiting_for_kv"]
    );
    for c in StallClass::ALL {
        assert_eq!(c.to_string().parse::<StallClass>(), Ok(c));
    }
    assert_eq!(
        "hung".parse::<StallClass>().unwrap_err().to_string(),
        "unknown stall class \"hung\"; expected one of: waiting_for_peer, transfer_hung, \
         release_lost, waiting_for_kv"
    );
    assert_eq!(
        Outcome::ALL.map(|o| o.to_string()),
        [
            "released",
            "completed",
            "aborted",
            "failed",
            "process_exited",
            "evicted",
            "end_unseen",
            "lease_expired",
            "kv_read_after_release",
            "leaked"
        ]
    );
    assert_eq!(Stage::ALL.map(StallClass::for_stage), [Some(WFP), Some(HUNG), Some(LOST), None, None, None]);
    assert_eq!(
        Stage::ALL.map(Outcome::for_stage),
        [None, None, None, Some(Outcome::Released), Some(Outcome::Aborted), Some(Outcome::Failed)]
    );
}

#[test]
fn snapshot_helpers() {
    let s = snap(1, 2, ABORT, [Some(10), None, Some(30), None], 10, 40, None);
    assert_eq!(s.stage_at(ENQ), Some(10));
    assert_eq!(s.stage_at(POST), None);
    assert_eq!(s.stage_at(DONE), Some(30));
    assert_eq!(s.stage_at(ABORT), None);
    assert_eq!(s.progress(), Some(DONE));
    assert_eq!(s.silent_ns(100), 60);
    assert_eq!(s.silent_ns(5), 0);
    assert_eq!(s.age_ns(100), 90);
}

#[test]
fn default_config() {
    assert_eq!(
        EngineConfig::default(),
        EngineConfig { timeout_ns: 60_000_000_000, max_tracked: 1_000_000, tick_ns: 10_000_000 }
    );
    let e = Engine::new(EngineConfig { timeout_ns: 5, max_tracked: 0, tick_ns: 0 });
    assert_eq!(*e.config(), EngineConfig { timeout_ns: 5, max_tracked: 1, tick_ns: 1 });
}

#[cfg(target_pointer_width = "64")]
#[test]
fn record_stays_88_bytes() {
    assert_eq!(std::mem::size_of::<Record>(), 88);
}

// ---------------------------------------------------------- transitions

#[test]
fn full_lifecycle_ends_released() {
    let mut h = H::new();
    assert_eq!(h.obs(1, 0xA, ENQ, 100), vec![]);
    assert_eq!(h.get(1, 0xA), Some(snap(1, 0xA, ENQ, [Some(100), None, None, None], 100, 100, None)));
    assert_eq!(h.obs(1, 0xA, POST, 200), vec![]);
    assert_eq!(h.obs(1, 0xA, DONE, 300), vec![]);
    assert_eq!(h.get(1, 0xA), Some(snap(1, 0xA, DONE, [Some(100), Some(200), Some(300), None], 100, 300, None)));
    assert_eq!(
        h.obs(1, 0xA, REL, 400),
        vec![ended(
            snap(1, 0xA, REL, [Some(100), Some(200), Some(300), Some(400)], 100, 400, None),
            Outcome::Released,
            400
        )]
    );
    assert_eq!(h.get(1, 0xA), None);
    assert_eq!(h.adv(100_000), vec![], "an ended request has no timer");
    assert_eq!(
        h.stats(),
        stats(|s| {
            s.seen = 1;
            s.completed = 1;
        })
    );
}

#[test]
fn a_framework_judgement_ends_a_request_where_it_stands_and_its_own_outcome_is_activity() {
    let mut h = H::new();
    let end = |h: &mut H, key, stage, ts_ns, outcome| {
        let mut out = Vec::new();
        let observation = Observation { pid: 1, key, stage, ts_ns, external_id: None, ends: Some(outcome) };
        h.e.observe(observation, &mut out);
        out
    };
    // Stalled, then its lease runs out: it ends stalled, never recovered,
    // at its stage, its last activity unchanged.
    h.obs(1, 0xA, ENQ, 100);
    let stuck = snap(1, 0xA, ENQ, [Some(100), None, None, None], 100, 100, Some(WFP));
    assert_eq!(h.adv(1_100), vec![stalled(stuck.clone(), WFP, 1_000, 1_100)]);
    assert_eq!(end(&mut h, 0xA, ENQ, 1_500, Outcome::LeaseExpired), vec![ended(stuck, Outcome::LeaseExpired, 1_500)]);
    // Not stalled: ended likewise, no timer left.
    h.obs(1, 0xB, ENQ, 2_000);
    let quiet = snap(1, 0xB, ENQ, [Some(2_000), None, None, None], 2_000, 2_000, None);
    assert_eq!(end(&mut h, 0xB, ENQ, 2_500, Outcome::LeaseExpired), vec![ended(quiet, Outcome::LeaseExpired, 2_500)]);
    assert_eq!(h.adv(10_000), vec![]);
    // A judgement of a request never seen is stale.
    assert_eq!(end(&mut h, 0xC, ENQ, 3_000, Outcome::LeaseExpired), vec![]);
    // A framework's outcome on a real event (a READ's release that read
    // freed KV) is that event: the release is timed, the outcome its own.
    h.obs(1, 0xD, ENQ, 4_000);
    let read = snap(1, 0xD, REL, [Some(4_000), None, None, Some(4_200)], 4_000, 4_200, None);
    assert_eq!(
        end(&mut h, 0xD, REL, 4_200, Outcome::KvReadAfterRelease),
        vec![ended(read, Outcome::KvReadAfterRelease, 4_200)]
    );
    assert_eq!(
        h.stats(),
        stats(|s| {
            s.seen = 3;
            s.stalled = 1;
            s.lease_expired = 2;
            s.kv_read_after_release = 1;
            s.stale_events = 1;
        })
    );
}

/// A leaked transfer (its framework's judgement, a lifecycle of its own
/// started just before): ended where it stood, counted apart from
/// failures, and never stalled first, although its start was long ago.
#[test]
fn a_leaked_transfer_is_its_own_outcome_counted_apart() {
    let mut h = H::new();
    let mut out = Vec::new();
    h.e.observe(Observation { pid: 1, key: 0xE, stage: DONE, ts_ns: 100, external_id: None, ends: None }, &mut out);
    let leak =
        Observation { pid: 1, key: 0xE, stage: DONE, ts_ns: 5_000, external_id: None, ends: Some(Outcome::Leaked) };
    h.e.observe(leak, &mut out);
    let done = snap(1, 0xE, DONE, [None, None, Some(100), None], 100, 100, None);
    assert_eq!(out, vec![ended(done, Outcome::Leaked, 5_000)]);
    assert_eq!(h.adv(100_000), vec![], "no timer left");
    assert_eq!(
        h.stats(),
        stats(|s| {
            s.seen = 1;
            s.leaked = 1;
        })
    );
}

#[test]
fn aborted_and_failed_from_every_live_stage() {
    for (terminal, outcome) in [(ABORT, Outcome::Aborted), (FAIL, Outcome::Failed)] {
        let mut h = H::new();
        // key 1 stops at enqueued, key 2 at posted, key 3 at done.
        for key in 1..=3u64 {
            let path = [ENQ, POST, DONE];
            for (n, stage) in path.iter().take(key as usize).enumerate() {
                assert_eq!(h.obs(7, key, *stage, 10 * n as u64), vec![]);
            }
            let mut stage_ns = [None; 4];
            for (n, slot) in stage_ns.iter_mut().take(key as usize).enumerate() {
                *slot = Some(10 * n as u64);
            }
            assert_eq!(
                h.obs(7, key, terminal, 50),
                vec![ended(snap(7, key, terminal, stage_ns, 0, 50, None), outcome, 50)]
            );
        }
        assert_eq!(h.stats().in_flight, 0);
        assert_eq!(h.stats().seen, 3);
        assert_eq!(h.stats().aborted, if terminal == ABORT { 3 } else { 0 });
        assert_eq!(h.stats().failed, if terminal == FAIL { 3 } else { 0 });
    }
}

#[test]
fn stages_may_be_skipped() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 0);
    h.obs(1, 1, DONE, 20);
    assert_eq!(
        h.obs(1, 1, REL, 30),
        vec![ended(snap(1, 1, REL, [Some(0), None, Some(20), Some(30)], 0, 30, None), Outcome::Released, 30)]
    );
}

#[test]
fn mid_flight_start_at_a_later_stage() {
    let mut h = H::new();
    assert_eq!(h.obs(1, 9, POST, 500), vec![]);
    assert_eq!(h.get(1, 9), Some(snap(1, 9, POST, [None, Some(500), None, None], 500, 500, None)));
    assert_eq!(
        h.adv(1500),
        vec![stalled(snap(1, 9, POST, [None, Some(500), None, None], 500, 500, Some(HUNG)), HUNG, 1000, 1500)]
    );
    assert_eq!(h.stats().seen, 1);
}

#[test]
fn terminal_event_for_an_unknown_request_is_stale() {
    let mut h = H::new();
    for stage in [REL, ABORT, FAIL] {
        assert_eq!(h.obs(1, 5, stage, 10), vec![]);
    }
    assert_eq!(h.stats(), stats(|s| s.stale_events = 3), "nothing started, nothing tracked");
}

#[test]
fn external_id_is_the_first_one_seen() {
    let mut h = H::new();
    h.obs_ext(1, 1, ENQ, 0, None);
    h.obs_ext(1, 1, POST, 10, Some("room-1"));
    h.obs_ext(1, 1, DONE, 20, Some("room-2"));
    let mut want = snap(1, 1, REL, [Some(0), Some(10), Some(20), Some(30)], 0, 30, None);
    want.external_id = Some("room-1".into());
    assert_eq!(h.obs_ext(1, 1, REL, 30, Some("room-3")), vec![ended(want, Outcome::Released, 30)]);
}

// ------------------------------------------------------ timeout exactness

#[test]
fn stall_not_before_the_timeout_and_at_it_exactly() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 105);
    assert_eq!(h.adv(105), vec![]);
    assert_eq!(h.adv(1000), vec![]);
    assert_eq!(h.adv(1104), vec![], "999 ns of silence is not a stall");
    assert_eq!(
        h.adv(1105),
        vec![stalled(snap(1, 1, ENQ, [Some(105), None, None, None], 105, 105, Some(WFP)), WFP, 1000, 1105)]
    );
    assert_eq!(h.get(1, 1).and_then(|s| s.stalled), Some(WFP));
}

#[test]
fn two_deadlines_inside_one_tick_each_fire_on_time() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 100); // deadline 1100
    h.obs(1, 2, ENQ, 104); // deadline 1104, same 10 ns tick
    let s1 = snap(1, 1, ENQ, [Some(100), None, None, None], 100, 100, Some(WFP));
    let s2 = snap(1, 2, ENQ, [Some(104), None, None, None], 104, 104, Some(WFP));
    assert_eq!(h.adv(1100), vec![stalled(s1, WFP, 1000, 1100)]);
    assert_eq!(h.adv(1102), vec![]);
    assert_eq!(h.adv(1103), vec![]);
    assert_eq!(h.adv(1104), vec![stalled(s2, WFP, 1000, 1104)]);
    assert_eq!(h.adv(1200), vec![]);
}

/// For every phase of the event within a tick and every phase of the
/// advance calls, with one advance per tick: the stall comes at the first
/// advance at or after the deadline, so within [timeout, timeout + tick).
#[test]
fn stall_within_timeout_plus_tick_for_any_phase() {
    for event_ts in 1000..1000 + 2 * TICK {
        for phase in 0..TICK {
            let mut h = H::new();
            h.obs(3, 3, POST, event_ts);
            let mut fired = None;
            let mut now = phase;
            while now < event_ts + TIMEOUT + 3 * TICK {
                let out = h.adv(now);
                if !out.is_empty() {
                    assert!(fired.is_none(), "fired twice");
                    assert_eq!(out.len(), 1);
                    fired = Some((now, out));
                }
                now += TICK;
            }
            let (at, out) = fired.expect("never fired");
            let deadline = event_ts + TIMEOUT;
            assert!(at >= deadline, "early: {at} < {deadline}");
            assert!(at < deadline + TICK, "late: {at} >= {deadline} + tick");
            assert_eq!(
                out,
                vec![stalled(
                    snap(3, 3, POST, [None, Some(event_ts), None, None], event_ts, event_ts, Some(HUNG)),
                    HUNG,
                    at - event_ts,
                    at
                )]
            );
        }
    }
}

#[test]
fn zero_timeout_stalls_at_the_first_advance_at_or_after_the_event() {
    let mut h = H::with(0, TICK, 10);
    h.obs(1, 1, ENQ, 100);
    assert_eq!(h.adv(99), vec![]);
    assert_eq!(
        h.adv(100),
        vec![stalled(snap(1, 1, ENQ, [Some(100), None, None, None], 100, 100, Some(WFP)), WFP, 0, 100)]
    );
}

#[test]
fn timeout_longer_than_one_wheel_lap_is_still_exact() {
    // 1 ns ticks and a 1 ms timeout: a million ticks, far more buckets than
    // the wheel has, so the entry waits through several laps.
    let mut h = H::with(1_000_000, 1, 10);
    h.obs(1, 1, ENQ, 7);
    h.obs(1, 2, ENQ, 300_000);
    let mut now = 0;
    let mut got = Vec::new();
    while now <= 1_400_000 {
        for r in h.adv(now) {
            got.push((now, r));
        }
        now += 997;
    }
    let at1 = 1_000_007u64.div_ceil(997) * 997;
    let at2 = 1_300_000u64.div_ceil(997) * 997;
    assert_eq!(
        got,
        vec![
            (at1, stalled(snap(1, 1, ENQ, [Some(7), None, None, None], 7, 7, Some(WFP)), WFP, at1 - 7, at1)),
            (
                at2,
                stalled(
                    snap(1, 2, ENQ, [Some(300_000), None, None, None], 300_000, 300_000, Some(WFP)),
                    WFP,
                    at2 - 300_000,
                    at2
                )
            )
        ]
    );
}

#[test]
fn tick_longer_than_the_timeout() {
    let mut h = H::with(30, 100, 10);
    h.obs(1, 1, ENQ, 5);
    assert_eq!(h.adv(34), vec![]);
    assert_eq!(h.adv(35).len(), 1);
}

// ------------------------------------------------------- classification

#[test]
fn each_stage_is_classified() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 0);
    h.obs(1, 2, ENQ, 0);
    h.obs(1, 2, POST, 0);
    h.obs(1, 3, ENQ, 0);
    h.obs(1, 3, POST, 0);
    h.obs(1, 3, DONE, 0);
    let z = Some(0);
    assert_eq!(
        by_key(h.adv(1000)),
        vec![
            stalled(snap(1, 1, ENQ, [z, None, None, None], 0, 0, Some(WFP)), WFP, 1000, 1000),
            stalled(snap(1, 2, POST, [z, z, None, None], 0, 0, Some(HUNG)), HUNG, 1000, 1000),
            stalled(snap(1, 3, DONE, [z, z, z, None], 0, 0, Some(LOST)), LOST, 1000, 1000),
        ]
    );
    assert_eq!(h.stats().stalled, 3);
}

#[test]
fn a_decode_silent_at_enqueued_waits_for_its_kv_until_it_exits() {
    let mut h = H::new();
    h.e.set_side(2, Side::Decode);
    h.obs(2, 7, ENQ, 0);
    h.obs(2, 8, ENQ, 0);
    h.obs(2, 8, POST, 0);
    h.obs(1, 7, ENQ, 0);
    let z = Some(0);
    let kv = StallClass::WaitingForKv;
    assert_eq!(
        by_key(h.adv(1000)),
        vec![
            stalled(snap(1, 7, ENQ, [z, None, None, None], 0, 0, Some(WFP)), WFP, 1000, 1000),
            stalled(snap(2, 7, ENQ, [z, None, None, None], 0, 0, Some(kv)), kv, 1000, 1000),
            stalled(snap(2, 8, POST, [z, z, None, None], 0, 0, Some(HUNG)), HUNG, 1000, 1000),
        ]
    );
    // The class stays with the stalled record (recovery names it).
    assert!(matches!(h.obs(2, 7, REL, 1500)[0], Report::Recovered { class: StallClass::WaitingForKv, .. }));
    // A new process with the same pid is a prefill until told otherwise.
    h.exit(2, 2000);
    h.obs(2, 9, ENQ, 3000);
    assert_eq!(
        h.adv(4000)[0],
        stalled(snap(2, 9, ENQ, [Some(3000), None, None, None], 3000, 3000, Some(WFP)), WFP, 1000, 4000)
    );
}

// --------------------------------------------------- episodes, recovery

#[test]
fn stalled_fires_once_per_episode() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 0);
    assert_eq!(h.adv(1000).len(), 1);
    for now in (1000..50_000).step_by(TICK as usize) {
        assert_eq!(h.adv(now), vec![]);
    }
    assert_eq!(h.adv(u64::MAX), vec![]);
    assert_eq!(h.stats().stalled, 1);
    assert_eq!(h.stats().in_flight, 1, "a stalled request stays tracked");
}

#[test]
fn recovered_then_stalled_again() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 0);
    assert_eq!(
        h.adv(1000),
        vec![stalled(snap(1, 1, ENQ, [Some(0), None, None, None], 0, 0, Some(WFP)), WFP, 1000, 1000)]
    );
    assert_eq!(
        h.obs(1, 1, POST, 1500),
        vec![recovered(snap(1, 1, POST, [Some(0), Some(1500), None, None], 0, 1500, None), WFP, 1500)]
    );
    assert_eq!(h.adv(2499), vec![]);
    assert_eq!(
        h.adv(2500),
        vec![stalled(snap(1, 1, POST, [Some(0), Some(1500), None, None], 0, 1500, Some(HUNG)), HUNG, 1000, 2500)]
    );
    // A repeat of the current stage is life too.
    assert_eq!(
        h.obs(1, 1, POST, 4000),
        vec![recovered(snap(1, 1, POST, [Some(0), Some(1500), None, None], 0, 4000, None), HUNG, 2500)]
    );
    assert_eq!(h.adv(4999), vec![]);
    assert_eq!(h.adv(5000).len(), 1);
    assert_eq!(
        h.stats(),
        stats(|s| {
            s.seen = 1;
            s.stalled = 3;
            s.recovered = 2;
            s.in_flight = 1;
        })
    );
}

/// A stall's class refined after the fact (a room between its chunks is
/// no `transfer_hung`, `evidence::transport::refined_class`) is the one
/// its request keeps: `inflight` and its recovery say what its alert said.
#[test]
fn a_reclassed_stall_keeps_its_new_class_to_its_recovery() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 0);
    h.obs(1, 1, POST, 10);
    assert!(!h.e.reclass(1, 1, WFP), "not stalled yet");
    assert_eq!(h.adv(1010).len(), 1);
    assert!(h.e.reclass(1, 1, WFP));
    assert!(!h.e.reclass(1, 2, WFP), "no such request");
    assert_eq!(h.get(1, 1).and_then(|r| r.stalled), Some(WFP));
    let s = snap(1, 1, REL, [Some(0), Some(10), None, Some(1200)], 0, 1200, None);
    assert_eq!(h.obs(1, 1, REL, 1200), vec![recovered(s.clone(), WFP, 1190), ended(s, Outcome::Released, 1200)]);
}

#[test]
fn terminal_event_after_a_stall_recovers_then_ends() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 0);
    h.obs(1, 1, POST, 10);
    assert_eq!(h.adv(1010).len(), 1);
    let s = snap(1, 1, REL, [Some(0), Some(10), None, Some(1200)], 0, 1200, None);
    assert_eq!(h.obs(1, 1, REL, 1200), vec![recovered(s.clone(), HUNG, 1190), ended(s, Outcome::Released, 1200)]);
    assert_eq!(h.adv(10_000), vec![]);
    assert_eq!(
        h.stats(),
        stats(|s| {
            s.seen = 1;
            s.completed = 1;
            s.stalled = 1;
            s.recovered = 1;
        })
    );
}

#[test]
fn late_news_does_not_end_a_silence() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 0);
    h.obs(1, 1, POST, 100);
    assert_eq!(h.adv(1100).len(), 1);
    // Dated inside the silence: recorded, but no recovery.
    assert_eq!(h.obs(1, 1, DONE, 50), vec![]);
    assert_eq!(h.obs(1, 1, POST, 100), vec![], "exact duplicate");
    assert_eq!(h.get(1, 1), Some(snap(1, 1, DONE, [Some(0), Some(100), Some(50), None], 0, 100, Some(HUNG))));
    assert_eq!(h.adv(5000), vec![], "still the same episode");
    // A terminal event that is late news ends it while still stuck.
    assert_eq!(
        h.obs(1, 1, ABORT, 60),
        vec![ended(snap(1, 1, ABORT, [Some(0), Some(100), Some(50), None], 0, 100, Some(HUNG)), Outcome::Aborted, 60)]
    );
    assert_eq!(h.stats().recovered, 0);
    assert_eq!(h.stats().duplicate_events, 1);
}

#[test]
fn activity_moves_the_deadline() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 0);
    h.obs(1, 1, POST, 400);
    h.obs(1, 1, POST, 900); // a repost is life
    for now in (0..1900).step_by(TICK as usize) {
        assert_eq!(h.adv(now), vec![], "at {now}");
    }
    assert_eq!(
        h.adv(1900),
        vec![stalled(snap(1, 1, POST, [Some(0), Some(400), None, None], 0, 900, Some(HUNG)), HUNG, 1000, 1900)]
    );
}

// ------------------------------------------- duplicates and reordering

#[test]
fn exact_duplicates_are_counted_and_ignored() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 0);
    assert_eq!(h.obs(1, 1, ENQ, 0), vec![]);
    h.obs(1, 1, POST, 10);
    assert_eq!(h.obs(1, 1, POST, 10), vec![]);
    assert_eq!(h.obs(1, 1, ENQ, 0), vec![], "duplicate of an earlier stage");
    assert_eq!(h.stats().duplicate_events, 3);
    assert_eq!(h.adv(1010).len(), 1);
    // A duplicate is not life: no recovery.
    assert_eq!(h.obs(1, 1, POST, 10), vec![]);
    assert_eq!(h.stats().duplicate_events, 4);
    assert_eq!(h.stats().recovered, 0);
    assert_eq!(h.get(1, 1), Some(snap(1, 1, POST, [Some(0), Some(10), None, None], 0, 10, Some(HUNG))));
}

#[test]
fn out_of_order_events_fill_gaps_without_moving_back() {
    let mut h = H::new();
    h.obs(1, 1, POST, 200);
    h.obs(1, 1, ENQ, 100);
    assert_eq!(h.get(1, 1), Some(snap(1, 1, POST, [Some(100), Some(200), None, None], 100, 200, None)));
    // An earlier stage that already has a time keeps it.
    h.obs(1, 1, ENQ, 150);
    // A later stage dated before the last event still advances the stage.
    h.obs(1, 1, DONE, 180);
    assert_eq!(h.get(1, 1), Some(snap(1, 1, DONE, [Some(100), Some(200), Some(180), None], 100, 200, None)));
    assert_eq!(h.stats().duplicate_events, 0);
    // Silence counts from the latest timestamp, not the latest arrival.
    assert_eq!(h.adv(1199), vec![]);
    assert_eq!(h.adv(1200)[0].request().stalled, Some(LOST));
}

#[test]
fn timestamps_going_backwards_never_underflow() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 5000);
    h.obs(1, 1, POST, 10); // far behind
    assert_eq!(h.adv(0), vec![]);
    assert_eq!(h.adv(6000).len(), 1);
    assert_eq!(h.adv(3), vec![], "clock behind the cursor");
    // Stuck for "negative" time: saturates to 0, and it is late news.
    assert_eq!(h.obs(1, 1, DONE, 1), vec![]);
    assert_eq!(h.stats().recovered, 0);
    // An event armed in the past fires at the next advance.
    h.obs(1, 2, ENQ, 100);
    assert_eq!(
        h.adv(6000),
        vec![stalled(snap(1, 2, ENQ, [Some(100), None, None, None], 100, 100, Some(WFP)), WFP, 5900, 6000)]
    );
    // Extremes.
    h.obs(1, 3, ENQ, u64::MAX - 5);
    assert_eq!(h.adv(u64::MAX - 1), vec![]);
    assert_eq!(h.adv(u64::MAX), vec![], "only 5 ns of silence, never 'stalled'");
    h.obs(1, 4, ENQ, 0);
    assert_eq!(h.adv(u64::MAX).len(), 1);
    assert_eq!(h.exit(1, 0).len(), 4);
}

#[test]
fn a_huge_jump_fires_everything_once() {
    let mut h = H::new();
    for key in 0..500u64 {
        h.obs(1, key, ENQ, key * 37);
    }
    let out = h.adv(1 << 60);
    assert_eq!(out.len(), 500);
    let keys: BTreeSet<u64> = out.iter().map(|r| r.request().key).collect();
    assert_eq!(keys.len(), 500);
    assert_eq!(h.adv(1 << 61), vec![]);
}

// ----------------------------------------------------- ends and reuse

#[test]
fn late_events_after_an_end_are_stale() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 100);
    h.obs(1, 1, POST, 200);
    assert_eq!(h.obs(1, 1, REL, 400).len(), 1);
    assert_eq!(h.obs(1, 1, DONE, 300), vec![], "reordered behind the release");
    assert_eq!(h.obs(1, 1, DONE, 400), vec![], "same instant as the end");
    assert_eq!(h.obs(1, 1, REL, 400), vec![], "duplicate release");
    assert_eq!(h.obs(1, 1, ABORT, 900), vec![], "terminal for an unknown key");
    assert_eq!(
        h.stats(),
        stats(|s| {
            s.seen = 1;
            s.completed = 1;
            s.stale_events = 4;
        })
    );
    assert_eq!(h.adv(5000), vec![]);
}

#[test]
fn end_time_is_the_latest_event_even_if_the_terminal_one_is_older() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 100);
    h.obs(1, 1, DONE, 300);
    h.obs(1, 1, REL, 250); // skewed across CPUs
    assert_eq!(h.obs(1, 1, POST, 280), vec![]);
    assert_eq!(h.stats().stale_events, 1);
}

#[test]
fn key_reuse_after_release_starts_a_fresh_lifecycle() {
    let mut h = H::new();
    h.obs_ext(1, 0xBEEF, ENQ, 0, Some("room-a"));
    h.obs(1, 0xBEEF, POST, 10);
    h.obs(1, 0xBEEF, DONE, 20);
    assert_eq!(h.obs(1, 0xBEEF, REL, 30).len(), 1);
    // The allocator hands the same handle to the next request.
    assert_eq!(h.obs(1, 0xBEEF, ENQ, 31), vec![]);
    assert_eq!(h.get(1, 0xBEEF), Some(snap(1, 0xBEEF, ENQ, [Some(31), None, None, None], 31, 31, None)));
    // A straggler of the previous lifecycle, read after the new one began.
    assert_eq!(h.obs(1, 0xBEEF, DONE, 25), vec![]);
    assert_eq!(h.stats().stale_events, 1);
    // An out-of-order event of the new lifecycle is not mistaken for one.
    assert_eq!(h.obs(1, 0xBEEF, POST, 45), vec![]);
    assert_eq!(
        h.obs(1, 0xBEEF, REL, 50),
        vec![ended(snap(1, 0xBEEF, REL, [Some(31), Some(45), None, Some(50)], 31, 50, None), Outcome::Released, 50)]
    );
    assert_eq!(h.stats().seen, 2);
    assert_eq!(h.stats().completed, 2);
}

/// The timer of an ended request never fires for its successor, whether
/// the successor reuses the key, the record slot, or both.
#[test]
fn generation_safety() {
    let mut h = H::new();
    // Same key: A's deadline would be 1000, B's is 1020.
    h.obs(1, 7, ENQ, 0);
    h.obs(1, 7, REL, 10);
    h.obs(1, 7, ENQ, 20);
    // Same slot, other key: C's deadline would be 1003, D's is 1006.
    h.obs(1, 8, ENQ, 3);
    h.obs(1, 8, ABORT, 5);
    h.obs(1, 9, ENQ, 6);
    for now in 0..1006 {
        assert_eq!(h.adv(now), vec![], "at {now}");
    }
    assert_eq!(
        h.adv(1006),
        vec![stalled(snap(1, 9, ENQ, [Some(6), None, None, None], 6, 6, Some(WFP)), WFP, 1000, 1006)]
    );
    for now in 1007..1020 {
        assert_eq!(h.adv(now), vec![], "at {now}");
    }
    assert_eq!(
        h.adv(1020),
        vec![stalled(snap(1, 7, ENQ, [Some(20), None, None, None], 20, 20, Some(WFP)), WFP, 1000, 1020)]
    );
    // A stalled request that ends leaves the stalled list: its successor
    // is neither stalled nor evicted in its place.
    h.obs(1, 9, FAIL, 2000);
    h.obs(1, 9, ENQ, 2001);
    assert_eq!(h.get(1, 9).and_then(|s| s.stalled), None);
    assert_eq!(h.adv(3000), vec![]);
    assert_eq!(h.adv(3001).len(), 1);
}

#[test]
fn recent_ends_are_bounded() {
    // max_tracked 10 -> the minimum of RECENT_ENDS_MIN ends remembered.
    let mut h = H::with(TIMEOUT, TICK, 10);
    h.obs(1, 0, ENQ, 0);
    h.obs(1, 0, REL, 10);
    for key in 1..RECENT_ENDS_MIN as u64 {
        h.obs(1, key, ENQ, 20);
        h.obs(1, key, REL, 30);
    }
    assert_eq!(h.obs(1, 0, POST, 5), vec![]);
    assert_eq!(h.stats().stale_events, 1, "still remembered");
    h.obs(1, 9999, ENQ, 40);
    h.obs(1, 9999, REL, 50);
    assert_eq!(h.obs(1, 0, POST, 5), vec![]);
    assert_eq!(h.stats().stale_events, 1, "forgotten: the ring wrapped");
    assert_eq!(h.get(1, 0).map(|s| s.stage), Some(POST));
}

#[test]
fn a_key_ended_again_is_remembered_from_its_latest_end() {
    let mut ends = super::recent::RecentLog::<(u32, u64)>::new(3, super::index::Mixer::new());
    ends.record((1, 1), 10);
    ends.record((1, 2), 20);
    ends.record((1, 1), 30); // moves to the newest position
    ends.record((1, 3), 40);
    ends.record((1, 4), 50); // evicts (1, 2), the oldest live one
    assert_eq!(ends.get((1, 1)), Some(30));
    assert_eq!(ends.get((1, 2)), None);
    assert_eq!(ends.get((1, 3)), Some(40));
    assert_eq!(ends.get((1, 4)), Some(50));
    assert_eq!(ends.len(), 3);
    ends.record((1, 1), 5); // an older time never moves the end back
    assert_eq!(ends.get((1, 1)), Some(30));
}

// ---------------------------------------------------------- process exit

#[test]
fn process_exit_with_several_pids() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 10);
    h.obs(1, 2, ENQ, 20);
    h.obs(1, 2, POST, 40);
    h.obs(1, 3, ENQ, 30);
    h.obs(2, 1, ENQ, 15);
    h.obs(2, 2, ENQ, 25);
    assert_eq!(h.exit(3, 50), vec![], "a pid holding nothing");
    assert_eq!(
        by_key(h.exit(1, 100)),
        vec![
            ended(snap(1, 1, ENQ, [Some(10), None, None, None], 10, 10, None), Outcome::ProcessExited, 100),
            ended(snap(1, 2, POST, [Some(20), Some(40), None, None], 20, 40, None), Outcome::ProcessExited, 100),
            ended(snap(1, 3, ENQ, [Some(30), None, None, None], 30, 30, None), Outcome::ProcessExited, 100),
        ]
    );
    assert_eq!(h.exit(1, 100), vec![], "already gone");
    // Events of the dead process still in the pipeline are stale.
    assert_eq!(h.obs(1, 4, ENQ, 90), vec![]);
    assert_eq!(h.obs(1, 1, POST, 100), vec![]);
    assert_eq!(h.stats().stale_events, 2);
    // The pid is reused by a new process later on.
    assert_eq!(h.obs(1, 5, ENQ, 101), vec![]);
    assert_eq!(
        h.stats(),
        stats(|s| {
            s.seen = 6;
            s.process_exited = 3;
            s.stale_events = 2;
            s.in_flight = 3;
        })
    );
    // The other pid is untouched and stalls on its own schedule.
    assert_eq!(
        h.adv(1015),
        vec![stalled(snap(2, 1, ENQ, [Some(15), None, None, None], 15, 15, Some(WFP)), WFP, 1000, 1015)]
    );
    // A stalled request whose process exits ends still stalled.
    assert_eq!(
        by_key(h.exit(2, 1020)),
        vec![
            ended(snap(2, 1, ENQ, [Some(15), None, None, None], 15, 15, Some(WFP)), Outcome::ProcessExited, 1020),
            ended(snap(2, 2, ENQ, [Some(25), None, None, None], 25, 25, None), Outcome::ProcessExited, 1020),
        ]
    );
    assert_eq!(h.exit(2, 1030), vec![]);
    assert_eq!(h.adv(1025), vec![], "pid 2 key 2 ended with its process");
    assert_eq!(h.stats().in_flight, 1);
}

// -------------------------------------------------------------- eviction

#[test]
fn eviction_prefers_the_oldest_stall() {
    let mut h = H::with(TIMEOUT, TICK, 3);
    h.obs(1, 1, ENQ, 0);
    h.obs(1, 2, ENQ, 5);
    h.obs(1, 3, ENQ, 10);
    assert_eq!(h.adv(1000).len(), 1); // key 1
    assert_eq!(h.adv(1005).len(), 1); // key 2
    // Key 3 is the most silent un-stalled one, but stalls go first.
    assert_eq!(
        h.obs(1, 4, ENQ, 1006),
        vec![ended(snap(1, 1, ENQ, [Some(0), None, None, None], 0, 0, Some(WFP)), Outcome::Evicted, 1006)]
    );
    assert_eq!(
        h.obs(1, 5, ENQ, 1007),
        vec![ended(snap(1, 2, ENQ, [Some(5), None, None, None], 5, 5, Some(WFP)), Outcome::Evicted, 1007)]
    );
    assert_eq!(
        h.obs(1, 6, ENQ, 1008),
        vec![ended(snap(1, 3, ENQ, [Some(10), None, None, None], 10, 10, None), Outcome::Evicted, 1008)]
    );
    assert_eq!(h.stats().evicted, 3);
    assert_eq!(h.stats().in_flight, 3);
}

#[test]
fn eviction_takes_the_request_silent_longest() {
    let mut h = H::with(TIMEOUT, TICK, 3);
    h.obs(1, 1, ENQ, 0);
    h.obs(1, 2, ENQ, 10);
    h.obs(1, 3, ENQ, 20);
    h.obs(1, 1, POST, 30); // key 1 is the oldest but not the most silent
    assert_eq!(
        h.obs(1, 4, ENQ, 40),
        vec![ended(snap(1, 2, ENQ, [Some(10), None, None, None], 10, 10, None), Outcome::Evicted, 40)]
    );
    assert_eq!(
        h.obs(1, 5, ENQ, 50),
        vec![ended(snap(1, 3, ENQ, [Some(20), None, None, None], 20, 20, None), Outcome::Evicted, 50)]
    );
    assert_eq!(
        h.obs(1, 6, ENQ, 60),
        vec![ended(snap(1, 1, POST, [Some(0), Some(30), None, None], 0, 30, None), Outcome::Evicted, 60)]
    );
    assert_eq!(
        h.stats(),
        stats(|s| {
            s.seen = 6;
            s.evicted = 3;
            s.in_flight = 3;
        })
    );
    // The survivors are the three newest, and their timers still work.
    assert_eq!(by_key(h.adv(1060)).iter().map(|r| r.request().key).collect::<Vec<_>>(), vec![4, 5, 6]);
    // Events of an evicted request older than what was known are stale;
    // newer ones are life again and start tracking anew.
    assert_eq!(h.obs(1, 2, POST, 10), vec![]);
    assert_eq!(h.stats().stale_events, 1);
}

#[test]
fn eviction_when_every_deadline_is_laps_away() {
    // Tick 1, timeout far beyond one lap, no advance ever: every entry
    // waits on a later lap and the scan must fall back to the earliest.
    let mut h = H::with(10_000_000, 1, 2);
    h.obs(1, 1, ENQ, 1_000);
    h.obs(1, 2, ENQ, 500_000);
    h.obs(1, 1, POST, 900_000);
    assert_eq!(
        h.obs(1, 3, ENQ, 1_000_000),
        vec![ended(
            snap(1, 2, ENQ, [Some(500_000), None, None, None], 500_000, 500_000, None),
            Outcome::Evicted,
            1_000_000
        )]
    );
}

#[test]
fn a_cap_of_one() {
    let mut h = H::with(TIMEOUT, TICK, 1);
    h.obs(1, 1, ENQ, 0);
    let out = h.obs(1, 2, ENQ, 1);
    assert_eq!(out, vec![ended(snap(1, 1, ENQ, [Some(0), None, None, None], 0, 0, None), Outcome::Evicted, 1)]);
    assert_eq!(h.stats().in_flight, 1);
}

// ----------------------------------------------------- randomized checks

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_stage(rng: &mut Rng) -> Stage {
    match rng.below(100) {
        0..30 => ENQ,
        30..52 => POST,
        52..74 => DONE,
        74..88 => REL,
        88..95 => ABORT,
        _ => FAIL,
    }
}

enum Op {
    Observe(Observation),
    Advance(u64),
    Exit(u32, u64),
}

/// A random but plausible stream: a few pids and keys (so keys are reused
/// and ends collide with new lifecycles), jittered timestamps, exact
/// repeats, advances with a slightly wobbly clock, occasional exits.
fn random_ops(seed: u64, n: usize, step: u64) -> Vec<Op> {
    let mut rng = Rng(seed | 1);
    let mut clock = 1_000u64;
    let mut last: Option<Observation> = None;
    let mut ops = Vec::with_capacity(n);
    for _ in 0..n {
        clock += rng.below(step);
        let roll = rng.below(100);
        let op = if roll < 8 && last.is_some() {
            Op::Observe(last.clone().unwrap_or_else(|| unreachable!()))
        } else if roll < 80 {
            let jitter = rng.below(41);
            let key = 0x1000 + 64 * rng.below(12);
            let stage = random_stage(&mut rng);
            let obs = Observation {
                pid: 1 + rng.below(3) as u32,
                key,
                stage,
                ts_ns: (clock + jitter).saturating_sub(20),
                external_id: (rng.below(10) == 0).then(|| format!("id-{}", rng.below(5)).into()),
                // A third of the keys come from a profile that completes
                // at transfer_done; now and then a framework ends one
                // with its own judgement (a lease ran out) or outcome.
                ends: match rng.below(40) {
                    0 => Some(Outcome::LeaseExpired),
                    1 => Some(Outcome::KvReadAfterRelease),
                    2 => Some(Outcome::Leaked),
                    _ => (stage == DONE && key < 0x1000 + 64 * 4).then_some(Outcome::Completed),
                },
            };
            last = Some(obs.clone());
            Op::Observe(obs)
        } else if roll < 98 {
            Op::Advance(clock.saturating_sub(rng.below(3)))
        } else {
            Op::Exit(1 + rng.below(4) as u32, clock)
        };
        ops.push(op);
    }
    ops
}

/// The rules, written as directly as possible: a scan over every request.
#[derive(Default)]
struct Model {
    timeout: u64,
    reqs: BTreeMap<(u32, u64), RequestSnapshot>,
    ends: HashMap<(u32, u64), u64>,
    exits: HashMap<u32, u64>,
    stats: EngineStats,
}

impl Model {
    fn ended_after(&self, pid: u32, key: u64, ts: u64) -> bool {
        self.ends.get(&(pid, key)).is_some_and(|&e| ts <= e) || self.exits.get(&pid).is_some_and(|&e| ts <= e)
    }

    fn end(&mut self, k: (u32, u64), outcome: Outcome, at_ns: u64, end_ns: u64, out: &mut Vec<Report>) {
        let Some(request) = self.reqs.remove(&k) else {
            return;
        };
        let e = self.ends.entry(k).or_insert(end_ns);
        *e = (*e).max(end_ns);
        match outcome {
            Outcome::Released => self.stats.completed += 1,
            Outcome::Completed => {
                self.stats.completed += 1;
                self.stats.completed_unreleased += 1;
            }
            Outcome::Aborted => self.stats.aborted += 1,
            Outcome::Failed => self.stats.failed += 1,
            Outcome::ProcessExited => self.stats.process_exited += 1,
            Outcome::Evicted => self.stats.evicted += 1,
            Outcome::EndUnseen => self.stats.end_unseen += 1,
            Outcome::LeaseExpired => self.stats.lease_expired += 1,
            Outcome::KvReadAfterRelease => self.stats.kv_read_after_release += 1,
            Outcome::Leaked => self.stats.leaked += 1,
        }
        out.push(ended(request, outcome, at_ns));
    }

    fn observe(&mut self, o: Observation, out: &mut Vec<Report>) {
        let k = (o.pid, o.key);
        let ts = o.ts_ns;
        let slot = o.stage.timestamp_slot();
        match self.reqs.get(&k) {
            Some(r) => {
                if ts < r.first_ns && self.ended_after(o.pid, o.key, ts) {
                    self.stats.stale_events += 1;
                    return;
                }
                if slot.is_some_and(|i| r.stage_ns[i] == Some(ts)) || (o.stage == r.stage && ts == r.last_ns) {
                    self.stats.duplicate_events += 1;
                    return;
                }
                if let Some(outcome) = o.ends.filter(|outcome| outcome.is_judgement()) {
                    let end_ns = r.last_ns;
                    self.end(k, outcome, ts.max(end_ns), end_ns, out);
                    return;
                }
                let Some(r) = self.reqs.get_mut(&k) else {
                    return;
                };
                if r.external_id.is_none() {
                    r.external_id = o.external_id;
                }
                let before = r.last_ns;
                r.first_ns = r.first_ns.min(ts);
                r.last_ns = r.last_ns.max(ts);
                if let Some(i) = slot {
                    r.stage_ns[i].get_or_insert(ts);
                }
                r.stage = r.stage.max(o.stage);
                if let Some(class) = r.stalled {
                    if ts > before {
                        r.stalled = None;
                        self.stats.recovered += 1;
                        out.push(recovered(r.clone(), class, ts - before));
                    }
                }
                let end_ns = r.last_ns;
                let outcome = Outcome::of_event(o.stage, o.ends);
                if let Some(outcome) = outcome {
                    self.end(k, outcome, ts, end_ns, out);
                }
            }
            None => {
                if o.stage.is_terminal() || o.ends.is_some() || self.ended_after(o.pid, o.key, ts) {
                    self.stats.stale_events += 1;
                    return;
                }
                let mut stage_ns = [None; 4];
                if let Some(i) = slot {
                    stage_ns[i] = Some(ts);
                }
                self.stats.seen += 1;
                self.reqs.insert(
                    k,
                    RequestSnapshot {
                        pid: o.pid,
                        key: o.key,
                        external_id: o.external_id,
                        stage: o.stage,
                        stage_ns,
                        first_ns: ts,
                        last_ns: ts,
                        stalled: None,
                        inferred: StageSet::EMPTY,
                    },
                );
            }
        }
    }

    fn advance(&mut self, now: u64, out: &mut Vec<Report>) {
        for r in self.reqs.values_mut() {
            if r.stalled.is_none() && now.checked_sub(r.last_ns).is_some_and(|s| s >= self.timeout) {
                let class = StallClass::for_stage(r.stage).unwrap_or_else(|| unreachable!());
                r.stalled = Some(class);
                self.stats.stalled += 1;
                out.push(stalled(r.clone(), class, now - r.last_ns, now));
            }
        }
    }

    fn exit(&mut self, pid: u32, now: u64, out: &mut Vec<Report>) {
        let e = self.exits.entry(pid).or_insert(now);
        *e = (*e).max(now);
        let keys: Vec<_> = self.reqs.range((pid, 0)..=(pid, u64::MAX)).map(|(k, _)| *k).collect();
        for k in keys {
            let end_ns = self.reqs[&k].last_ns.max(now);
            self.end(k, Outcome::ProcessExited, now, end_ns, out);
        }
    }
}

fn kind(r: &Report) -> u8 {
    match r {
        Report::Stalled { .. } => 0,
        Report::Recovered { .. } => 1,
        Report::Ended { .. } => 2,
    }
}

fn normalized(mut v: Vec<Report>) -> Vec<Report> {
    v.sort_by_key(|r| (r.request().pid, r.request().key, kind(r)));
    v
}

fn inflight_sorted(e: &Engine) -> Vec<RequestSnapshot> {
    let mut v: Vec<_> = e.inflight().collect();
    v.sort_by_key(|s| (s.pid, s.key));
    v
}

/// The engine and the naive model agree on every report, every snapshot
/// and every counter, across configurations that exercise sub-tick
/// deadlines, zero timeouts, ticks longer than the timeout and deadlines
/// several wheel laps away.
#[test]
fn engine_matches_the_naive_model() {
    let configs = [(1000, 10, 60), (1000, 1, 60), (1000, 7, 60), (0, 10, 20), (50, 100, 60), (200_000, 1, 4000)];
    for (timeout, tick, step) in configs {
        for seed in 1..=4u64 {
            let mut h = H::with(timeout, tick, 100_000);
            let mut m = Model { timeout, ..Model::default() };
            let mut total = EngineStats::default();
            let (mut last_now, mut ahead) = (0, 0);
            for (n, op) in random_ops(seed * 7919 + timeout + tick, 6000, step).into_iter().enumerate() {
                let (mut got, mut want) = (Vec::new(), Vec::new());
                match op {
                    Op::Observe(o) => {
                        m.observe(o.clone(), &mut want);
                        h.e.observe(o, &mut got);
                    }
                    Op::Advance(now) => {
                        // A loop sleeping until `next_due_ns` misses no
                        // stall: it wakes by the end of the earliest
                        // deadline's tick (or at once, for one already past).
                        let earliest = m
                            .reqs
                            .values()
                            .filter(|r| r.stalled.is_none())
                            .map(|r| r.last_ns.saturating_add(timeout))
                            .min();
                        let due = h.e.next_due_ns(last_now);
                        if let Some(earliest) = earliest {
                            let by = earliest.div_ceil(tick).saturating_mul(tick).max(last_now);
                            assert!(
                                due.is_some_and(|due| due <= by),
                                "config {timeout}/{tick} seed {seed} op {n}: due {due:?}, a deadline at {earliest}"
                            );
                        }
                        ahead += usize::from(due.is_some_and(|due| due > last_now));
                        last_now = last_now.max(now);
                        m.advance(now, &mut want);
                        h.e.advance(now, &mut got);
                    }
                    Op::Exit(pid, now) => {
                        m.exit(pid, now, &mut want);
                        h.e.process_exited(pid, now, &mut got);
                    }
                }
                let ctx = format!("config {timeout}/{tick} seed {seed} op {n}");
                assert_eq!(normalized(got), normalized(want), "{ctx}");
                let mut st = m.stats;
                st.in_flight = m.reqs.len() as u64;
                assert_eq!(h.stats(), st, "{ctx}");
                if n % 97 == 0 {
                    let model: Vec<_> = m.reqs.values().cloned().collect();
                    assert_eq!(inflight_sorted(&h.e), model, "{ctx}");
                }
                total = st;
            }
            // The stream really exercised the rules.
            assert!(ahead > 100, "config {timeout}/{tick} seed {seed}: the next due time was ahead only {ahead} times");
            assert!(total.stalled > 20, "{total:?}");
            assert!(total.recovered > 5, "{total:?}");
            assert!(total.completed > 100, "{total:?}");
            assert!(total.stale_events > 20, "{total:?}");
            assert!(total.duplicate_events > 20, "{total:?}");
            assert!(total.process_exited > 0, "{total:?}");
        }
    }
}

/// Under a tight cap: never more than `max_tracked`, every report is about a
/// request that was (or just became) tracked, stalls and recoveries
/// alternate per request, eviction takes a stalled request whenever there
/// is one, and the counters add up.
#[test]
fn cap_is_never_exceeded_and_invariants_hold() {
    for (cap, seed) in [(1usize, 3u64), (4, 5), (8, 11), (8, 12), (16, 13)] {
        let mut h = H::with(TIMEOUT, TICK, cap);
        let mut ended_total = 0u64;
        for op in random_ops(seed, 20_000, 60) {
            let before: BTreeMap<(u32, u64), RequestSnapshot> = h.e.inflight().map(|s| ((s.pid, s.key), s)).collect();
            let mut out = Vec::new();
            let observed = match op {
                Op::Observe(o) => {
                    let k = (o.pid, o.key);
                    h.e.observe(o, &mut out);
                    Some(k)
                }
                Op::Advance(now) => {
                    h.e.advance(now, &mut out);
                    None
                }
                Op::Exit(pid, now) => {
                    h.e.process_exited(pid, now, &mut out);
                    None
                }
            };
            let after: BTreeMap<(u32, u64), RequestSnapshot> = h.e.inflight().map(|s| ((s.pid, s.key), s)).collect();
            assert!(after.len() <= cap);
            let st = h.stats();
            assert_eq!(st.in_flight as usize, after.len());
            let any_stalled_before = before.values().any(|s| s.stalled.is_some());
            for r in &out {
                let k = (r.request().pid, r.request().key);
                match r {
                    Report::Stalled { class, .. } => {
                        assert_eq!(before.get(&k).map(|s| s.stalled), Some(None));
                        assert_eq!(after.get(&k).and_then(|s| s.stalled), Some(*class));
                    }
                    Report::Recovered { class, .. } => {
                        assert_eq!(before.get(&k).and_then(|s| s.stalled), Some(*class));
                    }
                    Report::Ended { outcome, .. } => {
                        ended_total += 1;
                        assert!(before.contains_key(&k), "ended something untracked");
                        if *outcome == Outcome::Evicted {
                            assert_eq!(after.len(), cap);
                            if any_stalled_before {
                                assert!(r.request().stalled.is_some(), "evicted a live one first");
                            }
                        } else if *outcome != Outcome::ProcessExited {
                            assert_eq!(Some(k), observed);
                        }
                    }
                }
            }
            for k in after.keys() {
                assert!(before.contains_key(k) || Some(*k) == observed);
            }
            assert_eq!(
                st.seen,
                st.completed
                    + st.failed
                    + st.aborted
                    + st.process_exited
                    + st.evicted
                    + st.lease_expired
                    + st.kv_read_after_release
                    + st.leaked
                    + st.in_flight
            );
            assert_eq!(ended_total, st.seen - st.in_flight);
        }
        assert!(h.stats().evicted > 100, "{:?}", h.stats());
    }
}

// ---------------------------------------------------------------- restoring

/// A request the kernel held: enqueued at 100, posted at 200.
fn held(alerted_ns: Option<u64>) -> Restored {
    Restored {
        pid: 1,
        key: 7,
        stage: Stage::TransferPosted,
        ended: false,
        stage_ns: [Some(100), Some(200), None],
        first_ns: 100,
        last_ns: 200,
        external_id: Some("room-7".into()),
        alerted_ns,
    }
}

fn assert_balanced(s: EngineStats) {
    assert_eq!(
        s.seen,
        s.completed + s.failed + s.aborted + s.process_exited + s.evicted + s.end_unseen + s.in_flight,
        "{s:?}"
    );
}

#[test]
fn a_restored_request_silent_past_the_timeout_stalls_at_the_next_advance() {
    let mut h = H::new();
    assert!(h.restore(held(None)).is_empty());
    assert!(h.adv(1199).is_empty());
    let reports = h.adv(1200);
    assert_eq!(reports.len(), 1, "{reports:?}");
    let Report::Stalled { request, class, silent_ns, .. } = &reports[0] else { panic!("{reports:?}") };
    // Silence counts from the request's own last event, not the restore.
    assert_eq!((*class, *silent_ns), (HUNG, 1000));
    assert_eq!(request.external_id.as_deref(), Some("room-7"));
    assert_eq!(request.stage_ns, [Some(100), Some(200), None, None]);
    let s = h.stats();
    assert_eq!((s.seen, s.restored, s.stalled, s.in_flight), (1, 1, 1, 1));
    assert_balanced(s);
}

#[test]
fn a_stall_already_reported_is_not_reported_again_and_recovers_once() {
    let mut h = H::new();
    assert!(h.restore(held(Some(200))).is_empty());
    assert_eq!(h.get(1, 7).and_then(|r| r.stalled), Some(HUNG), "tracked as stalled");
    assert!(h.adv(5000).is_empty(), "no second Stalled for the same silence");
    let reports = h.obs(1, 7, Stage::TransferDone, 5200);
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert!(matches!(reports[0], Report::Recovered { class: HUNG, stuck_ns: 5000, .. }), "{reports:?}");
    assert!(h.adv(6199).is_empty());
    assert!(matches!(h.adv(6200)[..], [Report::Stalled { class: LOST, .. }]));
    let s = h.stats();
    assert_eq!((s.stalled, s.recovered), (1, 1));
    assert_balanced(s);
}

#[test]
fn a_stall_that_moved_on_while_no_agent_ran_recovers_at_once() {
    let mut h = H::new();
    // Alerted at 100 while enqueued; posted at 200 since.
    let reports = h.restore(Restored { alerted_ns: Some(100), ..held(None) });
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert!(matches!(reports[0], Report::Recovered { class: WFP, stuck_ns: 100, .. }), "{reports:?}");
    assert_eq!(h.get(1, 7).and_then(|r| r.stalled), None);
    assert!(h.adv(1199).is_empty());
    assert!(matches!(h.adv(1200)[..], [Report::Stalled { class: HUNG, .. }]));
}

#[test]
fn restored_requests_that_ended_report_their_recovery_and_end() {
    let mut h = H::new();
    let ended_since = Restored { stage: Stage::Released, last_ns: 900, alerted_ns: Some(200), ..held(None) };
    let reports = h.restore(ended_since);
    assert_eq!(reports.len(), 2, "{reports:?}");
    assert!(matches!(reports[0], Report::Recovered { class: HUNG, stuck_ns: 700, .. }), "{reports:?}");
    let Report::Ended { request, outcome: Outcome::Released, at_ns: 900 } = &reports[1] else { panic!("{reports:?}") };
    assert_eq!((request.stalled, request.stage_ns[3]), (None, Some(900)));

    // Failed within the reported silence: it ended stuck.
    let failed = Restored { key: 8, stage: Stage::Failed, alerted_ns: Some(200), ..held(None) };
    let reports = h.restore(failed);
    assert!(
        matches!(&reports[..], [Report::Ended { outcome: Outcome::Failed, request, .. }] if request.stalled == Some(HUNG)),
        "{reports:?}"
    );
    let s = h.stats();
    assert_eq!((s.seen, s.completed, s.failed, s.recovered, s.in_flight), (2, 1, 1, 1, 0));
    assert_balanced(s);
    // Replayed events of the ended lifecycle are stale.
    assert!(h.obs(1, 7, Stage::Released, 900).is_empty());
    assert_eq!(h.stats().stale_events, 1);
}

#[test]
fn an_alert_outside_the_restored_lifecycle_is_ignored() {
    let mut h = H::new();
    // Alerted at 50: an earlier lifecycle of the reused key.
    assert!(h.restore(Restored { alerted_ns: Some(50), ..held(None) }).is_empty());
    assert_eq!(h.get(1, 7).and_then(|r| r.stalled), None);
    assert!(matches!(h.adv(1200)[..], [Report::Stalled { class: HUNG, .. }]));
}

#[test]
fn replayed_events_of_a_reused_key_are_stale_and_its_own_are_duplicates() {
    let mut h = H::new();
    h.restore(held(None));
    // The previous lifecycle of key 7, still in the ring buffer.
    assert!(h.obs(1, 7, Stage::Enqueued, 40).is_empty());
    assert!(h.obs(1, 7, Stage::Released, 90).is_empty());
    assert!(h.get(1, 7).is_some(), "a straggler's release does not end the restored request");
    // The restored lifecycle's own events, replayed.
    assert!(h.obs(1, 7, Stage::Enqueued, 100).is_empty());
    assert!(h.obs(1, 7, Stage::TransferPosted, 200).is_empty());
    let s = h.stats();
    assert_eq!((s.stale_events, s.duplicate_events, s.in_flight), (2, 2, 1));
    // Its next events apply.
    assert!(h.obs(1, 7, Stage::TransferDone, 300).is_empty());
    assert!(matches!(h.obs(1, 7, Stage::Released, 400)[..], [Report::Ended { outcome: Outcome::Released, .. }]));
    assert_balanced(h.stats());
}

#[test]
fn restoring_respects_the_cap_and_ignores_a_tracked_key() {
    let mut h = H::with(TIMEOUT, TICK, 1);
    h.obs(1, 9, Stage::Enqueued, 10);
    assert!(h.restore(Restored { key: 9, ..held(None) }).is_empty());
    assert_eq!(h.stats().duplicate_events, 1);
    let reports = h.restore(held(None));
    assert!(
        matches!(&reports[..], [Report::Ended { outcome: Outcome::Evicted, request, .. }] if request.key == 9),
        "{reports:?}"
    );
    assert_eq!(h.e.len(), 1);
    assert_balanced(h.stats());
}

#[test]
fn odd_restored_times_do_not_panic() {
    let mut h = H::new();
    let odd = Restored { first_ns: 0, last_ns: 0, stage_ns: [None, None, None], alerted_ns: Some(0), ..held(None) };
    assert!(h.restore(odd).is_empty());
    let backwards = Restored { key: 8, first_ns: 500, last_ns: 10, alerted_ns: Some(u64::MAX), ..held(None) };
    assert!(h.restore(backwards).is_empty());
    assert_eq!(h.get(1, 8).map(|r| r.last_ns), Some(500));
    let _ = h.adv(u64::MAX);
    assert_balanced(h.stats());
}

// ---- State reads: what the target's memory says of a silent request ----

impl H {
    /// `advance_reading` with a memory that answers `read`; also returns
    /// every request it was asked about.
    fn adv_read(&mut self, now_ns: u64, read: Option<Stage>) -> (Vec<Report>, Vec<Silent>) {
        self.adv_read_some(now_ns, usize::MAX, read)
    }

    /// [`H::adv_read`], reading at most `budget`.
    fn adv_read_some(&mut self, now_ns: u64, budget: usize, read: Option<Stage>) -> (Vec<Report>, Vec<Silent>) {
        let (mut out, mut asked) = (Vec::new(), Vec::new());
        self.e.advance_reading(
            now_ns,
            budget,
            &mut |silents, answers| {
                asked.extend_from_slice(silents);
                answers.extend(silents.iter().map(|_| read.map(|stage| StageRead { stage, ends: false })));
            },
            &mut out,
        );
        (out, asked)
    }
}

#[test]
fn a_read_at_the_report_tells_a_done_transfer_from_a_hung_one() {
    let mut h = H::new();
    h.obs(1, 7, POST, 100);
    h.obs(1, 8, POST, 100);
    h.obs(1, 9, ENQ, 100);
    h.obs(1, 9, REL, 200);
    assert_eq!(h.adv_read(1099, Some(DONE)), (vec![], vec![]), "nothing is read before it is due");
    let mut out = Vec::new();
    let mut asked = Vec::new();
    h.e.advance_reading(
        1100,
        usize::MAX,
        &mut |silents, answers| {
            asked.extend_from_slice(silents);
            answers.extend(
                silents.iter().map(|silent| (silent.key == 7).then_some(StageRead { stage: DONE, ends: false })),
            );
        },
        &mut out,
    );
    // What the reader needs to find the memory and check it is this lifecycle's.
    asked.sort_by_key(|silent| silent.key);
    assert_eq!(
        asked,
        [7, 8].map(|key| Silent { pid: 1, key, stage: POST, first_ns: 100, last_ns: 100 }),
        "a request that ended is never read"
    );
    let out = by_key(out);
    let [
        Report::Stalled { request: done, class: LOST, silent_ns: 1000, at_ns: 1100 },
        Report::Stalled { request: hung, class: HUNG, .. },
    ] = &out[..]
    else {
        panic!("{out:?}")
    };
    // Inferred: timed at the read, marked, and not activity (silence still
    // counts from the post).
    assert_eq!((done.stage, done.stage_ns[2], done.last_ns), (DONE, Some(1100), 100));
    assert_eq!(done.inferred.iter().collect::<Vec<_>>(), [DONE]);
    assert_eq!((hung.stage, hung.inferred), (POST, StageSet::EMPTY));
    // Reported once; a stalled request is not read again.
    assert_eq!(h.adv_read(5000, Some(FAIL)), (vec![], vec![]));
}

#[test]
fn a_mass_stall_is_read_a_budget_per_call_oldest_due_first() {
    let mut h = H::new();
    // Due in this order: 6 (earliest), 5, 4, 3, 2, 1, 0.
    for key in 0..7 {
        h.obs(1, key, POST, 160 - 10 * key);
    }
    h.obs(1, 2, REL, 170);
    let keys = |asked: &[Silent]| asked.iter().map(|silent| silent.key).collect::<Vec<_>>();
    let (out, asked) = h.adv_read_some(1200, 2, Some(DONE));
    assert_eq!((keys(&asked), out.len()), (vec![6, 5], 2), "{out:?}");
    // While waiting its turn: 4 moves (due again later), 3 ends; neither is read.
    assert!(h.obs(1, 4, DONE, 1250).is_empty());
    assert_eq!(h.obs(1, 3, REL, 1250).len(), 1);
    let (out, asked) = h.adv_read_some(1300, 2, Some(DONE));
    assert_eq!(keys(&asked), [1, 0], "{out:?}");
    assert!(
        out.iter()
            .all(|report| matches!(report, Report::Stalled { class: LOST, silent_ns, .. } if *silent_ns > TIMEOUT))
    );
    assert_eq!(h.adv_read_some(1400, 2, Some(DONE)), (vec![], vec![]));
    // 4, from its own last event.
    let (out, asked) = h.adv_read_some(2250, 2, None);
    assert_eq!((keys(&asked), out.len()), (vec![4], 1), "{out:?}");
    assert_eq!((h.stats().stalled, h.stats().in_flight), (5, 5));
    assert_balanced(h.stats());
}

#[test]
fn a_stall_beyond_the_budget_is_read_on_a_later_call_and_only_then_reported() {
    // 2 500 due at once, 1 000 read a call: three calls, in the order they
    // came due (key n's last event at 100 + n / 100, over three ticks),
    // each report one of the requests read in that call, none before it is
    // read, none dropped.
    let mut h = H::with(TIMEOUT, TICK, 10_000);
    for key in 0..2500 {
        h.obs(1, key, POST, 100 + key / 100);
    }
    let mut read = Vec::new();
    for call in 0..3u64 {
        let (out, asked) = h.adv_read_some(1130 + call * TICK, 1000, None);
        let keys: Vec<u64> = asked.iter().map(|silent| silent.key).collect();
        let expected: Vec<u64> = (call * 1000..(call * 1000 + 1000).min(2500)).collect();
        assert_eq!(keys, expected, "call {call}: the oldest due first, a budget's worth");
        let stalled: Vec<u64> = out
            .iter()
            .map(|report| match report {
                Report::Stalled { request, class: HUNG, .. } => request.key,
                other => panic!("call {call}: {other:?}"),
            })
            .collect();
        assert_eq!(stalled, keys, "call {call}: each stall reported once it is read, in order");
        read.extend(keys);
    }
    assert_eq!(read, (0..2500).collect::<Vec<_>>());
    assert_eq!(h.adv_read_some(1160, 1000, None), (vec![], vec![]));
    assert_eq!((h.stats().stalled, h.stats().in_flight), (2500, 2500));
    assert_balanced(h.stats());
}

#[test]
fn a_request_waiting_for_its_read_is_evicted_before_a_live_one() {
    // At the cap, every request due, one read so far: a new request evicts
    // the oldest still waiting for its read, never a live one, and is
    // tracked.
    let mut h = H::with(TIMEOUT, TICK, 3);
    for key in 0..3 {
        h.obs(1, key, POST, 100 + key);
    }
    let (out, asked) = h.adv_read_some(5000, 1, None);
    assert_eq!((asked.len(), asked[0].key, out.len()), (1, 0, 1));
    // Key 0 is stalled: evicted first, its alert already out.
    let out = h.obs(1, 10, ENQ, 5001);
    assert!(
        matches!(&out[..], [Report::Ended { request, outcome: Outcome::Evicted, .. }] if request.key == 0),
        "{out:?}"
    );
    let out = h.obs(1, 11, ENQ, 5002);
    assert!(
        matches!(&out[..], [Report::Ended { request, outcome: Outcome::Evicted, .. }] if request.key == 1),
        "{out:?}"
    );
    assert!(h.e.get(1, 10).is_some() && h.e.get(1, 11).is_some() && h.e.get(1, 2).is_some());
    // The one left waiting is still read and stalled; the evicted one is not.
    let (out, asked) = h.adv_read_some(5010, 1, None);
    assert_eq!((asked.len(), asked[0].key, out.len()), (1, 2, 1));
    assert_eq!((h.stats().evicted, h.stats().in_flight), (2, 3));
    assert_balanced(h.stats());
}

#[test]
fn a_failed_status_ends_the_request_failed_at_the_read() {
    let mut h = H::new();
    h.obs_ext(1, 7, POST, 100, Some("room-1"));
    let (out, _) = h.adv_read(1100, Some(FAIL));
    let [Report::Ended { request, outcome: Outcome::Failed, at_ns: 1100 }] = &out[..] else { panic!("{out:?}") };
    assert_eq!((request.stage, request.external_id.as_deref(), request.stalled), (FAIL, Some("room-1"), None));
    assert_eq!(request.inferred.iter().collect::<Vec<_>>(), [FAIL]);
    assert_eq!((h.stats().failed, h.stats().stalled), (1, 0));
    // The framework's release of the failed handle is old news.
    assert!(h.obs(1, 7, REL, 1050).is_empty());
    assert_eq!(h.stats().stale_events, 1);
    assert_eq!(h.adv_read(5000, Some(FAIL)), (vec![], vec![]));
    assert_balanced(h.stats());
}

#[test]
fn an_unreadable_request_is_kept_and_classified_by_its_probes() {
    let mut h = H::new();
    h.obs(1, 7, POST, 100);
    let (out, asked) = h.adv_read(1100, None);
    assert_eq!(asked.len(), 1);
    assert!(
        matches!(&out[..], [Report::Stalled { class: HUNG, request, .. }] if request.inferred.is_empty()),
        "{out:?}"
    );
    assert_eq!(h.stats().in_flight, 1);
}

#[test]
fn a_read_never_moves_a_request_back_and_a_probe_replaces_an_inferred_time() {
    let mut h = H::new();
    h.obs(1, 7, DONE, 100);
    let (out, _) = h.adv_read(1100, Some(POST));
    assert!(
        matches!(&out[..], [Report::Stalled { class: LOST, request, .. }] if request.inferred.is_empty()),
        "{out:?}"
    );
    h.obs(1, 8, POST, 2000);
    h.adv_read(3000, Some(DONE));
    assert_eq!(
        h.get(1, 8).map(|r| (r.stage, r.stage_ns[2], r.inferred.contains(DONE))),
        Some((DONE, Some(3000), true))
    );
    // The probe's news of the real completion: its time replaces the read's.
    let out = h.obs(1, 8, DONE, 2500);
    assert!(
        matches!(&out[..], [Report::Recovered { class: LOST, request, .. }] if request.inferred.is_empty() && request.stage_ns[2] == Some(2500)),
        "{out:?}"
    );
}

// ------------------------------------------- completing at transfer_done

impl H {
    /// An observation whose probe ends lifecycles at its stage.
    fn obs_ending(&mut self, pid: u32, key: u64, stage: Stage, ts_ns: u64) -> Vec<Report> {
        let mut out = Vec::new();
        self.e.observe(
            Observation { pid, key, stage, ts_ns, external_id: None, ends: Some(Outcome::Completed) },
            &mut out,
        );
        out
    }
}

#[test]
fn a_done_that_ends_the_lifecycle_completes_it_and_its_later_release_is_stale() {
    let mut h = H::new();
    assert!(h.obs(1, 7, ENQ, 100).is_empty());
    assert!(h.obs(1, 7, POST, 150).is_empty());
    let done = snap(1, 7, DONE, [Some(100), Some(150), Some(200), None], 100, 200, None);
    assert_eq!(h.obs_ending(1, 7, DONE, 200), vec![ended(done, Outcome::Completed, 200)]);
    assert_eq!(h.get(1, 7), None);
    // Idle for ever after: nothing stalls; the late release starts nothing.
    assert!(h.adv(10_000).is_empty());
    assert!(h.obs(1, 7, REL, 20_000).is_empty());
    let s = h.stats();
    assert_eq!(
        (s.seen, s.completed, s.completed_unreleased, s.stale_events, s.stalled, s.in_flight),
        (1, 1, 1, 1, 0, 0)
    );
    assert_balanced(s);
    // The key's next lifecycle is a new one, and a release still ends it.
    assert!(h.obs(1, 7, ENQ, 20_100).is_empty());
    assert_eq!(h.obs(1, 7, REL, 20_200).len(), 1);
    assert_eq!((h.stats().completed, h.stats().completed_unreleased), (2, 1));
    // An ending event of a request never seen opens nothing.
    assert!(h.obs_ending(1, 9, DONE, 20_300).is_empty());
    assert_eq!((h.get(1, 9), h.stats().stale_events), (None, 2));
}

#[test]
fn a_stalled_request_whose_done_ends_it_recovers_then_completes() {
    let mut h = H::new();
    h.obs(1, 7, POST, 100);
    assert_eq!(h.adv(1100).len(), 1);
    let out = h.obs_ending(1, 7, DONE, 1500);
    assert!(
        matches!(
            &out[..],
            [
                Report::Recovered { class: HUNG, stuck_ns: 1400, .. },
                Report::Ended { outcome: Outcome::Completed, at_ns: 1500, .. }
            ]
        ),
        "{out:?}"
    );
    assert!(h.adv(5000).is_empty());
}

#[test]
fn a_done_read_where_done_is_complete_ends_the_lifecycle_inferred_never_release_lost() {
    let mut h = H::new();
    h.obs(1, 7, POST, 100);
    h.obs(1, 8, ENQ, 100);
    let mut out = Vec::new();
    // Both memories say done, past what the probes saw (posted, enqueued):
    // complete, not release_lost.
    h.e.advance_reading(
        1100,
        usize::MAX,
        &mut |silents, answers| answers.extend(silents.iter().map(|_| Some(StageRead { stage: DONE, ends: true }))),
        &mut out,
    );
    assert_eq!(out.len(), 2, "{out:?}");
    for report in &out {
        let Report::Ended { request, outcome: Outcome::Completed, at_ns: 1100 } = report else { panic!("{report:?}") };
        assert_eq!((request.stage, request.stage_at(DONE), request.stalled), (DONE, Some(1100), None));
        assert!(request.inferred.contains(DONE) && request.stage_at(REL).is_none(), "{request:?}");
    }
    assert_eq!((h.stats().stalled, h.stats().completed_unreleased, h.stats().in_flight), (0, 2, 0));
    h.obs(1, 9, POST, 2000);
    h.e.advance_reading(
        3000,
        usize::MAX,
        &mut |silents, answers| answers.extend(silents.iter().map(|_| Some(StageRead { stage: ENQ, ends: false }))),
        &mut out,
    );
    assert!(matches!(out.last(), Some(Report::Stalled { class: HUNG, .. })), "{out:?}");
}

#[test]
fn a_request_taken_over_ended_at_done_recovers_and_completes_once() {
    let mut h = H::new();
    // Alerted at 200 while posted, then done (ending it) while no agent ran.
    let request = Restored {
        stage: DONE,
        ended: true,
        stage_ns: [Some(100), Some(200), Some(900)],
        last_ns: 900,
        ..held(Some(200))
    };
    let out = h.restore(request);
    assert!(
        matches!(
            &out[..],
            [
                Report::Recovered { class: HUNG, stuck_ns: 700, .. },
                Report::Ended { outcome: Outcome::Completed, at_ns: 900, .. }
            ]
        ),
        "{out:?}"
    );
    assert_eq!((h.stats().completed_unreleased, h.stats().in_flight), (1, 0));
    // Live at done (a profile that waits for the release): release_lost as before.
    let mut h = H::new();
    h.restore(Restored { stage: DONE, stage_ns: [Some(100), Some(200), Some(900)], last_ns: 900, ..held(None) });
    assert!(matches!(&h.adv(1900)[..], [Report::Stalled { class: LOST, .. }]));
}

// ---- Withheld events: what `quiet` probes kept in the kernel's table ----

impl H {
    /// `advance_checking` with a kernel that holds `kernel` of every
    /// request it is asked about; also returns every request asked about.
    fn adv_withheld(&mut self, now_ns: u64, kernel: Option<Withheld>) -> (Vec<Report>, Vec<Silent>) {
        let (mut out, mut asked) = (Vec::new(), Vec::new());
        self.e.advance_checking(
            now_ns,
            usize::MAX,
            &mut |silent| {
                asked.push(*silent);
                kernel
            },
            &mut |silents, answers| answers.extend(silents.iter().map(|_| None)),
            &mut out,
        );
        (out, asked)
    }
}

#[test]
fn a_request_moved_along_by_withheld_events_stalls_from_its_latest_at_its_stage() {
    let mut h = H::new();
    h.obs(1, 7, ENQ, 100);
    // Posted at 300 and again at 600, neither sent: due at 1100 by what the
    // engine knows, active at 600 by what the kernel holds.
    let kernel = Withheld { stage: POST, last_ns: 600, stage_ns: [Some(100), Some(300), None] };
    let (out, asked) = h.adv_withheld(1100, Some(kernel));
    assert_eq!(out, vec![], "not silent: armed again from the kernel's latest");
    assert_eq!(asked, [Silent { pid: 1, key: 7, stage: ENQ, first_ns: 100, last_ns: 100 }]);
    assert_eq!(h.stats().caught_up, 1);
    let caught = h.get(1, 7).expect("tracked");
    assert_eq!((caught.stage, caught.stage_at(POST), caught.last_ns), (POST, Some(300), 600));
    assert!(!caught.inferred.contains(POST), "a probe's event, not a read: {caught:?}");
    // Nothing more in the kernel: transfer_hung, silent since 600.
    let (out, asked) = h.adv_withheld(1600, None);
    assert_eq!(asked.len(), 1);
    let [Report::Stalled { request, class: HUNG, silent_ns: 1000, at_ns: 1600 }] = &out[..] else { panic!("{out:?}") };
    assert_eq!(request.stage_at(POST), Some(300));
}

#[test]
fn withheld_events_that_leave_a_request_silent_stall_it_at_once_at_their_stage() {
    let mut h = H::new();
    h.obs(1, 7, ENQ, 100);
    h.obs(1, 8, ENQ, 100);
    // Key 7 was done at 200, unsent and silent since: release_lost now, its
    // silence counted from 200. Key 8's kernel entry is what the engine has.
    let (mut out, mut asked) = (Vec::new(), Vec::new());
    h.e.advance_checking(
        1300,
        usize::MAX,
        &mut |silent| {
            asked.push(silent.key);
            (silent.key == 7).then_some(Withheld { stage: DONE, last_ns: 200, stage_ns: [Some(100), None, Some(200)] })
        },
        &mut |silents, answers| answers.extend(silents.iter().map(|_| None)),
        &mut out,
    );
    asked.sort_unstable();
    assert_eq!(asked, [7, 8]);
    let out = by_key(out);
    let [
        Report::Stalled { request: lost, class: LOST, silent_ns: 1100, .. },
        Report::Stalled { request: waiting, class: WFP, .. },
    ] = &out[..]
    else {
        panic!("{out:?}")
    };
    assert_eq!((lost.key, lost.stage_at(DONE), waiting.key), (7, Some(200), 8));
}

#[test]
fn catching_up_brings_the_requests_asked_for_up_to_the_kernel_but_not_a_stalled_one() {
    let mut h = H::new();
    h.obs(1, 7, ENQ, 100);
    h.obs(2, 8, ENQ, 100);
    h.obs(1, 9, POST, 100);
    assert!(matches!(&h.adv(1100)[..], [_, _, _]), "all three stalled");
    h.obs(1, 10, ENQ, 1200);
    h.obs(2, 11, ENQ, 1200);
    let done = Withheld { stage: DONE, last_ns: 1300, stage_ns: [Some(1200), Some(1250), Some(1300)] };
    let mut asked = Vec::new();
    h.e.catch_up(Some(1), &mut |silent| {
        asked.push(silent.key);
        Some(done)
    });
    assert_eq!(asked, [10], "pid 1's live request only: a stalled one's later events are all sent");
    assert_eq!(h.stats().caught_up, 1);
    let caught = h.get(1, 10).expect("tracked");
    assert_eq!(
        (caught.stage, caught.stage_at(POST), caught.stage_at(DONE), caught.last_ns),
        (DONE, Some(1250), Some(1300), 1300)
    );
    assert_eq!(h.get(2, 11).map(|r| r.stage), Some(ENQ), "another process's request is not asked about");
    // Its timer counts from the kernel's latest event: release_lost at 2300,
    // not 2200 with the other process's request.
    assert!(matches!(&h.adv(2250)[..], [Report::Stalled { class: WFP, request, .. }] if request.key == 11));
    assert_eq!(h.adv(2299), vec![]);
    assert!(
        matches!(&h.adv(2300)[..], [Report::Stalled { class: LOST, request, silent_ns: 1000, .. }] if request.key == 10)
    );
}

// ---------------------------------------------------------- resynchronising

impl H {
    /// A resynchronisation with the kernel holding `table` (also what a
    /// lookup of a tracked key finds), read from `since_ns`.
    fn resync(&mut self, since_ns: u64, complete: bool, table: &[Restored]) -> Vec<Report> {
        let mut out = Vec::new();
        let mut held = |pid: u32, key: u64| Ok(table.iter().find(|r| (r.pid, r.key) == (pid, key)).cloned());
        self.e.resync(since_ns, complete, &mut held, table.to_vec(), &mut out);
        out
    }
}

/// What a pause of the agent that filled the ring buffer leaves: a healthy
/// request whose release was lost, one whose every event was lost while it
/// pinned, one the kernel saw move on, a stalled one that recovered and
/// then ended, a key reused by a later lifecycle. After the resync each is
/// what the kernel says, and only the pinned one ever stalls.
#[test]
fn a_resync_after_lost_events_ends_what_the_kernel_ended_and_takes_over_what_it_holds() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 100); // released, release lost
    h.obs(1, 2, ENQ, 100); // moved on to posted at 900, event lost
    h.obs(1, 3, POST, 100); // stalls, then done and released (kept ended for the alert)
    h.obs(1, 4, ENQ, 100); // released; key 4 began again at 950
    h.obs(1, 5, ENQ, 2500); // newer than the table's view
    assert!(matches!(
        h.adv(1100)[..],
        [Report::Stalled { .. }, Report::Stalled { .. }, Report::Stalled { .. }, Report::Stalled { .. }]
    ));
    // All four stalled: what the resync finds of each says how it ends.
    let table = [
        Restored {
            key: 2,
            stage: POST,
            stage_ns: [Some(100), Some(1900), None],
            first_ns: 100,
            last_ns: 1900,
            external_id: None,
            ..held(None)
        },
        Restored {
            key: 3,
            stage: REL,
            ended: true,
            stage_ns: [None, Some(100), Some(1500)],
            first_ns: 100,
            last_ns: 1600,
            external_id: None,
            alerted_ns: Some(100),
            ..held(None)
        },
        Restored {
            key: 4,
            stage: ENQ,
            stage_ns: [Some(1950), None, None],
            first_ns: 1950,
            last_ns: 1950,
            external_id: None,
            ..held(None)
        },
        // Never seen: every event lost while it pinned.
        Restored {
            key: 6,
            stage: POST,
            stage_ns: [Some(300), Some(400), None],
            first_ns: 300,
            last_ns: 400,
            external_id: None,
            ..held(None)
        },
    ];
    let reports = h.resync(2000, true, &table);
    let ends: Vec<(u64, Outcome)> =
        reports
            .iter()
            .filter_map(|r| {
                if let Report::Ended { request, outcome, .. } = r { Some((request.key, *outcome)) } else { None }
            })
            .collect();
    assert_eq!(ends, [(1, Outcome::EndUnseen), (3, Outcome::Released), (4, Outcome::EndUnseen)], "{reports:?}");
    let recovered: Vec<u64> =
        reports.iter().filter(|&r| matches!(r, Report::Recovered { .. })).map(|r| r.request().key).collect();
    assert_eq!(recovered, [2, 3], "life after a reported silence is a recovery: {reports:?}");
    assert_eq!(h.get(1, 2).map(|r| (r.stage, r.last_ns, r.stalled)), Some((POST, 1900, None)));
    assert_eq!(
        h.get(1, 4).map(|r| (r.first_ns, r.stage)),
        Some((1950, ENQ)),
        "the key's later lifecycle is taken over"
    );
    assert_eq!(
        h.get(1, 6).map(|r| (r.first_ns, r.last_ns, r.stage)),
        Some((300, 400, POST)),
        "the pinned request is taken over"
    );
    assert_eq!(h.get(1, 5).map(|r| r.last_ns), Some(2500), "newer than the table: left as it is");
    // The pinned request stalls at once, silent since its own last event;
    // nothing else is judged stalled.
    let reports = h.adv(2010);
    assert!(
        matches!(&reports[..], [Report::Stalled { request, class: HUNG, silent_ns: 1610, .. }] if request.key == 6),
        "{reports:?}"
    );
    let s = h.stats();
    assert_eq!((s.end_unseen, s.restored, s.resyncs), (2, 2, 1), "{s:?}");
    assert_balanced(s);
    // A second resync with the same view changes nothing.
    assert!(h.resync(2020, true, &table).is_empty());
}

/// While the kernel's table has refused entries, a request it holds
/// nothing of may never have had one: it is not ended; one whose key holds
/// a later lifecycle still is. A lookup that fails leaves it as it is.
#[test]
fn a_resync_ends_nothing_the_kernel_may_never_have_held() {
    let mut h = H::new();
    h.obs(1, 1, ENQ, 100);
    h.obs(1, 2, ENQ, 100);
    h.obs(1, 3, ENQ, 100);
    let later = Restored {
        key: 2,
        stage: ENQ,
        stage_ns: [Some(500), None, None],
        first_ns: 500,
        last_ns: 500,
        external_id: None,
        ..held(None)
    };
    let reports = h.resync(600, false, std::slice::from_ref(&later));
    assert!(
        matches!(&reports[..], [Report::Ended { request, outcome: Outcome::EndUnseen, .. }] if request.key == 2),
        "{reports:?}"
    );
    assert!(h.get(1, 1).is_some());
    let mut out = Vec::new();
    h.e.resync(700, true, &mut |_, key| if key == 3 { Err(()) } else { Ok(None) }, Vec::new(), &mut out);
    assert_eq!(out.iter().map(|r| r.request().key).collect::<Vec<_>>(), [1, 2], "{out:?}");
    assert_eq!(h.get(1, 3).map(|r| r.first_ns), Some(100), "a failed lookup ends nothing");
    assert_balanced(h.stats());
}

/// A stage time a record carries for a quiet probe, which the engine
/// already took from the kernel's table, is an expected repeat; the same
/// event delivered twice is a duplicate.
#[test]
fn a_carried_time_already_caught_up_is_no_duplicate() {
    let mut h = H::new();
    h.obs(1, 7, ENQ, 100);
    // Due: the kernel's table shows the withheld post.
    let mut out = Vec::new();
    let seen = Withheld { stage: POST, last_ns: 600, stage_ns: [Some(100), Some(600), None] };
    h.e.advance_checking(1100, usize::MAX, &mut |_| Some(seen), &mut |s, a| a.extend(s.iter().map(|_| None)), &mut out);
    assert!(out.is_empty(), "active within the timeout: {out:?}");
    // The release record carries the post's time again.
    let post = Observation { pid: 1, key: 7, stage: POST, ts_ns: 600, external_id: None, ends: None };
    h.e.observe_carried(post.clone(), &mut out);
    assert_eq!((h.stats().caught_up_repeats, h.stats().duplicate_events), (1, 0));
    // Delivered twice as an event of its own: a duplicate.
    h.e.observe(post, &mut out);
    assert_eq!((h.stats().caught_up_repeats, h.stats().duplicate_events), (1, 1));
    assert!(out.is_empty(), "{out:?}");
}
