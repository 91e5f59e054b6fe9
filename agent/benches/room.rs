//! What a room costs, per probe: SGLang's real prefill code serving
//! healthy rooms at 2, 32 and 80 layers and with fragmented page runs,
//! side by side in one run (one target a shape serves every run, each
//! run a round of rooms; configurations interleaved run by run, medians
//! shown), with the prefill process
//! - not watched (off);
//! - under the eBPF object's empty programs on every function the target's
//!   SGLang profile links for the whole run (the kernel's own uprobe cost:
//!   the floor);
//! - watched by `stallwatch run --profile nixl` (NIXL's probes only) and by
//!   the target's SGLang profile (`sglang` on NIXL, `sglang-mooncake` on
//!   Mooncake), as an operator runs it;
//! - once per shape, counted: the kernel's perf uprobe counter on every
//!   thread at every place the floor attaches (no program: which thread
//!   traps where, per room), not timed.
//!
//! Targets: tests/sglang/real/prefill.py (sglang 0.5.23's classes over real
//! NIXL, two TP1 decodes) for off / empty / `nixl` / `sglang`, and
//! tests/sglang/mooncake/prefill.py (the same classes over Mooncake's
//! TransferEngine) for off / empty / `sglang-mooncake`, each with the same
//! KV shape (`--layers`, `--decode-free-runs`). The prefill process runs
//! SGLang's threads in one process (scheduler, bootstrap thread, transfer
//! workers; the target's tokenizer and detokenizer stand-ins beside them),
//! each named by `--report-threads`.
//!
//! Printed per shape: each thread role's CPU per room (schedstat); the
//! watched threads are those that hit the probes without polling
//! (bootstrap, tokenizer, detokenizer): the scheduler's loop (every 0.5
//! ms, as SGLang's polls) and the transfer workers (NIXL's status) poll
//! between rooms, so their CPU follows the wall time and is shown, not
//! read. The per-trap cost is measured in the same run: the watched
//! threads' CPU under the empty programs less off, over the traps the
//! counted run saw on them. Per probe: traps a room (per thread
//! group), the agent's probe hits and programs a room (its stop summary),
//! and traps times the per-trap cost. Figures only, never a pass or fail.
//!
//! `cargo bench -p stallwatch --bench room` (as root, with the SGLang venv
//! and its Mooncake layer); `STALLWATCH_ROOM_RUNS` (3), `STALLWATCH_ROOM_ROOMS`
//! (200), `STALLWATCH_ROOM_TARGETS` (`nixl,mooncake`) and
//! `STALLWATCH_ROOM_SHAPES` (`2,32,80,32f`) trim a run. SGLang's default
//! pickle IPC (`STALLWATCH_ROOM_IPC=msgpack` for msgpack). Without
//! `--bench` (as under `cargo test --all-targets`) it returns at once: the
//! target alone takes 15-45 s to start here, which CI's hour has no room
//! for (the `sglang` bench's smoke runs the same target and agent).
//! `STALLWATCH_ROOM_SMOKE=1` runs a smoke anyway: 2 layers watched by
//! `sglang`, 20 rooms, which fails unless the agent followed every room and
//! linked exactly the floor's functions.
mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    os::fd::{AsRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use stallwatch::{
    kernel::uprobe_link,
    profile::{At, Profile},
};
use support::{Agent, Driver, Floor, Summary, median};

/// The thread roles whose CPU is read: they hit the probes and block
/// between rooms. The scheduler (its loop polls every 0.5 ms, as
/// SGLang's does when idle) and the transfer workers (they poll NIXL's
/// status) are shown apart: their CPU follows the wall time.
const WATCHED: [&str; 3] = ["bootstrap", "tokenizer", "detokenizer"];

/// One KV shape a room is served with.
#[derive(Clone, Copy)]
struct Shape {
    key: &'static str,
    label: &'static str,
    layers: u32,
    /// Decode pages handed out in shuffled runs of this many (0: in order).
    free_runs: u32,
}

const SHAPES: [Shape; 4] = [
    Shape { key: "2", label: "2 layers", layers: 2, free_runs: 0 },
    Shape { key: "32", label: "32 layers", layers: 32, free_runs: 0 },
    Shape { key: "80", label: "80 layers", layers: 80, free_runs: 0 },
    Shape { key: "32f", label: "32 layers, every page its own run", layers: 32, free_runs: 1 },
];

/// A real target and the profiles measured on it.
struct Target {
    key: &'static str,
    label: &'static str,
    script: &'static str,
    /// The framework's profile: the floor's functions, the counted places.
    profile: &'static str,
    /// The agents run, in columns after off and empty.
    agents: &'static [&'static str],
}

