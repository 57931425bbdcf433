//! The prefill side of one request: admitted, opened, sent chunk by chunk, polled.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvwire_proto::FailureReason;
use tokio::runtime::Handle;

use kvwire_proto::admission::Request;
use kvwire_proto::wire::{ErrorCode, TransferId};

use super::{Conn, Error, ErrorKind, KvPoll, Manager, RoomClaim, Shared, Target};
use crate::engine::{OutgoingTransfer, Rooms, SenderConn, TransferError};
use crate::memory::Holder;

#[derive(Debug, Default)]
struct Slot {
    /// (pages, tokens) from `init`, until the transfer is opened.
    init: Option<(u32, u32)>,
    /// When `init` was called: a request no decode names within the reservation timeout
    /// fails (routing by the decode, [`Manager::sender`]).
    init_at: Option<Instant>,
    /// This manager's claim on the request id, from `init` until `clear` or drop.
    claim: Option<RoomClaim>,
    /// Chunks handed over before the transfer was open, sent in order when it opens.
    queued: Vec<(Vec<u32>, Option<Vec<u8>>)>,
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
/// the original error, which the decode side also receives) and opens it once its decode
/// reserved it; [`send`](Self::send) hands over each chunk of the engine's pages as chunked
/// prefill produces them, read in place, the final one with the aux record;
/// [`poll`](Self::poll) says where the transfer is; [`clear`](Self::clear) returns once
/// kvwire reads none of the pages any more. Dropping the transfer aborts it if it is still
/// open.
///
/// Routed by the decode ([`Manager::sender`] with no peer): the request goes to the decode
/// node that reserved it (or refused it), whichever of the connected decodes that is. Until
/// one did, the transfer is [`KvPoll::Bootstrapping`]; [`KvPoll::WaitingForInput`] means a
/// decode reserved it. A decode's refusal (its pool or context too small, its engine
/// cancelled the request) fails the transfer at once with the decode's code
/// ([`ErrorKind::PeerAborted`], not retryable); no decode naming it within the reservation
/// timeout fails it with [`ErrorKind::Timeout`] (retryable).
#[derive(Debug)]
pub struct SenderTransfer {
    manager: Manager,
    room: TransferId,
    peer: Target,
    shared: Arc<Shared<()>>,
    /// Shared with the task that opens the transfer when its decode names it.
    slot: Arc<Mutex<Slot>>,
}

fn lock(slot: &Mutex<Slot>) -> MutexGuard<'_, Slot> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

impl SenderTransfer {
    pub(super) fn new(manager: Manager, room: TransferId, peer: Target) -> Self {
        Self {
            manager,
            room,
            peer,
            shared: Shared::new(),
            slot: Arc::default(),
        }
    }

    fn slot(&self) -> MutexGuard<'_, Slot> {
        lock(&self.slot)
    }

