//! Same-host pulls over TCP (SPEC §9.3): two nodes on one host, the decode copying each page
//! out of the prefill's memory with `process_vm_readv`, every byte checked in place by the
//! README's integrator code; and the configurations that turn it off or require it.

#[path = "../examples/quickstart/integrator.rs"]
mod integrator;

use kvwire::{Auth, EngineError, NodeConfig, PoolGeometry, ReceiverConn, SameHost, SenderConn};

/// The test's node configuration (one key for every node of the test binary), with
/// `same_host` and `streams`.
fn config(same_host: SameHost, streams: u16) -> NodeConfig {
    static BASE: std::sync::OnceLock<NodeConfig> = std::sync::OnceLock::new();
    let mut c = BASE
        .get_or_init(|| {
            let pool = PoolGeometry {
                tokens_per_page: 16,
                buffer_page_bytes: vec![4096, 8192],
                pages: 256,
            };
            NodeConfig::builder(pool, 4096)
                .fingerprint("same-host/tp0")
                .auth(Auth::ephemeral())
                .build()
                .unwrap()
        })
        .clone();
    c.same_host = same_host;
    c.tcp_streams = streams;
    c
}

/// [`config`] with pages of `buffer_page_bytes` (and 64 of them).
fn config_with_pages(same_host: SameHost, buffer_page_bytes: Vec<u32>) -> NodeConfig {
    let mut c = config(same_host, 1);
    c.pool.buffer_page_bytes = buffer_page_bytes;
    c.pool.pages = 64;
    c.engine = kvwire::EngineConfig::new(1024);
    c
}

/// Runs the integrator's 8 requests of 100 tokens from a prefill configured `prefill` to a
/// decode configured `decode`; returns whether the decode pulled, and the bytes it checked.
async fn run(prefill: NodeConfig, decode: NodeConfig) -> (bool, u64) {
    let (pulled, checked, _) = run_counting_digests(prefill, decode).await;
    (pulled, checked)
}

/// [`run`], and the source pages the prefill digested right after their writes (pull records
/// or data records) rather than before them.
async fn run_counting_digests(prefill: NodeConfig, decode: NodeConfig) -> (bool, u64, u64) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let decode_node = kvwire::Node::new(decode).unwrap();
    let prefill_node = kvwire::Node::new(prefill).unwrap();
    let decode = tokio::spawn(async move {
        let conn = ReceiverConn::accept(&listener, &decode_node).await.unwrap();
        let checked = integrator::decode(&conn, 8, 100).await.unwrap();
        let stats = conn.stats().await.unwrap();
        assert_eq!(stats.verified, 8);
        (stats.same_host_pulls, checked)
    });
    let conn = SenderConn::connect(addr, &prefill_node).await.unwrap();
    integrator::prefill(&conn, 8, 100).await.unwrap();
    let after_writes = conn.stats().await.unwrap().pages_digested_after_write;
    let (pulled, checked) = decode.await.unwrap();
    (pulled, checked, after_writes)
}

const BYTES: u64 = 8 * 7 * (4096 + 8192);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_host_the_decode_pulls_every_page_and_verifies_it() {
    let (pulled, checked) = run(config(SameHost::Auto, 1), config(SameHost::Auto, 1)).await;
    assert!(
        pulled,
        "both ends on 127.0.0.1 with same_host = auto: pulls"
    );
    assert_eq!(checked, BYTES);
    // Over several streams too, with the prefill as the server.
    let (pulled, checked) = run(config(SameHost::Require, 3), config(SameHost::Require, 3)).await;
    assert!(pulled);
    assert_eq!(checked, BYTES);
}

