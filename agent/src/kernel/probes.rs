//! Probe profiles and attaching them to processes.
//!
//! One eBPF object holds two generic programs (`lifecycle_entry`,
//! `lifecycle_return`). Each probe of a profile attached to a pid becomes a
//! *slot*: a [`SlotConfig`] written to the `SLOTS` map at the slot's index,
//! and one or two uprobe attachments whose cookie is that index, except
//! that the entry halves of one function's slots share one attachment (the
//! first slot's cookie; each names the next, [`SlotConfig::next`]), so a
//! hit of the function runs one program, not one a slot. Slots are
//! reused once their process is detached and its links are gone (dropped
//! off the event loop, see [`super::detach`]): events name their own
//! stage, so nothing in the ring buffer depends on what a slot meant.
//!
//! With a [`BpfDir`], the maps are pinned there (or taken over from a
//! previous agent) and every link is pinned as it is made, so the probes
//! outlive the agent; see [`crate::kernel::state`].
//!
//! Progress and post probes (`[[activity]]` of a kind that is
//! [`ActivityKind::near_stall_only`]) are the exception: the target calls
//! them thousands of times a transfer (progress) or once per descriptor
//! (posts), so they get their slot at attach time but are linked only
//! while the gate says so (a request of the process nears its stall, see
//! [`crate::evidence::gate`]), off the event loop ([`Probes::begin_opening`],
//! [`super::uprobe_link`]). Their links are never pinned: they belong to
//! this agent alone and go with it (the kernel drops an unpinned link when
//! its file descriptor closes, even on a crash), so a restart can neither
//! leak nor double one; the next agent opens its own gate when it needs to.

use std::{
    collections::{HashMap, HashSet},
    num::NonZeroU32,
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{Array, MapData, PerCpuArray, PerCpuValues, RingBuf},
    programs::{
        BtfTracePoint,
        links::{FdLink, PinnedLink},
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLink, UProbeScope},
    },
};
use stallwatch_common::{MAX_CHAIN, MAX_SLOTS, SlotConfig, cmp, counter, slot_flags};
use tracing::{debug, info, warn};

use super::{
    caps::{CAP_SYS_ADMIN, Caps},
    detach::{Detached, Detaching, Detachings, drop_all, drop_together},
    programs::{self, Programs},
    state::{BpfDir, BpfTables, KernelState, OldLink, PINNED_MAPS},
    uprobe_link::{Linked, Opening, Openings, UprobeLink},
};
use crate::profile::{
    ActivityKind, ActivitySpec, At, ProbeSpec, Profile, SignalSpec,
    plan::{Missing, Plan},
    resolve::FirstInsn,
};

/// The eBPF object built by `build.rs`.
pub fn ebpf_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/stallwatch"))
}

const ENTRY_PROGRAM: &str = programs::ENTRY;
const RETURN_PROGRAM: &str = programs::RETURN;
const EXEC_PROGRAM: &str = "process_exec";

