//! Connections over several TCP streams (SPEC §9.1, several streams; `NodeConfig::tcp_streams`):
//! transfers verify with the sender's bytes over every stream; a listener serves such
//! connections and counts the streams that joined; mismatched stream counts and stray join
//! records are refused without stopping the listener; losing one stream fails the whole
//! connection safely, with both pools back to full.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvwire::proto::admission::Request;
use kvwire::proto::wire::ErrorCode;
use kvwire::receiver::ReserveParams;
use kvwire::testkit::{first_pattern_mismatch, kv_pattern};
use kvwire::transport::tcp::JoinRecord;
use kvwire::TransferId;
use kvwire::{EngineError, Listener, ListenerConfig, Node, NodeConfig, ReceiverConn, SenderConn};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn config(streams: u16) -> NodeConfig {
    let mut c = NodeConfig::example();
    c.tcp_streams = streams;
    c.handshake_timeout = Duration::from_secs(5);
    c
}

fn params(id: u64, tokens: u32) -> ReserveParams {
    ReserveParams::new(TransferId(id), tokens, Duration::from_secs(10)).with_page_digests()
}

/// Sends transfer `id` of `tokens` tokens (the test pattern) and checks that the receiver
/// delivers exactly those bytes.
async fn transfer(s: &SenderConn, r: &ReceiverConn, id: u64, tokens: u32) {
    let verified = r.reserve(params(id, tokens));
    let admitted = s
        .admit(Request {
            transfer_id: TransferId(id),
            tokens: u64::from(tokens),
        })
        .unwrap();
    s.send(admitted, move |o, b, p| kv_pattern(TransferId(id), o, b, p))
        .await
        .unwrap();
    let kv = verified.await.unwrap();
    assert_eq!(
        first_pattern_mismatch(&kv, TransferId(id)),
        None,
        "transfer {id}: (ordinal, buffer) differs from the sender's"
    );
    kv.release().unwrap();
}

/// A connection from `prefill` to `decode` (accepted on a fresh listener, the prefill the
/// client): both ends' results.
async fn connect(
    prefill: &Node,
    decode: &Node,
) -> (
    Result<SenderConn, EngineError>,
    Result<ReceiverConn, EngineError>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let d = decode.clone();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &d).await });
    let s = SenderConn::connect(addr, prefill).await;
    (s, accept.await.unwrap())
}

/// Two nodes of `c` and a connection between them.
async fn pair(c: &NodeConfig) -> (SenderConn, ReceiverConn) {
    let (prefill, decode) = (Node::new(c.clone()).unwrap(), Node::new(c.clone()).unwrap());
    let (s, r) = connect(&prefill, &decode).await;
    (s.unwrap(), r.unwrap())
}

