//! The node's pods as the agent keeps them: a list replaced whole, then
//! the watch's events applied one by one (client-go's reflector, by hand),
//! indexed by container id and by pod UID, each pod already turned into the
//! [`Workload`] its processes are named by.
//!
//! Only what is read is parsed: serde skips the rest, so a list of 1 000
//! pods never exists as a JSON tree (one made the agent's RSS grow by about
//! 9 MiB that the allocator kept).
use std::{collections::HashMap, sync::Arc};

use anyhow::{Context as _, Result};
use serde::Deserialize;

use super::Workload;

/// The pods known now and the resource version they are as of.
#[derive(Default)]
pub(super) struct Pods {
    /// By UID: the pod, and the ids of its containers in `by_container`.
    by_uid: HashMap<String, (Arc<Workload>, Vec<String>)>,
    by_container: HashMap<String, Arc<Workload>>,
    /// Where a watch resumes: the list's, then each event's.
    resource_version: Option<String>,
}

/// What one watch event did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Applied {
    /// A pod added, changed or deleted, or a bookmark.
    Changed,
    /// 410 Gone: the resource version is too old to watch from; list again.
    Gone,
    /// Any other `ERROR` event: this message; watch again.
    Failed(String),
}

impl Pods {
    /// Everything from a `PodList`, what was known before dropped.
    pub(super) fn replace(&mut self, list: PodList) {
        self.by_uid.clear();
        self.by_container.clear();
        for pod in list.items {
            self.insert(pod);
        }
        self.resource_version = list.metadata.resource_version;
    }

    /// One event of a watch (`{"type": ..., "object": ...}`).
    pub(super) fn apply(&mut self, event: WatchEvent) -> Result<Applied> {
        let kind = event.kind.as_str();
        if kind == "ERROR" {
            // A `Status`: 410 when the version is compacted away.
            let status: Status = serde_json::from_value(event.object).context("an ERROR event that is not a Status")?;
            return Ok(if status.code == Some(410) {
                Applied::Gone
            } else {
                Applied::Failed(format!("{} {}", status.code.unwrap_or_default(), status.message.unwrap_or_default()))
            });
        }
        let pod: Pod = serde_json::from_value(event.object).with_context(|| format!("a {kind} event without a pod"))?;
        let version = pod.metadata.resource_version.clone();
        match kind {
            "ADDED" | "MODIFIED" => self.insert(pod),
            "DELETED" => {
                if let Some(uid) = &pod.metadata.uid {
                    self.remove(uid);
                }
            }
            // Only a newer version to resume from.
            "BOOKMARK" => {}
            other => anyhow::bail!("a watch event of unknown type {other:?}"),
        }
        if version.is_some() {
            self.resource_version = version;
        }
        Ok(Applied::Changed)
    }

    pub(super) fn resource_version(&self) -> Option<&str> {
        self.resource_version.as_deref()
    }

    /// `ids` (from a cgroup) completed from the pod that has that
    /// container, else the pod with that UID (its container not known yet:
    /// the kubelet reports a container's id after it started it).
    pub(super) fn find(&self, ids: &Workload) -> Option<Workload> {
        let by_container = ids.container_id.as_ref().and_then(|id| self.by_container.get(id));
        let pod =
            by_container.or_else(|| ids.pod_uid.as_ref().and_then(|uid| self.by_uid.get(uid).map(|(pod, _)| pod)))?;
        let mut found = (**pod).clone();
        found.container_id = ids.container_id.clone().or(found.container_id);
        Some(found)
    }

    pub(super) fn len(&self) -> usize {
        self.by_uid.len()
    }

    /// Add `pod`, or replace what was known of it.
    fn insert(&mut self, pod: Pod) {
        let Some(uid) = pod.metadata.uid.clone() else { return };
        self.remove(&uid);
        let (base, containers) = workloads(pod);
        let ids = containers.iter().filter_map(|w| w.container_id.clone()).collect();
        for workload in containers {
            if let Some(id) = workload.container_id.clone() {
                self.by_container.insert(id, Arc::new(workload));
            }
        }
        self.by_uid.insert(uid, (Arc::new(base), ids));
    }

    fn remove(&mut self, uid: &str) {
        if let Some((_, ids)) = self.by_uid.remove(uid) {
            for id in ids {
                self.by_container.remove(&id);
            }
        }
    }
}

