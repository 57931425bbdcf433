//! The TCP transport and tokio drivers end to end on loopback: verified content, concurrency,
//! early rejection, peer loss and timeouts, with the pools back to full afterwards.

use kvwire::TransferId;
use std::time::Duration;

use kvwire::proto::admission::Request;
use kvwire::proto::wire::{DigestAlgorithm, ErrorCode};
use kvwire::proto::{FailureReason, Wait};
use kvwire::receiver::ReserveParams;
use kvwire::testkit::{first_pattern_mismatch, kv_pattern};
use kvwire::{Node, NodeConfig, ReceiverConn, SenderConn, TransferError};
use tokio::net::TcpListener;

async fn pair(config: &NodeConfig) -> (SenderConn, ReceiverConn) {
    let nodes = (
        Node::new(config.clone()).unwrap(),
        Node::new(config.clone()).unwrap(),
    );
    pair_of(&nodes).await
}

/// A connection from the prefill node `nodes.0` to the decode node `nodes.1`.
async fn pair_of(nodes: &(Node, Node)) -> (SenderConn, ReceiverConn) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let decode = nodes.1.clone();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode).await });
    let sender = SenderConn::connect(addr, &nodes.0).await.unwrap();
    (sender, accept.await.unwrap().unwrap())
}

fn params(id: u64, tokens: u32) -> ReserveParams {
    ReserveParams::new(TransferId(id), tokens, Duration::from_secs(5)).with_page_digests()
}

async fn send(s: &SenderConn, id: u64, tokens: u64) -> Result<(), TransferError> {
    let admitted = s.admit(Request {
        transfer_id: TransferId(id),
        tokens,
    })?;
    s.send(admitted, move |ord, b, page| {
        kv_pattern(TransferId(id), ord, b, page)
    })
    .await
}

