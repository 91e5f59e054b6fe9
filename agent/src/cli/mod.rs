//! The command line: its flags ([`flags`]), the config file ([`config`]),
//! `doctor` ([`doctor`]), the agent's own logs ([`logging`]); [`main`] runs
//! the command asked for.
pub mod config;
pub mod doctor;
pub mod flags;
pub mod logging;
mod profile_check;

use std::{
    io::{ErrorKind, Write},
    process::ExitCode,
};

use anyhow::{Context as _, Result};
use clap::{CommandFactory as _, FromArgMatches as _};

use self::{
    config::ConfigFile,
    flags::{Cli, Command, ConfigCommand, ProfileCommand, StateCommand},
};
use crate::{
    kernel::state,
    profile::{self, Profile},
    query, run,
    util::text,
};

/// `stallwatch`'s `main`: parse the command line, set up logging, run the
/// command; an error is one line on stderr and a failing exit code.
pub fn main() -> ExitCode {
    // The matches too, not only the parsed flags: they say which values
    // came from the command line and which from a variable.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.format(&mut Cli::command()).exit());
    logging::init(&cli.log, cli.log_format);
    match dispatch(cli, &matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // Never `eprintln!`: it panics when stderr is gone.
            let _ = writeln!(std::io::stderr(), "stallwatch: error: {}", text::escaped(&format!("{err:#}")));
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cli: Cli, matches: &clap::ArgMatches) -> Result<()> {
    match cli.command {
        Command::Run { config, flags } => {
            let config::RunConfig {
                target,
                rules,
                timeout,
                tick,
                max_tracked,
                output,
                telemetry,
                socket,
                bpf_dir,
                on_exit,
                trust,
            } = config::resolve(config.as_deref(), flags, &origins(matches, "run"))?;
            let rules = rules.load()?;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the tokio runtime")?;
            let options = run::Options {
                target,
                rules,
                timeout,
                tick,
                max_tracked,
                format: output,
                telemetry,
                socket,
                bpf_dir,
                on_exit,
                trust,
            };
            runtime.block_on(run::run(options, std::io::stdout()))
        }
        Command::Doctor { json, bpf_dir, socket } => {
            let report = doctor::run(&bpf_dir, &socket);
            print(|out| {
                if json {
                    serde_json::to_writer_pretty(&mut *out, &report)?;
                    writeln!(out)
                } else {
                    report.write_human(out)
                }
            })?;
            if !report.ok {
                anyhow::bail!("required checks missing: {} (the fixes are above)", report.failed_required.join(", "));
            }
            Ok(())
        }
        Command::Config { command: ConfigCommand::Check { path, flags } } => {
            let origins = matches.subcommand_matches("config").map_or_else(Default::default, |m| origins(m, "check"));
            let text = ConfigFile::check(path.as_deref(), flags, &origins)?;
            print(|out| out.write_all(text.as_bytes()))
        }
        Command::Completions { shell } => {
            // Into a buffer first: clap_complete panics on a write error,
            // and a closed pipe (`| head`) must end the command quietly.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "stallwatch", &mut script);
            print(|out| out.write_all(&script))
        }
        Command::Man { dir: None } => {
            let mut page = Vec::new();
            clap_mangen::Man::new(Cli::command()).render(&mut page).context("rendering the man page")?;
            print(|out| out.write_all(&page))
        }
        Command::Man { dir: Some(dir) } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(Cli::command(), &dir)
                .with_context(|| format!("writing the man pages to {}", dir.display()))
        }
        Command::Inflight { socket, json } => {
            let (inflight, raw) = query::client::inflight(&socket, query::client::ANSWER_TIMEOUT)?;
            query::client::print(&inflight, &raw, json, std::io::BufWriter::new(std::io::stdout().lock()))
        }
        Command::State { command: StateCommand::Clear { bpf_dir } } => {
            let removed = state::clear(&bpf_dir)?;
            print(|out| {
                if removed {
                    writeln!(out, "removed {}: its probes are detached", bpf_dir.display())
                } else {
                    writeln!(out, "nothing pinned at {}", bpf_dir.display())
                }
            })
        }
        Command::Profile { command } => match command {
            ProfileCommand::List => print(|out| profile::builtin_names().try_for_each(|name| writeln!(out, "{name}"))),
            ProfileCommand::Show { name } => {
                let text = profile::builtin_text(&name).with_context(|| {
                    format!(
                        "no built-in profile `{name}`; built-ins: {}",
                        profile::builtin_names().collect::<Vec<_>>().join(", ")
                    )
                })?;
                print(|out| out.write_all(text.as_bytes()))
            }
            ProfileCommand::Check { path, pid } => {
                let path = path.to_str().context("profile path is not UTF-8")?;
                let profile = Profile::load(path)?;
                let points = pid.map(|pid| profile::plan::probe_points(&profile, pid)).transpose()?;
                let family = pid.map(|pid| profile_check::Family::read(&profile, pid));
                print(|out| {
                    profile_check::check_report(&profile, out)?;
                    points.map_or(Ok(()), |points| profile_check::points_report(&points, out))?;
                    family.map_or(Ok(()), |family| profile_check::role_report(&profile, &family, out))
                })
            }
        },
    }
}

/// Which run settings subcommand `name` of `matches` took from the command
/// line and which from their variables.
fn origins(matches: &clap::ArgMatches, name: &str) -> config::Origins {
    matches.subcommand_matches(name).map(config::Origins::of).unwrap_or_default()
}

/// Write to stdout, flushed. A reader that goes away (`| head -1`) ends
/// the command quietly: what it printed was all that was wanted.
fn print(write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match write(&mut out).and_then(|()| out.flush()) {
        Err(err) if err.kind() == ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing to stdout"),
    }
}
