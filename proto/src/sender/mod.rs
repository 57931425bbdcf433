//! The sender (prefill side): answers reservations, posts writes, commits (SPEC.md §5.3).
//!
//! ```text
//!  submit(Admitted) ─▶ AwaitingReservation ──RESERVE ok──▶ Writing ──all written + digests──▶ AwaitingVerdict
//!        │ RESERVE mismatch: REJECT                  │ write failed / ABORT / timeout / abort()     │ VERIFIED | NACK | ABORT
//!        ▼                                           ▼                                              ▼
//!   failed (source released)              Draining (cancel unposted, wait for posted) ─▶ ABORT | ABORT_ACK ─▶ done
//!  retire(Rejected) ─▶ any RESERVE for it gets REJECT with the original error; nothing else happens.
//! ```
//!
//! Source pages are released only once every posted write has completed or failed, since a
//! transport may still be reading them.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use crate::admission::{Admitted, Rejected};
use crate::error::{unexpected, FailureReason, Wait};
use crate::handshake::Established;
use crate::history::{Finished, History};
use crate::scope::FrameError;
use crate::timers::Timers;
use crate::wire::{
    Abort, Commit, DigestAlgorithm, ErrorCode, Frame, FrameType, Reject, Reserve, TransferDigests,
    TransferRef, NONE_INDEX,
};

/// Sender session settings.
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// How long an admitted request waits for its reservation.
    pub reservation_timeout: Duration,
    /// How long a reservation that names no known request is held (the request may still
    /// be on its way to this engine) before it is rejected as `UNKNOWN_REQUEST`.
    pub parked_reservation_timeout: Duration,
    /// How long to wait for VERIFIED or NACK after COMMIT.
    pub verdict_timeout: Duration,
    /// How long to wait for ABORT_ACK after ABORT.
    pub abort_ack_timeout: Duration,
    /// How many finished and retired requests to remember for late reservations.
    pub history: usize,
}

impl Default for SenderConfig {
    fn default() -> Self {
        Self {
            reservation_timeout: Duration::from_secs(30),
            parked_reservation_timeout: Duration::from_secs(5),
            verdict_timeout: Duration::from_secs(10),
            abort_ack_timeout: Duration::from_secs(5),
            history: 4096,
        }
    }
}

/// One page to write: ordinal `i` of the transfer, from a source page to a destination page
/// (the same slot in every buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageWrite {
    /// Position in the transfer.
    pub ordinal: u32,
    /// Source page index in the sender's pool.
    pub src_page: u32,
    /// Destination page index in the receiver's pool.
    pub dst_page: u32,
}

/// How a posted page write ended, as the transport reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WriteOutcome {
    /// Completed at the transport (all buffers of the page).
    Completed,
    /// Failed at the transport.
    Failed,
    /// Never posted, because [`SenderAction::CancelWrites`] withdrew it.
    Cancelled,
}

/// An effect the driver must carry out for the sender, then report back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SenderAction {
    /// Post these writes, then report each page's outcome with
    /// [`SenderSession::handle_write_outcome`].
    PostWrites {
        /// The transfer.
        transfer: TransferRef,
        /// The writes, in ordinal order.
        writes: Vec<PageWrite>,
        /// The receiver's access descriptor from RESERVE.
        access: Vec<u8>,
    },
    /// Compute digests of the source pages (in transfer order), then call
    /// [`SenderSession::handle_digests`].
    ComputeDigests {
        /// The transfer (the digests are bound to it).
        transfer: TransferRef,
        /// With this algorithm.
        algorithm: DigestAlgorithm,
        /// Per-page digests too.
        page_digests: bool,
    },
    /// Stop posting the transfer's writes; report every unposted write as
    /// [`WriteOutcome::Cancelled`].
    CancelWrites(TransferRef),
    /// No transport still reads the transfer's source pages: they may be reused.
    ReleaseSource(u64),
}

