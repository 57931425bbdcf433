//! Session-level regression tests for bugs found while writing SPEC.md.

use kvwire_proto::wire::TransferId;
use std::time::{Duration, Instant};

mod common;

use kvwire_proto::admission::{AdmissionPolicy, Request};
use kvwire_proto::handshake::{check_peer, Established};
use kvwire_proto::receiver::{ReceiverConfig, ReceiverSession, ReservationRequest, ReserveError};
use kvwire_proto::sender::{SenderAction, SenderConfig, SenderSession, WriteOutcome};
use kvwire_proto::wire::{
    Digest128, DigestAlgorithm, ErrorCode, Frame, Hello, KvLayout, Role, TransferDigests,
    TransferRef,
};

fn layout(buffers: usize) -> KvLayout {
    KvLayout {
        tokens_per_page: 16,
        buffer_page_bytes: vec![4096; buffers],
        fingerprint: b"m".to_vec(),
    }
}

fn hello(role: Role, layout: KvLayout) -> Hello {
    Hello {
        node_id: 1,
        role,
        layout,
        digests: vec![DigestAlgorithm::XXH3_64],
        transport_params: vec![],
        max_aux: 0,
    }
}

fn established(role: Role, buffers: usize) -> Established {
    let peer = if role == Role::SENDER {
        Role::RECEIVER
    } else {
        Role::SENDER
    };
    Established {
        local: hello(role, layout(buffers)),
        peer: hello(peer, layout(buffers)),
        digests: vec![DigestAlgorithm::XXH3_64],
    }
}

/// Regression (SPEC review Q1): a deadline re-armed by dropped frames sat in the timer heap
/// several times and fired once per copy. A sender timing out on its verdict sent ABORT and
/// then, on the duplicate, ended without waiting for ABORT_ACK.
#[test]
fn a_deadline_rearmed_by_dropped_frames_fires_once() {
    let now = Instant::now();
    let cfg = SenderConfig::default();
    let verdict_timeout = cfg.verdict_timeout;
    let mut s = SenderSession::new(&established(Role::SENDER, 1), cfg);
    let policy = AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 64,
        max_context_tokens: 1024,
    };
    let admitted = policy
        .admit(Request {
            transfer_id: TransferId(1),
            tokens: 32,
        })
        .unwrap();
    s.submit(now, admitted, vec![0, 1]).unwrap();
    s.handle_frame(now, Frame::Reserve(common::reserve_for(TransferId(1), 9)))
        .unwrap();
    let t = TransferRef {
        transfer_id: TransferId(1),
        nonce: 9,
    };
    while s.poll_action().is_some() {}
    s.handle_digests(
        now,
        t,
        TransferDigests {
            buffers: vec![Digest128::from_u128(3)],
            pages: vec![],
            aux: Digest128::from_u128(4),
        },
    );
    s.handle_write_outcome(now, t, WriteOutcome::Completed, 2);
    assert!(matches!(s.poll_transmit(), Some(Frame::Commit(_))));
    // Stale frames for this transfer are dropped; each re-arms the same verdict deadline.
    for _ in 0..3 {
        let stale = TransferRef {
            transfer_id: TransferId(1),
            nonce: 8,
        };
        assert!(s.handle_frame(now, Frame::Verified(stale)).is_err());
    }
    s.handle_timeout(now + verdict_timeout);
    assert!(matches!(s.poll_transmit(), Some(Frame::Abort(a)) if a.code == ErrorCode::TIMEOUT));
    assert_eq!(
        s.open_transfers(),
        1,
        "the transfer must still wait for ABORT_ACK"
    );
    s.handle_frame(now + verdict_timeout, Frame::AbortAck(t))
        .unwrap();
    assert_eq!(s.open_transfers(), 0);
    assert!(!s
        .poll_action()
        .is_some_and(|a| !matches!(a, SenderAction::ReleaseSource(TransferId(1)))));
}

