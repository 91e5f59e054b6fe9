//! NIXL handles of SGLang rooms that are never released: leaks.
//!
//! SGLang releases a handle lazily: its transfer worker drops a chunk's
//! handles (`handles`, `kv_xfer_handle`) when it takes its next chunk, and
//! a room's aux handle (`aux_xfer_handle`) when it creates the next aux,
//! and the handle's `__del__` calls `releaseXferReq`. So a worker that goes
//! idle keeps its last handles, unreleased and answering SUCCESS, for as
//! long as it is idle: that is no leak, and its room, released, is no
//! stall. A handle still unreleased once its worker has moved on (created a
//! handle of the same kind, KV or aux, for another room), or whose release
//! NIXL refused (a transfer still in progress: NIXL's Python wrapper then
//! keeps it on its agent's `_leaked_xfer_handles` list and never releases
//! it again), is held by nothing that will release it: its registered
//! memory and descriptors stay taken, and a transfer in progress may still
//! write into the decode's pages. Once its room has ended (released,
//! aborted, failed) and a timeout has passed since the worker moved on
//! (or the release was refused) with no release, it is reported once, as
//! a lifecycle of its own that ends [`Outcome::Leaked`]: the handle, its
//! room and its peer ([`Leaks::context`]).
//!
//! Handles are followed from their creation (attributed to a room) to
//! their release; one created before the agent started is not known.
use std::collections::{HashMap, VecDeque};

use crate::lifecycle::{Observation, Outcome, Stage};

/// Handles followed at most (a worker holds a few between releases; a
/// process that leaks more than this loses the newest from the count).
const TRACKED_MAX: usize = 1 << 16;

/// Leaks kept for their alert (each is a lifecycle that ends as it
/// starts: its alert is written on the same loop turn).
const FOUND_KEPT: usize = 1024;

/// One handle of a room, from its creation to its release.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Tracked {
    room: u64,
    peer: Box<str>,
    tid: u32,
    /// A KV chunk's (`makeXferReq`), not an aux transfer's
    /// (`createXferReq`): a worker drops each kind at its next of it.
    kv: bool,
    created_ns: u64,
    /// Its transfer was seen done.
    done: bool,
    /// Its release was called (its entry seen): its return says whether
    /// NIXL released it.
    releasing: bool,
    /// When NIXL refused its release.
    refused_ns: Option<u64>,
    /// When its worker moved on without it.
    moved_on_ns: Option<u64>,
}

impl Tracked {
    /// When it is a leak if still unreleased and its room has ended.
    fn due_ns(&self, timeout_ns: u64) -> Option<u64> {
        let since = match (self.refused_ns, self.moved_on_ns) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        Some(since.saturating_add(timeout_ns))
    }
}

/// What a handle was created for: its room, its peer (the decode's NIXL
/// agent) and whether it is a KV chunk's (`makeXferReq`) or an aux
/// transfer's (`createXferReq`).
#[derive(Debug, Clone, Copy)]
pub struct Made<'a> {
    pub room: u64,
    pub peer: &'a str,
    pub kv: bool,
}

/// A leaked handle, for its alert.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Leak {
    room: u64,
    peer: Box<str>,
    refused: bool,
    created_ns: u64,
    at_ns: u64,
}

/// The handles of every watched process's rooms until their release, and
/// the leaks among them.
#[derive(Default)]
pub struct Leaks {
    timeout_ns: u64,
    tracked: HashMap<(u32, u64), Tracked>,
    /// (pid, handle) -> when it is due, for those whose worker moved on or
    /// whose release was refused.
    due: HashMap<(u32, u64), u64>,
    found: HashMap<(u32, u64), Leak>,
    pending: VecDeque<Observation>,
    /// Handles reported leaked.
    pub leaked: u64,
    /// Handles not followed ([`TRACKED_MAX`]).
    pub untracked: u64,
}

impl Leaks {
    /// Leaks judged `timeout_ns` after their worker moved on.
    pub fn new(timeout_ns: u64) -> Self {
        Self { timeout_ns, ..Self::default() }
    }

