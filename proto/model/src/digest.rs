//! Model digests: a deterministic 128-bit hash of what a page slot holds, bound to the
//! transfer reference, buffer and ordinal like the real buffer digest (SPEC.md §6).

use std::hash::{DefaultHasher, Hash, Hasher};

use kvwire_proto::wire::{Digest128, DigestAlgorithm, TransferDigests, TransferId, TransferRef};

/// What a page slot holds: `None` for bytes no transfer wrote (stale or initial), else the
/// (transfer id, ordinal) whose source page was copied into it.
pub type Content = Option<(TransferId, u32)>;

fn hash128(v: impl Hash) -> u128 {
    let mut lo = DefaultHasher::new();
    0u8.hash(&mut lo);
    v.hash(&mut lo);
    let mut hi = DefaultHasher::new();
    1u8.hash(&mut hi);
    v.hash(&mut hi);
    (u128::from(hi.finish()) << 64) | u128::from(lo.finish())
}

/// The page digest of one slot of buffer `buffer`.
pub fn page_digest(algorithm: DigestAlgorithm, buffer: usize, content: Content) -> u64 {
    hash128((algorithm.0, buffer, content)) as u64
}

/// The aux digest of `aux`, bound to the reservation like the real one (SPEC.md §6).
pub fn aux_digest(transfer: TransferRef, algorithm: DigestAlgorithm, aux: &[u8]) -> Digest128 {
    Digest128::from_u128(hash128((b"KVWA", algorithm.0, transfer, aux)).max(1))
}

/// The digests of a transfer whose ordinal `i` holds `contents[i]` in every buffer, with
/// the aux record `aux`.
pub fn digests(
    transfer: TransferRef,
    algorithm: DigestAlgorithm,
    buffers: usize,
    contents: &[Content],
    page_digests: bool,
    aux: &[u8],
) -> TransferDigests {
    let buffer_digests = (0..buffers)
        .map(|b| {
            let h = hash128((b"KVWD", algorithm.0, transfer, b as u32, contents));
            Digest128::from_u128(h.max(1))
        })
        .collect();
    let pages = if page_digests {
        (0..buffers)
            .flat_map(|b| contents.iter().map(move |&c| page_digest(algorithm, b, c)))
            .collect()
    } else {
        Vec::new()
    };
    TransferDigests {
        buffers: buffer_digests,
        pages,
        aux: aux_digest(transfer, algorithm, aux),
    }
}

/// What the sender's source pages of transfer `transfer_id` hold: ordinal `i` is `(id, i)`.
pub fn source_contents(transfer_id: TransferId, pages: u32) -> Vec<Content> {
    (0..pages).map(|i| Some((transfer_id, i))).collect()
}
