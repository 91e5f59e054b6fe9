//! Storage for tracked requests: one flat `Vec` of fixed-size records
//! addressed by `u32` index, with a free list, and intrusive circular
//! doubly-linked lists threaded through the records.
//!
//! Why this shape:
//! - Every other structure (the hash index, the timer wheel, the stalled
//!   list) refers to a request by a 4-byte index instead of owning or
//!   copying it, which is most of what keeps a tracked request under a
//!   hundred bytes at a million in flight.
//! - A request is in exactly one list at a time (a wheel bucket while it
//!   waits for its deadline, the stalled list while its alert is out), so one
//!   pair of `prev`/`next` links serves both, and leaving a list is O(1)
//!   wherever the request is. That is what lets an ended request take its
//!   timer with it: the wheel never holds an entry for a request that is not
//!   tracked, so a reused slot or a reused key can never inherit a timer.
//! - Free slots are reused LIFO, so a steady churn of lifecycles keeps
//!   touching the same warm memory.

use super::report::{RequestSnapshot, Silent, Withheld};
use super::stage::{Stage, StageSet, StallClass};

/// "No record": the end of a list, an empty bucket.
pub(crate) const NIL: u32 = u32::MAX;

/// The most records a slab can hold (indices are `u32`, `NIL` reserved).
pub(crate) const MAX_RECORDS: usize = (u32::MAX - 1) as usize;

/// Which list a record is on.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Not a tracked request: on the free list.
    Free,
    /// Tracked, waiting in a timer-wheel bucket (`Record::bucket`).
    Wheel,
    /// Tracked, reported stalled with this class, on the stalled list.
    Stalled(StallClass),
    /// Tracked but momentarily on no list (being moved or ended).
    Detached,
}

// Layout of `Record::flags`: four "stage timestamp present" bits, then the
// place, then the stall class. Packed so that the record stays at 88 bytes.
const SEEN_MASK: u8 = 0b0000_1111;
const PLACE_SHIFT: u8 = 4;
const PLACE_MASK: u8 = 0b0011_0000;
const CLASS_SHIFT: u8 = 6;

// Layout of `Record::stage_bits`: the stage (three bits), then an
// "inferred" bit for each of the three live stages (their time is when the
// target's memory was read, not a probe's). Packed for the same reason.
const STAGE_MASK: u8 = 0b0000_0111;
const INFERRED_SHIFT: u8 = 3;

/// One tracked request (or a free slot).
///
/// `repr(C)` to fix the order: what the index compares on every lookup
/// (key, pid) and what every event reads or writes (flags, stage, last_ns,
/// first_ns, stage_ns) come first and together, so an event touches as few
/// cache lines as the 88 bytes allow; the list links, used only when the
/// request is armed, moved or ended, come last.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Record {
    pub(crate) key: u64,
    pub(crate) pid: u32,
    /// The furthest stage and which live stages were inferred: see
    /// [`Record::stage`] and [`Record::inferred`].
    stage_bits: u8,
    flags: u8,
    /// The wheel bucket this record is linked into while `Place::Wheel`
    /// (wheels have at most 2^16 buckets).
    pub(crate) bucket: u16,
    pub(crate) last_ns: u64,
    pub(crate) first_ns: u64,
    /// Valid where the matching bit of `flags & SEEN_MASK` is set.
    stage_ns: [u64; 4],
    pub(crate) external_id: Option<Box<str>>,
    pub(crate) prev: u32,
    pub(crate) next: u32,
}

impl Record {
    /// A new lifecycle whose first event is `stage` at `ts_ns`.
    pub(crate) fn new(pid: u32, key: u64, stage: Stage, ts_ns: u64, external_id: Option<Box<str>>) -> Record {
        let mut rec = Record {
            key,
            first_ns: ts_ns,
            last_ns: ts_ns,
            stage_ns: [0; 4],
            external_id,
            pid,
            prev: NIL,
            next: NIL,
            stage_bits: stage as u8,
            flags: 0,
            bucket: 0,
        };
        rec.set_place(Place::Detached);
        rec.note_stage_ts(stage, ts_ns);
        rec
    }

