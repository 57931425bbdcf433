//! The prefill side of a TCP connection: a task that owns the connection's source pool and
//! [`SenderEndpoint`], writing data records and frames on one stream so a COMMIT always
//! follows its data.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_proto::admission::{AdmissionError, Admitted, Request};
use kvwire_proto::auth::{AuthError, Opener, Sealer};
use kvwire_proto::sender::SenderEvent;
use kvwire_proto::wire::{ErrorCode, Frame, Hello, Role};
use kvwire_proto::{FailureReason, Scope};
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot};

use super::{open, run_digest_job, DigestDone, EngineError, NodeConfig, TransferError};
use crate::checksum::DigestExecution;
use crate::memory::KvMemory;
use crate::metrics::Metrics;
use crate::sender::{PostedWrite, SenderEndpoint};
use crate::transport::stream::{read_frame, ReadError};
use crate::transport::tcp::DataHeader;
use crate::transport::AccessKey;

type Fill = Box<dyn FnMut(u32, usize, &mut [u8]) + Send>;

enum Cmd {
    Admit {
        req: Request,
        reply: oneshot::Sender<Result<Admitted, AdmissionError>>,
    },
    Send {
        admitted: Admitted,
        fill: Fill,
        reply: oneshot::Sender<Result<(), TransferError>>,
    },
    Abort {
        transfer_id: u64,
        code: ErrorCode,
    },
    Stats {
        reply: oneshot::Sender<SenderConnStats>,
    },
    FillFree {
        f: Fill,
        reply: oneshot::Sender<()>,
    },
}

/// Counters of a sender connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SenderConnStats {
    /// Transfers the receiver verified.
    pub verified: u64,
    /// Transfers failed.
    pub failed: u64,
    /// Requests rejected at admission.
    pub rejected_at_admission: u64,
    /// Data records written.
    pub writes: u64,
    /// Page bytes written.
    pub bytes: u64,
    /// Source pages free.
    pub pages_free: u32,
    /// Source pages in the pool.
    pub pages_total: u32,
    /// Whether the peer is gone.
    pub peer_lost: bool,
}

/// The prefill side of one connection.
#[derive(Debug, Clone)]
pub struct SenderConn {
    cmd: mpsc::UnboundedSender<Cmd>,
    peer: Hello,
}

impl SenderConn {
    /// Connects to a receiver and runs the handshake as the client.
    pub async fn connect(
        addr: impl ToSocketAddrs,
        config: &NodeConfig,
    ) -> Result<Self, EngineError> {
        let stream = TcpStream::connect(addr).await?;
        Self::start(stream, config, true).await
    }