/// Regression (SPEC review Q6): a layout with zero buffers passed the handshake, and a
/// receiver with nothing to digest would "verify" and deliver. Degenerate layouts are
/// refused, on either side.
#[test]
fn degenerate_layouts_are_refused_at_the_handshake() {
    for bad in [
        KvLayout {
            tokens_per_page: 16,
            buffer_page_bytes: vec![],
            fingerprint: vec![],
        },
        KvLayout {
            tokens_per_page: 0,
            buffer_page_bytes: vec![4096],
            fingerprint: vec![],
        },
        KvLayout {
            tokens_per_page: 16,
            buffer_page_bytes: vec![4096, 0],
            fingerprint: vec![],
        },
    ] {
        let r = check_peer(
            &hello(Role::RECEIVER, bad.clone()),
            &hello(Role::SENDER, bad.clone()),
        );
        let reject = r.expect_err("degenerate layout accepted");
        assert_eq!(reject.code, ErrorCode::LAYOUT_MISMATCH, "{bad:?}");
        assert!(reject.detail.contains("degenerate"), "{}", reject.detail);
    }
}

/// Regression (SPEC review Q4): with per-page digests, 64 buffers x 2048 pages makes a COMMIT
/// larger than the frame limit; the transfer could only hang until its timeout. Such a
/// reservation is refused before anything is sent.
#[test]
fn a_reservation_whose_commit_cannot_fit_is_refused() {
    let now = Instant::now();
    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER, 64),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
    );
    let req = |page_digests| ReservationRequest {
        transfer_id: TransferId(1),
        tokens: 2048 * 16,
        pages: (0..2048).collect(),
        digest: None,
        page_digests,
        timeout: Duration::from_secs(1),
        access: vec![],
    };
    assert_eq!(r.reserve(now, req(true)), Err(ReserveError::TooLarge));
    assert!(r.poll_transmit().is_none());
    // Without per-page digests the COMMIT is small and the reservation goes ahead.
    assert!(r.reserve(now, req(false)).is_ok());
}

fn drain_actions<A>(mut poll: impl FnMut() -> Option<A>) -> Vec<A> {
    std::iter::from_fn(&mut poll).collect()
}

/// A receiver whose transfer has been committed and fenced, with its digest job running.
fn receiver_verifying(now: Instant) -> (ReceiverSession, TransferRef) {
    use kvwire_proto::receiver::ReceiverAction;

    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER, 1),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
    );
    let t = r
        .reserve(now, common::reservation_request(TransferId(1)))
        .unwrap();
    let commit = common::commit_of(t, vec![]);
    r.handle_frame(now, Frame::Commit(commit)).unwrap();
    assert_eq!(
        drain_actions(|| r.poll_action()),
        vec![ReceiverAction::Fence(t)]
    );
    r.handle_fenced(now, t);
    assert!(matches!(
        drain_actions(|| r.poll_action())[..],
        [ReceiverAction::ComputeDigests { .. }]
    ));
    (r, t)
}

/// Regression (SPEC review Q2): a receiver that failed a transfer while its digest job was
/// still hashing the pages released them at once, so they could be reused under the hash.
/// Release now waits for the digest job to return.
#[test]
fn receiver_releases_only_after_the_digest_job_returns() {
    use kvwire_proto::receiver::{ReceiverAction, ReceiverEvent};
    let now = Instant::now();
    for lose_peer in [false, true] {
        let (mut r, t) = receiver_verifying(now);
        if lose_peer {
            r.handle_peer_lost(now);
        } else {
            assert!(r.abort(now, TransferId(1), ErrorCode::CANCELLED));
        }
        let actions = drain_actions(|| r.poll_action());
        assert_eq!(
            actions,
            vec![ReceiverAction::Quarantine(t)],
            "released under a running digest"
        );
        assert!(r.poll_event().is_none());
        r.handle_digests(now, t, TransferDigests::default());
        assert_eq!(
            drain_actions(|| r.poll_action()),
            vec![ReceiverAction::Release(t)]
        );
        assert!(matches!(r.poll_event(), Some(ReceiverEvent::Failed { .. })));
    }
}

