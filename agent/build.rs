//! Builds the eBPF object (crate `stallwatch-ebpf`) with the nightly
//! toolchain and bpf-linker, for `include_bytes_aligned!` in `probes::load`.
//! `cargo xtask setup` installs what this needs.
//!
//! It also records what `stallwatch --version` and `stallwatch_build_info`
//! say of the build (git commit, rustc, target), through `vergen-gitcl`: an
//! operator reading an alert from a fleet needs to know which build sent
//! it, and a checkout without git (a Docker context without `.git`) still
//! builds, with those fields `VERGEN_IDEMPOTENT_OUTPUT`.
//!
//! The eBPF object is built by a cargo of its own (aya-build), which sees
//! none of the flags the outer cargo was given: a `cargo build --offline`
//! (or `--frozen`) is passed on to it as `CARGO_NET_OFFLINE=true`, so a
//! machine without the network builds from what is cached instead of
//! failing in the eBPF sub-build (whose `-Z build-std` would fetch).
use anyhow::{Context as _, anyhow};
use vergen_gitcl::{Emitter, GitclBuilder, RustcBuilder};

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=CARGO_NET_OFFLINE");
    if std::env::var_os("CARGO_NET_OFFLINE").is_none() && outer_cargo_offline() {
        println!("cargo:warning=cargo runs offline: the eBPF object is built offline too (CARGO_NET_OFFLINE=true)");
        // SAFETY: first thing in main, before anything could start a thread.
        unsafe { std::env::set_var("CARGO_NET_OFFLINE", "true") };
    }
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

/// Whether the cargo running this build script was given `--offline` or
/// `--frozen`. Cargo tells a build script neither, but it is this
/// process's parent, and Linux (the only target: uprobes) shows its
/// command line.
fn outer_cargo_offline() -> bool {
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", std::os::unix::process::parent_id())).unwrap_or_default();
    cmdline.split(|&b| b == 0).any(|arg| arg == b"--offline" || arg == b"--frozen")
}
