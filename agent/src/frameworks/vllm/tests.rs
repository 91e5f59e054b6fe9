use stallwatch_common::CHUNK_LEN;

use super::*;

fn whole(text: &str) -> Whole {
    Whole { text: text.as_bytes().to_vec(), complete: true }
}

#[test]
fn notifications_read_as_vllm_writes_them() {
    assert_eq!(parse("req-1:1", true), Ok(Notif::Consumer { id: "req-1", consumers: 1 }));
    assert_eq!(parse("cmpl-a:b-0:2", true), Ok(Notif::Consumer { id: "cmpl-a:b-0", consumers: 2 }));
    assert_eq!(parse("HB:req-1,req-2", true), Ok(Notif::Heartbeat(vec!["req-1", "req-2"])));
    // Cut short: the ids before the cut only.
    assert_eq!(parse("HB:req-1,req-2,re", false), Ok(Notif::Heartbeat(vec!["req-1", "req-2"])));
    assert!(parse("req-1:1", false).unwrap_err().contains("cut short"));
    assert!(parse("req-1", true).unwrap_err().contains("neither"));
    assert!(parse("req-1:0", true).is_err() && parse(":1", true).is_err() && parse("a:x", true).is_err());
    assert_eq!(parse("PUSH_REG:\u{1}\u{2}:x", true), Ok(Notif::PushRegistration));
    assert_ne!(key_of("req-1"), key_of("req-2"));
    assert!(key_of("req-1") >> 63 == 1);
}

#[test]
fn a_prefill_follows_a_request_from_its_heartbeat_to_its_last_consumer() {
    let mut vllm = Vllm::default();
    // Healthy, one consumer, no heartbeat: nothing to follow, counted.
    vllm.received(9, 1, &whole("req-0:1"));
    assert_eq!(vllm.pending(), None);
    assert_eq!(vllm.unseen_count, 1);
    // One heartbeat naming two requests: both held, waited on.
    vllm.received(9, 10, &whole("HB:req-1,req-2"));
    let started: Vec<Observation> = std::iter::from_fn(|| vllm.pending()).collect();
    assert_eq!(started.len(), 2);
    assert_eq!(
        (started[0].key, started[0].stage, started[0].external_id.as_deref()),
        (key_of("req-1"), Stage::Enqueued, Some("req-1"))
    );
    assert_eq!(started[1].external_id.as_deref(), Some("req-2"));
    vllm.received(9, 20, &whole("HB:req-1"));
    assert_eq!(vllm.pending(), None, "a heartbeat is evidence, not progress");
    // req-1 read by its only consumer: released.
    vllm.received(9, 30, &whole("req-1:1"));
    let released = vllm.pending().expect("released");
    assert_eq!((released.key, released.stage, released.ts_ns), (key_of("req-1"), Stage::Released, 30));
    // req-2 stalls: its alert says what the prefill knows.
    let snapshot = RequestSnapshot {
        pid: 9,
        key: key_of("req-2"),
        external_id: Some("req-2".into()),
        stage: Stage::Enqueued,
        stage_ns: [Some(10), None, None, None],
        first_ns: 10,
        last_ns: 10,
        stalled: None,
        inferred: Default::default(),
    };
    let fields: HashMap<_, _> = vllm.context(&snapshot).into_iter().collect();
    assert_eq!(fields["vllm_request_id"], "req-2");
    assert_eq!(fields["vllm_consumers_answered"], "0/?");
    assert_eq!(fields["vllm_heartbeats"], "1");
    assert!(fields["vllm_decode"].starts_with("abandoned"), "{fields:?}");
    assert_eq!(fields["vllm_recent_other_notifications"], "req-0:1");
    assert_eq!(vllm.stalled_transfer(&snapshot), Claim::NOTHING);
    let silent = Silent { pid: 9, key: key_of("req-2"), stage: Stage::Enqueued, first_ns: 10, last_ns: 10 };
    assert_eq!(vllm.read(&silent, &mut |_| panic!("no memory of its own")), Claim::NOTHING);
}

