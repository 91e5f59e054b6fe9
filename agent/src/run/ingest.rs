//! From ring-buffer record to the engine: each record decoded, the stage
//! times it carries replayed first, signals routed to their framework; and
//! what never got there (undecodable records, the kernel's losses), counted
//! and warned about once a counter period.
use anyhow::Result;
use stallwatch_common::Event;
use tracing::warn;

use crate::{
    evidence::transport::Tracker,
    frameworks::signals,
    kernel::{KernelCounters, Probes, decode},
    lifecycle::{Engine, Observation, Report, Side},
    util::warned::Warned,
};

/// Records the ring buffer held that did not become observations: counted
/// (the summary and metrics show them as lost events) and warned about at
/// most once per [`super::event_loop::COUNTER_PERIOD`], never once per record, since a whole
/// stream of them (an agent and an eBPF object that disagree) would flood
/// the log and slow the event loop.
#[derive(Default)]
pub struct Ingest {
    pub undecodable: u64,
    warned: Warned,
    /// Why the latest one did not decode.
    last_error: Option<String>,
}

impl Ingest {
    pub fn record(
        &mut self,
        bytes: &[u8],
        transport: &mut Tracker,
        engine: &mut Engine,
        reports: &mut Vec<Report>,
        route: &mut impl FnMut(Option<(&Event, Option<Observation>)>) -> Option<(Observation, Side)>,
    ) {
        match decode::decode(bytes) {
            Ok(event) => {
                for earlier in decode::withheld(&event) {
                    self.event(&earlier, true, transport, engine, reports, route);
                }
                self.event(&event, false, transport, engine, reports, route);
            }
            Err(err) => {
                self.undecodable += 1;
                self.last_error = Some(format!("{err:#}"));
            }
        }
    }

    /// `carried`: a stage time the record carried besides its own event
    /// (see [`Engine::observe_carried`]).
    fn event(
        &mut self,
        event: &Event,
        carried: bool,
        transport: &mut Tracker,
        engine: &mut Engine,
        reports: &mut Vec<Report>,
        route: &mut impl FnMut(Option<(&Event, Option<Observation>)>) -> Option<(Observation, Side)>,
    ) {
        // A signal is a lifecycle event only once its consumer makes one
        // (an SGLang room's, from its ZMQ messages); a probe's lifecycle
        // event may be another's (a NIXL handle's, its room's).
        let decoded = if signals::is_signal(event) {
            Ok(route(Some((event, None))))
        } else {
            decode::observe(event).map(|o| route(Some((event, Some(o)))))
        };
        match decoded {
            Ok(made) => {
                // A framework may make more than one observation of one
                // record (a heartbeat naming several requests), or one
                // besides none (a leaked Mooncake batch, at an end it took):
                // `route(None)` hands over the rest, in order.
                let mut next = made.or_else(|| route(None));
                while let Some((observation, side)) = next {
                    apply(observation, side, carried, transport, engine, reports);
                    next = route(None);
                }
            }
            Err(err) => {
                self.undecodable += 1;
                self.last_error = Some(format!("{err:#}"));
            }
        }
    }

    /// One warning for the records that failed since the last one.
    /// An observation a framework made on its own, not of a record (a
    /// request it ended at its lease): to the engine as any other.
    pub fn made(
        &mut self,
        observation: Observation,
        side: Side,
        transport: &mut Tracker,
        engine: &mut Engine,
        reports: &mut Vec<Report>,
    ) {
        apply(observation, side, false, transport, engine, reports);
    }

    pub fn warn_undecodable(&mut self) {
        if let Some(new) = self.warned.news(self.undecodable) {
            warn!(
                new,
                undecodable = self.undecodable,
                latest = self.last_error.as_deref().unwrap_or_default(),
                "ring-buffer records that did not become lifecycle events (counted as lost)"
            );
        }
    }
}

/// Log each new loss the kernel counted, as it happens.
/// One observation of a process on `side` to the transport tracker and
/// the engine; `carried`: a stage time a record carried besides its own
/// event ([`Engine::observe_carried`]).
fn apply(
    observation: Observation,
    side: Side,
    carried: bool,
    transport: &mut Tracker,
    engine: &mut Engine,
    reports: &mut Vec<Report>,
) {
    if side == Side::Decode {
        engine.set_side(observation.pid, side);
    }
    transport.observe(&observation);
    if carried {
        engine.observe_carried(observation, reports);
    } else {
        engine.observe(observation, reports);
    }
}