    /// Opens the transfer as soon as a decode names it (its reservation or refusal arrived),
    /// without waiting for the engine's next `poll`. The task holds no manager (the last
    /// one dropped there would drop the runtime inside itself).
    fn open_when_named(&self) {
        let named = self.manager.node().rooms().when_named(self.room);
        let (peers, rooms) = (
            self.manager.peer_list().clone(),
            self.manager.node().rooms().clone(),
        );
        let (room, shared, slot) = (self.room, self.shared.clone(), self.slot.clone());
        self.manager.spawn(async move {
            let Ok(route) = named.await else { return };
            // The peer list's lock is let go before the slot's is taken: the engine's `poll`
            // takes them the other way round (slot, then peers).
            let found = peers.lock().find(&Target::Node(route.peer));
            let Ok(Some(Conn::Sender(conn))) = found else {
                return;
            };
            let mut slot = lock(&slot);
            open_on(conn, room, &rooms, &shared, &mut slot, &Handle::current());
        });
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
            // One transfer per request on a node: a second admission of the id is refused
            // here, not at its first chunk.
            let peer = match self.peer {
                Target::Node(p) => Some(p),
                _ => None,
            };
            slot.claim = Some(self.manager.claim_room(self.room, peer)?);
            slot.init = Some((num_pages, tokens));
            slot.init_at = Some(Instant::now());
            slot.num_pages = num_pages;
            slot.aux_index = aux_index;
        }
        if let Target::Room(_) = self.peer {
            // Admission runs now, before any decode named the request (and before the
            // request can open): a rejected request fails at once, with its own reason, and
            // is retired on the connection of the decode that names it.
            let policy = self.manager.admission();
            if let Err(rejected) = policy.admit(Request {
                transfer_id: self.room,
                tokens: tokens.into(),
            }) {
                let error = Error::from_admission(&rejected.error);
                self.manager.node().rooms().retire_when_named(rejected);
                if let Ok(Some(Conn::Sender(c))) = self.manager.conn(&self.peer) {
                    // Named already: retire it on that connection too (idempotent).
                    let _ = c.admit(Request {
                        transfer_id: self.room,
                        tokens: tokens.into(),
                    });
                }
                self.slot().init = None;
                self.shared.fail(error);
                return Ok(());
            }
            self.open_when_named();
        }
        self.advance();
        Ok(())
    }

    /// Admits and opens, if `init` was called and the connection to the peer exists (routed
    /// by the decode: the decode that named the request reserved or refused it); sends the
    /// chunks queued meanwhile.
    fn advance(&self) {
        let mut slot = self.slot();
        if slot.out.is_some() || slot.cleared || self.shared.poll().is_final() {
            return;
        }
        let conn = match self.manager.conn(&self.peer) {
            Ok(Some(Conn::Sender(c))) => c,
            Ok(_) => {
                let wait = self.manager.reservation_wait();
                if let (Target::Room(_), Some(at)) = (&self.peer, slot.init_at) {
                    if slot.init.is_some() && at.elapsed() >= wait {
                        self.shared.fail(
                            Error::new(
                                ErrorKind::Timeout,
                                format!(
                                    "no decode node reserved request {} within {wait:?}",
                                    self.room.0
                                ),
                            )
                            .with_code(ErrorCode::TIMEOUT)
                            .retryable(true),
                        );
                    }
                }
                return;
            }
            Err(e) => {
                self.shared.fail(e);
                return;
            }
        };
        open_on(
            conn,
            self.room,
            self.manager.node().rooms(),
            &self.shared,
            &mut slot,
            self.manager.handle(),
        );
    }

    /// Hands over the next chunk: `pages` of the engine's registered memory, in transfer
    /// order after the chunks before it, read in place (the engine must not write them
    /// until [`Self::clear`] returned). `aux` goes with the final chunk only (the one that
    /// completes the request's pages). Never waits: the chunk goes to the connection's task
    /// and this returns (an engine's scheduler loop must not stall on its transfer layer; the
    /// chaos cluster once saw a send wait 30 s). A chunk the connection refuses (pages the
    /// pool cannot lend, a chunk the session does not take) fails the transfer: [`Self::poll`]
    /// reads Failed with the reason, and the transfer is aborted. Checks that need no
    /// connection (the page count, the aux record) still fail here, changing nothing. A
    /// chunk handed over after `init` but before the transfer opened
    /// (its decode has not reserved yet) is queued and sent when it opens.
    pub fn send(&self, pages: &[u32], aux: Option<&[u8]>) -> Result<(), Error> {
        let mut slot = self.slot();
        match self.shared.poll() {
            KvPoll::WaitingForInput => {}
            KvPoll::Bootstrapping if slot.init.is_some() => {}
            KvPoll::Failed => {
                return Err(self
                    .failure()
                    .unwrap_or_else(|| Error::state("the transfer failed")))
            }
            KvPoll::Bootstrapping => {
                return Err(Error::state("init the transfer before sending its pages"))
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
        let aux = match (aux, slot.aux_index) {
            (Some(a), _) => Some(a.to_vec()),
            (None, Some(i)) if last => Some(self.manager.aux().read(i)?),
            (None, _) => None,
        };
        let Some(out) = &slot.out else {
            // Not open yet: queued, sent when the decode reserved.
            slot.queued.push((pages.to_vec(), aux));
            slot.sent.extend_from_slice(pages);
            return Ok(());
        };
        // The chunk is in the connection's queue once this returns; whether it was taken is
        // learnt on the runtime, never waited for here (in the chaos cluster a prefill's
        // `send` that waited once held its engine loop for the whole call timeout, 30 s;
        // docs/CLUSTER.md).
        let taken = out.send_chunk(pages.to_vec(), aux);
        slot.sent.extend_from_slice(pages);
        drop(slot);
        if last {
            self.shared.advance(KvPoll::Transferring);
        }
        let (shared, slot) = (self.shared.clone(), self.slot.clone());
        self.manager.spawn(async move {
            use crate::sender::ChunkStartError::Session;
            use kvwire_proto::sender::ChunkError;
            match taken.await {
                Ok(()) => {}
                // The transfer already ended (failed, aborted, its connection lost): its own
                // outcome says why, and must not be masked by the chunk's refusal.
                Err(
                    TransferError::ConnectionClosed
                    | TransferError::Chunk(Session(
                        ChunkError::UnknownTransfer(_) | ChunkError::TransferEnding(_),
                    )),
                ) => {}
                Err(e) => {
                    // Refused: the transfer would wait for a chunk that never comes. Abort
                    // it, and let poll say why.
                    if let Some(out) = &lock(&slot).out {
                        out.abort(ErrorCode::CANCELLED);
                    }
                    shared.fail(Error::from_transfer(&e));
                }
            }
        });
        Ok(())
    }

    /// The state, at once (never blocks): [`KvPoll::Bootstrapping`] until opened (routed by
    /// the decode: until the decode reserved the request), [`KvPoll::WaitingForInput`]
    /// until the final chunk was handed over,
    /// [`KvPoll::Transferring`] until the receiver's verdict, then [`KvPoll::Success`] (the
    /// receiver verified it) or [`KvPoll::Failed`].
    pub fn poll(&self) -> KvPoll {
        if self.manager.is_shut_down() {
            self.shared.fail(Manager::shut_down_error());
        } else if self.shared.poll() == KvPoll::Bootstrapping {
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
        if self.shared.poll().is_final() {
            return;
        }
        if self.slot().out.is_none() && matches!(self.manager.conn(&self.peer), Ok(Some(_))) {
            // A decode reserved (or refused) the request and it is not open here yet: open
            // it, so that the abort reaches that decode now (its reservation fenced at once)
            // rather than at its parking deadline.
            self.advance();
        }
        let slot = self.slot();
        if self.shared.poll().is_final() {
            return;
        }
        match (&slot.out, slot.init, &self.peer) {
            (Some(out), _, _) => out.abort(ErrorCode::CANCELLED),
            // No decode named it yet: whichever does gets REJECT(CANCELLED) at once.
            (None, Some((_, tokens)), Target::Room(_)) => {
                self.manager.cancel_everywhere(self.room, tokens)
            }
            _ => {}
        }
        self.shared.fail(failure);
    }

    /// Ends the request here: aborts it if still open, then returns once kvwire reads none
    /// of its pages any more (its writes and digests drained); the engine may then write
    /// and reuse them. Calling it again does nothing.
    pub fn clear(&self) -> Result<(), Error> {
        let timeout = self.manager.config().release_timeout;
        self.abort();
        if self.manager.is_shut_down() {
            // Nothing of kvwire runs any more ([`Manager::shutdown`]).
            self.slot().cleared = true;
            return Ok(());
        }
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
            slot.queued.clear();
            slot.claim = None;
            std::mem::take(&mut slot.sent)
        };
        self.manager
            .wait_pages_free(Holder::Sending(self.room), Some(&sent))
    }
}

/// Admits and opens the request on `conn` (once `init` was called and it is not open yet,
/// else nothing happens), and sends the chunks the engine handed over meanwhile.
fn open_on(
    conn: SenderConn,
    room: TransferId,
    rooms: &Rooms,
    shared: &Arc<Shared<()>>,
    slot: &mut Slot,
    runtime: &Handle,
) {
    if slot.out.is_some() || slot.cleared || shared.poll().is_final() {
        return;
    }
    let refusal = rooms
        .route(room)
        .filter(|r| r.peer == conn.peer().node_id)
        .and_then(|r| r.refusal);
    if let Some(code) = refusal {
        // This decode refused the request before reserving it: the same failure as its
        // abort after (the connection would answer the open with it, a round trip later).
        // Also before `init`: the engine need not compute KV nobody will take.
        slot.init = None;
        shared.fail(Error::from_reason(&FailureReason::PeerAbort {
            code,
            completed_pages: 0,
        }));
        return;
    }
    let Some((_, tokens)) = slot.init.take() else {
        return;
    };
    let admitted = match conn.admit(Request {
        transfer_id: room,
        tokens: tokens.into(),
    }) {
        Ok(a) => a,
        Err(e) => {
            shared.fail(Error::from_transfer(&e));
            return;
        }
    };
    let mut out = conn.open(admitted);
    rooms.forget(room);
    let outcome = out.take_outcome();
    // The chunks the engine handed over before the transfer opened, in order; the first
    // one refused ends the transfer (the engine was told its chunk was taken).
    let queued: Vec<_> = std::mem::take(&mut slot.queued)
        .into_iter()
        .map(|(pages, aux)| out.send_chunk(pages, aux))
        .collect();
    let last = slot.sent.len() == slot.num_pages as usize;
    slot.out = Some(out);
    shared.lock().settled = false;
    shared.advance(if last {
        KvPoll::Transferring
    } else {
        KvPoll::WaitingForInput
    });
    let shared = shared.clone();
    runtime.spawn(async move {
        for taken in queued {
            if let Err(refused) = taken.await {
                // The transfer's own failure (a decode's refusal, a lost peer), if it has
                // one, is why the chunk was refused.
                conn.abort(room, ErrorCode::CANCELLED);
                let cause = match outcome.await {
                    Err(e)
                        if !matches!(
                            e,
                            TransferError::Failed(FailureReason::LocalAbort { .. })
                        ) =>
                    {
                        e
                    }
                    _ => refused,
                };
                shared.settle(Err(Error::from_transfer(&cause)));
                return;
            }
        }
        shared.settle(outcome.await.map_err(|e| Error::from_transfer(&e)));
    });
}

impl Drop for SenderTransfer {
    fn drop(&mut self) {
        self.abort();
    }
}
