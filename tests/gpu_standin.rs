//! KV memory in (simulated) device memory over TCP (issue 14), with the host stand-in
//! (`kvwire::gpu::HostStandIn`): device pages at addresses the host cannot dereference,
//! copies by worker threads, a gate that makes the pipeline's order observable.
//!
//! * a verified transfer between two device memories over TCP loopback, landed bytes read
//!   back from the receiver's device memory;
//! * stale pages: copies into the device that never happen leave stale pages, and the
//!   digests (taken in device memory, never at landing) fail;
//! * the double buffering: a record is on the socket while the next one's copy runs
//!   (sender), and the next record is read while the previous one is copied (receiver);
//! * an abort while a copy into a page is held back releases the pages only after it
//!   completed.

use std::sync::Arc;
use std::task::Waker;
use std::time::{Duration, Instant};

use kvwire::gpu::{HostStandIn, StandInStats};
use kvwire::memory::{
    CopyQueue, CopyTicket, DeviceError, DeviceMemoryOps, DevicePtr, DeviceSlots, KvBuffer,
    KvMemory, MemoryKind, PinnedBuffer,
};
use kvwire::proto::admission::Request;
use kvwire::proto::wire::{DigestAlgorithm, ErrorCode, TransferDigests, TransferRef};
use kvwire::proto::FailureReason;
use kvwire::{
    Node, NodeConfig, ReceiverConn, ReserveParams, SenderConn, TransferError, TransferId,
};
use tokio::net::TcpListener;

const PAGES: u32 = 32;
const PAGE_BYTES: u32 = 4096;
const BUFFERS: usize = 2;

fn config() -> NodeConfig {
    let mut c = NodeConfig::example();
    c.pool.pages = PAGES;
    c.pool.buffer_page_bytes = vec![PAGE_BYTES; BUFFERS];
    c.engine.max_context_tokens = u64::from(PAGES) * u64::from(c.pool.tokens_per_page);
    c
}

/// A node whose every buffer is device memory of `ops`' device (allocated on `dev`, every
/// byte `fill`).
fn device_node(
    config: &NodeConfig,
    dev: &HostStandIn,
    ops: Arc<dyn DeviceMemoryOps>,
    fill: u8,
) -> Node {
    let buffers = (0..BUFFERS)
        .map(|b| {
            let len = config.pool.buffer_len(b).unwrap();
            KvBuffer::Device {
                ptr: dev.alloc(len, fill),
                len,
            }
        })
        .collect();
    // SAFETY: the buffers are the stand-in's device allocations of exactly these lengths,
    // alive as long as the stand-in (held by `ops`, which the memory keeps); the test writes
    // only pages kvwire does not hold (through `engine_write`, which checks).
    let memory = unsafe { KvMemory::from_buffers_in(&config.pool, buffers, Some(ops)) }.unwrap();
    assert_eq!(
        memory.kinds().collect::<Vec<_>>(),
        vec![
            MemoryKind::Device {
                ordinal: dev.ops().ordinal()
            };
            BUFFERS
        ]
    );
    Node::with_memory(config.clone(), memory).unwrap()
}

async fn connect(prefill: &Node, decode: &Node) -> (SenderConn, ReceiverConn) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let d = decode.clone();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &d).await });
    let s = SenderConn::connect(addr, prefill).await.unwrap();
    (s, accept.await.unwrap().unwrap())
}

fn kv_bytes(id: u64, ordinal: usize, buffer: usize) -> Vec<u8> {
    (0..PAGE_BYTES as usize)
        .map(|i| (id as usize * 131 + ordinal * 17 + buffer * 7 + i / 3) as u8)
        .collect()
}

/// The prefill engine writes its KV for `id` into its (device) pages `src`.
fn fill_source(node: &Node, id: u64, src: &[u32]) {
    for (ordinal, &p) in src.iter().enumerate() {
        for b in 0..BUFFERS {
            node.pool()
                .engine_write(p, b, &kv_bytes(id, ordinal, b))
                .unwrap();
        }
    }
}

fn read_page(node: &Node, page: u32, buffer: usize) -> Vec<u8> {
    let mut out = vec![0; PAGE_BYTES as usize];
    node.pool().engine_read(page, buffer, &mut out).unwrap();
    out
}

