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
}

impl PageDigestStream {
    /// An empty stream under `kind`.
    pub(crate) fn new(kind: Kind) -> Self {
        match kind {
            Kind::Xxh3_64 => Self::Xxh3(RawHasher::new(SecretBuffer::default())),
            Kind::Crc32 => Self::Crc32(crc32fast::Hasher::new()),
        }
    }

    /// Feeds the next piece of the slot.
    #[inline]
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        match self {
            Self::Xxh3(h) => std::hash::Hasher::write(h, bytes),
            Self::Crc32(h) => h.update(bytes),
        }
    }

    /// The page digest of everything fed.
    pub(crate) fn finish(&self) -> u64 {
        match self {
            Self::Xxh3(h) => std::hash::Hasher::finish(h),
            Self::Crc32(h) => u64::from(h.clone().finalize()),
        }
    }
}

impl std::fmt::Debug for PageDigestStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Xxh3(_) => "PageDigestStream(XXH3-64)",
            Self::Crc32(_) => "PageDigestStream(CRC-32)",
        })
    }
}
