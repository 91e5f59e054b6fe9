//! The two lifecycle programs every probe is linked to, verified once per
//! build rather than once per agent.
//!
//! The kernel's verifier takes 1 to 2.3 s over `lifecycle_entry` on this
//! 2-core host (its msgpack, pickle and string walkers), nearly all of an
//! agent's start-up: a restarted agent (a DaemonSet's rolling update, an
//! OOM kill) would report its held requests' stalls that much late. So an
//! agent with a bpf directory pins the programs it loaded under its eBPF
//! object's id, and the next agent of the same build takes them over
//! instead of loading its own: no verifier pass, the same maps (pinned as
//! well, see [`PINNED_MAPS`]), watching within milliseconds. Programs
//! whose maps are not the ones pinned now (the maps were removed and made
//! again) are never taken over: their events would go where nobody reads.
use std::{path::Path, time::Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Ebpf,
    maps::{MapInfo, ProgramArray},
    programs::{ProbeKind, UProbe},
};
use tracing::{info, warn};

use super::state::{BpfDir, PINNED_MAPS};

/// The entry program: every entry probe, and the entry half of a return
/// probe that needs the call's arguments.
pub const ENTRY: &str = "lifecycle_entry";
/// The return program.
pub const RETURN: &str = "lifecycle_return";
/// The entry program's map of programs, for chains (see [`chain_entry`]).
const CHAIN: &str = "CHAIN";

/// Where the agent's lifecycle programs came from.
pub enum Programs {
    /// Loaded through the verifier now, and held by the [`Ebpf`] object.
    Loaded,
    /// A previous agent's of this very build, pinned in the bpf directory.
    TakenOver(Box<Pinned>),
}

/// The two programs a previous agent pinned.
pub struct Pinned {
    entry: UProbe,
    ret: UProbe,
}

impl Programs {
    /// The programs of `ebpf` (loaded with the maps pinned in `dir`): a
    /// previous agent's of the same object when `dir` holds them, else
    /// loaded now and, with `dir`, pinned there for the next agent. Failing
    /// to take over or to pin is warned, never fatal: the programs are then
    /// verified again next time, that is all.
    pub fn load(ebpf: &mut Ebpf, object: &[u8], dir: Option<&BpfDir>) -> Result<Self> {
        let build = build_id(object);
        let pins = match dir.map(|dir| dir.program_dir(&build)).transpose() {
            Ok(pins) => pins,
            Err(err) => {
                warn!("the pinned eBPF programs cannot be kept; the next agent verifies them again: {err:#}");
                None
            }
        };
        if let Some((pins, dir)) = pins.as_deref().zip(dir) {
            match take_over(pins, dir) {
                Ok(Some(programs)) => {
                    info!(build = %build, "eBPF programs taken over from a previous agent of this build (no verifier pass)");
                    return Ok(programs);
                }
                Ok(None) => {}
                Err(err) => warn!(
                    path = %pins.display(),
                    "not taking over the pinned eBPF programs; verifying them again: {err:#}"
                ),
            }
        }
        let started = Instant::now();
        verify_together(ebpf)?;
        chain_entry(ebpf)?;
        if let Some(pins) = &pins {
            // The chain's map first: a program pinned without it is never
            // taken over (see `take_over`).
            let path = pins.join(CHAIN);
            let _ = std::fs::remove_file(&path);
            let chain = ebpf.map(CHAIN).ok_or_else(|| anyhow!("the eBPF object has no map `{CHAIN}`"))?;
            match chain.pin(&path) {
                Ok(()) => {
                    for name in [ENTRY, RETURN] {
                        // A pin left by a run that failed half-way is replaced.
                        let path = pins.join(name);
                        let _ = std::fs::remove_file(&path);
                        if let Err(err) = object_program(ebpf, name)?.pin(&path) {
                            warn!(path = %path.display(), "pinning an eBPF program for the next agent: {err}");
                        }
                    }
                }
                Err(err) => warn!(path = %path.display(), "pinning an eBPF map for the next agent: {err}"),
            }
        }
        info!(
            build = %build,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "eBPF programs verified and loaded"
        );
        Ok(Self::Loaded)
    }

    /// Program `name` ([`ENTRY`] or [`RETURN`]), to link a probe to.
    pub fn get_mut<'a>(&'a mut self, ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
        match (self, name) {
            (Self::TakenOver(pinned), ENTRY) => Ok(&mut pinned.entry),
            (Self::TakenOver(pinned), RETURN) => Ok(&mut pinned.ret),
            _ => object_program(ebpf, name),
        }
    }
}

