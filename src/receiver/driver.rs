//! The decode-side driver: the one loop that runs a [`ReceiverSession`] over a
//! [`ReceiverTransport`] and real destination memory.
//!
//! It leases destination pages, has the transport open an access scope over exactly those
//! pages, fences (the transport closes the scope) when the session asks, computes digests
//! over the memory that actually landed, quarantines the pages of failed transfers and
//! releases them only after their fence. The engine receives a [`VerifiedKv`] only for a
//! transfer whose digests matched.

use kvwire_proto::wire::{TransferId, TransferIdMap};
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvwire_proto::handshake::Established;
use kvwire_proto::receiver::{
    ReceiverAction, ReceiverConfig, ReceiverEvent, ReceiverSession, ReservationRequest,
    ReserveError,
};
use kvwire_proto::wire::{DigestAlgorithm, ErrorCode, TransferRef};
use kvwire_proto::FailureReason;

use super::landing::Landings;
use crate::checksum::DigestMode;
use crate::config::{ConfigError, EngineConfig};
use crate::driver::core::{driver_common, impl_driver, Core};
use crate::driver::DigestExecution;
use crate::memory::{Holder, PageLease, PagePool, PageRef, PoolError};
use crate::transport::{Closed, Fence, ReceiverTransport, TransportEvent};

/// What the engine asks to receive.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReserveParams {
    /// The transfer id (the request id both engines know).
    pub transfer_id: TransferId,
    /// Tokens expected.
    pub tokens: u32,
    /// How long the sender has to commit.
    pub timeout: Duration,
    /// The digest algorithm; `None` for the first agreed.
    pub digest: Option<DigestAlgorithm>,
    /// Require per-page digests (names the first bad page on a mismatch).
    pub page_digests: bool,
    /// The destination pages, chosen by the engine's own allocator (one per
    /// `tokens_per_page` tokens, in transfer order); `None` lets kvwire's pool choose. The
    /// transfer lands exactly there; a page kvwire already holds is refused
    /// ([`PoolError::AlreadyLeased`]).
    pub pages: Option<Vec<u32>>,
}

impl ReserveParams {
    /// A reservation of `tokens` tokens for `transfer_id`, committed within `timeout`, with
    /// the first agreed digest algorithm, buffer digests only, into pages kvwire's pool
    /// chooses.
    pub fn new(transfer_id: TransferId, tokens: u32, timeout: Duration) -> Self {
        Self {
            transfer_id,
            tokens,
            timeout,
            digest: None,
            page_digests: false,
            pages: None,
        }
    }

    /// Into exactly these pages (the engine's choice, in transfer order).
    pub fn into_pages(mut self, pages: Vec<u32>) -> Self {
        self.pages = Some(pages);
        self
    }

    /// With per-page digests (a mismatch names the first bad page).
    pub fn with_page_digests(mut self) -> Self {
        self.page_digests = true;
        self
    }

    /// With this digest algorithm (one agreed at the handshake).
    pub fn with_digest(mut self, digest: DigestAlgorithm) -> Self {
        self.digest = Some(digest);
        self
    }
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
    /// The prompt is longer than the context this node serves: nothing was reserved, and the
    /// sender was told (PROMPT_EXCEEDS_CONTEXT, SPEC §5.1 "Refused before reservation").
    #[error("rejected at the decode node: prompt of {tokens} tokens exceeds its context length of {context} tokens")]
    ExceedsContext {
        /// The request's tokens.
        tokens: u32,
        /// This node's context length.
        context: u64,
    },
}

/// KV pages of a verified transfer, owned by the engine until it gives them back with
/// [`ReceiverDriver::release`].
#[derive(Debug)]
#[must_use = "verified pages must be released to the pool when the engine is done with them"]
pub struct VerifiedKv {
    /// The transfer.
    pub transfer: TransferRef,
    /// Tokens verified.
    pub tokens: u32,
    /// The auxiliary record delivered with the pages (verified; may be empty).
    pub aux: Vec<u8>,
    leases: Vec<PageLease>,
}

