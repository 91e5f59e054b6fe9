use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Result;
use clap::Args as _;

use super::{
    values::{parse_count, parse_duration, parse_pid},
    *,
};
use crate::{
    export::{alert::Format, otlp::Protocol},
    kernel::state,
    query,
    run::{OnExit, Target, discovery::Selector, rules},
};

fn parse(text: &str) -> Result<RunSettings> {
    ConfigFile::parse(text, Path::new("/etc/stallwatch/config.toml")).map(|file| file.settings)
}

fn error(text: &str) -> String {
    format!("{:#}", parse(text).expect_err(text))
}

const FULL: &str = r#"
pid = 4242
profile = "nixl"
timeout = "90s"
tick = "5ms"
max_tracked = 500000
output = "json"
socket = "/run/sw/agent.sock"
bpf_dir = "/sys/fs/bpf/sw"
on_exit = "detach"
trust_fuse = true

[otlp]
endpoint = "http://collector:4317"
protocol = "grpc"

[metrics]
addr = "0.0.0.0:9464"
"#;

#[test]
fn every_setting_parses() {
    let settings = parse(FULL).expect("valid");
    assert_eq!(
        settings,
        RunSettings {
            pid: Some(4242),
            exe: None,
            lib: None,
            cmdline: None,
            cgroup: None,
            profile: Some("nixl".to_owned()),
            rules: Vec::new(),
            builtin_rules: None,
            timeout: Some(Duration::from_secs(90)),
            tick: Some(Duration::from_millis(5)),
            max_tracked: Some(500_000),
            output: Some(Format::Json),
            otlp_endpoint: Some("http://collector:4317".to_owned()),
            otlp_protocol: Some(Protocol::Grpc),
            metrics_addr: Some("0.0.0.0:9464".parse().expect("addr")),
            kubernetes: None,
            kubernetes_service_account: None,
            socket: Some(PathBuf::from("/run/sw/agent.sock")),
            bpf_dir: Some(PathBuf::from("/sys/fs/bpf/sw")),
            ephemeral: false,
            on_exit: Some(OnExit::Detach),
            trust_fuse: true,
        }
    );
}

#[test]
fn state_settings_default_to_pinning_and_refuse_both() {
    let base = RunSettings { pid: Some(1), profile: Some("demo".into()), ..RunSettings::default() };
    let config = base.clone().finish().expect("complete");
    assert_eq!(config.bpf_dir.as_deref(), Some(Path::new(state::DEFAULT_BPF_DIR)));
    assert_eq!(config.on_exit, OnExit::Keep);
    let ephemeral = RunSettings { ephemeral: true, ..base.clone() }.finish().expect("complete");
    assert_eq!(ephemeral.bpf_dir, None);
    // The file says ephemeral, a flag names a directory: refused, not guessed.
    let file = RunSettings { ephemeral: true, ..RunSettings::default() };
    let flags = RunSettings { bpf_dir: Some("/sys/fs/bpf/x".into()), ..base };
    let err = flags.over(file).finish().expect_err("both");
    assert!(err.to_string().contains("--ephemeral"), "{err}");
    let err = parse("bpf_dir = \"/sys/fs/bpf/x\"\nephemeral = true\n").expect_err("both");
    assert!(err.to_string().contains("ephemeral = true"), "{err:#}");
    let err = parse("on_exit = \"stay\"\n").expect_err("bad choice");
    assert!(err.to_string().contains("\"keep\", \"detach\""), "{err:#}");
}

#[test]
fn an_empty_file_is_all_defaults() {
    assert_eq!(parse("").expect("valid"), RunSettings::default());
    let config = RunSettings { pid: Some(1), profile: Some("demo".into()), ..RunSettings::default() }
        .finish()
        .expect("complete");
    assert_eq!(config.timeout, DEFAULT_TIMEOUT);
    assert_eq!(config.tick, DEFAULT_TICK);
    assert_eq!(config.max_tracked, DEFAULT_MAX_TRACKED);
    assert_eq!(config.output, DEFAULT_OUTPUT);
    assert!(config.telemetry.otlp.endpoint.is_none() && config.telemetry.metrics_addr.is_none());
    assert_eq!(config.socket, Path::new(query::DEFAULT_SOCKET));
}

