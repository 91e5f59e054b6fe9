//! What a watched process or another local user can do: nothing the agent
//! prints can be forged by the target (a line, a field, a terminal
//! sequence), and nobody but root can prepare or replace the directories
//! the agent keeps its state and its socket in.
use std::{ffi::OsStr, os::unix::ffi::OsStrExt as _, process::Command, time::Duration};

use stallwatch_tests::{Proc, agent_bin, demo_bin, require_root, run_to_end, test_socket};

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
    assert!(rows[3].contains(&format!("({EXE_SHOWN})")), "{table}");

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
