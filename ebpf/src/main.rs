//! The stallwatch kernel side: two generic programs, one for function entry
//! and one for function return, attached once per probe slot. The attach
//! cookie names the slot; the slot's [`SlotConfig`] says where the request key
//! lives, which hits become events and which lifecycle stage each one is. No
//! target-specific code lives here. A slot stays silent until the agent
//! arms it (`slot_flags::ARMED`), once every probe of its process is
//! attached. The slots of one function's entry share one link: the first
//! names the next (`SlotConfig::next`), and a hit runs each in turn, the
//! entry program handing on to itself by a tail call, so the function
//! traps into one program, not one a slot.
//!
//! Besides the events, the programs keep the in-flight table (`INFLIGHT`):
//! the agent pins it with the other maps and the links in bpffs, so the
//! probes keep recording while no agent runs and a restarted agent takes
//! over every request in flight. A quiet slot's event that only moves a
//! busy request along stays there, not sent (`slot_flags::QUIET`).
//!
//! Every helper is `#[inline(always)]`: as BPF-to-BPF calls, LLVM may leave a
//! stack pointer in r0 on return, which the verifier rejects.
#![no_std]
#![no_main]
// Map keys and values go by reference: by value, each would be one more
// copy on the 512-byte BPF stack before the helper call.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, pt_regs},
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_loop, bpf_probe_read_user, bpf_probe_read_user_buf,
        bpf_probe_read_user_str_bytes, generated::bpf_get_attach_cookie,
    },
    macros::{btf_tracepoint, map, uprobe, uretprobe},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, ProgramArray, RingBuf, ring_buf::RingBufEntry},
    programs::{BtfTracePointContext, ProbeContext, RetProbeContext},
};
use aya_log_ebpf::warn;
use core::ffi::c_void;
use stallwatch_common::{
    CHUNK_LEN, EXT_ID_LEN, Event, HeldContext, InflightEntry, LastEmitted, MAX_CHAIN, MAX_DEREF, MAX_RET_RULES,
    MAX_SLOTS, MSGPACK_HEAD, MSGPACK_STEPS, MSGPACK_TAG_LEN, MsgpackElement, NOT_EMITTED, PICKLE_FIRST_WIDTH,
    PICKLE_HEAD, PICKLE_KEYS, PICKLE_NAME_LEN, PICKLE_RECORDS, PICKLE_STEPS, PICKLE_TAG_STEPS, RequestKey, RetRule,
    SAVED_ARGS, STRINGS_STEPS, SavedArgs, SavedArgsKey, SlotConfig, StringWalk, ValueSource, base, chunk, cmp, counter,
    event_flags, msgpack, pickle, slot_flags, stage, widen, withheld,
};

/// `BPF_F_NO_PREALLOC`: the in-flight tables take memory per request held,
/// not their whole capacity up front.
const NO_PREALLOC: u32 = 1;

/// Per-slot configuration, written by the agent before it attaches.
#[map]
static SLOTS: Array<SlotConfig> = Array::with_max_entries(MAX_SLOTS, 0);

/// Lifecycle events for the agent. 4 MiB holds ~35 000 events.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);
const EVENTS_BYTES: u32 = 1 << 22;

/// Unread bytes in `EVENTS` past which a submit wakes the agent. Below it
/// nothing does: a wakeup per event costs the target more than the event
/// itself (the agent reads the buffer on its tick anyway, every 10 ms by
/// default). A quarter leaves three quarters for the agent to catch up in,
/// so a burst (or a slow tick) fills the buffer only if the agent cannot
/// keep up at all, and even then each lost event is counted.
const WAKEUP_AT: u64 = EVENTS_BYTES as u64 / 4;

/// What went wrong in the kernel, per CPU (see [`counter`]).
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

/// Every hit of every slot, emitted or not, per CPU.
#[map]
static HITS: PerCpuArray<u64> = PerCpuArray::with_max_entries(MAX_SLOTS, 0);

/// When each slot was last hit, per CPU (the agent takes the maximum):
/// "last post 57 s ago" for transport-activity slots.
#[map]
static SEEN: PerCpuArray<u64> = PerCpuArray::with_max_entries(MAX_SLOTS, 0);

/// Arguments saved at entry for return slots that read them, per thread.
/// An LRU: a call whose thread dies inside it (the process is killed
/// mid-call) never returns to take its entry out, and a plain hash would
/// fill up with those for good, after which no return could read its
/// arguments. Here the least recently used give way; a call still running when
/// 16 384 newer ones have pushed its arguments out has its return counted
/// as `ARGS_MISSING`.
#[map]
static SAVED: LruHashMap<SavedArgsKey, SavedArgs> = LruHashMap::with_max_entries(16384, 0);

/// The event that ended a lifecycle, per (pid, key), when an
/// `ONLY_ON_CHANGE` slot emitted it: a failed status keeps being polled
/// after its entry left `INFLIGHT`. Every other last event lives in the
/// request's `INFLIGHT` entry, so this is written once per such failure,
/// not on every event.
#[map]
static LAST: LruHashMap<RequestKey, LastEmitted> = LruHashMap::with_max_entries(65536, 0);

/// Every request in flight: written here on each lifecycle event, deleted
/// when the lifecycle ends. Not an LRU: under pressure it must refuse new
/// requests (counted) rather than drop the oldest, which are the stalls.
#[map]
static INFLIGHT: HashMap<RequestKey, InflightEntry> = HashMap::with_max_entries(1 << 17, NO_PREALLOC);

/// Written by the agent only: the `last_ns` of the silence it reported as
/// stalled. As large as `INFLIGHT`: every request held may be stalled. A request in here that ends keeps its `INFLIGHT` entry (marked
/// ended) until the agent has seen the end, so the recovery of a reported
/// stall is never lost across an agent restart.
#[map]
static ALERTED: HashMap<RequestKey, u64> = HashMap::with_max_entries(1 << 17, NO_PREALLOC);

/// Written and read by the agent only, never by these programs: what it
/// knew of each request it made itself (an SGLang room's destinations,
/// answers and transfer handles), pinned so the next agent knows it too.
/// Entries take memory only while held (`NO_PREALLOC`).
#[map]
static CONTEXT: HashMap<RequestKey, HeldContext> = HashMap::with_max_entries(1 << 16, NO_PREALLOC);

#[uprobe]
pub fn lifecycle_entry(ctx: ProbeContext) -> u32 {
    let Some((mut slot, mut cfg)) = slot_of(&ctx) else {
        return 0;
    };
    let mut shared = Shared { known: 0, passed: 0 };
    // A chain's link (see `SlotConfig::next`): this run may be the next
    // slot of a hit whose earlier slots ran already, handed on below.
    if cfg.next != 0
        && let Some((next, was)) = chain_taken()
    {
        match SLOTS.get(next) {
            Some(next_cfg) if next_cfg.flags != 0 => {
                (slot, cfg, shared) = (next, next_cfg, was);
            }
            _ => {
                bump(counter::NO_SLOT);
                return 0;
            }
        }
    }
    entry_slot(slot, cfg, ctx.regs, &mut shared);
    if cfg.next != 0 {
        chain_to(&ctx, cfg.next - 1, &shared);
    }
    0
}

/// The entry program, for a chain to go on in ([`chain_to`]).
#[map]
static CHAIN: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// Ways a chain's next slot is handed to the program run next, per CPU:
/// each 0 (free) or one word, `tid << 32 | passed << 24 | known << 16 |
/// 1 + slot`, written and taken whole (one store each, so a program of
/// another thread preempting this one on its CPU never sees half of
/// one). More than one for such a preemption, which takes another way.
#[map]
static CHAINED: PerCpuArray<[u64; CHAIN_WAYS]> = PerCpuArray::with_max_entries(1, 0);
const CHAIN_WAYS: usize = 4;

/// The verdicts of the filters a chain's slots share, so far in a hit
/// (bit `n - 1` of each for [`SlotConfig::filter_share`] `n`).
struct Shared {
    known: u32,
    passed: u32,
}

