//! Wire codec tests: fuzzing `Frame::decode`, round trips of arbitrary valid frames, one
//! test per class of bad input, encoder limits, unknown codes, and the golden vectors in
//! `proto/vectors/` (assembled independently of this crate's encoder).

use kvwire_proto::wire::TransferId;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

use kvwire_proto::wire::{
    Abort, Commit, DecodeError, Digest128, DigestAlgorithm, EncodeError, ErrorCode, Frame,
    FrameType, Hello, HelloReject, KvLayout, Nack, Reject, Reserve, Role, TransferRef, HEADER_LEN,
    MAGIC, MAX_ACCESS, MAX_AUX, MAX_BUFFERS, MAX_DETAIL, MAX_DIGEST_ALGORITHMS, MAX_FINGERPRINT,
    MAX_PAGES, MAX_PAGE_DIGESTS, MAX_PAYLOAD, MAX_TRANSPORT_PARAMS, NONE_INDEX, TRAILER_LEN,
    VERSION,
};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;

// ---------------------------------------------------------------------------------------------
// A global allocator that records, per thread, the largest single allocation, so tests can
// check that a forged count does not make the decoder reserve memory up front.

struct PeakAlloc;

thread_local! {
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // A const-initialised `Cell` needs no lazy initialisation and no destructor, so touching
    // it never allocates; `try_with` tolerates thread teardown.
    let _ = PEAK.try_with(|p| p.set(p.get().max(size)));
}

// SAFETY: every method forwards its arguments unchanged to `System`, which upholds the
// `GlobalAlloc` contract; the bookkeeping in `note` neither allocates nor unwinds.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's guarantees for `alloc` are passed on to `System.alloc`.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes there).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: `ptr`/`layout` come from `System` (as above); the caller guarantees
        // `new_size` is valid for `layout`'s alignment.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: PeakAlloc = PeakAlloc;

/// Runs `f` and returns its result and the largest single allocation it made on this thread.
fn peak_alloc<R>(f: impl FnOnce() -> R) -> (R, usize) {
    PEAK.with(|p| p.set(0));
    let r = f();
    (r, PEAK.with(Cell::get))
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// A frame with the given header fields and payload, its length and CRC set correctly.
fn raw_frame(version: u16, frame_type: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len() + TRAILER_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&frame_type.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// A version-1 frame of the given type.
fn frame_v1(frame_type: FrameType, payload: &[u8]) -> Vec<u8> {
    raw_frame(VERSION, frame_type.0, payload)
}

/// The payload of an encoded frame.
fn payload_of(encoded: &[u8]) -> &[u8] {
    &encoded[HEADER_LEN..encoded.len() - TRAILER_LEN]
}

fn encode(frame: &Frame) -> Vec<u8> {
    frame
        .to_bytes()
        .unwrap_or_else(|e| panic!("encoding {frame:?}: {e}"))
}

/// What every decode result must satisfy, whatever the input.
fn check_decode_invariants(bytes: &[u8]) -> Result<(), TestCaseError> {
    match Frame::decode(bytes) {
        Ok((frame, n)) => {
            prop_assert!(n <= bytes.len(), "consumed {n} of {} bytes", bytes.len());
            prop_assert!(n >= HEADER_LEN + TRAILER_LEN);
            let again = frame
                .to_bytes()
                .map_err(|e| TestCaseError::fail(format!("re-encoding {frame:?}: {e}")))?;
            prop_assert_eq!(&again[..], &bytes[..n], "re-encoding {:?}", frame);
        }
        Err(DecodeError::Incomplete { needed }) => {
            prop_assert!(
                needed > bytes.len(),
                "Incomplete needs {needed} with {} bytes present",
                bytes.len()
            );
            prop_assert!(needed <= HEADER_LEN + MAX_PAYLOAD as usize + TRAILER_LEN);
        }
        Err(_) => {}
    }
    Ok(())
}

fn tref() -> TransferRef {
    TransferRef {
        transfer_id: TransferId(0x0102_0304_0506_0708),
        nonce: 0x1112_1314_1516_1718,
    }
}

fn sample_hello() -> Hello {
    Hello {
        node_id: 7,
        role: Role::SENDER,
        layout: KvLayout {
            tokens_per_page: 16,
            buffer_page_bytes: vec![4096, 8192],
            fingerprint: b"fp".to_vec(),
        },
        digests: vec![DigestAlgorithm::XXH3_64],
        transport_params: vec![9, 9],
        max_aux: 512,
    }
}

fn sample_reserve() -> Reserve {
    Reserve {
        transfer_id: TransferId(1),
        nonce: 2,
        tokens: 3,
        digest: DigestAlgorithm::XXH3_64,
        page_digests: false,
        deadline_ms: 100,
        pages: vec![0, 1],
        access: vec![],
    }
}

fn sample_commit() -> Commit {
    Commit {
        transfer: tref(),
        tokens: 1,
        pages: 1,
        bytes: 4096,
        digest: DigestAlgorithm::CRC32,
        buffer_digests: vec![Digest128::from_u128(5)],
        page_digests: vec![],
        aux_digest: Digest128::from_u128(6),
        aux: vec![],
    }
}

/// One frame of every type, each carrying `detail` where the type has one.
fn frames_with_detail(detail: &str) -> Vec<Frame> {
    vec![
        Frame::HelloReject(HelloReject {
            code: ErrorCode::LAYOUT_MISMATCH,
            detail: detail.to_owned(),
        }),
        Frame::Reject(Reject {
            transfer: tref(),
            code: ErrorCode::PROMPT_EXCEEDS_POOL,
            detail: detail.to_owned(),
        }),
        Frame::Nack(Nack {
            transfer: tref(),
            code: ErrorCode::DIGEST_MISMATCH,
            buffer: 1,
            page: NONE_INDEX,
            detail: detail.to_owned(),
        }),
        Frame::Abort(Abort {
            transfer: tref(),
            code: ErrorCode::CANCELLED,
            completed_pages: 0,
            detail: detail.to_owned(),
        }),
    ]
}

fn detail_of(frame: &Frame) -> &str {
    match frame {
        Frame::HelloReject(r) => &r.detail,
        Frame::Reject(r) => &r.detail,
        Frame::Nack(n) => &n.detail,
        Frame::Abort(a) => &a.detail,
        other => panic!("{other:?} has no detail"),
    }
}

// ---------------------------------------------------------------------------------------------
// Strategies for valid frames.

fn error_code() -> impl Strategy<Value = ErrorCode> {
    prop_oneof![
        prop::sample::select(ErrorCode::KNOWN),
        any::<u16>().prop_map(ErrorCode),
    ]
}

fn role() -> impl Strategy<Value = Role> {
    prop_oneof![
        prop::sample::select(Role::KNOWN),
        any::<u8>().prop_map(Role),
    ]
}

fn digest_algorithm() -> impl Strategy<Value = DigestAlgorithm> {
    prop_oneof![
        prop::sample::select(DigestAlgorithm::KNOWN),
        any::<u8>().prop_map(DigestAlgorithm),
    ]
}

/// Any string of at most 128 chars (<= 512 bytes, well under MAX_DETAIL), control and
/// multi-byte characters included.
fn detail() -> impl Strategy<Value = String> {
    prop::collection::vec(any::<char>(), 0..128).prop_map(String::from_iter)
}

fn transfer_ref() -> impl Strategy<Value = TransferRef> {
    (any::<u64>(), any::<u64>()).prop_map(|(transfer_id, nonce)| TransferRef {
        transfer_id: TransferId(transfer_id),
        nonce,
    })
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..=max)
}

fn hello() -> impl Strategy<Value = Hello> {
    (
        any::<u64>(),
        role(),
        any::<u32>(),
        prop::collection::vec(any::<u32>(), 0..64),
        bytes(MAX_FINGERPRINT),
        prop::collection::vec(digest_algorithm(), 0..=MAX_DIGEST_ALGORITHMS),
        bytes(512),
        prop_oneof![Just(0u32), Just(MAX_AUX as u32), 0..=MAX_AUX as u32],
    )
        .prop_map(
            |(
                node_id,
                role,
                tokens_per_page,
                buffer_page_bytes,
                fingerprint,
                digests,
                tp,
                max_aux,
            )| Hello {
                node_id,
                role,
                layout: KvLayout {
                    tokens_per_page,
                    buffer_page_bytes,
                    fingerprint,
                },
                digests,
                transport_params: tp,
                max_aux,
            },
        )
}

fn reserve() -> impl Strategy<Value = Reserve> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        digest_algorithm(),
        any::<bool>(),
        any::<u32>(),
        prop::collection::vec(any::<u32>(), 0..256),
        bytes(512),
    )
        .prop_map(
            |(transfer_id, nonce, tokens, digest, page_digests, deadline_ms, pages, access)| {
                Reserve {
                    transfer_id: TransferId(transfer_id),
                    nonce,
                    tokens,
                    digest,
                    page_digests,
                    deadline_ms,
                    pages,
                    access,
                }
            },
        )
}