/// A pod's workload without a container, and one per container that has
/// an id.
fn workloads(pod: Pod) -> (Workload, Vec<Workload>) {
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
    let (labels, annotations) = (meta.labels, meta.annotations);
    // OpenTelemetry's "Populating resource attributes in Kubernetes":
    // the annotation, the well-known labels (and `app`, their older
    // spelling), then the highest owner, then the pod.
    let service_name =
        [annotations.service_name, labels.instance, labels.name, labels.app, owner.clone(), meta.name.clone()]
            .into_iter()
            .flatten()
            .find(|name| !name.trim().is_empty());
    let service_namespace = annotations.service_namespace.or_else(|| meta.namespace.clone());
    let base = Workload {
        pod_uid: meta.uid,
        namespace: meta.namespace,
        pod: meta.name,
        owner_kind,
        owner,
        node: pod.spec.node,
        service_name,
        service_namespace,
        ..Workload::default()
    };
    let status = pod.status;
    let statuses = [status.container_statuses, status.init_container_statuses, status.ephemeral_container_statuses];
    let containers = statuses
        .into_iter()
        .flatten()
        .filter_map(|container| {
            // `containerd://ID`, `cri-o://ID`, `docker://ID`
            let id = container.container_id?.split_once("://")?.1.to_ascii_lowercase();
            // The spec's `namespace.pod.container`, unless the annotation says.
            let instance = annotations.service_instance.clone().or_else(|| {
                Some(format!("{}.{}.{}", base.namespace.as_deref()?, base.pod.as_deref()?, container.name.as_deref()?))
            });
            Some(Workload {
                container_id: Some(id),
                container: container.name,
                container_image: container.image,
                service_instance: instance,
                ..base.clone()
            })
        })
        .collect();
    (base, containers)
}

/// The fields of a `PodList` that are read.
#[derive(Deserialize)]
pub(super) struct PodList {
    #[serde(default)]
    metadata: ListMeta,
    #[serde(default)]
    items: Vec<Pod>,
}

#[derive(Deserialize, Default)]
struct ListMeta {
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
}

/// One line of a watch: `ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK` with a
/// pod (a bookmark's has its resource version alone), `ERROR` with a
/// `Status`. One pod at a time, so a tree of it is small.
#[derive(Deserialize)]
pub(super) struct WatchEvent {
    #[serde(rename = "type")]
    kind: String,
    object: serde_json::Value,
}

#[derive(Deserialize)]
struct Status {
    code: Option<u16>,
    message: Option<String>,
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
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
    #[serde(default)]
    labels: PodLabels,
    #[serde(default)]
    annotations: PodAnnotations,
    #[serde(default, rename = "ownerReferences")]
    owners: Vec<OwnerReference>,
}

#[derive(Deserialize, Default)]
struct PodLabels {
    #[serde(rename = "pod-template-hash")]
    template_hash: Option<String>,
    #[serde(rename = "app.kubernetes.io/instance")]
    instance: Option<String>,
    #[serde(rename = "app.kubernetes.io/name")]
    name: Option<String>,
    app: Option<String>,
}

/// OpenTelemetry's `resource.opentelemetry.io/` annotations of the service.
#[derive(Deserialize, Default)]
struct PodAnnotations {
    #[serde(rename = "resource.opentelemetry.io/service.name")]
    service_name: Option<String>,
    #[serde(rename = "resource.opentelemetry.io/service.namespace")]
    service_namespace: Option<String>,
    #[serde(rename = "resource.opentelemetry.io/service.instance.id")]
    service_instance: Option<String>,
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
    /// The image it runs, as the kubelet reports it.
    image: Option<String>,
}

#[cfg(test)]
pub(super) mod tests {
    use serde_json::{Value, json};

    use super::*;

    pub const ID: &str = "3f1e2d4c5b6a79881726354453627180a9b8c7d6e5f4031322314151617181a1";
    pub const UID: &str = "0b6c5a4e-1d2f-4a3b-9c8d-7e6f5a4b3c2d";

    /// A pod of the Deployment `prefill`, at resource version `version`,
    /// its container `sglang` started as `id` when given.
    pub fn pod(uid: &str, version: u32, id: Option<&str>, labels: Value) -> Value {
        let statuses: Vec<Value> = id
            .map(|id| {
                json!({"name": "sglang", "containerID": format!("containerd://{id}"),
                       "image": "docker.io/lmsysorg/sglang:v0.5.3-cu129"})
            })
            .into_iter()
            .collect();
        let mut labels = labels;
        labels["pod-template-hash"] = json!("7d9f8");
        json!({
            "metadata": {"name": "prefill-7d9f8-abcde", "namespace": "llm", "uid": uid,
                         "resourceVersion": version.to_string(), "labels": labels,
                         "ownerReferences": [{"kind": "ReplicaSet", "name": "prefill-7d9f8", "controller": true}]},
            "spec": {"nodeName": "gpu-1"},
            "status": {"containerStatuses": statuses}
        })
    }

    pub fn event(kind: &str, object: Value) -> WatchEvent {
        serde_json::from_value(json!({"type": kind, "object": object})).expect("a watch event")
    }

    fn ids(id: &str, uid: &str) -> Workload {
        Workload { container_id: Some(id.into()), pod_uid: Some(uid.into()), ..Workload::default() }
    }