/// An `EngineCoreOutputs` frame finishing `ids` as pull-mode prefills.
fn outputs_frame(ids: &[&str]) -> Whole {
    use rmpv::Value;
    let output = |id: &str| {
        let params = vec![
            (Value::from("do_remote_prefill"), Value::from(true)),
            (Value::from("remote_block_ids"), Value::Array(vec![Value::Array(vec![Value::from(4)])])),
            (Value::from("remote_request_id"), Value::from(id)),
            (Value::from("transfer_mode"), Value::from("pull")),
        ];
        let mut fields = vec![Value::from(id), Value::Array(vec![Value::from(3)])];
        fields.extend([Value::Nil, Value::Nil, Value::Nil, Value::from(1), Value::Nil, Value::Nil]);
        fields.push(Value::Map(params));
        Value::Array(fields)
    };
    let frame = Value::Array(vec![Value::from(0), Value::Array(ids.iter().map(|id| output(id)).collect())]);
    let mut text = Vec::new();
    rmpv::encode::write_value(&mut text, &frame).expect("encode");
    Whole { text, complete: true }
}

fn snapshot(pid: u32, id: &str, first_ns: u64) -> RequestSnapshot {
    RequestSnapshot {
        pid,
        key: key_of(id),
        external_id: Some(id.into()),
        stage: Stage::Enqueued,
        stage_ns: [Some(first_ns), None, None, None],
        first_ns,
        last_ns: first_ns,
        stalled: None,
        inferred: Default::default(),
    }
}

#[test]
fn a_prefill_holds_a_request_from_its_engine_output_and_one_never_named_was_never_read() {
    let mut vllm = Vllm::default();
    vllm.output(9, 100, &outputs_frame(&["req-0", "req-1"]));
    let held: Vec<Observation> = std::iter::from_fn(|| vllm.pending()).collect();
    assert_eq!(held.len(), 2);
    assert_eq!(
        (held[0].key, held[0].stage, held[0].ts_ns, held[0].external_id.as_deref()),
        (key_of("req-0"), Stage::Enqueued, 100, Some("req-0"))
    );
    // The same output again (it cannot be, but a second read of it) holds nothing new.
    vllm.output(9, 101, &outputs_frame(&["req-0"]));
    assert_eq!(vllm.pending(), None);
    // req-0's only consumer reads it: released, not "unseen".
    vllm.received(9, 150, &whole("req-0:1"));
    let released = vllm.pending().expect("released");
    assert_eq!((released.key, released.stage), (key_of("req-0"), Stage::Released));
    assert_eq!(vllm.unseen_count, 0);
    // A decode notifies another id (vLLM PR 36958): it shows beside req-1.
    vllm.received(9, 160, &whole("req-1-x:1"));
    assert_eq!(vllm.pending(), None);
    let fields: HashMap<_, _> = vllm.context(&snapshot(9, "req-1", 100)).into_iter().collect();
    assert_eq!(fields["vllm_held_since"], "engine output");
    assert_eq!(fields["vllm_consumers_answered"], "0/?");
    assert!(fields["vllm_decode"].starts_with("never read"), "{fields:?}");
    assert_eq!(fields["vllm_recent_other_notifications"], "req-1-x:1");
    // Frames that are no engine output, or unreadable ones, hold nothing;
    // the unreadable one is counted.
    vllm.output(9, 170, &whole("\u{92}\u{1}\u{91}\u{a1}x"));
    vllm.output(9, 170, &Whole { text: vec![0x92, 0x00, 0x92, 0x91, 0xa1, b'x', 0x05], complete: true });
    assert_eq!(vllm.pending(), None);
    assert_eq!(vllm.unparsed, 1, "{:?}", vllm.last_unparsed);
}

#[test]
fn with_tp_above_one_a_workers_notification_answers_the_engine_cores_request() {
    let mut vllm = Vllm::default();
    // The engine core (pid 9) sends the output; its worker (pid 12) reads
    // the notifications.
    vllm.output(9, 100, &outputs_frame(&["req-1", "req-2"]));
    assert_eq!(std::iter::from_fn(|| vllm.pending()).count(), 2);
    vllm.received(12, 200, &whole("HB:req-2"));
    assert_eq!(vllm.pending(), None, "a heartbeat of a request held by the engine core");
    assert_eq!(vllm.held[&(9, key_of("req-2"))].1.heartbeats, 1);
    vllm.received(12, 210, &whole("req-1:1"));
    let released = vllm.pending().expect("released");
    assert_eq!((released.pid, released.key, released.stage), (9, key_of("req-1"), Stage::Released));
    // An id no process holds stays the reader's.
    vllm.received(12, 220, &whole("req-5:2"));
    assert_eq!(vllm.pending().map(|o| (o.pid, o.stage)), Some((12, Stage::Enqueued)));
}

