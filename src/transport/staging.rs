//! The staging pipeline of a byte-stream transport over device (GPU) memory.
//!
//! A socket reads and writes host memory; device pages are never dereferenced on the host
//! (`memory::MemoryKind`). So a transport whose KV memory has device buffers moves each
//! data record through one of a few **pinned staging buffers** (two by default: double
//! buffering), with the device's copy engines ([`CopyQueue`]):
//!
//! * **Sending:** a record's pages are copied device → staging (host buffers of a mixed
//!   memory are copied on the host), the copy's ticket completes, and only then does the
//!   record go on the socket from the staging buffer. While one staging buffer is on the
//!   socket, the next record's copy into the other runs.
//! * **Receiving:** a record's payload is read from the socket into a staging buffer; once
//!   it is complete (and its scope still open), it is copied staging → device into the
//!   leased page. The page has **landed when that copy completed** (its ticket), and only
//!   then is the landing reported; while the copy runs, the next record is read into the
//!   other buffer. With every buffer busy, the socket is not read (backpressure).
//!
//! A slot's bytes are never referenced while a copy into or out of it may run: the host
//! touches a slot only while it is free (filling it), or after its ticket completed.
//! Nothing is allocated per record: the buffers are allocated once, with the transport.

use std::fmt;
use std::sync::Arc;
use std::task::Waker;

use crate::memory::{CopyQueue, CopyTicket, DeviceError, DeviceMemoryOps, KvMemory, PagePool};

/// Staging buffers per transport (double buffering).
pub(crate) const STAGING_BUFFERS: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    /// Unused.
    Free,
    /// Taken by the host (a record being read into it from the socket).
    Filling,
    /// A copy into or out of it runs until the ticket completes.
    Copying(CopyTicket),
    /// The copy completed (sending: the record may go on the socket).
    Ready,
}

struct Slot {
    buf: Box<dyn crate::memory::PinnedBuffer>,
    state: SlotState,
}

/// Counters of a staging pipeline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StagingStats {
    /// Records copied through a staging buffer.
    pub records: u64,
    /// Most staging buffers with a copy in flight at once.
    pub max_copies_in_flight: u64,
    /// Socket operations (a write of a staged record, or a read into a staging buffer)
    /// issued while another buffer's copy was in flight: the double buffering at work.
    pub overlapped: u64,
}

/// The staging buffers and copy queue of one transport end.
pub(crate) struct Staging {
    ops: Arc<dyn DeviceMemoryOps>,
    queue: Box<dyn CopyQueue>,
    slots: Vec<Slot>,
    pub(crate) stats: StagingStats,
}

impl fmt::Debug for Staging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Staging")
            .field("ordinal", &self.ops.ordinal())
            .field(
                "slots",
                &self.slots.iter().map(|s| s.state).collect::<Vec<_>>(),
            )
            .field("stats", &self.stats)
            .finish()
    }
}

impl Staging {
    /// The pipeline for `memory`, if it has device buffers: `buffers` staging buffers of
    /// one record (`record_len` bytes: every buffer's page) each, and a copy queue.
    pub(crate) fn for_memory(
        memory: &KvMemory,
        record_len: usize,
        buffers: usize,
    ) -> Result<Option<Self>, DeviceError> {
        let Some(ops) = memory.device_ops() else {
            return Ok(None);
        };
        let queue = ops.queue()?;
        let slots = (0..buffers.max(1))
            .map(|_| {
                Ok(Slot {
                    buf: ops.pinned(record_len)?,
                    state: SlotState::Free,
                })
            })
            .collect::<Result<Vec<_>, DeviceError>>()?;
        Ok(Some(Self {
            ops: ops.clone(),
            queue,
            slots,
            stats: StagingStats::default(),
        }))
    }

    /// Takes a free slot for the host (to fill it), if there is one.
    pub(crate) fn take_free(&mut self) -> Option<usize> {
        let i = self.slots.iter().position(|s| s.state == SlotState::Free)?;
        self.slots[i].state = SlotState::Filling;
        Some(i)
    }

    /// Gives a slot back (its copy completed, or it was never copied).
    pub(crate) fn release(&mut self, slot: usize) {
        debug_assert!(!matches!(self.slots[slot].state, SlotState::Copying(_)));
        self.slots[slot].state = SlotState::Free;
    }

