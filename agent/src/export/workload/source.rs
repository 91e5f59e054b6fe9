//! Where the node's pods are asked for (`--kubernetes`): off, in-cluster
//! with the pod's service account, or a URL (`kubectl proxy`).
//!
//! In-cluster is reached as client-go's in-cluster config reaches it:
//! `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`, the server's
//! certificate checked against the service account's `ca.crt` alone, and
//! its `token` sent as a bearer token, read again before every request so
//! a rotated (projected, expiring) token is picked up. The service account
//! is bound to a ClusterRole that may only read pods (`get`, `list`,
//! `watch`: agent/deploy/base/rbac.yaml).
use std::{
    fmt,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};

/// Where a pod's service account is mounted (`automountServiceAccountToken`),
/// as client-go's in-cluster config reads it.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The service account the agent authenticates to the API server as: its
/// directory's `token` and `ca.crt` (`--kubernetes-service-account`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAccount {
    pub dir: PathBuf,
}

impl ServiceAccount {
    pub fn token_path(&self) -> PathBuf {
        self.dir.join("token")
    }

    pub fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The bearer token, read now: the kubelet rotates a projected token
    /// (an hour by default) by replacing the file, as client-go's
    /// in-cluster config expects, so it is never kept.
    pub(super) fn token(&self) -> Result<String> {
        let path = self.token_path();
        let token = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "reading the service account's token {}: mount it (serviceAccountName and \
                 automountServiceAccountToken: true, as agent/deploy/base/daemonset.yaml does), \
                 or point --kubernetes-service-account at its directory",
                path.display()
            )
        })?;
        let token = token.trim();
        if token.is_empty() {
            bail!("the service account's token {} is empty", path.display());
        }
        Ok(token.to_owned())
    }

    /// A client that trusts the cluster's CA (`ca.crt`) and nothing else,
    /// as client-go's in-cluster config does; `builder` sets the rest.
    pub(super) fn client(&self, builder: reqwest::ClientBuilder) -> Result<reqwest::Client> {
        let path = self.ca_path();
        let pem = std::fs::read(&path).with_context(|| {
            format!(
                "reading the cluster's CA {}: mount the service account (automountServiceAccountToken: true), \
                 or point --kubernetes-service-account at its directory",
                path.display()
            )
        })?;
        let certificates = reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("the cluster's CA {} is not PEM certificates", path.display()))?;
        if certificates.is_empty() {
            bail!("the cluster's CA {} holds no certificate", path.display());
        }
        crate::util::tls::install_ring();
        builder.https_only(true).tls_certs_only(certificates).build().context("building the Kubernetes API client")
    }
}

/// Where pods are looked up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Source {
    /// No Kubernetes: the cgroup's container id only.
    #[default]
    Off,
    /// The API server at this base URL: `https://` with a service account
    /// (in-cluster), or `http://` without one (`kubectl proxy`, or anything
    /// that answers `GET /api/v1/pods` and its `watch=true` the same way).
    Api { base: String, node: Option<String>, account: Option<ServiceAccount> },
}

impl Source {
    /// `--kubernetes`, with this process's environment: see [`parse_with`](Self::parse_with).
    pub fn parse(setting: &str, node: Option<String>, account_dir: Option<&Path>) -> Result<Self> {
        Self::parse_with(setting, node, account_dir, &|name: &str| std::env::var(name).ok())
    }

    /// `--kubernetes`: `off`; `in-cluster` (the API server the pod's
    /// `KUBERNETES_SERVICE_HOST`/`_PORT` name, with the service account in
    /// `account_dir`, by default [`SERVICE_ACCOUNT_DIR`]); an `https://`
    /// URL (with that service account too); or an `http://` URL asked
    /// without a token (`kubectl proxy`). `node` (the downward API's
    /// `K8S_NODE_NAME`) limits the list and the watch to this node's pods.
    pub fn parse_with(
        setting: &str,
        node: Option<String>,
        account_dir: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let setting = setting.trim();
        if setting.eq_ignore_ascii_case("off") || setting.is_empty() {
            return Ok(Source::Off);
        }
        let node = node.filter(|n| !n.trim().is_empty());
        let account = || ServiceAccount {
            dir: account_dir.map_or_else(|| PathBuf::from(SERVICE_ACCOUNT_DIR), Path::to_path_buf),
        };
        if setting.eq_ignore_ascii_case("in-cluster") {
            let var = |name: &str| {
                env(name).filter(|v| !v.trim().is_empty()).with_context(|| {
                    format!(
                        "--kubernetes in-cluster: {name} is not set, so this is not a pod (Kubernetes sets it in \
                         every container); outside a cluster give the API's URL, e.g. http://127.0.0.1:8001 for \
                         `kubectl proxy`"
                    )
                })
            };
            let (host, port) = (var("KUBERNETES_SERVICE_HOST")?, var("KUBERNETES_SERVICE_PORT")?);
            let (host, port) = (host.trim(), port.trim());
            if port.parse::<u16>().is_err() {
                bail!("--kubernetes in-cluster: KUBERNETES_SERVICE_PORT={port:?} is not a port");
            }
            // An IPv6 service address goes in brackets (net.JoinHostPort).
            let host = if host.contains(':') { format!("[{host}]") } else { host.to_owned() };
            return Ok(Source::Api { base: format!("https://{host}:{port}"), node, account: Some(account()) });
        }
        let (scheme, rest) = setting.split_once("://").unwrap_or(("", setting));
        let account = match scheme {
            "https" => Some(account()),
            "http" => None,
            _ => bail!(
                "--kubernetes {setting:?} is neither `off`, `in-cluster` nor an http:// or https:// URL \
                 (in a pod: in-cluster; beside `kubectl proxy`: http://127.0.0.1:8001)"
            ),
        };
        if rest.trim_end_matches('/').is_empty() {
            bail!("--kubernetes {setting:?} names no host");
        }
        Ok(Source::Api { base: setting.trim_end_matches('/').to_owned(), node, account })
    }
}

