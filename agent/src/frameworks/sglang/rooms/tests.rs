//! Rooms from SGLang's bootstrap traffic and the NIXL handles that move
//! their KV, on messages and events as SGLang 0.5.23 makes them.
use super::{
    wire::{ABORT, ABORT_REQUEST_TAG, GUARD, KV_STATUS, REQUEST_TAG},
    *,
};
use crate::{
    frameworks::zmq::{Direction, Frame, Message},
    lifecycle::Outcome,
};

/// A decode rank's destination for `room` on port 1, no pages read.
fn destination(room: u64, agent: &str, ranks: u32) -> Bootstrap {
    Bootstrap::Destination { room, port: 1, agent: agent.into(), ranks, pages: Default::default() }
}

/// The one decode rank `d`'s destination for `room`, its first KV
/// pages `pages`.
fn to_pages(room: u64, pages: &[u32]) -> Bootstrap {
    Bootstrap::Destination { room, port: 1, agent: "d".into(), ranks: 1, pages: pages.into() }
}

fn message(direction: Direction, frames: &[&[u8]]) -> Message {
    let frames =
        frames.iter().map(|bytes| Frame { bytes: (*bytes).into(), complete: true, size: Some(bytes.len()) }).collect();
    Message { pid: 1, tid: 2, ts_ns: 3, direction, frames }
}

#[test]
fn sglangs_messages_name_their_room_and_others_are_not_sglangs() {
    use Direction::{Received, Sent};
    let info = message(
        Received,
        &[GUARD, b"8070450532247928832", b"127.0.0.1", b"40001", b"decode-0", b"\0\0\0\0", b"3", b"2"],
    );
    let destination = Bootstrap::Destination {
        room: 8070450532247928832,
        port: 40001,
        agent: "decode-0".into(),
        ranks: 2,
        pages: [0].into(),
    };
    assert_eq!(parse(&info), Ok(Some(destination)));
    let registration = message(Received, &[GUARD, b"None", b"127.0.0.1", b"40001"]);
    assert_eq!(parse(&registration), Ok(None));
    assert_eq!(
        parse(&message(Received, &[ABORT, b"17", b"127.0.0.1", b"40001", b"1"])),
        Ok(Some(Bootstrap::Abort { room: 17 }))
    );
    let status = message(Sent, &[KV_STATUS, b"17", b"4", b"0", b""]);
    assert_eq!(parse(&status), Ok(Some(Bootstrap::Status { room: 17, status: 4 })));
    // The decode's end of the same messages: its destination sent (only
    // the room read), its ABORT sent, the status received.
    let mut asked = message(Sent, &[GUARD, b"17", b"127.0.0.1", b"40001", b"", b"", b"3", b"1"]);
    asked.frames[4].complete = false;
    assert_eq!(parse(&asked), Ok(Some(Bootstrap::Asked { room: 17 })));
    assert_eq!(parse(&message(Sent, &[GUARD, b"None", b"127.0.0.1"])), Ok(None), "its registration");
    assert_eq!(
        parse(&message(Sent, &[ABORT, b"17", b"127.0.0.1", b"40001", b"1"])),
        Ok(Some(Bootstrap::Abort { room: 17 }))
    );
    assert_eq!(
        parse(&message(Received, &[KV_STATUS, b"17", b"4"])),
        Ok(Some(Bootstrap::Status { room: 17, status: 4 }))
    );
    assert_eq!(parse(&message(Received, &[b"hello"])), Ok(None));
    // A first frame read in part (its receive began before the probes).
    let mut cut = message(Received, &[b"NixlMsgGuard\x55\x55", b"5", b"ip", b"40001", b"d", b"\x05\0\0\0", b"0", b"1"]);
    cut.frames[0].complete = false;
    assert_eq!(
        parse(&cut),
        Ok(Some(Bootstrap::Destination { room: 5, port: 40001, agent: "d".into(), ranks: 1, pages: [5].into() }))
    );
    cut.frames[0].bytes = b"NixlMsgGuar".as_slice().into();
    assert_eq!(parse(&cut), Ok(None));
}

#[test]
fn truncated_or_garbled_messages_of_sglang_say_what_is_wrong() {
    use Direction::{Received, Sent};
    let err = parse(&message(Received, &[GUARD, b"12x"])).unwrap_err();
    assert!(err.contains("frame 1 (room)") && err.contains("12x"), "{err}");
    let err = parse(&message(Received, &[GUARD, b"12", b"ip"])).unwrap_err();
    assert!(err.contains("no frame 3 (port)"), "{err}");
    let err = parse(&message(Received, &[GUARD, b"12", b"ip", b"70000"])).unwrap_err();
    assert!(err.contains("past 65535"), "{err}");
    let err = parse(&message(Received, &[GUARD, b"12", b"ip", b"1", b"d", b"", b"0"])).unwrap_err();
    assert!(err.contains("no frame 7 (required_dst_info_num)"), "{err}");
    let mut cut = message(Sent, &[KV_STATUS, b"12", b"4"]);
    cut.frames[1].complete = false;
    assert!(parse(&cut).unwrap_err().contains("not read whole"));
    assert_eq!(parse(&message(Sent, &[])), Ok(None));
}

#[test]
fn a_room_starts_at_its_first_destination_and_ends_once() {
    let mut rooms = Rooms::default();
    let destination = destination(9, "d", 2);
    let start = rooms.observe(4, 10, &destination).expect("enqueued");
    assert_eq!(
        (start.key, start.stage, start.ts_ns, start.external_id.as_deref()),
        (9, Stage::Enqueued, 10, Some("9"))
    );
    // The second decode rank's destination of the same room.
    assert_eq!(rooms.observe(4, 11, &destination), None);
    // Not an end yet; then Success to each rank: released once.
    assert_eq!(rooms.observe(4, 12, &Bootstrap::Status { room: 9, status: 3 }), None);
    assert_eq!(
        rooms.observe(4, 13, &Bootstrap::Status { room: 9, status: SUCCESS }).map(|o| o.stage),
        Some(Stage::Released)
    );
    assert_eq!(rooms.observe(4, 14, &Bootstrap::Status { room: 9, status: SUCCESS }), None);
    // Aborted, then its Failed status: one end. Another pid's room 9 is another room.
    rooms.observe(5, 20, &destination).expect("enqueued");
    assert_eq!(rooms.observe(5, 21, &Bootstrap::Abort { room: 9 }).map(|o| o.stage), Some(Stage::Aborted));
    assert_eq!(rooms.observe(5, 22, &Bootstrap::Status { room: 9, status: FAILED }), None);
    rooms.observe(6, 30, &destination).expect("enqueued");
    assert_eq!(
        rooms.observe(6, 31, &Bootstrap::Status { room: 9, status: FAILED }).map(|o| o.stage),
        Some(Stage::Failed)
    );
    // An end for a room never started is no event.
    assert_eq!(rooms.observe(4, 40, &Bootstrap::Abort { room: 77 }), None);
    rooms.observe(7, 50, &destination).expect("enqueued");
    rooms.forget(7);
    assert!(rooms.live.is_empty());
}

