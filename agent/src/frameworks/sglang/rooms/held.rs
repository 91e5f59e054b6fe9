//! A room's context as the next agent is handed it: what [`Rooms`] knew
//! of a live room (its side, destinations and answers, rid, worker threads
//! and transfer handles), in bytes that fit one value of the pinned
//! `CONTEXT` map ([`CONTEXT_BYTES`]), written as the room changes and read
//! back after an agent restart ([`Rooms::adopt`]).
//!
//! Little-endian, in this order: the format (1 byte), flags (1: decode
//! side, 2: its scheduler received it, 4: it ended, and only its handles
//! still in flight are held, as nobody's), `ranks`, `ports`, `transfers`,
//! `dummies` (u32 each); the rid (u8 length, 255 for none, then its
//! bytes); the destinations (u8 count; each the agent name, u8 length then
//! bytes, and its pages' first runs, u8 count then u32 first page and u32
//! length each); the outstanding handles,
//! oldest first (u16 count; each u64 handle, u32 ordinal); every handle
//! attributed to it (u16 count; each u64 handle, u32 ordinal, u8 index of
//! its peer among the destinations, 255 for none); the worker threads
//! whose last room it is (u8 count, u32 each).
//!
//! Format 1 (the agent before pages were kept as runs) had no `dummies`
//! and a destination's first pages one u32 each: read too, each page a
//! run, so an agent upgraded inside a stall takes over what the old one
//! held.
//!
//! [`Rooms`]: super::Rooms
//! [`Rooms::adopt`]: super::Rooms::adopt
use stallwatch_common::CONTEXT_BYTES;

use super::{Attributed, Room, Runs};
use crate::lifecycle::Side;

/// The format written; an agent reads its own and [`FORMAT_PAGES`].
const FORMAT: u8 = 2;
/// The format before runs: pages one by one, no dummies.
const FORMAT_PAGES: u8 = 1;
/// How many runs of a destination's pages a context holds at most when
/// all of them do not fit: its first chunks' pages.
const FIRST_RUNS: usize = 16;
const DECODE: u8 = 1;
const RECEIVED: u8 = 2;
const ENDED: u8 = 4;
/// A u8 field's "none".
const NONE: u8 = u8::MAX;

/// A room's context, read back.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Held {
    pub room: Room,
    /// Its handles, each with its ordinal and peer (`room` is the caller's
    /// to fill in: the key the context was held under).
    pub handles: Vec<(u64, Attributed)>,
    /// Threads whose last attributed handle was the room's.
    pub threads: Vec<u32>,
    /// The room ended: `handles` are what is left of it.
    pub ended: bool,
}

/// `room`'s context, its `handles` and `threads` with it, in at most
/// [`CONTEXT_BYTES`]; with only the first [`FIRST_RUNS`] runs of its
/// destinations' pages, or none (they only help attribute its next
/// chunks), if it does not fit with all, `None` if it does not fit
/// without.
pub(super) fn encode(room: &Room, handles: &[(u64, Attributed)], threads: &[u32]) -> Option<Vec<u8>> {
    [usize::from(u8::MAX), FIRST_RUNS, 0]
        .into_iter()
        .filter_map(|runs| encode_with(room, handles, threads, runs, false))
        .find(|bytes| bytes.len() <= CONTEXT_BYTES)
}

/// What is left of a room that ended: its `handles` still in flight,
/// whose events are nobody's.
pub(super) fn encode_ended(handles: &[(u64, Attributed)]) -> Option<Vec<u8>> {
    encode_with(&Room::default(), handles, &[], 0, true).filter(|bytes| bytes.len() <= CONTEXT_BYTES)
}

