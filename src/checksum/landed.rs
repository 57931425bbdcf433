//! Page digests taken as the pages land ([`LandedDigests`]): on transports that see every
//! landing (TCP, loopback) the receiver digests each page right after its bytes were written,
//! while they are still in cache, and assembles the transfer's digests from them once the
//! fence closed the scope, instead of reading the whole transfer again (SPEC §6, digests at landing).

use kvwire_proto::wire::{DigestAlgorithm, TransferDigests};

use super::{aux_digest, BufferDigester, DigestBinding, Kind, UnsupportedAlgorithm};

/// The page digests of one transfer's pages, each taken when the page last landed.
///
/// A page that lands again is digested again: the last landing counts, as the memory after
/// the fence holds the last write. A page whose bytes could not be read when it landed is
/// forgotten, and the transfer then needs the full pass after the fence.
///
/// ```
/// use kvwire::checksum::{digest_transfer, DigestAlgorithm, DigestBinding, LandedDigests};
///
/// let binding = DigestBinding { transfer_id: kvwire::TransferId(3), nonce: 9 };
/// let pages = [[1u8; 64], [2u8; 64]];
/// let mut landed = LandedDigests::new(DigestAlgorithm::XXH3_64, 1, 2).unwrap();
/// for (ordinal, bytes) in pages.iter().enumerate().rev() {
///     let d = landed.page_digest(bytes);
///     landed.record(ordinal, 0, d);
///     landed.complete_page(ordinal);
/// }
/// let at_landing = landed.finish(binding, true, b"aux").unwrap();
/// let mut after = digest_transfer(DigestAlgorithm::XXH3_64, binding, 1, 2, true, |_, i| &pages[i][..]).unwrap();
/// after.aux = kvwire::checksum::aux_digest(DigestAlgorithm::XXH3_64, binding, b"aux").unwrap();
/// assert_eq!(at_landing, after);
/// ```
#[derive(Clone, Debug)]
pub struct LandedDigests {
    alg: DigestAlgorithm,
    kind: Kind,
    buffers: usize,
    pages: usize,
    /// Buffer-major: `digests[b * pages + ordinal]`.
    digests: Vec<u64>,
    /// Pages whose every buffer was digested at their last landing.
    complete: Vec<bool>,
    missing: usize,
}

impl LandedDigests {
    /// An empty table for a transfer of `buffers` buffers of `pages` pages.
    ///
    /// # Errors
    ///
    /// [`UnsupportedAlgorithm`] if `alg` is not one of [`super::supported_algorithms`].
    pub fn new(
        alg: DigestAlgorithm,
        buffers: usize,
        pages: usize,
    ) -> Result<Self, UnsupportedAlgorithm> {
        Ok(Self {
            alg,
            kind: Kind::new(alg)?,
            buffers,
            pages,
            digests: vec![0; buffers * pages],
            complete: vec![false; pages],
            missing: pages,
        })
    }

    /// The algorithm of the table's digests.
    #[must_use]
    pub fn algorithm(&self) -> DigestAlgorithm {
        self.alg
    }

    /// The page digest of `bytes` under this transfer's algorithm.
    #[inline]
    #[must_use]
    pub fn page_digest(&self, bytes: &[u8]) -> u64 {
        self.kind.page_digest(bytes)
    }

    /// Records the digest of page `ordinal` of `buffer` at its latest landing; marks the page
    /// incomplete until [`complete_page`](Self::complete_page). Out-of-range positions are
    /// ignored.
    pub fn record(&mut self, ordinal: usize, buffer: usize, digest: u64) {
        if ordinal < self.pages && buffer < self.buffers {
            self.digests[buffer * self.pages + ordinal] = digest;
            self.forget(ordinal);
        }
    }

    /// Every buffer of page `ordinal` was recorded at this landing.
    pub fn complete_page(&mut self, ordinal: usize) {
        if let Some(c) = self.complete.get_mut(ordinal) {
            if !*c {
                *c = true;
                self.missing -= 1;
            }
        }
    }

