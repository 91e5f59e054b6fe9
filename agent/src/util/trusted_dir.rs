//! Directories no other user can take over: the bpf directory
//! (`--bpf-dir`) and the query socket's directory.
//!
//! The agent pins its probes and in-flight state, and serves its socket, by
//! path. A path is only as safe as every directory on it: a user who owns
//! one, can write to one, or put a symlink on the way, can rename root's
//! pinned state away or put their own socket in its place. bpffs is often
//! mounted 1777 like /tmp, so anyone may pre-create `/sys/fs/bpf/stallwatch`.
//!
//! So before using such a path the agent walks it from `/`, one component
//! at a time, each opened relative to the one before with `O_NOFOLLOW` (no
//! symlink is followed, and none can be swapped in between checking a
//! component and using it), and checks each one:
//! - a directory on the way is owned by root (or the agent's own euid), and
//!   nobody else can write to it unless it is sticky (`/tmp`,
//!   `/sys/fs/bpf`), where others cannot rename or remove what root owns;
//! - the directory itself (and each one the agent makes inside it) is
//!   owned by root (or the euid) and nobody else can write to it, sticky
//!   or not: a shared directory lets another user pre-create the names the
//!   agent uses.
//!
//! What is missing is created 0700 on the way. Once the whole path has
//! passed, nobody but root can change what it names, so the agent may go
//! on using the path itself (aya pins by path, a socket binds to one).
use std::{
    ffi::{CStr, CString, OsStr, OsString},
    fmt,
    fs::File,
    io,
    os::{
        fd::{AsFd, BorrowedFd, OwnedFd},
        unix::ffi::{OsStrExt as _, OsStringExt as _},
    },
    path::{Component, Path, PathBuf},
};

use anyhow::{Context as _, Result};
use rustix::{
    fs::{AtFlags, FileType, Mode, OFlags, Stat},
    io::Errno,
};
use tracing::debug;

/// Mode of every directory the walk creates (0700).
const CREATED_MODE: Mode = Mode::RWXU;

/// A directory the whole path to which has passed the checks, held open
/// (an `O_PATH` descriptor: it needs no read permission, only the walk's
/// search permission on the way).
#[derive(Debug)]
pub struct TrustedDir {
    /// Absolute, without `.` or `..`: the path that was checked.
    path: PathBuf,
    fd: OwnedFd,
}

/// Why a directory on a path is refused, and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Untrusted {
    /// The offending component.
    pub path: PathBuf,
    pub reason: String,
    pub fix: String,
}

impl fmt::Display for Untrusted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}; fix: {}", self.reason, self.fix)
    }
}

impl std::error::Error for Untrusted {}

/// What a component is to the walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A directory on the way to the agent's.
    Ancestor,
    /// The agent's own directory, or one it keeps inside it.
    Own,
}

/// What the walk does with a missing component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Missing {
    Create,
    Stop,
}

impl TrustedDir {
    /// Open `path`, creating (0700) each missing directory on the way.
    pub fn create(path: &Path) -> Result<Self> {
        walk(path, Missing::Create)?.with_context(|| format!("{} vanished while it was being created", path.display()))
    }

    /// Open `path` if it exists (`None` if a component is missing); the
    /// same checks, nothing created.
    pub fn open(path: &Path) -> Result<Option<Self>> {
        walk(path, Missing::Stop)
    }

    /// The directory `name` inside this one (created 0700 if missing),
    /// held to the rules of the agent's own directory.
    pub fn create_child(&self, name: &str) -> Result<Self> {
        let path = self.path.join(name);
        let fd = step(self.fd.as_fd(), OsStr::new(name), &path, Role::Own, Missing::Create)?
            .with_context(|| format!("{} vanished while it was being created", path.display()))?;
        Ok(Self { path, fd })
    }

    /// The path that was checked: absolute, without `.` or `..`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `statfs(2)` type of the filesystem the directory is on.
    pub fn fs_type(&self) -> Result<i64> {
        let stat = rustix::fs::fstatfs(&self.fd).with_context(|| format!("statfs of {}", self.path.display()))?;
        Ok(stat.f_type as i64)
    }

    /// The directory opened for reading (to list it, or `flock` it).
    pub fn reopen(&self) -> Result<File> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&self.fd, c".", flags, Mode::empty())
            .with_context(|| format!("opening {}", self.path.display()))?;
        Ok(File::from(fd))
    }
}

