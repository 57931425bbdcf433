//! The decode side of a connection: a handle for the engine, verified KV handles that read
//! their pages in place, and the connection's task, which runs the receiver driver over the
//! connection's transport.

use kvwire_proto::wire::{TransferId, TransferIdMap};
use std::sync::Arc;
use std::time::Instant;

use kvwire_proto::wire::{ErrorCode, Hello, TransferRef};
use kvwire_proto::FailureReason;
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot};

use super::{transfer_error, ConnectionTask, EngineError, Node, NodeConfig, TransferError};
use crate::memory::{PagePool, PageRef, PoolError};
use crate::metrics::{Connection, Metrics};
use crate::receiver::{ReceiveOutcome, ReceiverDriver, ReserveParams, VerifiedKv};
use crate::transport::ReceiverTransport;

enum Cmd {
    Reserve {
        params: ReserveParams,
        reply: oneshot::Sender<Result<Verified, TransferError>>,
    },
    Refuse {
        transfer_id: TransferId,
        code: ErrorCode,
        detail: String,
    },
    Abort {
        transfer_id: TransferId,
        code: ErrorCode,
    },
    Stats {
        reply: oneshot::Sender<ReceiverConnStats>,
    },
}

/// Counters of a receiver connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReceiverConnStats {
    /// Transfers verified and delivered.
    pub verified: u64,
    /// Transfers failed.
    pub failed: u64,
    /// Page writes that landed (transports that see landings: TCP, loopback).
    pub pages_landed: u64,
    /// Bytes of the page writes that landed.
    pub bytes_landed: u64,
    /// Fences carried out.
    pub fences: u64,
    /// Transfers whose digests were taken as their pages landed (TCP, loopback), not read
    /// again after the fence (`NodeConfig::digest_at_landing`).
    pub digests_at_landing: u64,
    /// Page landings whose digests the transport took as the bytes landed, in pieces, while
    /// they were in cache (TCP, pages of more than 16 KiB in all buffers); the receiver
    /// digested the other landings as each was reported.
    pub pages_digested_by_transport: u64,
    /// Digest jobs split across several threads (`NodeConfig::digest_threads`).
    pub digest_jobs_split: u64,
    /// Digest jobs run on the blocking pool beside the connection, split or not
    /// (`NodeConfig::digest_offload_bytes`; by default RDMA's every one, TCP's from 8 MiB).
    pub digest_jobs_offloaded: u64,
    /// Pages free in the connection's pool.
    pub pages_free: u32,
    /// Pages in the connection's pool.
    pub pages_total: u32,
    /// Pages quarantined now.
    pub pages_quarantined: u32,
    /// Whether the peer is gone.
    pub peer_lost: bool,
    /// Whether this connection copies its pages out of the prefill's memory (same-host
    /// pulls over TCP, SPEC §9.3; `NodeConfig::same_host`) instead of receiving their bytes.
    pub same_host_pulls: bool,
    /// Transfers open on the connection: reserved and not yet delivered or failed, and those
    /// this end aborted whose ABORT_ACK has not come back (SPEC §7.3).
    pub open_transfers: usize,
    /// Lanes that failed while the connection went on (RDMA over several rails, SPEC §9.2);
    /// reconnect to use their rails again.
    pub failed_lanes: usize,
    /// Reservations moved off a failed lane: fenced, their pages bound on a live lane and
    /// reserved again (SPEC §9.2, moving a transfer).
    pub moves: u64,
    /// Reservations striped over several queue pairs, written over all of them at once
    /// (RDMA, SPEC §9.2, striping a transfer over lanes;
    /// `TransportConfig::Rdma::stripe_pages`).
    pub striped: u64,
}

/// KV pages of a verified transfer, read in place. Only a transfer whose digests, computed
/// over the memory that landed after the fence, matched the sender's is ever handed out;
/// nothing writes its pages while this handle holds them. They return to the pool when this
/// is released (which says whether the release succeeded) or dropped.
#[must_use = "dropping a Verified releases its pages"]
pub struct Verified {
    /// The transfer.
    pub transfer: TransferRef,
    /// Tokens verified.
    pub tokens: u32,
    kv: Option<VerifiedKv>,
    pool: Arc<PagePool>,
}

impl std::fmt::Debug for Verified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verified")
            .field("transfer", &self.transfer)
            .field("tokens", &self.tokens)
            .field("pages", &self.pages())
            .finish()
    }
}

impl Verified {
    /// Pages verified.
    pub fn pages(&self) -> usize {
        self.kv.as_ref().map_or(0, VerifiedKv::pages)
    }

    /// Buffers per page.
    pub fn buffers(&self) -> usize {
        self.pool.buffers()
    }