fn commit() -> impl Strategy<Value = Commit> {
    (
        transfer_ref(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        digest_algorithm(),
        prop::collection::vec(any::<[u8; 16]>().prop_map(Digest128), 0..32),
        prop::collection::vec(any::<u64>(), 0..256),
        any::<[u8; 16]>().prop_map(Digest128),
        bytes(512),
    )
        .prop_map(
            |(
                transfer,
                tokens,
                pages,
                bytes,
                digest,
                buffer_digests,
                page_digests,
                aux_digest,
                aux,
            )| Commit {
                transfer,
                tokens,
                pages,
                bytes,
                digest,
                buffer_digests,
                page_digests,
                aux_digest,
                aux,
            },
        )
}

/// Any valid frame, of all ten types.
fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        hello().prop_map(Frame::Hello),
        hello().prop_map(Frame::HelloAck),
        Just(Frame::HelloConfirm),
        any::<u64>().prop_map(Frame::Ping),
        any::<u64>().prop_map(Frame::Pong),
        (error_code(), detail())
            .prop_map(|(code, detail)| Frame::HelloReject(HelloReject { code, detail })),
        reserve().prop_map(Frame::Reserve),
        (transfer_ref(), error_code(), detail()).prop_map(|(transfer, code, detail)| {
            Frame::Reject(Reject {
                transfer,
                code,
                detail,
            })
        }),
        commit().prop_map(Frame::Commit),
        transfer_ref().prop_map(Frame::Verified),
        (
            transfer_ref(),
            error_code(),
            any::<u32>(),
            any::<u32>(),
            detail()
        )
            .prop_map(|(transfer, code, buffer, page, detail)| {
                Frame::Nack(Nack {
                    transfer,
                    code,
                    buffer,
                    page,
                    detail,
                })
            }),
        (transfer_ref(), error_code(), any::<u32>(), detail()).prop_map(
            |(transfer, code, completed_pages, detail)| {
                Frame::Abort(Abort {
                    transfer,
                    code,
                    completed_pages,
                    detail,
                })
            }
        ),
        transfer_ref().prop_map(Frame::AbortAck),
    ]
}

// ---------------------------------------------------------------------------------------------
// Property tests.

/// 512 cases per property, or `PROPTEST_CASES` when set (for longer fuzzing runs).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Arbitrary bytes never make `decode` panic, and whatever it accepts re-encodes to exactly
    /// the bytes it consumed.
    #[test]
    fn decode_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        check_decode_invariants(&bytes)?;
    }

    /// Arbitrary bytes behind a valid magic, sometimes a valid version.
    #[test]
    fn decode_arbitrary_bytes_after_magic(
        version in prop_oneof![Just(VERSION), any::<u16>()],
        rest in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&rest);
        check_decode_invariants(&bytes)?;
    }

    /// Arbitrary payloads behind a valid header and a correct CRC reach payload parsing.
    #[test]
    fn decode_arbitrary_payload_with_valid_crc(
        frame_type in prop_oneof![
            8 => prop::sample::select(FrameType::KNOWN),
            1 => any::<u16>().prop_map(FrameType),
        ],
        payload in prop::collection::vec(any::<u8>(), 0..1024),
        trailing in prop::collection::vec(any::<u8>(), 0..8),
    ) {
        let mut bytes = frame_v1(frame_type, &payload);
        check_decode_invariants(&bytes)?;
        bytes.extend_from_slice(&trailing);
        check_decode_invariants(&bytes)?;
    }

    /// Valid frames with a few payload bytes overwritten and the CRC fixed up: reaches deep
    /// into every payload parser.
    #[test]
    fn decode_mutated_payload_with_valid_crc(
        frame in frame(),
        edits in prop::collection::vec((any::<Index>(), any::<u8>()), 1..6),
        cut in prop_oneof![Just(None), any::<Index>().prop_map(Some)],
    ) {
        let enc = encode(&frame);
        let mut payload = payload_of(&enc).to_vec();
        if let Some(cut) = cut {
            let keep = cut.index(payload.len() + 1);
            payload.truncate(keep);
        }
        if !payload.is_empty() {
            for (at, value) in &edits {
                let i = at.index(payload.len());
                payload[i] = *value;
            }
        }
        let bytes = frame_v1(frame.frame_type(), &payload);
        check_decode_invariants(&bytes)?;
    }

    /// encode -> decode is the identity and consumes exactly the encoding, also on a stream
    /// where more bytes follow.
    #[test]
    fn valid_frames_round_trip(frame in frame(), tail in prop::collection::vec(any::<u8>(), 0..32)) {
        let enc = encode(&frame);
        let (decoded, n) = Frame::decode(&enc).map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(&decoded, &frame);
        prop_assert_eq!(n, enc.len());

        let mut stream = enc.clone();
        stream.extend_from_slice(&tail);
        let (decoded, n) = Frame::decode(&stream).map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(&decoded, &frame);
        prop_assert_eq!(n, enc.len());

        // `encode` appends.
        let mut out = vec![0xAA, 0xBB];
        frame.encode(&mut out).map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(&out[..2], &[0xAA, 0xBB][..]);
        prop_assert_eq!(&out[2..], &enc[..]);
    }

    /// Every strict prefix of a valid encoding is `Incomplete`, with the exact byte count
    /// needed: the header length until the header is complete, then the whole frame.
    #[test]
    fn valid_frame_prefixes_are_incomplete(frame in frame()) {
        let enc = encode(&frame);
        for k in 0..enc.len() {
            let needed = if k < HEADER_LEN { HEADER_LEN } else { enc.len() };
            prop_assert_eq!(
                Frame::decode(&enc[..k]),
                Err(DecodeError::Incomplete { needed }),
                "prefix of {} of {} bytes", k, enc.len()
            );
        }
    }

    /// Flipping any single bit of a valid encoding gives an error, never a (different) frame.
    #[test]
    fn single_bit_flips_are_detected(
        frame in frame(),
        positions in prop::collection::vec(any::<Index>(), 32),
    ) {
        let enc = encode(&frame);
        let bits = enc.len() * 8;
        for at in &positions {
            let bit = at.index(bits);
            let mut bad = enc.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let got = Frame::decode(&bad);
            prop_assert!(got.is_err(), "flipping bit {} of {:?} decoded to {:?}", bit, frame, got);
        }
    }
}

