//! Building, and the commands that run what was built.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use crate::{
    setup::Venvs,
    shell::{root, run},
    tools::Tools,
    venvs,
};

/// What `build` produced.
pub struct Built {
    pub agent: PathBuf,
    pub demo: PathBuf,
    /// libstallwatch_marker.so, the marker library the `marker` profile probes.
    pub marker: PathBuf,
}

/// The agent in release mode (its build script compiles and embeds the
/// eBPF object), and the demo target with frame pointers, in a target
/// directory of its own so its flags never invalidate the main build; and
/// the marker library.
pub fn build() -> Result<Built> {
    let root = root()?;
    run(Command::new("cargo").current_dir(&root).args(["build", "--release", "-p", "stallwatch", "--bins"]))?;
    run(Command::new("cargo").current_dir(&root).args(["build", "--release", "-p", "stallwatch-marker"]))?;
    let demo_target = root.join("target/demo");
    run(Command::new("cargo")
        .current_dir(&root)
        .args(["build", "--release", "-p", "demo-prefill", "--target-dir"])
        .arg(&demo_target)
        .env("RUSTFLAGS", "-C force-frame-pointers=yes"))?;
    Ok(Built {
        agent: root.join("target/release/stallwatch"),
        demo: demo_target.join("release/demo-prefill"),
        marker: root.join("target/release/libstallwatch_marker.so"),
    })
}

fn require_root(what: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("{what} loads eBPF programs into the kernel and needs root: run it with sudo (or as root)");
    }
    Ok(())
}

