//! Whether a watched process is itself the one that stopped: its threads'
//! scheduling state in procfs, read when one of its stalls is judged.
//!
//! A stopped process stops its transport too: a prefill SIGSTOPped
//! mid-transfer drives no UCX progress and completes nothing, so by its
//! transport alone its stalls read `peer_unresponsive` (or, where another
//! peer's completions came in just before, `others_completing`) and send
//! the on-call engineer to a decode that is fine. What the process itself
//! does is in the kernel's view of its threads, which costs a few small
//! reads and no probe:
//!
//! - **stopped**: every thread in state `T` (a job-control stop: SIGSTOP,
//!   SIGTSTP) or `t` (stopped by a tracer). One sample tells.
//! - **throttled**: the CPU controller of its cgroup held it back for at
//!   least half of the window between two samples (`cpu.stat`'s
//!   `throttled_usec`, v2, or `throttled_time`, v1, rising with
//!   `nr_throttled`).
//! - **not scheduled**: threads runnable (`R`) at both ends of the window
//!   ran, between them, for less than a twentieth of it (their `utime` +
//!   `stime`): they wanted a CPU and did not get one.
//!
//! The last two need a window: [`Scheduling::keep_sampling`] keeps a
//! sample of each process that holds a request near its stall (from the
//! agent's once-a-second counter tick), and a stall is judged on a fresh
//! sample against the newest kept one at least [`MIN_WINDOW_NS`] older.
//! Nothing is read on the event path or for a healthy process: only
//! processes holding a request silent for half the timeout are sampled,
//! each read bounded to [`MAX_THREADS`] threads, and a burst of stalls of
//! one process is judged on one read ([`FRESH_NS`]).
//!
//! The parsers take the files' text ([`parse_stat`], [`parse_cpu_stat`],
//! [`cpu_stat_path`]), and [`Scheduling`] reads under roots it is given,
//! so both are tested on fixture text and fixture trees.
use std::{
    collections::{HashMap, HashSet, VecDeque},
    io,
    path::{Path, PathBuf},
};

use tracing::{debug, warn};

/// Most threads read of one process per sample: the read stays bounded
/// (each thread is one small file) however many threads the target has;
/// an SGLang scheduler or a vLLM worker has tens to a few hundred.
pub const MAX_THREADS: usize = 1024;

/// The shortest window that can tell throttling or starvation: shorter,
/// a few scheduler ticks (and `utime` is counted in 10 ms ticks) decide.
pub const MIN_WINDOW_NS: u64 = 200_000_000;

/// A sample this recent is reused rather than read again: the stalls of
/// one process that come due together are judged on one read.
pub const FRESH_NS: u64 = 20_000_000;

/// Samples kept per process: enough that one at least [`MIN_WINDOW_NS`]
/// old is kept when a fresh one was just taken.
const KEPT: usize = 3;

/// Runnable threads that ran less than this share of the window (1/20)
/// were not scheduled.
const STARVED_DIVISOR: u64 = 20;

/// A cgroup throttled for at least this share of the window (1/2) held
/// its process back.
const THROTTLED_DIVISOR: u64 = 2;

/// One thread's line of `/proc/PID/task/TID/stat`, the fields read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadStat {
    /// The state letter (`R`, `S`, `D`, `T`, `t`, `Z`, ...).
    pub state: u8,
    /// `utime + stime`, in clock ticks.
    pub cpu_ticks: u64,
}

/// The state and CPU time of a `stat` line. The command name (field 2)
/// is in parentheses and may itself hold spaces and parentheses, so the
/// fields are counted from the last `)`. Not procfs's `Stat`, which
/// parses all 52 fields (4-5 us a line against 0.2 us here), for a sample
/// reads up to [`MAX_THREADS`] lines.
pub fn parse_stat(text: &str) -> Option<ThreadStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    // Field 3 is the state; utime and stime are fields 14 and 15.
    let state = *fields.next()?.as_bytes().first()?;
    let mut fields = fields.skip(10);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(ThreadStat { state, cpu_ticks: utime.saturating_add(stime) })
}

