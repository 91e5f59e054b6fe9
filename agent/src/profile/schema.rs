//! What a profile says, parsed and checked: the probes, signals, status
//! and activity tables, and how each lowers to the kernel's slot config.
use std::{fmt, sync::Arc};

use anyhow::{Result, bail};
use serde::Deserialize;
use stallwatch_common::{MAX_DEREF, MAX_RET_RULES, RetRule, SlotConfig, ValueSource, base, slot_flags, stage};

use super::returns::{RetType, Values};
use crate::lifecycle::Stage;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    pub name: String,
    /// Where it came from: a path, or `built-in NAME`; used in errors.
    pub origin: String,
    /// The profile it `extends`, by its origin, if any (what it inherits
    /// names its own origin).
    pub extends: Option<String>,
    pub probes: Vec<ProbeSpec>,
    /// Transport functions whose calls are counted as evidence.
    pub activity: Vec<ActivitySpec>,
    /// Functions whose hits are signals for a consumer in the agent, not
    /// lifecycle events (`[[signal]]`).
    pub signals: Vec<SignalSpec>,
    /// Where a request's state lies in the target's memory, read for a
    /// request whose stall is due (`[status]`).
    pub status: Option<StatusSpec>,
    /// Where a lifecycle is complete (`complete_at`).
    pub complete_at: CompleteAt,
    /// The builds of a library whose memory layout the profile's offsets
    /// were checked against (`[layout]`).
    pub layout: Option<Layout>,
    /// The processes a deployment of the framework runs, told apart by
    /// their command line (`[[process]]`): which of the profile's probes
    /// fire in each. Empty: the profile does not say.
    pub processes: Vec<ProcessRole>,
}

/// A `[[process]]` table: one kind of process of a framework's deployment
/// (vLLM's engine core, retitled `VLLM::EngineCore`), and the signals
/// (and whether the probes) that fire there. A framework spreads one
/// request over several such processes: `profile check --pid` says which
/// one a process is, and `run --pid` which others a request also needs.
#[derive(Debug, Clone)]
pub struct ProcessRole {
    pub origin: Arc<str>,
    pub line: usize,
    /// Matched against the command line, its arguments joined by spaces
    /// (after any setproctitle, its title).
    pub title: regex::Regex,
    /// What the process is, for a person: "vLLM's engine core".
    pub is: String,
    /// The profile's signals that fire there, by name.
    pub signals: Vec<String>,
    /// Whether the profile's `[[probe]]` and `[[activity]]` tables (the
    /// transfers) fire there.
    pub transfers: bool,
}

impl PartialEq for ProcessRole {
    fn eq(&self, other: &Self) -> bool {
        (&self.origin, self.line, self.title.as_str(), &self.is, &self.signals, self.transfers)
            == (&other.origin, other.line, other.title.as_str(), &other.is, &other.signals, other.transfers)
    }
}

impl Eq for ProcessRole {}

impl ProcessRole {
    /// Whether any of the profile's probes fire in such a process.
    pub fn fires(&self) -> bool {
        self.transfers || !self.signals.is_empty()
    }

    /// What fires there, for a person: "the transfers, vllm_notifs".
    pub fn firing(&self) -> String {
        let mut what: Vec<&str> = Vec::new();
        if self.transfers {
            what.push("the transfers");
        }
        what.extend(self.signals.iter().map(String::as_str));
        if what.is_empty() { "none of the profile's probes".to_owned() } else { what.join(", ") }
    }
}

/// The `[layout]` table: the offsets a profile reads in a library's
/// objects (a string behind the key, a status field) are that library's
/// build's, not its API's: another build may lay its structs out
/// otherwise, and the bytes there would read as ids and stages. So a
/// profile names the builds it was checked against, by their GNU build
/// id, and a process that maps another build is watched without what
/// those offsets give ([`Profile::without_offsets`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub origin: Arc<str>,
    pub line: usize,
    /// The library, as a probe's `object` names it.
    pub object: String,
    /// Lowercase hex GNU build ids.
    pub build_ids: Vec<String>,
    /// What the builds are (a version, a package), for the warning.
    pub checked: String,
}

