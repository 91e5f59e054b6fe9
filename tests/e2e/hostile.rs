//! What a watched process or another local user can do: nothing the agent
//! prints can be forged by the target (a line, a field, a terminal
//! sequence), nobody but root can prepare or replace the directories
//! the agent keeps its state and its socket in, what a mapped library's
//! path names after it was mapped changes nothing the agent reads or
//! probes, and a library whose reads never end costs only its own
//! process's watch.
use std::{
    ffi::{CString, OsStr},
    os::unix::ffi::OsStrExt as _,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use stallwatch_tests::{
    Agent, MemoryCgroup, Proc, agent_bin, demo_bin, marker_lib, require_root, root, run_to_end, summary, test_socket,
    venv_python,
};

/// A room string as hostile as 23 bytes allow: a quote, a line break, an
/// OSC sequence setting the terminal's title, a forged field, invalid UTF-8.
const ROOM: &[u8] = b"a\"\n\x1b]0;t\x07 class=x\xff";
/// How the agent shows it: one quoted token.
const ROOM_SHOWN: &str = "\"a\\\"\\n\\u{1b}]0;t\\u{7} class=x\u{fffd}\"";
/// An executable name (the process's `comm`) of the same kind.
const EXE: &[u8] = b"d\n\x1b]0;x\x07\" =\xff";
const EXE_SHOWN: &str = "\"d\\n\\u{1b}]0;x\\u{7}\\\" =\u{fffd}\"";

/// `key=value` tokens of a line (values may be double-quoted, with
/// backslash escapes), after its `lead` tokens.
fn fields(line: &str, lead: usize) -> Vec<(String, String)> {
    let mut fields = Vec::new();
    let mut rest = line;
    for _ in 0..lead {
        rest = rest.trim_start().split_once(' ').map_or("", |(_, rest)| rest);
    }
    while !rest.trim_start().is_empty() {
        rest = rest.trim_start();
        let (key, after) = rest.split_once('=').unwrap_or_else(|| panic!("not key=value at `{rest}` in: {line}"));
        assert!(!key.contains(' ') && !key.is_empty(), "a bare word `{key}` in: {line}");
        let end = if let Some(quoted) = after.strip_prefix('"') {
            let mut escaped = false;
            1 + quoted
                .char_indices()
                .find(|&(_, c)| {
                    let close = c == '"' && !escaped;
                    escaped = c == '\\' && !escaped;
                    close
                })
                .map(|(i, _)| i + 1)
                .unwrap_or_else(|| panic!("an unclosed quote in: {line}"))
        } else {
            after.find(' ').unwrap_or(after.len())
        };
        fields.push((key.to_owned(), after[..end].to_owned()));
        rest = &after[end..];
    }
    let mut keys: Vec<&str> = fields.iter().map(|(k, _)| k.as_str()).collect();
    keys.sort_unstable();
    assert!(keys.windows(2).all(|w| w[0] != w[1]), "a field given twice in: {line}");
    fields
}

fn field<'a>(fields: &'a [(String, String)], key: &str) -> &'a str {
    fields.iter().find(|(k, _)| k == key).map_or_else(|| panic!("no `{key}` in {fields:?}"), |(_, v)| v.as_str())
}

fn assert_printable(what: &str, text: &str) {
    for line in text.lines() {
        assert!(!line.chars().any(char::is_control), "{what}: a control character in {line:?}");
    }
}

