//! The open connections of one of the agent's small servers (`/metrics`,
//! the query socket), bounded, in which an idle connection gives way: one
//! that is not being answered (it has sent nothing yet, or, kept alive,
//! nothing since its last answer) is closed, oldest first, when a new
//! client needs its place. A deadline alone would let clients that connect and
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
    /// Closes it.
    evict: oneshot::Sender<()>,
    /// Not being answered: it may be closed to make room.
    idle: bool,
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
            let oldest_idle = table.open.iter().find(|(_, open)| open.idle).map(|(&id, _)| id)?;
            if let Some(open) = table.open.remove(&oldest_idle) {
                // Its task may be gone already; the place is free either way.
                let _ = open.evict.send(());
            }
        }
        let id = table.next;
        table.next += 1;
        let (evict, evicted) = oneshot::channel();
        table.open.insert(id, Open { evict, idle: true });
        Some(Admitted { activity: Activity { table: Arc::clone(&self.table), id }, evicted })
    }

    /// How many are open (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.table).open.len()
    }
}

/// One connection's place; given back when dropped.
pub struct Admitted {
    activity: Activity,
    evicted: oneshot::Receiver<()>,
}

impl Admitted {
    /// Resolves once the connection is closed to make room for a newer
    /// one, which can only happen while it is idle: race it against
    /// reading the request.
    pub async fn evicted(&mut self) {
        if (&mut self.evicted).await.is_err() {
            // The sender goes only with the place, which this holds.
            std::future::pending::<()>().await;
        }
    }

    /// Its request is read: it is answered from now on, never closed to
    /// make room (how long that takes is bounded by the server).
    pub fn busy(&self) {
        self.activity.busy();
    }

    /// A handle that says when it is answered, for a server that answers
    /// more than one request on a connection (HTTP keep-alive) while this
    /// place waits on [`Self::evicted`].
    pub fn activity(&self) -> Activity {
        self.activity.clone()
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        lock(&self.activity.table).open.remove(&self.activity.id);
    }
}

/// Whether one connection is being answered, said as its requests come
/// and go; a clone says it of the same connection.
#[derive(Clone)]
pub struct Activity {
    table: Arc<Mutex<Table>>,
    id: u64,
}

impl Activity {
    /// A request is being answered: never closed to make room meanwhile.
    pub fn busy(&self) {
        self.set_idle(false);
    }

    /// Its answer is given and it waits for its next request: it may be
    /// closed to make room again.
    pub fn idle(&self) {
        self.set_idle(true);
    }

    fn set_idle(&self, idle: bool) {
        // Gone from the table: closed to make room already.
        if let Some(open) = lock(&self.table).open.get_mut(&self.id) {
            open.idle = idle;
        }
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
    fn a_kept_alive_connection_gives_way_again_once_answered() {
        let connections = Connections::new(2);
        let mut kept = connections.admit().expect("room");
        let other = connections.admit().expect("room");
        other.busy();
        let activity = kept.activity();
        activity.busy();
        assert!(connections.admit().is_none(), "both are being answered");
        activity.idle();
        let _newer = connections.admit().expect("the answered one makes room");
        assert!(was_evicted(&mut kept));
        // Its place is gone: saying it is answered again keeps none.
        activity.busy();
        assert_eq!(connections.len(), 2);
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
