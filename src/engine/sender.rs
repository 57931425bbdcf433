//! The prefill side of a connection: a handle for the engine, and the connection's task,
//! which runs the sender driver over the connection's transport.

use kvwire_proto::wire::{TransferId, TransferIdMap};
use std::sync::Arc;
use std::time::Instant;

use kvwire_proto::admission::{AdmissionPolicy, Admitted, Rejected, Request};
use kvwire_proto::sender::{SenderEvent, SubmitError};
use kvwire_proto::wire::{ErrorCode, Hello};
use kvwire_proto::FailureReason;
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot};

use super::{transfer_error, ConnectionTask, EngineError, Node, Rooms, Route, TransferError};
use crate::sender::{SenderDriver, StartError};

use crate::metrics::Metrics;
use crate::transport::SenderTransport;

type Fill = Box<dyn FnMut(u32, usize, &mut [u8]) + Send>;
type Reply = oneshot::Sender<Result<(), TransferError>>;

/// Where a transfer's source KV comes from.
enum Source {
    /// Copied into pages of kvwire's pool by this closure.
    Fill(Fill),
    /// The engine's own pages of the registered memory, read in place.
    Pages(Vec<u32>),
}

enum Cmd {
    /// A request rejected at admission (in the engine's thread): retire it so that its
    /// reservation gets REJECT with the original error.
    Retire(Rejected),
    Send {
        admitted: Admitted,
        source: Source,
        reply: Reply,
    },
    /// Many transfers in one message.
    Batch(Vec<(Admitted, Vec<u32>, Reply)>),
    /// A transfer to be sent in chunks; `reply` gets its outcome.
    Open {
        admitted: Admitted,
        reply: Reply,
    },
    /// The next chunk of an opened transfer; `reply` says whether it was taken.
    Chunk {
        transfer_id: TransferId,
        pages: Vec<u32>,
        aux: Option<Vec<u8>>,
        reply: oneshot::Sender<Result<(), TransferError>>,
    },
    Abort {
        transfer_id: TransferId,
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
#[non_exhaustive]
pub struct SenderConnStats {
    /// Transfers the receiver verified.
    pub verified: u64,
    /// Transfers failed.
    pub failed: u64,
    /// Requests rejected at admission.
    pub rejected_at_admission: u64,
    /// Page writes completed at the transport.
    pub writes: u64,
    /// Page bytes written (all buffers).
    pub bytes: u64,
    /// Source pages free.
    pub pages_free: u32,
    /// Source pages in the pool.
    pub pages_total: u32,
    /// Whether the peer is gone.
    pub peer_lost: bool,
    /// Transfers open on the connection: admitted or announced by a reservation, and not
    /// yet verified or failed.
    pub open_transfers: usize,
    /// Lanes that failed while the connection went on (RDMA over several rails, SPEC §9.2);
    /// reconnect to use their rails again.
    pub failed_lanes: usize,
    /// Transfers the receiver moved off a failed lane, written again over a live one (SPEC
    /// §9.2, moving a transfer).
    pub moves: u64,
    /// Digest jobs split across several threads (`NodeConfig::digest_threads`).
    pub digest_jobs_split: u64,
    /// Digest jobs run on the blocking pool beside the connection, split or not
    /// (`NodeConfig::digest_offload_bytes`; by default RDMA's every one, TCP's none).
    pub digest_jobs_offloaded: u64,
    /// Source pages digested right after their writes completed, while the transport's copy
    /// left them in cache (TCP from host memory, chunks of at least 1 MiB).
    pub pages_digested_after_write: u64,
}

/// The prefill side of one connection.
#[derive(Debug, Clone)]
pub struct SenderConn {
    cmd: mpsc::UnboundedSender<Cmd>,
    /// What the connection's task last reported: whether it ended and why, its lanes and
    /// transfers.
    shared: Arc<super::TaskReport>,
    peer: Hello,
    admission: AdmissionPolicy,
}

impl SenderConn {
    super::open::constructors!(super::open::open::<SenderConn>);

    /// Starts the connection's task: the sender driver over `transport`.
    pub(crate) fn run<T: SenderTransport + 'static>(
        est: kvwire_proto::handshake::Established,
        node: &Node,
        transport: T,
    ) -> Result<Self, EngineError> {
        let (pool, config) = (node.pool().clone(), node.config());
        let admission = crate::sender::admission_policy(&pool, &config.engine);
        let mut driver = SenderDriver::new(
            &est,
            pool,
            &config.engine,
            config.sender.clone(),
            config.window,
            transport,
        )?;
        driver.enable_liveness(std::time::Instant::now(), config.liveness);
        driver.set_digest_mode(config.digest_mode);
        driver.set_digest_while_sending(config.digest_while_sending);
        driver.set_digest_execution(super::digest_execution(config));
        let (cmd, cmd_rx) = mpsc::unbounded_channel();
        let task = Task {
            driver,
            spans: TransferIdMap::default(),
            metrics: config.metrics.clone(),
            label: config
                .metrics
                .as_ref()
                .map(|_| super::next_connection_label()),
            peer: est.peer.node_id,
            waiting: TransferIdMap::default(),
            stats: SenderConnStats::default(),
            log: super::FailureLog::new("sender", est.peer.node_id),
            rooms: node.rooms().clone(),
        };
        let shared = Arc::new(super::TaskReport::default());
        tokio::spawn(super::run_task(task, cmd_rx, shared.clone()));
        Ok(Self {
            cmd,
            shared,
            peer: est.peer,
            admission,
        })
    }

    /// The peer's hello.
    pub fn peer(&self) -> &Hello {
        &self.peer
    }

    /// Whether the connection ended (its peer lost, it closed, or its task is gone): no new
    /// transfer can go over it. Does not wait (unlike the `peer_lost` of its stats).
    pub fn is_closed(&self) -> bool {
        self.shared.is_set() || self.cmd.is_closed()
    }

    /// Why the connection ended, once its task saw it end: the peer gone, a frame that failed
    /// authentication, the peer unresponsive or flooding PINGs (SPEC §8.3), closed by this
    /// side. `None` while it is up (and after a close by dropping every handle).
    pub fn closed_reason(&self) -> Option<crate::transport::Closed> {
        self.shared.why()
    }

    /// The connection's failed lanes as its task last reported them (RDMA rails lost or
    /// left out while it goes on, SPEC §9.2; 0 over TCP): without waiting, unlike its stats.
    pub fn failed_lanes(&self) -> usize {
        self.shared.failed_lanes()
    }

    /// The transfers open on the connection as its task last reported them: without
    /// waiting, unlike its stats.
    pub fn open_transfers(&self) -> usize {
        self.shared.open_transfers()
    }

    /// Admits a request, or rejects it with its typed error, at once, in the caller's thread
    /// (no round trip to the connection). A rejected request is retired: the receiver's
    /// reservation for it is answered with REJECT carrying that error.
    pub fn admit(&self, req: Request) -> Result<Admitted, TransferError> {
        self.admission.admit(req).map_err(|rejected| {
            let error = rejected.error.clone();
            let _ = self.cmd.send(Cmd::Retire(rejected));
            TransferError::Rejected(error)
        })
    }

    /// Sends an admitted request from the engine's own pages of the registered memory, in
    /// place: **zero copy** (TCP writes them to the socket from the registered memory, RDMA
    /// WRITEs them from the memory region). `pages` holds one page index per page of the
    /// request, in transfer order. kvwire reads them until the returned future resolves
    /// (verified, or the typed reason it failed, reported only once nothing reads them any
    /// more); the engine must not write them meanwhile. Several transfers may send the same
    /// page at once (a shared prompt prefix to several peers).
    pub fn send_pages(
        &self,
        admitted: Admitted,
        pages: Vec<u32>,
    ) -> impl std::future::Future<Output = Result<(), TransferError>> + Send + 'static {
        self.send_source(admitted, Source::Pages(pages))
    }

