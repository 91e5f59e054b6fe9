//! What the CLI asks a running agent: `stallwatch inflight`.
//!
//! `stallwatch run` serves a unix socket ([`DEFAULT_SOCKET`], or
//! `--socket PATH`) in a directory no other user can change (refused
//! otherwise, by the agent and by the client), the socket itself mode 0600.
//! A client connects, sends one query line and reads one answer line
//! ([`wire`] has the format); the agent answers from its lifecycle engine
//! ([`server`]) and `stallwatch inflight` prints it ([`client`]).
pub mod client;
pub mod server;
pub mod wire;

pub use server::{QueryServer, SocketPlace, socket_dir};

/// Where `stallwatch run` serves queries unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/stallwatch/stallwatch.sock";
