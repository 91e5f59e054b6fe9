//! Long frames of a multipart message read whole, for the message they
//! are part of: the `zmq_recv_long` signal reads a received frame longer
//! than libzmq keeps inline that has more frames after it, whole, up to
//! 16 128 bytes ([`strings`](crate::frameworks::strings) puts its chunks
//! back together), at the same `zmq_msg_close` where `zmq_recv` reads its
//! first 64 bytes and its size. What SGLang sends so is a destination's KV
//! page list (frame 5, 4 bytes a page: up to 4032 pages whole), which
//! tells every chunk of a room, not only those starting in its first 16
//! pages.
//!
//! A frame read whole is its message's when, once the message is put
//! together on the same thread, one of its frames read in part has that
//! length and those first bytes; the frames read whole are dropped as each
//! message received on the thread ends, so nothing outlives its message.
use std::collections::HashMap;

use super::rooms;
use crate::frameworks::{
    strings::{Assembler, Chunk},
    zmq::Message,
};

/// Frames read whole one message may have kept: SGLang's destination has
/// two long frames before its last (the agent name and the pages), its
/// registration of a decode rank a dozen; past that the oldest go.
const KEPT: usize = 16;

/// The long frames of the message each thread is receiving.
#[derive(Default)]
pub struct LongFrames {
    strings: Assembler,
    threads: HashMap<(u32, u32), Vec<Vec<u8>>>,
    /// Destinations whose pages were read whole.
    pub whole: u64,
    /// Long frames read cut short (past the signal's bound, or a chunk
    /// lost): their message is read as if they had not been.
    pub cut: u64,
}

impl LongFrames {
    /// One chunk of a long frame of thread `tid` (`slot`: the signal's).
    pub fn chunk(&mut self, pid: u32, tid: u32, slot: u32, chunk: &Chunk) {
        let Some(whole) = self.strings.chunk(pid, tid, slot, chunk) else { return };
        if !whole.complete {
            self.cut += 1;
            return;
        }
        let frames = self.threads.entry((pid, tid)).or_default();
        if frames.len() == KEPT {
            frames.remove(0);
        }
        frames.push(whole.text);
    }

    /// The message being received on thread `tid` ended: its long frames.
    pub fn take(&mut self, pid: u32, tid: u32) -> Vec<Vec<u8>> {
        self.threads.remove(&(pid, tid)).unwrap_or_default()
    }

    /// All the pages of the destination `message`, whose frame of pages
    /// was read in part as `head`: the frame among `long` with that
    /// frame's length and first bytes, if one is.
    pub fn pages(&mut self, long: Vec<Vec<u8>>, message: &Message, head: &[u32]) -> Option<Box<[u32]>> {
        let frame =
            message.frames.iter().find(|f| !f.complete && !head.is_empty() && *rooms::pages(&f.bytes) == *head)?;
        let whole = long.into_iter().find(|w| Some(w.len()) == frame.size && w.starts_with(&frame.bytes))?;
        self.whole += 1;
        Some(rooms::pages(&whole))
    }

    pub fn forget(&mut self, pid: u32) {
        self.strings.forget(pid);
        self.threads.retain(|(p, _), _| *p != pid);
    }
}
