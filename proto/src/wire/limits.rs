//! The wire format's constants: header fields, size limits, the sizes of a sealed frame's
//! authentication trailer, the COMMIT size check, and the "no index" value (SPEC.md §2).

/// The four magic bytes that open every frame.
pub const MAGIC: [u8; 4] = *b"KVWR";
/// The protocol version this crate speaks. There is no fallback: any other version is refused.
pub const VERSION: u16 = 2;
/// Bytes before the payload.
pub const HEADER_LEN: usize = 12;
/// Bytes after the payload (the CRC).
pub const TRAILER_LEN: usize = 4;
/// Largest payload accepted or produced.
pub const MAX_PAYLOAD: u32 = 1 << 20;
/// Most buffers a layout may declare.
pub const MAX_BUFFERS: usize = 4096;
/// Longest model/TP fingerprint.
pub const MAX_FINGERPRINT: usize = 255;
/// Most digest algorithms a hello may list.
pub const MAX_DIGEST_ALGORITHMS: usize = 16;
/// Longest opaque transport-parameter blob in a hello.
pub const MAX_TRANSPORT_PARAMS: usize = 4096;
/// Longest human-readable detail string; longer details are cut at a character boundary
/// when encoded.
pub const MAX_DETAIL: usize = 1024;
/// Most pages one reservation may name.
pub const MAX_PAGES: usize = 65_536;
/// Longest opaque access descriptor in a reservation (e.g. RDMA rkeys and addresses).
pub const MAX_ACCESS: usize = 4096;
/// Most per-page digests a commit may carry (further bounded by `MAX_PAYLOAD`).
pub const MAX_PAGE_DIGESTS: usize = 1 << 17;
/// Longest auxiliary record a COMMIT may carry, and the largest `max_aux` a hello may
/// announce.
pub const MAX_AUX: usize = 65_536;
/// Bytes of a tag (a full HMAC-SHA256 output).
pub const TAG_LEN: usize = 32;
/// Bytes of a sealed frame's sequence number.
pub const SEQ_LEN: usize = 8;
/// Bytes authentication adds to the payload of a sealed (post-hello) frame.
pub const SEALED_OVERHEAD: usize = SEQ_LEN + TAG_LEN;
/// Whether a COMMIT for `buffers` buffers and `pages` pages, with or without per-page
/// digests, carrying an auxiliary record of `aux` bytes, fits in one frame. Both sides check
/// a reservation with `aux` = the receiver's `max_aux` (the largest record it accepts), so a
/// reservation that passes can be committed with any aux the receiver accepts. Reservations
/// that fail this are refused before anything is sent: their COMMIT could never be encoded.
pub fn commit_fits(buffers: usize, pages: usize, page_digests: bool, aux: usize) -> bool {
    // transfer ref 16, tokens 4, pages 4, bytes 8, digest 1, count 2, count 4,
    // aux digest 16, aux length 4.
    let fixed = 16 + 4 + 4 + 8 + 1 + 2 + 4 + 16 + 4;
    let per_page = if page_digests {
        buffers.saturating_mul(pages)
    } else {
        0
    };
    // The COMMIT must also fit when sealed (SPEC.md §3.11), so that whether a reservation
    // can be served does not depend on whether the connection is authenticated.
    buffers <= MAX_BUFFERS
        && per_page <= MAX_PAGE_DIGESTS
        && aux <= MAX_AUX
        && fixed + buffers * 16 + per_page * 8 + aux + SEALED_OVERHEAD <= MAX_PAYLOAD as usize
}

/// Value of `Nack::buffer` / `Nack::page` when no buffer or page is named.
pub const NONE_INDEX: u32 = u32::MAX;
