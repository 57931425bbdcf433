//! The page pool proper: memory, slot table, free list.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::{PageLease, PoolError, PoolGeometry};
use crate::memory::{KvMemory, Pins, SharedPages};

/// The byte [`Scrub::Poison`] fills released pages with: conspicuous in a hex dump and
/// unlikely as a run of real KV-cache data.
pub const POISON_BYTE: u8 = 0xDB;

/// What the pool writes over a page's bytes, in every buffer, when the page is released.
///
/// Scrubbing is defence in depth: the protocol's digests and fences already make sure no
/// engine ever reads a page it was not handed verified data for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Scrub {
    /// Leave the bytes as they are (fastest).
    #[default]
    None,
    /// Overwrite with zeros.
    Zero,
    /// Overwrite with [`POISON_BYTE`], so stale data read by mistake is recognisable.
    Poison,
}

impl Scrub {
    fn fill_byte(self) -> Option<u8> {
        match self {
            Scrub::None => None,
            Scrub::Zero => Some(0),
            Scrub::Poison => Some(POISON_BYTE),
        }
    }
}

/// The state of one page index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageState {
    /// On the free list.
    Free,
    /// Handed out under `generation`.
    Leased {
        /// The generation current leases carry.
        generation: u32,
    },
    /// Its transfer failed or was aborted; waiting for the fence before release.
    Quarantined {
        /// The generation current leases carry.
        generation: u32,
    },
}

/// A snapshot of the pool's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Pages on the free list.
    pub free: u32,
    /// Pages leased and not quarantined.
    pub leased: u32,
    /// Pages quarantined, waiting for release.
    pub quarantined: u32,
    /// Pages handed out since the pool was built.
    pub allocations: u64,
    /// Pages moved from leased to quarantined since the pool was built.
    pub quarantines: u64,
    /// Successful releases since the pool was built.
    pub releases: u64,
    /// Releases refused because the lease was stale, already released, forged, out of range
    /// or from another pool. Anything but zero points at a bug in an error path.
    pub stale_release_errors: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    Leased,
    Quarantined,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    generation: u32,
    state: SlotState,
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// A pool of fixed-size KV pages, handed out as generation-checked [`PageLease`]s.
///
/// The pool owns one contiguous, zero-initialised allocation per buffer, made once at
/// construction. Allocation and release cost O(1) per page and allocate nothing per page.
/// See the [module documentation](super) for the page life cycle.
///
/// Generations are `u32` and wrap: a lease could only be mistaken for a current one if it
/// were kept across 2^32 reuses of its page.
pub struct PagePool {
    id: u64,
    geometry: PoolGeometry,
    scrub: Scrub,
    memory: Arc<KvMemory>,
    /// Per-page pin counts of live `SharedPages` views: a pinned page is never written.
    pins: Pins,
    slots: Vec<Slot>,
    /// Stack of free page indices; capacity `pages`, never reallocated.
    free: Vec<u32>,
    leased: u32,
    quarantined: u32,
    allocations: u64,
    quarantines: u64,
    releases: u64,
    stale_release_errors: u64,
}