/// What a slot's hits mean.
#[derive(Debug, Clone)]
pub enum Role {
    /// Hits are lifecycle events, per the probe spec.
    Lifecycle(Arc<ProbeSpec>),
    /// Hits are counted as transport activity of this kind.
    Activity(ActivityKind),
    /// Hits are signals for the consumer of this name.
    Signal(Arc<SignalSpec>),
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

/// A gated probe (progress, posts) of one process, resolved and given its
/// slot, linked only while its gate is open.
struct Gated {
    index: u32,
    host_path: PathBuf,
    file_offset: u64,
    link: Option<UprobeLink>,
}

/// One uprobe link; dropping it detaches the probe, unless it is pinned.
enum Link {
    Owned(UProbeLink),
    Pinned(PinnedLink),
}

impl Link {
    /// Remove its pin, if it has one (quick: a file removed), leaving the
    /// probe attached until what is returned is dropped (slow, see
    /// [`super::detach`]). `None`: the pin could not be removed, and the
    /// probe stays attached for the next agent (warned).
    fn unpin(self) -> Option<Box<dyn Send>> {
        match self {
            Self::Owned(link) => Some(Box::new(link)),
            Self::Pinned(link) => match link.unpin() {
                Ok(link) => Some(Box::new(link)),
                Err(err) => {
                    warn!("unpinning a probe link: {err}");
                    None
                }
            },
        }
    }
}

/// The loaded eBPF object, its slots and their attachments.
pub struct Probes {
    ebpf: Ebpf,
    /// The lifecycle programs probes are linked to.
    programs: Programs,
    slots_map: Array<MapData, SlotConfig>,
    counters: PerCpuArray<MapData, u64>,
    hits: PerCpuArray<MapData, u64>,
    seen: PerCpuArray<MapData, u64>,
    /// Indexed by slot; `None` for a free slot or one a previous agent's
    /// links still drive.
    slots: Vec<Option<Slot>>,
    /// Slots ready for reuse.
    free: Vec<u32>,
    links: HashMap<u32, Vec<Link>>,
    /// Per pid, its gated probes (progress, posts), linked only while its
    /// gate is open.
    gated: HashMap<u32, Vec<Gated>>,
    /// Openings of gates under way off the loop.
    openings: Openings,
    /// Processes gone whose links are being dropped off the loop.
    detachings: Detachings,
    /// Where the maps and links are pinned; `None`: nothing outlives us.
    dir: Option<BpfDir>,
    /// Links a previous agent left pinned, until ours replace them.
    old_links: Vec<OldLink>,
    /// The final counts of detached probes, for the summary (the newest
    /// [`MAX_SLOTS`]).
    retired: std::collections::VecDeque<ProbeHits>,
    /// [`SlotConfig::quiet_ns`] of `quiet` probes; 0 (the default) sends
    /// every event.
    quiet_ns: u64,
    /// Whether skipped optional probes were said (at info level): once an
    /// agent, since every process a profile watches on a node skips the
    /// same ones (a transport the node lacks); each process's at debug.
    skips_said: bool,
}

impl Probes {
    /// Load the eBPF object into the kernel and its programs through the
    /// verifier. With `dir`, the maps are the ones pinned there (a previous
    /// agent's, taken over) or are pinned there now, and links will be.
    pub fn load(dir: Option<BpfDir>) -> Result<Self> {
        raise_memlock_limit();
        let pins: Vec<(&str, PathBuf)> = match &dir {
            Some(dir) => PINNED_MAPS.iter().map(|name| (*name, dir.map_path(name))).collect(),
            None => Vec::new(),
        };
        let mut loader = EbpfLoader::new();
        for (name, path) in &pins {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader.load(ebpf_object()).with_context(|| {
            let stale = dir.as_ref().map_or_else(String::new, |dir| {
                format!(
                    "; if the maps pinned in {0} are another stallwatch build's, remove them with \
                     `stallwatch state clear --bpf-dir {0}`",
                    dir.path().display()
                )
            });
            format!(
                "loading the eBPF object into the kernel failed: stallwatch needs root (CAP_BPF and \
                 CAP_PERFMON) and a kernel with BPF ring buffers (5.8+){stale}"
            )
        })?;
        let programs = Programs::load(&mut ebpf, ebpf_object(), dir.as_ref())?;
        let slots_map = Array::try_from(take_map(&mut ebpf, "SLOTS")?)?;
        let counters = PerCpuArray::try_from(take_map(&mut ebpf, "COUNTERS")?)?;
        let hits = PerCpuArray::try_from(take_map(&mut ebpf, "HITS")?)?;
        let seen = PerCpuArray::try_from(take_map(&mut ebpf, "SEEN")?)?;
        let old_links = match &dir {
            Some(dir) => dir.links()?,
            None => Vec::new(),
        };
        let mut probes = Self {
            ebpf,
            programs,
            slots_map,
            counters,
            hits,
            seen,
            slots: Vec::new(),
            free: Vec::new(),
            quiet_ns: 0,
            skips_said: false,
            links: HashMap::new(),
            gated: HashMap::new(),
            openings: Openings::default(),
            detachings: Detachings::default(),
            dir,
            old_links,
            retired: std::collections::VecDeque::new(),
        };
        probes.reserve_old_slots()?;
        Ok(probes)
    }

    /// Keep the slots of a previous agent's links out of use until
    /// [`Self::release_old_links`]; clear every other slot config a previous
    /// agent left (nothing drives it any more).
    fn reserve_old_slots(&mut self) -> Result<()> {
        let held = self.old_slots(&self.old_links);
        let len = held.iter().max().map_or(0, |max| max + 1);
        self.slots = (0..len).map(|_| None).collect();
        self.free = (0..len).rev().filter(|slot| !held.contains(slot)).collect();
        for slot in (0..MAX_SLOTS).filter(|slot| !held.contains(slot)) {
            if self.slots_map.get(&slot, 0).is_ok_and(|cfg| cfg.flags != 0) {
                self.slots_map.set(slot, SlotConfig::default(), 0).context("clearing the slot config map")?;
            }
        }
        if !self.old_links.is_empty() {
            info!(links = self.old_links.len(), "a previous agent's probes are still attached; taking over");
        }
        Ok(())
    }

    /// The slots a previous agent's `links` drive: their own, and those
    /// chained after them ([`SlotConfig::next`]), which have no link of
    /// their own.
    fn old_slots(&self, links: &[OldLink]) -> HashSet<u32> {
        let mut held = HashSet::new();
        for link in links {
            let mut slot = link.slot;
            for _ in 0..MAX_CHAIN {
                held.insert(slot);
                match self.slots_map.get(&slot, 0) {
                    Ok(cfg) if cfg.flags != 0 && cfg.next != 0 => slot = cfg.next - 1,
                    _ => break,
                }
            }
        }
        held
    }

    /// Let a previous agent's links go once ours are attached (make before
    /// break: the targets are never without probes), on a thread of their
    /// own: each detach waits for the kernel's uprobe grace period (~0.1 s
    /// a link on a loaded host, one after another), and two dozen links
    /// held the event loop for seconds, past stalls coming due. Their slots
    /// are freed when it is done ([`Probes::released`]). `None`: no links.
    pub fn release_old_links(&mut self) -> Result<Option<Releasing>> {
        let old_links = std::mem::take(&mut self.old_links);
        if old_links.is_empty() {
            return Ok(None);
        }
        let slots = self.old_slots(&old_links);
        // Return halves first: a call entering between the two finds its
        // return probe gone, not its arguments unsaved (`args_missing`).
        let (returns, entries): (Vec<_>, Vec<_>) = old_links
            .into_iter()
            .map(|old| old.path)
            .partition(|path| path.to_string_lossy().ends_with(RETURN_PROGRAM));
        let (tx, done) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("release-links".into())
            .spawn(move || {
                let _ = tx.send(returns.iter().chain(&entries).try_for_each(|path| release(path)));
            })
            .context("starting the thread that releases the previous agent's links")?;
        Ok(Some(Releasing { slots, done }))
    }

    /// The links [`Probes::release_old_links`] let go are gone: their slots
    /// are free. Only now: a return slot's other half still attached would
    /// fire on a cleared config (`no_slot`).
    pub fn released(&mut self, releasing: Releasing) -> Result<()> {
        for slot in releasing.slots {
            self.slots_map.set(slot, SlotConfig::default(), 0).context("clearing the slot config map")?;
            self.free.push(slot);
        }
        Ok(())
    }

    /// The kernel's in-flight table (a previous agent's, when taken over).
    pub fn kernel_state(&mut self) -> Result<KernelState> {
        let tables = BpfTables::new(
            take_map_data(&mut self.ebpf, "INFLIGHT")?,
            take_map_data(&mut self.ebpf, "ALERTED")?,
            take_map_data(&mut self.ebpf, "CONTEXT")?,
        )?;
        Ok(KernelState::new(tables))
    }

    /// At exit: keep the pins for the next agent when `keep` and probes are
    /// still attached; otherwise detach everything and remove the pins.
    /// Returns where the state was kept, if it was.
    pub fn finish(mut self, keep: bool) -> Result<Option<PathBuf>> {
        // Detached below, or kept: either way nothing is left for `drop`.
        let Some(dir) = self.dir.take() else {
            // Nothing pinned (`--ephemeral`): every link goes with the
            // agent; all together here, not one after another as `drop`
            // would.
            self.detach_every();
            return Ok(None);
        };
        if keep && dir.has_links()? {
            // Dropping pinned links leaves them attached. The gated
            // probes' are never pinned: they go now, together.
            let gates: Vec<u32> = self.gated.keys().copied().collect();
            drop_all(gates.into_iter().flat_map(|pid| self.close_gate(pid)).collect());
            return Ok(Some(dir.path().to_owned()));
        }
        self.detach_every();
        dir.remove()?;
        Ok(None)
    }

    /// Detach every process's probes at the agent's end: every slot
    /// silenced, then every link dropped together (each link waits for the
    /// kernel's grace periods, one after another ~0.1 s a link: seconds
    /// for a few processes, see [`super::detach`]).
    fn detach_every(&mut self) {
        let pids: HashSet<u32> = self.links.keys().chain(self.gated.keys()).copied().collect();
        for &pid in &pids {
            if let Err(err) = self.disarm(pid) {
                warn!(pid, "silencing the probes of a process at the stop: {err:#}");
            }
        }
        let detachings = pids.into_iter().map(|pid| self.detach(pid)).collect();
        for detached in drop_together(detachings) {
            self.detached(&detached);
        }
    }

    /// The loaded object, for taking its ring buffer and log maps.
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    /// Attach every probe of `profile` to `pid`. All or nothing: on error the
    /// probes already attached for this call are detached again.
    /// Returns how many probes were attached (optional transport probes
    /// whose library or symbol is missing are skipped).
    /// `plan` is what was read of the process's files for `profile` (or
    /// for the profile it was cut from, [`Profile::without_offsets`]).
    pub fn attach(&mut self, plan: &Plan, profile: &Profile) -> Result<usize> {
        let pid = plan.image.pid;
        if self.links.contains_key(&pid) || self.gated.contains_key(&pid) {
            bail!("pid {pid} is attached already");
        }
        let result = self.attach_all(plan, profile).and_then(|()| self.arm(pid));
        if result.is_err() {
            // On the loop, as the attach itself is.
            self.detach_now(pid);
        }
        result.with_context(|| format!("attaching profile {} to pid {pid}", profile.origin))?;
        Ok(self.slots().filter(|(_, slot)| slot.pid == pid).count())
    }

    /// Make every slot of `pid` live, now that all its probes are attached
    /// (until then they record nothing, see [`slot_flags::ARMED`]). One map
    /// write per slot, so not at one instant: the slots are armed latest
    /// lifecycle stage first ([`arming_rank`]), so a request seen at a
    /// stage has every later stage's probe live already.
    fn arm(&mut self, pid: u32) -> Result<()> {
        let mut slots = self.slot_configs(pid)?;
        sort_for_arming(&mut slots);
        for (index, cfg) in slots {
            let armed = SlotConfig { flags: cfg.flags | slot_flags::ARMED, ..cfg };
            self.slots_map.set(index, armed, 0).context("arming a slot in the slot config map")?;
        }
        Ok(())
    }

    /// Silence every slot of `pid` before [`Self::detach`], whose links go
    /// one by one (tens of ms to seconds a link): a process that exec'd the same program again
    /// keeps hitting the old probes meanwhile, one stage fewer with each
    /// link gone. The reverse of [`Self::arm`]: those that start a request
    /// first.
    pub fn disarm(&mut self, pid: u32) -> Result<()> {
        let mut slots = self.slot_configs(pid)?;
        sort_for_arming(&mut slots);
        for (index, cfg) in slots.into_iter().rev() {
            let disarmed = SlotConfig { flags: cfg.flags & !slot_flags::ARMED, ..cfg };
            self.slots_map.set(index, disarmed, 0).context("disarming a slot in the slot config map")?;
        }
        Ok(())
    }

    /// The configs of `pid`'s slots, as the kernel has them.
    fn slot_configs(&self, pid: u32) -> Result<Vec<(u32, SlotConfig)>> {
        self.slots()
            .filter(|(_, slot)| slot.pid == pid)
            .map(|(index, _)| Ok((index, self.slots_map.get(&index, 0).context("reading the slot config map")?)))
            .collect()
    }

    /// A slot for a new probe of `pid`: a freed one (its counts zeroed), or
    /// the next. None left: an error saying where they went.
    fn allocate_slot(&mut self, pid: u32) -> Result<u32> {
        if let Some(index) = self.free.pop() {
            for map in [&mut self.hits, &mut self.seen] {
                let cpus = map.get(&index, 0).context("reading a reused slot's counters")?.len();
                let zeros = PerCpuValues::try_from(vec![0u64; cpus]).context("sizing the per-CPU counters")?;
                map.set(index, zeros, 0).context("zeroing a reused slot's counters")?;
            }
            return Ok(index);
        }
        let index = u32::try_from(self.slots.len())?;
        if index >= MAX_SLOTS {
            return Err(out_of_slots(&self.slots, pid));
        }
        self.slots.push(None);
        Ok(index)
    }

    /// Let `quiet` probes attached from now on keep an event in the
    /// kernel's in-flight table when it comes within `ns` of its request's
    /// previous one (see [`slot_flags::QUIET`]): half the agent's timeout,
    /// so that an event after a silence it may have reported is sent.
    pub fn set_quiet_gap(&mut self, ns: u64) {
        self.quiet_ns = ns;
    }

    fn attach_all(&mut self, plan: &Plan, profile: &Profile) -> Result<()> {
        let pid = plan.image.pid;
        let mut entries = Vec::new();
        self.place_all(plan, profile, &mut entries)?;
        self.link_entries(pid, entries)
    }

    /// Write every probe's slot config, link its return half, and add its
    /// entry half (if it has one) to `entries`, for [`Self::link_entries`].
    fn place_all(&mut self, plan: &Plan, profile: &Profile, entries: &mut Vec<EntryPoint>) -> Result<()> {
        let pid = plan.image.pid;
        let mut skipped = Vec::new();
        for spec in &profile.probes {
            let mut cfg = spec.slot_config();
            if cfg.flags & slot_flags::QUIET != 0 {
                cfg.quiet_ns = self.quiet_ns;
            }
            let target =
                Target { object: spec.object.as_deref(), symbol: &spec.symbol, origin: &spec.origin, line: spec.line };
            self.attach_slot(plan, &target, cfg, Role::Lifecycle(Arc::new(spec.clone())), entries)?;
        }
        for spec in &profile.activity {
            let target =
                Target { object: spec.object.as_deref(), symbol: &spec.symbol, origin: &spec.origin, line: spec.line };
            let attached =
                self.attach_slot(plan, &target, ActivitySpec::slot_config(), Role::Activity(spec.kind), entries);
            skip_if_optional(attached, spec.optional, pid, &spec.symbol, &mut skipped)?;
        }
        for spec in &profile.signals {
            let target =
                Target { object: spec.object.as_deref(), symbol: &spec.symbol, origin: &spec.origin, line: spec.line };
            let attached =
                self.attach_slot(plan, &target, spec.slot_config(), Role::Signal(Arc::new(spec.clone())), entries);
            skip_if_optional(attached, spec.optional, pid, &spec.symbol, &mut skipped)?;
        }
        if skipped.is_empty() {
            return Ok(());
        }
        // One short line an agent, not one a probe or a process with every
        // library it maps (each probe's reason is at debug level).
        let skipped = skipped.join(", ");
        if std::mem::replace(&mut self.skips_said, true) {
            debug!(pid, %skipped, "optional probes skipped");
        } else {
            info!(
                pid,
                %skipped,
                "optional probes skipped: their library or function is not in the process (a transport it does not \
                 use); said once, other processes' at debug level"
            );
        }
        Ok(())
    }

    /// Write one probe's slot config and attach its return program where
    /// the plan found its function; its entry program (an entry probe's,
    /// or a return probe's that saves arguments) goes to `entries`, linked
    /// once every probe of the process is placed ([`Self::link_entries`]).
    fn attach_slot(
        &mut self,
        plan: &Plan,
        target: &Target<'_>,
        cfg: SlotConfig,
        role: Role,
        entries: &mut Vec<EntryPoint>,
    ) -> Result<()> {
        let pid = plan.image.pid;
        let found = plan.target(target.object, target.symbol).map_err(|missing| match missing {
            Missing::NotMapped(why) => anyhow::Error::new(Unresolved(why)),
            Missing::NoSymbol(why) => {
                anyhow::Error::new(Unresolved(format!("profile {}, line {}: {why}", target.origin, target.line)))
            }
            Missing::Unreadable(why) => anyhow!(why),
        })?;
        let (object, resolved) = (found.object, found.symbol);
        let index = self.allocate_slot(pid)?;
        self.slots_map.set(index, cfg, 0).context("writing the slot config map")?;
        let at = match &role {
            Role::Lifecycle(spec) => spec.at,
            Role::Activity(_) => At::Entry,
            Role::Signal(spec) => spec.at,
        };
        self.slots[index as usize] = Some(Slot {
            pid,
            role,
            symbol: target.symbol.to_owned(),
            object: object.path.clone(),
            file_offset: resolved.file_offset,
            first_insn: resolved.first_insn,
        });
        if let Some(Role::Activity(kind)) = self.slots[index as usize].as_ref().map(|slot| &slot.role)
            && kind.near_stall_only()
        {
            let gated =
                Gated { index, host_path: object.host_path.clone(), file_offset: resolved.file_offset, link: None };
            self.gated.entry(pid).or_default().push(gated);
            debug!(
                pid,
                kind = kind.as_str(),
                symbol = %target.symbol,
                object = %object.path.display(),
                offset = format_args!("{:#x}", resolved.file_offset),
                "transport probe ready: attached only while a request of the process nears its stall"
            );
            return Ok(());
        }
        let point = EntryPoint {
            index,
            symbol: target.symbol.to_owned(),
            object: object.path.clone(),
            host_path: object.host_path.clone(),
            file_offset: resolved.file_offset,
        };
        if at == At::Return {
            self.link_point(RETURN_PROGRAM, &point, pid)?;
        }
        if at == At::Entry || cfg.flags & slot_flags::NEEDS_ARGS != 0 {
            entries.push(point);
        }
        info!(
            pid,
            symbol = %target.symbol,
            object = %object.path.display(),
            offset = format_args!("{:#x}", resolved.file_offset),
            skipped = resolved.skipped,
            at = ?at,
            first_insn = %resolved.first_insn,
            "probe attached"
        );
        if resolved.first_insn.single_stepped() {
            warn!(
                pid,
                symbol = %target.symbol,
                object = %object.path.display(),
                first_bytes = format_args!("{:02x?}", resolved.first_bytes),
                "profile {}, line {}: this probe's first instruction is single-stepped by the kernel (~30 us a hit, 25-50x \
                 an emulated push, nop or branch): fine for a function called a few times per request, not on a hot path; \
                 probe a function called less often, or its caller",
                target.origin,
                target.line
            );
        }
        Ok(())
    }

    /// Link the entry program once per function for `pid`'s `entries`
    /// (the slots placed by [`Self::place_all`]): the slots of one
    /// function's entry are chained ([`entry_chains`], [`chain_configs`]),
    /// so a hit runs one program, which does each slot's work in turn, not
    /// one program per slot. The links go before the process's return
    /// links, as they did when each probe was linked whole in turn (a
    /// detach drops the newest first: a return half before its entry).
    fn link_entries(&mut self, pid: u32, entries: Vec<EntryPoint>) -> Result<()> {
        let returns = self.links.remove(&pid).unwrap_or_default();
        let keys: Vec<(&Path, u64)> =
            entries.iter().map(|point| (point.host_path.as_path(), point.file_offset)).collect();
        let chains = entry_chains(&keys);
        let mut result = Ok(());
        for chain in chains {
            let mut configs = Vec::with_capacity(chain.len());
            for &n in &chain {
                let index = entries[n].index;
                configs.push((index, self.slots_map.get(&index, 0).context("reading the slot config map")?));
            }
            chain_configs(&mut configs);
            for (index, cfg) in &configs {
                self.slots_map.set(*index, *cfg, 0).context("chaining a slot in the slot config map")?;
            }
            let leader = &entries[chain[0]];
            if chain.len() > 1 {
                debug!(
                    pid,
                    symbol = %leader.symbol,
                    slots = ?configs.iter().map(|(index, _)| index).collect::<Vec<_>>(),
                    "probes of one function share one link (one program a hit)"
                );
            }
            if let Err(err) = self.link_point(ENTRY_PROGRAM, leader, pid) {
                result = Err(err);
                break;
            }
        }
        self.links.entry(pid).or_default().extend(returns);
        result
    }

    /// Link program `name` at `point` for `pid`, its hits on the point's
    /// slot (the cookie); pinned with a bpf directory.
    fn link_point(&mut self, name: &str, point: &EntryPoint, pid: u32) -> Result<()> {
        let link = self.link(name, point.index, pid, &point.host_path, point.file_offset).with_context(|| {
            // EACCES/EPERM here is the capability, not the target: 6.x
            // kernels want CAP_SYS_ADMIN for a uprobe perf event.
            let hint = if Caps::of_self().is_ok_and(|caps| !caps.has(CAP_SYS_ADMIN)) {
                " (this process lacks CAP_SYS_ADMIN, which attaching a uprobe through perf_event_open needs: \
                 run as root, or add SYS_ADMIN to the container's capabilities; `stallwatch doctor` checks it)"
            } else {
                ""
            };
            format!(
                "attaching a uprobe to `{}` at {:#x} in {} for pid {pid}{hint}",
                point.symbol,
                point.file_offset,
                point.object.display()
            )
        })?;
        let link = match &self.dir {
            Some(dir) => Link::Pinned(pin(link, &dir.link_path(point.index, pid, name))?),
            None => Link::Owned(link),
        };
        self.links.entry(pid).or_default().push(link);
        Ok(())
    }

    /// Attach program `name` at `file_offset` of `host_path` for `pid`, its
    /// hits on slot `index` (the cookie).
    fn link(
        &mut self,
        name: &str,
        index: u32,
        pid: u32,
        host_path: &std::path::Path,
        file_offset: u64,
    ) -> Result<UProbeLink> {
        let scope = UProbeScope::OneProcess(NonZeroU32::new(pid).ok_or_else(|| anyhow!("pid 0 is not a process"))?);
        let program = self.programs.get_mut(&mut self.ebpf, name)?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(file_offset),
            cookie: Some(u64::from(index)),
        };
        let id = program.attach(point, host_path, scope)?;
        program.take_link(id).context("taking the uprobe link")
    }

