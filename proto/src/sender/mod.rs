//! The sender (prefill side): answers reservations, posts writes, commits (SPEC.md §5.3).
//!
//! ```text
//!  submit(Admitted) ─▶ AwaitingReservation ──RESERVE ok──▶ Writing ──all written + digests──▶ AwaitingVerdict
//!        │ RESERVE mismatch: REJECT                  │ write failed / ABORT / timeout / abort()     │ VERIFIED | NACK | ABORT
//!        ▼                                           ▼                                              ▼
//!   failed (source released)              Draining (cancel unposted, wait for posted) ─▶ ABORT | ABORT_ACK ─▶ done
//!  (RDMA, several lanes: a lane that fails, or the receiver's RESERVE moving the transfer,
//!   drains it, then Writing again under the new reservation; AwaitingMove until it comes.)
//!  retire(Rejected) ─▶ any RESERVE for it gets REJECT with the original error; nothing else happens.
//! ```
//!
//! A request's pages may come whole ([`SenderSession::submit`]) or in chunks as chunked
//! prefill produces them ([`SenderSession::open`], then [`SenderSession::submit_chunk`]);
//! once the reservation is accepted every chunk is written and digested as it comes, and the
//! COMMIT, with the auxiliary record of the final chunk, goes once all have completed.
//!
//! Source pages are released only once every posted write has completed or failed and every
//! digest job has returned, since a transport or a digest may still be reading them.

mod closed;
mod state;
mod submit;
mod transfer;
mod types;

use crate::wire::TransferId;
use std::collections::BTreeMap;
use std::time::Instant;

use crate::admission::Rejected;
use crate::error::{FailureReason, Wait};
use crate::handshake::Established;
use crate::history::{Finished, History};
use crate::open::OpenTransfers;
use crate::scope::FrameError;
use crate::timers::Timers;
use crate::wire::{DigestAlgorithm, ErrorCode, Frame, Reserve, TransferDigests, TransferRef};
use state::{unconfirmed_if, AfterDrain, State};
use transfer::{Ctx, Next, Out, Transfer};

pub use types::{
    ChunkError, PageWrite, RetireError, SenderAction, SenderConfig, SenderEvent, SenderStats,
    SubmitError, WriteOutcome,
};

/// The sender side of one connection: all its transfers.
#[derive(Clone, Debug)]
pub struct SenderSession {
    digests: Vec<DigestAlgorithm>,
    bytes_per_page_index: u64,
    buffers: usize,
    tokens_per_page: u32,
    /// The receiver's `max_aux` (its hello): the longest aux record it accepts.
    peer_max_aux: u32,
    /// The receiver's page slots per buffer, when its transport advertised them.
    destination_pages: Option<u32>,
    config: SenderConfig,
    transfers: OpenTransfers<Transfer>,
    /// Reservations naming no known request, held briefly (the request may be on its way).
    /// Each with its park deadline and the instant it was received.
    parked: BTreeMap<TransferId, (Reserve, Instant, Instant)>,
    history: History,
    timers: Timers,
    out: Out,
    lost: bool,
    /// Whether transfers move off failed lanes (SPEC §9.2).
    moves: bool,
}

impl SenderSession {
    /// A session over an established connection on which this node is the sender.
    pub fn new(established: &Established, config: SenderConfig) -> Self {
        Self {
            digests: established.digests.clone(),
            bytes_per_page_index: established.layout().bytes_per_page_index(),
            buffers: established.layout().buffers(),
            tokens_per_page: established.layout().tokens_per_page,
            peer_max_aux: established.peer.max_aux,
            destination_pages: None,
            history: History::new(config.history),
            config,
            transfers: OpenTransfers::default(),
            parked: BTreeMap::new(),
            timers: Timers::default(),
            out: Out::default(),
            lost: false,
            moves: false,
        }
    }

    /// Moves a transfer off a failed lane instead of failing it (SPEC §9.2, moving a
    /// transfer): a RESERVE with a new nonce for a transfer being written or committed
    /// replaces its reservation (the writes are drained, then every page is written again
    /// under the new one), and a transfer whose lane fails here waits for that RESERVE. The
    /// driver of a connection whose lanes can fail one by one (several RDMA queue pairs)
    /// turns it on; the receiver must too.
    pub fn allow_moves(&mut self) {
        self.moves = true;
    }

