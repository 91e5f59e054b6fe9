//! Probe profiles: which functions of a target are which lifecycle points,
//! and where each hit's request key lives.
//!
//! A profile is a TOML file (format in docs/profiles.md) or one of the built-ins.
//! Parsing checks everything the kernel side cannot: every error names the
//! file, the line of the `[[probe]]` table and what to write instead.
use std::{
    fmt,
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{Context as _, Result, anyhow, bail};
use serde::Deserialize;
use stallwatch_common::{
    MAX_DEREF, MAX_RET_RULES, MSGPACK_STEPS, MSGPACK_TAG_LEN, RetRule, SAVED_ARGS, SlotConfig, ValueSource, base, cmp,
    slot_flags, stage,
};
use toml::Spanned;

use super::returns::Values;
use crate::lifecycle::Stage;

/// Built-in profiles: (name, TOML text).
const BUILTIN: &[(&str, &str)] = &[
    ("demo", include_str!("builtin/demo.toml")),
    ("nixl", include_str!("builtin/nixl.toml")),
    ("marker", include_str!("builtin/marker.toml")),
    ("sglang", include_str!("builtin/sglang.toml")),
];

/// Deepest chain of `extends` a profile may have (a longer one is a loop
/// or a mistake).
const MAX_EXTENDS: usize = 8;

/// Names of the built-in profiles, for help texts and errors.
pub fn builtin_names() -> impl Iterator<Item = &'static str> {
    BUILTIN.iter().map(|(name, _)| *name)
}

/// The TOML text of a built-in profile.
pub fn builtin_text(name: &str) -> Option<&'static str> {
    BUILTIN.iter().find(|(n, _)| *n == name).map(|(_, text)| *text)
}

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

    fn parse(text: &str) -> Result<Self> {
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
        self.rules.iter().find(|(rule, _)| super::returns::holds(rule, value)).map(|(_, stage)| *stage)
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
    pub value: Source,
    pub capture: Option<Capture>,
    /// The `bytes` are read at this element of the msgpack array there.
    pub msgpack: Option<Msgpack>,
    /// `layout = true`: what it reads is laid out by the library's own
    /// classes (its `[layout]` build ids vouch for it), so a process with
    /// a build the profile does not know goes without it.
    pub layout: bool,
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
        args_read(std::iter::once(&self.value).chain(capture))
    }

    /// The kernel-side configuration of this signal's slot.
    pub fn slot_config(&self) -> SlotConfig {
        let mut cfg = SlotConfig { key: self.value.lower(), stage: stage::SIGNAL, ..SlotConfig::default() };
        let capture = match &self.capture {
            Some(Capture::Text(at)) => Some((at, 0)),
            Some(Capture::Bytes(at)) => Some((at, slot_flags::EXT_BYTES)),
            None => None,
        };
        let mut flags = return_flags(self.at, self.ret, self.args_read(), &mut cfg);
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
        cfg.flags = flags | slot_flags::CONFIGURED;
        cfg
    }
}

/// The flags (and saved-argument count) of a probe at `at`: a return
/// probe's entry saves the `nargs` arguments its return reads.
fn return_flags(at: At, ret: RetType, nargs: u32, cfg: &mut SlotConfig) -> u32 {
    if at != At::Return {
        return 0;
    }
    let mut flags = slot_flags::RETURN;
    if ret == RetType::I32 {
        flags |= slot_flags::RET_I32;
    }
    if nargs > 0 {
        flags |= slot_flags::NEEDS_ARGS;
        cfg.nargs = nargs;
    }
    flags
}

/// How many arguments a probe reading `sources` needs saved.
fn args_read<'a>(sources: impl Iterator<Item = &'a Source>) -> u32 {
    sources
        .filter_map(|source| match source.from {
            From::Arg(n) => Some(u32::from(n) + 1),
            From::Ret | From::Key => None,
        })
        .max()
        .unwrap_or(0)
}

/// Entry or return of the probed function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum At {
    Entry,
    Return,
}

/// Width of the return value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetType {
    #[default]
    I64,
    /// A C `int` (a status enum): only the low 32 bits of `rax` are defined.
    I32,
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
    fn of(status: &StatusSpec) -> Result<Self> {
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
    fn lower(&self) -> ValueSource {
        let mut deref = self.at.deref.clone();
        deref.push(self.at.add);
        Source { from: From::Key, deref, add: 0 }.lower()
    }
}

impl Profile {
    /// `spec` is a built-in name or a path to a TOML file.
    pub fn load(spec: &str) -> Result<Self> {
        Self::load_in(spec, None, &mut Vec::new())
    }

    /// Parse and validate profile text; `origin` names it in errors. An
    /// `extends` path in it is taken from the current directory.
    pub fn parse(text: &str, origin: &str) -> Result<Self> {
        Self::parse_in(text, origin, None, &mut Vec::new())
    }

    /// `spec` as [`Self::load`], a relative path taken from `dir` (the
    /// directory of the profile that extends it); `chain` holds the
    /// origins being loaded, to refuse a loop.
    fn load_in(spec: &str, dir: Option<&Path>, chain: &mut Vec<String>) -> Result<Self> {
        if let Some(text) = builtin_text(spec) {
            return Self::parse_in(text, &format!("built-in profile `{spec}`"), None, chain);
        }
        let path = match dir {
            Some(dir) if Path::new(spec).is_relative() => dir.join(spec),
            _ => PathBuf::from(spec),
        };
        if !path.exists() {
            bail!(
                "no built-in profile named `{spec}` and no file `{}`: built-ins are {}; \
                 otherwise pass the path of a profile TOML file",
                path.display(),
                builtin_names().collect::<Vec<_>>().join(", ")
            );
        }
        let text = crate::files::read_text(&path, "profile file")?;
        let dir = path.parent().map(Path::to_path_buf);
        Self::parse_in(&text, &path.display().to_string(), dir.as_deref(), chain)
    }

