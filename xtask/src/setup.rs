//! Toolchain set-up, each step checked before it is done.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::steps::{root, run};

/// The bpf-linker release this project is built and tested with.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// The venvs outside the repository the tests are told of.
pub struct Venvs {
    pub sglang: PathBuf,
    pub phoenix: PathBuf,
}

/// Everything the build needs, and with `python` the three venvs; returns
/// the paths of the two outside the repository then (tests and benches are
/// told them).
pub fn all(python: bool) -> Result<Option<Venvs>> {
    rust_src()?;
    bpf_linker()?;
    if !python {
        return Ok(None);
    }
    venv()?;
    Ok(Some(Venvs { sglang: sglang_venv()?, phoenix: phoenix_venv()? }))
}

/// `rust-src` for the nightly toolchain: `-Z build-std=core` needs it.
fn rust_src() -> Result<()> {
    let installed = output(Command::new("rustup").args(["component", "list", "--toolchain", "nightly", "--installed"]))
        .context("listing the nightly toolchain's components: is the `nightly` toolchain installed (`rustup toolchain list`)?")?;
    if installed.lines().any(|line| line.starts_with("rust-src")) {
        return Ok(());
    }
    run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))
}

/// bpf-linker, built against the nightly rustc's own libLLVM (no system
/// LLVM needed): a prefix with `lib/libLLVM.so` pointing at the toolchain's
/// library and a stand-in `bin/llvm-config` is all its build checks.
fn bpf_linker() -> Result<()> {
    if Command::new("bpf-linker").arg("--version").output().is_ok_and(|out| out.status.success()) {
        return Ok(());
    }
    let sysroot = output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
    let lib_dir = Path::new(sysroot.trim()).join("lib");
    let libllvm = fs::read_dir(&lib_dir)
        .with_context(|| format!("reading {}", lib_dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libLLVM.so.")))
        .with_context(|| {
            format!("no libLLVM.so.* in {}: the nightly toolchain lacks its LLVM library", lib_dir.display())
        })?;
    let soname = libllvm.file_name().and_then(|n| n.to_str()).context("libLLVM file name is not UTF-8")?;
    // "libLLVM.so.22.1-rust-1.97.0-nightly" -> 22
    let major = soname
        .trim_start_matches("libLLVM.so.")
        .split(['.', '-'])
        .next()
        .filter(|major| major.parse::<u32>().is_ok())
        .with_context(|| format!("cannot read the LLVM major version from {soname}"))?;
    let prefix = cache_dir()?.join("llvm-prefix");
    let prefix_lib = prefix.join("lib");
    let prefix_bin = prefix.join("bin");
    fs::create_dir_all(&prefix_lib)?;
    fs::create_dir_all(&prefix_bin)?;
    // The soname link lets bpf-linker find libLLVM outside `rustup run` too.
    for name in ["libLLVM.so", soname] {
        let link = prefix_lib.join(name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link).with_context(|| format!("linking {}", link.display()))?;
    }
    let llvm_config = prefix_bin.join("llvm-config");
    fs::write(&llvm_config, format!("#!/bin/sh\necho {major}.1.0\n"))?;
    fs::set_permissions(&llvm_config, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    run(Command::new("cargo")
        .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION, "--locked", "--no-default-features"])
        .args(["--features", &format!("llvm-{major}")])
        .env("LLVM_PREFIX", &prefix))
}

/// The Python venv for the NIXL driver and the OTLP collector, in
/// `target/venv`; reinstalled only when the requirement files change.
fn venv() -> Result<()> {
    let root = root()?;
    let venv = root.join("target/venv");
    let nodeps = root.join("tests/nixl/requirements-nodeps.txt");
    let deps = root.join("tests/nixl/requirements.txt");
    let wanted = format!("{}\n--\n{}", fs::read_to_string(&nodeps)?, fs::read_to_string(&deps)?);
    let stamp = venv.join(".stallwatch-requirements");
    if fs::read_to_string(&stamp).is_ok_and(|have| have == wanted) {
        return Ok(());
    }
    run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    let pip = venv.join("bin/pip");
    // nixl-cu12's metadata asks for torch, which it never imports.
    run(Command::new(&pip).args(["install", "--quiet", "--no-deps", "-r"]).arg(&nodeps))?;
    run(Command::new(&pip).args(["install", "--quiet", "-r"]).arg(&deps))?;
    fs::write(&stamp, wanted)?;
    Ok(())
}

/// The venv for the SGLang target on real code (tests/sglang/real/): SGLang
/// 0.5.23 and torch 2.14.1 from their wheels, both NIXL builds, pyzmq. About
/// 6 GB (torch's CUDA libraries), so it lives outside the repo, in
/// `~/.cache/stallwatch/venv-sglang-<hash of the requirement files>`, where a
/// fresh clone on the same machine finds it; made once per content of
/// `tests/sglang/requirements{-nodeps,}.txt`. The stamp is written last, so
/// an interrupted install is redone from scratch.
fn sglang_venv() -> Result<PathBuf> {
    let root = root()?;
    let nodeps = root.join("tests/sglang/requirements-nodeps.txt");
    let deps = root.join("tests/sglang/requirements.txt");
    let wanted = format!("{}\n--\n{}", fs::read_to_string(&nodeps)?, fs::read_to_string(&deps)?);
    let cache = cache_dir()?;
    let venv = cache.join(format!("venv-sglang-{}", sglang_venv_hash(&wanted)));
    let stamp = venv.join(".stallwatch-requirements");
    // Where tests and benches run by hand (without the xtask's
    // STALLWATCH_SGLANG_VENV) find it.
    let pointer = root.join(SGLANG_VENV_POINTER);
    if fs::read_to_string(&stamp).is_ok_and(|have| have == wanted) {
        write_if_changed(&pointer, &venv.to_string_lossy())?;
        return Ok(venv);
    }
    if venv.exists() {
        fs::remove_dir_all(&venv).with_context(|| format!("removing the unfinished {}", venv.display()))?;
    }
    fs::create_dir_all(&cache)?;
    run(Command::new("python3.11").arg("-m").arg("venv").arg(&venv))?;
    let python = venv.join("bin/python");
    let wheels = cache.join("wheels");
    fs::create_dir_all(&wheels)?;
    // Every package --no-deps: the wheels' metadata asks for far more than
    // the import chain loads (see the comments in the requirement files).
    // pip's own HTTP cache stays empty on this machine, so the ~3 GB of wheels
    // are kept in ~/.cache/stallwatch/wheels (pip download skips those already
    // there) and installed from there only.
    for file in [&nodeps, &deps] {
        run(Command::new(&python)
            .args(["-m", "pip", "download", "--quiet", "--no-deps", "--find-links"])
            .arg(&wheels)
            .arg("--dest")
            .arg(&wheels)
            .arg("-r")
            .arg(file))?;
    }
    for file in [&nodeps, &deps] {
        run(Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--find-links"])
            .arg(&wheels)
            .arg("-r")
            .arg(file))?;
    }
    fs::write(&stamp, wanted)?;
    write_if_changed(&pointer, &venv.to_string_lossy())?;
    eprintln!("xtask: SGLang venv ready in {}", venv.display());
    Ok(venv)
}

/// The file, under the workspace root, that holds the SGLang venv's path.
pub const SGLANG_VENV_POINTER: &str = "target/sglang-venv";

/// The venv of Arize Phoenix (tests/phoenix/requirements.txt), the trace
/// store tests/e2e/phoenix.rs runs: about 860 MB with its dependencies, so
/// in `~/.cache/stallwatch/venv-phoenix-<hash of the file>`, made once per
/// content of the file (about a minute); the stamp is written last, so an
/// interrupted install is redone from scratch.
fn phoenix_venv() -> Result<PathBuf> {
    let root = root()?;
    let requirements = root.join("tests/phoenix/requirements.txt");
    let wanted = fs::read_to_string(&requirements)?;
    let cache = cache_dir()?;
    let venv = cache.join(format!("venv-phoenix-{}", sglang_venv_hash(&wanted)));
    let stamp = venv.join(".stallwatch-requirements");
    let pointer = root.join(PHOENIX_VENV_POINTER);
    if fs::read_to_string(&stamp).is_ok_and(|have| have == wanted) {
        write_if_changed(&pointer, &venv.to_string_lossy())?;
        return Ok(venv);
    }
    if venv.exists() {
        fs::remove_dir_all(&venv).with_context(|| format!("removing the unfinished {}", venv.display()))?;
    }
    fs::create_dir_all(&cache)?;
    run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    run(Command::new(venv.join("bin/python"))
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r"])
        .arg(&requirements))?;
    fs::write(&stamp, wanted)?;
    write_if_changed(&pointer, &venv.to_string_lossy())?;
    eprintln!("xtask: Phoenix venv ready in {}", venv.display());
    Ok(venv)
}

/// The file, under the workspace root, that holds the Phoenix venv's path.
pub const PHOENIX_VENV_POINTER: &str = "target/phoenix-venv";

fn write_if_changed(path: &Path, text: &str) -> Result<()> {
    if fs::read_to_string(path).is_ok_and(|have| have == text) {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// FNV-1a 64 of the requirement files (as `sglang_venv` joins them, or
/// `phoenix_venv`'s one), 12 hex digits.
fn sglang_venv_hash(text: &str) -> String {
    let hash =
        text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
    format!("{:012x}", hash >> 16)
}

fn cache_dir() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    Ok(PathBuf::from(home).join(".cache/stallwatch"))
}

fn output(command: &mut Command) -> Result<String> {
    let out = command.output().with_context(|| format!("running {command:?}"))?;
    if !out.status.success() {
        bail!("{command:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
