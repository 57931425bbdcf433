//! Registered KV memory: the bytes behind a page pool.
//!
//! A [`KvMemory`] is one contiguous region per buffer, either allocated here (zeroed and
//! faulted in, cache-line aligned, on transparent huge pages where the kernel gives them:
//! [`advise_huge_pages`]) or registered by the caller: owned buffers handed
//! over safely with [`KvMemory::from_buffers`], or memory the engine already owns (its KV
//! cache) with the `unsafe` [`KvMemory::from_raw_parts`].
//!
//! This module, `access.rs` and the RDMA transport are the only places with `unsafe` code.
//! Bytes are reached only through [`PagePool`](super::PagePool)'s access guards and
//! [`SharedPages`](super::SharedPages) views, which take each page's access lock
//! (`access.rs`), so no two Rust references to a page's bytes ever conflict.

use std::alloc::{alloc, dealloc, Layout};
use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;

use std::sync::Arc;

use crate::memory::device::{DeviceError, DeviceMemoryOps, DevicePtr, DeviceSlots, MemoryKind};
use crate::memory::{PoolError, PoolGeometry};

/// Alignment of memory allocated here: a 4 KiB page. Where a page starts within a 4 KiB page
/// decides how fast the kernel copies it in and out of a socket: the copy (`rep movsb` on
/// CPUs with fast strings) depends on how source and destination are aligned, and a TCP data
/// record's page bytes land in socket buffers at offsets shifted by its 36-byte header.
/// With buffers at offset 64 (this constant was 64 until 2026-12-05), the sender's copy of
/// 1 MiB pages ran at about 0.65x and 1.5x the CPU per byte; at offset 0 the engine workload
/// gained 1.21x at 1 MiB pages with one request in flight, with 64 KiB pages and four in
/// flight even (docs/BENCHMARKS.md, "Where a page starts within 4 KiB"). On that CPU the copy
/// runs at a sixth of its speed when the destination starts 1-15 bytes after the source modulo
/// 4 KiB, and under half for 16-31 ("Which offsets are slow"). (An earlier transport had
/// measured 64 KiB transfers 30% slower at 4 KiB alignment; the current one does not.)
/// RDMA registration needs no particular alignment (the kernel pins whole pages around any
/// range).
pub const ALIGN: usize = 4096;

/// Transparent huge pages are asked for only over memory of at least one huge page (2 MiB):
/// smaller memory gains nothing from them.
const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back `memory` with transparent huge pages (Linux `madvise(2)`
/// `MADV_HUGEPAGE`), before it is first touched. Memory an engine's KV pages are scattered
/// across (a gigabyte and more, written and read at random page indices) costs a TLB miss
/// per 4 KiB without them; numpy and PyTorch ask for them on large host allocations, and
/// [`KvMemory::allocate`] does for the memory kvwire allocates. Only the whole 4 KiB pages
/// inside `memory` are advised, and only when they span at least 2 MiB (else `false`
/// without asking); on hosts where the advice is refused (not Linux, a kernel without THP)
/// nothing changes. Returns whether the kernel took it. Best effort: the bytes are never
/// changed.
pub fn advise_huge_pages(memory: &mut [u8]) -> bool {
    match NonNull::new(memory.as_mut_ptr()) {
        Some(ptr) => advise_huge_pages_raw(ptr, memory.len()),
        None => false,
    }
}

/// [`advise_huge_pages`] over `len` bytes at `ptr`, which may not be initialized yet: the
/// advice reads and writes none of them.
fn advise_huge_pages_raw(ptr: NonNull<u8>, len: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        const BASE: usize = 4096;
        let start = ptr.as_ptr() as usize;
        let first = start.next_multiple_of(BASE);
        let end = (start + len) & !(BASE - 1);
        if end <= first || end - first < HUGE_PAGE {
            return false;
        }
        // SAFETY: `[first, end)` lies inside the caller's allocation of `len` bytes at `ptr`
        // and is 4 KiB aligned as madvise requires; MADV_HUGEPAGE changes how the range is
        // backed, never its contents, and reads or writes none of its bytes.
        let rc =
            unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
        rc == 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (ptr, len, HUGE_PAGE);
        false
    }
}

enum Owner {
    /// Allocated by [`KvMemory::allocate`] (or [`KvMemory::allocate_at_offset`]) with this
    /// layout; the region starts this many bytes into the allocation.
    Allocated(Layout, usize),
    /// A boxed slice handed over by [`KvMemory::from_buffers`].
    Boxed,
    /// Owned elsewhere ([`KvMemory::from_raw_parts`]); never freed here.
    Foreign,
}

