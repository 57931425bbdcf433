//! The sender's public types: its configuration, the effects it asks of the driver, the
//! events it reports, and its counters.

use crate::wire::TransferId;
use std::time::Duration;

use crate::admission::{Admitted, Rejected};
use crate::error::FailureReason;
use crate::wire::{DigestAlgorithm, ErrorCode, TransferRef};

/// Sender session settings.
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// How long an admitted request waits for its reservation.
    pub reservation_timeout: Duration,
    /// The longest a reservation that names no known request is held (the request may
    /// still be on its way to this engine) before it is rejected as `UNKNOWN_REQUEST`: it is
    /// held until its own deadline (`deadline_ms` from its receipt), at most this long
    /// (SPEC.md §5.1).
    pub parked_reservation_timeout: Duration,
    /// How long to wait for VERIFIED or NACK after COMMIT.
    pub verdict_timeout: Duration,
    /// How long to wait for ABORT_ACK after ABORT.
    pub abort_ack_timeout: Duration,
    /// How many finished and retired requests to remember for late reservations.
    pub history: usize,
    /// How many reservations naming no known request may be parked at once; a RESERVE
    /// beyond it is refused at once with `PARKED_LIMIT` (SPEC.md §5.1).
    pub max_parked: usize,
}

impl Default for SenderConfig {
    fn default() -> Self {
        Self {
            reservation_timeout: Duration::from_secs(30),
            parked_reservation_timeout: Duration::from_secs(60),
            verdict_timeout: Duration::from_secs(10),
            abort_ack_timeout: Duration::from_secs(5),
            history: 4096,
            max_parked: 256,
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
    /// Digest the source pages of ordinals `first .. first + pages` (one chunk of the
    /// transfer), continuing the transfer's digests from where its previous job for this
    /// transfer left them (jobs of one transfer run in the order emitted; the first starts
    /// at ordinal 0). Then, on a non-final chunk (`aux` is `None`), call
    /// [`SenderSession::handle_chunk_digested`](super::SenderSession::handle_chunk_digested);
    /// on the final one, finish the digests, add the aux digest over `aux`, and call
    /// [`SenderSession::handle_digests`](super::SenderSession::handle_digests). A job reads
    /// the source until it is reported.
    ComputeDigests {
        /// The transfer (the digests are bound to it).
        transfer: TransferRef,
        /// With this algorithm.
        algorithm: DigestAlgorithm,
        /// Per-page digests too.
        page_digests: bool,
        /// The first ordinal of the chunk.
        first: u32,
        /// Pages in the chunk (at least 1).
        pages: u32,
        /// `Some` exactly on the final chunk: the auxiliary record (possibly empty) to digest
        /// into [`TransferDigests::aux`](crate::wire::TransferDigests::aux).
        aux: Option<Vec<u8>>,
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
    /// The receiver named a request this session has no open transfer for: its RESERVE
    /// was parked (`refusal` `None`), or its ABORT refused the request before the engine
    /// submitted it (`refusal`: the ABORT's code; a submit of the id will fail with it,
    /// SPEC.md §5.1). The request's KV goes to this connection's peer: an engine serving
    /// several receivers routes the request here by it.
    Announced {
        /// The request.
        transfer_id: TransferId,
        /// The receiver's code, when it refused the request.
        refusal: Option<crate::wire::ErrorCode>,
    },
}

/// Why [`SenderSession::retire`](super::SenderSession::retire) refused to retire a request.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetireError {
    /// A transfer with this id is open: a rejection cannot retire it (SPEC.md §5.1). Nothing
    /// changed; end the open transfer with `abort` if that is what the engine means.
    Open(Rejected),
}

impl std::fmt::Display for RetireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Open(r) => write!(
                f,
                "transfer {} is open; its rejection ({}) retires nothing",
                r.transfer_id, r.error
            ),
        }
    }
}

impl std::error::Error for RetireError {}

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
    /// The request was admitted with another `tokens_per_page` than the connection's layout:
    /// its page count is not `ceil(tokens / tokens_per_page)` of the layout, so every
    /// reservation for it would be refused (SPEC.md §5.1).
    LayoutMismatch {
        /// The request.
        admitted: Admitted,
        /// Pages the layout gives for its tokens.
        layout_pages: u64,
    },
    /// The receiver aborted this transfer's reservation while it was parked (before the
    /// request was submitted here): nothing is written; `code` is the abort's.
    AbortedByPeer {
        /// The request.
        admitted: Admitted,
        /// The code of the receiver's ABORT.
        code: ErrorCode,
    },
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::DuplicateTransfer(a) => write!(f, "transfer {} is already open", a.transfer_id()),
            Self::SourcePageCount { admitted, given } => write!(
                f,
                "{given} source pages given, the request needs {}",
                admitted.pages()
            ),
            Self::PeerLost(_) => write!(f, "the connection is lost"),
            Self::LayoutMismatch {
                admitted,
                layout_pages,
            } => write!(
                f,
                "admitted as {} pages for {} tokens, but the connection's layout needs {layout_pages}: the admission policy's tokens per page is not the layout's",
                admitted.pages(),
                admitted.tokens()
            ),
            Self::AbortedByPeer { admitted, code } => write!(
                f,
                "the receiver aborted transfer {}'s reservation before it was submitted: {code}",
                admitted.transfer_id()
            ),
        }
    }
}

impl std::error::Error for SubmitError {}

/// Why [`SenderSession::submit_chunk`](super::SenderSession::submit_chunk) refused a chunk.
/// Nothing changed in the session; the transfer, if open, goes on.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChunkError {
    /// No open transfer has this id (never opened, or already finished).
    UnknownTransfer(TransferId),
    /// The transfer already received its final chunk.
    AfterFinal(TransferId),
    /// The transfer is being abandoned (drained, aborted or failed); its outcome comes as a
    /// [`SenderEvent::Failed`].
    TransferEnding(TransferId),
    /// The chunk has no pages.
    EmptyChunk,
    /// The chunk would bring the transfer past its admitted page count.
    TooManyPages {
        /// Pages in the chunk.
        given: usize,
        /// Pages the transfer still expects.
        remaining: u32,
    },
    /// An auxiliary record on a chunk that is not the final one.
    AuxBeforeFinal,
    /// The auxiliary record is longer than the receiver accepts (its hello's `max_aux`).
    AuxTooLarge {
        /// Bytes given.
        len: usize,
        /// The receiver's limit.
        max: u32,
    },
    /// The connection is lost.
    PeerLost,
}

impl std::fmt::Display for ChunkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::UnknownTransfer(id) => write!(f, "no open transfer {id}"),
            Self::AfterFinal(id) => write!(f, "transfer {id} already has its final chunk"),
            Self::TransferEnding(id) => write!(f, "transfer {id} is being abandoned"),
            Self::EmptyChunk => write!(f, "a chunk needs at least one page"),
            Self::TooManyPages { given, remaining } => write!(
                f,
                "chunk of {given} pages, the transfer expects {remaining} more"
            ),
            Self::AuxBeforeFinal => write!(f, "an auxiliary record goes with the final chunk only"),
            Self::AuxTooLarge { len, max } => write!(
                f,
                "auxiliary record of {len} bytes, the receiver accepts at most {max}"
            ),
            Self::PeerLost => write!(f, "the connection is lost"),
        }
    }
}

impl std::error::Error for ChunkError {}

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
    /// Transfers moved by the receiver off a failed lane (SPEC §9.2).
    pub moves: u64,
}