    /// Many [`SenderConn::send_pages`] in one message to the connection: one future per
    /// transfer, in order.
    pub fn send_batch(
        &self,
        batch: Vec<(Admitted, Vec<u32>)>,
    ) -> Vec<impl std::future::Future<Output = Result<(), TransferError>> + Send + 'static> {
        let mut sends = Vec::with_capacity(batch.len());
        let mut waits = Vec::with_capacity(batch.len());
        for (admitted, pages) in batch {
            let (reply, rx) = oneshot::channel();
            sends.push((admitted, pages, reply));
            waits.push(rx);
        }
        let sent = self.cmd.send(Cmd::Batch(sends)).is_ok();
        waits
            .into_iter()
            .map(move |rx| async move {
                if !sent {
                    return Err(TransferError::ConnectionClosed);
                }
                rx.await.map_err(|_| TransferError::ConnectionClosed)?
            })
            .collect()
    }

    /// Sends an admitted request whose KV the engine computed elsewhere: kvwire allocates
    /// source pages from its pool and `fill(ordinal, buffer, page)` **copies** the KV into
    /// them, on the connection's task. Engines whose KV is in the registered memory use
    /// [`SenderConn::send_pages`] instead (no copy). Waits until the receiver verified it
    /// (or the typed reason it failed).
    pub fn send(
        &self,
        admitted: Admitted,
        fill: impl FnMut(u32, usize, &mut [u8]) + Send + 'static,
    ) -> impl std::future::Future<Output = Result<(), TransferError>> + Send + 'static {
        self.send_source(admitted, Source::Fill(Box::new(fill)))
    }

    /// Opens an admitted request to be sent in chunks as the prefill produces them (chunked
    /// prefill): each [`OutgoingTransfer::send_chunk`] sends the next pages of the engine's
    /// registered memory in place (zero copy), written and digested while the next chunk is
    /// computed (no second pass over the memory); the final chunk (the one that completes
    /// the request's pages) may carry the auxiliary record delivered with the transfer.
    pub fn open(&self, admitted: Admitted) -> OutgoingTransfer {
        let transfer_id = admitted.transfer_id();
        let (reply, rx) = oneshot::channel();
        let sent = self.cmd.send(Cmd::Open { admitted, reply }).is_ok();
        OutgoingTransfer {
            transfer_id,
            cmd: self.cmd.clone(),
            outcome: rx,
            sent,
        }
    }

    fn send_source(
        &self,
        admitted: Admitted,
        source: Source,
    ) -> impl std::future::Future<Output = Result<(), TransferError>> + Send + 'static {
        let (reply, rx) = oneshot::channel();
        let sent = self.cmd.send(Cmd::Send {
            admitted,
            source,
            reply,
        });
        async move {
            sent.map_err(|_| TransferError::ConnectionClosed)?;
            rx.await.map_err(|_| TransferError::ConnectionClosed)?
        }
    }

    /// Aborts a transfer (stop posting, drain, ABORT).
    pub fn abort(&self, transfer_id: TransferId, code: ErrorCode) {
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

/// Why a transfer could not start. The receiver's abort (or refusal) of the request before
/// it was submitted is the same failure as its abort after: `PeerAbort` with its code.
fn start_error(e: StartError) -> TransferError {
    match e {
        StartError::Session(SubmitError::AbortedByPeer { code, .. }) => {
            TransferError::Failed(FailureReason::PeerAbort {
                code,
                completed_pages: 0,
            })
        }
        e => e.into(),
    }
}

/// The connection's task: the driver, and what the engine waits for.
struct Task<T> {
    driver: SenderDriver<T>,
    /// A tracing span per open transfer, entered whenever the task handles it.
    spans: TransferIdMap<tracing::Span>,
    metrics: Option<Arc<Metrics>>,
    /// The connection's label in the per-connection gauges, when metrics are on.
    label: Option<crate::metrics::Connection>,
    peer: u64,
    waiting: TransferIdMap<oneshot::Sender<Result<(), TransferError>>>,
    stats: SenderConnStats,
    log: super::FailureLog,
    /// The node's directory of requests its peers named: this connection's peer named
    /// those it announces.
    rooms: Arc<Rooms>,
}

impl<T: SenderTransport> Task<T> {
    /// Hands finished transfers to the engine.
    fn hand_over(&mut self) {
        while let Some(event) = self.driver.poll_event() {
            let (id, result) = match event {
                SenderEvent::Announced {
                    transfer_id: id,
                    refusal,
                } => {
                    // The request's KV goes to this peer; one the engine rejected before is
                    // retired here, so the reservation gets REJECT with the original error.
                    let route = Route {
                        peer: self.peer,
                        refusal,
                    };
                    if let Some(rejected) = self.rooms.named(id, route) {
                        if let Err(e) = self.driver.retire(Instant::now(), rejected) {
                            tracing::warn!(peer = self.peer, error = %e, "rejection not retired");
                        }
                    }
                    continue;
                }
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
                        m.transfer("sender", &outcome_label(&reason));
                    }
                    let span = self
                        .spans
                        .remove(&transfer.transfer_id)
                        .unwrap_or_else(tracing::Span::none);
                    let closed = self.driver.closed().is_some();
                    self.log.failed(&span, transfer, &reason, closed);
                    (
                        transfer.transfer_id,
                        Err(transfer_error(reason, self.driver.closed())),
                    )
                }
            };
            if let Some(reply) = self.waiting.remove(&id) {
                let _ = reply.send(result);
            }
        }
    }

    fn execute(&mut self, cmd: Cmd) {
        let now = Instant::now();
        match cmd {
            Cmd::Retire(rejected) => {
                self.stats.rejected_at_admission += 1;
                if let Some(m) = &self.metrics {
                    m.rejected_at_admission.inc();
                }
                tracing::info!(transfer_id = rejected.transfer_id.0, peer = self.peer, error = %rejected.error, "request rejected at admission");
                if let Err(e) = self.driver.retire(now, rejected) {
                    tracing::warn!(peer = self.peer, error = %e, "rejection not retired");
                }
            }
            Cmd::Send {
                admitted,
                source,
                reply,
            } => self.start(now, admitted, source, reply),
            Cmd::Open { admitted, reply } => {
                if self.driver.closed().is_some() {
                    let _ = reply.send(Err(TransferError::Failed(FailureReason::PeerLost)));
                    return;
                }
                let id = admitted.transfer_id();
                match self.driver.open(now, admitted) {
                    Ok(()) => self.track(id, reply),
                    Err(e) => {
                        let _ = reply.send(Err(start_error(e)));
                    }
                }
            }
            Cmd::Chunk {
                transfer_id,
                pages,
                aux,
                reply,
            } => {
                let r = self
                    .driver
                    .submit_chunk(now, transfer_id, &pages, aux)
                    .map_err(TransferError::Chunk);
                let _ = reply.send(r);
            }
            Cmd::Batch(batch) => {
                for (admitted, pages, reply) in batch {
                    self.start(now, admitted, Source::Pages(pages), reply);
                }
            }
            Cmd::Abort { transfer_id, code } => {
                if let Some(m) = &self.metrics {
                    m.aborts.inc();
                }
                self.driver.abort(now, transfer_id, code);
            }
            Cmd::FillFree { f, reply } => {
                self.driver.fill_free_pages(f);
                let _ = reply.send(());
            }
            Cmd::Stats { reply } => {
                let pool = self.driver.pool();
                let mut s = self.stats;
                let d = self.driver.stats();
                s.writes = d.writes_completed;
                s.digest_jobs_split = d.digest_jobs_split;
                s.digest_jobs_offloaded = d.digest_jobs_offloaded;
                s.pages_digested_after_write = d.pages_digested_after_write;
                s.bytes = d.writes_completed * pool.geometry().bytes_per_page_index();
                s.pages_free = pool.free_pages();
                s.pages_total = pool.capacity_pages();
                s.peer_lost = self.driver.closed().is_some();
                s.open_transfers = self.driver.session().open_transfers();
                s.failed_lanes = self.driver.transport().failed_lanes();
                s.moves = self.driver.session().stats().moves;
                let _ = reply.send(s);
            }
        }
    }
}

