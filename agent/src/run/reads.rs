//! Processes whose mapped objects are being read before they are watched.
//!
//! Each read runs on a thread of its own under [`READ_DEADLINE`]
//! ([`Plan::read_within`]), so the event loop never waits on a watched
//! process's files: a library on a filesystem that does not answer costs
//! that process its watch, not the agent its loop, its signals or the
//! other processes.
use std::{collections::HashMap, os::fd::OwnedFd};

use anyhow::{Context as _, Result, anyhow};
use tokio::{io::unix::AsyncFd, task::JoinSet};

use super::{processes::pidfd, rules::ProfileId};
use crate::profile::{
    Profile,
    plan::{Plan, READ_DEADLINE, Trust},
};

/// A process read: what to attach, with which profile, and its pidfd,
/// opened before the read began (a pid reused meanwhile is then not
/// mistaken for it).
pub struct Read {
    pub pid: u32,
    pub profile: ProfileId,
    pub plan: Result<(Plan, AsyncFd<OwnedFd>)>,
}

/// The reads under way, each pid once.
pub struct Reads {
    /// Which objects may be read ([`Plan::read`]).
    trust: Trust,
    under_way: JoinSet<(u32, Result<Plan>)>,
    /// Their pids and profiles by task, and their pidfds by pid (an
    /// `AsyncFd` is registered with this thread's reactor, so it stays here
    /// rather than travel with the read).
    tasks: HashMap<tokio::task::Id, (u32, ProfileId)>,
    pidfds: HashMap<u32, AsyncFd<OwnedFd>>,
}

impl Reads {
    pub fn new(trust: Trust) -> Self {
        Self { trust, under_way: JoinSet::new(), tasks: HashMap::new(), pidfds: HashMap::new() }
    }

    /// Begin reading `pid`'s objects for `profile` (profile `id`);
    /// nothing if a read of it is under way already. A pid that is gone
    /// already is a read that failed.
    pub fn start(&mut self, pid: u32, id: ProfileId, profile: &Profile) -> Result<()> {
        if self.pidfds.contains_key(&pid) {
            return Ok(());
        }
        self.pidfds.insert(pid, pidfd(pid)?);
        let (profile, trust) = (profile.clone(), self.trust);
        let task =
            self.under_way.spawn(async move { (pid, Plan::read_within(pid, profile, trust, READ_DEADLINE).await) });
        self.tasks.insert(task.id(), (pid, id));
        Ok(())
    }

    /// The next read done; never resolves while none is under way.
    pub async fn next(&mut self) -> Read {
        let Some(joined) = self.under_way.join_next_with_id().await else {
            return std::future::pending().await;
        };
        let (id, result) = match joined {
            Ok((id, (_, plan))) => (id, plan),
            Err(err) => (err.id(), Err(anyhow!("the task reading the process's objects ended: {err}"))),
        };
        let (pid, profile) = self.tasks.remove(&id).unwrap_or((0, ProfileId(0)));
        let exited = self.pidfds.remove(&pid);
        let plan = result.and_then(|plan| Ok((plan, exited.context("its pidfd went missing")?)));
        Read { pid, profile, plan }
    }

    /// Whether a read is under way.
    pub fn is_empty(&self) -> bool {
        self.pidfds.is_empty()
    }
}
