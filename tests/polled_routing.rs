//! What an engine's scheduler relies on (DESIGN.md, "Integration model"), through the polled
//! facade the C and Python fronts sit on: the prefill learns where a request's KV goes from
//! the decode that reserved it (no peer argument); a decode's refusal (pool, context, cancel)
//! reaches the prefill at once with its code, also before the prefill admitted the request;
//! the prefill's rejection or cancel before any decode named the request reaches that decode
//! at once too; `WaitingForInput` on the prefill means a decode reserved; a duplicate
//! admission is refused at `init`.

use std::time::{Duration, Instant};

use kvwire::polled::{ErrorKind, KvBuffer, KvPoll, Manager, ManagerConfig, Role};
use kvwire::{Auth, ErrorCode, TransferId};

const PAGE_BYTES: usize = 4096;
const TPP: u32 = 16;
const WAIT: Duration = Duration::from_secs(20);
/// Refusals are checked by what they are, not by a clock: a refusal that did not travel would
/// leave the other side waiting for its 30 s reservation deadline (prefill) or its 20 s commit
/// deadline (decode), past every wait below, and end in a Timeout, not in the refusal's code.
/// How long they took is printed (`--nocapture`), as a measurement.
fn measured(what: &str, t0: Instant) {
    eprintln!("{what}: {:?}", t0.elapsed());
}

/// An engine's KV cache of `pages` pages in two buffers (leaked: it outlives the manager).
#[derive(Clone, Copy)]
struct Cache {
    bufs: [*mut u8; 2],
    pages: usize,
}

impl Cache {
    fn new(pages: usize, fill: u8) -> Self {
        let alloc = || Box::leak(vec![fill; pages * PAGE_BYTES].into_boxed_slice()).as_mut_ptr();
        Self {
            bufs: [alloc(), alloc()],
            pages,
        }
    }

    fn buffers(&self) -> Vec<KvBuffer> {
        self.bufs
            .iter()
            .map(|&ptr| KvBuffer {
                ptr,
                len: self.pages * PAGE_BYTES,
                page_bytes: PAGE_BYTES,
            })
            .collect()
    }

    fn page(&self, buffer: usize, page: u32) -> &'static mut [u8] {
        assert!((page as usize) < self.pages);
        // SAFETY: in bounds of a leaked buffer; the tests write only pages kvwire does not
        // hold, and read any page (the engine contract allows it).
        unsafe {
            std::slice::from_raw_parts_mut(
                self.bufs[buffer].add(page as usize * PAGE_BYTES),
                PAGE_BYTES,
            )
        }
    }
}

fn manager(role: Role, cache: &Cache, context: u64, auth: &Auth) -> Manager {
    let mut config = ManagerConfig::new(role, TPP, context, auth.clone()).fingerprint("routing");
    config.allow_undersized_pool = true;
    // SAFETY: the buffers are leaked (live for the process) and do not overlap.
    unsafe { Manager::new(config, &cache.buffers()) }.unwrap()
}

/// A prefill (256 pages, 4096-token context) listening, and `n` decodes (64 pages each,
/// `decode_context` tokens) connected to it.
fn cluster(n: usize, decode_context: u64) -> (Manager, Cache, Vec<(Manager, Cache)>) {
    let auth = Auth::ephemeral();
    let pc = Cache::new(256, 0);
    let prefill = manager(Role::Prefill, &pc, 4096, &auth);
    let addr = prefill.listen("127.0.0.1:0").unwrap().to_string();
    let decodes: Vec<_> = (0..n)
        .map(|_| {
            let dc = Cache::new(64, 0xEE);
            let d = manager(Role::Decode, &dc, decode_context, &auth);
            d.connect(&addr).unwrap();
            (d, dc)
        })
        .collect();
    prefill.wait_for_peers(n, WAIT).unwrap();
    (prefill, pc, decodes)
}

