//! KV memory: the registered buffers, the page pool that leases their slots, and the access
//! scopes that fence them.
//!
//! * [`KvMemory`] (`region.rs`) is the bytes: one region per buffer, allocated here or
//!   registered by the engine. With the RDMA transport it is the only place with `unsafe`.
//! * [`MemoryKind`] and [`DeviceMemoryOps`] (`device.rs`): a buffer may be device (GPU)
//!   memory, never dereferenced on the host; its bytes move through the device's copy
//!   engines and are digested in place.
//! * [`PagePool`] hands out page slots as generation-checked [`PageLease`]s.
//! * [`ScopeTable`] (`scope.rs`) is the fence primitive of the in-process and TCP transports:
//!   the scope a reservation opens over exactly its pages, closed before they are verified or
//!   released.
//!
//! # Pages and leases
//!
//! A pool owns `N` buffers (typically one per layer and per K/V), each holding `P` page
//! slots of its own size. Page index `p` names slot `p` in *every* buffer, so one lease
//! covers the same slot across all buffers, exactly as a transfer moves it
//! ([`PoolGeometry`] mirrors the wire-level [`KvLayout`](kvwire_proto::wire::KvLayout)).
//!
//! Every slot carries a generation counter that is bumped each time the slot returns to the
//! free list. A [`PageLease`] names a page *and* the generation it was handed out under, and
//! the pool checks both (plus the pool's own id) on every use. A lease is consumed on
//! release, and because the generation moves on, a duplicated, stale or forged lease
//! ([`RawLease`]) yields a [`PoolError`], never a double entry in the free list and never
//! access to someone else's data through the lease API.
//!
//! Life cycle of a slot:
//!
//! ```text
//!            allocate                 quarantine
//!   Free ─────────────▶ Leased{g} ─────────────▶ Quarantined{g}
//!    ▲                     │                          │
//!    └──── release ────────┴────────── release ───────┘   (generation g -> g+1, scrub)
//! ```
//!
//! `Quarantined` holds the pages of a failed or aborted transfer until the transport's
//! fence guarantees no write for that transfer can still land in them; only then does the
//! driver release them.
//!
//! Allocation and release are O(1) per page: the free list is a preallocated stack of page
//! indices and the slot table a flat vector; nothing is allocated per page.

mod access;
mod device;
mod error;
mod geometry;
mod lease;
mod page_pool;
mod region;
mod scope;

pub use access::{PageMut, PageRef, PageRowMut, SharedPages};
pub use device::{
    CopyQueue, CopyTicket, DeviceError, DeviceMemoryOps, DevicePtr, DeviceSlots, MemoryKind,
    PinnedBuffer,
};
pub use error::PoolError;
pub use geometry::PoolGeometry;
pub use lease::{Holder, PageLease, RawLease};
pub use page_pool::{PagePool, PageState, PoolStats, Scrub, POISON_BYTE};
pub use region::{advise_huge_pages, KvBuffer, KvMemory, ALIGN};
pub use scope::{AccessError, AccessKey, AccessScope, ScopeTable};