/// Waits (up to 10 s) until `cond` holds of `dev`'s counters; returns them.
async fn wait_for(
    dev: &HostStandIn,
    what: &str,
    cond: impl Fn(&StandInStats) -> bool,
) -> StandInStats {
    let start = Instant::now();
    loop {
        let s = dev.stats();
        if cond(&s) {
            return s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn request(id: u64, pages: usize) -> Request {
    Request {
        transfer_id: TransferId(id),
        tokens: pages as u64 * 16,
    }
}

/// Device memory on both sides: the transfer verifies, every landed byte (read back from the
/// receiver's device memory) is the sender's, nothing else changed, and the receiver digested
/// in device memory after the copies (none raced a copy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_between_device_memories_verifies_over_tcp() {
    let config = config();
    let (pdev, ddev) = (HostStandIn::new(0), HostStandIn::new(1));
    let prefill = device_node(&config, &pdev, pdev.ops(), 0x11);
    let decode = device_node(&config, &ddev, ddev.ops(), 0xEE);
    let (s, r) = connect(&prefill, &decode).await;
    for (id, src, dst) in [
        (1u64, vec![3u32, 9, 1, 30, 12], vec![31u32, 4, 17, 0, 8]),
        (2, vec![5, 6], vec![20, 21]),
    ] {
        fill_source(&prefill, id, &src);
        let verified = r.reserve(
            ReserveParams::new(
                TransferId(id),
                src.len() as u32 * 16,
                Duration::from_secs(10),
            )
            .into_pages(dst.clone())
            .with_page_digests(),
        );
        let admitted = s.admit(request(id, src.len())).unwrap();
        s.send_pages(admitted, src.clone()).await.unwrap();
        let kv = verified.await.unwrap();
        assert_eq!(kv.page_indices(), dst);
        // Device pages are not reachable through host references.
        assert!(kv.page(0, 0).is_err());
        kv.release().unwrap();
        for (ordinal, &page) in dst.iter().enumerate() {
            for b in 0..BUFFERS {
                assert!(
                    read_page(&decode, page, b) == kv_bytes(id, ordinal, b),
                    "transfer {id}: page {page} buffer {b} is not ordinal {ordinal}"
                );
            }
        }
    }
    let written = [31u32, 4, 17, 0, 8, 20, 21];
    for page in (0..PAGES).filter(|p| !written.contains(p)) {
        assert!(
            read_page(&decode, page, 0).iter().all(|&x| x == 0xEE),
            "page {page} touched"
        );
    }
    let (p, d) = (pdev.stats(), ddev.stats());
    assert_eq!(
        p.to_host_done,
        7 * BUFFERS as u64,
        "sender copies device -> staging: {p:?}"
    );
    assert_eq!(
        d.to_device_done,
        7 * BUFFERS as u64,
        "receiver copies staging -> device: {d:?}"
    );
    assert!(
        d.digests >= 2 && d.pages_digested >= 7,
        "receiver digests in device memory: {d:?}"
    );
    assert!(p.digests >= 2, "sender digests in device memory: {p:?}");
    assert_eq!(d.digests_racing_copies, 0, "{d:?}");
    assert_eq!(
        d.pinned_buffers, 2,
        "two staging buffers, allocated once: {d:?}"
    );
    let stats = r.stats().await.unwrap();
    assert_eq!(
        stats.digests_at_landing, 0,
        "device pages are never digested at landing"
    );
    assert!(decode.pool().held_pages().is_empty());
    assert!(prefill.pool().held_pages().is_empty());
}

/// A device whose copies into device memory silently do nothing (a broken copy path): the
/// staging buffers hold the right bytes, the pages keep their stale ones.
#[derive(Debug)]
struct LostCopiesToDevice(HostStandIn);

#[derive(Debug)]
struct LostQueue(Box<dyn CopyQueue>);

impl CopyQueue for LostQueue {
    unsafe fn copy_to_host(
        &mut self,
        src: DevicePtr,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.copy_to_host(src, dst, len) }
    }
    unsafe fn copy_to_device(
        &mut self,
        _src: *const u8,
        _dst: DevicePtr,
        _len: usize,
    ) -> Result<(), DeviceError> {
        Ok(())
    }
    fn mark(&mut self) -> Result<CopyTicket, DeviceError> {
        self.0.mark()
    }
    fn poll_done(
        &mut self,
        ticket: CopyTicket,
        waker: Option<&Waker>,
    ) -> Result<bool, DeviceError> {
        self.0.poll_done(ticket, waker)
    }
    fn synchronize(&mut self) -> Result<(), DeviceError> {
        self.0.synchronize()
    }
}

impl DeviceMemoryOps for LostCopiesToDevice {
    fn ordinal(&self) -> u32 {
        self.0.ordinal()
    }
    fn pinned(&self, len: usize) -> Result<Box<dyn PinnedBuffer>, DeviceError> {
        self.0.pinned(len)
    }
    fn queue(&self) -> Result<Box<dyn CopyQueue>, DeviceError> {
        Ok(Box::new(LostQueue(self.0.queue()?)))
    }
    unsafe fn digest(
        &self,
        algorithm: DigestAlgorithm,
        transfer: TransferRef,
        buffers: &[DeviceSlots],
        pages: &[u32],
        per_page: bool,
    ) -> Result<TransferDigests, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.digest(algorithm, transfer, buffers, pages, per_page) }
    }
    unsafe fn fill(&self, dst: DevicePtr, len: usize, byte: u8) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.fill(dst, len, byte) }
    }
    unsafe fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.read(src, dst) }
    }
    unsafe fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.write(dst, src) }
    }
}