/// The first `EXT_ID_LEN` bytes of a msgpack tagged array of `len`
/// elements: tag, rid, then nils.
fn scheduler_frame(len: u16, tag: &[u8], rid: &[u8]) -> Frame {
    let str = |bytes: &mut Vec<u8>, s: &[u8]| {
        match s.len() {
            0..32 => bytes.push(0xa0 | s.len() as u8),
            _ => bytes.extend_from_slice(&[0xd9, s.len() as u8]),
        }
        bytes.extend_from_slice(s);
    };
    let mut bytes = vec![0xdc, (len >> 8) as u8, len as u8];
    str(&mut bytes, tag);
    str(&mut bytes, rid);
    bytes.resize(len as usize + bytes.len(), 0xc0);
    bytes.truncate(stallwatch_common::EXT_ID_LEN);
    Frame { size: Some(len as usize + 3), bytes: bytes.into(), complete: false }
}

#[test]
fn the_schedulers_requests_and_aborts_name_their_rid() {
    let rid = b"8d5e957f297893487bd98fa830fa6413";
    let received = |frame| Message { pid: 1, tid: 2, ts_ns: 3, direction: Direction::Received, frames: vec![frame] };
    let kept: Rid = rid[..RID_KEPT].into();
    let request = received(scheduler_frame(31, REQUEST_TAG, rid));
    assert_eq!(parse(&request), Ok(Some(Bootstrap::Request { room: 0, rid: kept.clone() })));
    assert_eq!(
        parse(&received(scheduler_frame(4, ABORT_REQUEST_TAG, rid))),
        Ok(Some(Bootstrap::AbortRequest { rid: kept }))
    );
    // A short rid is kept whole; other tags, other shapes, or a send are none of these.
    let short: Rid = b"r-1".as_slice().into();
    assert_eq!(
        parse(&received(scheduler_frame(4, ABORT_REQUEST_TAG, b"r-1"))),
        Ok(Some(Bootstrap::AbortRequest { rid: short }))
    );
    assert_eq!(parse(&received(scheduler_frame(4, b"FlushCacheReqInput", rid))), Ok(None));
    assert_eq!(
        parse(&received(Frame { bytes: b"\x93\x01\x02\x03".as_slice().into(), complete: true, size: Some(4) })),
        Ok(None)
    );
    let sent = Message { direction: Direction::Sent, ..request };
    assert_eq!(parse(&sent), Ok(None));
}

