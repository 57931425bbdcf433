//! Two processes over RDMA: the TCP bootstrap (SPEC.md §9.2).
//!
//! The prefill side connects over TCP and both sides run the ordinary handshake (with
//! authentication when configured); each HELLO's transport parameters carry its queue pair
//! ([`QpParams`]: QPN, PSN, GID, MTU), so the queue pairs are connected only to a peer that
//! completed the handshake. After it every control frame is a SEND on the queue pair, sealed
//! with the connection's channel. The TCP connection stays open as the liveness channel
//! ([`Liveness`]): when the peer's process dies, its kernel closes the socket, and the
//! survivor fences and frees everything of that connection at once instead of waiting for
//! timeouts.

use std::io::Read;
use std::sync::Arc;
use std::time::Instant;

use kvwire_proto::auth::AuthChannel;
use kvwire_proto::handshake::{Established, Handshake};
use kvwire_proto::wire::Role;
use tokio::net::TcpStream;

use super::driver::{
    sender_queue_depth, DriverError, RdmaReceiver, RdmaSender, RECEIVER_QUEUE_DEPTH,
};
use super::verbs::{QpParams, RcLink, RdmaDevice, RdmaError};
use crate::engine::{EngineError, NodeConfig};
use crate::memory::{PagePool, PoolError};

/// Transport-parameter kind of an RDMA RC queue pair in HELLO.
pub const PARAMS_RDMA_RC: u16 = 1;

/// Why a bootstrap failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// The TCP connection or the handshake failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A verbs call failed.
    #[error(transparent)]
    Rdma(#[from] RdmaError),
    /// The driver refused to start.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The pool could not be built.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The peer's HELLO carries no (valid) RDMA queue pair parameters.
    #[error("the peer's HELLO carries no RDMA RC queue pair parameters ({0})")]
    NoRdmaParams(&'static str),
}

/// HELLO transport parameters for a connection's queue pairs, lane 0 first:
/// `u16 kind = 1, u16 length = 28 x n, n x QpParams`.
pub fn encode_params(lanes: &[QpParams]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + 28 * lanes.len());
    v.extend_from_slice(&PARAMS_RDMA_RC.to_le_bytes());
    v.extend_from_slice(&((28 * lanes.len()) as u16).to_le_bytes());
    for p in lanes {
        v.extend_from_slice(&p.encode());
    }
    v
}

/// The queue pairs' parameters in a HELLO's transport parameters, lane 0 first.
pub fn decode_params(b: &[u8]) -> Result<Vec<QpParams>, BootstrapError> {
    if b.len() < 4 {
        return Err(BootstrapError::NoRdmaParams("shorter than its header"));
    }
    if u16::from_le_bytes([b[0], b[1]]) != PARAMS_RDMA_RC {
        return Err(BootstrapError::NoRdmaParams("another transport's kind"));
    }
    let len = usize::from(u16::from_le_bytes([b[2], b[3]]));
    if b.len() != 4 + len {
        return Err(BootstrapError::NoRdmaParams("length disagrees"));
    }
    if len == 0 || len % 28 != 0 {
        return Err(BootstrapError::NoRdmaParams(
            "not a whole number of 28-byte records",
        ));
    }
    b[4..]
        .chunks(28)
        .map(|c| QpParams::decode(c).ok_or(BootstrapError::NoRdmaParams("not 28 bytes")))
        .collect()
}

/// The bootstrap TCP connection, kept open after the handshake to learn that the peer died.
#[derive(Debug)]
pub struct Liveness {
    stream: std::net::TcpStream,
}

impl Liveness {
    fn new(stream: TcpStream) -> Result<Self, BootstrapError> {
        let stream = stream.into_std().map_err(EngineError::from)?;
        stream.set_nonblocking(true).map_err(EngineError::from)?;
        Ok(Self { stream })
    }

