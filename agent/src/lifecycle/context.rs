//! What is said of a request besides its lifecycle: the fields its
//! framework reads from its traffic (an SGLang room's hung `handle`, the
//! room it is queued `behind`, a vLLM request's id), and what the agent
//! itself judges of its process (`waiting_on=self`). A report's context
//! travels with it to every output, each of which says it its own way:
//! an alert line and an `inflight` row as `name=value`, a span as
//! `stallwatch.<scope>.<name>`. So no output knows a framework: the
//! framework names itself ([`Field::scope`]).

/// The scope of what the agent says of a request itself rather than
/// what a framework read ([`Context::say_halt`]).
const AGENT_SCOPE: &str = "stall";

/// One thing said of a request: by whom, under what name, and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    /// Who says it: the framework that follows the request (`sglang`,
    /// `vllm`), or [`AGENT_SCOPE`].
    pub scope: &'static str,
    /// Its name on an alert line (`waiting_on`).
    pub name: &'static str,
    pub value: String,
}

impl Field {
    /// Its span attribute's name: `stallwatch.<scope>.<name>`, the name
    /// without its own `<scope>_` prefix (an alert's `vllm_request_id` is
    /// `stallwatch.vllm.request_id`: the prefix keeps a flat alert line
    /// unambiguous, the attribute's scope already says it).
    pub fn attribute(&self) -> String {
        let name = self.name.strip_prefix(self.scope).and_then(|rest| rest.strip_prefix('_')).unwrap_or(self.name);
        format!("stallwatch.{}.{name}", self.scope)
    }
}

/// Everything said of one request besides its lifecycle.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Context {
    /// In the order they were said.
    pub fields: Vec<Field>,
    /// Span attributes under the framework's own names (SGLang's
    /// `bootstrap_room`), so its spans and the framework's own are found
    /// by one query. On every span of the request, never on alerts.
    pub native: Vec<(&'static str, i64)>,
}

impl Context {
    /// The fields `scope` says, in order.
    pub fn said_by(scope: &'static str, fields: impl IntoIterator<Item = (&'static str, String)>) -> Self {
        let fields = fields.into_iter().map(|(name, value)| Field { scope, name, value }).collect();
        Self { fields, native: Vec::new() }
    }

    /// Its fields as an alert line says them, in order.
    pub fn pairs(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.fields.iter().map(|field| (field.name, field.value.as_str()))
    }

    pub fn extend(&mut self, other: Self) {
        self.fields.extend(other.fields);
        self.native.extend(other.native);
    }

    /// A request of a process that is held itself (`state`: `stopped`,
    /// `throttled`, `not_scheduled`) waits on itself, `waiting_on=self`,
    /// whatever its framework read from its traffic (a peer that "has not
    /// answered" may well have: the held process did not read it; a worker
    /// it is `behind` is held with it); `process_state` says how. Every
    /// other field (a room's `handle`, `transfer`, `answered`) stays: it is
    /// where the request stood when the process stopped.
    pub fn say_halt(&mut self, state: &str) {
        self.fields.retain(|field| !matches!(field.name, "waiting_on" | "behind" | "process_state"));
        let said = |name, value: &str| Field { scope: AGENT_SCOPE, name, value: value.to_owned() };
        self.fields.push(said("waiting_on", "self"));
        self.fields.push(said("process_state", state));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fields_attribute_is_scoped_by_who_said_it_without_repeating_the_scope() {
        let field = |scope, name: &'static str| Field { scope, name, value: String::new() }.attribute();
        assert_eq!(field("sglang", "waiting_on"), "stallwatch.sglang.waiting_on");
        assert_eq!(field("vllm", "vllm_request_id"), "stallwatch.vllm.request_id");
        assert_eq!(field("vllm", "vllmx"), "stallwatch.vllm.vllmx");
        assert_eq!(field(AGENT_SCOPE, "process_state"), "stallwatch.stall.process_state");
    }

    #[test]
    fn a_held_process_waits_on_itself_and_keeps_where_its_request_stood() {
        let mut context = Context::said_by(
            "sglang",
            [("answered", "1/1".to_owned()), ("behind", "17".to_owned()), ("waiting_on", "worker".to_owned())],
        );
        context.say_halt("stopped");
        assert_eq!(
            context.pairs().collect::<Vec<_>>(),
            [("answered", "1/1"), ("waiting_on", "self"), ("process_state", "stopped")]
        );
        assert_eq!(context.fields[1].attribute(), "stallwatch.stall.waiting_on");
        // A process no framework says anything of (the `nixl` profile's)
        // still waits on itself.
        let mut nothing = Context::default();
        nothing.say_halt("not_scheduled");
        assert_eq!(nothing.pairs().collect::<Vec<_>>(), [("waiting_on", "self"), ("process_state", "not_scheduled")]);
    }
}
