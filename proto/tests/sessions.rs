//! Session-level regression tests for bugs found while writing SPEC.md.

use std::time::{Duration, Instant};

use kvwire_proto::admission::{AdmissionPolicy, Request};
use kvwire_proto::handshake::{check_peer, Established};
use kvwire_proto::receiver::{ReceiverConfig, ReceiverSession, ReservationRequest, ReserveError};
use kvwire_proto::sender::{SenderAction, SenderConfig, SenderSession, WriteOutcome};
use kvwire_proto::wire::{
    Digest128, DigestAlgorithm, ErrorCode, Frame, Hello, KvLayout, Reserve, Role, TransferDigests,
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
            transfer_id: 1,
            tokens: 32,
        })
        .unwrap();
    s.submit(now, admitted, vec![0, 1]).unwrap();
    s.handle_frame(
        now,
        Frame::Reserve(Reserve {
            transfer_id: 1,
            nonce: 9,
            tokens: 32,
            digest: DigestAlgorithm::XXH3_64,
            page_digests: false,
            deadline_ms: 1000,
            pages: vec![5, 6],
            access: vec![],
        }),
    )
    .unwrap();
    let t = TransferRef {
        transfer_id: 1,
        nonce: 9,
    };
    while s.poll_action().is_some() {}
    s.handle_digests(
        now,
        t,
        TransferDigests {
            buffers: vec![Digest128::from_u128(3)],
            pages: vec![],
        },
    );
    s.handle_write_outcome(now, t, WriteOutcome::Completed, 2);
    assert!(matches!(s.poll_transmit(), Some(Frame::Commit(_))));
    // Stale frames for this transfer are dropped; each re-arms the same verdict deadline.
    for _ in 0..3 {
        let stale = TransferRef {
            transfer_id: 1,
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
        .is_some_and(|a| !matches!(a, SenderAction::ReleaseSource(1))));
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
    let mut r = ReceiverSession::new(&established(Role::RECEIVER, 64), ReceiverConfig::default());
    let req = |page_digests| ReservationRequest {
        transfer_id: 1,
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
