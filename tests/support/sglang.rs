//! tests/sglang/real/prefill.py, SGLang 0.5.23's own disaggregation code
//! (bootstrap server, NixlKVManager, NixlKVSender and NixlKVReceiver from
//! the wheel, real NIXL over UCX on loopback, real ZMQ) in SGLang's process
//! layout (tests/sglang/real/launcher.py: a main process with the bootstrap
//! server and the tokenizer, a scheduler process per prefill rank retitled
//! `sglang::scheduler...`), or its Mooncake twin
//! tests/sglang/mooncake/prefill.py (every class in one process), driven as
//! the tests drive it: started, set up (its decode processes too), watched
//! as the README says, then told `go`; its JSON lines kept with when they
//! were seen.
use std::{
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{Agent, Line, MemoryCgroup, Proc, require_root, root, sglang_python};

/// The README's selector for an SGLang server's processes where the
/// `sglang` profile's probes fire: every scheduler (`--pid` of the main
/// process sees no transfer, and warns).
pub const SCHEDULERS: [&str; 4] = ["--lib", "libnixl.so", "--cmdline", "^sglang::scheduler"];

/// How much memory the target's cgroup lets its processes hold: the group
/// is there to tell one server's processes apart (as a pod's is), not to
/// cap them.
const GROUP_LIMIT: u64 = 64 << 30;

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
    /// The SGLang-layout target's own cgroup, as a server's pod would have
    /// one: the agent keeps to this server's schedulers with `--cgroup`
    /// (other tests' servers may run on this host). Last: removed once the
    /// processes are gone.
    group: Option<MemoryCgroup>,
}

impl Target {
    /// Set up with `fault` (12 rooms; `extra` arguments appended), not yet
    /// running.
    /// SGLang's layout (`--processes sglang`), the main process's command
    /// line an SGLang prefill's (`--disaggregation-mode prefill`), in a
    /// cgroup of its own.
    pub fn start(fault: &str, extra: &[&str], ipc: Ipc) -> Self {
        require_root();
        let group = MemoryCgroup::new(GROUP_LIMIT);
        let layout = ["--processes", "sglang", "--disaggregation-mode", "prefill"];
        let extra: Vec<&str> = layout.into_iter().chain(extra.iter().copied()).collect();
        Self::spawn("sglang real prefill", "tests/sglang/real/prefill.py", fault, &extra, ipc, Some(group))
    }

    /// The same on SGLang's Mooncake backend (tests/sglang/mooncake/
    /// prefill.py: SGLang's Mooncake classes over the real TransferEngine,
    /// TCP on loopback); its faults add `timeout`. No `--count` default:
    /// give one in `extra`.
    pub fn mooncake(fault: &str, extra: &[&str], ipc: Ipc) -> Self {
        Self::spawn("sglang mooncake prefill", "tests/sglang/mooncake/prefill.py", fault, extra, ipc, None)
    }

    fn spawn(name: &str, script: &str, fault: &str, extra: &[&str], ipc: Ipc, group: Option<MemoryCgroup>) -> Self {
        let count: &[&str] = if extra.contains(&"--count") { &[] } else { &["--count", "12"] };
        let mut command = Command::new(sglang_python());
        command
            .arg(root().join(script))
            .args(["--fault", fault, "--max-seconds", "90"])
            .args(count)
            .args(extra)
            .env("SGLANG_USE_PICKLE_IPC", if ipc == Ipc::Pickle { "1" } else { "0" });
        if let Some(group) = &group {
            group.contain(&mut command);
        }
        let proc = Proc::spawn(name, &mut command);
        let mut lines = Vec::new();
        // Set-up imports torch and SGLang in every process (main, schedulers,
        // decodes) at once, on a host whose cores other tests share.
        let ready = proc.until_event("ready", Duration::from_secs(240), &mut lines);
        Self { proc, ready, lines, group }
    }

    /// The agent attached to the prefill (`profile`, `timeout`), then `go`.
    pub fn watch_and_go(&mut self, profile: &str, timeout: &str, agent_extra: &[&str]) -> Agent {
        let agent = self.watch(profile, timeout, agent_extra);
        self.proc.write_line("go");
        agent
    }

    /// The agent on the prefill, attached as the README says: on SGLang's
    /// layout the selector [`SCHEDULERS`] (kept to this server's cgroup,
    /// as `--cgroup <pod UID>` keeps a node's agent to one pod), ready
    /// once it watches every scheduler; on the one-process Mooncake target
    /// `--pid` of it.
    pub fn watch(&self, profile: &str, timeout: &str, agent_extra: &[&str]) -> Agent {
        if self.group.is_none() {
            return Agent::watch(self.prefill(), profile, timeout, agent_extra);
        }
        let selectors = self.selectors();
        let selectors: Vec<&str> = selectors.iter().map(String::as_str).collect();
        let agent = Agent::selecting(&selectors).profile(profile).timeout(timeout).args(agent_extra).discover();
        for (pid, _) in self.schedulers() {
            agent.wait_watching(pid);
        }
        agent
    }

    /// [`SCHEDULERS`], with `--cgroup` of this server's group: the whole
    /// name as its `/proc/PID/cgroup` line ends it (`...-1` is in
    /// `...-12` too).
    pub fn selectors(&self) -> Vec<String> {
        let group = self.group.as_ref().expect("the SGLang-layout target has its cgroup");
        let mut selectors: Vec<String> = SCHEDULERS.iter().map(|s| (*s).to_owned()).collect();
        selectors.extend(["--cgroup".to_owned(), format!("{}\n", group.name())]);
        selectors
    }

    /// The main process (SGLang's layout: bootstrap server, tokenizer; the
    /// Mooncake target: everything).
    pub fn prefill(&self) -> u32 {
        self.ready["prefill_pid"].as_u64().expect("prefill_pid") as u32
    }

    /// The scheduler processes, by TP rank: pid and title.
    pub fn schedulers(&self) -> Vec<(u32, String)> {
        let schedulers = self.ready["schedulers"].as_array().unwrap_or_else(|| panic!("no schedulers: {}", self.ready));
        schedulers
            .iter()
            .map(|s| (s["pid"].as_u64().expect("pid") as u32, s["title"].as_str().expect("title").to_owned()))
            .collect()
    }

    /// The detokenizer process's pid.
    pub fn detokenizer(&self) -> u32 {
        self.ready["detokenizer"]["pid"].as_u64().unwrap_or_else(|| panic!("no detokenizer: {}", self.ready)) as u32
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
