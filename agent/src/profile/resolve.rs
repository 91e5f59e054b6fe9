//! Finding a probe's target in a live process: which mapped file a profile's
//! `object` names (through `/proc/PID/maps`), where the symbol sits in that
//! file, and what its first instruction costs to probe.
//!
//! The files are the watched process's, and so is what their paths name
//! once they are mapped: a tenant can grow a mapped library in place to
//! gigabytes, replace it with a symlink to `/dev/zero` or with a FIFO
//! nobody writes, or delete it (as a package upgrade does). So a mapped
//! file is reached as the inode the process maps,
//! `/proc/PID/map_files/START-END`, never by its path; whatever is opened
//! must be a regular file; and it is read by offset, only the headers and
//! tables a symbol lookup needs, within [`READ_BUDGET`].
use std::{
    cell::RefCell,
    collections::{BTreeMap, HashSet},
    ffi::OsStr,
    fmt,
    fs::{File, Metadata, OpenOptions},
    io,
    os::{
        fd::AsRawFd as _,
        unix::{
            ffi::OsStrExt as _,
            fs::{FileExt as _, FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _},
        },
    },
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use anyhow::{Context as _, Result, anyhow, bail};
use object::{Object as _, ObjectSection as _, ObjectSymbol as _, ReadCache, ReadCacheOps, ReadRef, SymbolKind};

/// A file mapped into the target process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedObject {
    /// The path as the target sees it (in its mount namespace), for logs:
    /// it may name another file by now, or none.
    pub path: PathBuf,
    /// What the agent opens ([`ElfFile::open`]) and the kernel attaches
    /// uprobes to: `/proc/PID/map_files/START-END`, a link to the inode
    /// mapped there, whatever `path` names now. The kernel follows it when
    /// a uprobe is created, so a deleted or replaced library is probed in
    /// the inode the process runs. It lasts as long as that mapping.
    pub host_path: PathBuf,
    /// The type of the filesystem it is on, when the process's mount table
    /// says (read for anonymous devices only: `fuse.sshfs`, `tmpfs`,
    /// `overlay`...).
    pub filesystem: Option<String>,
}

impl MappedObject {
    /// Whether it is on a FUSE filesystem: served by a process, which may
    /// be the watched tenant's own. A read of it, or the kernel's uprobe
    /// attach (which reads the probed page), waits on that server, and
    /// once a request reached the server no signal ends the wait, not even
    /// SIGKILL: a server that never answers holds the reader forever.
    pub fn on_fuse(&self) -> bool {
        self.filesystem.as_deref().is_some_and(|fs| fs == "fuse" || fs == "fuseblk" || fs.starts_with("fuse."))
    }
}

/// One file in `/proc/PID/maps`: its first mapping (any of them reaches the
/// file through map_files) and which inode it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// As the target sees it, without the ` (deleted)` maps adds to a file
    /// that was unlinked.
    pub path: PathBuf,
    pub start: u64,
    pub end: u64,
    /// The mapped inode's device (major, minor) and number.
    pub dev: (u32, u32),
    pub inode: u64,
}

/// The files a process has mapped, and its main executable.
#[derive(Debug, Clone)]
pub struct ProcessImage {
    pub pid: u32,
    pub exe: PathBuf,
    /// One per distinct path, by path.
    pub mapped: Vec<Mapping>,
    /// The filesystem types of its anonymous devices (major 0: FUSE,
    /// tmpfs, overlay...), by device, from its mount table: read only
    /// when it maps a file on one.
    filesystems: Vec<((u32, u32), String)>,
}

/// The most of a mount table read: about 50 000 mounts.
const MOUNTINFO_BUDGET: u64 = 8 << 20;

/// (device, filesystem type) of every mount of process `pid`'s mount
/// namespace, from `/proc/PID/mountinfo` (written by the kernel, so safe to
/// read, but bounded: a tenant can mount thousands of filesystems); empty
/// if it cannot be read.
fn mounted_filesystems(pid: u32) -> Vec<((u32, u32), String)> {
    use std::io::Read as _;
    let mut text = Vec::new();
    let read = File::open(format!("/proc/{pid}/mountinfo"))
        .and_then(|file| file.take(MOUNTINFO_BUDGET).read_to_end(&mut text));
    if read.is_err() {
        return Vec::new();
    }
    parse_mountinfo(&String::from_utf8_lossy(&text))
}

/// mountinfo(5): `ID PARENT MAJOR:MINOR ROOT POINT OPTIONS [TAGS...] - TYPE
/// SOURCE SUPER_OPTIONS`, the device in decimal.
fn parse_mountinfo(text: &str) -> Vec<((u32, u32), String)> {
    text.lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let (major, minor) = before.split(' ').nth(2)?.split_once(':')?;
            let fstype = after.split(' ').next()?;
            Some(((major.parse().ok()?, minor.parse().ok()?), fstype.to_owned()))
        })
        .collect()
}

/// The one-letter state in `/proc/PID/stat` (`Z` for a zombie): the field
/// after the last `)`, since the name before it may hold anything.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

impl ProcessImage {
    pub fn read(pid: u32) -> Result<Self> {
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        if !proc_dir.exists() {
            bail!(
                "no process with pid {pid} (check `ps -p {pid}`; with containers, run the agent in the host pid namespace)"
            );
        }
        let maps_path = proc_dir.join("maps");
        // Bytes: a path need not be UTF-8 (and must be opened as it is).
        let maps = std::fs::read(&maps_path)
            .with_context(|| format!("reading {} (the agent needs root or CAP_SYS_PTRACE)", maps_path.display()))?;
        let exe = std::fs::read_link(proc_dir.join("exe")).map_err(|err| {
            // A zombie has no image either: say which it is.
            if process_state(pid) == Some('Z') {
                anyhow!("pid {pid} is a zombie (it exited and its parent has not reaped it): there is nothing to watch")
            } else if err.kind() == io::ErrorKind::PermissionDenied {
                anyhow!(err).context(format!(
                    "reading /proc/{pid}/exe: another user's process, or one with capabilities this agent lacks, \
                     is read with CAP_SYS_PTRACE (`stallwatch doctor` checks it)"
                ))
            } else {
                anyhow!(err).context(format!("reading /proc/{pid}/exe (is pid {pid} a kernel thread?)"))
            }
        })?;
        let mapped = parse_maps(&maps);
        let filesystems = if mapped.iter().any(|m| m.dev.0 == 0) { mounted_filesystems(pid) } else { Vec::new() };
        Ok(Self { pid, exe, mapped, filesystems })
    }

    /// The type of the filesystem `mapping`'s file is on, as the process's
    /// mount table says (`None`: not found there).
    pub fn filesystem(&self, mapping: &Mapping) -> Option<&str> {
        self.filesystems.iter().find(|(dev, _)| *dev == mapping.dev).map(|(_, fstype)| fstype.as_str())
    }

