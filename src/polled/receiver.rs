//! The decode side of one request: a reservation into the engine's chosen pages, polled.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvwire_proto::wire::{ErrorCode, TransferId};

use super::aux::AuxBuffers;
use super::{Conn, Error, ErrorKind, KvPoll, Manager, Shared, Target};
use crate::engine::ReserveParams;
use crate::engine::{ReceiverConn, Verified};
use crate::memory::Holder;
use tokio::runtime::Handle;

/// What a verified transfer delivered, kept until the engine releases it.
#[derive(Debug)]
struct Delivered {
    /// The verified handle: kvwire holds its pages for the engine until released.
    verified: Option<Verified>,
    pages: Vec<u32>,
    aux: Vec<u8>,
}

#[derive(Debug)]
struct Init {
    pages: Vec<u32>,
    tokens: u32,
    timeout: Duration,
    aux_index: Option<usize>,
}

#[derive(Debug, Default)]
struct Slot {
    /// What `init` asked for, until the reservation is made.
    init: Option<Init>,
    /// The reserved pages, once reserved.
    reserved: Option<Vec<u32>>,
    conn: Option<ReceiverConn>,
    released: bool,
}

/// The decode side of one request ([`Manager::receiver`]): SGLang's `KVReceiver`.
///
/// [`init`](Self::init) with the engine's destination pages reserves them on the
/// connection to the peer (at once, or at the first `poll` after the connection exists);
/// [`poll`](Self::poll) says where the transfer is; after [`KvPoll::Success`] the pages
/// hold the sender's bytes, verified by digest over the memory that landed, and
/// [`page_indices`](Self::page_indices) and [`aux`](Self::aux) say what arrived;
/// [`release`](Self::release) gives the pages back to the engine. Dropping the transfer
/// aborts it if it is still open and releases its pages (without waiting for them).
#[derive(Debug)]
pub struct ReceiverTransfer {
    manager: Manager,
    room: TransferId,
    peer: Target,
    shared: Arc<Shared<Delivered>>,
    /// Shared with the task that reserves once the connection is up.
    slot: Arc<Mutex<Slot>>,
}

fn lock(slot: &Mutex<Slot>) -> MutexGuard<'_, Slot> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

impl ReceiverTransfer {
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

    /// The request's id.
    pub fn room(&self) -> TransferId {
        self.room
    }

    /// Reserves `pages` (the engine's destination page indices, one per `tokens_per_page`
    /// tokens, in transfer order) for `tokens` tokens; the sender must commit within
    /// `timeout`. Reserved at once if the connection to the peer exists, else at the first
    /// `poll` after it does. kvwire holds the pages from here until [`Self::release`]
    /// returned. Fails at once for a page count that does not fit the tokens, or when
    /// called twice.
    pub fn init(&self, pages: Vec<u32>, tokens: u32, timeout: Duration) -> Result<(), Error> {
        self.init_with_aux(pages, tokens, timeout, None)
    }

    /// As [`Self::init`], and the verified aux record is written at `aux_index` of the
    /// engine's aux buffers ([`Manager::with_aux`]) before the transfer reports Success. A
    /// prompt longer than this node's whole pool is rejected here, before anything goes
    /// out: the transfer fails with [`ErrorKind::Rejected`] (`PROMPT_EXCEEDS_POOL`).
    pub fn init_with_aux(
        &self,
        pages: Vec<u32>,
        tokens: u32,
        timeout: Duration,
        aux_index: Option<usize>,
    ) -> Result<(), Error> {
        if let Some(i) = aux_index {
            self.manager.aux().check_index(i)?;
        }
        let config = self.manager.node().config();
        let (pool, context) = (&config.pool, config.engine.max_context_tokens);
        let capacity = pool.capacity_tokens();
        let refusal = if u64::from(tokens) > context {
            Some((
                ErrorCode::PROMPT_EXCEEDS_CONTEXT,
                format!("rejected at the decode node: prompt of {tokens} tokens exceeds its context length of {context} tokens"),
            ))
        } else if u64::from(tokens) > capacity {
            let needed = u64::from(tokens).div_ceil(u64::from(pool.tokens_per_page.max(1)));
            Some((
                ErrorCode::PROMPT_EXCEEDS_POOL,
                format!(
                    "rejected at the decode node: prompt of {tokens} tokens needs {needed} pages but the decode KV pool has {} pages ({capacity} tokens)",
                    pool.pages
                ),
            ))
        } else {
            None
        };
        if let Some((code, detail)) = refusal {
            // Nothing is reserved; the prefill is told at once, with this code.
            if self.shared.poll().is_final() {
                return Err(Error::state("the transfer already ended"));
            }
            self.refuse(code, detail.clone());
            self.shared
                .fail(Error::new(ErrorKind::Rejected, detail).with_code(code));
            return Ok(());
        }
        let tpp = self.manager.config().tokens_per_page;
        let need = tokens.div_ceil(tpp.max(1)) as usize;
        if tokens == 0 || pages.len() != need {
            return Err(Error::invalid(format!(
                "{tokens} tokens need {need} pages of {tpp} tokens, {} given",
                pages.len()
            )));
        }
        {
            let mut slot = self.slot();
            if slot.init.is_some() || slot.reserved.is_some() || slot.released {
                return Err(Error::state("init was already called"));
            }
            if self.shared.poll().is_final() {
                return Err(Error::state("the transfer already ended"));
            }
            slot.init = Some(Init {
                pages,
                tokens,
                timeout,
                aux_index,
            });
        }
        self.advance();
        if self.shared.poll() == KvPoll::Bootstrapping {
            self.reserve_when_connected(timeout);
        }
        Ok(())
    }