    /// Accepts one connection on `listener` and runs the handshake as the server.
    pub async fn accept(listener: &TcpListener, config: &NodeConfig) -> Result<Self, EngineError> {
        let (stream, _) = listener.accept().await?;
        Self::start(stream, config, false).await
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
        } = open(stream, config, client, Role::SENDER, memory).await?;
        let mut endpoint = SenderEndpoint::new(
            &est,
            pool,
            &config.engine,
            config.sender.clone(),
            config.window,
        )?;
        endpoint.set_digest_mode(config.digest_mode);
        endpoint.set_digest_execution(DigestExecution::Deferred);
        let (rd, wr) = stream.into_split();
        let (frame_tx, frame_rx) = mpsc::unbounded_channel();
        tokio::spawn(read_frames(rd, frame_tx, opener));
        let (cmd, cmd_rx) = mpsc::unbounded_channel();
        let metrics = config.metrics.clone();
        let peer = est.peer.node_id;
        let wr = BufWriter::with_capacity(256 * 1024, wr);
        let offload = config.digest_offload_bytes;
        tokio::spawn(run(
            endpoint, wr, sealer, frame_rx, cmd_rx, metrics, peer, offload,
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

    /// Admits a request, or rejects it with its typed error. A rejected request is retired:
    /// the receiver's reservation for it is answered with REJECT carrying that error.
    pub async fn admit(&self, req: Request) -> Result<Admitted, TransferError> {
        let (reply, rx) = oneshot::channel();
        self.cmd
            .send(Cmd::Admit { req, reply })
            .map_err(|_| TransferError::ConnectionClosed)?;
        match rx.await {
            Ok(Ok(a)) => Ok(a),
            Ok(Err(e)) => Err(TransferError::Rejected(e)),
            Err(_) => Err(TransferError::ConnectionClosed),
        }
    }

    /// Sends an admitted request: allocates its source pages, lets `fill(ordinal, buffer,
    /// page)` write the KV data, and waits until the receiver verified it (or the typed reason
    /// it failed).
    pub fn send(
        &self,
        admitted: Admitted,
        fill: impl FnMut(u32, usize, &mut [u8]) + Send + 'static,
    ) -> impl std::future::Future<Output = Result<(), TransferError>> + Send + 'static {
        let (reply, rx) = oneshot::channel();
        let sent = self.cmd.send(Cmd::Send {
            admitted,
            fill: Box::new(fill),
            reply,
        });
        async move {
            sent.map_err(|_| TransferError::ConnectionClosed)?;
            rx.await.map_err(|_| TransferError::ConnectionClosed)?
        }
    }

    /// Aborts a transfer (stop posting, drain, ABORT).
    pub fn abort(&self, transfer_id: u64, code: ErrorCode) {
        let _ = self.cmd.send(Cmd::Abort { transfer_id, code });
    }

    /// Writes into every free source page, `f(page, buffer, bytes)` (e.g. to initialise KV
    /// memory once); pages leased to transfers are not touched.
    pub async fn fill_free_pages(
        &self,
        f: impl FnMut(u32, usize, &mut [u8]) + Send + 'static,
    ) -> Result<(), TransferError> {
        let (reply, rx) = oneshot::channel();
        self.cmd
            .send(Cmd::FillFree {
                f: Box::new(f),
                reply,
            })
            .map_err(|_| TransferError::ConnectionClosed)?;
        rx.await.map_err(|_| TransferError::ConnectionClosed)
    }

    /// Counters.
    pub async fn stats(&self) -> Result<SenderConnStats, TransferError> {
        let (reply, rx) = oneshot::channel();
        self.cmd
            .send(Cmd::Stats { reply })
            .map_err(|_| TransferError::ConnectionClosed)?;
        rx.await.map_err(|_| TransferError::ConnectionClosed)
    }
}

/// What the frame reader hands the connection task.
enum Incoming {
    /// A frame (authenticated, where the connection is).
    Frame(Frame),
    /// The connection is gone: end of stream, I/O error, bytes that are not a frame, or (with
    /// the error) a frame that failed authentication.
    Closed(Option<AuthError>),
}

/// Reads and opens control frames and hands them to the connection task.
async fn read_frames(mut rd: OwnedReadHalf, tx: mpsc::UnboundedSender<Incoming>, opener: Opener) {
    let mut buf = Vec::new();
    let mut opener = opener;
    let mut open = |b: &[u8]| opener.open(b);
    loop {
        match read_frame(&mut rd, &mut buf, &mut open).await {
            Ok(Some(f)) => {
                if tx.send(Incoming::Frame(f)).is_err() {
                    return;
                }
            }
            Ok(None) | Err(ReadError::Stream(_)) => {
                let _ = tx.send(Incoming::Closed(None));
                return;
            }
            Err(ReadError::Auth(e)) => {
                let _ = tx.send(Incoming::Closed(Some(e)));
                return;
            }
        }
    }
}

struct Task {
    endpoint: SenderEndpoint,
    /// A tracing span per open transfer, entered whenever the task handles it.
    spans: HashMap<u64, tracing::Span>,
    offload: u64,
    digests_done: mpsc::UnboundedSender<DigestDone>,
    metrics: Option<Arc<Metrics>>,
    peer: u64,
    waiting: HashMap<u64, oneshot::Sender<Result<(), TransferError>>>,
    wr: BufWriter<OwnedWriteHalf>,
    sealer: Sealer,
    stats: SenderConnStats,
    lost: bool,
    /// Why the connection was closed, when a frame failed authentication.
    auth_failure: Option<AuthError>,
}

impl Task {
    /// Starts every queued digest job; small ones finish at once.
    fn run_digest_jobs(&mut self) {
        while let Some(job) = self.endpoint.poll_digest_job() {
            if let Some((t, r)) = run_digest_job(job, self.offload, &self.digests_done) {
                self.endpoint.handle_digest_result(Instant::now(), t, r);
            }
        }
    }

