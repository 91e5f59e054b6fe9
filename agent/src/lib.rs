//! stallwatch: catches silent request stalls in disaggregated LLM serving.
//!
//! Data flows one way through the modules, in this order:
//! [`probes`] (profiles, symbol resolution, attach) -> [`events`]
//! (ring-buffer reader, decoding) -> [`lifecycle`] (per-request state
//! machine, timer wheel, classification) -> [`export`] (alerts, summary);
//! [`query`] answers `stallwatch inflight`. [`run`] wires them together;
//! [`gate`] links the costly progress probes only near a stall;
//! [`state`] keeps what outlives an agent (pinned maps and links) for the
//! next one, in directories [`trusted_dir`] keeps out of other users'
//! reach; [`config`] reads its settings from a file ([`files`] bounds
//! what is read), [`doctor`] checks the host; [`logging`] sets up the
//! agent's own logs, [`build_info`] says which build this is; [`text`]
//! makes what a target wrote safe to print; [`warned`]
//! keeps warnings about bad input to one a period.
pub mod build_info;
pub mod config;
pub mod discovery;
pub mod doctor;
pub mod events;
pub mod export;
pub mod files;
pub mod gate;
pub mod lifecycle;
pub mod logging;
pub mod peers;
pub mod probes;
pub mod query;
mod reactor;
pub mod run;
pub mod sglang;
pub mod signals;
pub mod state;
pub mod status;
pub mod text;
pub mod tls;
pub mod transport;
pub mod trusted_dir;
pub mod warned;
pub mod workload;
pub mod zmq;
