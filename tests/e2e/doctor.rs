//! `stallwatch doctor` on this machine, as root and without privileges:
//! the real binary, the real kernel. What the report must say is worked
//! out here from the machine itself (/proc/mounts, /sys), never assumed.
use std::{
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;
use stallwatch_tests::{Demo, Proc, agent_bin, require_root, run_to_end, test_socket};

fn doctor_json(command: &mut Command) -> (bool, Value, String) {
    let (ok, stdout, stderr) = run_to_end(command.args(["doctor", "--json"]));
    assert!(!stderr.contains("panicked"), "{stderr}");
    let report: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|err| panic!("doctor --json is not JSON ({err}):\n{stdout}\nstderr:\n{stderr}"));
    (ok, report, stderr)
}

fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no `{name}` check in {report:#}"))
}

/// Mount points of a filesystem type, from /proc/mounts.
fn mounted(fstype: &str) -> Vec<String> {
    let mounts = std::fs::read_to_string("/proc/mounts").expect("reading /proc/mounts");
    mounts
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(2) == Some(&fstype) { fields.get(1).map(|target| (*target).to_owned()) } else { None }
        })
        .collect()
}

fn tracefs_mounted() -> bool {
    mounted("tracefs").iter().any(|t| t == "/sys/kernel/tracing" || t == "/sys/kernel/debug/tracing")
}

#[test]
fn as_root_every_required_check_passes_and_the_report_matches_the_machine() {
    require_root();
    let (ok, report, stderr) = doctor_json(&mut Command::new(agent_bin()));
    assert!(ok, "doctor failed as root:\n{report:#}\nstderr:\n{stderr}");
    assert_eq!(report["ok"], true, "{report:#}");
    assert_eq!(report["failed_required"], serde_json::json!([]), "{report:#}");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    assert_eq!(report["kernel"], release.trim());

    // The real ones: a ring buffer created, the object loaded, both programs
    // attached to the doctor's own process and seen firing.
    for name in ["privileges", "uprobe_pmu", "ringbuf", "ebpf_load", "uprobe_attach"] {
        let c = check(&report, name);
        assert_eq!(c["status"], "ok", "{name}: {c:#}");
        assert_eq!(c["required"], true, "{name} is required");
    }
    assert!(check(&report, "uprobe_attach")["detail"].as_str().is_some_and(|d| d.contains("fired")));

    let btf = check(&report, "btf");
    let has_btf = Path::new("/sys/kernel/btf/vmlinux").exists();
    assert_eq!(btf["status"], if has_btf { "ok" } else { "missing" }, "{btf:#}");
    assert_eq!(btf["required"], false, "uprobes do not need BTF");
    // Process discovery's exec tracepoint is a BTF tracepoint.
    let exec = check(&report, "exec_tracepoint");
    assert_eq!(exec["status"], if has_btf { "ok" } else { "missing" }, "{exec:#}");
    assert_eq!(exec["required"], false, "--pid works without it");

    let tracefs = check(&report, "tracefs");
    assert_eq!(tracefs["required"], false);
    if tracefs_mounted() {
        assert_eq!(tracefs["status"], "ok", "tracefs is mounted ({:?}): {tracefs:#}", mounted("tracefs"));
        assert_eq!(tracefs["fix"], Value::Null);
    } else {
        assert_eq!(tracefs["status"], "missing", "no tracefs in /proc/mounts: {tracefs:#}");
        let fix = tracefs["fix"].as_str().unwrap_or_default();
        assert!(fix.starts_with("mount -t tracefs nodev /sys/kernel/tracing"), "{fix}");
        let needed = tracefs["needed_for"].as_str().unwrap_or_default();
        assert!(needed.contains("uprobe_events") && needed.contains("trace_pipe"), "{needed}");
    }

    let bpffs = check(&report, "bpffs");
    let has_bpffs = mounted("bpf").iter().any(|t| t == "/sys/fs/bpf");
    assert_eq!(bpffs["status"], if has_bpffs { "ok" } else { "missing" }, "{bpffs:#}");
    if !has_bpffs {
        assert!(bpffs["fix"].as_str().is_some_and(|f| f.starts_with("mount -t bpf bpf /sys/fs/bpf")), "{bpffs:#}");
    }

    // Every check has the same shape.
    for c in report["checks"].as_array().expect("checks") {
        assert!(["ok", "missing", "warning"].contains(&c["status"].as_str().unwrap_or("")), "{c:#}");
        assert!(c["detail"].as_str().is_some_and(|d| !d.is_empty()), "{c:#}");
        assert!(c["needed_for"].as_str().is_some_and(|d| !d.is_empty()), "{c:#}");
        assert_eq!(c["status"] == "ok", c["fix"].is_null(), "a fix exactly when not ok: {c:#}");
    }
}

#[test]
fn the_human_report_has_every_check_and_the_fixes() {
    require_root();
    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).arg("doctor"));
    assert!(ok, "{stdout}\n{stderr}");
    for name in [
        "kernel",
        "privileges",
        "btf",
        "uprobe_pmu",
        "ringbuf",
        "ebpf_load",
        "uprobe_attach",
        "exec_tracepoint",
        "tracefs",
        "bpffs",
        "memlock",
    ] {
        assert!(
            stdout.lines().any(|line| line.split_whitespace().any(|word| word == name)),
            "no `{name}` line:\n{stdout}"
        );
    }
    assert!(stdout.contains("all required checks passed"), "{stdout}");
    if !tracefs_mounted() {
        assert!(stdout.contains("fix: mount -t tracefs nodev /sys/kernel/tracing"), "{stdout}");
    }
}

