//! What outlives the agent: the eBPF maps and probe links pinned in bpffs.
//!
//! An agent restarted during a stall must still report it, and no request
//! may be lost or reported twice across the restart. So the agent pins, under
//! its bpf directory (`--bpf-dir`, one per agent instance):
//! - `v<layout>/maps/`: the ring buffer, the slot configs, the counters and
//!   the kernel's in-flight table (`INFLIGHT`, kept by the eBPF programs on
//!   every lifecycle event) with the agent's record of which stalls it
//!   already reported (`ALERTED`);
//! - `v<layout>/links/`: every uprobe link, so the probes keep recording
//!   into those maps while no agent runs.
//!
//! The next agent reuses the maps, attaches its own probes, then lets the
//! old links go (make before break: no moment without probes), restores the
//! in-flight table into its engine and reads what the ring buffer gathered
//! meanwhile. [`KernelState`] keeps `ALERTED` in step with the alerts, so a
//! stall reported before the restart is not reported again, and its
//! recovery after the restart is.
use std::{
    collections::HashSet,
    fs::File,
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::maps::{HashMap as BpfHashMap, MapData, MapError};
use stallwatch_common::{InflightEntry, RequestKey, STATE_LAYOUT, stage};
use tracing::{info, warn};

use crate::{
    events,
    lifecycle::{Outcome, Report, Restored},
};

/// `--bpf-dir` when neither the flag nor the config file sets it.
pub const DEFAULT_BPF_DIR: &str = "/sys/fs/bpf/stallwatch";
/// Where bpffs is mounted on a host that has it.
const BPFFS_MOUNT: &str = "/sys/fs/bpf";
/// `statfs(2)`'s `f_type` of a BPF filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The maps a restarted agent takes over, by their names in the eBPF
/// object. The exec ring buffer and the log buffer are per agent.
pub const PINNED_MAPS: [&str; 9] =
    ["EVENTS", "SLOTS", "COUNTERS", "HITS", "SEEN", "SAVED", "LAST", "INFLIGHT", "ALERTED"];

/// An agent's bpf directory, locked for as long as the agent runs.
pub struct BpfDir {
    base: PathBuf,
    /// `base/v<STATE_LAYOUT>`.
    root: PathBuf,
    /// Holds the `flock` that keeps a second agent out.
    _lock: File,
}

/// A link a previous agent pinned: which slot it drives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OldLink {
    pub path: PathBuf,
    pub slot: u32,
}

impl BpfDir {
    /// Open (creating it if need be) and lock `base`. Mounts bpffs at
    /// /sys/fs/bpf when `base` is below it and nothing is mounted there.
    /// State of another layout version is discarded, with a warning.
    pub fn open(base: &Path) -> Result<Self> {
        if base.starts_with(BPFFS_MOUNT) && !is_bpffs(Path::new(BPFFS_MOUNT)) {
            mount_bpffs()?;
        }
        std::fs::create_dir_all(base).with_context(|| {
            format!(
                "creating the bpf directory {}: it must be on a BPF filesystem (`mount -t bpf bpf {BPFFS_MOUNT}`), \
                 or pass --ephemeral to pin nothing",
                base.display()
            )
        })?;
        if !is_bpffs(base) {
            bail!(
                "{} is not on a BPF filesystem: pass a --bpf-dir below a bpffs mount (`mount -t bpf bpf {BPFFS_MOUNT}`), \
                 or --ephemeral to pin nothing",
                base.display()
            );
        }
        let lock = File::open(base).with_context(|| format!("opening {}", base.display()))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                bail!(
                    "another stallwatch agent is using the bpf directory {}: stop it first, or give this one \
                     its own --bpf-dir",
                    base.display()
                );
            }
            return Err(err).with_context(|| format!("locking {}", base.display()));
        }
        let root = base.join(format!("v{STATE_LAYOUT}"));
        discard_other_layouts(base, &root)?;
        for dir in [root.join("maps"), root.join("links")] {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        Ok(Self { base: base.to_owned(), root, _lock: lock })
    }

    pub fn path(&self) -> &Path {
        &self.base
    }

    /// Where map `name` is pinned.
    pub fn map_path(&self, name: &str) -> PathBuf {
        self.root.join("maps").join(name)
    }

    /// Where the link of `slot`'s `program` for `pid` is pinned.
    pub fn link_path(&self, slot: u32, pid: u32, program: &str) -> PathBuf {
        self.root.join("links").join(format!("slot{slot}-pid{pid}-{program}"))
    }

    /// The links pinned now (a previous agent's, before this one attaches).
    pub fn links(&self) -> Result<Vec<OldLink>> {
        let dir = self.root.join("links");
        let mut links = Vec::new();
        for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
            let path = entry.with_context(|| format!("listing {}", dir.display()))?.path();
            match path.file_name().and_then(|name| name.to_str()).and_then(slot_of_link) {
                Some(slot) => links.push(OldLink { path, slot }),
                None => warn!(path = %path.display(), "not a stallwatch link pin; left alone"),
            }
        }
        Ok(links)
    }

    /// Whether any probe link is still pinned (something to hand over).
    pub fn has_links(&self) -> Result<bool> {
        Ok(!self.links()?.is_empty())
    }

    /// Unpin everything: the probes detach once no agent holds them.
    pub fn remove(self) -> Result<()> {
        remove_all(&self.base)
    }
}

