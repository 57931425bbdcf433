//! The engine's own KV memory: registered once per node, destination pages the decode engine
//! chooses, source pages the prefill engine sends in place, several peers over one
//! registration. Every landed byte is read back from the engine's memory itself, not
//! through kvwire.

use std::ptr::NonNull;
use std::time::Duration;

use kvwire::memory::{Holder, KvMemory};
use kvwire::proto::admission::Request;
use kvwire::{
    Node, NodeConfig, PoolError, ReceiveError, ReceiverConn, ReserveParams, SenderConn,
    TransferError, TransferId,
};
use tokio::net::TcpListener;

/// An engine's KV cache: one allocation per buffer that the engine reads and writes through
/// its own pointers. Leaked on purpose: connection tasks may outlive a test's body, and the
/// memory must outlive every registration of it.
#[derive(Clone, Copy)]
struct EngineKv {
    buffers: [(NonNull<u8>, usize); 2],
    page_bytes: usize,
}

// SAFETY: the test engine hands the pointers to its own tasks only; it follows kvwire's
// contract (it writes no page kvwire holds).
unsafe impl Send for EngineKv {}

impl EngineKv {
    fn new(config: &NodeConfig) -> Self {
        let page_bytes = config.pool.buffer_page_bytes[0] as usize;
        let len = config.pool.buffer_len(0).unwrap();
        let alloc = |fill| {
            let b: &'static mut [u8] = Box::leak(vec![fill; len].into_boxed_slice());
            (NonNull::new(b.as_mut_ptr()).unwrap(), len)
        };
        Self {
            buffers: [alloc(0xAA), alloc(0xBB)],
            page_bytes,
        }
    }

    fn register(&self, config: &NodeConfig) -> Node {
        // SAFETY: the buffers live for the whole process (leaked), do not overlap, and the
        // test engine writes only pages kvwire does not hold.
        let memory = unsafe { KvMemory::from_raw_parts(&config.pool, self.buffers.to_vec()) };
        Node::with_memory(config.clone(), memory.unwrap()).unwrap()
    }

    /// The engine writes its KV for `id` into `page` (a page it owns: kvwire holds none).
    fn write(&self, page: u32, id: TransferId, ordinal: u32) {
        for (b, &(ptr, _)) in self.buffers.iter().enumerate() {
            let bytes = kv_bytes(id, ordinal, b, self.page_bytes);
            // SAFETY: in bounds of a live buffer; kvwire holds no lease on this page.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    ptr.as_ptr().add(page as usize * self.page_bytes),
                    self.page_bytes,
                )
            };
        }
    }

    /// The engine reads `page` of `buffer` (allowed at any time).
    fn read(&self, page: u32, buffer: usize) -> Vec<u8> {
        let (ptr, _) = self.buffers[buffer];
        let mut out = vec![0u8; self.page_bytes];
        // SAFETY: in bounds of a live buffer; the engine may read any page.
        unsafe {
            std::ptr::copy_nonoverlapping(
                ptr.as_ptr().add(page as usize * self.page_bytes),
                out.as_mut_ptr(),
                self.page_bytes,
            )
        };
        out
    }
}

fn kv_bytes(id: TransferId, ordinal: u32, buffer: usize, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (id.get() as usize * 131 + ordinal as usize * 17 + buffer * 7 + i / 3) as u8)
        .collect()
}

fn config() -> NodeConfig {
    let mut c = NodeConfig::example();
    c.pool.pages = 64;
    c.engine.max_context_tokens = 1024;
    c
}

async fn connect(prefill: &Node, decode: &Node) -> (SenderConn, ReceiverConn) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let d = decode.clone();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &d).await });
    let s = SenderConn::connect(addr, prefill).await.unwrap();
    (s, accept.await.unwrap().unwrap())
}

