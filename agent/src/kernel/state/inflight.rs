//! The agent's side of `INFLIGHT`: the lifecycles it tracks there itself,
//! what it reads there of a silent request (is it live, what did `quiet`
//! probes withhold), and the entries a restarted agent takes over.
use anyhow::Result;
use stallwatch_common::{EXT_ID_LEN, InflightEntry, NOT_EMITTED, RequestKey, stage};
use tracing::warn;

use super::{KernelState, Tables};
use crate::{
    kernel::decode,
    lifecycle::{Observation, Restored, Silent, Withheld},
};

impl<T: Tables> KernelState<T> {
    /// Track in `INFLIGHT` a lifecycle event the agent made itself, as the
    /// eBPF programs track those of the probes (`track` in
    /// ebpf/src/main.rs, hence the word): the lifecycles the kernel has
    /// are what the next agent takes over, so an SGLang room in flight
    /// survives a restart of the agent like a NIXL handle does. A write
    /// that fails (a full table) is counted and warned about
    /// ([`Self::warn`]); the agent goes on following the request, only a
    /// restart would lose it.
    pub fn track(&mut self, observation: &Observation) {
        if let Err(err) = self.try_track(observation) {
            self.untracked.note(format!("pid {} key {:#x}: {err:#}", observation.pid, observation.key));
        }
    }

    /// Lifecycles the agent made that it could not track
    /// ([`Self::track`]): while any, a request the kernel has no entry of
    /// may still be live.
    pub fn untracked(&self) -> u64 {
        self.untracked.count
    }

    fn try_track(&mut self, o: &Observation) -> Result<()> {
        let key = RequestKey { key: o.key, pid: o.pid, _pad: 0 };
        let entry = self.tables.inflight(&key)?;
        if o.stage.is_terminal() || o.ends.is_some() {
            return match entry {
                // Kept for the agent's stall alert, as the kernel keeps it.
                Some(entry) if self.tables.alerted(&key)?.is_some() => self.tables.put_inflight(
                    &key,
                    &InflightEntry { stage: o.stage as u8, ended: 1, last_ns: entry.last_ns.max(o.ts_ns), ..entry },
                ),
                Some(_) => self.tables.forget_inflight(&key),
                None => Ok(()),
            };
        }
        let at = usize::from(o.stage as u8);
        let entry = match entry.filter(|entry| entry.ended == 0) {
            Some(mut entry) => {
                entry.last_ns = entry.last_ns.max(o.ts_ns);
                entry.stage = entry.stage.max(o.stage as u8);
                if entry.stage_ns[at] == 0 {
                    entry.stage_ns[at] = o.ts_ns;
                }
                if entry.has_ext == 0
                    && let Some(id) = &o.external_id
                {
                    (entry.ext, entry.has_ext) = (ext_of(id), 1);
                }
                entry
            }
            // None, or an ended one kept for an alert: the key's next
            // lifecycle replaces it.
            None => {
                let mut stage_ns = [0; stage::LIVE];
                stage_ns[at] = o.ts_ns;
                let (ext, has_ext) = o.external_id.as_deref().map_or(([0; EXT_ID_LEN], 0), |id| (ext_of(id), 1));
                InflightEntry {
                    first_ns: o.ts_ns,
                    last_ns: o.ts_ns,
                    stage_ns,
                    last_ret: 0,
                    last_slot: NOT_EMITTED,
                    stage: o.stage as u8,
                    has_ext,
                    ended: 0,
                    withheld: 0,
                    ext,
                }
            }
        };
        self.tables.put_inflight(&key, &entry)
    }

    /// Every request the kernel holds, as the engine takes them over.
    /// Entries that vanish while being read (their lifecycle ended) are
    /// skipped; so are the few whose stage this agent does not know. The
    /// requests taken over with an earlier agent's mark (or already ended,
    /// which the kernel keeps only for a mark) count as marked, so their
    /// end collects the entry instead of leaving it for the next agent to
    /// end again; marks of requests the kernel no longer holds are dropped,
    /// or a later lifecycle of the key would inherit them.
    pub fn snapshot(&mut self) -> Result<Vec<Restored>> {
        let keys = self.tables.inflight_keys()?;
        let mut restored = Vec::with_capacity(keys.len());
        for key in keys {
            let Some(entry) = self.tables.inflight(&key)? else { continue };
            let alerted = self.tables.alerted(&key)?;
            match restored_from(key, &entry, alerted) {
                Some(request) => {
                    if alerted.is_some() || request.ended {
                        self.marked.insert((key.pid, key.key));
                    }
                    restored.push(request);
                }
                None => warn!(
                    pid = key.pid,
                    key = format_args!("{:#x}", key.key),
                    stage = entry.stage,
                    "in-flight entry of an unknown stage skipped"
                ),
            }
        }
        for key in self.tables.alerted_keys()? {
            if self.tables.inflight(&key)?.is_none() {
                self.tables.forget_alerted(&key)?;
            }
        }
        Ok(restored)
    }

