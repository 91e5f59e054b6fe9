//! Shared by the benchmarks that attach real probes: the three things a
//! target can be watched by, each started and stopped the way it is in
//! production, so a bench's figures are what each one costs there.
//! - [`Agent`]: the real `stallwatch run` process (its ring buffer read on
//!   its own tick, without a wakeup per event, exactly as deployed);
//! - [`Floor`]: the eBPF object's empty programs on the same functions, the
//!   kernel's own uprobe cost;
//! - [`Bpftrace`]: Debian's bpftrace running an equivalent script.
#![allow(dead_code)] // each bench uses the part it needs

use std::{
    fs,
    io::{BufRead as _, BufReader, Lines, Read as _, Write as _},
    num::NonZeroU32,
    os::unix::{fs::DirBuilderExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    sync::mpsc,
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf,
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeScope},
    },
};
use stallwatch::profile::{
    At, Profile,
    resolve::{ElfFile, ProcessImage},
};

/// Benchmarks load eBPF: without root they stop with the reason.
pub fn require_root(what: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "{what} loads eBPF and needs root: run `cargo run --release -p xtask -- bench` as root \
             (or `-- test`, which runs its smoke version)"
        );
    }
    Ok(())
}

/// `cargo bench` passes `--bench`; without it (`cargo test --all-targets`,
/// which `xtask test` runs) a benchmark runs a short smoke version of
/// itself, which checks that what it timed did happen and fails, never
/// skips, when something it needs is missing.
pub fn smoke() -> bool {
    !std::env::args().any(|arg| arg == "--bench")
}

/// The venv's Python (`STALLWATCH_VENV`, relative to the workspace root;
/// `target/venv` by default): NIXL, pyzmq and rotel live there.
pub fn venv_python() -> PathBuf {
    root().join(std::env::var("STALLWATCH_VENV").unwrap_or_else(|_| "target/venv".into())).join("bin/python")
}

/// The SGLang venv's Python: STALLWATCH_SGLANG_VENV (the xtask sets it),
/// else the venv the xtask's set-up last made or found (target/sglang-venv).
pub fn sglang_python() -> Result<PathBuf> {
    let venv = match std::env::var_os("STALLWATCH_SGLANG_VENV") {
        Some(venv) => PathBuf::from(venv),
        None => fs::read_to_string(root().join("target/sglang-venv"))
            .map(|path| PathBuf::from(path.trim()))
            .context("no SGLang venv: run `cargo run --release -p xtask -- setup --python` (or `-- bench`)")?,
    };
    let python = venv.join("bin/python");
    if !python.exists() {
        bail!("no {}: run `cargo run --release -p xtask -- setup --python`", python.display());
    }
    Ok(python)
}

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The agent binary to measure: `STALLWATCH_BIN`, else this build's.
pub fn agent_bin() -> PathBuf {
    std::env::var_os("STALLWATCH_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_stallwatch")), PathBuf::from)
}

/// A second agent binary to measure beside the first (`STALLWATCH_BASELINE_BIN`),
/// e.g. the build before a change, so both are measured in one run.
pub fn baseline_bin() -> Option<PathBuf> {
    std::env::var_os("STALLWATCH_BASELINE_BIN").map(PathBuf::from)
}

/// CPU time of every thread of `pid`, in ns (`/proc/PID/task/*/schedstat`).
pub fn cpu_ns(pid: u32) -> Result<u64> {
    let mut total = 0;
    let tasks = format!("/proc/{pid}/task");
    for task in fs::read_dir(&tasks).with_context(|| format!("reading {tasks}"))? {
        let path = task?.path().join("schedstat");
        // A thread that exited between the listing and the read: no time.
        let Ok(text) = fs::read_to_string(&path) else { continue };
        let ns = text.split_whitespace().next().and_then(|field| field.parse::<u64>().ok());
        total += ns.with_context(|| format!("unexpected {}: {text:?}", path.display()))?;
    }
    Ok(total)
}

/// What an agent said when it stopped (its JSON summary line).
#[derive(Debug, Default, Clone)]
pub struct Summary {
    pub seen: u64,
    pub completed: u64,
    pub lost_events: u64,
    /// Its probes linked for the whole run (`attached: always`), each with
    /// its hits as the summary counts them, in the summary's order.
    pub always_attached: Vec<(String, u64)>,
    /// Every probe of the summary (each slot, linked always or near a
    /// stall only), in the summary's order.
    pub probes: Vec<ProbeCount>,
}

