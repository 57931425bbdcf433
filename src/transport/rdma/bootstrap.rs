//! Two processes over RDMA: the TCP bootstrap (SPEC.md §9.2).
//!
//! The two nodes meet over TCP and run the ordinary handshake (with authentication when
//! configured); each HELLO's transport parameters carry its queue pairs ([`QpParams`]: QPN,
//! PSN, GID, MTU), so the queue pairs are connected only to a peer that completed the
//! handshake. After it every control frame is a SEND on a queue pair, sealed with that lane
//! of the connection's channel. The TCP connection stays open as the liveness channel: when
//! the peer's process dies its kernel closes the socket, and the survivor fences and frees
//! everything of that connection at once instead of waiting for timeouts.
//!
//! The engine runs the handshake itself between [`prepare`] and
//! [`Prepared::into_sender`] / [`Prepared::into_receiver`].

use std::sync::Arc;
use std::time::Duration;

use kvwire_proto::auth::AuthChannel;
use kvwire_proto::handshake::Established;
use kvwire_proto::wire::Role;
use tokio::net::TcpStream;

use super::lanes::Lanes;
use super::link::{QpParams, RcLink};
use super::receiver::{RdmaReceiver, RECEIVER_QUEUE_DEPTH};
use super::sender::{sender_queue_depth, RdmaSender};
use super::verbs::{PortPath, RdmaDevice, RdmaError, RegisteredMemory};
use super::QP_PARAMS_LEN;
use crate::memory::PagePool;

/// Transport-parameter kind of an RDMA RC queue pair in HELLO.
pub const PARAMS_RDMA_RC: u16 = 1;

/// Why a bootstrap failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// The bootstrap connection failed.
    #[error("bootstrap connection: {0}")]
    Io(#[from] std::io::Error),
    /// A verbs call failed.
    #[error(transparent)]
    Rdma(#[from] RdmaError),
    /// The peer's HELLO carries no (valid) RDMA queue pair parameters.
    #[error("the peer's HELLO carries no RDMA RC queue pair parameters ({0})")]
    NoRdmaParams(&'static str),
}

/// HELLO transport parameters for a connection's queue pairs, lane 0 first:
/// `u16 kind = 1, u16 length = 28 x n, n x QpParams`.
pub fn encode_params(lanes: &[QpParams]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + QP_PARAMS_LEN * lanes.len());
    v.extend_from_slice(&PARAMS_RDMA_RC.to_le_bytes());
    v.extend_from_slice(&((QP_PARAMS_LEN * lanes.len()) as u16).to_le_bytes());
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
    if len == 0 || len % QP_PARAMS_LEN != 0 {
        return Err(BootstrapError::NoRdmaParams(
            "not a whole number of 28-byte records",
        ));
    }
    b[4..]
        .chunks(QP_PARAMS_LEN)
        .map(|c| QpParams::decode(c).ok_or(BootstrapError::NoRdmaParams("not 28 bytes")))
        .collect()
}

/// The queue pairs of a connection being set up: made before the handshake (their parameters
/// travel in HELLO), connected after it.
pub struct Prepared {
    lanes: Lanes,
    devs: Vec<Arc<RdmaDevice>>,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("lanes", &self.lanes.lanes.len())
            .finish_non_exhaustive()
    }
}

