//! tests/sglang/real/prefill.py, SGLang 0.5.23's own disaggregation code
//! (bootstrap server, NixlKVManager, NixlKVSender and NixlKVReceiver from
//! the wheel, real NIXL over UCX on loopback, real ZMQ), or its Mooncake
//! twin tests/sglang/mooncake/prefill.py, driven as the tests drive it: started, set up (its decode processes too), watched,
//! then told `go`; its JSON lines kept with when they were seen.
use std::{
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{Agent, Line, Proc, require_root, root, sglang_python};

/// How SGLang's tokenizer hands a request to its scheduler (and the
/// scheduler its output to the detokenizer): msgpack
/// (`SGLANG_USE_PICKLE_IPC=0`) or pickle, SGLang 0.5.23's default. The
/// `sglang` profile reads the `bootstrap_room` and `rid` of either as the
/// scheduler receives it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Ipc {
    Msgpack,
    Pickle,
}

/// The prefill process (and its decodes), set up and waiting for `go`,
/// or running.
pub struct Target {
    pub proc: Proc,
    pub ready: Value,
    pub lines: Vec<Line>,
}

impl Target {
    /// Set up with `fault` (12 rooms; `extra` arguments appended), not yet
    /// running.
    pub fn start(fault: &str, extra: &[&str], ipc: Ipc) -> Self {
        require_root();
        Self::spawn("sglang real prefill", "tests/sglang/real/prefill.py", fault, extra, ipc)
    }

    /// The same on SGLang's Mooncake backend (tests/sglang/mooncake/
    /// prefill.py: SGLang's Mooncake classes over the real TransferEngine,
    /// TCP on loopback); its faults add `timeout`. No `--count` default:
    /// give one in `extra`.
    pub fn mooncake(fault: &str, extra: &[&str], ipc: Ipc) -> Self {
        Self::spawn("sglang mooncake prefill", "tests/sglang/mooncake/prefill.py", fault, extra, ipc)
    }

    fn spawn(name: &str, script: &str, fault: &str, extra: &[&str], ipc: Ipc) -> Self {
        let count: &[&str] = if extra.contains(&"--count") { &[] } else { &["--count", "12"] };
        let proc = Proc::spawn(
            name,
            Command::new(sglang_python())
                .arg(root().join(script))
                .args(["--fault", fault, "--max-seconds", "90"])
                .args(count)
                .args(extra)
                .env("SGLANG_USE_PICKLE_IPC", if ipc == Ipc::Pickle { "1" } else { "0" }),
        );
        let mut lines = Vec::new();
        let ready = proc.until_event("ready", Duration::from_secs(120), &mut lines);
        Self { proc, ready, lines }
    }

    /// The agent attached to the prefill (`profile`, `timeout`), then `go`.
    pub fn watch_and_go(&mut self, profile: &str, timeout: &str, agent_extra: &[&str]) -> Agent {
        let agent = Agent::watch(self.prefill(), profile, timeout, agent_extra);
        self.proc.write_line("go");
        agent
    }

    pub fn prefill(&self) -> u32 {
        self.ready["prefill_pid"].as_u64().expect("prefill_pid") as u32
    }

    pub fn fault_room(&self) -> u64 {
        self.ready["fault_room"].as_u64().expect("fault_room")
    }

    /// Decode rank `index`'s pid and NIXL agent name.
    pub fn decode(&self, index: u64) -> (u32, String) {
        let decodes = self.ready["decodes"].as_array().expect("decodes");
        let decode =
            decodes.iter().find(|d| d["index"] == index).unwrap_or_else(|| panic!("no decode {index}: {}", self.ready));
        (decode["pid"].as_u64().expect("pid") as u32, decode["agent"].as_str().expect("agent").to_owned())
    }

    /// Decode rank `index`'s pid.
    pub fn decode_pid(&self, index: u64) -> u32 {
        let decodes = self.ready["decodes"].as_array().expect("decodes");
        let decode =
            decodes.iter().find(|d| d["index"] == index).unwrap_or_else(|| panic!("no decode {index}: {}", self.ready));
        decode["pid"].as_u64().expect("pid") as u32
    }

    /// Read lines until one with `event`; its value.
    pub fn until(&mut self, event: &str, within: Duration) -> Value {
        self.proc.until_event(event, within, &mut self.lines)
    }

    /// When the target printed `event` for `room` (its first such line).
    pub fn at(&self, event: &str, room: u64) -> Instant {
        self.first(|v| v["event"] == event && v["room"] == room)
            .unwrap_or_else(|| panic!("no {event} of room {room}: {:?}", self.lines))
    }

    /// When the target handed chunk `chunk` (from 0) of `room` to SGLang's
    /// sender, if it did.
    pub fn chunk(&self, room: u64, chunk: u64) -> Option<Instant> {
        self.first(|v| v["event"] == "chunk" && v["room"] == room && v["chunk"] == chunk)
    }

    /// How many chunks of `room` the target handed to SGLang's sender.
    pub fn chunks(&self, room: u64) -> usize {
        let json = self.lines.iter().filter_map(|line| line.json());
        json.filter(|v| v["event"] == "chunk" && v["room"] == room).count()
    }

    /// When the target printed its first JSON line that `matches`.
    fn first(&self, matches: impl Fn(&Value) -> bool) -> Option<Instant> {
        self.lines.iter().find(|line| line.json().is_some_and(|v| matches(&v))).map(|line| line.at)
    }

    /// Every room the router handed to the prefill.
    pub fn rooms(&self) -> Vec<u64> {
        let rooms = self.lines.iter().filter_map(|line| line.json()).filter(|v| v["event"] == "request");
        rooms.map(|v| v["room"].as_u64().expect("room")).collect()
    }

    /// The rooms a `holding` line says are in `state`.
    pub fn rooms_in(&self, holding: &Value, state: &str) -> Vec<u64> {
        self.rooms().into_iter().filter(|r| holding["rooms"][r.to_string()] == state).collect()
    }
}