/// Every bit of every golden vector, flipped one at a time, is detected.
#[test]
fn golden_vectors_every_bit_flip_is_detected() {
    for (name, expected) in golden_frames() {
        let enc = encode(&expected);
        for bit in 0..enc.len() * 8 {
            let mut bad = enc.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let got = Frame::decode(&bad);
            assert!(
                got.is_err(),
                "{name}: flipping bit {bit} decoded to {got:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One test per class of bad input.

#[test]
fn truncated_frame_is_incomplete() {
    let enc = encode(&Frame::Verified(tref()));
    assert_eq!(enc.len(), 32);
    assert_eq!(
        Frame::decode(&enc[..31]),
        Err(DecodeError::Incomplete { needed: 32 })
    );
    assert_eq!(
        Frame::decode(&enc[..12]),
        Err(DecodeError::Incomplete { needed: 32 })
    );
    assert_eq!(
        Frame::decode(&enc[..11]),
        Err(DecodeError::Incomplete { needed: HEADER_LEN })
    );
    assert_eq!(
        Frame::decode(&[]),
        Err(DecodeError::Incomplete { needed: HEADER_LEN })
    );
    // A partial magic that matches so far is incomplete, not bad.
    assert_eq!(
        Frame::decode(b"KV"),
        Err(DecodeError::Incomplete { needed: HEADER_LEN })
    );
}

#[test]
fn bad_crc() {
    let mut enc = encode(&Frame::AbortAck(tref()));
    let n = enc.len();
    let good = u32::from_le_bytes(enc[n - 4..].try_into().unwrap());
    enc[n - 1] ^= 0x80;
    let carried = u32::from_le_bytes(enc[n - 4..].try_into().unwrap());
    assert_eq!(
        Frame::decode(&enc),
        Err(DecodeError::BadCrc {
            carried,
            computed: good
        })
    );

    // A corrupted payload byte is a CRC error too, reported with the CRC of what arrived.
    let mut enc = encode(&Frame::AbortAck(tref()));
    enc[HEADER_LEN] ^= 1;
    let computed = crc32fast::hash(&enc[..n - 4]);
    assert_eq!(
        Frame::decode(&enc),
        Err(DecodeError::BadCrc {
            carried: good,
            computed
        })
    );
}

#[test]
fn unknown_frame_type_with_valid_crc() {
    let bytes = raw_frame(VERSION, 0x7777, &[1, 2, 3]);
    assert_eq!(
        Frame::decode(&bytes),
        Err(DecodeError::UnknownFrameType(FrameType(0x7777)))
    );
    // Also with an empty payload, and for a gap in the known range.
    assert_eq!(
        Frame::decode(&raw_frame(VERSION, 0x0005, &[])),
        Err(DecodeError::UnknownFrameType(FrameType(0x0005)))
    );
    // A flagged (authenticated, SPEC.md §3.11) type is unknown to the plain decoder.
    assert_eq!(
        Frame::decode(&raw_frame(VERSION, 0x8013, &[0; 56])),
        Err(DecodeError::UnknownFrameType(FrameType(0x8013)))
    );
    assert_eq!(
        Frame::decode(&raw_frame(VERSION, 0, &[])),
        Err(DecodeError::UnknownFrameType(FrameType(0)))
    );
}

#[test]
fn unsupported_version() {
    let payload = payload_of(&encode(&Frame::Verified(tref()))).to_vec();
    // Version 1 (the previous protocol) is refused like any other version.
    for v in [0u16, 1, 3, 0x0100, 0x0200, u16::MAX] {
        let bytes = raw_frame(v, FrameType::VERIFIED.0, &payload);
        assert_eq!(
            Frame::decode(&bytes),
            Err(DecodeError::UnsupportedVersion(v)),
            "version {v}"
        );
        // Reported from the header alone, before the payload or CRC arrive.
        assert_eq!(
            Frame::decode(&bytes[..HEADER_LEN]),
            Err(DecodeError::UnsupportedVersion(v)),
            "version {v}, header only"
        );
    }
}

#[test]
fn bad_magic() {
    let mut enc = encode(&Frame::Verified(tref()));
    enc[0] = b'X';
    assert_eq!(Frame::decode(&enc), Err(DecodeError::BadMagic(*b"XVWR")));
    // Reported as soon as the wrong byte is visible.
    assert_eq!(Frame::decode(b"X"), Err(DecodeError::BadMagic(*b"X\0\0\0")));
    assert_eq!(Frame::decode(b"KVX"), Err(DecodeError::BadMagic(*b"KVX\0")));
    assert_eq!(
        Frame::decode(b"GET / HTTP/1.1\r\n"),
        Err(DecodeError::BadMagic(*b"GET "))
    );
}

#[test]
fn payload_too_large_is_reported_from_the_header() {
    for len in [MAX_PAYLOAD + 1, u32::MAX] {
        let mut header = MAGIC.to_vec();
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&FrameType::COMMIT.0.to_le_bytes());
        header.extend_from_slice(&len.to_le_bytes());
        assert_eq!(
            Frame::decode(&header),
            Err(DecodeError::PayloadTooLarge { len })
        );
    }
    // Exactly MAX_PAYLOAD is allowed: the decoder asks for the rest.
    let mut header = MAGIC.to_vec();
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&FrameType::COMMIT.0.to_le_bytes());
    header.extend_from_slice(&MAX_PAYLOAD.to_le_bytes());
    assert_eq!(
        Frame::decode(&header),
        Err(DecodeError::Incomplete {
            needed: HEADER_LEN + MAX_PAYLOAD as usize + TRAILER_LEN
        })
    );
}

#[test]
fn trailing_bytes_inside_payload() {
    let mut payload = payload_of(&encode(&Frame::Verified(tref()))).to_vec();
    payload.push(0);
    assert_eq!(
        Frame::decode(&frame_v1(FrameType::VERIFIED, &payload)),
        Err(DecodeError::TrailingBytes { extra: 1 })
    );
    // For every frame type.
    for (name, frame) in golden_frames() {
        let mut payload = payload_of(&encode(&frame)).to_vec();
        payload.extend_from_slice(&[0, 0, 0]);
        assert_eq!(
            Frame::decode(&frame_v1(frame.frame_type(), &payload)),
            Err(DecodeError::TrailingBytes { extra: 3 }),
            "{name}"
        );
    }
}

#[test]
fn payload_ending_inside_a_field_is_truncated() {
    let payload = payload_of(&encode(&Frame::Verified(tref()))).to_vec();
    assert_eq!(
        Frame::decode(&frame_v1(FrameType::VERIFIED, &payload[..15])),
        Err(DecodeError::Truncated { field: "nonce" })
    );
    assert_eq!(
        Frame::decode(&frame_v1(FrameType::VERIFIED, &[])),
        Err(DecodeError::Truncated {
            field: "transfer_id"
        })
    );
    // Every strict prefix of every payload, behind a correct header and CRC.
    for (name, frame) in golden_frames() {
        let payload = payload_of(&encode(&frame)).to_vec();
        for k in 0..payload.len() {
            let got = Frame::decode(&frame_v1(frame.frame_type(), &payload[..k]));
            assert!(
                matches!(got, Err(DecodeError::Truncated { .. })),
                "{name}: payload cut to {k} bytes gave {got:?}"
            );
        }
    }
}

/// Payload bytes of a RESERVE up to (not including) the page count.
fn reserve_head() -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&1u64.to_le_bytes());
    p.extend_from_slice(&2u64.to_le_bytes());
    p.extend_from_slice(&3u32.to_le_bytes());
    p.push(DigestAlgorithm::XXH3_64.0);
    p.push(0);
    p.extend_from_slice(&100u32.to_le_bytes());
    p
}

