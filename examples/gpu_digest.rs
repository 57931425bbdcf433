//! GPU digest throughput, next to a device-to-device copy of the same bytes (feature `cuda`).
//!
//! ```sh
//! cargo run --release --features cuda --example gpu_digest -- [--gib 1] [--page-kib 32] \
//!     [--buffers 2] [--iters 10]
//! ```
//!
//! Fills at least `--gib` GiB of page slots in device memory with random bytes (`--buffers`
//! buffers of `--page-kib` KiB pages), then, for each digest algorithm, digests one transfer
//! of every page slot, in a shuffled page order, with `GpuDigester::digest` (two kernel
//! launches and the copy of the digests back, page digests included) and copies the same
//! bytes device to device (`cuMemcpyDtoD`, one copy per buffer) in the same run. Throughput is
//! GB/s (10^9 bytes per second) of page bytes, best of `--iters` runs after one warm-up.
//! Every page digest and buffer digest is then checked against
//! `kvwire::checksum::digest_transfer` over a host copy of the pages.
//!
//! Exits 0 when every digest matched, 1 on a mismatch, 2 when there is no CUDA driver,
//! NVRTC or device (with the reason; never a panic).

use kvwire::TransferId;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, DevicePtr};
use kvwire::checksum::{digest_transfer, DigestAlgorithm, DigestBinding, TransferDigests};
use kvwire::gpu::{DeviceBuffer, GpuDigester, GpuError};

struct Args {
    gib: u64,
    page_kib: u32,
    buffers: u32,
    iters: u32,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        gib: 1,
        page_kib: 32,
        buffers: 2,
        iters: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |_| format!("bad value for {flag}: {value}");
        match flag.as_str() {
            "--gib" => args.gib = value.parse().map_err(bad)?,
            "--page-kib" => args.page_kib = value.parse().map_err(bad)?,
            "--buffers" => args.buffers = value.parse().map_err(bad)?,
            "--iters" => args.iters = value.parse().map_err(bad)?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if args.gib == 0 || args.page_kib == 0 || args.buffers == 0 || args.iters == 0 {
        return Err("every value must be positive".into());
    }
    Ok(args)
}

/// xorshift64*: deterministic random bytes and shuffles.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn ms(t: Duration) -> f64 {
    t.as_secs_f64() * 1e3
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpu_digest: {e}");
            return ExitCode::from(2);
        }
    };
    let gpu = match GpuDigester::new(0) {
        Ok(gpu) => gpu,
        Err(e @ (GpuError::NoDriver(_) | GpuError::NoNvrtc(_) | GpuError::NoDevice { .. })) => {
            eprintln!("gpu_digest: {e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("gpu_digest: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(&gpu, &args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("gpu_digest: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(gpu: &GpuDigester, args: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    let stream = gpu.stream().clone();
    let page_bytes = args.page_kib << 10;
    let per_page_set = u64::from(args.buffers) * u64::from(page_bytes);
    let pages_per_buffer = u32::try_from((args.gib << 30).div_ceil(per_page_set))?;
    let slot_bytes = pages_per_buffer as usize * page_bytes as usize;
    let total = per_page_set * u64::from(pages_per_buffer);

    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut host: Vec<Vec<u8>> = Vec::new();
    let mut src: Vec<CudaSlice<u8>> = Vec::new();
    let mut dst: Vec<CudaSlice<u8>> = Vec::new();
    for _ in 0..args.buffers {
        let mut bytes = vec![0u8; slot_bytes];
        rng.fill(&mut bytes);
        src.push(stream.clone_htod(&bytes)?);
        dst.push(stream.alloc_zeros::<u8>(slot_bytes)?);
        host.push(bytes);
    }
    let buffers: Vec<DeviceBuffer> = src
        .iter()
        .map(|s| DeviceBuffer {
            ptr: s.device_ptr(&stream).0,
            page_bytes,
        })
        .collect();
    let mut pages: Vec<u32> = (0..pages_per_buffer).collect();
    for i in (1..pages.len()).rev() {
        pages.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    stream.synchronize()?;

    println!(
        "device 0: {} ({:?}); transfer: {} buffers x {} pages x {} KiB = {:.3} GiB, pages in \
         shuffled order; best of {} runs after a warm-up",
        gpu.context().name()?,
        gpu,
        args.buffers,
        pages_per_buffer,
        args.page_kib,
        total as f64 / f64::from(1u32 << 30),
        args.iters
    );

    let copy = |stream: &std::sync::Arc<cudarc::driver::CudaStream>,
                dst: &mut Vec<CudaSlice<u8>>|
     -> Result<Duration, Box<dyn std::error::Error>> {
        stream.synchronize()?;
        let t = Instant::now();
        for (s, d) in src.iter().zip(dst.iter_mut()) {
            stream.memcpy_dtod(s, d)?;
        }
        stream.synchronize()?;
        Ok(t.elapsed())
    };

    let mut all_ok = true;
    for alg in [DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32] {
        let binding = DigestBinding {
            transfer_id: TransferId(0x0123_4567_89AB_CDEF),
            nonce: 42,
        };
        let mut digests = gpu.digest(alg, binding, &buffers, &pages, true)?;
        copy(&stream, &mut dst)?;
        let mut best_digest = Duration::MAX;
        let mut best_copy = Duration::MAX;
        for _ in 0..args.iters {
            let t = Instant::now();
            digests = gpu.digest(alg, binding, &buffers, &pages, true)?;
            best_digest = best_digest.min(t.elapsed());
            best_copy = best_copy.min(copy(&stream, &mut dst)?);
        }
        let without_pages = gpu.digest(alg, binding, &buffers, &pages, false)?;

        let t = Instant::now();
        let want: TransferDigests = digest_transfer(
            alg,
            binding,
            args.buffers as usize,
            pages.len(),
            true,
            |b, i| {
                let start = pages[i] as usize * page_bytes as usize;
                &host[b][start..start + page_bytes as usize]
            },
        )?;
        let cpu = t.elapsed();
        let bad_pages = want
            .pages
            .iter()
            .zip(&digests.pages)
            .filter(|(a, b)| a != b)
            .count()
            + want.pages.len().abs_diff(digests.pages.len());
        let bad_buffers = want
            .buffers
            .iter()
            .zip(&digests.buffers)
            .filter(|(a, b)| a != b)
            .count()
            + want.buffers.len().abs_diff(digests.buffers.len());
        let ok = bad_pages == 0
            && bad_buffers == 0
            && without_pages.buffers == want.buffers
            && without_pages.pages.is_empty();
        all_ok &= ok;
        println!(
            "{alg:>8}: digest {:8.3} ms {:8.1} GB/s | d2d copy {:8.3} ms {:8.1} GB/s | digest \
             time / copy time {:5.2} | CPU (1 thread, host memory) {:8.1} GB/s | check: {}",
            ms(best_digest),
            gbps(total, best_digest),
            ms(best_copy),
            gbps(total, best_copy),
            best_digest.as_secs_f64() / best_copy.as_secs_f64(),
            gbps(total, cpu),
            if ok {
                format!(
                    "all {} page digests and {} buffer digests equal the CPU's",
                    want.pages.len(),
                    want.buffers.len()
                )
            } else {
                format!("MISMATCH: {bad_pages} page digests, {bad_buffers} buffer digests differ")
            }
        );
    }
    Ok(all_ok)
}
