//! Device (GPU) memory as KV memory: where a buffer's bytes live, and the seam through which
//! kvwire reaches bytes it must never dereference on the host.
//!
//! A [`KvMemory`](super::KvMemory) registers each buffer with a [`MemoryKind`]: host memory
//! (read and written by Rust code through the page locks), or device memory of one GPU
//! ([`MemoryKind::Device`], with its ordinal), given as a [`DevicePtr`] that kvwire never
//! turns into a host reference. Everything that touches page bytes on the host — digests,
//! scrub-on-release, a TCP record landing, an engine's fill — goes, for a device buffer,
//! through a [`DeviceMemoryOps`]: copy engines (a [`CopyQueue`]: asynchronous copies between
//! device memory and pinned host staging buffers, in order, with tickets to learn when they
//! completed), digests computed in device memory, fills, and blocking copies for engines and
//! tests.
//!
//! Implementations: `kvwire::gpu::CudaMemoryOps` (feature `cuda`: cudarc, async memcpy on a
//! stream, pinned buffers from `cuMemHostAlloc`, the GPU digest kernels) and
//! `kvwire::gpu::HostStandIn` (always built: "device" memory simulated by host allocations at
//! addresses the host cannot dereference, copies carried out by a worker thread so the
//! asynchrony is real), which CI tests with.

use std::fmt;
use std::task::Waker;

use kvwire_proto::wire::{DigestAlgorithm, TransferDigests, TransferRef};

/// Where one buffer's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Host memory: kvwire reads and writes it directly (under the page locks).
    #[default]
    Host,
    /// Memory of GPU `ordinal`: never dereferenced on the host; reached only through the
    /// memory's [`DeviceMemoryOps`].
    Device {
        /// The device ordinal (CUDA's device index).
        ordinal: u32,
    },
}

impl MemoryKind {
    /// Whether this is device memory.
    pub fn is_device(self) -> bool {
        matches!(self, Self::Device { .. })
    }
}

/// A device address (a `CUdeviceptr` on CUDA). Plain data: kvwire never dereferences it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address `bytes` further on.
    pub fn offset(self, bytes: usize) -> Self {
        Self(self.0 + bytes as u64)
    }
}

/// One buffer of a transfer in device memory, for a digest in place: page slot `p` is the
/// `page_bytes` bytes at `ptr + p * page_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceSlots {
    /// Device address of page slot 0.
    pub ptr: DevicePtr,
    /// Bytes per page of this buffer.
    pub page_bytes: u32,
}

/// Why a device memory operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// Allocating pinned host memory (staging) failed.
    #[error("pinned host allocation of {bytes} bytes failed: {detail}")]
    PinnedAlloc {
        /// Bytes asked for.
        bytes: usize,
        /// What the driver said.
        detail: String,
    },
    /// A copy between host and device could not be queued, or failed.
    #[error("device copy failed: {0}")]
    Copy(String),
    /// A digest in device memory could not be computed.
    #[error("device digest failed: {0}")]
    Digest(String),
    /// An address range is not device memory of this device.
    #[error("{len} bytes at device address {addr:#x} are not memory of this device")]
    BadAddress {
        /// The address.
        addr: u64,
        /// The length.
        len: usize,
    },
    /// The device (or its driver) is not usable.
    #[error("device unavailable: {0}")]
    Unavailable(String),
}

/// A point in a [`CopyQueue`]: every copy queued before [`CopyQueue::mark`] returned it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CopyTicket(pub u64);