/// Payload bytes of a COMMIT up to (not including) the buffer digest count.
fn commit_head() -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&1u64.to_le_bytes());
    p.extend_from_slice(&2u64.to_le_bytes());
    p.extend_from_slice(&3u32.to_le_bytes());
    p.extend_from_slice(&1u32.to_le_bytes());
    p.extend_from_slice(&4096u64.to_le_bytes());
    p.push(DigestAlgorithm::XXH3_64.0);
    p
}

/// Payload bytes of a HELLO up to (not including) the buffer count.
fn hello_head() -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&7u64.to_le_bytes());
    p.push(Role::SENDER.0);
    p.extend_from_slice(&16u32.to_le_bytes());
    p
}

/// Decodes `bytes`, asserts the error, and that decoding allocated nothing large.
fn assert_decode_err_small_alloc(bytes: &[u8], want: DecodeError) {
    let (got, peak) = peak_alloc(|| Frame::decode(bytes));
    assert_eq!(got, Err(want));
    assert!(
        peak <= 1024,
        "decoding a {}-byte frame allocated {peak} bytes at once",
        bytes.len()
    );
}

#[test]
fn allocation_meter_sees_decoder_allocations() {
    // Positive control for `peak_alloc`: an honest 1000-page RESERVE allocates its page list.
    let frame = Frame::Reserve(Reserve {
        pages: (0..1000).collect(),
        ..sample_reserve()
    });
    let enc = encode(&frame);
    let (got, peak) = peak_alloc(|| Frame::decode(&enc));
    assert_eq!(got, Ok((frame, enc.len())));
    assert!(peak >= 4000, "peak {peak}");
}

