//! A connection over several TCP streams (SPEC §9.1, several streams; `NodeConfig::tcp_streams`):
//! after the handshake on the first stream, the client opens the others to the same address,
//! each starting with a [`JoinRecord`] that names the connection by the token of the client's
//! HELLO, and the server gathers them; both ends then run one transport lane per stream.
//!
//! The streams that join arrive at the server's listener like new connections. Whoever accepts
//! them (a [`Listener`](super::Listener)'s accept loop, or the connection's own `accept` while it
//! waits) hands them to the node's [`Joins`], where the server's connection claims those of its
//! token. A stream whose token no connection claims within the handshake timeout is dropped.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvwire_proto::auth::{AuthChannel, Opener, Sealer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::EngineError;
use crate::transport::tcp::{JoinRecord, JOIN_MAGIC};

/// Connection tokens with joined streams no connection claimed yet, at most (streams for
/// further tokens are dropped at once, until older ones expire).
const UNCLAIMED_LIMIT: usize = 1024;

/// One stream of a connection, with its lane of the connection's authentication channel.
pub(crate) type LaneStream = (TcpStream, Sealer, Opener);

/// The streams that joined, by the token of the connection they name.
#[derive(Debug, Default)]
pub(crate) struct Joins {
    slots: Mutex<HashMap<[u8; 16], Slot>>,
}

#[derive(Debug)]
struct Slot {
    tx: mpsc::UnboundedSender<(JoinRecord, TcpStream)>,
    /// Until the connection claims it.
    rx: Option<mpsc::UnboundedReceiver<(JoinRecord, TcpStream)>>,
    since: Instant,
}

impl Joins {
    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 16], Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands a joining stream to the connection of `token` (now, or when it claims them).
    /// Streams nobody claimed within `expiry` are dropped (closed); beyond
    /// [`UNCLAIMED_LIMIT`] unclaimed tokens, a stream for a new one is dropped at once.
    fn deliver(&self, join: JoinRecord, stream: TcpStream, expiry: Duration) {
        let token = join.token;
        let mut slots = self.slots();
        let now = Instant::now();
        slots.retain(|_, s| s.rx.is_none() || now.duration_since(s.since) < expiry);
        if !slots.contains_key(&token) && slots.len() >= UNCLAIMED_LIMIT {
            tracing::warn!("a joining stream dropped: too many unclaimed connection tokens");
            return;
        }
        let slot = slots.entry(token).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            Slot {
                tx,
                rx: Some(rx),
                since: now,
            }
        });
        let _ = slot.tx.send((join, stream));
    }

    /// The connection of `token` takes its joining streams; `None` if another connection
    /// already claimed that token (the new one is refused).
    fn claim(&self, token: [u8; 16]) -> Option<Claim<'_>> {
        let mut slots = self.slots();
        let slot = slots.entry(token).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            Slot {
                tx,
                rx: Some(rx),
                since: Instant::now(),
            }
        });
        let rx = slot.rx.take()?;
        Some(Claim {
            joins: self,
            token,
            rx,
        })
    }
}

/// A connection's claim on its token: the streams that join it; the token is forgotten when
/// the claim is dropped (later streams naming it are dropped).
struct Claim<'a> {
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
/// [`EngineError::StreamJoined`]; otherwise leaves the stream untouched for the handshake.
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
    if let Some(s) = stream.take() {
        joins.deliver(j, s, timeout);
    }
    Err(EngineError::StreamJoined)
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
    node: &super::Node,
    listener: Option<&TcpListener>,
    timeout: Duration,
) -> Result<Vec<LaneStream>, EngineError> {
    let joins = node.joins();
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
                EngineError::Transport(format!(
                    "the connection's {streams} TCP streams could not be opened within {} ms",
                    timeout.as_millis()
                ))
            })??;
        } else {
            // The handshake is done: a listener's slot can serve the streams joining now.
            super::listener::release_handshake_slot();
            let mut claim = joins.claim(token).ok_or_else(|| {
                EngineError::Transport(
                    "another connection already uses this client's stream token".into(),
                )
            })?;
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
                EngineError::Transport(format!(
                    "{joined} of the connection's {} extra TCP streams joined within {} ms",
                    others.len(),
                    timeout.as_millis()
                ))
            })??;
        }
    }
    let mut lanes = Vec::with_capacity(usize::from(streams.max(1)));
    for (s, c) in std::iter::once(Some(stream)).chain(others).zip(channels) {
        let Some(s) = s else {
            return Err(EngineError::Transport(
                "a TCP stream of the connection did not join".into(),
            ));
        };
        let (sealer, opener) = c.split();
        lanes.push((s, sealer, opener));
    }
    Ok(lanes)
}