#[test]
fn flags_override_the_file() {
    let file = parse(FULL).expect("valid");
    let flags = RunSettings {
        pid: Some(7),
        timeout: Some(Duration::from_secs(5)),
        output: Some(Format::Human),
        socket: Some(PathBuf::from("/tmp/mine.sock")),
        ..RunSettings::default()
    };
    let config = flags.over(file).finish().expect("complete");
    assert!(matches!(config.target, Target::Pid(7)), "{:?}", config.target);
    assert_eq!(config.timeout, Duration::from_secs(5));
    assert_eq!(config.output, Format::Human);
    assert_eq!(config.socket, Path::new("/tmp/mine.sock"));
    // What the flags leave unset comes from the file.
    assert_eq!(config.rules.own, [RuleSetting::given(Selector::any(), "nixl")]);
    assert!(!config.rules.builtin);
    assert_eq!(config.tick, Duration::from_millis(5));
    assert_eq!(config.max_tracked, 500_000);
    assert_eq!(config.telemetry.otlp.protocol, Some(Protocol::Grpc));
    assert_eq!(config.telemetry.metrics_addr, Some("0.0.0.0:9464".parse().expect("addr")));
}

#[test]
fn a_select_table_watches_every_matching_process() {
    let settings = parse("profile = \"nixl\"\n[select]\nlib = \"libnixl.so\"\ncmdline = \"sglang\"\n").expect("valid");
    assert_eq!(settings.lib.as_deref(), Some("libnixl.so"));
    let config = settings.finish().expect("complete");
    assert_eq!(config.target, Target::Discover);
    assert_eq!(config.rules.own[0].selector.describe(), "lib=libnixl.so cmdline=/sglang/");
    let err = error("profile = \"nixl\"\n\n[select]\ncmdline = \"(\"\n");
    assert!(err.contains("line 4") && err.contains("not a valid regular expression"), "{err}");
    let both = RunSettings { pid: Some(1), exe: Some("x".into()), profile: Some("demo".into()), ..Default::default() };
    assert!(format!("{:#}", both.finish().expect_err("both")).contains("not both"));
    // A --pid flag replaces the file's [select]: on call, one process.
    let file = parse("profile = \"nixl\"\n[select]\nlib = \"libnixl.so\"\n").expect("valid");
    let config = RunSettings { pid: Some(9), ..Default::default() }.over(file).finish().expect("complete");
    assert!(matches!(config.target, Target::Pid(9)), "{:?}", config.target);
}

#[test]
fn a_profile_needs_its_processes_and_a_selector_its_profile() {
    let err = format!(
        "{:#}",
        RunSettings { profile: Some("demo".into()), ..Default::default() }.finish().expect_err("no pid")
    );
    assert!(err.contains("pass --pid PID or a selector") && err.contains("leave the profile out"), "{err}");
    let lib = RunSettings { lib: Some("libnixl.so".into()), ..Default::default() };
    let err = format!("{:#}", lib.finish().expect_err("no profile"));
    assert!(err.contains("pass --profile"), "{err}");
}

