//! The embedded bootstrap server: prefill (and decode) nodes register their records with a
//! TTL and refresh them; peers resolve them, or long-poll for changes.
//!
//! HTTP/1.1, one request per connection, JSON bodies:
//!
//! | request | answer |
//! |---|---|
//! | `PUT /v1/peers` `{"record": PeerRecord, "ttl_ms": n, "lease": l?, "age_ms": a?}` | `200 {"lease", "ttl_ms", "generation", "registered"}`; `409` if `lease` is given and the key is held by another lease; `503` when full |
//! | `DELETE /v1/peers/<cluster>/<role>/<rank>/<node_id>?lease=l` | `200 {"removed": true}`; `404` absent; `409` held by another lease |
//! | `GET /v1/peers?cluster=c[&role=r][&rank=n]` | `200 {"epoch", "generation", "records": [...]}`, each rank's newest registration first |
//! | the same with `&since=g&epoch=e[&wait_ms=w]` | as above, once the generation is no longer `g` (or the epoch not `e`), or after `w` ms |
//! | `GET /v1/health` | `200 {"status": "ok", "epoch", "generation", "records"}` |
//!
//! A `PUT` without a lease creates or replaces the record under a fresh lease; with its lease
//! it refreshes (or re-creates, after a server restart) the record. Errors are
//! `{"error": "..."}` with a 4xx status: malformed requests, unknown paths and methods,
//! oversized heads or bodies and slow clients never stop the server.
//!
//! Registration order: the server stamps each record's `registered` field with the time it
//! took the registration, in Unix milliseconds on its clock (new registrations get strictly
//! increasing stamps, so two never tie); what a client sends there is ignored, but for the
//! one case below. A `PUT` without a lease is a new registration and takes a new stamp,
//! even when it replaces a record of the same key; a refresh keeps the stamp; a re-creation
//! (a `PUT` with a lease the server does not hold, after a restart or an expiry) is stamped
//! `age_ms` before now, `age_ms` being how long the client has held its registration on
//! its own clock, so a server restart does not reorder live registrations. (Where the
//! record's own `registered`, the stamp an earlier server gave it, is within 1 s of that,
//! it is kept as is: a server restarted on the same clock gets the record back unchanged,
//! and watches see no change.) `GET` lists records by role and rank, each rank's newest
//! registration (largest `registered`) first, then by node id. Older clients ignore the
//! field; an older server's records lack it (it reads as 0).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{watch, Notify, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use super::http::{self, ReadError, Request};
use super::record::parse_decimal;
use super::{sort_newest_first, PeerKey, PeerQuery, PeerRecord, Role};

/// Limits and timings of a [`BootstrapServer`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BootstrapConfig {
    /// Shortest TTL a registration may ask for (default 500 ms).
    pub min_ttl: Duration,
    /// Longest TTL a registration may ask for (default 1 hour).
    pub max_ttl: Duration,
    /// Most records held at once; registering a new key beyond it is refused with 503
    /// (default 65,536).
    pub max_records: usize,
    /// Largest request body (default 64 KiB).
    pub max_body_bytes: usize,
    /// Largest request line plus headers (default 8 KiB).
    pub max_head_bytes: usize,
    /// Time a client has to send its whole request, and to take the whole answer; a slower
    /// one gets 408 and is disconnected (default 10 s).
    pub request_timeout: Duration,
    /// Longest long-poll of a watch (default 30 s).
    pub max_wait: Duration,
    /// Most connections served at once; further ones wait in the listen backlog (default
    /// 1,024).
    pub max_connections: usize,
}

impl Default for BootstrapConfig {
    fn default() -> Self {
        BootstrapConfig {
            min_ttl: Duration::from_millis(500),
            max_ttl: Duration::from_secs(3600),
            max_records: 65_536,
            max_body_bytes: 64 * 1024,
            max_head_bytes: 8 * 1024,
            request_timeout: Duration::from_secs(10),
            max_wait: Duration::from_secs(30),
            max_connections: 1024,
        }
    }
}

