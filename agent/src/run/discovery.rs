//! Process discovery: which processes on the host to watch, when no
//! `--pid` is given.
//!
//! A [`Selector`] matches on the executable, a mapped library, the command
//! line and the cgroup (container) of a process; every condition given must
//! hold. The agent scans `/proc` at start, hears of every exec through the
//! `sched_process_exec` BTF tracepoint, and re-checks recent execs for a
//! while because a library such as `libnixl.so` is `dlopen`ed well after
//! the exec (Python imports it).
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use regex::Regex;

use crate::profile::resolve::ProcessImage;

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
        let selector = Self { exe, lib, cmdline, cgroup };
        if selector.is_empty() {
            bail!("nothing to watch: give --pid, or at least one of --exe, --lib, --cmdline, --cgroup");
        }
        Ok(selector)
    }

    fn is_empty(&self) -> bool {
        self.exe.is_none() && self.lib.is_none() && self.cmdline.is_none() && self.cgroup.is_none()
    }

    /// Whether `pid` matches now. A process that vanished, or that this
    /// agent may not inspect, does not match.
    pub fn matches(&self, pid: u32) -> bool {
        self.check(Path::new(&format!("/proc/{pid}")), pid).unwrap_or(false)
    }

    fn check(&self, proc_dir: &Path, pid: u32) -> Result<bool> {
        if let Some(exe) = &self.exe {
            let path = std::fs::read_link(proc_dir.join("exe"))?;
            if !exe_matches(&path, exe) {
                return Ok(false);
            }
        }
        if let Some(cmdline) = &self.cmdline {
            let raw = std::fs::read(proc_dir.join("cmdline"))?;
            if !cmdline.is_match(&join_cmdline(&raw)) {
                return Ok(false);
            }
        }
        if let Some(cgroup) = &self.cgroup {
            if !std::fs::read_to_string(proc_dir.join("cgroup"))?.contains(cgroup.as_str()) {
                return Ok(false);
            }
        }
        if let Some(lib) = &self.lib {
            return Ok(ProcessImage::read(pid)?.find(Some(lib)).is_ok());
        }
        Ok(true)
    }

    /// Every process on the host that matches, but this agent.
    pub fn scan(&self) -> Result<Vec<u32>> {
        let me = std::process::id();
        let mut pids: Vec<u32> = std::fs::read_dir("/proc")
            .context("listing /proc")?
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&pid| pid != me && self.matches(pid))
            .collect();
        pids.sort_unstable();
        Ok(pids)
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
        parts.join(" ")
    }
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

    /// The pending pids that match now (and are no longer pending); drops
    /// those past their patience or gone.
    pub fn recheck(&mut self, selector: &Selector, now_ns: u64) -> Vec<u32> {
        let mut matched = Vec::new();
        self.since.retain(|&pid, since| {
            if !Path::new(&format!("/proc/{pid}")).exists() || now_ns.saturating_sub(*since) > Self::PATIENCE_NS {
                return false;
            }
            if selector.matches(pid) {
                matched.push(pid);
                return false;
            }
            true
        });
        matched.sort_unstable();
        matched
    }

    pub fn is_empty(&self) -> bool {
        self.since.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // scan() leaves the agent itself out.
        assert!(!by_exe.scan().unwrap().contains(&me));
    }

    #[test]
    fn pending_execs_are_dropped_when_gone_or_past_patience() {
        let never = Selector::new(None, Some("libnixl.so".into()), None, None).unwrap();
        let mut pending = Pending::default();
        pending.add(std::process::id(), 0);
        pending.add(u32::MAX - 1, 0);
        assert!(pending.recheck(&never, 1).is_empty());
        assert_eq!(pending.since.len(), 1, "the vanished pid is dropped");
        assert!(pending.recheck(&never, Pending::PATIENCE_NS + 1).is_empty());
        assert!(pending.is_empty());
    }
}