    /// The mapped file a profile's `object` names: `None` is the main
    /// executable; a name starting with `/` is a path; otherwise the
    /// basename of a mapped file equals the name's last component or
    /// starts with it followed by `.` (so `libfoo.so` finds `libfoo.so.1`),
    /// and the directories before it, if the name has any, are the last of
    /// the file's (`mooncake/engine.so` is the `engine.so` of a `mooncake`
    /// package, wherever its site-packages lies: a bare `engine.so` is too
    /// common a name).
    pub fn find(&self, object: Option<&str>) -> Result<MappedObject> {
        let mapping = match object {
            None => {
                // `exe` links to a deleted executable as maps names it, plus
                // ` (deleted)`.
                let exe = self.exe.as_os_str().as_bytes();
                let exe = Path::new(OsStr::from_bytes(exe.strip_suffix(DELETED).unwrap_or(exe)));
                self.mapped.iter().find(|m| m.path == exe).ok_or_else(|| {
                    anyhow!("pid {}: its executable {} is not among the files it maps", self.pid, self.exe.display())
                })?
            }
            Some(name) if name.starts_with('/') => {
                self.mapped.iter().find(|m| m.path.as_os_str() == name).ok_or_else(|| self.not_mapped(name))?
            }
            Some(name) => {
                let matches: Vec<_> = self.mapped.iter().filter(|m| object_matches(&m.path, name)).collect();
                match matches.as_slice() {
                    [one] => *one,
                    [] => return Err(self.not_mapped(name)),
                    many => bail!(
                        "`{name}` matches {} files mapped by pid {}: {}; give the full path as `object`, \
                         or the file's last directories too (`pkg/{name}`)",
                        many.len(),
                        self.pid,
                        many.iter().map(|m| m.path.display().to_string()).collect::<Vec<_>>().join(", ")
                    ),
                }
            }
        };
        let link = MapFilesLink { pid: self.pid, start: mapping.start, end: mapping.end };
        let filesystem = self.filesystem(mapping).map(str::to_owned);
        Ok(MappedObject { path: mapping.path.clone(), host_path: link.path(), filesystem })
    }

    /// Says which libraries the process maps, the first
    /// [`LISTED_LIBRARIES`] of them: a Python server maps hundreds, and
    /// the error is one log line.
    fn not_mapped(&self, name: &str) -> anyhow::Error {
        let mut libs: Vec<_> =
            self.mapped.iter().filter_map(|m| m.path.file_name()?.to_str()).filter(|n| n.contains(".so")).collect();
        libs.sort_unstable();
        libs.dedup();
        let listed = match libs.len() {
            0 => "none".to_owned(),
            n if n <= LISTED_LIBRARIES => libs.join(", "),
            n => format!(
                "{} and {} more (all in /proc/{}/maps)",
                libs[..LISTED_LIBRARIES].join(", "),
                n - LISTED_LIBRARIES,
                self.pid
            ),
        };
        anyhow!(
            "pid {} ({}) has no file `{name}` mapped: it is not loaded (yet), or the name differs; \
             mapped libraries: {listed}",
            self.pid,
            self.exe.display(),
        )
    }
}

/// How many mapped libraries a missing object's error names.
const LISTED_LIBRARIES: usize = 16;

/// Whether the mapped file `path` is the one `name` (no leading `/`)
/// names: its basename by [`basename_matches`], its directories by the
/// name's (`pkg/lib.so`: the file's parent directory is `pkg`).
fn object_matches(path: &Path, name: &str) -> bool {
    let (dirs, base) = match name.rsplit_once('/') {
        Some((dirs, base)) => (Some(dirs), base),
        None => (None, name),
    };
    if !basename_matches(path, base) {
        return false;
    }
    let Some(dirs) = dirs else { return true };
    let mut parent = path.parent();
    for dir in dirs.rsplit('/') {
        match parent {
            Some(p) if p.file_name().and_then(|n| n.to_str()) == Some(dir) => parent = p.parent(),
            _ => return false,
        }
    }
    true
}

fn basename_matches(path: &Path, name: &str) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|base| {
        let base = without_wheel_hash(base);
        base == name || base.strip_prefix(name).is_some_and(|rest| rest.starts_with('.'))
    })
}

/// `libucp-b39b3ed9.so.0.0.0` -> `libucp.so.0.0.0`: Python wheels
/// (auditwheel) rename the libraries they vendor with a hash of their
/// contents, which differs per wheel build; profiles name the library.
fn without_wheel_hash(base: &str) -> std::borrow::Cow<'_, str> {
    if let Some(at) = base.find(".so") {
        let (stem, rest) = base.split_at(at);
        if let Some((name, hash)) = stem.rsplit_once('-') {
            if hash.len() == 8 && hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return format!("{name}{rest}").into();
            }
        }
    }
    base.into()
}

/// What maps appends to the path of a file that was unlinked.
const DELETED: &[u8] = b" (deleted)";

/// One file per distinct path in `/proc/PID/maps`, by path, with its
/// first mapping (the lowest: maps lists them by address).
fn parse_maps(maps: &[u8]) -> Vec<Mapping> {
    let mut files = BTreeMap::new();
    for mapping in file_mappings(maps) {
        files.entry(mapping.path.clone()).or_insert(mapping);
    }
    files.into_values().collect()
}

/// Every mapping of a file in `/proc/PID/maps`, in its order; a line that
/// does not parse is skipped.
fn file_mappings(maps: &[u8]) -> impl Iterator<Item = Mapping> + '_ {
    maps.split(|&b| b == b'\n').filter_map(|line| {
        // address perms offset dev inode path: the path is the sixth
        // field and may contain spaces.
        let mut fields = line.splitn(6, |&b| b == b' ');
        let (start, end) = std::str::from_utf8(fields.next()?).ok()?.split_once('-')?;
        let (_perms, _offset) = (fields.next()?, fields.next()?);
        let (major, minor) = std::str::from_utf8(fields.next()?).ok()?.split_once(':')?;
        let inode = std::str::from_utf8(fields.next()?).ok()?.parse().ok()?;
        let path = fields.next()?.trim_ascii_start();
        let path = path.strip_suffix(DELETED).unwrap_or(path);
        path.starts_with(b"/").then_some(())?;
        Some(Mapping {
            path: PathBuf::from(OsStr::from_bytes(&with_newlines(path))),
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
            dev: (u32::from_str_radix(major, 16).ok()?, u32::from_str_radix(minor, 16).ok()?),
            inode,
        })
    })
}

/// `path` as maps gives it, with each `\012` put back as the newline maps
/// wrote it for (so that a mapping stays one line): the path as
/// `/proc/PID/exe` gives it, and as the process opened it.
fn with_newlines(path: &[u8]) -> Vec<u8> {
    const ESCAPED: &[u8] = b"\\012";
    let mut out = Vec::with_capacity(path.len());
    let mut rest = path;
    while let Some((&first, after)) = rest.split_first() {
        match rest.strip_prefix(ESCAPED) {
            Some(unescaped) => {
                out.push(b'\n');
                rest = unescaped;
            }
            None => {
                out.push(first);
                rest = after;
            }
        }
    }
    out
}

/// `/proc/PID/map_files/START-END`: the file process `pid` maps at those
/// addresses. Following it takes CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE
/// (the agent has the first: attaching a uprobe takes it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MapFilesLink {
    pid: u32,
    start: u64,
    end: u64,
}

impl MapFilesLink {
    fn path(self) -> PathBuf {
        // No leading zeros: the kernel refuses a name with them.
        PathBuf::from(format!("/proc/{}/map_files/{:x}-{:x}", self.pid, self.start, self.end))
    }

    /// The link `path` is, if it is one ([`MappedObject::host_path`]).
    fn parse(path: &Path) -> Option<Self> {
        let rest = path.to_str()?.strip_prefix("/proc/")?;
        let (pid, rest) = rest.split_once("/map_files/")?;
        let (start, end) = rest.split_once('-')?;
        let link = Self {
            pid: pid.parse().ok()?,
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
        };
        (link.path() == path).then_some(link)
    }

