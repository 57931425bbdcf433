//! Page and buffer digests computed on the GPU, where the KV pages live.
//!
//! The receiver verifies a transfer by digesting the memory that actually landed
//! ([`checksum`](crate::checksum), SPEC.md §6). When that memory is GPU memory, copying it
//! to the host to hash it would cost more than the transfer itself; this module computes
//! **exactly the same digests** ([`TransferDigests`], bit for bit what
//! [`digest_transfer`](crate::checksum::digest_transfer) returns) on the device, and only
//! the digests (16 bytes per buffer, 8 per page) cross back to the host.
//!
//! # What is here
//!
//! * [`KERNEL_SOURCE`]: the kernels, CUDA C compiled at run time by NVRTC. The same source
//!   is plain C11/C++: compiled by the host C compiler, its block programs run on the CPU,
//!   which is how CI tests it without a GPU (`tests/gpu_kernel_cpu.rs`, see `docs/GPU.md`).
//! * [`DeviceBuffer`] and [`GpuError`]: plain types, always available.
//! * `GpuDigester` (feature `cuda`): loads the CUDA driver and NVRTC at run time
//!   (`cudarc` with dynamic loading: a binary built with `cuda` runs on a machine without
//!   CUDA and reports [`GpuError::NoDriver`]), compiles the kernels once, and digests
//!   transfers whose pages are in device memory.
//!
//! # Kernel layout
//!
//! A transfer of `B` buffers and `P` pages is digested in two launches:
//!
//! 1. `kvwd_page_digests`, **one launch for every page of the transfer**: one thread block
//!    of [`THREADS_PER_BLOCK`] (128) threads per (buffer, page), `B × P` blocks, each
//!    writing one page digest (buffer-major, the order of [`TransferDigests::pages`]).
//!    Many independent blocks per SM keep HBM busy while any one block synchronises.
//!    * **XXH3-64**, pages over 240 bytes: XXH3's long loop adds 16 stripes of 64 bytes per
//!      1 KiB block into 8 accumulator lanes, then scrambles the lanes. The adds commute, so
//!      a block's contribution does not depend on the accumulators: in each round, 32 groups
//!      of 4 threads each sum one 1 KiB block (each thread 16 bytes, two lanes, per stripe:
//!      a group reads 64 contiguous bytes per step, 32 KiB in flight per block and round),
//!      then 8 threads, one per lane, run the cheap sequential chain
//!      `acc = scramble(acc + S_k)` over those 32 blocks in order. The partial last block and
//!      XXH3's overlapping last stripe are one more block without a scramble; thread 0
//!      merges. Pages of 0–240 bytes take XXH3's short paths on one thread.
//!    * **CRC-32**: the page is cut into 128 chunks, right-aligned so that chunks 1..127
//!      have one length `c` (a multiple of 16) and chunk 0 the rest; every thread runs
//!      slicing-by-8 over its chunk (chunk 0 from the register `0xFFFFFFFF`, the others from
//!      0), and a 7-level tree combines neighbours with `reg(A‖B) = reg(A)·x^(8|B|) ⊕
//!      reg(B) mod P`, one operator per level because every right-hand part of a level has
//!      the same length.
//! 2. `kvwd_buffer_digests`, one block per buffer: XXH3-128 of SPEC.md §6's byte string
//!    (`"KVWD"`, algorithm, transfer id, nonce, buffer index, then `i ‖ page digest i` per
//!    page), read on the fly from the page-digest array, through the same block-parallel
//!    long loop (or the short paths, up to 17 pages), with both XXH3-128 merges; the
//!    all-zero result maps to 1.
//!
//! Every block runs its job as a sequence of *steps* separated by a barrier; state passes
//! between steps only through the block's shared memory. The GPU entry points are a
//! three-line loop around the shared step function; the CPU path runs each step for all
//! 128 threads in turn (in three different orders, to expose any two threads that race
//! within a step). Loads are 8-byte loads where aligned and byte loads otherwise, so any
//! base address and page size works.
//!
//! The secret, CRC tables and the 64×64→128-bit multiply are the same code on both sides
//! (no `__umul64hi`, no vector loads): what the CPU test runs is what NVRTC compiles, except
//! the three `__global__` wrappers and the barrier loop.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_memory;
mod standin;
#[cfg(feature = "cuda")]
pub use cuda::GpuDigester;
#[cfg(feature = "cuda")]
pub use cuda_memory::CudaMemoryOps;
pub use standin::{HostStandIn, StandInStats};

pub use crate::checksum::TransferDigests;
use crate::checksum::UnsupportedAlgorithm;