#[test]
fn with_no_profile_every_process_is_watched_by_the_files_rules_then_the_builtin_ones() {
    let config = RunSettings::default().finish().expect("the built-in rules");
    assert_eq!(config.target, Target::Discover);
    assert!(config.rules.own.is_empty() && config.rules.builtin);
    let loaded = config.rules.load().expect("the built-in profiles load");
    assert_eq!(loaded.len(), rules::BUILTIN.len());
    // A pid alone: the rules choose its profile.
    let pid = RunSettings { pid: Some(1), ..Default::default() }.finish().expect("a pid");
    assert!(pid.rules.builtin && pid.target == Target::Pid(1));

    let file = parse(
        "builtin_rules = false\n\n[[rule]]\nprofile = \"sglang\"\nlib = \"libnixl.so\"\ncmdline = \"^sglang::\"\n\n\
         [[rule]]\nprofile = \"vllm\"\ncgroup = \"pod-1\"\n\n[[rule]]\nprofile = \"nixl\"\nimage = \"^nvcr.io/\"\n",
    )
    .expect("valid");
    let config = file.clone().finish().expect("the file's rules");
    assert!(!config.rules.builtin);
    let own: Vec<(String, String, String)> = config
        .rules
        .own
        .iter()
        .map(|rule| (rule.selector.describe(), rule.profile.clone(), rule.origin.clone()))
        .collect();
    assert_eq!(
        own,
        [
            (
                "lib=libnixl.so cmdline=/^sglang::/".into(),
                "sglang".into(),
                "config file /etc/stallwatch/config.toml, line 3".into()
            ),
            ("cgroup=pod-1".into(), "vllm".into(), "config file /etc/stallwatch/config.toml, line 8".into()),
            ("image=/^nvcr.io//".into(), "nixl".into(), "config file /etc/stallwatch/config.toml, line 12".into()),
        ]
    );
    // A --profile on call replaces the file's rules.
    let flags = RunSettings { pid: Some(5), profile: Some("nixl".into()), ..Default::default() };
    let config = flags.over(file).finish().expect("one profile");
    assert_eq!(config.rules.own, [RuleSetting::given(Selector::any(), "nixl")]);

    let err = error("[[rule]]\nprofile = \"nixl\"\n");
    assert!(err.contains("line 1") && err.contains("selects nothing"), "{err}");
    let err = error("profile = \"nixl\"\n[[rule]]\nprofile = \"nixl\"\nlib = \"x\"\n");
    assert!(err.contains("line 2") && err.contains("not both"), "{err}");
    let err = error("[[rule]]\nprofile = \"nixl\"\ncmdline = \"(\"\n");
    assert!(err.contains("line 1") && err.contains("not a valid regular expression"), "{err}");
    let err = error("[[rule]]\nprofile = \"nixl\"\nlib = \"x\"\nimage = \"(\"\n");
    assert!(err.contains("line 1") && err.contains("image `(` is not a valid regular expression"), "{err}");
    let err = error("[[rule]]\nprofile = \"nixl\"\nlibrary = \"x\"\n");
    assert!(err.contains("unknown field `library`"), "{err}");
    let none = parse("builtin_rules = false\n").expect("valid").finish().expect_err("no rules");
    assert!(format!("{none:#}").contains("no rules"), "{none:#}");
}

#[test]
fn unknown_keys_name_file_line_and_the_valid_keys() {
    let err = error("profile = \"demo\"\n\ntimeot = \"5s\"\n");
    assert!(err.starts_with("config file /etc/stallwatch/config.toml, line 3:"), "{err}");
    assert!(err.contains("unknown field `timeot`"), "{err}");
    assert!(err.contains("`timeout`"), "lists the valid keys: {err}");
    let err = error("[otlp]\nendpoint = \"http://c:4318\"\nheaders = \"x\"\n");
    assert!(err.contains("line 3") && err.contains("unknown field `headers`"), "{err}");
    let err = error("[query]\nsocket = \"/run/x\"\n");
    assert!(err.contains("line 1") && err.contains("unknown field `query`"), "{err}");
    let err = error("[metrics]\nsocket = \"/run/x\"\n");
    assert!(err.contains("line 2") && err.contains("unknown field `socket`, expected `addr`"), "{err}");
}