/// Pinned (page-locked) host memory: what copy engines read from and write into.
///
/// Its owner must not make a reference to its bytes while a copy into or out of it may still
/// run (the staging pipeline only does after the copy's ticket completed).
pub trait PinnedBuffer: Send + fmt::Debug {
    /// The start of the buffer (valid for [`PinnedBuffer::len`] bytes while it lives).
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// The start of the buffer, for reading.
    fn as_ptr(&self) -> *const u8;
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An in-order queue of asynchronous copies on one device (a CUDA stream): copies run in the
/// order queued; a ticket from [`CopyQueue::mark`] completes once every copy queued before it
/// completed.
pub trait CopyQueue: Send + fmt::Debug {
    /// Queues a copy of `len` bytes from device address `src` into host memory at `dst`.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for writes of `len` bytes (pinned memory from
    /// [`DeviceMemoryOps::pinned`]), and nothing may read or write them, until a ticket
    /// marked after this call has completed (or [`CopyQueue::synchronize`] returned).
    /// `src..src+len` must be memory of this queue's device that stays allocated as long.
    unsafe fn copy_to_host(
        &mut self,
        src: DevicePtr,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), DeviceError>;

    /// Queues a copy of `len` bytes from host memory at `src` to device address `dst`.
    ///
    /// # Safety
    ///
    /// `src` must be valid for reads of `len` bytes, and nothing may write them, until a
    /// ticket marked after this call has completed (or [`CopyQueue::synchronize`] returned).
    /// `dst..dst+len` must be memory of this queue's device that stays allocated as long,
    /// and nothing else may write it meanwhile.
    unsafe fn copy_to_device(
        &mut self,
        src: *const u8,
        dst: DevicePtr,
        len: usize,
    ) -> Result<(), DeviceError>;

    /// A ticket for everything queued so far.
    fn mark(&mut self) -> Result<CopyTicket, DeviceError>;

    /// Whether every copy before `ticket` completed (never blocks). When not, `waker` (if
    /// given) is woken once it may have. A failed copy is an error here.
    fn poll_done(&mut self, ticket: CopyTicket, waker: Option<&Waker>)
        -> Result<bool, DeviceError>;

    /// Blocks until every copy queued so far completed.
    fn synchronize(&mut self) -> Result<(), DeviceError>;
}

/// What kvwire needs from a device to use its memory as KV memory: copy engines, digests in
/// place, fills, and blocking copies. See the module documentation.
pub trait DeviceMemoryOps: Send + Sync + fmt::Debug {
    /// The device ordinal (what [`MemoryKind::Device`] names).
    fn ordinal(&self) -> u32;

    /// Pinned host memory of `len` bytes, for staging.
    fn pinned(&self, len: usize) -> Result<Box<dyn PinnedBuffer>, DeviceError>;

    /// A new copy queue (its own stream).
    fn queue(&self) -> Result<Box<dyn CopyQueue>, DeviceError>;

    /// The digests of `pages` (slot indices, in ordinal order) of every buffer in `buffers`,
    /// computed in device memory, bound to `transfer` (SPEC §6): equal to
    /// `checksum::digest_transfer` over the same bytes. Blocks until done. Page digests are
    /// included when `per_page`; the aux digest is left zero (the caller computes it on the
    /// host from the COMMIT's record).
    ///
    /// # Safety
    ///
    /// Every slot named must be allocated memory of this device, and nothing may write it
    /// until this returns.
    unsafe fn digest(
        &self,
        algorithm: DigestAlgorithm,
        transfer: TransferRef,
        buffers: &[DeviceSlots],
        pages: &[u32],
        per_page: bool,
    ) -> Result<TransferDigests, DeviceError>;

    /// Fills `len` bytes at `dst` with `byte`; blocks until done (scrub-on-release).
    ///
    /// # Safety
    ///
    /// `dst..dst+len` must be allocated memory of this device that nothing else reads or
    /// writes until this returns.
    unsafe fn fill(&self, dst: DevicePtr, len: usize, byte: u8) -> Result<(), DeviceError>;

    /// Copies `dst.len()` bytes from device address `src` into `dst`; blocks until done.
    ///
    /// # Safety
    ///
    /// `src..src+dst.len()` must be allocated memory of this device that nothing writes
    /// until this returns.
    unsafe fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Copies `src` to device address `dst`; blocks until done.
    ///
    /// # Safety
    ///
    /// `dst..dst+src.len()` must be allocated memory of this device that nothing else reads
    /// or writes until this returns.
    unsafe fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError>;
}
