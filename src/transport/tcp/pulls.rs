//! Same-host pulls on several threads (SPEC §9.3; docs/SAME_HOST.md).
//!
//! A verified pull is the kernel's copy out of the prefill's memory and a digest of what
//! landed, both on one core: one connection's pulls on its own task run at the speed of that
//! core. With [`NodeConfig::pull_threads`](crate::NodeConfig::pull_threads) above one, the
//! stream's task still parses every record and checks every pull record's scope, and then
//! hands the copy (and its digests) to one of the node's **pull threads** (shared by its
//! connections).
//!
//! What the stream's task keeps, so the rules of the inline path hold:
//!
//! * **Order.** Everything a stream yields — landed pages, refused records, control frames —
//!   is reported in stream order: a frame read behind pull records waits for their copies
//!   ([`PullQueue`]). A COMMIT is never seen before the pages it covers landed.
//! * **The fence.** A pull is handed out only after its scope check, on the task that closes
//!   scopes; a fence of a transfer with copies still running completes once they did
//!   (`TableScoped::fence_pending`), so nothing lands in a page after its fence was reported.
//! * **Pages.** A connection that closes waits for its copies before it reports the close
//!   (after which the driver releases the pages), and so does a receiver dropped without one.
//! * **Batches and backpressure.** Consecutive pull records go to a thread together (up to
//!   [`BATCH_BYTES`] of pages, or whatever was parsed before the stream waits), and at most two
//!   batches per thread per stream are in flight; beyond that the stream is not read until
//!   one returned.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::task::Waker;

use kvwire_proto::wire::{DigestAlgorithm, TransferRef};

use super::records::{DataHeader, StreamStats};
use crate::checksum::Kind;
use crate::memory::PagePool;
use crate::transport::same_host::{PullError, Puller};
use crate::transport::{LandingDigests, TransportEvent};

/// While a record's page is digested as it lands, each read into the page asks for at most
/// this many bytes, so that a buffer's slot is still in the core's cache when the read that
/// completes it returns and the slot is digested (a read of several MiB would have pushed its
/// first bytes out before they are digested).
pub(super) const DIGEST_PIECE: usize = 256 * 1024;

/// Copies each of a page's `slots` from `sources` in the prefill's memory (SPEC §9.3), and
/// pushes each slot's digest onto `digests` under `kind`: a page of up to [`DIGEST_PIECE`]
/// bytes in one call, its slots digested after it (still in cache); a larger one slot by
/// slot, each digested right after its copy.
pub(crate) fn pull_row(
    puller: Puller,
    slots: &mut [&mut [u8]],
    sources: &[u64],
    kind: Option<Kind>,
    digests: &mut Vec<u64>,
) -> Result<(), PullError> {
    let len: usize = slots.iter().map(|s| s.len()).sum();
    if len <= DIGEST_PIECE {
        puller.pull_slots(slots, sources)?;
        if let Some(kind) = kind {
            digests.extend(slots.iter().map(|slot| kind.page_digest(slot)));
        }
        return Ok(());
    }
    slots.iter_mut().zip(sources).try_for_each(|(slot, &src)| {
        puller.pull(slot, src)?;
        if let Some(kind) = kind {
            digests.push(kind.page_digest(slot));
        }
        Ok(())
    })
}

/// What became of one pull.
#[derive(Debug)]
pub(crate) enum PullOutcome {
    /// Its page landed, with the digests taken right after each copy when asked for.
    Landed(Option<LandingDigests>),
    /// Someone else held the destination page: nothing was copied.
    Busy,
    /// The kernel refused or cut short the copy: the page is not covered.
    Failed(PullError),
}

impl PullOutcome {
    /// The copy of `header`'s page from `sources`, digested under `landing` when asked for.
    pub(crate) fn run(
        puller: Puller,
        pool: &PagePool,
        header: DataHeader,
        sources: &[u64],
        landing: Option<DigestAlgorithm>,
        digests: &mut Vec<u64>,
    ) -> Self {
        let Some(mut row) = pool.raw_row_mut(header.dst_page) else {
            return Self::Busy;
        };
        digests.clear();
        let kind = landing.and_then(|alg| crate::checksum::Kind::new(alg).ok());
        if let Err(e) = pull_row(puller, row.buffers_mut(), sources, kind, digests) {
            return Self::Failed(e);
        }
        Self::Landed(match (landing, kind) {
            (Some(algorithm), Some(_)) => Some(LandingDigests {
                algorithm,
                per_buffer: digests.as_slice().into(),
            }),
            _ => None,
        })
    }