/// Before the handshake: `queue_pairs` RC queue pairs (in INIT) for the `role` end of a
/// connection (a sender's sized for `window` pages of `buffers` buffers in flight), lane `i`
/// on rail `i % devs.len()` (the node's devices in the order it names them: several devices
/// are several rails), and the HELLO transport parameters that describe them (each queue
/// pair with its own device's GID). Their completions go to one completion channel per
/// device, registered with the current tokio runtime, unless `busy_poll`; they connect with
/// the local ACK timeout exponent `ack_timeout` (`TransportConfig::Rdma::ack_timeout`).
pub fn prepare(
    devs: &[Arc<RdmaDevice>],
    role: Role,
    queue_pairs: u16,
    window: u32,
    buffers: usize,
    busy_poll: bool,
    ack_timeout: u8,
) -> Result<(Prepared, Vec<u8>), BootstrapError> {
    if devs.is_empty() {
        return Err(RdmaError::NoDevice(" (no device named for the connection)".into()).into());
    }
    let depth = if role == Role::SENDER {
        sender_queue_depth(window, buffers)
    } else {
        RECEIVER_QUEUE_DEPTH
    };
    let events = if busy_poll {
        Vec::new()
    } else {
        devs.iter()
            .map(|d| d.event_channel())
            .collect::<Result<Vec<_>, _>>()?
    };
    // Each rail as a connection opened now sees it: a rail whose port is down gets lanes
    // that are left out of this connection (SPEC §9.2, "A rail down when the connection
    // opens"), if another rail carries at least one lane.
    let lanes_n = usize::from(queue_pairs.max(1));
    let mut paths: Vec<Result<PortPath, RdmaError>> = devs.iter().map(|d| d.port_path()).collect();
    if (0..lanes_n).all(|i| paths[i % devs.len()].is_err()) {
        // No lane would be left: the first rail's reason.
        if let Err(e) = paths.swap_remove(0) {
            return Err(e.into());
        }
    }
    let links = (0..lanes_n)
        .map(|i| {
            let rail = i % devs.len();
            let path = paths[rail]
                .as_ref()
                .copied()
                .unwrap_or_else(|_| PortPath::down());
            let mut link = RcLink::on_path(&devs[rail], &path, depth, events.get(rail))?;
            link.set_ack_timeout(ack_timeout)?;
            Ok::<_, RdmaError>((link, rail))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut lanes = Lanes::new(links, events);
    for i in 0..lanes_n {
        let rail = i % devs.len();
        if let Err(e) = &paths[rail] {
            lanes.leave_out(
                i,
                &format!("rail {rail} ({}) is down here: {e}", devs[rail].name),
            );
        }
    }
    let params = encode_params(&lanes.params());
    Ok((
        Prepared {
            lanes,
            devs: devs.to_vec(),
        },
        params,
    ))
}

impl Prepared {
    /// After the handshake: connects each queue pair to the peer's (from the peer's HELLO
    /// transport parameters), authenticates each lane with the connection's `channel`, and
    /// passes the readiness barrier on `stream`, which then stays open as the liveness
    /// channel.
    async fn connect(
        mut self,
        peer_params: &[u8],
        channel: AuthChannel,
        mut stream: TcpStream,
        timeout: Duration,
    ) -> Result<(Lanes, Vec<Arc<RdmaDevice>>), BootstrapError> {
        let peer = decode_params(peer_params)?;
        self.lanes.connect(&peer)?;
        self.lanes.set_auth(channel);
        ready(&mut stream, timeout).await?;
        self.lanes.watch(stream);
        Ok((self.lanes, self.devs))
    }

    /// Finishes the prefill end, writing out of `pool`, whose memory `regs` registered on
    /// each device, in the order of the devices given to [`prepare`] (one registration per
    /// device serves every connection of a node).
    #[allow(clippy::too_many_arguments)]
    pub async fn into_sender(
        self,
        est: &Established,
        channel: AuthChannel,
        stream: TcpStream,
        pool: &Arc<PagePool>,
        regs: Vec<Arc<RegisteredMemory>>,
        window: u32,
        timeout: Duration,
    ) -> Result<RdmaSender, BootstrapError> {
        let page_bytes = pool.geometry().buffer_page_bytes.clone();
        let (lanes, _) = self
            .connect(&est.peer.transport_params, channel, stream, timeout)
            .await?;
        Ok(RdmaSender::new(lanes, regs, page_bytes, window))
    }

    /// Finishes the decode end, landing in `pool`, whose memory `regs` registered on each
    /// device, in the order of the devices given to [`prepare`] (one registration per device
    /// serves every connection of a node).
    pub async fn into_receiver(
        self,
        est: &Established,
        channel: AuthChannel,
        stream: TcpStream,
        pool: &Arc<PagePool>,
        regs: Vec<Arc<RegisteredMemory>>,
        timeout: Duration,
    ) -> Result<RdmaReceiver, BootstrapError> {
        let (lanes, devs) = self
            .connect(&est.peer.transport_params, channel, stream, timeout)
            .await?;
        Ok(RdmaReceiver::new(lanes, devs, regs, pool.clone()))
    }
}

/// Both ends of one connection in this process, on one device (what `ib_write_bw` does with
/// a server and a client on one host): the sender writes from `source` into `dest` over
/// `queue_pairs` queue pairs connected to each other directly, with no bootstrap connection
/// (so no liveness channel), prepared as a connection's are ([`prepare`], with the local ACK
/// timeout exponent `ack_timeout`). Frames are unauthenticated (nothing leaves the host).
/// Needs a tokio runtime unless `busy_poll`.
pub fn in_process(
    dev: &Arc<RdmaDevice>,
    source: &Arc<PagePool>,
    dest: &Arc<PagePool>,
    queue_pairs: u16,
    window: u32,
    busy_poll: bool,
    ack_timeout: u8,
) -> Result<(RdmaSender, RdmaReceiver), BootstrapError> {
    let buffers = source.buffers();
    let end = |role| {
        prepare(
            std::slice::from_ref(dev),
            role,
            queue_pairs,
            window,
            buffers,
            busy_poll,
            ack_timeout,
        )
    };
    let ((s, _), (r, _)) = (end(Role::SENDER)?, end(Role::RECEIVER)?);
    let (mut s_lanes, mut r_lanes) = (s.lanes, r.lanes);
    let (sp, rp) = (s_lanes.params(), r_lanes.params());
    s_lanes.connect(&rp)?;
    r_lanes.connect(&sp)?;
    let s_reg = Arc::new(dev.register(source.memory())?);
    let r_reg = Arc::new(dev.register(dest.memory())?);
    Ok((
        RdmaSender::new(
            s_lanes,
            vec![s_reg],
            source.geometry().buffer_page_bytes.clone(),
            window,
        ),
        RdmaReceiver::new(r_lanes, vec![dev.clone()], vec![r_reg], dest.clone()),
    ))
}

/// The readiness barrier: this side's queue pairs are connected (RTR, RTS); say so with one
/// byte `R` and wait for the peer's. Without it a SEND can reach a peer queue pair that is
/// not yet ready to receive, and the sender's queue pair fails after its retries (seen on rxe
/// when one side registers its memory more slowly than the other).
async fn ready(stream: &mut TcpStream, timeout: Duration) -> Result<(), BootstrapError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let barrier = async {
        stream.write_all(&[READY]).await?;
        stream.flush().await?;
        let mut b = [0u8; 1];
        stream.read_exact(&mut b).await?;
        Ok::<u8, std::io::Error>(b[0])
    };
    match tokio::time::timeout(timeout, barrier).await {
        Ok(Ok(READY)) => Ok(()),
        Ok(Ok(_)) => Err(BootstrapError::NoRdmaParams(
            "the peer sent something else than READY",
        )),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the peer's queue pairs did not become ready",
        )
        .into()),
    }
}

