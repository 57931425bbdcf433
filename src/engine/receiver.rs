//! The decode side of a TCP connection: a task that owns the connection's page pool and
//! [`ReceiverEndpoint`], and a handle for the engine.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_proto::auth::{AuthError, Sealer};
use kvwire_proto::wire::{ErrorCode, Hello, Role, TransferRef};
use kvwire_proto::{FailureReason, Scope};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot};

use super::{open, run_digest_job, DigestDone, EngineError, NodeConfig, TransferError};
use crate::checksum::DigestExecution;
use crate::memory::KvMemory;
use crate::memory::PagePool;
use crate::metrics::{Connection, Metrics};
use crate::receiver::{ReceiveOutcome, ReceiverEndpoint, ReserveParams, VerifiedKv};
use crate::transport::tcp::{Record, StreamError, StreamReader, StreamStats};

type ReadFn = Box<dyn FnOnce(PagesView<'_>) + Send>;

enum Cmd {
    Reserve {
        params: ReserveParams,
        reply: oneshot::Sender<Result<Verified, TransferError>>,
    },
    Abort {
        transfer_id: u64,
        code: ErrorCode,
    },
    Read {
        transfer_id: u64,
        f: ReadFn,
    },
    Release {
        transfer_id: u64,
    },
    Stats {
        reply: oneshot::Sender<ReceiverConnStats>,
    },
}

/// Counters of a receiver connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReceiverConnStats {
    /// Transfers verified and delivered.
    pub verified: u64,
    /// Transfers failed.
    pub failed: u64,
    /// What the stream carried.
    pub stream: StreamStats,
    /// Fences carried out.
    pub fences: u64,
    /// Pages free in the connection's pool.
    pub pages_free: u32,
    /// Pages in the connection's pool.
    pub pages_total: u32,
    /// Pages quarantined now.
    pub pages_quarantined: u32,
    /// Whether the peer is gone.
    pub peer_lost: bool,
}

/// Read access to the pages of a verified transfer.
pub struct PagesView<'a> {
    pool: &'a PagePool,
    kv: &'a VerifiedKv,
}

impl PagesView<'_> {
    /// The bytes of page `ordinal` in `buffer`.
    ///
    /// # Panics
    /// If `ordinal` or `buffer` is out of range.
    pub fn page(&self, ordinal: usize, buffer: usize) -> crate::memory::PageRef<'_> {
        match self.kv.page(self.pool, ordinal, buffer) {
            Ok(p) => p,
            Err(e) => panic!("page {ordinal} of buffer {buffer}: {e}"),
        }
    }

    /// Pages in the transfer.
    pub fn pages(&self) -> usize {
        self.kv.pages()
    }

    /// Buffers per page.
    pub fn buffers(&self) -> usize {
        self.pool.buffers()
    }
}

/// KV pages of a verified transfer. Only a transfer whose digests, computed over the
/// memory that landed, matched the sender's is ever handed out. The pages return to the pool
/// when this is released or dropped.
#[must_use = "dropping a Verified releases its pages"]
pub struct Verified {
    /// The transfer.
    pub transfer: TransferRef,
    /// Tokens verified.
    pub tokens: u32,
    /// Pages verified.
    pub pages: usize,
    cmd: mpsc::UnboundedSender<Cmd>,
}

impl std::fmt::Debug for Verified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verified")
            .field("transfer", &self.transfer)
            .field("tokens", &self.tokens)
            .field("pages", &self.pages)
            .finish()
    }
}

impl Verified {
    /// Runs `f` over the verified pages, in the connection's task.
    pub async fn read<R: Send + 'static>(
        &self,
        f: impl FnOnce(PagesView<'_>) -> R + Send + 'static,
    ) -> Result<R, TransferError> {
        let (tx, rx) = oneshot::channel();
        let f: ReadFn = Box::new(move |view| {
            let _ = tx.send(f(view));
        });
        self.cmd
            .send(Cmd::Read {
                transfer_id: self.transfer.transfer_id,
                f,
            })
            .map_err(|_| TransferError::ConnectionClosed)?;
        rx.await.map_err(|_| TransferError::ConnectionClosed)
    }

