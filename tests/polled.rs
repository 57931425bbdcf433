//! The poll-style facade (`kvwire::polled`) end to end over TCP loopback, from plain threads
//! (no async anywhere in the test): a chunked transfer into the decode engine's chosen,
//! scattered pages with every byte read back from the engine's own memory, a rejection
//! reaching both sides as Failed with the original reason, aborts from either side, and
//! the configuration checks at start.

use std::time::Duration;

use kvwire::polled::{ErrorKind, KvBuffer, KvPoll, Manager, ManagerConfig, Role};
use kvwire::{Auth, ErrorCode, TransferId};

const PAGES: usize = 64;
const PAGE_BYTES: usize = 4096;
const TPP: u32 = 16;
const WAIT: Duration = Duration::from_secs(20);

/// An engine's KV cache: two buffers it reads and writes through its own pointers. Leaked:
/// the memory must outlive the manager, as an engine's cache does.
#[derive(Clone, Copy)]
struct Cache {
    bufs: [*mut u8; 2],
}

impl Cache {
    fn new(fill: [u8; 2]) -> Self {
        let alloc = |f| Box::leak(vec![f; PAGES * PAGE_BYTES].into_boxed_slice()).as_mut_ptr();
        Self {
            bufs: [alloc(fill[0]), alloc(fill[1])],
        }
    }

    fn buffers(&self) -> Vec<KvBuffer> {
        self.bufs
            .iter()
            .map(|&ptr| KvBuffer {
                ptr,
                len: PAGES * PAGE_BYTES,
                page_bytes: PAGE_BYTES,
            })
            .collect()
    }

    fn page(&self, buffer: usize, page: u32) -> &'static mut [u8] {
        // SAFETY: in bounds of a leaked buffer; the tests write only pages kvwire does not
        // hold, and read any page (allowed by the engine contract).
        unsafe {
            std::slice::from_raw_parts_mut(
                self.bufs[buffer].add(page as usize * PAGE_BYTES),
                PAGE_BYTES,
            )
        }
    }
}

