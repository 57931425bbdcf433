//! Where a driver computes digests: inline, or on tokio's blocking pool for large jobs (so the
//! connection keeps moving other transfers meanwhile). Both roles use it the same way: start a
//! job over a pinned view of the pages, get the result now or later.
//!
//! A transfer sent in chunks has one job per chunk; its digests stream across them. Each
//! transfer's streaming state ([`TransferDigester`]) stays here between its jobs, which run
//! one at a time and in the order they were started (a job started while an earlier one of
//! the same transfer is still on the pool waits for it), so no page is read twice.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::task::{Context, Poll};

use kvwire_proto::wire::{DigestAlgorithm, TransferDigests, TransferId, TransferRef};
use tokio::sync::mpsc;

use crate::checksum::{DigestJob, DigestJobError, DigestMode, DigestProgress, TransferDigester};
use crate::memory::{PoolError, SharedPages};

/// Runs `f`, a digest job's work, turning a panic into [`DigestJobError::Panicked`]: the job
/// (and its pin on the pages) is dropped by the unwinding, and the transfer gets an outcome
/// instead of waiting forever for one.
pub(super) fn guarded<T>(
    f: impl FnOnce() -> Result<T, DigestJobError>,
) -> Result<T, DigestJobError> {
    // AssertUnwindSafe: on a panic nothing `f` touched is used again; its job and digest
    // state are dropped, and the outcome says the job failed.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        Err(DigestJobError::Panicked(message))
    })
}

/// How a digest job ended, for the session.
#[derive(Debug)]
pub(crate) enum JobOutcome {
    /// A non-final chunk was digested (the session's `handle_chunk_digested`).
    ChunkDigested,
    /// The final chunk was digested: the transfer's digests (`handle_digests`).
    Digests(TransferDigests),
    /// No digest could be made (no view of the pages, an unsupported algorithm, a job out of
    /// order); the job no longer reads the pages.
    Failed {
        /// Whether it was the transfer's final chunk.
        final_chunk: bool,
    },
}

/// A finished digest job: the transfer and how it ended.
pub(crate) type DigestDone = (TransferRef, JobOutcome);

/// A job that ran on the blocking pool: the transfer, whether it was the final chunk, and
/// what it left.
type PoolDone = (TransferRef, bool, Result<DigestProgress, DigestJobError>);

/// Where digest jobs run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DigestExecution {
    /// At once, in the driver (deterministic; what the in-process `Pair` harness uses).
    Inline,
    /// Jobs of at least this many bytes on tokio's blocking pool, smaller ones inline (a
    /// thread handoff costs more than it saves for small transfers; docs/BENCHMARKS.md).
    /// Inline outside a tokio runtime.
    ///
    /// A job on the pool is split into up to `threads` parts of consecutive pages, each at
    /// least [`MIN_PART_BYTES`], whose page digests are taken on that many pool threads at
    /// once and folded in ordinal order by the last part to finish (the buffer digests are a
    /// function of the page digests alone, SPEC §6): the same digests, sooner, where cores
    /// are idle. `threads: 1` keeps every job on one thread.
    Offload {
        /// The threshold in bytes.
        min_bytes: u64,
        /// Pool threads one job may use at once (at least 1).
        threads: usize,
    },
}

/// The smallest part of a job split across pool threads ([`DigestExecution::Offload`]): below
/// this a thread handoff costs more than the part's digests.
pub const MIN_PART_BYTES: u64 = 1 << 20;

/// Pool threads one digest job may use by default: the cores this process may run on, at
/// most 8 (`NodeConfig::digest_threads` = 0).
pub fn default_digest_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// One transfer's digests between its jobs.
#[derive(Debug, Default)]
struct Stream {
    /// The digests so far (`None` before the first job, and while a job runs on the pool).
    state: Option<TransferDigester>,
    /// A job of this transfer runs on the pool.
    running: bool,
    /// A job digested step by step as its pages are sent ([`Digests::advance`]).
    stepped: Option<Stepped>,
    /// Jobs waiting for the one running, in order.
    queue: VecDeque<DigestJob>,
}

/// A job digested step by step: the digests so far cover its first `done` pages.
#[derive(Debug)]
struct Stepped {
    job: DigestJob,
    state: TransferDigester,
    done: usize,
}

