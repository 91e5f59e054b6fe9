//! Build orchestration for stallwatch: `cargo run -p xtask -- <command>`.
//!
//! Every command installs what it needs first and is idempotent: the nightly
//! `rust-src` component, `bpf-linker` built against the nightly rustc's own
//! libLLVM, and (for tests) the Python venv with NIXL and the manifest
//! checkers (promtool, kubectl).
//!
//! Inside, the modules use each other one way only: `steps` (build, run,
//! test) uses `setup` (toolchain, venvs) and `tools` (manifest checkers),
//! which use `venvs` (where the venvs are) and `shell` (running a command).
mod setup;
mod shell;
mod steps;
mod tools;
#[allow(dead_code, reason = "`CachedVenv::find` and `venv_dir` are for tests/support, which includes the file")]
mod venvs;

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow};
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
        Command::Setup { python } => {
            setup::rust()?;
            if python {
                setup::python()?;
            }
            Ok(())
        }
        Command::Build => setup::rust().and_then(|()| steps::build().map(drop)),
        Command::Demo { duration, timeout } => {
            setup::rust()?;
            let built = steps::build()?;
            steps::demo(&built, duration, timeout)
        }
        Command::Test => {
            let python = in_background("the Python venvs and the manifest tools", || {
                let venvs = setup::python()?;
                Ok((venvs, tools::ensure()?))
            });
            setup::rust()?;
            steps::lint()?;
            let built = steps::build()?;
            let (venvs, tools) = python()?;
            steps::test(&built, &tools, &venvs)
        }
        Command::Bench => {
            let python = in_background("the Python venvs", setup::python);
            setup::rust()?;
            let built = steps::build()?;
            steps::bench(&built, &python()?.sglang)
        }
    }
}

/// Runs `work` on a thread of its own while the caller goes on to compile,
/// and returns what waits for it. The Python set-up is downloads and
/// unpacking (network and disk: several GB of wheels on a fresh machine)
/// and the Rust side is compiling (CPU), so the two overlap instead of
/// adding up. Every apt-get call stays on the one thread (`work`), so two
/// never wait on dpkg's lock. The wait says how long the compile side
/// waited, which a CI log then shows.
fn in_background<T: Send + 'static>(
    what: &'static str,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> impl FnOnce() -> Result<T> {
    let started = Instant::now();
    let worker = std::thread::spawn(move || {
        let result = work();
        eprintln!("xtask: {what} ready after {:.0?}", started.elapsed());
        result
    });
    move || {
        let waiting = Instant::now();
        let result = worker.join().map_err(|_| anyhow!("setting up {what}: its thread panicked"))?;
        eprintln!("xtask: waited {:.0?} for {what}", waiting.elapsed());
        result.with_context(|| format!("setting up {what}"))
    }
}
