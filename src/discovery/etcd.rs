//! Discovery through etcd (cargo feature `etcd`).
//!
//! A record is the JSON value of the key `/<prefix>/<cluster>/<role>/<rank>/<node_id>`,
//! attached to a lease of the registration's TTL that the [`Registration`] keeps alive (and
//! revokes when it is dropped or deregistered, which deletes the key). A node that dies stops
//! the keep-alives and etcd deletes its key when the lease expires. Resolve is a prefix get;
//! watch is a prefix get and an etcd watch from the revision after it.
//!
//! A record's [`PeerRecord::registered`] is its key's modification revision (etcd's own
//! order, the same for every client; it is not stored in the value): `register` puts the key
//! and so takes a new revision, a keep-alive does not touch it, and a record put back after
//! its lease expired takes a new one (it counts as a new registration). Resolve returns each
//! rank's highest revision first.

use std::future::Future;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue,
    LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp, WatchOptions, WatchStream,
};
use tokio::sync::mpsc;

use super::{
    backoff, send_all, sort_newest_first, BoxFuture, Discovery, DiscoveryError, Lease, PeerEvent,
    PeerKey, PeerQuery, PeerRecord, PeerWatch, Registration, Tracker,
};

/// Settings of an [`EtcdDiscovery`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// The first segment of every key (default `kvwire`): records live under
    /// `/<prefix>/<cluster>/`. `[A-Za-z0-9._-]` segments separated by `/`.
    pub prefix: String,
    /// The TTL of registrations' leases, rounded up to whole seconds (default 10 s; etcd
    /// raises very short ones to its minimum, about 2 s with default election settings).
    pub ttl: Duration,
    /// Time allowed for connecting (default 5 s).
    pub connect_timeout: Duration,
    /// Time allowed for one etcd call (default 5 s).
    pub request_timeout: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            prefix: "kvwire".to_owned(),
            ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
        }
    }
}

impl EtcdOptions {
    /// Sets the key prefix.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the registrations' TTL.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }
}

/// [`Discovery`] through an etcd cluster (v3 API). Cheap to clone.
#[derive(Clone)]
pub struct EtcdDiscovery {
    client: Client,
    /// `/<prefix>/`.
    root: String,
    options: EtcdOptions,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("root", &self.root)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

fn etcd(op: &'static str) -> impl FnOnce(etcd_client::Error) -> DiscoveryError {
    move |source| DiscoveryError::Etcd { op, source }
}

impl EtcdDiscovery {
    /// Connects to etcd at `endpoints` (e.g. `["http://127.0.0.1:2379"]`).
    pub async fn connect<E: AsRef<str>, S: AsRef<[E]>>(
        endpoints: S,
        options: EtcdOptions,
    ) -> Result<Self, DiscoveryError> {
        let root = root_of(&options.prefix)?;
        let connect = ConnectOptions::new()
            .with_connect_timeout(options.connect_timeout)
            .with_keep_alive(Duration::from_secs(10), options.request_timeout);
        let client = tokio::time::timeout(
            options.connect_timeout + options.request_timeout,
            Client::connect(endpoints, Some(connect)),
        )
        .await
        .map_err(|_| DiscoveryError::Timeout("connecting to etcd".into()))?
        .map_err(etcd("connect"))?;
        Ok(EtcdDiscovery {
            client,
            root,
            options,
        })
    }

    /// Uses an etcd client the caller configured (TLS, authentication...).
    pub fn with_client(client: Client, options: EtcdOptions) -> Result<Self, DiscoveryError> {
        Ok(EtcdDiscovery {
            client,
            root: root_of(&options.prefix)?,
            options,
        })
    }

    /// The etcd key of a record: `/<prefix>/<cluster>/<role>/<rank>/<node_id>`.
    pub fn key_of(&self, key: &PeerKey) -> String {
        format!("{}{key}", self.root)
    }

