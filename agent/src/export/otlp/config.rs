//! Where spans go and what they say about their source: the `--otlp-*`
//! flags, the standard `OTEL_EXPORTER_OTLP_*` variables and the resource.
//!
//! Precedence, highest first: the flag, the traces-specific variable
//! (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `..._TRACES_PROTOCOL`), the
//! generic one (`OTEL_EXPORTER_OTLP_ENDPOINT`, `..._PROTOCOL`). Export is
//! off unless one of the endpoint sources is set. Headers, timeout and
//! compression (`OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`, `..._TIMEOUT`,
//! `..._COMPRESSION`) are read by the `opentelemetry-otlp` exporter itself.
//!
//! An `https://` endpoint is reached over TLS (rustls), trusting the
//! system's roots (`/etc/ssl/certs`, `SSL_CERT_FILE`) and the CA file in
//! `OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE` / `OTEL_EXPORTER_OTLP_CERTIFICATE`
//! (PEM), which is read and checked here, at start-up.
use std::{fmt, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result, bail};
use opentelemetry::{Key, KeyValue};
use opentelemetry_sdk::{
    Resource,
    resource::{EnvResourceDetector, ResourceDetector as _},
};

pub const ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
pub const TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
pub const PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
pub const TRACES_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL";
pub const SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
pub const CERTIFICATE: &str = "OTEL_EXPORTER_OTLP_CERTIFICATE";
pub const TRACES_CERTIFICATE: &str = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE";
pub const TIMEOUT: &str = "OTEL_EXPORTER_OTLP_TIMEOUT";
pub const TRACES_TIMEOUT: &str = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT";

/// The OTLP exporter spec's default export timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The service name spans carry unless `OTEL_SERVICE_NAME` (or
/// `service.name` in `OTEL_RESOURCE_ATTRIBUTES`) says otherwise.
pub const DEFAULT_SERVICE_NAME: &str = "stallwatch";

/// Kubernetes resource attributes and the variables they are read from,
/// meant to be set through the downward API (`fieldRef: spec.nodeName`,
/// `metadata.name`, `metadata.namespace`, `metadata.uid`).
pub const K8S_ENV: [(&str, &str); 4] = [
    ("k8s.node.name", "K8S_NODE_NAME"),
    ("k8s.pod.name", "K8S_POD_NAME"),
    ("k8s.namespace.name", "K8S_NAMESPACE_NAME"),
    ("k8s.pod.uid", "K8S_POD_UID"),
];

/// The OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Protocol {
    /// OTLP/gRPC (port 4317 by convention).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (port 4318 by convention).
    #[value(name = "http", alias = "http/protobuf")]
    HttpProtobuf,
}

impl Protocol {
    /// The spec's name, as in `OTEL_EXPORTER_OTLP_PROTOCOL`.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Grpc => "grpc",
            Protocol::HttpProtobuf => "http/protobuf",
        }
    }

    fn from_env(name: &str, value: &str) -> Result<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "grpc" => Ok(Protocol::Grpc),
            "http/protobuf" | "http" => Ok(Protocol::HttpProtobuf),
            "http/json" => bail!("{name}=http/json is not supported: set it to `http/protobuf` or `grpc`"),
            other => bail!("{name}={other:?} is not an OTLP protocol: set it to `grpc` or `http/protobuf`"),
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the command line said about OTLP.
#[derive(Debug, Clone, Default)]
pub struct OtlpOptions {
    /// `--otlp-endpoint`: a base URL like `OTEL_EXPORTER_OTLP_ENDPOINT`
    /// (for HTTP, `/v1/traces` is appended when the URL has no path).
    pub endpoint: Option<String>,
    /// `--otlp-protocol`.
    pub protocol: Option<Protocol>,
    /// Where `endpoint` was given, as messages name it (its variable, the
    /// config file); `None`: `--otlp-endpoint`.
    pub endpoint_from: Option<&'static str>,
}

