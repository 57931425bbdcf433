//! The RDMA transport's opening: the node's registration on each configured device (one per
//! rail), queue pairs prepared for the role over the rails, their parameters exchanged in the
//! handshake; the role's end then connects them ([`End::over_rdma`](super::End::over_rdma)).
#![cfg(feature = "rdma")]

use kvwire_proto::handshake::Established;
use kvwire_proto::wire::Role;
use tokio::net::TcpStream;

use super::super::{EngineError, Node};
use crate::transport::rdma::bootstrap::{self, Prepared};

/// The node's RDMA settings (its `TransportConfig::Rdma`).
pub(super) struct Settings<'a> {
    /// The devices, one per rail (empty: the first device).
    pub(super) devices: &'a [String],
    pub(super) queue_pairs: u16,
    pub(super) busy_poll: bool,
    pub(super) ack_timeout: u8,
}

/// What the handshake leaves for the role's end to connect.
pub(crate) struct Handshaken {
    /// The node's registration on each rail's device, in rail order.
    pub(crate) registrations: Vec<super::super::node::rdma::Registration>,
    /// The queue pairs prepared for the role.
    pub(crate) prepared: Prepared,
    /// The bootstrap stream (kept for the connection's end, and the final exchange).
    pub(crate) stream: TcpStream,
    /// The authenticated channel of the handshake.
    pub(crate) channel: kvwire_proto::auth::AuthChannel,
}

impl Handshaken {
    /// The node's memory as each rail's device registered it, in rail order.
    pub(crate) fn memories(&self) -> Vec<std::sync::Arc<crate::transport::rdma::RegisteredMemory>> {
        self.registrations
            .iter()
            .map(|r| r.memory.clone())
            .collect()
    }
}

/// An RDMA setup failure, as the engine reports it.
pub(super) fn error(e: impl Into<bootstrap::BootstrapError>) -> EngineError {
    super::super::node::rdma::transport(e)
}

/// The RDMA transport's handshake on `stream` for `role`: the node's registration on the
/// configured devices, queue pairs prepared for the role over them, their parameters
/// exchanged.
pub(super) async fn handshake(
    stream: TcpStream,
    node: &Node,
    client: bool,
    role: Role,
    settings: Settings<'_>,
) -> Result<(Established, Handshaken), EngineError> {
    let config = node.config();
    let Settings {
        devices,
        queue_pairs,
        busy_poll,
        ack_timeout,
    } = settings;
    let registrations = if devices.is_empty() {
        vec![node.rdma(None)?]
    } else {
        devices
            .iter()
            .map(|d| node.rdma(Some(d)))
            .collect::<Result<Vec<_>, _>>()?
    };
    let devs: Vec<_> = registrations.iter().map(|r| r.device.clone()).collect();
    let (prepared, params) = bootstrap::prepare(
        &devs,
        role,
        queue_pairs,
        config.window,
        config.pool.buffers(),
        busy_poll,
        ack_timeout,
    )
    .map_err(error)?;
    let (stream, est, channel) = super::super::handshake(
        stream,
        config,
        client,
        role,
        // RDMA validates its queue-pair records while it builds the queue pairs, after the
        // handshake (SPEC §9.2).
        (params, None),
        config.handshake_timeout,
        &mut |_| {},
    )
    .await?;
    Ok((
        est,
        Handshaken {
            registrations,
            prepared,
            stream,
            channel,
        },
    ))
}