    fn parse_in(text: &str, origin: &str, dir: Option<&Path>, chain: &mut Vec<String>) -> Result<Self> {
        if chain.iter().any(|earlier| earlier == origin) {
            bail!("profiles extend one another in a loop: {} -> {origin}", chain.join(" -> "));
        }
        let raw: RawProfile = toml::from_str(text).map_err(|err| anyhow!("profile {origin}: {err}"))?;
        let here: Arc<str> = origin.into();
        let base = match raw.extends {
            Some(spanned) => {
                let line = line_of(text, spanned.span().start);
                let spec = spanned.into_inner();
                let at = format!("profile {origin}, line {line} (`extends = \"{spec}\"`)");
                chain.push(origin.to_owned());
                if chain.len() > MAX_EXTENDS {
                    bail!(
                        "{at}: more than {MAX_EXTENDS} profiles extend one another ({}): shorten the chain",
                        chain.join(" -> ")
                    );
                }
                let base = Self::load_in(&spec, dir, chain).with_context(|| at.clone())?;
                chain.pop();
                Some(base)
            }
            None => None,
        };
        let own_probes = raw
            .probe
            .into_iter()
            .map(|spanned| {
                let line = line_of(text, spanned.span().start);
                let raw = spanned.into_inner();
                let symbol = raw.symbol.clone();
                raw.validate(here.clone(), line, |span| line_of(text, span.start))
                    .map_err(|err| anyhow!("profile {origin}, line {line} ([[probe]] for `{symbol}`): {err}"))
            })
            .collect::<Result<Vec<_>>>()?;
        let own_activity = raw
            .activity
            .into_iter()
            .map(|spanned| {
                let line = line_of(text, spanned.span().start);
                let raw = spanned.into_inner();
                if raw.symbol.trim().is_empty() {
                    bail!("profile {origin}, line {line} ([[activity]]): `symbol` is empty");
                }
                Ok(ActivitySpec {
                    origin: here.clone(),
                    line,
                    object: raw.object.filter(|object| !object.is_empty()),
                    symbol: raw.symbol,
                    kind: raw.kind,
                    optional: raw.optional,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let own_status = raw
            .status
            .map(|spanned| {
                let line = line_of(text, spanned.span().start);
                spanned
                    .into_inner()
                    .validate(here.clone(), line, |span| line_of(text, span.start))
                    .map_err(|err| anyhow!("profile {origin}, line {line} ([status]): {err}"))
            })
            .transpose()?;
        let own_signals = raw
            .signal
            .into_iter()
            .map(|spanned| {
                let line = line_of(text, spanned.span().start);
                let raw = spanned.into_inner();
                let name = raw.name.clone();
                raw.validate(here.clone(), line)
                    .map_err(|err| anyhow!("profile {origin}, line {line} ([[signal]] `{name}`): {err}"))
            })
            .collect::<Result<Vec<SignalSpec>>>()?;
        // What this file probes replaces what the base probes on the same
        // function (both ends): a profile changes a probe by giving the
        // function's probes anew, and adds one on a function of its own. A
        // signal replaces the base's of the same name.
        let own_complete_at = raw
            .complete_at
            .map(|spanned| {
                let line = line_of(text, spanned.span().start);
                CompleteAt::parse(spanned.get_ref())
                    .map(|at| (at, line))
                    .map_err(|err| anyhow!("profile {origin}, line {line}: {err}"))
            })
            .transpose()?;
        let own_layout = raw
            .layout
            .map(|spanned| {
                let line = line_of(text, spanned.span().start);
                let raw = spanned.into_inner();
                let bad = |why: String| anyhow!("profile {origin}, line {line} ([layout]): {why}");
                if raw.object.trim().is_empty() {
                    return Err(bad("`object` is empty: name the library whose layout the offsets are (e.g. \"libnixl.so\")".into()));
                }
                if raw.build_ids.is_empty() {
                    return Err(bad("`build_ids` is empty: list the GNU build ids (`readelf -n LIB`) the offsets were checked against".into()));
                }
                for id in &raw.build_ids {
                    if id.is_empty() || id.len() % 2 != 0 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return Err(bad(format!("build id {id:?} is not hex bytes: copy it from `readelf -n LIB` (\"Build ID: ...\")")));
                    }
                }
                Ok(Layout {
                    origin: here.clone(),
                    line,
                    object: raw.object,
                    build_ids: raw.build_ids.into_iter().map(|id| id.to_ascii_lowercase()).collect(),
                    checked: raw.checked,
                })
            })
            .transpose()?;
        let (mut probes, activity, signals, status, extends, complete_at, layout) = match base {
            Some(base) => {
                let mut probes: Vec<ProbeSpec> = base
                    .probes
                    .into_iter()
                    .filter(|probe| !own_probes.iter().any(|own| own.function() == probe.function()))
                    .collect();
                probes.extend(own_probes);
                let mut activity: Vec<ActivitySpec> = base
                    .activity
                    .into_iter()
                    .filter(|spec| !own_activity.iter().any(|own| own.function() == spec.function()))
                    .collect();
                activity.extend(own_activity);
                let mut signals: Vec<SignalSpec> = base
                    .signals
                    .into_iter()
                    .filter(|spec| !own_signals.iter().any(|own| own.name == spec.name))
                    .collect();
                signals.extend(own_signals);
                let complete_at = own_complete_at.map(|(at, _)| at).unwrap_or(base.complete_at);
                (
                    probes,
                    activity,
                    signals,
                    own_status.or(base.status),
                    Some(base.origin),
                    complete_at,
                    own_layout.or(base.layout),
                )
            }
            None => (
                own_probes,
                own_activity,
                own_signals,
                own_status,
                None,
                own_complete_at.map(|(at, _)| at).unwrap_or_default(),
                own_layout,
            ),
        };
        for probe in &mut probes {
            probe.ends = probe.ends_under(complete_at, origin).map_err(|err| {
                anyhow!("profile {}, line {} ([[probe]] for `{}`): {err}", probe.origin, probe.line, probe.symbol)
            })?;
            if probe.read_status {
                let entry = match &status {
                    Some(status) => EntryStatus::of(status),
                    None => Err(anyhow!(
                        "`read_status` reads the profile's [status], and profile {origin} has none: add one"
                    )),
                };
                probe.entry_status = Some(entry.map_err(|err| {
                    anyhow!("profile {}, line {} ([[probe]] for `{}`): {err}", probe.origin, probe.line, probe.symbol)
                })?);
            }
        }
        if probes.is_empty() {
            bail!("profile {origin}: no [[probe]] tables; a profile needs at least one lifecycle point");
        }
        for (i, probe) in probes.iter().enumerate() {
            if let Some(err) = probes[..i].iter().find_map(|earlier| probe.conflict_with(earlier)) {
                bail!("profile {}, line {} ([[probe]] for `{}`): {err}", probe.origin, probe.line, probe.symbol);
            }
        }
        for (i, spec) in activity.iter().enumerate() {
            if let Some(earlier) = activity[..i].iter().find(|e| e.function() == spec.function()) {
                bail!(
                    "profile {}, line {} ([[activity]] for `{}`): the [[activity]] on line {} counts the same \
                     function already, so every call would count twice: keep one",
                    spec.origin,
                    spec.line,
                    spec.symbol,
                    earlier.line
                );
            }
        }
        for (i, spec) in signals.iter().enumerate() {
            if let Some(earlier) = signals[..i].iter().find(|e| e.name == spec.name) {
                bail!(
                    "profile {}, line {} ([[signal]] `{}`): the [[signal]] on line {} has the same name, and \
                     consumers tell signals apart by name: rename one",
                    spec.origin,
                    spec.line,
                    spec.name,
                    earlier.line
                );
            }
        }
        Ok(Self {
            name: raw.name.unwrap_or_else(|| origin.to_owned()),
            origin: origin.to_owned(),
            extends,
            probes,
            activity,
            signals,
            status,
            complete_at,
            layout,
        })
    }

    /// This profile without what its `[layout]` offsets give, for a process
    /// that maps a build of the library the profile does not know: no
    /// external id read through the key of a probe on that library, no
    /// signal on it that reads its classes (`layout = true`), no
    /// `read_status` (the `[status]` reads are turned off per process by
    /// [`crate::status::StatusReader::turn_off`]). Lifecycle events, keys
    /// (function arguments: the API) and transport counts stay.
    pub fn without_offsets(&self) -> Self {
        let mut profile = self.clone();
        let Some(layout) = &self.layout else { return profile };
        for probe in &mut profile.probes {
            if probe.object.as_deref().is_some_and(|object| object == layout.object) {
                if probe.external_id.as_ref().is_some_and(|ext| ext.at.from == From::Key) {
                    probe.external_id = None;
                }
                probe.entry_status = None;
            }
        }
        profile.signals.retain(|signal| !(signal.layout && signal.object.as_deref() == Some(layout.object.as_str())));
        profile
    }
}

impl Profile {
    /// Whether the agent follows SGLang's rooms under this profile (it
    /// reads the bootstrap ZMQ messages, [`crate::sglang`]): a request the
    /// kernel holds that is keyed by its room is then one of those rooms,
    /// not a probe's (the `marker` profile's are keyed by room too).
    pub fn follows_rooms(&self) -> bool {
        self.signals.iter().any(|spec| spec.name == "zmq_recv")
    }
}

impl ActivitySpec {
    /// The function counted: (object, symbol).
    fn function(&self) -> (Option<&str>, &str) {
        (self.object.as_deref(), &self.symbol)
    }
}

impl ProbeSpec {
    /// Whether this probe's events end the lifecycle under `complete_at`
    /// (of the profile `profile`): the kernel ends a lifecycle per probe,
    /// so one whose rules pick both the completing stage and another live
    /// stage is refused.
    fn ends_under(&self, complete_at: CompleteAt, profile: &str) -> Result<bool> {
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
    fn function(&self) -> (Option<&str>, &str) {
        (self.object.as_deref(), &self.symbol)
    }

    /// The kernel-side configuration of this probe's slot.
    pub fn slot_config(&self) -> SlotConfig {
        let mut cfg = SlotConfig { key: self.key.lower(), ..SlotConfig::default() };
        let mut flags = return_flags(self.at, self.ret, self.args_read(), &mut cfg);
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
            flags |= slot_flags::ENTRY_VALUE;
            if status.value == RetType::I32 {
                flags |= slot_flags::RET_I32;
            }
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
    fn emits_for(&self) -> Values {
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
    fn conflict_with(&self, earlier: &ProbeSpec) -> Option<String> {
        if (&self.object, &self.symbol, self.at) != (&earlier.object, &earlier.symbol, earlier.at)
            || self.key != earlier.key
        {
            return None;
        }
        let end = match self.at {
            At::Entry => "entry",
            At::Return => "return",
        };
        if self.at == At::Return && self.ret != earlier.ret {
            return Some(format!(
                "the [[probe]] on line {} reads the same function's return as {:?}: one function returns one type; \
                 give both the same `ret`",
                earlier.line, earlier.ret
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
    fn lower(&self) -> ValueSource {
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
    fn check_from_key(&self, field: &str, int_key: bool) -> Result<()> {
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

fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    name: Option<String>,
    /// A profile this one starts from (a built-in name or a file).
    extends: Option<Spanned<String>>,
    #[serde(rename = "description")]
    _description: Option<String>,
    #[serde(default)]
    probe: Vec<Spanned<RawProbe>>,
    #[serde(default)]
    activity: Vec<Spanned<RawActivity>>,
    #[serde(default)]
    signal: Vec<Spanned<RawSignal>>,
    status: Option<Spanned<RawStatus>>,
    complete_at: Option<Spanned<String>>,
    layout: Option<Spanned<RawLayout>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLayout {
    object: String,
    build_ids: Vec<String>,
    checked: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSignal {
    name: String,
    object: Option<String>,
    symbol: String,
    at: At,
    ret: Option<RetType>,
    value: RawSource,
    text: Option<RawSource>,
    bytes: Option<RawSource>,
    msgpack: Option<RawMsgpack>,
    #[serde(default)]
    layout: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMsgpack {
    element: u32,
    #[serde(default)]
    tag: String,
}

impl RawSignal {
    fn validate(self, origin: Arc<str>, line: usize) -> Result<SignalSpec> {
        if self.name.trim().is_empty() {
            bail!("`name` is empty: name the signal as its consumer knows it");
        }
        if self.symbol.trim().is_empty() {
            bail!("`symbol` is empty: name the function to probe (mangled C++ names are fine)");
        }
        if self.at == At::Entry && self.ret.is_some() {
            bail!("`ret` describes a return value: it needs `at = \"return\"`");
        }
        let value = self.value.validate("value", self.at, false)?;
        // `from = "key"` reads at the signal's value, which may well be an
        // address (a data pointer returned).
        let capture = match (self.text, self.bytes) {
            (Some(text), None) => Some(Capture::Text(text.validate("text", self.at, true)?)),
            (None, Some(bytes)) => Some(Capture::Bytes(bytes.validate("bytes", self.at, true)?)),
            (None, None) => None,
            (Some(_), Some(_)) => bail!("give either `text` (a string) or `bytes` (raw bytes), not both"),
        };
        let msgpack = self.msgpack.map(|m| m.validate(matches!(capture, Some(Capture::Bytes(_))))).transpose()?;
        Ok(SignalSpec {
            origin,
            line,
            name: self.name,
            object: self.object.filter(|object| !object.is_empty()),
            symbol: self.symbol,
            at: self.at,
            ret: self.ret.unwrap_or_default(),
            value,
            capture,
            msgpack,
            layout: self.layout,
        })
    }
}

impl RawMsgpack {
    fn validate(self, bytes: bool) -> Result<Msgpack> {
        if !bytes {
            bail!(
                "`msgpack` says where in a msgpack array to read `bytes`: give `bytes` too (its address is the array's)"
            );
        }
        if self.tag.len() > MSGPACK_TAG_LEN {
            bail!("`msgpack.tag` is {} bytes; at most {MSGPACK_TAG_LEN} are matched: shorten it", self.tag.len());
        }
        // Each element before it costs at least one header read.
        if self.element >= MSGPACK_STEPS {
            bail!(
                "`msgpack.element = {}` is past what the kernel walks ({MSGPACK_STEPS} headers): no hit could reach it",
                self.element
            );
        }
        Ok(Msgpack { element: self.element, tag: self.tag })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStatus {
    at: RawSource,
    #[serde(rename = "type")]
    value: RetType,
    values: Vec<Spanned<RawRule>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawActivity {
    object: Option<String>,
    symbol: String,
    kind: ActivityKind,
    #[serde(default = "yes")]
    optional: bool,
}

const fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProbe {
    object: Option<String>,
    symbol: String,
    at: At,
    event: Option<String>,
    on_return: Option<Vec<Spanned<RawRule>>>,
    key: RawSource,
    external_id: Option<RawString>,
    ret: Option<RetType>,
    #[serde(default)]
    only_on_change: bool,
    #[serde(default)]
    quiet: bool,
    #[serde(default)]
    read_status: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    when: String,
    event: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSource {
    from: String,
    #[serde(default)]
    deref: Vec<i64>,
    #[serde(default)]
    add: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawString {
    from: String,
    #[serde(default)]
    deref: Vec<i64>,
    #[serde(default)]
    add: i64,
    guard: Option<RawSource>,
}

impl RawProbe {
    /// `line_at` turns a span of the file into its line.
    fn validate(
        self,
        origin: Arc<str>,
        line: usize,
        line_at: impl Fn(std::ops::Range<usize>) -> usize,
    ) -> Result<ProbeSpec> {
        if self.symbol.trim().is_empty() {
            bail!("`symbol` is empty: name the function to probe (mangled C++ names are fine)");
        }
        let action = match (self.event, self.on_return) {
            (Some(event), None) => Action::Always(parse_stage(&event)?),
            (None, Some(rules)) => {
                if self.at != At::Return {
                    bail!("`on_return` needs `at = \"return\"`; an entry probe takes a single `event`");
                }
                if rules.is_empty() || rules.len() > MAX_RET_RULES {
                    bail!("`on_return` takes 1 to {MAX_RET_RULES} rules, found {}", rules.len());
                }
                let parsed = parse_rules(rules, self.ret.unwrap_or_default(), &line_at)?;
                Action::OnReturn(parsed)
            }
            (Some(_), Some(_)) => bail!("give either `event` or `on_return`, not both"),
            (None, None) => bail!(
                "no lifecycle event: add `event = \"...\"` (one of {}) or, for a return probe, `on_return = [...]`",
                stage_names()
            ),
        };
        if self.at == At::Entry && self.ret.is_some() {
            bail!("`ret` describes a return value: it needs `at = \"return\"`");
        }
        if self.read_status && (self.at != At::Entry || !matches!(action, Action::Always(_))) {
            bail!(
                "`read_status` reads the request's [status] at the function's entry, where its memory is still its \
                 own: it needs `at = \"entry\"` and one `event`"
            );
        }
        if self.at == At::Entry && self.only_on_change {
            bail!("`only_on_change` compares return values: it needs `at = \"return\"`");
        }
        let ret = self.ret.unwrap_or_default();
        let key = self.key.validate("key", self.at, false)?;
        let int_key = key.from == From::Ret && key.deref.is_empty() && ret == RetType::I32;
        let external_id = self
            .external_id
            .map(|ext| -> Result<StringSource> {
                let at = RawSource { from: ext.from, deref: ext.deref, add: ext.add }.validate(
                    "external_id",
                    self.at,
                    true,
                )?;
                let guard = ext.guard.map(|g| g.validate("external_id.guard", self.at, true)).transpose()?;
                for (field, source) in
                    std::iter::once(("external_id", &at)).chain(guard.iter().map(|g| ("external_id.guard", g)))
                {
                    source.check_from_key(field, int_key)?;
                }
                Ok(StringSource { at, guard })
            })
            .transpose()?;
        Ok(ProbeSpec {
            origin,
            line,
            object: self.object.filter(|object| !object.is_empty()),
            symbol: self.symbol,
            at: self.at,
            action,
            key,
            external_id,
            ret,
            only_on_change: self.only_on_change,
            quiet: self.quiet,
            ends: false,
            read_status: self.read_status,
            entry_status: None,
        })
    }
}

/// `on_return` / `values` rules, in order: each must hold for some value
/// of type `ret` and pick its event for one no earlier rule takes (the
/// first rule that holds wins). `line_at` gives a rule's line.
fn parse_rules(
    rules: Vec<Spanned<RawRule>>,
    ret: RetType,
    line_at: &impl Fn(std::ops::Range<usize>) -> usize,
) -> Result<Vec<(RetRule, Stage)>> {
    let mut left = Values::all(ret);
    let mut parsed = Vec::with_capacity(rules.len());
    for spanned in rules {
        let rule_line = line_at(spanned.span());
        let rule = spanned.into_inner();
        let (when, stage) = (parse_rule(&rule.when)?, parse_stage(&rule.event)?);
        let holds = Values::held_by(&when, ret);
        if holds.is_empty() {
            bail!(
                "`when = \"{}\"` (line {rule_line}) never holds: {}",
                rule.when.trim(),
                match ret {
                    RetType::I32 => "an \"i32\" value is between -2147483648 and 2147483647",
                    RetType::I64 => "no 64-bit value satisfies it",
                }
            );
        }
        if !holds.intersects(&left) {
            bail!(
                "`when = \"{}\"` (line {rule_line}) never picks its event: every value it holds for is taken \
                 by a rule before it (the first rule that holds wins); reorder or remove it",
                rule.when.trim()
            );
        }
        left = left.minus(&holds);
        parsed.push((when, stage));
    }
    Ok(parsed)
}

impl RawStatus {
    fn validate(
        self,
        origin: Arc<str>,
        line: usize,
        line_at: impl Fn(std::ops::Range<usize>) -> usize,
    ) -> Result<StatusSpec> {
        if self.at.from != "key" {
            bail!(
                "`at.from = \"{}\"`: a status is read long after any probe fired, when only the request key is \
                 known: write `at = {{ from = \"key\", deref = [...], add = OFFSET }}`",
                self.at.from
            );
        }
        let at = self.at.validate("at", At::Entry, true)?;
        if at.deref.is_empty() && at.add == 0 {
            bail!(
                "`at = {{ from = \"key\" }}` would read at the address the key holds: give the status field's \
                 offset in the request (`add = OFFSET`, behind pointers `deref = [OFFSET, ...]`)"
            );
        }
        if self.values.is_empty() || self.values.len() > MAX_STATUS_RULES {
            bail!("`values` takes 1 to {MAX_STATUS_RULES} rules, found {}", self.values.len());
        }
        let rules = parse_rules(self.values, self.value, &line_at)?;
        if let Some((_, stage)) = rules.iter().find(|(_, stage)| *stage == Stage::Released) {
            bail!(
                "`event = \"{stage}\"` in `values`: a released request's memory is no longer its own (freed, or \
                 another request's), so no status it holds can say released; map the values to enqueued, \
                 transfer_posted, transfer_done, aborted or failed"
            );
        }
        Ok(StatusSpec { origin, line, at, value: self.value, rules })
    }
}

impl RawSource {
    fn validate(self, field: &str, at: At, key_allowed: bool) -> Result<Source> {
        let from = match self.from.as_str() {
            "ret" if at == At::Return => From::Ret,
            "ret" => bail!("`{field}.from = \"ret\"` needs `at = \"return\"`"),
            "key" if key_allowed => From::Key,
            "key" => bail!("`{field}.from = \"key\"` is only for `external_id`: the key cannot come from itself"),
            other => match other.strip_prefix("arg").map(str::parse::<u8>) {
                Some(Ok(n)) if usize::from(n) < SAVED_ARGS => From::Arg(n),
                _ => bail!(
                    "`{field}.from = \"{other}\"`: expected \"arg0\" .. \"arg{}\", \"ret\"{}",
                    SAVED_ARGS - 1,
                    if key_allowed { " or \"key\"" } else { "" }
                ),
            },
        };
        if self.deref.len() > MAX_DEREF {
            bail!("`{field}.deref` has {} steps; at most {MAX_DEREF} are supported", self.deref.len());
        }
        Ok(Source { from, deref: self.deref, add: self.add })
    }
}

fn stage_names() -> String {
    Stage::ALL.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ")
}

fn parse_stage(name: &str) -> Result<Stage> {
    name.parse::<Stage>().map_err(|_| anyhow!("unknown lifecycle event \"{name}\": expected one of {}", stage_names()))
}

/// `"== 0"`, `"< 0"`, `">= -3"`, `"!= 1"`...
fn parse_rule(text: &str) -> Result<RetRule> {
    let text = text.trim();
    let (op, rest) =
        [("==", cmp::EQ), ("!=", cmp::NE), ("<=", cmp::LE), (">=", cmp::GE), ("<", cmp::LT), (">", cmp::GT)]
            .into_iter()
            .find_map(|(token, op)| text.strip_prefix(token).map(|rest| (op, rest)))
            .ok_or_else(|| anyhow!("`when = \"{text}\"`: expected a comparison such as \"== 0\", \"< 0\", \"!= 1\""))?;
    let value = rest
        .trim()
        .parse::<i64>()
        .map_err(|err| anyhow!("`when = \"{text}\"`: `{}` is not an integer ({err})", rest.trim()))?;
    Ok(RetRule { op, stage: 0, _pad: [0; 6], value })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_parses() {
        for name in builtin_names() {
            let profile = Profile::load(name).unwrap_or_else(|err| panic!("{name}: {err:#}"));
            assert!(!profile.probes.is_empty(), "{name}");
        }
    }

    #[test]
    fn the_nixl_profile_lowers_to_the_documented_slots() {
        let profile = Profile::load("nixl").unwrap();
        let create = &profile.probes[0];
        let cfg = create.slot_config();
        assert_eq!(cfg.flags & slot_flags::RETURN, slot_flags::RETURN);
        // The out-reference is r9: six arguments saved, handle read through it.
        assert_eq!(cfg.nargs, 6);
        assert_eq!((cfg.key.base, cfg.key.index, cfg.key.depth), (base::ARG, 5, 1));
        assert_eq!((cfg.ext.base, cfg.ext.depth, cfg.ext.offsets[0]), (base::KEY, 1, 144));
        assert_eq!((cfg.guard.base, cfg.guard.add), (base::KEY, 176));
        assert_eq!(
            cfg.flags & (slot_flags::HAS_EXT | slot_flags::HAS_GUARD | slot_flags::RET_I32),
            slot_flags::HAS_EXT | slot_flags::HAS_GUARD | slot_flags::RET_I32
        );
        // The post's return says done or failed when the post finished it;
        // the kernel picks the stage of the first rule that holds.
        let post = profile.probes.iter().find(|p| p.symbol.contains("postXferReq") && p.at == At::Return).unwrap();
        let rules = post.slot_config().rules;
        assert_eq!(
            (rules[0].op, rules[0].value, rules[0].stage),
            (cmp::EQ, 0, stallwatch_common::stage::TRANSFER_DONE)
        );
        assert_eq!((rules[1].op, rules[1].value, rules[1].stage), (cmp::LT, 0, stallwatch_common::stage::FAILED));
    }

    #[test]
    fn the_sglang_profile_is_the_nixl_profile_with_its_posts_sent_and_its_release_probed_at_return() {
        let nixl = Profile::load("nixl").unwrap();
        let sglang = Profile::load("sglang").unwrap();
        assert_eq!((sglang.name.as_str(), sglang.extends.as_deref()), ("sglang", Some("built-in profile `nixl`")));
        let of = |p: &Profile, name: &str| -> Vec<ProbeSpec> {
            p.probes.iter().filter(|p| p.symbol.contains(name)).cloned().collect()
        };
        let releases = |p: &Profile| of(p, "releaseXferReq");
        // Every other probe is nixl's own, from nixl's file.
        let others = |p: &Profile| -> Vec<ProbeSpec> {
            p.probes
                .iter()
                .filter(|p| !p.symbol.contains("releaseXferReq") && !p.symbol.contains("postXferReq"))
                .cloned()
                .collect()
        };
        assert_eq!(others(&sglang), others(&nixl));
        assert!(others(&sglang).iter().all(|p| &*p.origin == "built-in profile `nixl`"));
        // The posts are nixl's but sent (rooms follow them as they happen),
        // and done is complete: the post's return (done or failed) ends the
        // lifecycle, in the kernel too.
        let posts: Vec<ProbeSpec> = of(&nixl, "postXferReq")
            .into_iter()
            .map(|p| ProbeSpec { quiet: false, ends: p.at == At::Return, ..p })
            .collect();
        let without_place = |p: Vec<ProbeSpec>| -> Vec<ProbeSpec> {
            p.into_iter().map(|p| ProbeSpec { origin: "".into(), line: 0, ..p }).collect()
        };
        assert!(of(&nixl, "postXferReq").iter().all(|p| p.quiet), "nixl's posts are quiet");
        assert_eq!(without_place(of(&sglang, "postXferReq")), without_place(posts));
        assert_eq!((sglang.complete_at, nixl.complete_at), (CompleteAt::TransferDone, CompleteAt::Released));
        let ends = |p: &Profile| p.probes.iter().filter(|p| p.slot_config().flags & slot_flags::ENDS != 0).count();
        assert_eq!((ends(&sglang), ends(&nixl)), (1, 0));
        assert_eq!((sglang.activity.clone(), sglang.status.clone()), (nixl.activity.clone(), nixl.status.clone()));
        let [release] = &releases(&sglang)[..] else { panic!("one release probe: {:?}", releases(&sglang)) };
        assert_eq!((release.at, &*release.origin), (At::Return, "built-in profile `sglang`"));
        // Only NIXL_SUCCESS is a release; the handle is the argument saved at entry.
        let cfg = release.slot_config();
        assert_eq!(
            cfg.flags & (slot_flags::RETURN | slot_flags::NEEDS_ARGS | slot_flags::RET_I32),
            slot_flags::RETURN | slot_flags::NEEDS_ARGS | slot_flags::RET_I32
        );
        assert_eq!((cfg.key.base, cfg.key.index, cfg.nargs), (base::ARG, 1, 2));
        assert_eq!(
            (cfg.rules[0].op, cfg.rules[0].value, cfg.rules[0].stage),
            (cmp::EQ, 0, stallwatch_common::stage::RELEASED)
        );
        assert_eq!(cfg.rules[1].op, cmp::NONE, "a failed release (e.g. -7) emits nothing");
        assert_eq!(releases(&nixl)[0].at, At::Entry);
    }

    /// A directory of profile files for one test.
    fn profile_dir(files: &[(&str, &str)]) -> PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "stallwatch-profiles-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        dir
    }

    const ENTRY_F: &str =
        "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n\n";
    const RETURN_F: &str =
        "[[probe]]\nsymbol = \"f\"\nat = \"return\"\nkey = { from = \"arg0\" }\nevent = \"transfer_done\"\n\n";
    const ENTRY_G: &str =
        "[[probe]]\nsymbol = \"g\"\nat = \"entry\"\nevent = \"released\"\nkey = { from = \"arg0\" }\n\n";
    const ACTIVITY_P: &str = "[[activity]]\nsymbol = \"p\"\nkind = \"progress\"\n\n";

    #[test]
    fn a_profile_extending_another_replaces_the_functions_it_probes_and_adds_the_rest() {
        let base = format!(
            "name = \"base\"\n{ENTRY_F}{RETURN_F}{ENTRY_G}{ACTIVITY_P}[status]\nat = {{ from = \"key\", add = 8 }}\ntype = \"i32\"\nvalues = [{{ when = \"== 0\", event = \"transfer_done\" }}]\n"
        );
        let child = "extends = \"base.toml\"\nname = \"child\"\n\n[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"transfer_posted\"\nkey = { from = \"arg1\" }\n\n[[probe]]\nsymbol = \"h\"\nat = \"entry\"\nevent = \"aborted\"\nkey = { from = \"arg0\" }\n\n[[activity]]\nsymbol = \"p\"\nkind = \"post\"\n";
        let dir = profile_dir(&[("base.toml", &base), ("child.toml", child)]);
        let path = dir.join("child.toml");
        let profile = Profile::load(path.to_str().unwrap()).expect("child");
        let base_origin = dir.join("base.toml").display().to_string();
        assert_eq!((profile.name.as_str(), profile.extends.as_deref()), ("child", Some(base_origin.as_str())));
        // f's two probes gave way to the child's one; g stays, h is added.
        let probes: Vec<(&str, Stage, usize, bool)> = profile
            .probes
            .iter()
            .map(|p| {
                (
                    p.symbol.as_str(),
                    match p.action {
                        Action::Always(stage) => stage,
                        Action::OnReturn(_) => unreachable!(),
                    },
                    p.line,
                    *p.origin == *base_origin,
                )
            })
            .collect();
        assert_eq!(
            probes,
            [
                ("g", Stage::Released, 14, true),
                ("f", Stage::TransferPosted, 4, false),
                ("h", Stage::Aborted, 10, false)
            ]
        );
        assert_eq!(profile.activity.iter().map(|a| (a.kind, a.line)).collect::<Vec<_>>(), [(ActivityKind::Post, 16)]);
        assert_eq!(profile.status.as_ref().map(|s| (&*s.origin, s.line)), Some((base_origin.as_str(), 24)));
        // A profile of nothing but `extends` is its base.
        let same = profile_dir(&[("base.toml", &base), ("same.toml", "extends = \"base.toml\"\n")]);
        let copy = Profile::load(same.join("same.toml").to_str().unwrap()).expect("same");
        assert_eq!(copy.probes.len(), 3);
        // Built-ins are found by name from any file.
        let on_nixl = profile_dir(&[("mine.toml", &format!("extends = \"nixl\"\n{ENTRY_F}"))]);
        let mine = Profile::load(on_nixl.join("mine.toml").to_str().unwrap()).expect("mine");
        assert_eq!(mine.probes.len(), Profile::load("nixl").unwrap().probes.len() + 1);
        for dir in [dir, same, on_nixl] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }

    #[test]
    fn complete_at_ends_lifecycles_at_transfer_done_per_probe_and_is_inherited() {
        let profile = |top: &str, body: &str| {
            format!(
                "{top}{ENTRY_F}[[probe]]\nsymbol = \"g\"\nat = \"return\"\nret = \"i32\"\nkey = {{ from = \"arg0\" }}\non_return = [\n{body}]\n"
            )
        };
        let done_or_failed =
            "  { when = \"== 0\", event = \"transfer_done\" },\n  { when = \"< 0\", event = \"failed\" },\n";
        let lazy =
            Profile::parse(&profile("complete_at = \"transfer_done\"\n", done_or_failed), "p.toml").expect("valid");
        let flags: Vec<bool> = lazy.probes.iter().map(|p| p.slot_config().flags & slot_flags::ENDS != 0).collect();
        assert_eq!((lazy.complete_at, flags), (CompleteAt::TransferDone, vec![false, true]));
        let eager = Profile::parse(&profile("complete_at = \"released\"\n", done_or_failed), "p.toml").expect("valid");
        assert!(eager.probes.iter().all(|p| p.slot_config().flags & slot_flags::ENDS == 0));
        assert_eq!(Profile::parse(&profile("", done_or_failed), "p.toml").unwrap().complete_at, CompleteAt::Released);
        // Rules that pick done and another live stage cannot end per probe.
        let mixed =
            "  { when = \"== 0\", event = \"transfer_done\" },\n  { when = \"== 1\", event = \"transfer_posted\" },\n";
        let err = error_of(&profile("complete_at = \"transfer_done\"\n", mixed));
        assert!(
            err.contains("line 8 ([[probe]] for `g`): its rules pick both transfer_done")
                && err.contains("split the rules"),
            "{err}"
        );
        Profile::parse(&profile("", mixed), "p.toml").expect("fine where done is not complete");
        let err = error_of(&profile("\ncomplete_at = \"done\"\n", done_or_failed));
        assert!(err.contains("p.toml, line 2: `complete_at = \"done\"`: expected \"released\""), "{err}");
        // Inherited, and overridden.
        let dir = profile_dir(&[
            ("lazy.toml", &profile("complete_at = \"transfer_done\"\n", done_or_failed)),
            ("child.toml", "extends = \"lazy.toml\"\n"),
            ("eager.toml", "extends = \"lazy.toml\"\ncomplete_at = \"released\"\n"),
        ]);
        let load = |name: &str| Profile::load(dir.join(name).to_str().unwrap()).unwrap();
        let (child, eager) = (load("child.toml"), load("eager.toml"));
        assert_eq!((child.complete_at, child.probes.iter().filter(|p| p.ends).count()), (CompleteAt::TransferDone, 1));
        assert_eq!((eager.complete_at, eager.probes.iter().filter(|p| p.ends).count()), (CompleteAt::Released, 0));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn bad_extends_name_the_file_the_line_and_the_fix() {
        let dir = profile_dir(&[
            ("missing.toml", &format!("name = \"m\"\n\nextends = \"nowhere.toml\"\n{ENTRY_F}")),
            ("a.toml", &format!("extends = \"b.toml\"\n{ENTRY_F}")),
            ("b.toml", &format!("extends = \"a.toml\"\n{ENTRY_G}")),
            ("broken.toml", "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"arg0\" }\n"),
            ("on-broken.toml", &format!("extends = \"broken.toml\"\n{ENTRY_G}")),
            ("twice.toml", &format!("extends = \"nixl\"\n{ENTRY_F}{ENTRY_F}")),
        ]);
        let err = |name: &str| format!("{:#}", Profile::load(dir.join(name).to_str().unwrap()).unwrap_err());
        let missing = err("missing.toml");
        assert!(
            missing.contains("missing.toml, line 3 (`extends = \"nowhere.toml\"`)")
                && missing.contains("no built-in profile named `nowhere.toml`")
                && missing.contains("built-ins are demo, nixl"),
            "{missing}"
        );
        let looped = err("a.toml");
        assert!(
            looped.contains("extend one another in a loop")
                && looped.contains("a.toml -> ")
                && looped.contains("b.toml -> "),
            "{looped}"
        );
        // An error in the base names the base's own line, under the line that extends it.
        let broken = err("on-broken.toml");
        assert!(
            broken.contains("on-broken.toml, line 1 (`extends = \"broken.toml\"`)")
                && broken.contains("broken.toml, line 1 ([[probe]] for `f`): no lifecycle event"),
            "{broken}"
        );
        // Probes of one file still may not both emit for one call.
        let twice = err("twice.toml");
        assert!(twice.contains("twice.toml, line 8 ([[probe]] for `f`): the [[probe]] on line 2"), "{twice}");
        let err = error_of("extends = 3\n");
        assert!(err.contains("extends"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_nixl_profile_reads_the_status_instead_of_probing_its_poll() {
        let profile = Profile::load("nixl").unwrap();
        assert!(profile.probes.iter().all(|p| !p.symbol.contains("getXferStatus")), "the hot poll is not probed");
        // No probe suppresses repeats: the polled function is not probed.
        assert!(profile.probes.iter().all(|p| !p.only_on_change));
        let status = profile.status.as_ref().expect("[status]");
        assert_eq!(
            (status.at.from, &status.at.deref[..], status.at.add, status.value),
            (From::Key, &[][..], 184, RetType::I32)
        );
        // NIXL's status codes, as 1.5.1 keeps them in the handle.
        for (value, stage) in [
            (1, Some(Stage::TransferPosted)),
            (0, Some(Stage::TransferDone)),
            (-1, Some(Stage::Enqueued)),
            (-10, Some(Stage::Failed)),
            (-3, Some(Stage::Failed)),
            (2, None),
        ] {
            assert_eq!(status.stage_of(value), stage, "status {value}");
        }
    }

    /// The release reads the handle's status at its entry: an error there
    /// is the failure, anything else (or nothing readable) the release.
    #[test]
    fn the_nixl_release_reads_the_status_at_its_entry_and_an_error_is_failed() {
        let profile = Profile::load("nixl").unwrap();
        let release = profile.probes.iter().find(|p| p.symbol.contains("releaseXferReq")).unwrap();
        let cfg = release.slot_config();
        assert_eq!(
            cfg.flags & (slot_flags::ENTRY_VALUE | slot_flags::RET_I32 | slot_flags::RETURN),
            slot_flags::ENTRY_VALUE | slot_flags::RET_I32
        );
        assert_eq!(cfg.stage, stallwatch_common::stage::RELEASED);
        // One read: the i32 at handle + 184.
        assert_eq!((cfg.value.base, cfg.value.depth, cfg.value.offsets[0], cfg.value.add), (base::KEY, 1, 184, 0));
        assert_eq!(
            (cfg.rules[0].op, cfg.rules[0].value, cfg.rules[0].stage),
            (cmp::LT, -1, stallwatch_common::stage::FAILED)
        );
        assert_eq!(cfg.rules[1].op, cmp::NONE, "only the terminal rule");
        // No other nixl probe reads it.
        assert_eq!(profile.probes.iter().filter(|p| p.slot_config().flags & slot_flags::ENTRY_VALUE != 0).count(), 1);
        // Behind a pointer: the chain, then the value's own offset.
        let text = "[[probe]]\nsymbol = \"rel\"\nat = \"entry\"\nevent = \"released\"\nkey = { from = \"arg0\" }\nread_status = true\n\n\
                    [status]\nat = { from = \"key\", deref = [8], add = 4 }\ntype = \"i64\"\nvalues = [\n  { when = \"== 1\", event = \"transfer_posted\" },\n  \
                    { when = \"< 0\", event = \"failed\" },\n  { when = \"== 9\", event = \"aborted\" },\n]\n";
        let cfg = Profile::parse(text, "p.toml").unwrap().probes[0].slot_config();
        assert_eq!((cfg.value.depth, &cfg.value.offsets[..2], cfg.flags & slot_flags::RET_I32), (2, &[8, 4][..], 0));
        assert_eq!(
            (cfg.rules[0].stage, cfg.rules[1].stage),
            (stallwatch_common::stage::FAILED, stallwatch_common::stage::ABORTED)
        );
    }

    /// nixl names the build its offsets were checked against; a profile
    /// extending it inherits that, or gives its own; without the offsets,
    /// a probe on the library reads neither its external id nor its status.
    #[test]
    fn a_layout_names_the_builds_and_without_it_nothing_is_read_at_its_offsets() {
        let nixl = Profile::load("nixl").unwrap();
        let layout = nixl.layout.as_ref().expect("[layout]");
        assert_eq!(layout.object, "libnixl.so");
        assert!(layout.knows("C60AC851FDD67A4D9738B5B2F53BD4849505F241") && !layout.knows("00"));
        assert_eq!(Profile::load("sglang").unwrap().layout.as_ref(), Some(layout), "inherited");
        let off = nixl.without_offsets();
        assert!(off.probes.iter().all(|p| p.external_id.is_none() && p.entry_status.is_none()));
        assert!(
            off.probes.iter().all(|p| p.slot_config().flags & (slot_flags::HAS_EXT | slot_flags::ENTRY_VALUE) == 0)
        );
        assert_eq!(off.probes.len(), nixl.probes.len(), "every lifecycle point stays");
        // sglang's dlist signal reads NIXL's own class: gone; the others stay.
        let sglang = Profile::load("sglang").unwrap();
        let names = |p: &Profile| p.signals.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        assert!(names(&sglang).contains(&"nixl_dlist_remote_agent".to_owned()));
        let mut kept = names(&sglang);
        kept.retain(|name| name != "nixl_dlist_remote_agent");
        assert_eq!(names(&sglang.without_offsets()), kept);
        let text = |layout: &str| format!("extends = \"nixl\"\n[layout]\n{layout}");
        let own = Profile::parse(&text("object = \"libnixl.so\"\nbuild_ids = [\"AB01\"]\nchecked = \"x\"\n"), "p.toml")
            .unwrap();
        assert_eq!(own.layout.expect("own").build_ids, ["ab01"]);
        let err = error_of(&text("object = \"libnixl.so\"\nbuild_ids = [\"xyz\"]\nchecked = \"x\"\n"));
        assert!(err.contains("([layout]): build id \"xyz\" is not hex bytes") && err.contains("readelf -n"), "{err}");
        let err = error_of(&text("object = \"libnixl.so\"\nbuild_ids = []\nchecked = \"x\"\n"));
        assert!(err.contains("`build_ids` is empty"), "{err}");
    }

    #[test]
    fn read_status_the_kernel_cannot_follow_is_refused_with_the_fix() {
        let probe = |at: &str, extra: &str| {
            format!(
                "[[probe]]\nsymbol = \"rel\"\nat = \"{at}\"\n{extra}key = {{ from = \"arg0\" }}\nread_status = true\n\n"
            )
        };
        let status = |values: &str| {
            format!("[status]\nat = {{ from = \"key\", add = 8 }}\ntype = \"i32\"\nvalues = [\n{values}]\n")
        };
        let failed = "  { when = \"< 0\", event = \"failed\" },\n";
        let released = "event = \"released\"\n";
        let err = error_of(&probe("entry", released));
        assert!(err.contains("has none: add one"), "{err}");
        let err = error_of(&format!(
            "{}{}",
            probe("return", "on_return = [{ when = \"== 0\", event = \"released\" }]\n"),
            status(failed)
        ));
        assert!(err.contains("needs `at = \"entry\"`"), "{err}");
        let err = error_of(&format!(
            "{}{}",
            probe("entry", released),
            status("  { when = \"== 0\", event = \"transfer_done\" },\n")
        ));
        assert!(err.contains("has 0 rules for a terminal event"), "{err}");
        let overlap = "  { when = \"== -1\", event = \"enqueued\" },\n  { when = \"< 0\", event = \"failed\" },\n";
        let err = error_of(&format!("{}{}", probe("entry", released), status(overlap)));
        assert!(err.contains("takes values an earlier rule takes first"), "{err}");
        Profile::parse(&format!("{}{}", probe("entry", released), status(failed)), "p.toml").expect("valid");
    }

    #[test]
    fn invalid_status_tables_name_their_line_and_the_fix() {
        let probe = "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n\n";
        let status = |at: &str, ty: &str, values: &str| {
            format!("{probe}[status]\nat = {at}\ntype = \"{ty}\"\nvalues = [\n{values}]\n")
        };
        let done = "  { when = \"== 0\", event = \"transfer_done\" },\n";
        Profile::parse(&status("{ from = \"key\", add = 184 }", "i32", done), "p.toml").expect("valid");
        Profile::parse(&status("{ from = \"key\", deref = [8], add = 4 }", "i64", done), "p.toml").expect("valid");
        let err = error_of(&status("{ from = \"arg1\", add = 184 }", "i32", done));
        assert!(err.contains("line 7 ([status]): `at.from = \"arg1\"`") && err.contains("from = \"key\""), "{err}");
        let err = error_of(&status("{ from = \"key\" }", "i32", done));
        assert!(err.contains("line 7 ([status])") && err.contains("the status field's offset"), "{err}");
        let err = error_of(&status("{ from = \"key\", add = 8 }", "u7", done));
        assert!(err.contains("u7"), "{err}");
        let err = error_of(&status("{ from = \"key\", add = 8 }", "i32", ""));
        assert!(err.contains("line 7 ([status]): `values` takes 1 to 16 rules, found 0"), "{err}");
        let err = error_of(&status(
            "{ from = \"key\", add = 8 }",
            "i32",
            "  { when = \"== 5000000000\", event = \"failed\" },\n",
        ));
        assert!(err.contains("line 7 ([status]): `when = \"== 5000000000\"` (line 11) never holds"), "{err}");
        let err = error_of(&status(
            "{ from = \"key\", add = 8 }",
            "i32",
            "  { when = \"< 0\", event = \"failed\" },\n  { when = \"== -1\", event = \"enqueued\" },\n",
        ));
        assert!(err.contains("`when = \"== -1\"` (line 12) never picks its event"), "{err}");
        let err =
            error_of(&status("{ from = \"key\", add = 8 }", "i32", "  { when = \"== 2\", event = \"released\" },\n"));
        assert!(
            err.contains("line 7 ([status]): `event = \"released\"`") && err.contains("no longer its own"),
            "{err}"
        );
        let err =
            error_of(&status("{ from = \"key\", add = 8 }", "i32", "  { when = \"== 2\", event = \"finished\" },\n"));
        assert!(err.contains("unknown lifecycle event \"finished\""), "{err}");
        let err = error_of(&format!("{}colour = 1\n", status("{ from = \"key\", add = 8 }", "i32", done)));
        assert!(err.contains("colour"), "{err}");
    }

    #[test]
    fn entry_probes_emit_every_hit_and_save_nothing() {
        let profile = Profile::parse(
            "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"released\"\nkey = { from = \"arg2\", deref = [8, 16], add = 4 }\n",
            "test",
        )
        .unwrap();
        let cfg = profile.probes[0].slot_config();
        assert_eq!(cfg.flags, slot_flags::CONFIGURED);
        assert_eq!(cfg.key.offsets[..2], [8, 16]);
        assert_eq!(cfg.key.add, 4);
        assert_eq!(cfg.stage, stallwatch_common::stage::RELEASED);
    }

    const ONE_PROBE: &str =
        "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"released\"\nkey = { from = \"arg0\" }\n";

    #[test]
    fn signals_lower_to_untracked_slots_reading_their_value_and_capture() {
        let text = format!(
            "{ONE_PROBE}\n[[signal]]\nname = \"frame\"\nobject = \"libzmq.so\"\nsymbol = \"zmq_msg_data\"\nat = \"return\"\n\
             value = {{ from = \"arg0\" }}\nbytes = {{ from = \"ret\" }}\n\n\
             [[signal]]\nname = \"peer\"\nsymbol = \"g\"\nat = \"entry\"\nvalue = {{ from = \"arg5\" }}\ntext = {{ from = \"arg3\", deref = [0] }}\n"
        );
        let profile = Profile::parse(&text, "test").unwrap();
        let [frame, peer] = profile.signals.as_slice() else { panic!("{:?}", profile.signals) };
        assert_eq!((frame.name.as_str(), frame.line, frame.object.as_deref()), ("frame", 7, Some("libzmq.so")));
        let cfg = frame.slot_config();
        assert_eq!(cfg.stage, stage::SIGNAL);
        let want = slot_flags::RETURN
            | slot_flags::NEEDS_ARGS
            | slot_flags::HAS_EXT
            | slot_flags::EXT_BYTES
            | slot_flags::CONFIGURED;
        assert_eq!((cfg.flags, cfg.nargs), (want, 1));
        assert_eq!((cfg.key.base, cfg.ext.base), (base::ARG, base::RET));
        let cfg = peer.slot_config();
        assert_eq!(cfg.flags, slot_flags::HAS_EXT | slot_flags::CONFIGURED);
        assert_eq!((cfg.key.index, cfg.ext.index, cfg.ext.depth), (5, 3, 1));
    }

    #[test]
    fn invalid_signals_name_their_line_and_the_fix() {
        let signal = |body: &str| format!("{ONE_PROBE}[[signal]]\nname = \"s\"\nsymbol = \"g\"\n{body}");
        let err = error_of(&signal("at = \"entry\"\nvalue = { from = \"ret\" }\n"));
        assert!(err.contains("line 6 ([[signal]] `s`): `value.from = \"ret\"` needs `at = \"return\"`"), "{err}");
        let err = error_of(&signal(
            "at = \"return\"\nvalue = { from = \"ret\" }\ntext = { from = \"ret\" }\nbytes = { from = \"ret\" }\n",
        ));
        assert!(err.contains("either `text`") && err.contains("line 6"), "{err}");
        let err = error_of(&signal("at = \"entry\"\nret = \"i32\"\nvalue = { from = \"arg0\" }\n"));
        assert!(err.contains("`ret` describes a return value"), "{err}");
        let err = error_of(&signal("at = \"entry\"\n"));
        assert!(err.contains("value"), "{err}");
        let err = error_of(&format!(
            "{ONE_PROBE}[[signal]]\nname = \" \"\nsymbol = \"g\"\nat = \"entry\"\nvalue = {{ from = \"arg0\" }}\n"
        ));
        assert!(err.contains("`name` is empty"), "{err}");
        let twice = signal("at = \"entry\"\nvalue = { from = \"arg0\" }\n");
        let err = error_of(&format!("{twice}{}", twice.trim_start_matches(ONE_PROBE)));
        assert!(err.contains("line 11 ([[signal]] `s`): the [[signal]] on line 6 has the same name"), "{err}");
    }

    #[test]
    fn a_msgpack_capture_needs_bytes_a_short_tag_and_a_reachable_element() {
        let signal = |extra: &str| {
            format!(
                "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"released\"\nkey = {{ from = \"arg0\" }}\n\
                 [[signal]]\nname = \"room\"\nobject = \"libzmq.so\"\nsymbol = \"zmq_msg_data\"\nat = \"return\"\n\
                 value = {{ from = \"arg0\" }}\n{extra}\n"
            )
        };
        let profile = Profile::parse(
            &signal("bytes = { from = \"ret\" }\nmsgpack = { element = 27, tag = \"TokenizedGenerateReqInput\" }"),
            "p.toml",
        )
        .expect("valid");
        let cfg = profile.signals[0].slot_config();
        assert_ne!(cfg.flags & slot_flags::EXT_MSGPACK, 0);
        assert_eq!((cfg.msgpack.element, cfg.msgpack.tag_len), (27, 25));
        assert_eq!(&cfg.msgpack.tag[..25], b"TokenizedGenerateReqInput");
        let error_of = |text: &str| Profile::parse(text, "p.toml").unwrap_err().to_string();
        let err = error_of(&signal("text = { from = \"ret\" }\nmsgpack = { element = 1 }"));
        assert!(err.contains("line 6 ([[signal]] `room`)") && err.contains("give `bytes` too"), "{err}");
        let err = error_of(&signal(&format!(
            "bytes = {{ from = \"ret\" }}\nmsgpack = {{ element = 1, tag = \"{}\" }}",
            "t".repeat(33)
        )));
        assert!(err.contains("`msgpack.tag` is 33 bytes; at most 32"), "{err}");
        let err = error_of(&signal("bytes = { from = \"ret\" }\nmsgpack = { element = 512 }"));
        assert!(err.contains("`msgpack.element = 512` is past what the kernel walks"), "{err}");
    }

    #[test]
    fn rules_parse_and_bad_ones_say_why() {
        assert_eq!(parse_rule(">= -3").unwrap(), RetRule { op: cmp::GE, stage: 0, _pad: [0; 6], value: -3 });
        assert_eq!(parse_rule("!=1").unwrap().op, cmp::NE);
        assert!(parse_rule("~ 1").unwrap_err().to_string().contains("expected a comparison"));
        assert!(parse_rule("== x").unwrap_err().to_string().contains("not an integer"));
    }

    fn error_of(text: &str) -> String {
        format!("{:#}", Profile::parse(text, "p.toml").unwrap_err())
    }

    #[test]
    fn invalid_probes_name_the_line_and_the_fix() {
        let err =
            error_of("[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"ret\" }\nevent = \"enqueued\"\n");
        assert!(err.contains("line 1") && err.contains("needs `at = \"return\"`"), "{err}");
        let err = error_of(
            "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"arg0\" }\non_return = [{ when = \"== 0\", event = \"released\" }]\n",
        );
        assert!(err.contains("`on_return` needs `at = \"return\"`"), "{err}");
        let err =
            error_of("[[probe]]\nsymbol = \"f\"\nat = \"return\"\nkey = { from = \"arg10\" }\nevent = \"released\"\n");
        assert!(err.contains("expected \"arg0\" .. \"arg9\""), "{err}");
        let err = error_of(
            "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"arg0\", deref = [1, 2, 3, 4, 5] }\nevent = \"released\"\n",
        );
        assert!(err.contains("at most 4"), "{err}");
        let err = error_of("[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"arg0\" }\n");
        assert!(err.contains("no lifecycle event"), "{err}");
        let err = error_of("name = \"x\"\n");
        assert!(err.contains("no [[probe]] tables"), "{err}");
        let err = error_of(
            "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"arg0\" }\nevent = \"released\"\ncolour = 1\n",
        );
        assert!(err.contains("colour"), "{err}");
    }

    #[test]
    fn rules_that_can_never_pick_their_event_are_refused_with_their_line() {
        let probe = |ret: &str, rules: &str| {
            format!(
                "[[probe]]\nsymbol = \"f\"\nat = \"return\"\nret = \"{ret}\"\nkey = {{ from = \"arg0\" }}\non_return = [\n{rules}]\n"
            )
        };
        let err = error_of(&probe("i32", "  { when = \"== 99999999999999\", event = \"transfer_done\" },\n"));
        assert!(
            err.contains("line 1 ([[probe]] for `f`)")
                && err.contains("`when = \"== 99999999999999\"` (line 7) never holds"),
            "{err}"
        );
        assert!(err.contains("between -2147483648 and 2147483647"), "{err}");
        // The same value is a fine 64-bit return.
        Profile::parse(&probe("i64", "  { when = \"== 99999999999999\", event = \"transfer_done\" },\n"), "p.toml")
            .expect("valid");
        let err = error_of(&probe(
            "i32",
            "  { when = \"< 0\", event = \"failed\" },\n  { when = \"== -3\", event = \"aborted\" },\n",
        ));
        assert!(err.contains("`when = \"== -3\"` (line 8) never picks its event"), "{err}");
        let err = error_of(&probe(
            "i64",
            "  { when = \"!= 7\", event = \"failed\" },\n  { when = \"== 3\", event = \"transfer_done\" },\n",
        ));
        assert!(err.contains("`when = \"== 3\"` (line 8) never picks its event"), "{err}");
        Profile::parse(
            &probe(
                "i32",
                "  { when = \"== 0\", event = \"transfer_done\" },\n  { when = \"< 0\", event = \"failed\" },\n",
            ),
            "p.toml",
        )
        .expect("valid");
    }

    #[test]
    fn two_probes_emitting_for_one_call_are_refused_naming_both_lines() {
        let entry = |symbol: &str, event: &str, key: &str| {
            format!(
                "[[probe]]\nsymbol = \"{symbol}\"\nat = \"entry\"\nevent = \"{event}\"\nkey = {{ from = \"{key}\" }}\n\n"
            )
        };
        let err = error_of(
            &(entry("f", "enqueued", "arg0") + &entry("g", "released", "arg0") + &entry("f", "released", "arg0")),
        );
        assert!(
            err.contains("line 13 ([[probe]] for `f`): the [[probe]] on line 1 probes the same function's entry"),
            "{err}"
        );
        // Another key, or another end of the function, is another lifecycle point.
        Profile::parse(&(entry("f", "enqueued", "arg0") + &entry("f", "released", "arg1")), "p.toml").expect("valid");
        let ret = |rules: &str, ret: &str| {
            format!(
                "[[probe]]\nsymbol = \"f\"\nat = \"return\"\nret = \"{ret}\"\nkey = {{ from = \"arg0\" }}\non_return = [{rules}]\n\n"
            )
        };
        let split =
            ret("{ when = \"== 0\", event = \"transfer_done\" }, { when = \"== 1\", event = \"aborted\" }", "i32")
                + &ret("{ when = \"< 0\", event = \"failed\" }", "i32");
        Profile::parse(&(entry("f", "enqueued", "arg0") + &split), "p.toml").expect("rules split over two probes");
        let overlap = ret("{ when = \"<= 0\", event = \"transfer_done\" }", "i32")
            + &ret("{ when = \"< 0\", event = \"failed\" }", "i32");
        assert!(error_of(&overlap).contains("both would emit for one call"));
        let types = ret("{ when = \"== 0\", event = \"transfer_done\" }", "i32")
            + &ret("{ when = \"< 0\", event = \"failed\" }", "i64");
        assert!(error_of(&types).contains("one function returns one type"), "{}", error_of(&types));
        let activity =
            "[[activity]]\nsymbol = \"p\"\nkind = \"progress\"\n\n[[activity]]\nsymbol = \"p\"\nkind = \"post\"\n";
        let err = error_of(&(entry("f", "enqueued", "arg0") + activity));
        assert!(
            err.contains("line 11 ([[activity]] for `p`): the [[activity]] on line 7 counts the same function"),
            "{err}"
        );
    }

    #[test]
    fn an_external_id_at_the_key_itself_is_refused() {
        let with_ext = |key: &str, ret: &str, ext: &str| {
            format!(
                "[[probe]]\nsymbol = \"f\"\nat = \"return\"\nret = \"{ret}\"\nkey = {key}\nevent = \"enqueued\"\nexternal_id = {ext}\n"
            )
        };
        let err = error_of(&with_ext("{ from = \"arg0\", deref = [0] }", "i64", "{ from = \"key\" }"));
        assert!(
            err.contains(
                "line 1 ([[probe]] for `f`): `external_id = { from = \"key\" }` would read at the address the key holds"
            ),
            "{err}"
        );
        let err = error_of(&with_ext("{ from = \"arg0\" }", "i64", "{ from = \"arg1\", guard = { from = \"key\" } }"));
        assert!(err.contains("`external_id.guard = { from = \"key\" }`"), "{err}");
        let err = error_of(&with_ext("{ from = \"ret\" }", "i32", "{ from = \"key\", deref = [8] }"));
        assert!(err.contains("the key is a 32-bit return value"), "{err}");
        // Through the key, as the nixl profile reads its notification message.
        Profile::parse(
            &with_ext(
                "{ from = \"arg0\", deref = [0] }",
                "i64",
                "{ from = \"key\", deref = [144], guard = { from = \"key\", add = 176 } }",
            ),
            "p.toml",
        )
        .expect("valid");
    }

    #[test]
    fn return_probes_save_as_many_arguments_as_they_read() {
        let profile = Profile::parse(
            "[[probe]]\nsymbol = \"f\"\nat = \"return\"\nkey = { from = \"arg1\" }\nexternal_id = { from = \"arg3\" }\nevent = \"released\"\n\n[[probe]]\nsymbol = \"g\"\nat = \"return\"\nkey = { from = \"ret\" }\nevent = \"enqueued\"\n",
            "test",
        )
        .unwrap();
        let with_args = profile.probes[0].slot_config();
        assert_eq!((with_args.flags & slot_flags::NEEDS_ARGS, with_args.nargs), (slot_flags::NEEDS_ARGS, 4));
        let from_ret = profile.probes[1].slot_config();
        assert_eq!((from_ret.flags & slot_flags::NEEDS_ARGS, from_ret.nargs), (0, 0));
    }
}
