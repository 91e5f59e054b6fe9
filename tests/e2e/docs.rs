//! The reference pages in `docs/` against what the real agent emits: one
//! agent on the demo target (real eBPF in this kernel) with a stall of every
//! class, a recovery, a failure and an abort, its OTLP spans at a real
//! collector and its `/metrics` scraped. Every name a reference table lists
//! is checked against that run, and every name the run emits must be in a
//! table: an emitted field, metric, label value or span attribute the docs
//! do not list fails, as does a listed one marked `always` that the run
//! never emitted.
//!
//! A reference table is a markdown table whose first column holds the name
//! in backticks; a `present` column says `always` for what every run emits
//! (the rest appears only with some profiles or set-ups: it must still be a
//! documented name when it does appear).
use std::{
    collections::{BTreeMap, BTreeSet},
    process::Command,
    time::Duration,
};

use serde_json::Value;
use stallwatch_tests::{
    Agent, Demo, Line, METRICS, agent_bin, otlp::Collector, require_root, root, run_to_end, summary,
};

/// One reference table: its rows, each cell as written.
struct Table {
    /// Where it is, for error messages.
    at: String,
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// The table in `docs/<page>` whose header's first cell is `first`.
    fn find(page: &str, first: &str) -> Self {
        let path = root().join("docs").join(page);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("reading {}: {err}", path.display()));
        let cells = |line: &str| -> Vec<String> {
            let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
            split_cells(inner).into_iter().map(|cell| cell.trim().to_owned()).collect()
        };
        let lines: Vec<&str> = text.lines().collect();
        let start = lines
            .iter()
            .position(|line| line.starts_with('|') && cells(line).first().is_some_and(|cell| cell == first))
            .unwrap_or_else(|| {
                panic!("docs/{page} has no table whose first column is headed `{first}`: the docs test reads it")
            });
        let rows = lines[start + 2..].iter().take_while(|line| line.starts_with('|')).map(|line| cells(line)).collect();
        Self { at: format!("docs/{page}, the `{first}` table (line {})", start + 1), header: cells(lines[start]), rows }
    }

    /// The index of the column headed `name`.
    fn column(&self, name: &str) -> usize {
        self.header
            .iter()
            .position(|cell| cell == name)
            .unwrap_or_else(|| panic!("{} has no `{name}` column (it has {:?})", self.at, self.header))
    }

    /// Each row's name (the first column's one backticked name) with the
    /// row.
    fn named(&self) -> BTreeMap<String, &[String]> {
        let mut named = BTreeMap::new();
        for row in &self.rows {
            let names = ticked(&row[0]);
            assert_eq!(names.len(), 1, "{}: the first column must hold one name in backticks: {:?}", self.at, row[0]);
            assert!(named.insert(names[0].clone(), row.as_slice()).is_none(), "{}: `{}` twice", self.at, names[0]);
        }
        named
    }

    /// The names of the rows whose `present` column says `always`.
    fn always(&self) -> BTreeSet<String> {
        let present = self.column("present");
        self.named().into_iter().filter(|(_, row)| row[present] == "always").map(|(name, _)| name).collect()
    }
}

/// A table row's cells, split at `|` outside backticks (`a \| b` in a code
/// span is one cell).
fn split_cells(line: &str) -> Vec<String> {
    let (mut cells, mut cell, mut code) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '`' => {
                code = !code;
                cell.push(c);
            }
            '\\' if chars.peek() == Some(&'|') => cell.push(chars.next().unwrap_or('|')),
            '|' if !code => cells.push(std::mem::take(&mut cell)),
            _ => cell.push(c),
        }
    }
    cells.push(cell);
    cells
}

/// The backticked words of a cell, in order.
fn ticked(cell: &str) -> Vec<String> {
    cell.split('`').skip(1).step_by(2).map(str::to_owned).collect()
}

