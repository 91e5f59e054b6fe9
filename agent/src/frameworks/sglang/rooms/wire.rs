//! SGLang's bootstrap and scheduler messages as they travel over ZMQ
//! (sglang 0.5.23's `disaggregation/nixl/conn.py` and
//! `srt/managers/io_struct.py`): what one message says of a room, read
//! from its frames, its msgpack or its pickle. No state: [`super::Rooms`]
//! follows the rooms these messages tell of.
use crate::frameworks::zmq::{Direction, Frame, Message};

pub(super) const GUARD: &[u8] = b"NixlMsgGuard";
pub(super) const ABORT: &[u8] = b"ABORT";
pub(super) const KV_STATUS: &[u8] = b"KV_STATUS";
/// KVPoll.Failed and KVPoll.Success.
pub(super) const FAILED: u8 = 0;
pub(super) const SUCCESS: u8 = 4;

/// What one bootstrap message says of a room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bootstrap {
    /// A decode rank's destination for `room`, on its PULL `port`, its
    /// NIXL agent named `agent`; the room has `ranks` decode ranks
    /// (`required_dst_info_num`), each of which sends one.
    /// `pages`: the decode's KV pages for the room (frame 5, int32s): all
    /// of them where the frame was read whole (the `zmq_recv_long` signal,
    /// up to 4032 pages), else as many as its first 64 bytes hold (16).
    Destination { room: u64, port: u16, agent: Box<str>, ranks: u32, pages: Box<[u32]> },
    /// A decode rank's destination for `room` (of `ranks`) that is no
    /// transfer of this prefill rank (SGLang's `is_dummy`: frame 10 says
    /// 1, or, with no such frame, no pages and no decode prefix length):
    /// with MLA a decode rank asks every prefill rank of its group, and
    /// only one for the KV. It answers for the room and moves nothing.
    Dummy { room: u64, ranks: u32 },
    /// This process, a decode rank, sent its destination for `room`: it
    /// asks for the room's KV.
    Asked { room: u64 },
    /// The decode gave the room up (received by the prefill, sent by the
    /// decode).
    Abort { room: u64 },
    /// A KVPoll status: sent by the prefill to a decode, received by it.
    Status { room: u64, status: u8 },
    /// The scheduler received the request `room` (SGLang's tokenizer sends
    /// it a `TokenizedGenerateReqInput`; its `rid` begins with `rid`):
    /// the process has the room before any decode answers for it.
    Request { room: u64, rid: Rid },
    /// The scheduler was told to abort the request whose `rid` begins with
    /// `rid` (an `AbortReq`).
    AbortRequest { rid: Rid },
    /// The scheduler streamed the output of the requests `rids` (the first
    /// of its batch, as many as [`output_rids`] could read): it is done with
    /// them. A disaggregated prefill streams a request only when it
    /// finished (`disaggregation/prefill.py`: transferred, failed, aborted,
    /// or refused). A room not yet bootstrapped (a destination missing) at
    /// its output cannot have been transferred: the prefill ended it itself
    /// with no message to the decode, by its bootstrap timeout
    /// (`CommonKVSender._check_bootstrap_timeout`) or `abort()` on an
    /// `AbortReq` this agent did not read, so it fails. A bootstrapped
    /// room's output ends nothing: it may come before the room's KV_STATUS
    /// Success (`conclude_transfer` sets the status the scheduler polls,
    /// then sends it), and its status, an ABORT or its transfers end it.
    Output { rids: Vec<Rid> },
}

/// The first bytes of a request id (`rid`), as many as fit in what is read
/// of both a request and an abort: enough to tell requests apart (SGLang's
/// rids are 32 hex digits), never longer than [`RID_KEPT`].
pub type Rid = Box<[u8]>;

/// How much of a `rid` is kept: what a 64-byte read of a
/// `TokenizedGenerateReqInput` holds past its array header and tag.
pub const RID_KEPT: usize = 24;

/// SGLang's scheduler messages (msgspec tagged `array_like` structs in
/// msgpack, `srt/managers/io_struct.py`), by their tag, element 0.
pub(super) const REQUEST_TAG: &[u8] = b"TokenizedGenerateReqInput";
pub(super) const ABORT_REQUEST_TAG: &[u8] = b"AbortReq";