    /// Reserves, if `init` was called and the connection to the peer exists.
    fn advance(&self) {
        let mut slot = self.slot();
        if slot.reserved.is_some() || slot.released || self.shared.poll().is_final() {
            return;
        }
        let conn = match self.manager.conn(&self.peer) {
            Ok(Some(Conn::Receiver(c))) => c,
            Ok(_) => return,
            Err(e) => {
                self.shared.fail(e);
                return;
            }
        };
        self.reserving()
            .reserve_on(conn, &mut slot, self.manager.handle());
    }

    /// What reserving needs, without the manager: a task may hold it.
    fn reserving(&self) -> Reserving {
        Reserving {
            room: self.room,
            shared: self.shared.clone(),
            aux: self.manager.aux().clone(),
            release_verified: self.manager.config().release_verified,
        }
    }

    /// Reserves as soon as the connection to the peer is up (or fails the transfer with the
    /// dial's error), without waiting for the engine's next `poll`: the prefill learns of
    /// the request now. Gives up waiting after `timeout` (a later `poll` still reserves).
    /// The task holds no manager (the last one dropped there would drop the runtime inside
    /// itself).
    fn reserve_when_connected(&self, timeout: Duration) {
        let (peers, target, slot) = (
            self.manager.peer_list().clone(),
            self.peer.clone(),
            self.slot.clone(),
        );
        let reserving = self.reserving();
        self.manager.spawn(async move {
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                let changed = peers.notify.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                // The peer list's lock is let go before the slot's is taken: the engine's
                // `poll` takes them the other way round (slot, then peers).
                let found = peers.lock().find(&target);
                match found {
                    Ok(Some(Conn::Receiver(conn))) => {
                        let mut slot = lock(&slot);
                        reserving.reserve_on(conn, &mut slot, &Handle::current());
                        return;
                    }
                    Err(e) => {
                        reserving.shared.fail(e);
                        return;
                    }
                    Ok(_) => {}
                }
                if reserving.shared.poll() != KvPoll::Bootstrapping {
                    return;
                }
                if tokio::time::timeout_at(deadline, changed).await.is_err() {
                    return;
                }
            }
        });
    }

    /// The state, at once (never blocks). [`KvPoll::Bootstrapping`] until the reservation
    /// is made, [`KvPoll::WaitingForInput`] until the verdict, then
    /// [`KvPoll::Success`] or [`KvPoll::Failed`].
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

    /// Blocks until the transfer ended or `timeout` passed; returns the state then.
    pub fn wait(&self, timeout: Duration) -> KvPoll {
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
    /// (`CANCELLED`); kvwire fences the reservation (no write for it can land any more) and
    /// tells the sender. Nothing happens to a transfer that already ended.
    ///
    /// "Ended" is what [`poll`](Self::poll) read: the abort takes effect here at once, before
    /// the connection hears of it. An abort that crosses the verdict on its way (the
    /// connection had verified the transfer and told the sender, but this handle had not read
    /// it yet) still fails the transfer here with `CANCELLED`, while the sender reports it
    /// verified: the bytes were verified, this engine chose not to use them, and the pages go
    /// back as for any abort.
    pub fn abort(&self) {
        let slot = self.slot();
        if self.shared.poll().is_final() {
            return;
        }
        match &slot.conn {
            Some(conn) => conn.abort(self.room, ErrorCode::CANCELLED),
            // Not reserved yet: the prefill is told the request is cancelled, so it does
            // not wait for a reservation.
            None => self.refuse(
                ErrorCode::CANCELLED,
                "cancelled by the decode engine".into(),
            ),
        }
        self.shared.fail(Error::aborted());
    }

    /// Tells the prefill that this node will not reserve the request (SPEC §5.1, "Refused
    /// before reservation"): now if the connection is up, else as soon as it is (dialled
    /// already for a receiver made by address), within the manager's call timeout.
    fn refuse(&self, code: ErrorCode, detail: String) {
        let (peers, target, room) = (
            self.manager.peer_list().clone(),
            self.peer.clone(),
            self.room,
        );
        let deadline = std::time::Instant::now() + self.manager.config().call_timeout;
        self.manager.spawn(async move {
            loop {
                let found = peers.lock().find(&target);
                match found {
                    Ok(Some(Conn::Receiver(c))) => {
                        c.refuse(room, code, detail);
                        return;
                    }
                    Ok(None) if std::time::Instant::now() < deadline => {}
                    // Failed, or never connected: the prefill finds no reservation, and
                    // fails at its reservation timeout.
                    _ => return,
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
    }

    /// The destination page indices that hold the verified KV, in transfer order (after
    /// [`KvPoll::Success`]).
    pub fn page_indices(&self) -> Result<Vec<u32>, Error> {
        let s = self.shared.lock();
        match &s.result {
            Some(d) => Ok(d.pages.clone()),
            None => Err(Error::state("no verified transfer (poll until Success)")),
        }
    }

    /// The auxiliary record delivered with the pages (e.g. the first output token),
    /// verified against its digest; empty if the sender sent none (after
    /// [`KvPoll::Success`]).
    pub fn aux(&self) -> Result<Vec<u8>, Error> {
        let s = self.shared.lock();
        match &s.result {
            Some(d) => Ok(d.aux.clone()),
            None => Err(Error::state("no verified transfer (poll until Success)")),
        }
    }

    /// Gives the pages back to the engine: returns only once kvwire holds none of them (a
    /// verified transfer's handle released; a failed or aborted one fenced and released).
    /// A transfer still open is aborted first. After it returned the engine may write and
    /// reuse the pages. Calling it again does nothing.
    pub fn release(&self) -> Result<(), Error> {
        let timeout = self.manager.config().release_timeout;
        self.abort();
        if self.manager.is_shut_down() {
            // Nothing of kvwire runs any more ([`Manager::shutdown`]).
            self.slot().released = true;
            return Ok(());
        }
        let settled = self.shared.wait_until(timeout, |s| s.settled, &|| {});
        if !settled {
            return Err(Error::new(
                super::ErrorKind::WaitTimedOut,
                format!("the transfer's outcome did not arrive within {timeout:?}"),
            ));
        }
        let verified = self
            .shared
            .lock()
            .result
            .as_mut()
            .and_then(|d| d.verified.take());
        if let Some(v) = verified {
            v.release().map_err(|e| Error::state(e.to_string()))?;
        }
        let reserved = {
            let mut slot = self.slot();
            slot.released = true;
            slot.init = None;
            slot.reserved.clone()
        };
        match reserved {
            Some(pages) => self
                .manager
                .wait_pages_free(Holder::Receiving(self.room), Some(&pages)),
            None => Ok(()),
        }
    }
}

/// Reserves a transfer's pages on a connection and follows it to its verdict.
struct Reserving {
    room: TransferId,
    shared: Arc<Shared<Delivered>>,
    aux: Arc<AuxBuffers>,
    release_verified: bool,
}

impl Reserving {
    /// Reserves on `conn`, if `init` was called and nothing is reserved yet.
    fn reserve_on(self, conn: ReceiverConn, slot: &mut Slot, runtime: &Handle) {
        if slot.reserved.is_some() || slot.released || self.shared.poll().is_final() {
            return;
        }
        let Some(init) = slot.init.take() else { return };
        let params =
            ReserveParams::new(self.room, init.tokens, init.timeout).into_pages(init.pages.clone());
        // The reservation is sent to the connection's task here; the future only waits.
        let verdict = conn.reserve(params);
        slot.reserved = Some(init.pages);
        slot.conn = Some(conn);
        self.shared.lock().settled = false;
        self.shared.advance(KvPoll::WaitingForInput);
        let Self {
            shared,
            aux,
            release_verified,
            ..
        } = self;
        let aux_index = init.aux_index;
        runtime.spawn(async move {
            let outcome = verdict.await.map_err(|e| Error::from_transfer(&e));
            shared.settle(outcome.and_then(|v| {
                let record = v.aux().to_vec();
                if let Some(i) = aux_index {
                    aux.write(i, &record)?;
                }
                let pages = v.page_indices();
                let verified = if release_verified {
                    // kvwire holds none of the pages once this returned.
                    v.release()
                        .map_err(|e| Error::state(format!("release: {e}")))?;
                    None
                } else {
                    Some(v)
                };
                Ok(Delivered {
                    pages,
                    aux: record,
                    verified,
                })
            }));
        });
    }
}

impl Drop for ReceiverTransfer {
    fn drop(&mut self) {
        self.abort();
        // A verified handle still held is dropped with the shared state (its pages go back
        // to the pool); a reservation still open is fenced and released by its connection.
    }
}