impl<T: SenderTransport> Task<T> {
    /// Publishes the connection's failed lanes (metrics on), as the receiver does its gauges.
    fn publish(&mut self) {
        let (Some(m), Some(label)) = (&self.metrics, &self.label) else {
            return;
        };
        let failed = self.driver.transport().failed_lanes();
        m.failed_lanes.get_or_create(label).set(failed as i64);
    }

    /// Starts one transfer, or answers why it cannot start.
    fn start(&mut self, now: Instant, admitted: Admitted, source: Source, reply: Reply) {
        if self.driver.closed().is_some() {
            let _ = reply.send(Err(TransferError::Failed(FailureReason::PeerLost)));
            return;
        }
        let id = admitted.transfer_id();
        let started = match source {
            Source::Fill(fill) => self.driver.submit(now, admitted, fill),
            Source::Pages(pages) => self.driver.submit_pages(now, admitted, &pages),
        };
        match started {
            Ok(()) => self.track(id, reply),
            Err(e) => {
                let _ = reply.send(Err(start_error(e)));
            }
        }
    }

    /// Follows a started transfer until its outcome, which goes to `reply`.
    fn track(&mut self, id: TransferId, reply: Reply) {
        let span = tracing::info_span!(
            "transfer",
            transfer_id = id.0,
            peer = self.peer,
            role = "sender"
        );
        span.in_scope(|| tracing::debug!("submitted"));
        self.spans.insert(id, span);
        self.waiting.insert(id, reply);
    }
}