fn fill(c: &Cache, room: u64, pages: &[u32]) {
    for (o, &p) in pages.iter().enumerate() {
        for b in 0..2 {
            c.page(b, p).fill((room as usize * 13 + o * 3 + b) as u8);
        }
    }
}

fn landed(c: &Cache, room: u64, pages: &[u32]) -> bool {
    pages.iter().enumerate().all(|(o, &p)| {
        (0..2).all(|b| {
            c.page(b, p)
                .iter()
                .all(|&x| x == (room as usize * 13 + o * 3 + b) as u8)
        })
    })
}

/// Polls `poll` until it leaves `from` (at most `within`); returns the state and when.
fn leave(from: KvPoll, within: Duration, poll: impl Fn() -> KvPoll) -> (KvPoll, Duration) {
    let t0 = Instant::now();
    loop {
        let s = poll();
        if s != from || t0.elapsed() >= within {
            return (s, t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn one_prefill_two_decodes_each_request_goes_to_the_decode_that_reserved_it() {
    let (prefill, pc, decodes) = cluster(2, 1024);
    let mut rxs = Vec::new();
    let mut txs = Vec::new();
    for i in 0..8u64 {
        let room = TransferId(1000 + i);
        let (d, _) = &decodes[(i % 2) as usize];
        let dst: Vec<u32> = (0..3).map(|k| (i * 3 + k) as u32).collect();
        let src: Vec<u32> = (0..3).map(|k| (100 + i * 3 + k) as u32).collect();
        fill(&pc, room.get(), &src);
        // The prefill's request exists before the decode reserved (SGLang's order is
        // either): it waits, Bootstrapping, for a decode to name it.
        let tx = prefill.sender(room, None).unwrap();
        tx.init(3, 40).unwrap();
        assert_eq!(tx.poll(), KvPoll::Bootstrapping);
        let rx = d.receiver(room, None).unwrap();
        rx.init(dst.clone(), 40, WAIT).unwrap();
        let (s, _) = leave(KvPoll::Bootstrapping, WAIT, || tx.poll());
        assert_eq!(s, KvPoll::WaitingForInput, "{:?}", tx.failure());
        tx.send(&src, None).unwrap();
        rxs.push((i, rx, dst));
        txs.push(tx);
    }
    for (i, rx, dst) in &rxs {
        assert_eq!(rx.wait(WAIT), KvPoll::Success, "{:?}", rx.failure());
        let (_, dc) = &decodes[(*i % 2) as usize];
        assert!(landed(dc, 1000 + i, dst), "request {i}'s bytes");
        // The other decode's same pages were never touched (its requests use other pages).
        let (_, other) = &decodes[((*i + 1) % 2) as usize];
        assert!(dst
            .iter()
            .all(|&p| (0..2).all(|b| other.page(b, p).iter().all(|&x| x == 0xEE))));
        rx.release().unwrap();
    }
    for tx in &txs {
        assert_eq!(tx.wait(WAIT), KvPoll::Success, "{:?}", tx.failure());
        tx.clear().unwrap();
    }
    assert!(prefill.held_pages().is_empty());
    assert!(
        prefill.node().rooms().is_empty(),
        "every route forgotten once opened"
    );
}

#[test]
fn a_decodes_refusal_reaches_the_prefill_at_once_with_its_code() {
    // The decode serves 4096-token contexts on a 64-page (1024-token) pool: a 2000-token
    // prompt fits the prefill but not the decode's pool. A 5000-token one exceeds the
    // decode's context, but the prefill (4096) rejects it itself; use a 3000-token decode
    // context for the context case below.
    let (prefill, _, decodes) = cluster(1, 4096);
    let (d, dc) = &decodes[0];

    // (a) The prefill admitted first; the decode refuses: the prefill fails within 1 s.
    let room = TransferId(1);
    let tx = prefill.sender(room, None).unwrap();
    tx.init(125, 2000).unwrap();
    let rx = d.receiver(room, None).unwrap();
    let t0 = Instant::now();
    rx.init((0..125).collect(), 2000, WAIT).unwrap();
    assert_eq!(rx.poll(), KvPoll::Failed);
    let e = rx.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::Rejected, "{e}");
    assert_eq!(e.wire_code(), Some(ErrorCode::PROMPT_EXCEEDS_POOL));
    let (s, _) = leave(KvPoll::Bootstrapping, WAIT, || tx.poll());
    assert_eq!(s, KvPoll::Failed);
    let e = tx.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::PeerAborted, "{e}");
    assert_eq!(e.wire_code(), Some(ErrorCode::PROMPT_EXCEEDS_POOL), "{e}");
    assert!(!e.is_retryable(), "{e}");
    measured("a decode's refusal reached the prefill", t0);
    tx.clear().unwrap();

    // (b) The decode refuses before the prefill's engine got to the request: its init fails
    // at once, nothing opened.
    let room = TransferId(2);
    let rx = d.receiver(room, None).unwrap();
    rx.init((0..125).collect(), 2000, WAIT).unwrap();
    assert_eq!(rx.poll(), KvPoll::Failed);
    // The refusal is on its way: the prefill's directory names the decode once it arrived.
    let t0 = Instant::now();
    while prefill.node().rooms().peer_of(room).is_none() && t0.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(1));
    }
    // The prefill's engine learns it before computing anything: its request polls Failed
    // even before `init`.
    let tx = prefill.sender(room, None).unwrap();
    assert_eq!(tx.poll(), KvPoll::Failed);
    let e = tx.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::PeerAborted, "{e}");
    assert_eq!(e.wire_code(), Some(ErrorCode::PROMPT_EXCEEDS_POOL), "{e}");
    assert_eq!(
        tx.init(125, 2000).unwrap_err().kind(),
        ErrorKind::InvalidState
    );
    tx.clear().unwrap();

    // (c) The decode cancels before it reserved: CANCELLED, at once.
    let room = TransferId(3);
    let tx = prefill.sender(room, None).unwrap();
    tx.init(2, 20).unwrap();
    let rx = d.receiver(room, None).unwrap();
    let t0 = Instant::now();
    rx.abort();
    let (s, _) = leave(KvPoll::Bootstrapping, WAIT, || tx.poll());
    measured("a decode's cancel reached the prefill", t0);
    assert_eq!(s, KvPoll::Failed);
    let e = tx.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::PeerAborted, "{e}");
    assert_eq!(e.wire_code(), Some(ErrorCode::CANCELLED));
    tx.clear().unwrap();

    // Nothing was reserved or written on the decode; nothing is held anywhere.
    assert!(d.held_pages().is_empty());
    assert!(dc.page(0, 0).iter().all(|&x| x == 0xEE));
    assert!(prefill.held_pages().is_empty());
}