/// The labels a metric row lists: `` `label`: `v1`, `v2` `` (values
/// listed: a bounded set, checked both ways) or `` `label` `` alone (any
/// value).
fn labels(cell: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut labels: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    let parts: Vec<&str> = cell.split('`').collect();
    for (i, word) in parts.iter().enumerate().skip(1).step_by(2) {
        let after = parts.get(i + 1).copied().unwrap_or("");
        if after.starts_with(':') {
            labels.insert((*word).to_owned(), BTreeSet::new());
            current = Some((*word).to_owned());
        } else if let Some(label) = &current {
            labels.get_mut(label).map(|values| values.insert((*word).to_owned()));
        } else {
            labels.insert((*word).to_owned(), BTreeSet::new());
        }
        if !after.starts_with(':') && !after.trim_start().starts_with(',') {
            current = None;
        }
    }
    labels
}

/// The values a span attribute row lists after "one of": the backticked
/// words up to the first that is not followed by a comma.
fn one_of(cell: &str) -> BTreeSet<String> {
    let Some((_, rest)) = cell.split_once("one of") else { return BTreeSet::new() };
    let parts: Vec<&str> = rest.split('`').collect();
    let mut values = BTreeSet::new();
    for (i, word) in parts.iter().enumerate().skip(1).step_by(2) {
        values.insert((*word).to_owned());
        if !parts.get(i + 1).is_some_and(|after| after.trim_start().starts_with(',')) {
            break;
        }
    }
    values
}

/// Names emitted but not documented, and documented `always` but not
/// emitted: both must be empty.
fn both_ways(what: &str, table: &Table, emitted: &BTreeSet<String>) {
    let documented: BTreeSet<String> = table.named().into_keys().collect();
    let undocumented: Vec<&String> = emitted.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "{what} the agent emitted that {} does not list: {undocumented:?}; add a row for each",
        table.at
    );
    let always = table.always();
    let missing: Vec<&String> = always.difference(emitted).collect();
    assert!(
        missing.is_empty(),
        "{what} {} marks `always` that the agent did not emit: {missing:?}; fix the name, or say when it is present",
        table.at
    );
}

/// The keys of a JSON object.
fn keys(value: &Value) -> BTreeSet<String> {
    value.as_object().unwrap_or_else(|| panic!("not a JSON object: {value}")).keys().cloned().collect()
}

/// What one run of the agent on the demo emitted.
struct Run {
    lines: Vec<Line>,
    inflight: Value,
    metrics: String,
    spans: Vec<stallwatch_tests::otlp::Span>,
}

/// The agent on the demo with a stall of each class, a recovery, a failure
/// and an abort; `inflight --json` and `/metrics` taken while they are
/// stuck; the spans of every request at the collector.
fn run() -> Run {
    require_root();
    let mut collector = Collector::start();
    let mut demo =
        Demo::builder().rate(500).duration("6s").inject_after("300ms").each_stall("2500ms").fail(1).abort(1).start();
    let endpoint = collector.http_endpoint();
    let mut extra = vec!["--otlp-endpoint", &endpoint];
    extra.extend(METRICS);
    let agent = Agent::watch(demo.proc.pid(), "demo", "1s", &extra);
    demo.go();
    let mut lines = Vec::new();
    agent.wait_alerts("stalled", 4, Duration::from_secs(10), &mut lines);
    let socket = agent.proc.stderr();
    let socket = socket
        .lines()
        .filter(|line| line.contains("serving `stallwatch inflight`"))
        .find_map(|line| line.split("socket=").nth(1))
        .map(|rest| rest.split_whitespace().next().unwrap_or(rest).to_owned())
        .expect("the agent logs its socket");
    let (ok, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(["inflight", "--json", "--socket", &socket]));
    assert!(ok, "stallwatch inflight --json failed: {stderr}");
    let inflight = serde_json::from_str(&stdout).unwrap_or_else(|err| panic!("inflight --json ({err}): {stdout}"));
    let metrics = stallwatch_tests::otlp::http_get(agent.metrics_port(), "/metrics", None).1;
    // The demo exits at 6 s: its pinned requests end process_exited, and
    // the agent with it.
    lines.extend(agent.proc.lines_until_exit(Duration::from_secs(30)));
    let spans = collector.wait_for(Duration::from_secs(10), "the request spans of the pinned requests", |spans| {
        spans.iter().filter(|s| s.attr("stallwatch.request.outcome") == Some("process_exited")).count() >= 3
    });
    let _ = collector.stop();
    Run { lines, inflight, metrics, spans }
}

