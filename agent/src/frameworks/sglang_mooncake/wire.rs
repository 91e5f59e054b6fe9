//! SGLang's bootstrap messages on its Mooncake backend (sglang 0.5.23,
//! `disaggregation/mooncake/conn.py`, `common/conn.py`), read into the
//! same [`Bootstrap`] values as the NIXL backend's, so the rooms are the
//! same code ([`crate::frameworks::sglang::Rooms`]).
//!
//! Mooncake's dialect has no guard tag: a decode rank's destination for a
//! room is `[room, ip, zmq port, session, kv indices (int32s), aux index,
//! state indices, required_dst_info_num, decode prefix len, device kv
//! indices]` (`TransferInfo.from_zmq`), its registration the same with
//! room `None` (`KVArgsRegisterInfo`, 20 frames); the prefill's status to
//! a decode is `[room, status, rank]` and maybe a reason (`kv_status_msg_tag`
//! is None on this backend); `[ABORT, room, ...]` and `[ABORT_ACK, room]`
//! as on every backend. The session (`"ip:rpc port"`) names the decode's
//! engine: it is the peer of every batch written to it, and its port the
//! sum SGLang picks a room's transfer worker by.
use crate::frameworks::{
    sglang::{Bootstrap, scheduler},
    zmq::{Direction, Message},
};

/// Frames of a destination a decode sends, at least (`TransferInfo`
/// reads frames 0 to 7).
const DESTINATION_FRAMES: usize = 8;

/// The room a message is about, if it is one of SGLang's on Mooncake; `Err`
/// for one whose first frame is a room but whose fields do not read as
/// SGLang writes them.
pub fn parse(message: &Message) -> Result<Option<Bootstrap>, String> {
    if let Some(scheduler) = scheduler(message) {
        return Ok(Some(scheduler));
    }
    let frame = |n: usize, what: &str| -> Result<&[u8], String> {
        let frame = message.frames.get(n).ok_or_else(|| format!("no frame {n} ({what})"))?;
        frame.whole().ok_or_else(|| format!("frame {n} ({what}) was not read whole"))
    };
    let number = |n: usize, what: &str| -> Result<u64, String> {
        let bytes = frame(n, what)?;
        decimal(bytes)
            .ok_or_else(|| format!("frame {n} ({what}) is {:?}, not a decimal number", String::from_utf8_lossy(bytes)))
    };
    let Some(first) = message.frames.first().and_then(|frame| frame.whole()) else { return Ok(None) };
    if first == b"ABORT" {
        return Ok(Some(Bootstrap::Abort { room: number(1, "room")? }));
    }
    // Anything else untagged starts with a room in decimal (a registration
    // with `None`, other backends' and SGLang's other messages with a tag).
    let Some(room) = decimal(first) else { return Ok(None) };
    let frames = message.frames.len();
    Ok(Some(match (message.direction, frames) {
        (_, 3 | 4) => {
            let status = u8::try_from(number(1, "status")?).map_err(|_| "frame 1 (status) is past 255".to_owned())?;
            Bootstrap::Status { room, status }
        }
        (Direction::Received, n) if n >= DESTINATION_FRAMES => {
            let session = frame(3, "session")?;
            let port = session_port(session)
                .ok_or_else(|| format!("frame 3 (session) is {:?}, not ip:port", String::from_utf8_lossy(session)))?;
            let ranks = u32::try_from(number(7, "required_dst_info_num")?)
                .map_err(|_| "frame 7 (required_dst_info_num) is past 2^32".to_owned())?;
            let pages = message.frames.get(4).map_or_else(Default::default, |frame| {
                frame.bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            });
            Bootstrap::Destination { room, port, agent: String::from_utf8_lossy(session).into(), ranks, pages }
        }
        // A decode's own destination: only its room is read (what follows
        // may be past what libzmq keeps inline, all a send is read from).
        (Direction::Sent, n) if n >= DESTINATION_FRAMES => Bootstrap::Asked { room },
        _ => return Ok(None),
    }))
}

/// A decimal number, as SGLang writes rooms and statuses (ASCII).
fn decimal(bytes: &[u8]) -> Option<u64> {
    std::str::from_utf8(bytes).ok().filter(|text| !text.is_empty()).and_then(|text| text.parse().ok())
}

/// The port of a Mooncake session id, `"ip:port"` (`[v6]:port` too).
pub fn session_port(session: &[u8]) -> Option<u16> {
    let text = std::str::from_utf8(session).ok()?;
    text.rsplit_once(':')?.1.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frameworks::zmq::Frame;

    fn message(direction: Direction, frames: &[&[u8]]) -> Message {
        let frames = frames
            .iter()
            .map(|bytes| Frame { bytes: (*bytes).into(), complete: true, size: Some(bytes.len()) })
            .collect();
        Message { pid: 1, tid: 2, ts_ns: 3, direction, frames }
    }

    #[test]
    fn mooncakes_untagged_messages_name_their_room() {
        use Direction::{Received, Sent};
        let pages: &[u8] = &[7, 0, 0, 0, 8, 0, 0, 0];
        let destination =
            [&b"8070450532247928832"[..], b"127.0.0.1", b"40001", b"127.0.0.1:15290", pages, b"3", b"", b"2", b"", b""];
        assert_eq!(
            parse(&message(Received, &destination)),
            Ok(Some(Bootstrap::Destination {
                room: 8070450532247928832,
                port: 15290,
                agent: "127.0.0.1:15290".into(),
                ranks: 2,
                pages: [7, 8].into(),
            }))
        );
        assert_eq!(parse(&message(Sent, &destination)), Ok(Some(Bootstrap::Asked { room: 8070450532247928832 })));
        let mut registration = destination;
        registration[0] = b"None";
        assert_eq!(parse(&message(Received, &registration)), Ok(None), "a registration is no room");
        assert_eq!(parse(&message(Sent, &[b"12", b"4", b"0"])), Ok(Some(Bootstrap::Status { room: 12, status: 4 })));
        assert_eq!(
            parse(&message(Received, &[b"12", b"0", b"0", b"Failed to send kv chunk"])),
            Ok(Some(Bootstrap::Status { room: 12, status: 0 }))
        );
        assert_eq!(
            parse(&message(Received, &[b"ABORT", b"12", b"127.0.0.1"])),
            Ok(Some(Bootstrap::Abort { room: 12 }))
        );
        assert_eq!(parse(&message(Received, &[b"ABORT_ACK", b"12"])), Ok(None));
        assert_eq!(parse(&message(Received, &[b"WATERMARK", b"1", b"2"])), Ok(None));
        assert_eq!(parse(&message(Received, &[b"NixlMsgGuard", b"12", b"x"])), Ok(None), "NIXL's is not this");
        assert_eq!(parse(&message(Received, &[b"12", b"x"])), Ok(None), "two frames: nothing SGLang sends");
        let err = parse(&message(Received, &[b"12", b"Success", b"0"])).unwrap_err();
        assert!(err.contains("frame 1 (status)"), "{err}");
        let mut bad = destination;
        bad[3] = b"no-port";
        assert!(parse(&message(Received, &bad)).unwrap_err().contains("not ip:port"));
        assert_eq!(session_port(b"[::1]:15290"), Some(15290));
    }
}
