//! Digest throughput: page digests (XXH3-64 and CRC-32) at KV page sizes, whole-transfer
//! digests (`digest_transfer`), and one 8 MiB chunk's digest job on one thread against the same
//! job split into parts on several (`digest_job_parts`). Results are recorded in
//! docs/BENCHMARKS.md.
//!
//! Run: `cargo bench -p kvwire --bench checksum -- --quick`.
//!
//! The data is in cache after the first iteration (a page is hashed over and over), so these
//! figures are the hash's compute throughput, not memory bandwidth.

use std::hint::black_box;

use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};
use kvwire::checksum::{digest_transfer, page_digest, DigestAlgorithm, DigestBinding};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

/// Page sizes measured: 4 KiB .. 2 MiB.
const PAGE_SIZES: &[(usize, &str)] = &[
    (4 * KIB, "4KiB"),
    (16 * KIB, "16KiB"),
    (64 * KIB, "64KiB"),
    (256 * KIB, "256KiB"),
    (MIB, "1MiB"),
    (2 * MIB, "2MiB"),
];

const ALGORITHMS: &[(DigestAlgorithm, &str)] = &[
    (DigestAlgorithm::XXH3_64, "XXH3_64"),
    (DigestAlgorithm::CRC32, "CRC32"),
];

/// Non-trivial, deterministic content (xorshift64), so nothing can special-case zeros.
fn filled(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

fn bench_page_digest(c: &mut Criterion) {
    let mut group = c.benchmark_group("page_digest");
    for &(size, label) in PAGE_SIZES {
        let page = filled(size, size as u64);
        group.throughput(Throughput::Bytes(size as u64));
        for &(alg, name) in ALGORITHMS {
            group.bench_with_input(BenchmarkId::new(name, label), &page, |b, page| {
                b.iter(|| page_digest(black_box(alg), black_box(page)).unwrap());
            });
        }
    }
    group.finish();
}

/// XXH3-64 page digests as kvwire computes them (twox-hash, SIMD chosen at run time) beside
/// xxhash-rust's `xxh3_64` (SIMD chosen at compile time: SSE2 on the default x86-64 target),
/// the same function: what choosing the implementation buys.
fn bench_xxh3_implementations(c: &mut Criterion) {
    let mut group = c.benchmark_group("xxh3_64_impl");
    for &(size, label) in &[(4 * KIB, "4KiB"), (64 * KIB, "64KiB"), (MIB, "1MiB")] {
        let page = filled(size, size as u64);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(
            BenchmarkId::new("kvwire-twox-hash", label),
            &page,
            |b, page| {
                b.iter(|| page_digest(DigestAlgorithm::XXH3_64, black_box(page)).unwrap());
            },
        );
        group.bench_with_input(BenchmarkId::new("xxhash-rust", label), &page, |b, page| {
            b.iter(|| xxhash_rust::xxh3::xxh3_64(black_box(page)));
        });
    }
    group.finish();
}

fn bench_digest_transfer(c: &mut Criterion) {
    const BUFFERS: usize = 8;
    const PAGES: usize = 16;
    const PAGE: usize = 64 * KIB;
    let memory: Vec<Vec<Vec<u8>>> = (0..BUFFERS)
        .map(|b| {
            (0..PAGES)
                .map(|i| filled(PAGE, (b * PAGES + i) as u64 + 1))
                .collect()
        })
        .collect();
    let binding = DigestBinding {
        transfer_id: kvwire::TransferId(0x1234),
        nonce: 0x5678,
    };

    let mut group = c.benchmark_group("digest_transfer");
    group.throughput(Throughput::Bytes((BUFFERS * PAGES * PAGE) as u64));
    for &(alg, name) in ALGORITHMS {
        for per_page in [false, true] {
            let shape = if per_page {
                "8x16x64KiB+pages"
            } else {
                "8x16x64KiB"
            };
            let id = BenchmarkId::new(name, shape);
            group.bench_function(id, |b| {
                b.iter(|| {
                    digest_transfer(black_box(alg), binding, BUFFERS, PAGES, per_page, |b, i| {
                        &memory[b][i]
                    })
                    .unwrap()
                })
            });
        }
    }
    group.finish();
}

/// One engine request's digest job (4 buffers x 32 pages of 64 KiB = 8 MiB, XXH3-64 with page
/// digests) on one thread (`DigestJob::run`), against its page digests taken in 2 and 4 parts
/// on as many threads and folded in order (`page_digests_of` + `run_from_parts`, what the
/// driver does on the blocking pool; here on scoped threads, so without tokio's hand-off).
fn bench_digest_job_parts(c: &mut Criterion) {
    use kvwire::checksum::{DigestJob, DigestMode};
    use kvwire::{PagePool, PoolGeometry, Scrub};
    const BUFFERS: usize = 4;
    const PAGES: u32 = 32;
    const PAGE: usize = 64 * KIB;
    let pool = PagePool::new(
        PoolGeometry {
            tokens_per_page: 16,
            buffer_page_bytes: vec![PAGE as u32; BUFFERS],
            pages: PAGES,
        },
        Scrub::None,
    )
    .unwrap();
    for p in 0..PAGES {
        for b in 0..BUFFERS {
            let mut page = pool.raw_page_mut(p, b).unwrap();
            page.copy_from_slice(&filled(PAGE, u64::from(p) * 8 + b as u64 + 1));
        }
    }
    let t = kvwire::TransferRef {
        transfer_id: kvwire::TransferId(7),
        nonce: 9,
    };
    let job = DigestJob::new(
        t,
        DigestAlgorithm::XXH3_64,
        true,
        DigestMode::Verify,
        0,
        pool.share_pages((0..PAGES).collect()).unwrap(),
        Some(Vec::new()),
    );
    let n = job.page_count();
    let mut group = c.benchmark_group("digest_job_parts");
    group.throughput(Throughput::Bytes(job.bytes()));
    group.bench_function("8MiB/1_thread", |b| b.iter(|| job.run(None).unwrap()));
    for parts in [2usize, 4] {
        group.bench_function(format!("8MiB/{parts}_parts"), |b| {
            b.iter(|| {
                let got: Vec<_> = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..parts)
                        .map(|k| {
                            let job = &job;
                            s.spawn(move || job.page_digests_of(k * n / parts, (k + 1) * n / parts))
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().unwrap().unwrap())
                        .collect()
                });
                job.run_from_parts(None, &got).unwrap()
            })
        });
    }
    group.finish();
}

/// The benchmark group (in a module of its own: `criterion_group!` defines an undocumented
/// `pub fn`).
mod group {
    use super::{
        bench_digest_job_parts, bench_digest_transfer, bench_page_digest,
        bench_xxh3_implementations,
    };
    criterion::criterion_group!(
        benches,
        bench_page_digest,
        bench_xxh3_implementations,
        bench_digest_transfer,
        bench_digest_job_parts
    );
}

criterion_main!(group::benches);
