//! A manager's connections: by peer node id, and (decode) by the address they were dialled
//! at; the listener's counters; the background task that forgets connections whose peer is
//! gone (a restarted peer comes back as a new connection) and renews a dialled connection
//! that lost lanes (RDMA rails): it drains it, then dials again.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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

    /// Lanes it lost or left out while it goes on (RDMA rails).
    fn failed_lanes(&self) -> usize {
        match self {
            Self::Sender(c) => c.failed_lanes(),
            Self::Receiver(c) => c.failed_lanes(),
        }
    }

    /// Transfers open on it.
    fn open_transfers(&self) -> usize {
        match self {
            Self::Sender(c) => c.open_transfers(),
            Self::Receiver(c) => c.open_transfers(),
        }
    }
}

/// How long a dialled connection runs with failed lanes before it is renewed, at first; each
/// renewal of the same address whose new connection has failed lanes again (its rail still
/// down) doubles it, up to [`RENEW_AFTER_MAX`].
pub(super) const RENEW_AFTER: Duration = Duration::from_secs(5);
/// The longest wait between renewals of one address.
pub(super) const RENEW_AFTER_MAX: Duration = Duration::from_secs(300);

/// Renewals of one address: when the next may start, and the wait after it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Renewal {
    /// When the connection may be renewed.
    due: Instant,
    /// The wait before the renewal after this one.
    backoff: Duration,
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
    /// Up to the peer with this node id, and being renewed: no new transfer takes it; once
    /// its open transfers ended it is forgotten and the address dialled again.
    Draining(u64),
    Failed(Error),
}

#[derive(Debug, Default)]
pub(super) struct PeerList {
    /// By peer node id; a new connection from the same peer replaces the old one.
    pub(super) conns: Vec<(u64, Conn)>,
    /// Connections dialled at an address, by that address.
    pub(super) links: HashMap<String, Link>,
    /// Addresses whose connection has failed lanes: when it is renewed.
    pub(super) renewals: HashMap<String, Renewal>,
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

    /// The live connections a new transfer may take: not one being drained for renewal.
    fn usable(&self) -> impl Iterator<Item = &(u64, Conn)> {
        self.live().filter(|(id, _)| {
            !self
                .links
                .values()
                .any(|l| matches!(l, Link::Draining(p) if p == id))
        })
    }

