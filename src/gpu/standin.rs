//! A host stand-in for a GPU's memory and copy engines ([`HostStandIn`]): what CI tests
//! device-memory KV with, on machines without a GPU.
//!
//! * "Device memory" is host allocations owned by the stand-in, handed out at addresses the
//!   host **cannot dereference** (non-canonical on x86-64, far above any mapping elsewhere):
//!   a kvwire code path that touched a device page through a host reference would fault,
//!   not silently work.
//! * Each [`CopyQueue`] is a worker thread that runs its copies in order, so copies really
//!   are asynchronous: the caller learns of completion only through tickets (and wakers).
//! * A **gate** lets a test hold copies back and let them through one by one
//!   ([`HostStandIn::hold_copies`], [`HostStandIn::allow_copies`],
//!   [`HostStandIn::open_copies`]): the order of events in a staging pipeline is then
//!   observable without timing. A blocking [`CopyQueue::synchronize`] forces the held copies
//!   of its queue through (it never waits on the gate). Counters ([`HostStandIn::stats`]) say what was queued and
//!   completed.
//! * Digests are computed over the simulated device memory with the CPU reference
//!   (`checksum::digest_transfer`), and the stand-in counts a digest that ran while a copy
//!   into one of its pages was still in flight ([`StandInStats::digests_racing_copies`]):
//!   that must never happen.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::Waker;
use std::thread::JoinHandle;

use kvwire_proto::wire::{DigestAlgorithm, TransferDigests, TransferRef};

use crate::checksum::{digest_transfer, DigestBinding};
use crate::memory::{
    CopyQueue, CopyTicket, DeviceError, DeviceMemoryOps, DevicePtr, DeviceSlots, PinnedBuffer,
};

