//! `stallwatch run --config FILE`: the run settings as a TOML file.
//!
//! The file holds what the `run` flags hold, under the same names (format in
//! docs/deploying.md). A flag given on the command line wins over the file, the
//! file wins over the built-in defaults. Unknown keys are errors, and every
//! error names the file and the line.
//!
//! Where the processes to watch come from, and with which profile: one
//! `pid`, or a `[select]` table (executable, library, command line,
//! cgroup), with one `profile`; or, with no profile, `[[rule]]` tables
//! (a selector and a profile each) before the built-in rules, so one
//! agent per node watches every framework (see [`crate::run::rules`]).
use std::{
    collections::BTreeMap,
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::{Args as _, ValueEnum, parser::ValueSource};
use serde::{Deserialize, Deserializer, de};
use toml::Spanned;

use crate::{
    export::workload,
    export::{
        alert::Format,
        metrics,
        otlp::{self, OtlpOptions, Protocol},
        telemetry::TelemetryOptions,
    },
    kernel::state,
    profile::{self, Profile, plan::Trust},
    query,
    run::{
        OnExit, Target,
        discovery::Selector,
        rules::{self, Rule},
    },
};

/// `--timeout` when neither the flag nor the file sets it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// `--tick` when neither the flag nor the file sets it.
pub const DEFAULT_TICK: Duration = Duration::from_millis(10);
/// `--max-tracked` when neither the flag nor the file sets it.
pub const DEFAULT_MAX_TRACKED: usize = 1_000_000;
/// `--output` when neither the flag nor the file sets it.
pub const DEFAULT_OUTPUT: Format = Format::Human;

/// `stallwatch run`'s settings as one source gives them (the flags, or the
/// file); `None`: that source does not say. The flags are these fields.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct RunSettings {
    /// The process to watch (the prefill server); the agent ends when it
    /// exits. Without it, every process matching the selectors below is
    /// watched, including ones started later.
    #[arg(long, value_parser = parse_pid, env = "STALLWATCH_PID")]
    pub pid: Option<u32>,
    /// Select processes by executable: a basename, or a full path.
    #[arg(long, value_name = "NAME", env = "STALLWATCH_EXE")]
    pub exe: Option<String>,
    /// Select processes that have this library mapped (e.g. libnixl.so);
    /// checked again for a while after each exec, as it may be loaded late.
    #[arg(long, value_name = "NAME", env = "STALLWATCH_LIB")]
    pub lib: Option<String>,
    /// Select processes whose command line (arguments joined by spaces)
    /// matches this regular expression.
    #[arg(long, value_name = "REGEX", env = "STALLWATCH_CMDLINE")]
    pub cmdline: Option<String>,
    /// Select processes whose /proc/PID/cgroup contains this text (a
    /// container id, a pod UID).
    #[arg(long, value_name = "TEXT", env = "STALLWATCH_CGROUP")]
    pub cgroup: Option<String>,
    /// A built-in profile name (see `stallwatch profile list`) or the
    /// path of a profile TOML file, for the --pid or the selected
    /// processes. Without it, each process is watched with the profile of
    /// the first rule it matches: the config file's `[[rule]]` tables, then
    /// the built-in rules (SGLang on Mooncake and on NIXL, vLLM, NIXL).
    #[arg(long, env = "STALLWATCH_PROFILE")]
    pub profile: Option<String>,
    /// The config file's `[[rule]]` tables (no flag: a rule list is a file's).
    #[arg(skip)]
    pub rules: Vec<RuleSetting>,
    /// Whether the built-in rules follow the file's (`builtin_rules`; no
    /// flag) [default: true].
    #[arg(skip)]
    pub builtin_rules: Option<bool>,
    /// How long a request may stay silent before it is reported stalled
    /// [default: 60s].
    #[arg(long, value_parser = parse_duration, env = "STALLWATCH_TIMEOUT")]
    pub timeout: Option<Duration>,
    /// Resolution of the stall timer: a stall is reported within a tick of its timeout [default: 10ms].
    /// The agent wakes when one can be due, and reads the ring buffer at least every 100 ms.
    #[arg(long, value_parser = parse_duration, env = "STALLWATCH_TICK")]
    pub tick: Option<Duration>,
    /// Most requests tracked at once; beyond it the stalest is evicted
    /// (and reported) [default: 1000000].
    #[arg(long, env = "STALLWATCH_MAX_TRACKED", value_parser = parse_count)]
    pub max_tracked: Option<usize>,
    /// Alert line format on stdout [default: human].
    #[arg(long, value_enum, env = "STALLWATCH_OUTPUT")]
    pub output: Option<Format>,
    /// Export spans over OTLP to this collector (e.g.
    /// `http://127.0.0.1:4318`). Without it, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    /// or OTEL_EXPORTER_OTLP_ENDPOINT; none set: no export.
    #[arg(long, value_name = "URL", env = "STALLWATCH_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// OTLP transport (default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else http).
    #[arg(long, value_enum, value_name = "PROTOCOL", env = "STALLWATCH_OTLP_PROTOCOL")]
    pub otlp_protocol: Option<Protocol>,
    /// Serve Prometheus metrics at /metrics on PORT (127.0.0.1), :PORT
    /// (every IPv4 interface, as in a pod) or ADDRESS:PORT (`[::]:PORT` for
    /// IPv6 too).
    #[arg(long, value_name = "[ADDRESS:]PORT", value_parser = metrics::parse_addr, env = "STALLWATCH_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Serve `stallwatch inflight` on this unix socket (its directory is
    /// created 0700, and refused if another user owns it, can write to it
    /// or a symlink leads to it; the socket is 0600) [default: /run/stallwatch/stallwatch.sock].
    #[arg(long, value_name = "PATH", env = "STALLWATCH_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Pin the probes and the kernel's in-flight table here (on bpffs), so
    /// a restarted agent takes over every request in flight; one directory
    /// per agent, created 0700, refused as `--socket`'s is [default: /sys/fs/bpf/stallwatch].
    #[arg(long, value_name = "PATH", env = "STALLWATCH_BPF_DIR")]
    pub bpf_dir: Option<PathBuf>,
    /// Name each watched process's pod from the Kubernetes API: `off`;
    /// `in-cluster` (in a pod: the API server of KUBERNETES_SERVICE_HOST and
    /// _PORT, with the pod's service account); an https:// URL (with the
    /// service account too); or an http:// URL asked without a token
    /// (`kubectl proxy`, e.g. http://127.0.0.1:8001). Only this node's pods
    /// (K8S_NODE_NAME) are listed. Off, a process in a container still has
    /// its container id [default: off].
    #[arg(long, value_name = "off|in-cluster|URL", env = "STALLWATCH_KUBERNETES")]
    pub kubernetes: Option<String>,
    /// The service account's directory (its `token`, re-read before every
    /// pod list, and `ca.crt`), for an in-cluster or https:// --kubernetes
    /// [default: /var/run/secrets/kubernetes.io/serviceaccount].
    #[arg(long, value_name = "DIR", env = "STALLWATCH_KUBERNETES_SERVICE_ACCOUNT")]
    pub kubernetes_service_account: Option<PathBuf>,
    /// Pin nothing: the probes and the in-flight state end with this agent.
    #[arg(long, env = "STALLWATCH_EPHEMERAL")]
    pub ephemeral: bool,
    /// At SIGINT/SIGTERM, leave the probes attached and the state pinned
    /// for the next agent (keep), or detach everything [default: keep].
    #[arg(long, value_enum, value_name = "WHAT", env = "STALLWATCH_ON_EXIT")]
    pub on_exit: Option<OnExit>,
    /// Also read, and probe, watched processes' libraries on FUSE
    /// filesystems. Off, such a process is not watched (and said so): a
    /// FUSE server, which a tenant can run, could hold the agent's read or
    /// the kernel's uprobe attach forever, past every signal. Turn it on
    /// for a FUSE filesystem the node runs itself (a lazy-pulling image
    /// snapshotter).
    #[arg(long, env = "STALLWATCH_TRUST_FUSE")]
    pub trust_fuse: bool,
}

