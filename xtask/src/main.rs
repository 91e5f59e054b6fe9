//! Build orchestration for stallwatch: `cargo run -p xtask -- <command>`.
//!
//! Every command installs what it needs first and is idempotent: the nightly
//! `rust-src` component, `bpf-linker` built against the nightly rustc's own
//! libLLVM, and (for tests) the Python venv with NIXL and the manifest
//! checkers (promtool, kubectl).
mod setup;
mod steps;
mod tools;

use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "stallwatch build orchestration")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install the toolchain pieces: nightly rust-src, bpf-linker, and with
    /// --python the test venv.
    Setup {
        #[arg(long)]
        python: bool,
    },
    /// Build the agent (eBPF object embedded) and the demo target.
    Build,
    /// Run the agent on the bundled demo with injected stalls (needs root).
    Demo {
        /// How long the demo target runs.
        #[arg(long, default_value = "12s", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// The agent's stall timeout.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
    /// Run the whole test suite: rustfmt's and clippy's checks, unit tests
    /// and the integration tests that load the real eBPF object into this
    /// kernel (needs root).
    Test,
    /// Run the benchmarks and print their figures (needs root; installs
    /// bpftrace with apt-get when missing, to compare against).
    Bench,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Setup { python } => setup::all(python).map(drop),
        Command::Build => setup::all(false).and_then(|_| steps::build().map(drop)),
        Command::Demo { duration, timeout } => {
            setup::all(false)?;
            let built = steps::build()?;
            steps::demo(&built, duration, timeout)
        }
        Command::Test => {
            let venvs = setup::all(true)?.context("the set-up made no venvs")?;
            steps::lint()?;
            let tools = tools::ensure()?;
            let built = steps::build()?;
            steps::test(&built, &tools, &venvs)
        }
        Command::Bench => {
            let venvs = setup::all(true)?.context("the set-up made no venvs")?;
            let built = steps::build()?;
            steps::bench(&built, &venvs.sglang)
        }
    }
}