    /// Slots with a copy in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| matches!(s.state, SlotState::Copying(_)))
            .count()
    }

    fn started(&mut self, slot: usize) -> Result<(), DeviceError> {
        let t = self.queue.mark()?;
        self.slots[slot].state = SlotState::Copying(t);
        self.stats.records += 1;
        self.stats.max_copies_in_flight =
            self.stats.max_copies_in_flight.max(self.in_flight() as u64);
        Ok(())
    }

    /// Sending: copies page `page` (every buffer, in order) into `slot` (taken with
    /// [`Staging::take_free`]): device buffers by the copy queue, host buffers now.
    pub(crate) fn copy_out(
        &mut self,
        slot: usize,
        pool: &PagePool,
        page: u32,
    ) -> Result<(), DeviceError> {
        let memory = pool.memory();
        let base = self.slots[slot].buf.as_mut_ptr();
        let mut off = 0;
        for b in 0..memory.buffers() {
            let n = pool.geometry().buffer_page_bytes[b] as usize;
            match memory.device_page(page, b) {
                // SAFETY: `base + off .. + n` is inside the slot (one record: the sum of the
                // page sizes); the slot is the host's (Filling), so nothing else touches it
                // until the ticket marked below completed; the source is a slot of a
                // registered device buffer, leased to the transfer being sent (its source
                // page stays leased until the write is reported, after this copy).
                Some(src) => unsafe { self.queue.copy_to_host(src, base.add(off), n) }?,
                None => {
                    let bytes = pool
                        .raw_page(page, b)
                        .ok_or_else(|| DeviceError::Copy(format!("host page {page} busy")))?;
                    // SAFETY: as above for the slot; `bytes` is a read-locked host page of
                    // `n` bytes, another allocation.
                    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(off), n) };
                }
            }
            off += n;
        }
        self.started(slot)
    }

    /// Receiving: copies the record in `slot` (filled from the socket) into page `page`:
    /// device buffers by the copy queue, host buffers now.
    pub(crate) fn copy_in(
        &mut self,
        slot: usize,
        pool: &PagePool,
        page: u32,
    ) -> Result<(), DeviceError> {
        let memory = pool.memory();
        let base = self.slots[slot].buf.as_mut_ptr();
        let mut off = 0;
        for b in 0..memory.buffers() {
            let n = pool.geometry().buffer_page_bytes[b] as usize;
            match memory.device_page(page, b) {
                // SAFETY: the slot holds the whole record and is the host's (Filling): nothing
                // writes it until the ticket marked below completed; the destination is a slot
                // of a registered device buffer in the reservation's open scope, which the
                // fence waits for (it completes only once this copy did).
                Some(dst) => unsafe {
                    self.queue
                        .copy_to_device(base.add(off).cast_const(), dst, n)
                }?,
                None => {
                    let mut bytes = pool
                        .raw_page_mut(page, b)
                        .ok_or_else(|| DeviceError::Copy(format!("host page {page} busy")))?;
                    // SAFETY: as above for the slot; `bytes` is a write-locked host page of
                    // `n` bytes, another allocation.
                    unsafe { std::ptr::copy_nonoverlapping(base.add(off), bytes.as_mut_ptr(), n) };
                }
            }
            off += n;
        }
        self.started(slot)
    }

    /// Whether `slot`'s copy completed (it is then Ready); registers `waker` if not.
    pub(crate) fn poll_slot(
        &mut self,
        slot: usize,
        waker: Option<&Waker>,
    ) -> Result<bool, DeviceError> {
        match self.slots[slot].state {
            SlotState::Copying(t) => {
                if self.queue.poll_done(t, waker)? {
                    self.slots[slot].state = SlotState::Ready;
                    Ok(true)
                } else {
                    Ok(false)
                }
            }
            SlotState::Ready => Ok(true),
            SlotState::Free | SlotState::Filling => Ok(false),
        }
    }

    /// The bytes of `slot`, `len` of them: only for a slot whose copy completed (Ready) or
    /// that the host holds (Filling).
    ///
    /// # Panics
    /// If a copy may still run on the slot, or `len` exceeds it.
    pub(crate) fn bytes(&mut self, slot: usize, len: usize) -> &mut [u8] {
        let s = &mut self.slots[slot];
        assert!(
            matches!(s.state, SlotState::Ready | SlotState::Filling),
            "staging slot {slot} is {:?}",
            s.state
        );
        assert!(len <= s.buf.len());
        // SAFETY: no copy runs on the slot (asserted: its ticket completed, or none was
        // queued since it was taken), the buffer is valid for its length while `s` lives, and
        // the `&mut self` borrow makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(s.buf.as_mut_ptr(), len) }
    }

    /// The bytes of a Ready `slot` (its copy completed), `len` of them, shared.
    ///
    /// # Panics
    /// If the slot is not Ready, or `len` exceeds it.
    pub(crate) fn ready_bytes(&self, slot: usize, len: usize) -> &[u8] {
        let s = &self.slots[slot];
        assert!(
            s.state == SlotState::Ready,
            "staging slot {slot} is {:?}",
            s.state
        );
        assert!(len <= s.buf.len());
        // SAFETY: the slot's copy completed and no other is queued on it until it is released
        // (which needs `&mut self`, excluded while this borrow lives); the buffer is valid
        // for its length while `s` lives.
        unsafe { std::slice::from_raw_parts(s.buf.as_ptr(), len) }
    }

    /// Blocks until every queued copy completed (before the transport lets go of pages or
    /// buffers: a connection closing).
    pub(crate) fn synchronize(&mut self) -> Result<(), DeviceError> {
        let r = self.queue.synchronize();
        for s in &mut self.slots {
            if matches!(s.state, SlotState::Copying(_)) {
                s.state = SlotState::Ready;
            }
        }
        r
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The buffers are freed after this: no copy may still use them.
        if let Err(e) = self.queue.synchronize() {
            tracing::error!(error = %e, "staging copies failed at close");
        }
    }
}
