//! Probe profiles and attaching them to processes.
//!
//! One eBPF object holds two generic programs (`lifecycle_entry`,
//! `lifecycle_return`). Each probe of a profile attached to a pid becomes a
//! *slot*: a [`SlotConfig`] written to the `SLOTS` map at the slot's index,
//! and one or two uprobe attachments whose cookie is that index.
pub mod profile;
pub mod resolve;

use std::{collections::HashMap, num::NonZeroU32, path::PathBuf, sync::Arc};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Ebpf,
    Btf,
    maps::{Array, MapData, PerCpuArray, RingBuf},
    programs::{
        BtfTracePoint, UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
    },
};
use stallwatch_common::{MAX_SLOTS, SlotConfig, counter, slot_flags};
use tracing::info;

pub use self::profile::{ActivityKind, ActivitySpec, At, Profile, ProbeSpec};
use self::resolve::{ElfFile, FirstInsn, ProcessImage};

/// The eBPF object built by `build.rs`.
pub fn ebpf_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/stallwatch"))
}

const ENTRY_PROGRAM: &str = "lifecycle_entry";
const RETURN_PROGRAM: &str = "lifecycle_return";
const EXEC_PROGRAM: &str = "process_exec";

/// What a slot's hits mean.
#[derive(Debug, Clone)]
pub enum Role {
    /// Hits are lifecycle events, per the probe spec.
    Lifecycle(Arc<ProbeSpec>),
    /// Hits are counted as transport activity of this kind.
    Activity(ActivityKind),
}

/// One attached probe: what the event decoder needs to know of a slot.
#[derive(Debug, Clone)]
pub struct Slot {
    pub pid: u32,
    pub role: Role,
    pub symbol: String,
    pub object: PathBuf,
    pub file_offset: u64,
    pub first_insn: FirstInsn,
}

/// The loaded eBPF object, its slots and their attachments.
pub struct Probes {
    ebpf: Ebpf,
    slots_map: Array<MapData, SlotConfig>,
    counters: PerCpuArray<MapData, u64>,
    hits: PerCpuArray<MapData, u64>,
    seen: PerCpuArray<MapData, u64>,
    slots: Vec<Slot>,
    links: HashMap<u32, Vec<(&'static str, UProbeLinkId)>>,
}

impl Probes {
    /// Load the eBPF object into the kernel and its programs through the
    /// verifier.
    pub fn load() -> Result<Self> {
        raise_memlock_limit();
        let mut ebpf = Ebpf::load(ebpf_object()).context(
            "loading the eBPF object into the kernel failed: stallwatch needs root (CAP_BPF and \
             CAP_PERFMON) and a kernel with BPF ring buffers (5.8+)",
        )?;
        for name in [ENTRY_PROGRAM, RETURN_PROGRAM] {
            let program: &mut UProbe = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("the eBPF object has no program `{name}`"))?
                .try_into()?;
            program.load().with_context(|| format!("the kernel verifier rejected `{name}`"))?;
        }
        let slots_map = Array::try_from(take_map(&mut ebpf, "SLOTS")?)?;
        let counters = PerCpuArray::try_from(take_map(&mut ebpf, "COUNTERS")?)?;
        let hits = PerCpuArray::try_from(take_map(&mut ebpf, "HITS")?)?;
        let seen = PerCpuArray::try_from(take_map(&mut ebpf, "SEEN")?)?;
        Ok(Self { ebpf, slots_map, counters, hits, seen, slots: Vec::new(), links: HashMap::new() })
    }

    /// The loaded object, for taking its ring buffer and log maps.
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    /// Attach every probe of `profile` to `pid`. All or nothing: on error the
    /// probes already attached for this call are detached again.
    /// Returns how many probes were attached (optional transport probes
    /// whose library or symbol is missing are skipped).
    pub fn attach(&mut self, pid: u32, profile: &Profile) -> Result<usize> {
        let image = ProcessImage::read(pid)?;
        let first_new = self.slots.len();
        let result = self.attach_all(&image, profile);
        if result.is_err() {
            self.detach_from(pid, first_new);
        }
        result.with_context(|| format!("attaching profile {} to pid {pid}", profile.origin))?;
        Ok(self.slots.len() - first_new)
    }

