//! Typed reasons a transfer fails, each mapped to a wire [`ErrorCode`].

use core::fmt;

use crate::wire::{ErrorCode, Frame, FrameType};

/// What a state was waiting for when its deadline passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Wait {
    /// Sender: a RESERVE for an admitted request.
    Reservation,
    /// Sender: its writes and digests, before the reservation's deadline.
    Writes,
    /// Receiver: the COMMIT.
    Commit,
    /// Sender: VERIFIED or NACK after its COMMIT.
    Verdict,
    /// Either side: the ABORT_ACK for its ABORT.
    AbortAck,
}

/// Which count in a COMMIT disagreed with the reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CountField {
    /// Tokens.
    Tokens,
    /// Pages.
    Pages,
    /// Bytes over all buffers.
    Bytes,
}

/// Why a transfer failed. Every variant names its cause precisely; [`FailureReason::code`]
/// gives the wire code carried in NACK, REJECT or ABORT.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureReason {
    /// Receiver: the sender rejected the reservation, carrying the request's original error
    /// (for example `PROMPT_EXCEEDS_POOL` from admission). No data was written.
    Rejected {
        /// The sender's code.
        code: ErrorCode,
        /// The sender's detail.
        detail: String,
    },
    /// Sender: the reservation disagreed with the request (token or page count, digest
    /// algorithm, malformed page list); the sender refused it with this code.
    ReservationRefused {
        /// The code sent in REJECT.
        code: ErrorCode,
        /// Details.
        detail: String,
    },
    /// Receiver: a count in the COMMIT differs from what was reserved.
    CountMismatch {
        /// Which count.
        field: CountField,
        /// What the reservation implies.
        expected: u64,
        /// What the commit carried.
        got: u64,
    },
    /// Receiver: a digest computed over the landed memory differs from the sender's.
    DigestMismatch {
        /// The first buffer whose digest differs.
        buffer: u32,
        /// The first page ordinal (within that buffer) whose digest differs, when the commit
        /// carried per-page digests.
        page: Option<u32>,
    },
    /// Receiver: the digest of the auxiliary record received differs from the sender's.
    AuxMismatch,
    /// Receiver: a reserved page did not receive all its bytes for this reservation (the
    /// transport's coverage check, SPEC.md §6), so its contents may be stale.
    PagesMissing {
        /// The first page ordinal found missing.
        first_missing: u32,
    },
    /// Receiver: the COMMIT's auxiliary record is longer than this receiver accepts.
    AuxTooLarge {
        /// Bytes carried.
        len: u32,
        /// This receiver's `max_aux`.
        max: u32,
    },
    /// Receiver: the COMMIT lacks a digest the reservation requires, or carries an
    /// all-zero one. Fail closed.
    MissingDigest {
        /// What was missing.
        detail: String,
    },
    /// Receiver: the COMMIT names another reservation's nonce.
    StaleNonce {
        /// The current reservation's nonce.
        expected: u64,
        /// The nonce carried.
        got: u64,
    },
    /// A deadline passed.
    Timeout {
        /// What was awaited.
        waiting_for: Wait,
    },
    /// The peer aborted the transfer.
    PeerAbort {
        /// The peer's code.
        code: ErrorCode,
        /// Pages the sender reported complete (0 from a receiver).
        completed_pages: u32,
    },
    /// The local engine aborted the transfer.
    LocalAbort {
        /// The code sent in ABORT.
        code: ErrorCode,
    },
    /// Sender: the receiver refused the commit.
    Nacked {
        /// The receiver's code.
        code: ErrorCode,
        /// The first bad buffer, if named.
        buffer: Option<u32>,
        /// The first bad page, if named.
        page: Option<u32>,
    },
    /// Sender: a data write failed at the transport.
    WriteFailed,
    /// The connection to the peer was lost.
    PeerLost,
    /// The peer stopped answering heartbeats within the liveness timeout (SPEC.md §8.3); the
    /// connection was closed. Retryable, on a new connection.
    PeerUnresponsive,
    /// Sender only: the COMMIT was sent but no verdict (VERIFIED, NACK, the receiver's ABORT
    /// or ABORT_ACK) came back before `cause` ended the transfer (a verdict or abort-ack
    /// deadline, a lost or unresponsive peer). The receiver may have delivered the pages or
    /// failed the transfer; only its side knows (SPEC.md §7.6). Never reported for a
    /// transfer whose COMMIT was not sent: those failures are definite.
    Unconfirmed {
        /// What ended the wait.
        cause: Box<FailureReason>,
    },
    /// The peer broke the protocol.
    ProtocolViolation {
        /// What happened.
        detail: String,
    },
}

