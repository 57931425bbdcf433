//! The TCP stream's records: the data record's header, what a completed record is, and why a
//! stream can no longer be read (the parser of the receiving side is `reader.rs`).

use kvwire_proto::auth::{AuthError, OpenError};
use kvwire_proto::wire::TransferId;
use kvwire_proto::wire::{DecodeError, Frame, TransferRef, MAGIC};

use crate::memory::AccessKey;
use crate::transport::LandingDigests;

/// Magic of a data record.
pub const DATA_MAGIC: [u8; 4] = *b"KVDT";
/// Length of a data record's header.
pub const DATA_HEADER_LEN: usize = 36;

/// The header of a data record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataHeader {
    /// The reservation written.
    pub transfer: TransferRef,
    /// The access key from RESERVE.
    pub key: AccessKey,
    /// The page's ordinal in the transfer.
    pub ordinal: u32,
    /// The destination page index.
    pub dst_page: u32,
    /// Payload bytes (all buffers of the page).
    pub len: u32,
}

impl DataHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; DATA_HEADER_LEN] {
        let mut b = [0u8; DATA_HEADER_LEN];
        b[0..4].copy_from_slice(&DATA_MAGIC);
        b[4..12].copy_from_slice(&self.transfer.transfer_id.0.to_le_bytes());
        b[12..20].copy_from_slice(&self.transfer.nonce.to_le_bytes());
        b[20..24].copy_from_slice(&self.key.0.to_le_bytes());
        b[24..28].copy_from_slice(&self.ordinal.to_le_bytes());
        b[28..32].copy_from_slice(&self.dst_page.to_le_bytes());
        b[32..36].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8; DATA_HEADER_LEN]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        Self {
            transfer: TransferRef {
                transfer_id: TransferId(u64_at(4)),
                nonce: u64_at(12),
            },
            key: AccessKey(u32_at(20)),
            ordinal: u32_at(24),
            dst_page: u32_at(28),
            len: u32_at(32),
        }
    }
}

/// Why the stream can no longer be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// A control record did not decode.
    #[error("bad control frame: {0}")]
    Frame(#[from] DecodeError),
    /// A control record failed authentication (SPEC.md §3.11): the connection is closed.
    #[error("control frame refused: {0}")]
    Auth(AuthError),
    /// A control record could not be opened for another reason.
    #[error("control frame refused: {0}")]
    Open(OpenError),
    /// A record starts with neither magic.
    #[error(
        "unknown record magic {} (expected a frame, {}, or a data record, {})",
        kvwire_proto::wire::show_bytes(.0),
        kvwire_proto::wire::show_bytes(&MAGIC),
        kvwire_proto::wire::show_bytes(&DATA_MAGIC)
    )]
    BadMagic([u8; 4]),
    /// A data record whose access key names an open scope but which does not match that
    /// scope's reservation: another transfer id or nonce, an ordinal beyond its pages, or a
    /// destination page other than the one reserved at its ordinal (SPEC §9.1). A protocol
    /// violation: the connection is closed and every transfer fails safely.
    #[error(
        "data record for transfer {} nonce {:#x}, ordinal {} -> page {} under the access key of transfer {} nonce {:#x}, which reserved {} at that ordinal",
        .header.transfer.transfer_id.0,
        .header.transfer.nonce,
        .header.ordinal,
        .header.dst_page,
        .scope.transfer_id.0,
        .scope.nonce,
        .reserved.map_or("no page".to_string(), |p| format!("page {p}"))
    )]
    RecordMismatch {
        /// The record's header.
        header: DataHeader,
        /// The reservation the key belongs to.
        scope: TransferRef,
        /// The page that reservation has at the record's ordinal.
        reserved: Option<u32>,
    },
    /// A data record's length is not the layout's bytes per page index.
    #[error("data record of {got} bytes, the layout's pages are {expected} bytes")]
    BadDataLength {
        /// The record's length.
        got: u32,
        /// Bytes per page index.
        expected: u64,
    },
}

/// What a completed record was.
#[derive(Debug)]
pub enum Record {
    /// A control frame.
    Frame(Frame),
    /// A data record whose bytes landed in its destination page, with the page digests taken
    /// as they landed when its scope asked for them (and every byte was digested).
    Landed(DataHeader, Option<LandingDigests>),
    /// A data record refused (no open scope or page out of scope): its bytes were dropped.
    Refused(DataHeader),
    /// Device memory: a data record whose bytes are all in staging buffer `slot`, its scope
    /// still open; it lands once they are copied into the page.
    Staged(DataHeader, usize),
    /// Same-host pulls on pull threads: a pull record under its open scope, at the page
    /// reserved for it, whose copy from `sources` (digested under `landing`) is still to run.
    Pull {
        /// The record.
        header: DataHeader,
        /// Each buffer's slot's address in the prefill's memory.
        sources: Vec<u64>,
        /// The digests to take as it lands, when its scope asks for them.
        landing: Option<kvwire_proto::wire::DigestAlgorithm>,
    },
}

/// Counters of the receiving side of a stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Data records landed.
    pub writes_landed: u64,
    /// Data records refused.
    pub writes_refused: u64,
    /// Payload bytes landed in pages.
    pub bytes_landed: u64,
    /// Control frames received.
    pub frames: u64,
    /// Reads made (system calls that returned bytes).
    pub reads: u64,
    /// Payload bytes that arrived in the read-ahead buffer and were copied into their pages
    /// (the rest landed by reads straight into the pages).
    pub bytes_copied: u64,
    /// Data records landed whose page digests the stream took as their bytes landed (SPEC
    /// §6, digests at landing).
    pub digested_at_landing: u64,
    /// Pull records whose pages were copied out of the prefill's memory (SPEC §9.3); they
    /// count among `writes_landed` and their bytes among `bytes_landed`.
    pub pulled: u64,
    /// Pull records under an open scope whose copy failed (the page is not covered).
    pub pulls_failed: u64,
    /// Of `pulled`, those copied on pull threads
    /// ([`TcpReceiver::with_pull_threads`](super::TcpReceiver::with_pull_threads)) rather
    /// than on the stream's task.
    pub pulled_on_threads: u64,
}
