//! Peer discovery: how prefill and decode nodes find each other's `host:port` (and check each
//! other's KV layout) without configuring addresses by hand.
//!
//! A node publishes a [`PeerRecord`] (node id, role, ranks, address, transport, layout
//! fingerprint, cluster) through a [`Discovery`] backend and keeps the returned
//! [`Registration`]: the record stays registered while the guard lives and is refreshed by
//! it; dropping the guard (or [`Registration::deregister`]) removes it, and a node that dies
//! stops refreshing, so its record expires after its TTL. Peers [`resolve`](Discovery::resolve)
//! records by cluster, role and rank, or [`watch`](Discovery::watch) them: a [`PeerWatch`]
//! first reports every matching record as [`PeerEvent::Added`], then every change.
//!
//! **A newer registration wins at once.** Records of one role and rank under different node
//! ids co-exist: a prefill killed with SIGKILL leaves its record until the TTL expires, and
//! during a rolling restart the old and the new node of a rank both run for a while. The
//! backend stamps each registration ([`PeerRecord::registered`]: the embedded server's clock,
//! etcd's revision; not the node's clock, so skew between hosts cannot reorder them), and
//! `resolve` returns the records of each rank newest first ([`sort_newest_first`]). A caller
//! that takes the first record of a rank therefore reaches a restarted node as soon as it
//! registered, not a TTL later; the older records stay listed after it (a node of a rolling
//! restart still drains) until they are deregistered or expire. A refresh keeps the stamp
//! (it is the same registration); registering again (a new `register` call, even under the
//! same key) takes a new one. Nothing is evicted early: two nodes may advertise one
//! `address` (behind NAT or a proxy), so the server never guesses that an older record is
//! dead.
//!
//! Two backends implement the trait:
//!
//! * **Embedded** (always built): a small HTTP/1.1 + JSON [`BootstrapServer`] that runs on any
//!   tokio runtime (one per cluster; e.g. beside a router, or inside one decode engine),
//!   and [`EmbeddedDiscovery`], its client. Registrations expire after their TTL unless
//!   refreshed; watches long-poll a generation number. Nothing else needs to run. The
//!   server stamps a registration with its clock when it takes it; after a server restart,
//!   a live registration re-creates its record with its age, so its order survives.
//! * **etcd** (cargo feature `etcd`): `EtcdDiscovery` keeps each record under
//!   `/<prefix>/<cluster>/<role>/<rank>/<node_id>` attached to a lease that the
//!   registration keeps alive; resolve is a prefix get, watch an etcd watch. A record's
//!   stamp is its key's modification revision (a keep-alive does not modify the key; a
//!   record put back after its lease expired counts as a new registration).
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::time::Duration;
//! use kvwire::discovery::{
//!     BootstrapServer, Discovery, EmbeddedDiscovery, PeerQuery, PeerRecord, Role,
//! };
//!
//! // One bootstrap server per cluster (it stops when `server` is dropped).
//! let (server, addr) = BootstrapServer::bind("127.0.0.1:0").await?;
//!
//! // A prefill node publishes where it listens; the record lives as long as `reg`.
//! let prefill = EmbeddedDiscovery::new(addr).with_ttl(Duration::from_secs(5));
//! let reg = prefill
//!     .register(PeerRecord::new("llama-70b", Role::Prefill, 0, 17, "10.0.0.5:7400"))
//!     .await?;
//!
//! // A decode node finds it.
//! let decode = EmbeddedDiscovery::new(addr);
//! let peers = decode.resolve(PeerQuery::cluster("llama-70b").role(Role::Prefill)).await?;
//! assert_eq!(peers[0].address, "10.0.0.5:7400");
//!
//! reg.deregister().await?;
//! assert!(decode.resolve(PeerQuery::cluster("llama-70b")).await?.is_empty());
//! server.shutdown().await;
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(()) }).unwrap();
//! ```
//!
//! Discovery only says where peers are. It is not authenticated (neither is the bootstrap
//! server): run it on a trusted network. The kvwire connection to a resolved peer still
//! authenticates it (pre-shared key) and checks its layout in the handshake;
//! [`PeerRecord::check_layout`] only refuses a mismatched peer earlier.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