#[test]
fn a_target_cannot_forge_alerts_table_rows_or_log_lines() {
    require_root();
    let dir = tempfile::tempdir().expect("temp dir");
    let exe = dir.path().join(OsStr::from_bytes(EXE));
    std::fs::copy(demo_bin(), &exe).expect("copying the demo under a hostile name");
    let mut demo = Proc::spawn(
        "demo-prefill",
        Command::new(&exe)
            .args([
                "--wait-for-go",
                "--rate",
                "100",
                "--duration",
                "5s",
                "--inject-after",
                "100ms",
                "--waiting-for-peer",
                "1",
            ])
            .arg("--pinned-room")
            .arg(OsStr::from_bytes(ROOM)),
    );
    demo.next_line(Duration::from_secs(10), "ready line");
    let socket = test_socket();
    let agent = Proc::spawn(
        "stallwatch",
        Command::new(agent_bin())
            .args(["run", "--pid", &demo.pid().to_string(), "--profile", "demo", "--timeout", "1s", "--ephemeral"])
            .arg("--socket")
            .arg(&socket),
    );
    agent.wait_stderr("watching", Duration::from_secs(30));
    demo.write_line("go");

    let mut lines = Vec::new();
    while !lines.iter().any(|l: &String| l.contains(" STALLED ")) {
        lines.push(agent.next_line(Duration::from_secs(10), "the stall alert").text);
    }
    // While it is stuck: the table.
    let (ok, table, stderr) = run_to_end(Command::new(agent_bin()).args(["inflight", "--socket"]).arg(&socket));
    assert!(ok, "{stderr}");
    assert_printable("inflight", &table);
    let rows: Vec<&str> = table.lines().collect();
    assert_eq!(rows.len(), 4, "header, one row, the totals, one process: {table}");
    assert!(rows[1].contains(ROOM_SHOWN) && rows[1].contains(EXE_SHOWN), "{table}");
    assert!(rows[3].contains(&format!("({EXE_SHOWN}, profile demo)")), "{table}");

    lines.extend(agent.lines_until_exit(Duration::from_secs(20)).into_iter().map(|l| l.text));
    let stdout = lines.join("\n");
    assert_printable("alerts", &stdout);
    for line in &lines {
        let first = line.split(' ').next().unwrap_or_default();
        let parsed = match first {
            "SUMMARY" | "PROBE" => fields(line, 1),
            ts if ts.starts_with("20") && ts.contains('T') => {
                let kind = line.split_whitespace().nth(1).unwrap_or_default();
                assert!(["STALLED", "PROCESS_EXITED"].contains(&kind), "unexpected alert: {line}");
                let parsed = fields(line, 2);
                assert_eq!(field(&parsed, "process"), EXE_SHOWN, "{line}");
                assert_eq!(field(&parsed, "external_id"), ROOM_SHOWN, "{line}");
                assert_eq!(field(&parsed, "class"), "waiting_for_peer", "{line}");
                parsed
            }
            _ => panic!("a line that is no alert, summary or probe line: {line:?}\nall:\n{stdout}"),
        };
        assert!(!parsed.is_empty(), "{line}");
    }
    assert_eq!(lines.iter().filter(|l| l.contains(" STALLED ")).count(), 1, "{stdout}");

    let logs = agent.stderr();
    assert_printable("logs", &logs);
    for line in logs.lines() {
        assert!(line.starts_with("20") && line.contains('T'), "a log line that is not one: {line:?}\nall:\n{logs}");
    }
    assert!(logs.contains(&format!("process={EXE_SHOWN}")), "{logs}");
}

/// What a tenant does to the path of a library its process has mapped
/// (issue 41): the agent must still read the library as mapped, within
/// bounded memory, and stay responsive to SIGTERM.
#[derive(Debug, Clone, Copy)]
enum Change {
    /// Grown in place to 6 GiB, sparse: the same inode, so the mapping
    /// stays valid.
    Grown,
    /// Replaced by a symlink to `/dev/zero`, endless to read.
    DevZero,
    /// Replaced by a FIFO nobody writes: a plain open blocks for ever.
    Fifo,
    /// Deleted, as an in-place package upgrade leaves the old library.
    Deleted,
}

impl Change {
    fn apply(self, path: &Path) {
        match self {
            Self::Grown => std::fs::File::options()
                .write(true)
                .open(path)
                .and_then(|file| file.set_len(6 << 30))
                .expect("growing the library in place"),
            Self::DevZero => {
                std::fs::remove_file(path).expect("removing the library");
                std::os::unix::fs::symlink("/dev/zero", path).expect("a symlink to /dev/zero in its place");
            }
            Self::Fifo => {
                std::fs::remove_file(path).expect("removing the library");
                let c_path = CString::new(path.as_os_str().as_bytes()).expect("no NUL");
                // SAFETY: mkfifo reads the NUL-terminated path, alive for the call.
                let made = unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) };
                assert_eq!(made, 0, "mkfifo: {}", std::io::Error::last_os_error());
            }
            Self::Deleted => std::fs::remove_file(path).expect("deleting the library"),
        }
    }
}

