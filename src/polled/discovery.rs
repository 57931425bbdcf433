//! Peer discovery from the facade ([`crate::discovery`]): a manager publishes itself with
//! the embedded bootstrap server or etcd (feature `etcd`) and resolves its peers there, a
//! peer whose layout fingerprint differs from its own refused before it is dialled (fail
//! closed); and the embedded bootstrap server on a runtime of its own.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Error, ErrorKind, Manager, Role};
pub use crate::discovery::DiscoveryBackend;
use crate::discovery::{
    connect, Discovery, DiscoveryError, PeerQuery, PeerRecord, Role as PeerRole,
};

impl Error {
    /// A discovery call's failure.
    pub fn from_discovery(e: &DiscoveryError) -> Self {
        match e {
            DiscoveryError::LayoutMismatch { .. } => {
                Self::new(ErrorKind::LayoutMismatch, e.to_string())
            }
            _ => Self::new(ErrorKind::DiscoveryError, e.to_string()),
        }
    }
}

fn peer_role(role: Role) -> PeerRole {
    match role {
        Role::Prefill => PeerRole::Prefill,
        Role::Decode => PeerRole::Decode,
    }
}

impl Manager {
    /// The fingerprint of this node's KV layout and model fingerprint, as discovery records
    /// carry it.
    pub fn layout_fingerprint(&self) -> String {
        self.node().layout_fingerprint()
    }

    /// A client of `backend` (etcd: connected within the call timeout).
    fn backend(
        &self,
        backend: &DiscoveryBackend,
        ttl: Duration,
    ) -> Result<Arc<dyn Discovery>, Error> {
        let backend = backend.clone();
        self.block(
            async move { connect(&backend, ttl).await },
            self.config().call_timeout,
        )?
        .map_err(|e| Error::from_discovery(&e))
    }

    /// Publishes this node in `cluster` as engine rank `rank`, reachable at `address` (by
    /// default where it listens, [`Manager::listen`]); the record lives while the manager
    /// does (refreshed), and expires `ttl` after the process died. Blocks for the round trip.
    pub fn register(
        &self,
        backend: &DiscoveryBackend,
        cluster: &str,
        rank: u32,
        ttl: Duration,
        address: Option<&str>,
    ) -> Result<(), Error> {
        let address = match address {
            Some(a) => a.to_owned(),
            None => self
                .listen_addr()
                .ok_or_else(|| {
                    Error::invalid("no address to publish (listen first, or name the address)")
                })?
                .to_string(),
        };
        let record = self
            .node()
            .peer_record(cluster, peer_role(self.role()), rank, address);
        let disc = self.backend(backend, ttl)?;
        let reg = self
            .block(
                async move { disc.register(record).await },
                self.config().call_timeout,
            )?
            .map_err(|e| Error::from_discovery(&e))?;
        self.registrations().push(reg);
        Ok(())
    }

    /// Removes this node's records now and waits until they are gone (at most 5 s each;
    /// they also go, without waiting, when the manager is dropped).
    pub fn deregister(&self) {
        let regs = std::mem::take(&mut *self.registrations());
        for r in regs {
            let _ = self.block(r.deregister(), Duration::from_secs(5));
        }
    }

    /// The peers of `role` registered in `cluster` (of one engine rank, or every rank), by
    /// rank and, within a rank, the newest registration first: a node restarted under a new
    /// node id comes before its dead predecessor's record (which stays until its TTL runs
    /// out), so the first record of a rank is the one to dial.
    /// With `check_layout`, a peer whose layout fingerprint differs from this node's fails
    /// the call with [`ErrorKind::LayoutMismatch`] (fail closed) instead of being returned.
    pub fn resolve(
        &self,
        backend: &DiscoveryBackend,
        cluster: &str,
        role: Role,
        rank: Option<u32>,
        check_layout: bool,
    ) -> Result<Vec<PeerRecord>, Error> {
        let mut query = PeerQuery::cluster(cluster).role(peer_role(role));
        if let Some(r) = rank {
            query = query.rank(r);
        }
        let disc = self.backend(backend, Duration::from_secs(10))?;
        let node = self.node().clone();
        let found = self
            .block(
                async move { node.resolve(disc.as_ref(), query, check_layout).await },
                self.config().call_timeout,
            )?
            .map_err(|e| match e {
                DiscoveryError::LayoutMismatch { .. } => {
                    Error::new(ErrorKind::LayoutMismatch, e.to_string())
                }
                e => Error::from_discovery(&e),
            })?;
        Ok(found)
    }
}

/// kvwire's embedded bootstrap server ([`crate::discovery::BootstrapServer`]: HTTP/1.1 +
/// JSON), on a small runtime of its own.
#[derive(Debug)]
pub struct BootstrapServer {
    server: Mutex<Option<crate::discovery::BootstrapServer>>,
    addr: SocketAddr,
    runtime: tokio::runtime::Runtime,
}

impl BootstrapServer {
    /// Binds `addr` (`host:port`; port 0 for any) and starts serving.
    pub fn bind(addr: &str) -> Result<Self, Error> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvwire-bootstrap")
            .enable_all()
            .build()
            .map_err(|e| Error::new(ErrorKind::ConfigError, format!("runtime: {e}")))?;
        let (server, local) = runtime
            .block_on(crate::discovery::BootstrapServer::bind(addr))
            .map_err(|e| {
                Error::new(
                    ErrorKind::ConnectFailed,
                    format!("bootstrap server on {addr}: {e}"),
                )
            })?;
        Ok(Self {
            server: Mutex::new(Some(server)),
            addr: local,
            runtime,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Records held now (0 once closed).
    pub fn record_count(&self) -> usize {
        self.lock().as_ref().map_or(0, |s| s.record_count())
    }

    /// Stops the server (and waits until it stopped); calling it again does nothing.
    pub fn close(&self) {
        let server = self.lock().take();
        if let Some(s) = server {
            self.runtime.block_on(s.shutdown());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<crate::discovery::BootstrapServer>> {
        self.server.lock().unwrap_or_else(|p| p.into_inner())
    }
}
