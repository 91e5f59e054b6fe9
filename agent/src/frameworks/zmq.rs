//! ZMQ multipart messages, put together from signal probes on libzmq 4.3
//! (the `sglang` profile's `zmq_recv`, `zmq_data` and `zmq_send`).
//!
//! pyzmq's copying paths (what `recv_multipart` and `send_multipart` use
//! by default) call, per frame, on one thread:
//! - receive: `zmq_msg_recv(msg)` (returns the size), then
//!   `zmq_msg_data(msg)` (returns the data pointer) to copy the bytes out;
//! - send: `zmq_msg_init_size`, `zmq_msg_data`, a memcpy, then
//!   `zmq_msg_send(msg, socket, flags)`, so the frame is complete at the
//!   entry of `zmq_msg_send`.
//!
//! So a received frame is the `zmq_recv` return of a `msg`, paired with the
//! next `zmq_data` return for the same `msg` on the same thread (its first
//! 64 bytes, cut to the size); a sent frame is read from the `zmq_msg_t`
//! itself at `zmq_send`, since libzmq keeps a frame of up to 33 bytes
//! inline (a "very small message"), which is what SGLang's status messages
//! are made of. Whether more frames follow is the `more` flag of the
//! received `zmq_msg_t` and `ZMQ_SNDMORE` of a send. Layout of `zmq_msg_t`
//! in libzmq 4.3.5 (pyzmq 27.3.0's bundled copy; read off `zmq_msg_size`
//! and `zmq_msg_more`): inline data at +8 (33 bytes), the inline size at
//! +41, the type at +42 (101 for inline), flags at +43 (1 is `more`). The
//! probes capture 64 bytes from +8, so those are bytes 33, 34 and 35.
use std::collections::HashMap;

use stallwatch_common::EXT_ID_LEN;