impl RunSettings {
    /// The ids (clap's, the field names) of the settings given here.
    fn given(&self) -> Vec<&'static str> {
        [
            ("pid", self.pid.is_some()),
            ("exe", self.exe.is_some()),
            ("lib", self.lib.is_some()),
            ("cmdline", self.cmdline.is_some()),
            ("cgroup", self.cgroup.is_some()),
            ("profile", self.profile.is_some()),
            ("rules", !self.rules.is_empty() || self.builtin_rules.is_some()),
            ("timeout", self.timeout.is_some()),
            ("tick", self.tick.is_some()),
            ("max_tracked", self.max_tracked.is_some()),
            ("output", self.output.is_some()),
            ("otlp_endpoint", self.otlp_endpoint.is_some()),
            ("otlp_protocol", self.otlp_protocol.is_some()),
            ("metrics_addr", self.metrics_addr.is_some()),
            ("socket", self.socket.is_some()),
            ("bpf_dir", self.bpf_dir.is_some()),
            ("kubernetes", self.kubernetes.is_some()),
            ("kubernetes_service_account", self.kubernetes_service_account.is_some()),
            ("ephemeral", self.ephemeral),
            ("on_exit", self.on_exit.is_some()),
            ("trust_fuse", self.trust_fuse),
        ]
        .into_iter()
        .filter_map(|(id, given)| given.then_some(id))
        .collect()
    }

    fn has_selector(&self) -> bool {
        self.exe.is_some() || self.lib.is_some() || self.cmdline.is_some() || self.cgroup.is_some()
    }

    fn names_target(&self) -> bool {
        self.pid.is_some() || self.has_selector()
    }

    /// These settings (the flags) over `file`'s: each one given here wins;
    /// a target given here (a pid or any selector) replaces the file's
    /// whole target, so `--pid` works with a DaemonSet's selecting config,
    /// and a profile given here replaces the file's rules.
    pub fn over(self, file: RunSettings) -> RunSettings {
        let (pid, exe, lib, cmdline, cgroup) = if self.names_target() {
            (self.pid, self.exe, self.lib, self.cmdline, self.cgroup)
        } else {
            (file.pid, file.exe, file.lib, file.cmdline, file.cgroup)
        };
        let rules = if self.profile.is_some() { Vec::new() } else { file.rules };
        RunSettings {
            pid,
            exe,
            lib,
            cmdline,
            cgroup,
            profile: self.profile.or(file.profile),
            rules,
            builtin_rules: file.builtin_rules,
            timeout: self.timeout.or(file.timeout),
            tick: self.tick.or(file.tick),
            max_tracked: self.max_tracked.or(file.max_tracked),
            output: self.output.or(file.output),
            otlp_endpoint: self.otlp_endpoint.or(file.otlp_endpoint),
            otlp_protocol: self.otlp_protocol.or(file.otlp_protocol),
            metrics_addr: self.metrics_addr.or(file.metrics_addr),
            kubernetes: self.kubernetes.or(file.kubernetes),
            kubernetes_service_account: self.kubernetes_service_account.or(file.kubernetes_service_account),
            socket: self.socket.or(file.socket),
            bpf_dir: self.bpf_dir.or(file.bpf_dir),
            ephemeral: self.ephemeral || file.ephemeral,
            on_exit: self.on_exit.or(file.on_exit),
            trust_fuse: self.trust_fuse || file.trust_fuse,
        }
    }

    /// Which processes, and the rules that give each its profile: a
    /// `--profile` for the pid or the selected processes, or, without one,
    /// the file's rules and the built-in ones.
    fn watch(&self) -> Result<(Target, Rules)> {
        let selects = self.has_selector();
        let target = match (self.pid, selects) {
            (Some(pid), false) => Target::Pid(pid),
            (None, _) => Target::Discover,
            (Some(_), true) => bail!(
                "both a pid and a process selector: watch one process (--pid) or every matching one \
                 (--exe/--lib/--cmdline/--cgroup), not both"
            ),
        };
        let rules = match &self.profile {
            Some(profile) => {
                let selector = match target {
                    Target::Pid(_) => Selector::any(),
                    Target::Discover if selects => {
                        Selector::new(self.exe.clone(), self.lib.clone(), self.cmdline.as_deref(), self.cgroup.clone())?
                    }
                    Target::Discover => bail!(
                        "--profile {profile} with no process: pass --pid PID or a selector (--exe NAME, --lib NAME, \
                         --cmdline REGEX, --cgroup TEXT) for it, or leave the profile out to watch every process the \
                         rules match (the config file's [[rule]] tables, then the built-in rules)"
                    ),
                };
                Rules { own: vec![RuleSetting::given(selector, profile)], builtin: false }
            }
            None if selects => bail!(
                "a process selector with no profile: pass --profile NAME|FILE for the selected processes (built-ins: \
                 see `stallwatch profile list`), or leave the selector out to watch every process the rules match"
            ),
            None => {
                let builtin = self.builtin_rules.unwrap_or(true);
                if self.rules.is_empty() && !builtin {
                    bail!(
                        "no rules: the config file sets `builtin_rules = false` and has no [[rule]] table; add one, \
                         or pass --profile with --pid or a selector"
                    );
                }
                Rules { own: self.rules.clone(), builtin }
            }
        };
        Ok((target, rules))
    }

    /// The defaults for what is still unset; the target and its profile
    /// come from [`Self::watch`].
    pub fn finish(self) -> Result<RunConfig> {
        let (target, rules) = self.watch()?;
        if self.ephemeral && self.bpf_dir.is_some() {
            bail!("both a --bpf-dir and --ephemeral: pin the state in one directory, or nowhere");
        }
        Ok(RunConfig {
            target,
            rules,
            timeout: self.timeout.unwrap_or(DEFAULT_TIMEOUT),
            tick: self.tick.unwrap_or(DEFAULT_TICK),
            max_tracked: self.max_tracked.unwrap_or(DEFAULT_MAX_TRACKED),
            output: self.output.unwrap_or(DEFAULT_OUTPUT),
            telemetry: TelemetryOptions {
                otlp: OtlpOptions { endpoint: self.otlp_endpoint, protocol: self.otlp_protocol, endpoint_from: None },
                metrics_addr: self.metrics_addr,
                kubernetes: workload::Source::parse(
                    self.kubernetes.as_deref().unwrap_or("off"),
                    std::env::var("K8S_NODE_NAME").ok(),
                    self.kubernetes_service_account.as_deref(),
                )?,
            },
            socket: self.socket.unwrap_or_else(|| PathBuf::from(query::DEFAULT_SOCKET)),
            bpf_dir: (!self.ephemeral).then(|| self.bpf_dir.unwrap_or_else(|| PathBuf::from(state::DEFAULT_BPF_DIR))),
            on_exit: self.on_exit.unwrap_or_default(),
            trust: Trust { fuse: self.trust_fuse },
        })
    }
}

