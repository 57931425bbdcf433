//! The wire format: frame header, payloads, codes. See SPEC.md.

mod codes;
mod digest;
mod layout;

pub use codes::{DigestAlgorithm, ErrorCode, FrameType, Role};
pub use digest::{Digest128, TransferDigests};
pub use layout::KvLayout;