struct Region {
    /// Host memory: the start. For a device buffer, a dangling placeholder never
    /// dereferenced (`device` holds the address).
    ptr: NonNull<u8>,
    len: usize,
    owner: Owner,
    /// `Some` for device memory: its address (never dereferenced on the host).
    device: Option<DevicePtr>,
}

/// One buffer of an engine's KV memory, for [`KvMemory::from_buffers_in`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvBuffer {
    /// Host memory at `ptr`, `len` bytes.
    Host {
        /// The start.
        ptr: NonNull<u8>,
        /// Its length.
        len: usize,
    },
    /// Device memory at `ptr` (of the device the [`DeviceMemoryOps`] given with it drive),
    /// `len` bytes.
    Device {
        /// The device address.
        ptr: DevicePtr,
        /// Its length.
        len: usize,
    },
}

impl KvBuffer {
    fn len(&self) -> usize {
        match *self {
            Self::Host { len, .. } | Self::Device { len, .. } => len,
        }
    }
}

/// The memory of every buffer of a pool.
pub struct KvMemory {
    regions: Vec<Region>,
    pub(super) page_bytes: Vec<usize>,
    pages: usize,
    /// The device of the device buffers (if any).
    device: Option<Arc<dyn DeviceMemoryOps>>,
}

// SAFETY: a KvMemory owns its regions (or, for `from_raw_parts`, the caller promised that
// they outlive it and that the engine writes no page kvwire holds). It hands out no references by itself: bytes are
// reached only through `unsafe fn bytes`/`bytes_mut`, whose callers guarantee the absence of
// data races, so sharing the handle across threads is sound.
unsafe impl Send for KvMemory {}
// SAFETY: see `Send` above.
unsafe impl Sync for KvMemory {}

impl fmt::Debug for KvMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvMemory")
            .field("buffers", &self.regions.len())
            .field("kinds", &self.kinds().collect::<Vec<_>>())
            .field("pages", &self.pages)
            .field("page_bytes", &self.page_bytes)
            .finish()
    }
}

fn check_len(geometry: &PoolGeometry, buffer: usize, len: usize) -> Result<usize, PoolError> {
    let want = geometry
        .buffer_len(buffer)
        .ok_or_else(|| PoolError::BadGeometry(format!("buffer {buffer} too large")))?;
    if len != want {
        return Err(PoolError::BadGeometry(format!(
            "buffer {buffer} has {len} bytes, the geometry needs {want}"
        )));
    }
    Ok(want)
}

impl KvMemory {
    fn shape(geometry: &PoolGeometry, regions: Vec<Region>) -> Self {
        Self {
            regions,
            page_bytes: geometry
                .buffer_page_bytes
                .iter()
                .map(|&b| b as usize)
                .collect(),
            pages: geometry.pages as usize,
            device: None,
        }
    }

    /// Allocates zeroed memory for `geometry`, every buffer starting on a 4 KiB page
    /// ([`ALIGN`]), asks for transparent huge pages over it ([`advise_huge_pages`]), and
    /// writes it so it is faulted in: a pool that cannot really be backed fails at start.
    pub fn allocate(geometry: &PoolGeometry) -> Result<Self, PoolError> {
        Self::allocate_at_offset(geometry, 0)
    }