    /// The mapped file: the link itself; when this agent may not follow it
    /// (EPERM: it lacks both capabilities, as for `stallwatch profile
    /// check` by a user), the path maps gives, if that still names the
    /// mapped inode. Returned with how errors name it.
    fn open(self) -> Result<(File, String)> {
        let link = self.path();
        let (pid, start, end) = (self.pid, self.start, self.end);
        // How the process names the file (the link's target, as maps
        // shows it), read without following the link.
        let name = match std::fs::read_link(&link) {
            Ok(target) => format!("{} mapped by pid {pid}", target.display()),
            Err(_) => format!("the file pid {pid} maps at {start:#x}-{end:#x}"),
        };
        match open_regular(&link) {
            Ok(file) => Ok((file, name)),
            Err(err) if err.raw_os_error() == Some(libc::EPERM) => {
                let file = self.open_by_path().with_context(|| {
                    format!(
                        "refusing {name}: this agent may not open it as mapped, through {} (EPERM: that takes \
                         CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE), nor by its path",
                        link.display()
                    )
                })?;
                Ok((file, name))
            }
            Err(err) if err.raw_os_error() == Some(libc::ENOENT) => {
                bail!(
                    "pid {pid} no longer maps a file at {start:#x}-{end:#x} (unmapped, or exited, since maps was read)"
                )
            }
            Err(err) => Err(anyhow!(err).context(format!("refusing {name} (opened through {})", link.display()))),
        }
    }

    /// The fallback of [`Self::open`]: `/proc/PID/root/<path>`, opened
    /// as [`open_regular`] opens, and only if it is the inode maps says is
    /// mapped there (a path replaced after mapping names another file).
    fn open_by_path(self) -> Result<File> {
        let maps_path = format!("/proc/{}/maps", self.pid);
        let maps = std::fs::read(&maps_path).with_context(|| format!("reading {maps_path}"))?;
        let mapping = file_mappings(&maps)
            .find(|m| (m.start, m.end) == (self.start, self.end))
            .ok_or_else(|| anyhow!("pid {} no longer maps a file at {:#x}-{:#x}", self.pid, self.start, self.end))?;
        open_as_mapped(self.pid, &mapping)
    }
}

/// `mapping` of process `pid` through `/proc/PID/root/<path>`, if its path
/// still names the inode mapped.
fn open_as_mapped(pid: u32, mapping: &Mapping) -> Result<File> {
    let path = root_path(pid, &mapping.path);
    let file = open_regular(&path).with_context(|| format!("opening {}", path.display()))?;
    let meta = file.metadata().with_context(|| format!("reading what {} is", path.display()))?;
    let found = ((libc::major(meta.dev()), libc::minor(meta.dev())), meta.ino());
    if found != (mapping.dev, mapping.inode) {
        let ((major, minor), inode) = found;
        bail!(
            "{} is not the file mapped (it is device {major:x}:{minor:x} inode {inode}, the mapped one {:x}:{:x} inode \
             {}): it was replaced or deleted after it was mapped",
            path.display(),
            mapping.dev.0,
            mapping.dev.1,
            mapping.inode
        );
    }
    Ok(file)
}

/// `path` (as process `pid` sees it) from here, through its root.
fn root_path(pid: u32, path: &Path) -> PathBuf {
    let relative = path.strip_prefix("/").unwrap_or(path);
    PathBuf::from(format!("/proc/{pid}/root")).join(relative)
}

/// Open `path` to read it, if it is a regular file, without letting
/// whoever controls it stall the agent or act through it: it is first
/// opened with `O_PATH`, which resolves the path and opens nothing (no
/// FIFO waits for a writer, no device's open runs: a watchdog's would arm
/// it), and checked on that descriptor; then that very inode is opened
/// through `/proc/self/fd` with `O_NONBLOCK` (a tenant's lease on the file
/// would hold a plain open for 45 s) and `O_NOCTTY`.
fn open_regular(path: &Path) -> io::Result<File> {
    let handle = OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(path)?;
    let meta = handle.metadata()?;
    if !meta.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("it is {}, not a regular file", file_kind(&meta)),
        ));
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(format!("/proc/self/fd/{}", handle.as_raw_fd()))?;
    let opened = file.metadata()?;
    if (opened.dev(), opened.ino()) != (meta.dev(), meta.ino()) || !opened.file_type().is_file() {
        return Err(io::Error::other("it changed while it was opened"));
    }
    Ok(file)
}

/// What a file that is not a regular one is, for errors.
fn file_kind(meta: &Metadata) -> &'static str {
    let kind = meta.file_type();
    if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_dir() {
        "a directory"
    } else {
        "something else"
    }
}

/// What the kernel does with the instruction a uprobe replaces: it decides
/// what each hit costs. Measured here (kernel 6.18, one bpftrace counter
/// per hit, 200 000 calls each, `tests`-free microbenchmark in docs/profiles.md):
/// a 5-byte nop 0.63 us a hit, `jmp rel32` 0.86 us, `push %rbp` 1.29 us,
/// `mov %rdi,%rax` 33.9 us, `endbr64` 32.6 us. The kernel emulates nops,
/// pushes and relative branches; everything else, `endbr64` included, is
/// copied out of line and single-stepped, 25 to 50 times dearer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstInsn {
    /// `push %reg`: emulated.
    Push,
    /// A multi-byte nop (`nop5` and kin): emulated, the cheapest.
    Nop,
    /// A relative `jmp`, `call` or conditional jump: emulated (a function
    /// that is only a tail jump, such as libzmq's `zmq_msg_data`).
    Branch,
    /// Anything else: executed out of line by single-stepping.
    SingleStep,
}

/// `endbr64`, the CET landing pad many distributions compile every
/// function with: single-stepped, and it changes no register or memory,
/// so a probe goes on the instruction after it (see [`ElfFile::resolve`]).
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

/// How many bytes of `function` (`size` long, 0 if unknown) a probe steps
/// over: its `endbr64`, unless that is all there is.
fn landing_pad(function: &[u8], size: u64) -> usize {
    let pad = ENDBR64.len();
    if function.starts_with(&ENDBR64) && (size == 0 || size > pad as u64) { pad } else { 0 }
}

impl FirstInsn {
    fn classify(bytes: &[u8]) -> Self {
        match bytes {
            [0x50..=0x57, ..] | [0x41, 0x50..=0x57, ..] => Self::Push,
            [0x90, ..] | [0x0f, 0x1f, ..] | [0x66, 0x0f, 0x1f, ..] | [0x66, 0x90, ..] => Self::Nop,
            [0xe8 | 0xe9 | 0xeb | 0x70..=0x7f, ..] | [0x0f, 0x80..=0x8f, ..] => Self::Branch,
            _ => Self::SingleStep,
        }
    }

    /// Whether every hit pays for a single step (what no hot probe may do).
    pub fn single_stepped(self) -> bool {
        self == Self::SingleStep
    }
}

impl fmt::Display for FirstInsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Push => "push (emulated, ~1.3 us a hit)",
            Self::Nop => "nop (emulated, ~0.6 us a hit)",
            Self::Branch => "relative branch (emulated, ~0.9 us a hit)",
            Self::SingleStep => "single-stepped (~30 us a hit)",
        })
    }
}

/// A function found in an ELF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedSymbol {
    /// Where the probe goes, as a file offset (what the kernel's uprobe
    /// takes): the function's first byte, or the one after its `endbr64`.
    pub file_offset: u64,
    /// How many bytes of landing pad were stepped over (0 or 4).
    pub skipped: u64,
    pub first_insn: FirstInsn,
    /// The first instruction bytes, for the log.
    pub first_bytes: [u8; 4],
}

/// The most the agent reads of one ELF file: its headers, section table,
/// symbol and string tables and notes, each block counted once (see
/// [`ElfFile`]). The file is the watched process's, which can make it
/// anything: a library grown to gigabytes, headers that claim a table of
/// terabytes. 256 MiB holds the tables of the largest libraries a serving
/// process maps (libtorch_cpu.so's `.dynstr` alone runs to tens of MB,
/// and each name is read in 256-byte steps) with room to spare, and stays
/// well inside the 1 GiB the DaemonSet gives the agent.
pub const READ_BUDGET: u64 = 256 << 20;