    /// Whether `pid` has gated probes (progress, posts) that
    /// [`Self::begin_opening`] links.
    pub fn has_gated(&self, pid: u32) -> bool {
        self.gated.get(&pid).is_some_and(|gated| !gated.is_empty())
    }

    /// The pids with gated probes (progress, posts), and whether their gate
    /// is open.
    pub fn gates(&self) -> impl Iterator<Item = (u32, bool)> + '_ {
        self.gated
            .iter()
            .filter(|(_, gated)| !gated.is_empty())
            .map(|(&pid, gated)| (pid, gated.iter().all(|g| g.link.is_some())))
    }

    /// What linking the gated probes (progress, posts) of `pid` takes (its slots are
    /// configured and armed already; their hit counts go on from where the
    /// last opening left them), for [`Opening::link`] to do off the event
    /// loop: it can take the kernel seconds. `None` when there is nothing
    /// to link, or an opening of the process is under way already.
    pub fn begin_opening(&mut self, pid: u32) -> Result<Option<Opening>> {
        if self.openings.under_way(pid) {
            return Ok(None);
        }
        let points: Vec<(u32, PathBuf, u64)> = self
            .gated
            .get(&pid)
            .into_iter()
            .flatten()
            .filter(|probe| probe.link.is_none())
            .map(|probe| (probe.index, probe.host_path.clone(), probe.file_offset))
            .collect();
        if points.is_empty() {
            return Ok(None);
        }
        let program = self
            .programs
            .get_mut(&mut self.ebpf, ENTRY_PROGRAM)?
            .fd()
            .context("the entry program's fd")?
            .try_clone()
            .context("duplicating the entry program's fd")?;
        let id = self.openings.begin(pid, points.iter().map(|(index, ..)| *index).collect());
        Ok(Some(Opening::new(id, pid, program, points)))
    }

