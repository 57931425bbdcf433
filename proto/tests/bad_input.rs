//! Bad peer input, one test per class (SPEC.md §7.3): each asserts the typed error, the
//! scope SPEC.md names (frame dropped, transfer failed, connection closed), and that no
//! page is leaked: every page a failed reservation held is released, after its fence.
//! Decoder-level detail (field order, allocation bounds) is in `codec.rs`; this file checks
//! what the sessions and drivers do with each class.

use kvwire_proto::wire::TransferId;
use std::time::{Duration, Instant};

mod common;

use kvwire_proto::admission::{AdmissionPolicy, Request};
use kvwire_proto::handshake::Established;
use kvwire_proto::receiver::{
    ReceiverAction, ReceiverConfig, ReceiverEvent, ReceiverSession, ReservationRequest,
    ReserveError,
};
use kvwire_proto::sender::{SenderAction, SenderConfig, SenderEvent, SenderSession, WriteOutcome};
use kvwire_proto::wire::{
    Abort, Commit, DecodeError, DigestAlgorithm, ErrorCode, Frame, FrameType, Hello, KvLayout,
    Reserve, Role, TransferRef, MAX_PAGES, MAX_PAYLOAD,
};
use kvwire_proto::{FailureReason, Scope};

fn layout() -> KvLayout {
    KvLayout {
        tokens_per_page: 16,
        buffer_page_bytes: vec![4096],
        fingerprint: b"m".to_vec(),
    }
}

fn established(role: Role) -> Established {
    let hello = |role| Hello {
        node_id: 1,
        role,
        layout: layout(),
        digests: vec![DigestAlgorithm::XXH3_64],
        transport_params: vec![],
        max_aux: 64,
    };
    let peer = if role == Role::SENDER {
        Role::RECEIVER
    } else {
        Role::SENDER
    };
    Established {
        local: hello(role),
        peer: hello(peer),
        digests: vec![DigestAlgorithm::XXH3_64],
    }
}

/// A receiver with one open reservation of pages [3, 4] for transfer 1.
fn receiver(now: Instant) -> (ReceiverSession, TransferRef) {
    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
    );
    let t = r
        .reserve(now, common::reservation_request(TransferId(1)))
        .unwrap();
    assert!(matches!(r.poll_transmit(), Some(Frame::Reserve(_))));
    (r, t)
}

/// A sender with transfer 1 (32 tokens, 2 pages) submitted, awaiting its reservation.
fn sender(now: Instant) -> SenderSession {
    let mut s = SenderSession::new(&established(Role::SENDER), SenderConfig::default());
    let policy = AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 2,
        max_context_tokens: 1024,
    };
    let admitted = policy
        .admit(Request {
            transfer_id: TransferId(1),
            tokens: 32,
        })
        .unwrap();
    s.submit(now, admitted, vec![0, 1]).unwrap();
    s
}

fn reserve_frame(nonce: u64, pages: Vec<u32>) -> Frame {
    Frame::Reserve(Reserve {
        transfer_id: TransferId(1),
        nonce,
        tokens: 32,
        digest: DigestAlgorithm::XXH3_64,
        page_digests: false,
        deadline_ms: 1000,
        pages,
        access: vec![],
    })
}

fn commit(t: TransferRef) -> Commit {
    common::commit_of(t, vec![])
}

fn actions<A>(mut poll: impl FnMut() -> Option<A>) -> Vec<A> {
    std::iter::from_fn(&mut poll).collect()
}