#[test]
fn bad_values_name_the_line_and_the_fix() {
    let err = error("pid = 1\ntimeout = 60\n");
    assert!(err.contains("line 2") && err.contains("e.g. \"60s\""), "{err}");
    let err = error("timeout = \"5 parsecs\"\n");
    assert!(err.contains("line 1") && err.contains("is not a duration"), "{err}");
    let err = error("\npid = 0\n");
    assert!(err.contains("line 2") && err.contains("pid 0 is not a process id"), "{err}");
    let err = error("pid = \"4242\"\n");
    assert!(err.contains("line 1") && err.contains("invalid type: string"), "{err}");
    // The flag and the file refuse the same values.
    for bad in ["0", "-1", "x"] {
        assert!(parse_count(bad).is_err_and(|err| err.contains("not a positive count")), "{bad}");
    }
    assert_eq!(parse_count("5"), Ok(5));
    // "As many as you can": taken, and capped by the engine.
    assert_eq!(parse_count("18446744073709551615"), Ok(usize::MAX));
    assert_eq!(parse_count("99999999999999999999999"), Ok(usize::MAX));
    let err = error("max_tracked = 0\n");
    assert!(err.contains("not a positive count"), "{err}");
    let err = error("max_tracked = -1\n");
    assert!(err.contains("line 1") && err.contains("not a positive count"), "{err}");
    let err = error("output = \"yaml\"\n");
    assert!(err.contains("\"yaml\" is not one of \"human\", \"json\""), "{err}");
    let err = error("[otlp]\nprotocol = \"http/json\"\n");
    assert!(err.contains("line 2") && err.contains("\"grpc\", \"http\""), "{err}");
    let err = error("[metrics]\naddr = \"everywhere\"\n");
    assert!(err.contains("line 2") && err.contains("is not PORT, :PORT or ADDRESS:PORT"), "{err}");
    let err = error("profile = \"demo\"\ntimeout = \"1ms\"\ntick = \"10ms\"\n");
    assert!(err.contains("line 2") && err.contains("shorter than tick 10ms"), "{err}");
    let err = error("timeout = \"1ms\"\n");
    assert!(err.contains("shorter than the default tick"), "{err}");
    let err = error("[otlp]\n\nendpoint = \"collector:4318\"\n");
    assert!(err.contains("line 3") && err.contains("give the scheme, e.g. `http://collector:4318`"), "{err}");
    let err = error("pid = 1\npid = 2\n");
    assert!(err.contains("line 2") && err.contains("duplicate key"), "{err}");
    let err = error("profile = \"demo\n");
    assert!(err.contains("line 1"), "{err}");
}

#[test]
fn zero_and_endless_durations_are_refused_where_they_are_given() {
    let err = error("profile = \"demo\"\ntick = \"0s\"\n");
    assert!(err.contains("line 2: tick: a zero duration would stop the timers"), "{err}");
    let err = error("timeout = \"0ms\"\n");
    assert!(err.contains("line 1: timeout: a zero duration"), "{err}");
    let err = error("\ntimeout = \"1000years\"\n");
    assert!(err.contains("line 2: timeout: ") && err.contains("longer than the longest taken"), "{err}");
    assert!(parse_duration("0s").expect_err("zero").contains("a zero duration"));
    assert_eq!(parse_duration("10ms"), Ok(Duration::from_millis(10)));
    assert!(parse_duration("soon").expect_err("no unit").contains("is not a duration"));
}

#[test]
fn pids_are_positive_process_ids() {
    assert_eq!(parse_pid("42"), Ok(42));
    assert!(parse_pid("0").expect_err("zero").contains("pid 0 is not a process id"));
    assert!(parse_pid("-5").expect_err("negative").contains("pid -5 is not a process id"));
    assert!(parse_pid("4294967296").expect_err("too big").contains("is not a process id"));
    assert!(parse_pid("me").expect_err("text").contains("\"me\" is not a process id"));
}

#[test]
fn the_metrics_port_alone_is_localhost() {
    let settings = parse("[metrics]\naddr = 9464\n").expect("valid");
    assert_eq!(settings.metrics_addr, Some("127.0.0.1:9464".parse().expect("addr")));
    let settings = parse("[metrics]\naddr = \":9464\"\n").expect("valid");
    assert_eq!(settings.metrics_addr, Some("0.0.0.0:9464".parse().expect("addr")), "`:PORT` is every interface");
}