/// Two prefill engines, each with its own registration, send from their own pages (in
/// place) into one decode registration, at pages the decode engine's allocator chose
/// (scattered, interleaved between the two peers). Every landed byte is read back from the
/// decode engine's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_prefill_peers_land_exactly_at_the_decode_engines_pages() {
    let config = config();
    let decode_kv = EngineKv::new(&config);
    let decode = decode_kv.register(&config);
    let prefill_kv = [EngineKv::new(&config), EngineKv::new(&config)];
    let prefill = [
        prefill_kv[0].register(&config),
        prefill_kv[1].register(&config),
    ];
    let conns = [
        connect(&prefill[0], &decode).await,
        connect(&prefill[1], &decode).await,
    ];
    // The decode allocator's choice: pages from the top, the two peers interleaved.
    let dst: [Vec<u32>; 2] = [vec![63, 40, 7, 22], vec![41, 5, 62, 23]];
    // Each prefill engine's own source pages (ids 1 and 2 on different peers).
    let src: [Vec<u32>; 2] = [vec![3, 9, 1, 30], vec![30, 0, 12, 11]];
    let mut waits = Vec::new();
    for peer in 0..2 {
        let id = TransferId(1 + peer as u64);
        let (s, r) = &conns[peer];
        let params =
            ReserveParams::new(id, 64, Duration::from_secs(10)).into_pages(dst[peer].clone());
        let verified = r.reserve(params);
        for (ordinal, &p) in src[peer].iter().enumerate() {
            prefill_kv[peer].write(p, id, ordinal as u32);
        }
        let admitted = s
            .admit(Request {
                transfer_id: id,
                tokens: 64,
            })
            .unwrap();
        let sent = s.send_pages(admitted, src[peer].clone());
        waits.push((id, peer, verified, sent));
    }
    for (id, peer, verified, sent) in waits {
        sent.await.unwrap();
        let kv = verified.await.unwrap();
        assert_eq!(kv.page_indices(), dst[peer]);
        // While the engine holds the verified handle, kvwire still holds the pages for it.
        assert_eq!(
            decode.pool().holders(dst[peer][0]),
            vec![Holder::Receiving(id)]
        );
        kv.release().unwrap();
        for (ordinal, &page) in dst[peer].iter().enumerate() {
            for b in 0..2 {
                assert!(
                    decode_kv.read(page, b)
                        == kv_bytes(id, ordinal as u32, b, decode_kv.page_bytes),
                    "transfer {id}: page {page} buffer {b} is not ordinal {ordinal}"
                );
            }
        }
    }
    // Nothing else in the decode memory was touched: every other page still holds the
    // engine's initial bytes.
    let written: Vec<u32> = dst.concat();
    for page in (0..64).filter(|p| !written.contains(p)) {
        assert!(
            decode_kv.read(page, 0).iter().all(|&x| x == 0xAA),
            "page {page} touched"
        );
        assert!(
            decode_kv.read(page, 1).iter().all(|&x| x == 0xBB),
            "page {page} touched"
        );
    }
    for node in [&decode, &prefill[0], &prefill[1]] {
        assert!(
            node.pool().held_pages().is_empty(),
            "{:?}",
            node.pool().held_pages()
        );
    }
}

/// A page already held (by a reservation on another connection of the same node) is never
/// leased twice: the second reservation is refused naming the holder, and leases nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_leased_twice_is_refused_across_connections() {
    let config = config();
    let decode = Node::new(config.clone()).unwrap();
    let a = connect(&Node::new(config.clone()).unwrap(), &decode).await;
    let b = connect(&Node::new(config.clone()).unwrap(), &decode).await;
    let first = a.1.reserve(
        ReserveParams::new(TransferId(1), 32, Duration::from_secs(10)).into_pages(vec![10, 11]),
    );
    // The first reservation holds page 11 before the second asks for it.
    let start = std::time::Instant::now();
    while decode.pool().holders(11).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "page 11 never leased"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let second =
        b.1.reserve(
            ReserveParams::new(TransferId(2), 32, Duration::from_secs(10)).into_pages(vec![12, 11]),
        )
        .await;
    match second {
        Err(TransferError::Reserve(ReceiveError::Pool(PoolError::AlreadyLeased {
            page,
            holders,
        }))) => {
            assert_eq!(page, 11);
            assert_eq!(holders, vec![Holder::Receiving(TransferId(1))]);
        }
        other => panic!("expected AlreadyLeased, got {other:?}"),
    }
    assert!(
        decode.pool().holders(12).is_empty(),
        "a refused reservation leased page 12"
    );
    // The engine may not free a page kvwire holds.
    assert!(matches!(
        decode.pool().check_engine_free(&[10]),
        Err(PoolError::HeldByKvwire { page: 10, .. })
    ));
    let admitted =
        a.0.admit(Request {
            transfer_id: TransferId(1),
            tokens: 32,
        })
        .unwrap();
    a.0.send(admitted, |_, _, p| p.fill(1)).await.unwrap();
    first.await.unwrap().release().unwrap();
    assert!(decode.pool().check_engine_free(&[10, 11, 12]).is_ok());
}

