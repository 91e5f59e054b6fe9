//! Where reports leave the agent: alert lines on stdout and the summary,
//! OTLP spans ([`otlp`]) and Prometheus metrics ([`metrics`]), both fed
//! through [`telemetry`].
pub mod alert;
pub mod metrics;
pub mod otlp;
pub mod queue;
pub mod telemetry;
pub mod workload;
