//! Known-answer tests of the digest primitives (XXH3-64, XXH3-128, CRC-32) against published
//! vectors, the two XXH3 implementations against each other, and the algorithm list.

use super::*;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

// ---------------------------------------------------------------------------------------
// Known-answer tests of the primitives against published vectors.

#[test]
fn kat_xxh3_64_empty() {
    assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2);
    assert_eq!(
        page_digest(DigestAlgorithm::XXH3_64, b""),
        Ok(0x2D06_8005_38D3_94C2)
    );
}

/// `XSUM_XXH3_testdata`, seed 0 rows, from xxHash's cli/xsum_sanity_check.c. The lengths
/// cover every XXH3 code path (short, mid-size, one block, several blocks, unaligned tail).
#[test]
fn kat_xxh3_64_xxhash_sanity_vectors() {
    const VECTORS: &[(usize, u64)] = &[
        (0, 0x2D06_8005_38D3_94C2),
        (1, 0xC44B_DFF4_074E_ECDB),
        (6, 0x27B5_6A84_CD2D_7325),
        (12, 0xA713_DAF0_DFBB_77E7),
        (24, 0xA3FE_70BF_9D35_10EB),
        (48, 0x397D_A259_ECBA_1F11),
        (80, 0xBCDE_FBBB_2C47_C90A),
        (195, 0xCD94_217E_E362_EC3A),
        (403, 0xCDEB_804D_65C6_DEA4),
        (512, 0x617E_4959_9013_CB6B),
        (2048, 0xDD59_E2C3_A5F0_38E0),
        (2240, 0x6E73_A905_39CF_2948),
        (2367, 0xCB37_AEB9_E5D3_61ED),
    ];
    let buf = xxhash_sanity_buffer(4096 + 64 + 1);
    for &(len, want) in VECTORS {
        assert_eq!(
            page_digest(DigestAlgorithm::XXH3_64, &buf[..len]),
            Ok(want),
            "XXH3_64 of sanity buffer[..{len}]"
        );
    }
}

/// `XSUM_XXH128_testdata`, seed 0 rows (as `{low64, high64}`), from the same file: the
/// primitive under the buffer digest, both one-shot and through the streaming state we use.
#[test]
fn kat_xxh3_128_xxhash_sanity_vectors() {
    const VECTORS: &[(usize, u64, u64)] = &[
        (0, 0x6001_C324_468D_497F, 0x99AA_06D3_0147_98D8),
        (1, 0xC44B_DFF4_074E_ECDB, 0xA6CD_5E93_9200_0F6A),
        (6, 0x3E70_39BD_DA43_CFC6, 0x082A_FE0B_8162_D12A),
        (12, 0x061A_1927_13F6_9AD9, 0x6E3E_FD8F_C780_2B18),
        (24, 0x1E70_44D2_8B1B_901D, 0x0CE9_66E4_678D_3761),
        (48, 0xF942_219A_ED80_F67B, 0xA002_AC4E_5478_227E),
        (81, 0x5E8B_AFB9_F95F_B803, 0x4952_F581_81AB_0042),
        (222, 0xF1AE_BD59_7CEC_6B3A, 0x337E_0964_1B94_8717),
        (403, 0xCDEB_804D_65C6_DEA4, 0x1B6D_E21E_332D_D73D),
        (512, 0x617E_4959_9013_CB6B, 0x18D2_D110_DCC9_BCA1),
        (2048, 0xDD59_E2C3_A5F0_38E0, 0xF736_557F_D470_73A5),
        (2240, 0x6E73_A905_39CF_2948, 0xCCB1_34FB_FA7C_E49D),
        (2367, 0xCB37_AEB9_E5D3_61ED, 0xE89C_0F6F_F369_B427),
    ];
    let buf = xxhash_sanity_buffer(4096 + 64 + 1);
    for &(len, lo, hi) in VECTORS {
        let want = (u128::from(hi) << 64) | u128::from(lo);
        let data = &buf[..len];
        assert_eq!(
            xxh3_128(data),
            want,
            "one-shot XXH3_128 of sanity buffer[..{len}]"
        );
        // Streaming, in uneven chunks (12 bytes, like our page records).
        let mut s = Xxh3Default::new();
        for chunk in data.chunks(12) {
            s.update(chunk);
        }
        assert_eq!(
            s.digest128(),
            want,
            "streaming XXH3_128 of sanity buffer[..{len}]"
        );
    }
}