    /// [`KvMemory::allocate`], with every buffer starting `offset` bytes past a 4 KiB
    /// boundary instead of on one (`offset < ALIGN`): memory placed as an engine's allocator
    /// may place it (glibc's `malloc` puts large blocks 16 bytes into a page, PyTorch's CPU
    /// allocator 64), to measure what that costs (`kvwire bench --buffer-offset`). Over TCP
    /// the kernel's copies in and out of socket buffers slow down sharply on some CPUs for
    /// some pairings of offsets (docs/BENCHMARKS.md, "Which offsets are slow").
    pub fn allocate_at_offset(geometry: &PoolGeometry, offset: usize) -> Result<Self, PoolError> {
        geometry.validate()?;
        if offset >= ALIGN {
            return Err(PoolError::BadGeometry(format!(
                "buffer offset {offset} is not below {ALIGN}"
            )));
        }
        let mut regions = Vec::with_capacity(geometry.buffers());
        for buffer in 0..geometry.buffers() {
            let len = check_len(geometry, buffer, geometry.buffer_len(buffer).unwrap_or(0))?;
            let oom = PoolError::OutOfMemory {
                buffer,
                bytes: len as u64,
            };
            let total = len.checked_add(offset).ok_or_else(|| oom.clone())?;
            let layout = Layout::from_size_align(total, ALIGN).map_err(|_| oom.clone())?;
            // Not `alloc_zeroed`: above malloc's own alignment it zeroes (touches) every page
            // at once, before huge pages could be asked for.
            // SAFETY: `layout` has a non-zero size (a validated geometry has no empty buffer).
            let raw = unsafe { alloc(layout) };
            let base = NonNull::new(raw).ok_or(oom)?;
            // SAFETY: `offset < total`, so the result is inside the allocation (and not null).
            let ptr = unsafe { base.add(offset) };
            advise_huge_pages_raw(ptr, len);
            // Write every byte now (zeroes) so the memory is really backed at start (a pool
            // that cannot be fails here, not in the middle of a transfer), in huge pages where
            // the kernel gave them, and no page fault lands on the data path.
            // SAFETY: `ptr` is valid for writes of `len` bytes (just allocated with that size).
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
            regions.push(Region {
                ptr,
                len,
                owner: Owner::Allocated(layout, offset),
                device: None,
            });
        }
        Ok(Self::shape(geometry, regions))
    }

    /// Registers buffers the caller owns and hands over (one per buffer, each exactly the
    /// geometry's size). They are freed when the memory is dropped.
    pub fn from_buffers(
        geometry: &PoolGeometry,
        buffers: Vec<Box<[u8]>>,
    ) -> Result<Self, PoolError> {
        geometry.validate()?;
        if buffers.len() != geometry.buffers() {
            return Err(PoolError::BadGeometry(format!(
                "{} buffers given, the geometry has {}",
                buffers.len(),
                geometry.buffers()
            )));
        }
        for (b, buf) in buffers.iter().enumerate() {
            check_len(geometry, b, buf.len())?;
        }
        let regions = buffers
            .into_iter()
            .map(|buf| {
                let len = buf.len();
                let raw = Box::into_raw(buf).cast::<u8>();
                Region {
                    // Box pointers are never null.
                    ptr: NonNull::new(raw).unwrap_or(NonNull::dangling()),
                    len,
                    owner: Owner::Boxed,
                    device: None,
                }
            })
            .collect();
        Ok(Self::shape(geometry, regions))
    }

    /// Registers memory the engine already owns (its KV cache): one `(pointer, length)` per
    /// buffer. It is never freed here. Hand it to [`Node::with_memory`](crate::Node::with_memory)
    /// to share it with every connection.
    ///
    /// # Safety
    ///
    /// Each pointer must be valid for reads and writes of its length for as long as the
    /// returned `KvMemory` lives (and everything built over it: the node, its connections,
    /// [`SharedPages`](super::SharedPages) views), and the regions must not overlap. The
    /// engine keeps using the memory under this contract:
    ///
    /// * kvwire writes only pages leased to an open reservation and reads only pages leased
    ///   to a transfer ([`PagePool::holders`](super::PagePool::holders) names them);
    /// * the engine may read any page at any time (a page leased to an open reservation
    ///   reads as unspecified bytes until its transfer is verified);
    /// * the engine must not write, or reuse, a page while kvwire holds it
    ///   ([`PagePool::check_engine_free`](super::PagePool::check_engine_free) refuses it).
    pub unsafe fn from_raw_parts(
        geometry: &PoolGeometry,
        buffers: Vec<(NonNull<u8>, usize)>,
    ) -> Result<Self, PoolError> {
        geometry.validate()?;
        if buffers.len() != geometry.buffers() {
            return Err(PoolError::BadGeometry(format!(
                "{} buffers given, the geometry has {}",
                buffers.len(),
                geometry.buffers()
            )));
        }
        let mut regions = Vec::with_capacity(buffers.len());
        for (b, (ptr, len)) in buffers.into_iter().enumerate() {
            check_len(geometry, b, len)?;
            regions.push(Region {
                ptr,
                len,
                owner: Owner::Foreign,
                device: None,
            });
        }
        Ok(Self::shape(geometry, regions))
    }