#[test]
fn a_request_of_several_consumers_waits_for_the_rest() {
    let mut vllm = Vllm::default();
    vllm.received(9, 5, &whole("req-7:2"));
    let started = vllm.pending().expect("1 of 2 answered: held for the other");
    assert_eq!((started.stage, started.external_id.as_deref()), (Stage::Enqueued, Some("req-7")));
    let (_, held) = &vllm.held[&(9, key_of("req-7"))];
    assert_eq!((held.answered, held.consumers), (1, Some(2)));
    vllm.received(9, 6, &whole("req-7:2"));
    assert_eq!(vllm.pending().map(|o| o.stage), Some(Stage::Released));
    assert!(vllm.held.is_empty());
}

#[test]
fn waited_on_while_heartbeats_keep_their_pace() {
    let s = 1_000_000_000;
    let held = Held { heartbeats: 4, first_beat_ns: 10 * s, last_beat_ns: 13 * s, ..Held::default() };
    assert!(held.waited_on(14 * s, 4 * s));
    assert!(!held.waited_on(20 * s, 10 * s), "stopped 7 s ago at a 1 s pace");
    let once = Held { heartbeats: 1, first_beat_ns: 10 * s, last_beat_ns: 10 * s, ..Held::default() };
    assert!(once.waited_on(11 * s, 2 * s) && !once.waited_on(13 * s, 4 * s));
    assert!(!Held::default().waited_on(1, 1));
}

#[test]
fn a_decode_read_takes_the_prefills_request_id_from_its_notification() {
    let mut vllm = Vllm::default();
    let read = |key, stage, external_id: Option<&str>| Observation {
        pid: 4,
        key,
        stage,
        ts_ns: 1,
        external_id: external_id.map(Into::into),
        ends: None,
    };
    vllm.creating.insert((4, 40), (NIXL_READ, "prefill-agent".into()));
    vllm.decodes.insert(4);
    let made = vllm.handle(40, read(0xa0, Stage::Enqueued, Some("req-1:1"))).expect("passed on");
    assert_eq!(made.external_id.as_deref(), Some("req-1"), "the trace of the prefill's request id");
    assert_eq!(vllm.side(4), Side::Decode);
    // Heartbeats the decode sent for it, and a notify-only abort of another.
    vllm.sent(4, 2, &whole("HB:req-1,req-3"));
    vllm.sent(4, 3, &whole("req-3:1"));
    assert!(vllm.sent[&(4, "req-3".into())].aborted);
    let snapshot = RequestSnapshot {
        pid: 4,
        key: 0xa0,
        external_id: Some("req-1".into()),
        stage: Stage::TransferPosted,
        stage_ns: [Some(1), Some(1), None, None],
        first_ns: 1,
        last_ns: 1,
        stalled: None,
        inferred: Default::default(),
    };
    let fields: HashMap<_, _> = vllm.context(&snapshot).into_iter().collect();
    assert_eq!(
        (fields["vllm_request_id"].as_str(), fields["vllm_consumers"].as_str(), fields["vllm_peer_agent"].as_str()),
        ("req-1", "1", "prefill-agent")
    );
    assert_eq!(fields["vllm_heartbeats_sent"], "1");
    // A push prefill's WRITE: its notification names the decode's request.
    vllm.creating.insert((4, 42), (1, "decode-agent".into()));
    let write = vllm.handle(42, read(0xd0, Stage::Enqueued, Some("req-9:2"))).expect("passed on");
    assert_eq!(write.external_id.as_deref(), Some("req-9"));
    let mut write_snapshot = snapshot.clone();
    write_snapshot.key = 0xd0;
    let fields: HashMap<_, _> = vllm.context(&write_snapshot).into_iter().collect();
    assert_eq!((fields["vllm_transfer"].as_str(), fields["vllm_consumers"].as_str()), ("WRITE (prefill pushes)", "2"));
    // A handle made on another thread, or a notification not vLLM's, is left as it is.
    assert_eq!(vllm.handle(41, read(0xb0, Stage::Enqueued, Some("x:1"))).unwrap().external_id.as_deref(), Some("x:1"));
    vllm.creating.insert((4, 40), (NIXL_READ, "a".into()));
    assert_eq!(
        vllm.handle(40, read(0xc0, Stage::Enqueued, Some("room"))).unwrap().external_id.as_deref(),
        Some("room")
    );
    // Its release ends what is known of it.
    vllm.handle(40, read(0xa0, Stage::Released, None));
    assert!(vllm.context(&snapshot).is_empty());
    vllm.forget(4);
    assert!(vllm.sent.is_empty() && vllm.decodes.is_empty());
}