    /// Handle `key` of `pid` was created on thread `tid` at `ts_ns` for
    /// `made.room`, to the NIXL agent `made.peer`, a KV chunk's
    /// (`made.kv`) or an aux transfer's: the thread's earlier handles of
    /// that kind for other rooms are dropped by now (SGLang's worker took
    /// another room's chunk), so from now a timeout tells whether they were
    /// released.
    pub fn created(&mut self, pid: u32, tid: u32, key: u64, made: Made<'_>, ts_ns: u64) {
        let Made { room, peer, kv } = made;
        for (&(p, handle), t) in &mut self.tracked {
            if p == pid && t.tid == tid && t.kv == kv && t.room != room && t.moved_on_ns.is_none() {
                t.moved_on_ns = Some(ts_ns);
                if let Some(due) = t.due_ns(self.timeout_ns) {
                    self.due.insert((pid, handle), due);
                }
            }
        }
        // NIXL hands a released handle's address to the next: one it hands
        // out again was released (a release this agent did not see).
        self.due.remove(&(pid, key));
        if self.tracked.len() >= TRACKED_MAX && !self.tracked.contains_key(&(pid, key)) {
            self.untracked += 1;
            return;
        }
        let tracked = Tracked {
            room,
            peer: peer.into(),
            tid,
            kv,
            created_ns: ts_ns,
            done: false,
            releasing: false,
            refused_ns: None,
            moved_on_ns: None,
        };
        self.tracked.insert((pid, key), tracked);
    }

    /// A lifecycle event of handle `key` of `pid` (`entry`: of
    /// `releaseXferReq`'s entry, its return, or neither): whether it is
    /// this tracker's to take (a release's return, which ends nothing the
    /// rooms follow), so nobody else sees it.
    ///
    /// The release is probed at its entry (`released`, or `failed` by the
    /// handle's status read there) and at its return (`released` when
    /// NIXL released it, `transfer_posted` when it refused: the handle
    /// lives on). So a handle's first `released`/`failed` after its
    /// creation is the call, the next `released` the release done.
    pub fn event(&mut self, pid: u32, key: u64, stage: Stage, ts_ns: u64) -> bool {
        let Some(t) = self.tracked.get_mut(&(pid, key)) else { return false };
        match stage {
            Stage::TransferDone => {
                t.done = true;
                false
            }
            Stage::Released | Stage::Failed if !t.releasing => {
                t.releasing = true;
                false
            }
            Stage::Released => {
                self.tracked.remove(&(pid, key));
                self.due.remove(&(pid, key));
                true
            }
            Stage::TransferPosted if t.releasing => {
                t.releasing = false;
                t.refused_ns.get_or_insert(ts_ns);
                if let Some(due) = t.due_ns(self.timeout_ns) {
                    self.due.insert((pid, key), due);
                }
                true
            }
            _ => false,
        }
    }

    /// The handles due by `now_ns` whose room has ended (`live` says
    /// whether a room of a process still is) are leaks: each a lifecycle
    /// of its own for [`Leaks::pending`], started at its creation (done,
    /// if it was seen done) and ended [`Outcome::Leaked`] now. One whose
    /// room is still live is judged a timeout later.
    pub fn expire(&mut self, now_ns: u64, live: impl Fn(u32, u64) -> bool) {
        let due: Vec<(u32, u64)> = self.due.iter().filter(|&(_, &at)| at <= now_ns).map(|(&k, _)| k).collect();
        for (pid, key) in due {
            let Some(t) = self.tracked.get(&(pid, key)) else {
                self.due.remove(&(pid, key));
                continue;
            };
            if live(pid, t.room) {
                self.due.insert((pid, key), now_ns.saturating_add(self.timeout_ns));
                continue;
            }
            self.due.remove(&(pid, key));
            let Some(t) = self.tracked.remove(&(pid, key)) else { continue };
            self.leaked += 1;
            if self.found.len() >= FOUND_KEPT {
                self.found.clear();
            }
            let stage = if t.done { Stage::TransferDone } else { Stage::TransferPosted };
            let own = |ts_ns, ends| Observation { pid, key, stage, ts_ns, external_id: None, ends };
            self.pending.push_back(own(t.created_ns, None));
            self.pending.push_back(own(now_ns, Some(Outcome::Leaked)));
            let leak = Leak {
                room: t.room,
                peer: t.peer,
                refused: t.refused_ns.is_some(),
                created_ns: t.created_ns,
                at_ns: now_ns,
            };
            self.found.insert((pid, key), leak);
        }
    }

