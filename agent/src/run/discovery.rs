//! Process discovery: which processes on the host to watch, when no
//! `--pid` is given.
//!
//! A [`Selector`] matches on the executable, a mapped library, the command
//! line (a title `setproctitle` gave is the command line), the cgroup
//! (container) of a process and the image its container runs (from the
//! node's pods, with `--kubernetes`); every condition given must hold. The agent
//! scans `/proc` at start, hears of every exec through the
//! `sched_process_exec` BTF tracepoint, and re-checks recent execs for a
//! while because a library such as `libnixl.so` is `dlopen`ed well after
//! the exec (Python imports it). Which profile a matched process is
//! watched with is [`super::rules`]'.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use regex::Regex;

use crate::{export::workload::Directory, profile::resolve::ProcessImage};

/// What a watched process must look like.
#[derive(Debug, Clone, Default)]
pub struct Selector {
    /// Basename of the executable, or its full path when it has a `/`.
    pub exe: Option<String>,
    /// A library the process has mapped (as a profile's `object` names it).
    pub lib: Option<String>,
    /// Matched against the command line, arguments joined by spaces.
    pub cmdline: Option<Regex>,
    /// A substring of `/proc/PID/cgroup`: a container id, a pod UID, a
    /// systemd unit.
    pub cgroup: Option<String>,
    /// Matched against the image the process's container runs, as its
    /// pod's status names it (a config file's `[[rule]]` only).
    pub image: Option<Regex>,
}

impl Selector {
    pub fn new(
        exe: Option<String>,
        lib: Option<String>,
        cmdline: Option<&str>,
        cgroup: Option<String>,
    ) -> Result<Self> {
        let cmdline = cmdline
            .map(|pattern| {
                Regex::new(pattern).with_context(|| format!("--cmdline `{pattern}` is not a valid regular expression"))
            })
            .transpose()?;
        let selector = Self { exe, lib, cmdline, cgroup, image: None };
        if selector.is_empty() {
            bail!("nothing to watch: give --pid, or at least one of --exe, --lib, --cmdline, --cgroup");
        }
        Ok(selector)
    }

    /// Also the image of the process's container (a regular expression).
    pub fn with_image(mut self, pattern: &str) -> Result<Self> {
        let image =
            Regex::new(pattern).with_context(|| format!("image `{pattern}` is not a valid regular expression"))?;
        self.image = Some(image);
        Ok(self)
    }

    /// Every process: `--pid` with `--profile`, where the pid is the choice.
    pub fn any() -> Self {
        Self::default()
    }

    fn is_empty(&self) -> bool {
        self.exe.is_none()
            && self.lib.is_none()
            && self.cmdline.is_none()
            && self.cgroup.is_none()
            && self.image.is_none()
    }

    /// Whether the process `facts` reads matches; the cheap conditions
    /// first, the mapped libraries last (several selectors asking of one
    /// process read each of its files once). A process that vanished, or
    /// that this agent may not inspect, does not match.
    pub fn matches_facts(&self, facts: &mut Facts) -> bool {
        self.check(facts).unwrap_or(false)
    }

    fn check(&self, facts: &mut Facts) -> Result<bool> {
        if let Some(exe) = &self.exe {
            if !exe_matches(facts.exe()?, exe) {
                return Ok(false);
            }
        }
        if let Some(cmdline) = &self.cmdline {
            if !cmdline.is_match(facts.cmdline()?) {
                return Ok(false);
            }
        }
        if let Some(cgroup) = &self.cgroup {
            if !facts.cgroup()?.contains(cgroup.as_str()) {
                return Ok(false);
            }
        }
        if let Some(image) = &self.image {
            if !facts.image().is_some_and(|name| image.is_match(name)) {
                return Ok(false);
            }
        }
        if let Some(lib) = &self.lib {
            return facts.maps(lib);
        }
        Ok(true)
    }

    /// Whether the process maps the library this selector names (`false`
    /// for one that names none): a process that does, but that no rule
    /// matches, is one an operator may have meant to watch.
    pub fn maps_its_library(&self, facts: &mut Facts) -> bool {
        self.lib.as_ref().is_some_and(|lib| facts.maps(lib).unwrap_or(false))
    }

    /// Human-readable, for logs.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(exe) = &self.exe {
            parts.push(format!("exe={exe}"));
        }
        if let Some(lib) = &self.lib {
            parts.push(format!("lib={lib}"));
        }
        if let Some(cmdline) = &self.cmdline {
            parts.push(format!("cmdline=/{cmdline}/"));
        }
        if let Some(cgroup) = &self.cgroup {
            parts.push(format!("cgroup={cgroup}"));
        }
        if let Some(image) = &self.image {
            parts.push(format!("image=/{image}/"));
        }
        parts.join(" ")
    }
}