    /// Gives the pages back to the pool (as dropping does).
    pub fn release(self) {}
}

impl Drop for Verified {
    fn drop(&mut self) {
        let _ = self.cmd.send(Cmd::Release {
            transfer_id: self.transfer.transfer_id,
        });
    }
}

/// The decode side of one connection.
#[derive(Debug, Clone)]
pub struct ReceiverConn {
    cmd: mpsc::UnboundedSender<Cmd>,
    peer: Hello,
}

impl ReceiverConn {
    /// Accepts one connection on `listener` and runs the handshake as the server.
    pub async fn accept(listener: &TcpListener, config: &NodeConfig) -> Result<Self, EngineError> {
        let (stream, _) = listener.accept().await?;
        Self::start(stream, config, false).await
    }

    /// Connects to a sender and runs the handshake as the client.
    pub async fn connect(
        addr: impl ToSocketAddrs,
        config: &NodeConfig,
    ) -> Result<Self, EngineError> {
        let stream = TcpStream::connect(addr).await?;
        Self::start(stream, config, true).await
    }

    /// Runs the handshake on `stream` and starts the connection's task, over a pool the
    /// engine allocates.
    pub async fn start(
        stream: TcpStream,
        config: &NodeConfig,
        client: bool,
    ) -> Result<Self, EngineError> {
        let memory = KvMemory::allocate(&config.pool)?;
        Self::start_with_memory(stream, config, client, memory).await
    }

    /// Runs the handshake on `stream` and starts the connection's task over KV memory the
    /// caller registered ([`KvMemory::from_buffers`], or the engine's own memory with
    /// [`KvMemory::from_raw_parts`]), which must match `config.pool`.
    pub async fn start_with_memory(
        stream: TcpStream,
        config: &NodeConfig,
        client: bool,
        memory: KvMemory,
    ) -> Result<Self, EngineError> {
        let super::Opened {
            stream,
            est,
            pool,
            sealer,
            opener,
        } = open(stream, config, client, Role::RECEIVER, memory).await?;
        let mut rx_config = config.receiver.clone();
        rx_config.nonce_seed = fresh_seed();
        let mut endpoint = ReceiverEndpoint::new(&est, pool, &config.engine, rx_config)?;
        endpoint.set_digest_mode(config.digest_mode);
        endpoint.set_digest_execution(DigestExecution::Deferred);
        let (rd, wr) = stream.into_split();
        let (wr_tx, mut wr_rx) = mpsc::unbounded_channel::<Vec<u8>>();
        tokio::spawn(async move {
            let mut wr = wr;
            while let Some(bytes) = wr_rx.recv().await {
                if wr.write_all(&bytes).await.is_err() {
                    break;
                }
            }
            let _ = wr.shutdown().await;
        });
        let (cmd, cmd_rx) = mpsc::unbounded_channel();
        let reader = StreamReader::new(&config.pool.buffer_page_bytes).with_opener(opener);
        let (digests_done, digest_rx) = mpsc::unbounded_channel::<DigestDone>();
        // Verified handles talk to the task on a channel of their own, so the engine's
        // channel closes when the engine drops its ReceiverConn handles; the task then ends
        // once every verified handle has been released.
        let (own_tx, own_rx) = mpsc::unbounded_channel::<Cmd>();
        let task = Task {
            endpoint,
            metrics: config.metrics.clone().map(|m| (m, next_connection_label())),
            fences_reported: 0,
            peer: est.peer.node_id,
            offload: config.digest_offload_bytes,
            digests_done,
            spans: HashMap::new(),
            waiting: HashMap::new(),
            verified: HashMap::new(),
            cmd: own_tx,
            wr: wr_tx,
            sealer,
            stats: ReceiverConnStats::default(),
            lost: false,
            auth_failure: None,
        };
        tokio::spawn(run(
            task,
            rd,
            reader,
            Inbox {
                engine: cmd_rx,
                own: own_rx,
                digests: digest_rx,
            },
        ));
        Ok(Self {
            cmd,
            peer: est.peer,
        })
    }

    /// The peer's hello.
    pub fn peer(&self) -> &Hello {
        &self.peer
    }

