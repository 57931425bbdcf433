//! The receiver (decode side): reserves pages, fences, verifies, delivers (SPEC.md §5.2).
//!
//! ```text
//!  reserve() ──RESERVE──▶ AwaitingCommit ──COMMIT ok──▶ FencingForVerify ──fenced──▶ Verifying
//!                              │                                                      │
//!      REJECT / ABORT / timeout / local abort / peer lost                 digests match│mismatch
//!                              ▼                                                      ▼
//!                        Failing ──fenced (and digests done)──▶ Release ──▶ [AwaitingAbortAck]   Delivered | Release+NACK
//! ```
//!
//! Pages are released only after the transport has reported the fence complete, so no write
//! for the transfer can land in them afterwards. Only a transfer whose digests, computed by
//! the driver over the landed memory after the fence, match the commit is delivered.

mod closed;
mod state;
mod transfer;
mod types;
mod verify;

use crate::open::OpenTransfers;
use crate::wire::TransferId;
use std::time::Instant;

use crate::error::{FailureReason, Wait};
use crate::handshake::Established;
use crate::history::{Finished, History};
use crate::scope::FrameError;
use crate::timers::Timers;
use crate::wire::{
    commit_fits, Abort, DigestAlgorithm, ErrorCode, Frame, KvLayout, Nack, Reserve,
    TransferDigests, TransferRef, MAX_ACCESS, MAX_PAGES, NONE_INDEX,
};
use state::{AfterFence, Awaiting, AwaitingCommit, Pending, Spec, State, Verifying};
use transfer::{Next, Out, Transfer};
use verify::compare_digests;

pub use types::{
    Delivery, ReceiverAction, ReceiverConfig, ReceiverEvent, ReceiverStats, ReservationRequest,
    ReserveError,
};

/// The receiver side of one connection: all its transfers.
#[derive(Clone, Debug)]
pub struct ReceiverSession {
    layout: KvLayout,
    digests: Vec<DigestAlgorithm>,
    /// This node's `max_aux` (its hello): the longest aux record a COMMIT may carry.
    max_aux: u32,
    config: ReceiverConfig,
    nonce_counter: u64,
    transfers: OpenTransfers<Transfer>,
    history: History,
    timers: Timers,
    out: Out,
    lost: bool,
    /// Whether a transfer whose lane fails is moved to a live lane (SPEC §9.2).
    moves: bool,
}

