//! One uprobe linked to an already loaded program from any thread.
//!
//! aya links a uprobe through `&mut UProbe`, which lives in the [`aya::Ebpf`]
//! the event loop owns, so a link made through it is made on the loop. And a
//! link can take the kernel seconds: registering a uprobe takes a write lock
//! whose entry waits for an RCU grace period (`uprobe_register` ->
//! `register_for_each_vma` -> `rcu_sync_enter` -> `synchronize_rcu`, in the
//! calling thread's kernel stack all the while). Measured on the SGLang
//! test target's prefill mid-transfer, on the shared 2-core host: 5 ms to
//! 1.3 s per link, median 8-24 ms (an alert 1.3 s late in CI was judged
//! 2.1 s after its gate opened: the link held the loop). The gated probes
//! (progress, posts) are linked exactly then (a request nears its stall), so they are linked
//! here, off the loop, from a duplicate of the program's fd: the two calls
//! aya makes (`perf_event_open` of the `uprobe` PMU, then `BPF_LINK_CREATE`
//! of a perf-event link with the slot's cookie), and nothing else. The link
//! holds the perf event; dropping it (closing its fd) detaches the probe,
//! which waits for grace periods too (up to 8.6 s measured there): drop it
//! off the loop as well.
use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    os::{
        fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow};
use aya::programs::ProgramFd;

/// Where the kernel says which perf type number its uprobe PMU has.
const UPROBE_PMU_TYPE: &str = "/sys/bus/event_source/devices/uprobe/type";

/// `PERF_FLAG_FD_CLOEXEC` (include/uapi/linux/perf_event.h).
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
/// `PERF_ATTR_SIZE_VER1`: the attr up to `config2`, all a uprobe needs.
const PERF_ATTR_SIZE_VER1: u32 = 72;
/// `BPF_LINK_CREATE` (include/uapi/linux/bpf.h, `enum bpf_cmd`).
const BPF_LINK_CREATE: libc::c_long = 28;
/// `BPF_PERF_EVENT` (`enum bpf_attach_type`).
const BPF_PERF_EVENT: u32 = 41;

/// `struct perf_event_attr` up to `config2` (the `VER1` layout), as the
/// `uprobe` PMU reads it: `config1` is the file's path, `config2` the
/// offset in it, `config` 0 for an entry probe.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
    config2: u64,
}

/// `union bpf_attr` as `BPF_LINK_CREATE` reads it for a perf event, padded
/// with zeros (the kernel requires every byte it does not read to be 0).
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    bpf_cookie: u64,
    _zero: [u64; 6],
}

/// A uprobe linked to a program; dropping it detaches the probe.
#[derive(Debug)]
pub struct UprobeLink {
    /// The link's fd: held, never read; closing it detaches.
    _fd: OwnedFd,
}

/// The gated probes (progress, posts) of one process to link, handed off the event loop
/// by [`super::Probes::begin_opening`]; [`Self::link`] links them there,
/// and [`super::Probes::end_opening`] takes the result back on the loop.
pub struct Opening {
    id: u64,
    pid: u32,
    /// The entry program (a duplicate of its fd: the loop keeps its own).
    program: ProgramFd,
    /// Each probe's slot (its cookie), file and offset in it.
    points: Vec<(u32, PathBuf, u64)>,
}

/// What [`Opening::link`] made.
pub struct Linked {
    id: u64,
    pid: u32,
    took: Duration,
    links: Result<Vec<(u32, UprobeLink)>>,
}