/// Polls a prefill transfer until it left Bootstrapping (its decode's reservation arrived).
fn opened(tx: &kvwire::polled::SenderTransfer) -> KvPoll {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let s = tx.poll();
        if s != KvPoll::Bootstrapping || std::time::Instant::now() >= deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn kv(room: u64, ordinal: usize, buffer: usize) -> Vec<u8> {
    (0..PAGE_BYTES)
        .map(|i| (room as usize * 31 + ordinal * 17 + buffer * 7 + i / 5) as u8)
        .collect()
}

fn manager(role: Role, cache: &Cache, context: u64, auth: &Auth) -> Manager {
    let config = ManagerConfig::new(role, TPP, context, auth.clone()).fingerprint("polled/tp0");
    // SAFETY: the buffers are leaked (live for the process) and do not overlap.
    unsafe { Manager::new(config, &cache.buffers()) }.unwrap()
}

/// A decode and a prefill manager over their own caches, connected (prefill connects).
fn pair(prefill_context: u64) -> (Manager, Cache, Manager, Cache) {
    let auth = Auth::ephemeral();
    let (dc, pc) = (Cache::new([0xAA, 0xBB]), Cache::new([0, 0]));
    let decode = manager(Role::Decode, &dc, 1024, &auth);
    let prefill = manager(Role::Prefill, &pc, prefill_context, &auth);
    let addr = decode.listen("127.0.0.1:0").unwrap();
    let peer = prefill.connect(&addr.to_string()).unwrap();
    assert_eq!(peer, decode.node_id());
    decode.wait_for_peers(1, WAIT).unwrap();
    (decode, dc, prefill, pc)
}

#[test]
fn a_chunked_transfer_lands_in_the_chosen_pages_with_its_aux_record() {
    let (decode, dc, prefill, pc) = pair(1024);
    let room = TransferId(7);
    // 70 tokens = 5 pages: the decode engine's scattered choice, the prefill's own pages.
    let dst = vec![50, 3, 41, 17, 8];
    let src = [9u32, 10, 2, 33, 60];
    for (o, &p) in src.iter().enumerate() {
        for b in 0..2 {
            pc.page(b, p).copy_from_slice(&kv(room.get(), o, b));
        }
    }
    let rx = decode.receiver(room, None).unwrap();
    assert_eq!(rx.poll(), KvPoll::Bootstrapping);
    rx.init(dst.clone(), 70, WAIT).unwrap();
    assert_eq!(rx.poll(), KvPoll::WaitingForInput);
    assert!(matches!(rx.page_indices(), Err(e) if e.kind() == ErrorKind::InvalidState));

    let tx = prefill.sender(room, None).unwrap();
    tx.init(5, 70).unwrap();
    // Open once the decode's reservation reached the prefill.
    assert_eq!(opened(&tx), KvPoll::WaitingForInput);
    // The aux record goes with the final chunk only; a refused chunk changes nothing.
    let early = tx.send(&src[..3], Some(b"x")).unwrap_err();
    assert_eq!(early.kind(), ErrorKind::InvalidArgument);
    tx.send(&src[..3], None).unwrap();
    assert_eq!(tx.poll(), KvPoll::WaitingForInput);
    tx.send(&src[3..], Some(b"first-token:4242")).unwrap();
    assert_ne!(tx.poll(), KvPoll::WaitingForInput);

    assert_eq!(rx.wait(WAIT), KvPoll::Success, "{:?}", rx.failure());
    assert_eq!(tx.wait(WAIT), KvPoll::Success, "{:?}", tx.failure());
    assert!(rx.failure().is_none() && tx.failure().is_none());
    assert_eq!(rx.page_indices().unwrap(), dst);
    assert_eq!(rx.aux().unwrap(), b"first-token:4242");
    // kvwire holds the pages for the engine until released.
    assert!(decode.node().pool().check_engine_free(&dst).is_err());
    rx.release().unwrap();
    assert!(decode.node().pool().check_engine_free(&dst).is_ok());
    tx.clear().unwrap();
    assert!(prefill.node().pool().held_pages().is_empty());
    // Every byte, read from the decode engine's own memory; nothing else touched.
    for (o, &p) in dst.iter().enumerate() {
        for b in 0..2 {
            assert!(
                dc.page(b, p) == &kv(room.get(), o, b)[..],
                "page {p} buffer {b} is not ordinal {o}"
            );
        }
    }
    for p in (0..PAGES as u32).filter(|p| !dst.contains(p)) {
        assert!(dc.page(0, p).iter().all(|&x| x == 0xAA), "page {p} touched");
        assert!(dc.page(1, p).iter().all(|&x| x == 0xBB), "page {p} touched");
    }
    // Released twice: nothing happens.
    rx.release().unwrap();
}

#[test]
fn a_rejection_reaches_both_sides_as_failed_with_the_original_reason() {
    // The prefill serves 512-token contexts; the decode reserves 600 tokens.
    let (decode, _, prefill, _) = pair(512);
    let room = TransferId(9);
    let dst: Vec<u32> = (10..48).collect(); // 38 pages
    let rx = decode.receiver(room, None).unwrap();
    rx.init(dst.clone(), 600, WAIT).unwrap();
    let tx = prefill.sender(room, None).unwrap();
    tx.init(38, 600).unwrap();
    assert_eq!(tx.poll(), KvPoll::Failed);
    let e = tx.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::Rejected, "{e}");
    assert_eq!(e.wire_code(), Some(ErrorCode::PROMPT_EXCEEDS_CONTEXT));
    assert!(!e.is_retryable());
    assert_eq!(tx.send(&[1], None).unwrap_err().kind(), ErrorKind::Rejected);

    assert_eq!(rx.wait(WAIT), KvPoll::Failed);
    let e = rx.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::Rejected, "{e}");
    assert_eq!(e.wire_code(), Some(ErrorCode::PROMPT_EXCEEDS_CONTEXT));
    assert!(!e.is_retryable());
    rx.release().unwrap();
    assert!(decode.node().pool().check_engine_free(&dst).is_ok());
    tx.clear().unwrap();
}

