//! The decode-side driver: reservation, fencing, verification over landed memory, deferred
//! release, delivery of verified handles.
//!
//! [`ReceiverEndpoint`] wraps the sans-IO [`ReceiverSession`] with real memory: it leases
//! destination pages, opens an access scope over exactly those pages, fences (closes the
//! scope) when the session asks, computes digests over the memory that actually landed,
//! quarantines the pages of failed transfers and releases them only after their fence. The
//! engine receives a [`VerifiedKv`] only for a transfer whose digests matched.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use kvwire_proto::handshake::Established;
use kvwire_proto::receiver::{
    ReceiverAction, ReceiverConfig, ReceiverEvent, ReceiverSession, ReservationRequest,
    ReserveError,
};
use kvwire_proto::wire::{DigestAlgorithm, ErrorCode, Frame, TransferDigests, TransferRef};
use kvwire_proto::{FailureReason, FrameError};

use crate::checksum::{DigestExecution, DigestJob, DigestMode, DigestRunner, UnsupportedAlgorithm};
use crate::config::{ConfigError, EngineConfig};
use crate::memory::{PageLease, PagePool, PoolError};
use crate::transport::ScopeTable;

/// What the engine asks to receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReserveParams {
    /// The transfer id (the request id both engines know).
    pub transfer_id: u64,
    /// Tokens expected.
    pub tokens: u32,
    /// How long the sender has to commit.
    pub timeout: Duration,
    /// The digest algorithm; `None` for the first agreed.
    pub digest: Option<DigestAlgorithm>,
    /// Require per-page digests (names the first bad page on a mismatch).
    pub page_digests: bool,
}

/// Why a reservation could not be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReceiveError {
    /// Too few free pages.
    #[error("receiver pool: {0}")]
    Pool(#[from] PoolError),
    /// The session refused the reservation.
    #[error("reservation refused: {0}")]
    Reserve(#[from] ReserveError),
    /// The transport could not scope remote access to the pages (e.g. RDMA: binding a
    /// memory window failed, or the pages are too scattered for one descriptor).
    #[error("transport could not scope access to the pages: {0}")]
    Access(String),
}

/// Who completes a fence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FenceCompletion {
    /// The endpoint's scope table is the fence (loopback, TCP): closing the scope completes
    /// it at once.
    #[default]
    Immediate,
    /// The transport fences (RDMA: invalidating the reservation's memory windows). The
    /// transport takes fences from [`ReceiverEndpoint::poll_fenced`] and reports each with
    /// [`ReceiverEndpoint::handle_fence_complete`]; until then the transfer's pages are
    /// neither verified nor released.
    Transport,
}

/// KV pages of a verified transfer, owned by the engine until it gives them back with
/// [`ReceiverEndpoint::release`].
#[derive(Debug)]
#[must_use = "verified pages must be released to the pool when the engine is done with them"]
pub struct VerifiedKv {
    /// The transfer.
    pub transfer: TransferRef,
    /// Tokens verified.
    pub tokens: u32,
    leases: Vec<PageLease>,
}

impl VerifiedKv {
    /// The bytes of page `ordinal` in `buffer`.
    pub fn page<'a>(
        &self,
        pool: &'a PagePool,
        ordinal: usize,
        buffer: usize,
    ) -> Result<crate::memory::PageRef<'a>, PoolError> {
        let lease = self.leases.get(ordinal).ok_or(PoolError::PageOutOfRange {
            page: ordinal as u32,
            pages: self.leases.len() as u32,
        })?;
        pool.page(lease, buffer)
    }

    /// Pages.
    pub fn pages(&self) -> usize {
        self.leases.len()
    }
}

/// The end of a transfer, for the engine.
#[derive(Debug)]
pub enum ReceiveOutcome {
    /// Verified: the pages are the engine's.
    Verified(VerifiedKv),
    /// Failed: the pages were fenced and released.
    Failed {
        /// The transfer.
        transfer: TransferRef,
        /// Why.
        reason: FailureReason,
    },
}