    /// Registers memory the engine already owns, host or device, one [`KvBuffer`] per
    /// buffer (each exactly the geometry's size); never freed here. Device buffers are
    /// memory of the device `device` drives (required when there is one): kvwire never
    /// dereferences them on the host, it reaches their bytes only through `device` (copies
    /// into and out of pinned staging, digests in device memory, fills).
    ///
    /// # Safety
    ///
    /// As for [`KvMemory::from_raw_parts`], for every buffer: host buffers valid for reads
    /// and writes of their length, device buffers allocated memory of `device`'s device of
    /// their length, for as long as the returned memory (and everything built over it)
    /// lives; no two overlap; and the engine follows the same contract (it writes no page
    /// kvwire holds, by any means: kernels included).
    pub unsafe fn from_buffers_in(
        geometry: &PoolGeometry,
        buffers: Vec<KvBuffer>,
        device: Option<Arc<dyn DeviceMemoryOps>>,
    ) -> Result<Self, PoolError> {
        geometry.validate()?;
        if buffers.len() != geometry.buffers() {
            return Err(PoolError::BadGeometry(format!(
                "{} buffers given, the geometry has {}",
                buffers.len(),
                geometry.buffers()
            )));
        }
        let mut regions = Vec::with_capacity(buffers.len());
        for (b, buffer) in buffers.into_iter().enumerate() {
            check_len(geometry, b, buffer.len())?;
            regions.push(match buffer {
                KvBuffer::Host { ptr, len } => Region {
                    ptr,
                    len,
                    owner: Owner::Foreign,
                    device: None,
                },
                KvBuffer::Device { ptr, len } => {
                    if device.is_none() {
                        return Err(PoolError::NoDeviceOps { buffer: b });
                    }
                    Region {
                        ptr: NonNull::dangling(),
                        len,
                        owner: Owner::Foreign,
                        device: Some(ptr),
                    }
                }
            });
        }
        let mut memory = Self::shape(geometry, regions);
        if memory.regions.iter().any(|r| r.device.is_some()) {
            memory.device = device;
        }
        Ok(memory)
    }

    /// Where buffer `buffer`'s bytes live.
    pub fn kind(&self, buffer: usize) -> Option<MemoryKind> {
        let r = self.regions.get(buffer)?;
        Some(match (r.device, &self.device) {
            (Some(_), Some(ops)) => MemoryKind::Device {
                ordinal: ops.ordinal(),
            },
            _ => MemoryKind::Host,
        })
    }

