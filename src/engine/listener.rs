//! A listener that keeps serving: it accepts connections for one role of a node, runs their
//! handshakes concurrently (at most [`ListenerConfig::max_handshakes`] at once, each bounded
//! by the node's handshake timeout), and hands out only the connections whose handshake
//! succeeded. A port scan, an HTTP health check, a peer with the wrong key or layout, or a
//! client that connects and says nothing costs one handshake slot for at most the handshake
//! timeout: it is logged (rate-limited), counted, and dropped, and the listener goes on.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, Semaphore};

use super::{EngineError, Node, ReceiverConn, SenderConn};
use crate::metrics::Metrics;

/// How a [`Listener`] runs handshakes.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ListenerConfig {
    /// Handshakes running at once; connections beyond wait in the kernel's backlog. A
    /// connection over several TCP streams (`NodeConfig::tcp_streams`) gives its slot back
    /// once its handshake succeeded, while it waits for its extra streams (each of which
    /// takes a slot briefly to be read), so such connections cannot hold every slot.
    pub max_handshakes: usize,
    /// At most one log line per this interval for failed handshakes (the others are
    /// counted and summed into the next line).
    pub log_interval: Duration,
}

impl Default for ListenerConfig {
    fn default() -> Self {
        Self {
            max_handshakes: 64,
            log_interval: Duration::from_secs(1),
        }
    }
}

/// Counters of a listener.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerStats {
    /// TCP connections accepted.
    pub accepted: u64,
    /// Handshakes that succeeded (connections handed out, or waiting to be).
    pub established: u64,
    /// Handshakes that failed: refused by either side (wrong key, layout, version, ...), and
    /// joining streams that name no connection of this node.
    pub refused: u64,
    /// Handshakes that failed on bytes that are not kvwire frames (a port scan, HTTP).
    pub malformed: u64,
    /// Handshakes that failed on I/O, a timeout (a stalled client) or the transport.
    pub failed: u64,
    /// Accepted streams that were not connections of their own but joined one as one of its
    /// extra TCP streams (`NodeConfig::tcp_streams`).
    pub joined: u64,
}

#[derive(Default)]
struct Counters {
    joined: AtomicU64,
    accepted: AtomicU64,
    established: AtomicU64,
    refused: AtomicU64,
    malformed: AtomicU64,
    failed: AtomicU64,
}

/// Accepts connections of one role (`C` is [`ReceiverConn`] or [`SenderConn`]) for a node.
/// Dropping it stops accepting; connections already handed out live on.
pub struct Listener<C> {
    addr: SocketAddr,
    ready: mpsc::Receiver<C>,
    counters: Arc<Counters>,
    accept_loop: tokio::task::JoinHandle<()>,
}

impl<C> std::fmt::Debug for Listener<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("addr", &self.addr)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl<C> Drop for Listener<C> {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

impl Listener<ReceiverConn> {
    /// Listens on `addr` for prefill nodes; each connection is the decode end over `node`.
    pub async fn receivers(
        addr: impl ToSocketAddrs,
        node: &Node,
        config: ListenerConfig,
    ) -> std::io::Result<Self> {
        Self::receivers_on(Arc::new(TcpListener::bind(addr).await?), node, config)
    }

    /// As [`Listener::receivers`], on a socket that is already listening (shared: dropping
    /// the listener stops accepting but leaves the socket to its other owners).
    pub fn receivers_on(
        socket: Arc<TcpListener>,
        node: &Node,
        config: ListenerConfig,
    ) -> std::io::Result<Self> {
        let node = node.clone();
        let metrics = node.config().metrics.clone();
        Self::start(socket, config, metrics, move |s| {
            let node = node.clone();
            async move { ReceiverConn::start(s, &node, false).await }
        })
    }
}

impl Listener<SenderConn> {
    /// Listens on `addr` for decode nodes; each connection is the prefill end over `node`.
    pub async fn senders(
        addr: impl ToSocketAddrs,
        node: &Node,
        config: ListenerConfig,
    ) -> std::io::Result<Self> {
        Self::senders_on(Arc::new(TcpListener::bind(addr).await?), node, config)
    }