/// The memory the agent's cgroup allows: half a node's agent's (1 GiB),
/// so a whole-file read of the grown library or of /dev/zero ends in the
/// OOM killer, not in a slow pass.
const AGENT_MEMORY_MAX: u64 = 512 << 20;
/// What the agent's cgroup may peak at. Most of it is kernel memory the
/// verifier takes while the eBPF object loads, before any library is read
/// (about 180 MiB of a 190 MiB peak here, on 6.18).
const AGENT_CGROUP_PEAK: u64 = 300 << 20;
/// What the agent itself may peak at (`VmHWM`: its resident pages), about
/// 40 MiB here: a read of 60 MiB more of the library than its tables
/// would show, where the cgroup's peak, set by the load, would not.
const AGENT_RESIDENT_PEAK: u64 = 100 << 20;
/// How soon the agent must be gone after SIGTERM.
const STOP_WITHIN: Duration = Duration::from_secs(2);

/// A process maps a copy of the marker library, the test `change`s the
/// copy's path, then the agent is started on the process in a memory
/// cgroup: it must attach to the library as mapped (the inode is intact
/// in every row, and the kernel's uprobe goes on it through map_files),
/// follow the process's requests, stay under [`AGENT_RESIDENT_PEAK`] and
/// [`AGENT_CGROUP_PEAK`], and exit within [`STOP_WITHIN`] of a SIGTERM.
fn a_library_changed_after_mapping_is_watched_as_mapped(change: Change) {
    require_root();
    let dir = tempfile::tempdir().expect("temp dir");
    let lib = dir.path().join("libstallwatch_marker.so");
    std::fs::copy(marker_lib(), &lib).expect("copying the marker library");
    let mut driver =
        Proc::spawn("marker driver", Command::new(venv_python()).arg(root().join("tests/marker/driver.py")).arg(&lib));
    let ready = driver.next_line(Duration::from_secs(10), "ready line").json().expect("ready line is JSON");
    let pid = ready["pid"].as_u64().expect("pid") as u32;
    change.apply(&lib);

    let cgroup = MemoryCgroup::new(AGENT_MEMORY_MAX);
    let agent = Agent::on_pid(pid).profile("marker").timeout("1s").in_cgroup(&cgroup).start();
    agent.proc.wait_stderr(&format!("watching pid={pid}"), Duration::from_secs(15));
    let stderr = agent.proc.stderr();
    let attached = stderr.lines().filter(|l| l.contains("probe attached")).collect::<Vec<_>>();
    assert_eq!(attached.len(), 6, "{change:?}: a probe on each stage function:\n{stderr}");
    assert!(attached.iter().all(|l| l.contains(lib.to_str().expect("utf-8"))), "{change:?}:\n{stderr}");

    driver.write_line("go");
    let marked = driver.next_line(Duration::from_secs(10), "marked line");
    assert_eq!(marked.json().expect("marked line is JSON")["event"], "marked", "{}", marked.text);
    // The request the driver fails is reported when its event comes: the
    // uprobes fire in the inode the process runs.
    let mut seen = Vec::new();
    let failed = agent.wait_alerts("failed", 1, Duration::from_secs(5), &mut seen);
    assert_eq!(failed[0].1["external_id"], "7006", "{change:?}: {}", failed[0].1);

    let resident = resident_peak(agent.proc.pid());
    assert!(resident < AGENT_RESIDENT_PEAK, "{change:?}: the agent's resident memory peaked at {} MiB", resident >> 20);

    let stopping = Instant::now();
    agent.proc.signal(libc::SIGTERM);
    seen.extend(agent.proc.lines_until_exit(STOP_WITHIN));
    let stopped = stopping.elapsed();
    assert!(stopped <= STOP_WITHIN, "{change:?}: the agent took {stopped:?} to exit on SIGTERM");
    let summary = summary(&seen);
    assert_eq!(summary["seen"], 6, "{change:?}: {summary}");
    assert_eq!(summary["lost_events"], 0, "{change:?}: {summary}");
    let peak = cgroup.peak();
    assert!(peak < AGENT_CGROUP_PEAK, "{change:?}: the agent's cgroup peaked at {} MiB", peak >> 20);
    drop(agent);
}