    /// Writes everything the session produced, in order, then reports events.
    async fn flush(&mut self) {
        loop {
            let mut moved = false;
            while let Some(w) = self.endpoint.poll_write() {
                moved = true;
                let ok = !self.lost && self.write_record(&w).await.is_ok();
                if !ok && !self.lost {
                    self.peer_lost("write failed");
                }
                self.endpoint
                    .handle_write_completion(Instant::now(), w.transfer, ok);
            }
            while let Some(frame) = self.endpoint.poll_transmit() {
                moved = true;
                if self.lost {
                    continue;
                }
                let written = match self.sealer.seal_to_vec(&frame) {
                    Ok(bytes) => self.wr.write_all(&bytes).await.is_ok(),
                    Err(e) => {
                        tracing::error!(error = %e, "frame could not be encoded");
                        true
                    }
                };
                if !written {
                    self.peer_lost("write failed");
                }
            }
            if !moved {
                break;
            }
        }
        if !self.lost && self.wr.flush().await.is_err() {
            self.peer_lost("flush failed");
        }
        while let Some(event) = self.endpoint.poll_event() {
            let (id, result) = match event {
                SenderEvent::Verified(t) => {
                    self.stats.verified += 1;
                    if let Some(span) = self.spans.remove(&t.transfer_id) {
                        span.in_scope(|| tracing::debug!("verified by the receiver"));
                    }
                    if let Some(m) = &self.metrics {
                        m.transfer("sender", "verified");
                    }
                    (t.transfer_id, Ok(()))
                }
                SenderEvent::Failed { transfer, reason } => {
                    self.stats.failed += 1;
                    if let Some(m) = &self.metrics {
                        m.transfer("sender", &reason.code().to_string());
                    }
                    let span = self
                        .spans
                        .remove(&transfer.transfer_id)
                        .unwrap_or_else(tracing::Span::none);
                    span.in_scope(|| tracing::warn!(transfer_id = transfer.transfer_id, peer = self.peer, %reason, "transfer failed"));
                    let err = match (&reason, &self.auth_failure) {
                        (FailureReason::PeerLost, Some(e)) => {
                            TransferError::Unauthenticated(e.clone())
                        }
                        _ => TransferError::Failed(reason),
                    };
                    (transfer.transfer_id, Err(err))
                }
            };
            if let Some(reply) = self.waiting.remove(&id) {
                let _ = reply.send(result);
            }
        }
    }

    /// One data record: header, then each buffer's page straight from the source pool.
    async fn write_record(&mut self, w: &PostedWrite) -> std::io::Result<()> {
        let pool = self.endpoint.pool();
        let len = pool.geometry().bytes_per_page_index() as u32;
        let header = DataHeader {
            transfer: w.transfer,
            key: AccessKey::from_descriptor(&w.access).unwrap_or(AccessKey(0)),
            ordinal: w.write.ordinal,
            dst_page: w.write.dst_page,
            len,
        };
        self.wr.write_all(&header.encode()).await?;
        for b in 0..pool.buffers() {
            // The source page is leased to this transfer until its writes complete: the
            // engine does not write it meanwhile, so the read lock is always granted.
            match pool.raw_page(w.write.src_page, b) {
                Some(page) => self.wr.write_all(&page).await?,
                None => return Err(std::io::Error::other("source page out of range or busy")),
            }
        }
        self.stats.writes += 1;
        self.stats.bytes += u64::from(len);
        Ok(())
    }

    fn peer_lost(&mut self, why: &str) {
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
            self.endpoint.handle_peer_lost(Instant::now());
        }
    }