#[test]
fn a_long_heartbeat_is_read_across_its_chunks() {
    use crate::frameworks::strings::Chunk;
    let mut vllm = Vllm::default();
    let ids: Vec<String> = (0..3).map(|n| format!("cmpl-0123456789abcdef0123456789abcdef-{n}")).collect();
    let text = format!("HB:{}", ids.join(","));
    let chunks: Vec<&[u8]> = text.as_bytes().chunks(CHUNK_LEN as usize).collect();
    for (n, part) in chunks.iter().enumerate() {
        let chunk = Chunk {
            len: text.len() as u32,
            item: 0,
            index: n as u8,
            last: n + 1 == chunks.len(),
            text: (*part).into(),
        };
        if let Some(whole) = vllm.strings.chunk(9, 9, 1, &chunk) {
            vllm.received(9, 1, &whole);
        }
    }
    let started: Vec<_> = std::iter::from_fn(|| vllm.pending()).filter_map(|o| o.external_id).collect();
    assert_eq!(started.iter().map(|id| id.to_string()).collect::<Vec<_>>(), ids);
}

const S: u64 = 1_000_000_000;

/// A vLLM prefill whose engine core (pid 9) has a 12 s lease on its API
/// server's command line, and whose worker (pid 12) reads notifications;
/// a decode worker (pid 4) on the same node.
fn with_lease() -> Vllm {
    use crate::util::lineage::Generation;
    let mut vllm = Vllm::default();
    let server = Generation {
        pid: 1,
        args: [
            "vllm",
            "serve",
            "m",
            "--kv-transfer-config",
            r#"{"kv_connector_extra_config":{"kv_lease_duration":12}}"#,
        ]
        .map(String::from)
        .to_vec(),
    };
    let engine = Generation { pid: 9, args: vec!["VLLM::EngineCore".into()] };
    vllm.attached(9, &Lineage(vec![engine, server]));
    vllm
}

#[test]
fn a_request_never_read_ends_at_its_lease_and_heartbeats_move_the_lease_on() {
    let mut vllm = with_lease();
    vllm.output(9, 100 * S, &outputs_frame(&["req-1", "req-2"]));
    assert_eq!(std::iter::from_fn(|| vllm.pending()).count(), 2);
    assert_eq!(vllm.next_expiry(), Some(112 * S + LEASE_GRACE_NS));
    let fields: HashMap<_, _> = vllm.context(&snapshot(9, "req-1", 100 * S)).into_iter().collect();
    assert_eq!(fields["vllm_lease"], "12 s (pid 1's --kv-transfer-config)");
    // req-2's decode sends a heartbeat at 110 s: its lease runs to 118 s
    // (two thirds of 12 s, whole seconds, from the heartbeat).
    vllm.received(12, 110 * S, &whole("HB:req-2"));
    assert_eq!(vllm.pending(), None);
    // At the deadline itself, within the grace: nothing ends.
    vllm.expire(112 * S);
    assert_eq!(vllm.pending(), None);
    vllm.expire(112 * S + LEASE_GRACE_NS);
    let expired = vllm.pending().expect("req-1 past its lease");
    assert_eq!(
        (expired.pid, expired.key, expired.ts_ns, expired.ends),
        (9, key_of("req-1"), 112 * S, Some(Outcome::LeaseExpired))
    );
    assert_eq!(vllm.pending(), None, "req-2's heartbeat moved its lease on");
    assert_eq!(vllm.next_expiry(), Some(118 * S + LEASE_GRACE_NS));
    // The lease_expired alert says how it was freed.
    let fields: HashMap<_, _> = vllm.context(&snapshot(9, "req-1", 100 * S)).into_iter().collect();
    assert_eq!(fields["vllm_kv_freed"], "by pid 9 at its lease: 12 s (pid 1's --kv-transfer-config), never read");
    // A late heartbeat of the freed request follows nothing anew.
    vllm.received(12, 113 * S, &whole("HB:req-1"));
    assert_eq!(vllm.pending(), None);
}

