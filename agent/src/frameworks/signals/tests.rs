//! The router: signals to their frameworks, handles to their peers, and
//! what the next agent takes over.
use super::*;
use crate::{
    frameworks::sglang::{Bootstrap, Sglang},
    lifecycle::Restored,
    profile::resolve::FirstInsn,
};

fn event(flags: u32, ext: &[u8]) -> Event {
    let mut event = Event {
        ts_ns: 5,
        key: 0x10,
        ret: 3,
        pid: 9,
        tid: 10,
        slot: 0,
        flags,
        stage: stage::SIGNAL,
        _pad: [0; 7],
        ext: [0; EXT_ID_LEN],
    };
    event.ext[..ext.len()].copy_from_slice(ext);
    event
}

#[test]
fn captures_are_text_up_to_nul_raw_bytes_or_nothing() {
    let text = Signal::of(&event(event_flags::HAS_EXT, b"ABORT\0junk"));
    assert_eq!(text.capture, Captured::Text(b"ABORT".as_slice().into()));
    assert_eq!((text.pid, text.tid, text.value, text.ret, text.ts_ns), (9, 10, 0x10, 3, 5));
    let raw = Signal::of(&event(event_flags::HAS_EXT | event_flags::EXT_BYTES, b"KV\0STATUS"));
    let Captured::Bytes(bytes) = raw.capture else { panic!("{raw:?}") };
    assert_eq!(&bytes[..9], b"KV\0STATUS");
    assert_eq!(Signal::of(&event(0, b"ABORT")).capture, Captured::None);
    assert_eq!(Shown(&Captured::Text(b"a b".as_slice().into())).to_string(), text::value("a b"));
    assert!(is_signal(&event(0, b"")));
}