    fn attach_all(&mut self, image: &ProcessImage, profile: &Profile) -> Result<()> {
        let mut files = ElfCache::default();
        let track_last = profile.tracks_last();
        for spec in &profile.probes {
            let cfg = spec.slot_config(track_last);
            let target = Target { object: spec.object.as_deref(), symbol: &spec.symbol, line: spec.line };
            self.attach_slot(image, &mut files, profile, &target, cfg, Role::Lifecycle(Arc::new(spec.clone())))?;
        }
        for spec in &profile.activity {
            let target = Target { object: spec.object.as_deref(), symbol: &spec.symbol, line: spec.line };
            let attached =
                self.attach_slot(image, &mut files, profile, &target, ActivitySpec::slot_config(), Role::Activity(spec.kind));
            match attached {
                Err(err) if spec.optional && err.downcast_ref::<Unresolved>().is_some() => {
                    info!(pid = image.pid, symbol = %spec.symbol, reason = %err, "optional transport probe skipped");
                }
                other => other?,
            }
        }
        Ok(())
    }

    /// Resolve one probe, write its slot config, attach its program(s).
    fn attach_slot(
        &mut self,
        image: &ProcessImage,
        files: &mut ElfCache,
        profile: &Profile,
        target: &Target<'_>,
        cfg: SlotConfig,
        role: Role,
    ) -> Result<()> {
        let pid = image.pid;
        let object = image.find(target.object).map_err(|err| Unresolved(format!("{err:#}")))?;
        let resolved = files
            .open(&object.host_path)?
            .resolve(target.symbol)
            .map_err(|err| Unresolved(format!("profile {}, line {}: {err:#}", profile.origin, target.line)))?;
        let index = u32::try_from(self.slots.len())?;
        if index >= MAX_SLOTS {
            bail!("all {MAX_SLOTS} probe slots are in use: watch fewer processes per agent");
        }
        self.slots_map.set(index, cfg, 0).context("writing the slot config map")?;
        let at = match &role {
            Role::Lifecycle(spec) => spec.at,
            Role::Activity(_) => At::Entry,
        };
        self.slots.push(Slot {
            pid,
            role,
            symbol: target.symbol.to_owned(),
            object: object.path.clone(),
            file_offset: resolved.file_offset,
            first_insn: resolved.first_insn,
        });
        let mut programs = Vec::new();
        if at == At::Entry || cfg.flags & slot_flags::NEEDS_ARGS != 0 {
            programs.push(ENTRY_PROGRAM);
        }
        if at == At::Return {
            programs.push(RETURN_PROGRAM);
        }
        let scope = UProbeScope::OneProcess(NonZeroU32::new(pid).ok_or_else(|| anyhow!("pid 0 is not a process"))?);
        for name in programs {
            let program: &mut UProbe = self
                .ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("the eBPF object has no program `{name}`"))?
                .try_into()?;
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(resolved.file_offset),
                cookie: Some(u64::from(index)),
            };
            let link = program.attach(point, &object.host_path, scope).with_context(|| {
                format!(
                    "attaching a uprobe to `{}` at {:#x} in {} for pid {pid}",
                    target.symbol,
                    resolved.file_offset,
                    object.path.display()
                )
            })?;
            self.links.entry(pid).or_default().push((name, link));
        }
        info!(
            pid,
            symbol = %target.symbol,
            object = %object.path.display(),
            offset = format_args!("{:#x}", resolved.file_offset),
            at = ?at,
            first_insn = %resolved.first_insn,
            "probe attached"
        );
        Ok(())
    }

    /// Start hearing of every exec on the host (process discovery): loads
    /// and attaches the `sched_process_exec` BTF tracepoint and hands over
    /// the ring buffer of exec'd pids.
    pub fn watch_execs(&mut self) -> Result<RingBuf<MapData>> {
        let btf = Btf::from_sys_fs().context(
            "reading the kernel's BTF (/sys/kernel/btf/vmlinux) for the exec tracepoint: discovery needs a kernel \
             with CONFIG_DEBUG_INFO_BTF; use --pid instead",
        )?;
        let program: &mut BtfTracePoint = self
            .ebpf
            .program_mut(EXEC_PROGRAM)
            .ok_or_else(|| anyhow!("the eBPF object has no program `{EXEC_PROGRAM}`"))?
            .try_into()?;
        program.load("sched_process_exec", &btf).context("the kernel verifier rejected the exec tracepoint")?;
        program.attach().context("attaching to the sched_process_exec tracepoint")?;
        RingBuf::try_from(take_map(&mut self.ebpf, "EXECS")?).context("EXECS is not a ring buffer")
    }

    /// Detach every probe of `pid` (the process exited or stopped matching).
    pub fn detach(&mut self, pid: u32) {
        self.detach_from(pid, 0);
    }

    fn detach_from(&mut self, pid: u32, first_slot: usize) {
        for (name, link) in self.links.remove(&pid).unwrap_or_default() {
            if let Some(Ok(program)) = self.ebpf.program_mut(name).map(<&mut UProbe>::try_from) {
                // The process may be gone already, which removes the probe.
                let _ = program.detach(link);
            }
        }
        for (index, slot) in self.slots.iter().enumerate().skip(first_slot) {
            if slot.pid == pid {
                let _ = self.slots_map.set(index as u32, SlotConfig::default(), 0);
            }
        }
        // Slots are not reused: an event still in the ring buffer must not
        // be decoded with a successor's config.
    }

    pub fn slot(&self, index: u32) -> Option<&Slot> {
        self.slots.get(index as usize)
    }

    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Sums of the kernel-side [`counter`]s over all CPUs.
    pub fn counters(&self) -> Result<KernelCounters> {
        let sum = |index| -> Result<u64> {
            Ok(self.counters.get(&index, 0).context("reading the COUNTERS map")?.iter().sum())
        };
        Ok(KernelCounters {
            ringbuf_full: sum(counter::RINGBUF_FULL)?,
            read_failed: sum(counter::READ_FAILED)?,
            args_missing: sum(counter::ARGS_MISSING)?,
            no_slot: sum(counter::NO_SLOT)?,
            unchanged: sum(counter::UNCHANGED)?,
            exec_lost: sum(counter::EXEC_LOST)?,
        })
    }

    /// Hits of one slot over all CPUs.
    pub fn hits(&self, index: u32) -> Result<u64> {
        Ok(self.hits.get(&index, 0).context("reading the HITS map")?.iter().sum())
    }

    /// Every slot's hits, for the summary.
    pub fn probe_hits(&self) -> Result<Vec<ProbeHits>> {
        self.slots
            .iter()
            .enumerate()
            .map(|(index, slot)| {
                let role = match &slot.role {
                    Role::Lifecycle(_) => "lifecycle",
                    Role::Activity(kind) => kind.as_str(),
                };
                Ok(ProbeHits { pid: slot.pid, symbol: slot.symbol.clone(), role, hits: self.hits(index as u32)? })
            })
            .collect()
    }

    /// When a transport-activity slot was last hit, on any CPU.
    pub fn last_hit(&self, index: u32) -> Result<Option<u64>> {
        let latest = self.seen.get(&index, 0).context("reading the SEEN map")?.iter().copied().max();
        Ok(latest.filter(|&ns| ns > 0))
    }
}