    fn command(&mut self, cmd: Cmd) {
        let now = Instant::now();
        match cmd {
            Cmd::Admit { req, reply } => {
                let r = self.endpoint.admit(req);
                if let Err(e) = &r {
                    self.stats.rejected_at_admission += 1;
                    if let Some(m) = &self.metrics {
                        m.rejected_at_admission.inc();
                    }
                    tracing::info!(transfer_id = req.transfer_id, peer = self.peer, error = %e, "request rejected at admission");
                }
                let _ = reply.send(r);
            }
            Cmd::Send {
                admitted,
                fill,
                reply,
            } => {
                if self.lost {
                    let _ = reply.send(Err(TransferError::Failed(FailureReason::PeerLost)));
                    return;
                }
                let id = admitted.transfer_id();
                match self.endpoint.submit(now, admitted, fill) {
                    Ok(()) => {
                        let span = tracing::info_span!(
                            "transfer",
                            transfer_id = id,
                            peer = self.peer,
                            role = "sender"
                        );
                        span.in_scope(|| tracing::debug!("submitted"));
                        self.spans.insert(id, span);
                        self.waiting.insert(id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e.into()));
                    }
                }
            }
            Cmd::Abort { transfer_id, code } => {
                if let Some(m) = &self.metrics {
                    m.aborts.inc();
                }
                self.endpoint.abort(now, transfer_id, code);
            }
            Cmd::FillFree { f, reply } => {
                self.endpoint.fill_free_pages(f);
                let _ = reply.send(());
            }
            Cmd::Stats { reply } => {
                let pool = self.endpoint.pool();
                let mut s = self.stats;
                s.pages_free = pool.free_pages();
                s.pages_total = pool.capacity_pages();
                s.peer_lost = self.lost;
                let _ = reply.send(s);
            }
        }
    }
}

enum Event {
    Frame(Option<Incoming>),
    Digest(Option<DigestDone>),
    Cmd(Option<Cmd>),
    Timer,
}

#[allow(clippy::too_many_arguments)]
async fn run(
    endpoint: SenderEndpoint,
    wr: BufWriter<OwnedWriteHalf>,
    sealer: Sealer,
    mut frames: mpsc::UnboundedReceiver<Incoming>,
    mut cmd_rx: mpsc::UnboundedReceiver<Cmd>,
    metrics: Option<Arc<Metrics>>,
    peer: u64,
    offload: u64,
) {
    let (digests_done, mut digest_rx) = mpsc::unbounded_channel::<DigestDone>();
    let mut task = Task {
        endpoint,
        spans: HashMap::new(),
        offload,
        digests_done,
        metrics,
        peer,
        waiting: HashMap::new(),
        wr,
        sealer,
        stats: SenderConnStats::default(),
        lost: false,
        auth_failure: None,
    };
    let mut frames_open = true;
    let far = Duration::from_secs(3600);
    loop {
        task.run_digest_jobs();
        task.flush().await;
        let wake = task
            .endpoint
            .poll_timeout()
            .map(tokio::time::Instant::from_std);
        let sleep =
            tokio::time::sleep_until(wake.unwrap_or_else(|| tokio::time::Instant::now() + far));
        let event = tokio::select! {
            f = frames.recv(), if frames_open => Event::Frame(f),
            c = cmd_rx.recv() => Event::Cmd(c),
            d = digest_rx.recv() => Event::Digest(d),
            _ = sleep => Event::Timer,
        };
        let now = Instant::now();
        match event {
            Event::Frame(Some(Incoming::Frame(frame))) => {
                let span = frame
                    .transfer()
                    .and_then(|t| task.spans.get(&t.transfer_id).cloned())
                    .unwrap_or_else(tracing::Span::none);
                let _entered = span.enter();
                if let Err(e) = task.endpoint.handle_frame(now, frame) {
                    if e.scope == Scope::Connection {
                        task.peer_lost(&e.detail);
                    }
                }
            }
            Event::Frame(Some(Incoming::Closed(Some(e)))) => {
                frames_open = false;
                tracing::warn!(peer = task.peer, error = %e, "frame failed authentication: closing the connection");
                task.auth_failure = Some(e);
                task.peer_lost("a frame failed authentication");
                // Nothing more is sent to a peer that cannot be trusted.
                let _ = task.wr.shutdown().await;
            }
            Event::Frame(Some(Incoming::Closed(None)) | None) => {
                frames_open = false;
                task.peer_lost("connection closed by the peer");
            }
            Event::Cmd(Some(c)) => task.command(c),
            Event::Cmd(None) => {
                task.peer_lost("engine closed the connection");
                task.flush().await;
                let _ = task.wr.shutdown().await;
                return;
            }
            Event::Digest(Some((t, r))) => task.endpoint.handle_digest_result(now, t, r),
            Event::Digest(None) => {}
            Event::Timer => task.endpoint.handle_timeout(now),
        }
    }
}