/// Stale pages: every record arrives whole into staging (so coverage alone would pass), but
/// no byte reaches the device pages, which still hold an earlier request's KV. The receiver
/// digests the device memory after the copies, not the staging buffers, so the transfer
/// fails on the digest and nothing is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_device_pages_fail_the_digest() {
    let config = config();
    let (pdev, ddev) = (HostStandIn::new(0), HostStandIn::new(1));
    let prefill = device_node(&config, &pdev, pdev.ops(), 0x11);
    let decode = device_node(
        &config,
        &ddev,
        Arc::new(LostCopiesToDevice(ddev.clone())),
        0xEE,
    );
    // The decode pages hold another request's KV (pages are not zeroed between requests).
    let dst = vec![2u32, 7, 11];
    for (ordinal, &p) in dst.iter().enumerate() {
        for b in 0..BUFFERS {
            decode
                .pool()
                .engine_write(p, b, &kv_bytes(99, ordinal, b))
                .unwrap();
        }
    }
    let (s, r) = connect(&prefill, &decode).await;
    let src = vec![0u32, 1, 2];
    fill_source(&prefill, 5, &src);
    let verified = r.reserve(
        ReserveParams::new(TransferId(5), 48, Duration::from_secs(10))
            .into_pages(dst.clone())
            .with_page_digests(),
    );
    let admitted = s.admit(request(5, 3)).unwrap();
    let sent = s.send_pages(admitted, src).await;
    match verified.await {
        Err(TransferError::Failed(FailureReason::DigestMismatch {
            buffer: 0,
            page: Some(0),
        })) => {}
        other => panic!("stale device pages must fail the digest, got {other:?}"),
    }
    assert!(sent.is_err(), "the sender learns it failed: {sent:?}");
    assert_eq!(
        r.stats().await.unwrap().pages_landed,
        3,
        "every record arrived whole"
    );
    assert_eq!(
        read_page(&decode, 2, 0),
        kv_bytes(99, 0, 0),
        "the page is stale"
    );
    assert!(ddev.stats().digests >= 1);
}

