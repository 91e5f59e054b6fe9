//! Benchmark of the lifecycle engine, on one core, in simulated time.
//!
//! Prints, in one run:
//! 1. throughput in events/s for a realistic mix: 4 events per lifecycle
//!    (enqueued, transfer_posted, transfer_done, released), many requests
//!    interleaved in a scattered order, handle addresses reused by the next
//!    request (as NIXL's allocator does), a few requests hanging for longer
//!    than the timeout and then resuming (stall, then recovery), and
//!    `advance` called at every 10 ms tick of simulated time;
//! 2. bytes per tracked request with 1 000 000 in flight, from a counting
//!    global allocator (bytes live in the engine / requests);
//! 3. the throughput with 1M in flight against 1k in flight, as a ratio;
//! 4. the event loop's time at a mass stall with status reads: 100 000
//!    requests due in one tick, each one's NIXL handle status read from
//!    memory (`process_vm_readv(2)`, as the agent does, here of handles in
//!    this process laid out as the `nixl` profile's `[status]` says), side
//!    by side: every due request read in the one tick with a call each (the
//!    agent before the read budget), and at most
//!    [`READS_PER_TICK`](stallwatch::evidence::status::READS_PER_TICK) a tick in
//!    batched calls (the agent now). Each read is asked of the kernel's
//!    in-flight table before and after, as the agent does
//!    (`KernelState::is_live`, a `bpf(2)` lookup each, of the eBPF object
//!    loaded here, nothing attached), so (4) needs root.
//!
//! Run: `cargo bench -p stallwatch --bench engine` (about 20 s, as root). Without
//! `--bench` (as under `cargo test --all-targets`) it runs a short smoke
//! version (3 s simulated: no stall; the engine's unit tests cover those;
//! 5 000 due requests for (4), every one of them read and stalled).

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use stallwatch::evidence::status::{READS_PER_TICK, StatusReader};
use stallwatch::kernel::state::KernelState;
use stallwatch::lifecycle::{Engine, EngineConfig, Observation, Report, Silent, Stage, StageRead, StallClass};
use stallwatch::{kernel::Probes, profile::Profile};

/// Counts the bytes the program holds (and the peak), so the engine's
/// footprint is measured rather than estimated.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded unchanged to the system allocator; the
// counters are only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const TICK_NS: u64 = 10_000_000;
const TIMEOUT_NS: u64 = 60_000_000_000;
/// Simulated event rate: 100k events/s, so 1 000 events per 10 ms tick.
const EVENT_GAP_NS: u64 = 10_000;
/// A hanging request resumes after this long (more than the timeout).
const HANG_NS: u64 = 61_000_000_000;
/// One lifecycle in this many hangs at transfer_posted.
const HANG_ONE_IN: u64 = 100_000;
/// Visiting order: slot j, j + STRIDE, ... (mod slots); coprime with 10^k.
const STRIDE: usize = 7_919;
const START_NS: u64 = 1_000_000_000_000;

#[derive(Clone, Copy)]
struct Slot {
    /// The next event this slot emits: 1 posted, 2 done, 3 released (then
    /// a new lifecycle is enqueued under the same key).
    next: u8,
    generation: u32,
    /// Hanging until this time (0: not hanging).
    resume_ns: u64,
}

/// One input to the engine, generated ahead of the timed part.
enum Input {
    Observe(Observation),
    Advance(u64),
}

/// A population of `slots` requests always in flight, each walking its
/// lifecycle in steps; slot j's handle address is reused by each of its
/// successive requests.
struct Workload {
    slots: Vec<Slot>,
    pos: usize,
    now_ns: u64,
    next_tick_ns: u64,
    with_ids: bool,
}

fn key_of(slot: usize) -> u64 {
    0x7f3a_0000_0000 + 64 * slot as u64
}

fn pid_of(slot: usize) -> u32 {
    4000 + (slot % 8) as u32
}

impl Workload {
    fn new(slots: usize, with_ids: bool) -> Workload {
        Workload {
            slots: vec![Slot { next: 1, generation: 0, resume_ns: 0 }; slots],
            pos: 0,
            now_ns: START_NS,
            next_tick_ns: START_NS + TICK_NS,
            with_ids,
        }
    }

    fn push(&mut self, slot: usize, stage: Stage, buf: &mut Vec<Input>) {
        self.now_ns += EVENT_GAP_NS;
        let external_id = (self.with_ids && stage == Stage::Enqueued).then(|| {
            let n = slot as u64 * 1000 + u64::from(self.slots[slot].generation % 1000);
            format!("room-{n:011}").into()
        });
        buf.push(Input::Observe(Observation {
            pid: pid_of(slot),
            key: key_of(slot),
            stage,
            ts_ns: self.now_ns,
            external_id,
            ends: None,
        }));
    }

