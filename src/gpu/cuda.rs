//! The device side (feature `cuda`): cudarc over the CUDA driver API and NVRTC, both loaded
//! at run time.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use super::{
    DeviceBuffer, GpuError, BUFFER_KERNEL, CRC_TABLE_KERNEL, CRC_TABLE_WORDS, KERNEL_SOURCE,
    PAGE_KERNEL, THREADS_PER_BLOCK,
};
use crate::checksum::{
    Digest128, DigestAlgorithm, DigestBinding, TransferDigests, UnsupportedAlgorithm,
};

/// The largest grid the page kernel is launched with (`gridDim.x` limit, 2^31 − 1 blocks).
const MAX_BLOCKS: u64 = (1 << 31) - 1;

/// Computes transfer digests on one GPU, over pages in that GPU's memory.
///
/// [`new`](Self::new) loads the driver and NVRTC, retains the device's **primary context**
/// (the one the CUDA runtime, and so PyTorch and most inference engines, use: their device
/// pointers are valid here), compiles the kernels for the device's architecture once and
/// creates the digester's own stream. [`digest`](Self::digest) then costs two kernel
/// launches, a few small copies and one synchronisation.
///
/// ```no_run
/// use kvwire::checksum::{DigestAlgorithm, DigestBinding};
/// use kvwire::gpu::{DeviceBuffer, GpuDigester, GpuError};
///
/// # fn k_ptr() -> u64 { 0 } fn v_ptr() -> u64 { 0 }
/// let gpu = match GpuDigester::new(0) {
///     Ok(gpu) => gpu,
///     Err(GpuError::NoDriver(why)) => {
///         println!("no CUDA driver ({why}): digest on the CPU");
///         return Ok(());
///     }
///     Err(e) => panic!("{e}"),
/// };
/// // Two buffers (K and V) of 32 KiB pages; the transfer landed in page slots 7, 3 and 12.
/// let buffers = [
///     DeviceBuffer { ptr: k_ptr(), page_bytes: 32 << 10 },
///     DeviceBuffer { ptr: v_ptr(), page_bytes: 32 << 10 },
/// ];
/// let binding = DigestBinding { transfer_id: 42, nonce: 7 };
/// let digests = gpu.digest(DigestAlgorithm::XXH3_64, binding, &buffers, &[7, 3, 12], true)?;
/// assert_eq!(digests.buffers.len(), 2);
/// assert_eq!(digests.pages.len(), 6);
/// # Ok::<(), GpuError>(())
/// ```
pub struct GpuDigester {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    page_fn: CudaFunction,
    buffer_fn: CudaFunction,
    crc_tables: CudaSlice<u32>,
    arch: Option<String>,
}

impl core::fmt::Debug for GpuDigester {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("GpuDigester")
            .field("ordinal", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .finish_non_exhaustive()
    }
}

fn launch_error(stage: &'static str) -> impl Fn(DriverError) -> GpuError {
    move |e| GpuError::Launch {
        stage,
        detail: e.to_string(),
    }
}

fn compile_error(e: CompileError) -> GpuError {
    match e {
        CompileError::CompileError { nvrtc, log, .. } => GpuError::Compile {
            detail: nvrtc.to_string(),
            log: log.to_string_lossy().into_owned(),
        },
        other => GpuError::Compile {
            detail: other.to_string(),
            log: String::new(),
        },
    }
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a CUDA library call panicked".to_owned())
}