    #[test]
    fn the_pod_list_names_containers_and_deployments() {
        let list = json!({"kind": "PodList", "metadata": {"resourceVersion": "7"},
                          "items": [pod(UID, 5, Some(ID), json!({"app": "prefill"}))]});
        let mut pods = Pods::default();
        pods.replace(serde_json::from_value(list).expect("a PodList"));
        assert_eq!(pods.resource_version(), Some("7"));
        let w = pods.find(&ids(ID, UID)).expect("found");
        assert_eq!(w.to_string(), "llm/prefill-7d9f8-abcde/sglang");
        assert_eq!((w.owner_kind.as_deref(), w.owner.as_deref()), (Some("Deployment"), Some("prefill")));
        assert_eq!(w.node.as_deref(), Some("gpu-1"));
        assert_eq!(w.service_instance.as_deref(), Some("llm.prefill-7d9f8-abcde.sglang"));
        assert_eq!(w.labels()[1], ("k8s_owner_name", "prefill".to_owned()));
        // Its image, as the kubelet reports it: what a rule's `image` matches.
        assert_eq!(w.container_image.as_deref(), Some("docker.io/lmsysorg/sglang:v0.5.3-cu129"));
        // By UID alone (another container of it, not reported yet).
        let other = "ab".repeat(32);
        let by_uid = pods.find(&ids(&other, UID)).expect("by uid");
        assert_eq!((by_uid.container, by_uid.container_id.as_deref()), (None, Some(other.as_str())));
        assert_eq!(by_uid.service_instance, None);
    }

    #[test]
    fn the_service_name_follows_opentelemetrys_kubernetes_order() {
        let name = |labels: Value, annotations: Value| {
            let mut pod = pod(UID, 1, Some(ID), labels);
            pod["metadata"]["annotations"] = annotations;
            let mut pods = Pods::default();
            pods.apply(event("ADDED", pod)).expect("applied");
            pods.find(&ids(ID, UID)).expect("found").service_name.expect("a service name")
        };
        let all = json!({"app.kubernetes.io/instance": "i", "app.kubernetes.io/name": "n", "app": "a"});
        let annotation = json!({"resource.opentelemetry.io/service.name": "s"});
        assert_eq!(name(all.clone(), annotation), "s");
        assert_eq!(name(all, json!({})), "i");
        assert_eq!(name(json!({"app.kubernetes.io/name": "n", "app": "a"}), json!({})), "n");
        assert_eq!(name(json!({"app": "a"}), json!({})), "a");
        assert_eq!(name(json!({}), json!({})), "prefill", "the Deployment");
    }

    #[test]
    fn watch_events_add_change_and_delete_pods() {
        let mut pods = Pods::default();
        pods.replace(serde_json::from_value(json!({"metadata": {"resourceVersion": "1"}})).expect("empty list"));
        assert_eq!(pods.find(&ids(ID, UID)), None);
        // Scheduled, its container not started: named by UID.
        assert_eq!(pods.apply(event("ADDED", pod(UID, 2, None, json!({})))).expect("added"), Applied::Changed);
        let pending = pods.find(&ids(ID, UID)).expect("by uid");
        assert_eq!((pending.pod.as_deref(), pending.container.as_deref()), (Some("prefill-7d9f8-abcde"), None));
        // Started: the kubelet reports its container id.
        pods.apply(event("MODIFIED", pod(UID, 3, Some(ID), json!({})))).expect("modified");
        assert_eq!(pods.find(&ids(ID, UID)).expect("by container").container.as_deref(), Some("sglang"));
        assert_eq!((pods.len(), pods.resource_version()), (1, Some("3")));
        // A bookmark moves the version only.
        pods.apply(event("BOOKMARK", json!({"metadata": {"resourceVersion": "9"}}))).expect("bookmark");
        assert_eq!((pods.len(), pods.resource_version()), (1, Some("9")));
        pods.apply(event("DELETED", pod(UID, 10, Some(ID), json!({})))).expect("deleted");
        assert_eq!((pods.find(&ids(ID, UID)), pods.len()), (None, 0));
        assert!(pods.by_container.is_empty(), "no container left behind");
    }

    #[test]
    fn gone_asks_for_a_list_and_other_errors_are_said() {
        let mut pods = Pods::default();
        let gone = json!({"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"});
        assert_eq!(pods.apply(event("ERROR", gone)).expect("status"), Applied::Gone);
        let other = json!({"kind": "Status", "code": 500, "message": "etcd is down"});
        assert_eq!(pods.apply(event("ERROR", other)).expect("status"), Applied::Failed("500 etcd is down".into()));
        let err = format!("{:#}", pods.apply(event("RENAMED", json!({}))).expect_err("unknown"));
        assert!(err.contains("unknown type \"RENAMED\""), "{err}");
    }
}
