//! Builds the eBPF object (crate `stallwatch-ebpf`) with the nightly
//! toolchain and bpf-linker, for `include_bytes_aligned!` in `probes::load`.
//! `cargo xtask setup` installs what this needs.
use anyhow::{Context as _, anyhow};

fn main() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR not set")?;
    let root = std::path::Path::new(&manifest_dir)
        .parent()
        .ok_or_else(|| anyhow!("agent/ has no parent directory"))?;
    let ebpf_dir = root.join("ebpf");
    let ebpf_dir = ebpf_dir.to_str().ok_or_else(|| anyhow!("non-UTF-8 path {}", ebpf_dir.display()))?;
    println!("cargo:rerun-if-changed={}", root.join("common").display());
    aya_build::build_ebpf(
        [aya_build::Package { name: "stallwatch-ebpf", root_dir: ebpf_dir, ..Default::default() }],
        aya_build::Toolchain::default(),
    )
    .context("building the eBPF object failed: run `cargo xtask setup` (nightly rust-src and bpf-linker)")
}