fn block(threads: u32, blocks: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl GpuDigester {
    /// Loads the CUDA driver and NVRTC, opens device `device_ordinal` (its primary context)
    /// and compiles the digest kernels for it.
    ///
    /// # Errors
    ///
    /// * [`GpuError::NoDriver`]: `libcuda.so.1` is not there (or is unusable: a missing
    ///   symbol, which cudarc reports by panicking, is caught and reported here).
    /// * [`GpuError::NoNvrtc`]: no NVRTC library (`libnvrtc.so`, `libnvrtc.so.12`, ...).
    /// * [`GpuError::NoDevice`]: the driver has no device `device_ordinal` or cannot
    ///   initialise it.
    /// * [`GpuError::Compile`]: NVRTC rejected the source (with its log), or the driver
    ///   rejected the PTX (for example PTX newer than the driver).
    /// * [`GpuError::Launch`]: filling the CRC tables failed.
    pub fn new(device_ordinal: usize) -> Result<Self, GpuError> {
        catch_unwind(AssertUnwindSafe(|| Self::open(device_ordinal)))
            .unwrap_or_else(|panic| Err(GpuError::NoDriver(panic_text(panic.as_ref()))))
    }

    fn open(ordinal: usize) -> Result<Self, GpuError> {
        // SAFETY: `is_culib_present` tries to dlopen the driver library under its usual
        // names and drops it again; loading it runs its initialisers, as any use of CUDA does.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDriver(
                "libcuda.so.1, the NVIDIA driver library, was not found".into(),
            ));
        }
        // SAFETY: as above, for the NVRTC library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(GpuError::NoNvrtc(
                "no libnvrtc.so / libnvrtc.so.12 on the library path".into(),
            ));
        }
        // A library under the right name without the entry points (a stub, a broken
        // install) would make cudarc panic on first use: check the first ones it needs.
        // SAFETY: both libraries are present (checked above), so `culib` opens them (once,
        // cached) instead of panicking.
        let (driver, nvrtc) =
            unsafe { (cudarc::driver::sys::culib(), cudarc::nvrtc::sys::culib()) };
        for name in [
            "cuInit",
            "cuGetErrorString",
            "cuDeviceGet",
            "cuDevicePrimaryCtxRetain",
        ] {
            // SAFETY: a symbol lookup only; the returned pointer is never called here.
            if unsafe { driver.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
                return Err(GpuError::NoDriver(format!(
                    "the libcuda.so found has no {name}: not a usable CUDA driver"
                )));
            }
        }
        for name in ["nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetPTX"] {
            // SAFETY: as above.
            if unsafe { nvrtc.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
                return Err(GpuError::NoNvrtc(format!(
                    "the libnvrtc found has no {name}: not a usable NVRTC"
                )));
            }
        }
        let no_device = |e: DriverError| GpuError::NoDevice {
            ordinal,
            detail: e.to_string(),
        };
        let ctx = CudaContext::new(ordinal).map_err(no_device)?;
        let (major, minor) = ctx.compute_capability().map_err(no_device)?;
        let stream = ctx.new_stream().map_err(no_device)?;

        let arch = format!("--gpu-architecture=compute_{major}{minor}");
        let compile = |options: Vec<String>| {
            cudarc::nvrtc::compile_ptx_with_opts(
                KERNEL_SOURCE,
                CompileOptions {
                    options,
                    name: Some("kvwd_kernel.cu".into()),
                    ..Default::default()
                },
            )
        };
        // An NVRTC older than the device does not know its architecture: fall back to
        // NVRTC's default virtual architecture (the driver JIT-compiles the PTX).
        let (ptx, arch): (Ptx, Option<String>) = match compile(vec![arch.clone()]) {
            Ok(ptx) => (ptx, Some(arch)),
            Err(CompileError::CompileError { nvrtc, .. })
                if nvrtc.0 == cudarc::nvrtc::sys::nvrtcResult::NVRTC_ERROR_INVALID_OPTION =>
            {
                (compile(Vec::new()).map_err(compile_error)?, None)
            }
            Err(e) => return Err(compile_error(e)),
        };
        let module = ctx.load_module(ptx).map_err(|e| GpuError::Compile {
            detail: format!("the driver rejected the compiled module: {e}"),
            log: String::new(),
        })?;
        let function = |name: &str| {
            module.load_function(name).map_err(|e| GpuError::Compile {
                detail: format!("kernel {name}: {e}"),
                log: String::new(),
            })
        };
        let page_fn = function(PAGE_KERNEL)?;
        let buffer_fn = function(BUFFER_KERNEL)?;
        let crc_fn = function(CRC_TABLE_KERNEL)?;

        let mut crc_tables = stream
            .alloc_zeros::<u32>(CRC_TABLE_WORDS)
            .map_err(launch_error("allocating the CRC tables"))?;
        let mut args = stream.launch_builder(&crc_fn);
        args.arg(&mut crc_tables);
        let blocks = (CRC_TABLE_WORDS as u32).div_ceil(THREADS_PER_BLOCK);
        // SAFETY: `kvwd_crc_tables(kv_u32* tab)` takes exactly this one argument, a device
        // array of CRC_TABLE_WORDS u32s; its grid of CRC_TABLE_WORDS / THREADS_PER_BLOCK
        // blocks writes each word once (thread e writes tab[e], guarded by e < the size).
        unsafe { args.launch(block(THREADS_PER_BLOCK, blocks)) }
            .map_err(launch_error("filling the CRC tables"))?;
        stream
            .synchronize()
            .map_err(launch_error("filling the CRC tables"))?;
        Ok(Self {
            ctx,
            stream,
            page_fn,
            buffer_fn,
            crc_tables,
            arch,
        })
    }

    /// The context the digester runs in: the device's primary context. Device pointers
    /// passed to [`digest`](Self::digest) must be valid in it.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The digester's stream. [`digest`](Self::digest) runs after the work already queued
    /// on it; writes made on other streams must be complete (or this stream made to wait
    /// for them) before calling it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The digests of a transfer whose pages are in device memory: the same
    /// [`TransferDigests`] that
    /// [`digest_transfer`](crate::checksum::digest_transfer) computes over the same bytes.
    ///
    /// Page ordinal `i` of buffer `b` is page slot `pages[i]` of `buffers[b]`, i.e. the
    /// `buffers[b].page_bytes` bytes at device address `buffers[b].ptr + pages[i] *
    /// buffers[b].page_bytes`. With `per_page`, the result also holds every page digest,
    /// buffer-major; otherwise its `pages` is empty (the page digests are still computed on
    /// the device, for the buffer digests, but not copied back). The call returns when the
    /// digests are on the host.
    ///
    /// The pages are read on the digester's [`stream`](Self::stream): writes into them
    /// (RDMA, other streams) must be complete before the call. The kernels only read the
    /// pages. An address outside device memory of this context makes the kernel fault
    /// ([`GpuError::Launch`]); CUDA treats such faults as fatal to the context, so pass
    /// only pointers to memory the caller owns.
    ///
    /// # Errors
    ///
    /// [`GpuError::Unsupported`] for an algorithm other than XXH3_64 and CRC32,
    /// [`GpuError::TooLarge`] if `buffers.len() * pages.len()` exceeds 2^31 − 1 (one block
    /// per page), [`GpuError::Launch`] if a driver call or the kernels fail.
    pub fn digest(
        &self,
        alg: DigestAlgorithm,
        binding: DigestBinding,
        buffers: &[DeviceBuffer],
        pages: &[u32],
        per_page: bool,
    ) -> Result<TransferDigests, GpuError> {
        if alg != DigestAlgorithm::XXH3_64 && alg != DigestAlgorithm::CRC32 {
            return Err(UnsupportedAlgorithm(alg).into());
        }
        let too_large = || {
            GpuError::TooLarge(format!(
                "{} buffers x {} pages (at most {MAX_BLOCKS} pages in all)",
                buffers.len(),
                pages.len()
            ))
        };
        let nbufs = u32::try_from(buffers.len()).map_err(|_| too_large())?;
        let npages = u32::try_from(pages.len()).map_err(|_| too_large())?;
        let blocks = u64::from(nbufs) * u64::from(npages);
        if blocks > MAX_BLOCKS {
            return Err(too_large());
        }
        if nbufs == 0 {
            return Ok(TransferDigests::default());
        }
        let alg_code = u32::from(alg.0);
        self.ctx
            .bind_to_thread()
            .map_err(launch_error("binding the context"))?;

        let table: Vec<u64> = buffers
            .iter()
            .flat_map(|b| [b.ptr, u64::from(b.page_bytes)])
            .collect();
        let upload = launch_error("uploading the transfer's layout");
        let d_table = self.stream.clone_htod(&table).map_err(&upload)?;
        // The page list and the page digests are never empty on the device (a zero-length
        // allocation is not portable); the kernels read only the first `npages` entries.
        let d_pages = if pages.is_empty() {
            self.stream.clone_htod(&[0u32][..])
        } else {
            self.stream.clone_htod(pages)
        }
        .map_err(&upload)?;
        let mut d_page_digests = self
            .stream
            .alloc_zeros::<u64>((blocks as usize).max(1))
            .map_err(launch_error("allocating the digests"))?;
        let mut d_buffer_digests = self
            .stream
            .alloc_zeros::<u64>(2 * nbufs as usize)
            .map_err(launch_error("allocating the digests"))?;

        if npages > 0 {
            let mut args = self.stream.launch_builder(&self.page_fn);
            args.arg(&d_table)
                .arg(&npages)
                .arg(&alg_code)
                .arg(&d_pages)
                .arg(&self.crc_tables)
                .arg(&mut d_page_digests);
            // SAFETY: the arguments match `kvwd_page_digests(const KvwdBuffer* bufs (2 u64
            // per buffer), kv_u32 npages, kv_u32 alg, const kv_u32* pages, const kv_u32*
            // crc_tab, kv_u64* out)` in order and type; `d_table` holds nbufs entries,
            // `d_pages` npages indices, `crc_tables` CRC_TABLE_WORDS words filled in `new`,
            // and `d_page_digests` nbufs * npages words, one per block of the grid of exactly
            // nbufs * npages blocks (each block writes only its own word). The page memory
            // is the caller's device memory, only read; a bad address faults on the device
            // and is reported by the driver, it cannot touch host memory.
            unsafe { args.launch(block(THREADS_PER_BLOCK, blocks as u32)) }
                .map_err(launch_error("launching the page kernel"))?;
        }
        let mut args = self.stream.launch_builder(&self.buffer_fn);
        args.arg(&d_page_digests)
            .arg(&npages)
            .arg(&alg_code)
            .arg(&binding.transfer_id.0)
            .arg(&binding.nonce)
            .arg(&mut d_buffer_digests);
        // SAFETY: the arguments match `kvwd_buffer_digests(const kv_u64* page_digests,
        // kv_u32 npages, kv_u32 alg, kv_u64 transfer_id, kv_u64 nonce, kv_u64* out)` in
        // order and type; block b reads page digests b * npages .. (b + 1) * npages (within
        // the nbufs * npages written above) and writes out[2b], out[2b + 1], within the
        // 2 * nbufs words of `d_buffer_digests`; the grid has exactly nbufs blocks.
        unsafe { args.launch(block(THREADS_PER_BLOCK, nbufs)) }
            .map_err(launch_error("launching the buffer kernel"))?;

        let fetch = launch_error("running the kernels and copying the digests back");
        let words = self.stream.clone_dtoh(&d_buffer_digests).map_err(&fetch)?;
        let pages_out = if per_page {
            let mut v = self.stream.clone_dtoh(&d_page_digests).map_err(&fetch)?;
            v.truncate(blocks as usize);
            v
        } else {
            Vec::new()
        };
        let buffers_out = words
            .chunks_exact(2)
            .map(|w| Digest128::from_u128(u128::from(w[0]) | (u128::from(w[1]) << 64)))
            .collect();
        // The aux record is host memory and not part of this call: like
        // `digest_transfer`, the caller fills in `aux` (see `checksum::aux_digest`).
        Ok(TransferDigests {
            buffers: buffers_out,
            pages: pages_out,
            aux: Digest128::default(),
        })
    }
}
