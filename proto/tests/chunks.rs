//! Protocol version 2 at the session level: transfers sent in chunks with an auxiliary
//! record (SPEC.md §5.3.2), the receiver's aux and coverage checks (§5.2.5, §5.2.6, §6), and
//! the parked-reservation rules Q9 and Q10 (§5.1).

use std::time::{Duration, Instant};

use kvwire_proto::admission::{AdmissionPolicy, Admitted, Request};
use kvwire_proto::handshake::Established;
use kvwire_proto::receiver::{
    ReceiverAction, ReceiverConfig, ReceiverEvent, ReceiverSession, ReservationRequest,
};
use kvwire_proto::sender::{
    ChunkError, PageWrite, SenderAction, SenderConfig, SenderEvent, SenderSession, SubmitError,
    WriteOutcome,
};
use kvwire_proto::wire::{
    Abort, Commit, Digest128, DigestAlgorithm, ErrorCode, Frame, Hello, KvLayout, Reserve, Role,
    TransferDigests, TransferId, TransferRef, NONE_INDEX,
};
use kvwire_proto::FailureReason;

/// The receiver's `max_aux` in these tests.
const MAX_AUX: u32 = 16;
const ID: TransferId = TransferId(1);
const NONCE: u64 = 9;
const T: TransferRef = TransferRef {
    transfer_id: ID,
    nonce: NONCE,
};