/// Where simulated device memory starts: a non-canonical x86-64 address (bit 62 set), so a
/// host dereference faults.
const DEVICE_BASE: u64 = 0x4B56_0000_0000_0000;
/// Alignment of simulated device allocations (like `cudaMalloc`'s 256 bytes).
const DEVICE_ALIGN: u64 = 256;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counters of a [`HostStandIn`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StandInStats {
    /// Device-to-host copies queued.
    pub to_host_queued: u64,
    /// Device-to-host copies completed.
    pub to_host_done: u64,
    /// Host-to-device copies queued.
    pub to_device_queued: u64,
    /// Host-to-device copies completed.
    pub to_device_done: u64,
    /// Most copies queued and not completed at once (over all queues).
    pub max_in_flight: u64,
    /// Digests computed in (simulated) device memory.
    pub digests: u64,
    /// Pages digested in (simulated) device memory.
    pub pages_digested: u64,
    /// Digests that ran while a host-to-device copy into one of their pages was still in
    /// flight. Must stay zero: verification digests only after the copies completed.
    pub digests_racing_copies: u64,
    /// Fills (scrub-on-release).
    pub fills: u64,
    /// Pinned staging buffers allocated.
    pub pinned_buffers: u64,
}

impl StandInStats {
    /// Copies queued and not completed.
    pub fn in_flight(&self) -> u64 {
        self.to_host_queued + self.to_device_queued - self.to_host_done - self.to_device_done
    }
}

#[derive(Debug)]
struct Alloc {
    base: u64,
    len: usize,
    /// The host bytes standing in for the device's (a leaked `Box<[u8]>`, freed on drop).
    host: usize,
}

#[derive(Debug, Default)]
struct Gate {
    /// `None`: copies run freely; `Some(n)`: `n` more copies may run.
    permits: Option<u64>,
}

#[derive(Debug)]
struct Shared {
    ordinal: u32,
    allocs: Mutex<Vec<Alloc>>,
    gate: Mutex<Gate>,
    gate_cv: Condvar,
    stats: Mutex<StandInStats>,
    /// Host-to-device copies queued and not completed: (device address, length).
    to_device_in_flight: Mutex<Vec<(u64, usize)>>,
}

impl Shared {
    /// The host address standing in for `len` bytes at device address `addr`.
    fn translate(&self, addr: u64, len: usize) -> Result<*mut u8, DeviceError> {
        let allocs = lock(&self.allocs);
        let a = allocs
            .iter()
            .find(|a| addr >= a.base && addr + len as u64 <= a.base + a.len as u64)
            .ok_or(DeviceError::BadAddress { addr, len })?;
        Ok((a.host + (addr - a.base) as usize) as *mut u8)
    }

    /// Waits for the gate to let one copy through (always, when `bypass` is set).
    fn pass_gate(&self, bypass: &AtomicBool) {
        let mut g = lock(&self.gate);
        loop {
            if bypass.load(Ordering::Acquire) {
                return;
            }
            match g.permits {
                None => return,
                Some(n) if n > 0 => {
                    g.permits = Some(n - 1);
                    return;
                }
                Some(_) => {}
            }
            g = self
                .gate_cv
                .wait_timeout(g, std::time::Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for a in lock(&self.allocs).drain(..) {
            let slice = std::ptr::slice_from_raw_parts_mut(a.host as *mut u8, a.len);
            // SAFETY: made by `Box::into_raw` of a `Box<[u8]>` of this length in `alloc`,
            // freed once; no queue outlives the `Shared` it holds an `Arc` of.
            drop(unsafe { Box::from_raw(slice) });
        }
    }
}

/// Simulated GPU memory and copy engines on the host: see the module documentation.
#[derive(Clone, Debug)]
pub struct HostStandIn {
    shared: Arc<Shared>,
}

impl HostStandIn {
    /// A stand-in for device `ordinal`.
    pub fn new(ordinal: u32) -> Self {
        Self {
            shared: Arc::new(Shared {
                ordinal,
                allocs: Mutex::default(),
                gate: Mutex::default(),
                gate_cv: Condvar::new(),
                stats: Mutex::default(),
                to_device_in_flight: Mutex::default(),
            }),
        }
    }

    /// Allocates `len` bytes of simulated device memory, every byte `fill`. The address is
    /// not a host address; the memory lives as long as the stand-in (any clone of it).
    pub fn alloc(&self, len: usize, fill: u8) -> DevicePtr {
        let host = Box::into_raw(vec![fill; len.max(1)].into_boxed_slice()).cast::<u8>() as usize;
        let mut allocs = lock(&self.shared.allocs);
        let base = allocs.last().map_or(DEVICE_BASE, |a| {
            (a.base + a.len as u64).div_ceil(DEVICE_ALIGN) * DEVICE_ALIGN + DEVICE_ALIGN
        });
        allocs.push(Alloc {
            base,
            len: len.max(1),
            host,
        });
        DevicePtr(base)
    }

    /// The stand-in as the [`DeviceMemoryOps`] of a registration.
    pub fn ops(&self) -> Arc<dyn DeviceMemoryOps> {
        Arc::new(self.clone())
    }

    /// Counters.
    pub fn stats(&self) -> StandInStats {
        *lock(&self.shared.stats)
    }

    /// Holds every copy not started yet until [`allow_copies`](Self::allow_copies) or
    /// [`open_copies`](Self::open_copies).
    pub fn hold_copies(&self) {
        lock(&self.shared.gate).permits = Some(0);
        self.shared.gate_cv.notify_all();
    }

    /// Lets `n` more copies through a held gate.
    pub fn allow_copies(&self, n: u64) {
        let mut g = lock(&self.shared.gate);
        g.permits = Some(g.permits.unwrap_or(0) + n);
        self.shared.gate_cv.notify_all();
    }

    /// Lets every copy through (the default).
    pub fn open_copies(&self) {
        lock(&self.shared.gate).permits = None;
        self.shared.gate_cv.notify_all();
    }

    /// Reads simulated device memory (for tests: what "landed").
    pub fn read_vec(&self, src: DevicePtr, len: usize) -> Result<Vec<u8>, DeviceError> {
        let mut out = vec![0; len];
        // SAFETY: `read` checks the range is simulated device memory of this stand-in.
        unsafe { self.read(src, &mut out) }?;
        Ok(out)
    }

    fn count(&self, f: impl FnOnce(&mut StandInStats)) {
        let mut s = lock(&self.shared.stats);
        f(&mut s);
        s.max_in_flight = s.max_in_flight.max(s.in_flight());
    }
}

/// Pinned host memory of the stand-in (ordinary host memory).
#[derive(Debug)]
struct StandInPinned(Box<[u8]>);

impl PinnedBuffer for StandInPinned {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
    fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

#[derive(Clone, Copy, Debug)]
enum Direction {
    ToHost,
    ToDevice,
}

#[derive(Debug)]
enum Command {
    Copy {
        direction: Direction,
        host: usize,
        device: u64,
        len: usize,
    },
    Mark(u64),
}

#[derive(Debug, Default)]
struct QueueState {
    done: u64,
    error: Option<DeviceError>,
    wakers: Vec<Waker>,
}

type Completion = Arc<(Mutex<QueueState>, Condvar)>;

/// One in-order copy queue of the stand-in: a worker thread.
#[derive(Debug)]
struct StandInQueue {
    standin: HostStandIn,
    tx: Option<mpsc::Sender<Command>>,
    completion: Completion,
    /// Set when the queue is dropped: the worker then runs what is left without the gate.
    bypass: Arc<AtomicBool>,
    next: u64,
    worker: Option<JoinHandle<()>>,
}

impl StandInQueue {
    fn new(standin: HostStandIn) -> Self {
        let (tx, rx) = mpsc::channel::<Command>();
        let completion: Completion = Arc::default();
        let bypass = Arc::new(AtomicBool::new(false));
        let worker = {
            let (standin, completion, bypass) =
                (standin.clone(), completion.clone(), bypass.clone());
            std::thread::Builder::new()
                .name("kvwire-standin-copy".into())
                .spawn(move || run_queue(&standin, &rx, &completion, &bypass))
                .ok()
        };
        Self {
            standin,
            tx: Some(tx),
            completion,
            bypass,
            next: 0,
            worker,
        }
    }

    fn send(&mut self, c: Command) -> Result<(), DeviceError> {
        self.tx
            .as_ref()
            .and_then(|tx| tx.send(c).ok())
            .ok_or_else(|| DeviceError::Copy("the stand-in copy worker is gone".into()))
    }

    fn queue_copy(
        &mut self,
        direction: Direction,
        host: usize,
        device: DevicePtr,
        len: usize,
    ) -> Result<(), DeviceError> {
        // Checked now, as a real driver checks the range at submission.
        self.standin.shared.translate(device.0, len)?;
        match direction {
            Direction::ToHost => self.standin.count(|s| s.to_host_queued += 1),
            Direction::ToDevice => {
                lock(&self.standin.shared.to_device_in_flight).push((device.0, len));
                self.standin.count(|s| s.to_device_queued += 1);
            }
        }
        self.send(Command::Copy {
            direction,
            host,
            device: device.0,
            len,
        })
    }
}

fn run_queue(
    standin: &HostStandIn,
    rx: &mpsc::Receiver<Command>,
    completion: &Completion,
    bypass: &AtomicBool,
) {
    while let Ok(cmd) = rx.recv() {
        match cmd {
            Command::Copy {
                direction,
                host,
                device,
                len,
            } => {
                standin.shared.pass_gate(bypass);
                let r = standin.shared.translate(device, len).map(|dev| {
                    let host = host as *mut u8;
                    // SAFETY: `dev` is `len` bytes of a live simulated allocation (checked);
                    // `host` is `len` bytes the submitter keeps valid and untouched until this
                    // copy's ticket completed (the `CopyQueue` contract). They do not overlap
                    // (simulated device memory is the stand-in's own allocation).
                    unsafe {
                        match direction {
                            Direction::ToHost => std::ptr::copy_nonoverlapping(dev, host, len),
                            Direction::ToDevice => std::ptr::copy_nonoverlapping(host, dev, len),
                        }
                    }
                });
                match direction {
                    Direction::ToHost => standin.count(|s| s.to_host_done += 1),
                    Direction::ToDevice => {
                        let mut f = lock(&standin.shared.to_device_in_flight);
                        if let Some(i) = f.iter().position(|&(a, l)| a == device && l == len) {
                            f.swap_remove(i);
                        }
                        drop(f);
                        standin.count(|s| s.to_device_done += 1);
                    }
                }
                if let Err(e) = r {
                    lock(&completion.0).error.get_or_insert(e);
                }
            }
            Command::Mark(t) => {
                let wakers = {
                    let mut st = lock(&completion.0);
                    st.done = st.done.max(t);
                    std::mem::take(&mut st.wakers)
                };
                completion.1.notify_all();
                for w in wakers {
                    w.wake();
                }
            }
        }
    }
}

impl Drop for StandInQueue {
    fn drop(&mut self) {
        // Copies already queued still run (their buffers are kept by their owners until
        // they completed), past any held gate.
        self.bypass.store(true, Ordering::Release);
        self.standin.shared.gate_cv.notify_all();
        self.tx = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl CopyQueue for StandInQueue {
    unsafe fn copy_to_host(
        &mut self,
        src: DevicePtr,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.queue_copy(Direction::ToHost, dst as usize, src, len)
    }

    unsafe fn copy_to_device(
        &mut self,
        src: *const u8,
        dst: DevicePtr,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.queue_copy(Direction::ToDevice, src as usize, dst, len)
    }

    fn mark(&mut self) -> Result<CopyTicket, DeviceError> {
        self.next += 1;
        let t = self.next;
        self.send(Command::Mark(t))?;
        Ok(CopyTicket(t))
    }

    fn poll_done(
        &mut self,
        ticket: CopyTicket,
        waker: Option<&Waker>,
    ) -> Result<bool, DeviceError> {
        let mut st = lock(&self.completion.0);
        if let Some(e) = &st.error {
            return Err(e.clone());
        }
        if st.done >= ticket.0 {
            return Ok(true);
        }
        if let Some(w) = waker {
            if !st.wakers.iter().any(|x| x.will_wake(w)) {
                st.wakers.push(w.clone());
            }
        }
        Ok(false)
    }

    /// Waits for every queued copy; a held gate does not hold them back (a blocking wait
    /// forces them through, so a pipeline that synchronises while a test holds copies shows
    /// as wrong results, not as a hang).
    fn synchronize(&mut self) -> Result<(), DeviceError> {
        let t = self.mark()?;
        self.bypass.store(true, Ordering::Release);
        self.standin.shared.gate_cv.notify_all();
        let mut st = lock(&self.completion.0);
        while st.done < t.0 {
            st = self
                .completion
                .1
                .wait(st)
                .unwrap_or_else(|p| p.into_inner());
        }
        self.bypass.store(false, Ordering::Release);
        st.error.clone().map_or(Ok(()), Err)
    }
}

impl DeviceMemoryOps for HostStandIn {
    fn ordinal(&self) -> u32 {
        self.shared.ordinal
    }

    fn pinned(&self, len: usize) -> Result<Box<dyn PinnedBuffer>, DeviceError> {
        self.count(|s| s.pinned_buffers += 1);
        Ok(Box::new(StandInPinned(vec![0; len].into_boxed_slice())))
    }

    fn queue(&self) -> Result<Box<dyn CopyQueue>, DeviceError> {
        Ok(Box::new(StandInQueue::new(self.clone())))
    }

    unsafe fn digest(
        &self,
        algorithm: DigestAlgorithm,
        transfer: TransferRef,
        buffers: &[DeviceSlots],
        pages: &[u32],
        per_page: bool,
    ) -> Result<TransferDigests, DeviceError> {
        let racing = {
            let f = lock(&self.shared.to_device_in_flight);
            pages.iter().any(|&p| {
                buffers.iter().any(|b| {
                    let start = b.ptr.0 + u64::from(p) * u64::from(b.page_bytes);
                    let end = start + u64::from(b.page_bytes);
                    f.iter().any(|&(a, l)| a < end && start < a + l as u64)
                })
            })
        };
        let mut slices: Vec<Vec<&[u8]>> = Vec::with_capacity(buffers.len());
        for b in buffers {
            let mut per = Vec::with_capacity(pages.len());
            for &p in pages {
                let n = b.page_bytes as usize;
                let addr = b.ptr.0 + u64::from(p) * u64::from(b.page_bytes);
                let host = self.shared.translate(addr, n)?;
                // SAFETY: `n` bytes of a live simulated allocation (checked); nothing writes
                // them until this returns (the caller's contract), and the stand-in owns them
                // for as long as `self` lives.
                per.push(unsafe { std::slice::from_raw_parts(host.cast_const(), n) });
            }
            slices.push(per);
        }
        let binding = DigestBinding {
            transfer_id: transfer.transfer_id,
            nonce: transfer.nonce,
        };
        let d = digest_transfer(
            algorithm,
            binding,
            buffers.len(),
            pages.len(),
            per_page,
            |b, i| slices[b][i],
        )
        .map_err(|e| DeviceError::Digest(e.to_string()))?;
        self.count(|s| {
            s.digests += 1;
            s.pages_digested += pages.len() as u64;
            s.digests_racing_copies += u64::from(racing);
        });
        Ok(d)
    }

    unsafe fn fill(&self, dst: DevicePtr, len: usize, byte: u8) -> Result<(), DeviceError> {
        let host = self.shared.translate(dst.0, len)?;
        // SAFETY: `len` bytes of a live simulated allocation (checked); nothing else touches
        // them until this returns (the caller's contract).
        unsafe { std::ptr::write_bytes(host, byte, len) };
        self.count(|s| s.fills += 1);
        Ok(())
    }

    unsafe fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        let host = self.shared.translate(src.0, dst.len())?;
        // SAFETY: `dst.len()` bytes of a live simulated allocation (checked), which nothing
        // writes until this returns (the caller's contract); `dst` is a distinct allocation.
        unsafe { std::ptr::copy_nonoverlapping(host.cast_const(), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        let host = self.shared.translate(dst.0, src.len())?;
        // SAFETY: as in `read`, the other way round.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), host, src.len()) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::ptr::NonNull;

    use super::HostStandIn;
    use crate::memory::{KvBuffer, KvMemory, MemoryKind, PagePool, PoolError, PoolGeometry};

    /// Device buffers are registered with kvwire's memory by kind, never reachable through
    /// host references, and need the device's operations (here the host stand-in's).
    #[test]
    fn device_buffers_are_registered_by_kind_and_refused_on_the_host() {
        let g = PoolGeometry {
            tokens_per_page: 16,
            buffer_page_bytes: vec![4096, 512],
            pages: 8,
        };
        let dev = HostStandIn::new(2);
        let mut host = vec![7u8; 4096 * 8];
        let device = dev.alloc(512 * 8, 9);
        let buffers = vec![
            KvBuffer::Host {
                ptr: NonNull::new(host.as_mut_ptr()).unwrap(),
                len: host.len(),
            },
            KvBuffer::Device {
                ptr: device,
                len: 512 * 8,
            },
        ];
        // SAFETY: `host` outlives the memory and is not touched meanwhile; `device` is the
        // stand-in's allocation of that length.
        let missing = unsafe { KvMemory::from_buffers_in(&g, buffers.clone(), None) };
        assert_eq!(missing.unwrap_err(), PoolError::NoDeviceOps { buffer: 1 });
        // SAFETY: as above.
        let m = unsafe { KvMemory::from_buffers_in(&g, buffers, Some(dev.ops())) }.unwrap();
        assert_eq!(m.kind(0), Some(MemoryKind::Host));
        assert_eq!(m.kind(1), Some(MemoryKind::Device { ordinal: 2 }));
        assert!(m.has_device_memory());
        assert_eq!(m.region(1), None, "no host region for a device buffer");
        assert_eq!(m.device_page(3, 1), Some(device.offset(3 * 512)));
        assert_eq!(m.device_page(3, 0), None);
        let pool = PagePool::with_memory(g, m, crate::memory::Scrub::Zero).unwrap();
        assert!(pool.raw_page(3, 1).is_none());
        assert_eq!(
            pool.engine_page(3, 1).unwrap_err(),
            PoolError::DeviceMemory { buffer: 1 }
        );
        assert!(pool.engine_page(3, 0).is_ok());
        let mut out = vec![0u8; 512];
        pool.engine_read(3, 1, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 9));
        pool.engine_write(3, 1, &[5u8; 512]).unwrap();
        assert_eq!(
            dev.read_vec(device.offset(3 * 512), 512).unwrap(),
            vec![5u8; 512]
        );
        // A leased page is not the engine's to write; released, it is scrubbed on the device.
        let lease = pool.lease_pages(&[3]).unwrap().pop().unwrap();
        assert!(pool.engine_write(3, 1, &[6u8; 512]).is_err());
        pool.write_page(&lease, 1, &[6u8; 512]).unwrap();
        pool.release(lease).unwrap();
        assert_eq!(
            dev.read_vec(device.offset(3 * 512), 512).unwrap(),
            vec![0u8; 512]
        );
        assert_eq!(dev.stats().fills, 1);
        drop(pool);
        assert!(host.iter().take(4096 * 3).all(|&x| x == 7));
    }
}
