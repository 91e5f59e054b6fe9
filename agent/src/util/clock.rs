//! Kernel timestamps are CLOCK_MONOTONIC; people read wall-clock time.
//!
//! `bpf_ktime_get_ns()` reads the host's CLOCK_MONOTONIC, whatever time
//! namespace the probed process or the agent runs in. An agent in a time
//! namespace (`unshare --time`, a container runtime that makes one) reads
//! its own clock shifted by the namespace's offset: behind, no stall would
//! ever be due; ahead, every time printed would be wrong. So every clock
//! read here is brought back to the host's by the offsets the namespace
//! declares ([`TimeOffsets`], `/proc/self/timens_offsets`).
use std::{
    sync::OnceLock,
    time::{Duration, SystemTime},
};

use procfs::FromRead as _;
use rustix::time::ClockId;

/// Now on the host's CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns()`.
pub fn monotonic_ns() -> u64 {
    host_clock_ns(ClockId::Monotonic, time_offsets().monotonic_ns)
}

/// How far this process's time namespace shifts CLOCK_MONOTONIC and
/// CLOCK_BOOTTIME from the host's (both 0 outside one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeOffsets {
    pub monotonic_ns: i64,
    pub boottime_ns: i64,
}

impl TimeOffsets {
    /// `/proc/self/timens_offsets`: `monotonic <secs> <nanos>` and
    /// `boottime <secs> <nanos>` lines (secs may be negative). A line
    /// that does not parse counts as no offset.
    pub fn parse(text: &str) -> Self {
        let mut offsets = Self::default();
        for line in text.lines() {
            let mut fields = line.split_whitespace();
            let (Some(clock), Some(secs), Some(nanos)) = (fields.next(), fields.next(), fields.next()) else {
                continue;
            };
            let (Ok(secs), Ok(nanos)) = (secs.parse::<i64>(), nanos.parse::<i64>()) else {
                continue;
            };
            let ns = secs.saturating_mul(1_000_000_000).saturating_add(nanos);
            match clock {
                "monotonic" => offsets.monotonic_ns = ns,
                "boottime" => offsets.boottime_ns = ns,
                _ => {}
            }
        }
        offsets
    }

    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// This process's time-namespace offsets, read once (they cannot change
/// once a process is in the namespace). No file (a kernel before 5.6, or
/// no /proc): no namespace, no offset.
pub fn time_offsets() -> TimeOffsets {
    static OFFSETS: OnceLock<TimeOffsets> = OnceLock::new();
    *OFFSETS.get_or_init(|| {
        std::fs::read_to_string("/proc/self/timens_offsets").map(|text| TimeOffsets::parse(&text)).unwrap_or_default()
    })
}

/// `clock` as the host reads it: this namespace's reading less its offset.
fn host_clock_ns(clock: ClockId, offset_ns: i64) -> u64 {
    let ns = i128::from(clock_ns(clock)) - i128::from(offset_ns);
    u64::try_from(ns.max(0)).unwrap_or(u64::MAX)
}

/// When process `pid` started, on CLOCK_MONOTONIC (to the kernel's clock
/// tick, rounded down); `None` when there is no such process. `/proc`
/// gives it in ticks of CLOCK_BOOTTIME, which runs ahead of CLOCK_MONOTONIC
/// by the time suspended; taking today's gap makes the result early, never
/// late, so "the process started after an event" is never said wrongly.
pub fn process_start_ns(pid: u32) -> Option<u64> {
    let ticks = procfs::process::Stat::from_file(format!("/proc/{pid}/stat")).ok()?.starttime;
    let hz = Some(rustix::param::clock_ticks_per_second()).filter(|&hz| hz > 0)?;
    // `/proc` shows it shifted by this namespace's boottime offset.
    let offsets = time_offsets();
    let boot_ns = i128::from(ticks) * 1_000_000_000 / i128::from(hz) - i128::from(offsets.boottime_ns);
    let boot_ns = u64::try_from(boot_ns.max(0)).ok()?;
    let ahead = host_clock_ns(ClockId::Boottime, offsets.boottime_ns).saturating_sub(monotonic_ns());
    Some(boot_ns.saturating_sub(ahead))
}

fn clock_ns(clock: ClockId) -> u64 {
    let ts = rustix::time::clock_gettime(clock);
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
    fn time_namespace_offsets_parse_with_negative_seconds() {
        let offsets = TimeOffsets::parse("monotonic        -300         0\nboottime          5   500000000\n");
        assert_eq!(offsets, TimeOffsets { monotonic_ns: -300_000_000_000, boottime_ns: 5_500_000_000 });
        assert!(TimeOffsets::parse("monotonic 0 0\nboottime 0 0\n").is_zero());
        assert!(TimeOffsets::parse("garbage\nmonotonic x 1\n").is_zero());
        // Back on the host's clock: a namespace behind reads earlier.
        let host = host_clock_ns(ClockId::Monotonic, 0);
        assert!(host_clock_ns(ClockId::Monotonic, -1_000_000_000) >= host + 1_000_000_000);
    }

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