    fn ctx(&mut self, now: Instant) -> Ctx<'_> {
        Ctx {
            out: &mut self.out,
            config: &self.config,
            digests: &self.digests,
            bytes_per_page_index: self.bytes_per_page_index,
            buffers: self.buffers,
            peer_max_aux: self.peer_max_aux,
            destination_pages: self.destination_pages,
            now,
            reserve_received: now,
            moves: self.moves,
        }
    }

    fn settle(&mut self, t: Transfer, next: Next) {
        let id = t.transfer.transfer_id;
        match next {
            Next::Move(r, received) => {
                // The receiver's new reservation, taken as a fresh one (SPEC §9.2).
                let mut t = t;
                // Its writes deadline counts from its receipt, as for any RESERVE.
                let mut cx = self.ctx(received);
                let (next, _) = cx.accept_reservation(&mut t, *r);
                self.settle(t, next);
            }
            Next::Stay(state) => {
                let deadline = state.deadline();
                if let Some(d) = deadline.filter(|&d| t.armed != Some(d)) {
                    self.timers.arm(d, id);
                }
                self.transfers.insert(
                    id,
                    Transfer {
                        state,
                        armed: deadline,
                        ..t
                    },
                );
            }
            Next::Done(failure) => self
                .history
                .insert(id, Finished::ended(t.transfer.nonce, failure)),
        }
    }

    /// Bounds the destination page indices a reservation may name: the receiver has `pages`
    /// page slots per buffer, as its transport advertised them (SPEC.md §5.3.1 #7; TCP:
    /// the transport parameters of §9.1). A RESERVE naming a page index `>= pages` is then
    /// refused with BAD_RESERVATION before anything is written. Without a bound (the
    /// default) the range is left to the transport's access check.
    pub fn limit_destination_pages(&mut self, pages: u32) {
        self.destination_pages = Some(pages);
    }

    /// Retires a rejected request: any reservation for it (already parked or still to come)
    /// is answered with REJECT carrying the original error. Nothing is allocated or sent
    /// otherwise. Refused, changing nothing, if a transfer with the id is open (SPEC.md
    /// §5.1): a rejection never rewrites the record of a transfer under way.
    pub fn retire(&mut self, rejected: Rejected) -> Result<(), RetireError> {
        let id = rejected.transfer_id;
        if self.transfers.contains_key(&id) {
            return Err(RetireError::Open(rejected));
        }
        let code = rejected.error.code();
        let detail = rejected.error.to_string();
        self.history
            .insert(id, Finished::ended(0, Some((code, detail.clone()))));
        if let Some((r, _, _)) = self.parked.remove(&id) {
            self.reject_reservation(&r, code, detail);
        }
        Ok(())
    }

    /// Aborts a transfer from the sender side: stop posting, drain, then ABORT with the
    /// count of completed pages. Returns false if the transfer is not open or already ending.
    pub fn abort(&mut self, now: Instant, transfer_id: TransferId, code: ErrorCode) -> bool {
        let Some(mut t) = self.transfers.remove(&transfer_id) else {
            return false;
        };
        let state = t.take_state(now);
        let reason = FailureReason::LocalAbort { code };
        let mut cx = self.ctx(now);
        let (next, applied) = match state {
            State::AwaitingReservation(_) => (Next::Done(Some(cx.failed(&t, reason))), true),
            State::Writing(w) => (cx.drain(&t, w, reason, AfterDrain::SendAbort(code)), true),
            State::AwaitingVerdict(_) => (
                cx.abandon_committed(&t, reason, AfterDrain::SendAbort(code)),
                true,
            ),
            State::AwaitingMove(m) => (cx.abandon_move(&t, m, code, reason), true),
            other => (Next::Stay(other), false),
        };
        self.settle(t, next);
        applied
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
        if matches!(frame, Frame::Commit(_) | Frame::Reject(_)) {
            return Err(FrameError::connection(format!(
                "{} is sent only by senders",
                frame.frame_type()
            )));
        }
        let Some(t) = self.transfers.remove(&tref.transfer_id) else {
            return self.handle_closed_transfer(now, frame, tref);
        };
        let mut cx = self.ctx(now);
        let (next, t, result) = t.on_frame(frame, &mut cx);
        self.settle(t, next);
        result
    }

    /// The transport reports how `pages` page writes of a transfer ended.
    pub fn handle_write_outcome(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        outcome: WriteOutcome,
        pages: u32,
    ) {
        let Some(mut t) = self.take_current(transfer) else {
            return;
        };
        let state = t.take_state(now);
        let mut cx = self.ctx(now);
        let next = match (state, outcome) {
            (State::Writing(mut w), WriteOutcome::Completed) => {
                w.completed = w.completed.saturating_add(pages).min(w.posted);
                cx.maybe_commit(&t, w)
            }
            (State::Writing(w), WriteOutcome::Failed | WriteOutcome::Cancelled) => {
                let after = AfterDrain::SendAbort(ErrorCode::WRITE_FAILED);
                let d = cx.drain(&t, w, FailureReason::WriteFailed, after);
                match d {
                    Next::Stay(State::Draining(mut d)) => {
                        d.accounted = d.accounted.saturating_add(pages).min(d.posted);
                        cx.finish_drain(&t, d)
                    }
                    other => other,
                }
            }
            (State::Draining(mut d), outcome) => {
                // Capped at the pages posted (SPEC §5.3.3): a driver that over-reports
                // cannot make ABORT's `completed_pages` exceed them.
                if outcome == WriteOutcome::Completed {
                    d.completed = d.completed.saturating_add(pages).min(d.posted);
                }
                d.accounted = d.accounted.saturating_add(pages).min(d.posted);
                cx.finish_drain(&t, d)
            }
            (other, _) => Next::Stay(other),
        };
        self.settle(t, next);
    }

    /// The driver hands back the source digests: the final chunk's digest job has
    /// returned, with the digests of the whole transfer and of its aux record.
    pub fn handle_digests(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        digests: TransferDigests,
    ) {
        self.digest_job_returned(now, transfer, Some(digests));
    }

    /// A non-final chunk's digest job has returned: it no longer reads the source (its
    /// progress stays in the driver's streaming digest state for the next job).
    pub fn handle_chunk_digested(&mut self, now: Instant, transfer: TransferRef) {
        self.digest_job_returned(now, transfer, None);
    }

    fn digest_job_returned(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        digests: Option<TransferDigests>,
    ) {
        let Some(mut t) = self.take_current(transfer) else {
            return;
        };
        let state = t.take_state(now);
        let mut cx = self.ctx(now);
        let next = match state {
            State::Writing(mut w) => {
                w.digest_jobs = w.digest_jobs.saturating_sub(1);
                if digests.is_some() {
                    w.digests = digests;
                }
                cx.maybe_commit(&t, w)
            }
            // Abandoned while digests were computed: this job no longer reads the source.
            State::Draining(mut d) => {
                d.digest_jobs = d.digest_jobs.saturating_sub(1);
                cx.finish_drain(&t, d)
            }
            other => Next::Stay(other),
        };
        self.settle(t, next);
    }

    fn take_current(&mut self, transfer: TransferRef) -> Option<Transfer> {
        match self.transfers.get(&transfer.transfer_id) {
            Some(t) if t.transfer.nonce == transfer.nonce => {
                self.transfers.remove(&transfer.transfer_id)
            }
            _ => None,
        }
    }

    /// Handles the passage of time.
    pub fn handle_timeout(&mut self, now: Instant) {
        let (transfers, parked) = (&self.transfers, &self.parked);
        let expired = self.timers.expired(now, |id| {
            transfers
                .get(&id)
                .and_then(|t| t.state.deadline())
                .or_else(|| parked.get(&id).map(|p| p.1))
        });
        for id in expired {
            if let Some((r, _, _)) = self.parked.remove(&id) {
                self.reject_reservation(
                    &r,
                    ErrorCode::UNKNOWN_REQUEST,
                    "no such request on this sender".into(),
                );
                continue;
            }
            let Some(mut t) = self.transfers.remove(&id) else {
                continue;
            };
            // Its timer entry has just been taken out of the heap.
            t.armed = None;
            let state = t.take_state(now);
            let mut cx = self.ctx(now);
            let timeout = |waiting_for| FailureReason::Timeout { waiting_for };
            let next = match state {
                State::AwaitingReservation(_) => {
                    Next::Done(Some(cx.failed(&t, timeout(Wait::Reservation))))
                }
                State::Writing(w) => cx.drain(
                    &t,
                    w,
                    timeout(Wait::Writes),
                    AfterDrain::SendAbort(ErrorCode::TIMEOUT),
                ),
                State::AwaitingVerdict(_) => cx.abandon_committed(
                    &t,
                    timeout(Wait::Verdict),
                    AfterDrain::SendAbort(ErrorCode::TIMEOUT),
                ),
                // The receiver never moved the transfer off the failed lane.
                State::AwaitingMove(m) => {
                    cx.abandon_move(&t, m, ErrorCode::SHUTDOWN, FailureReason::PeerLost)
                }
                // The peer never answered our ABORT: report why we abandoned the transfer
                // (unconfirmed if the COMMIT had gone: the receiver may have delivered).
                State::AwaitingAbortAck(s) => {
                    Next::Done(Some(cx.report_failure(&t, s.unanswered())))
                }
                other => Next::Stay(other),
            };
            self.settle(t, next);
        }
    }

    /// The connection is gone: stop every transfer; each fails with
    /// [`FailureReason::PeerLost`] once its posted writes are drained ([`FailureReason::
    /// Unconfirmed`] around it where the COMMIT was sent and no verdict came back).
    pub fn handle_peer_lost(&mut self, now: Instant) {
        self.lose(now, FailureReason::PeerLost);
    }

    /// The peer stopped answering heartbeats ([`crate::liveness::Liveness`]) and the driver
    /// closed the connection: as [`SenderSession::handle_peer_lost`], with
    /// [`FailureReason::PeerUnresponsive`].
    pub fn handle_peer_unresponsive(&mut self, now: Instant) {
        self.lose(now, FailureReason::PeerUnresponsive);
    }

    fn lose(&mut self, now: Instant, reason: FailureReason) {
        if self.lost {
            return;
        }
        self.lost = true;
        self.parked.clear();
        let open = self.transfers.drain_in_order();
        for (_, t) in open {
            self.lose_one(now, t, &reason);
        }
        self.out.transmit.clear();
    }

    /// One transfer's path to the peer is gone (SPEC §9.2, several rails: the queue pair it
    /// was bound to failed) while the connection goes on over its other lanes. With moves
    /// allowed ([`SenderSession::allow_moves`]) a transfer being written or committed is
    /// drained and then waits, its source held, for the receiver's RESERVE moving it to a
    /// live lane (AwaitingMove; at its verdict timeout it gives up as below). Without moves
    /// it is abandoned with [`FailureReason::PeerLost`] and the peer told with
    /// ABORT(SHUTDOWN) (sent on a live lane): once its posted writes are drained, as for any
    /// abort; a committed one waits for the answer (VERIFIED: delivered after all;
    /// ABORT_ACK: a definite failure; neither within the abort-ack deadline: `Unconfirmed`).
    /// A transfer not open here, or already stopping, is left alone. Whether the transfer was
    /// open here (a lane's failure names every transfer it carried, ended ones too).
    pub fn handle_transfer_lost(&mut self, now: Instant, transfer_id: TransferId) -> bool {
        if self.lost {
            return false;
        }
        let Some(mut t) = self.transfers.remove(&transfer_id) else {
            return false;
        };
        let state = t.take_state(now);
        let after = if self.moves {
            AfterDrain::AwaitMove
        } else {
            AfterDrain::SendAbort(ErrorCode::SHUTDOWN)
        };
        let mut cx = self.ctx(now);
        let next = match state {
            State::Writing(w) => cx.drain(&t, w, FailureReason::PeerLost, after),
            State::AwaitingVerdict(_) => cx.abandon_committed(&t, FailureReason::PeerLost, after),
            other => Next::Stay(other),
        };
        self.settle(t, next);
        true
    }

    fn lose_one(&mut self, now: Instant, mut t: Transfer, reason: &FailureReason) {
        let state = t.take_state(now);
        let mut cx = self.ctx(now);
        let next = match state {
            State::Writing(w) => cx.drain(&t, w, reason.clone(), AfterDrain::Nothing),
            State::Draining(mut d) => {
                d.after = AfterDrain::Nothing;
                Next::Stay(State::Draining(d))
            }
            State::AwaitingAbortAck(s) => Next::Done(Some(cx.report_failure(&t, s.unanswered()))),
            State::AwaitingMove(m) => Next::Done(Some(
                cx.failed(&t, unconfirmed_if(m.committed, reason.clone())),
            )),
            State::AwaitingReservation(_) => Next::Done(Some(cx.failed(&t, reason.clone()))),
            // The COMMIT is out and no verdict came back: the receiver may have delivered.
            State::AwaitingVerdict(_) => Next::Done(Some(cx.failed(
                &t,
                FailureReason::Unconfirmed {
                    cause: Box::new(reason.clone()),
                },
            ))),
        };
        self.settle(t, next);
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        if self.lost {
            self.out.transmit.clear();
        }
        self.out.transmit.pop_front()
    }

    /// The next effect for the driver.
    pub fn poll_action(&mut self) -> Option<SenderAction> {
        self.out.actions.pop_front()
    }

    /// The next event for the engine.
    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.out.events.pop_front()
    }

    /// When [`SenderSession::handle_timeout`] must next be called.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        let (transfers, parked) = (&self.transfers, &self.parked);
        self.timers.next(|id| {
            transfers
                .get(&id)
                .and_then(|t| t.state.deadline())
                .or_else(|| parked.get(&id).map(|p| p.1))
        })
    }

    /// Open transfers.
    pub fn open_transfers(&self) -> usize {
        self.transfers.len()
    }

    /// The reservation an open transfer is served under (nonce 0 before one was accepted);
    /// `None` when no transfer with the id is open.
    pub fn transfer_ref(&self, transfer_id: TransferId) -> Option<TransferRef> {
        self.transfers.get(&transfer_id).map(|t| t.transfer)
    }

    /// Counters.
    pub fn stats(&self) -> SenderStats {
        self.out.stats
    }
}