/// What a cgroup's CPU controller says of its throttling.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Throttling {
    /// Periods in which the cgroup was throttled.
    pub nr_throttled: u64,
    /// Time its runqueues spent throttled (summed over CPUs).
    pub throttled_ns: u64,
}

/// `cpu.stat` of a cgroup: v2 (`throttled_usec`) or v1 (`throttled_time`,
/// ns). `None` when it holds neither (no CPU limit accounting).
pub fn parse_cpu_stat(text: &str) -> Option<Throttling> {
    let (mut nr, mut ns) = (None, None);
    for line in text.lines() {
        let mut words = line.split_ascii_whitespace();
        let (Some(name), Some(value)) = (words.next(), words.next().and_then(|v| v.parse::<u64>().ok())) else {
            continue;
        };
        match name {
            "nr_throttled" => nr = Some(value),
            "throttled_usec" => ns = Some(value.saturating_mul(1000)),
            "throttled_time" => ns = Some(value),
            _ => {}
        }
    }
    Some(Throttling { nr_throttled: nr?, throttled_ns: ns? })
}

/// Where a process's CPU controller keeps its `cpu.stat`, from its
/// `/proc/PID/cgroup` text, under `root` (`/sys/fs/cgroup`): the v1
/// hierarchy whose controllers include `cpu` (mounted under their joined
/// names, e.g. `cpu,cpuacct`), else the v2 one (`0::/path`).
pub fn cpu_stat_path(cgroup: &str, root: &Path) -> Option<PathBuf> {
    let mut unified = None;
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let path = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "cpu") {
            return Some(root.join(controllers).join(path).join("cpu.stat"));
        }
        if controllers.is_empty() {
            unified = Some(root.join(path).join("cpu.stat"));
        }
    }
    unified
}

/// One look at a process's threads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sample {
    pub at_ns: u64,
    /// Live threads read (zombies and dead ones left out).
    pub threads: u32,
    /// Of those, stopped (`T`) or stopped by a tracer (`t`).
    pub stopped: u32,
    /// The runnable threads (`R`) and the CPU time each had, ticks.
    pub runnable: Vec<(u32, u64)>,
    /// Its cgroup's throttling, where its CPU controller accounts it.
    pub throttling: Option<Throttling>,
}

/// How the process itself is held, if it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Halt {
    /// Every live thread stopped (SIGSTOP, or a tracer).
    Stopped { threads: u32 },
    /// Its cgroup was throttled for `throttled_ns` of the last `window_ns`.
    Throttled { throttled_ns: u64, window_ns: u64 },
    /// `runnable` threads, runnable at both ends of the last `window_ns`,
    /// ran `ran_ns` between them.
    NotScheduled { runnable: u32, ran_ns: u64, window_ns: u64 },
}

impl Halt {
    /// The process's state, as alerts name it (`process_state=`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stopped { .. } => "stopped",
            Self::Throttled { .. } => "throttled",
            Self::NotScheduled { .. } => "not_scheduled",
        }
    }

    /// One line for people: "process stopped (all 57 threads in state T)".
    pub fn summary(self) -> String {
        let s = |ns: u64| ns as f64 / 1e9;
        match self {
            Self::Stopped { threads } => format!("process stopped (all {threads} threads in state T)"),
            Self::Throttled { throttled_ns, window_ns } => {
                format!(
                    "process throttled by its cgroup's CPU limit ({:.1}s of the last {:.1}s)",
                    s(throttled_ns),
                    s(window_ns)
                )
            }
            Self::NotScheduled { runnable, ran_ns, window_ns } => format!(
                "process not scheduled ({runnable} runnable threads ran {:.2}s in the last {:.1}s)",
                s(ran_ns),
                s(window_ns)
            ),
        }
    }
}

