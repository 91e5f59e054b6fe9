//! The peer of every NIXL transfer, and what each peer completed: so a
//! stalled transfer's transport verdict is judged against its own peer,
//! not the whole process.
//!
//! A prefill process sends to several decode peers. Judged per process, a
//! transfer hung on one stopped decode reads `others_completing` as soon as
//! transfers to another decode complete, which sends the on-call engineer
//! looking for a lost completion instead of at the stopped peer. The
//! remote agent's name is an argument of `createXferReq`: a `[[signal]]`
//! named `nixl_remote_agent` on its entry names it on the creating thread
//! ([`Peers::creating`]), and the handle the call returns on that thread is
//! the transfer to that peer. Every handle's lifecycle events then say
//! what that peer completed ([`Peers::observe`]): a handle's
//! `transfer_done`, or the release of a posted handle whose done no probe
//! saw (as [`crate::evidence::transport::Tracker::observe_end`] counts completions
//! for the process).
//!
//! Only profiles with that signal (`sglang`) know peers; without it no
//! handle has one, and the verdict stays the process's.
use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
};

use crate::lifecycle::{Observation, Stage};

/// Completions closer together than this are counted as one bucket, timed
/// at the first: memory stays bounded (per peer, at most one bucket per
/// millisecond kept) whatever the completion rate, and a completion in the
/// bucket of a request's last event but after it is not counted as
/// "since" (never the other way round: one just before the event, such as
/// the previous transfer's release on the same worker, is never taken for
/// a sign that the peer is alive).
const BUCKET_NS: u64 = 1_000_000;

/// What the peer of a stalled request's transfer, and the process's other
/// peers, completed since the request's last event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCompletions {
    /// The remote NIXL agent's name.
    pub peer: Arc<str>,
    pub to_peer: u64,
    pub to_others: u64,
}

/// A live handle whose creating thread named its peer.
#[derive(Debug)]
struct Handle {
    peer: Arc<str>,
    posted: bool,
    /// Its completion was counted (a `transfer_done` seen).
    done: bool,
}

/// One peer's completions: (first completion's time, completions) per
/// bucket, oldest first.
type Buckets = VecDeque<(u64, u64)>;

/// The handles' peers and the peers' completions of every watched process.
pub struct Peers {
    /// (pid, tid): the peer of the transfer the thread is creating.
    creating: HashMap<(u32, u32), Arc<str>>,
    /// (pid, handle): until the handle ends.
    handles: HashMap<(u32, u64), Handle>,
    /// pid -> peer -> its buckets, none older than `keep_ns` before the
    /// newest.
    completions: HashMap<u32, HashMap<Arc<str>, Buckets>>,
    /// How far back completions are kept: a stall is judged against its
    /// last event, one timeout (plus slack) ago.
    keep_ns: u64,
}

impl Peers {
    /// Completions are kept for two timeouts and 5 s, as the transport's
    /// samples are ([`crate::evidence::transport::Tracker::new`]).
    pub fn new(timeout_ns: u64) -> Self {
        Self {
            creating: HashMap::new(),
            handles: HashMap::new(),
            completions: HashMap::new(),
            keep_ns: timeout_ns.saturating_mul(2).saturating_add(5_000_000_000),
        }
    }

    /// Thread `tid` is creating a transfer to the NIXL agent `agent`.
    pub fn creating(&mut self, pid: u32, tid: u32, agent: &[u8]) {
        self.creating.insert((pid, tid), String::from_utf8_lossy(agent).into());
    }

    /// Transfer `handle` of `pid`, to `peer`, was posted (a framework told
    /// its peer from its own traffic, [`crate::frameworks::Framework::started_transfer`]):
    /// its release counts as a completion to that peer.
    pub fn started(&mut self, pid: u32, handle: u64, peer: &str) {
        self.handles.insert((pid, handle), Handle { peer: peer.into(), posted: true, done: false });
    }

    /// A handle a previous agent knew the peer of (`None`: it did not),
    /// taken over live: posted or not, its completion not seen yet.
    pub fn adopt(&mut self, pid: u32, handle: u64, peer: Option<&str>, posted: bool) {
        match peer {
            Some(peer) => self.handles.insert((pid, handle), Handle { peer: peer.into(), posted, done: false }),
            None => self.handles.remove(&(pid, handle)),
        };
    }

    /// A NIXL handle's lifecycle event, seen on thread `tid` (before it is
    /// made a room's, so every handle counts, a room's or not). A handle
    /// is forgotten at its end: a terminal stage, or an event that `ends`
    /// its lifecycle (a profile that completes at `transfer_done`; its
    /// release, if seen, is then no handle's).
    pub fn observe(&mut self, tid: u32, observation: &Observation) {
        let &Observation { pid, key, stage, ts_ns, ref ends, .. } = observation;
        let completed = match stage {
            Stage::Enqueued => {
                // A handle address is reused after its release: a new handle
                // whose thread named no peer has none, whatever the old had.
                match self.creating.remove(&(pid, tid)) {
                    Some(peer) => self.handles.insert((pid, key), Handle { peer, posted: false, done: false }),
                    None => self.handles.remove(&(pid, key)),
                };
                None
            }
            Stage::TransferPosted => {
                if let Some(handle) = self.handles.get_mut(&(pid, key)) {
                    handle.posted = true;
                }
                None
            }
            Stage::TransferDone => self.handles.get_mut(&(pid, key)).filter(|h| !h.done).map(|handle| {
                handle.done = true;
                handle.peer.clone()
            }),
            Stage::Released => self.handles.remove(&(pid, key)).filter(|h| h.posted && !h.done).map(|h| h.peer),
            Stage::Aborted | Stage::Failed => {
                self.handles.remove(&(pid, key));
                None
            }
        };
        if ends.is_some() {
            self.handles.remove(&(pid, key));
        }
        if let Some(peer) = completed {
            self.complete(pid, peer, ts_ns);
        }
    }

