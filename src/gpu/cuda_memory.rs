//! [`CudaMemoryOps`] (feature `cuda`): device memory as KV memory on a real GPU — copies on
//! CUDA streams (`cuMemcpyDtoHAsync` / `cuMemcpyHtoDAsync`), completion by events, pinned
//! staging from `cuMemHostAlloc`, digests in place by the [`GpuDigester`] kernels.
//!
//! Not run in CI (no GPU there): `tests/gpu_cuda.rs` runs it with `KVWIRE_REQUIRE_GPU=1` on a
//! GPU machine (docs/GPU.md, "What the GPU check runs").

use std::collections::VecDeque;
use std::sync::{mpsc, Arc};
use std::task::Waker;
use std::thread::JoinHandle;

use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream, DriverError};
use kvwire_proto::wire::{DigestAlgorithm, TransferDigests, TransferRef};

use super::{DeviceBuffer, GpuDigester, GpuError};
use crate::checksum::DigestBinding;
use crate::memory::{
    CopyQueue, CopyTicket, DeviceError, DeviceMemoryOps, DevicePtr, DeviceSlots, PinnedBuffer,
};

fn copy_error(e: DriverError) -> DeviceError {
    DeviceError::Copy(e.to_string())
}

/// A GPU's memory as KV memory: see the module documentation.
#[derive(Debug)]
pub struct CudaMemoryOps {
    digester: GpuDigester,
    ordinal: u32,
}

impl CudaMemoryOps {
    /// Opens device `ordinal` (its primary context, as [`GpuDigester::new`]) and compiles
    /// the digest kernels.
    ///
    /// # Errors
    ///
    /// As [`GpuDigester::new`]: no driver, no NVRTC, no device, a compile failure.
    pub fn new(ordinal: u32) -> Result<Self, GpuError> {
        Ok(Self {
            digester: GpuDigester::new(ordinal as usize)?,
            ordinal,
        })
    }

    /// The digester (the kernels), e.g. to digest other device memory.
    pub fn digester(&self) -> &GpuDigester {
        &self.digester
    }

    fn ctx(&self) -> &Arc<CudaContext> {
        self.digester.context()
    }
}

/// Pinned host memory from `cuMemHostAlloc`, freed with `cuMemFreeHost`.
#[derive(Debug)]
struct CudaPinned {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value alone; moving it to another
// thread moves that ownership (the context handle is `Send`).
unsafe impl Send for CudaPinned {}

impl PinnedBuffer for CudaPinned {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `cuMemHostAlloc` in `pinned`, freed once; its owner queues
            // no copy that outlives it (the staging pipeline synchronises first).
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// A waiter thread's job: wake `waker` once `event` completed.
type Wait = (Arc<CudaEvent>, Waker);

/// One CUDA stream as a [`CopyQueue`]; tickets are events recorded on it.
#[derive(Debug)]
struct CudaQueue {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Recorded and not yet seen complete, in order.
    events: VecDeque<(u64, Arc<CudaEvent>)>,
    next: u64,
    done: u64,
    waits: Option<mpsc::Sender<Wait>>,
    waiter: Option<JoinHandle<()>>,
}

impl CudaQueue {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self, DeviceError> {
        let stream = ctx.new_stream().map_err(copy_error)?;
        let (tx, rx) = mpsc::channel::<Wait>();
        let waiter = std::thread::Builder::new()
            .name("kvwire-cuda-copy-wait".into())
            .spawn(move || {
                while let Ok((event, waker)) = rx.recv() {
                    let _ = event.synchronize();
                    waker.wake();
                }
            })
            .ok();
        Ok(Self {
            ctx: ctx.clone(),
            stream,
            events: VecDeque::new(),
            next: 0,
            done: 0,
            waits: Some(tx),
            waiter,
        })
    }
}

impl Drop for CudaQueue {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        self.waits = None;
        if let Some(w) = self.waiter.take() {
            let _ = w.join();
        }
    }
}

impl CopyQueue for CudaQueue {
    unsafe fn copy_to_host(
        &mut self,
        src: DevicePtr,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(copy_error)?;
        // SAFETY: `dst` is valid for `len` bytes and untouched until the copy completed, and
        // `src` is device memory of this context (the caller's contract); the slice lives
        // only for the call, the copy runs on this queue's stream.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(dst, len);
            result::memcpy_dtoh_async(dst, src.0, self.stream.cu_stream())
        }
        .map_err(copy_error)
    }

