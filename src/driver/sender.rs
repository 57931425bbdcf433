//! The prefill-side driver: the one loop that runs a [`SenderSession`] over a
//! [`SenderTransport`] and real source memory.
//!
//! It admits requests (a rejected one is retired at once), leases and fills source pages,
//! carries out the session's actions (digests over the source pages, page writes paced by a
//! posting window so an abort can stop them, source pages released only after the drain),
//! moves frames to the transport and feeds every transport event back into the session.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use kvwire_proto::admission::{AdmissionError, AdmissionPolicy, Admitted, Request};
use kvwire_proto::handshake::Established;
use kvwire_proto::sender::{
    PageWrite, SenderAction, SenderConfig, SenderEvent, SenderSession, SubmitError, WriteOutcome,
};
use kvwire_proto::wire::{ErrorCode, TransferDigests, TransferRef};
use kvwire_proto::{FrameError, Scope};

use super::digest::{DigestExecution, Digests};
use crate::checksum::DigestMode;
use crate::config::{ConfigError, EngineConfig};
use crate::memory::{PageLease, PagePool, PageState, PoolError};
use crate::transport::{Closed, SenderTransport, TransportEvent};

/// Why [`SenderDriver::submit`] could not start a transfer.
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

/// Counters of a sender driver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SenderDriverStats {
    /// Requests rejected at admission.
    pub rejected_at_admission: u64,
    /// Page writes posted to the transport.
    pub writes_posted: u64,
    /// Page writes withdrawn before posting.
    pub writes_cancelled: u64,
    /// Page writes the transport reported completed.
    pub writes_completed: u64,
}

/// The writes of one transfer not yet posted, and how many are posted and not yet done.
#[derive(Debug)]
struct Posting {
    transfer: TransferRef,
    access: Arc<[u8]>,
    pending: VecDeque<PageWrite>,
    outstanding: u32,
}

/// The prefill side of one connection: a [`SenderSession`] over a transport `T` and a pool of
/// source pages.
#[derive(Debug)]
pub struct SenderDriver<T> {
    session: SenderSession,
    transport: T,
    pool: Arc<PagePool>,
    admission: AdmissionPolicy,
    window: u32,
    sources: BTreeMap<u64, Vec<PageLease>>,
    postings: BTreeMap<u64, Posting>,
    batch: Vec<PageWrite>,
    digests: Digests,
    closed: Option<Closed>,
    stats: SenderDriverStats,
}

