//! A listener no bad client can stop: port scans, HTTP requests, peers with the wrong key
//! and clients that connect and stall, before and between real senders; every real sender
//! is served.

use std::time::Duration;

use kvwire::proto::admission::Request;
use kvwire::{
    Auth, Listener, ListenerConfig, Node, NodeConfig, ReserveParams, SenderConn, TransferId,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn config() -> NodeConfig {
    let mut c = NodeConfig::example();
    // A stalled client holds a handshake slot this long.
    c.handshake_timeout = Duration::from_millis(500);
    c
}

/// One real prefill node: connects, sends transfer `id`, and returns once it is verified.
async fn real_sender(addr: std::net::SocketAddr, config: &NodeConfig, id: u64) -> SenderConn {
    let node = Node::new(config.clone()).unwrap();
    let s = SenderConn::connect(addr, &node).await.unwrap();
    let a = s
        .admit(Request {
            transfer_id: TransferId(id),
            tokens: 64,
        })
        .unwrap();
    // Sent in the background: the decode side reserves after accepting.
    let s2 = s.clone();
    tokio::spawn(async move { s2.send(a, |_, _, p| p.fill(7)).await });
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_serves_every_real_sender_whatever_else_connects() {
    let config = config();
    let metrics = kvwire::metrics::Metrics::new();
    let mut decode_config = config.clone();
    decode_config.metrics = Some(metrics.clone());
    let decode = Node::new(decode_config).unwrap();
    let mut listener = Listener::receivers("127.0.0.1:0", &decode, ListenerConfig::default())
        .await
        .unwrap();
    let addr = listener.local_addr();
    let mut wrong_key = config.clone();
    wrong_key.auth = Auth::ephemeral();

    // A client that connects and says nothing, held open for the whole test.
    let stalled = TcpStream::connect(addr).await.unwrap();
    let mut served = Vec::new();
    for round in 0..3u64 {
        // A port scan: connect, close.
        drop(TcpStream::connect(addr).await.unwrap());
        // An HTTP health check.
        let mut http = TcpStream::connect(addr).await.unwrap();
        http.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), http.read_to_end(&mut sink)).await;
        // A peer with the wrong key.
        let bad = SenderConn::connect(addr, &Node::new(wrong_key.clone()).unwrap()).await;
        assert!(bad.is_err(), "a wrong key was accepted");
        // A real sender, served in between.
        let sender = real_sender(addr, &config, round + 1).await;
        let r = tokio::time::timeout(Duration::from_secs(10), listener.accept())
            .await
            .expect("the real sender was not served")
            .expect("the listener stopped");
        let kv = r
            .reserve(ReserveParams::new(
                TransferId(round + 1),
                64,
                Duration::from_secs(10),
            ))
            .await
            .unwrap();
        assert!(kv.page(0, 0).unwrap().iter().all(|&b| b == 7));
        kv.release().unwrap();
        served.push((sender, r));
    }
    // Only the real senders were handed out, and every bad client was counted.
    let st = listener.stats();
    assert_eq!(st.established, 3, "{st:?}");
    assert!(st.refused >= 3, "wrong keys: {st:?}");
    assert!(st.malformed >= 3, "HTTP requests: {st:?}");
    assert!(st.failed >= 3, "port scans: {st:?}");
    // The stalled client times out of its slot (its handshake deadline) without holding up
    // anyone: awaited, not slept on.
    for _ in 0..3000 {
        if listener.stats().failed >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(listener.stats().failed >= 4, "{:?}", listener.stats());
    drop(stalled);
    assert!(decode.pool().held_pages().is_empty());
    let text = metrics.encode();
    for want in [
        r#"kvwire_handshakes_total{outcome="established"} 3"#,
        r#"kvwire_handshakes_total{outcome="refused"}"#,
        r#"kvwire_handshakes_total{outcome="malformed"}"#,
        r#"kvwire_handshakes_total{outcome="failed"}"#,
    ] {
        assert!(text.contains(want), "missing {want}: {text}");
    }
}

/// Handshakes run concurrently: with every slot but one held by stalled clients, a real
/// sender is served while they still stall; with every slot held, it waits in the backlog
/// and is served as soon as a stalled handshake times out and frees its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_clients_cannot_hold_the_accept_loop() {
    let mut config = config();
    config.handshake_timeout = Duration::from_secs(2);
    let decode = Node::new(config.clone()).unwrap();
    let mut lc = ListenerConfig::default();
    lc.max_handshakes = 4;
    let mut listener = Listener::receivers("127.0.0.1:0", &decode, lc)
        .await
        .unwrap();
    let addr = listener.local_addr();
    // Real senders wait longer than the listener's stalled handshakes take to time out.
    let mut patient = config.clone();
    patient.handshake_timeout = Duration::from_secs(20);
    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(TcpStream::connect(addr).await.unwrap());
    }
    let _sender = real_sender(addr, &patient, 1).await;
    let r = listener.accept().await.unwrap();
    assert_eq!(
        listener.stats().failed,
        0,
        "served only after the stalled handshakes gave up"
    );
    drop(r);
    for _ in 0..4 {
        stalled.push(TcpStream::connect(addr).await.unwrap());
    }
    let _second = real_sender(addr, &patient, 2).await;
    let r = tokio::time::timeout(Duration::from_secs(15), listener.accept())
        .await
        .expect("never served after the slots freed");
    assert!(r.is_some());
    assert!(listener.stats().failed >= 1, "{:?}", listener.stats());
}

/// SPEC §4.6: a client that connects and says nothing is told why it is dropped: at the
/// handshake deadline the listener sends HELLO_REJECT(HANDSHAKE_TIMEOUT), then closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_client_is_sent_hello_reject_handshake_timeout() {
    use kvwire::proto::wire::{ErrorCode, Frame};
    let decode = Node::new(config()).unwrap();
    let _listener = Listener::receivers("127.0.0.1:0", &decode, ListenerConfig::default())
        .await
        .unwrap();
    let mut stalled = TcpStream::connect(_listener.local_addr()).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stalled.read_to_end(&mut got))
        .await
        .expect("the listener never closed the stalled connection")
        .unwrap();
    match Frame::decode(&got) {
        Ok((Frame::HelloReject(r), _)) => {
            assert_eq!(r.code, ErrorCode::HANDSHAKE_TIMEOUT);
            assert!(r.detail.contains("HELLO"), "{}", r.detail);
            // The node's timeout, not what was left of it when the handshake began.
            let ms = config().handshake_timeout.as_millis();
            assert!(r.detail.contains(&format!("of {ms} ms")), "{}", r.detail);
        }
        other => panic!("expected HELLO_REJECT(HANDSHAKE_TIMEOUT), got {other:?} from {got:02x?}"),
    }
}