fn hello(role: Role) -> Hello {
    Hello {
        node_id: 1,
        role,
        layout: KvLayout {
            tokens_per_page: 16,
            buffer_page_bytes: vec![4096, 1024],
            fingerprint: b"m".to_vec(),
        },
        digests: vec![DigestAlgorithm::XXH3_64],
        transport_params: vec![],
        // A receiver accepts aux records of up to MAX_AUX bytes; a sender receives none.
        max_aux: if role == Role::RECEIVER { MAX_AUX } else { 0 },
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

fn admitted(id: TransferId, pages: u32) -> Admitted {
    AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 64,
        max_context_tokens: 4096,
    }
    .admit(Request {
        transfer_id: id,
        tokens: u64::from(pages) * 16,
    })
    .unwrap()
}

fn sender() -> SenderSession {
    SenderSession::new(&established(Role::SENDER), SenderConfig::default())
}

fn reserve(id: TransferId, nonce: u64, pages: u32) -> Frame {
    Frame::Reserve(Reserve {
        transfer_id: id,
        nonce,
        tokens: pages * 16,
        digest: DigestAlgorithm::XXH3_64,
        page_digests: false,
        deadline_ms: 1000,
        pages: (100..100 + pages).collect(),
        access: vec![7],
    })
}

fn drain<A>(mut poll: impl FnMut() -> Option<A>) -> Vec<A> {
    std::iter::from_fn(&mut poll).collect()
}

fn digests(tag: u128) -> TransferDigests {
    TransferDigests {
        buffers: vec![Digest128::from_u128(tag), Digest128::from_u128(tag + 1)],
        pages: vec![],
        aux: Digest128::from_u128(tag + 2),
    }
}

fn compute(first: u32, pages: u32, aux: Option<&[u8]>) -> SenderAction {
    SenderAction::ComputeDigests {
        transfer: T,
        algorithm: DigestAlgorithm::XXH3_64,
        page_digests: false,
        first,
        pages,
        aux: aux.map(<[u8]>::to_vec),
    }
}

fn post(ordinals: std::ops::Range<u32>, source: &[u32]) -> SenderAction {
    SenderAction::PostWrites {
        transfer: T,
        writes: ordinals
            .map(|i| PageWrite {
                ordinal: i,
                src_page: source[i as usize],
                dst_page: 100 + i,
            })
            .collect(),
        access: vec![7],
    }
}

/// A transfer of five pages in three chunks (2, 1, 2 pages; the last with an aux record):
/// every chunk is written and digested as it comes, the COMMIT goes only once every write
/// completed and every digest job returned, it carries the aux record, and a receiver fed
/// that COMMIT delivers the pages with the same aux record.
#[test]
fn a_transfer_in_three_chunks_commits_its_aux_and_delivers_it() {
    let now = Instant::now();
    let source = [40, 41, 42, 43, 44];
    for chunk_before_reservation in [false, true] {
        let mut s = sender();
        s.open(now, admitted(ID, 5)).unwrap();
        assert!(s.poll_action().is_none());
        if chunk_before_reservation {
            // A chunk before the reservation waits for it.
            s.submit_chunk(now, ID, source[..2].to_vec(), None).unwrap();
            assert!(s.poll_action().is_none(), "posted before the reservation");
        }
        s.handle_frame(now, reserve(ID, NONCE, 5)).unwrap();
        if !chunk_before_reservation {
            assert!(s.poll_action().is_none(), "nothing to post yet");
            s.submit_chunk(now, ID, source[..2].to_vec(), None).unwrap();
        }
        assert_eq!(
            drain(|| s.poll_action()),
            vec![compute(0, 2, None), post(0..2, &source)]
        );
        s.submit_chunk(now, ID, source[2..3].to_vec(), None)
            .unwrap();
        assert_eq!(
            drain(|| s.poll_action()),
            vec![compute(2, 1, None), post(2..3, &source)]
        );
        s.submit_chunk(now, ID, source[3..].to_vec(), Some(b"tok".to_vec()))
            .unwrap();
        assert_eq!(
            drain(|| s.poll_action()),
            vec![compute(3, 2, Some(b"tok")), post(3..5, &source)]
        );
        // Every write completes and the final digests return, but the first chunk's digest
        // job has not: no COMMIT yet (it still reads the source).
        s.handle_write_outcome(now, T, WriteOutcome::Completed, 5);
        s.handle_chunk_digested(now, T);
        s.handle_digests(now, T, digests(10));
        assert!(
            s.poll_transmit().is_none(),
            "COMMIT before every digest job returned"
        );
        s.handle_chunk_digested(now, T);
        let Some(Frame::Commit(commit)) = s.poll_transmit() else {
            panic!("no COMMIT");
        };
        assert_eq!(commit.aux, b"tok");
        assert_eq!(commit.aux_digest, Digest128::from_u128(12));
        assert_eq!(commit.buffer_digests, digests(10).buffers);
        assert_eq!((commit.pages, commit.tokens), (5, 80));

        // The receiver side: its reservation of the same five pages.
        let (mut r, t) = receiver(now, 5);
        let commit = Commit {
            transfer: t,
            ..commit
        };
        r.handle_frame(now, Frame::Commit(commit)).unwrap();
        assert_eq!(drain(|| r.poll_action()), vec![ReceiverAction::Fence(t)]);
        r.handle_fenced(now, t);
        assert_eq!(
            drain(|| r.poll_action()),
            vec![ReceiverAction::ComputeDigests {
                transfer: t,
                algorithm: DigestAlgorithm::XXH3_64,
                page_digests: false,
                aux: b"tok".to_vec(),
            }]
        );
        r.handle_digests(now, t, digests(10));
        match r.poll_event() {
            Some(ReceiverEvent::Delivered(d)) => {
                assert_eq!(d.aux, b"tok");
                assert_eq!(d.pages, 5);
            }
            other => panic!("expected Delivered, got {other:?}"),
        }
        assert_eq!(r.poll_transmit(), Some(Frame::Verified(t)));
        s.handle_frame(now, Frame::Verified(T)).unwrap();
        assert_eq!(s.poll_event(), Some(SenderEvent::Verified(T)));
        assert_eq!(
            drain(|| s.poll_action()),
            vec![SenderAction::ReleaseSource(ID)]
        );
    }
}

/// Every misuse of `submit_chunk` is a typed error that changes nothing.
#[test]
fn chunk_errors_are_typed_and_change_nothing() {
    let now = Instant::now();
    let mut s = sender();
    assert_eq!(
        s.submit_chunk(now, ID, vec![1], None),
        Err(ChunkError::UnknownTransfer(ID))
    );
    s.open(now, admitted(ID, 3)).unwrap();
    s.handle_frame(now, reserve(ID, NONCE, 3)).unwrap();
    assert_eq!(
        s.submit_chunk(now, ID, vec![], None),
        Err(ChunkError::EmptyChunk)
    );
    assert_eq!(
        s.submit_chunk(now, ID, vec![1, 2, 3, 4], None),
        Err(ChunkError::TooManyPages {
            given: 4,
            remaining: 3
        })
    );
    assert_eq!(
        s.submit_chunk(now, ID, vec![1], Some(vec![1])),
        Err(ChunkError::AuxBeforeFinal)
    );
    assert_eq!(
        s.submit_chunk(now, ID, vec![1, 2, 3], Some(vec![0; MAX_AUX as usize + 1])),
        Err(ChunkError::AuxTooLarge {
            len: MAX_AUX as usize + 1,
            max: MAX_AUX
        })
    );
    assert!(
        s.poll_action().is_none(),
        "a refused chunk posted something"
    );
    // The transfer is untouched: a good final chunk with the largest aux still goes.
    s.submit_chunk(now, ID, vec![1, 2, 3], Some(vec![5; MAX_AUX as usize]))
        .unwrap();
    assert_eq!(drain(|| s.poll_action()).len(), 2);
    assert_eq!(
        s.submit_chunk(now, ID, vec![4], None),
        Err(ChunkError::AfterFinal(ID))
    );

    // A transfer being drained refuses chunks; its outcome comes as an event.
    let id2 = TransferId(2);
    s.open(now, admitted(id2, 3)).unwrap();
    s.handle_frame(now, reserve(id2, 5, 3)).unwrap();
    s.submit_chunk(now, id2, vec![9], None).unwrap();
    drain(|| s.poll_action());
    assert!(s.abort(now, id2, ErrorCode::CANCELLED));
    assert_eq!(
        s.submit_chunk(now, id2, vec![10], None),
        Err(ChunkError::TransferEnding(id2))
    );
    // After the connection is lost, chunks for a transfer it ended are refused as such.
    let id3 = TransferId(3);
    s.open(now, admitted(id3, 2)).unwrap();
    s.handle_peer_lost(now);
    assert_eq!(
        s.submit_chunk(now, id3, vec![1], None),
        Err(ChunkError::PeerLost)
    );
}

/// An abort between chunks drains what was posted: CancelWrites, and the source is released
/// only once every posted write is accounted for and every chunk's digest job returned.
#[test]
fn a_drain_waits_for_every_chunk_digest_job() {
    let now = Instant::now();
    let mut s = sender();
    s.open(now, admitted(ID, 4)).unwrap();
    s.handle_frame(now, reserve(ID, NONCE, 4)).unwrap();
    s.submit_chunk(now, ID, vec![1], None).unwrap();
    s.submit_chunk(now, ID, vec![2], None).unwrap();
    assert_eq!(drain(|| s.poll_action()).len(), 4);
    s.handle_write_outcome(now, T, WriteOutcome::Completed, 2);
    assert!(s.abort(now, ID, ErrorCode::CANCELLED));
    assert_eq!(
        drain(|| s.poll_action()),
        vec![SenderAction::CancelWrites(T)]
    );
    s.handle_chunk_digested(now, T);
    assert!(
        s.poll_action().is_none(),
        "source released while a chunk's digest job still reads it"
    );
    assert!(
        s.poll_transmit().is_none(),
        "ABORT before the drain finished"
    );
    s.handle_chunk_digested(now, T);
    assert_eq!(
        drain(|| s.poll_action()),
        vec![SenderAction::ReleaseSource(ID)]
    );
    assert!(matches!(
        s.poll_transmit(),
        Some(Frame::Abort(a)) if a.completed_pages == 2 && a.code == ErrorCode::CANCELLED
    ));

    // Before the reservation, an abort with chunks given releases at once, sends nothing.
    let mut s = sender();
    s.open(now, admitted(ID, 4)).unwrap();
    s.submit_chunk(now, ID, vec![1, 2], None).unwrap();
    assert!(s.abort(now, ID, ErrorCode::CANCELLED));
    assert_eq!(
        drain(|| s.poll_action()),
        vec![SenderAction::ReleaseSource(ID)]
    );
    assert!(s.poll_transmit().is_none());
    assert_eq!(
        s.submit_chunk(now, ID, vec![3, 4], None),
        Err(ChunkError::UnknownTransfer(ID))
    );
}

/// A receiver with a reservation of `pages` pages for transfer 1.
fn receiver(now: Instant, pages: u32) -> (ReceiverSession, TransferRef) {
    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
    );
    let t = r
        .reserve(
            now,
            ReservationRequest {
                transfer_id: ID,
                tokens: pages * 16,
                pages: (0..pages).collect(),
                digest: None,
                page_digests: false,
                timeout: Duration::from_secs(1),
                access: vec![],
            },
        )
        .unwrap();
    assert!(matches!(r.poll_transmit(), Some(Frame::Reserve(_))));
    (r, t)
}