/// Load both programs through the verifier, each on a thread of its own:
/// the verifier runs in the loading thread, one program at a time, so on
/// a host with two cores the two take as long as the longer one instead
/// of both (the entry program's pass is ~60 % of the whole).
fn verify_together(ebpf: &mut Ebpf) -> Result<()> {
    let programs: Vec<(&str, &mut UProbe)> = ebpf
        .programs_mut()
        .filter(|(name, _)| [ENTRY, RETURN].contains(name))
        .map(|(name, program)| Ok((name, <&mut UProbe>::try_from(program)?)))
        .collect::<Result<_>>()?;
    if programs.len() != 2 {
        bail!("the eBPF object lacks `{ENTRY}` or `{RETURN}`");
    }
    std::thread::scope(|scope| {
        let loads: Vec<_> = programs
            .into_iter()
            .map(|(name, program)| {
                let load = move || program.load().with_context(|| format!("the kernel verifier rejected `{name}`"));
                (name, std::thread::Builder::new().name(format!("verify-{name}")).spawn_scoped(scope, load))
            })
            .collect();
        loads.into_iter().try_for_each(|(name, load)| {
            let load = load.with_context(|| format!("starting the thread that loads `{name}`"))?;
            load.join().map_err(|_| anyhow!("loading `{name}` panicked"))?
        })
    })
}

/// The entry program's own map of programs (`CHAIN`, one entry: the
/// entry program), through which a hit goes on to the next slot of a
/// chain (the slots of one function's entry on one link,
/// [`SlotConfig::next`](stallwatch_common::SlotConfig::next)). Its entry
/// stays while the map is held: by the agent's [`Ebpf`], and pinned with
/// the programs (a map of programs no one holds is emptied, and the
/// chains of the pinned programs with it).
fn chain_entry(ebpf: &mut Ebpf) -> Result<()> {
    let entry = object_program(ebpf, ENTRY)?.fd()?.try_clone().context("duplicating the entry program's fd")?;
    let map = ebpf.map_mut(CHAIN).ok_or_else(|| anyhow!("the eBPF object has no map `{CHAIN}`"))?;
    ProgramArray::try_from(map)?.set(0, &entry, 0).context("putting the entry program in its chain map")?;
    Ok(())
}

/// Program `name` of the eBPF object.
fn object_program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    Ok(ebpf.program_mut(name).ok_or_else(|| anyhow!("the eBPF object has no program `{name}`"))?.try_into()?)
}

/// The programs pinned in `pins`, if both are there and use the maps
/// pinned in `dir` now.
fn take_over(pins: &Path, dir: &BpfDir) -> Result<Option<Programs>> {
    let (entry, ret) = (pins.join(ENTRY), pins.join(RETURN));
    if !entry.exists() || !ret.exists() || !pins.join(CHAIN).exists() {
        return Ok(None);
    }
    let entry = UProbe::from_pin(&entry, ProbeKind::Entry).with_context(|| format!("opening {}", entry.display()))?;
    let ret = UProbe::from_pin(&ret, ProbeKind::Return).with_context(|| format!("opening {}", ret.display()))?;
    for program in [&entry, &ret] {
        let ids = program.info()?.map_ids()?.ok_or_else(|| anyhow!("the kernel does not list a program's maps"))?;
        for id in ids {
            let map = MapInfo::from_id(id).with_context(|| format!("reading map {id} of a pinned program"))?;
            let Some(name) = map.name_as_str().filter(|name| PINNED_MAPS.contains(name)) else {
                continue;
            };
            let pinned =
                MapInfo::from_pin(dir.map_path(name)).with_context(|| format!("reading the pinned map {name}"))?.id();
            if pinned != id {
                warn!(map = name, "the pinned eBPF programs use another copy of a map than the one pinned now");
                return Ok(None);
            }
        }
    }
    Ok(Some(Programs::TakenOver(Box::new(Pinned { entry, ret }))))
}

/// The eBPF object's id: FNV-1a of its bytes, in hex. Stable across
/// builds of the agent that embed the same object (unlike std's hasher,
/// whose algorithm may change between Rust releases).
fn build_id(object: &[u8]) -> String {
    let hash = object
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, &byte| (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3));
    format!("{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_id_is_fnv_1a_of_the_object() {
        // FNV-1a's published test vectors.
        assert_eq!(build_id(b""), "cbf29ce484222325");
        assert_eq!(build_id(b"a"), "af63dc4c8601ec8c");
        assert_ne!(build_id(b"object one"), build_id(b"object two"));
    }
}
