//! Nothing another local user does can take the agent's state: a bpf
//! directory (`--bpf-dir`) or a socket directory another user owns, can
//! write to, or reaches through a symlink is refused, naming the directory
//! and why, before anything is pinned, attached or bound; what the agent
//! creates itself is root's, mode 0700.
use std::{
    ffi::CString,
    os::unix::{
        ffi::OsStrExt as _,
        fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _},
        net::UnixListener,
    },
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{Agent, Demo, Proc, agent_bin, require_root, run_to_end, test_socket};

/// uid and gid of `nobody`: another local user.
const NOBODY: u32 = 65534;
/// `statfs(2)`'s `f_type` of a BPF filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn chown_nobody(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).expect("path");
    // SAFETY: a NUL-terminated path.
    let done = unsafe { libc::lchown(c.as_ptr(), NOBODY, NOBODY) } == 0;
    assert!(done, "chown {} to nobody: {}", path.display(), std::io::Error::last_os_error());
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

fn mkdir(path: &Path) -> PathBuf {
    std::fs::create_dir(path).unwrap_or_else(|err| panic!("mkdir {}: {err}", path.display()));
    path.to_owned()
}

fn symlink(target: &Path, link: &Path) {
    std::os::unix::fs::symlink(target, link)
        .unwrap_or_else(|err| panic!("ln -s {} {}: {err}", target.display(), link.display()));
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir).expect("listing").map(|entry| entry.expect("entry").path()).collect()
}

fn arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// A fresh root-only directory on bpffs, under the tests' own
/// `/sys/fs/bpf/stallwatch-tests/`; removed (unpinning whatever is in it)
/// when dropped.
struct BpfScratch(PathBuf);

