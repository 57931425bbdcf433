//! The engine API with discovery and aux records, no facade: a prefill node publishes itself
//! with the embedded bootstrap server, a decode node resolves it (its layout checked), dials
//! the address it found and receives a transfer whose final chunk carries an aux record; a
//! node with another model fingerprint is refused before it dials; the record goes with its
//! registration.

use std::time::Duration;

use kvwire::discovery::{
    connect, BootstrapServer, DiscoveryBackend, DiscoveryError, PeerQuery, Role,
};
use kvwire::{Node, NodeConfig, ReceiverConn, Request, ReserveParams, SenderConn, TransferId};
use tokio::net::TcpListener;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_resolves_its_prefill_and_receives_kv_with_its_aux_record() {
    let (_server, at) = BootstrapServer::bind("127.0.0.1:0").await.unwrap();
    let discovery = connect(
        &DiscoveryBackend::Bootstrap(at.to_string()),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    // One key for both nodes (the example configuration draws a fresh one), two node ids.
    let config = NodeConfig::example();
    let prefill = Node::new(config.clone()).unwrap();
    let with = |node_id: u64, fingerprint: &[u8]| {
        let mut c = config.clone();
        c.node_id = node_id;
        c.fingerprint = fingerprint.to_vec();
        Node::new(c).unwrap()
    };
    let decode = with(2, &config.fingerprint);

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let registration = prefill
        .register(
            discovery.as_ref(),
            "engines",
            Role::Prefill,
            0,
            address.clone(),
        )
        .await
        .unwrap();
    let p = prefill.clone();
    let accepted = tokio::spawn(async move { SenderConn::accept(&listener, &p).await });

    let query = || PeerQuery::cluster("engines").role(Role::Prefill).rank(0);
    let found = decode
        .resolve(discovery.as_ref(), query(), true)
        .await
        .unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].address, address);
    assert_eq!(found[0].node_id, config.node_id);
    assert_eq!(found[0].layout_fingerprint, decode.layout_fingerprint());

    let r = ReceiverConn::connect(found[0].address.as_str(), &decode)
        .await
        .unwrap();
    let s = accepted.await.unwrap().unwrap();
    assert_eq!(s.peer().node_id, 2);
    let id = TransferId(7);
    let verified =
        r.reserve(ReserveParams::new(id, 2 * 16, Duration::from_secs(10)).into_pages(vec![9, 4]));
    let admitted = s
        .admit(Request {
            transfer_id: id,
            tokens: 2 * 16,
        })
        .unwrap();
    let tx = s.open(admitted);
    tx.send_chunk(vec![3], None).await.unwrap();
    tx.send_chunk(vec![5], Some(b"first token 1234".to_vec()))
        .await
        .unwrap();
    tx.outcome().await.unwrap();
    let kv = verified.await.unwrap();
    assert_eq!(kv.aux(), b"first token 1234");
    assert_eq!(kv.page_indices(), vec![9, 4]);
    kv.release().unwrap();

    // Another model: its layout fingerprint differs, the peer is refused before any dial.
    let other = with(3, b"another-model/tp0");
    let refused = other.resolve(discovery.as_ref(), query(), true).await;
    assert!(
        matches!(refused, Err(DiscoveryError::LayoutMismatch { .. })),
        "{refused:?}"
    );
    // Unchecked, the record is returned as it is.
    assert_eq!(
        other
            .resolve(discovery.as_ref(), query(), false)
            .await
            .unwrap()
            .len(),
        1
    );

    registration.deregister().await.unwrap();
    assert!(decode
        .resolve(discovery.as_ref(), query(), true)
        .await
        .unwrap()
        .is_empty());
}
