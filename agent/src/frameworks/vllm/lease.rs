//! vLLM's KV lease: how long a prefill holds a finished request's KV
//! blocks for a decode to read them (vllm 0.32.0 / 0.33.0,
//! `kv_connector/v1/nixl/`).
//!
//! The scheduler stamps `now + kv_lease_duration` when a request finishes
//! with blocks to send (`pull_scheduler.py` `request_finished`); each
//! heartbeat a decode sends for it moves that to at least
//! `now + kv_lease_duration * 2 // 3` (`base_worker.py`
//! `_handle_heartbeat`); the worker frees the blocks of every request past
//! its deadline at the end of each step's `get_finished`, after that
//! step's notifications (`_reap_expired_send_leases`), and the engine
//! keeps stepping while such requests wait (`Scheduler.has_requests`).
//! `kv_lease_duration` is an integer number of seconds in the
//! `kv_connector_extra_config` of `--kv-transfer-config`, 30 when unset.
//!
//! A retitled engine core or worker no longer shows its command line, so
//! the lease is read from the nearest process of its lineage that was
//! started with `--kv-transfer-config` (the `vllm serve` API server).
use serde_json::Value;

use crate::util::lineage::Lineage;

/// vLLM's `kv_lease_duration` when the config sets none.
pub const DEFAULT_SECS: u64 = 30;

/// A process's lease, and where it was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub secs: u64,
    /// Where the figure comes from, for an alert: "pid 41's
    /// --kv-transfer-config", "vLLM's default (...)".
    pub from: String,
    /// A `--kv-transfer-config` that could not be read (the default is
    /// then assumed): said once in the log.
    pub problem: Option<String>,
}

impl Lease {
    pub fn duration_ns(&self) -> u64 {
        self.secs.saturating_mul(1_000_000_000)
    }

    /// What a heartbeat extends the lease to, from its arrival: vLLM's
    /// `kv_lease_duration * 2 // 3`, in whole seconds.
    pub fn extension_ns(&self) -> u64 {
        (self.secs * 2 / 3).saturating_mul(1_000_000_000)
    }

    fn default_because(why: impl Into<String>, problem: Option<String>) -> Self {
        Self { secs: DEFAULT_SECS, from: format!("vLLM's default ({})", why.into()), problem }
    }

    /// The lease of the process `lineage` starts with.
    pub fn of(lineage: &Lineage) -> Self {
        for generation in lineage.iter() {
            match from_args(&generation.args) {
                None => continue,
                Some(Ok(Some(secs))) => {
                    return Self {
                        secs,
                        from: format!("pid {}'s --kv-transfer-config", generation.pid),
                        problem: None,
                    };
                }
                Some(Ok(None)) => {
                    return Self::default_because(
                        format!("pid {}'s --kv-transfer-config sets no kv_lease_duration", generation.pid),
                        None,
                    );
                }
                Some(Err(why)) => {
                    let problem = format!("pid {}: {why}", generation.pid);
                    return Self::default_because("its --kv-transfer-config could not be read", Some(problem));
                }
            }
        }
        let pids: Vec<String> = lineage.iter().map(|g| g.pid.to_string()).collect();
        Self::default_because(format!("no --kv-transfer-config on the command line of pids {}", pids.join(", ")), None)
    }
}

/// The `kv_lease_duration` a command line sets: `None` when it has no
/// `--kv-transfer-config` at all, `Ok(None)` when its config sets none.
/// vLLM takes the config as JSON (`--kv-transfer-config '{...}'` or
/// `=...`) or one field at a time
/// (`--kv-transfer-config.kv_connector_extra_config.kv_lease_duration 12`),
/// with `_` or `-` in the flag's name.
pub fn from_args(args: &[String]) -> Option<Result<Option<u64>, String>> {
    const FLAG: &str = "--kv-transfer-config";
    const FIELD: &str = ".kv-connector-extra-config.kv-lease-duration";
    let mut found = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) => (name, Some(value.to_owned())),
            None => (arg.as_str(), None),
        };
        let name = name.replace('_', "-");
        let Some(rest) = name.strip_prefix(FLAG) else { continue };
        let value = match inline {
            Some(value) => value,
            None => match args.next() {
                Some(value) => value.clone(),
                None => return Some(Err(format!("{arg} is the last argument: it has no value"))),
            },
        };
        // The last setting wins, as with vLLM's parser.
        found = Some(match rest {
            "" => from_json(&value),
            FIELD => seconds(&Value::String(value.clone())).map(Some),
            _ => continue,
        });
    }
    found
}