mod backend;
mod embedded;
#[cfg(feature = "etcd")]
mod etcd;
mod http;
mod record;
mod server;

pub use backend::{connect, DiscoveryBackend};
pub use embedded::EmbeddedDiscovery;
#[cfg(feature = "etcd")]
pub use etcd::{EtcdDiscovery, EtcdOptions};
/// The etcd client crate, for [`EtcdDiscovery::with_client`] (TLS, authentication).
#[cfg(feature = "etcd")]
pub use etcd_client;
pub use record::{
    layout_fingerprint, node_layout_fingerprint, sort_newest_first, PeerKey, PeerQuery, PeerRecord,
    Role, MAX_ADDRESS_LEN, MAX_CLUSTER_LEN, MAX_EXTRA_ENTRIES, MAX_EXTRA_KEY_LEN,
    MAX_EXTRA_VALUE_LEN, MAX_FINGERPRINT_LEN, MAX_TRANSPORT_LEN, MAX_TRANSPORT_PARAMS_LEN,
    TRANSPORT_RDMA, TRANSPORT_TCP,
};
pub use server::{BootstrapConfig, BootstrapServer};

/// The future a [`Discovery`] method returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A discovery backend: publish this node, find peers, follow changes. Object-safe, so an
/// engine can hold an `Arc<dyn Discovery>` chosen by configuration.
pub trait Discovery: Send + Sync {
    /// Publishes `record` (after [`PeerRecord::validate`]) and keeps it published while the
    /// returned guard lives. A record with the same [`PeerKey`] is replaced.
    fn register(&self, record: PeerRecord) -> BoxFuture<'_, Result<Registration, DiscoveryError>>;

    /// The records that match `query` now, by role and engine rank, and within one rank the
    /// newest registration first ([`sort_newest_first`], [`PeerRecord::registered`]): a
    /// node restarted under a new node id is first of its rank as soon as it registered,
    /// ahead of its dead predecessor's record (which stays until its TTL runs out), so a
    /// caller that takes the first record of a rank reaches the newest node.
    fn resolve(&self, query: PeerQuery) -> BoxFuture<'_, Result<Vec<PeerRecord>, DiscoveryError>>;

    /// Follows the records that match `query`: the watch first reports every matching record
    /// as [`PeerEvent::Added`], then each change. Errors here are those of the first
    /// look-up; afterwards the watch retries by itself (and reconciles what it reported with
    /// what it finds) until it is dropped.
    fn watch(&self, query: PeerQuery) -> BoxFuture<'_, Result<PeerWatch, DiscoveryError>>;
}

/// Why a discovery call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The record breaks a rule of [`PeerRecord::validate`].
    #[error("invalid peer record: {0}")]
    InvalidRecord(String),
    /// The query (or a key) is malformed.
    #[error("invalid query: {0}")]
    InvalidQuery(String),
    /// The backend could not be reached.
    #[error("cannot reach {server}: {source}")]
    Unreachable {
        /// The address tried.
        server: String,
        /// What connecting or talking to it returned.
        #[source]
        source: std::io::Error,
    },
    /// The backend did not answer in time.
    #[error("{0} timed out")]
    Timeout(String),
    /// The bootstrap server refused the request.
    #[error("bootstrap server answered {status}: {message}")]
    Refused {
        /// HTTP status code.
        status: u16,
        /// The server's explanation.
        message: String,
    },
    /// The backend answered something this client cannot read.
    #[error("malformed answer from the discovery backend: {0}")]
    Protocol(String),
    /// The record's key is held by another live registration, which replaced this one.
    #[error("{0} is registered by another registration")]
    Superseded(PeerKey),
    /// A peer's KV layout fingerprint is not the expected one ([`PeerRecord::check_layout`]).
    #[error("peer {peer} has layout fingerprint {found:?}, expected {expected:?}")]
    LayoutMismatch {
        /// The peer's key.
        peer: PeerKey,
        /// The fingerprint the caller expects (its own).
        expected: String,
        /// The peer's.
        found: String,
    },
    /// The registration's background task is gone (its runtime shut down).
    #[error("the registration's task has ended")]
    Closed,
    /// The backend is not in this build.
    #[error("{0}")]
    Unsupported(&'static str),
    /// An etcd call failed.
    #[cfg(feature = "etcd")]
    #[error("etcd {op}: {source}")]
    Etcd {
        /// What was being done.
        op: &'static str,
        /// etcd-client's error.
        #[source]
        source: etcd_client::Error,
    },
}

