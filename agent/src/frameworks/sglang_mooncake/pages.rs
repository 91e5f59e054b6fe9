//! Which of its decode's KV pages a batch writes first, once that decode's
//! layout is learnt: what tells apart two rooms to one decode that a
//! worker takes out of the order they were bootstrapped in (or whose
//! chunks it interleaves).
//!
//! SGLang's Mooncake worker (`send_kvcache`) writes a chunk as one batch
//! whose requests are the runs of contiguous pages of each layer, layer 0's
//! K first: the first request's destination is `dst_kv_ptrs[0] + page *
//! kv_item_len` and its length `kv_item_len * run`. Both numbers are the
//! decode's, sent in its registration before the agent may have started;
//! they are learnt instead from two batches that could only be the first
//! of a room with a known first page ([`Rooms::sole_first_page`]), which
//! give the base and the item length. An aux batch (another buffer, a
//! length no multiple of the item length) has no page.
//!
//! [`Rooms::sole_first_page`]: crate::frameworks::sglang::Rooms::sole_first_page

/// A decode segment's KV layout: learnt, or on its way.
#[derive(Debug, Default)]
pub struct Layout {
    /// A request known to start at a page, waiting for a second.
    sample: Option<(u64, u32)>,
    fit: Option<Fit>,
}

/// Layer 0's K buffer and the length of a page in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fit {
    pub base: u64,
    pub item_len: u64,
}

impl Layout {
    /// The page a request to `offset`, `len` bytes long, starts at, by the
    /// layout learnt: none before, and none for a request that is no run
    /// of whole pages in it.
    pub fn page(&self, offset: u64, len: u64) -> Option<u32> {
        let Fit { base, item_len } = self.fit?;
        let past = offset.checked_sub(base)?;
        if len == 0 || !len.is_multiple_of(item_len) || !past.is_multiple_of(item_len) {
            return None;
        }
        u32::try_from(past / item_len).ok()
    }

    /// A request to `offset` known to start at `page`. Two with different
    /// pages fit the layout; one the layout does not place at `page`
    /// starts the learning over from it (returns true then: the layout
    /// was wrong, or the decode's memory changed).
    pub fn learn(&mut self, offset: u64, page: u32) -> bool {
        if let Some(fit) = self.fit {
            let placed = offset.checked_sub(fit.base).is_some_and(|past| past == u64::from(page) * fit.item_len);
            if placed {
                return false;
            }
            *self = Self { sample: Some((offset, page)), fit: None };
            return true;
        }
        self.fit = self.sample.and_then(|(first, first_page)| fit((first, first_page), (offset, page)));
        self.sample = if self.fit.is_some() { None } else { Some((offset, page)) };
        false
    }

    pub fn fitted(&self) -> Option<Fit> {
        self.fit
    }
}

/// The layout two requests at known pages fit, if any: a positive whole
/// item length between them, a base not below 0.
fn fit((a, a_page): (u64, u32), (b, b_page): (u64, u32)) -> Option<Fit> {
    let bytes = i128::from(b) - i128::from(a);
    let pages = i128::from(b_page) - i128::from(a_page);
    if pages == 0 || bytes % pages != 0 || bytes / pages <= 0 {
        return None;
    }
    let item_len = bytes / pages;
    let base = i128::from(a) - i128::from(a_page) * item_len;
    Some(Fit { base: u64::try_from(base).ok()?, item_len: u64::try_from(item_len).ok()? })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0x7f00_0000_0000;
    const ITEM: u64 = 8192;

    fn at(page: u32) -> u64 {
        BASE + u64::from(page) * ITEM
    }

    #[test]
    fn two_first_pages_give_the_layout_and_place_every_run_of_pages() {
        let mut layout = Layout::default();
        assert!(!layout.learn(at(7), 7));
        assert_eq!((layout.fitted(), layout.page(at(7), ITEM)), (None, None), "one sample fits nothing");
        assert!(!layout.learn(at(3), 3));
        assert_eq!(layout.fitted(), Some(Fit { base: BASE, item_len: ITEM }));
        assert_eq!(layout.page(at(12), 2 * ITEM), Some(12));
        // An aux request (another buffer below, 64 bytes), a length that is
        // no run of pages, an offset between pages: no page.
        assert_eq!(layout.page(BASE - 4096, 64), None);
        assert_eq!(layout.page(at(12), 64), None);
        assert_eq!(layout.page(at(12) + 8, ITEM), None);
        // A first page it agrees with changes nothing.
        assert!(!layout.learn(at(40), 40));
        assert_eq!(layout.page(at(40), ITEM), Some(40));
    }

    #[test]
    fn samples_that_fit_nothing_are_replaced_and_a_contradiction_starts_over() {
        let mut layout = Layout::default();
        // The same page twice, pages and offsets in opposite orders, a
        // length that is no whole number of bytes per page: no layout yet.
        assert!(!layout.learn(at(5), 5));
        assert!(!layout.learn(at(5) + ITEM, 5));
        assert!(!layout.learn(at(9), 2));
        assert!(!layout.learn(at(9) + 3, 4));
        assert_eq!(layout.fitted(), None);
        assert!(!layout.learn(at(4), 4));
        assert!(!layout.learn(at(6), 6));
        assert_eq!(layout.fitted(), Some(Fit { base: BASE, item_len: ITEM }));
        // The decode's buffer moved: learnt again from there.
        assert!(layout.learn(at(6) + 0x1000_0000, 6));
        assert_eq!(layout.fitted(), None);
        assert!(!layout.learn(at(8) + 0x1000_0000, 8));
        assert_eq!(layout.fitted(), Some(Fit { base: BASE + 0x1000_0000, item_len: ITEM }));
    }
}
