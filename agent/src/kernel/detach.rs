//! The links of a process gone, dropped off the event loop.
//!
//! Dropping a uprobe link detaches its probe, and the kernel's
//! `uprobe_unregister` waits for RCU grace periods in the calling thread:
//! measured on the SGLang test target, 100-139 ms a link (median) and up to
//! 8.6 s. A process's every link went at once on the loop when it exited or
//! exec'd, so with several processes watched one exit held back every other
//! process's stall alerts for seconds. [`super::Probes::detach`] now does on
//! the loop only what is quick (silence the slots, remove the pins, count
//! the final hits) and hands the links over as a [`Detaching`]; the
//! [`Detacher`] drops them on a blocking task and hands back a [`Detached`],
//! and only then, with [`super::Probes::detached`], are the process's slots
//! free. Until then a hit of a link still going reads a cleared config
//! (`no_slot`), never a successor's meaning: an exec'd process can map the
//! same library again, and its old links fire on it. The links of a gate
//! opening that comes back after its process is gone go the same way
//! ([`super::Probes::end_opening`]).
//!
//! Where a link's time goes (6.18): closing a perf-event uprobe link waits
//! for a tasks-trace RCU grace period outside any lock
//! (`perf_event_detach_bpf_prog`), then, under the kernel's global
//! `event_mutex` (`perf_uprobe_destroy`), for the uprobe's unregister
//! (`uprobe_unregister_sync`) and the tracepoint's
//! (`tracepoint_synchronize_unregister`). Dropped concurrently
//! ([`drop_all`]) the waits outside the mutex overlap and are shared;
//! those under it are not. Measured on the shared 2-core test host (load
//! 7-12): an idle process with the `vllm` profile's 22 links, 2.1-2.6 s
//! one after another, 1.7-1.95 s together; three demo processes serving
//! 200 requests/s (their probes firing, so the first wait is long), a stop
//! detaching their 18 links, 1.7-11.8 s one after another, 1.7-1.8 s
//! together. The floor is the mutex's ~80-100 ms a link, host-wide (any
//! process's close queues on it): one `uprobe_multi` link a library and
//! program (kernel 6.6+: one unregister sync for all its uprobes, no
//! `event_mutex`) is what would go below it; aya 0.14 cannot load a
//! program for it.
use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use tokio::sync::mpsc;

/// The links of one process gone, for [`Detaching::drop_links`] off the
/// loop. Each is held only to be dropped: its drop detaches its probe.
pub struct Detaching {
    id: u64,
    pid: u32,
    /// Dropped concurrently ([`drop_all`]): their slots are silenced first.
    links: Vec<Box<dyn Send>>,
}

/// What [`Detaching::drop_links`] did: the links of detaching `id` are gone.
#[derive(Debug)]
pub struct Detached {
    id: u64,
    pid: u32,
    links: usize,
    took: Duration,
}