impl Layout {
    pub fn knows(&self, build_id: &str) -> bool {
        self.build_ids.iter().any(|known| known.eq_ignore_ascii_case(build_id))
    }
}

/// Where a profile's lifecycles are complete (`complete_at`, a top-level
/// key): at their release (the default), or, for a framework that releases
/// what is done only lazily if ever (SGLang drops its NIXL handles to the
/// garbage collector when a worker picks up its next chunk), once done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompleteAt {
    #[default]
    Released,
    TransferDone,
}

impl CompleteAt {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Released => "released",
            Self::TransferDone => "transfer_done",
        }
    }

    /// Whether an event (or a state read) at `stage` ends the lifecycle
    /// beyond what terminal stages do: a live stage the profile completes at.
    pub fn ends_at(self, stage: Stage) -> bool {
        self == Self::TransferDone && stage == Stage::TransferDone
    }

    pub(super) fn parse(text: &str) -> Result<Self> {
        match text {
            "released" => Ok(Self::Released),
            "transfer_done" => Ok(Self::TransferDone),
            other => bail!(
                "`complete_at = \"{other}\"`: expected \"released\" (the default: a lifecycle is complete when \
                 released) or \"transfer_done\" (for a framework that releases what is done lazily, if ever)"
            ),
        }
    }
}

/// The `[status]` table: a request's state as the target keeps it, at an
/// address reached from the request key, read from userspace
/// (`process_vm_readv`) only for a request whose stall is due, so a
/// status the target polls in a hot loop needs no probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusSpec {
    /// The profile file the table is in (a profile's own, or one it extends).
    pub origin: Arc<str>,
    /// 1-based line of the `[status]` table.
    pub line: usize,
    /// From the key: `deref` steps (each reads a `u64`), then `add`.
    pub at: Source,
    /// The width of the value read there.
    pub value: RetType,
    /// The first rule the value satisfies picks the stage; a value no rule
    /// takes says nothing (read as unrecognised).
    pub rules: Vec<(RetRule, Stage)>,
}

/// Most rules a `[status]` table takes (userspace evaluates them: no
/// kernel limit, just a sane bound).
pub const MAX_STATUS_RULES: usize = 16;

impl StatusSpec {
    /// The stage the value `value` (sign-extended) says, if a rule takes it.
    pub fn stage_of(&self, value: i64) -> Option<Stage> {
        self.rules.iter().find(|(rule, _)| rule.holds(value)).map(|(_, stage)| *stage)
    }
}

/// What a transport-activity probe counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivityKind {
    /// Work handed to the transport (a put, get or send posted).
    Post,
    /// Work the transport reports finished.
    Completion,
    /// The transport's progress engine being driven (polled).
    Progress,
}

impl ActivityKind {
    pub const ALL: [Self; 3] = [Self::Post, Self::Completion, Self::Progress];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Post => "post",
            Self::Completion => "completion",
            Self::Progress => "progress",
        }
    }

    /// Whether probes of this kind are linked only while a request of
    /// their process nears its stall ([`crate::evidence::gate`]), and so
    /// counted over that window alone. Progress is called thousands of
    /// times a transfer and posts once per descriptor (chunks x KV buffers
    /// x page runs: a hundred and more a request); both matter only to
    /// judge a stall. Completions are kept linked: none of the built-in
    /// profiles counts one, and a profile that does wants them all.
    pub fn near_stall_only(self) -> bool {
        matches!(self, Self::Post | Self::Progress)
    }
}

/// A `[[activity]]` table: a transport function counted, never an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivitySpec {
    /// The profile file the table is in (a profile's own, or one it extends).
    pub origin: Arc<str>,
    pub line: usize,
    pub object: Option<String>,
    pub symbol: String,
    pub kind: ActivityKind,
    /// Skip (and log) when the object is not mapped or lacks the symbol:
    /// an RDMA provider library is only there on hosts with the hardware.
    pub optional: bool,
}