/// What `now` says, against `before` (the newest kept sample at least
/// [`MIN_WINDOW_NS`] older, if any), of how the process is held:
/// stopped first (one sample tells), then throttled, then not scheduled.
/// `tick_ns`: the length of a clock tick.
pub fn judge(before: Option<&Sample>, now: &Sample, tick_ns: u64) -> Option<Halt> {
    if now.threads > 0 && now.stopped == now.threads {
        return Some(Halt::Stopped { threads: now.threads });
    }
    let before = before?;
    let window_ns = now.at_ns.checked_sub(before.at_ns).filter(|&ns| ns >= MIN_WINDOW_NS)?;
    if let (Some(a), Some(b)) = (before.throttling, now.throttling) {
        let throttled_ns = b.throttled_ns.saturating_sub(a.throttled_ns);
        if b.nr_throttled > a.nr_throttled && throttled_ns >= window_ns / THROTTLED_DIVISOR {
            return Some(Halt::Throttled { throttled_ns, window_ns });
        }
    }
    let ran: Vec<u64> = now
        .runnable
        .iter()
        .filter_map(|&(tid, ticks)| {
            let (_, was) = before.runnable.iter().find(|(t, _)| *t == tid)?;
            Some(ticks.saturating_sub(*was))
        })
        .collect();
    let ran_ns = ran.iter().sum::<u64>().saturating_mul(tick_ns);
    if !ran.is_empty() && ran_ns < window_ns / STARVED_DIVISOR {
        return Some(Halt::NotScheduled { runnable: ran.len() as u32, ran_ns, window_ns });
    }
    None
}

/// What is kept of one process.
#[derive(Debug, Default)]
struct Kept {
    /// Oldest first, at most [`KEPT`].
    samples: VecDeque<Sample>,
    /// Its `cpu.stat`, found at its first sample (`None` inside: it has
    /// none).
    cpu_stat: Option<Option<PathBuf>>,
}

/// The scheduling samples of the processes near a stall, and the reads.
pub struct Scheduling {
    processes: HashMap<u32, Kept>,
    proc_root: PathBuf,
    cgroup_root: PathBuf,
    tick_ns: u64,
    /// Processes whose threads could not be read, warned about once.
    warned: HashSet<u32>,
}

impl Default for Scheduling {
    fn default() -> Self {
        Self::with_roots(PathBuf::from("/proc"), PathBuf::from("/sys/fs/cgroup"))
    }
}

impl Scheduling {
    /// Reads under `proc_root` (`/proc`) and `cgroup_root`
    /// (`/sys/fs/cgroup`): another pair for a fixture tree.
    pub fn with_roots(proc_root: PathBuf, cgroup_root: PathBuf) -> Self {
        let ticks = rustix::param::clock_ticks_per_second();
        let tick_ns = 1_000_000_000u64.checked_div(ticks).unwrap_or(10_000_000);
        Self { processes: HashMap::new(), proc_root, cgroup_root, tick_ns, warned: HashSet::new() }
    }

    /// Keep a recent sample of each of `near_stall` (the processes holding
    /// a request silent for half the timeout or more), so a stall judged
    /// later has a window to judge throttling and starvation over; one
    /// taken less than [`MIN_WINDOW_NS`] ago is enough. The samples of
    /// processes no longer near a stall are dropped.
    pub fn keep_sampling(&mut self, near_stall: &HashSet<u32>, now_ns: u64) {
        self.processes.retain(|pid, _| near_stall.contains(pid));
        for &pid in near_stall {
            let newest = self.processes.get(&pid).and_then(|kept| kept.samples.back());
            if newest.is_some_and(|sample| now_ns.saturating_sub(sample.at_ns) < MIN_WINDOW_NS) {
                continue;
            }
            self.sample(pid, now_ns);
        }
    }

