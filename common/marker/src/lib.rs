//! `libstallwatch_marker.so`: the smallest marker a serving framework can
//! add at a stage that has no native signal stallwatch could probe (a
//! request entering a Python queue, an ABORT handled without any library
//! call).
//!
//! The framework calls one C function, `stallwatch_mark(room, event)`
//! (from Python through ctypes: `python/stallwatch_marker.py`). It does no
//! work: it writes the room as decimal ASCII on its own stack and calls
//! the stage's function, `stallwatch_mark_<stage>(room, room_text)`, whose
//! body is only a 5-byte nop and a return. The built-in `marker` profile
//! puts one uprobe on each stage function: the event is the function, the
//! request key the room (`arg0`), the external id the room's text (`arg1`),
//! so alerts and trace ids carry the same room SGLang's ZMQ frames do.
//!
//! Why a function per stage: a profile's probe has one event, fixed (a
//! return rule could pick it from a value, but return probes cost two hits
//! a call). Why the nop first: the kernel emulates a nop at the probed
//! address, the cheapest of the three cases (nop, `push %rbp` emulated,
//! any other instruction single-stepped); no frame pointer is set up in a
//! leaf this small, so the nop is the first instruction. Each stage returns
//! its own code, so no two stage functions have the same body and the
//! compiler cannot fold them into one address (two probes at one address
//! would both fire on every call).
//!
//! Without stallwatch attached a mark costs a call and a few stores.
use core::ffi::c_char;

use stallwatch_common::stage;

/// Marks `event` (stallwatch's stage code: 0 enqueued, 1 transfer_posted,
/// 2 transfer_done, 3 released, 4 aborted, 5 failed) for the request
/// `room`. Returns 0, or -1 for an unknown event (nothing is marked).
#[unsafe(no_mangle)]
pub extern "C" fn stallwatch_mark(room: u64, event: u32) -> i32 {
    let mut text = [0u8; 21];
    let room_text = decimal(room, &mut text).as_ptr().cast::<c_char>();
    let Ok(event) = u8::try_from(event) else { return -1 };
    match event {
        stage::ENQUEUED => stallwatch_mark_enqueued(room, room_text),
        stage::TRANSFER_POSTED => stallwatch_mark_transfer_posted(room, room_text),
        stage::TRANSFER_DONE => stallwatch_mark_transfer_done(room, room_text),
        stage::RELEASED => stallwatch_mark_released(room, room_text),
        stage::ABORTED => stallwatch_mark_aborted(room, room_text),
        stage::FAILED => stallwatch_mark_failed(room, room_text),
        _ => return -1,
    };
    0
}

/// `room` in decimal, NUL-terminated, at the end of `buf` (20 digits and
/// the NUL fit any u64); returns the text with its NUL.
fn decimal(mut room: u64, buf: &mut [u8; 21]) -> &[u8] {
    let mut start = buf.len() - 1;
    buf[start] = 0;
    loop {
        start -= 1;
        buf[start] = b'0' + (room % 10) as u8;
        room /= 10;
        if room == 0 {
            return &buf[start..];
        }
    }
}

/// A stage function: the probed site. The nop comes first and names the
/// arguments' registers, so they are still where the uprobe reads them;
/// it is declared to read memory (`readonly`, not `nomem`), or the
/// compiler, seeing a callee that reads nothing, would drop the caller's
/// writes of the room's text as dead stores.
macro_rules! stage_fn {
    ($(#[$doc:meta] $name:ident = $code:expr;)*) => {$(
        #[$doc]
        #[unsafe(no_mangle)]
        #[inline(never)]
        pub extern "C" fn $name(room: u64, room_text: *const c_char) -> u32 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a nop; it reads and writes nothing.
            unsafe {
                core::arch::asm!(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00", in("rdi") room, in("rsi") room_text,
                                 options(readonly, nostack, preserves_flags));
            }
            #[cfg(not(target_arch = "x86_64"))]
            core::hint::black_box((room, room_text));
            u32::from($code)
        }
    )*};
}

stage_fn! {
    /// `enqueued`: the request entered the framework's queue.
    stallwatch_mark_enqueued = stage::ENQUEUED;
    /// `transfer_posted`: its KV transfer was handed to the transport.
    stallwatch_mark_transfer_posted = stage::TRANSFER_POSTED;
    /// `transfer_done`: the transfer completed.
    stallwatch_mark_transfer_done = stage::TRANSFER_DONE;
    /// `released`: the framework is done with the request.
    stallwatch_mark_released = stage::RELEASED;
    /// `aborted`: the request was aborted.
    stallwatch_mark_aborted = stage::ABORTED;
    /// `failed`: the transfer failed.
    stallwatch_mark_failed = stage::FAILED;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rooms_are_written_in_decimal_with_their_nul() {
        let mut buf = [0xffu8; 21];
        assert_eq!(decimal(0, &mut buf), b"0\0");
        assert_eq!(decimal(1042, &mut buf), b"1042\0");
        assert_eq!(decimal(u64::MAX, &mut buf), b"18446744073709551615\0");
    }

    #[test]
    fn unknown_events_mark_nothing() {
        assert_eq!(stallwatch_mark(7, u32::from(stage::FAILED) + 1), -1);
        assert_eq!(stallwatch_mark(7, u32::MAX), -1);
        assert_eq!(stallwatch_mark(7, u32::from(stage::ENQUEUED)), 0);
    }
}
