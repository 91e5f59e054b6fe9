//! The three kernel tables a [`super::KernelState`] keeps in step with
//! the reports, behind [`Tables`] so the tests can model what the eBPF
//! programs do with them.
use anyhow::{Context as _, Result, anyhow};
use aya::maps::{HashMap as BpfHashMap, MapData, MapError};
use stallwatch_common::{HeldContext, InflightEntry, RequestKey};

/// The three kernel tables [`super::KernelState`] keeps in step with the reports:
/// the pinned BPF maps ([`BpfTables`]), or, in the tests, a model of what
/// the eBPF programs do with them.
pub trait Tables {
    fn inflight_keys(&self) -> Result<Vec<RequestKey>>;
    /// `None`: no entry (it may have just ended).
    fn inflight(&self, key: &RequestKey) -> Result<Option<InflightEntry>>;
    /// Remove an entry; already gone is fine.
    fn forget_inflight(&mut self, key: &RequestKey) -> Result<()>;
    /// Write an entry (create or replace); a full table is an error.
    fn put_inflight(&mut self, key: &RequestKey, entry: &InflightEntry) -> Result<()>;
    fn alerted_keys(&self) -> Result<Vec<RequestKey>>;
    fn alerted(&self, key: &RequestKey) -> Result<Option<u64>>;
    /// Mark the silence that ended at `last_ns` as reported.
    fn mark(&mut self, key: &RequestKey, last_ns: u64) -> Result<()>;
    /// Remove a mark; already gone is fine.
    fn forget_alerted(&mut self, key: &RequestKey) -> Result<()>;
    fn context_keys(&self) -> Result<Vec<RequestKey>>;
    fn context(&self, key: &RequestKey) -> Result<Option<HeldContext>>;
    /// Write a request's context (create or replace); a full table is an error.
    fn put_context(&mut self, key: &RequestKey, context: &HeldContext) -> Result<()>;
    /// Remove a context; already gone is fine.
    fn forget_context(&mut self, key: &RequestKey) -> Result<()>;
}

/// The pinned `INFLIGHT`, `ALERTED` and `CONTEXT` maps.
pub struct BpfTables {
    inflight: BpfHashMap<MapData, RequestKey, InflightEntry>,
    alerted: BpfHashMap<MapData, RequestKey, u64>,
    context: BpfHashMap<MapData, RequestKey, HeldContext>,
}

impl BpfTables {
    pub fn new(inflight: MapData, alerted: MapData, context: MapData) -> Result<Self> {
        Ok(Self {
            inflight: BpfHashMap::try_from(aya::maps::Map::HashMap(inflight)).context("INFLIGHT is not a hash map")?,
            alerted: BpfHashMap::try_from(aya::maps::Map::HashMap(alerted)).context("ALERTED is not a hash map")?,
            context: BpfHashMap::try_from(aya::maps::Map::HashMap(context)).context("CONTEXT is not a hash map")?,
        })
    }
}

impl Tables for BpfTables {
    fn inflight_keys(&self) -> Result<Vec<RequestKey>> {
        self.inflight.keys().collect::<Result<Vec<_>, _>>().context("listing the INFLIGHT map")
    }

    fn inflight(&self, key: &RequestKey) -> Result<Option<InflightEntry>> {
        found(self.inflight.get(key, 0)).context("reading the INFLIGHT map")
    }

    fn forget_inflight(&mut self, key: &RequestKey) -> Result<()> {
        forget(&mut self.inflight, key)
    }

    fn put_inflight(&mut self, key: &RequestKey, entry: &InflightEntry) -> Result<()> {
        self.inflight.insert(key, entry, 0).context("writing the INFLIGHT map")
    }

    fn alerted_keys(&self) -> Result<Vec<RequestKey>> {
        self.alerted.keys().collect::<Result<Vec<_>, _>>().context("listing the ALERTED map")
    }

    fn alerted(&self, key: &RequestKey) -> Result<Option<u64>> {
        found(self.alerted.get(key, 0)).context("reading the ALERTED map")
    }

    fn mark(&mut self, key: &RequestKey, last_ns: u64) -> Result<()> {
        self.alerted.insert(key, last_ns, 0).context("writing the ALERTED map")
    }

    fn forget_alerted(&mut self, key: &RequestKey) -> Result<()> {
        forget(&mut self.alerted, key)
    }

    fn context_keys(&self) -> Result<Vec<RequestKey>> {
        self.context.keys().collect::<Result<Vec<_>, _>>().context("listing the CONTEXT map")
    }

    fn context(&self, key: &RequestKey) -> Result<Option<HeldContext>> {
        found(self.context.get(key, 0)).context("reading the CONTEXT map")
    }

    fn put_context(&mut self, key: &RequestKey, context: &HeldContext) -> Result<()> {
        self.context.insert(key, context, 0).context("writing the CONTEXT map")
    }

    fn forget_context(&mut self, key: &RequestKey) -> Result<()> {
        forget(&mut self.context, key)
    }
}

/// A lookup's value, `None` for a key not there.
fn found<V>(result: Result<V, MapError>) -> Result<Option<V>> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(err) => Err(anyhow!(err)),
    }
}

/// Remove `key`; already gone is fine.
fn forget<V: aya::Pod>(map: &mut BpfHashMap<MapData, RequestKey, V>, key: &RequestKey) -> Result<()> {
    match map.remove(key) {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(err)) if err.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(err) => Err(anyhow!(err)).context("removing an in-flight map entry"),
    }
}
