//! stallwatch: catches silent request stalls in disaggregated LLM serving.
//!
//! One folder per layer, in the order data moves (docs/design.md draws it);
//! a layer uses the ones below it, never one above:
//!
//! - [`cli`]: the command line, the config file, `doctor`, the agent's logs.
//! - [`run`]: `stallwatch run`: the session, the process table and the
//!   event loop that wires every layer below together.
//! - [`query`]: `stallwatch inflight`, answered over a unix socket.
//! - [`export`]: what leaves the agent: alert lines, the summary, OTLP spans,
//!   metrics, and the identity of the workload each watched process is.
//! - [`frameworks`]: what follows a serving framework's own protocol
//!   (signals in, room observations and context out), one folder each.
//! - [`evidence`]: what is read when a stall comes due: the target's memory,
//!   transport counters, each transfer's peer, and the progress-probe gate.
//! - [`kernel`]: the eBPF object, slots and attach, the pinned tables a
//!   restarted agent takes over, the ring-buffer reader.
//! - [`profile`]: probe profiles: schema, validation, built-ins, symbol
//!   resolution.
//! - [`lifecycle`]: the pure engine: per-request state machine, timer wheel,
//!   classification.
//! - [`util`]: small helpers every layer may use.
pub mod cli;
pub mod evidence;
pub mod export;
pub mod frameworks;
pub mod kernel;
pub mod lifecycle;
pub mod profile;
pub mod query;
pub mod run;
pub mod util;
