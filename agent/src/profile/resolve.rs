//! Finding a probe's target in a live process: which mapped file a profile's
//! `object` names (through `/proc/PID/maps`, opened through
//! `/proc/PID/root` so containers' own paths work from the host), where the
//! symbol sits in that file, and what its first instruction costs to probe.
use std::{
    collections::BTreeSet,
    fmt,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, anyhow, bail};
use object::{Object as _, ObjectSection as _, ObjectSymbol as _, SymbolKind};

/// A file mapped into the target process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedObject {
    /// The path as the target sees it (in its mount namespace).
    pub path: PathBuf,
    /// The same file reached from here: `/proc/PID/root/<path>`.
    pub host_path: PathBuf,
}

/// The files a process has mapped, and its main executable.
#[derive(Debug, Clone)]
pub struct ProcessImage {
    pub pid: u32,
    pub exe: PathBuf,
    pub mapped: Vec<PathBuf>,
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
            } else {
                anyhow!(err).context(format!("reading /proc/{pid}/exe (is pid {pid} a kernel thread?)"))
            }
        })?;
        Ok(Self { pid, exe, mapped: parse_maps(&maps) })
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
        let path = match object {
            None => self.exe.clone(),
            Some(name) if name.starts_with('/') => self
                .mapped
                .iter()
                .find(|path| path.as_os_str() == name)
                .cloned()
                .ok_or_else(|| self.not_mapped(name))?,
            Some(name) => {
                let matches: Vec<_> = self.mapped.iter().filter(|path| object_matches(path, name)).collect();
                match matches.as_slice() {
                    [one] => (*one).clone(),
                    [] => return Err(self.not_mapped(name)),
                    many => bail!(
                        "`{name}` matches {} files mapped by pid {}: {}; give the full path as `object`, \
                         or the file's last directories too (`pkg/{name}`)",
                        many.len(),
                        self.pid,
                        many.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
                    ),
                }
            }
        };
        let host_path = host_path(self.pid, &path);
        Ok(MappedObject { path, host_path })
    }

    fn not_mapped(&self, name: &str) -> anyhow::Error {
        let mut libs: Vec<_> =
            self.mapped.iter().filter_map(|p| p.file_name()?.to_str()).filter(|n| n.contains(".so")).collect();
        libs.sort_unstable();
        libs.dedup();
        anyhow!(
            "pid {} ({}) has no file `{name}` mapped: it is not loaded (yet), or the name differs; \
             mapped libraries: {}",
            self.pid,
            self.exe.display(),
            if libs.is_empty() { "none".to_owned() } else { libs.join(", ") }
        )
    }
}

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

fn host_path(pid: u32, path: &Path) -> PathBuf {
    let relative = path.strip_prefix("/").unwrap_or(path);
    PathBuf::from(format!("/proc/{pid}/root")).join(relative)
}

/// Distinct file paths in `/proc/PID/maps`.
fn parse_maps(maps: &[u8]) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStrExt as _;
    let paths: BTreeSet<PathBuf> = maps
        .split(|&b| b == b'\n')
        .filter_map(|line| {
            // address perms offset dev inode path: the path is the sixth
            // field and may contain spaces.
            let path = line.splitn(6, |&b| b == b' ').nth(5)?.trim_ascii_start();
            let path = path.strip_suffix(b" (deleted)").unwrap_or(path);
            path.starts_with(b"/").then(|| PathBuf::from(std::ffi::OsStr::from_bytes(path)))
        })
        .collect();
    paths.into_iter().collect()
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

/// Where each probe of `profile` would land in process `pid`, and what the
/// kernel does with the instruction there (`stallwatch profile check
/// --pid`): every lifecycle probe, signal and transport probe, in profile
/// order, as (profile line, symbol, object, where or why not).
pub fn probe_points(profile: &super::Profile, pid: u32) -> Result<Vec<ProbePoint>> {
    let image = ProcessImage::read(pid)?;
    let mut files: std::collections::HashMap<PathBuf, Result<ElfFile, String>> = std::collections::HashMap::new();
    let targets = profile
        .probes
        .iter()
        .map(|p| (p.line, &p.symbol, &p.object))
        .chain(profile.signals.iter().map(|s| (s.line, &s.symbol, &s.object)))
        .chain(profile.activity.iter().map(|a| (a.line, &a.symbol, &a.object)));
    let mut points = Vec::new();
    for (line, symbol, object) in targets {
        let found = image.find(object.as_deref()).map_err(|err| format!("{err:#}")).and_then(|mapped| {
            let elf = files
                .entry(mapped.host_path.clone())
                .or_insert_with(|| ElfFile::open(&mapped.host_path).map_err(|err| format!("{err:#}")));
            let elf = elf.as_ref().map_err(Clone::clone)?;
            elf.resolve(symbol).map(|resolved| (mapped.path, resolved)).map_err(|err| format!("{err:#}"))
        });
        points.push(ProbePoint { line, symbol: symbol.clone(), object: object.clone(), found });
    }
    Ok(points)
}