impl Detaching {
    pub(super) fn new(id: u64, pid: u32, links: Vec<Box<dyn Send>>) -> Self {
        Self { id, pid, links }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Drop every link, in order. Blocks for as long as the kernel takes:
    /// call it off the event loop.
    pub fn drop_links(self) -> Detached {
        let start = Instant::now();
        let links = self.links.len();
        drop_all(self.links);
        Detached { id: self.id, pid: self.pid, links, took: start.elapsed() }
    }
}

/// At most this many links are dropped at once ([`drop_all`]).
const CONCURRENT_DROPS: usize = 64;

/// Drop every link, concurrently (up to [`CONCURRENT_DROPS`] threads, each
/// dropping its share in order), and return once all are gone. Each drop
/// waits in the kernel for grace periods; waits that overlap share one,
/// so the whole takes what the kernel serialises, not the sum. The order
/// between links is not kept: silence their slots first (a return probe
/// gone before its entry otherwise counts a call `args_missing`). Blocks:
/// call it off the event loop, or where blocking does not matter.
pub(super) fn drop_all<T: Send>(links: Vec<T>) {
    let threads = links.len().min(CONCURRENT_DROPS);
    if threads <= 1 {
        drop(links);
        return;
    }
    let mut shares: Vec<Vec<T>> = (0..threads).map(|_| Vec::new()).collect();
    for (n, link) in links.into_iter().enumerate() {
        shares[n % threads].push(link);
    }
    std::thread::scope(|scope| {
        for share in shares {
            let spawned =
                std::thread::Builder::new().name("detach-link".into()).spawn_scoped(scope, move || drop(share));
            // No thread to be had: the caller's then, one after another.
            if let Err(err) = spawned {
                tracing::debug!("dropping probe links on this thread: {err}");
            }
        }
    });
}

/// Drop the links of every one of `detachings` together (the agent's end:
/// the kernel's waits overlap across processes too); what each did, all
/// with the time the whole took.
pub(super) fn drop_together(detachings: Vec<Detaching>) -> Vec<Detached> {
    let start = Instant::now();
    let mut links = Vec::new();
    let done: Vec<(u64, u32, usize)> = detachings
        .into_iter()
        .map(|detaching| {
            let count = detaching.links.len();
            links.extend(detaching.links);
            (detaching.id, detaching.pid, count)
        })
        .collect();
    drop_all(links);
    let took = start.elapsed();
    done.into_iter().map(|(id, pid, links)| Detached { id, pid, links, took }).collect()
}

impl Detached {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// How many links went.
    pub fn links(&self) -> usize {
        self.links
    }

    /// How long the kernel took to detach them.
    pub fn took(&self) -> Duration {
        self.took
    }

    pub(super) fn id(&self) -> u64 {
        self.id
    }
}

/// The detachings under way, by id, and the slots each holds.
#[derive(Debug, Default)]
pub(super) struct Detachings {
    held: HashMap<u64, Vec<u32>>,
    next: u64,
}

impl Detachings {
    /// A process gone with these `slots`: they are held until the detaching
    /// (the id returned) is [`Self::end`]ed, except those an opening under
    /// way holds (`opening`: freed when that opening is back, never twice).
    pub fn begin(&mut self, slots: impl IntoIterator<Item = u32>, opening: &HashSet<u32>) -> u64 {
        let id = self.next;
        self.next += 1;
        self.held.insert(id, slots.into_iter().filter(|slot| !opening.contains(slot)).collect());
        id
    }

    /// Detaching `id` is done: the slots now free (none if it was ended already).
    pub fn end(&mut self, id: u64) -> Vec<u32> {
        self.held.remove(&id).unwrap_or_default()
    }

    /// Whether `slot` is held by a detaching under way.
    #[cfg(test)]
    pub fn holds(&self, slot: u32) -> bool {
        self.held.values().any(|slots| slots.contains(&slot))
    }
}

/// Detachings under way: each dropped on a blocking task, done coming back
/// through a channel to the loop, which alone frees slots.
pub struct Detacher {
    tx: mpsc::UnboundedSender<Detached>,
    rx: mpsc::UnboundedReceiver<Detached>,
    under_way: usize,
}

impl Default for Detacher {
    fn default() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self { tx, rx, under_way: 0 }
    }
}

impl Detacher {
    /// Drop `detaching`'s links on a blocking task.
    pub fn start(&mut self, detaching: Detaching) {
        self.under_way += 1;
        let tx = self.tx.clone();
        tokio::task::spawn_blocking(move || {
            // The receiver lives as long as `self`; gone, the agent is gone.
            let _ = tx.send(detaching.drop_links());
        });
    }

    /// Detachings whose links are not all gone yet.
    pub fn under_way(&self) -> usize {
        self.under_way
    }

