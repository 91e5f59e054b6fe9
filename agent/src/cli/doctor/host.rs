//! The kernel's version, BTF and the uprobe PMU: what the programs need of the host.
use std::{fmt, io, path::Path};

use anyhow::Result;
use serde::Serialize;

use super::{Check, bytes};

/// The kernel that has everything stallwatch's programs use: BPF ring
/// buffers (5.8), uprobe attach cookies (`bpf_get_attach_cookie` for
/// uprobes and BPF perf links, 5.15), and the BPF memory allocator (6.1)
/// that makes hash maps without preallocation (the in-flight tables) safe in
/// uprobe programs: before it the verifier warns that they are unsafe, and a
/// PREEMPT_RT kernel refuses them.
pub const MIN_KERNEL: KernelVersion = KernelVersion { major: 6, minor: 1, patch: 0 };

/// `major.minor.patch` of a kernel release string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct KernelVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl KernelVersion {
    /// `6.18.44-fc-v1045`, `5.15.0-91-generic`, `4.18.0-513.el8.x86_64`,
    /// `6.1`: the leading numbers; `None` without at least major.minor.
    pub fn parse(release: &str) -> Option<Self> {
        let numeric = release.trim().split(|c: char| !(c.is_ascii_digit() || c == '.')).next()?;
        let mut parts = numeric.split('.').filter(|part| !part.is_empty()).map(str::parse::<u32>);
        let major = parts.next()?.ok()?;
        let minor = parts.next()?.ok()?;
        let patch = parts.next().and_then(Result::ok).unwrap_or(0);
        Some(Self { major, minor, patch })
    }
}

impl fmt::Display for KernelVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.patch == 0 {
            write!(f, "{}.{}", self.major, self.minor)
        } else {
            write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
        }
    }
}

pub(super) fn uname() -> (String, String) {
    // SAFETY: utsname is plain bytes; uname fills it.
    let mut name: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: uname writes into the struct we own.
    if unsafe { libc::uname(&mut name) } != 0 {
        return ("unknown".to_owned(), "unknown".to_owned());
    }
    let text = |field: &[libc::c_char]| {
        let bytes: Vec<u8> = field.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    (text(&name.release), text(&name.machine))
}

pub(super) fn kernel_check(release: &str, version: Option<KernelVersion>) -> Check {
    let check = Check::new(
        "kernel",
        false,
        "BPF ring buffers (5.8), uprobe attach cookies (5.15), non-preallocated hash maps safe in uprobe programs (6.1); the ringbuf, ebpf_load and uprobe_attach checks are the real test",
    );
    match version {
        Some(v) if v >= MIN_KERNEL => check.ok(format!(
            "Linux {release}: {MIN_KERNEL}+ has BPF ring buffers, uprobe attach cookies and the BPF memory allocator"
        )),
        Some(v) => check.warning(
            format!(
                "Linux {v} is older than {MIN_KERNEL}: BPF ring buffers need 5.8, uprobe attach cookies 5.15, and the \
                 in-flight tables (hash maps without preallocation) are unsafe in uprobe programs before 6.1 (the \
                 verifier warns; a PREEMPT_RT kernel refuses them; a distribution kernel may have backports: see \
                 the checks below)"
            ),
            format!("run a {MIN_KERNEL} or newer kernel"),
        ),
        None => check.warning(
            format!("cannot read a version from the kernel release {release:?}"),
            "trust the ringbuf, ebpf_load and uprobe_attach checks below",
        ),
    }
}

pub fn btf_check(path: &Path) -> Check {
    let check = Check::new(
        "btf",
        false,
        "process discovery (`run` without --pid loads the sched_process_exec BTF tracepoint); the uprobe programs \
         read only user memory, so watching a given --pid works without it (but misses an exec of the target)",
    );
    match std::fs::read(path) {
        Ok(data) if data.get(..2) == Some(&[0x9f, 0xeb]) => {
            check.ok(format!("{} ({})", path.display(), bytes(Some(data.len() as u64))))
        }
        Ok(_) => check.warning(
            format!("{} is not BTF (bad magic)", path.display()),
            "check the kernel's CONFIG_DEBUG_INFO_BTF build",
        ),
        Err(err) if err.kind() == io::ErrorKind::NotFound => check.missing(
            format!("no {}: the kernel was built without CONFIG_DEBUG_INFO_BTF", path.display()),
            "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (most distribution kernels since 2020)",
        ),
        Err(err) => check.warning(format!("reading {}: {err}", path.display()), "run as root"),
    }
}

pub fn uprobe_pmu_check(dir: &Path) -> Check {
    let check = Check::new("uprobe_pmu", true, "attaching uprobes and uretprobes through perf_event_open(2)");
    let fix = "use a kernel built with CONFIG_UPROBE_EVENTS=y (4.17+ for the uprobe PMU); in a container, \
               the host's /sys must be visible (privileged containers see it)";
    let type_path = dir.join("type");
    let pmu = match std::fs::read_to_string(&type_path) {
        Ok(text) => match text.trim().parse::<u32>() {
            Ok(pmu) => pmu,
            Err(_) => {
                return check.missing(format!("{} says {:?}, not a PMU type", type_path.display(), text.trim()), fix);
            }
        },
        Err(err) => return check.missing(format!("no uprobe PMU: {}: {err}", type_path.display()), fix),
    };
    let retprobe_path = dir.join("format/retprobe");
    match std::fs::read_to_string(&retprobe_path) {
        Ok(format) => check.ok(format!("uprobe PMU type {pmu}, uretprobes via {}", format.trim())),
        Err(err) => check
            .missing(format!("uprobe PMU type {pmu} but no uretprobe bit: {}: {err}", retprobe_path.display()), fix),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::doctor::Status;

    #[test]
    fn kernel_versions() {
        let v = |s| KernelVersion::parse(s);
        let k = |major, minor, patch| Some(KernelVersion { major, minor, patch });
        assert_eq!(v("6.18.44-fc-v1045"), k(6, 18, 44));
        assert_eq!(v("5.15.0-91-generic"), k(5, 15, 0));
        assert_eq!(v("4.18.0-513.el8.x86_64"), k(4, 18, 0));
        assert_eq!(v("6.1"), k(6, 1, 0));
        assert_eq!(v("6.8.0+"), k(6, 8, 0));
        assert_eq!(v("5.10.0-rc3"), k(5, 10, 0));
        assert_eq!(v(" 6.2.1\n"), k(6, 2, 1));
        assert_eq!(v("6"), None);
        assert_eq!(v("linux"), None);
        assert_eq!(v(""), None);
        assert!(v("5.15.0").expect("parses") < MIN_KERNEL);
        assert!(v("6.0.19").expect("parses") < MIN_KERNEL);
        assert!(v("6.1.0").expect("parses") >= MIN_KERNEL);
        assert!(v("10.0").expect("parses") > MIN_KERNEL);
    }

    #[test]
    fn kernel_check_warns_below_the_minimum() {
        assert_eq!(kernel_check("6.18.44", KernelVersion::parse("6.18.44")).status, Status::Ok);
        let old = kernel_check("5.4.0", KernelVersion::parse("5.4.0"));
        assert_eq!(old.status, Status::Warning);
        assert!(old.detail.contains("Linux 5.4 is older than 6.1"), "{}", old.detail);
        let no_allocator = kernel_check("5.15.0", KernelVersion::parse("5.15.0"));
        assert_eq!(no_allocator.status, Status::Warning);
        assert!(no_allocator.detail.contains("unsafe in uprobe programs before 6.1"), "{}", no_allocator.detail);
        assert_eq!(kernel_check("weird", None).status, Status::Warning);
    }
}