    /// The key prefix that holds every record `query` can match.
    fn prefix_of(&self, query: &PeerQuery) -> String {
        match (query.role, query.engine_rank) {
            (Some(role), Some(rank)) => format!("{}{}/{role}/{rank}/", self.root, query.cluster),
            (Some(role), None) => format!("{}{}/{role}/", self.root, query.cluster),
            (None, _) => format!("{}{}/", self.root, query.cluster),
        }
    }

    fn parse_key(&self, raw: &[u8]) -> Option<PeerKey> {
        let s = std::str::from_utf8(raw).ok()?;
        PeerKey::parse_path(s.strip_prefix(&self.root)?).ok()
    }

    /// The record stored in `kv`, if it is a valid one under the key it claims, stamped with
    /// the key's modification revision.
    fn decode(&self, kv: &KeyValue) -> Option<PeerRecord> {
        let key = self.parse_key(kv.key())?;
        match serde_json::from_slice::<PeerRecord>(kv.value()) {
            Ok(mut r) if r.key() == key && r.validate().is_ok() => {
                r.registered = u64::try_from(kv.mod_revision()).unwrap_or(0);
                Some(r)
            }
            _ => {
                tracing::warn!(%key, "discovery: etcd holds a value that is not a valid record for its key; ignored");
                None
            }
        }
    }