#[test]
fn the_decode_side_aborts_and_both_sides_fail() {
    let (decode, _, prefill, _) = pair(1024);
    let room = TransferId(11);
    let dst = vec![5, 6, 7, 8];
    let rx = decode.receiver(room, None).unwrap();
    rx.init(dst.clone(), 64, WAIT).unwrap();
    let tx = prefill.sender(room, None).unwrap();
    tx.init(4, 64).unwrap();
    tx.send(&[1, 2], None).unwrap();
    rx.abort();
    assert_eq!(rx.poll(), KvPoll::Failed);
    assert_eq!(rx.failure().unwrap().kind(), ErrorKind::Aborted);
    // release returns only once the reservation is fenced and its pages are free.
    rx.release().unwrap();
    assert!(decode.node().pool().check_engine_free(&dst).is_ok());
    assert_eq!(tx.wait(WAIT), KvPoll::Failed);
    let e = tx.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::PeerAborted, "{e}");
    assert_eq!(e.wire_code(), Some(ErrorCode::CANCELLED));
    tx.clear().unwrap();
    assert!(prefill.node().pool().held_pages().is_empty());
}

#[test]
fn the_prefill_side_aborts_and_both_sides_fail() {
    let (decode, _, prefill, _) = pair(1024);
    let room = TransferId(12);
    let dst = vec![20, 2, 30];
    let rx = decode.receiver(room, None).unwrap();
    rx.init(dst.clone(), 48, WAIT).unwrap();
    let tx = prefill.sender(room, None).unwrap();
    tx.init(3, 48).unwrap();
    tx.send(&[4], None).unwrap();
    tx.abort();
    assert_eq!(tx.poll(), KvPoll::Failed);
    assert_eq!(tx.failure().unwrap().kind(), ErrorKind::Aborted);
    tx.clear().unwrap();
    assert!(prefill.node().pool().held_pages().is_empty());
    assert_eq!(rx.wait(WAIT), KvPoll::Failed);
    let e = rx.failure().unwrap();
    // The sender's ABORT, or, when its abort came before the reservation reached it, its
    // REJECT of the reservation: with the abort's code either way.
    assert!(
        matches!(e.kind(), ErrorKind::PeerAborted | ErrorKind::Rejected),
        "{e}"
    );
    assert_eq!(e.wire_code(), Some(ErrorCode::CANCELLED));
    rx.release().unwrap();
    assert!(decode.node().pool().check_engine_free(&dst).is_ok());
}

#[test]
fn a_transfer_bootstraps_until_the_peer_connects() {
    let auth = Auth::ephemeral();
    let (dc, pc) = (Cache::new([0, 0]), Cache::new([1, 2]));
    let decode = manager(Role::Decode, &dc, 1024, &auth);
    let prefill = manager(Role::Prefill, &pc, 1024, &auth);
    let room = TransferId(3);
    let rx = decode.receiver(room, None).unwrap();
    rx.init(vec![1], 10, WAIT).unwrap();
    let tx = prefill.sender(room, None).unwrap();
    assert_eq!(
        tx.send(&[0], None).unwrap_err().kind(),
        ErrorKind::InvalidState,
        "a chunk before init"
    );
    tx.init(1, 10).unwrap();
    assert_eq!(rx.poll(), KvPoll::Bootstrapping);
    assert_eq!(tx.poll(), KvPoll::Bootstrapping);
    // A chunk handed over before the decode reserved is queued, sent once it did.
    tx.send(&[0], None).unwrap();
    assert_eq!(tx.poll(), KvPoll::Bootstrapping);
    assert_eq!(rx.wait(Duration::from_millis(20)), KvPoll::Bootstrapping);
    // Decode connects to the listening prefill this time.
    let addr = prefill.listen("127.0.0.1:0").unwrap();
    decode.connect(&addr.to_string()).unwrap();
    prefill.wait_for_peers(1, WAIT).unwrap();
    assert_eq!(rx.wait(WAIT), KvPoll::Success, "{:?}", rx.failure());
    assert_eq!(tx.wait(WAIT), KvPoll::Success);
    assert_eq!(rx.aux().unwrap(), b"");
    assert!(dc.page(1, 1).iter().all(|&x| x == 2));
    rx.release().unwrap();
    tx.clear().unwrap();
}