    /// Take what [`Opening::link`] made: the links become the process's
    /// (`Ok(None)`), or, if it was detached meanwhile, are returned to drop
    /// off the loop as its other links were (`Ok(Some)`: the slots are
    /// free once they are gone); a failure linked nothing (all or nothing).
    pub fn end_opening(&mut self, linked: Linked) -> Result<Option<Detaching>> {
        let (id, links) = linked.into_parts();
        let flight = self.openings.end(id).ok_or_else(|| anyhow!("no opening {id} is under way"))?;
        if flight.orphaned {
            let links = links.unwrap_or_default().into_iter().map(|(_, link)| Box::new(link) as Box<dyn Send>);
            let id = self.detachings.begin(flight.indices, &HashSet::new());
            return Ok(Some(Detaching::new(id, flight.pid, links.collect())));
        }
        let gated = self.gated.entry(flight.pid).or_default();
        for (index, link) in links? {
            if let Some(probe) = gated.iter_mut().find(|probe| probe.index == index) {
                probe.link = Some(link);
            }
        }
        Ok(None)
    }

    /// Unlink every gated probe (progress, posts) of `pid`; its slots stay its own, so
    /// their counts keep their meaning and a later opening goes on from
    /// them. The links are returned: dropping one detaches it, which takes
    /// the kernel tens of ms, so the caller may drop them off the event
    /// loop.
    pub fn close_gate(&mut self, pid: u32) -> Vec<UprobeLink> {
        self.gated
            .get_mut(&pid)
            .map_or_else(Vec::new, |gated| gated.iter_mut().filter_map(|probe| probe.link.take()).collect())
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

    /// Detach every probe of `pid` (the process exited or stopped matching):
    /// on the loop, only what is quick. Its slots are silenced (a hit still
    /// running reads an empty config: `no_slot`, never a successor's
    /// meaning) and their final counts kept; its pins are removed now, so a
    /// hand-over never takes over a gone process's links. The links
    /// themselves are returned, for [`Detaching::drop_links`] off the loop
    /// (it can take the kernel seconds); the slots stay out of reuse until
    /// [`Self::detached`] says they are gone.
    pub fn detach(&mut self, pid: u32) -> Detaching {
        // Newest first: a return slot's return half goes before its entry
        // half, as in `release_old_links`.
        let mut links: Vec<Box<dyn Send>> =
            self.links.remove(&pid).unwrap_or_default().into_iter().rev().filter_map(Link::unpin).collect();
        // Their final counts say whether the gated probes were on.
        let finals: Vec<ProbeHits> = self
            .slots()
            .filter(|(_, slot)| slot.pid == pid)
            .filter_map(|(index, slot)| self.probe_hit(index, slot).ok())
            .collect();
        let gated = self.gated.remove(&pid).unwrap_or_default();
        links.extend(gated.into_iter().filter_map(|probe| probe.link).map(|link| Box::new(link) as Box<dyn Send>));
        // Those of an opening under way are freed once its links are back.
        let opening = self.openings.orphan(pid);
        for hits in finals {
            if self.retired.len() == MAX_SLOTS as usize {
                self.retired.pop_front();
            }
            self.retired.push_back(hits);
        }
        let mut held = Vec::new();
        for (index, slot) in self.slots.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|slot| slot.pid == pid) {
                // Its config stays as it is (disarmed by the caller) until
                // the links are gone: a hit meanwhile (a program that
                // exec'd the same file again) is dropped quietly, where a
                // cleared config would count it lost (`no_slot`).
                *slot = None;
                held.push(index as u32);
            }
        }
        Detaching::new(self.detachings.begin(held, &opening), pid, links)
    }

    /// A detaching's links are gone: its slots are free, their configs
    /// cleared only now (as [`Self::released`] does).
    pub fn detached(&mut self, detached: &Detached) {
        for index in self.detachings.end(detached.id()) {
            let _ = self.slots_map.set(index, SlotConfig::default(), 0);
            self.free.push(index);
        }
    }

    /// [`Self::detach`] and drop the links here: where blocking does not
    /// matter (a failed attach, on the loop as the attach is; the agent's
    /// end).
    fn detach_now(&mut self, pid: u32) {
        // Its links go together: silenced first (a failed attach may have
        // armed some).
        let _ = self.disarm(pid);
        let detached = self.detach(pid).drop_links();
        self.detached(&detached);
    }

    /// The slots in use, with their indices.
    /// The probe attached at slot `index`, if one is.
    pub fn slot(&self, index: u32) -> Option<&Slot> {
        self.slots.get(index as usize)?.as_ref()
    }

    pub fn slots(&self) -> impl Iterator<Item = (u32, &Slot)> {
        self.slots.iter().enumerate().filter_map(|(index, slot)| Some((index as u32, slot.as_ref()?)))
    }

    /// Sums of the kernel-side [`counter`]s over all CPUs.
    pub fn counters(&self) -> Result<KernelCounters> {
        let sum = |index| -> Result<u64> {
            Ok(self.counters.get(&index, 0).context("reading the COUNTERS map")?.iter().sum())
        };
        Ok(KernelCounters {
            ringbuf_full: sum(counter::RINGBUF_FULL)?,
            key_unreadable: sum(counter::KEY_UNREADABLE)?,
            args_missing: sum(counter::ARGS_MISSING)?,
            no_slot: sum(counter::NO_SLOT)?,
            unchanged: sum(counter::UNCHANGED)?,
            exec_lost: sum(counter::EXEC_LOST)?,
            state_full: sum(counter::STATE_FULL)?,
            ext_unreadable: sum(counter::EXT_UNREADABLE)?,
            withheld: sum(counter::WITHHELD)?,
        })
    }

    /// Hits of one slot over all CPUs.
    pub fn hits(&self, index: u32) -> Result<u64> {
        Ok(self.hits.get(&index, 0).context("reading the HITS map")?.iter().sum())
    }

    /// Every probe's hits, for the summary: those detached (their
    /// process exited) first, then those attached now.
    pub fn probe_hits(&self) -> Result<Vec<ProbeHits>> {
        let live = self.slots().map(|(index, slot)| self.probe_hit(index, slot)).collect::<Result<Vec<_>>>()?;
        Ok(self.retired.iter().cloned().chain(live).collect())
    }

    fn probe_hit(&self, index: u32, slot: &Slot) -> Result<ProbeHits> {
        let role = match &slot.role {
            Role::Lifecycle(_) => "lifecycle",
            Role::Activity(kind) => kind.as_str(),
            Role::Signal(_) => "signal",
        };
        let gated = self.gated.get(&slot.pid).and_then(|gated| gated.iter().find(|probe| probe.index == index));
        let attached = match gated {
            Some(probe) => Attached::OnDemand { now: probe.link.is_some() },
            None => Attached::Always,
        };
        Ok(ProbeHits { pid: slot.pid, symbol: slot.symbol.clone(), role, hits: self.hits(index)?, attached })
    }

    /// When a transport-activity slot was last hit, on any CPU.
    pub fn last_hit(&self, index: u32) -> Result<Option<u64>> {
        let latest = self.seen.get(&index, 0).context("reading the SEEN map")?.iter().copied().max();
        Ok(latest.filter(|&ns| ns > 0))
    }
}

