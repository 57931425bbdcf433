//! Opening a connection over the node's transport: the handshake (carrying the transport's
//! parameters), the transport over the node's memory, and the role's task.

use kvwire_proto::handshake::Established;
use kvwire_proto::wire::Role;
use tokio::net::{TcpListener, TcpStream};

use super::streams::{self, LaneStream};
use super::{handshake, EngineError, Node, ReceiverConn, SenderConn};
use crate::config::TransportConfig;
use crate::transport::tcp::{TcpParams, TcpReceiver, TcpSender, MAX_STREAMS};
use crate::transport::LaneSet;

/// A connection's TCP transports: one stream's alone (no lanes to route), or several.
enum Streams<T> {
    One(T),
    Several(Vec<T>),
}

fn one_or_several<T>(mut lanes: Vec<T>) -> Result<Streams<T>, EngineError> {
    match (lanes.len(), lanes.pop()) {
        (1, Some(t)) => Ok(Streams::One(t)),
        (_, Some(t)) => {
            lanes.push(t);
            Ok(Streams::Several(lanes))
        }
        (_, None) => Err(EngineError::Transport(
            "a connection without streams".into(),
        )),
    }
}

/// The TCP transport's handshake (its parameters carrying the page count and, with several
/// streams, the stream count and a token) and the connection's streams, lane 0 first (SPEC
/// §9.1): a server with several streams first hands a stream that joins another connection
/// to that connection; `listener`, where the connection was accepted by one, is where its
/// extra streams arrive.
async fn tcp_lanes(
    stream: TcpStream,
    node: &Node,
    client: bool,
    role: Role,
    listener: Option<&TcpListener>,
) -> Result<(Established, TcpParams, Vec<LaneStream>), EngineError> {
    let config = node.config();
    let started = std::time::Instant::now();
    let streams = config.tcp_streams.max(1);
    if streams > MAX_STREAMS {
        return Err(EngineError::Transport(format!(
            "tcp_streams = {streams}: at most {MAX_STREAMS} TCP streams per connection"
        )));
    }
    if streams > 1 && node.pool().memory().has_device_memory() {
        return Err(EngineError::Transport(
            "several TCP streams per connection move host memory only (device memory: tcp_streams = 1)"
                .into(),
        ));
    }
    let mut stream = Some(stream);
    if !client && streams > 1 {
        streams::route_join(&mut stream, node.joins(), config.handshake_timeout).await?;
    }
    let Some(stream) = stream else {
        return Err(EngineError::StreamJoined);
    };
    let token = if streams > 1 {
        crate::config::random_bytes().map_err(EngineError::Io)?
    } else {
        [0; 16]
    };
    let params = TcpParams {
        pages: node.pool().capacity_pages(),
        streams,
        token,
    };
    let left = config.handshake_timeout.saturating_sub(started.elapsed());
    // A server with several streams claims the client's token as soon as it reads the
    // client's HELLO, before it answers: the client opens its extra streams only after the
    // answer, so a join naming a token nobody claimed is never this client's (closed at once).
    let mut claim = None;
    let mut on_frame = |f: &kvwire_proto::wire::Frame| {
        if let (false, true, kvwire_proto::wire::Frame::Hello(h)) = (client, streams > 1, f) {
            if let Ok(p) = TcpParams::parse(&h.transport_params) {
                if p.streams > 1 && claim.is_none() {
                    claim = Some(node.joins().claim(p.token));
                }
            }
        }
    };
    let (stream, est, channel) = handshake(
        stream,
        config,
        client,
        role,
        params.encode(),
        left,
        &mut on_frame,
    )
    .await?;
    let peer = TcpParams::parse(&est.peer.transport_params)
        .map_err(|e| EngineError::Transport(format!("the peer's TCP transport parameters: {e}")))?;
    if peer.streams != streams {
        return Err(EngineError::Transport(format!(
            "this node runs {streams} TCP streams per connection, the peer {} (both ends must set the same tcp_streams)",
            peer.streams
        )));
    }
    // The client's token names the connection; its extra streams present it.
    let join = if client { token } else { peer.token };
    let lanes = streams::open_lanes(
        stream,
        channel,
        client,
        streams,
        join,
        claim,
        node,
        listener,
        config.handshake_timeout,
    )
    .await?;
    Ok((est, peer, lanes))
}