#[test]
fn the_manager_checks_its_memory_and_its_peers() {
    let auth = Auth::ephemeral();
    let cache = Cache::new([0, 0]);
    // 64 pages x 16 tokens = 1024 tokens: a 4096-token context does not fit.
    let config = ManagerConfig::new(Role::Decode, TPP, 4096, auth.clone());
    // SAFETY: leaked, non-overlapping buffers.
    let e = unsafe { Manager::new(config, &cache.buffers()) }.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConfigError);
    assert!(
        e.message().contains("1024") && e.message().contains("4096"),
        "{e}"
    );
    let mut bad = cache.buffers();
    bad[1].len -= 1;
    let config = ManagerConfig::new(Role::Decode, TPP, 1024, auth.clone());
    // SAFETY: as above (a shorter length of the same buffer).
    let e = unsafe { Manager::new(config.clone(), &bad) }.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    bad[1].ptr = std::ptr::null_mut();
    // SAFETY: refused before any use of the pointers.
    let e = unsafe { Manager::new(config, &bad) }.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");

    // A prefill with another key is refused at the handshake.
    let decode = manager(Role::Decode, &cache, 1024, &auth);
    let other = Cache::new([0, 0]);
    let prefill = manager(Role::Prefill, &other, 1024, &Auth::ephemeral());
    let addr = decode.listen("127.0.0.1:0").unwrap();
    let e = prefill.connect(&addr.to_string()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unauthenticated, "{e}");
    assert!(decode.sender(TransferId(1), None).is_err());
    assert!(prefill.receiver(TransferId(1), None).is_err());
}

#[test]
fn with_several_peers_a_transfer_names_its_peer() {
    let auth = Auth::ephemeral();
    let dc = Cache::new([0, 0]);
    let decode = manager(Role::Decode, &dc, 1024, &auth);
    let addr = decode.listen("127.0.0.1:0").unwrap().to_string();
    let (ca, cb) = (Cache::new([0, 0]), Cache::new([0, 0]));
    let a = manager(Role::Prefill, &ca, 1024, &auth);
    let b = manager(Role::Prefill, &cb, 1024, &auth);
    a.connect(&addr).unwrap();
    b.connect(&addr).unwrap();
    decode.wait_for_peers(2, WAIT).unwrap();
    let mut peers = decode.peers();
    peers.sort_unstable();
    let mut want = vec![a.node_id(), b.node_id()];
    want.sort_unstable();
    assert_eq!(peers, want);

    // Unnamed with two peers: refused, naming the way out.
    let unnamed = decode.receiver(TransferId(1), None).unwrap();
    unnamed.init(vec![0], 16, WAIT).unwrap();
    assert_eq!(unnamed.poll(), KvPoll::Failed);
    assert_eq!(
        unnamed.failure().unwrap().kind(),
        ErrorKind::InvalidArgument
    );
    unnamed.release().unwrap();

    // The same room id from each peer, into different pages: each lands from its own peer.
    let room = TransferId(5);
    for (i, c) in [&ca, &cb].into_iter().enumerate() {
        c.page(0, 1).fill(0x10 + i as u8);
        c.page(1, 1).fill(0x20 + i as u8);
    }
    let rxs: Vec<_> = [&a, &b]
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let rx = decode.receiver(room, Some(m.node_id())).unwrap();
            rx.init(vec![10 + i as u32], 16, WAIT).unwrap();
            rx
        })
        .collect();
    let txs: Vec<_> = [&a, &b]
        .iter()
        .map(|m| {
            let tx = m.sender(room, None).unwrap();
            tx.init(1, 16).unwrap();
            tx.send(&[1], None).unwrap();
            tx
        })
        .collect();
    for (i, rx) in rxs.iter().enumerate() {
        assert_eq!(rx.wait(WAIT), KvPoll::Success, "{:?}", rx.failure());
        assert!(dc
            .page(0, 10 + i as u32)
            .iter()
            .all(|&x| x == 0x10 + i as u8));
        assert!(dc
            .page(1, 10 + i as u32)
            .iter()
            .all(|&x| x == 0x20 + i as u8));
        rx.release().unwrap();
    }
    for tx in &txs {
        assert_eq!(tx.wait(WAIT), KvPoll::Success, "{:?}", tx.failure());
        tx.clear().unwrap();
    }
}

