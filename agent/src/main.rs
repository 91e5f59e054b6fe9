//! The `stallwatch` command line.
use std::{path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use stallwatch::{
    export::alert::Format,
    probes::{Profile, profile},
    run,
};

#[derive(Parser)]
#[command(version, about = "Catches silent request stalls in disaggregated LLM serving, from outside the process")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Watch a process: attach a probe profile and alert on every request
    /// silent past the timeout, while it is still stuck.
    Run {
        /// The process to watch (the prefill server).
        #[arg(long)]
        pid: u32,
        /// A built-in profile name (see `stallwatch profile list`) or the
        /// path of a profile TOML file.
        #[arg(long)]
        profile: String,
        /// How long a request may stay silent before it is reported stalled.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Resolution of the stall timer.
        #[arg(long, default_value = "10ms", value_parser = humantime::parse_duration)]
        tick: Duration,
        /// Most requests tracked at once; beyond it the stalest is evicted
        /// (and reported).
        #[arg(long, default_value_t = 1_000_000)]
        max_tracked: usize,
        /// Alert line format on stdout.
        #[arg(long, value_enum, default_value_t = Format::Human)]
        output: Format,
    },
    /// Built-in probe profiles.
    Profile {
        #[command(subcommand)]
        command: ProfileCommand,
    },
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
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match dispatch(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("stallwatch: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run { pid, profile, timeout, tick, max_tracked, output } => {
            let profile = Profile::load(&profile)?;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the tokio runtime")?;
            let options = run::Options { pid, profile, timeout, tick, max_tracked, format: output };
            runtime.block_on(run::run(options, std::io::stdout().lock()))
        }
        Command::Profile { command } => match command {
            ProfileCommand::List => {
                for name in profile::builtin_names() {
                    println!("{name}");
                }
                Ok(())
            }
            ProfileCommand::Show { name } => {
                let text = profile::builtin_text(&name).with_context(|| {
                    format!(
                        "no built-in profile `{name}`; built-ins: {}",
                        profile::builtin_names().collect::<Vec<_>>().join(", ")
                    )
                })?;
                print!("{text}");
                Ok(())
            }
            ProfileCommand::Check { path } => {
                let path = path.to_str().context("profile path is not UTF-8")?;
                let profile = Profile::load(path)?;
                for probe in &profile.probes {
                    println!(
                        "line {:>3}: {} {:?} of `{}`",
                        probe.line,
                        probe.object.as_deref().unwrap_or("<executable>"),
                        probe.at,
                        probe.symbol
                    );
                }
                Ok(())
            }
        },
    }
}
