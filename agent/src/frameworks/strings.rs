//! The strings a signal's `strings` walk sends ([`StringWalk`]), put back
//! together: the kernel sends each string in chunks of [`CHUNK_LEN`]
//! bytes, one record each, in order on the thread that made the call;
//! here they become whole strings, each marked whole or cut short (the
//! walk's `bytes` bound, or a chunk lost to a full ring buffer).
//!
//! [`StringWalk`]: stallwatch_common::StringWalk
use std::collections::HashMap;

use stallwatch_common::{CHUNK_LEN, EXT_ID_LEN, Event, chunk, event_flags};

/// One chunk record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The string's full length.
    pub len: u32,
    /// Its number among the strings of the hit.
    pub item: u16,
    /// The chunk's number in the string.
    pub index: u8,
    /// The last chunk the kernel sends of the string.
    pub last: bool,
    pub text: Box<[u8]>,
}

impl Chunk {
    pub fn of(event: &Event) -> Self {
        let (len, item, index, last) = chunk::unpack(event.ret);
        let end = if event.flags & event_flags::RAW != 0 {
            // Bytes: as many as this chunk's share of the string.
            let left = u64::from(len).saturating_sub(u64::from(index) * CHUNK_LEN).min(CHUNK_LEN);
            left as usize
        } else {
            event.ext.iter().position(|&b| b == 0).unwrap_or(EXT_ID_LEN)
        };
        Self { len, item, index, last, text: event.ext[..end].into() }
    }
}

/// A string put back together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Whole {
    pub text: Vec<u8>,
    /// Every byte of it arrived (else it was cut short: read no further
    /// than its last complete part).
    pub complete: bool,
}

/// The strings being put together, per (pid, tid, slot).
#[derive(Default)]
pub struct Assembler {
    open: HashMap<(u32, u32, u32), Open>,
    /// Strings that arrived cut short.
    pub cut: u64,
}

struct Open {
    item: u16,
    next: u8,
    len: u32,
    text: Vec<u8>,
    /// A chunk went missing: the string cannot be whole.
    gap: bool,
}

impl Assembler {
    /// One chunk of `(pid, tid, slot)`: the string it ends, if it does.
    pub fn chunk(&mut self, pid: u32, tid: u32, slot: u32, chunk: &Chunk) -> Option<Whole> {
        let key = (pid, tid, slot);
        let open = self.open.entry(key).or_insert_with(|| Open {
            item: chunk.item,
            next: 0,
            len: chunk.len,
            text: Vec::new(),
            gap: false,
        });
        if open.item != chunk.item || chunk.index == 0 {
            // A new string: whatever was open lost its end.
            *open = Open { item: chunk.item, next: 0, len: chunk.len, text: Vec::new(), gap: false };
        }
        if chunk.index != open.next {
            open.gap = true;
        }
        open.text.extend_from_slice(&chunk.text);
        open.next = chunk.index.wrapping_add(1);
        // A chunk shorter than its share before the string's end: its read
        // stopped early (a NUL inside, or unreadable memory).
        let share = (chunk.len as usize).saturating_sub(usize::from(chunk.index) * CHUNK_LEN as usize);
        if chunk.text.len() < share.min(CHUNK_LEN as usize) {
            open.gap = true;
        }
        if !chunk.last {
            return None;
        }
        let open = self.open.remove(&key)?;
        let complete = !open.gap && open.text.len() >= open.len as usize;
        if !complete {
            self.cut += 1;
        }
        let mut text = open.text;
        text.truncate(open.len as usize);
        Some(Whole { text, complete })
    }

    pub fn forget(&mut self, pid: u32) {
        self.open.retain(|(p, _, _), _| *p != pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(len: u32, item: u16, index: u8, last: bool, text: &[u8]) -> Chunk {
        Chunk { len, item, index, last, text: text.into() }
    }

    #[test]
    fn a_string_comes_back_whole_from_its_chunks_and_a_cut_one_says_so() {
        let mut strings = Assembler::default();
        assert_eq!(
            strings.chunk(1, 2, 3, &chunk(7, 0, 0, true, b"req-1:1")),
            Some(Whole { text: b"req-1:1".to_vec(), complete: true })
        );
        let long = vec![b'a'; 63];
        assert_eq!(strings.chunk(1, 2, 3, &chunk(70, 1, 0, false, &long)), None);
        // Another thread's string in between changes nothing.
        assert!(strings.chunk(1, 9, 3, &chunk(2, 0, 0, true, b"HB")).is_some());
        let whole = strings.chunk(1, 2, 3, &chunk(70, 1, 1, true, b"bbbbbbb")).expect("the end");
        assert_eq!((whole.text.len(), whole.complete), (70, true));
        // The kernel's `bytes` bound: the last chunk sent before the end.
        let cut = strings.chunk(1, 2, 3, &chunk(200, 2, 0, true, &long)).expect("cut");
        assert_eq!((cut.text.len(), cut.complete, strings.cut), (63, false, 1));
        // A lost chunk (a full ring buffer) leaves a gap.
        strings.chunk(1, 2, 3, &chunk(130, 3, 0, false, &long));
        let gapped = strings.chunk(1, 2, 3, &chunk(130, 3, 2, true, b"cccc")).expect("ended");
        assert!(!gapped.complete);
        // A new string before the last one ended: that one is dropped.
        strings.chunk(1, 2, 3, &chunk(130, 4, 0, false, &long));
        assert_eq!(strings.chunk(1, 2, 3, &chunk(5, 0, 0, true, b"HB:ab")).map(|w| w.complete), Some(true));
        assert_eq!(strings.chunk(1, 2, 3, &chunk(0, 0, 0, true, b"")).map(|w| w.text), Some(Vec::new()));
    }
}