/// Sending: with the sender's copies held, exactly two records are being copied (two staging
/// buffers) and nothing is on the socket. Letting one record's copies through puts it on the
/// socket — the receiver copies it into its device memory — while the second record's copy
/// is still held, and the freed buffer already takes the third record's copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sending_overlaps_a_records_socket_write_with_the_next_records_copy() {
    let config = config();
    let (pdev, ddev) = (HostStandIn::new(0), HostStandIn::new(1));
    let prefill = device_node(&config, &pdev, pdev.ops(), 0x11);
    let decode = device_node(&config, &ddev, ddev.ops(), 0xEE);
    let (s, r) = connect(&prefill, &decode).await;
    let src = vec![10u32, 11, 12, 13];
    fill_source(&prefill, 7, &src);
    let before = pdev.stats();
    pdev.hold_copies();
    let verified = r.reserve(
        ReserveParams::new(TransferId(7), 64, Duration::from_secs(10)).into_pages(vec![1, 2, 3, 4]),
    );
    let admitted = s.admit(request(7, 4)).unwrap();
    let sent = tokio::spawn(async move {
        let r = s.send_pages(admitted, src).await;
        (s, r)
    });
    let b = BUFFERS as u64;
    wait_for(&pdev, "two records' copies queued", |x| {
        x.to_host_queued - before.to_host_queued == 2 * b
    })
    .await;
    // No copy completed yet, so nothing may be on its way to the receiver. That no third
    // record's copy is ever queued alongside is checked over the whole run at the end
    // (`max_in_flight`), not by waiting here for something not to happen.
    let held = pdev.stats();
    assert_eq!(held.to_host_done, before.to_host_done, "{held:?}");
    assert_eq!(
        ddev.stats().to_device_queued,
        0,
        "nothing on the socket before a copy completed"
    );

    pdev.allow_copies(b); // record 0's copies
    let landed = wait_for(&ddev, "record 0 landed at the receiver", |x| {
        x.to_device_done >= b
    })
    .await;
    let p = pdev.stats();
    assert_eq!(landed.to_device_done, b, "{landed:?}");
    assert_eq!(
        p.to_host_done - before.to_host_done,
        b,
        "record 1's copy is still held: {p:?}"
    );
    assert_eq!(
        p.to_host_queued - before.to_host_queued,
        3 * b,
        "the freed buffer took record 2's copy while record 1's ran: {p:?}"
    );

    pdev.open_copies();
    let kv = verified.await.unwrap();
    kv.release().unwrap();
    let (_s, r2) = sent.await.unwrap();
    r2.unwrap();
    for (ordinal, page) in [1u32, 2, 3, 4].into_iter().enumerate() {
        assert!(read_page(&decode, page, 1) == kv_bytes(7, ordinal, 1));
    }
    let p = pdev.stats();
    assert_eq!(
        p.max_in_flight,
        2 * b,
        "only two staging buffers: never a third record's copies at once: {p:?}"
    );
}

/// Receiving: with the receiver's copies held, it reads one record into each staging buffer
/// — the second while the first one's copy is in flight — and then stops reading (both
/// buffers busy). Nothing has landed, and the fence waits: the transfer verifies only after
/// the copies went through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiving_reads_the_next_record_while_the_previous_one_is_copied() {
    let config = config();
    let (pdev, ddev) = (HostStandIn::new(0), HostStandIn::new(1));
    let prefill = device_node(&config, &pdev, pdev.ops(), 0x11);
    let decode = device_node(&config, &ddev, ddev.ops(), 0xEE);
    let (s, r) = connect(&prefill, &decode).await;
    let src = vec![0u32, 1, 2, 3, 4];
    fill_source(&prefill, 8, &src);
    ddev.hold_copies();
    let verified = r.reserve(
        ReserveParams::new(TransferId(8), 80, Duration::from_secs(10))
            .into_pages(vec![9, 8, 7, 6, 5]),
    );
    let admitted = s.admit(request(8, 5)).unwrap();
    let sent = tokio::spawn(async move {
        let r = s.send_pages(admitted, src).await;
        (s, r)
    });
    let b = BUFFERS as u64;
    wait_for(&ddev, "two records staged", |x| x.to_device_queued == 2 * b).await;
    // That no third record is read while both buffers are busy is checked over the whole run
    // at the end (`max_in_flight`), not by waiting here for something not to happen.
    let held = ddev.stats();
    assert_eq!(
        held.to_device_queued,
        2 * b,
        "a third record is not read yet: {held:?}"
    );
    assert_eq!(held.to_device_done, 0);
    assert_eq!(
        held.max_in_flight,
        2 * b,
        "both buffers' copies in flight at once: {held:?}"
    );
    let st = r.stats().await.unwrap();
    assert_eq!(
        st.pages_landed, 0,
        "a page lands when its copy completed: {st:?}"
    );
    ddev.open_copies();
    let kv = verified.await.unwrap();
    kv.release().unwrap();
    sent.await.unwrap().1.unwrap();
    let d = ddev.stats();
    assert_eq!(d.digests_racing_copies, 0);
    assert_eq!(
        d.max_in_flight,
        2 * b,
        "a third record is never read while both buffers' copies are in flight: {d:?}"
    );
    for (ordinal, page) in [9u32, 8, 7, 6, 5].into_iter().enumerate() {
        assert!(read_page(&decode, page, 0) == kv_bytes(8, ordinal, 0));
    }
}

