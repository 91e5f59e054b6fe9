//! What this binary is: the version, and what the build script recorded of
//! the build (`vergen-gitcl`, see `agent/build.rs`). `stallwatch --version`
//! prints it and `/metrics` carries it as `stallwatch_build_info`, so an
//! alert from a fleet can be traced to the exact build that sent it.

/// The crate version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git commit built; `VERGEN_IDEMPOTENT_OUTPUT` when built without git.
pub const GIT_SHA: &str = env!("VERGEN_GIT_SHA");
/// `true` when the work tree had uncommitted changes.
pub const GIT_DIRTY: &str = env!("VERGEN_GIT_DIRTY");
/// The rustc that built it (semver).
pub const RUSTC: &str = env!("VERGEN_RUSTC_SEMVER");
/// The target triple.
pub const TARGET: &str = env!("STALLWATCH_TARGET");

/// `stallwatch --version`: the version, then one `key: value` a line.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "\ncommit: ",
    env!("VERGEN_GIT_SHA"),
    "\ndirty: ",
    env!("VERGEN_GIT_DIRTY"),
    "\nrustc: ",
    env!("VERGEN_RUSTC_SEMVER"),
    "\ntarget: ",
    env!("STALLWATCH_TARGET"),
);