/// One probe of a profile, resolved in a process (see [`probe_points`]).
#[derive(Debug)]
pub struct ProbePoint {
    pub line: usize,
    pub symbol: String,
    pub object: Option<String>,
    /// The mapped file and where in it, or why it was not found.
    pub found: Result<(PathBuf, ResolvedSymbol), String>,
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

/// An ELF file read once and queried for many symbols.
pub struct ElfFile {
    path: PathBuf,
    data: Vec<u8>,
}

impl ElfFile {
    pub fn open(path: &Path) -> Result<Self> {
        let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        object::File::parse(&*data).with_context(|| format!("{} is not an ELF file aya can read", path.display()))?;
        Ok(Self { path: path.to_owned(), data })
    }

    /// The file's GNU build id, lowercase hex (`None`: it has none).
    pub fn build_id(&self) -> Result<Option<String>> {
        let file = object::File::parse(&*self.data).with_context(|| format!("parsing {}", self.path.display()))?;
        let id = file.build_id().with_context(|| format!("reading the build id of {}", self.path.display()))?;
        Ok(id.map(|bytes| bytes.iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// Look `symbol` up in `.symtab` and `.dynsym` (mangled names as they
    /// are in the file).
    pub fn resolve(&self, symbol: &str) -> Result<ResolvedSymbol> {
        let file = object::File::parse(&*self.data).with_context(|| format!("parsing {}", self.path.display()))?;
        let found = file
            .symbols()
            .chain(file.dynamic_symbols())
            .find(|sym| sym.name_bytes().is_ok_and(|name| name == symbol.as_bytes()) && sym.is_definition());
        let Some(sym) = found else {
            return Err(self.not_found(&file, symbol));
        };
        if sym.kind() != SymbolKind::Text {
            bail!("`{symbol}` in {} is a {:?} symbol, not a function", self.path.display(), sym.kind());
        }
        let section_index =
            sym.section_index().ok_or_else(|| anyhow!("`{symbol}` in {} has no section", self.path.display()))?;
        let section = file.section_by_index(section_index)?;
        let (section_offset, section_size) = section
            .file_range()
            .ok_or_else(|| anyhow!("section of `{symbol}` in {} has no file data", self.path.display()))?;
        let within = sym
            .address()
            .checked_sub(section.address())
            .filter(|within| *within < section_size)
            .ok_or_else(|| anyhow!("`{symbol}` in {} lies outside its section", self.path.display()))?;
        let start = usize::try_from(section_offset + within)?;
        let function = self.data.get(start..).unwrap_or_default();
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
            file_offset: section_offset + within + skipped as u64,
            skipped: skipped as u64,
            first_insn: FirstInsn::classify(available.get(..8).unwrap_or(available)),
            first_bytes,
        })
    }

    fn not_found(&self, file: &object::File<'_>, symbol: &str) -> anyhow::Error {
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
            return anyhow!("symbol `{shown}` not found: {} has no function symbols (stripped?)", self.path.display());
        }
        let hint = match suggestions(symbol, &names) {
            Suggestions::Close(close) if !close.is_empty() => format!("; did you mean: {}", close.join(", ")),
            Suggestions::Close(_) => String::new(),
            Suggestions::TooLong => format!(
                "; no suggestions for a name of {} bytes (function names are rarely longer than {MAX_SUGGESTED_LEN})",
                symbol.len()
            ),
        };
        anyhow!("symbol `{shown}` not found in {} ({} function symbols){hint}", self.path.display(), names.len())
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
    fn maps_paths_are_distinct_and_keep_spaces() {
        let maps = b"\
55d0c-55d0d r--p 00000000 08:01 1234 /usr/bin/demo prefill
55d0d-55d0e r-xp 00001000 08:01 1234 /usr/bin/demo prefill
7f00-7f01 r-xp 00000000 08:01 99 /lib/libnixl.so (deleted)
7f01-7f02 rw-p 00000000 00:00 0 
7ffd-7ffe rw-p 00000000 00:00 0 [stack]
7f02-7f03 r-xp 00000000 08:01 98 /lib/lib\xff.so
";
        assert_eq!(
            parse_maps(maps),
            vec![
                PathBuf::from("/lib/libnixl.so"),
                PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b"/lib/lib\xff.so")),
                PathBuf::from("/usr/bin/demo prefill")
            ]
        );
    }

    #[test]
    fn object_names_match_basename_and_versions() {
        let image = ProcessImage {
            pid: 1,
            exe: "/bin/x".into(),
            mapped: vec!["/bin/x".into(), "/a/libnixl.so.0".into(), "/a/libnixl_ucx.so".into()],
        };
        assert_eq!(image.find(Some("libnixl.so")).unwrap().path, PathBuf::from("/a/libnixl.so.0"));
        assert_eq!(image.find(None).unwrap().host_path, PathBuf::from("/proc/1/root/bin/x"));
        let wheel = ProcessImage { mapped: vec!["/w/nixl_cu12.libs/libucp-b39b3ed9.so.0.0.0".into()], ..image.clone() };
        assert_eq!(
            wheel.find(Some("libucp.so")).unwrap().path,
            PathBuf::from("/w/nixl_cu12.libs/libucp-b39b3ed9.so.0.0.0")
        );
        assert!(wheel.find(Some("libucp-b39b3ed9.so")).is_err(), "profiles name the library, not one build of it");
        let packaged = ProcessImage {
            mapped: vec![
                "/v/site-packages/mooncake/engine.so".into(),
                "/v/site-packages/other/engine.so".into(),
                "/v/site-packages/notmooncake/engine.so".into(),
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
}
