//! The vocabulary of a lifecycle: where a request is ([`Stage`]), why it is
//! stuck ([`StallClass`]) and how it ended ([`Outcome`]).
//!
//! All three are plain `Copy` enums with stable snake_case names, because
//! those names leave the agent: in alerts, span attributes, metrics labels
//! and CLI filters. Renaming one is a breaking change for whoever matches on
//! it downstream, so the names live in exactly one place (`as_str`) and both
//! `Display` and `FromStr` go through it.

use std::fmt;
use std::str::FromStr;

/// A point in a request's life on the prefill side.
///
/// The derived order is the order of progress: a request's stage only ever
/// moves to a greater one, which is how the engine ignores late or
/// reordered events without moving a request backwards. The three terminal
/// stages sort after every live one, so "the furthest stage" of an ended
/// request is the way it ended.
#[repr(u8)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// The request entered the inflight queue (waiting for the decode side).
    Enqueued = 0,
    /// A KV transfer for it was posted to the transport.
    TransferPosted = 1,
    /// The transport reported the transfer complete.
    TransferDone = 2,
    /// The request left the queue normally. Terminal.
    Released = 3,
    /// The framework aborted it. Terminal.
    Aborted = 4,
    /// The transfer or the request failed. Terminal.
    Failed = 5,
}

impl Stage {
    /// Every stage, in order of progress.
    pub const ALL: [Stage; 6] =
        [Stage::Enqueued, Stage::TransferPosted, Stage::TransferDone, Stage::Released, Stage::Aborted, Stage::Failed];

    /// The live stages, in order: those a request in flight is at.
    pub const LIVE: [Stage; 3] = [Stage::Enqueued, Stage::TransferPosted, Stage::TransferDone];

    /// The stable name used in reports, configuration and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Enqueued => "enqueued",
            Stage::TransferPosted => "transfer_posted",
            Stage::TransferDone => "transfer_done",
            Stage::Released => "released",
            Stage::Aborted => "aborted",
            Stage::Failed => "failed",
        }
    }

    /// Whether this stage ends the lifecycle.
    pub fn is_terminal(self) -> bool {
        matches!(self, Stage::Released | Stage::Aborted | Stage::Failed)
    }

    /// Index into [`RequestSnapshot::stage_ns`](super::RequestSnapshot::stage_ns)
    /// for the four stages that are timestamped there (the main path), `None`
    /// for the side exits.
    pub fn timestamp_slot(self) -> Option<usize> {
        match self {
            Stage::Enqueued | Stage::TransferPosted | Stage::TransferDone | Stage::Released => Some(self as usize),
            Stage::Aborted | Stage::Failed => None,
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not one of [`Stage::ALL`]. The message lists the valid
/// names, because it usually ends up in front of someone editing a probe
/// profile by hand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownStage(pub Box<str>);

impl fmt::Display for UnknownStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown lifecycle stage {:?}; expected one of: ", self.0)?;
        write_names(f, Stage::ALL.iter().map(|s| s.as_str()))
    }
}

impl std::error::Error for UnknownStage {}

impl FromStr for Stage {
    type Err = UnknownStage;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Stage::ALL.into_iter().find(|stage| stage.as_str() == s).ok_or_else(|| UnknownStage(s.into()))
    }
}

/// A set of stages, one bit each: which stages of a request were inferred
/// (read from the target's memory) rather than seen by a probe.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct StageSet(u8);

impl StageSet {
    pub const EMPTY: StageSet = StageSet(0);

    pub fn contains(self, stage: Stage) -> bool {
        self.0 & (1 << stage as u8) != 0
    }

    pub fn insert(&mut self, stage: Stage) {
        self.0 |= 1 << stage as u8;
    }

