//! The deployment base in agent/deploy/base/: the DaemonSet checked against
//! the real Kubernetes API schemas (kubernetes-validate, from the test venv,
//! offline), shown able to fail on a broken copy, and kept consistent with
//! the example config, the kustomization and the Dockerfile. The
//! components and overlays are checked in packaging.rs.
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Demo, Proc, agent_bin, require_root, root, run_to_end, summary, test_bpf_dir, test_socket, venv_python,
    wait_for,
};

/// A file of the kustomize base (the Dockerfile is one level up).
fn deploy(file: &str) -> PathBuf {
    match file {
        "Dockerfile" => root().join("agent/deploy").join(file),
        _ => root().join("agent/deploy/base").join(file),
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|err| panic!("reading {}: {err}", path.display()))
}

/// The venv's Python with kubernetes-validate importable, or a panic that
/// says how to get it.
fn validator() -> PathBuf {
    let python = venv_python();
    let (ok, _, stderr) = run_to_end(Command::new(&python).args(["-c", "import kubernetes_validate"]));
    assert!(
        ok,
        "kubernetes-validate is not installed in the test venv ({}): tests/nixl/requirements.txt pins it; \
         re-run `cargo run --release -p xtask -- setup --python`\n{stderr}",
        python.display()
    );
    python
}

/// `kubernetes-validate --strict FILE`: (passed, everything it printed).
fn validate(file: &Path) -> (bool, String) {
    let (ok, stdout, stderr) =
        run_to_end(Command::new(validator()).args(["-m", "kubernetes_validate", "--strict"]).arg(file));
    (ok, format!("{stdout}{stderr}"))
}

/// The YAML documents of a file, as JSON (PyYAML from the same venv).
fn yaml_documents(file: &Path) -> Vec<Value> {
    let script = "import json, sys, yaml\nprint(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))";
    let (ok, stdout, stderr) = run_to_end(Command::new(validator()).args(["-c", script]).arg(file));
    assert!(ok, "parsing {} as YAML: {stderr}", file.display());
    match serde_json::from_str(&stdout) {
        Ok(Value::Array(docs)) => docs.into_iter().filter(|doc| !doc.is_null()).collect(),
        other => panic!("unexpected YAML documents in {}: {other:?}", file.display()),
    }
}

fn daemonset() -> Value {
    yaml_documents(&deploy("daemonset.yaml"))
        .into_iter()
        .find(|doc| doc["kind"] == "DaemonSet")
        .expect("daemonset.yaml has a DaemonSet")
}

/// A copy of daemonset.yaml with one edit.
fn broken_copy(from: &str, to: &str) -> tempfile::NamedTempFile {
    let text = read(&deploy("daemonset.yaml"));
    assert_eq!(text.matches(from).count(), 1, "daemonset.yaml should contain `{from}` once");
    let file = tempfile::Builder::new().suffix(".yaml").tempfile().expect("temp manifest");
    std::fs::write(file.path(), text.replacen(from, to, 1)).expect("writing the broken copy");
    file
}

#[test]
fn the_daemonset_passes_the_kubernetes_schemas() {
    let (ok, out) = validate(&deploy("daemonset.yaml"));
    assert!(ok, "agent/deploy/base/daemonset.yaml does not validate:\n{out}");
    assert!(out.contains("passed for resource daemonset/stallwatch"), "{out}");
    assert!(out.contains("passed for resource namespace/stallwatch"), "{out}");
    assert!(!out.contains("Couldn't find schema"), "every resource was checked against a schema:\n{out}");
}

#[test]
fn a_manifest_with_a_wrong_field_type_is_rejected() {
    let broken = broken_copy("hostPID: true", "hostPID: \"yes\"");
    let (ok, out) = validate(broken.path());
    assert!(!ok, "a string hostPID passed validation:\n{out}");
    assert!(out.contains("spec.template.spec.hostPID") && out.contains("is not of type 'boolean'"), "{out}");

    let broken = broken_copy("containerPort: 9464", "containerPort: \"9464\"");
    let (ok, out) = validate(broken.path());
    assert!(!ok, "a string containerPort passed validation:\n{out}");
    assert!(out.contains("containerPort") && out.contains("is not of type 'integer'"), "{out}");
}

