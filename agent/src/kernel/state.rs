//! What outlives the agent: the eBPF maps and probe links pinned in bpffs.
//!
//! An agent restarted during a stall must still report it, and no request
//! may be lost or reported twice across the restart. So the agent pins, under
//! its bpf directory (`--bpf-dir`, one per agent instance):
//! - `v<layout>/maps/`: the ring buffer, the slot configs, the counters and
//!   the kernel's in-flight table (`INFLIGHT`, kept by the eBPF programs on
//!   every lifecycle event) with the agent's record of which stalls it
//!   already reported (`ALERTED`) and what it knew of the requests it made
//!   itself beyond what `INFLIGHT` holds (`CONTEXT`: an SGLang room's
//!   destinations, answers and handles, as its framework serialises it);
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
    os::{fd::AsRawFd as _, unix::fs::DirBuilderExt as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::maps::{HashMap as BpfHashMap, MapData, MapError};
use stallwatch_common::{
    CONTEXT_BYTES, EXT_ID_LEN, HeldContext, InflightEntry, NOT_EMITTED, RequestKey, STATE_LAYOUT, stage,
};
use tracing::{info, warn};

use super::decode;
use crate::{
    lifecycle::{Observation, Outcome, Report, Restored, Silent, Withheld},
    util::trusted_dir::TrustedDir,
    util::warned::Warned,
};

/// `--bpf-dir` when neither the flag nor the config file sets it.
pub const DEFAULT_BPF_DIR: &str = "/sys/fs/bpf/stallwatch";
/// Where bpffs is mounted on a host that has it.
const BPFFS_MOUNT: &str = "/sys/fs/bpf";
/// `statfs(2)`'s `f_type` of a BPF filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The maps a restarted agent takes over, by their names in the eBPF
/// object: every map the lifecycle programs use that the agent reads, so
/// a next agent can take the programs over too ([`BpfDir::program_dir`]);
/// the log buffer as well, since a taken-over program writes its logs to
/// the one it was loaded with. The exec ring buffer is per agent (its
/// program is loaded by each), and the walkers' per-CPU scratch is the
/// programs' own.
pub const PINNED_MAPS: [&str; 11] =
    ["EVENTS", "SLOTS", "COUNTERS", "HITS", "SEEN", "SAVED", "LAST", "INFLIGHT", "ALERTED", "CONTEXT", "AYA_LOGS"];

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
    /// `base` and every directory on the way must be out of other users'
    /// reach ([`TrustedDir`]). State of another layout version is
    /// discarded, with a warning.
    pub fn open(base: &Path) -> Result<Self> {
        if base.starts_with(BPFFS_MOUNT) && !is_bpffs(Path::new(BPFFS_MOUNT)) {
            mount_bpffs()?;
        }
        let dir = TrustedDir::create(base)
            .with_context(|| format!("the bpf directory {} (or pass --ephemeral to pin nothing)", base.display()))?;
        if dir.fs_type()? != BPF_FS_MAGIC {
            bail!(
                "{} is not on a BPF filesystem: pass a --bpf-dir below a bpffs mount (`mount -t bpf bpf {BPFFS_MOUNT}`), \
                 or --ephemeral to pin nothing",
                base.display()
            );
        }
        let lock = dir.reopen()?;
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
        let root = dir.create_child(&format!("v{STATE_LAYOUT}"))?;
        discard_other_layouts(dir.path(), root.path())?;
        for sub in ["maps", "links", "programs"] {
            root.create_child(sub)?;
        }
        Ok(Self { base: dir.path().to_owned(), root: root.path().to_owned(), _lock: lock })
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

    /// Where the lifecycle programs of eBPF object `build` are pinned (made
    /// now if need be, mode 0700 below this directory's trusted root),
    /// after the programs of every other build are unpinned: only the
    /// running build's are worth keeping, and a previous build's go on
    /// running only as long as its links do.
    pub fn program_dir(&self, build: &str) -> Result<PathBuf> {
        let programs = self.root.join("programs");
        for entry in std::fs::read_dir(&programs).with_context(|| format!("listing {}", programs.display()))? {
            let path = entry.with_context(|| format!("listing {}", programs.display()))?.path();
            if path.file_name().is_some_and(|name| name != build) {
                remove_all(&path)?;
            }
        }
        let dir = programs.join(build);
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Err(err) if err.kind() != std::io::ErrorKind::AlreadyExists => {
                Err(err).with_context(|| format!("creating {}", dir.display()))
            }
            _ => Ok(dir),
        }
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
    let exists = TrustedDir::open(base).with_context(|| format!("the bpf directory {}", base.display()))?.is_some();
    if !exists {
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

/// The two kernel tables [`KernelState`] keeps in step with the reports:
/// the pinned BPF maps ([`BpfTables`]), or, in the tests, a model of what
/// the eBPF programs do with them.
pub trait Tables {
    fn inflight_keys(&self) -> Result<Vec<RequestKey>>;
    /// `None`: no entry (it may have just ended).
    fn inflight(&self, key: &RequestKey) -> Result<Option<InflightEntry>>;
    /// Remove an entry; already gone is fine.
    fn forget_inflight(&mut self, key: &RequestKey) -> Result<()>;
    /// Write an entry (create or replace); a full table is an error.
    fn put_inflight(&mut self, key: &RequestKey, entry: &InflightEntry) -> Result<()>;
    fn alerted_keys(&self) -> Result<Vec<RequestKey>>;
    fn alerted(&self, key: &RequestKey) -> Result<Option<u64>>;
    /// Mark the silence that ended at `last_ns` as reported.
    fn mark(&mut self, key: &RequestKey, last_ns: u64) -> Result<()>;
    /// Remove a mark; already gone is fine.
    fn forget_alerted(&mut self, key: &RequestKey) -> Result<()>;
    fn context_keys(&self) -> Result<Vec<RequestKey>>;
    fn context(&self, key: &RequestKey) -> Result<Option<HeldContext>>;
    /// Write a request's context (create or replace); a full table is an error.
    fn put_context(&mut self, key: &RequestKey, context: &HeldContext) -> Result<()>;
    /// Remove a context; already gone is fine.
    fn forget_context(&mut self, key: &RequestKey) -> Result<()>;
}

/// The pinned `INFLIGHT`, `ALERTED` and `CONTEXT` maps.
pub struct BpfTables {
    inflight: BpfHashMap<MapData, RequestKey, InflightEntry>,
    alerted: BpfHashMap<MapData, RequestKey, u64>,
    context: BpfHashMap<MapData, RequestKey, HeldContext>,
}

impl BpfTables {
    pub fn new(inflight: MapData, alerted: MapData, context: MapData) -> Result<Self> {
        Ok(Self {
            inflight: BpfHashMap::try_from(aya::maps::Map::HashMap(inflight)).context("INFLIGHT is not a hash map")?,
            alerted: BpfHashMap::try_from(aya::maps::Map::HashMap(alerted)).context("ALERTED is not a hash map")?,
            context: BpfHashMap::try_from(aya::maps::Map::HashMap(context)).context("CONTEXT is not a hash map")?,
        })
    }
}

impl Tables for BpfTables {
    fn inflight_keys(&self) -> Result<Vec<RequestKey>> {
        self.inflight.keys().collect::<Result<Vec<_>, _>>().context("listing the INFLIGHT map")
    }

    fn inflight(&self, key: &RequestKey) -> Result<Option<InflightEntry>> {
        found(self.inflight.get(key, 0)).context("reading the INFLIGHT map")
    }

    fn forget_inflight(&mut self, key: &RequestKey) -> Result<()> {
        forget(&mut self.inflight, key)
    }

    fn put_inflight(&mut self, key: &RequestKey, entry: &InflightEntry) -> Result<()> {
        self.inflight.insert(key, entry, 0).context("writing the INFLIGHT map")
    }

    fn alerted_keys(&self) -> Result<Vec<RequestKey>> {
        self.alerted.keys().collect::<Result<Vec<_>, _>>().context("listing the ALERTED map")
    }

    fn alerted(&self, key: &RequestKey) -> Result<Option<u64>> {
        found(self.alerted.get(key, 0)).context("reading the ALERTED map")
    }

    fn mark(&mut self, key: &RequestKey, last_ns: u64) -> Result<()> {
        self.alerted.insert(key, last_ns, 0).context("writing the ALERTED map")
    }

    fn forget_alerted(&mut self, key: &RequestKey) -> Result<()> {
        forget(&mut self.alerted, key)
    }

    fn context_keys(&self) -> Result<Vec<RequestKey>> {
        self.context.keys().collect::<Result<Vec<_>, _>>().context("listing the CONTEXT map")
    }

    fn context(&self, key: &RequestKey) -> Result<Option<HeldContext>> {
        found(self.context.get(key, 0)).context("reading the CONTEXT map")
    }

    fn put_context(&mut self, key: &RequestKey, context: &HeldContext) -> Result<()> {
        self.context.insert(key, context, 0).context("writing the CONTEXT map")
    }

    fn forget_context(&mut self, key: &RequestKey) -> Result<()> {
        forget(&mut self.context, key)
    }
}

/// The kernel's in-flight table and the agent's record of reported stalls.
pub struct KernelState<T = BpfTables> {
    tables: T,
    /// Requests this agent followed while they had a mark in `ALERTED`
    /// (its own stall alert, or an earlier agent's it took over), and those
    /// it took over ended: the kernel may keep their entry past the end, so
    /// their end must collect it.
    marked: HashSet<(u32, u64)>,
    /// Lifecycle events the agent made (no probe's: an SGLang room's,
    /// from its ZMQ traffic) that could not be written to `INFLIGHT`, and
    /// why the latest could not.
    unheld: u64,
    last_unheld: Option<String>,
    warned: Warned,
    /// Contexts [`Self::hand_over`] could not write or drop, and why the
    /// latest could not.
    unkept: u64,
    last_unkept: Option<String>,
    warned_unkept: Warned,
}

impl<T: Tables> KernelState<T> {
    pub fn new(tables: T) -> Self {
        Self {
            tables,
            marked: HashSet::new(),
            unheld: 0,
            last_unheld: None,
            warned: Warned::default(),
            unkept: 0,
            last_unkept: None,
            warned_unkept: Warned::default(),
        }
    }

    /// Keep in `CONTEXT` what the agent knows of a request it made itself
    /// beyond what `INFLIGHT` holds of it (`context`, as its framework
    /// serialises it, at most [`CONTEXT_BYTES`]), for the next agent;
    /// `None` drops it (the request ended). A write that fails (a full
    /// table, a context too large) is counted and warned about
    /// ([`Self::warn`]); only a restart would miss it, and the next write
    /// of the request's context replaces it.
    pub fn hand_over(&mut self, pid: u32, key: u64, context: Option<&[u8]>) {
        let id = RequestKey { key, pid, _pad: 0 };
        let result = match context {
            Some(bytes) => held_context(bytes).and_then(|held| self.tables.put_context(&id, &held)),
            None => self.tables.forget_context(&id),
        };
        if let Err(err) = result {
            // What is there is no longer true: better nothing.
            let _ = self.tables.forget_context(&id);
            self.unkept += 1;
            self.last_unkept = Some(format!("pid {pid} key {key:#x}: {err:#}"));
        }
    }

    /// Every context a previous agent handed over ([`Self::hand_over`]),
    /// by (pid, key). Entries that vanish while being read are skipped.
    pub fn contexts(&self) -> Result<std::collections::HashMap<(u32, u64), Vec<u8>>> {
        let mut contexts = std::collections::HashMap::new();
        for key in self.tables.context_keys()? {
            if let Some(held) = self.tables.context(&key)? {
                let len = usize::from(held.len).min(CONTEXT_BYTES);
                contexts.insert((key.pid, key.key), held.bytes[..len].to_vec());
            }
        }
        Ok(contexts)
    }

    /// Keep in `INFLIGHT` a lifecycle event the agent made itself, as the
    /// eBPF programs keep those of the probes (`track` in
    /// ebpf/src/main.rs): the lifecycles the kernel holds are what the
    /// next agent takes over, so an SGLang room in flight survives a
    /// restart of the agent like a NIXL handle does. A write that fails
    /// (a full table) is counted and warned about ([`Self::warn`]); the
    /// agent goes on following the request, only a restart would lose it.
    pub fn hold(&mut self, observation: &Observation) {
        if let Err(err) = self.try_hold(observation) {
            self.unheld += 1;
            self.last_unheld = Some(format!("pid {} key {:#x}: {err:#}", observation.pid, observation.key));
        }
    }

    fn try_hold(&mut self, o: &Observation) -> Result<()> {
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

    /// Warn, once per counter period, of the lifecycles [`Self::hold`]
    /// could not keep since the last warning.
    pub fn warn(&mut self) {
        if let Some(new) = self.warned.news(self.unheld) {
            warn!(
                new,
                total = self.unheld,
                latest = self.last_unheld.as_deref().unwrap_or(""),
                "requests the agent made (SGLang rooms) that the kernel's in-flight table could not hold: they are followed, \
                 but would not survive an agent restart"
            );
        }
        if let Some(new) = self.warned_unkept.news(self.unkept) {
            warn!(
                new,
                total = self.unkept,
                latest = self.last_unkept.as_deref().unwrap_or(""),
                "what the agent knew of requests it made (an SGLang room's destinations and handles) could not be pinned \
                 for the next agent: after a restart such a request is taken over knowing nothing of what it waits on"
            );
        }
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

    /// Lifecycles the agent made that the table could not hold
    /// ([`Self::hold`]): while any, a request it does not hold may still
    /// be live.
    pub fn unheld(&self) -> u64 {
        self.unheld
    }

    /// Keep the kernel's tables in step with a report: mark a stall as
    /// reported, unmark it when it recovers, collect an ended entry the
    /// kernel kept for a mark, drop what the kernel cannot know has ended
    /// (evictions, processes gone).
    pub fn apply(&mut self, report: &Report) -> Result<()> {
        let request = report.request();
        let id = (request.pid, request.key);
        let key = RequestKey { key: request.key, pid: request.pid, _pad: 0 };
        match report {
            Report::Stalled { request, .. } => {
                self.tables.mark(&key, request.last_ns)?;
                self.marked.insert(id);
            }
            Report::Recovered { .. } => {
                // The kernel may already have kept an ended entry: `marked`
                // stays until the end, which collects it.
                self.tables.forget_alerted(&key)?;
            }
            Report::Ended { outcome, .. } => {
                let marked = self.marked.remove(&id);
                if marked {
                    self.tables.forget_alerted(&key)?;
                }
                match outcome {
                    Outcome::Released
                    | Outcome::Completed
                    | Outcome::Aborted
                    | Outcome::Failed
                    | Outcome::LeaseExpired
                    | Outcome::KvReadAfterRelease
                    | Outcome::Leaked => {
                        if request.inferred.contains(request.stage) {
                            // Ended by a read of the target's memory (an
                            // error status, or a done one where done is
                            // complete): the kernel saw no end and still
                            // holds it as live, which the next agent would
                            // take over and end again. Its entry, not a
                            // next lifecycle's.
                            if self.tables.inflight(&key)?.is_some_and(|entry| entry.first_ns <= request.last_ns) {
                                self.tables.forget_inflight(&key)?;
                            }
                        } else if marked {
                            // The kernel already dropped it, unless it kept
                            // it for the stall alert: collect that (not a
                            // next lifecycle of the key that began since).
                            if self.tables.inflight(&key)?.is_some_and(|entry| entry.ended != 0) {
                                self.tables.forget_inflight(&key)?;
                            }
                        }
                    }
                    Outcome::Evicted => self.tables.forget_inflight(&key)?,
                    // The kernel holds none of it (or a later lifecycle of
                    // the key, which is not this one's to drop).
                    Outcome::EndUnseen => {}
                    // Its own entry only: a reused pid's new process may
                    // hold others (`forget_process` drops the rest of an
                    // exited one).
                    Outcome::ProcessExited => {
                        self.tables.forget_inflight(&key)?;
                        self.tables.forget_alerted(&key)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether the kernel still holds, live, the lifecycle of (`pid`, `key`)
    /// whose latest event the agent has is at `last_ns`: the probes saw no
    /// end of it (even one whose event was lost or is not read yet), and
    /// the key has not started another lifecycle since (the entry began no
    /// later). What the target's memory holds at the key is that
    /// lifecycle's only while this is true: a released request's memory
    /// may be freed or already another request's.
    pub fn holds(&self, pid: u32, key: u64, last_ns: u64) -> Result<bool> {
        let entry = self.tables.inflight(&RequestKey { key, pid, _pad: 0 })?;
        Ok(entry.is_some_and(|entry| entry.ended == 0 && entry.first_ns <= last_ns))
    }

    /// What the kernel holds of the silent `silent` beyond what the agent
    /// has: its entry's events later than `last_ns`, kept there by `quiet`
    /// probes, while the entry is live and this lifecycle's (it began no
    /// later than the silence).
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

    /// Drop every entry of `pid`: it exited, or this agent does not watch it.
    pub fn forget_process(&mut self, pid: u32) -> Result<()> {
        self.marked.retain(|(marked_pid, _)| *marked_pid != pid);
        for key in self.tables.inflight_keys()?.iter().filter(|key| key.pid == pid) {
            self.tables.forget_inflight(key)?;
        }
        for key in self.tables.alerted_keys()?.iter().filter(|key| key.pid == pid) {
            self.tables.forget_alerted(key)?;
        }
        for key in self.tables.context_keys()?.iter().filter(|key| key.pid == pid) {
            self.tables.forget_context(key)?;
        }
        Ok(())
    }
}

/// A lookup's value, `None` for a key not there.
fn found<V>(result: Result<V, MapError>) -> Result<Option<V>> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(err) => Err(anyhow!(err)),
    }
}

/// Remove `key`; already gone is fine.
fn forget<V: aya::Pod>(map: &mut BpfHashMap<MapData, RequestKey, V>, key: &RequestKey) -> Result<()> {
    match map.remove(key) {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(err)) if err.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(err) => Err(anyhow!(err)).context("removing an in-flight map entry"),
    }
}

/// `bytes` as a `CONTEXT` value; an error if they do not fit.
fn held_context(bytes: &[u8]) -> Result<HeldContext> {
    let mut held = HeldContext { len: 0, _pad: [0; 6], bytes: [0; CONTEXT_BYTES] };
    held.bytes
        .get_mut(..bytes.len())
        .ok_or_else(|| anyhow!("a context of {} bytes, more than the {CONTEXT_BYTES} pinned", bytes.len()))?
        .copy_from_slice(bytes);
    held.len = u16::try_from(bytes.len()).context("a context's length")?;
    Ok(held)
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
    use stallwatch_common::{EXT_ID_LEN, NOT_EMITTED, stage};

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

    // ------------------------------------------- the in-flight protocol, modelled

    use std::{cell::RefCell, collections::BTreeMap, collections::HashMap, collections::VecDeque, rc::Rc};

    use crate::lifecycle::{Engine, EngineConfig, Observation, StageRead};

    /// What the eBPF programs do with the two tables and the ring buffer
    /// (`emit` and `track` in ebpf/src/main.rs), written out plainly. It
    /// outlives every agent, as the pinned maps do.
    #[derive(Default)]
    struct Kernel {
        inflight: BTreeMap<(u32, u64), InflightEntry>,
        alerted: BTreeMap<(u32, u64), u64>,
        context: BTreeMap<(u32, u64), HeldContext>,
        ring: VecDeque<Observation>,
        capacity: usize,
    }

    impl Kernel {
        /// `ends`: the event's slot ends lifecycles at its stage (`ENDS`).
        fn event(&mut self, pid: u32, key: u64, stage: u8, ends: bool, ts: u64) {
            let id = (pid, key);
            self.ring.push_back(Observation {
                pid,
                key,
                stage: decode::stage(stage).expect("stage"),
                ts_ns: ts,
                external_id: None,
                ends: ends.then_some(Outcome::Completed),
            });
            if ends || stage >= stage::FIRST_TERMINAL {
                if self.alerted.contains_key(&id) {
                    if let Some(entry) = self.inflight.get_mut(&id) {
                        entry.stage = stage;
                        entry.ended = 1;
                        entry.last_ns = entry.last_ns.max(ts);
                    }
                } else {
                    self.inflight.remove(&id);
                }
                return;
            }
            if let Some(entry) = self.inflight.get_mut(&id) {
                if entry.ended == 0 {
                    entry.last_ns = entry.last_ns.max(ts);
                    entry.stage = entry.stage.max(stage);
                    if entry.stage_ns[usize::from(stage)] == 0 {
                        entry.stage_ns[usize::from(stage)] = ts;
                    }
                    return;
                }
            } else if self.inflight.len() >= self.capacity {
                return;
            }
            let mut entry = InflightEntry {
                first_ns: ts,
                last_ns: ts,
                stage_ns: [0; stage::LIVE],
                last_ret: 0,
                last_slot: NOT_EMITTED,
                stage,
                has_ext: 0,
                ended: 0,
                withheld: 0,
                ext: [0; EXT_ID_LEN],
            };
            entry.stage_ns[usize::from(stage)] = ts;
            self.inflight.insert(id, entry);
        }
    }

    #[derive(Clone, Default)]
    struct Shared(Rc<RefCell<Kernel>>);

    /// A seeded xorshift die, `roll(n)` in `0..n`: the model tests replay
    /// any failing seed exactly, without a crate for randomness.
    fn dice(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        move |n| {
            rng ^= rng >> 12;
            rng ^= rng << 25;
            rng ^= rng >> 27;
            rng.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
        }
    }

    fn id(key: &RequestKey) -> (u32, u64) {
        (key.pid, key.key)
    }

    fn key_of((pid, key): (u32, u64)) -> RequestKey {
        RequestKey { key, pid, _pad: 0 }
    }

    impl Tables for Shared {
        fn inflight_keys(&self) -> Result<Vec<RequestKey>> {
            Ok(self.0.borrow().inflight.keys().copied().map(key_of).collect())
        }
        fn inflight(&self, key: &RequestKey) -> Result<Option<InflightEntry>> {
            Ok(self.0.borrow().inflight.get(&id(key)).copied())
        }
        fn forget_inflight(&mut self, key: &RequestKey) -> Result<()> {
            self.0.borrow_mut().inflight.remove(&id(key));
            Ok(())
        }
        fn put_inflight(&mut self, key: &RequestKey, entry: &InflightEntry) -> Result<()> {
            let mut kernel = self.0.borrow_mut();
            if !kernel.inflight.contains_key(&id(key)) && kernel.inflight.len() >= kernel.capacity {
                bail!("the table is full");
            }
            kernel.inflight.insert(id(key), *entry);
            Ok(())
        }
        fn alerted_keys(&self) -> Result<Vec<RequestKey>> {
            Ok(self.0.borrow().alerted.keys().copied().map(key_of).collect())
        }
        fn alerted(&self, key: &RequestKey) -> Result<Option<u64>> {
            Ok(self.0.borrow().alerted.get(&id(key)).copied())
        }
        fn mark(&mut self, key: &RequestKey, last_ns: u64) -> Result<()> {
            self.0.borrow_mut().alerted.insert(id(key), last_ns);
            Ok(())
        }
        fn forget_alerted(&mut self, key: &RequestKey) -> Result<()> {
            self.0.borrow_mut().alerted.remove(&id(key));
            Ok(())
        }
        fn context_keys(&self) -> Result<Vec<RequestKey>> {
            Ok(self.0.borrow().context.keys().copied().map(key_of).collect())
        }
        fn context(&self, key: &RequestKey) -> Result<Option<HeldContext>> {
            Ok(self.0.borrow().context.get(&id(key)).copied())
        }
        fn put_context(&mut self, key: &RequestKey, context: &HeldContext) -> Result<()> {
            let mut kernel = self.0.borrow_mut();
            if !kernel.context.contains_key(&id(key)) && kernel.context.len() >= kernel.capacity {
                bail!("the table is full");
            }
            kernel.context.insert(id(key), *context);
            Ok(())
        }
        fn forget_context(&mut self, key: &RequestKey) -> Result<()> {
            self.0.borrow_mut().context.remove(&id(key));
            Ok(())
        }
    }

    /// One agent: the real engine and the real [`KernelState`] on the model
    /// kernel, doing what `run` does (restore at start, then read the ring
    /// buffer, tick, and apply every report after it is out).
    struct ModelAgent {
        engine: Engine,
        state: KernelState<Shared>,
    }

    /// Every report any agent made, to find one made twice.
    #[derive(Default)]
    struct Reported {
        /// (pid, key, first_ns) of each lifecycle ended.
        ended: HashMap<(u32, u64, u64), usize>,
        /// (pid, key, last_ns) of each silence reported.
        stalled: HashMap<(u32, u64, u64), usize>,
        /// Lifecycles ended by a read of the target's memory: failed, and
        /// complete at a done read.
        read_failed: usize,
        read_done: usize,
    }

    impl ModelAgent {
        fn start(kernel: &Shared, reported: &mut Reported) -> Self {
            let mut agent = Self {
                engine: Engine::new(EngineConfig { timeout_ns: 50, max_tracked: 1 << 20, tick_ns: 1 }),
                state: KernelState::new(kernel.clone()),
            };
            let mut reports = Vec::new();
            for request in agent.state.snapshot().expect("snapshot") {
                agent.engine.restore(request, &mut reports);
            }
            // What the ring buffer gathered is read before any report of
            // the take-over is applied, as `run` does: a lifecycle that
            // ended while no agent ran is collected from the table only
            // once its events are read, never left for the next agent to
            // read as a new one.
            agent.read_into(kernel, &mut reports);
            agent.emit(reports, reported);
            agent
        }

        fn emit(&mut self, reports: Vec<Report>, reported: &mut Reported) {
            for report in reports {
                let r = report.request();
                match &report {
                    Report::Ended { .. } => {
                        *reported.ended.entry((r.pid, r.key, r.first_ns)).or_default() += 1;
                        reported.read_failed += usize::from(r.inferred.contains(Stage::Failed));
                        reported.read_done += usize::from(r.inferred.contains(Stage::TransferDone));
                    }
                    Report::Stalled { .. } => *reported.stalled.entry((r.pid, r.key, r.last_ns)).or_default() += 1,
                    Report::Recovered { .. } => {}
                }
                self.state.apply(&report).expect("apply");
            }
        }

        fn read(&mut self, kernel: &Shared, reported: &mut Reported) {
            let mut reports = Vec::new();
            self.read_into(kernel, &mut reports);
            self.emit(reports, reported);
        }

        fn read_into(&mut self, kernel: &Shared, reports: &mut Vec<Report>) {
            while let Some(observation) = kernel.0.borrow_mut().ring.pop_front() {
                self.engine.observe(observation, reports);
            }
        }

        /// A tick, reading the target's memory as `run` does, only for a
        /// request the kernel still holds: key 0x105's memory says its
        /// transfer failed once posted, and the target never releases it;
        /// key 0x104's says done, which completes it (its profile completes
        /// at transfer_done, see [`lazy`]). One read a tick, so requests due
        /// but not read yet (carried over, as at a mass stall) are often
        /// what a killed agent leaves behind.
        fn advance(&mut self, now: u64, reported: &mut Reported) {
            let mut reports = Vec::new();
            let state = &self.state;
            self.engine.advance_reading(
                now,
                1,
                &mut |silents, answers| {
                    answers.extend(silents.iter().map(|silent| {
                        let stage = match silent.key {
                            0x105 => Stage::Failed,
                            0x104 => Stage::TransferDone,
                            _ => return None,
                        };
                        let read = silent.stage == Stage::TransferPosted;
                        (read && state.holds(silent.pid, silent.key, silent.last_ns).expect("holds"))
                            .then_some(StageRead { stage, ends: lazy(silent.key) && stage == Stage::TransferDone })
                    }));
                },
                &mut reports,
            );
            self.emit(reports, reported);
        }
    }

    /// The lifecycles the agent makes itself (an SGLang room's) are held
    /// in `INFLIGHT` as the kernel holds the probes': the same random
    /// events, some keys marked alerted, leave the same table written by
    /// [`KernelState::hold`] as by the model of the eBPF programs; and a
    /// full table is counted, not fatal.
    #[test]
    fn a_lifecycle_the_agent_makes_is_held_as_the_kernel_holds_its_own() {
        use stallwatch_common::stage::{FIRST_TERMINAL, LIVE};
        let mut kept_ended = 0;
        for seed in 1..=20u64 {
            let mut roll = dice(seed);
            let (kernel, held) = (Shared::default(), Shared::default());
            let capacity = if seed % 5 == 0 { 2 } else { 1 << 17 };
            kernel.0.borrow_mut().capacity = capacity;
            held.0.borrow_mut().capacity = capacity;
            let mut state = KernelState::new(held.clone());
            let mut full = 0;
            for step in 0..400u64 {
                let (pid, key) = (1 + roll(2) as u32, 1_000 + roll(4));
                if roll(10) == 0 {
                    for table in [&kernel, &held] {
                        table.0.borrow_mut().alerted.insert((pid, key), step);
                    }
                }
                let stage = if roll(5) == 0 { FIRST_TERMINAL + roll(3) as u8 } else { roll(LIVE as u64) as u8 };
                let ends = stage < FIRST_TERMINAL && roll(8) == 0;
                let ts = 10 * step + roll(15);
                let before = held.0.borrow().inflight.len();
                kernel.0.borrow_mut().event(pid, key, stage, ends, ts);
                let observation = Observation {
                    pid,
                    key,
                    stage: decode::stage(stage).expect("stage"),
                    ts_ns: ts,
                    external_id: Some(key.to_string().into()),
                    ends: ends.then_some(Outcome::Completed),
                };
                let unheld = state.unheld;
                state.hold(&observation);
                if state.unheld > unheld {
                    assert_eq!(before, capacity, "seed {seed} step {step}: only a full table refuses");
                    full += 1;
                }
                kept_ended += held.0.borrow().inflight.values().filter(|entry| entry.ended == 1).count();
            }
            // The model keeps no external id: compare the rest, and the id
            // where the agent kept one.
            let ours = held.0.borrow().inflight.clone();
            for ((pid, key), entry) in &ours {
                assert_eq!(entry.has_ext, 1);
                assert_eq!(
                    decode::external_id_of(&entry.ext, true).as_deref(),
                    Some(key.to_string().as_str()),
                    "{pid}"
                );
            }
            let normalized: BTreeMap<_, _> = ours
                .into_iter()
                .map(|(id, entry)| (id, InflightEntry { has_ext: 0, ext: [0; EXT_ID_LEN], ..entry }))
                .collect();
            assert_eq!(normalized, kernel.0.borrow().inflight, "seed {seed}");
            assert_eq!(full > 0, capacity == 2, "seed {seed}");
        }
        assert!(kept_ended > 0, "some ended entries were kept for their alert");
    }

    /// What the agent hands over of the requests it made (`CONTEXT`) is
    /// what the next agent reads, byte for byte; `None` drops it; a
    /// context too large or a full table is counted and leaves nothing
    /// stale; an exited process's go with its entries.
    #[test]
    fn contexts_handed_over_are_read_back_and_what_cannot_be_kept_is_counted() {
        use stallwatch_common::CONTEXT_BYTES;
        let kernel = Shared::default();
        kernel.0.borrow_mut().capacity = 3;
        let mut state = KernelState::new(kernel.clone());
        state.hand_over(4, 1, Some(b"room one"));
        state.hand_over(4, 2, Some(&[7; CONTEXT_BYTES]));
        state.hand_over(5, 1, Some(b""));
        let read = |state: &KernelState<Shared>| {
            let mut contexts: Vec<_> = state.contexts().expect("contexts").into_iter().collect();
            contexts.sort();
            contexts
        };
        let full = vec![7; CONTEXT_BYTES];
        assert_eq!(read(&state), [((4, 1), b"room one".to_vec()), ((4, 2), full.clone()), ((5, 1), Vec::new())]);
        // Rewritten in place, then dropped.
        state.hand_over(4, 1, Some(b"answered"));
        state.hand_over(5, 1, None);
        state.hand_over(5, 9, None);
        assert_eq!(read(&state), [((4, 1), b"answered".to_vec()), ((4, 2), full)]);
        assert_eq!(state.unkept, 0);
        // Too large: counted, and what was there (no longer true) is gone.
        state.hand_over(4, 2, Some(&[1; CONTEXT_BYTES + 1]));
        assert_eq!((state.unkept, read(&state).len()), (1, 1));
        assert!(
            state.last_unkept.as_deref().is_some_and(|why| why.contains("more than the 1016")),
            "{:?}",
            state.last_unkept
        );
        // A full table refuses a new request's.
        for key in 10..13 {
            state.hand_over(6, key, Some(b"x"));
        }
        assert_eq!((state.unkept, read(&state).len()), (2, 3));
        state.forget_process(6).expect("forget");
        assert_eq!(read(&state), [((4, 1), b"answered".to_vec())]);
    }

    /// Keys whose probes end their lifecycles at transfer_done (a profile
    /// with `complete_at = "transfer_done"`), released only some time
    /// later if ever, as SGLang's handles are.
    fn lazy(key: u64) -> bool {
        key >= 0x103
    }

    /// Random lifecycles of a few keys (reused at once, as NIXL does),
    /// random agent ticks and reads, agents SIGKILLed between any two steps
    /// and started again, the ring buffer keeping what no agent read: no
    /// lifecycle ends twice, no silence is reported twice, and once a
    /// running agent has read everything the kernel keeps no ended entry.
    #[test]
    fn no_request_ends_twice_across_any_number_of_restarts() {
        use stallwatch_common::stage::{ABORTED, ENQUEUED, FAILED, RELEASED, TRANSFER_DONE};
        let mut totals = (0usize, 0usize, 0usize, 0usize, 0usize);
        for seed in 1..=40u64 {
            let mut roll = dice(seed);
            let kernel = Shared::default();
            kernel.0.borrow_mut().capacity = if seed % 4 == 0 { 3 } else { 1 << 17 };
            let mut reported = Reported::default();
            let mut agent = Some(ModelAgent::start(&kernel, &mut reported));
            let mut live: HashMap<(u32, u64), u8> = HashMap::new();
            let mut now = 1_000u64;
            let mut restarts = 0;
            for step in 0..3000 {
                now += 1 + roll(8);
                match roll(100) {
                    0..55 => {
                        let id = (1 + roll(2) as u32, 0x100 + roll(6));
                        let stage = match live.get(&id) {
                            // The late release of a lifecycle complete at transfer_done.
                            None if lazy(id.1) && roll(3) == 0 => RELEASED,
                            None => ENQUEUED,
                            Some(&at) => match roll(10) {
                                0..6 => (at + roll(2) as u8).min(TRANSFER_DONE),
                                6..8 => RELEASED,
                                8 => ABORTED,
                                _ => FAILED,
                            },
                        };
                        let ends = lazy(id.1) && stage == TRANSFER_DONE;
                        if stage >= RELEASED || ends {
                            live.remove(&id);
                        } else {
                            live.insert(id, stage);
                        }
                        kernel.0.borrow_mut().event(id.0, id.1, stage, ends, now);
                    }
                    55..75 => {
                        if let Some(agent) = &mut agent {
                            agent.read(&kernel, &mut reported);
                        }
                    }
                    75..93 => {
                        if let Some(agent) = &mut agent {
                            agent.advance(now, &mut reported);
                        }
                    }
                    _ => {
                        agent = match agent {
                            Some(_) => None,
                            None => {
                                restarts += 1;
                                Some(ModelAgent::start(&kernel, &mut reported))
                            }
                        };
                    }
                }
                let ctx = format!("seed {seed} step {step}");
                let twice: Vec<_> = reported.ended.iter().filter(|(_, n)| **n > 1).collect();
                assert!(twice.is_empty(), "{ctx}: lifecycles ended twice: {twice:?}");
                let twice: Vec<_> = reported.stalled.iter().filter(|(_, n)| **n > 1).collect();
                assert!(twice.is_empty(), "{ctx}: silences reported twice: {twice:?}");
                if let Some(agent) = &mut agent {
                    if kernel.0.borrow().ring.is_empty() {
                        let k = kernel.0.borrow();
                        let ended: Vec<_> = k.inflight.iter().filter(|(_, e)| e.ended != 0).collect();
                        assert!(ended.is_empty(), "{ctx}: ended entries the agent has seen end are kept: {ended:?}");
                        let orphans: Vec<_> =
                            k.alerted.keys().filter(|id| agent.engine.get(id.0, id.1).is_none()).collect();
                        assert!(orphans.is_empty(), "{ctx}: marks of requests no agent follows: {orphans:?}");
                    }
                }
            }
            totals.0 += restarts;
            totals.1 += reported.stalled.len();
            totals.2 += reported.ended.len();
            totals.3 += reported.read_failed;
            totals.4 += reported.read_done;
        }
        // The walk really restarted agents with stalls marked, and ended
        // requests by reads.
        assert!(totals.0 > 500 && totals.1 > 500 && totals.2 > 5000 && totals.3 > 20 && totals.4 > 20, "{totals:?}");
    }
}