#[test]
fn forged_counts_are_refused_without_allocating() {
    // RESERVE pages: over the limit, then at the limit with nothing behind it.
    let mut p = reserve_head();
    p.extend_from_slice(&0xFFFF_FFFFu32.to_le_bytes());
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::RESERVE, &p),
        DecodeError::TooMany {
            field: "pages",
            count: 0xFFFF_FFFF,
            max: MAX_PAGES as u64,
        },
    );
    let mut p = reserve_head();
    p.extend_from_slice(&(MAX_PAGES as u32).to_le_bytes());
    p.extend_from_slice(&[0; 12]);
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::RESERVE, &p),
        DecodeError::Truncated { field: "pages" },
    );
    // RESERVE access blob longer than what is left.
    let mut p = reserve_head();
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&(MAX_ACCESS as u16).to_le_bytes());
    p.extend_from_slice(&[1, 2, 3]);
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::RESERVE, &p),
        DecodeError::Truncated { field: "access" },
    );
    let mut p = reserve_head();
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&u16::MAX.to_le_bytes());
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::RESERVE, &p),
        DecodeError::TooMany {
            field: "access",
            count: u64::from(u16::MAX),
            max: MAX_ACCESS as u64,
        },
    );

    // COMMIT buffer digests.
    let mut p = commit_head();
    p.extend_from_slice(&u16::MAX.to_le_bytes());
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::COMMIT, &p),
        DecodeError::TooMany {
            field: "buffer_digests",
            count: u64::from(u16::MAX),
            max: MAX_BUFFERS as u64,
        },
    );
    let mut p = commit_head();
    p.extend_from_slice(&(MAX_BUFFERS as u16).to_le_bytes());
    p.extend_from_slice(&[0; 20]);
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::COMMIT, &p),
        DecodeError::Truncated {
            field: "buffer_digests",
        },
    );
    // COMMIT page digests.
    let mut p = commit_head();
    p.extend_from_slice(&0u16.to_le_bytes());
    p.extend_from_slice(&0xFFFF_FFFFu32.to_le_bytes());
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::COMMIT, &p),
        DecodeError::TooMany {
            field: "page_digests",
            count: 0xFFFF_FFFF,
            max: MAX_PAGE_DIGESTS as u64,
        },
    );
    let mut p = commit_head();
    p.extend_from_slice(&0u16.to_le_bytes());
    p.extend_from_slice(&(MAX_PAGE_DIGESTS as u32).to_le_bytes());
    p.extend_from_slice(&[0; 8]);
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::COMMIT, &p),
        DecodeError::Truncated {
            field: "page_digests",
        },
    );

    // HELLO buffers, fingerprint, digests, transport params.
    let mut p = hello_head();
    p.extend_from_slice(&u16::MAX.to_le_bytes());
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::HELLO, &p),
        DecodeError::TooMany {
            field: "buffers",
            count: u64::from(u16::MAX),
            max: MAX_BUFFERS as u64,
        },
    );
    let mut p = hello_head();
    p.extend_from_slice(&(MAX_BUFFERS as u16).to_le_bytes());
    p.extend_from_slice(&[0; 8]);
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::HELLO_ACK, &p),
        DecodeError::Truncated { field: "buffers" },
    );
    let mut p = hello_head();
    p.extend_from_slice(&0u16.to_le_bytes());
    p.push(255);
    p.extend_from_slice(b"short");
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::HELLO, &p),
        DecodeError::Truncated {
            field: "fingerprint",
        },
    );
    let mut p = hello_head();
    p.extend_from_slice(&0u16.to_le_bytes());
    p.push(0);
    p.push(MAX_DIGEST_ALGORITHMS as u8 + 1);
    p.extend_from_slice(&[1; 17]);
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::HELLO, &p),
        DecodeError::TooMany {
            field: "digests",
            count: MAX_DIGEST_ALGORITHMS as u64 + 1,
            max: MAX_DIGEST_ALGORITHMS as u64,
        },
    );
    let mut p = hello_head();
    p.extend_from_slice(&0u16.to_le_bytes());
    p.push(0);
    p.push(0);
    p.extend_from_slice(&u16::MAX.to_le_bytes());
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::HELLO, &p),
        DecodeError::TooMany {
            field: "transport_params",
            count: u64::from(u16::MAX),
            max: MAX_TRANSPORT_PARAMS as u64,
        },
    );

    // Detail strings.
    let mut p = ErrorCode::SHUTDOWN.0.to_le_bytes().to_vec();
    p.extend_from_slice(&u16::MAX.to_le_bytes());
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::HELLO_REJECT, &p),
        DecodeError::TooMany {
            field: "detail",
            count: u64::from(u16::MAX),
            max: MAX_DETAIL as u64,
        },
    );
    let mut p = ErrorCode::SHUTDOWN.0.to_le_bytes().to_vec();
    p.extend_from_slice(&(MAX_DETAIL as u16).to_le_bytes());
    p.extend_from_slice(b"abc");
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::HELLO_REJECT, &p),
        DecodeError::Truncated { field: "detail" },
    );
}

#[test]
fn invalid_utf8_detail() {
    for bad in [
        &[0xFF_u8, 0xFE][..],
        b"ok\xC0\x80",
        b"\xED\xA0\x80",
        b"cut\xE2\x82",
    ] {
        for frame in frames_with_detail("") {
            let mut payload = payload_of(&encode(&frame)).to_vec();
            // The empty detail is the last field: replace its length prefix.
            payload.truncate(payload.len() - 2);
            payload.extend_from_slice(&(bad.len() as u16).to_le_bytes());
            payload.extend_from_slice(bad);
            assert_eq!(
                Frame::decode(&frame_v1(frame.frame_type(), &payload)),
                Err(DecodeError::InvalidUtf8 { field: "detail" }),
                "{:?} with detail bytes {bad:02x?}",
                frame.frame_type()
            );
        }
    }
}

#[test]
fn page_digests_flag_must_be_zero_or_one() {
    let enc = encode(&Frame::Reserve(sample_reserve()));
    let mut payload = payload_of(&enc).to_vec();
    // transfer_id(8) nonce(8) tokens(4) digest(1) then the flag.
    const FLAG: usize = 21;
    assert_eq!(payload[FLAG], 0);
    for v in [2u8, 0x80, 0xFF] {
        payload[FLAG] = v;
        assert_eq!(
            Frame::decode(&frame_v1(FrameType::RESERVE, &payload)),
            Err(DecodeError::InvalidValue {
                field: "page_digests",
                value: u64::from(v)
            })
        );
    }
    payload[FLAG] = 1;
    let (frame, _) = Frame::decode(&frame_v1(FrameType::RESERVE, &payload)).unwrap();
    assert!(matches!(
        frame,
        Frame::Reserve(Reserve {
            page_digests: true,
            ..
        })
    ));
}

// ---------------------------------------------------------------------------------------------
// Encoder limits.

/// Asserts encoding fails with exactly `want` and leaves `out` as it was.
fn assert_encode_too_large(frame: &Frame, want: EncodeError) {
    let mut out = b"earlier frames".to_vec();
    assert_eq!(frame.encode(&mut out), Err(want));
    assert_eq!(out, b"earlier frames", "output changed on error");
    assert!(frame.to_bytes().is_err());
}

fn too_large(field: &'static str, len: usize, max: usize) -> EncodeError {
    EncodeError::TooLarge { field, len, max }
}

#[test]
fn encoding_over_limit_fields_fails_and_leaves_output_unchanged() {
    let mut h = sample_hello();
    h.layout.buffer_page_bytes = vec![1; MAX_BUFFERS + 1];
    assert_encode_too_large(
        &Frame::Hello(h),
        too_large("buffers", MAX_BUFFERS + 1, MAX_BUFFERS),
    );
    let mut h = sample_hello();
    h.layout.fingerprint = vec![1; MAX_FINGERPRINT + 1];
    assert_encode_too_large(
        &Frame::HelloAck(h),
        too_large("fingerprint", MAX_FINGERPRINT + 1, MAX_FINGERPRINT),
    );
    let mut h = sample_hello();
    h.digests = vec![DigestAlgorithm::CRC32; MAX_DIGEST_ALGORITHMS + 1];
    assert_encode_too_large(
        &Frame::Hello(h),
        too_large("digests", MAX_DIGEST_ALGORITHMS + 1, MAX_DIGEST_ALGORITHMS),
    );
    let mut h = sample_hello();
    h.transport_params = vec![1; MAX_TRANSPORT_PARAMS + 1];
    assert_encode_too_large(
        &Frame::Hello(h),
        too_large(
            "transport_params",
            MAX_TRANSPORT_PARAMS + 1,
            MAX_TRANSPORT_PARAMS,
        ),
    );

    let mut r = sample_reserve();
    r.pages = vec![0; MAX_PAGES + 1];
    assert_encode_too_large(
        &Frame::Reserve(r),
        too_large("pages", MAX_PAGES + 1, MAX_PAGES),
    );
    let mut r = sample_reserve();
    r.access = vec![0; MAX_ACCESS + 1];
    assert_encode_too_large(
        &Frame::Reserve(r),
        too_large("access", MAX_ACCESS + 1, MAX_ACCESS),
    );

    let mut c = sample_commit();
    c.buffer_digests = vec![Digest128::from_u128(1); MAX_BUFFERS + 1];
    assert_encode_too_large(
        &Frame::Commit(c),
        too_large("buffer_digests", MAX_BUFFERS + 1, MAX_BUFFERS),
    );
    let mut c = sample_commit();
    c.page_digests = vec![1; MAX_PAGE_DIGESTS + 1];
    assert_encode_too_large(
        &Frame::Commit(c),
        too_large("page_digests", MAX_PAGE_DIGESTS + 1, MAX_PAGE_DIGESTS),
    );
    let mut c = sample_commit();
    c.aux = vec![7; MAX_AUX + 1];
    assert_encode_too_large(&Frame::Commit(c), too_large("aux", MAX_AUX + 1, MAX_AUX));
    let mut h = sample_hello();
    h.max_aux = MAX_AUX as u32 + 1;
    assert_encode_too_large(
        &Frame::HelloAck(h),
        too_large("max_aux", MAX_AUX + 1, MAX_AUX),
    );
}

