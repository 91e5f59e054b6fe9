//! The settings resolved: the flags over the file over the defaults, the
//! processes to watch and the rules that give each its profile, as
//! `stallwatch run` takes them ([`RunConfig`]).
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use super::{ConfigFile, Origins, RunSettings};
use crate::{
    export::{alert::Format, otlp::OtlpOptions, telemetry::TelemetryOptions, workload},
    kernel::state,
    profile::{Profile, plan::Trust},
    query,
    run::{OnExit, Target, discovery::Selector, rules::Rule},
};

/// `--timeout` when neither the flag nor the file sets it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// `--tick` when neither the flag nor the file sets it.
pub const DEFAULT_TICK: Duration = Duration::from_millis(10);
/// `--max-tracked` when neither the flag nor the file sets it.
pub const DEFAULT_MAX_TRACKED: usize = 1_000_000;
/// `--output` when neither the flag nor the file sets it.
pub const DEFAULT_OUTPUT: Format = Format::Human;

impl RunSettings {
    /// Which processes, and the rules that give each its profile: a
    /// `--profile` for the pid or the selected processes, or, without one,
    /// the file's rules and the built-in ones.
    pub(super) fn watch(&self) -> Result<(Target, Rules)> {
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
    pub(super) fn given(selector: Selector, profile: &str) -> Self {
        Self { selector, profile: profile.to_owned(), origin: "--profile".to_owned() }
    }
}

/// The rules of a run, their profiles not loaded yet.
#[derive(Debug, Clone)]
pub struct Rules {
    /// The file's, or the one `--profile` makes.
    pub own: Vec<RuleSetting>,
    /// Whether the built-in rules ([`crate::run::rules::BUILTIN`]) follow.
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
