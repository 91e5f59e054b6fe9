//! The signals that stop the agent, installed before anything else.
//!
//! Every signal whose default action ends a process ends the agent the way
//! SIGTERM does: the summary, and the state left for the next agent as
//! `--on-exit` says. Without a handler SIGHUP (a closed terminal), SIGQUIT
//! or SIGUSR1 (a stray `kill -USR1` meant for another daemon) killed it on
//! the spot, with no summary and its probes left to the next agent's
//! take-over. The faults (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) stay
//! fatal: after one nothing the agent holds can be trusted.
use std::future::Future;

use anyhow::{Context as _, Result};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tracing::info;

/// The signals that end the agent as SIGTERM does, with their names.
const STOPPING: &[(&str, i32)] = &[
    ("SIGTERM", libc::SIGTERM),
    ("SIGINT", libc::SIGINT),
    ("SIGHUP", libc::SIGHUP),
    ("SIGQUIT", libc::SIGQUIT),
    ("SIGUSR1", libc::SIGUSR1),
    ("SIGUSR2", libc::SIGUSR2),
    ("SIGALRM", libc::SIGALRM),
    ("SIGVTALRM", libc::SIGVTALRM),
    ("SIGPROF", libc::SIGPROF),
    ("SIGIO", libc::SIGIO),
    ("SIGPWR", libc::SIGPWR),
    ("SIGXCPU", libc::SIGXCPU),
    ("SIGXFSZ", libc::SIGXFSZ),
    ("SIGSTKFLT", libc::SIGSTKFLT),
];

/// The stop signals' streams. A stop asked for during start-up is taken
/// at once ([`Stops::unless_stopped`]), never the default death that
/// leaves no summary.
pub struct Stops {
    signals: Vec<(&'static str, Signal)>,
}

impl Stops {
    pub fn install() -> Result<Self> {
        let signals = STOPPING
            .iter()
            .map(|&(name, number)| {
                signal(SignalKind::from_raw(number))
                    .map(|stream| (name, stream))
                    .with_context(|| format!("installing the {name} handler"))
            })
            .collect::<Result<_>>()?;
        Ok(Self { signals })
    }

    /// The next stop signal's name.
    pub async fn next(&mut self) -> &'static str {
        std::future::poll_fn(|cx| {
            for (name, signal) in &mut self.signals {
                if signal.poll_recv(cx).is_ready() {
                    return std::task::Poll::Ready(*name);
                }
            }
            std::task::Poll::Pending
        })
        .await
    }

    /// `work`, unless a stop signal comes first: then `None`, logged as a
    /// stop during `what`.
    pub async fn unless_stopped<T>(&mut self, what: &str, work: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            done = work => Some(done),
            signal = self.next() => {
                info!(signal, "stopped while {what}");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_signal_that_ends_a_process_by_default_is_a_stop_but_the_faults() {
        // signal(7): the signals whose default action is Term or Core,
        // less the faults and the two that cannot be caught.
        let mut numbers: Vec<i32> = STOPPING.iter().map(|&(_, n)| n).collect();
        numbers.sort_unstable();
        numbers.dedup();
        assert_eq!(numbers.len(), STOPPING.len(), "each signal once");
        for fault in [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE, libc::SIGABRT, libc::SIGKILL] {
            assert!(!numbers.contains(&fault));
        }
        for stop in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT, libc::SIGUSR1, libc::SIGUSR2] {
            assert!(numbers.contains(&stop));
        }
    }

    #[test]
    fn a_signal_during_work_stops_it() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        runtime.block_on(async {
            let mut stops = Stops::install().expect("install");
            // SAFETY: raise sends a signal to this thread; the handler above
            // takes it.
            unsafe { libc::raise(libc::SIGUSR2) };
            let stopped = stops.unless_stopped("waiting", std::future::pending::<()>()).await;
            assert!(stopped.is_none());
        });
    }
}