impl fmt::Display for Source {
    /// What `config check` shows.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Off => write!(f, "off (a process in a container is named by its container id)"),
            Source::Api { base, node, account } => {
                write!(f, "{base}")?;
                match account {
                    Some(account) => {
                        write!(f, " (token {}, CA {}", account.token_path().display(), account.ca_path().display())?
                    }
                    None => write!(f, " (no token")?,
                }
                match node {
                    Some(node) => write!(f, "; pods of node {node})"),
                    None => write!(f, "; every pod: K8S_NODE_NAME is not set)"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_refuse_what_they_cannot_reach() {
        let no_env = |_: &str| None;
        let parse = |setting: &str| Source::parse_with(setting, Some("n".into()), None, &no_env);
        assert_eq!(parse("off").expect("off"), Source::Off);
        assert_eq!(
            parse("http://127.0.0.1:8001/").expect("http"),
            Source::Api { base: "http://127.0.0.1:8001".into(), node: Some("n".into()), account: None }
        );
        let default_account = Some(ServiceAccount { dir: SERVICE_ACCOUNT_DIR.into() });
        assert_eq!(
            parse("https://10.0.0.1").expect("https"),
            Source::Api { base: "https://10.0.0.1".into(), node: Some("n".into()), account: default_account }
        );
        assert!(format!("{:#}", parse("kubernetes").expect_err("what")).contains("neither `off`, `in-cluster`"));
        assert!(format!("{:#}", parse("https://").expect_err("no host")).contains("names no host"));
        let outside = format!("{:#}", parse("in-cluster").expect_err("not in a pod"));
        assert!(outside.contains("KUBERNETES_SERVICE_HOST is not set"), "{outside}");
    }

    #[test]
    fn in_cluster_is_the_service_address_with_the_account() {
        let env = |host: &'static str, port: &'static str| {
            move |name: &str| match name {
                "KUBERNETES_SERVICE_HOST" => Some(host.to_owned()),
                "KUBERNETES_SERVICE_PORT" => Some(port.to_owned()),
                _ => None,
            }
        };
        let dir = Path::new("/tmp/sa");
        assert_eq!(
            Source::parse_with("in-cluster", None, Some(dir), &env("10.96.0.1", "443")).expect("v4"),
            Source::Api {
                base: "https://10.96.0.1:443".into(),
                node: None,
                account: Some(ServiceAccount { dir: dir.into() })
            }
        );
        let v6 = Source::parse_with("in-cluster", None, None, &env("fd00:10:96::1", "443")).expect("v6");
        assert!(matches!(&v6, Source::Api { base, .. } if base == "https://[fd00:10:96::1]:443"), "{v6:?}");
        let err = Source::parse_with("in-cluster", None, None, &env("10.96.0.1", "https")).expect_err("port");
        assert!(format!("{err:#}").contains("KUBERNETES_SERVICE_PORT=\"https\" is not a port"), "{err:#}");
    }

    #[test]
    fn a_missing_or_empty_ca_is_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        let account = ServiceAccount { dir: dir.path().into() };
        let missing = format!("{:#}", account.client(reqwest::Client::builder()).expect_err("no ca.crt"));
        assert!(missing.contains("ca.crt") && missing.contains("--kubernetes-service-account"), "{missing}");
        std::fs::write(account.ca_path(), "").expect("empty");
        let empty = format!("{:#}", account.client(reqwest::Client::builder()).expect_err("empty ca.crt"));
        assert!(empty.contains("holds no certificate"), "{empty}");
    }
}