    fn complete(&mut self, pid: u32, peer: Arc<str>, at_ns: u64) {
        let keep_ns = self.keep_ns;
        let peers = self.completions.entry(pid).or_default();
        let buckets = peers.entry(peer).or_default();
        match buckets.back_mut() {
            Some((first_ns, count)) if at_ns.saturating_sub(*first_ns) < BUCKET_NS => *count += 1,
            _ => buckets.push_back((at_ns, 1)),
        }
        for buckets in peers.values_mut() {
            while buckets.front().is_some_and(|(first_ns, _)| at_ns.saturating_sub(*first_ns) > keep_ns) {
                buckets.pop_front();
            }
        }
        peers.retain(|_, buckets| !buckets.is_empty());
    }

    /// What `handle`'s peer, and the other peers of `pid`, completed after
    /// `since_ns`; `None` when the handle's peer is unknown.
    pub fn since(&self, pid: u32, handle: u64, since_ns: u64) -> Option<PeerCompletions> {
        let peer = self.handles.get(&(pid, handle))?.peer.clone();
        let count = |buckets: &VecDeque<(u64, u64)>| -> u64 {
            let after = buckets.partition_point(|(first_ns, _)| *first_ns <= since_ns);
            buckets.range(after..).map(|(_, count)| count).sum()
        };
        let (mut to_peer, mut to_others) = (0, 0);
        for (name, buckets) in self.completions.get(&pid).into_iter().flatten() {
            if *name == peer {
                to_peer += count(buckets);
            } else {
                to_others += count(buckets);
            }
        }
        Some(PeerCompletions { peer, to_peer, to_others })
    }

