//! Reading the kernel's ring buffer: its records, read when a stall can be
//! due, and what the agent will never see of them ([`Losses`]); what each
//! record means is [`super::decode`]'s.
use anyhow::{Context as _, Result, anyhow};
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;

use super::{
    probes::{KernelCounters, Probes},
    reactor,
};

/// The `EVENTS` ring buffer, registered with the tokio reactor. The
/// programs submit without a wakeup unless the buffer is a quarter full, so
/// the agent [`drain`](Self::drain)s it on its tick and [`readable`](Self::readable)
/// returns only when the kernel forces a wakeup (or when records were
/// already there at registration, after a restart).
pub struct EventReader {
    ring: AsyncFd<RingBuf<MapData>>,
}

impl EventReader {
    pub fn new(probes: &mut Probes) -> Result<Self> {
        let map = probes.ebpf_mut().take_map("EVENTS").ok_or_else(|| anyhow!("the eBPF object has no map `EVENTS`"))?;
        let ring = RingBuf::try_from(map).context("EVENTS is not a ring buffer")?;
        Ok(Self { ring: reactor::register(ring, "the EVENTS ring buffer")? })
    }

    /// Wait until the kernel says records are ready; [`EventReader::drain`]
    /// reads them. The readiness is cleared first, so a record submitted
    /// while they are read wakes the next wait rather than going unnoticed.
    pub async fn readable(&mut self) -> Result<()> {
        let mut guard = self.ring.readable_mut().await.context("waiting on the ring buffer")?;
        guard.clear_ready();
        Ok(())
    }

    /// Hand every record already in the buffer to `sink`, without waiting.
    pub fn drain(&mut self, mut sink: impl FnMut(&[u8])) {
        let ring = self.ring.get_mut();
        while let Some(item) = ring.next() {
            sink(&item);
        }
    }
}

/// Every lifecycle event the agent will never see, and why: the kernel's
/// counts, and the ring-buffer records that could not be decoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Losses {
    pub kernel: KernelCounters,
    /// Records that did not become lifecycle events (an agent and an eBPF
    /// object that disagree, or a stage this agent does not know).
    pub undecodable: u64,
}

impl Losses {
    /// Events lost, each counted once.
    pub fn lost(&self) -> u64 {
        self.kernel.lost() + self.undecodable
    }
}