/// Waits (up to 10 s: a loaded CI host can be slow; a passing run returns in milliseconds)
/// until the receiver's pool is full again (releases travel on channels).
async fn assert_receiver_pool_full(r: &ReceiverConn) {
    for _ in 0..2000 {
        let s = r.stats().await.unwrap();
        if s.pages_free == s.pages_total {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("receiver pages leaked: {:?}", r.stats().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfers_verify_with_the_senders_bytes() {
    let config = NodeConfig::example();
    let (s, r) = pair(&config).await;
    let mut tasks = Vec::new();
    for id in 1..=16u64 {
        let tokens = 50 + id as u32 * 20;
        let verified = r.reserve(params(id, tokens));
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            send(&s, id, u64::from(tokens)).await.unwrap();
            let kv = verified.await.unwrap();
            assert_eq!(
                first_pattern_mismatch(&kv, TransferId(id)),
                None,
                "transfer {id}: delivered bytes differ from the sender's"
            );
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(r.stats().await.unwrap().verified, 16);
    assert_eq!(s.stats().await.unwrap().verified, 16);
    assert_receiver_pool_full(&r).await;
    assert_eq!(
        s.stats().await.unwrap().pages_free,
        s.stats().await.unwrap().pages_total
    );
}

/// Over TCP the receiver verifies from the digests it took as each page landed (SPEC §6,
/// digests at landing); turned off, it reads every transfer's memory after the fence. Both
/// deliver the sender's bytes. Pages of small records are digested by the receiver as each
/// landing is reported; large ones (here 340 KiB per page, more than one digested read's
/// piece in a buffer) by the transport, piece by piece as each read lands, under each
/// transfer's algorithm, also over a connection of two TCP streams (the request reaches the
/// transfer's lane).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_verifies_from_digests_taken_at_landing_unless_turned_off() {
    for (at_landing, page_bytes, alg, streams) in [
        (true, vec![4096, 4096], DigestAlgorithm::XXH3_64, 1),
        (
            true,
            vec![40 * 1024, 300 * 1024],
            DigestAlgorithm::XXH3_64,
            1,
        ),
        (true, vec![40 * 1024, 300 * 1024], DigestAlgorithm::CRC32, 1),
        (
            true,
            vec![40 * 1024, 300 * 1024],
            DigestAlgorithm::XXH3_64,
            2,
        ),
        (
            false,
            vec![40 * 1024, 300 * 1024],
            DigestAlgorithm::XXH3_64,
            1,
        ),
    ] {
        let mut config = NodeConfig::example();
        // Digests of page bytes read off the stream (same-host pulls: tests/same_host.rs).
        config.same_host = kvwire::SameHost::Off;
        config.digest_at_landing = at_landing;
        config.pool.buffer_page_bytes = page_bytes.clone();
        config.pool.pages = 64;
        config.engine = kvwire::EngineConfig::new(1024);
        config.digests = vec![alg];
        config.tcp_streams = streams;
        let large = page_bytes.iter().sum::<u32>() > 16 * 1024;
        let (s, r) = pair(&config).await;
        for id in 1..=4u64 {
            let verified = r.reserve(params(id, 300));
            send(&s, id, 300).await.unwrap();
            let kv = verified.await.unwrap();
            assert_eq!(
                first_pattern_mismatch(&kv, TransferId(id)),
                None,
                "transfer {id}"
            );
        }
        let st = r.stats().await.unwrap();
        assert_eq!(st.verified, 4);
        assert_eq!(
            st.digests_at_landing,
            if at_landing { 4 } else { 0 },
            "{st:?}"
        );
        assert_eq!(st.pages_landed, 4 * 19, "{st:?}");
        assert_eq!(
            st.pages_digested_by_transport,
            if at_landing && large { 4 * 19 } else { 0 },
            "{page_bytes:?} {alg:?} over {streams} streams: {st:?}"
        );
        assert_receiver_pool_full(&r).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placeholder_is_rejected_at_admission_and_nothing_moves() {
    let mut config = NodeConfig::example();
    config.engine.max_context_tokens = 8192;
    config.engine.allow_undersized_pool = true; // sender pool: 256 pages x 16 = 4096 tokens
    let (s, r) = pair(&config).await;
    let verified = r.reserve(params(9, 4000));
    // 5000 tokens do not fit the prefill pool: rejected, never sent.
    match send(&s, 9, 5000).await {
        Err(TransferError::Rejected(e)) => assert_eq!(e.code(), ErrorCode::PROMPT_EXCEEDS_POOL),
        other => panic!("expected a rejection at admission, got {other:?}"),
    }
    match verified.await {
        Err(TransferError::Failed(FailureReason::Rejected { code, .. })) => {
            assert_eq!(code, ErrorCode::PROMPT_EXCEEDS_POOL)
        }
        other => panic!("receiver did not get the original error: {other:?}"),
    }
    assert_eq!(s.stats().await.unwrap().writes, 0);
    assert_eq!(r.stats().await.unwrap().bytes_landed, 0);
    assert_receiver_pool_full(&r).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_gone_mid_transfer_fails_safely_and_frees_pages() {
    let config = NodeConfig::example();
    let (s, r) = pair(&config).await;
    let verified = r.reserve(params(3, 2000));
    // The sender's engine disappears before sending anything.
    drop(s);
    match verified.await {
        Err(TransferError::Failed(FailureReason::PeerLost)) => {}
        other => panic!("expected PeerLost, got {other:?}"),
    }
    let st = r.stats().await.unwrap();
    assert!(st.peer_lost);
    assert_receiver_pool_full(&r).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_never_comes_times_out() {
    let config = NodeConfig::example();
    let (_s, r) = pair(&config).await;
    let mut p = params(4, 64);
    p.timeout = Duration::from_millis(200);
    match r.reserve(p).await {
        Err(TransferError::Failed(FailureReason::Timeout {
            waiting_for: Wait::Commit,
        })) => {}
        other => panic!("expected a commit timeout, got {other:?}"),
    }
    assert_receiver_pool_full(&r).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_mismatch_is_refused_at_connect() {
    let config = NodeConfig::example();
    let mut other = config.clone();
    other.pool.buffer_page_bytes = vec![4096, 8192];
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let decode = Node::new(config).unwrap();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode).await });
    let err = SenderConn::connect(addr, &Node::new(other).unwrap())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("LAYOUT_MISMATCH"), "{err}");
    assert!(accept.await.unwrap().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_transfers_and_are_served_as_prometheus_text() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let metrics = kvwire::metrics::Metrics::new();
    let mut config = NodeConfig::example();
    config.metrics = Some(metrics.clone());
    let (s, r) = pair(&config).await;
    let verified = r.reserve(params(1, 64));
    send(&s, 1, 64).await.unwrap();
    verified.await.unwrap().release().unwrap();
    // A failure is counted by its wire code.
    let mut p = params(2, 64);
    p.timeout = Duration::from_millis(50);
    assert!(r.reserve(p).await.is_err());
    assert_receiver_pool_full(&r).await;

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(kvwire::metrics::serve(listener, metrics));
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    conn.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    for want in [
        r#"kvwire_transfers_total{role="receiver",outcome="verified"} 1"#,
        r#"kvwire_transfers_total{role="sender",outcome="verified"} 1"#,
        r#"kvwire_transfers_total{role="receiver",outcome="TIMEOUT"} 1"#,
        "kvwire_fences_total 2",
    ] {
        assert!(body.contains(want), "missing {want}: {body}");
    }
    // Each connection, the sender's and the receiver's, publishes its failed lanes (none
    // over TCP), under a connection label of its own.
    let lanes: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("kvwire_failed_lanes{connection="))
        .collect();
    assert_eq!(lanes.len(), 2, "{body}");
    assert!(lanes.iter().all(|l| l.ends_with(" 0")), "{lanes:?}");
    assert_ne!(lanes[0].split(' ').next(), lanes[1].split(' ').next());
}

/// The decode engine registers its own KV memory; verified pages land in it, in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_land_in_memory_the_engine_registered() {
    use kvwire::memory::KvMemory;
    let config = NodeConfig::example();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // The engine's own buffers, handed over (pointer + length per buffer would be
    // KvMemory::from_raw_parts for memory Rust does not own).
    let buffers: Vec<Box<[u8]>> = (0..config.pool.buffers())
        .map(|b| vec![0xEE; config.pool.buffer_len(b).unwrap()].into_boxed_slice())
        .collect();
    let memory = KvMemory::from_buffers(&config.pool, buffers).unwrap();
    let decode = Node::with_memory(config.clone(), memory).unwrap();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode).await });
    let s = SenderConn::connect(addr, &Node::new(config.clone()).unwrap())
        .await
        .unwrap();
    let r = accept.await.unwrap().unwrap();
    let verified = r.reserve(params(5, 64));
    send(&s, 5, 64).await.unwrap();
    let kv = verified.await.unwrap();
    let first = kv.page(0, 1).unwrap().to_vec();
    let mut want = vec![0u8; first.len()];
    kv_pattern(TransferId(5), 0, 1, &mut want);
    assert_eq!(first, want);
    // A memory that does not match the configured geometry is refused at registration.
    let wrong = KvMemory::allocate(&kvwire::memory::PoolGeometry {
        pages: 8,
        ..config.pool.clone()
    })
    .unwrap();
    let err = Node::with_memory(config.clone(), wrong).unwrap_err();
    assert!(err.to_string().contains("geometry"), "{err}");
}

/// The registration states the served context length: a memory too small for it is
/// refused, naming both numbers (the incident's lesson holds for engine memory too).
#[test]
fn a_registration_smaller_than_the_context_is_refused_naming_both_numbers() {
    use kvwire::memory::KvMemory;
    let mut config = NodeConfig::example();
    config.engine.max_context_tokens = config.pool.capacity_tokens() + 1;
    let memory = KvMemory::allocate(&config.pool).unwrap();
    let err = Node::with_memory(config.clone(), memory).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains(&config.pool.capacity_tokens().to_string())
            && text.contains(&config.engine.max_context_tokens.to_string()),
        "{text}"
    );
    assert!(Node::new(config).is_err());
}

