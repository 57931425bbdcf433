//! The TCP transport: one TCP connection per peer pair carries the handshake and then, in
//! order, two kinds of record:
//!
//! * a **control record**: one protocol frame exactly as `proto/SPEC.md` §3 defines it
//!   (it starts with the frame magic `KVWR` and is self-delimiting), sealed by the
//!   connection's authentication channel where there is one;
//! * a **data record**: one page write (`proto/SPEC.md` §9.1) —
//!
//! ```text
//! offset size field
//! 0      4    magic        "KVDT"
//! 4      8    transfer_id  u64 LE
//! 12     8    nonce        u64 LE
//! 20     4    access key   u32 LE (from RESERVE's access descriptor)
//! 24     4    ordinal      u32 LE
//! 28     4    dst_page     u32 LE
//! 32     4    length       u32 LE = bytes per page index (sum over buffers)
//! 36     len  page bytes   buffer 0's page, then buffer 1's, ...
//! ```
//!
//! The sender ([`TcpSender`]) writes data records straight from its source pages with
//! vectored writes (no copy in user space) and reports a page write complete once its record
//! is on the stream; it writes a transfer's data records before its COMMIT, so the receiver
//! has consumed every byte of the transfer before it sees the commit: ordering is structural.
//! The receiver ([`TcpReceiver`]) reads page bytes straight into the destination page
//! slices, checking the access scope (its [`ScopeTable`](crate::memory::ScopeTable)) before
//! every read into a page; a write refused at its header, or whose scope closes part-way (the
//! fence), is read into a fixed scratch buffer and dropped.
//!
//! Over device (GPU) memory, both ends move records through pinned staging buffers and the
//! device's copy engines instead (`transport/staging.rs`; docs/GPU.md): a record is landed when
//! its copy into the page completed, and a fence waits for the copies into its pages.

mod receiver;
mod records;
mod sender;

pub use receiver::TcpReceiver;
pub use records::{
    DataHeader, ReadTarget, Record, StreamError, StreamReader, StreamStats, DATA_HEADER_LEN,
    DATA_MAGIC,
};
pub use sender::TcpSender;
