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

/// A sender and a receiver session with moves allowed (SPEC §9.2, moving a transfer off a
/// failed lane), the sender's request 1 (two pages) admitted and submitted, the receiver's
/// reservation for it made and delivered to the sender, whose writes and digest job are
/// posted. Returns the reservation's ref.
fn moving_pair(now: Instant) -> (SenderSession, ReceiverSession, TransferRef) {
    let mut s = SenderSession::new(&established(Role::SENDER, 1), SenderConfig::default());
    s.allow_moves();
    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER, 1),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0002,
    );
    r.allow_moves();
    let admitted = AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 64,
        max_context_tokens: 1024,
    }
    .admit(Request {
        transfer_id: TransferId(1),
        tokens: 32,
    })
    .unwrap();
    s.submit(now, admitted, vec![0, 1]).unwrap();
    let t = r
        .reserve(now, common::reservation_request(TransferId(1)))
        .unwrap();
    drain_actions(|| r.poll_action());
    shuttle_to_sender(now, &mut r, &mut s);
    (s, r, t)
}

/// Every frame the receiver has queued, handed to the sender.
fn shuttle_to_sender(now: Instant, r: &mut ReceiverSession, s: &mut SenderSession) {
    while let Some(f) = r.poll_transmit() {
        let _ = s.handle_frame(now, f);
    }
}

/// The sender's posted writes and digest jobs for `t`, as (pages written, digest jobs).
fn posted_for(s: &mut SenderSession, t: TransferRef) -> (usize, usize) {
    let mut posted = (0, 0);
    for a in drain_actions(|| s.poll_action()) {
        match a {
            SenderAction::PostWrites {
                transfer, writes, ..
            } if transfer == t => posted.0 += writes.len(),
            SenderAction::ComputeDigests { transfer, .. } if transfer == t => posted.1 += 1,
            _ => {}
        }
    }
    posted
}

/// The digests `commit_now` commits and the receiver's landed memory then matches
/// (`common::commit_of`'s buffer digest 5, aux digest 6).
fn the_commits_digests() -> TransferDigests {
    TransferDigests {
        buffers: vec![Digest128::from_u128(5)],
        pages: vec![],
        aux: Digest128::from_u128(6),
    }
}

/// The sender completes `t`'s writes and digests and sends its COMMIT; returns it.
fn commit_now(now: Instant, s: &mut SenderSession, t: TransferRef) -> kvwire_proto::wire::Commit {
    s.handle_write_outcome(now, t, WriteOutcome::Completed, 2);
    s.handle_digests(now, t, the_commits_digests());
    std::iter::from_fn(|| s.poll_transmit())
        .find_map(|f| match f {
            Frame::Commit(c) => Some(c),
            _ => None,
        })
        .expect("no COMMIT")
}