/// The collector spans are sent to, fully resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpTarget {
    /// The URL requests go to (for HTTP, including the `/v1/traces` path).
    pub endpoint: String,
    pub protocol: Protocol,
    /// Where the endpoint came from (a flag or a variable name), for
    /// error messages.
    pub source: &'static str,
    /// The CA to trust besides the system's roots, for an `https://`
    /// endpoint.
    pub ca: Option<CaFile>,
    /// How long one export request may take (`OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT`,
    /// in ms): a collector that accepts and never answers is given up on.
    pub timeout: Duration,
}

impl OtlpTarget {
    /// A target over plain HTTP or with the system's roots only.
    pub fn new(endpoint: String, protocol: Protocol, source: &'static str) -> Self {
        Self { endpoint, protocol, source, ca: None, timeout: DEFAULT_TIMEOUT }
    }

    pub fn is_tls(&self) -> bool {
        self.endpoint.starts_with("https://")
    }
}

/// A PEM file of CA certificates, read at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaFile {
    pub path: PathBuf,
    /// The variable that named it.
    pub source: &'static str,
    pub pem: String,
}

impl CaFile {
    /// `OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE`, else `..._CERTIFICATE`:
    /// read, and checked to hold a PEM certificate.
    fn from_env(env: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let Some((source, path)) =
            [TRACES_CERTIFICATE, CERTIFICATE].into_iter().find_map(|name| Some((name, env(name)?)))
        else {
            return Ok(None);
        };
        let path = PathBuf::from(path);
        let pem =
            crate::util::files::read_text(&path, "CA file").with_context(|| format!("{source}={}", path.display()))?;
        if !pem.contains("-----BEGIN CERTIFICATE-----") {
            bail!(
                "{source}={}: no PEM certificate in it (`-----BEGIN CERTIFICATE-----`): give the CA's certificate, \
                 e.g. the ca.crt that signed the collector's",
                path.display()
            );
        }
        Ok(Some(Self { path, source, pem }))
    }
}

impl OtlpOptions {
    /// The collector to export to, or `None` when no endpoint is configured
    /// (export is off).
    pub fn resolve(&self) -> Result<Option<OtlpTarget>> {
        self.resolve_with(|name| std::env::var(name).ok())
    }

    /// [`resolve`](Self::resolve) with the environment given as a lookup
    /// (for tests).
    pub fn resolve_with(&self, env: impl Fn(&str) -> Option<String>) -> Result<Option<OtlpTarget>> {
        // The standard switches first: off means off, whatever the endpoint.
        if super::sampling::disabled_by(&env)?.is_some() {
            return Ok(None);
        }
        super::sampling::check_headers(&env)?;
        let env = |name: &str| env(name).filter(|value| !value.trim().is_empty());
        let protocol = match self.protocol {
            Some(protocol) => protocol,
            None => match (env(TRACES_PROTOCOL), env(PROTOCOL)) {
                (Some(value), _) => Protocol::from_env(TRACES_PROTOCOL, &value)?,
                (None, Some(value)) => Protocol::from_env(PROTOCOL, &value)?,
                // The OTLP exporter spec's default transport.
                (None, None) => Protocol::HttpProtobuf,
            },
        };
        let (raw, source, append_path) = if let Some(endpoint) = &self.endpoint {
            (endpoint.clone(), self.endpoint_from.unwrap_or("--otlp-endpoint"), AppendPath::IfNone)
        } else if let Some(endpoint) = env(TRACES_ENDPOINT) {
            (endpoint, TRACES_ENDPOINT, AppendPath::Never)
        } else if let Some(endpoint) = env(ENDPOINT) {
            (endpoint, ENDPOINT, AppendPath::Always)
        } else {
            return Ok(None);
        };
        let url = Url::parse(raw.trim(), source)?;
        let endpoint = match protocol {
            // gRPC paths come from the service definition, never the URL.
            Protocol::Grpc => url.origin(),
            Protocol::HttpProtobuf => url.with_traces_path(append_path),
        };
        let ca = CaFile::from_env(env)?;
        let timeout = match [TRACES_TIMEOUT, TIMEOUT].into_iter().find_map(|name| Some((name, env(name)?))) {
            Some((name, ms)) => match ms.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Duration::from_millis(ms),
                _ => bail!("{name}={ms:?} is not a timeout: give milliseconds, e.g. `{name}=10000`"),
            },
            None => DEFAULT_TIMEOUT,
        };
        Ok(Some(OtlpTarget { endpoint, protocol, source, ca, timeout }))
    }
}