/// Regression (SPEC review Q2): a sender abandoning a transfer whose writes had all
/// completed but whose source digest was still running released the source pages at once.
#[test]
fn sender_releases_source_only_after_the_digest_job_returns() {
    let now = Instant::now();
    let mut s = SenderSession::new(&established(Role::SENDER, 1), SenderConfig::default());
    let policy = AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 64,
        max_context_tokens: 1024,
    };
    let admitted = policy
        .admit(Request {
            transfer_id: TransferId(1),
            tokens: 32,
        })
        .unwrap();
    s.submit(now, admitted, vec![0, 1]).unwrap();
    s.handle_frame(now, Frame::Reserve(common::reserve_for(TransferId(1), 9)))
        .unwrap();
    let t = TransferRef {
        transfer_id: TransferId(1),
        nonce: 9,
    };
    drain_actions(|| s.poll_action());
    s.handle_write_outcome(now, t, WriteOutcome::Completed, 2);
    assert!(s.abort(now, TransferId(1), ErrorCode::CANCELLED));
    let actions = drain_actions(|| s.poll_action());
    assert!(
        !actions.contains(&SenderAction::ReleaseSource(TransferId(1))),
        "source released under a running digest: {actions:?}"
    );
    assert!(
        s.poll_transmit().is_none(),
        "ABORT sent before the drain finished"
    );
    s.handle_digests(now, t, TransferDigests::default());
    assert!(drain_actions(|| s.poll_action()).contains(&SenderAction::ReleaseSource(TransferId(1))));
    assert!(matches!(s.poll_transmit(), Some(Frame::Abort(a)) if a.completed_pages == 2));
}

/// A sender with one transfer of two pages reserved by nonce 9; `commit` says whether it
/// also completes its writes and digests, so the COMMIT goes out (AwaitingVerdict).
fn sender_with_transfer(now: Instant, commit: bool) -> (SenderSession, TransferRef) {
    let mut s = SenderSession::new(&established(Role::SENDER, 1), SenderConfig::default());
    let policy = AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 64,
        max_context_tokens: 1024,
    };
    let admitted = policy
        .admit(Request {
            transfer_id: TransferId(1),
            tokens: 32,
        })
        .unwrap();
    s.submit(now, admitted, vec![0, 1]).unwrap();
    s.handle_frame(now, Frame::Reserve(common::reserve_for(TransferId(1), 9)))
        .unwrap();
    let t = TransferRef {
        transfer_id: TransferId(1),
        nonce: 9,
    };
    drain_actions(|| s.poll_action());
    if commit {
        s.handle_write_outcome(now, t, WriteOutcome::Completed, 2);
        let d = TransferDigests {
            buffers: vec![Digest128([1; 16])],
            pages: vec![],
            aux: Digest128([2; 16]),
        };
        s.handle_digests(now, t, d);
        assert!(
            std::iter::from_fn(|| s.poll_transmit()).any(|f| matches!(f, Frame::Commit(_))),
            "no COMMIT"
        );
    }
    (s, t)
}

fn failure(s: &mut SenderSession) -> kvwire_proto::FailureReason {
    std::iter::from_fn(|| s.poll_event())
        .find_map(|e| match e {
            kvwire_proto::sender::SenderEvent::Failed { reason, .. } => Some(reason),
            _ => None,
        })
        .expect("no failure reported")
}

