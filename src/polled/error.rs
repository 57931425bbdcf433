//! The facade's one error type: a kind with a stable numeric code, a message, whether the
//! same request may be tried again, and the wire code that travelled with it (a rejection
//! carries the sender's original admission error, an abort the aborting side's code).

use std::fmt;

use kvwire_proto::admission::AdmissionError;
use kvwire_proto::wire::ErrorCode;
use kvwire_proto::FailureReason;

use crate::engine::{EngineError, TransferError};

macro_rules! kinds {
    ($( $(#[$m:meta])* $name:ident = $code:expr ),* $(,)?) => {
        /// What went wrong, with a stable numeric code ([`ErrorKind::code`]); the C ABI
        /// returns these codes (`KVWIRE_ERR_*`) and the Python binding names its exception
        /// classes after [`ErrorKind::name`]. Codes are never reused or renumbered; new kinds
        /// get new codes.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ErrorKind {
            $( $(#[$m])* $name = $code, )*
        }

        impl ErrorKind {
            /// Every kind, in code order.
            pub const ALL: &'static [ErrorKind] = &[$(ErrorKind::$name),*];

            /// The stable numeric code (never 0: 0 is success in the C ABI).
            pub const fn code(self) -> i32 {
                self as i32
            }

            /// The kind's name (`"DigestMismatch"`, ...), as the Python binding names its
            /// exception classes.
            pub const fn name(self) -> &'static str {
                match self {
                    $( ErrorKind::$name => stringify!($name), )*
                }
            }

            /// The kind with this code.
            pub fn from_code(code: i32) -> Option<Self> {
                Self::ALL.iter().copied().find(|k| k.code() == code)
            }
        }
    };
}

kinds! {
    // Calls.
    /// An argument is invalid (a null or dangling pointer caught at the C boundary, a page
    /// count that does not fit the tokens, an address that does not parse, ...).
    InvalidArgument = 1,
    /// The call does not fit the transfer's state (send before the transfer is open, init
    /// twice, pages asked for before Success, ...).
    InvalidState = 2,
    /// A caller's buffer is too small for what it was to receive (the C ABI's copies).
    BufferTooSmall = 3,
    /// The node refused to start: its configuration or memory is inconsistent (e.g. the KV
    /// pool holds fewer tokens than the served context length).
    ConfigError = 4,
    /// A connection could not be opened or accepted (socket, transport set-up).
    ConnectFailed = 5,
    /// The peer (or this node) refused the handshake: layout, fingerprint or version
    /// mismatch; the wire code says which.
    HandshakeRefused = 6,
    /// Authentication failed: a wrong or missing pre-shared key at the handshake, or an
    /// altered, replayed or foreign frame that closed the connection.
    Unauthenticated = 7,
    /// A bounded wait inside a call ran out (not a transfer's deadline: that is `Timeout`).
    WaitTimedOut = 8,
    /// A panic inside kvwire, caught at the boundary (a bug: please report it).
    Internal = 9,
    /// Peer discovery failed (the bootstrap server or etcd unreachable, a bad record, no
    /// such peer).
    DiscoveryError = 10,
    /// A peer found through discovery has another KV layout or model fingerprint (refused
    /// before it is dialled; the handshake refuses the same as `HandshakeRefused`).
    LayoutMismatch = 11,

    // Transfers: one per protocol failure reason (`FailureReason`).
    /// The request was rejected at the sender's admission; the wire code is the original
    /// error (e.g. `PROMPT_EXCEEDS_CONTEXT`), on both sides.
    Rejected = 20,
    /// The sender refused the reservation (token or page count, digest algorithm).
    ReservationRefused = 21,
    /// A count in the commit differs from the reservation.
    CountMismatch = 22,
    /// A digest of the landed memory differs from the sender's.
    DigestMismatch = 23,
    /// The auxiliary record's digest differs.
    AuxMismatch = 24,
    /// A reserved page did not receive all its bytes.
    PagesMissing = 25,
    /// The auxiliary record is longer than the receiver accepts.
    AuxTooLarge = 26,
    /// The commit lacked a required digest (fail closed).
    MissingDigest = 27,
    /// The commit named another reservation's nonce.
    StaleNonce = 28,
    /// A transfer's deadline passed.
    Timeout = 29,
    /// The peer aborted the transfer; the wire code is the peer's.
    PeerAborted = 30,
    /// This engine aborted the transfer.
    Aborted = 31,
    /// The receiver refused the commit.
    Nacked = 32,
    /// A data write failed at the transport.
    WriteFailed = 33,
    /// The connection to the peer was lost.
    PeerLost = 34,
    /// The peer stopped answering heartbeats.
    PeerUnresponsive = 35,
    /// Sender only: the commit was sent but no verdict came back; the receiver may have
    /// delivered ([`Error::cause`] says what ended the wait). Its [`Error::is_retryable`] is
    /// the cause's (the request is sound), but the sender must not send it again on its own:
    /// only the receiver knows, and it reserves again if it did not deliver (SPEC §7.6).
    Unconfirmed = 36,
    /// The peer broke the protocol.
    ProtocolViolation = 37,
    /// The reservation could not be made here (a page already held, the pool full, ...).
    ReservationFailed = 38,
    /// The transfer or one of its chunks could not start on the sender (pages out of
    /// range or held, too many pages, aux before the final chunk, ...).
    InvalidRequest = 39,
    /// Another transfer failure (a reason newer than this facade).
    TransferFailed = 40,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failure of a facade call or of a transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    retryable: bool,
    wire_code: Option<ErrorCode>,
    cause: Option<ErrorKind>,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for Error {}

impl Error {
    /// An error of `kind`, not retryable, with no wire code.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            retryable: false,
            wire_code: None,
            cause: None,
        }
    }

    pub(crate) fn retryable(mut self, retryable: bool) -> Self {
        self.retryable = retryable;
        self
    }

    pub(crate) fn with_code(mut self, code: ErrorCode) -> Self {
        self.wire_code = Some(code);
        self
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    pub(crate) fn state(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidState, message)
    }

    /// This engine's abort, as the transfer reports it at once.
    pub(crate) fn aborted() -> Self {
        Self::new(ErrorKind::Aborted, "aborted locally: CANCELLED").with_code(ErrorCode::CANCELLED)
    }

    /// The kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The kind's stable numeric code.
    pub fn code(&self) -> i32 {
        self.kind.code()
    }

    /// The message (what `Display` prints after the kind).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether the same request may be tried again (on a new connection if this one is
    /// gone): the transfer failed in the transport or a deadline passed, not because of
    /// what was sent. Rejections, digest mismatches, aborts and authentication failures are
    /// not retryable.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// The wire error code that came with the failure: the sender's original admission
    /// error of a rejection (on both sides), the code of an abort or NACK, a handshake
    /// refusal's reason; `None` where nothing travelled.
    pub fn wire_code(&self) -> Option<ErrorCode> {
        self.wire_code
    }

    /// For [`ErrorKind::Unconfirmed`]: the kind of what ended the wait for a verdict.
    pub fn cause(&self) -> Option<ErrorKind> {
        self.cause
    }

    /// A protocol failure reason.
    pub fn from_reason(r: &FailureReason) -> Self {
        use FailureReason as F;
        let kind = match r {
            // The sender's engine cancelled the request before writing anything: kvwire
            // answers the reservation with REJECT carrying CANCELLED. To the receiver that
            // is the peer's abort.
            F::Rejected { code, .. } if *code == ErrorCode::CANCELLED => ErrorKind::PeerAborted,
            F::Rejected { .. } => ErrorKind::Rejected,
            F::ReservationRefused { .. } => ErrorKind::ReservationRefused,
            F::CountMismatch { .. } => ErrorKind::CountMismatch,
            F::DigestMismatch { .. } => ErrorKind::DigestMismatch,
            F::AuxMismatch => ErrorKind::AuxMismatch,
            F::PagesMissing { .. } => ErrorKind::PagesMissing,
            F::AuxTooLarge { .. } => ErrorKind::AuxTooLarge,
            F::MissingDigest { .. } => ErrorKind::MissingDigest,
            F::StaleNonce { .. } => ErrorKind::StaleNonce,
            F::Timeout { .. } => ErrorKind::Timeout,
            F::PeerAbort { .. } => ErrorKind::PeerAborted,
            F::LocalAbort { .. } => ErrorKind::Aborted,
            F::Nacked { .. } => ErrorKind::Nacked,
            F::WriteFailed => ErrorKind::WriteFailed,
            F::PeerLost => ErrorKind::PeerLost,
            F::PeerUnresponsive => ErrorKind::PeerUnresponsive,
            F::Unconfirmed { .. } => ErrorKind::Unconfirmed,
            F::ProtocolViolation { .. } => ErrorKind::ProtocolViolation,
            #[allow(unreachable_patterns)]
            _ => ErrorKind::TransferFailed,
        };
        let mut e = Self::new(kind, r.to_string())
            .retryable(r.is_retryable())
            .with_code(r.code());
        if let F::Unconfirmed { cause } = r {
            e.cause = Some(Self::from_reason(cause).kind);
            e.retryable = cause.is_retryable();
        }
        e
    }

    /// A rejection at this sender's admission: the same kind and wire code the receiver
    /// gets in REJECT.
    pub fn from_admission(a: &AdmissionError) -> Self {
        Self::new(ErrorKind::Rejected, format!("rejected at admission: {a}")).with_code(a.code())
    }

    /// A transfer error of the engine API.
    pub fn from_transfer(e: &TransferError) -> Self {
        let retryable = e.is_retryable();
        match e {
            TransferError::Failed(r) => Self::from_reason(r),
            TransferError::Rejected(a) => Self::from_admission(a),
            TransferError::Unauthenticated(_) => {
                Self::new(ErrorKind::Unauthenticated, e.to_string())
            }
            TransferError::ConnectionClosed => {
                Self::new(ErrorKind::PeerLost, e.to_string()).retryable(true)
            }
            TransferError::Reserve(crate::engine::ReceiveError::ExceedsContext { .. }) => {
                Self::new(ErrorKind::Rejected, e.to_string())
                    .with_code(ErrorCode::PROMPT_EXCEEDS_CONTEXT)
            }
            TransferError::Reserve(_) => {
                Self::new(ErrorKind::ReservationFailed, e.to_string()).retryable(retryable)
            }
            TransferError::Start(_) | TransferError::Chunk(_) => {
                Self::new(ErrorKind::InvalidRequest, e.to_string()).retryable(retryable)
            }
            #[allow(unreachable_patterns)]
            _ => Self::new(ErrorKind::TransferFailed, e.to_string()).retryable(retryable),
        }
    }

    /// A connection that could not be opened.
    pub fn from_engine(e: &EngineError) -> Self {
        let msg = e.to_string();
        match e.refusal_code() {
            Some(c) if c == ErrorCode::AUTH_FAILED || c == ErrorCode::AUTH_MISMATCH => {
                Self::new(ErrorKind::Unauthenticated, msg).with_code(c)
            }
            Some(c) => Self::new(ErrorKind::HandshakeRefused, msg).with_code(c),
            None => match e {
                EngineError::Io(_) => Self::new(ErrorKind::ConnectFailed, msg).retryable(true),
                EngineError::Config(_) | EngineError::Pool(_) => {
                    Self::new(ErrorKind::ConfigError, msg)
                }
                _ => Self::new(ErrorKind::ConnectFailed, msg),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_nonzero_and_round_trip() {
        let mut seen = std::collections::HashSet::new();
        for &k in ErrorKind::ALL {
            assert!(k.code() > 0, "{k}");
            assert!(seen.insert(k.code()), "{k}: code {} twice", k.code());
            assert_eq!(ErrorKind::from_code(k.code()), Some(k));
        }
        assert_eq!(ErrorKind::from_code(0), None);
    }

    #[test]
    fn a_rejection_keeps_the_original_code_and_is_not_retryable() {
        let r = FailureReason::Rejected {
            code: ErrorCode::PROMPT_EXCEEDS_CONTEXT,
            detail: "too long".into(),
        };
        let e = Error::from_reason(&r);
        assert_eq!(e.kind(), ErrorKind::Rejected);
        assert_eq!(e.wire_code(), Some(ErrorCode::PROMPT_EXCEEDS_CONTEXT));
        assert!(!e.is_retryable());
        let lost = Error::from_reason(&FailureReason::PeerLost);
        assert_eq!(lost.kind(), ErrorKind::PeerLost);
        assert!(lost.is_retryable());
        let unconfirmed = Error::from_reason(&FailureReason::Unconfirmed {
            cause: Box::new(FailureReason::PeerUnresponsive),
        });
        assert_eq!(unconfirmed.kind(), ErrorKind::Unconfirmed);
        assert_eq!(unconfirmed.cause(), Some(ErrorKind::PeerUnresponsive));
        assert!(unconfirmed.is_retryable());
    }
}
