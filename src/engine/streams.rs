//! A connection over several TCP streams (SPEC §9.1, several streams; `NodeConfig::tcp_streams`):
//! after the handshake on the first stream, the client opens the others to the same address,
//! each starting with a [`JoinRecord`] that names the connection by the token of the client's
//! HELLO, and the server gathers them; both ends then run one transport lane per stream.
//!
//! The streams that join arrive at the server's listener like new connections. Whoever accepts
//! them (a [`Listener`](super::Listener)'s accept loop, or the connection's own `accept` while it
//! waits) hands them to the node's [`Joins`], where the server's connection claimed its client's
//! token as soon as it read the client's HELLO, before it answered. The client opens its extra
//! streams only after that answer, so a stream naming a token no connection claimed is never
//! a client's and is closed at once: the registry holds no more tokens than the server has
//! connections (established, or between HELLO and the end of their handshake).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use kvwire_proto::auth::{AuthChannel, Opener, Sealer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::{EngineError, SetupError};
use crate::transport::tcp::{JoinRecord, JOIN_MAGIC, MAX_STREAMS};

/// One stream of a connection, with its lane of the connection's authentication channel.
pub(crate) type LaneStream = (TcpStream, Sealer, Opener);

/// The streams that join, by the token of the connection that claimed it.
#[derive(Debug, Default)]
pub(crate) struct Joins {
    slots: Mutex<HashMap<[u8; 16], Slot>>,
}

#[derive(Debug)]
struct Slot {
    tx: mpsc::UnboundedSender<(JoinRecord, TcpStream)>,
    /// Streams handed over so far: at most [`MAX_STREAMS`] per token (a party that learned the
    /// token cannot queue streams without bound).
    delivered: usize,
}

/// What became of a joining stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// Handed to the connection that claimed its token.
    Delivered,
    /// No connection claims its token (closed).
    Unclaimed,
    /// Its token's connection had as many streams handed over as a connection can have
    /// (closed).
    TooMany,
}

impl Joins {
    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 16], Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands a joining stream to the connection that claimed its token; closes it when none
    /// did, or when that connection had [`MAX_STREAMS`] streams handed over already.
    pub(crate) fn deliver(&self, join: JoinRecord, stream: TcpStream) -> Delivery {
        let mut slots = self.slots();
        let Some(slot) = slots.get_mut(&join.token) else {
            tracing::warn!("a joining stream names no connection of this node; closed");
            return Delivery::Unclaimed;
        };
        if slot.delivered >= usize::from(MAX_STREAMS) {
            tracing::warn!("a joining stream beyond its connection's stream count; closed");
            return Delivery::TooMany;
        }
        slot.delivered += 1;
        // A claim whose connection is gone removes its slot; until then it receives.
        let _ = slot.tx.send((join, stream));
        Delivery::Delivered
    }

    /// Claims `token` for a connection: streams joining with it come to the claim until it
    /// is dropped. `None` if another connection holds that token (the new one is refused).
    pub(crate) fn claim(&self, token: [u8; 16]) -> Option<Claim<'_>> {
        let mut slots = self.slots();
        if slots.contains_key(&token) {
            return None;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        slots.insert(token, Slot { tx, delivered: 0 });
        Some(Claim {
            joins: self,
            token,
            rx,
        })
    }

    /// Tokens claimed now.
    #[cfg(test)]
    pub(crate) fn claimed(&self) -> usize {
        self.slots().len()
    }
}

/// A connection's claim on its token: the streams that join it; the token is forgotten when
/// the claim is dropped (later streams naming it are closed).
#[derive(Debug)]
pub(crate) struct Claim<'a> {
    joins: &'a Joins,
    token: [u8; 16],
    rx: mpsc::UnboundedReceiver<(JoinRecord, TcpStream)>,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.joins.slots().remove(&self.token);
    }
}

