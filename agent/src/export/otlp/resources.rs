//! One resource per watched process, the way OpenTelemetry eBPF
//! Instrumentation (Beyla) sends what it watches: a span's resource
//! describes the process it is about (`process.pid`,
//! `process.executable.name`, `container.id`, `k8s.pod.name`, ...), not
//! only the agent that saw it, so a backend groups and filters stalls by
//! the stuck workload like any of that workload's own telemetry.
//!
//! The `opentelemetry-otlp` exporter carries one resource per exporter, so
//! there is one exporter per watched process, all sharing one connection
//! ([`Connection`]): a batch is split by process and each part sent with
//! its process's exporter. The agent's own resource (service, host, and
//! `OTEL_RESOURCE_ATTRIBUTES`) is the base of each; the agent's own pod
//! (`K8S_POD_NAME` ...) is left out of them, since it is not the pod the
//! spans are about.
//!
//! A process whose pod is known is its own service: `service.name`,
//! `service.namespace` and `service.instance.id` as OpenTelemetry's
//! Kubernetes conventions derive them from the pod (the workload's
//! attributes), in place of the agent's. The agent that saw it is
//! `telemetry.sdk.name`/`telemetry.sdk.version`, as OBI names itself on
//! what it instruments; on a process with no pod known, `service.name`
//! stays the agent's and `service.instance.id` is the agent's own pod
//! (`namespace.pod`), else its host.
use std::{collections::HashMap, sync::Arc};

use opentelemetry::{Key, KeyValue};
use opentelemetry_sdk::{Resource, trace::SpanExporter as _};

use super::{connection::Connection, names::attr};
use crate::export::workload::{Directory, Workload};

/// Exporters kept at most; past it they are dropped and rebuilt as needed
/// (processes come and go; each exporter is a few allocations).
const MAX_EXPORTERS: usize = 4096;

/// The agent's own pod in its resource: not carried on a watched process's.
const AGENT_POD_KEYS: [&str; 3] = ["k8s.pod.name", "k8s.namespace.name", "k8s.pod.uid"];

/// The agent, as the "SDK" that made every span.
const SDK_NAME: &str = "stallwatch";

/// A process's exporter and what its resource was made of.
struct ForProcess {
    workload: Option<Arc<Workload>>,
    executable: Option<Arc<str>>,
    exporter: Arc<opentelemetry_otlp::SpanExporter>,
}

/// The exporters of the watched processes.
pub struct Resources {
    connection: Connection,
    base: Resource,
    workloads: Option<Directory>,
    executables: HashMap<u32, Arc<str>>,
    by_pid: HashMap<u32, ForProcess>,
}

impl Resources {
    pub fn new(connection: Connection, base: Resource, workloads: Option<Directory>) -> Self {
        Self { connection, base, workloads, executables: HashMap::new(), by_pid: HashMap::new() }
    }

    /// The executable name `pid`'s resource carries.
    pub fn name_process(&mut self, pid: u32, executable: &str) {
        self.executables.insert(pid, executable.into());
    }

    /// The shared connection's kept causes of failed HTTP requests.
    pub fn causes(&self) -> Option<super::connection::Causes> {
        self.connection.causes()
    }

    /// The exporter for spans of `pid`, its resource up to date with what
    /// is known of the process now (its workload may be found after its
    /// first spans).
    pub fn exporter(&mut self, pid: u32) -> anyhow::Result<Arc<opentelemetry_otlp::SpanExporter>> {
        let workload = self.workloads.as_ref().and_then(|w| w.get(pid)).filter(|w| !w.is_empty());
        let executable = self.executables.get(&pid).cloned();
        let stale = self.by_pid.get(&pid).is_none_or(|have| have.workload != workload || have.executable != executable);
        if stale {
            if self.by_pid.len() >= MAX_EXPORTERS {
                self.by_pid.clear();
            }
            let mut exporter = self.connection.exporter()?;
            exporter.set_resource(&resource(&self.base, pid, executable.as_deref(), workload.as_deref()));
            self.by_pid.insert(pid, ForProcess { workload, executable, exporter: Arc::new(exporter) });
        }
        Ok(Arc::clone(&self.by_pid[&pid].exporter))
    }
}

