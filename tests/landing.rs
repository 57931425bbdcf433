//! Digests taken as pages land (SPEC §6, digests at landing): on transports that report landings the receiver
//! digests each page right after its bytes were written and verifies from those digests once
//! the fence closed the scope, without reading the transfer again; what it verifies is what
//! landed, exactly as the pass after the fence would see it.

mod common;

use common::{assert_invariants, transfer};
use kvwire::proto::FailureReason;
use kvwire::testkit::{Fault, FaultRule, Pair, PairConfig};
use kvwire::TransferId;

#[test]
fn a_clean_transfer_verifies_from_its_landing_digests() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    for id in 1..=4 {
        transfer(&mut pair, id, 160);
    }
    pair.drive();
    let mut v = pair.verified.clone();
    v.sort_unstable();
    assert_eq!(
        v,
        (1..=4).map(TransferId).collect::<Vec<_>>(),
        "{:?}",
        pair.receiver_failures
    );
    assert_eq!(pair.receiver.stats().verified_from_landing, 4);
    assert_invariants(&pair);
}

/// Bytes altered as they land are in the landing digest: the transfer fails on the digest,
/// naming the page, decided from the landing digests.
#[test]
fn bytes_altered_at_landing_fail_from_the_landing_digests() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    pair.fault(FaultRule::on(
        TransferId(5),
        Fault::CorruptByte {
            ordinal: 2,
            buffer: 1,
            offset: 100,
        },
    ));
    transfer(&mut pair, 5, 160);
    pair.drive();
    assert!(pair.verified.is_empty());
    assert_eq!(
        pair.receiver_failure(TransferId(5)),
        Some(&FailureReason::DigestMismatch {
            buffer: 1,
            page: Some(2)
        })
    );
    assert_eq!(pair.receiver.stats().verified_from_landing, 1);
    assert_invariants(&pair);
}

/// A page that lands twice is digested twice; the last landing is what the memory holds.
#[test]
fn a_page_landing_twice_verifies_from_its_last_landing() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    pair.fault(FaultRule::on(
        TransferId(6),
        Fault::DuplicateWrite { ordinal: 1 },
    ));
    transfer(&mut pair, 6, 160);
    pair.drive();
    assert_eq!(
        pair.verified,
        vec![TransferId(6)],
        "{:?}",
        pair.receiver_failures
    );
    assert_eq!(pair.receiver.stats().verified_from_landing, 1);
    assert_invariants(&pair);
}

/// What the two modes differ in (SPEC §6, digests at landing): a write into a leased page by something other
/// than the transport, after the page landed and before the COMMIT (an engine bug writing
/// into pages it lent to kvwire). Digesting after the fence reads the memory again and
/// catches it; digests at landing vouch for what landed, and do not.
#[test]
fn only_the_pass_after_the_fence_sees_a_local_write_after_landing() {
    for at_landing in [true, false] {
        let mut pair = Pair::new(PairConfig::small()).unwrap();
        pair.receiver.set_digest_at_landing(at_landing);
        // 160 tokens of 16 per page: 10 pages. Hold the COMMIT back until every page landed.
        transfer(&mut pair, 8, 160);
        assert!(
            pair.drive_until(|p| p.receiver.stats().pages_landed == 10),
            "the pages never landed"
        );
        assert!(pair.verified.is_empty(), "verified before the test wrote");
        let page = pair.receiver.pool().held_pages()[0].0;
        {
            let mut bytes = pair
                .receiver
                .pool()
                .raw_page_mut(page, 0)
                .expect("page bytes");
            bytes[0] ^= 0xff;
        }
        pair.drive();
        if at_landing {
            assert_eq!(
                pair.verified,
                vec![TransferId(8)],
                "{:?}",
                pair.receiver_failures
            );
            assert_eq!(pair.receiver.stats().verified_from_landing, 1);
            // Delivered with the engine's own write in it: the harness sees bytes other than
            // the sender's (what this mode gives up), and nothing else is wrong.
            assert_eq!(pair.wrong_content, vec![TransferId(8)]);
            pair.wrong_content.clear();
        } else {
            assert!(pair.verified.is_empty());
            assert!(
                matches!(
                    pair.receiver_failure(TransferId(8)),
                    Some(FailureReason::DigestMismatch { buffer: 0, .. })
                ),
                "{:?}",
                pair.receiver_failures
            );
            assert_eq!(pair.receiver.stats().verified_from_landing, 0);
        }
        assert_invariants(&pair);
    }
}
