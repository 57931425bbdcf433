//! Page access locks: how several connections, digest jobs and the engine reach the bytes of
//! one shared [`KvMemory`] without two conflicting Rust references ever existing.
//!
//! Every page index has one access word: a count of readers, or the writer bit. A reader
//! ([`PageRef`], a [`SharedPages`] view) or a writer ([`PageMut`]) takes it before it makes a
//! reference to the page's bytes (in any buffer) and gives it back when dropped; taking it
//! never blocks, it fails instead (the caller reports [`PoolError::Busy`] or
//! [`PoolError::Pinned`]). This is a per-page reader/writer lock checked at run time, like a
//! `RefCell` that may cross threads: what it guards is that Rust code never aliases a
//! `&mut [u8]`. What may *write* a page at all (its lease, its access scope, the fence) is
//! decided above it, by the pool and the transports.
//!
//! Memory that is also written outside Rust (an engine's kernels, a NIC's DMA) is outside
//! these locks; the integration contract (`KvMemory::from_raw_parts`, `Node`) says which
//! pages the engine may write and when: never one kvwire holds.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::{KvMemory, PoolError};

const WRITER: u32 = 1 << 31;

/// The access words of every page of one memory.
#[derive(Clone)]
pub(crate) struct PageLocks(Arc<[AtomicU32]>);

impl fmt::Debug for PageLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageLocks")
            .field("pages", &self.0.len())
            .finish()
    }
}

impl PageLocks {
    pub(crate) fn new(pages: u32) -> Self {
        Self((0..pages).map(|_| AtomicU32::new(0)).collect())
    }

    /// Takes a read lock on `page` (in range); false if a writer holds it.
    pub(super) fn try_read(&self, page: u32) -> bool {
        let word = &self.0[page as usize];
        let mut v = word.load(Ordering::Acquire);
        loop {
            if v & WRITER != 0 || v == WRITER - 1 {
                return false;
            }
            match word.compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => v = now,
            }
        }
    }

    pub(super) fn unlock_read(&self, page: u32) {
        self.0[page as usize].fetch_sub(1, Ordering::AcqRel);
    }

    /// Takes the write lock on `page` (in range); false if anyone holds it.
    pub(super) fn try_write(&self, page: u32) -> bool {
        self.0[page as usize]
            .compare_exchange(0, WRITER, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// [`PageLocks::try_write`], or why not: a reader pins the page, or a writer holds it.
    pub(super) fn lock_for_writing(&self, page: u32) -> Result<(), PoolError> {
        if self.try_write(page) {
            Ok(())
        } else if self.read_locked(page) {
            Err(PoolError::Pinned { page })
        } else {
            Err(PoolError::Busy { page })
        }
    }

    pub(super) fn unlock_write(&self, page: u32) {
        self.0[page as usize].fetch_and(!WRITER, Ordering::AcqRel);
    }

    /// Whether anyone holds `page` (a reader or the writer).
    pub(crate) fn held(&self, page: u32) -> bool {
        self.0
            .get(page as usize)
            .is_some_and(|w| w.load(Ordering::Acquire) != 0)
    }

    /// Whether readers (not a writer) hold `page`.
    pub(crate) fn read_locked(&self, page: u32) -> bool {
        self.0.get(page as usize).is_some_and(|w| {
            let v = w.load(Ordering::Acquire);
            v != 0 && v & WRITER == 0
        })
    }
}

/// What both guards do alike: give the bytes, unlock when dropped, never print the bytes.
macro_rules! guard {
    ($guard:ident, $unlock:ident) => {
        impl Deref for $guard<'_> {
            type Target = [u8];
            fn deref(&self) -> &[u8] {
                self.bytes
            }
        }

        impl Drop for $guard<'_> {
            fn drop(&mut self) {
                self.locks.$unlock(self.page);
            }
        }

        impl fmt::Debug for $guard<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($guard))
                    .field("page", &self.page)
                    .field("len", &self.bytes.len())
                    .finish()
            }
        }
    };
}

/// Read access to one page of one buffer: the bytes, locked against writers while it lives.
pub struct PageRef<'a> {
    bytes: &'a [u8],
    locks: &'a PageLocks,
    page: u32,
}