impl Opening {
    pub(super) fn new(id: u64, pid: u32, program: ProgramFd, points: Vec<(u32, PathBuf, u64)>) -> Self {
        Self { id, pid, program, points }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Link every probe, all or nothing (on an error those linked go
    /// again, detached here). Blocks for as long as the kernel takes:
    /// call it off the event loop.
    pub fn link(self) -> Linked {
        let start = Instant::now();
        let links = uprobe_pmu().and_then(|pmu| {
            self.points
                .iter()
                .map(|(index, path, offset)| {
                    link_entry(self.program.as_fd(), pmu, path, *offset, self.pid, u64::from(*index))
                        .map(|link| (*index, link))
                })
                .collect()
        });
        Linked { id: self.id, pid: self.pid, took: start.elapsed(), links }
    }
}

impl Linked {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// How long the kernel took to link them (or to fail).
    pub fn took(&self) -> Duration {
        self.took
    }

    /// Nothing linked, of an opening of `pid`.
    #[cfg(test)]
    pub(crate) fn for_test(pid: u32) -> Self {
        Self { id: 0, pid, took: Duration::ZERO, links: Ok(Vec::new()) }
    }

    pub(super) fn into_parts(self) -> (u64, Result<Vec<(u32, UprobeLink)>>) {
        (self.id, self.links)
    }
}

/// An [`Opening`] under way.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct InFlight {
    pub pid: u32,
    /// Its probes' slots.
    pub indices: Vec<u32>,
    /// The process was detached meanwhile: its links go as they come back,
    /// and only then are these slots free (a link of theirs would count its
    /// hits on a successor's slot).
    pub orphaned: bool,
}

/// The openings under way, by id, and the slots they hold.
#[derive(Debug, Default)]
pub(super) struct Openings {
    flights: HashMap<u64, InFlight>,
    next: u64,
}

impl Openings {
    /// Whether an opening of `pid` (its current process) is under way.
    pub fn under_way(&self, pid: u32) -> bool {
        self.flights.values().any(|flight| flight.pid == pid && !flight.orphaned)
    }

    /// A new opening of `pid`'s probes at these slots: its id.
    pub fn begin(&mut self, pid: u32, indices: Vec<u32>) -> u64 {
        let id = self.next;
        self.next += 1;
        self.flights.insert(id, InFlight { pid, indices, orphaned: false });
        id
    }

    /// The opening `id` is back.
    pub fn end(&mut self, id: u64) -> Option<InFlight> {
        self.flights.remove(&id)
    }

    /// `pid` is detached: its openings' links go as they come back; the
    /// slots they hold, not free until then.
    pub fn orphan(&mut self, pid: u32) -> HashSet<u32> {
        let mut held = HashSet::new();
        for flight in self.flights.values_mut().filter(|flight| flight.pid == pid) {
            flight.orphaned = true;
            held.extend(flight.indices.iter().copied());
        }
        held
    }
}

/// The kernel's perf type number for uprobes.
pub fn uprobe_pmu() -> Result<u32> {
    let text = std::fs::read_to_string(UPROBE_PMU_TYPE)
        .with_context(|| format!("reading {UPROBE_PMU_TYPE} (a kernel with CONFIG_UPROBE_EVENTS has it)"))?;
    text.trim().parse().with_context(|| format!("{UPROBE_PMU_TYPE} holds {text:?}, not a perf type number"))
}

/// A uprobe perf event at `file_offset` in `host_path` (its return when
/// `at_return`), for thread or process `pid` alone: what a program is
/// linked to, and, read as a `u64`, the count of its hits (the `room`
/// bench counts traps per thread so, with no program at all).
pub fn uprobe_event(pmu: u32, host_path: &Path, file_offset: u64, at_return: bool, pid: u32) -> Result<OwnedFd> {
    let path = CString::new(host_path.as_os_str().as_bytes())
        .map_err(|_| anyhow!("{} has a NUL byte in its path", host_path.display()))?;
    let attr = PerfEventAttr {
        kind: pmu,
        size: PERF_ATTR_SIZE_VER1,
        // The PMU's `retprobe` format bit: config:0.
        config: u64::from(at_return),
        config1: path.as_ptr() as u64,
        config2: file_offset,
        ..PerfEventAttr::default()
    };
    let pid = libc::pid_t::try_from(pid).with_context(|| format!("pid {pid} is out of range"))?;
    // SAFETY: perf_event_open reads `attr` (`size` bytes, all ours) and
    // the NUL-terminated path it points to, both alive for the call; it
    // returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_perf_event_open, &raw const attr, pid, -1, -1, PERF_FLAG_FD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| {
            format!("perf_event_open of a uprobe at {file_offset:#x} in {} for pid {pid}", host_path.display())
        });
    }
    // SAFETY: a fresh fd nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Link `program` (an entry program) at `file_offset` in `host_path`, for
