//! The `stallwatch` binary: everything is in [`stallwatch::cli`].
fn main() -> std::process::ExitCode {
    stallwatch::cli::main()
}
