//! The receiver's public types: its configuration, what a reservation asks for and why it
//! may be refused, the effects it asks of the driver, the events it reports, its counters.

use crate::wire::TransferId;
use std::time::Duration;

use crate::error::FailureReason;
use crate::wire::{DigestAlgorithm, TransferRef};

/// Receiver session settings. The nonce seed is not among them: it is an argument of
/// [`ReceiverSession::new`](super::ReceiverSession::new), fresh per connection (SPEC.md
/// §5.2.1), so no configuration can carry a constant one to every connection.
///
/// ```compile_fail
/// // There is no nonce seed to forget in the configuration (SPEC.md §5.2.1).
/// let _ = kvwire_proto::receiver::ReceiverConfig::default().nonce_seed;
/// ```
#[derive(Clone, Debug)]
pub struct ReceiverConfig {
    /// How many finished transfers to remember for late frames.
    pub history: usize,
    /// How long to wait for ABORT_ACK after sending ABORT.
    pub abort_ack_timeout: Duration,
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        Self {
            history: 4096,
            abort_ack_timeout: Duration::from_secs(5),
        }
    }
}

/// What the engine asks to reserve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservationRequest {
    /// The transfer id (the request id both engines know).
    pub transfer_id: TransferId,
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

/// Why [`ReceiverSession::reserve`](super::ReceiverSession::reserve) refused a reservation before sending anything.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReserveError {
    /// A transfer with this id is open.
    DuplicateTransfer(TransferId),
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
    /// More than [`MAX_PAGES`](crate::wire::MAX_PAGES) pages, an access descriptor over
    /// [`MAX_ACCESS`](crate::wire::MAX_ACCESS) bytes, or a COMMIT that could not fit in one
    /// frame (see [`commit_fits`](crate::wire::commit_fits)).
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
    /// [`ReceiverSession::handle_fenced`](super::ReceiverSession::handle_fenced).
    Fence(TransferRef),
    /// Compute the transfer's digests over the landed pages, and the aux digest over
    /// `aux`, then call
    /// [`ReceiverSession::handle_digests`](super::ReceiverSession::handle_digests) — or,
    /// if the driver knows a reserved page did not receive all its bytes for this
    /// reservation,
    /// [`ReceiverSession::handle_missing_pages`](super::ReceiverSession::handle_missing_pages)
    /// instead.
    ComputeDigests {
        /// The transfer.
        transfer: TransferRef,
        /// With this algorithm.
        algorithm: DigestAlgorithm,
        /// Per-page digests too.
        page_digests: bool,
        /// The COMMIT's auxiliary record, to digest with the transfer's algorithm and
        /// binding.
        aux: Vec<u8>,
    },
    /// Return the transfer's pages to the pool. Always after its fence.
    Release(TransferRef),
    /// The transfer is moving off a failed lane and its old reservation is fenced: open a
    /// new access scope over the same pages on a live lane, then call
    /// [`ReceiverSession::handle_reopened`](super::ReceiverSession::handle_reopened) with
    /// its descriptor (or
    /// [`ReceiverSession::handle_reopen_failed`](super::ReceiverSession::handle_reopen_failed)).
    /// The pages stay leased to the transfer.
    Reopen(TransferRef),
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
    /// The auxiliary record that came with the pages (verified against its digest; may be
    /// empty).
    pub aux: Vec<u8>,
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
    /// Reservations moved off a failed lane (SPEC §9.2).
    pub moves: u64,
}
