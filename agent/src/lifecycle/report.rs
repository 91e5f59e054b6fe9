//! What goes into the engine ([`Observation`]) and what comes out of it
//! ([`Report`], [`RequestSnapshot`], [`EngineStats`]).
//!
//! Everything that leaves is an owned copy, so exporters and the query layer
//! can keep, send or sort it without holding a borrow of the engine (which
//! the event loop needs back for the next event).

use super::stage::{Outcome, Stage, StageSet, StallClass};

/// One decoded lifecycle event for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    /// Thread-group id of the process that holds the request.
    pub pid: u32,
    /// The request key the probe resolved (a handle address, a request id).
    pub key: u64,
    pub stage: Stage,
    /// CLOCK_MONOTONIC nanoseconds (`bpf_ktime_get_ns`), the clock that
    /// [`Engine::advance`](super::Engine::advance) is driven with.
    pub ts_ns: u64,
    /// A cross-node identity (bootstrap room, notification message) if the
    /// probe captured one.
    pub external_id: Option<Box<str>>,
    /// How the event ends the lifecycle when its stage does not say, or
    /// says otherwise: [`Outcome::Completed`] at a live stage its probe's
    /// profile completes lifecycles at (`complete_at`, for a framework that
    /// releases what is done only lazily, if ever); a framework's own
    /// outcome ([`Outcome::LeaseExpired`], [`Outcome::KvReadAfterRelease`],
    /// [`Outcome::Leaked`]) at any stage. `None`: its stage says (a terminal stage ends it, a
    /// live one leaves it live).
    pub ends: Option<Outcome>,
}

/// What a read of the target's memory says of a request whose stall is
/// due: its stage, and whether that ends the lifecycle as an
/// [`Observation`] that `ends` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageRead {
    pub stage: Stage,
    pub ends: bool,
}

/// What the kernel's in-flight entry of a request whose stall is due holds
/// beyond what the agent was sent: events of its `quiet` probes, kept in
/// the entry instead of the ring buffer. Probe events all the same: seen
/// at these times, not inferred.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Withheld {
    /// The furthest stage.
    pub stage: Stage,
    /// The latest event.
    pub last_ns: u64,
    /// When each live stage was first seen.
    pub stage_ns: [Option<u64>; 3],
}

/// A request the kernel's in-flight table held when this agent started: a
/// lifecycle a previous agent was following, or one that began while no
/// agent ran. See [`Engine::restore`](super::Engine::restore).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restored {
    pub pid: u32,
    pub key: u64,
    /// Furthest stage.
    pub stage: Stage,
    /// The request ended (at `stage`, terminal or one its profile completes
    /// at) while a previous agent's stall alert for it was out: the kernel
    /// keeps such entries so that the recovery is not lost.
    pub ended: bool,
    /// When enqueued, transfer_posted and transfer_done were first seen.
    pub stage_ns: [Option<u64>; 3],
    pub first_ns: u64,
    pub last_ns: u64,
    pub external_id: Option<Box<str>>,
    /// The `last_ns` of the silence a previous agent already reported as
    /// stalled, if any.
    pub alerted_ns: Option<u64>,
}

/// A request whose stall is due, as [`Engine::advance_reading`](super::Engine::advance_reading)
/// asks its reader about it: enough to find its state in the target's memory
/// and to check that the memory still belongs to this lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Silent {
    pub pid: u32,
    pub key: u64,
    pub stage: Stage,
    pub first_ns: u64,
    pub last_ns: u64,
}

/// What the engine knows of one request (a copy, for reports and queries).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSnapshot {
    pub pid: u32,
    pub key: u64,
    /// The first external id any observation of this lifecycle carried.
    pub external_id: Option<Box<str>>,
    /// Furthest stage reached (never moves backwards). For a lifecycle that
    /// ended on a terminal event this is that event's stage.
    pub stage: Stage,
    /// When Enqueued, TransferPosted, TransferDone and Released were first
    /// seen (index = `stage as usize`). Gaps are normal: an agent attached
    /// mid-flight, or a probe that missed.
    pub stage_ns: [Option<u64>; 4],
    /// Earliest event timestamp of this lifecycle.
    pub first_ns: u64,
    /// Latest event timestamp of this lifecycle: silence is measured from it.
    pub last_ns: u64,
    /// `Some` while the request is stalled, or if it was still stalled when
    /// it ended (evicted, its process exited, or only stale news came).
    pub stalled: Option<StallClass>,
    /// Stages no probe saw, inferred from the request's state in the
    /// target's memory: their time (in `stage_ns`, or the `Ended` report's
    /// `at_ns` for a terminal one) is when it was read, the latest the stage
    /// can have been reached.
    pub inferred: StageSet,
}

impl RequestSnapshot {
    /// When stage `s` was first seen, for the four main-path stages; `None`
    /// for a stage never seen and for the side exits (whose time is the
    /// `at_ns` of the [`Report::Ended`]).
    pub fn stage_at(&self, s: Stage) -> Option<u64> {
        s.timestamp_slot().and_then(|i| self.stage_ns[i])
    }