fn commit(t: TransferRef, aux: Vec<u8>) -> Commit {
    Commit {
        transfer: t,
        tokens: 32,
        pages: 2,
        bytes: 2 * 5120,
        digest: DigestAlgorithm::XXH3_64,
        buffer_digests: digests(10).buffers,
        page_digests: vec![],
        aux_digest: digests(10).aux,
        aux,
    }
}

/// A receiver in Verifying: COMMIT accepted, fenced, its digest job running.
fn verifying(now: Instant, aux: &[u8]) -> (ReceiverSession, TransferRef) {
    let (mut r, t) = receiver(now, 2);
    r.handle_frame(now, Frame::Commit(commit(t, aux.to_vec())))
        .unwrap();
    r.handle_fenced(now, t);
    assert_eq!(drain(|| r.poll_action()).len(), 2);
    (r, t)
}

fn nack(r: &mut ReceiverSession) -> (ErrorCode, u32, u32) {
    match r.poll_transmit() {
        Some(Frame::Nack(n)) => (n.code, n.buffer, n.page),
        other => panic!("expected NACK, got {other:?}"),
    }
}

fn failure(r: &mut ReceiverSession) -> FailureReason {
    match r.poll_event() {
        Some(ReceiverEvent::Failed { reason, .. }) => reason,
        other => panic!("expected Failed, got {other:?}"),
    }
}

