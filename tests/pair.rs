//! The Pair harness itself: clean transfers verify with the right bytes.

mod common;

use common::{assert_invariants, transfer};
use kvwire::testkit::{Pair, PairConfig};
use kvwire::TransferId;

#[test]
fn one_transfer_verifies_with_the_senders_bytes() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    transfer(&mut pair, 7, 100);
    pair.drive();
    assert_eq!(pair.verified, vec![TransferId(7)]);
    assert!(pair.sender_verified(TransferId(7)));
    assert!(
        pair.receiver_failures.is_empty(),
        "{:?}",
        pair.receiver_failures
    );
    assert!(pair.wire_stats().bytes_landed > 0);
    assert_invariants(&pair);
}

#[test]
fn many_concurrent_transfers_verify() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    for id in 1..=12u64 {
        transfer(&mut pair, id, 40 + id as u32 * 3);
    }
    pair.drive();
    let mut v = pair.verified.clone();
    v.sort_unstable();
    assert_eq!(v, (1..=12).map(TransferId).collect::<Vec<_>>());
    assert_invariants(&pair);
}

#[test]
fn reservation_before_request_is_parked_then_served() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    common::reserve(&mut pair, 9, 33);
    // Deliver the RESERVE to a sender that has no such request yet (no timer may fire).
    while !pair.wire_idle() {
        pair.step();
    }
    assert_eq!(pair.sender.session().open_transfers(), 0);
    common::send(&mut pair, 9, 33).unwrap();
    pair.drive();
    assert_eq!(
        pair.verified,
        vec![TransferId(9)],
        "receiver failures: {:?}",
        pair.receiver_failures
    );
    assert_invariants(&pair);
}

/// Regression: a duplicated RESERVE (same nonce) reached a sender already writing, which
/// answered REJECT(DUPLICATE_TRANSFER) and so failed a healthy transfer. A duplicate of the
/// current reservation is now dropped.
#[test]
fn duplicated_reserve_is_idempotent() {
    use kvwire::proto::wire::FrameType;
    use kvwire::testkit::{Fault, FaultRule};
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    pair.fault(FaultRule::on(
        TransferId(31),
        Fault::DuplicateFrame(FrameType::RESERVE),
    ));
    transfer(&mut pair, 31, 64);
    pair.drive();
    assert_eq!(
        pair.verified,
        vec![TransferId(31)],
        "{:?}",
        pair.receiver_failures
    );
    assert!(pair.sender_verified(TransferId(31)));
    assert_eq!(pair.sender.session().stats().rejected_reservations, 0);
    assert_invariants(&pair);
}

/// Regression (found by the interleavings proptest): writes posted after the receiver had
/// already fenced the transfer were held forever by the loopback link, so the sender never
/// finished draining and leaked its source pages. A write to a fenced scope must be refused
/// at once, and the sender must end with every source page back.
#[test]
fn writes_posted_after_the_fence_are_refused_and_the_sender_drains() {
    use kvwire::proto::wire::FrameType;
    use kvwire::testkit::{Fault, FaultRule};
    use std::time::Duration;
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    pair.fault(FaultRule::on(TransferId(41), Fault::LateWrites));
    // The RESERVE arrives after the receiver's 2 s commit deadline: it has fenced already.
    pair.fault(FaultRule::on(
        TransferId(41),
        Fault::DelayFrame(FrameType::RESERVE, Duration::from_millis(2001)),
    ));
    transfer(&mut pair, 41, 16);
    pair.drive();
    assert!(pair.verified.is_empty());
    assert!(pair.wire_stats().writes_refused > 0);
    assert!(pair.sender_failure(TransferId(41)).is_some());
    assert_invariants(&pair);
}

/// Regression (SPEC Q3): the receiver verified and delivered, but its VERIFIED was lost; the
/// sender timed out, sent ABORT and reported a failure for KV the decode side was using. The
/// receiver now answers an ABORT for a transfer it verified with VERIFIED again, and the
/// sender, which holds its failure report until the abort resolves, reports Verified.
#[test]
fn a_lost_verified_ends_verified_on_both_sides() {
    use kvwire::proto::wire::FrameType;
    use kvwire::testkit::{Fault, FaultRule};
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    pair.fault(FaultRule::on(
        TransferId(51),
        Fault::DropFrame(FrameType::VERIFIED),
    ));
    transfer(&mut pair, 51, 64);
    pair.drive();
    assert_eq!(pair.verified, vec![TransferId(51)]);
    assert!(
        pair.sender_verified(TransferId(51)),
        "sender disagrees: {:?}",
        pair.sender_events
    );
    assert!(
        pair.sender_failure(TransferId(51)).is_none(),
        "sender also reported a failure: {:?}",
        pair.sender_events
    );
    assert_invariants(&pair);
}

/// A failed transfer's pages come back only after its fence: while the (slow) fence is
/// pending the pages stay held (quarantined) and no failure is reported; the failure is
/// reported once the fence completed and the pages are free again.
#[test]
fn a_failed_transfers_pages_come_back_only_after_its_fence() {
    use kvwire::proto::wire::ErrorCode;
    use kvwire::testkit::{Fault, FaultRule};
    use std::time::Duration;
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    pair.fault(FaultRule::on(
        TransferId(4),
        Fault::SlowFence(Duration::from_millis(300)),
    ));
    let t = common::reserve(&mut pair, 4, 64);
    let pages: Vec<u32> = pair
        .receiver
        .pool()
        .held_pages()
        .iter()
        .map(|p| p.0)
        .collect();
    assert_eq!(pages.len(), 4);
    let now = pair.now;
    assert!(pair
        .receiver
        .abort(now, TransferId(4), ErrorCode::CANCELLED));
    let aborted_at = pair.now;
    // Step through the fence: every step before the failure is reported, the pages are
    // still held; the step that reports it finds them free.
    let mut order = Vec::new();
    while pair.receiver_failure(TransferId(4)).is_none() {
        let held = pages
            .iter()
            .all(|&p| !pair.receiver.pool().holders(p).is_empty());
        order.push(held);
        assert!(pair.step(), "the transfer never ended");
    }
    assert!(
        order.iter().all(|&h| h),
        "a page came back before the failure was reported"
    );
    assert!(
        pair.now >= aborted_at + Duration::from_millis(300),
        "the failure was reported before the fence completed"
    );
    for &p in &pages {
        assert!(
            pair.receiver.pool().holders(p).is_empty(),
            "page {p} still held"
        );
    }
    assert_eq!(
        pair.receiver.pool().free_pages(),
        pair.receiver.pool().capacity_pages()
    );
    let _ = t;
    pair.drive();
    assert_invariants(&pair);
}