#[derive(Clone, Copy)]
enum AppendPath {
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` is a base URL: the signal path is
    /// always appended.
    Always,
    /// `--otlp-endpoint`: appended when the URL has no path of its own.
    IfNone,
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is used as given.
    Never,
}

/// An `http://host:port[/path]` URL, checked enough to fail at start-up
/// with a message rather than at the first export.
struct Url<'a> {
    scheme: &'a str,
    authority: &'a str,
    /// Everything from the first `/` after the authority, possibly empty.
    path: &'a str,
}

impl<'a> Url<'a> {
    fn parse(raw: &'a str, source: &str) -> Result<Self> {
        let Some((scheme, rest)) = raw.split_once("://") else {
            bail!("{source} {raw:?} is not a URL: give the scheme, e.g. `http://{raw}`");
        };
        if !matches!(scheme, "http" | "https") {
            bail!("{source} {raw:?} has scheme {scheme:?}: use `http://HOST:PORT` or `https://HOST:PORT`");
        }
        let (authority, path) = rest.find(['/', '?', '#']).map_or((rest, ""), |at| rest.split_at(at));
        if path.starts_with(['?', '#']) {
            bail!("{source} {raw:?} has a query or fragment: give `http://HOST:PORT[/PATH]`");
        }
        // `[v6]:port`, `[v6]`, `host:port` or `host`.
        let (host, port) = match authority.strip_prefix('[') {
            Some(v6) => match v6.split_once(']') {
                Some((host, "")) => (host, None),
                Some((host, port)) => (host, Some(port.strip_prefix(':').unwrap_or(port))),
                None => ("", None),
            },
            None => match authority.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            },
        };
        if let Some(port) = port.filter(|port| port.parse::<u16>().is_err()) {
            bail!("{source} {raw:?} has port {port:?}, which is not a number in 0..=65535");
        }
        if host.is_empty() || authority.contains('@') || authority.chars().any(char::is_whitespace) {
            bail!("{source} {raw:?} has no usable host: give `http://HOST:PORT`");
        }
        Ok(Self { scheme, authority, path })
    }

    fn origin(&self) -> String {
        format!("{}://{}", self.scheme, self.authority)
    }

    fn with_traces_path(&self, append: AppendPath) -> String {
        let base = self.path.trim_end_matches('/');
        let path = match append {
            AppendPath::Always => format!("{base}/v1/traces"),
            AppendPath::IfNone if base.is_empty() => "/v1/traces".to_owned(),
            AppendPath::IfNone | AppendPath::Never => self.path.to_owned(),
        };
        format!("{}{path}", self.origin())
    }
}

/// This host's name (the kernel's nodename; in a pod without host
/// networking that is the pod's hostname, hence `k8s.node.name`).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The resource every span of this agent carries: `service.name`
/// (`OTEL_SERVICE_NAME`, else [`DEFAULT_SERVICE_NAME`]), `service.version`,
/// `host.name`, the [`K8S_ENV`] attributes that are set, anything in
/// `OTEL_RESOURCE_ATTRIBUTES` (which wins over what is detected here), and
/// the SDK's `telemetry.sdk.*`.
pub fn resource(host: &str) -> Resource {
    resource_with(host, |name| std::env::var(name).ok())
}