/// An aux record whose digest over the bytes received differs from the COMMIT's (tampered
/// on the way, or digested by the sender over other bytes) fails the transfer with
/// NACK(AUX_MISMATCH), on the digest-mismatch path: quarantine, release, failure.
#[test]
fn a_tampered_aux_record_is_nacked_aux_mismatch() {
    let now = Instant::now();
    let (mut r, t) = verifying(now, b"tok");
    let mut landed = digests(10);
    landed.aux = Digest128::from_u128(99);
    r.handle_digests(now, t, landed);
    assert_eq!(
        nack(&mut r),
        (ErrorCode::AUX_MISMATCH, NONE_INDEX, NONE_INDEX)
    );
    assert_eq!(
        drain(|| r.poll_action()),
        vec![ReceiverAction::Quarantine(t), ReceiverAction::Release(t)]
    );
    assert_eq!(failure(&mut r), FailureReason::AuxMismatch);
    assert_eq!(r.open_transfers(), 0);
    // The same digests with the matching aux digest deliver.
    let (mut r, t) = verifying(now, b"tok");
    r.handle_digests(now, t, digests(10));
    assert!(matches!(r.poll_event(), Some(ReceiverEvent::Delivered(d)) if d.aux == b"tok"));
}

/// A COMMIT whose aux record is longer than the receiver's `max_aux` is refused with
/// NACK(AUX_TOO_LARGE) before any digest is computed (fence, then release); the sender
/// refuses such a record as a typed error before anything is sent.
#[test]
fn an_oversize_aux_record_is_refused_at_both_ends() {
    let now = Instant::now();
    let (mut r, t) = receiver(now, 2);
    let e = r
        .handle_frame(now, Frame::Commit(commit(t, vec![1; MAX_AUX as usize + 1])))
        .unwrap_err();
    assert_eq!(e.scope, kvwire_proto::Scope::Transfer);
    assert_eq!(
        nack(&mut r),
        (ErrorCode::AUX_TOO_LARGE, NONE_INDEX, NONE_INDEX)
    );
    assert_eq!(
        drain(|| r.poll_action()),
        vec![ReceiverAction::Quarantine(t), ReceiverAction::Fence(t)]
    );
    r.handle_fenced(now, t);
    assert_eq!(drain(|| r.poll_action()), vec![ReceiverAction::Release(t)]);
    assert_eq!(
        failure(&mut r),
        FailureReason::AuxTooLarge {
            len: MAX_AUX + 1,
            max: MAX_AUX
        }
    );
    // Exactly max_aux is accepted.
    let (mut r, t) = receiver(now, 2);
    r.handle_frame(now, Frame::Commit(commit(t, vec![1; MAX_AUX as usize])))
        .unwrap();
    assert_eq!(drain(|| r.poll_action()), vec![ReceiverAction::Fence(t)]);

    let mut s = sender();
    s.submit(now, admitted(ID, 1), vec![3]).unwrap();
    let id = TransferId(2);
    s.open(now, admitted(id, 1)).unwrap();
    assert_eq!(
        s.submit_chunk(now, id, vec![4], Some(vec![0; MAX_AUX as usize + 1])),
        Err(ChunkError::AuxTooLarge {
            len: MAX_AUX as usize + 1,
            max: MAX_AUX
        })
    );
}

