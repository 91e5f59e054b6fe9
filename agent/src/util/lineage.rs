//! A process's command line and its ancestors', read once when it is first
//! watched: a serving framework retitles the processes it starts
//! (setproctitle: vLLM's `VLLM::EngineCore`, SGLang's `sglang::scheduler`),
//! so what the operator configured (vLLM's `--kv-transfer-config`) is only
//! on the command line of the process that started them.
use std::{fs::File, io::Read as _};

/// How many generations are read: the process, its parent, ... A serving
/// deployment is a few deep (a container's init, the server, its engine,
/// its workers); the walk stops sooner at pid 1.
const GENERATIONS: usize = 6;

/// The most of one command line kept: a serving command line is a few
/// hundred bytes, a JSON config on it a few KiB.
const MAX_CMDLINE: u64 = 16 << 10;

/// One process of a lineage: its pid and its arguments as its command
/// line holds them now (after any retitle).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Generation {
    pub pid: u32,
    pub args: Vec<String>,
}

/// The process first, then its parent, and so on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lineage(pub Vec<Generation>);

impl Lineage {
    /// `pid`'s lineage as `/proc` tells it now. What cannot be read ends
    /// it there (a parent gone, a process that hid its command line): a
    /// lineage is a hint, never a reason to refuse a process. Blocking:
    /// a command line is read from the process's memory, so this runs off
    /// the event loop with the rest of the process's read.
    pub fn read(pid: u32) -> Self {
        let mut generations = Vec::new();
        let mut next = Some(pid);
        while let Some(pid) = next.filter(|&pid| pid > 0 && generations.len() < GENERATIONS) {
            let Some(args) = cmdline(pid) else { break };
            generations.push(Generation { pid, args });
            next = parent(pid).filter(|&parent| parent > 1 && parent != pid);
        }
        Self(generations)
    }

    /// Every generation, the process first.
    pub fn iter(&self) -> std::slice::Iter<'_, Generation> {
        self.0.iter()
    }
}

/// The process `root` and every process descending from it now, each with
/// its command line, by pid (`/proc` scanned once: each process's parent,
/// then the command lines of `root`'s family only). Blocking, as
/// [`Lineage::read`].
pub fn descendants(root: u32) -> Vec<Generation> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    let parents: Vec<(u32, u32)> = dir
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, parent(pid)?)))
        .collect();
    let mut family = vec![root];
    let mut found: Vec<Generation> = cmdline(root).map(|args| Generation { pid: root, args }).into_iter().collect();
    while let Some(parent_pid) = family.pop() {
        for &(pid, _) in parents.iter().filter(|&&(pid, parent)| parent == parent_pid && pid != root) {
            family.push(pid);
            if let Some(args) = cmdline(pid) {
                found.push(Generation { pid, args });
            }
        }
    }
    found.sort_by_key(|generation| generation.pid);
    found
}

fn cmdline(pid: u32) -> Option<Vec<String>> {
    let file = File::open(format!("/proc/{pid}/cmdline")).ok()?;
    let mut raw = Vec::new();
    file.take(MAX_CMDLINE).read_to_end(&mut raw).ok()?;
    Some(split_cmdline(&raw))
}

/// A `/proc/PID/cmdline`'s arguments: NUL-separated, the last NUL optional.
/// A retitled process may have one argument with spaces in it, padded
/// with spaces or NULs to the length of the command line it replaced
/// (setproctitle): the padding is not part of it.
pub fn split_cmdline(raw: &[u8]) -> Vec<String> {
    let end = raw.iter().rposition(|&b| b != 0 && !b.is_ascii_whitespace()).map_or(0, |last| last + 1);
    let raw = &raw[..end];
    if raw.is_empty() {
        return Vec::new();
    }
    raw.split(|&b| b == 0).map(|arg| String::from_utf8_lossy(arg).into_owned()).collect()
}

/// The parent's pid, from `/proc/PID/stat` (field 4, after the command
/// name in parentheses, which may itself hold spaces and parentheses).
/// Parsed here rather than by procfs's `Stat`, which parses all 52
/// fields: [`descendants`] reads every process's, and procfs's parse
/// took 4-5 us a line against 0.2 us for this one field.
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parent_of_stat(&stat)
}

fn parent_of_stat(stat: &str) -> Option<u32> {
    let (_, after) = stat.rsplit_once(')')?;
    after.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_line_splits_at_its_nuls_and_a_retitled_one_is_one_argument() {
        assert_eq!(split_cmdline(b"vllm\0serve\0/m\0"), ["vllm", "serve", "/m"]);
        assert_eq!(split_cmdline(b"VLLM::EngineCore"), ["VLLM::EngineCore"]);
        assert_eq!(split_cmdline(b"VLLM::Worker      \0\0"), ["VLLM::Worker"]);
        assert_eq!(split_cmdline(b"python\0\0x\0"), ["python", "", "x"]);
        assert!(split_cmdline(b"").is_empty());
    }

    #[test]
    fn the_parent_is_read_past_a_command_name_with_spaces_and_parentheses() {
        assert_eq!(parent_of_stat("42 (a) b) S 7 42 42 0 -1"), Some(7));
        assert_eq!(parent_of_stat("42 (VLLM::Worker_TP0) R 41 1 1"), Some(41));
        assert_eq!(parent_of_stat("garbage"), None);
    }

    #[test]
    fn a_child_is_among_its_parents_descendants() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let found = descendants(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        let sleep = found.iter().find(|g| g.pid == child.id()).expect("the child");
        assert_eq!(sleep.args, ["sleep", "30"]);
        assert!(found.iter().any(|g| g.pid == std::process::id()), "the root itself");
    }

    #[test]
    fn this_process_lineage_starts_with_itself_and_names_its_parent() {
        let lineage = Lineage::read(std::process::id());
        let first = lineage.iter().next().expect("this process");
        assert_eq!(first.pid, std::process::id());
        assert!(!first.args.is_empty());
        let parent = lineage.iter().nth(1).map(|g| g.pid);
        assert_eq!(parent, Some(std::os::unix::process::parent_id()).filter(|&p| p > 1));
    }
}