    /// The kernel's entry of (`pid`, `key`) now, as the engine takes it
    /// (for a resynchronisation, [`crate::lifecycle::Engine::resync`]);
    /// `None` when it holds none (or one of a stage this agent does not
    /// know).
    pub fn entry(&self, pid: u32, key: u64) -> Result<Option<Restored>> {
        let key = RequestKey { key, pid, _pad: 0 };
        let Some(entry) = self.tables.inflight(&key)? else {
            return Ok(None);
        };
        Ok(restored_from(key, &entry, self.tables.alerted(&key)?))
    }

    /// Whether the lifecycle of (`pid`, `key`) whose latest event the agent
    /// has is at `last_ns` is still live in the kernel's table: the probes
    /// saw no end of it (even one whose event was lost or is not read
    /// yet), and the key has not started another lifecycle since (the
    /// entry began no later). What the target's memory holds at the key is
    /// that lifecycle's only while this is true: a released request's
    /// memory may be freed or already another request's.
    pub fn is_live(&self, pid: u32, key: u64, last_ns: u64) -> Result<bool> {
        let entry = self.tables.inflight(&RequestKey { key, pid, _pad: 0 })?;
        Ok(entry.is_some_and(|entry| entry.ended == 0 && entry.first_ns <= last_ns))
    }

    /// The events `quiet` probes withheld of the silent `silent`: what its
    /// kernel entry has beyond what the agent has (events later than
    /// `last_ns`), while the entry is live and this lifecycle's (it began
    /// no later than the silence).
    pub fn withheld(&self, silent: &Silent) -> Result<Option<Withheld>> {
        let entry = self.tables.inflight(&RequestKey { key: silent.key, pid: silent.pid, _pad: 0 })?;
        let Some(entry) = entry
            .filter(|entry| entry.ended == 0 && entry.first_ns <= silent.last_ns && entry.last_ns > silent.last_ns)
        else {
            return Ok(None);
        };
        let Some(stage) = decode::stage(entry.stage).filter(|stage| !stage.is_terminal()) else { return Ok(None) };
        Ok(Some(Withheld { stage, last_ns: entry.last_ns, stage_ns: entry.stage_ns.map(|ns| (ns != 0).then_some(ns)) }))
    }
}

/// An external id as the kernel keeps it: NUL-terminated, cut to fit.
fn ext_of(id: &str) -> [u8; EXT_ID_LEN] {
    let mut ext = [0; EXT_ID_LEN];
    let len = id.len().min(EXT_ID_LEN - 1);
    ext[..len].copy_from_slice(&id.as_bytes()[..len]);
    ext
}

/// The engine's view of one kernel entry; `None` for a stage this agent
/// does not know.
pub fn restored_from(key: RequestKey, entry: &InflightEntry, alerted_ns: Option<u64>) -> Option<Restored> {
    let stage = decode::stage(entry.stage)?;
    let stage_ns = entry.stage_ns.map(|ns| (ns != 0).then_some(ns));
    Some(Restored {
        pid: key.pid,
        key: key.key,
        stage,
        ended: entry.ended != 0,
        stage_ns,
        first_ns: entry.first_ns,
        last_ns: entry.last_ns,
        external_id: decode::external_id_of(&entry.ext, entry.has_ext != 0),
        alerted_ns,
    })
}

#[cfg(test)]
mod tests {
    use stallwatch_common::{EXT_ID_LEN, stage};

    use super::*;
    use crate::lifecycle::Stage;

    #[test]
    fn kernel_entries_become_restored_requests() {
        let mut ext = [0; EXT_ID_LEN];
        ext[..6].copy_from_slice(b"room-7");
        let entry = InflightEntry {
            first_ns: 10,
            last_ns: 30,
            stage_ns: [10, 30, 0],
            last_ret: 0,
            last_slot: 1,
            stage: stage::TRANSFER_POSTED,
            has_ext: 1,
            ended: 0,
            withheld: 0,
            ext,
        };
        let key = RequestKey { key: 0xabc, pid: 42, _pad: 0 };
        let restored = restored_from(key, &entry, Some(30)).unwrap();
        assert_eq!((restored.pid, restored.key, restored.stage), (42, 0xabc, Stage::TransferPosted));
        assert_eq!(restored.stage_ns, [Some(10), Some(30), None]);
        assert_eq!((restored.first_ns, restored.last_ns, restored.alerted_ns), (10, 30, Some(30)));
        assert_eq!(restored.external_id.as_deref(), Some("room-7"));
        let no_ext = InflightEntry { has_ext: 0, ..entry };
        assert_eq!(restored_from(key, &no_ext, None).unwrap().external_id, None);
        assert!(restored_from(key, &InflightEntry { stage: 99, ..entry }, None).is_none());
        // Ended at a live stage (a slot that ends lifecycles at transfer_done).
        let done =
            restored_from(key, &InflightEntry { stage: stage::TRANSFER_DONE, ended: 1, ..entry }, Some(30)).unwrap();
        assert_eq!((done.stage, done.ended, restored.ended), (Stage::TransferDone, true, false));
    }
}
