//! Opening a connection over the node's transport: the handshake (carrying the transport's
//! parameters), the transport over the node's memory, and the role's task.

use kvwire_proto::wire::Role;
use tokio::net::TcpStream;

use super::{handshake, EngineError, Node, ReceiverConn, SenderConn};
use crate::config::TransportConfig;
use crate::transport::tcp::{self, TcpReceiver, TcpSender};

/// The prefill end of a connection on `stream` (client or server side of the handshake).
pub(crate) async fn sender(
    stream: TcpStream,
    node: &Node,
    client: bool,
) -> Result<SenderConn, EngineError> {
    let config = node.config();
    let pool = node.pool().clone();
    match &config.transport {
        TransportConfig::Tcp => {
            let params = tcp::transport_params(pool.capacity_pages());
            let (stream, est, channel) =
                handshake(stream, config, client, Role::SENDER, params).await?;
            // The receiver's page count bounds the pages a reservation may name (SPEC §9.1).
            let pages = tcp::parse_transport_params(&est.peer.transport_params).map_err(|e| {
                EngineError::Transport(format!("the receiver's TCP transport parameters: {e}"))
            })?;
            let (sealer, opener) = channel.split();
            let t =
                TcpSender::new(stream, sealer, opener, pool.clone()).with_destination_pages(pages);
            SenderConn::run(est, pool, t, config)
        }
        #[cfg(feature = "rdma")]
        TransportConfig::Rdma {
            device,
            queue_pairs,
            busy_poll,
        } => {
            use crate::transport::rdma::bootstrap;
            let reg = node.rdma(device.as_deref())?;
            let (prepared, params) = bootstrap::prepare(
                &reg.device,
                Role::SENDER,
                *queue_pairs,
                config.window,
                config.pool.buffers(),
                *busy_poll,
            )
            .map_err(rdma)?;
            let (stream, est, channel) =
                handshake(stream, config, client, Role::SENDER, params).await?;
            let t = prepared
                .into_sender(
                    &est,
                    channel,
                    stream,
                    &pool,
                    reg.memory,
                    config.window,
                    config.handshake_timeout,
                )
                .await
                .map_err(rdma)?;
            SenderConn::run(est, pool, t, config)
        }
        #[allow(unreachable_patterns)]
        other => Err(unsupported(other)),
    }
}

/// The decode end of a connection on `stream` (client or server side of the handshake).
pub(crate) async fn receiver(
    stream: TcpStream,
    node: &Node,
    client: bool,
) -> Result<ReceiverConn, EngineError> {
    let config = node.config();
    let pool = node.pool().clone();
    match &config.transport {
        TransportConfig::Tcp => {
            let params = tcp::transport_params(pool.capacity_pages());
            let (stream, est, channel) =
                handshake(stream, config, client, Role::RECEIVER, params).await?;
            let (sealer, opener) = channel.split();
            let t = TcpReceiver::new(stream, sealer, opener, pool.clone());
            ReceiverConn::run(est, pool, t, config)
        }
        #[cfg(feature = "rdma")]
        TransportConfig::Rdma {
            device,
            queue_pairs,
            busy_poll,
        } => {
            use crate::transport::rdma::bootstrap;
            let reg = node.rdma(device.as_deref())?;
            let (prepared, params) = bootstrap::prepare(
                &reg.device,
                Role::RECEIVER,
                *queue_pairs,
                config.window,
                config.pool.buffers(),
                *busy_poll,
            )
            .map_err(rdma)?;
            let (stream, est, channel) =
                handshake(stream, config, client, Role::RECEIVER, params).await?;
            let t = prepared
                .into_receiver(
                    &est,
                    channel,
                    stream,
                    &pool,
                    reg.memory,
                    config.handshake_timeout,
                )
                .await
                .map_err(rdma)?;
            ReceiverConn::run(est, pool, t, config)
        }
        #[allow(unreachable_patterns)]
        other => Err(unsupported(other)),
    }
}

#[cfg(feature = "rdma")]
fn rdma(e: impl std::fmt::Display) -> EngineError {
    super::node::rdma::transport(e)
}

#[allow(dead_code)]
fn unsupported(t: &TransportConfig) -> EngineError {
    EngineError::Transport(format!(
        "this kvwire was built without the {} transport (rebuild with `--features {}`)",
        t.name(),
        t.name()
    ))
}

/// Both ends of one connection in this process over the loopback transport (a simulated
/// wire in real time, no latency): `prefill` sends from its memory into `decode`'s. The two
/// nodes must hold different memories (two [`Node`]s), with the same layout. Unauthenticated
/// (nothing leaves the process); `decode`'s configuration sets the sessions' parameters.
pub fn loopback(prefill: &Node, decode: &Node) -> Result<(SenderConn, ReceiverConn), EngineError> {
    use crate::transport::loopback;
    let now = std::time::Instant::now();
    let (client, server) = kvwire_proto::handshake::in_memory(
        now,
        decode.config().hello(Role::RECEIVER),
        prefill.config().hello(Role::SENDER),
    )?;
    let (source, dest) = (prefill.pool().clone(), decode.pool().clone());
    if std::sync::Arc::ptr_eq(&source, &dest) {
        return Err(EngineError::Transport(
            "loopback needs two nodes: a node cannot send into its own memory".into(),
        ));
    }
    if source.memory().has_device_memory() || dest.memory().has_device_memory() {
        // The in-process wire copies page bytes with the CPU; device memory goes over TCP
        // (its staging pipeline), docs/GPU.md.
        return Err(EngineError::Transport(
            "loopback moves host memory only: a node with device memory connects over TCP".into(),
        ));
    }
    let (s, r) = loopback::connect(source.clone(), dest.clone(), std::time::Duration::ZERO);
    let receiver = ReceiverConn::run(client, dest, r, decode.config())?;
    let sender = SenderConn::run(server, source, s, prefill.config())?;
    Ok((sender, receiver))
}

/// The ways to open one end of a connection, alike for both roles: `$open` is
/// [`sender`] or [`receiver`] of this module.
macro_rules! constructors {
    ($open:path) => {
        /// Connects to the peer and runs the handshake as the client, over `node`'s memory
        /// and transport.
        pub async fn connect(addr: impl ToSocketAddrs, node: &Node) -> Result<Self, EngineError> {
            let stream = TcpStream::connect(addr).await?;
            Self::start(stream, node, true).await
        }

        /// Accepts one connection on `listener` and runs the handshake as the server, over
        /// `node`'s memory and transport.
        pub async fn accept(listener: &TcpListener, node: &Node) -> Result<Self, EngineError> {
            let (stream, _) = listener.accept().await?;
            Self::start(stream, node, false).await
        }

        /// Runs the handshake on `stream` (over the transport `node`'s configuration names)
        /// and starts the connection's task over `node`'s memory, which every connection of
        /// the node shares. After a connection ends (the peer is gone, a queue pair failed),
        /// opening another one over the same node is how it recovers: the memory stays
        /// registered.
        pub async fn start(
            stream: TcpStream,
            node: &Node,
            client: bool,
        ) -> Result<Self, EngineError> {
            $open(stream, node, client).await
        }
    };
}
pub(crate) use constructors;