#[test]
fn after_shutdown_nothing_lands_in_the_memory_and_transfers_report_it() {
    let (decode, dc, prefill, pc) = pair(1024);
    // A transfer under way: reserved, half sent.
    let room = TransferId(21);
    let dst = vec![40, 41, 42];
    let rx = decode.receiver(room, None).unwrap();
    rx.init(dst.clone(), 48, WAIT).unwrap();
    let tx = prefill.sender(room, None).unwrap();
    tx.init(3, 48).unwrap();
    assert_eq!(opened(&tx), KvPoll::WaitingForInput);
    for p in [1, 2, 3] {
        pc.page(0, p).fill(0x5A);
        pc.page(1, p).fill(0x5B);
    }
    tx.send(&[1], None).unwrap();

    decode.shutdown(WAIT).unwrap();
    assert!(decode.is_shut_down());
    // The engine may free its memory now: nothing of kvwire writes it any more, whatever
    // the prefill still sends.
    let before: Vec<Vec<u8>> = dst.iter().map(|&p| dc.page(0, p).to_vec()).collect();
    let _ = tx.send(&[2, 3], None);
    assert_eq!(
        tx.wait(WAIT),
        KvPoll::Failed,
        "the prefill sees the decode go"
    );
    let e = tx.failure().unwrap();
    assert!(e.is_retryable(), "{e}");
    std::thread::sleep(Duration::from_millis(100));
    let after: Vec<Vec<u8>> = dst.iter().map(|&p| dc.page(0, p).to_vec()).collect();
    assert_eq!(before, after, "a page changed after shutdown returned");
    // The decode's own transfer reports it, and gives its pages back at once.
    assert_eq!(rx.poll(), KvPoll::Failed);
    assert_eq!(rx.failure().unwrap().kind(), ErrorKind::InvalidState);
    rx.release().unwrap();
    // New work is refused; a second shutdown returns at once.
    let late = decode.receiver(TransferId(22), None).unwrap();
    late.init(vec![1], 16, WAIT).unwrap();
    assert_eq!(late.poll(), KvPoll::Failed);
    assert!(decode.listen("127.0.0.1:0").is_err());
    decode.shutdown(Duration::ZERO).unwrap();
    tx.clear().unwrap();
}