/// A change reported by a [`PeerWatch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerEvent {
    /// A record appeared, or replaced one with the same key (its contents changed).
    Added(PeerRecord),
    /// The record with this key is gone (deregistered or expired).
    Removed(PeerKey),
}

/// How a [`Registration`] is doing (see [`Registration::status`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegistrationStatus {
    /// The last registration or refresh succeeded.
    Live,
    /// The last refresh failed; the guard keeps retrying (and re-registers the record if
    /// the backend lost it).
    Retrying,
    /// Another registration took the key; this guard stopped refreshing and will not remove
    /// the other's record.
    Superseded,
}

const LIVE: u8 = 0;
const RETRYING: u8 = 1;
const SUPERSEDED: u8 = 2;

/// What a backend's registration task does: refresh (or re-create) the record, remove it.
pub(crate) trait Lease: Send + 'static {
    /// Keeps the record alive; `Ok(false)` when another registration took the key.
    fn refresh(&mut self) -> BoxFuture<'_, Result<bool, DiscoveryError>>;
    /// Removes the record (only if it is still this registration's).
    fn remove(&mut self) -> BoxFuture<'_, Result<(), DiscoveryError>>;
}

enum Stop {
    Deregister(oneshot::Sender<Result<(), DiscoveryError>>),
    Abandon,
}

/// The guard of a published record: while it lives, a background task refreshes the record
/// (every third of its TTL); dropping it removes the record in the background (best effort:
/// where that fails, the TTL removes it), and [`deregister`](Registration::deregister)
/// removes it and reports the outcome.
///
/// The task runs on the tokio runtime that registered the record; if that runtime shuts
/// down, refreshing stops and the record expires after its TTL.
#[must_use = "the record is removed when the Registration is dropped"]
pub struct Registration {
    record: PeerRecord,
    ttl: Duration,
    status: Arc<AtomicU8>,
    stop: Option<oneshot::Sender<Stop>>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("key", &self.record.key())
            .field("ttl", &self.ttl)
            .field("status", &self.status())
            .finish()
    }
}

impl Registration {
    /// Starts the refresh task for a record the backend has just published.
    pub(crate) fn spawn(record: PeerRecord, ttl: Duration, lease: impl Lease) -> Self {
        let (stop_tx, stop_rx) = oneshot::channel();
        let status = Arc::new(AtomicU8::new(LIVE));
        let interval = (ttl / 3).max(Duration::from_millis(20));
        let key = record.key();
        let task = tokio::spawn(run_lease(key, interval, lease, status.clone(), stop_rx));
        Registration {
            record,
            ttl,
            status,
            stop: Some(stop_tx),
            task: Some(task),
        }
    }

    /// The published record, with the stamp the backend gave it when it was registered
    /// ([`PeerRecord::registered`]).
    pub fn record(&self) -> &PeerRecord {
        &self.record
    }

    /// The record's key.
    pub fn key(&self) -> PeerKey {
        self.record.key()
    }

