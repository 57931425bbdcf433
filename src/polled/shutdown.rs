//! Stopping a manager for good: [`Manager::shutdown`] returns once nothing of kvwire touches
//! the registered memory, so the engine may free it.

use std::time::Duration;

use super::{Error, ErrorKind, Manager};

impl Manager {
    /// Whether [`Manager::shutdown`] was called.
    pub fn is_shut_down(&self) -> bool {
        self.inner
            .shut_down
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    pub(super) fn shut_down_error() -> Error {
        Error::state("the manager was shut down")
    }

    /// Stops kvwire on this node for good and returns once nothing of kvwire touches the
    /// registered memory any more: from then on the engine may free or reuse every buffer
    /// it registered, whatever transfers were under way.
    ///
    /// In order: this node's discovery records are removed (waiting at most 5 s each); new
    /// transfers and calls are refused ([`ErrorKind::InvalidState`]); every connection is
    /// closed, which ends every transfer on it (the peers see the connection lost, and
    /// fail their side with a retryable `PeerLost`: nothing half-written is ever
    /// delivered); and the manager's runtime is stopped, waiting for every task and every
    /// digest job on its blocking pool. Transfers still held by the engine report
    /// [`KvPoll::Failed`](super::KvPoll::Failed) (`InvalidState`, "the manager was shut down") from their next
    /// `poll`, and their `release` / `clear` return at once.
    ///
    /// Returns [`ErrorKind::WaitTimedOut`] if that did not finish within `timeout` (a
    /// digest job still running): the memory must then stay valid; the stop goes on in the
    /// background, and calling `shutdown` again waits for it again. Calling it after it
    /// returned `Ok` returns `Ok` at once.
    pub fn shutdown(&self, timeout: Duration) -> Result<(), Error> {
        use std::sync::atomic::Ordering;
        if !self.is_shut_down() {
            // While calls still run: the records are gone before the node stops.
            self.deregister();
        }
        if !self.inner.shut_down.swap(true, Ordering::SeqCst) {
            {
                let mut peers = self.inner.peers.lock();
                peers.conns.clear();
                peers.links.clear();
            }
            let runtime = self
                .inner
                .runtime
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            // Dropped on a thread of its own: a runtime cannot be dropped inside an async
            // context, and the caller's wait must be bounded.
            std::thread::spawn(move || {
                drop(runtime);
                let _ = tx.send(());
            });
            *self.inner.stopped.lock().unwrap_or_else(|p| p.into_inner()) = Some(rx);
        }
        let mut stopped = self.inner.stopped.lock().unwrap_or_else(|p| p.into_inner());
        match stopped.as_ref().map(|rx| rx.recv_timeout(timeout)) {
            // Stopped now, or by an earlier call (its sender is gone once it sent).
            None | Some(Ok(())) | Some(Err(std::sync::mpsc::RecvTimeoutError::Disconnected)) => {
                *stopped = None;
                Ok(())
            }
            Some(Err(std::sync::mpsc::RecvTimeoutError::Timeout)) => Err(Error::new(
                ErrorKind::WaitTimedOut,
                format!(
                    "kvwire did not stop within {timeout:?}: the registered memory must stay valid (call shutdown again to wait more)"
                ),
            )),
        }
    }
}