    /// A lifecycle taken over from the kernel's in-flight table, with the
    /// stage times it recorded (index = `stage as usize`, main path only).
    pub(crate) fn restored(
        pid: u32,
        key: u64,
        stage: Stage,
        (first_ns, last_ns): (u64, u64),
        stage_ns: [Option<u64>; 4],
        external_id: Option<Box<str>>,
    ) -> Record {
        let mut rec = Record::new(pid, key, stage, first_ns, external_id);
        rec.last_ns = last_ns;
        rec.flags &= !SEEN_MASK;
        for (i, ns) in stage_ns.iter().enumerate() {
            if let Some(ns) = ns {
                rec.flags |= 1 << i;
                rec.stage_ns[i] = *ns;
            }
        }
        rec
    }

    /// The furthest stage reached.
    pub(crate) fn stage(&self) -> Stage {
        Stage::ALL[usize::from(self.stage_bits & STAGE_MASK)]
    }

    pub(crate) fn set_stage(&mut self, stage: Stage) {
        self.stage_bits = (self.stage_bits & !STAGE_MASK) | stage as u8;
    }

    /// The live stages whose time was inferred from a read of the target's
    /// memory (the read's time) rather than seen by a probe.
    pub(crate) fn inferred(&self) -> StageSet {
        let mut set = StageSet::EMPTY;
        for stage in Stage::LIVE {
            if self.stage_bits & (1 << (INFERRED_SHIFT + stage as u8)) != 0 {
                set.insert(stage);
            }
        }
        set
    }

    pub(crate) fn stage_ts(&self, stage: Stage) -> Option<u64> {
        let i = stage.timestamp_slot()?;
        (self.flags & (1 << i) != 0).then(|| self.stage_ns[i])
    }

    /// Record when `stage` was seen, unless it already has a time: the
    /// snapshot says when the engine first learned of each stage. A probe's
    /// time replaces an inferred one.
    pub(crate) fn note_stage_ts(&mut self, stage: Stage, ts_ns: u64) {
        if let Some(i) = stage.timestamp_slot() {
            // Only live stages are ever inferred; Released's bit stays clear.
            let inferred = 1 << (INFERRED_SHIFT + stage as u8);
            if self.flags & (1 << i) == 0 || self.stage_bits & inferred != 0 {
                self.flags |= 1 << i;
                self.stage_ns[i] = ts_ns;
                self.stage_bits &= !inferred;
            }
        }
    }

    /// What a reader of its state (the target's memory, the kernel's
    /// table) is told of the request.
    pub(crate) fn silent(&self) -> Silent {
        Silent { pid: self.pid, key: self.key, stage: self.stage(), first_ns: self.first_ns, last_ns: self.last_ns }
    }

    /// Apply what the kernel holds of the request beyond what the engine
    /// was sent (`quiet` probes' events): probe events at their times.
    pub(crate) fn catch_up(&mut self, seen: &Withheld) {
        for stage in Stage::LIVE {
            if let Some(ns) = seen.stage_ns[stage as usize] {
                self.note_stage_ts(stage, ns);
            }
        }
        self.set_stage(self.stage().max(seen.stage));
        self.last_ns = self.last_ns.max(seen.last_ns);
    }

    /// A live stage the target's memory says was reached by `at_ns`, which
    /// no probe saw: timed at the read and marked inferred. Not activity.
    pub(crate) fn infer_stage(&mut self, stage: Stage, at_ns: u64) {
        debug_assert!(!stage.is_terminal());
        if stage.is_terminal() || stage <= self.stage() {
            return;
        }
        self.set_stage(stage);
        if self.stage_ts(stage).is_none() {
            self.note_stage_ts(stage, at_ns);
            self.stage_bits |= 1 << (INFERRED_SHIFT + stage as u8);
        }
    }

    pub(crate) fn place(&self) -> Place {
        match (self.flags & PLACE_MASK) >> PLACE_SHIFT {
            0 => Place::Free,
            1 => Place::Wheel,
            2 => Place::Stalled(StallClass::from_bits(self.flags >> CLASS_SHIFT)),
            _ => Place::Detached,
        }
    }

    pub(crate) fn set_place(&mut self, place: Place) {
        let (p, class) = match place {
            Place::Free => (0, 0),
            Place::Wheel => (1, 0),
            Place::Stalled(c) => (2, c as u8),
            Place::Detached => (3, 0),
        };
        self.flags = (self.flags & SEEN_MASK) | (p << PLACE_SHIFT) | (class << CLASS_SHIFT);
    }