/// The CUDA C source of the digest kernels (`src/gpu/kernel.cu`). Compiled by NVRTC with
/// `__CUDACC_RTC__` defined; without it, it is plain C11/C++ with CPU entry points
/// (`kvwd_cpu_*`) that run the same block programs on the host.
pub const KERNEL_SOURCE: &str = include_str!("kernel.cu");

/// Threads per block of every digest kernel (`KVWD_THREADS` in the source).
pub const THREADS_PER_BLOCK: u32 = 128;

/// Name of the page kernel: one block per (buffer, page), writes `B × P` page digests.
pub const PAGE_KERNEL: &str = "kvwd_page_digests";

/// Name of the buffer kernel: one block per buffer, writes `B` buffer digests (two `u64`
/// words each, low then high).
pub const BUFFER_KERNEL: &str = "kvwd_buffer_digests";

/// Name of the kernel that fills the CRC-32 slicing tables, once per `GpuDigester`.
pub const CRC_TABLE_KERNEL: &str = "kvwd_crc_tables";

/// Words (`u32`) in the CRC-32 slicing tables (`KVWD_CRC_TABLE_WORDS`: 8 tables of 256).
pub const CRC_TABLE_WORDS: usize = 2048;

/// One buffer of a transfer in device memory: page slot `p` of the buffer is the
/// `page_bytes` bytes at device address `ptr + p * page_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceBuffer {
    /// Device address of page slot 0 (a `CUdeviceptr` in the digester's context).
    pub ptr: u64,
    /// Bytes per page of this buffer.
    pub page_bytes: u32,
}

/// Why a GPU digest could not be computed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// The CUDA driver library (`libcuda.so.1`) could not be loaded.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// The NVRTC library (`libnvrtc.so`) could not be loaded.
    #[error("no NVRTC library: {0}")]
    NoNvrtc(String),
    /// The driver is there but device `ordinal` is not usable (absent, or the driver failed
    /// to initialise it).
    #[error("no usable CUDA device {ordinal}: {detail}")]
    NoDevice {
        /// The device ordinal asked for.
        ordinal: usize,
        /// What the driver said.
        detail: String,
    },
    /// NVRTC rejected the kernel source, or the driver rejected the compiled module.
    #[error("compiling the digest kernels failed: {detail}\n{log}")]
    Compile {
        /// The NVRTC or driver error.
        detail: String,
        /// NVRTC's compile log (empty if compilation itself succeeded).
        log: String,
    },
    /// A driver call failed while digesting: allocation, copy, launch, or the kernel itself
    /// (kernel faults surface when the results are copied back).
    #[error("GPU digest failed during {stage}: {detail}")]
    Launch {
        /// What was being done.
        stage: &'static str,
        /// What the driver said.
        detail: String,
    },
    /// The digest algorithm is not one the kernels implement.
    #[error(transparent)]
    Unsupported(#[from] UnsupportedAlgorithm),
    /// The transfer's shape does not fit one launch (too many buffers × pages).
    #[error("transfer too large for the GPU digest: {0}")]
    TooLarge(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Rust constants are the source's constants.
    #[test]
    fn constants_match_the_kernel_source() {
        let has = |s: &str| KERNEL_SOURCE.contains(s);
        assert!(has(&format!("#define KVWD_THREADS {THREADS_PER_BLOCK}\n")));
        assert!(has(&format!(
            "#define KVWD_CRC_TABLE_WORDS {CRC_TABLE_WORDS}\n"
        )));
        for name in [PAGE_KERNEL, BUFFER_KERNEL, CRC_TABLE_KERNEL] {
            assert!(has(&format!(" {name}(")), "{name}");
        }
        assert!(has(&format!(
            "#define KVWD_ALG_XXH3_64 {}\n",
            crate::checksum::DigestAlgorithm::XXH3_64.0
        )));
        assert!(has(&format!(
            "#define KVWD_ALG_CRC32 {}\n",
            crate::checksum::DigestAlgorithm::CRC32.0
        )));
        // NVRTC has no standard headers: the GPU branch must not include anything.
        let gpu_part = KERNEL_SOURCE
            .split("#ifndef __CUDACC_RTC__")
            .next()
            .unwrap();
        assert!(!gpu_part.contains("#include"));
        assert!(!KERNEL_SOURCE.contains("#include"));
    }

    #[test]
    fn errors_display() {
        assert_eq!(
            GpuError::NoDriver("libcuda.so.1 not found".into()).to_string(),
            "no CUDA driver: libcuda.so.1 not found"
        );
        let e = GpuError::from(UnsupportedAlgorithm(crate::checksum::DigestAlgorithm(9)));
        assert!(matches!(e, GpuError::Unsupported(_)));
    }
}
