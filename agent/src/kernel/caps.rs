//! The capabilities loading and attaching need, read from this process:
//! `run` refuses to start without them ([`require_privileges`]), `doctor`
//! says which are missing, and a refused attach says which one it was.
//!
//! Attaching a uprobe through perf_event_open(2) is refused (EACCES)
//! without CAP_SYS_ADMIN even with CAP_PERFMON: measured on 6.18
//! (tests/e2e/packaging.rs runs the agent without it). Loading needs
//! CAP_BPF (or CAP_SYS_ADMIN) besides.

pub const CAP_SYS_PTRACE: u32 = 19;
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_SYS_RESOURCE: u32 = 24;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;

/// The capabilities an agent uses, by bit (named in privilege errors).
const NAMED_CAPS: [(u32, &str); 5] = [
    (CAP_BPF, "CAP_BPF"),
    (CAP_PERFMON, "CAP_PERFMON"),
    (CAP_SYS_PTRACE, "CAP_SYS_PTRACE"),
    (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
    (CAP_SYS_RESOURCE, "CAP_SYS_RESOURCE"),
];

/// A capability set, as in the `CapEff:` line of `/proc/PID/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps(pub u64);

impl Caps {
    pub fn has(self, cap: u32) -> bool {
        cap < 64 && self.0 & (1 << cap) != 0
    }

    /// May load BPF programs of the kprobe/uprobe type and create maps.
    pub fn can_bpf(self) -> bool {
        self.has(CAP_SYS_ADMIN) || self.has(CAP_BPF)
    }

    /// This process's effective capabilities (`CapEff:` of
    /// `/proc/self/status`, read by procfs).
    pub fn of_self() -> Result<Self, String> {
        let status = procfs::process::Process::myself().and_then(|me| me.status());
        status.map(|status| Caps(status.capeff)).map_err(|err| format!("reading /proc/self/status: {err}"))
    }

    /// The mask, and the named capabilities it has and lacks.
    pub fn describe(self) -> String {
        let (have, lack): (Vec<_>, Vec<_>) = NAMED_CAPS.iter().partition(|(bit, _)| self.has(*bit));
        let names = |list: Vec<&(u32, &str)>| list.iter().map(|(_, name)| *name).collect::<Vec<_>>().join(" ");
        let mut text = format!("CapEff {:016x}", self.0);
        if !have.is_empty() {
            text.push_str(&format!(", has {}", names(have)));
        }
        if !lack.is_empty() {
            text.push_str(&format!(", lacks {}", names(lack)));
        }
        text
    }

    /// May open perf events (the uprobes) and attach tracing programs.
    pub fn can_perf(self) -> bool {
        self.has(CAP_SYS_ADMIN) || self.has(CAP_PERFMON)
    }
}

/// How to grant them in a container (the fix every privilege error ends with).
pub const CONTAINER_CAPS: &str = "in a container: `securityContext: {privileged: true}`, or add the capabilities BPF, \
                                  PERFMON, SYS_ADMIN, SYS_PTRACE and SYS_RESOURCE and allow bpf(2) and \
                                  perf_event_open(2) in its seccomp profile (agent/deploy/components/capabilities)";

/// Whether `euid` with `caps` (`Err`: why they could not be read) may load
/// and attach: `Ok(detail)`, or `Err((detail, fix))`. `cap_last`: the
/// kernel's `cap_last_cap` (before 5.8 there is no CAP_BPF / CAP_PERFMON).
pub fn attach_verdict(euid: u32, caps: Result<Caps, &str>, cap_last: Option<u32>) -> Result<String, (String, String)> {
    let caps = caps.map_err(|error| {
        (
            format!("euid {euid}; cannot read the capabilities: {error}"),
            format!("run as root with CAP_BPF and CAP_SYS_ADMIN; {CONTAINER_CAPS}"),
        )
    })?;
    let detail = format!("euid {euid}, {}", caps.describe());
    if caps.can_bpf() && caps.has(CAP_SYS_ADMIN) {
        return Ok(detail);
    }
    let wanted = if cap_last.is_none_or(|last| last >= CAP_BPF) {
        "CAP_SYS_ADMIN (attaching uprobes through perf_event_open needs it; CAP_PERFMON is not enough) and CAP_BPF"
    } else {
        "CAP_SYS_ADMIN (this kernel predates CAP_BPF and CAP_PERFMON)"
    };
    Err((detail, format!("run as root (`sudo stallwatch ...`) with {wanted}; {CONTAINER_CAPS}")))
}

/// The kernel's highest capability number.
pub fn cap_last() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").ok().and_then(|s| s.trim().parse().ok())
}

/// The effective user id of this process.
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Refuse to start `run` without the privileges to load and attach, before
/// it creates anything: a bpf or socket directory made by an unprivileged
/// user belongs to that user, and every root agent after it refuses it.
pub fn require_privileges() -> anyhow::Result<()> {
    let caps = Caps::of_self();
    if let Err((detail, fix)) = attach_verdict(euid(), caps.as_ref().copied().map_err(String::as_str), cap_last()) {
        anyhow::bail!(
            "not enough privileges to load and attach eBPF programs ({detail}): {fix}; nothing was created. \
             `stallwatch doctor` checks the host"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_masks() {
        let root = Caps(0x0000_01ff_feff_ffff);
        for cap in [CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_SYS_ADMIN] {
            assert!(root.has(cap), "bit {cap}");
        }
        assert!(!root.has(CAP_SYS_RESOURCE), "bit 24 is clear in ...fe...");
        assert!(root.has(40) && !root.has(41) && !root.has(64), "bits 0..=40 (CAP_CHECKPOINT_RESTORE is the last)");
        let bpf_perf = Caps((1 << CAP_BPF) | (1 << CAP_PERFMON));
        assert!(bpf_perf.can_bpf() && bpf_perf.can_perf() && !bpf_perf.has(CAP_SYS_ADMIN));
        let admin = Caps(1 << CAP_SYS_ADMIN);
        assert!(admin.can_bpf() && admin.can_perf());
        assert!(!Caps(1 << CAP_BPF).can_perf());
        assert_eq!(
            Caps(1 << CAP_BPF).describe(),
            "CapEff 0000008000000000, has CAP_BPF, lacks CAP_PERFMON CAP_SYS_PTRACE CAP_SYS_ADMIN CAP_SYS_RESOURCE"
        );
    }

    #[test]
    fn this_process_capabilities_are_the_cap_eff_line_of_its_status() {
        let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
        let line = status.lines().find_map(|line| line.strip_prefix("CapEff:")).expect("a CapEff line");
        let mask = u64::from_str_radix(line.trim(), 16).expect("a hex mask");
        assert_eq!(Caps::of_self(), Ok(Caps(mask)));
    }
}