/// `send` never waits on the connection: a chunk the connection refuses (a page beyond the
/// pool) returns at once, and the refusal comes back through `poll` as a typed failure; the
/// transfer is aborted, so the decode's reservation fails too instead of waiting for pages
/// that never come, and every page comes back.
#[test]
fn a_chunk_the_connection_refuses_fails_the_transfer_through_poll() {
    let (decode, _, prefill, _) = pair(1024);
    let room = TransferId(13);
    let dst = vec![20, 21];
    let rx = decode.receiver(room, None).unwrap();
    rx.init(dst.clone(), 32, WAIT).unwrap();
    let tx = prefill.sender(room, None).unwrap();
    tx.init(2, 32).unwrap();
    assert_eq!(opened(&tx), KvPoll::WaitingForInput);
    tx.send(&[1, PAGES as u32 + 7], None).unwrap();
    assert_eq!(tx.wait(WAIT), KvPoll::Failed);
    let e = tx.failure().unwrap();
    assert!(e.to_string().contains(&(PAGES + 7).to_string()), "{e}");
    assert_eq!(rx.wait(WAIT), KvPoll::Failed, "the decode still waits");
    rx.release().unwrap();
    assert!(decode.node().pool().check_engine_free(&dst).is_ok());
    tx.clear().unwrap();
    assert!(prefill.node().pool().held_pages().is_empty());
}

/// A chunk sent while the transfer is ending (the decode aborted it; the prefill's `poll`
/// has not read that yet) does not mask why it ended: the prefill fails with the decode's
/// abort (or succeeds, where the abort crossed the verdict), never with the chunk's refusal.
/// The chaos cluster saw the refusal win (`InvalidRequest`) 7 times in 220,891 requests
/// before the fix; this test meets that race only rarely on loopback (a refusal while the
/// transfer drains), so it guards the contract more than it reproduces the race.
#[test]
fn a_chunk_refused_because_the_transfer_ended_does_not_mask_its_outcome() {
    let (decode, _, prefill, _) = pair(1024);
    for round in 0..40u64 {
        let room = TransferId(100 + round);
        let rx = decode.receiver(room, None).unwrap();
        rx.init(vec![30, 31, 32], 48, WAIT).unwrap();
        let tx = prefill.sender(room, None).unwrap();
        tx.init(3, 48).unwrap();
        assert_eq!(opened(&tx), KvPoll::WaitingForInput);
        tx.send(&[1], None).unwrap();
        rx.abort();
        // Sent at once after the abort, and again after it surely reached the prefill's
        // connection; each may be refused, as the transfer is ending.
        let _ = tx.send(&[2], None);
        std::thread::sleep(Duration::from_millis((round % 4) * 2));
        let _ = tx.send(&[3], None);
        // The decode's abort may also cross the verdict on its way (the decode's connection
        // verified the pages before it handled the abort: `ReceiverTransfer::abort`), and
        // the prefill reads Success; what it must never read is the chunk's refusal.
        if tx.wait(WAIT) == KvPoll::Failed {
            let e = tx.failure().unwrap();
            assert_eq!(e.kind(), ErrorKind::PeerAborted, "round {round}: {e}");
        }
        rx.release().unwrap();
        tx.clear().unwrap();
    }
    assert!(prefill.node().pool().held_pages().is_empty());
    assert!(decode.node().pool().held_pages().is_empty());
}