/// A copy of the agent that an unprivileged user can execute, whatever the
/// permissions of the checkout it was built in.
struct ExecutableCopy {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl ExecutableCopy {
    fn new() -> Self {
        let dir = tempfile::Builder::new().prefix("stallwatch-doctor-").tempdir_in("/tmp").expect("temp dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod 755");
        let path = dir.path().join("stallwatch");
        std::fs::copy(agent_bin(), &path).expect("copying the agent");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod 755");
        Self { _dir: dir, path }
    }
}

#[test]
fn without_privileges_doctor_fails_and_says_what_to_grant() {
    require_root();
    let copy = ExecutableCopy::new();
    // nobody: no capabilities at all.
    let (ok, report, stderr) = doctor_json(Command::new(&copy.path).uid(65534).gid(65534).current_dir("/"));
    assert!(!ok, "doctor passed as nobody:\n{report:#}");
    assert_eq!(report["ok"], false);
    let failed: Vec<&str> =
        report["failed_required"].as_array().expect("list").iter().filter_map(Value::as_str).collect();
    for name in ["privileges", "ringbuf", "ebpf_load", "uprobe_attach"] {
        assert!(failed.contains(&name), "{name} not among the failed: {failed:?}");
        assert_eq!(check(&report, name)["status"], "missing");
    }
    let privileges = check(&report, "privileges");
    assert!(
        privileges["detail"].as_str().is_some_and(|d| d.starts_with("euid 65534") && d.contains("lacks CAP_BPF")),
        "{privileges:#}"
    );
    assert!(
        privileges["fix"]
            .as_str()
            .is_some_and(|f| f.contains("CAP_SYS_ADMIN (attaching uprobes") && f.contains("privileged: true")),
        "{privileges:#}"
    );
    assert!(check(&report, "ringbuf")["detail"].as_str().is_some_and(|d| d.contains("not permitted")));
    // What does not need privileges is still judged as it is.
    assert_eq!(check(&report, "uprobe_pmu")["status"], "ok");
    assert!(stderr.contains("required checks missing: privileges"), "{stderr}");
}

/// The agent run by `setpriv` keeping only `caps` (setpriv's names:
/// `sys_admin`) in the bounding set: as root, exec then gives it exactly
/// those.
fn with_only(caps: &[String]) -> Command {
    let bounding = std::iter::once("-all".to_owned())
        .chain(caps.iter().map(|cap| format!("+{cap}")))
        .collect::<Vec<_>>()
        .join(",");
    let mut command = Command::new("setpriv");
    command.args(["--inh-caps", "-all", "--bounding-set", &bounding, "--"]).arg(agent_bin());
    command
}

/// `run --pid` arguments for `pid`, on a socket of its own, pinning nothing.
fn run_args(pid: u32) -> Vec<String> {
    let socket = test_socket().to_str().expect("UTF-8 socket path").to_owned();
    ["run", "--profile", "demo", "--timeout", "1s", "--ephemeral", "--socket", &socket, "--pid", &pid.to_string()]
        .map(str::to_owned)
        .to_vec()
}

/// Issue 41: with CAP_SYS_ADMIN alone doctor passed and `run` then failed
/// on a root process ("is pid N a kernel thread?"): the kernel refuses
/// its /proc/PID/exe without CAP_SYS_PTRACE to a process holding more
/// capabilities. Doctor now fails naming what is missing, and with what
/// its fixes name added, it passes and `run` really attaches.
#[test]
fn with_cap_sys_admin_alone_doctor_fails_as_run_does_and_its_fix_makes_run_attach() {
    require_root();
    let demo = Demo::start(&["--rate", "100", "--duration", "60s"]);
    let pid = demo.proc.pid();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("demo status");
    assert!(status.contains("CapEff:\t000001ff"), "the demo is a root process with every capability:\n{status}");
    let admin = vec!["sys_admin".to_owned()];

    // What `run` says with CAP_SYS_ADMIN alone, on this kernel.
    let (ok, _, stderr) = run_to_end(with_only(&admin).args(run_args(pid)));
    assert!(!ok, "run attached with CAP_SYS_ADMIN alone: doctor need not ask for more\n{stderr}");
    assert!(stderr.contains(&format!("/proc/{pid}/exe")) && stderr.contains("Permission denied"), "{stderr}");

    // Doctor says so, naming the capability.
    let (ok, report, _) = doctor_json(&mut with_only(&admin));
    assert!(!ok, "doctor passed with CAP_SYS_ADMIN alone:\n{report:#}");
    assert_eq!(report["failed_required"], serde_json::json!(["ptrace"]), "{report:#}");
    let fixes: Vec<&str> = report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["required"] == true && c["status"] == "missing")
        .filter_map(|c| c["fix"].as_str())
        .collect();
    let named: Vec<String> = fixes
        .iter()
        .flat_map(|fix| fix.split(|c: char| !c.is_ascii_alphanumeric() && c != '_'))
        .filter_map(|word| word.strip_prefix("CAP_"))
        .map(str::to_lowercase)
        .collect();
    assert_eq!(named, ["sys_ptrace"], "the fixes: {fixes:?}");

    // With what the fix names added: doctor passes, and `run` attaches.
    let fixed: Vec<String> = admin.iter().chain(&named).cloned().collect();
    let (ok, report, stderr) = doctor_json(&mut with_only(&fixed));
    assert!(ok, "doctor failed with {fixed:?}:\n{report:#}\n{stderr}");
    let mut agent = Proc::spawn("stallwatch", with_only(&fixed).args(run_args(pid)));
    agent.wait_stderr(&format!("watching pid={pid}"), std::time::Duration::from_secs(30));
    agent.signal(libc::SIGINT);
    assert!(agent.wait(std::time::Duration::from_secs(20)).success(), "{}", agent.stderr());
}
