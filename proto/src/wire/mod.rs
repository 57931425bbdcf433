//! The wire format: frame header, payloads, codes. See SPEC.md.

mod codec;
mod codes;
mod digest;
pub(crate) mod frame;
mod layout;

pub use codes::{DigestAlgorithm, ErrorCode, FrameType, Role};
pub use digest::{Digest128, TransferDigests};
pub use frame::{
    commit_fits, Abort, Commit, DecodeError, EncodeError, Frame, Hello, HelloReject, Nack, Reject,
    Reserve, TransferRef, HEADER_LEN, MAGIC, MAX_ACCESS, MAX_BUFFERS, MAX_DETAIL,
    MAX_DIGEST_ALGORITHMS, MAX_FINGERPRINT, MAX_PAGES, MAX_PAGE_DIGESTS, MAX_PAYLOAD,
    MAX_TRANSPORT_PARAMS, NONE_INDEX, TRAILER_LEN, VERSION,
};
pub use layout::KvLayout;