/// Counters of a receiver endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReceiverEndpointStats {
    /// Fences carried out.
    pub fences: u64,
    /// Pages quarantined.
    pub pages_quarantined: u64,
    /// Releases the session asked for while the transfer's scope was still open. The
    /// endpoint fences first anyway; a non-zero count is a protocol-machine bug.
    pub release_before_fence: u64,
}

/// The decode side of one connection, over real destination memory.
#[derive(Debug)]
pub struct ReceiverEndpoint {
    session: ReceiverSession,
    pool: PagePool,
    scopes: ScopeTable,
    leases: BTreeMap<u64, (TransferRef, Vec<PageLease>)>,
    outcomes: VecDeque<ReceiveOutcome>,
    fenced: VecDeque<TransferRef>,
    fence: FenceCompletion,
    stats: ReceiverEndpointStats,
    digests: DigestRunner,
}

impl ReceiverEndpoint {
    /// Builds the endpoint; refuses to start if the pool's geometry differs from the layout
    /// negotiated in `established`, or if the pool as built cannot hold the configured
    /// context length (unless explicitly allowed, with a warning).
    pub fn new(
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: ReceiverConfig,
    ) -> Result<Self, ConfigError> {
        engine.validate(&pool)?;
        crate::config::check_layout(&pool, established.layout())?;
        Ok(Self {
            session: ReceiverSession::new(established, config),
            pool,
            scopes: ScopeTable::default(),
            leases: BTreeMap::new(),
            outcomes: VecDeque::new(),
            fenced: VecDeque::new(),
            fence: FenceCompletion::Immediate,
            stats: ReceiverEndpointStats::default(),
            digests: DigestRunner::default(),
        })
    }

    /// Leases pages, opens an access scope over them and sends RESERVE.
    pub fn reserve(&mut self, now: Instant, p: ReserveParams) -> Result<TransferRef, ReceiveError> {
        self.reserve_with(now, p, |_, key| Ok(key))
    }

    /// [`ReceiverEndpoint::reserve`] for transports with their own access scoping:
    /// `access(pages, table_descriptor)` returns the descriptor RESERVE carries (RDMA: the
    /// rkeys of memory windows bound over exactly `pages`). On `Err` nothing is reserved.
    pub fn reserve_with(
        &mut self,
        now: Instant,
        p: ReserveParams,
        access: impl FnOnce(&[u32], Vec<u8>) -> Result<Vec<u8>, String>,
    ) -> Result<TransferRef, ReceiveError> {
        let tpp = self.pool.geometry().tokens_per_page.max(1);
        let leases = self.pool.allocate(p.tokens.div_ceil(tpp))?;
        let pages: Vec<u32> = leases.iter().map(PageLease::page).collect();
        let key = self.scopes.open(p.transfer_id, &pages);
        let access = match access(&pages, key.to_descriptor()) {
            Ok(a) => a,
            Err(e) => {
                self.scopes.close(p.transfer_id);
                for l in leases {
                    let _ = self.pool.release(l);
                }
                return Err(ReceiveError::Access(e));
            }
        };
        let req = ReservationRequest {
            transfer_id: p.transfer_id,
            tokens: p.tokens,
            pages,
            digest: p.digest,
            page_digests: p.page_digests,
            timeout: p.timeout,
            access,
        };
        match self.session.reserve(now, req) {
            Ok(transfer) => {
                self.scopes.bind(transfer);
                self.leases.insert(p.transfer_id, (transfer, leases));
                Ok(transfer)
            }
            Err(e) => {
                // A duplicate id must not close the open transfer's scope.
                if !matches!(e, ReserveError::DuplicateTransfer(_)) {
                    self.scopes.close(p.transfer_id);
                }
                for l in leases {
                    let _ = self.pool.release(l);
                }
                Err(e.into())
            }
        }
    }

    /// Aborts a transfer: fence, release, then ABORT.
    pub fn abort(&mut self, now: Instant, transfer_id: u64, code: ErrorCode) -> bool {
        let r = self.session.abort(now, transfer_id, code);
        self.process(now);
        r
    }