impl<'a> PageRef<'a> {
    /// Locks `page` for reading and borrows its bytes in `buffer` (both in range).
    pub(crate) fn new(
        memory: &'a KvMemory,
        locks: &'a PageLocks,
        page: u32,
        buffer: usize,
    ) -> Result<Self, PoolError> {
        if !memory.is_host(buffer) {
            return Err(PoolError::DeviceMemory { buffer });
        }
        if !locks.try_read(page) {
            return Err(PoolError::Busy { page });
        }
        let range = memory.range(page, buffer);
        // SAFETY: in bounds (the caller checked page and buffer); the read lock excludes
        // every writer of this page until the guard drops, so no `&mut` aliases these bytes.
        let bytes = unsafe { memory.bytes(buffer, range) };
        Ok(Self { bytes, locks, page })
    }
}

guard!(PageRef, unlock_read);

impl PartialEq for PageRef<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl PartialEq<[u8]> for PageRef<'_> {
    fn eq(&self, other: &[u8]) -> bool {
        self.bytes == other
    }
}

impl PartialEq<&[u8]> for PageRef<'_> {
    fn eq(&self, other: &&[u8]) -> bool {
        self.bytes == *other
    }
}

/// Write access to one page of one buffer: the bytes, locked against every other reader and
/// writer while it lives.
pub struct PageMut<'a> {
    bytes: &'a mut [u8],
    locks: &'a PageLocks,
    page: u32,
}

impl<'a> PageMut<'a> {
    /// Locks `page` for writing and borrows its bytes in `buffer` (both in range).
    pub(crate) fn new(
        memory: &'a KvMemory,
        locks: &'a PageLocks,
        page: u32,
        buffer: usize,
    ) -> Result<Self, PoolError> {
        if !memory.is_host(buffer) {
            return Err(PoolError::DeviceMemory { buffer });
        }
        locks.lock_for_writing(page)?;
        let range = memory.range(page, buffer);
        // SAFETY: in bounds (the caller checked page and buffer); the write lock excludes
        // every other reader and writer of this page until the guard drops.
        let bytes = unsafe { memory.bytes_mut(buffer, range) };
        Ok(Self { bytes, locks, page })
    }
}

guard!(PageMut, unlock_write);

impl DerefMut for PageMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

/// Write access to one page index in every buffer (a TCP data record's destination: the page
/// of buffer 0, then buffer 1, ...), under one write lock: one guard lets a single vectored
/// read land a whole record.
pub struct PageRowMut<'a> {
    buffers: Vec<&'a mut [u8]>,
    locks: &'a PageLocks,
    page: u32,
}

impl<'a> PageRowMut<'a> {
    /// Locks `page` (in range) for writing and borrows its bytes in every buffer, all of
    /// which must be host memory.
    pub(crate) fn new(
        memory: &'a KvMemory,
        locks: &'a PageLocks,
        page: u32,
    ) -> Result<Self, PoolError> {
        if let Some(buffer) = (0..memory.buffers()).find(|&b| !memory.is_host(b)) {
            return Err(PoolError::DeviceMemory { buffer });
        }
        locks.lock_for_writing(page)?;
        let buffers = (0..memory.buffers())
            .map(|b| {
                let range = memory.range(page, b);
                // SAFETY: in bounds (the caller checked page; b < buffers), host memory
                // (checked above), and the buffers are distinct regions, so these slices do
                // not overlap; the write lock excludes every other reader and writer of this
                // page index until the guard drops.
                unsafe { memory.bytes_mut(b, range) }
            })
            .collect();
        Ok(Self {
            buffers,
            locks,
            page,
        })
    }

    /// The page's bytes in every buffer, in buffer order.
    pub fn buffers_mut(&mut self) -> &mut [&'a mut [u8]] {
        &mut self.buffers
    }
}

impl Drop for PageRowMut<'_> {
    fn drop(&mut self) {
        self.locks.unlock_write(self.page);
    }
}

impl fmt::Debug for PageRowMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageRowMut")
            .field("page", &self.page)
            .field("buffers", &self.buffers.len())
            .finish()
    }
}

/// A read-only view of some pages of a [`KvMemory`], which may cross threads (a digest
/// job on the blocking pool). It keeps the memory alive and read-locks (*pins*) its pages:
/// the pool refuses to write or release them until the view is dropped.
pub struct SharedPages {
    memory: Arc<KvMemory>,
    locks: PageLocks,
    pages: Arc<[u32]>,
}

