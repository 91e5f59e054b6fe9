//! The bpf directory (`--bpf-dir`): where an agent pins the maps and
//! probe links a restarted agent takes over, locked while the agent runs.
use std::{
    fs::File,
    os::{fd::AsRawFd as _, unix::fs::DirBuilderExt as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use stallwatch_common::STATE_LAYOUT;
use tracing::{info, warn};

use crate::util::trusted_dir::TrustedDir;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_pins_name_their_slot() {
        assert_eq!(slot_of_link("slot12-pid345-lifecycle_entry"), Some(12));
        assert_eq!(slot_of_link("slot0-pid1-lifecycle_return"), Some(0));
        for bad in ["slot-pid1-x", "slotx-pid1-x", "slot1-pid-x", "slot1-pid1-", "slot1-pid1", "other"] {
            assert_eq!(slot_of_link(bad), None, "{bad}");
        }
    }
}