/// Which of the [`RunSettings`] the command line set and which their
/// variables did: `config check` names where each value it shows comes
/// from, as an operator must know which of four places to edit.
#[derive(Debug, Clone, Default)]
pub struct Origins(BTreeMap<String, String>);

impl Origins {
    /// From the matches of a command that flattens [`RunSettings`]: by
    /// setting id, `--FLAG` or the variable's name.
    pub fn of(matches: &clap::ArgMatches) -> Self {
        let definitions = RunSettings::augment_args(clap::Command::new("run"));
        let origins = definitions.get_arguments().filter_map(|arg| {
            let id = arg.get_id().as_str();
            let origin = match matches.value_source(id)? {
                ValueSource::CommandLine => format!("--{}", arg.get_long()?),
                ValueSource::EnvVariable => arg.get_env()?.to_str()?.to_owned(),
                _ => return None,
            };
            Some((id.to_owned(), origin))
        });
        Self(origins.collect())
    }

    /// Where a set `--otlp-endpoint` came from, as the exporter's messages
    /// name it (`from=` in the agent's log, its errors).
    fn otlp_endpoint(&self) -> &'static str {
        match self.0.get("otlp_endpoint").map(String::as_str) {
            Some("--otlp-endpoint") => "--otlp-endpoint",
            Some(_) => "STALLWATCH_OTLP_ENDPOINT",
            None => "[otlp] endpoint in the config file",
        }
    }

    /// Where setting `id` of `merged` came from: its flag or variable, the
    /// file (`in_file`: the ids the file gives), or the default.
    fn of_setting(&self, id: &str, in_file: &[&str]) -> String {
        match self.0.get(id) {
            Some(origin) => format!("from {origin}"),
            None if in_file.contains(&id) => "from the config file".to_owned(),
            None => "default".to_owned(),
        }
    }
}