/// An abort while a copy into the reservation's pages is in flight (held): the fence waits
/// for the copy, so the pages stay held — not back in the pool, where the engine could reuse
/// them under a running copy — until it completed; then they are released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_mid_pipeline_releases_pages_only_after_the_copies_completed() {
    let config = config();
    let (pdev, ddev) = (HostStandIn::new(0), HostStandIn::new(1));
    let prefill = device_node(&config, &pdev, pdev.ops(), 0x11);
    let decode = device_node(&config, &ddev, ddev.ops(), 0xEE);
    let (s, r) = connect(&prefill, &decode).await;
    let src = vec![0u32, 1, 2, 3];
    fill_source(&prefill, 9, &src);
    ddev.hold_copies();
    let dst = vec![12u32, 13, 14, 15];
    let verified = r.reserve(
        ReserveParams::new(TransferId(9), 64, Duration::from_secs(10)).into_pages(dst.clone()),
    );
    let admitted = s.admit(request(9, 4)).unwrap();
    let sent = tokio::spawn(async move {
        let r = s.send_pages(admitted, src).await;
        (s, r)
    });
    let b = BUFFERS as u64;
    wait_for(&ddev, "copies into the pages in flight", |x| {
        x.to_device_queued >= b
    })
    .await;
    r.abort(TransferId(9), ErrorCode::CANCELLED);
    // Handled once the connection's task answered this (its commands run in order); the
    // copies are held at the gate, so the pages must be held now.
    r.stats().await.unwrap();
    for &p in &dst {
        assert!(
            !decode.pool().holders(p).is_empty(),
            "page {p} released while a copy into it is in flight: {:?}",
            ddev.stats()
        );
    }
    assert!(ddev.stats().to_device_done < ddev.stats().to_device_queued);
    ddev.open_copies();
    let out = verified.await;
    assert!(matches!(out, Err(TransferError::Failed(_))), "{out:?}");
    let start = Instant::now();
    while !decode.pool().held_pages().is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            decode.pool().held_pages()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let d = ddev.stats();
    assert_eq!(
        d.to_device_done, d.to_device_queued,
        "released after every copy completed: {d:?}"
    );
    let _ = sent.await.unwrap();
}

/// A node with buffer 0 in host memory and buffer 1 in device memory (mixed), host bytes
/// `fill`. The host buffer is leaked: it must outlive every connection task.
fn mixed_node(config: &NodeConfig, dev: &HostStandIn, fill: u8) -> Node {
    let len = config.pool.buffer_len(0).unwrap();
    let host: &'static mut [u8] = Box::leak(vec![fill; len].into_boxed_slice());
    let buffers = vec![
        KvBuffer::Host {
            ptr: std::ptr::NonNull::new(host.as_mut_ptr()).unwrap(),
            len,
        },
        KvBuffer::Device {
            ptr: dev.alloc(config.pool.buffer_len(1).unwrap(), fill),
            len: config.pool.buffer_len(1).unwrap(),
        },
    ];
    // SAFETY: a leaked host allocation and a stand-in device allocation of exactly these
    // lengths, alive for the process / as long as the stand-in; the test writes no page
    // kvwire holds.
    let memory =
        unsafe { KvMemory::from_buffers_in(&config.pool, buffers, Some(dev.ops())) }.unwrap();
    assert_eq!(memory.kind(0), Some(MemoryKind::Host));
    assert_eq!(memory.kind(1), Some(MemoryKind::Device { ordinal: 3 }));
    Node::with_memory(config.clone(), memory).unwrap()
}

