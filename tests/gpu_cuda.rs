//! The GPU digests on a real GPU (feature `cuda`): `GpuDigester` over pages in device memory
//! must return exactly what `kvwire::checksum::digest_transfer` returns over the same bytes.
//!
//! Without a CUDA driver (or NVRTC, or device) the test prints `SKIPPED: ...` and passes,
//! unless `KVWIRE_REQUIRE_GPU=1`, which makes any of those a failure.
#![cfg(feature = "cuda")]

#[path = "common/gpu.rs"]
mod gpu;

use cudarc::driver::{CudaSlice, DevicePtr};
use kvwire::checksum::{digest_transfer, DigestAlgorithm, DigestBinding};
use kvwire::gpu::{DeviceBuffer, GpuDigester, GpuError};
use kvwire::TransferId;

fn gpu_or_skip() -> Option<GpuDigester> {
    gpu::or_skip("GPU digester", GpuDigester::new(0))
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// One buffer: `slots` page slots of `page_bytes`, placed `offset` bytes into its device
/// allocation (an odd offset exercises the unaligned loads).
struct Buf {
    host: Vec<u8>,
    dev: CudaSlice<u8>,
    page_bytes: u32,
    offset: usize,
}

#[test]
fn gpu_digests_equal_cpu_digests() {
    let Some(gpu) = gpu_or_skip() else { return };
    let stream = gpu.stream().clone();
    let mut rng = Rng(0x5DEE_CE66_D1CE_5EED);

    // (page bytes, offset of slot 0 in the allocation): every XXH3 length class, CRC chunk
    // shapes, several rounds of the long loop, odd sizes and unaligned bases.
    let shapes: &[(u32, usize)] = &[
        (0, 0),
        (1, 0),
        (3, 1),
        (16, 0),
        (17, 3),
        (128, 0),
        (129, 0),
        (240, 8),
        (241, 0),
        (1000, 0),
        (4096, 0),
        (4099, 5),
        (65_536, 0),
        (65_537, 1),
        (1 << 20, 0),
    ];
    let slots = 40u32;
    let bufs: Vec<Buf> = shapes
        .iter()
        .map(|&(page_bytes, offset)| {
            let len = offset + page_bytes as usize * slots as usize;
            let mut host = vec![0u8; len];
            for b in &mut host {
                *b = rng.next() as u8;
            }
            let dev = stream.clone_htod(&host).expect("copy to device");
            Buf {
                host,
                dev,
                page_bytes,
                offset,
            }
        })
        .collect();
    stream.synchronize().unwrap();
    let device: Vec<DeviceBuffer> = bufs
        .iter()
        .map(|b| DeviceBuffer {
            ptr: b.dev.device_ptr(&stream).0 + b.offset as u64,
            page_bytes: b.page_bytes,
        })
        .collect();

    // Page lists: one page, the first and last slots, every slot shuffled, and a long list
    // (a buffer digest input over 240 bytes, several rounds of the long loop).
    let mut all: Vec<u32> = (0..slots).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let lists: Vec<Vec<u32>> = vec![vec![], vec![5], vec![slots - 1, 0], all.clone(), {
        let mut long = all.clone();
        long.extend(all.iter().rev());
        long.extend(&all);
        long
    }];

    for alg in [DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32] {
        for (n, pages) in lists.iter().enumerate() {
            let binding = DigestBinding {
                transfer_id: TransferId(rng.next()),
                nonce: rng.next(),
            };
            let want = digest_transfer(alg, binding, bufs.len(), pages.len(), true, |b, i| {
                let pb = bufs[b].page_bytes as usize;
                let start = bufs[b].offset + pages[i] as usize * pb;
                &bufs[b].host[start..start + pb]
            })
            .unwrap();
            let got = gpu.digest(alg, binding, &device, pages, true).unwrap();
            for (b, buf) in bufs.iter().enumerate() {
                for i in 0..pages.len() {
                    assert_eq!(
                        got.pages[b * pages.len() + i],
                        want.pages[b * pages.len() + i],
                        "{alg}, list {n}, page bytes {}, ordinal {i}",
                        buf.page_bytes
                    );
                }
            }
            assert_eq!(got, want, "{alg}, list {n}");
            let without = gpu.digest(alg, binding, &device, pages, false).unwrap();
            assert_eq!(without.buffers, want.buffers);
            assert!(without.pages.is_empty());
        }
    }

    assert!(matches!(
        gpu.digest(
            DigestAlgorithm(9),
            DigestBinding {
                transfer_id: TransferId(1),
                nonce: 2
            },
            &device,
            &[0],
            true
        ),
        Err(GpuError::Unsupported(_))
    ));
    assert_eq!(
        gpu.digest(
            DigestAlgorithm::XXH3_64,
            DigestBinding {
                transfer_id: TransferId(1),
                nonce: 2
            },
            &[],
            &[0, 1],
            true
        )
        .unwrap(),
        Default::default()
    );
}
