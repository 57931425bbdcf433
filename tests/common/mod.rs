//! Helpers shared by the integration tests: starting transfers on a Pair and checking the
//! safety invariants every scenario must keep.
#![allow(dead_code)]

use kvwire::TransferId;
use std::time::Duration;

use kvwire::proto::admission::{AdmissionError, Request};
use kvwire::proto::wire::TransferRef;
use kvwire::receiver::ReserveParams;
use kvwire::testkit::{kv_pattern, Pair};
use kvwire::transport::{ReceiverTransport, SenderTransport};

/// The receiver reserves for `tokens` (commit deadline 2 s).
pub fn reserve<S: SenderTransport, R: ReceiverTransport>(
    pair: &mut Pair<S, R>,
    id: impl Into<TransferId>,
    tokens: u32,
) -> TransferRef {
    let id: TransferId = id.into();
    try_reserve(pair, id, tokens).expect("reserve")
}

/// As [`reserve`], returning the refusal (e.g. after the connection was lost).
pub fn try_reserve<S: SenderTransport, R: ReceiverTransport>(
    pair: &mut Pair<S, R>,
    id: impl Into<TransferId>,
    tokens: u32,
) -> Result<TransferRef, kvwire::receiver::ReceiveError> {
    let id: TransferId = id.into();
    let now = pair.now;
    pair.receiver.reserve(
        now,
        ReserveParams::new(id, tokens, Duration::from_secs(2)).with_page_digests(),
    )
}

/// The sender admits `tokens` and, if admitted, fills and submits its pages.
pub fn send<S: SenderTransport, R: ReceiverTransport>(
    pair: &mut Pair<S, R>,
    id: impl Into<TransferId>,
    tokens: u64,
) -> Result<(), AdmissionError> {
    let id: TransferId = id.into();
    try_send(pair, id, tokens).map(|r| r.expect("submit"))
}

/// As [`send`], also returning a refused start (e.g. after the connection was lost).
pub fn try_send<S: SenderTransport, R: ReceiverTransport>(
    pair: &mut Pair<S, R>,
    id: impl Into<TransferId>,
    tokens: u64,
) -> Result<Result<(), kvwire::sender::StartError>, AdmissionError> {
    let id: TransferId = id.into();
    let now = pair.now;
    let admitted = pair.sender.admit(
        now,
        Request {
            transfer_id: id,
            tokens,
        },
    )?;
    Ok(pair
        .sender
        .submit(now, admitted, |ord, b, page| kv_pattern(id, ord, b, page)))
}

/// Both sides start transfer `id` of `tokens` tokens.
pub fn transfer<S: SenderTransport, R: ReceiverTransport>(
    pair: &mut Pair<S, R>,
    id: impl Into<TransferId>,
    tokens: u32,
) {
    let id: TransferId = id.into();
    send(pair, id, u64::from(tokens)).expect("admitted");
    reserve(pair, id, tokens);
}

/// The invariants every run must keep once it has settled:
/// 1. nothing unverified was delivered: every verified transfer holds exactly the sender's bytes;
/// 2. every page is back in its pool (for the sides that did not crash);
/// 3. no write landed in a page not leased to its transfer;
/// 4. no open transfers, no open access scopes, no release before fence.
pub fn assert_invariants<S: SenderTransport, R: ReceiverTransport>(pair: &Pair<S, R>) {
    assert!(
        pair.wrong_content.is_empty(),
        "verified transfers with wrong bytes: {:?}",
        pair.wrong_content
    );
    assert!(
        pair.illegal_landings().is_empty(),
        "writes landed in unleased pages: {:?}",
        pair.illegal_landings()
    );
    assert_eq!(
        pair.receiver.stats().release_before_fence,
        0,
        "a page was released before its fence"
    );
    if pair.crashed != Some(kvwire::testkit::Side::Receiver) {
        let pool = pair.receiver.pool();
        assert_eq!(
            pool.free_pages(),
            pool.capacity_pages(),
            "receiver pages leaked: {:?}",
            pool.stats()
        );
        assert_eq!(
            pair.receiver.session().open_transfers(),
            0,
            "receiver transfers still open"
        );
        assert_eq!(pair.open_scopes(), 0, "receiver access scopes still open");
    }
    if pair.crashed != Some(kvwire::testkit::Side::Sender) {
        let pool = pair.sender.pool();
        assert_eq!(
            pool.free_pages(),
            pool.capacity_pages(),
            "sender pages leaked: {:?}",
            pool.stats()
        );
        assert_eq!(
            pair.sender.session().open_transfers(),
            0,
            "sender transfers still open"
        );
    }
}

/// Both ends of a TCP connection on the loopback address over pools of `cfg`,
/// unauthenticated (faults are injected above the transport).
pub async fn tcp_pair(
    cfg: &kvwire::testkit::PairConfig,
) -> Pair<kvwire::transport::tcp::TcpSender, kvwire::transport::tcp::TcpReceiver> {
    use kvwire::proto::auth::AuthChannel;
    use kvwire::transport::tcp::{TcpReceiver, TcpSender};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (a, b) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    let (a, b) = (a.unwrap(), b.unwrap().0);
    a.set_nodelay(true).unwrap();
    b.set_nodelay(true).unwrap();
    let (s_pool, r_pool) = cfg.pools().unwrap();
    let (sealer, opener) = AuthChannel::off().split();
    let s = TcpSender::new(a, sealer, opener, s_pool.clone());
    let (sealer, opener) = AuthChannel::off().split();
    let r = TcpReceiver::new(b, sealer, opener, r_pool.clone());
    Pair::with_transports(cfg, std::time::Instant::now(), (s_pool, s), (r_pool, r)).unwrap()
}

/// Transfer 1 sends KV into `pages`; transfer 2 sends the very same KV into the very same
/// pages, with its write of ordinal 1 lost (reported complete): the page's stale contents
/// equal what the sender digested. Starts both (the caller drives between and after with
/// `drive` or `drive_live`, see [`stale_resend_step`]).
pub fn stale_resend_step<S: SenderTransport, R: ReceiverTransport>(pair: &mut Pair<S, R>, id: u64) {
    use kvwire::testkit::{Fault, FaultRule};
    let id = TransferId(id);
    let tpp = pair.receiver.pool().geometry().tokens_per_page;
    if id == TransferId(2) {
        pair.fault(FaultRule::on(id, Fault::DropWrite { ordinal: 1 }));
    }
    let now = pair.now;
    let params = ReserveParams::new(id, 4 * tpp, Duration::from_secs(30))
        .into_pages(vec![9, 3, 14, 6])
        .with_page_digests();
    pair.receiver.reserve(now, params).unwrap();
    let admitted = pair
        .sender
        .admit(
            now,
            Request {
                transfer_id: id,
                tokens: u64::from(4 * tpp),
            },
        )
        .unwrap();
    pair.sender
        .submit(now, admitted, |o, b, p| kv_pattern(TransferId(1), o, b, p))
        .unwrap();
}