/// A hello announcing a `max_aux` over the wire limit is a decode error (TooMany), and a
/// COMMIT's aux length over MAX_AUX, or longer than what is left, is refused without
/// allocating for it.
#[test]
fn aux_limits_are_enforced_by_the_decoder() {
    let enc = encode(&Frame::Hello(sample_hello()));
    let mut payload = payload_of(&enc).to_vec();
    let at = payload.len() - 4;
    for (max_aux, ok) in [
        (MAX_AUX as u32, true),
        (MAX_AUX as u32 + 1, false),
        (u32::MAX, false),
    ] {
        payload[at..].copy_from_slice(&max_aux.to_le_bytes());
        let got = Frame::decode(&frame_v1(FrameType::HELLO, &payload));
        if ok {
            assert!(matches!(got, Ok((Frame::Hello(h), _)) if h.max_aux == max_aux));
        } else {
            assert_eq!(
                got,
                Err(DecodeError::TooMany {
                    field: "max_aux",
                    count: u64::from(max_aux),
                    max: MAX_AUX as u64,
                })
            );
        }
    }
    // COMMIT: head, no buffer or page digests, an aux digest, then the aux length.
    let mut p = commit_head();
    p.extend_from_slice(&0u16.to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&[9; 16]);
    let mut over = p.clone();
    over.extend_from_slice(&(MAX_AUX as u32 + 1).to_le_bytes());
    over.extend_from_slice(&[0; 8]);
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::COMMIT, &over),
        DecodeError::TooMany {
            field: "aux",
            count: MAX_AUX as u64 + 1,
            max: MAX_AUX as u64,
        },
    );
    let mut short = p.clone();
    short.extend_from_slice(&(MAX_AUX as u32).to_le_bytes());
    short.extend_from_slice(&[0; 8]);
    assert_decode_err_small_alloc(
        &frame_v1(FrameType::COMMIT, &short),
        DecodeError::Truncated { field: "aux" },
    );
    // At the limit, present in full: decodes.
    let mut full = p;
    full.extend_from_slice(&(MAX_AUX as u32).to_le_bytes());
    full.extend_from_slice(&vec![0xAB; MAX_AUX]);
    let (frame, _) = Frame::decode(&frame_v1(FrameType::COMMIT, &full)).unwrap();
    assert!(
        matches!(frame, Frame::Commit(c) if c.aux.len() == MAX_AUX && c.aux_digest.0 == [9; 16])
    );
}

/// `commit_fits` counts the aux record: a COMMIT it accepts, with an aux of that length,
/// page digests for every page and the seal's overhead, encodes within MAX_PAYLOAD; one page
/// more does not fit.
#[test]
fn commit_fits_accounts_for_the_aux_record() {
    use kvwire_proto::wire::commit_fits;
    for (buffers, aux) in [(64usize, 0usize), (64, MAX_AUX), (7, 4096), (1, MAX_AUX)] {
        let max_pages = (1..=MAX_PAGES)
            .take_while(|&p| commit_fits(buffers, p, true, aux))
            .last()
            .unwrap();
        assert!(max_pages == MAX_PAGES || !commit_fits(buffers, max_pages + 1, true, aux));
        assert!(commit_fits(buffers, MAX_PAGES, false, aux));
        let c = Commit {
            buffer_digests: vec![Digest128::from_u128(1); buffers],
            page_digests: vec![1; buffers * max_pages],
            aux: vec![2; aux],
            ..sample_commit()
        };
        let enc = encode(&Frame::Commit(c));
        // Room for the 40 bytes a seal adds (SPEC.md §3.11).
        assert!(enc.len() - HEADER_LEN - TRAILER_LEN + 40 <= MAX_PAYLOAD as usize);
        if max_pages < MAX_PAGES {
            assert!(
                enc.len() - HEADER_LEN - TRAILER_LEN + 40 + 8 * buffers > MAX_PAYLOAD as usize,
                "commit_fits is tighter than needed for {buffers} buffers, aux {aux}"
            );
        }
    }
    assert!(!commit_fits(1, 1, false, MAX_AUX + 1));
}

#[test]
fn payload_limit_is_exact() {
    // A COMMIT with MAX_BUFFERS buffer digests and as many page digests as fit (and an
    // empty aux: aux digest 16, aux length 4).
    let fixed = 16 + 4 + 4 + 8 + 1 + 2 + 16 * MAX_BUFFERS + 4 + 16 + 4;
    let fit = (MAX_PAYLOAD as usize - fixed) / 8;
    assert!(fit <= MAX_PAGE_DIGESTS);
    let mut c = sample_commit();
    c.buffer_digests = (0..MAX_BUFFERS as u128)
        .map(|i| Digest128::from_u128(i + 1))
        .collect();
    c.page_digests = (0..fit as u64).collect();
    let frame = Frame::Commit(c.clone());
    let enc = encode(&frame);
    assert_eq!(enc.len(), HEADER_LEN + fixed + 8 * fit + TRAILER_LEN);
    assert_eq!(Frame::decode(&enc), Ok((frame, enc.len())));

    c.page_digests.push(0);
    assert_encode_too_large(
        &Frame::Commit(c),
        too_large("payload", fixed + 8 * (fit + 1), MAX_PAYLOAD as usize),
    );
}

