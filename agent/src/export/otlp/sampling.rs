//! The standard OpenTelemetry switches over span export, read strictly:
//! `OTEL_SDK_DISABLED`, `OTEL_TRACES_EXPORTER`, `OTEL_TRACES_SAMPLER` and
//! `OTEL_TRACES_SAMPLER_ARG`, and a check of `OTEL_EXPORTER_OTLP_HEADERS`.
//!
//! The sampling decision itself is the SDK's (`Sampler::should_sample`,
//! by trace id), so the prefill-side and decode-side agents of one room,
//! whose spans share a trace id, keep or drop that trace alike. The
//! environment is read here rather than by the SDK's `Config` because the
//! SDK falls back silently on a value it does not know (an unknown sampler
//! becomes `parentbased_always_on`); here it is an error that names the
//! variable and the fix. Spans have no parent (each is the root of its
//! trace), so the `parentbased_*` samplers decide as their root sampler.
//!
//! `stallwatch_stalls` is this agent's own sampler: every stall span and
//! every request span of a request that stalled or ended badly (failed,
//! aborted, its process gone, evicted) is kept; the healthy ones are kept
//! at the ratio `OTEL_TRACES_SAMPLER_ARG` (default 0: none).
use anyhow::{Result, bail};
use opentelemetry::trace::{SpanKind, TraceId};
use opentelemetry_sdk::trace::{Sampler, SamplingDecision, ShouldSample as _, SpanData};

pub const SDK_DISABLED: &str = "OTEL_SDK_DISABLED";
pub const TRACES_EXPORTER: &str = "OTEL_TRACES_EXPORTER";
pub const TRACES_SAMPLER: &str = "OTEL_TRACES_SAMPLER";
pub const TRACES_SAMPLER_ARG: &str = "OTEL_TRACES_SAMPLER_ARG";
pub const HEADERS: [&str; 2] = ["OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"];

/// The stalls-only sampler's name in `OTEL_TRACES_SAMPLER`.
pub const STALLS_ONLY: &str = "stallwatch_stalls";

/// Why span export is off although an endpoint may be set, if it is.
pub fn disabled_by(env: &impl Fn(&str) -> Option<String>) -> Result<Option<String>> {
    let get = |name: &str| env(name).map(|v| v.trim().to_ascii_lowercase()).filter(|v| !v.is_empty());
    match get(SDK_DISABLED).as_deref() {
        None | Some("false") => {}
        Some("true") => return Ok(Some(format!("{SDK_DISABLED}=true"))),
        Some(other) => bail!("{SDK_DISABLED}={other:?} is neither `true` nor `false`"),
    }
    match get(TRACES_EXPORTER).as_deref() {
        None | Some("otlp") => Ok(None),
        Some("none") => Ok(Some(format!("{TRACES_EXPORTER}=none"))),
        Some(other) => bail!("{TRACES_EXPORTER}={other:?} is not supported: set it to `otlp` (the default) or `none`"),
    }
}

/// `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`, checked as the exporter would
/// read it (`key=value` pairs, comma-separated): a malformed entry would
/// otherwise be dropped without a word, and the collector refuse every
/// export for want of the tenant or token it carried.
pub fn check_headers(env: &impl Fn(&str) -> Option<String>) -> Result<()> {
    for name in HEADERS {
        let Some(value) = env(name) else { continue };
        for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let Some((key, _)) = entry.split_once('=') else {
                bail!("{name}: `{entry}` is not KEY=VALUE (write e.g. `authorization=Bearer%20TOKEN,x-tenant=a`)");
            };
            let key = key.trim();
            let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
            if key.is_empty() || !key.chars().all(token) {
                bail!("{name}: `{key}` is not an HTTP header name");
            }
        }
    }
    Ok(())
}

/// Which spans are exported.
#[derive(Debug, Clone)]
pub struct SpanSampler {
    /// The sampler named, as text (for the log and `config check`).
    pub name: String,
    sampler: Sampler,
    /// `stallwatch_stalls`: `sampler` decides only the healthy spans.
    stalls_only: bool,
}

impl Default for SpanSampler {
    /// Every span: the SDK's default (`parentbased_always_on`) for spans
    /// without a parent.
    fn default() -> Self {
        Self { name: "parentbased_always_on".to_owned(), sampler: Sampler::AlwaysOn, stalls_only: false }
    }
}

impl SpanSampler {
    /// `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`.
    pub fn from_env(env: &impl Fn(&str) -> Option<String>) -> Result<Self> {
        let name = env(TRACES_SAMPLER).map(|v| v.trim().to_ascii_lowercase()).filter(|v| !v.is_empty());
        let arg = env(TRACES_SAMPLER_ARG).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        let ratio = |default: Option<f64>| -> Result<f64> {
            match (&arg, default) {
                (Some(text), _) => match text.parse::<f64>() {
                    Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
                    _ => bail!(
                        "{TRACES_SAMPLER_ARG}={text:?} is not a ratio from 0 to 1 (e.g. 0.01 keeps one trace in a hundred)"
                    ),
                },
                (None, Some(default)) => Ok(default),
                (None, None) => bail!("{TRACES_SAMPLER_ARG} is not set: give the ratio of traces to keep, from 0 to 1"),
            }
        };
        let Some(name) = name else {
            return Ok(Self::default());
        };
        let (sampler, stalls_only) = match name.as_str() {
            "always_on" | "parentbased_always_on" => (Sampler::AlwaysOn, false),
            "always_off" | "parentbased_always_off" => (Sampler::AlwaysOff, false),
            "traceidratio" | "parentbased_traceidratio" => (Sampler::TraceIdRatioBased(ratio(None)?), false),
            STALLS_ONLY => (Sampler::TraceIdRatioBased(ratio(Some(0.0))?), true),
            other => bail!(
                "{TRACES_SAMPLER}={other:?} is not supported: set it to always_on, always_off, traceidratio, \
                 parentbased_always_on, parentbased_always_off, parentbased_traceidratio or {STALLS_ONLY} \
                 (every stalled or failed request kept, healthy ones at {TRACES_SAMPLER_ARG})"
            ),
        };
        let name = match (&arg, matches!(sampler, Sampler::TraceIdRatioBased(_))) {
            (_, true) => format!("{name} ({})", ratio(Some(0.0))?),
            _ => name,
        };
        Ok(Self { name, sampler, stalls_only })
    }

