//! What a receiver learns as pages land (transports that see landings: TCP, loopback): which
//! reserved pages received all their bytes under the reservation's scope (coverage, SPEC §6),
//! and, unless turned off, each page's digests taken right after it landed, while its bytes
//! are still in cache (SPEC §6, digests at landing), so verification need not read the transfer again.

use kvwire_proto::wire::{DigestAlgorithm, TransferDigests, TransferRef};

use crate::checksum::{DigestBinding, LandedDigests};
use crate::memory::PagePool;
use crate::transport::LandingDigests;

/// One open reservation's landings.
#[derive(Debug)]
pub(super) struct Landings {
    pub(super) transfer: TransferRef,
    /// Ordinals that received all their bytes under this reservation's scope.
    landed: Vec<bool>,
    /// Page digests taken at landing; `None` when not taken (turned off, unverified mode,
    /// an algorithm this build cannot compute).
    digests: Option<LandedDigests>,
}

impl Landings {
    /// `pages` reserved pages; page digests at landing under `digest` when given.
    pub(super) fn new(
        transfer: TransferRef,
        pages: usize,
        buffers: usize,
        digest: Option<DigestAlgorithm>,
    ) -> Self {
        Self {
            transfer,
            landed: vec![false; pages],
            digests: digest.and_then(|alg| LandedDigests::new(alg, buffers, pages).ok()),
        }
    }

    /// Page `page` (ordinal `ordinal`) received all its bytes: covered, and digested in
    /// every buffer: by the transport as the bytes landed (`taken`, when it took them under
    /// this transfer's algorithm), else now, from `pool`. Whether the transport's digests
    /// were used.
    pub(super) fn land(
        &mut self,
        pool: &PagePool,
        ordinal: u32,
        page: u32,
        taken: Option<&LandingDigests>,
    ) -> bool {
        let ordinal = ordinal as usize;
        let Some(l) = self.landed.get_mut(ordinal) else {
            return false;
        };
        *l = true;
        let Some(digests) = &mut self.digests else {
            return false;
        };
        if let Some(taken) = taken
            .filter(|t| t.algorithm == digests.algorithm() && t.per_buffer.len() == pool.buffers())
        {
            for (buffer, &d) in taken.per_buffer.iter().enumerate() {
                digests.record(ordinal, buffer, d);
            }
            digests.complete_page(ordinal);
            return true;
        }
        for buffer in 0..pool.buffers() {
            // A page another holder writes at this instant cannot be digested now; it then
            // needs the pass after the fence.
            match pool.raw_page(page, buffer) {
                Some(bytes) => {
                    let d = digests.page_digest(&bytes);
                    digests.record(ordinal, buffer, d);
                }
                None => {
                    digests.forget(ordinal);
                    return false;
                }
            }
        }
        digests.complete_page(ordinal);
        false
    }

    /// A landing wrote a page of the scope other than the one reserved at its ordinal: it
    /// covers nothing, and the digests taken so far may no longer match the memory (the page
    /// it wrote belongs to another ordinal), so the transfer is digested after its fence.
    pub(super) fn misplaced(&mut self) {
        self.digests = None;
    }

    /// The first reserved ordinal that did not land, if any.
    pub(super) fn first_missing(&self) -> Option<u32> {
        self.landed.iter().position(|l| !l).map(|o| o as u32)
    }

    /// The transfer's digests from the landing digests, if every page has them.
    pub(super) fn digests(self, per_page: bool, aux: &[u8]) -> Option<TransferDigests> {
        let binding = DigestBinding {
            transfer_id: self.transfer.transfer_id,
            nonce: self.transfer.nonce,
        };
        self.digests?.finish(binding, per_page, aux)
    }
}
