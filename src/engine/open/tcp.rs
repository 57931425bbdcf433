//! The TCP transport's opening: its handshake (its parameters carrying the page count and,
//! with several streams, the stream count and a token) and the connection's streams.

use kvwire_proto::handshake::Established;
use kvwire_proto::wire::Role;
use tokio::net::{TcpListener, TcpStream};

use super::super::streams::{self, LaneStream};
use super::super::{EngineError, Node, SetupError};
use crate::config::SameHost;
use crate::transport::same_host::{self, HostIdentity};
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

/// What a TCP handshake settled: the peer's parameters and, when both ends offered same-host
/// pulls from the same boot (SPEC §9.3), the peer's identity.
pub(crate) struct Settled {
    /// The peer's transport parameters.
    pub(crate) peer: TcpParams,
    /// The peer's process, when both offered same-host pulls from one boot.
    pub(crate) same_host: Option<HostIdentity>,
}

/// Whether this node offers same-host pulls on `stream` (SPEC §9.3), and as whom.
fn same_host_offer(stream: &TcpStream, node: &Node) -> Result<Option<HostIdentity>, EngineError> {
    let mode = node.config().same_host;
    if mode == SameHost::Off {
        return Ok(None);
    }
    if node.pool().memory().has_device_memory() {
        return match mode {
            SameHost::Require => Err(SetupError::SameHostNeedsHostMemory.into()),
            _ => Ok(None),
        };
    }
    let local_peer = match (stream.local_addr(), stream.peer_addr()) {
        (Ok(l), Ok(p)) => same_host::looks_local(l, p),
        _ => false,
    };
    match mode {
        SameHost::Require => Ok(Some(
            HostIdentity::this_process().map_err(SetupError::from)?,
        )),
        _ if local_peer => Ok(HostIdentity::this_process().ok()),
        _ => Ok(None),
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
) -> Result<(Established, Settled, Vec<LaneStream>), EngineError> {
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
        same_host: same_host_offer(&stream, node)?,
    };
    let check: kvwire_proto::handshake::TransportCheck = if config.same_host == SameHost::Require {
        check_tcp_params_same_host
    } else {
        check_tcp_params
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
        (params.encode(), Some(check)),
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
    let same_host = params.same_host_with(&peer);
    Ok((est, Settled { peer, same_host }, lanes))
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

/// [`check_tcp_params`] for `same_host = require` (SPEC §9.3): the peer must also offer
/// same-host pulls, from this node's boot.
fn check_tcp_params_same_host(local: &[u8], peer: &[u8]) -> Result<(), String> {
    check_tcp_params(local, peer)?;
    let (local, peer) = match (TcpParams::parse(local), TcpParams::parse(peer)) {
        (Ok(l), Ok(p)) => (l, p),
        _ => return Err("transport parameters that do not parse".into()),
    };
    match (local.same_host, peer.same_host) {
        (Some(ours), Some(theirs)) => ours.same_boot(&theirs).map_err(|e| {
            format!("this node requires same-host pulls (same_host = require) and {e}")
        }),
        _ => Err(
            "this node requires same-host pulls (same_host = require) and the peer does not offer them"
                .into(),
        ),
    }
}

/// The decode's side of same-host pulls (SPEC §9.3): when both ends offered them from one
/// boot, checks that the prefill's pid holds the other end of every stream of the connection
/// and that this process may read its memory. A check that fails leaves the connection on
/// page bytes (`same_host = auto`, with one log line) or refuses it before any transfer
/// (`require`).
pub(super) fn puller(
    settled: &Settled,
    lanes: &[LaneStream],
    mode: SameHost,
) -> Result<Option<same_host::Puller>, EngineError> {
    let Some(prefill) = settled.same_host else {
        return Ok(None);
    };
    let checked = lanes
        .iter()
        .try_for_each(|(s, _, _)| {
            let (local, peer) = match (s.local_addr(), s.peer_addr()) {
                (Ok(l), Ok(p)) => (l, p),
                (Err(cause), _) | (_, Err(cause)) => {
                    return Err(same_host::SameHostError::Proc {
                        path: "the stream's addresses".into(),
                        cause,
                    })
                }
            };
            same_host::attest_peer(local, peer, prefill.pid)
        })
        .and_then(|()| {
            let p = same_host::Puller::new(prefill.pid);
            p.probe().map(|()| p)
        });
    match (checked, mode) {
        (Ok(p), _) => {
            tracing::debug!(pid = prefill.pid, "same-host pulls from the prefill");
            Ok(Some(p))
        }
        (Err(e), SameHost::Require) => Err(SetupError::from(e).into()),
        (Err(e), _) => {
            tracing::warn!(error = %e, "same-host pulls not used; page bytes travel on the stream");
            Ok(None)
        }
    }
}