/// The other ways in: a mixed memory (host buffer 0, device buffer 1) receiving from a
/// device sender; a send whose KV is copied in by a fill closure (through a host buffer into
/// the device pages); a transfer sent in chunks (its digests streamed from the device's page
/// digests chunk by chunk); pages poisoned on release through the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_memory_fill_copies_chunks_and_device_scrub() {
    let mut config = config();
    config.scrub = kvwire::memory::Scrub::Poison;
    let (pdev, ddev) = (HostStandIn::new(0), HostStandIn::new(3));
    let prefill = device_node(&config, &pdev, pdev.ops(), 0x11);
    let decode = mixed_node(&config, &ddev, 0xEE);
    let (s, r) = connect(&prefill, &decode).await;

    // A fill-copy send: kvwire allocates the source pages and the closure writes the KV.
    let verified = r.reserve(
        ReserveParams::new(TransferId(20), 48, Duration::from_secs(10)).into_pages(vec![1, 2, 3]),
    );
    let admitted = s.admit(request(20, 3)).unwrap();
    s.send(admitted, |ordinal, b, page: &mut [u8]| {
        page.copy_from_slice(&kv_bytes(20, ordinal as usize, b))
    })
    .await
    .unwrap();
    let kv = verified.await.unwrap();
    assert!(
        kv.page(0, 0).is_ok(),
        "the host buffer is readable in place"
    );
    assert!(kv.page(0, 1).is_err(), "the device buffer is not");
    // Read before the release (which poisons them).
    for (ordinal, page) in [1u32, 2, 3].into_iter().enumerate() {
        for b in 0..BUFFERS {
            assert!(
                read_page(&decode, page, b) == kv_bytes(20, ordinal, b),
                "page {page} buffer {b}"
            );
        }
    }
    kv.release().unwrap();
    for b in 0..BUFFERS {
        assert!(
            read_page(&decode, 1, b)
                .iter()
                .all(|&x| x == kvwire::memory::POISON_BYTE),
            "released page 1 of buffer {b} (host, then device) is poisoned"
        );
    }

    // A chunked send from the engine's own device pages.
    let src = vec![7u32, 8, 9, 10, 11];
    fill_source(&prefill, 21, &src);
    let dst = vec![30u32, 29, 28, 27, 26];
    let verified = r.reserve(
        ReserveParams::new(TransferId(21), 80, Duration::from_secs(10))
            .into_pages(dst.clone())
            .with_page_digests(),
    );
    let out = s.open(s.admit(request(21, 5)).unwrap());
    out.send_chunk(src[..2].to_vec(), None).await.unwrap();
    out.send_chunk(src[2..4].to_vec(), None).await.unwrap();
    out.send_chunk(src[4..].to_vec(), Some(b"first token".to_vec()))
        .await
        .unwrap();
    out.outcome().await.unwrap();
    let kv = verified.await.unwrap();
    assert_eq!(kv.aux(), b"first token");
    for (ordinal, &page) in dst.iter().enumerate() {
        for b in 0..BUFFERS {
            assert!(
                read_page(&decode, page, b) == kv_bytes(21, ordinal, b),
                "page {page} buffer {b}"
            );
        }
    }
    kv.release().unwrap();

    // Scrub-on-release reached the device: the prefill's fill-copy source pages (released
    // after the transfer) are poisoned in device memory.
    assert!(pdev.stats().fills > 0, "{:?}", pdev.stats());
    let poisoned = (0..PAGES).any(|p| {
        read_page(&prefill, p, 1)
            .iter()
            .all(|&x| x == kvwire::memory::POISON_BYTE)
    });
    assert!(poisoned, "no source page was scrubbed through the device");
    assert_eq!(ddev.stats().digests_racing_copies, 0);
}

