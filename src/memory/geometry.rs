//! Pool geometry: how many pages, how many buffers, how many bytes and tokens per page.

use kvwire_proto::wire::KvLayout;

use super::PoolError;

/// The shape of a page pool.
///
/// The pool holds `buffer_page_bytes.len()` buffers of `pages` slots each; slot `p` of buffer
/// `b` is `buffer_page_bytes[b]` bytes long, and page index `p` (one slot in every buffer)
/// holds `tokens_per_page` tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolGeometry {
    /// Tokens held by one page index.
    pub tokens_per_page: u32,
    /// Bytes of one page slot in each buffer; its length is the buffer count.
    pub buffer_page_bytes: Vec<u32>,
    /// Number of page indices (slots per buffer).
    pub pages: u32,
}

impl PoolGeometry {
    /// Tokens the whole pool can hold: `pages * tokens_per_page` (cannot overflow a `u64`).
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.pages) * u64::from(self.tokens_per_page)
    }

    /// Page indices needed to hold `tokens` tokens (`ceil(tokens / tokens_per_page)`), or
    /// `None` when `tokens_per_page` is zero. This does not compare against `pages`.
    pub fn pages_for_tokens(&self, tokens: u64) -> Option<u64> {
        if self.tokens_per_page == 0 {
            return None;
        }
        Some(tokens.div_ceil(u64::from(self.tokens_per_page)))
    }

    /// Number of buffers.
    pub fn buffers(&self) -> usize {
        self.buffer_page_bytes.len()
    }

    /// Bytes of one page index summed over all buffers (saturating at `u64::MAX`, which no
    /// real geometry approaches).
    pub fn bytes_per_page_index(&self) -> u64 {
        self.buffer_page_bytes
            .iter()
            .fold(0u64, |acc, &b| acc.saturating_add(u64::from(b)))
    }

    /// Bytes of the whole pool, or `None` if that does not fit in a `u64`.
    pub fn total_bytes(&self) -> Option<u64> {
        self.buffer_page_bytes.iter().try_fold(0u64, |acc, &b| {
            acc.checked_add(u64::from(b).checked_mul(u64::from(self.pages))?)
        })
    }

    /// The wire-level layout of this geometry, with the given model/TP fingerprint (which the
    /// protocol limits to 255 bytes; that limit is checked where the layout is encoded).
    pub fn to_layout(&self, fingerprint: Vec<u8>) -> KvLayout {
        KvLayout {
            tokens_per_page: self.tokens_per_page,
            buffer_page_bytes: self.buffer_page_bytes.clone(),
            fingerprint,
        }
    }

    /// Checks that a pool of this geometry can be built: at least one buffer, one page, one
    /// token per page and one byte per page slot, and every buffer and the total addressable
    /// (each buffer at most `isize::MAX` bytes, the total within `u64`).
    pub fn validate(&self) -> Result<(), PoolError> {
        let bad = |msg: String| Err(PoolError::BadGeometry(msg));
        if self.buffer_page_bytes.is_empty() {
            return bad("the pool needs at least one buffer".into());
        }
        if self.pages == 0 {
            return bad("the pool needs at least one page".into());
        }
        if self.tokens_per_page == 0 {
            return bad("tokens_per_page must be at least 1".into());
        }
        for (buffer, &bytes) in self.buffer_page_bytes.iter().enumerate() {
            if bytes == 0 {
                return bad(format!("buffer {buffer} has zero bytes per page"));
            }
            if self.buffer_len(buffer).is_none() {
                return bad(format!(
                    "buffer {buffer} of {} pages x {bytes} bytes is too large to address",
                    self.pages
                ));
            }
        }
        if self.total_bytes().is_none() {
            return bad(format!(
                "{} buffers x {} pages overflow a 64-bit byte count",
                self.buffers(),
                self.pages
            ));
        }
        Ok(())
    }

    /// Length in bytes of buffer `buffer` (all its pages), if it exists and is addressable
    /// (`<= isize::MAX`): the size of each region to register with [`crate::memory::KvMemory`].
    pub fn buffer_len(&self, buffer: usize) -> Option<usize> {
        let page_bytes = usize::try_from(*self.buffer_page_bytes.get(buffer)?).ok()?;
        let pages = usize::try_from(self.pages).ok()?;
        let len = page_bytes.checked_mul(pages)?;
        (len <= isize::MAX as usize).then_some(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(tpp: u32, bytes: &[u32], pages: u32) -> PoolGeometry {
        PoolGeometry {
            tokens_per_page: tpp,
            buffer_page_bytes: bytes.to_vec(),
            pages,
        }
    }

    #[test]
    fn capacity_and_sizes() {
        let g = geo(16, &[64, 32, 8], 10);
        assert_eq!(g.capacity_tokens(), 160);
        assert_eq!(g.bytes_per_page_index(), 104);
        assert_eq!(g.total_bytes(), Some(1040));
        assert_eq!(g.buffers(), 3);
        assert_eq!(g.buffer_len(1), Some(320));
        assert_eq!(g.buffer_len(3), None);
    }

    #[test]
    fn capacity_tokens_does_not_overflow() {
        let g = geo(u32::MAX, &[1], u32::MAX);
        assert_eq!(
            g.capacity_tokens(),
            u64::from(u32::MAX) * u64::from(u32::MAX)
        );
    }

    #[test]
    fn pages_for_tokens_rounds_up() {
        let g = geo(16, &[1], 4);
        assert_eq!(g.pages_for_tokens(0), Some(0));
        assert_eq!(g.pages_for_tokens(1), Some(1));
        assert_eq!(g.pages_for_tokens(16), Some(1));
        assert_eq!(g.pages_for_tokens(17), Some(2));
        assert_eq!(g.pages_for_tokens(u64::MAX), Some(u64::MAX.div_ceil(16)));
        assert_eq!(geo(0, &[1], 4).pages_for_tokens(5), None);
    }

    #[test]
    fn total_bytes_overflow_is_none() {
        let g = geo(1, &[u32::MAX; 5], u32::MAX);
        assert_eq!(g.total_bytes(), None);
        assert!(matches!(g.validate(), Err(PoolError::BadGeometry(_))));
    }

    #[test]
    fn to_layout_copies_geometry() {
        let g = geo(32, &[128, 256], 7);
        let l = g.to_layout(b"llama-tp0".to_vec());
        assert_eq!(l.tokens_per_page, 32);
        assert_eq!(l.buffer_page_bytes, vec![128, 256]);
        assert_eq!(l.fingerprint, b"llama-tp0".to_vec());
        assert_eq!(l.bytes_per_page_index(), g.bytes_per_page_index());
    }

    #[test]
    fn validate_rejects_degenerate_geometry() {
        assert!(geo(16, &[64], 1).validate().is_ok());
        for bad in [
            geo(16, &[], 4),
            geo(16, &[64], 0),
            geo(0, &[64], 4),
            geo(16, &[64, 0], 4),
        ] {
            assert!(
                matches!(bad.validate(), Err(PoolError::BadGeometry(_))),
                "{bad:?} accepted"
            );
        }
    }
}