impl VerifiedKv {
    /// The bytes of page `ordinal` in `buffer`.
    pub fn page<'a>(
        &self,
        pool: &'a PagePool,
        ordinal: usize,
        buffer: usize,
    ) -> Result<PageRef<'a>, PoolError> {
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

    /// The destination page indices, in ordinal order.
    pub fn page_indices(&self) -> impl Iterator<Item = u32> + '_ {
        self.leases.iter().map(PageLease::page)
    }

    /// The leases of the pages, in ordinal order (to release them to their pool).
    pub fn into_leases(self) -> Vec<PageLease> {
        self.leases
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

/// Counters of a receiver driver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReceiverDriverStats {
    /// Fences carried out.
    pub fences: u64,
    /// Pages quarantined.
    pub pages_quarantined: u64,
    /// Releases the session asked for while the transfer's fence had not completed. The
    /// driver fences first anyway; a non-zero count is a protocol-machine bug.
    pub release_before_fence: u64,
    /// Page writes that landed (transports that see landings: TCP, loopback).
    pub pages_landed: u64,
    /// Transfers failed because a reserved page did not receive all its bytes before the
    /// COMMIT (coverage, transports that see landings).
    pub coverage_failures: u64,
    /// Transfers verified from the page digests taken as their pages landed (no pass over
    /// the memory after the fence; SPEC §6, digests at landing).
    pub verified_from_landing: u64,
    /// Page landings whose digests the transport took as the page's bytes landed
    /// ([`ReceiverTransport::digest_landings`]; TCP, records longer than 16 KiB); the
    /// driver digested the other landings itself when they were reported.
    pub pages_digested_by_transport: u64,
    /// Digest jobs split across several threads of the blocking pool
    /// (`DigestExecution::Offload::threads`).
    pub digest_jobs_split: u64,
    /// Digest jobs run on the blocking pool, split or not (`DigestExecution::Offload`).
    pub digest_jobs_offloaded: u64,
    /// Reservations moved off a failed lane: their pages given a scope on a live lane and
    /// reserved again (SPEC §9.2).
    pub moves: u64,
}

/// Who waits for a fence that has not completed yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FenceWaiter {
    /// The session (it asked for the fence).
    Session,
    /// A release the session asked for without a fence first (a protocol-machine bug the
    /// driver defends against): the pages go back only once the fence completed.
    Release,
}

/// The decode side of one connection: a [`ReceiverSession`] over a transport `T` and a pool
/// of destination pages.
#[derive(Debug)]
pub struct ReceiverDriver<T> {
    core: Core<ReceiverSession, T>,
    /// Leases of every open transfer (and their current reservation).
    leases: TransferIdMap<(TransferRef, Vec<PageLease>)>,
    /// Transfers whose access scope is open (reserved, not fenced yet).
    open: BTreeSet<TransferId>,
    /// Transfers whose fence was started and has not completed, and who waits for it.
    fencing: TransferIdMap<(TransferRef, FenceWaiter)>,
    /// Coverage (transports that report landings): per open reservation, which ordinals
    /// received all their bytes under its scope (SPEC §6), and their digests at landing.
    coverage: TransferIdMap<Landings>,
    /// Digest pages as they land, when the transport reports landings (SPEC §6, digests at landing).
    digest_at_landing: bool,
    outcomes: VecDeque<ReceiveOutcome>,
    stats: ReceiverDriverStats,
    /// The context length this node serves: a longer prompt is refused before reserving.
    max_context_tokens: u64,
}

impl<T: ReceiverTransport> ReceiverDriver<T> {
    /// Builds the driver; refuses to start if the pool's geometry differs from the layout
    /// negotiated in `established`, or if the pool as built cannot hold the configured
    /// context length (unless explicitly allowed, with a warning).
    pub fn new(
        established: &Established,
        pool: Arc<PagePool>,
        engine: &EngineConfig,
        config: ReceiverConfig,
        nonce_seed: u64,
        transport: T,
    ) -> Result<Self, ConfigError> {
        engine.validate(&pool)?;
        crate::config::check_layout(&pool, established.layout())?;
        let mut session = ReceiverSession::new(established, config, nonce_seed);
        if transport.moves_transfers() {
            session.allow_moves();
        }
        Ok(Self {
            core: Core::new(session, transport, pool),
            leases: TransferIdMap::default(),
            open: BTreeSet::new(),
            fencing: TransferIdMap::default(),
            coverage: TransferIdMap::default(),
            digest_at_landing: true,
            outcomes: VecDeque::new(),
            stats: ReceiverDriverStats::default(),
            max_context_tokens: engine.max_context_tokens,
        })
    }

    driver_common!();

    /// Whether to digest pages as they land (on by default; only transports that report
    /// landings can). Off, the receiver digests every transfer's memory after its fence.
    pub fn set_digest_at_landing(&mut self, on: bool) {
        self.digest_at_landing = on;
    }

