//! Every flag and command of `stallwatch`, defined once with its docs
//! (clap derives `--help`, the completions and the man page from them).
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use super::{
    config,
    logging::{self, LogFormat},
};
use crate::{kernel::state, query, util::build_info};

/// Every option can also be set by its environment variable (shown in
/// `--help` as `[env: ...]`); a flag on the command line wins over the
/// variable, the variable over `run --config`'s file.
#[derive(Parser)]
#[command(
    name = "stallwatch",
    version,
    long_version = build_info::LONG_VERSION,
    about = "Catches silent request stalls in disaggregated LLM serving, from outside the process"
)]
pub struct Cli {
    /// Which log lines to write (stderr): a level, or `LEVEL,TARGET=LEVEL,...`
    /// (tracing's EnvFilter syntax); a filter that does not parse is an error.
    #[arg(long, global = true, env = "STALLWATCH_LOG", value_name = "FILTER", default_value = logging::DEFAULT_FILTER,
          value_parser = logging::parse_filter)]
    pub log: String,
    /// Log line format.
    #[arg(long, global = true, env = "STALLWATCH_LOG_FORMAT", value_enum, value_name = "FORMAT", default_value_t)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Watch a process: attach a probe profile and alert on every request
    /// silent past the timeout, while it is still stuck.
    ///
    /// SIGTERM, SIGINT and every other signal that would end the process
    /// (SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM...) stop it the same
    /// way: the last alerts, the summary, and the probes and in-flight
    /// state left for the next agent as --on-exit says. SIGHUP does not
    /// reload: restart the agent (the next one takes the requests over).
    /// A stop during start-up ends it at once, leaving nothing of its own.
    #[command(verbatim_doc_comment)]
    Run {
        /// Settings from this TOML file (see docs/deploying.md); a flag or
        /// variable given here wins over the file.
        #[arg(long, value_name = "FILE", env = "STALLWATCH_CONFIG")]
        config: Option<PathBuf>,
        #[command(flatten)]
        flags: config::RunSettings,
    },
    /// Check that this kernel and these privileges can run stallwatch: what
    /// is missing and how to fix it. Exits non-zero when a required check
    /// fails.
    Doctor {
        /// Print the report as one JSON document.
        #[arg(long)]
        json: bool,
        /// The bpf directory `run` would use: is it safe from other users?
        #[arg(long, value_name = "PATH", env = "STALLWATCH_BPF_DIR", default_value = state::DEFAULT_BPF_DIR)]
        bpf_dir: PathBuf,
        /// The socket `run` would serve: is its directory safe from other users?
        #[arg(long, value_name = "PATH", env = "STALLWATCH_SOCKET", default_value = query::DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// `stallwatch run --config` files.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Every request in flight in the running agent, oldest first: stage,
    /// age, silence and, if stalled, the class. Needs root.
    Inflight {
        /// The agent's socket (its `stallwatch run --socket`).
        #[arg(long, value_name = "PATH", env = "STALLWATCH_SOCKET", default_value = query::DEFAULT_SOCKET)]
        socket: PathBuf,
        /// Print the agent's answer as JSON (one document) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Built-in probe profiles.
    Profile {
        #[command(subcommand)]
        command: ProfileCommand,
    },
    /// What a stopped agent left pinned for the next one: its probes and
    /// the kernel's in-flight table.
    State {
        #[command(subcommand)]
        command: StateCommand,
    },
    /// Print a shell completion script, generated from these flags
    /// (e.g. `stallwatch completions bash > /etc/bash_completion.d/stallwatch`).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), generated from these flags; with `--dir`,
    /// write one page per command there (stallwatch.1, stallwatch-run.1, ...).
    Man {
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
pub enum StateCommand {
    /// Detach the probes and drop the in-flight state pinned in the bpf
    /// directory (refused while an agent uses it).
    Clear {
        /// The agent's `run --bpf-dir`.
        #[arg(long, value_name = "PATH", env = "STALLWATCH_BPF_DIR", default_value = state::DEFAULT_BPF_DIR)]
        bpf_dir: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Validate a config file and print the settings `run` would use with
    /// it: the same flags, `STALLWATCH_*` and `OTEL_*` variables applied as
    /// `run` applies them, so what `run` would refuse fails here too.
    Check {
        /// The file (else `STALLWATCH_CONFIG`; neither: flags and
        /// environment alone).
        #[arg(env = "STALLWATCH_CONFIG")]
        path: Option<PathBuf>,
        #[command(flatten)]
        flags: config::RunSettings,
    },
}

#[derive(Subcommand)]
pub enum ProfileCommand {
    /// List the built-in profiles.
    List,
    /// Print a built-in profile's TOML (a starting point for your own).
    Show { name: String },
    /// Validate a profile file and print what it attaches to.
    Check {
        path: PathBuf,
        /// Also resolve every probe in this running process and say what
        /// the kernel does with the instruction it lands on (emulated, or
        /// single-stepped: ~30 us a hit). The same variable as `run --pid`.
        #[arg(long, value_name = "PID", env = "STALLWATCH_PID")]
        pid: Option<u32>,
    },
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    /// clap's own consistency checks (duplicate names, bad defaults).
    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    /// Every option has an environment variable, as a DaemonSet sets
    /// them; left out: positional arguments (except the config file), the
    /// generated commands' own options and one-shot `--json` switches.
    #[test]
    fn every_option_has_an_environment_variable() {
        fn walk(command: &clap::Command, path: &str, missing: &mut Vec<String>) {
            let path = format!("{path} {}", command.get_name());
            if ["stallwatch completions", "stallwatch man"].contains(&path.as_str()) {
                return;
            }
            for arg in command.get_arguments() {
                let id = arg.get_id().as_str();
                let exempt = arg.is_positional() && path != "stallwatch config check"
                    || ["help", "version", "json"].contains(&id);
                if !exempt && arg.get_env().is_none() {
                    missing.push(format!("{path} --{id}"));
                }
            }
            for sub in command.get_subcommands() {
                walk(sub, &path, missing);
            }
        }
        let mut missing = Vec::new();
        let command = Cli::command();
        for sub in command.get_subcommands() {
            walk(sub, "stallwatch", &mut missing);
        }
        for arg in command.get_arguments().filter(|a| !["help", "version"].contains(&a.get_id().as_str())) {
            assert!(arg.get_env().is_some(), "--{} has no env", arg.get_id());
        }
        assert!(missing.is_empty(), "options without an environment variable: {missing:?}");
    }
}
