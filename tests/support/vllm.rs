//! tests/vllm/pd.py, vLLM 0.33.0's own NixlPullConnector (scheduler and
//! worker, unchanged from the wheel) in a prefill and a decode engine on
//! CPU, real NIXL READs over UCX loopback, real ZMQ side channel, routed by
//! pd.py: started with a fault, then told `go`; its JSON lines (both
//! engines' and the router's) kept with when they were seen.
use std::{
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{Line, Proc, root, vllm_python};

/// The prefill and decode engines and their router, set up and waiting for
/// `go`, or running.
pub struct Target {
    pub proc: Proc,
    pub ready: Value,
    pub lines: Vec<Line>,
}

impl Target {
    /// Set up with `fault` (`extra` arguments appended to pd.py's), not yet
    /// running.
    pub fn start(fault: &str, extra: &[&str]) -> Self {
        let proc = Proc::spawn(
            "vllm pd",
            Command::new(vllm_python()).arg(root().join("tests/vllm/pd.py")).args(["--fault", fault]).args(extra),
        );
        let mut lines = Vec::new();
        // The router's own ready line (the engines' carry a role).
        let ready = loop {
            let value = proc.until_event("ready", Duration::from_secs(180), &mut lines);
            if value.get("role").is_none() {
                break value;
            }
        };
        Self { proc, ready, lines }
    }

    pub fn go(&mut self) {
        self.proc.write_line("go");
    }

    pub fn prefill(&self) -> u32 {
        self.ready["prefill_pid"].as_u64().expect("prefill_pid") as u32
    }

    pub fn decode(&self) -> u32 {
        self.ready["decode_pid"].as_u64().expect("decode_pid") as u32
    }

    /// Read lines until one with `event`; its value.
    pub fn until(&mut self, event: &str, within: Duration) -> Value {
        self.proc.until_event(event, within, &mut self.lines)
    }

    /// Read lines until the router says it is done.
    pub fn run_to_done(&mut self, within: Duration) {
        self.until("done", within);
    }

    /// Every JSON line with `event` (and `request`, when given).
    pub fn events(&self, event: &str, request: Option<&str>) -> Vec<(Instant, Value)> {
        let lines = self.lines.iter().filter_map(|line| line.json().map(|v| (line.at, v)));
        lines.filter(|(_, v)| v["event"] == event && request.is_none_or(|r| v["request"] == r)).collect()
    }

    /// The first `event` line of `request`, or a panic listing what was seen.
    pub fn one(&self, event: &str, request: &str) -> Value {
        self.events(event, Some(request)).into_iter().next().map(|(_, v)| v).unwrap_or_else(|| {
            let seen: Vec<&str> = self.lines.iter().map(|l| l.text.as_str()).collect();
            panic!("no {event} of {request}; lines:\n{}", seen.join("\n"))
        })
    }

    /// Whether stderr (both engines' vLLM logs) has `needle`.
    pub fn logged(&self, needle: &str) -> bool {
        self.proc.stderr().contains(needle)
    }
}
