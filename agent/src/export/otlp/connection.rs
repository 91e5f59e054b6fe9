//! The connection to the collector, shared by the exporters of every
//! watched process ([`super::resources`]): one HTTP/2 channel (gRPC) or
//! one HTTP client pool (HTTP/protobuf).
//!
//! Built here rather than by `opentelemetry-otlp` so that the exporters
//! share it, and so that TLS trusts what the OpenTelemetry environment
//! says: the system's roots and the CA file of
//! `OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE` (the exporter reads neither).
//! rustls runs on the `ring` provider ([`crate::util::tls`]).
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow};
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
    Http { client: reqwest::Client, endpoint: String },
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
                Ok(Connection::Http { client, endpoint: target.endpoint.clone() })
            }
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