#[test]
fn the_reference_docs_list_exactly_what_the_agent_emits() {
    let run = run();
    alert_lines(&run.lines);
    summary_line(&summary(&run.lines));
    inflight_answer(&run.inflight);
    metrics(&run.metrics);
    spans(&run.spans);
}

/// docs/schema.md: every alert line's fields, by kind.
fn alert_lines(lines: &[Line]) {
    let table = Table::find("schema.md", "alert field");
    let kinds_column = table.column("alerts");
    let present = table.column("present");
    let kinds = Table::find("schema.md", "alert");
    let documented_kinds: BTreeSet<String> = kinds.named().into_keys().collect();
    let mut emitted_kinds = BTreeSet::new();
    for line in lines {
        let Some(value) = line.json() else { continue };
        let kind = value["alert"].as_str().unwrap_or_else(|| panic!("an alert line without `alert`: {value}"));
        emitted_kinds.insert(kind.to_owned());
        if kind == "summary" {
            continue;
        }
        for field in keys(&value) {
            let row =
                table.named().get(&field).map(|row| row.to_vec()).unwrap_or_else(|| {
                    panic!("alert field `{field}` (in {value}) is not in {}: add its row", table.at)
                });
            let of = &row[kinds_column];
            assert!(
                of == "every" || ticked(of).iter().any(|k| k == kind),
                "`{field}` is on `{kind}` alerts ({value}), but {} lists it for {of} only",
                table.at
            );
        }
        for (field, row) in table.named() {
            let on_this = row[kinds_column] == "every" || ticked(&row[kinds_column]).iter().any(|k| k == kind);
            if on_this && row[present] == "always" {
                assert!(value.get(&field).is_some(), "{} says every `{kind}` alert has `{field}`: {value}", table.at);
            }
        }
    }
    let expected = ["stalled", "recovered", "failed", "process_exited", "summary"];
    for kind in expected {
        assert!(emitted_kinds.contains(kind), "the run emitted no `{kind}` line: {emitted_kinds:?}");
    }
    let undocumented: Vec<&String> = emitted_kinds.difference(&documented_kinds).collect();
    assert!(undocumented.is_empty(), "alert kinds not in {}: {undocumented:?}", kinds.at);
}

/// docs/schema.md: the summary line and its probe entries.
fn summary_line(summary: &Value) {
    both_ways("summary fields", &Table::find("schema.md", "summary field"), &keys(summary));
    let probes = summary["probes"].as_array().unwrap_or_else(|| panic!("summary without probes: {summary}"));
    let emitted = probes.iter().flat_map(keys).collect();
    both_ways("summary probe fields", &Table::find("schema.md", "probe field"), &emitted);
}

/// docs/schema.md: `stallwatch inflight --json`.
fn inflight_answer(answer: &Value) {
    both_ways("inflight fields", &Table::find("schema.md", "inflight field"), &keys(answer));
    let processes = answer["processes"].as_array().unwrap_or_else(|| panic!("no processes: {answer}"));
    both_ways(
        "inflight process fields",
        &Table::find("schema.md", "process field"),
        &processes.iter().flat_map(keys).collect(),
    );
    let requests = answer["requests"].as_array().unwrap_or_else(|| panic!("no requests: {answer}"));
    assert!(requests.len() >= 3, "inflight showed fewer than the 3 pinned requests: {answer}");
    both_ways(
        "inflight request fields",
        &Table::find("schema.md", "request field"),
        &requests.iter().flat_map(keys).collect(),
    );
}

