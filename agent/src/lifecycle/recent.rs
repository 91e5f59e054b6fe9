//! A bounded memory of what ended recently, to tell a late event of a
//! finished lifecycle from the first event of a new one.
//!
//! Events reach the agent slightly out of order (per-CPU timestamps, ring
//! buffer batching), so the `transfer_done` of a request can be read after
//! its `released`; and NIXL's allocator hands the same handle address to the
//! next request right after a release. Without a record of the end, the late
//! event would start a phantom lifecycle that never completes and, a timeout
//! later, raise a false stall. With it, an event for an ended (pid, key) with
//! a timestamp at or before the end is stale, and a later one is key reuse.
//!
//! The record is a ring of the last `capacity` ends plus a hash index into
//! it, so a lookup is O(1) and memory is fixed; when the ring wraps, the
//! oldest end is forgotten. Late events arrive within milliseconds, so a ring
//! that holds the last tens of thousands of ends covers them with a wide
//! margin at any realistic request rate.

use hashbrown::HashTable;

use super::index::Mixer;

/// What a log can be keyed by.
pub(crate) trait LogKey: Copy + Eq {
    fn hash(&self, mixer: Mixer) -> u64;
}

/// A (pid, key) request identity.
impl LogKey for (u32, u64) {
    fn hash(&self, mixer: Mixer) -> u64 {
        mixer.hash(self.0, self.1)
    }
}

/// A pid.
impl LogKey for u32 {
    fn hash(&self, mixer: Mixer) -> u64 {
        // Distinct from any (pid, key) hash is not needed: separate tables.
        mixer.hash(*self, u64::MAX)
    }
}

#[derive(Debug)]
struct Entry<K> {
    key: K,
    at_ns: u64,
    live: bool,
}

/// The last `capacity` (key, time) pairs recorded, newest time per key.
#[derive(Debug)]
pub(crate) struct RecentLog<K> {
    ring: Vec<Entry<K>>,
    capacity: usize,
    next: usize,
    index: HashTable<u32>,
    mixer: Mixer,
}

impl<K: LogKey> RecentLog<K> {
    /// `capacity` is clamped to at least 1 (and to `u32` indices).
    pub(crate) fn new(capacity: usize, mixer: Mixer) -> RecentLog<K> {
        RecentLog {
            ring: Vec::new(),
            capacity: capacity.clamp(1, u32::MAX as usize),
            next: 0,
            index: HashTable::new(),
            mixer,
        }
    }

    /// When `key` was last recorded, if it is still remembered.
    pub(crate) fn get(&self, key: K) -> Option<u64> {
        if self.index.is_empty() {
            return None;
        }
        let ring = &self.ring;
        self.index.find(key.hash(self.mixer), |&i| ring[i as usize].key == key).map(|&i| ring[i as usize].at_ns)
    }

    /// Remember that `key` ended at `at_ns`. A key recorded again moves to
    /// the newest position (keeping the later of the two times), so a key
    /// that is reused over and over is never the one forgotten first.
    pub(crate) fn record(&mut self, key: K, at_ns: u64) {
        let mixer = self.mixer;
        let hash = key.hash(mixer);
        let mut at_ns = at_ns;
        let ring = &mut self.ring;
        if let Ok(entry) = self.index.find_entry(hash, |&i| ring[i as usize].key == key) {
            let (i, _) = entry.remove();
            let old = &mut ring[i as usize];
            old.live = false;
            at_ns = at_ns.max(old.at_ns);
        }
        let pos = self.next;
        self.next = (pos + 1) % self.capacity;
        let fresh = Entry { key, at_ns, live: true };
        if pos == ring.len() {
            ring.push(fresh);
        } else {
            let old = std::mem::replace(&mut ring[pos], fresh);
            if old.live {
                if let Ok(entry) = self.index.find_entry(old.key.hash(mixer), |&i| i as usize == pos) {
                    entry.remove();
                }
            }
        }
        let ring = &self.ring;
        self.index.insert_unique(hash, pos as u32, |&i| ring[i as usize].key.hash(mixer));
    }

    /// Keys remembered right now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }
}
