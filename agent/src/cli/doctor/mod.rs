//! `stallwatch doctor`: can stallwatch run here, and if not, what is
//! missing and how to fix it.
//!
//! Each check is `ok`, `missing` or `warning`, with a one-line detail, the
//! fix when it is not ok, and what depends on it. The checks that matter
//! most are real: a BPF ring buffer is created, stallwatch's own eBPF object
//! is loaded through the verifier, and its two programs are attached as a
//! uprobe and a uretprobe to a function of this very process, which is then
//! called to see them fire. A *required* check that is missing means
//! `stallwatch run` cannot work; doctor then exits non-zero.
//!
//! One module per kind of check: [`host`], [`privileges`], [`namespaces`],
//! [`ebpf`], [`filesystems`].
mod ebpf;
mod filesystems;
mod host;
mod namespaces;
mod privileges;

use std::{
    io::{self, Write},
    path::Path,
};

use serde::Serialize;

use crate::kernel::caps::{self, CAP_SYS_RESOURCE, Caps};

use self::{ebpf::*, filesystems::*, host::*, namespaces::*, privileges::*};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    Missing,
    Warning,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Missing => "missing",
            Status::Warning => "warning",
        }
    }
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    /// Missing, `stallwatch run` cannot work.
    pub required: bool,
    pub detail: String,
    /// What to do; `None` when ok.
    pub fix: Option<String>,
    /// What depends on it.
    pub needed_for: &'static str,
}

impl Check {
    fn new(name: &'static str, required: bool, needed_for: &'static str) -> Self {
        Self { name, status: Status::Ok, required, detail: String::new(), fix: None, needed_for }
    }

    fn ok(mut self, detail: impl Into<String>) -> Self {
        self.status = Status::Ok;
        self.detail = detail.into();
        self.fix = None;
        self
    }

    fn missing(mut self, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        self.status = Status::Missing;
        self.detail = detail.into();
        self.fix = Some(fix.into());
        self
    }

    fn warning(mut self, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        self.status = Status::Warning;
        self.detail = detail.into();
        self.fix = Some(fix.into());
        self
    }

    /// Missing and required: stallwatch cannot run.
    pub fn failed(&self) -> bool {
        self.required && self.status == Status::Missing
    }
}

/// All findings, in the order they were made.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// No required check is missing.
    pub ok: bool,
    pub kernel: String,
    pub arch: String,
    pub version: &'static str,
    /// Names of the required checks that are missing.
    pub failed_required: Vec<&'static str>,
    pub checks: Vec<Check>,
}

impl Report {
    fn new(kernel: String, arch: String, checks: Vec<Check>) -> Self {
        let failed_required: Vec<_> = checks.iter().filter(|c| c.failed()).map(|c| c.name).collect();
        Self {
            ok: failed_required.is_empty(),
            kernel,
            arch,
            version: env!("CARGO_PKG_VERSION"),
            failed_required,
            checks,
        }
    }

    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// The report for people: one line a check, the fix and what needs it
    /// under each that is not ok.
    pub fn write_human(&self, mut out: impl Write) -> io::Result<()> {
        writeln!(out, "stallwatch {} doctor on Linux {} ({})", self.version, self.kernel, self.arch)?;
        writeln!(out)?;
        for check in &self.checks {
            let mark = if check.required { '*' } else { ' ' };
            writeln!(out, "{:<8}{mark} {:<16} {}", check.status.as_str(), check.name, check.detail)?;
            if check.status != Status::Ok {
                let indent = " ".repeat(27);
                if let Some(fix) = &check.fix {
                    writeln!(out, "{indent}fix: {fix}")?;
                }
                writeln!(out, "{indent}needed for: {}", check.needed_for)?;
            }
        }
        writeln!(out)?;
        writeln!(out, "* required: without it `stallwatch run` cannot work")?;
        let others: Vec<_> =
            self.checks.iter().filter(|c| !c.failed() && c.status != Status::Ok).map(|c| c.name).collect();
        let others =
            if others.is_empty() { String::new() } else { format!("; not ok but not required: {}", others.join(", ")) };
        if self.ok {
            writeln!(out, "all required checks passed{others}")
        } else {
            writeln!(out, "required checks missing: {}{others}", self.failed_required.join(", "))
        }
    }
}

