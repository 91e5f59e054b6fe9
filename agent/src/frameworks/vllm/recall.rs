//! A bounded memory of request ids, the oldest forgotten first: what the
//! agent remembers of requests a prefill no longer holds, so that a READ
//! arriving after their end is recognised (see [`super::Freed`]).
use std::collections::{HashMap, VecDeque};

/// How many ids a [`Recall`] keeps by default: minutes of requests at a
/// busy prefill's rate, a few hundred KiB.
pub const CAPACITY: usize = 4096;

pub struct Recall<V> {
    capacity: usize,
    order: VecDeque<Box<str>>,
    by_id: HashMap<Box<str>, V>,
}

impl<V> Default for Recall<V> {
    fn default() -> Self {
        Self::with_capacity(CAPACITY)
    }
}

impl<V> Recall<V> {
    pub fn with_capacity(capacity: usize) -> Self {
        Self { capacity, order: VecDeque::new(), by_id: HashMap::new() }
    }

    /// Remember `value` for `id` (replacing what was), forgetting the
    /// oldest id past the capacity.
    pub fn insert(&mut self, id: &str, value: V) {
        if self.by_id.insert(id.into(), value).is_none() {
            self.order.push_back(id.into());
        }
        while self.order.len() > self.capacity {
            if let Some(oldest) = self.order.pop_front() {
                self.by_id.remove(&oldest);
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<&V> {
        self.by_id.get(id)
    }

    pub fn get_mut(&mut self, id: &str) -> Option<&mut V> {
        self.by_id.get_mut(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_id_is_forgotten_first_and_a_repeat_keeps_its_place() {
        let mut recall = Recall::with_capacity(2);
        recall.insert("a", 1);
        recall.insert("b", 2);
        recall.insert("a", 3);
        recall.insert("c", 4);
        assert_eq!((recall.get("a"), recall.get("b"), recall.get("c")), (None, Some(&2), Some(&4)));
    }
}
