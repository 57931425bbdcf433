//! The sender's public types: its configuration, the effects it asks of the driver, the
//! events it reports, and its counters.

use crate::wire::TransferId;
use std::time::Duration;

use crate::admission::Admitted;
use crate::error::FailureReason;
use crate::wire::{DigestAlgorithm, TransferRef};

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
    /// [`SenderSession::handle_write_outcome`](super::SenderSession::handle_write_outcome).
    PostWrites {
        /// The transfer.
        transfer: TransferRef,
        /// The writes, in ordinal order.
        writes: Vec<PageWrite>,
        /// The receiver's access descriptor from RESERVE.
        access: Vec<u8>,
    },
    /// Compute digests of the source pages (in transfer order), then call
    /// [`SenderSession::handle_digests`](super::SenderSession::handle_digests).
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
    ReleaseSource(TransferId),
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

/// Why [`SenderSession::submit`](super::SenderSession::submit) refused an admitted request.
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
