//! Opening a connection over the node's transport: the handshake (carrying the transport's
//! parameters), the transport over the node's memory, and the role's task.
//!
//! Each transport is one module here (`tcp`, `rdma`) that runs its handshake and builds its
//! transports for either role through [`End`], and one arm of [`open`]: the role's own part
//! (which transport type, which task) is in `End`'s two implementations, once.

mod rdma;
mod tcp;

#[cfg(feature = "rdma")]
use std::future::Future;

use kvwire_proto::handshake::Established;
use kvwire_proto::wire::Role;
use tokio::net::{TcpListener, TcpStream};

use super::streams::LaneStream;
use super::{EngineError, Node, ReceiverConn, SenderConn, SetupError};
use crate::config::TransportConfig;
use crate::transport::tcp::{TcpReceiver, TcpSender};
use crate::transport::LaneSet;

/// One role's end of a connection, as each transport builds it.
pub(crate) trait End: Sized + Send + 'static {
    /// The role this end plays in the handshake.
    const ROLE: Role;

    /// Over TCP: the connection's streams, lane 0 first (one: no lanes to route).
    fn over_tcp(
        est: Established,
        settled: &tcp::Settled,
        lanes: Vec<LaneStream>,
        node: &Node,
    ) -> Result<Self, EngineError>;

    /// Over RDMA: the queue pairs prepared for this role, connected to the peer's.
    #[cfg(feature = "rdma")]
    fn over_rdma(
        est: Established,
        link: rdma::Handshaken,
        node: &Node,
    ) -> impl Future<Output = Result<Self, EngineError>> + Send;
}

impl End for SenderConn {
    const ROLE: Role = Role::SENDER;

    fn over_tcp(
        est: Established,
        settled: &tcp::Settled,
        lanes: Vec<LaneStream>,
        node: &Node,
    ) -> Result<Self, EngineError> {
        let pool = node.pool();
        // The receiver's page count bounds the pages a reservation may name (SPEC §9.1).
        let lanes: Vec<TcpSender> = lanes
            .into_iter()
            .map(|(s, sealer, opener)| {
                let t = TcpSender::new(s, sealer, opener, pool.clone())
                    .with_destination_pages(settled.peer.pages);
                // Both offered same-host pulls: the decode may ask for them (SPEC §9.3).
                if settled.same_host.is_some() {
                    t.with_pulls()
                } else {
                    t
                }
            })
            .collect();
        match tcp::one_or_several(lanes)? {
            tcp::Streams::One(t) => SenderConn::run(est, node, t),
            tcp::Streams::Several(l) => SenderConn::run(
                est,
                node,
                LaneSet::sender(l).with_silence_limit(node.config().liveness.timeout),
            ),
        }
    }

    #[cfg(feature = "rdma")]
    async fn over_rdma(
        est: Established,
        link: rdma::Handshaken,
        node: &Node,
    ) -> Result<Self, EngineError> {
        let config = node.config();
        let memories = link.memories();
        let t = link
            .prepared
            .into_sender(
                &est,
                link.channel,
                link.stream,
                node.pool(),
                memories,
                config.window,
                config.handshake_timeout,
            )
            .await
            .map_err(rdma::error)?;
        let mut t = t;
        t.set_lane_timeout(config.liveness.timeout / 2);
        SenderConn::run(est, node, t)
    }
}

impl End for ReceiverConn {
    const ROLE: Role = Role::RECEIVER;

    fn over_tcp(
        est: Established,
        settled: &tcp::Settled,
        lanes: Vec<LaneStream>,
        node: &Node,
    ) -> Result<Self, EngineError> {
        let (pool, config) = (node.pool(), node.config());
        let n = lanes.len() as u16;
        let puller = tcp::puller(settled, &lanes, config.same_host)?;
        let threads = puller.and_then(|_| node.pull_threads());
        let lanes: Vec<TcpReceiver> = lanes
            .into_iter()
            .zip(0u16..)
            .map(|((s, sealer, opener), i)| {
                let t = TcpReceiver::new(s, sealer, opener, pool.clone()).with_lane(i, n);
                match (puller, &threads) {
                    (Some(p), Some(threads)) => t.with_pulls(p).with_pull_threads(threads.clone()),
                    (Some(p), None) => t.with_pulls(p),
                    (None, _) => t,
                }
            })
            .collect();
        match tcp::one_or_several(lanes)? {
            tcp::Streams::One(t) => ReceiverConn::run(est, pool.clone(), t, config),
            tcp::Streams::Several(l) => ReceiverConn::run(
                est,
                pool.clone(),
                LaneSet::receiver(l).with_silence_limit(config.liveness.timeout),
                config,
            ),
        }
    }