impl<T: SenderTransport> ConnectionTask for Task<T> {
    type Command = Cmd;
    type Driver = SenderDriver<T>;

    fn driver(&mut self) -> &mut SenderDriver<T> {
        &mut self.driver
    }

    fn report(&mut self) {
        self.hand_over();
        self.publish();
        let open = crate::driver::Driver::open_transfers(&self.driver);
        self.log.summarize(self.driver.closed(), open);
    }

    fn command(&mut self, command: Cmd) {
        self.execute(command);
    }
}

/// A transfer sent in chunks ([`SenderConn::open`]).
#[derive(Debug)]
pub struct OutgoingTransfer {
    transfer_id: TransferId,
    cmd: mpsc::UnboundedSender<Cmd>,
    outcome: oneshot::Receiver<Result<(), TransferError>>,
    sent: bool,
}

impl OutgoingTransfer {
    /// The transfer's id.
    pub fn transfer_id(&self) -> TransferId {
        self.transfer_id
    }

    /// Sends the next chunk: `pages` of the registered memory, in transfer order after the
    /// chunks before it, read in place until the transfer's outcome (the engine must not
    /// write them meanwhile). `aux` goes with the final chunk only (the one that completes
    /// the request's pages). The returned future says whether the chunk was taken (a refused
    /// chunk changes nothing; see [`ChunkStartError`](super::ChunkStartError)); the
    /// engine need not wait for it before computing the next chunk.
    pub fn send_chunk(
        &self,
        pages: Vec<u32>,
        aux: Option<Vec<u8>>,
    ) -> impl std::future::Future<Output = Result<(), TransferError>> + Send + 'static {
        let (reply, rx) = oneshot::channel();
        let sent = self.cmd.send(Cmd::Chunk {
            transfer_id: self.transfer_id,
            pages,
            aux,
            reply,
        });
        async move {
            sent.map_err(|_| TransferError::ConnectionClosed)?;
            rx.await.map_err(|_| TransferError::ConnectionClosed)?
        }
    }

    /// Aborts the transfer (stop posting, drain, ABORT).
    pub fn abort(&self, code: ErrorCode) {
        let _ = self.cmd.send(Cmd::Abort {
            transfer_id: self.transfer_id,
            code,
        });
    }

    /// The transfer's outcome as a future that borrows nothing, so the engine can wait for it
    /// (e.g. on another task) while it still sends chunks and may abort through `self`: a
    /// failure before the final chunk (an abort by the receiver, a lost peer) resolves it at
    /// once. It resolves like [`OutgoingTransfer::outcome`]; take it once: afterwards
    /// `outcome` and a second `take_outcome` resolve with
    /// [`TransferError::ConnectionClosed`].
    pub fn take_outcome(
        &mut self,
    ) -> impl std::future::Future<Output = Result<(), TransferError>> + Send + 'static {
        let (_, spent) = oneshot::channel();
        let rx = std::mem::replace(&mut self.outcome, spent);
        let sent = std::mem::replace(&mut self.sent, false);
        async move {
            if !sent {
                return Err(TransferError::ConnectionClosed);
            }
            rx.await.map_err(|_| TransferError::ConnectionClosed)?
        }
    }

    /// Waits until the receiver verified the transfer, or the typed reason it failed
    /// (reported only once nothing reads its source pages any more).
    pub async fn outcome(self) -> Result<(), TransferError> {
        if !self.sent {
            return Err(TransferError::ConnectionClosed);
        }
        self.outcome
            .await
            .map_err(|_| TransferError::ConnectionClosed)?
    }
}

