//! Rebuild the eBPF object when bpf-linker changes: cargo does not track the
//! linker, so a new bpf-linker would otherwise leave a stale object behind.
fn main() {
    match which::which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(err) => println!("cargo:warning=bpf-linker not found ({err}); run `cargo xtask setup`"),
    }
}