/// Transfers large enough to be digested on the blocking pool verify, and their pages come
/// back once the jobs are done. By default TCP digests a transfer this small (300 tokens, 19
/// pages of 8 KiB) on the connection's thread: none goes to the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloaded_digests_verify_and_release() {
    for offload in [Some(1), None] {
        let mut config = NodeConfig::example();
        config.digest_offload_bytes = offload; // Some(1): every job on the blocking pool
        let (s, r) = pair(&config).await;
        let mut tasks = Vec::new();
        for id in 1..=8u64 {
            let verified = r.reserve(params(id, 300));
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                send(&s, id, 300).await.unwrap();
                verified.await.unwrap().release().unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(r.stats().await.unwrap().verified, 8);
        // The sender digests every transfer (its COMMIT's digests); the receiver here
        // verifies from the digests it took at landing, which need no job.
        let st = s.stats().await.unwrap();
        if offload.is_some() {
            assert!(st.digest_jobs_offloaded >= 8, "{st:?}");
        } else {
            assert_eq!(st.digest_jobs_offloaded, 0, "{st:?}");
        }
        assert_receiver_pool_full(&r).await;
    }
}

/// The example node with 64 pages of two 64 KiB buffers (16 tokens each, 1024 in all).
fn pages_of_two_64k_buffers() -> NodeConfig {
    let mut config = NodeConfig::example();
    // Page bytes on the stream (the sender's digests around its writes of them).
    config.same_host = kvwire::SameHost::Off;
    config.pool.buffer_page_bytes = vec![64 << 10, 64 << 10];
    config.pool.pages = 64;
    config.engine = kvwire::config::EngineConfig::new(1024);
    config
}

