//! Wire enums: integer newtypes with named constants.
//!
//! A code received from a peer is kept as the integer it was, so an unknown code is reported
//! as such (`Unknown(0x1234)`) rather than mangled into a neighbouring variant. Each type
//! knows the set of codes this implementation understands ([`FrameType::is_known`] etc.).

use core::fmt;

macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub struct $name:ident($repr:ty) {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal => $text:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub $repr);

        impl $name {
            $( $(#[$vmeta])* pub const $variant: Self = Self($value); )*

            /// Every code this implementation knows, in ascending order.
            pub const KNOWN: &'static [Self] = &[$(Self::$variant),*];

            /// The specification's name of this code, or `None` for an unknown code.
            pub const fn name(self) -> Option<&'static str> {
                match self.0 {
                    $( $value => Some($text), )*
                    _ => None,
                }
            }

            /// Whether this implementation knows the code.
            pub const fn is_known(self) -> bool {
                self.name().is_some()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.name() {
                    Some(n) => f.write_str(n),
                    None => write!(f, "Unknown({:#x})", self.0),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(self, f)
            }
        }
    };
}

wire_enum! {
    /// The type of a frame (header bytes 6..8).
    pub struct FrameType(u16) {
        /// Connection opening, client to server.
        HELLO = 0x0001 => "HELLO",
        /// Connection accepted, server to client; carries the server's own hello body.
        HELLO_ACK = 0x0002 => "HELLO_ACK",
        /// Connection refused, with a reason.
        HELLO_REJECT = 0x0003 => "HELLO_REJECT",
        /// Client to server, sealed: the client holds the connection keys (authenticated
        /// handshakes only).
        HELLO_CONFIRM = 0x0004 => "HELLO_CONFIRM",
        /// Receiver to sender: pages reserved for a transfer.
        RESERVE = 0x0010 => "RESERVE",
        /// Sender to receiver: the request behind a reservation was rejected; no data follows.
        REJECT = 0x0011 => "REJECT",
        /// Sender to receiver: all writes are done; counts and digests follow.
        COMMIT = 0x0012 => "COMMIT",
        /// Receiver to sender: the transfer verified and was delivered.
        VERIFIED = 0x0013 => "VERIFIED",
        /// Receiver to sender: the transfer failed verification.
        NACK = 0x0014 => "NACK",
        /// Either side: the transfer is abandoned.
        ABORT = 0x0015 => "ABORT",
        /// Either side: acknowledges an ABORT.
        ABORT_ACK = 0x0016 => "ABORT_ACK",
        /// Either side, after the handshake: a heartbeat; the peer answers PONG with the same
        /// token (SPEC.md §8.3).
        PING = 0x0020 => "PING",
        /// Either side: the answer to a PING, echoing its token.
        PONG = 0x0021 => "PONG",
    }
}

wire_enum! {
    /// The role a node plays on a connection.
    pub struct Role(u8) {
        /// The prefill side: owns KV pages and writes them into the peer.
        SENDER = 1 => "SENDER",
        /// The decode side: reserves pages and verifies what lands in them.
        RECEIVER = 2 => "RECEIVER",
    }
}

wire_enum! {
    /// A page digest algorithm. There is deliberately no "none": verification cannot be
    /// negotiated away on the wire.
    pub struct DigestAlgorithm(u8) {
        /// XXH3-64 per page (the default).
        XXH3_64 = 1 => "XXH3_64",
        /// CRC-32 (IEEE 802.3 polynomial) per page.
        CRC32 = 2 => "CRC32",
    }
}

