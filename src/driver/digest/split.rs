//! One digest job split across several threads of tokio's blocking pool: each part takes the
//! page digests of a run of consecutive pages, and the part that finishes last folds them into
//! the transfer's digests in ordinal order (SPEC §6: the buffer digests are a function of the
//! page digests alone), so the result equals the job run on one thread.
//!
//! The job's view pins its pages until the job is dropped. Every part drops its handle on the
//! job before it counts itself done, so the last part holds the only one left: it folds, drops
//! the job (the pin with it) and only then reports the result.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::checksum::{
    DigestJob, DigestJobError, DigestProgress, PageDigestPart, TransferDigester,
};

type PartResult = Result<PageDigestPart, DigestJobError>;

/// What the parts of one job share.
struct Shared {
    /// The job, until the last part takes it to fold.
    job: Mutex<Option<Arc<DigestJob>>>,
    /// The transfer's digests so far, which the fold continues.
    state: Mutex<Option<TransferDigester>>,
    /// Each part's result, in ordinal order.
    parts: Mutex<Vec<Option<PartResult>>>,
    /// Parts not finished yet.
    left: AtomicUsize,
}

/// Runs `job` (host memory, [`DigestJob::splits_on_host`]) in `parts` parts on the blocking
/// pool, continuing `state`; `report` gets the result once the job is dropped.
pub(super) fn spawn(
    job: DigestJob,
    state: Option<TransferDigester>,
    parts: usize,
    report: impl FnOnce(Result<DigestProgress, DigestJobError>) + Send + 'static,
) {
    let n = job.page_count();
    let parts = parts.clamp(1, n.max(1));
    let job = Arc::new(job);
    // Every part's handle, made before any part runs, so `spawn` keeps none past its loop.
    let mut handles: Vec<Arc<DigestJob>> = (0..parts).map(|_| job.clone()).collect();
    let shared = Arc::new(Shared {
        job: Mutex::new(Some(job)),
        state: Mutex::new(state),
        parts: Mutex::new((0..parts).map(|_| None).collect()),
        left: AtomicUsize::new(parts),
    });
    let report = Arc::new(Mutex::new(Some(report)));
    for k in 0..parts {
        // Part k covers positions [k*n/parts, (k+1)*n/parts): consecutive, together the chunk.
        let (from, to) = (k * n / parts, (k + 1) * n / parts);
        let Some(job) = handles.pop() else { break };
        let (shared, report) = (shared.clone(), report.clone());
        tokio::task::spawn_blocking(move || {
            let part = super::guarded(|| job.page_digests_of(from, to));
            drop(job);
            lock(&shared.parts)[k] = Some(part);
            // AcqRel: the last part sees every other part's result and dropped handle.
            if shared.left.fetch_sub(1, Ordering::AcqRel) != 1 {
                return;
            }
            let result = fold(&shared);
            if let Some(report) = lock(&report).take() {
                report(result);
            }
        });
    }
}

/// The last part: folds every part's page digests into the transfer's digests, then drops the
/// job (and its pin on the pages) before returning the result.
fn fold(shared: &Shared) -> Result<DigestProgress, DigestJobError> {
    let job = lock(&shared.job).take();
    let state = lock(&shared.state).take();
    let parts: Result<Vec<PageDigestPart>, DigestJobError> =
        lock(&shared.parts).drain(..).flatten().collect();
    let Some(job) = job else {
        // Only the last part folds, once; never reached.
        return Err(DigestJobError::PartsMismatch {
            covered: "none (the job was folded already)".into(),
            pages: 0,
        });
    };
    let result = parts.and_then(|parts| super::guarded(|| job.run_from_parts(state, &parts)));
    // Every other handle was dropped before its part counted itself done.
    match Arc::try_unwrap(job) {
        Ok(job) => drop(job),
        Err(still_shared) => {
            tracing::error!("a split digest job is still shared after its last part");
            drop(still_shared);
        }
    }
    result
}

/// A poisoned lock only means a part panicked; what it guards stays consistent (each slot is
/// written once).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