#[test]
fn a_manifest_with_a_misspelt_field_is_rejected() {
    let broken = broken_copy("hostPID: true", "hostPid: true");
    let (ok, out) = validate(broken.path());
    assert!(!ok, "an unknown field passed strict validation:\n{out}");
    assert!(out.contains("'hostPid' was unexpected"), "{out}");
}

#[test]
fn the_example_config_passes_config_check() {
    let config = deploy("config.toml");
    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(["config", "check"]).arg(&config));
    assert!(ok, "stallwatch config check {}: {stdout}\n{stderr}", config.display());
    assert!(stdout.contains(": ok"), "{stdout}");
    // No profile: every process a built-in rule matches, each with its
    // rule's profile, the rules listed in order.
    assert!(setting(&stdout, "watch").starts_with("every process a rule matches"), "{stdout}");
    let profile = setting(&stdout, "profile");
    let rules = ["-> sglang-mooncake", "-> sglang;", "-> vllm", "-> nixl"].map(|rule| profile.find(rule));
    assert!(rules.iter().all(Option::is_some) && rules.is_sorted(), "the built-in rules in order: {stdout}");
}

#[test]
fn a_broken_config_fails_config_check_with_its_line() {
    let text = read(&deploy("config.toml")).replacen("timeout = \"60s\"", "timeout = 60", 1);
    let file = tempfile::Builder::new().suffix(".toml").tempfile().expect("temp config");
    std::fs::write(file.path(), &text).expect("writing the broken config");
    let line = text.lines().position(|l| l == "timeout = 60").map(|n| n + 1).expect("edited line");
    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(["config", "check"]).arg(file.path()));
    assert!(!ok, "a bare-number timeout passed: {stdout}");
    let path = file.path().display().to_string();
    assert!(stderr.contains(&format!("config file {path}, line {line}:")), "{stderr}");
    assert!(stderr.contains("e.g. \"60s\""), "{stderr}");
}

#[test]
fn run_takes_its_settings_from_the_config_file_and_flags_win() {
    require_root();
    let mut demo = Demo::start(&["--duration", "3s"]);
    let socket = test_socket();
    let bpf_dir = test_bpf_dir();
    // The file asks for human output and a 1s timeout; the flag asks for
    // JSON, and wins; the pid comes from the flag, the rest from the file.
    let text = format!(
        "profile = \"demo\"\ntimeout = \"1s\"\ntick = \"5ms\"\noutput = \"human\"\nsocket = {:?}\nbpf_dir = {:?}\n",
        socket.display().to_string(),
        bpf_dir.display().to_string()
    );
    let file = tempfile::Builder::new().suffix(".toml").tempfile().expect("temp config");
    std::fs::write(file.path(), text).expect("writing the config");
    let mut agent = Proc::spawn(
        "stallwatch",
        Command::new(agent_bin()).args(["run", "--config"]).arg(file.path()).args([
            "--pid",
            &demo.proc.pid().to_string(),
            "--output",
            "json",
        ]),
    );
    agent.wait_stderr("watching", Duration::from_secs(30));
    // The socket is bound after the probes are attached (and said so):
    // wait for the agent to say it serves it.
    agent.wait_stderr("serving `stallwatch inflight`", Duration::from_secs(30));
    assert!(agent.stderr().contains("timeout=1s"), "the file's timeout: {}", agent.stderr());
    assert!(socket.exists(), "the agent serves the file's socket {}", socket.display());
    let pinned = std::fs::read_dir(&bpf_dir).map(Iterator::count);
    demo.go();
    // The demo exits after 3s, and the agent with it.
    let lines = agent.lines_until_exit(Duration::from_secs(30));
    let status = agent.wait(Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&bpf_dir);
    assert!(status.success(), "agent exited with {status}; stderr:\n{}", agent.stderr());
    assert!(
        pinned.as_ref().is_ok_and(|&n| n > 0),
        "the agent pins its state in the file's bpf_dir {}: {pinned:?}",
        bpf_dir.display()
    );
    let summary = summary(&lines);
    assert!(
        summary["seen"].as_u64().is_some_and(|seen| seen > 0),
        "the flag's JSON output, with requests seen: {summary}"
    );
}