/// What happened to a transfer, for the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SenderEvent {
    /// The receiver verified the transfer.
    Verified(TransferRef),
    /// The transfer failed; its source pages have been released.
    Failed {
        /// The transfer (nonce 0 if no reservation arrived).
        transfer: TransferRef,
        /// Why.
        reason: FailureReason,
    },
}

/// Why [`SenderSession::submit`] refused an admitted request.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SubmitError {
    /// A transfer with this id is open.
    DuplicateTransfer(Admitted),
    /// The source page count differs from [`Admitted::pages`].
    SourcePageCount {
        /// The request.
        admitted: Admitted,
        /// Pages given.
        given: usize,
    },
    /// The connection is lost.
    PeerLost(Admitted),
}

/// Counters of a sender session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SenderStats {
    /// Transfers verified by the receiver.
    pub verified: u64,
    /// Transfers failed.
    pub failed: u64,
    /// Reservations answered with REJECT.
    pub rejected_reservations: u64,
    /// Frames dropped as late, duplicate or stale.
    pub dropped_frames: u64,
}

// ---- states -----------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct AwaitingReservation {
    deadline: Instant,
}

#[derive(Clone, Debug)]
struct Writing {
    deadline: Instant,
    digest: DigestAlgorithm,
    completed: u32,
    digests: Option<TransferDigests>,
}

/// What follows the drain of an abandoned transfer.
#[derive(Clone, Debug)]
enum AfterDrain {
    SendAbort(ErrorCode),
    SendAbortAck,
    Nothing,
}

/// Whether the source digest computation still reads the source pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DigestJob {
    Running,
    Returned,
}

#[derive(Clone, Debug)]
struct Draining {
    completed: u32,
    accounted: u32,
    digest_job: DigestJob,
    reason: FailureReason,
    after: AfterDrain,
}

#[derive(Clone, Debug)]
struct AwaitingVerdict {
    deadline: Instant,
}

#[derive(Clone, Debug)]
struct AwaitingAbortAck {
    deadline: Instant,
    /// Why the transfer was abandoned; reported when the abort resolves, unless the receiver
    /// answers VERIFIED (it had delivered before our ABORT arrived).
    reason: FailureReason,
}

#[derive(Clone, Debug)]
enum State {
    AwaitingReservation(AwaitingReservation),
    Writing(Writing),
    Draining(Draining),
    AwaitingVerdict(AwaitingVerdict),
    AwaitingAbortAck(AwaitingAbortAck),
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            Self::AwaitingReservation(_) => "AwaitingReservation",
            Self::Writing(_) => "Writing",
            Self::Draining(_) => "Draining",
            Self::AwaitingVerdict(_) => "AwaitingVerdict",
            Self::AwaitingAbortAck(_) => "AwaitingAbortAck",
        }
    }

    fn deadline(&self) -> Option<Instant> {
        match self {
            Self::AwaitingReservation(s) => Some(s.deadline),
            Self::Writing(s) => Some(s.deadline),
            Self::AwaitingVerdict(s) => Some(s.deadline),
            Self::AwaitingAbortAck(s) => Some(s.deadline),
            Self::Draining(_) => None,
        }
    }
}

#[derive(Debug)]
struct Transfer {
    admitted: Admitted,
    source: Vec<u32>,
    /// Nonce 0 until a reservation is accepted.
    transfer: TransferRef,
    state: State,
}

impl Clone for Transfer {
    fn clone(&self) -> Self {
        Self {
            admitted: self.admitted.duplicate(),
            source: self.source.clone(),
            transfer: self.transfer,
            state: self.state.clone(),
        }
    }
}

enum Next {
    Stay(State),
    Done(Option<(ErrorCode, String)>),
}

#[derive(Clone, Debug, Default)]
struct Out {
    transmit: VecDeque<Frame>,
    actions: VecDeque<SenderAction>,
    events: VecDeque<SenderEvent>,
    stats: SenderStats,
}

struct Ctx<'a> {
    out: &'a mut Out,
    config: &'a SenderConfig,
    digests: &'a [DigestAlgorithm],
    bytes_per_page_index: u64,
    buffers: usize,
    now: Instant,
}

