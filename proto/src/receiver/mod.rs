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

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use crate::error::{unexpected, CountField, FailureReason, Wait};
use crate::handshake::Established;
use crate::history::{Finished, History};
use crate::scope::FrameError;
use crate::timers::Timers;
use crate::wire::{
    commit_fits, Abort, Commit, DigestAlgorithm, ErrorCode, Frame, FrameType, KvLayout, Nack,
    Reserve, TransferDigests, TransferRef, MAX_ACCESS, MAX_PAGES, NONE_INDEX,
};

/// Receiver session settings.
#[derive(Clone, Debug)]
pub struct ReceiverConfig {
    /// Seed for reservation nonces; use a fresh random value per connection.
    pub nonce_seed: u64,
    /// How many finished transfers to remember for late frames.
    pub history: usize,
    /// How long to wait for ABORT_ACK after sending ABORT.
    pub abort_ack_timeout: Duration,
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        Self {
            nonce_seed: 0x6b76_7769_7265_0001,
            history: 4096,
            abort_ack_timeout: Duration::from_secs(5),
        }
    }
}

/// What the engine asks to reserve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservationRequest {
    /// The transfer id (the request id both engines know).
    pub transfer_id: u64,
    /// Tokens expected.
    pub tokens: u32,
    /// Destination page indices, already leased by the driver, in transfer order.
    pub pages: Vec<u32>,
    /// The digest algorithm; `None` picks the first agreed at the handshake.
    pub digest: Option<DigestAlgorithm>,
    /// Whether to require per-page digests (names the first bad page on mismatch).
    pub page_digests: bool,
    /// How long the sender has to commit.
    pub timeout: Duration,
    /// The transport's access descriptor, scoped to exactly these pages.
    pub access: Vec<u8>,
}

/// Why [`ReceiverSession::reserve`] refused a reservation before sending anything.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReserveError {
    /// A transfer with this id is open.
    DuplicateTransfer(u64),
    /// The token count is zero.
    NoTokens,
    /// `pages.len()` differs from `ceil(tokens / tokens_per_page)`.
    PageCountMismatch {
        /// Pages given.
        pages: usize,
        /// Pages the tokens need.
        expected: u64,
    },
    /// A page appears twice.
    DuplicatePage(u32),
    /// More than [`MAX_PAGES`] pages, an access descriptor over [`MAX_ACCESS`] bytes, or a
    /// COMMIT that could not fit in one frame (see [`commit_fits`]).
    TooLarge,
    /// The digest algorithm was not agreed at the handshake.
    DigestNotAgreed(DigestAlgorithm),
    /// The connection is lost.
    PeerLost,
}

impl std::fmt::Display for ReserveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::DuplicateTransfer(t) => write!(f, "transfer {t} already has a reservation"),
            Self::NoTokens => write!(f, "a reservation needs at least one token"),
            Self::PageCountMismatch { pages, expected } => {
                write!(f, "{pages} pages given, the tokens need {expected}")
            }
            Self::DuplicatePage(p) => write!(f, "page {p} appears twice"),
            Self::TooLarge => write!(f, "reservation exceeds the frame limits"),
            Self::DigestNotAgreed(d) => write!(f, "digest {d} was not agreed at the handshake"),
            Self::PeerLost => write!(f, "the connection is lost"),
        }
    }
}

impl std::error::Error for ReserveError {}

/// An effect the driver must carry out for the receiver, then report back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReceiverAction {
    /// Mark the transfer's pages quarantined: it failed and they must not be delivered or
    /// reused until the fence completes.
    Quarantine(TransferRef),
    /// Make sure no further write for the transfer can land (RDMA: invalidate its memory
    /// window; TCP/loopback: close its scope), then call
    /// [`ReceiverSession::handle_fenced`].
    Fence(TransferRef),
    /// Compute the transfer's digests over the landed pages, then call
    /// [`ReceiverSession::handle_digests`].
    ComputeDigests {
        /// The transfer.
        transfer: TransferRef,
        /// With this algorithm.
        algorithm: DigestAlgorithm,
        /// Per-page digests too.
        page_digests: bool,
    },
    /// Return the transfer's pages to the pool. Always after its fence.
    Release(TransferRef),
}

