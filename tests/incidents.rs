//! The incident scenarios from DESIGN.md, one test each. Each asserts content and
//! accounting, not just a status, and fails if the check it relies on is removed.

mod common;

use kvwire::TransferId;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use common::{assert_invariants, reserve, send, transfer};
use kvwire::config::{ConfigError, EngineConfig};
use kvwire::memory::{PagePool, PoolGeometry, Scrub};
use kvwire::proto::admission::AdmissionError;
use kvwire::proto::receiver::ReceiverConfig;
use kvwire::proto::wire::{
    Commit, Digest128, DigestAlgorithm, ErrorCode, Frame, Hello, Role, TransferRef,
};
use kvwire::proto::{CountField, FailureReason};
use kvwire::receiver::{ReceiveOutcome, ReceiverDriver, ReserveParams};
use kvwire::testkit::{handshake, Pair, PairConfig, PairError};
use kvwire::testkit::{Fault, FaultRule};
use kvwire::transport::loopback::{self, LoopbackReceiver, LoopbackSender};
use kvwire::transport::{ReceiverTransport, Transport, TransportEvent};

/// The receiver's page bytes for every page of the pool, to prove nothing changed.
fn snapshot(pool: &PagePool) -> Vec<Vec<u8>> {
    (0..pool.capacity_pages())
        .flat_map(|p| (0..pool.buffers()).map(move |b| (p, b)))
        .map(|(p, b)| pool.raw_page(p, b).unwrap().to_vec())
        .collect()
}

/// Incident 1: a prompt longer than the sender's KV pool is "rejected" — in the incident by
/// swapping in a one-token placeholder that still reached the transfer stage. Here it is
/// retired at admission with its original error: the receiver's reservation is answered
/// with REJECT carrying PROMPT_EXCEEDS_POOL, no source page is allocated, zero bytes move,
/// and the receiver delivers nothing.
#[test]
fn placeholder_prompt_longer_than_pool_is_rejected_at_admission() {
    let mut cfg = PairConfig::small();
    // The sender's pool (1024 tokens) is smaller than its context length; the operator
    // overrode the start-up check (a loud warning), so admission is the last line.
    cfg.sender_engine = {
        let mut c = EngineConfig::new(4096);
        c.allow_undersized_pool = true;
        c
    };
    cfg.receiver_pool.pages = 256;
    cfg.receiver_engine = EngineConfig::new(4096);
    let mut pair = Pair::new(cfg).unwrap();
    let before = snapshot(pair.receiver.pool());

    let err = send(&mut pair, 42, 2000).unwrap_err();
    assert!(
        matches!(
            err,
            AdmissionError::ExceedsPool {
                tokens: 2000,
                pool_pages: 64,
                ..
            }
        ),
        "{err:?}"
    );
    reserve(&mut pair, 42, 2000);
    pair.drive();

    match pair.receiver_failure(TransferId(42)) {
        Some(FailureReason::Rejected { code, detail }) => {
            assert_eq!(*code, ErrorCode::PROMPT_EXCEEDS_POOL);
            assert!(
                detail.contains("2000") && detail.contains("64 pages"),
                "original error lost: {detail}"
            );
        }
        other => panic!("expected the original admission error, got {other:?}"),
    }
    assert!(pair.verified.is_empty());
    assert_eq!(
        pair.wire_stats().writes_posted,
        0,
        "a rejected request reached the transfer stage"
    );
    assert_eq!(pair.wire_stats().bytes_landed, 0);
    assert_eq!(
        pair.sender.pool().stats().allocations,
        0,
        "a rejected request allocated pages"
    );
    assert_eq!(
        snapshot(pair.receiver.pool()),
        before,
        "receiver memory changed"
    );
    assert_invariants(&pair);
}

/// The placeholder itself: a one-token request meets a reservation sized for the real
/// prompt. The sender refuses the mismatch (never truncates or pads) and writes nothing.
#[test]
fn placeholder_token_count_mismatch_is_refused_by_the_sender() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    send(&mut pair, 5, 1).unwrap();
    reserve(&mut pair, 5, 900);
    pair.drive();
    assert!(
        matches!(pair.receiver_failure(TransferId(5)), Some(FailureReason::Rejected { code, .. }) if *code == ErrorCode::TOKEN_COUNT_MISMATCH),
        "{:?}",
        pair.receiver_failures
    );
    assert!(
        matches!(pair.sender_failure(TransferId(5)), Some(FailureReason::ReservationRefused { code, .. }) if *code == ErrorCode::TOKEN_COUNT_MISMATCH)
    );
    assert_eq!(pair.wire_stats().writes_posted, 0);
    assert!(pair.verified.is_empty());
    assert_invariants(&pair);
}

