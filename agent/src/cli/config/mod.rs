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
//!
//! Raw settings apart from resolved ones, as ripgrep keeps its low and
//! high arguments: [`settings`] is what one source (the flags, or the
//! file) says, each setting once with its flag's docs; [`mod@file`] reads the
//! file into those; [`values`] checks each value for both alike;
//! [`mod@resolve`] merges them over the defaults into the [`RunConfig`] `run`
//! takes; [`origins`] names where a value came from; [`check`] is
//! `stallwatch config check`.
mod check;
mod file;
mod origins;
mod resolve;
mod settings;
#[cfg(test)]
mod tests;
mod values;

pub use file::ConfigFile;
pub use origins::Origins;
pub use resolve::{
    DEFAULT_MAX_TRACKED, DEFAULT_OUTPUT, DEFAULT_TICK, DEFAULT_TIMEOUT, RuleSetting, Rules, RunConfig, resolve,
};
pub use settings::RunSettings;