/// `value` with where it came from: inside its own parentheses if it ends
/// with some (`nixl (built-in profile ..., from the config file)`), else in
/// its own (`60s (default)`).
fn with_origin(value: &str, origin: &str) -> String {
    match value.strip_suffix(')') {
        Some(open) if open.contains('(') => format!("{open}, {origin})"),
        _ => format!("{value} ({origin})"),
    }
}

/// One rule as given, its profile not loaded yet: a config file's
/// `[[rule]]`, or `--profile` with its pid or selector.
#[derive(Debug, Clone)]
pub struct RuleSetting {
    pub selector: Selector,
    /// A built-in profile's name or a profile file's path.
    pub profile: String,
    /// Where it was written (`config file F, line N`, `--profile`).
    pub origin: String,
}

impl PartialEq for RuleSetting {
    fn eq(&self, other: &Self) -> bool {
        (self.selector.describe(), &self.profile, &self.origin)
            == (other.selector.describe(), &other.profile, &other.origin)
    }
}

impl Eq for RuleSetting {}

impl RuleSetting {
    fn given(selector: Selector, profile: &str) -> Self {
        Self { selector, profile: profile.to_owned(), origin: "--profile".to_owned() }
    }
}

/// The rules of a run, their profiles not loaded yet.
#[derive(Debug, Clone)]
pub struct Rules {
    /// The file's, or the one `--profile` makes.
    pub own: Vec<RuleSetting>,
    /// Whether the built-in rules ([`rules::BUILTIN`]) follow.
    pub builtin: bool,
}

impl Rules {
    /// Each with its profile loaded (an error names the rule).
    pub fn load(&self) -> Result<Vec<Rule>> {
        let mut loaded = self
            .own
            .iter()
            .map(|rule| {
                let profile = Profile::load(&rule.profile)
                    .with_context(|| format!("{}: profile {}", rule.origin, rule.profile))?;
                Ok(Rule { selector: rule.selector.clone(), profile, origin: rule.origin.clone() })
            })
            .collect::<Result<Vec<_>>>()?;
        if self.builtin {
            loaded.extend(Rule::builtin()?);
        }
        Ok(loaded)
    }
}

/// Everything `stallwatch run` needs, flags, file and defaults merged.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub target: Target,
    pub rules: Rules,
    pub timeout: Duration,
    pub tick: Duration,
    pub max_tracked: usize,
    pub output: Format,
    pub telemetry: TelemetryOptions,
    pub socket: PathBuf,
    /// `None`: `--ephemeral`.
    pub bpf_dir: Option<PathBuf>,
    pub on_exit: OnExit,
    pub trust: Trust,
}

/// The flags over the file (if any) over the defaults; `origins` tells
/// the flags from their variables, for the messages that name a source.
pub fn resolve(config: Option<&Path>, flags: RunSettings, origins: &Origins) -> Result<RunConfig> {
    let file = match config {
        Some(path) => ConfigFile::load(path)?.settings,
        None => RunSettings::default(),
    };
    let mut run = flags.over(file).finish()?;
    run.telemetry.otlp.endpoint_from = Some(origins.otlp_endpoint());
    Ok(run)
}

/// A parsed and checked config file.
#[derive(Debug, Clone)]
pub struct ConfigFile {
    pub path: PathBuf,
    pub settings: RunSettings,
}