    unsafe fn copy_to_device(
        &mut self,
        src: *const u8,
        dst: DevicePtr,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(copy_error)?;
        // SAFETY: as in `copy_to_host`, the other way round.
        unsafe {
            let src = std::slice::from_raw_parts(src, len);
            result::memcpy_htod_async(dst.0, src, self.stream.cu_stream())
        }
        .map_err(copy_error)
    }

    fn mark(&mut self) -> Result<CopyTicket, DeviceError> {
        let event = self.stream.record_event(None).map_err(copy_error)?;
        self.next += 1;
        self.events.push_back((self.next, Arc::new(event)));
        Ok(CopyTicket(self.next))
    }

    fn poll_done(
        &mut self,
        ticket: CopyTicket,
        waker: Option<&Waker>,
    ) -> Result<bool, DeviceError> {
        while let Some((t, e)) = self.events.front() {
            if !e.try_is_complete().map_err(copy_error)? {
                break;
            }
            self.done = *t;
            self.events.pop_front();
        }
        if self.done >= ticket.0 {
            return Ok(true);
        }
        if let (Some(w), Some(tx)) = (waker, &self.waits) {
            if let Some((_, e)) = self.events.iter().find(|(t, _)| *t >= ticket.0) {
                let _ = tx.send((e.clone(), w.clone()));
            }
        }
        Ok(false)
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        self.stream.synchronize().map_err(copy_error)?;
        self.done = self.next;
        self.events.clear();
        Ok(())
    }
}

impl DeviceMemoryOps for CudaMemoryOps {
    fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn pinned(&self, len: usize) -> Result<Box<dyn PinnedBuffer>, DeviceError> {
        let alloc = |e: DriverError| DeviceError::PinnedAlloc {
            bytes: len,
            detail: e.to_string(),
        };
        self.ctx().bind_to_thread().map_err(alloc)?;
        // SAFETY: a plain allocation call in the bound context; the pointer is owned by the
        // returned buffer, which frees it once.
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }.map_err(alloc)?;
        Ok(Box::new(CudaPinned {
            ctx: self.ctx().clone(),
            ptr: ptr.cast(),
            len,
        }))
    }

    fn queue(&self) -> Result<Box<dyn CopyQueue>, DeviceError> {
        Ok(Box::new(CudaQueue::new(self.ctx())?))
    }

    unsafe fn digest(
        &self,
        algorithm: DigestAlgorithm,
        transfer: TransferRef,
        buffers: &[DeviceSlots],
        pages: &[u32],
        per_page: bool,
    ) -> Result<TransferDigests, DeviceError> {
        let buffers: Vec<DeviceBuffer> = buffers
            .iter()
            .map(|b| DeviceBuffer {
                ptr: b.ptr.0,
                page_bytes: b.page_bytes,
            })
            .collect();
        let binding = DigestBinding {
            transfer_id: transfer.transfer_id,
            nonce: transfer.nonce,
        };
        self.digester
            .digest(algorithm, binding, &buffers, pages, per_page)
            .map_err(|e| DeviceError::Digest(e.to_string()))
    }

    unsafe fn fill(&self, dst: DevicePtr, len: usize, byte: u8) -> Result<(), DeviceError> {
        self.ctx().bind_to_thread().map_err(copy_error)?;
        // SAFETY: device memory of this context, not used by anyone else meanwhile (caller).
        unsafe { result::memset_d8_sync(dst.0, byte, len) }.map_err(copy_error)
    }

    unsafe fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.ctx().bind_to_thread().map_err(copy_error)?;
        // SAFETY: device memory of this context that nothing writes meanwhile (caller).
        unsafe { result::memcpy_dtoh_sync(dst, src.0) }.map_err(copy_error)
    }

    unsafe fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        self.ctx().bind_to_thread().map_err(copy_error)?;
        // SAFETY: device memory of this context that nothing else uses meanwhile (caller).
        unsafe { result::memcpy_htod_sync(dst.0, src) }.map_err(copy_error)
    }
}