/// docs/telemetry.md: every metric family, its type, its labels and the
/// values of bounded labels, both ways.
fn metrics(body: &str) {
    let table = Table::find("telemetry.md", "metric");
    let (type_column, labels_column) = (table.column("type"), table.column("labels"));
    let mut families: BTreeMap<String, String> = BTreeMap::new();
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("odd TYPE line: {line}"));
            families.insert(name.to_owned(), kind.to_owned());
        }
    }
    both_ways("metrics", &table, &families.keys().cloned().collect());
    let named = table.named();
    // Every sample's labels and values, per family.
    let mut seen: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for line in body.lines().filter(|line| !line.starts_with('#') && !line.is_empty()) {
        let (series, _) = line.rsplit_once(' ').unwrap_or_else(|| panic!("odd sample: {line}"));
        let (name, labels) = series.split_once('{').map_or((series, ""), |(n, l)| (n, l.trim_end_matches('}')));
        let family = families
            .keys()
            .filter(|family| {
                name == family.as_str() || ["_bucket", "_sum", "_count"].iter().any(|s| name == format!("{family}{s}"))
            })
            .max_by_key(|family| family.len())
            .unwrap_or_else(|| panic!("sample `{line}` of no family"));
        let entry = seen.entry(family.clone()).or_default();
        for pair in labels.split("\",").filter(|pair| !pair.is_empty()) {
            let (label, value) = pair.split_once("=\"").unwrap_or_else(|| panic!("odd label in {line}"));
            if label != "le" {
                entry.entry(label.to_owned()).or_default().insert(value.trim_end_matches('"').to_owned());
            }
        }
    }
    for (family, kind) in &families {
        let row = named[family];
        let documented_type = &row[type_column];
        assert!(
            documented_type.is_empty() || documented_type == kind,
            "{}: `{family}` is a {kind}, not a {documented_type}",
            table.at
        );
        let documented = labels(&row[labels_column]);
        let emitted = seen.get(family).cloned().unwrap_or_default();
        let names = |m: &BTreeMap<String, BTreeSet<String>>| m.keys().cloned().collect::<BTreeSet<_>>();
        assert_eq!(
            names(&emitted),
            names(&documented),
            "{}: `{family}`'s labels are {:?}, the docs say {:?}",
            table.at,
            names(&emitted),
            names(&documented)
        );
        // A metric present in every run has a series for every value
        // (they are registered up front); one present only sometimes (a
        // stalled workload) has some of them.
        let every_value = row[table.column("present")] == "always";
        for (label, values) in documented.iter().filter(|(_, values)| !values.is_empty()) {
            let taken = &emitted[label];
            assert!(
                taken.is_subset(values) && (!every_value || taken == values),
                "{}: `{family}{{{label}}}` takes {taken:?}, the docs list {values:?}",
                table.at
            );
        }
    }
}

/// docs/telemetry.md: every span attribute, on which span, and the values
/// of the enumerated ones (which must be the metrics' label values).
fn spans(spans: &[stallwatch_tests::otlp::Span]) {
    let table = Table::find("telemetry.md", "span attribute");
    let (spans_column, value_column) = (table.column("spans"), table.column("value"));
    let named = table.named();
    let mut emitted = BTreeSet::new();
    let mut kinds = BTreeSet::new();
    for span in spans {
        let kind = match span.name.as_str() {
            "stallwatch.stall" => "stall",
            "stallwatch.request" => "request",
            other => panic!("a span named `{other}`: the docs know stallwatch.stall and stallwatch.request"),
        };
        kinds.insert(kind);
        for (name, value) in &span.attributes {
            emitted.insert(name.clone());
            let Some(row) = named.get(name) else { continue };
            let on = &row[spans_column];
            assert!(on == "both" || on == kind, "{}: `{name}` is on {kind} spans, the docs say {on}", table.at);
            let values = one_of(&row[value_column]);
            assert!(
                values.is_empty() || values.contains(value),
                "{}: `{name}` = `{value}` on a {kind} span, not one of {values:?}",
                table.at
            );
        }
    }
    assert_eq!(kinds.len(), 2, "the run sent no stall span or no request span");
    both_ways("span attributes", &table, &emitted);
    // The enumerations of spans and metrics are the agent's one enum each.
    let metrics = Table::find("telemetry.md", "metric");
    let metric_labels =
        |metric: &str, label: &str| labels(&metrics.named()[metric][metrics.column("labels")])[label].clone();
    for (attribute, metric, label) in [
        ("stallwatch.request.outcome", "stallwatch_requests_ended_total", "outcome"),
        ("stallwatch.stall.class", "stallwatch_stalls_total", "class"),
    ] {
        assert_eq!(
            one_of(&named[attribute][value_column]),
            metric_labels(metric, label),
            "{}: `{attribute}`'s values and `{metric}{{{label}}}`'s differ",
            table.at
        );
    }
}