    /// The process is gone: its handles and peers go with it.
    pub fn forget(&mut self, pid: u32) {
        self.creating.retain(|(p, _), _| *p != pid);
        self.handles.retain(|(p, _), _| *p != pid);
        self.completions.remove(&pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::Outcome;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000 * MS;

    fn event(pid: u32, key: u64, stage: Stage, ts_ns: u64) -> Observation {
        Observation { pid, key, stage, ts_ns, external_id: None, ends: None }
    }

    /// Handle `key` of pid 4 created on thread `tid` to `peer` and posted at `at`.
    fn posted(peers: &mut Peers, tid: u32, key: u64, peer: &str, at: u64) {
        peers.creating(4, tid, peer.as_bytes());
        peers.observe(tid, &event(4, key, Stage::Enqueued, at));
        peers.observe(tid, &event(4, key, Stage::TransferPosted, at));
    }

    fn counts(peers: &Peers, key: u64, since_ns: u64) -> Option<(String, u64, u64)> {
        peers.since(4, key, since_ns).map(|p| (p.peer.to_string(), p.to_peer, p.to_others))
    }

    #[test]
    fn a_handle_has_the_peer_its_thread_named_and_completions_count_per_peer_once() {
        let mut peers = Peers::new(2 * S);
        posted(&mut peers, 20, 0xa0, "decode-0", 10 * S);
        posted(&mut peers, 21, 0xb0, "decode-1", 10 * S);
        posted(&mut peers, 21, 0xb1, "decode-1", 10 * S);
        posted(&mut peers, 21, 0xb2, "decode-1", 10 * S);
        assert_eq!(counts(&peers, 0xa0, 10 * S), Some(("decode-0".into(), 0, 0)));
        // Done seen, then released: one completion. Released after a post
        // with no done seen: one, at the release. Created, never posted,
        // released: none. Failed: none.
        peers.observe(21, &event(4, 0xb0, Stage::TransferDone, 11 * S));
        peers.observe(21, &event(4, 0xb0, Stage::TransferDone, 11 * S + 5 * MS));
        peers.observe(21, &event(4, 0xb0, Stage::Released, 12 * S));
        peers.observe(21, &event(4, 0xb1, Stage::Released, 13 * S));
        peers.creating(4, 21, b"decode-1");
        peers.observe(21, &event(4, 0xb3, Stage::Enqueued, 13 * S));
        peers.observe(21, &event(4, 0xb3, Stage::Released, 14 * S));
        peers.observe(21, &event(4, 0xb2, Stage::Failed, 14 * S));
        assert_eq!(counts(&peers, 0xa0, 10 * S), Some(("decode-0".into(), 0, 2)));
        assert_eq!(counts(&peers, 0xa0, 12 * S), Some(("decode-0".into(), 0, 1)), "only after the time asked");
        // Ended handles have no peer any more; nor has one whose thread named none.
        assert_eq!(counts(&peers, 0xb0, 0), None);
        assert_eq!(counts(&peers, 0xb2, 0), None);
        peers.observe(22, &event(4, 0xc0, Stage::Enqueued, 15 * S));
        assert_eq!(counts(&peers, 0xc0, 0), None);
        // A reused address is the new handle, with the new thread's peer or none.
        posted(&mut peers, 20, 0xb0, "decode-0", 16 * S);
        assert_eq!(counts(&peers, 0xb0, 0), Some(("decode-0".into(), 0, 2)));
        peers.observe(20, &event(4, 0xb0, Stage::Released, 17 * S));
        peers.observe(23, &event(4, 0xb0, Stage::Enqueued, 18 * S));
        assert_eq!(counts(&peers, 0xb0, 0), None);
        // Complete at transfer_done (the lifecycle ends there): counted
        // once, the handle forgotten, its later release no one's.
        posted(&mut peers, 21, 0xb4, "decode-1", 17 * S);
        peers.observe(
            21,
            &Observation { ends: Some(Outcome::Completed), ..event(4, 0xb4, Stage::TransferDone, 17 * S) },
        );
        assert_eq!(counts(&peers, 0xb4, 0), None);
        peers.observe(21, &event(4, 0xb4, Stage::Released, 17 * S + 10 * MS));
        assert_eq!(counts(&peers, 0xa0, 10 * S), Some(("decode-0".into(), 1, 3)));
        // Another process's handles and peers are its own.
        peers.creating(5, 20, b"decode-0");
        peers.observe(20, &event(5, 0xa0, Stage::Enqueued, 19 * S));
        peers.observe(20, &event(5, 0xa0, Stage::TransferDone, 19 * S));
        assert_eq!(counts(&peers, 0xa0, 10 * S), Some(("decode-0".into(), 1, 3)));
        assert_eq!(peers.since(5, 0xa0, 0).map(|p| (p.to_peer, p.to_others)), Some((1, 0)));
        peers.forget(4);
        assert_eq!(counts(&peers, 0xa0, 0), None);
        assert!(!peers.completions.contains_key(&4) && peers.handles.keys().all(|(pid, _)| *pid == 5));
        peers.forget(5);
        assert!(peers.handles.is_empty() && peers.creating.is_empty() && peers.completions.is_empty());
    }

    #[test]
    fn a_transfer_a_framework_names_the_peer_of_counts_its_release_for_that_peer() {
        let mut peers = Peers::new(2 * S);
        // Two batches to two decodes, told by the framework (no creating thread).
        peers.started(4, 0xb0, "127.0.0.1:15290");
        peers.started(4, 0xc0, "127.0.0.1:15292");
        peers.observe(30, &event(4, 0xc0, Stage::Released, 11 * S));
        let hung = peers.since(4, 0xb0, 10 * S).expect("its peer is known");
        assert_eq!((&*hung.peer, hung.to_peer, hung.to_others), ("127.0.0.1:15290", 0, 1));
        // A failed one counts for nobody and is forgotten.
        peers.observe(30, &event(4, 0xb0, Stage::Failed, 12 * S));
        assert_eq!(peers.since(4, 0xb0, 10 * S), None);
    }

    #[test]
    fn a_completion_just_before_the_event_is_never_counted_since_and_memory_is_bounded() {
        let mut peers = Peers::new(S);
        // The worker releases the previous transfer to decode-0, then
        // creates and posts the one that hangs, within the same millisecond.
        posted(&mut peers, 20, 0xa0, "decode-0", 10 * S);
        peers.observe(20, &event(4, 0xa0, Stage::Released, 20 * S));
        posted(&mut peers, 20, 0xa1, "decode-0", 20 * S + MS / 10);
        assert_eq!(counts(&peers, 0xa1, 20 * S + MS / 10), Some(("decode-0".into(), 0, 0)));
        // A flood of completions to decode-1, 100 a millisecond for 10 s:
        // buckets, each kept for two timeouts and 5 s only.
        for n in 0..1_000_000u64 {
            let key = 0x1000 + n % 64;
            peers.creating(4, 21, b"decode-1");
            peers.observe(21, &event(4, key, Stage::Enqueued, 21 * S + n * 10_000));
            peers.observe(21, &event(4, key, Stage::TransferDone, 21 * S + n * 10_000));
            peers.observe(21, &event(4, key, Stage::Released, 21 * S + n * 10_000));
        }
        let buckets = &peers.completions[&4];
        assert!(
            buckets.values().all(|b| b.len() <= 7_001),
            "{:?}",
            buckets.values().map(VecDeque::len).collect::<Vec<_>>()
        );
        assert!(!buckets.contains_key("decode-0"), "decode-0's only completion is older than kept");
        let (_, to_peer, to_others) = counts(&peers, 0xa1, 30 * S).expect("peer");
        assert_eq!((to_peer, to_others), (0, 100_000 - 100), "the last second, less the bucket at 30 s");
    }
}