/// The sender's side of an abort mid-pipeline: the prefill engine aborts while copies out of
/// its source pages into staging are held. Its source pages stay held (the engine must not
/// reuse them under a running copy) until the copies completed, then go back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_abort_mid_pipeline_keeps_source_pages_until_the_copies_completed() {
    let config = config();
    let (pdev, ddev) = (HostStandIn::new(0), HostStandIn::new(1));
    let prefill = device_node(&config, &pdev, pdev.ops(), 0x11);
    let decode = device_node(&config, &ddev, ddev.ops(), 0xEE);
    let (s, r) = connect(&prefill, &decode).await;
    let src = vec![20u32, 21, 22, 23];
    fill_source(&prefill, 10, &src);
    let before = pdev.stats();
    pdev.hold_copies();
    let verified = r.reserve(
        ReserveParams::new(TransferId(10), 64, Duration::from_secs(10))
            .into_pages(vec![0, 1, 2, 3]),
    );
    let admitted = s.admit(request(10, 4)).unwrap();
    let s = Arc::new(s);
    let sender = s.clone();
    let sent = tokio::spawn(async move { sender.send_pages(admitted, src).await });
    let b = BUFFERS as u64;
    wait_for(&pdev, "copies out of the source pages in flight", |x| {
        x.to_host_queued - before.to_host_queued >= 2 * b
    })
    .await;
    s.abort(TransferId(10), ErrorCode::CANCELLED);
    // The connection's task runs its commands in order: once it answered this, it has
    // handled the abort. The copies are held at the gate, so no amount of waiting could
    // complete them: the source pages must be held now.
    s.stats().await.unwrap();
    for p in [20u32, 21] {
        assert!(
            !prefill.pool().holders(p).is_empty(),
            "source page {p} released while a copy out of it is in flight: {:?}",
            pdev.stats()
        );
    }
    pdev.open_copies();
    assert!(sent.await.unwrap().is_err(), "the aborted send fails");
    assert!(verified.await.is_err(), "and so does the reservation");
    let start = Instant::now();
    while !prefill.pool().held_pages().is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            prefill.pool().held_pages()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let p = pdev.stats();
    assert_eq!(p.to_host_done, p.to_host_queued, "{p:?}");
}

/// A transfer of 8 MiB (64 pages of 2 x 64 KiB), above the digest offload threshold set here
/// (1 MiB), so both sides' digest jobs are handed to tokio's blocking pool: they still digest
/// in device memory, and the transfer verifies byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_transfer_verifies_with_digest_jobs_on_the_blocking_pool() {
    let mut config = NodeConfig::example();
    config.digest_offload_bytes = Some(1 << 20);
    config.pool.pages = 80;
    config.pool.buffer_page_bytes = vec![64 << 10; BUFFERS];
    config.engine.max_context_tokens = 80 * u64::from(config.pool.tokens_per_page);
    let (pdev, ddev) = (HostStandIn::new(0), HostStandIn::new(1));
    let prefill = device_node(&config, &pdev, pdev.ops(), 0x11);
    let decode = device_node(&config, &ddev, ddev.ops(), 0xEE);
    let (s, r) = connect(&prefill, &decode).await;
    let page = |id: usize, ordinal: usize, b: usize| -> Vec<u8> {
        (0..64usize << 10)
            .map(|i| (id * 31 + ordinal * 7 + b * 3 + i / 5) as u8)
            .collect()
    };
    let src: Vec<u32> = (0..64).map(|i| (i * 7) % 80).collect();
    let dst: Vec<u32> = (0..64).map(|i| 79 - i).collect();
    for (ordinal, &p) in src.iter().enumerate() {
        for b in 0..BUFFERS {
            prefill
                .pool()
                .engine_write(p, b, &page(11, ordinal, b))
                .unwrap();
        }
    }
    let verified = r.reserve(
        ReserveParams::new(TransferId(11), 64 * 16, Duration::from_secs(30))
            .into_pages(dst.clone()),
    );
    let admitted = s.admit(request(11, 64)).unwrap();
    s.send_pages(admitted, src).await.unwrap();
    let kv = verified.await.unwrap();
    let mut got = vec![0u8; 64 << 10];
    for (ordinal, &p) in dst.iter().enumerate() {
        for b in 0..BUFFERS {
            decode.pool().engine_read(p, b, &mut got).unwrap();
            assert!(got == page(11, ordinal, b), "page {p} buffer {b}");
        }
    }
    kv.release().unwrap();
    let d = ddev.stats();
    assert_eq!(d.pages_digested, 64, "{d:?}");
    assert_eq!(d.digests_racing_copies, 0);
}
