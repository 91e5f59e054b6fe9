//! Soak: "nothing lost, nothing invented" under a hostile host, measured,
//! not asserted (the smoke version asserts the two zeros). For the run's
//! length (`STALLWATCH_SOAK_SECS`, 600 by default) the real agent follows,
//! by discovery (`--exe demo-prefill`), one demo target at its highest
//! sustained rate and, every 15-30 s, a short-lived demo that pins 1-3
//! requests (random stall classes, at a random moment) and exits later;
//! meanwhile the agent is SIGSTOPped for 0.5-10 s every 10-40 s (its ring
//! buffer overflows), and the OTLP collector (rotel) goes away for 20 s
//! every 90 s and comes back on the same port. It reports stalls injected
//! against reported (missed, invented, late: later than timeout + 1 s after
//! the request's last event, which a pause makes unavoidable and which is
//! counted with the pauses), events lost against resynchronisations, and
//! the agent's RSS over time.
//!
//! `cargo bench -p stallwatch --bench soak` (as root) with `STALLWATCH_DEMO`
//! set, or `cargo run --release -p xtask -- bench`. Under `cargo test
//! --all-targets` a 25 s smoke version runs (one pinned demo, one pause),
//! and fails unless nothing was missed and nothing invented.
mod support;

use std::{
    collections::{HashMap, HashSet},
    io::{BufRead as _, BufReader},
    net::{Ipv4Addr, TcpListener},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

const TIMEOUT: Duration = Duration::from_secs(5);
const LATE: Duration = Duration::from_secs(1);
/// The healthy target's rate: as high as the demo sustains here with the
/// probes on (one request at a time, so its rate is its latency's limit).
const RATE: u32 = 20_000;

/// A line of a child's stdout, and when it was read (on both clocks: the
/// agent's log is stamped with the wall clock).
type Lines = Arc<Mutex<Vec<(Instant, std::time::SystemTime, serde_json::Value)>>>;

fn main() -> Result<()> {
    support::require_root("the soak benchmark")?;
    let smoke = support::smoke();
    let secs: u64 =
        if smoke { 25 } else { std::env::var("STALLWATCH_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(600) };
    let root = support::root();
    let demo =
        root.join(std::env::var("STALLWATCH_DEMO").unwrap_or_else(|_| "target/demo/release/demo-prefill".into()));
    let agent_bin = support::agent_bin();
    let rotel = rotel_bin().context(
        "no rotel-agent under the venv (STALLWATCH_VENV): run `cargo run --release -p xtask -- setup --python`",
    )?;
    let mut rng = Rng(0x5eed_50a4 ^ u64::from(std::process::id()));
    let tag = format!("stallwatch-bench-soak-{}", std::process::id());
    let bpf_dir = PathBuf::from("/sys/fs/bpf").join(&tag);
    let socket_dir = std::env::temp_dir().join(&tag);
    let socket = socket_dir.join("agent.sock");
    let log = std::env::temp_dir().join(format!("{tag}.log"));
    let otlp_port = free_port();
    let mut collector = Some(Collector::start(&rotel, otlp_port)?);

    // Only this run's demos, tagged on their command line (their pinned
    // rooms' bytes): other demos on the host are not the soak's.
    let room = format!("soak-{}", std::process::id());
    let agent = Command::new(&agent_bin)
        .args(["run", "--exe", "demo-prefill", "--cmdline", &room, "--profile", "demo", "--output", "json"])
        .args([
            "--timeout",
            &format!("{}s", TIMEOUT.as_secs()),
            "--otlp-endpoint",
            &format!("http://127.0.0.1:{otlp_port}"),
        ])
        .arg("--bpf-dir")
        .arg(&bpf_dir)
        .arg("--socket")
        .arg(&socket)
        .args(["--on-exit", "detach"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?)
        .spawn()
        .with_context(|| format!("starting {}", agent_bin.display()))?;
    let mut agent = Killed(agent);
    let alerts = read_lines(agent.0.stdout.take().context("agent stdout")?);
    let agent_pid = agent.0.id();
    thread::sleep(Duration::from_secs(2));

    let start = Instant::now();
    let end = start + Duration::from_secs(secs);
    let mut healthy =
        Killed(spawn_demo(&demo, &room, &["--rate", &RATE.to_string(), "--duration", &format!("{}s", secs + 30)])?);
    let _healthy_lines = read_lines(healthy.0.stdout.take().context("demo stdout")?);
    // Pinned demos: their lines (for the `injected` ones) and processes.
    let mut pinned_demos: Vec<(Killed, Lines)> = Vec::new();
    let mut next_pinned = start + Duration::from_secs(if smoke { 1 } else { 5 });
    let mut next_pause = start + Duration::from_secs(if smoke { 8 } else { rng.range(10, 40) });
    let mut next_outage = start + Duration::from_secs(if smoke { 12 } else { 90 });
    let mut outage_until: Option<Instant> = None;
    let (mut pauses, mut paused_total) = (Vec::new(), Duration::ZERO);
    let mut rss = Vec::new();
    let mut next_rss = start;
    while Instant::now() < end {
        let now = Instant::now();
        if now >= next_rss {
            rss.push((now.duration_since(start).as_secs(), rss_kib(agent_pid).unwrap_or(0)));
            next_rss = now + Duration::from_secs(if smoke { 5 } else { 30 });
        }
        // None so late that its stalls could not come due before the stop.
        let late_start = end.saturating_duration_since(now) < Duration::from_secs(15);
        if now >= next_pinned && !late_start && (!smoke || pinned_demos.is_empty()) {
            let classes = ["--waiting-for-peer", "--transfer-hung", "--release-lost"];
            let mut args = vec!["--rate".to_owned(), "50".to_owned(), "--duration".to_owned(), "40s".to_owned()];
            args.extend(["--inject-after".to_owned(), format!("{}ms", 1000 + rng.range(0, 9000))]);
            let class = classes[rng.range(0, 3) as usize];
            args.extend([class.to_owned(), rng.range(1, 4).to_string()]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut child = Killed(spawn_demo(&demo, &room, &args)?);
            let lines = read_lines(child.0.stdout.take().context("demo stdout")?);
            pinned_demos.push((child, lines));
            next_pinned = now + Duration::from_secs(rng.range(15, 31));
        }
        if now >= next_pause {
            let pause = Duration::from_millis(if smoke { 2000 } else { rng.range(500, 10_001) });
            signal(agent_pid, libc::SIGSTOP);
            thread::sleep(pause);
            signal(agent_pid, libc::SIGCONT);
            pauses.push((now.duration_since(start), pause));
            paused_total += pause;
            next_pause = Instant::now() + Duration::from_secs(if smoke { 1000 } else { rng.range(10, 41) });
        }
        if now >= next_outage && outage_until.is_none() {
            collector = None;
            outage_until = Some(now + Duration::from_secs(if smoke { 4 } else { 20 }));
        }
        if outage_until.is_some_and(|until| now >= until) {
            collector = Some(Collector::start(&rotel, otlp_port)?);
            outage_until = None;
            next_outage = now + Duration::from_secs(if smoke { 1000 } else { 90 });
        }
        thread::sleep(Duration::from_millis(50));
    }
    // The last pinned requests' stalls come due, then the agent stops.
    thread::sleep(TIMEOUT + Duration::from_secs(2));
    if collector.is_none() {
        collector = Some(Collector::start(&rotel, otlp_port)?);
    }
    rss.push((start.elapsed().as_secs(), rss_kib(agent_pid).unwrap_or(0)));
    // An agent that died on its own is the finding, not what it then missed.
    if let Some(status) = agent.0.try_wait().context("waiting for the agent")? {
        let log_text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = log_text.lines().rev().take(20).collect();
        bail!(
            "the agent exited on its own ({status}) before the soak ended; the end of its log ({}):\n{}",
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    signal(agent_pid, libc::SIGINT);
    let exited = wait_exit(&mut agent.0, Duration::from_secs(30));
    drop(collector);

    // When the agent attached to each demo (its log's `watching` lines): a
    // request pinned before that had no probe to see it, on any agent.
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    let watched: HashMap<u64, std::time::SystemTime> = log_text
        .lines()
        .filter(|line| line.contains("watching pid="))
        .filter_map(|line| {
            let at = humantime::parse_rfc3339(line.split_whitespace().next()?).ok()?;
            let pid = line.split("watching pid=").nth(1)?.split_whitespace().next()?.parse().ok()?;
            Some((pid, at))
        })
        .collect();
    // Injected: (pid, key) -> when the demo said it pinned it (its last event).
    let mut injected: HashMap<(u64, String), Instant> = HashMap::new();
    let mut before_attach = 0;
    for (child, lines) in &pinned_demos {
        let pid = u64::from(child.0.id());
        for (at, wall, line) in lines.lock().expect("lines").iter() {
            if line["event"] == "injected" {
                if watched.get(&pid).is_none_or(|attached| attached > wall) {
                    before_attach += 1;
                    continue;
                }
                let key = format!("{:#x}", line["key"].as_u64().unwrap_or_default());
                injected.insert((pid, key), *at);
            }
        }
    }
    let lines = alerts.lock().expect("alerts").clone();
    let mut reported: HashMap<(u64, String), Instant> = HashMap::new();
    let mut invented = Vec::new();
    for (at, _, alert) in &lines {
        if alert["alert"] != "stalled" {
            continue;
        }
        let id = (alert["pid"].as_u64().unwrap_or_default(), alert["key"].as_str().unwrap_or_default().to_owned());
        if injected.contains_key(&id) {
            reported.entry(id).or_insert(*at);
        } else {
            invented.push(alert.clone());
        }
    }
    let missed: Vec<_> = injected.keys().filter(|id| !reported.contains_key(*id)).collect();
    let late = reported.iter().filter(|(id, at)| at.duration_since(injected[*id]) > TIMEOUT + LATE).count();
    let summary = lines.iter().map(|(_, _, l)| l).find(|l| l["alert"] == "summary").cloned().unwrap_or_default();
    // A stall late past timeout + 1 s whose due time fell in a pause (or
    // within the second around it) was late because the agent was stopped.
    let in_pause = |due: Instant| {
        pauses.iter().any(|(at, pause): &(Duration, Duration)| {
            let from = start + *at;
            due + LATE >= from && due <= from + *pause + LATE
        })
    };
    let late_in_pause = reported
        .iter()
        .filter(|(id, at)| at.duration_since(injected[*id]) > TIMEOUT + LATE && in_pause(injected[*id] + TIMEOUT))
        .count();
    let distinct: HashSet<_> = reported.keys().collect();

    println!(
        "soak: {secs} s, healthy demo at {RATE}/s, {} pinned demos, timeout {}s",
        pinned_demos.len(),
        TIMEOUT.as_secs()
    );
    println!(
        "  agent pauses     {} (0.5-10 s), {:.1} s paused in all: {:?}",
        pauses.len(),
        paused_total.as_secs_f64(),
        pauses
            .iter()
            .map(|(at, d): &(Duration, Duration)| format!("{}s+{:.1}s", at.as_secs(), d.as_secs_f64()))
            .collect::<Vec<_>>()
    );
    println!(
        "  stalls injected  {} (and {before_attach} pinned before the agent had attached to their demo: no probe saw them)",
        injected.len()
    );
    println!(
        "  reported         {} (missed {}, invented {}, late past timeout + 1 s {late}, of which {late_in_pause} came due in a pause)",
        distinct.len(),
        missed.len(),
        invented.len()
    );
    for (id, at) in &reported {
        let lateness = at.duration_since(injected[id]).saturating_sub(TIMEOUT);
        if lateness > LATE {
            let due = injected[id] + TIMEOUT;
            println!(
                "  late             pid {} key {} due at {:.1}s, reported {:.1}s after{}",
                id.0,
                id.1,
                due.duration_since(start).as_secs_f64(),
                lateness.as_secs_f64(),
                if in_pause(due) { " (a pause)" } else { "" }
            );
        }
    }
    for id in &missed {
        println!(
            "  missed           pid {} key {} pinned at {:.1}s",
            id.0,
            id.1,
            injected[*id].duration_since(start).as_secs_f64()
        );
    }
    println!(
        "  events           lost {} (ringbuf_full {}), resyncs {}, taken over {}, ended unseen {}, duplicate_events {}, caught_up_repeats {}",
        summary["lost_events"],
        summary["ringbuf_full"],
        summary["resyncs"],
        summary["restored"],
        summary["end_unseen"],
        summary["duplicate_events"],
        summary["caught_up_repeats"]
    );
    println!(
        "  requests         seen {}, completed {}, export_drops {}",
        summary["seen"], summary["completed"], summary["export_drops"]
    );
    println!("  agent RSS (KiB)  {}", rss.iter().map(|(t, kib)| format!("{t}s:{kib}")).collect::<Vec<_>>().join(" "));
    println!("  agent log        {}", log.display());
    if !exited {
        bail!("the agent did not exit within 30 s of SIGINT (its log: {})", log.display());
    }
    if smoke && (!missed.is_empty() || !invented.is_empty() || injected.is_empty()) {
        bail!(
            "soak smoke: {} injected, missed {missed:?}, invented {invented:?} (the agent's log: {})",
            injected.len(),
            log.display()
        );
    }
    let _ = std::fs::remove_dir_all(&bpf_dir);
    let _ = std::fs::remove_dir_all(&socket_dir);
    Ok(())
}

fn spawn_demo(demo: &PathBuf, room: &str, args: &[&str]) -> Result<Child> {
    Command::new(demo)
        .args(args)
        .args(["--pinned-room", room])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {} (build it with `cargo run --release -p xtask -- build`)", demo.display()))
}

/// Every JSON line of `out`, with when it was read, gathered by a thread.
fn read_lines(out: impl std::io::Read + Send + 'static) -> Lines {
    let lines: Lines = Arc::default();
    let sink = Arc::clone(&lines);
    thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Ok(value) = serde_json::from_str(&line) {
                sink.lock().expect("lines").push((Instant::now(), std::time::SystemTime::now(), value));
            }
        }
    });
    lines
}

fn signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) on a child of ours.
    unsafe { libc::kill(pid as i32, signal) };
}

fn wait_exit(child: &mut Child, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            return true;
        }
        thread::sleep(Duration::from_millis(50));
    }
    false
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|line| line.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
}