    /// Page `ordinal`'s digests are not usable (its bytes could not be read at landing).
    pub fn forget(&mut self, ordinal: usize) {
        if let Some(c) = self.complete.get_mut(ordinal) {
            if *c {
                *c = false;
                self.missing += 1;
            }
        }
    }

    /// Whether every page has its digests.
    #[must_use]
    pub fn is_complete(&self) -> bool {
        self.missing == 0
    }

    /// The transfer's digests (buffer digests, page digests if `per_page`, the aux digest of
    /// `aux`), exactly as [`super::digest_transfer`] over the same bytes gives them; `None`
    /// while a page lacks its digests.
    #[must_use]
    pub fn finish(
        self,
        binding: DigestBinding,
        per_page: bool,
        aux: &[u8],
    ) -> Option<TransferDigests> {
        if !self.is_complete() {
            return None;
        }
        let buffers = (0..self.buffers)
            .zip(0u32..)
            .map(|(b, index)| {
                let mut d = BufferDigester::with_kind(self.kind, self.alg, binding, index);
                for &page in &self.digests[b * self.pages..(b + 1) * self.pages] {
                    d.push_page_digest(page);
                }
                d.finish()
            })
            .collect();
        Some(TransferDigests {
            buffers,
            pages: if per_page { self.digests } else { Vec::new() },
            aux: aux_digest(self.alg, binding, aux).ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::digest_transfer;
    use kvwire_proto::wire::TransferId;

    fn binding() -> DigestBinding {
        DigestBinding {
            transfer_id: TransferId(77),
            nonce: 0xfeed,
        }
    }

    fn page(b: usize, o: usize, v: u8) -> Vec<u8> {
        (0..4096).map(|i| (i + b * 7 + o * 13) as u8 ^ v).collect()
    }

    #[test]
    fn landing_digests_equal_the_digests_after_the_fence_whatever_the_landing_order() {
        for alg in [DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32] {
            let (buffers, pages) = (3, 5);
            let mut landed = LandedDigests::new(alg, buffers, pages).unwrap();
            // Out of order, page 2 landing twice: the second (different) bytes are what the
            // memory holds after the fence.
            for (o, v) in [(4, 0), (2, 0), (0, 0), (2, 0x55), (1, 0), (3, 0)] {
                for b in 0..buffers {
                    let d = landed.page_digest(&page(b, o, v));
                    landed.record(o, b, d);
                }
                landed.complete_page(o);
            }
            let memory: Vec<Vec<Vec<u8>>> = (0..buffers)
                .map(|b| {
                    (0..pages)
                        .map(|o| page(b, o, if o == 2 { 0x55 } else { 0 }))
                        .collect()
                })
                .collect();
            for per_page in [false, true] {
                let mut after =
                    digest_transfer(alg, binding(), buffers, pages, per_page, |b, o| {
                        &memory[b][o][..]
                    })
                    .unwrap();
                after.aux = aux_digest(alg, binding(), b"first token").unwrap();
                assert_eq!(
                    landed.clone().finish(binding(), per_page, b"first token"),
                    Some(after),
                    "{alg:?} per_page={per_page}"
                );
            }
        }
    }

    #[test]
    fn a_page_without_its_landing_digests_leaves_the_table_incomplete() {
        let mut landed = LandedDigests::new(DigestAlgorithm::XXH3_64, 2, 2).unwrap();
        for o in 0..2 {
            for b in 0..2 {
                landed.record(o, b, 1);
            }
            landed.complete_page(o);
        }
        assert!(landed.is_complete());
        // Page 1 lands again but one buffer cannot be read: it must not count.
        landed.record(1, 0, 5);
        assert!(!landed.is_complete());
        assert!(landed.clone().finish(binding(), false, b"").is_none());
        landed.record(1, 1, 6);
        landed.complete_page(1);
        assert!(landed.finish(binding(), false, b"").is_some());
    }
}
