//! ZMQ multipart messages, put together from signal probes on libzmq 4.3
//! (the `sglang` profile's `zmq_recv` and `zmq_send`), one entry probe a
//! frame.
//!
//! pyzmq's copying paths (what `recv_multipart` and `send_multipart` use
//! by default; pyzmq 27, `zmq/backend/cython/_zmq.py`) call, per frame, on
//! one thread:
//! - receive (`_recv_copy`): `zmq_msg_init(msg)`, `zmq_msg_recv(msg)`, the
//!   bytes copied out (`zmq_msg_data`, `zmq_msg_size`), then
//!   `zmq_msg_close(msg)`: at the entry of `zmq_msg_close` the frame is
//!   whole, its bytes, size and `more` flag in the `zmq_msg_t`;
//! - send (`_send_copy`): `zmq_msg_init_size`, `zmq_msg_data`, a memcpy,
//!   `zmq_msg_send(msg, socket, flags)`, then `zmq_msg_close(msg)` of the
//!   message libzmq emptied when it took it: the frame is whole at the
//!   entry of `zmq_msg_send`.
//!
//! So a received frame is one `zmq_recv` hit, a sent frame one `zmq_send`
//! hit. The closes that are no received frame (a sent message, emptied;
//! the empty message of a receive that failed, EAGAIN on every idle poll
//! of SGLang's scheduler) are dropped in the kernel by the signal's
//! `when`: libzmq's stream engines attach their connection's metadata to
//! every frame they receive (`stream_engine_base_t::decode_and_push`, for
//! tcp and ipc), and nothing else a process closes has any. libzmq itself
//! calls `zmq_msg_close` only from `zmq_send` (a failed send), `zmq_recv`
//! and `zmq_recviov` (a frame received, whole, as here) and `zmq_sendiov`;
//! its own code closes with `msg_t::close`.
//!
//! Layout of `zmq_msg_t` in libzmq 4.3.5 (pyzmq 27's bundled copy; read
//! off `zmq_msg_size`, `zmq_msg_more` and `msg_t::init`): the metadata
//! pointer at +0; inline data at +8 (a "very small message", up to 33
//! bytes), the inline size at +41, the type at +42 (101 inline, 102 long,
//! 105 zero-copy: a `content_t` pointer at +8, whose data pointer is at +0
//! and size at +8), flags at +43 (1 is `more`). `zmq_recv`'s value is the
//! `u64` at +40 (bytes 41 to 43 are size, type and flags), its `ret` the
//! long frame's size, its capture the frame's first 64 bytes wherever they
//! are. `zmq_send` captures 64 bytes from +8 (for an inline frame its
//! bytes, size, type and flags at 33, 34 and 35).
use std::collections::HashMap;

use stallwatch_common::EXT_ID_LEN;

/// Where in a `zmq_msg_t` capture (64 bytes from +8) the fields lie.
const VSM_SIZE_AT: usize = 33;
const TYPE_AT: usize = 34;
/// `msg_t::type_vsm`: the frame's bytes are inline.
const TYPE_VSM: u8 = 101;
/// `msg_t::type_lmsg` and `type_zclmsg`: behind a `content_t`.
const TYPE_LMSG: u8 = 102;
const TYPE_ZCLMSG: u8 = 105;
const VSM_MAX: usize = 33;
/// `msg_t::more`.
const FLAG_MORE: u8 = 1;
/// `ZMQ_SNDMORE` of `zmq_msg_send`'s flags.
const SNDMORE: u64 = 2;
/// Frames one message may have before it is given up as garbled (SGLang's
/// longest, a registration, has about 16).
pub const MAX_FRAMES: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Received,
    Sent,
}

/// One frame: its bytes, or only their first [`EXT_ID_LEN`] (or none, for
/// a sent frame libzmq does not keep inline) when `complete` is false.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub bytes: Box<[u8]>,
    pub complete: bool,
    /// Its length as libzmq holds it, where read (a received frame): what
    /// tells a whole copy of a long frame read by another signal for it.
    pub size: Option<usize>,
}

