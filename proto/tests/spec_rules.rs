//! Rules that closed SPEC.md §12's open questions (issue 13): one test per rule, each
//! naming the section of the SPEC body that states it.

use std::time::{Duration, Instant};

use kvwire_proto::admission::{AdmissionPolicy, Request};
use kvwire_proto::receiver::{ReceiverConfig, ReceiverSession};
use kvwire_proto::sender::{SenderConfig, SenderSession, WriteOutcome};
use kvwire_proto::wire::{
    Abort, Digest128, DigestAlgorithm, ErrorCode, Frame, Hello, Reserve, Role, TransferDigests,
    TransferRef,
};
use kvwire_proto::FailureReason;

mod common;
use common::*;

fn reserve(nonce: u64) -> Reserve {
    reserve_for(ID, nonce)
}

/// A sender with one two-page transfer submitted; `nonce` (if any) is a RESERVE accepted at
/// `now`, after which it is Writing with its writes and one digest job posted.
fn sender(now: Instant, nonce: Option<u64>) -> SenderSession {
    let mut s = SenderSession::new(&established(Role::SENDER, 0), SenderConfig::default());
    let admitted = policy()
        .admit(Request {
            transfer_id: ID,
            tokens: 32,
        })
        .unwrap();
    s.submit(now, admitted, vec![0, 1]).unwrap();
    if let Some(n) = nonce {
        s.handle_frame(now, Frame::Reserve(reserve(n))).unwrap();
        std::iter::from_fn(|| s.poll_action()).for_each(drop);
    }
    s
}

fn receiver(now: Instant) -> (ReceiverSession, TransferRef) {
    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER, 0),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
    );
    let t = r.reserve(now, reservation_request(ID)).unwrap();
    frames_r(&mut r);
    std::iter::from_fn(|| r.poll_action()).for_each(drop);
    (r, t)
}

/// SPEC §5.3.3 step 2 (was Q21): a driver that reports more page outcomes than were posted
/// cannot make ABORT's `completed_pages` exceed the pages posted.
#[test]
fn over_reported_outcomes_while_draining_are_capped_at_the_posted_pages() {
    let now = Instant::now();
    let mut s = sender(now, Some(9));
    assert!(s.abort(now, ID, ErrorCode::CANCELLED));
    // Draining: the digest job still runs; the driver over-reports.
    s.handle_write_outcome(now, tref(9), WriteOutcome::Completed, 7);
    s.handle_write_outcome(now, tref(9), WriteOutcome::Completed, 7);
    s.handle_digests(now, tref(9), TransferDigests::default());
    let abort = frames_s(&mut s)
        .into_iter()
        .find_map(|f| match f {
            Frame::Abort(a) => Some(a),
            _ => None,
        })
        .expect("no ABORT");
    assert_eq!(
        abort.completed_pages, 2,
        "completed_pages beyond the posted pages"
    );
}

/// SPEC §7.3 / §7.4 (was Q8): an ABORT for another reservation of an open transfer id is
/// acknowledged (ABORT_ACK echoing its TransferRef) on both sides, and the open transfer is
/// unaffected; on the sender a nonce-0 ABORT after a reservation was accepted is such an
/// ABORT.
#[test]
fn an_abort_for_another_reservation_of_an_open_id_is_acknowledged_and_changes_nothing() {
    let now = Instant::now();
    let (mut r, t) = receiver(now);
    let abort = |nonce| {
        Frame::Abort(Abort {
            transfer: tref(nonce),
            code: ErrorCode::TIMEOUT,
            completed_pages: 0,
            detail: String::new(),
        })
    };
    let other = t.nonce ^ 0x55;
    r.handle_frame(now, abort(other)).unwrap();
    assert_eq!(frames_r(&mut r), vec![Frame::AbortAck(tref(other))]);
    assert_eq!(r.open_transfers(), 1);
    assert!(r.poll_event().is_none());

    let mut s = sender(now, Some(9));
    for nonce in [77, 0] {
        s.handle_frame(now, abort(nonce)).unwrap();
        assert_eq!(frames_s(&mut s), vec![Frame::AbortAck(tref(nonce))]);
        assert_eq!(s.open_transfers(), 1);
    }
    assert!(s.poll_event().is_none());
}

