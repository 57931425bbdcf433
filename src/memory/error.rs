//! Errors returned by the page pool.

use super::Holder;

fn list_holders(h: &[Holder]) -> String {
    if h.is_empty() {
        return "nobody".into();
    }
    h.iter()
        .map(Holder::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why a pool operation was refused. A refused operation changes nothing in the pool.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolError {
    /// Fewer free pages than requested; nothing was allocated (allocation is all or nothing).
    #[error("page pool exhausted: requested {requested} pages but only {free} are free")]
    Exhausted {
        /// Pages requested.
        requested: u32,
        /// Pages free at the time of the request.
        free: u32,
    },
    /// The lease names a generation of the page that is no longer (or never was) current:
    /// the page was released and possibly handed out again since.
    #[error(
        "stale lease for page {page}: lease generation {lease_generation}, \
         current generation {current_generation}"
    )]
    StaleLease {
        /// The page named by the lease.
        page: u32,
        /// The generation recorded in the lease.
        lease_generation: u32,
        /// The page's current generation.
        current_generation: u32,
    },
    /// The page is free: the lease was already released (a double release) or forged.
    #[error("page {page} is not leased (double release or forged lease)")]
    NotLeased {
        /// The page named by the lease.
        page: u32,
    },
    /// The lease was issued by another pool.
    #[error("lease belongs to pool {lease_pool}, not to pool {pool}")]
    WrongPool {
        /// The pool id recorded in the lease.
        lease_pool: u64,
        /// The id of the pool it was presented to.
        pool: u64,
    },
    /// The page index is not below the pool's page count.
    #[error("page {page} out of range: the pool has {pages} pages")]
    PageOutOfRange {
        /// The page index asked for.
        page: u32,
        /// The pool's page count.
        pages: u32,
    },
    /// The buffer index is not below the pool's buffer count.
    #[error("buffer {buffer} out of range: the pool has {buffers} buffers")]
    BufferOutOfRange {
        /// The buffer index asked for.
        buffer: usize,
        /// The pool's buffer count.
        buffers: usize,
    },
    /// The lease is current but its page is quarantined (its transfer failed or was aborted):
    /// its bytes must not be read or written through the lease; release it after the fence.
    #[error("page {page} is quarantined; its contents must not be used, only released")]
    Quarantined {
        /// The quarantined page.
        page: u32,
    },
    /// The geometry is empty, zero-sized or too large to address.
    #[error("bad pool geometry: {0}")]
    BadGeometry(String),
    /// A digest job still reads the page (a live `SharedPages` view pins it): it cannot be
    /// written or released yet.
    #[error("page {page} is pinned by a running digest job")]
    Pinned {
        /// The page.
        page: u32,
    },
    /// The engine asked to lease a page that is held already (leased, read by an outgoing
    /// transfer, or quarantined; by this or another connection): a page is never leased
    /// twice.
    #[error("page {page} is already held by {} (a page is never leased twice)", list_holders(.holders))]
    AlreadyLeased {
        /// The page.
        page: u32,
        /// Who holds it.
        holders: Vec<Holder>,
    },
    /// The engine was about to free (reuse) a page kvwire still holds.
    #[error("page {page} is still held by kvwire for {}: it must not be freed yet", list_holders(.holders))]
    HeldByKvwire {
        /// The page.
        page: u32,
        /// Who holds it.
        holders: Vec<Holder>,
    },
    /// The lease is a shared read lease (several transfers may read the page): it cannot
    /// write the page or quarantine it.
    #[error("page {page} is shared by outgoing transfers: read-only")]
    SharedLease {
        /// The page.
        page: u32,
    },
    /// A page appears twice in one request.
    #[error("page {page} appears twice")]
    DuplicatePage {
        /// The page.
        page: u32,
    },
    /// A writer holds the page right now (a transport landing bytes in it, or the engine
    /// writing through a [`PageMut`](super::PageMut)).
    #[error("page {page} is being written")]
    Busy {
        /// The page.
        page: u32,
    },
    /// Buffer `buffer` is device memory: its bytes are not reachable from the host (read
    /// them through the memory's device operations, e.g. [`PagePool::engine_read`](super::PagePool::engine_read)).
    #[error("buffer {buffer} is device memory: not reachable from the host")]
    DeviceMemory {
        /// The buffer.
        buffer: usize,
    },
    /// Buffer `buffer` is device memory and no device operations were registered for it.
    #[error("buffer {buffer} is device memory, and no device operations were given")]
    NoDeviceOps {
        /// The buffer.
        buffer: usize,
    },
    /// A device operation (copy, fill) failed.
    #[error("device memory: {0}")]
    Device(#[from] super::DeviceError),
    /// The memory for a buffer could not be allocated.
    #[error("could not allocate {bytes} bytes for pool buffer {buffer}")]
    OutOfMemory {
        /// The buffer whose allocation failed.
        buffer: usize,
        /// Its size in bytes.
        bytes: u64,
    },
}
