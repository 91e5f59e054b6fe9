//! Whether this process may load and attach (capabilities, memlock) and watch other users' processes.
use std::io::{self};

use super::{Check, bytes, host::KernelVersion};
use crate::kernel::caps::{self, CAP_SYS_PTRACE, Caps};

/// Since 5.11 BPF memory is charged to the memory cgroup, not RLIMIT_MEMLOCK.
pub(super) const MEMCG_ACCOUNTING: KernelVersion = KernelVersion { major: 5, minor: 11, patch: 0 };

pub fn privileges_check(euid: u32, caps: Option<Caps>, cap_last: Option<u32>, error: Option<&String>) -> Check {
    let check = Check::new(
        "privileges",
        true,
        "loading eBPF programs (bpf(2)), attaching uprobes (perf_event_open(2)) and opening the libraries a process \
         mapped through /proc/PID/map_files (CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE)",
    );
    let caps = caps.ok_or_else(|| error.map_or("unknown error", String::as_str));
    match caps::attach_verdict(euid, caps, cap_last) {
        Ok(detail) => check.ok(detail),
        Err((detail, fix)) => check.missing(detail, fix),
    }
}

/// Required: the kernel lets a process read another's /proc/PID/exe,
/// maps and map_files only with ptrace read access, which without
/// CAP_SYS_PTRACE it has only to processes of its own uid that hold no
/// capability it lacks. A root agent with a few capabilities is refused
/// every root process (they hold them all): measured on 6.18 with
/// CAP_SYS_ADMIN alone, `run` fails reading the target's /proc/PID/exe
/// (tests/e2e/doctor.rs).
pub fn ptrace_check(euid: u32, caps: Option<Caps>) -> Check {
    let check = Check::new(
        "ptrace",
        true,
        "attaching to a process: reading its /proc/PID/exe, maps and map_files and its files through /proc/PID/root, \
         which the kernel allows only with ptrace read access to it",
    );
    match caps {
        Some(caps) if caps.has(CAP_SYS_PTRACE) => check.ok("CAP_SYS_PTRACE: processes of any user can be watched"),
        _ => check.missing(
            format!(
                "no CAP_SYS_PTRACE: only processes of uid {euid} holding no capability this process lacks can be \
                 watched; any other, a root process among them, is refused (`run` fails reading its /proc/PID/exe)"
            ),
            "add CAP_SYS_PTRACE (run as root; in a container `privileged: true` or `capabilities: {add: [SYS_PTRACE]}`)",
        ),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memlock {
    /// `None`: unlimited.
    pub soft: Option<u64>,
    pub hard: Option<u64>,
}

pub(super) fn read_memlock() -> io::Result<Memlock> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let value = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    Ok(Memlock { soft: value(limit.rlim_cur), hard: value(limit.rlim_max) })
}

/// What stallwatch's maps take, about: the 4 MiB ring buffer plus hash maps.
pub(super) const MAPS_NEED: u64 = 16 << 20;

pub fn memlock_check(limit: io::Result<Memlock>, kernel: Option<KernelVersion>, can_raise: bool) -> Check {
    let check = Check::new("memlock", false, "BPF map memory on kernels before 5.11 (charged to RLIMIT_MEMLOCK)");
    let limit = match limit {
        Ok(limit) => limit,
        Err(err) => {
            return check.warning(format!("getrlimit(RLIMIT_MEMLOCK): {err}"), "run `ulimit -l` to see the limit");
        }
    };
    let text = format!("RLIMIT_MEMLOCK soft {} / hard {}", bytes(limit.soft), bytes(limit.hard));
    if kernel.is_some_and(|v| v >= MEMCG_ACCOUNTING) {
        return check.ok(format!("{text}: not used, BPF memory is charged to the memory cgroup since 5.11"));
    }
    if limit.soft.is_none_or(|n| n >= MAPS_NEED) {
        return check.ok(text);
    }
    if limit.hard.is_none() || can_raise {
        return check.ok(format!("{text}: stallwatch raises it to unlimited when it starts"));
    }
    check.warning(
        format!("{text}: too low for stallwatch's maps (about {}) and it cannot raise it", bytes(Some(MAPS_NEED))),
        "`ulimit -l unlimited` before starting it, or grant CAP_SYS_RESOURCE (in a container `privileged: true`)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::doctor::Status;
    use crate::kernel::caps::{CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN};

    #[test]
    fn privileges_need_sys_admin_for_the_uprobes() {
        assert_eq!(privileges_check(0, Some(Caps(0x1ff_feff_ffff)), Some(40), None).status, Status::Ok);
        assert_eq!(
            privileges_check(0, Some(Caps((1 << CAP_BPF) | (1 << CAP_SYS_ADMIN))), Some(40), None).status,
            Status::Ok
        );
        // BPF and PERFMON load, but cannot attach a uprobe.
        let split = privileges_check(0, Some(Caps((1 << CAP_BPF) | (1 << CAP_PERFMON))), Some(40), None);
        assert!(
            split.failed() && split.fix.as_deref().is_some_and(|f| f.contains("CAP_PERFMON is not enough")),
            "{split:?}"
        );
        let none = privileges_check(65534, Some(Caps(0)), Some(40), None);
        assert!(none.failed());
        assert!(none.detail.starts_with("euid 65534"), "{}", none.detail);
        assert!(none.fix.as_deref().is_some_and(|f| f.contains("CAP_SYS_ADMIN (attaching uprobes")));
        let old = privileges_check(0, Some(Caps(1 << CAP_SYS_PTRACE)), Some(37), None);
        assert!(old.fix.as_deref().is_some_and(|f| f.contains("predates CAP_BPF")), "{old:?}");
        let unreadable = privileges_check(0, None, None, Some(&"no CapEff".to_owned()));
        assert!(unreadable.failed() && unreadable.detail.contains("no CapEff"));
        // CAP_SYS_ADMIN alone loads and attaches, but may not read a root
        // process's /proc/PID/exe: `run` needs CAP_SYS_PTRACE too.
        let ptrace = ptrace_check(0, Some(Caps(1 << CAP_SYS_ADMIN)));
        assert!(ptrace.failed(), "required: {ptrace:?}");
        assert!(ptrace.detail.contains("uid 0") && ptrace.detail.contains("a root process"), "{}", ptrace.detail);
        assert!(ptrace.fix.as_deref().is_some_and(|f| f.contains("CAP_SYS_PTRACE")), "{ptrace:?}");
        assert_eq!(ptrace_check(0, Some(Caps((1 << CAP_SYS_ADMIN) | (1 << CAP_SYS_PTRACE)))).status, Status::Ok);
    }

    #[test]
    fn memlock_matters_only_before_5_11() {
        let low = || Ok(Memlock { soft: Some(8 << 20), hard: Some(8 << 20) });
        let new = KernelVersion::parse("6.1");
        let old = KernelVersion::parse("5.4");
        let ok = memlock_check(low(), new, false);
        assert_eq!(ok.status, Status::Ok);
        assert!(
            ok.detail.contains("soft 8.0 MiB / hard 8.0 MiB") && ok.detail.contains("memory cgroup"),
            "{}",
            ok.detail
        );
        assert_eq!(memlock_check(low(), old, false).status, Status::Warning);
        assert!(memlock_check(low(), old, true).detail.contains("raises it"));
        let unlimited = memlock_check(Ok(Memlock { soft: None, hard: None }), old, false);
        assert_eq!(unlimited.status, Status::Ok);
        assert!(unlimited.detail.contains("soft unlimited"));
    }
}
