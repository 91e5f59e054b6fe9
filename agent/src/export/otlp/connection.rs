//! The connection to the collector, shared by the exporters of every
//! watched process ([`super::resources`]): one HTTP/2 channel (gRPC) or
//! one HTTP client pool (HTTP/protobuf).
//!
//! Built here rather than by `opentelemetry-otlp` so that the exporters
//! share it, and so that TLS trusts what the OpenTelemetry environment
//! says: the system's roots and the CA file of
//! `OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE` (the exporter reads neither).
//! rustls runs on the `ring` provider ([`crate::util::tls`]).
use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow};
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{RetryPolicy, WithExportConfig as _, WithHttpConfig as _, WithTonicConfig as _};

use super::config::{OtlpTarget, Protocol};

/// What a failed export to a TLS endpoint most often means, and its fix.
pub const UNTRUSTED_HINT: &str = "if the collector's certificate is not trusted, set OTEL_EXPORTER_OTLP_CERTIFICATE to \
     the PEM file of the CA that signed it (the system's roots are trusted already)";

/// Retries within the export timeout: a collector restart of a few seconds
/// loses nothing that fits in the queue meanwhile.
fn retry() -> RetryPolicy {
    RetryPolicy::recommended()
        .with_max_retries(10)
        .with_initial_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(2))
}

/// One connection to the collector.
#[derive(Clone)]
pub enum Connection {
    Grpc(tonic::transport::Channel),
    Http { client: CausedClient, endpoint: String },
}

impl Connection {
    /// Connect lazily to `target`: nothing is sent before the first export,
    /// so a collector that is down does not keep the agent from starting.
    pub fn open(target: &OtlpTarget) -> Result<Self> {
        crate::util::tls::install_ring();
        let ca = target.ca.as_ref().filter(|_| target.is_tls());
        match target.protocol {
            Protocol::Grpc => {
                let mut endpoint = tonic::transport::Endpoint::from_shared(target.endpoint.clone())
                    .map_err(|err| anyhow!("{} {:?} is not a gRPC endpoint: {err}", target.source, target.endpoint))?;
                if target.is_tls() {
                    let mut tls = tonic::transport::ClientTlsConfig::new().with_native_roots();
                    if let Some(ca) = ca {
                        tls = tls.ca_certificate(tonic::transport::Certificate::from_pem(&ca.pem));
                    }
                    endpoint =
                        endpoint.tls_config(tls).with_context(|| format!("setting up TLS for {}", target.endpoint))?;
                }
                // Each export request, not only the connect (the exporter's
                // own retries stop at this timeout too, but do not bound a
                // request that never gets an answer).
                Ok(Connection::Grpc(endpoint.timeout(target.timeout).connect_lazy()))
            }
            Protocol::HttpProtobuf => {
                let mut client = reqwest::Client::builder().timeout(target.timeout);
                if let Some(ca) = ca {
                    let certificates = reqwest::Certificate::from_pem_bundle(ca.pem.as_bytes())
                        .with_context(|| format!("{}={}: reading its certificates", ca.source, ca.path.display()))?;
                    for certificate in certificates {
                        client = client.add_root_certificate(certificate);
                    }
                }
                let client = client.build().context("building the OTLP HTTP client")?;
                Ok(Connection::Http { client: CausedClient::new(client), endpoint: target.endpoint.clone() })
            }
        }
    }

    /// Where the cause of a failed HTTP request is kept (none for gRPC,
    /// whose errors carry theirs).
    pub fn causes(&self) -> Option<Causes> {
        match self {
            Connection::Grpc(_) => None,
            Connection::Http { client, .. } => Some(client.causes.clone()),
        }
    }

    /// A span exporter over this connection (headers, timeout and
    /// compression from the `OTEL_EXPORTER_OTLP_*` variables).
    pub fn exporter(&self) -> Result<opentelemetry_otlp::SpanExporter> {
        let builder = opentelemetry_otlp::SpanExporter::builder();
        match self {
            Connection::Grpc(channel) => {
                builder.with_tonic().with_channel(channel.clone()).with_retry_policy(retry()).build()
            }
            Connection::Http { client, endpoint } => builder
                .with_http()
                .with_http_client(client.clone())
                .with_endpoint(endpoint)
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_retry_policy(retry())
                .build(),
        }
        .map_err(|err| anyhow!("building the OTLP span exporter: {err}"))
    }
}

/// The cause of the last HTTP request that failed before an answer (TLS,
/// connect, timeout), taken by whoever reports the export's failure.
#[derive(Clone, Debug, Default)]
pub struct Causes(Arc<Mutex<Option<String>>>);

impl Causes {
    /// `err` with the cause kept since the last take, if any.
    pub fn explain(&self, err: impl std::fmt::Display) -> String {
        match self.0.lock().ok().and_then(|mut cause| cause.take()) {
            Some(cause) => format!("{err}: {cause}"),
            None => err.to_string(),
        }
    }

    fn keep(&self, cause: String) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(cause);
        }
    }
}

/// reqwest as the exporter's HTTP client, keeping why a request failed.
///
/// opentelemetry-otlp 0.33 turns every transport error into "HTTP export
/// failed: network error" and logs the cause only through its own internal
/// logs, so an untrusted certificate and a refused connection read alike;
/// this keeps the cause's whole chain (reqwest, hyper, rustls: `invalid
/// peer certificate: UnknownIssuer`) for the agent's error line.
#[derive(Clone, Debug)]
pub struct CausedClient {
    client: reqwest::Client,
    causes: Causes,
}

impl CausedClient {
    fn new(client: reqwest::Client) -> Self {
        Self { client, causes: Causes::default() }
    }
}

impl HttpClient for CausedClient {
    // What `#[async_trait]` writes for the trait's `async fn`, by hand so
    // that the agent needs no macro crate for one method.
    fn send_bytes<'life0, 'async_trait>(
        &'life0 self,
        request: Request<Bytes>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<Bytes>, HttpError>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move {
            let result = self.client.send_bytes(request).await;
            if let Err(err) = &result {
                self.causes.keep(chain(err.as_ref()));
            }
            result
        })
    }
}

/// An error and its sources, `: `-separated, repeats left out (reqwest
/// and hyper repeat their source's text in their own).
fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(err) = source {
        let text = err.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = err.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failed_request_keeps_its_cause() {
        // A port nothing listens on: the connection is refused.
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        crate::util::tls::install_ring();
        let client = CausedClient::new(reqwest::Client::new());
        let request = Request::post(format!("http://127.0.0.1:{port}/v1/traces")).body(Bytes::new()).expect("request");
        assert!(client.send_bytes(request).await.is_err());
        let explained = client.causes.explain("HTTP export failed: network error");
        assert!(explained.starts_with("HTTP export failed: network error: error sending request"), "{explained}");
        assert!(explained.to_lowercase().contains("connection refused"), "{explained}");
        // Taken: the next failure without a cause is not given this one.
        assert_eq!(client.causes.explain("later"), "later");
    }
}