/// `stallwatch config check` on the base's config.toml with the
/// DaemonSet's own variables set, as in the pod (and the ones Kubernetes
/// sets in every container): what the agent in the pod would use.
fn check_in_the_pod(ds: &Value) -> String {
    let env = ds["spec"]["template"]["spec"]["containers"][0]["env"].as_array().expect("env").clone();
    let mut command = Command::new(agent_bin());
    command.args(["config", "check"]).arg(deploy("config.toml"));
    for var in env.iter().filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with("STALLWATCH_"))) {
        command.env(var["name"].as_str().expect("name"), var["value"].as_str().expect("a plain value"));
    }
    command.envs([("KUBERNETES_SERVICE_HOST", "10.96.0.1"), ("KUBERNETES_SERVICE_PORT", "443")]);
    command.env("K8S_NODE_NAME", "gpu-node-1");
    let (ok, check, stderr) = run_to_end(&mut command);
    assert!(ok, "config check in the pod: {stderr}");
    check
}

/// The value of setting `name` in `config check`'s output.
fn setting<'a>(check: &'a str, name: &str) -> &'a str {
    check
        .lines()
        .find_map(|l| l.trim().strip_prefix(name).filter(|rest| rest.starts_with(' ')))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no `{name}` in:\n{check}"))
}

