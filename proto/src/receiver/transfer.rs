//! One receiver transfer and its transitions: the frames it accepts in each state, and the
//! failure path (quarantine, fence, release, goodbye) every failing transition takes.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::state::{
    AfterFence, Awaiting, AwaitingAbortAck, Failing, FencingForVerify, Pending, Spec, State,
};
use super::verify::check_commit;
use super::{ReceiverAction, ReceiverEvent, ReceiverStats};
use crate::error::{unexpected, FailureReason};
use crate::scope::FrameError;
use crate::wire::{Abort, ErrorCode, Frame, FrameType, Nack, NONE_INDEX};

#[derive(Clone, Debug)]
pub(super) struct Transfer {
    pub(super) spec: Spec,
    pub(super) state: State,
}

/// Where a state transition goes.
pub(super) enum Next {
    Stay(State),
    /// The transfer is over; remember it with this outcome.
    Done(Option<(ErrorCode, String)>),
}

/// The queues a transition writes into.
#[derive(Clone, Debug, Default)]
pub(super) struct Out {
    pub(super) transmit: VecDeque<Frame>,
    pub(super) actions: VecDeque<ReceiverAction>,
    pub(super) events: VecDeque<ReceiverEvent>,
    pub(super) stats: ReceiverStats,
    pub(super) abort_ack_timeout: Duration,
}

impl Out {
    /// Starts the failure path: quarantine, then wait for the fence (requesting it if
    /// needed) and for any digest computation still reading the pages; only then release.
    pub(super) fn fail(
        &mut self,
        spec: &Spec,
        pending: Pending,
        reason: FailureReason,
        after: AfterFence,
        now: Instant,
    ) -> Next {
        self.actions
            .push_back(ReceiverAction::Quarantine(spec.transfer));
        let awaiting = match pending {
            Pending::NoFenceYet => {
                self.stats.fences += 1;
                self.actions.push_back(ReceiverAction::Fence(spec.transfer));
                Awaiting::Fence
            }
            Pending::InFlight(a) => a,
            Pending::Nothing => return self.after_fence(spec, reason, after, now),
        };
        Next::Stay(State::Failing(Failing {
            reason,
            after,
            awaiting,
        }))
    }

    /// The fence of a failed transfer is complete: release, report, and say goodbye.
    pub(super) fn after_fence(
        &mut self,
        spec: &Spec,
        reason: FailureReason,
        after: AfterFence,
        now: Instant,
    ) -> Next {
        self.actions
            .push_back(ReceiverAction::Release(spec.transfer));
        let code = reason.code();
        let detail = reason.to_string();
        self.stats.failed += 1;
        self.events.push_back(ReceiverEvent::Failed {
            transfer: spec.transfer,
            reason,
        });
        match after {
            AfterFence::SendAbort(code) => {
                self.transmit.push_back(Frame::Abort(Abort {
                    transfer: spec.transfer,
                    code,
                    completed_pages: 0,
                    detail: detail.clone(),
                }));
                Next::Stay(State::AwaitingAbortAck(AwaitingAbortAck {
                    deadline: now + self.abort_ack_timeout,
                    outcome: (code, detail),
                }))
            }
            AfterFence::SendAbortAck => {
                self.transmit.push_back(Frame::AbortAck(spec.transfer));
                Next::Done(Some((code, detail)))
            }
            AfterFence::Nothing => Next::Done(Some((code, detail))),
        }
    }
}

const COMMIT_EXPECTS: &[FrameType] = &[FrameType::COMMIT, FrameType::REJECT, FrameType::ABORT];