    /// The next detaching done; never resolves while none is under way.
    pub async fn detached(&mut self) -> Detached {
        match self.rx.recv().await {
            Some(detached) => {
                self.under_way -= 1;
                detached
            }
            // Never: `self` holds a sender.
            None => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link whose drop takes as long as the kernel took (`.0`).
    struct Slow(Duration);

    impl Drop for Slow {
        fn drop(&mut self) {
            std::thread::sleep(self.0);
        }
    }

    #[test]
    fn a_gone_process_holds_its_slots_until_its_links_are_gone_and_frees_each_once() {
        let mut detachings = Detachings::default();
        // Slot 4 is held by an opening under way: freed when it is back.
        let first = detachings.begin([3, 4, 5], &HashSet::from([4]));
        let second = detachings.begin([8], &HashSet::new());
        assert!(detachings.holds(3) && detachings.holds(5) && !detachings.holds(4) && detachings.holds(8));
        assert_eq!(detachings.end(second), [8]);
        assert!(detachings.holds(3), "the first's links are still going");
        assert_eq!(detachings.end(first), [3, 5]);
        assert!(detachings.end(first).is_empty(), "once");
        assert!(!detachings.holds(3) && !detachings.holds(5));
    }

    #[test]
    fn links_are_dropped_together_and_every_one_is_dropped() {
        use std::sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        };
        /// Counts its drop, and how many drops were under way at once,
        /// over the kernel's 50 ms.
        #[derive(Clone, Default)]
        struct Counts {
            dropped: Arc<AtomicUsize>,
            under_way: Arc<AtomicUsize>,
            most: Arc<AtomicUsize>,
        }
        struct Counted(Counts);
        impl Drop for Counted {
            fn drop(&mut self) {
                let now = self.0.under_way.fetch_add(1, Ordering::SeqCst) + 1;
                self.0.most.fetch_max(now, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
                self.0.under_way.fetch_sub(1, Ordering::SeqCst);
                self.0.dropped.fetch_add(1, Ordering::SeqCst);
            }
        }
        let counts = Counts::default();
        let links = |n: usize| (0..n).map(|_| Box::new(Counted(counts.clone())) as Box<dyn Send>).collect();
        // More links than threads: some threads drop two.
        let done = drop_together(vec![
            Detaching::new(1, 10, links(CONCURRENT_DROPS)),
            Detaching::new(2, 11, links(3)),
            Detaching::new(3, 12, Vec::new()),
        ]);
        assert_eq!(counts.dropped.load(Ordering::SeqCst), CONCURRENT_DROPS + 3);
        let each: Vec<(u64, u32, usize)> = done.iter().map(|d| (d.id(), d.pid(), d.links())).collect();
        assert_eq!(each, [(1, 10, CONCURRENT_DROPS), (2, 11, 3), (3, 12, 0)]);
        // Across processes, and never more at once than the bound.
        let most = counts.most.load(Ordering::SeqCst);
        assert!((2..=CONCURRENT_DROPS).contains(&most), "{most} drops at once");
    }

    #[test]
    fn a_slow_detach_holds_nothing_up_on_the_loop() {
        let runtime =
            tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a current-thread runtime");
        runtime.block_on(async {
            let mut detacher = Detacher::default();
            // Two links the kernel takes 300 ms over each (seen up to 8.6 s),
            // dropped together.
            let slow = || Box::new(Slow(Duration::from_millis(300))) as Box<dyn Send>;
            let started = Instant::now();
            detacher.start(Detaching::new(5, 7, vec![slow(), slow()]));
            assert!(started.elapsed() < Duration::from_millis(100), "start blocked: {:?}", started.elapsed());
            assert_eq!(detacher.under_way(), 1);
            // Another process's stall due 50 ms on is judged on time.
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = detacher.detached() => panic!("the links went before the stall was due"),
            }
            assert!(started.elapsed() < Duration::from_millis(250), "{:?}", started.elapsed());
            // Done comes back as a message, once the links are gone.
            let done = detacher.detached().await;
            assert_eq!((done.id(), done.pid(), done.links()), (5, 7, 2));
            assert!(done.took() >= Duration::from_millis(300), "{:?}", done.took());
            assert_eq!(detacher.under_way(), 0);
        });
    }
}