#[test]
fn a_room_from_the_scheduler_waits_on_its_peer_until_answered_and_ends_at_its_abort() {
    let mut rooms = Rooms::default();
    let rid: Rid = b"rid-7".as_slice().into();
    let start = rooms.observe(4, 10, &Bootstrap::Request { room: 7, rid: rid.clone() }).expect("enqueued");
    assert_eq!((start.key, start.stage, start.ts_ns), (7, Stage::Enqueued, 10));
    let fields = |pairs: &[(&'static str, &str)]| pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect::<Vec<_>>();
    assert_eq!(rooms.context(4, 7), fields(&[("answered", "0"), ("waiting_on", "peer")]));
    assert_eq!(rooms.observe(4, 11, &Bootstrap::Request { room: 7, rid: rid.clone() }), None, "received once");
    // Its first destination is news (what it waited on arrived); a second rank's is not.
    let to = |agent: &str| destination(7, agent, 2);
    assert_eq!(rooms.observe(4, 12, &to("d0")).map(|o| (o.stage, o.ts_ns)), Some((Stage::Enqueued, 12)));
    assert_eq!(rooms.context(4, 7), fields(&[("answered", "1/2"), ("waiting_on", "peer")]));
    assert_eq!(rooms.observe(4, 13, &to("d1")), None);
    // The abort names its rid; after the room ended it names nothing.
    assert_eq!(
        rooms.observe(4, 14, &Bootstrap::AbortRequest { rid: rid.clone() }).map(|o| (o.key, o.stage)),
        Some((7, Stage::Aborted))
    );
    assert_eq!(rooms.observe(4, 15, &Bootstrap::AbortRequest { rid }), None);
    assert!(rooms.rids.is_empty());
    // On a decode: received, then asked (news), then its status.
    rooms.observe(5, 20, &Bootstrap::Asked { room: 1 }).expect("a decode");
    rooms.observe(5, 21, &Bootstrap::Request { room: 8, rid: b"r8".as_slice().into() }).expect("enqueued");
    assert_eq!(rooms.context(5, 8), fields(&[("side", "decode"), ("asked", "no")]));
    assert_eq!(
        rooms.observe(5, 22, &Bootstrap::Asked { room: 8 }).map(|o| (o.stage, o.ts_ns)),
        Some((Stage::Enqueued, 22))
    );
    assert_eq!(rooms.context(5, 8), fields(&[("side", "decode"), ("waiting_on", "prefill")]));
    assert_eq!(rooms.observe(5, 23, &Bootstrap::Asked { room: 8 }), None);
    rooms.forget(5);
    assert!(rooms.rids.is_empty());
}

#[test]
fn a_room_whose_destination_came_before_its_request_still_ends_at_its_abort() {
    // The router tells the decode before the tokenizer hands the request
    // on: on the real target the destination often arrives first.
    let mut rooms = Rooms::default();
    let to = destination(7, "d", 1);
    rooms.observe(4, 10, &to).expect("enqueued at its destination");
    let rid: Rid = b"req-7".as_slice().into();
    assert_eq!(rooms.observe(4, 11, &Bootstrap::Request { room: 7, rid: rid.clone() }), None, "no second start");
    assert_eq!(
        rooms.observe(4, 12, &Bootstrap::AbortRequest { rid }).map(|o| (o.key, o.stage, o.ts_ns)),
        Some((7, Stage::Aborted, 12))
    );
    assert!(rooms.rids.is_empty() && rooms.live.is_empty());
}

#[test]
fn a_scheduler_outputs_rids_are_read_as_far_as_they_were_captured() {
    // `rids` of a BatchTokenIDOutput as captured: ["req-1002", "r2"].
    assert_eq!(
        output_rids(b"\x92\xa8req-1002\xa2r2\x91\xc0"),
        [b"req-1002".as_slice().into(), b"r2".as_slice().into()]
    );
    // SGLang's 32-digit rids: the first whole, the second cut at the capture's end, kept to RID_KEPT.
    let mut capture = b"\x92\xd9\x20".to_vec();
    capture.extend_from_slice(&[b'a'; 32]);
    capture.extend_from_slice(b"\xd9\x20");
    capture.extend_from_slice(&[b'b'; 64 - 37]);
    assert_eq!(output_rids(&capture), [[b'a'; RID_KEPT].as_slice().into(), [b'b'; RID_KEPT].as_slice().into()]);
    capture.truncate(37 + RID_KEPT - 1);
    assert_eq!(output_rids(&capture).len(), 1, "a rid read short of what is kept is none");
    assert!(output_rids(b"\xc0").is_empty(), "no array (rids=None)");
}

#[test]
fn a_room_still_live_at_its_schedulers_output_was_ended_by_the_prefill_and_fails() {
    let mut rooms = Rooms::default();
    let output = |rids: &[&[u8]]| Bootstrap::Output { rids: rids.iter().map(|r| (*r).into()).collect() };
    // Room 7: received, never answered (the prefill's bootstrap timeout fails it).
    rooms.observe(4, 10, &Bootstrap::Request { room: 7, rid: b"req-7".as_slice().into() }).expect("room 7");
    // Room 8: bootstrapped; its output may come before its status, which ends it.
    rooms.observe(4, 11, &Bootstrap::Request { room: 8, rid: b"req-8".as_slice().into() }).expect("room 8");
    let to = destination(8, "d", 1);
    rooms.observe(4, 12, &to).expect("answered");
    assert_eq!(rooms.observe(4, 13, &output(&[b"req-8"])), None, "a bootstrapped room's output ends nothing");
    rooms.observe(4, 13, &Bootstrap::Status { room: 8, status: SUCCESS }).expect("room 8 released");
    assert_eq!(rooms.observe(4, 14, &output(&[b"other"])), None, "a rid no room has");
    assert_eq!(
        rooms.observe(4, 15, &output(&[b"req-8", b"req-7"])).map(|o| (o.key, o.stage, o.ts_ns)),
        Some((7, Stage::Failed, 15))
    );
    assert_eq!(rooms.observe(4, 16, &output(&[b"req-7"])), None, "once");
    assert!(rooms.live.is_empty() && rooms.rids.is_empty());
    // A TP2 room with one destination of its two: not bootstrapped.
    rooms.observe(4, 17, &Bootstrap::Request { room: 10, rid: b"req-10".as_slice().into() }).expect("room 10");
    let half = destination(10, "d", 2);
    rooms.observe(4, 18, &half).expect("answered by one rank");
    assert_eq!(rooms.observe(4, 19, &output(&[b"req-10"])).map(|o| (o.key, o.stage)), Some((10, Stage::Failed)));
    // A decode streams its rooms' tokens: an output ends none of them.
    rooms.observe(5, 20, &Bootstrap::Asked { room: 1 }).expect("a decode");
    rooms.observe(5, 21, &Bootstrap::Request { room: 9, rid: b"req-9".as_slice().into() }).expect("room 9");
    assert_eq!(rooms.observe(5, 22, &output(&[b"req-9"])), None);
}

#[test]
fn a_decode_rank_asks_for_its_rooms_kv_and_waits_on_the_prefill() {
    let mut rooms = Rooms::default();
    assert_eq!(rooms.side(4), Side::Prefill);
    let start = rooms.observe(4, 10, &Bootstrap::Asked { room: 9 }).expect("enqueued");
    assert_eq!(
        (start.key, start.stage, start.ts_ns, start.external_id.as_deref()),
        (9, Stage::Enqueued, 10, Some("9"))
    );
    assert_eq!(rooms.side(4), Side::Decode);
    assert_eq!(rooms.observe(4, 11, &Bootstrap::Asked { room: 9 }), None, "asked again: one room");
    let fields = vec![("side", "decode".to_owned()), ("waiting_on", "prefill".to_owned())];
    assert_eq!(rooms.context(4, 9), fields);
    // No handle of a decode's is a room's: it names no agent of it.
    rooms.creating(4, 20, b"prefill-0", None);
    assert!(rooms.handle(20, handle_event(4, 0xa0, Stage::Enqueued, 12)).is_some());
    assert_eq!(
        rooms.observe(4, 13, &Bootstrap::Status { room: 9, status: SUCCESS }).map(|o| o.stage),
        Some(Stage::Released)
    );
    rooms.observe(4, 14, &Bootstrap::Asked { room: 10 }).expect("room 10");
    assert_eq!(
        rooms.observe(4, 15, &Bootstrap::Status { room: 10, status: FAILED }).map(|o| o.stage),
        Some(Stage::Failed)
    );
    rooms.observe(4, 16, &Bootstrap::Asked { room: 11 }).expect("room 11");
    assert_eq!(rooms.observe(4, 17, &Bootstrap::Abort { room: 11 }).map(|o| o.stage), Some(Stage::Aborted));
    rooms.forget(4);
    assert_eq!(rooms.side(4), Side::Prefill, "a pid reused is no decode until it sends");
}

#[test]
fn a_room_adopted_with_nothing_handed_over_ends_once_and_claims_to_know_nothing() {
    let mut rooms = Rooms::default();
    assert_eq!(rooms.adopt(4, 9, None), Ok(Vec::new()));
    assert_eq!(rooms.context(4, 9), Vec::new(), "its destinations are unknown");
    let silent = Silent { pid: 4, key: 9, stage: Stage::Enqueued, first_ns: 1, last_ns: 2 };
    assert_eq!(
        rooms.read(&silent, &mut |_| panic!("no handle to read")),
        Claim::NOTHING,
        "a room: its key is no handle to read"
    );
    // A handle to any agent is not its: none is known.
    rooms.creating(4, 20, b"d", None);
    assert!(rooms.handle(20, handle_event(4, 0xa0, Stage::Enqueued, 3)).is_some());
    // A destination arriving now tells what it waits on again, and starts nothing.
    let destination = destination(9, "d", 2);
    assert_eq!(rooms.observe(4, 4, &destination), None);
    assert_eq!(rooms.context(4, 9)[0], ("answered", "1/2".to_owned()));
    assert_eq!(
        rooms.observe(4, 5, &Bootstrap::Status { room: 9, status: SUCCESS }).map(|o| o.stage),
        Some(Stage::Released)
    );
    assert_eq!(rooms.observe(4, 6, &Bootstrap::Status { room: 9, status: SUCCESS }), None);
    // Adopting a room followed already changes nothing.
    rooms.observe(4, 7, &destination).expect("enqueued");
    assert_eq!(rooms.adopt(4, 9, Some(b"not read")), Ok(Vec::new()));
    assert_eq!(rooms.context(4, 9)[0], ("answered", "1/2".to_owned()));
    // What does not read is said, and the room is followed all the same.
    let mut fresh = Rooms::default();
    assert!(fresh.adopt(4, 10, Some(b"\x09")).unwrap_err().contains("format 9"));
    assert!(fresh.live.contains_key(&(4, 10)));
}

/// Every context [`Rooms::held`] hands over, by (pid, room): what the
/// pinned map holds, as the session writes it.
fn pinned(rooms: &mut Rooms, map: &mut HashMap<(u32, u64), Vec<u8>>) {
    let mut out = Vec::new();
    rooms.held(&mut out);
    for HandOver { pid, key, context } in out {
        match context {
            Some(bytes) => map.insert((pid, key), bytes),
            None => map.remove(&(pid, key)),
        };
    }
}

/// A new agent's rooms from what the old one handed over: each held
/// room adopted with its context, in any order, and the handles it
/// owns as [`Session::restore`](crate::run) skips them.
fn taken_over(map: &HashMap<(u32, u64), Vec<u8>>) -> (Rooms, Vec<(u32, AdoptedHandle)>) {
    let mut next = Rooms::default();
    let mut handles = Vec::new();
    for (&(pid, room), bytes) in map {
        let adopted = next.adopt(pid, room, Some(bytes)).expect("reads");
        handles.extend(adopted.into_iter().map(|h| (pid, h)));
    }
    (next, handles)
}

#[test]
fn rooms_taken_over_with_what_was_handed_over_say_and_do_what_they_did() {
    use Stage::*;
    let mut rooms = Rooms::default();
    let mut map = HashMap::new();
    let to = |room, port, agent: &str, pages: &[u32]| Bootstrap::Destination {
        room,
        port,
        agent: agent.into(),
        ranks: 2,
        pages: pages.into(),
    };
    // Room 1: both ranks answered, its first chunk to a done, its
    // second to b posted and hung; room 2 behind it on the same worker;
    // room 3 received, one rank of two answered; room 4 received only.
    for (room, rid) in [(1, b"r-1"), (2, b"r-2"), (3, b"r-3"), (4, b"r-4")] {
        rooms.observe(4, 1, &Bootstrap::Request { room, rid: rid.as_slice().into() }).expect("received");
    }
    rooms.observe(4, 2, &to(1, 40001, "a", &[10, 11])).expect("answered");
    rooms.observe(4, 2, &to(1, 40003, "b", &[20, 21]));
    rooms.observe(4, 3, &to(2, 40003, "b", &[30])).expect("answered");
    rooms.observe(4, 3, &to(2, 40001, "a", &[40]));
    rooms.observe(4, 3, &to(3, 40001, "a", &[50])).expect("answered");
    rooms.creating(4, 20, b"a", Some(10));
    assert_eq!(rooms.handle(20, handle_event(4, 0xa0, Enqueued, 4)), None);
    rooms.handle(20, handle_event(4, 0xa0, TransferPosted, 5)).expect("room 1's");
    rooms.handle(20, handle_event(4, 0xa0, TransferDone, 6)).expect("room 1's");
    rooms.creating(4, 20, b"b", Some(20));
    assert_eq!(rooms.handle(20, handle_event(4, 0xa1, Enqueued, 7)), None);
    rooms.handle(20, handle_event(4, 0xa1, TransferPosted, 8)).expect("room 1's");
    // A decode process's room, asked for.
    rooms.observe(5, 9, &Bootstrap::Asked { room: 1 }).expect("asked");
    pinned(&mut rooms, &mut map);
    assert_eq!(map.len(), 5, "{:?}", map.keys());
    let mut out = Vec::new();
    rooms.held(&mut out);
    assert!(out.is_empty(), "nothing changed since: nothing to write");

    let (mut next, handles) = taken_over(&map);
    for (pid, room) in [(4, 1), (4, 2), (4, 3), (4, 4), (5, 1), (4, 99)] {
        assert_eq!(next.context(pid, room), rooms.context(pid, room), "pid {pid} room {room}");
    }
    assert_eq!(next.context(4, 1), [("handle", "0xa1".to_owned()), ("transfer", "2".to_owned())]);
    assert_eq!(next.side(5), Side::Decode);
    assert_eq!(next.hung_handle(4, 1), Some(0xa1));
    // Its handles, with their peers: the done one too (its release ends it).
    let mut handles: Vec<_> = handles.into_iter().map(|(pid, h)| (pid, h.key, h.peer, h.posted)).collect();
    handles.sort();
    assert_eq!(handles, [(4, 0xa0, Some("a".into()), false), (4, 0xa1, Some("b".into()), true)]);
    assert!(next.owns(4, 0xa1) && next.owns(4, 0xa0) && !next.owns(4, 0xb0) && !next.owns(5, 0xa1));
    assert_eq!(
        next.read(&Silent { pid: 4, key: 1, stage: TransferPosted, first_ns: 1, last_ns: 8 }, &mut |s| {
            assert_eq!(s.key, 0xa1);
            None
        }),
        Claim::NOTHING
    );

    // It goes on as the old agent would have: the hung chunk completes
    // (the room's), the aux is created on the room's thread (no page:
    // by the thread), room 4's rid aborts it, room 3's output fails it.
    for rooms in [&mut rooms, &mut next] {
        assert_eq!(
            rooms.handle(20, handle_event(4, 0xa1, TransferDone, 20)).map(|o| (o.key, o.stage)),
            Some((1, TransferPosted))
        );
        rooms.creating(4, 20, b"b", None);
        assert_eq!(rooms.handle(20, handle_event(4, 0xa2, Enqueued, 21)), None);
        assert_eq!(rooms.handle(20, handle_event(4, 0xa2, TransferPosted, 22)).map(|o| o.key), Some(1));
        assert_eq!(rooms.context(4, 1), [("handle", "0xa2".to_owned()), ("transfer", "3".to_owned())]);
        // Room 2's first chunk, by its page, on another thread.
        rooms.creating(4, 21, b"b", Some(30));
        assert_eq!(rooms.handle(21, handle_event(4, 0xb0, Enqueued, 23)), None);
        assert_eq!(rooms.handle(21, handle_event(4, 0xb0, TransferPosted, 24)).map(|o| o.key), Some(2));
        let abort = Bootstrap::AbortRequest { rid: b"r-4".as_slice().into() };
        assert_eq!(rooms.observe(4, 25, &abort).map(|o| (o.key, o.stage)), Some((4, Aborted)));
        let output = Bootstrap::Output { rids: vec![b"r-3".as_slice().into()] };
        assert_eq!(rooms.observe(4, 26, &output).map(|o| (o.key, o.stage)), Some((3, Failed)));
        let released = Bootstrap::Status { room: 1, status: SUCCESS };
        assert_eq!(rooms.observe(4, 27, &released).map(|o| o.stage), Some(Released));
    }
    // What the new agent hands over in turn: room 2's new context, what
    // is left of room 1 (its handles still in flight), nothing of the
    // rooms 3 and 4 (ended with no handle).
    let mut map = HashMap::new();
    pinned(&mut next, &mut map);
    let mut held: Vec<_> = map.keys().copied().collect();
    held.sort();
    assert_eq!(held, [(4, 1), (4, 2)]);
    assert!(next.adopt(4, 1, Some(&map[&(4, 1)])).is_err_and(|why| why == "the room ended"));
    next.observe(4, 28, &Bootstrap::Status { room: 1, status: SUCCESS }).expect("the adoption's room ends");
    // A third agent: room 1's handles are nobody's, not requests of their own.
    let mut third = Rooms::default();
    assert!(third.adopt_ended(4, 1, &map[&(4, 1)]));
    assert!(!third.adopt_ended(4, 2, &map[&(4, 2)]), "a live room's context is no ended room's");
    assert!(third.owns(4, 0xa2) && third.owns(4, 0xa0) && !third.owns(4, 0xb0));
    assert_eq!(third.handle(20, handle_event(4, 0xa2, TransferDone, 30)), None);
    assert_eq!(third.context(4, 1), Vec::new(), "no live room");
    // Once its last handle ends, nothing is left of it to hand over.
    for handle in [0xa0, 0xa1, 0xa2] {
        assert_eq!(next.handle(20, handle_event(4, handle, Released, 31)), None);
    }
    let mut out = Vec::new();
    next.held(&mut out);
    assert!(out.contains(&HandOver { pid: 4, key: 1, context: None }), "{out:?}");
    next.forget(4);
    next.held(&mut out);
    assert!(!out.iter().any(|h| h.pid == 4 && h.key == 2), "a process gone: the kernel drops all of it");
}

fn handle_event(pid: u32, handle: u64, stage: Stage, ts_ns: u64) -> Observation {
    Observation { pid, key: handle, stage, ts_ns, external_id: None, ends: None }
}

#[test]
fn a_handle_to_the_one_room_awaiting_its_agent_is_the_rooms() {
    use Stage::*;
    let mut rooms = Rooms::default();
    let to = |room, agent: &str| destination(room, agent, 1);
    rooms.observe(4, 1, &to(7, "decode-0")).expect("room 7");
    rooms.observe(4, 2, &to(7, "decode-1"));
    rooms.observe(4, 3, &to(8, "decode-1")).expect("room 8");
    // Thread 20 creates a transfer to decode-0: only room 7 awaits it.
    rooms.creating(4, 20, b"decode-0", None);
    assert_eq!(rooms.handle(20, handle_event(4, 0xa0, Enqueued, 10)), None);
    let posted = rooms.handle(21, handle_event(4, 0xa0, TransferPosted, 11)).expect("the room's");
    assert_eq!(
        (posted.key, posted.stage, posted.ts_ns, posted.external_id.as_deref()),
        (7, TransferPosted, 11, Some("7"))
    );
    // Done is life of the room mid-transfer; the release only ends the attribution.
    assert_eq!(
        rooms.handle(20, handle_event(4, 0xa0, TransferDone, 12)).map(|o| (o.key, o.stage)),
        Some((7, TransferPosted))
    );
    assert_eq!(rooms.handle(20, handle_event(4, 0xa0, Released, 13)), None);
    assert_eq!(
        rooms.handle(20, handle_event(4, 0xa0, TransferDone, 14)),
        Some(handle_event(4, 0xa0, TransferDone, 14))
    );
    // decode-1 on a new thread: rooms 7 and 8 both await it, so the handle is its own.
    rooms.creating(4, 30, b"decode-1", None);
    assert_eq!(rooms.handle(30, handle_event(4, 0xb0, Enqueued, 20)), Some(handle_event(4, 0xb0, Enqueued, 20)));
    assert_eq!(
        rooms.handle(30, handle_event(4, 0xb0, TransferPosted, 21)),
        Some(handle_event(4, 0xb0, TransferPosted, 21))
    );
    // Thread 20 was on room 7: its next handle to decode-1 is room 7's, ambiguous or not.
    rooms.creating(4, 20, b"decode-1", None);
    assert_eq!(rooms.handle(20, handle_event(4, 0xb1, Enqueued, 22)), None);
    assert_eq!(rooms.handle(20, handle_event(4, 0xb1, TransferPosted, 23)).map(|o| o.key), Some(7));
    // A thread that named no agent (or another pid's) attributes nothing.
    rooms.creating(5, 20, b"decode-0", None);
    assert_eq!(rooms.handle(20, handle_event(4, 0xc0, Enqueued, 30)), Some(handle_event(4, 0xc0, Enqueued, 30)));
    // Room 8's handle fails: the room fails, once; its status then ends nothing.
    rooms.observe(4, 40, &Bootstrap::Status { room: 7, status: SUCCESS }).expect("room 7 released");
    rooms.creating(4, 22, b"decode-1", None);
    assert_eq!(rooms.handle(22, handle_event(4, 0xd0, Enqueued, 41)), None);
    assert_eq!(rooms.handle(22, handle_event(4, 0xd0, Failed, 42)).map(|o| (o.key, o.stage)), Some((8, Failed)));
    assert_eq!(rooms.observe(4, 43, &Bootstrap::Status { room: 8, status: FAILED }), None);
    // A handle of a room that ended is nobody's lifecycle.
    rooms.observe(4, 50, &to(9, "decode-0")).expect("room 9");
    rooms.creating(4, 23, b"decode-0", None);
    assert_eq!(rooms.handle(23, handle_event(4, 0xe0, Enqueued, 51)), None);
    rooms.observe(4, 52, &Bootstrap::Abort { room: 9 }).expect("room 9 aborted");
    assert_eq!(rooms.handle(23, handle_event(4, 0xe0, TransferDone, 53)), None);
    rooms.forget(4);
    rooms.forget(5);
    assert!(rooms.live.is_empty());
    assert!(rooms.handles.is_empty() && rooms.creating.is_empty() && rooms.current.is_empty());
}

#[test]
fn a_chunk_is_its_rooms_by_the_decode_page_it_writes_however_many_rooms_await_that_decode() {
    use Stage::*;
    let mut rooms = Rooms::default();
    rooms.observe(4, 1, &to_pages(7, &[10, 11, 12, 13])).expect("room 7");
    rooms.observe(4, 2, &to_pages(8, &[20, 21, 22, 23])).expect("room 8");
    // Chunks interleaved on one worker: 7's, 8's, 7's second, 8's second.
    for (handle, page, room) in [(0xa0, 10, 7), (0xa1, 20, 8), (0xa2, 12, 7), (0xa3, 22, 8)] {
        rooms.creating(4, 30, b"d", Some(page));
        assert_eq!(rooms.handle(30, handle_event(4, handle, Enqueued, 3)), None, "{handle:#x}");
        assert_eq!(
            rooms.handle(30, handle_event(4, handle, TransferPosted, 4)).map(|o| o.key),
            Some(room),
            "{handle:#x}"
        );
    }
    // The aux transfer (createXferReq: no page) follows its room's last chunk on the thread.
    rooms.creating(4, 30, b"d", None);
    assert_eq!(rooms.handle(30, handle_event(4, 0xa4, Enqueued, 5)), None);
    assert_eq!(rooms.handle(30, handle_event(4, 0xa4, TransferPosted, 6)).map(|o| o.key), Some(8));
    // A page neither room has, on a thread with no room yet: nobody's, counted.
    rooms.creating(4, 31, b"d", Some(99));
    assert!(rooms.handle(31, handle_event(4, 0xb0, Enqueued, 7)).is_some());
    assert_eq!(rooms.unattributed, 1);
    assert_eq!(rooms.live[&(4, 7)].transfers, 2);
    assert_eq!(rooms.live[&(4, 8)].transfers, 3);
}

/// `rooms` rooms of `pages` pages each to decode `d`, from one free
/// list as a decode's allocator hands them out: each room's pages in a
/// few runs, the rooms' runs interleaved, none trivially predictable.
fn free_list_rooms(rooms: u64, pages: u32) -> Vec<(u64, Vec<u32>)> {
    let run = pages / 3;
    (0..rooms)
        .map(|r| {
            let r32 = r as u32;
            // Three runs per room, far apart and in a scrambled order.
            let starts = [(r32 * 7 + 3) % 50, (r32 * 11 + 17) % 50 + 50, (r32 * 13 + 5) % 50 + 100];
            let list = starts.iter().flat_map(|&s| (0..run).map(move |p| s * 100_000 + r32 * run + p)).collect();
            (100 + r, list)
        })
        .collect()
}

#[test]
fn a_chunk_past_page_16_is_its_rooms_among_24_live_rooms_to_one_decode() {
    use Stage::*;
    let live = free_list_rooms(24, 3000);
    let chunk_of = |rooms: &mut Rooms, tid, handle, page| {
        rooms.creating(4, tid, b"d", Some(page));
        assert_eq!(rooms.handle(tid, handle_event(4, handle, Enqueued, 3)), None, "{handle:#x}: a room's");
        rooms.handle(tid, handle_event(4, handle, TransferPosted, 4)).map(|o| o.key)
    };
    let mut rooms = Rooms::default();
    for (room, pages) in &live {
        rooms.observe(4, 1, &to_pages(*room, pages)).expect("a room");
        assert!(rooms.live[&(4, *room)].pages[0].runs().len() <= 3, "held as runs");
    }
    // Three chunks of 1000 pages per room, the rooms' chunks
    // interleaved on four workers: each chunk's first page is its
    // room's page at the chunk's start.
    let mut handle = 0xa000;
    for chunk in 0..3 {
        for (n, (room, pages)) in live.iter().enumerate() {
            handle += 1;
            let tid = 30 + (n % 4) as u32;
            assert_eq!(chunk_of(&mut rooms, tid, handle, pages[chunk * 1100]), Some(*room), "chunk {chunk}");
        }
    }
    assert_eq!(rooms.unattributed, 0);
    assert!(live.iter().all(|(room, _)| rooms.live[&(4, *room)].transfers == 3));
    // What the first 16 pages alone told: a chunk past them among
    // several rooms awaiting the decode, on a fresh thread, is nobody's.
    let mut first16 = Rooms::default();
    for (room, pages) in &live {
        first16.observe(4, 1, &to_pages(*room, &pages[..16])).expect("a room");
    }
    first16.creating(4, 99, b"d", Some(live[5].1[1000]));
    assert!(first16.handle(99, handle_event(4, 0xb0, Enqueued, 3)).is_some(), "its own lifecycle");
    assert_eq!(first16.unattributed, 1);
}

#[test]
fn a_dummy_destination_neither_starts_nor_keeps_a_room_here() {
    let mut rooms = Rooms::default();
    let dummy = |room, ranks| Bootstrap::Dummy { room, ranks };
    let request = |room, rid: &[u8]| Bootstrap::Request { room, rid: rid.into() };
    // An MLA prefill rank the decode asked for nothing: its scheduler
    // has the room, every destination is a dummy: done with, here.
    rooms.observe(4, 1, &request(7, b"r-7")).expect("received");
    let ended = rooms.observe(4, 2, &dummy(7, 1)).map(|o| (o.key, o.stage, o.ts_ns));
    assert_eq!(ended, Some((7, Stage::Released, 2)));
    assert!(rooms.live.is_empty() && rooms.rids.is_empty());
    // The dummy before the request (the router tells the decode first):
    // the request starts nothing, and its rid names nothing.
    assert_eq!(rooms.observe(4, 3, &dummy(8, 1)), None);
    assert_eq!(rooms.observe(4, 4, &request(8, b"r-8")), None);
    assert!(rooms.live.is_empty() && rooms.rids.is_empty());
    assert_eq!(rooms.observe(4, 5, &Bootstrap::AbortRequest { rid: b"r-8".as_slice().into() }), None);
    // A room of two decode ranks, one of them a dummy, in either order:
    // started by its real destination, bootstrapped by both answers,
    // and its output ends nothing (the prefill's timeout did not fail it).
    assert_eq!(rooms.observe(4, 6, &dummy(9, 2)), None);
    let to = |room| Bootstrap::Destination { room, port: 1, agent: "d".into(), ranks: 2, pages: [40].into() };
    assert_eq!(rooms.observe(4, 7, &to(9)).map(|o| o.stage), Some(Stage::Enqueued));
    rooms.observe(4, 8, &request(10, b"r-10")).expect("received");
    assert_eq!(rooms.observe(4, 9, &to(10)).map(|o| o.stage), Some(Stage::Enqueued));
    assert_eq!(rooms.observe(4, 10, &dummy(10, 2)), None);
    let fields = vec![("answered", "2/2".to_owned()), ("waiting_on", "prefill".to_owned())];
    assert_eq!((rooms.context(4, 9), rooms.context(4, 10)), (fields.clone(), fields));
    assert_eq!(rooms.observe(4, 11, &Bootstrap::Output { rids: vec![b"r-10".as_slice().into()] }), None);
    assert!(rooms.live[&(4, 9)].awaits_first_transfer());
    rooms.forget(4);
    assert_eq!(rooms.observe(4, 12, &request(8, b"r-8")).map(|o| o.key), Some(8), "a pid reused knows nothing");
}

#[test]
fn a_destination_is_a_dummy_as_sglangs_transfer_info_reads_it() {
    let frames = |pages: &'static [u8], prefix: Option<&'static [u8]>, dummy: Option<&'static [u8]>| {
        let mut frames: Vec<&[u8]> = vec![GUARD, b"7", b"ip", b"40001", b"d", pages, b"0", b"1", b""];
        frames.extend(prefix.into_iter().chain(dummy));
        parse(&message(Direction::Received, &frames))
    };
    let real =
        Ok(Some(Bootstrap::Destination { room: 7, port: 40001, agent: "d".into(), ranks: 1, pages: [5].into() }));
    let dummy = Ok(Some(Bootstrap::Dummy { room: 7, ranks: 1 }));
    let no_pages =
        Ok(Some(Bootstrap::Destination { room: 7, port: 40001, agent: "d".into(), ranks: 1, pages: [].into() }));
    // Frame 10 says (SGLang 0.5.23 always sends it; MLA's dummy ranks "1").
    assert_eq!(frames(b"", Some(b""), Some(b"1")), dummy);
    assert_eq!(frames(b"\x05\0\0\0", Some(b""), Some(b"0")), real);
    // Without it: no pages and no prefix length (a decode radix-cache
    // full hit still sends the aux: not a dummy).
    assert_eq!(frames(b"", None, None), dummy);
    assert_eq!(frames(b"", Some(b""), Some(b"")), dummy);
    assert_eq!(frames(b"", Some(b"0"), None), dummy);
    assert_eq!(frames(b"", Some(b"32"), None), no_pages);
    assert_eq!(frames(b"\x05\0\0\0", None, None), real);
    let err = frames(b"", Some(b""), Some(b"yes")).unwrap_err();
    assert!(err.contains("frame 10 (is_dummy)"), "{err}");
}

#[test]
fn a_chunk_that_goes_out_after_its_room_was_cut_short_is_that_rooms_and_nobodys_lifecycle() {
    use Stage::*;
    let mut rooms = Rooms::default();
    let chunk = |rooms: &mut Rooms, tid, handle, page| {
        rooms.creating(4, tid, b"d", page);
        let created = rooms.handle(tid, handle_event(4, handle, Enqueued, 3));
        (created, rooms.handle(tid, handle_event(4, handle, TransferPosted, 4)).map(|o| o.key))
    };
    rooms.observe(4, 1, &to_pages(7, &[10, 11])).expect("room 7");
    rooms.observe(4, 1, &Bootstrap::Request { room: 8, rid: b"r-8".as_slice().into() }).expect("room 8");
    rooms.observe(4, 2, &to_pages(8, &[20, 21])).expect("room 8 answered");
    rooms.observe(4, 2, &to_pages(9, &[30, 31])).expect("room 9");
    assert_eq!(chunk(&mut rooms, 30, 0xa0, Some(10)), (None, Some(7)), "thread 30 works room 7");
    assert_eq!(chunk(&mut rooms, 31, 0xb0, Some(30)), (None, Some(9)), "thread 31 works room 9");
    // Room 8 is aborted by its rid while thread 30 holds its first
    // chunk: the chunk goes out after, on a thread whose room (7) awaits
    // the same decode; and it is room 8's by its page.
    let abort = Bootstrap::AbortRequest { rid: b"r-8".as_slice().into() };
    assert_eq!(rooms.observe(4, 5, &abort).map(|o| (o.key, o.stage)), Some((8, Aborted)));
    assert_eq!(chunk(&mut rooms, 30, 0xa1, Some(20)), (None, None));
    assert_eq!(rooms.handle(30, handle_event(4, 0xa1, TransferDone, 6)), None);
    assert_eq!(rooms.handle(30, handle_event(4, 0xa1, Released, 7)), None);
    // Room 9 fails at its first chunk's handle: its next chunk, taken
    // before, is room 9's too.
    let failed = rooms.handle(31, handle_event(4, 0xb0, Failed, 8)).map(|o| (o.key, o.stage));
    assert_eq!(failed, Some((9, Failed)));
    assert_eq!(chunk(&mut rooms, 31, 0xb1, Some(31)), (None, None));
    assert_eq!(rooms.late, 2);
    // A released room's pages tell nothing: its transfers were all done.
    rooms.observe(4, 9, &Bootstrap::Status { room: 7, status: SUCCESS }).expect("room 7 released");
    rooms.observe(4, 9, &to_pages(11, &[40])).expect("room 11");
    rooms.observe(4, 9, &to_pages(12, &[50])).expect("room 12");
    let (created, _) = chunk(&mut rooms, 32, 0xc0, Some(10));
    assert!(created.is_some(), "nobody's: two live rooms await the decode");
    assert_eq!(rooms.unattributed, 1);
    rooms.forget(4);
    assert!(rooms.cut_short.is_empty());
}

#[test]
fn a_rooms_alert_names_its_stopped_transfer_or_what_it_waits_on() {
    use Stage::*;
    let mut rooms = Rooms::default();
    let to = |room, port, agent: &str| Bootstrap::Destination {
        room,
        port,
        agent: agent.into(),
        ranks: 2,
        pages: Default::default(),
    };
    let fields = |pairs: &[(&'static str, &str)]| pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect::<Vec<_>>();
    // Rooms 1 and 2 on worker (40001 + 40003) % 4 = 0, both ranks answered;
    // room 3: one rank of its two answered.
    rooms.observe(4, 1, &to(1, 40001, "a")).expect("room 1");
    rooms.observe(4, 1, &to(1, 40003, "b"));
    rooms.observe(4, 2, &to(2, 40003, "b")).expect("room 2");
    rooms.observe(4, 2, &to(2, 40001, "a"));
    rooms.observe(4, 3, &to(3, 40001, "a")).expect("room 3");
    assert_eq!(rooms.context(4, 2), fields(&[("answered", "2/2"), ("waiting_on", "prefill")]));
    assert_eq!(rooms.context(4, 3), fields(&[("answered", "1/2"), ("waiting_on", "peer")]));
    // Room 1's first transfer, to a, done; its second, to b, posted and not done.
    rooms.creating(4, 20, b"a", None);
    // Ambiguous until the thread is on a room: make it room 1's by the thread.
    rooms.current.insert((4, 20), 1);
    assert_eq!(rooms.handle(20, handle_event(4, 0xa0, Enqueued, 10)), None);
    rooms.handle(20, handle_event(4, 0xa0, TransferPosted, 11)).expect("room 1's");
    assert_eq!(rooms.context(4, 1), fields(&[("handle", "0xa0"), ("transfer", "1")]));
    rooms.handle(20, handle_event(4, 0xa0, TransferDone, 12)).expect("room 1's");
    assert_eq!(rooms.context(4, 1), fields(&[("waiting_on", "prefill")]), "between its transfers");
    rooms.creating(4, 20, b"b", None);
    assert_eq!(rooms.handle(20, handle_event(4, 0xa1, Enqueued, 13)), None);
    rooms.handle(20, handle_event(4, 0xa1, TransferPosted, 14)).expect("room 1's");
    assert_eq!(rooms.context(4, 1), fields(&[("handle", "0xa1"), ("transfer", "2")]));
    // Room 2 waits on the worker stuck on room 1; room 3 still on its peer.
    assert_eq!(rooms.context(4, 2), fields(&[("answered", "2/2"), ("behind", "1"), ("waiting_on", "worker")]));
    assert_eq!(rooms.context(4, 3), fields(&[("answered", "1/2"), ("waiting_on", "peer")]), "a missing peer first");
    assert_eq!(rooms.context(4, 99), Vec::new(), "no such room");
    // Done at the post's return, ending the handle's lifecycle (`complete_at`).
    let done = Observation { ends: Some(Outcome::Completed), ..handle_event(4, 0xa1, TransferDone, 15) };
    assert_eq!(rooms.handle(20, done).map(|o| (o.key, o.stage)), Some((1, TransferPosted)));
    assert!(!rooms.handles.contains_key(&(4, 0xa1)), "an ended handle is no room's any more");
    assert_eq!(rooms.context(4, 2), fields(&[("answered", "2/2"), ("waiting_on", "prefill")]), "the worker moved on");
    // Room 2's first transfer hangs on the same thread: room 1, between
    // its transfers, has its next chunk queued behind it.
    rooms.current.insert((4, 20), 2);
    rooms.creating(4, 20, b"b", None);
    assert_eq!(rooms.handle(20, handle_event(4, 0xb0, Enqueued, 16)), None);
    rooms.handle(20, handle_event(4, 0xb0, TransferPosted, 17)).expect("room 2's");
    assert_eq!(rooms.context(4, 1), fields(&[("behind", "2"), ("waiting_on", "worker")]));
    // The worker thread ends (it raised): its shard's rooms wait on a
    // worker that is gone, whatever else they would have waited on.
    rooms.threads = ThreadCheck(|_, tid| tid != 20);
    let exited = [("waiting_on", "worker"), ("worker", "exited"), ("worker_tid", "20")];
    assert_eq!(rooms.context(4, 1), fields(&exited));
    assert_eq!(rooms.context(4, 2), fields(&[("handle", "0xb0"), ("transfer", "1")]), "its own transfer first");
    assert_eq!(rooms.context(4, 3), fields(&[("answered", "1/2"), ("waiting_on", "peer")]), "a missing peer first");
    rooms.observe(4, 18, &to(3, 40003, "b"));
    assert_eq!(rooms.context(4, 3), fields(&[[("answered", "2/2")].as_slice(), &exited].concat()));
}

#[test]
fn procfs_tells_a_running_thread_from_an_ended_one() {
    fn this_thread() -> u32 {
        let me = std::fs::read_link("/proc/thread-self").expect("/proc/thread-self");
        me.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse().ok()).expect("a tid")
    }
    let pid = std::process::id();
    assert!((ThreadCheck::PROCFS.0)(pid, this_thread()));
    let ended = std::thread::spawn(this_thread).join().expect("the thread");
    // Joined as it clears its tid, a moment before the kernel reaps it.
    let gone = (0..200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(5));
        !(ThreadCheck::PROCFS.0)(pid, ended)
    });
    assert!(gone, "thread {ended} still in /proc/{pid}/task after 1 s");
    assert!((ThreadCheck::PROCFS.0)(u32::MAX, 1), "a process gone says nothing of its threads");
}

