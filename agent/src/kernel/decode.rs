//! What a kernel record means: a lifecycle event, the stage times withheld
//! before it, its external id. The pinned in-flight table's entries read the
//! same way ([`super::state`]), so this knows no map and no slot.
use anyhow::{Result, anyhow, bail};
use stallwatch_common::{EXT_ID_LEN, Event, event_flags};

use crate::lifecycle::{Observation, Outcome, Stage};

/// A record as the kernel wrote it.
pub fn decode(bytes: &[u8]) -> Result<Event> {
    if bytes.len() < size_of::<Event>() {
        bail!(
            "ring-buffer record of {} bytes, expected {}: agent and eBPF object disagree",
            bytes.len(),
            size_of::<Event>()
        );
    }
    // SAFETY: the length is checked above and Event is plain old data that
    // any bit pattern fits; the record need not be aligned.
    Ok(unsafe { bytes.as_ptr().cast::<Event>().read_unaligned() })
}

/// The lifecycle observation an event stands for. Events name their own
/// stage, so this needs no slot table: a restarted agent reads what the
/// previous agent's probes wrote while no agent ran.
pub fn observe(event: &Event) -> Result<Observation> {
    let stage = stage(event.stage).ok_or_else(|| {
        anyhow!("event of slot {} names stage {}, which this agent does not know", event.slot, event.stage)
    })?;
    Ok(Observation {
        pid: event.pid,
        key: event.key,
        stage,
        ts_ns: event.ts_ns,
        external_id: external_id(event),
        ends: (event.flags & event_flags::ENDS != 0).then_some(Outcome::Completed),
    })
}

/// The events a record carries besides its own: the first times of its
/// request's stages whose events were withheld before it (a `quiet`
/// probe's, or lost), oldest stage first, each an event of the record's
/// slot at that stage and time. They come before the record itself.
pub fn withheld(event: &Event) -> impl Iterator<Item = Event> + '_ {
    let carried = event.flags & event_flags::WITHHELD != 0 && event.flags & event_flags::HAS_EXT == 0;
    let times = event
        .ext
        .chunks_exact(8)
        .take(stallwatch_common::stage::LIVE)
        .map(|bytes| u64::from_ne_bytes(bytes.try_into().unwrap_or_default()));
    let flags = event.flags & !(event_flags::WITHHELD | event_flags::ENDS);
    (0u8..).zip(times).filter(move |&(_, ts_ns)| carried && ts_ns != 0).map(move |(stage, ts_ns)| Event {
        ts_ns,
        stage,
        flags,
        ext: [0; EXT_ID_LEN],
        ..*event
    })
}

/// The agent's [`Stage`] for a kernel-side stage number
/// ([`stallwatch_common::stage`]).
pub fn stage(raw: u8) -> Option<Stage> {
    Stage::ALL.get(usize::from(raw)).copied()
}

/// The external id an event or in-flight entry carries.
pub fn external_id_of(bytes: &[u8; EXT_ID_LEN], present: bool) -> Option<Box<str>> {
    if !present {
        return None;
    }
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    (len > 0).then(|| String::from_utf8_lossy(&bytes[..len]).into())
}

fn external_id(event: &Event) -> Option<Box<str>> {
    external_id_of(&event.ext, event.flags & event_flags::HAS_EXT != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(flags: u32, ext: &[u8]) -> Event {
        let mut event = Event {
            ts_ns: 5,
            key: 7,
            ret: 0,
            pid: 9,
            tid: 9,
            slot: 0,
            flags,
            stage: 0,
            _pad: [0; 7],
            ext: [0; EXT_ID_LEN],
        };
        event.ext[..ext.len()].copy_from_slice(ext);
        event
    }

    #[test]
    fn kernel_stage_numbers_are_the_agents() {
        use stallwatch_common::stage as k;
        for (raw, stage) in [
            (k::ENQUEUED, Stage::Enqueued),
            (k::TRANSFER_POSTED, Stage::TransferPosted),
            (k::TRANSFER_DONE, Stage::TransferDone),
            (k::RELEASED, Stage::Released),
            (k::ABORTED, Stage::Aborted),
            (k::FAILED, Stage::Failed),
        ] {
            assert_eq!(super::stage(raw), Some(stage));
            assert_eq!(stage as u8, raw);
            assert_eq!(stage.is_terminal(), raw >= k::FIRST_TERMINAL);
        }
        assert_eq!(super::stage(6), None);
        let mut bad = event(0, b"");
        bad.stage = 200;
        assert!(observe(&bad).unwrap_err().to_string().contains("stage 200"));
    }

    #[test]
    fn a_record_carries_the_stage_times_withheld_before_it_as_events_of_its_slot() {
        let times: Vec<u8> = [0u64, 300, 600].iter().flat_map(|t| t.to_ne_bytes()).collect();
        let mut release = event(event_flags::WITHHELD | event_flags::ENDS, &times);
        release.stage = stallwatch_common::stage::RELEASED;
        release.ts_ns = 900;
        let earlier: Vec<Event> = withheld(&release).collect();
        let seen: Vec<(u8, u64, u32)> = earlier.iter().map(|e| (e.stage, e.ts_ns, e.flags)).collect();
        assert_eq!(seen, [(1, 300, 0), (2, 600, 0)], "posted, then done; neither ends it");
        assert!(earlier.iter().all(|e| (e.pid, e.key, e.slot) == (release.pid, release.key, release.slot)));
        assert!(earlier.iter().all(|e| external_id(e).is_none()), "the times are not an id");
        // Times without the flag are not news; nor is an id read as times.
        release.flags = event_flags::ENDS;
        assert_eq!(withheld(&release).count(), 0);
        release.flags = event_flags::WITHHELD | event_flags::HAS_EXT;
        assert_eq!(withheld(&release).count(), 0);
    }

    #[test]
    fn short_records_are_refused() {
        assert!(decode(&[0; 8]).is_err());
    }

    #[test]
    fn records_round_trip() {
        let original = event(event_flags::HAS_EXT, b"room-1\0");
        // SAFETY: viewing a POD value as its bytes.
        let bytes = unsafe { std::slice::from_raw_parts((&raw const original).cast::<u8>(), size_of::<Event>()) };
        assert_eq!(decode(bytes).unwrap(), original);
    }

    #[test]
    fn external_ids_stop_at_nul_and_need_the_flag() {
        assert_eq!(external_id(&event(event_flags::HAS_EXT, b"room-42\0junk")).as_deref(), Some("room-42"));
        assert_eq!(external_id(&event(0, b"room-42\0")), None);
        assert_eq!(external_id(&event(event_flags::HAS_EXT, b"\0")), None);
        let full = [b'x'; EXT_ID_LEN];
        assert_eq!(external_id(&event(event_flags::HAS_EXT, &full)).map(|s| s.len()), Some(EXT_ID_LEN));
    }
}
