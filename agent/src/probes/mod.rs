//! Probe profiles and attaching them to a process.

/// The eBPF object built by `build.rs`.
pub fn ebpf_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/stallwatch"))
}