impl AsFd for TrustedDir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn walk(path: &Path, missing: Missing) -> Result<Option<TrustedDir>> {
    let names = components(path)?;
    let mut checked = PathBuf::from("/");
    let root = openat_path(rustix::fs::CWD, c"/").context("opening /")?;
    judge(&checked, &fstat(root.as_fd(), &checked)?, if names.is_empty() { Role::Own } else { Role::Ancestor })?;
    let mut dir = root;
    for (i, name) in names.iter().enumerate() {
        checked.push(name);
        let role = if i + 1 == names.len() { Role::Own } else { Role::Ancestor };
        match step(dir.as_fd(), name, &checked, role, missing)? {
            Some(next) => dir = next,
            None => return Ok(None),
        }
    }
    Ok(Some(TrustedDir { path: checked, fd: dir }))
}

/// The names from `/` to `path` (made absolute from the working
/// directory, whose path the kernel gives without symlinks). `..` is taken
/// lexically, which is right here: no component the walk accepts is a
/// symlink.
fn components(path: &Path) -> Result<Vec<OsString>> {
    let absolute = std::path::absolute(path).with_context(|| format!("making {} absolute", path.display()))?;
    let mut names = Vec::new();
    for component in absolute.components() {
        match component {
            Component::Normal(name) => names.push(name.to_owned()),
            Component::ParentDir => {
                names.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(names)
}

/// Open `name` in `parent` without following a symlink, creating it if
/// missing and asked to, and check it. `None`: missing, not created.
fn step(parent: BorrowedFd<'_>, name: &OsStr, path: &Path, role: Role, missing: Missing) -> Result<Option<OwnedFd>> {
    let c_name = CString::new(name.as_bytes()).with_context(|| format!("{} has a NUL byte", path.display()))?;
    let fd = match openat_path(parent, &c_name) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => {
            if missing == Missing::Stop {
                return Ok(None);
            }
            match rustix::fs::mkdirat(parent, c_name.as_c_str(), CREATED_MODE) {
                Ok(()) => debug!(path = %path.display(), "created (mode 0700)"),
                // Made meanwhile by someone else: judged below like any other.
                Err(Errno::EXIST) => {}
                Err(err) => return Err(io::Error::from(err)).with_context(|| format!("creating {}", path.display())),
            }
            openat_path(parent, &c_name).map_err(|err| unopened(parent, &c_name, path, role, err))?
        }
        Err(err) => return Err(unopened(parent, &c_name, path, role, err)),
    };
    judge(path, &fstat(fd.as_fd(), path)?, role)?;
    Ok(Some(fd))
}

/// The error for a component `O_DIRECTORY | O_NOFOLLOW` would not open: a
/// symlink is refused with where it points, anything else said as it is.
fn unopened(parent: BorrowedFd<'_>, name: &CStr, path: &Path, role: Role, err: Errno) -> anyhow::Error {
    if !matches!(err, Errno::LOOP | Errno::NOTDIR) {
        return anyhow::Error::new(io::Error::from(err)).context(format!("opening {}", path.display()));
    }
    let stated = rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW);
    if stated.is_ok_and(|stat| FileType::from_raw_mode(stat.st_mode) == FileType::Symlink) {
        let target = rustix::fs::readlinkat(parent, name, Vec::new()).map_or_else(
            |_| "?".to_owned(),
            |target| Path::new(&OsString::from_vec(target.into_bytes())).display().to_string(),
        );
        let shown = path.display();
        let fix = match role {
            Role::Ancestor => format!("give the path without symlinks (the real directory {shown} points to)"),
            Role::Own => format!(
                "give the real directory's path, or remove the link ({shown}) and let stallwatch create the directory"
            ),
        };
        return Untrusted {
            path: path.to_owned(),
            reason: format!(
                "{shown} is a symbolic link (to {target}): stallwatch follows no symlink to its directories, as the \
                 link's owner or anyone who can replace it could point it elsewhere"
            ),
            fix,
        }
        .into();
    }
    anyhow::anyhow!("{} is not a directory: remove it, or give another path", path.display())
}

/// Refuse a component another user could change (see the module's doc).
fn judge(path: &Path, stat: &Stat, role: Role) -> Result<(), Untrusted> {
    let euid = rustix::process::geteuid().as_raw();
    let mode = stat.st_mode & 0o7777;
    let shown = path.display();
    let others_write = mode & 0o022 != 0;
    let sticky = mode & Mode::SVTX.bits() != 0;
    let untrusted = |reason: String, fix: String| Err(Untrusted { path: path.to_owned(), reason, fix });
    let own_fix = || format!("`chown root {shown} && chmod 700 {shown}`, or remove it and let stallwatch create it");
    if stat.st_uid != 0 && stat.st_uid != euid {
        let reason = format!(
            "{shown} is owned by uid {} (mode {mode:04o}), not by root: its owner could rename or replace what \
             stallwatch keeps {}",
            stat.st_uid,
            if role == Role::Own { "there" } else { "below it" }
        );
        return match role {
            Role::Own => untrusted(reason, own_fix()),
            Role::Ancestor => {
                untrusted(reason, format!("`chown root {shown}`, or give a path whose every directory is root's"))
            }
        };
    }
    match role {
        Role::Ancestor if others_write && !sticky => untrusted(
            format!(
                "{shown} (mode {mode:04o}) is writable by its group or by anyone, and not sticky: another user \
                 could rename what stallwatch keeps below it"
            ),
            format!(
                "`chmod go-w {shown}` (or `chmod +t {shown}` for a shared directory like /tmp), or give another path"
            ),
        ),
        Role::Own if others_write => untrusted(
            format!(
                "{shown} (mode {mode:04o}) is writable by its group or by anyone: another user could put their own \
                 files in place of what stallwatch keeps there"
            ),
            // A shared directory (/tmp) stays shared: use one of its own.
            if sticky {
                format!("give a directory of its own below {shown} (stallwatch creates it, mode 0700)")
            } else {
                own_fix()
            },
        ),
        Role::Ancestor | Role::Own => Ok(()),
    }
}

/// `openat(parent, name, O_PATH | O_DIRECTORY | O_NOFOLLOW)`; `parent`
/// is [`rustix::fs::CWD`] only with an absolute name.
fn openat_path(parent: BorrowedFd<'_>, name: &CStr) -> rustix::io::Result<OwnedFd> {
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    rustix::fs::openat(parent, name, flags, Mode::empty())
}

fn fstat(fd: BorrowedFd<'_>, path: &Path) -> Result<Stat> {
    rustix::fs::fstat(fd)
        .map_err(io::Error::from)
        .with_context(|| format!("reading the owner and mode of {}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};

    use super::*;

    /// uid and gid of `nobody`: another local user.
    const NOBODY: u32 = 65534;

    fn chmod(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    fn chown_nobody(path: &Path) {
        std::os::unix::fs::chown(path, Some(NOBODY), Some(NOBODY))
            .unwrap_or_else(|err| panic!("chown {} to nobody: {err} (these tests need root)", path.display()));
    }

    fn refusal(result: Result<impl fmt::Debug>) -> Untrusted {
        let err = result.expect_err("refused");
        err.downcast_ref::<Untrusted>().unwrap_or_else(|| panic!("not a refusal: {err:#}")).clone()
    }

    /// A root-owned 0700 temp dir (tempfile's), and `sub` under it.
    fn temp() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("temp dir");
        let sub = dir.path().join("sub");
        (dir, sub)
    }

    #[test]
    fn missing_directories_are_created_0700_and_the_path_is_made_plain() {
        let (dir, sub) = temp();
        let deep = sub.join("a/b");
        let opened = TrustedDir::create(&dir.path().join("sub/./x/../a/b")).expect("created");
        assert_eq!(opened.path(), deep);
        for path in [&sub, &sub.join("a"), &deep] {
            let meta = std::fs::symlink_metadata(path).expect("made");
            assert!(meta.is_dir(), "{}", path.display());
            assert_eq!(
                (meta.mode() & 0o7777, meta.uid()),
                (0o700, rustix::process::geteuid().as_raw()),
                "{}",
                path.display()
            );
        }
        // Again: all there, all fine.
        TrustedDir::create(&deep).expect("opened");
        let child = opened.create_child("maps").expect("child");
        assert_eq!(std::fs::symlink_metadata(child.path()).expect("child").mode() & 0o7777, 0o700);
        opened.reopen().expect("readable");
    }

    #[test]
    fn a_relative_path_is_taken_from_the_working_directory() {
        let cwd = std::env::current_dir().expect("cwd");
        let mut expected: Vec<OsString> = cwd.components().skip(1).map(|c| c.as_os_str().to_owned()).collect();
        expected.push("b".into());
        assert_eq!(components(Path::new("./a/../b")).expect("absolute"), expected);
        assert_eq!(components(Path::new("/../x/./y/..")).expect("absolute"), [OsString::from("x")]);
    }

    #[test]
    fn open_creates_nothing() {
        let (_dir, sub) = temp();
        assert!(TrustedDir::open(&sub.join("a")).expect("checked").is_none());
        assert!(!sub.exists());
    }

    #[test]
    fn its_own_directory_must_be_writable_by_nobody_else_sticky_or_not() {
        let (_dir, sub) = temp();
        std::fs::create_dir(&sub).expect("mkdir");
        for mode in [0o700, 0o755, 0o750, 0o1755] {
            chmod(&sub, mode);
            TrustedDir::create(&sub).unwrap_or_else(|err| panic!("{mode:o}: {err:#}"));
        }
        for mode in [0o770, 0o707, 0o777, 0o720, 0o1777] {
            chmod(&sub, mode);
            let refused = refusal(TrustedDir::create(&sub));
            assert_eq!(refused.path, sub);
            assert!(
                refused.reason.contains(&format!("(mode {mode:04o}) is writable by its group or by anyone")),
                "{refused}"
            );
            let fix = if mode == 0o1777 {
                format!("a directory of its own below {}", sub.display())
            } else {
                format!("chmod 700 {}", sub.display())
            };
            assert!(refused.fix.contains(&fix), "{refused}");
        }
        // A directory it keeps inside is held to the same rules.
        chmod(&sub, 0o700);
        std::fs::create_dir(sub.join("v1")).expect("mkdir");
        chmod(&sub.join("v1"), 0o777);
        let parent = TrustedDir::create(&sub).expect("parent");
        assert_eq!(refusal(parent.create_child("v1")).path, sub.join("v1"));
    }

    #[test]
    fn a_directory_on_the_way_may_be_shared_only_if_sticky() {
        let (_dir, sub) = temp();
        let own = sub.join("own");
        std::fs::create_dir_all(&own).expect("mkdir");
        for mode in [0o755, 0o1777, 0o1770] {
            chmod(&sub, mode);
            TrustedDir::create(&own).unwrap_or_else(|err| panic!("{mode:o}: {err:#}"));
        }
        for mode in [0o777, 0o775] {
            chmod(&sub, mode);
            let refused = refusal(TrustedDir::create(&own));
            assert_eq!(refused.path, sub, "the ancestor is named");
            assert!(refused.reason.contains("and not sticky"), "{refused}");
            assert!(refused.fix.contains(&format!("chmod go-w {}", sub.display())), "{refused}");
        }
    }

    #[test]
    fn a_directory_of_another_user_is_refused_on_the_way_or_at_the_end() {
        let (_dir, sub) = temp();
        let own = sub.join("own");
        std::fs::create_dir_all(&own).expect("mkdir");
        chown_nobody(&own);
        let refused = refusal(TrustedDir::create(&own));
        assert_eq!(refused.path, own);
        assert!(refused.reason.contains("is owned by uid 65534 (mode 0755), not by root"), "{refused}");
        assert!(refused.fix.contains("or remove it and let stallwatch create it"), "{refused}");
        chown_nobody(&sub);
        let refused = refusal(TrustedDir::open(&own.join("missing")));
        assert_eq!(refused.path, sub, "the first offending component is named");
        assert!(refused.fix.contains(&format!("chown root {}", sub.display())), "{refused}");
        // Even a sticky one: its owner may rename anything in it.
        chmod(&sub, 0o1777);
        assert_eq!(refusal(TrustedDir::create(&own)).path, sub);
    }

    #[test]
    fn no_symlink_is_followed_and_nothing_is_made_behind_one() {
        let (dir, sub) = temp();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).expect("mkdir");
        std::os::unix::fs::symlink(&real, &sub).expect("symlink");
        let refused = refusal(TrustedDir::create(&sub));
        assert_eq!(refused.path, sub);
        assert!(refused.reason.contains(&format!("is a symbolic link (to {})", real.display())), "{refused}");
        assert!(refused.fix.contains("remove the link"), "{refused}");
        let refused = refusal(TrustedDir::create(&sub.join("state/deeper")));
        assert_eq!(refused.path, sub, "the link on the way is named");
        assert!(refused.fix.contains("without symlinks"), "{refused}");
        assert_eq!(std::fs::read_dir(&real).expect("list").count(), 0, "nothing made behind the link");
        // A dangling one too.
        std::fs::remove_dir(&real).expect("rmdir");
        assert_eq!(refusal(TrustedDir::create(&sub)).path, sub);
        assert!(!real.exists());
    }

    #[test]
    fn a_file_in_the_way_is_said_to_be_one() {
        let (_dir, sub) = temp();
        std::fs::write(&sub, "").expect("file");
        let err = TrustedDir::create(&sub.join("x")).expect_err("a file");
        assert!(err.downcast_ref::<Untrusted>().is_none());
        assert!(format!("{err:#}").contains(&format!("{} is not a directory", sub.display())), "{err:#}");
    }
}
