//! The real thing: a BPF ring buffer, stallwatch's own object through the verifier, its programs attached to this process and fired.
use std::{
    io::{self},
    path::PathBuf,
};

use anyhow::{Context as _, Result, anyhow};
use aya::programs::{
    UProbe,
    uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
};
use stallwatch_common::MAX_SLOTS;

use super::{Check, bytes};
use crate::kernel::Probes;
use crate::kernel::caps::CONTAINER_CAPS;

pub(super) const BPF_MAP_CREATE: libc::c_long = 0;
pub(super) const BPF_MAP_TYPE_RINGBUF: u32 = 27;

/// The first fields of `union bpf_attr` for `BPF_MAP_CREATE`; the kernel
/// takes the rest as zero.
#[repr(C)]
pub(super) struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

/// Create (and close again) a one-page BPF ring buffer.
pub(super) fn create_ringbuf() -> io::Result<u32> {
    // SAFETY: sysconf has no preconditions.
    let page = u32::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let attr =
        MapCreateAttr { map_type: BPF_MAP_TYPE_RINGBUF, key_size: 0, value_size: 0, max_entries: page, map_flags: 0 };
    // SAFETY: bpf(BPF_MAP_CREATE) reads `size` bytes of the attr we own.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_CREATE,
            &attr as *const MapCreateAttr,
            std::mem::size_of::<MapCreateAttr>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd that nothing else owns.
    unsafe { libc::close(fd as i32) };
    Ok(page)
}

pub fn ringbuf_check(result: io::Result<u32>) -> Check {
    let check = Check::new(
        "ringbuf",
        true,
        "every lifecycle event: the kernel side hands events to the agent through a BPF ring buffer",
    );
    match result {
        Ok(size) => check.ok(format!("created a {} BPF_MAP_TYPE_RINGBUF", bytes(Some(u64::from(size))))),
        Err(err) => {
            let (why, fix) = match err.raw_os_error() {
                Some(libc::EPERM | libc::EACCES) => (
                    "not permitted",
                    format!(
                        "run as root with CAP_BPF (or CAP_SYS_ADMIN); on kernels before 5.11 raise RLIMIT_MEMLOCK; {CONTAINER_CAPS}"
                    ),
                ),
                Some(libc::EINVAL) => ("this kernel has no BPF ring buffer", "run a 5.8 or newer kernel".to_owned()),
                Some(libc::ENOSYS) => (
                    "no bpf(2) system call",
                    "use a kernel with CONFIG_BPF_SYSCALL=y, and allow bpf(2) in the container's seccomp profile"
                        .to_owned(),
                ),
                _ => ("failed", "see the error; run as root on a 5.8+ kernel".to_owned()),
            };
            check.missing(format!("bpf(BPF_MAP_CREATE, RINGBUF): {why}: {err}"), fix)
        }
    }
}

// --- stallwatch's own programs ------------------------------------------

/// The function the uprobe check attaches to and calls.
#[inline(never)]
pub(super) fn probe_target(x: u64) -> u64 {
    std::hint::black_box(x).wrapping_mul(3).wrapping_add(1)
}

/// The file and file offset a code address of this process is mapped from.
pub fn file_offset_of(maps: &str, addr: u64) -> Option<(PathBuf, u64)> {
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let (start, end) = (u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?);
        if !(start..end).contains(&addr) {
            return None;
        }
        let _perms = fields.next()?;
        let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
        let _dev = fields.next()?;
        let _inode = fields.next()?;
        let path: Vec<&str> = fields.collect();
        let path = path.join(" ");
        if !path.starts_with('/') {
            return None;
        }
        // A binary replaced on disk while running: the kernel still finds
        // the running one through /proc/self/exe.
        let path = if path.ends_with(" (deleted)") { PathBuf::from("/proc/self/exe") } else { PathBuf::from(path) };
        Some((path, addr - start + offset))
    })
}