impl ActivitySpec {
    pub fn slot_config() -> SlotConfig {
        SlotConfig { flags: slot_flags::COUNT_ONLY | slot_flags::CONFIGURED, ..SlotConfig::default() }
    }
}

/// A `[[signal]]` table: every hit is an event for a consumer in the
/// agent, named by `name` (e.g. the ZMQ frames behind SGLang's rooms),
/// which the kernel does not track as a request: a value, and optionally a
/// string or raw bytes read at an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalSpec {
    /// The profile file the table is in (a profile's own, or one it extends).
    pub origin: Arc<str>,
    pub line: usize,
    /// What consumers know it by.
    pub name: String,
    pub object: Option<String>,
    pub symbol: String,
    pub at: At,
    pub ret: RetType,
    /// `ret = { from = "ret", deref = [...], type = "..." }`: the return
    /// value is read behind the return register ([`slot_flags::RET_DEREF`]).
    pub ret_at: Option<Source>,
    pub value: Source,
    pub capture: Option<Capture>,
    /// The `bytes` are read at this element of the msgpack array there.
    pub msgpack: Option<Msgpack>,
    /// `strings = { ... }`: every string a container holds, in chunks (in
    /// place of `text` or `bytes`).
    pub strings: Option<Strings>,
    /// The `bytes` are the values of keys of the pickle there.
    pub pickle: Option<Pickle>,
    /// `layout = true`: what it reads is laid out by the library's own
    /// classes (its `[layout]` build ids vouch for it), so a process with
    /// a build the profile does not know goes without it.
    pub layout: bool,
    /// `when = { from, deref, add, is = "RULE" }`: a hit is a signal only
    /// where the value read there satisfies the rule; others cost the
    /// target one read and send nothing.
    pub when: Option<Filter>,
    /// `extra = { ... }`: a second value, read at the entry, handed over
    /// where a return value goes ([`Signal::ret`](crate::frameworks::signals::Signal)).
    pub extra: Option<Source>,
    /// The `extra` is `bytes_else.extra`: read only where the bytes are at
    /// `bytes_else.at` (0 elsewhere).
    pub extra_if_else: bool,
    /// `bytes_else`: where the `bytes` are when a byte says they are not
    /// where `bytes` points.
    pub bytes_else: Option<BytesElse>,
    /// `optional = true`: skip it (and log) in a process that does not map
    /// its object or lacks its symbol, where the profile's other probes
    /// still serve (a NIXL process without pyzmq's libzmq).
    pub optional: bool,
    /// `peer = true`: its `text` names the peer (the remote agent) of the
    /// transfer its thread creates next (NIXL's `createXferReq`,
    /// `makeXferReq`), so every handle's completions count for its peer
    /// ([`crate::evidence::peers`]), whichever framework reads it.
    pub peer: bool,
}

/// A signal's `when`: the value at `at` must satisfy `rule`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub at: Source,
    pub rule: RetRule,
    /// The bits of the value compared (0: all of them).
    pub mask: u64,
}

/// A signal's `bytes_else = { at, unless_byte, is }`: its `bytes` are read
/// where `bytes` says when the byte at `unless_byte` is `is`, else at `at`
/// (a struct that keeps short data inline and longer data behind a
/// pointer, told apart by its type byte).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BytesElse {
    pub at: Source,
    pub unless_byte: Source,
    pub is: u8,
}

/// A signal's `msgpack = { element = N, tag = "..." }`: its `bytes` are
/// element `element` of the msgpack array at their address, an array
/// whose element 0 is the string `tag` (a msgspec tagged `array_like`
/// struct); a hit whose data is no such array is no signal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Msgpack {
    pub element: u32,
    pub tag: String,
}

