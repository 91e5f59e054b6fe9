//! Probe profiles: which functions of a target are which lifecycle points,
//! and where each hit's request key lives.
//!
//! A profile is a TOML file (format in docs/profiles.md) or one of the built-ins.
//! Parsing checks everything the kernel side cannot: every error names the
//! file, the line of the `[[probe]]` table and what to write instead.
//!
//! [`schema`] is what a profile says, [`load`] reads and checks it,
//! [`returns`] compares return values as the kernel does, [`resolve`] finds
//! each probe's function in a process.
mod load;
pub mod plan;
pub mod resolve;
mod returns;
pub mod roles;
mod schema;
#[cfg(test)]
mod tests;

pub use returns::RetType;
pub use schema::*;

/// Built-in profiles: (name, TOML text).
const BUILTIN: &[(&str, &str)] = &[
    ("demo", include_str!("builtin/demo.toml")),
    ("nixl", include_str!("builtin/nixl.toml")),
    ("marker", include_str!("builtin/marker.toml")),
    ("sglang", include_str!("builtin/sglang.toml")),
    ("sglang-mooncake", include_str!("builtin/sglang-mooncake.toml")),
    ("vllm", include_str!("builtin/vllm.toml")),
];

/// Names of the built-in profiles, for help texts and errors.
pub fn builtin_names() -> impl Iterator<Item = &'static str> {
    BUILTIN.iter().map(|(name, _)| *name)
}

/// The TOML text of a built-in profile.
pub fn builtin_text(name: &str) -> Option<&'static str> {
    BUILTIN.iter().find(|(n, _)| *n == name).map(|(_, text)| *text)
}