impl Frame {
    /// The whole frame, if it was read whole.
    pub fn whole(&self) -> Option<&[u8]> {
        self.complete.then_some(&*self.bytes)
    }
}

/// A multipart message one thread received or sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub pid: u32,
    pub tid: u32,
    /// When its last frame was seen.
    pub ts_ns: u64,
    pub direction: Direction,
    pub frames: Vec<Frame>,
}

/// One probe hit, as the signals carry it.
#[derive(Debug, Clone, Copy)]
pub enum Hit<'a> {
    /// A received frame closed (`zmq_msg_close`): `head` the `zmq_msg_t`'s
    /// `u64` at +40, `size` a long frame's size (read through its
    /// content), `data` its first bytes, wherever they are.
    Received { head: u64, size: i64, data: Option<&'a [u8]> },
    /// `zmq_msg_send` entered with `flags`, `tail` the `zmq_msg_t` from +8.
    Send { flags: u64, tail: Option<&'a [u8; EXT_ID_LEN]> },
}

/// Per-thread frame streams, turned into messages.
#[derive(Default)]
pub struct Assembler {
    threads: HashMap<(u32, u32), Thread>,
    /// Frames that could not be read (their `zmq_msg_t` unreadable, of a
    /// type no received frame has) and messages given up (too many
    /// frames): counted, never a panic.
    pub garbled: u64,
}

#[derive(Default)]
struct Thread {
    incoming: Vec<Frame>,
    outgoing: Vec<Frame>,
}

impl Assembler {
    /// Take one hit of thread `tid` of `pid`; a message it completes is
    /// returned.
    pub fn hit(&mut self, pid: u32, tid: u32, ts_ns: u64, hit: Hit<'_>) -> Option<Message> {
        let thread = self.threads.entry((pid, tid)).or_default();
        let done = step(thread, hit, &mut self.garbled);
        if thread.incoming.is_empty() && thread.outgoing.is_empty() {
            // A thread between messages holds nothing: no entry per thread
            // that ever spoke ZMQ.
            self.threads.remove(&(pid, tid));
        }
        let (direction, frames) = done.filter(|(_, frames)| !frames.is_empty())?;
        Some(Message { pid, tid, ts_ns, direction, frames })
    }

    /// The process is gone: its half-read messages with it.
    pub fn forget(&mut self, pid: u32) {
        self.threads.retain(|(p, _), _| *p != pid);
    }
}

/// One hit on one thread's streams: the message it ends, if it ends one.
fn step(thread: &mut Thread, hit: Hit<'_>, garbled: &mut u64) -> Option<(Direction, Vec<Frame>)> {
    match hit {
        Hit::Received { head, size, data } => {
            let [_, vsm_size, kind, flags, ..] = head.to_le_bytes();
            let size = match kind {
                TYPE_VSM if usize::from(vsm_size) <= VSM_MAX => Some(usize::from(vsm_size)),
                TYPE_LMSG | TYPE_ZCLMSG => usize::try_from(size).ok(),
                _ => None,
            };
            let frame = match (size, data) {
                (Some(size), Some(data)) => {
                    Frame { bytes: data[..size.min(data.len())].into(), complete: size <= data.len(), size: Some(size) }
                }
                (size, _) => {
                    *garbled += 1;
                    Frame { bytes: Box::default(), complete: size == Some(0), size }
                }
            };
            push(&mut thread.incoming, frame, garbled);
            (flags & FLAG_MORE == 0).then(|| (Direction::Received, std::mem::take(&mut thread.incoming)))
        }
        Hit::Send { flags, tail } => {
            let frame = match tail {
                Some(tail) if tail[TYPE_AT] == TYPE_VSM && usize::from(tail[VSM_SIZE_AT]) <= VSM_MAX => {
                    Frame { bytes: tail[..usize::from(tail[VSM_SIZE_AT])].into(), complete: true, size: None }
                }
                Some(_) => Frame { bytes: Box::default(), complete: false, size: None },
                None => {
                    *garbled += 1;
                    Frame { bytes: Box::default(), complete: false, size: None }
                }
            };
            push(&mut thread.outgoing, frame, garbled);
            (flags & SNDMORE == 0).then(|| (Direction::Sent, std::mem::take(&mut thread.outgoing)))
        }
    }
}

/// Add a frame; a message past [`MAX_FRAMES`] is garbled (a lost end
/// flag), so it is dropped, counted, and the stream starts over.
fn push(frames: &mut Vec<Frame>, frame: Frame, garbled: &mut u64) {
    if frames.len() >= MAX_FRAMES {
        frames.clear();
        *garbled += 1;
    }
    frames.push(frame);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `zmq_msg_t` from +8 holding `bytes` inline, `more` set or not.
    fn vsm(bytes: &[u8], more: bool) -> [u8; EXT_ID_LEN] {
        let mut tail = [0xAA; EXT_ID_LEN];
        let inline = bytes.len() <= VSM_MAX;
        if inline {
            tail[..bytes.len()].copy_from_slice(bytes);
            tail[VSM_SIZE_AT] = bytes.len() as u8;
        }
        tail[TYPE_AT] = if inline { TYPE_VSM } else { TYPE_LMSG };
        tail[35] = u8::from(more);
        tail
    }

    /// The `u64` at +40 of a `zmq_msg_t` of this type, inline size and `more`.
    fn head(kind: u8, vsm_size: u8, more: bool) -> u64 {
        u64::from_le_bytes([0x55, vsm_size, kind, u8::from(more), 0, 0, 0, 0])
    }

    /// A frame received and closed as pyzmq's `_recv_copy` does: what the
    /// `zmq_recv` signal reads at `zmq_msg_close`'s entry. Frames past 33
    /// bytes are zero-copy ones (type 105), as libzmq's decoder makes them.
    fn receive(asm: &mut Assembler, tid: u32, bytes: &[u8], more: bool) -> Option<Message> {
        let hit_head = if bytes.len() <= VSM_MAX {
            head(TYPE_VSM, bytes.len() as u8, more)
        } else {
            head(TYPE_ZCLMSG, 0x77, more)
        };
        let mut data = [0x55; EXT_ID_LEN];
        let n = bytes.len().min(EXT_ID_LEN);
        data[..n].copy_from_slice(&bytes[..n]);
        asm.hit(1, tid, 6, Hit::Received { head: hit_head, size: bytes.len() as i64, data: Some(&data) })
    }

    fn texts(message: &Message) -> Vec<&[u8]> {
        message.frames.iter().map(|frame| &*frame.bytes).collect()
    }

    #[test]
    fn received_frames_are_read_whole_at_their_close_and_end_at_the_last() {
        let mut asm = Assembler::default();
        assert_eq!(receive(&mut asm, 7, b"NixlMsgGuard", true), None);
        assert_eq!(receive(&mut asm, 7, b"42", true), None);
        let agent = [b'a'; 40];
        assert_eq!(receive(&mut asm, 7, &agent, true), None);
        let long = [b'x'; 100];
        assert_eq!(receive(&mut asm, 7, &long, true), None);
        let message = receive(&mut asm, 7, b"", false).expect("a message");
        assert_eq!((message.direction, message.tid, message.ts_ns), (Direction::Received, 7, 6));
        assert_eq!(message.frames.len(), 5);
        assert_eq!(message.frames[0].whole(), Some(b"NixlMsgGuard".as_slice()));
        assert_eq!(message.frames[1].whole(), Some(b"42".as_slice()));
        // A long frame of 34 to 64 bytes is whole, cut to its size.
        assert_eq!(message.frames[2].whole(), Some(agent.as_slice()));
        assert_eq!((message.frames[3].bytes.len(), message.frames[3].complete), (EXT_ID_LEN, false));
        assert_eq!(message.frames[3].size, Some(100), "a long frame's length, read where its bytes are not");
        assert_eq!(message.frames[4].whole(), Some(b"".as_slice()));
        assert!(asm.threads.is_empty(), "nothing held between messages");
        // A long message libzmq allocated (type 102) reads the same.
        let data = [b'y'; EXT_ID_LEN];
        let message = asm
            .hit(1, 7, 8, Hit::Received { head: head(TYPE_LMSG, 0, false), size: 50, data: Some(&data) })
            .expect("a message");
        assert_eq!(message.frames[0].whole(), Some(&data[..50]));
    }

    #[test]
    fn threads_are_apart_and_sends_between_frames_are_their_own() {
        let mut asm = Assembler::default();
        assert_eq!(receive(&mut asm, 1, b"ABORT", true), None);
        // Another thread's message in between, and a send of this one.
        assert!(receive(&mut asm, 2, b"solo", false).is_some());
        let tail = vsm(b"x", false);
        let sent = asm.hit(1, 1, 7, Hit::Send { flags: 0, tail: Some(&tail) }).expect("a sent message");
        assert_eq!(texts(&sent), [b"x".as_slice()]);
        let message = receive(&mut asm, 1, b"7", false).expect("a message");
        assert_eq!(texts(&message), [b"ABORT".as_slice(), b"7"]);
        assert_eq!(asm.garbled, 0);
        assert!(asm.threads.is_empty());
    }

    #[test]
    fn sent_frames_are_read_inline_and_end_without_sndmore() {
        let mut asm = Assembler::default();
        let send = |asm: &mut Assembler, bytes: &[u8], more: bool| {
            let tail = vsm(bytes, false);
            asm.hit(1, 3, 9, Hit::Send { flags: if more { SNDMORE } else { 0 }, tail: Some(&tail) })
        };
        assert_eq!(send(&mut asm, b"KV_STATUS", true), None);
        assert_eq!(send(&mut asm, b"1234567890123456789", true), None);
        assert_eq!(send(&mut asm, b"4", true), None);
        // A long frame (not inline): known to be there, its bytes not.
        let mut long = vsm(b"", false);
        long[TYPE_AT] = TYPE_LMSG;
        assert_eq!(asm.hit(1, 3, 9, Hit::Send { flags: SNDMORE, tail: Some(&long) }), None);
        let message = send(&mut asm, b"", false).expect("a message");
        assert_eq!(message.direction, Direction::Sent);
        assert_eq!(texts(&message), [b"KV_STATUS".as_slice(), b"1234567890123456789", b"4", b"", b""]);
        assert!(!message.frames[3].complete && message.frames[4].complete);
    }

    #[test]
    fn garbled_streams_are_counted_and_bounded_never_a_panic() {
        let mut asm = Assembler::default();
        // An unreadable frame, an inline size no inline frame has, a type
        // no received frame has (constant data, 104), a long frame whose
        // size could not be read, a sent inline size past 33.
        let unreadable = asm.hit(1, 1, 1, Hit::Received { head: head(TYPE_VSM, 5, false), size: 0, data: None });
        assert!(!unreadable.expect("a message").frames[0].complete);
        let data = [0; EXT_ID_LEN];
        for head in [head(TYPE_VSM, 200, false), head(104, 0, false), head(TYPE_LMSG, 0, false)] {
            let message = asm.hit(1, 1, 1, Hit::Received { head, size: -1, data: Some(&data) }).expect("a message");
            assert!(!message.frames[0].complete);
        }
        assert_eq!(asm.garbled, 4);
        let mut bad = vsm(b"", false);
        bad[VSM_SIZE_AT] = 200;
        let message = asm.hit(1, 1, 1, Hit::Send { flags: 0, tail: Some(&bad) }).expect("a message");
        assert!(!message.frames[0].complete);
        // A lost end: the message is given up past MAX_FRAMES, counted.
        for _ in 0..MAX_FRAMES + 1 {
            assert_eq!(receive(&mut asm, 1, b"f", true), None);
        }
        assert_eq!(asm.garbled, 5);
        assert_eq!(asm.threads[&(1, 1)].incoming.len(), 1);
        asm.forget(1);
        assert!(asm.threads.is_empty());
    }
}
