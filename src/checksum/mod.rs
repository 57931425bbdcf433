//! Page and buffer digests: what the sender puts in COMMIT and what the receiver recomputes
//! over the memory that actually landed.
//!
//! # Algorithm (normative, SPEC.md §6)
//!
//! **Page digest** of a page's bytes, by [`DigestAlgorithm`]:
//!
//! * [`DigestAlgorithm::XXH3_64`] (the default): `XXH3_64(bytes)` with seed 0.
//! * [`DigestAlgorithm::CRC32`]: CRC-32/ISO-HDLC (the IEEE 802.3 / zlib CRC) of the bytes,
//!   zero-extended to 64 bits.
//!
//! **Buffer digest** of buffer index `b` of a transfer `(transfer_id, nonce)` under algorithm
//! `A`: XXH3-128 (seed 0) of the byte string
//!
//! ```text
//! "KVWD"                      4 bytes, ASCII
//! A                           u8
//! transfer_id                 u64 little-endian
//! nonce                       u64 little-endian
//! b                           u32 little-endian
//! for each page, i = 0, 1, 2, ... in transfer order:
//!     i                       u32 little-endian
//!     page_digest_A(page i)   u64 little-endian
//! ```
//!
//! taken as a [`Digest128`] via [`Digest128::from_u128`] (little-endian bytes). The all-zero
//! digest is **reserved** to mean "missing" (a receiver treats it as a failure, never a
//! pass), so a hash that happens to be zero (probability 2^-128) is replaced by the digest of
//! the value 1.
//!
//! Binding the buffer digest to the transfer id, the reservation nonce, the buffer index and
//! each page's ordinal means a digest computed for another transfer, an earlier reservation
//! of the same transfer, another buffer, or a reordered set of pages cannot verify.
//!
//! **Aux digest** of a transfer's auxiliary record (the bytes COMMIT carries with the pages,
//! possibly none) under algorithm `A`: XXH3-128 (seed 0) of the byte string
//!
//! ```text
//! "KVWA"                      4 bytes, ASCII (its own domain: never a buffer digest input)
//! A                           u8
//! transfer_id                 u64 little-endian
//! nonce                       u64 little-endian
//! length of the record        u32 little-endian
//! the record's bytes
//! ```
//!
//! taken as a [`Digest128`] like the buffer digest, zero replaced by one. It is always
//! computed, over an empty record too, and bound to the same reservation as the pages.
//!
//! # Streaming
//!
//! A transfer sent in chunks is digested chunk by chunk with a [`TransferDigester`], which
//! keeps each buffer's streaming state between chunks: the result equals
//! [`digest_transfer`] over all the pages, with no second pass over memory.
//!
//! # Performance
//!
//! [`BufferDigester::update`] does no heap allocation: the page is digested in one pass and
//! 12 bytes (ordinal and page digest) are fed to a streaming XXH3 state that lives inline in
//! the digester. [`digest_transfer`] allocates only its two output vectors, once, with their
//! final capacity.

use kvwire_proto::wire::TransferId;
use xxhash_rust::xxh3::Xxh3Default;

pub use kvwire_proto::wire::{Digest128, DigestAlgorithm, TransferDigests};

mod job;
mod landed;
#[cfg(test)]
mod tests;

#[cfg(test)]
pub(crate) use job::PANICS_IN_TESTS;
pub use job::{DigestJob, DigestJobError, DigestProgress, PageDigestPart, TransferDigester};
pub use landed::LandedDigests;

/// The 4-byte domain-separation prefix of every buffer digest input (ASCII `"KVWD"`).
pub const BUFFER_DIGEST_DOMAIN: [u8; 4] = *b"KVWD";

/// The 4-byte domain-separation prefix of every aux digest input (ASCII `"KVWA"`).
pub const AUX_DIGEST_DOMAIN: [u8; 4] = *b"KVWA";

/// A digest algorithm this implementation does not support (for example an unknown code
/// received from a peer).
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
#[error("unsupported digest algorithm {0}")]
pub struct UnsupportedAlgorithm(pub DigestAlgorithm);

/// The algorithms this implementation supports, the default ([`DigestAlgorithm::XXH3_64`])
/// first, then in order of preference.
#[must_use]
pub fn supported_algorithms() -> &'static [DigestAlgorithm] {
    const SUPPORTED: &[DigestAlgorithm] = &[DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32];
    SUPPORTED
}

/// A supported algorithm, resolved once so the per-page dispatch is a two-way branch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Xxh3_64,
    Crc32,
}

impl Kind {
    #[inline]
    pub(crate) fn new(alg: DigestAlgorithm) -> Result<Self, UnsupportedAlgorithm> {
        match alg {
            DigestAlgorithm::XXH3_64 => Ok(Kind::Xxh3_64),
            DigestAlgorithm::CRC32 => Ok(Kind::Crc32),
            other => Err(UnsupportedAlgorithm(other)),
        }
    }

