//! The sender (prefill) role: its driver, the one loop that runs a sender session over a
//! transport (admission, reservations, page writes, digests, commits). Its engine handle is
//! [`SenderConn`](crate::engine::SenderConn).

mod driver;

pub use driver::{
    admission_policy, ChunkStartError, SenderDriver, SenderDriverStats, StartError,
    DIGEST_AFTER_WRITE_MIN_BYTES,
};