impl ConfigFile {
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::util::files::read_text(path, "config file")?;
        Self::parse(&text, path)
    }

    /// Parse and check `text`, the contents of `path`. Relative profile and
    /// socket paths are taken from the file's directory.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let origin = path.display();
        let raw: RawConfig = toml::from_str(text).map_err(|err| {
            let at = err.span().map(|span| format!(", line {}", line_of(text, span.start))).unwrap_or_default();
            anyhow!("config file {origin}{at}: {}", err.message().trim_end())
        })?;
        let at = |span: std::ops::Range<usize>| format!("config file {origin}, line {}", line_of(text, span.start));

        for (name, duration) in [("timeout", &raw.timeout), ("tick", &raw.tick)] {
            if let Some(duration) = duration {
                check_duration(duration.get_ref().0)
                    .map_err(|err| anyhow!("{}: {name}: {err}", at(duration.span())))?;
            }
        }
        if let Some(timeout) = &raw.timeout {
            let (tick, which) = match &raw.tick {
                Some(tick) => (tick.get_ref().0, "tick"),
                None => (DEFAULT_TICK, "the default tick"),
            };
            if timeout.get_ref().0 < tick {
                bail!(
                    "{}: timeout {} is shorter than {which} {}: raise the timeout or lower the tick",
                    at(timeout.span()),
                    timeout.get_ref(),
                    Dur(tick)
                );
            }
        }
        let otlp = raw.otlp.unwrap_or_default();
        if let Some(endpoint) = &otlp.endpoint {
            let protocol = otlp.protocol.as_ref().map(|p| p.get_ref().0);
            // The endpoint alone, as the flag would be checked (no
            // environment): a typo fails here, with its line.
            OtlpOptions {
                endpoint: Some(endpoint.get_ref().clone()),
                protocol,
                endpoint_from: Some("[otlp] endpoint"),
            }
            .resolve_with(|_| None)
            .map_err(|err| anyhow!("{}: {err:#}", at(endpoint.span())))?;
        }
        let beside = |name: String| match path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            Some(dir) if Path::new(&name).is_relative() => dir.join(&name).display().to_string(),
            _ => name,
        };
        let profile = raw
            .profile
            .map(Spanned::into_inner)
            .map(|name| if profile::builtin_text(&name).is_some() { name } else { beside(name) });
        let socket = raw.socket.map(Spanned::into_inner).map(|socket| PathBuf::from(beside(socket)));
        let bpf_dir = raw.bpf_dir.map(Spanned::into_inner).map(PathBuf::from);
        if let (Some(true), Some(dir)) = (raw.ephemeral.as_ref().map(|e| *e.get_ref()), &bpf_dir) {
            bail!(
                "config file {origin}: both `bpf_dir = {:?}` and `ephemeral = true`: give one",
                dir.display().to_string()
            );
        }
        let select_given = raw.select.is_some();
        let select = raw.select.unwrap_or_default();
        if let Some(pattern) = &select.cmdline {
            regex::Regex::new(pattern.get_ref()).map_err(|err| {
                anyhow!("{}: [select] cmdline is not a valid regular expression: {err}", at(pattern.span()))
            })?;
        }
        if let Some(kubernetes) = &raw.kubernetes {
            workload::Source::parse(kubernetes.get_ref(), None, None)
                .map_err(|err| anyhow!("{}: kubernetes: {err:#}", at(kubernetes.span())))?;
        }
        let kubernetes_service_account =
            raw.kubernetes_service_account.map(Spanned::into_inner).map(|dir| PathBuf::from(beside(dir)));
        let rules = raw.rule.unwrap_or_default();
        if let (Some(first), true) = (rules.first(), profile.is_some() || select_given) {
            bail!(
                "{}: a [[rule]] table beside `profile` or [select]: give rules (each process watched with its \
                 rule's profile) or one profile for the selected processes, not both",
                at(first.span())
            );
        }
        let rules = rules
            .into_iter()
            .map(|rule| {
                let line = at(rule.span());
                let rule = rule.into_inner();
                let name = rule.profile.into_inner();
                let profile = if profile::builtin_text(&name).is_some() { name } else { beside(name) };
                let (exe, lib, cmdline, cgroup) = (rule.exe, rule.lib, rule.cmdline, rule.cgroup);
                let selector =
                    match (exe.is_none() && lib.is_none() && cmdline.is_none() && cgroup.is_none(), rule.image) {
                        (true, None) => bail!(
                            "{line}: [[rule]] for {profile} selects nothing: give at least one of exe, lib, cmdline, \
                         cgroup, image"
                        ),
                        // An image alone selects.
                        (true, Some(image)) => Selector::any().with_image(&image),
                        (false, image) => {
                            Selector::new(exe, lib, cmdline.as_deref(), cgroup).and_then(|selector| match image {
                                Some(image) => selector.with_image(&image),
                                None => Ok(selector),
                            })
                        }
                    }
                    .map_err(|err| anyhow!("{line}: [[rule]]: {err:#}"))?;
                Ok(RuleSetting { selector, profile, origin: line })
            })
            .collect::<Result<Vec<_>>>()?;
        let settings = RunSettings {
            pid: raw.pid.map(|pid| pid.into_inner().0),
            exe: select.exe,
            lib: select.lib,
            cmdline: select.cmdline.map(Spanned::into_inner),
            cgroup: select.cgroup,
            profile,
            rules,
            builtin_rules: raw.builtin_rules.map(Spanned::into_inner),
            timeout: raw.timeout.map(|d| d.into_inner().0),
            tick: raw.tick.map(|d| d.into_inner().0),
            max_tracked: raw.max_tracked.map(|n| n.into_inner().0),
            output: raw.output.map(|o| o.into_inner().0),
            otlp_endpoint: otlp.endpoint.map(Spanned::into_inner),
            otlp_protocol: otlp.protocol.map(|p| p.into_inner().0),
            metrics_addr: raw.metrics.and_then(|m| m.addr).map(|a| a.0),
            kubernetes: raw.kubernetes.map(Spanned::into_inner),
            kubernetes_service_account,
            socket,
            bpf_dir,
            ephemeral: raw.ephemeral.is_some_and(Spanned::into_inner),
            on_exit: raw.on_exit.map(|o| o.into_inner().0),
            trust_fuse: raw.trust_fuse.is_some_and(Spanned::into_inner),
        };
        Ok(Self { path: path.to_path_buf(), settings })
    }

    /// `stallwatch config check`: everything [`parse`](Self::parse) checks,
    /// plus that the profile loads, with `flags` (the command line and the
    /// `STALLWATCH_*` variables, which `origins` tells apart) over the file
    /// and the `OTEL_*` variables resolved exactly as `run` resolves them:
    /// what `run` would refuse fails here too. Returns what `run` would
    /// use, one setting a line, each with where its value came from.
    pub fn check(path: Option<&Path>, flags: RunSettings, origins: &Origins) -> Result<String> {
        let file = path.map(Self::load).transpose()?.map(|file| file.settings).unwrap_or_default();
        let in_file = file.given();
        let from = |what: &str| match path {
            Some(path) => format!("config file {}: {what}", path.display()),
            None => what.to_owned(),
        };
        let origin = |id: &str| origins.of_setting(id, &in_file);
        let s = &flags.over(file);
        if s.ephemeral && s.bpf_dir.is_some() {
            bail!("{}", from("both a bpf_dir and ephemeral: pin the state in one directory, or nowhere"));
        }
        let tick = s.tick.unwrap_or(DEFAULT_TICK);
        if let Some(timeout) = s.timeout.filter(|&timeout| timeout < tick) {
            bail!(
                "{}",
                from(&format!(
                    "timeout {} is shorter than the tick {}: raise the timeout or lower the tick",
                    Dur(timeout),
                    Dur(tick)
                ))
            );
        }
        let profile = match &s.profile {
            Some(spec) => {
                let loaded = Profile::load(spec).with_context(|| from("profile"))?;
                with_origin(
                    &format!("{} ({}, {} probes)", spec, loaded.origin, loaded.probes.len()),
                    &origin("profile"),
                )
            }
            None => {
                let (_, rules) = s.watch().map_err(|err| anyhow!("{}", from(&format!("{err:#}"))))?;
                let loaded = rules.load().with_context(|| from("rules"))?;
                format!("by rule, the first a process matches: {}", rules::Rules::new(loaded).0.describe_all())
            }
        };
        let target_ids = ["pid", "exe", "lib", "cmdline", "cgroup"];
        let selector = [("exe", &s.exe), ("lib", &s.lib), ("cmdline", &s.cmdline), ("cgroup", &s.cgroup)]
            .into_iter()
            .filter_map(|(name, value)| value.as_ref().map(|value| format!("{name}={value}")))
            .collect::<Vec<_>>();
        let target_origin =
            || target_ids.iter().map(|id| origin(id)).find(|o| o != "default").unwrap_or_else(|| "default".to_owned());
        let pid = match (s.pid, selector.is_empty()) {
            (Some(pid), true) => with_origin(&pid.to_string(), &target_origin()),
            (Some(_), false) => bail!("{}", from("both a pid and a process selector: give one or the other")),
            (None, false) => with_origin(&format!("every process matching {}", selector.join(" ")), &target_origin()),
            (None, true) if s.profile.is_some() => "not set: pass --pid or a selector at run time".to_owned(),
            (None, true) => "every process a rule matches, now and later".to_owned(),
        };
        let shown = |id: &str, value: Option<String>, default: String| match value {
            Some(value) => with_origin(&value, &origin(id)),
            None => format!("{default} (default)"),
        };
        let env = |name: &str| std::env::var(name).ok().filter(|value| !value.trim().is_empty());
        // The environment too, as `run` reads it.
        let options = OtlpOptions {
            endpoint: s.otlp_endpoint.clone(),
            protocol: s.otlp_protocol,
            endpoint_from: Some(origins.otlp_endpoint()),
        };
        let otlp = match options.resolve() {
            Ok(Some(t)) => {
                let endpoint_from =
                    if s.otlp_endpoint.is_some() { origin("otlp_endpoint") } else { format!("from {}", t.source) };
                let protocol_from = if s.otlp_protocol.is_some() {
                    Some(origin("otlp_protocol"))
                } else {
                    [otlp::config::TRACES_PROTOCOL, otlp::config::PROTOCOL]
                        .into_iter()
                        .find(|name| env(name).is_some())
                        .map(|name| format!("from {name}"))
                };
                let protocol = match protocol_from {
                    Some(from) => format!("{} {from}", t.protocol),
                    None => t.protocol.to_string(),
                };
                let tls = match (&t.ca, t.is_tls()) {
                    (_, false) => String::new(),
                    (None, true) => ", TLS trusting the system's roots".to_owned(),
                    (Some(ca), true) => {
                        format!(", TLS trusting the system's roots and {} (from {})", ca.path.display(), ca.source)
                    }
                };
                format!("{} ({protocol}, {endpoint_from}{tls})", t.endpoint)
            }
            Ok(None) => match otlp::sampling::disabled_by(&|name: &str| std::env::var(name).ok()) {
                Ok(Some(why)) => format!("off ({why})"),
                _ => "off (no --otlp-endpoint, [otlp] endpoint nor OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)".to_owned(),
            },
            Err(err) => bail!("{}", from(&format!("otlp: {err:#}"))),
        };
        let sampler = otlp::sampling::SpanSampler::from_env(&|name: &str| std::env::var(name).ok())
            .map_err(|err| anyhow!("{}", from(&format!("{err:#}"))))?;
        let sampler = match env(otlp::sampling::TRACES_SAMPLER) {
            Some(_) => format!("{} (from {})", sampler.name, otlp::sampling::TRACES_SAMPLER),
            None => format!("{} (default)", sampler.name),
        };
        let kubernetes = workload::Source::parse(
            s.kubernetes.as_deref().unwrap_or("off"),
            std::env::var("K8S_NODE_NAME").ok(),
            s.kubernetes_service_account.as_deref(),
        )
        .map_err(|err| anyhow!("{}", from(&format!("{err:#}"))))?
        .to_string();
        let rows = [
            ("watch", pid),
            ("profile", profile),
            ("timeout", shown("timeout", s.timeout.map(|d| Dur(d).to_string()), Dur(DEFAULT_TIMEOUT).to_string())),
            ("tick", shown("tick", s.tick.map(|d| Dur(d).to_string()), Dur(DEFAULT_TICK).to_string())),
            (
                "max_tracked",
                shown("max_tracked", s.max_tracked.map(|n| n.to_string()), DEFAULT_MAX_TRACKED.to_string()),
            ),
            ("output", shown("output", s.output.map(choice_name), choice_name(DEFAULT_OUTPUT))),
            ("otlp", otlp),
            ("sampler", sampler),
            (
                "metrics",
                match s.metrics_addr {
                    Some(addr) => with_origin(&format!("http://{addr}/metrics"), &origin("metrics_addr")),
                    None => "off (default)".to_owned(),
                },
            ),
            ("kubernetes", with_origin(&kubernetes, &origin("kubernetes"))),
            (
                "socket",
                shown("socket", s.socket.as_ref().map(|p| p.display().to_string()), query::DEFAULT_SOCKET.to_owned()),
            ),
            (
                "bpf_dir",
                if s.ephemeral {
                    with_origin("none (ephemeral: nothing outlives the agent)", &origin("ephemeral"))
                } else {
                    shown(
                        "bpf_dir",
                        s.bpf_dir.as_ref().map(|p| p.display().to_string()),
                        state::DEFAULT_BPF_DIR.to_owned(),
                    )
                },
            ),
            ("on_exit", shown("on_exit", s.on_exit.map(choice_name), choice_name(OnExit::default()))),
            ("trust_fuse", with_origin(&s.trust_fuse.to_string(), &origin("trust_fuse"))),
        ];
        let mut out = match path {
            Some(path) => format!("config file {}: ok\n", path.display()),
            None => "settings (no config file): ok\n".to_owned(),
        };
        for (name, value) in rows {
            out.push_str(&format!("  {name:<12} {value}\n"));
        }
        Ok(out)
    }
}