fn geometry() -> PoolGeometry {
    PairConfig::small().receiver_pool
}

fn hello(role: Role) -> Hello {
    Hello {
        node_id: 1,
        role,
        layout: geometry().to_layout(b"test-model/tp0".to_vec()),
        digests: vec![DigestAlgorithm::XXH3_64],
        transport_params: vec![],
        max_aux: 0,
    }
}

/// A lone receiver driver, handshaken with a sender that is played by the test through the
/// other end of the loopback wire.
fn receiver_driver(now: Instant) -> (ReceiverDriver<LoopbackReceiver>, LoopbackSender) {
    let (est, _) = handshake(now, hello(Role::RECEIVER), hello(Role::SENDER)).unwrap();
    let pool = Arc::new(PagePool::new(geometry(), Scrub::None).unwrap());
    let source = Arc::new(PagePool::new(geometry(), Scrub::None).unwrap());
    let (s, r) = loopback::connect(source, pool.clone(), Duration::ZERO);
    let rx = ReceiverDriver::new(
        &est,
        pool,
        &EngineConfig::new(1024),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
        r,
    )
    .unwrap();
    (rx, s)
}

/// The frames the receiver sent, as the played sender reads them off the wire.
fn frames_sent(peer: &mut LoopbackSender, now: Instant) -> Vec<Frame> {
    let mut cx = Context::from_waker(Waker::noop());
    let mut out = Vec::new();
    while let Poll::Ready(e) = peer.poll_event(&mut cx, now) {
        if let TransportEvent::Frame(f) = e {
            out.push(f);
        }
    }
    out
}

/// Incident 2: a short transfer. A (buggy or legacy) sender writes 1 of N pages and commits
/// with counts for what it wrote. The receiver compares the commit with its reservation and
/// fails the transfer on the page count; nothing is delivered and every page is released.
#[test]
fn short_transfer_one_of_n_pages_fails_on_counts() {
    let now = Instant::now();
    let (mut rx, mut peer) = receiver_driver(now);
    let t: TransferRef = rx
        .reserve(
            now,
            ReserveParams::new(TransferId(3), 8 * 16, Duration::from_secs(1)),
        )
        .unwrap();
    // The sender writes one page and commits "complete" for one page.
    let page_bytes: u64 = geometry()
        .buffer_page_bytes
        .iter()
        .map(|&b| u64::from(b))
        .sum();
    let commit = Frame::Commit(Commit {
        transfer: t,
        tokens: 16,
        pages: 1,
        bytes: page_bytes,
        digest: DigestAlgorithm::XXH3_64,
        buffer_digests: vec![Digest128::from_u128(1); 3],
        page_digests: vec![],
        aux_digest: Digest128::from_u128(1),
        aux: vec![],
    });
    rx.handle_event(now, TransportEvent::Frame(commit));
    match rx.poll_outcome() {
        Some(ReceiveOutcome::Failed { reason, .. }) => assert_eq!(
            reason,
            FailureReason::CountMismatch {
                field: CountField::Tokens,
                expected: 128,
                got: 16
            }
        ),
        other => panic!("expected a count failure, got {other:?}"),
    }
    assert!(rx.poll_outcome().is_none(), "something was delivered");
    assert_eq!(
        rx.pool().free_pages(),
        rx.pool().capacity_pages(),
        "pages leaked"
    );
    assert_eq!(rx.transport().open_scopes(), 0, "scope not fenced");
    // The NACK tells the sender why.
    let sent = frames_sent(&mut peer, now);
    assert!(matches!(sent[0], Frame::Reserve(_)), "{sent:?}");
    assert!(
        matches!(&sent[1], Frame::Nack(n) if n.code == ErrorCode::COUNT_MISMATCH),
        "{sent:?}"
    );
}