    /// Every buffer's kind, in order.
    pub fn kinds(&self) -> impl Iterator<Item = MemoryKind> + '_ {
        (0..self.regions.len()).map(|b| self.kind(b).unwrap_or_default())
    }

    /// Whether any buffer is device memory.
    pub fn has_device_memory(&self) -> bool {
        self.device.is_some()
    }

    /// The operations of the device holding the device buffers, if there are any.
    pub fn device_ops(&self) -> Option<&Arc<dyn DeviceMemoryOps>> {
        self.device.as_ref()
    }

    /// The device address of slot `page` of device buffer `buffer` (`None` for host memory
    /// or out of range).
    pub fn device_page(&self, page: u32, buffer: usize) -> Option<DevicePtr> {
        let r = self.regions.get(buffer)?;
        let base = r.device?;
        let range = self.range(page, buffer);
        (range.end <= r.len).then(|| base.offset(range.start))
    }

    /// Device buffer `buffer` as a digest target (`None` for host memory).
    pub fn device_slots(&self, buffer: usize) -> Option<DeviceSlots> {
        Some(DeviceSlots {
            ptr: self.regions.get(buffer)?.device?,
            page_bytes: self.page_bytes[buffer] as u32,
        })
    }

    /// Fills slot `page` of device buffer `buffer` with `byte` through the device.
    ///
    /// # Safety
    ///
    /// In range, and nothing else reads or writes the slot until this returns.
    pub(crate) unsafe fn fill_device_page(
        &self,
        page: u32,
        buffer: usize,
        byte: u8,
    ) -> Result<(), DeviceError> {
        let (Some(ptr), Some(ops)) = (self.device_page(page, buffer), &self.device) else {
            return Err(DeviceError::BadAddress { addr: 0, len: 0 });
        };
        // SAFETY: a slot of a registered device buffer (the registration's contract), not
        // accessed by anyone else meanwhile (caller).
        unsafe { ops.fill(ptr, self.page_bytes[buffer], byte) }
    }

    /// Whether buffer `buffer` is host memory kvwire may reach directly.
    pub(crate) fn is_host(&self, buffer: usize) -> bool {
        self.regions.get(buffer).is_some_and(|r| r.device.is_none())
    }

    /// Buffers.
    pub fn buffers(&self) -> usize {
        self.regions.len()
    }

    /// The start of host buffer `buffer` and its length, e.g. to register it with a NIC
    /// (`None` for a device buffer: see [`KvMemory::device_page`]).
    pub fn region(&self, buffer: usize) -> Option<(NonNull<u8>, usize)> {
        self.regions
            .get(buffer)
            .filter(|r| r.device.is_none())
            .map(|r| (r.ptr, r.len))
    }

    /// The length of buffer `buffer`, host or device.
    pub fn buffer_len(&self, buffer: usize) -> Option<usize> {
        self.regions.get(buffer).map(|r| r.len)
    }

    /// The byte range of page `page` within `buffer`.
    pub(crate) fn range(&self, page: u32, buffer: usize) -> Range<usize> {
        // (Host or device: an offset into the buffer, never a dereference.)
        let n = self.page_bytes[buffer];
        let start = page as usize * n;
        start..start + n
    }

    /// Bytes of `buffer` in `range`.
    ///
    /// # Safety
    ///
    /// `buffer` must be a host buffer ([`MemoryKind::Host`]), `buffer` and `range` in
    /// bounds, and no `&mut` to any of these bytes may be live for the returned lifetime.
    pub(crate) unsafe fn bytes(&self, buffer: usize, range: Range<usize>) -> &[u8] {
        let r = &self.regions[buffer];
        assert!(r.device.is_none(), "host access to device buffer {buffer}");
        debug_assert!(range.end <= r.len && range.start <= range.end);
        // SAFETY: in bounds of a live region (caller), and no aliasing `&mut` (caller).
        unsafe {
            std::slice::from_raw_parts(r.ptr.as_ptr().add(range.start), range.end - range.start)
        }
    }

    /// Bytes of `buffer` in `range`, writable.
    ///
    /// # Safety
    ///
    /// `buffer` must be a host buffer ([`MemoryKind::Host`]), `buffer` and `range` in
    /// bounds, and no other reference to any of these bytes may be live for the returned
    /// lifetime.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self, buffer: usize, range: Range<usize>) -> &mut [u8] {
        let r = &self.regions[buffer];
        assert!(r.device.is_none(), "host access to device buffer {buffer}");
        debug_assert!(range.end <= r.len && range.start <= range.end);
        // SAFETY: in bounds of a live region (caller), and exclusive for the lifetime (caller).
        unsafe {
            std::slice::from_raw_parts_mut(r.ptr.as_ptr().add(range.start), range.end - range.start)
        }
    }
}

impl Drop for KvMemory {
    fn drop(&mut self) {
        for r in &self.regions {
            match r.owner {
                // SAFETY: the region starts `offset` bytes into an allocation made by `alloc`
                // with exactly this layout, freed once.
                Owner::Allocated(layout, offset) => unsafe {
                    dealloc(r.ptr.as_ptr().sub(offset), layout)
                },
                Owner::Boxed => {
                    let slice = std::ptr::slice_from_raw_parts_mut(r.ptr.as_ptr(), r.len);
                    // SAFETY: made by `Box::into_raw` of a `Box<[u8]>` of this length, freed once.
                    drop(unsafe { Box::from_raw(slice) });
                }
                Owner::Foreign => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> PoolGeometry {
        PoolGeometry {
            tokens_per_page: 16,
            buffer_page_bytes: vec![4096, 512],
            pages: 8,
        }
    }

    /// Every buffer starts on a 4 KiB page: at a cache line's offset within one, the kernel's
    /// copies of 1 MiB pages into TCP socket buffers ran at about 0.65x (`ALIGN`'s doc).
    #[test]
    fn allocated_memory_is_page_aligned_and_zeroed() {
        let m = KvMemory::allocate(&geometry()).unwrap();
        for b in 0..2 {
            let (ptr, len) = m.region(b).unwrap();
            assert_eq!(
                ptr.as_ptr() as usize % 4096,
                0,
                "buffer {b} within its 4 KiB page"
            );
            // SAFETY: in bounds, nothing else references this fresh memory.
            assert!(unsafe { m.bytes(b, 0..len) }.iter().all(|&x| x == 0));
        }
    }

    /// Memory placed at an offset within a 4 KiB page (to measure what an engine's allocator
    /// costs): every buffer starts exactly there, zeroed and writable to its last byte, and
    /// an offset of a whole page or more is refused.
    #[test]
    fn memory_allocated_at_an_offset_starts_there() {
        for offset in [0, 16, 64, 4095] {
            let m = KvMemory::allocate_at_offset(&geometry(), offset).unwrap();
            for b in 0..2 {
                let (ptr, len) = m.region(b).unwrap();
                assert_eq!(ptr.as_ptr() as usize % 4096, offset, "buffer {b}");
                // SAFETY: in bounds, nothing else references this fresh memory.
                let bytes = unsafe { m.bytes_mut(b, 0..len) };
                assert!(bytes.iter().all(|&x| x == 0));
                bytes[len - 1] = 0xff;
            }
        }
        assert!(matches!(
            KvMemory::allocate_at_offset(&geometry(), 4096),
            Err(PoolError::BadGeometry(_))
        ));
    }

    /// The `VmFlags` of the mapping of this process that holds `addr` (Linux `smaps`).
    #[cfg(target_os = "linux")]
    fn vm_flags_at(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) =
                        (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                    {
                        inside = (lo..hi).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.to_owned());
                }
            }
        }
        None
    }