#[test]
fn fields_at_their_limits_round_trip() {
    let h = Hello {
        node_id: u64::MAX,
        role: Role(0xFF),
        layout: KvLayout {
            tokens_per_page: u32::MAX,
            buffer_page_bytes: (0..MAX_BUFFERS as u32).collect(),
            fingerprint: vec![0xFF; MAX_FINGERPRINT],
        },
        digests: (0..MAX_DIGEST_ALGORITHMS as u8)
            .map(DigestAlgorithm)
            .collect(),
        transport_params: vec![0xEE; MAX_TRANSPORT_PARAMS],
        max_aux: MAX_AUX as u32,
    };
    let r = Reserve {
        pages: (0..MAX_PAGES as u32).rev().collect(),
        access: vec![0xAB; MAX_ACCESS],
        page_digests: true,
        ..sample_reserve()
    };
    for frame in [
        Frame::Hello(h.clone()),
        Frame::HelloAck(h),
        Frame::Reserve(r),
    ] {
        let enc = encode(&frame);
        assert_eq!(Frame::decode(&enc), Ok((frame, enc.len())));
    }
    for frame in frames_with_detail(&"d".repeat(MAX_DETAIL)) {
        let enc = encode(&frame);
        assert_eq!(Frame::decode(&enc), Ok((frame, enc.len())));
    }
}