#[test]
fn the_daemonset_runs_the_agent_privileged_on_every_node_with_the_config() {
    let ds = daemonset();
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], true);
    // No GPU label by default: on a cluster without NVIDIA's feature
    // discovery it would schedule no pod at all (components/gpu-nodes adds it).
    let selector = pod["nodeSelector"].as_object().expect("nodeSelector");
    assert_eq!(selector.keys().collect::<Vec<_>>(), ["kubernetes.io/arch", "kubernetes.io/os"], "{selector:?}");
    assert_eq!(pod["nodeSelector"]["kubernetes.io/arch"], "amd64", "the kernel side is x86-64 only");
    // Every taint tolerated (a GPU taint, a cordon, a drain), as node agents do.
    let tolerations = pod["tolerations"].as_array().expect("tolerations");
    assert!(
        tolerations.iter().any(|t| t["operator"] == "Exists" && t.get("key").is_none() && t.get("effect").is_none()),
        "{pod:#}"
    );
    // The cluster's default priority: GKE refuses system-node-critical
    // outside kube-system without a quota (components/node-critical).
    assert!(pod.get("priorityClassName").is_none(), "{pod:#}");
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1);
    let agent = &containers[0];
    assert_eq!(agent["securityContext"]["privileged"], true);
    for kind in ["requests", "limits"] {
        assert!(
            agent["resources"][kind]["cpu"].is_string() && agent["resources"][kind]["memory"].is_string(),
            "{kind}: {agent:#}"
        );
    }

    // `run --config FILE`, FILE inside the ConfigMap's mount.
    let args: Vec<&str> = agent["args"].as_array().expect("args").iter().filter_map(Value::as_str).collect();
    let at = args.iter().position(|a| *a == "--config").expect("--config in the args");
    assert_eq!(args[0], "run");
    let config_path = Path::new(args[at + 1]);
    let mounts = agent["volumeMounts"].as_array().expect("volumeMounts");
    let mount_of =
        |dir: &str| mounts.iter().find(|m| m["mountPath"] == dir).unwrap_or_else(|| panic!("nothing mounted at {dir}"));
    let config_dir = config_path.parent().and_then(Path::to_str).expect("config dir");
    let config_volume = mount_of(config_dir)["name"].as_str().expect("volume name");
    let volumes = pod["volumes"].as_array().expect("volumes");
    let volume = |name: &str| volumes.iter().find(|v| v["name"] == name).unwrap_or_else(|| panic!("no volume {name}"));
    let config_map = volume(config_volume)["configMap"]["name"].as_str().expect("config comes from a ConfigMap");
    let file_name = config_path.file_name().and_then(|n| n.to_str()).expect("file name");

    // kustomize makes that ConfigMap from config.toml, under that key.
    let kustomization = yaml_documents(&deploy("kustomization.yaml")).remove(0);
    assert!(kustomization["resources"].as_array().is_some_and(|r| r.iter().any(|r| r == "daemonset.yaml")));
    let generator = kustomization["configMapGenerator"]
        .as_array()
        .and_then(|g| g.iter().find(|g| g["name"] == config_map))
        .unwrap_or_else(|| panic!("kustomization.yaml generates no ConfigMap {config_map}"));
    assert!(generator["files"].as_array().is_some_and(|f| f.iter().any(|f| f == file_name)), "{generator:#}");
    assert_eq!(generator["namespace"], ds["metadata"]["namespace"]);

    // The host filesystems, and the query socket's directory.
    for dir in ["/sys/fs/bpf", "/sys/kernel/tracing", "/sys/kernel/debug", "/run/stallwatch"] {
        let name = mount_of(dir)["name"].as_str().expect("volume name");
        assert_eq!(volume(name)["hostPath"]["path"], dir, "{dir} comes from the host");
    }
    // A bpffs the agent mounts reaches the host, so its pins outlive the pod.
    assert_eq!(mount_of("/sys/fs/bpf")["mountPropagation"], "Bidirectional");
    let check = check_in_the_pod(&ds);
    let socket = setting(&check, "socket");
    assert!(socket.starts_with("/run/stallwatch/"), "the agent's socket is in the mounted /run/stallwatch: {socket}");

    // The agent listens on every interface at the port the pod declares
    // (the probes' and the Service's), set beside it.
    let port = agent["ports"].as_array().and_then(|p| p.iter().find(|p| p["name"] == "metrics")).expect("metrics port");
    assert_eq!(
        setting(&check, "metrics"),
        format!("http://0.0.0.0:{}/metrics (from STALLWATCH_METRICS_ADDR)", port["containerPort"])
    );
    // Pods named from the API server, with the pod's service account.
    let kubernetes = setting(&check, "kubernetes");
    assert!(
        kubernetes.starts_with("https://10.96.0.1:443 (token /var/run/secrets/kubernetes.io/serviceaccount/token")
            && kubernetes.ends_with("from STALLWATCH_KUBERNETES)"),
        "{kubernetes}"
    );
    assert_eq!(pod["automountServiceAccountToken"], true);
    // No collector hard-coded: the OTEL_* variables decide.
    assert!(setting(&check, "otlp").starts_with("off (no --otlp-endpoint"), "{check}");
}

#[test]
fn the_daemonset_passes_the_node_and_pod_to_the_otlp_resource() {
    let ds = daemonset();
    let env = ds["spec"]["template"]["spec"]["containers"][0]["env"].as_array().expect("env").clone();
    let field = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["valueFrom"]["fieldRef"]["fieldPath"].as_str().map(str::to_owned))
            .unwrap_or_else(|| panic!("no downward-API {name} in {env:?}"))
    };
    // The variables agent/src/export/otlp/config.rs (K8S_ENV) reads.
    assert_eq!(field("K8S_NODE_NAME"), "spec.nodeName");
    assert_eq!(field("K8S_POD_NAME"), "metadata.name");
    assert_eq!(field("K8S_NAMESPACE_NAME"), "metadata.namespace");
    assert_eq!(field("K8S_POD_UID"), "metadata.uid");
}