    /// Leases pages, has the transport open an access scope over exactly them, and sends
    /// RESERVE.
    pub fn reserve(&mut self, now: Instant, p: ReserveParams) -> Result<TransferRef, ReceiveError> {
        if self.core.closed.is_some() {
            return Err(ReserveError::PeerLost.into());
        }
        if u64::from(p.tokens) > self.max_context_tokens {
            // The seed incident's request: never reserved, never transferred; the sender
            // fails it at once with this code.
            let e = ReceiveError::ExceedsContext {
                tokens: p.tokens,
                context: self.max_context_tokens,
            };
            self.refuse(
                now,
                p.transfer_id,
                ErrorCode::PROMPT_EXCEEDS_CONTEXT,
                e.to_string(),
            );
            return Err(e);
        }
        if self.core.session.has_transfer(p.transfer_id) {
            // Refused before any page is leased or any scope opened: a transport keys its
            // scopes by transfer id, and a second scope would replace the open transfer's.
            return Err(ReserveError::DuplicateTransfer(p.transfer_id).into());
        }
        let holder = Holder::Receiving(p.transfer_id);
        let leases = match &p.pages {
            Some(pages) => self.core.pool.lease_pages_for(pages, holder)?,
            None => {
                let tpp = self.core.pool.geometry().tokens_per_page.max(1);
                self.core
                    .pool
                    .allocate_for(p.tokens.div_ceil(tpp), holder)?
            }
        };
        let pages: Vec<u32> = leases.iter().map(PageLease::page).collect();
        let access = match self.core.transport.open_scope(p.transfer_id, &pages) {
            Ok(a) => a,
            Err(e) => {
                self.release_leases(p.transfer_id, leases);
                return Err(ReceiveError::Access(e.0));
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
        match self.core.session.reserve(now, req) {
            Ok(transfer) => {
                self.core.transport.bind_scope(transfer);
                if self.core.transport.reports_landings() {
                    // Device pages are never digested at landing (they are not readable on
                    // the host): they are digested in device memory after the fence, which
                    // on a staging path completes only after the last copy into them did.
                    let digest = (self.digest_at_landing
                        && self.core.digests.mode == DigestMode::Verify
                        && !self.core.pool.memory().has_device_memory())
                    .then(|| self.core.session.digest_algorithm(transfer))
                    .flatten();
                    let buffers = self.core.pool.buffers();
                    if let Some(alg) = digest {
                        // Where the transport can, it digests each page as its bytes land.
                        self.core.transport.digest_landings(p.transfer_id, alg);
                    }
                    self.coverage.insert(
                        p.transfer_id,
                        Landings::new(transfer, leases.len(), buffers, digest),
                    );
                }
                self.open.insert(p.transfer_id);
                self.leases.insert(p.transfer_id, (transfer, leases));
                self.process(now);
                Ok(transfer)
            }
            Err(e) => {
                // A duplicate id must not close the open transfer's scope.
                if !matches!(e, ReserveError::DuplicateTransfer(_)) {
                    self.core.transport.abandon_scope(p.transfer_id);
                }
                self.release_leases(p.transfer_id, leases);
                Err(e.into())
            }
        }
    }

    fn release_leases(&mut self, transfer_id: TransferId, leases: Vec<PageLease>) {
        for l in leases {
            if let Err(e) = self.core.pool.release(l) {
                tracing::error!(transfer_id = transfer_id.0, error = %e, "page release refused");
            }
        }
    }

    /// Refuses a request never reserved here: ABORT with nonce 0 and `code`
    /// (`ReceiverSession::refuse`, SPEC §5.1). False, sending nothing, for an open one.
    pub fn refuse(
        &mut self,
        now: Instant,
        transfer_id: TransferId,
        code: ErrorCode,
        detail: String,
    ) -> bool {
        let r = self.core.session.refuse(transfer_id, code, detail);
        self.process(now);
        r
    }

    /// Aborts a transfer: fence, release, then ABORT.
    pub fn abort(&mut self, now: Instant, transfer_id: TransferId, code: ErrorCode) -> bool {
        let r = self.core.session.abort(now, transfer_id, code);
        self.process(now);
        r
    }

    /// Gives verified pages back to the pool.
    pub fn release(&mut self, kv: VerifiedKv) -> Result<(), PoolError> {
        let mut first = Ok(());
        for l in kv.leases {
            if let Err(e) = self.core.pool.release(l) {
                first = first.and(Err(e));
            }
        }
        first
    }

    /// Handles one transport event.
    pub fn handle_event(&mut self, now: Instant, event: TransportEvent) {
        let Some(event) = self.core.handle_common(now, event) else {
            self.process(now);
            return;
        };
        match event {
            TransportEvent::Landed {
                transfer,
                ordinal,
                page,
                digests,
            } => {
                self.stats.pages_landed += 1;
                // Only the page reserved at that ordinal counts as its landing: bytes put
                // elsewhere in the scope cover nothing and digest nothing for it.
                let reserved = self
                    .leases
                    .get(&transfer.transfer_id)
                    .filter(|(t, _)| *t == transfer)
                    .and_then(|(_, ls)| ls.get(ordinal as usize))
                    .map(PageLease::page);
                if let Some(l) = self.coverage.get_mut(&transfer.transfer_id) {
                    if l.transfer == transfer {
                        if reserved == Some(page) {
                            if l.land(&self.core.pool, ordinal, page, digests.as_ref()) {
                                self.stats.pages_digested_by_transport += 1;
                            }
                        } else {
                            l.misplaced();
                        }
                    }
                }
            }
            TransportEvent::Fenced(t) => match self.fencing.get(&t.transfer_id) {
                Some(&(f, waiter)) if f == t => {
                    self.fencing.remove(&t.transfer_id);
                    match waiter {
                        FenceWaiter::Session => self.core.session.handle_fenced(now, t),
                        FenceWaiter::Release => self.release_transfer(t),
                    }
                }
                _ => {}
            },
            _ => tracing::debug!("sender-side transport event at a receiver; ignored"),
        }
        self.process(now);
    }

    /// The next finished transfer.
    pub fn poll_outcome(&mut self) -> Option<ReceiveOutcome> {
        self.outcomes.pop_front()
    }

    /// Whether `page` is currently leased to `transfer` (by this driver, for an open
    /// transfer). Harnesses use it to detect writes landing where they must not.
    pub fn is_leased_to(&self, transfer: TransferRef, page: u32) -> bool {
        self.leases
            .get(&transfer.transfer_id)
            .filter(|(t, _)| *t == transfer)
            .is_some_and(|(_, ls)| {
                ls.iter()
                    .any(|l| l.page() == page && self.core.pool.holds(l.page(), l.generation()))
            })
    }

    fn leases_of(&self, transfer: TransferRef) -> Option<&Vec<PageLease>> {
        self.leases
            .get(&transfer.transfer_id)
            .filter(|(t, _)| *t == transfer)
            .map(|(_, l)| l)
    }

    /// Carries out every queued session effect and moves frames to the transport, until
    /// nothing is left to do.
    fn process(&mut self, now: Instant) {
        loop {
            let mut moved = false;
            while let Some(action) = self.core.session.poll_action() {
                moved = true;
                self.act(now, action);
            }
            while let Some(frame) = self.core.session.poll_transmit() {
                moved = true;
                self.core.transport.send_frame(now, &frame);
            }
            moved |= self.core.flush_liveness(now);
            while let Some(event) = self.core.session.poll_event() {
                moved = true;
                self.deliver(event);
            }
            if !moved {
                return;
            }
        }
    }

    fn deliver(&mut self, event: ReceiverEvent) {
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
                        aux: d.aux,
                        leases,
                    }));
            }
            ReceiverEvent::Failed { transfer, reason } => {
                self.outcomes
                    .push_back(ReceiveOutcome::Failed { transfer, reason });
            }
        }
    }

    fn act(&mut self, now: Instant, action: ReceiverAction) {
        match action {
            ReceiverAction::Quarantine(t) => {
                let n = self.leases_of(t).map_or(0, |leases| {
                    leases
                        .iter()
                        .filter(|l| self.core.pool.quarantine(l).is_ok())
                        .count()
                });
                self.stats.pages_quarantined += n as u64;
            }
            ReceiverAction::Fence(t) => {
                self.stats.fences += 1;
                self.open.remove(&t.transfer_id);
                match self.core.transport.fence(t) {
                    Fence::Done => self.core.session.handle_fenced(now, t),
                    Fence::Pending => {
                        self.fencing
                            .insert(t.transfer_id, (t, FenceWaiter::Session));
                    }
                }
            }
            ReceiverAction::ComputeDigests {
                transfer,
                algorithm,
                page_digests,
                aux,
            } => {
                // Coverage first: a reserved page that did not receive all its bytes for
                // this reservation holds stale contents, whatever its digest (SPEC §6).
                let landings = self
                    .coverage
                    .remove(&transfer.transfer_id)
                    .filter(|l| l.transfer == transfer);
                if let Some(ordinal) = landings.as_ref().and_then(Landings::first_missing) {
                    self.stats.coverage_failures += 1;
                    self.core
                        .session
                        .handle_missing_pages(now, transfer, ordinal);
                    return;
                }
                // Every page was digested right after it last landed, and the fence closed
                // the scope: no write can land any more, so these are the digests of the
                // memory as it is now (SPEC §6, digests at landing), without reading it again.
                if let Some(d) = landings.and_then(|l| l.digests(page_digests, &aux)) {
                    self.stats.verified_from_landing += 1;
                    self.core.session.handle_digests(now, transfer, d);
                    return;
                }
                let Some(leases) = self.leases_of(transfer) else {
                    return;
                };
                // Digests of the memory that actually landed, after the fence, and of the
                // COMMIT's aux record, in one (final) job; the pages are pinned (never
                // written or released) until the digest job is done.
                let pages = leases.iter().map(PageLease::page).collect();
                self.core.start_digests(
                    now,
                    transfer,
                    algorithm,
                    page_digests,
                    0,
                    pages,
                    Some(aux),
                );
            }
            ReceiverAction::Reopen(t) => self.reopen(now, t),
            ReceiverAction::Release(t) => {
                // The session releases only after the fence completed. Should it ever ask
                // earlier, fence first and give the pages back only after that fence.
                let unfenced = self.open.remove(&t.transfer_id);
                if unfenced || self.fencing.contains_key(&t.transfer_id) {
                    self.stats.release_before_fence += 1;
                    tracing::error!(
                        transfer_id = t.transfer_id.0,
                        "release requested before the fence completed; fencing first"
                    );
                    if unfenced && self.core.transport.fence(t) == Fence::Done {
                        self.release_transfer(t);
                    } else {
                        self.fencing
                            .insert(t.transfer_id, (t, FenceWaiter::Release));
                    }
                    return;
                }
                self.release_transfer(t);
            }
        }
    }

    /// A transfer moving off a failed lane, its old reservation fenced: the same pages get a
    /// scope on a live lane (RDMA: scrubbed again, windows bound there) and are reserved
    /// again (SPEC §9.2).
    fn reopen(&mut self, now: Instant, t: TransferRef) {
        let Some(pages) = self
            .leases_of(t)
            .map(|l| l.iter().map(PageLease::page).collect::<Vec<u32>>())
        else {
            return self.core.session.handle_reopen_failed(now, t);
        };
        let access = match self.core.transport.open_scope(t.transfer_id, &pages) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(transfer_id = t.transfer_id.0, error = %e.0, "a transfer could not move off its failed lane");
                return self.core.session.handle_reopen_failed(now, t);
            }
        };
        let count = pages.len();
        let Some(moved) = self.core.session.handle_reopened(now, t, pages, access) else {
            // It failed meanwhile: nobody saw the new scope.
            return self.core.transport.abandon_scope(t.transfer_id);
        };
        self.core.transport.bind_scope(moved);
        self.open.insert(t.transfer_id);
        if let Some(entry) = self.leases.get_mut(&t.transfer_id) {
            entry.0 = moved;
        }
        if let Some(landings) = self.coverage.get_mut(&t.transfer_id) {
            // Coverage starts afresh with the new reservation (its pages digested after the
            // fence, not as they land).
            *landings = Landings::new(moved, count, self.core.pool.buffers(), None);
        }
        self.stats.moves += 1;
        tracing::info!(
            transfer_id = t.transfer_id.0,
            "a transfer moved off its failed lane: reserved again on a live one"
        );
    }

    fn release_transfer(&mut self, t: TransferRef) {
        if self
            .coverage
            .get(&t.transfer_id)
            .is_some_and(|l| l.transfer == t)
        {
            self.coverage.remove(&t.transfer_id);
        }
        if self
            .leases
            .get(&t.transfer_id)
            .is_some_and(|(r, _)| *r == t)
        {
            if let Some((_, leases)) = self.leases.remove(&t.transfer_id) {
                self.release_leases(t.transfer_id, leases);
            }
        }
    }

    /// The destination page pool.
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.core.pool
    }

    /// The protocol session.
    pub fn session(&self) -> &ReceiverSession {
        &self.core.session
    }

    /// Counters.
    pub fn stats(&self) -> ReceiverDriverStats {
        let mut s = self.stats;
        s.digest_jobs_split = self.core.digests.split_jobs;
        s.digest_jobs_offloaded = self.core.digests.offloaded_jobs;
        s
    }
}

impl_driver!(ReceiverDriver, ReceiverTransport);