/// SPEC §7.3 (was Q8): a receiver that reserved a verified id afresh still answers a late
/// ABORT for the verified reservation with VERIFIED, never ABORT_ACK (which would tell the
/// sender it did not deliver, §7.6).
#[test]
fn an_abort_for_a_verified_reservation_of_a_reserved_again_id_gets_verified() {
    let now = Instant::now();
    let (mut r, t) = receiver(now);
    let (b, a) = (Digest128::from_u128(5), Digest128::from_u128(6));
    r.handle_frame(now, Frame::Commit(commit_of(t, vec![])))
        .unwrap();
    r.handle_fenced(now, t);
    r.handle_digests(
        now,
        t,
        TransferDigests {
            buffers: vec![b],
            pages: vec![],
            aux: a,
        },
    );
    assert_eq!(frames_r(&mut r), vec![Frame::Verified(t)]);
    let again = r.reserve(now, reservation_request(ID)).unwrap();
    assert_ne!(again.nonce, t.nonce);
    frames_r(&mut r);
    r.handle_frame(
        now,
        Frame::Abort(Abort {
            transfer: t,
            code: ErrorCode::TIMEOUT,
            completed_pages: 2,
            detail: String::new(),
        }),
    )
    .unwrap();
    assert_eq!(frames_r(&mut r), vec![Frame::Verified(t)]);
    assert_eq!(r.open_transfers(), 1);
}

/// SPEC §5.1 / §8.1 (was Q11): a parked RESERVE's `deadline_ms` counts from its receipt, not
/// from the later submit that takes it.
#[test]
fn a_parked_reservations_deadline_counts_from_its_receipt() {
    use kvwire_proto::sender::SenderAction;
    let t0 = Instant::now();
    let mut s = SenderSession::new(&established(Role::SENDER, 0), SenderConfig::default());
    s.handle_frame(t0, Frame::Reserve(reserve(9))).unwrap(); // parked
    let submit_at = t0 + Duration::from_millis(800);
    let admitted = policy()
        .admit(Request {
            transfer_id: ID,
            tokens: 32,
        })
        .unwrap();
    s.submit(submit_at, admitted, vec![0, 1]).unwrap();
    let posted: Vec<_> = std::iter::from_fn(|| s.poll_action()).collect();
    assert!(posted
        .iter()
        .any(|a| matches!(a, SenderAction::PostWrites { .. })));
    assert_eq!(s.poll_timeout(), Some(t0 + Duration::from_millis(1000)));
    s.handle_timeout(t0 + Duration::from_millis(1000));
    let actions: Vec<_> = std::iter::from_fn(|| s.poll_action()).collect();
    assert!(
        actions.contains(&SenderAction::CancelWrites(tref(9))),
        "the writes deadline did not fire {} ms after the RESERVE's receipt: {actions:?}",
        1000
    );
}