/// `stallwatch state clear`: detach the probes and drop the in-flight
/// state a stopped agent left pinned in `base`.
pub fn clear(base: &Path) -> Result<bool> {
    if !base.exists() {
        return Ok(false);
    }
    // Refuses while an agent runs on it.
    let dir = BpfDir::open(base)?;
    dir.remove()?;
    Ok(true)
}

/// `slot12-pid345-lifecycle_entry` -> 12.
fn slot_of_link(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("slot")?;
    let (slot, rest) = rest.split_once("-pid")?;
    let (pid, program) = rest.split_once('-')?;
    pid.parse::<u32>().ok()?;
    (!program.is_empty()).then_some(())?;
    slot.parse().ok()
}

fn discard_other_layouts(base: &Path, ours: &Path) -> Result<()> {
    for entry in std::fs::read_dir(base).with_context(|| format!("listing {}", base.display()))? {
        let path = entry.with_context(|| format!("listing {}", base.display()))?.path();
        if path != ours {
            warn!(
                path = %path.display(),
                "discarding state pinned by a stallwatch of another layout: its probes detach, its in-flight \
                 requests are not taken over"
            );
            remove_all(&path)?;
        }
    }
    Ok(())
}

/// `rm -r` for bpffs: pins are files, unlinking one drops the pin.
fn remove_all(path: &Path) -> Result<()> {
    let result = if path.is_dir() { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
    result.with_context(|| format!("removing {}", path.display()))
}

fn is_bpffs(path: &Path) -> bool {
    let Ok(path) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out pointer.
    (unsafe { libc::statfs(path.as_ptr(), &mut stat) } == 0) && stat.f_type as i64 == BPF_FS_MAGIC
}

fn mount_bpffs() -> Result<()> {
    let (source, target, fstype) = (c"bpf", c"/sys/fs/bpf", c"bpf");
    // SAFETY: NUL-terminated strings and no data argument.
    if unsafe { libc::mount(source.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) } != 0 {
        return Err(std::io::Error::last_os_error()).context(
            "no BPF filesystem at /sys/fs/bpf and mounting one failed: mount it (`mount -t bpf bpf /sys/fs/bpf`; in \
             Kubernetes a hostPath volume of the host's /sys/fs/bpf), or pass --ephemeral to pin nothing",
        );
    }
    info!("mounted a BPF filesystem at {BPFFS_MOUNT}");
    Ok(())
}

/// The kernel's in-flight table and the agent's record of reported stalls.
pub struct KernelState {
    inflight: BpfHashMap<MapData, RequestKey, InflightEntry>,
    alerted: BpfHashMap<MapData, RequestKey, u64>,
    /// Requests whose stall this agent marked in `ALERTED` during their
    /// current lifecycle: the kernel may keep their entry past the end.
    marked: HashSet<(u32, u64)>,
}

impl KernelState {
    pub fn new(inflight: MapData, alerted: MapData) -> Result<Self> {
        Ok(Self {
            inflight: BpfHashMap::try_from(aya::maps::Map::HashMap(inflight)).context("INFLIGHT is not a hash map")?,
            alerted: BpfHashMap::try_from(aya::maps::Map::HashMap(alerted)).context("ALERTED is not a hash map")?,
            marked: HashSet::new(),
        })
    }

    /// Every request the kernel holds, as the engine takes them over.
    /// Entries that vanish while being read (their lifecycle ended) are
    /// skipped; so are the few whose stage this agent does not know.
    pub fn snapshot(&self) -> Result<Vec<Restored>> {
        let keys = self.inflight.keys().collect::<Result<Vec<_>, _>>().context("listing the INFLIGHT map")?;
        let mut restored = Vec::with_capacity(keys.len());
        for key in keys {
            let entry = match self.inflight.get(&key, 0) {
                Ok(entry) => entry,
                Err(MapError::KeyNotFound) => continue,
                Err(err) => return Err(err).context("reading the INFLIGHT map"),
            };
            let alerted = match self.alerted.get(&key, 0) {
                Ok(ns) => Some(ns),
                Err(MapError::KeyNotFound) => None,
                Err(err) => return Err(err).context("reading the ALERTED map"),
            };
            match restored_from(key, &entry, alerted) {
                Some(request) => restored.push(request),
                None => warn!(pid = key.pid, key = format_args!("{:#x}", key.key), stage = entry.stage, "in-flight entry of an unknown stage skipped"),
            }
        }
        Ok(restored)
    }

    /// Keep the kernel's tables in step with a report: mark a stall as
    /// reported, unmark it when it recovers, drop what the kernel cannot
    /// know has ended (evictions).
    pub fn apply(&mut self, report: &Report) -> Result<()> {
        let request = report.request();
        let id = (request.pid, request.key);
        let key = RequestKey { key: request.key, pid: request.pid, _pad: 0 };
        match report {
            Report::Stalled { request, .. } => {
                self.alerted.insert(key, request.last_ns, 0).context("writing the ALERTED map")?;
                self.marked.insert(id);
            }
            Report::Recovered { .. } => {
                // The kernel may already have kept an ended entry: `marked`
                // stays until the end, which collects it.
                forget(&mut self.alerted, &key)?;
            }
            Report::Ended { outcome, .. } => {
                let marked = self.marked.remove(&id);
                if marked {
                    forget(&mut self.alerted, &key)?;
                }
                match outcome {
                    // The kernel already dropped it, unless it kept it for
                    // the stall alert: collect that.
                    Outcome::Released | Outcome::Aborted | Outcome::Failed if marked => {
                        if let Ok(entry) = self.inflight.get(&key, 0) {
                            if entry.stage >= stage::FIRST_TERMINAL {
                                forget(&mut self.inflight, &key)?;
                            }
                        }
                    }
                    Outcome::Released | Outcome::Aborted | Outcome::Failed => {}
                    Outcome::Evicted => forget(&mut self.inflight, &key)?,
                    // `forget_process` drops the whole process at once.
                    Outcome::ProcessExited => {}
                }
            }
        }
        Ok(())
    }

    /// Drop every entry of `pid`: it exited, or this agent does not watch it.
    pub fn forget_process(&mut self, pid: u32) -> Result<()> {
        self.marked.retain(|(marked_pid, _)| *marked_pid != pid);
        forget_pid(&mut self.inflight, pid)?;
        forget_pid(&mut self.alerted, pid)
    }
}

fn forget_pid<V: aya::Pod>(map: &mut BpfHashMap<MapData, RequestKey, V>, pid: u32) -> Result<()> {
    // Collect first: deleting while walking restarts the walk.
    let keys = map.keys().collect::<Result<Vec<_>, _>>().context("listing an in-flight map")?;
    for key in keys.iter().filter(|key| key.pid == pid) {
        forget(map, key)?;
    }
    Ok(())
}

/// Remove `key`; already gone is fine.
fn forget<V: aya::Pod>(map: &mut BpfHashMap<MapData, RequestKey, V>, key: &RequestKey) -> Result<()> {
    match map.remove(key) {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(err)) if err.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(err) => Err(anyhow!(err)).context("removing an in-flight map entry"),
    }
}