/// Over TCP the sender digests a transfer of at least `DIGEST_AFTER_WRITE_MIN_BYTES` page by
/// page right after the kernel copied it into the socket (from cache), a smaller one right
/// before its writes are posted (so its COMMIT can leave with its last record); both verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sender_digests_large_transfers_after_their_writes_and_small_ones_before() {
    let config = pages_of_two_64k_buffers();
    let page = config.pool.bytes_per_page_index();
    let (s, r) = pair(&config).await;
    // 160 tokens: 10 pages of 2 x 64 KiB, 1.25 MiB; then 16 tokens: one page, 128 KiB.
    for (id, tokens, pages) in [(1u64, 160, 10u64), (2, 16, 1)] {
        assert_eq!(
            pages * page >= kvwire::sender::DIGEST_AFTER_WRITE_MIN_BYTES,
            id == 1
        );
        let verified = r.reserve(params(id, tokens));
        send(&s, id, u64::from(tokens)).await.unwrap();
        verified.await.unwrap().release().unwrap();
    }
    let st = s.stats().await.unwrap();
    assert_eq!(st.verified, 2);
    assert_eq!(st.digest_jobs_offloaded, 0, "{st:?}");
    assert_eq!(st.pages_digested_after_write, 10, "{st:?}");
    assert_receiver_pool_full(&r).await;
}

/// Digest jobs split across pool threads (`digest_threads`) on both ends, the receiver's after
/// the fence: 8 MiB transfers verify, both sides report split jobs, the pages come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digests_split_across_threads_verify_and_release() {
    let mut config = pages_of_two_64k_buffers();
    config.digest_offload_bytes = Some(1 << 20);
    config.digest_threads = 3;
    config.digest_at_landing = false;
    let (s, r) = pair(&config).await;
    for id in 1..=3u64 {
        // 1000 tokens: 63 pages of 2 x 64 KiB, about 8 MiB: three parts on each side.
        let verified = r.reserve(params(id, 1000));
        send(&s, id, 1000).await.unwrap();
        verified.await.unwrap().release().unwrap();
    }
    let (ss, rs) = (s.stats().await.unwrap(), r.stats().await.unwrap());
    assert_eq!((ss.verified, rs.verified), (3, 3));
    assert_eq!(
        (ss.digest_jobs_split, rs.digest_jobs_split),
        (3, 3),
        "{ss:?} {rs:?}"
    );
    assert_eq!(rs.digests_at_landing, 0);
    assert_receiver_pool_full(&r).await;
}

/// Regression (found by the soak): a receiver connection whose engine handles were all
/// dropped with nothing open stayed alive until its next timer (up to an hour), holding its
/// pool and socket. Its task must end, which closes the connection: the sender sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_receiver_handles_ends_its_connection() {
    let config = NodeConfig::example();
    let (s, r) = pair(&config).await;
    let v = r.reserve(params(1, 40));
    send(&s, 1, 40).await.unwrap();
    v.await.unwrap().release().unwrap();
    drop(r);
    // Bounded rounds, not a duration: the sender learns of the close from end of stream.
    for _ in 0..2000 {
        if s.stats().await.unwrap().peer_lost {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("the receiver's connection stayed open after its handles were dropped");
}

/// A proxy between the two nodes that forwards one connection until `cut` is notified, then
/// drops both sockets (the network path is gone; neither process closed anything).
async fn cuttable_proxy(
    target: std::net::SocketAddr,
) -> (std::net::SocketAddr, std::sync::Arc<tokio::sync::Notify>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cut = std::sync::Arc::new(tokio::sync::Notify::new());
    let c = cut.clone();
    tokio::spawn(async move {
        let (mut client, _) = listener.accept().await.unwrap();
        let mut server = tokio::net::TcpStream::connect(target).await.unwrap();
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
            _ = c.notified() => {}
        }
    });
    (addr, cut)
}

