//! What follows a serving framework's own protocol: signals in, room
//! observations and context out.
pub mod sglang;
pub mod signals;
pub mod zmq;
