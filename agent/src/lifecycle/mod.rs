//! The lifecycle engine: per-request state machines, the silence timer and
//! the stall diagnosis.
//!
//! Pure Rust, no eBPF, no I/O, no async: it is fed decoded [`Observation`]s
//! and a clock ([`Engine::advance`]) and appends [`Report`]s to a caller's
//! `Vec`, so it can be unit-tested exhaustively and benchmarked on its own
//! (`agent/benches/engine.rs`), and the event loop decides what to do with
//! the reports (alerts, spans, metrics).
//!
//! # Rules
//!
//! **Identity.** A request is a (pid, key) pair. A (pid, key) has at most one
//! live lifecycle; when one ends the pair can start another (key reuse: NIXL
//! hands the same handle address to the next request after a release).
//!
//! **Stages.** `enqueued -> transfer_posted -> transfer_done -> released`,
//! with the side exits `aborted` and `failed`; the three are terminal. A
//! request's stage is the furthest it reached and never moves backwards;
//! stages may be skipped (a missed probe). `process_exited` and `evicted` are
//! outcomes of [`Engine::process_exited`] and of the memory cap, not stages.
//!
//! **Starting.** Only a non-terminal event opens a lifecycle for an untracked
//! (pid, key), at whatever stage it names (an agent attached mid-flight may
//! first see `transfer_posted`). A terminal event for an untracked key is
//! counted in `stale_events` and ignored.
//!
//! **Events.** Every accepted event is activity: `last_ns` becomes the
//! latest timestamp seen, `first_ns` the earliest, and its stage is timed in
//! `stage_ns` unless that stage already has a time (so `stage_ns` says when
//! each stage was first seen, and an event for an earlier stage than the
//! current one fills in a gap without moving the stage back). A repeat of
//! the current stage with a new timestamp (a repost) is activity too.
//!
//! **Duplicates.** An event whose stage already has exactly that timestamp,
//! or that repeats the current stage at exactly `last_ns`, is an exact
//! duplicate: counted in `duplicate_events`, ignored (it is not activity).
//! A stage time a record carries for a `quiet` probe (see **Withheld
//! events**) that the engine already took from the kernel's table is the
//! same repeat, but expected: counted in `caught_up_repeats` instead
//! ([`Engine::observe_carried`]), so `duplicate_events` keeps meaning an
//! event delivered twice.
//!
//! **Silence and stalls.** Silence is the time since `last_ns`. A request
//! silent for `timeout_ns` or more is stalled, classified by its stage:
//! `enqueued` -> `waiting_for_peer`, `transfer_posted` -> `transfer_hung`,
//! `transfer_done` -> `release_lost`; in a process [`Engine::set_side`]
//! made a decode, `enqueued` -> `waiting_for_kv` (the decode asked for its
//! KV and waits on the prefill). [`Report::Stalled`] fires exactly once
//! per silence episode, at the first `advance(now)` with
//! `now >= last_ns + timeout_ns`: never earlier, and so no later than
//! `timeout + tick` when `advance` is called at least once per tick, or at
//! each [`Engine::next_due_ns`] (which the agent's loop sleeps until).
//! ([`Engine::advance_reading`] with a budget may take a few more ticks
//! when more stalls come due at once than it reads per call: see **State
//! reads**.)
//! A stalled request stays tracked (the query layer shows it) until it
//! recovers, ends, is evicted or its process exits.
//!
//! **Recovery.** The first accepted event after a `Stalled` whose timestamp
//! is later than `last_ns` gives [`Report::Recovered`] with
//! `stuck_ns = ts - last_ns`, and re-arms the timer, so a later silence
//! stalls it again (a new episode). If that event is terminal, `Recovered`
//! is followed by the `Ended`. An event dated at or before `last_ns` is late
//! news from inside the silence, not life after it: it is recorded but the
//! request stays stalled. `Recovered` and `Ended` snapshots say
//! `stalled: None` after a recovery; an `Ended` with `stalled: Some(_)`
//! means the request ended while still stuck (evicted, process exited, or a
//! terminal event that was late news).
//!
//! **Completing early.** An observation that `ends` (its probe's profile
//! completes lifecycles at that live stage, `complete_at`, for a framework
//! that releases lazily) is terminal in every rule here: it ends the
//! lifecycle at its own stage with [`Outcome::Completed`] (counted in
//! `completed`), and a later `released` of the key is a stale event of a
//! lifecycle already over, never a new one.
//!
//! **Ending.** Every tracked request ends in exactly one [`Report::Ended`]:
//! on `released`/`aborted`/`failed` (at the event's `ts_ns`), on
//! [`Engine::process_exited`], or on eviction. It is then untracked and its
//! timer is gone with it.
//!
//! **Stale events.** The engine remembers the most recent ends, as many as
//! `max_tracked` clamped to [`RECENT_ENDS_MIN`]..=[`RECENT_ENDS`], with
//! their end time (the latest event of the lifecycle, or the exit time), and
//! the last [`RECENT_EXITS`] process exits. An event for an ended (pid, key)
//! with `ts <= end`, or for an exited pid with `ts <= exit`, is stale:
//! counted in `stale_events`, ignored. A later non-terminal event starts a
//! fresh lifecycle. An event older than a tracked lifecycle's first event
//! and no later than the previous end of the same (pid, key) is stale too
//! (a straggler of the previous lifecycle).
//!
//! **Clocks.** Timestamps may go backwards a little across CPUs, and
//! `advance` may be called with a clock behind the events: all arithmetic
//! saturates, nothing panics, and a timer armed in the past fires at the
//! next `advance`.
//!
//! **Memory bound.** Never more than `max_tracked` requests. A new lifecycle
//! that would exceed it first evicts one: the oldest stalled request if any
//! (its alert already went out), otherwise the oldest whose stall is due but
//! not read yet (**State reads**), otherwise the one silent longest (to
//! within a tick, found from the timer wheel, see `wheel.rs`), which ends with
//! [`Outcome::Evicted`] and is counted in `evicted`.
//!
//! **Process exit.** [`Engine::process_exited`] ends every request of the
//! pid with [`Outcome::ProcessExited`]; it scans the record store (exits are
//! rare) but returns at once for a pid holding nothing.
//!
//! **Restoring.** [`Engine::restore`] takes over a request from the kernel's
//! in-flight table when an agent starts (the previous agent's, or begun
//! while none ran), before any observation. A (pid, key) already tracked is
//! ignored (a duplicate). The restored lifecycle counts in `seen` and
//! `restored`, is subject to the memory bound, and an end at `first_ns - 1`
//! is remembered for it, so that replayed events of an *earlier* lifecycle of
//! the same key (NIXL reuses handles at once) are stale; replayed events of
//! the restored lifecycle itself are duplicates (same stage, same time).
//! `alerted_ns`, the silence a previous agent already reported, counts only
//! within `[first_ns, last_ns]`. Still in that silence (`alerted_ns ==
//! last_ns`): the request is tracked as stalled without a new `Stalled`, and
//! its next event recovers it. Moved on since (`alerted_ns < last_ns`):
//! `Recovered` at once, with the class of the stage it was at when alerted
//! and `stuck_ns` up to the first stage time after the alert. Not alerted:
//! armed at `last_ns + timeout`, so one silent past the timeout stalls at the
//! next `advance`, its silence counted from its own last event. A terminal
//! stage (ended while the alert was out) gives the `Recovered` if it moved,
//! then its `Ended` at `last_ns`.
//!
//! **Resynchronising.** Lost events (a full ring buffer: an agent paused,
//! throttled or blocked) leave the engine behind the kernel, whose
//! in-flight table saw every event. Before anything is judged after a loss,
//! [`Engine::resync`] brings the engine back in step with that table, the
//! same table a restarted agent takes over: a tracked request the kernel
//! no longer holds (or whose key holds a later lifecycle) ended unseen
//! ([`Outcome::EndUnseen`], counted in `end_unseen`; alerted only if its
//! stall was), never stalled; one the kernel saw end (kept for a stall
//! alert) ends as it did; one the kernel saw move on is caught up (a
//! stalled one recovers); one the kernel holds and the engine never saw is
//! taken over as by **Restoring**. A request with an event newer than the
//! table's view is left as it is, and so is one the kernel holds nothing
//! of while the table has refused entries (full): it may never have had one.
//!
//! **State reads.** Some targets keep a request's state where the agent
//! can read it (NIXL's handle holds its transfer status), which spares a
//! probe on a hot polling function. [`Engine::advance_reading`] asks its
//! reader about each request whose stall is due, and about no other, so a
//! healthy request is never read. A later live stage the read shows is
//! *inferred*: timed at the read, listed in the snapshot's `inferred`, and
//! not activity (silence still counts from the last probe event, so the
//! stall is on time and classified by the inferred stage: posted + "done"
//! in memory is `release_lost`). A terminal stage read (an error status)
//! ends the lifecycle at the read instead of stalling it, with that stage
//! inferred. A read that tells nothing (unreadable, no rule, an earlier
//! stage) changes nothing: the stall is classified by the probes' stage. A
//! stalled request is not read again. A probe event for a stage whose time
//! was inferred replaces that time. A read costs the event loop a few
//! microseconds, so `advance_reading` reads at most a budget of requests per
//! call: those beyond it wait in a queue, oldest due first, for the next
//! calls, and none is reported before it is read. One that ends while it
//! waits is dropped from the queue; one that has an event is armed again
//! from that event. A read whose stage `ends` (see [`StageRead`])
//! completes the lifecycle at the read, that stage inferred.
//!
//! **Withheld events.** A probe can keep its events in the kernel's
//! in-flight entry instead of sending them (a profile's `quiet`), so the
//! engine may know less of a request than the kernel does. Before reading
//! or stalling a request whose stall is due, [`Engine::advance_checking`]
//! asks what the kernel holds of it; events there later than the last the
//! engine has are applied as probe events at their times (stage times
//! too), and a request they show active within the timeout is armed again
//! from its latest event instead. The kernel sends any event that ends a
//! silence of half the timeout, so a stalled request's recovery is always
//! an observation.
//!
//! **Counters.** `seen` counts lifecycles started, and
//! `seen = completed + failed + aborted + process_exited + evicted +
//! end_unseen + in_flight` always holds; `in_flight` is the number tracked.
//!
//! # Data structures
//!
//! One slab of 88-byte records indexed by `u32` (`slab.rs`); a
//! `hashbrown::HashTable<u32>` from (pid, key) to record (`index.rs`); a
//! hashed timer wheel whose entries are the records themselves, linked
//! through them (`wheel.rs`); an intrusive list of stalled requests for
//! eviction; and two bounded rings of recent ends and exits (`recent.rs`).
//! About 103 bytes per tracked request at a million in flight (88 in the
//! record, ~10 in the index, measured by the bench); O(1) per event and no
//! allocation per event once the tables have grown (a report about a request
//! with an external id clones that id).

mod context;
mod engine;
mod index;
mod recent;
mod report;
mod slab;
mod stage;
mod wheel;

#[cfg(test)]
mod tests;

pub use context::{Context, Field};
pub use engine::{Engine, EngineConfig, RECENT_ENDS, RECENT_ENDS_MIN, RECENT_EXITS};
pub use report::{EngineStats, Observation, Report, RequestSnapshot, Restored, Silent, StageRead, Withheld};
pub use stage::{Outcome, Side, Stage, StageSet, StallClass, UnknownStage, UnknownStallClass};
