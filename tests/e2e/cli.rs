//! Operability of the command line itself: `--version`, the log filter and
//! format, flags from the environment, `config check` resolving the
//! environment as `run` does, shell completions and man pages.
use std::{process::Command, time::Duration};

use serde_json::Value;
use stallwatch_tests::{Demo, Proc, agent_bin, require_root, run_to_end, test_bpf_dir, test_socket};

/// The agent with none of the test's own STALLWATCH_*/OTEL_* flag variables.
fn agent() -> Command {
    let mut command = Command::new(agent_bin());
    for (name, _) in std::env::vars() {
        if name.starts_with("OTEL_")
            || (name.starts_with("STALLWATCH_") && !["STALLWATCH_BIN"].contains(&name.as_str()))
        {
            command.env_remove(name);
        }
    }
    command
}

#[test]
fn version_says_which_build() {
    let (ok, stdout, stderr) = run_to_end(agent().arg("--version"));
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("stallwatch 0."), "{stdout}");
    let field = |name: &str| {
        lines.iter().find_map(|l| l.strip_prefix(&format!("{name}: "))).unwrap_or_else(|| panic!("no {name}: {stdout}"))
    };
    let commit = field("commit");
    assert!(
        commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit()),
        "a git commit (built from a checkout): {stdout}"
    );
    assert!(["true", "false"].contains(&field("dirty")), "{stdout}");
    assert!(field("rustc").starts_with("1."), "{stdout}");
    assert!(field("target").starts_with("x86_64-"), "{stdout}");
    // -V stays the one-line version.
    let (_, short, _) = run_to_end(agent().arg("-V"));
    assert_eq!(short.trim(), lines[0]);
}

#[test]
fn a_log_filter_that_does_not_parse_is_an_error_not_silence() {
    // `json` once muted every line: tracing takes a bare word as a target.
    let (ok, _, stderr) = run_to_end(agent().args(["profile", "list"]).env("STALLWATCH_LOG", "json"));
    assert!(!ok, "STALLWATCH_LOG=json was taken");
    assert!(stderr.contains("`json` is not a log level") && stderr.contains("STALLWATCH_LOG_FORMAT=json"), "{stderr}");
    let (ok, _, stderr) = run_to_end(agent().args(["--log", "stallwatch=loud", "profile", "list"]));
    assert!(!ok && stderr.contains("is not a log filter"), "{stderr}");
    let (ok, _, stderr) = run_to_end(agent().args(["profile", "list"]).env("STALLWATCH_LOG_FORMAT", "yaml"));
    assert!(!ok && stderr.contains("invalid value 'yaml'") && stderr.contains("json"), "{stderr}");
    let (ok, stdout, stderr) =
        run_to_end(agent().args(["profile", "list"]).env("STALLWATCH_LOG", "warn,stallwatch=debug"));
    assert!(ok && stdout.contains("nixl"), "{stderr}");
}

#[test]
fn config_check_refuses_what_run_refuses_from_the_environment() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "profile = \"demo\"\npid = 1\n").expect("config");
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")];
    let (ok, _, check) = run_to_end(agent().args(["config", "check"]).arg(&config).envs(env));
    assert!(!ok, "config check passed a protocol run refuses");
    assert!(check.contains("OTEL_EXPORTER_OTLP_PROTOCOL=http/json is not supported"), "{check}");
    // `run` refuses it the same way, before it loads anything.
    let (ok, _, run) = run_to_end(agent().args(["run", "--config"]).arg(&config).envs(env));
    assert!(!ok && run.contains("OTEL_EXPORTER_OTLP_PROTOCOL=http/json is not supported"), "{run}");

    // What the environment sets is what check shows: the endpoint from
    // OTEL_*, the timeout and the file itself from STALLWATCH_*.
    let (ok, stdout, stderr) = run_to_end(
        agent()
            .args(["config", "check"])
            .env("STALLWATCH_CONFIG", &config)
            .env("STALLWATCH_TIMEOUT", "5s")
            .env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/in"),
    );
    assert!(ok, "{stderr}");
    assert!(stdout.contains(&format!("config file {}: ok", config.display())), "{stdout}");
    assert!(stdout.contains("timeout      5s (from STALLWATCH_TIMEOUT)\n"), "the variable over the default: {stdout}");
    assert!(stdout.contains("watch        1 (from the config file)\n"), "{stdout}");
    assert!(stdout.contains("tick         10ms (default)\n"), "{stdout}");
    assert!(
        stdout.contains("http://collector:4318/in (http/protobuf, from OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)"),
        "{stdout}"
    );
    // A flag wins over its variable.
    let (_, stdout, _) =
        run_to_end(agent().args(["config", "check", "--timeout", "7s"]).arg(&config).env("STALLWATCH_TIMEOUT", "5s"));
    assert!(stdout.contains("timeout      7s (from --timeout)\n"), "{stdout}");
    // The file's [otlp] endpoint wins over OTEL_EXPORTER_OTLP_ENDPOINT only
    // when it is there, and check says which one is used.
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://from-env:4318")];
    let (_, stdout, _) = run_to_end(agent().args(["config", "check"]).arg(&config).envs(env));
    assert!(
        stdout.contains("http://from-env:4318/v1/traces (http/protobuf, from OTEL_EXPORTER_OTLP_ENDPOINT)"),
        "{stdout}"
    );
    let with_endpoint = dir.path().join("with-endpoint.toml");
    std::fs::write(&with_endpoint, "profile = \"demo\"\npid = 1\n[otlp]\nendpoint = \"http://from-file:4318\"\n")
        .expect("config");
    let (_, stdout, _) = run_to_end(agent().args(["config", "check"]).arg(&with_endpoint).envs(env));
    assert!(stdout.contains("http://from-file:4318/v1/traces (http/protobuf, from the config file)"), "{stdout}");
    // A bad value in a variable names the variable.
    let (ok, _, stderr) = run_to_end(agent().args(["config", "check"]).arg(&config).env("STALLWATCH_TIMEOUT", "soon"));
    assert!(!ok && stderr.contains("--timeout") && stderr.contains("is not a duration"), "{stderr}");
}

