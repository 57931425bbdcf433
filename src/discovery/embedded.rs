//! The client of the embedded [`BootstrapServer`](super::BootstrapServer).

use std::net::SocketAddr;
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::server::{ErrorBody, Peers, RegisterBody, Registered};
use super::{
    backoff, http, send_all, sort_newest_first, BoxFuture, Discovery, DiscoveryError, Lease,
    PeerEvent, PeerKey, PeerQuery, PeerRecord, PeerWatch, Registration, Tracker,
};

/// Largest answer read from the server (a resolve of a very large cluster).
const MAX_RESPONSE: usize = 32 << 20;
/// How long one long-poll of a watch waits on the server.
const POLL_WAIT: Duration = Duration::from_secs(15);

/// [`Discovery`] through an embedded [`BootstrapServer`](super::BootstrapServer). Cheap to
/// clone; every call is one short HTTP/1.1 connection.
#[derive(Clone, Debug)]
pub struct EmbeddedDiscovery {
    server: String,
    ttl: Duration,
    request_timeout: Duration,
}

impl EmbeddedDiscovery {
    /// A client of the server at `server_addr`, registering with a 10 s TTL.
    pub fn new(server_addr: SocketAddr) -> Self {
        Self::from_host(server_addr.to_string())
    }

    /// A client of the server at `host:port` (the name is resolved at every call, so a
    /// server that moves is followed).
    pub fn from_host(server: impl Into<String>) -> Self {
        EmbeddedDiscovery {
            server: server.into(),
            ttl: Duration::from_secs(10),
            request_timeout: Duration::from_secs(5),
        }
    }

    /// The TTL of this client's registrations: a record not refreshed for this long (its
    /// node died, or lost the server) disappears. They are refreshed every third of it. The
    /// server accepts 500 ms ..= 1 h unless configured otherwise.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long one call may take (connect, send, answer; default 5 s).
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// The server's `host:port`.
    pub fn server(&self) -> &str {
        &self.server
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        target: &str,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<T, DiscoveryError> {
        let (status, answer) = http::call(
            &self.server,
            method,
            target,
            body.as_deref(),
            timeout,
            MAX_RESPONSE,
        )
        .await?;
        if status != 200 {
            let message = serde_json::from_slice::<ErrorBody>(&answer)
                .map(|e| e.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&answer).into_owned());
            return Err(DiscoveryError::Refused { status, message });
        }
        serde_json::from_slice(&answer).map_err(|e| {
            DiscoveryError::Protocol(format!("{method} {target}: unreadable answer: {e}"))
        })
    }

