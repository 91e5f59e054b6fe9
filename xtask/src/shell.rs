//! Running commands from the workspace root: the leaf every other xtask
//! module uses (and none of them uses another to run a command).
use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, Result, bail};

/// The workspace root (xtask lives one level below it).
pub fn root() -> Result<PathBuf> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).context("xtask has no parent directory")
}

/// Run `command`, said on stderr first; its failure is an error.
pub fn run(command: &mut Command) -> Result<()> {
    eprintln!("xtask: running {command:?}");
    let status = command.status().with_context(|| format!("starting {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed with {status}");
    }
    Ok(())
}

/// Run `command` for its stdout; its failure is an error with its stderr.
pub fn output(command: &mut Command) -> Result<String> {
    let out = command.output().with_context(|| format!("running {command:?}"))?;
    if !out.status.success() {
        bail!("{command:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