    /// Handles a frame from the sender.
    pub fn handle_frame(&mut self, now: Instant, frame: Frame) -> Result<(), FrameError> {
        let r = self.session.handle_frame(now, frame);
        self.process(now);
        r
    }

    /// Handles the passage of time.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.session.handle_timeout(now);
        self.process(now);
    }

    /// The connection is gone: every open transfer is fenced, released and failed.
    pub fn handle_peer_lost(&mut self, now: Instant) {
        self.session.handle_peer_lost(now);
        self.process(now);
    }

    /// Gives verified pages back to the pool.
    pub fn release(&mut self, kv: VerifiedKv) -> Result<(), PoolError> {
        let mut first = Ok(());
        for l in kv.leases {
            if let Err(e) = self.pool.release(l) {
                first = first.and(Err(e));
            }
        }
        first
    }

    fn leases_of(&self, transfer: TransferRef) -> Option<&Vec<PageLease>> {
        self.leases
            .get(&transfer.transfer_id)
            .filter(|(t, _)| *t == transfer)
            .map(|(_, l)| l)
    }

    fn process(&mut self, now: Instant) {
        loop {
            while let Some(action) = self.session.poll_action() {
                self.act(now, action);
            }
            let Some(event) = self.session.poll_event() else {
                break;
            };
            match event {
                ReceiverEvent::Delivered(d) => {
                    let (_, leases) = self
                        .leases
                        .remove(&d.transfer.transfer_id)
                        .unwrap_or((d.transfer, Vec::new()));
                    self.outcomes
                        .push_back(ReceiveOutcome::Verified(VerifiedKv {
                            transfer: d.transfer,
                            tokens: d.tokens,
                            leases,
                        }));
                }
                ReceiverEvent::Failed { transfer, reason } => {
                    self.outcomes
                        .push_back(ReceiveOutcome::Failed { transfer, reason });
                }
            }
        }
    }

    fn act(&mut self, now: Instant, action: ReceiverAction) {
        match action {
            ReceiverAction::Quarantine(t) => {
                if let Some((_, leases)) = self.leases.get(&t.transfer_id).filter(|(r, _)| *r == t)
                {
                    for l in leases {
                        if self.pool.quarantine(l).is_ok() {
                            self.stats.pages_quarantined += 1;
                        }
                    }
                }
            }
            ReceiverAction::Fence(t) => {
                self.scopes.close(t.transfer_id);
                self.stats.fences += 1;
                self.fenced.push_back(t);
                if self.fence == FenceCompletion::Immediate {
                    self.session.handle_fenced(now, t);
                }
            }
            ReceiverAction::ComputeDigests {
                transfer,
                algorithm,
                page_digests,
            } => {
                let Some(leases) = self.leases_of(transfer) else {
                    return;
                };
                // Digests of the memory that actually landed, after the fence. The view pins
                // the pages until the job is dropped.
                let pages = leases.iter().map(PageLease::page).collect();
                let view = self.pool.share_pages(pages);
                if let Some(result) = self.digests.start(transfer, algorithm, page_digests, view) {
                    self.finish_digests(now, transfer, result);
                }
            }
            ReceiverAction::Release(t) => {
                if self.scopes.close(t.transfer_id) {
                    self.stats.release_before_fence += 1;
                    tracing::error!(
                        transfer_id = t.transfer_id,
                        "release requested before fence; fenced now"
                    );
                }
                if let Some((_, leases)) = self.leases.remove(&t.transfer_id) {
                    for l in leases {
                        if let Err(e) = self.pool.release(l) {
                            tracing::error!(transfer_id = t.transfer_id, error = %e, "page release refused");
                        }
                    }
                }
            }
        }
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        self.session.poll_transmit()
    }

    /// Takes the page pool back, to serve a new connection after this one was lost (call
    /// [`Self::handle_peer_lost`] first, and take every event, so no page is still
    /// in use by this connection). Pages the engine still holds stay leased; their leases
    /// remain valid against the pool.
    pub fn into_pool(self) -> PagePool {
        self.pool
    }

    /// The next finished transfer.
    pub fn poll_outcome(&mut self) -> Option<ReceiveOutcome> {
        self.outcomes.pop_front()
    }

    /// The next transfer fenced: with [`FenceCompletion::Immediate`] its fence is complete
    /// (for transports that must react to it); with [`FenceCompletion::Transport`] the
    /// transport must now fence it and report [`ReceiverEndpoint::handle_fence_complete`].
    pub fn poll_fenced(&mut self) -> Option<TransferRef> {
        self.fenced.pop_front()
    }

    /// Sets who completes fences (before the first reservation).
    pub fn set_fence_completion(&mut self, fence: FenceCompletion) {
        self.fence = fence;
    }

    /// The transport's fence for `transfer` completed ([`FenceCompletion::Transport`]): no
    /// write for it can land any more. Verification or release proceeds.
    pub fn handle_fence_complete(&mut self, now: Instant, transfer: TransferRef) {
        self.session.handle_fenced(now, transfer);
        self.process(now);
    }

    /// When [`ReceiverEndpoint::handle_timeout`] must next be called.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        self.session.poll_timeout()
    }

    /// Whether `page` is currently leased to `transfer` (by this endpoint, for an open
    /// transfer). Used by transports to detect writes landing where they must not.
    pub fn is_leased_to(&self, transfer: TransferRef, page: u32) -> bool {
        self.leases_of(transfer).is_some_and(|ls| {
            ls.iter()
                .any(|l| l.page() == page && self.pool.holds(l.page(), l.generation()))
        })
    }

    /// Sets the digest mode. [`DigestMode::UnverifiedBenchmarkOnly`] delivers unverified
    /// data and exists only to measure the integrity tax.
    pub fn set_digest_mode(&mut self, mode: DigestMode) {
        self.digests.mode = mode;
    }

    /// Sets where digests are computed: inline (the default) or handed to the driver as
    /// [`DigestJob`]s through [`ReceiverEndpoint::poll_digest_job`].
    pub fn set_digest_execution(&mut self, execution: DigestExecution) {
        self.digests.execution = execution;
    }

    /// The next digest job to run ([`DigestExecution::Deferred`]). Run it anywhere, drop it,
    /// and hand the result to [`ReceiverEndpoint::handle_digest_result`].
    pub fn poll_digest_job(&mut self) -> Option<DigestJob> {
        self.digests.poll_job()
    }

    /// A digest job finished (`Err` if no digest could be made, e.g. an unsupported
    /// algorithm). The job must already be dropped: its pages are then unpinned.
    pub fn handle_digest_result(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        result: Result<TransferDigests, UnsupportedAlgorithm>,
    ) {
        self.finish_digests(now, transfer, result.map_err(|_| ()));
        self.process(now);
    }

    fn finish_digests(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        result: Result<TransferDigests, ()>,
    ) {
        match result {
            Ok(d) => self.session.handle_digests(now, transfer, d),
            Err(()) => {
                // No digest can be made: abort, then report the digest job as ended so the
                // session may release the pages it was waiting on.
                self.session
                    .abort(now, transfer.transfer_id, ErrorCode::DIGEST_UNSUPPORTED);
                self.session
                    .handle_digests(now, transfer, TransferDigests::default());
            }
        }
    }

    /// The destination page pool.
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// The pool and the scope table, for a transport landing writes.
    pub fn landing_parts(&mut self) -> (&PagePool, &ScopeTable) {
        (&self.pool, &self.scopes)
    }

    /// Open access scopes.
    pub fn open_scopes(&self) -> usize {
        self.scopes.open_scopes()
    }

    /// The protocol session.
    pub fn session(&self) -> &ReceiverSession {
        &self.session
    }

    /// Counters.
    pub fn stats(&self) -> ReceiverEndpointStats {
        self.stats
    }
}