/// docs/getting-started.md: `stallwatch doctor`'s checks, and which are
/// required, both ways.
#[test]
fn the_doctor_table_lists_every_check_doctor_runs() {
    let (_, stdout, stderr) = run_to_end(Command::new(agent_bin()).args(["doctor", "--json"]));
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|err| panic!("doctor --json ({err}): {stderr}"));
    let table = Table::find("getting-started.md", "check");
    let required = table.column("required");
    let named = table.named();
    let checks = report["checks"].as_array().unwrap_or_else(|| panic!("no checks: {report}"));
    let emitted: BTreeSet<String> = checks.iter().map(|c| c["name"].as_str().expect("name").to_owned()).collect();
    let documented: BTreeSet<String> = named.keys().cloned().collect();
    assert_eq!(emitted, documented, "{}: doctor runs {emitted:?}", table.at);
    for check in checks {
        let name = check["name"].as_str().expect("name");
        let says = if check["required"] == true { "yes" } else { "no" };
        assert_eq!(named[name][required], says, "{}: is `{name}` required? doctor says {says}", table.at);
    }
}

/// The README stays a front page: at most ~250 lines, with the two
/// commands CI and a newcomer rely on, verbatim.
#[test]
fn the_readme_is_short_and_has_the_two_commands() {
    let path = root().join("README.md");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("reading {}: {err}", path.display()));
    let lines = text.lines().count();
    assert!(lines <= 250, "README.md has {lines} lines: move reference material into docs/ (at most ~250)");
    for command in ["cargo run --release -p xtask -- demo", "cargo run --release -p xtask -- test"] {
        assert!(
            text.lines().any(|line| line.starts_with(command)),
            "README.md lost `{command}` at the start of a line (.ci/run and newcomers rely on it)"
        );
    }
}

/// Every relative link in the README and docs/ leads to a file that exists
/// and, with a `#fragment`, to a heading of it (GitHub's anchors).
#[test]
fn every_link_in_the_docs_resolves() {
    let mut pages = vec![root().join("README.md"), root().join("CHANGELOG.md")];
    let mut dirs = vec![root().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|err| panic!("reading {}: {err}", dir.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "md") {
                pages.push(path);
            }
        }
    }
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap_or_else(|err| panic!("reading {}: {err}", page.display()));
        for target in text.split("](").skip(1).filter_map(|rest| rest.split_once(')').map(|(target, _)| target)) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, fragment) = target.split_once('#').unwrap_or((target, ""));
            let file = if file.is_empty() { page.clone() } else { page.parent().expect("a page's folder").join(file) };
            if !file.exists() {
                broken.push(format!("{}: `{target}`: no such file", page.display()));
            } else if !fragment.is_empty() && !anchors(&file).contains(fragment) {
                broken.push(format!(
                    "{}: `{target}`: no heading with that anchor in {}",
                    page.display(),
                    file.display()
                ));
            }
        }
    }
    assert!(broken.is_empty(), "broken links (fix the path, or the heading they point at):\n{}", broken.join("\n"));
}

/// The anchors GitHub gives a markdown file's headings: lower case, spaces
/// to hyphens, punctuation but `-` and `_` dropped.
fn anchors(file: &std::path::Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    text.lines()
        .filter(|line| line.starts_with('#'))
        .map(|line| {
            line.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}