#[test]
fn run_takes_every_setting_from_the_environment_and_logs_json() {
    require_root();
    let mut demo = Demo::start(&["--duration", "2s"]);
    let bpf_dir = test_bpf_dir();
    let mut command = agent();
    command
        .arg("run")
        .env("STALLWATCH_PID", demo.proc.pid().to_string())
        .env("STALLWATCH_PROFILE", "demo")
        .env("STALLWATCH_TIMEOUT", "1s")
        .env("STALLWATCH_OUTPUT", "json")
        .env("STALLWATCH_SOCKET", test_socket())
        .env("STALLWATCH_BPF_DIR", &bpf_dir)
        .env("STALLWATCH_LOG_FORMAT", "json")
        .env("STALLWATCH_LOG", "info");
    let mut agent = Proc::spawn("stallwatch", &mut command);
    agent.wait_stderr("watching", Duration::from_secs(30));
    demo.go();
    let lines = agent.lines_until_exit(Duration::from_secs(30));
    let status = agent.wait(Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&bpf_dir);
    assert!(status.success(), "{status}: {}", agent.stderr());
    assert!(
        lines.iter().any(|l| l.json().is_some_and(|v| v["alert"] == "summary")),
        "JSON alerts from STALLWATCH_OUTPUT"
    );
    // Every log line is one JSON object with the fields at the top level.
    let stderr = agent.stderr();
    let logs: Vec<Value> = stderr
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|err| panic!("a log line that is not JSON ({err}): {l}\n{stderr}"))
        })
        .collect();
    assert!(
        logs.iter().all(|l| l["timestamp"].is_string() && l["level"].is_string() && l["target"].is_string()),
        "{stderr}"
    );
    let watching =
        logs.iter().find(|l| l["message"] == "watching").unwrap_or_else(|| panic!("no `watching` line: {stderr}"));
    assert_eq!(watching["pid"], demo.proc.pid(), "{watching}");
    assert_eq!(watching["level"], "INFO");
}

#[test]
fn bash_completion_completes_commands_and_flags() {
    let (ok, script, stderr) = run_to_end(agent().args(["completions", "bash"]));
    assert!(ok, "{stderr}");
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("stallwatch.bash");
    std::fs::write(&file, script).expect("script");
    // Complete `stallwatch ru` and `stallwatch run --max-` as bash would.
    let complete = |words: &str, cword: usize| {
        let program = format!(
            "source {}; COMP_WORDS=({words}); COMP_CWORD={cword}; COMP_LINE=\"{words}\"; COMP_POINT=${{#COMP_LINE}}; \
             _stallwatch stallwatch \"${{COMP_WORDS[$COMP_CWORD]}}\" \"${{COMP_WORDS[$COMP_CWORD-1]}}\"; echo \"${{COMPREPLY[@]}}\"",
            file.display()
        );
        let (ok, out, err) = run_to_end(Command::new("bash").args(["-c", &program]));
        assert!(ok, "{err}");
        out
    };
    assert_eq!(complete("stallwatch ru", 1).trim(), "run");
    assert!(complete("stallwatch run --max-", 2).contains("--max-tracked"));
    for shell in ["zsh", "fish"] {
        let (ok, script, _) = run_to_end(agent().args(["completions", shell]));
        assert!(ok && script.contains("max-tracked"), "{shell}");
    }
    // A closed pipe ends it quietly, not with a panic.
    let (ok, _, stderr) = run_to_end(Command::new("bash").args([
        "-c",
        &format!("{} completions bash | head -1 >/dev/null; exit ${{PIPESTATUS[0]}}", agent_bin().display()),
    ]));
    assert!(ok && !stderr.contains("panicked"), "{stderr}");
}

#[test]
fn man_pages_document_every_command_flag_and_variable() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (ok, _, stderr) = run_to_end(agent().args(["man", "--dir"]).arg(dir.path()));
    assert!(ok, "{stderr}");
    for page in ["stallwatch.1", "stallwatch-run.1", "stallwatch-inflight.1", "stallwatch-config-check.1"] {
        assert!(dir.path().join(page).exists(), "no {page}");
    }
    // groff renders it, with the flags and their variables.
    let (ok, text, stderr) =
        run_to_end(Command::new("groff").args(["-man", "-Tutf8", "-P-cbou"]).arg(dir.path().join("stallwatch-run.1")));
    assert!(ok, "{stderr}");
    let text = text.replace(['\u{2010}', '\u{2212}'], "-");
    for needle in ["--max-tracked", "STALLWATCH_MAX_TRACKED", "--metrics-addr", "STALLWATCH_LOG_FORMAT"] {
        assert!(text.contains(needle), "stallwatch-run(1) lacks {needle}:\n{text}");
    }
    let (ok, page, _) = run_to_end(agent().arg("man"));
    assert!(ok && page.contains(".TH stallwatch 1"), "{page}");
}
