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
use std::{
    fmt,
    io::{self, Write},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, anyhow};
use aya::programs::{
    UProbe,
    uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
};
use serde::Serialize;
use stallwatch_common::MAX_SLOTS;

use crate::{
    kernel::Probes,
    util::trusted_dir::{TrustedDir, Untrusted},
};

/// The kernel that has everything stallwatch's programs use: BPF ring
/// buffers (5.8), uprobe attach cookies (`bpf_get_attach_cookie` for
/// uprobes and BPF perf links, 5.15), and the BPF memory allocator (6.1)
/// that makes hash maps without preallocation (the in-flight tables) safe in
/// uprobe programs: before it the verifier warns that they are unsafe, and a
/// PREEMPT_RT kernel refuses them.
pub const MIN_KERNEL: KernelVersion = KernelVersion { major: 6, minor: 1, patch: 0 };
/// Since 5.11 BPF memory is charged to the memory cgroup, not RLIMIT_MEMLOCK.
const MEMCG_ACCOUNTING: KernelVersion = KernelVersion { major: 5, minor: 11, patch: 0 };

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
    let caps = read_caps();
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let cap_last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").ok().and_then(|s| s.trim().parse().ok());
    let mounts = std::fs::read_to_string("/proc/mounts").map(|text| parse_mounts(&text));
    let mut checks = vec![
        kernel_check(&kernel, version),
        privileges_check(euid, caps.as_ref().ok().copied(), cap_last, caps.as_ref().err()),
        ptrace_check(euid, caps.as_ref().ok().copied()),
        pid_namespace_check(std::fs::read_link("/proc/self/ns/pid").map(|link| link.display().to_string())),
        time_namespace_check(crate::export::clock::time_offsets()),
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

// --- the kernel ---------------------------------------------------------

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

fn uname() -> (String, String) {
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

fn kernel_check(release: &str, version: Option<KernelVersion>) -> Check {
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

// --- privileges ---------------------------------------------------------

pub const CAP_SYS_PTRACE: u32 = 19;
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_SYS_RESOURCE: u32 = 24;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;

/// The capabilities doctor looks at, by bit.
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
    /// The hex mask of a `Cap*:` line (`000001fffeffffff`).
    pub fn parse_hex(text: &str) -> Option<Self> {
        u64::from_str_radix(text.trim(), 16).ok().map(Caps)
    }

    /// The `CapEff:` line of a `/proc/PID/status` text.
    pub fn effective_from_status(status: &str) -> Option<Self> {
        status.lines().find_map(|line| line.strip_prefix("CapEff:")).and_then(Self::parse_hex)
    }

    pub fn has(self, cap: u32) -> bool {
        cap < 64 && self.0 & (1 << cap) != 0
    }

    /// May load BPF programs of the kprobe/uprobe type and create maps.
    pub fn can_bpf(self) -> bool {
        self.has(CAP_SYS_ADMIN) || self.has(CAP_BPF)
    }

    /// May open perf events (the uprobes) and attach tracing programs.
    pub fn can_perf(self) -> bool {
        self.has(CAP_SYS_ADMIN) || self.has(CAP_PERFMON)
    }
}

/// Refuse to start `run` without the privileges to load and attach, before
/// it creates anything: a bpf or socket directory made by an unprivileged
/// user belongs to that user, and every root agent after it refuses it.
pub fn require_privileges() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let caps = read_caps();
    let cap_last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").ok().and_then(|s| s.trim().parse().ok());
    let check = privileges_check(euid, caps.as_ref().ok().copied(), cap_last, caps.as_ref().err());
    if check.failed() {
        anyhow::bail!(
            "not enough privileges to load and attach eBPF programs ({}): {}; nothing was created. \
             `stallwatch doctor` checks the host",
            check.detail,
            check.fix.unwrap_or_default()
        );
    }
    Ok(())
}

fn read_caps() -> Result<Caps, String> {
    let status =
        std::fs::read_to_string("/proc/self/status").map_err(|err| format!("reading /proc/self/status: {err}"))?;
    Caps::effective_from_status(&status).ok_or_else(|| "no CapEff line in /proc/self/status".to_owned())
}

fn describe_caps(caps: Caps) -> String {
    let (have, lack): (Vec<_>, Vec<_>) = NAMED_CAPS.iter().partition(|(bit, _)| caps.has(*bit));
    let names = |list: Vec<&(u32, &str)>| list.iter().map(|(_, name)| *name).collect::<Vec<_>>().join(" ");
    let mut text = format!("CapEff {:016x}", caps.0);
    if !have.is_empty() {
        text.push_str(&format!(", has {}", names(have)));
    }
    if !lack.is_empty() {
        text.push_str(&format!(", lacks {}", names(lack)));
    }
    text
}

const CONTAINER_CAPS: &str = "in a container: `securityContext: {privileged: true}`, or add the capabilities BPF, PERFMON, \
                              SYS_ADMIN, SYS_PTRACE and SYS_RESOURCE and allow bpf(2) and perf_event_open(2) in its \
                              seccomp profile (agent/deploy/components/capabilities)";

pub fn privileges_check(euid: u32, caps: Option<Caps>, cap_last: Option<u32>, error: Option<&String>) -> Check {
    let check =
        Check::new("privileges", true, "loading eBPF programs (bpf(2)) and attaching uprobes (perf_event_open(2))");
    let Some(caps) = caps else {
        return check.missing(
            format!("euid {euid}; cannot read the capabilities: {}", error.map_or("unknown error", String::as_str)),
            format!("run as root with CAP_BPF and CAP_SYS_ADMIN; {CONTAINER_CAPS}"),
        );
    };
    let detail = format!("euid {euid}, {}", describe_caps(caps));
    // Kernels before 5.8 have no CAP_BPF / CAP_PERFMON (cap_last_cap < 38).
    let split_caps = cap_last.is_none_or(|last| last >= CAP_BPF);
    // Attaching a uprobe through perf_event_open(2) is refused (EACCES)
    // without CAP_SYS_ADMIN even with CAP_PERFMON: measured on 6.18
    // (tests/e2e/packaging.rs runs the agent without it). Loading needs
    // CAP_BPF (or CAP_SYS_ADMIN) besides.
    if caps.can_bpf() && caps.has(CAP_SYS_ADMIN) {
        return check.ok(detail);
    }
    let wanted = if split_caps {
        "CAP_SYS_ADMIN (attaching uprobes through perf_event_open needs it; CAP_PERFMON is not enough) and CAP_BPF"
    } else {
        "CAP_SYS_ADMIN (this kernel predates CAP_BPF and CAP_PERFMON)"
    };
    check.missing(detail, format!("run as root (`sudo stallwatch ...`) with {wanted}; {CONTAINER_CAPS}"))
}

pub fn ptrace_check(euid: u32, caps: Option<Caps>) -> Check {
    let check = Check::new(
        "ptrace",
        false,
        "watching processes of other users: reading their /proc/PID/maps and their files through /proc/PID/root",
    );
    match caps {
        Some(caps) if caps.has(CAP_SYS_PTRACE) => check.ok("CAP_SYS_PTRACE: processes of any user can be watched"),
        _ => check.missing(
            format!("no CAP_SYS_PTRACE: only processes running as uid {euid} can be watched"),
            "add CAP_SYS_PTRACE (run as root; in a container `privileged: true` or `capabilities: {add: [SYS_PTRACE]}`)",
        ),
    }
}

/// The inode of the initial (host) PID namespace (`PROC_PID_INIT_INO`).
const INIT_PID_NS: u64 = 0xEFFF_FFFC;

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
pub fn time_namespace_check(offsets: crate::export::clock::TimeOffsets) -> Check {
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

// --- memlock ------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memlock {
    /// `None`: unlimited.
    pub soft: Option<u64>,
    pub hard: Option<u64>,
}

fn read_memlock() -> io::Result<Memlock> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let value = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    Ok(Memlock { soft: value(limit.rlim_cur), hard: value(limit.rlim_max) })
}

