//! KV memory in real GPU memory over TCP (feature `cuda`): the staging pipeline with
//! `CudaMemoryOps` (async copies on CUDA streams, pinned staging, the digest kernels), the
//! same transfer `tests/gpu_standin.rs` runs with the host stand-in.
//!
//! Without a CUDA driver (or NVRTC, or device) the test prints `SKIPPED: ...` and passes,
//! unless `KVWIRE_REQUIRE_GPU=1`, which makes any of those a failure.
#![cfg(feature = "cuda")]

#[path = "common/gpu.rs"]
mod gpu;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::DevicePtr as _;
use kvwire::gpu::CudaMemoryOps;
use kvwire::memory::{DeviceMemoryOps, DevicePtr, KvBuffer, KvMemory, MemoryKind};
use kvwire::proto::admission::Request;
use kvwire::{Node, NodeConfig, ReceiverConn, ReserveParams, SenderConn, TransferId};
use tokio::net::TcpListener;

const PAGES: u32 = 64;
const PAGE_BYTES: u32 = 64 << 10;
const BUFFERS: usize = 2;

fn ops_or_skip() -> Option<CudaMemoryOps> {
    gpu::or_skip("CUDA device memory", CudaMemoryOps::new(0))
}

fn config() -> NodeConfig {
    let mut c = NodeConfig::example();
    c.pool.pages = PAGES;
    c.pool.buffer_page_bytes = vec![PAGE_BYTES; BUFFERS];
    c.engine.max_context_tokens = u64::from(PAGES) * u64::from(c.pool.tokens_per_page);
    c
}

/// A node whose buffers are fresh device allocations (every byte `fill`), leaked: the
/// connection tasks may outlive the test body, and the memory must outlive them.
fn device_node(config: &NodeConfig, ops: CudaMemoryOps, fill: u8) -> Node {
    let stream = ops.digester().stream().clone();
    let buffers = (0..BUFFERS)
        .map(|b| {
            let len = config.pool.buffer_len(b).unwrap();
            let dev = stream
                .clone_htod(&vec![fill; len])
                .expect("device allocation");
            let ptr = DevicePtr(dev.device_ptr(&stream).0);
            std::mem::forget(dev);
            KvBuffer::Device { ptr, len }
        })
        .collect();
    stream.synchronize().unwrap();
    let ops: Arc<dyn DeviceMemoryOps> = Arc::new(ops);
    // SAFETY: device allocations of exactly these lengths in the device's primary context
    // (the one `ops` uses), never freed (leaked above); the test writes only pages kvwire
    // does not hold, through `engine_write`.
    let memory = unsafe { KvMemory::from_buffers_in(&config.pool, buffers, Some(ops)) }.unwrap();
    assert!(memory
        .kinds()
        .all(|k| k == MemoryKind::Device { ordinal: 0 }));
    Node::with_memory(config.clone(), memory).unwrap()
}

fn kv_bytes(id: u64, ordinal: usize, buffer: usize) -> Vec<u8> {
    (0..PAGE_BYTES as usize)
        .map(|i| (id as usize * 131 + ordinal * 17 + buffer * 7 + i / 3) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_between_gpu_memories_verifies_over_tcp() {
    let Some(prefill_ops) = ops_or_skip() else {
        return;
    };
    let decode_ops = CudaMemoryOps::new(0).unwrap();
    let config = config();
    let prefill = device_node(&config, prefill_ops, 0x11);
    let decode = device_node(&config, decode_ops, 0xEE);

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let d = decode.clone();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &d).await });
    let s = SenderConn::connect(addr, &prefill).await.unwrap();
    let r = accept.await.unwrap().unwrap();

    let src: Vec<u32> = vec![3, 9, 1, 30, 12, 63, 0, 40];
    let dst: Vec<u32> = vec![62, 4, 17, 0, 8, 33, 34, 5];
    for (ordinal, &p) in src.iter().enumerate() {
        for b in 0..BUFFERS {
            prefill
                .pool()
                .engine_write(p, b, &kv_bytes(1, ordinal, b))
                .unwrap();
        }
    }
    let tokens = src.len() as u32 * config.pool.tokens_per_page;
    let verified = r.reserve(
        ReserveParams::new(TransferId(1), tokens, Duration::from_secs(30))
            .into_pages(dst.clone())
            .with_page_digests(),
    );
    let admitted = s
        .admit(Request {
            transfer_id: TransferId(1),
            tokens: u64::from(tokens),
        })
        .unwrap();
    s.send_pages(admitted, src.clone()).await.unwrap();
    let kv = verified.await.unwrap();
    assert_eq!(kv.page_indices(), dst);
    kv.release().unwrap();
    let mut got = vec![0u8; PAGE_BYTES as usize];
    for (ordinal, &page) in dst.iter().enumerate() {
        for b in 0..BUFFERS {
            decode.pool().engine_read(page, b, &mut got).unwrap();
            assert!(
                got == kv_bytes(1, ordinal, b),
                "page {page} buffer {b} is not ordinal {ordinal}"
            );
        }
    }
    decode.pool().engine_read(1, 0, &mut got).unwrap();
    assert!(
        got.iter().all(|&x| x == 0xEE),
        "an unreserved page was touched"
    );
    assert_eq!(r.stats().await.unwrap().digests_at_landing, 0);
    assert!(decode.pool().held_pages().is_empty());
}