/// The readiness byte (SPEC.md §9.2).
pub const READY: u8 = b'R';

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
        // A lane whose rail is down (SPEC §9.2): 28 zero bytes, decoded as down; a real
        // record is never taken for one.
        let down = encode_params(&[p, QpParams::DOWN]);
        assert_eq!(&down[4 + 28..], &[0u8; 28]);
        let back = decode_params(&down).unwrap();
        assert_eq!(back, vec![p, QpParams::DOWN]);
        assert!(!back[0].is_down() && back[1].is_down());
        assert!(
            decode_params(&[1, 0, 0, 0]).is_err(),
            "no queue pair at all"
        );
        assert!(decode_params(&[]).is_err());
        assert!(decode_params(&b[..b.len() - 1]).is_err());
        let mut other = b.clone();
        other[0] = 2;
        assert!(decode_params(&other).is_err());
        // The most queue pairs a config allows fit a HELLO's transport parameters; one more
        // does not (config::MAX_QUEUE_PAIRS refuses it before any connection).
        let most = vec![p; usize::from(super::super::MAX_QUEUE_PAIRS)];
        let b = encode_params(&most);
        assert!(b.len() <= kvwire_proto::wire::MAX_TRANSPORT_PARAMS);
        assert_eq!(decode_params(&b).unwrap().len(), most.len());
        assert!(
            encode_params(&[most.as_slice(), &[p]].concat()).len()
                > kvwire_proto::wire::MAX_TRANSPORT_PARAMS
        );
    }
}