#[test]
fn a_silent_rooms_state_is_read_from_its_outstanding_handles_oldest_first() {
    use Stage::*;
    let mut rooms = Rooms::default();
    let to = |room, agent: &str| destination(room, agent, 1);
    let silent = |key| Silent { pid: 4, key, stage: TransferPosted, first_ns: 1, last_ns: 9 };
    let posted = |rooms: &mut Rooms, tid, agent: &[u8], handle| {
        rooms.creating(4, tid, agent, None);
        assert_eq!(rooms.handle(tid, handle_event(4, handle, Enqueued, 5)), None);
        rooms.handle(tid, handle_event(4, handle, TransferPosted, 6)).expect("the room's");
    };
    // What each handle's memory says, and which handles were read.
    let memory: HashMap<u64, Stage> =
        [(0xa0, TransferDone), (0xa1, TransferPosted), (0xb0, TransferDone), (0xb1, Failed)].into();
    let mut asked = Vec::new();
    let mut read = |s: &Silent| {
        assert_eq!((s.pid, s.stage, s.last_ns), (4, TransferPosted, 9), "{s:?}");
        asked.push(s.key);
        memory.get(&s.key).map(|&stage| StageRead { stage, ends: stage == TransferDone })
    };
    rooms.observe(4, 1, &to(7, "a")).expect("room 7");
    rooms.observe(4, 1, &to(8, "b")).expect("room 8");
    assert_eq!(rooms.read(&silent(7), &mut read), Claim::NOTHING, "no transfer posted: nothing to read");
    posted(&mut rooms, 20, b"a", 0xa0);
    posted(&mut rooms, 20, b"a", 0xa1);
    // 0xa0 done: not outstanding; 0xa1 in progress: the room is hung on it.
    assert_eq!(rooms.read(&silent(7), &mut read), Claim::NOTHING);
    assert_eq!(rooms.context(4, 7)[0], ("handle", "0xa1".to_owned()));
    posted(&mut rooms, 30, b"b", 0xb0);
    assert_eq!(
        rooms.read(&silent(8), &mut read),
        Claim::Mine(Some(StageRead { stage: TransferDone, ends: false })),
        "all done, no status"
    );
    posted(&mut rooms, 30, b"b", 0xb1);
    assert_eq!(rooms.read(&silent(8), &mut read), Claim::Mine(Some(StageRead { stage: Failed, ends: false })));
    assert_eq!(rooms.read(&silent(8), &mut read), Claim::NotMine, "a failed room is no live room");
    assert_eq!(rooms.read(&silent(0xa1), &mut read), Claim::NotMine, "a handle is no room");
    assert_eq!(asked, [0xa0, 0xa1, 0xb0, 0xb1]);
}