/// Incident 3: stale pages. Counts are right and "transfer complete" arrives, but the data
/// never landed (lost writes reported complete). The receiver knows which reserved pages
/// received all their bytes for this reservation (coverage, SPEC §6; TCP and loopback see
/// every landed record): the transfer fails with PAGES_MISSING naming the first page that
/// did not, before any digest, and the engine never sees the stale bytes of another tenant.
/// (Over RDMA, which cannot see landings, the digests catch it: tests/rdma.rs.)
#[test]
fn stale_pages_counts_right_data_not_written_fails_on_coverage() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    for ordinal in 0..4 {
        pair.fault(FaultRule::on(TransferId(11), Fault::DropWrite { ordinal }));
    }
    transfer(&mut pair, 11, 64);
    pair.drive();
    assert!(pair.verified.is_empty(), "stale pages were delivered");
    assert_eq!(
        pair.receiver_failure(TransferId(11)),
        Some(&FailureReason::PagesMissing { first_missing: 0 })
    );
    assert!(matches!(
        pair.sender_failure(TransferId(11)),
        Some(FailureReason::Nacked { code, buffer: None, page: Some(0) }) if *code == ErrorCode::PAGES_MISSING
    ));
    assert_eq!(pair.wire_stats().bytes_landed, 0);
    assert_eq!(pair.receiver.stats().coverage_failures, 1);
    assert_invariants(&pair);
}

/// One lost page among many is enough, and the failure names it.
#[test]
fn stale_pages_one_lost_page_is_named() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    pair.fault(FaultRule::on(
        TransferId(12),
        Fault::DropWrite { ordinal: 5 },
    ));
    transfer(&mut pair, 12, 160);
    pair.drive();
    assert!(pair.verified.is_empty());
    assert_eq!(
        pair.receiver_failure(TransferId(12)),
        Some(&FailureReason::PagesMissing { first_missing: 5 })
    );
    assert_invariants(&pair);
}

/// Bytes that landed but differ from the sender's (altered on the way) are caught by the
/// digests over the receiver's own memory, naming the first bad buffer and page.
#[test]
fn altered_bytes_fail_on_digest_naming_the_page() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    pair.fault(FaultRule::on(
        TransferId(13),
        Fault::CorruptByte {
            ordinal: 3,
            buffer: 1,
            offset: 10,
        },
    ));
    transfer(&mut pair, 13, 160);
    pair.drive();
    assert!(pair.verified.is_empty());
    assert_eq!(
        pair.receiver_failure(TransferId(13)),
        Some(&FailureReason::DigestMismatch {
            buffer: 1,
            page: Some(3)
        })
    );
    assert_invariants(&pair);
}

/// Incident 4: the receiver aborts while writes are in flight. It fences first (closes the
/// transfer's access scope), only then releases the pages, and the writes that arrive after
/// the fence are refused: they land in no page, released or not, and the pages keep their
/// bytes. The sender drains its posted writes before acknowledging.
#[test]
fn abort_while_writes_in_flight_fences_before_release() {
    let mut cfg = PairConfig::small();
    cfg.receiver_scrub = Scrub::Poison;
    let mut pair = Pair::new(cfg).unwrap();
    pair.fault(FaultRule::on(TransferId(21), Fault::LateWrites));
    transfer(&mut pair, 21, 128);
    assert!(
        pair.drive_until(|p| p.held_writes(TransferId(21)) > 0),
        "no write ever in flight"
    );
    let reserved = pair.receiver.pool().leased_pages();
    assert_eq!(reserved, 8);

    let now = pair.now;
    assert!(pair
        .receiver
        .abort(now, TransferId(21), ErrorCode::CANCELLED));
    // The fence completed before the release: the scope is closed and nothing was released
    // while it was open.
    assert_eq!(pair.open_scopes(), 0);
    assert_eq!(pair.receiver.stats().release_before_fence, 0);
    assert_eq!(pair.receiver.stats().fences, 1);
    let after_release = snapshot(pair.receiver.pool());

    pair.drive();
    assert!(
        pair.wire_stats().writes_refused > 0,
        "the late writes never arrived"
    );
    assert_eq!(
        pair.wire_stats().writes_landed,
        0,
        "a late write landed after the fence"
    );
    assert_eq!(
        snapshot(pair.receiver.pool()),
        after_release,
        "released pages changed after the fence"
    );
    assert!(matches!(
        pair.receiver_failure(TransferId(21)),
        Some(FailureReason::LocalAbort { .. })
    ));
    assert!(matches!(
        pair.sender_failure(TransferId(21)),
        Some(FailureReason::PeerAbort { .. })
    ));
    assert!(pair.verified.is_empty());
    assert_invariants(&pair);
}

