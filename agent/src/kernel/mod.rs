//! The kernel interface: the eBPF object and its slots ([`probes`]), its
//! programs verified once per build ([`programs`]), what
//! outlives an agent for the next one ([`state`]), the ring-buffer reader
//! ([`ring`]) and how a kernel record reads as an observation ([`decode`]).
//!
//! Inside, each module uses only the ones listed before it: `decode` <-
//! `state` <- `programs` <- `probes` <- `ring`; [`reactor`] registers kernel file
//! descriptors with tokio, [`caps`] says whether this process may load and
//! attach; [`uprobe_link`] links and [`detach`] unlinks probes off the
//! event loop (the kernel can take seconds at either).
pub mod caps;
pub mod decode;
pub mod detach;
pub mod probes;
mod programs;
pub mod reactor;
pub mod ring;
pub mod state;
pub mod uprobe_link;

pub use probes::{Attached, KernelCounters, ProbeHits, Probes, Releasing, Role, Slot, ebpf_object};