    /// Reserves pages for a transfer and waits for its verified KV, or the typed reason it
    /// failed.
    pub fn reserve(
        &self,
        params: ReserveParams,
    ) -> impl std::future::Future<Output = Result<Verified, TransferError>> + Send + 'static {
        let (reply, rx) = oneshot::channel();
        let sent = self.cmd.send(Cmd::Reserve { params, reply });
        async move {
            sent.map_err(|_| TransferError::ConnectionClosed)?;
            rx.await.map_err(|_| TransferError::ConnectionClosed)?
        }
    }

    /// Aborts a transfer (fence, release, ABORT).
    pub fn abort(&self, transfer_id: u64, code: ErrorCode) {
        let _ = self.cmd.send(Cmd::Abort { transfer_id, code });
    }

    /// Counters, including the pool's free and quarantined pages.
    pub async fn stats(&self) -> Result<ReceiverConnStats, TransferError> {
        let (reply, rx) = oneshot::channel();
        self.cmd
            .send(Cmd::Stats { reply })
            .map_err(|_| TransferError::ConnectionClosed)?;
        rx.await.map_err(|_| TransferError::ConnectionClosed)
    }
}

/// A per-process connection number for metric labels.
fn next_connection_label() -> Connection {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    Connection {
        connection: NEXT.fetch_add(1, Ordering::Relaxed).to_string(),
    }
}

/// A seed for reservation nonces that differs per connection and per process.
pub(crate) fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

enum Event {
    Read(std::io::Result<usize>),
    Digest(Option<DigestDone>),
    Cmd(Option<Cmd>),
    Timer,
}

struct Task {
    endpoint: ReceiverEndpoint,
    metrics: Option<(Arc<Metrics>, Connection)>,
    fences_reported: u64,
    waiting: HashMap<u64, oneshot::Sender<Result<Verified, TransferError>>>,
    verified: HashMap<u64, VerifiedKv>,
    cmd: mpsc::UnboundedSender<Cmd>,
    wr: mpsc::UnboundedSender<Vec<u8>>,
    sealer: Sealer,
    stats: ReceiverConnStats,
    lost: bool,
    /// Why the connection was closed, when a frame failed authentication.
    auth_failure: Option<AuthError>,
    peer: u64,
    offload: u64,
    digests_done: mpsc::UnboundedSender<DigestDone>,
    /// A tracing span per open transfer (transfer id, nonce, peer), entered whenever the
    /// task handles it, closed when it ends.
    spans: HashMap<u64, tracing::Span>,
}

impl Task {
    fn flush(&mut self) {
        while let Some(frame) = self.endpoint.poll_transmit() {
            match self.sealer.seal_to_vec(&frame) {
                Ok(bytes) => {
                    if self.auth_failure.is_none() {
                        let _ = self.wr.send(bytes);
                    }
                }
                Err(e) => tracing::error!(error = %e, "frame could not be encoded"),
            }
        }
        while let Some(outcome) = self.endpoint.poll_outcome() {
            match outcome {
                ReceiveOutcome::Verified(kv) => {
                    self.stats.verified += 1;
                    if let Some((m, _)) = &self.metrics {
                        m.transfer("receiver", "verified");
                        let bytes = kv.pages() as u64
                            * self.endpoint.pool().geometry().bytes_per_page_index();
                        m.bytes_verified.inc_by(bytes);
                    }
                    let id = kv.transfer.transfer_id;
                    if let Some(span) = self.spans.remove(&id) {
                        span.in_scope(|| {
                            tracing::debug!(pages = kv.pages(), "verified and delivered")
                        });
                    }
                    let handle = Verified {
                        transfer: kv.transfer,
                        tokens: kv.tokens,
                        pages: kv.pages(),
                        cmd: self.cmd.clone(),
                    };
                    self.verified.insert(id, kv);
                    match self.waiting.remove(&id) {
                        // If the engine stopped waiting, dropping the handle releases the pages.
                        Some(reply) => drop(reply.send(Ok(handle))),
                        None => drop(handle),
                    }
                }
                ReceiveOutcome::Failed { transfer, reason } => {
                    self.stats.failed += 1;
                    if let Some((m, _)) = &self.metrics {
                        m.transfer("receiver", &reason.code().to_string());
                    }
                    let span = self
                        .spans
                        .remove(&transfer.transfer_id)
                        .unwrap_or_else(tracing::Span::none);
                    span.in_scope(|| tracing::warn!(transfer_id = transfer.transfer_id, peer = self.peer, %reason, "transfer failed"));
                    if let Some(reply) = self.waiting.remove(&transfer.transfer_id) {
                        let err = match (&reason, &self.auth_failure) {
                            (FailureReason::PeerLost, Some(e)) => {
                                TransferError::Unauthenticated(e.clone())
                            }
                            _ => TransferError::Failed(reason),
                        };
                        let _ = reply.send(Err(err));
                    }
                }
            }
        }
    }

