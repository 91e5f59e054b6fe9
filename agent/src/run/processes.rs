//! The process table: every watched process, the task that hears of its
//! exit (through a pidfd, so a reused pid is never mistaken for it), and
//! what is known of its image.
use std::{
    collections::{HashMap, HashSet},
    os::fd::{FromRawFd as _, OwnedFd},
    path::PathBuf,
};

use anyhow::{Context as _, Result, bail};
use tokio::{io::unix::AsyncFd, sync::mpsc, task::JoinHandle};
use tracing::warn;

use super::rules::ProfileId;
use crate::{
    kernel::reactor,
    profile::{Profile, plan::Plan},
    util::lineage::Lineage,
};

/// One attached process.
struct Watched {
    /// Its name when attached (an exec changes it).
    name: String,
    /// The profile it is watched with.
    profile: ProfileId,
    exit_waiter: JoinHandle<()>,
}

/// Why a watched process's probes and requests go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    Exited,
    /// It exec'd a new program: the probes were on the old one.
    Exec,
}

/// The watched processes, by pid.
pub struct Processes {
    watched: HashMap<u32, Watched>,
    /// Where each exit waiter sends its pid ([`Self::new`] returns the
    /// receiving end, which the event loop polls).
    exit_tx: mpsc::UnboundedSender<u32>,
    /// Library files (and builds) already warned about as foreign builds.
    foreign_builds: HashSet<(PathBuf, String)>,
}

impl Processes {
    /// An empty table, and the stream of pids that exit.
    pub fn new() -> (Self, mpsc::UnboundedReceiver<u32>) {
        let (exit_tx, exits) = mpsc::unbounded_channel();
        (Self { watched: HashMap::new(), exit_tx, foreign_builds: HashSet::new() }, exits)
    }

    pub fn contains(&self, pid: u32) -> bool {
        self.watched.contains_key(&pid)
    }

    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.watched.keys().copied()
    }

    /// The name `pid` had when it was attached.
    pub fn name(&self, pid: u32) -> Option<&str> {
        self.watched.get(&pid).map(|watched| watched.name.as_str())
    }

    /// The profile `pid` is watched with.
    pub fn profile(&self, pid: u32) -> Option<ProfileId> {
        self.watched.get(&pid).map(|watched| watched.profile)
    }

    /// Follow `pid`, named `name` and watched with `profile`, until
    /// `exited` (its pidfd, opened before it was attached) says it exited.
    pub fn insert(&mut self, pid: u32, name: String, profile: ProfileId, exited: AsyncFd<OwnedFd>) {
        let exit_tx = self.exit_tx.clone();
        let waiter = tokio::spawn(async move {
            // Readable means exited; an error means it cannot be watched,
            // which is reported the same way rather than lost.
            if let Ok(mut guard) = exited.readable().await {
                guard.retain_ready();
            }
            let _ = exit_tx.send(pid);
        });
        self.watched.insert(pid, Watched { name, profile, exit_waiter: waiter });
    }

    /// Stop following `pid`.
    pub fn remove(&mut self, pid: u32) {
        if let Some(watched) = self.watched.remove(&pid) {
            watched.exit_waiter.abort();
        }
    }

    /// Whether `pid` maps a build of the profile's `[layout]` library that
    /// the profile's offsets were not checked against (another build id,
    /// or none): then nothing is read at those offsets in it, since the
    /// bytes there may be anything (a never-posted handle read as
    /// `release_lost`). Warned about once per library file and build. A
    /// process that does not map the library is not judged here: its
    /// probes on it fail to attach, saying so.
    /// `plan` holds the library's build id, read with the process's other
    /// objects.
    pub fn foreign_build(&mut self, plan: &Plan, profile: &Profile) -> bool {
        let Some(layout) = &profile.layout else { return false };
        let Some((path, build)) = &plan.layout_build else { return false };
        let pid = plan.image.pid;
        let build = match build {
            Ok(Some(id)) if layout.knows(id) => return false,
            Ok(Some(id)) => format!("build id {id}"),
            Ok(None) => "no build id".to_owned(),
            Err(err) => format!("a build id that could not be read ({err})"),
        };
        if self.foreign_builds.insert((path.clone(), build.clone())) {
            warn!(
                pid,
                library = %crate::util::text::value(&path.display().to_string()),
                "{} has {build}, not a build profile {} (line {} of {}) was checked against ({}): its status reads, \
                 read_status and external ids are off for processes mapping it, their stalls classified by the probes \
                 alone. To use them, check that the build lays its structs out as the profile's offsets say (see \
                 docs/frameworks/nixl.md, \"A library build the profile does not know\"), then add its build id (`readelf -n`) to \
                 `build_ids` in the [layout] of a profile that extends this one",
                layout.object,
                profile.name,
                layout.line,
                layout.origin,
                layout.checked
            );
        }
        true
    }
}

