//! The page pool proper: memory, slot table, free list.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::access::{PageLocks, PageMut};
use super::{Holder, KvMemory, PageLease, PoolError, PoolGeometry};

mod bytes;

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
    /// Handed out, exclusively, under `generation`: a reservation's destination page, or a
    /// page allocated for the caller.
    Leased {
        /// The generation current leases carry.
        generation: u32,
    },
    /// Read by `readers` outgoing transfers (shared: the same source page, e.g. a shared
    /// prompt prefix, may go to several peers at once), under `generation`.
    Reading {
        /// The generation current leases carry.
        generation: u32,
        /// Transfers reading it.
        readers: u32,
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
    /// Pages leased exclusively and not quarantined.
    pub leased: u32,
    /// Pages read by outgoing transfers (shared leases).
    pub reading: u32,
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
    /// Shared by this many read leases (at least 1).
    Reading(u32),
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    generation: u32,
    state: SlotState,
    /// Who holds it (meaningless while free); for a shared page, its first reader (the
    /// others are in `Table::more_readers`).
    holder: Holder,
}

/// "No page" in the free list's links.
const NIL: u32 = u32::MAX;

/// The free pages, as a doubly linked list threaded through two arrays: O(1) push and pop at
/// the head (a fresh pool hands out page 0 first; a released page is reused first) and O(1)
/// removal of any page (when the engine leases pages it chose itself). Allocated once.
#[derive(Debug)]
struct FreeList {
    next: Vec<u32>,
    prev: Vec<u32>,
    head: u32,
    len: u32,
}

impl FreeList {
    fn full(pages: u32) -> Self {
        Self {
            next: (0..pages)
                .map(|p| if p + 1 < pages { p + 1 } else { NIL })
                .collect(),
            prev: (0..pages)
                .map(|p| if p == 0 { NIL } else { p - 1 })
                .collect(),
            head: if pages == 0 { NIL } else { 0 },
            len: pages,
        }
    }

    fn push(&mut self, page: u32) {
        let p = page as usize;
        self.next[p] = self.head;
        self.prev[p] = NIL;
        if self.head != NIL {
            self.prev[self.head as usize] = page;
        }
        self.head = page;
        self.len += 1;
    }

    fn pop(&mut self) -> Option<u32> {
        let page = self.head;
        if page == NIL {
            return None;
        }
        self.unlink(page);
        Some(page)
    }

    /// Removes `page`, which must be on the list.
    fn unlink(&mut self, page: u32) {
        let p = page as usize;
        let (prev, next) = (self.prev[p], self.next[p]);
        if prev == NIL {
            self.head = next;
        } else {
            self.next[prev as usize] = next;
        }
        if next != NIL {
            self.prev[next as usize] = prev;
        }
        self.next[p] = NIL;
        self.prev[p] = NIL;
        self.len -= 1;
    }
}

