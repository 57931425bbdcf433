//! The prefill-side driver: the one loop that runs a [`SenderSession`] over a
//! [`SenderTransport`] and real source memory.
//!
//! It admits requests (a rejected one is retired at once), leases and fills source pages,
//! carries out the session's actions (digests over the source pages, page writes paced by a
//! posting window so an abort can stop them, source pages released only after the drain),
//! moves frames to the transport and feeds every transport event back into the session.

use kvwire_proto::wire::{TransferId, TransferIdMap};
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use kvwire_proto::admission::{AdmissionError, AdmissionPolicy, Admitted, Rejected, Request};
use kvwire_proto::handshake::Established;
use kvwire_proto::sender::{
    ChunkError, PageWrite, RetireError, SenderAction, SenderConfig, SenderEvent, SenderSession,
    SubmitError, WriteOutcome,
};
use kvwire_proto::wire::{ErrorCode, TransferRef};

use crate::checksum::DigestMode;
use crate::config::{ConfigError, EngineConfig};
use crate::driver::core::{driver_common, impl_driver, Core};
use crate::driver::DigestExecution;
use crate::memory::{Holder, PageLease, PagePool, PageState, PoolError};
use crate::transport::{Closed, SenderTransport, TransportEvent};

/// Why a transfer could not start (the sender driver's `submit`).
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
    /// The engine's source pages cannot be read for it (out of range, named twice, or
    /// held by a reservation); the request is handed back.
    #[error("source pages refused: {source}")]
    Pages {
        /// The request, to retry.
        admitted: Admitted,
        /// The pool's error.
        source: PoolError,
    },
    /// The session refused it (duplicate id, lost connection).
    #[error("session refused the transfer: {0:?}")]
    Session(SubmitError),
}

/// Why a chunk could not be sent.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChunkStartError {
    /// The chunk's pages cannot be read for it (out of range, named twice, or held by a
    /// reservation).
    #[error("chunk pages refused: {0}")]
    Pages(PoolError),
    /// The session refused the chunk (unknown or finished transfer, too many pages, aux
    /// before the final chunk or over the receiver's limit, lost connection).
    #[error("chunk refused: {0}")]
    Session(ChunkError),
}

/// The admission limits of a sender over `pool` (the pool as built, not the configured
/// numbers).
pub fn admission_policy(pool: &PagePool, engine: &EngineConfig) -> AdmissionPolicy {
    AdmissionPolicy {
        tokens_per_page: pool.geometry().tokens_per_page,
        pool_pages: pool.capacity_pages(),
        max_context_tokens: engine.max_context_tokens,
    }
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
    /// Digest jobs split across several threads of the blocking pool
    /// (`DigestExecution::Offload::threads`).
    pub digest_jobs_split: u64,
    /// Digest jobs run on the blocking pool, split or not (`DigestExecution::Offload`).
    pub digest_jobs_offloaded: u64,
    /// Source pages digested right after their writes completed
    /// ([`SenderTransport::digests_after_writes`], chunks of at least
    /// [`DIGEST_AFTER_WRITE_MIN_BYTES`]).
    pub pages_digested_after_write: u64,
}

/// Chunks of at least this many bytes are digested after their writes over a transport that
/// asks for it ([`SenderTransport::digests_after_writes`]: TCP, the source then in cache, or
/// same-host pull records); smaller ones right before their writes are posted. A digest after
/// the writes finishes only after the last write completed, so the COMMIT leaves in a write of
/// its own rather than with the last data record: for 4 KiB single-page transfers over TCP that cost 0.68x the
/// transfers/s, while the digest's read from memory that it saves is about 2 µs per 64 KiB
/// page (docs/BENCHMARKS.md, "The sender's digest after the kernel's copy").
pub const DIGEST_AFTER_WRITE_MIN_BYTES: u64 = 1 << 20;

/// The writes of one transfer not yet posted, and those posted and not yet done.
#[derive(Debug)]
struct Posting {
    transfer: TransferRef,
    access: Arc<[u8]>,
    pending: VecDeque<PageWrite>,
    /// The ordinals of the writes posted and not yet done, in the order they were posted.
    in_flight: VecDeque<u32>,
}