/// A signal's `strings`: the strings at `at`, one (`list` none) or those
/// of a linked list of nodes each holding an array of them (a libstdc++
/// `unordered_map<string, vector<string>>`), each sent in chunks of
/// [`CHUNK_LEN`](stallwatch_common::CHUNK_LEN) bytes, bounded by `nodes`,
/// `items` a node and `bytes` a string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Strings {
    pub at: Source,
    pub list: Option<StringList>,
    /// A string's length, from the string (its data pointer is at +0).
    pub length: i64,
    pub nodes: u16,
    pub items: u16,
    pub bytes: u32,
    /// Bytes (a message on the wire), not text: every chunk read whole,
    /// NULs and all.
    pub raw: bool,
}

/// Where a [`Strings`] list keeps its nodes and their strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StringList {
    /// The first node's pointer, from the container.
    pub first: i64,
    /// A node's next-node pointer, from the node.
    pub next: i64,
    /// A node's array of strings: begin and end pointers, from the node.
    pub begin: i64,
    pub end: i64,
    /// Bytes from one string of an array to the next.
    pub stride: u32,
}

impl Strings {
    /// Chunk records a string may take.
    pub fn chunks(&self) -> u32 {
        self.bytes.div_ceil(stallwatch_common::CHUNK_LEN as u32)
    }

    /// Most loop turns the kernel's walk can take (see
    /// [`STRINGS_STEPS`](stallwatch_common::STRINGS_STEPS)).
    pub fn turns(&self) -> u64 {
        let per_node = 1 + u64::from(self.items) * (1 + u64::from(self.chunks()));
        if self.list.is_some() { u64::from(self.nodes) * per_node + 1 } else { 1 + u64::from(self.chunks()) + 1 }
    }

    /// The records a hit may send at most.
    pub fn records(&self) -> u64 {
        let strings = if self.list.is_some() { u64::from(self.nodes) * u64::from(self.items) } else { 1 };
        strings * u64::from(self.chunks())
    }

    pub(super) fn lower(&self) -> stallwatch_common::StringWalk {
        let list = self.list.unwrap_or(StringList { first: 0, next: 0, begin: 0, end: 0, stride: 1 });
        stallwatch_common::StringWalk {
            first: list.first,
            next: list.next,
            begin: list.begin,
            end: list.end,
            length: self.length,
            stride: list.stride,
            nodes: self.nodes,
            items: self.items,
            chunks: self.chunks() as u16,
            list: u8::from(self.list.is_some()),
            raw: u8::from(self.raw),
            _pad: [0; 4],
        }
    }
}

/// A signal's `pickle = { tags = [...], keys = [...], items = false }`:
/// its `bytes` are records of the values of `keys` in the pickle at their
/// address, one event each, in a pickle that names one of `tags` near its
/// start (see [`PickleCapture`](stallwatch_common::PickleCapture)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pickle {
    pub tags: Vec<String>,
    pub keys: Vec<String>,
    /// The one key's value is a list whose every string is a record.
    pub items: bool,
}

/// What a signal reads at an address besides its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Capture {
    /// A NUL-terminated string (`text`).
    Text(Source),
    /// [`EXT_ID_LEN`](stallwatch_common::EXT_ID_LEN) raw bytes (`bytes`).
    Bytes(Source),
}

impl SignalSpec {
    /// How many arguments it reads (at a return, its entry saves them).
    pub fn args_read(&self) -> u32 {
        let capture = self.capture.as_ref().map(|capture| match capture {
            Capture::Text(at) | Capture::Bytes(at) => at,
        });
        let when = self.when.as_ref().map(|when| &when.at);
        let bytes_else = self.bytes_else.iter().flat_map(|other| [&other.at, &other.unless_byte]);
        let strings = self.strings.as_ref().map(|strings| &strings.at);
        args_read(
            std::iter::once(&self.value).chain(capture).chain(when).chain(&self.extra).chain(bytes_else).chain(strings),
        )
    }

