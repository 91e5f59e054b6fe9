//! Which workload a watched process belongs to: its cgroup, the container
//! id in it, and the pod that runs that container, asked of the Kubernetes
//! API server (the way OBI/Beyla and Tetragon name what they watch).
//!
//! Without Kubernetes this still names what it can: a process in a
//! container has its container id from the cgroup path alone; a process in
//! no container has no identity, which is not an error. The API is asked at
//! most once per [`MIN_RELIST`] (one list of the node's pods, cached), so
//! a burst of new processes costs the API server one request; a process
//! whose pod is not listed yet keeps its container id and is resolved on a
//! later process start.
//!
//! The API is reached as client-go's in-cluster config reaches it
//! (`--kubernetes in-cluster`): `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`,
//! the server's certificate checked against the service account's
//! `ca.crt` alone, and its `token` sent as a bearer token, read again before
//! every list so a rotated (projected, expiring) token is picked up. The
//! service account is bound to a ClusterRole that may only `list` pods
//! (`agent/deploy/components/workload-identity`). An `http://` URL (e.g.
//! `kubectl proxy`, which authenticates itself) is asked without a token.
use std::{
    collections::HashMap,
    fmt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

/// Shortest time between two pod lists.
pub const MIN_RELIST: Duration = Duration::from_secs(5);
/// How long one pod list may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(5);

/// What is known of a watched process's workload; every field may be
/// missing (a process in no container has none).
///
/// In JSON (alert lines, `inflight` rows) it is an object keyed by the
/// same semantic-convention names as [`attributes`](Self::attributes),
/// unknown fields left out, so one `jq` path reads both.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    /// The container runtime's id (64 hex digits), from the cgroup path.
    #[serde(rename = "container.id", default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// The pod's UID, from the cgroup path (kubelet's cgroup layout).
    #[serde(rename = "k8s.pod.uid", default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    #[serde(rename = "k8s.namespace.name", default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(rename = "k8s.pod.name", default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(rename = "k8s.container.name", default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// The pod's controller, with a ReplicaSet's Deployment named instead
    /// (as Beyla's `k8s.owner.name`): `Deployment/vllm-prefill`.
    #[serde(rename = "k8s.owner.kind", default, skip_serializing_if = "Option::is_none")]
    pub owner_kind: Option<String>,
    #[serde(rename = "k8s.owner.name", default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(rename = "k8s.node.name", default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

impl Workload {
    /// The OpenTelemetry semantic-convention attributes that are known.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        let mut put = |key, value: &Option<String>| {
            if let Some(value) = value {
                out.push((key, value.clone()));
            }
        };
        put("container.id", &self.container_id);
        put("k8s.pod.uid", &self.pod_uid);
        put("k8s.namespace.name", &self.namespace);
        put("k8s.pod.name", &self.pod);
        put("k8s.container.name", &self.container);
        put("k8s.owner.name", &self.owner);
        put("k8s.owner.kind", &self.owner_kind);
        put("k8s.node.name", &self.node);
        out
    }

    /// The bounded metric labels (Beyla's names, so they never collide
    /// with the `namespace`/`pod` labels Prometheus gives the agent's own
    /// target): namespace, owner, pod, container; empty when unknown.
    pub fn labels(&self) -> [(&'static str, String); 4] {
        let or_empty = |value: &Option<String>| value.clone().unwrap_or_default();
        [
            ("k8s_namespace_name", or_empty(&self.namespace)),
            ("k8s_owner_name", or_empty(&self.owner)),
            ("k8s_pod_name", or_empty(&self.pod)),
            ("k8s_container_name", or_empty(&self.container)),
        ]
    }

    pub fn is_empty(&self) -> bool {
        *self == Workload::default()
    }
}

impl fmt::Display for Workload {
    /// `namespace/pod/container`, else the short container id, else nothing.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.namespace, &self.pod, &self.container_id) {
            (Some(namespace), Some(pod), _) => {
                write!(f, "{namespace}/{pod}")?;
                match &self.container {
                    Some(container) => write!(f, "/{container}"),
                    None => Ok(()),
                }
            }
            (_, _, Some(id)) => write!(f, "container {}", &id[..id.len().min(12)]),
            _ => Ok(()),
        }
    }
}