/// Completes the receiver's fences; asserts its failed reservation `t` was quarantined,
/// fenced, and released only after the fence (no page leaked), and returns its failure.
fn receiver_fails_safely(r: &mut ReceiverSession, now: Instant, t: TransferRef) -> FailureReason {
    let first = actions(|| r.poll_action());
    assert_eq!(
        first,
        vec![ReceiverAction::Quarantine(t), ReceiverAction::Fence(t)],
        "a failure must quarantine and fence, and release nothing yet"
    );
    assert!(
        r.poll_event().is_none(),
        "failure reported before the fence"
    );
    r.handle_fenced(now, t);
    assert_eq!(
        actions(|| r.poll_action()),
        vec![ReceiverAction::Release(t)]
    );
    match r.poll_event() {
        Some(ReceiverEvent::Failed { transfer, reason }) if transfer == t => reason,
        other => panic!("expected Failed({t:?}), got {other:?}"),
    }
}

/// SPEC §7.2: a decode error closes the connection; the driver calls `handle_peer_lost`,
/// and the open reservation fails safely (fence, then release) with nothing sent.
fn decode_error_closes_the_connection(bytes: &[u8], want: DecodeError) {
    let now = Instant::now();
    assert_eq!(Frame::decode(bytes).map(|_| ()), Err(want));
    let (mut r, t) = receiver(now);
    r.handle_peer_lost(now);
    assert_eq!(
        receiver_fails_safely(&mut r, now, t),
        FailureReason::PeerLost
    );
    assert!(r.poll_transmit().is_none(), "nothing is sent after a close");
    assert_eq!(r.open_transfers(), 0);
    // The sender side closes the same way: its transfer fails and its source is released.
    let mut s = sender(now);
    s.handle_peer_lost(now);
    assert_eq!(
        actions(|| s.poll_action()),
        vec![SenderAction::ReleaseSource(TransferId(1))]
    );
    assert!(matches!(
        s.poll_event(),
        Some(SenderEvent::Failed {
            reason: FailureReason::PeerLost,
            ..
        })
    ));
    assert_eq!(s.open_transfers(), 0);
}

fn encoded(frame: &Frame) -> Vec<u8> {
    frame.to_bytes().unwrap()
}

/// Sets the CRC of a frame whose header or payload was edited.
fn fix_crc(bytes: &mut [u8]) {
    let n = bytes.len() - 4;
    let crc = crc32fast::hash(&bytes[..n]);
    bytes[n..].copy_from_slice(&crc.to_le_bytes());
}

#[test]
fn truncated_frame() {
    // On a stream a prefix is "read more"; a payload that ends inside a field (length and
    // CRC consistent) is an error that closes the connection.
    let full = encoded(&Frame::Verified(TransferRef {
        transfer_id: TransferId(1),
        nonce: 2,
    }));
    assert_eq!(
        Frame::decode(&full[..full.len() - 1]).map(|_| ()),
        Err(DecodeError::Incomplete { needed: full.len() })
    );
    let mut short = full[..12 + 8].to_vec();
    short[8..12].copy_from_slice(&8u32.to_le_bytes());
    short.extend_from_slice(&[0; 4]);
    fix_crc(&mut short);
    decode_error_closes_the_connection(&short, DecodeError::Truncated { field: "nonce" });
}

#[test]
fn bad_crc() {
    let mut bytes = encoded(&Frame::AbortAck(TransferRef {
        transfer_id: TransferId(1),
        nonce: 2,
    }));
    bytes[14] ^= 0x40;
    let carried = u32::from_le_bytes(bytes[bytes.len() - 4..].try_into().unwrap());
    let computed = crc32fast::hash(&bytes[..bytes.len() - 4]);
    decode_error_closes_the_connection(&bytes, DecodeError::BadCrc { carried, computed });
}

#[test]
fn unknown_frame_type() {
    let mut bytes = encoded(&Frame::Verified(TransferRef {
        transfer_id: TransferId(1),
        nonce: 2,
    }));
    bytes[6..8].copy_from_slice(&0x0017u16.to_le_bytes());
    fix_crc(&mut bytes);
    decode_error_closes_the_connection(&bytes, DecodeError::UnknownFrameType(FrameType(0x17)));
}