impl FailureReason {
    /// Whether the request itself is sound and may be sent again on a working connection:
    /// the transfer failed in the transport (a write failed, the connection or queue pair
    /// was lost and rebuilt, a deadline passed, the peer aborted it with SHUTDOWN because
    /// its lane failed), or the sender was busy (its engine had not
    /// got to the request while the reservation was parked, or it held too many parked
    /// reservations: REJECT with UNKNOWN_REQUEST or PARKED_LIMIT, SPEC §7.6), not because
    /// of what was sent.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Rejected { code, .. } => {
                *code == ErrorCode::UNKNOWN_REQUEST || *code == ErrorCode::PARKED_LIMIT
            }
            // The peer gave the transfer up because its lane failed (SPEC §9.2, several
            // rails) or it is shutting down: the request itself is sound.
            Self::PeerAbort { code, .. } => *code == ErrorCode::SHUTDOWN,
            _ => matches!(
                self,
                Self::WriteFailed | Self::PeerLost | Self::PeerUnresponsive | Self::Timeout { .. }
            ),
        }
    }

    /// Whether this is [`FailureReason::Unconfirmed`]: the receiver may have delivered.
    pub fn is_unconfirmed(&self) -> bool {
        matches!(self, Self::Unconfirmed { .. })
    }

    /// The wire code for this reason.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Rejected { code, .. }
            | Self::ReservationRefused { code, .. }
            | Self::PeerAbort { code, .. }
            | Self::LocalAbort { code }
            | Self::Nacked { code, .. } => *code,
            Self::CountMismatch { .. } => ErrorCode::COUNT_MISMATCH,
            Self::DigestMismatch { .. } => ErrorCode::DIGEST_MISMATCH,
            Self::AuxMismatch => ErrorCode::AUX_MISMATCH,
            Self::PagesMissing { .. } => ErrorCode::PAGES_MISSING,
            Self::AuxTooLarge { .. } => ErrorCode::AUX_TOO_LARGE,
            Self::MissingDigest { .. } => ErrorCode::MISSING_DIGEST,
            Self::StaleNonce { .. } => ErrorCode::STALE_NONCE,
            Self::Timeout { .. } => ErrorCode::TIMEOUT,
            Self::WriteFailed => ErrorCode::WRITE_FAILED,
            Self::PeerLost => ErrorCode::SHUTDOWN,
            Self::PeerUnresponsive => ErrorCode::PEER_UNRESPONSIVE,
            Self::Unconfirmed { cause } => cause.code(),
            Self::ProtocolViolation { .. } => ErrorCode::PROTOCOL_VIOLATION,
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rejected { code, detail } => {
                write!(f, "rejected by the sender: {code}: {detail}")
            }
            Self::ReservationRefused { code, detail } => {
                write!(f, "reservation refused: {code}: {detail}")
            }
            Self::CountMismatch {
                field,
                expected,
                got,
            } => write!(
                f,
                "{field:?} count mismatch: reserved {expected}, commit says {got}"
            ),
            Self::DigestMismatch { buffer, page } => match page {
                Some(p) => write!(f, "digest mismatch in buffer {buffer}, page ordinal {p}"),
                None => write!(f, "digest mismatch in buffer {buffer}"),
            },
            Self::AuxMismatch => write!(f, "auxiliary record digest mismatch"),
            Self::PagesMissing { first_missing } => write!(
                f,
                "reserved pages did not receive all their bytes (first: page ordinal {first_missing})"
            ),
            Self::AuxTooLarge { len, max } => write!(
                f,
                "auxiliary record of {len} bytes exceeds this receiver's limit of {max}"
            ),
            Self::MissingDigest { detail } => write!(f, "missing digest: {detail}"),
            Self::StaleNonce { expected, got } => {
                write!(
                    f,
                    "stale nonce {got:#x} (current reservation {expected:#x})"
                )
            }
            Self::Timeout { waiting_for } => write!(f, "timed out waiting for {waiting_for:?}"),
            Self::PeerAbort {
                code,
                completed_pages,
            } => write!(
                f,
                "aborted by the peer: {code} ({completed_pages} pages completed)"
            ),
            Self::LocalAbort { code } => write!(f, "aborted locally: {code}"),
            Self::Nacked { code, buffer, page } => {
                write!(f, "receiver refused the commit: {code}")?;
                if let Some(b) = buffer {
                    write!(f, " (buffer {b}")?;
                    if let Some(p) = page {
                        write!(f, ", page {p}")?;
                    }
                    write!(f, ")")?;
                }
                Ok(())
            }
            Self::WriteFailed => write!(f, "a data write failed"),
            Self::PeerLost => write!(f, "connection to the peer lost"),
            Self::PeerUnresponsive => write!(f, "peer unresponsive (silent, or not reading, for the liveness timeout)"),
            Self::Unconfirmed { cause } => write!(
                f,
                "unconfirmed: committed, but no verdict came back ({cause}); the receiver may have delivered"
            ),
            Self::ProtocolViolation { detail } => write!(f, "protocol violation: {detail}"),
        }
    }
}

impl std::error::Error for FailureReason {}

/// A frame that arrived in a state that does not accept it. Made only by [`unexpected`],
/// the one place wrong-message errors come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnexpectedFrame {
    /// The frame type received.
    pub got: FrameType,
    /// The state it arrived in.
    pub state: &'static str,
    /// The frame types that state accepts.
    pub expected: &'static [FrameType],
}

impl fmt::Display for UnexpectedFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unexpected {} in state {} (expected one of {:?})",
            self.got, self.state, self.expected
        )
    }
}

/// Builds the error for a frame a state does not accept.
pub fn unexpected(
    frame: &Frame,
    state: &'static str,
    expected: &'static [FrameType],
) -> UnexpectedFrame {
    UnexpectedFrame {
        got: frame.frame_type(),
        state,
        expected,
    }
}