    /// The kernel-side configuration of this signal's slot.
    pub fn slot_config(&self) -> SlotConfig {
        let mut cfg = SlotConfig { key: self.value.lower(), stage: stage::SIGNAL, ..SlotConfig::default() };
        let capture = match &self.capture {
            Some(Capture::Text(at)) => Some((at, 0)),
            Some(Capture::Bytes(at)) => Some((at, slot_flags::EXT_BYTES)),
            None => None,
        };
        let mut flags = return_flags(self.at, self.ret, self.ret_at.as_ref(), self.args_read(), &mut cfg);
        if let Some((at, bytes)) = capture {
            flags |= slot_flags::HAS_EXT | bytes;
            cfg.ext = at.lower();
        }
        if let Some(msgpack) = &self.msgpack {
            flags |= slot_flags::EXT_MSGPACK;
            cfg.msgpack.element = msgpack.element;
            cfg.msgpack.tag_len = msgpack.tag.len() as u32;
            cfg.msgpack.tag[..msgpack.tag.len()].copy_from_slice(msgpack.tag.as_bytes());
        }
        if let Some(when) = &self.when {
            flags |= slot_flags::FILTER;
            cfg.filter = when.at.lower();
            cfg.filter_rule = when.rule;
            cfg.filter_mask = when.mask;
        }
        if let Some(extra) = &self.extra {
            // An entry value with no rules: every hit is the signal, its
            // `ret` the value read.
            flags |= slot_flags::ENTRY_VALUE;
            cfg.value = extra.lower();
            if self.extra_if_else {
                flags |= slot_flags::VALUE_IF_ELSE;
            }
        }
        if let Some(other) = &self.bytes_else {
            flags |= slot_flags::EXT_SELECT;
            cfg.select = other.unless_byte.lower();
            cfg.ext_else = other.at.lower();
            cfg.select_byte = other.is;
        }
        if let Some(strings) = &self.strings {
            flags |= slot_flags::EXT_STRINGS;
            cfg.ext = strings.at.lower();
            cfg.strings = strings.lower();
        }
        if let Some(pickle) = &self.pickle {
            flags |= slot_flags::EXT_PICKLE;
            for (n, tag) in pickle.tags.iter().enumerate() {
                cfg.pickle.tag_lens[n] = tag.len() as u8;
                cfg.pickle.tags[n][..tag.len()].copy_from_slice(tag.as_bytes());
            }
            for (n, key) in pickle.keys.iter().enumerate() {
                cfg.pickle.key_lens[n] = key.len() as u8;
                cfg.pickle.keys[n][..key.len()].copy_from_slice(key.as_bytes());
            }
            cfg.pickle.items = u8::from(pickle.items);
        }
        cfg.flags = flags | slot_flags::CONFIGURED;
        cfg
    }
}

/// The flags (and saved-argument count) of a probe at `at`: a return
/// probe's entry saves the `nargs` arguments its return reads; a return
/// value read behind the return register (`ret_at`) is read through
/// [`SlotConfig::value`].
pub(super) fn return_flags(at: At, ret: RetType, ret_at: Option<&Source>, nargs: u32, cfg: &mut SlotConfig) -> u32 {
    if at != At::Return {
        return 0;
    }
    let mut flags = slot_flags::RETURN | ret.flag();
    if let Some(ret_at) = ret_at {
        flags |= slot_flags::RET_DEREF;
        cfg.value = ret_at.lower();
    }
    if nargs > 0 {
        flags |= slot_flags::NEEDS_ARGS;
        cfg.nargs = nargs;
    }
    flags
}

/// How many arguments a probe reading `sources` needs saved.
pub(super) fn args_read<'a>(sources: impl Iterator<Item = &'a Source>) -> u32 {
    sources
        .filter_map(|source| match source.from {
            From::Arg(n) => Some(u32::from(n) + 1),
            From::Ret | From::Key => None,
        })
        .max()
        .unwrap_or(0)
}

/// Entry or return of the probed function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum At {
    Entry,
    Return,
}

/// Where a value comes from, before the dereference chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum From {
    Arg(u8),
    Ret,
    /// The request key of the same hit (for external ids and guards).
    Key,
}

/// `from`, then `deref` (each step reads a `u64` at value + offset), then
/// `add`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub from: From,
    pub deref: Vec<i64>,
    pub add: i64,
}