/// SPEC §5.1: a parked RESERVE lives as long as the receiver said (its `deadline_ms` from
/// receipt), bounded by the sender's `parked_reservation_timeout`; the REJECT(UNKNOWN_REQUEST)
/// at its end is retryable (a busy sender, not a refusal of the request).
#[test]
fn a_parked_reservation_lives_for_the_receivers_deadline_at_most_the_senders_bound() {
    use kvwire_proto::wire::{ErrorCode, Reject};
    let t0 = Instant::now();
    // deadline_ms 1000 < the bound (60 s by default): rejected 1 s after it (the grace for
    // the receiver's own ABORT), not before.
    let mut s = SenderSession::new(&established(Role::SENDER, 0), SenderConfig::default());
    s.handle_frame(t0, Frame::Reserve(reserve(9))).unwrap();
    assert_eq!(s.poll_timeout(), Some(t0 + Duration::from_millis(2000)));
    s.handle_timeout(t0 + Duration::from_millis(1999));
    assert_eq!(s.poll_transmit(), None);
    s.handle_timeout(t0 + Duration::from_millis(2000));
    match s.poll_transmit() {
        Some(Frame::Reject(Reject { code, .. })) => assert_eq!(code, ErrorCode::UNKNOWN_REQUEST),
        other => panic!("expected REJECT(UNKNOWN_REQUEST), got {other:?}"),
    }
    // The sender's bound is shorter: it wins.
    let mut s = SenderSession::new(
        &established(Role::SENDER, 0),
        SenderConfig {
            parked_reservation_timeout: Duration::from_millis(300),
            ..SenderConfig::default()
        },
    );
    s.handle_frame(t0, Frame::Reserve(reserve(9))).unwrap();
    assert_eq!(s.poll_timeout(), Some(t0 + Duration::from_millis(300)));
    // What the receiver makes of it: retryable, unlike a rejection of the request itself.
    let busy = FailureReason::Rejected {
        code: ErrorCode::UNKNOWN_REQUEST,
        detail: String::new(),
    };
    assert!(busy.is_retryable());
    let full = FailureReason::Rejected {
        code: ErrorCode::PARKED_LIMIT,
        detail: String::new(),
    };
    assert!(full.is_retryable());
    let refused = FailureReason::Rejected {
        code: ErrorCode::PROMPT_EXCEEDS_CONTEXT,
        detail: String::new(),
    };
    assert!(!refused.is_retryable());
}

/// SPEC §7.3 (was Q12): a COMMIT for a finished transfer is answered: the same reservation
/// with its outcome again (VERIFIED, or NACK with the code it failed with), another
/// reservation of the id with NACK(STALE_NONCE).
#[test]
fn a_commit_for_a_finished_transfer_gets_its_outcome_or_stale_nonce() {
    use kvwire_proto::wire::{Nack, NONE_INDEX};
    let commit = |t: TransferRef| Frame::Commit(commit_of(t, vec![]));
    let now = Instant::now();
    // Verified, then the same COMMIT again.
    let (mut r, t) = receiver(now);
    r.handle_frame(now, commit(t)).unwrap();
    r.handle_fenced(now, t);
    r.handle_digests(
        now,
        t,
        TransferDigests {
            buffers: vec![Digest128::from_u128(5)],
            pages: vec![],
            aux: Digest128::from_u128(6),
        },
    );
    assert_eq!(frames_r(&mut r), vec![Frame::Verified(t)]);
    let _ = r.handle_frame(now, commit(t));
    assert_eq!(frames_r(&mut r), vec![Frame::Verified(t)]);
    // Another reservation of the finished id.
    let other = tref(t.nonce ^ 1);
    let _ = r.handle_frame(now, commit(other));
    assert!(matches!(
        &frames_r(&mut r)[..],
        [Frame::Nack(Nack { transfer, code: ErrorCode::STALE_NONCE, buffer: NONE_INDEX, page: NONE_INDEX, .. })] if *transfer == other
    ));
    // Failed (aborted locally, ABORT acknowledged), then its COMMIT arrives.
    let (mut r, t) = receiver(now);
    assert!(r.abort(now, ID, ErrorCode::CANCELLED));
    r.handle_fenced(now, t);
    frames_r(&mut r);
    r.handle_frame(now, Frame::AbortAck(t)).unwrap();
    assert_eq!(r.open_transfers(), 0);
    let _ = r.handle_frame(now, commit(t));
    assert!(matches!(
        &frames_r(&mut r)[..],
        [Frame::Nack(Nack { transfer, code: ErrorCode::CANCELLED, .. })] if *transfer == t
    ));
}

