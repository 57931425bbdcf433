//! Rules that closed SPEC.md §12's open questions (issue 13): one test per rule, each
//! naming the section of the SPEC body that states it.

use kvwire_proto::wire::TransferId;
use std::time::{Duration, Instant};

use kvwire_proto::admission::{AdmissionPolicy, Request};
use kvwire_proto::handshake::Established;
use kvwire_proto::receiver::{ReceiverConfig, ReceiverSession, ReservationRequest};
use kvwire_proto::sender::{SenderConfig, SenderEvent, SenderSession, WriteOutcome};
use kvwire_proto::wire::{
    Abort, Digest128, DigestAlgorithm, ErrorCode, Frame, Hello, KvLayout, Reserve, Role,
    TransferDigests, TransferRef,
};
use kvwire_proto::FailureReason;

const ID: TransferId = TransferId(1);

fn layout() -> KvLayout {
    KvLayout {
        tokens_per_page: 16,
        buffer_page_bytes: vec![4096],
        fingerprint: b"m".to_vec(),
    }
}

fn hello(role: Role) -> Hello {
    Hello {
        node_id: 1,
        role,
        layout: layout(),
        digests: vec![DigestAlgorithm::XXH3_64],
        transport_params: vec![],
        max_aux: 0,
    }
}

fn established(role: Role) -> Established {
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

fn policy() -> AdmissionPolicy {
    AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 64,
        max_context_tokens: 1024,
    }
}

fn reserve(nonce: u64) -> Reserve {
    Reserve {
        transfer_id: ID,
        nonce,
        tokens: 32,
        digest: DigestAlgorithm::XXH3_64,
        page_digests: false,
        deadline_ms: 1000,
        pages: vec![5, 6],
        access: vec![],
    }
}

fn tref(nonce: u64) -> TransferRef {
    TransferRef {
        transfer_id: ID,
        nonce,
    }
}

fn frames_s(s: &mut SenderSession) -> Vec<Frame> {
    std::iter::from_fn(|| s.poll_transmit()).collect()
}

fn frames_r(r: &mut ReceiverSession) -> Vec<Frame> {
    std::iter::from_fn(|| r.poll_transmit()).collect()
}

/// A sender with one two-page transfer submitted; `nonce` (if any) is a RESERVE accepted at
/// `now`, after which it is Writing with its writes and one digest job posted.
fn sender(now: Instant, nonce: Option<u64>) -> SenderSession {
    let mut s = SenderSession::new(&established(Role::SENDER), SenderConfig::default());
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

fn sender_failure(s: &mut SenderSession) -> FailureReason {
    std::iter::from_fn(|| s.poll_event())
        .find_map(|e| match e {
            SenderEvent::Failed { reason, .. } => Some(reason),
            _ => None,
        })
        .expect("no failure reported")
}

fn receiver(now: Instant) -> (ReceiverSession, TransferRef) {
    let mut r = ReceiverSession::new(&established(Role::RECEIVER), ReceiverConfig::default());
    let t = r
        .reserve(
            now,
            ReservationRequest {
                transfer_id: ID,
                tokens: 32,
                pages: vec![3, 4],
                digest: None,
                page_digests: false,
                timeout: Duration::from_secs(1),
                access: vec![],
            },
        )
        .unwrap();
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
