//! The hashed timer wheel that finds silent requests without scanning them.
//!
//! A request's deadline is `last_ns + timeout`. The wheel has a power-of-two
//! number of buckets, one per tick of `tick_ns`; a request waits in the
//! bucket of `deadline / tick_ns` (modulo the size), linked through its own
//! record ([`super::slab`]), so it costs no allocation and at most one entry.
//!
//! **Lazy re-arming.** An event only moves `last_ns` forward; it does not
//! touch the wheel. When a bucket comes due, each entry recomputes its real
//! deadline from `last_ns`: if that has passed it fires, otherwise it is
//! re-linked into the bucket of the real deadline. A busy request therefore
//! costs one wheel move per timeout period at most, not one per event.
//!
//! **Exactness.** Each bucket remembers a lower bound of the deadlines put
//! into it (`min_deadline`). `advance(now)` visits the buckets of the ticks
//! crossed since the last call and processes one only if that bound is
//! `<= now`, so the bucket of the current, partly elapsed tick is looked at
//! only when something in it is really due. The result is that a request
//! fires at the first `advance(now)` with `now >= deadline`: never before the
//! timeout, and no later than one advance interval after it (so by
//! `timeout + tick` when `advance` runs every tick, whatever its phase).
//!
//! **Bounded work.** `advance` visits `min(ticks crossed + 1, size)` buckets,
//! skipping empty ones through an occupancy bitmap (one word per 64), plus
//! the entries of the buckets that are due. A jump of hours costs one lap,
//! not hours of ticks.
//! When `timeout / tick` exceeds the largest wheel (2^16 buckets), deadlines
//! more than one lap away wait in their bucket and are passed over (one look
//! per lap) until their lap comes, as in any hashed wheel.
//!
//! The wheel also answers "who has been silent longest" for eviction: the
//! earliest non-empty bucket from the cursor holds the earliest deadlines.

use super::slab::{self, NIL, Place, Record};

/// Largest wheel: bucket numbers fit the record's `u16`.
const MAX_BUCKETS: usize = 1 << 16;
/// Smallest wheel: the bitmap works in whole words.
const MIN_BUCKETS: usize = 64;

#[derive(Debug)]
pub(crate) struct Wheel {
    tick_ns: u64,
    timeout_ns: u64,
    mask: u64,
    heads: Box<[u32]>,
    /// Lower bound of the deadlines linked into each bucket (`u64::MAX`
    /// when none is known); reset whenever the bucket is processed.
    min_deadline: Box<[u64]>,
    /// Bit `b` set iff bucket `b` is non-empty.
    occupied: Box<[u64]>,
    /// The tick of the latest `advance` (or of the first event seen).
    /// Buckets of earlier ticks hold no entry of their lap.
    cursor: u64,
    started: bool,
}

impl Wheel {
    pub(crate) fn new(tick_ns: u64, timeout_ns: u64) -> Wheel {
        let tick_ns = tick_ns.max(1);
        // One lap covers the whole timeout (plus the partly elapsed current
        // tick and one more), so normally no entry waits more than a lap.
        let ticks = (timeout_ns / tick_ns).saturating_add(2);
        let size = usize::try_from(ticks).unwrap_or(MAX_BUCKETS).clamp(MIN_BUCKETS, MAX_BUCKETS).next_power_of_two();
        Wheel {
            tick_ns,
            timeout_ns,
            mask: (size - 1) as u64,
            heads: vec![NIL; size].into_boxed_slice(),
            min_deadline: vec![u64::MAX; size].into_boxed_slice(),
            occupied: vec![0; size / 64].into_boxed_slice(),
            cursor: 0,
            started: false,
        }
    }

    fn size(&self) -> usize {
        self.heads.len()
    }

    /// Anchor the cursor at the first time the engine hears of (an event or
    /// an advance), so that the first `advance` does not walk from tick 0
    /// and lap arithmetic is relative to real time.
    pub(crate) fn start(&mut self, now_ns: u64) {
        if !self.started {
            self.started = true;
            self.cursor = now_ns / self.tick_ns;
        }
    }

    pub(crate) fn deadline_of(&self, rec: &Record) -> u64 {
        rec.last_ns.saturating_add(self.timeout_ns)
    }

    /// The tick a deadline waits for: never behind the cursor, because the
    /// buckets behind it have already been walked for this lap.
    fn tick_of(&self, deadline: u64) -> u64 {
        (deadline / self.tick_ns).max(self.cursor)
    }

    /// Link record `i` (on no list) for `deadline`.
    pub(crate) fn insert(&mut self, recs: &mut [Record], i: u32, deadline: u64) {
        let b = (self.tick_of(deadline) & self.mask) as usize;
        let lowest = &mut self.min_deadline[b];
        *lowest = (*lowest).min(deadline);
        slab::push_back(recs, &mut self.heads[b], i);
        self.occupied[b / 64] |= 1 << (b % 64);
        let r = &mut recs[i as usize];
        r.bucket = b as u16;
        r.set_place(Place::Wheel);
    }

    /// Unlink record `i`, which is on the wheel.
    pub(crate) fn remove(&mut self, recs: &mut [Record], i: u32) {
        let b = recs[i as usize].bucket as usize;
        slab::unlink(recs, &mut self.heads[b], i);
        if self.heads[b] == NIL {
            self.occupied[b / 64] &= !(1 << (b % 64));
        }
        recs[i as usize].set_place(Place::Detached);
    }

