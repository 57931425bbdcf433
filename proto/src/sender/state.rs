//! The states of one sender transfer, one type per state, and what the drain of an
//! abandoned transfer still waits for (posted writes and digest jobs, counted).

use std::time::Instant;

use crate::error::FailureReason;
use crate::wire::{DigestAlgorithm, ErrorCode, Reserve, TransferDigests};

#[derive(Clone, Debug)]
pub(super) struct AwaitingReservation {
    pub(super) deadline: Instant,
}

/// What an accepted reservation fixes for every chunk still to come.
#[derive(Clone, Debug)]
pub(super) struct Reserved {
    pub(super) digest: DigestAlgorithm,
    pub(super) page_digests: bool,
    /// Destination pages, in ordinal order.
    pub(super) pages: Vec<u32>,
    pub(super) access: Vec<u8>,
}

#[derive(Clone, Debug)]
pub(super) struct Writing {
    pub(super) deadline: Instant,
    pub(super) reserved: Reserved,
    /// Ordinals `0 .. posted` have had their writes and digest job emitted.
    pub(super) posted: u32,
    /// Page writes completed.
    pub(super) completed: u32,
    /// Digest jobs emitted and not yet reported (each still reads the source).
    pub(super) digest_jobs: u32,
    /// The final digest job's result.
    pub(super) digests: Option<TransferDigests>,
}

/// What follows the drain of an abandoned transfer.
#[derive(Clone, Debug)]
pub(super) enum AfterDrain {
    SendAbort(ErrorCode),
    SendAbortAck,
    Nothing,
    /// The transfer's lane failed here: wait for the receiver to move it (SPEC §9.2).
    AwaitMove,
    /// The receiver moved the transfer: take this reservation (received then) and write
    /// every page again under it.
    Move(Box<Reserve>, Instant),
}

impl AfterDrain {
    /// Whether the drain leads to a move rather than to the transfer's end.
    pub(super) fn moves(&self) -> bool {
        matches!(self, Self::AwaitMove | Self::Move(..))
    }
}

#[derive(Clone, Debug)]
pub(super) struct Draining {
    pub(super) completed: u32,
    /// Page writes reported (any outcome); the drain waits until it reaches `posted`.
    pub(super) accounted: u32,
    /// Page writes emitted in `PostWrites`.
    pub(super) posted: u32,
    /// Digest jobs still reading the source.
    pub(super) digest_jobs: u32,
    pub(super) reason: FailureReason,
    pub(super) after: AfterDrain,
    /// The COMMIT was sent: an end without a verdict is [`FailureReason::Unconfirmed`].
    pub(super) committed: bool,
}

#[derive(Clone, Debug)]
pub(super) struct AwaitingVerdict {
    pub(super) deadline: Instant,
}

/// The transfer's lane failed at this end: its writes are drained, its source still held,
/// and the receiver's RESERVE moving it to a live lane is awaited (SPEC §9.2).
#[derive(Clone, Debug)]
pub(super) struct AwaitingMove {
    pub(super) deadline: Instant,
    /// The COMMIT had been sent on the failed lane.
    pub(super) committed: bool,
}

#[derive(Clone, Debug)]
pub(super) struct AwaitingAbortAck {
    pub(super) deadline: Instant,
    /// Why the transfer was abandoned; reported when the abort resolves, unless the receiver
    /// answers VERIFIED (it had delivered before our ABORT arrived).
    pub(super) reason: FailureReason,
    /// The COMMIT was sent before the ABORT: an end without the receiver's answer is
    /// [`FailureReason::Unconfirmed`] (SPEC.md §7.6).
    pub(super) committed: bool,
}

impl AwaitingAbortAck {
    /// What to report when the abort ends without the receiver's answer (its deadline, or
    /// the connection's end): unconfirmed when the COMMIT had been sent.
    pub(super) fn unanswered(self) -> FailureReason {
        unconfirmed_if(self.committed, self.reason)
    }
}

/// `reason`, or [`FailureReason::Unconfirmed`] around it when the COMMIT had been sent.
pub(super) fn unconfirmed_if(committed: bool, reason: FailureReason) -> FailureReason {
    if committed {
        FailureReason::Unconfirmed {
            cause: Box::new(reason),
        }
    } else {
        reason
    }
}

#[derive(Clone, Debug)]
pub(super) enum State {
    AwaitingReservation(AwaitingReservation),
    Writing(Writing),
    Draining(Draining),
    AwaitingVerdict(AwaitingVerdict),
    AwaitingMove(AwaitingMove),
    AwaitingAbortAck(AwaitingAbortAck),
}

impl State {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Self::AwaitingReservation(_) => "AwaitingReservation",
            Self::Writing(_) => "Writing",
            Self::Draining(_) => "Draining",
            Self::AwaitingVerdict(_) => "AwaitingVerdict",
            Self::AwaitingMove(_) => "AwaitingMove",
            Self::AwaitingAbortAck(_) => "AwaitingAbortAck",
        }
    }

    pub(super) fn deadline(&self) -> Option<Instant> {
        match self {
            Self::AwaitingReservation(s) => Some(s.deadline),
            Self::Writing(s) => Some(s.deadline),
            Self::AwaitingVerdict(s) => Some(s.deadline),
            Self::AwaitingMove(s) => Some(s.deadline),
            Self::AwaitingAbortAck(s) => Some(s.deadline),
            Self::Draining(_) => None,
        }
    }
}
