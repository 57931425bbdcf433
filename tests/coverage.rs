//! Coverage (SPEC §6): a COMMIT for a page that received no bytes never verifies, not even
//! when its digests match the page's stale contents (the same KV re-sent into the same
//! pages). TCP and loopback see every landed record: PAGES_MISSING names the page. (RDMA:
//! the scrub pattern, tests/rdma.rs.)

mod common;

use common::{assert_invariants, stale_resend_step, tcp_pair};
use kvwire::proto::FailureReason;
use kvwire::testkit::{Pair, PairConfig};
use kvwire::TransferId;

#[test]
fn over_loopback_a_page_that_got_no_bytes_fails_even_when_stale_contents_match() {
    let mut pair = Pair::new(PairConfig::small()).unwrap();
    for id in [1, 2] {
        stale_resend_step(&mut pair, id);
        pair.drive();
    }
    assert_eq!(
        pair.verified,
        vec![TransferId(1)],
        "{:?}",
        pair.receiver_failures
    );
    assert_eq!(
        pair.receiver_failure(TransferId(2)),
        Some(&FailureReason::PagesMissing { first_missing: 1 })
    );
    assert_invariants(&pair);
}

#[tokio::test(flavor = "current_thread")]
async fn over_tcp_a_page_that_got_no_bytes_fails_even_when_stale_contents_match() {
    let mut pair = tcp_pair(&PairConfig::small()).await;
    for id in [1, 2] {
        pair.now = std::time::Instant::now();
        stale_resend_step(&mut pair, id);
        assert!(pair.drive_live(std::time::Duration::from_secs(30)).await);
    }
    assert_eq!(
        pair.verified,
        vec![TransferId(1)],
        "{:?}",
        pair.receiver_failures
    );
    assert_eq!(
        pair.receiver_failure(TransferId(2)),
        Some(&FailureReason::PagesMissing { first_missing: 1 })
    );
    assert_invariants(&pair);
}