    /// The furthest main-path stage that has a timestamp: where a request
    /// that was aborted, failed, evicted or orphaned had got to.
    pub fn progress(&self) -> Option<Stage> {
        [Stage::Released, Stage::TransferDone, Stage::TransferPosted, Stage::Enqueued]
            .into_iter()
            .find(|s| self.stage_at(*s).is_some())
    }

    /// Time since the last event, as of `now_ns` (0 if the clock is behind).
    pub fn silent_ns(&self, now_ns: u64) -> u64 {
        now_ns.saturating_sub(self.last_ns)
    }

    /// Time since the first event, as of `now_ns` (0 if the clock is behind).
    pub fn age_ns(&self, now_ns: u64) -> u64 {
        now_ns.saturating_sub(self.first_ns)
    }
}

/// Something the exporters must hear about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// The request has been silent for at least the timeout. Fired exactly
    /// once per silence episode.
    Stalled {
        request: RequestSnapshot,
        class: StallClass,
        /// `at_ns - request.last_ns`.
        silent_ns: u64,
        /// The `now_ns` of the `advance` call that found it.
        at_ns: u64,
    },
    /// A stalled request showed life again (the first event after Stalled
    /// with a timestamp later than its last one). For a terminal event this
    /// is immediately followed by the `Ended` for it.
    Recovered {
        request: RequestSnapshot,
        /// The class it was stalled with.
        class: StallClass,
        /// The reviving event's timestamp minus the last event before it.
        stuck_ns: u64,
    },
    /// The lifecycle is over and no longer tracked: every tracked request
    /// ends in exactly one of these.
    Ended {
        request: RequestSnapshot,
        outcome: Outcome,
        /// The terminal event's timestamp; for `ProcessExited` the exit
        /// time given; for `Evicted` the latest of the evicting event's
        /// timestamp and the victim's last event.
        at_ns: u64,
    },
}

impl Report {
    /// The request this report is about.
    pub fn request(&self) -> &RequestSnapshot {
        match self {
            Report::Stalled { request, .. } | Report::Recovered { request, .. } | Report::Ended { request, .. } => {
                request
            }
        }
    }
}

/// Counters since the engine was created (plus the `in_flight` gauge).
///
/// Lifecycle counters count requests: `seen` = `completed` + `failed` +
/// `aborted` + `process_exited` + `evicted` + `end_unseen` +
/// `lease_expired` + `kv_read_after_release` + `leaked` + `in_flight`
/// always holds.
/// `stalled` and `recovered` count episodes (a request can stall and recover
/// several times). The `_events` counters count observations the engine
/// dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Lifecycles started.
    pub seen: u64,
    /// Lifecycles ended by `released`, or complete at a live stage
    /// ([`Outcome::Completed`]).
    pub completed: u64,
    /// Of `completed`, those complete at a live stage, not released.
    pub completed_unreleased: u64,
    /// Lifecycles ended by `failed`.
    pub failed: u64,
    /// Lifecycles ended by `aborted`.
    pub aborted: u64,
    /// `Report::Stalled` emitted.
    pub stalled: u64,
    /// `Report::Recovered` emitted.
    pub recovered: u64,
    /// Lifecycles ended because their process exited.
    pub process_exited: u64,
    /// Lifecycles dropped to stay within `max_tracked`.
    pub evicted: u64,
    /// Lifecycles a resynchronisation found ended in the kernel, their end
    /// event lost ([`Outcome::EndUnseen`]).
    pub end_unseen: u64,
    /// Lifecycles a framework ended when the prefill's lease on their KV
    /// ran out, never read ([`Outcome::LeaseExpired`]).
    pub lease_expired: u64,
    /// Lifecycles that were a read of KV already freed
    /// ([`Outcome::KvReadAfterRelease`]).
    pub kv_read_after_release: u64,
    /// Lifecycles that were a transfer its framework found leaked: never
    /// released once its request ended ([`Outcome::Leaked`]).
    pub leaked: u64,
    /// Resynchronisations with the kernel's in-flight table after events
    /// were lost ([`Engine::resync`](super::Engine::resync)).
    pub resyncs: u64,
    /// Observations ignored as belonging to a lifecycle already over (or
    /// never seen: a terminal event for an unknown request).
    pub stale_events: u64,
    /// Observations ignored as exact repeats (same request, stage and ts):
    /// an event delivered twice.
    pub duplicate_events: u64,
    /// Stage times a record carried that the engine already had from the
    /// kernel's table ([`Engine::observe_carried`](super::Engine::observe_carried)):
    /// expected after a catch-up, ignored, not duplicates.
    pub caught_up_repeats: u64,
    /// Lifecycles taken over from the kernel's in-flight table at start,
    /// or at a resynchronisation after lost events (also counted in `seen`).
    pub restored: u64,
    /// Times the kernel's in-flight entry of a request showed it further
    /// along than the engine knew (events of `quiet` probes): read when its
    /// stall came due, before a query, or before its process's end.
    pub caught_up: u64,
    /// Requests tracked right now.
    pub in_flight: u64,
}