/// SplitMix64's finaliser: a bijection on u64, so distinct counters give distinct nonces.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl ReceiverSession {
    /// A session over an established connection on which this node is the receiver.
    ///
    /// `nonce_seed` seeds the reservation nonces (SPEC.md §5.2.1). The crate has no source of
    /// randomness (sans-IO): the caller MUST draw it afresh for every connection, from a
    /// random source, so nonces differ across connections and cannot be predicted. A fixed
    /// seed is for deterministic tests only.
    pub fn new(established: &Established, config: ReceiverConfig, nonce_seed: u64) -> Self {
        let history = History::new(config.history);
        Self {
            layout: established.layout().clone(),
            digests: established.digests.clone(),
            max_aux: established.local.max_aux,
            nonce_counter: nonce_seed,
            out: Out {
                abort_ack_timeout: config.abort_ack_timeout,
                ..Out::default()
            },
            config,
            transfers: OpenTransfers::default(),
            history,
            timers: Timers::default(),
            lost: false,
            moves: false,
        }
    }

    /// Moves a transfer whose lane fails before its COMMIT came to a live lane instead of
    /// failing it (SPEC §9.2, moving a transfer): the driver of a connection whose lanes can
    /// fail one by one (several RDMA queue pairs) turns it on; the sender must too.
    pub fn allow_moves(&mut self) {
        self.moves = true;
    }

    fn fresh_nonce(&mut self) -> u64 {
        loop {
            self.nonce_counter = self.nonce_counter.wrapping_add(1);
            let n = mix(self.nonce_counter);
            if n != 0 {
                return n;
            }
        }
    }

    /// Whether `transfer_id` has a transfer here (open, or ending: a reservation for it
    /// would be refused, [`ReserveError::DuplicateTransfer`]).
    pub fn has_transfer(&self, transfer_id: TransferId) -> bool {
        self.transfers.contains_key(&transfer_id)
    }

    /// Reserves pages for a transfer: queues RESERVE and arms the commit deadline.
    /// Returns the reservation's transfer reference (with its fresh nonce).
    pub fn reserve(
        &mut self,
        now: Instant,
        req: ReservationRequest,
    ) -> Result<TransferRef, ReserveError> {
        if self.lost {
            return Err(ReserveError::PeerLost);
        }
        if self.transfers.contains_key(&req.transfer_id) {
            return Err(ReserveError::DuplicateTransfer(req.transfer_id));
        }
        if req.tokens == 0 {
            return Err(ReserveError::NoTokens);
        }
        let expected = self.layout.pages_for_tokens(req.tokens).unwrap_or(0);
        if req.pages.len() as u64 != u64::from(expected) {
            return Err(ReserveError::PageCountMismatch {
                pages: req.pages.len(),
                expected: u64::from(expected),
            });
        }
        if req.pages.len() > MAX_PAGES
            || req.access.len() > MAX_ACCESS
            || !commit_fits(
                self.layout.buffers(),
                req.pages.len(),
                req.page_digests,
                self.max_aux as usize,
            )
        {
            return Err(ReserveError::TooLarge);
        }
        let mut sorted = req.pages.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(ReserveError::DuplicatePage(w[0]));
        }
        let digest = req.digest.unwrap_or(self.digests[0]);
        if !self.digests.contains(&digest) {
            return Err(ReserveError::DigestNotAgreed(digest));
        }
        // A new reservation for an id seen before starts afresh (with a new nonce). The
        // history entry of the earlier one stays until this one ends (and replaces it), so a
        // late ABORT for the earlier reservation still gets the truth (SPEC §7.3).
        let transfer = TransferRef {
            transfer_id: req.transfer_id,
            nonce: self.fresh_nonce(),
        };
        let pages = req.pages.len() as u32;
        let spec = Spec {
            transfer,
            tokens: req.tokens,
            pages,
            bytes: u64::from(pages) * self.layout.bytes_per_page_index(),
            buffers: self.layout.buffers(),
            digest,
            page_digests: req.page_digests,
            max_aux: self.max_aux,
            timeout: req.timeout,
            moved_from: Vec::new(),
        };
        let deadline = now + req.timeout;
        self.out.transmit.push_back(Frame::Reserve(Reserve {
            transfer_id: transfer.transfer_id,
            nonce: transfer.nonce,
            tokens: req.tokens,
            digest,
            page_digests: req.page_digests,
            deadline_ms: u32::try_from(req.timeout.as_millis()).unwrap_or(u32::MAX),
            pages: req.pages,
            access: req.access,
        }));
        self.timers.arm(deadline, transfer.transfer_id);
        self.transfers.insert(
            transfer.transfer_id,
            Transfer {
                spec,
                state: State::AwaitingCommit(AwaitingCommit { deadline }),
            },
        );
        Ok(transfer)
    }

    /// Refuses request `transfer_id` before reserving anything for it (this node's pool or
    /// context cannot hold it, or its engine cancelled it first): sends ABORT with nonce 0,
    /// `code` and `detail`, so the sender fails the request at once when its engine submits
    /// it, with this code, instead of waiting for a reservation that never comes (SPEC.md
    /// §5.1, "Refused before reservation"). Nothing is leased or fenced. Returns false, and
    /// sends nothing, if the id has an open reservation: end that one with
    /// [`ReceiverSession::abort`]. The sender's ABORT_ACK (nonce 0) is dropped on arrival.
    pub fn refuse(&mut self, transfer_id: TransferId, code: ErrorCode, detail: String) -> bool {
        if self.lost || self.transfers.contains_key(&transfer_id) {
            return false;
        }
        self.out.transmit.push_back(Frame::Abort(Abort {
            transfer: TransferRef {
                transfer_id,
                nonce: 0,
            },
            code,
            completed_pages: 0,
            detail,
        }));
        true
    }

    /// Aborts a transfer from the receiver side: fence first, then release, then ABORT.
    /// Returns false if the transfer is not open or is already failing.
    pub fn abort(&mut self, now: Instant, transfer_id: TransferId, code: ErrorCode) -> bool {
        let Some(t) = self.transfers.remove(&transfer_id) else {
            return false;
        };
        let (next, applied) = match t.state {
            s @ (State::AwaitingCommit(_)
            | State::Moving(_)
            | State::FencingForVerify(_)
            | State::Verifying(_)) => {
                let reason = FailureReason::LocalAbort { code };
                (
                    self.out.fail(
                        &t.spec,
                        s.pending(),
                        reason,
                        AfterFence::SendAbort(code),
                        now,
                    ),
                    true,
                )
            }
            other => (Next::Stay(other), false),
        };
        self.settle(t.spec, next);
        applied
    }

    fn settle(&mut self, spec: Spec, next: Next) {
        match next {
            Next::Stay(state) => {
                if let Some(d) = state.deadline() {
                    self.timers.arm(d, spec.transfer.transfer_id);
                }
                self.transfers
                    .insert(spec.transfer.transfer_id, Transfer { spec, state });
            }
            Next::Done(failure) => {
                if failure.is_none() {
                    self.out.stats.delivered += 1;
                }
                self.history.insert(
                    spec.transfer.transfer_id,
                    Finished::ended(spec.transfer.nonce, failure),
                );
            }
        }
    }

    /// Handles a frame from the peer. The error, if any, says how far its damage reaches;
    /// on [`crate::Scope::Connection`] the driver must close the connection.
    pub fn handle_frame(&mut self, now: Instant, frame: Frame) -> Result<(), FrameError> {
        if self.lost {
            self.out.stats.dropped_frames += 1;
            return Err(FrameError::frame("frame after the connection was lost"));
        }
        if matches!(frame, Frame::Ping(_) | Frame::Pong(_)) {
            return Err(FrameError::frame(
                "PING / PONG belong to the connection's Liveness, not to a session",
            ));
        }
        let Some(tref) = frame.transfer() else {
            return Err(FrameError::without_transfer(&frame));
        };
        if matches!(
            frame,
            Frame::Reserve(_) | Frame::Verified(_) | Frame::Nack(_)
        ) {
            return Err(FrameError::connection(format!(
                "{} is sent only by receivers",
                frame.frame_type()
            )));
        }
        if matches!(frame, Frame::AbortAck(_)) && tref.nonce == 0 {
            // The answer to a refusal (`refuse`): reservations never have nonce 0, so it
            // names no reservation, whatever is open for the id now (SPEC §5.1).
            return Ok(());
        }
        let Some(t) = self.transfers.remove(&tref.transfer_id) else {
            return self.handle_closed_transfer(frame, tref);
        };
        if let Frame::Abort(a) = &frame {
            let current = t.spec.transfer.nonce;
            if t.spec.moved_from.contains(&a.transfer.nonce) {
                // The sender gave up on a reservation this transfer moved from (it never saw
                // the new one in time): the transfer ends, answered with that reservation's
                // ref, which is the one the sender waits on (SPEC §9.2).
                self.out.transmit.push_back(Frame::AbortAck(a.transfer));
                let reason = FailureReason::PeerAbort {
                    code: a.code,
                    completed_pages: a.completed_pages,
                };
                let next = match t.state {
                    s @ (State::AwaitingCommit(_) | State::Moving(_)) => {
                        self.out
                            .fail(&t.spec, s.pending(), reason, AfterFence::Nothing, now)
                    }
                    other => Next::Stay(other),
                };
                self.settle(t.spec, next);
                return Ok(());
            }
            if a.transfer.nonce != current && a.transfer.nonce != 0 {
                // An ABORT for another (earlier) reservation of an open id: answered as for a
                // finished one (VERIFIED if the history says it verified, else ABORT_ACK);
                // the open reservation is unaffected (SPEC §7.3, §7.4).
                self.transfers.insert(tref.transfer_id, t);
                return self.handle_closed_transfer(frame, tref);
            }
        }
        let (next, spec, result) = t.on_frame(frame, now, &mut self.out);
        self.settle(spec, next);
        result
    }

    /// The transport reports the fence of a transfer complete.
    pub fn handle_fenced(&mut self, now: Instant, transfer: TransferRef) {
        let Some(t) = self.take_current(transfer) else {
            return;
        };
        let next = match t.state {
            State::FencingForVerify(f) => {
                self.out.actions.push_back(ReceiverAction::ComputeDigests {
                    transfer,
                    algorithm: t.spec.digest,
                    page_digests: !f.commit.page_digests.is_empty(),
                    aux: f.commit.aux.clone(),
                });
                Next::Stay(State::Verifying(Verifying { commit: f.commit }))
            }
            State::Failing(f) if f.awaiting == Awaiting::Fence => {
                self.out.after_fence(&t.spec, f.reason, f.after, now)
            }
            State::Moving(mut m) if !m.fenced => {
                // Nothing of the old reservation can land any more: a scope on a live lane.
                m.fenced = true;
                self.out.actions.push_back(ReceiverAction::Reopen(transfer));
                Next::Stay(State::Moving(m))
            }
            other => Next::Stay(other),
        };
        self.settle(t.spec, next);
    }

    /// The driver opened a new access scope over a moving transfer's pages on a live lane
    /// (its [`ReceiverAction::Reopen`]): `pages` are the reservation's pages in ordinal
    /// order, `access` the new scope's descriptor. The transfer is reserved again with a
    /// fresh nonce (RESERVE goes out) and waits for its COMMIT anew. Returns the new
    /// reservation's ref, or `None` when the transfer is no longer moving (it failed
    /// meanwhile: the driver closes the new scope).
    pub fn handle_reopened(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        pages: Vec<u32>,
        access: Vec<u8>,
    ) -> Option<TransferRef> {
        let ready = self.transfers.get(&transfer.transfer_id).is_some_and(|t| {
            t.spec.transfer == transfer
                && matches!(&t.state, State::Moving(m) if m.fenced)
                && pages.len() == t.spec.pages as usize
        });
        if !ready || access.len() > MAX_ACCESS {
            self.handle_reopen_failed(now, transfer);
            return None;
        }
        let mut spec = self.take_current(transfer)?.spec;
        spec.moved_from.push(transfer.nonce);
        spec.transfer.nonce = self.fresh_nonce();
        self.out.stats.moves += 1;
        self.out.transmit.push_back(Frame::Reserve(Reserve {
            transfer_id: spec.transfer.transfer_id,
            nonce: spec.transfer.nonce,
            tokens: spec.tokens,
            digest: spec.digest,
            page_digests: spec.page_digests,
            deadline_ms: u32::try_from(spec.timeout.as_millis()).unwrap_or(u32::MAX),
            pages,
            access,
        }));
        let moved = spec.transfer;
        let deadline = now + spec.timeout;
        self.settle(
            spec,
            Next::Stay(State::AwaitingCommit(AwaitingCommit { deadline })),
        );
        Some(moved)
    }

    /// The driver could not open a scope for a moving transfer (no live lane, a bind that
    /// failed): it fails as a transfer whose lane was lost, with ABORT(SHUTDOWN).
    pub fn handle_reopen_failed(&mut self, now: Instant, transfer: TransferRef) {
        let Some(t) = self.take_current(transfer) else {
            return;
        };
        let next = match t.state {
            s @ State::Moving(_) => self.out.fail(
                &t.spec,
                s.pending(),
                FailureReason::PeerLost,
                AfterFence::SendAbort(ErrorCode::SHUTDOWN),
                now,
            ),
            other => Next::Stay(other),
        };
        self.settle(t.spec, next);
    }

    /// The driver hands back the digests of the landed memory (and of the COMMIT's aux
    /// record), computed after the fence.
    pub fn handle_digests(&mut self, now: Instant, transfer: TransferRef, landed: TransferDigests) {
        let Some(t) = self.take_current(transfer) else {
            return;
        };
        let next = match t.state {
            State::Verifying(v) => match compare_digests(&t.spec, &v.commit, &landed) {
                Ok(()) => {
                    self.out
                        .events
                        .push_back(ReceiverEvent::Delivered(Delivery {
                            transfer,
                            tokens: t.spec.tokens,
                            pages: t.spec.pages,
                            bytes: t.spec.bytes,
                            aux: v.commit.aux,
                        }));
                    self.out.transmit.push_back(Frame::Verified(transfer));
                    Next::Done(None)
                }
                Err(reason) => self.refuse_verified(&t.spec, reason, now),
            },
            // Failed while the digests were computed: they no longer read the pages.
            State::Failing(f) if f.awaiting == Awaiting::Digests => {
                self.out.after_fence(&t.spec, f.reason, f.after, now)
            }
            other => Next::Stay(other),
        };
        self.settle(t.spec, next);
    }

    /// The driver found, instead of computing digests, that a reserved page did not receive
    /// all its bytes for this reservation (the transport's coverage check, SPEC.md §6): the
    /// transfer fails with `PAGES_MISSING` naming `first_missing` (a page ordinal), on the
    /// same path as a digest mismatch. Call it in place of
    /// [`ReceiverSession::handle_digests`] for the `ComputeDigests` it answers, once
    /// nothing reads the pages for it.
    pub fn handle_missing_pages(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        first_missing: u32,
    ) {
        let Some(t) = self.take_current(transfer) else {
            return;
        };
        let next = match t.state {
            State::Verifying(_) => {
                self.refuse_verified(&t.spec, FailureReason::PagesMissing { first_missing }, now)
            }
            State::Failing(f) if f.awaiting == Awaiting::Digests => {
                self.out.after_fence(&t.spec, f.reason, f.after, now)
            }
            other => Next::Stay(other),
        };
        self.settle(t.spec, next);
    }

    /// A fenced transfer whose landed memory does not verify: NACK, then quarantine,
    /// release and report (nothing reads the pages any more).
    fn refuse_verified(&mut self, spec: &Spec, reason: FailureReason, now: Instant) -> Next {
        let (buffer, page) = match &reason {
            FailureReason::DigestMismatch { buffer, page } => (*buffer, page.unwrap_or(NONE_INDEX)),
            FailureReason::PagesMissing { first_missing } => (NONE_INDEX, *first_missing),
            _ => (NONE_INDEX, NONE_INDEX),
        };
        self.out.transmit.push_back(Frame::Nack(Nack {
            transfer: spec.transfer,
            code: reason.code(),
            buffer,
            page,
            detail: reason.to_string(),
        }));
        self.out
            .fail(spec, Pending::Nothing, reason, AfterFence::Nothing, now)
    }

    fn take_current(&mut self, transfer: TransferRef) -> Option<Transfer> {
        match self.transfers.get(&transfer.transfer_id) {
            Some(t) if t.spec.transfer.nonce == transfer.nonce => {
                self.transfers.remove(&transfer.transfer_id)
            }
            _ => None,
        }
    }

    /// Handles the passage of time: expired waits fail their transfers.
    pub fn handle_timeout(&mut self, now: Instant) {
        let transfers = &self.transfers;
        let expired = self.timers.expired(now, |id| {
            transfers.get(&id).and_then(|t| t.state.deadline())
        });
        for id in expired {
            let Some(t) = self.transfers.remove(&id) else {
                continue;
            };
            let next = match t.state {
                s @ (State::AwaitingCommit(_) | State::Moving(_)) => self.out.fail(
                    &t.spec,
                    s.pending(),
                    FailureReason::Timeout {
                        waiting_for: Wait::Commit,
                    },
                    AfterFence::SendAbort(ErrorCode::TIMEOUT),
                    now,
                ),
                // The peer never acknowledged our abort; pages were released long ago.
                State::AwaitingAbortAck(s) => Next::Done(Some(s.outcome)),
                other => Next::Stay(other),
            };
            self.settle(t.spec, next);
        }
    }

    /// The connection is gone: every open transfer fails with [`FailureReason::PeerLost`],
    /// fencing first where writes could still land. No frames are sent.
    pub fn handle_peer_lost(&mut self, now: Instant) {
        self.lose(now, FailureReason::PeerLost);
    }

    /// The peer stopped answering heartbeats ([`crate::liveness::Liveness`]) and the driver
    /// closed the connection: as [`ReceiverSession::handle_peer_lost`], with
    /// [`FailureReason::PeerUnresponsive`].
    pub fn handle_peer_unresponsive(&mut self, now: Instant) {
        self.lose(now, FailureReason::PeerUnresponsive);
    }

    fn lose(&mut self, now: Instant, reason: FailureReason) {
        if self.lost {
            return;
        }
        self.lost = true;
        self.out.transmit.clear();
        let open = self.transfers.drain_in_order();
        for (_, t) in open {
            self.lose_one(now, t, &reason);
        }
        self.out.transmit.clear();
    }

    /// One transfer's path to the peer is gone (SPEC §9.2, several rails: the queue pair its
    /// reservation was bound on failed) while the connection goes on over its other lanes.
    /// With moves allowed ([`ReceiverSession::allow_moves`]) a transfer still awaiting its
    /// COMMIT moves: it is fenced (`Fence`), then the driver is asked to open a scope on a
    /// live lane (`Reopen`, answered by [`ReceiverSession::handle_reopened`]), and it is
    /// reserved again; one whose COMMIT came goes on (its writes landed before it). Without
    /// moves the transfer fails with [`FailureReason::PeerLost`], fenced first where writes
    /// could still land, then the peer is told with ABORT(SHUTDOWN) (sent on a live lane)
    /// and its ABORT_ACK awaited as for any abort. A transfer not open here, or already
    /// failing, is left alone. Whether the transfer was open here (a lane's failure names
    /// every transfer it carried, ended ones too).
    pub fn handle_transfer_lost(&mut self, now: Instant, transfer_id: TransferId) -> bool {
        if self.lost {
            return false;
        }
        let Some(t) = self.transfers.remove(&transfer_id) else {
            return false;
        };
        let next = match t.state {
            s @ (State::AwaitingAbortAck(_) | State::Failing(_) | State::Moving(_)) => {
                Next::Stay(s)
            }
            State::AwaitingCommit(s) if self.moves => {
                self.out.stats.fences += 1;
                self.out
                    .actions
                    .push_back(ReceiverAction::Fence(t.spec.transfer));
                Next::Stay(State::Moving(state::Moving {
                    deadline: s.deadline,
                    fenced: false,
                }))
            }
            s @ (State::FencingForVerify(_) | State::Verifying(_)) if self.moves => Next::Stay(s),
            s => self.out.fail(
                &t.spec,
                s.pending(),
                FailureReason::PeerLost,
                AfterFence::SendAbort(ErrorCode::SHUTDOWN),
                now,
            ),
        };
        self.settle(t.spec, next);
        true
    }

    fn lose_one(&mut self, now: Instant, t: Transfer, reason: &FailureReason) {
        let next = match t.state {
            State::AwaitingAbortAck(s) => Next::Done(Some(s.outcome)),
            State::Failing(mut f) => {
                f.after = AfterFence::Nothing;
                Next::Stay(State::Failing(f))
            }
            s => self.out.fail(
                &t.spec,
                s.pending(),
                reason.clone(),
                AfterFence::Nothing,
                now,
            ),
        };
        self.settle(t.spec, next);
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        self.out.transmit.pop_front()
    }

    /// The next effect for the driver.
    pub fn poll_action(&mut self) -> Option<ReceiverAction> {
        self.out.actions.pop_front()
    }

    /// The next event for the engine.
    pub fn poll_event(&mut self) -> Option<ReceiverEvent> {
        self.out.events.pop_front()
    }

    /// When [`ReceiverSession::handle_timeout`] must next be called.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        let transfers = &self.transfers;
        self.timers
            .next(|id| transfers.get(&id).and_then(|t| t.state.deadline()))
    }

    /// The digest algorithm of `transfer` (fixed when it was reserved), while it is open.
    pub fn digest_algorithm(&self, transfer: TransferRef) -> Option<DigestAlgorithm> {
        self.transfers
            .get(&transfer.transfer_id)
            .filter(|t| t.spec.transfer == transfer)
            .map(|t| t.spec.digest)
    }

    /// Open transfers (not yet delivered, failed, or acknowledged).
    pub fn open_transfers(&self) -> usize {
        self.transfers.len()
    }

    /// Counters.
    pub fn stats(&self) -> ReceiverStats {
        self.out.stats
    }

    /// The session's configuration.
    pub fn config(&self) -> &ReceiverConfig {
        &self.config
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Hello, Role};
    use std::time::Duration;

    fn session() -> ReceiverSession {
        let hello = |role| Hello {
            node_id: 1,
            role,
            layout: KvLayout {
                tokens_per_page: 16,
                buffer_page_bytes: vec![64],
                fingerprint: vec![],
            },
            digests: vec![DigestAlgorithm::XXH3_64],
            transport_params: vec![],
            max_aux: 0,
        };
        let est = Established {
            local: hello(Role::RECEIVER),
            peer: hello(Role::SENDER),
            digests: vec![DigestAlgorithm::XXH3_64],
        };
        ReceiverSession::new(&est, ReceiverConfig::default(), 1)
    }

    /// SPEC §7.3 (was Q15): a transfer that ends through AwaitingAbortAck is remembered with
    /// the reason it failed for (here TIMEOUT), not CANCELLED, however the abort resolves.
    #[test]
    fn an_abort_that_resolves_keeps_the_original_failure_in_the_history() {
        for resolve in 0..3 {
            let now = Instant::now();
            let mut r = session();
            let t = r
                .reserve(
                    now,
                    ReservationRequest {
                        transfer_id: TransferId(1),
                        tokens: 16,
                        pages: vec![0],
                        digest: None,
                        page_digests: false,
                        timeout: Duration::from_millis(10),
                        access: vec![],
                    },
                )
                .unwrap();
            let later = now + Duration::from_secs(1);
            r.handle_timeout(later);
            r.handle_fenced(later, t);
            match resolve {
                0 => r.handle_frame(later, Frame::AbortAck(t)).unwrap(),
                1 => r.handle_timeout(later + Duration::from_secs(60)),
                _ => r.handle_peer_lost(later),
            }
            assert_eq!(r.open_transfers(), 0);
            let code = r.history.get(TransferId(1)).and_then(|f| f.failure.clone());
            assert_eq!(
                code.map(|c| c.0),
                Some(ErrorCode::TIMEOUT),
                "resolve {resolve}"
            );
        }
    }
}