/// The container id and pod UID in a `/proc/PID/cgroup` (v1 or v2;
/// systemd's and cgroupfs's layouts; containerd, CRI-O, Docker, Podman).
pub fn from_cgroup(text: &str) -> Workload {
    let mut workload = Workload::default();
    for line in text.lines() {
        // `hierarchy-ID:controllers:path`
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        for part in path.split('/').rev() {
            if workload.container_id.is_none() {
                workload.container_id = container_id(part);
            }
            if workload.pod_uid.is_none() {
                workload.pod_uid = pod_uid(part);
            }
        }
        if workload.container_id.is_some() {
            break;
        }
    }
    workload
}

fn container_id(part: &str) -> Option<String> {
    let part = part.strip_suffix(".scope").unwrap_or(part);
    let id = ["cri-containerd-", "crio-", "docker-", "cri-dockerd-", "libpod-"]
        .iter()
        .find_map(|prefix| part.strip_prefix(prefix))
        .unwrap_or(part);
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_ascii_lowercase())
}

/// `pod<uid>` (cgroupfs) or `kubepods-<qos>-pod<uid with _>.slice` (systemd).
fn pod_uid(part: &str) -> Option<String> {
    let part = part.strip_suffix(".slice").unwrap_or(part);
    let at = part.rfind("pod")?;
    if at > 0 && !part[..at].ends_with('-') {
        return None;
    }
    let uid = part[at + 3..].replace('_', "-");
    let shape = uid.len() == 36
        && uid.char_indices().all(|(i, c)| if [8, 13, 18, 23].contains(&i) { c == '-' } else { c.is_ascii_hexdigit() });
    shape.then_some(uid)
}

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
    fn token(&self) -> Result<String> {
        let path = self.token_path();
        let token = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "reading the service account's token {}: mount it (serviceAccountName and \
                 automountServiceAccountToken: true, as agent/deploy/components/workload-identity does), \
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
    /// as client-go's in-cluster config does.
    fn client(&self) -> Result<reqwest::Client> {
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
        reqwest::Client::builder()
            .timeout(LIST_TIMEOUT)
            .https_only(true)
            .tls_certs_only(certificates)
            .build()
            .context("building the Kubernetes API client")
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
    /// that answers `GET /api/v1/pods` the same way).
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
    /// `K8S_NODE_NAME`) limits the list to this node's pods.
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

/// Pods by container id and by UID, from the last list.
#[derive(Default)]
struct Cache {
    by_container: HashMap<String, Arc<Workload>>,
    by_uid: HashMap<String, Arc<Workload>>,
    listed: Option<Instant>,
    lists: u64,
}

/// The watched processes' workloads, shared by whoever names a process
/// (alerts, spans, metrics, `inflight`).
#[derive(Clone)]
pub struct Directory {
    source: Source,
    /// Built at start for `http://`; for a service account, at the first
    /// list that can read its CA (a late mount is picked up).
    client: Arc<Mutex<Option<reqwest::Client>>>,
    cache: Arc<Mutex<Cache>>,
    by_pid: Arc<Mutex<HashMap<u32, Arc<Workload>>>>,
}

impl fmt::Debug for Directory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Directory").field("source", &self.source).finish_non_exhaustive()
    }
}

impl Directory {
    pub fn new(source: Source) -> Result<Self> {
        let client = match &source {
            Source::Api { account: None, .. } => {
                crate::util::tls::install_ring();
                let client = reqwest::Client::builder().timeout(LIST_TIMEOUT).build();
                Some(client.context("building the Kubernetes API client")?)
            }
            Source::Off | Source::Api { account: Some(_), .. } => None,
        };
        Ok(Self { source, client: Arc::new(Mutex::new(client)), cache: Arc::default(), by_pid: Arc::default() })
    }