    async fn timed<T>(
        &self,
        op: &'static str,
        f: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, DiscoveryError> {
        tokio::time::timeout(self.options.request_timeout, f)
            .await
            .map_err(|_| DiscoveryError::Timeout(format!("etcd {op}")))?
            .map_err(etcd(op))
    }

    /// The matching records and the revision they were read at.
    async fn snapshot(&self, query: &PeerQuery) -> Result<(Vec<PeerRecord>, i64), DiscoveryError> {
        let mut c = self.client.clone();
        let prefix = self.prefix_of(query);
        let resp = self
            .timed("get", c.get(prefix, Some(GetOptions::new().with_prefix())))
            .await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        let mut records: Vec<PeerRecord> = resp
            .kvs()
            .iter()
            .filter_map(|kv| self.decode(kv))
            .filter(|r| query.matches(r))
            .collect();
        // etcd orders keys as strings ("10" before "2"); the trait promises rank order, each
        // rank's newest registration first.
        sort_newest_first(&mut records);
        Ok((records, revision))
    }

    async fn open_watch(
        &self,
        query: &PeerQuery,
        from: i64,
    ) -> Result<WatchStream, DiscoveryError> {
        let mut c = self.client.clone();
        let options = WatchOptions::new().with_prefix().with_start_revision(from);
        self.timed("watch", c.watch(self.prefix_of(query), Some(options)))
            .await
    }

    fn ttl_secs(&self) -> i64 {
        let ms = self.options.ttl.as_millis().max(1);
        i64::try_from(ms.div_ceil(1000)).unwrap_or(i64::MAX)
    }

    /// A watch's task: apply etcd's events; on any break, re-read and reconcile, then watch
    /// again from there.
    async fn follow(
        self,
        query: PeerQuery,
        mut tracker: Tracker,
        mut stream: Option<WatchStream>,
        tx: mpsc::Sender<PeerEvent>,
    ) {
        let mut attempt = 0;
        loop {
            if let Some(s) = stream.as_mut() {
                match s.message().await {
                    Ok(Some(resp)) if !resp.canceled() => {
                        attempt = 0;
                        let mut events = Vec::new();
                        for e in resp.events() {
                            let Some(kv) = e.kv() else { continue };
                            let event = match e.event_type() {
                                EventType::Put => match self.decode(kv) {
                                    Some(r) => tracker.put(r),
                                    None => {
                                        self.parse_key(kv.key()).and_then(|k| tracker.remove(&k))
                                    }
                                },
                                EventType::Delete => {
                                    self.parse_key(kv.key()).and_then(|k| tracker.remove(&k))
                                }
                            };
                            events.extend(event);
                        }
                        if !send_all(&tx, events).await {
                            return;
                        }
                        continue;
                    }
                    Ok(Some(resp)) => tracing::warn!(
                        reason = resp.cancel_reason(),
                        compacted = resp.compact_revision(),
                        "discovery: etcd cancelled the watch; re-reading"
                    ),
                    Ok(None) => tracing::warn!("discovery: etcd watch ended; re-reading"),
                    Err(e) => {
                        tracing::warn!(error = %e, "discovery: etcd watch failed; re-reading")
                    }
                }
                stream = None;
            }
            tokio::time::sleep(backoff(attempt)).await;
            attempt += 1;
            let resync = async {
                let (records, revision) = self.snapshot(&query).await?;
                let watch = self.open_watch(&query, revision + 1).await?;
                Ok::<_, DiscoveryError>((records, watch))
            };
            match resync.await {
                Ok((records, watch)) => {
                    if !send_all(&tx, tracker.reconcile(records)).await {
                        return;
                    }
                    stream = Some(watch);
                }
                Err(e) => tracing::warn!(error = %e, "discovery: re-reading etcd failed; retrying"),
            }
        }
    }
}

/// `/<prefix>/` from a prefix of `/`-separated `[A-Za-z0-9._-]` segments.
fn root_of(prefix: &str) -> Result<String, DiscoveryError> {
    let trimmed = prefix.trim_matches('/');
    let ok = !trimmed.is_empty()
        && trimmed.split('/').all(|seg| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        });
    if !ok {
        return Err(DiscoveryError::InvalidQuery(format!(
            "etcd prefix {prefix:?} is not /-separated segments of [A-Za-z0-9._-]"
        )));
    }
    Ok(format!("/{trimmed}/"))
}

impl Discovery for EtcdDiscovery {
    fn register(
        &self,
        mut record: PeerRecord,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        Box::pin(async move {
            record.validate()?;
            // The stamp is the key's revision, not part of the value.
            record.registered = 0;
            let value = serde_json::to_string(&record)
                .map_err(|e| DiscoveryError::InvalidRecord(e.to_string()))?;
            let key = self.key_of(&record.key());
            let mut c = self.client.clone();
            let grant = self
                .timed("lease grant", c.lease_grant(self.ttl_secs(), None))
                .await?;
            let mut lease = EtcdLease {
                discovery: self.clone(),
                key,
                value,
                id: grant.id(),
                keeper: None,
            };
            let put = async {
                let options = PutOptions::new().with_lease(lease.id);
                let put = self
                    .timed(
                        "put",
                        c.put(lease.key.clone(), lease.value.clone(), Some(options)),
                    )
                    .await?;
                lease.keep_alive_stream().await?;
                Ok::<_, DiscoveryError>(put.header().map_or(0, |h| h.revision()))
            };
            match put.await {
                // The put's revision is the key's modification revision.
                Ok(revision) => record.registered = u64::try_from(revision).unwrap_or(0),
                Err(e) => {
                    let _ = lease.remove().await;
                    return Err(e);
                }
            }
            let ttl = Duration::from_secs(u64::try_from(grant.ttl()).unwrap_or(1));
            Ok(Registration::spawn(record, ttl, lease))
        })
    }

    fn resolve(&self, query: PeerQuery) -> BoxFuture<'_, Result<Vec<PeerRecord>, DiscoveryError>> {
        Box::pin(async move {
            query.validate()?;
            Ok(self.snapshot(&query).await?.0)
        })
    }

    fn watch(&self, query: PeerQuery) -> BoxFuture<'_, Result<PeerWatch, DiscoveryError>> {
        Box::pin(async move {
            query.validate()?;
            let (records, revision) = self.snapshot(&query).await?;
            let stream = self.open_watch(&query, revision + 1).await?;
            let mut tracker = Tracker::new(query.clone());
            let initial = tracker.reconcile(records);
            let this = self.clone();
            Ok(PeerWatch::spawn(initial, move |tx| {
                this.follow(query, tracker, Some(stream), tx)
            }))
        })
    }
}