    /// The auxiliary record delivered with the pages (e.g. the first output token), verified
    /// against its digest; empty if the sender sent none.
    pub fn aux(&self) -> &[u8] {
        self.kv.as_ref().map_or(&[][..], |kv| kv.aux.as_slice())
    }

    /// The destination page indices, in ordinal order.
    pub fn page_indices(&self) -> Vec<u32> {
        self.kv
            .as_ref()
            .map_or_else(Vec::new, |kv| kv.page_indices().collect())
    }

    /// The bytes of page `ordinal` in `buffer`, in place (no copy).
    pub fn page(&self, ordinal: usize, buffer: usize) -> Result<PageRef<'_>, PoolError> {
        match &self.kv {
            Some(kv) => kv.page(&self.pool, ordinal, buffer),
            None => Err(PoolError::PageOutOfRange {
                page: ordinal as u32,
                pages: 0,
            }),
        }
    }

    /// Gives the pages back to the pool now.
    pub fn release(mut self) -> Result<(), PoolError> {
        self.give_back()
    }

    fn give_back(&mut self) -> Result<(), PoolError> {
        let Some(kv) = self.kv.take() else {
            return Ok(());
        };
        let mut first = Ok(());
        for lease in kv.into_leases() {
            if let Err(e) = self.pool.release(lease) {
                first = first.and(Err(e));
            }
        }
        first
    }
}

impl Drop for Verified {
    fn drop(&mut self) {
        if let Err(e) = self.give_back() {
            tracing::error!(transfer_id = self.transfer.transfer_id.0, error = %e, "release of verified pages refused");
        }
    }
}

/// The decode side of one connection.
#[derive(Debug, Clone)]
pub struct ReceiverConn {
    cmd: mpsc::UnboundedSender<Cmd>,
    /// What the connection's task last reported: whether it ended and why, its lanes and
    /// transfers.
    shared: Arc<super::TaskReport>,
    peer: Hello,
}

impl ReceiverConn {
    super::open::constructors!(super::open::open::<ReceiverConn>);

