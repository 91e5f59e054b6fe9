//! Where each setting came from (its flag, its variable, the file or the
//! default), for the messages and the `config check` lines that name it.
use std::collections::BTreeMap;

use clap::{Args as _, parser::ValueSource};

use super::RunSettings;

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
    pub(super) fn otlp_endpoint(&self) -> &'static str {
        match self.0.get("otlp_endpoint").map(String::as_str) {
            Some("--otlp-endpoint") => "--otlp-endpoint",
            Some(_) => "STALLWATCH_OTLP_ENDPOINT",
            None => "[otlp] endpoint in the config file",
        }
    }

    /// Where setting `id` of `merged` came from: its flag or variable, the
    /// file (`in_file`: the ids the file gives), or the default.
    pub(super) fn of_setting(&self, id: &str, in_file: &[&str]) -> String {
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
pub(super) fn with_origin(value: &str, origin: &str) -> String {
    match value.strip_suffix(')') {
        Some(open) if open.contains('(') => format!("{open}, {origin})"),
        _ => format!("{value} ({origin})"),
    }
}