    /// When [`Leaks::expire`] next has one to judge.
    pub fn next_expiry(&self) -> Option<u64> {
        self.due.values().min().copied()
    }

    /// The next observation of a leak found.
    pub fn pending(&mut self) -> Option<Observation> {
        self.pending.pop_front()
    }

    /// What a leaked handle's alert says: `leaked=handle`, the handle, its
    /// room and peer, whether NIXL refused its release (`release`:
    /// `refused`, or `never` called while its worker went on), and how
    /// long after its creation it was found (`after_ms`). Empty for any
    /// other lifecycle.
    pub fn context(&self, pid: u32, key: u64) -> Vec<(&'static str, String)> {
        let Some(leak) = self.found.get(&(pid, key)) else { return Vec::new() };
        vec![
            ("leaked", "handle".to_owned()),
            ("handle", format!("{key:#x}")),
            ("room", leak.room.to_string()),
            ("peer", leak.peer.to_string()),
            ("release", if leak.refused { "refused" } else { "never" }.to_owned()),
            ("after_ms", (leak.at_ns.saturating_sub(leak.created_ns) / 1_000_000).to_string()),
        ]
    }

    /// The process is gone (its handles with it).
    pub fn forget(&mut self, pid: u32) {
        self.tracked.retain(|(p, _), _| *p != pid);
        self.due.retain(|(p, _), _| *p != pid);
        self.found.retain(|(p, _), _| *p != pid);
        self.pending.retain(|o| o.pid != pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn made(room: u64, peer: &str, kv: bool) -> Made<'_> {
        Made { room, peer, kv }
    }

    fn leaks_of(leaks: &mut Leaks) -> Vec<(u64, Stage, u64, Option<Outcome>)> {
        std::iter::from_fn(|| leaks.pending()).map(|o| (o.key, o.stage, o.ts_ns, o.ends)).collect()
    }

    #[test]
    fn an_idle_workers_last_handles_are_no_leak_however_long_it_idles() {
        let mut leaks = Leaks::new(2 * S);
        leaks.created(1, 10, 0xa, made(7, "dec", true), S);
        leaks.created(1, 10, 0xb, made(7, "dec", false), S);
        for key in [0xa, 0xb] {
            assert!(!leaks.event(1, key, Stage::TransferDone, S + 1));
        }
        assert_eq!(leaks.next_expiry(), None, "nothing moved on");
        leaks.expire(100 * S, |_, _| false);
        assert_eq!(leaks_of(&mut leaks), []);
    }

    #[test]
    fn a_handle_released_after_its_worker_moved_on_is_no_leak() {
        let mut leaks = Leaks::new(2 * S);
        leaks.created(1, 10, 0xa, made(7, "dec", true), S);
        // SGLang: release(chunk of 7) at entry and return, then make(8's).
        assert!(!leaks.event(1, 0xa, Stage::Released, 2 * S), "the call: the rooms see it");
        assert!(leaks.event(1, 0xa, Stage::Released, 2 * S + 1), "done: taken");
        leaks.created(1, 10, 0xa, made(8, "dec", true), 2 * S + 2);
        // The aux of 7 is released just after the aux of 8 is created.
        leaks.created(1, 10, 0xc, made(7, "dec", false), S);
        leaks.created(1, 10, 0xd, made(8, "dec", false), 3 * S);
        assert_eq!(leaks.next_expiry(), Some(5 * S));
        leaks.event(1, 0xc, Stage::Released, 3 * S + 1);
        leaks.event(1, 0xc, Stage::Released, 3 * S + 2);
        leaks.expire(10 * S, |_, _| false);
        assert_eq!(leaks_of(&mut leaks), []);
        assert_eq!(leaks.next_expiry(), None);
    }

    #[test]
    fn a_handle_left_behind_by_its_worker_leaks_once_its_room_ended() {
        let mut leaks = Leaks::new(2 * S);
        leaks.created(1, 10, 0xa, made(7, "dec-a", true), S);
        leaks.event(1, 0xa, Stage::TransferDone, S + 5);
        // Another thread's handles, and an aux, move nothing on.
        leaks.created(1, 11, 0xe, made(8, "dec-a", true), 2 * S);
        leaks.created(1, 10, 0xf, made(8, "dec-a", false), 2 * S);
        assert_eq!(leaks.next_expiry(), None);
        // Its worker takes room 8's chunk; 0xa is never released.
        leaks.created(1, 10, 0xb, made(8, "dec-a", true), 3 * S);
        assert_eq!(leaks.next_expiry(), Some(5 * S));
        leaks.expire(5 * S - 1, |_, _| false);
        assert_eq!(leaks_of(&mut leaks), []);
        // Room 7 still live at the due time: judged a timeout later.
        leaks.expire(5 * S, |_, room| room == 7);
        assert_eq!((leaks_of(&mut leaks), leaks.next_expiry()), (vec![], Some(7 * S)));
        leaks.expire(7 * S, |_, _| false);
        let done = Stage::TransferDone;
        assert_eq!(leaks_of(&mut leaks), [(0xa, done, S, None), (0xa, done, 7 * S, Some(Outcome::Leaked))]);
        let context = leaks.context(1, 0xa);
        let field = |name: &str| context.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str());
        assert_eq!(
            ["leaked", "handle", "room", "peer", "release", "after_ms"].map(field),
            [Some("handle"), Some("0xa"), Some("7"), Some("dec-a"), Some("never"), Some("6000")]
        );
        // Once: it is no longer followed.
        leaks.expire(100 * S, |_, _| false);
        assert_eq!(leaks_of(&mut leaks), []);
        assert_eq!(leaks.leaked, 1);
        assert!(leaks.context(1, 0xb).is_empty());
    }

