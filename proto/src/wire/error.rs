//! Why bytes are not a frame ([`DecodeError`]) and why a frame cannot be encoded
//! ([`EncodeError`]).

use core::fmt;

use super::limits::{MAGIC, MAX_PAYLOAD, VERSION};
use super::FrameType;

/// Bytes for humans, as hex and as ASCII (SPEC.md §7.2): `47 45 54 20 "GET "`. Bytes that
/// are not printable ASCII show as `.` in the quoted part; a `"` or `\\` shows as `.` too, so
/// the quoted part never needs escaping.
pub fn show_bytes(bytes: &[u8]) -> String {
    let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let ascii: String = bytes
        .iter()
        .map(|&b| match b {
            b'"' | b'\\' => '.',
            0x20..=0x7e => b as char,
            _ => '.',
        })
        .collect();
    format!("{} \"{ascii}\"", hex.join(" "))
}

/// Why a byte string is not a frame.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// More bytes are needed; at least `needed` bytes in all. Not an error on a stream.
    Incomplete {
        /// Total bytes needed before decoding can proceed.
        needed: usize,
    },
    /// The first four bytes are not [`MAGIC`](super::MAGIC).
    BadMagic([u8; 4]),
    /// A version other than [`VERSION`].
    UnsupportedVersion(u16),
    /// The payload length exceeds [`MAX_PAYLOAD`].
    PayloadTooLarge {
        /// Declared length.
        len: u32,
    },
    /// The CRC does not match.
    BadCrc {
        /// CRC carried by the frame.
        carried: u32,
        /// CRC computed over the bytes received.
        computed: u32,
    },
    /// A frame type this version does not define.
    UnknownFrameType(FrameType),
    /// The payload ended inside a field.
    Truncated {
        /// The field being read.
        field: &'static str,
    },
    /// Bytes remain after the last field of the payload.
    TrailingBytes {
        /// How many.
        extra: usize,
    },
    /// A count exceeds its limit.
    TooMany {
        /// The field.
        field: &'static str,
        /// The count carried.
        count: u64,
        /// The limit.
        max: u64,
    },
    /// A string is not UTF-8.
    InvalidUtf8 {
        /// The field.
        field: &'static str,
    },
    /// A field holds a value its type forbids (e.g. a flag that is neither 0 nor 1).
    InvalidValue {
        /// The field.
        field: &'static str,
        /// The value carried.
        value: u64,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Incomplete { needed } => write!(f, "incomplete frame: {needed} bytes needed"),
            Self::BadMagic(m) => write!(
                f,
                "bad magic {} (expected {}): not a kvwire frame",
                show_bytes(m),
                show_bytes(&MAGIC)
            ),
            Self::UnsupportedVersion(v) => {
                write!(
                    f,
                    "unsupported protocol version {v} (this node speaks {VERSION})"
                )
            }
            Self::PayloadTooLarge { len } => {
                write!(
                    f,
                    "payload of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit"
                )
            }
            Self::BadCrc { carried, computed } => {
                write!(
                    f,
                    "frame CRC mismatch: carried {carried:#010x}, computed {computed:#010x}"
                )
            }
            Self::UnknownFrameType(t) => write!(f, "unknown frame type {t}"),
            Self::Truncated { field } => write!(f, "payload truncated in field `{field}`"),
            Self::TrailingBytes { extra } => {
                write!(f, "{extra} bytes after the last payload field")
            }
            Self::TooMany { field, count, max } => {
                write!(f, "`{field}` count {count} exceeds the limit {max}")
            }
            Self::InvalidUtf8 { field } => write!(f, "`{field}` is not UTF-8"),
            Self::InvalidValue { field, value } => {
                write!(f, "`{field}` holds invalid value {value}")
            }
        }
    }
}

impl std::error::Error for DecodeError {}

/// Why a frame cannot be encoded.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EncodeError {
    /// A field or the payload exceeds its limit.
    TooLarge {
        /// The field.
        field: &'static str,
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An authenticated channel cannot send this frame in its state (for example a frame
    /// after HELLO before the connection keys exist, or a second HELLO).
    AuthState {
        /// The frame's type.
        frame_type: FrameType,
    },
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLarge { field, len, max } => {
                write!(f, "`{field}` is {len}, over the limit {max}")
            }
            Self::AuthState { frame_type } => {
                write!(
                    f,
                    "{frame_type} cannot be sealed in this authentication state"
                )
            }
        }
    }
}

impl std::error::Error for EncodeError {}
