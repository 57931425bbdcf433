//! Which decode peer each request's KV goes to, as the decodes said it: a prefill node that
//! serves several decode nodes learns where request (room) `R` goes from the decode that
//! reserved `R`, or refused it, never from an argument of the engine's (DESIGN.md, "routing
//! comes from the decode").
//!
//! Every sender connection of a [`Node`](super::Node) reports the requests its peer named
//! before the engine opened them (a parked RESERVE, a refusal: `SenderEvent::Announced`,
//! SPEC §5.1, "Routing by the receiver") into the node's one [`Rooms`]; an engine looks a
//! request up there ([`Rooms::peer_of`]) and opens it on that peer's connection. A request the
//! engine rejected at admission before any decode named it is held here too
//! ([`Rooms::retire_when_named`]), and retired on the connection that names it later, so its
//! reservation still gets REJECT with the original error.
//!
//! Both tables are bounded ([`ROOMS_REMEMBERED`] entries each, the oldest forgotten first), so
//! a peer that names many requests the engine never opens costs bounded memory.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use kvwire_proto::admission::Rejected;
use kvwire_proto::wire::{ErrorCode, TransferId};
use tokio::sync::oneshot;

/// How many named requests (and how many retirements waiting for a name) a node remembers.
pub const ROOMS_REMEMBERED: usize = 16_384;

/// A bounded map with insertion order, the oldest entry evicted first.
#[derive(Debug)]
struct Bounded<V> {
    entries: HashMap<TransferId, V>,
    order: VecDeque<TransferId>,
}

impl<V> Default for Bounded<V> {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

impl<V> Bounded<V> {
    fn insert(&mut self, id: TransferId, v: V) {
        if self.entries.insert(id, v).is_some() {
            self.order.retain(|&t| t != id);
        }
        self.order.push_back(id);
        while self.order.len() > ROOMS_REMEMBERED {
            if let Some(old) = self.order.pop_front() {
                self.entries.remove(&old);
            }
        }
    }

    fn remove(&mut self, id: TransferId) -> Option<V> {
        let v = self.entries.remove(&id)?;
        self.order.retain(|&t| t != id);
        Some(v)
    }
}

#[derive(Debug, Default)]
struct Tables {
    /// Request → the peer that named it last.
    named: Bounded<Route>,
    /// Requests rejected at admission before any peer named them.
    rejected: Bounded<Rejected>,
    /// The engine's own waits for a request to be named ([`Rooms::when_named`]).
    waiters: HashMap<TransferId, Vec<oneshot::Sender<Route>>>,
}

/// Waiters kept before the ones nobody waits on any more are swept out.
const WAITERS_SWEPT_ABOVE: usize = 1024;

/// Where a request goes, as its decode said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// The node id of the peer that named the request.
    pub peer: u64,
    /// The peer's code if it refused the request (SPEC §5.1, "Refused before
    /// reservation"): opening the request there fails with it.
    pub refusal: Option<ErrorCode>,
}

/// A node's directory of requests its decode peers named (see the module docs).
#[derive(Debug, Default)]
pub struct Rooms {
    tables: Mutex<Tables>,
}

impl Rooms {
    fn lock(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where request `id` goes: the peer that named it last, if one did.
    pub fn route(&self, id: TransferId) -> Option<Route> {
        self.lock().named.entries.get(&id).copied()
    }

    /// The peer (node id) that named request `id` last, if one did.
    pub fn peer_of(&self, id: TransferId) -> Option<u64> {
        self.route(id).map(|r| r.peer)
    }

    /// A peer named request `id` (a sender connection's report). Returns the request's
    /// rejection if the engine rejected it before: the connection retires it now.
    pub(crate) fn named(&self, id: TransferId, route: Route) -> Option<Rejected> {
        let mut t = self.lock();
        t.named.insert(id, route);
        for w in t.waiters.remove(&id).unwrap_or_default() {
            let _ = w.send(route);
        }
        t.rejected.remove(id)
    }

    /// Resolves with the route of request `id` once a peer names it: at once if one did
    /// already. Dropping the receiver withdraws the wait.
    pub fn when_named(&self, id: TransferId) -> oneshot::Receiver<Route> {
        let (tx, rx) = oneshot::channel();
        let mut t = self.lock();
        if let Some(&route) = t.named.entries.get(&id) {
            let _ = tx.send(route);
            return rx;
        }
        if t.waiters.len() >= WAITERS_SWEPT_ABOVE {
            t.waiters.retain(|_, ws| {
                ws.retain(|w| !w.is_closed());
                !ws.is_empty()
            });
        }
        t.waiters.entry(id).or_default().push(tx);
        rx
    }

    /// The engine opened (or ended) request `id`: it needs no route any more.
    pub fn forget(&self, id: TransferId) {
        let mut t = self.lock();
        t.named.remove(id);
        t.rejected.remove(id);
    }

    /// The engine rejected request `rejected` at admission and no peer named it yet: the
    /// connection that names it later retires it there (its reservation gets REJECT with the
    /// original error).
    pub fn retire_when_named(&self, rejected: Rejected) {
        self.lock().rejected.insert(rejected.transfer_id, rejected);
    }

    /// How many requests are named now (for tests and metrics).
    pub fn len(&self) -> usize {
        self.lock().named.entries.len()
    }

    /// Whether no request is named now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvwire_proto::admission::{AdmissionPolicy, Request};

    fn route(peer: u64) -> Route {
        Route {
            peer,
            refusal: None,
        }
    }

    #[test]
    fn the_latest_naming_wins_and_the_oldest_entries_are_forgotten() {
        let rooms = Rooms::default();
        assert_eq!(rooms.named(TransferId(1), route(10)), None);
        rooms.named(TransferId(1), route(11));
        assert_eq!(rooms.peer_of(TransferId(1)), Some(11));
        for i in 0..ROOMS_REMEMBERED as u64 {
            rooms.named(TransferId(100 + i), route(12));
        }
        assert_eq!(rooms.peer_of(TransferId(1)), None, "bounded");
        assert_eq!(rooms.len(), ROOMS_REMEMBERED);
        rooms.forget(TransferId(100));
        assert_eq!(rooms.peer_of(TransferId(100)), None);
    }

    #[test]
    fn a_wait_resolves_when_the_request_is_named_or_at_once_if_it_was() {
        let rooms = Rooms::default();
        let mut later = rooms.when_named(TransferId(5));
        let dropped = rooms.when_named(TransferId(5));
        drop(dropped);
        assert!(later.try_recv().is_err());
        rooms.named(TransferId(5), route(9));
        assert_eq!(later.try_recv(), Ok(route(9)));
        assert_eq!(rooms.when_named(TransferId(5)).try_recv(), Ok(route(9)));
        // Abandoned waits are swept out, not kept for ever.
        for i in 0..(2 * WAITERS_SWEPT_ABOVE as u64) {
            drop(rooms.when_named(TransferId(1000 + i)));
        }
        assert!(rooms.lock().waiters.len() <= WAITERS_SWEPT_ABOVE + 1);
    }

    #[test]
    fn a_rejection_waits_for_the_peer_that_names_it() {
        let rooms = Rooms::default();
        let rejected = AdmissionPolicy {
            tokens_per_page: 16,
            pool_pages: 4,
            max_context_tokens: 64,
        }
        .admit(Request {
            transfer_id: TransferId(7),
            tokens: 65,
        })
        .unwrap_err();
        rooms.retire_when_named(rejected.clone());
        assert_eq!(rooms.named(TransferId(7), route(3)), Some(rejected));
        assert_eq!(rooms.named(TransferId(7), route(3)), None, "retired once");
    }
}
