//! Reading the small text files the agent is given (profiles, its config
//! file) with a bound: a path that names something endless (`/dev/zero`,
//! `/dev/urandom`) or huge must fail with an error that says so, never
//! grow the agent's memory until the host kills it.
use std::{io::Read as _, path::Path};

use anyhow::{Context as _, Result, bail};

/// The most a profile or config file may hold: real ones are a few KiB;
/// this leaves room for a hostile one (a megabyte symbol) to be read and
/// refused with its own error.
pub const MAX_TEXT_FILE: u64 = 4 << 20;

/// The UTF-8 text of `path`, a `what` ("profile file", "config file"), at
/// most [`MAX_TEXT_FILE`] bytes.
pub fn read_text(path: &Path, what: &str) -> Result<String> {
    read_text_within(path, what, MAX_TEXT_FILE)
}

fn read_text_within(path: &Path, what: &str, max: u64) -> Result<String> {
    let file = std::fs::File::open(path).with_context(|| format!("reading {what} {}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).with_context(|| format!("reading {what} {}", path.display()))?;
    if bytes.len() as u64 > max {
        bail!(
            "{what} {} holds more than {} KiB (or never ends, as a device such as /dev/zero does): a {what} is a small \
             text file; check the path",
            path.display(),
            max / 1024
        );
    }
    String::from_utf8(bytes).with_context(|| format!("{what} {} is not UTF-8 text: check the path", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_or_oversized_file_is_refused_without_reading_it_all() {
        let err = read_text(Path::new("/dev/zero"), "profile file").unwrap_err().to_string();
        assert!(
            err.contains("profile file /dev/zero holds more than 4096 KiB") && err.contains("check the path"),
            "{err}"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("big.toml");
        std::fs::write(&path, "#".repeat(2048)).expect("write");
        assert!(read_text_within(&path, "config file", 1024).unwrap_err().to_string().contains("more than 1 KiB"));
        assert_eq!(read_text_within(&path, "config file", 2048).expect("fits").len(), 2048);
        std::fs::write(&path, [0xff, 0xfe]).expect("write");
        assert!(read_text(&path, "config file").unwrap_err().to_string().contains("is not UTF-8"));
    }
}