    /// How process `pid` is held now, if it is: judged on a fresh sample
    /// (or one younger than [`FRESH_NS`]) against the newest kept one at
    /// least [`MIN_WINDOW_NS`] older. `None` too when its threads cannot
    /// be read (warned about once).
    pub fn judge(&mut self, pid: u32, now_ns: u64) -> Option<Halt> {
        let fresh = self
            .processes
            .get(&pid)
            .and_then(|kept| kept.samples.back())
            .is_some_and(|sample| now_ns.saturating_sub(sample.at_ns) < FRESH_NS);
        if !fresh {
            self.sample(pid, now_ns);
        }
        let samples = &self.processes.get(&pid)?.samples;
        let now = samples.back()?;
        let before = samples.iter().rev().find(|sample| now.at_ns.saturating_sub(sample.at_ns) >= MIN_WINDOW_NS);
        let halt = judge(before, now, self.tick_ns);
        debug!(pid, threads = now.threads, stopped = now.stopped, ?halt, "scheduling state judged");
        halt
    }

    /// The process is gone.
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
        self.warned.remove(&pid);
    }

    fn sample(&mut self, pid: u32, now_ns: u64) {
        let kept = self.processes.entry(pid).or_default();
        let cpu_stat = kept.cpu_stat.get_or_insert_with(|| {
            let cgroup = std::fs::read_to_string(self.proc_root.join(pid.to_string()).join("cgroup")).ok()?;
            cpu_stat_path(&cgroup, &self.cgroup_root)
        });
        match read_sample(&self.proc_root, pid, cpu_stat.as_deref(), now_ns) {
            Ok(sample) => {
                if kept.samples.len() == KEPT {
                    kept.samples.pop_front();
                }
                kept.samples.push_back(sample);
            }
            Err(err) => {
                self.processes.remove(&pid);
                if err.kind() != io::ErrorKind::NotFound && self.warned.insert(pid) {
                    warn!(
                        pid,
                        "reading the process's threads in procfs (its stalls cannot say whether it is stopped itself): {err}"
                    );
                }
            }
        }
    }
}

