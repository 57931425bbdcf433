//! The RDMA transport's opening: the node's registration on the configured device, queue
//! pairs prepared for the role, their parameters exchanged in the handshake; the role's end
//! then connects them ([`End::over_rdma`](super::End::over_rdma)).
#![cfg(feature = "rdma")]

use kvwire_proto::handshake::Established;
use kvwire_proto::wire::Role;
use tokio::net::TcpStream;

use super::super::{EngineError, Node};
use crate::config::TransportConfig;
use crate::transport::rdma::bootstrap::{self, Prepared};

/// What the handshake leaves for the role's end to connect.
pub(crate) struct Handshaken {
    /// The node's registration on the device.
    pub(crate) registration: super::super::node::rdma::Registration,
    /// The queue pairs prepared for the role.
    pub(crate) prepared: Prepared,
    /// The bootstrap stream (kept for the connection's end, and the final exchange).
    pub(crate) stream: TcpStream,
    /// The authenticated channel of the handshake.
    pub(crate) channel: kvwire_proto::auth::AuthChannel,
}

/// An RDMA setup failure, as the engine reports it.
pub(super) fn error(e: impl std::fmt::Display) -> EngineError {
    super::super::node::rdma::transport(e)
}

/// The RDMA transport's handshake on `stream` for `role`: the node's registration on the
/// configured device, queue pairs prepared for the role, their parameters exchanged.
pub(super) async fn handshake(
    stream: TcpStream,
    node: &Node,
    client: bool,
    role: Role,
) -> Result<(Established, Handshaken), EngineError> {
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
    let registration = node.rdma(device.as_deref())?;
    let (prepared, params) = bootstrap::prepare(
        &registration.device,
        role,
        *queue_pairs,
        config.window,
        config.pool.buffers(),
        *busy_poll,
        *ack_timeout,
    )
    .map_err(error)?;
    let (stream, est, channel) = super::super::handshake(
        stream,
        config,
        client,
        role,
        params,
        config.handshake_timeout,
        &mut |_| {},
    )
    .await?;
    Ok((
        est,
        Handshaken {
            registration,
            prepared,
            stream,
            channel,
        },
    ))
}