    /// As [`Listener::senders`], on a socket that is already listening.
    pub fn senders_on(
        socket: Arc<TcpListener>,
        node: &Node,
        config: ListenerConfig,
    ) -> std::io::Result<Self> {
        let node = node.clone();
        let metrics = node.config().metrics.clone();
        Self::start(socket, config, metrics, move |s| {
            let node = node.clone();
            async move { SenderConn::start(s, &node, false).await }
        })
    }
}

impl<C: Send + 'static> Listener<C> {
    fn start<F, Fut>(
        listener: Arc<TcpListener>,
        config: ListenerConfig,
        metrics: Option<Arc<Metrics>>,
        start: F,
    ) -> std::io::Result<Self>
    where
        F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<C, EngineError>> + Send + 'static,
    {
        let addr = listener.local_addr()?;
        let counters = Arc::new(Counters::default());
        let (tx, ready) = mpsc::channel(config.max_handshakes.max(1));
        let accept_loop = tokio::spawn(accept_loop(
            listener,
            config,
            Arc::new(start),
            tx,
            counters.clone(),
            metrics,
        ));
        Ok(Self {
            addr,
            ready,
            counters,
            accept_loop,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next connection whose handshake succeeded. `None` only if the listening socket
    /// failed for good.
    pub async fn accept(&mut self) -> Option<C> {
        self.ready.recv().await
    }
}

impl<C> Listener<C> {
    /// Counters.
    pub fn stats(&self) -> ListenerStats {
        let c = &self.counters;
        ListenerStats {
            accepted: c.accepted.load(Ordering::Relaxed),
            joined: c.joined.load(Ordering::Relaxed),
            established: c.established.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            malformed: c.malformed.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
        }
    }
}

/// How a failed handshake counts in [`ListenerStats`]: `"refused"` (by either side: wrong
/// key, layout, version), `"malformed"` (bytes that are not kvwire frames) or `"failed"`
/// (I/O, a timeout, the transport).
pub(crate) fn failure_class(e: &EngineError) -> &'static str {
    use kvwire_proto::handshake::HandshakeError as H;
    match e {
        EngineError::Handshake(H::Refused(_) | H::RefusedByPeer(_)) | EngineError::StrayJoin(_) => {
            "refused"
        }
        EngineError::Handshake(H::Unexpected(_)) | EngineError::Stream(_) => "malformed",
        _ => "failed",
    }
}

/// Rate-limits the failure log: one line per interval, with what it suppressed.
struct FailureLog {
    interval: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl FailureLog {
    fn report(&mut self, peer: SocketAddr, e: &EngineError) {
        let now = Instant::now();
        if self.last.is_some_and(|t| now < t + self.interval) {
            self.suppressed += 1;
            return;
        }
        self.last = Some(now);
        let more = std::mem::take(&mut self.suppressed);
        if more > 0 {
            tracing::warn!(%peer, error = %e, suppressed = more, "handshake failed; connection dropped ({more} more since the last report)");
        } else {
            tracing::warn!(%peer, error = %e, "handshake failed; connection dropped");
        }
    }
}

tokio::task_local! {
    /// The handshake slot of the connection whose start runs in this task.
    static SLOT: std::cell::RefCell<Option<tokio::sync::OwnedSemaphorePermit>>;
}

/// Gives back the handshake slot of the connection starting in this task, if a listener gave
/// it one: its handshake is done and what remains (its extra TCP streams joining) needs the
/// listener to accept more.
pub(crate) fn release_handshake_slot() {
    let _ = SLOT.try_with(|s| s.borrow_mut().take());
}

async fn accept_loop<C, F, Fut>(
    listener: Arc<TcpListener>,
    config: ListenerConfig,
    start: Arc<F>,
    ready: mpsc::Sender<C>,
    counters: Arc<Counters>,
    metrics: Option<Arc<Metrics>>,
) where
    C: Send + 'static,
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<C, EngineError>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(config.max_handshakes.max(1)));
    let log = Arc::new(Mutex::new(FailureLog {
        interval: config.log_interval,
        last: None,
        suppressed: 0,
    }));
    let mut backoff = Duration::from_millis(10);
    loop {
        // A free handshake slot first: connections beyond the bound wait in the backlog.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(x) => {
                backoff = Duration::from_millis(10);
                x
            }
            Err(e) => {
                // E.g. out of file descriptors: wait and try again, never stop serving.
                tracing::warn!(error = %e, "accept failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        counters.accepted.fetch_add(1, Ordering::Relaxed);
        let (start, ready, counters, log, metrics) = (
            start.clone(),
            ready.clone(),
            counters.clone(),
            log.clone(),
            metrics.clone(),
        );
        let count = move |outcome: &str| {
            if let Some(m) = &metrics {
                m.handshakes
                    .get_or_create(&crate::metrics::Handshake {
                        outcome: outcome.into(),
                    })
                    .inc();
            }
        };
        tokio::spawn(async move {
            let result = SLOT
                .scope(std::cell::RefCell::new(Some(slot)), start(stream))
                .await;
            match result {
                Ok(conn) => {
                    counters.established.fetch_add(1, Ordering::Relaxed);
                    count("established");
                    let _ = ready.send(conn).await;
                }
                Err(EngineError::StreamJoined) => {
                    counters.joined.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    let outcome = failure_class(&e);
                    let counter = match outcome {
                        "refused" => &counters.refused,
                        "malformed" => &counters.malformed,
                        _ => &counters.failed,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    count(outcome);
                    log.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .report(peer, &e);
                }
            }
        });
    }
}
