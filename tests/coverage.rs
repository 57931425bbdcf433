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

/// SPEC §5.3.1 #7 and §9.1: a TCP sender that knows the receiver's page count (its transport
/// parameters) refuses a reservation naming a page beyond it with BAD_RESERVATION, before
/// any byte is written; the receiver fails the reservation with that code.
#[tokio::test(flavor = "current_thread")]
async fn over_tcp_a_reservation_beyond_the_advertised_pages_is_refused() {
    use kvwire::proto::auth::AuthChannel;
    use kvwire::proto::wire::ErrorCode;
    use kvwire::transport::tcp::{TcpReceiver, TcpSender};
    let cfg = PairConfig::small();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (a, b) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    let (a, b) = (a.unwrap(), b.unwrap().0);
    let (s_pool, r_pool) = cfg.pools().unwrap();
    let (sealer, opener) = AuthChannel::off().split();
    // As if the receiver had advertised a single page.
    let s = TcpSender::new(a, sealer, opener, s_pool.clone()).with_destination_pages(1);
    let (sealer, opener) = AuthChannel::off().split();
    let r = TcpReceiver::new(b, sealer, opener, r_pool.clone());
    let mut pair =
        Pair::with_transports(&cfg, std::time::Instant::now(), (s_pool, s), (r_pool, r)).unwrap();
    let tokens = 2 * cfg.receiver_pool.tokens_per_page;
    common::transfer(&mut pair, 1, tokens);
    assert!(pair.drive_live(std::time::Duration::from_secs(30)).await);
    assert!(pair.verified.is_empty());
    match pair.receiver_failure(TransferId(1)) {
        Some(FailureReason::Rejected { code, detail }) => {
            assert_eq!(*code, ErrorCode::BAD_RESERVATION);
            assert!(detail.contains("beyond"), "{detail}");
        }
        other => panic!("not refused: {other:?}"),
    }
    assert_invariants(&pair);
}