/// Run every check; `bpf_dir` and `socket` are the paths `run` would use.
pub fn run(bpf_dir: &Path, socket: &Path) -> Report {
    let (kernel, arch) = uname();
    let version = KernelVersion::parse(&kernel);
    let caps = Caps::of_self();
    let euid = caps::euid();
    let cap_last = caps::cap_last();
    let mounts = std::fs::read_to_string("/proc/mounts").map(|text| parse_mounts(&text));
    let mut checks = vec![
        kernel_check(&kernel, version),
        privileges_check(euid, caps.as_ref().ok().copied(), cap_last, caps.as_ref().err()),
        ptrace_check(euid, caps.as_ref().ok().copied()),
        pid_namespace_check(std::fs::read_link("/proc/self/ns/pid").map(|link| link.display().to_string())),
        time_namespace_check(crate::util::clock::time_offsets()),
        // Before the eBPF object is loaded: loading raises the limit.
        memlock_check(read_memlock(), version, caps.as_ref().ok().is_some_and(|c| c.has(CAP_SYS_RESOURCE))),
        btf_check(Path::new("/sys/kernel/btf/vmlinux")),
        uprobe_pmu_check(Path::new("/sys/bus/event_source/devices/uprobe")),
        ringbuf_check(create_ringbuf()),
    ];
    checks.extend(ebpf_checks(checks.iter().any(|c| c.name == "privileges" && c.failed())));
    let mounts = mounts.as_ref().map(Vec::as_slice).map_err(|err| format!("reading /proc/mounts: {err}"));
    let mounts = mounts.as_ref().map(|m| *m);
    checks.push(tracefs_check(mounts));
    checks.push(bpffs_check(mounts));
    checks.push(trusted_dir_check(
        "bpf_dir",
        bpf_dir,
        "restart safety: `run --bpf-dir` pins the probes and in-flight state there, and refuses a directory another user could change",
    ));
    checks.push(trusted_dir_check(
        "socket_dir",
        crate::query::socket_dir(socket),
        "`stallwatch inflight`: `run --socket` serves there, and refuses a directory where another user could put their own socket",
    ));
    Report::new(kernel, arch, checks)
}

/// A size for a detail line.
pub(super) fn bytes(limit: Option<u64>) -> String {
    match limit {
        None => "unlimited".to_owned(),
        Some(n) if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1 << 20)),
        Some(n) => format!("{} KiB", n / 1024),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_fail_only_on_required_checks() {
        let optional = tracefs_check(Ok(&[]));
        let report = Report::new("6.1.0".into(), "x86_64".into(), vec![ringbuf_check(Ok(4096)), optional.clone()]);
        assert!(report.ok);
        let mut text = Vec::new();
        report.write_human(&mut text).expect("write");
        let text = String::from_utf8(text).expect("utf-8");
        assert!(text.contains("ok      * ringbuf"), "{text}");
        assert!(text.contains("missing   tracefs"), "{text}");
        assert!(text.contains("fix: mount -t tracefs nodev /sys/kernel/tracing"), "{text}");
        assert!(text.contains("all required checks passed; not ok but not required: tracefs"), "{text}");
        let failed = Report::new(
            "6.1.0".into(),
            "x86_64".into(),
            vec![ringbuf_check(Err(io::Error::from_raw_os_error(libc::EPERM))), optional],
        );
        assert!(!failed.ok);
        assert_eq!(failed.failed_required, ["ringbuf"]);
        let json = serde_json::to_value(&failed).expect("json");
        assert_eq!(json["checks"][0]["status"], "missing");
        assert_eq!(json["checks"][0]["required"], true);
        assert_eq!(json["checks"][1]["fix"].as_str().map(|f| f.starts_with("mount -t tracefs")), Some(true));
    }
}