/// Renewing a dialled connection (`Manager::renew`; the manager does it by itself to one
/// that runs with failed lanes, RDMA rails lost or left out): the transfer open on it
/// finishes there, a transfer made meanwhile waits for its successor instead of taking the
/// draining connection, the address is dialled again once the old connection has nothing
/// open, and the waiting transfer verifies over the new one; every byte is compared.
#[test]
fn renewing_a_dialled_connection_drains_it_and_later_transfers_take_its_successor() {
    let auth = Auth::ephemeral();
    let (dc, pc) = (Cache::new([0xAA, 0xBB]), Cache::new([0, 0]));
    let decode = manager(Role::Decode, &dc, 1024, &auth);
    let prefill = manager(Role::Prefill, &pc, 1024, &auth);
    let addr = prefill.listen("127.0.0.1:0").unwrap().to_string();
    let fill = |room: u64, src: &[u32]| {
        for (o, &p) in src.iter().enumerate() {
            for b in 0..2 {
                pc.page(b, p).copy_from_slice(&kv(room, o, b));
            }
        }
    };
    let landed = |room: u64, dst: &[u32]| {
        for (o, &p) in dst.iter().enumerate() {
            for b in 0..2 {
                assert!(dc.page(b, p) == &kv(room, o, b)[..], "room {room} page {p}");
            }
        }
    };
    // Transfer 1, open on the first connection.
    let (dst1, src1) = (vec![4, 5], [10u32, 11]);
    fill(1, &src1);
    let rx1 = decode.receiver_at(TransferId(1), &addr).unwrap();
    rx1.init(dst1.clone(), 32, WAIT).unwrap();
    let tx1 = prefill.sender(TransferId(1), None).unwrap();
    tx1.init(2, 32).unwrap();
    assert_eq!(opened(&tx1), KvPoll::WaitingForInput);
    assert_eq!(prefill.handshake_stats().established, 1);
    assert!(decode.renew(&addr));
    assert!(!decode.renew("127.0.0.1:1"), "nothing was dialled there");
    // Transfer 2, made while the first connection drains.
    let (dst2, src2) = (vec![20, 21], [30u32, 31]);
    fill(2, &src2);
    let rx2 = decode.receiver_at(TransferId(2), &addr).unwrap();
    rx2.init(dst2.clone(), 32, WAIT).unwrap();
    let tx2 = prefill.sender(TransferId(2), None).unwrap();
    tx2.init(2, 32).unwrap();
    // Transfer 3 names the peer by node id instead of the address: it waits as well.
    let (dst3, src3) = (vec![40], [50u32]);
    fill(3, &src3);
    let rx3 = decode
        .receiver(TransferId(3), Some(prefill.node_id()))
        .unwrap();
    rx3.init(dst3.clone(), 16, WAIT).unwrap();
    let tx3 = prefill.sender(TransferId(3), None).unwrap();
    tx3.init(1, 16).unwrap();
    // While transfer 1 keeps the draining connection open, transfers 2 and 3 do not take
    // it (over it, the prefill would see their reservations within milliseconds).
    let until = std::time::Instant::now() + Duration::from_secs(1);
    while std::time::Instant::now() < until {
        for (tx, n) in [(&tx2, 2), (&tx3, 3)] {
            assert_eq!(
                tx.poll(),
                KvPoll::Bootstrapping,
                "transfer {n} went over the draining connection"
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(prefill.handshake_stats().established, 1);
    // Transfer 1 finishes on the old connection.
    tx1.send(&src1, None).unwrap();
    assert_eq!(rx1.wait(WAIT), KvPoll::Success, "{:?}", rx1.failure());
    assert_eq!(tx1.wait(WAIT), KvPoll::Success, "{:?}", tx1.failure());
    landed(1, &dst1);
    rx1.release().unwrap();
    tx1.clear().unwrap();
    // Then the address is dialled again, and transfer 2 goes over the new connection.
    assert_eq!(opened(&tx2), KvPoll::WaitingForInput, "{:?}", tx2.failure());
    assert_eq!(prefill.handshake_stats().established, 2);
    tx2.send(&src2, None).unwrap();
    assert_eq!(rx2.wait(WAIT), KvPoll::Success, "{:?}", rx2.failure());
    assert_eq!(tx2.wait(WAIT), KvPoll::Success, "{:?}", tx2.failure());
    landed(2, &dst2);
    rx2.release().unwrap();
    tx2.clear().unwrap();
    assert_eq!(opened(&tx3), KvPoll::WaitingForInput, "{:?}", tx3.failure());
    tx3.send(&src3, None).unwrap();
    assert_eq!(rx3.wait(WAIT), KvPoll::Success, "{:?}", rx3.failure());
    assert_eq!(tx3.wait(WAIT), KvPoll::Success, "{:?}", tx3.failure());
    landed(3, &dst3);
    rx3.release().unwrap();
    tx3.clear().unwrap();
    assert_eq!(decode.peers(), vec![prefill.node_id()]);
    assert!(prefill.node().pool().held_pages().is_empty());
    assert!(decode.node().pool().held_pages().is_empty());
}