    /// The event this outcome reports for `header` (`None`: the record is refused), counted
    /// in `stats` as the inline path counts it.
    pub(crate) fn report(
        self,
        header: DataHeader,
        stats: &mut StreamStats,
    ) -> Option<TransportEvent> {
        match self {
            Self::Landed(digests) => {
                stats.writes_landed += 1;
                stats.pulled += 1;
                stats.bytes_landed += u64::from(header.len);
                stats.digested_at_landing += u64::from(digests.is_some());
                Some(TransportEvent::Landed {
                    transfer: header.transfer,
                    ordinal: header.ordinal,
                    page: header.dst_page,
                    digests,
                })
            }
            Self::Busy => {
                tracing::warn!(
                    page = header.dst_page,
                    "destination page busy: pull record dropped"
                );
                stats.writes_refused += 1;
                None
            }
            Self::Failed(e) => {
                tracing::warn!(error = %e, transfer = header.transfer.transfer_id.0, ordinal = header.ordinal, "pull failed: the page is not covered");
                stats.pulls_failed += 1;
                stats.writes_refused += 1;
                None
            }
        }
    }
}

/// One pull record's copy.
struct Copy {
    seq: u64,
    header: DataHeader,
    sources: Vec<u64>,
    landing: Option<DigestAlgorithm>,
}

/// Copies handed to a pull thread at once: consecutive pull records of one stream, up to
/// [`BATCH_BYTES`] (one handoff and one wake-up for several small pages).
struct Job {
    copies: Vec<Copy>,
    puller: Puller,
    pool: Arc<PagePool>,
    returns: Arc<Returns>,
}

/// A batch is handed out once its pages hold this many bytes (or the stream has nothing more
/// parsed). Each batch costs a handoff, a thread's wake-up and the stream task's: in batches
/// of 256 KiB (one page of the bench's 64 KiB engine case, four buffers) verified pulls ran at
/// 0.50 of a memcpy (median of 3 rounds; 2-vCPU Intel Xeon KVM guest, 2026-12-07), in batches
/// of 1, 2 and 4 MiB at 0.60, 0.62 and 0.62 (BENCHMARKS-LOG, "Same-host pull batches").
const BATCH_BYTES: usize = 2 << 20;

/// Where a stream's pull threads put what they did, and how its task is woken.
#[derive(Default)]
struct Returns {
    state: Mutex<ReturnState>,
    /// Signalled on every return (a closing stream waits for its copies).
    returned: Condvar,
}

#[derive(Default)]
struct ReturnState {
    /// Each returned job's outcomes.
    done: Vec<Vec<(u64, PullOutcome)>>,
    waker: Option<Waker>,
}

impl Returns {
    fn lock(&self) -> std::sync::MutexGuard<'_, ReturnState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn put(&self, outcomes: Vec<(u64, PullOutcome)>) {
        let waker = {
            let mut s = self.lock();
            s.done.push(outcomes);
            s.waker.take()
        };
        self.returned.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl Job {
    fn run(self, digests: &mut Vec<u64>) {
        let outcomes = self
            .copies
            .into_iter()
            .map(|c| {
                let outcome = PullOutcome::run(
                    self.puller,
                    &self.pool,
                    c.header,
                    &c.sources,
                    c.landing,
                    digests,
                );
                (c.seq, outcome)
            })
            .collect();
        self.returns.put(outcomes);
    }
}

/// Pull threads, shared by the streams they copy for (kvwire: one set per node, shared by
/// its connections; [`TcpReceiver::with_pull_threads`](super::TcpReceiver::with_pull_threads)).
/// The threads end once every holder dropped its handle (and its jobs are done).
#[derive(Debug)]
pub struct PullThreads {
    jobs: Mutex<mpsc::Sender<Job>>,
    threads: usize,
}

impl PullThreads {
    /// The threads `NodeConfig::pull_threads` asks for: `0` half the cores this process may
    /// run on (the prefill it pulls from runs on the same host), at most 8. `None` where
    /// that is one (pulls then run on each connection's task) or the OS refused a thread
    /// (with one log line).
    pub fn configured(threads: usize) -> Option<Arc<Self>> {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).clamp(1, 8)),
            n => n,
        };
        if threads <= 1 {
            return None;
        }
        match Self::start(threads) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %e, threads, "pull threads not started; pulls run on each connection's task");
                None
            }
        }
    }

    /// `threads` threads (at least one), named `kvwire-pull`.
    ///
    /// # Errors
    ///
    /// The OS refused a thread.
    pub fn start(threads: usize) -> std::io::Result<Arc<Self>> {
        let threads = threads.max(1);
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..threads {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name("kvwire-pull".into())
                .spawn(move || {
                    let mut digests = Vec::new();
                    loop {
                        let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
                        let Ok(job) = job else { return };
                        job.run(&mut digests);
                    }
                })?;
        }
        Ok(Arc::new(Self {
            jobs: Mutex::new(tx),
            threads,
        }))
    }
}