impl Drop for Probes {
    /// An agent that stops on an error (without [`Probes::finish`])
    /// detaches the probes it attached: it must not leave them behind
    /// because, say, its socket was taken. A previous agent's links it had
    /// not yet replaced stay, and so does the directory while they do. A
    /// crash runs no drop: everything stays for the next agent.
    fn drop(&mut self) {
        let Some(dir) = self.dir.take() else {
            return;
        };
        // Together (see [`super::detach`]); the slots silenced first.
        let pids: Vec<u32> = self.links.keys().copied().collect();
        for pid in pids {
            let _ = self.disarm(pid);
        }
        drop_all(self.links.drain().flat_map(|(_, links)| links).filter_map(Link::unpin).collect());
        if let Ok(false) = dir.has_links() {
            if let Err(err) = dir.remove() {
                warn!("removing the unused bpf directory: {err:#}");
            }
        }
    }
}

/// A slot's entry half, placed and not yet linked.
struct EntryPoint {
    index: u32,
    symbol: String,
    object: PathBuf,
    host_path: PathBuf,
    file_offset: u64,
}

/// Which entry points (given in the order their slots were placed, as
/// (object, file offset)) share one link: a chain per function, each its
/// points' positions in the order the program runs them. That is the
/// newest first, as the kernel ran the programs of several links on one
/// function (each link's uprobe consumer goes first in its list): a hit's
/// events come in the order they did with a link a slot. A function with
/// more than [`MAX_CHAIN`] slots has several chains.
fn entry_chains<K: PartialEq>(points: &[K]) -> Vec<Vec<usize>> {
    let mut functions: Vec<(&K, Vec<usize>)> = Vec::new();
    for (n, key) in points.iter().enumerate() {
        match functions.iter_mut().find(|(function, _)| *function == key) {
            Some((_, members)) => members.push(n),
            None => functions.push((key, vec![n])),
        }
    }
    let mut chains = Vec::new();
    for (_, mut members) in functions {
        members.reverse();
        chains.extend(members.chunks(MAX_CHAIN as usize).map(<[usize]>::to_vec));
    }
    chains
}