/// `pid` alone, its hits carrying `cookie`.
pub fn link_entry(
    program: BorrowedFd<'_>,
    pmu: u32,
    host_path: &Path,
    file_offset: u64,
    pid: u32,
    cookie: u64,
) -> Result<UprobeLink> {
    let perf = uprobe_event(pmu, host_path, file_offset, false, pid)?;
    let attr = LinkCreateAttr {
        prog_fd: program.as_raw_fd() as u32,
        target_fd: perf.as_raw_fd() as u32,
        attach_type: BPF_PERF_EVENT,
        bpf_cookie: cookie,
        ..LinkCreateAttr::default()
    };
    // SAFETY: bpf reads `size_of_val(&attr)` bytes of `attr`, alive for the
    // call, and returns a new fd or -1.
    let fd =
        unsafe { libc::syscall(libc::SYS_bpf, BPF_LINK_CREATE, &raw const attr, size_of_val(&attr) as libc::c_uint) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| {
            format!("linking the program to the uprobe at {file_offset:#x} in {} for pid {pid}", host_path.display())
        });
    }
    // The link holds the perf event from here on: its own fd can go.
    drop(perf);
    // SAFETY: a fresh fd nothing else owns.
    Ok(UprobeLink { _fd: unsafe { OwnedFd::from_raw_fd(fd as i32) } })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attrs_have_the_kernel_layouts() {
        // PERF_ATTR_SIZE_VER1, and bpf_attr's link_create: prog_fd,
        // target_fd, attach_type, flags, then the perf_event union member.
        assert_eq!(size_of::<PerfEventAttr>(), PERF_ATTR_SIZE_VER1 as usize);
        assert_eq!(std::mem::offset_of!(PerfEventAttr, config1), 56);
        assert_eq!(std::mem::offset_of!(PerfEventAttr, config2), 64);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, bpf_cookie), 16);
    }

    #[test]
    fn a_process_detached_mid_opening_holds_its_slots_until_the_links_are_back() {
        let mut openings = Openings::default();
        let first = openings.begin(7, vec![3, 4]);
        assert!(openings.under_way(7) && !openings.under_way(8));
        // Detached (it exited, or exec'd): a new process of the same pid
        // (the exec'd program, watched again) may open its own gate.
        assert_eq!(openings.orphan(7), HashSet::from([3, 4]));
        assert!(!openings.under_way(7));
        let second = openings.begin(7, vec![9]);
        assert!(openings.under_way(7));
        assert_eq!(openings.end(first), Some(InFlight { pid: 7, indices: vec![3, 4], orphaned: true }));
        assert_eq!(openings.end(second), Some(InFlight { pid: 7, indices: vec![9], orphaned: false }));
        assert_eq!(openings.end(second), None, "once");
        assert!(!openings.under_way(7) && openings.orphan(7).is_empty());
    }

    #[test]
    fn a_path_with_a_nul_byte_is_refused_by_name() {
        let devnull = std::fs::File::open("/dev/null").expect("/dev/null");
        let err = link_entry(std::os::fd::AsFd::as_fd(&devnull), 0, Path::new("/lib/x\0y.so"), 0, 1, 0)
            .expect_err("a NUL byte");
        assert!(format!("{err:#}").contains("NUL byte"), "{err:#}");
    }
}