/// What a stream yielded, held in stream order behind the copies before it.
#[derive(Debug)]
enum Held {
    /// A pull handed to the threads; `done` once it returned.
    Pull {
        seq: u64,
        header: DataHeader,
        done: Option<PullOutcome>,
    },
    /// An event read behind a pull still copying.
    Event(TransportEvent),
}

/// Whether a copy into one of `transfer`'s pages is held (running, or done and not yet
/// reported).
fn holds_copy_of(held: &VecDeque<Held>, transfer: TransferRef) -> bool {
    held.iter().any(|h| {
        matches!(h, Held::Pull { header, .. } if header.transfer.transfer_id == transfer.transfer_id)
    })
}

/// One stream's pulls in flight and what waits behind them.
pub(crate) struct PullQueue {
    threads: Arc<PullThreads>,
    puller: Puller,
    pool: Arc<PagePool>,
    returns: Arc<Returns>,
    held: VecDeque<Held>,
    next_seq: u64,
    /// Copies parsed and not yet handed out, and their bytes.
    batch: Vec<Copy>,
    batch_bytes: usize,
    /// Jobs handed out and not yet returned.
    in_flight: usize,
    /// Fences waiting for copies of their transfer.
    fences: Vec<TransferRef>,
}

impl std::fmt::Debug for PullQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullQueue")
            .field("threads", &self.threads.threads)
            .field("held", &self.held.len())
            .field("batch", &self.batch.len())
            .field("in_flight", &self.in_flight)
            .field("fences", &self.fences)
            .finish()
    }
}

impl PullQueue {
    /// A stream's queue over the connection's `threads`, copying from `puller` into `pool`.
    pub(crate) fn new(threads: Arc<PullThreads>, puller: Puller, pool: Arc<PagePool>) -> Self {
        Self {
            threads,
            puller,
            pool,
            returns: Arc::default(),
            held: VecDeque::new(),
            next_seq: 0,
            batch: Vec::new(),
            batch_bytes: 0,
            in_flight: 0,
            fences: Vec::new(),
        }
    }

    /// Whether the stream must wait for a job to return before it reads on: two jobs per
    /// thread in flight keep every thread busy while the task parses the next records.
    pub(crate) fn full(&self) -> bool {
        self.in_flight >= 2 * self.threads.threads
    }