/// SPEC §4.6 (was Q14): at the handshake deadline a node queues HELLO_REJECT
/// (HANDSHAKE_TIMEOUT) naming what it waited for, and reports `Timeout` only once the frame
/// was taken for transmission; the default timeout is 10 s.
#[test]
fn a_handshake_that_times_out_sends_hello_reject_handshake_timeout() {
    use kvwire_proto::handshake::{Handshake, HandshakeError, DEFAULT_HANDSHAKE_TIMEOUT};
    assert_eq!(DEFAULT_HANDSHAKE_TIMEOUT, Duration::from_secs(10));
    let now = Instant::now();
    let timeout = Duration::from_millis(1500);
    let mut client = Handshake::client(now, hello(Role::SENDER, 0), timeout);
    assert!(matches!(client.poll_transmit(), Some(Frame::Hello(_))));
    let mut server = Handshake::server(now, hello(Role::RECEIVER, 0), timeout);
    for (hs, waited) in [(&mut client, "HELLO_ACK"), (&mut server, "HELLO")] {
        hs.handle_timeout(now + timeout - Duration::from_millis(1));
        assert!(hs.poll_outcome().is_none() && hs.poll_transmit().is_none());
        hs.handle_timeout(now + timeout);
        assert!(
            hs.poll_outcome().is_none(),
            "outcome before the reply was taken"
        );
        match hs.poll_transmit() {
            Some(Frame::HelloReject(r)) => {
                assert_eq!(r.code, ErrorCode::HANDSHAKE_TIMEOUT);
                assert!(
                    r.detail.contains(waited) && r.detail.contains("1500 ms"),
                    "{}",
                    r.detail
                );
            }
            other => panic!("no HELLO_REJECT(HANDSHAKE_TIMEOUT): {other:?}"),
        }
        assert_eq!(hs.poll_outcome(), Some(Err(HandshakeError::Timeout)));
    }
}

/// SPEC §3.9 (was Q14): SENDER_OUT_OF_PAGES is engine-chosen: aborting a submitted request
/// with it before a reservation sends nothing, and the RESERVE that comes later is refused
/// with it.
#[test]
fn sender_out_of_pages_reaches_the_receiver_through_abort_and_the_history() {
    let now = Instant::now();
    let mut s = sender(now, None);
    assert!(s.abort(now, ID, ErrorCode::SENDER_OUT_OF_PAGES));
    assert!(
        frames_s(&mut s).is_empty(),
        "an ABORT with no reservation to name"
    );
    s.handle_frame(now, Frame::Reserve(reserve(9))).unwrap();
    assert!(matches!(
        &frames_s(&mut s)[..],
        [Frame::Reject(r)] if r.code == ErrorCode::SENDER_OUT_OF_PAGES && r.transfer == tref(9)
    ));
}

/// SPEC §5.2.5 (was Q14), by design: a COMMIT under another algorithm than reserved is
/// PROTOCOL_VIOLATION (not DIGEST_UNSUPPORTED), and one with more buffer digests than
/// buffers is MISSING_DIGEST, like one with fewer.
#[test]
fn commit_algorithm_and_digest_count_failures_have_their_deliberate_codes() {
    use kvwire_proto::wire::Commit;
    let now = Instant::now();
    for (digest, buffers, want) in [
        (DigestAlgorithm::CRC32, 1, ErrorCode::PROTOCOL_VIOLATION),
        (DigestAlgorithm::XXH3_64, 2, ErrorCode::MISSING_DIGEST),
        (DigestAlgorithm::XXH3_64, 0, ErrorCode::MISSING_DIGEST),
    ] {
        let (mut r, t) = receiver(now);
        let _ = r.handle_frame(
            now,
            Frame::Commit(Commit {
                digest,
                buffer_digests: vec![Digest128::from_u128(5); buffers],
                ..commit_of(t, vec![])
            }),
        );
        assert!(
            matches!(&frames_r(&mut r)[..], [Frame::Nack(n)] if n.code == want),
            "{digest} with {buffers} buffer digests"
        );
    }
}