    pub fn remove(&mut self, stage: Stage) {
        self.0 &= !(1 << stage as u8);
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The stages in the set, in order of progress.
    pub fn iter(self) -> impl Iterator<Item = Stage> {
        Stage::ALL.into_iter().filter(move |stage| self.contains(*stage))
    }
}

/// Where a stalled request stopped, which is what the on-call engineer needs
/// first: it says which side (or which layer) to look at.
#[repr(u8)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StallClass {
    /// Enqueued, never posted: the decode side never sent its destination
    /// (or died across a restart).
    WaitingForPeer = 0,
    /// Posted, never completed: the transfer itself hangs.
    TransferHung = 1,
    /// Completed, never released: typically an abort that raced a chunk.
    ReleaseLost = 2,
    /// On the decode side: the request asked for its KV (sent its
    /// destination) and it never arrived. The decode waits on the prefill,
    /// whose own span of the same request (one trace) says where it stopped.
    WaitingForKv = 3,
}

/// Which side of the KV transfer a process serves: the prefill sends the
/// KV, the decode waits for it. A request silent at `enqueued` means the
/// prefill waits on its decode, or the decode on its prefill.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Side {
    #[default]
    Prefill,
    Decode,
}

impl Side {
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }
}

impl StallClass {
    /// Every class, in order of the stage it stops at.
    pub const ALL: [StallClass; 4] =
        [StallClass::WaitingForPeer, StallClass::TransferHung, StallClass::ReleaseLost, StallClass::WaitingForKv];

    /// The stable name used in reports, configuration and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            StallClass::WaitingForPeer => "waiting_for_peer",
            StallClass::TransferHung => "transfer_hung",
            StallClass::ReleaseLost => "release_lost",
            StallClass::WaitingForKv => "waiting_for_kv",
        }
    }

    /// The class of a request silent at `stage`; `None` for terminal stages
    /// (an ended request cannot stall).
    pub fn for_stage(stage: Stage) -> Option<StallClass> {
        match stage {
            Stage::Enqueued => Some(StallClass::WaitingForPeer),
            Stage::TransferPosted => Some(StallClass::TransferHung),
            Stage::TransferDone => Some(StallClass::ReleaseLost),
            Stage::Released | Stage::Aborted | Stage::Failed => None,
        }
    }

    /// The class of a request silent at `stage` in a process on `side`:
    /// a decode silent at `enqueued` waits for its KV.
    pub fn on_side(stage: Stage, side: Side) -> Option<StallClass> {
        match (side, stage) {
            (Side::Decode, Stage::Enqueued) => Some(StallClass::WaitingForKv),
            _ => StallClass::for_stage(stage),
        }
    }

    pub(crate) fn from_bits(bits: u8) -> StallClass {
        match bits {
            0 => StallClass::WaitingForPeer,
            1 => StallClass::TransferHung,
            2 => StallClass::ReleaseLost,
            _ => StallClass::WaitingForKv,
        }
    }
}

impl fmt::Display for StallClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not one of [`StallClass::ALL`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownStallClass(pub Box<str>);

impl fmt::Display for UnknownStallClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown stall class {:?}; expected one of: ", self.0)?;
        write_names(f, StallClass::ALL.iter().map(|c| c.as_str()))
    }
}

impl std::error::Error for UnknownStallClass {}

impl FromStr for StallClass {
    type Err = UnknownStallClass;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        StallClass::ALL.into_iter().find(|class| class.as_str() == s).ok_or_else(|| UnknownStallClass(s.into()))
    }
}