#[test]
fn long_detail_is_cut_at_a_char_boundary() {
    let cases = [
        // 1025 ASCII bytes: cut to exactly MAX_DETAIL.
        "x".repeat(MAX_DETAIL + 1),
        // 3-byte chars: 1024 is not a boundary, 1023 is.
        "€".repeat(400),
        // 2 + 4k bytes: the nearest boundary below 1024 is 1022.
        format!("ab{}", "𝄞".repeat(300)),
        // 2-byte chars behind one ASCII byte: boundaries at odd offsets, so 1023.
        format!("a{}", "é".repeat(600)),
    ];
    for long in &cases {
        assert!(long.len() > MAX_DETAIL);
        let mut cut = MAX_DETAIL;
        while !long.is_char_boundary(cut) {
            cut -= 1;
        }
        let want = &long[..cut];
        for frame in frames_with_detail(long) {
            let enc = encode(&frame);
            let (decoded, n) = Frame::decode(&enc).unwrap();
            assert_eq!(n, enc.len());
            let got = detail_of(&decoded);
            assert_eq!(got.len(), cut, "{:?}", frame.frame_type());
            assert_eq!(got, want);
            // Everything but the detail survives.
            let mut expected = frames_with_detail(want);
            expected.retain(|f| f.frame_type() == frame.frame_type());
            assert_eq!(decoded, expected[0]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Unknown codes.

#[test]
fn unknown_codes_are_preserved_and_displayed() {
    let frames = [
        Frame::HelloReject(HelloReject {
            code: ErrorCode(0x1234),
            detail: String::new(),
        }),
        Frame::Hello(Hello {
            role: Role(0x7F),
            digests: vec![
                DigestAlgorithm(0xEE),
                DigestAlgorithm::XXH3_64,
                DigestAlgorithm(0),
            ],
            ..sample_hello()
        }),
        Frame::Reserve(Reserve {
            digest: DigestAlgorithm(0x33),
            ..sample_reserve()
        }),
        Frame::Nack(Nack {
            transfer: tref(),
            code: ErrorCode(0xFFFF),
            buffer: NONE_INDEX,
            page: NONE_INDEX,
            detail: String::new(),
        }),
    ];
    for frame in frames {
        let enc = encode(&frame);
        assert_eq!(Frame::decode(&enc), Ok((frame, enc.len())));
    }

    assert!(!ErrorCode(0x1234).is_known());
    assert_eq!(ErrorCode(0x1234).name(), None);
    assert_eq!(format!("{:?}", ErrorCode(0x1234)), "Unknown(0x1234)");
    assert_eq!(format!("{}", ErrorCode(0x1234)), "Unknown(0x1234)");
    assert_eq!(format!("{}", Role(0x7F)), "Unknown(0x7f)");
    assert_eq!(format!("{:?}", Role(0)), "Unknown(0x0)");
    assert_eq!(format!("{}", DigestAlgorithm(0xEE)), "Unknown(0xee)");
    assert_eq!(format!("{}", FrameType(0x7777)), "Unknown(0x7777)");
    assert_eq!(
        DecodeError::UnknownFrameType(FrameType(0x7777)).to_string(),
        "unknown frame type Unknown(0x7777)"
    );

    // Known codes display their specification names.
    assert_eq!(
        format!("{}", ErrorCode::PROMPT_EXCEEDS_POOL),
        "PROMPT_EXCEEDS_POOL"
    );
    assert_eq!(format!("{:?}", Role::RECEIVER), "RECEIVER");
    assert_eq!(format!("{}", DigestAlgorithm::XXH3_64), "XXH3_64");
    assert_eq!(format!("{}", FrameType::ABORT_ACK), "ABORT_ACK");
    for c in ErrorCode::KNOWN {
        assert!(c.is_known());
        assert!(!format!("{c}").starts_with("Unknown"));
    }
    // A list of codes keeps unknown entries distinguishable.
    assert_eq!(
        format!("{:?}", [DigestAlgorithm::CRC32, DigestAlgorithm(9)]),
        "[CRC32, Unknown(0x9)]"
    );
}

// ---------------------------------------------------------------------------------------------
// Golden vectors (proto/vectors/*.hex), assembled by hand from the documented layout.

fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("vectors")
}

/// Parses a vector file: full-line `#` comments, then lowercase hex with any whitespace.
fn read_vector(name: &str) -> Vec<u8> {
    let path = vectors_dir().join(format!("{name}.hex"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let digits: Vec<u8> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| l.bytes())
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    assert!(
        digits.len() % 2 == 0,
        "{}: odd number of hex digits",
        path.display()
    );
    digits
        .chunks(2)
        .map(|pair| {
            let hex = std::str::from_utf8(pair).unwrap();
            assert!(
                pair.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
                "{}: `{hex}` is not lowercase hex",
                path.display()
            );
            u8::from_str_radix(hex, 16).unwrap()
        })
        .collect()
}

const TID: u64 = 0x0102_0304_0506_0708;
const NONCE: u64 = 0x1112_1314_1516_1718;
const GOLDEN_REF: TransferRef = TransferRef {
    transfer_id: TransferId(TID),
    nonce: NONCE,
};

fn golden_layout() -> KvLayout {
    KvLayout {
        tokens_per_page: 16,
        buffer_page_bytes: vec![65_536, 32_768],
        fingerprint: b"llama-3-8b/tp2of8".to_vec(),
    }
}

/// The frames the vectors hold, by file name, written out field by field.
fn golden_frames() -> Vec<(&'static str, Frame)> {
    vec![
        (
            "hello",
            Frame::Hello(Hello {
                node_id: 0x2122_2324_2526_2728,
                role: Role::SENDER,
                layout: golden_layout(),
                digests: vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32],
                transport_params: vec![1, 2, 3, 4],
                max_aux: 0,
            }),
        ),
        (
            "hello_ack",
            Frame::HelloAck(Hello {
                node_id: 0x3132_3334_3536_3738,
                role: Role::RECEIVER,
                layout: golden_layout(),
                digests: vec![DigestAlgorithm::CRC32, DigestAlgorithm::XXH3_64],
                transport_params: vec![],
                max_aux: 4096,
            }),
        ),
        (
            "hello_reject",
            Frame::HelloReject(HelloReject {
                code: ErrorCode::LAYOUT_MISMATCH,
                detail: "tokens per page: local 16, peer 32".into(),
            }),
        ),
        (
            "reserve",
            Frame::Reserve(Reserve {
                transfer_id: TransferId(TID),
                nonce: NONCE,
                tokens: 40,
                digest: DigestAlgorithm::XXH3_64,
                page_digests: true,
                deadline_ms: 5000,
                pages: vec![7, 3, 0x0001_2345],
                access: vec![0xDE, 0xAD, 0xBE, 0xEF, 0x00, 0x01],
            }),
        ),
        (
            "reject",
            Frame::Reject(Reject {
                transfer: GOLDEN_REF,
                code: ErrorCode::PROMPT_EXCEEDS_POOL,
                detail: "prompt needs 9 pages, pool has 8".into(),
            }),
        ),
        (
            "commit",
            Frame::Commit(Commit {
                transfer: GOLDEN_REF,
                tokens: 40,
                pages: 3,
                bytes: 3 * (65_536 + 32_768),
                digest: DigestAlgorithm::XXH3_64,
                buffer_digests: vec![
                    Digest128(core::array::from_fn(|i| i as u8)),
                    Digest128(core::array::from_fn(|i| 0x10 + i as u8)),
                ],
                page_digests: (0..6).map(|i| 0xA0A1_A2A3_A4A5_A6A0 + i).collect(),
                aux_digest: Digest128(core::array::from_fn(|i| 0x20 + i as u8)),
                aux: vec![],
            }),
        ),
        (
            "commit_aux",
            Frame::Commit(Commit {
                transfer: GOLDEN_REF,
                tokens: 16,
                pages: 1,
                bytes: 65_536 + 32_768,
                digest: DigestAlgorithm::CRC32,
                buffer_digests: vec![
                    Digest128(core::array::from_fn(|i| i as u8)),
                    Digest128(core::array::from_fn(|i| 0x10 + i as u8)),
                ],
                page_digests: vec![],
                aux_digest: Digest128(core::array::from_fn(|i| 0x30 + i as u8)),
                aux: [
                    &128_000u32.to_le_bytes()[..],
                    &[0x70, 0x71, 0x72, 0x73, 0x74, 0x75, 0x76, 0x77],
                ]
                .concat(),
            }),
        ),
        ("verified", Frame::Verified(GOLDEN_REF)),
        (
            "nack",
            Frame::Nack(Nack {
                transfer: GOLDEN_REF,
                code: ErrorCode::DIGEST_MISMATCH,
                buffer: 1,
                page: 2,
                detail: "digest mismatch in buffer 1, page ordinal 2".into(),
            }),
        ),
        (
            "abort",
            Frame::Abort(Abort {
                transfer: GOLDEN_REF,
                code: ErrorCode::CANCELLED,
                completed_pages: 2,
                detail: "cancelled by engine \u{2014} client gone".into(),
            }),
        ),
        ("abort_ack", Frame::AbortAck(GOLDEN_REF)),
        ("ping", Frame::Ping(0x0102_0304_0506_0708)),
        ("pong", Frame::Pong(0x0102_0304_0506_0708)),
    ]
}

#[test]
fn golden_vectors_cover_every_frame_type_and_nothing_else() {
    let frames = golden_frames();
    let mut types: Vec<FrameType> = frames.iter().map(|(_, f)| f.frame_type()).collect();
    types.push(FrameType::HELLO_CONFIRM); // only sealed: auth/hello_confirm.hex (below)
    types.sort();
    types.dedup();
    assert_eq!(types, FrameType::KNOWN);
    // SPEC §3.6: an unsealed HELLO_CONFIRM is never valid, so no plain vector shows one; its
    // only vector is the sealed one.
    assert!(!vectors_dir().join("hello_confirm.hex").exists());
    assert!(vectors_dir()
        .join("auth")
        .join("hello_confirm.hex")
        .exists());

    let mut on_disk: Vec<String> = std::fs::read_dir(vectors_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter_map(|n| n.strip_suffix(".hex").map(str::to_owned))
        .collect();
    on_disk.sort();
    let mut expected: Vec<String> = frames.iter().map(|(n, _)| (*n).to_owned()).collect();
    expected.sort();
    assert_eq!(
        on_disk, expected,
        "every vector file needs an expected frame"
    );
}

#[test]
fn golden_vectors_decode() {
    for (name, expected) in golden_frames() {
        let bytes = read_vector(name);
        assert_eq!(
            Frame::decode(&bytes),
            Ok((expected, bytes.len())),
            "vector {name}"
        );
    }
}

#[test]
fn golden_vectors_encode() {
    for (name, frame) in golden_frames() {
        let bytes = read_vector(name);
        assert_eq!(encode(&frame), bytes, "vector {name}");
    }
}

#[test]
fn golden_vectors_header_fields() {
    for (name, frame) in golden_frames() {
        let bytes = read_vector(name);
        assert_eq!(&bytes[..4], b"KVWR", "{name}");
        assert_eq!(u16::from_le_bytes([bytes[4], bytes[5]]), VERSION, "{name}");
        assert_eq!(VERSION, 2);
        assert_eq!(
            u16::from_le_bytes([bytes[6], bytes[7]]),
            frame.frame_type().0,
            "{name}"
        );
        let len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
        assert_eq!(bytes.len(), HEADER_LEN + len + TRAILER_LEN, "{name}");
        let crc = u32::from_le_bytes(bytes[bytes.len() - 4..].try_into().unwrap());
        assert_eq!(crc, crc32fast::hash(&bytes[..bytes.len() - 4]), "{name}");
    }
}

#[test]
fn concatenated_golden_vectors_decode_as_a_stream() {
    let frames = golden_frames();
    let mut stream = Vec::new();
    for (name, _) in &frames {
        stream.extend_from_slice(&read_vector(name));
    }
    let mut at = 0;
    for (name, expected) in frames {
        let (frame, n) = Frame::decode(&stream[at..]).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(frame, expected, "{name}");
        at += n;
    }
    assert_eq!(at, stream.len());
    assert_eq!(
        Frame::decode(&stream[at..]),
        Err(DecodeError::Incomplete { needed: HEADER_LEN })
    );
}