/// The connection breaks under open transfers: each fails with a retryable reason on its
/// side, every page comes back, and a new connection over the same two nodes (the memory
/// stays registered) serves the same requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_connection_fails_retryably_and_a_new_one_over_the_same_nodes_serves() {
    let config = NodeConfig::example();
    let nodes = (
        Node::new(config.clone()).unwrap(),
        Node::new(config).unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (via, cut) = cuttable_proxy(listener.local_addr().unwrap()).await;
    let decode = nodes.1.clone();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode).await });
    let s = SenderConn::connect(via, &nodes.0).await.unwrap();
    let r = accept.await.unwrap().unwrap();
    // Reservations waiting for data, and a request waiting for its reservation.
    let waiting: Vec<_> = (1..=2).map(|id| r.reserve(params(id, 300))).collect();
    let sending = {
        let s = s.clone();
        tokio::spawn(async move { send(&s, 3, 300).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(nodes.1.pool().leased_pages() > 0);
    cut.notify_one();
    for w in waiting {
        let e = w.await.unwrap_err();
        assert!(e.is_retryable(), "{e:?}");
    }
    let e = sending.await.unwrap().unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
    assert_receiver_pool_full(&r).await;
    // After the loss, the old handles refuse new work with a retryable error...
    let e = send(&s, 4, 64).await.unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
    drop((s, r));
    // ...and a new connection over the same nodes serves the same requests.
    let (s, r) = pair_of(&nodes).await;
    for id in 1..=3 {
        let verified = r.reserve(params(id, 300));
        send(&s, id, 300).await.unwrap();
        verified.await.unwrap().release().unwrap();
    }
    assert_receiver_pool_full(&r).await;
    assert!(nodes.1.pool().held_pages().is_empty());
    assert!(nodes.0.pool().held_pages().is_empty());
}

/// SPEC §7.2: a server that answers in another protocol is named by its bytes, as hex and
/// ASCII, in the connect error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_kvwire_server_is_named_by_its_bytes_in_hex_and_ascii() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut c, _) = l.accept().await.unwrap();
        let mut sink = [0u8; 256];
        let _ = c.read(&mut sink).await;
        let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
    });
    let node = Node::new(NodeConfig::example()).unwrap();
    let e = SenderConn::connect(addr, &node)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains(r#"48 54 54 50 "HTTP""#), "{e}");
}

/// Write coalescing (issue 12): frames queued while the transport holds its writes stay off
/// the socket until 16 are queued or the hold is released; then every one of them arrives,
/// in order, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_frames_go_out_on_release_or_once_a_batch_is_queued() {
    use kvwire::proto::auth::AuthChannel;
    use kvwire::proto::wire::Frame;
    use kvwire::transport::tcp::TcpReceiver;
    use kvwire::transport::Transport;
    use std::task::Poll;
    use tokio::io::AsyncReadExt;

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (a, b) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    let (mut peer, ours) = (a.unwrap(), b.unwrap().0);
    let (_, pool) = kvwire::testkit::PairConfig::small().pools().unwrap();
    let (sealer, opener) = AuthChannel::off().split();
    let mut rx = TcpReceiver::new(ours, sealer, opener, pool);
    let now = std::time::Instant::now();
    async fn poll_once(rx: &mut TcpReceiver, now: std::time::Instant) {
        std::future::poll_fn(|cx| {
            let _ = rx.poll_event(cx, now);
            Poll::Ready(())
        })
        .await
    }
    // What the peer has received within `wait`, decoded.
    async fn received(peer: &mut tokio::net::TcpStream, wait: Duration) -> Vec<Frame> {
        let mut bytes = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(Ok(n)) = tokio::time::timeout(wait, peer.read(&mut buf)).await {
            if n == 0 {
                break;
            }
            bytes.extend_from_slice(&buf[..n]);
        }
        let (mut frames, mut at) = (Vec::new(), 0);
        while at < bytes.len() {
            let (f, len) = Frame::decode(&bytes[at..]).unwrap();
            frames.push(f);
            at += len;
        }
        frames
    }
    let wait = Duration::from_millis(100);
    assert!(rx.coalesces_writes(), "TCP says it coalesces held writes");

    rx.hold_writes(true);
    for token in 0..3 {
        rx.send_frame(now, &Frame::Ping(token));
    }
    poll_once(&mut rx, now).await;
    assert!(
        received(&mut peer, wait).await.is_empty(),
        "held frames were written before the release"
    );
    rx.hold_writes(false);
    poll_once(&mut rx, now).await;
    assert_eq!(
        received(&mut peer, wait).await,
        (0..3).map(Frame::Ping).collect::<Vec<_>>()
    );

    // Still held, but a batch's worth (16) is queued: it goes out.
    rx.hold_writes(true);
    for token in 10..26 {
        rx.send_frame(now, &Frame::Ping(token));
    }
    poll_once(&mut rx, now).await;
    assert_eq!(
        received(&mut peer, wait).await,
        (10..26).map(Frame::Ping).collect::<Vec<_>>()
    );
}