impl fmt::Debug for SharedPages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedPages")
            .field("pages", &self.pages.len())
            .finish()
    }
}

impl SharedPages {
    /// Read-locks `pages` (in range: the pool checked) and makes the view; fails, locking
    /// nothing, if a writer holds one of them.
    pub(crate) fn new(
        memory: Arc<KvMemory>,
        locks: PageLocks,
        pages: Vec<u32>,
    ) -> Result<Self, PoolError> {
        for (i, &p) in pages.iter().enumerate() {
            if !locks.try_read(p) {
                for &q in &pages[..i] {
                    locks.unlock_read(q);
                }
                return Err(PoolError::Busy { page: p });
            }
        }
        Ok(Self {
            memory,
            locks,
            pages: pages.into(),
        })
    }

    /// Pages in the view.
    pub fn pages(&self) -> usize {
        self.pages.len()
    }

    /// Buffers per page.
    pub fn buffers(&self) -> usize {
        self.memory.buffers()
    }

    /// Bytes the view covers (all buffers of all its pages).
    pub fn bytes(&self) -> u64 {
        self.memory
            .page_bytes
            .iter()
            .map(|&b| b as u64)
            .sum::<u64>()
            * self.pages.len() as u64
    }

    /// The memory the view is of (its kinds, its device operations).
    pub fn memory(&self) -> &KvMemory {
        &self.memory
    }

    /// The slot indices of the view's pages, in ordinal order.
    pub fn page_indices(&self) -> &[u32] {
        &self.pages
    }

    /// The page digests (buffer-major, every device buffer in order, page digests included)
    /// of the view's pages in the memory's **device** buffers, computed in device memory by
    /// its [`DeviceMemoryOps`](super::DeviceMemoryOps), bound to `transfer`; empty digests when
    /// the memory has no device buffer. Blocks until done.
    pub fn digest_device_pages(
        &self,
        algorithm: kvwire_proto::wire::DigestAlgorithm,
        transfer: kvwire_proto::wire::TransferRef,
    ) -> Result<kvwire_proto::wire::TransferDigests, super::DeviceError> {
        let Some(ops) = self.memory.device_ops() else {
            return Ok(kvwire_proto::wire::TransferDigests::default());
        };
        let slots: Vec<_> = (0..self.memory.buffers())
            .filter_map(|b| self.memory.device_slots(b))
            .collect();
        // SAFETY: the slots are of the memory's registered device buffers (its registration
        // contract), and the view read-locks (pins) its pages until it drops: the pool refuses
        // to write or release them meanwhile. The transports write a page only under an open
        // scope, and a receiver digests a transfer only after its fence, which (on a staging
        // path) completes only once the copies into its pages completed.
        unsafe { ops.digest(algorithm, transfer, &slots, &self.pages, true) }
    }

    /// The bytes of the view's page `ordinal` in `buffer`.
    ///
    /// # Panics
    /// If `ordinal` or `buffer` is out of range, or `buffer` is device memory (see
    /// [`SharedPages::memory`]: digest device pages in place).
    pub fn page(&self, ordinal: usize, buffer: usize) -> &[u8] {
        let range = self.memory.range(self.pages[ordinal], buffer);
        // SAFETY: the page is in range (checked by the pool) and read-locked while this view
        // lives, so no `&mut` aliases it. The view holds the memory alive.
        unsafe { self.memory.bytes(buffer, range) }
    }
}

impl Drop for SharedPages {
    fn drop(&mut self) {
        for &p in self.pages.iter() {
            self.locks.unlock_read(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_share_writers_exclude() {
        let l = PageLocks::new(2);
        assert!(l.try_read(0) && l.try_read(0));
        assert!(!l.try_write(0), "readers hold it");
        assert!(l.try_write(1), "another page is independent");
        assert!(!l.try_read(1) && !l.try_write(1), "the writer holds it");
        l.unlock_read(0);
        l.unlock_read(0);
        l.unlock_write(1);
        assert!(!l.held(0) && !l.held(1));
        assert!(l.try_write(0));
        assert!(l.held(0) && !l.read_locked(0));
        l.unlock_write(0);
    }
}