    /// Queues the copy of `header`'s page from `sources` (digested under `landing`), handed
    /// to a thread with the copies parsed after it once they hold [`BATCH_BYTES`] or
    /// [`PullQueue::flush`] is called.
    pub(crate) fn submit(
        &mut self,
        header: DataHeader,
        sources: Vec<u64>,
        landing: Option<DigestAlgorithm>,
    ) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.batch.push(Copy {
            seq,
            header,
            sources,
            landing,
        });
        self.batch_bytes += header.len as usize;
        self.held.push_back(Held::Pull {
            seq,
            header,
            done: None,
        });
        if self.batch_bytes >= BATCH_BYTES {
            self.flush();
        }
    }

    /// Hands the copies queued so far to a thread (the stream is about to wait). Where the
    /// threads are gone (they cannot be, while this queue holds them) they run here.
    pub(crate) fn flush(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        self.batch_bytes = 0;
        let job = Job {
            copies: std::mem::take(&mut self.batch),
            puller: self.puller,
            pool: self.pool.clone(),
            returns: self.returns.clone(),
        };
        let sent = self
            .threads
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(job);
        self.in_flight += 1;
        if let Err(mpsc::SendError(job)) = sent {
            job.run(&mut Vec::new());
        }
    }

    /// Holds `event` behind the copies before it; `Some(event)` back when none is held.
    pub(crate) fn hold(&mut self, event: TransportEvent) -> Option<TransportEvent> {
        if self.held.is_empty() {
            return Some(event);
        }
        self.held.push_back(Held::Event(event));
        None
    }

    /// Takes what the threads returned (registering `waker` for the next return), then moves
    /// everything at the front whose copy is done to `events`, in order, counted in `stats`,
    /// and then the fences no copy holds back any more.
    pub(crate) fn poll(
        &mut self,
        waker: &Waker,
        events: &mut VecDeque<TransportEvent>,
        stats: &mut StreamStats,
    ) {
        let done = {
            let mut s = self.returns.lock();
            if !s.waker.as_ref().is_some_and(|old| old.will_wake(waker)) {
                s.waker = Some(waker.clone());
            }
            std::mem::take(&mut s.done)
        };
        self.place(done);
        self.deliver(events, stats);
    }

    fn place(&mut self, done: Vec<Vec<(u64, PullOutcome)>>) {
        for job in done {
            self.in_flight -= 1;
            for (seq, outcome) in job {
                if let Some(Held::Pull { done, .. }) = self
                    .held
                    .iter_mut()
                    .find(|h| matches!(h, Held::Pull { seq: s, .. } if *s == seq))
                {
                    *done = Some(outcome);
                }
            }
        }
    }

    fn deliver(&mut self, events: &mut VecDeque<TransportEvent>, stats: &mut StreamStats) {
        while let Some(front) = self.held.front_mut() {
            match front {
                Held::Pull { done: None, .. } => break,
                Held::Pull { header, done, .. } => {
                    let (header, outcome) = (*header, done.take());
                    self.held.pop_front();
                    if matches!(outcome, Some(PullOutcome::Landed(_))) {
                        stats.pulled_on_threads += 1;
                    }
                    if let Some(e) = outcome.and_then(|o| o.report(header, stats)) {
                        events.push_back(e);
                    }
                }
                Held::Event(_) => {
                    if let Some(Held::Event(e)) = self.held.pop_front() {
                        events.push_back(e);
                    }
                }
            }
        }
        let held = &self.held;
        self.fences.retain(|t| {
            let waits = holds_copy_of(held, *t);
            if !waits {
                events.push_back(TransportEvent::Fenced(*t));
            }
            waits
        });
    }

    /// The fence of `transfer`: `true` (reported later as [`TransportEvent::Fenced`]) while a
    /// copy into one of its pages runs or waits to be reported.
    pub(crate) fn fence_pending(&mut self, transfer: TransferRef) -> bool {
        let waits = holds_copy_of(&self.held, transfer);
        if waits {
            self.fences.push(transfer);
        }
        waits
    }

    /// Waits (blocking this thread: each copy is one page) until every copy handed out
    /// returned, then reports everything held, in order, and the fences.
    pub(crate) fn finish(
        &mut self,
        events: &mut VecDeque<TransportEvent>,
        stats: &mut StreamStats,
    ) {
        self.wait_all();
        self.deliver(events, stats);
    }

    /// Hands out what is queued and waits until every copy returned.
    fn wait_all(&mut self) {
        self.flush();
        while self.in_flight > 0 {
            let done = {
                let mut s = self.returns.lock();
                while s.done.is_empty() {
                    s = self
                        .returns
                        .returned
                        .wait(s)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                std::mem::take(&mut s.done)
            };
            self.place(done);
        }
    }
}