/// How a tracked lifecycle ended. Every tracked request ends in exactly one.
#[repr(u8)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// A `released` event.
    Released,
    /// An event at a live stage that ends the lifecycle there (its probe's
    /// profile has `complete_at = "transfer_done"`: the framework releases
    /// lazily, so done is complete), or such a stage read from memory.
    Completed,
    /// An `aborted` event.
    Aborted,
    /// A `failed` event.
    Failed,
    /// The process holding it went away ([`Engine::process_exited`](super::Engine::process_exited)).
    ProcessExited,
    /// The engine dropped it to stay within `max_tracked`.
    Evicted,
    /// Its end was never seen: events were lost (the ring buffer was
    /// full), and the kernel's in-flight table, read to resynchronise, no
    /// longer holds it (or holds a later lifecycle of its key). It ended;
    /// how is not known, so it is neither completed nor failed.
    EndUnseen,
    /// A framework's judgement, not an event of the target: the prefill
    /// freed the request's KV when the lease its framework gives a decode
    /// to read it ran out, and no decode had read it (vLLM's
    /// `kv_lease_duration`). It ends the lifecycle where it stands; a
    /// stalled request ends stalled.
    LeaseExpired,
    /// A decode read the request's KV after its prefill had freed it (its
    /// lease had expired, or the prefill had released it): the decode
    /// served tokens from blocks that may hold another request's KV. On
    /// the decode, its READ's end; on the prefill, the notification of
    /// that READ, a lifecycle of its own.
    KvReadAfterRelease,
    /// A transfer (a NIXL handle, a Mooncake batch) of a request that
    /// ended, never released when it should have been: its registered
    /// memory and descriptors are held for good, and it may still write
    /// into its peer's pages. A framework's judgement, a lifecycle of its
    /// own (the transfer's), so its request's outcome stands as it was and
    /// the leak is counted and alerted apart (`leaked`).
    Leaked,
}

impl Outcome {
    /// Every outcome.
    pub const ALL: [Outcome; 10] = [
        Outcome::Released,
        Outcome::Completed,
        Outcome::Aborted,
        Outcome::Failed,
        Outcome::ProcessExited,
        Outcome::Evicted,
        Outcome::EndUnseen,
        Outcome::LeaseExpired,
        Outcome::KvReadAfterRelease,
        Outcome::Leaked,
    ];

    /// The stable name used in reports and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Released => "released",
            Outcome::Completed => "completed",
            Outcome::Aborted => "aborted",
            Outcome::Failed => "failed",
            Outcome::ProcessExited => "process_exited",
            Outcome::Evicted => "evicted",
            Outcome::EndUnseen => "end_unseen",
            Outcome::LeaseExpired => "lease_expired",
            Outcome::KvReadAfterRelease => "kv_read_after_release",
            Outcome::Leaked => "leaked",
        }
    }

    /// The outcome of an event at `stage` that `ends` the lifecycle (see
    /// [`Observation::ends`](super::Observation::ends)) or is terminal;
    /// `None` for one that leaves it live.
    /// A terminal stage says more than [`Outcome::Completed`] (a release
    /// after `complete_at` is a release); a framework's own outcome says
    /// more than the stage.
    pub fn of_event(stage: Stage, ends: Option<Outcome>) -> Option<Outcome> {
        match ends {
            None | Some(Outcome::Completed) => Outcome::for_stage(stage).or(ends),
            Some(outcome) => Some(outcome),
        }
    }

    /// Whether an observation ending a lifecycle with this outcome is a
    /// judgement of the agent's, not the target's activity: it ends the
    /// request as it stands, never reviving a stalled one.
    pub fn is_judgement(self) -> bool {
        matches!(self, Outcome::LeaseExpired | Outcome::Leaked)
    }

    /// The outcome a terminal stage means; `None` for live stages.
    pub fn for_stage(stage: Stage) -> Option<Outcome> {
        match stage {
            Stage::Released => Some(Outcome::Released),
            Stage::Aborted => Some(Outcome::Aborted),
            Stage::Failed => Some(Outcome::Failed),
            Stage::Enqueued | Stage::TransferPosted | Stage::TransferDone => None,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn write_names<'a>(f: &mut fmt::Formatter<'_>, names: impl Iterator<Item = &'a str>) -> fmt::Result {
    for (i, name) in names.enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        f.write_str(name)?;
    }
    Ok(())
}