#[test]
fn relative_paths_are_beside_the_config_file() {
    assert_eq!(
        parse("profile = \"custom.toml\"").expect("valid").profile.as_deref(),
        Some("/etc/stallwatch/custom.toml")
    );
    assert_eq!(parse("profile = \"/opt/p.toml\"").expect("valid").profile.as_deref(), Some("/opt/p.toml"));
    assert_eq!(parse("profile = \"nixl\"").expect("valid").profile.as_deref(), Some("nixl"));
    let bare = ConfigFile::parse("profile = \"p.toml\"", Path::new("config.toml")).expect("valid");
    assert_eq!(bare.settings.profile.as_deref(), Some("p.toml"));
    assert_eq!(parse("socket = \"q.sock\"").expect("valid").socket, Some(PathBuf::from("/etc/stallwatch/q.sock")));
}

#[test]
fn check_describes_what_run_would_use() {
    let dir = std::env::temp_dir().join(format!("stallwatch-config-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("config.toml");
    std::fs::write(&path, "profile = \"demo\"\ntimeout = \"2s\"\n").expect("write");
    let out = ConfigFile::check(Some(&path), RunSettings::default(), &Origins::default()).expect("valid");
    assert!(out.contains(": ok"), "{out}");
    assert!(out.contains("watch        not set: pass --pid or a selector at run time"), "{out}");
    assert!(out.contains("built-in profile `demo`"), "{out}");
    assert!(out.contains("timeout      2s (from the config file)\n"), "{out}");
    assert!(out.contains("tick         10ms (default)"), "{out}");
    // Each value names its source: a flag over the file, the file over the default.
    std::fs::write(&path, "profile = \"demo\"\ntimeout = \"2s\"\n[otlp]\nendpoint = \"http://file:4318\"\n")
        .expect("write");
    let matches = RunSettings::augment_args(clap::Command::new("check"))
        .try_get_matches_from(["check", "--timeout", "5s", "--metrics-addr", ":9464"])
        .expect("flags parse");
    let flags = <RunSettings as clap::FromArgMatches>::from_arg_matches(&matches).expect("settings");
    let out = ConfigFile::check(Some(&path), flags, &Origins::of(&matches)).expect("valid");
    assert!(out.contains("timeout      5s (from --timeout)\n"), "{out}");
    assert!(out.contains("metrics      http://0.0.0.0:9464/metrics (from --metrics-addr)\n"), "{out}");
    assert!(out.contains("http://file:4318/v1/traces (http/protobuf, from the config file)"), "{out}");
    assert!(out.contains("profile      demo (built-in profile `demo`, 5 probes, from the config file)"), "{out}");
    // `run` names the same source in its log and errors.
    let run = resolve(Some(&path), RunSettings { pid: Some(1), ..RunSettings::default() }, &Origins::of(&matches))
        .expect("complete");
    let target = run.telemetry.otlp.resolve_with(|_| None).expect("valid").expect("set");
    assert_eq!(target.source, "[otlp] endpoint in the config file");
    std::fs::write(&path, "profile = \"missing.toml\"\n").expect("write");
    let err = format!(
        "{:#}",
        ConfigFile::check(Some(&path), RunSettings::default(), &Origins::default()).expect_err("no such profile")
    );
    assert!(err.contains("config file") && err.contains("missing.toml"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_shipped_example_config_is_valid() {
    let settings =
        ConfigFile::parse(include_str!("../../../deploy/base/config.toml"), Path::new("/etc/stallwatch/config.toml"))
            .expect("agent/deploy/base/config.toml parses")
            .settings;
    // One agent per node for every framework: no profile, no selector,
    // the built-in rules.
    let config = settings.finish().expect("the example resolves");
    assert_eq!(config.target, Target::Discover);
    assert!(config.rules.own.is_empty() && config.rules.builtin, "{:?}", config.rules);
}

#[test]
fn the_daemonset_sets_every_variable_the_otlp_resource_reads() {
    let manifest = include_str!("../../../deploy/base/daemonset.yaml");
    for (attribute, var) in crate::export::otlp::config::K8S_ENV {
        assert!(manifest.contains(&format!("name: {var}\n")), "daemonset.yaml does not set {var} (for {attribute})");
    }
}
