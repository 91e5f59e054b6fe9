//! The names spans and their attributes go by: a leaf every other part of
//! the export uses (the span maker, the sampler, the resources), so none
//! of them reaches into another for a name.

/// Span names.
pub const REQUEST_SPAN: &str = "stallwatch.request";
pub const STALL_SPAN: &str = "stallwatch.stall";

/// Span attribute keys: semantic-convention names where one exists, the
/// rest under `stallwatch.`.
pub mod attr {
    /// The watched process (semantic conventions).
    pub const PROCESS_PID: &str = "process.pid";
    pub const PROCESS_EXECUTABLE_NAME: &str = "process.executable.name";
    /// The profile that watched the process and judged the request.
    pub const PROFILE: &str = "stallwatch.profile";
    /// The request key, hex (`0x…`), as in the alert lines.
    pub const KEY: &str = "stallwatch.request.key";
    /// The cross-node identity the probe captured (a bootstrap room).
    pub const EXTERNAL_ID: &str = "stallwatch.request.external_id";
    /// The furthest stage reached (for an ended request, how it ended if by
    /// an event).
    pub const STAGE: &str = "stallwatch.request.stage";
    /// How the lifecycle ended (request spans).
    pub const OUTCOME: &str = "stallwatch.request.outcome";
    /// The stages a probe saw (string array, in order).
    pub const STAGES_OBSERVED: &str = "stallwatch.request.stages_observed";
    /// The stages no probe saw, inferred from the request's state read in
    /// the target's memory (string array; empty when none): their span
    /// events are timed at the read, the latest they can have happened.
    pub const STAGES_INFERRED: &str = "stallwatch.request.stages_inferred";
    /// `true` on the span event of an inferred stage.
    pub const STAGE_INFERRED: &str = "stallwatch.stage.inferred";
    /// Silence episodes this lifecycle had (request spans, when > 0).
    pub const STALLS: &str = "stallwatch.request.stalls";
    /// `waiting_for_peer`, `transfer_hung` or `release_lost`: on stall
    /// spans, and on request spans of a lifecycle that stalled (the last
    /// episode's class).
    pub const STALL_CLASS: &str = "stallwatch.stall.class";
    /// On every span whose status is ERROR: the stall class, `failed` or
    /// `process_exited` (semantic conventions' `error.type`).
    pub const ERROR_TYPE: &str = "error.type";
    /// How long the request had been silent when the stall was detected.
    pub const SILENT_MS: &str = "stallwatch.stall.silent_ms";
    /// How long a recovered request had been stuck (`recovered` events).
    pub const STUCK_MS: &str = "stallwatch.stall.stuck_ms";
    /// The transport's verdict on a stall (`peer_unresponsive`, ...;
    /// `process_stopped` when the process itself was held).
    pub const TRANSPORT_VERDICT: &str = "stallwatch.transport.verdict";
    /// How the process itself was held when its stall was judged
    /// (`stopped`, `throttled`, `not_scheduled`): the reason of a
    /// `process_stopped` verdict. Absent: it was not held.
    pub const TRANSPORT_PROCESS_STATE: &str = "stallwatch.transport.process_state";
    /// "last post 57.0s ago, last completion 57.0s ago, 120000 progress calls in the last 30.0s, none completed".
    pub const TRANSPORT_SUMMARY: &str = "stallwatch.transport.summary";
    /// Calls of each kind since the request's last event.
    pub const TRANSPORT_POSTS_SINCE: &str = "stallwatch.transport.posts_since";
    pub const TRANSPORT_COMPLETIONS_SINCE: &str = "stallwatch.transport.completions_since";
    pub const TRANSPORT_PROGRESS_SINCE: &str = "stallwatch.transport.progress_calls_since";
    /// How far back `progress_calls_since` counts, in ms: the progress
    /// probe is attached only near a stall. Absent: it was not attached.
    pub const TRANSPORT_PROGRESS_WINDOW_MS: &str = "stallwatch.transport.progress_window_ms";
    /// The stalled transfer's peer (the remote NIXL agent), where known.
    pub const TRANSPORT_PEER: &str = "stallwatch.transport.peer";
    /// Completions to that peer, and to the process's other peers, since
    /// the request's last event.
    pub const TRANSPORT_PEER_COMPLETIONS_SINCE: &str = "stallwatch.transport.peer_completions_since";
    pub const TRANSPORT_OTHER_PEERS_COMPLETIONS_SINCE: &str = "stallwatch.transport.other_peers_completions_since";
}