/// One probe's hit count, for the summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeHits {
    pub pid: u32,
    pub symbol: String,
    /// `lifecycle`, or the activity kind.
    pub role: &'static str,
    pub hits: u64,
}

/// Where one probe goes, for [`Probes::attach_slot`].
struct Target<'a> {
    object: Option<&'a str>,
    symbol: &'a str,
    line: usize,
}

/// The probe's object is not mapped or has no such symbol: fatal for a
/// lifecycle probe, a logged skip for an optional transport probe.
#[derive(Debug)]
struct Unresolved(String);

impl std::fmt::Display for Unresolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unresolved {}

/// ELF files read once per attach call, shared by the probes in them.
#[derive(Default)]
struct ElfCache(HashMap<PathBuf, ElfFile>);

impl ElfCache {
    fn open(&mut self, path: &std::path::Path) -> Result<&ElfFile> {
        match self.0.entry(path.to_owned()) {
            std::collections::hash_map::Entry::Occupied(entry) => Ok(entry.into_mut()),
            std::collections::hash_map::Entry::Vacant(entry) => Ok(entry.insert(ElfFile::open(path)?)),
        }
    }
}

/// What the kernel side could not do, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelCounters {
    /// Events lost because the ring buffer was full.
    pub ringbuf_full: u64,
    /// Keys or external ids that could not be read from the target.
    pub read_failed: u64,
    /// Return hits whose entry arguments were not saved.
    pub args_missing: u64,
    /// Hits on unconfigured slots.
    pub no_slot: u64,
    /// Status returns suppressed because nothing changed (expected).
    pub unchanged: u64,
    /// Exec notifications lost; discovery's rescans catch those processes.
    pub exec_lost: u64,
}

impl KernelCounters {
    /// Events the agent will never see: these must be reported.
    pub fn lost(&self) -> u64 {
        self.ringbuf_full + self.read_failed + self.args_missing + self.no_slot
    }
}

fn take_map(ebpf: &mut Ebpf, name: &str) -> Result<aya::maps::Map> {
    ebpf.take_map(name).ok_or_else(|| anyhow!("the eBPF object has no map `{name}`"))
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK; lift it so the
/// ring buffer fits. Newer kernels ignore it, so failure is only logged.
fn raise_memlock_limit() {
    let limit = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: setrlimit reads the struct we pass and nothing else.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) } != 0 {
        tracing::debug!("could not raise RLIMIT_MEMLOCK: {}", std::io::Error::last_os_error());
    }
}
