//! Protocol costs: frame codec, one full session round (sans IO), and a loopback transfer
//! end to end through the Pair harness.
//!
//! Run: `cargo bench -p kvwire --bench protocol -- --quick`

use kvwire::TransferId;
use std::time::Duration;

use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};
use kvwire::memory::PoolGeometry;
use kvwire::proto::admission::Request;
use kvwire::proto::wire::{Commit, Digest128, DigestAlgorithm, Frame, Reserve, TransferRef};
use kvwire::receiver::ReserveParams;
use kvwire::testkit::{kv_pattern, Pair, PairConfig};

fn frames() -> Vec<(&'static str, Frame)> {
    let t = TransferRef {
        transfer_id: TransferId(7),
        nonce: 9,
    };
    vec![
        (
            "reserve_64_pages",
            Frame::Reserve(Reserve {
                transfer_id: TransferId(7),
                nonce: 9,
                tokens: 1024,
                digest: DigestAlgorithm::XXH3_64,
                page_digests: false,
                deadline_ms: 5000,
                pages: (0..64).collect(),
                access: vec![1, 2, 3, 4],
            }),
        ),
        (
            "commit_160_buffers",
            Frame::Commit(Commit {
                transfer: t,
                tokens: 1024,
                pages: 64,
                bytes: 1 << 30,
                digest: DigestAlgorithm::XXH3_64,
                buffer_digests: vec![Digest128::from_u128(5); 160],
                page_digests: vec![],
                aux_digest: Digest128::from_u128(6),
                aux: vec![0; 8],
            }),
        ),
        ("verified", Frame::Verified(t)),
    ]
}

fn codec(c: &mut Criterion) {
    let mut g = c.benchmark_group("codec");
    for (name, frame) in frames() {
        let bytes = frame.to_bytes().unwrap();
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        let mut out = Vec::with_capacity(bytes.len());
        g.bench_function(BenchmarkId::new("encode", name), |b| {
            b.iter(|| {
                out.clear();
                frame.encode(&mut out).unwrap();
            })
        });
        g.bench_function(BenchmarkId::new("decode", name), |b| {
            b.iter(|| Frame::decode(&bytes).unwrap())
        });
    }
    g.finish();
}

fn pair_config(page: u32) -> PairConfig {
    let mut cfg = PairConfig::small();
    let geometry = PoolGeometry {
        tokens_per_page: 16,
        buffer_page_bytes: vec![page; 4],
        pages: 64,
    };
    cfg.sender_pool = geometry.clone();
    cfg.receiver_pool = geometry;
    cfg
}

fn loopback(c: &mut Criterion) {
    let mut g = c.benchmark_group("loopback_transfer");
    g.sample_size(20);
    for page in [4096u32, 65536] {
        // The harness checks every delivered byte against kv_pattern, so fill whole pages.
        let mut pair = Pair::new(pair_config(page)).unwrap();
        let mut id = 0u64;
        g.throughput(Throughput::Bytes(u64::from(page) * 4 * 8));
        g.bench_function(BenchmarkId::new("8_pages_x_4_buffers", page), |b| {
            b.iter(|| {
                id += 1;
                let now = pair.now;
                pair.receiver
                    .reserve(
                        now,
                        ReserveParams::new(TransferId(id), 128, Duration::from_secs(5)),
                    )
                    .unwrap();
                let now = pair.now;
                let admitted = pair
                    .sender
                    .admit(
                        now,
                        Request {
                            transfer_id: TransferId(id),
                            tokens: 128,
                        },
                    )
                    .unwrap();
                let this = id;
                pair.sender
                    .submit(now, admitted, |o, b, p| {
                        kv_pattern(TransferId(this), o, b, p)
                    })
                    .unwrap();
                assert!(pair.drive_until(|p| p.verified.last() == Some(&TransferId(this))));
            })
        });
        assert!(pair.wrong_content.is_empty());
    }
    g.finish();
}

/// The benchmark group (in a module of its own: `criterion_group!` defines an undocumented
/// public function).
mod group {
    use super::{codec, loopback};
    criterion::criterion_group!(benches, codec, loopback);
}

criterion_main!(group::benches);
