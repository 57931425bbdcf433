//! One sender transfer and its transitions: the frames it accepts in each state, and the
//! helpers that drain, commit, release the source and report the outcome.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::state::{
    unconfirmed_if, AfterDrain, AwaitingAbortAck, AwaitingMove, AwaitingReservation,
    AwaitingVerdict, Draining, Reserved, State, Writing,
};
use super::{PageWrite, SenderAction, SenderConfig, SenderEvent, SenderStats};
use crate::admission::Admitted;
use crate::error::{unexpected, FailureReason};
use crate::scope::FrameError;
use crate::wire::{
    Abort, Commit, DigestAlgorithm, ErrorCode, Frame, FrameType, Reject, Reserve, TransferRef,
    NONE_INDEX,
};

#[derive(Debug)]
pub(super) struct Transfer {
    pub(super) admitted: Admitted,
    /// Source pages submitted so far, in ordinal order (all of them once the final chunk
    /// came).
    pub(super) source: Vec<u32>,
    /// The auxiliary record: `Some` (possibly empty) once the final chunk came.
    pub(super) aux: Option<Vec<u8>>,
    /// Nonce 0 until a reservation is accepted.
    pub(super) transfer: TransferRef,
    pub(super) state: State,
    /// The deadline last armed in the session's timers for this transfer, while that entry
    /// is still there: settling with the same deadline again arms nothing.
    pub(super) armed: Option<Instant>,
    /// Reservations of this transfer moved off failed lanes (SPEC §9.2), at most
    /// [`MAX_MOVES`].
    pub(super) moves: u32,
}

/// The most times one transfer is moved to another lane; a RESERVE moving it again is
/// refused as a second reservation (DUPLICATE_TRANSFER).
pub(super) const MAX_MOVES: u32 = 16;

impl Clone for Transfer {
    fn clone(&self) -> Self {
        Self {
            admitted: self.admitted.duplicate(),
            source: self.source.clone(),
            aux: self.aux.clone(),
            transfer: self.transfer,
            state: self.state.clone(),
            armed: self.armed,
            moves: self.moves,
        }
    }
}

impl Transfer {
    /// Whether every source page (and the aux record) has been submitted.
    pub(super) fn has_final_chunk(&self) -> bool {
        self.aux.is_some()
    }
}

pub(super) enum Next {
    Stay(State),
    Done(Option<(ErrorCode, String)>),
    /// The transfer is drained and moves (SPEC §9.2): take this reservation, received then,
    /// as a fresh one (the session does, with the transfer in hand).
    Move(Box<Reserve>, Instant),
}

#[derive(Clone, Debug, Default)]
pub(super) struct Out {
    pub(super) transmit: VecDeque<Frame>,
    pub(super) actions: VecDeque<SenderAction>,
    pub(super) events: VecDeque<SenderEvent>,
    pub(super) stats: SenderStats,
}

impl Out {
    /// Refuses reservation `r` with REJECT (its own ref, `code`, `detail`).
    pub(super) fn reject(&mut self, r: &Reserve, code: ErrorCode, detail: String) {
        self.stats.rejected_reservations += 1;
        self.transmit.push_back(Frame::Reject(Reject {
            transfer: TransferRef {
                transfer_id: r.transfer_id,
                nonce: r.nonce,
            },
            code,
            detail,
        }));
    }
}

pub(super) struct Ctx<'a> {
    pub(super) out: &'a mut Out,
    pub(super) config: &'a SenderConfig,
    pub(super) digests: &'a [DigestAlgorithm],
    pub(super) bytes_per_page_index: u64,
    pub(super) buffers: usize,
    /// The receiver's `max_aux`: the longest aux record it accepts.
    pub(super) peer_max_aux: u32,
    /// The receiver's page slots per buffer, when advertised (SPEC §5.3.1 #7).
    pub(super) destination_pages: Option<u32>,
    pub(super) now: Instant,
    /// When the RESERVE being handled was received: `now`, or earlier for a parked one.
    /// Its `deadline_ms` counts from here (SPEC §5.1, §8.1).
    pub(super) reserve_received: Instant,
    /// Whether transfers move off failed lanes (SPEC §9.2).
    pub(super) moves: bool,
}