#[test]
fn unsupported_version() {
    let mut bytes = encoded(&Frame::Verified(TransferRef {
        transfer_id: TransferId(1),
        nonce: 2,
    }));
    // Version 1, the previous protocol: refused like any version but 2.
    bytes[4..6].copy_from_slice(&1u16.to_le_bytes());
    fix_crc(&mut bytes);
    // After the handshake it is an ordinary decode error (SPEC §4.5, §7.2).
    decode_error_closes_the_connection(&bytes, DecodeError::UnsupportedVersion(1));
}

#[test]
fn oversize_length() {
    let mut bytes = encoded(&Frame::Verified(TransferRef {
        transfer_id: TransferId(1),
        nonce: 2,
    }));
    bytes[8..12].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
    // Reported from the header alone: the decoder does not wait for a bogus megabyte.
    decode_error_closes_the_connection(
        &bytes[..12],
        DecodeError::PayloadTooLarge {
            len: MAX_PAYLOAD + 1,
        },
    );
}

#[test]
fn counts_that_overflow() {
    // A page count over the limit is refused by the decoder (connection closed) ...
    let mut bytes = encoded(&reserve_frame(9, vec![1]));
    let at = 12 + 26;
    bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    fix_crc(&mut bytes);
    decode_error_closes_the_connection(
        &bytes,
        DecodeError::TooMany {
            field: "pages",
            count: u64::from(u32::MAX),
            max: MAX_PAGES as u64,
        },
    );
    // ... and counts at the top of their range in a well-formed COMMIT fail the transfer
    // with COUNT_MISMATCH, never an arithmetic overflow.
    let now = Instant::now();
    let (mut r, t) = receiver(now);
    let c = Commit {
        pages: u32::MAX,
        bytes: u64::MAX,
        tokens: u32::MAX,
        ..commit(t)
    };
    let e = r.handle_frame(now, Frame::Commit(c)).unwrap_err();
    assert_eq!(e.scope, Scope::Transfer);
    assert!(
        matches!(r.poll_transmit(), Some(Frame::Nack(n)) if n.code == ErrorCode::COUNT_MISMATCH && n.transfer == t)
    );
    let reason = receiver_fails_safely(&mut r, now, t);
    assert!(
        matches!(reason, FailureReason::CountMismatch { .. }),
        "{reason:?}"
    );
}

#[test]
fn page_index_outside_the_pool() {
    // A sender given no bound on the receiver's pages (SPEC §5.3.1 #7 applies only when the
    // transport advertised one; TCP always does, see spec_rules.rs) accepts the RESERVE, and
    // the transport refuses the write outside the scope; the transfer drains and aborts with
    // WRITE_FAILED, and the source comes back.
    let now = Instant::now();
    let mut s = sender(now);
    s.handle_frame(now, reserve_frame(9, vec![u32::MAX, 7]))
        .unwrap();
    let t = TransferRef {
        transfer_id: TransferId(1),
        nonce: 9,
    };
    let a = actions(|| s.poll_action());
    assert!(a.iter().any(
        |a| matches!(a, SenderAction::PostWrites { writes, .. } if writes[0].dst_page == u32::MAX)
    ));
    s.handle_write_outcome(now, t, WriteOutcome::Failed, 1);
    s.handle_write_outcome(now, t, WriteOutcome::Cancelled, 1);
    s.handle_digests(now, t, Default::default());
    let a = actions(|| s.poll_action());
    assert!(a.contains(&SenderAction::CancelWrites(t)));
    assert!(a.contains(&SenderAction::ReleaseSource(TransferId(1))));
    assert!(
        matches!(s.poll_transmit(), Some(Frame::Abort(a)) if a.code == ErrorCode::WRITE_FAILED)
    );
    // The receiver's own reservations only name pages its driver leased: nothing to check
    // there (a reservation of pages it does not own is a driver bug, refused by the pool).
}

