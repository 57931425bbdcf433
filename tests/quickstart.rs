//! The README's integrator code (`examples/quickstart/integrator.rs`) over TCP: the decode
//! side checks every byte it reads in place. The SoftRoCE lane runs the same code over RDMA
//! across two processes (`examples/quickstart`).

#[path = "../examples/quickstart/integrator.rs"]
mod integrator;

use kvwire::{Auth, NodeConfig, PoolGeometry, ReceiverConn, SenderConn};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_integrator_code_moves_verified_kv_over_tcp() {
    let pool = PoolGeometry {
        tokens_per_page: 16,
        buffer_page_bytes: vec![4096, 4096],
        pages: 256,
    };
    let config = NodeConfig::builder(pool, 4096)
        .fingerprint("quickstart-model/tp0")
        .auth(Auth::ephemeral())
        .build()
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let decode_node = kvwire::Node::new(config.clone()).unwrap();
    let prefill_node = kvwire::Node::new(config).unwrap();
    let decode = tokio::spawn(async move {
        let conn = ReceiverConn::accept(&listener, &decode_node).await.unwrap();
        integrator::decode(&conn, 8, 100).await.unwrap()
    });
    let conn = SenderConn::connect(addr, &prefill_node).await.unwrap();
    integrator::prefill(&conn, 8, 100).await.unwrap();
    // 8 requests x 7 pages x 2 buffers x 4 KiB, every byte compared.
    assert_eq!(decode.await.unwrap(), 8 * 7 * 2 * 4096);
}

#[test]
fn a_node_whose_pool_cannot_hold_its_context_is_refused_at_build() {
    let pool = PoolGeometry {
        tokens_per_page: 16,
        buffer_page_bytes: vec![4096],
        pages: 10,
    };
    let e = NodeConfig::builder(pool, 4096)
        .auth(Auth::Off)
        .build()
        .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("160") && msg.contains("4096"), "{msg}");
}