/// A COMMIT whose aux digest is all-zero is refused as a missing digest (fail closed).
#[test]
fn an_all_zero_aux_digest_is_a_missing_digest() {
    let now = Instant::now();
    let (mut r, t) = receiver(now, 2);
    let c = Commit {
        aux_digest: Digest128::default(),
        ..commit(t, vec![])
    };
    assert!(r.handle_frame(now, Frame::Commit(c)).is_err());
    assert_eq!(nack(&mut r).0, ErrorCode::MISSING_DIGEST);
}

/// The driver's coverage check (SPEC.md §6) found a reserved page that did not receive all
/// its bytes: `handle_missing_pages` fails the transfer with NACK(PAGES_MISSING) naming the
/// page, on the digest-mismatch path. If the transfer was already failing, it only ends the
/// wait for the digest job.
#[test]
fn missing_pages_fail_the_transfer_with_pages_missing() {
    let now = Instant::now();
    let (mut r, t) = verifying(now, b"");
    r.handle_missing_pages(now, t, 1);
    assert_eq!(nack(&mut r), (ErrorCode::PAGES_MISSING, NONE_INDEX, 1));
    assert_eq!(
        drain(|| r.poll_action()),
        vec![ReceiverAction::Quarantine(t), ReceiverAction::Release(t)]
    );
    assert_eq!(
        failure(&mut r),
        FailureReason::PagesMissing { first_missing: 1 }
    );
    assert!(r.poll_event().is_none(), "never delivered");
    // Another reservation's report is ignored (matched by TransferRef).
    let (mut r, t) = verifying(now, b"");
    r.handle_missing_pages(
        now,
        TransferRef {
            nonce: t.nonce ^ 1,
            ..t
        },
        0,
    );
    assert!(r.poll_transmit().is_none() && r.poll_action().is_none());
    // Failing while the digest job ran: the report ends that wait; the failure stays the
    // one that came first.
    assert!(r.abort(now, ID, ErrorCode::CANCELLED));
    assert_eq!(
        drain(|| r.poll_action()),
        vec![ReceiverAction::Quarantine(t)]
    );
    r.handle_missing_pages(now, t, 0);
    assert_eq!(drain(|| r.poll_action()), vec![ReceiverAction::Release(t)]);
    assert_eq!(
        failure(&mut r),
        FailureReason::LocalAbort {
            code: ErrorCode::CANCELLED
        }
    );
}