/// A pidfd that becomes readable when `pid` exits.
pub fn pidfd(pid: u32) -> Result<AsyncFd<OwnedFd>> {
    let raw_pid = libc::pid_t::try_from(pid).with_context(|| format!("pid {pid} is out of range"))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, 0) };
    if fd < 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ESRCH) {
            bail!("no process with pid {pid} (check `ps -p {pid}`)");
        }
        // The kernel refuses (ENOENT, EINVAL on older kernels) a thread
        // that is not its process's main one.
        if let Some(tgid) = thread_group_of(pid) {
            bail!("pid {pid} is a thread of process {tgid}, not a process: pass --pid {tgid}");
        }
        return Err(err).with_context(|| format!("pidfd_open({pid})"));
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    reactor::register(fd, "the target's pidfd")
}

/// The process a thread id belongs to (`Tgid:` in its status file).
fn thread_group_of(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status.lines().find_map(|line| line.strip_prefix("Tgid:")?.trim().parse().ok()).filter(|&tgid| tgid != tid)
}

/// The name a watched process is shown by: its `comm`, or where that is
/// its title cut at the kernel's 15 bytes (setproctitle sets both:
/// `VLLM::EngineCor`), the title's first word, up to 64 bytes.
pub fn shown_name(pid: u32, lineage: &Lineage) -> String {
    shown(process_name(pid), lineage)
}

fn shown(comm: String, lineage: &Lineage) -> String {
    let title = lineage.iter().next().and_then(|own| own.args.first()).and_then(|arg| arg.split_whitespace().next());
    match title {
        Some(title) if comm.len() == 15 && title.len() > 15 && title.starts_with(&comm) => {
            title.chars().take(64).collect()
        }
        _ => comm,
    }
}

/// The process's name (`comm`), as the process set it: any bytes, made
/// UTF-8 (invalid sequences replaced); printed through [`crate::util::text`].
pub fn process_name(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/comm")).map_or_else(
        |_| "?".to_owned(),
        |bytes| String::from_utf8_lossy(bytes.strip_suffix(b"\n").unwrap_or(&bytes)).into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::lineage::Generation;

    #[test]
    fn a_retitled_process_is_shown_by_its_title_not_its_cut_comm() {
        let lineage = |title: &str| Lineage(vec![Generation { pid: 7, args: vec![title.to_owned()] }]);
        assert_eq!(shown("VLLM::EngineCor".into(), &lineage("VLLM::EngineCore")), "VLLM::EngineCore");
        assert_eq!(shown("VLLM::Worker_TP".into(), &lineage("VLLM::Worker_TP0 x")), "VLLM::Worker_TP0");
        assert_eq!(shown("python".into(), &lineage("/usr/bin/python3")), "python");
        assert_eq!(shown("abcdefghijklmno".into(), &lineage("other-title-longer")), "abcdefghijklmno");
        assert_eq!(shown("python".into(), &Lineage::default()), "python");
    }
}
