//! Which workload a watched process belongs to: its cgroup, the container
//! id in it, and the pod that runs that container, as the Kubernetes API
//! server describes it (the way OBI/Beyla and Tetragon name what they
//! watch).
//!
//! Without Kubernetes this still names what it can: a process in a
//! container has its container id from the cgroup path alone; a process in
//! no container has no identity, which is not an error. With it, the
//! node's pods are listed once and then watched ([`watch`]), so a pod is
//! known as soon as the API server has it; a process whose cgroup names a
//! pod not known yet (the kubelet reports a container's id after starting
//! it) is looked up again at each change of the node's pods, for up to
//! [`PATIENCE`], and said once if it is never found. Where the API is
//! reached and how is [`Source`]; the two requests, [`client`].
mod client;
mod pods;
mod source;
mod watch;

use std::{
    collections::HashMap,
    fmt,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

pub use self::source::{SERVICE_ACCOUNT_DIR, ServiceAccount, Source};

/// How long a process whose cgroup names a pod waits for that pod (and its
/// container) to show among the node's pods before that is said.
const PATIENCE: Duration = Duration::from_secs(60);

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
    /// The image the container runs, from its pod's status: what a rule's
    /// `image` matches ([`crate::run::rules`]).
    #[serde(rename = "container.image.name", default, skip_serializing_if = "Option::is_none")]
    pub container_image: Option<String>,
    /// The pod's controller, with a ReplicaSet's Deployment named instead
    /// (as Beyla's `k8s.owner.name`): `Deployment/vllm-prefill`.
    #[serde(rename = "k8s.owner.kind", default, skip_serializing_if = "Option::is_none")]
    pub owner_kind: Option<String>,
    #[serde(rename = "k8s.owner.name", default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(rename = "k8s.node.name", default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The workload's own service, as OpenTelemetry's Kubernetes
    /// conventions derive it from the pod ([`pods`]): its spans carry it
    /// in place of the agent's.
    #[serde(rename = "service.name", default, skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    #[serde(rename = "service.namespace", default, skip_serializing_if = "Option::is_none")]
    pub service_namespace: Option<String>,
    /// `namespace.pod.container`, once the container is known.
    #[serde(rename = "service.instance.id", default, skip_serializing_if = "Option::is_none")]
    pub service_instance: Option<String>,
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
        put("container.image.name", &self.container_image);
        put("k8s.owner.name", &self.owner);
        put("k8s.owner.kind", &self.owner_kind);
        put("k8s.node.name", &self.node);
        put("service.name", &self.service_name);
        put("service.namespace", &self.service_namespace);
        put("service.instance.id", &self.service_instance);
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

/// The watched processes' workloads, shared by whoever names a process
/// (alerts, spans, metrics, `inflight`).
#[derive(Clone)]
pub struct Directory {
    source: Source,
    /// The node's pods, kept by the watch; none without Kubernetes.
    pods: Option<watch::Shared>,
    by_pid: Arc<Mutex<HashMap<u32, Arc<Workload>>>>,
    /// Whether a pod never found was said already (once an agent).
    warned: Arc<AtomicBool>,
}

impl fmt::Debug for Directory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Directory").field("source", &self.source).finish_non_exhaustive()
    }
}

impl Directory {
    /// With an API, its watch starts now, on the current tokio runtime.
    pub fn new(source: Source) -> Result<Self> {
        let pods = match &source {
            Source::Off => None,
            Source::Api { base, node, account } => {
                let runtime = tokio::runtime::Handle::try_current()
                    .context("watching the node's pods needs the agent's runtime")?;
                let shared = watch::Shared::new();
                let api = client::Api::new(base.clone(), node.clone(), account.clone())?;
                runtime.spawn(watch::run(api, shared.clone()));
                Some(shared)
            }
        };
        Ok(Self::with(source, pods))
    }