/// The slot table and everything else that changes under the pool's lock.
#[derive(Debug)]
struct Table {
    slots: Vec<Slot>,
    free: FreeList,
    /// The readers of shared pages beyond each page's first (rare: a page sent to several
    /// peers at once).
    more_readers: HashMap<u32, Vec<Holder>>,
    leased: u32,
    reading: u32,
    quarantined: u32,
    allocations: u64,
    quarantines: u64,
    releases: u64,
    stale_release_errors: u64,
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// A pool of fixed-size KV pages, handed out as generation-checked [`PageLease`]s.
///
/// The pool owns (or has been given) one contiguous region per buffer ([`KvMemory`]).
/// Allocation and release cost O(1) per page and allocate nothing per page. See the
/// [module documentation](super) for the page life cycle.
///
/// A pool is `Sync`: every method takes `&self`, so one pool (behind an `Arc`) can serve
/// every connection of a node. The slot table sits behind a mutex held only for the
/// bookkeeping of a call, never while bytes move; the bytes themselves are reached through
/// per-page access guards ([`PageRef`](super::PageRef), [`PageMut`]; `access.rs`).
///
/// Generations are `u32` and wrap: a lease could only be mistaken for a current one if it
/// were kept across 2^32 reuses of its page.
pub struct PagePool {
    id: u64,
    geometry: PoolGeometry,
    scrub: Scrub,
    memory: Arc<KvMemory>,
    locks: PageLocks,
    table: Mutex<Table>,
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
            let len = memory.buffer_len(b).unwrap_or(0);
            if Some(len) != geometry.buffer_len(b) {
                return Err(PoolError::BadGeometry(format!(
                    "memory buffer {b} is {len} bytes, the geometry needs {:?}",
                    geometry.buffer_len(b)
                )));
            }
        }
        let pages = geometry.pages;
        let slots = vec![
            Slot {
                generation: 0,
                state: SlotState::Free,
                holder: Holder::Caller,
            };
            pages as usize
        ];
        Ok(Self {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            scrub,
            locks: PageLocks::new(pages),
            memory: Arc::new(memory),
            table: Mutex::new(Table {
                slots,
                free: FreeList::full(pages),
                more_readers: HashMap::new(),
                leased: 0,
                reading: 0,
                quarantined: 0,
                allocations: 0,
                quarantines: 0,
                releases: 0,
                stale_release_errors: 0,
            }),
            geometry,
        })
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the lock cannot leave the table half-updated in a way that
        // matters more than the panic itself; keep serving.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
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
        self.table().free.len
    }

    /// Pages leased exclusively and not quarantined.
    pub fn leased_pages(&self) -> u32 {
        self.table().leased
    }

    /// Pages read by outgoing transfers (shared leases).
    pub fn reading_pages(&self) -> u32 {
        self.table().reading
    }

    /// Pages quarantined, waiting for release.
    pub fn quarantined_pages(&self) -> u32 {
        self.table().quarantined
    }

    /// Leases `n` pages the pool chooses (the embedded allocator) to the caller, all or
    /// nothing; see [`PagePool::allocate_for`].
    pub fn allocate(&self, n: u32) -> Result<Vec<PageLease>, PoolError> {
        self.allocate_for(n, Holder::Caller)
    }

    /// Leases `n` pages the pool chooses (the embedded allocator) to `holder`, all or
    /// nothing. `n == 0` yields an empty vector.
    ///
    /// Fails with [`PoolError::Exhausted`] (and allocates nothing) when fewer than `n` pages
    /// are free.
    pub fn allocate_for(&self, n: u32, holder: Holder) -> Result<Vec<PageLease>, PoolError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut t = self.table();
        let free = t.free.len;
        if n > free {
            return Err(PoolError::Exhausted { requested: n, free });
        }
        let mut leases = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let Some(page) = t.free.pop() else {
                unreachable!("free list shorter than its checked length");
            };
            leases.push(self.lease_slot(&mut t, page, holder));
        }
        t.leased += n;
        t.allocations += u64::from(n);
        Ok(leases)
    }

    /// Leases exactly `pages` to the caller; see [`PagePool::lease_pages_for`].
    pub fn lease_pages(&self, pages: &[u32]) -> Result<Vec<PageLease>, PoolError> {
        self.lease_pages_for(pages, Holder::Caller)
    }

    /// Leases exactly `pages` (chosen by the engine's own allocator) to `holder`,
    /// exclusively, all or nothing, in the order given: what a reservation into the
    /// engine's pages does.
    ///
    /// Fails, leasing nothing, with [`PoolError::PageOutOfRange`], with
    /// [`PoolError::AlreadyLeased`] when a page is held already (leased, read by an outgoing
    /// transfer, or quarantined; by any connection: a page is never leased twice), or with
    /// [`PoolError::DuplicatePage`] when a page appears twice in `pages`.
    pub fn lease_pages_for(
        &self,
        pages: &[u32],
        holder: Holder,
    ) -> Result<Vec<PageLease>, PoolError> {
        let mut t = self.table();
        self.check_choice(&t, pages, |state| state == SlotState::Free)?;
        let mut leases = Vec::with_capacity(pages.len());
        for &page in pages {
            t.free.unlink(page);
            leases.push(self.lease_slot(&mut t, page, holder));
        }
        let n = pages.len() as u32;
        t.leased += n;
        t.allocations += u64::from(n);
        Ok(leases)
    }

    /// Leases `pages` for reading to `holder` (an outgoing transfer), all or nothing: the
    /// engine's source pages, sent in place. Reading is shared: a page already read by
    /// other transfers gets one more reader (the same prefix page may go to several peers);
    /// a page leased exclusively (a reservation's destination, or the caller's) or
    /// quarantined is refused with [`PoolError::AlreadyLeased`]. Pages read by a transfer
    /// must not be written by anyone until every reader released them.
    ///
    /// Fails, leasing nothing, as [`PagePool::lease_pages_for`] does.
    pub fn lease_for_reading(
        &self,
        pages: &[u32],
        holder: Holder,
    ) -> Result<Vec<PageLease>, PoolError> {
        let mut t = self.table();
        self.check_choice(&t, pages, |state| {
            matches!(state, SlotState::Free | SlotState::Reading(_))
        })?;
        let mut leases = Vec::with_capacity(pages.len());
        for &page in pages {
            let slot = t.slots[page as usize];
            match slot.state {
                SlotState::Free => {
                    t.free.unlink(page);
                    let s = &mut t.slots[page as usize];
                    s.state = SlotState::Reading(1);
                    s.holder = holder;
                    t.reading += 1;
                    t.allocations += 1;
                }
                SlotState::Reading(n) => {
                    t.slots[page as usize].state = SlotState::Reading(n + 1);
                    t.more_readers.entry(page).or_default().push(holder);
                }
                _ => unreachable!("checked above"),
            }
            leases.push(PageLease::new(self.id, page, slot.generation, holder));
        }
        Ok(leases)
    }

    /// Checks an engine's choice of pages: in range, no page twice, each in a state `ok`.
    fn check_choice(
        &self,
        t: &Table,
        pages: &[u32],
        ok: impl Fn(SlotState) -> bool,
    ) -> Result<(), PoolError> {
        for (i, &page) in pages.iter().enumerate() {
            let Some(slot) = t.slots.get(page as usize) else {
                return Err(PoolError::PageOutOfRange {
                    page,
                    pages: self.geometry.pages,
                });
            };
            if !ok(slot.state) {
                return Err(PoolError::AlreadyLeased {
                    page,
                    holders: Self::holders_of(t, page),
                });
            }
            if pages[..i].contains(&page) {
                return Err(PoolError::DuplicatePage { page });
            }
        }
        Ok(())
    }

    fn lease_slot(&self, t: &mut Table, page: u32, holder: Holder) -> PageLease {
        let slot = &mut t.slots[page as usize];
        debug_assert_eq!(slot.state, SlotState::Free, "page {page} leased twice");
        slot.state = SlotState::Leased;
        slot.holder = holder;
        PageLease::new(self.id, page, slot.generation, holder)
    }

    fn holders_of(t: &Table, page: u32) -> Vec<Holder> {
        let Some(slot) = t.slots.get(page as usize) else {
            return Vec::new();
        };
        if slot.state == SlotState::Free {
            return Vec::new();
        }
        let mut v = vec![slot.holder];
        if let Some(more) = t.more_readers.get(&page) {
            v.extend_from_slice(more);
        }
        v
    }

    /// Who holds `page` now: the transfer (and role) each lease on it is for; empty when
    /// kvwire holds nothing on it. The engine asks before it reuses a page.
    pub fn holders(&self, page: u32) -> Vec<Holder> {
        Self::holders_of(&self.table(), page)
    }

    /// Every page kvwire holds now, with its holders, in page order.
    pub fn held_pages(&self) -> Vec<(u32, Vec<Holder>)> {
        let t = self.table();
        (0..t.slots.len() as u32)
            .filter(|&p| t.slots[p as usize].state != SlotState::Free)
            .map(|p| (p, Self::holders_of(&t, p)))
            .collect()
    }

    /// The engine's allocator is about to free (reuse) `pages`: refused with
    /// [`PoolError::HeldByKvwire`], naming the first page kvwire still holds and for which
    /// transfers, so a page in flight is never silently handed to another request.
    pub fn check_engine_free(&self, pages: &[u32]) -> Result<(), PoolError> {
        let t = self.table();
        for &page in pages {
            let Some(slot) = t.slots.get(page as usize) else {
                return Err(PoolError::PageOutOfRange {
                    page,
                    pages: self.geometry.pages,
                });
            };
            if slot.state != SlotState::Free {
                return Err(PoolError::HeldByKvwire {
                    page,
                    holders: Self::holders_of(&t, page),
                });
            }
        }
        Ok(())
    }

    /// Moves a leased page to quarantine: its transfer failed or was aborted, and it must wait
    /// for the transport's fence before it is released. Quarantining an already quarantined
    /// page is a no-op. A quarantined page's bytes cannot be reached through its lease.
    ///
    /// Fails, changing nothing, when the lease is stale, released, forged or from another
    /// pool.
    pub fn quarantine(&self, lease: &PageLease) -> Result<(), PoolError> {
        let mut t = self.table();
        let state = self.check(&t, lease)?;
        if let SlotState::Reading(_) = state {
            return Err(PoolError::SharedLease { page: lease.page() });
        }
        if state == SlotState::Leased {
            t.slots[lease.page() as usize].state = SlotState::Quarantined;
            t.leased -= 1;
            t.quarantined += 1;
            t.quarantines += 1;
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
    /// [`PoolError::WrongPool`] or [`PoolError::PageOutOfRange`], and with
    /// [`PoolError::Pinned`] / [`PoolError::Busy`] while a reader or writer still holds the
    /// page.
    pub fn release(&self, lease: PageLease) -> Result<(), PoolError> {
        let mut t = self.table();
        let state = match self.check(&t, &lease) {
            Ok(state) => state,
            Err(e) => {
                t.stale_release_errors += 1;
                tracing::debug!(pool = self.id, error = %e, "page release refused");
                return Err(e);
            }
        };
        let page = lease.page();
        if let SlotState::Reading(n) = state {
            if n > 1 {
                // Other transfers still read the page: only this reader goes.
                Self::drop_reader(&mut t, page, lease.holder());
                t.slots[page as usize].state = SlotState::Reading(n - 1);
                t.releases += 1;
                return Ok(());
            }
        }
        if self.locks.held(page) {
            t.stale_release_errors += 1;
            let e = if self.locks.read_locked(page) {
                PoolError::Pinned { page }
            } else {
                PoolError::Busy { page }
            };
            tracing::error!(pool = self.id, page, error = %e, "page release refused");
            return Err(e);
        }
        if let Some(byte) = self.scrub.fill_byte() {
            for buffer in 0..self.memory.buffers() {
                // Nobody holds the page (checked above, under the table lock, and new guards
                // need a current lease or go through the transports, which write only pages
                // leased to an open scope).
                if !self.memory.is_host(buffer) {
                    // Device memory: filled by the device (never through a host reference),
                    // under the page's write lock like a host fill.
                    if self.locks.try_write(page) {
                        // SAFETY: in range; the write lock and the table lock exclude every
                        // other user of the slot until the blocking fill returned.
                        let r = unsafe { self.memory.fill_device_page(page, buffer, byte) };
                        self.locks.unlock_write(page);
                        if let Err(e) = r {
                            tracing::error!(pool = self.id, page, buffer, error = %e, "device scrub failed");
                        }
                    }
                    continue;
                }
                if let Ok(mut bytes) = PageMut::new(&self.memory, &self.locks, page, buffer) {
                    bytes.fill(byte);
                }
            }
        }
        let slot = &mut t.slots[page as usize];
        slot.generation = slot.generation.wrapping_add(1);
        slot.state = SlotState::Free;
        slot.holder = Holder::Caller;
        match state {
            SlotState::Leased => t.leased -= 1,
            SlotState::Quarantined => t.quarantined -= 1,
            SlotState::Reading(_) => t.reading -= 1,
            SlotState::Free => unreachable!("check() refuses free pages"),
        }
        t.free.push(page);
        t.releases += 1;
        Ok(())
    }

    /// Removes one reader `holder` of shared `page` (which has more than one).
    fn drop_reader(t: &mut Table, page: u32, holder: Holder) {
        let more = t.more_readers.entry(page).or_default();
        if t.slots[page as usize].holder == holder {
            // The first reader goes: the next one takes its place.
            if let Some(next) = more.pop() {
                t.slots[page as usize].holder = next;
            }
        } else if let Some(i) = more.iter().position(|&h| h == holder) {
            more.swap_remove(i);
        } else {
            more.pop();
        }
        if more.is_empty() {
            t.more_readers.remove(&page);
        }
    }

    /// The state of `page`, or `None` if it is out of range.
    pub fn state(&self, page: u32) -> Option<PageState> {
        let t = self.table();
        let slot = t.slots.get(page as usize)?;
        Some(match slot.state {
            SlotState::Free => PageState::Free,
            SlotState::Leased => PageState::Leased {
                generation: slot.generation,
            },
            SlotState::Quarantined => PageState::Quarantined {
                generation: slot.generation,
            },
            SlotState::Reading(readers) => PageState::Reading {
                generation: slot.generation,
                readers,
            },
        })
    }

    /// Whether `page` is leased or quarantined under exactly `generation`: what a transport
    /// checks before letting a write land in the page.
    pub fn holds(&self, page: u32, generation: u32) -> bool {
        self.table()
            .slots
            .get(page as usize)
            .is_some_and(|s| s.state != SlotState::Free && s.generation == generation)
    }

    /// Checks a lease without using it: its page's state if the lease is current, the error
    /// any other operation would return otherwise.
    pub fn check_lease(&self, lease: &PageLease) -> Result<PageState, PoolError> {
        self.check(&self.table(), lease)?;
        Ok(self.state(lease.page()).unwrap_or(PageState::Free))
    }

    /// A snapshot of the pool's counters.
    pub fn stats(&self) -> PoolStats {
        let t = self.table();
        PoolStats {
            free: t.free.len,
            leased: t.leased,
            reading: t.reading,
            quarantined: t.quarantined,
            allocations: t.allocations,
            quarantines: t.quarantines,
            releases: t.releases,
            stale_release_errors: t.stale_release_errors,
        }
    }

    /// Checks that `lease` is current in this pool; returns its page's (non-free) state.
    fn check(&self, t: &Table, lease: &PageLease) -> Result<SlotState, PoolError> {
        if lease.pool_id() != self.id {
            return Err(PoolError::WrongPool {
                lease_pool: lease.pool_id(),
                pool: self.id,
            });
        }
        let page = lease.page();
        let Some(slot) = t.slots.get(page as usize) else {
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

    /// Cross-checks the free list, slot table and counters (tests only).
    #[cfg(test)]
    fn assert_invariants(&self) {
        let t = self.table();
        let mut on_free_list = vec![false; t.slots.len()];
        let (mut p, mut n, mut prev) = (t.free.head, 0u32, NIL);
        while p != NIL {
            assert!(!on_free_list[p as usize], "page {p} twice on the free list");
            assert_eq!(t.free.prev[p as usize], prev, "broken back link at {p}");
            on_free_list[p as usize] = true;
            n += 1;
            prev = p;
            p = t.free.next[p as usize];
        }
        assert_eq!(n, t.free.len);
        let (mut leased, mut quarantined, mut reading) = (0u32, 0u32, 0u32);
        for (p, slot) in t.slots.iter().enumerate() {
            assert_eq!(
                on_free_list[p],
                slot.state == SlotState::Free,
                "page {p} free-list membership disagrees with its state {:?}",
                slot.state
            );
            match slot.state {
                SlotState::Leased => leased += 1,
                SlotState::Quarantined => quarantined += 1,
                SlotState::Reading(n) => {
                    reading += 1;
                    let more = t.more_readers.get(&(p as u32)).map_or(0, Vec::len);
                    assert_eq!(
                        more as u32 + 1,
                        n,
                        "page {p}: {n} readers, {more} extra holders"
                    );
                }
                SlotState::Free => {}
            }
        }
        assert_eq!(leased, t.leased);
        assert_eq!(quarantined, t.quarantined);
        assert_eq!(reading, t.reading);
        assert_eq!(
            u64::from(t.free.len) + u64::from(leased) + u64::from(quarantined) + u64::from(reading),
            u64::from(self.geometry.pages)
        );
    }
}

#[cfg(test)]
mod tests;
