//! Registering kernel file descriptors (ring buffer, log buffer, pidfd) with
//! the tokio reactor.
use std::os::fd::AsRawFd;

use anyhow::{Context as _, Result};
use tokio::io::unix::AsyncFd;

/// Wrap `inner` so its readiness can be awaited; `what` names it in errors.
pub fn register<T: AsRawFd>(inner: T, what: &str) -> Result<AsyncFd<T>> {
    let fd = inner.as_raw_fd();
    // SAFETY: every caller hands over an owned object (an aya map, logger
    // or OwnedFd) whose fd stays open and unreplaced for as long as the
    // AsyncFd owns it, which is what `register` requires.
    unsafe { AsyncFd::register(inner) }
        .map_err(std::io::Error::from)
        .with_context(|| format!("registering {what} (fd {fd}) with the reactor"))
}