/// One probe (slot) of an agent's summary.
#[derive(Debug, Default, Clone)]
pub struct ProbeCount {
    pub symbol: String,
    /// `lifecycle`, `signal`, or the activity kind.
    pub role: String,
    pub hits: u64,
    /// `always`, `on_demand` (linked at the stop) or `on_demand_idle`.
    pub attached: String,
}

/// The real agent, `stallwatch run --pid PID --profile NAME`, with
/// nothing pinned and a socket of its own.
pub struct Agent {
    child: Child,
    stdout: Option<ChildStdout>,
    stderr: Option<JoinHandle<String>>,
    /// Holds the agent's socket.
    dir: PathBuf,
}

impl Agent {
    pub fn start(bin: &Path, pid: u32, profile: &str) -> Result<Self> {
        // The socket's directory must be root's alone (the agent checks).
        let dir = std::env::temp_dir().join(format!("stallwatch-bench-{}-{pid}", std::process::id()));
        fs::DirBuilder::new().mode(0o700).create(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let socket = dir.join("agent.sock");
        let mut child = Command::new(bin)
            .args(["run", "--pid", &pid.to_string(), "--profile", profile, "--ephemeral", "--output", "json"])
            .args(["--timeout", "10min", "--socket"])
            .arg(&socket)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| {
                format!("starting {} (build it with `cargo run --release -p xtask -- build`)", bin.display())
            })?;
        let mut stderr = BufReader::new(child.stderr.take().context("agent stderr")?);
        let mut log = String::new();
        loop {
            let mut line = String::new();
            if stderr.read_line(&mut line)? == 0 {
                let _ = child.wait();
                bail!("{} exited before watching pid {pid}:\n{log}", bin.display());
            }
            log.push_str(&line);
            if line.contains("watching") {
                break;
            }
        }
        // Keep reading its log so the agent never blocks on a full pipe.
        let stderr = thread::spawn(move || {
            let mut rest = String::new();
            let _ = stderr.read_to_string(&mut rest);
            log + &rest
        });
        let stdout = child.stdout.take();
        Ok(Self { child, stdout, stderr: Some(stderr), dir })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGINT, as an operator stops it; its summary.
    pub fn stop(mut self) -> Result<Summary> {
        // SAFETY: signalling our own child, which we have not reaped yet.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGINT) };
        let mut out = String::new();
        self.stdout.take().context("agent stdout")?.read_to_string(&mut out)?;
        let status = self.child.wait()?;
        let log = self.stderr.take().and_then(|log| log.join().ok()).unwrap_or_default();
        let summary = out
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .find(|value| value["alert"] == "summary")
            .with_context(|| format!("the agent ({status}) printed no summary; its log:\n{log}"))?;
        let field = |name: &str| summary[name].as_u64().with_context(|| format!("summary without {name}: {summary}"));
        let probes = summary["probes"].as_array().with_context(|| format!("summary without probes: {summary}"))?;
        let always_attached = probes
            .iter()
            .filter(|probe| probe["attached"] == "always")
            .map(|probe| {
                let symbol = probe["symbol"].as_str().with_context(|| format!("a probe without symbol: {probe}"))?;
                let hits = probe["hits"].as_u64().with_context(|| format!("a probe without hits: {probe}"))?;
                Ok((symbol.to_owned(), hits))
            })
            .collect::<Result<_>>()?;
        let every = probes
            .iter()
            .map(|probe| ProbeCount {
                symbol: probe["symbol"].as_str().unwrap_or_default().to_owned(),
                role: probe["role"].as_str().unwrap_or_default().to_owned(),
                hits: probe["hits"].as_u64().unwrap_or_default(),
                attached: probe["attached"].as_str().unwrap_or_default().to_owned(),
            })
            .collect();
        Ok(Summary {
            seen: field("seen")?,
            completed: field("completed")?,
            lost_events: field("lost_events")?,
            always_attached,
            probes: every,
        })
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.stdout.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The empty programs attached where the agent links a profile's probes
/// for the whole run: every lifecycle probe and signal (its entry half too,
/// for a return probe that reads arguments) and every completion activity
/// probe that resolves. Not the progress and post probes
/// ([`stallwatch::profile::ActivityKind::near_stall_only`]): the agent links those only while a
/// request nears its stall, so a healthy run never has them, and a floor
/// with them would be below the agent's real one.
pub struct Floor {
    _ebpf: Ebpf,
    /// The functions attached, one entry per attachment.
    pub symbols: Vec<String>,
}

/// One place a floor attaches an empty program.
struct Point {
    symbol: String,
    program: &'static str,
    path: PathBuf,
    offset: u64,
}

impl Floor {
    pub fn attach(pid: u32, profile: &Profile) -> Result<Self> {
        let points = Self::points(pid, profile)?;
        let mut ebpf = Ebpf::load(stallwatch::kernel::ebpf_object())?;
        for name in ["empty_entry", "empty_return"] {
            let program: &mut UProbe = ebpf.program_mut(name).context("empty program")?.try_into()?;
            program.load()?;
        }
        let scope = UProbeScope::OneProcess(NonZeroU32::new(pid).context("pid 0")?);
        let mut linked = std::collections::HashSet::new();
        for point in &points {
            // One entry program a function, as the agent links its probes
            // of one function's entry (chained on one link).
            if point.program == "empty_entry" && !linked.insert((&point.path, point.offset)) {
                continue;
            }
            let program: &mut UProbe = ebpf.program_mut(point.program).context("empty program")?.try_into()?;
            program.attach(UProbeAttachLocation::AbsoluteOffset(point.offset), &point.path, scope)?;
        }
        Ok(Self { _ebpf: ebpf, symbols: points.into_iter().map(|point| point.symbol).collect() })
    }

    /// The functions a floor on `pid` attaches, without attaching them.
    pub fn symbols(pid: u32, profile: &Profile) -> Result<Vec<String>> {
        Ok(Self::points(pid, profile)?.into_iter().map(|point| point.symbol).collect())
    }

    /// Where a floor on `pid` attaches its empty programs, without
    /// attaching them: (function, at its return, object, file offset), one
    /// a program (a function with two programs at its entry is there twice).
    pub fn places(pid: u32, profile: &Profile) -> Result<Vec<(String, bool, PathBuf, u64)>> {
        Ok(Self::points(pid, profile)?
            .into_iter()
            .map(|point| (point.symbol, point.program == "empty_return", point.path, point.offset))
            .collect())
    }

    fn points(pid: u32, profile: &Profile) -> Result<Vec<Point>> {
        let image = ProcessImage::read(pid)?;
        let mut points = Vec::new();
        for Half { object, symbol, at_return, optional } in halves(profile) {
            let program = if at_return { "empty_return" } else { "empty_entry" };
            let resolved =
                image.find(object).and_then(|mapped| Ok((ElfFile::open(&mapped.host_path)?.resolve(symbol)?, mapped)));
            match resolved {
                Ok((resolved, mapped)) => points.push(Point {
                    symbol: symbol.to_owned(),
                    program,
                    path: mapped.host_path,
                    offset: resolved.file_offset,
                }),
                // As the agent does: an optional probe or signal that is not there is skipped.
                Err(_) if optional => {}
                Err(err) => return Err(err),
            }
        }
        Ok(points)
    }
}

/// One half of a probe of a profile, as the agent links it.
pub struct Half<'a> {
    pub object: Option<&'a str>,
    pub symbol: &'a str,
    /// Its return (else its entry).
    pub at_return: bool,
    pub optional: bool,
}

/// The halves of `profile`'s probes the agent links on a healthy run: a
/// probe's entry (also a return probe's, when it reads arguments) and its
/// return; of the activity probes those always linked (not the ones
/// linked only near a stall).
pub fn halves<'a>(profile: &'a Profile) -> Vec<Half<'a>> {
    let mut halves = Vec::new();
    let mut add = |object: Option<&'a str>, symbol: &'a str, at: At, args_read: u32, optional: bool| {
        if at == At::Entry || args_read > 0 {
            halves.push(Half { object, symbol, at_return: false, optional });
        }
        if at == At::Return {
            halves.push(Half { object, symbol, at_return: true, optional });
        }
    };
    for spec in &profile.probes {
        add(spec.object.as_deref(), &spec.symbol, spec.at, spec.args_read(), false);
    }
    for spec in &profile.signals {
        add(spec.object.as_deref(), &spec.symbol, spec.at, spec.args_read(), spec.optional);
    }
    for spec in profile.activity.iter().filter(|spec| !spec.kind.near_stall_only()) {
        add(spec.object.as_deref(), &spec.symbol, At::Entry, 0, spec.optional);
    }
    halves
}

