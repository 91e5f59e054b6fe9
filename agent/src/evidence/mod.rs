//! The evidence read when a stall comes due, so an alert says where the
//! request stopped and who it waits on: the target's own memory
//! ([`status`]), what its transports did since the request's last event
//! ([`transport`], with the costly progress probes linked only near a stall
//! by [`gate`]), and what each transfer's peer completed meanwhile
//! ([`peers`]); whether the target itself is stopped, throttled or not
//! scheduled, from its threads in procfs ([`sched`]), which outranks what
//! its transport says; and a single read of the target's memory a
//! framework asks for ([`memory`]).
pub mod gate;
pub mod memory;
pub mod peers;
pub mod sched;
pub mod status;
pub mod transport;