/// Q9: the receiver aborts a reservation the sender holds parked (its request not submitted
/// yet). The sender acknowledges, drops the parked RESERVE, and a later submit or open of the
/// id fails at once with the abort's code; no write is posted. A new reservation of the id
/// after that starts afresh.
#[test]
fn an_abort_for_a_parked_reservation_fails_a_later_submit_at_once() {
    let now = Instant::now();
    for whole in [true, false] {
        let mut s = sender();
        s.handle_frame(now, reserve(ID, NONCE, 2)).unwrap();
        s.handle_frame(
            now,
            Frame::Abort(Abort {
                transfer: T,
                code: ErrorCode::TIMEOUT,
                completed_pages: 0,
                detail: "commit deadline".into(),
            }),
        )
        .unwrap();
        assert_eq!(s.poll_transmit(), Some(Frame::AbortAck(T)));
        let r = if whole {
            s.submit(now, admitted(ID, 2), vec![1, 2])
        } else {
            s.open(now, admitted(ID, 2))
        };
        match r {
            Err(SubmitError::AbortedByPeer { code, admitted }) => {
                assert_eq!(code, ErrorCode::TIMEOUT);
                assert_eq!(admitted.transfer_id(), ID);
            }
            other => panic!("expected AbortedByPeer, got {other:?}"),
        }
        assert!(
            s.poll_action().is_none(),
            "a write or digest for an aborted reservation"
        );
        assert!(s.poll_transmit().is_none());
        assert_eq!(s.open_transfers(), 0);
    }

    // A fresh reservation (new nonce) after the abort clears it: submit then serves that
    // reservation.
    let mut s = sender();
    s.handle_frame(now, reserve(ID, NONCE, 2)).unwrap();
    s.handle_frame(
        now,
        Frame::Abort(Abort {
            transfer: T,
            code: ErrorCode::TIMEOUT,
            completed_pages: 0,
            detail: String::new(),
        }),
    )
    .unwrap();
    s.poll_transmit();
    s.handle_frame(now, reserve(ID, NONCE + 1, 2)).unwrap();
    assert!(s.poll_transmit().is_none(), "the new reservation is parked");
    s.submit(now, admitted(ID, 2), vec![1, 2]).unwrap();
    assert!(drain(|| s.poll_action()).iter().any(
        |a| matches!(a, SenderAction::PostWrites { transfer, .. } if transfer.nonce == NONCE + 1)
    ));
}