/// The next slot of this thread's chain, if this run is one (handed on by
/// [`chain_to`]), with the verdicts of its shared filters so far.
#[inline(always)]
fn chain_taken() -> Option<(u32, Shared)> {
    let ways = CHAINED.get_ptr_mut(0)?;
    // SAFETY: a per-CPU map value; each way is read and written whole.
    let ways = unsafe { &mut *ways };
    let tid = bpf_get_current_pid_tgid() as u32;
    for way in ways.iter_mut() {
        // SAFETY: as above.
        let word = unsafe { core::ptr::read_volatile(way) };
        if word != 0 && (word >> 32) as u32 == tid {
            // SAFETY: as above.
            unsafe { core::ptr::write_volatile(way, 0) };
            let shared = Shared { known: ((word >> 16) & 0xff) as u32, passed: ((word >> 24) & 0xff) as u32 };
            return Some((((word & 0xffff) as u32).wrapping_sub(1), shared));
        }
    }
    None
}

/// Run `next` for this hit: handed on through a free way of [`CHAINED`]
/// to the entry program again, by a tail call (the program is verified
/// once, not once per slot of a chain). One that cannot be (no free way,
/// no program in [`CHAIN`]) is counted as [`counter::NO_SLOT`]: its slot,
/// and the chain's rest, miss this hit.
#[inline(always)]
fn chain_to(ctx: &ProbeContext, next: u32, shared: &Shared) {
    let Some(ways) = CHAINED.get_ptr_mut(0) else {
        bump(counter::NO_SLOT);
        return;
    };
    // SAFETY: as in `chain_taken`.
    let ways = unsafe { &mut *ways };
    let tid = bpf_get_current_pid_tgid() as u32;
    let word = (u64::from(tid) << 32)
        | (u64::from(shared.passed & 0xff) << 24)
        | (u64::from(shared.known & 0xff) << 16)
        | u64::from(next.wrapping_add(1) & 0xffff);
    for way in ways.iter_mut() {
        // SAFETY: as above.
        if unsafe { core::ptr::read_volatile(way) } != 0 {
            continue;
        }
        // SAFETY: as above; the tail call returns only when it failed.
        unsafe {
            core::ptr::write_volatile(way, word);
            CHAIN.tail_call(ctx, 0);
            core::ptr::write_volatile(way, 0);
        }
        break;
    }
    bump(counter::NO_SLOT);
}

/// What the entry program does for one slot of a hit.
#[inline(always)]
fn entry_slot(slot: u32, cfg: &SlotConfig, regs: *mut pt_regs, shared: &mut Shared) {
    let args = Args::Live(regs);
    if cfg.flags & slot_flags::RETURN != 0 {
        // The entry half of a return slot: keep the arguments for the
        // return, armed or not, since the return may come after arming.
        // SAFETY: `regs` is the probe context the kernel handed this program.
        let frame = unsafe { (*regs).rsp };
        save_args(slot, cfg, &args, frame);
        return;
    }
    if cfg.flags & slot_flags::ARMED == 0 {
        return;
    }
    if cfg.flags & slot_flags::COUNT_ONLY != 0 {
        count_hit(slot);
        if let Some(seen) = SEEN.get_ptr_mut(slot) {
            // SAFETY: per-CPU slot, no other writer on this CPU while we run.
            unsafe { *seen = bpf_ktime_get_ns() };
        }
        return;
    }
    count_hit(slot);
    if !shared_filter_holds(cfg, &args, shared) {
        return;
    }
    if cfg.flags & slot_flags::EXT_STRINGS != 0 {
        walk_strings(slot, cfg, &args, 0);
        return;
    }
    if cfg.flags & slot_flags::ENTRY_VALUE != 0 {
        let (value, matched) = entry_value(cfg, &args);
        emit(slot, cfg, &args, value, matched);
    } else {
        emit(slot, cfg, &args, 0, Matched { rules: 0, stage: cfg.stage });
    }
}

/// [`filter_holds`] at entry, read once a hit for the slots of a chain
/// that share the filter ([`SlotConfig::filter_share`]).
#[inline(always)]
fn shared_filter_holds(cfg: &SlotConfig, args: &Args, trap: &mut Shared) -> bool {
    let share = u32::from(cfg.filter_share);
    if cfg.flags & slot_flags::FILTER == 0 || share == 0 || share > MAX_CHAIN {
        return filter_holds(cfg, args, 0);
    }
    let bit = 1u32 << (share - 1);
    if trap.known & bit != 0 {
        return trap.passed & bit != 0;
    }
    let holds = filter_holds(cfg, args, 0);
    trap.known |= bit;
    if holds {
        trap.passed |= bit;
    }
    holds
}

/// The value an [`slot_flags::ENTRY_VALUE`] slot reads at entry (carried
/// in the event's `ret`), and the event it picks: the first rule that
/// holds, else the slot's own stage (also when nothing could be read: the
/// event itself is never lost to the read).
#[inline(always)]
fn entry_value(cfg: &SlotConfig, args: &Args) -> (i64, Matched) {
    let own = Matched { rules: 0, stage: cfg.stage };
    let Some(key) = resolve(&cfg.key, args, 0, 0) else {
        return (0, own);
    };
    // A value not read, as one that cannot be: the slot's own stage.
    if cfg.flags & slot_flags::VALUE_IF_ELSE != 0 && selects_else(cfg, args, 0, key) != Some(true) {
        return (0, own);
    }
    let Some(raw) = resolve(&cfg.value, args, 0, key) else {
        return (0, own);
    };
    let value = widen(cfg.flags, raw);
    (value, match_rules(cfg, value).unwrap_or(own))
}

#[uretprobe]
pub fn lifecycle_return(ctx: RetProbeContext) -> u32 {
    let Some((slot, cfg)) = slot_of(&ctx) else {
        return 0;
    };
    if cfg.flags & slot_flags::ARMED == 0 {
        return 0;
    }
    count_hit(slot);
    let mut raw: u64 = ctx.ret();
    if cfg.flags & slot_flags::RET_DEREF != 0 {
        // The value behind the return register (a result returned through
        // a hidden pointer): read before the rules, which compare it.
        match resolve(&cfg.value, &Args::None, raw as i64, 0) {
            Some(value) => raw = value,
            None => {
                bump(counter::KEY_UNREADABLE);
                return 0;
            }
        }
    }
    let ret = widen(cfg.flags, raw);
    // The rules before the saved arguments: a return filtered out (a
    // status poll answering "in progress") costs no lookup of them. What
    // it leaves behind is tied to its frame, which no other return has.
    let Some(matched) = match_rules(cfg, ret) else {
        return 0;
    };
    let args = if cfg.flags & slot_flags::NEEDS_ARGS == 0 {
        Args::None
    } else {
        // SAFETY: `regs` is the probe context the kernel handed this program.
        let frame = unsafe { (*ctx.regs).rsp }.wrapping_sub(RETURN_ADDRESS);
        match take_saved(slot, frame) {
            Some(saved) => Args::Saved(saved),
            None => {
                // Only a return that would have been an event is a loss.
                bump(counter::ARGS_MISSING);
                return 0;
            }
        }
    };
    if !filter_holds(cfg, &args, ret) {
        return 0;
    }
    if cfg.flags & slot_flags::EXT_STRINGS != 0 {
        walk_strings(slot, cfg, &args, ret);
        return 0;
    }
    emit(slot, cfg, &args, ret, matched);
    0
}

/// Whether a hit passes its slot's [`slot_flags::FILTER`] (true without
/// one): the value there, read as a `u64` and masked (a mask picks bits of
/// the first bytes of a message, e.g. its format's markers), satisfies the
/// filter's rule. A value that cannot be read fails it.
#[inline(always)]
fn filter_holds(cfg: &SlotConfig, args: &Args, ret: i64) -> bool {
    if cfg.flags & slot_flags::FILTER == 0 {
        return true;
    }
    match resolve(&cfg.filter, args, ret, 0) {
        Some(value) => {
            let masked = if cfg.filter_mask == 0 { value } else { value & cfg.filter_mask };
            cfg.filter_rule.holds(masked as i64)
        }
        None => false,
    }
}

