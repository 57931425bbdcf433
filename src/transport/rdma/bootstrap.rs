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

use kvwire_proto::handshake::{Established, Handshake};
use kvwire_proto::wire::Role;
use tokio::net::TcpStream;

use super::driver::{
    sender_queue_depth, DriverError, RdmaReceiver, RdmaSender, RECEIVER_QUEUE_DEPTH,
};
use super::verbs::{QpParams, RcLink, RdmaDevice, RdmaError};
use crate::engine::{EngineError, NodeConfig};
use crate::pool::{PagePool, PoolError};

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

/// HELLO transport parameters for a queue pair: `u16 kind = 1, u16 length = 28, QpParams`.
pub fn encode_params(p: &QpParams) -> Vec<u8> {
    let body = p.encode();
    let mut v = Vec::with_capacity(4 + body.len());
    v.extend_from_slice(&PARAMS_RDMA_RC.to_le_bytes());
    v.extend_from_slice(&(body.len() as u16).to_le_bytes());
    v.extend_from_slice(&body);
    v
}

/// The queue pair parameters in a HELLO's transport parameters.
pub fn decode_params(b: &[u8]) -> Result<QpParams, BootstrapError> {
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
    QpParams::decode(&b[4..]).ok_or(BootstrapError::NoRdmaParams("not 28 bytes"))
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
    /// is sent on it after the handshake, so any byte is a protocol violation and counts as
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
    link: &RcLink,
) -> Result<
    (
        Established,
        kvwire_proto::auth::Sealer,
        kvwire_proto::auth::Opener,
        TcpStream,
    ),
    BootstrapError,
> {
    stream.set_nodelay(true).map_err(EngineError::from)?;
    let client = role == Role::SENDER;
    let mut hello = config.hello(role);
    hello.transport_params = encode_params(&link.params());
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
    let est =
        crate::engine::stream::handshake(&mut stream, hs, &mut channel, config.handshake_timeout)
            .await?;
    let (sealer, opener) = channel.split();
    Ok((est, sealer, opener, stream))
}

/// The prefill side: handshake on `stream` (connected to the decode side), then its queue
/// pair connected to the peer's.
pub async fn sender(
    stream: TcpStream,
    dev: &Arc<RdmaDevice>,
    config: &NodeConfig,
) -> Result<(RdmaSender, Liveness), BootstrapError> {
    let mut link = RcLink::new(
        dev,
        sender_queue_depth(config.window, config.pool.buffers()),
    )?;
    let (est, sealer, opener, stream) = handshake(stream, config, Role::SENDER, &link).await?;
    link.connect(&decode_params(&est.peer.transport_params)?)?;
    let pool = PagePool::new(config.pool.clone(), config.scrub)?;
    let mut s = RdmaSender::with_link(
        link,
        dev,
        &est,
        pool,
        &config.engine,
        config.sender.clone(),
        config.window,
    )?;
    s.set_auth(sealer, opener);
    s.endpoint().set_digest_mode(config.digest_mode);
    Ok((s, Liveness::new(stream)?))
}

/// The decode side: handshake on an accepted `stream`, then its queue pair connected to the
/// peer's.
pub async fn receiver(
    stream: TcpStream,
    dev: &Arc<RdmaDevice>,
    config: &NodeConfig,
) -> Result<(RdmaReceiver, Liveness), BootstrapError> {
    let mut link = RcLink::new(dev, RECEIVER_QUEUE_DEPTH)?;
    let (est, sealer, opener, stream) = handshake(stream, config, Role::RECEIVER, &link).await?;
    link.connect(&decode_params(&est.peer.transport_params)?)?;
    let pool = PagePool::new(config.pool.clone(), config.scrub)?;
    let mut r = RdmaReceiver::with_link(
        link,
        Arc::clone(dev),
        &est,
        pool,
        &config.engine,
        config.receiver.clone(),
    )?;
    r.set_auth(sealer, opener);
    r.endpoint().set_digest_mode(config.digest_mode);
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
        let b = encode_params(&p);
        assert_eq!(&b[..4], &[1, 0, 28, 0]);
        assert_eq!(decode_params(&b).unwrap(), p);
        assert!(decode_params(&[]).is_err());
        assert!(decode_params(&b[..b.len() - 1]).is_err());
        let mut other = b.clone();
        other[0] = 2;
        assert!(decode_params(&other).is_err());
    }
}
