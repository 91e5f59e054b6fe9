//! Kernel timestamps are CLOCK_MONOTONIC; people read wall-clock time.
use std::time::{Duration, SystemTime};

/// Now on CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns()`.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// When process `pid` started, on CLOCK_MONOTONIC (to the kernel's clock
/// tick, rounded down); `None` when there is no such process. `/proc`
/// gives it in ticks of CLOCK_BOOTTIME, which runs ahead of CLOCK_MONOTONIC
/// by the time suspended; taking today's gap makes the result early, never
/// late, so "the process started after an event" is never said wrongly.
pub fn process_start_ns(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22, counted from the one after the `(comm)`, which may hold
    // spaces and parentheses.
    let ticks: u64 = stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok().filter(|&hz| hz > 0)?;
    let boot_ns = u64::try_from(u128::from(ticks) * 1_000_000_000 / u128::from(hz)).ok()?;
    let ahead = clock_ns(libc::CLOCK_BOOTTIME).saturating_sub(monotonic_ns());
    Some(boot_ns.saturating_sub(ahead))
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we own; both clocks used
    // here always exist on Linux.
    unsafe { libc::clock_gettime(clock, &mut ts) };
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

    #[test]
    fn a_process_start_is_on_the_monotonic_clock() {
        let before = monotonic_ns();
        std::thread::sleep(Duration::from_millis(30));
        let mut child = std::process::Command::new("sleep").arg("5").spawn().expect("spawning sleep");
        let started = process_start_ns(child.id());
        let after = monotonic_ns();
        let _ = child.kill();
        let _ = child.wait();
        let started = started.expect("the child's start");
        // To the clock tick (at most 10 ms at USER_HZ 100), rounded down.
        assert!(started > before && started <= after, "{before} < {started} <= {after}");
        assert!(process_start_ns(std::process::id()).is_some_and(|ns| ns <= before));
        assert_eq!(process_start_ns(u32::MAX), None);
    }
}