/// Server side, before the handshake: if `stream` is an extra stream joining a connection
/// (it starts with `KVJN`), reads its join record and hands it to `joins`, and returns
/// [`EngineError::StreamJoined`] ([`EngineError::StrayJoin`] when it names no connection:
/// closed); otherwise leaves the stream untouched for the handshake.
pub(crate) async fn route_join(
    stream: &mut Option<TcpStream>,
    joins: &Joins,
    timeout: Duration,
) -> Result<(), EngineError> {
    let Some(s) = stream.as_mut() else {
        return Ok(());
    };
    let mut magic = [0u8; 4];
    let peeked = tokio::time::timeout(timeout, async {
        loop {
            let n = s.peek(&mut magic).await?;
            if n == 0 || n == magic.len() || magic[..n] != JOIN_MAGIC[..n] {
                return Ok::<usize, std::io::Error>(n);
            }
            // A prefix of the magic so far: wait for the rest.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    // Not a join (or nothing yet): the handshake judges the bytes, under its own deadline.
    let Ok(Ok(4)) = peeked else {
        return Ok(());
    };
    if magic != JOIN_MAGIC {
        return Ok(());
    }
    let mut b = [0u8; JoinRecord::LEN];
    tokio::time::timeout(timeout, s.read_exact(&mut b))
        .await
        .map_err(|_| EngineError::Stream("a join record did not arrive in time".into()))??;
    let j = JoinRecord::decode(&b).map_err(EngineError::Stream)?;
    let Some(s) = stream.take() else {
        return Ok(());
    };
    match joins.deliver(j, s) {
        Delivery::Delivered => Err(EngineError::StreamJoined),
        Delivery::Unclaimed => Err(EngineError::StrayJoin("no connection claims its token")),
        Delivery::TooMany => Err(EngineError::StrayJoin(
            "its connection had all its streams handed over",
        )),
    }
}

/// The streams of a connection whose handshake just completed on `stream`, each with its
/// lane of `channel` (SPEC §3.11.1), lane 0 first: just `stream` for one; with more, the
/// client opens the others to the same peer and the server gathers them (accepting on
/// `listener` meanwhile when it has one; see the module documentation).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn open_lanes(
    stream: TcpStream,
    channel: AuthChannel,
    client: bool,
    streams: u16,
    token: [u8; 16],
    claim: Option<Option<Claim<'_>>>,
    node: &super::Node,
    listener: Option<&TcpListener>,
    timeout: Duration,
) -> Result<Vec<LaneStream>, EngineError> {
    let channels = channel.lanes(streams.max(1));
    let mut others: Vec<Option<TcpStream>> = (1..streams).map(|_| None).collect();
    if streams > 1 {
        if client {
            let addr = stream.peer_addr()?;
            let connect = async {
                for lane in 1..streams {
                    let mut s = TcpStream::connect(addr).await?;
                    s.set_nodelay(true)?;
                    let j = JoinRecord {
                        lane,
                        streams,
                        token,
                    };
                    s.write_all(&j.encode()).await?;
                    others[usize::from(lane) - 1] = Some(s);
                }
                Ok::<(), std::io::Error>(())
            };
            tokio::time::timeout(timeout, connect).await.map_err(|_| {
                EngineError::from(SetupError::StreamsNotOpened {
                    streams,
                    within: timeout,
                })
            })??;
        } else {
            // The handshake is done: a listener's slot can serve the streams joining now.
            super::listener::release_handshake_slot();
            let mut claim = claim
                .flatten()
                .ok_or_else(|| EngineError::from(SetupError::TokenInUse))?;
            let gather = async {
                let mut missing = others.len();
                while missing > 0 {
                    let joined = match listener {
                        Some(l) => tokio::select! {
                            j = claim.rx.recv() => j,
                            a = l.accept() => {
                                // A stream for this connection, or not one of ours (closed
                                // when its task ends); read apart, so a client that
                                // connects and says nothing cannot hold up the others.
                                let node = node.clone();
                                tokio::spawn(async move {
                                    let mut s = a.ok().map(|(s, _)| s);
                                    let _ = route_join(&mut s, node.joins(), timeout).await;
                                });
                                continue;
                            }
                        },
                        None => claim.rx.recv().await,
                    };
                    let Some((join, s)) = joined else { break };
                    let lane = join.lane;
                    match others.get_mut(usize::from(lane).wrapping_sub(1)) {
                        Some(slot @ None) if join.streams == streams => {
                            s.set_nodelay(true)?;
                            *slot = Some(s);
                            missing -= 1;
                        }
                        // A lane beyond the count, one that joined twice, or another stream
                        // count: not this client's (closed).
                        _ => tracing::warn!(
                            lane,
                            streams = join.streams,
                            "a joining stream that does not fit the connection (a lane already joined, or another count); dropped"
                        ),
                    }
                }
                Ok::<(), std::io::Error>(())
            };
            tokio::time::timeout(timeout, gather).await.map_err(|_| {
                let joined = others.iter().filter(|s| s.is_some()).count();
                EngineError::from(SetupError::StreamsNotJoined {
                    joined,
                    expected: others.len(),
                    within: timeout,
                })
            })??;
        }
    }
    let mut lanes = Vec::with_capacity(usize::from(streams.max(1)));
    for (s, c) in std::iter::once(Some(stream)).chain(others).zip(channels) {
        let Some(s) = s else {
            return Err(SetupError::StreamMissing.into());
        };
        let (sealer, opener) = c.split();
        lanes.push((s, sealer, opener));
    }
    Ok(lanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected pair of loopback streams (the accepted end returned).
    async fn stream(l: &TcpListener) -> TcpStream {
        let addr = l.local_addr().unwrap();
        let (_c, a) = tokio::join!(TcpStream::connect(addr), l.accept());
        a.unwrap().0
    }

    fn join(token: u8, lane: u16) -> JoinRecord {
        JoinRecord {
            lane,
            streams: 2,
            token: [token; 16],
        }
    }

    /// Streams come only to a claimed token, at most `MAX_STREAMS` of them; a token is held by
    /// one claim at a time and forgotten when its claim is dropped.
    #[tokio::test]
    async fn joins_reach_only_a_claimed_token_and_a_bounded_number_of_them() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let joins = Joins::default();
        assert_eq!(
            joins.deliver(join(1, 1), stream(&l).await),
            Delivery::Unclaimed
        );
        assert_eq!(
            joins.claimed(),
            0,
            "an unclaimed join leaves nothing behind"
        );
        let mut claim = joins.claim([1; 16]).unwrap();
        assert!(joins.claim([1; 16]).is_none(), "a token is claimed once");
        for _ in 0..MAX_STREAMS {
            assert_eq!(
                joins.deliver(join(1, 1), stream(&l).await),
                Delivery::Delivered
            );
        }
        assert_eq!(
            joins.deliver(join(1, 1), stream(&l).await),
            Delivery::TooMany
        );
        assert!(claim.rx.try_recv().is_ok());
        drop(claim);
        assert_eq!(joins.claimed(), 0);
        assert_eq!(
            joins.deliver(join(1, 1), stream(&l).await),
            Delivery::Unclaimed,
            "a dropped claim's token is forgotten"
        );
        assert!(joins.claim([1; 16]).is_some());
    }
}