#[test]
fn a_read_after_the_lease_is_an_alert_on_both_sides_in_one_trace() {
    let mut vllm = with_lease();
    vllm.output(9, 100 * S, &outputs_frame(&["req-1"]));
    vllm.pending();
    // The decode's READ of req-1, made at 115 s, done at 115.2 s: the
    // agent has not expired req-1 yet (no wake between), but its lease ran
    // out at 112 s.
    let read = |stage, ts_ns, external_id: Option<&str>| Observation {
        pid: 4,
        key: 0xa0,
        stage,
        ts_ns,
        external_id: external_id.map(Into::into),
        ends: None,
    };
    vllm.creating.insert((4, 40), (NIXL_READ, "prefill-agent".into()));
    vllm.handle(40, read(Stage::Enqueued, 115 * S, Some("req-1:1")));
    let done = vllm.handle(40, read(Stage::Released, 115 * S + S / 5, None)).expect("passed on");
    assert_eq!(done.ends, Some(Outcome::KvReadAfterRelease), "the decode read freed KV");
    // Its notification reaches the prefill's worker: the held request ends
    // at its lease first, then the READ is a lifecycle of its own.
    vllm.received(12, 115 * S + S / 2, &whole("req-1:1"));
    let made: Vec<Observation> = std::iter::from_fn(|| vllm.pending()).collect();
    let seen: Vec<_> = made.iter().map(|o| (o.pid, o.key, o.stage, o.ts_ns, o.ends)).collect();
    let key = key_of("req-1");
    assert_eq!(
        seen,
        [
            (9, key, Stage::Enqueued, 112 * S, Some(Outcome::LeaseExpired)),
            (9, key, Stage::Enqueued, 115 * S + S / 2, None),
            (9, key, Stage::Released, 115 * S + S / 2, Some(Outcome::KvReadAfterRelease)),
        ]
    );
    assert_eq!(made[1].external_id.as_deref(), Some("req-1"), "the prefill's side in the request's trace");
    // Both alerts say when the KV was freed.
    let mut prefill = snapshot(9, "req-1", 115 * S + S / 2);
    prefill.stage = Stage::Released;
    let fields: HashMap<_, _> = vllm.context(&prefill).into_iter().collect();
    assert_eq!(fields["vllm_read_after_freed_s"], "3.5");
    let decode = RequestSnapshot { pid: 4, key: 0xa0, first_ns: 115 * S, last_ns: 115 * S + S / 5, ..prefill };
    let fields: HashMap<_, _> = vllm.context(&decode).into_iter().collect();
    assert_eq!(fields["vllm_read_after_freed_s"], "3.2");
    // A second notification of it (another consumer) is not a second alert.
    vllm.received(12, 116 * S, &whole("req-1:1"));
    assert!(std::iter::from_fn(|| vllm.pending()).all(|o| o.ends != Some(Outcome::KvReadAfterRelease)));
}

#[test]
fn a_read_in_time_is_a_release_and_a_second_read_after_it_reads_freed_kv() {
    let mut vllm = with_lease();
    vllm.output(9, 100 * S, &outputs_frame(&["req-1"]));
    vllm.pending();
    vllm.received(12, 105 * S, &whole("req-1:1"));
    let released = vllm.pending().expect("released");
    assert_eq!((released.stage, released.ends), (Stage::Released, None));
    // Its own span says nothing of freed KV: it was read, then released.
    let mut own = snapshot(9, "req-1", 100 * S);
    own.last_ns = 105 * S;
    assert!(vllm.context(&own).is_empty());
    // A READ of it after the release read blocks the prefill freed.
    vllm.received(12, 106 * S, &whole("req-1:1"));
    let made: Vec<Observation> = std::iter::from_fn(|| vllm.pending()).collect();
    assert_eq!(made.last().map(|o| o.ends), Some(Some(Outcome::KvReadAfterRelease)));
    let fields: HashMap<_, _> = vllm.context(&snapshot(9, "req-1", 106 * S)).into_iter().collect();
    assert_eq!(fields["vllm_kv_freed"], "by pid 9 released: every consumer had answered");
}