/// Body of `PUT /v1/peers`.
#[derive(Serialize, Deserialize)]
pub(crate) struct RegisterBody {
    pub record: PeerRecord,
    pub ttl_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<u64>,
    /// With `lease`: how long ago (on the client's clock) the registration was first taken,
    /// for a record re-created after a server restart to keep its place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_ms: Option<u64>,
}

/// Answer to `PUT /v1/peers`.
#[derive(Serialize, Deserialize)]
pub(crate) struct Registered {
    pub lease: u64,
    pub ttl_ms: u64,
    pub generation: u64,
    /// The record's stamp (0 from a server older than it).
    #[serde(default)]
    pub registered: u64,
}

/// Answer to `GET /v1/peers`.
#[derive(Serialize, Deserialize)]
pub(crate) struct Peers {
    pub epoch: u64,
    pub generation: u64,
    pub records: Vec<PeerRecord>,
}

/// An error answer's body.
#[derive(Serialize, Deserialize)]
pub(crate) struct ErrorBody {
    pub error: String,
}

/// How far a re-created record's own stamp may be from the one its age gives, for the
/// server to keep it (round trips and scheduling; clocks of different hosts differ more).
const RESTAMP_SLACK_MS: u64 = 1000;

struct Entry {
    record: PeerRecord,
    lease: u64,
    expires: Instant,
}

struct Table {
    generation: u64,
    records: BTreeMap<PeerKey, Entry>,
    /// The last stamp given to a new registration.
    last_stamp: u64,
}

struct State {
    config: BootstrapConfig,
    /// Random per server instance: a client long-polling across a restart notices it.
    epoch: u64,
    table: Mutex<Table>,
    /// The generation, for long-polls to wait on.
    generation: watch::Sender<u64>,
    /// Woken when a record with a new expiry is added.
    reaper: Notify,
    shutdown: watch::Receiver<bool>,
    /// The wall clock (Unix ms) when the server started, and the monotonic instant of that
    /// moment: stamps follow the monotonic clock, so a step of the wall clock cannot
    /// reorder registrations.
    started_unix_ms: u64,
    started: Instant,
}

impl State {
    fn table(&self) -> MutexGuard<'_, Table> {
        // Nothing panics while holding the lock; recover the data if something ever did.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bumps the generation after a change (called with the table locked).
    fn changed(&self, table: &mut Table) {
        table.generation += 1;
        self.generation.send_replace(table.generation);
    }

    /// The stamp of a registration taken now (`recreated` `None`; strictly increasing), or
    /// of a re-created one: first taken `age` ms ago, and stamped `claimed` by a server
    /// before (0 if unknown). The claimed stamp is kept where it agrees with the age (the
    /// same clock: the record comes back unchanged); otherwise the age decides (another
    /// host's clock, or a client that got it wrong).
    fn stamp(&self, table: &mut Table, recreated: Option<(u64, u64)>) -> u64 {
        let elapsed = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let now = self.started_unix_ms.saturating_add(elapsed);
        let stamp = match recreated {
            Some((age, claimed)) => {
                let aged = now.saturating_sub(age).max(1);
                if claimed != 0 && claimed.abs_diff(aged) <= RESTAMP_SLACK_MS {
                    claimed
                } else {
                    aged
                }
            }
            None => now.max(table.last_stamp + 1),
        };
        table.last_stamp = table.last_stamp.max(stamp);
        stamp
    }

    /// Removes expired records; returns the earliest remaining expiry.
    fn expire(&self, now: Instant) -> Option<Instant> {
        let mut t = self.table();
        let before = t.records.len();
        t.records.retain(|key, e| {
            let keep = e.expires > now;
            if !keep {
                tracing::info!(%key, "bootstrap: registration expired");
            }
            keep
        });
        if t.records.len() != before {
            self.changed(&mut t);
        }
        t.records.values().map(|e| e.expires).min()
    }
}