/// The peak resident memory (`VmHWM`) of process `pid`, in bytes.
fn resident_peak(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("reading the agent's status");
    let kib = status.lines().find_map(|line| line.strip_prefix("VmHWM:")?.trim().strip_suffix(" kB")?.parse().ok());
    kib.map(|kib: u64| kib << 10).unwrap_or_else(|| panic!("no VmHWM in:\n{status}"))
}

#[test]
fn a_mapped_library_grown_in_place_to_6_gib_is_read_only_as_far_as_its_tables() {
    a_library_changed_after_mapping_is_watched_as_mapped(Change::Grown);
}

#[test]
fn a_mapped_library_replaced_by_a_symlink_to_dev_zero_is_read_as_mapped() {
    a_library_changed_after_mapping_is_watched_as_mapped(Change::DevZero);
}

#[test]
fn a_mapped_library_replaced_by_a_fifo_is_read_as_mapped_without_blocking() {
    a_library_changed_after_mapping_is_watched_as_mapped(Change::Fifo);
}

#[test]
fn a_deleted_mapped_library_is_read_and_probed_as_mapped() {
    a_library_changed_after_mapping_is_watched_as_mapped(Change::Deleted);
}

/// A marker process whose library is on a FUSE filesystem that stopped
/// answering reads (the worst a tenant's files can do), beside a healthy
/// marker process, both matching the selector.
struct FrozenBeside {
    fs: Proc,
    _mount: tempfile::TempDir,
    _hostile: Proc,
    hostile_pid: u32,
    healthy: Proc,
    healthy_pid: u32,
}

impl FrozenBeside {
    fn start() -> Self {
        let mount = tempfile::tempdir().expect("mount point");
        let mut fs = Proc::spawn(
            "frozen_fs",
            Command::new("python3").arg(root().join("tests/support/frozen_fs.py")).arg(mount.path()).arg(marker_lib()),
        );
        let mounted = fs.next_line(Duration::from_secs(10), "mounted line").json().expect("mounted line is JSON");
        let driver = |lib: &str| {
            let driver = root().join("tests/marker/driver.py");
            let proc = Proc::spawn("marker driver", Command::new(venv_python()).arg(driver).arg(lib));
            let ready = proc.next_line(Duration::from_secs(10), "ready line").json().expect("ready line is JSON");
            (proc, ready["pid"].as_u64().expect("pid") as u32)
        };
        let (hostile, hostile_pid) = driver(mounted["path"].as_str().expect("path"));
        fs.write_line("freeze");
        fs.next_line(Duration::from_secs(5), "frozen line");
        let (healthy, healthy_pid) = driver(marker_lib().to_str().expect("utf-8"));
        Self { fs, _mount: mount, _hostile: hostile, hostile_pid, healthy, healthy_pid }
    }

    /// An agent discovering both, in `cgroup`; once ready, the line that
    /// refused the frozen process (said once), and how long the agent took
    /// to be ready.
    fn discover(&self, cgroup: &MemoryCgroup, extra: &[&str]) -> (Agent, String, Duration) {
        let started = Instant::now();
        let agent = Agent::selecting(&["--lib", "libstallwatch_marker.so"])
            .profile("marker")
            .timeout("1s")
            .args(extra)
            .in_cgroup(cgroup)
            .discover();
        let ready = started.elapsed();
        agent.wait_watching(self.healthy_pid);
        let stderr = agent.proc.stderr();
        let pid_field = format!("pid={}", self.hostile_pid);
        let refusals: Vec<&str> =
            stderr.lines().filter(|line| line.contains("not watching") && line.ends_with(&pid_field)).collect();
        assert_eq!(refusals.len(), 1, "the frozen process is said once:\n{stderr}");
        (agent, refusals[0].to_owned(), ready)
    }