/// The check value of CRC-32/ISO-HDLC and two other well-known values.
#[test]
fn kat_crc32_check_values() {
    assert_eq!(
        page_digest(DigestAlgorithm::CRC32, b"123456789"),
        Ok(0xCBF4_3926)
    );
    assert_eq!(page_digest(DigestAlgorithm::CRC32, b""), Ok(0));
    assert_eq!(
        page_digest(
            DigestAlgorithm::CRC32,
            b"The quick brown fox jumps over the lazy dog"
        ),
        Ok(0x414F_A339)
    );
}

#[test]
fn crc32_page_digest_is_zero_extended() {
    for len in [0usize, 1, 7, 4096, 65_537] {
        let p = pat(0, 0, len);
        let d = page_digest(DigestAlgorithm::CRC32, &p).unwrap();
        assert_eq!(d >> 32, 0);
        assert_eq!(d, u64::from(crc32fast::hash(&p)));
    }
}

/// We stream with `Xxh3Default`; the spec names XXH3 seed 0, i.e. `Xxh3::new()`.
#[test]
fn xxh3_default_state_equals_seed_zero_state() {
    let data = xxhash_sanity_buffer(5000);
    for len in [0usize, 25, 37, 240, 241, 1024, 5000] {
        let mut a = Xxh3Default::new();
        let mut b = Xxh3::new();
        a.update(&data[..len]);
        b.update(&data[..len]);
        assert_eq!(a.digest128(), b.digest128(), "len {len}");
    }
}

// ---------------------------------------------------------------------------------------
// Algorithms.

#[test]
fn supported_algorithms_default_first() {
    assert_eq!(
        supported_algorithms(),
        &[DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32]
    );
    for &a in supported_algorithms() {
        assert!(page_digest(a, b"x").is_ok());
        assert!(BufferDigester::new(a, BIND, 0).is_ok());
    }
}

#[test]
fn unknown_algorithm_is_unsupported() {
    let bad = DigestAlgorithm(99);
    assert_eq!(page_digest(bad, b"abc"), Err(UnsupportedAlgorithm(bad)));
    assert_eq!(
        BufferDigester::new(bad, BIND, 0).unwrap_err(),
        UnsupportedAlgorithm(bad)
    );
    let mut called = false;
    let r = digest_transfer(bad, BIND, 2, 2, true, |_, _| {
        called = true;
        &[][..]
    });
    assert_eq!(r, Err(UnsupportedAlgorithm(bad)));
    assert!(
        !called,
        "the page callback must not run for an unsupported algorithm"
    );
    // 0 is not an algorithm either ("none" cannot be negotiated).
    assert!(page_digest(DigestAlgorithm(0), b"").is_err());
    assert_eq!(
        UnsupportedAlgorithm(bad).to_string(),
        "unsupported digest algorithm Unknown(0x63)"
    );
}

/// Page digests come from twox-hash (SIMD chosen at run time) and everything else XXH3 from
/// xxhash-rust: both are the same XXH3-64 (seed 0), at every length class of the algorithm
/// (0, 1-3, 4-8, 9-16, 17-128, 129-240, and the long-input loop with a partial stripe and
/// block), so a page's digest does not depend on which computed it.
#[test]
fn page_digests_equal_xxhash_rusts_xxh3_64_at_every_length_class() {
    let buf = xxhash_sanity_buffer(3 * 1024 * 1024 + 77);
    for len in (0..=300).chain([
        1023,
        1024,
        1025,
        4096,
        65536,
        65536 + 17,
        1 << 20,
        buf.len(),
    ]) {
        assert_eq!(
            page_digest(DigestAlgorithm::XXH3_64, &buf[..len]).unwrap(),
            xxhash_rust::xxh3::xxh3_64(&buf[..len]),
            "length {len}"
        );
    }
}