    fn with(source: Source, pods: Option<watch::Shared>) -> Self {
        Self { source, pods, by_pid: Arc::default(), warned: Arc::default() }
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

    /// `ids` (from a cgroup) completed from the node's pods as known now,
    /// once they were listed (waited for, up to [`PATIENCE`]).
    pub async fn lookup(&self, ids: Workload) -> Workload {
        let Some(shared) = &self.pods else {
            return ids;
        };
        let mut changes = shared.changes.subscribe();
        let listed = changes.wait_for(|_| shared.lists() > 0);
        if tokio::time::timeout(PATIENCE, listed).await.is_ok_and(|waited| waited.is_ok()) {
            if let Some(found) = shared.pods.lock().ok().and_then(|pods| pods.find(&ids)) {
                return found;
            }
        }
        ids
    }

    /// The image `pid`'s container runs, as the node's pods known now say
    /// (no wait: a pod not listed yet is asked again by the next recheck);
    /// `None` without Kubernetes, for a process in no container, or one
    /// whose pod does not list its container yet.
    pub fn image_of(&self, pid: u32) -> Option<String> {
        let shared = self.pods.as_ref()?;
        let ids = from_cgroup(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?);
        shared.pods.lock().ok()?.find(&ids)?.container_image
    }

    /// Until the node's pods were listed once (at most [`PATIENCE`];
    /// nothing to wait for without an API): a rule that selects by image
    /// needs them to judge the processes running at start-up.
    pub async fn listed(&self) {
        let Some(shared) = &self.pods else { return };
        let mut changes = shared.changes.subscribe();
        let _ = tokio::time::timeout(PATIENCE, changes.wait_for(|_| shared.lists() > 0)).await;
    }

    /// Whether pods are looked up (`--kubernetes` names an API).
    pub fn watches_pods(&self) -> bool {
        self.pods.is_some()
    }

    /// Pod lists made so far (a watch that goes on lists no more).
    pub fn lists(&self) -> u64 {
        self.pods.as_ref().map_or(0, watch::Shared::lists)
    }

    /// Read `pid`'s cgroup and name it from its pod, kept for
    /// [`get`](Self::get) as it becomes known: at once what the cgroup and
    /// the pods known now say, then better as the pod shows (see
    /// [`follow`](Self::follow)). Never fails: an unreadable cgroup or an
    /// API error leaves what could be known (logged).
    pub async fn resolve(&self, pid: u32) -> Arc<Workload> {
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        self.follow(pid, from_cgroup(&cgroup), PATIENCE).await
    }

    /// `ids` completed from the node's pods now; again at each change of
    /// them while the pod its cgroup names (a pod UID) or its container is
    /// not known, for up to `patience` and while `pid` lives.
    async fn follow(&self, pid: u32, ids: Workload, patience: Duration) -> Arc<Workload> {
        let Some(shared) = &self.pods else {
            return self.keep(pid, ids);
        };
        // Subscribed before the first look: no change is missed between.
        let mut changes = shared.changes.subscribe();
        let find = || shared.pods.lock().ok().and_then(|pods| pods.find(&ids)).unwrap_or_else(|| ids.clone());
        let mut found = self.keep(pid, find());
        let named = |w: &Workload| w.pod.is_some() && (w.container_id.is_none() || w.container.is_some());
        let deadline = tokio::time::Instant::now() + patience;
        while ids.pod_uid.is_some() && !named(&found) {
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                // The watch ended: the agent is stopping.
                Ok(Err(_)) => break,
                Err(_) => {
                    self.unnamed(pid, &found, shared, patience);
                    break;
                }
            }
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                break;
            }
            let now = find();
            if now != *found {
                found = self.keep(pid, now);
            }
        }
        found
    }

    fn keep(&self, pid: u32, workload: Workload) -> Arc<Workload> {
        let workload = Arc::new(workload);
        if let Ok(mut by_pid) = self.by_pid.lock() {
            by_pid.insert(pid, Arc::clone(&workload));
        }
        if !workload.is_empty() {
            info!(pid, workload = %workload, "workload");
        }
        workload
    }

    /// Say, once an agent, that a process's pod never showed, and why.
    fn unnamed(&self, pid: u32, found: &Workload, shared: &watch::Shared, patience: Duration) {
        let why = shared.failing.lock().ok().and_then(|failing| failing.clone()).unwrap_or_else(|| {
            let node = match &self.source {
                Source::Api { node: Some(node), .. } => format!("node {node}'s pods"),
                _ => "the pods".to_owned(),
            };
            format!(
                "the API server's {node} do not have it (K8S_NODE_NAME another node's, or a static pod whose \
                 mirror has not shown its container yet)"
            )
        });
        let what = found.pod_uid.as_deref().unwrap_or_default();
        if self.warned.swap(true, Ordering::Relaxed) {
            debug!(pid, "workload identity: pod {what} not found within {patience:?}: {why}");
        } else {
            warn!(
                pid,
                "workload identity: pod {what} not found within {patience:?}, the process keeps its container id: {why}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{
        pods::tests::{ID, UID, event, pod},
        *,
    };

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
    fn json_keys_are_the_attribute_names() {
        let full = Workload {
            container_id: Some(ID.into()),
            pod_uid: Some(UID.into()),
            namespace: Some("llm".into()),
            pod: Some("p".into()),
            container: Some("c".into()),
            container_image: Some("registry/serve:1".into()),
            owner_kind: Some("Deployment".into()),
            owner: Some("d".into()),
            node: Some("n".into()),
            service_name: Some("s".into()),
            service_namespace: Some("llm".into()),
            service_instance: Some("llm.p.c".into()),
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

    #[tokio::test]
    async fn a_process_whose_pod_is_not_known_yet_is_named_when_it_shows() {
        let shared = watch::Shared::new();
        let directory = Directory::with(Source::Off, Some(shared.clone()));
        // A live pid, so the lookup goes on; its ids as its cgroup says.
        let pid = std::process::id();
        let ids = Workload { container_id: Some(ID.into()), pod_uid: Some(UID.into()), ..Workload::default() };
        let follow = tokio::spawn({
            let directory = directory.clone();
            async move { directory.follow(pid, ids, PATIENCE).await }
        });
        let apply = |kind, object| {
            shared.pods.lock().expect("lock").apply(event(kind, object)).expect("applied");
            shared.changes.send_modify(|n| *n += 1);
        };
        // Not known: named by its cgroup meanwhile, not cached as nobody's.
        tokio::task::yield_now().await;
        assert_eq!(directory.get(pid).and_then(|w| w.container_id.clone()).as_deref(), Some(ID));
        // Its pod, then its container.
        apply("ADDED", pod(UID, 2, None, json!({})));
        tokio::task::yield_now().await;
        assert_eq!(directory.get(pid).and_then(|w| w.pod.clone()).as_deref(), Some("prefill-7d9f8-abcde"));
        apply("MODIFIED", pod(UID, 3, Some(ID), json!({"app.kubernetes.io/name": "sglang-prefill"})));
        let found = tokio::time::timeout(PATIENCE / 2, follow).await.expect("named before the patience").expect("task");
        assert_eq!(found.to_string(), "llm/prefill-7d9f8-abcde/sglang");
        assert_eq!(found.service_name.as_deref(), Some("sglang-prefill"));
        assert_eq!(directory.get(pid), Some(found));
    }

    #[tokio::test]
    async fn a_pod_that_never_shows_is_said_once_and_the_lookup_ends() {
        let shared = watch::Shared::new();
        *shared.failing.lock().expect("lock") = Some("listing pods at http://api: 403 Forbidden".into());
        let directory = Directory::with(Source::Off, Some(shared));
        let ids = Workload { container_id: Some(ID.into()), pod_uid: Some(UID.into()), ..Workload::default() };
        let found = directory.follow(std::process::id(), ids.clone(), Duration::from_millis(20)).await;
        assert_eq!(*found, ids);
        assert!(directory.warned.load(Ordering::Relaxed));
    }
}
