//! Hashing: the (pid, key) -> record index, and the per-pid request counts.
//!
//! The index is a `hashbrown::HashTable<u32>`: it stores only the 4-byte
//! record index and compares against the record itself, so the table costs
//! about 5 bytes per bucket (value plus control byte) instead of the 25 of a
//! `HashMap<(u32, u64), u32>`, whose key would be stored a second time
//! beside the record. At a million requests that is ~10 MB instead of
//! ~50 MB. `hashbrown` is already in the agent's dependency tree (through
//! aya), so it adds nothing to the build.
//!
//! The hash is a seeded folded multiply written here (two 64x64->128-bit
//! multiplies): keys are user-space addresses, mostly multiples of 8 or 64,
//! and a folded multiply spreads those low zero bits across the whole word,
//! which the table's 7-bit tags and bucket bits both need. The seed is drawn
//! from std's `RandomState` per engine, so which addresses collide is not a
//! fixed property a traced process's allocator could fall into every run.

use std::hash::{BuildHasher, Hasher};

use hashbrown::HashTable;

use super::slab::Record;

const K0: u64 = 0x9E37_79B9_7F4A_7C15;
const K1: u64 = 0xD6E8_FEB8_6659_FD93;

#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// A seeded hash of (pid, key).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mixer {
    s0: u64,
    s1: u64,
}

impl Mixer {
    pub(crate) fn new() -> Mixer {
        let state = std::collections::hash_map::RandomState::new();
        let draw = |n: u64| {
            let mut h = state.build_hasher();
            h.write_u64(n);
            h.finish()
        };
        Mixer { s0: draw(0), s1: draw(1) }
    }

    #[inline]
    pub(crate) fn hash(self, pid: u32, key: u64) -> u64 {
        let wide_pid = u64::from(pid) | (u64::from(pid) << 32);
        let h = fold(key ^ self.s0, (wide_pid ^ self.s1) | 1);
        fold(h ^ K0, K1)
    }
}

/// (pid, key) -> index of the tracked record.
#[derive(Debug)]
pub(crate) struct Index {
    table: HashTable<u32>,
    mixer: Mixer,
}

impl Index {
    pub(crate) fn new(mixer: Mixer) -> Index {
        Index { table: HashTable::new(), mixer }
    }

    pub(crate) fn find(&self, recs: &[Record], pid: u32, key: u64) -> Option<u32> {
        let hash = self.mixer.hash(pid, key);
        self.table
            .find(hash, |&i| {
                let r = &recs[i as usize];
                r.pid == pid && r.key == key
            })
            .copied()
    }

    /// Index record `i` (whose (pid, key) must not be indexed yet).
    pub(crate) fn insert(&mut self, recs: &[Record], i: u32) {
        let r = &recs[i as usize];
        let mixer = self.mixer;
        self.table.insert_unique(mixer.hash(r.pid, r.key), i, |&j| {
            let r = &recs[j as usize];
            mixer.hash(r.pid, r.key)
        });
    }

    /// Forget record `i`.
    pub(crate) fn remove(&mut self, recs: &[Record], i: u32) {
        let r = &recs[i as usize];
        if let Ok(entry) = self.table.find_entry(self.mixer.hash(r.pid, r.key), |&j| j == i) {
            entry.remove();
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }
}

/// How many tracked requests each pid holds. It lets
/// [`Engine::process_exited`](super::Engine::process_exited) return at once
/// for a pid with none (the agent may hear of every exit on the host) and
/// stop its scan as soon as it has found them all.
#[derive(Debug)]
pub(crate) struct PidCounts {
    table: HashTable<(u32, u32)>,
    mixer: Mixer,
}

impl PidCounts {
    pub(crate) fn new(mixer: Mixer) -> PidCounts {
        PidCounts { table: HashTable::new(), mixer }
    }

    pub(crate) fn get(&self, pid: u32) -> u32 {
        self.table.find(self.mixer.hash(pid, 0), |e| e.0 == pid).map_or(0, |e| e.1)
    }

    pub(crate) fn increment(&mut self, pid: u32) {
        let mixer = self.mixer;
        let hash = mixer.hash(pid, 0);
        match self.table.find_mut(hash, |e| e.0 == pid) {
            Some(e) => e.1 += 1,
            None => {
                self.table.insert_unique(hash, (pid, 1), |e| mixer.hash(e.0, 0));
            }
        }
    }

    pub(crate) fn decrement(&mut self, pid: u32) {
        if let Ok(mut entry) = self.table.find_entry(self.mixer.hash(pid, 0), |e| e.0 == pid) {
            let e = entry.get_mut();
            e.1 = e.1.saturating_sub(1);
            if e.1 == 0 {
                entry.remove();
            }
        }
    }
}
