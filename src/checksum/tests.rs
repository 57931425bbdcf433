//! Known-answer, golden-value, binding and equivalence tests for the digests.
//!
//! Golden buffer digests below were computed by an independent Python reference of SPEC.md §6
//! (python-xxhash 3.x `xxh3_64_intdigest` / `xxh3_128_intdigest` over the byte string built
//! with `struct.pack("<BQQI", ...)` and `struct.pack("<IQ", ...)`, and `zlib.crc32`), and
//! cross-checked against this implementation. If one of them changes, the wire format changed.

use super::*;
use proptest::prelude::*;
use xxhash_rust::xxh3::xxh3_128;

mod primitives;

const T: u64 = 0x0123_4567_89AB_CDEF;
const N: u64 = 0xFEDC_BA98_7654_3210;
const BIND: DigestBinding = DigestBinding {
    transfer_id: TransferId(T),
    nonce: N,
};

/// Deterministic page content shared with the Python reference:
/// byte `j` of page `i` of buffer `b` is `(j*131 + i*17 + b*29 + 7) % 251`.
fn pat(b: usize, i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| ((j * 131 + i * 17 + b * 29 + 7) % 251) as u8)
        .collect()
}

/// The xxHash project's sanity-test buffer (cli/xsum_sanity_check.c, `XSUM_fillTestBuffer`).
fn xxhash_sanity_buffer(len: usize) -> Vec<u8> {
    const PRIME32: u64 = 2_654_435_761;
    const PRIME64: u64 = 11_400_714_785_074_694_797;
    let mut gen = PRIME32;
    (0..len)
        .map(|_| {
            let byte = (gen >> 56) as u8;
            gen = gen.wrapping_mul(PRIME64);
            byte
        })
        .collect()
}

/// The buffer digest input built byte by byte as SPEC.md §6 writes it, hashed one-shot.
fn reference_buffer_digest(
    alg: DigestAlgorithm,
    bind: DigestBinding,
    b: u32,
    pages: &[&[u8]],
) -> u128 {
    let mut s = Vec::new();
    s.extend_from_slice(b"KVWD");
    s.push(alg.0);
    s.extend_from_slice(&bind.transfer_id.0.to_le_bytes());
    s.extend_from_slice(&bind.nonce.to_le_bytes());
    s.extend_from_slice(&b.to_le_bytes());
    for (i, p) in pages.iter().enumerate() {
        s.extend_from_slice(&(i as u32).to_le_bytes());
        s.extend_from_slice(&page_digest(alg, p).unwrap().to_le_bytes());
    }
    xxh3_128(&s)
}

fn buffer_digest(alg: DigestAlgorithm, bind: DigestBinding, b: u32, pages: &[&[u8]]) -> Digest128 {
    let mut d = BufferDigester::new(alg, bind, b).unwrap();
    for p in pages {
        d.update(p);
    }
    d.finish()
}

// ---------------------------------------------------------------------------------------
// Golden buffer digests (cross-checked with python-xxhash, see the module comment).

#[test]
fn golden_empty_buffer() {
    assert_eq!(
        buffer_digest(DigestAlgorithm::XXH3_64, BIND, 0, &[]),
        Digest128::from_u128(0xc2a2c6af6b3c47e122bff5b8a5394288)
    );
    assert_eq!(
        buffer_digest(DigestAlgorithm::CRC32, BIND, 0, &[]),
        Digest128::from_u128(0xfd978dd67157fef9e9aa94bb30c63331)
    );
}

#[test]
fn golden_buffer_three_4k_pages() {
    let pages: Vec<Vec<u8>> = (0..3).map(|i| pat(3, i, 4096)).collect();
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();

    let mut d = BufferDigester::new(DigestAlgorithm::XXH3_64, BIND, 3).unwrap();
    let pds: Vec<u64> = refs.iter().map(|p| d.update(p)).collect();
    assert_eq!(
        pds,
        [0x719ee87b4d856707, 0x8a5019b50a3d3259, 0x29ec9c85fa5a55f8]
    );
    assert_eq!(
        d.finish(),
        Digest128::from_u128(0x6186d9b8aec70e560eb1914b5d5cebea)
    );

    let mut d = BufferDigester::new(DigestAlgorithm::CRC32, BIND, 3).unwrap();
    let pds: Vec<u64> = refs.iter().map(|p| d.update(p)).collect();
    assert_eq!(pds, [0x2bed56cf, 0x285ae0ae, 0xebe44ef9]);
    assert_eq!(
        d.finish(),
        Digest128::from_u128(0x8f20a49d05f3d22b94ab80a10f62fdd0)
    );
}

