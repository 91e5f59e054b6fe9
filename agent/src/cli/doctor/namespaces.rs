//! Which PID and time namespaces the agent runs in: what a pid and a timestamp mean to it.
use std::io::{self};

use super::Check;

/// The inode of the initial (host) PID namespace (`PROC_PID_INIT_INO`).
pub(super) const INIT_PID_NS: u64 = 0xEFFF_FFFC;

/// `pid:[4026531836]` -> 4026531836.
pub fn parse_ns_link(link: &str) -> Option<u64> {
    link.trim().strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

pub fn pid_namespace_check(link: io::Result<String>) -> Check {
    let check = Check::new(
        "pid_namespace",
        false,
        "seeing the node's processes: pids given to `run` are read in this PID namespace",
    );
    match link.as_deref().map(parse_ns_link) {
        Ok(Some(INIT_PID_NS)) => check.ok("the host's PID namespace: every process of the node is visible"),
        Ok(Some(inode)) => check.warning(
            format!("a nested PID namespace (pid:[{inode}]): only processes of this container are visible"),
            "in Kubernetes set `hostPID: true` (agent/deploy/base/daemonset.yaml does); with docker, `--pid=host`",
        ),
        Ok(None) => check.warning(
            format!("unexpected /proc/self/ns/pid link {:?}", link.as_deref().unwrap_or_default()),
            "check that /proc is the host's procfs",
        ),
        Err(err) => check.warning(format!("reading /proc/self/ns/pid: {err}"), "check that /proc is mounted"),
    }
}

/// A time namespace shifts the agent's clocks, not the kernel's
/// timestamps: the agent reads its offsets and takes them back out, and
/// says so, since every time it prints depends on it.
pub fn time_namespace_check(offsets: crate::util::clock::TimeOffsets) -> Check {
    let check = Check::new(
        "time_namespace",
        false,
        "judging silence: the kernel stamps events on the host's CLOCK_MONOTONIC, which the agent compares with its own",
    );
    if offsets.is_zero() {
        return check.ok("the host's clocks (no time-namespace offset)");
    }
    let secs = |ns: i64| format!("{:+.3}s", ns as f64 / 1e9);
    check.ok(format!(
        "a time namespace whose CLOCK_MONOTONIC is offset {} (CLOCK_BOOTTIME {}) from the host's, read from \
         /proc/self/timens_offsets: the agent takes the offset out of every clock it reads, so stalls and the times \
         printed follow the kernel's timestamps",
        secs(offsets.monotonic_ns),
        secs(offsets.boottime_ns)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::doctor::Status;

    #[test]
    fn pid_namespaces() {
        assert_eq!(parse_ns_link("pid:[4026531836]"), Some(INIT_PID_NS));
        assert_eq!(parse_ns_link("pid:[4026532201]"), Some(4_026_532_201));
        assert_eq!(parse_ns_link("net:[1]"), None);
        assert_eq!(pid_namespace_check(Ok("pid:[4026531836]".into())).status, Status::Ok);
        let nested = pid_namespace_check(Ok("pid:[4026532201]".into()));
        assert_eq!(nested.status, Status::Warning);
        assert!(nested.fix.as_deref().is_some_and(|f| f.contains("hostPID: true")));
    }

    #[test]
    fn a_time_namespace_offset_is_said_with_its_sign() {
        use crate::util::clock::TimeOffsets;
        let host = time_namespace_check(TimeOffsets::default());
        assert_eq!(host.status, Status::Ok);
        assert!(host.detail.contains("no time-namespace offset"), "{}", host.detail);
        let behind = time_namespace_check(TimeOffsets { monotonic_ns: -300_000_000_000, boottime_ns: 0 });
        assert_eq!(behind.status, Status::Ok);
        assert!(
            behind.detail.contains("offset -300.000s") && behind.detail.contains("takes the offset out"),
            "{}",
            behind.detail
        );
    }
}