/// Chain `configs` (one function's slots, in the order the entry program
/// runs them): each names the next ([`SlotConfig::next`]), and a filter
/// that two or more of them have alike is numbered
/// ([`SlotConfig::filter_share`]), so a hit reads it once.
fn chain_configs(configs: &mut [(u32, SlotConfig)]) {
    let nexts: Vec<u32> = configs.iter().skip(1).map(|(index, _)| index + 1).chain([0]).collect();
    let filter = |cfg: &SlotConfig| {
        (cfg.flags & slot_flags::FILTER != 0).then_some((cfg.filter, cfg.filter_rule, cfg.filter_mask))
    };
    let filters: Vec<_> = configs.iter().map(|(_, cfg)| filter(cfg)).collect();
    let mut shared = Vec::new();
    for (n, (_, cfg)) in configs.iter_mut().enumerate() {
        cfg.next = nexts[n];
        cfg.filter_share = 0;
        let Some(mine) = filters[n] else { continue };
        if filters.iter().filter(|other| **other == Some(mine)).count() < 2 {
            continue;
        }
        let number = match shared.iter().position(|known| *known == mine) {
            Some(at) => at + 1,
            None => {
                shared.push(mine);
                shared.len()
            }
        };
        // A chain has at most MAX_CHAIN slots, so as many filters.
        cfg.filter_share = u8::try_from(number).unwrap_or(0);
    }
}

/// The order [`Probes::arm`] arms slots in: highest [`arming_rank`] first
/// (stable, so ties keep the profile's order).
fn sort_for_arming<T>(slots: &mut [(T, SlotConfig)]) {
    slots.sort_by_key(|(_, cfg)| std::cmp::Reverse(arming_rank(cfg)));
}

/// Transport probes rank first (they start no lifecycle), then slots by
/// the earliest lifecycle stage they can emit, so the probes that end a
/// request go live before those that start one.
fn arming_rank(cfg: &SlotConfig) -> u8 {
    if cfg.flags & slot_flags::COUNT_ONLY != 0 {
        return u8::MAX;
    }
    let rules = cfg.rules.iter().filter(|rule| rule.op != cmp::NONE).map(|rule| rule.stage);
    rules.min().unwrap_or(cfg.stage)
}

/// One probe's hit count, for the summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeHits {
    pub pid: u32,
    pub symbol: String,
    /// `lifecycle`, or the activity kind.
    pub role: &'static str,
    pub hits: u64,
    pub attached: Attached,
}

/// When a probe is linked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attached {
    /// From attach to detach.
    Always,
    /// Only while a request of its process nears its stall (progress and
    /// post probes); `now`: whether it is linked at this moment.
    OnDemand { now: bool },
}