impl Transfer {
    pub(super) fn on_frame(
        self,
        frame: Frame,
        now: Instant,
        out: &mut Out,
    ) -> (Next, Spec, Result<(), FrameError>) {
        let Transfer { spec, state } = self;
        let name = state.name();
        let (next, result) = match (state, frame) {
            (state, Frame::Commit(c)) if spec.moved_from.contains(&c.transfer.nonce) => {
                // The sender's COMMIT for a reservation this transfer moved from: it will
                // write again under the new one (SPEC §9.2).
                out.stats.dropped_frames += 1;
                (
                    Next::Stay(state),
                    Err(FrameError::frame(
                        "COMMIT for a reservation moved off its lane",
                    )),
                )
            }
            (state @ State::AwaitingCommit(_), Frame::Commit(c))
                if c.transfer.nonce != spec.transfer.nonce =>
            {
                // A commit bound to another reservation: answer it, and fail ours (fail closed).
                out.transmit.push_back(Frame::Nack(Nack {
                    transfer: c.transfer,
                    code: ErrorCode::STALE_NONCE,
                    buffer: NONE_INDEX,
                    page: NONE_INDEX,
                    detail: "nonce names no current reservation".into(),
                }));
                let reason = FailureReason::StaleNonce {
                    expected: spec.transfer.nonce,
                    got: c.transfer.nonce,
                };
                let next = out.fail(
                    &spec,
                    state.pending(),
                    reason,
                    AfterFence::SendAbort(ErrorCode::STALE_NONCE),
                    now,
                );
                (next, Err(FrameError::transfer("commit with a stale nonce")))
            }
            (State::AwaitingCommit(s), Frame::Commit(c)) => match check_commit(&spec, &c) {
                Ok(()) => {
                    out.stats.fences += 1;
                    out.actions.push_back(ReceiverAction::Fence(spec.transfer));
                    (
                        Next::Stay(State::FencingForVerify(FencingForVerify { commit: c })),
                        Ok(()),
                    )
                }
                Err(reason) => {
                    let detail = reason.to_string();
                    let (buffer, page) = (NONE_INDEX, NONE_INDEX);
                    out.transmit.push_back(Frame::Nack(Nack {
                        transfer: spec.transfer,
                        code: reason.code(),
                        buffer,
                        page,
                        detail: detail.clone(),
                    }));
                    let state = State::AwaitingCommit(s);
                    (
                        out.fail(&spec, state.pending(), reason, AfterFence::Nothing, now),
                        Err(FrameError::transfer(detail)),
                    )
                }
            },
            (state, Frame::Commit(_)) => {
                // Duplicate commit for a transfer already committed or failing: drop.
                out.stats.dropped_frames += 1;
                (
                    Next::Stay(state),
                    Err(FrameError::frame(format!("duplicate COMMIT in {name}"))),
                )
            }
            (state @ State::AwaitingCommit(_), Frame::Reject(r))
                if r.transfer.nonce == spec.transfer.nonce =>
            {
                let reason = FailureReason::Rejected {
                    code: r.code,
                    detail: r.detail,
                };
                (
                    out.fail(&spec, state.pending(), reason, AfterFence::Nothing, now),
                    Ok(()),
                )
            }
            (State::AwaitingAbortAck(s), Frame::AbortAck(t)) if t.nonce == spec.transfer.nonce => {
                (Next::Done(Some(s.outcome)), Ok(()))
            }
            (State::AwaitingAbortAck(s), Frame::Abort(a))
                if a.transfer.nonce == spec.transfer.nonce || a.transfer.nonce == 0 =>
            {
                // Crossed aborts: the peer's ABORT also ends our wait.
                out.transmit.push_back(Frame::AbortAck(spec.transfer));
                (Next::Done(Some(s.outcome)), Ok(()))
            }
            (state, Frame::Abort(a))
                if a.transfer.nonce == spec.transfer.nonce || a.transfer.nonce == 0 =>
            {
                match state {
                    State::Failing(mut f) => {
                        // Already failing: acknowledge after our own fence.
                        if matches!(f.after, AfterFence::SendAbort(_)) {
                            f.after = AfterFence::SendAbortAck;
                        } else if matches!(f.after, AfterFence::Nothing) {
                            out.transmit.push_back(Frame::AbortAck(spec.transfer));
                        }
                        (Next::Stay(State::Failing(f)), Ok(()))
                    }
                    state => {
                        let reason = FailureReason::PeerAbort {
                            code: a.code,
                            completed_pages: a.completed_pages,
                        };
                        (
                            out.fail(
                                &spec,
                                state.pending(),
                                reason,
                                AfterFence::SendAbortAck,
                                now,
                            ),
                            Ok(()),
                        )
                    }
                }
            }
            (state, frame @ (Frame::Reject(_) | Frame::Abort(_) | Frame::AbortAck(_))) => {
                out.stats.dropped_frames += 1;
                let e = if frame.transfer().map(|t| t.nonce) != Some(spec.transfer.nonce) {
                    FrameError::frame(format!(
                        "{} for another reservation (stale nonce)",
                        frame.frame_type()
                    ))
                } else {
                    FrameError::frame(unexpected(&frame, name, COMMIT_EXPECTS).to_string())
                };
                (Next::Stay(state), Err(e))
            }
            (state, frame) => {
                // Routed here only for per-transfer frames the receiver accepts.
                (
                    Next::Stay(state),
                    Err(FrameError::connection(
                        unexpected(&frame, name, COMMIT_EXPECTS).to_string(),
                    )),
                )
            }
        };
        (next, spec, result)
    }
}