    #[cfg(feature = "rdma")]
    async fn over_rdma(
        est: Established,
        link: rdma::Handshaken,
        node: &Node,
    ) -> Result<Self, EngineError> {
        let config = node.config();
        let memories = link.memories();
        let t = link
            .prepared
            .into_receiver(
                &est,
                link.channel,
                link.stream,
                node.pool(),
                memories,
                config.handshake_timeout,
            )
            .await
            .map_err(rdma::error)?;
        let mut t = t;
        t.set_lane_timeout(config.liveness.timeout / 2);
        t.set_heartbeat_interval(config.liveness.interval);
        if let TransportConfig::Rdma {
            stripe_pages,
            rail_affinity,
            ..
        } = config.transport
        {
            t.set_stripe_pages(stripe_pages);
            t.set_rail_affinity(rail_affinity);
        }
        ReceiverConn::run(est, node.pool().clone(), t, config)
    }
}

/// `E`'s end of a connection on `stream` (client or server side of the handshake), over the
/// transport `node`'s configuration names; `listener`, where the connection was accepted by
/// one, is where a TCP connection's extra streams arrive.
pub(crate) async fn open<E: End>(
    stream: TcpStream,
    node: &Node,
    client: bool,
    listener: Option<&TcpListener>,
) -> Result<E, EngineError> {
    match &node.config().transport {
        TransportConfig::Tcp => {
            let (est, settled, lanes) =
                tcp::handshake(stream, node, client, E::ROLE, listener).await?;
            E::over_tcp(est, &settled, lanes, node)
        }
        #[cfg(feature = "rdma")]
        TransportConfig::Rdma {
            devices,
            queue_pairs,
            busy_poll,
            ack_timeout,
            ..
        } => {
            let settings = rdma::Settings {
                devices,
                queue_pairs: *queue_pairs,
                busy_poll: *busy_poll,
                ack_timeout: *ack_timeout,
            };
            let (est, link) = rdma::handshake(stream, node, client, E::ROLE, settings).await?;
            E::over_rdma(est, link, node).await
        }
        #[allow(unreachable_patterns)]
        other => Err(unsupported(other)),
    }
}

#[allow(dead_code)]
fn unsupported(t: &TransportConfig) -> EngineError {
    SetupError::NotBuilt(t.name()).into()
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
        return Err(SetupError::LoopbackSameNode.into());
    }
    if source.memory().has_device_memory() || dest.memory().has_device_memory() {
        // The in-process wire copies page bytes with the CPU; device memory goes over TCP
        // (its staging pipeline), docs/GPU.md.
        return Err(SetupError::LoopbackDeviceMemory.into());
    }
    let (s, r) = loopback::connect(source.clone(), dest.clone(), std::time::Duration::ZERO);
    let receiver = ReceiverConn::run(client, dest, r, decode.config())?;
    let sender = SenderConn::run(server, prefill, s)?;
    Ok((sender, receiver))
}

/// The ways to open one end of a connection, alike for both roles (`$open`: [`open`] for
/// the role).
macro_rules! constructors {
    ($open:path) => {
        /// Connects to the peer and runs the handshake as the client, over `node`'s memory
        /// and transport.
        pub async fn connect(addr: impl ToSocketAddrs, node: &Node) -> Result<Self, EngineError> {
            let stream = TcpStream::connect(addr).await?;
            Self::start(stream, node, true).await
        }

        /// Accepts one connection on `listener` and runs the handshake as the server, over
        /// `node`'s memory and transport. With several TCP streams per connection
        /// (`NodeConfig::tcp_streams`) the connection's other streams arrive on `listener`
        /// too, and other connections arriving on it meanwhile are closed: serve several
        /// peers with a [`Listener`](crate::engine::Listener).
        pub async fn accept(listener: &TcpListener, node: &Node) -> Result<Self, EngineError> {
            loop {
                let (stream, _) = listener.accept().await?;
                match $open(stream, node, false, Some(listener)).await {
                    // A stream of another connection (handed to it): wait for ours.
                    Err(EngineError::StreamJoined) => continue,
                    r => return r,
                }
            }
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
            $open(stream, node, client, None).await
        }
    };
}
pub(crate) use constructors;