/// `ebpf_load`, `uprobe_attach` and `exec_tracepoint`, on one loaded object.
pub(super) fn ebpf_checks(no_privileges: bool) -> [Check; 3] {
    let load = Check::new(
        "ebpf_load",
        true,
        "everything: stallwatch's eBPF object, its maps and its two programs through the verifier",
    );
    let attach = Check::new(
        "uprobe_attach",
        true,
        "every probe of a profile: the programs attached as uprobes and uretprobes with a cookie",
    );
    let exec = Check::new(
        "exec_tracepoint",
        false,
        "process discovery: `run` without --pid hears of every exec through the sched_process_exec BTF tracepoint \
         (with --pid, of the target's exec)",
    );
    let hint = if no_privileges {
        "fix the privileges check first"
    } else {
        "see the error; a kernel before 5.15 lacks uprobe attach cookies"
    };
    let mut probes = match Probes::load(None) {
        Ok(probes) => probes,
        Err(err) => {
            return [
                load.missing(format!("{err:#}"), hint),
                attach.missing("not tried: the eBPF object did not load", "fix ebpf_load first"),
                exec.missing("not tried: the eBPF object did not load", "fix ebpf_load first"),
            ];
        }
    };
    let load = load.ok("stallwatch's eBPF object loaded, both programs accepted by the verifier");
    let attach = match attach_to_self(&mut probes) {
        Ok(detail) => attach.ok(detail),
        Err(err) => attach.missing(
            format!("{err:#}"),
            if no_privileges {
                "fix the privileges check first"
            } else {
                "see the error; check that perf_event_open(2) is allowed (seccomp, perf_event_paranoid without CAP_PERFMON)"
            },
        ),
    };
    // Attached here for a moment: the exec'd pids it reports are dropped
    // with the object.
    let exec = match probes.watch_execs() {
        Ok(_execs) => exec.ok("the sched_process_exec BTF tracepoint loaded and attached"),
        Err(err) => exec.missing(
            format!("{err:#}"),
            "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (see the btf check), or watch a given process with --pid",
        ),
    };
    [load, attach, exec]
}

/// Attach both programs to [`probe_target`] in this process with an
/// unconfigured slot's cookie, call it, and see the kernel count the hits.
pub(super) fn attach_to_self(probes: &mut Probes) -> Result<String> {
    let target = std::hint::black_box(probe_target as fn(u64) -> u64);
    let maps = std::fs::read_to_string("/proc/self/maps").context("reading /proc/self/maps")?;
    let (file, offset) = file_offset_of(&maps, target as usize as u64)
        .ok_or_else(|| anyhow!("cannot find this binary's code in /proc/self/maps"))?;
    let pid = std::num::NonZeroU32::new(std::process::id()).ok_or_else(|| anyhow!("pid 0"))?;
    let mut hits = Vec::new();
    for name in ["lifecycle_entry", "lifecycle_return"] {
        let before = probes.counters()?.no_slot;
        let program: &mut UProbe = probes
            .ebpf_mut()
            .program_mut(name)
            .ok_or_else(|| anyhow!("the eBPF object has no program `{name}`"))?
            .try_into()?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie: Some(u64::from(MAX_SLOTS - 1)),
        };
        program
            .attach(point, &file, UProbeScope::OneProcess(pid))
            .with_context(|| format!("attaching `{name}` to {} at {offset:#x} (this process)", file.display()))?;
        target(7);
        // Both programs count a hit on an unconfigured slot.
        let after = probes.counters()?.no_slot;
        hits.push(after.saturating_sub(before));
    }
    // The entry program alone, then both: 1 and 2 hits.
    match hits.as_slice() {
        [entry, both] if *entry >= 1 && *both >= 2 => {
            Ok(format!("uprobe and uretprobe attached to this process ({} at {offset:#x}) and fired", file.display()))
        }
        _ => Err(anyhow!(
            "attached, but the programs did not run when the function was called (hits {hits:?}, wanted [1, 2])"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ringbuf_errors_say_why() {
        let err = |code| ringbuf_check(Err(io::Error::from_raw_os_error(code)));
        assert!(err(libc::EPERM).failed());
        assert!(err(libc::EPERM).detail.contains("not permitted"));
        assert!(err(libc::EINVAL).fix.as_deref().is_some_and(|f| f.contains("5.8")));
        assert!(err(libc::ENOSYS).detail.contains("no bpf(2)"));
        assert_eq!(ringbuf_check(Ok(4096)).detail, "created a 4 KiB BPF_MAP_TYPE_RINGBUF");
    }

    #[test]
    fn code_addresses_map_to_file_offsets() {
        let maps = "5600a0000000-5600a0010000 r--p 00000000 fd:00 12 /usr/local/bin/stallwatch\n\
                    5600a0010000-5600a0200000 r-xp 00010000 fd:00 12 /usr/local/bin/stallwatch\n\
                    7f0000000000-7f0000001000 rw-p 00000000 00:00 0 \n\
                    7f1000000000-7f1000100000 r-xp 00002000 fd:00 99 /opt/my dir/stallwatch (deleted)\n";
        assert_eq!(file_offset_of(maps, 0x5600_a001_2345), Some((PathBuf::from("/usr/local/bin/stallwatch"), 0x12345)));
        assert_eq!(file_offset_of(maps, 0x7f00_0000_0010), None, "anonymous memory");
        assert_eq!(file_offset_of(maps, 0x7f10_0000_0010), Some((PathBuf::from("/proc/self/exe"), 0x2010)));
        assert_eq!(file_offset_of(maps, 0x1), None);
    }
}