#[test]
fn rooms_are_told_by_key_and_decimal_external_id() {
    assert_eq!(room_of(42, Some("42")), Some(42));
    assert_eq!(room_of(42, Some("room-42")), None);
    assert_eq!(room_of(0x55aa, Some("42")), None);
    assert_eq!(room_of(42, None), None);
}

/// Records as the kernel captures them from SGLang 0.5.23's own pickles
/// (`pickle.dumps(obj, 5)` of a `TokenizedGenerateReqInput` with a
/// 63-bit room and a uuid rid, an `AbortReq`, a `BatchTokenIDOutput`),
/// the bytes copied from what `pickletools.dis` showed.
#[test]
fn pickled_records_read_as_sglang_writes_them() {
    use stallwatch_common::PICKLE_FIRST_WIDTH;
    let record = |room: &[u8], rid: &[u8]| {
        let mut bytes = [0u8; 64];
        bytes[..room.len()].copy_from_slice(room);
        bytes[PICKLE_FIRST_WIDTH..PICKLE_FIRST_WIDTH + rid.len()].copy_from_slice(rid);
        bytes
    };
    // bootstrap_room 6917529027641081857 (LONG1, 8 bytes), rid a uuid hex.
    let request = record(
        b"\x8a\x08\x01\x00\x00\x00\x00\x00\x00`\x8c\x12boot",
        b"\x8c 0f3c9a2e5b7d4e1f8a6c3b2d1e0f9a8b\x94\x8c\x0fhttp_worker",
    );
    assert_eq!(
        pickled_record("sglang_request_pickle", Some(0), &request),
        Ok(Bootstrap::Request { room: 6917529027641081857, rid: b"0f3c9a2e5b7d4e1f8a6c3b2d".as_slice().into() })
    );
    // Small rooms are BININT2 (the test target's), short rids kept whole.
    let request = record(b"M\xea\x03", b"\x8c\x08req-1002\x94");
    assert_eq!(
        pickled_record("sglang_request_pickle", Some(0), &request),
        Ok(Bootstrap::Request { room: 1002, rid: b"req-1002".as_slice().into() })
    );
    // An AbortReq: its rid only (no bootstrap_room key).
    let abort = record(b"", b"\x8c\x08req-1002\x94\x8c\x0fhttp");
    assert_eq!(
        pickled_record("sglang_request_pickle", Some(1), &abort),
        Ok(Bootstrap::AbortRequest { rid: b"req-1002".as_slice().into() })
    );
    // One rid of an output's list.
    let mut output = [0u8; 64];
    output[..13].copy_from_slice(b"\x8c\x08req-1003\x94e\x8c");
    assert_eq!(
        pickled_record("sglang_output_pickle", Some(0), &output),
        Ok(Bootstrap::Output { rids: vec![b"req-1003".as_slice().into()] })
    );
    // What does not read so is said, not guessed.
    let none = record(b"N", b"\x8c\x08req-1002");
    assert!(pickled_record("sglang_request_pickle", Some(0), &none).unwrap_err().contains("bootstrap_room"));
    let negative = record(b"J\xff\xff\xff\xff", b"\x8c\x01r");
    assert!(pickled_record("sglang_request_pickle", Some(0), &negative).is_err());
    let memoized = record(b"M\xea\x03", b"h\x08");
    assert!(pickled_record("sglang_request_pickle", Some(0), &memoized).unwrap_err().contains("rid"));
    let short = record(b"M\xea\x03", b"X\x40\x00\x00\x00abc");
    let err = pickled_record("sglang_request_pickle", Some(0), &short[..PICKLE_FIRST_WIDTH + 8]).unwrap_err();
    assert!(err.contains("read short"), "{err}");
    assert!(pickled_record("sglang_request_pickle", None, &request).is_err());
}