impl<T: SenderTransport> SenderDriver<T> {
    /// Builds the driver; refuses to start if the pool's geometry differs from the layout
    /// negotiated in `established`, or if the pool as built cannot hold the configured
    /// context length (unless the configuration explicitly allows it, with a warning).
    /// `window` bounds the page writes of one transfer in flight.
    pub fn new(
        established: &Established,
        pool: Arc<PagePool>,
        engine: &EngineConfig,
        config: SenderConfig,
        window: u32,
        transport: T,
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
            transport,
            pool,
            admission,
            window: window.max(1),
            sources: BTreeMap::new(),
            postings: BTreeMap::new(),
            batch: Vec::new(),
            digests: Digests::new(DigestMode::Verify, DigestExecution::Inline),
            closed: None,
            stats: SenderDriverStats::default(),
        })
    }

    /// Sets the digest mode. [`DigestMode::UnverifiedBenchmarkOnly`] delivers unverified
    /// data and exists only to measure the integrity tax.
    pub fn set_digest_mode(&mut self, mode: DigestMode) {
        self.digests.mode = mode;
    }

    /// Sets where digests are computed (inline by default).
    pub fn set_digest_execution(&mut self, execution: DigestExecution) {
        self.digests.execution = execution;
    }

    /// Admits a request, or rejects it with its original error. A rejected request is
    /// retired at once: a reservation for it gets REJECT carrying that error, and nothing
    /// is allocated, written or sent for it otherwise.
    pub fn admit(&mut self, now: Instant, req: Request) -> Result<Admitted, AdmissionError> {
        let r = self.admission.admit(req).map_err(|rejected| {
            self.stats.rejected_at_admission += 1;
            let error = rejected.error.clone();
            self.session.retire(rejected);
            error
        });
        self.process(now);
        r
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

    /// Handles the passage of time.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.session.handle_timeout(now);
        self.process(now);
    }

    /// When [`SenderDriver::handle_timeout`] must next be called (the session's deadlines and
    /// the transport's own wake-up, whichever is first).
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        let session = self.session.poll_timeout();
        let transport = self.transport.poll_timeout();
        session.into_iter().chain(transport).min()
    }

    /// Closes the connection from this side: every open transfer fails safely (drained,
    /// source pages released) as the transport reports the end of its writes.
    pub fn close(&mut self, now: Instant) {
        self.transport.close(now);
    }

    /// Waits for the next input (a transport event or a digest job finished elsewhere) and
    /// handles it. `Ready` when something was handled.
    pub fn poll_input(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<()> {
        if let Poll::Ready((t, r)) = self.digests.poll_done(cx) {
            self.finish_digests(now, t, r.map_err(|_| ()));
            self.process(now);
            return Poll::Ready(());
        }
        match self.transport.poll_event(cx, now) {
            Poll::Ready(ev) => {
                self.handle_event(now, ev);
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Handles one transport event.
    pub fn handle_event(&mut self, now: Instant, event: TransportEvent) {
        match event {
            TransportEvent::Frame(frame) => {
                if let Err(e) = self.session.handle_frame(now, frame) {
                    self.frame_error(now, e);
                }
            }
            TransportEvent::WritesDone {
                transfer,
                pages,
                ok,
            } => {
                if let Some(p) = self.postings.get_mut(&transfer.transfer_id) {
                    if p.transfer == transfer {
                        p.outstanding = p.outstanding.saturating_sub(pages);
                    }
                }
                let outcome = if ok {
                    self.stats.writes_completed += u64::from(pages);
                    WriteOutcome::Completed
                } else {
                    WriteOutcome::Failed
                };
                self.session
                    .handle_write_outcome(now, transfer, outcome, pages);
            }
            TransportEvent::Closed(why) => {
                if self.closed.is_none() {
                    self.closed = Some(why);
                    self.session.handle_peer_lost(now);
                }
            }
            TransportEvent::Landed { .. } | TransportEvent::Fenced(_) => {
                tracing::debug!("receiver-side transport event at a sender; ignored");
            }
        }
        self.process(now);
    }

    fn frame_error(&mut self, now: Instant, e: FrameError) {
        if e.scope == Scope::Connection {
            tracing::warn!(error = %e, "protocol error on the connection: closing it");
            self.transport.close(now);
        } else {
            tracing::debug!(error = %e, "frame dropped");
        }
    }

    /// The next event for the engine: a transfer verified by the receiver, or failed.
    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.session.poll_event()
    }

    /// Why the connection closed, once it has.
    pub fn closed(&self) -> Option<&Closed> {
        self.closed.as_ref()
    }

    /// Carries out every queued session effect, posts what the windows allow, and moves
    /// frames to the transport, until nothing is left to do.
    fn process(&mut self, now: Instant) {
        loop {
            let mut moved = false;
            while let Some(action) = self.session.poll_action() {
                moved = true;
                self.act(now, action);
            }
            moved |= self.post(now);
            while let Some(frame) = self.session.poll_transmit() {
                moved = true;
                self.transport.send_frame(now, &frame);
            }
            if !moved {
                return;
            }
        }
    }

    /// Posts pending writes, transfer by transfer, within each transfer's window and the
    /// transport's credit. Returns whether anything was posted.
    fn post(&mut self, now: Instant) -> bool {
        let mut credit = self.transport.write_credit();
        let mut posted = false;
        for p in self.postings.values_mut() {
            if credit == 0 {
                break;
            }
            let room = (self.window.saturating_sub(p.outstanding) as usize).min(credit);
            if room == 0 || p.pending.is_empty() {
                continue;
            }
            self.batch.clear();
            self.batch
                .extend(p.pending.drain(..room.min(p.pending.len())));
            let n = self.batch.len();
            p.outstanding += n as u32;
            credit -= n;
            self.stats.writes_posted += n as u64;
            self.transport
                .post_writes(now, p.transfer, &p.access, &self.batch);
            posted = true;
        }
        posted
    }

    fn act(&mut self, now: Instant, action: SenderAction) {
        match action {
            SenderAction::ComputeDigests {
                transfer,
                algorithm,
                page_digests,
            } => {
                let Some(leases) = self.sources.get(&transfer.transfer_id) else {
                    return;
                };
                // The view pins the source pages until the job is dropped.
                let pages = leases.iter().map(PageLease::page).collect();
                let view = self.pool.share_pages(pages);
                if let Some(result) = self.digests.start(transfer, algorithm, page_digests, view) {
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
                self.stats.writes_cancelled += u64::from(n);
                if n > 0 {
                    self.session
                        .handle_write_outcome(now, transfer, WriteOutcome::Cancelled, n);
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
            if self.pool.state(p) != Some(PageState::Free) {
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
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.pool
    }

    /// The protocol session.
    pub fn session(&self) -> &SenderSession {
        &self.session
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The transport, mutably (harnesses reach their fault injectors through it).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Counters.
    pub fn stats(&self) -> SenderDriverStats {
        self.stats
    }
}