const TARGETS: [Target; 2] = [
    Target {
        key: "nixl",
        label: "SGLang on NIXL (tests/sglang/real/prefill.py)",
        script: "tests/sglang/real/prefill.py",
        profile: "sglang",
        agents: &["nixl", "sglang"],
    },
    Target {
        key: "mooncake",
        label: "SGLang on Mooncake (tests/sglang/mooncake/prefill.py)",
        script: "tests/sglang/mooncake/prefill.py",
        profile: "sglang-mooncake",
        agents: &["sglang-mooncake"],
    },
];

/// Who watches one run.
#[derive(Clone)]
enum Column {
    Off,
    Empty,
    Agent(&'static str),
    /// Per-thread perf counters at the floor's places (not timed).
    Count,
}

/// What one run measured, per room.
#[derive(Default)]
struct Run {
    /// CPU us a room, by thread role.
    cpu: BTreeMap<String, f64>,
    wall_ms: f64,
    summary: Option<Summary>,
    /// Traps a room by (function, at its return) and thread role (Count).
    traps: BTreeMap<(String, bool), BTreeMap<String, f64>>,
}

impl Run {
    fn watched(&self) -> f64 {
        WATCHED.iter().filter_map(|role| self.cpu.get(*role)).sum()
    }
    fn role(&self, role: &str) -> f64 {
        self.cpu.get(role).copied().unwrap_or(0.0)
    }
    fn all(&self) -> f64 {
        self.cpu.values().sum()
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Per-thread CPU (schedstat, ns) of the threads named in `threads`.
fn thread_cpu(pid: u32, threads: &BTreeMap<u32, String>) -> BTreeMap<u32, u64> {
    threads
        .keys()
        .filter_map(|tid| {
            let text = fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?;
            Some((*tid, text.split_whitespace().next()?.parse().ok()?))
        })
        .collect()
}

/// Hits of a uprobe counted per thread by the kernel's perf `uprobe` PMU:
/// no eBPF program, no tracefs; one counting event per (thread, place).
struct TrapCounter {
    events: Vec<(u32, usize, OwnedFd)>,
}

impl TrapCounter {
    /// `places`: (object, file offset, at its return).
    fn open(tids: &[u32], places: &[(PathBuf, u64, bool)]) -> Result<Self> {
        let pmu = uprobe_link::uprobe_pmu()?;
        let mut events = Vec::new();
        for (n, (path, offset, ret)) in places.iter().enumerate() {
            for &tid in tids {
                match uprobe_link::uprobe_event(pmu, path, *offset, *ret, tid) {
                    Ok(fd) => events.push((tid, n, fd)),
                    // A thread that exited since the listing is not counted.
                    Err(err)
                        if err.downcast_ref::<std::io::Error>().and_then(std::io::Error::raw_os_error)
                            == Some(libc::ESRCH) => {}
                    Err(err) => return Err(err.context(format!("counting traps of thread {tid}"))),
                }
            }
        }
        Ok(Self { events })
    }

    /// (thread, place, hits) of every event.
    fn read(&self) -> Vec<(u32, usize, u64)> {
        self.events
            .iter()
            .filter_map(|(tid, place, fd)| {
                let mut count = 0u64;
                // SAFETY: reading 8 bytes into a u64 from our own fd.
                let n = unsafe { libc::read(fd.as_raw_fd(), (&raw mut count).cast(), 8) };
                (n == 8).then_some((*tid, *place, count))
            })
            .collect()
    }
}

/// One target serving rounds of rooms, each round watched its own way.
struct Session {
    driver: Driver,
    pid: u32,
    threads: BTreeMap<u32, String>,
    /// Where the floor attaches: (function, at its return, object, offset).
    places: Vec<(String, bool, PathBuf, u64)>,
    rooms: u64,
}

impl Session {
    /// `target` in `shape`, ready to serve `rounds` rounds of `rooms`.
    fn start(python: &Path, target: &Target, shape: Shape, rooms: u64, rounds: u64, profile: &Profile) -> Result<Self> {
        let args = [
            "--fault",
            "none",
            "--count",
            &rooms.to_string(),
            "--rounds",
            &rounds.to_string(),
            "--max-seconds",
            "3600",
            "--layers",
            &shape.layers.to_string(),
            "--decode-free-runs",
            &shape.free_runs.to_string(),
            "--report-threads",
        ]
        .map(String::from);
        let pickle = if env_or("STALLWATCH_ROOM_IPC", "pickle") == "msgpack" { "0" } else { "1" };
        let (driver, ready) = Driver::spawn(python, target.script, &args, &[("SGLANG_USE_PICKLE_IPC", pickle)])?;
        let pid = ready["prefill_pid"].as_u64().context("ready without prefill_pid")? as u32;
        let threads = ready["threads"]
            .as_object()
            .context("ready without threads (--report-threads)")?
            .iter()
            .filter_map(|(tid, role)| Some((tid.parse().ok()?, role.as_str()?.to_owned())))
            .collect();
        let places = Floor::places(pid, profile)?;
        Ok(Self { driver, pid, threads, places, rooms })
    }
}

/// One round of the session's rooms under `column`.
fn run(session: &mut Session, target: &Target, column: &Column, profile: &Profile) -> Result<Run> {
    let Session { driver, pid, threads, places, rooms } = session;
    let (pid, rooms) = (*pid, *rooms);
    let mut floor = None;
    let mut agent = None;
    let mut counter = None;
    // One trap place per (object, offset, return): two programs at one
    // place are one trap.
    let distinct: Vec<(String, bool, PathBuf, u64)> =
        places.iter().cloned().collect::<BTreeSet<_>>().into_iter().collect();
    match column {
        Column::Off => {}
        Column::Empty => floor = Some(Floor::attach(pid, profile)?),
        Column::Agent(name) => agent = Some(Agent::start(&support::agent_bin(), pid, name)?),
        Column::Count => {
            let tids: Vec<u32> = threads.keys().copied().collect();
            let at: Vec<(PathBuf, u64, bool)> =
                distinct.iter().map(|(_, ret, path, offset)| (path.clone(), *offset, *ret)).collect();
            counter = Some(TrapCounter::open(&tids, &at)?);
        }
    }
    let before = thread_cpu(pid, threads);
    let counted_before = counter.as_ref().map(TrapCounter::read).unwrap_or_default();
    let started = Instant::now();
    driver.go()?;
    let done = driver.until("done");
    let wall = started.elapsed();
    let after = thread_cpu(pid, threads);
    let counted = counter.as_ref().map(TrapCounter::read).unwrap_or_default();
    drop(counter);
    let done = done?;
    if done["completed"].as_u64() != Some(rooms) {
        bail!("{} completed {} of {rooms} rooms: {done}", target.script, done["completed"]);
    }
    drop(floor);
    let per_room = |ns: u64| ns as f64 / 1e3 / rooms as f64;
    let mut measured = Run { wall_ms: wall.as_secs_f64() * 1e3 / rooms as f64, ..Run::default() };
    for (tid, role) in threads.iter() {
        if let (Some(a), Some(b)) = (after.get(tid), before.get(tid)) {
            *measured.cpu.entry(role.clone()).or_default() += per_room(a.saturating_sub(*b));
        }
    }
    let start: BTreeMap<(u32, usize), u64> = counted_before.iter().map(|(t, p, c)| ((*t, *p), *c)).collect();
    for (tid, place, count) in counted {
        let hits = count.saturating_sub(start.get(&(tid, place)).copied().unwrap_or(0));
        let (symbol, ret, ..) = &distinct[place];
        let role = threads.get(&tid).cloned().unwrap_or_default();
        *measured.traps.entry((symbol.clone(), *ret)).or_default().entry(role).or_default() +=
            hits as f64 / rooms as f64;
    }
    if let (Some(agent), Column::Agent(name)) = (agent, column) {
        let summary = agent.stop()?;
        if summary.lost_events > 0 {
            eprintln!("room bench: the {name} agent lost {} events", summary.lost_events);
        }
        // The SGLang profiles follow rooms (and the warm-up rooms);
        // nixl's lifecycles are handles.
        if *name != "nixl" && summary.completed < rooms {
            let followed = format!("the {name} agent followed {} of the {rooms} rooms to their end", summary.completed);
            if support::smoke() {
                bail!(followed);
            }
            eprintln!("room bench: {followed}");
        }
        // The floor must be what the agent links for the run.
        if *name == target.profile {
            let linked: BTreeSet<&str> = summary.always_attached.iter().map(|(symbol, _)| symbol.as_str()).collect();
            let floor: BTreeSet<&str> = places.iter().map(|(symbol, ..)| symbol.as_str()).collect();
            if linked != floor {
                bail!(
                    "the empty-program floor attaches other functions than the {name} agent linked: the floor alone \
                     {:?}, the agent alone {:?}",
                    floor.difference(&linked).collect::<Vec<_>>(),
                    linked.difference(&floor).collect::<Vec<_>>()
                );
            }
        }
        measured.summary = Some(summary);
    }
    Ok(measured)
}

/// Per function of an agent's summary: (traps, programs) a room, and how
/// it is linked. A function's slots each count every call (one uprobe
/// each, the same trap); a return slot that reads arguments has an entry
/// half too, a trap at entry and a program there, not in its hits.
fn by_function(summary: &Summary, profile: &Profile, rooms: u64) -> Functions {
    let mut calls: BTreeMap<&str, (u64, u64, &str)> = BTreeMap::new();
    for probe in &summary.probes {
        let entry = calls.entry(probe.symbol.as_str()).or_insert((0, 0, probe.attached.as_str()));
        entry.0 = entry.0.max(probe.hits);
        entry.1 += probe.hits;
    }
    // (symbol, at, args read) of every probe and signal; activity at entry.
    let mut halves: Vec<(&str, At, u32)> = Vec::new();
    halves.extend(profile.probes.iter().map(|spec| (spec.symbol.as_str(), spec.at, spec.args_read())));
    halves.extend(profile.signals.iter().map(|spec| (spec.symbol.as_str(), spec.at, spec.args_read())));
    halves.extend(profile.activity.iter().map(|spec| (spec.symbol.as_str(), At::Entry, 0)));
    calls
        .into_iter()
        .map(|(symbol, (calls, hits, attached))| {
            let own = halves.iter().filter(|(name, ..)| *name == symbol);
            let entry = own.clone().any(|(_, at, args)| *at == At::Entry || *args > 0);
            let ret = own.clone().any(|(_, at, _)| *at == At::Return);
            let arg_halves = own.filter(|(_, at, args)| *at == At::Return && *args > 0).count() as u64;
            let traps = calls * (u64::from(entry) + u64::from(ret));
            let programs = hits + arg_halves * calls;
            (symbol.to_owned(), (traps as f64 / rooms as f64, programs as f64 / rooms as f64, attached.to_owned()))
        })
        .collect()
}

/// A function's name as a table shows it: C++ names by their method.
fn short(symbol: &str) -> String {
    for class in ["nixlAgent", "TransferEngine", "ClientSession"] {
        if let Some(rest) = symbol.split(class).nth(1) {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            if let Ok(len) = digits.parse::<usize>() {
                return rest[digits.len()..].chars().take(len).collect();
            }
        }
    }
    symbol.chars().take(40).collect()
}

/// What the cross-shape table shows of one (target, shape).
struct Line {
    target: &'static str,
    shape: &'static str,
    /// Per column: watched CPU us a room (median).
    watched: Vec<(String, f64)>,
    per_trap_us: f64,
    /// Per agent: (traps, programs) a room, always-linked probes.
    agents: Vec<(String, f64, f64)>,
    watched_traps: f64,
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|text| text.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn main() -> Result<()> {
    support::require_root("the room benchmark")?;
    let full = !support::smoke();
    let python = support::sglang_python()?;
    let parse = |name: &str, default: u64| -> Result<u64> {
        env_or(name, &default.to_string()).parse().with_context(|| format!("{name} is not a number"))
    };
    let (runs, rooms) =
        if full { (parse("STALLWATCH_ROOM_RUNS", 3)?, parse("STALLWATCH_ROOM_ROOMS", 200)?) } else { (1, 20) };
    let targets = env_or("STALLWATCH_ROOM_TARGETS", "nixl,mooncake");
    let shapes = env_or("STALLWATCH_ROOM_SHAPES", "2,32,80,32f");
    let targets: Vec<&Target> = TARGETS.iter().filter(|t| targets.split(',').any(|k| k == t.key)).collect();
    let shapes: Vec<Shape> = SHAPES.iter().copied().filter(|s| shapes.split(',').any(|k| k == s.key)).collect();
    if !full {
        if std::env::var_os("STALLWATCH_ROOM_SMOKE").is_none() {
            // The target's start (torch and SGLang imported, two decodes,
            // the warm-up rooms) alone takes 45 s on this 2-core host under
            // load: no room in CI's hour. The `sglang` bench's smoke runs the
            // same target and agent and fails unless every room is followed.
            println!(
                "room bench: no smoke run under `cargo test` (the SGLang target takes 15-45 s to start); \
                 STALLWATCH_ROOM_SMOKE=1 runs one (20 rooms, 2 layers, the sglang agent); \
                 `cargo bench -p stallwatch --bench room` the whole bench"
            );
            return Ok(());
        }
        // One target, one shape, the SGLang agent only.
        let target = &TARGETS[0];
        let profile = Profile::load(target.profile)?;
        let started = Instant::now();
        let mut session = Session::start(&python, target, SHAPES[0], rooms, 1, &profile)?;
        let measured = run(&mut session, target, &Column::Agent(target.profile), &profile)?;
        session.driver.finish();
        let summary = measured.summary.as_ref().context("no summary")?;
        println!(
            "room bench [smoke run: too short for meaningful figures]: the {} agent followed {} rooms (of {rooms}, \
             with the warm-up's) in {:.1} s; watched threads {:.0} us a room",
            target.profile,
            summary.completed,
            started.elapsed().as_secs_f64(),
            measured.watched()
        );
        return Ok(());
    }
    println!("host load average at the start (1, 5, 15 min): {}", loadavg());
    println!(
        "What a room costs, per probe: {rooms} healthy rooms a run, one target a shape serving every run, {runs} \
         interleaved runs a configuration, medians; SGLang's {} IPC; two TP1 decodes, 4 pages (4 KiB a buffer) a room in 2 chunks",
        env_or("STALLWATCH_ROOM_IPC", "pickle")
    );
    let mut lines = Vec::new();
    for target in &targets {
        let profile = Profile::load(target.profile)?;
        let agent_profiles: Vec<Profile> =
            target.agents.iter().map(|name| Profile::load(name)).collect::<Result<_>>()?;
        let mut columns = vec![("off".to_owned(), Column::Off), ("empty".to_owned(), Column::Empty)];
        columns.extend(target.agents.iter().map(|name| (name.to_string(), Column::Agent(name))));
        for shape in &shapes {
            let mut measured: Vec<Vec<Run>> = columns.iter().map(|_| Vec::new()).collect();
            // One target a shape: a round to settle (not shown), the runs
            // (each run the columns in turn, its first column rotating), the
            // counted round.
            let rounds = 1 + runs * columns.len() as u64 + 1;
            let mut session = Session::start(&python, target, *shape, rooms, rounds, &profile)?;
            run(&mut session, target, &Column::Off, &profile)?;
            for round in 0..runs as usize {
                for k in 0..columns.len() {
                    let n = (round + k) % columns.len();
                    measured[n].push(run(&mut session, target, &columns[n].1, &profile)?);
                }
            }
            let counted = Some(run(&mut session, target, &Column::Count, &profile)?);
            session.driver.finish();
            let counted = counted.context("no counted run")?;
            lines.push(report(target, *shape, &columns, &measured, &counted, &profile, &agent_profiles, rooms));
        }
    }
    println!();
    println!("Per room, every shape (watched threads: bootstrap, tokenizer, detokenizer):");
    println!(
        "{:<9} {:<34} {:>9} {:>9} {:>22} {:>14} {:>11} {:>11} {:>28}",
        "target",
        "shape",
        "off us",
        "empty us",
        "agents us",
        "agent/empty",
        "traps wtch",
        "us a trap",
        "agents traps, programs"
    );
    for line in &lines {
        let value = |name: &str| line.watched.iter().find(|(n, _)| n == name).map_or(f64::NAN, |(_, v)| *v);
        let agents: Vec<&(String, f64)> = line.watched.iter().skip(2).collect();
        let agent_us = agents.iter().map(|(n, v)| format!("{n} {v:.0}")).collect::<Vec<_>>().join(", ");
        let over = agents.iter().map(|(_, v)| format!("{:.2}x", v / value("empty"))).collect::<Vec<_>>().join(", ");
        let traps = line.agents.iter().map(|(n, t, p)| format!("{n} {t:.1}, {p:.1}")).collect::<Vec<_>>().join("; ");
        println!(
            "{:<9} {:<34} {:>9.1} {:>9.1} {agent_us:>22} {over:>14} {:>11.1} {:>11.2} {traps:>28}",
            line.target,
            line.shape,
            value("off"),
            value("empty"),
            line.watched_traps,
            line.per_trap_us
        );
    }
    println!("host load average at the end (1, 5, 15 min): {}", loadavg());
    Ok(())
}

/// A figure read off one run.
type Figure = dyn Fn(&Run) -> f64;

/// Each agent's figures by function: (traps, programs) a room, how linked.
type Functions = BTreeMap<String, (f64, f64, String)>;

/// Prints one (target, shape)'s tables; its line of the summary table.
#[allow(clippy::too_many_arguments)]
fn report(
    target: &Target,
    shape: Shape,
    columns: &[(String, Column)],
    measured: &[Vec<Run>],
    counted: &Run,
    profile: &Profile,
    agent_profiles: &[Profile],
    rooms: u64,
) -> Line {
    let med = |n: usize, f: &Figure| median(&measured[n].iter().map(f).collect::<Vec<_>>());
    println!();
    println!(
        "{} , {} (--layers {} --decode-free-runs {}), CPU us a room (median; min-max):",
        target.label, shape.label, shape.layers, shape.free_runs
    );
    print!("{:<34}", "thread");
    for (name, _) in columns {
        print!(" {name:>22}");
    }
    println!();
    let rows: [(&str, &Figure); 8] = [
        ("bootstrap", &|r: &Run| r.role("bootstrap")),
        ("tokenizer", &|r: &Run| r.role("tokenizer")),
        ("detokenizer", &|r: &Run| r.role("detokenizer")),
        ("watched (the three above)", &|r: &Run| r.watched()),
        ("scheduler (polls: wall time)", &|r: &Run| r.role("scheduler")),
        ("transfer workers (poll: wall time)", &|r: &Run| r.role("transfer_worker")),
        ("every thread", &|r: &Run| r.all()),
        ("wall ms a room", &|r: &Run| r.wall_ms),
    ];
    for (label, f) in rows {
        print!("{label:<34}");
        for runs in measured {
            let values: Vec<f64> = runs.iter().map(f).collect();
            let (low, high) = values.iter().fold((f64::MAX, f64::MIN), |(l, h), v| (l.min(*v), h.max(*v)));
            print!(" {:>22}", format!("{:.1} ({low:.0}-{high:.0})", median(&values)));
        }
        println!();
    }
    let off = med(0, &|r| r.watched());
    let empty = med(1, &|r| r.watched());
    print!("{:<34}", "watched / off, / empty");
    for n in 0..columns.len() {
        let value = med(n, &|r| r.watched());
        print!(" {:>22}", format!("{:.2}x, {:.2}x", value / off, value / empty));
    }
    println!();
    // Traps on the watched threads (counted run), the per-trap cost.
    let role_group = |role: &str| {
        if WATCHED.contains(&role) {
            "watched"
        } else if role == "scheduler" {
            "scheduler"
        } else if role == "transfer_worker" {
            "workers"
        } else {
            "other"
        }
    };
    let mut grouped: BTreeMap<(String, bool), BTreeMap<&str, f64>> = BTreeMap::new();
    for (place, roles) in &counted.traps {
        for (role, traps) in roles {
            *grouped.entry(place.clone()).or_default().entry(role_group(role)).or_default() += traps;
        }
    }
    let watched_traps: f64 = grouped.values().filter_map(|g| g.get("watched")).sum();
    let per_trap = (empty - off) / watched_traps;
    println!(
        "per-trap cost on the watched threads: (empty {empty:.1} - off {off:.1} us) / {watched_traps:.1} traps a room \
         = {per_trap:.2} us"
    );
    let summaries: Vec<(String, Functions)> = columns
        .iter()
        .enumerate()
        .filter_map(|(n, (name, column))| {
            let Column::Agent(profile_name) = column else { return None };
            let agent_profile = agent_profiles.iter().find(|p| p.name == *profile_name).unwrap_or(profile);
            // The median run's summary by watched CPU is as good as any: hits are counts.
            let summary = measured[n].iter().find_map(|r| r.summary.as_ref())?;
            Some((name.clone(), by_function(summary, agent_profile, rooms)))
        })
        .collect();
    println!(
        "per function, a room: traps counted per thread group (watched / scheduler / transfer workers / other, perf \
         uprobe counters, one run), each agent's traps and programs (its summary's hits), and the floor's CPU (traps x {per_trap:.2} us):"
    );
    print!("{:<22} {:>12} {:>30}", "function", "at", "traps: wtch / sched / wkrs / oth");
    for (name, _) in &summaries {
        print!(" {:>28}", format!("{name}: traps, programs"));
    }
    println!(" {:>10}", "floor us");
    let mut shown = BTreeSet::new();
    let mut symbols: BTreeSet<String> = grouped.keys().map(|(s, _)| s.clone()).collect();
    for (_, functions) in &summaries {
        symbols.extend(functions.keys().cloned());
    }
    for symbol in &symbols {
        let mut halves: Vec<&str> = Vec::new();
        let mut traps = [0.0; 4];
        for ret in [false, true] {
            if let Some(g) = grouped.get(&(symbol.clone(), ret)) {
                halves.push(if ret { "return" } else { "entry" });
                for (i, group) in ["watched", "scheduler", "workers", "other"].iter().enumerate() {
                    traps[i] += g.get(group).copied().unwrap_or(0.0);
                }
            }
        }
        let at = if halves.is_empty() { "-".to_owned() } else { halves.join("+") };
        let mut name = short(symbol);
        while !shown.insert(name.clone()) {
            name.push('\''); // another overload
        }
        let counted = format!("{:.1} / {:.1} / {:.1} / {:.1}", traps[0], traps[1], traps[2], traps[3]);
        print!("{name:<22} {at:>12} {counted:>30}");
        for (_, functions) in &summaries {
            let cell = match functions.get(symbol) {
                Some((t, p, attached)) if attached == "always" => format!("{t:.1}, {p:.1}"),
                Some((t, p, attached)) => format!("{t:.1}, {p:.1} ({attached})"),
                None => "-".to_owned(),
            };
            print!(" {cell:>28}");
        }
        println!(" {:>10.1}", traps.iter().sum::<f64>() * per_trap);
    }
    let agents = summaries
        .iter()
        .map(|(name, functions)| {
            let always = functions.values().filter(|(.., attached)| attached == "always");
            let (t, p) = always.fold((0.0, 0.0), |(t, p), (ft, fp, _)| (t + ft, p + fp));
            (name.clone(), t, p)
        })
        .collect();
    Line {
        target: target.key,
        shape: shape.label,
        watched: columns.iter().enumerate().map(|(n, (name, _))| (name.clone(), med(n, &|r| r.watched()))).collect(),
        per_trap_us: per_trap,
        agents,
        watched_traps,
    }
}