impl fmt::Debug for PagePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagePool")
            .field("id", &self.id)
            .field("geometry", &self.geometry)
            .field("scrub", &self.scrub)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl PagePool {
    /// Builds a pool of `geometry`, allocating and zeroing all of its memory now.
    ///
    /// Fails with [`PoolError::BadGeometry`] when the geometry has no buffer, no page, zero
    /// tokens per page, a zero-byte page or a size that cannot be addressed, and with
    /// [`PoolError::OutOfMemory`] when the memory cannot be allocated.
    pub fn new(geometry: PoolGeometry, scrub: Scrub) -> Result<Self, PoolError> {
        let memory = KvMemory::allocate(&geometry)?;
        Self::with_memory(geometry, memory, scrub)
    }

    /// Builds a pool over memory registered with [`KvMemory`] (allocated, handed over, or the
    /// engine's own KV memory), which must have been made for this `geometry`.
    pub fn with_memory(
        geometry: PoolGeometry,
        memory: KvMemory,
        scrub: Scrub,
    ) -> Result<Self, PoolError> {
        geometry.validate()?;
        if memory.buffers() != geometry.buffers() {
            return Err(PoolError::BadGeometry(format!(
                "memory has {} buffers, the geometry {}",
                memory.buffers(),
                geometry.buffers()
            )));
        }
        for b in 0..geometry.buffers() {
            let len = memory.region(b).map_or(0, |r| r.1);
            if Some(len) != geometry.buffer_len(b) {
                return Err(PoolError::BadGeometry(format!(
                    "memory buffer {b} is {len} bytes, the geometry needs {:?}",
                    geometry.buffer_len(b)
                )));
            }
        }
        let memory = Arc::new(memory);
        let geometry_pages = geometry.pages;
        let pages = geometry.pages;
        let slots = vec![
            Slot {
                generation: 0,
                state: SlotState::Free,
            };
            pages as usize
        ];
        // Reversed so that a fresh pool hands out page 0 first.
        let free: Vec<u32> = (0..pages).rev().collect();
        Ok(Self {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            geometry,
            scrub,
            pins: (0..geometry_pages).map(|_| AtomicU32::new(0)).collect(),
            memory,
            slots,
            free,
            leased: 0,
            quarantined: 0,
            allocations: 0,
            quarantines: 0,
            releases: 0,
            stale_release_errors: 0,
        })
    }

    /// This pool's process-unique id (never 0); every lease records it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The geometry the pool was built with.
    pub fn geometry(&self) -> &PoolGeometry {
        &self.geometry
    }

    /// The scrub policy applied on release.
    pub fn scrub(&self) -> Scrub {
        self.scrub
    }

    /// Number of buffers.
    pub fn buffers(&self) -> usize {
        self.memory.buffers()
    }

    /// Total page indices.
    pub fn capacity_pages(&self) -> u32 {
        self.geometry.pages
    }

    /// Total tokens the pool can hold, as built.
    pub fn capacity_tokens(&self) -> u64 {
        self.geometry.capacity_tokens()
    }

    /// Pages on the free list.
    pub fn free_pages(&self) -> u32 {
        // The free list never holds more than `pages` (a u32) entries.
        self.free.len() as u32
    }

    /// Pages leased and not quarantined.
    pub fn leased_pages(&self) -> u32 {
        self.leased
    }

    /// Pages quarantined, waiting for release.
    pub fn quarantined_pages(&self) -> u32 {
        self.quarantined
    }

    /// Leases `n` pages, all or nothing. `n == 0` yields an empty vector.
    ///
    /// Fails with [`PoolError::Exhausted`] (and allocates nothing) when fewer than `n` pages
    /// are free.
    pub fn allocate(&mut self, n: u32) -> Result<Vec<PageLease>, PoolError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let free = self.free_pages();
        if n > free {
            return Err(PoolError::Exhausted { requested: n, free });
        }
        let mut leases = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let Some(page) = self.free.pop() else {
                unreachable!("free list shorter than its checked length");
            };
            let slot = &mut self.slots[page as usize];
            debug_assert_eq!(
                slot.state,
                SlotState::Free,
                "page {page} on free list twice"
            );
            slot.state = SlotState::Leased;
            leases.push(PageLease::new(self.id, page, slot.generation));
        }
        self.leased += n;
        self.allocations += u64::from(n);
        Ok(leases)
    }

    /// Moves a leased page to quarantine: its transfer failed or was aborted, and it must wait
    /// for the transport's fence before it is released. Quarantining an already quarantined
    /// page is a no-op. A quarantined page's bytes cannot be reached through its lease.
    ///
    /// Fails, changing nothing, when the lease is stale, released, forged or from another
    /// pool.
    pub fn quarantine(&mut self, lease: &PageLease) -> Result<(), PoolError> {
        let state = self.check(lease)?;
        if state == SlotState::Leased {
            self.slots[lease.page() as usize].state = SlotState::Quarantined;
            self.leased -= 1;
            self.quarantined += 1;
            self.quarantines += 1;
        }
        Ok(())
    }

    /// Returns a leased or quarantined page to the free list, consuming the lease: scrubs the
    /// page in every buffer according to the pool's [`Scrub`] policy and bumps its generation
    /// (wrapping), so every copy of the lease is stale from now on. O(1) in pages.
    ///
    /// Fails, changing nothing but the `stale_release_errors` counter, with
    /// [`PoolError::NotLeased`] when the page is free (a double release),
    /// [`PoolError::StaleLease`] when the page has been handed out again since,
    /// [`PoolError::WrongPool`] or [`PoolError::PageOutOfRange`].
    pub fn release(&mut self, lease: PageLease) -> Result<(), PoolError> {
        let state = match self.check(&lease) {
            Ok(state) => state,
            Err(e) => {
                self.stale_release_errors += 1;
                tracing::debug!(pool = self.id, error = %e, "page release refused");
                return Err(e);
            }
        };
        let page = lease.page();
        if self.pinned(page) {
            self.stale_release_errors += 1;
            tracing::error!(
                pool = self.id,
                page,
                "release of a page a digest job still reads refused"
            );
            return Err(PoolError::Pinned { page });
        }
        if let Some(byte) = self.scrub.fill_byte() {
            for buffer in 0..self.memory.buffers() {
                let range = self.range(page, buffer);
                // SAFETY: in bounds; `&mut self` excludes the pool's other accessors, and the
                // page is not pinned (checked above), so no `SharedPages` view reads it.
                unsafe { self.memory.bytes_mut(buffer, range) }.fill(byte);
            }
        }
        let slot = &mut self.slots[page as usize];
        slot.generation = slot.generation.wrapping_add(1);
        slot.state = SlotState::Free;
        match state {
            SlotState::Leased => self.leased -= 1,
            SlotState::Quarantined => self.quarantined -= 1,
            SlotState::Free => unreachable!("check() refuses free pages"),
        }
        debug_assert!(self.free.len() < self.slots.len(), "free list overflow");
        self.free.push(page);
        self.releases += 1;
        Ok(())
    }

    /// The state of `page`, or `None` if it is out of range.
    pub fn state(&self, page: u32) -> Option<PageState> {
        let slot = self.slots.get(page as usize)?;
        Some(match slot.state {
            SlotState::Free => PageState::Free,
            SlotState::Leased => PageState::Leased {
                generation: slot.generation,
            },
            SlotState::Quarantined => PageState::Quarantined {
                generation: slot.generation,
            },
        })
    }

    /// Whether `page` is leased or quarantined under exactly `generation`: what a transport
    /// checks before letting a write land in the page.
    pub fn holds(&self, page: u32, generation: u32) -> bool {
        self.slots
            .get(page as usize)
            .is_some_and(|s| s.state != SlotState::Free && s.generation == generation)
    }

    /// Checks a lease without using it: its page's state if the lease is current, the error
    /// any other operation would return otherwise.
    pub fn check_lease(&self, lease: &PageLease) -> Result<PageState, PoolError> {
        self.check(lease)?;
        Ok(self.state(lease.page()).unwrap_or(PageState::Free))
    }

    /// The bytes of the leased page in `buffer`.
    ///
    /// Fails when the lease is not current or of this pool, when its page is quarantined, or
    /// when `buffer` is out of range.
    pub fn page(&self, lease: &PageLease, buffer: usize) -> Result<&[u8], PoolError> {
        self.check_usable(lease, buffer)?;
        let range = self.range(lease.page(), buffer);
        // SAFETY: checked in bounds; writers need `&mut self`, which `&self` excludes.
        Ok(unsafe { self.memory.bytes(buffer, range) })
    }

    /// The bytes of the leased page in `buffer`, writable. Fails as [`PagePool::page`] does.
    pub fn page_mut(&mut self, lease: &PageLease, buffer: usize) -> Result<&mut [u8], PoolError> {
        self.check_usable(lease, buffer)?;
        if self.pinned(lease.page()) {
            return Err(PoolError::Pinned { page: lease.page() });
        }
        let range = self.range(lease.page(), buffer);
        // SAFETY: checked in bounds; `&mut self` is exclusive, and the page is not pinned,
        // so no `SharedPages` view reads it (new pins need `&self`).
        Ok(unsafe { self.memory.bytes_mut(buffer, range) })
    }

    /// The bytes of slot `page` in `buffer` regardless of lease state: what a NIC or an
    /// in-process transport sees. Access control is the transport's job (scopes/fences), not
    /// this method's. `None` if `page` or `buffer` is out of range.
    pub fn raw_page(&self, page: u32, buffer: usize) -> Option<&[u8]> {
        if page >= self.geometry.pages || buffer >= self.memory.buffers() {
            return None;
        }
        let range = self.range(page, buffer);
        // SAFETY: checked in bounds; writers need `&mut self`, which `&self` excludes.
        Some(unsafe { self.memory.bytes(buffer, range) })
    }

    /// The bytes of slot `page` in `buffer` regardless of lease state, writable. See
    /// [`PagePool::raw_page`].
    pub fn raw_page_mut(&mut self, page: u32, buffer: usize) -> Option<&mut [u8]> {
        if page >= self.geometry.pages || buffer >= self.memory.buffers() {
            return None;
        }
        if self.pinned(page) {
            return None;
        }
        let range = self.range(page, buffer);
        // SAFETY: checked in bounds; `&mut self` is exclusive, and the page is not pinned,
        // so no `SharedPages` view reads it (new pins need `&self`).
        Some(unsafe { self.memory.bytes_mut(buffer, range) })
    }

    /// The whole of `buffer` (all its page slots, contiguous), e.g. to register it with a
    /// NIC. `None` if `buffer` is out of range.
    pub fn buffer(&self, buffer: usize) -> Option<&[u8]> {
        let (_, len) = self.memory.region(buffer)?;
        // SAFETY: the whole region, in bounds; writers need `&mut self`, which `&self` excludes.
        Some(unsafe { self.memory.bytes(buffer, 0..len) })
    }

    /// A read-only view of `pages` that can cross threads (e.g. a digest job on the
    /// blocking pool) and keeps the memory alive. The pages are pinned while the view lives:
    /// [`PagePool::page_mut`] and [`PagePool::release`] refuse them with
    /// [`PoolError::Pinned`], and [`PagePool::raw_page_mut`] returns `None`.
    pub fn share_pages(&self, pages: Vec<u32>) -> Result<SharedPages, PoolError> {
        if let Some(&page) = pages.iter().find(|&&p| p >= self.geometry.pages) {
            return Err(PoolError::PageOutOfRange {
                page,
                pages: self.geometry.pages,
            });
        }
        Ok(SharedPages::new(
            self.memory.clone(),
            self.pins.clone(),
            pages,
        ))
    }

    /// The pool's memory, e.g. to register it with a NIC.
    pub fn memory(&self) -> &Arc<KvMemory> {
        &self.memory
    }

    /// Whether a live [`SharedPages`] view pins `page`.
    pub fn pinned(&self, page: u32) -> bool {
        self.pins
            .get(page as usize)
            .is_some_and(|p| p.load(Ordering::Acquire) > 0)
    }

    /// A snapshot of the pool's counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            free: self.free_pages(),
            leased: self.leased,
            quarantined: self.quarantined,
            allocations: self.allocations,
            quarantines: self.quarantines,
            releases: self.releases,
            stale_release_errors: self.stale_release_errors,
        }
    }

    /// Checks that `lease` is current in this pool; returns its page's (non-free) state.
    fn check(&self, lease: &PageLease) -> Result<SlotState, PoolError> {
        if lease.pool_id() != self.id {
            return Err(PoolError::WrongPool {
                lease_pool: lease.pool_id(),
                pool: self.id,
            });
        }
        let page = lease.page();
        let Some(slot) = self.slots.get(page as usize) else {
            return Err(PoolError::PageOutOfRange {
                page,
                pages: self.geometry.pages,
            });
        };
        if slot.state == SlotState::Free {
            return Err(PoolError::NotLeased { page });
        }
        if slot.generation != lease.generation() {
            return Err(PoolError::StaleLease {
                page,
                lease_generation: lease.generation(),
                current_generation: slot.generation,
            });
        }
        Ok(slot.state)
    }

    /// Checks that `lease` is current, not quarantined, and `buffer` exists.
    fn check_usable(&self, lease: &PageLease, buffer: usize) -> Result<(), PoolError> {
        if self.check(lease)? == SlotState::Quarantined {
            return Err(PoolError::Quarantined { page: lease.page() });
        }
        if buffer >= self.memory.buffers() {
            return Err(PoolError::BufferOutOfRange {
                buffer,
                buffers: self.memory.buffers(),
            });
        }
        Ok(())
    }

    /// Byte range of slot `page` in `buffer`; both must be in range. Cannot overflow: the
    /// buffer's length (`pages * page_bytes`) was checked to fit when the pool was built.
    fn range(&self, page: u32, buffer: usize) -> Range<usize> {
        let len = self.geometry.buffer_page_bytes[buffer] as usize;
        let start = page as usize * len;
        start..start + len
    }

    /// Cross-checks the free list, slot table and counters (tests only).
    #[cfg(test)]
    fn assert_invariants(&self) {
        let mut on_free_list = vec![false; self.slots.len()];
        for &p in &self.free {
            assert!(!on_free_list[p as usize], "page {p} twice on the free list");
            on_free_list[p as usize] = true;
        }
        let (mut leased, mut quarantined) = (0u32, 0u32);
        for (p, slot) in self.slots.iter().enumerate() {
            assert_eq!(
                on_free_list[p],
                slot.state == SlotState::Free,
                "page {p} free-list membership disagrees with its state {:?}",
                slot.state
            );
            match slot.state {
                SlotState::Leased => leased += 1,
                SlotState::Quarantined => quarantined += 1,
                SlotState::Free => {}
            }
        }
        assert_eq!(leased, self.leased);
        assert_eq!(quarantined, self.quarantined);
        assert_eq!(
            self.free.len() as u64 + u64::from(leased) + u64::from(quarantined),
            u64::from(self.geometry.pages)
        );
        assert_eq!(
            self.free.capacity(),
            self.slots.len(),
            "free list reallocated"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RawLease;
    use proptest::prelude::*;

    fn geometry(pages: u32) -> PoolGeometry {
        PoolGeometry {
            tokens_per_page: 4,
            buffer_page_bytes: vec![8, 3],
            pages,
        }
    }

    fn pool(pages: u32, scrub: Scrub) -> PagePool {
        PagePool::new(geometry(pages), scrub).unwrap()
    }

    #[test]
    fn new_pool_is_zeroed_free_and_hands_out_page_zero_first() {
        let mut p = pool(3, Scrub::None);
        p.assert_invariants();
        assert_ne!(p.id(), 0);
        assert_eq!(p.buffer(0).unwrap(), &[0u8; 24][..]);
        assert_eq!(p.buffer(1).unwrap(), &[0u8; 9][..]);
        assert_eq!(p.buffer(2), None);
        assert_eq!((p.free_pages(), p.capacity_pages()), (3, 3));
        assert_eq!(p.capacity_tokens(), 12);
        let l = p.allocate(1).unwrap();
        assert_eq!(
            (l[0].page(), l[0].generation(), l[0].pool_id()),
            (0, 0, p.id())
        );
        p.release(l.into_iter().next().unwrap()).unwrap();
    }

    #[test]
    fn pool_ids_are_unique() {
        let a = pool(1, Scrub::None);
        let b = pool(1, Scrub::None);
        assert_ne!(a.id(), b.id());
    }

    #[test]
    fn slots_do_not_overlap() {
        let mut p = pool(3, Scrub::None);
        for page in 0..3u32 {
            for buffer in 0..2 {
                let fill = (page * 10) as u8 + buffer as u8 + 1;
                p.raw_page_mut(page, buffer).unwrap().fill(fill);
            }
        }
        for page in 0..3u32 {
            for buffer in 0..2 {
                let fill = (page * 10) as u8 + buffer as u8 + 1;
                let bytes = p.raw_page(page, buffer).unwrap();
                assert_eq!(bytes.len(), [8, 3][buffer]);
                assert!(bytes.iter().all(|&b| b == fill));
            }
        }
        assert!(p.raw_page(3, 0).is_none());
        assert!(p.raw_page(0, 2).is_none());
        assert!(p.raw_page_mut(3, 0).is_none());
    }

    #[test]
    fn release_bumps_generation_and_frees_only_once() {
        let mut p = pool(1, Scrub::None);
        let lease = p.allocate(1).unwrap().pop().unwrap();
        let raw = RawLease {
            pool_id: lease.pool_id(),
            page: lease.page(),
            generation: lease.generation(),
        };
        assert!(p.holds(0, 0));
        p.release(lease).unwrap();
        assert_eq!(p.state(0), Some(PageState::Free));
        assert!(!p.holds(0, 0));
        assert_eq!(
            p.release(PageLease::from_raw(raw)),
            Err(PoolError::NotLeased { page: 0 })
        );
        p.assert_invariants();
        let again = p.allocate(1).unwrap().pop().unwrap();
        assert_eq!(again.generation(), 1);
        assert_eq!(
            p.release(PageLease::from_raw(raw)),
            Err(PoolError::StaleLease {
                page: 0,
                lease_generation: 0,
                current_generation: 1
            })
        );
        p.assert_invariants();
        assert_eq!(p.stats().stale_release_errors, 2);
        p.release(again).unwrap();
    }

    #[test]
    fn generation_wraps() {
        let mut p = pool(1, Scrub::None);
        p.slots[0].generation = u32::MAX;
        let lease = p.allocate(1).unwrap().pop().unwrap();
        assert_eq!(lease.generation(), u32::MAX);
        p.release(lease).unwrap();
        assert_eq!(p.allocate(1).unwrap()[0].generation(), 0);
    }

    #[test]
    fn quarantined_page_is_not_usable_through_its_lease() {
        let mut p = pool(2, Scrub::None);
        let lease = p.allocate(1).unwrap().pop().unwrap();
        p.quarantine(&lease).unwrap();
        assert_eq!(p.page(&lease, 0), Err(PoolError::Quarantined { page: 0 }));
        assert_eq!(
            p.page_mut(&lease, 0).map(|_| ()),
            Err(PoolError::Quarantined { page: 0 })
        );
        assert_eq!(
            p.check_lease(&lease),
            Ok(PageState::Quarantined { generation: 0 })
        );
        assert!(p.holds(0, 0));
        p.release(lease).unwrap();
        p.assert_invariants();
    }

    #[test]
    fn buffer_out_of_range() {
        let mut p = pool(1, Scrub::None);
        let lease = p.allocate(1).unwrap().pop().unwrap();
        assert_eq!(
            p.page(&lease, 2),
            Err(PoolError::BufferOutOfRange {
                buffer: 2,
                buffers: 2
            })
        );
        assert!(p.page_mut(&lease, 5).is_err());
        p.release(lease).unwrap();
    }

    #[test]
    fn forged_out_of_range_lease_is_refused() {
        let mut p = pool(2, Scrub::None);
        let forged = PageLease::from_raw(RawLease {
            pool_id: p.id(),
            page: 2,
            generation: 0,
        });
        assert_eq!(
            p.page(&forged, 0),
            Err(PoolError::PageOutOfRange { page: 2, pages: 2 })
        );
        assert_eq!(
            p.quarantine(&forged),
            Err(PoolError::PageOutOfRange { page: 2, pages: 2 })
        );
        assert_eq!(
            p.release(forged),
            Err(PoolError::PageOutOfRange { page: 2, pages: 2 })
        );
        assert_eq!(p.state(2), None);
        assert!(!p.holds(2, 0));
        p.assert_invariants();
    }

    #[test]
    fn huge_geometry_fails_cleanly() {
        // Addressable on paper (fits isize), but far more than any machine has.
        let g = PoolGeometry {
            tokens_per_page: 1,
            buffer_page_bytes: vec![u32::MAX],
            pages: u32::MAX / 4,
        };
        match PagePool::new(g, Scrub::None) {
            Err(PoolError::OutOfMemory { .. } | PoolError::BadGeometry(_)) => {}
            other => panic!("expected an allocation error, got {other:?}"),
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Allocate(u32),
        Quarantine(usize),
        Release(usize),
        Replay(usize),
        Forge(u32, u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..5).prop_map(Op::Allocate),
            any::<usize>().prop_map(Op::Quarantine),
            any::<usize>().prop_map(Op::Release),
            any::<usize>().prop_map(Op::Replay),
            (0u32..10, 0u32..4).prop_map(|(p, g)| Op::Forge(p, g)),
        ]
    }

    proptest! {
        /// Whatever the sequence of operations, including replayed and forged leases, the
        /// free list, slot table and counters stay consistent.
        #[test]
        fn invariants_hold_under_any_sequence(ops in proptest::collection::vec(op(), 0..80)) {
            let mut p = pool(8, Scrub::Poison);
            let mut held: Vec<PageLease> = Vec::new();
            let mut released: Vec<RawLease> = Vec::new();
            for op in ops {
                match op {
                    Op::Allocate(n) => {
                        if let Ok(leases) = p.allocate(n) {
                            held.extend(leases);
                        }
                    }
                    Op::Quarantine(i) if !held.is_empty() => {
                        let i = i % held.len();
                        p.quarantine(&held[i]).unwrap();
                    }
                    Op::Release(i) if !held.is_empty() => {
                        let lease = held.swap_remove(i % held.len());
                        released.push(RawLease { pool_id: lease.pool_id(), page: lease.page(), generation: lease.generation() });
                        p.release(lease).unwrap();
                    }
                    Op::Replay(i) if !released.is_empty() => {
                        let raw = released[i % released.len()];
                        prop_assert!(p.release(PageLease::from_raw(raw)).is_err());
                    }
                    Op::Forge(page, generation) => {
                        let current = held.iter().any(|l| l.page() == page && l.generation() == generation);
                        let forged = PageLease::from_raw(RawLease { pool_id: p.id(), page, generation });
                        if !current {
                            prop_assert!(p.release(forged).is_err());
                        }
                    }
                    _ => {}
                }
                p.assert_invariants();
            }
        }
    }
}