    /// What is known of `pid` now (nothing until [`resolve`](Self::resolve) ran).
    pub fn get(&self, pid: u32) -> Option<Arc<Workload>> {
        self.by_pid.lock().ok()?.get(&pid).cloned()
    }

    pub fn forget(&self, pid: u32) {
        if let Ok(mut by_pid) = self.by_pid.lock() {
            by_pid.remove(&pid);
        }
    }

    /// Pod lists made so far.
    pub fn lists(&self) -> u64 {
        self.cache.lock().map_or(0, |cache| cache.lists)
    }

    /// Read `pid`'s cgroup and look its pod up; what is found is kept for
    /// [`get`](Self::get). Never fails: an unreadable cgroup or an API
    /// error leaves what could be known (logged).
    pub async fn resolve(&self, pid: u32) -> Arc<Workload> {
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        let found = Arc::new(self.lookup(from_cgroup(&cgroup)).await);
        if let Ok(mut by_pid) = self.by_pid.lock() {
            by_pid.insert(pid, Arc::clone(&found));
        }
        if !found.is_empty() {
            info!(pid, workload = %found, "workload");
        }
        found
    }

    /// `ids` (from a cgroup) completed from the pod list.
    pub async fn lookup(&self, ids: Workload) -> Workload {
        let Source::Api { base, node, account } = &self.source else {
            return ids;
        };
        if ids.container_id.is_none() && ids.pod_uid.is_none() {
            return ids;
        }
        if let Some(found) = self.cached(&ids) {
            return found;
        }
        let due =
            self.cache.lock().map(|cache| cache.listed.is_none_or(|at| at.elapsed() >= MIN_RELIST)).unwrap_or(false);
        if due {
            match self.list(base, node.as_deref(), account.as_ref()).await {
                Ok(n) => debug!(pods = n, "listed the node's pods"),
                Err(err) => warn!("workload identity: {err:#}"),
            }
        }
        self.cached(&ids).unwrap_or(ids)
    }

    fn cached(&self, ids: &Workload) -> Option<Workload> {
        let cache = self.cache.lock().ok()?;
        let pod = ids
            .container_id
            .as_ref()
            .and_then(|id| cache.by_container.get(id))
            .or_else(|| ids.pod_uid.as_ref().and_then(|uid| cache.by_uid.get(uid)))?;
        let mut found = (**pod).clone();
        found.container_id = ids.container_id.clone().or(found.container_id);
        // A pod found by UID alone: which of its containers is unknown.
        if ids.container_id.is_some()
            && !cache.by_container.contains_key(ids.container_id.as_deref().unwrap_or_default())
        {
            found.container = None;
        }
        Some(found)
    }

    async fn list(&self, base: &str, node: Option<&str>, account: Option<&ServiceAccount>) -> Result<usize> {
        if let Ok(mut cache) = self.cache.lock() {
            cache.listed = Some(Instant::now());
            cache.lists += 1;
        }
        let client = self.client(account)?;
        // Node names are DNS subdomains: only the `=` needs escaping.
        let url = match node {
            Some(node) => format!("{base}/api/v1/pods?fieldSelector=spec.nodeName%3D{node}"),
            None => format!("{base}/api/v1/pods"),
        };
        let mut request = client.get(&url);
        if let Some(account) = account {
            // Marked sensitive by reqwest: never in a debug print.
            request = request.bearer_auth(account.token()?);
        }
        let response = request.send().await.with_context(|| match account {
            Some(account) => format!(
                "listing pods at {base} (its certificate is checked against {} alone)",
                account.ca_path().display()
            ),
            None => format!("listing pods at {base}: is the API (kubectl proxy) up?"),
        })?;
        let status = response.status();
        let body = response.bytes().await.with_context(|| format!("reading the pod list from {base}"))?;
        if !status.is_success() {
            let hint = match (status.as_u16(), account) {
                (401, Some(account)) => format!(
                    ": the API server did not accept the token in {} (expired, or another cluster's; it is read \
                     again before every list)",
                    account.token_path().display()
                ),
                (403, _) => ": the service account may not list pods (agent/deploy/components/workload-identity \
                             binds a ClusterRole that may)"
                    .to_owned(),
                _ => String::new(),
            };
            bail!("listing pods at {base}: {status}{hint}: {}", String::from_utf8_lossy(&body[..body.len().min(200)]));
        }
        let list: PodList =
            serde_json::from_slice(&body).with_context(|| format!("the pod list from {base} is not a PodList"))?;
        let (by_container, by_uid) = index(list);
        let n = by_uid.len();
        if let Ok(mut cache) = self.cache.lock() {
            cache.by_container = by_container;
            cache.by_uid = by_uid;
        }
        Ok(n)
    }
}