/// A verified transfer, ready for the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    /// The transfer.
    pub transfer: TransferRef,
    /// Tokens verified.
    pub tokens: u32,
    /// Pages verified.
    pub pages: u32,
    /// Bytes verified.
    pub bytes: u64,
}

/// What happened to a transfer, for the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReceiverEvent {
    /// Verified: the driver hands the pages to the engine (they are not released).
    Delivered(Delivery),
    /// Failed: its pages have been released (after the fence).
    Failed {
        /// The transfer.
        transfer: TransferRef,
        /// Why.
        reason: FailureReason,
    },
}

/// Counters of a receiver session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Transfers delivered.
    pub delivered: u64,
    /// Transfers failed.
    pub failed: u64,
    /// Frames dropped as late, duplicate or stale.
    pub dropped_frames: u64,
    /// Fences requested.
    pub fences: u64,
}

// ---- states -----------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct AwaitingCommit {
    deadline: Instant,
}

#[derive(Clone, Debug)]
struct FencingForVerify {
    commit: Commit,
}

#[derive(Clone, Debug)]
struct Verifying {
    commit: Commit,
}

/// What follows the fence of a failed transfer.
#[derive(Clone, Debug)]
enum AfterFence {
    /// Send ABORT with this code and wait for ABORT_ACK.
    SendAbort(ErrorCode),
    /// Send ABORT_ACK (the peer aborted).
    SendAbortAck,
    /// Nothing to send (rejected, or the peer is gone).
    Nothing,
}

/// The local effect a failing transfer waits for before its pages may be released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Awaiting {
    /// The fence: a write for the transfer could still land.
    Fence,
    /// A digest computation over the pages, still reading them.
    Digests,
}

/// What a transition into failure must still wait for, given the state it leaves.
enum Pending {
    /// Writes may land and no fence was requested: request one.
    NoFenceYet,
    /// Already waiting on this effect.
    InFlight(Awaiting),
    /// Fenced, nothing reads the pages: release now.
    Nothing,
}

#[derive(Clone, Debug)]
struct Failing {
    reason: FailureReason,
    after: AfterFence,
    awaiting: Awaiting,
}

#[derive(Clone, Debug)]
struct AwaitingAbortAck {
    deadline: Instant,
}

#[derive(Clone, Debug)]
enum State {
    AwaitingCommit(AwaitingCommit),
    FencingForVerify(FencingForVerify),
    Verifying(Verifying),
    Failing(Failing),
    AwaitingAbortAck(AwaitingAbortAck),
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            Self::AwaitingCommit(_) => "AwaitingCommit",
            Self::FencingForVerify(_) => "FencingForVerify",
            Self::Verifying(_) => "Verifying",
            Self::Failing(_) => "Failing",
            Self::AwaitingAbortAck(_) => "AwaitingAbortAck",
        }
    }

    fn deadline(&self) -> Option<Instant> {
        match self {
            Self::AwaitingCommit(s) => Some(s.deadline),
            Self::AwaitingAbortAck(s) => Some(s.deadline),
            _ => None,
        }
    }

    /// What a failure from this state must wait for before releasing pages.
    fn pending(&self) -> Pending {
        match self {
            Self::AwaitingCommit(_) => Pending::NoFenceYet,
            Self::FencingForVerify(_) => Pending::InFlight(Awaiting::Fence),
            Self::Verifying(_) => Pending::InFlight(Awaiting::Digests),
            Self::Failing(f) => Pending::InFlight(f.awaiting),
            Self::AwaitingAbortAck(_) => Pending::Nothing,
        }
    }
}