/// Page lengths 0, 1, 240, 241 and 64 KiB: every XXH3 length class.
#[test]
fn golden_buffer_mixed_page_sizes() {
    let bind = DigestBinding {
        transfer_id: TransferId(7),
        nonce: 42,
    };
    let pages: Vec<Vec<u8>> = [0usize, 1, 240, 241, 65536]
        .iter()
        .enumerate()
        .map(|(i, &n)| pat(1, i, n))
        .collect();
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();

    let mut d = BufferDigester::new(DigestAlgorithm::XXH3_64, bind, 1).unwrap();
    let pds: Vec<u64> = refs.iter().map(|p| d.update(p)).collect();
    assert_eq!(
        pds,
        [
            0x2d06800538d394c2,
            0xdedb980100c87e72,
            0x427d384b82b86797,
            0x0355cf309a0de96b,
            0xd939f145270f1223
        ]
    );
    assert_eq!(d.pages(), 5);
    assert_eq!(
        d.finish(),
        Digest128::from_u128(0xe3079d1c57ef000daa4765624d8ea0aa)
    );

    let mut d = BufferDigester::new(DigestAlgorithm::CRC32, bind, 1).unwrap();
    let pds: Vec<u64> = refs.iter().map(|p| d.update(p)).collect();
    assert_eq!(pds, [0x0, 0x84b12bae, 0x3585308e, 0xa0ecb62d, 0x93515326]);
    assert_eq!(
        d.finish(),
        Digest128::from_u128(0xb07ca6e0c0b813115cf051d9a930eb57)
    );
}

/// 2 buffers x 3 pages x 1000 bytes through `digest_transfer`, with page digests.
#[test]
fn golden_digest_transfer() {
    let bind = DigestBinding {
        transfer_id: TransferId(1),
        nonce: 2,
    };
    let pages: Vec<Vec<Vec<u8>>> = (0..2)
        .map(|b| (0..3).map(|i| pat(b, i, 1000)).collect())
        .collect();

    let got = digest_transfer(DigestAlgorithm::XXH3_64, bind, 2, 3, true, |b, i| {
        &pages[b][i]
    })
    .unwrap();
    assert_eq!(
        got.buffers,
        [
            Digest128::from_u128(0x3fef5235feb8b4b59348192cdb5b3f9a),
            Digest128::from_u128(0x883057f56cf9203a223c8663e7634e66),
        ]
    );
    assert_eq!(
        got.pages,
        [
            0x7b7c853ec74de9cd,
            0xd51dc26d93a2b622,
            0x0f6c8df7e9e869c1,
            0x1bf8a3cfb0b6a517,
            0x8e6d5745f03d69e8,
            0xbb67ab5bf2feb870,
        ]
    );

    let got = digest_transfer(DigestAlgorithm::CRC32, bind, 2, 3, true, |b, i| {
        &pages[b][i]
    })
    .unwrap();
    assert_eq!(
        got.buffers,
        [
            Digest128::from_u128(0xd839ae571165b80b23d27da4bf5612e6),
            Digest128::from_u128(0x5be2e49329be7e514a8b2b0e7e5cbb21),
        ]
    );
    assert_eq!(
        got.pages,
        [0x77e57f86, 0x08217863, 0xfc139944, 0x10166c16, 0x8ee3109d, 0xec1122e5]
    );
}

// ---------------------------------------------------------------------------------------
// Binding: every bound field changes the digest.

fn three_pages() -> Vec<Vec<u8>> {
    (0..3).map(|i| pat(0, i, 4096)).collect()
}

fn digest_of(alg: DigestAlgorithm, bind: DigestBinding, b: u32, pages: &[Vec<u8>]) -> Digest128 {
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    buffer_digest(alg, bind, b, &refs)
}

#[test]
fn binding_transfer_id_nonce_and_buffer_index() {
    let pages = three_pages();
    for &alg in supported_algorithms() {
        let base = digest_of(alg, BIND, 0, &pages);
        let other_transfer = DigestBinding {
            transfer_id: TransferId(T ^ 1),
            ..BIND
        };
        let other_nonce = DigestBinding {
            nonce: N.wrapping_add(1),
            ..BIND
        };
        let swapped = DigestBinding {
            transfer_id: TransferId(N),
            nonce: T,
        };
        assert_ne!(
            base,
            digest_of(alg, other_transfer, 0, &pages),
            "{alg}: transfer id"
        );
        assert_ne!(base, digest_of(alg, other_nonce, 0, &pages), "{alg}: nonce");
        assert_ne!(
            base,
            digest_of(alg, swapped, 0, &pages),
            "{alg}: transfer id <-> nonce"
        );
        assert_ne!(base, digest_of(alg, BIND, 1, &pages), "{alg}: buffer index");
        assert_eq!(
            base,
            digest_of(alg, BIND, 0, &pages),
            "{alg}: deterministic"
        );
    }
}