impl Ctx<'_> {
    /// The transfer is over with a failure: release the source (nothing reads it any more)
    /// and report the failure.
    fn failed(&mut self, t: &Transfer, reason: FailureReason) -> (ErrorCode, String) {
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
    fn report_failure(&mut self, t: &Transfer, reason: FailureReason) -> (ErrorCode, String) {
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

    /// Abandons a transfer that may have writes posted and a digest job running: cancel
    /// unposted writes, then wait for the posted ones and for the digest job.
    fn drain(
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
            digest_job: if w.digests.is_some() {
                DigestJob::Returned
            } else {
                DigestJob::Running
            },
            reason,
            after,
        };
        self.finish_drain(t, d)
    }

    /// Abandons a committed transfer: every write completed and the digests returned, so
    /// nothing reads the source any more.
    fn abandon_committed(
        &mut self,
        t: &Transfer,
        reason: FailureReason,
        after: AfterDrain,
    ) -> Next {
        let pages = t.admitted.pages();
        let d = Draining {
            completed: pages,
            accounted: pages,
            digest_job: DigestJob::Returned,
            reason,
            after,
        };
        self.finish_drain(t, d)
    }

    /// If every write is accounted for and no digest job reads the source, finish the
    /// abandoned transfer (only now may the source pages be released).
    fn finish_drain(&mut self, t: &Transfer, d: Draining) -> Next {
        if d.accounted < t.admitted.pages() || d.digest_job == DigestJob::Running {
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
                }))
            }
            AfterDrain::SendAbortAck => {
                let done = self.failed(t, d.reason);
                self.out.transmit.push_back(Frame::AbortAck(t.transfer));
                Next::Done(Some(done))
            }
            AfterDrain::Nothing => Next::Done(Some(self.failed(t, d.reason))),
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
        if !crate::wire::commit_fits(self.buffers, r.pages.len(), r.page_digests) {
            return Err((
                ErrorCode::BAD_RESERVATION,
                format!(
                    "a COMMIT with per-page digests for {} pages would exceed the frame limit",
                    r.pages.len()
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
        Ok(())
    }

    /// Commits if every write completed and the digests are ready.
    fn maybe_commit(&mut self, t: &Transfer, w: Writing) -> Next {
        if w.completed < t.admitted.pages() || w.digests.is_none() {
            return Next::Stay(State::Writing(w));
        }
        let digest = w.digest;
        let digests = w.digests.unwrap_or_default();
        let pages = t.admitted.pages();
        self.out.transmit.push_back(Frame::Commit(Commit {
            transfer: t.transfer,
            tokens: t.admitted.tokens(),
            pages,
            bytes: u64::from(pages) * self.bytes_per_page_index,
            digest,
            buffer_digests: digests.buffers,
            page_digests: digests.pages,
        }));
        Next::Stay(State::AwaitingVerdict(AwaitingVerdict {
            deadline: self.now + self.config.verdict_timeout,
        }))
    }
}

const SENDER_ACCEPTS: &[FrameType] = &[
    FrameType::RESERVE,
    FrameType::VERIFIED,
    FrameType::NACK,
    FrameType::ABORT,
    FrameType::ABORT_ACK,
];

impl Transfer {
    /// Takes the state out for a consuming transition. Every caller hands the transfer to
    /// `settle` afterwards with the next state (or ends it), so the placeholder left here is
    /// never observed.
    fn take_state(&mut self, now: Instant) -> State {
        std::mem::replace(
            &mut self.state,
            State::AwaitingReservation(AwaitingReservation { deadline: now }),
        )
    }

    fn on_frame(mut self, frame: Frame, cx: &mut Ctx<'_>) -> (Next, Self, Result<(), FrameError>) {
        let name = self.state.name();
        let current = self.transfer.nonce;
        let matches = |t: TransferRef| t.nonce == current || (t.nonce == 0 && current == 0);
        let state = self.take_state(cx.now);
        let (next, result) = match (state, frame) {
            (State::AwaitingReservation(_), Frame::Reserve(r)) => {
                let reply = |code, detail| {
                    Frame::Reject(Reject {
                        transfer: TransferRef {
                            transfer_id: r.transfer_id,
                            nonce: r.nonce,
                        },
                        code,
                        detail,
                    })
                };
                match cx.check_reservation(&self, &r) {
                    Err((code, detail)) => {
                        cx.out.stats.rejected_reservations += 1;
                        cx.out.transmit.push_back(reply(code, detail.clone()));
                        self.transfer.nonce = r.nonce;
                        let done = cx.failed(
                            &self,
                            FailureReason::ReservationRefused {
                                code,
                                detail: detail.clone(),
                            },
                        );
                        (Next::Done(Some(done)), Err(FrameError::transfer(detail)))
                    }
                    Ok(()) => {
                        self.transfer.nonce = r.nonce;
                        let writes = self
                            .source
                            .iter()
                            .zip(&r.pages)
                            .enumerate()
                            .map(|(i, (&src_page, &dst_page))| PageWrite {
                                ordinal: i as u32,
                                src_page,
                                dst_page,
                            })
                            .collect();
                        cx.out.actions.push_back(SenderAction::ComputeDigests {
                            transfer: self.transfer,
                            algorithm: r.digest,
                            page_digests: r.page_digests,
                        });
                        cx.out.actions.push_back(SenderAction::PostWrites {
                            transfer: self.transfer,
                            writes,
                            access: r.access,
                        });
                        let deadline = cx.now + Duration::from_millis(u64::from(r.deadline_ms));
                        let w = Writing {
                            deadline,
                            digest: r.digest,
                            completed: 0,
                            digests: None,
                        };
                        (Next::Stay(State::Writing(w)), Ok(()))
                    }
                }
            }
            (state, Frame::Reserve(r)) if r.nonce == current => {
                // The same reservation again (a duplicated frame): idempotent.
                cx.out.stats.dropped_frames += 1;
                (
                    Next::Stay(state),
                    Err(FrameError::frame("duplicate RESERVE")),
                )
            }
            (state, Frame::Reserve(r)) => {
                // A second reservation while one is being served: refuse the newcomer.
                cx.out.stats.rejected_reservations += 1;
                cx.out.transmit.push_back(Frame::Reject(Reject {
                    transfer: TransferRef {
                        transfer_id: r.transfer_id,
                        nonce: r.nonce,
                    },
                    code: ErrorCode::DUPLICATE_TRANSFER,
                    detail: format!("transfer already reserved (state {name})"),
                }));
                (
                    Next::Stay(state),
                    Err(FrameError::frame("second RESERVE for an open transfer")),
                )
            }
            (State::AwaitingVerdict(_), Frame::Verified(t)) if matches(t) => {
                cx.release_source(&self);
                cx.report_verified(&self);
                (Next::Done(None), Ok(()))
            }
            (State::AwaitingVerdict(_), Frame::Nack(n)) if matches(n.transfer) => {
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
                        // Already stopping: acknowledge once drained instead of aborting.
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
            (state @ State::Writing(_), frame @ Frame::Verified(t)) if matches(t) => {
                let e = unexpected(&frame, name, SENDER_ACCEPTS).to_string();
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

/// The sender side of one connection: all its transfers.
#[derive(Clone, Debug)]
pub struct SenderSession {
    digests: Vec<DigestAlgorithm>,
    bytes_per_page_index: u64,
    buffers: usize,
    config: SenderConfig,
    transfers: BTreeMap<u64, Transfer>,
    /// Reservations naming no known request, held briefly (the request may be on its way).
    parked: BTreeMap<u64, (Reserve, Instant)>,
    history: History,
    timers: Timers,
    out: Out,
    lost: bool,
}

impl SenderSession {
    /// A session over an established connection on which this node is the sender.
    pub fn new(established: &Established, config: SenderConfig) -> Self {
        Self {
            digests: established.digests.clone(),
            bytes_per_page_index: established.layout().bytes_per_page_index(),
            buffers: established.layout().buffers(),
            history: History::new(config.history),
            config,
            transfers: BTreeMap::new(),
            parked: BTreeMap::new(),
            timers: Timers::default(),
            out: Out::default(),
            lost: false,
        }
    }

    fn ctx(&mut self, now: Instant) -> Ctx<'_> {
        Ctx {
            out: &mut self.out,
            config: &self.config,
            digests: &self.digests,
            bytes_per_page_index: self.bytes_per_page_index,
            buffers: self.buffers,
            now,
        }
    }

    fn settle(&mut self, t: Transfer, next: Next) {
        let id = t.transfer.transfer_id;
        match next {
            Next::Stay(state) => {
                if let Some(d) = state.deadline() {
                    self.timers.arm(d, id);
                }
                self.transfers.insert(id, Transfer { state, ..t });
            }
            Next::Done(failure) => self.history.insert(
                id,
                Finished {
                    nonce: t.transfer.nonce,
                    failure,
                },
            ),
        }
    }

    /// Submits an admitted request whose KV pages are in `source` (sender pool page indices,
    /// in token order). It waits for the receiver's reservation.
    pub fn submit(
        &mut self,
        now: Instant,
        admitted: Admitted,
        source: Vec<u32>,
    ) -> Result<(), SubmitError> {
        if self.lost {
            return Err(SubmitError::PeerLost(admitted));
        }
        let id = admitted.transfer_id();
        if self.transfers.contains_key(&id) {
            return Err(SubmitError::DuplicateTransfer(admitted));
        }
        if source.len() as u64 != u64::from(admitted.pages()) {
            return Err(SubmitError::SourcePageCount {
                given: source.len(),
                admitted,
            });
        }
        self.history.remove(id);
        let deadline = now + self.config.reservation_timeout;
        let t = Transfer {
            admitted,
            source,
            transfer: TransferRef {
                transfer_id: id,
                nonce: 0,
            },
            state: State::AwaitingReservation(AwaitingReservation { deadline }),
        };
        self.settle(
            t,
            Next::Stay(State::AwaitingReservation(AwaitingReservation { deadline })),
        );
        if let Some((r, _)) = self.parked.remove(&id) {
            // Cannot fail with a connection-scope error: it is a RESERVE for an open transfer.
            let _ = self.handle_frame(now, Frame::Reserve(r));
        }
        Ok(())
    }

    /// Retires a rejected request: any reservation for it (already parked or still to come)
    /// is answered with REJECT carrying the original error. Nothing is allocated or sent
    /// otherwise.
    pub fn retire(&mut self, rejected: Rejected) {
        let id = rejected.transfer_id;
        let code = rejected.error.code();
        let detail = rejected.error.to_string();
        self.history.insert(
            id,
            Finished {
                nonce: 0,
                failure: Some((code, detail.clone())),
            },
        );
        if let Some((r, _)) = self.parked.remove(&id) {
            self.reject_reservation(&r, code, detail);
        }
    }

    fn reject_reservation(&mut self, r: &Reserve, code: ErrorCode, detail: String) {
        self.out.stats.rejected_reservations += 1;
        self.out.transmit.push_back(Frame::Reject(Reject {
            transfer: TransferRef {
                transfer_id: r.transfer_id,
                nonce: r.nonce,
            },
            code,
            detail,
        }));
    }

    /// Aborts a transfer from the sender side: stop posting, drain, then ABORT with the
    /// count of completed pages. Returns false if the transfer is not open or already ending.
    pub fn abort(&mut self, now: Instant, transfer_id: u64, code: ErrorCode) -> bool {
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
        let Some(tref) = frame.transfer() else {
            return Err(FrameError::connection(format!(
                "{} after the handshake",
                frame.frame_type()
            )));
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

    fn handle_closed_transfer(
        &mut self,
        now: Instant,
        frame: Frame,
        tref: TransferRef,
    ) -> Result<(), FrameError> {
        match (frame, self.history.get(tref.transfer_id).cloned()) {
            (Frame::Reserve(r), Some(f)) => {
                let (code, detail) = f.failure.unwrap_or((
                    ErrorCode::DUPLICATE_TRANSFER,
                    "transfer already verified".into(),
                ));
                self.reject_reservation(&r, code, detail);
                Ok(())
            }
            (Frame::Reserve(r), None) => {
                if let Some((old, _)) = self.parked.remove(&r.transfer_id) {
                    self.reject_reservation(
                        &old,
                        ErrorCode::DUPLICATE_TRANSFER,
                        "superseded".into(),
                    );
                }
                let deadline = now + self.config.parked_reservation_timeout;
                self.timers.arm(deadline, r.transfer_id);
                self.parked.insert(r.transfer_id, (r, deadline));
                Ok(())
            }
            (Frame::Abort(_), _) => {
                self.out.transmit.push_back(Frame::AbortAck(tref));
                Ok(())
            }
            (other, f) => {
                self.out.stats.dropped_frames += 1;
                let what = if f.is_some() { "finished" } else { "unknown" };
                Err(FrameError::frame(format!(
                    "{} for a {what} transfer",
                    other.frame_type()
                )))
            }
        }
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
                w.completed = w.completed.saturating_add(pages).min(t.admitted.pages());
                cx.maybe_commit(&t, w)
            }
            (State::Writing(w), WriteOutcome::Failed | WriteOutcome::Cancelled) => {
                let after = AfterDrain::SendAbort(ErrorCode::WRITE_FAILED);
                let d = cx.drain(&t, w, FailureReason::WriteFailed, after);
                match d {
                    Next::Stay(State::Draining(mut d)) => {
                        d.accounted = d.accounted.saturating_add(pages);
                        cx.finish_drain(&t, d)
                    }
                    other => other,
                }
            }
            (State::Draining(mut d), outcome) => {
                if outcome == WriteOutcome::Completed {
                    d.completed = d.completed.saturating_add(pages);
                }
                d.accounted = d.accounted.saturating_add(pages);
                cx.finish_drain(&t, d)
            }
            (other, _) => Next::Stay(other),
        };
        self.settle(t, next);
    }

    /// The driver hands back the source digests.
    pub fn handle_digests(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        digests: TransferDigests,
    ) {
        let Some(mut t) = self.take_current(transfer) else {
            return;
        };
        let state = t.take_state(now);
        let mut cx = self.ctx(now);
        let next = match state {
            State::Writing(mut w) => {
                w.digests = Some(digests);
                cx.maybe_commit(&t, w)
            }
            // Abandoned while the digests were computed: they no longer read the source.
            State::Draining(mut d) => {
                d.digest_job = DigestJob::Returned;
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
            if let Some((r, _)) = self.parked.remove(&id) {
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
                // The peer never answered our ABORT: report why we abandoned the transfer.
                State::AwaitingAbortAck(s) => Next::Done(Some(cx.report_failure(&t, s.reason))),
                other => Next::Stay(other),
            };
            self.settle(t, next);
        }
    }

    /// The connection is gone: stop every transfer; each fails with
    /// [`FailureReason::PeerLost`] once its posted writes are drained.
    pub fn handle_peer_lost(&mut self, now: Instant) {
        self.lost = true;
        self.parked.clear();
        let open = std::mem::take(&mut self.transfers);
        for (_, mut t) in open {
            let state = t.take_state(now);
            let mut cx = self.ctx(now);
            let next = match state {
                State::Writing(w) => cx.drain(&t, w, FailureReason::PeerLost, AfterDrain::Nothing),
                State::Draining(mut d) => {
                    d.after = AfterDrain::Nothing;
                    Next::Stay(State::Draining(d))
                }
                State::AwaitingAbortAck(s) => Next::Done(Some(cx.report_failure(&t, s.reason))),
                State::AwaitingReservation(_) | State::AwaitingVerdict(_) => {
                    Next::Done(Some(cx.failed(&t, FailureReason::PeerLost)))
                }
            };
            self.settle(t, next);
        }
        self.out.transmit.clear();
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

    /// Counters.
    pub fn stats(&self) -> SenderStats {
        self.out.stats
    }
}
