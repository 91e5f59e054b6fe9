//! tracefs, bpffs and the directories `run` would use: mounted, and safe from other users.
use std::path::Path;

use anyhow::Result;

use super::Check;
use crate::util::trusted_dir::{TrustedDir, Untrusted};

/// One line of `/proc/mounts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub source: String,
    pub target: String,
    pub fstype: String,
}

/// `/proc/mounts`, with the `\040`-style escapes of paths undone.
pub fn parse_mounts(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let source = unescape(fields.next()?);
            let target = unescape(fields.next()?);
            let fstype = fields.next()?.to_owned();
            Some(Mount { source, target, fstype })
        })
        .collect()
}

pub(super) fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = if bytes[i] == b'\\' {
            field.get(i + 1..i + 4).and_then(|oct| u8::from_str_radix(oct, 8).ok())
        } else {
            None
        };
        if let Some(code) = escaped {
            out.push(code);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where tracefs is looked for, in aya's order.
pub const TRACEFS_PATHS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

pub fn tracefs_check(mounts: Result<&[Mount], &String>) -> Check {
    let check = Check::new(
        "tracefs",
        false,
        "not needed to attach on a kernel with the uprobe PMU; needed for the legacy uprobe_events attach path \
         (kernels without the uprobe PMU), classic (non-BTF) tracepoint programs, and reading eBPF debug output \
         from trace_pipe",
    );
    let mounts = match mounts {
        Ok(mounts) => mounts,
        Err(err) => return check.warning(err.clone(), "check that /proc is mounted"),
    };
    match mounts.iter().find(|m| m.fstype == "tracefs" && TRACEFS_PATHS.contains(&m.target.as_str())) {
        Some(mount) => check.ok(format!("mounted at {}", mount.target)),
        None => check.missing(
            format!("no tracefs mounted at {} or {}", TRACEFS_PATHS[0], TRACEFS_PATHS[1]),
            "mount -t tracefs nodev /sys/kernel/tracing (in Kubernetes, a hostPath volume of the host's \
             /sys/kernel/tracing, as agent/deploy/base/daemonset.yaml has)",
        ),
    }
}

pub const BPFFS_PATH: &str = "/sys/fs/bpf";

pub fn bpffs_check(mounts: Result<&[Mount], &String>) -> Check {
    let check = Check::new(
        "bpffs",
        false,
        "restart safety: probes and in-flight state pinned under `run --bpf-dir` outlive the agent (`run` mounts \
         bpffs at /sys/fs/bpf itself when it can; --ephemeral needs none)",
    );
    let mounts = match mounts {
        Ok(mounts) => mounts,
        Err(err) => return check.warning(err.clone(), "check that /proc is mounted"),
    };
    if mounts.iter().any(|m| m.fstype == "bpf" && m.target == BPFFS_PATH) {
        check.ok(format!("mounted at {BPFFS_PATH}"))
    } else {
        check.missing(
            format!("no bpf filesystem mounted at {BPFFS_PATH}"),
            "mount -t bpf bpf /sys/fs/bpf (in Kubernetes, a hostPath volume of the host's /sys/fs/bpf)",
        )
    }
}

/// Whether `run` would accept `dir` ([`TrustedDir`]'s rules); one it
/// would create is fine. Not required: `run` may be given another path.
pub fn trusted_dir_check(name: &'static str, dir: &Path, needed_for: &'static str) -> Check {
    let check = Check::new(name, false, needed_for);
    let shown = dir.display();
    match TrustedDir::open(dir) {
        Ok(Some(_)) => check.ok(format!("{shown}: root's, writable by nobody else, no symlink on the way")),
        Ok(None) => check.ok(format!("{shown}: missing; `run` creates it (mode 0700), nothing on the way is unsafe")),
        Err(err) => match err.downcast_ref::<Untrusted>() {
            // The reason names the offending directory; `dir` too if another.
            Some(untrusted) if untrusted.path == dir => check.missing(untrusted.reason.clone(), untrusted.fix.clone()),
            Some(untrusted) => check.missing(format!("{shown}: {}", untrusted.reason), untrusted.fix.clone()),
            None => check.missing(format!("{shown}: {err:#}"), "give `run` a directory it can create or open"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::doctor::Status;

    #[test]
    fn mounts_and_the_filesystem_checks() {
        let text = "proc /proc proc rw 0 0\n\
                    nodev /sys/kernel/tracing tracefs rw 0 0\n\
                    bpf /sys/fs/bpf bpf rw 0 0\n\
                    /dev/sda1 /mnt/with\\040space ext4 rw 0 0\n";
        let mounts = parse_mounts(text);
        assert_eq!(mounts.len(), 4);
        assert_eq!(mounts[3].target, "/mnt/with space");
        assert_eq!(tracefs_check(Ok(&mounts)).status, Status::Ok);
        assert_eq!(bpffs_check(Ok(&mounts)).status, Status::Ok);
        let debug = parse_mounts("tracefs /sys/kernel/debug/tracing tracefs rw 0 0\n");
        assert_eq!(tracefs_check(Ok(&debug)).detail, "mounted at /sys/kernel/debug/tracing");
        let bare = parse_mounts("proc /proc proc rw 0 0\n/dev/vda / ext4 rw 0 0\n");
        let tracefs = tracefs_check(Ok(&bare));
        assert_eq!(tracefs.status, Status::Missing);
        assert!(!tracefs.failed(), "tracefs is not required");
        assert!(tracefs.fix.as_deref().is_some_and(|f| f.starts_with("mount -t tracefs nodev /sys/kernel/tracing")));
        assert!(bpffs_check(Ok(&bare)).fix.as_deref().is_some_and(|f| f.starts_with("mount -t bpf bpf /sys/fs/bpf")));
        // A tracefs elsewhere is not where aya looks.
        assert_eq!(tracefs_check(Ok(&parse_mounts("nodev /mnt/t tracefs rw 0 0\n"))).status, Status::Missing);
    }

    #[test]
    fn a_directory_run_would_refuse_is_missing_with_the_reason_and_the_fix() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("temp dir");
        let check = trusted_dir_check("bpf_dir", dir.path(), "x");
        assert_eq!((check.status, check.required), (Status::Ok, false), "{check:?}");
        let missing = trusted_dir_check("bpf_dir", &dir.path().join("new"), "x");
        assert_eq!(missing.status, Status::Ok, "{missing:?}");
        assert!(missing.detail.contains("`run` creates it (mode 0700)"), "{missing:?}");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let shared = trusted_dir_check("bpf_dir", &dir.path().join("new"), "x");
        assert_eq!(shared.status, Status::Missing, "{shared:?}");
        assert!(
            shared.detail.contains("(mode 0777) is writable by its group or by anyone, and not sticky"),
            "{shared:?}"
        );
        assert!(shared.fix.as_deref().is_some_and(|f| f.contains("chmod go-w")), "{shared:?}");
        assert!(!shared.failed(), "not required");
    }
}