#[test]
fn binding_algorithm() {
    let pages = three_pages();
    assert_ne!(
        digest_of(DigestAlgorithm::XXH3_64, BIND, 0, &pages),
        digest_of(DigestAlgorithm::CRC32, BIND, 0, &pages)
    );
    // Even with no pages, the algorithm byte is bound.
    assert_ne!(
        digest_of(DigestAlgorithm::XXH3_64, BIND, 0, &[]),
        digest_of(DigestAlgorithm::CRC32, BIND, 0, &[])
    );
}

#[test]
fn binding_page_order_and_count() {
    let pages = three_pages();
    for &alg in supported_algorithms() {
        let base = digest_of(alg, BIND, 0, &pages);
        let mut swapped = pages.clone();
        swapped.swap(0, 2);
        assert_ne!(base, digest_of(alg, BIND, 0, &swapped), "{alg}: page order");
        assert_ne!(
            base,
            digest_of(alg, BIND, 0, &pages[..2]),
            "{alg}: dropped last page"
        );
        let mut extra = pages.clone();
        extra.push(Vec::new());
        assert_ne!(
            base,
            digest_of(alg, BIND, 0, &extra),
            "{alg}: extra empty page"
        );
        // Same multiset of pages, identical content at two ordinals: still order-bound.
        let dup = vec![pages[0].clone(), pages[0].clone(), pages[1].clone()];
        let dup2 = vec![pages[0].clone(), pages[1].clone(), pages[0].clone()];
        assert_ne!(
            digest_of(alg, BIND, 0, &dup),
            digest_of(alg, BIND, 0, &dup2),
            "{alg}"
        );
    }
}

#[test]
fn binding_single_byte_and_bit() {
    let pages = three_pages();
    for &alg in supported_algorithms() {
        let base = digest_of(alg, BIND, 0, &pages);
        for (page, pos) in [(0usize, 0usize), (1, 2048), (2, 4095)] {
            for bit in 0..8 {
                let mut m = pages.clone();
                m[page][pos] ^= 1 << bit;
                assert_ne!(
                    base,
                    digest_of(alg, BIND, 0, &m),
                    "{alg}: page {page} byte {pos} bit {bit}"
                );
            }
        }
    }
}

/// Stale pages: the same bytes that verified for one reservation do not verify for the next.
#[test]
fn stale_digest_from_earlier_reservation_does_not_verify() {
    let pages = three_pages();
    let first = digest_of(
        DigestAlgorithm::XXH3_64,
        DigestBinding {
            transfer_id: TransferId(5),
            nonce: 1,
        },
        0,
        &pages,
    );
    let second = digest_of(
        DigestAlgorithm::XXH3_64,
        DigestBinding {
            transfer_id: TransferId(5),
            nonce: 2,
        },
        0,
        &pages,
    );
    assert_ne!(first, second);
}

// ---------------------------------------------------------------------------------------
// Streaming == one-shot, and API invariants.

#[test]
fn zero_is_reserved() {
    assert_eq!(nonzero_digest(0), Digest128::from_u128(1));
    assert_eq!(nonzero_digest(5), Digest128::from_u128(5));
    assert!(!nonzero_digest(0).is_zero());
}

#[test]
fn digester_reports_pages_and_identity() {
    let mut d = BufferDigester::new(DigestAlgorithm::CRC32, BIND, 9).unwrap();
    assert_eq!(d.pages(), 0);
    assert_eq!(d.algorithm(), DigestAlgorithm::CRC32);
    assert_eq!(d.buffer_index(), 9);
    d.update(b"a");
    d.update(b"");
    assert_eq!(d.pages(), 2);
    assert!(format!("{d:?}").contains("pages: 2"));
}

#[test]
fn push_page_digest_equals_update() {
    let pages = three_pages();
    for &alg in supported_algorithms() {
        let mut a = BufferDigester::new(alg, BIND, 2).unwrap();
        let mut b = BufferDigester::new(alg, BIND, 2).unwrap();
        for p in &pages {
            a.update(p);
            b.push_page_digest(page_digest(alg, p).unwrap());
        }
        assert_eq!(a.pages(), b.pages());
        assert_eq!(a.finish(), b.finish());
    }
}

