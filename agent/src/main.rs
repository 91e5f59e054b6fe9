//! The `stallwatch` command line.
use std::{
    io::{ErrorKind, Write},
    path::PathBuf,
    process::ExitCode,
};

use anyhow::{Context as _, Result};
use clap::{CommandFactory as _, Parser, Subcommand};
use stallwatch::{
    build_info,
    config::{self, ConfigFile},
    doctor,
    logging::{self, LogFormat},
    probes::{self, Profile, profile},
    query, run, state, text,
};

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
struct Cli {
    /// Which log lines to write (stderr): a level, or `LEVEL,TARGET=LEVEL,...`
    /// (tracing's EnvFilter syntax); a filter that does not parse is an error.
    #[arg(long, global = true, env = "STALLWATCH_LOG", value_name = "FILTER", default_value = logging::DEFAULT_FILTER,
          value_parser = logging::parse_filter)]
    log: String,
    /// Log line format.
    #[arg(long, global = true, env = "STALLWATCH_LOG_FORMAT", value_enum, value_name = "FORMAT", default_value_t)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Watch a process: attach a probe profile and alert on every request
    /// silent past the timeout, while it is still stuck.
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
enum StateCommand {
    /// Detach the probes and drop the in-flight state pinned in the bpf
    /// directory (refused while an agent uses it).
    Clear {
        /// The agent's `run --bpf-dir`.
        #[arg(long, value_name = "PATH", env = "STALLWATCH_BPF_DIR", default_value = state::DEFAULT_BPF_DIR)]
        bpf_dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
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
enum ProfileCommand {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init(&cli.log, cli.log_format);
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // Never `eprintln!`: it panics when stderr is gone.
            let _ = writeln!(std::io::stderr(), "stallwatch: error: {}", text::escaped(&format!("{err:#}")));
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run { config, flags } => {
            let config::RunConfig {
                target,
                profile,
                timeout,
                tick,
                max_tracked,
                output,
                telemetry,
                socket,
                bpf_dir,
                on_exit,
            } = config::resolve(config.as_deref(), flags)?;
            let profile = Profile::load(&profile)?;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the tokio runtime")?;
            let options = run::Options {
                target,
                profile,
                timeout,
                tick,
                max_tracked,
                format: output,
                telemetry,
                socket,
                bpf_dir,
                on_exit,
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
            let text = ConfigFile::check(path.as_deref(), flags)?;
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
                let points = pid.map(|pid| probes::resolve::probe_points(&profile, pid)).transpose()?;
                print(|out| {
                    check_report(&profile, out)?;
                    points.map_or(Ok(()), |points| points_report(&points, out))
                })
            }
        },
    }
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

/// `stallwatch profile check --pid`: where each probe lands in the process.
fn points_report(points: &[probes::resolve::ProbePoint], out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "in the process:")?;
    for point in points {
        let symbol = text::escaped(&point.symbol);
        match &point.found {
            Ok((path, resolved)) => writeln!(
                out,
                "  line {:>3}: {} at {}+{:#x}{}: {}",
                point.line,
                symbol,
                text::escaped(&path.display().to_string()),
                resolved.file_offset,
                if resolved.skipped > 0 { " (after its endbr64)" } else { "" },
                resolved.first_insn
            )?,
            Err(why) => writeln!(out, "  line {:>3}: {symbol}: not attachable: {}", point.line, text::escaped(why))?,
        }
    }
    Ok(())
}

/// `stallwatch profile check`: what each probe of a valid profile attaches
/// to. Names, symbols and paths come from a file anyone may have written:
/// printed escaped, so none can break a line or reach the terminal as a
/// control sequence.
fn check_report(profile: &Profile, out: &mut dyn Write) -> std::io::Result<()> {
    use text::escaped;
    writeln!(out, "profile {}: ok", escaped(&profile.name))?;
    if let Some(base) = &profile.extends {
        writeln!(out, "  extends {}", escaped(base))?;
    }
    // What a profile inherits names the file it comes from.
    let from =
        |origin: &str| if origin == profile.origin { String::new() } else { format!(" (from {})", escaped(origin)) };
    for probe in &profile.probes {
        let events = match &probe.action {
            profile::Action::Always(stage) => stage.to_string(),
            profile::Action::OnReturn(rules) => {
                rules.iter().map(|(_, stage)| stage.to_string()).collect::<Vec<_>>().join(" | ")
            }
        };
        writeln!(
            out,
            "  line {:>3}: {events:<30} {:?} of `{}` in {}{}",
            probe.line,
            probe.at,
            escaped(&probe.symbol),
            escaped(probe.object.as_deref().unwrap_or("the executable")),
            from(&probe.origin)
        )?;
    }
    if let Some(status) = &profile.status {
        let stages = status.rules.iter().map(|(_, stage)| stage.to_string()).collect::<Vec<_>>().join(" | ");
        writeln!(
            out,
            "  line {:>3}: {stages:<30} read from the target's memory, key {}{:+}, when a stall is due{}",
            status.line,
            status.at.deref.iter().map(|offset| format!("->[{offset:+}]")).collect::<String>(),
            status.at.add,
            from(&status.origin)
        )?;
    }
    for signal in &profile.signals {
        writeln!(
            out,
            "  line {:>3}: {:<30} {:?} of `{}` in {}{}{}",
            signal.line,
            format!("signal {}", escaped(&signal.name)),
            signal.at,
            escaped(&signal.symbol),
            escaped(signal.object.as_deref().unwrap_or("the executable")),
            signal
                .msgpack
                .as_ref()
                .map(|m| format!(", msgpack element {} of `{}`", m.element, escaped(&m.tag)))
                .unwrap_or_default(),
            from(&signal.origin)
        )?;
    }
    for activity in &profile.activity {
        writeln!(
            out,
            "  line {:>3}: {:<30} Entry of `{}` in {}{}{}",
            activity.line,
            format!("transport {}", activity.kind.as_str()),
            escaped(&activity.symbol),
            escaped(activity.object.as_deref().unwrap_or("the executable")),
            if activity.optional { " (optional)" } else { "" },
            from(&activity.origin)
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
