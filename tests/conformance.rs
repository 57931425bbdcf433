//! The conformance kit (`kvwire::testkit::conformance`, `kvwire conform`) against kvwire's own
//! listener, with authentication and without: every check passes (the unsealed frame check
//! is skipped, with its reason, where the listener authenticates).

use std::time::Duration;

use kvwire::testkit::conformance::{self, Options, Verdict};
use kvwire::{Auth, Listener, ListenerConfig, Node, NodeConfig};

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
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some(c) = listener.accept().await {
            held.push(c);
        }
    });
    let options = Options {
        wait: Duration::from_secs(5),
        ..Options::default()
    };
    let checked = conformance::run(addr, &config, options).await;
    held.abort();
    let shown: Vec<String> = checked
        .iter()
        .map(|c| format!("{} ({}): {:?}", c.name, c.spec, c.verdict))
        .collect();
    let shown = shown.join("\n");
    println!("{shown}");
    assert_eq!(checked.len(), 13, "{shown}");
    for c in &checked {
        match &c.verdict {
            Verdict::Pass(_) => {}
            Verdict::Skip(why) if config.auth.is_on() && why.contains("authenticates") => {}
            other => panic!("{}: {other:?}\n{shown}", c.name),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvwires_listener_passes_the_conformance_kit_with_authentication() {
    check_against_a_listener(Auth::ephemeral()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvwires_listener_passes_the_conformance_kit_without_authentication() {
    check_against_a_listener(Auth::Off).await;
}