    /// Memory kvwire allocates is advised for transparent huge pages (madvise `hg` in the
    /// mapping's flags) over its whole 2 MiB pages, and is zeroed after the advice; small
    /// buffers are not advised.
    #[cfg(target_os = "linux")]
    #[test]
    fn allocated_memory_asks_for_huge_pages() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            assert!(
                !std::env::var("KVWIRE_REQUIRE_THP").is_ok_and(|v| v == "1"),
                "KVWIRE_REQUIRE_THP=1 but this kernel has no transparent huge pages"
            );
            eprintln!("skipped: this kernel has no transparent huge pages (KVWIRE_REQUIRE_THP=1 fails instead)");
            return;
        }
        let g = PoolGeometry {
            tokens_per_page: 16,
            buffer_page_bytes: vec![1 << 20, 4096],
            pages: 8,
        };
        let m = KvMemory::allocate(&g).unwrap();
        let (ptr, len) = m.region(0).unwrap();
        let middle = ptr.as_ptr() as usize + len / 2;
        let flags = vm_flags_at(middle).expect("the buffer's mapping is in smaps");
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "an 8 MiB buffer not advised for huge pages: VmFlags{flags}"
        );
        // SAFETY: in bounds, nothing else references this fresh memory.
        assert!(unsafe { m.bytes(0, 0..len) }.iter().all(|&x| x == 0));
        let mut small = vec![1u8; 1 << 20];
        assert!(
            !advise_huge_pages(&mut small),
            "1 MiB holds no whole 2 MiB page"
        );
        assert!(small.iter().all(|&x| x == 1), "the advice changed no byte");
    }

    #[test]
    fn registered_buffers_must_match_the_geometry() {
        let g = geometry();
        assert!(KvMemory::from_buffers(
            &g,
            vec![vec![0; 4096 * 8].into(), vec![0; 512 * 8].into()]
        )
        .is_ok());
        let err = KvMemory::from_buffers(&g, vec![vec![0; 4096 * 8].into(), vec![0; 100].into()])
            .unwrap_err();
        assert!(err.to_string().contains("buffer 1 has 100 bytes"), "{err}");
        assert!(KvMemory::from_buffers(&g, vec![vec![0; 4096 * 8].into()]).is_err());
    }

    #[test]
    fn caller_memory_is_used_in_place_and_not_freed() {
        let g = geometry();
        let mut a = vec![7u8; 4096 * 8];
        let mut b = vec![9u8; 512 * 8];
        let parts = vec![
            (NonNull::new(a.as_mut_ptr()).unwrap(), a.len()),
            (NonNull::new(b.as_mut_ptr()).unwrap(), b.len()),
        ];
        {
            // SAFETY: both vectors outlive `m` and are not touched while it lives.
            let m = unsafe { KvMemory::from_raw_parts(&g, parts) }.unwrap();
            let range = m.range(3, 1);
            // SAFETY: in bounds; no other reference to these bytes is live.
            let page = unsafe { m.bytes_mut(1, range) };
            assert!(page.iter().all(|&x| x == 9));
            page.fill(1);
        }
        assert!(b[3 * 512..4 * 512].iter().all(|&x| x == 1));
        assert!(a.iter().all(|&x| x == 7));
    }
}