impl BpfScratch {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let bpffs = Path::new("/sys/fs/bpf");
        // SAFETY: statfs writes into the zeroed struct we own.
        let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: a NUL-terminated path and a valid out pointer.
        let on_bpffs =
            unsafe { libc::statfs(c"/sys/fs/bpf".as_ptr(), &mut stat) } == 0 && stat.f_type as i64 == BPF_FS_MAGIC;
        if !on_bpffs {
            // SAFETY: NUL-terminated strings and no data argument.
            let mounted =
                unsafe { libc::mount(c"bpf".as_ptr(), c"/sys/fs/bpf".as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null()) }
                    == 0;
            assert!(mounted, "these tests need bpffs at {}: {}", bpffs.display(), std::io::Error::last_os_error());
        }
        let parent = bpffs.join("stallwatch-tests");
        let _ = std::fs::create_dir(&parent);
        let dir = parent.join(format!("trust-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        mkdir(&dir);
        chmod(&dir, 0o700);
        Self(dir)
    }
}

impl Drop for BpfScratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Run the agent on `demo` with `args`; it must fail at start-up, never
/// get as far as watching: its stderr.
fn refused(demo: &Demo, args: &[&str]) -> String {
    let mut agent = Proc::spawn(
        "stallwatch",
        Command::new(agent_bin()).args(["run", "--pid", &demo.proc.pid().to_string(), "--profile", "demo"]).args(args),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = agent.child.try_wait().expect("try_wait") {
            assert!(!status.success(), "the agent exited 0 with {args:?}; stderr:\n{}", agent.stderr());
            agent.wait_stderr("stallwatch: error:", Duration::from_secs(5));
            let stderr = agent.stderr();
            assert!(!stderr.contains("panicked"), "{stderr}");
            return stderr;
        }
        let stderr = agent.stderr();
        assert!(!stderr.contains("watching"), "the agent started with {args:?}; stderr:\n{stderr}");
        assert!(Instant::now() < deadline, "the agent neither failed nor started with {args:?}; stderr:\n{stderr}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn assert_says(stderr: &str, needles: &[&str]) {
    for needle in needles {
        assert!(stderr.contains(needle), "no `{needle}` in:\n{stderr}");
    }
}

#[test]
fn a_bpf_dir_another_user_owns_is_refused_and_nothing_is_pinned_in_it() {
    require_root();
    let scratch = BpfScratch::new();
    let dir = mkdir(&scratch.0.join("state"));
    chown_nobody(&dir);
    let demo = Demo::start(&[]);
    let stderr = refused(&demo, &["--bpf-dir", arg(&dir), "--socket", arg(&test_socket())]);
    let shown = dir.display().to_string();
    assert_says(
        &stderr,
        &[
            &format!("the bpf directory {shown}"),
            &format!("{shown} is owned by uid 65534"),
            "not by root",
            &format!("chown root {shown}"),
        ],
    );
    assert_eq!(entries(&dir), Vec::<PathBuf>::new(), "pinned into it anyway");
}

#[test]
fn a_bpf_dir_anyone_can_write_to_is_refused_and_nothing_is_pinned_in_it() {
    require_root();
    let scratch = BpfScratch::new();
    let dir = mkdir(&scratch.0.join("state"));
    chmod(&dir, 0o777);
    let demo = Demo::start(&[]);
    let stderr = refused(&demo, &["--bpf-dir", arg(&dir), "--socket", arg(&test_socket())]);
    let shown = dir.display().to_string();
    assert_says(
        &stderr,
        &[&format!("{shown} (mode 0777) is writable by its group or by anyone"), &format!("chmod 700 {shown}")],
    );
    assert_eq!(entries(&dir), Vec::<PathBuf>::new(), "pinned into it anyway");
}

#[test]
fn a_bpf_dir_that_is_a_symlink_is_refused_even_to_a_root_only_directory() {
    require_root();
    let scratch = BpfScratch::new();
    let real = mkdir(&scratch.0.join("real"));
    chmod(&real, 0o700);
    let link = scratch.0.join("link");
    symlink(&real, &link);
    let demo = Demo::start(&[]);
    let stderr = refused(&demo, &["--bpf-dir", arg(&link), "--socket", arg(&test_socket())]);
    assert_says(&stderr, &[&format!("{} is a symbolic link (to {})", link.display(), real.display())]);
    assert_eq!(entries(&real), Vec::<PathBuf>::new(), "pinned behind the link anyway");
}

#[test]
fn a_bpf_dir_below_a_symlink_is_refused_naming_the_link() {
    require_root();
    let scratch = BpfScratch::new();
    let real = mkdir(&scratch.0.join("real"));
    let link = scratch.0.join("link");
    symlink(&real, &link);
    let demo = Demo::start(&[]);
    let stderr = refused(&demo, &["--bpf-dir", arg(&link.join("state")), "--socket", arg(&test_socket())]);
    assert_says(&stderr, &[&format!("{} is a symbolic link", link.display()), "without symlinks"]);
    assert_eq!(entries(&real), Vec::<PathBuf>::new(), "created behind the link anyway");
}

/// `--socket DIR/agent.sock` with `dir` set up by `spoil`: refused before
/// anything is pinned (its `--bpf-dir` is never made) and nothing is bound.
fn socket_dir_refused(spoil: impl FnOnce(&Path) -> PathBuf, needles: impl FnOnce(&Path) -> Vec<String>) {
    require_root();
    let tmp = tempfile::tempdir().expect("temp dir");
    let scratch = BpfScratch::new();
    let dir = spoil(tmp.path());
    let bpf_dir = scratch.0.join("state");
    let demo = Demo::start(&[]);
    let stderr = refused(&demo, &["--bpf-dir", arg(&bpf_dir), "--socket", arg(&dir.join("agent.sock"))]);
    let needles = needles(&dir);
    assert_says(&stderr, &needles.iter().map(String::as_str).collect::<Vec<_>>());
    assert_says(&stderr, &[&format!("the query socket's directory {}", dir.display())]);
    let real = std::fs::canonicalize(&dir).expect("the directory");
    assert_eq!(entries(&real), Vec::<PathBuf>::new(), "a socket bound there anyway");
    assert!(!bpf_dir.exists(), "the bpf directory was made before the socket's was refused");
}

#[test]
fn a_socket_directory_another_user_owns_is_refused() {
    socket_dir_refused(
        |tmp| {
            let dir = mkdir(&tmp.join("run"));
            chown_nobody(&dir);
            dir
        },
        |dir| vec![format!("{} is owned by uid 65534", dir.display())],
    );
}

#[test]
fn a_socket_directory_anyone_can_write_to_is_refused_sticky_or_not() {
    for mode in [0o777, 0o1777] {
        socket_dir_refused(
            |tmp| {
                let dir = mkdir(&tmp.join("run"));
                chmod(&dir, mode);
                dir
            },
            |dir| vec![format!("{} (mode {mode:04o}) is writable by its group or by anyone", dir.display())],
        );
    }
}

#[test]
fn a_socket_directory_reached_through_a_symlink_is_refused() {
    socket_dir_refused(
        |tmp| {
            let real = mkdir(&tmp.join("real"));
            chmod(&real, 0o700);
            let link = tmp.join("link");
            symlink(&real, &link);
            link
        },
        |link| vec![format!("{} is a symbolic link", link.display())],
    );
}

#[test]
fn what_the_agent_creates_is_root_only() {
    require_root();
    let scratch = BpfScratch::new();
    let tmp = tempfile::tempdir().expect("temp dir");
    let bpf_dir = scratch.0.join("fresh/state");
    let socket = tmp.path().join("run/stallwatch/agent.sock");
    let demo = Demo::start(&[]);
    let agent = Agent::watch(demo.proc.pid(), "demo", "2s", &["--bpf-dir", arg(&bpf_dir), "--socket", arg(&socket)]);
    let layout: Vec<PathBuf> = entries(&bpf_dir);
    assert_eq!(layout.len(), 1, "one layout directory: {layout:?}");
    let layout = &layout[0];
    let made = [
        scratch.0.join("fresh"),
        bpf_dir.clone(),
        layout.clone(),
        layout.join("maps"),
        layout.join("links"),
        tmp.path().join("run"),
        tmp.path().join("run/stallwatch"),
    ];
    for dir in &made {
        let meta = std::fs::symlink_metadata(dir).unwrap_or_else(|err| panic!("{}: {err}", dir.display()));
        assert!(meta.is_dir(), "{}", dir.display());
        assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o700), "owner and mode of {}", dir.display());
    }
    let meta = std::fs::symlink_metadata(&socket).expect("the socket");
    assert!(meta.file_type().is_socket());
    assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o600));
    assert!(!entries(&layout.join("maps")).is_empty(), "its maps are pinned");
    drop(agent.stop());
}