/// One driver's digest jobs.
#[derive(Debug)]
pub(crate) struct Digests {
    pub(crate) mode: DigestMode,
    pub(crate) execution: DigestExecution,
    /// Host-memory jobs that would run inline are not run at once but digested step by step,
    /// page by page as the driver hands the pages to the transport ([`Digests::advance`]):
    /// each page is read right before the transport sends it, and the first bytes leave
    /// before the last page is digested (the sender's digests while sending; SPEC §6). Jobs
    /// large enough for the blocking pool still go there.
    pub(crate) while_sending: bool,
    /// Parts of a split job are at least this long ([`MIN_PART_BYTES`]; smaller in tests).
    pub(crate) min_part_bytes: u64,
    /// Jobs split across pool threads so far.
    pub(crate) split_jobs: u64,
    /// Jobs run on the blocking pool so far (split or not).
    pub(crate) offloaded_jobs: u64,
    streams: BTreeMap<TransferRef, Stream>,
    /// The transfers with a stepped job.
    stepping: BTreeSet<TransferRef>,
    ready: VecDeque<DigestDone>,
    done_tx: mpsc::UnboundedSender<PoolDone>,
    done_rx: mpsc::UnboundedReceiver<PoolDone>,
}

impl Digests {
    pub(crate) fn new(mode: DigestMode, execution: DigestExecution) -> Self {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        Self {
            mode,
            execution,
            while_sending: false,
            min_part_bytes: MIN_PART_BYTES,
            split_jobs: 0,
            offloaded_jobs: 0,
            streams: BTreeMap::new(),
            stepping: BTreeSet::new(),
            ready: VecDeque::new(),
            done_tx,
            done_rx,
        }
    }

