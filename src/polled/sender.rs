//! The prefill side of one request: admitted, opened, sent chunk by chunk, polled.

use std::sync::{Arc, Mutex};

use kvwire_proto::admission::Request;
use kvwire_proto::wire::{ErrorCode, TransferId};

use super::{Conn, Error, KvPoll, Manager, Shared, Target};
use crate::engine::OutgoingTransfer;
use crate::memory::Holder;

#[derive(Debug, Default)]
struct Slot {
    /// (pages, tokens) from `init`, until the transfer is opened.
    init: Option<(u32, u32)>,
    /// Pages of the request, once `init` was called.
    num_pages: u32,
    /// The open transfer.
    out: Option<OutgoingTransfer>,
    /// The engine's pages handed over so far, in transfer order.
    sent: Vec<u32>,
    /// The aux index whose record goes with the final chunk.
    aux_index: Option<usize>,
    cleared: bool,
}

/// The prefill side of one request ([`Manager::sender`]): SGLang's `KVSender`.
///
/// [`init`](Self::init) admits the request (a request admission rejects fails at once with
/// the original error, which the decode side also receives) and opens it;
/// [`send`](Self::send) hands over each chunk of the engine's pages as chunked prefill
/// produces them, read in place, the final one with the aux record; [`poll`](Self::poll)
/// says where the transfer is; [`clear`](Self::clear) returns once kvwire reads none of
/// the pages any more. Dropping the transfer aborts it if it is still open.
#[derive(Debug)]
pub struct SenderTransfer {
    manager: Manager,
    room: TransferId,
    peer: Target,
    shared: Arc<Shared<()>>,
    slot: Mutex<Slot>,
}

