//! Reading a profile: a built-in or a TOML file, its `extends` chain, and
//! every check the kernel side cannot make, each error naming the file, the
//! line and what to write instead.
use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{Context as _, Result, anyhow, bail};
use serde::Deserialize;
use stallwatch_common::{
    CHUNK_LEN, MAX_DEREF, MAX_RET_RULES, MAX_SLOTS, MSGPACK_STEPS, MSGPACK_TAG_LEN, PICKLE_KEYS, PICKLE_NAME_LEN,
    PICKLE_TAGS, RetRule, SAVED_ARGS, STRINGS_STEPS, cmp,
};
use toml::Spanned;

use super::{
    builtin_names, builtin_text,
    returns::{RetType, Values},
    schema::*,
};
use crate::lifecycle::Stage;

/// Deepest chain of `extends` a profile may have (a longer one is a loop
/// or a mistake).
const MAX_EXTENDS: usize = 8;

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
        let text = crate::util::files::read_text(&path, "profile file")?;
        let dir = path.parent().map(Path::to_path_buf);
        Self::parse_in(&text, &path.display().to_string(), dir.as_deref(), chain)
    }

    /// The profile `spec` that the one being read (`origin`, in `dir`)
    /// names at `at` (its `extends`, a `[[signals_from]]`), loaded with
    /// `origin` on `chain`.
    fn load_named(spec: &str, at: &str, origin: &str, dir: Option<&Path>, chain: &mut Vec<String>) -> Result<Self> {
        chain.push(origin.to_owned());
        if chain.len() > MAX_EXTENDS {
            bail!(
                "{at}: more than {MAX_EXTENDS} profiles extend or take signals from one another ({}): shorten the \
                 chain",
                chain.join(" -> ")
            );
        }
        let named = Self::load_in(spec, dir, chain).with_context(|| at.to_owned())?;
        chain.pop();
        Ok(named)
    }

    fn parse_in(text: &str, origin: &str, dir: Option<&Path>, chain: &mut Vec<String>) -> Result<Self> {
        if chain.iter().any(|earlier| earlier == origin) {
            bail!(
                "profiles extend one another (or take signals from one another) in a loop: {} -> {origin}",
                chain.join(" -> ")
            );
        }
        let raw: RawProfile = toml::from_str(text).map_err(|err| anyhow!("profile {origin}: {err}"))?;
        // Before anything is checked table by table: what this file adds
        // alone may be more than the kernel side can hold.
        check_slots(origin, raw.probe.len(), raw.activity.len(), raw.signal.len())?;
        let lines = Lines::of(text);
        let here: Arc<str> = origin.into();
        let base = match raw.extends {
            Some(spanned) => {
                let line = lines.at(spanned.span().start);
                let spec = spanned.into_inner();
                let at = format!("profile {origin}, line {line} (`extends = \"{spec}\"`)");
                Some(Self::load_named(&spec, &at, origin, dir, chain)?)
            }
            None => None,
        };
        let own_probes = raw
            .probe
            .into_iter()
            .map(|spanned| {
                let line = lines.at(spanned.span().start);
                let raw = spanned.into_inner();
                let symbol = raw.symbol.clone();
                raw.validate(here.clone(), line, |span| lines.at(span.start))
                    .map_err(|err| anyhow!("profile {origin}, line {line} ([[probe]] for `{symbol}`): {err}"))
            })
            .collect::<Result<Vec<_>>>()?;
        let own_activity = raw
            .activity
            .into_iter()
            .map(|spanned| {
                let line = lines.at(spanned.span().start);
                let raw = spanned.into_inner();
                if raw.symbol.trim().is_empty() {
                    bail!("profile {origin}, line {line} ([[activity]]): `symbol` is empty");
                }
                check_object(raw.object.as_deref())
                    .map_err(|err| anyhow!("profile {origin}, line {line} ([[activity]]): {err}"))?;
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
                let line = lines.at(spanned.span().start);
                spanned
                    .into_inner()
                    .validate(here.clone(), line, |span| lines.at(span.start))
                    .map_err(|err| anyhow!("profile {origin}, line {line} ([status]): {err}"))
            })
            .transpose()?;
        let own_signals = raw
            .signal
            .into_iter()
            .map(|spanned| {
                let line = lines.at(spanned.span().start);
                let raw = spanned.into_inner();
                let name = raw.name.clone();
                raw.validate(here.clone(), line)
                    .map_err(|err| anyhow!("profile {origin}, line {line} ([[signal]] `{name}`): {err}"))
            })
            .collect::<Result<Vec<SignalSpec>>>()?;
        // Signals of other profiles, each with the line of the table that
        // takes it (for a name it collides on).
        let mut taken: Vec<(usize, SignalSpec)> = Vec::new();
        for spanned in raw.signals_from {
            let line = lines.at(spanned.span().start);
            for signal in spanned.into_inner().take(&lines, origin, line, dir, chain)? {
                taken.push((line, signal));
            }
        }
        // What this file probes replaces what the base probes on the same
        // function (both ends): a profile changes a probe by giving the
        // function's probes anew, and adds one on a function of its own. A
        // signal replaces the base's of the same name.
        let own_complete_at = raw
            .complete_at
            .map(|spanned| {
                let line = lines.at(spanned.span().start);
                CompleteAt::parse(spanned.get_ref())
                    .map(|at| (at, line))
                    .map_err(|err| anyhow!("profile {origin}, line {line}: {err}"))
            })
            .transpose()?;
        let own_layout = raw
            .layout
            .map(|spanned| {
                let line = lines.at(spanned.span().start);
                let raw = spanned.into_inner();
                let bad = |why: String| anyhow!("profile {origin}, line {line} ([layout]): {why}");
                if raw.object.trim().is_empty() {
                    return Err(bad("`object` is empty: name the library whose layout the offsets are (e.g. \"libnixl.so\")".into()));
                }
                check_object(Some(&raw.object)).map_err(|err| bad(err.to_string()))?;
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
        let base_processes = base.as_ref().map(|base| base.processes.clone()).unwrap_or_default();
        let (mut probes, activity, mut signals, status, extends, complete_at, layout) = match base {
            Some(base) => {
                // Looked up in sets: a profile's tables may be many.
                let own: HashSet<_> = own_probes.iter().map(ProbeSpec::function).collect();
                let mut probes: Vec<ProbeSpec> =
                    base.probes.into_iter().filter(|probe| !own.contains(&probe.function())).collect();
                probes.extend(own_probes);
                let own: HashSet<_> = own_activity.iter().map(ActivitySpec::function).collect();
                let mut activity: Vec<ActivitySpec> =
                    base.activity.into_iter().filter(|spec| !own.contains(&spec.function())).collect();
                activity.extend(own_activity);
                let own: HashSet<&str> = own_signals.iter().map(|own| own.name.as_str()).collect();
                let mut signals: Vec<SignalSpec> =
                    base.signals.into_iter().filter(|spec| !own.contains(spec.name.as_str())).collect();
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
        // A signal taken from another profile is added, never in place of
        // one: its name is new to this profile, or an error.
        let mut named: HashMap<String, usize> =
            signals.iter().enumerate().map(|(i, signal)| (signal.name.clone(), i)).collect();
        for (line, spec) in taken {
            if let Some(earlier) = named.get(&spec.name).map(|&i| &signals[i]) {
                let (what, place) = if *earlier.origin == *origin {
                    ("the [[signal]]", format!("on line {}", earlier.line))
                } else {
                    ("the signal", format!("of profile {}, line {}", earlier.origin, earlier.line))
                };
                bail!(
                    "profile {origin}, line {line} ([[signals_from]]): it takes a signal named `{}`, the name of \
                     {what} {place}, and consumers tell signals apart by name: drop one, or take it under \
                     another `prefix`",
                    spec.name
                );
            }
            named.insert(spec.name.clone(), signals.len());
            signals.push(spec);
        }
        // Before the checks that compare tables with one another.
        check_slots(origin, probes.len(), activity.len(), signals.len())?;
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
        // Only probes of one function's same end can conflict: compared
        // within those, not each with every other.
        let mut ends: HashMap<(Option<&str>, &str, At), Vec<&ProbeSpec>> = HashMap::new();
        for probe in &probes {
            let earlier = ends.entry((probe.object.as_deref(), probe.symbol.as_str(), probe.at)).or_default();
            if let Some(err) = earlier.iter().find_map(|earlier| probe.conflict_with(earlier)) {
                bail!("profile {}, line {} ([[probe]] for `{}`): {err}", probe.origin, probe.line, probe.symbol);
            }
            earlier.push(probe);
        }
        let mut counted: HashMap<(Option<&str>, &str), &ActivitySpec> = HashMap::new();
        for spec in &activity {
            if let Some(earlier) = counted.insert(spec.function(), spec) {
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
        let mut named: HashMap<&str, &SignalSpec> = HashMap::new();
        for spec in &signals {
            if let Some(earlier) = named.insert(&spec.name, spec) {
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
        // A profile's own [[process]] tables replace its base's: they
        // describe one deployment.
        let mut processes = Vec::with_capacity(raw.process.len());
        for spanned in raw.process {
            let line = lines.at(spanned.span().start);
            let role = spanned
                .into_inner()
                .validate(here.clone(), line, &signals)
                .map_err(|err| anyhow!("profile {origin}, line {line} ([[process]]): {err}"))?;
            processes.push(role);
        }
        if processes.is_empty() {
            processes = base_processes;
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
            processes,
        })
    }

    /// This profile without what its `[layout]` offsets give, for a process
    /// that maps a build of the library the profile does not know: no
    /// external id read through the key of a probe on that library, no
    /// signal on it that reads its classes (`layout = true`), no
    /// `read_status` (the `[status]` reads are turned off per process by
    /// [`crate::evidence::status::StatusReader::turn_off`]). Lifecycle events, keys
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

/// Where a profile's lines start, to name the line of a table by the
/// byte offset toml gives: found once per file, each table's then looked
/// up, where counting the newlines before every table took time
/// quadratic in the file's size (seconds for a 4 MiB profile).
struct Lines {
    /// The offset of every newline, in order.
    newlines: Vec<usize>,
}

impl Lines {
    fn of(text: &str) -> Self {
        Self { newlines: text.bytes().enumerate().filter(|&(_, b)| b == b'\n').map(|(i, _)| i).collect() }
    }

    /// The line (from 1) of the byte at `offset`.
    fn at(&self, offset: usize) -> usize {
        self.newlines.partition_point(|&newline| newline < offset) + 1
    }
}

/// Refuse a profile whose probes take more slots than the kernel side
/// has: every `[[probe]]`, `[[activity]]` and `[[signal]]` is a slot of its own
/// in every process watched (a return probe's entry and return share
/// one), and an agent has [`MAX_SLOTS`] for all its processes. Said
/// here, when the profile is read, rather than by the attach that runs
/// out of them after linking a thousand uprobes.
fn check_slots(origin: &str, probes: usize, activity: usize, signals: usize) -> Result<()> {
    let needed = probes + activity + signals;
    if needed > MAX_SLOTS as usize {
        bail!(
            "profile {origin}: it needs {needed} probe slots per process ({probes} [[probe]], {activity} [[activity]] \
             and {signals} [[signal]] tables, one slot each) and an agent has {MAX_SLOTS} in all: probe fewer \
             functions (at most {MAX_SLOTS} tables, fewer for an agent that watches several processes: each takes \
             its own)"
        );
    }
    Ok(())
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
    /// Signals of another profile, taken by name, renamed with a prefix.
    #[serde(default)]
    signals_from: Vec<Spanned<RawSignalsFrom>>,
    #[serde(default)]
    process: Vec<Spanned<RawProcess>>,
}

/// A `[[process]]` table ([`ProcessRole`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProcess {
    title: String,
    is: String,
    /// Signal names, and `transfers` for the profile's probes.
    #[serde(default)]
    fires: Vec<String>,
}

impl RawProcess {
    /// Checked against the profile's signals, by name.
    fn validate(self, origin: Arc<str>, line: usize, signals: &[SignalSpec]) -> Result<ProcessRole> {
        let title = regex::Regex::new(&self.title)
            .map_err(|err| anyhow!("`title` {:?} is not a valid regular expression: {err}", self.title))?;
        if self.is.trim().is_empty() {
            bail!("`is` is empty: say what the process is (\"vLLM's engine core\")");
        }
        let mut transfers = false;
        let mut named = Vec::new();
        for name in self.fires {
            if name == "transfers" {
                transfers = true;
            } else if signals.iter().any(|signal| signal.name == name) {
                named.push(name);
            } else {
                let known: Vec<&str> = signals.iter().map(|signal| signal.name.as_str()).collect();
                bail!(
                    "`fires` names `{name}`, which is no signal of the profile: use `transfers` (its probes) or one \
                     of: {}",
                    known.join(", ")
                );
            }
        }
        Ok(ProcessRole { origin, line, title, is: self.is, signals: named, transfers })
    }
}

/// A `[[signals_from]]` table: the signals `names` of profile `profile`
/// (as it resolves, with what it inherits), each named `prefix` + its
/// name here, so two frameworks that read the same traffic (SGLang's ZMQ
/// on NIXL and on Mooncake) read it with one definition, each under the
/// names its consumers know.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSignalsFrom {
    profile: String,
    names: Vec<Spanned<String>>,
    #[serde(default)]
    prefix: String,
}

impl RawSignalsFrom {
    /// The signals taken, in the order of `names`, each as its profile
    /// wrote it (its origin and line, for errors and `profile check`) but
    /// for its name. `line` is the table's in the text of profile
    /// `origin`, whose `lines` those are.
    fn take(
        self,
        lines: &Lines,
        origin: &str,
        line: usize,
        dir: Option<&Path>,
        chain: &mut Vec<String>,
    ) -> Result<Vec<SignalSpec>> {
        let spec = &self.profile;
        let at = format!("profile {origin}, line {line} ([[signals_from]] `{spec}`)");
        if self.names.is_empty() {
            bail!("{at}: `names` is empty: list the signals to take (`stallwatch profile check {spec}` lists them)");
        }
        let from = Profile::load_named(spec, &at, origin, dir, chain)?;
        let signals: HashMap<&str, &SignalSpec> =
            from.signals.iter().map(|signal| (signal.name.as_str(), signal)).collect();
        let mut seen: HashSet<&str> = HashSet::with_capacity(self.names.len());
        let mut taken: Vec<SignalSpec> = Vec::with_capacity(self.names.len());
        for spanned in &self.names {
            let name = spanned.get_ref();
            let at = format!("profile {origin}, line {} ([[signals_from]] `{spec}`)", lines.at(spanned.span().start));
            if !seen.insert(name) {
                bail!("{at}: `names` has `{name}` twice: keep one");
            }
            let Some(&signal) = signals.get(name.as_str()) else {
                let known: Vec<&str> = from.signals.iter().map(|signal| signal.name.as_str()).collect();
                bail!(
                    "{at}: `{spec}` has no signal named `{name}`; its signals are {}",
                    if known.is_empty() { "none".to_owned() } else { known.join(", ") }
                );
            };
            if signal.layout {
                bail!(
                    "{at}: signal `{name}` reads the classes of a build that `{spec}`'s [layout] vouches for \
                     (`layout = true`), which this profile's [layout] does not: copy it into a [[signal]] here, \
                     with a [layout] for its library"
                );
            }
            taken.push(SignalSpec { name: format!("{}{name}", self.prefix), ..signal.clone() });
        }
        Ok(taken)
    }
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
    ret: Option<toml::Value>,
    value: RawSource,
    text: Option<RawSource>,
    bytes: Option<RawSource>,
    msgpack: Option<RawMsgpack>,
    strings: Option<RawStrings>,
    pickle: Option<RawPickle>,
    #[serde(default)]
    layout: bool,
    when: Option<RawFilter>,
    extra: Option<RawSource>,
    bytes_else: Option<RawBytesElse>,
    #[serde(default)]
    optional: bool,
    #[serde(default)]
    peer: bool,
}

/// A signal's `when = { from, deref, add, mask, is = "RULE" }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFilter {
    from: String,
    #[serde(default)]
    deref: Vec<i64>,
    #[serde(default)]
    add: i64,
    mask: Option<u64>,
    is: String,
}

/// A signal's `bytes_else = { at = {...}, unless_byte = {...}, is = N }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBytesElse {
    at: RawSource,
    unless_byte: RawSource,
    is: i64,
    /// `extra`, read only where the bytes are at `at` (their length
    /// behind the same pointer).
    extra: Option<RawSource>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStrings {
    from: String,
    #[serde(default)]
    deref: Vec<i64>,
    #[serde(default)]
    add: i64,
    first: Option<i64>,
    next: Option<i64>,
    begin: Option<i64>,
    end: Option<i64>,
    stride: Option<u32>,
    /// libstdc++'s `std::string`: its length after its data pointer.
    #[serde(default = "std_string_length")]
    length: i64,
    nodes: Option<u16>,
    items: Option<u16>,
    bytes: u32,
    /// Bytes, not text: read NULs and all.
    #[serde(default)]
    raw: bool,
}

fn std_string_length() -> i64 {
    8
}

impl RawStrings {
    fn validate(self, at: At) -> Result<Strings> {
        let source = RawSource { from: self.from, deref: self.deref, add: self.add }.validate("strings", at, true)?;
        let list = match (self.first, self.next, self.begin, self.end, self.stride) {
            (Some(first), Some(next), Some(begin), Some(end), Some(stride)) => {
                if stride == 0 || stride > 4096 {
                    bail!("`strings.stride = {stride}`: the bytes from one string to the next, 1 to 4096");
                }
                Some(StringList { first, next, begin, end, stride })
            }
            (None, None, None, None, None) => None,
            _ => bail!(
                "`strings` walks a list of nodes only with all of `first`, `next`, `begin`, `end` and `stride` (give \
                 them all, or none for one string at its address)"
            ),
        };
        let (nodes, items) = match (&list, self.nodes, self.items) {
            (Some(_), Some(nodes), Some(items)) if nodes > 0 && items > 0 => (nodes, items),
            (Some(_), _, _) => bail!(
                "`strings` over a list needs `nodes` and `items` (at least 1 each): the most nodes, and strings a \
                 node, read per hit"
            ),
            (None, None, None) => (1, 1),
            (None, _, _) => {
                bail!("`strings.nodes` and `strings.items` bound a list's walk: give `first` .. `stride` too")
            }
        };
        // A chunk's number is 8 bits in its record (`chunk::pack`).
        let most = 256 * CHUNK_LEN as u32;
        if self.bytes == 0 || self.bytes > most {
            bail!("`strings.bytes = {}`: the most bytes read of a string, 1 to {most} (256 chunks)", self.bytes);
        }
        let strings = Strings { at: source, list, length: self.length, nodes, items, bytes: self.bytes, raw: self.raw };
        if strings.turns() > u64::from(STRINGS_STEPS) {
            bail!(
                "`strings` may take {} turns a hit (nodes x items x chunks of {CHUNK_LEN} bytes), past the kernel's \
                 bound of {STRINGS_STEPS}: lower `nodes`, `items` or `bytes`",
                strings.turns()
            );
        }
        Ok(strings)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPickle {
    tags: Vec<String>,
    keys: Vec<String>,
    #[serde(default)]
    items: bool,
}

impl RawPickle {
    fn validate(self, bytes: bool, msgpack: bool) -> Result<Pickle> {
        if !bytes {
            bail!(
                "`pickle` says which values of the pickle at `bytes` to read: give `bytes` too (the pickle's address)"
            );
        }
        if msgpack {
            bail!("give either `msgpack` or `pickle`: the data at `bytes` is one or the other");
        }
        let names = |what: &str, names: &[String], most: usize| -> Result<()> {
            if names.is_empty() || names.len() > most {
                bail!("`pickle.{what}` has {} names; give 1 to {most}", names.len());
            }
            for name in names {
                if name.is_empty() || name.len() > PICKLE_NAME_LEN {
                    bail!(
                        "`pickle.{what}` has {name:?}, {} bytes: each is matched whole, 1 to {PICKLE_NAME_LEN} bytes",
                        name.len()
                    );
                }
            }
            Ok(())
        };
        names("tags", &self.tags, PICKLE_TAGS)?;
        names("keys", &self.keys, PICKLE_KEYS)?;
        if self.items && self.keys.len() != 1 {
            bail!("`pickle.items = true` reads the strings of one key's list: give one key, not {}", self.keys.len());
        }
        Ok(Pickle { tags: self.tags, keys: self.keys, items: self.items })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMsgpack {
    element: u32,
    #[serde(default)]
    tag: String,
}

impl RawSignal {
    fn validate(mut self, origin: Arc<str>, line: usize) -> Result<SignalSpec> {
        if self.name.trim().is_empty() {
            bail!("`name` is empty: name the signal as its consumer knows it");
        }
        if self.symbol.trim().is_empty() {
            bail!("`symbol` is empty: name the function to probe (mangled C++ names are fine)");
        }
        check_object(self.object.as_deref())?;
        let (ret, ret_at) = parse_ret(self.ret, self.at)?;
        let value = self.value.validate("value", self.at, false)?;
        // `from = "key"` reads at the signal's value, which may well be an
        // address (a data pointer returned).
        let capture = match (self.text, self.bytes) {
            (Some(text), None) => Some(Capture::Text(text.validate("text", self.at, true)?)),
            (None, Some(bytes)) => Some(Capture::Bytes(bytes.validate("bytes", self.at, true)?)),
            (None, None) => None,
            (Some(_), Some(_)) => bail!("give either `text` (a string) or `bytes` (raw bytes), not both"),
        };
        if ret_at.is_some() {
            let capture = capture.as_ref().map(|capture| match capture {
                Capture::Text(at) => ("text", at),
                Capture::Bytes(at) => ("bytes", at),
            });
            refuse_ret_register(std::iter::once(("value", &value)).chain(capture))?;
        }
        let bytes = matches!(capture, Some(Capture::Bytes(_)));
        let pickle = self.pickle.map(|p| p.validate(bytes, self.msgpack.is_some())).transpose()?;
        let msgpack = self.msgpack.map(|m| m.validate(bytes)).transpose()?;
        let when = self.when.map(|when| when.validate(self.at)).transpose()?;
        let (extra, extra_if_else) = match (self.extra, self.bytes_else.as_mut().and_then(|other| other.extra.take())) {
            (Some(_), Some(_)) => bail!(
                "`extra` is given twice (at the top and in `bytes_else`): keep the one in `bytes_else` to read it \
                 only where the bytes are at `bytes_else.at`, or the top one to read it on every hit"
            ),
            (Some(_), _) | (_, Some(_)) if self.at == At::Return => bail!(
                "`extra` is a second value read at the entry, handed over where a return value goes: at a return \
                 the return value is there already; read it at `at = \"entry\"`, or drop `extra`"
            ),
            (Some(extra), None) => (Some(extra.validate("extra", self.at, false)?), false),
            (None, Some(extra)) => (Some(extra.validate("bytes_else.extra", self.at, false)?), true),
            (None, None) => (None, false),
        };
        let bytes_else = match self.bytes_else {
            Some(_) if !matches!(capture, Some(Capture::Bytes(_))) => bail!(
                "`bytes_else` says where the `bytes` are when a byte says they are not where `bytes` points: \
                 give `bytes` too"
            ),
            Some(other) => Some(other.validate(self.at)?),
            None => None,
        };
        if self.strings.is_some() && (capture.is_some() || msgpack.is_some()) {
            bail!("`strings` is a signal's capture of its own: drop `text`, `bytes` and `msgpack`, or `strings`");
        }
        let strings = self.strings.map(|strings| strings.validate(self.at)).transpose()?;
        if self.peer && !matches!(capture, Some(Capture::Text(_))) {
            bail!(
                "`peer = true` says the signal's `text` names the peer of the transfer its thread creates next: \
                 give `text` (where the remote agent's name is), or drop `peer`"
            );
        }
        Ok(SignalSpec {
            origin,
            line,
            name: self.name,
            object: self.object.filter(|object| !object.is_empty()),
            symbol: self.symbol,
            at: self.at,
            ret,
            ret_at,
            value,
            capture,
            msgpack,
            strings,
            pickle,
            layout: self.layout,
            when,
            extra,
            extra_if_else,
            bytes_else,
            optional: self.optional,
            peer: self.peer,
        })
    }
}

impl RawFilter {
    fn validate(self, at: At) -> Result<Filter> {
        let source = RawSource { from: self.from, deref: self.deref, add: self.add }.validate("when", at, false)?;
        let rule = parse_rule(&self.is).map_err(|err| anyhow!("`when.is`: {err}"))?;
        if Values::held_by(&rule, RetType::I64).is_empty() {
            bail!("`when.is = \"{}\"` never holds for a 64-bit value: no hit would be a signal", self.is.trim());
        }
        let mask = match self.mask {
            Some(0) => {
                bail!("`when.mask = 0` keeps no bit: every hit would compare 0; drop it or name the bits to keep")
            }
            Some(mask) => {
                if rule.op == cmp::EQ && rule.value as u64 & !mask != 0 {
                    bail!(
                        "`when.is = \"{}\"` never holds for a value masked with {mask:#x}: compare bits the mask keeps",
                        self.is.trim()
                    );
                }
                mask
            }
            None => 0,
        };
        Ok(Filter { at: source, rule, mask })
    }
}

impl RawBytesElse {
    fn validate(self, at: At) -> Result<BytesElse> {
        let is = u8::try_from(self.is).map_err(|_| {
            anyhow!("`bytes_else.is = {}`: the byte at `unless_byte` is compared with it, so give 0 to 255", self.is)
        })?;
        Ok(BytesElse {
            at: self.at.validate("bytes_else.at", at, true)?,
            unless_byte: self.unless_byte.validate("bytes_else.unless_byte", at, true)?,
            is,
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
    ret: Option<toml::Value>,
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
        check_object(self.object.as_deref())?;
        let (ret, ret_at) = parse_ret(self.ret, self.at)?;
        let action = match (self.event, self.on_return) {
            (Some(event), None) => Action::Always(parse_stage(&event)?),
            (None, Some(rules)) => {
                if self.at != At::Return {
                    bail!("`on_return` needs `at = \"return\"`; an entry probe takes a single `event`");
                }
                if rules.is_empty() || rules.len() > MAX_RET_RULES {
                    bail!("`on_return` takes 1 to {MAX_RET_RULES} rules, found {}", rules.len());
                }
                let parsed = parse_rules(rules, ret, &line_at)?;
                Action::OnReturn(parsed)
            }
            (Some(_), Some(_)) => bail!("give either `event` or `on_return`, not both"),
            (None, None) => bail!(
                "no lifecycle event: add `event = \"...\"` (one of {}) or, for a return probe, `on_return = [...]`",
                stage_names()
            ),
        };
        if self.read_status && (self.at != At::Entry || !matches!(action, Action::Always(_))) {
            bail!(
                "`read_status` reads the request's [status] at the function's entry, where its memory is still its \
                 own: it needs `at = \"entry\"` and one `event`"
            );
        }
        if self.at == At::Entry && self.only_on_change {
            bail!("`only_on_change` compares return values: it needs `at = \"return\"`");
        }
        let key = self.key.validate("key", self.at, false)?;
        let int_key = key.from == From::Ret && key.deref.is_empty() && ret != RetType::I64;
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
        if ret_at.is_some() {
            let ext = external_id.iter().flat_map(|ext| {
                std::iter::once(("external_id", &ext.at)).chain(ext.guard.iter().map(|g| ("external_id.guard", g)))
            });
            refuse_ret_register(std::iter::once(("key", &key)).chain(ext))?;
        }
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
            ret_at,
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
            bail!("`when = \"{}\"` (line {rule_line}) never holds: {}", rule.when.trim(), ret.range());
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

/// An `object` is the main executable (none), a full path (`/...`), or
/// a file name with as many of its last directories as tell it apart
/// (`mooncake/engine.so`), matched against each mapped file's path
/// ([`super::resolve::ProcessImage::find`]).
fn check_object(object: Option<&str>) -> Result<()> {
    let Some(object) = object.filter(|object| !object.is_empty() && !object.starts_with('/')) else { return Ok(()) };
    if let Some(bad) = object.split('/').find(|part| part.is_empty() || *part == "." || *part == "..") {
        bail!(
            "`object = \"{object}\"` has {}: name a mapped file by its full path (\"/...\"), its file name \
             (\"libnixl.so\") or its file name with the directories just above it (\"mooncake/engine.so\")",
            if bad.is_empty() { "an empty path component".to_owned() } else { format!("a `{bad}` component") }
        );
    }
    Ok(())
}

/// A `ret`: the return value's type (`ret = "i32"`), or where it lies
/// behind the return register and its type (`ret = { from = "ret", deref
/// = [0], type = "u16" }`, for a result returned through a hidden pointer).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetAt {
    from: String,
    #[serde(default)]
    deref: Vec<i64>,
    #[serde(default)]
    add: i64,
    #[serde(rename = "type")]
    value: RetType,
}

/// The return value's type, and where it lies when it is read behind the
/// return register, from a probe's or signal's `ret`.
fn parse_ret(raw: Option<toml::Value>, at: At) -> Result<(RetType, Option<Source>)> {
    let Some(raw) = raw else { return Ok((RetType::default(), None)) };
    if at != At::Return {
        bail!("`ret` describes a return value: it needs `at = \"return\"`");
    }
    const TYPES: &str = "\"i64\" (the default), \"i32\", \"u16\" or \"u8\"";
    let ret_type = |name: &str, field: &str| -> Result<RetType> {
        RetType::deserialize(toml::Value::String(name.to_owned()))
            .map_err(|_| anyhow!("`{field} = \"{name}\"`: expected {TYPES}"))
    };
    match raw {
        toml::Value::String(name) => Ok((ret_type(&name, "ret")?, None)),
        toml::Value::Table(table) => {
            let typed = table.get("type").and_then(toml::Value::as_str).map(|name| ret_type(name, "ret.type"));
            if let Some(Err(err)) = typed {
                return Err(err);
            }
            let raw: RawRetAt = toml::Value::Table(table).try_into().map_err(|err| {
                anyhow!(
                    "`ret = {{ ... }}`: {err}; write `ret = {{ from = \"ret\", deref = [OFFSET], type = \"u16\" }}` \
                     for a value behind the return register"
                )
            })?;
            if raw.from != "ret" {
                bail!(
                    "`ret.from = \"{}\"`: a return value read behind a register is read from the return register: \
                     write `from = \"ret\"` (an argument's memory at return is read by `key` or a signal's `value`)",
                    raw.from
                );
            }
            if raw.deref.is_empty() {
                bail!(
                    "`ret = {{ from = \"ret\" }}` with no `deref` is the return register itself: write `ret = \"{}\"`, \
                     or give where the value lies behind it (`deref = [OFFSET]`)",
                    raw.value.as_str()
                );
            }
            if raw.deref.len() > MAX_DEREF {
                bail!("`ret.deref` has {} steps; at most {MAX_DEREF} are supported", raw.deref.len());
            }
            Ok((raw.value, Some(Source { from: From::Ret, deref: raw.deref, add: raw.add })))
        }
        other => bail!(
            "`ret = {other}`: expected a type ({TYPES}) or where the value lies behind the return register \
             (`{{ from = \"ret\", deref = [OFFSET], type = \"u16\" }}`)"
        ),
    }
}

/// With `ret` read behind the return register, no other source may start
/// at the register: the kernel hands them the value read, not the
/// register, which would read memory nobody meant.
fn refuse_ret_register<'a>(sources: impl Iterator<Item = (&'a str, &'a Source)>) -> Result<()> {
    for (field, source) in sources {
        if source.from == From::Ret {
            bail!(
                "`{field}.from = \"ret\"` beside a `ret` read behind the return register: the return value is then \
                 the value read there, not the register; read `{field}` from an argument instead, or probe the \
                 function twice (one [[probe]] or [[signal]] per reading of its return)"
            );
        }
    }
    Ok(())
}

fn stage_names() -> String {
    Stage::ALL.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ")
}

fn parse_stage(name: &str) -> Result<Stage> {
    name.parse::<Stage>().map_err(|_| anyhow!("unknown lifecycle event \"{name}\": expected one of {}", stage_names()))
}

/// `"== 0"`, `"< 0"`, `">= -3"`, `"!= 1"`...
pub(super) fn parse_rule(text: &str) -> Result<RetRule> {
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
