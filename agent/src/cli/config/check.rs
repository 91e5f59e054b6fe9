//! `stallwatch config check`: what `run` would use, each setting with
//! where its value came from, failing where `run` would.
use std::path::Path;

use anyhow::{Context as _, Result, anyhow, bail};

use super::{
    ConfigFile, DEFAULT_MAX_TRACKED, DEFAULT_OUTPUT, DEFAULT_TICK, DEFAULT_TIMEOUT, Origins, RunSettings,
    origins::with_origin,
    values::{Dur, choice_name},
};
use crate::{
    export::{
        otlp::{self, OtlpOptions},
        workload,
    },
    kernel::state,
    profile::Profile,
    query,
    run::{OnExit, rules},
};

impl ConfigFile {
    /// `stallwatch config check`: everything [`parse`](Self::parse) checks,
    /// plus that the profile loads, with `flags` (the command line and the
    /// `STALLWATCH_*` variables, which `origins` tells apart) over the file
    /// and the `OTEL_*` variables resolved exactly as `run` resolves them:
    /// what `run` would refuse fails here too. Returns what `run` would
    /// use, one setting a line, each with where its value came from.
    pub fn check(path: Option<&Path>, flags: RunSettings, origins: &Origins) -> Result<String> {
        let file = path.map(Self::load).transpose()?.map(|file| file.settings).unwrap_or_default();
        let check = Check { path, origins, in_file: file.given() };
        let s = &flags.over(file);
        check.timers_and_state(s)?;
        // In this order, as the first that fails is the error.
        let profile = check.profile(s)?;
        let watch = check.watch(s)?;
        let (otlp, sampler, kubernetes) = (check.otlp(s)?, check.sampler()?, check.kubernetes(s)?);
        let rows = [
            ("watch", watch),
            ("profile", profile),
            (
                "timeout",
                check.shown("timeout", s.timeout.map(|d| Dur(d).to_string()), Dur(DEFAULT_TIMEOUT).to_string()),
            ),
            ("tick", check.shown("tick", s.tick.map(|d| Dur(d).to_string()), Dur(DEFAULT_TICK).to_string())),
            (
                "max_tracked",
                check.shown("max_tracked", s.max_tracked.map(|n| n.to_string()), DEFAULT_MAX_TRACKED.to_string()),
            ),
            ("output", check.shown("output", s.output.map(choice_name), choice_name(DEFAULT_OUTPUT))),
            ("otlp", otlp),
            ("sampler", sampler),
            (
                "metrics",
                match s.metrics_addr {
                    Some(addr) => with_origin(&format!("http://{addr}/metrics"), &check.origin("metrics_addr")),
                    None => "off (default)".to_owned(),
                },
            ),
            ("kubernetes", kubernetes),
            (
                "socket",
                check.shown(
                    "socket",
                    s.socket.as_ref().map(|p| p.display().to_string()),
                    query::DEFAULT_SOCKET.to_owned(),
                ),
            ),
            (
                "bpf_dir",
                if s.ephemeral {
                    with_origin("none (ephemeral: nothing outlives the agent)", &check.origin("ephemeral"))
                } else {
                    check.shown(
                        "bpf_dir",
                        s.bpf_dir.as_ref().map(|p| p.display().to_string()),
                        state::DEFAULT_BPF_DIR.to_owned(),
                    )
                },
            ),
            ("on_exit", check.shown("on_exit", s.on_exit.map(choice_name), choice_name(OnExit::default()))),
            ("trust_fuse", with_origin(&s.trust_fuse.to_string(), &check.origin("trust_fuse"))),
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

/// One `config check`: the file checked (if any), where each setting came
/// from, and the lines it shows.
struct Check<'a> {
    path: Option<&'a Path>,
    origins: &'a Origins,
    /// The ids of the settings the file gives.
    in_file: Vec<&'static str>,
}

impl Check<'_> {
    /// `what`, said of the file if there is one.
    fn from(&self, what: &str) -> String {
        match self.path {
            Some(path) => format!("config file {}: {what}", path.display()),
            None => what.to_owned(),
        }
    }

    /// Where setting `id` came from.
    fn origin(&self, id: &str) -> String {
        self.origins.of_setting(id, &self.in_file)
    }

    /// A setting's value with where it came from, or its default.
    fn shown(&self, id: &str, value: Option<String>, default: String) -> String {
        match value {
            Some(value) => with_origin(&value, &self.origin(id)),
            None => format!("{default} (default)"),
        }
    }

    /// What `run` refuses of the state directory and the timers.
    fn timers_and_state(&self, s: &RunSettings) -> Result<()> {
        if s.ephemeral && s.bpf_dir.is_some() {
            bail!("{}", self.from("both a bpf_dir and ephemeral: pin the state in one directory, or nowhere"));
        }
        let tick = s.tick.unwrap_or(DEFAULT_TICK);
        if let Some(timeout) = s.timeout.filter(|&timeout| timeout < tick) {
            bail!(
                "{}",
                self.from(&format!(
                    "timeout {} is shorter than the tick {}: raise the timeout or lower the tick",
                    Dur(timeout),
                    Dur(tick)
                ))
            );
        }
        Ok(())
    }

    /// The profile, loaded; or the rules, each profile loaded.
    fn profile(&self, s: &RunSettings) -> Result<String> {
        Ok(match &s.profile {
            Some(spec) => {
                let loaded = Profile::load(spec).with_context(|| self.from("profile"))?;
                with_origin(
                    &format!("{} ({}, {} probes)", spec, loaded.origin, loaded.probes.len()),
                    &self.origin("profile"),
                )
            }
            None => {
                let (_, rules) = s.watch().map_err(|err| anyhow!("{}", self.from(&format!("{err:#}"))))?;
                let loaded = rules.load().with_context(|| self.from("rules"))?;
                format!("by rule, the first a process matches: {}", rules::Rules::new(loaded).0.describe_all())
            }
        })
    }

    /// Which processes: a pid, the selected ones, or every one a rule
    /// matches.
    fn watch(&self, s: &RunSettings) -> Result<String> {
        let target_ids = ["pid", "exe", "lib", "cmdline", "cgroup"];
        let selector = [("exe", &s.exe), ("lib", &s.lib), ("cmdline", &s.cmdline), ("cgroup", &s.cgroup)]
            .into_iter()
            .filter_map(|(name, value)| value.as_ref().map(|value| format!("{name}={value}")))
            .collect::<Vec<_>>();
        let target_origin = || {
            target_ids.iter().map(|id| self.origin(id)).find(|o| o != "default").unwrap_or_else(|| "default".to_owned())
        };
        Ok(match (s.pid, selector.is_empty()) {
            (Some(pid), true) => with_origin(&pid.to_string(), &target_origin()),
            (Some(_), false) => bail!("{}", self.from("both a pid and a process selector: give one or the other")),
            (None, false) => with_origin(&format!("every process matching {}", selector.join(" ")), &target_origin()),
            (None, true) if s.profile.is_some() => "not set: pass --pid or a selector at run time".to_owned(),
            (None, true) => "every process a rule matches, now and later".to_owned(),
        })
    }

    /// The OTLP export, the environment read as `run` reads it.
    fn otlp(&self, s: &RunSettings) -> Result<String> {
        let options = OtlpOptions {
            endpoint: s.otlp_endpoint.clone(),
            protocol: s.otlp_protocol,
            endpoint_from: Some(self.origins.otlp_endpoint()),
        };
        Ok(match options.resolve() {
            Ok(Some(t)) => {
                let endpoint_from =
                    if s.otlp_endpoint.is_some() { self.origin("otlp_endpoint") } else { format!("from {}", t.source) };
                let protocol_from = if s.otlp_protocol.is_some() {
                    Some(self.origin("otlp_protocol"))
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
            Err(err) => bail!("{}", self.from(&format!("otlp: {err:#}"))),
        })
    }

    /// The span sampler the `OTEL_TRACES_SAMPLER*` variables make.
    fn sampler(&self) -> Result<String> {
        let sampler = otlp::sampling::SpanSampler::from_env(&|name: &str| std::env::var(name).ok())
            .map_err(|err| anyhow!("{}", self.from(&format!("{err:#}"))))?;
        Ok(match env(otlp::sampling::TRACES_SAMPLER) {
            Some(_) => format!("{} (from {})", sampler.name, otlp::sampling::TRACES_SAMPLER),
            None => format!("{} (default)", sampler.name),
        })
    }

    /// Where pods are named from.
    fn kubernetes(&self, s: &RunSettings) -> Result<String> {
        let kubernetes = workload::Source::parse(
            s.kubernetes.as_deref().unwrap_or("off"),
            std::env::var("K8S_NODE_NAME").ok(),
            s.kubernetes_service_account.as_deref(),
        )
        .map_err(|err| anyhow!("{}", self.from(&format!("{err:#}"))))?
        .to_string();
        Ok(with_origin(&kubernetes, &self.origin("kubernetes")))
    }
}

/// A variable of the environment, unset if blank.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.trim().is_empty())
}
