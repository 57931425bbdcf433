//! Opening a connection over the configured transport: the handshake (carrying the
//! transport's parameters), the connection's pool, the transport, and the role's task.

use std::sync::Arc;

use kvwire_proto::wire::Role;
use tokio::net::TcpStream;

use super::{handshake, EngineError, NodeConfig, ReceiverConn, SenderConn};
use crate::config::TransportConfig;
use crate::memory::{KvMemory, PagePool};
use crate::transport::tcp::{TcpReceiver, TcpSender};

fn pool(config: &NodeConfig, memory: KvMemory) -> Result<Arc<PagePool>, EngineError> {
    Ok(Arc::new(PagePool::with_memory(
        config.pool.clone(),
        memory,
        config.scrub,
    )?))
}

/// The prefill end of a connection on `stream` (client or server side of the handshake).
pub(crate) async fn sender(
    stream: TcpStream,
    config: &NodeConfig,
    client: bool,
    memory: KvMemory,
) -> Result<SenderConn, EngineError> {
    match &config.transport {
        TransportConfig::Tcp => {
            let (stream, est, channel) =
                handshake(stream, config, client, Role::SENDER, Vec::new()).await?;
            let pool = pool(config, memory)?;
            let (sealer, opener) = channel.split();
            let t = TcpSender::new(stream, sealer, opener, pool.clone());
            SenderConn::run(est, pool, t, config)
        }
        #[cfg(feature = "rdma")]
        TransportConfig::Rdma {
            device,
            queue_pairs,
            busy_poll,
        } => {
            use crate::transport::rdma::{bootstrap, RdmaDevice};
            let dev = Arc::new(RdmaDevice::open(device.as_deref()).map_err(rdma)?);
            let (prepared, params) = bootstrap::prepare(
                &dev,
                Role::SENDER,
                *queue_pairs,
                config.window,
                config.pool.buffers(),
                *busy_poll,
            )
            .map_err(rdma)?;
            let (stream, est, channel) =
                handshake(stream, config, client, Role::SENDER, params).await?;
            let pool = pool(config, memory)?;
            let t = prepared
                .into_sender(
                    &est,
                    channel,
                    stream,
                    &pool,
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
    config: &NodeConfig,
    client: bool,
    memory: KvMemory,
) -> Result<ReceiverConn, EngineError> {
    match &config.transport {
        TransportConfig::Tcp => {
            let (stream, est, channel) =
                handshake(stream, config, client, Role::RECEIVER, Vec::new()).await?;
            let pool = pool(config, memory)?;
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
            use crate::transport::rdma::{bootstrap, RdmaDevice};
            let dev = Arc::new(RdmaDevice::open(device.as_deref()).map_err(rdma)?);
            let (prepared, params) = bootstrap::prepare(
                &dev,
                Role::RECEIVER,
                *queue_pairs,
                config.window,
                config.pool.buffers(),
                *busy_poll,
            )
            .map_err(rdma)?;
            let (stream, est, channel) =
                handshake(stream, config, client, Role::RECEIVER, params).await?;
            let pool = pool(config, memory)?;
            let t = prepared
                .into_receiver(&est, channel, stream, &pool, config.handshake_timeout)
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
    EngineError::Transport(e.to_string())
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
/// wire in real time, no latency), each with a pool of its own allocated from
/// `config.pool`: a node that is both the prefill and the decode side of a transfer, and the
/// in-process benchmark. Unauthenticated (nothing leaves the process).
pub fn loopback(config: &NodeConfig) -> Result<(SenderConn, ReceiverConn), EngineError> {
    use crate::transport::loopback;
    let now = std::time::Instant::now();
    let (client, server) = kvwire_proto::handshake::in_memory(
        now,
        config.hello(Role::RECEIVER),
        config.hello(Role::SENDER),
    )?;
    let source = pool(config, KvMemory::allocate(&config.pool)?)?;
    let dest = pool(config, KvMemory::allocate(&config.pool)?)?;
    let (s, r) = loopback::connect(source.clone(), dest.clone(), std::time::Duration::ZERO);
    let receiver = ReceiverConn::run(client, dest, r, config)?;
    let sender = SenderConn::run(server, source, s, config)?;
    Ok((sender, receiver))
}

/// The ways to open one end of a connection, alike for both roles: `$open` is
/// [`sender`] or [`receiver`] of this module.
macro_rules! constructors {
    ($open:path) => {
        /// Connects to the peer and runs the handshake as the client.
        pub async fn connect(
            addr: impl ToSocketAddrs,
            config: &NodeConfig,
        ) -> Result<Self, EngineError> {
            let stream = TcpStream::connect(addr).await?;
            Self::start(stream, config, true).await
        }

        /// Accepts one connection on `listener` and runs the handshake as the server.
        pub async fn accept(
            listener: &TcpListener,
            config: &NodeConfig,
        ) -> Result<Self, EngineError> {
            let (stream, _) = listener.accept().await?;
            Self::start(stream, config, false).await
        }

        /// Runs the handshake on `stream` and starts the connection's task, over a pool the
        /// engine allocates.
        pub async fn start(
            stream: TcpStream,
            config: &NodeConfig,
            client: bool,
        ) -> Result<Self, EngineError> {
            let memory = KvMemory::allocate(&config.pool)?;
            Self::start_with_memory(stream, config, client, memory).await
        }

        /// Runs the handshake on `stream` (over the transport `config.transport` names) and
        /// starts the connection's task over KV memory the caller registered
        /// ([`KvMemory::from_buffers`], or the engine's own memory with
        /// [`KvMemory::from_raw_parts`]), which must match `config.pool`.
        pub async fn start_with_memory(
            stream: TcpStream,
            config: &NodeConfig,
            client: bool,
            memory: KvMemory,
        ) -> Result<Self, EngineError> {
            $open(stream, config, client, memory).await
        }
    };
}
pub(crate) use constructors;