/// Where in a `zmq_msg_t` capture (64 bytes from +8) the fields lie.
const VSM_SIZE_AT: usize = 33;
const TYPE_AT: usize = 34;
const FLAGS_AT: usize = 35;
/// `msg_t::type_vsm`: the frame's bytes are inline.
const TYPE_VSM: u8 = 101;
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
    /// `zmq_msg_recv` returned `size` (-1: nothing received) for `msg`;
    /// `tail` is the `zmq_msg_t` from +8.
    Recv { msg: u64, size: i64, tail: Option<&'a [u8; EXT_ID_LEN]> },
    /// `zmq_msg_data(msg)` returned, `data` its first bytes.
    Data { msg: u64, data: Option<&'a [u8]> },
    /// `zmq_msg_send` entered with `flags`, `tail` the `zmq_msg_t` from +8.
    Send { flags: u64, tail: Option<&'a [u8; EXT_ID_LEN]> },
}

/// Per-thread frame streams, turned into messages.
#[derive(Default)]
pub struct Assembler {
    threads: HashMap<(u32, u32), Thread>,
    /// Frames that could not be read (their `zmq_msg_t` unreadable) and
    /// messages given up (too many frames): counted, never a panic.
    pub garbled: u64,
}

#[derive(Default)]
struct Thread {
    /// A frame received, waiting for its bytes: (msg, size, more).
    pending: Option<(u64, usize, bool)>,
    /// The data of a `msg` no receive was seen for: a send filling its
    /// frame (its send follows), or the first frame of a message whose
    /// `zmq_msg_recv` began before the probes were attached (a thread
    /// blocked in it, waiting for the next message, when the agent
    /// started), which the next receive of the same `msg` reveals.
    orphan: Option<(u64, Box<[u8]>)>,
    incoming: Vec<Frame>,
    outgoing: Vec<Frame>,
}

impl Assembler {
    /// Take one hit of thread `tid` of `pid`; a message it completes is
    /// returned.
    pub fn hit(&mut self, pid: u32, tid: u32, ts_ns: u64, hit: Hit<'_>) -> Option<Message> {
        let thread = self.threads.entry((pid, tid)).or_default();
        let done = step(thread, hit, &mut self.garbled);
        let idle = thread.pending.is_none()
            && thread.orphan.is_none()
            && thread.incoming.is_empty()
            && thread.outgoing.is_empty();
        if idle {
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
        Hit::Recv { msg, size, tail } => {
            // A failed receive (EAGAIN, EINTR) is no frame.
            thread.pending = None;
            let orphan = thread.orphan.take();
            let size = usize::try_from(size).ok()?;
            if let Some((_, bytes)) = orphan.filter(|(orphan, _)| *orphan == msg && thread.incoming.is_empty()) {
                // Its length is unknown: what was read of it, incomplete.
                thread.incoming.push(Frame { bytes, complete: false });
            }
            let Some(tail) = tail else {
                *garbled += 1;
                return None;
            };
            thread.pending = Some((msg, size, tail[FLAGS_AT] & FLAG_MORE != 0));
            None
        }
        Hit::Data { msg, data } => {
            // Anything but the data of the frame just received (a send
            // filling its frame) is not a received frame.
            let Some((_, size, more)) = thread.pending.filter(|(pending, ..)| *pending == msg) else {
                thread.orphan = data.map(|data| (msg, data.into()));
                return None;
            };
            thread.pending = None;
            let frame = match data {
                Some(data) => Frame { bytes: data[..size.min(data.len())].into(), complete: size <= data.len() },
                None => {
                    *garbled += 1;
                    Frame { bytes: Box::default(), complete: size == 0 }
                }
            };
            push(&mut thread.incoming, frame, garbled);
            (!more).then(|| (Direction::Received, std::mem::take(&mut thread.incoming)))
        }
        Hit::Send { flags, tail } => {
            thread.orphan = None;
            let frame = match tail {
                Some(tail) if tail[TYPE_AT] == TYPE_VSM && usize::from(tail[VSM_SIZE_AT]) <= VSM_MAX => {
                    Frame { bytes: tail[..usize::from(tail[VSM_SIZE_AT])].into(), complete: true }
                }
                Some(_) => Frame { bytes: Box::default(), complete: false },
                None => {
                    *garbled += 1;
                    Frame { bytes: Box::default(), complete: false }
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
        tail[TYPE_AT] = if inline { TYPE_VSM } else { 102 };
        tail[FLAGS_AT] = u8::from(more);
        tail
    }

    fn receive(asm: &mut Assembler, tid: u32, msg: u64, bytes: &[u8], more: bool) -> Option<Message> {
        let tail = vsm(bytes, more);
        assert_eq!(asm.hit(1, tid, 5, Hit::Recv { msg, size: bytes.len() as i64, tail: Some(&tail) }), None);
        let mut data = [0x55; EXT_ID_LEN];
        let n = bytes.len().min(EXT_ID_LEN);
        data[..n].copy_from_slice(&bytes[..n]);
        asm.hit(1, tid, 6, Hit::Data { msg, data: Some(&data) })
    }

    fn texts(message: &Message) -> Vec<&[u8]> {
        message.frames.iter().map(|frame| &*frame.bytes).collect()
    }

    #[test]
    fn received_frames_pair_with_their_data_and_end_at_the_last() {
        let mut asm = Assembler::default();
        assert_eq!(receive(&mut asm, 7, 0x100, b"NixlMsgGuard", true), None);
        assert_eq!(receive(&mut asm, 7, 0x100, b"42", true), None);
        let long = [b'x'; 100];
        assert_eq!(receive(&mut asm, 7, 0x100, &long, true), None);
        let message = receive(&mut asm, 7, 0x100, b"", false).expect("a message");
        assert_eq!((message.direction, message.tid, message.ts_ns), (Direction::Received, 7, 6));
        assert_eq!(message.frames.len(), 4);
        assert_eq!(message.frames[0].whole(), Some(b"NixlMsgGuard".as_slice()));
        assert_eq!(message.frames[1].whole(), Some(b"42".as_slice()));
        assert_eq!((message.frames[2].bytes.len(), message.frames[2].complete), (EXT_ID_LEN, false));
        assert_eq!(message.frames[3].whole(), Some(b"".as_slice()));
        assert!(asm.threads.is_empty(), "nothing held between messages");
    }

    #[test]
    fn threads_are_apart_and_data_of_sends_or_failed_receives_is_no_frame() {
        let mut asm = Assembler::default();
        assert_eq!(receive(&mut asm, 1, 0x100, b"ABORT", true), None);
        // Another thread's message in between, and a send's fill of its frame.
        assert!(receive(&mut asm, 2, 0x200, b"solo", false).is_some());
        assert_eq!(asm.hit(1, 1, 7, Hit::Data { msg: 0x999, data: Some(&[0; EXT_ID_LEN]) }), None);
        // A receive that failed (EAGAIN) leaves no frame behind it.
        assert_eq!(asm.hit(1, 1, 7, Hit::Recv { msg: 0x100, size: -1, tail: None }), None);
        assert_eq!(asm.hit(1, 1, 7, Hit::Data { msg: 0x100, data: Some(&[0; EXT_ID_LEN]) }), None);
        let message = receive(&mut asm, 1, 0x100, b"7", false).expect("a message");
        assert_eq!(texts(&message), [b"ABORT".as_slice(), b"7"]);
        assert_eq!(asm.garbled, 0);
    }

    #[test]
    fn a_first_frame_received_before_the_probes_is_kept_incomplete() {
        let mut asm = Assembler::default();
        // The thread was inside zmq_msg_recv when the probes came: only the
        // data of its frame is seen; the next frame's receive of the same
        // msg says it was a received one.
        let mut first = [0x55; EXT_ID_LEN];
        first[..12].copy_from_slice(b"NixlMsgGuard");
        assert_eq!(asm.hit(1, 4, 1, Hit::Data { msg: 0x100, data: Some(&first) }), None);
        let message = receive(&mut asm, 4, 0x100, b"42", false).expect("a message");
        assert_eq!(message.frames.len(), 2);
        assert!(!message.frames[0].complete && message.frames[0].bytes.starts_with(b"NixlMsgGuard"));
        assert_eq!(message.frames[1].whole(), Some(b"42".as_slice()));
        // A send's fill of its frame is no received frame, nor is data of
        // another msg.
        asm.hit(1, 4, 2, Hit::Data { msg: 0x200, data: Some(&first) });
        let tail = vsm(b"x", false);
        assert!(asm.hit(1, 4, 2, Hit::Send { flags: 0, tail: Some(&tail) }).is_some());
        assert_eq!(texts(&receive(&mut asm, 4, 0x200, b"y", false).expect("a message")), [b"y".as_slice()]);
        asm.hit(1, 4, 3, Hit::Data { msg: 0x300, data: Some(&first) });
        assert_eq!(texts(&receive(&mut asm, 4, 0x100, b"z", false).expect("a message")), [b"z".as_slice()]);
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
        long[TYPE_AT] = 102;
        assert_eq!(asm.hit(1, 3, 9, Hit::Send { flags: SNDMORE, tail: Some(&long) }), None);
        let message = send(&mut asm, b"", false).expect("a message");
        assert_eq!(message.direction, Direction::Sent);
        assert_eq!(texts(&message), [b"KV_STATUS".as_slice(), b"1234567890123456789", b"4", b"", b""]);
        assert!(!message.frames[3].complete && message.frames[4].complete);
    }

    #[test]
    fn garbled_streams_are_counted_and_bounded_never_a_panic() {
        let mut asm = Assembler::default();
        // An unreadable zmq_msg_t, a size past the capture, an inline size
        // no inline frame has, a data read that failed.
        assert_eq!(asm.hit(1, 1, 1, Hit::Recv { msg: 1, size: 5, tail: None }), None);
        let mut bad = vsm(b"", false);
        bad[VSM_SIZE_AT] = 200;
        let message = asm.hit(1, 1, 1, Hit::Send { flags: 0, tail: Some(&bad) }).expect("a message");
        assert!(!message.frames[0].complete);
        let tail = vsm(b"abc", false);
        asm.hit(1, 1, 1, Hit::Recv { msg: 2, size: 3, tail: Some(&tail) });
        let message = asm.hit(1, 1, 1, Hit::Data { msg: 2, data: None }).expect("a message");
        assert!(!message.frames[0].complete);
        assert_eq!(asm.garbled, 2);
        // A lost end: the message is given up past MAX_FRAMES, counted.
        for _ in 0..MAX_FRAMES + 1 {
            assert_eq!(receive(&mut asm, 1, 3, b"f", true), None);
        }
        assert_eq!(asm.garbled, 3);
        assert_eq!(asm.threads[&(1, 1)].incoming.len(), 1);
        asm.forget(1);
        assert!(asm.threads.is_empty());
    }
}
