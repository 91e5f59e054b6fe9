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
    /// In the order they are dropped (a return probe before its entry).
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
        for link in self.links {
            drop(link);
        }
        Detached { id: self.id, pid: self.pid, links, took: start.elapsed() }
    }
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
    fn a_slow_detach_holds_nothing_up_on_the_loop() {
        let runtime =
            tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a current-thread runtime");
        runtime.block_on(async {
            let mut detacher = Detacher::default();
            // Two links the kernel takes 300 ms over each (seen up to 8.6 s).
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
            assert!(done.took() >= Duration::from_millis(600), "{:?}", done.took());
            assert_eq!(detacher.under_way(), 0);
        });
    }
}
