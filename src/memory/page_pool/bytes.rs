//! The page pool's bytes: reading and writing pages through leases, the engine's own pages,
//! raw access for the transports, and pinned views that cross threads.

use std::sync::Arc;

use super::{PagePool, SlotState};
use crate::memory::access::{PageMut, PageRef, PageRowMut, SharedPages};
use crate::memory::{KvMemory, PageLease, PoolError};

impl PagePool {
    /// The bytes of the leased page in `buffer`, read-locked while the guard lives.
    ///
    /// Fails when the lease is not current or of this pool, when its page is quarantined,
    /// when `buffer` is out of range, or ([`PoolError::Busy`]) while a writer holds the page.
    pub fn page(&self, lease: &PageLease, buffer: usize) -> Result<PageRef<'_>, PoolError> {
        self.check_usable(lease, buffer)?;
        PageRef::new(&self.memory, &self.locks, lease.page(), buffer)
    }

    /// The bytes of the leased page in `buffer`, writable, locked against everyone else while
    /// the guard lives. Fails as [`PagePool::page`] does, and with [`PoolError::Pinned`] while
    /// a digest job reads the page.
    pub fn page_mut(&self, lease: &PageLease, buffer: usize) -> Result<PageMut<'_>, PoolError> {
        if let SlotState::Reading(_) = self.check_usable(lease, buffer)? {
            return Err(PoolError::SharedLease { page: lease.page() });
        }
        PageMut::new(&self.memory, &self.locks, lease.page(), buffer)
    }

    /// The bytes of slot `page` in `buffer` regardless of lease state: what a NIC or an
    /// in-process transport sees. Access control is the transport's job (scopes/fences), not
    /// this method's. `None` if `page` or `buffer` is out of range or a writer holds it.
    pub fn raw_page(&self, page: u32, buffer: usize) -> Option<PageRef<'_>> {
        self.in_range(page, buffer)?;
        PageRef::new(&self.memory, &self.locks, page, buffer).ok()
    }

    /// The bytes of slot `page` in `buffer` regardless of lease state, writable. See
    /// [`PagePool::raw_page`]; `None` also while anyone else holds the page (e.g. a digest
    /// job pins it).
    pub fn raw_page_mut(&self, page: u32, buffer: usize) -> Option<PageMut<'_>> {
        self.in_range(page, buffer)?;
        PageMut::new(&self.memory, &self.locks, page, buffer).ok()
    }

    /// Slot `page` in every buffer, writable, regardless of lease state (a TCP record's
    /// destination). See [`PagePool::raw_page_mut`]; `None` if `page` is out of range, a
    /// buffer is device memory, or anyone else holds the page.
    pub fn raw_row_mut(&self, page: u32) -> Option<PageRowMut<'_>> {
        (page < self.geometry.pages).then_some(())?;
        PageRowMut::new(&self.memory, &self.locks, page).ok()
    }

    /// The engine reads page `page` of `buffer` of its own registered memory (any page, at
    /// any time: a page leased to an open reservation reads as unspecified bytes until its
    /// transfer is verified). Fails when out of range or ([`PoolError::Busy`]) while kvwire
    /// writes the page through Rust code right now (a TCP record landing).
    pub fn engine_page(&self, page: u32, buffer: usize) -> Result<PageRef<'_>, PoolError> {
        self.check_range(page, buffer)?;
        PageRef::new(&self.memory, &self.locks, page, buffer)
    }

    /// The engine writes page `page` of `buffer` of its own registered memory: allowed only
    /// while kvwire holds nothing on the page (fails with [`PoolError::HeldByKvwire`]
    /// naming who holds it). The safe way for a Rust engine to produce its KV in place
    /// before [`SenderConn::send_pages`](crate::SenderConn::send_pages).
    pub fn engine_page_mut(&self, page: u32, buffer: usize) -> Result<PageMut<'_>, PoolError> {
        self.check_range(page, buffer)?;
        let t = self.table();
        if t.slots[page as usize].state != SlotState::Free {
            return Err(PoolError::HeldByKvwire {
                page,
                holders: Self::holders_of(&t, page),
            });
        }
        // Taken under the table lock, so no lease can be made between the check and the
        // guard; a transport writes only leased pages.
        PageMut::new(&self.memory, &self.locks, page, buffer)
    }

    /// Copies `src` (the page's size) into the leased page in `buffer`, host or device memory
    /// alike (through the device for a device buffer: a blocking copy). Fails as
    /// [`PagePool::page_mut`] does.
    pub fn write_page(
        &self,
        lease: &PageLease,
        buffer: usize,
        src: &[u8],
    ) -> Result<(), PoolError> {
        if let SlotState::Reading(_) = self.check_usable(lease, buffer)? {
            return Err(PoolError::SharedLease { page: lease.page() });
        }
        let page = lease.page();
        let want = self.memory.page_bytes[buffer];
        if src.len() != want {
            return Err(PoolError::BadGeometry(format!(
                "{} bytes to write into page {page} of buffer {buffer}, the page has {want}",
                src.len()
            )));
        }
        let (Some(ptr), Some(ops)) = (
            self.memory.device_page(page, buffer),
            self.memory.device_ops(),
        ) else {
            PageMut::new(&self.memory, &self.locks, page, buffer)?.copy_from_slice(src);
            return Ok(());
        };
        if !self.locks.try_write(page) {
            return Err(if self.locks.read_locked(page) {
                PoolError::Pinned { page }
            } else {
                PoolError::Busy { page }
            });
        }
        // SAFETY: a slot of a registered device buffer, leased to the caller (checked) and
        // write-locked: nothing of kvwire's reads or writes it until the copy returned.
        let r = unsafe { ops.write(ptr, src) };
        self.locks.unlock_write(page);
        r.map_err(PoolError::from)
    }

    /// The engine copies page `page` of `buffer` of its own memory into `dst` (the page's
    /// size), host or device memory alike: what [`PagePool::engine_page`] allows, through the
    /// device for a device buffer (a blocking copy).
    pub fn engine_read(&self, page: u32, buffer: usize, dst: &mut [u8]) -> Result<(), PoolError> {
        self.check_page_len(page, buffer, dst.len(), "to read the page into")?;
        let (Some(ptr), Some(ops)) = (
            self.memory.device_page(page, buffer),
            self.memory.device_ops(),
        ) else {
            dst.copy_from_slice(&self.engine_page(page, buffer)?);
            return Ok(());
        };
        if !self.locks.try_read(page) {
            return Err(PoolError::Busy { page });
        }
        // SAFETY: a slot of a registered device buffer; the read lock keeps kvwire's own
        // writers (fills) out until the blocking copy returned.
        let r = unsafe { ops.read(ptr, dst) };
        self.locks.unlock_read(page);
        r.map_err(PoolError::from)
    }

    /// The engine writes `src` (the page's size) into page `page` of `buffer` of its own
    /// memory, host or device: allowed when [`PagePool::engine_page_mut`] is (kvwire holds
    /// nothing on the page), through the device for a device buffer (a blocking copy).
    pub fn engine_write(&self, page: u32, buffer: usize, src: &[u8]) -> Result<(), PoolError> {
        self.check_page_len(page, buffer, src.len(), "to write into the page")?;
        let (Some(ptr), Some(ops)) = (
            self.memory.device_page(page, buffer),
            self.memory.device_ops(),
        ) else {
            self.engine_page_mut(page, buffer)?.copy_from_slice(src);
            return Ok(());
        };
        let t = self.table();
        if t.slots[page as usize].state != SlotState::Free {
            return Err(PoolError::HeldByKvwire {
                page,
                holders: Self::holders_of(&t, page),
            });
        }
        if !self.locks.try_write(page) {
            return Err(PoolError::Busy { page });
        }
        // SAFETY: a slot of a registered device buffer, free (checked under the table lock,
        // held until the copy returned) and write-locked: nothing of kvwire's touches it.
        let r = unsafe { ops.write(ptr, src) };
        self.locks.unlock_write(page);
        drop(t);
        r.map_err(PoolError::from)
    }

    /// `page` and `buffer` are in range and `len` is the page's size (the engine's copies
    /// in and out of its own pages).
    fn check_page_len(
        &self,
        page: u32,
        buffer: usize,
        len: usize,
        what: &str,
    ) -> Result<(), PoolError> {
        self.check_range(page, buffer)?;
        let want = self.memory.page_bytes[buffer];
        if len != want {
            return Err(PoolError::BadGeometry(format!(
                "{len} bytes {what} (page {page} of buffer {buffer}), the page has {want}"
            )));
        }
        Ok(())
    }

    fn check_range(&self, page: u32, buffer: usize) -> Result<(), PoolError> {
        if page >= self.geometry.pages {
            return Err(PoolError::PageOutOfRange {
                page,
                pages: self.geometry.pages,
            });
        }
        if buffer >= self.memory.buffers() {
            return Err(PoolError::BufferOutOfRange {
                buffer,
                buffers: self.memory.buffers(),
            });
        }
        Ok(())
    }

    fn in_range(&self, page: u32, buffer: usize) -> Option<()> {
        (page < self.geometry.pages && buffer < self.memory.buffers()).then_some(())
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
        SharedPages::new(self.memory.clone(), self.locks.clone(), pages)
    }

    /// The pool's memory, e.g. to register it with a NIC.
    pub fn memory(&self) -> &Arc<KvMemory> {
        &self.memory
    }

    /// Whether a live [`SharedPages`] view pins `page`.
    pub fn pinned(&self, page: u32) -> bool {
        self.locks.read_locked(page)
    }

    /// Checks that `lease` is current, not quarantined, and `buffer` exists; returns the
    /// page's state.
    fn check_usable(&self, lease: &PageLease, buffer: usize) -> Result<SlotState, PoolError> {
        let state = self.check(&self.table(), lease)?;
        if state == SlotState::Quarantined {
            return Err(PoolError::Quarantined { page: lease.page() });
        }
        if buffer >= self.memory.buffers() {
            return Err(PoolError::BufferOutOfRange {
                buffer,
                buffers: self.memory.buffers(),
            });
        }
        Ok(state)
    }
}