#[test]
fn a_read_ending_after_its_own_release_is_none_of_freed_kv_and_one_not_taken_says_so() {
    let mut vllm = with_lease();
    vllm.output(9, 100 * S, &outputs_frame(&["req-1", "req-2"]));
    while vllm.pending().is_some() {}
    let read = |key, stage, ts_ns, external_id: Option<&str>| Observation {
        pid: 4,
        key,
        stage,
        ts_ns,
        external_id: external_id.map(Into::into),
        ends: None,
    };
    vllm.creating.insert((4, 40), (NIXL_READ, "prefill-agent".into()));
    vllm.handle(40, read(0xa0, Stage::Enqueued, 101 * S, Some("req-1:1")));
    // Its notification releases req-1 at the prefill before the decode
    // releases the READ's handle: a READ made in time, nothing freed.
    vllm.received(12, 101 * S, &whole("req-1:1"));
    assert_eq!(vllm.pending().map(|o| o.stage), Some(Stage::Released));
    let done = vllm.handle(40, read(0xa0, Stage::Released, 101 * S + S / 10, None)).expect("passed on");
    assert_eq!(done.ends, None, "released after the prefill's release, made before it");
    // req-2's READ is made and hangs: the prefill's alert says it is
    // being read, not never read.
    vllm.creating.insert((4, 40), (NIXL_READ, "prefill-agent".into()));
    vllm.handle(40, read(0xb0, Stage::Enqueued, 102 * S, Some("req-2:1")));
    let fields: HashMap<_, _> = vllm.context(&snapshot(9, "req-2", 100 * S)).into_iter().collect();
    assert!(fields["vllm_decode"].starts_with("being read: the decode (pid 4) made its READ"), "{fields:?}");
    assert!(fields["vllm_decode"].contains("handle 0xb0"), "{fields:?}");
    // Then it completes, but the prefill takes no notification (its
    // engine core does not step): its alert says it was read.
    vllm.creating.insert((4, 40), (NIXL_READ, "prefill-agent".into()));
    vllm.handle(40, read(0xb0, Stage::Enqueued, 102 * S, Some("req-2:1")));
    assert_eq!(vllm.handle(40, read(0xb0, Stage::Released, 102 * S, None)).and_then(|o| o.ends), None);
    let fields: HashMap<_, _> = vllm.context(&snapshot(9, "req-2", 100 * S)).into_iter().collect();
    assert!(fields["vllm_decode"].starts_with("read: the decode (pid 4) finished its READ"), "{fields:?}");
}

/// The real server's decode at capacity: its engine core heartbeats the
/// request it queues, the prefill (pid 9) holds it. One agent sees both:
/// the stall names the decode that waits on it; once that decode's process
/// exits, the heartbeats' stop is its exit, not a decode that gave up.
#[test]
fn a_request_waited_on_names_its_decode_and_says_when_that_decode_exited() {
    let s = 1_000_000_000;
    let mut vllm = Vllm::default();
    let now = monotonic_ns();
    let start = now - 3 * s;
    vllm.output(9, start, &outputs_frame(&["req-1"]));
    assert_eq!(std::iter::from_fn(|| vllm.pending()).count(), 1);
    // The decode's worker (pid 5) sends two heartbeats 1 s apart, the
    // prefill reads each.
    vllm.decodes.insert(5);
    for at in [start + s, start + 2 * s] {
        vllm.sent(5, at, &whole("HB:req-1"));
        vllm.received(9, at, &whole("HB:req-1"));
    }
    assert_eq!(vllm.pending(), None, "heartbeats are evidence, not progress");
    let verdict = |vllm: &Vllm| {
        let fields: HashMap<_, _> = vllm.context(&snapshot(9, "req-1", start)).into_iter().collect();
        fields["vllm_decode"].clone()
    };
    let waited = verdict(&vllm);
    assert!(waited.starts_with("waited on: the decode (pid 5) still sends heartbeats"), "{waited}");
    // The decode is killed: its exit is the verdict, at once.
    vllm.forget(5);
    let gone = verdict(&vllm);
    assert!(gone.starts_with("abandoned: the decode (pid 5) that sent its heartbeats exited"), "{gone}");
    // Another decode heartbeats it later (the router sent it again): waited
    // on again.
    vllm.decodes.insert(6);
    let later = monotonic_ns();
    vllm.sent(6, later, &whole("HB:req-1"));
    vllm.received(9, later, &whole("HB:req-1"));
    let again = verdict(&vllm);
    assert!(again.starts_with("waited on: the decode (pid 6)"), "{again}");
    // A decode that exits without having heartbeated a request leaves no
    // verdict about it.
    vllm.decodes.insert(7);
    vllm.forget(7);
    assert!(vllm.departed.get("req-2").is_none());
}