#[test]
fn inflight_does_not_ask_a_socket_in_a_directory_another_user_owns() {
    require_root();
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = mkdir(&tmp.path().join("run"));
    let socket = dir.join("agent.sock");
    // What another user could leave there: a socket that answers anything.
    let listener = UnixListener::bind(&socket).expect("bind");
    listener.set_nonblocking(true).expect("non-blocking");
    chown_nobody(&dir);
    chown_nobody(&socket);
    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(["inflight", "--socket", arg(&socket)]));
    assert!(!ok, "{stdout}");
    assert_says(
        &stderr,
        &[&format!("not asking {}", socket.display()), &format!("{} is owned by uid 65534", dir.display())],
    );
    assert!(listener.accept().is_err(), "it connected to the socket");
}

#[test]
fn state_clear_refuses_a_directory_another_user_owns_and_leaves_it() {
    require_root();
    let scratch = BpfScratch::new();
    let dir = mkdir(&scratch.0.join("state"));
    let kept = mkdir(&dir.join("v1"));
    chown_nobody(&dir);
    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(["state", "clear", "--bpf-dir", arg(&dir)]));
    assert!(!ok, "{stdout}");
    assert_says(&stderr, &[&format!("the bpf directory {}", dir.display()), "is owned by uid 65534"]);
    assert!(kept.exists(), "removed anyway");
}

#[test]
fn doctor_says_why_a_directory_run_would_refuse() {
    require_root();
    let tmp = tempfile::tempdir().expect("temp dir");
    let shared = mkdir(&tmp.path().join("shared"));
    chmod(&shared, 0o777);
    let fresh = tmp.path().join("fresh/state");
    let doctor = |bpf_dir: &Path, socket: &Path| -> Value {
        let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args([
            "doctor",
            "--json",
            "--bpf-dir",
            arg(bpf_dir),
            "--socket",
            arg(socket),
        ]));
        assert!(ok, "neither check is required:\n{stdout}\n{stderr}");
        serde_json::from_str(&stdout).unwrap_or_else(|err| panic!("{err}: {stdout}"))
    };
    let check = |report: &Value, name: &str| -> Value {
        report["checks"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["name"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("no {name}: {report:#}"))
    };
    let report = doctor(&shared, &shared.join("sub/agent.sock"));
    for name in ["bpf_dir", "socket_dir"] {
        let c = check(&report, name);
        assert_eq!((&c["status"], &c["required"]), (&Value::from("missing"), &Value::from(false)), "{c:#}");
        let detail = c["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(&format!("{} (mode 0777) is writable", shared.display())), "{c:#}");
        assert!(
            c["fix"]
                .as_str()
                .is_some_and(|f| f.contains(&format!("chmod 700 {}", shared.display())) || f.contains("chmod go-w")),
            "{c:#}"
        );
    }
    let report = doctor(&fresh, &fresh.join("agent.sock"));
    for name in ["bpf_dir", "socket_dir"] {
        assert_eq!(check(&report, name)["status"], "ok", "{report:#}");
    }
    assert!(!fresh.exists(), "doctor created it");
}
