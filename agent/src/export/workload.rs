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
//! The API is reached over plain HTTP only (the agent reads no
//! service-account token to authenticate with): through
//! `kubectl proxy` beside the agent (`agent/deploy/components/workload-identity`),
//! which authenticates with the pod's service account, bound to a
//! ClusterRole that may only `get`/`list`/`watch` pods.
use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;
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

/// Where pods are looked up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Source {
    /// No Kubernetes: the cgroup's container id only.
    #[default]
    Off,
    /// The API server at this `http://` base URL (`kubectl proxy`, or
    /// anything that answers `GET /api/v1/pods` the same way).
    Api { base: String, node: Option<String> },
}

impl Source {
    /// `--kubernetes`: `off`, or an `http://HOST:PORT` URL; `node` (the
    /// downward API's `K8S_NODE_NAME`) limits the list to this node's pods.
    pub fn parse(setting: &str, node: Option<String>) -> Result<Self> {
        let setting = setting.trim();
        if setting.eq_ignore_ascii_case("off") || setting.is_empty() {
            return Ok(Source::Off);
        }
        if setting.starts_with("https://") {
            bail!(
                "--kubernetes {setting:?}: the agent does not authenticate to the API server itself (no service-account \
                 token is read); run `kubectl proxy` beside the agent and give its http://127.0.0.1:8001 \
                 (agent/deploy/components/workload-identity does)"
            );
        }
        if !setting.starts_with("http://") {
            bail!(
                "--kubernetes {setting:?} is neither `off` nor an http:// URL (e.g. http://127.0.0.1:8001 for `kubectl proxy`)"
            );
        }
        Ok(Source::Api { base: setting.trim_end_matches('/').to_owned(), node: node.filter(|n| !n.trim().is_empty()) })
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
    client: Option<reqwest::Client>,
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
            Source::Off => None,
            Source::Api { .. } => {
                crate::util::tls::install_ring();
                let client = reqwest::Client::builder().timeout(LIST_TIMEOUT).build();
                Some(client.context("building the Kubernetes API client")?)
            }
        };
        Ok(Self { source, client, cache: Arc::default(), by_pid: Arc::default() })
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
        let Source::Api { base, node } = &self.source else {
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
            match self.list(base, node.as_deref()).await {
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

    async fn list(&self, base: &str, node: Option<&str>) -> Result<usize> {
        if let Ok(mut cache) = self.cache.lock() {
            cache.listed = Some(Instant::now());
            cache.lists += 1;
        }
        let client = self.client.as_ref().context("no API client")?;
        // Node names are DNS subdomains: only the `=` needs escaping.
        let url = match node {
            Some(node) => format!("{base}/api/v1/pods?fieldSelector=spec.nodeName%3D{node}"),
            None => format!("{base}/api/v1/pods"),
        };
        let response = client
            .get(&url)
            .send()
            .await
            .with_context(|| format!("listing pods at {base}: is the API (kubectl proxy) up?"))?;
        let status = response.status();
        let body = response.text().await.with_context(|| format!("reading the pod list from {base}"))?;
        if !status.is_success() {
            let hint = if status.as_u16() == 403 {
                ": the service account may not list pods (agent/deploy/components/workload-identity binds a ClusterRole that may)"
            } else {
                ""
            };
            bail!("listing pods at {base}: {status}{hint}: {}", body.chars().take(200).collect::<String>());
        }
        let list: Value =
            serde_json::from_str(&body).with_context(|| format!("the pod list from {base} is not JSON"))?;
        let (by_container, by_uid) = index(&list);
        let n = by_uid.len();
        if let Ok(mut cache) = self.cache.lock() {
            cache.by_container = by_container;
            cache.by_uid = by_uid;
        }
        Ok(n)
    }
}

/// A `PodList`'s pods by container id and by UID.
fn index(list: &Value) -> (HashMap<String, Arc<Workload>>, HashMap<String, Arc<Workload>>) {
    let mut by_container = HashMap::new();
    let mut by_uid = HashMap::new();
    for pod in list["items"].as_array().into_iter().flatten() {
        let text = |value: &Value| value.as_str().map(str::to_owned);
        let meta = &pod["metadata"];
        let controller = meta["ownerReferences"].as_array().into_iter().flatten().find(|o| o["controller"] == true);
        let (mut owner_kind, mut owner) =
            (controller.and_then(|o| text(&o["kind"])), controller.and_then(|o| text(&o["name"])));
        // A Deployment's pods are owned by its ReplicaSet `NAME-HASH`.
        if let (Some("ReplicaSet"), Some(name), Some(hash)) =
            (owner_kind.as_deref(), owner.as_deref(), meta["labels"]["pod-template-hash"].as_str())
        {
            if let Some(deployment) = name.strip_suffix(hash).and_then(|n| n.strip_suffix('-')) {
                owner = Some(deployment.to_owned());
                owner_kind = Some("Deployment".to_owned());
            }
        }
        let base = Workload {
            container_id: None,
            pod_uid: text(&meta["uid"]),
            namespace: text(&meta["namespace"]),
            pod: text(&meta["name"]),
            container: None,
            owner_kind,
            owner,
            node: text(&pod["spec"]["nodeName"]),
        };
        let status = &pod["status"];
        for statuses in ["containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"] {
            for container in status[statuses].as_array().into_iter().flatten() {
                // `containerd://ID`, `cri-o://ID`, `docker://ID`
                let Some(id) = container["containerID"]
                    .as_str()
                    .and_then(|id| id.split_once("://"))
                    .map(|(_, id)| id.to_ascii_lowercase())
                else {
                    continue;
                };
                let workload =
                    Workload { container_id: Some(id.clone()), container: text(&container["name"]), ..base.clone() };
                by_container.insert(id, Arc::new(workload));
            }
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
        let (by_container, by_uid) = index(&list);
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
        assert_eq!(Source::parse("off", None).expect("off"), Source::Off);
        assert_eq!(
            Source::parse("http://127.0.0.1:8001/", Some("n".into())).expect("http"),
            Source::Api { base: "http://127.0.0.1:8001".into(), node: Some("n".into()) }
        );
        assert!(format!("{:#}", Source::parse("https://10.0.0.1", None).expect_err("tls")).contains("kubectl proxy"));
        assert!(format!("{:#}", Source::parse("kubernetes", None).expect_err("what")).contains("neither `off`"));
    }
}