/// Waits (up to 10 s: a loaded CI host can be slow) until both pools are full again.
async fn pools_full(s: &SenderConn, r: &ReceiverConn) {
    for _ in 0..2000 {
        let (ss, rs) = (s.stats().await.unwrap(), r.stats().await.unwrap());
        if ss.pages_free == ss.pages_total && rs.pages_free == rs.pages_total {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!(
        "pages leaked: {:?} {:?}",
        s.stats().await.unwrap(),
        r.stats().await.unwrap()
    );
}

/// 24 concurrent transfers over a connection of four streams: every one verifies with the
/// sender's bytes (the receiver spreads them over the streams round robin).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_over_four_streams_verify_with_the_senders_bytes() {
    let (s, r) = pair(&config(4)).await;
    let mut tasks = Vec::new();
    for id in 1..=24u64 {
        let (s, r) = (s.clone(), r.clone());
        tasks.push(tokio::spawn(async move {
            transfer(&s, &r, id, 40 + id as u32 * 7).await;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(r.stats().await.unwrap().verified, 24);
    assert_eq!(s.stats().await.unwrap().verified, 24);
    pools_full(&s, &r).await;
}

/// Every stream carries its share of the transfers, not lane 0 alone: 24 transfers over four
/// streams through a proxy that counts each stream's bytes as it forwards them; once every
/// transfer verified (so every byte the sender wrote for it went through the proxy), each
/// stream carried at least an eighth of the bytes from the sender (round robin gives each a
/// quarter). The counts are read while the streams are open: how a stream ends (a clean close
/// or a reset when the other end closes with bytes unread) does not matter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stream_carries_its_share_of_the_transfers() {
    let c = config(4);
    let (s, r, counter) = through_proxy(&c).await;
    for id in 1..=24u64 {
        transfer(&s, &r, id, 96).await;
    }
    assert_eq!(r.stats().await.unwrap().verified, 24);
    let bytes: Vec<usize> = (0..4)
        .map(|i| counter.forwarded[i].load(Ordering::SeqCst))
        .collect();
    let total: usize = bytes.iter().sum();
    assert!(
        total > 0 && bytes.iter().all(|&b| b * 8 >= total),
        "bytes from the sender per stream: {bytes:?}"
    );
}

/// A prefill node's listener serves connections of three streams from two decode nodes (the
/// decode side the client this time): both carry verified transfers, and the listener counts
/// the four streams that joined beside the two connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_serves_multi_stream_connections_and_counts_the_joined_streams() {
    let c = config(3);
    let prefill = Node::new(c.clone()).unwrap();
    let mut listener = Listener::senders("127.0.0.1:0", &prefill, ListenerConfig::default())
        .await
        .unwrap();
    let addr = listener.local_addr();
    let decodes = [Node::new(c.clone()).unwrap(), Node::new(c).unwrap()];
    // One after the other, so the listener hands out their connections in the same order.
    let r1 = ReceiverConn::connect(addr, &decodes[0]).await.unwrap();
    let s1 = listener.accept().await.unwrap();
    let r2 = ReceiverConn::connect(addr, &decodes[1]).await.unwrap();
    let s2 = listener.accept().await.unwrap();
    for (k, (s, r)) in [(&s1, &r1), (&s2, &r2)].into_iter().enumerate() {
        for id in 0..3 {
            transfer(s, r, 100 * k as u64 + id, 64).await;
        }
    }
    let stats = listener.stats();
    assert_eq!((stats.established, stats.joined), (2, 4), "{stats:?}");
}

/// Both ends must run the same number of streams: a mismatch is refused in the handshake
/// (SPEC §4.3 #7), HELLO_REJECT(TRANSPORT_MISMATCH) naming both counts, so that each end
/// learns why, the one that refused and the one refused; no transfer starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_stream_counts_are_refused_at_both_ends() {
    for (prefill_streams, decode_streams) in [(2u16, 1u16), (1, 3), (2, 4)] {
        let mut pc = config(prefill_streams);
        let mut dc = pc.clone();
        dc.tcp_streams = decode_streams;
        pc.tcp_streams = prefill_streams;
        let (prefill, decode) = (Node::new(pc).unwrap(), Node::new(dc).unwrap());
        let (s, r) = connect(&prefill, &decode).await;
        let mut refused = 0;
        for (side, e) in [("sender", s.err()), ("receiver", r.err())] {
            use kvwire::proto::handshake::HandshakeError;
            let reject = match e {
                Some(EngineError::Handshake(HandshakeError::Refused(r))) => {
                    refused += 1;
                    r
                }
                Some(EngineError::Handshake(HandshakeError::RefusedByPeer(r))) => r,
                other => panic!(
                    "{prefill_streams}/{decode_streams}: the {side} was not refused: {other:?}"
                ),
            };
            assert_eq!(reject.code, ErrorCode::TRANSPORT_MISMATCH, "{side}");
            let (mine, theirs) = if side == "sender" {
                (prefill_streams, decode_streams)
            } else {
                (decode_streams, prefill_streams)
            };
            assert!(
                reject.detail.contains(&mine.to_string())
                    && reject.detail.contains(&theirs.to_string()),
                "{side}: {}",
                reject.detail
            );
        }
        assert_eq!(refused, 1, "one end refused, the other was told");
    }
}

/// Stray join records reach a listener: one naming no connection's token (held, then
/// dropped), one for lane 0 (malformed). The listener keeps serving: a real connection of two
/// streams is established and verifies afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stray_join_records_do_not_stop_the_listener() {
    let c = config(2);
    let decode = Node::new(c.clone()).unwrap();
    let mut listener = Listener::receivers("127.0.0.1:0", &decode, ListenerConfig::default())
        .await
        .unwrap();
    let addr = listener.local_addr();
    let mut unknown = TcpStream::connect(addr).await.unwrap();
    let j = JoinRecord {
        lane: 1,
        streams: 2,
        token: [0x5A; 16],
    };
    unknown.write_all(&j.encode()).await.unwrap();
    let mut bad = TcpStream::connect(addr).await.unwrap();
    let mut b = j.encode();
    b[4] = 0; // lane 0
    bad.write_all(&b).await.unwrap();
    // A join naming no connection is closed at once, not held for the handshake timeout
    // (5 s): the registry holds only the tokens of connections that sent their HELLO.
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(Duration::from_secs(2), unknown.read(&mut byte)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "the stray join was not closed at once: {closed:?}"
    );
    let prefill = Node::new(c).unwrap();
    let s = SenderConn::connect(addr, &prefill).await.unwrap();
    let r = listener.accept().await.unwrap();
    transfer(&s, &r, 7, 100).await;
    let stats = listener.stats();
    assert_eq!(stats.established, 1, "{stats:?}");
    assert_eq!(stats.joined, 1, "the real extra stream: {stats:?}");
    assert_eq!(stats.refused, 1, "the stray join: {stats:?}");
    assert_eq!(stats.malformed, 1, "the lane-0 join record: {stats:?}");
}

/// A connection of `c`'s streams from a prefill to a decode node through a [`proxy`] (the
/// prefill the client): both ends and the proxy's handle.
async fn through_proxy(c: &NodeConfig) -> (SenderConn, ReceiverConn, Arc<Cutter>) {
    let (prefill, decode) = (Node::new(c.clone()).unwrap(), Node::new(c.clone()).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (via, cutter) = proxy(listener.local_addr().unwrap()).await;
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode).await });
    let s = SenderConn::connect(via, &prefill).await.unwrap();
    let r = accept.await.unwrap().unwrap();
    (s, r, cutter)
}