/// SPEC §3.3 (was Q17), by design: the header (magic, version, length) is judged before the
/// CRC, so a frame whose header bytes were corrupted on the way is reported by what the
/// header now says, not as `BadCrc`: a decoder never waits for (or allocates) a bogus frame
/// length, and never reads a payload under a version it does not speak.
#[test]
fn header_checks_come_before_the_crc_by_design() {
    use kvwire_proto::wire::{DecodeError, MAX_PAYLOAD};
    let good = Frame::Verified(tref(9)).to_bytes().unwrap();
    // A bit flip in the version field: the CRC no longer matches, the version is reported.
    let mut v = good.clone();
    v[4] ^= 0x01;
    assert_eq!(Frame::decode(&v), Err(DecodeError::UnsupportedVersion(3)));
    // A bit flip in the length's high byte: too large, reported from the header.
    let mut l = good.clone();
    l[11] ^= 0x80;
    let len = u32::from_le_bytes([l[8], l[9], l[10], l[11]]);
    assert!(len > MAX_PAYLOAD);
    assert_eq!(Frame::decode(&l), Err(DecodeError::PayloadTooLarge { len }));
    // A bit flip in the frame type: checked only after the CRC, so it is a CRC error.
    let mut t = good.clone();
    t[6] ^= 0x40;
    assert!(matches!(Frame::decode(&t), Err(DecodeError::BadCrc { .. })));
}

/// SPEC §5.1 (was Q18): `retire` of an id with an open transfer is refused and changes
/// nothing (the open transfer is served); a later submission of a retired id supersedes the
/// retirement (the engine admitted the id again), so its next RESERVE is served, not refused.
#[test]
fn retire_refuses_an_open_id_and_a_later_submit_supersedes_a_retirement() {
    use kvwire_proto::sender::{RetireError, SenderAction};
    let now = Instant::now();
    let rejected = || {
        policy()
            .admit(Request {
                transfer_id: ID,
                tokens: 0,
            })
            .unwrap_err()
    };
    let mut s = sender(now, None);
    assert!(matches!(s.retire(rejected()), Err(RetireError::Open(_))));
    s.handle_frame(now, Frame::Reserve(reserve(9))).unwrap();
    assert!(frames_s(&mut s).is_empty(), "the open transfer was refused");
    assert!(std::iter::from_fn(|| s.poll_action())
        .any(|a| matches!(a, SenderAction::PostWrites { .. })));

    let mut s = SenderSession::new(&established(Role::SENDER, 0), SenderConfig::default());
    s.retire(rejected()).unwrap();
    let admitted = policy()
        .admit(Request {
            transfer_id: ID,
            tokens: 32,
        })
        .unwrap();
    s.submit(now, admitted, vec![0, 1]).unwrap();
    s.handle_frame(now, Frame::Reserve(reserve(9))).unwrap();
    assert!(
        frames_s(&mut s).is_empty(),
        "the resubmitted id was refused"
    );
}

/// SPEC §4.2 (was Q20): a server established at its HELLO_ACK whose client then refuses
/// (HELLO_REJECT) closes the connection (Connection scope) and gets the client's refusal
/// typed, code and detail, to report as a refusal by the peer, in either role.
#[test]
fn hello_reject_after_hello_ack_is_reported_as_the_peers_refusal() {
    use kvwire_proto::wire::HelloReject;
    let now = Instant::now();
    let reject = HelloReject {
        code: ErrorCode::NO_COMMON_DIGEST,
        detail: "local digests [CRC32], peer digests [XXH3_64]".into(),
    };
    let (mut r, _) = receiver(now);
    let e = r
        .handle_frame(now, Frame::HelloReject(reject.clone()))
        .unwrap_err();
    assert_eq!(e.scope, kvwire_proto::Scope::Connection);
    assert_eq!(e.refused_by_peer.as_ref(), Some(&reject));
    assert!(e.detail.contains("NO_COMMON_DIGEST"), "{}", e.detail);
    let mut s = sender(now, None);
    let e = s
        .handle_frame(now, Frame::HelloReject(reject.clone()))
        .unwrap_err();
    assert_eq!(e.scope, kvwire_proto::Scope::Connection);
    assert_eq!(e.refused_by_peer, Some(reject));
    // Other handshake frames are plain connection errors.
    let e = s.handle_frame(now, Frame::HelloConfirm).unwrap_err();
    assert_eq!(
        (e.scope, e.refused_by_peer),
        (kvwire_proto::Scope::Connection, None)
    );
}