/// `base` without the agent's pod, plus the process and its workload (its
/// service in place of the agent's), and the agent as the SDK.
pub fn resource(base: &Resource, pid: u32, executable: Option<&str>, workload: Option<&Workload>) -> Resource {
    let of_base = |key: &'static str| base.get(&Key::from_static_str(key)).map(|value| value.to_string());
    let agent = match (of_base("k8s.namespace.name"), of_base("k8s.pod.name")) {
        (Some(namespace), Some(pod)) => Some(format!("{namespace}.{pod}")),
        _ => of_base("host.name"),
    };
    let mut attributes: Vec<KeyValue> = base
        .iter()
        .filter(|(key, _)| !AGENT_POD_KEYS.contains(&key.as_str()))
        .map(|(key, value)| KeyValue::new(key.clone(), value.clone()))
        .collect();
    attributes.push(KeyValue::new(attr::PROCESS_PID, i64::from(pid)));
    if let Some(executable) = executable {
        attributes.push(KeyValue::new(attr::PROCESS_EXECUTABLE_NAME, executable.to_owned()));
    }
    let mut put = |key: &'static str, value: String| {
        attributes.retain(|kv| kv.key != Key::from_static_str(key));
        attributes.push(KeyValue::new(key, value));
    };
    put("telemetry.sdk.name", SDK_NAME.to_owned());
    put("telemetry.sdk.version", env!("CARGO_PKG_VERSION").to_owned());
    if let (None, Some(agent)) = (workload.and_then(|w| w.service_name.as_ref()), agent) {
        put("service.instance.id", agent);
    }
    for (key, value) in workload.map(Workload::attributes).unwrap_or_default() {
        put(key, value);
    }
    let builder = Resource::builder_empty().with_attributes(attributes);
    match base.schema_url() {
        Some(url) => builder.with_schema_url([], url.to_owned()).build(),
        None => builder.build(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(resource: &Resource, key: &'static str) -> Option<String> {
        resource.get(&Key::from_static_str(key)).map(|value| value.to_string())
    }

    #[test]
    fn a_process_resource_names_the_process_and_its_pod_not_the_agents() {
        let base = Resource::builder_empty()
            .with_attributes([
                KeyValue::new("service.name", "stallwatch"),
                KeyValue::new("host.name", "gpu-node-7"),
                KeyValue::new("k8s.node.name", "gpu-node-7"),
                KeyValue::new("k8s.pod.name", "stallwatch-x2k4q"),
                KeyValue::new("k8s.namespace.name", "monitoring"),
            ])
            .build();
        let pod = Workload {
            container_id: Some("ab".repeat(32)),
            namespace: Some("llm".into()),
            pod: Some("prefill-0".into()),
            container: Some("sglang".into()),
            node: Some("gpu-node-7".into()),
            ..Workload::default()
        };
        let resource = resource(&base, 4242, Some("python3.12"), Some(&pod));
        assert_eq!(get(&resource, "service.name").as_deref(), Some("stallwatch"));
        assert_eq!(get(&resource, "host.name").as_deref(), Some("gpu-node-7"));
        assert_eq!(get(&resource, "process.pid").as_deref(), Some("4242"));
        assert_eq!(get(&resource, "process.executable.name").as_deref(), Some("python3.12"));
        assert_eq!(get(&resource, "k8s.pod.name").as_deref(), Some("prefill-0"));
        assert_eq!(get(&resource, "k8s.namespace.name").as_deref(), Some("llm"));
        assert_eq!(get(&resource, "k8s.container.name").as_deref(), Some("sglang"));
        assert_eq!(get(&resource, "container.id"), pod.container_id);
        // The agent is the SDK; with no service of the pod's, the agent is
        // the service and its pod the instance.
        assert_eq!(get(&resource, "telemetry.sdk.name").as_deref(), Some("stallwatch"));
        assert_eq!(get(&resource, "telemetry.sdk.version").as_deref(), Some(env!("CARGO_PKG_VERSION")));
        assert_eq!(get(&resource, "service.instance.id").as_deref(), Some("monitoring.stallwatch-x2k4q"));
        assert_eq!(resource.len(), 12, "{resource:?}");

        // The pod's own service in place of the agent's.
        let service = Workload {
            service_name: Some("sglang-prefill".into()),
            service_namespace: Some("llm".into()),
            service_instance: Some("llm.prefill-0.sglang".into()),
            ..pod.clone()
        };
        let own = super::resource(&base, 4242, None, Some(&service));
        assert_eq!(get(&own, "service.name").as_deref(), Some("sglang-prefill"));
        assert_eq!(get(&own, "service.namespace").as_deref(), Some("llm"));
        assert_eq!(get(&own, "service.instance.id").as_deref(), Some("llm.prefill-0.sglang"));
        assert_eq!(get(&own, "telemetry.sdk.name").as_deref(), Some("stallwatch"));

        // No workload known: the agent's pod is still not the process's.
        let bare = super::resource(&base, 7, None, None);
        assert_eq!(get(&bare, "k8s.pod.name"), None);
        assert_eq!(get(&bare, "k8s.node.name").as_deref(), Some("gpu-node-7"));
        assert_eq!(get(&bare, "process.pid").as_deref(), Some("7"));
    }
}
