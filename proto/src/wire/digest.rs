//! Digest values as they travel in COMMIT and as the receiver's driver computes them.

use core::fmt;

/// A 128-bit digest, stored as its 16 little-endian bytes.
///
/// An all-zero digest is never valid: the receiver treats it as missing (fail closed).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Digest128(pub [u8; 16]);

impl Digest128 {
    /// The digest of a `u128` value (little-endian).
    pub const fn from_u128(v: u128) -> Self {
        Self(v.to_le_bytes())
    }

    /// The digest as a `u128`.
    pub const fn to_u128(self) -> u128 {
        u128::from_le_bytes(self.0)
    }

    /// Whether every byte is zero (a missing digest).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Debug for Digest128 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest128({:032x})", self.to_u128())
    }
}

/// Digests of one transfer: one 128-bit digest per buffer, optionally one 64-bit digest per
/// page of every buffer, and the digest of its auxiliary record.
///
/// Buffer digests are bound to (transfer id, nonce, buffer index, page ordinal) and the aux
/// digest to (transfer id, nonce) by the algorithms in SPEC.md §6, so digests made for
/// another transfer or an earlier reservation of the same transfer cannot verify.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TransferDigests {
    /// One digest per buffer, in buffer order.
    pub buffers: Vec<Digest128>,
    /// Either empty, or `buffers.len() * pages` page digests, buffer-major
    /// (`pages[b * page_count + ordinal]`).
    pub pages: Vec<u64>,
    /// The digest of the transfer's auxiliary record (always computed, also over an empty
    /// record; all-zero = missing).
    pub aux: Digest128,
}

impl TransferDigests {
    /// Whether per-page digests are present.
    pub fn has_page_digests(&self) -> bool {
        !self.pages.is_empty()
    }
}
