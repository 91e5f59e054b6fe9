//! stallwatch: catches silent request stalls in disaggregated LLM serving.
//!
//! One folder per layer, in the order data moves (docs/design.md draws it);
//! a layer uses the ones below it, never one above:
//!
//! - [`cli`]: the command line, the config file, `doctor`, the agent's logs.
//! - [`run`]: `stallwatch run`: the session, the process table and the
//!   event loop that wires every layer below together.
//! - [`query`]: `stallwatch inflight`, answered over a unix socket.
//! - [`export`]: what leaves the agent: alert lines, the summary, OTLP spans,
//!   metrics, and the identity of the workload each watched process is.
//! - [`frameworks`]: what follows a serving framework's own protocol
//!   (signals in, room observations and context out), one folder each.
//! - [`evidence`]: what is read when a stall comes due: the target's memory,
//!   transport counters, each transfer's peer, and the progress-probe gate.
//! - [`kernel`]: the eBPF object, slots and attach, the pinned tables a
//!   restarted agent takes over, the ring-buffer reader.
//! - [`profile`]: probe profiles: schema, validation, built-ins, symbol
//!   resolution.
//! - [`lifecycle`]: the pure engine: per-request state machine, timer wheel,
//!   classification.
//! - [`util`]: small helpers every layer may use.

// The library is the agent's inside, read with `--document-private-items`
// (as CI's lint builds it): its docs link to private modules on purpose.
#![allow(rustdoc::private_intra_doc_links)]
pub mod cli;
pub mod evidence;
pub mod export;
pub mod frameworks;
pub mod kernel;
pub mod lifecycle;
pub mod profile;
pub mod query;
pub mod run;
pub mod util;

/// The layers above, top to bottom: a module may use its own layer and
/// those after it here, never one before.
#[cfg(test)]
const LAYERS: [&str; 10] =
    ["cli", "run", "query", "export", "frameworks", "evidence", "kernel", "profile", "lifecycle", "util"];

#[cfg(test)]
mod layers {
    use std::path::Path;

    use super::LAYERS;

    /// The layers a source names through `crate::` (in paths and in
    /// `use crate::{...}` groups), comments left out.
    fn named(source: &str) -> Vec<String> {
        let code: Vec<&str> = source.lines().filter(|line| !line.trim_start().starts_with("//")).collect();
        let code = code.join("\n");
        let mut names = Vec::new();
        let mut rest = code.as_str();
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // Top-level names of the group: after `{` or a `,` at depth 0.
                let mut depth = 0;
                let mut start = true;
                for (i, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => start = true,
                        c if start && c.is_ascii_lowercase() => {
                            let len = group[i..].find(|c: char| !(c.is_ascii_lowercase() || c == '_')).unwrap_or(0);
                            names.push(&group[i..i + len]);
                            start = false;
                        }
                        _ => {}
                    }
                }
            } else {
                let len = rest.find(|c: char| !(c.is_ascii_lowercase() || c == '_')).unwrap_or(rest.len());
                names.push(&rest[..len]);
            }
        }
        names.into_iter().filter(|name| LAYERS.contains(name)).map(str::to_owned).collect()
    }

    fn walk(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("reading agent/src") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                walk(&path, files);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path);
            }
        }
    }

    #[test]
    fn no_module_uses_a_layer_above_its_own() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        walk(&src, &mut files);
        let mut upward = Vec::new();
        for file in &files {
            let relative = file.strip_prefix(&src).expect("under src");
            let layer = relative.iter().next().and_then(|first| first.to_str()).unwrap_or_default();
            let Some(rank) = LAYERS.iter().position(|l| *l == layer) else { continue };
            let source = std::fs::read_to_string(file).expect("reading a source file");
            for name in named(&source) {
                if LAYERS.iter().position(|l| *l == name.as_str()).is_some_and(|used| used < rank) {
                    upward.push(format!("{} uses crate::{name}", relative.display()));
                }
            }
        }
        assert!(files.len() > 50, "found only {} source files under {}", files.len(), src.display());
        assert!(upward.is_empty(), "modules using a layer above their own (see lib.rs): {upward:#?}");
    }

    #[test]
    fn layer_names_are_read_from_paths_and_groups() {
        let source =
            "use crate::{kernel::Probes, util::{text, warned}};\n// crate::cli in a comment\nlet x = crate::run::f();";
        assert_eq!(named(source), ["kernel", "util", "run"]);
    }
}
