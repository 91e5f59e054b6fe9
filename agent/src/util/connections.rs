//! The open connections of one of the agent's small servers (`/metrics`,
//! the query socket), bounded, in which an idle connection gives way: one
//! that has sent nothing yet is closed, oldest first, when a new client
//! needs its place. A deadline alone would let clients that connect and
//! send nothing, faster than it expires, keep every place taken and every
//! scrape or `stallwatch inflight` unanswered; this way any number of them
//! costs a new client nothing, and one whose request is read is answered.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use tokio::sync::oneshot;

/// The open connections of one server, at most `limit`.
#[derive(Clone)]
pub struct Connections {
    table: Arc<Mutex<Table>>,
}

struct Table {
    limit: usize,
    next: u64,
    /// By id, the order they came in: the first idle one is the oldest.
    open: BTreeMap<u64, Open>,
}

struct Open {
    /// Closes it; `Some` while it is idle (its request not read yet).
    evict: Option<oneshot::Sender<()>>,
}

impl Connections {
    pub fn new(limit: usize) -> Self {
        Self { table: Arc::new(Mutex::new(Table { limit, next: 0, open: BTreeMap::new() })) }
    }

    /// A place for a connection just accepted. With every place taken, the
    /// oldest idle connection is closed to make room; `None` when none is
    /// idle (every place holds a request being answered).
    pub fn admit(&self) -> Option<Admitted> {
        let mut table = lock(&self.table);
        if table.open.len() >= table.limit {
            let oldest_idle = table.open.iter().find(|(_, open)| open.evict.is_some()).map(|(&id, _)| id)?;
            if let Some(evict) = table.open.remove(&oldest_idle).and_then(|open| open.evict) {
                // Its task may be gone already; the place is free either way.
                let _ = evict.send(());
            }
        }
        let id = table.next;
        table.next += 1;
        let (evict, evicted) = oneshot::channel();
        table.open.insert(id, Open { evict: Some(evict) });
        Some(Admitted { table: Arc::clone(&self.table), id, evicted })
    }

    /// How many are open (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.table).open.len()
    }
}

/// One connection's place; given back when dropped.
pub struct Admitted {
    table: Arc<Mutex<Table>>,
    id: u64,
    evicted: oneshot::Receiver<()>,
}

impl Admitted {
    /// Resolves once the connection is closed to make room for a newer
    /// one, which can only happen while it is idle: race it against
    /// reading the request.
    pub async fn evicted(&mut self) {
        if (&mut self.evicted).await.is_err() {
            // Not closed to make room: its request was read ([`Self::busy`]).
            std::future::pending::<()>().await;
        }
    }

    /// Its request is read: it is answered from now on, never closed to
    /// make room (how long that takes is bounded by the server).
    pub fn busy(&self) {
        if let Some(open) = lock(&self.table).open.get_mut(&self.id) {
            open.evict = None;
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        lock(&self.table).open.remove(&self.id);
    }
}

/// No code panics while holding the lock, but a poisoned table is still
/// a table: carry on with it.
fn lock(table: &Mutex<Table>) -> MutexGuard<'_, Table> {
    table.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::{future::Future as _, pin::pin, task::Context};

    use super::*;

    /// Whether `admitted` was closed to make room, without waiting.
    fn was_evicted(admitted: &mut Admitted) -> bool {
        pin!(admitted.evicted()).poll(&mut Context::from_waker(std::task::Waker::noop())).is_ready()
    }

    #[test]
    fn the_oldest_idle_connection_makes_room_and_busy_ones_are_kept() {
        let connections = Connections::new(3);
        let mut first = connections.admit().expect("room");
        let second = connections.admit().expect("room");
        let mut third = connections.admit().expect("room");
        second.busy();
        // Full: the oldest idle one (the first) goes, not the busy second.
        let mut fourth = connections.admit().expect("an idle one makes room");
        assert!(was_evicted(&mut first));
        assert!(!was_evicted(&mut third) && !was_evicted(&mut fourth));
        assert_eq!(connections.len(), 3);
        // Then the third, the oldest idle one left.
        let fifth = connections.admit().expect("room");
        assert!(was_evicted(&mut third));
        fourth.busy();
        fifth.busy();
        // Every place answering a request: a new one is refused.
        assert!(connections.admit().is_none());
        drop(second);
        assert!(connections.admit().is_some(), "a place given back is free");
        // A busy connection is never told it was evicted.
        assert!(!was_evicted(&mut fourth));
    }

    #[test]
    fn any_number_of_idle_connections_leave_room_for_one_more() {
        let connections = Connections::new(4);
        let idle: Vec<Admitted> = (0..1000).filter_map(|_| connections.admit()).collect();
        assert_eq!(idle.len(), 1000, "every idle newcomer found room");
        assert_eq!(connections.len(), 4, "the oldest ones were closed");
        let client = connections.admit().expect("room for a client");
        client.busy();
        drop(idle);
        assert_eq!(connections.len(), 1);
    }
}