    #[inline]
    pub(crate) fn page_digest(self, bytes: &[u8]) -> u64 {
        match self {
            // The same function as `xxh3_64` (seed 0, default secret; the known answers in
            // checksum/tests.rs hold for both), with the SIMD width chosen at run time.
            Kind::Xxh3_64 => twox_hash::XxHash3_64::oneshot(bytes),
            Kind::Crc32 => u64::from(crc32fast::hash(bytes)),
        }
    }
}

/// The page digest of `bytes` under `alg`: XXH3-64 (seed 0), or the IEEE CRC-32
/// zero-extended to 64 bits.
///
/// # Errors
///
/// [`UnsupportedAlgorithm`] if `alg` is not one of [`supported_algorithms`].
#[inline]
pub fn page_digest(alg: DigestAlgorithm, bytes: &[u8]) -> Result<u64, UnsupportedAlgorithm> {
    Kind::new(alg).map(|k| k.page_digest(bytes))
}

/// The aux digest of a transfer's auxiliary record `aux` under `alg`, bound to `binding`
/// (SPEC.md §6; the module documentation gives the input). Never all-zero.
///
/// # Errors
///
/// [`UnsupportedAlgorithm`] if `alg` is not one of [`supported_algorithms`].
///
/// # Panics
///
/// If `aux` is longer than `u32::MAX` bytes (the wire allows at most
/// [`MAX_AUX`](kvwire_proto::wire::MAX_AUX)).
pub fn aux_digest(
    alg: DigestAlgorithm,
    binding: DigestBinding,
    aux: &[u8],
) -> Result<Digest128, UnsupportedAlgorithm> {
    Kind::new(alg)?;
    let len = u32::try_from(aux.len()).expect("an aux record of more than u32::MAX bytes");
    let mut header = [0u8; 25];
    header[0..4].copy_from_slice(&AUX_DIGEST_DOMAIN);
    header[4] = alg.0;
    header[5..13].copy_from_slice(&binding.transfer_id.0.to_le_bytes());
    header[13..21].copy_from_slice(&binding.nonce.to_le_bytes());
    header[21..25].copy_from_slice(&len.to_le_bytes());
    let mut hasher = Xxh3Default::new();
    hasher.update(&header);
    hasher.update(aux);
    Ok(nonzero_digest(hasher.digest128()))
}

/// What a buffer digest is bound to: the transfer and the reservation it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DigestBinding {
    /// The transfer id.
    pub transfer_id: TransferId,
    /// The nonce of the reservation (RESERVE) the pages were written into.
    pub nonce: u64,
}

/// Streaming digest of one buffer's pages, fed in transfer order (page ordinal 0 first).
///
/// ```
/// use kvwire::checksum::{BufferDigester, DigestAlgorithm, DigestBinding};
///
/// let binding = DigestBinding { transfer_id: kvwire::TransferId(7), nonce: 42 };
/// let mut d = BufferDigester::new(DigestAlgorithm::XXH3_64, binding, 0).unwrap();
/// let _page0 = d.update(&[1u8; 4096]);
/// let _page1 = d.update(&[2u8; 4096]);
/// assert_eq!(d.pages(), 2);
/// assert!(!d.finish().is_zero());
/// ```
#[derive(Clone)]
pub struct BufferDigester {
    hasher: Xxh3Default,
    kind: Kind,
    alg: DigestAlgorithm,
    buffer_index: u32,
    pages: u32,
}

impl core::fmt::Debug for BufferDigester {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("BufferDigester")
            .field("alg", &self.alg)
            .field("buffer_index", &self.buffer_index)
            .field("pages", &self.pages)
            .finish_non_exhaustive()
    }
}

impl BufferDigester {
    /// Starts the digest of buffer `buffer_index` of the transfer identified by `binding`.
    ///
    /// # Errors
    ///
    /// [`UnsupportedAlgorithm`] if `alg` is not one of [`supported_algorithms`].
    pub fn new(
        alg: DigestAlgorithm,
        binding: DigestBinding,
        buffer_index: u32,
    ) -> Result<Self, UnsupportedAlgorithm> {
        Kind::new(alg).map(|kind| Self::with_kind(kind, alg, binding, buffer_index))
    }

    #[inline]
    pub(crate) fn with_kind(
        kind: Kind,
        alg: DigestAlgorithm,
        binding: DigestBinding,
        buffer_index: u32,
    ) -> Self {
        let mut header = [0u8; 25];
        header[0..4].copy_from_slice(&BUFFER_DIGEST_DOMAIN);
        header[4] = alg.0;
        header[5..13].copy_from_slice(&binding.transfer_id.0.to_le_bytes());
        header[13..21].copy_from_slice(&binding.nonce.to_le_bytes());
        header[21..25].copy_from_slice(&buffer_index.to_le_bytes());
        let mut hasher = Xxh3Default::new();
        hasher.update(&header);
        Self {
            hasher,
            kind,
            alg,
            buffer_index,
            pages: 0,
        }
    }