    #[test]
    fn a_release_nixl_refused_leaks_a_timeout_later_unless_released_after_all() {
        let mut leaks = Leaks::new(2 * S);
        leaks.created(1, 10, 0xa, made(7, "dec", true), S);
        leaks.created(1, 10, 0xb, made(7, "dec", true), S);
        for key in [0xa, 0xb] {
            // The entry (its status read: `failed`), then the refusal.
            assert!(!leaks.event(1, key, Stage::Failed, 2 * S));
            assert!(leaks.event(1, key, Stage::TransferPosted, 2 * S + 1), "the refusal is taken");
        }
        // 0xb is released at a later try.
        leaks.event(1, 0xb, Stage::Released, 3 * S);
        leaks.event(1, 0xb, Stage::Released, 3 * S + 1);
        leaks.expire(10 * S, |_, _| false);
        let posted = Stage::TransferPosted;
        assert_eq!(leaks_of(&mut leaks), [(0xa, posted, S, None), (0xa, posted, 10 * S, Some(Outcome::Leaked))]);
        assert!(leaks.context(1, 0xa).contains(&("release", "refused".to_owned())));
    }

    #[test]
    fn a_handle_address_handed_out_again_was_released_and_a_gone_process_forgets_all() {
        let mut leaks = Leaks::new(2 * S);
        leaks.created(1, 10, 0xa, made(7, "dec", true), S);
        leaks.created(1, 10, 0xb, made(8, "dec", true), 2 * S);
        // 0xa again (its release unseen): the old one is gone.
        leaks.created(1, 10, 0xa, made(9, "dec", true), 3 * S);
        leaks.expire(100 * S, |_, _| false);
        let leaked: Vec<u64> = leaks_of(&mut leaks).into_iter().map(|(key, ..)| key).collect();
        assert_eq!(leaked, [0xb, 0xb], "0xb was left behind, 0xa is a new handle");
        leaks.created(2, 10, 0xc, made(7, "dec", true), S);
        leaks.created(2, 10, 0xd, made(8, "dec", true), 2 * S);
        leaks.forget(2);
        leaks.expire(100 * S, |_, _| false);
        assert_eq!(leaks_of(&mut leaks), []);
        assert!(leaks.tracked.keys().all(|(p, _)| *p == 1));
    }
}