    /// Whether the peer closed the connection (or its process died). Never blocks. Nothing
    /// is sent on it after the ready byte, so any byte is a protocol violation and counts as
    /// the peer being gone too.
    pub fn peer_gone(&mut self) -> bool {
        let mut b = [0u8; 16];
        match self.stream.read(&mut b) {
            Ok(0) => true,
            Ok(_) => {
                tracing::error!("bytes on the RDMA bootstrap connection after the handshake");
                true
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => false,
            Err(_) => true,
        }
    }
}

async fn handshake(
    mut stream: TcpStream,
    config: &NodeConfig,
    role: Role,
    links: &[RcLink],
) -> Result<(Established, AuthChannel, TcpStream), BootstrapError> {
    stream.set_nodelay(true).map_err(EngineError::from)?;
    let client = role == Role::SENDER;
    let mut hello = config.hello(role);
    let params: Vec<QpParams> = links.iter().map(RcLink::params).collect();
    hello.transport_params = encode_params(&params);
    let now = Instant::now();
    let mut hs = if client {
        Handshake::client(now, hello, config.handshake_timeout)
    } else {
        Handshake::server(now, hello, config.handshake_timeout)
    };
    let mut channel = config.auth.channel(client).map_err(EngineError::from)?;
    if channel.is_authenticated() {
        hs = hs.with_confirmation();
    }
    let est = crate::transport::stream::handshake(
        &mut stream,
        hs,
        &mut channel,
        config.handshake_timeout,
    )
    .await
    .map_err(EngineError::from)?;
    Ok((est, channel, stream))
}

/// The readiness barrier: this side's queue pairs are connected (RTR, RTS); say so with one
/// byte `R` and wait for the peer's. Without it a SEND can reach a peer queue pair that is
/// not yet ready to receive, and the sender's queue pair fails after its retries (seen on rxe
/// when one side registers its memory more slowly than the other).
async fn ready(mut stream: TcpStream, config: &NodeConfig) -> Result<TcpStream, BootstrapError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let barrier = async {
        stream.write_all(&[READY]).await?;
        stream.flush().await?;
        let mut b = [0u8; 1];
        stream.read_exact(&mut b).await?;
        Ok::<u8, std::io::Error>(b[0])
    };
    match tokio::time::timeout(config.handshake_timeout, barrier).await {
        Ok(Ok(READY)) => Ok(stream),
        Ok(Ok(_)) => Err(BootstrapError::NoRdmaParams(
            "the peer sent something else than READY",
        )),
        Ok(Err(e)) => Err(EngineError::from(e).into()),
        Err(_) => Err(EngineError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the peer's queue pairs did not become ready",
        ))
        .into()),
    }
}

/// The readiness byte (SPEC.md §9.2).
pub const READY: u8 = b'R';

/// The prefill side: handshake on `stream` (connected to the decode side), then its
/// `config.rdma_queue_pairs` queue pairs connected to the peer's.
pub async fn sender(
    stream: TcpStream,
    dev: &Arc<RdmaDevice>,
    config: &NodeConfig,
) -> Result<(RdmaSender, Liveness), BootstrapError> {
    let depth = sender_queue_depth(config.window, config.pool.buffers());
    let links = (0..config.rdma_queue_pairs.max(1))
        .map(|_| RcLink::new(dev, depth))
        .collect::<Result<Vec<_>, _>>()?;
    let (est, channel, stream) = handshake(stream, config, Role::SENDER, &links).await?;
    let peer = decode_params(&est.peer.transport_params)?;
    let pool = PagePool::new(config.pool.clone(), config.scrub)?;
    let mut s = RdmaSender::with_links(
        links,
        dev,
        &est,
        pool,
        &config.engine,
        config.sender.clone(),
        config.window,
    )?;
    s.connect(&peer)?;
    s.set_auth(channel);
    s.endpoint().set_digest_mode(config.digest_mode);
    let stream = ready(stream, config).await?;
    Ok((s, Liveness::new(stream)?))
}

/// The decode side: handshake on an accepted `stream`, then its `config.rdma_queue_pairs`
/// queue pairs connected to the peer's.
pub async fn receiver(
    stream: TcpStream,
    dev: &Arc<RdmaDevice>,
    config: &NodeConfig,
) -> Result<(RdmaReceiver, Liveness), BootstrapError> {
    let links = (0..config.rdma_queue_pairs.max(1))
        .map(|_| RcLink::new(dev, RECEIVER_QUEUE_DEPTH))
        .collect::<Result<Vec<_>, _>>()?;
    let (est, channel, stream) = handshake(stream, config, Role::RECEIVER, &links).await?;
    let peer = decode_params(&est.peer.transport_params)?;
    let pool = PagePool::new(config.pool.clone(), config.scrub)?;
    let mut r = RdmaReceiver::with_links(
        links,
        Arc::clone(dev),
        &est,
        pool,
        &config.engine,
        config.receiver.clone(),
    )?;
    r.connect(&peer)?;
    r.set_auth(channel);
    r.endpoint().set_digest_mode(config.digest_mode);
    let stream = ready(stream, config).await?;
    Ok((r, Liveness::new(stream)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_params_round_trip_and_refuse_malformed() {
        let p = QpParams {
            qpn: 17,
            psn: 99,
            gid: [3; 16],
            mtu: 1024,
        };
        let b = encode_params(&[p]);
        assert_eq!(&b[..4], &[1, 0, 28, 0]);
        assert_eq!(decode_params(&b).unwrap(), vec![p]);
        let two = encode_params(&[p, QpParams { qpn: 18, ..p }]);
        assert_eq!(&two[..4], &[1, 0, 56, 0]);
        assert_eq!(decode_params(&two).unwrap().len(), 2);
        assert!(
            decode_params(&[1, 0, 0, 0]).is_err(),
            "no queue pair at all"
        );
        assert!(decode_params(&[]).is_err());
        assert!(decode_params(&b[..b.len() - 1]).is_err());
        let mut other = b.clone();
        other[0] = 2;
        assert!(decode_params(&other).is_err());
    }
}