#[test]
fn a_decode_checks_its_own_context_length() {
    let (prefill, _, decodes) = cluster(1, 512);
    let (d, _) = &decodes[0];
    let room = TransferId(4);
    let tx = prefill.sender(room, None).unwrap();
    tx.init(38, 600).unwrap();
    let rx = d.receiver(room, None).unwrap();
    rx.init((0..38).collect(), 600, WAIT).unwrap();
    assert_eq!(rx.poll(), KvPoll::Failed);
    let e = rx.failure().unwrap();
    assert_eq!(
        e.wire_code(),
        Some(ErrorCode::PROMPT_EXCEEDS_CONTEXT),
        "{e}"
    );
    assert_eq!(
        leave(KvPoll::Bootstrapping, WAIT, || tx.poll()).0,
        KvPoll::Failed
    );
    let e = tx.failure().unwrap();
    assert_eq!(
        e.wire_code(),
        Some(ErrorCode::PROMPT_EXCEEDS_CONTEXT),
        "{e}"
    );
    assert!(!e.is_retryable());
    assert!(d.held_pages().is_empty());
}

#[test]
fn the_prefills_rejection_or_cancel_before_any_decode_named_the_request_reaches_it_at_once() {
    let (prefill, _, decodes) = cluster(1, 8192);
    let (d, _) = &decodes[0];
    // Rejected at the prefill's admission (its context is 4096) before the decode reserved.
    let room = TransferId(5);
    let tx = prefill.sender(room, None).unwrap();
    tx.init(313, 5000).unwrap();
    assert_eq!(tx.poll(), KvPoll::Failed);
    assert_eq!(
        tx.failure().unwrap().wire_code(),
        Some(ErrorCode::PROMPT_EXCEEDS_CONTEXT)
    );
    // The decode's pool (64 pages) cannot hold 5000 tokens either, so reserve a prompt that
    // it can, under the same id: what it gets is the prefill's verdict on the id.
    let rx = d.receiver(room, None).unwrap();
    let t0 = Instant::now();
    rx.init((0..10).collect(), 160, WAIT).unwrap();
    assert_eq!(rx.wait(WAIT), KvPoll::Failed);
    measured("the prefill's rejection reached the decode", t0);
    let e = rx.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::Rejected, "{e}");
    assert_eq!(e.wire_code(), Some(ErrorCode::PROMPT_EXCEEDS_CONTEXT));
    rx.release().unwrap();

    // Cancelled by the prefill before any decode named it.
    let room = TransferId(6);
    let tx = prefill.sender(room, None).unwrap();
    tx.init(2, 20).unwrap();
    tx.abort();
    let rx = d.receiver(room, None).unwrap();
    let t0 = Instant::now();
    rx.init(vec![1, 2], 20, WAIT).unwrap();
    assert_eq!(rx.wait(WAIT), KvPoll::Failed);
    measured("the prefill's cancel reached the decode", t0);
    let e = rx.failure().unwrap();
    assert_eq!(e.wire_code(), Some(ErrorCode::CANCELLED), "{e}");
    rx.release().unwrap();
    assert!(d.held_pages().is_empty());
    tx.clear().unwrap();
}

