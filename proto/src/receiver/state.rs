//! The states of one receiver transfer, one type per state, and what a failing transfer
//! still waits for before its pages may be released.

use std::time::{Duration, Instant};

use crate::error::FailureReason;
use crate::wire::{Commit, DigestAlgorithm, ErrorCode, TransferRef};

#[derive(Clone, Debug)]
pub(super) struct AwaitingCommit {
    pub(super) deadline: Instant,
}

/// The transfer's lane failed before its COMMIT came (SPEC §9.2, moving a transfer): the
/// reservation is being fenced and its pages given a scope on a live lane, after which a
/// RESERVE with a fresh nonce goes out for the same pages.
#[derive(Clone, Debug)]
pub(super) struct Moving {
    /// The commit deadline of the reservation being moved.
    pub(super) deadline: Instant,
    /// Whether the old reservation's fence completed (the driver was then asked to reopen).
    pub(super) fenced: bool,
}

#[derive(Clone, Debug)]
pub(super) struct FencingForVerify {
    pub(super) commit: Commit,
}

#[derive(Clone, Debug)]
pub(super) struct Verifying {
    pub(super) commit: Commit,
}

/// What follows the fence of a failed transfer.
#[derive(Clone, Debug)]
pub(super) enum AfterFence {
    /// Send ABORT with this code and wait for ABORT_ACK.
    SendAbort(ErrorCode),
    /// Send ABORT_ACK (the peer aborted).
    SendAbortAck,
    /// Nothing to send (rejected, or the peer is gone).
    Nothing,
}

/// The local effect a failing transfer waits for before its pages may be released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Awaiting {
    /// The fence: a write for the transfer could still land.
    Fence,
    /// A digest computation over the pages, still reading them.
    Digests,
}

/// What a transition into failure must still wait for, given the state it leaves.
pub(super) enum Pending {
    /// Writes may land and no fence was requested: request one.
    NoFenceYet,
    /// Already waiting on this effect.
    InFlight(Awaiting),
    /// Fenced, nothing reads the pages: release now.
    Nothing,
}

#[derive(Clone, Debug)]
pub(super) struct Failing {
    pub(super) reason: FailureReason,
    pub(super) after: AfterFence,
    pub(super) awaiting: Awaiting,
}

#[derive(Clone, Debug)]
pub(super) struct AwaitingAbortAck {
    pub(super) deadline: Instant,
    /// The failure already reported (code, detail): what the history records however the
    /// abort resolves (SPEC.md §7.3).
    pub(super) outcome: (ErrorCode, String),
}

#[derive(Clone, Debug)]
pub(super) enum State {
    AwaitingCommit(AwaitingCommit),
    Moving(Moving),
    FencingForVerify(FencingForVerify),
    Verifying(Verifying),
    Failing(Failing),
    AwaitingAbortAck(AwaitingAbortAck),
}

impl State {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Self::AwaitingCommit(_) => "AwaitingCommit",
            Self::Moving(_) => "Moving",
            Self::FencingForVerify(_) => "FencingForVerify",
            Self::Verifying(_) => "Verifying",
            Self::Failing(_) => "Failing",
            Self::AwaitingAbortAck(_) => "AwaitingAbortAck",
        }
    }

    pub(super) fn deadline(&self) -> Option<Instant> {
        match self {
            Self::AwaitingCommit(s) => Some(s.deadline),
            Self::Moving(s) => Some(s.deadline),
            Self::AwaitingAbortAck(s) => Some(s.deadline),
            _ => None,
        }
    }

    /// What a failure from this state must wait for before releasing pages.
    pub(super) fn pending(&self) -> Pending {
        match self {
            Self::AwaitingCommit(_) => Pending::NoFenceYet,
            Self::Moving(m) if m.fenced => Pending::Nothing,
            Self::Moving(_) => Pending::InFlight(Awaiting::Fence),
            Self::FencingForVerify(_) => Pending::InFlight(Awaiting::Fence),
            Self::Verifying(_) => Pending::InFlight(Awaiting::Digests),
            Self::Failing(f) => Pending::InFlight(f.awaiting),
            Self::AwaitingAbortAck(_) => Pending::Nothing,
        }
    }
}

/// The fixed facts of one reservation.
#[derive(Clone, Debug)]
pub(super) struct Spec {
    pub(super) transfer: TransferRef,
    pub(super) tokens: u32,
    pub(super) pages: u32,
    pub(super) bytes: u64,
    pub(super) buffers: usize,
    pub(super) digest: DigestAlgorithm,
    pub(super) page_digests: bool,
    /// The longest aux record this receiver accepts (its hello's `max_aux`).
    pub(super) max_aux: u32,
    /// The reservation's timeout (RESERVE's `deadline_ms`), again for a moved reservation.
    pub(super) timeout: Duration,
    /// Nonces of this transfer's earlier reservations, moved off failed lanes (SPEC §9.2):
    /// a COMMIT naming one is the sender's late frame for this same transfer.
    pub(super) moved_from: Vec<u64>,
}