/// Where the capture is read: [`SlotConfig::ext`], or, with
/// [`slot_flags::EXT_SELECT`], there only when the byte at
/// [`SlotConfig::select`] is [`SlotConfig::select_byte`], else at
/// [`SlotConfig::ext_else`].
#[inline(always)]
fn ext_at(cfg: &SlotConfig, args: &Args, ret: i64, key: u64) -> Option<u64> {
    if cfg.flags & slot_flags::EXT_SELECT == 0 {
        return resolve(&cfg.ext, args, ret, key);
    }
    if selects_else(cfg, args, ret, key)? {
        resolve(&cfg.ext_else, args, ret, key)
    } else {
        resolve(&cfg.ext, args, ret, key)
    }
}

/// Whether the byte at [`SlotConfig::select`] picks
/// [`SlotConfig::ext_else`] (it is not [`SlotConfig::select_byte`]);
/// `None` where it cannot be read.
#[inline(always)]
fn selects_else(cfg: &SlotConfig, args: &Args, ret: i64, key: u64) -> Option<bool> {
    let at = resolve(&cfg.select, args, ret, key)?;
    // SAFETY: a user-memory read; failure means "nowhere to read".
    let byte: u8 = unsafe { bpf_probe_read_user(at as *const u8) }.ok()?;
    Some(byte != cfg.select_byte)
}

/// Pids of processes that just exec'd, for process discovery.
#[map]
static EXECS: RingBuf = RingBuf::with_byte_size(1 << 16, 0);

/// Every exec on the host: the agent checks the new program against its
/// selectors. A BTF tracepoint, so it needs no tracefs mount.
#[btf_tracepoint(function = "sched_process_exec")]
pub fn process_exec(_ctx: BtfTracePointContext) -> u32 {
    let pid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if EXECS.output::<u32>(pid, 0).is_err() {
        bump(counter::EXEC_LOST);
    }
    0
}

/// The overhead floor for `cargo bench --bench uprobe`: uprobes that do
/// nothing, attached where ours are, so the bench can tell the kernel's
/// uprobe cost from the cost of our program.
#[uprobe]
pub fn empty_entry(_ctx: ProbeContext) -> u32 {
    0
}

#[uretprobe]
pub fn empty_return(_ctx: RetProbeContext) -> u32 {
    0
}

/// Where arguments come from: live registers at entry, the saved copy at
/// return, or nowhere (a return slot that reads only the return value).
enum Args {
    Live(*mut pt_regs),
    Saved(SavedArgs),
    None,
}

impl Args {
    #[inline(always)]
    fn get(&self, n: usize) -> Option<u64> {
        match self {
            Self::Live(regs) => live_arg(*regs, n),
            Self::Saved(saved) => saved.args.get(n).copied(),
            Self::None => None,
        }
    }
}

/// Argument `n` of the x86-64 SysV calling convention at function entry:
/// six registers, then the stack above the return address.
#[inline(always)]
fn live_arg(regs: *mut pt_regs, n: usize) -> Option<u64> {
    // SAFETY: `regs` is the probe context the kernel handed this program.
    let regs = unsafe { &*regs };
    match n {
        0 => Some(regs.rdi),
        1 => Some(regs.rsi),
        2 => Some(regs.rdx),
        3 => Some(regs.rcx),
        4 => Some(regs.r8),
        5 => Some(regs.r9),
        6..SAVED_ARGS => {
            let slot = regs.rsp + 8 * (n as u64 - 5);
            // SAFETY: a user-memory read; failure is an error, not a fault.
            unsafe { bpf_probe_read_user(slot as *const u64) }.ok()
        }
        _ => None,
    }
}

#[inline(always)]
fn slot_of<C: EbpfContext>(ctx: &C) -> Option<(u32, &'static SlotConfig)> {
    // SAFETY: the helper only reads the cookie of the running attachment.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let slot = cookie as u32;
    match SLOTS.get(slot) {
        Some(cfg) if cfg.flags != 0 => Some((slot, cfg)),
        _ => {
            bump(counter::NO_SLOT);
            warn!(ctx, "stallwatch: hit on cookie {} with no slot configured", cookie);
            None
        }
    }
}

/// What a call's `ret` pops off the stack between its entry and its
/// return probe on x86-64: the return address.
const RETURN_ADDRESS: u64 = 8;

/// Keep the arguments for the return, with the call's `frame` (its stack
/// pointer at entry). A thread's entry for a slot is written over in place
/// from one call to the next (a lookup, where an insert at every entry and
/// a delete at every return cost two updates of the LRU), and marked taken
/// by the return instead of removed.
#[inline(always)]
fn save_args(slot: u32, cfg: &SlotConfig, args: &Args, frame: u64) {
    let key = SavedArgsKey { pid_tgid: bpf_get_current_pid_tgid(), slot, _pad: 0 };
    if let Some(saved) = SAVED.get_ptr_mut(&key) {
        // SAFETY: a map value only this thread's calls of this slot use.
        fill_saved(unsafe { &mut *saved }, cfg, args, frame);
        return;
    }
    let mut saved = SavedArgs::default();
    fill_saved(&mut saved, cfg, args, frame);
    // A failed save is counted at the return, once, if that return was an
    // event.
    let _ = SAVED.insert(&key, &saved, 0);
}

#[inline(always)]
fn fill_saved(saved: &mut SavedArgs, cfg: &SlotConfig, args: &Args, frame: u64) {
    let nargs = cfg.nargs as usize;
    for (n, value) in saved.args.iter_mut().enumerate() {
        if n >= nargs {
            break;
        }
        *value = args.get(n).unwrap_or(0);
    }
    saved.frame = frame;
}

/// The arguments the entry of the returning call (its stack pointer at
/// entry: `frame`) saved, once. Another call's are refused: an inner call
/// of a recursion overwrote the outer's, or the thread's last call of the
/// slot was filtered out at its return and left them.
#[inline(always)]
fn take_saved(slot: u32, frame: u64) -> Option<SavedArgs> {
    let key = SavedArgsKey { pid_tgid: bpf_get_current_pid_tgid(), slot, _pad: 0 };
    let saved = SAVED.get_ptr_mut(&key)?;
    // SAFETY: as in `save_args`.
    let saved = unsafe { &mut *saved };
    if saved.frame != frame {
        return None;
    }
    saved.frame = 0;
    Some(*saved)
}

/// Which return rules held, and the lifecycle stage the hit is.
struct Matched {
    /// `RULE_MATCHED << n` for every rule `n` that holds.
    rules: u32,
    stage: u8,
}

/// The rules that hold and the stage of the first of them; the slot's own
/// stage when it has no rules (every return is an event); `None` when it
/// has rules and none holds.
#[inline(always)]
fn match_rules(cfg: &SlotConfig, ret: i64) -> Option<Matched> {
    let rules: &[RetRule; MAX_RET_RULES] = &cfg.rules;
    let mut any_rule = false;
    let mut matched = 0;
    let mut first = None;
    for (n, rule) in rules.iter().enumerate() {
        if rule.op == cmp::NONE || rule.op > cmp::GE {
            continue;
        }
        let holds = rule.holds(ret);
        any_rule = true;
        if holds {
            matched |= event_flags::RULE_MATCHED << n;
            if first.is_none() {
                first = Some(rule.stage);
            }
        }
    }
    match first {
        Some(stage) => Some(Matched { rules: matched, stage }),
        None if !any_rule => Some(Matched { rules: 0, stage: cfg.stage }),
        None => None,
    }
}