/// A string read at the address a [`Source`] yields, optionally only when
/// the byte at `guard` is non-zero.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StringSource {
    pub at: Source,
    pub guard: Option<Source>,
}

/// Which lifecycle event a hit is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Every hit is this event.
    Always(Stage),
    /// Return probes: the first rule the return value satisfies picks the
    /// event; other returns (e.g. "still in progress") emit nothing.
    OnReturn(Vec<(RetRule, Stage)>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSpec {
    /// The profile file the table is in (a profile's own, or one it extends).
    pub origin: Arc<str>,
    /// 1-based line of the `[[probe]]` table.
    pub line: usize,
    /// Executable or library name as mapped in the target; `None` is the
    /// main executable.
    pub object: Option<String>,
    pub symbol: String,
    pub at: At,
    pub action: Action,
    pub key: Source,
    pub external_id: Option<StringSource>,
    pub ret: RetType,
    /// `ret = { from = "ret", deref = [...], type = "..." }`: what the
    /// rules compare is read behind the return register (a `Status`
    /// returned through a hidden result pointer), not the register itself.
    pub ret_at: Option<Source>,
    pub only_on_change: bool,
    /// Its events may stay in the kernel's in-flight table instead of the
    /// ring buffer while they only move a busy request along
    /// ([`slot_flags::QUIET`]).
    pub quiet: bool,
    /// Its events end the lifecycle at a live stage: it emits only the
    /// stage its profile completes at (`complete_at`), or terminal ones.
    pub ends: bool,
    /// `read_status = true`: read the profile's `[status]` at this entry.
    pub read_status: bool,
    /// What `read_status` lowers to, once the profile's `[status]` is known.
    pub entry_status: Option<EntryStatus>,
}

/// The profile's `[status]`, read by the kernel at an entry probe (its
/// `read_status`): where the value lies and the terminal rules of the
/// table (a value they do not take is the probe's own event). The release
/// of a transfer that failed is then the failure: the handle's memory is
/// no longer readable once released, and a failure released before its
/// stall came due would otherwise end `completed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryStatus {
    pub at: Source,
    pub value: RetType,
    pub rules: Vec<(RetRule, Stage)>,
}

impl EntryStatus {
    /// From the profile's `status`: refused when the kernel could not
    /// pick what the table picks (too many terminal
    /// rules, one an earlier live rule overlaps, a pointer chain too long).
    pub(super) fn of(status: &StatusSpec) -> Result<Self> {
        let mut earlier = Values::none();
        let mut rules = Vec::new();
        for (rule, stage) in &status.rules {
            let held = Values::held_by(rule, status.value);
            if stage.is_terminal() {
                if held.intersects(&earlier) {
                    bail!(
                        "`read_status`: the [status] rule for {stage} (profile {}, line {}) takes values an earlier rule \
                         takes first, which the kernel cannot tell apart at the probe: make the {stage} rules come \
                         first or not overlap",
                        status.origin,
                        status.line
                    );
                }
                rules.push((*rule, *stage));
            }
            earlier = earlier.union(held);
        }
        if rules.is_empty() || rules.len() > MAX_RET_RULES {
            bail!(
                "`read_status`: the [status] of profile {}, line {} has {} rules for a terminal event (failed, aborted); \
                 the kernel takes 1 to {MAX_RET_RULES}: merge them (e.g. `when = \"< -1\"`) or drop `read_status`",
                status.origin,
                status.line,
                rules.len()
            );
        }
        if status.at.deref.len() >= MAX_DEREF {
            bail!(
                "`read_status`: the [status] `at` of profile {}, line {} follows {} pointers; read at a probe it may \
                 follow at most {}",
                status.origin,
                status.line,
                status.at.deref.len(),
                MAX_DEREF - 1
            );
        }
        Ok(Self { at: status.at.clone(), value: status.value, rules })
    }

    /// The value's source for the kernel: the table's pointer chain, then
    /// one more read at its `add` (the value itself).
    pub(super) fn lower(&self) -> ValueSource {
        let mut deref = self.at.deref.clone();
        deref.push(self.at.add);
        Source { from: From::Key, deref, add: 0 }.lower()
    }
}

