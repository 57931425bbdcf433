//! Transports: how page bytes reach the receiver's memory, and how the receiver fences them.
//!
//! Every transport gives the receiver the same two guarantees the protocol relies on
//! (`proto/SPEC.md` §9):
//!
//! * **Scoped access.** A reservation opens an [`AccessScope`] over exactly its pages; a
//!   write is accepted only if it carries the scope's key and targets one of those pages.
//! * **Fence.** Closing a scope is a fence: once [`ScopeTable::close`] returns, no write
//!   for that transfer can land. RDMA implements this with a memory window invalidation, TCP
//!   and loopback with this table.
//!
//! [`loopback`] is the in-process transport with fault injection used by the
//! [`Pair`](crate::harness::Pair) harness.

pub mod loopback;
pub mod rdma;
pub(crate) mod stream;
pub mod tcp;

pub use stream::ConnectError;

pub use crate::memory::{AccessError, AccessKey, AccessScope, ScopeTable};