/// SPEC §9.2, moving a transfer: the receiver's lane fails before the COMMIT; the
/// reservation is fenced, its pages reopened on a live lane and reserved again with a fresh
/// nonce; the sender, still writing, drains the old writes and writes every page again under
/// the new reservation; a late COMMIT of the old reservation is dropped; the new COMMIT
/// verifies and both sides count the transfer delivered, with no failure on either side.
#[test]
fn a_transfer_whose_lane_fails_before_its_commit_moves_and_verifies() {
    use kvwire_proto::receiver::{ReceiverAction, ReceiverEvent};
    use kvwire_proto::sender::SenderEvent;
    let now = Instant::now();
    let (mut s, mut r, t1) = moving_pair(now);
    assert_eq!(posted_for(&mut s, t1), (2, 1));

    assert!(r.handle_transfer_lost(now, TransferId(1)));
    assert_eq!(
        drain_actions(|| r.poll_action()),
        vec![ReceiverAction::Fence(t1)]
    );
    assert!(r.poll_transmit().is_none(), "a frame before the fence");
    r.handle_fenced(now, t1);
    assert_eq!(
        drain_actions(|| r.poll_action()),
        vec![ReceiverAction::Reopen(t1)]
    );
    let t2 = r
        .handle_reopened(now, t1, vec![3, 4], vec![0xaa])
        .expect("not moved");
    assert_eq!(t2.transfer_id, t1.transfer_id);
    assert_ne!(t2.nonce, t1.nonce, "a move keeps the nonce");
    assert_eq!(r.stats().moves, 1);
    let reserve = match r.poll_transmit() {
        Some(Frame::Reserve(x)) => x,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        (
            reserve.nonce,
            reserve.tokens,
            &reserve.pages[..],
            &reserve.access[..]
        ),
        (t2.nonce, 32, &[3u32, 4][..], &[0xaau8][..])
    );

    // The sender: the old writes are drained first, nothing new is posted meanwhile.
    s.handle_frame(now, Frame::Reserve(reserve)).unwrap();
    assert!(
        drain_actions(|| s.poll_action())
            .iter()
            .all(|a| !matches!(a, SenderAction::PostWrites { .. })),
        "new writes before the old ones were drained"
    );
    s.handle_write_outcome(now, t1, WriteOutcome::Failed, 2);
    s.handle_digests(now, t1, TransferDigests::default());
    assert!(
        s.poll_transmit().is_none(),
        "an ABORT or COMMIT for the moved reservation"
    );
    assert_eq!(posted_for(&mut s, t2), (2, 1), "every page written again");
    assert_eq!(s.stats().moves, 1);

    // A COMMIT of the old reservation is dropped, the transfer unaffected.
    let mut late = common::commit_of(t1, vec![]);
    late.transfer = t1;
    assert!(r.handle_frame(now, Frame::Commit(late)).is_err());
    assert!(r.poll_transmit().is_none(), "the late COMMIT was answered");
    assert_eq!(r.open_transfers(), 1);

    let c = commit_now(now, &mut s, t2);
    assert_eq!(c.transfer, t2);
    r.handle_frame(now, Frame::Commit(c)).unwrap();
    assert_eq!(
        drain_actions(|| r.poll_action()),
        vec![ReceiverAction::Fence(t2)]
    );
    r.handle_fenced(now, t2);
    drain_actions(|| r.poll_action());
    r.handle_digests(now, t2, the_commits_digests());
    assert!(std::iter::from_fn(|| r.poll_event())
        .any(|e| matches!(e, ReceiverEvent::Delivered(d) if d.transfer == t2)));
    shuttle_to_sender(now, &mut r, &mut s);
    let events: Vec<_> = std::iter::from_fn(|| s.poll_event()).collect();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, SenderEvent::Verified(x) if *x == t2)),
        "{events:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, SenderEvent::Failed { .. })),
        "{events:?}"
    );
    assert_eq!((s.open_transfers(), r.open_transfers()), (0, 0));
}