/// The prefill side of one connection: a [`SenderSession`] over a transport `T` and a pool of
/// source pages.
#[derive(Debug)]
pub struct SenderDriver<T> {
    core: Core<SenderSession, T>,
    admission: AdmissionPolicy,
    window: u32,
    sources: TransferIdMap<Vec<PageLease>>,
    postings: TransferIdMap<Posting>,
    /// The postings that may have writes pending (what [`SenderDriver::post`] visits, so
    /// its cost follows the transfers with writes left, not every open one).
    with_pending: BTreeSet<TransferId>,
    /// Scratch: postings found without pending writes during a pass.
    emptied: Vec<TransferId>,
    /// Scratch: the transfers with a stepped digest job during a pass.
    stepping: Vec<TransferRef>,
    batch: Vec<PageWrite>,
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
        let admission = admission_policy(&pool, engine);
        let mut session = SenderSession::new(established, config);
        if let Some(pages) = transport.destination_pages() {
            session.limit_destination_pages(pages);
        }
        if transport.moves_transfers() {
            session.allow_moves();
        }
        Ok(Self {
            core: Core::new(session, transport, pool),
            admission,
            window: window.max(1),
            sources: TransferIdMap::default(),
            postings: TransferIdMap::default(),
            with_pending: BTreeSet::new(),
            emptied: Vec::new(),
            stepping: Vec::new(),
            batch: Vec::new(),
            stats: SenderDriverStats::default(),
        })
    }

    driver_common!();

    /// Retires a request rejected at admission elsewhere (e.g. in the engine's thread, with
    /// the same [`admission_policy`]): a reservation for it gets REJECT carrying its error.
    /// Refused, changing nothing, while a transfer with the same id is open (SPEC §5.1).
    pub fn retire(&mut self, now: Instant, rejected: Rejected) -> Result<(), RetireError> {
        self.stats.rejected_at_admission += 1;
        let r = self.core.session.retire(rejected);
        self.process(now);
        r
    }

    /// Admits a request, or rejects it with its original error. A rejected request is
    /// retired at once: a reservation for it gets REJECT carrying that error, and nothing
    /// is allocated, written or sent for it otherwise.
    pub fn admit(&mut self, now: Instant, req: Request) -> Result<Admitted, AdmissionError> {
        let r = self.admission.admit(req).map_err(|rejected| {
            self.stats.rejected_at_admission += 1;
            let error = rejected.error.clone();
            // An id with an open transfer is not retired (SPEC §5.1): the open transfer goes
            // on, and the caller still gets the rejection.
            let _ = self.core.session.retire(rejected);
            error
        });
        self.process(now);
        r
    }

    /// Allocates the admitted request's source pages from kvwire's pool, lets
    /// `fill(ordinal, buffer, bytes)` write the KV data into them (a copy: the prefill
    /// computed it elsewhere), and submits the transfer. Engines whose KV already sits in
    /// the registered memory send it in place with [`SenderDriver::submit_pages`].
    pub fn submit(
        &mut self,
        now: Instant,
        admitted: Admitted,
        mut fill: impl FnMut(u32, usize, &mut [u8]),
    ) -> Result<(), StartError> {
        let holder = Holder::Sending(admitted.transfer_id());
        let leases = match self.core.pool.allocate_for(admitted.pages(), holder) {
            Ok(l) => l,
            Err(source) => return Err(StartError::OutOfPages { admitted, source }),
        };
        // Device buffers are filled through a host buffer (one per call, reused for every
        // page) and copied to the device: their pages are never written through a host
        // reference.
        let mut staging = Vec::new();
        for (ordinal, lease) in (0u32..).zip(&leases) {
            for b in 0..self.core.pool.buffers() {
                if let Ok(mut page) = self.core.pool.page_mut(lease, b) {
                    fill(ordinal, b, &mut page);
                } else if self
                    .core
                    .pool
                    .memory()
                    .device_page(lease.page(), b)
                    .is_some()
                {
                    staging.resize(self.core.pool.geometry().buffer_page_bytes[b] as usize, 0);
                    fill(ordinal, b, &mut staging);
                    if let Err(e) = self.core.pool.write_page(lease, b, &staging) {
                        tracing::error!(page = lease.page(), buffer = b, error = %e, "device page fill failed");
                    }
                }
            }
        }
        self.submit_leased(now, admitted, leases)
    }

    /// Submits the admitted request from `pages` of the registered memory, in place (no
    /// copy): the engine's own KV pages, one per page of the request, in transfer order.
    /// kvwire reads them until the transfer ends (its outcome is reported only after every
    /// write and digest that reads them drained); the engine must not write them meanwhile.
    /// Several transfers may read the same page at once.
    ///
    /// Fails with [`StartError::Pages`] (the request handed back) when a page is out of
    /// range, appears twice, or is held by a reservation.
    pub fn submit_pages(
        &mut self,
        now: Instant,
        admitted: Admitted,
        pages: &[u32],
    ) -> Result<(), StartError> {
        let holder = Holder::Sending(admitted.transfer_id());
        match self.core.pool.lease_for_reading(pages, holder) {
            Ok(leases) => self.submit_leased(now, admitted, leases),
            Err(source) => Err(StartError::Pages { admitted, source }),
        }
    }

    /// Opens an admitted request to be sent in chunks ([`SenderDriver::submit_chunk`]) as the
    /// prefill produces them; it waits for its reservation meanwhile.
    pub fn open(&mut self, now: Instant, admitted: Admitted) -> Result<(), StartError> {
        let id = admitted.transfer_id();
        self.core
            .session
            .open(now, admitted)
            .map_err(StartError::Session)?;
        self.sources.insert(id, Vec::new());
        self.process(now);
        Ok(())
    }

    /// The next chunk of an opened transfer: `pages` of the registered memory, in place, in
    /// transfer order after the chunks before it. The chunk that completes the request's
    /// pages is the final one; `aux` (the auxiliary record delivered with the transfer) goes
    /// only with it. Its writes are posted and its digests computed as soon as the
    /// reservation is known, while the prefill produces the next chunk.
    ///
    /// A refused chunk changes nothing: the transfer goes on (or the engine aborts it).
    pub fn submit_chunk(
        &mut self,
        now: Instant,
        transfer_id: TransferId,
        pages: &[u32],
        aux: Option<Vec<u8>>,
    ) -> Result<(), ChunkStartError> {
        if !self.sources.contains_key(&transfer_id) {
            return Err(ChunkStartError::Session(ChunkError::UnknownTransfer(
                transfer_id,
            )));
        }
        let leases = self
            .core
            .pool
            .lease_for_reading(pages, Holder::Sending(transfer_id))
            .map_err(ChunkStartError::Pages)?;
        match self
            .core
            .session
            .submit_chunk(now, transfer_id, pages.to_vec(), aux)
        {
            Ok(()) => {
                if let Some(s) = self.sources.get_mut(&transfer_id) {
                    s.extend(leases);
                }
                self.process(now);
                Ok(())
            }
            Err(e) => {
                for l in leases {
                    // Fresh read leases, unused: release cannot fail.
                    let _ = self.core.pool.release(l);
                }
                Err(ChunkStartError::Session(e))
            }
        }
    }

    fn submit_leased(
        &mut self,
        now: Instant,
        admitted: Admitted,
        leases: Vec<PageLease>,
    ) -> Result<(), StartError> {
        let id = admitted.transfer_id();
        let pages = leases.iter().map(PageLease::page).collect();
        match self.core.session.submit(now, admitted, pages) {
            Ok(()) => {
                self.sources.insert(id, leases);
                self.process(now);
                Ok(())
            }
            Err(e) => {
                for l in leases {
                    // Fresh leases of this pool, unused: release cannot fail.
                    let _ = self.core.pool.release(l);
                }
                Err(StartError::Session(e))
            }
        }
    }

    /// Aborts a transfer: stop posting, drain, then ABORT.
    pub fn abort(&mut self, now: Instant, transfer_id: TransferId, code: ErrorCode) -> bool {
        let r = self.core.session.abort(now, transfer_id, code);
        self.process(now);
        r
    }

    /// Handles one transport event.
    pub fn handle_event(&mut self, now: Instant, event: TransportEvent) {
        let Some(event) = self.core.handle_common(now, event) else {
            self.process(now);
            return;
        };
        match event {
            TransportEvent::WritesDone {
                transfer,
                pages,
                ok,
            } => {
                if let Some(p) = self.postings.get_mut(&transfer.transfer_id) {
                    if p.transfer == transfer {
                        let done = (pages as usize).min(p.in_flight.len());
                        p.in_flight.drain(..done);
                    }
                }
                let outcome = if ok {
                    self.stats.writes_completed += u64::from(pages);
                    WriteOutcome::Completed
                } else {
                    WriteOutcome::Failed
                };
                self.core
                    .session
                    .handle_write_outcome(now, transfer, outcome, pages);
            }
            _ => tracing::debug!("receiver-side transport event at a sender; ignored"),
        }
        self.process(now);
    }

    /// The next event for the engine: a transfer verified by the receiver, or failed.
    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.core.session.poll_event()
    }

    /// Carries out every queued session effect, posts what the windows allow, and moves
    /// frames to the transport, until nothing is left to do.
    fn process(&mut self, now: Instant) {
        loop {
            let mut moved = false;
            while let Some(action) = self.core.session.poll_action() {
                moved = true;
                self.act(now, action);
            }
            moved |= self.post(now);
            moved |= self.digest_sent(now);
            while let Some(frame) = self.core.session.poll_transmit() {
                moved = true;
                self.core.transport.send_frame(now, &frame);
            }
            moved |= self.core.flush_liveness(now);
            if !moved {
                return;
            }
        }
    }

    /// Posts pending writes, transfer by transfer, within each transfer's window and the
    /// transport's credit. Returns whether anything was posted.
    fn post(&mut self, now: Instant) -> bool {
        let mut credit = self.core.transport.write_credit();
        let mut posted = false;
        for id in &self.with_pending {
            if credit == 0 {
                break;
            }
            let Some(p) = self.postings.get_mut(id).filter(|p| !p.pending.is_empty()) else {
                self.emptied.push(*id);
                continue;
            };
            let room = (self.window.saturating_sub(p.in_flight.len() as u32) as usize).min(credit);
            if room == 0 {
                continue;
            }
            self.batch.clear();
            self.batch
                .extend(p.pending.drain(..room.min(p.pending.len())));
            let n = self.batch.len();
            p.in_flight.extend(self.batch.iter().map(|w| w.ordinal));
            credit -= n;
            self.stats.writes_posted += n as u64;
            self.core
                .transport
                .post_writes(now, p.transfer, &p.access, &self.batch);
            posted = true;
            if p.pending.is_empty() {
                self.emptied.push(*id);
            }
        }
        for id in self.emptied.drain(..) {
            self.with_pending.remove(&id);
        }
        posted
    }

    /// Digests while sending (off by default here, on in the engine API:
    /// `NodeConfig::digest_while_sending`): the digests of host-memory pages are computed
    /// page by page as the pages are handed to the transport, instead of over the whole
    /// chunk before its first write.
    pub fn set_digest_while_sending(&mut self, on: bool) {
        self.core.digests.while_sending = on;
    }

    /// Digests while sending: every stepped digest job covers its transfer's pages up to the
    /// first write still pending, right before the transport sends them; or, for a chunk of
    /// at least [`DIGEST_AFTER_WRITE_MIN_BYTES`] over a transport that asks for it
    /// ([`SenderTransport::digests_after_writes`]), up to the first write not yet done,
    /// right after the transport wrote them. A job with
    /// no write left (all done, or cancelled) is finished. Returns whether an outcome went to
    /// the session.
    fn digest_sent(&mut self, now: Instant) -> bool {
        self.stepping.clear();
        self.stepping.extend(self.core.digests.stepping());
        if self.stepping.is_empty() {
            return false;
        }
        let after_writes = self.core.transport.digests_after_writes();
        for &t in &self.stepping {
            let after_write =
                after_writes && self.core.digests.stepped_bytes(t) >= DIGEST_AFTER_WRITE_MIN_BYTES;
            let through = match self.postings.get(&t.transfer_id) {
                Some(p) if p.transfer == t => after_write
                    .then(|| p.in_flight.front().copied())
                    .flatten()
                    .or_else(|| p.pending.front().map(|w| w.ordinal))
                    .unwrap_or(u32::MAX),
                _ => u32::MAX,
            };
            let digested = self.core.digests.advance(t, through) as u64;
            if after_write {
                self.stats.pages_digested_after_write += digested;
            }
        }
        self.core.finish_ready_digests(now)
    }

    fn act(&mut self, now: Instant, action: SenderAction) {
        match action {
            SenderAction::ComputeDigests {
                transfer,
                algorithm,
                page_digests,
                first,
                pages,
                aux,
            } => {
                let Some(leases) = self.sources.get(&transfer.transfer_id) else {
                    return;
                };
                // The chunk's pages, pinned (never written or released) until its digest
                // job is done.
                let chunk = leases
                    .iter()
                    .skip(first as usize)
                    .take(pages as usize)
                    .map(PageLease::page)
                    .collect();
                self.core
                    .start_digests(now, transfer, algorithm, page_digests, first, chunk, aux);
            }
            SenderAction::PostWrites {
                transfer,
                writes,
                access,
            } => match self.postings.get_mut(&transfer.transfer_id) {
                // A later chunk of the transfer: queue behind the writes still pending.
                Some(p) if p.transfer == transfer => {
                    p.pending.extend(writes);
                    self.with_pending.insert(transfer.transfer_id);
                }
                _ => {
                    self.with_pending.insert(transfer.transfer_id);
                    self.postings.insert(
                        transfer.transfer_id,
                        Posting {
                            transfer,
                            access: access.into(),
                            pending: writes.into(),
                            in_flight: VecDeque::new(),
                        },
                    );
                }
            },
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
                    self.core.session.handle_write_outcome(
                        now,
                        transfer,
                        WriteOutcome::Cancelled,
                        n,
                    );
                }
            }
            SenderAction::ReleaseSource(id) => {
                self.postings.remove(&id);
                self.core.digests.forget(id);
                for lease in self.sources.remove(&id).unwrap_or_default() {
                    if let Err(e) = self.core.pool.release(lease) {
                        tracing::error!(transfer_id = id.0, error = %e, "source page release refused");
                    }
                }
            }
        }
    }

    /// Writes into every *free* source page (for example to initialise KV memory);
    /// `f(page, buffer, bytes)`. Pages leased to a transfer are not touched.
    pub fn fill_free_pages(&mut self, mut f: impl FnMut(u32, usize, &mut [u8])) {
        let mut staging = Vec::new();
        for p in 0..self.core.pool.capacity_pages() {
            if self.core.pool.state(p) != Some(PageState::Free) {
                continue;
            }
            for b in 0..self.core.pool.buffers() {
                if let Some(mut page) = self.core.pool.raw_page_mut(p, b) {
                    f(p, b, &mut page);
                } else if self.core.pool.memory().device_page(p, b).is_some() {
                    // Device memory: through a host buffer, copied to the device.
                    staging.resize(self.core.pool.geometry().buffer_page_bytes[b] as usize, 0);
                    f(p, b, &mut staging);
                    if let Err(e) = self.core.pool.engine_write(p, b, &staging) {
                        tracing::error!(page = p, buffer = b, error = %e, "device page fill failed");
                    }
                }
            }
        }
    }

    /// The source page pool.
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.core.pool
    }

    /// The protocol session.
    pub fn session(&self) -> &SenderSession {
        &self.core.session
    }

    /// Counters.
    pub fn stats(&self) -> SenderDriverStats {
        let mut s = self.stats;
        s.digest_jobs_split = self.core.digests.split_jobs;
        s.digest_jobs_offloaded = self.core.digests.offloaded_jobs;
        s
    }
}

impl_driver!(SenderDriver, SenderTransport);
