//! The prefill-side driver: admission, source pages, posting writes, digests, commit, abort.
//!
//! [`SenderEndpoint`] wraps the sans-IO [`SenderSession`] with real memory (a [`PagePool`]
//! of source pages) and carries out its effects: it computes digests over the source pages,
//! paces page writes through a posting window (so an abort can stop posting), and releases
//! source pages only when the session says no transport still reads them. It is
//! transport-agnostic: the transport takes [`PostedWrite`]s from [`SenderEndpoint::poll_write`]
//! and reports completions with [`SenderEndpoint::handle_write_completion`].

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvwire_proto::admission::{AdmissionError, AdmissionPolicy, Admitted, Request};
use kvwire_proto::handshake::Established;
use kvwire_proto::sender::{
    PageWrite, SenderAction, SenderConfig, SenderEvent, SenderSession, SubmitError, WriteOutcome,
};
use kvwire_proto::wire::{ErrorCode, Frame, TransferDigests, TransferRef};
use kvwire_proto::FrameError;

use crate::checksum::{DigestExecution, DigestJob, DigestMode, DigestRunner, UnsupportedAlgorithm};
use crate::config::{ConfigError, EngineConfig};
use crate::memory::{PageLease, PagePool, PoolError};

/// A page write for the transport to carry out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostedWrite {
    /// The reservation it serves.
    pub transfer: TransferRef,
    /// The receiver's access descriptor from RESERVE, shared by all writes of the transfer
    /// (cloning it is a reference-count increment, not an allocation).
    pub access: Arc<[u8]>,
    /// The write.
    pub write: PageWrite,
}

/// Why [`SenderEndpoint::submit`] could not start a transfer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// Too few free source pages now; the request is handed back to retry later.
    #[error("sender pool has too few free pages: {source}")]
    OutOfPages {
        /// The request, to retry.
        admitted: Admitted,
        /// The pool's error.
        source: PoolError,
    },
    /// The session refused it (duplicate id, lost connection).
    #[error("session refused the transfer: {0:?}")]
    Session(SubmitError),
}

/// Counters of a sender endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SenderEndpointStats {
    /// Requests rejected at admission.
    pub rejected_at_admission: u64,
    /// Page writes posted.
    pub writes_posted: u64,
    /// Page writes withdrawn before posting.
    pub writes_cancelled: u64,
}

#[derive(Debug)]
struct Posting {
    transfer: TransferRef,
    access: Arc<[u8]>,
    pending: VecDeque<PageWrite>,
    outstanding: u32,
}

/// The prefill side of one connection, over real source memory.
#[derive(Debug)]
pub struct SenderEndpoint {
    session: SenderSession,
    pool: PagePool,
    admission: AdmissionPolicy,
    window: u32,
    sources: BTreeMap<u64, Vec<PageLease>>,
    postings: BTreeMap<u64, Posting>,
    writes: VecDeque<PostedWrite>,
    stats: SenderEndpointStats,
    digests: DigestRunner,
}

impl SenderEndpoint {
    /// Builds the endpoint; refuses to start if the pool's geometry differs from the layout
    /// negotiated in `established`, or if the pool as built cannot hold the configured
    /// context length (unless the configuration explicitly allows it, with a warning).
    pub fn new(
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: SenderConfig,
        window: u32,
    ) -> Result<Self, ConfigError> {
        engine.validate(&pool)?;
        crate::config::check_layout(&pool, established.layout())?;
        let admission = AdmissionPolicy {
            tokens_per_page: pool.geometry().tokens_per_page,
            pool_pages: pool.capacity_pages(),
            max_context_tokens: engine.max_context_tokens,
        };
        Ok(Self {
            session: SenderSession::new(established, config),
            pool,
            admission,
            window: window.max(1),
            sources: BTreeMap::new(),
            postings: BTreeMap::new(),
            writes: VecDeque::new(),
            stats: SenderEndpointStats::default(),
            digests: DigestRunner::default(),
        })
    }