/// The README's first command: the demo with one request pinned at each
/// stall point and one that recovers, watched live by the agent.
pub fn demo(built: &Built, duration: Duration, timeout: Duration) -> Result<()> {
    require_root("the demo")?;
    let duration_arg = humantime::format_duration(duration).to_string();
    let mut demo = Command::new(&built.demo)
        .args(["--wait-for-go", "--rate", "1000", "--inject-after", "1s", "--duration", &duration_arg])
        .args(["--waiting-for-peer", "1", "--transfer-hung", "1", "--release-lost", "1", "--recover", "1"])
        .args(["--recover-after", &humantime::format_duration(timeout * 2).to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", built.demo.display()))?;
    let mut demo_out = BufReader::new(demo.stdout.take().context("demo stdout")?).lines();
    let ready = demo_out.next().context("the demo exited before it was ready")??;
    let pid = serde_json::from_str::<serde_json::Value>(&ready)
        .ok()
        .and_then(|value| value["pid"].as_u64())
        .with_context(|| format!("unexpected first line from the demo: {ready}"))?;
    eprintln!("xtask: demo prefill server is pid {pid}; starting the agent");
    let mut agent = Command::new(&built.agent)
        .args(["run", "--pid", &pid.to_string(), "--profile", "demo"])
        .args(["--timeout", &humantime::format_duration(timeout).to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", built.agent.display()))?;
    let agent_err = BufReader::new(agent.stderr.take().context("agent stderr")?);
    let mut demo_in = demo.stdin.take().context("demo stdin")?;
    let mut lines = agent_err.lines();
    for line in lines.by_ref() {
        let line = line?;
        eprintln!("{line}");
        if line.contains("watching") {
            writeln!(demo_in, "go")?;
            break;
        }
    }
    let narrate = std::thread::spawn(move || {
        for line in demo_out.map_while(Result::ok) {
            eprintln!("demo: {line}");
        }
    });
    for line in lines.map_while(Result::ok) {
        eprintln!("{line}");
    }
    let status = agent.wait()?;
    let _ = demo.kill();
    let _ = demo.wait();
    let _ = narrate.join();
    if !status.success() {
        bail!("the agent failed with {status}");
    }
    Ok(())
}

/// Unit tests, the integration tests (which find the built binaries
/// through the environment), and every benchmark's smoke version (a
/// benchmark run without `--bench`), so a benchmark that no longer works
/// fails here, not when someone next wants its figures.
/// Every target runs even after one fails (`--no-fail-fast`), so a CI run
/// reports every failure at once.
pub fn test(built: &Built, tools: &Tools, made: &Venvs) -> Result<()> {
    let root = root()?;
    run(Command::new("cargo")
        .current_dir(&root)
        .args([
            "test",
            "--release",
            "--workspace",
            "--exclude",
            "stallwatch-ebpf",
            "--all-targets",
            "--no-fail-fast",
            "--",
            "--test-threads=1",
        ])
        .env("STALLWATCH_BIN", &built.agent)
        .env("STALLWATCH_DEMO", &built.demo)
        .env("STALLWATCH_MARKER", &built.marker)
        .env(venvs::VENV_VARIABLE, root.join(venvs::VENV))
        .env(venvs::SGLANG.variable, &made.sglang)
        .env(venvs::VLLM.variable, &made.vllm)
        .env(venvs::PHOENIX.variable, &made.phoenix)
        .env("STALLWATCH_PROMTOOL", &tools.promtool)
        .env("STALLWATCH_KUBECTL", &tools.kubectl)
        .env("STALLWATCH_DEBIAN_KUBECTL", &tools.debian_kubectl)
        .env("STALLWATCH_HELM", &tools.helm))
}

/// The habits CI holds the code to, before any test runs: rustfmt's check
/// and clippy with warnings denied, on the host crates with the stable
/// toolchain and on the eBPF crate with the nightly it is built with, and
/// rustdoc's link checks.
pub fn lint() -> Result<()> {
    let root = root()?;
    let cargo = |args: &[&str]| run(Command::new("cargo").current_dir(&root).args(args));
    cargo(&["fmt", "--all", "--check"]).context("the code is not formatted: run `cargo fmt --all`")?;
    let deny = ["--", "-D", "warnings"];
    let host = ["clippy", "--release", "--workspace", "--exclude", "stallwatch-ebpf", "--all-targets"];
    cargo(&[&host[..], &deny].concat()).context("clippy found warnings in the host crates (listed above)")?;
    // The eBPF crate's own target directory: its nightly, bpf-target
    // metadata would otherwise rebuild the host crates' dependencies.
    let ebpf = ["+nightly", "clippy", "-p", "stallwatch-ebpf", "--release", "--target", "bpfel-unknown-none"];
    let ebpf = [&ebpf[..], &["-Z", "build-std=core", "--target-dir", "target/ebpf-clippy"], &deny].concat();
    cargo(&ebpf).context("clippy found warnings in the eBPF crate (listed above)")?;
    // Doc links are checked too: a renamed item leaves a link that points
    // nowhere, which neither the compiler nor clippy reports.
    run(Command::new("cargo")
        .current_dir(&root)
        .args(["doc", "--no-deps", "--workspace", "--exclude", "stallwatch-ebpf", "--document-private-items"])
        .env("RUSTDOCFLAGS", "-D warnings"))
    .context("rustdoc found broken doc links or other doc warnings (listed above)")
}

/// Every benchmark, against this build. The uprobe and NIXL benches put
/// stallwatch beside Debian's bpftrace, installed here when missing.
pub fn bench(built: &Built, sglang_venv: &Path) -> Result<()> {
    require_root("the uprobe benchmark")?;
    install_bpftrace()?;
    let root = root()?;
    run(Command::new("cargo")
        .current_dir(&root)
        .args(["bench", "-p", "stallwatch"])
        .env("STALLWATCH_BIN", &built.agent)
        .env("STALLWATCH_DEMO", &built.demo)
        .env(venvs::VENV_VARIABLE, root.join(venvs::VENV))
        .env(venvs::SGLANG.variable, sglang_venv))
}

/// `apt-get install -y bpftrace` unless it runs already.
fn install_bpftrace() -> Result<()> {
    let runs = |command: &mut Command| command.output().is_ok_and(|out| out.status.success());
    if runs(Command::new("bpftrace").arg("--version")) {
        return Ok(());
    }
    eprintln!("xtask: bpftrace is missing; installing it with apt-get (the benchmarks compare against it)");
    let installed =
        run(Command::new("apt-get").args(["install", "-y", "bpftrace"]).env("DEBIAN_FRONTEND", "noninteractive"));
    if let Err(err) = installed {
        bail!(
            "could not install bpftrace ({err:#}): run `apt-get update && apt-get install -y bpftrace` \
             (Debian/Ubuntu), or install bpftrace 0.17 or newer by other means, then run the benchmarks again"
        );
    }
    if !runs(Command::new("bpftrace").arg("--version")) {
        bail!("apt-get installed bpftrace, but `bpftrace --version` fails: check the install");
    }
    Ok(())
}
