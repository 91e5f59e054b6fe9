//! Kernel timestamps are CLOCK_MONOTONIC; people read wall-clock time.
use std::time::{Duration, SystemTime};

/// Now on CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns()`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we own; CLOCK_MONOTONIC
    // always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

/// Converts monotonic nanoseconds to wall-clock time, with the offset
/// between the two clocks taken once at start-up (so every report of one
/// run agrees with every other, even across NTP steps).
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    boot_wall: SystemTime,
}

impl Clock {
    pub fn new() -> Self {
        let mono = Duration::from_nanos(monotonic_ns());
        let now = SystemTime::now();
        Self { boot_wall: now.checked_sub(mono).unwrap_or(SystemTime::UNIX_EPOCH) }
    }

    pub fn wall(&self, mono_ns: u64) -> SystemTime {
        self.boot_wall + Duration::from_nanos(mono_ns)
    }

    /// RFC 3339 with milliseconds, UTC.
    pub fn rfc3339(&self, mono_ns: u64) -> String {
        humantime::format_rfc3339_millis(self.wall(mono_ns)).to_string()
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_now_maps_to_wall_now() {
        let clock = Clock::new();
        let wall = clock.wall(monotonic_ns());
        let drift = SystemTime::now().duration_since(wall).unwrap_or_default();
        assert!(drift < Duration::from_secs(1), "{drift:?}");
    }
}
