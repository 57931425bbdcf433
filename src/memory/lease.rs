//! Page leases: the capability to use (and the obligation to release) one page index, and
//! who holds it.

use std::fmt;

use kvwire_proto::wire::TransferId;

/// Who a lease is for: what the engine learns when it asks which of its pages kvwire holds
/// ([`PagePool::holders`](super::PagePool::holders)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Holder {
    /// The destination of this incoming transfer: reserved, being written, verified and
    /// not yet released by the engine, or quarantined until its fence.
    Receiving(TransferId),
    /// A source page this outgoing transfer reads (until its writes and digests drained).
    Sending(TransferId),
    /// Leased by the caller itself ([`PagePool::allocate`](super::PagePool::allocate),
    /// [`PagePool::lease_pages`](super::PagePool::lease_pages)), for no transfer.
    Caller,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Receiving(t) => write!(f, "receiving transfer {t}"),
            Self::Sending(t) => write!(f, "sending transfer {t}"),
            Self::Caller => f.write_str("the caller"),
        }
    }
}

/// The right to use one page index of one pool, under one generation.
///
/// A lease is deliberately neither `Clone` nor `Copy`: [`PagePool::release`] consumes it, so
/// in safe code each lease is released at most once. Dropping a lease without releasing it
/// leaks its page (the pool cannot know), hence `#[must_use]`.
///
/// [`PagePool::release`]: super::PagePool::release
#[must_use = "a lease must be released to the pool"]
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct PageLease {
    pool_id: u64,
    page: u32,
    generation: u32,
    holder: Holder,
}

impl PageLease {
    pub(crate) fn new(pool_id: u64, page: u32, generation: u32, holder: Holder) -> Self {
        Self {
            pool_id,
            page,
            generation,
            holder,
        }
    }

    /// Who the lease is for.
    pub fn holder(&self) -> Holder {
        self.holder
    }

    /// The page index this lease covers (the same slot in every buffer).
    pub fn page(&self) -> u32 {
        self.page
    }

    /// The generation of the page this lease was issued under.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// The id of the pool that issued this lease.
    pub fn pool_id(&self) -> u64 {
        self.pool_id
    }

    /// Turns the lease into plain data, e.g. to cross an FFI or wire boundary.
    pub fn into_raw(self) -> RawLease {
        RawLease {
            pool_id: self.pool_id,
            page: self.page,
            generation: self.generation,
            holder: self.holder,
        }
    }

    /// Turns plain data back into a lease.
    ///
    /// This is safe even for forged, stale or duplicated data: the pool checks the pool id,
    /// page range, page state and generation on every use, so such a lease yields a
    /// [`PoolError`](super::PoolError), never corruption.
    pub fn from_raw(raw: RawLease) -> Self {
        Self::new(raw.pool_id, raw.page, raw.generation, raw.holder)
    }
}

/// A lease as plain data (for crossing FFI or wire boundaries). Turning it back into a
/// [`PageLease`] is safe: the pool checks generation and pool id on every use, so a forged,
/// stale or duplicated lease yields an error, never corruption.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RawLease {
    /// The id of the pool that issued the lease.
    pub pool_id: u64,
    /// The page index.
    pub page: u32,
    /// The generation of the page the lease was issued under.
    pub generation: u32,
    /// Who the lease is for.
    pub holder: Holder,
}

impl From<PageLease> for RawLease {
    fn from(lease: PageLease) -> Self {
        lease.into_raw()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_round_trip_preserves_fields() {
        let lease = PageLease::new(7, 3, 42, Holder::Caller);
        assert_eq!(
            (lease.pool_id(), lease.page(), lease.generation()),
            (7, 3, 42)
        );
        let raw = lease.into_raw();
        assert_eq!(
            raw,
            RawLease {
                pool_id: 7,
                page: 3,
                generation: 42,
                holder: Holder::Caller,
            }
        );
        assert_eq!(
            PageLease::from_raw(raw),
            PageLease::new(7, 3, 42, Holder::Caller)
        );
        assert_eq!(RawLease::from(PageLease::from_raw(raw)), raw);
    }
}