    /// The first non-empty bucket at an offset in `from..limit` from bucket
    /// `start` (`limit <= size`), as an offset. Reads one bitmap word per 64
    /// buckets of the range at most.
    fn next_occupied(&self, start: usize, from: usize, limit: usize) -> Option<usize> {
        let mask = self.size() - 1;
        let mut off = from;
        while off < limit {
            let pos = (start + off) & mask;
            let bit = pos % 64;
            // The rest of this word is contiguous bucket numbers: a word
            // never straddles the wrap because the size is a multiple of 64.
            let bits = self.occupied[pos / 64] >> bit;
            if bits != 0 {
                let found = off + bits.trailing_zeros() as usize;
                return (found < limit).then_some(found);
            }
            off += 64 - bit;
        }
        None
    }

    /// Fire every entry whose deadline is `<= now_ns`: `fire` gets each one
    /// detached (on no list) and must put it somewhere.
    pub(crate) fn advance(&mut self, recs: &mut [Record], now_ns: u64, mut fire: impl FnMut(&mut [Record], u32)) {
        self.start(now_ns);
        let old = self.cursor;
        let target = now_ns / self.tick_ns;
        // A clock that went backwards cannot un-walk buckets; the current
        // bucket is still checked, for entries armed in the past.
        let crossed = target.saturating_sub(old);
        self.cursor = old.max(target);
        let size = self.size();
        let visits = usize::try_from(crossed).map_or(size, |c| c.saturating_add(1)).min(size);
        let start = (old & self.mask) as usize;
        let mut off = 0;
        while let Some(found) = self.next_occupied(start, off, visits) {
            let b = (start + found) & (size - 1);
            if self.min_deadline[b] <= now_ns {
                self.process(recs, b, now_ns, &mut fire);
            }
            off = found + 1;
        }
    }

    /// The first time, a tick boundary, at which [`Self::advance`] would
    /// process a bucket: the end of the tick holding the earliest deadline
    /// bound, or the cursor's own tick for entries armed in the past. So a
    /// caller that sleeps until then wakes once per tick that holds
    /// deadlines, however many, and never misses one. Lazy re-arming makes
    /// it an early answer at worst (the entry moves on and the next answer
    /// is later), never a late one.
    pub(crate) fn next_due_ns(&self) -> Option<u64> {
        let size = self.size();
        let start = (self.cursor & self.mask) as usize;
        let mut best: Option<u64> = None;
        let mut off = 0;
        while let Some(found) = self.next_occupied(start, off, size) {
            let begins = self.cursor.saturating_add(found as u64).saturating_mul(self.tick_ns);
            // Later buckets begin later: only one on a later lap of its
            // own (a timeout of more than 2^16 ticks) lets them win.
            if best.is_some_and(|best| begins >= best) {
                break;
            }
            let due = begins.max(self.min_deadline[(start + found) & (size - 1)]);
            let due = due.div_ceil(self.tick_ns).saturating_mul(self.tick_ns);
            best = Some(best.map_or(due, |best| best.min(due)));
            off = found + 1;
        }
        best
    }

    /// Walk bucket `b`: fire what is due, re-link the rest at their real
    /// deadline (possibly back into `b` itself, for a later lap).
    fn process(&mut self, recs: &mut [Record], b: usize, now_ns: u64, fire: &mut impl FnMut(&mut [Record], u32)) {
        let head = std::mem::replace(&mut self.heads[b], NIL);
        self.occupied[b / 64] &= !(1 << (b % 64));
        self.min_deadline[b] = u64::MAX;
        if head == NIL {
            return;
        }
        // The detached list is walked from head to its tail; each node's
        // `next` is read before the node is re-linked elsewhere.
        let tail = recs[head as usize].prev;
        let mut cur = head;
        loop {
            let next = recs[cur as usize].next;
            let last = cur == tail;
            let rec = &mut recs[cur as usize];
            let deadline = rec.last_ns.saturating_add(self.timeout_ns);
            // Due when the silence has reached the timeout. (Not
            // `deadline <= now`: a deadline that saturated at u64::MAX would
            // then fire early at now == u64::MAX. And not a saturating
            // difference: with a zero timeout a clock behind the event
            // would count as silence.)
            let due = now_ns.checked_sub(rec.last_ns).is_some_and(|silent| silent >= self.timeout_ns);
            rec.set_place(Place::Detached);
            if due {
                fire(recs, cur);
            } else {
                self.insert(recs, cur, deadline);
            }
            if last {
                break;
            }
            cur = next;
        }
    }

    /// The entry silent longest, to within a tick: the first entry (in arm
    /// order) of the earliest bucket whose real deadline is in that bucket's
    /// tick. Entries found there with a later real deadline (they had events
    /// since they were armed) are moved to their real bucket on the way,
    /// which is work their events already paid for.
    pub(crate) fn oldest(&mut self, recs: &mut [Record]) -> Option<u32> {
        let size = self.size();
        let start = (self.cursor & self.mask) as usize;
        let mut fallback: Option<(u64, u32)> = None;
        let mut off = 0;
        while let Some(found) = self.next_occupied(start, off, size) {
            let b = (start + found) & (size - 1);
            let lap_tick = self.cursor.saturating_add(found as u64);
            let head = self.heads[b];
            let tail = recs[head as usize].prev;
            let mut cur = head;
            loop {
                let next = recs[cur as usize].next;
                let last = cur == tail;
                let deadline = self.deadline_of(&recs[cur as usize]);
                let tick = self.tick_of(deadline);
                if tick <= lap_tick {
                    return Some(cur);
                }
                if (tick & self.mask) as usize != b {
                    self.remove(recs, cur);
                    self.insert(recs, cur, deadline);
                }
                // Only entries on a later lap of their bucket get here more
                // than once per scan; remember the earliest of them in case
                // every entry is on a later lap.
                if fallback.is_none_or(|(t, _)| tick < t) {
                    fallback = Some((tick, cur));
                }
                if last {
                    break;
                }
                cur = next;
            }
            off = found + 1;
        }
        fallback.map(|(_, i)| i)
    }
}
