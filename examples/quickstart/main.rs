//! The README's quickstart, runnable: a decode node and a prefill node moving verified KV.
//!
//! ```sh
//! cargo run --example quickstart                      # both nodes in this process, over TCP
//! KVWIRE_PSK=$(kvwire gen-psk) ...                    # for two processes, both need the key:
//! cargo run --example quickstart -- --listen 127.0.0.1:7400 [--rdma DEVICE]   # decode node
//! cargo run --example quickstart -- --connect 127.0.0.1:7400 [--rdma DEVICE]  # prefill node
//! ```
//!
//! Exits non-zero unless every transfer verified and every byte matched.

mod integrator;

use std::net::SocketAddr;

use kvwire::{Auth, Node, NodeConfig, PoolGeometry, ReceiverConn, SenderConn, TransportConfig};

const REQUESTS: u64 = 8;
const TOKENS: u32 = 100;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn config(auth: Auth, rdma: Option<&str>) -> Result<NodeConfig, Error> {
    let pool = PoolGeometry {
        tokens_per_page: 16,
        buffer_page_bytes: vec![4096, 4096],
        pages: 256,
    };
    let transport = match rdma {
        Some(dev) => TransportConfig::rdma(Some(dev)),
        None => TransportConfig::Tcp,
    };
    Ok(NodeConfig::builder(pool, 4096)
        .fingerprint("quickstart-model/tp0")
        .auth(auth)
        .transport(transport)
        .build()?)
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let rdma = arg("--rdma");
    let (listen, connect) = (arg("--listen"), arg("--connect"));
    // Two processes share a pre-shared key (KVWIRE_PSK_FILE or KVWIRE_PSK); one process
    // makes one up.
    let auth = match kvwire::config::auth::find_psk(None)? {
        Some((key, _)) => Auth::Psk(key),
        None if listen.is_none() && connect.is_none() => Auth::ephemeral(),
        None => return Err("set KVWIRE_PSK (or KVWIRE_PSK_FILE) in both processes".into()),
    };
    let config = config(auth, rdma.as_deref())?;
    // The node's KV memory, registered once (here kvwire allocates it).
    let node = Node::new(config.clone())?;
    match (listen, connect) {
        (Some(addr), _) => {
            let listener = tokio::net::TcpListener::bind(addr.parse::<SocketAddr>()?).await?;
            eprintln!("decode: listening on {}", listener.local_addr()?);
            let conn = ReceiverConn::accept(&listener, &node).await?;
            let bytes = integrator::decode(&conn, REQUESTS, TOKENS).await?;
            println!(
                "decode: {REQUESTS} transfers verified over {}, {bytes} bytes checked",
                config.transport.name()
            );
        }
        (_, Some(addr)) => {
            let addr = addr.parse::<SocketAddr>()?;
            // The decode node may still be starting: retry for a while.
            let mut tries = 0;
            let conn = loop {
                match SenderConn::connect(addr, &node).await {
                    Ok(c) => break c,
                    Err(kvwire::EngineError::Io(e)) if tries < 100 => {
                        tries += 1;
                        let _ = e;
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            integrator::prefill(&conn, REQUESTS, TOKENS).await?;
            println!("prefill: {REQUESTS} transfers verified by the decode node");
        }
        _ => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            // Both nodes in this process: the decode node gets memory of its own.
            let decode_node = Node::new(config.clone())?;
            let decode = tokio::spawn(async move {
                let conn = ReceiverConn::accept(&listener, &decode_node).await?;
                integrator::decode(&conn, REQUESTS, TOKENS).await
            });
            let conn = SenderConn::connect(addr, &node).await?;
            integrator::prefill(&conn, REQUESTS, TOKENS).await?;
            let bytes = decode.await??;
            println!(
                "{REQUESTS} transfers verified over {}, {bytes} bytes checked",
                config.transport.name()
            );
        }
    }
    Ok(())
}