/// SPEC §9.2, moving a transfer, the sender's side first: its lane fails while it writes,
/// or after its COMMIT went; it drains and waits, holding the source, without an ABORT; the
/// receiver's move then takes it (written again, committed again). A move that never comes
/// ends, at the verdict timeout, in ABORT(SHUTDOWN) as before; without moves a second
/// RESERVE is still refused (DUPLICATE_TRANSFER).
#[test]
fn a_sender_whose_lane_fails_waits_for_the_move() {
    use kvwire_proto::receiver::ReceiverAction;
    use kvwire_proto::sender::SenderEvent;
    let now = Instant::now();
    for committed in [false, true] {
        let (mut s, mut r, t1) = moving_pair(now);
        posted_for(&mut s, t1);
        if committed {
            commit_now(now, &mut s, t1);
        }
        assert!(s.handle_transfer_lost(now, TransferId(1)));
        if !committed {
            s.handle_write_outcome(now, t1, WriteOutcome::Failed, 2);
            s.handle_digests(now, t1, TransferDigests::default());
        }
        assert!(
            s.poll_transmit().is_none(),
            "the sender aborted instead of waiting"
        );
        assert!(
            !drain_actions(|| s.poll_action())
                .iter()
                .any(|a| matches!(a, SenderAction::ReleaseSource(_))),
            "the source was released while a move may come"
        );
        assert!(s.poll_event().is_none());
        // Chunks are not refused meanwhile (a whole submit has none left; nothing changes).
        assert!(r.handle_transfer_lost(now, TransferId(1)));
        drain_actions(|| r.poll_action());
        r.handle_fenced(now, t1);
        assert_eq!(
            drain_actions(|| r.poll_action()),
            vec![ReceiverAction::Reopen(t1)]
        );
        let t2 = r.handle_reopened(now, t1, vec![3, 4], vec![]).unwrap();
        shuttle_to_sender(now, &mut r, &mut s);
        assert_eq!(posted_for(&mut s, t2), (2, 1), "committed: {committed}");
        assert_eq!(commit_now(now, &mut s, t2).transfer, t2);
    }

    // No move within the verdict timeout: ABORT(SHUTDOWN), then the answer decides.
    let (mut s, _r, t1) = moving_pair(now);
    posted_for(&mut s, t1);
    commit_now(now, &mut s, t1);
    s.handle_transfer_lost(now, TransferId(1));
    let later = now + SenderConfig::default().verdict_timeout + Duration::from_millis(1);
    s.handle_timeout(later);
    match s.poll_transmit() {
        Some(Frame::Abort(a)) => assert_eq!((a.transfer, a.code), (t1, ErrorCode::SHUTDOWN)),
        other => panic!("{other:?}"),
    }
    s.handle_frame(later, Frame::AbortAck(t1)).unwrap();
    assert!(std::iter::from_fn(|| s.poll_event()).any(|e| matches!(
        e,
        SenderEvent::Failed {
            reason: kvwire_proto::FailureReason::PeerLost,
            ..
        }
    )));

    // Without moves, a RESERVE with another nonce for a transfer being written is refused.
    let (mut s, t) = sender_with_transfer(now, false);
    let mut again = common::reserve_for(TransferId(1), 10);
    again.nonce = t.nonce + 1;
    assert!(s.handle_frame(now, Frame::Reserve(again)).is_err());
    match s.poll_transmit() {
        Some(Frame::Reject(x)) => assert_eq!(x.code, ErrorCode::DUPLICATE_TRANSFER),
        other => panic!("{other:?}"),
    }
}

/// SPEC §9.2, moving a transfer: the sender gives up on the old reservation (its ABORT names
/// the nonce the transfer moved from) — the receiver's transfer ends, answered with that
/// ref; a reservation whose COMMIT came before its lane failed is not moved: it verifies.
#[test]
fn a_moved_reservation_ends_on_an_abort_of_its_old_nonce_and_a_committed_one_stays() {
    use kvwire_proto::receiver::{ReceiverAction, ReceiverEvent};
    let now = Instant::now();
    let (mut s, mut r, t1) = moving_pair(now);
    posted_for(&mut s, t1);
    r.handle_transfer_lost(now, TransferId(1));
    drain_actions(|| r.poll_action());
    r.handle_fenced(now, t1);
    drain_actions(|| r.poll_action());
    r.handle_reopened(now, t1, vec![3, 4], vec![]).unwrap();
    std::iter::from_fn(|| r.poll_transmit()).for_each(drop);
    r.handle_frame(
        now,
        Frame::Abort(kvwire_proto::wire::Abort {
            transfer: t1,
            code: ErrorCode::SHUTDOWN,
            completed_pages: 0,
            detail: String::new(),
        }),
    )
    .unwrap();
    assert!(matches!(r.poll_transmit(), Some(Frame::AbortAck(x)) if x == t1));
    let actions = drain_actions(|| r.poll_action());
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, ReceiverAction::Fence(_))),
        "{actions:?}"
    );

    // Committed before the lane failed: the verification goes on.
    let (mut s, mut r, t1) = moving_pair(now);
    posted_for(&mut s, t1);
    let c = commit_now(now, &mut s, t1);
    r.handle_frame(now, Frame::Commit(c)).unwrap();
    drain_actions(|| r.poll_action());
    assert!(r.handle_transfer_lost(now, TransferId(1)));
    assert!(drain_actions(|| r.poll_action()).is_empty());
    r.handle_fenced(now, t1);
    drain_actions(|| r.poll_action());
    r.handle_digests(now, t1, the_commits_digests());
    assert!(std::iter::from_fn(|| r.poll_event()).any(|e| matches!(e, ReceiverEvent::Delivered(_))));
}