fn encode_with(
    room: &Room,
    handles: &[(u64, Attributed)],
    threads: &[u32],
    runs: usize,
    ended: bool,
) -> Option<Vec<u8>> {
    let mut out = vec![FORMAT];
    let flags = if room.side == Side::Decode { DECODE } else { 0 }
        | if room.received { RECEIVED } else { 0 }
        | if ended { ENDED } else { 0 };
    out.push(flags);
    for n in [room.ranks, room.ports, room.transfers, room.dummies] {
        out.extend_from_slice(&n.to_le_bytes());
    }
    match &room.rid {
        Some(rid) => short(&mut out, rid)?,
        None => out.push(NONE),
    }
    out.push(u8::try_from(room.agents.len()).ok()?);
    for (n, agent) in room.agents.iter().enumerate() {
        short(&mut out, agent.as_bytes())?;
        let all = room.pages.get(n).map_or(&[][..], Runs::runs);
        let kept = &all[..all.len().min(runs)];
        out.push(u8::try_from(kept.len()).ok()?);
        for &(first, len) in kept {
            out.extend_from_slice(&first.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
    }
    out.extend_from_slice(&u16::try_from(room.outstanding.len()).ok()?.to_le_bytes());
    for &(handle, ordinal) in &room.outstanding {
        out.extend_from_slice(&handle.to_le_bytes());
        out.extend_from_slice(&ordinal.to_le_bytes());
    }
    out.extend_from_slice(&u16::try_from(handles.len()).ok()?.to_le_bytes());
    for &(handle, Attributed { ordinal, agent, .. }) in handles {
        out.extend_from_slice(&handle.to_le_bytes());
        out.extend_from_slice(&ordinal.to_le_bytes());
        out.push(agent.filter(|&a| a != NONE).unwrap_or(NONE));
    }
    out.push(u8::try_from(threads.len()).ok()?);
    threads.iter().for_each(|tid| out.extend_from_slice(&tid.to_le_bytes()));
    Some(out)
}

/// A byte string of fewer than 255 bytes, its length first.
fn short(out: &mut Vec<u8>, bytes: &[u8]) -> Option<()> {
    out.push(u8::try_from(bytes.len()).ok().filter(|&len| len != NONE)?);
    out.extend_from_slice(bytes);
    Some(())
}

/// A room's context from what [`encode`] wrote; `Err` says what does not
/// read.
pub(super) fn decode(bytes: &[u8]) -> Result<Held, String> {
    let mut r = Reader { bytes, at: 0 };
    let format = r.u8("its format")?;
    if format != FORMAT && format != FORMAT_PAGES {
        return Err(format!("format {format}, this agent reads {FORMAT} and {FORMAT_PAGES}"));
    }
    let flags = r.u8("its flags")?;
    let side = if flags & DECODE != 0 { Side::Decode } else { Side::Prefill };
    let (ranks, ports, transfers) = (r.u32("its ranks")?, r.u32("its ports")?, r.u32("its transfers")?);
    let dummies = if format == FORMAT { r.u32("its dummies")? } else { 0 };
    let rid = match r.u8("its rid's length")? {
        NONE => None,
        len => Some(r.take(usize::from(len), "its rid")?.into()),
    };
    let (mut agents, mut pages) = (Vec::new(), Vec::new());
    for _ in 0..r.u8("its destinations' count")? {
        let len = r.u8("a destination's name length")?;
        agents.push(String::from_utf8_lossy(r.take(usize::from(len), "a destination's name")?).into());
        let count = r.u8("a destination's run count")?;
        pages.push(if format == FORMAT {
            let runs = (0..count).map(|_| Ok((r.u32("a destination's runs")?, r.u32("a destination's runs")?)));
            Runs::from_runs(runs.collect::<Result<_, String>>()?)
        } else {
            Runs::of(&(0..count).map(|_| r.u32("a destination's pages")).collect::<Result<Vec<_>, _>>()?)
        });
    }
    let count = r.u16("its outstanding handles' count")?;
    let outstanding = (0..count)
        .map(|_| Ok((r.u64("an outstanding handle")?, r.u32("an outstanding handle's ordinal")?)))
        .collect::<Result<Vec<_>, String>>()?;
    let count = r.u16("its handles' count")?;
    let handles = (0..count)
        .map(|_| {
            let key = r.u64("a handle")?;
            let ordinal = r.u32("a handle's ordinal")?;
            let agent = Some(r.u8("a handle's peer")?).filter(|&a| a != NONE && usize::from(a) < agents.len());
            Ok((key, Attributed { room: 0, ordinal, agent }))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let threads = (0..r.u8("its threads' count")?).map(|_| r.u32("a thread")).collect::<Result<_, _>>()?;
    if r.at != bytes.len() {
        return Err(format!("{} bytes past its end", bytes.len() - r.at));
    }
    let received = flags & RECEIVED != 0;
    // Its place among bootstrapped rooms is the adopting agent's to give.
    let room = Room { side, received, agents, pages, ranks, dummies, ports, transfers, outstanding, rid, seq: 0 };
    Ok(Held { room, handles, threads, ended: flags & ENDED != 0 })
}

/// Reads what [`encode`] wrote, naming what is cut short.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], String> {
        let bytes = self.bytes.get(self.at..self.at + n).ok_or_else(|| format!("cut short in {what}"))?;
        self.at += n;
        Ok(bytes)
    }

    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().expect("2 bytes")))
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room() -> Room {
        Room {
            side: Side::Prefill,
            received: true,
            agents: vec!["8c1f7d1e-decode-0".into(), "decode-1".into()],
            pages: vec![Runs::of(&[10, 11, 12, 40]), Runs::default()],
            ranks: 2,
            dummies: 0,
            ports: 80_004,
            transfers: 3,
            outstanding: vec![(0x7f00_00a0, 2), (0x7f00_00a1, 3)],
            rid: Some(b"8d5e957f297893487bd98fa8".as_slice().into()),
            seq: 0,
        }
    }

    fn attributed(ordinal: u32, agent: Option<u8>) -> Attributed {
        Attributed { room: 0, ordinal, agent }
    }

    #[test]
    fn a_rooms_context_reads_back_as_it_was_written() {
        let handles = vec![(0x7f00_00a0, attributed(2, Some(0))), (0x7f00_00a1, attributed(3, Some(1)))];
        let bytes = encode(&room(), &handles, &[41, 42]).expect("fits");
        assert_eq!(
            decode(&bytes),
            Ok(Held { room: room(), handles: handles.clone(), threads: vec![41, 42], ended: false })
        );
        // What is left of a room that ended: its handles, nobody's (no peer).
        let bytes = encode_ended(&handles).expect("fits");
        let handles = handles.into_iter().map(|(key, h)| (key, Attributed { agent: None, ..h })).collect();
        assert_eq!(decode(&bytes), Ok(Held { room: Room::default(), handles, threads: Vec::new(), ended: true }));
        // A decode's room, adopted knowing nothing before, no rid, no handle.
        let bare = Room { side: Side::Decode, ..Room::default() };
        let bytes = encode(&bare, &[], &[]).expect("fits");
        assert_eq!(bytes.len(), 1 + 1 + 16 + 1 + 1 + 2 + 2 + 1);
        assert_eq!(decode(&bytes), Ok(Held { room: bare, handles: Vec::new(), threads: Vec::new(), ended: false }));
    }

    #[test]
    fn a_context_too_large_is_held_with_its_first_runs_without_its_pages_or_not_at_all() {
        // A room of scattered pages (a run each): its first runs.
        let mut scattered = room();
        let pages: Vec<u32> = (0..400).map(|n| n * 2).collect();
        scattered.pages = vec![Runs::of(&pages), Runs::default()];
        let held = decode(&encode(&scattered, &[], &[]).expect("fits with its first runs")).expect("reads");
        assert_eq!(held.room.pages[0].runs(), &Runs::of(&pages).runs()[..FIRST_RUNS]);
        // 8 ranks of 64-byte names with 16 runs each: not with the pages.
        let mut big = room();
        big.agents = (0..8).map(|n| format!("{n:064}").into()).collect();
        big.pages = (0..8).map(|_| Runs::of(&(0..32).map(|n| n * 2).collect::<Vec<_>>())).collect();
        let bytes = encode(&big, &[], &[]).expect("fits without its pages");
        assert!(bytes.len() <= CONTEXT_BYTES);
        let held = decode(&bytes).expect("reads");
        assert_eq!(held.room.agents, big.agents);
        assert!(held.room.pages.iter().all(Runs::is_empty), "{:?}", held.room.pages);
        // Too many handles for the value: none.
        let handles: Vec<_> = (0..100).map(|n| (n, attributed(n as u32, None))).collect();
        assert_eq!(encode(&big, &handles, &[]), None);
        // A name no length byte holds.
        big.agents[0] = "x".repeat(300).into();
        assert_eq!(encode(&big, &[], &[]), None);
    }

    #[test]
    fn a_context_that_does_not_read_says_where() {
        let handles = vec![(0x7f00_00a0, attributed(2, Some(0)))];
        let bytes = encode(&room(), &handles, &[41]).expect("fits");
        for cut in 0..bytes.len() {
            let err = decode(&bytes[..cut]).unwrap_err();
            assert!(err.starts_with("cut short in "), "{cut}: {err}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(decode(&long), Err("1 bytes past its end".to_owned()));
        let mut other = bytes.clone();
        other[0] = 9;
        assert_eq!(decode(&other), Err("format 9, this agent reads 2 and 1".to_owned()));
        // What the agent before runs held: its pages one by one, no dummies.
        let mut old = vec![FORMAT_PAGES, RECEIVED];
        [2u32, 80_004, 3].iter().for_each(|n| old.extend_from_slice(&n.to_le_bytes()));
        old.extend_from_slice(&[255, 1, 1, b'd', 3]);
        [10u32, 11, 30].iter().for_each(|n| old.extend_from_slice(&n.to_le_bytes()));
        old.extend_from_slice(&[0, 0, 0, 0, 0]);
        let held = decode(&old).expect("format 1 reads");
        assert_eq!((held.room.ranks, held.room.dummies, held.room.pages[0].runs()), (2, 0, &[(10, 2), (30, 1)][..]));
        // A peer index past the destinations reads as no peer.
        let bytes = encode(&room(), &[(0x7f00_00a0, attributed(2, Some(7)))], &[]).expect("fits");
        assert_eq!(decode(&bytes).expect("reads").handles[0].1.agent, None);
    }
}