    /// Admits a request, or rejects it with its original error. A rejected request is
    /// retired at once: a reservation for it gets REJECT carrying that error, and nothing
    /// is allocated, written or sent for it otherwise.
    pub fn admit(&mut self, req: Request) -> Result<Admitted, AdmissionError> {
        self.admission.admit(req).map_err(|rejected| {
            self.stats.rejected_at_admission += 1;
            let error = rejected.error.clone();
            self.session.retire(rejected);
            error
        })
    }

    /// Allocates the admitted request's source pages, lets `fill(ordinal, buffer, bytes)`
    /// write the KV data into them (the prefill), and submits the transfer.
    pub fn submit(
        &mut self,
        now: Instant,
        admitted: Admitted,
        mut fill: impl FnMut(u32, usize, &mut [u8]),
    ) -> Result<(), StartError> {
        let leases = match self.pool.allocate(admitted.pages()) {
            Ok(l) => l,
            Err(source) => return Err(StartError::OutOfPages { admitted, source }),
        };
        for (ordinal, lease) in (0u32..).zip(&leases) {
            for b in 0..self.pool.buffers() {
                if let Ok(mut page) = self.pool.page_mut(lease, b) {
                    fill(ordinal, b, &mut page);
                }
            }
        }
        let id = admitted.transfer_id();
        let pages = leases.iter().map(PageLease::page).collect();
        match self.session.submit(now, admitted, pages) {
            Ok(()) => {
                self.sources.insert(id, leases);
                self.process(now);
                Ok(())
            }
            Err(e) => {
                for l in leases {
                    // Fresh leases of this pool: release cannot fail.
                    let _ = self.pool.release(l);
                }
                Err(StartError::Session(e))
            }
        }
    }

    /// Aborts a transfer: stop posting, drain, then ABORT.
    pub fn abort(&mut self, now: Instant, transfer_id: u64, code: ErrorCode) -> bool {
        let r = self.session.abort(now, transfer_id, code);
        self.process(now);
        r
    }

    /// Handles a frame from the receiver.
    pub fn handle_frame(&mut self, now: Instant, frame: Frame) -> Result<(), FrameError> {
        let r = self.session.handle_frame(now, frame);
        self.process(now);
        r
    }

    /// The transport reports one page write of `transfer` complete (`ok`) or failed.
    pub fn handle_write_completion(&mut self, now: Instant, transfer: TransferRef, ok: bool) {
        if let Some(p) = self.postings.get_mut(&transfer.transfer_id) {
            if p.transfer == transfer {
                p.outstanding = p.outstanding.saturating_sub(1);
            }
        }
        let outcome = if ok {
            WriteOutcome::Completed
        } else {
            WriteOutcome::Failed
        };
        self.session.handle_write_outcome(now, transfer, outcome, 1);
        self.pump(transfer.transfer_id);
        self.process(now);
    }

