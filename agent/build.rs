//! Builds the eBPF object (crate `stallwatch-ebpf`) with the nightly
//! toolchain and bpf-linker, for `include_bytes_aligned!` in `probes::load`.
//! `cargo xtask setup` installs what this needs.
//!
//! It also records what `stallwatch --version` and `stallwatch_build_info`
//! say of the build (git commit, rustc, target), through `vergen-gitcl`: an
//! operator reading an alert from a fleet needs to know which build sent
//! it, and a checkout without git (a Docker context without `.git`) still
//! builds, with those fields `VERGEN_IDEMPOTENT_OUTPUT`.
use anyhow::{Context as _, anyhow};
use vergen_gitcl::{Emitter, GitclBuilder, RustcBuilder};

fn main() -> anyhow::Result<()> {
    Emitter::default()
        .add_instructions(&GitclBuilder::default().sha(true).dirty(true).build()?)?
        .add_instructions(&RustcBuilder::default().semver(true).build()?)?
        .emit()
        .context("recording the build info (vergen)")?;
    // The target triple cargo gives every build script (vergen's `cargo`
    // feature would bring cargo_metadata for this one value).
    println!("cargo:rustc-env=STALLWATCH_TARGET={}", std::env::var("TARGET").context("TARGET not set")?);
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR not set")?;
    let root = std::path::Path::new(&manifest_dir).parent().ok_or_else(|| anyhow!("agent/ has no parent directory"))?;
    let ebpf_dir = root.join("ebpf");
    let ebpf_dir = ebpf_dir.to_str().ok_or_else(|| anyhow!("non-UTF-8 path {}", ebpf_dir.display()))?;
    println!("cargo:rerun-if-changed={}", root.join("common").display());
    aya_build::build_ebpf(
        [aya_build::Package { name: "stallwatch-ebpf", root_dir: ebpf_dir, ..Default::default() }],
        aya_build::Toolchain::default(),
    )
    .context("building the eBPF object failed: run `cargo xtask setup` (nightly rust-src and bpf-linker)")
}