/// Waits (up to 10 s: a loaded CI host can be slow) until both ends report the peer lost,
/// and checks they do.
async fn both_see_the_peer_lost(s: &SenderConn, r: &ReceiverConn) {
    for _ in 0..2000 {
        let (ss, rs) = (s.stats().await.unwrap(), r.stats().await.unwrap());
        if ss.peer_lost && rs.peer_lost {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(s.stats().await.unwrap().peer_lost && r.stats().await.unwrap().peer_lost);
}

/// A proxy that forwards every connection to `target` and can cut the `n`-th one (0-based)
/// alone (both its sockets dropped) or freeze it (nothing forwarded either way, both sockets
/// kept open: a black-holed flow), the other streams untouched.
async fn proxy(target: std::net::SocketAddr) -> (std::net::SocketAddr, Arc<Cutter>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cutter = Arc::new(Cutter {
        seen: AtomicUsize::new(0),
        cuts: (0..8).map(|_| tokio::sync::Notify::new()).collect(),
        freezes: (0..8).map(|_| tokio::sync::Notify::new()).collect(),
        forwarded: (0..8).map(|_| AtomicUsize::new(0)).collect(),
    });
    let c = cutter.clone();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let i = c.seen.fetch_add(1, Ordering::SeqCst);
            let c = c.clone();
            tokio::spawn(async move {
                let server = TcpStream::connect(target).await.unwrap();
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let up = async {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        match from_client.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if to_server.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                                c.forwarded[i].fetch_add(n, Ordering::SeqCst);
                            }
                        }
                    }
                    let _ = to_server.shutdown().await;
                };
                let down = async {
                    let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
                    let _ = to_client.shutdown().await;
                };
                tokio::select! {
                    _ = async { tokio::join!(up, down) } => {}
                    _ = c.cuts[i].notified() => {}
                    _ = c.freezes[i].notified() => {
                        // Both sockets stay open; nothing moves any more.
                        std::future::pending::<()>().await;
                    }
                }
            });
        }
    });
    (addr, cutter)
}

struct Cutter {
    seen: AtomicUsize,
    cuts: Vec<tokio::sync::Notify>,
    freezes: Vec<tokio::sync::Notify>,
    /// Bytes each stream has carried from client to server so far.
    forwarded: Vec<AtomicUsize>,
}

