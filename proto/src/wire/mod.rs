//! The wire format: frame header, payloads, codes. See SPEC.md.

mod codec;
mod codes;
mod digest;
mod error;
pub(crate) mod frame;
mod ids;
mod layout;
pub(crate) mod limits;

pub use codes::{DigestAlgorithm, ErrorCode, FrameType, Role};
pub use digest::{Digest128, TransferDigests};
pub use error::{show_bytes, DecodeError, EncodeError};
pub use frame::{Abort, Commit, Frame, Hello, HelloReject, Nack, Reject, Reserve, TransferRef};
pub use ids::{TransferId, TransferIdMap};
pub use layout::KvLayout;
pub use limits::{
    commit_fits, HEADER_LEN, MAGIC, MAX_ACCESS, MAX_AUX, MAX_BUFFERS, MAX_DETAIL,
    MAX_DIGEST_ALGORITHMS, MAX_FINGERPRINT, MAX_PAGES, MAX_PAGE_DIGESTS, MAX_PAYLOAD,
    MAX_TRANSPORT_PARAMS, NONE_INDEX, TRAILER_LEN, VERSION,
};