/// A batch of transfers from the engine's pages in one message, with one request rejected at
/// admission (in the caller's thread, no round trip) and the same source page shared by two
/// transfers at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_sends_in_place_and_a_shared_page_serves_two_transfers() {
    let config = config();
    let prefill_kv = EngineKv::new(&config);
    let prefill = prefill_kv.register(&config);
    let decode = Node::new(config.clone()).unwrap();
    let (s, r) = connect(&prefill, &decode).await;
    // A request longer than the context is rejected at once; its reservation gets REJECT.
    let too_long = s.admit(Request {
        transfer_id: TransferId(9),
        tokens: 5000,
    });
    assert!(matches!(too_long, Err(TransferError::Rejected(_))));
    let rejected = r.reserve(ReserveParams::new(
        TransferId(9),
        16,
        Duration::from_secs(10),
    ));
    // Page 5 is the shared prefix of transfers 1 and 2.
    let sources = [vec![5, 6], vec![5, 7]];
    for (i, pages) in sources.iter().enumerate() {
        for (ordinal, &p) in pages.iter().enumerate() {
            if p != 5 || i == 0 {
                prefill_kv.write(p, TransferId(1 + i as u64), ordinal as u32);
            }
        }
    }
    let waits: Vec<_> = (1..=2)
        .map(|id| {
            r.reserve(ReserveParams::new(
                TransferId(id),
                32,
                Duration::from_secs(10),
            ))
        })
        .collect();
    let batch = (1..=2u64)
        .map(|id| {
            let a = s
                .admit(Request {
                    transfer_id: TransferId(id),
                    tokens: 32,
                })
                .unwrap();
            (a, sources[id as usize - 1].clone())
        })
        .collect();
    for sent in s.send_batch(batch) {
        sent.await.unwrap();
    }
    for (i, w) in waits.into_iter().enumerate() {
        let kv = w.await.unwrap();
        // Ordinal 0 of both is page 5, written for transfer 1.
        assert_eq!(
            *kv.page(0, 0).unwrap(),
            kv_bytes(TransferId(1), 0, 0, prefill_kv.page_bytes)[..]
        );
        assert_eq!(
            *kv.page(1, 1).unwrap(),
            kv_bytes(TransferId(1 + i as u64), 1, 1, prefill_kv.page_bytes)[..]
        );
        kv.release().unwrap();
    }
    match rejected.await {
        Err(TransferError::Failed(reason)) => {
            assert_eq!(
                reason.code(),
                kvwire::ErrorCode::PROMPT_EXCEEDS_CONTEXT,
                "{reason}"
            )
        }
        other => panic!("expected the admission error, got {other:?}"),
    }
    assert!(prefill.pool().held_pages().is_empty());
}