/// The file as written. New `run` flags get a field here and in
/// [`RunSettings`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    pid: Option<Spanned<Pid>>,
    select: Option<RawSelect>,
    profile: Option<Spanned<String>>,
    rule: Option<Vec<Spanned<RawRule>>>,
    builtin_rules: Option<Spanned<bool>>,
    timeout: Option<Spanned<Dur>>,
    tick: Option<Spanned<Dur>>,
    max_tracked: Option<Spanned<Count>>,
    output: Option<Spanned<Choice<Format>>>,
    socket: Option<Spanned<String>>,
    bpf_dir: Option<Spanned<String>>,
    ephemeral: Option<Spanned<bool>>,
    on_exit: Option<Spanned<Choice<OnExit>>>,
    trust_fuse: Option<Spanned<bool>>,
    otlp: Option<RawOtlp>,
    metrics: Option<RawMetrics>,
    kubernetes: Option<Spanned<String>>,
    kubernetes_service_account: Option<Spanned<String>>,
}

/// `[select]`: `--exe`, `--lib`, `--cmdline`, `--cgroup`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawSelect {
    exe: Option<String>,
    lib: Option<String>,
    cmdline: Option<Spanned<String>>,
    cgroup: Option<String>,
}

/// `[[rule]]`: a selector, as `[select]`, and the profile of the processes
/// it matches.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    profile: Spanned<String>,
    exe: Option<String>,
    lib: Option<String>,
    cmdline: Option<String>,
    cgroup: Option<String>,
    /// A regular expression over the image the process's container runs.
    image: Option<String>,
}