/// Losing one of a connection's streams (the third, cut at a proxy) is the loss of the
/// connection: transfers in flight fail (retryably, as peer loss), both ends see the peer
/// gone, and both pools come back to full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_one_stream_fails_the_connection_safely() {
    let c = config(3);
    let (s, r, cutter) = through_proxy(&c).await;
    assert_eq!(
        cutter.seen.load(Ordering::SeqCst),
        3,
        "three streams through the proxy"
    );
    // One transfer on each stream verifies first.
    for id in 1..=3 {
        transfer(&s, &r, id, 64).await;
    }
    // Reserved, admitted and waiting; then the third stream goes.
    let pending: Vec<_> = (10..16).map(|id| r.reserve(params(id, 64))).collect();
    cutter.cuts[2].notify_one();
    let mut failed = 0;
    for (k, v) in pending.into_iter().enumerate() {
        let id = 10 + k as u64;
        let sent = match s.admit(Request {
            transfer_id: TransferId(id),
            tokens: 64,
        }) {
            Ok(a) => s
                .send(a, move |o, b, p| kv_pattern(TransferId(id), o, b, p))
                .await
                .is_ok(),
            Err(_) => false,
        };
        let got = tokio::time::timeout(Duration::from_secs(10), v)
            .await
            .unwrap();
        if !sent || got.is_err() {
            failed += 1;
        }
        // A receiver's failure is the connection's loss: retryable, never a verdict on the
        // bytes (a digest mismatch would mean bytes of one stream landed under another's).
        if let Err(e) = &got {
            assert!(
                matches!(e, kvwire::TransferError::Failed(reason) if reason.is_retryable()),
                "transfer {id}: {e:?}"
            );
        }
        if let Ok(kv) = got {
            kv.release().unwrap();
        }
    }
    assert!(failed > 0, "no transfer failed after a stream was cut");
    both_see_the_peer_lost(&s, &r).await;
    pools_full(&s, &r).await;
}

/// One stream of a connection goes silent without closing (frozen at a proxy: a black-holed
/// flow) while the others carry heartbeats: each end finds it within about its liveness
/// timeout (SPEC §9.1, several streams; heartbeats on every lane) and fails the connection (as
/// unresponsive where it found it first), instead of waiting for each transfer's deadline;
/// both pools come back to full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_fails_the_connection_as_unresponsive() {
    use kvwire::proto::liveness::LivenessConfig;
    use kvwire::proto::FailureReason;
    use kvwire::TransferError;
    let mut c = config(3);
    c.liveness = LivenessConfig {
        interval: Duration::from_millis(50),
        timeout: Duration::from_millis(600),
    };
    let (s, r, cutter) = through_proxy(&c).await;
    for id in 1..=3 {
        transfer(&s, &r, id, 64).await;
    }
    // A transfer admitted and reserved with a long deadline, its data not sent: it waits on
    // the connection; then stream 1 freezes.
    let waiting = r.reserve(ReserveParams::new(
        TransferId(40),
        64,
        Duration::from_secs(60),
    ));
    let _admitted = s
        .admit(Request {
            transfer_id: TransferId(40),
            tokens: 64,
        })
        .unwrap();
    cutter.freezes[1].notify_one();
    // Found within about the liveness timeout (600 ms), long before the deadline (60 s).
    // Whichever end finds it first closes the connection: that end's transfers fail as
    // unresponsive, the other end's as the peer lost (it sees the streams end).
    let got = tokio::time::timeout(Duration::from_secs(3), waiting)
        .await
        .expect("the silent stream was not found: the reservation still waits");
    assert!(
        matches!(
            got,
            Err(TransferError::Failed(
                FailureReason::PeerUnresponsive | FailureReason::PeerLost
            ))
        ),
        "{got:?}"
    );
    both_see_the_peer_lost(&s, &r).await;
    pools_full(&s, &r).await;
}

/// Regression (found by `kvwire bench --tcp-streams 4`): a receiver that closes its
/// connection right after its last verdict ends every stream; the sender saw one stream's end
/// first and dropped the others, and with them a VERIFIED still unread on one of them (the
/// transfer failed on the sender, verified on the receiver). Every verdict sent before the
/// close must be read: thirty connections, each closed by the receiver at once after its last
/// transfer verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_closing_after_its_last_verdict_loses_no_verdict() {
    let c = config(4);
    for round in 0..30u64 {
        let (s, r) = pair(&c).await;
        let mut sends = Vec::new();
        let mut verdicts = Vec::new();
        for k in 0..8u64 {
            let id = round * 100 + k;
            verdicts.push(r.reserve(params(id, 48)));
            let s = s.clone();
            sends.push(tokio::spawn(async move {
                let a = s
                    .admit(Request {
                        transfer_id: TransferId(id),
                        tokens: 48,
                    })
                    .unwrap();
                s.send(a, move |o, b, p| kv_pattern(TransferId(id), o, b, p))
                    .await
            }));
        }
        for v in verdicts {
            v.await.unwrap().release().unwrap();
        }
        drop(r);
        for (k, t) in sends.into_iter().enumerate() {
            let got = tokio::time::timeout(Duration::from_secs(10), t)
                .await
                .unwrap()
                .unwrap();
            assert!(
                got.is_ok(),
                "round {round}: transfer {k} verified at the receiver but failed at the sender: {got:?}"
            );
        }
    }
}