/// The `outcome` label of a sender's failed transfer in the metrics: its code, except
/// Unconfirmed, which is not a failure of its cause's code (the receiver may have delivered,
/// SPEC §7.6) and is counted apart.
fn outcome_label(reason: &FailureReason) -> String {
    match reason {
        FailureReason::Unconfirmed { .. } => "unconfirmed".to_string(),
        r => r.code().to_string(),
    }
}

#[cfg(test)]
mod outcome_tests {
    use super::*;

    /// SPEC §7.6: an Unconfirmed transfer is counted under its own outcome, never under its
    /// cause's code (PEER_UNRESPONSIVE here), which would count it a failure.
    #[test]
    fn an_unconfirmed_transfer_has_its_own_metrics_outcome() {
        let cause = FailureReason::PeerUnresponsive;
        assert_eq!(
            outcome_label(&FailureReason::Unconfirmed {
                cause: Box::new(cause.clone())
            }),
            "unconfirmed"
        );
        assert_eq!(outcome_label(&cause), cause.code().to_string());
        let m = crate::metrics::Metrics::new();
        m.transfer(
            "sender",
            &outcome_label(&FailureReason::Unconfirmed {
                cause: Box::new(cause),
            }),
        );
        assert!(
            m.encode().contains(r#"outcome="unconfirmed""#),
            "{}",
            m.encode()
        );
    }
}