/// SPEC §7.6: a committed transfer that loses its peer before a verdict is `Unconfirmed`
/// (the receiver may have delivered), never a plain failure; one whose COMMIT never left is
/// a definite failure, with the peer-unresponsive reason when the heartbeat found it.
#[test]
fn a_committed_transfer_without_a_verdict_is_unconfirmed_an_uncommitted_one_failed() {
    use kvwire_proto::FailureReason;
    let now = Instant::now();
    let (mut s, _) = sender_with_transfer(now, true);
    s.handle_peer_unresponsive(now);
    let r = failure(&mut s);
    assert_eq!(
        r,
        FailureReason::Unconfirmed {
            cause: Box::new(FailureReason::PeerUnresponsive)
        }
    );
    assert!(!r.is_retryable());

    let (mut s, _) = sender_with_transfer(now, false);
    s.handle_peer_unresponsive(now);
    s.handle_write_outcome(
        now,
        TransferRef {
            transfer_id: TransferId(1),
            nonce: 9,
        },
        WriteOutcome::Cancelled,
        2,
    );
    s.handle_digests(
        now,
        TransferRef {
            transfer_id: TransferId(1),
            nonce: 9,
        },
        TransferDigests::default(),
    );
    let r = failure(&mut s);
    assert_eq!(r, FailureReason::PeerUnresponsive);
    assert!(r.is_retryable());
}

/// SPEC §9.2, several rails: a transfer whose lane failed is abandoned alone, and the peer
/// told with ABORT(SHUTDOWN): a committed one then ends as the answer says (ABORT_ACK: a
/// definite, retryable PeerLost; VERIFIED: delivered after all); one still writing sends its
/// ABORT once its writes are drained; the session goes on; an id not open is left alone.
#[test]
fn a_transfer_whose_lane_failed_is_aborted_alone() {
    use kvwire_proto::sender::SenderEvent;
    use kvwire_proto::FailureReason;
    let now = Instant::now();
    let abort_of = |s: &mut SenderSession| {
        std::iter::from_fn(|| s.poll_transmit()).find_map(|f| match f {
            Frame::Abort(a) => Some(a),
            _ => None,
        })
    };
    // Committed, then the lane fails; the receiver acknowledges the ABORT.
    let (mut s, t) = sender_with_transfer(now, true);
    assert!(
        !s.handle_transfer_lost(now, TransferId(77)),
        "not open here"
    );
    assert!(s.poll_event().is_none(), "an id not open ended something");
    assert!(s.handle_transfer_lost(now, t.transfer_id));
    let a = abort_of(&mut s).expect("no ABORT for the lost transfer");
    assert_eq!((a.transfer, a.code), (t, ErrorCode::SHUTDOWN));
    assert!(s.poll_event().is_none(), "ended before the answer");
    s.handle_frame(now, Frame::AbortAck(t)).unwrap();
    let r = failure(&mut s);
    assert_eq!(r, FailureReason::PeerLost);
    assert!(r.is_retryable());
    assert_eq!(s.open_transfers(), 0);
    // Ended: a later loss of the lane that carried it names it again, and changes nothing.
    assert!(!s.handle_transfer_lost(now, t.transfer_id));

    // Committed, and the receiver had delivered: its VERIFIED answers the ABORT.
    let (mut s, t) = sender_with_transfer(now, true);
    s.handle_transfer_lost(now, t.transfer_id);
    assert!(abort_of(&mut s).is_some());
    s.handle_frame(now, Frame::Verified(t)).unwrap();
    assert!(std::iter::from_fn(|| s.poll_event())
        .any(|e| matches!(e, SenderEvent::Verified(x) if x == t)));

    // Still writing: the ABORT goes out once the writes it posted are reported.
    let (mut s, t) = sender_with_transfer(now, false);
    s.handle_transfer_lost(now, t.transfer_id);
    assert!(abort_of(&mut s).is_none(), "an ABORT before the drain");
    s.handle_write_outcome(now, t, WriteOutcome::Failed, 2);
    s.handle_digests(now, t, TransferDigests::default());
    assert!(abort_of(&mut s).is_some());
}