impl Profile {
    /// The `[[process]]` a process with command line `args` is, if the
    /// profile says: the first whose title matches.
    pub fn role_of(&self, args: &[String]) -> Option<&ProcessRole> {
        let line = args.join(" ");
        self.processes.iter().find(|role| role.title.is_match(&line))
    }

    /// The probe slots each process watched under this profile takes: one
    /// per `[[probe]]`, `[[activity]]` and `[[signal]]` (a return probe's entry
    /// and return share theirs), fewer only where an optional one's
    /// function is missing. Loading refuses a profile that needs more than
    /// the agent has ([`stallwatch_common::MAX_SLOTS`]).
    pub fn slots_needed(&self) -> usize {
        self.probes.len() + self.activity.len() + self.signals.len()
    }
}

impl ActivitySpec {
    /// The function counted: (object, symbol).
    pub(super) fn function(&self) -> (Option<&str>, &str) {
        (self.object.as_deref(), &self.symbol)
    }
}

impl ProbeSpec {
    /// Whether this probe's events end the lifecycle under `complete_at`
    /// (of the profile `profile`): the kernel ends a lifecycle per probe,
    /// so one whose rules pick both the completing stage and another live
    /// stage is refused.
    pub(super) fn ends_under(&self, complete_at: CompleteAt, profile: &str) -> Result<bool> {
        let stages: Vec<Stage> = match &self.action {
            Action::Always(stage) => vec![*stage],
            Action::OnReturn(rules) => rules.iter().map(|(_, stage)| *stage).collect(),
        };
        let completing = stages.iter().any(|stage| complete_at.ends_at(*stage));
        match stages.iter().find(|stage| !stage.is_terminal() && !complete_at.ends_at(**stage)) {
            Some(live) if completing => bail!(
                "its rules pick both {} (where profile {profile} completes a lifecycle: `complete_at = \"{}\"`) and \
                 {live}, but a probe's events either all end the lifecycle or none do: split the rules over two \
                 [[probe]] tables on the same function",
                complete_at.as_str(),
                complete_at.as_str()
            ),
            _ => Ok(completing),
        }
    }

    /// The function probed: (object, symbol).
    pub(super) fn function(&self) -> (Option<&str>, &str) {
        (self.object.as_deref(), &self.symbol)
    }

    /// The kernel-side configuration of this probe's slot.
    pub fn slot_config(&self) -> SlotConfig {
        let mut cfg = SlotConfig { key: self.key.lower(), ..SlotConfig::default() };
        let mut flags = return_flags(self.at, self.ret, self.ret_at.as_ref(), self.args_read(), &mut cfg);
        match &self.action {
            Action::Always(stage) => cfg.stage = *stage as u8,
            Action::OnReturn(rules) => {
                for (slot, (rule, stage)) in cfg.rules.iter_mut().zip(rules) {
                    *slot = RetRule { stage: *stage as u8, ..*rule };
                }
            }
        }
        if let Some(ext) = &self.external_id {
            flags |= slot_flags::HAS_EXT;
            cfg.ext = ext.at.lower();
            if let Some(guard) = &ext.guard {
                flags |= slot_flags::HAS_GUARD;
                cfg.guard = guard.lower();
            }
        }
        if self.only_on_change {
            flags |= slot_flags::ONLY_ON_CHANGE;
        }
        if self.quiet {
            flags |= slot_flags::QUIET;
        }
        if self.ends {
            flags |= slot_flags::ENDS;
        }
        if let Some(status) = &self.entry_status {
            flags |= slot_flags::ENTRY_VALUE | status.value.flag();
            cfg.value = status.lower();
            for (slot, (rule, stage)) in cfg.rules.iter_mut().zip(&status.rules) {
                *slot = RetRule { stage: *stage as u8, ..*rule };
            }
        }
        // A zero flags word means "no slot" to the kernel side.
        cfg.flags = flags | slot_flags::CONFIGURED;
        cfg
    }

