//! A destination's KV pages at its decode rank, kept as runs of
//! consecutive pages: a room of thousands of pages (SGLang's default page
//! size is one token) taken from a free pool is a few runs, so every live
//! room's whole destination is held in little memory, and telling which
//! room a chunk writes to is a range check per run.
//!
//! Disjoint live rooms of one decode rank never share a page (the decode
//! allocates each room its own), so the room whose runs hold a chunk's
//! first page is the chunk's.

/// Pages in the order the destination lists them, as runs `(first, len)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Runs(Box<[(u32, u32)]>);

impl Runs {
    /// The runs of `pages`, in their order: each page one past the one
    /// before it extends the run.
    pub fn of(pages: &[u32]) -> Self {
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for &page in pages {
            match runs.last_mut() {
                Some((first, len)) if first.checked_add(*len) == Some(page) && *len < u32::MAX => *len += 1,
                _ => runs.push((page, 1)),
            }
        }
        Self(runs.into())
    }

    /// Runs as they were held (a context handed over).
    pub fn from_runs(runs: Vec<(u32, u32)>) -> Self {
        Self(runs.into())
    }

    pub fn runs(&self) -> &[(u32, u32)] {
        &self.0
    }

    /// Whether `page` is one of the pages.
    pub fn contains(&self, page: u32) -> bool {
        self.0.iter().any(|&(first, len)| page >= first && page - first < len)
    }

    /// The first page listed: where the room's first chunk writes.
    pub fn first(&self) -> Option<u32> {
        self.0.first().map(|&(first, _)| first)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_kept_as_runs_in_their_order_and_tell_their_own() {
        // A room from a free list: 3000 pages in three runs, out of order.
        let pages: Vec<u32> = (500..1500).chain(4000..5000).chain(0..1000).collect();
        let runs = Runs::of(&pages);
        assert_eq!(runs.runs(), [(500, 1000), (4000, 1000), (0, 1000)]);
        assert_eq!(runs.first(), Some(500));
        for page in [0, 999, 500, 1499, 4000, 4999] {
            assert!(runs.contains(page), "{page}");
        }
        for page in [1500, 1999, 3999, 5000, u32::MAX] {
            assert!(!runs.contains(page), "{page}");
        }
        // Scattered pages: a run each; a repeated page breaks a run.
        assert_eq!(Runs::of(&[7, 3, 4, 4, 9]).runs(), [(7, 1), (3, 2), (4, 1), (9, 1)]);
        assert_eq!(Runs::of(&[u32::MAX, 0]).runs(), [(u32::MAX, 1), (0, 1)], "no wrap");
        assert!(Runs::of(&[]).is_empty() && Runs::of(&[]).first().is_none());
    }
}