/// `[otlp]`: `--otlp-endpoint`, `--otlp-protocol`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawOtlp {
    endpoint: Option<Spanned<String>>,
    protocol: Option<Spanned<Choice<Protocol>>>,
}

/// `[metrics]`: `--metrics-addr`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    addr: Option<Addr>,
}

/// A duration written as a string, as the flags take it (`"60s"`, `"1m 30s"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dur(Duration);

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = Dur;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"60s\", \"500ms\" or \"2m\"")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Dur, E> {
                humantime::parse_duration(text.trim()).map(Dur).map_err(|err| {
                    E::custom(format!("{text:?} is not a duration ({err}): write it like \"60s\", \"500ms\" or \"2m\""))
                })
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Dur, E> {
                Err(E::custom(format!(
                    "a bare number ({n}) has no unit: write the duration as a string, e.g. \"{n}s\""
                )))
            }
            fn visit_f64<E: de::Error>(self, n: f64) -> Result<Dur, E> {
                Err(E::custom(format!(
                    "a bare number ({n}) has no unit: write the duration as a string, e.g. \"{n}s\""
                )))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// The longest `timeout` or `tick` taken: far beyond any use, and far
/// from where the timers' arithmetic would overflow.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// `--timeout` and `--tick`: a duration the timers can run on. Zero would
/// stop them (a zero period is a panic in the timer, after attaching).
fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text.trim())
        .map_err(|err| format!("{text:?} is not a duration ({err}): write it like 60s, 500ms or 2m"))?;
    check_duration(duration)?;
    Ok(duration)
}