/// Pulls copied on pull threads (`NodeConfig::pull_threads`): over one stream and over three
/// sharing the connection's threads, every page verified and every byte checked; with one
/// thread (on the connection's task) too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_on_pull_threads_verify_every_page() {
    for (threads, streams) in [(2, 1), (3, 3), (1, 1)] {
        let mut decode = config(SameHost::Require, streams);
        decode.pull_threads = threads;
        let (pulled, checked) = run(config(SameHost::Require, streams), decode).await;
        assert!(pulled, "{threads} threads, {streams} streams");
        assert_eq!(checked, BYTES, "{threads} threads, {streams} streams");
    }
    let pages = vec![160 * 1024, 200 * 1024];
    let mut decode = config_with_pages(SameHost::Auto, pages.clone());
    decode.pull_threads = 2;
    let (pulled, checked) = run(config_with_pages(SameHost::Auto, pages), decode).await;
    assert!(pulled);
    assert_eq!(checked, 8 * 7 * (160 + 200) * 1024);
}

/// Pages of more than 256 KiB are pulled slot by slot (each digested right after its copy),
/// smaller ones in one call: both verify every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_pages_are_pulled_slot_by_slot_and_verify() {
    let pages = vec![160 * 1024, 200 * 1024];
    let (pulled, checked) = run(
        config_with_pages(SameHost::Auto, pages.clone()),
        config_with_pages(SameHost::Auto, pages),
    )
    .await;
    assert!(pulled);
    assert_eq!(checked, 8 * 7 * (160 + 200) * 1024);
}

/// The prefill digests the source pages of a pulled transfer of at least
/// `DIGEST_AFTER_WRITE_MIN_BYTES` right after the write that carried their pull records (the
/// decode copies them meanwhile), and a smaller transfer's before its records; all verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_digests_large_pulled_transfers_after_their_pull_records() {
    // 7 pages of 360 KiB per request: 2.5 MiB, digested after the records.
    let pages = vec![160 * 1024, 200 * 1024];
    const { assert!(7 * (160 + 200) * 1024 >= kvwire::sender::DIGEST_AFTER_WRITE_MIN_BYTES) };
    let (pulled, checked, after_writes) = run_counting_digests(
        config_with_pages(SameHost::Require, pages.clone()),
        config_with_pages(SameHost::Require, pages),
    )
    .await;
    assert!(pulled);
    assert_eq!(checked, 8 * 7 * (160 + 200) * 1024);
    assert_eq!(after_writes, 8 * 7, "every page of the 8 requests");
    // 7 pages of 12 KiB per request: digested before the records.
    let (pulled, checked, after_writes) =
        run_counting_digests(config(SameHost::Require, 1), config(SameHost::Require, 1)).await;
    assert!(pulled);
    assert_eq!(checked, BYTES);
    assert_eq!(after_writes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn either_end_off_keeps_page_bytes_on_the_stream() {
    for (p, d) in [
        (SameHost::Off, SameHost::Auto),
        (SameHost::Auto, SameHost::Off),
    ] {
        let (pulled, checked) = run(config(p, 1), config(d, 1)).await;
        assert!(!pulled, "prefill {p:?}, decode {d:?}");
        assert_eq!(checked, BYTES);
    }
}

/// A node that requires pulls refuses a peer that does not offer them, in the handshake,
/// naming why (SPEC §9.3, §4.3 #7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_refuses_a_peer_without_pulls_in_the_handshake() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let decode_node = kvwire::Node::new(config(SameHost::Require, 1)).unwrap();
    let prefill_node = kvwire::Node::new(config(SameHost::Off, 1)).unwrap();
    let decode =
        tokio::spawn(async move { ReceiverConn::accept(&listener, &decode_node).await.err() });
    let prefill = SenderConn::connect(addr, &prefill_node).await.err();
    let decode = decode.await.unwrap();
    let shown = format!("{prefill:?} / {decode:?}");
    assert!(
        matches!(prefill, Some(EngineError::Handshake(_))),
        "the prefill is told in HELLO_REJECT: {shown}"
    );
    assert!(shown.contains("same_host = require"), "{shown}");
    assert!(
        shown.contains("TRANSPORT_MISMATCH") || shown.contains("TransportMismatch"),
        "{shown}"
    );
}
