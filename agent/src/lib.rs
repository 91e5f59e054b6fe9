//! stallwatch: catches silent request stalls in disaggregated LLM serving.
//!
//! Data flows one way through the modules, in this order:
//! [`probes`] (profiles, symbol resolution, attach) -> [`events`]
//! (ring-buffer reader, decoding) -> [`lifecycle`] (per-request state
//! machine, timer wheel, classification) -> [`export`] (alerts, summary).
//! [`run`] wires them together.
pub mod events;
pub mod export;
pub mod lifecycle;
pub mod probes;
mod reactor;
pub mod run;
