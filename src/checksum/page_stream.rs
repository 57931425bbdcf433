//! The page digest of bytes that arrive in pieces ([`PageDigestStream`]): a TCP receiver
//! digests each piece of a page slot right after the read that landed it, while the bytes are
//! still in cache, instead of reading the whole slot again once the record is complete.

use twox_hash::xxhash3_64::{RawHasher, SecretBuffer, DEFAULT_SECRET_LENGTH};

use super::Kind;

/// The page digest of one slot's bytes fed in order: after [`update`](Self::update) with
/// every piece of the slot, [`finish`](Self::finish) equals the one-pass page digest of the
/// whole slot (SPEC §6). It allocates nothing.
// The streams of one record live side by side in one vector: boxing the XXH3 state would add
// an allocation per buffer and record for the sake of CRC-32's smaller one.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub(crate) enum PageDigestStream {
    /// XXH3-64, seed 0, default secret (the streaming form of the same function).
    Xxh3(RawHasher<&'static [u8; DEFAULT_SECRET_LENGTH]>),
    /// CRC-32/ISO-HDLC.
    Crc32(crc32fast::Hasher),
    /// The whole slot, digested in one pass ([`feed`](Self::feed) with `whole`).
    Whole(u64),
}

impl PageDigestStream {
    /// An empty stream under `kind`.
    pub(crate) fn new(kind: Kind) -> Self {
        match kind {
            Kind::Xxh3_64 => Self::Xxh3(RawHasher::new(SecretBuffer::default())),
            Kind::Crc32 => Self::Crc32(crc32fast::Hasher::new()),
        }
    }

    /// Feeds the next piece of the slot; `whole`: the piece is the whole slot (nothing was
    /// fed before it and nothing follows), which is then digested in one pass, as the sender
    /// digests its pages. The streaming form's loop keeps XXH3's accumulators in memory or in
    /// registers as the compiler happens to lay it out: measured at the same commit, two
    /// builds that differed by one unrelated line read landed pages at 0.2 and 0.7 of the
    /// kernel copy's cost (docs/BENCHMARKS.md, "The receiver's digest and the compiler").
    #[inline]
    pub(crate) fn feed(&mut self, bytes: &[u8], whole: bool) {
        match self {
            Self::Xxh3(_) if whole => *self = Self::Whole(twox_hash::XxHash3_64::oneshot(bytes)),
            Self::Crc32(_) if whole => *self = Self::Whole(u64::from(crc32fast::hash(bytes))),
            Self::Xxh3(h) => std::hash::Hasher::write(h, bytes),
            Self::Crc32(h) => h.update(bytes),
            // A slot fed whole takes no more bytes: only `RowDigests` feeds, slot by slot.
            Self::Whole(_) => debug_assert!(bytes.is_empty(), "bytes fed after the whole slot"),
        }
    }

    /// The page digest of everything fed.
    pub(crate) fn finish(&self) -> u64 {
        match self {
            Self::Xxh3(h) => std::hash::Hasher::finish(h),
            Self::Crc32(h) => u64::from(h.clone().finalize()),
            Self::Whole(d) => *d,
        }
    }
}

impl std::fmt::Debug for PageDigestStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Xxh3(_) => "PageDigestStream(XXH3-64)",
            Self::Crc32(_) => "PageDigestStream(CRC-32)",
            Self::Whole(_) => "PageDigestStream(whole slot)",
        })
    }
}