    /// Handles the passage of time.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.session.handle_timeout(now);
        self.process(now);
    }

    /// The connection is gone.
    pub fn handle_peer_lost(&mut self, now: Instant) {
        self.session.handle_peer_lost(now);
        self.process(now);
    }

    fn pump(&mut self, transfer_id: u64) {
        let Some(p) = self.postings.get_mut(&transfer_id) else {
            return;
        };
        while p.outstanding < self.window {
            let Some(write) = p.pending.pop_front() else {
                break;
            };
            p.outstanding += 1;
            self.stats.writes_posted += 1;
            self.writes.push_back(PostedWrite {
                transfer: p.transfer,
                access: p.access.clone(),
                write,
            });
        }
    }

    /// Carries out every queued session effect.
    fn process(&mut self, now: Instant) {
        while let Some(action) = self.session.poll_action() {
            match action {
                SenderAction::ComputeDigests {
                    transfer,
                    algorithm,
                    page_digests,
                } => {
                    let Some(leases) = self.sources.get(&transfer.transfer_id) else {
                        continue;
                    };
                    // The view pins the source pages until the job is dropped.
                    let pages = leases.iter().map(PageLease::page).collect();
                    let view = self.pool.share_pages(pages);
                    if let Some(result) =
                        self.digests.start(transfer, algorithm, page_digests, view)
                    {
                        self.finish_digests(now, transfer, result);
                    }
                }
                SenderAction::PostWrites {
                    transfer,
                    writes,
                    access,
                } => {
                    self.postings.insert(
                        transfer.transfer_id,
                        Posting {
                            transfer,
                            access: access.into(),
                            pending: writes.into(),
                            outstanding: 0,
                        },
                    );
                    self.pump(transfer.transfer_id);
                }
                SenderAction::CancelWrites(transfer) => {
                    let n = match self.postings.get_mut(&transfer.transfer_id) {
                        Some(p) if p.transfer == transfer => {
                            let n = p.pending.len() as u32;
                            p.pending.clear();
                            n
                        }
                        _ => 0,
                    };
                    // Writes handed to the transport but not yet taken are withdrawn too.
                    let before = self.writes.len();
                    self.writes.retain(|w| w.transfer != transfer);
                    let n = n + (before - self.writes.len()) as u32;
                    if let Some(p) = self.postings.get_mut(&transfer.transfer_id) {
                        p.outstanding = p
                            .outstanding
                            .saturating_sub((before - self.writes.len()) as u32);
                    }
                    self.stats.writes_cancelled += u64::from(n);
                    if n > 0 {
                        self.session.handle_write_outcome(
                            now,
                            transfer,
                            WriteOutcome::Cancelled,
                            n,
                        );
                    }
                }
                SenderAction::ReleaseSource(id) => {
                    self.postings.remove(&id);
                    for lease in self.sources.remove(&id).unwrap_or_default() {
                        if let Err(e) = self.pool.release(lease) {
                            tracing::error!(transfer_id = id, error = %e, "source page release refused");
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

    /// The next page write to carry out.
    pub fn poll_write(&mut self) -> Option<PostedWrite> {
        self.writes.pop_front()
    }

    /// The page write [`SenderEndpoint::poll_write`] would return next, left queued (a
    /// transport with several queues checks it has room before taking it).
    pub fn peek_write(&self) -> Option<&PostedWrite> {
        self.writes.front()
    }

    /// The next event for the engine.
    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.session.poll_event()
    }

    /// When [`SenderEndpoint::handle_timeout`] must next be called.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        self.session.poll_timeout()
    }

    /// Sets the digest mode. [`DigestMode::UnverifiedBenchmarkOnly`] delivers unverified
    /// data and exists only to measure the integrity tax.
    pub fn set_digest_mode(&mut self, mode: DigestMode) {
        self.digests.mode = mode;
    }

    /// Sets where digests are computed: inline (the default) or handed to the driver as
    /// [`DigestJob`]s through [`SenderEndpoint::poll_digest_job`].
    pub fn set_digest_execution(&mut self, execution: DigestExecution) {
        self.digests.execution = execution;
    }

    /// The next digest job to run ([`DigestExecution::Deferred`]). Run it anywhere, drop it,
    /// and hand the result to [`SenderEndpoint::handle_digest_result`].
    pub fn poll_digest_job(&mut self) -> Option<DigestJob> {
        self.digests.poll_job()
    }

    /// A digest job finished. The job must already be dropped: its pages are then unpinned.
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

    /// Writes into every *free* source page (for example to initialise KV memory);
    /// `f(page, buffer, bytes)`. Pages leased to a transfer are not touched.
    pub fn fill_free_pages(&mut self, mut f: impl FnMut(u32, usize, &mut [u8])) {
        for p in 0..self.pool.capacity_pages() {
            if self.pool.state(p) != Some(crate::memory::PageState::Free) {
                continue;
            }
            for b in 0..self.pool.buffers() {
                if let Some(mut page) = self.pool.raw_page_mut(p, b) {
                    f(p, b, &mut page);
                }
            }
        }
    }

    /// The source page pool.
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// The protocol session.
    pub fn session(&self) -> &SenderSession {
        &self.session
    }

    /// Counters.
    pub fn stats(&self) -> SenderEndpointStats {
        self.stats
    }
}