wire_enum! {
    /// Why a connection, a request or a transfer failed. Carried by HELLO_REJECT, REJECT,
    /// NACK and ABORT.
    pub struct ErrorCode(u16) {
        // Connection (HELLO_REJECT).
        /// The peer speaks another protocol version.
        VERSION_MISMATCH = 0x0001 => "VERSION_MISMATCH",
        /// Both peers claim the same role, or a role is unknown.
        ROLE_MISMATCH = 0x0002 => "ROLE_MISMATCH",
        /// Tokens per page, buffer count or bytes per page differ.
        LAYOUT_MISMATCH = 0x0003 => "LAYOUT_MISMATCH",
        /// The model / tensor-parallel fingerprints differ.
        FINGERPRINT_MISMATCH = 0x0004 => "FINGERPRINT_MISMATCH",
        /// No digest algorithm is supported by both peers.
        NO_COMMON_DIGEST = 0x0005 => "NO_COMMON_DIGEST",
        /// The handshake did not finish in time (sent at the handshake deadline, SPEC.md §4.6).
        HANDSHAKE_TIMEOUT = 0x0006 => "HANDSHAKE_TIMEOUT",
        /// One node authenticates its frames and the other does not (a pre-shared key on one
        /// side only).
        AUTH_MISMATCH = 0x0007 => "AUTH_MISMATCH",
        /// A handshake tag did not verify: another key, or altered or replayed bytes.
        AUTH_FAILED = 0x0008 => "AUTH_FAILED",
        /// The peer's transport parameters are malformed, of another transport, or do not
        /// match this node's (a stream count, SPEC.md §4.3 #7).
        TRANSPORT_MISMATCH = 0x0009 => "TRANSPORT_MISMATCH",

        // Request admission (REJECT), carried verbatim from the sender's admission.
        /// The prompt needs more pages than the sender's pool has in total.
        PROMPT_EXCEEDS_POOL = 0x0100 => "PROMPT_EXCEEDS_POOL",
        /// The prompt is longer than the configured maximum context length.
        PROMPT_EXCEEDS_CONTEXT = 0x0101 => "PROMPT_EXCEEDS_CONTEXT",
        /// The request has no tokens.
        EMPTY_REQUEST = 0x0102 => "EMPTY_REQUEST",
        /// The sender has no request with this transfer id.
        UNKNOWN_REQUEST = 0x0103 => "UNKNOWN_REQUEST",
        /// The sender's pool has too few free pages right now. Engine-chosen: passed to the
        /// sender's `abort` (admission never produces it, SPEC.md §3.9).
        SENDER_OUT_OF_PAGES = 0x0104 => "SENDER_OUT_OF_PAGES",
        /// The request was cancelled by the sender's engine before a reservation arrived.
        REQUEST_CANCELLED = 0x0105 => "REQUEST_CANCELLED",

        // Reservation checks (REJECT).
        /// The reservation's token count differs from the request's.
        TOKEN_COUNT_MISMATCH = 0x0200 => "TOKEN_COUNT_MISMATCH",
        /// The reservation's page count does not fit its token count.
        PAGE_COUNT_MISMATCH = 0x0201 => "PAGE_COUNT_MISMATCH",
        /// The reservation names a digest algorithm the hello did not agree on.
        DIGEST_UNSUPPORTED = 0x0202 => "DIGEST_UNSUPPORTED",
        /// A reservation for a transfer id that already has one.
        DUPLICATE_TRANSFER = 0x0203 => "DUPLICATE_TRANSFER",
        /// The reservation is malformed (nonce 0, a page index twice, a COMMIT that could not
        /// fit, a page index beyond the receiver's advertised pages; SPEC.md §5.3.1). An access
        /// descriptor the transport cannot use fails the writes instead (WRITE_FAILED, §9).
        BAD_RESERVATION = 0x0204 => "BAD_RESERVATION",
        /// The sender holds as many parked reservations (naming no request it knows yet) as
        /// it allows; this one is refused at once.
        PARKED_LIMIT = 0x0205 => "PARKED_LIMIT",

        // Verification (NACK).
        /// The commit's tokens, pages or bytes differ from the reservation.
        COUNT_MISMATCH = 0x0300 => "COUNT_MISMATCH",
        /// A digest over the landed memory differs from the sender's.
        DIGEST_MISMATCH = 0x0301 => "DIGEST_MISMATCH",
        /// The commit lacks a digest, or carries an all-zero one (fail closed).
        MISSING_DIGEST = 0x0302 => "MISSING_DIGEST",
        /// The commit names another reservation's nonce.
        STALE_NONCE = 0x0303 => "STALE_NONCE",
        /// The commit is for a transfer the receiver does not know.
        UNKNOWN_TRANSFER = 0x0304 => "UNKNOWN_TRANSFER",
        /// The auxiliary record's digest over the bytes received differs from the sender's.
        AUX_MISMATCH = 0x0305 => "AUX_MISMATCH",
        /// A reserved page did not receive all its bytes for this reservation before COMMIT.
        PAGES_MISSING = 0x0306 => "PAGES_MISSING",
        /// The commit's auxiliary record is longer than the receiver accepts (its `max_aux`).
        AUX_TOO_LARGE = 0x0307 => "AUX_TOO_LARGE",

        // Abort (ABORT).
        /// A deadline passed.
        TIMEOUT = 0x0400 => "TIMEOUT",
        /// The local engine cancelled the transfer.
        CANCELLED = 0x0401 => "CANCELLED",
        /// A data write failed at the transport.
        WRITE_FAILED = 0x0402 => "WRITE_FAILED",
        /// The peer broke the protocol.
        PROTOCOL_VIOLATION = 0x0403 => "PROTOCOL_VIOLATION",
        /// The node is shutting down.
        SHUTDOWN = 0x0404 => "SHUTDOWN",
        /// Local only, never sent: the peer stopped answering heartbeats (SPEC.md §8.3) and
        /// the connection was closed.
        PEER_UNRESPONSIVE = 0x0405 => "PEER_UNRESPONSIVE",
    }
}

impl FrameType {
    /// Whether frames of this type belong to the connection handshake.
    pub const fn is_handshake(self) -> bool {
        matches!(self.0, 0x0001..=0x0004)
    }
}
