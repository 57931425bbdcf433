//! The Pair harness itself: clean transfers verify with the right bytes.

mod common;

use common::{assert_invariants, transfer};
use kvwire::harness::{Pair, PairConfig};

#[test]
fn one_transfer_verifies_with_the_senders_bytes() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    transfer(&mut pair, 7, 100);
    pair.drive();
    assert_eq!(pair.verified, vec![7]);
    assert!(pair.sender_verified(7));
    assert!(
        pair.receiver_failures.is_empty(),
        "{:?}",
        pair.receiver_failures
    );
    assert!(pair.link.stats.bytes_landed > 0);
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
    assert_eq!(v, (1..=12).collect::<Vec<_>>());
    assert_invariants(&pair);
}

#[test]
fn reservation_before_request_is_parked_then_served() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    common::reserve(&mut pair, 9, 33);
    // Deliver the RESERVE to a sender that has no such request yet (no timer may fire).
    while pair.link.next_due().is_some() {
        pair.step();
    }
    assert_eq!(pair.sender.session().open_transfers(), 0);
    common::send(&mut pair, 9, 33).unwrap();
    pair.drive();
    assert_eq!(
        pair.verified,
        vec![9],
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
    use kvwire::transport::loopback::{Fault, FaultRule};
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    pair.fault(FaultRule::on(31, Fault::DuplicateFrame(FrameType::RESERVE)));
    transfer(&mut pair, 31, 64);
    pair.drive();
    assert_eq!(pair.verified, vec![31], "{:?}", pair.receiver_failures);
    assert!(pair.sender_verified(31));
    assert_eq!(pair.sender.session().stats().rejected_reservations, 0);
    assert_invariants(&pair);
}