/// A duration is more than zero and at most [`MAX_DURATION`].
fn check_duration(duration: Duration) -> Result<(), String> {
    if duration.is_zero() {
        return Err(
            "a zero duration would stop the timers: give a positive one (e.g. 10ms for the tick, 60s for the timeout)"
                .to_owned(),
        );
    }
    if duration > MAX_DURATION {
        return Err(format!(
            "{} is longer than the longest taken, {}",
            humantime::format_duration(duration),
            humantime::format_duration(MAX_DURATION)
        ));
    }
    Ok(())
}

/// `--pid`: a process id, as the kernel gives them (1 and up).
fn parse_pid(text: &str) -> Result<u32, String> {
    let n = text
        .trim()
        .parse::<i64>()
        .map_err(|_| format!("{text:?} is not a process id: give the number `ps` or `pgrep` shows"))?;
    check_pid(n)
}

fn check_pid(n: i64) -> Result<u32, String> {
    match u32::try_from(n) {
        Ok(pid) if pid > 0 && pid <= i32::MAX as u32 => Ok(pid),
        Ok(0) => Err("pid 0 is not a process id (it is the kernel's idle task, not a process one can watch): \
                      give the prefill server's pid, as `ps` or `pgrep` shows it"
            .to_owned()),
        _ => Err(format!("pid {n} is not a process id (a positive integer, as `ps` or `pgrep` shows it)")),
    }
}

/// A pid: a positive integer.
struct Pid(u32);

impl<'de> Deserialize<'de> for Pid {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(deserializer)?;
        check_pid(n).map(Pid).map_err(de::Error::custom)
    }
}

/// A positive count on the command line, as the config file takes it
/// ([`Count`]): 0 would track nothing and is refused by both. A count
/// past what a number holds (`--max-tracked 99999999999999999999`, "no
/// limit") saturates, as `18446744073709551615` does: the engine caps
/// either at the most it can track (2^32 - 2).
fn parse_count(text: &str) -> Result<usize, String> {
    match text.trim().parse::<u64>() {
        Ok(0) => Err(format!("{text} is not a positive count (1 or more): 0 would track nothing")),
        Ok(count) => Ok(usize::try_from(count).unwrap_or(usize::MAX)),
        Err(err) if *err.kind() == std::num::IntErrorKind::PosOverflow => Ok(usize::MAX),
        Err(_) => Err(format!("{text} is not a positive count (1 or more)")),
    }
}

/// A positive count.
struct Count(usize);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(deserializer)?;
        match usize::try_from(n) {
            Ok(count) if count > 0 => Ok(Count(count)),
            _ => Err(de::Error::custom(format!("{n} is not a positive count"))),
        }
    }
}

/// One of a flag's named values (`output = "json"`), spelled as on the
/// command line.
struct Choice<T>(T);

impl<'de, T: ValueEnum> Deserialize<'de> for Choice<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        T::from_str(text.trim(), true).map(Choice).map_err(|_| {
            let names: Vec<String> = T::value_variants()
                .iter()
                .filter_map(ValueEnum::to_possible_value)
                .map(|value| format!("{:?}", value.get_name()))
                .collect();
            de::Error::custom(format!("{text:?} is not one of {}", names.join(", ")))
        })
    }
}

fn choice_name<T: ValueEnum>(value: T) -> String {
    value.to_possible_value().map_or_else(|| "?".to_owned(), |v| v.get_name().to_owned())
}

/// `PORT` or `ADDRESS:PORT`, as `--metrics-addr` takes it.
struct Addr(SocketAddr);

impl<'de> Deserialize<'de> for Addr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = Addr;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a port number or an \"ADDRESS:PORT\" string")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Addr, E> {
                metrics::parse_addr(text).map(Addr).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Addr, E> {
                self.visit_str(&n.to_string())
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let settings =
            parse("profile = \"nixl\"\n[select]\nlib = \"libnixl.so\"\ncmdline = \"sglang\"\n").expect("valid");
        assert_eq!(settings.lib.as_deref(), Some("libnixl.so"));
        let config = settings.finish().expect("complete");
        assert_eq!(config.target, Target::Discover);
        assert_eq!(config.rules.own[0].selector.describe(), "lib=libnixl.so cmdline=/sglang/");
        let err = error("profile = \"nixl\"\n\n[select]\ncmdline = \"(\"\n");
        assert!(err.contains("line 4") && err.contains("not a valid regular expression"), "{err}");
        let both =
            RunSettings { pid: Some(1), exe: Some("x".into()), profile: Some("demo".into()), ..Default::default() };
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
            ConfigFile::parse(include_str!("../../deploy/base/config.toml"), Path::new("/etc/stallwatch/config.toml"))
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
        let manifest = include_str!("../../deploy/base/daemonset.yaml");
        for (attribute, var) in crate::export::otlp::config::K8S_ENV {
            assert!(
                manifest.contains(&format!("name: {var}\n")),
                "daemonset.yaml does not set {var} (for {attribute})"
            );
        }
    }
}
