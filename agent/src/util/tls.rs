//! The process's TLS: rustls on the `ring` provider, not its default
//! aws-lc-rs (a C/CMake build of minutes). reqwest is built without a
//! provider and panics when a client is built before one is installed, so
//! whoever builds a client (OTLP export, the Kubernetes API) installs it
//! first; tonic picks ring itself.

/// Install `ring` as the process's rustls provider (once; later calls do
/// nothing). rustls 0.23.48 deprecates it for lacking post-quantum key
/// exchange (X25519MLKEM768), which only aws-lc-rs offers; classical ECDHE
/// is what collectors negotiate today.
#[allow(deprecated)]
pub fn install_ring() {
    // Err: already installed, which is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
}
