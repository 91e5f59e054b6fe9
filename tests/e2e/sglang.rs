//! The SGLang test target (tests/sglang: SGLang's real prefill flow, real
//! NIXL over UCX, real ZMQ) watched by the real agent with today's `nixl`
//! profile. These assert only what is right already; what the profile gets
//! wrong on this flow (no room on any alert, a false `release_lost` for
//! the last handles of every worker that goes idle, nothing for a room
//! whose decode never answers or for the rooms queued behind a hung
//! worker) is what the `sglang` profile is to fix (issue 10).
use std::{
    collections::HashMap,
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use stallwatch_tests::{Agent, Line, Proc, alerts, require_root, root, venv_python};

const TIMEOUT: Duration = Duration::from_secs(2);
const LATENESS: Duration = Duration::from_secs(1);

/// prefill.py (and its decode.py ranks), set up and waiting for `go`.
struct Target {
    proc: Proc,
    prefill: u32,
    fault_room: u64,
    lines: Vec<Line>,
}

impl Target {
    fn start(fault: &str) -> Self {
        require_root();
        let proc = Proc::spawn(
            "sglang prefill",
            Command::new(venv_python())
                .arg(root().join("tests/sglang/prefill.py"))
                .args(["--fault", fault, "--count", "12", "--events", "--max-seconds", "60"]),
        );
        let ready = proc.next_line(Duration::from_secs(30), "ready line");
        let value = ready.json().unwrap_or_else(|| panic!("prefill said: {}", ready.text));
        assert_eq!(value["event"], "ready", "{value}");
        let prefill = value["prefill_pid"].as_u64().expect("prefill_pid") as u32;
        let fault_room = value["fault_room"].as_u64().expect("fault_room");
        Self { proc, prefill, fault_room, lines: vec![ready] }
    }

    /// Attach the agent (`nixl`, 2 s), then let the target run.
    fn watched(fault: &str) -> (Self, Agent) {
        let mut target = Self::start(fault);
        let agent = Agent::watch(target.prefill, "nixl", "2s", &[]);
        target.proc.write_line("go");
        (target, agent)
    }

    /// Read lines until one with `event`.
    fn until(&mut self, event: &str, within: Duration) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let line = self.proc.next_line(deadline.saturating_duration_since(Instant::now()), event);
            let value = line.json();
            self.lines.push(line);
            if let Some(value) = value.filter(|v| v["event"] == event) {
                return value;
            }
        }
    }

    /// The transfers posted for `room`: handle (as the agent prints it) ->
    /// when the line was seen.
    fn transfers(&self, room: u64) -> HashMap<String, Instant> {
        self.lines
            .iter()
            .filter_map(|line| {
                let value = line.json()?;
                (value["event"] == "xfer" && value["room"] == room).then(|| {
                    let handle = value["handle"].as_str().expect("handle").trim_start_matches("0x");
                    (format!("{:#x}", u64::from_str_radix(handle, 16).expect("hex handle")), line.at)
                })
            })
            .collect()
    }
}

#[test]
fn a_transfer_hung_on_a_stopped_decode_is_transfer_hung() {
    let (mut target, agent) = Target::watched("hang");
    let holding = target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    assert_eq!(holding["rooms"][room.to_string()], "transferring", "{holding}");
    let hung = target.transfers(room);
    assert_eq!(hung.len(), 1, "one chunk posted before the stall: {hung:?}");
    let mut seen = Vec::new();
    agent.wait_until("a transfer_hung alert", TIMEOUT + Duration::from_secs(5), &mut seen, |seen| {
        alerts(seen, "stalled").any(|(_, a)| a["class"] == "transfer_hung")
    });
    let stalls: Vec<(Instant, Value)> = alerts(&seen, "stalled").filter(|(_, a)| a["class"] == "transfer_hung").collect();
    assert_eq!(stalls.len(), 1, "{seen:?}");
    let (at, alert) = &stalls[0];
    let key = alert["key"].as_str().expect("key");
    let posted = hung.get(key).unwrap_or_else(|| panic!("hung transfer not one of room {room}'s: {alert}"));
    assert_eq!(alert["stage"], "transfer_posted", "{alert}");
    let latency = at.duration_since(*posted);
    assert!(latency >= TIMEOUT - Duration::from_millis(50) && latency <= TIMEOUT + LATENESS, "{alert} after {latency:?}");
}

#[test]
fn a_transfer_to_a_decode_that_died_is_failed() {
    let (mut target, agent) = Target::watched("decode-dies");
    target.until("decode_killed", Duration::from_secs(30));
    let killed_at = target.lines.last().expect("the decode_killed line").at;
    let holding = target.until("holding", Duration::from_secs(30));
    let room = target.fault_room;
    assert_eq!(holding["rooms"][room.to_string()], "failed", "{holding}");
    let transfers = target.transfers(room);
    let mut seen = Vec::new();
    agent.wait_until("a failed alert", Duration::from_secs(5), &mut seen, |seen| alerts(seen, "failed").next().is_some());
    let failed: Vec<(Instant, Value)> = alerts(&seen, "failed").collect();
    assert_eq!(failed.len(), 1, "{seen:?}");
    let (at, alert) = &failed[0];
    let key = alert["key"].as_str().expect("key");
    assert!(transfers.contains_key(key), "failed transfer not one of room {room}'s {transfers:?}: {alert}");
    // Seen from the post's error, or read from the handle once its
    // silence reaches the timeout: within timeout + 1 s either way.
    let latency = at.duration_since(killed_at);
    assert!(latency <= TIMEOUT + LATENESS, "{alert} after {latency:?}");
}
