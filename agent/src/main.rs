//! The `stallwatch` command line.
use std::{
    io::{ErrorKind, Write},
    path::PathBuf,
    process::ExitCode,
};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use stallwatch::{
    config::{self, ConfigFile},
    doctor,
    probes::{Profile, profile},
    query, run, state, text,
};
use tracing_subscriber::{field::MakeExt as _, fmt::format::debug_fn};

#[derive(Parser)]
#[command(version, about = "Catches silent request stalls in disaggregated LLM serving, from outside the process")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
#[expect(clippy::large_enum_variant, reason = "parsed once per process; boxing buys nothing")]
enum Command {
    /// Watch a process: attach a probe profile and alert on every request
    /// silent past the timeout, while it is still stuck.
    Run {
        /// Settings from this TOML file (see the README); a flag given here
        /// wins over the file.
        #[arg(long, value_name = "FILE")]
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
        #[arg(long, value_name = "PATH", default_value = state::DEFAULT_BPF_DIR)]
        bpf_dir: PathBuf,
        /// The socket `run` would serve: is its directory safe from other users?
        #[arg(long, value_name = "PATH", default_value = query::DEFAULT_SOCKET)]
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
        #[arg(long, value_name = "PATH", default_value = query::DEFAULT_SOCKET)]
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
}

#[derive(Subcommand)]
enum StateCommand {
    /// Detach the probes and drop the in-flight state pinned in the bpf
    /// directory (refused while an agent uses it).
    Clear {
        /// The agent's `run --bpf-dir`.
        #[arg(long, value_name = "PATH", default_value = state::DEFAULT_BPF_DIR)]
        bpf_dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Validate a config file and print the settings `run` would use.
    Check { path: PathBuf },
}

#[derive(Subcommand)]
enum ProfileCommand {
    /// List the built-in profiles.
    List,
    /// Print a built-in profile's TOML (a starting point for your own).
    Show { name: String },
    /// Validate a profile file and print what it attaches to.
    Check { path: PathBuf },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STALLWATCH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // A stderr gone (its reader exited, a closed fd) loses the logs,
        // not the agent: tracing's own report of a failed write is an
        // `eprintln!`, which panics on that same stderr.
        .log_internal_errors(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // Logs carry what targets wrote (names, paths, symbols): no field
        // or message may break a line or reach the terminal as a sequence.
        .fmt_fields(
            debug_fn(|writer, field, value| match field.name() {
                "message" => write!(writer, "{}", text::escaped(&format!("{value:?}"))),
                name if name.starts_with("log.") => Ok(()),
                name => write!(writer, "{name}={}", text::escaped(&format!("{value:?}"))),
            })
            .delimited(" "),
        )
        .init();
    match dispatch(Cli::parse()) {
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
        Command::Config { command: ConfigCommand::Check { path } } => {
            let text = ConfigFile::check(&path)?;
            print(|out| out.write_all(text.as_bytes()))
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
            ProfileCommand::Check { path } => {
                let path = path.to_str().context("profile path is not UTF-8")?;
                let profile = Profile::load(path)?;
                print(|out| check_report(&profile, out))
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
    let from = |origin: &str| if origin == profile.origin { String::new() } else { format!(" (from {})", escaped(origin)) };
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
