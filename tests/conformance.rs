//! The conformance kit (`kvwire::testkit::conformance`, `kvwire conform`) against kvwire's own
//! listener, with authentication and without: every check passes (the unsealed frame check
//! is skipped, with its reason, where the listener authenticates), and the connection of the
//! PING flood, which the kit sends far faster than `PING_FLOOD_LIMIT` a second, was closed by
//! the decode as a flood (SPEC §8.3), a typed reason its engine can read.

use std::time::Duration;

use kvwire::testkit::conformance::{self, Checked, Options, Verdict};
use kvwire::transport::Closed;
use kvwire::{Auth, Listener, ListenerConfig, Node, NodeConfig, ReceiverConn};

/// Every one of the 13 checks passed (those that write unsealed frames may be skipped, with
/// their reason, where the target authenticates); the target closed the flood's connection
/// while the kit still read (not only when the kit hung up), and exactly one of the
/// target's connections ended as a PING flood (`reasons`: how each ended).
fn judge(checked: &[Checked], authenticated: bool, reasons: &[Option<Closed>]) {
    let shown: Vec<String> = checked
        .iter()
        .map(|c| format!("{} ({}): {:?}", c.name, c.spec, c.verdict))
        .collect();
    let shown = shown.join("\n");
    println!("{shown}");
    assert_eq!(checked.len(), 13, "{shown}");
    for c in checked {
        match &c.verdict {
            Verdict::Pass(_) => {}
            Verdict::Skip(why) if authenticated && why.contains("authenticates") => {}
            other => panic!("{}: {other:?}\n{shown}", c.name),
        }
    }
    let flood = checked
        .iter()
        .find(|c| c.name.starts_with("a PING flood"))
        .unwrap();
    assert!(
        matches!(&flood.verdict, Verdict::Pass(seen) if seen.contains(", then closed")),
        "{flood:?}"
    );
    let floods = reasons
        .iter()
        .filter(|r| matches!(r, Some(Closed::PingFlood { pings, .. }) if *pings > kvwire::proto::liveness::PING_FLOOD_LIMIT))
        .count();
    assert_eq!(
        floods, 1,
        "one connection closed as a PING flood: {reasons:?}"
    );
}

async fn check_against_a_listener(auth: Auth) {
    let mut config = NodeConfig::example();
    config.auth = auth;
    config.handshake_timeout = Duration::from_secs(1);
    let decode = Node::new(config.clone()).unwrap();
    let mut listener = Listener::receivers("127.0.0.1:0", &decode, ListenerConfig::default())
        .await
        .unwrap();
    let addr = listener.local_addr();
    // The connections the kit completes are accepted and held, as a decode engine would.
    let (conns, mut accepted) = tokio::sync::mpsc::unbounded_channel::<ReceiverConn>();
    let held = tokio::spawn(async move {
        while let Some(c) = listener.accept().await {
            let _ = conns.send(c);
        }
    });
    let options = Options {
        wait: Duration::from_secs(5),
        ..Options::default()
    };
    let checked = conformance::run(addr, &config, options).await;
    held.abort();
    let mut reasons = Vec::new();
    while let Ok(c) = accepted.try_recv() {
        reasons.push(c.closed_reason());
    }
    judge(&checked, config.auth.is_on(), &reasons);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvwires_listener_passes_the_conformance_kit_with_authentication() {
    check_against_a_listener(Auth::ephemeral()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvwires_listener_passes_the_conformance_kit_without_authentication() {
    check_against_a_listener(Auth::Off).await;
}

/// The prefill half of the kit (`conformance::run_prefill`) against kvwire's prefill, which
/// connects again whenever a check ended its connection: every check passes (those that
/// write unsealed frames are skipped, with their reason, where it authenticates), and its
/// connection of the PING flood ended as `Closed::PingFlood`.
async fn check_a_prefill(auth: Auth) {
    let mut config = NodeConfig::example();
    config.auth = auth;
    config.handshake_timeout = Duration::from_secs(1);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let prefill = Node::new(config.clone()).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let connecting = tokio::spawn(conformance::reconnecting_prefill(
        addr,
        prefill,
        done.clone(),
    ));
    let options = Options {
        wait: Duration::from_secs(5),
        ..Options::default()
    };
    let checked = conformance::run_prefill(&listener, &config, options).await;
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let reasons = connecting.await.unwrap();
    judge(&checked, config.auth.is_on(), &reasons);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvwires_prefill_passes_the_conformance_kit_with_authentication() {
    check_a_prefill(Auth::ephemeral()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvwires_prefill_passes_the_conformance_kit_without_authentication() {
    check_a_prefill(Auth::Off).await;
}