/// Chunked prefill: the prefill engine computes a request's KV in three chunks and sends
/// each as it is ready, the final one with an auxiliary record; the decode engine receives
/// it at its own pages and reads the aux record with the verified KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_chunk_transfer_with_an_aux_record_lands_at_the_engines_pages() {
    let config = config();
    let prefill_kv = EngineKv::new(&config);
    let prefill = prefill_kv.register(&config);
    let decode_kv = EngineKv::new(&config);
    let decode = decode_kv.register(&config);
    let (s, r) = connect(&prefill, &decode).await;
    let id = TransferId(31);
    let dst = vec![50, 2, 33, 17, 8, 61, 40];
    let src = [vec![4, 5], vec![20, 21, 22], vec![1, 60]];
    let verified = r.reserve(
        ReserveParams::new(id, 7 * 16, Duration::from_secs(10))
            .into_pages(dst.clone())
            .with_page_digests(),
    );
    let admitted = s
        .admit(Request {
            transfer_id: id,
            tokens: 7 * 16,
        })
        .unwrap();
    let tx = s.open(admitted);
    let mut ordinal = 0u32;
    for (i, chunk) in src.iter().enumerate() {
        // The prefill computes this chunk's KV into its own pages...
        for &p in chunk {
            prefill_kv.write(p, id, ordinal);
            ordinal += 1;
        }
        // ...and sends it while it computes the next.
        let aux = (i == 2).then(|| b"first token 42".to_vec());
        tx.send_chunk(chunk.clone(), aux).await.unwrap();
    }
    // A chunk after the final one is refused; the transfer is unaffected.
    let late = tx.send_chunk(vec![7], None).await;
    assert!(matches!(late, Err(TransferError::Chunk(_))), "{late:?}");
    tx.outcome().await.unwrap();
    let kv = verified.await.unwrap();
    assert_eq!(kv.aux(), b"first token 42");
    assert_eq!(kv.page_indices(), dst);
    kv.release().unwrap();
    for (o, &p) in dst.iter().enumerate() {
        for b in 0..2 {
            assert!(
                decode_kv.read(p, b) == kv_bytes(id, o as u32, b, decode_kv.page_bytes),
                "page {p} buffer {b} is not ordinal {o}"
            );
        }
    }
    assert!(prefill.pool().held_pages().is_empty());
}

/// SPEC §12 Q9 at the engine: the decode engine aborts a reservation the prefill has not
/// submitted yet; the later submit fails at once with the abort's reason, and nothing is
/// written into the decode engine's pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_abort_before_the_prefill_submits_fails_the_late_submit_at_once() {
    let config = config();
    let decode_kv = EngineKv::new(&config);
    let decode = decode_kv.register(&config);
    let prefill = Node::new(config.clone()).unwrap();
    let (s, r) = connect(&prefill, &decode).await;
    let id = TransferId(41);
    let reserved =
        r.reserve(ReserveParams::new(id, 32, Duration::from_secs(10)).into_pages(vec![12, 13]));
    // The RESERVE goes out before the ABORT on the one ordered connection.
    r.abort(id, kvwire::ErrorCode::CANCELLED);
    assert!(reserved.await.is_err());
    // The decode's transfer stays open until the prefill's ABORT_ACK: once it is closed the
    // prefill has handled the abort.
    let start = std::time::Instant::now();
    while r.stats().await.unwrap().open_transfers > 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "no ABORT_ACK");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let admitted = s
        .admit(Request {
            transfer_id: id,
            tokens: 32,
        })
        .unwrap();
    let started = std::time::Instant::now();
    let sent = s.send_pages(admitted, vec![0, 1]).await;
    // The same shape as the peer's abort of an open transfer (one shape for a peer's abort).
    match &sent {
        Err(TransferError::Failed(kvwire::FailureReason::PeerAbort {
            code,
            completed_pages: 0,
        })) => assert_eq!(*code, kvwire::ErrorCode::CANCELLED),
        other => panic!("expected the peer's abort, got {other:?}"),
    }
    // At once, not at the sender's 30 s reservation deadline: the reason is the decode's
    // abort (above), which no deadline gives.
    println!("the late submit failed after {:?}", started.elapsed());
    let st = s.stats().await.unwrap();
    assert_eq!(
        st.writes, 0,
        "a write was posted for an aborted reservation"
    );
    for p in [12, 13] {
        assert!(
            decode_kv.read(p, 0).iter().all(|&x| x == 0xAA),
            "page {p} written"
        );
    }
}