#[test]
fn a_duplicate_admission_is_refused_at_init_and_an_unclaimed_request_times_out() {
    let auth = Auth::ephemeral();
    let pc = Cache::new(64, 0);
    let mut config = ManagerConfig::new(Role::Prefill, TPP, 1024, auth).fingerprint("routing");
    config.sender = Some(kvwire::proto::sender::SenderConfig {
        reservation_timeout: Duration::from_millis(200),
        ..Default::default()
    });
    // SAFETY: leaked, non-overlapping buffers.
    let prefill = unsafe { Manager::new(config, &pc.buffers()) }.unwrap();
    let room = TransferId(8);
    let first = prefill.sender(room, None).unwrap();
    first.init(1, 16).unwrap();
    let second = prefill.sender(room, None).unwrap();
    let e = second.init(1, 16).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidState, "{e}");
    // No decode ever names it: a retryable Timeout once the reservation wait passed.
    assert_eq!(first.wait(WAIT), KvPoll::Failed);
    let e = first.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.is_retryable());
    first.clear().unwrap();
    // Cleared: the id may be admitted again.
    let third = prefill.sender(room, None).unwrap();
    third.init(1, 16).unwrap();
}

#[test]
fn a_decode_that_dials_its_prefill_by_address_is_routed_too() {
    // The Python package's and SGLang's way: the decode dials the prefill's address per
    // request (`receiver_at`), the prefill routes by the reservation.
    let auth = Auth::ephemeral();
    let pc = Cache::new(64, 0);
    let prefill = manager(Role::Prefill, &pc, 1024, &auth);
    let addr = prefill.listen("127.0.0.1:0").unwrap().to_string();
    let dc = Cache::new(64, 0xEE);
    let decode = manager(Role::Decode, &dc, 1024, &auth);
    let room = TransferId(44);
    let rx = decode.receiver_at(room, &addr).unwrap();
    rx.init(vec![5, 17], 32, WAIT).unwrap();
    fill(&pc, room.get(), &[1, 2]);
    // Nobody polls the decode: its reservation goes out once its dial is up all the same,
    // and names the request at the prefill.
    let t0 = Instant::now();
    while prefill.node().rooms().peer_of(room).is_none() && t0.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(prefill.node().rooms().peer_of(room), Some(decode.node_id()));
    let tx = prefill.sender(room, None).unwrap();
    assert_eq!(tx.poll(), KvPoll::Bootstrapping, "not open before init");
    tx.init(2, 32).unwrap();
    let (s, _) = leave(KvPoll::Bootstrapping, WAIT, || tx.poll());
    assert_eq!(s, KvPoll::WaitingForInput, "{:?}", tx.failure());
    tx.send(&[1, 2], None).unwrap();
    assert_eq!(rx.wait(WAIT), KvPoll::Success, "{:?}", rx.failure());
    assert!(landed(&dc, room.get(), &[5, 17]));
}