/// The kernel's opcode sizes chain along a real pickle's opcodes: from
/// its first byte to the `rids` key of a `BatchTokenIDOutput` and past
/// the list of rids, each opcode where `pickletools` puts it.
#[test]
fn pickle_opcodes_are_sized_as_python_writes_them() {
    use stallwatch_common::{
        PICKLE_HEAD,
        pickle::{self, Kind},
    };
    let bytes: &[u8] =
        b"\x80\x05\x95\xce\x05\x00\x00\x00\x00\x00\x00\x8c\x0emsgspec._utils\x94\x8c\x07rebuild\x94\x93\x94\
          \x8c\x1dsglang.srt.managers.io_struct\x94\x8c\x12BatchTokenIDOutput\x94\x93\x94}\x94(\x8c\x04rids\x94]\x94(\
          \x8c\x08req-1002\x94\x8c\x08req-1003\x94e\x8c\x10http_";
    let mut at = 0usize;
    let mut strings = Vec::new();
    let mut memo = 0;
    while at < bytes.len() - 8 {
        let mut head = [0u8; PICKLE_HEAD];
        head.copy_from_slice(&bytes[at..at + PICKLE_HEAD]);
        let (size, kind) = pickle::op(&head).unwrap_or_else(|| panic!("no opcode at {at}: {:#x}", bytes[at]));
        match kind {
            Kind::Str { len, header } => {
                let from = at + header as usize;
                strings.push(String::from_utf8_lossy(&bytes[from..from + len as usize]).into_owned());
            }
            Kind::Memoize => memo += 1,
            _ => {}
        }
        at += size as usize;
    }
    assert_eq!(
        strings,
        [
            "msgspec._utils",
            "rebuild",
            "sglang.srt.managers.io_struct",
            "BatchTokenIDOutput",
            "rids",
            "req-1002",
            "req-1003"
        ]
    );
    assert_eq!(memo, 11);
    // Integers as the capture holds them.
    assert_eq!(pickle::uint(b"K\x07"), Some(7));
    assert_eq!(pickle::uint(b"J\x00\x00\x00\x40"), Some(1 << 30));
    assert_eq!(pickle::uint(b"\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\x00"), Some(u64::MAX));
    assert_eq!(pickle::uint(b"\x8a\x01\xff"), None, "-1");
    assert_eq!(pickle::uint(b"\x8a\x0a\x00\x00\x00\x00\x00\x00\x00\x00\x01\x00"), None, "2**64");
    assert_eq!(pickle::uint(b"\x8a\x00"), Some(0));
    // Opcodes no protocol 2+ pickler writes end a walk.
    assert_eq!(pickle::op(b"I123\n\0\0\0\0"), None);
    assert_eq!(pickle::op(b"\x8e\xff\xff\xff\xff\xff\xff\xff\xff"), None, "a size past u64");
}