/// `OutgoingTransfer::take_outcome`: the outcome can be awaited elsewhere while chunks still
/// go through the handle, and a decode abort after the first chunk resolves it at once,
/// before the prefill sends its final chunk; a second take (and `outcome`) is
/// `ConnectionClosed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_outcome_sees_a_decode_abort_before_the_final_chunk() {
    let config = config();
    let decode_kv = EngineKv::new(&config);
    let decode = decode_kv.register(&config);
    let prefill_kv = EngineKv::new(&config);
    let prefill = prefill_kv.register(&config);
    let (s, r) = connect(&prefill, &decode).await;
    let id = TransferId(51);
    let reserved = r
        .reserve(ReserveParams::new(id, 64, Duration::from_secs(10)).into_pages(vec![3, 9, 27, 5]));
    let admitted = s
        .admit(Request {
            transfer_id: id,
            tokens: 64,
        })
        .unwrap();
    let mut tx = s.open(admitted);
    let outcome = tokio::spawn(tx.take_outcome());
    for (o, p) in [1u32, 2].into_iter().enumerate() {
        prefill_kv.write(p, id, o as u32);
    }
    tx.send_chunk(vec![1, 2], None).await.unwrap();
    // The first chunk landed at the decode before it aborts.
    let start = std::time::Instant::now();
    while r.stats().await.unwrap().pages_landed < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the first chunk never landed"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    r.abort(id, kvwire::ErrorCode::CANCELLED);
    assert!(reserved.await.is_err());
    let got = tokio::time::timeout(Duration::from_secs(5), outcome)
        .await
        .expect("the taken outcome resolves before the final chunk")
        .unwrap();
    match &got {
        Err(TransferError::Failed(kvwire::FailureReason::PeerAbort { code, .. })) => {
            assert_eq!(*code, kvwire::ErrorCode::CANCELLED)
        }
        other => panic!("expected the decode's abort, got {other:?}"),
    }
    assert!(matches!(
        tx.take_outcome().await,
        Err(TransferError::ConnectionClosed)
    ));
    assert!(matches!(
        tx.outcome().await,
        Err(TransferError::ConnectionClosed)
    ));
}

/// The seed incident at the engine API: a prompt longer than the decode node's context (though
/// its pool could hold it, and the prefill, serving a longer context, admitted it) is refused by
/// the decode's reserve before anything is leased, and the prefill's transfer fails at once
/// with PROMPT_EXCEEDS_CONTEXT: no page is written on either side. (The chaos cluster found
/// this check only in the poll-style facade, scripts/cluster/run.py.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_over_the_decodes_context_is_refused_at_reserve_and_the_prefill_told() {
    let config = NodeConfig::example();
    let mut short = config.clone();
    short.engine.max_context_tokens = 1024;
    let prefill = Node::new(config.clone()).unwrap();
    let decode = Node::new(short).unwrap();
    let (s, r) = connect(&prefill, &decode).await;
    let id = TransferId(77);
    let tokens = 2000; // 125 pages: the decode's pool (256) holds them, its context does not
    let admitted = s
        .admit(Request {
            transfer_id: id,
            tokens: tokens.into(),
        })
        .unwrap();
    let sent = s.send(admitted, |_, _, page| page.fill(0xAB));
    let refused = r
        .reserve(ReserveParams::new(id, tokens, Duration::from_secs(10)))
        .await;
    assert!(
        matches!(
            refused,
            Err(TransferError::Reserve(ReceiveError::ExceedsContext {
                tokens: 2000,
                context: 1024
            }))
        ),
        "{refused:?}"
    );
    let e = sent.await.unwrap_err();
    assert!(
        matches!(
            e,
            TransferError::Failed(kvwire::FailureReason::PeerAbort { code, .. })
                if code == kvwire::ErrorCode::PROMPT_EXCEEDS_CONTEXT
        ),
        "{e:?}"
    );
    assert!(decode.pool().held_pages().is_empty());
    assert_eq!(decode.pool().free_pages(), 256);
    assert!(prefill.pool().held_pages().is_empty());
}