/// An ELF file opened once and queried for many symbols: read by offset,
/// only what a query needs, each block once (kept by `object`'s
/// [`ReadCache`], which the parsed tables borrow) and never more than
/// [`READ_BUDGET`] in all. It is not mapped into the agent: the file's
/// owner could truncate it, and a read of a mapped page past the new end
/// would kill the agent with SIGBUS.
pub struct ElfFile {
    /// How errors name it: for a mapped object, its path in the process
    /// and the pid.
    name: String,
    reader: Reader,
}

impl ElfFile {
    /// Open `path`, a [`MappedObject::host_path`] or a file of the agent's
    /// own. It must be a regular file holding ELF; a mapped object is
    /// opened as mapped (see [`MapFilesLink::open`]).
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_within(path, READ_BUDGET)
    }

    fn open_within(path: &Path, budget: u64) -> Result<Self> {
        let (file, name) = match MapFilesLink::parse(path) {
            Some(link) => link.open()?,
            None => {
                let name = path.display().to_string();
                (open_regular(path).with_context(|| format!("refusing {name}"))?, name)
            }
        };
        let len = file.metadata().with_context(|| format!("reading the size of {name}"))?.len();
        let budget = Arc::new(Budget { limit: budget, spent: AtomicU64::new(0), exceeded: AtomicBool::new(false) });
        let counted = CountedFile { file, len, pos: 0, budget: Arc::clone(&budget) };
        let reader =
            Reader { cache: ReadCache::new(counted), budget, blocks: RefCell::default(), sections: Vec::new() };
        let mut elf = Self { name, reader };
        let sections = elf
            .parse()?
            .sections()
            .filter_map(|section| {
                let (at, size) = section.file_range()?;
                Some((at, at.checked_add(size)?))
            })
            .collect();
        elf.reader.sections = sections;
        Ok(elf)
    }

    /// Its headers and tables, as far as a query reads them (each query
    /// parses anew: the parsed file borrows the reader).
    fn parse(&self) -> Result<object::File<'_, Bounded<'_>>> {
        let parsed = object::File::parse(Bounded(&self.reader));
        self.within_budget()?;
        parsed.with_context(|| format!("{} is not an ELF file aya can read", self.name))
    }

    /// An error once reading the file went past its budget: whatever a
    /// query found meanwhile may miss what the refused reads held.
    fn within_budget(&self) -> Result<()> {
        let budget = &self.reader.budget;
        if budget.exceeded.load(Ordering::Relaxed) {
            bail!(
                "refusing {}: reading its headers and symbol tables takes more than {} MiB, the most the agent \
                 reads of one file (its headers claim tables that large, or it is not the library it seems)",
                self.name,
                budget.limit >> 20
            );
        }
        Ok(())
    }

    /// The file's GNU build id, lowercase hex (`None`: it has none).
    pub fn build_id(&self) -> Result<Option<String>> {
        let file = self.parse()?;
        let id = file.build_id();
        self.within_budget()?;
        let id = id.with_context(|| format!("reading the build id of {}", self.name))?;
        Ok(id.map(|bytes| bytes.iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// Look `symbol` up in `.symtab` and `.dynsym` (mangled names as they
    /// are in the file).
    pub fn resolve(&self, symbol: &str) -> Result<ResolvedSymbol> {
        let resolved = self.resolve_read(symbol);
        // A name the budget refused reads as no match: the symbol looked
        // for may have been that one.
        self.within_budget()?;
        resolved
    }

    fn resolve_read(&self, symbol: &str) -> Result<ResolvedSymbol> {
        let file = self.parse()?;
        let found = file
            .symbols()
            .chain(file.dynamic_symbols())
            .find(|sym| sym.name_bytes().is_ok_and(|name| name == symbol.as_bytes()) && sym.is_definition());
        let Some(sym) = found else {
            return Err(self.not_found(&file, symbol));
        };
        if sym.kind() != SymbolKind::Text {
            bail!("`{symbol}` in {} is a {:?} symbol, not a function", self.name, sym.kind());
        }
        let section_index = sym.section_index().ok_or_else(|| anyhow!("`{symbol}` in {} has no section", self.name))?;
        let section = file.section_by_index(section_index)?;
        let (section_offset, section_size) =
            section.file_range().ok_or_else(|| anyhow!("section of `{symbol}` in {} has no file data", self.name))?;
        let within = sym
            .address()
            .checked_sub(section.address())
            .filter(|within| *within < section_size)
            .ok_or_else(|| anyhow!("`{symbol}` in {} lies outside its section", self.name))?;
        let start = section_offset
            .checked_add(within)
            .ok_or_else(|| anyhow!("`{symbol}` in {} lies past the end of any file", self.name))?;
        // Its landing pad and the instruction after it, as far as the
        // section goes.
        let wanted = (section_size - within).min(FUNCTION_HEAD);
        let function = Bounded(&self.reader)
            .read_bytes_at(start, wanted)
            .map_err(|()| anyhow!("reading the first bytes of `{symbol}` in {}", self.name))?;
        // A probe after the landing pad sees the same registers and stack
        // as one on it (the pad changes neither), for entry and return
        // probes alike, and costs an emulated instruction instead of a
        // single step. Nothing jumps into a function past its pad.
        let skipped = landing_pad(function, sym.size());
        let available = &function[skipped..];
        let mut first_bytes = [0; 4];
        let n = available.len().min(first_bytes.len());
        first_bytes[..n].copy_from_slice(&available[..n]);
        Ok(ResolvedSymbol {
            file_offset: start + skipped as u64,
            skipped: skipped as u64,
            first_insn: FirstInsn::classify(available),
            first_bytes,
        })
    }

    fn not_found<'a>(&self, file: &object::File<'a, Bounded<'a>>, symbol: &str) -> anyhow::Error {
        let mut names: Vec<&str> = file
            .symbols()
            .chain(file.dynamic_symbols())
            .filter(|sym| sym.is_definition() && sym.kind() == SymbolKind::Text)
            .filter_map(|sym| sym.name().ok())
            .collect();
        names.sort_unstable();
        names.dedup();
        let shown = shortened(symbol);
        if names.is_empty() {
            return anyhow!("symbol `{shown}` not found: {} has no function symbols (stripped?)", self.name);
        }
        let hint = match suggestions(symbol, &names) {
            Suggestions::Close(close) if !close.is_empty() => format!("; did you mean: {}", close.join(", ")),
            Suggestions::Close(_) => String::new(),
            Suggestions::TooLong => format!(
                "; no suggestions for a name of {} bytes (function names are rarely longer than {MAX_SUGGESTED_LEN})",
                symbol.len()
            ),
        };
        anyhow!("symbol `{shown}` not found in {} ({} function symbols){hint}", self.name, names.len())
    }
}

/// How much of a function's start [`ElfFile::resolve`] reads: its landing
/// pad, if any, and the instruction after it (x86 instructions are at
/// most 15 bytes long).
const FUNCTION_HEAD: u64 = 16;

/// What reading one file has taken, against its limit: shared by the
/// reader inside the [`ReadCache`] and the check made before the cache
/// allocates a block. (Atomics, not a `Cell`, so an [`ElfFile`] can be
/// read on another thread than the one that opened it.)
#[derive(Debug)]
struct Budget {
    limit: u64,
    spent: AtomicU64,
    /// A read was refused: the file is over budget from then on.
    exceeded: AtomicBool,
}

impl Budget {
    /// Whether `bytes` more fit in what is left.
    fn fits(&self, bytes: u64) -> bool {
        bytes <= self.limit.saturating_sub(self.spent.load(Ordering::Relaxed))
    }

    /// Whether `bytes` more may be read; if not, the file is over budget.
    fn allows(&self, bytes: u64) -> bool {
        let allowed = self.fits(bytes);
        if !allowed {
            self.exceeded.store(true, Ordering::Relaxed);
        }
        allowed
    }

    /// Count `bytes` about to be read, or refuse them.
    fn charge(&self, bytes: usize) -> core::result::Result<(), ()> {
        let bytes = bytes as u64;
        if !self.allows(bytes) {
            return Err(());
        }
        self.spent.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }
}

/// The opened file as the [`ReadCache`] reads it: by offset (`pread`, so
/// a seek costs no system call), every byte counted against the budget
/// before it is read.
#[derive(Debug)]
struct CountedFile {
    file: File,
    /// Its size when opened: reads past it fail (a file truncated since
    /// fails them too, with an error, not a signal).
    len: u64,
    pos: u64,
    budget: Arc<Budget>,
}

impl ReadCacheOps for CountedFile {
    fn len(&mut self) -> core::result::Result<u64, ()> {
        Ok(self.len)
    }

    fn seek(&mut self, pos: u64) -> core::result::Result<u64, ()> {
        self.pos = pos;
        Ok(pos)
    }

    fn read(&mut self, buf: &mut [u8]) -> core::result::Result<usize, ()> {
        self.budget.charge(buf.len())?;
        loop {
            match self.file.read_at(buf, self.pos) {
                Ok(n) => {
                    self.pos += n as u64;
                    return Ok(n);
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Err(()),
            }
        }
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> core::result::Result<(), ()> {
        self.budget.charge(buf.len())?;
        self.file.read_exact_at(buf, self.pos).map_err(|_| ())?;
        self.pos += buf.len() as u64;
        Ok(())
    }
}

/// One file's bytes as `object` parses them, through its [`ReadCache`].
struct Reader {
    cache: ReadCache<CountedFile>,
    budget: Arc<Budget>,
    /// The blocks (offset, size) the cache holds: asked for again (each
    /// query parses the file anew), they are read from memory.
    blocks: RefCell<HashSet<(u64, u64)>>,
    /// Where the file's sections lie (offset, end), once it is parsed: a
    /// name is read with the whole string table it is in.
    sections: Vec<(u64, u64)>,
}

impl Reader {
    /// The string table (offset, size) `range` (a name, to the table's
    /// end) lies in, if reading all of it at once fits in the budget or is
    /// done already: the cache alone would read each name in 256-byte
    /// steps, a system call each, counted whole (libtorch_cpu.so's 600 000
    /// symbols: 2 s, and 160 MiB counted for a 78 MB table; at once: 0.15 s
    /// and the 78 MB).
    fn string_table(&self, range: &std::ops::Range<u64>) -> Option<(u64, u64)> {
        let (start, end) = self
            .sections
            .iter()
            .copied()
            .filter(|&(start, end)| end == range.end && start <= range.start)
            .max_by_key(|&(start, _)| start)?;
        let size = end - start;
        (self.blocks.borrow().contains(&(start, size)) || self.budget.fits(size)).then_some((start, size))
    }
}

/// [`Reader`] as `object` takes it: a [`ReadRef`] that refuses a block
/// larger than the budget has left before the cache allocates it (and
/// fills it with zeros, before its reader is asked for a byte): headers
/// claiming a table of terabytes cost nothing.
#[derive(Clone, Copy)]
struct Bounded<'a>(&'a Reader);

impl<'a> ReadRef<'a> for Bounded<'a> {
    fn len(self) -> core::result::Result<u64, ()> {
        ReadRef::len(&self.0.cache)
    }

    fn read_bytes_at(self, offset: u64, size: u64) -> core::result::Result<&'a [u8], ()> {
        let held = self.0.blocks.borrow().contains(&(offset, size));
        if !held && !self.0.budget.allows(size) {
            return Err(());
        }
        let bytes = (&self.0.cache).read_bytes_at(offset, size)?;
        self.0.blocks.borrow_mut().insert((offset, size));
        Ok(bytes)
    }

    /// Strings (symbol names): out of their whole string table (see
    /// [`Reader::string_table`]), else as the cache reads them, at most 4
    /// KiB for one.
    fn read_bytes_at_until(self, range: std::ops::Range<u64>, delimiter: u8) -> core::result::Result<&'a [u8], ()> {
        let Some((start, size)) = self.0.string_table(&range) else {
            return (&self.0.cache).read_bytes_at_until(range, delimiter);
        };
        let table = self.read_bytes_at(start, size)?;
        let from = table.get(usize::try_from(range.start - start).map_err(|_| ())?..).ok_or(())?;
        let len = from.iter().position(|&b| b == delimiter).ok_or(())?;
        Ok(&from[..len])
    }
}

