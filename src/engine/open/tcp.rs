//! The TCP transport's opening: its handshake (its parameters carrying the page count and,
//! with several streams, the stream count and a token) and the connection's streams.

use kvwire_proto::handshake::Established;
use kvwire_proto::wire::Role;
use tokio::net::{TcpListener, TcpStream};

use super::super::streams::{self, LaneStream};
use super::super::{EngineError, Node, SetupError};
use crate::transport::tcp::{TcpParams, MAX_STREAMS};

/// A connection's TCP transports: one stream's alone (no lanes to route), or several.
pub(super) enum Streams<T> {
    One(T),
    Several(Vec<T>),
}

pub(super) fn one_or_several<T>(mut lanes: Vec<T>) -> Result<Streams<T>, EngineError> {
    match (lanes.len(), lanes.pop()) {
        (1, Some(t)) => Ok(Streams::One(t)),
        (_, Some(t)) => {
            lanes.push(t);
            Ok(Streams::Several(lanes))
        }
        (_, None) => Err(SetupError::StreamMissing.into()),
    }
}

/// The TCP transport's handshake (its parameters carrying the page count and, with several
/// streams, the stream count and a token) and the connection's streams, lane 0 first (SPEC
/// §9.1): a server with several streams first hands a stream that joins another connection
/// to that connection; `listener`, where the connection was accepted by one, is where its
/// extra streams arrive.
pub(super) async fn handshake(
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
        return Err(SetupError::TooManyStreams {
            asked: streams,
            max: MAX_STREAMS,
        }
        .into());
    }
    if streams > 1 && node.pool().memory().has_device_memory() {
        return Err(SetupError::StreamsNeedHostMemory.into());
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
    let (stream, est, channel) = super::super::handshake(
        stream,
        config,
        client,
        role,
        (params.encode(), Some(check_tcp_params)),
        left,
        &mut on_frame,
    )
    .await?;
    let peer = TcpParams::parse(&est.peer.transport_params).map_err(SetupError::PeerParams)?;
    if peer.streams != streams {
        return Err(SetupError::StreamCount {
            ours: streams,
            peer: peer.streams,
        }
        .into());
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

/// The handshake's check of the peer's TCP transport parameters (SPEC §4.3 #7, §9.1): of the
/// TCP kind, well formed, and naming this node's stream count; a peer that fails it is told
/// why in HELLO_REJECT(TRANSPORT_MISMATCH) instead of a bare close after the handshake.
fn check_tcp_params(local: &[u8], peer: &[u8]) -> Result<(), String> {
    let peer = TcpParams::parse(peer).map_err(|e| format!("the peer's {e}"))?;
    let local = TcpParams::parse(local).map_err(|e| format!("this node's {e}"))?;
    if peer.streams != local.streams {
        return Err(format!(
            "TCP streams: this node runs {}, the peer {}",
            local.streams, peer.streams
        ));
    }
    Ok(())
}