fn resource_with(host: &str, env: impl Fn(&str) -> Option<String>) -> Resource {
    let env = |name: &str| env(name).map(|value| value.trim().to_owned()).filter(|value| !value.is_empty());
    let from_env = EnvResourceDetector::new().detect();
    let unset = |key: &'static str| from_env.get(&Key::from_static_str(key)).is_none();
    let mut attributes = Vec::new();
    if env(SERVICE_NAME).is_none() && unset("service.name") {
        attributes.push(KeyValue::new("service.name", DEFAULT_SERVICE_NAME));
    }
    if unset("service.version") {
        attributes.push(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    }
    if unset("host.name") {
        attributes.push(KeyValue::new("host.name", host.to_owned()));
    }
    for (key, var) in K8S_ENV {
        if let (Some(value), true) = (env(var), unset(key)) {
            attributes.push(KeyValue::new(key, value));
        }
    }
    // builder() starts from OTEL_SERVICE_NAME, the SDK's own attributes and
    // OTEL_RESOURCE_ATTRIBUTES; ours only fill what those left unset.
    Resource::builder().with_attributes(attributes).build()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn resolve(flag: Option<&str>, protocol: Option<Protocol>, env: &[(&str, &str)]) -> Result<Option<OtlpTarget>> {
        let env: HashMap<String, String> = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        OtlpOptions { endpoint: flag.map(str::to_owned), protocol, endpoint_from: None }
            .resolve_with(|name| env.get(name).cloned())
    }

    fn endpoint(
        flag: Option<&str>,
        protocol: Option<Protocol>,
        env: &[(&str, &str)],
    ) -> (String, Protocol, &'static str) {
        let target = resolve(flag, protocol, env).expect("valid").expect("configured");
        (target.endpoint, target.protocol, target.source)
    }

    #[test]
    fn off_without_an_endpoint() {
        assert_eq!(resolve(None, Some(Protocol::Grpc), &[(PROTOCOL, "grpc")]).expect("valid"), None);
        assert_eq!(resolve(None, None, &[(ENDPOINT, "  ")]).expect("valid"), None);
    }

    #[test]
    fn the_flag_wins_and_gets_the_traces_path_for_http() {
        let env = [(ENDPOINT, "http://env:4318"), (TRACES_ENDPOINT, "http://traces:4318/x")];
        assert_eq!(
            endpoint(Some("http://127.0.0.1:4318"), None, &env),
            ("http://127.0.0.1:4318/v1/traces".to_owned(), Protocol::HttpProtobuf, "--otlp-endpoint")
        );
        assert_eq!(endpoint(Some("http://c:4318/custom"), None, &[]).0, "http://c:4318/custom");
        assert_eq!(endpoint(Some("http://c:4317/ignored"), Some(Protocol::Grpc), &[]).0, "http://c:4317");
    }

    #[test]
    fn environment_endpoints_follow_the_otlp_spec() {
        // The traces variable is used as is; the generic one is a base URL.
        assert_eq!(
            endpoint(None, None, &[(TRACES_ENDPOINT, "http://t:4318/in"), (ENDPOINT, "http://e:1")]).0,
            "http://t:4318/in"
        );
        assert_eq!(endpoint(None, None, &[(ENDPOINT, "http://e:4318/otlp/")]).0, "http://e:4318/otlp/v1/traces");
        assert_eq!(endpoint(None, None, &[(ENDPOINT, "http://e:4318")]).0, "http://e:4318/v1/traces");
        assert_eq!(endpoint(None, None, &[(ENDPOINT, "http://[::1]:4317"), (PROTOCOL, "grpc")]).0, "http://[::1]:4317");
        assert_eq!(endpoint(Some("http://[::1]"), None, &[]).0, "http://[::1]/v1/traces");
    }

    #[test]
    fn protocol_precedence() {
        let env = [(ENDPOINT, "http://e:4317"), (PROTOCOL, "grpc"), (TRACES_PROTOCOL, "http/protobuf")];
        assert_eq!(endpoint(None, None, &env).1, Protocol::HttpProtobuf);
        assert_eq!(endpoint(None, Some(Protocol::Grpc), &env).1, Protocol::Grpc);
        assert_eq!(endpoint(None, None, &[(ENDPOINT, "http://e:4317"), (PROTOCOL, "GRPC")]).1, Protocol::Grpc);
        assert_eq!(endpoint(None, None, &[(ENDPOINT, "http://e:4318")]).1, Protocol::HttpProtobuf);
    }

    #[test]
    fn bad_configuration_says_what_to_fix() {
        let err = |flag: &str| format!("{:#}", resolve(Some(flag), None, &[]).expect_err(flag));
        assert!(err("localhost:4317").contains("give the scheme, e.g. `http://localhost:4317`"));
        assert!(err("ftp://c:4318").contains("use `http://HOST:PORT` or `https://HOST:PORT`"));
        assert!(err("http://c:99999").contains("not a number"));
        assert!(err("http://:4318").contains("no usable host"));
        assert!(err("http://c:4318?x=1").contains("query"));
        let env = format!(
            "{:#}",
            resolve(None, None, &[(ENDPOINT, "http://e:1"), (PROTOCOL, "http/json")]).expect_err("json")
        );
        assert!(env.contains("OTEL_EXPORTER_OTLP_PROTOCOL=http/json is not supported"), "{env}");
        let env = format!("{:#}", resolve(None, None, &[(TRACES_ENDPOINT, "e:1")]).expect_err("no scheme"));
        assert!(env.starts_with(TRACES_ENDPOINT), "{env}");
    }

    #[test]
    fn https_endpoints_with_the_ca_file_the_environment_names() {
        let target = resolve(Some("https://collector:4317"), Some(Protocol::Grpc), &[]).expect("valid").expect("set");
        assert!(target.is_tls() && target.ca.is_none());
        assert_eq!(target.endpoint, "https://collector:4317");
        let dir = tempfile::tempdir().expect("temp dir");
        let (ca, other) = (dir.path().join("ca.crt"), dir.path().join("other.crt"));
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").expect("write");
        std::fs::write(&other, "not a certificate").expect("write");
        let (ca, other) = (ca.to_str().expect("UTF-8"), other.to_str().expect("UTF-8"));
        let env = [(ENDPOINT, "https://c:4318"), (CERTIFICATE, other), (TRACES_CERTIFICATE, ca)];
        let target = resolve(None, None, &env).expect("valid").expect("set");
        let file = target.ca.expect("a CA file");
        assert_eq!((file.source, file.path.to_str()), (TRACES_CERTIFICATE, Some(ca)), "the traces variable wins");
        let err = format!("{:#}", resolve(None, None, &env[..2]).expect_err("not PEM"));
        assert!(err.starts_with(&format!("{CERTIFICATE}={other}: no PEM certificate")), "{err}");
        let err = format!(
            "{:#}",
            resolve(None, None, &[(ENDPOINT, "https://c"), (CERTIFICATE, "/nonexistent/ca.crt")]).expect_err("missing")
        );
        assert!(err.contains("reading CA file /nonexistent/ca.crt"), "{err}");
    }

    #[test]
    fn the_export_timeout_follows_the_otlp_variables() {
        let timeout = |env: &[(&str, &str)]| resolve(Some("http://c:4318"), None, env).map(|t| t.expect("set").timeout);
        assert_eq!(timeout(&[]).expect("default"), DEFAULT_TIMEOUT);
        assert_eq!(timeout(&[(TIMEOUT, "2500")]).expect("ms"), Duration::from_millis(2500));
        assert_eq!(timeout(&[(TIMEOUT, "2500"), (TRACES_TIMEOUT, "700")]).expect("ms"), Duration::from_millis(700));
        let err = format!("{:#}", timeout(&[(TIMEOUT, "10s")]).expect_err("not ms"));
        assert!(err.contains("give milliseconds, e.g. `OTEL_EXPORTER_OTLP_TIMEOUT=10000`"), "{err}");
    }

    #[test]
    fn resource_defaults_and_k8s_attributes() {
        let env: HashMap<&str, &str> = [("K8S_NODE_NAME", "gpu-node-7"), ("K8S_POD_NAME", " ")].into_iter().collect();
        let resource = resource_with("host-a", |name| env.get(name).map(|v| (*v).to_owned()));
        let get = |key: &'static str| resource.get(&Key::from_static_str(key)).map(|v| v.to_string());
        assert_eq!(get("host.name").as_deref(), Some("host-a"));
        assert_eq!(get("k8s.node.name").as_deref(), Some("gpu-node-7"));
        assert_eq!(get("k8s.pod.name"), None, "blank variables are unset");
        if std::env::var_os(SERVICE_NAME).is_none() && std::env::var_os("OTEL_RESOURCE_ATTRIBUTES").is_none() {
            assert_eq!(get("service.name").as_deref(), Some(DEFAULT_SERVICE_NAME));
        }
    }
}
