//! Assurance tooling for `kvwire-proto`: models of the drivers around the real sender and
//! receiver sessions, the safety invariants they must keep, and an exhaustive explorer.
//!
//! * [`digest`]: a stand-in for the digest algorithms (any injective-enough function will
//!   do: what matters is that different landed contents give different digests).
//! * [`driver`]: the receiver's pool, access scopes, fences and digest jobs, and the sender's
//!   posted writes and digest jobs, each checking the session's effects against SPEC.md
//!   (fence before release, fence before verify, source released only after the drain, ...).
//! * [`world`]: both sessions connected by a lossy, duplicating channel, with every
//!   nondeterministic step (delivery, drop, duplication, timer expiry, local aborts, write
//!   and fence completion, peer loss) as an [`world::Action`].
//! * [`explore`]: a depth-first explorer over [`world::World`] with state deduplication.
//! * [`single`]: one session driven by arbitrary peer input (the fuzz targets use it).
#![forbid(unsafe_code)]

pub mod digest;
pub mod driver;
pub mod explore;
pub mod single;
pub mod world;

use kvwire_proto::handshake::Established;
use kvwire_proto::wire::{DigestAlgorithm, Hello, KvLayout, Role};

/// Tokens per page in every model.
pub const TOKENS_PER_PAGE: u32 = 16;

/// The `max_aux` both model nodes announce.
pub const MAX_AUX_MODEL: u32 = 8;

/// The layout every model uses: 16 tokens per page, two buffers.
pub fn layout() -> KvLayout {
    KvLayout {
        tokens_per_page: TOKENS_PER_PAGE,
        buffer_page_bytes: vec![64, 32],
        fingerprint: b"model".to_vec(),
    }
}

/// An established connection as seen by the node with `role`.
pub fn established(role: Role) -> Established {
    let hello = |role| Hello {
        node_id: 1,
        role,
        layout: layout(),
        digests: vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32],
        transport_params: vec![],
        max_aux: MAX_AUX_MODEL,
    };
    let peer = if role == Role::SENDER {
        Role::RECEIVER
    } else {
        Role::SENDER
    };
    Established {
        local: hello(role),
        peer: hello(peer),
        digests: vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32],
    }
}

/// A broken safety or liveness property, with what was seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation(pub String);

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Violation {}

/// Returns a [`Violation`] from the enclosing function when `cond` is false.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::Violation(format!($($fmt)+)));
        }
    };
}