#[test]
fn duplicate_pages_in_one_reservation() {
    let now = Instant::now();
    let mut s = sender(now);
    let e = s
        .handle_frame(now, reserve_frame(9, vec![5, 5]))
        .unwrap_err();
    assert_eq!(e.scope, Scope::Transfer);
    assert!(
        matches!(s.poll_transmit(), Some(Frame::Reject(r)) if r.code == ErrorCode::BAD_RESERVATION && r.transfer.nonce == 9)
    );
    assert_eq!(
        actions(|| s.poll_action()),
        vec![SenderAction::ReleaseSource(TransferId(1))]
    );
    assert!(
        matches!(s.poll_event(), Some(SenderEvent::Failed { reason: FailureReason::ReservationRefused { code, .. }, .. }) if code == ErrorCode::BAD_RESERVATION)
    );
    assert_eq!(s.open_transfers(), 0);
    // The receiver refuses to send such a reservation at all.
    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
    );
    let req = ReservationRequest {
        transfer_id: TransferId(2),
        tokens: 32,
        pages: vec![6, 6],
        digest: None,
        page_digests: false,
        timeout: Duration::from_secs(1),
        access: vec![],
    };
    assert_eq!(r.reserve(now, req), Err(ReserveError::DuplicatePage(6)));
    assert!(r.poll_transmit().is_none());
}

#[test]
fn reservation_larger_than_the_pool() {
    // More pages than the request needs (the sender's pool holds 2): PAGE_COUNT_MISMATCH.
    let now = Instant::now();
    let mut s = sender(now);
    let mut big = reserve_frame(9, (0..5).collect());
    if let Frame::Reserve(r) = &mut big {
        r.tokens = 32;
    }
    let e = s.handle_frame(now, big).unwrap_err();
    assert_eq!(e.scope, Scope::Transfer);
    assert!(
        matches!(s.poll_transmit(), Some(Frame::Reject(r)) if r.code == ErrorCode::PAGE_COUNT_MISMATCH)
    );
    assert_eq!(
        actions(|| s.poll_action()),
        vec![SenderAction::ReleaseSource(TransferId(1))]
    );
    assert_eq!(s.open_transfers(), 0);
    // A request larger than the sender's pool never gets that far: admission refuses it.
    let policy = AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 2,
        max_context_tokens: 1024,
    };
    let rejected = policy
        .admit(Request {
            transfer_id: TransferId(3),
            tokens: 48,
        })
        .unwrap_err();
    assert_eq!(rejected.error.code(), ErrorCode::PROMPT_EXCEEDS_POOL);
    // A receiver cannot reserve more than the wire allows.
    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
    );
    let n = MAX_PAGES as u32 + 1;
    let req = ReservationRequest {
        transfer_id: TransferId(4),
        tokens: n * 16,
        pages: (0..n).collect(),
        digest: None,
        page_digests: false,
        timeout: Duration::from_secs(1),
        access: vec![],
    };
    assert_eq!(r.reserve(now, req), Err(ReserveError::TooLarge));
}

#[test]
fn commit_for_an_unknown_transfer() {
    let now = Instant::now();
    let (mut r, _) = receiver(now);
    let other = TransferRef {
        transfer_id: TransferId(42),
        nonce: 7,
    };
    let e = r
        .handle_frame(now, Frame::Commit(commit(other)))
        .unwrap_err();
    assert_eq!(e.scope, Scope::Frame);
    assert!(
        matches!(r.poll_transmit(), Some(Frame::Nack(n)) if n.code == ErrorCode::UNKNOWN_TRANSFER && n.transfer == other)
    );
    assert!(
        r.poll_action().is_none(),
        "the open reservation is untouched"
    );
    assert_eq!(r.open_transfers(), 1);
}