    /// Starts every queued digest job; small ones finish at once.
    fn run_digest_jobs(&mut self) {
        while let Some(job) = self.endpoint.poll_digest_job() {
            if let Some((t, r)) = run_digest_job(job, self.offload, &self.digests_done) {
                self.endpoint.handle_digest_result(Instant::now(), t, r);
            }
        }
    }

    fn command(&mut self, now: Instant, cmd: Cmd) {
        match cmd {
            Cmd::Reserve { params, reply } => {
                if self.lost {
                    let _ = reply.send(Err(TransferError::Failed(FailureReason::PeerLost)));
                    return;
                }
                match self.endpoint.reserve(now, params) {
                    Ok(t) => {
                        let span = tracing::info_span!(
                            "transfer",
                            transfer_id = t.transfer_id,
                            nonce = t.nonce,
                            peer = self.peer,
                            role = "receiver"
                        );
                        span.in_scope(|| tracing::debug!(tokens = params.tokens, "reserved"));
                        self.spans.insert(t.transfer_id, span);
                        self.waiting.insert(t.transfer_id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e.into()));
                    }
                }
            }
            Cmd::Abort { transfer_id, code } => {
                if let Some((m, _)) = &self.metrics {
                    m.aborts.inc();
                }
                self.endpoint.abort(now, transfer_id, code);
            }
            Cmd::Read { transfer_id, f } => {
                if let Some(kv) = self.verified.get(&transfer_id) {
                    f(PagesView {
                        pool: self.endpoint.pool(),
                        kv,
                    });
                }
            }
            Cmd::Release { transfer_id } => {
                if let Some(kv) = self.verified.remove(&transfer_id) {
                    if let Err(e) = self.endpoint.release(kv) {
                        tracing::error!(transfer_id, error = %e, "release of verified pages refused");
                    }
                }
            }
            Cmd::Stats { reply } => {
                let pool = self.endpoint.pool();
                let mut s = self.stats;
                s.pages_free = pool.free_pages();
                s.pages_total = pool.capacity_pages();
                s.pages_quarantined = pool.quarantined_pages();
                s.fences = self.endpoint.stats().fences;
                s.peer_lost = self.lost;
                let _ = reply.send(s);
            }
        }
    }

    /// Publishes the pool gauges and new fences.
    fn publish(&mut self) {
        let Some((m, conn)) = &self.metrics else {
            return;
        };
        let pool = self.endpoint.pool();
        m.pages_free
            .get_or_create(conn)
            .set(i64::from(pool.free_pages()));
        m.pages_quarantined
            .get_or_create(conn)
            .set(i64::from(pool.quarantined_pages()));
        let fences = self.endpoint.stats().fences;
        m.fences.inc_by(fences - self.fences_reported);
        self.fences_reported = fences;
    }

    fn peer_lost(&mut self, now: Instant, why: &str) {
        if !self.lost {
            let open = self.endpoint.session().open_transfers();
            if open > 0 {
                tracing::warn!(
                    why,
                    peer = self.peer,
                    open,
                    "peer lost: failing its open transfers"
                );
            } else {
                tracing::debug!(
                    why,
                    peer = self.peer,
                    "connection closed with no transfer open"
                );
            }
            self.lost = true;
            self.endpoint.handle_peer_lost(now);
        }
    }
}

/// The channels a connection task listens to besides its socket.
struct Inbox {
    /// Commands from the engine's `ReceiverConn` handles.
    engine: mpsc::UnboundedReceiver<Cmd>,
    /// Commands from `Verified` handles.
    own: mpsc::UnboundedReceiver<Cmd>,
    /// Finished digest jobs.
    digests: mpsc::UnboundedReceiver<DigestDone>,
}