    /// The TTL the backend keeps the record for without a refresh (etcd rounds it up to
    /// whole seconds, and the server may raise it to its minimum lease TTL).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Whether the last refresh succeeded.
    pub fn status(&self) -> RegistrationStatus {
        match self.status.load(Ordering::Relaxed) {
            LIVE => RegistrationStatus::Live,
            SUPERSEDED => RegistrationStatus::Superseded,
            _ => RegistrationStatus::Retrying,
        }
    }

    /// Removes the record now and waits for the backend's answer. A record that another
    /// registration has taken over is left alone (and this returns `Ok`).
    pub async fn deregister(mut self) -> Result<(), DiscoveryError> {
        let (ack_tx, ack_rx) = oneshot::channel();
        let stop = self.stop.take().ok_or(DiscoveryError::Closed)?;
        self.task.take();
        stop.send(Stop::Deregister(ack_tx))
            .map_err(|_| DiscoveryError::Closed)?;
        ack_rx.await.map_err(|_| DiscoveryError::Closed)?
    }

    /// Stops refreshing without removing the record, as if this process had died: the record
    /// stays visible until its TTL runs out. For tests of failure handling, and for handing a
    /// key over to another process that registers it again.
    pub fn abandon(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(Stop::Abandon);
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Dropping the stop sender tells the task to remove the record and end.
        self.stop.take();
        self.task.take();
    }
}

async fn run_lease(
    key: PeerKey,
    interval: Duration,
    mut lease: impl Lease,
    status: Arc<AtomicU8>,
    mut stop: oneshot::Receiver<Stop>,
) {
    let mut superseded = false;
    let ack = loop {
        let refresh = async {
            tokio::time::sleep(interval).await;
            if superseded {
                return std::future::pending().await;
            }
            lease.refresh().await
        };
        tokio::select! {
            biased;
            s = &mut stop => match s {
                Ok(Stop::Abandon) => return,
                Ok(Stop::Deregister(ack)) => break Some(ack),
                Err(_) => break None, // the guard was dropped
            },
            r = refresh => match r {
                Ok(true) => status.store(LIVE, Ordering::Relaxed),
                Ok(false) => {
                    tracing::warn!(%key, "discovery: another registration took this key; no longer refreshing it");
                    status.store(SUPERSEDED, Ordering::Relaxed);
                    superseded = true;
                }
                Err(e) => {
                    tracing::warn!(%key, error = %e, "discovery: refreshing the registration failed; retrying");
                    status.store(RETRYING, Ordering::Relaxed);
                }
            },
        }
    };
    let result = if superseded {
        Ok(())
    } else {
        lease.remove().await
    };
    match ack {
        Some(ack) => {
            let _ = ack.send(result);
        }
        None => {
            if let Err(e) = result {
                tracing::warn!(%key, error = %e, "discovery: removing a dropped registration failed; it expires after its TTL");
            }
        }
    }
}

/// The changes to the records matching a query (see [`Discovery::watch`]). Dropping it stops
/// the watch.
pub struct PeerWatch {
    pending: VecDeque<PeerEvent>,
    rx: mpsc::Receiver<PeerEvent>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for PeerWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerWatch")
            .field("pending", &(self.pending.len() + self.rx.len()))
            .finish()
    }
}

impl PeerWatch {
    /// Starts a watch: `initial` events first, then what the `run` task sends.
    pub(crate) fn spawn<F, Fut>(initial: Vec<PeerEvent>, run: F) -> Self
    where
        F: FnOnce(mpsc::Sender<PeerEvent>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(256);
        PeerWatch {
            pending: initial.into(),
            rx,
            task: tokio::spawn(run(tx)),
        }
    }

    /// The next change; `None` only if the watch's task has ended (its runtime is shutting
    /// down).
    pub async fn next(&mut self) -> Option<PeerEvent> {
        if let Some(e) = self.pending.pop_front() {
            return Some(e);
        }
        self.rx.recv().await
    }

    /// The next change if one is already here.
    pub fn try_next(&mut self) -> Option<PeerEvent> {
        self.pending.pop_front().or_else(|| self.rx.try_recv().ok())
    }
}