impl Drop for PullQueue {
    /// A stream dropped with copies in flight waits for them: its pages are released after.
    fn drop(&mut self) {
        self.wait_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{AccessKey, PoolGeometry, Scrub};
    use kvwire_proto::wire::{Frame, TransferId};

    /// Eight pages of one 8-byte buffer.
    fn pool() -> Arc<PagePool> {
        let geometry = PoolGeometry {
            tokens_per_page: 1,
            buffer_page_bytes: vec![8],
            pages: 8,
        };
        Arc::new(PagePool::new(geometry, Scrub::None).unwrap())
    }

    fn header(transfer: u64, ordinal: u32, page: u32) -> DataHeader {
        DataHeader {
            transfer: TransferRef {
                transfer_id: TransferId(transfer),
                nonce: 1,
            },
            key: AccessKey(1),
            ordinal,
            dst_page: page,
            len: 8,
        }
    }

    /// What a stream yields behind pulls on threads comes out in stream order (a frame after
    /// the pages before it), a fence of a transfer with a copy held waits for it and is
    /// reported after its landing, and a fence of another transfer does not wait; the bytes
    /// are the source's and were copied on a pull thread.
    #[test]
    fn frames_and_fences_wait_for_the_copies_before_them() {
        let pool = pool();
        let sources = [b"pulled-a".to_vec(), b"pulled-b".to_vec()];
        let puller = Puller::new(std::process::id());
        let mut q = PullQueue::new(PullThreads::start(2).unwrap(), puller, pool.clone());
        let (a, b) = (header(7, 0, 3), header(7, 1, 4));
        // Two jobs: one handed out before the frame, one left to `finish`.
        q.submit(a, vec![sources[0].as_ptr() as u64], None);
        q.flush();
        assert!(q.hold(TransportEvent::Frame(Frame::Ping(1))).is_none());
        q.submit(
            b,
            vec![sources[1].as_ptr() as u64],
            Some(DigestAlgorithm::XXH3_64),
        );
        assert!(q.hold(TransportEvent::Frame(Frame::Ping(2))).is_none());
        assert!(q.fence_pending(a.transfer), "copies of transfer 7 are held");
        assert!(!q.fence_pending(header(8, 0, 5).transfer));
        let (mut events, mut stats) = (VecDeque::new(), StreamStats::default());
        q.finish(&mut events, &mut stats);
        let shown: Vec<String> = events
            .iter()
            .map(|e| match e {
                TransportEvent::Landed { page, digests, .. } => {
                    format!("landed {page} {}", digests.is_some())
                }
                TransportEvent::Frame(Frame::Ping(t)) => format!("ping {t}"),
                TransportEvent::Fenced(t) => format!("fenced {}", t.transfer_id.0),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(
            shown,
            [
                "landed 3 false",
                "ping 1",
                "landed 4 true",
                "ping 2",
                "fenced 7"
            ]
        );
        assert_eq!(pool.raw_page(3, 0).unwrap().to_vec(), sources[0]);
        assert_eq!(pool.raw_page(4, 0).unwrap().to_vec(), sources[1]);
        assert_eq!((stats.pulled, stats.pulled_on_threads), (2, 2));
        // Once nothing is held, an event passes straight through and no fence waits.
        assert!(q.hold(TransportEvent::Frame(Frame::Ping(3))).is_some());
        assert!(!q.fence_pending(a.transfer));
    }

    /// A copy that fails or finds its page held is reported as a refused record (nothing
    /// covered), in its place, and the stream goes on.
    #[test]
    fn a_failed_copy_covers_nothing() {
        let pool = pool();
        let source = b"pulled-c".to_vec();
        let puller = Puller::new(std::process::id());
        let mut q = PullQueue::new(PullThreads::start(1).unwrap(), puller, pool.clone());
        // An address this process does not map, then a page someone else holds.
        q.submit(header(7, 0, 3), vec![8], None);
        q.submit(header(7, 1, 4), vec![source.as_ptr() as u64], None);
        assert!(q.hold(TransportEvent::Frame(Frame::Ping(1))).is_none());
        let held = pool.raw_row_mut(4).unwrap();
        let (mut events, mut stats) = (VecDeque::new(), StreamStats::default());
        q.finish(&mut events, &mut stats);
        drop(held);
        assert!(matches!(
            events.iter().collect::<Vec<_>>().as_slice(),
            [TransportEvent::Frame(Frame::Ping(1))]
        ));
        assert_eq!(
            (stats.pulls_failed, stats.writes_refused, stats.pulled),
            (1, 2, 0)
        );
        assert_ne!(pool.raw_page(4, 0).unwrap().to_vec(), source);
    }
}