/// The fixed facts of one reservation.
#[derive(Clone, Debug)]
struct Spec {
    transfer: TransferRef,
    tokens: u32,
    pages: u32,
    bytes: u64,
    buffers: usize,
    digest: DigestAlgorithm,
    page_digests: bool,
}

#[derive(Clone, Debug)]
struct Transfer {
    spec: Spec,
    state: State,
}

/// Where a state transition goes.
enum Next {
    Stay(State),
    /// The transfer is over; remember it with this outcome.
    Done(Option<(ErrorCode, String)>),
}

/// The queues a transition writes into.
#[derive(Clone, Debug, Default)]
struct Out {
    transmit: VecDeque<Frame>,
    actions: VecDeque<ReceiverAction>,
    events: VecDeque<ReceiverEvent>,
    stats: ReceiverStats,
    abort_ack_timeout: Duration,
}

impl Out {
    /// Starts the failure path: quarantine, then wait for the fence (requesting it if
    /// needed) and for any digest computation still reading the pages; only then release.
    fn fail(
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
    fn after_fence(
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

/// Checks a commit against the reservation; the first disagreement is the reason.
fn check_commit(spec: &Spec, c: &Commit) -> Result<(), FailureReason> {
    let counts = [
        (
            CountField::Tokens,
            u64::from(spec.tokens),
            u64::from(c.tokens),
        ),
        (CountField::Pages, u64::from(spec.pages), u64::from(c.pages)),
        (CountField::Bytes, spec.bytes, c.bytes),
    ];
    for (field, expected, got) in counts {
        if expected != got {
            return Err(FailureReason::CountMismatch {
                field,
                expected,
                got,
            });
        }
    }
    if c.digest != spec.digest {
        return Err(FailureReason::ProtocolViolation {
            detail: format!(
                "commit digest {} differs from the reserved {}",
                c.digest, spec.digest
            ),
        });
    }
    if c.buffer_digests.len() != spec.buffers {
        return Err(FailureReason::MissingDigest {
            detail: format!(
                "{} buffer digests for {} buffers",
                c.buffer_digests.len(),
                spec.buffers
            ),
        });
    }
    if let Some(b) = c.buffer_digests.iter().position(|d| d.is_zero()) {
        return Err(FailureReason::MissingDigest {
            detail: format!("buffer {b} digest is all zero"),
        });
    }
    let want_pages = spec.buffers as u64 * u64::from(spec.pages);
    match (spec.page_digests, c.page_digests.len() as u64) {
        (true, n) if n != want_pages => Err(FailureReason::MissingDigest {
            detail: format!("{n} page digests, {want_pages} required"),
        }),
        (false, n) if n != 0 && n != want_pages => Err(FailureReason::ProtocolViolation {
            detail: format!("{n} page digests for {want_pages} pages"),
        }),
        _ => Ok(()),
    }
}

/// Compares the landed memory's digests with the commit's; names the first bad buffer and,
/// where the commit has per-page digests, the first bad page in it.
fn compare_digests(
    spec: &Spec,
    commit: &Commit,
    landed: &TransferDigests,
) -> Result<(), FailureReason> {
    let pages = spec.pages as usize;
    for b in 0..spec.buffers {
        let ours = landed.buffers.get(b);
        if ours != Some(&commit.buffer_digests[b]) {
            let page = if commit.page_digests.is_empty()
                || landed.pages.len() != commit.page_digests.len()
            {
                None
            } else {
                let range = b * pages..(b + 1) * pages;
                landed.pages[range.clone()]
                    .iter()
                    .zip(&commit.page_digests[range])
                    .position(|(x, y)| x != y)
                    .map(|p| p as u32)
            };
            return Err(FailureReason::DigestMismatch {
                buffer: b as u32,
                page,
            });
        }
    }
    if !commit.page_digests.is_empty() && landed.pages != commit.page_digests {
        // Buffer digests agree but page digests do not: the commit is inconsistent.
        return Err(FailureReason::ProtocolViolation {
            detail: "page digests disagree with matching buffer digests".into(),
        });
    }
    Ok(())
}

impl Transfer {
    fn on_frame(
        self,
        frame: Frame,
        now: Instant,
        out: &mut Out,
    ) -> (Next, Spec, Result<(), FrameError>) {
        let Transfer { spec, state } = self;
        let name = state.name();
        let (next, result) = match (state, frame) {
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
            (State::AwaitingAbortAck(_), Frame::AbortAck(t)) if t.nonce == spec.transfer.nonce => (
                Next::Done(Some((ErrorCode::CANCELLED, "aborted".into()))),
                Ok(()),
            ),
            (State::AwaitingAbortAck(_), Frame::Abort(a))
                if a.transfer.nonce == spec.transfer.nonce || a.transfer.nonce == 0 =>
            {
                // Crossed aborts: the peer's ABORT also ends our wait.
                out.transmit.push_back(Frame::AbortAck(spec.transfer));
                (
                    Next::Done(Some((ErrorCode::CANCELLED, "aborted".into()))),
                    Ok(()),
                )
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

/// The receiver side of one connection: all its transfers.
#[derive(Clone, Debug)]
pub struct ReceiverSession {
    layout: KvLayout,
    digests: Vec<DigestAlgorithm>,
    config: ReceiverConfig,
    nonce_counter: u64,
    transfers: BTreeMap<u64, Transfer>,
    history: History,
    timers: Timers,
    out: Out,
    lost: bool,
}

/// SplitMix64's finaliser: a bijection on u64, so distinct counters give distinct nonces.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl ReceiverSession {
    /// A session over an established connection on which this node is the receiver.
    pub fn new(established: &Established, config: ReceiverConfig) -> Self {
        let history = History::new(config.history);
        Self {
            layout: established.layout().clone(),
            digests: established.digests.clone(),
            nonce_counter: config.nonce_seed,
            out: Out {
                abort_ack_timeout: config.abort_ack_timeout,
                ..Out::default()
            },
            config,
            transfers: BTreeMap::new(),
            history,
            timers: Timers::default(),
            lost: false,
        }
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
            || !commit_fits(self.layout.buffers(), req.pages.len(), req.page_digests)
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
        // A new reservation for an id seen before starts afresh (with a new nonce).
        self.history.remove(req.transfer_id);
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

    /// Aborts a transfer from the receiver side: fence first, then release, then ABORT.
    /// Returns false if the transfer is not open or is already failing.
    pub fn abort(&mut self, now: Instant, transfer_id: u64, code: ErrorCode) -> bool {
        let Some(t) = self.transfers.remove(&transfer_id) else {
            return false;
        };
        let (next, applied) = match t.state {
            s @ (State::AwaitingCommit(_) | State::FencingForVerify(_) | State::Verifying(_)) => {
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
                    Finished {
                        nonce: spec.transfer.nonce,
                        failure,
                    },
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
        let Some(tref) = frame.transfer() else {
            return Err(FrameError::connection(format!(
                "{} after the handshake",
                frame.frame_type()
            )));
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
        let Some(t) = self.transfers.remove(&tref.transfer_id) else {
            return self.handle_closed_transfer(frame, tref);
        };
        let (next, spec, result) = t.on_frame(frame, now, &mut self.out);
        self.settle(spec, next);
        result
    }

    /// A frame for a transfer with no open state: finished or never known.
    fn handle_closed_transfer(
        &mut self,
        frame: Frame,
        tref: TransferRef,
    ) -> Result<(), FrameError> {
        let known = self.history.get(tref.transfer_id).is_some();
        match frame {
            Frame::Abort(_) => {
                let verified = self
                    .history
                    .get(tref.transfer_id)
                    .is_some_and(|f| f.failure.is_none() && f.nonce == tref.nonce);
                if verified {
                    // We delivered before this ABORT arrived (the sender timed out on a lost
                    // or slow VERIFIED): say so again, so both sides agree on the outcome.
                    self.out.transmit.push_back(Frame::Verified(tref));
                } else {
                    // Idempotent: a late or crossed abort still gets its acknowledgement.
                    self.out.transmit.push_back(Frame::AbortAck(tref));
                }
                Ok(())
            }
            Frame::Commit(c) if !known => {
                self.out.transmit.push_back(Frame::Nack(Nack {
                    transfer: c.transfer,
                    code: ErrorCode::UNKNOWN_TRANSFER,
                    buffer: NONE_INDEX,
                    page: NONE_INDEX,
                    detail: "no reservation for this transfer".into(),
                }));
                self.out.stats.dropped_frames += 1;
                Err(FrameError::frame("COMMIT for an unknown transfer"))
            }
            other => {
                self.out.stats.dropped_frames += 1;
                let what = if known { "finished" } else { "unknown" };
                Err(FrameError::frame(format!(
                    "{} for a {what} transfer",
                    other.frame_type()
                )))
            }
        }
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
                });
                Next::Stay(State::Verifying(Verifying { commit: f.commit }))
            }
            State::Failing(f) if f.awaiting == Awaiting::Fence => {
                self.out.after_fence(&t.spec, f.reason, f.after, now)
            }
            other => Next::Stay(other),
        };
        self.settle(t.spec, next);
    }

    /// The driver hands back the digests of the landed memory, computed after the fence.
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
                        }));
                    self.out.transmit.push_back(Frame::Verified(transfer));
                    Next::Done(None)
                }
                Err(reason) => {
                    let (buffer, page) = match &reason {
                        FailureReason::DigestMismatch { buffer, page } => {
                            (*buffer, page.unwrap_or(NONE_INDEX))
                        }
                        _ => (NONE_INDEX, NONE_INDEX),
                    };
                    self.out.transmit.push_back(Frame::Nack(Nack {
                        transfer,
                        code: reason.code(),
                        buffer,
                        page,
                        detail: reason.to_string(),
                    }));
                    self.out
                        .fail(&t.spec, Pending::Nothing, reason, AfterFence::Nothing, now)
                }
            },
            // Failed while the digests were computed: they no longer read the pages.
            State::Failing(f) if f.awaiting == Awaiting::Digests => {
                self.out.after_fence(&t.spec, f.reason, f.after, now)
            }
            other => Next::Stay(other),
        };
        self.settle(t.spec, next);
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
                s @ State::AwaitingCommit(_) => self.out.fail(
                    &t.spec,
                    s.pending(),
                    FailureReason::Timeout {
                        waiting_for: Wait::Commit,
                    },
                    AfterFence::SendAbort(ErrorCode::TIMEOUT),
                    now,
                ),
                // The peer never acknowledged our abort; pages were released long ago.
                State::AwaitingAbortAck(_) => {
                    Next::Done(Some((ErrorCode::TIMEOUT, "abort unacknowledged".into())))
                }
                other => Next::Stay(other),
            };
            self.settle(t.spec, next);
        }
    }

    /// The connection is gone: every open transfer fails with [`FailureReason::PeerLost`],
    /// fencing first where writes could still land. No frames are sent.
    pub fn handle_peer_lost(&mut self, now: Instant) {
        self.lost = true;
        self.out.transmit.clear();
        let open = std::mem::take(&mut self.transfers);
        for (_, t) in open {
            let next = match t.state {
                State::AwaitingAbortAck(_) => {
                    Next::Done(Some((ErrorCode::SHUTDOWN, "peer lost".into())))
                }
                State::Failing(mut f) => {
                    f.after = AfterFence::Nothing;
                    Next::Stay(State::Failing(f))
                }
                s => self.out.fail(
                    &t.spec,
                    s.pending(),
                    FailureReason::PeerLost,
                    AfterFence::Nothing,
                    now,
                ),
            };
            self.settle(t.spec, next);
        }
        self.out.transmit.clear();
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