#[test]
fn digest_transfer_without_page_digests() {
    let pages: Vec<Vec<Vec<u8>>> = (0..3)
        .map(|b| (0..4).map(|i| pat(b, i, 512)).collect())
        .collect();
    let with = digest_transfer(DigestAlgorithm::XXH3_64, BIND, 3, 4, true, |b, i| {
        &pages[b][i]
    })
    .unwrap();
    let without = digest_transfer(DigestAlgorithm::XXH3_64, BIND, 3, 4, false, |b, i| {
        &pages[b][i]
    })
    .unwrap();
    assert_eq!(with.buffers, without.buffers);
    assert!(!without.has_page_digests());
    assert_eq!(with.pages.len(), 12);
    assert_eq!(with.buffers.capacity(), 3);
    assert_eq!(with.pages.capacity(), 12);
    // Empty transfer shapes.
    let none = digest_transfer(
        DigestAlgorithm::XXH3_64,
        BIND,
        0,
        4,
        true,
        |_, _| unreachable!(),
    )
    .unwrap();
    assert_eq!(none, TransferDigests::default());
    let no_pages = digest_transfer(
        DigestAlgorithm::CRC32,
        BIND,
        2,
        0,
        true,
        |_, _| unreachable!(),
    )
    .unwrap();
    assert_eq!(no_pages.buffers.len(), 2);
    assert!(no_pages.pages.is_empty());
    assert_eq!(
        no_pages.buffers[0],
        digest_of(DigestAlgorithm::CRC32, BIND, 0, &[])
    );
}

#[test]
fn digest_transfer_calls_pages_in_order_once() {
    let page = [0u8; 8];
    let mut calls = Vec::new();
    digest_transfer(DigestAlgorithm::CRC32, BIND, 2, 3, false, |b, i| {
        calls.push((b, i));
        &page[..]
    })
    .unwrap();
    assert_eq!(calls, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]);
}