/// What the selectors read of one process, each file read once, when
/// first asked.
pub struct Facts<'a> {
    pub pid: u32,
    proc_dir: PathBuf,
    exe: Option<PathBuf>,
    cmdline: Option<String>,
    cgroup: Option<String>,
    mapped: Option<ProcessImage>,
    /// Where its container's image is looked up (`None`: no Kubernetes).
    pods: Option<&'a Directory>,
    /// Its container's image, once asked (`Some(None)`: not known).
    container_image: Option<Option<String>>,
}

impl<'a> Facts<'a> {
    /// `pid`, its container's image looked up in `pods` if given.
    pub fn of(pid: u32, pods: Option<&'a Directory>) -> Self {
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        Self { pid, proc_dir, exe: None, cmdline: None, cgroup: None, mapped: None, pods, container_image: None }
    }

    /// The image its container runs, if the node's pods say.
    fn image(&mut self) -> Option<&str> {
        if self.container_image.is_none() {
            self.container_image = Some(self.pods.and_then(|pods| pods.image_of(self.pid)));
        }
        self.container_image.as_ref().and_then(Option::as_deref)
    }

    fn exe(&mut self) -> Result<&Path> {
        if self.exe.is_none() {
            self.exe = Some(std::fs::read_link(self.proc_dir.join("exe"))?);
        }
        Ok(self.exe.as_deref().unwrap_or(Path::new("")))
    }

    /// The command line, arguments joined by spaces.
    pub fn cmdline(&mut self) -> Result<&str> {
        if self.cmdline.is_none() {
            self.cmdline = Some(join_cmdline(&std::fs::read(self.proc_dir.join("cmdline"))?));
        }
        Ok(self.cmdline.as_deref().unwrap_or_default())
    }

    fn cgroup(&mut self) -> Result<&str> {
        if self.cgroup.is_none() {
            self.cgroup = Some(std::fs::read_to_string(self.proc_dir.join("cgroup"))?);
        }
        Ok(self.cgroup.as_deref().unwrap_or_default())
    }

    fn maps(&mut self, lib: &str) -> Result<bool> {
        if self.mapped.is_none() {
            self.mapped = Some(ProcessImage::read(self.pid)?);
        }
        Ok(self.mapped.as_ref().is_some_and(|mapped| mapped.find(Some(lib)).is_ok()))
    }
}

/// Every pid in `/proc` but this agent's, in order.
pub fn all_pids() -> Result<Vec<u32>> {
    let me = std::process::id();
    let mut pids: Vec<u32> = std::fs::read_dir("/proc")
        .context("listing /proc")?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .collect();
    pids.sort_unstable();
    Ok(pids)
}

fn exe_matches(path: &Path, exe: &str) -> bool {
    let path = PathBuf::from(path.to_string_lossy().trim_end_matches(" (deleted)"));
    if exe.contains('/') { path == Path::new(exe) } else { path.file_name().is_some_and(|name| name == exe) }
}

fn join_cmdline(raw: &[u8]) -> String {
    let trimmed = raw.strip_suffix(b"\0").unwrap_or(raw);
    String::from_utf8_lossy(trimmed).replace('\0', " ")
}

/// Execs seen recently that did not match yet: re-checked every
/// [`Pending::RECHECK_NS`] until they match, exit, or [`Pending::PATIENCE_NS`]
/// passes (a library is loaded during start-up, not an hour later).
#[derive(Default)]
pub struct Pending {
    since: HashMap<u32, u64>,
}

impl Pending {
    pub const RECHECK_NS: u64 = 500_000_000;
    pub const PATIENCE_NS: u64 = 120_000_000_000;

    pub fn add(&mut self, pid: u32, now_ns: u64) {
        self.since.entry(pid).or_insert(now_ns);
    }

    /// The pending pids `choose` finds a match for now (and are no longer
    /// pending), with it; drops those gone, and those past their patience,
    /// which are returned as `expired` (alive, matching nothing).
    pub fn recheck<T>(&mut self, now_ns: u64, mut choose: impl FnMut(u32) -> Option<T>) -> Rechecked<T> {
        let mut rechecked = Rechecked { matched: Vec::new(), expired: Vec::new() };
        self.since.retain(|&pid, since| {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return false;
            }
            if now_ns.saturating_sub(*since) > Self::PATIENCE_NS {
                rechecked.expired.push(pid);
                return false;
            }
            match choose(pid) {
                Some(chosen) => {
                    rechecked.matched.push((pid, chosen));
                    false
                }
                None => true,
            }
        });
        rechecked.matched.sort_unstable_by_key(|(pid, _)| *pid);
        rechecked
    }

    pub fn is_empty(&self) -> bool {
        self.since.is_empty()
    }
}