    /// Registers `record` (no `lease`), or refreshes the registration `lease`, first taken
    /// `age` ago.
    async fn put(
        &self,
        record: &PeerRecord,
        lease: Option<(u64, Duration)>,
    ) -> Result<Registered, DiscoveryError> {
        let body = RegisterBody {
            record: record.clone(),
            ttl_ms: u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX),
            lease: lease.map(|(l, _)| l),
            age_ms: lease.map(|(_, age)| u64::try_from(age.as_millis()).unwrap_or(u64::MAX)),
        };
        let body =
            serde_json::to_vec(&body).map_err(|e| DiscoveryError::InvalidRecord(e.to_string()))?;
        match self
            .call("PUT", "/v1/peers", Some(body), self.request_timeout)
            .await
        {
            Err(DiscoveryError::Refused { status: 409, .. }) => {
                Err(DiscoveryError::Superseded(record.key()))
            }
            other => other,
        }
    }

    async fn delete(&self, key: &PeerKey, lease: u64) -> Result<(), DiscoveryError> {
        let target = format!("/v1/peers/{key}?lease={lease}");
        match self
            .call::<serde_json::Value>("DELETE", &target, None, self.request_timeout)
            .await
        {
            // Gone already (expired), or someone else's now: nothing of ours to remove.
            Ok(_)
            | Err(DiscoveryError::Refused {
                status: 404 | 409, ..
            }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `GET /v1/peers`; with `since`, a long-poll until the generation moves on.
    async fn get(
        &self,
        query: &PeerQuery,
        since: Option<(u64, u64)>,
    ) -> Result<Peers, DiscoveryError> {
        let mut target = format!("/v1/peers?cluster={}", query.cluster);
        if let Some(role) = query.role {
            target.push_str(&format!("&role={role}"));
        }
        if let Some(rank) = query.engine_rank {
            target.push_str(&format!("&rank={rank}"));
        }
        let mut timeout = self.request_timeout;
        if let Some((generation, epoch)) = since {
            target.push_str(&format!(
                "&since={generation}&epoch={epoch}&wait_ms={}",
                POLL_WAIT.as_millis()
            ));
            timeout += POLL_WAIT;
        }
        self.call("GET", &target, None, timeout).await
    }

    /// A watch's task: long-poll, reconcile, report; retry while the server is away.
    async fn follow(
        self,
        query: PeerQuery,
        mut tracker: Tracker,
        mut at: (u64, u64),
        tx: mpsc::Sender<PeerEvent>,
    ) {
        let mut attempt = 0;
        loop {
            match self.get(&query, Some(at)).await {
                Ok(peers) => {
                    attempt = 0;
                    at = (peers.generation, peers.epoch);
                    if !send_all(&tx, tracker.reconcile(peers.records)).await {
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!(server = %self.server, error = %e, "discovery: watch poll failed; retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt += 1;
                }
            }
        }
    }
}

impl Discovery for EmbeddedDiscovery {
    fn register(
        &self,
        mut record: PeerRecord,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        Box::pin(async move {
            record.validate()?;
            // The server stamps the registration; its age counts from when it was asked.
            let since = Instant::now();
            record.registered = 0;
            let registered = self.put(&record, None).await?;
            record.registered = registered.registered;
            let ttl = Duration::from_millis(registered.ttl_ms);
            let lease = EmbeddedLease {
                client: self.clone(),
                record: record.clone(),
                lease: registered.lease,
                since,
            };
            Ok(Registration::spawn(record, ttl, lease))
        })
    }

    fn resolve(&self, query: PeerQuery) -> BoxFuture<'_, Result<Vec<PeerRecord>, DiscoveryError>> {
        Box::pin(async move {
            query.validate()?;
            let mut records = self.get(&query, None).await?.records;
            // A server older than the `registered` stamp sends key order (all stamps 0).
            sort_newest_first(&mut records);
            Ok(records)
        })
    }

    fn watch(&self, query: PeerQuery) -> BoxFuture<'_, Result<PeerWatch, DiscoveryError>> {
        Box::pin(async move {
            query.validate()?;
            let first = self.get(&query, None).await?;
            let mut tracker = Tracker::new(query.clone());
            let initial = tracker.reconcile(first.records);
            let client = self.clone();
            let at = (first.generation, first.epoch);
            Ok(PeerWatch::spawn(initial, move |tx| {
                client.follow(query, tracker, at, tx)
            }))
        })
    }
}

/// A registration on the bootstrap server: refreshed by re-sending the record with its lease
/// and its age (which also re-creates it after a server restart, as old as it was).
struct EmbeddedLease {
    client: EmbeddedDiscovery,
    record: PeerRecord,
    lease: u64,
    /// When the registration was first asked for.
    since: Instant,
}

impl Lease for EmbeddedLease {
    fn refresh(&mut self) -> BoxFuture<'_, Result<bool, DiscoveryError>> {
        Box::pin(async move {
            let age = self.since.elapsed();
            match self.client.put(&self.record, Some((self.lease, age))).await {
                Ok(_) => Ok(true),
                Err(DiscoveryError::Superseded(_)) => Ok(false),
                Err(e) => Err(e),
            }
        })
    }

    fn remove(&mut self) -> BoxFuture<'_, Result<(), DiscoveryError>> {
        Box::pin(async move { self.client.delete(&self.record.key(), self.lease).await })
    }
}