    /// Enqueue every slot, then move slot j forward by j % 3 stages so the
    /// population is spread over the stages.
    fn fill(&mut self, buf: &mut Vec<Input>) {
        for j in 0..self.slots.len() {
            self.push(j, Stage::Enqueued, buf);
            for _ in 0..j % 3 {
                self.step_slot(j, buf);
            }
        }
    }

    /// Emit `slot`'s next event(s), unless it is hanging.
    fn step_slot(&mut self, j: usize, buf: &mut Vec<Input>) {
        let s = self.slots[j];
        if s.resume_ns > self.now_ns {
            return;
        }
        self.slots[j].resume_ns = 0;
        match s.next {
            1 => {
                self.push(j, Stage::TransferPosted, buf);
                self.slots[j].next = 2;
                let mix = (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(s.generation);
                if mix.is_multiple_of(HANG_ONE_IN) {
                    self.slots[j].resume_ns = self.now_ns + HANG_NS;
                }
            }
            2 => {
                self.push(j, Stage::TransferDone, buf);
                self.slots[j].next = 3;
            }
            _ => {
                self.push(j, Stage::Released, buf);
                self.slots[j].generation = s.generation.wrapping_add(1);
                self.push(j, Stage::Enqueued, buf);
                self.slots[j].next = 1;
            }
        }
    }

    /// Generate about `events` more events into `buf`, with an `Advance` at
    /// every tick of simulated time crossed.
    fn generate(&mut self, buf: &mut Vec<Input>, events: usize) {
        let n = self.slots.len();
        let target = buf.len() + events;
        while buf.len() < target {
            let j = self.pos;
            self.pos = (self.pos + STRIDE) % n;
            self.step_slot(j, buf);
            if self.now_ns >= self.next_tick_ns {
                buf.push(Input::Advance(self.now_ns));
                self.next_tick_ns += TICK_NS;
            }
        }
    }
}

/// Feed `inputs` to the engine; returns (events fed, reports by kind).
fn feed(engine: &mut Engine, inputs: &mut Vec<Input>, out: &mut Vec<Report>) -> (u64, [u64; 3]) {
    let mut events = 0;
    let mut kinds = [0u64; 3];
    for input in inputs.drain(..) {
        match input {
            Input::Observe(o) => {
                engine.observe(o, out);
                events += 1;
            }
            Input::Advance(now) => engine.advance(now, out),
        }
        for r in out.drain(..) {
            let k = match r {
                Report::Stalled { .. } => 0,
                Report::Recovered { .. } => 1,
                Report::Ended { .. } => 2,
            };
            kinds[k] += 1;
            black_box(&r);
        }
    }
    (events, kinds)
}

fn config() -> EngineConfig {
    EngineConfig { timeout_ns: TIMEOUT_NS, max_tracked: 1_000_000, tick_ns: TICK_NS }
}

struct Run {
    in_flight: usize,
    events_per_s: f64,
    events: u64,
    sim_s: f64,
    kinds: [u64; 3],
}

/// Throughput with `slots` requests in flight, measured over `events`
/// events after a fill (the best of `reps` timings, against noise from the
/// machine being shared). Events are generated in batches outside the
/// timed part, so the workload's own bookkeeping is not counted.
fn throughput(slots: usize, events: u64, reps: usize) -> Run {
    const BATCH: usize = 1 << 16;
    let mut best = Run { in_flight: slots, events_per_s: 0.0, events: 0, sim_s: 0.0, kinds: [0; 3] };
    for _ in 0..reps {
        let mut engine = Engine::new(config());
        let mut out = Vec::with_capacity(1024);
        let mut buf = Vec::with_capacity(BATCH + 1024);
        let mut w = Workload::new(slots, false);
        w.fill(&mut buf);
        feed(&mut engine, &mut buf, &mut out);
        let sim_start = w.now_ns;
        let mut fed = 0;
        let mut kinds = [0u64; 3];
        let mut busy = Duration::ZERO;
        while fed < events {
            w.generate(&mut buf, BATCH);
            let t = Instant::now();
            let (n, k) = feed(&mut engine, &mut buf, &mut out);
            busy += t.elapsed();
            fed += n;
            for (a, b) in kinds.iter_mut().zip(k) {
                *a += b;
            }
        }
        let rate = fed as f64 / busy.as_secs_f64();
        assert_eq!(engine.stats().in_flight as usize, slots);
        if rate > best.events_per_s {
            best = Run {
                in_flight: slots,
                events_per_s: rate,
                events: fed,
                sim_s: (w.now_ns - sim_start) as f64 / 1e9,
                kinds,
            };
        }
    }
    best
}

/// Bytes the engine holds per tracked request with `n` in flight, the same
/// counting the engine's fixed parts, and the peak during the fill (the
/// table and record store grow by doubling).
fn footprint(n: usize, with_ids: bool) -> (f64, f64, f64) {
    let mut out = Vec::with_capacity(1024);
    let mut buf = Vec::with_capacity(3 * n);
    let mut w = Workload::new(n, with_ids);
    w.fill(&mut buf);
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let mut engine = Engine::new(config());
    let empty = LIVE.load(Ordering::Relaxed) - base;
    let t = Instant::now();
    let (events, _) = feed(&mut engine, &mut buf, &mut out);
    let fill_rate = events as f64 / t.elapsed().as_secs_f64();
    assert_eq!(engine.stats().in_flight as usize, n);
    // The external ids were allocated by the generator, before `base`, and
    // moved into the engine: count them as the engine's.
    let ids = if with_ids { n * "room-00000000000".len() } else { 0 };
    let held = LIVE.load(Ordering::Relaxed) + ids - base;
    let peak = PEAK.load(Ordering::Relaxed) + ids - base;
    black_box(&engine);
    println!(
        "  {n} in flight{}: {:.1} MB held ({:.1} MB of it fixed), peak {:.1} MB, filled at {:.2} M events/s",
        if with_ids { ", 16-byte external ids" } else { "" },
        held as f64 / 1e6,
        empty as f64 / 1e6,
        peak as f64 / 1e6,
        fill_rate / 1e6
    );
    ((held - empty) as f64 / n as f64, held as f64 / n as f64, peak as f64 / n as f64)
}

/// A NIXL transfer handle as far as the `nixl` profile's `[status]` reads
/// it: the `nixl_status_t` at +184.
#[repr(C, align(8))]
struct Handle {
    _before: [u8; 184],
    status: i32,
    _after: [u8; 4],
}

/// How the due requests' statuses are read in one configuration of (4).
#[derive(Clone, Copy, PartialEq)]
enum Reads {
    /// All in the tick they come due, a `process_vm_readv(2)` each.
    AllAtOnceOneEach,
    /// At most `READS_PER_TICK` a tick, a process's reads batched.
    BudgetBatched,
}

/// One run of (4): the ticks it took to report every stall, the longest
/// of them and their sum.
struct StatusTicks {
    ticks: usize,
    longest: Duration,
    total: Duration,
}

/// `n` requests posted in one tick in this process, their handles saying
/// "in progress", all due at the same tick: advance tick by tick until
/// every one is reported stalled (`transfer_hung`, which only the read
/// tells from a done or failed one), timing each tick's `advance_reading`.
/// `state` is asked about each read before and after it, as the agent
/// asks; nothing probed these requests, so every lookup misses, which
/// costs what a hit does, and the answer is taken as "held".
fn status_ticks(n: usize, reads: Reads, state: &KernelState) -> StatusTicks {
    let handles: Vec<Handle> = (0..n).map(|_| Handle { _before: [0; 184], status: 1, _after: [0; 4] }).collect();
    let profile = Profile::load("nixl").expect("the built-in nixl profile");
    let mut status = StatusReader::new(profile.status.expect("the nixl profile's [status]"), profile.complete_at);
    let pid = std::process::id();
    let mut engine = Engine::new(EngineConfig { max_tracked: n.max(1), ..config() });
    let mut out = Vec::with_capacity(n);
    for (i, handle) in handles.iter().enumerate() {
        let observation = Observation {
            pid,
            key: (&raw const *handle) as u64,
            stage: Stage::TransferPosted,
            ts_ns: START_NS + i as u64,
            external_id: None,
            ends: None,
        };
        engine.observe(observation, &mut out);
    }
    let budget = match reads {
        Reads::AllAtOnceOneEach => usize::MAX,
        Reads::BudgetBatched => READS_PER_TICK,
    };
    let holds = |silent: &Silent| state.is_live(silent.pid, silent.key, silent.last_ns).map(|_| true);
    let mut read = |silents: &[Silent], answers: &mut Vec<Option<StageRead>>| match reads {
        Reads::AllAtOnceOneEach => {
            for silent in silents {
                status.read(std::slice::from_ref(silent), holds, answers);
            }
        }
        Reads::BudgetBatched => status.read(silents, holds, answers),
    };
    let mut run = StatusTicks { ticks: 0, longest: Duration::ZERO, total: Duration::ZERO };
    let mut stalled = 0;
    let mut now = START_NS + TIMEOUT_NS + TICK_NS;
    while stalled < n {
        assert!(run.ticks <= n, "{stalled} of {n} stalls reported after {} ticks", run.ticks);
        let t = Instant::now();
        engine.advance_reading(now, budget, &mut read, &mut out);
        let took = t.elapsed();
        run.ticks += 1;
        run.longest = run.longest.max(took);
        run.total += took;
        for report in out.drain(..) {
            assert!(matches!(report, Report::Stalled { class: StallClass::TransferHung, .. }), "{report:?}");
            stalled += 1;
        }
        now += TICK_NS;
    }
    assert_eq!(status.reads().answered, n as u64, "every status read from memory: {:?}", status.reads());
    black_box(&handles);
    run
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this
    // binary without it, as a smoke test: keep that quick.
    let quick = !std::env::args().any(|a| a == "--bench");
    let (events, reps) = if quick { (200_000, 1) } else { (8_000_000, 3) };

    println!("stallwatch lifecycle engine (one core, simulated time, 60 s timeout, 10 ms tick)");
    println!();
    println!("(2) memory");
    let (per, per_all, peak) = footprint(1_000_000, false);
    println!("  bytes per tracked request: {per:.1} (incl. fixed parts {per_all:.1}, peak {peak:.1})");
    let (per_ids, _, _) = footprint(1_000_000, true);
    println!("  bytes per tracked request with external ids: {per_ids:.1}");
    println!();

    println!("(1) throughput, {events} events per run, best of {reps}");
    let small = throughput(1_000, events, reps);
    let large = throughput(1_000_000, events, reps);
    // The smoke run's few simulated seconds stay short of the 60 s timeout,
    // so it stalls nothing; what it timed must still have ended lifecycles.
    for r in [&small, &large] {
        assert!(r.kinds[2] > 0, "{} in flight: {} events fed and no lifecycle ended", r.in_flight, r.events);
    }
    for r in [&small, &large] {
        println!(
            "  {:>9} in flight: {:>6.2} M events/s  ({} events over {:.0} s simulated; stalled {}, recovered {}, ended {})",
            r.in_flight,
            r.events_per_s / 1e6,
            r.events,
            r.sim_s,
            r.kinds[0],
            r.kinds[1],
            r.kinds[2]
        );
    }
    println!();
    println!("(3) 1M in flight vs 1k in flight");
    println!(
        "  throughput ratio 1M/1k: {:.2} ({:.2} vs {:.2} M events/s)",
        large.events_per_s / small.events_per_s,
        large.events_per_s / 1e6,
        small.events_per_s / 1e6
    );
    println!();

    if let Err(err) = support::require_root("the engine benchmark's status reads (4)") {
        eprintln!("{err:#}");
        std::process::exit(1);
    }
    let mut probes = Probes::load(None).expect("loading the eBPF object (for its in-flight table)");
    let state = probes.kernel_state().expect("the eBPF object's in-flight table");
    let due = if quick { 5_000 } else { 100_000 };
    println!("(4) a mass stall: {due} requests due in one tick, each handle's status read from memory, best of {reps}");
    println!("  (each read asked of the kernel's in-flight table before and after, as the agent does)");
    let configurations = [
        ("every due request in its tick, a process_vm_readv each", Reads::AllAtOnceOneEach),
        ("at most READS_PER_TICK a tick, batched", Reads::BudgetBatched),
    ];
    // Rounds interleaved, so both configurations share the machine's
    // noise; the best round of each.
    let mut best: [Option<StatusTicks>; 2] = [None, None];
    for _ in 0..reps {
        for ((_, reads), best) in configurations.iter().zip(&mut best) {
            let run = status_ticks(due, *reads, &state);
            if best.as_ref().is_none_or(|b| run.longest < b.longest) {
                *best = Some(run);
            }
        }
    }
    for ((name, _), best) in configurations.iter().zip(best) {
        let best = best.expect("reps >= 1");
        println!(
            "  {name:<56}: longest tick {:>8.2} ms, {:>4} ticks to report all, {:>8.2} ms on the loop in all",
            best.longest.as_secs_f64() * 1e3,
            best.ticks,
            best.total.as_secs_f64() * 1e3
        );
    }
}
