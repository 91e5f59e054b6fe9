//! Dummy destinations of rooms this process does not follow (yet): a
//! decode rank's destination that says it is no transfer this prefill
//! rank will make (SGLang's `is_dummy`: with MLA, a decode rank asks every
//! prefill rank of its group and only one of them for the KV). A room
//! every destination of which is a dummy is nothing of this process: no
//! chunk of it goes out and no status of it is sent (`conclude_transfer`
//! notifies only non-dummy destinations), so it must not start here,
//! even when its scheduler's request arrives after the destinations (the
//! router tells the decode before the tokenizer hands the request on).

use std::collections::{HashMap, VecDeque};

/// How many rooms' dummy answers are remembered, across processes: a
/// room's request follows its destinations within moments, so only the
/// latest matter.
const KEPT: usize = 4096;

/// Rooms not live that had dummy destinations, by (pid, room): how many,
/// of how many destinations the room has (`required_dst_info_num`).
#[derive(Default)]
pub struct Dummies {
    answers: HashMap<(u32, u64), (u32, u32)>,
    /// Oldest first, at most [`KEPT`].
    order: VecDeque<(u32, u64)>,
}

impl Dummies {
    /// One more dummy destination of `room` (of `ranks`).
    pub fn answer(&mut self, pid: u32, room: u64, ranks: u32) {
        let key = (pid, room);
        if !self.answers.contains_key(&key) {
            if self.order.len() == KEPT
                && let Some(oldest) = self.order.pop_front()
            {
                self.answers.remove(&oldest);
            }
            self.order.push_back(key);
        }
        let (count, of) = self.answers.entry(key).or_default();
        *count += 1;
        *of = ranks;
    }

    /// Whether every destination of `room` was a dummy.
    pub fn all(&self, pid: u32, room: u64) -> bool {
        self.answers.get(&(pid, room)).is_some_and(|&(count, of)| count >= of)
    }

    /// The room starts: its dummy destinations so far, now its own.
    pub fn take(&mut self, pid: u32, room: u64) -> u32 {
        let Some((count, _)) = self.answers.remove(&(pid, room)) else { return 0 };
        self.order.retain(|&key| key != (pid, room));
        count
    }

    pub fn forget(&mut self, pid: u32) {
        self.answers.retain(|(p, _), _| *p != pid);
        self.order.retain(|(p, _)| *p != pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dummy_answers_are_counted_per_room_and_bounded() {
        let mut dummies = Dummies::default();
        dummies.answer(1, 7, 2);
        assert!(!dummies.all(1, 7), "one of two");
        dummies.answer(1, 7, 2);
        assert!(dummies.all(1, 7) && !dummies.all(2, 7), "both");
        assert_eq!(dummies.take(1, 7), 2);
        assert_eq!((dummies.take(1, 7), dummies.all(1, 7)), (0, false));
        for room in 0..KEPT as u64 + 10 {
            dummies.answer(1, room, 1);
        }
        assert_eq!((dummies.answers.len(), dummies.order.len()), (KEPT, KEPT));
        assert!(!dummies.all(1, 0) && dummies.all(1, KEPT as u64 + 9), "the oldest go first");
        dummies.forget(1);
        assert!(dummies.answers.is_empty() && dummies.order.is_empty());
    }
}
