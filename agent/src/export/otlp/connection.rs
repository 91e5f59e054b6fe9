//! The connection to the collector, shared by the exporters of every
//! watched process ([`super::resources`]): one HTTP/2 channel (gRPC) or
//! one HTTP client pool (HTTP/protobuf).
//!
//! Built here rather than by `opentelemetry-otlp` so that the exporters
//! share it.
use std::time::Duration;

use anyhow::{Result, anyhow};
use opentelemetry_otlp::{RetryPolicy, WithExportConfig as _, WithHttpConfig as _, WithTonicConfig as _};

use super::config::{OtlpTarget, Protocol};

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
        match target.protocol {
            Protocol::Grpc => {
                let endpoint = tonic::transport::Endpoint::from_shared(target.endpoint.clone())
                    .map_err(|err| anyhow!("{} {:?} is not a gRPC endpoint: {err}", target.source, target.endpoint))?;
                Ok(Connection::Grpc(endpoint.connect_lazy()))
            }
            Protocol::HttpProtobuf => {
                let client = reqwest::Client::builder()
                    .build()
                    .map_err(|err| anyhow!("building the OTLP HTTP client: {err}"))?;
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