/// The embedded bootstrap server. Runs on the tokio runtime that bound it, until
/// [`shutdown`](BootstrapServer::shutdown) or drop. It keeps everything in memory: after a
/// restart, live registrations re-create their records at their next refresh.
pub struct BootstrapServer {
    addr: SocketAddr,
    state: Arc<State>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for BootstrapServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl BootstrapServer {
    /// Binds `addr` (port 0 for any free port) with the default [`BootstrapConfig`] and
    /// starts serving; returns the server and the address it listens on.
    pub async fn bind(addr: impl ToSocketAddrs) -> std::io::Result<(Self, SocketAddr)> {
        Self::bind_with(addr, BootstrapConfig::default()).await
    }

    /// [`bind`](BootstrapServer::bind) with explicit limits.
    pub async fn bind_with(
        addr: impl ToSocketAddrs,
        config: BootstrapConfig,
    ) -> std::io::Result<(Self, SocketAddr)> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let epoch = u64::from_le_bytes(crate::config::random_bytes()?);
        let (stop, shutdown) = watch::channel(false);
        let state = Arc::new(State {
            config,
            epoch,
            table: Mutex::new(Table {
                generation: 0,
                records: BTreeMap::new(),
                last_stamp: 0,
            }),
            generation: watch::channel(0).0,
            reaper: Notify::new(),
            shutdown,
            started_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            started: Instant::now(),
        });
        let task = tokio::spawn(serve(listener, state.clone()));
        tracing::info!(addr = %local, "bootstrap server listening");
        Ok((
            BootstrapServer {
                addr: local,
                state,
                stop,
                task: Some(task),
            },
            local,
        ))
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Records held now (expired ones may linger until the next expiry pass).
    pub fn record_count(&self) -> usize {
        self.state.table().records.len()
    }

    /// Stops accepting, ends every connection (long-polls included) and waits for the
    /// server's tasks to end.
    pub async fn shutdown(mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

async fn serve(listener: TcpListener, state: Arc<State>) {
    let mut shutdown = state.shutdown.clone();
    let permits = Arc::new(Semaphore::new(state.config.max_connections.max(1)));
    let mut connections = JoinSet::new();
    let mut reaper = tokio::spawn(reap(state.clone()));
    loop {
        // Reap finished connection tasks so the set does not grow.
        while connections.try_join_next().is_some() {}
        let permit = tokio::select! {
            _ = shutdown.wait_for(|s| *s) => break,
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|s| *s) => break,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                let state = state.clone();
                connections.spawn(async move {
                    connection(stream, peer, &state).await;
                    drop(permit);
                });
            }
            Err(e) => {
                // Out of file descriptors and the like: do not spin.
                tracing::warn!(error = %e, "bootstrap: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    reaper.abort();
    let _ = (&mut reaper).await;
    connections.shutdown().await;
    tracing::info!("bootstrap server stopped");
}

async fn reap(state: Arc<State>) {
    loop {
        let next = state.expire(Instant::now());
        let far = Instant::now() + Duration::from_secs(3600);
        tokio::select! {
            _ = tokio::time::sleep_until(next.unwrap_or(far)) => {}
            _ = state.reaper.notified() => {}
        }
    }
}

async fn connection(mut stream: TcpStream, peer: SocketAddr, state: &State) {
    let config = &state.config;
    let read = tokio::time::timeout(
        config.request_timeout,
        http::read_request(&mut stream, config.max_head_bytes, config.max_body_bytes),
    )
    .await;
    let (status, body) = match read {
        Err(_) => error(408, "request not received in time".into()),
        Ok(Err(ReadError::Io(e))) if e.kind() != std::io::ErrorKind::UnexpectedEof => {
            tracing::debug!(%peer, error = %e, "bootstrap: connection failed");
            return;
        }
        Ok(Err(e)) => {
            let (status, message) = e.status();
            tracing::debug!(%peer, status, %message, "bootstrap: bad request");
            error(status, message)
        }
        Ok(Ok(request)) => route(state, request).await,
    };
    let write = async {
        http::write_response(&mut stream, status, &body).await?;
        stream.shutdown().await
    };
    if let Err(e) = tokio::time::timeout(config.request_timeout, write)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
    {
        tracing::debug!(%peer, error = %e, "bootstrap: answer not delivered");
    }
}

type Answer = (u16, Vec<u8>);

fn error(status: u16, message: String) -> Answer {
    json(status, &ErrorBody { error: message })
}

fn json<T: Serialize>(status: u16, value: &T) -> Answer {
    match serde_json::to_vec(value) {
        Ok(body) => (status, body),
        Err(e) => (500, format!("{{\"error\":\"{e}\"}}").into_bytes()),
    }
}

async fn route(state: &State, req: Request) -> Answer {
    const PEERS: &str = "/v1/peers";
    let path = req.path.as_str();
    match (req.method.as_str(), path) {
        ("PUT", PEERS) => register(state, &req),
        ("GET", PEERS) => peers(state, &req).await,
        ("GET", "/v1/health") => {
            let t = state.table();
            json(
                200,
                &serde_json::json!({
                    "status": "ok",
                    "epoch": state.epoch,
                    "generation": t.generation,
                    "records": t.records.len(),
                }),
            )
        }
        ("DELETE", p) if p.starts_with("/v1/peers/") => deregister(state, &req),
        (_, PEERS | "/v1/health") => error(405, format!("{} not allowed on {path}", req.method)),
        (_, p) if p.starts_with("/v1/peers/") => {
            error(405, format!("{} not allowed on {path}", req.method))
        }
        _ => error(404, format!("no such resource: {path}")),
    }
}

fn register(state: &State, req: &Request) -> Answer {
    let body: RegisterBody = match serde_json::from_slice(&req.body) {
        Ok(b) => b,
        Err(e) => return error(400, format!("bad registration body: {e}")),
    };
    if let Err(e) = body.record.validate() {
        return error(400, e.to_string());
    }
    let config = &state.config;
    let ttl = Duration::from_millis(body.ttl_ms);
    if ttl < config.min_ttl || ttl > config.max_ttl {
        return error(
            400,
            format!(
                "ttl_ms {} is outside {}..={}",
                body.ttl_ms,
                config.min_ttl.as_millis(),
                config.max_ttl.as_millis()
            ),
        );
    }
    let lease = match body.lease {
        Some(l) => l,
        None => match crate::config::random_bytes() {
            Ok(b) => u64::from_le_bytes(b),
            Err(e) => return error(500, format!("no random lease id: {e}")),
        },
    };
    let mut record = body.record;
    let key = record.key();
    let expires = Instant::now() + ttl;
    let mut t = state.table();
    let refresh = body.lease.is_some();
    match t.records.get(&key) {
        Some(e) if refresh && e.lease != lease => {
            return error(409, format!("{key} is held by another registration"));
        }
        None if t.records.len() >= config.max_records => {
            return error(503, format!("full: {} records", t.records.len()));
        }
        _ => {}
    }
    let stamp = match t.records.get(&key) {
        // A refresh: the same registration, its stamp unchanged.
        Some(e) if refresh => e.record.registered,
        // A re-creation (the server restarted, or the record expired): as old as the client
        // says its registration is. Without an age (an older client), as new.
        None if refresh => state.stamp(&mut t, body.age_ms.map(|a| (a, record.registered))),
        // A new registration, possibly replacing a record of the same key.
        _ => state.stamp(&mut t, None),
    };
    record.registered = stamp;
    let generation = match t.records.get_mut(&key) {
        Some(e) => {
            let changed = e.record != record || e.lease != lease;
            e.expires = expires;
            e.lease = lease;
            if changed {
                e.record = record;
                state.changed(&mut t);
                tracing::info!(%key, "bootstrap: registration replaced");
            }
            t.generation
        }
        None => {
            tracing::info!(%key, address = %record.address, "bootstrap: registered");
            t.records.insert(
                key,
                Entry {
                    record,
                    lease,
                    expires,
                },
            );
            state.changed(&mut t);
            t.generation
        }
    };
    drop(t);
    // The reaper sleeps until the earliest expiry; this one may be earlier.
    state.reaper.notify_one();
    json(
        200,
        &Registered {
            lease,
            ttl_ms: body.ttl_ms,
            generation,
            registered: stamp,
        },
    )
}

fn deregister(state: &State, req: &Request) -> Answer {
    let key = match PeerKey::parse_path(&req.path["/v1/peers/".len()..]) {
        Ok(k) => k,
        Err(e) => return error(400, e.to_string()),
    };
    let Some(lease) = req.param("lease").and_then(parse_decimal::<u64>) else {
        return error(400, "a decimal lease parameter is required".into());
    };
    let mut t = state.table();
    match t.records.get(&key) {
        None => error(404, format!("{key} is not registered")),
        Some(e) if e.lease != lease => error(409, format!("{key} is held by another registration")),
        Some(_) => {
            t.records.remove(&key);
            state.changed(&mut t);
            tracing::info!(%key, "bootstrap: deregistered");
            json(
                200,
                &serde_json::json!({ "removed": true, "generation": t.generation }),
            )
        }
    }
}

fn query_of(req: &Request) -> Result<PeerQuery, String> {
    let cluster = req
        .param("cluster")
        .ok_or("the cluster parameter is required")?;
    let mut query = PeerQuery::cluster(cluster);
    query.validate().map_err(|e| e.to_string())?;
    if let Some(role) = req.param("role") {
        query.role = Some(role.parse::<Role>().map_err(|e| e.to_string())?);
    }
    if let Some(rank) = req.param("rank") {
        query.engine_rank = Some(parse_decimal(rank).ok_or(format!("rank {rank:?} is not a u32"))?);
    }
    Ok(query)
}

fn number(req: &Request, name: &str) -> Result<Option<u64>, String> {
    req.param(name)
        .map(|v| parse_decimal(v).ok_or(format!("{name} {v:?} is not a u64")))
        .transpose()
}

async fn peers(state: &State, req: &Request) -> Answer {
    let (query, since, epoch, wait) = match (|| {
        Ok::<_, String>((
            query_of(req)?,
            number(req, "since")?,
            number(req, "epoch")?,
            number(req, "wait_ms")?,
        ))
    })() {
        Ok(v) => v,
        Err(e) => return error(400, e),
    };
    if let Some(since) = since {
        let mut generation = state.generation.subscribe();
        let unchanged =
            *generation.borrow_and_update() == since && epoch.is_none_or(|e| e == state.epoch);
        if unchanged {
            let wait = wait
                .map(Duration::from_millis)
                .unwrap_or(state.config.max_wait)
                .min(state.config.max_wait);
            let mut shutdown = state.shutdown.clone();
            tokio::select! {
                _ = generation.changed() => {}
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.wait_for(|s| *s) => {}
            }
        }
    }
    let now = Instant::now();
    let t = state.table();
    let mut records: Vec<PeerRecord> = t
        .records
        .range(range_start(&query)..)
        .take_while(|(k, _)| k.cluster == query.cluster)
        // Expired but not yet reaped: already gone for readers.
        .filter(|(k, e)| query.matches_key(k) && e.expires > now)
        .map(|(_, e)| e.record.clone())
        .collect();
    let generation = t.generation;
    drop(t);
    sort_newest_first(&mut records);
    json(
        200,
        &Peers {
            epoch: state.epoch,
            generation,
            records,
        },
    )
}

/// The smallest key of `query`'s cluster (keys sort by cluster first).
fn range_start(query: &PeerQuery) -> PeerKey {
    PeerKey {
        cluster: query.cluster.clone(),
        role: Role::Prefill,
        engine_rank: 0,
        node_id: 0,
    }
}