/// What a received frame that is a scheduler message says, from its first
/// bytes: the message's tag and its `rid` (element 1), if it is one of
/// [`REQUEST_TAG`] or [`ABORT_REQUEST_TAG`].
fn scheduler_message(frame: &[u8]) -> Option<(&'static [u8], Rid)> {
    use stallwatch_common::msgpack;
    let head = |at: usize| head(frame, at);
    let (_, header) = msgpack::array(&head(0)?)?;
    let at = usize::try_from(header).ok()?;
    let (len, header) = msgpack::str(&head(at)?)?;
    let tag_at = at + usize::try_from(header).ok()?;
    let tag = frame.get(tag_at..tag_at + usize::try_from(len).ok()?)?;
    let tag = [REQUEST_TAG, ABORT_REQUEST_TAG].into_iter().find(|known| *known == tag)?;
    let rid_at = tag_at + tag.len();
    let (len, header) = msgpack::str(&head(rid_at)?)?;
    let from = rid_at + usize::try_from(header).ok()?;
    let kept = usize::try_from(len).ok()?.min(RID_KEPT);
    Some((tag, frame.get(from..from + kept)?.into()))
}

/// The msgpack header at `at` of `bytes` (zero-padded past their end).
fn head(bytes: &[u8], at: usize) -> Option<[u8; stallwatch_common::MSGPACK_HEAD]> {
    let mut head = [0; stallwatch_common::MSGPACK_HEAD];
    let bytes = bytes.get(at..)?;
    let n = bytes.len().min(head.len());
    head[..n].copy_from_slice(&bytes[..n]);
    Some(head)
}

/// The rids of a scheduler output (`BatchTokenIDOutput`'s `rids`, a
/// msgpack array of strings, as the `sglang_output_rids` signal captures
/// it: its first 64 bytes), each cut to [`RID_KEPT`] as a request's is;
/// only those read far enough to tell (whole, or [`RID_KEPT`] bytes of it).
/// With SGLang's 32-digit rids that is the batch's first.
pub fn output_rids(bytes: &[u8]) -> Vec<Rid> {
    use stallwatch_common::msgpack;
    let mut rids = Vec::new();
    let Some((len, mut at)) = head(bytes, 0).and_then(|h| msgpack::array(&h)) else { return rids };
    for _ in 0..len {
        let Some((len, header)) = head(bytes, at as usize).and_then(|h| msgpack::str(&h)) else { break };
        let from = (at + header) as usize;
        let kept = (len as usize).min(RID_KEPT);
        let Some(rid) = bytes.get(from..from + kept) else { break };
        rids.push(rid.into());
        at += header + len;
    }
    rids
}

/// A request or abort SGLang's scheduler received (its rid; the request's
/// room is read apart, from the same receive: see `Sglang::request`),
/// whatever the transfer backend: the scheduler's IPC is the same.
pub fn scheduler(message: &Message) -> Option<Bootstrap> {
    let (Direction::Received, [frame]) = (message.direction, &message.frames[..]) else { return None };
    let (tag, rid) = scheduler_message(&frame.bytes)?;
    Some(if tag == REQUEST_TAG { Bootstrap::Request { room: 0, rid } } else { Bootstrap::AbortRequest { rid } })
}

/// What one record of a pickled scheduler message says (SGLang's default
/// IPC, `SGLANG_USE_PICKLE_IPC`: `send_pyobj`, one frame): a record of the
/// `sglang_request_pickle` signal holds a `TokenizedGenerateReqInput`'s
/// `bootstrap_room` (its first 16 bytes, a pickle integer) and `rid` (the
/// rest, a pickle string) when its tag is 0, an `AbortReq`'s `rid` when it
/// is 1; one of `sglang_output_pickle` is one rid of a `BatchTokenIDOutput`.
/// `Err` for a record that does not read so.
pub fn pickled_record(signal: &str, tag: Option<u8>, bytes: &[u8]) -> Result<Bootstrap, String> {
    use stallwatch_common::{PICKLE_FIRST_WIDTH, pickle};
    let rid = |bytes: &[u8], what: &str| -> Result<Rid, String> {
        let (body, len) = pickle::str(bytes).ok_or_else(|| format!("{what}'s rid is no pickled string"))?;
        let kept = usize::try_from(len).map_or(RID_KEPT, |len| len.min(RID_KEPT));
        body.get(..kept).map(Rid::from).ok_or_else(|| format!("{what}'s rid was read short ({} bytes)", body.len()))
    };
    match (signal, tag) {
        ("sglang_request_pickle", Some(0)) => {
            let room = pickle::uint(&bytes[..PICKLE_FIRST_WIDTH.min(bytes.len())])
                .ok_or("a pickled request's bootstrap_room is no unsigned integer")?;
            let rid = rid(bytes.get(PICKLE_FIRST_WIDTH..).unwrap_or_default(), "a pickled request")?;
            Ok(Bootstrap::Request { room, rid })
        }
        ("sglang_request_pickle", Some(1)) => Ok(Bootstrap::AbortRequest {
            rid: rid(bytes.get(PICKLE_FIRST_WIDTH..).unwrap_or_default(), "an AbortReq")?,
        }),
        ("sglang_output_pickle", Some(_)) => Ok(Bootstrap::Output { rids: vec![rid(bytes, "a scheduler output")?] }),
        _ => Err(format!("a {signal} record with tag {tag:?}: the profile's tags are not what SGLang's are")),
    }
}