impl Attached {
    /// `always`, `on_demand` (linked now) or `on_demand_idle`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Always => "always",
            Self::OnDemand { now: true } => "on_demand",
            Self::OnDemand { now: false } => "on_demand_idle",
        }
    }
}

/// Where one probe goes, for [`Probes::attach_slot`].
struct Target<'a> {
    object: Option<&'a str>,
    symbol: &'a str,
    /// The profile file that names the probe (one the profile extends, maybe).
    origin: &'a str,
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

/// What the kernel side could not do, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelCounters {
    /// Events lost because the ring buffer was full.
    pub ringbuf_full: u64,
    /// Events lost because their request key could not be read from the
    /// target.
    pub key_unreadable: u64,
    /// Events lost because their return found no arguments saved at entry.
    pub args_missing: u64,
    /// Hits on unconfigured slots.
    pub no_slot: u64,
    /// Status returns suppressed because nothing changed (expected).
    pub unchanged: u64,
    /// Exec notifications lost; discovery's rescans catch those processes.
    pub exec_lost: u64,
    /// Requests the kernel's in-flight table had no room for: they would
    /// not survive an agent restart.
    pub state_full: u64,
    /// Events delivered without their external id, which could not be read:
    /// not lost, but the request has no cross-node trace id.
    pub ext_unreadable: u64,
    /// Events of `quiet` probes kept in their request's in-flight entry,
    /// not sent: not lost, the agent reads them when it needs them.
    pub withheld: u64,
}

impl KernelCounters {
    /// Events the agent will never see: these must be reported. An event
    /// counts in one reason only.
    pub fn lost(&self) -> u64 {
        self.ringbuf_full + self.key_unreadable + self.args_missing + self.no_slot
    }
}

fn take_map(ebpf: &mut Ebpf, name: &str) -> Result<aya::maps::Map> {
    ebpf.take_map(name).ok_or_else(|| anyhow!("the eBPF object has no map `{name}`"))
}

fn take_map_data(ebpf: &mut Ebpf, name: &str) -> Result<MapData> {
    match take_map(ebpf, name)? {
        aya::maps::Map::HashMap(data) => Ok(data),
        _ => bail!("the eBPF object's map `{name}` is not a hash map"),
    }
}

/// Why no slot is left for another probe of `pid` (attached part way),
/// from who holds them: every process watched takes one per table of the
/// profile, so the processes attached in full say what it needs, and `pid`
/// needs at least one more than it holds. Loading refuses a profile that
/// needs more than [`MAX_SLOTS`] for one process; this is several.
fn out_of_slots(slots: &[Option<Slot>], pid: u32) -> anyhow::Error {
    let mut held: std::collections::BTreeMap<u32, usize> = std::collections::BTreeMap::new();
    for slot in slots.iter().flatten() {
        *held.entry(slot.pid).or_default() += 1;
    }
    let gone = slots.len() - held.values().sum::<usize>();
    let own = held.remove(&pid).unwrap_or(0);
    let full = held.values().copied().max().unwrap_or(0);
    let needs = full.max(own + 1);
    const SHOWN: usize = 8;
    let mut list: Vec<String> =
        held.iter().take(SHOWN).map(|(holder, count)| format!("pid {holder} {count}")).collect();
    if held.len() > SHOWN {
        list.push(format!("{} more", held.len() - SHOWN));
    }
    list.push(format!("pid {pid} (being attached) {own} so far"));
    let gone = if gone > 0 {
        format!("; {gone} more are held by a previous agent's links or a gone process's, until they are released")
    } else {
        String::new()
    };
    let processes = |n: usize| if n == 1 { "1 process".to_owned() } else { format!("{n} processes") };
    anyhow!(
        "all {MAX_SLOTS} probe slots are in use: this profile needs {}{needs} per process (a slot per [[probe]], \
         [[activity]] and [[signal]]; `stallwatch profile check` counts them) and {} watched ({}){gone}: \
         watch at most {} per agent (split them over several agents), or probe fewer functions",
        if needs > full { "at least " } else { "" },
        processes(held.len() + 1),
        list.join(", "),
        processes(MAX_SLOTS as usize / needs)
    )
}