/// What [`Pending::recheck`] found.
pub struct Rechecked<T> {
    /// Pids that match now, with what matched.
    pub matched: Vec<(u32, T)>,
    /// Pids that matched nothing within [`Pending::PATIENCE_NS`].
    pub expired: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Selector {
        /// Whether `pid` matches now, no pods watched.
        fn matches(&self, pid: u32) -> bool {
            self.matches_facts(&mut Facts::of(pid, None))
        }
    }

    #[test]
    fn an_empty_selector_is_refused_with_the_flags_to_use() {
        let err = Selector::new(None, None, None, None).unwrap_err().to_string();
        assert!(err.contains("--pid") && err.contains("--exe"), "{err}");
        let err = Selector::new(None, None, Some("("), None).unwrap_err().to_string();
        assert!(err.contains("not a valid regular expression"), "{err}");
    }

    #[test]
    fn executables_match_by_basename_or_full_path() {
        assert!(exe_matches(Path::new("/usr/bin/python3.11"), "python3.11"));
        assert!(exe_matches(Path::new("/usr/bin/python3.11 (deleted)"), "python3.11"));
        assert!(!exe_matches(Path::new("/usr/bin/python3.11"), "python3"));
        assert!(exe_matches(Path::new("/opt/x/serve"), "/opt/x/serve"));
        assert!(!exe_matches(Path::new("/opt/y/serve"), "/opt/x/serve"));
    }

    #[test]
    fn command_lines_are_joined_with_spaces() {
        assert_eq!(join_cmdline(b"python\0-m\0sglang.launch_server\0"), "python -m sglang.launch_server");
        assert_eq!(join_cmdline(b""), "");
    }

    #[test]
    fn this_test_process_is_found_by_its_own_traits() {
        let me = std::process::id();
        let exe = std::env::current_exe().unwrap();
        let name = exe.file_name().unwrap().to_str().unwrap().to_owned();
        let by_exe = Selector::new(Some(name.clone()), None, None, None).unwrap();
        assert!(by_exe.matches(me));
        let by_both = Selector::new(Some(name), Some("libc.so".into()), Some("stallwatch"), None).unwrap();
        assert!(by_both.matches(me));
        let not_me = Selector::new(None, Some("libnixl.so".into()), None, None).unwrap();
        assert!(!not_me.matches(me));
        assert!(Selector::any().matches(me));
        // The scan leaves the agent itself out.
        assert!(!all_pids().unwrap().contains(&me));
    }

    #[test]
    fn an_image_selector_matches_the_containers_image_and_nothing_without_one() {
        let nvidia = Selector::any().with_image("^nvcr\\.io/nvidia/").unwrap();
        assert_eq!(nvidia.describe(), "image=/^nvcr\\.io/nvidia//");
        let mut facts = Facts::of(std::process::id(), None);
        assert!(!nvidia.matches_facts(&mut facts), "no pods watched: no image, no match");
        facts.container_image = Some(Some("nvcr.io/nvidia/tritonserver:25.01".into()));
        assert!(nvidia.matches_facts(&mut facts));
        facts.container_image = Some(Some("docker.io/lmsysorg/sglang:latest".into()));
        assert!(!nvidia.matches_facts(&mut facts));
        let err = Selector::any().with_image("(").unwrap_err().to_string();
        assert!(err.contains("image `(`"), "{err}");
    }

    #[test]
    fn pending_execs_are_dropped_when_gone_or_past_patience() {
        let never = Selector::new(None, Some("libnixl.so".into()), None, None).unwrap();
        let choose = |pid| never.matches(pid).then_some(());
        let mut pending = Pending::default();
        pending.add(std::process::id(), 0);
        pending.add(u32::MAX - 1, 0);
        let first = pending.recheck(1, choose);
        assert!(first.matched.is_empty() && first.expired.is_empty());
        assert_eq!(pending.since.len(), 1, "the vanished pid is dropped");
        let late = pending.recheck(Pending::PATIENCE_NS + 1, choose);
        assert_eq!(late.expired, [std::process::id()], "past its patience, said as matching nothing");
        assert!(pending.is_empty());
        pending.add(std::process::id(), 0);
        let me = pending.recheck(1, Some);
        assert_eq!(me.matched, [(std::process::id(), std::process::id())]);
    }
}