    /// The return values for which this probe emits an event.
    pub(super) fn emits_for(&self) -> Values {
        match &self.action {
            Action::Always(_) => Values::all(self.ret),
            Action::OnReturn(rules) => {
                rules.iter().fold(Values::none(), |values, (rule, _)| values.union(Values::held_by(rule, self.ret)))
            }
        }
    }

    /// Why this probe cannot sit beside `earlier`, if it cannot: on the
    /// same function's same end, with the same key, both would emit for
    /// one call (two events for one request), and one function returns
    /// one type. Probes of one call with different keys, or return rules
    /// split over two probes (more than [`MAX_RET_RULES`] outcomes), may.
    pub(super) fn conflict_with(&self, earlier: &ProbeSpec) -> Option<String> {
        if (&self.object, &self.symbol, self.at) != (&earlier.object, &earlier.symbol, earlier.at)
            || self.key != earlier.key
        {
            return None;
        }
        let end = match self.at {
            At::Entry => "entry",
            At::Return => "return",
        };
        if self.at == At::Return && (self.ret, &self.ret_at) != (earlier.ret, &earlier.ret_at) {
            return Some(format!(
                "the [[probe]] on line {} reads the same function's return as {}{}: one function returns one type \
                 (read one way); give both the same `ret`",
                earlier.line,
                earlier.ret.as_str(),
                if earlier.ret_at.is_some() { " behind the return register" } else { "" }
            ));
        }
        self.emits_for().intersects(&earlier.emits_for()).then(|| {
            format!(
                "the [[probe]] on line {} probes the same function's {end} with the same key, and both would emit for \
                 one call (two events for one request): merge them into one [[probe]], or make their `on_return` rules \
                 exclusive",
                earlier.line
            )
        })
    }

    /// How many arguments a return probe reads (so its entry must save them).
    pub fn args_read(&self) -> u32 {
        let ext = self.external_id.iter().flat_map(|ext| std::iter::once(&ext.at).chain(&ext.guard));
        args_read(std::iter::once(&self.key).chain(ext))
    }
}

impl Source {
    pub(super) fn lower(&self) -> ValueSource {
        let mut offsets = [0; MAX_DEREF];
        offsets[..self.deref.len()].copy_from_slice(&self.deref);
        let (base, index) = match self.from {
            From::Arg(n) => (base::ARG, n),
            From::Ret => (base::RET, 0),
            From::Key => (base::KEY, 0),
        };
        ValueSource { base, index, depth: self.deref.len() as u8, _pad: [0; 5], offsets, add: self.add }
    }
}

impl Source {
    /// A string (or guard byte) read from the key must be read *through*
    /// it: the key is an id (an integer, or a handle), never the string's
    /// own address, so `{ from = "key" }` alone would fail on every hit and
    /// count each delivered event as lost (`read_failed`). `int_key`: the
    /// key is a 32-bit return value, which points nowhere at all.
    pub(super) fn check_from_key(&self, field: &str, int_key: bool) -> Result<()> {
        if self.from != From::Key {
            return Ok(());
        }
        if int_key {
            bail!(
                "`{field}.from = \"key\"`: the key is a 32-bit return value (`key = {{ from = \"ret\" }}` with \
                 `ret = \"i32\"`), not an address, so nothing can be read through it: read the {field} from an \
                 argument instead"
            );
        }
        if self.deref.is_empty() && self.add == 0 {
            bail!(
                "`{field} = {{ from = \"key\" }}` would read at the address the key holds, but a request key is an id \
                 (an integer or a handle), so every read would fail and count the event as lost: give where the string \
                 lies from there (`deref = [OFFSET]` for a pointer field, `add = OFFSET` for inline chars), or, if the \
                 key really is the string's address, read it from the key's own source (e.g. `from = \"arg0\"`)"
            );
        }
        Ok(())
    }
}

impl fmt::Display for From {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Arg(n) => write!(f, "arg{n}"),
            Self::Ret => f.write_str("ret"),
            Self::Key => f.write_str("key"),
        }
    }
}
