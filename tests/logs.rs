//! Log hygiene: losing a peer with many open transfers is one WARN line per side (with the
//! count by reason), not one per transfer; each transfer's detail is at DEBUG.

use std::time::Duration;

use kvwire::{Node, NodeConfig, ReceiverConn, ReserveParams, SenderConn, TransferId};

#[path = "common/captured_log.rs"]
mod captured_log;
use captured_log::CapturedLog;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_peer_with_many_open_transfers_is_one_warning() {
    let logs = CapturedLog::default();
    tracing::subscriber::set_global_default(logs.warn_subscriber()).unwrap();
    let config = NodeConfig::example();
    let (prefill, decode) = (
        Node::new(config.clone()).unwrap(),
        Node::new(config).unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode).await });
    let s = SenderConn::connect(addr, &prefill).await.unwrap();
    let r = accept.await.unwrap().unwrap();
    let waits: Vec<_> = (1..=60)
        .map(|id| {
            r.reserve(ReserveParams::new(
                TransferId(id),
                16,
                Duration::from_secs(30),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The prefill engine goes away: every reservation fails.
    drop(s);
    for w in waits {
        assert!(w.await.is_err());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let text = logs.text();
    let warnings: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
    assert!(
        warnings.len() <= 2,
        "{} warnings for one lost peer:\n{text}",
        warnings.len()
    );
    assert!(
        warnings
            .iter()
            .any(|l| l.contains("connection lost") && l.contains("60 open transfers failed")),
        "no summary line:\n{text}"
    );
}
