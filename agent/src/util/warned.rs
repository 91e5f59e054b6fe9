//! "Warn about what is new since the last warning": input the agent cannot
//! use (undecodable ring-buffer records, unreadable ZMQ frames, status
//! reads that told nothing) is counted, and the count is warned about once
//! per counter period, never once per item (a whole stream of bad input
//! must not flood the log or slow the event loop), and only when it moved.

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

#[cfg(test)]
mod tests {
    use super::*;

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