impl Directory {
    /// The API client; for a service account, built on first use from
    /// its CA and kept.
    fn client(&self, account: Option<&ServiceAccount>) -> Result<reqwest::Client> {
        let mut client = self.client.lock().map_err(|_| anyhow::anyhow!("the API client's lock is poisoned"))?;
        if let Some(client) = client.as_ref() {
            return Ok(client.clone());
        }
        let account = account.context("no Kubernetes API client")?;
        Ok(client.insert(account.client()?).clone())
    }
}

/// The fields of a `PodList` the index reads; serde skips the rest while
/// parsing, so a list of 1 000 pods never exists as a JSON tree (one made
/// the agent's RSS grow by about 9 MiB that the allocator kept).
#[derive(Deserialize)]
struct PodList {
    #[serde(default)]
    items: Vec<Pod>,
}

#[derive(Deserialize)]
struct Pod {
    #[serde(default)]
    metadata: PodMeta,
    #[serde(default)]
    spec: PodSpec,
    #[serde(default)]
    status: PodStatus,
}

#[derive(Deserialize, Default)]
struct PodMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    #[serde(default)]
    labels: PodLabels,
    #[serde(default, rename = "ownerReferences")]
    owners: Vec<OwnerReference>,
}

#[derive(Deserialize, Default)]
struct PodLabels {
    #[serde(rename = "pod-template-hash")]
    template_hash: Option<String>,
}

#[derive(Deserialize)]
struct OwnerReference {
    kind: Option<String>,
    name: Option<String>,
    #[serde(default)]
    controller: bool,
}