/// A proxy that forwards the receiver's bytes to the sender always, and the sender's to the
/// receiver until `stall` is notified; then it stops reading from the sender (and keeps both
/// sockets open): a peer that keeps talking but no longer reads.
async fn one_way_stalling_proxy(
    target: std::net::SocketAddr,
) -> (std::net::SocketAddr, std::sync::Arc<tokio::sync::Notify>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stall = std::sync::Arc::new(tokio::sync::Notify::new());
    let st = stall.clone();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let server = tokio::net::TcpStream::connect(target).await.unwrap();
        let (mut from_sender, mut to_sender) = client.into_split();
        let (mut from_receiver, mut to_receiver) = server.into_split();
        let back = tokio::spawn(async move {
            let _ = tokio::io::copy(&mut from_receiver, &mut to_sender).await;
        });
        let mut buf = vec![0u8; 64 * 1024];
        let stalled = st.notified();
        tokio::pin!(stalled);
        loop {
            tokio::select! {
                _ = &mut stalled => break,
                n = from_sender.read(&mut buf) => match n {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        if to_receiver.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                },
            }
        }
        // Stalled: nothing more is read from the sender; its bytes back up into its socket.
        let _keep = (from_sender, to_receiver);
        let _ = back.await;
    });
    (addr, stall)
}

/// SPEC §8.3, a peer that does not read: the receiver's end keeps sending (its heartbeats
/// reach the sender) but stops reading, so the sender's page bytes back up in the socket.
/// The sender declares the peer unresponsive once its bytes found no taker for its liveness
/// timeout, fails the transfer with `PeerUnresponsive` (not at a protocol deadline, which are
/// a minute here) and gets its source pages back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_talks_but_does_not_read_is_declared_unresponsive() {
    let mut config = NodeConfig::example();
    config.pool = kvwire::PoolGeometry {
        tokens_per_page: 16,
        buffer_page_bytes: vec![256 * 1024, 256 * 1024],
        pages: 64,
    };
    config.engine = kvwire::EngineConfig::new(1024);
    config.sender.verdict_timeout = Duration::from_secs(60);
    config.sender.reservation_timeout = Duration::from_secs(60);
    // Page bytes on the stream, which is what backs up (same-host pulls send only records
    // naming the pages).
    config.same_host = kvwire::SameHost::Off;
    let mut patient = config.clone();
    // The receiver hears nothing from the sender once the proxy stalls: it must not be the
    // one that gives up first.
    patient.liveness.timeout = Duration::from_secs(120);
    let nodes = (Node::new(config).unwrap(), Node::new(patient).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (via, stall) = one_way_stalling_proxy(listener.local_addr().unwrap()).await;
    let decode = nodes.1.clone();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode).await });
    let s = SenderConn::connect(via, &nodes.0).await.unwrap();
    let r = accept.await.unwrap().unwrap();
    stall.notify_one();
    // 48 pages of 512 KiB (24 MiB): more than the sockets on the way can hold.
    let verified = r.reserve(ReserveParams::new(
        TransferId(1),
        48 * 16,
        Duration::from_secs(60),
    ));
    let e = tokio::time::timeout(Duration::from_secs(50), send(&s, 1, 48 * 16))
        .await
        .expect("the sender still waits on a peer that does not read")
        .unwrap_err();
    assert!(
        matches!(
            &e,
            TransferError::Failed(FailureReason::PeerUnresponsive)
                | TransferError::Failed(FailureReason::Unconfirmed { .. })
        ),
        "{e:?}"
    );
    for _ in 0..2000 {
        if nodes.0.pool().held_pages().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(nodes.0.pool().held_pages().is_empty(), "source pages held");
    drop(verified);
}