proptest! {
    /// The streaming digester, `digest_transfer` and a byte-by-byte one-shot construction of
    /// the SPEC.md §6 input agree, for any shape, binding and content.
    #[test]
    fn streaming_equals_one_shot(
        alg_crc in any::<bool>(),
        transfer_id in any::<u64>(),
        nonce in any::<u64>(),
        buffer_pages in prop::collection::vec(
            prop::collection::vec(prop::collection::vec(any::<u8>(), 0..600), 0..6),
            1..4,
        ),
    ) {
        let alg = if alg_crc { DigestAlgorithm::CRC32 } else { DigestAlgorithm::XXH3_64 };
        let bind = DigestBinding { transfer_id: TransferId(transfer_id), nonce };
        // digest_transfer needs a rectangular shape: pad every buffer to the longest.
        let pages = buffer_pages.iter().map(Vec::len).max().unwrap_or(0);
        let mut rect = buffer_pages.clone();
        for buf in &mut rect {
            buf.resize(pages, Vec::new());
        }
        let all = digest_transfer(alg, bind, rect.len(), pages, true, |b, i| &rect[b][i]).unwrap();
        for (b, buf) in rect.iter().enumerate() {
            let refs: Vec<&[u8]> = buf.iter().map(Vec::as_slice).collect();
            let want = reference_buffer_digest(alg, bind, b as u32, &refs);
            let streamed = buffer_digest(alg, bind, b as u32, &refs);
            prop_assert_eq!(streamed.to_u128(), want);
            prop_assert_eq!(all.buffers[b], streamed);
            for (i, p) in buf.iter().enumerate() {
                prop_assert_eq!(all.pages[b * pages + i], page_digest(alg, p).unwrap());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Aux digests (SPEC.md §6): golden values from the independent Python reference
// (`xxhash.xxh3_128_intdigest(b"KVWA" + struct.pack("<BQQI", alg, t, n, len(aux)) + aux)`).

/// The aux digest input built byte by byte as SPEC.md §6 writes it, hashed one-shot.
fn reference_aux_digest(alg: DigestAlgorithm, bind: DigestBinding, aux: &[u8]) -> u128 {
    let mut s = Vec::new();
    s.extend_from_slice(b"KVWA");
    s.push(alg.0);
    s.extend_from_slice(&bind.transfer_id.0.to_le_bytes());
    s.extend_from_slice(&bind.nonce.to_le_bytes());
    s.extend_from_slice(&(aux.len() as u32).to_le_bytes());
    s.extend_from_slice(aux);
    xxh3_128(&s)
}

#[test]
fn golden_aux_digests() {
    let cases: [(DigestAlgorithm, &[u8], u128); 4] = [
        (
            DigestAlgorithm::XXH3_64,
            b"",
            0x2eb3de5d1feec1d5e7f403832a5cc919,
        ),
        (
            DigestAlgorithm::CRC32,
            b"",
            0xd59ca4bc8548fe3eb5a9d46f16045843,
        ),
        (
            DigestAlgorithm::XXH3_64,
            b"first token",
            0xfc4113a7881b266b9113d60f7f9b0a48,
        ),
        (
            DigestAlgorithm::CRC32,
            b"first token",
            0xf1f8348225a607fcf77a62aacf8c5c6a,
        ),
    ];
    for (alg, aux, want) in cases {
        assert_eq!(
            aux_digest(alg, BIND, aux).unwrap().to_u128(),
            want,
            "{alg} {aux:?}"
        );
        assert_eq!(reference_aux_digest(alg, BIND, aux), want);
    }
    let long = pat(0, 0, 1000);
    assert_eq!(
        aux_digest(DigestAlgorithm::XXH3_64, BIND, &long)
            .unwrap()
            .to_u128(),
        0xe070a833fac136cdf2bbe93e3ea999ef
    );
    // Wire form: the 16 little-endian bytes.
    assert_eq!(
        aux_digest(DigestAlgorithm::XXH3_64, BIND, b"").unwrap().0,
        [
            0x19, 0xc9, 0x5c, 0x2a, 0x83, 0x03, 0xf4, 0xe7, 0xd5, 0xc1, 0xee, 0x1f, 0x5d, 0xde,
            0xb3, 0x2e
        ]
    );
}

#[test]
fn aux_digest_binding_and_domain() {
    let base = aux_digest(DigestAlgorithm::XXH3_64, BIND, b"tok").unwrap();
    let other_nonce = DigestBinding {
        nonce: N ^ 1,
        ..BIND
    };
    let other_transfer = DigestBinding {
        transfer_id: TransferId(T ^ 1),
        ..BIND
    };
    assert_ne!(
        base,
        aux_digest(DigestAlgorithm::XXH3_64, other_nonce, b"tok").unwrap()
    );
    assert_ne!(
        base,
        aux_digest(DigestAlgorithm::XXH3_64, other_transfer, b"tok").unwrap()
    );
    assert_ne!(
        base,
        aux_digest(DigestAlgorithm::CRC32, BIND, b"tok").unwrap()
    );
    assert_ne!(
        base,
        aux_digest(DigestAlgorithm::XXH3_64, BIND, b"tok\0").unwrap()
    );
    assert_ne!(
        base,
        aux_digest(DigestAlgorithm::XXH3_64, BIND, b"toK").unwrap()
    );
    // Its own domain: an empty aux never equals an empty buffer's digest of the same binding.
    assert_ne!(
        aux_digest(DigestAlgorithm::XXH3_64, BIND, b"").unwrap(),
        buffer_digest(DigestAlgorithm::XXH3_64, BIND, 0, &[])
    );
    assert_eq!(
        aux_digest(DigestAlgorithm(9), BIND, b""),
        Err(UnsupportedAlgorithm(DigestAlgorithm(9)))
    );
}

proptest! {
    /// Digests streamed chunk by chunk (any split) equal the one-shot digests of the same
    /// pages, and the aux digest is the one of `aux_digest`.
    #[test]
    fn chunked_streaming_equals_one_shot(
        alg_crc in any::<bool>(),
        per_page in any::<bool>(),
        buffers in 1usize..4,
        pages in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..200), 1..12),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..4),
        aux in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let alg = if alg_crc { DigestAlgorithm::CRC32 } else { DigestAlgorithm::XXH3_64 };
        // Buffer b of page i holds `pages[i]` rotated by b.
        let content: Vec<Vec<Vec<u8>>> = (0..buffers)
            .map(|b| {
                pages
                    .iter()
                    .map(|p| {
                        let mut p = p.clone();
                        let by = b % p.len();
                        p.rotate_left(by);
                        p
                    })
                    .collect()
            })
            .collect();
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c.index(pages.len() + 1)).collect();
        bounds.push(0);
        bounds.push(pages.len());
        bounds.sort_unstable();
        bounds.dedup();
        let mut d = TransferDigester::new(alg, BIND, buffers, per_page).unwrap();
        for w in bounds.windows(2) {
            prop_assert_eq!(d.pages() as usize, w[0]);
            d.update(w[1] - w[0], |b, i| &content[b][w[0] + i]);
        }
        let streamed = d.finish(&aux);
        let mut want = digest_transfer(alg, BIND, buffers, pages.len(), per_page, |b, i| &content[b][i]).unwrap();
        want.aux = aux_digest(alg, BIND, &aux).unwrap();
        prop_assert_eq!(streamed, want);
    }
}