/// The prefill end of a connection on `stream` (client or server side of the handshake).
pub(crate) async fn sender(
    stream: TcpStream,
    node: &Node,
    client: bool,
    listener: Option<&TcpListener>,
) -> Result<SenderConn, EngineError> {
    let config = node.config();
    let pool = node.pool().clone();
    match &config.transport {
        TransportConfig::Tcp => {
            let (est, peer, lanes) =
                tcp_lanes(stream, node, client, Role::SENDER, listener).await?;
            // The receiver's page count bounds the pages a reservation may name (SPEC §9.1).
            let lanes: Vec<TcpSender> = lanes
                .into_iter()
                .map(|(s, sealer, opener)| {
                    TcpSender::new(s, sealer, opener, pool.clone())
                        .with_destination_pages(peer.pages)
                })
                .collect();
            match one_or_several(lanes)? {
                Streams::One(t) => SenderConn::run(est, node, t),
                Streams::Several(l) => SenderConn::run(
                    est,
                    node,
                    LaneSet::sender(l).with_silence_limit(config.liveness.timeout),
                ),
            }
        }
        #[cfg(feature = "rdma")]
        TransportConfig::Rdma { .. } => {
            let (reg, prepared, stream, est, channel) =
                rdma_handshake(stream, node, client, Role::SENDER).await?;
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
            SenderConn::run(est, node, t)
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
    listener: Option<&TcpListener>,
) -> Result<ReceiverConn, EngineError> {
    let config = node.config();
    let pool = node.pool().clone();
    match &config.transport {
        TransportConfig::Tcp => {
            let (est, _, lanes) = tcp_lanes(stream, node, client, Role::RECEIVER, listener).await?;
            let n = lanes.len() as u16;
            let lanes: Vec<TcpReceiver> = lanes
                .into_iter()
                .zip(0u16..)
                .map(|((s, sealer, opener), i)| {
                    TcpReceiver::new(s, sealer, opener, pool.clone()).with_lane(i, n)
                })
                .collect();
            match one_or_several(lanes)? {
                Streams::One(t) => ReceiverConn::run(est, pool, t, config),
                Streams::Several(l) => ReceiverConn::run(
                    est,
                    pool,
                    LaneSet::receiver(l).with_silence_limit(config.liveness.timeout),
                    config,
                ),
            }
        }
        #[cfg(feature = "rdma")]
        TransportConfig::Rdma { .. } => {
            let (reg, prepared, stream, est, channel) =
                rdma_handshake(stream, node, client, Role::RECEIVER).await?;
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

/// The RDMA transport's handshake on `stream` for `role`: the node's registration on the
/// configured device, queue pairs prepared for the role, their parameters exchanged.
#[cfg(feature = "rdma")]
async fn rdma_handshake(
    stream: TcpStream,
    node: &Node,
    client: bool,
    role: Role,
) -> Result<
    (
        super::node::rdma::Registration,
        crate::transport::rdma::bootstrap::Prepared,
        TcpStream,
        Established,
        kvwire_proto::auth::AuthChannel,
    ),
    EngineError,
> {
    use crate::transport::rdma::bootstrap;
    let config = node.config();
    let TransportConfig::Rdma {
        device,
        queue_pairs,
        busy_poll,
        ack_timeout,
    } = &config.transport
    else {
        // Called from the node's RDMA arm only.
        return Err(EngineError::Transport(
            "an RDMA handshake on a node whose transport is not RDMA".into(),
        ));
    };
    let reg = node.rdma(device.as_deref())?;
    let (prepared, params) = bootstrap::prepare(
        &reg.device,
        role,
        *queue_pairs,
        config.window,
        config.pool.buffers(),
        *busy_poll,
        *ack_timeout,
    )
    .map_err(rdma)?;
    let (stream, est, channel) = handshake(
        stream,
        config,
        client,
        role,
        params,
        config.handshake_timeout,
        &mut |_| {},
    )
    .await?;
    Ok((reg, prepared, stream, est, channel))
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
    let sender = SenderConn::run(server, prefill, s)?;
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