    /// Whether `span` is exported.
    pub fn keep(&self, span: &SpanData) -> bool {
        if self.stalls_only && is_bad(span) {
            return true;
        }
        self.decide(span.span_context.trace_id(), &span.name)
    }

    fn decide(&self, trace_id: TraceId, name: &str) -> bool {
        let result = self.sampler.should_sample(None, trace_id, name, &SpanKind::Internal, &[], &[]);
        result.decision != SamplingDecision::Drop
    }
}

/// A stall span, or a request span of a request that stalled or ended
/// badly: what the stalls-only sampler always keeps.
fn is_bad(span: &SpanData) -> bool {
    span.name == super::names::STALL_SPAN
        || matches!(span.status, opentelemetry::trace::Status::Error { .. })
        || span
            .attributes
            .iter()
            .any(|kv| kv.key.as_str() == super::names::attr::STALL_CLASS || kv.key.as_str() == "error.type")
        || span.attributes.iter().any(|kv| {
            kv.key.as_str() == super::names::attr::OUTCOME
                && !["released", "completed"].contains(&kv.value.as_str().as_ref())
        })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        move |name: &str| map.get(name).cloned()
    }

    #[test]
    fn the_switches_turn_export_off_and_refuse_what_they_do_not_know() {
        assert_eq!(disabled_by(&env(&[])).expect("valid"), None);
        assert_eq!(
            disabled_by(&env(&[(SDK_DISABLED, "TRUE")])).expect("valid").as_deref(),
            Some("OTEL_SDK_DISABLED=true")
        );
        assert_eq!(disabled_by(&env(&[(SDK_DISABLED, "false"), (TRACES_EXPORTER, "otlp")])).expect("valid"), None);
        assert_eq!(
            disabled_by(&env(&[(TRACES_EXPORTER, "none")])).expect("valid").as_deref(),
            Some("OTEL_TRACES_EXPORTER=none")
        );
        let err = format!("{:#}", disabled_by(&env(&[(TRACES_EXPORTER, "zipkin")])).expect_err("zipkin"));
        assert!(err.contains("`otlp` (the default) or `none`"), "{err}");
        assert!(disabled_by(&env(&[(SDK_DISABLED, "yes")])).is_err());
    }

    #[test]
    fn samplers_are_the_sdks_and_stalls_only() {
        assert_eq!(SpanSampler::from_env(&env(&[])).expect("default").name, "parentbased_always_on");
        let half = SpanSampler::from_env(&env(&[(TRACES_SAMPLER, "traceidratio"), (TRACES_SAMPLER_ARG, "0.5")]))
            .expect("ratio");
        // The SDK's decision by trace id: deterministic, about half.
        let kept = (0..10_000u128)
            .filter(|n| half.decide(TraceId::from(n.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)), "x"))
            .count();
        assert!((4_000..6_000).contains(&kept), "{kept}");
        let off = SpanSampler::from_env(&env(&[(TRACES_SAMPLER, "parentbased_always_off")])).expect("off");
        assert!(!off.decide(TraceId::from(7u128), "x"));
        let stalls = SpanSampler::from_env(&env(&[(TRACES_SAMPLER, STALLS_ONLY)])).expect("stalls");
        assert!(stalls.stalls_only && !stalls.decide(TraceId::from(7u128), "x"), "healthy ones at ratio 0");
        for (pairs, needle) in [
            (vec![(TRACES_SAMPLER, "jaeger_remote")], "is not supported"),
            (vec![(TRACES_SAMPLER, "traceidratio")], "is not set"),
            (vec![(TRACES_SAMPLER, "traceidratio"), (TRACES_SAMPLER_ARG, "2")], "not a ratio"),
        ] {
            let err = format!("{:#}", SpanSampler::from_env(&env(&pairs)).expect_err(needle));
            assert!(err.contains(needle), "{err}");
        }
    }

    #[test]
    fn headers_must_be_key_value_pairs() {
        assert!(check_headers(&env(&[(HEADERS[1], "x-tenant=a, authorization=Bearer%20t")])).is_ok());
        let err = format!("{:#}", check_headers(&env(&[(HEADERS[0], "x-tenant")])).expect_err("no ="));
        assert!(err.starts_with("OTEL_EXPORTER_OTLP_TRACES_HEADERS: `x-tenant` is not KEY=VALUE"), "{err}");
        assert!(check_headers(&env(&[(HEADERS[1], "bad key=v")])).is_err());
    }
}