    /// Starts the connection's task: the receiver driver over `transport`.
    pub(crate) fn run<T: ReceiverTransport + 'static>(
        est: kvwire_proto::handshake::Established,
        pool: Arc<PagePool>,
        transport: T,
        config: &NodeConfig,
    ) -> Result<Self, EngineError> {
        // A fresh nonce seed for every connection, whatever the transport (SPEC §5.2.1).
        let mut driver = ReceiverDriver::new(
            &est,
            pool,
            &config.engine,
            config.receiver.clone(),
            fresh_seed(),
            transport,
        )?;
        driver.enable_liveness(std::time::Instant::now(), config.liveness);
        driver.set_digest_mode(config.digest_mode);
        driver.set_digest_execution(super::digest_execution(config));
        driver.set_digest_at_landing(config.digest_at_landing);
        let (cmd, cmd_rx) = mpsc::unbounded_channel();
        let task = Task {
            driver,
            metrics: config
                .metrics
                .clone()
                .map(|m| (m, super::next_connection_label())),
            fences_reported: 0,
            peer: est.peer.node_id,
            spans: TransferIdMap::default(),
            waiting: TransferIdMap::default(),
            stats: ReceiverConnStats::default(),
            log: super::FailureLog::new("receiver", est.peer.node_id),
        };
        let shared = Arc::new(super::TaskReport::default());
        tokio::spawn(super::run_task(task, cmd_rx, shared.clone()));
        Ok(Self {
            cmd,
            shared,
            peer: est.peer,
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
    pub fn abort(&self, transfer_id: TransferId, code: ErrorCode) {
        let _ = self.cmd.send(Cmd::Abort { transfer_id, code });
    }

    /// Refuses request `transfer_id` without reserving anything for it (this node's pool or
    /// context cannot hold it, or the engine cancelled it first): the sender fails the
    /// request at once with `code` when its engine opens it, instead of waiting for a
    /// reservation (SPEC §5.1, "Refused before reservation"). Does nothing for a transfer
    /// with an open reservation ([`ReceiverConn::abort`] ends that one).
    pub fn refuse(&self, transfer_id: TransferId, code: ErrorCode, detail: impl Into<String>) {
        let _ = self.cmd.send(Cmd::Refuse {
            transfer_id,
            code,
            detail: detail.into(),
        });
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

/// A seed for reservation nonces that differs per connection and per process.
pub(crate) fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

/// The connection's task: the driver, and what the engine waits for.
struct Task<T> {
    driver: ReceiverDriver<T>,
    metrics: Option<(Arc<Metrics>, Connection)>,
    fences_reported: u64,
    peer: u64,
    /// A tracing span per open transfer (transfer id, nonce, peer), entered whenever the
    /// task handles it, closed when it ends.
    spans: TransferIdMap<tracing::Span>,
    waiting: TransferIdMap<oneshot::Sender<Result<Verified, TransferError>>>,
    stats: ReceiverConnStats,
    log: super::FailureLog,
}

impl<T: ReceiverTransport> Task<T> {
    /// Hands finished transfers to the engine.
    fn hand_over(&mut self) {
        while let Some(outcome) = self.driver.poll_outcome() {
            match outcome {
                ReceiveOutcome::Verified(kv) => {
                    self.stats.verified += 1;
                    let pool = self.driver.pool().clone();
                    if let Some((m, _)) = &self.metrics {
                        m.transfer("receiver", "verified");
                        let bytes = kv.pages() as u64 * pool.geometry().bytes_per_page_index();
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
                        kv: Some(kv),
                        pool,
                    };
                    // If the engine stopped waiting, dropping the handle releases the pages.
                    if let Some(reply) = self.waiting.remove(&id) {
                        let _ = reply.send(Ok(handle));
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
                    let closed = self.driver.closed().is_some();
                    self.log.failed(&span, transfer, &reason, closed);
                    if let Some(reply) = self.waiting.remove(&transfer.transfer_id) {
                        let _ = reply.send(Err(transfer_error(reason, self.driver.closed())));
                    }
                }
            }
        }
    }

    fn execute(&mut self, cmd: Cmd) {
        let now = Instant::now();
        match cmd {
            Cmd::Reserve { params, reply } => {
                if self.driver.closed().is_some() {
                    let _ = reply.send(Err(TransferError::Failed(FailureReason::PeerLost)));
                    return;
                }
                let tokens = params.tokens;
                match self.driver.reserve(now, params) {
                    Ok(t) => {
                        let span = tracing::info_span!(
                            "transfer",
                            transfer_id = t.transfer_id.0,
                            nonce = t.nonce,
                            peer = self.peer,
                            role = "receiver"
                        );
                        span.in_scope(|| tracing::debug!(tokens, "reserved"));
                        self.spans.insert(t.transfer_id, span);
                        self.waiting.insert(t.transfer_id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e.into()));
                    }
                }
            }
            Cmd::Refuse {
                transfer_id,
                code,
                detail,
            } => {
                tracing::info!(transfer_id = transfer_id.0, peer = self.peer, %code, "request refused before reservation");
                self.driver.refuse(now, transfer_id, code, detail);
            }
            Cmd::Abort { transfer_id, code } => {
                if let Some((m, _)) = &self.metrics {
                    m.aborts.inc();
                }
                self.driver.abort(now, transfer_id, code);
            }
            Cmd::Stats { reply } => {
                let pool = self.driver.pool();
                let d = self.driver.stats();
                let mut s = self.stats;
                s.pages_landed = d.pages_landed;
                s.bytes_landed = d.pages_landed * pool.geometry().bytes_per_page_index();
                s.pages_free = pool.free_pages();
                s.pages_total = pool.capacity_pages();
                s.pages_quarantined = pool.quarantined_pages();
                s.fences = d.fences;
                s.digests_at_landing = d.verified_from_landing;
                s.pages_digested_by_transport = d.pages_digested_by_transport;
                s.digest_jobs_split = d.digest_jobs_split;
                s.digest_jobs_offloaded = d.digest_jobs_offloaded;
                s.peer_lost = self.driver.closed().is_some();
                s.same_host_pulls = self.driver.transport().pulls_pages();
                s.open_transfers = self.driver.session().open_transfers();
                s.failed_lanes = self.driver.transport().failed_lanes();
                s.striped = self.driver.transport().striped_reservations();
                s.moves = d.moves;
                let _ = reply.send(s);
            }
        }
    }

    /// Publishes the pool gauges and new fences.
    fn publish(&mut self) {
        let Some((m, conn)) = &self.metrics else {
            return;
        };
        let pool = self.driver.pool();
        m.pages_free
            .get_or_create(conn)
            .set(i64::from(pool.free_pages()));
        m.pages_quarantined
            .get_or_create(conn)
            .set(i64::from(pool.quarantined_pages()));
        m.failed_lanes
            .get_or_create(conn)
            .set(self.driver.transport().failed_lanes() as i64);
        let fences = self.driver.stats().fences;
        m.fences.inc_by(fences - self.fences_reported);
        self.fences_reported = fences;
    }
}

impl<T: ReceiverTransport> ConnectionTask for Task<T> {
    type Command = Cmd;
    type Driver = ReceiverDriver<T>;

    fn driver(&mut self) -> &mut ReceiverDriver<T> {
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