/// The room a message is about, if it is one of SGLang's; `Err` for one of
/// SGLang's (by its tag) whose fields do not read as SGLang writes them.
pub fn parse(message: &Message) -> Result<Option<Bootstrap>, String> {
    let frame = |n: usize, what: &str| -> Result<&[u8], String> {
        let frame = message.frames.get(n).ok_or_else(|| format!("no frame {n} ({what})"))?;
        frame.whole().ok_or_else(|| format!("frame {n} ({what}) was not read whole"))
    };
    let number = |n: usize, what: &str| -> Result<u64, String> {
        let bytes = frame(n, what)?;
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.parse::<u64>().ok())
            .ok_or_else(|| format!("frame {n} ({what}) is {:?}, not a decimal number", String::from_utf8_lossy(bytes)))
    };
    if let Some(scheduler) = scheduler(message) {
        return Ok(Some(scheduler));
    }
    let Some(tag) = message.frames.first().and_then(tag_of) else {
        return Ok(None);
    };
    let parsed = match (message.direction, tag) {
        (Direction::Received, GUARD) => {
            if frame(1, "room")? == b"None" {
                return Ok(None);
            }
            let room = number(1, "room")?;
            let port = u16::try_from(number(3, "port")?).map_err(|_| "frame 3 (port) is past 65535".to_owned())?;
            let agent = String::from_utf8_lossy(frame(4, "agent name")?).into();
            let ranks = u32::try_from(number(7, "required_dst_info_num")?)
                .map_err(|_| "frame 7 (required_dst_info_num) is past 2^32".to_owned())?;
            // As much of the page list as was read: whole or not, its first
            // pages are the room's.
            let pages: Box<[u32]> = message.frames.get(5).map_or_else(Default::default, |frame| pages(&frame.bytes));
            // `TransferInfo.from_zmq`: frame 10 when there is one, else no
            // pages (frame 5 read whole and empty) and no prefix length.
            let dummy = match message.frames.get(10).filter(|frame| !frame.complete || !frame.bytes.is_empty()) {
                Some(_) => number(10, "is_dummy")? != 0,
                None => {
                    let empty = message.frames.get(5).and_then(Frame::whole).is_some_and(<[u8]>::is_empty);
                    let prefix = match message.frames.get(9).filter(|frame| !frame.complete || !frame.bytes.is_empty())
                    {
                        Some(_) => number(9, "decode prefix len")?,
                        None => 0,
                    };
                    empty && prefix == 0
                }
            };
            if dummy {
                Bootstrap::Dummy { room, ranks }
            } else {
                Bootstrap::Destination { room, port, agent, ranks, pages }
            }
        }
        // A decode's own destination: only its room is read (the frames
        // after it, the agent name among them, may be past what libzmq
        // keeps inline, which is all a send is read from).
        (Direction::Sent, GUARD) => {
            if frame(1, "room")? == b"None" {
                return Ok(None);
            }
            Bootstrap::Asked { room: number(1, "room")? }
        }
        (_, ABORT) => Bootstrap::Abort { room: number(1, "room")? },
        (_, KV_STATUS) => {
            let status = u8::try_from(number(2, "status")?).map_err(|_| "frame 2 (status) is past 255".to_owned())?;
            Bootstrap::Status { room: number(1, "room")?, status }
        }
        _ => return Ok(None),
    };
    Ok(Some(parsed))
}

/// KV page indices as SGLang sends them (`np.int32`, little-endian on
/// every platform it runs on): as many whole ones as `bytes` hold.
pub fn pages(bytes: &[u8]) -> Box<[u32]> {
    bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// A message's tag: its first frame, or, when only its first bytes were
/// read (a frame whose receive began before the probes), the tag it starts
/// with; the frames after it must still read as SGLang's.
fn tag_of(frame: &Frame) -> Option<&[u8]> {
    match frame.whole() {
        Some(whole) => Some(whole),
        None => [GUARD, ABORT].into_iter().find(|tag| frame.bytes.starts_with(tag)),
    }
}