impl Drop for PeerWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a watch has reported so far, to turn snapshots and backend events into changes.
pub(crate) struct Tracker {
    query: PeerQuery,
    known: BTreeMap<PeerKey, PeerRecord>,
}

impl Tracker {
    pub(crate) fn new(query: PeerQuery) -> Self {
        Tracker {
            query,
            known: BTreeMap::new(),
        }
    }

    fn wants(&self, key: &PeerKey) -> bool {
        self.query.matches_key(key)
    }

    /// A record was put: `Added` if it matches and is new or changed.
    pub(crate) fn put(&mut self, record: PeerRecord) -> Option<PeerEvent> {
        let key = record.key();
        if !self.wants(&key) || self.known.get(&key) == Some(&record) {
            return None;
        }
        self.known.insert(key, record.clone());
        Some(PeerEvent::Added(record))
    }

    /// A key was deleted: `Removed` if it had been reported.
    pub(crate) fn remove(&mut self, key: &PeerKey) -> Option<PeerEvent> {
        self.known
            .remove(key)
            .map(|_| PeerEvent::Removed(key.clone()))
    }

    /// The full set of records now: `Removed` for each reported key that is gone, then
    /// `Added` for each new or changed record.
    pub(crate) fn reconcile(&mut self, records: Vec<PeerRecord>) -> Vec<PeerEvent> {
        let now: BTreeMap<PeerKey, PeerRecord> = records
            .into_iter()
            .map(|r| (r.key(), r))
            .filter(|(k, _)| self.wants(k))
            .collect();
        let gone: Vec<PeerKey> = self
            .known
            .keys()
            .filter(|k| !now.contains_key(*k))
            .cloned()
            .collect();
        let mut events: Vec<PeerEvent> = gone.iter().filter_map(|k| self.remove(k)).collect();
        events.extend(now.into_values().filter_map(|r| self.put(r)));
        events
    }
}

/// Sends `events` in order; `false` when the watch was dropped.
pub(crate) async fn send_all(tx: &mpsc::Sender<PeerEvent>, events: Vec<PeerEvent>) -> bool {
    for e in events {
        if tx.send(e).await.is_err() {
            return false;
        }
    }
    true
}

/// Delay before the `attempt`-th retry (from 0): 100 ms doubling to 2 s.
pub(crate) fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(100u64 << attempt.min(5)).min(Duration::from_secs(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rank: u32, node: u64, addr: &str) -> PeerRecord {
        PeerRecord::new("c", Role::Prefill, rank, node, addr)
    }

    #[test]
    fn tracker_reports_differences_only() {
        let mut t = Tracker::new(PeerQuery::cluster("c").role(Role::Prefill));
        let e = t.reconcile(vec![rec(0, 1, "h:1"), rec(1, 2, "h:2")]);
        assert_eq!(e.len(), 2);
        assert!(t
            .reconcile(vec![rec(0, 1, "h:1"), rec(1, 2, "h:2")])
            .is_empty());
        let e = t.reconcile(vec![rec(0, 1, "h:9")]);
        assert_eq!(
            e,
            vec![
                PeerEvent::Removed(rec(1, 2, "h:2").key()),
                PeerEvent::Added(rec(0, 1, "h:9"))
            ]
        );
        let mut other = rec(0, 3, "h:3");
        other.role = Role::Decode;
        assert_eq!(t.put(other.clone()), None, "not matched by the query");
        assert_eq!(t.remove(&other.key()), None, "never reported");
        assert_eq!(t.put(rec(0, 1, "h:9")), None, "unchanged");
        assert_eq!(
            t.remove(&rec(0, 1, "h:9").key()),
            Some(PeerEvent::Removed(rec(0, 1, "h:9").key()))
        );
    }

    #[test]
    fn backoff_is_bounded() {
        assert_eq!(backoff(0), Duration::from_millis(100));
        assert_eq!(backoff(40), Duration::from_secs(2));
    }
}