/// Debian's bpftrace, as `apt-get install bpftrace` gives it.
pub const BPFTRACE: &str = "bpftrace";

/// Whether bpftrace can be run (`xtask bench` installs it).
/// Who watches the target in one column of a side-by-side table.
#[derive(Clone)]
pub enum Config {
    Off,
    Empty,
    Bpftrace,
    Agent(PathBuf),
}

/// A table's columns, in order: off, the empty-program floor, bpftrace
/// (full runs only: a smoke run must not need it), this build's agent, and
/// the agent `STALLWATCH_BASELINE_BIN` names, if any.
pub fn columns(full: bool) -> Result<Vec<(&'static str, Config)>> {
    let mut columns = vec![("off", Config::Off), ("empty", Config::Empty)];
    if full {
        if !bpftrace_available() {
            bail!(
                "no `bpftrace` on PATH: `apt-get install -y bpftrace` (`cargo run --release -p xtask -- bench` does)"
            );
        }
        columns.push(("bpftrace", Config::Bpftrace));
    }
    columns.push(("stallwatch", Config::Agent(agent_bin())));
    if let Some(baseline) = baseline_bin() {
        columns.push(("baseline", Config::Agent(baseline)));
    }
    Ok(columns)
}

pub fn bpftrace_available() -> bool {
    Command::new(BPFTRACE).arg("--version").output().is_ok_and(|out| out.status.success())
}