/// A loopback sender that reports, as TCP's does, that its writes leave the source pages in
/// cache: the sender driver then digests each page after its write completed.
struct CachedWrites(kvwire::transport::loopback::LoopbackSender);

impl kvwire::transport::Transport for CachedWrites {
    fn send_frame(&mut self, now: std::time::Instant, frame: &kvwire::proto::wire::Frame) {
        self.0.send_frame(now, frame);
    }
    fn poll_event(
        &mut self,
        cx: &mut std::task::Context<'_>,
        now: std::time::Instant,
    ) -> std::task::Poll<kvwire::transport::TransportEvent> {
        self.0.poll_event(cx, now)
    }
    fn close(&mut self, now: std::time::Instant) {
        self.0.close(now);
    }
    fn poll_timeout(&self) -> Option<std::time::Instant> {
        self.0.poll_timeout()
    }
}

impl kvwire::transport::SenderTransport for CachedWrites {
    fn write_credit(&self) -> usize {
        self.0.write_credit()
    }
    fn post_writes(
        &mut self,
        now: std::time::Instant,
        transfer: kvwire::TransferRef,
        access: &std::sync::Arc<[u8]>,
        writes: &[kvwire::proto::sender::PageWrite],
    ) {
        self.0.post_writes(now, transfer, access, writes);
    }
    fn digests_after_writes(&self) -> bool {
        true
    }
}

/// Over a transport whose writes leave the source in cache, the sender digests a page only
/// once its write is done, never before (at every step of the run, the pages digested after
/// their writes never outnumber the writes done), and a chunk smaller than
/// `DIGEST_AFTER_WRITE_MIN_BYTES` right before its writes; every transfer verifies.
#[test]
fn the_sender_digests_a_page_only_after_its_write_when_writes_leave_it_in_cache() {
    use kvwire::transport::loopback;
    let mut config = PairConfig::small();
    config.sender_pool.buffer_page_bytes = vec![64 << 10, 64 << 10];
    config.receiver_pool = config.sender_pool.clone();
    let (s_pool, r_pool) = config.pools().unwrap();
    let (s, r) = loopback::connect(s_pool.clone(), r_pool.clone(), config.latency);
    let mut pair = Pair::with_transports(
        &config,
        std::time::Instant::now(),
        (s_pool, CachedWrites(s)),
        (r_pool, r),
    )
    .unwrap();
    pair.sender.set_digest_while_sending(true);
    // 160 tokens: 10 pages of 2 x 64 KiB (1.25 MiB), four writes in flight at most.
    transfer(&mut pair, 1, 160);
    let mut saw_posted_undigested = false;
    while pair.step() {
        let st = pair.sender.stats();
        assert!(
            st.pages_digested_after_write <= st.writes_completed,
            "a page digested before its write was done: {st:?}"
        );
        saw_posted_undigested |= st.writes_posted > st.pages_digested_after_write;
    }
    assert!(
        saw_posted_undigested,
        "the writes never ran ahead of the digest"
    );
    assert_eq!(pair.sender.stats().pages_digested_after_write, 10);
    // 16 tokens: one page, 128 KiB, digested before its write.
    transfer(&mut pair, 2, 16);
    pair.drive();
    assert_eq!(pair.sender.stats().pages_digested_after_write, 10);
    assert_eq!(pair.verified, vec![TransferId(1), TransferId(2)]);
    assert_invariants(&pair);
}

/// Regression: a second reservation for an id that is already open was refused
/// (DuplicateTransfer) only after the transport had opened a new access scope for it, which
/// replaced the open transfer's scope: the sender's writes then fell outside every scope and
/// the open transfer failed. The duplicate is now refused before any page is leased or any
/// scope opened, and the open transfer verifies.
#[test]
fn a_duplicate_reservation_is_refused_without_touching_the_open_one() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    let free = pair.receiver.pool().free_pages();
    common::reserve(&mut pair, 5, 64);
    let now = pair.now;
    let dup = pair.receiver.reserve(
        now,
        kvwire::ReserveParams::new(TransferId(5), 64, std::time::Duration::from_secs(30)),
    );
    assert!(
        matches!(
            dup,
            Err(kvwire::ReceiveError::Reserve(
                kvwire::proto::receiver::ReserveError::DuplicateTransfer(TransferId(5))
            ))
        ),
        "{dup:?}"
    );
    // Only the first reservation's pages are out.
    assert_eq!(pair.receiver.pool().free_pages(), free - 4);
    common::send(&mut pair, 5, 64).unwrap();
    pair.drive();
    assert_eq!(
        pair.verified,
        vec![TransferId(5)],
        "receiver failures: {:?}, sender: {:?}",
        pair.receiver_failures,
        pair.sender_failure(TransferId(5))
    );
    assert_invariants(&pair);
}