    /// Starts the digest job of one chunk of `transfer` over `view` (the chunk's pages in
    /// ordinal order from `first`, pinned); `aux` is `Some` on the final chunk. The result
    /// comes from [`Digests::take_ready`] at once when the job ran inline, else later, once
    /// [`Digests::poll_done`] saw it. The job, and with it the pin on the pages, is dropped
    /// before its result is reported.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        &mut self,
        transfer: TransferRef,
        algorithm: DigestAlgorithm,
        page_digests: bool,
        first: u32,
        view: Result<SharedPages, PoolError>,
        aux: Option<Vec<u8>>,
    ) {
        let final_chunk = aux.is_some();
        let Ok(view) = view else {
            self.ready
                .push_back((transfer, JobOutcome::Failed { final_chunk }));
            if final_chunk {
                self.streams.remove(&transfer);
            }
            return;
        };
        let job = DigestJob::new(
            transfer,
            algorithm,
            page_digests,
            self.mode,
            first,
            view,
            aux,
        );
        self.streams
            .entry(transfer)
            .or_default()
            .queue
            .push_back(job);
        self.pump(transfer);
    }

    /// Runs `transfer`'s queued jobs in order: inline ones at once, until one goes to the
    /// blocking pool (the rest wait for it).
    fn pump(&mut self, transfer: TransferRef) {
        loop {
            let Some(stream) = self.streams.get_mut(&transfer) else {
                return;
            };
            if stream.running || stream.stepped.is_some() {
                return;
            }
            let Some(job) = stream.queue.pop_front() else {
                return;
            };
            let state = stream.state.take();
            let (offload, threads) = match self.execution {
                DigestExecution::Inline => (false, 1),
                DigestExecution::Offload { min_bytes, threads } => (
                    job.bytes() >= min_bytes && tokio::runtime::Handle::try_current().is_ok(),
                    threads,
                ),
            };
            // A job that would run inline is stepped instead (the same thread reads each page
            // right before the transport sends it); one large enough for the blocking pool
            // still goes there, where it runs beside the sending on another core.
            if self.while_sending && !offload && job.steps_on_host() {
                match job.begin(state) {
                    Ok(state) => {
                        stream.stepped = Some(Stepped {
                            job,
                            state,
                            done: 0,
                        });
                        self.stepping.insert(transfer);
                        // Pages are digested as they are sent; a chunk of none is done now.
                        self.advance(transfer, 0);
                    }
                    Err(e) => {
                        let final_chunk = job.is_final();
                        drop(job);
                        self.complete(transfer, final_chunk, Err(e));
                        continue;
                    }
                }
                return;
            }
            let final_chunk = job.is_final();
            if !offload {
                let result = guarded(|| job.run(state));
                drop(job);
                self.complete(transfer, final_chunk, result);
                continue;
            }
            stream.running = true;
            self.offloaded_jobs += 1;
            let done = self.done_tx.clone();
            let parts = self.parts(&job, threads);
            if parts > 1 {
                self.split_jobs += 1;
                split::spawn(job, state, parts, move |result| {
                    let _ = done.send((transfer, final_chunk, result));
                });
                return;
            }
            tokio::task::spawn_blocking(move || {
                let result = guarded(|| job.run(state));
                drop(job);
                let _ = done.send((transfer, final_chunk, result));
            });
            return;
        }
    }

    /// How many parts `job` is split into on the pool: at most `threads`, each of at least
    /// `min_part_bytes` and one page.
    fn parts(&self, job: &DigestJob, threads: usize) -> usize {
        if !job.splits_on_host() {
            return 1;
        }
        let by_bytes = job.bytes() / self.min_part_bytes.max(1);
        threads
            .min(usize::try_from(by_bytes).unwrap_or(usize::MAX))
            .min(job.page_count())
            .max(1)
    }

    /// The bytes of `transfer`'s stepped job (its chunk's pages), 0 when it has none.
    pub(crate) fn stepped_bytes(&self, transfer: TransferRef) -> u64 {
        self.streams
            .get(&transfer)
            .and_then(|s| s.stepped.as_ref())
            .map_or(0, |s| s.job.bytes())
    }

    /// The transfers whose stepped job waits for more of its pages to be sent.
    pub(crate) fn stepping(&self) -> impl Iterator<Item = TransferRef> + '_ {
        self.stepping.iter().copied()
    }

    /// Digests the pages of `transfer`'s stepped job before ordinal `through` (the first
    /// page not handed to the transport yet, or not yet written; `u32::MAX` once none is left
    /// to send, the writes done or cancelled), and finishes the job once it covers its chunk.
    /// Returns how many pages this call digested.
    pub(crate) fn advance(&mut self, transfer: TransferRef, through: u32) -> usize {
        let Some(stream) = self.streams.get_mut(&transfer) else {
            self.stepping.remove(&transfer);
            return 0;
        };
        let Some(s) = stream.stepped.as_mut() else {
            self.stepping.remove(&transfer);
            return 0;
        };
        let n = s.job.page_count();
        let mut stepped = 0;
        let to = (through.saturating_sub(s.job.first) as usize).min(n);
        if to > s.done {
            let (job, state, done) = (&s.job, &mut s.state, s.done);
            if let Err(e) = guarded(|| {
                job.step(state, done, to);
                Ok(())
            }) {
                // The stepped job ends here: its state is not continued.
                let final_chunk = s.job.is_final();
                stream.stepped = None;
                self.stepping.remove(&transfer);
                self.complete(transfer, final_chunk, Err(e));
                self.pump(transfer);
                return 0;
            }
            stepped = to - s.done;
            s.done = to;
        }
        if s.done < n {
            return stepped;
        }
        let Some(Stepped { job, state, .. }) = stream.stepped.take() else {
            return stepped;
        };
        self.stepping.remove(&transfer);
        let final_chunk = job.is_final();
        let result = Ok(job.end(state));
        // The job, and with it the pin on the pages, is dropped before its result is
        // reported.
        drop(job);
        self.complete(transfer, final_chunk, result);
        self.pump(transfer);
        stepped
    }

    /// Records a job's result: keeps the streaming state for the transfer's next chunk, or
    /// drops it after the final one; queues the outcome for the session.
    fn complete(
        &mut self,
        transfer: TransferRef,
        final_chunk: bool,
        result: Result<DigestProgress, DigestJobError>,
    ) {
        let outcome = match result {
            Ok(DigestProgress::Partial(state)) => {
                if let Some(stream) = self.streams.get_mut(&transfer) {
                    stream.state = Some(state);
                }
                JobOutcome::ChunkDigested
            }
            Ok(DigestProgress::Done(digests)) => JobOutcome::Digests(digests),
            Err(e) => {
                tracing::warn!(transfer_id = transfer.transfer_id.0, error = %e, "digest job failed");
                JobOutcome::Failed { final_chunk }
            }
        };
        if final_chunk {
            if let Some(stream) = self.streams.get(&transfer) {
                if stream.queue.is_empty() && !stream.running && stream.stepped.is_none() {
                    self.streams.remove(&transfer);
                }
            }
        }
        self.ready.push_back((transfer, outcome));
    }

    /// The next finished job whose outcome the session has not had yet.
    pub(crate) fn take_ready(&mut self) -> Option<DigestDone> {
        self.ready.pop_front()
    }

    /// Takes the jobs finished on the blocking pool (starting each transfer's next queued
    /// job); `Ready` when an outcome is waiting in [`Digests::take_ready`].
    pub(crate) fn poll_done(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        // The driver holds a sender, so the channel never closes.
        while let Poll::Ready(Some((transfer, final_chunk, result))) = self.done_rx.poll_recv(cx) {
            if let Some(stream) = self.streams.get_mut(&transfer) {
                stream.running = false;
            }
            self.complete(transfer, final_chunk, result);
            self.pump(transfer);
        }
        if self.ready.is_empty() {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    }

    /// Drops the streaming state of every reservation of `transfer_id` with no job left (a
    /// transfer abandoned between chunks never has a final job).
    pub(crate) fn forget(&mut self, transfer_id: TransferId) {
        self.streams
            .retain(|t, s| t.transfer_id != transfer_id || s.running || !s.queue.is_empty());
        let streams = &self.streams;
        self.stepping
            .retain(|t| t.transfer_id != transfer_id || streams.contains_key(t));
    }

    /// Transfers with digest state held here (for tests).
    #[cfg(test)]
    fn streams(&self) -> usize {
        self.streams.len()
    }
}

mod split;
#[cfg(test)]
mod tests;