/// bpftrace running one of `agent/benches/bpftrace/*.bt` on one process.
/// The script's `@NAME@` placeholders are replaced with paths known only
/// at run time (the target's binary and libraries); its `BEGIN` prints
/// `ready`, which bpftrace runs once every probe is attached. Its output
/// is read and counted, as a user of bpftrace would read it.
pub struct Bpftrace {
    child: Child,
    lines: Option<JoinHandle<u64>>,
    log: Option<JoinHandle<String>>,
    script: PathBuf,
}

impl Bpftrace {
    pub fn start(script: &str, pid: u32, paths: &[(&str, &Path)]) -> Result<Self> {
        let source = root().join("agent/benches/bpftrace").join(script);
        let mut text = fs::read_to_string(&source).with_context(|| format!("reading {}", source.display()))?;
        for (name, path) in paths {
            text = text.replace(&format!("@{name}@"), &path.to_string_lossy());
        }
        let file = std::env::temp_dir().join(format!("stallwatch-bench-{}-{script}", std::process::id()));
        fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
        let mut child = Command::new(BPFTRACE)
            .arg("-p")
            .arg(pid.to_string())
            .arg(&file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting bpftrace (`apt-get install -y bpftrace`; `xtask bench` does it)")?;
        let stdout = BufReader::new(child.stdout.take().context("bpftrace stdout")?);
        let mut stderr = child.stderr.take().context("bpftrace stderr")?;
        let log = thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        let (ready_tx, ready_rx) = mpsc::channel();
        let lines = thread::spawn(move || {
            let mut count = 0;
            let mut ready = Some(ready_tx);
            for line in stdout.lines().map_while(Result::ok) {
                match ready.take() {
                    Some(tx) if line == "ready" => {
                        let _ = tx.send(());
                    }
                    // "Attaching N probes...", before the probes fire.
                    Some(tx) => ready = Some(tx),
                    None => count += 1,
                }
            }
            count
        });
        let started = Instant::now();
        if ready_rx.recv_timeout(Duration::from_secs(120)).is_err() {
            let _ = child.kill();
            let _ = child.wait();
            let err = log.join().unwrap_or_default();
            bail!("bpftrace did not start {} on pid {pid} within {:?}:\n{err}", source.display(), started.elapsed());
        }
        Ok(Self { child, lines: Some(lines), log: Some(log), script: file })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGINT; how many lines it printed, and how many events it said it
    /// lost (its "Lost N events" lines).
    pub fn stop(mut self) -> Result<(u64, u64)> {
        // SAFETY: signalling our own child, which we have not reaped yet.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGINT) };
        self.child.wait()?;
        let lines = self.lines.take().and_then(|lines| lines.join().ok()).unwrap_or(0);
        let log = self.log.take().and_then(|log| log.join().ok()).unwrap_or_default();
        let lost = log
            .lines()
            .filter_map(|line| line.strip_prefix("Lost ")?.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        Ok((lines, lost))
    }
}

impl Drop for Bpftrace {
    fn drop(&mut self) {
        if self.lines.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = fs::remove_file(&self.script);
    }
}

/// The median of some figures (NaN for none).
pub fn median(values: &[f64]) -> f64 {
    let mut values = values.to_vec();
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// A bench's Python driver: a script that prints JSON lines with an
/// `event` (`ready` first, with the pids to watch), waits for `go` on its
/// stdin, and exits when its stdin closes. Its stderr is discarded (the
/// errors say to run it by hand); it runs in a process group of its own,
/// killed with the processes it started when dropped before [`Self::finish`].
pub struct Driver {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
    script: String,
    finished: bool,
}

impl Driver {
    /// `python` running `script` (a path under the repository) with `args`
    /// and `env`, up to its `ready` line, which it returns.
    pub fn spawn(
        python: &Path,
        script: &str,
        args: &[String],
        env: &[(&str, &str)],
    ) -> Result<(Self, serde_json::Value)> {
        let mut child = Command::new(python)
            .arg(root().join(script))
            .args(args)
            .envs(env.iter().copied())
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {script} with {}", python.display()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().with_context(|| format!("{script}'s stdout"))?;
        let mut driver =
            Self { child, stdin, lines: BufReader::new(stdout).lines(), script: script.to_owned(), finished: false };
        let ready = driver.until("ready")?;
        Ok((driver, ready))
    }

    /// Its next line whose `event` is `event` (other lines are skipped).
    pub fn until(&mut self, event: &str) -> Result<serde_json::Value> {
        for line in &mut self.lines {
            let line = line.with_context(|| format!("reading {}'s stdout", self.script))?;
            if let Ok(value) = serde_json::from_str::<serde_json::Value>(&line)
                && value["event"] == event
            {
                return Ok(value);
            }
        }
        bail!(
            "{} exited before `{event}` (its stderr is discarded: run it by hand with the same Python to see why)",
            self.script
        )
    }

    /// `go`: the driver starts what it times.
    pub fn go(&mut self) -> Result<()> {
        let stdin = self.stdin.as_mut().with_context(|| format!("{}'s stdin is closed", self.script))?;
        writeln!(stdin, "go").with_context(|| format!("telling {} to go", self.script))
    }

    /// Its stdin closed, its exit awaited.
    pub fn finish(mut self) {
        self.stdin = None;
        let _ = self.child.wait();
        self.finished = true;
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if !self.finished {
            // SAFETY: signalling the process group of a child not reaped yet.
            unsafe { libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL) };
            let _ = self.child.wait();
        }
    }
}

/// The keys of the requests an [`Agent`] has in flight, asked on its own
/// socket with `bin inflight --json` (`bin` the binary that runs it): what
/// it follows now, request by request (its summary only counts them).
pub fn inflight_keys(bin: &Path, agent: &Agent) -> Result<Vec<u64>> {
    let out = Command::new(bin)
        .args(["inflight", "--json", "--socket"])
        .arg(agent.dir.join("agent.sock"))
        .output()
        .with_context(|| format!("running {} inflight", bin.display()))?;
    if !out.status.success() {
        bail!("{} inflight: {}", bin.display(), String::from_utf8_lossy(&out.stderr));
    }
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).context("inflight --json")?;
    let rows = answer["requests"].as_array().with_context(|| format!("inflight without requests: {answer}"))?;
    rows.iter()
        .map(|row| {
            let key = row["key"].as_str().with_context(|| format!("a request without key: {row}"))?;
            u64::from_str_radix(key.trim_start_matches("0x"), 16).with_context(|| format!("key {key}"))
        })
        .collect()
}