/// SPEC §5.1 "Refused before reservation": a receiver that cannot take a request (its pool
/// or context too small, its engine cancelled it) refuses it with ABORT nonce 0 before
/// reserving anything. The sender acknowledges, announces the id (its KV would have gone to
/// this peer), and a later submit or open of the id fails at once with the receiver's code;
/// nothing is posted. The receiver drops the ABORT_ACK; a real reservation of the id after
/// that starts afresh.
#[test]
fn a_refusal_before_any_reservation_fails_a_later_submit_at_once() {
    let now = Instant::now();
    let mut r = ReceiverSession::new(&established(Role::RECEIVER), ReceiverConfig::default(), 7);
    assert!(r.refuse(ID, ErrorCode::PROMPT_EXCEEDS_POOL, "pool of 4 pages".into()));
    let abort = r.poll_transmit().expect("the refusal goes out");
    let refusal = TransferRef {
        transfer_id: ID,
        nonce: 0,
    };
    assert_eq!(
        abort,
        Frame::Abort(Abort {
            transfer: refusal,
            code: ErrorCode::PROMPT_EXCEEDS_POOL,
            completed_pages: 0,
            detail: "pool of 4 pages".into(),
        })
    );
    assert!(r.poll_action().is_none(), "nothing leased or fenced");

    for whole in [true, false] {
        let mut s = sender();
        s.handle_frame(now, abort.clone()).unwrap();
        assert_eq!(s.poll_transmit(), Some(Frame::AbortAck(refusal)));
        assert_eq!(
            s.poll_event(),
            Some(SenderEvent::Announced {
                transfer_id: ID,
                refusal: Some(ErrorCode::PROMPT_EXCEEDS_POOL)
            })
        );
        let result = if whole {
            s.submit(now, admitted(ID, 2), vec![1, 2])
        } else {
            s.open(now, admitted(ID, 2))
        };
        match result {
            Err(SubmitError::AbortedByPeer { code, .. }) => {
                assert_eq!(code, ErrorCode::PROMPT_EXCEEDS_POOL)
            }
            other => panic!("expected AbortedByPeer, got {other:?}"),
        }
        assert!(s.poll_action().is_none() && s.poll_transmit().is_none());
        assert_eq!(s.open_transfers(), 0);
    }
    // The acknowledgement names no reservation: dropped without a frame error.
    r.handle_frame(now, Frame::AbortAck(refusal)).unwrap();
    assert!(r.poll_transmit().is_none());

    // A RESERVE after the refusal (the receiver's engine took the request after all) is
    // parked and announced as any other, and served by the submit.
    let mut s = sender();
    s.handle_frame(now, abort.clone()).unwrap();
    s.poll_transmit();
    s.handle_frame(now, reserve(ID, NONCE, 2)).unwrap();
    assert!(s.poll_transmit().is_none(), "parked");
    assert_eq!(
        drain(|| s.poll_event()),
        vec![
            SenderEvent::Announced {
                transfer_id: ID,
                refusal: Some(ErrorCode::PROMPT_EXCEEDS_POOL)
            },
            SenderEvent::Announced {
                transfer_id: ID,
                refusal: None
            }
        ]
    );
    s.submit(now, admitted(ID, 2), vec![1, 2]).unwrap();
    assert!(drain(|| s.poll_action())
        .iter()
        .any(|a| matches!(a, SenderAction::PostWrites { transfer, .. } if *transfer == T)));

    // A refusal of an id the sender already finished changes nothing about it.
    let mut s = sender();
    s.retire(
        AdmissionPolicy {
            tokens_per_page: 16,
            pool_pages: 64,
            max_context_tokens: 16,
        }
        .admit(Request {
            transfer_id: ID,
            tokens: 32,
        })
        .unwrap_err(),
    )
    .unwrap();
    s.handle_frame(now, abort).unwrap();
    assert_eq!(s.poll_transmit(), Some(Frame::AbortAck(refusal)));
    assert!(s.poll_event().is_none(), "a retired id is not announced");
    // An open reservation is not refused: abort ends it instead.
    let (mut r, _) = receiver(now, 2);
    assert!(!r.refuse(ID, ErrorCode::CANCELLED, String::new()));
    assert!(r.poll_transmit().is_none());
}

/// Q10: at most `max_parked` reservations are parked; one more is refused at once with
/// REJECT(PARKED_LIMIT). A RESERVE superseding a parked one of the same id does not count.
#[test]
fn reservations_beyond_max_parked_are_rejected_with_parked_limit() {
    let now = Instant::now();
    let config = SenderConfig {
        max_parked: 2,
        ..SenderConfig::default()
    };
    let mut s = SenderSession::new(&established(Role::SENDER), config);
    s.handle_frame(now, reserve(TransferId(1), 11, 1)).unwrap();
    s.handle_frame(now, reserve(TransferId(2), 12, 1)).unwrap();
    assert!(s.poll_transmit().is_none());
    // A newer reservation for a parked id supersedes it: still two parked.
    s.handle_frame(now, reserve(TransferId(2), 13, 1)).unwrap();
    assert!(matches!(
        s.poll_transmit(),
        Some(Frame::Reject(r)) if r.code == ErrorCode::DUPLICATE_TRANSFER && r.transfer.nonce == 12
    ));
    s.handle_frame(now, reserve(TransferId(3), 14, 1)).unwrap();
    match s.poll_transmit() {
        Some(Frame::Reject(r)) => {
            assert_eq!(r.code, ErrorCode::PARKED_LIMIT);
            assert_eq!(
                r.transfer,
                TransferRef {
                    transfer_id: TransferId(3),
                    nonce: 14
                }
            );
        }
        other => panic!("expected REJECT(PARKED_LIMIT), got {other:?}"),
    }
    assert_eq!(s.stats().rejected_reservations, 2);
    // The parked ones are still served.
    s.submit(now, admitted(TransferId(1), 1), vec![5]).unwrap();
    assert!(drain(|| s.poll_action())
        .iter()
        .any(|a| matches!(a, SenderAction::PostWrites { .. })));
}
