//! Everything an attach reads from a process's files, read before the
//! attach: which mapped object each probe of a profile names, where its
//! function lies in that object, and the build of the profile's `[layout]`
//! library.
//!
//! The files are the watched process's, so a hostile tenant controls what
//! reading them costs (a library on a filesystem that never answers, say).
//! A [`Plan`] is therefore made by [`Plan::read`] on a thread of its own,
//! under a deadline ([`Plan::read_within`]): the event loop waits on it
//! without blocking, a signal still stops the agent, and a process whose
//! files do not answer is refused while every other one is watched. The
//! attach itself ([`crate::kernel::Probes::attach`]) then only asks the
//! kernel.
use std::{collections::HashMap, path::PathBuf, time::Duration};

use anyhow::{Result, anyhow, bail};

use super::{
    Profile,
    resolve::{ElfFile, MappedObject, ProcessImage, ResolvedSymbol},
};
use crate::util::lineage::Lineage;

/// How long reading one process's objects may take before the process is
/// refused. Reading the symbol tables of a large library (libtorch_cpu's
/// run to tens of megabytes) takes well under a second here; five allow
/// for a loaded host.
pub const READ_DEADLINE: Duration = Duration::from_secs(5);

/// A probe's function, found in a process.
#[derive(Debug, Clone)]
pub struct Found {
    pub object: MappedObject,
    pub symbol: ResolvedSymbol,
}

/// Why a probe's function was not found. The messages name no profile
/// line: several probes may share a target, and each says its own.
#[derive(Debug, Clone)]
pub enum Missing {
    /// The object is not mapped: the probe is skipped when it is optional.
    NotMapped(String),
    /// The object has no such function: likewise.
    NoSymbol(String),
    /// The object is mapped but could not be read: the process is refused.
    Unreadable(String),
}

impl Missing {
    pub fn message(&self) -> &str {
        match self {
            Self::NotMapped(why) | Self::NoSymbol(why) | Self::Unreadable(why) => why,
        }
    }
}

/// What [`Plan::read`] found in one process for one profile.
#[derive(Debug)]
pub struct Plan {
    pub image: ProcessImage,
    /// By (object as the profile names it, symbol).
    targets: HashMap<(Option<String>, String), Result<Found, Missing>>,
    /// The profile's `[layout]` library as mapped, and its GNU build id
    /// (`Ok(None)`: it has none); `None` when the process does not map it.
    pub layout_build: Option<(PathBuf, Result<Option<String>, String>)>,
    /// Its command line and its ancestors': what a framework learns of
    /// its configuration (see [`crate::frameworks::Framework::attached`]).
    pub lineage: Lineage,
}

impl Plan {
    /// Read what attaching `profile` to `pid` needs (blocking: see
    /// [`Self::read_within`]).
    pub fn read(pid: u32, profile: &Profile, trust: Trust) -> Result<Self> {
        let image = ProcessImage::read(pid)?;
        let mut files = Files { trust, opened: HashMap::new() };
        let wanted = profile
            .probes
            .iter()
            .map(|p| (&p.object, &p.symbol))
            .chain(profile.signals.iter().map(|s| (&s.object, &s.symbol)))
            .chain(profile.activity.iter().map(|a| (&a.object, &a.symbol)));
        let mut targets = HashMap::new();
        for (object, symbol) in wanted {
            let key = (object.clone(), symbol.clone());
            if targets.contains_key(&key) {
                continue;
            }
            let found = match image.find(object.as_deref()) {
                Err(err) => Err(Missing::NotMapped(format!("{err:#}"))),
                Ok(mapped) => match open(&mut files, &mapped) {
                    Err(err) => Err(Missing::Unreadable(err)),
                    Ok(elf) => elf
                        .resolve(symbol)
                        .map(|symbol| Found { object: mapped, symbol })
                        .map_err(|err| Missing::NoSymbol(format!("{err:#}"))),
                },
            };
            targets.insert(key, found);
        }
        let layout_build = profile.layout.as_ref().and_then(|layout| {
            let mapped = image.find(Some(&layout.object)).ok()?;
            let build = open(&mut files, &mapped).and_then(|elf| elf.build_id().map_err(|err| format!("{err:#}")));
            Some((mapped.path, build))
        });
        Ok(Self { image, targets, layout_build, lineage: Lineage::read(pid) })
    }