#[derive(Deserialize, Default)]
struct PodSpec {
    #[serde(rename = "nodeName")]
    node: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct PodStatus {
    #[serde(default)]
    container_statuses: Vec<ContainerStatus>,
    #[serde(default)]
    init_container_statuses: Vec<ContainerStatus>,
    #[serde(default)]
    ephemeral_container_statuses: Vec<ContainerStatus>,
}

#[derive(Deserialize)]
struct ContainerStatus {
    name: Option<String>,
    #[serde(rename = "containerID")]
    container_id: Option<String>,
}

/// A `PodList`'s pods by container id and by UID.
fn index(list: PodList) -> (HashMap<String, Arc<Workload>>, HashMap<String, Arc<Workload>>) {
    let mut by_container = HashMap::new();
    let mut by_uid = HashMap::new();
    for pod in list.items {
        let meta = pod.metadata;
        let controller = meta.owners.into_iter().find(|o| o.controller);
        let (mut owner_kind, mut owner) = controller.map_or((None, None), |o| (o.kind, o.name));
        // A Deployment's pods are owned by its ReplicaSet `NAME-HASH`.
        if let (Some("ReplicaSet"), Some(name), Some(hash)) =
            (owner_kind.as_deref(), owner.as_deref(), meta.labels.template_hash.as_deref())
        {
            if let Some(deployment) = name.strip_suffix(hash).and_then(|n| n.strip_suffix('-')) {
                owner = Some(deployment.to_owned());
                owner_kind = Some("Deployment".to_owned());
            }
        }
        let base = Workload {
            container_id: None,
            pod_uid: meta.uid,
            namespace: meta.namespace,
            pod: meta.name,
            container: None,
            owner_kind,
            owner,
            node: pod.spec.node,
        };
        let status = pod.status;
        let containers =
            [status.container_statuses, status.init_container_statuses, status.ephemeral_container_statuses];
        for container in containers.into_iter().flatten() {
            // `containerd://ID`, `cri-o://ID`, `docker://ID`
            let Some(id) = container
                .container_id
                .as_deref()
                .and_then(|id| id.split_once("://"))
                .map(|(_, id)| id.to_ascii_lowercase())
            else {
                continue;
            };
            let workload = Workload { container_id: Some(id.clone()), container: container.name, ..base.clone() };
            by_container.insert(id, Arc::new(workload));
        }
        if let Some(uid) = base.pod_uid.clone() {
            by_uid.insert(uid, Arc::new(base));
        }
    }
    (by_container, by_uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f1e2d4c5b6a79881726354453627180a9b8c7d6e5f4031322314151617181a1";
    const UID: &str = "0b6c5a4e-1d2f-4a3b-9c8d-7e6f5a4b3c2d";

    #[test]
    fn container_ids_and_pod_uids_from_every_layout() {
        let uid_ = UID.replace('-', "_");
        for (cgroup, runtime) in [
            (
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{ID}.scope\n"
                ),
                "systemd containerd",
            ),
            (format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/crio-{ID}.scope\n"), "systemd cri-o, guaranteed"),
            (
                format!("12:memory:/kubepods/besteffort/pod{UID}/{ID}\n11:cpu:/kubepods/besteffort/pod{UID}/{ID}\n"),
                "cgroupfs v1",
            ),
        ] {
            let found = from_cgroup(&cgroup);
            assert_eq!(found.container_id.as_deref(), Some(ID), "{runtime}");
            assert_eq!(found.pod_uid.as_deref(), Some(UID), "{runtime}");
        }
        let docker = from_cgroup(&format!("0::/system.slice/docker-{ID}.scope\n"));
        assert_eq!(docker.container_id.as_deref(), Some(ID));
        assert_eq!(docker.pod_uid, None);
        // A process in no container: nothing, and no error.
        assert!(from_cgroup("0::/user.slice/user-0.slice/session-3.scope\n").is_empty());
        assert!(from_cgroup("").is_empty());
        assert!(from_cgroup("0::/system.slice/podman.service\n").is_empty(), "`pod` inside a word is not a pod UID");
    }

    #[test]
    fn the_pod_list_names_containers_and_deployments() {
        let list = serde_json::json!({"kind": "PodList", "items": [{
            "metadata": {"name": "prefill-7d9f8-abcde", "namespace": "llm", "uid": UID,
                         "labels": {"pod-template-hash": "7d9f8"},
                         "ownerReferences": [{"kind": "ReplicaSet", "name": "prefill-7d9f8", "controller": true}]},
            "spec": {"nodeName": "gpu-1"},
            "status": {"containerStatuses": [{"name": "sglang", "containerID": format!("containerd://{ID}")}]}
        }]});
        let (by_container, by_uid) = index(serde_json::from_value(list).expect("a PodList"));
        let w = &by_container[ID];
        assert_eq!(w.to_string(), "llm/prefill-7d9f8-abcde/sglang");
        assert_eq!((w.owner_kind.as_deref(), w.owner.as_deref()), (Some("Deployment"), Some("prefill")));
        assert_eq!(w.node.as_deref(), Some("gpu-1"));
        assert_eq!(by_uid[UID].container, None);
        assert_eq!(w.labels()[1], ("k8s_owner_name", "prefill".to_owned()));
    }

    #[test]
    fn json_keys_are_the_attribute_names() {
        let full = Workload {
            container_id: Some(ID.into()),
            pod_uid: Some(UID.into()),
            namespace: Some("llm".into()),
            pod: Some("p".into()),
            container: Some("c".into()),
            owner_kind: Some("Deployment".into()),
            owner: Some("d".into()),
            node: Some("n".into()),
        };
        let json = serde_json::to_value(&full).expect("json");
        let mut keys: Vec<&str> = json.as_object().expect("object").keys().map(String::as_str).collect();
        let mut names: Vec<&str> = full.attributes().iter().map(|(key, _)| *key).collect();
        keys.sort_unstable();
        names.sort_unstable();
        assert_eq!(keys, names);
        assert_eq!(serde_json::from_value::<Workload>(json).expect("back"), full);
        let partial = Workload { container_id: Some(ID.into()), ..Workload::default() };
        assert_eq!(serde_json::to_string(&partial).expect("json"), format!("{{\"container.id\":\"{ID}\"}}"));
    }

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

    /// A local HTTP server answering `status` with `body` to each of `n`
    /// requests; the `Authorization` header of each.
    fn serve(n: usize, status: &'static str, body: String) -> (u16, std::thread::JoinHandle<Vec<String>>) {
        use std::io::{BufRead as _, BufReader, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let server = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for stream in listener.incoming().take(n) {
                let mut stream = stream.expect("accept");
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut auth = String::new();
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                    if let Some(value) = line.strip_prefix("authorization: ") {
                        auth = value.trim().to_owned();
                    }
                    line.clear();
                }
                seen.push(auth);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
            seen
        });
        (port, server)
    }

    #[tokio::test]
    async fn the_token_is_read_again_for_every_list() {
        let dir = tempfile::tempdir().expect("temp dir");
        let account = ServiceAccount { dir: dir.path().into() };
        let (port, server) = serve(2, "200 OK", serde_json::json!({"kind": "PodList", "items": []}).to_string());
        let base = format!("http://127.0.0.1:{port}");
        let source = Source::Api { base: base.clone(), node: None, account: Some(account.clone()) };
        let directory = Directory::new(source).expect("directory");
        // The https client would refuse this plain server: a plain one in
        // its place, as the token is what is tested.
        crate::util::tls::install_ring();
        *directory.client.lock().expect("lock") = Some(reqwest::Client::new());

        let missing = directory.list(&base, None, Some(&account)).await.expect_err("no token yet");
        let missing = format!("{missing:#}");
        assert!(missing.contains("token") && missing.contains("automountServiceAccountToken"), "{missing}");
        std::fs::write(account.token_path(), "first\n").expect("token");
        directory.list(&base, None, Some(&account)).await.expect("first list");
        // The kubelet rotates the projected token by replacing the file.
        std::fs::write(account.token_path(), "second").expect("rotated token");
        directory.list(&base, None, Some(&account)).await.expect("second list");
        assert_eq!(server.join().expect("server"), ["Bearer first", "Bearer second"]);
    }

    #[tokio::test]
    async fn a_refused_token_says_which_file_it_came_from() {
        let dir = tempfile::tempdir().expect("temp dir");
        let account = ServiceAccount { dir: dir.path().into() };
        std::fs::write(account.token_path(), "stale").expect("token");
        let (port, server) = serve(1, "401 Unauthorized", r#"{"kind":"Status","code":401}"#.to_owned());
        let base = format!("http://127.0.0.1:{port}");
        let directory = Directory::new(Source::Off).expect("directory");
        crate::util::tls::install_ring();
        *directory.client.lock().expect("lock") = Some(reqwest::Client::new());
        let err = format!("{:#}", directory.list(&base, None, Some(&account)).await.expect_err("401"));
        assert!(err.contains("401 Unauthorized") && err.contains(&account.token_path().display().to_string()), "{err}");
        server.join().expect("server");
    }

    #[test]
    fn a_missing_or_empty_ca_is_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        let account = ServiceAccount { dir: dir.path().into() };
        let missing = format!("{:#}", account.client().expect_err("no ca.crt"));
        assert!(missing.contains("ca.crt") && missing.contains("--kubernetes-service-account"), "{missing}");
        std::fs::write(account.ca_path(), "").expect("empty");
        let empty = format!("{:#}", account.client().expect_err("empty ca.crt"));
        assert!(empty.contains("holds no certificate"), "{empty}");
    }
}
