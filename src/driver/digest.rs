//! Where a driver computes digests: inline, or on tokio's blocking pool for large transfers
//! (so the connection keeps moving other transfers meanwhile). Both roles use it the same
//! way: start a job over a pinned view of the pages, get the result now or later.

use std::task::{Context, Poll};

use kvwire_proto::wire::{DigestAlgorithm, TransferDigests, TransferRef};
use tokio::sync::mpsc;

use crate::checksum::{DigestJob, DigestMode, UnsupportedAlgorithm};
use crate::memory::{PoolError, SharedPages};

/// A finished digest job: the transfer and its digests.
pub(crate) type DigestDone = (TransferRef, Result<TransferDigests, UnsupportedAlgorithm>);

/// Where digest jobs run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DigestExecution {
    /// At once, in the driver (deterministic; what the in-process `Pair` harness uses).
    Inline,
    /// Jobs of at least this many bytes on tokio's blocking pool, smaller ones inline (a
    /// thread handoff costs more than it saves for small transfers; docs/BENCHMARKS.md).
    /// Inline outside a tokio runtime.
    Offload {
        /// The threshold in bytes.
        min_bytes: u64,
    },
}

/// One driver's digest jobs.
#[derive(Debug)]
pub(crate) struct Digests {
    pub(crate) mode: DigestMode,
    pub(crate) execution: DigestExecution,
    done_tx: mpsc::UnboundedSender<DigestDone>,
    done_rx: mpsc::UnboundedReceiver<DigestDone>,
}

impl Digests {
    pub(crate) fn new(mode: DigestMode, execution: DigestExecution) -> Self {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        Self {
            mode,
            execution,
            done_tx,
            done_rx,
        }
    }

    /// Starts the digests of `transfer` over `view` (its pages in transfer order, pinned):
    /// the result now, or `None` when the job went to the blocking pool (it then comes from
    /// [`Digests::poll_done`]). `Err(())`: no digest can be made (no view, or an unsupported
    /// algorithm). The job, and with it the pin on the pages, is dropped before the result
    /// is reported either way.
    pub(crate) fn start(
        &mut self,
        transfer: TransferRef,
        algorithm: DigestAlgorithm,
        page_digests: bool,
        view: Result<SharedPages, PoolError>,
    ) -> Option<Result<TransferDigests, ()>> {
        let Ok(view) = view else { return Some(Err(())) };
        let job = DigestJob::new(transfer, algorithm, page_digests, self.mode, view);
        let offload = match self.execution {
            DigestExecution::Inline => false,
            DigestExecution::Offload { min_bytes } => {
                job.bytes() >= min_bytes && tokio::runtime::Handle::try_current().is_ok()
            }
        };
        if !offload {
            let result = job.run().map_err(|_| ());
            drop(job);
            return Some(result);
        }
        let done = self.done_tx.clone();
        tokio::task::spawn_blocking(move || {
            let result = job.run();
            drop(job);
            let _ = done.send((transfer, result));
        });
        None
    }

    /// The next job finished on the blocking pool.
    pub(crate) fn poll_done(&mut self, cx: &mut Context<'_>) -> Poll<DigestDone> {
        match self.done_rx.poll_recv(cx) {
            Poll::Ready(Some(d)) => Poll::Ready(d),
            // The driver holds a sender, so the channel never closes.
            Poll::Ready(None) | Poll::Pending => Poll::Pending,
        }
    }
}