#[test]
fn a_stalled_rooms_peer_is_its_hung_handles_and_a_handles_is_its_own() {
    use crate::lifecycle::Stage::{self, *};
    // Room 7 awaits its KV at decode-0.
    let mut sglang = Sglang::default();
    sglang
        .rooms_mut()
        .observe(
            9,
            1,
            &Bootstrap::Destination { room: 7, port: 1, agent: "decode-0".into(), ranks: 1, pages: Default::default() },
        )
        .expect("room 7");
    // Room 8, to decode-2 on the same port (so the same transfer
    // worker: SGLang's sum of ports % 4), answered, queued behind it.
    sglang
        .rooms_mut()
        .observe(
            9,
            2,
            &Bootstrap::Destination { room: 8, port: 1, agent: "decode-2".into(), ranks: 1, pages: Default::default() },
        )
        .expect("room 8");
    let mut signals = Signals::with(1_000_000_000, vec![Box::new(sglang)]);
    // Every handle event comes on thread 10 of pid 9.
    let on_thread = event(0, b"");
    let handle = |key, stage, ts_ns| Observation { pid: 9, key, stage, ts_ns, external_id: None, ends: None };
    let consume =
        |signals: &mut Signals, key, stage, ts_ns| signals.consume(&on_thread, Some(handle(key, stage, ts_ns)), None);
    // The built-in profile's `nixl_remote_agent` signal, as its slot
    // delivers it: both the room tracker and the peers hear of it.
    let spec = Profile::load("sglang")
        .expect("the sglang profile")
        .signals
        .into_iter()
        .find(|spec| spec.name == "nixl_remote_agent")
        .expect("its nixl_remote_agent signal");
    let slot = Slot {
        pid: 9,
        role: Role::Signal(Arc::new(spec)),
        symbol: String::new(),
        object: std::path::PathBuf::new(),
        file_offset: 0,
        first_insn: FirstInsn::Push,
    };
    let name = |signals: &mut Signals, agent: &[u8]| {
        assert_eq!(signals.route(&event(event_flags::HAS_EXT, agent), Some(&slot)), None);
    };
    name(&mut signals, b"decode-0");
    assert_eq!(consume(&mut signals, 0xa0, Enqueued, 10), None, "room 7's");
    assert!(consume(&mut signals, 0xa0, TransferPosted, 20).is_some());
    // Two transfers to decode-1 of no room: one completes (released
    // after its post), one is left hanging.
    for key in [0xb0, 0xc0] {
        name(&mut signals, b"decode-1");
        assert_eq!(consume(&mut signals, key, Enqueued, 21), Some(handle(key, Enqueued, 21)), "its own");
        consume(&mut signals, key, TransferPosted, 25);
    }
    consume(&mut signals, 0xb0, Released, 30);
    let stalled = |key, external_id: Option<&str>, last_ns| RequestSnapshot {
        pid: 9,
        key,
        external_id: external_id.map(Into::into),
        stage: Stage::TransferPosted,
        stage_ns: [Some(last_ns), Some(last_ns), None, None],
        first_ns: last_ns,
        last_ns,
        stalled: None,
        inferred: Default::default(),
    };
    let of = |request| signals.peer_completions(&request).map(|p| (p.peer.to_string(), p.to_peer, p.to_others));
    assert_eq!(of(stalled(7, Some("7"), 20)), Some(("decode-0".into(), 0, 1)), "the room's hung handle's peer");
    assert_eq!(of(stalled(0xc0, None, 25)), Some(("decode-1".into(), 1, 0)), "the handle's own");
    assert_eq!(of(stalled(0xd0, None, 25)), None, "a handle whose peer no thread named");
    // A room with no transfer of its own, queued on its worker behind
    // room 7's hung one: judged by that transfer's peer (the one its
    // worker is stuck on), as its alert says it is `behind` room 7.
    let context = signals.context(&stalled(8, Some("8"), 25));
    assert_eq!(context.pairs().collect::<Vec<_>>(), [("answered", "1/1"), ("behind", "7"), ("waiting_on", "worker")]);
    assert!(context.fields.iter().all(|field| field.scope == "sglang"), "{context:?}");
    assert_eq!(context.native, [("bootstrap_room", 8)], "a room's spans carry it under SGLang's name");
    assert_eq!(of(stalled(8, Some("8"), 25)), Some(("decode-0".into(), 0, 1)), "queued behind room 7");
    assert_eq!(of(stalled(6, Some("6"), 25)), None, "no such room");

    // The next agent, handed what this one knew: room 7's hung handle
    // is its own again, with its peer; the others' are not.
    let mut held = signals.held();
    held.sort_by_key(|h| h.key);
    // (Room 8 is handed over too: its context, queued behind room 7.)
    let [HandOver { pid: 9, key: 7, context: Some(context) }, HandOver { pid: 9, key: 8, .. }] = &held[..] else {
        panic!("{held:?}")
    };
    assert!(signals.held().is_empty(), "handed over once");
    let mut next = Signals::with(1_000_000_000, vec![Box::new(Sglang::default())]);
    let sglang = Profile::load("sglang").expect("the sglang profile");
    next.attached(9, &Lineage(Vec::new()), &sglang);
    let restored = |key, external_id: Option<&str>| Restored {
        pid: 9,
        key,
        stage: Stage::TransferPosted,
        ended: false,
        stage_ns: [Some(10), Some(20), None],
        first_ns: 10,
        last_ns: 20,
        external_id: external_id.map(Into::into),
        alerted_ns: None,
    };
    assert_eq!(next.adopt(&restored(7, Some("7")), Some(context)), Ok(()));
    assert!(next.owns(9, 0xa0) && !next.owns(9, 0xc0) && !next.owns(9, 7));
    assert_eq!(next.adopt(&restored(0xc0, None), None), Ok(()), "no room's: nothing to adopt");
    let of = |request| next.peer_completions(&request).map(|p| (p.peer.to_string(), p.to_peer, p.to_others));
    assert_eq!(of(stalled(7, Some("7"), 20)), Some(("decode-0".into(), 0, 0)), "its peer; no completion seen yet");
    assert_eq!(
        next.context(&stalled(7, Some("7"), 20)).pairs().collect::<Vec<_>>(),
        [("handle", "0xa0"), ("transfer", "1")]
    );
    let mut other = Signals::with(1, vec![Box::new(Sglang::default())]);
    other.attached(9, &Lineage(Vec::new()), &sglang);
    let err = other.adopt(&restored(8, Some("8")), Some(b"\x01"));
    assert!(err.is_err_and(|why| why.contains("cut short")));
    // A process of a profile without the framework's signals: what a
    // previous agent knew of it is none of that framework's.
    let mut nixl = Signals::with(1, vec![Box::new(Sglang::default())]);
    nixl.attached(9, &Lineage(Vec::new()), &Profile::load("nixl").expect("the nixl profile"));
    assert_eq!(nixl.adopt(&restored(8, Some("8")), Some(b"\x01")), Ok(()), "not read at all");
}

#[test]
fn signals_of_slots_not_attached_as_signals_are_dropped_counted() {
    let mut signals = Signals::new(1_000_000_000);
    assert_eq!(signals.route(&event(0, b""), None), None);
    assert_eq!(signals.unrouted, 1);
}