/// SPEC §3.5.8 / §5.3.5 (was Q13): a sender aborting before any reservation sends no ABORT
/// (no nonce-0 ABORT ever leaves the reference); the RESERVE that comes later is refused
/// with the abort's code. A receiver still takes a nonce-0 ABORT as naming its open
/// reservation: it fails it, fence first, and acknowledges it with its own TransferRef.
#[test]
fn no_nonce_zero_abort_is_sent_but_a_receiver_accepts_one() {
    use kvwire_proto::receiver::{ReceiverAction, ReceiverEvent};
    let now = Instant::now();
    let mut s = sender(now, None);
    assert!(s.abort(now, ID, ErrorCode::CANCELLED));
    assert!(frames_s(&mut s).is_empty());
    s.handle_frame(now, Frame::Reserve(reserve(9))).unwrap();
    assert!(matches!(
        &frames_s(&mut s)[..],
        [Frame::Reject(r)] if r.code == ErrorCode::CANCELLED
    ));

    let (mut r, t) = receiver(now);
    r.handle_frame(
        now,
        Frame::Abort(Abort {
            transfer: tref(0),
            code: ErrorCode::CANCELLED,
            completed_pages: 0,
            detail: String::new(),
        }),
    )
    .unwrap();
    let actions: Vec<_> = std::iter::from_fn(|| r.poll_action()).collect();
    assert_eq!(
        actions,
        vec![ReceiverAction::Quarantine(t), ReceiverAction::Fence(t)]
    );
    r.handle_fenced(now, t);
    assert_eq!(frames_r(&mut r), vec![Frame::AbortAck(t)]);
    assert!(matches!(r.poll_event(), Some(ReceiverEvent::Failed { .. })));
}

/// SPEC §5.1 (was Q7): an admission policy whose `tokens_per_page` is not the layout's is
/// caught at submit (the page count disagrees with the layout), naming both numbers, instead
/// of every reservation failing with PAGE_COUNT_MISMATCH; a request beyond the wire's
/// limits but within the pool is refused as such (still PROMPT_EXCEEDS_POOL).
#[test]
fn admission_must_use_the_layouts_tokens_per_page_and_names_wire_limits() {
    use kvwire_proto::admission::AdmissionError;
    use kvwire_proto::sender::SubmitError;
    let now = Instant::now();
    let mut s = SenderSession::new(&established(Role::SENDER, 0), SenderConfig::default());
    let wrong = AdmissionPolicy {
        tokens_per_page: 8, // the layout has 16
        ..policy()
    };
    let admitted = wrong
        .admit(Request {
            transfer_id: ID,
            tokens: 32,
        })
        .unwrap();
    match s.submit(now, admitted, vec![0, 1, 2, 3]) {
        Err(
            e @ SubmitError::LayoutMismatch {
                layout_pages: 2, ..
            },
        ) => {
            assert!(e.to_string().contains("4 pages"), "{e}");
        }
        other => panic!("not refused as a layout mismatch: {other:?}"),
    }
    assert_eq!(s.open_transfers(), 0);
    // Zero is read as one token per page: caught the same way against this layout.
    let zero = AdmissionPolicy {
        tokens_per_page: 0,
        ..policy()
    };
    let admitted = zero
        .admit(Request {
            transfer_id: ID,
            tokens: 2,
        })
        .unwrap();
    assert!(matches!(
        s.open(now, admitted),
        Err(SubmitError::LayoutMismatch {
            layout_pages: 1,
            ..
        })
    ));

    let huge = AdmissionPolicy {
        tokens_per_page: 1 << 20,
        pool_pages: u32::MAX,
        max_context_tokens: u64::MAX,
    };
    let e = huge
        .admit(Request {
            transfer_id: ID,
            tokens: 1 << 33,
        })
        .unwrap_err();
    assert!(
        matches!(e.error, AdmissionError::ExceedsWire { .. }),
        "{e:?}"
    );
    assert_eq!(e.error.code(), ErrorCode::PROMPT_EXCEEDS_POOL);
    assert!(e.error.to_string().contains("wire"), "{}", e.error);
}