/// The same race without a held write: abort after some writes landed and others are on the
/// wire.
#[test]
fn abort_midway_through_real_writes() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    transfer(&mut pair, 22, 256);
    assert!(pair.drive_until(|p| p.wire_stats().writes_landed >= 2));
    let now = pair.now;
    assert!(pair
        .receiver
        .abort(now, TransferId(22), ErrorCode::CANCELLED));
    pair.drive();
    assert!(pair.verified.is_empty());
    assert!(matches!(
        pair.sender_failure(TransferId(22)),
        Some(FailureReason::PeerAbort { .. })
    ));
    assert_invariants(&pair);
}

/// Incident 5: the KV pool (sized at start) is smaller than the configured context length.
/// The engine refuses to start, naming both numbers.
#[test]
fn pool_smaller_than_context_refuses_to_start() {
    let mut cfg = PairConfig::small();
    cfg.receiver_engine = EngineConfig::new(2048);
    match Pair::new(cfg) {
        Err(PairError::Config(
            e @ ConfigError::PoolSmallerThanContext {
                pool_tokens: 1024,
                context_tokens: 2048,
                ..
            },
        )) => {
            let msg = e.to_string();
            assert!(msg.contains("1024") && msg.contains("2048"), "{msg}");
        }
        other => panic!("engine started with an undersized pool: {other:?}"),
    }
}

/// Fail closed: a commit whose counts are right but whose digest is all zero (a sender that
/// skipped verification) is a failure, not a pass, and nothing is delivered.
#[test]
fn zero_digest_is_missing_and_fails_closed() {
    let now = Instant::now();
    let (mut rx, _peer) = receiver_driver(now);
    let params = ReserveParams::new(TransferId(4), 32, Duration::from_secs(1));
    let t = rx.reserve(now, params).unwrap();
    let page_bytes: u64 = geometry()
        .buffer_page_bytes
        .iter()
        .map(|&b| u64::from(b))
        .sum();
    let mut digests = vec![Digest128::from_u128(7); 3];
    digests[2] = Digest128::default();
    let commit = Frame::Commit(Commit {
        transfer: t,
        tokens: 32,
        pages: 2,
        bytes: 2 * page_bytes,
        digest: DigestAlgorithm::XXH3_64,
        buffer_digests: digests,
        page_digests: vec![],
        aux_digest: Digest128::from_u128(1),
        aux: vec![],
    });
    rx.handle_event(now, TransportEvent::Frame(commit));
    match rx.poll_outcome() {
        Some(ReceiveOutcome::Failed {
            reason: FailureReason::MissingDigest { detail },
            ..
        }) => {
            assert!(detail.contains("buffer 2"), "{detail}")
        }
        other => panic!("a zero digest was not treated as missing: {other:?}"),
    }
    assert!(rx.poll_outcome().is_none());
    assert_eq!(rx.pool().free_pages(), rx.pool().capacity_pages());
}

/// The pool an endpoint is given must have the geometry it advertised at the handshake;
/// otherwise every transfer would fail later on counts or digests. It refuses to start.
#[test]
fn pool_that_differs_from_the_negotiated_layout_refuses_to_start() {
    let now = Instant::now();
    let (est, _) = handshake(now, hello(Role::RECEIVER), hello(Role::SENDER)).unwrap();
    let mut g = geometry();
    g.buffer_page_bytes[1] = 1024;
    let pool = Arc::new(PagePool::new(g, Scrub::None).unwrap());
    let source = Arc::new(PagePool::new(geometry(), Scrub::None).unwrap());
    let (_, r) = loopback::connect(source, pool.clone(), Duration::ZERO);
    match ReceiverDriver::new(
        &est,
        pool,
        &EngineConfig::new(1024),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0001,
        r,
    ) {
        Err(e @ ConfigError::PoolLayoutMismatch { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("1024") && msg.contains("256"), "{msg}");
        }
        other => panic!("endpoint started on a pool unlike its layout: {other:?}"),
    }
}