#[test]
fn probes_ask_the_agent_over_http_and_the_init_check_runs_doctor_from_the_image() {
    let ds = daemonset();
    let pod = &ds["spec"]["template"]["spec"];
    let agent = &pod["containers"][0];
    // Start-up, liveness and readiness are HTTP on the metrics port: no
    // eBPF loaded per probe, as `doctor` would.
    for (probe, path) in [("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(agent[probe]["httpGet"]["path"], path, "{probe}: {agent:#}");
        assert_eq!(agent[probe]["httpGet"]["port"], "metrics", "{probe}: {agent:#}");
        assert!(agent[probe].get("exec").is_none(), "{probe}");
    }
    let init = &pod["initContainers"][0];
    assert_eq!(init["args"][0], "doctor");
    assert_eq!(init["image"], agent["image"]);
    // The binary is where the Dockerfile puts it, and the image's entrypoint.
    let dockerfile = read(&deploy("Dockerfile"));
    let binary = "/usr/local/bin/stallwatch";
    assert!(
        dockerfile.lines().any(|l| l.starts_with("COPY --from=build") && l.trim_end().ends_with(binary)),
        "Dockerfile copies no {binary}"
    );
    assert!(dockerfile.contains(&format!("ENTRYPOINT [\"{binary}\"]")), "the image's entrypoint is {binary}");
    assert!(dockerfile.contains("cargo run --release -p xtask -- build"), "the image builds through xtask");
    assert!(dockerfile.contains("COPY agent/deploy/base/config.toml /etc/stallwatch/config.toml"), "{dockerfile}");
    // The context has no .git: the commit comes in as a build argument,
    // into the variables vergen reads (agent/build.rs), and the built
    // binary is checked to say it.
    assert!(dockerfile.lines().any(|l| l == "ARG GIT_SHA"), "{dockerfile}");
    assert!(dockerfile.contains("VERGEN_GIT_SHA=\"$GIT_SHA\" VERGEN_GIT_DIRTY=\"$GIT_DIRTY\""), "{dockerfile}");
    assert!(dockerfile.contains("stallwatch --version | grep -Fx \"commit: $GIT_SHA\""), "{dockerfile}");
    assert!(dockerfile.contains("org.opencontainers.image.revision=\"$GIT_SHA\""), "{dockerfile}");
    let (_, version, _) = run_to_end(Command::new(agent_bin()).arg("--version"));
    assert!(version.lines().any(|l| l.starts_with("commit: ")), "the line the Dockerfile checks: {version}");
    let docs = std::fs::read_to_string(root().join("docs/deploying.md")).expect("deploying.md");
    assert!(docs.contains("--build-arg GIT_SHA=$(git rev-parse HEAD)"), "deploying.md shows the build argument");
}

#[test]
fn a_selecting_agent_says_its_skipped_optional_probes_once() {
    require_root();
    // As the DaemonSet's agent on a node without InfiniBand: every process
    // the profile watches lacks the same optional transport library.
    let dir = tempfile::tempdir().expect("temp dir");
    let profile = dir.path().join("optional.toml");
    std::fs::write(
        &profile,
        "name = \"demo-optional\"\nextends = \"demo\"\n\n[[activity]]\nobject = \"libuct_ib.so\"\n\
         symbol = \"uct_rc_verbs_ep_put_zcopy\"\nkind = \"post\"\noptional = true\n",
    )
    .expect("profile");
    // Two processes the selector (and nothing another test runs, nor the
    // agent: `13[1]` is not itself a match) matches.
    let demos =
        [Demo::start(&["--rate", "131", "--duration", "9s"]), Demo::start(&["--rate", "131", "--duration", "9s"])];
    let agent = Agent::selecting(&["--cmdline", "demo-prefill --wait-for-go --rate 13[1] "])
        .profile(profile.to_str().expect("UTF-8"))
        .timeout("5s")
        .discover();
    let pids = demos.each_ref().map(|demo| demo.proc.pid());
    let stderr = wait_for("both processes watched", Duration::from_secs(30), || {
        let stderr = agent.proc.stderr();
        pids.iter().all(|pid| stderr.contains(&format!("watching pid={pid} "))).then_some(stderr)
    });
    let said: Vec<&str> = stderr.lines().filter(|l| l.contains("optional probes skipped")).collect();
    assert_eq!(said.len(), 1, "one line an agent, not one a process:\n{stderr}");
    assert!(
        said[0].contains("skipped=uct_rc_verbs_ep_put_zcopy") && said[0].len() < 400,
        "one short line: {}",
        said[0]
    );
    assert!(!said[0].contains("mapped libraries"), "{}", said[0]);
}