/// The longest symbol "did you mean" looks for: the similarity score costs
/// the product of the two lengths, and a profile's name of a megabyte
/// would take minutes over a large library, deaf to SIGINT meanwhile.
const MAX_SUGGESTED_LEN: usize = 256;
/// The most names of a file scored for suggestions (in name order), so a
/// library of millions of symbols costs bounded work too.
const MAX_CANDIDATES: usize = 100_000;
/// The longest candidate name scored by similarity; longer ones (deep C++
/// templates) are only checked for containing the symbol, or it in them.
const MAX_SCORED_LEN: usize = 1024;

/// What "did you mean" has to offer.
#[derive(Debug, PartialEq, Eq)]
enum Suggestions<'a> {
    /// Up to three close names, the closest first.
    Close(Vec<&'a str>),
    /// The symbol is longer than [`MAX_SUGGESTED_LEN`]: none looked for.
    TooLong,
}

/// The names of `names` closest to `symbol`: one containing it (or
/// contained in it) first, then by Jaro-Winkler similarity above 0.7.
fn suggestions<'a>(symbol: &str, names: &[&'a str]) -> Suggestions<'a> {
    if symbol.len() > MAX_SUGGESTED_LEN {
        return Suggestions::TooLong;
    }
    let mut scored: Vec<(f64, &str)> = names
        .iter()
        .take(MAX_CANDIDATES)
        .filter_map(|name| {
            if name.contains(symbol) || symbol.contains(name) {
                Some((1.0, *name))
            } else if name.len() <= MAX_SCORED_LEN {
                Some((strsim::jaro_winkler(symbol, name), *name))
            } else {
                None
            }
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    Suggestions::Close(scored.iter().take(3).filter(|(score, _)| *score > 0.7).map(|(_, n)| *n).collect())
}

/// A name as errors show it: whole up to 200 bytes, else its start and its
/// length.
fn shortened(name: &str) -> std::borrow::Cow<'_, str> {
    const SHOWN: usize = 200;
    if name.len() <= SHOWN {
        return name.into();
    }
    let end = (0..=100).rev().find(|&i| name.is_char_boundary(i)).unwrap_or(0);
    format!("{}... ({} bytes)", &name[..end], name.len()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_id_is_read_as_readelf_prints_it() {
        // The C library every process here maps carries one.
        let libc =
            ProcessImage::read(std::process::id()).expect("own image").find(Some("libc.so")).expect("libc mapped");
        let id = ElfFile::open(&libc.host_path).expect("libc").build_id().expect("parsed").expect("a build id");
        assert!(id.len() >= 16 && id.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()), "{id}");
    }

    /// A child that exited and was not reaped is named a zombie, not a
    /// kernel thread.
    #[test]
    fn a_zombie_is_named_as_such() {
        let mut child = std::process::Command::new("true").spawn().expect("spawning true");
        let pid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while process_state(pid) != Some('Z') {
            assert!(std::time::Instant::now() < deadline, "the child never became a zombie");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let err = format!("{:#}", ProcessImage::read(pid).expect_err("no image"));
        let _ = child.wait();
        assert!(err.contains(&format!("pid {pid} is a zombie")) && !err.contains("kernel thread"), "{err}");
        assert!(process_state(std::process::id()).is_some_and(|state| state != 'Z'));
    }

    #[test]
    fn maps_give_each_file_once_with_its_first_range_and_inode() {
        let maps = b"\
55d0c-55d0d r--p 00000000 08:01 1234 /usr/bin/demo prefill
55d0d-55d0e r-xp 00001000 08:01 1234 /usr/bin/demo prefill
00400000-00401000 r-xp 00000000 fe:1a 99 /lib/libnixl.so (deleted)
7f01-7f02 rw-p 00000000 00:00 0 
7ffd-7ffe rw-p 00000000 00:00 0 [stack]
7f02-7f03 r-xp 00000000 08:01 98 /lib/lib\xff.so
zzzz-7f04 r-xp 00000000 08:01 97 /lib/unparsed.so
7f05-7f06 r-xp 00000000 08:01 96 /opt/a\\012b\\01
";
        let mapping = |path: &[u8], start, end, dev, inode| Mapping {
            path: PathBuf::from(OsStr::from_bytes(path)),
            start,
            end,
            dev,
            inode,
        };
        assert_eq!(
            parse_maps(maps),
            vec![
                mapping(b"/lib/libnixl.so", 0x40_0000, 0x40_1000, (0xfe, 0x1a), 99),
                mapping(b"/lib/lib\xff.so", 0x7f02, 0x7f03, (8, 1), 98),
                // maps writes a newline as \012.
                mapping(b"/opt/a\nb\\01", 0x7f05, 0x7f06, (8, 1), 96),
                mapping(b"/usr/bin/demo prefill", 0x55d0c, 0x55d0d, (8, 1), 1234),
            ]
        );
        assert_eq!(file_mappings(maps).count(), 5, "every mapping of a file, the unparsable line skipped");
    }

    #[test]
    fn map_files_links_are_named_as_the_kernel_names_them() {
        let link = MapFilesLink { pid: 42, start: 0x40_0000, end: 0x7f00_0000_1000 };
        // No leading zeros (maps pads addresses to 8 digits).
        assert_eq!(link.path(), PathBuf::from("/proc/42/map_files/400000-7f0000001000"));
        assert_eq!(MapFilesLink::parse(&link.path()), Some(link));
        for other in
            ["/proc/42/map_files/0400000-7f0000001000", "/proc/42/root/lib/x.so", "/lib/x.so", "/proc/x/map_files/1-2"]
        {
            assert_eq!(MapFilesLink::parse(Path::new(other)), None, "{other}");
        }
    }

    /// A file of `path` in a test image, mapped at an address of its own.
    fn mapping(path: &str) -> Mapping {
        let start = 0x1000 * (1 + path.len() as u64);
        Mapping { path: path.into(), start, end: start + 0x1000, dev: (8, 1), inode: 7 }
    }

    #[test]
    fn a_mapped_objects_filesystem_comes_from_the_mount_table_by_device() {
        // From a real host: the root, a FUSE mount, a tmpfs; optional tags
        // before the separator.
        let mountinfo = "\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
95 22 0:52 / /tmp/fz rw,nosuid,nodev,relatime shared:40 master:3 - fuse frozen_fs rw,user_id=0
97 22 0:53 / /mnt/s rw,relatime - fuse.sshfs host:/ rw
98 22 0:54 / /dev/shm rw - tmpfs tmpfs rw
bad line without a separator
";
        let image = ProcessImage {
            pid: 1,
            exe: "/bin/x".into(),
            mapped: vec![
                Mapping { dev: (253, 1), ..mapping("/usr/lib/libc.so.6") },
                Mapping { dev: (0, 52), ..mapping("/tmp/fz/lib.so") },
                Mapping { dev: (0, 53), ..mapping("/mnt/s/lib.so") },
                Mapping { dev: (0, 54), ..mapping("/dev/shm/lib.so") },
                Mapping { dev: (0, 99), ..mapping("/gone/lib.so") },
            ],
            filesystems: parse_mountinfo(mountinfo),
        };
        let on = |name: &str| image.find(Some(name)).expect(name);
        assert_eq!(on("libc.so").filesystem.as_deref(), Some("ext4"));
        assert!(!on("libc.so").on_fuse());
        assert!(on("/tmp/fz/lib.so").on_fuse());
        assert_eq!(on("/mnt/s/lib.so").filesystem.as_deref(), Some("fuse.sshfs"));
        assert!(on("/mnt/s/lib.so").on_fuse());
        assert!(!on("/dev/shm/lib.so").on_fuse());
        assert_eq!(on("/gone/lib.so").filesystem, None, "a device no mount has");
        // This process's own table reads, and names its root's type.
        let own = ProcessImage::read(std::process::id()).expect("own image");
        assert!(own.mapped.iter().all(|m| m.dev.0 != 0) || !own.filesystems.is_empty());
    }

    #[test]
    fn object_names_match_basename_and_versions() {
        let image = ProcessImage {
            pid: 1,
            exe: "/bin/x".into(),
            mapped: vec![mapping("/bin/x"), mapping("/a/libnixl.so.0"), mapping("/a/libnixl_ucx.so")],
            filesystems: Vec::new(),
        };
        assert_eq!(image.find(Some("libnixl.so")).unwrap().path, PathBuf::from("/a/libnixl.so.0"));
        assert_eq!(image.find(None).unwrap().host_path, PathBuf::from("/proc/1/map_files/7000-8000"));
        let deleted = ProcessImage { exe: "/bin/x (deleted)".into(), ..image.clone() };
        assert_eq!(deleted.find(None).unwrap().path, PathBuf::from("/bin/x"));
        let gone = ProcessImage { exe: "/bin/y".into(), ..image.clone() };
        assert!(gone.find(None).unwrap_err().to_string().contains("its executable /bin/y is not among the files"));
        let wheel =
            ProcessImage { mapped: vec![mapping("/w/nixl_cu12.libs/libucp-b39b3ed9.so.0.0.0")], ..image.clone() };
        assert_eq!(
            wheel.find(Some("libucp.so")).unwrap().path,
            PathBuf::from("/w/nixl_cu12.libs/libucp-b39b3ed9.so.0.0.0")
        );
        assert!(wheel.find(Some("libucp-b39b3ed9.so")).is_err(), "profiles name the library, not one build of it");
        let packaged = ProcessImage {
            mapped: vec![
                mapping("/v/site-packages/mooncake/engine.so"),
                mapping("/v/site-packages/other/engine.so"),
                mapping("/v/site-packages/notmooncake/engine.so"),
            ],
            ..image.clone()
        };
        assert_eq!(
            packaged.find(Some("mooncake/engine.so")).unwrap().path,
            PathBuf::from("/v/site-packages/mooncake/engine.so")
        );
        assert_eq!(
            packaged.find(Some("site-packages/mooncake/engine.so")).unwrap().path,
            PathBuf::from("/v/site-packages/mooncake/engine.so")
        );
        let err = packaged.find(Some("engine.so")).unwrap_err().to_string();
        assert!(err.contains("matches 3 files"), "a bare name is ambiguous: {err}");
        assert!(packaged.find(Some("ooncake/engine.so")).is_err(), "whole directory names only");
        assert!(packaged.find(Some("x/mooncake/engine.so")).is_err());
        let err = image.find(Some("libucx.so")).unwrap_err().to_string();
        assert!(err.contains("has no file `libucx.so` mapped"), "{err}");
        assert!(err.contains("libnixl.so.0"), "{err}");
        // A Python server maps hundreds: the error names a few, and where the rest are.
        let many =
            ProcessImage { mapped: (0..300).map(|n| mapping(&format!("/v/lib{n:03}.so"))).collect(), ..image.clone() };
        let err = many.find(Some("libucx.so")).unwrap_err().to_string();
        assert!(err.contains("lib015.so and 284 more (all in /proc/1/maps)"), "{err}");
        assert!(!err.contains("lib016.so"), "{err}");
    }

    #[test]
    fn first_instructions_are_classified() {
        assert_eq!(FirstInsn::classify(&[0x55, 0x48, 0x89, 0xe5]), FirstInsn::Push);
        assert_eq!(FirstInsn::classify(&[0x41, 0x57]), FirstInsn::Push);
        assert_eq!(FirstInsn::classify(&[0x0f, 0x1f, 0x44, 0x00, 0x00]), FirstInsn::Nop);
        // libzmq's zmq_msg_data: a tail jump.
        assert_eq!(FirstInsn::classify(&[0xe9, 0xcb, 0x0e, 0xfb, 0xff]), FirstInsn::Branch);
        assert_eq!(FirstInsn::classify(&[0xeb, 0x10]), FirstInsn::Branch);
        assert_eq!(FirstInsn::classify(&[0x0f, 0x84, 0, 0, 0, 0]), FirstInsn::Branch);
        assert_eq!(FirstInsn::classify(&ENDBR64), FirstInsn::SingleStep, "stepped over by resolve, never probed");
        assert_eq!(FirstInsn::classify(&[0x48, 0x83, 0xec, 0x18]), FirstInsn::SingleStep);
        assert!(FirstInsn::classify(&[0x48, 0x89, 0xf8]).single_stepped());
        assert!(!FirstInsn::classify(&[0x55]).single_stepped());
        assert_eq!(FirstInsn::classify(&[]), FirstInsn::SingleStep);
    }

    #[test]
    fn a_cet_landing_pad_is_stepped_over_unless_it_is_the_whole_function() {
        assert_eq!(landing_pad(&[0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48], 32), 4);
        assert_eq!(landing_pad(&[0xf3, 0x0f, 0x1e, 0xfa, 0x55], 0), 4, "size unknown");
        assert_eq!(landing_pad(&[0xf3, 0x0f, 0x1e, 0xfa], 4), 0);
        assert_eq!(landing_pad(&[0x55, 0x48, 0x89, 0xe5], 32), 0);
        assert_eq!(landing_pad(&[0xf3, 0x0f], 32), 0);
    }

    #[test]
    fn suggestions_are_bounded_work() {
        let names = ["prefill_enqueue", "prefill_release", "kv_transfer_post"];
        assert_eq!(
            suggestions("prefill_enqueu", &names),
            Suggestions::Close(vec!["prefill_enqueue", "prefill_release"])
        );
        assert_eq!(suggestions("transfer_post", &names), Suggestions::Close(vec!["kv_transfer_post"]));
        assert_eq!(suggestions(&"x".repeat(MAX_SUGGESTED_LEN + 1), &names), Suggestions::TooLong);
        // Only the first MAX_CANDIDATES names are looked at.
        let many: Vec<String> = (0..MAX_CANDIDATES).map(|i| format!("unrelated_{i:06}")).collect();
        let mut many: Vec<&str> = many.iter().map(String::as_str).collect();
        many.push("prefill_enqueue");
        assert_eq!(suggestions("prefill_enqueu", &many), Suggestions::Close(vec![]));
    }

    #[test]
    fn a_megabyte_symbol_is_refused_without_suggestions_and_shown_short() {
        let elf = ElfFile::open(&std::env::current_exe().unwrap()).unwrap();
        let symbol = "é".repeat(512 * 1024);
        let err = elf.resolve(&symbol).unwrap_err().to_string();
        assert!(err.contains("no suggestions for a name of 1048576 bytes"), "{}", &err[..err.len().min(400)]);
        assert!(err.len() < 1000, "the name is shortened: {} bytes", err.len());
        assert!(err.contains("... (1048576 bytes)`"), "{err}");
    }

    #[test]
    fn symbols_resolve_in_our_own_executable() {
        let exe = std::env::current_exe().unwrap();
        let elf = ElfFile::open(&exe).unwrap();
        let err = elf.resolve("definitely_not_a_symbol_here").unwrap_err().to_string();
        assert!(err.contains("not found"), "{err}");
        let resolved = elf.resolve("main").unwrap();
        assert!(resolved.file_offset > 0);
    }

    /// This process's C library, and a copy of it in `dir` named `name`:
    /// an ELF file the test may grow, map, delete or replace.
    fn libc_copy(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let image = ProcessImage::read(std::process::id()).expect("own image");
        let libc = image.find(Some("libc.so")).expect("libc mapped").path;
        let copy = dir.join(name);
        std::fs::copy(&libc, &copy).expect("copying libc");
        (libc, copy)
    }

    fn mkfifo(path: &Path) {
        let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("no NUL");
        // SAFETY: mkfifo reads the NUL-terminated path, alive for the call.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "mkfifo: {}", io::Error::last_os_error());
    }

    /// A file mapped into this process (read-only, as the loader maps a
    /// library's headers) until dropped.
    struct Mapped {
        addr: *mut libc::c_void,
        len: usize,
    }

    impl Mapped {
        fn new(path: &Path) -> Self {
            let file = File::open(path).expect("opening the file to map");
            let len = file.metadata().expect("its size").len() as usize;
            // SAFETY: a new private read-only mapping of an open file, at
            // an address the kernel picks; nothing else refers to it.
            let addr = unsafe {
                libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_PRIVATE, file.as_raw_fd(), 0)
            };
            assert_ne!(addr, libc::MAP_FAILED, "mmap: {}", io::Error::last_os_error());
            Self { addr, len }
        }
    }

    impl Drop for Mapped {
        fn drop(&mut self) {
            // SAFETY: the mapping `new` made; nothing reads through it.
            unsafe { libc::munmap(self.addr, self.len) };
        }
    }

    /// `run` on a thread of its own, which must be done within 10 s: a
    /// test of something that must not block fails instead of hanging.
    fn within_10s<T: Send + 'static>(run: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(run()));
        rx.recv_timeout(std::time::Duration::from_secs(10)).expect("done within 10 s, not blocked")
    }

    #[test]
    fn an_elf_file_can_be_read_on_another_thread() {
        fn send<T: Send>() {}
        send::<ElfFile>();
    }

    #[test]
    fn a_fifo_or_a_device_is_refused_without_opening_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join("libfifo.so");
        mkfifo(&fifo);
        let zero = dir.path().join("libzero.so");
        std::os::unix::fs::symlink("/dev/zero", &zero).expect("symlink");
        let errors =
            within_10s(move || [fifo, zero].map(|path| format!("{:#}", ElfFile::open(&path).err().expect("refused"))));
        assert!(errors[0].contains("libfifo.so: it is a FIFO, not a regular file"), "{}", errors[0]);
        assert!(errors[1].contains("libzero.so: it is a character device, not a regular file"), "{}", errors[1]);
    }

    #[test]
    fn a_library_grown_to_gigabytes_in_place_is_read_only_as_far_as_its_tables() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (libc, copy) = libc_copy(dir.path(), "libgrown.so");
        File::options().write(true).open(&copy).expect("open").set_len(6 << 30).expect("grown, sparse");
        let grown = within_10s(move || {
            let elf = ElfFile::open(&copy).expect("opened");
            (elf.resolve("getpid").expect("getpid"), elf.reader.budget.spent.load(Ordering::Relaxed))
        });
        assert_eq!(grown.0, ElfFile::open(&libc).expect("libc").resolve("getpid").expect("getpid"));
        assert!(grown.1 < 16 << 20, "read {} bytes of a 6 GiB file", grown.1);
    }

    /// An ELF header whose symbol table claims 4 GiB, at the start of an
    /// 8 GiB sparse file: reading the table would take that much memory.
    fn elf_claiming_a_huge_symtab(path: &Path) {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        for half in [3u16, 62] {
            bytes.extend_from_slice(&half.to_le_bytes()); // e_type ET_DYN, e_machine x86-64
        }
        bytes.extend_from_slice(&1u32.to_le_bytes()); // e_version
        for word in [0u64, 0, 64] {
            bytes.extend_from_slice(&word.to_le_bytes()); // e_entry, e_phoff, e_shoff
        }
        bytes.extend_from_slice(&0u32.to_le_bytes()); // e_flags
        for half in [64u16, 56, 0, 64, 3, 2] {
            bytes.extend_from_slice(&half.to_le_bytes()); // e_ehsize .. e_shstrndx (section 2 names them)
        }
        let section = |kind: u32, size: u64, link: u32, entsize: u64| {
            let mut header = Vec::new();
            header.extend_from_slice(&0u32.to_le_bytes()); // sh_name
            header.extend_from_slice(&kind.to_le_bytes());
            for word in [0u64, 0, 4096, size] {
                header.extend_from_slice(&word.to_le_bytes()); // sh_flags, sh_addr, sh_offset, sh_size
            }
            header.extend_from_slice(&link.to_le_bytes());
            header.extend_from_slice(&0u32.to_le_bytes()); // sh_info
            header.extend_from_slice(&8u64.to_le_bytes()); // sh_addralign
            header.extend_from_slice(&entsize.to_le_bytes());
            header
        };
        bytes.extend(section(0, 0, 0, 0));
        bytes.extend(section(2, 4 << 30, 2, 24)); // SHT_SYMTAB, its names in section 2
        bytes.extend(section(3, 1, 0, 0)); // SHT_STRTAB: one NUL
        std::fs::write(path, &bytes).expect("writing the headers");
        File::options().write(true).open(path).expect("open").set_len(8 << 30).expect("sparse");
    }

    /// This process's peak resident memory (`VmHWM`), in bytes.
    fn peak_memory() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").expect("reading /proc/self/status");
        let kib = status.lines().find_map(|line| line.strip_prefix("VmHWM:")?.trim().strip_suffix(" kB")?.parse().ok());
        kib.map(|kib: u64| kib << 10).expect("VmHWM in /proc/self/status")
    }

    #[test]
    fn reading_past_the_budget_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let huge = dir.path().join("libhuge.so");
        elf_claiming_a_huge_symtab(&huge);
        // Refused before the 4 GiB are allocated (and zero-filled): this
        // process's peak memory does not grow by them.
        let peak_before = peak_memory();
        let err = within_10s(move || format!("{:#}", ElfFile::open(&huge).err().expect("refused")));
        assert!(err.contains("libhuge.so: reading its headers and symbol tables takes more than 256 MiB"), "{err}");
        let grown = peak_memory().saturating_sub(peak_before);
        assert!(grown < 1 << 30, "the peak grew by {} MiB", grown >> 20);
        // This test binary's own tables are larger than 1 MiB: read in
        // blocks and names, they pass that budget.
        let exe = std::env::current_exe().expect("own executable");
        let err = match ElfFile::open_within(&exe, 1 << 20) {
            Err(err) => format!("{err:#}"),
            Ok(elf) => format!("{:#}", elf.resolve("definitely_not_a_symbol_here").expect_err("refused")),
        };
        assert!(err.contains("takes more than 1 MiB"), "{err}");
    }

    #[test]
    fn a_deleted_library_is_read_as_mapped_whatever_its_path_names_now() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (libc, copy) = libc_copy(dir.path(), "libdeleted.so");
        let _mapped = Mapped::new(&copy);
        std::fs::remove_file(&copy).expect("delete");
        // Its path now names a FIFO nobody writes: opening that would block.
        mkfifo(&copy);
        let pid = std::process::id();
        let object = ProcessImage::read(pid).expect("own image").find(Some("libdeleted.so")).expect("still mapped");
        assert_eq!(object.path, copy);
        assert!(object.host_path.starts_with(format!("/proc/{pid}/map_files/")), "{}", object.host_path.display());
        let (elf, symbol, build) = within_10s(move || {
            let elf = ElfFile::open(&object.host_path).expect("opened as mapped");
            let symbol = elf.resolve("getpid").expect("getpid");
            let build = elf.build_id().expect("build id");
            (elf.name, symbol, build)
        });
        let original = ElfFile::open(&libc).expect("libc");
        assert_eq!(symbol, original.resolve("getpid").expect("getpid"));
        assert_eq!(build, original.build_id().expect("build id"));
        assert!(elf.contains("libdeleted.so (deleted) mapped by pid"), "{elf}");
    }

    /// The capability sets of the calling thread (capget/capset act on one
    /// thread): version 3 headers, two words of each set.
    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: i32,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }

    /// Drop the calling thread's effective CAP_SYS_ADMIN (21) and
    /// CAP_CHECKPOINT_RESTORE (40): it may no longer follow map_files.
    fn drop_map_files_caps() {
        let mut header = CapHeader { version: 0x2008_0522, pid: 0 };
        let mut data = [CapData::default(); 2];
        // SAFETY: capget writes two CapData (version 3) into `data`;
        // capset reads them; both read the header.
        unsafe {
            assert_eq!(libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr()), 0);
            data[0].effective &= !(1 << 21);
            data[1].effective &= !(1 << (40 - 32));
            assert_eq!(libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()), 0);
        }
    }

    #[test]
    fn without_map_files_a_mapped_file_is_read_by_its_path_only_while_that_names_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (libc, copy) = libc_copy(dir.path(), "libreplaced.so");
        let _mapped = Mapped::new(&copy);
        let pid = std::process::id();
        let object = ProcessImage::read(pid).expect("own image").find(Some("libreplaced.so")).expect("mapped");
        let open_unprivileged = move |host_path: PathBuf| {
            within_10s(move || {
                drop_map_files_caps();
                let refused = open_regular(&host_path).err().map(|err| err.raw_os_error());
                (refused, ElfFile::open(&host_path).and_then(|elf| elf.resolve("getpid")).map_err(|e| format!("{e:#}")))
            })
        };
        let (refused, resolved) = open_unprivileged(object.host_path.clone());
        assert_eq!(refused, Some(Some(libc::EPERM)), "map_files is closed to this thread");
        assert_eq!(resolved.expect("read by its path"), ElfFile::open(&libc).unwrap().resolve("getpid").unwrap());
        // Replaced by a copy: the same bytes, another inode.
        let twin = dir.path().join("twin");
        std::fs::copy(&copy, &twin).expect("copy");
        std::fs::rename(&twin, &copy).expect("replace");
        let err = open_unprivileged(object.host_path.clone()).1.expect_err("refused");
        assert!(err.contains("libreplaced.so (deleted) mapped by pid"), "{err}");
        assert!(
            err.contains("is not the file mapped") && err.contains("replaced or deleted after it was mapped"),
            "{err}"
        );
        // By a symlink to /dev/zero.
        std::fs::remove_file(&copy).expect("remove");
        std::os::unix::fs::symlink("/dev/zero", &copy).expect("symlink");
        let err = open_unprivileged(object.host_path).1.expect_err("refused");
        assert!(err.contains("it is a character device, not a regular file"), "{err}");
    }
}
