//! A manager's connections: by peer node id, and (decode) by the address they were dialled
//! at; the listener's counters; the background task that forgets connections whose peer is
//! gone (a restarted peer comes back as a new connection).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::{Error, ErrorKind, Role};
use crate::engine::{failure_class, EngineError, ListenerStats, Node, ReceiverConn, SenderConn};

/// A connection to a peer.
#[derive(Clone, Debug)]
pub(super) enum Conn {
    Sender(SenderConn),
    Receiver(ReceiverConn),
}

impl Conn {
    pub(super) fn peer_id(&self) -> u64 {
        match self {
            Self::Sender(c) => c.peer().node_id,
            Self::Receiver(c) => c.peer().node_id,
        }
    }

    /// Whether the connection ended (its peer is lost, or it closed): known as soon as
    /// its task saw it, before the list is pruned.
    fn lost(&self) -> bool {
        match self {
            Self::Sender(c) => c.is_closed(),
            Self::Receiver(c) => c.is_closed(),
        }
    }
}

/// Which connection a transfer goes over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Target {
    /// The only connection (several connected: the transfer fails, naming the choice).
    Only,
    /// The peer with this node id.
    Node(u64),
    /// The connection dialled at this address ([`Manager::receiver_at`](super::Manager)):
    /// dialled again when it failed or its peer was lost.
    Address(String),
    /// The connection of the peer that named this request (prefill: the decode that
    /// reserved or refused it, from the node's [`Rooms`](crate::engine::Rooms)); none
    /// until one did.
    Room(kvwire_proto::wire::TransferId),
}

/// A connection dialled at an address.
#[derive(Clone, Debug)]
pub(super) enum Link {
    Connecting,
    /// Up, to the peer with this node id.
    Up(u64),
    Failed(Error),
}

#[derive(Debug, Default)]
pub(super) struct PeerList {
    /// By peer node id; a new connection from the same peer replaces the old one.
    pub(super) conns: Vec<(u64, Conn)>,
    /// Connections dialled at an address, by that address.
    pub(super) links: HashMap<String, Link>,
    /// The last accept or handshake failure of the listener.
    pub(super) last_accept_error: Option<Error>,
    /// The listener's counters.
    pub(super) stats: ListenerStats,
}

impl PeerList {
    /// The live connections (one whose peer is gone is never picked for a new transfer,
    /// even before the list is pruned).
    fn live(&self) -> impl Iterator<Item = &(u64, Conn)> {
        self.conns.iter().filter(|(_, c)| !c.lost())
    }

    /// The connection `target` names: `Ok(None)` while there is none yet.
    pub(super) fn find(&self, target: &Target) -> Result<Option<Conn>, Error> {
        let by_id = |p: u64| self.live().find(|(id, _)| *id == p).map(|(_, c)| c.clone());
        match target {
            Target::Node(p) => Ok(by_id(*p)),
            Target::Address(a) => match self.links.get(a) {
                Some(Link::Up(p)) => Ok(by_id(*p)),
                Some(Link::Failed(e)) => Err(e.clone()),
                Some(Link::Connecting) | None => Ok(None),
            },
            // Resolved to `Node` by the manager, which holds the node's directory.
            Target::Room(_) => Ok(None),
            Target::Only => {
                let mut live = self.live();
                match (live.next(), live.next()) {
                    (None, _) => Ok(None),
                    (Some((_, c)), None) => Ok(Some(c.clone())),
                    _ => Err(Error::invalid(
                        "several peers are connected: name the transfer's peer (its node id)",
                    )),
                }
            }
        }
    }

    /// Whether `addr` must be dialled (again): never dialled, its peer lost, or (`retry`)
    /// its last attempt failed.
    pub(super) fn needs_dial(&self, addr: &str, retry: bool) -> bool {
        match self.links.get(addr) {
            None => true,
            Some(Link::Connecting) => false,
            Some(Link::Up(p)) => !self.live().any(|(id, _)| id == p),
            Some(Link::Failed(_)) => retry,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Peers {
    list: Mutex<PeerList>,
    pub(super) changed: Condvar,
    /// The same as `changed`, for tasks.
    pub(super) notify: tokio::sync::Notify,
}

impl Peers {
    pub(super) fn lock(&self) -> MutexGuard<'_, PeerList> {
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn add(&self, conn: Conn) -> u64 {
        let id = conn.peer_id();
        let mut l = self.lock();
        l.conns.retain(|(p, _)| *p != id);
        l.conns.push((id, conn));
        self.changed.notify_all();
        self.notify.notify_waiters();
        id
    }

    /// An incoming connection: established, or its failure (counted as the engine's
    /// listener counts it).
    pub(super) fn accepted(&self, outcome: Result<Conn, EngineError>) {
        let mut l = self.lock();
        l.stats.accepted += 1;
        match outcome {
            Ok(c) => {
                l.stats.established += 1;
                drop(l);
                self.add(c);
            }
            // A stream that joined another connection (several TCP streams): not a failure.
            Err(EngineError::StreamJoined) => l.stats.joined += 1,
            Err(e) => {
                tracing::warn!(error = %e, "polled: an incoming connection failed");
                match failure_class(&e) {
                    "refused" => l.stats.refused += 1,
                    "malformed" => l.stats.malformed += 1,
                    _ => l.stats.failed += 1,
                }
                l.last_accept_error = Some(Error::from_engine(&e));
                self.changed.notify_all();
            }
        }
    }

    /// The outcome of dialling `addr`.
    pub(super) fn dialled(&self, addr: String, outcome: Result<Conn, Error>) {
        let link = match outcome {
            Ok(c) => Link::Up(self.add(c)),
            Err(e) => Link::Failed(e),
        };
        self.lock().links.insert(addr, link);
        self.changed.notify_all();
        self.notify.notify_waiters();
    }

    /// Forgets, every 100 ms, the connections whose peer is gone (and the addresses dialled
    /// to them), so that the list does not grow; [`PeerList::find`] already skips them.
    pub(super) async fn prune(self: Arc<Self>) {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut l = self.lock();
            let gone: Vec<u64> = l
                .conns
                .iter()
                .filter(|(_, c)| c.lost())
                .map(|(id, _)| *id)
                .collect();
            for id in gone {
                // By id and liveness: a new connection of the same peer stays.
                l.conns.retain(|(p, c)| *p != id || !c.lost());
                let live = l.conns.iter().any(|(p, _)| *p == id);
                if !live {
                    l.links
                        .retain(|_, link| !matches!(link, Link::Up(p) if *p == id));
                }
            }
        }
    }
}

/// Opens one end of a connection for `role` on `stream`.
pub(super) async fn open(
    stream: tokio::net::TcpStream,
    node: &Node,
    role: Role,
    client: bool,
) -> Result<Conn, EngineError> {
    match role {
        Role::Prefill => SenderConn::start(stream, node, client)
            .await
            .map(Conn::Sender),
        Role::Decode => ReceiverConn::start(stream, node, client)
            .await
            .map(Conn::Receiver),
    }
}

/// Dials `addr` and runs the handshake for `role`.
pub(super) async fn dial(addr: String, node: Node, role: Role) -> Result<Conn, Error> {
    let stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| {
        Error::new(ErrorKind::ConnectFailed, format!("connect: {e}")).retryable(true)
    })?;
    open(stream, &node, role, true)
        .await
        .map_err(|e| Error::from_engine(&e))
}