/// A sample of `pid`: the state and CPU time of up to [`MAX_THREADS`] of
/// its threads (a thread that ends meanwhile is left out), and its
/// cgroup's throttling from `cpu_stat` if it has one. An error when the
/// process's task directory cannot be listed (the process is gone:
/// `NotFound`) or no thread's `stat` could be read.
fn read_sample(proc_root: &Path, pid: u32, cpu_stat: Option<&Path>, at_ns: u64) -> io::Result<Sample> {
    let tasks = proc_root.join(pid.to_string()).join("task");
    let mut sample = Sample { at_ns, ..Sample::default() };
    let mut text = String::new();
    let mut read = 0usize;
    let mut last_error = None;
    for entry in std::fs::read_dir(&tasks)?.take(MAX_THREADS) {
        let entry = entry?;
        let Some(tid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        text.clear();
        match std::fs::File::open(entry.path().join("stat"))
            .and_then(|mut f| io::Read::read_to_string(&mut f, &mut text))
        {
            Ok(_) => {}
            Err(err) => {
                last_error = Some(err);
                continue;
            }
        }
        read += 1;
        let Some(stat) = parse_stat(&text) else { continue };
        match stat.state {
            b'Z' | b'X' | b'x' => continue,
            b'T' | b't' => sample.stopped += 1,
            b'R' => sample.runnable.push((tid, stat.cpu_ticks)),
            _ => {}
        }
        sample.threads += 1;
    }
    if read == 0 {
        return Err(last_error.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no threads")));
    }
    sample.throttling =
        cpu_stat.and_then(|path| std::fs::read_to_string(path).ok()).and_then(|text| parse_cpu_stat(&text));
    Ok(sample)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const TICK: u64 = 10 * MS;

    /// A thread's `stat` line as Linux 6.x writes it, with command `comm`,
    /// state `state` and `utime`/`stime` ticks.
    fn stat_line(tid: u32, comm: &str, state: char, utime: u64, stime: u64) -> String {
        format!(
            "{tid} ({comm}) {state} 1 {tid} {tid} 0 -1 4194560 5120 0 12 0 {utime} {stime} 0 0 20 0 57 0 \
             171819 3321819136 150000 18446744073709551615 1 1 0 0 0 0 0 16781312 17642 0 0 0 17 1 0 0 0 0 0\n"
        )
    }

    #[test]
    fn a_stat_line_gives_its_state_and_cpu_time_whatever_the_command_name() {
        assert_eq!(
            parse_stat(&stat_line(41, "python3", 'S', 120, 30)),
            Some(ThreadStat { state: b'S', cpu_ticks: 150 })
        );
        // SGLang's threads are named by Python; a name may hold ") " itself.
        assert_eq!(
            parse_stat(&stat_line(42, "sglang::sched) R (x", 'T', 7, 1)),
            Some(ThreadStat { state: b'T', cpu_ticks: 8 })
        );
        assert_eq!(parse_stat("42 (cut short) R 1 2"), None);
        assert_eq!(parse_stat(""), None);
    }

    #[test]
    fn cpu_stat_of_either_cgroup_version_gives_its_throttling() {
        let v2 = "usage_usec 8123456\nuser_usec 6000000\nsystem_usec 2123456\nnr_periods 310\nnr_throttled 120\n\
                  throttled_usec 4500000\nnr_bursts 0\nburst_usec 0\n";
        assert_eq!(parse_cpu_stat(v2), Some(Throttling { nr_throttled: 120, throttled_ns: 4_500_000_000 }));
        let v1 = "nr_periods 0\nnr_throttled 3\nthrottled_time 1500000\n";
        assert_eq!(parse_cpu_stat(v1), Some(Throttling { nr_throttled: 3, throttled_ns: 1_500_000 }));
        assert_eq!(parse_cpu_stat("usage_usec 10\n"), None, "no CPU limit accounting");
    }

    #[test]
    fn the_cpu_controllers_stat_is_found_in_either_cgroup_version() {
        let root = Path::new("/sys/fs/cgroup");
        let v2 = "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab.scope\n";
        assert_eq!(
            cpu_stat_path(v2, root),
            Some(PathBuf::from("/sys/fs/cgroup/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab.scope/cpu.stat"))
        );
        // Hybrid (v1 controllers, an empty v2 hierarchy): the v1 cpu one.
        let hybrid = "9:name=systemd:/\n4:memory:/x\n2:cpu,cpuacct:/kubepods/pod1/ab\n1:cpuset:/\n0::/\n";
        assert_eq!(
            cpu_stat_path(hybrid, root),
            Some(PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/ab/cpu.stat"))
        );
        let separate = "2:cpuacct:/\n1:cpu:/\n0::/\n";
        assert_eq!(cpu_stat_path(separate, root), Some(PathBuf::from("/sys/fs/cgroup/cpu/cpu.stat")));
        assert_eq!(cpu_stat_path("4:memory:/x\n", root), None);
    }

    fn sample(
        at_ns: u64,
        threads: u32,
        stopped: u32,
        runnable: &[(u32, u64)],
        throttling: Option<(u64, u64)>,
    ) -> Sample {
        Sample {
            at_ns,
            threads,
            stopped,
            runnable: runnable.to_vec(),
            throttling: throttling.map(|(nr_throttled, throttled_ns)| Throttling { nr_throttled, throttled_ns }),
        }
    }

    #[test]
    fn every_thread_stopped_is_stopped_from_one_sample() {
        let now = sample(1_000 * MS, 57, 57, &[], None);
        assert_eq!(judge(None, &now, TICK), Some(Halt::Stopped { threads: 57 }));
        assert_eq!(Halt::Stopped { threads: 57 }.summary(), "process stopped (all 57 threads in state T)");
        // One thread left running (a stop not yet taken by all): not stopped.
        assert_eq!(judge(None, &sample(1_000 * MS, 57, 56, &[(3, 10)], None), TICK), None);
        assert_eq!(judge(None, &sample(1_000 * MS, 0, 0, &[], None), TICK), None, "nothing read says nothing");
    }

    #[test]
    fn throttling_for_half_the_window_or_more_is_throttled() {
        let before = sample(1_000 * MS, 8, 0, &[(3, 100)], Some((10, 2_000 * MS)));
        // 300 ms throttled in 500 ms, with more throttled periods.
        let now = sample(1_500 * MS, 8, 0, &[(3, 103)], Some((14, 2_300 * MS)));
        assert_eq!(
            judge(Some(&before), &now, TICK),
            Some(Halt::Throttled { throttled_ns: 300 * MS, window_ns: 500 * MS })
        );
        // 100 ms of 500: a limit that bites, but the process runs.
        let light = sample(1_500 * MS, 8, 0, &[(3, 130)], Some((14, 2_100 * MS)));
        assert_eq!(judge(Some(&before), &light, TICK), None);
        // A window too short proves nothing.
        let soon = sample(1_100 * MS, 8, 0, &[(3, 100)], Some((14, 2_300 * MS)));
        assert_eq!(judge(Some(&before), &soon, TICK), None);
    }

    #[test]
    fn runnable_threads_that_did_not_run_are_not_scheduled() {
        let before = sample(1_000 * MS, 8, 0, &[(3, 100), (4, 50)], None);
        // Runnable at both ends of a second, 1 tick between them.
        let now = sample(2_000 * MS, 8, 0, &[(3, 101), (4, 50)], None);
        assert_eq!(
            judge(Some(&before), &now, TICK),
            Some(Halt::NotScheduled { runnable: 2, ran_ns: 10 * MS, window_ns: 1_000 * MS })
        );
        // Runnable and running: 40 ticks of the second.
        let running = sample(2_000 * MS, 8, 0, &[(3, 140), (4, 50)], None);
        assert_eq!(judge(Some(&before), &running, TICK), None);
        // Asleep (not runnable), as an idle prefill waiting on its decode: nothing said.
        let idle = sample(2_000 * MS, 8, 0, &[], None);
        assert_eq!(judge(Some(&before), &idle, TICK), None);
        // A thread runnable only now has no window of its own.
        let new = sample(2_000 * MS, 8, 0, &[(9, 0)], None);
        assert_eq!(judge(Some(&before), &new, TICK), None);
    }

    /// A fixture `/proc` with process `pid`'s threads (tid, state, ticks)
    /// and its cgroup, and a fixture cgroup root with its `cpu.stat`.
    struct Tree {
        dir: PathBuf,
    }

    impl Tree {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("stallwatch-sched-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(dir.join("cgroup/cpu,cpuacct/pod")).expect("fixture dir");
            Self { dir }
        }

        fn threads(&self, pid: u32, threads: &[(u32, char, u64)]) {
            let tasks = self.dir.join(format!("proc/{pid}/task"));
            let _ = std::fs::remove_dir_all(&tasks);
            for &(tid, state, ticks) in threads {
                std::fs::create_dir_all(tasks.join(tid.to_string())).expect("task dir");
                std::fs::write(tasks.join(format!("{tid}/stat")), stat_line(tid, "python3", state, ticks, 0))
                    .expect("stat");
            }
            std::fs::write(self.dir.join(format!("proc/{pid}/cgroup")), "2:cpu,cpuacct:/pod\n0::/\n").expect("cgroup");
        }

        fn throttled(&self, nr: u64, usec: u64) {
            let text = format!("nr_periods 100\nnr_throttled {nr}\nthrottled_time {}\n", usec * 1000);
            std::fs::write(self.dir.join("cgroup/cpu,cpuacct/pod/cpu.stat"), text).expect("cpu.stat");
        }

        fn scheduling(&self) -> Scheduling {
            Scheduling::with_roots(self.dir.join("proc"), self.dir.join("cgroup"))
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn a_process_is_judged_on_its_tree_with_a_kept_sample_as_the_window() {
        let tree = Tree::new("window");
        let mut sched = tree.scheduling();
        sched.tick_ns = TICK;
        tree.threads(7, &[(7, 'S', 10), (8, 'R', 100), (9, 'S', 5)]);
        tree.throttled(2, 1_000);
        let near = HashSet::from([7]);
        sched.keep_sampling(&near, 1_000 * MS);
        // Too soon for another: the one kept is recent enough.
        sched.keep_sampling(&near, 1_100 * MS);
        assert_eq!(sched.processes[&7].samples.len(), 1);
        // Thread 8 runnable throughout, never run: not scheduled.
        assert_eq!(
            sched.judge(7, 1_600 * MS),
            Some(Halt::NotScheduled { runnable: 1, ran_ns: 0, window_ns: 600 * MS })
        );
        // A burst of stalls judged together: no second read (a change
        // to the tree within FRESH_NS is not seen).
        tree.threads(7, &[(7, 'T', 10), (8, 'T', 100), (9, 'T', 5)]);
        assert_eq!(sched.processes[&7].samples.len(), 2);
        assert!(matches!(sched.judge(7, 1_610 * MS), Some(Halt::NotScheduled { .. })));
        assert_eq!(sched.processes[&7].samples.len(), 2);
        // Then stopped, all three (a zombie thread is no thread).
        tree.threads(7, &[(7, 'T', 10), (8, 'T', 100), (9, 't', 5), (10, 'Z', 0)]);
        assert_eq!(sched.judge(7, 1_700 * MS), Some(Halt::Stopped { threads: 3 }));
        // Throttled: 150 ms of the window, whose start is the newest kept
        // sample at least 200 ms older (the one at 1.7 s; the one at 1.0 s
        // is pushed out: three kept at most).
        tree.threads(7, &[(7, 'S', 10), (8, 'R', 160), (9, 'S', 5)]);
        tree.throttled(9, 1_000 + 150_000);
        assert_eq!(sched.judge(7, 1_900 * MS), Some(Halt::Throttled { throttled_ns: 150 * MS, window_ns: 200 * MS }));
        assert_eq!(sched.processes[&7].samples.front().map(|s| s.at_ns), Some(1_600 * MS));
        assert!(sched.processes[&7].samples.len() <= KEPT);
        // No longer near a stall: forgotten; gone: nothing said, no warning.
        sched.keep_sampling(&HashSet::new(), 2_000 * MS);
        assert!(sched.processes.is_empty());
        assert_eq!(sched.judge(99, 2_000 * MS), None);
        assert!(sched.warned.is_empty());
    }

    #[test]
    fn this_very_process_reads_as_running_and_a_stopped_child_as_stopped() {
        let mut sched = Scheduling::default();
        assert_eq!(sched.judge(std::process::id(), 0), None, "the test itself runs");
        use rustix::process::{Pid, Signal, WaitOptions, kill_process, waitpid};
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let pid = child.id();
        let child_pid = Pid::from_raw(pid as i32).expect("a child's pid is positive");
        kill_process(child_pid, Signal::STOP).expect("SIGSTOP to our own child");
        // The stop is taken asynchronously: wait for the kernel to say so
        // (a waitpid for the stop, not a sleep).
        let waited = waitpid(Some(child_pid), WaitOptions::UNTRACED).expect("waitpid");
        assert!(waited.is_some_and(|(waited, status)| waited == child_pid && status.stopped()), "{waited:?}");
        assert_eq!(sched.judge(pid, 10 * FRESH_NS), Some(Halt::Stopped { threads: 1 }));
        let _ = kill_process(child_pid, Signal::CONT);
        let _ = child.kill();
        let _ = child.wait();
    }
}