/// The receiver's side: a reservation whose lane failed fails PeerLost, fenced before its
/// pages are released, then tells the sender with ABORT(SHUTDOWN); a second reservation
/// stays open. A sender's ABORT with that code is retryable.
#[test]
fn a_reservation_whose_lane_failed_is_fenced_then_aborted() {
    use kvwire_proto::receiver::{ReceiverAction, ReceiverEvent};
    use kvwire_proto::FailureReason;
    let now = Instant::now();
    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER, 1),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
    );
    let t1 = r
        .reserve(now, common::reservation_request(TransferId(1)))
        .unwrap();
    let _t2 = r
        .reserve(now, common::reservation_request(TransferId(2)))
        .unwrap();
    drain_actions(|| r.poll_action());
    std::iter::from_fn(|| r.poll_transmit()).for_each(drop);
    assert!(r.handle_transfer_lost(now, TransferId(1)));
    assert!(!r.handle_transfer_lost(now, TransferId(9)), "not open here");
    let actions = drain_actions(|| r.poll_action());
    assert!(actions.contains(&ReceiverAction::Fence(t1)), "{actions:?}");
    assert!(
        !actions.contains(&ReceiverAction::Release(t1)),
        "released before the fence: {actions:?}"
    );
    assert!(r.poll_transmit().is_none(), "an ABORT before the fence");
    r.handle_fenced(now, t1);
    assert_eq!(
        drain_actions(|| r.poll_action()),
        vec![ReceiverAction::Release(t1)]
    );
    match r.poll_transmit() {
        Some(Frame::Abort(a)) => assert_eq!((a.transfer, a.code), (t1, ErrorCode::SHUTDOWN)),
        other => panic!("{other:?}"),
    }
    r.handle_frame(now, Frame::AbortAck(t1)).unwrap();
    assert!(matches!(
        std::iter::from_fn(|| r.poll_event()).last(),
        Some(ReceiverEvent::Failed {
            reason: FailureReason::PeerLost,
            ..
        })
    ));
    assert_eq!(r.open_transfers(), 1);
    assert!(FailureReason::PeerAbort {
        code: ErrorCode::SHUTDOWN,
        completed_pages: 0
    }
    .is_retryable());
}

/// SPEC §7.6: the verdict deadline sends ABORT(TIMEOUT); if neither ABORT_ACK nor VERIFIED
/// comes back, the outcome is `Unconfirmed`, not `Timeout` (the divergence SPEC §7.4 once
/// described); an ABORT_ACK makes the failure definite.
#[test]
fn a_verdict_timeout_whose_abort_is_never_answered_is_unconfirmed() {
    use kvwire_proto::{FailureReason, Wait};
    let now = Instant::now();
    let (mut s, t) = sender_with_transfer(now, true);
    let later = now + Duration::from_secs(3600);
    s.handle_timeout(later);
    assert!(matches!(s.poll_transmit(), Some(Frame::Abort(_))));
    s.handle_timeout(later + Duration::from_secs(3600));
    let r = failure(&mut s);
    assert_eq!(
        r,
        FailureReason::Unconfirmed {
            cause: Box::new(FailureReason::Timeout {
                waiting_for: Wait::Verdict
            })
        }
    );

    let (mut s, _) = sender_with_transfer(now, true);
    s.handle_timeout(later);
    assert!(matches!(s.poll_transmit(), Some(Frame::Abort(_))));
    s.handle_frame(later, Frame::AbortAck(t)).unwrap();
    assert_eq!(
        failure(&mut s),
        FailureReason::Timeout {
            waiting_for: Wait::Verdict
        }
    );
}

/// PING / PONG reaching a session (the driver's Liveness takes them first) are dropped with
/// Frame scope: they never close the connection.
#[test]
fn ping_and_pong_are_never_connection_errors_in_a_session() {
    let now = Instant::now();
    let (mut s, _) = sender_with_transfer(now, false);
    let e = s.handle_frame(now, Frame::Ping(1)).unwrap_err();
    assert_eq!(e.scope, kvwire_proto::Scope::Frame);
    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER, 1),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
    );
    let e = r.handle_frame(now, Frame::Pong(1)).unwrap_err();
    assert_eq!(e.scope, kvwire_proto::Scope::Frame);
}