impl SenderTransfer {
    pub(super) fn new(manager: Manager, room: TransferId, peer: Target) -> Self {
        Self {
            manager,
            room,
            peer,
            shared: Shared::new(),
            slot: Mutex::default(),
        }
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The request's id.
    pub fn room(&self) -> TransferId {
        self.room
    }

    /// Admits and opens the request: `tokens` tokens in `num_pages` pages (one per
    /// `tokens_per_page` tokens). At once if the connection to the peer exists, else at the
    /// first `poll` after it does. A request admission rejects (longer than the context,
    /// empty, larger than the pool) fails with [`ErrorKind::Rejected`](super::ErrorKind)
    /// carrying the original wire code; the decode side's reservation gets the same.
    pub fn init(&self, num_pages: u32, tokens: u32) -> Result<(), Error> {
        self.init_with_aux(num_pages, tokens, None)
    }

    /// As [`Self::init`], and the final chunk carries the record at `aux_index` of the
    /// engine's aux buffers ([`Manager::with_aux`]), read when it is sent (a `send` that
    /// passes its own aux record sends that one instead).
    pub fn init_with_aux(
        &self,
        num_pages: u32,
        tokens: u32,
        aux_index: Option<usize>,
    ) -> Result<(), Error> {
        if let Some(i) = aux_index {
            self.manager.aux().check_index(i)?;
        }
        let tpp = self.manager.config().tokens_per_page;
        let need = tokens.div_ceil(tpp.max(1));
        if tokens > 0 && num_pages != need {
            return Err(Error::invalid(format!(
                "{tokens} tokens need {need} pages of {tpp} tokens, not {num_pages}"
            )));
        }
        {
            let mut slot = self.slot();
            if slot.init.is_some() || slot.out.is_some() || slot.cleared {
                return Err(Error::state("init was already called"));
            }
            if self.shared.poll().is_final() {
                return Err(Error::state("the transfer already ended"));
            }
            slot.init = Some((num_pages, tokens));
            slot.num_pages = num_pages;
            slot.aux_index = aux_index;
        }
        self.advance();
        Ok(())
    }

    /// Admits and opens, if `init` was called and the connection to the peer exists.
    fn advance(&self) {
        let mut slot = self.slot();
        if slot.out.is_some() || slot.cleared || self.shared.poll().is_final() {
            return;
        }
        let conn = match self.manager.conn(&self.peer) {
            Ok(Some(Conn::Sender(c))) => c,
            Ok(_) => return,
            Err(e) => {
                self.shared.fail(e);
                return;
            }
        };
        let Some((_, tokens)) = slot.init.take() else {
            return;
        };
        let admitted = match conn.admit(Request {
            transfer_id: self.room,
            tokens: tokens.into(),
        }) {
            Ok(a) => a,
            Err(e) => {
                self.shared.fail(Error::from_transfer(&e));
                return;
            }
        };
        let mut out = conn.open(admitted);
        let outcome = out.take_outcome();
        slot.out = Some(out);
        self.shared.lock().settled = false;
        self.shared.advance(KvPoll::WaitingForInput);
        let shared = self.shared.clone();
        self.manager.spawn(async move {
            shared.settle(outcome.await.map_err(|e| Error::from_transfer(&e)));
        });
    }

    /// Hands over the next chunk: `pages` of the engine's registered memory, in transfer
    /// order after the chunks before it, read in place (the engine must not write them
    /// until [`Self::clear`] returned). `aux` goes with the final chunk only (the one that
    /// completes the request's pages). Waits only for the connection to take the chunk (a
    /// local round trip), not for the data to be written. A refused chunk changes nothing:
    /// the transfer goes on.
    pub fn send(&self, pages: &[u32], aux: Option<&[u8]>) -> Result<(), Error> {
        let mut slot = self.slot();
        match self.shared.poll() {
            KvPoll::WaitingForInput => {}
            KvPoll::Failed => {
                return Err(self
                    .failure()
                    .unwrap_or_else(|| Error::state("the transfer failed")))
            }
            KvPoll::Bootstrapping => {
                return Err(Error::state(
                    "the transfer is not open yet (init, and poll until WaitingForInput)",
                ))
            }
            KvPoll::Transferring | KvPoll::Success => {
                return Err(Error::state("every page of the request was already sent"))
            }
        }
        let total = slot.sent.len() + pages.len();
        if pages.is_empty() || total > slot.num_pages as usize {
            return Err(Error::invalid(format!(
                "a chunk of {} pages after {} sent: the request has {}",
                pages.len(),
                slot.sent.len(),
                slot.num_pages
            )));
        }
        let last = total == slot.num_pages as usize;
        if aux.is_some() && !last {
            return Err(Error::invalid(
                "the aux record goes with the final chunk only",
            ));
        }
        let Some(out) = &slot.out else {
            return Err(Error::state("the transfer is not open"));
        };
        let aux = match (aux, slot.aux_index) {
            (Some(a), _) => Some(a.to_vec()),
            (None, Some(i)) if last => Some(self.manager.aux().read(i)?),
            (None, _) => None,
        };
        let taken = out.send_chunk(pages.to_vec(), aux);
        self.manager
            .block(taken, self.manager.config().call_timeout)?
            .map_err(|e| Error::from_transfer(&e))?;
        slot.sent.extend_from_slice(pages);
        if last {
            self.shared.advance(KvPoll::Transferring);
        }
        Ok(())
    }

    /// The state, at once (never blocks): [`KvPoll::Bootstrapping`] until opened,
    /// [`KvPoll::WaitingForInput`] until the final chunk was handed over,
    /// [`KvPoll::Transferring`] until the receiver's verdict, then [`KvPoll::Success`] (the
    /// receiver verified it) or [`KvPoll::Failed`].
    pub fn poll(&self) -> KvPoll {
        if self.shared.poll() == KvPoll::Bootstrapping {
            self.advance();
        }
        self.shared.poll()
    }

    /// Whether the connection the transfer goes over is up (it may still be
    /// [`KvPoll::Bootstrapping`] for want of `init`).
    pub fn connected(&self) -> bool {
        matches!(self.manager.conn(&self.peer), Ok(Some(_)))
    }

    /// Pages handed over so far.
    pub fn pages_sent(&self) -> usize {
        self.slot().sent.len()
    }

    /// Blocks until the transfer ended or `timeout` passed; returns the state then.
    pub fn wait(&self, timeout: std::time::Duration) -> KvPoll {
        self.shared.wait_until(timeout, |s| s.poll.is_final(), &|| {
            self.poll();
        });
        self.shared.poll()
    }

    /// Why the transfer failed (`None` unless [`KvPoll::Failed`]).
    pub fn failure(&self) -> Option<Error> {
        self.shared.lock().error.clone()
    }

    /// Aborts the transfer: it fails at once with [`ErrorKind::Aborted`](super::ErrorKind)
    /// (`CANCELLED`); kvwire stops posting, drains what it posted and tells the receiver.
    /// Nothing happens to a transfer that already ended.
    pub fn abort(&self) {
        self.abort_with(Error::aborted());
    }

    /// Aborts the transfer as [`Self::abort`] does, with `failure` as the reason it reports
    /// (the receiver still gets `CANCELLED`): for an engine that treats a refused chunk as
    /// the end of the request (the Python package does).
    pub fn abort_with(&self, failure: Error) {
        let slot = self.slot();
        if self.shared.poll().is_final() {
            return;
        }
        if let Some(out) = &slot.out {
            out.abort(ErrorCode::CANCELLED);
        }
        self.shared.fail(failure);
    }

    /// Ends the request here: aborts it if still open, then returns once kvwire reads none
    /// of its pages any more (its writes and digests drained); the engine may then write
    /// and reuse them. Calling it again does nothing.
    pub fn clear(&self) -> Result<(), Error> {
        let timeout = self.manager.config().release_timeout;
        self.abort();
        if !self.shared.wait_until(timeout, |s| s.settled, &|| {}) {
            return Err(Error::new(
                super::ErrorKind::WaitTimedOut,
                format!("the transfer's outcome did not arrive within {timeout:?}"),
            ));
        }
        let sent = {
            let mut slot = self.slot();
            slot.cleared = true;
            slot.init = None;
            slot.out = None;
            std::mem::take(&mut slot.sent)
        };
        self.manager
            .wait_pages_free(Holder::Sending(self.room), Some(&sent))
    }
}

impl Drop for SenderTransfer {
    fn drop(&mut self) {
        self.abort();
    }
}