pub fn warn_on_loss(probes: &Probes, before: KernelCounters) -> Result<KernelCounters> {
    let now = probes.counters()?;
    if now.lost() > before.lost() {
        warn!(
            lost = now.lost() - before.lost(),
            ringbuf_full = now.ringbuf_full,
            key_unreadable = now.key_unreadable,
            args_missing = now.args_missing,
            no_slot = now.no_slot,
            "events lost in the kernel"
        );
    }
    if now.ext_unreadable > before.ext_unreadable {
        warn!(
            ext_unreadable = now.ext_unreadable,
            "events delivered without their external id, which could not be read: check the profile's `external_id`"
        );
    }
    if now.state_full > before.state_full {
        warn!(
            state_full = now.state_full,
            "the kernel's in-flight table is full: these requests are followed, but would not survive an agent restart"
        );
    }
    if now.exec_lost > before.exec_lost {
        warn!(exec_lost = now.exec_lost, "exec notifications lost; such processes are found by the next rescan");
    }
    Ok(now)
}

#[cfg(test)]
mod tests {
    use std::{
        io::Write,
        sync::{Arc, Mutex},
    };

    use serde_json::Value;
    use stallwatch_common::EXT_ID_LEN;

    use super::*;
    use crate::{
        export::alert::{AlertWriter, Format, Shortfalls},
        kernel::ring::Losses,
        lifecycle::{EngineConfig, EngineStats},
        util::clock::Clock,
    };

    /// The log lines `f` writes at warn level or above.
    fn warnings(f: impl FnOnce()) -> Vec<String> {
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().expect("log buffer").extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(buffer.0.lock().expect("log buffer").clone()).expect("UTF-8 log");
        text.lines().map(str::to_owned).collect()
    }

    fn bytes_of(event: &Event) -> Vec<u8> {
        // SAFETY: viewing a POD value as its bytes.
        unsafe { std::slice::from_raw_parts((&raw const *event).cast::<u8>(), size_of::<Event>()) }.to_vec()
    }

    #[test]
    fn undecodable_records_are_lost_events_warned_about_once_per_period() {
        let mut ingest = Ingest::default();
        let mut transport = Tracker::new(1_000);
        let mut engine = Engine::new(EngineConfig::default());
        let mut reports = Vec::new();
        let unknown_stage = Event {
            ts_ns: 5,
            key: 7,
            ret: 0,
            pid: 9,
            tid: 9,
            slot: 3,
            flags: 0,
            stage: 200,
            _pad: [0; 7],
            ext: [0; EXT_ID_LEN],
        };
        let logged = warnings(|| {
            for _ in 0..1000 {
                ingest.record(&[0; 8], &mut transport, &mut engine, &mut reports, &mut |routed| {
                    routed.and_then(|(_, o)| o).map(|o| (o, Side::Prefill))
                });
            }
            ingest.record(&bytes_of(&unknown_stage), &mut transport, &mut engine, &mut reports, &mut |routed| {
                routed.and_then(|(_, o)| o).map(|o| (o, Side::Prefill))
            });
            // Two counter periods: the second has nothing new.
            ingest.warn_undecodable();
            ingest.warn_undecodable();
        });
        assert_eq!(ingest.undecodable, 1001);
        assert_eq!(logged.len(), 1, "one warning, not one per record: {logged:?}");
        assert!(logged[0].contains("undecodable=1001") && logged[0].contains("stage 200"), "{logged:?}");
        assert!(reports.is_empty() && engine.is_empty());

        // The summary counts them as lost events.
        let mut out = Vec::new();
        let losses = Losses {
            kernel: KernelCounters { ringbuf_full: 2, ..KernelCounters::default() },
            undecodable: ingest.undecodable,
        };
        AlertWriter::new(&mut out, Format::Json, Clock::new())
            .summary(&EngineStats::default(), &losses, &Shortfalls::default(), &[], None)
            .expect("summary");
        let summary: Value = serde_json::from_slice(&out).expect("JSON summary");
        assert_eq!(
            (summary["lost_events"].as_u64(), summary["undecodable"].as_u64()),
            (Some(1003), Some(1001)),
            "{summary}"
        );
    }
}