/// SPEC §5.2.1 (was Q5): the nonce seed is an argument of `ReceiverSession::new`, not a
/// configuration field with a constant default (a `compile_fail` doc test on
/// `ReceiverConfig` pins that no `nonce_seed` field exists): sessions with different seeds
/// draw different nonces for the same transfer; nonces are never 0 and never repeat.
#[test]
fn the_nonce_seed_is_given_per_session_and_drives_the_nonces() {
    let now = Instant::now();
    let request = || reservation_request(ID);
    let nonces = |seed| {
        let mut r = ReceiverSession::new(
            &established(Role::RECEIVER, 0),
            ReceiverConfig::default(),
            seed,
        );
        let mut seen = Vec::new();
        for _ in 0..3 {
            let t = r.reserve(now, request()).unwrap();
            assert!(r.abort(now, ID, ErrorCode::CANCELLED));
            r.handle_fenced(now, t);
            r.handle_frame(now, Frame::AbortAck(t)).unwrap();
            seen.push(t.nonce);
        }
        seen
    };
    let (a, b) = (nonces(1), nonces(2));
    assert_ne!(a, b);
    assert_eq!(a, nonces(1));
    for n in a.iter().chain(&b) {
        assert_ne!(*n, 0);
    }
    let mut sorted = a.clone();
    sorted.dedup();
    assert_eq!(sorted.len(), 3);
}

/// SPEC §5.3.1 #7: a sender that knows the receiver's page count (its transport advertised
/// it, §9.1) refuses a RESERVE naming a page index beyond it with BAD_RESERVATION, naming
/// both numbers, and writes nothing.
#[test]
fn a_reservation_naming_a_page_beyond_the_receivers_pool_is_refused() {
    use kvwire_proto::sender::SenderAction;
    let now = Instant::now();
    let mut s = sender(now, None);
    s.limit_destination_pages(6);
    s.handle_frame(now, Frame::Reserve(reserve(9))).unwrap_err(); // pages [5, 6]
    match &frames_s(&mut s)[..] {
        [Frame::Reject(r)] => {
            assert_eq!(r.code, ErrorCode::BAD_RESERVATION);
            assert!(
                r.detail.contains('6') && r.detail.contains("beyond"),
                "{}",
                r.detail
            );
        }
        other => panic!("not refused: {other:?}"),
    }
    assert!(!std::iter::from_fn(|| s.poll_action())
        .any(|a| matches!(a, SenderAction::PostWrites { .. })));
    // Both pages beyond: the detail names the first in the reservation's order, not the
    // largest.
    let mut s = sender(now, None);
    s.limit_destination_pages(5);
    s.handle_frame(now, Frame::Reserve(reserve(9))).unwrap_err();
    match &frames_s(&mut s)[..] {
        [Frame::Reject(r)] => assert!(
            r.detail.starts_with("page index 5 (ordinal 0) is beyond"),
            "{}",
            r.detail
        ),
        other => panic!("not refused: {other:?}"),
    }
    // Within the bound it is served.
    let mut s = sender(now, None);
    s.limit_destination_pages(7);
    s.handle_frame(now, Frame::Reserve(reserve(9))).unwrap();
    assert!(frames_s(&mut s).is_empty());
}

