//! "Warn about what is new since the last warning": input the agent cannot
//! use (undecodable ring-buffer records, unreadable ZMQ frames, status
//! reads that told nothing) is counted, and the count is warned about once
//! per counter period, never once per item (a whole stream of bad input
//! must not flood the log or slow the event loop), and only when it moved.
//! A failure that repeats (every export to a collector whose certificate
//! is not trusted) is said when it starts, then at most once a period with
//! how many more there were ([`Repeated`]).
use std::time::{Duration, Instant};

/// How much of a running count the last warning covered.
#[derive(Debug, Default)]
pub struct Warned(u64);

impl Warned {
    /// How much `total` grew since the last warning, if it did; a warning
    /// is then taken to cover it.
    pub fn news(&mut self, total: u64) -> Option<u64> {
        let new = total.checked_sub(self.0).filter(|&new| new > 0)?;
        self.0 = total;
        Some(new)
    }
}

/// A failure that may repeat many times a second: said when it starts,
/// then at most once a `period` with the count since, and when it ends.
#[derive(Debug)]
pub struct Repeated {
    period: Duration,
    /// While failing: when it was last said, and the failures since.
    failing: Option<(Instant, u64)>,
}

/// What to say of one more failure.
#[derive(Debug, PartialEq, Eq)]
pub enum Say {
    /// The first failure since it last worked: say it, whole.
    Started,
    /// A period since it was last said: say it again, with how many
    /// failures there were since (this one included).
    Again(u64),
    /// Said less than a period ago: at most a debug line.
    Quiet,
}

impl Repeated {
    pub fn new(period: Duration) -> Self {
        Self { period, failing: None }
    }

    /// One more failure, at `now`.
    pub fn failed(&mut self, now: Instant) -> Say {
        let Some((said, since)) = &mut self.failing else {
            self.failing = Some((now, 0));
            return Say::Started;
        };
        *since += 1;
        if now.saturating_duration_since(*said) < self.period {
            return Say::Quiet;
        }
        let count = std::mem::take(since);
        *said = now;
        Say::Again(count)
    }

    /// It works: `true` when it was failing (say that it works again).
    pub fn ended(&mut self) -> bool {
        self.failing.take().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_failure_is_said_once_a_period_with_its_count() {
        let minute = Duration::from_secs(60);
        let start = Instant::now();
        let mut repeated = Repeated::new(minute);
        assert!(!repeated.ended(), "nothing failed yet");
        assert_eq!(repeated.failed(start), Say::Started);
        // Seven a second for a minute: one line, then one with the count.
        let mut said = Vec::new();
        for n in 1..=420 {
            let at = start + Duration::from_millis(n * 1000 / 7);
            match repeated.failed(at) {
                Say::Quiet => {}
                other => said.push(other),
            }
        }
        assert_eq!(said, [Say::Again(420)]);
        assert_eq!(repeated.failed(start + minute + Duration::from_secs(1)), Say::Quiet);
        assert!(repeated.ended(), "it was failing: say it works again");
        assert!(!repeated.ended(), "once");
        assert_eq!(repeated.failed(start + 2 * minute), Say::Started, "a new failure is said whole again");
    }

    #[test]
    fn only_what_grew_since_the_last_warning_is_news() {
        let mut warned = Warned::default();
        assert_eq!(warned.news(0), None);
        assert_eq!(warned.news(5), Some(5));
        assert_eq!(warned.news(5), None, "nothing new: no second warning");
        assert_eq!(warned.news(12), Some(7));
        assert_eq!(warned.news(3), None, "a count that went down is no news");
    }
}
