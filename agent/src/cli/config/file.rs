//! The config file: its TOML as written ([`RawConfig`]), checked line by
//! line and read into [`RunSettings`], relative paths taken from the
//! file's directory.
use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow, bail};
use serde::Deserialize;
use toml::Spanned;

use super::{
    DEFAULT_TICK, RuleSetting, RunSettings,
    values::{Addr, Choice, Count, Dur, Pid, check_duration},
};
use crate::{
    export::{
        alert::Format,
        otlp::{OtlpOptions, Protocol},
        workload,
    },
    profile,
    run::{OnExit, discovery::Selector},
};

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
fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1
}