/// SPEC §4.3 "Details": a HELLO_REJECT names both sides' values in human form: whole
/// layouts, fingerprints as text with a digest of all their bytes (two fingerprints equal in
/// their first 16 bytes are still told apart), the algorithms each side offers, versions.
#[test]
fn hello_reject_details_name_both_sides_in_human_form() {
    use kvwire_proto::handshake::{check_peer, show_fingerprint, version_reject};
    let local = hello(Role::RECEIVER, 0);
    let refuse = |peer: Hello| check_peer(&local, &peer).unwrap_err();

    let mut peer = hello(Role::SENDER, 0);
    peer.layout.tokens_per_page = 32;
    peer.layout.buffer_page_bytes = vec![4096, 2048];
    let r = refuse(peer);
    assert_eq!(r.code, ErrorCode::LAYOUT_MISMATCH);
    for want in [
        "local 16, peer 32",
        "local layout 16 tokens/page, 1 buffers of 4096 bytes/page",
        "peer layout 32 tokens/page, 2 buffers of [4096, 2048] bytes/page",
    ] {
        assert!(r.detail.contains(want), "{:?} lacks {want:?}", r.detail);
    }

    // Equal in their first 16 bytes: a truncated hex would print the same for both.
    let (a, b) = (
        b"meta-llama/Llama-3-70B/tp0of8".to_vec(),
        b"meta-llama/Llama-3-70B/tp1of8".to_vec(),
    );
    let mut l = hello(Role::RECEIVER, 0);
    l.layout.fingerprint = a.clone();
    let mut peer = hello(Role::SENDER, 0);
    peer.layout.fingerprint = b.clone();
    let r = check_peer(&l, &peer).unwrap_err();
    assert_eq!(r.code, ErrorCode::FINGERPRINT_MISMATCH);
    assert_ne!(show_fingerprint(&a), show_fingerprint(&b));
    for want in [show_fingerprint(&a), show_fingerprint(&b)] {
        assert!(r.detail.contains(&want), "{:?} lacks {want:?}", r.detail);
    }
    assert!(
        r.detail.contains("\"meta-llama/Llama-3-70B/tp1of8\""),
        "{}",
        r.detail
    );
    assert!(r.detail.contains("sha256 "), "{}", r.detail);

    let mut peer = hello(Role::SENDER, 0);
    peer.digests = vec![DigestAlgorithm::CRC32, DigestAlgorithm(9)];
    let r = refuse(peer);
    assert_eq!(r.code, ErrorCode::NO_COMMON_DIGEST);
    for want in [
        "local offers [XXH3_64]",
        "peer offers [CRC32, Unknown(0x9)]",
    ] {
        assert!(r.detail.contains(want), "{:?} lacks {want:?}", r.detail);
    }

    let r = version_reject(1);
    assert!(
        r.detail.contains("version 1") && r.detail.contains("version 2"),
        "{}",
        r.detail
    );
}

/// SPEC §7.2: bytes in errors are shown as hex and ASCII: an HTTP request where a frame
/// was expected reads as `47 45 54 20 "GET "`, not as a list of decimal numbers.
#[test]
fn bad_bytes_in_errors_are_shown_as_hex_and_ascii() {
    use kvwire_proto::wire::{show_bytes, DecodeError};
    let e = Frame::decode(b"GET / HTTP/1.0\r\n\r\n").unwrap_err();
    assert_eq!(e, DecodeError::BadMagic(*b"GET "));
    let text = e.to_string();
    assert!(text.contains(r#"47 45 54 20 "GET ""#), "{text}");
    assert!(text.contains(r#"4b 56 57 52 "KVWR""#), "{text}");
    assert_eq!(
        show_bytes(&[0x00, b'A', 0xff, b'"']),
        r#"00 41 ff 22 ".A..""#
    );
    // Seen before the whole magic arrived: the bytes seen, zero-padded.
    assert!(Frame::decode(b"X")
        .unwrap_err()
        .to_string()
        .contains(r#"58 00 00 00 "X...""#));
}

/// A VERIFIED before the COMMIT ends the connection; its error names what the transfer
/// accepted then (NACK, ABORT), not VERIFIED itself (issue 37).
#[test]
fn an_early_verified_names_what_was_expected_without_verified() {
    let now = Instant::now();
    let mut s = sender(now, Some(9));
    let e = s
        .handle_frame(now, Frame::Verified(tref(9)))
        .expect_err("a VERIFIED before the COMMIT is refused");
    let text = e.to_string();
    assert!(text.contains("VERIFIED before COMMIT"), "{text}");
    let expected = text
        .split("expected one of")
        .nth(1)
        .unwrap_or_else(|| panic!("{text}"));
    assert!(!expected.contains("VERIFIED"), "{text}");
    assert!(
        expected.contains("NACK") && expected.contains("ABORT"),
        "{text}"
    );
}