    /// The connection `target` names: `Ok(None)` while there is none yet (or while the one
    /// there is drained for renewal: its successor is on its way).
    pub(super) fn find(&self, target: &Target) -> Result<Option<Conn>, Error> {
        let by_id = |p: u64| {
            self.usable()
                .find(|(id, _)| *id == p)
                .map(|(_, c)| c.clone())
        };
        match target {
            Target::Node(p) => Ok(by_id(*p)),
            Target::Address(a) => match self.links.get(a) {
                Some(Link::Up(p)) => Ok(by_id(*p)),
                Some(Link::Failed(e)) => Err(e.clone()),
                // Draining: the transfer waits for the connection that replaces it.
                Some(Link::Connecting | Link::Draining(_)) | None => Ok(None),
            },
            // Resolved to `Node` by the manager, which holds the node's directory.
            Target::Room(_) => Ok(None),
            Target::Only => {
                let mut live = self.usable();
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

    /// The connection dialled at `addr` (up, to peer `p`) reports `failed` lanes at `now`:
    /// none clears the address's renewal wait; some start it ([`RENEW_AFTER`] at first) and,
    /// once it has passed, start draining the connection for renewal, doubling the wait for
    /// the next one (up to [`RENEW_AFTER_MAX`]) in case the new connection has failed lanes
    /// too (its rail still down). Whether a renewal started.
    pub(super) fn judge_failed_lanes(
        &mut self,
        addr: &str,
        p: u64,
        failed: usize,
        now: Instant,
    ) -> bool {
        if failed == 0 {
            self.renewals.remove(addr);
            return false;
        }
        let r = self.renewals.entry(addr.to_owned()).or_insert(Renewal {
            due: now + RENEW_AFTER,
            backoff: RENEW_AFTER,
        });
        if now < r.due {
            return false;
        }
        r.backoff = (r.backoff * 2).min(RENEW_AFTER_MAX);
        r.due = now + r.backoff;
        tracing::warn!(addr = %addr, peer = p, failed_lanes = failed,
            "the connection runs with failed lanes: renewing it (drained, then dialled again)");
        self.links.insert(addr.to_owned(), Link::Draining(p));
        true
    }

    /// Whether `addr` must be dialled (again): never dialled, its peer lost, or (`retry`)
    /// its last attempt failed.
    pub(super) fn needs_dial(&self, addr: &str, retry: bool) -> bool {
        match self.links.get(addr) {
            None => true,
            Some(Link::Connecting | Link::Draining(_)) => false,
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

    /// Starts renewing the connection dialled at `addr` (up now): no new transfer takes it,
    /// and once its open transfers ended it is forgotten and `addr` dialled again. Whether
    /// it was up.
    pub(super) fn renew(&self, addr: &str) -> bool {
        let mut l = self.lock();
        match l.links.get(addr) {
            Some(&Link::Up(p)) => {
                l.links.insert(addr.to_owned(), Link::Draining(p));
                true
            }
            _ => false,
        }
    }

    /// Every 100 ms: forgets the connections whose peer is gone (and the addresses dialled
    /// to them), so that the list does not grow ([`PeerList::find`] already skips them);
    /// renews a dialled connection that has run with failed lanes for its address's wait
    /// ([`RENEW_AFTER`], doubling while the renewed connections keep failed lanes); and
    /// dials again an address whose draining connection has nothing open (seen twice, 100
    /// ms apart, so that a reservation handed to it just before the drain began is seen).
    pub(super) async fn prune(self: Arc<Self>, node: Node, role: Role) {
        let mut idle_before: Vec<String> = Vec::new();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = Instant::now();
            let mut redial: Vec<String> = Vec::new();
            {
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
                let mut idle_now = Vec::new();
                let links: Vec<(String, Link)> = l
                    .links
                    .iter()
                    .map(|(a, k)| (a.clone(), k.clone()))
                    .collect();
                for (addr, link) in links {
                    match link {
                        Link::Up(p) => {
                            let failed = l
                                .live()
                                .find(|(id, _)| *id == p)
                                .map(|(_, c)| c.failed_lanes());
                            if let Some(failed) = failed {
                                l.judge_failed_lanes(&addr, p, failed, now);
                            }
                        }
                        Link::Draining(p) => {
                            let open = l
                                .live()
                                .find(|(id, _)| *id == p)
                                .map_or(0, |(_, c)| c.open_transfers());
                            if open > 0 {
                                continue;
                            }
                            if idle_before.contains(&addr) {
                                // Forgotten here; the transfers that finished on it hold
                                // their own handles, and it closes once they are gone.
                                l.conns.retain(|(id, _)| *id != p);
                                l.links.insert(addr.clone(), Link::Connecting);
                                redial.push(addr);
                            } else {
                                idle_now.push(addr);
                            }
                        }
                        Link::Connecting | Link::Failed(_) => {}
                    }
                }
                idle_before = idle_now;
            }
            for addr in redial {
                let (node, peers) = (node.clone(), self.clone());
                tokio::spawn(async move {
                    let outcome = dial(addr.clone(), node, role).await;
                    peers.dialled(addr, outcome);
                });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_with_failed_lanes_is_renewed_after_a_wait_that_doubles_while_they_stay() {
        let mut l = PeerList::default();
        let addr = "10.0.0.2:7000";
        let t0 = Instant::now();
        l.links.insert(addr.into(), Link::Up(7));
        // Every lane alive: nothing to do.
        assert!(!l.judge_failed_lanes(addr, 7, 0, t0));
        assert!(l.renewals.is_empty());
        // A lane failed: renewed once it has run so for RENEW_AFTER, not before.
        assert!(!l.judge_failed_lanes(addr, 7, 1, t0));
        assert!(!l.judge_failed_lanes(addr, 7, 1, t0 + RENEW_AFTER - Duration::from_millis(1)));
        assert!(l.judge_failed_lanes(addr, 7, 1, t0 + RENEW_AFTER));
        assert!(matches!(l.links.get(addr), Some(Link::Draining(7))));
        // Its successor still has a failed lane (the rail is still down): the next renewal
        // waits twice as long, and so on up to RENEW_AFTER_MAX.
        let mut at = t0 + RENEW_AFTER;
        let mut wait = RENEW_AFTER * 2;
        for _ in 0..10 {
            l.links.insert(addr.into(), Link::Up(8));
            assert!(!l.judge_failed_lanes(addr, 8, 1, at + wait - Duration::from_millis(1)));
            assert!(l.judge_failed_lanes(addr, 8, 1, at + wait));
            at += wait;
            wait = (wait * 2).min(RENEW_AFTER_MAX);
        }
        assert_eq!(wait, RENEW_AFTER_MAX);
        // A successor with every lane alive clears the wait: a later failure starts afresh.
        l.links.insert(addr.into(), Link::Up(9));
        assert!(!l.judge_failed_lanes(addr, 9, 0, at));
        assert!(!l.judge_failed_lanes(addr, 9, 2, at));
        assert!(l.judge_failed_lanes(addr, 9, 2, at + RENEW_AFTER));
    }
}