#[test]
fn commit_for_a_finished_transfer() {
    let now = Instant::now();
    let (mut r, t) = receiver(now);
    assert!(r.abort(now, TransferId(1), ErrorCode::CANCELLED));
    receiver_fails_safely(&mut r, now, t);
    assert!(matches!(r.poll_transmit(), Some(Frame::Abort(_))));
    r.handle_frame(now, Frame::AbortAck(t)).unwrap();
    assert_eq!(r.open_transfers(), 0);
    // Answered with the outcome it had (SPEC §7.3): NACK with the code it failed with; nothing
    // else happens.
    let e = r.handle_frame(now, Frame::Commit(commit(t))).unwrap_err();
    assert_eq!(e.scope, Scope::Frame);
    assert!(
        matches!(r.poll_transmit(), Some(Frame::Nack(n)) if n.code == ErrorCode::CANCELLED && n.transfer == t)
    );
    assert!(r.poll_transmit().is_none());
    assert!(r.poll_action().is_none());
}

#[test]
fn commit_for_another_nonce() {
    let now = Instant::now();
    let (mut r, t) = receiver(now);
    let stale = TransferRef {
        transfer_id: TransferId(1),
        nonce: t.nonce ^ 1,
    };
    let e = r
        .handle_frame(now, Frame::Commit(commit(stale)))
        .unwrap_err();
    assert_eq!(e.scope, Scope::Transfer);
    assert!(
        matches!(r.poll_transmit(), Some(Frame::Nack(n)) if n.code == ErrorCode::STALE_NONCE && n.transfer == stale)
    );
    let reason = receiver_fails_safely(&mut r, now, t);
    assert!(
        matches!(reason, FailureReason::StaleNonce { .. }),
        "{reason:?}"
    );
    assert!(
        matches!(r.poll_transmit(), Some(Frame::Abort(a)) if a.code == ErrorCode::STALE_NONCE && a.transfer == t)
    );
}

#[test]
fn abort_for_an_unknown_transfer() {
    let now = Instant::now();
    let unknown = TransferRef {
        transfer_id: TransferId(42),
        nonce: 7,
    };
    let abort = Frame::Abort(Abort {
        transfer: unknown,
        code: ErrorCode::CANCELLED,
        completed_pages: 0,
        detail: String::new(),
    });
    // Success on both sides: acknowledged (idempotent), nothing else changes.
    let (mut r, _) = receiver(now);
    r.handle_frame(now, abort.clone()).unwrap();
    assert_eq!(r.poll_transmit(), Some(Frame::AbortAck(unknown)));
    assert!(r.poll_action().is_none());
    assert_eq!(r.open_transfers(), 1);
    let mut s = sender(now);
    s.handle_frame(now, abort).unwrap();
    assert_eq!(s.poll_transmit(), Some(Frame::AbortAck(unknown)));
    assert!(s.poll_action().is_none());
    assert_eq!(s.open_transfers(), 1);
}

#[test]
fn frames_after_close() {
    let now = Instant::now();
    let (mut r, t) = receiver(now);
    r.handle_peer_lost(now);
    receiver_fails_safely(&mut r, now, t);
    for f in [
        Frame::Commit(commit(t)),
        Frame::Abort(Abort {
            transfer: t,
            code: ErrorCode::CANCELLED,
            completed_pages: 0,
            detail: String::new(),
        }),
        Frame::AbortAck(t),
    ] {
        let e = r.handle_frame(now, f).unwrap_err();
        assert_eq!(e.scope, Scope::Frame);
        assert!(r.poll_transmit().is_none());
        assert!(r.poll_action().is_none());
    }
    let mut s = sender(now);
    s.handle_peer_lost(now);
    actions(|| s.poll_action());
    for f in [reserve_frame(9, vec![1, 2]), Frame::Verified(t)] {
        let e = s.handle_frame(now, f).unwrap_err();
        assert_eq!(e.scope, Scope::Frame);
        assert!(s.poll_transmit().is_none());
        assert!(s.poll_action().is_none());
    }
    assert_eq!(s.open_transfers(), 0);
    assert_eq!(r.open_transfers(), 0);
}