/// A registration in etcd: the key under a lease kept alive here.
struct EtcdLease {
    discovery: EtcdDiscovery,
    key: String,
    value: String,
    id: i64,
    keeper: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
}

impl EtcdLease {
    async fn keep_alive_stream(&mut self) -> Result<(), DiscoveryError> {
        let mut c = self.discovery.client.clone();
        let keeper = self
            .discovery
            .timed("lease keep-alive", c.lease_keep_alive(self.id))
            .await?;
        self.keeper = Some(keeper);
        Ok(())
    }

    /// One keep-alive round trip; `Ok(false)` if the lease is gone (expired).
    async fn keep_alive(&mut self) -> Result<bool, DiscoveryError> {
        if self.keeper.is_none() {
            self.keep_alive_stream().await?;
        }
        let Some((keeper, stream)) = self.keeper.as_mut() else {
            return Err(DiscoveryError::Closed);
        };
        let round = async {
            keeper.keep_alive().await?;
            stream.message().await
        };
        match tokio::time::timeout(self.discovery.options.request_timeout, round).await {
            Ok(Ok(Some(resp))) => Ok(resp.ttl() > 0),
            Ok(Ok(None)) => {
                self.keeper = None;
                Err(DiscoveryError::Protocol(
                    "etcd ended the keep-alive stream".into(),
                ))
            }
            Ok(Err(e)) => {
                self.keeper = None;
                Err(etcd("lease keep-alive")(e))
            }
            Err(_) => {
                self.keeper = None;
                Err(DiscoveryError::Timeout("etcd lease keep-alive".into()))
            }
        }
    }

    /// The lease expired (and took the key with it): a new lease, and the key again unless
    /// another registration has put it meanwhile. `Ok(false)` in that case.
    async fn recreate(&mut self) -> Result<bool, DiscoveryError> {
        let d = self.discovery.clone();
        let mut c = d.client.clone();
        let grant = d
            .timed("lease grant", c.lease_grant(d.ttl_secs(), None))
            .await?;
        let txn = Txn::new()
            .when([Compare::version(self.key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                self.key.clone(),
                self.value.clone(),
                Some(PutOptions::new().with_lease(grant.id())),
            )]);
        let old = std::mem::replace(&mut self.id, grant.id());
        self.keeper = None;
        let done = d.timed("txn", c.txn(txn)).await;
        match done {
            Ok(r) if r.succeeded() => {
                tracing::warn!(key = %self.key, old_lease = old, lease = self.id, "discovery: etcd lease had expired; registered again");
                self.keep_alive_stream().await?;
                Ok(true)
            }
            Ok(_) => {
                let _ = self.remove().await;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

impl Lease for EtcdLease {
    fn refresh(&mut self) -> BoxFuture<'_, Result<bool, DiscoveryError>> {
        Box::pin(async move {
            if self.keep_alive().await? {
                Ok(true)
            } else {
                self.recreate().await
            }
        })
    }

    fn remove(&mut self) -> BoxFuture<'_, Result<(), DiscoveryError>> {
        Box::pin(async move {
            self.keeper = None;
            let mut c = self.discovery.client.clone();
            match self
                .discovery
                .timed("lease revoke", c.lease_revoke(self.id))
                .await
            {
                Ok(_) => Ok(()),
                // Already expired: its keys are gone with it.
                Err(DiscoveryError::Etcd {
                    source: etcd_client::Error::GRpcStatus(s),
                    ..
                }) if i32::from(s.code()) == GRPC_NOT_FOUND => Ok(()),
                Err(e) => Err(e),
            }
        })
    }
}

/// etcd answers "requested lease not found" with gRPC status NOT_FOUND.
const GRPC_NOT_FOUND: i32 = 5;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        assert_eq!(root_of("kvwire").unwrap(), "/kvwire/");
        assert_eq!(root_of("/a/b-c/").unwrap(), "/a/b-c/");
        for bad in ["", "/", "a//b", "a/../b", "a b"] {
            assert!(root_of(bad).is_err(), "{bad:?}");
        }
    }
}