fn bytes(limit: Option<u64>) -> String {
    match limit {
        None => "unlimited".to_owned(),
        Some(n) if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1 << 20)),
        Some(n) => format!("{} KiB", n / 1024),
    }
}

/// What stallwatch's maps take, about: the 4 MiB ring buffer plus hash maps.
const MAPS_NEED: u64 = 16 << 20;

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

// --- BTF, uprobe PMU ----------------------------------------------------

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

// --- the ring buffer ----------------------------------------------------

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_TYPE_RINGBUF: u32 = 27;

/// The first fields of `union bpf_attr` for `BPF_MAP_CREATE`; the kernel
/// takes the rest as zero.
#[repr(C)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

/// Create (and close again) a one-page BPF ring buffer.
fn create_ringbuf() -> io::Result<u32> {
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
fn probe_target(x: u64) -> u64 {
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
fn ebpf_checks(no_privileges: bool) -> [Check; 3] {
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
fn attach_to_self(probes: &mut Probes) -> Result<String> {
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

// --- filesystems --------------------------------------------------------

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

fn unescape(field: &str) -> String {
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

    #[test]
    fn capability_masks() {
        let root = Caps::parse_hex("000001fffeffffff").expect("hex");
        for cap in [CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_SYS_ADMIN] {
            assert!(root.has(cap), "bit {cap}");
        }
        assert!(!root.has(CAP_SYS_RESOURCE), "bit 24 is clear in ...fe...");
        assert!(root.has(40) && !root.has(41) && !root.has(64), "bits 0..=40 (CAP_CHECKPOINT_RESTORE is the last)");
        let status =
            "Name:\tstallwatch\nCapInh:\t0000000000000000\nCapPrm:\t000001ffffffffff\nCapEff:\t000000c000000000\n";
        let bpf_perf = Caps::effective_from_status(status).expect("CapEff");
        assert_eq!(bpf_perf, Caps((1 << CAP_BPF) | (1 << CAP_PERFMON)));
        assert!(bpf_perf.can_bpf() && bpf_perf.can_perf() && !bpf_perf.has(CAP_SYS_ADMIN));
        let admin = Caps(1 << CAP_SYS_ADMIN);
        assert!(admin.can_bpf() && admin.can_perf());
        assert!(!Caps(1 << CAP_BPF).can_perf());
        assert_eq!(Caps::effective_from_status("CapPrm:\t0\n"), None);
        assert_eq!(Caps::parse_hex("not hex"), None);
        assert_eq!(
            describe_caps(Caps(1 << CAP_BPF)),
            "CapEff 0000008000000000, has CAP_BPF, lacks CAP_PERFMON CAP_SYS_PTRACE CAP_SYS_ADMIN CAP_SYS_RESOURCE"
        );
    }

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
        let ptrace = ptrace_check(1000, Some(Caps(1 << CAP_SYS_ADMIN)));
        assert_eq!(ptrace.status, Status::Missing);
        assert!(!ptrace.failed(), "not required");
        assert!(ptrace.detail.contains("uid 1000"));
    }

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
        use crate::export::clock::TimeOffsets;
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