#[test]
fn the_prefills_own_rejection_is_its_verdict_even_after_a_decodes_refusal() {
    // The decode refused first (over its 512-token context), then the prefill's engine
    // admits the same over-long prompt (over its own 4096-token context): the prefill reports
    // its own rejection, never the decode's refusal racing it. Twenty times: the two verdicts
    // once raced.
    let (prefill, _, decodes) = cluster(1, 512);
    let (d, _) = &decodes[0];
    for i in 0..20 {
        let room = TransferId(3000 + i);
        let rx = d.receiver(room, None).unwrap();
        rx.init((0..10).collect(), 5000, WAIT).unwrap();
        assert_eq!(rx.poll(), KvPoll::Failed);
        let t0 = Instant::now();
        while prefill.node().rooms().peer_of(room).is_none() && t0.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
        let tx = prefill.sender(room, None).unwrap();
        tx.init(313, 5000).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(tx.poll(), KvPoll::Failed);
        let e = tx.failure().unwrap();
        assert_eq!(e.kind(), ErrorKind::Rejected, "round {i}: {e}");
        assert_eq!(e.wire_code(), Some(ErrorCode::PROMPT_EXCEEDS_CONTEXT));
    }
}

#[test]
fn polling_a_decode_while_its_connection_comes_up_never_deadlocks() {
    // The engine polls a receiver (its state lock, then the peer list) while kvwire's own
    // task reserves it as the dial completes (the peer list, then the state lock): the two
    // once took the locks in opposite orders and hung the engine's poll for good. A fresh
    // dial per round, polled from the moment of `init`.
    let auth = Auth::ephemeral();
    let pc = Cache::new(64, 0);
    let prefill = manager(Role::Prefill, &pc, 1024, &auth);
    let addr = prefill.listen("127.0.0.1:0").unwrap().to_string();
    for round in 0..200u64 {
        let dc = Cache::new(64, 0xEE);
        let decode = manager(Role::Decode, &dc, 1024, &auth);
        let (done, rx_done) = std::sync::mpsc::channel();
        let addr = addr.clone();
        std::thread::spawn(move || {
            let rx = decode.receiver_at(TransferId(5000 + round), &addr).unwrap();
            rx.init(vec![1], 16, WAIT).unwrap();
            // A scheduler loop that polls without pausing.
            let t0 = Instant::now();
            let mut s = rx.poll();
            while s == KvPoll::Bootstrapping && t0.elapsed() < WAIT {
                s = rx.poll();
            }
            let _ = done.send(s);
        });
        let s = rx_done
            .recv_timeout(WAIT)
            .unwrap_or_else(|_| panic!("round {round}: the engine's poll hung"));
        assert_eq!(s, KvPoll::WaitingForInput, "round {round}");
    }
}