    /// Digests the next page (ordinal [`pages`](Self::pages)) and returns its page digest.
    ///
    /// # Panics
    ///
    /// If the buffer already has `u32::MAX` pages (ordinals are 32-bit on the wire).
    #[inline]
    pub fn update(&mut self, page: &[u8]) -> u64 {
        let digest = self.kind.page_digest(page);
        self.push_page_digest(digest);
        digest
    }

    /// Folds in the next page by its already-computed page digest (same effect as
    /// [`update`](Self::update) on bytes whose page digest is `page_digest`). For callers that
    /// compute page digests elsewhere, e.g. in parallel, and fold them in order.
    ///
    /// # Panics
    ///
    /// If the buffer already has `u32::MAX` pages (ordinals are 32-bit on the wire).
    #[inline]
    pub fn push_page_digest(&mut self, page_digest: u64) {
        let ordinal = self.pages;
        assert!(
            ordinal != u32::MAX,
            "more than u32::MAX pages in one buffer"
        );
        let mut record = [0u8; 12];
        record[0..4].copy_from_slice(&ordinal.to_le_bytes());
        record[4..12].copy_from_slice(&page_digest.to_le_bytes());
        self.hasher.update(&record);
        self.pages = ordinal + 1;
    }

    /// How many pages have been digested so far.
    #[inline]
    #[must_use]
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// The algorithm this digester uses.
    #[inline]
    #[must_use]
    pub fn algorithm(&self) -> DigestAlgorithm {
        self.alg
    }

    /// The buffer index this digest is bound to.
    #[inline]
    #[must_use]
    pub fn buffer_index(&self) -> u32 {
        self.buffer_index
    }

    /// The buffer digest. Never all-zero (zero is reserved for "missing").
    #[inline]
    #[must_use]
    pub fn finish(self) -> Digest128 {
        nonzero_digest(self.hasher.digest128())
    }
}

/// Maps the reserved all-zero value to 1, so a computed digest is never "missing".
#[inline]
fn nonzero_digest(h: u128) -> Digest128 {
    Digest128::from_u128(if h == 0 { 1 } else { h })
}

/// Digests of a whole transfer of `buffers` buffers of `pages` pages each (the aux digest
/// left all-zero: add it with [`aux_digest`]).
///
/// `page(b, ordinal)` returns the bytes of page `ordinal` of buffer `b`; it is called exactly
/// once per page, buffer by buffer, pages in ordinal order. With `per_page`, the result also
/// holds every page digest, buffer-major (`pages[b * pages + ordinal]`); otherwise its `pages`
/// is empty. The two output vectors are the only allocations.
///
/// # Errors
///
/// [`UnsupportedAlgorithm`] if `alg` is not one of [`supported_algorithms`]; `page` is then
/// never called.
///
/// # Panics
///
/// If `buffers` or `pages` exceeds `u32::MAX`, or `buffers * pages` overflows `usize`.
pub fn digest_transfer<'a, F>(
    alg: DigestAlgorithm,
    binding: DigestBinding,
    buffers: usize,
    pages: usize,
    per_page: bool,
    mut page: F,
) -> Result<TransferDigests, UnsupportedAlgorithm>
where
    F: FnMut(usize, usize) -> &'a [u8],
{
    let kind = Kind::new(alg)?;
    assert!(u32::try_from(buffers).is_ok(), "more than u32::MAX buffers");
    assert!(
        u32::try_from(pages).is_ok(),
        "more than u32::MAX pages per buffer"
    );
    let mut out = TransferDigests {
        aux: Digest128::default(),
        buffers: Vec::with_capacity(buffers),
        pages: if per_page {
            Vec::with_capacity(
                buffers
                    .checked_mul(pages)
                    .expect("buffers * pages overflows"),
            )
        } else {
            Vec::new()
        },
    };
    // `buffers <= u32::MAX` (checked above), so the zipped u32 index never wraps.
    for (b, index) in (0..buffers).zip(0u32..) {
        let mut digester = BufferDigester::with_kind(kind, alg, binding, index);
        for ordinal in 0..pages {
            let d = digester.update(page(b, ordinal));
            if per_page {
                out.pages.push(d);
            }
        }
        out.buffers.push(digester.finish());
    }
    Ok(out)
}

/// Whether the drivers compute digests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DigestMode {
    /// Compute digests over the source and over the landed memory (the only mode for
    /// production).
    #[default]
    Verify,
    /// **Delivers unverified data.** Both drivers skip digest computation and hand the
    /// session a fixed placeholder digest, so "verification" always passes. It exists only
    /// so `kvwire bench --verify none` can measure the integrity tax; both peers must use it.
    UnverifiedBenchmarkOnly,
}

/// The fixed digests [`DigestMode::UnverifiedBenchmarkOnly`] reports instead of computing
/// (both sides report the same, so "verification" passes).
pub fn placeholder_digests(buffers: usize, pages: usize, per_page: bool) -> TransferDigests {
    TransferDigests {
        buffers: vec![Digest128::from_u128(1); buffers],
        pages: if per_page {
            vec![0; buffers * pages]
        } else {
            Vec::new()
        },
        aux: Digest128::from_u128(1),
    }
}