fn from_json(text: &str) -> Result<Option<u64>, String> {
    let config: Value = serde_json::from_str(text).map_err(|err| format!("--kv-transfer-config is not JSON: {err}"))?;
    match config.get("kv_connector_extra_config").and_then(|extra| extra.get("kv_lease_duration")) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => seconds(value).map(Some),
    }
}

fn seconds(value: &Value) -> Result<u64, String> {
    let parsed = match value {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    };
    parsed.filter(|&secs| secs > 0).ok_or_else(|| format!("kv_lease_duration {value} is not a whole number of seconds"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::lineage::Generation;

    fn args(text: &[&str]) -> Vec<String> {
        text.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_lease_is_read_from_every_form_vllm_takes() {
        let json = r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"kv_lease_duration":12}}"#;
        assert_eq!(from_args(&args(&["vllm", "serve", "m", "--kv-transfer-config", json])), Some(Ok(Some(12))));
        assert_eq!(from_args(&args(&["serve", &format!("--kv_transfer_config={json}")])), Some(Ok(Some(12))));
        let field = "--kv-transfer-config.kv_connector_extra_config.kv_lease_duration";
        assert_eq!(from_args(&args(&["serve", field, "7"])), Some(Ok(Some(7))));
        assert_eq!(from_args(&args(&["serve", &format!("{field}=9")])), Some(Ok(Some(9))));
        assert_eq!(
            from_args(&args(&["serve", "--kv-transfer-config", r#"{"kv_role":"kv_producer"}"#])),
            Some(Ok(None))
        );
        assert_eq!(from_args(&args(&["serve", "--model", "m"])), None);
    }

    #[test]
    fn a_config_that_cannot_be_read_says_why() {
        let bad = from_args(&args(&["serve", "--kv-transfer-config", "{not json"]));
        assert!(bad.is_some_and(|r| r.is_err_and(|why| why.contains("not JSON"))));
        let negative =
            from_args(&args(&["--kv-transfer-config", r#"{"kv_connector_extra_config":{"kv_lease_duration":-1}}"#]));
        assert!(negative.is_some_and(|r| r.is_err_and(|why| why.contains("whole number"))));
        assert!(from_args(&args(&["--kv-transfer-config"])).is_some_and(|r| r.is_err()));
    }

    #[test]
    fn a_retitled_process_takes_the_lease_of_the_ancestor_that_was_started_with_it() {
        let json = r#"{"kv_connector_extra_config":{"kv_lease_duration":12}}"#;
        let lineage = Lineage(vec![
            Generation { pid: 30, args: args(&["VLLM::Worker_TP0"]) },
            Generation { pid: 20, args: args(&["VLLM::EngineCore"]) },
            Generation { pid: 10, args: args(&["vllm", "serve", "m", "--kv-transfer-config", json]) },
        ]);
        let lease = Lease::of(&lineage);
        assert_eq!((lease.secs, lease.from.as_str()), (12, "pid 10's --kv-transfer-config"));
        assert_eq!((lease.duration_ns(), lease.extension_ns()), (12_000_000_000, 8_000_000_000));
        let unset = Lease::of(&Lineage(vec![Generation { pid: 20, args: args(&["VLLM::EngineCore"]) }]));
        assert_eq!(unset.secs, DEFAULT_SECS);
        assert!(unset.from.contains("no --kv-transfer-config on the command line of pids 20"), "{}", unset.from);
        assert_eq!(Lease { secs: 30, from: String::new(), problem: None }.extension_ns(), 20_000_000_000);
    }
}