    pub(crate) fn stalled(&self) -> Option<StallClass> {
        match self.place() {
            Place::Stalled(c) => Some(c),
            _ => None,
        }
    }

    /// A copy of what is known, for reports and queries.
    pub(crate) fn snapshot(&self) -> RequestSnapshot {
        RequestSnapshot {
            pid: self.pid,
            key: self.key,
            external_id: self.external_id.clone(),
            stage: self.stage(),
            stage_ns: [
                self.stage_ts(Stage::Enqueued),
                self.stage_ts(Stage::TransferPosted),
                self.stage_ts(Stage::TransferDone),
                self.stage_ts(Stage::Released),
            ],
            first_ns: self.first_ns,
            last_ns: self.last_ns,
            stalled: self.stalled(),
            inferred: self.inferred(),
        }
    }
}

/// The record store. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Slab {
    slots: Vec<Record>,
    free_head: u32,
    live: usize,
}

impl Slab {
    pub(crate) fn new() -> Slab {
        Slab { slots: Vec::new(), free_head: NIL, live: 0 }
    }

    /// Tracked records.
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// Store `rec`, returning its index. `None` only if the slab already
    /// holds [`MAX_RECORDS`] (the engine caps `max_tracked` below that).
    pub(crate) fn alloc(&mut self, rec: Record) -> Option<u32> {
        let i = if self.free_head != NIL {
            let i = self.free_head;
            let slot = &mut self.slots[i as usize];
            self.free_head = slot.next;
            *slot = rec;
            i
        } else {
            if self.slots.len() >= MAX_RECORDS {
                return None;
            }
            let i = self.slots.len() as u32;
            self.slots.push(rec);
            i
        };
        self.live += 1;
        Some(i)
    }

    /// Return record `i` (already off every list) to the free list.
    pub(crate) fn free(&mut self, i: u32) {
        let slot = &mut self.slots[i as usize];
        debug_assert!(matches!(slot.place(), Place::Detached));
        slot.external_id = None;
        slot.set_place(Place::Free);
        slot.prev = NIL;
        slot.next = self.free_head;
        self.free_head = i;
        self.live -= 1;
    }

    pub(crate) fn get(&self, i: u32) -> &Record {
        &self.slots[i as usize]
    }

    pub(crate) fn get_mut(&mut self, i: u32) -> &mut Record {
        &mut self.slots[i as usize]
    }

    pub(crate) fn records(&self) -> &[Record] {
        &self.slots
    }

    pub(crate) fn records_mut(&mut self) -> &mut [Record] {
        &mut self.slots
    }

    /// Every tracked record with its index.
    pub(crate) fn live(&self) -> impl Iterator<Item = (u32, &Record)> + '_ {
        self.slots.iter().enumerate().filter(|(_, r)| r.place() != Place::Free).map(|(i, r)| (i as u32, r))
    }
}

/// Append record `i` to the circular list whose head is `*head`.
pub(crate) fn push_back(recs: &mut [Record], head: &mut u32, i: u32) {
    if *head == NIL {
        let r = &mut recs[i as usize];
        r.prev = i;
        r.next = i;
        *head = i;
    } else {
        let h = *head;
        let tail = recs[h as usize].prev;
        recs[i as usize].prev = tail;
        recs[i as usize].next = h;
        recs[tail as usize].next = i;
        recs[h as usize].prev = i;
    }
}

/// Take record `i` off the circular list whose head is `*head`.
pub(crate) fn unlink(recs: &mut [Record], head: &mut u32, i: u32) {
    let (prev, next) = {
        let r = &recs[i as usize];
        (r.prev, r.next)
    };
    if next == i {
        *head = NIL;
    } else {
        recs[prev as usize].next = next;
        recs[next as usize].prev = prev;
        if *head == i {
            *head = next;
        }
    }
    let r = &mut recs[i as usize];
    r.prev = NIL;
    r.next = NIL;
}

/// A list with its own head: the stalled list, oldest stall first.
#[derive(Debug)]
pub(crate) struct List {
    head: u32,
}

impl List {
    pub(crate) fn new() -> List {
        List { head: NIL }
    }

    pub(crate) fn first(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    pub(crate) fn push_back(&mut self, recs: &mut [Record], i: u32) {
        push_back(recs, &mut self.head, i);
    }

    pub(crate) fn unlink(&mut self, recs: &mut [Record], i: u32) {
        unlink(recs, &mut self.head, i);
    }
}