/// Follow a [`ValueSource`]: its base, `depth` dereferences, then `add`.
#[inline(always)]
fn resolve(src: &ValueSource, args: &Args, ret: i64, key: u64) -> Option<u64> {
    let mut value = match src.base {
        base::ARG => args.get(src.index as usize)?,
        base::RET => ret as u64,
        base::KEY => key,
        _ => return None,
    };
    for (n, offset) in src.offsets.iter().enumerate() {
        if n >= src.depth as usize || n >= MAX_DEREF {
            break;
        }
        let at = value.wrapping_add(*offset as u64);
        // SAFETY: a user-memory read; failure is reported, not a fault.
        value = unsafe { bpf_probe_read_user(at as *const u64) }.ok()?;
    }
    Some(value.wrapping_add(src.add as u64))
}

#[inline(always)]
fn emit(slot: u32, cfg: &SlotConfig, args: &Args, ret: i64, matched: Matched) {
    let Some(key) = resolve(&cfg.key, args, ret, 0) else {
        bump(counter::KEY_UNREADABLE);
        return;
    };
    let pid_tgid = bpf_get_current_pid_tgid();
    if cfg.flags & slot_flags::EXT_PICKLE != 0 {
        // A signal (the profile allows it nowhere else): one event per
        // record, nothing tracked.
        if let Some(at) = ext_at(cfg, args, ret, key) {
            emit_pickle(slot, at, key, ret, pid_tgid);
        }
        return;
    }
    let request = RequestKey { key, pid: (pid_tgid >> 32) as u32, _pad: 0 };
    let only_on_change = cfg.flags & slot_flags::ONLY_ON_CHANGE != 0;
    // A signal is the agent's alone: no in-flight entry, no last event.
    let lifecycle = matched.stage != stage::SIGNAL;
    // The request's entry, looked up once for everything below that needs
    // it. A map value stays valid while the program runs (RCU), even if
    // another CPU deletes it meanwhile.
    let held = if lifecycle || only_on_change { INFLIGHT.get_ptr_mut(&request) } else { None };
    // SAFETY: read only, see above.
    let held_ref = held.map(|entry| unsafe { &*entry });
    if only_on_change && unchanged(held_ref, &request, slot, ret) {
        bump(counter::UNCHANGED);
        return;
    }
    // The kernel and the agent keep a request's first external id: once
    // its live entry has one, reading it again (a string copy from the
    // target) is wasted.
    let wants_ext = cfg.flags & slot_flags::HAS_EXT != 0
        && !(lifecycle && held_ref.is_some_and(|entry| entry.ended == 0 && entry.has_ext != 0));
    // SAFETY: the helper only reads the clock.
    let ts = unsafe { bpf_ktime_get_ns() };
    let ends = lifecycle && (matched.stage >= stage::FIRST_TERMINAL || cfg.flags & slot_flags::ENDS != 0);
    let live = held_ref.filter(|entry| entry.ended == 0);
    let emitted = LastEmitted { ret, slot, _pad: 0 };
    // A quiet slot's event that only moves a busy request the agent knows
    // along stays in its entry: the ring-buffer record is most of what an
    // emitting probe costs the target.
    if lifecycle
        && !ends
        && !wants_ext
        && cfg.flags & slot_flags::QUIET != 0
        && live.is_some_and(|entry| {
            entry.withheld & withheld::UNKNOWN == 0 && ts.saturating_sub(entry.last_ns) < cfg.quiet_ns
        })
    {
        bump(counter::WITHHELD);
        track(&request, held, matched.stage, ends, ts, None, Delivery::Withheld(emitted));
        return;
    }
    // A capture at an element of a msgpack array, found before anything is
    // reserved: a hit whose data is not the array looked for is no event.
    let element = if cfg.flags & slot_flags::EXT_MSGPACK != 0 {
        match ext_at(cfg, args, ret, key).and_then(|at| msgpack_element(&cfg.msgpack, at)) {
            Some(at) => Some(at),
            None => return,
        }
    } else {
        None
    };
    let flags = if cfg.flags & slot_flags::ENDS != 0 { matched.rules | event_flags::ENDS } else { matched.rules };
    let head = Head { ts_ns: ts, key, ret, pid_tgid, slot, flags, stage: matched.stage };
    let Some(mut entry) = reserve(&head) else {
        // The agent misses this event, but the in-flight table need not;
        // it is not recorded as emitted, so a poll answering the same
        // again is sent again.
        if lifecycle {
            track(&request, held, matched.stage, ends, ts, None, Delivery::Lost);
        }
        return;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: `event` points at a reserved, exclusively owned ring-buffer
    // record of the right size, its head written; `ext` is written here,
    // all but its tail.
    unsafe {
        (*event).ext[0] = 0;
        // The external id, or else the stage times withheld before this
        // record (they share the field): a record that reads the id leaves
        // the times in the entry for the next.
        let mut carried = false;
        if wants_ext && guard_holds(cfg, args, ret, key) {
            let bytes = cfg.flags & slot_flags::EXT_BYTES != 0;
            match element.or_else(|| ext_at(cfg, args, ret, key)) {
                Some(at) if bytes && read_bytes_to_page_end(at, &mut (*event).ext) => {
                    (*event).flags |= event_flags::HAS_EXT | event_flags::EXT_BYTES;
                }
                Some(at) if bpf_probe_read_user_str_bytes(at as *const u8, &mut (*event).ext).is_ok() => {
                    (*event).flags |= event_flags::HAS_EXT;
                }
                // Delivered all the same, without the id.
                _ => bump(counter::EXT_UNREADABLE),
            }
        } else if let Some(held) = live {
            let bits = held.withheld & withheld::STAGES;
            if bits != 0 {
                let mut times = [0u64; stage::LIVE];
                for (n, at) in times.iter_mut().enumerate() {
                    if bits & (1 << n) != 0 {
                        *at = held.stage_ns[n];
                    }
                }
                // `ext` is 8-aligned in the record (offset 48), and longer.
                *(*event).ext.as_mut_ptr().cast::<[u64; stage::LIVE]>() = times;
                (*event).flags |= event_flags::WITHHELD;
                carried = true;
            }
        }
        if lifecycle {
            // Before the submit: once submitted the record is the agent's.
            let ext = if (*event).flags & event_flags::HAS_EXT != 0 { Some(&(*event).ext) } else { None };
            track(&request, held, matched.stage, ends, ts, ext, Delivery::Sent { last: emitted, carried });
        }
    }
    submit(entry);
    if only_on_change && ends {
        let _ = LAST.insert(&request, &emitted, 0);
    }
}

/// The bytes of an `EXT_BYTES` capture: [`EXT_ID_LEN`] at `at`, or, where
/// they run into a page that cannot be read (one the process never
/// touched: a probe cannot fault it in), those before that page and the
/// rest zero. A field near its buffer's end is read so wherever the
/// buffer ends: an SGLang msgpack request's `bootstrap_room` is 39 bytes
/// before its frame's end, in libzmq's fresh receive buffer.
#[inline(always)]
fn read_bytes_to_page_end(at: u64, out: &mut [u8; EXT_ID_LEN]) -> bool {
    /// The smallest page there is: a boundary of any larger page is one.
    const PAGE: u64 = 4096;
    // SAFETY: the helper writes at most `out`'s length into it.
    if unsafe { bpf_probe_read_user_buf(at as *const u8, out) }.is_ok() {
        return true;
    }
    let left = (PAGE - (at & (PAGE - 1))) as usize;
    if left >= EXT_ID_LEN {
        return false;
    }
    *out = [0; EXT_ID_LEN];
    // SAFETY: as above; `left` < EXT_ID_LEN, a power of two, so the mask
    // keeps it and shows the verifier the bound.
    unsafe { bpf_probe_read_user_buf(at as *const u8, &mut out[..left & (EXT_ID_LEN - 1)]) }.is_ok()
}

/// What became of the event [`track`] records, as its entry keeps it.
enum Delivery {
    /// In the ring buffer; `carried`: with the stage times withheld
    /// before it (a record with an external id leaves them to the next).
    Sent { last: LastEmitted, carried: bool },
    /// Kept in the entry only ([`slot_flags::QUIET`]).
    Withheld(LastEmitted),
    /// Lost (the ring buffer was full); the next record sent for the
    /// request carries its stage's time, if it was the first.
    Lost,
}

/// Whether the last event emitted for `request` was this slot's with this
/// return value: what the request's in-flight entry (`held`) says, or, once
/// its lifecycle has ended (no entry), what ended it.
#[inline(always)]
fn unchanged(held: Option<&InflightEntry>, request: &RequestKey, slot: u32, ret: i64) -> bool {
    match held {
        Some(entry) => entry.last_slot == slot && entry.last_ret == ret,
        None => unsafe { LAST.get(request) }.is_some_and(|last| last.slot == slot && last.ret == ret),
    }
}

/// Keep the in-flight table: an event that leaves the lifecycle live
/// creates or advances the request's entry, one that `ends` it (a terminal
/// stage, or a slot's `ENDS`) deletes it (or, while the agent's stall alert
/// for it is out, marks it ended for the agent to collect). `held` is the
/// request's entry as the event's lookup found it. The entry records the
/// event as `delivery` says.
#[inline(always)]
fn track(
    request: &RequestKey,
    held: Option<*mut InflightEntry>,
    stage: u8,
    ends: bool,
    ts: u64,
    ext: Option<&[u8; EXT_ID_LEN]>,
    delivery: Delivery,
) {
    if ends {
        // SAFETY: only tested for presence.
        if unsafe { ALERTED.get(request) }.is_some() {
            if let Some(entry) = held {
                // SAFETY: a map value; concurrent writers race benignly
                // (whole u64/u8 fields, the agent reads them as a hint).
                let entry = unsafe { &mut *entry };
                entry.stage = stage;
                entry.ended = 1;
                if ts > entry.last_ns {
                    entry.last_ns = ts;
                }
                note_delivery(entry, stage, false, &delivery);
            }
        } else {
            let _ = INFLIGHT.remove(request);
        }
        return;
    }
    if let Some(entry) = held {
        // SAFETY: as above.
        let entry = unsafe { &mut *entry };
        if entry.ended == 0 {
            if ts > entry.last_ns {
                entry.last_ns = ts;
            }
            if stage > entry.stage {
                entry.stage = stage;
            }
            let first = note_stage_time(&mut entry.stage_ns, stage, ts);
            if let (0, Some(ext)) = (entry.has_ext, ext) {
                entry.ext = *ext;
                entry.has_ext = 1;
            }
            note_delivery(entry, stage, first, &delivery);
            return;
        }
        // An ended entry kept for the agent: the key's next lifecycle
        // replaces it.
    }
    let mut entry = InflightEntry {
        first_ns: ts,
        last_ns: ts,
        stage_ns: [0; stage::LIVE],
        last_ret: 0,
        last_slot: NOT_EMITTED,
        stage,
        has_ext: 0,
        ended: 0,
        withheld: 0,
        ext: [0; EXT_ID_LEN],
    };
    note_stage_time(&mut entry.stage_ns, stage, ts);
    note_delivery(&mut entry, stage, true, &delivery);
    if let Delivery::Lost = delivery {
        entry.withheld |= withheld::UNKNOWN;
    }
    if let Some(ext) = ext {
        entry.ext = *ext;
        entry.has_ext = 1;
    }
    if INFLIGHT.insert(request, &entry, 0).is_err() {
        bump(counter::STATE_FULL);
        // Without an entry, an `ONLY_ON_CHANGE` slot compares with `LAST`:
        // what ended an earlier lifecycle of this key must not suppress
        // this one's events.
        let _ = LAST.remove(request);
    }
}

/// Record how the event of `stage` was delivered: the last event an
/// `ONLY_ON_CHANGE` slot compares with (sent or withheld, not lost), and
/// whether the agent still lacks the stage's first time (`first`: this
/// event set it). A record sent carries every time withheld before it.
#[inline(always)]
fn note_delivery(entry: &mut InflightEntry, stage: u8, first: bool, delivery: &Delivery) {
    match delivery {
        Delivery::Sent { last, carried } => {
            entry.last_ret = last.ret;
            entry.last_slot = last.slot;
            // The agent knows of the request now.
            entry.withheld &= if *carried { 0 } else { withheld::STAGES };
        }
        Delivery::Withheld(last) => {
            entry.last_ret = last.ret;
            entry.last_slot = last.slot;
            if first {
                entry.withheld |= stage_bit(stage);
            }
        }
        Delivery::Lost => {
            if first {
                entry.withheld |= stage_bit(stage);
            }
        }
    }
}

/// The [`withheld::STAGES`] bit of a live stage.
#[inline(always)]
fn stage_bit(stage: u8) -> u8 {
    (1u8 << (stage & 7)) & withheld::STAGES
}

/// When a live stage was first seen, unless it already has a time; true
/// when this set it. A walk with constant offsets: LLVM turns
/// `get_mut(stage as usize)` into a variable offset whose bound the
/// verifier cannot follow.
#[inline(always)]
fn note_stage_time(times: &mut [u64; stage::LIVE], stage: u8, ts: u64) -> bool {
    let mut set = false;
    for (n, at) in times.iter_mut().enumerate() {
        if n == usize::from(stage) && *at == 0 {
            *at = ts;
            set = true;
        }
    }
    set
}

/// The address of element `m.element` of the msgpack array at `at`, if
/// that is an array long enough whose element 0 is the string `m.tag`: the
/// elements before it are skipped header by header, nested ones included,
/// at most [`MSGPACK_STEPS`] headers (one user read each).
#[inline(always)]
fn msgpack_element(m: &MsgpackElement, at: u64) -> Option<u64> {
    let (len, header) = msgpack::array(&read_head(at)?)?;
    if u64::from(m.element) >= len {
        return None;
    }
    let pos = at.wrapping_add(header);
    if m.tag_len > 0 {
        let (n, header) = msgpack::str(&read_head(pos)?)?;
        if n != u64::from(m.tag_len) {
            return None;
        }
        // SAFETY: a user-memory read; failure means "no such array".
        let tag: [u8; MSGPACK_TAG_LEN] = unsafe { bpf_probe_read_user(pos.wrapping_add(header) as *const _) }.ok()?;
        for (i, (got, want)) in tag.iter().zip(m.tag.iter()).enumerate() {
            if (i as u64) < n && got != want {
                return None;
            }
        }
    }
    let mut walk = Walk { pos, skip: u64::from(m.element) };
    // A loop the verifier checks once (`bpf_loop`), not once per turn: an
    // unrolled walk of this many headers is past what it accepts.
    // SAFETY: the callback has the signature `bpf_loop` calls it with, and
    // its context is `walk`, alive until the helper returns.
    unsafe {
        let step: unsafe extern "C" fn(u64, *mut c_void) -> i64 = msgpack_step;
        bpf_loop(MSGPACK_STEPS, step as *mut c_void, (&raw mut walk).cast(), 0);
    }
    (walk.skip == 0).then_some(walk.pos)
}

/// Where a msgpack walk is: the next header, and how many elements remain
/// to be skipped before the one looked for (nested ones included).
#[repr(C)]
struct Walk {
    pos: u64,
    skip: u64,
}

/// One header of a walk ([`msgpack_element`]): skip the element there.
/// Stops (1) once nothing remains to skip, or at a header that cannot be
/// read (the walk then fails: `skip` stays above 0).
#[inline(never)]
unsafe extern "C" fn msgpack_step(_turn: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `Walk` that `msgpack_element` handed `bpf_loop`.
    let walk = unsafe { &mut *ctx.cast::<Walk>() };
    if walk.skip == 0 {
        return 1;
    }
    let Some((size, nested)) = read_head(walk.pos).and_then(|head| msgpack::element(&head)) else {
        return 1;
    };
    walk.pos = walk.pos.wrapping_add(size);
    walk.skip = (walk.skip - 1).saturating_add(nested);
    0
}

/// A signal's strings ([`StringWalk`]): one record per chunk of every
/// string found, each a signal of the slot (value: the slot's key), the
/// chunk's place in `ret`. A container with nothing in it costs one read.
#[inline(always)]
fn walk_strings(slot: u32, cfg: &SlotConfig, args: &Args, ret: i64) {
    let Some(key) = resolve(&cfg.key, args, ret, 0) else {
        bump(counter::KEY_UNREADABLE);
        return;
    };
    let Some(at) = resolve(&cfg.ext, args, ret, key) else {
        bump(counter::EXT_UNREADABLE);
        return;
    };
    let Some(walk) = STRINGS_WALK.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's scratch; a program preempted mid-walk by another
    // on the same CPU finds `owner` changed and stops (its strings arrive
    // cut short, which the agent says).
    let walk = unsafe { &mut *walk };
    let w: &StringWalk = &cfg.strings;
    let pid_tgid = bpf_get_current_pid_tgid();
    walk.w = *w;
    walk.container = at;
    walk.node = 0;
    walk.started = 0;
    walk.item = 0;
    walk.end = 0;
    walk.nodes_left = u32::from(w.nodes);
    walk.items_left = 0;
    walk.data = 0;
    walk.len = 0;
    walk.chunk = 0;
    walk.seq = 0;
    walk.key = key;
    walk.owner = pid_tgid;
    walk.slot = slot;
    // SAFETY: the helper only reads the clock.
    walk.ts = unsafe { bpf_ktime_get_ns() };
    if w.list == 0 {
        // One string, at the container itself.
        walk.item = at;
        walk.end = at.wrapping_add(1);
        walk.items_left = 1;
        walk.started = 1;
        walk.nodes_left = 0;
        walk.w.stride = 1;
    }
    let mut owner = pid_tgid;
    // The walk's state lives in a map, not on the stack: the verifier
    // then checks the callback once, where it would follow the counters
    // of a stack context turn by turn past its limits.
    // SAFETY: as in `msgpack_element`: the context lives until the
    // helper returns.
    unsafe {
        let step: unsafe extern "C" fn(u64, *mut c_void) -> i64 = strings_step;
        bpf_loop(STRINGS_STEPS, step as *mut c_void, (&raw mut owner).cast(), 0);
    }
}

/// The state of the [`walk_strings`] running on this CPU.
#[map]
static STRINGS_WALK: PerCpuArray<Strings> = PerCpuArray::with_max_entries(1, 0);

/// Where a [`walk_strings`] is.
#[repr(C)]
struct Strings {
    w: StringWalk,
    container: u64,
    /// The current node, and whether the first was read (`started`).
    node: u64,
    started: u64,
    /// The next string of the node's array, and the array's end.
    item: u64,
    end: u64,
    nodes_left: u32,
    items_left: u32,
    /// The string being sent, its length, and its next chunk.
    data: u64,
    len: u64,
    chunk: u32,
    /// Strings begun so far (the current one is `seq - 1`).
    seq: u32,
    key: u64,
    /// The thread walking.
    owner: u64,
    slot: u32,
    ts: u64,
}

/// One turn of a [`walk_strings`]: send the current string's next chunk,
/// else begin the next string, else move to the next node; stop (1) at
/// the end or at anything that cannot be read.
#[inline(never)]
unsafe extern "C" fn strings_step(_turn: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the walking thread's id that `walk_strings` handed
    // `bpf_loop`; the state is this CPU's scratch.
    let owner = unsafe { *ctx.cast::<u64>() };
    let Some(s) = STRINGS_WALK.get_ptr_mut(0) else { return 1 };
    // SAFETY: as in `walk_strings`.
    let s = unsafe { &mut *s };
    if s.owner != owner {
        return 1;
    }
    let sent = u64::from(s.chunk) * CHUNK_LEN;
    if s.data != 0 && sent < s.len && s.chunk < u32::from(s.w.chunks) {
        let last = sent + CHUNK_LEN >= s.len || s.chunk + 1 >= u32::from(s.w.chunks);
        send_chunk(s, s.data.wrapping_add(sent), last);
        s.chunk += 1;
        return 0;
    }
    s.data = 0;
    if s.items_left > 0 && s.item < s.end {
        let string = s.item;
        s.item = s.item.wrapping_add(u64::from(s.w.stride));
        s.items_left -= 1;
        // SAFETY: user-memory reads; failure ends the walk.
        let Ok(data) = (unsafe { bpf_probe_read_user(string as *const u64) }) else { return 1 };
        let Ok(len) = (unsafe { bpf_probe_read_user(string.wrapping_add(s.w.length as u64) as *const u64) }) else {
            return 1;
        };
        s.data = data;
        s.len = len;
        s.chunk = 0;
        s.seq += 1;
        if len == 0 {
            send_chunk(s, 0, true);
        }
        return 0;
    }
    if s.nodes_left == 0 {
        return 1;
    }
    s.nodes_left -= 1;
    let from =
        if s.started == 0 { s.container.wrapping_add(s.w.first as u64) } else { s.node.wrapping_add(s.w.next as u64) };
    s.started = 1;
    // SAFETY: user-memory reads; failure ends the walk.
    let Ok(node) = (unsafe { bpf_probe_read_user(from as *const u64) }) else { return 1 };
    if node == 0 {
        return 1;
    }
    s.node = node;
    let Ok(begin) = (unsafe { bpf_probe_read_user(node.wrapping_add(s.w.begin as u64) as *const u64) }) else {
        return 1;
    };
    let Ok(end) = (unsafe { bpf_probe_read_user(node.wrapping_add(s.w.end as u64) as *const u64) }) else {
        return 1;
    };
    s.item = begin;
    s.end = end;
    s.items_left = u32::from(s.w.items);
    0
}

/// One chunk record of a string walk (`at` 0: an empty string).
#[inline(always)]
fn send_chunk(s: &Strings, at: u64, last: bool) {
    let head = Head {
        ts_ns: s.ts,
        key: s.key,
        ret: chunk::pack(s.len, s.seq.wrapping_sub(1), s.chunk, last),
        pid_tgid: s.owner,
        slot: s.slot,
        flags: event_flags::HAS_EXT | event_flags::CHUNK | if s.w.raw != 0 { event_flags::RAW } else { 0 },
        stage: stage::SIGNAL,
    };
    let Some(mut entry) = reserve(&head) else { return };
    let event = entry.as_mut_ptr();
    // SAFETY: a reserved, exclusively owned record, its head written; all
    // of `ext` but its tail is written here.
    unsafe {
        (*event).ext[0] = 0;
        if at != 0 {
            let read = if s.w.raw != 0 {
                // Bytes, NULs and all: exactly the chunk's share, never
                // past the string's end (which may end its mapping).
                let left = s.len.saturating_sub(u64::from(s.chunk) * CHUNK_LEN).min(CHUNK_LEN) as usize;
                match (*event).ext.get_mut(..left) {
                    Some(dst) => bpf_probe_read_user_buf(at as *const u8, dst).is_ok(),
                    None => false,
                }
            } else {
                bpf_probe_read_user_str_bytes(at as *const u8, &mut (*event).ext).is_ok()
            };
            if !read {
                bump(counter::EXT_UNREADABLE);
            }
        }
    }
    submit(entry);
}

/// A msgpack header's bytes at `at`.
#[inline(always)]
fn read_head(at: u64) -> Option<[u8; MSGPACK_HEAD]> {
    // SAFETY: a user-memory read; failure is reported, not a fault.
    unsafe { bpf_probe_read_user(at as *const [u8; MSGPACK_HEAD]) }.ok()
}

/// The records a pickle walk fills, per CPU: too large for the stack.
#[repr(C)]
pub struct PickleRecords {
    records: [[u8; EXT_ID_LEN]; PICKLE_RECORDS],
    /// The walk's state: in a map value, not on the stack (the programs'
    /// own leave too little room), which also makes every field an unknown
    /// to the verifier, so it checks the callback once, not once per
    /// combination of their values.
    walk: PickleWalk,
    /// A string the walk compares with its names (off the callback's
    /// stack, which the programs' own leaves little room for).
    name: [u64; PICKLE_NAME_LEN / 8],
    /// The opcode the walk is at.
    head: [u8; PICKLE_HEAD],
}

#[map]
static PICKLE_SCRATCH: PerCpuArray<PickleRecords> = PerCpuArray::with_max_entries(1, 0);

/// Where a pickle walk ([`emit_pickle`]) is.
#[repr(C)]
struct PickleWalk {
    slot: u32,
    steps: u32,
    pos: u64,
    /// MEMOIZE opcodes passed: the index the next one stores at.
    memo: u64,
    /// Each key's memo index once its string was memoized (`u64::MAX`:
    /// not yet).
    key_memo: [u64; PICKLE_KEYS],
    /// Records complete (emitted after the walk).
    records: u32,
    /// 1 + the key whose string was the last opcode (its memo store, if
    /// any, comes next, then its value).
    pending: u8,
    /// 1 + the tag matched; 0: none yet.
    tag: u8,
    /// Keys in the record being filled (bit per key).
    have: u8,
    /// In the list of an `items` key.
    in_items: u8,
    /// `MARK`s open: how deep in containers the walk is.
    marks: u32,
    /// The walk is done once fewer marks than this are open: set when a
    /// request's record is complete, to the marks open at a batch's list
    /// of requests (its element's own dict is one deeper; fewer, and the
    /// list is done), or past any count for a request on its own. 0: no
    /// record complete yet.
    batch_marks: u32,
}

/// Walk the pickle at `at` ([`PickleCapture`](stallwatch_common::PickleCapture))
/// and emit one signal event per record, with the tag matched in its flags.
#[inline(always)]
fn emit_pickle(slot: u32, at: u64, key: u64, ret: i64, pid_tgid: u64) {
    // Anything but a pickle costs one read.
    match unsafe { bpf_probe_read_user(at as *const u8) } {
        Ok(pickle::PROTO) => {}
        _ => return,
    }
    let Some(scratch) = PICKLE_SCRATCH.get_ptr_mut(0) else { return };
    // SAFETY: a per-CPU map value, this program its only user on this CPU
    // (the callback reaches it the same way).
    unsafe {
        (*scratch).walk = PickleWalk {
            slot,
            steps: 0,
            pos: at,
            memo: 0,
            key_memo: [u64::MAX; PICKLE_KEYS],
            records: 0,
            pending: 0,
            tag: 0,
            have: 0,
            in_items: 0,
            marks: 0,
            batch_marks: 0,
        };
    }
    // SAFETY: as in `msgpack_element`.
    unsafe {
        let step: unsafe extern "C" fn(u64, *mut c_void) -> i64 = pickle_step;
        bpf_loop(PICKLE_STEPS, step as *mut c_void, core::ptr::null_mut(), 0);
    }
    // SAFETY: as above.
    let walk = unsafe { &mut (*scratch).walk };
    if walk.have != 0 {
        walk.records += 1;
    }
    if walk.tag == 0 || walk.records == 0 {
        return;
    }
    // SAFETY: the helper only reads the clock.
    let ts = unsafe { bpf_ktime_get_ns() };
    let tag_flag = event_flags::PICKLE_TAG << ((walk.tag - 1) & 1);
    let flags = tag_flag | event_flags::HAS_EXT | event_flags::EXT_BYTES;
    let head = Head { ts_ns: ts, key, ret, pid_tgid, slot, flags, stage: stage::SIGNAL };
    for n in 0..PICKLE_RECORDS {
        if n as u32 >= walk.records {
            break;
        }
        let Some(mut entry) = reserve(&head) else { return };
        let event = entry.as_mut_ptr();
        // SAFETY: a reserved record, its head written, all of `ext` here;
        // `scratch` a per-CPU map value no one else writes while this runs.
        unsafe {
            words_copy(&mut (*event).ext, &(*scratch).records[n]);
        }
        submit(entry);
    }
}

/// Everything a ring-buffer record says but its `ext`: the three writers
/// (a probe's event in [`emit`], a string chunk in [`send_chunk`], a pickle
/// record in [`emit_pickle`]) fill it through [`reserve`], the one place
/// that writes these fields, so a field added to [`Event`] is added there.
struct Head {
    ts_ns: u64,
    key: u64,
    ret: i64,
    /// `bpf_get_current_pid_tgid()` of the thread that hit the probe.
    pid_tgid: u64,
    slot: u32,
    flags: u32,
    stage: u8,
}

/// A ring-buffer record reserved with `head` written, its `ext` the
/// caller's to fill; `None` (counted) when the buffer is full.
#[inline(always)]
fn reserve(head: &Head) -> Option<RingBufEntry<Event>> {
    let Some(mut entry) = EVENTS.reserve::<Event>(0) else {
        bump(counter::RINGBUF_FULL);
        return None;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: `event` points at a reserved, exclusively owned ring-buffer
    // record of the right size; the fields written here are all but `ext`
    // (and the padding, which no reader looks at).
    unsafe {
        (*event).ts_ns = head.ts_ns;
        (*event).key = head.key;
        (*event).ret = head.ret;
        (*event).pid = (head.pid_tgid >> 32) as u32;
        (*event).tid = head.pid_tgid as u32;
        (*event).slot = head.slot;
        (*event).flags = head.flags;
        (*event).stage = head.stage;
    }
    Some(entry)
}

/// Hand a record to the agent, waking it only past [`WAKEUP_AT`].
#[inline(always)]
fn submit(entry: RingBufEntry<Event>) {
    let wakeup =
        if EVENTS.query(u64::from(BPF_RB_AVAIL_DATA)) >= WAKEUP_AT { BPF_RB_FORCE_WAKEUP } else { BPF_RB_NO_WAKEUP };
    entry.submit(u64::from(wakeup));
}

/// A record zeroed word by word: as `= [0; 64]`, LLVM calls a memset
/// that loops byte by byte, and the verifier walks each turn.
#[inline(always)]
fn words_zero(record: &mut [u8; EXT_ID_LEN]) {
    let words = record.as_mut_ptr().cast::<u64>();
    // SAFETY: 8 aligned-or-not u64 writes inside the 64 bytes.
    unsafe {
        for i in [0, 1, 2, 3, 4, 5, 6, 7] {
            core::ptr::write_volatile(words.add(i), 0);
        }
    }
}

/// A record copied word by word (see [`words_zero`]).
#[inline(always)]
fn words_copy(to: &mut [u8; EXT_ID_LEN], from: &[u8; EXT_ID_LEN]) {
    let (to, from) = (to.as_mut_ptr().cast::<u64>(), from.as_ptr().cast::<u64>());
    // SAFETY: 8 u64 reads and writes inside the two 64-byte arrays.
    unsafe {
        for i in [0, 1, 2, 3, 4, 5, 6, 7] {
            core::ptr::write_volatile(to.add(i), core::ptr::read_volatile(from.add(i)));
        }
    }
}

/// Whether `got` (a string of `len` bytes) is `name` (`name_len` long).
#[inline(always)]
fn pickle_name_is(got: &[u64; PICKLE_NAME_LEN / 8], len: u64, name: &[u8; PICKLE_NAME_LEN], name_len: u8) -> bool {
    // Word by word, with a mask of the name's bytes: a loop over bytes is
    // one LLVM keeps, which the verifier walks turn by turn on every path.
    const _: () = assert!(PICKLE_NAME_LEN == 32);
    let word = |w: usize| {
        // SAFETY: an unaligned read of 8 of the name's 32 bytes.
        let name = unsafe { core::ptr::read_unaligned(name.as_ptr().add(8 * w).cast::<u64>()) };
        let n = len.saturating_sub(8 * w as u64);
        let mask = if n >= 8 { u64::MAX } else { (1u64 << (8 * n)) - 1 };
        (got[w] ^ name) & mask
    };
    name_len != 0 && len == u64::from(name_len) && (word(0) | word(1) | word(2) | word(3)) == 0
}

/// Which of `names` (1 + its index; 0: none) the string at `at`, `len`
/// bytes, is: one read for all of them.
#[inline(always)]
fn pickle_which(at: u64, len: u64, names: &[[u8; PICKLE_NAME_LEN]; 2], lens: &[u8; 2]) -> u8 {
    if len == 0 || len > PICKLE_NAME_LEN as u64 || (len != u64::from(lens[0]) && len != u64::from(lens[1])) {
        return 0;
    }
    let Some(scratch) = PICKLE_SCRATCH.get_ptr_mut(0) else { return 0 };
    // SAFETY: a per-CPU map value; a user-memory read into it, whose
    // failure means "none of them".
    let got = unsafe { &mut (*scratch).name };
    if unsafe {
        bpf_probe_read_user_buf(
            at as *const u8,
            core::slice::from_raw_parts_mut(got.as_mut_ptr().cast(), PICKLE_NAME_LEN),
        )
    }
    .is_err()
    {
        return 0;
    }
    if pickle_name_is(got, len, &names[0], lens[0]) {
        1
    } else if pickle_name_is(got, len, &names[1], lens[1]) {
        2
    } else {
        0
    }
}

/// Read key `k`'s value at `at` into the record being filled.
#[inline(always)]
fn pickle_capture(walk: &mut PickleWalk, cfg: &SlotConfig, k: usize, at: u64) {
    let all: u8 = if cfg.pickle.key_lens[1] != 0 { 3 } else { 1 };
    let bit = 1u8 << (k & 1);
    if walk.have & bit != 0 {
        // The key again: a batch's next element.
        walk.records += 1;
        walk.have = 0;
    }
    if walk.records as usize >= PICKLE_RECORDS {
        return;
    }
    let Some(scratch) = PICKLE_SCRATCH.get_ptr_mut(0) else { return };
    // A volatile read, so the mask stays: LLVM would drop it after the
    // check above, and the verifier loses that check's bound on the way.
    let index = unsafe { core::ptr::read_volatile(&walk.records) } as usize & (PICKLE_RECORDS - 1);
    // SAFETY: per-CPU map value, this program its only user on this CPU.
    let record = unsafe { &mut (*scratch).records[index] };
    if walk.have == 0 {
        words_zero(record);
    }
    let whole = all == 1 || cfg.pickle.items != 0;
    let (from, to) = if whole {
        (0, EXT_ID_LEN)
    } else if k == 0 {
        (0, PICKLE_FIRST_WIDTH)
    } else {
        (PICKLE_FIRST_WIDTH, EXT_ID_LEN)
    };
    // SAFETY: a user-memory read into the record; a failed one leaves zeros.
    let _ = unsafe { bpf_probe_read_user_buf(at as *const u8, &mut record[from..to]) };
    walk.have |= bit;
    if walk.have == all || cfg.pickle.items != 0 {
        walk.records += 1;
        walk.have = 0;
        if cfg.pickle.items == 0 {
            // A request's record is complete, in its dict (`marks` deep):
            // alone (the outermost container), nothing follows; in a
            // batch, the next one's comes in the list one mark up.
            walk.batch_marks = if walk.marks <= 1 { u32::MAX } else { walk.marks - 1 };
        }
    }
}

/// One opcode of a pickle walk ([`emit_pickle`]). Stops (1) at the
/// pickle's end, at an opcode it cannot size, once the records are full,
/// at an `items` list's end, when no tag matched within
/// [`PICKLE_TAG_STEPS`] opcodes, or once every request of the frame has
/// its record: at once for a request on its own (its dict is the
/// outermost container open), at the end of a batch's list of them.
/// The rest of a request (its fields after `bootstrap_room` and `rid`,
/// a third of its opcodes in sglang 0.5.23) is never read.
#[inline(never)]
unsafe extern "C" fn pickle_step(_turn: u64, _ctx: *mut c_void) -> i64 {
    let Some(scratch) = PICKLE_SCRATCH.get_ptr_mut(0) else { return 1 };
    // SAFETY: the walk `emit_pickle` set up, in a per-CPU map value.
    let walk = unsafe { &mut (*scratch).walk };
    let Some(cfg) = SLOTS.get(walk.slot) else { return 1 };
    // Every request's record read (see `batch_marks`), or no room for more.
    if walk.marks < walk.batch_marks || walk.records as usize >= PICKLE_RECORDS {
        return 1;
    }
    walk.steps += 1;
    if walk.tag == 0 && walk.steps > PICKLE_TAG_STEPS {
        return 1;
    }
    // SAFETY: a user-memory read into the map value (the stack has no
    // room); failure ends the walk.
    let head = unsafe { &mut (*scratch).head };
    if unsafe { bpf_probe_read_user_buf(walk.pos as *const u8, head) }.is_err() {
        return 1;
    }
    let Some((size, kind)) = pickle::op(head) else { return 1 };
    let opcode = head[0];
    let here = walk.pos;
    let next = here.wrapping_add(size);
    walk.pos = next;
    // What this opcode captures, if anything: (1 + key, where its value is).
    let mut capture: (u8, u64) = (0, 0);
    let mut stop = false;
    match kind {
        pickle::Kind::Mark => walk.marks += 1,
        pickle::Kind::PopMark => walk.marks = walk.marks.saturating_sub(1),
        _ => {}
    }
    if walk.pending != 0 {
        // The value of the key just passed, after its memo store if any.
        let k = usize::from((walk.pending - 1) & 1);
        capture = (walk.pending, here);
        walk.pending = 0;
        match kind {
            pickle::Kind::Memoize => {
                walk.key_memo[k] = walk.memo;
                capture.1 = next;
            }
            pickle::Kind::Put(index) => {
                walk.key_memo[k] = index;
                capture.1 = next;
            }
            _ => {}
        }
    }
    match kind {
        pickle::Kind::Stop => stop = true,
        pickle::Kind::Memoize => walk.memo += 1,
        pickle::Kind::Str { len, header } => {
            let at = here.wrapping_add(header);
            if walk.tag == 0 {
                walk.tag = pickle_which(at, len, &cfg.pickle.tags, &cfg.pickle.tag_lens);
            } else if walk.in_items != 0 {
                capture = (1, here);
            } else {
                let key = pickle_which(at, len, &cfg.pickle.keys, &cfg.pickle.key_lens);
                if key != 0 {
                    walk.pending = key;
                    walk.in_items = cfg.pickle.items;
                }
            }
        }
        pickle::Kind::Get(index) if walk.tag != 0 && walk.in_items == 0 => {
            let key = if walk.key_memo[0] == index {
                1
            } else if walk.key_memo[1] == index {
                2
            } else {
                0
            };
            if key != 0 {
                if cfg.pickle.items != 0 {
                    walk.in_items = 1;
                } else {
                    capture = (key, next);
                }
            }
        }
        _ if walk.in_items != 0 => {
            // A list's own opcodes, and memo references (items read
            // before: not captured); anything else ends it.
            stop = !matches!(opcode, pickle::EMPTY_LIST | pickle::MARK | pickle::APPEND | pickle::APPENDS)
                && !matches!(kind, pickle::Kind::Get(_) | pickle::Kind::Put(_));
        }
        _ => {}
    }
    if capture.0 != 0 {
        pickle_capture(walk, cfg, usize::from((capture.0 - 1) & 1), capture.1);
    }
    i64::from(stop)
}

#[inline(always)]
fn guard_holds(cfg: &SlotConfig, args: &Args, ret: i64, key: u64) -> bool {
    if cfg.flags & slot_flags::HAS_GUARD == 0 {
        return true;
    }
    let Some(at) = resolve(&cfg.guard, args, ret, key) else {
        return false;
    };
    // SAFETY: a user-memory read; failure means "no string".
    matches!(unsafe { bpf_probe_read_user(at as *const u8) }, Ok(flag) if flag != 0)
}

#[inline(always)]
fn count_hit(slot: u32) {
    if let Some(hits) = HITS.get_ptr_mut(slot) {
        // SAFETY: per-CPU slot, no other writer on this CPU while we run.
        unsafe { *hits += 1 };
    }
}

#[inline(always)]
fn bump(index: u32) {
    if let Some(count) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, no other writer on this CPU while we run.
        unsafe { *count += 1 };
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}

/// GPL-compatible, for the user-memory read helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