/// The engine's view of one kernel entry; `None` for a stage this agent
/// does not know.
pub fn restored_from(key: RequestKey, entry: &InflightEntry, alerted_ns: Option<u64>) -> Option<Restored> {
    let stage = events::stage(entry.stage)?;
    let stage_ns = entry.stage_ns.map(|ns| (ns != 0).then_some(ns));
    Some(Restored {
        pid: key.pid,
        key: key.key,
        stage,
        stage_ns,
        first_ns: entry.first_ns,
        last_ns: entry.last_ns,
        external_id: events::external_id_of(&entry.ext, entry.has_ext != 0),
        alerted_ns,
    })
}

#[cfg(test)]
mod tests {
    use stallwatch_common::EXT_ID_LEN;

    use super::*;
    use crate::lifecycle::Stage;

    #[test]
    fn link_pins_name_their_slot() {
        assert_eq!(slot_of_link("slot12-pid345-lifecycle_entry"), Some(12));
        assert_eq!(slot_of_link("slot0-pid1-lifecycle_return"), Some(0));
        for bad in ["slot-pid1-x", "slotx-pid1-x", "slot1-pid-x", "slot1-pid1-", "slot1-pid1", "other"] {
            assert_eq!(slot_of_link(bad), None, "{bad}");
        }
    }

    #[test]
    fn kernel_entries_become_restored_requests() {
        let mut ext = [0; EXT_ID_LEN];
        ext[..6].copy_from_slice(b"room-7");
        let entry = InflightEntry {
            first_ns: 10,
            last_ns: 30,
            stage_ns: [10, 30, 0],
            stage: stage::TRANSFER_POSTED,
            has_ext: 1,
            _pad: [0; 6],
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
    }
}
