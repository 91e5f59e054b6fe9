//! Pinned contexts: what a framework knew of a request it made beyond
//! what `INFLIGHT` has (an SGLang room's destinations, answers and
//! handles), kept in `CONTEXT` so the next agent takes the request over
//! knowing what it waits on. The value is `stallwatch_common::HeldContext`.
use std::collections::HashMap;

use anyhow::{Context as _, Result, anyhow};
use stallwatch_common::{CONTEXT_BYTES, HeldContext, RequestKey};

use super::{KernelState, Tables};

impl<T: Tables> KernelState<T> {
    /// Pin in `CONTEXT` what the agent knows of a request it made itself
    /// beyond what `INFLIGHT` has of it (`context`, as its framework
    /// serialises it, at most [`CONTEXT_BYTES`]), for the next agent;
    /// `None` drops it (the request ended). A write that fails (a full
    /// table, a context too large) is counted and warned about
    /// ([`Self::warn`]); only a restart would miss it, and the next write
    /// of the request's context replaces it.
    pub fn pin_context(&mut self, pid: u32, key: u64, context: Option<&[u8]>) {
        let id = RequestKey { key, pid, _pad: 0 };
        let result = match context {
            Some(bytes) => pinned(bytes).and_then(|pinned| self.tables.put_context(&id, &pinned)),
            None => self.tables.forget_context(&id),
        };
        if let Err(err) = result {
            // What is there is no longer true: better nothing.
            let _ = self.tables.forget_context(&id);
            self.unpinned.note(format!("pid {pid} key {key:#x}: {err:#}"));
        }
    }

    /// Every context a previous agent pinned ([`Self::pin_context`]), by
    /// (pid, key). Entries that vanish while being read are skipped.
    pub fn pinned_contexts(&self) -> Result<HashMap<(u32, u64), Vec<u8>>> {
        let mut contexts = HashMap::new();
        for key in self.tables.context_keys()? {
            if let Some(pinned) = self.tables.context(&key)? {
                let len = usize::from(pinned.len).min(CONTEXT_BYTES);
                contexts.insert((key.pid, key.key), pinned.bytes[..len].to_vec());
            }
        }
        Ok(contexts)
    }
}

/// `bytes` as a `CONTEXT` value; an error if they do not fit.
fn pinned(bytes: &[u8]) -> Result<HeldContext> {
    let mut pinned = HeldContext { len: 0, _pad: [0; 6], bytes: [0; CONTEXT_BYTES] };
    pinned
        .bytes
        .get_mut(..bytes.len())
        .ok_or_else(|| anyhow!("a context of {} bytes, more than the {CONTEXT_BYTES} pinned", bytes.len()))?
        .copy_from_slice(bytes);
    pinned.len = u16::try_from(bytes.len()).context("a context's length")?;
    Ok(pinned)
}