/// A child killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// rotel with the blackhole exporter, on a port given (it comes back on
/// the same one after an outage).
struct Collector {
    _child: Killed,
    _dir: tempfile::TempDir,
}

impl Collector {
    fn start(bin: &PathBuf, port: u16) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let child = Command::new(bin)
            .args(["start", "--exporter", "blackhole", "--otlp-grpc-endpoint", &format!("127.0.0.1:{}", free_port())])
            .args(["--otlp-http-endpoint", &format!("127.0.0.1:{port}")])
            .arg("--pid-file")
            .arg(dir.path().join("pid"))
            .arg("--log-file")
            .arg(dir.path().join("log"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Self { _child: Killed(child), _dir: dir })
    }
}

fn rotel_bin() -> Option<PathBuf> {
    let venv = support::venv_python().parent()?.parent()?.to_path_buf();
    std::fs::read_dir(venv.join("lib"))
        .ok()?
        .filter_map(Result::ok)
        .map(|python| python.path().join("site-packages/rotel/rotel-agent"))
        .find(|path| path.exists())
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(4318)
}

/// A xorshift die: the soak's schedule, different each run (the seed is
/// the pid), with no crate for randomness.
struct Rng(u64);

impl Rng {
    /// In `lo..hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        lo + self.0 % (hi - lo).max(1)
    }
}
