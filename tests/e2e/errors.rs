//! Bad input gets a clear error naming the thing and the fix, and a
//! non-zero exit; never a panic or a silent no-op.
use std::{io::Write as _, process::Command};

use stallwatch_tests::{Demo, agent_bin, require_root, run_to_end};

/// Run the agent to its end and return its stderr, asserting it failed
/// without panicking.
fn fails(args: &[&str]) -> String {
    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(args));
    assert!(!ok, "expected failure of {args:?}; stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn profile_file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new().suffix(".toml").tempfile().expect("temp profile");
    file.write_all(text.as_bytes()).expect("writing the temp profile");
    file
}

fn watch_with(profile: &str) -> String {
    require_root();
    let demo = Demo::start(&["--duration", "20s"]);
    let file = profile_file(profile);
    let path = file.path().to_str().expect("utf-8 temp path");
    let stderr = fails(&["run", "--pid", &demo.proc.pid().to_string(), "--profile", path, "--timeout", "1s"]);
    drop(demo);
    stderr
}

#[test]
fn a_pid_that_does_not_exist_is_named() {
    // Above any pid_max, so never a live process.
    let stderr = fails(&["run", "--pid", "4194305", "--profile", "demo"]);
    assert!(stderr.contains("no process with pid 4194305"), "{stderr}");
}

#[test]
fn an_unknown_profile_lists_the_built_ins() {
    let stderr = fails(&["run", "--pid", "1", "--profile", "no-such-profile"]);
    assert!(stderr.contains("no built-in profile named `no-such-profile`"), "{stderr}");
    assert!(stderr.contains("demo"), "{stderr}");
}

#[test]
fn malformed_toml_names_file_and_line() {
    let file = profile_file("name = \"x\"\n\n[[probe]]\nsymbol = \"f\"\nat = \"entry\nevent = \"enqueued\"\n");
    let path = file.path().to_str().expect("utf-8 temp path");
    let stderr = fails(&["profile", "check", path]);
    assert!(stderr.contains(path), "{stderr}");
    assert!(stderr.contains("line 5"), "{stderr}");
}

#[test]
fn an_unknown_event_names_the_probe_line_and_the_valid_events() {
    let file = profile_file("[[probe]]\nsymbol = \"a\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n\n[[probe]]\nsymbol = \"b\"\nat = \"entry\"\nevent = \"posted\"\nkey = { from = \"arg0\" }\n");
    let path = file.path().to_str().expect("utf-8 temp path");
    let stderr = fails(&["profile", "check", path]);
    assert!(stderr.contains("line 7"), "{stderr}");
    assert!(stderr.contains("unknown lifecycle event \"posted\""), "{stderr}");
    assert!(stderr.contains("\"transfer_posted\""), "{stderr}");
}

#[test]
fn a_missing_symbol_is_named_with_suggestions() {
    let stderr = watch_with("[[probe]]\nsymbol = \"prefill_enqueu\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n");
    assert!(stderr.contains("symbol `prefill_enqueu` not found"), "{stderr}");
    assert!(stderr.contains("did you mean: prefill_enqueue"), "{stderr}");
    assert!(stderr.contains("line 1"), "{stderr}");
}

#[test]
fn a_library_the_process_has_not_mapped_is_named() {
    let stderr = watch_with("[[probe]]\nobject = \"libnixl.so\"\nsymbol = \"x\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n");
    assert!(stderr.contains("has no file `libnixl.so` mapped"), "{stderr}");
    assert!(stderr.contains("libc.so"), "lists what is mapped: {stderr}");
}