/// Pin `link` at `path`; it then stays attached after the agent exits.
fn pin(link: UProbeLink, path: &std::path::Path) -> Result<PinnedLink> {
    let link = FdLink::try_from(link)
        .context("this kernel attached the uprobe without a BPF link, which cannot be pinned; pass --ephemeral")?;
    link.pin(path).with_context(|| format!("pinning a probe link at {}", path.display()))
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

/// A previous agent's links being released ([`Probes::release_old_links`]).
pub struct Releasing {
    slots: HashSet<u32>,
    done: tokio::sync::oneshot::Receiver<Result<()>>,
}

impl Releasing {
    /// Until every link is released (or one failed to be).
    pub async fn done(&mut self) -> Result<()> {
        (&mut self.done)
            .await
            .unwrap_or_else(|_| Err(anyhow!("the thread releasing the previous agent's links ended without a word")))
    }
}

/// Detach a previous agent's link pinned at `path`. The link is held while
/// unpinning: dropping the last reference from a file descriptor detaches
/// at once, while an unpinned link nobody holds is released later by a
/// kernel worker, and would fire on a slot config cleared after (`no_slot`).
fn release(path: &Path) -> Result<()> {
    let link = PinnedLink::from_pin(path)
        .with_context(|| format!("opening the previous agent's probe link {}", path.display()))?;
    drop(link.unpin().with_context(|| format!("unpinning {}", path.display()))?);
    Ok(())
}

/// An attachment's result, with an optional one whose object or symbol
/// is not in the process (`Unresolved`) skipped: its symbol added to
/// `skipped`, its reason logged at debug level.
fn skip_if_optional(
    attached: Result<()>,
    optional: bool,
    pid: u32,
    symbol: &str,
    skipped: &mut Vec<String>,
) -> Result<()> {
    match attached {
        Err(err) if optional && err.downcast_ref::<Unresolved>().is_some() => {
            debug!(pid, symbol = %symbol, reason = %err, "optional probe skipped");
            skipped.push(symbol.to_owned());
            Ok(())
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use stallwatch_common::stage;

    use super::*;
    use crate::profile;

    /// `profile`'s slot configs with their probes' names, in the order
    /// [`Probes::arm`] makes them live.
    fn armed_in_order(profile: &str) -> Vec<(String, SlotConfig)> {
        let profile = Profile::load(profile).unwrap();
        let lifecycle =
            profile.probes.iter().map(|spec| (format!("{}@{:?}", spec.symbol, spec.at), spec.slot_config()));
        let activity =
            profile.activity.iter().map(|spec| (format!("activity:{}", spec.symbol), ActivitySpec::slot_config()));
        let mut slots: Vec<_> = lifecycle.chain(activity).collect();
        sort_for_arming(&mut slots);
        slots
    }

    #[test]
    fn the_probes_that_end_a_request_are_armed_before_those_that_start_one() {
        let demo: Vec<String> = armed_in_order("demo").into_iter().map(|(name, _)| name).collect();
        assert_eq!(
            demo,
            [
                "prefill_abort@Entry",
                "prefill_release@Entry",
                "kv_transfer_poll@Return",
                "kv_transfer_post@Entry",
                "prefill_enqueue@Entry"
            ]
        );
        for name in profile::builtin_names() {
            let slots = armed_in_order(name);
            let last_ending = slots.iter().rposition(|(_, cfg)| arming_rank(cfg) >= stage::FIRST_TERMINAL);
            let first_starting = slots.iter().position(|(_, cfg)| arming_rank(cfg) == stage::ENQUEUED);
            // A profile whose lifecycles all start at signals (the rooms of
            // `sglang-mooncake`) has no probe that starts one.
            assert!(
                first_starting.is_none_or(|first| last_ending < Some(first)),
                "{name}: {:?}",
                slots.iter().map(|(name, _)| name).collect::<Vec<_>>()
            );
            assert!(
                slots[0].1.flags & slot_flags::COUNT_ONLY != 0
                    || !slots.iter().any(|(_, cfg)| cfg.flags & slot_flags::COUNT_ONLY != 0)
            );
        }
    }

    #[test]
    fn the_entry_slots_of_one_function_share_a_link_newest_first() {
        // Placed in this order: two functions, a third with one slot.
        let points = ["close", "send", "close", "other", "close", "send"];
        assert_eq!(entry_chains(&points), [vec![4, 2, 0], vec![5, 1], vec![3]]);
        // Past MAX_CHAIN, several links.
        let many = vec!["f"; MAX_CHAIN as usize + 2];
        let chains = entry_chains(&many);
        assert_eq!(chains.len(), 2);
        assert_eq!(chains[0].len(), MAX_CHAIN as usize);
        assert_eq!(chains[0][0], MAX_CHAIN as usize + 1);
        assert_eq!(chains[1], [1, 0]);
        assert!(entry_chains::<&str>(&[]).is_empty());
    }

    #[test]
    fn a_chain_names_each_next_slot_and_numbers_the_filters_it_shares() {
        // The `sglang` profile's slots on `zmq_msg_close`, as the program
        // runs them: three of four share `when = arg0 deref [0] != 0`.
        let profile = Profile::load("sglang").unwrap();
        let close: Vec<SlotConfig> = profile
            .signals
            .iter()
            .filter(|spec| spec.symbol == "zmq_msg_close")
            .map(|spec| spec.slot_config())
            .rev()
            .collect();
        assert_eq!(close.len(), 4);
        let mut chain: Vec<(u32, SlotConfig)> = [40, 31, 30, 12].into_iter().zip(close.iter().copied()).collect();
        chain_configs(&mut chain);
        assert_eq!(chain.iter().map(|(_, cfg)| cfg.next).collect::<Vec<_>>(), [32, 31, 13, 0]);
        let shares: Vec<u8> = chain.iter().map(|(_, cfg)| cfg.filter_share).collect();
        let long = profile
            .signals
            .iter()
            .rev()
            .filter(|spec| spec.symbol == "zmq_msg_close")
            .position(|spec| spec.name == "zmq_recv_long");
        for (n, share) in shares.iter().enumerate() {
            if Some(n) == long {
                assert_eq!(*share, 0, "{shares:?}");
            } else {
                assert_eq!(*share, 1, "{shares:?}");
            }
        }
        // Nothing else of a config changes.
        for ((_, chained), alone) in chain.iter().zip(&close) {
            assert_eq!(SlotConfig { next: 0, filter_share: 0, ..*chained }, *alone);
        }
        // One slot: no chain; slots without filters share none.
        let send: Vec<(u32, SlotConfig)> = profile
            .signals
            .iter()
            .filter(|spec| spec.symbol == "zmq_msg_send")
            .enumerate()
            .map(|(n, spec)| (n as u32, spec.slot_config()))
            .collect();
        let mut alone = vec![send[0]];
        chain_configs(&mut alone);
        assert_eq!((alone[0].1.next, alone[0].1.filter_share), (0, 0));
        let mut send = send;
        chain_configs(&mut send);
        assert!(send.iter().all(|(_, cfg)| cfg.filter_share == 0));
        // Two different filters each shared: numbered apart.
        let with = |mask| {
            let mut cfg = close[0];
            cfg.filter_mask = mask;
            (0, cfg)
        };
        let mut two = vec![with(1), with(2), with(1), with(2)];
        chain_configs(&mut two);
        assert_eq!(two.iter().map(|(_, cfg)| cfg.filter_share).collect::<Vec<_>>(), [1, 2, 1, 2]);
    }

    #[test]
    fn running_out_of_slots_says_what_the_profile_needs_and_who_holds_them() {
        let slot = |pid| {
            Some(Slot {
                pid,
                role: Role::Activity(ActivityKind::Post),
                symbol: "f".into(),
                object: PathBuf::from("/bin/true"),
                file_offset: 0,
                first_insn: crate::profile::resolve::FirstInsn::Push,
            })
        };
        // Two processes attached in full, a third part way, and slots a
        // gone process's links still hold.
        let mut slots: Vec<Option<Slot>> = Vec::new();
        slots.extend((0..340).map(|_| slot(11)));
        slots.extend((0..340).map(|_| slot(12)));
        slots.extend((0..24).map(|_| None));
        slots.extend((0..320).map(|_| slot(13)));
        assert_eq!(slots.len(), MAX_SLOTS as usize);
        let err = out_of_slots(&slots, 13).to_string();
        let watched = "and 3 processes watched (pid 11 340, pid 12 340, pid 13 (being attached) 320 so far); \
                       24 more are held";
        assert!(
            err.starts_with("all 1024 probe slots are in use: this profile needs 340 per process (a slot per")
                && err.contains(watched)
                && err.ends_with(
                    "watch at most 3 processes per agent (split them over several agents), or probe fewer functions"
                ),
            "{err}"
        );
        // The first process alone, behind a previous agent's slots: its
        // need is known only to be more than it got.
        let mut slots: Vec<Option<Slot>> = (0..1000).map(|_| None).collect();
        slots.extend((0..24).map(|_| slot(7)));
        let err = out_of_slots(&slots, 7).to_string();
        assert!(
            err.contains("needs at least 25 per process")
                && err.contains("1 process watched (pid 7 (being attached) 24 so far); 1000 more")
                && err.contains("watch at most 40 processes per agent"),
            "{err}"
        );
    }
}
