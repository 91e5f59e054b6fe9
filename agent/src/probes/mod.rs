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
    maps::{Array, MapData, PerCpuArray},
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
    },
};
use stallwatch_common::{MAX_SLOTS, SlotConfig, counter};
use tracing::info;

pub use self::profile::{At, Profile, ProbeSpec};
use self::resolve::{ElfFile, FirstInsn, ProcessImage};

/// The eBPF object built by `build.rs`.
pub fn ebpf_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/stallwatch"))
}

const ENTRY_PROGRAM: &str = "lifecycle_entry";
const RETURN_PROGRAM: &str = "lifecycle_return";

/// One attached probe: what the event decoder needs to know of a slot.
#[derive(Debug, Clone)]
pub struct Slot {
    pub pid: u32,
    pub spec: Arc<ProbeSpec>,
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
        Ok(Self { ebpf, slots_map, counters, hits, slots: Vec::new(), links: HashMap::new() })
    }

    /// The loaded object, for taking its ring buffer and log maps.
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    /// Attach every probe of `profile` to `pid`. All or nothing: on error the
    /// probes already attached for this call are detached again.
    pub fn attach(&mut self, pid: u32, profile: &Profile) -> Result<Vec<Slot>> {
        let image = ProcessImage::read(pid)?;
        let first_new = self.slots.len();
        let result = self.attach_all(&image, profile);
        if result.is_err() {
            self.detach_from(pid, first_new);
        }
        result.with_context(|| format!("attaching profile {} to pid {pid}", profile.origin))?;
        Ok(self.slots[first_new..].to_vec())
    }

    fn attach_all(&mut self, image: &ProcessImage, profile: &Profile) -> Result<()> {
        let mut files: HashMap<PathBuf, ElfFile> = HashMap::new();
        let pid = image.pid;
        let scope = UProbeScope::OneProcess(NonZeroU32::new(pid).ok_or_else(|| anyhow!("pid 0 is not a process"))?);
        for spec in &profile.probes {
            let object = image.find(spec.object.as_deref())?;
            let elf = match files.entry(object.host_path.clone()) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(ElfFile::open(&object.host_path)?),
            };
            let resolved = elf
                .resolve(&spec.symbol)
                .with_context(|| format!("profile {}, line {}", profile.origin, spec.line))?;
            let index = u32::try_from(self.slots.len())?;
            if index >= MAX_SLOTS {
                bail!("all {MAX_SLOTS} probe slots are in use: watch fewer processes per agent");
            }
            let cfg = spec.slot_config(profile.tracks_last());
            self.slots_map.set(index, cfg, 0).context("writing the slot config map")?;
            self.slots.push(Slot {
                pid,
                spec: Arc::new(spec.clone()),
                object: object.path.clone(),
                file_offset: resolved.file_offset,
                first_insn: resolved.first_insn,
            });
            let mut programs = Vec::new();
            if spec.at == At::Entry || cfg.flags & stallwatch_common::slot_flags::NEEDS_ARGS != 0 {
                programs.push(ENTRY_PROGRAM);
            }
            if spec.at == At::Return {
                programs.push(RETURN_PROGRAM);
            }
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
                        spec.symbol,
                        resolved.file_offset,
                        object.path.display()
                    )
                })?;
                self.links.entry(pid).or_default().push((name, link));
            }
            info!(
                pid,
                symbol = %spec.symbol,
                object = %object.path.display(),
                offset = format_args!("{:#x}", resolved.file_offset),
                at = ?spec.at,
                first_insn = %resolved.first_insn,
                "probe attached"
            );
        }
        Ok(())
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
        })
    }

    /// Hits of one slot over all CPUs.
    pub fn hits(&self, index: u32) -> Result<u64> {
        Ok(self.hits.get(&index, 0).context("reading the HITS map")?.iter().sum())
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