    /// [`Self::read`] on a thread of its own, given up after `deadline`
    /// (the thread is left to finish or hang on its own: nothing waits for
    /// it, and it holds nothing of the agent's).
    pub async fn read_within(pid: u32, profile: Profile, trust: Trust, deadline: Duration) -> Result<Self> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name(format!("stallwatch-read-{pid}"))
            .spawn(move || {
                let _ = tx.send(Self::read(pid, &profile, trust));
            })
            .map_err(|err| anyhow!("starting the thread that reads pid {pid}'s objects: {err}"))?;
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(plan)) => plan,
            Ok(Err(_)) => bail!("reading pid {pid}'s mapped objects failed: the reading thread ended without a word"),
            Err(_) => bail!(
                "reading its mapped objects took longer than {deadline:?} (a library on a filesystem that does not \
                 answer?); the agent goes on with the other processes"
            ),
        }
    }

    /// Where the profile's probe on `symbol` in `object` goes.
    pub fn target(&self, object: Option<&str>, symbol: &str) -> Result<Found, Missing> {
        match self.targets.get(&(object.map(str::to_owned), symbol.to_owned())) {
            Some(found) => found.clone(),
            None => Err(Missing::Unreadable(format!(
                "`{symbol}` was not read from pid {}'s objects (a plan made for another profile)",
                self.image.pid
            ))),
        }
    }
}

/// Where each probe of `profile` would land in process `pid`, and what the
/// kernel does with the instruction there (`stallwatch profile check
/// --pid`): every lifecycle probe, signal and transport probe, in profile
/// order, as (profile line, symbol, object, where or why not). Read as
/// `run` reads it ([`Plan::read`]), FUSE objects included: an operator's
/// check of a process they name.
pub fn probe_points(profile: &Profile, pid: u32) -> Result<Vec<ProbePoint>> {
    let plan = Plan::read(pid, profile, Trust { fuse: true })?;
    let targets = profile
        .probes
        .iter()
        .map(|p| (p.line, &p.symbol, &p.object))
        .chain(profile.signals.iter().map(|s| (s.line, &s.symbol, &s.object)))
        .chain(profile.activity.iter().map(|a| (a.line, &a.symbol, &a.object)));
    Ok(targets
        .map(|(line, symbol, object)| {
            let found = plan
                .target(object.as_deref(), symbol)
                .map(|found| (found.object.path, found.symbol))
                .map_err(|missing| missing.message().to_owned());
            ProbePoint { line, symbol: symbol.clone(), object: object.clone(), found }
        })
        .collect())
}

/// One probe of a profile, resolved in a process (see [`probe_points`]).
#[derive(Debug)]
pub struct ProbePoint {
    pub line: usize,
    pub symbol: String,
    pub object: Option<String>,
    /// The mapped file and where in it, or why it was not found.
    pub found: Result<(PathBuf, ResolvedSymbol), String>,
}

/// Which objects the agent reads besides those on the host's own
/// filesystems (`--trust-fuse`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Trust {
    /// Objects on FUSE filesystems ([`MappedObject::on_fuse`]).
    pub fuse: bool,
}

/// The objects a plan opened, each once, by the path they were opened at.
struct Files {
    trust: Trust,
    opened: HashMap<PathBuf, Result<ElfFile, String>>,
}

fn open<'a>(files: &'a mut Files, object: &MappedObject) -> Result<&'a ElfFile, String> {
    let trust = files.trust;
    files
        .opened
        .entry(object.host_path.clone())
        .or_insert_with(|| {
            if object.on_fuse() && !trust.fuse {
                return Err(format!(
                    "{} is on a FUSE filesystem ({}), not read: its server, which a tenant can run, could hold a \
                     read of it, or the kernel's uprobe attach, forever, and no signal ends such a wait; to watch \
                     processes whose libraries are on a FUSE filesystem you trust (a lazy-pulling image \
                     snapshotter), run with --trust-fuse",
                    object.path.display(),
                    object.filesystem.as_deref().unwrap_or("fuse")
                ));
            }
            ElfFile::open(&object.host_path).map_err(|err| format!("{err:#}"))
        })
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_finds_a_profiles_functions_and_says_which_are_missing() {
        // This test binary maps libc: a profile on one of its functions and
        // on one it lacks.
        let profile = Profile::parse(
            "name = \"t\"\n[[probe]]\nobject = \"libc.so\"\nsymbol = \"getpid\"\nat = \"entry\"\n\
             event = \"enqueued\"\nkey = { from = \"arg0\" }\n\
             [[probe]]\nobject = \"libc.so\"\nsymbol = \"no_such_function_here\"\nat = \"entry\"\n\
             event = \"released\"\nkey = { from = \"arg0\" }\n",
            "test",
        )
        .expect("profile");
        let plan = Plan::read(std::process::id(), &profile, Trust::default()).expect("read");
        let found = plan.target(Some("libc.so"), "getpid").expect("getpid found");
        assert!(found.object.path.to_string_lossy().contains("libc.so"));
        assert!(matches!(plan.target(Some("libc.so"), "no_such_function_here"), Err(Missing::NoSymbol(_))));
        assert!(matches!(plan.target(None, "elsewhere"), Err(Missing::Unreadable(_))));
    }
}
