//! The KV layout both peers must agree on.

/// The geometry of a node's KV pages, exchanged in HELLO and compared exactly.
///
/// A page index names one slot in every buffer: transferring page `p` moves
/// `buffer_page_bytes[b]` bytes of buffer `b` at slot `p`, for every buffer `b`
/// (buffers are typically one per layer and per K/V).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Tokens held by one page.
    pub tokens_per_page: u32,
    /// Bytes of one page in each buffer; its length is the buffer count.
    pub buffer_page_bytes: Vec<u32>,
    /// An opaque fingerprint of the model and tensor-parallel shard (at most 255 bytes).
    /// Peers with different fingerprints must not exchange KV pages.
    pub fingerprint: Vec<u8>,
}

impl KvLayout {
    /// Number of buffers.
    pub fn buffers(&self) -> usize {
        self.buffer_page_bytes.len()
    }

    /// Bytes moved per page index, summed over all buffers.
    pub fn bytes_per_page_index(&self) -> u64 {
        self.buffer_page_bytes.iter().map(|&b| u64::from(b)).sum()
    }

    /// Pages needed to hold `tokens` tokens (`ceil(tokens / tokens_per_page)`), or `None` when
    /// `tokens_per_page` is zero.
    pub fn pages_for_tokens(&self, tokens: u32) -> Option<u32> {
        if self.tokens_per_page == 0 {
            return None;
        }
        Some(tokens.div_ceil(self.tokens_per_page))
    }
}