    /// The healthy process's three unfinished rooms stall, each alerted
    /// within a second of its timeout.
    fn healthy_stalls_on_time(&mut self, agent: &Agent) {
        self.healthy.write_line("go");
        let marked = self.healthy.next_line(Duration::from_secs(10), "marked line");
        let mut seen = Vec::new();
        for (at, alert) in agent.wait_alerts("stalled", 3, Duration::from_secs(6), &mut seen) {
            assert_eq!(alert["pid"], self.healthy_pid, "{alert}");
            let latency = at.duration_since(marked.at);
            assert!(latency <= Duration::from_secs(2), "the healthy process's stall was late: {latency:?} {alert}");
        }
    }
}

/// By default the agent reads nothing on a FUSE filesystem (a server that
/// does not answer holds a reader past every signal): the process is
/// refused at once, saying why and how to trust such a filesystem, and
/// every other process is watched.
#[test]
fn a_library_on_fuse_is_not_read_unless_trusted_and_costs_only_its_own_watch() {
    require_root();
    let mut frozen = FrozenBeside::start();
    let cgroup = MemoryCgroup::new(AGENT_MEMORY_MAX);
    let (agent, refusal, ready) = frozen.discover(&cgroup, &[]);
    assert!(refusal.contains("on a FUSE filesystem (fuse)") && refusal.contains("--trust-fuse"), "{refusal}");
    eprintln!("ready {ready:?} after start, the FUSE process refused unread");
    frozen.healthy_stalls_on_time(&agent);
    let resident = resident_peak(agent.proc.pid());
    assert!(resident < AGENT_RESIDENT_PEAK, "the agent's resident memory peaked at {} MiB", resident >> 20);
    let stop = Instant::now();
    let (lines, _) = agent.stop_logged(libc::SIGTERM);
    let stopped = stop.elapsed();
    eprintln!("stopped {stopped:?} after SIGTERM");
    assert!(stopped <= STOP_WITHIN, "the agent took {stopped:?} to exit on SIGTERM");
    assert!(cgroup.peak() < AGENT_CGROUP_PEAK, "the agent's cgroup peaked at {} MiB", cgroup.peak() >> 20);
    let last = summary(&lines);
    assert_eq!(last["refused_processes"], 1, "{last}");
    assert_eq!(last["stalled"], 3, "{last}");
    assert!(cgroup.peak() < AGENT_CGROUP_PEAK, "the agent's cgroup peaked at {} MiB", cgroup.peak() >> 20);
}

/// Trusted (`--trust-fuse`), the frozen library's read hangs: it costs the
/// agent that process's watch after the read deadline, counted and said
/// once; the other process is watched and its stalls alerted on time; a
/// stop still takes its steps at once. The hung read itself ends only when
/// the server goes (the kernel lets no signal end it).
#[test]
fn a_trusted_fuse_library_that_never_answers_costs_only_its_own_watch() {
    require_root();
    let mut frozen = FrozenBeside::start();
    let cgroup = MemoryCgroup::new(AGENT_MEMORY_MAX);
    let (mut agent, refusal, ready) = frozen.discover(&cgroup, &["--trust-fuse"]);
    assert!(refusal.contains("took longer than"), "{refusal}");
    eprintln!("ready {ready:?} after start, the frozen process refused on its deadline");
    frozen.healthy_stalls_on_time(&agent);
    let resident = resident_peak(agent.proc.pid());
    assert!(resident < AGENT_RESIDENT_PEAK, "the agent's resident memory peaked at {} MiB", resident >> 20);
    let stop = Instant::now();
    agent.proc.signal(libc::SIGTERM);
    agent.proc.wait_stderr("probes left attached", STOP_WITHIN);
    eprintln!("stop done {:?} after SIGTERM, a read still hung", stop.elapsed());
    // The server gone, the kernel fails the hung read and the agent's
    // process ends.
    drop(frozen.fs);
    let lines = agent.proc.lines_until_exit(Duration::from_secs(10));
    assert!(agent.proc.wait(Duration::from_secs(5)).success());
    let last = summary(&lines);
    assert_eq!(last["refused_processes"], 1, "{last}");
    assert_eq!(last["stalled"], 3, "{last}");
    assert!(cgroup.peak() < AGENT_CGROUP_PEAK, "the agent's cgroup peaked at {} MiB", cgroup.peak() >> 20);
}