impl Ctx<'_> {
    /// The transfer is over with a failure: release the source (nothing reads it any more)
    /// and report the failure.
    pub(super) fn failed(&mut self, t: &Transfer, reason: FailureReason) -> (ErrorCode, String) {
        self.release_source(t);
        self.report_failure(t, reason)
    }

    /// No transport or digest job reads the source any more: it may be reused.
    fn release_source(&mut self, t: &Transfer) {
        self.out
            .actions
            .push_back(SenderAction::ReleaseSource(t.transfer.transfer_id));
    }

    /// Tells the engine the transfer failed.
    pub(super) fn report_failure(
        &mut self,
        t: &Transfer,
        reason: FailureReason,
    ) -> (ErrorCode, String) {
        let r = (reason.code(), reason.to_string());
        self.out.stats.failed += 1;
        self.out.events.push_back(SenderEvent::Failed {
            transfer: t.transfer,
            reason,
        });
        r
    }

    /// Tells the engine the receiver verified the transfer.
    fn report_verified(&mut self, t: &Transfer) {
        self.out.stats.verified += 1;
        self.out.events.push_back(SenderEvent::Verified(t.transfer));
    }

    /// Abandons a transfer that may have writes posted and digest jobs running: cancel
    /// unposted writes, then wait for the posted ones and for the digest jobs.
    pub(super) fn drain(
        &mut self,
        t: &Transfer,
        w: Writing,
        reason: FailureReason,
        after: AfterDrain,
    ) -> Next {
        self.out
            .actions
            .push_back(SenderAction::CancelWrites(t.transfer));
        let d = Draining {
            completed: w.completed,
            accounted: w.completed,
            posted: w.posted,
            digest_jobs: w.digest_jobs,
            reason,
            after,
            committed: false,
        };
        self.finish_drain(t, d)
    }

    /// Abandons a committed transfer: every write completed and every digest job returned,
    /// so nothing reads the source any more.
    pub(super) fn abandon_committed(
        &mut self,
        t: &Transfer,
        reason: FailureReason,
        after: AfterDrain,
    ) -> Next {
        let pages = t.admitted.pages();
        let d = Draining {
            completed: pages,
            accounted: pages,
            posted: pages,
            digest_jobs: 0,
            reason,
            after,
            committed: true,
        };
        self.finish_drain(t, d)
    }

    /// If every posted write is accounted for and no digest job reads the source, finish
    /// the abandoned transfer (only now may the source pages be released).
    pub(super) fn finish_drain(&mut self, t: &Transfer, d: Draining) -> Next {
        if d.accounted < d.posted || d.digest_jobs > 0 {
            return Next::Stay(State::Draining(d));
        }
        match d.after {
            AfterDrain::SendAbort(code) => {
                // The source is free now; the outcome waits for the abort to resolve: the
                // receiver may answer VERIFIED if it had already delivered (SPEC §5.3.3).
                self.release_source(t);
                self.out.transmit.push_back(Frame::Abort(Abort {
                    transfer: t.transfer,
                    code,
                    completed_pages: d.completed,
                    detail: d.reason.to_string(),
                }));
                Next::Stay(State::AwaitingAbortAck(AwaitingAbortAck {
                    deadline: self.now + self.config.abort_ack_timeout,
                    reason: d.reason,
                    committed: d.committed,
                }))
            }
            AfterDrain::SendAbortAck => {
                let done = self.failed(t, d.reason);
                self.out.transmit.push_back(Frame::AbortAck(t.transfer));
                Next::Done(Some(done))
            }
            AfterDrain::Nothing => {
                Next::Done(Some(self.failed(t, unconfirmed_if(d.committed, d.reason))))
            }
            // The source stays held: it is written again once the receiver moved the transfer.
            AfterDrain::AwaitMove => Next::Stay(State::AwaitingMove(AwaitingMove {
                deadline: self.now + self.config.verdict_timeout,
                committed: d.committed,
            })),
            AfterDrain::Move(r, received) => Next::Move(r, received),
        }
    }

    /// Gives up on a transfer whose move never came (its deadline): the source is free (its
    /// writes were drained), the receiver is told ABORT(SHUTDOWN) as for a transfer whose
    /// lane was lost, and its answer awaited.
    pub(super) fn abandon_move(
        &mut self,
        t: &Transfer,
        m: AwaitingMove,
        code: ErrorCode,
        reason: FailureReason,
    ) -> Next {
        self.release_source(t);
        self.out.transmit.push_back(Frame::Abort(Abort {
            transfer: t.transfer,
            code,
            completed_pages: 0,
            detail: reason.to_string(),
        }));
        Next::Stay(State::AwaitingAbortAck(AwaitingAbortAck {
            deadline: self.now + self.config.abort_ack_timeout,
            reason,
            committed: m.committed,
        }))
    }

    /// Takes a reservation for a transfer awaiting one (its first, or the one it moves to):
    /// the checks of SPEC §5.3.1, then Writing with every submitted page posted; or REJECT
    /// and the transfer's end.
    pub(super) fn accept_reservation(
        &mut self,
        t: &mut Transfer,
        r: Reserve,
    ) -> (Next, Result<(), FrameError>) {
        match self.check_reservation(t, &r) {
            Err((code, detail)) => {
                self.out.reject(&r, code, detail.clone());
                t.transfer.nonce = r.nonce;
                let done = self.failed(
                    t,
                    FailureReason::ReservationRefused {
                        code,
                        detail: detail.clone(),
                    },
                );
                (Next::Done(Some(done)), Err(FrameError::transfer(detail)))
            }
            Ok(()) => {
                t.transfer.nonce = r.nonce;
                let deadline =
                    self.reserve_received + Duration::from_millis(u64::from(r.deadline_ms));
                let mut w = Writing {
                    deadline,
                    reserved: Reserved {
                        digest: r.digest,
                        page_digests: r.page_digests,
                        pages: r.pages,
                        access: r.access,
                    },
                    posted: 0,
                    completed: 0,
                    digest_jobs: 0,
                    digests: None,
                };
                self.post_available(t, &mut w);
                (Next::Stay(State::Writing(w)), Ok(()))
            }
        }
    }

    /// Checks a reservation against the admitted request.
    fn check_reservation(&self, t: &Transfer, r: &Reserve) -> Result<(), (ErrorCode, String)> {
        if r.nonce == 0 {
            return Err((ErrorCode::BAD_RESERVATION, "nonce 0 is reserved".into()));
        }
        if r.tokens != t.admitted.tokens() {
            return Err((
                ErrorCode::TOKEN_COUNT_MISMATCH,
                format!(
                    "reservation for {} tokens, request has {}",
                    r.tokens,
                    t.admitted.tokens()
                ),
            ));
        }
        if r.pages.len() as u64 != u64::from(t.admitted.pages()) {
            return Err((
                ErrorCode::PAGE_COUNT_MISMATCH,
                format!(
                    "reservation of {} pages, request needs {}",
                    r.pages.len(),
                    t.admitted.pages()
                ),
            ));
        }
        if !self.digests.contains(&r.digest) {
            return Err((
                ErrorCode::DIGEST_UNSUPPORTED,
                format!("digest {} not agreed", r.digest),
            ));
        }
        let max_aux = self.peer_max_aux as usize;
        if !crate::wire::commit_fits(self.buffers, r.pages.len(), r.page_digests, max_aux) {
            return Err((
                ErrorCode::BAD_RESERVATION,
                format!(
                    "a COMMIT for {} pages (page digests: {}) with an aux record of up to {max_aux} bytes would exceed the frame limit",
                    r.pages.len(),
                    r.page_digests
                ),
            ));
        }
        let mut sorted = r.pages.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err((
                ErrorCode::BAD_RESERVATION,
                format!("page {} reserved twice", w[0]),
            ));
        }
        if let Some(limit) = self.destination_pages {
            // The first such page in the reservation's order (SPEC §5.3.1 #7).
            if let Some((ordinal, page)) = r.pages.iter().enumerate().find(|(_, &p)| p >= limit) {
                return Err((
                    ErrorCode::BAD_RESERVATION,
                    format!(
                        "page index {page} (ordinal {ordinal}) is beyond the receiver's advertised {limit} pages (0..{limit})"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Emits the writes and the digest job of every source page submitted and not yet
    /// posted (one chunk, or all chunks that came before the reservation).
    pub(super) fn post_available(&mut self, t: &Transfer, w: &mut Writing) {
        let from = w.posted;
        let to = t.source.len() as u32;
        if to <= from {
            return;
        }
        let aux = if to == t.admitted.pages() {
            t.aux.clone()
        } else {
            None
        };
        self.out.actions.push_back(SenderAction::ComputeDigests {
            transfer: t.transfer,
            algorithm: w.reserved.digest,
            page_digests: w.reserved.page_digests,
            first: from,
            pages: to - from,
            aux,
        });
        let writes = (from..to)
            .map(|ordinal| PageWrite {
                ordinal,
                src_page: t.source[ordinal as usize],
                dst_page: w.reserved.pages[ordinal as usize],
            })
            .collect();
        self.out.actions.push_back(SenderAction::PostWrites {
            transfer: t.transfer,
            writes,
            access: w.reserved.access.clone(),
        });
        w.posted = to;
        w.digest_jobs += 1;
    }

    /// Commits if every write completed and every digest job returned, the final one with
    /// the transfer's digests.
    pub(super) fn maybe_commit(&mut self, t: &Transfer, w: Writing) -> Next {
        let pages = t.admitted.pages();
        if w.completed < pages || w.digest_jobs > 0 || w.digests.is_none() {
            return Next::Stay(State::Writing(w));
        }
        let digests = w.digests.unwrap_or_default();
        self.out.transmit.push_back(Frame::Commit(Commit {
            transfer: t.transfer,
            tokens: t.admitted.tokens(),
            pages,
            bytes: u64::from(pages) * self.bytes_per_page_index,
            digest: w.reserved.digest,
            buffer_digests: digests.buffers,
            page_digests: digests.pages,
            aux_digest: digests.aux,
            aux: t.aux.clone().unwrap_or_default(),
        }));
        Next::Stay(State::AwaitingVerdict(AwaitingVerdict {
            deadline: self.now + self.config.verdict_timeout,
        }))
    }
}

/// What a transfer accepts while Writing (before its COMMIT): a VERIFIED then is a violation,
/// and its error lists these, not VERIFIED.
const WRITING_ACCEPTS: &[FrameType] = &[FrameType::NACK, FrameType::ABORT];

const SENDER_ACCEPTS: &[FrameType] = &[
    FrameType::RESERVE,
    FrameType::VERIFIED,
    FrameType::NACK,
    FrameType::ABORT,
    FrameType::ABORT_ACK,
];

/// Whether a RESERVE with another nonce moves a transfer in `state` (SPEC §9.2): one whose
/// writes or COMMIT went under its reservation, or that awaits a move; not one ending.
fn state_moves(state: &State) -> bool {
    match state {
        State::Writing(_) | State::AwaitingVerdict(_) | State::AwaitingMove(_) => true,
        State::Draining(d) => d.after.moves(),
        State::AwaitingReservation(_) | State::AwaitingAbortAck(_) => false,
    }
}

impl Transfer {
    /// Takes the state out for a consuming transition. Every caller hands the transfer to
    /// `settle` afterwards with the next state (or ends it), so the placeholder left here is
    /// never observed.
    pub(super) fn take_state(&mut self, now: Instant) -> State {
        std::mem::replace(
            &mut self.state,
            State::AwaitingReservation(AwaitingReservation { deadline: now }),
        )
    }

    pub(super) fn on_frame(
        mut self,
        frame: Frame,
        cx: &mut Ctx<'_>,
    ) -> (Next, Self, Result<(), FrameError>) {
        let name = self.state.name();
        let current = self.transfer.nonce;
        let matches = |t: TransferRef| t.nonce == current || (t.nonce == 0 && current == 0);
        let state = self.take_state(cx.now);
        let (next, result) = match (state, frame) {
            (State::AwaitingReservation(_), Frame::Reserve(r)) => {
                cx.accept_reservation(&mut self, r)
            }
            (state, Frame::Reserve(r)) if r.nonce == current => {
                // The same reservation again (a duplicated frame): idempotent.
                cx.out.stats.dropped_frames += 1;
                (
                    Next::Stay(state),
                    Err(FrameError::frame("duplicate RESERVE")),
                )
            }
            (state, Frame::Reserve(r))
                if cx.moves && self.moves < MAX_MOVES && state_moves(&state) =>
            {
                // The receiver moved the transfer off a failed lane (SPEC §9.2): stop
                // writing under the old reservation, drain, then write again under this one.
                self.moves += 1;
                cx.out.stats.moves += 1;
                let after = AfterDrain::Move(Box::new(r), cx.now);
                let next = match state {
                    State::Writing(w) => cx.drain(&self, w, FailureReason::PeerLost, after),
                    State::AwaitingVerdict(_) => {
                        cx.abandon_committed(&self, FailureReason::PeerLost, after)
                    }
                    State::Draining(mut d) => {
                        d.after = after;
                        Next::Stay(State::Draining(d))
                    }
                    State::AwaitingMove(_) => match after {
                        AfterDrain::Move(r, at) => Next::Move(r, at),
                        _ => unreachable!("built as a move above"),
                    },
                    other => Next::Stay(other),
                };
                (next, Ok(()))
            }
            (state, Frame::Reserve(r)) => {
                // A second reservation while one is being served: refuse the newcomer.
                cx.out.reject(
                    &r,
                    ErrorCode::DUPLICATE_TRANSFER,
                    format!("transfer already reserved (state {name})"),
                );
                (
                    Next::Stay(state),
                    Err(FrameError::frame("second RESERVE for an open transfer")),
                )
            }
            (State::AwaitingVerdict(_) | State::AwaitingMove(_), Frame::Verified(t))
                if matches(t) =>
            {
                // From AwaitingMove: the receiver had the COMMIT and verified (it did not move).
                cx.release_source(&self);
                cx.report_verified(&self);
                (Next::Done(None), Ok(()))
            }
            (State::AwaitingVerdict(_) | State::AwaitingMove(_), Frame::Nack(n))
                if matches(n.transfer) =>
            {
                let opt = |v| (v != NONE_INDEX).then_some(v);
                let reason = FailureReason::Nacked {
                    code: n.code,
                    buffer: opt(n.buffer),
                    page: opt(n.page),
                };
                (Next::Done(Some(cx.failed(&self, reason))), Ok(()))
            }
            (State::Writing(w), Frame::Nack(n)) if matches(n.transfer) => {
                let reason = FailureReason::Nacked {
                    code: n.code,
                    buffer: None,
                    page: None,
                };
                (cx.drain(&self, w, reason, AfterDrain::Nothing), Ok(()))
            }
            (State::AwaitingAbortAck(s), Frame::AbortAck(t)) if matches(t) => {
                (Next::Done(Some(cx.report_failure(&self, s.reason))), Ok(()))
            }
            (State::AwaitingAbortAck(s), Frame::Abort(a)) if matches(a.transfer) => {
                // Crossed aborts: the peer's ABORT also ends our wait.
                cx.out.transmit.push_back(Frame::AbortAck(self.transfer));
                (Next::Done(Some(cx.report_failure(&self, s.reason))), Ok(()))
            }
            (State::AwaitingAbortAck(_), Frame::Verified(t)) if matches(t) => {
                // The receiver had verified and delivered before our ABORT: both sides agree.
                cx.report_verified(&self);
                (Next::Done(None), Ok(()))
            }
            (state, Frame::Abort(a)) if matches(a.transfer) || a.transfer.nonce == current => {
                let reason = FailureReason::PeerAbort {
                    code: a.code,
                    completed_pages: a.completed_pages,
                };
                let next = match state {
                    State::Writing(w) => cx.drain(&self, w, reason, AfterDrain::SendAbortAck),
                    State::Draining(mut d) => {
                        // Already stopping: acknowledge once drained instead of aborting
                        // (or moving: the receiver gave the transfer up).
                        if d.after.moves() {
                            d.reason = reason;
                        }
                        d.after = AfterDrain::SendAbortAck;
                        Next::Stay(State::Draining(d))
                    }
                    _ => {
                        cx.out.transmit.push_back(Frame::AbortAck(self.transfer));
                        Next::Done(Some(cx.failed(&self, reason)))
                    }
                };
                (next, Ok(()))
            }
            (state, Frame::Abort(a)) => {
                // An ABORT for another reservation of this id (an earlier one, or nonce 0 once
                // one is accepted): acknowledged, as for a finished transfer, so the aborting
                // side need not wait out its abort-ack deadline; this transfer is unaffected
                // (SPEC §7.3, §7.4).
                cx.out.transmit.push_back(Frame::AbortAck(a.transfer));
                (Next::Stay(state), Ok(()))
            }
            (state @ State::Writing(_), frame @ Frame::Verified(t)) if matches(t) => {
                let e = unexpected(&frame, name, WRITING_ACCEPTS).to_string();
                (
                    Next::Stay(state),
                    Err(FrameError::connection(format!(
                        "VERIFIED before COMMIT: {e}"
                    ))),
                )
            }
            (state, frame) => {
                cx.out.stats.dropped_frames += 1;
                let e = if frame.transfer().is_some_and(|t| !matches(t)) {
                    format!(
                        "{} for another reservation (stale nonce)",
                        frame.frame_type()
                    )
                } else {
                    unexpected(&frame, name, SENDER_ACCEPTS).to_string()
                };
                (Next::Stay(state), Err(FrameError::frame(e)))
            }
        };
        (next, self, result)
    }
}