async fn run(mut task: Task, mut rd: OwnedReadHalf, mut reader: StreamReader, inbox: Inbox) {
    let Inbox {
        engine: mut cmd_rx,
        own: mut own_rx,
        digests: mut digest_rx,
    } = inbox;
    let mut engine_open = true;
    let far = Duration::from_secs(3600);
    loop {
        task.run_digest_jobs();
        task.flush();
        task.publish();
        // Checked before waiting: once every engine handle and verified handle is gone and
        // nothing is open, nothing can wake the task any more (its own channels stay open),
        // so it ends here rather than at the next timer (up to an hour later), which left the
        // connection, its pool and its socket alive.
        if !engine_open && task.verified.is_empty() && task.endpoint.session().open_transfers() == 0
        {
            return;
        }
        task.stats.stream = reader.stats;
        let wake = task
            .endpoint
            .poll_timeout()
            .map(tokio::time::Instant::from_std);
        let sleep =
            tokio::time::sleep_until(wake.unwrap_or_else(|| tokio::time::Instant::now() + far));
        let event = if task.lost {
            tokio::select! {
                c = cmd_rx.recv(), if engine_open => Event::Cmd(c),
                c = own_rx.recv() => Event::Cmd(c),
                d = digest_rx.recv() => Event::Digest(d),
                _ = sleep => Event::Timer,
            }
        } else {
            let (pool, scopes) = task.endpoint.landing_parts();
            let mut target = reader.target(pool, scopes);
            tokio::select! {
                r = rd.read(target.bytes()) => Event::Read(r),
                c = cmd_rx.recv(), if engine_open => Event::Cmd(c),
                c = own_rx.recv() => Event::Cmd(c),
                d = digest_rx.recv() => Event::Digest(d),
                _ = sleep => Event::Timer,
            }
        };
        let now = Instant::now();
        match event {
            Event::Read(Ok(0)) => task.peer_lost(now, "end of stream"),
            Event::Read(Err(e)) => task.peer_lost(now, &e.to_string()),
            Event::Read(Ok(n)) => {
                let (_, scopes) = task.endpoint.landing_parts();
                match reader.advance(n, scopes) {
                    Ok(Some(Record::Frame(frame))) => {
                        let span = frame
                            .transfer()
                            .and_then(|t| task.spans.get(&t.transfer_id).cloned())
                            .unwrap_or_else(tracing::Span::none);
                        let _entered = span.enter();
                        if let Err(e) = task.endpoint.handle_frame(now, frame) {
                            if e.scope == Scope::Connection {
                                task.peer_lost(now, &e.detail);
                            } else {
                                tracing::debug!(error = %e, "frame dropped");
                            }
                        }
                    }
                    Ok(Some(Record::Refused(h))) => {
                        tracing::debug!(
                            transfer_id = h.transfer.transfer_id,
                            page = h.dst_page,
                            "write refused (fenced or out of scope)"
                        );
                    }
                    Ok(Some(Record::Landed(_)) | None) => {}
                    Err(StreamError::Auth(e)) => {
                        tracing::warn!(peer = task.peer, error = %e, "frame failed authentication: closing the connection");
                        task.auth_failure = Some(e);
                        task.peer_lost(now, "a frame failed authentication");
                        // Close the connection: the writer ends (and shuts the socket
                        // down) once its channel is gone; nothing more goes to this peer.
                        task.wr = mpsc::unbounded_channel().0;
                    }
                    Err(e) => task.peer_lost(now, &e.to_string()),
                }
            }
            Event::Cmd(Some(c)) => task.command(now, c),
            Event::Cmd(None) => {
                // Every engine handle is gone: fail what is open (fence, release) and stop
                // listening to the engine.
                engine_open = false;
                task.peer_lost(now, "engine closed the connection");
            }
            Event::Digest(Some((t, r))) => task.endpoint.handle_digest_result(now, t, r),
            Event::Digest(None) => {}
            Event::Timer => task.endpoint.handle_timeout(now),
        }
    }
}
