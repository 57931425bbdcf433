//! What the facade gives its bindings beyond `tests/polled.rs` (the Python package sits on
//! these): aux records read from and written to the engines' aux buffers by aux index, a
//! decode manager dialling its prefill by address in the background (a failed dial fails
//! the transfer, typed, and a later receiver dials again), verified pages handed back at
//! once (`release_verified`), and discovery through the embedded bootstrap server with the
//! layout fingerprint check.

use std::time::Duration;

use kvwire::polled::{
    AuxBuffer, BootstrapServer, DiscoveryBackend, ErrorKind, KvBuffer, KvPoll, Manager,
    ManagerConfig, Role,
};
use kvwire::{Auth, TransferId};

const PAGES: usize = 32;
const PAGE_BYTES: usize = 1024;
const TPP: u32 = 16;
const SLOTS: usize = 8;
const SLOT: usize = 8;
const WAIT: Duration = Duration::from_secs(20);

/// One KV buffer and two aux buffers of 8-byte slots (a record is 16 bytes), leaked.
struct Engine {
    kv: *mut u8,
    aux: [*mut u8; 2],
}

impl Engine {
    fn new(fill: u8) -> Self {
        let alloc = |n| Box::leak(vec![fill; n].into_boxed_slice()).as_mut_ptr();
        Self {
            kv: alloc(PAGES * PAGE_BYTES),
            aux: [alloc(SLOTS * SLOT), alloc(SLOTS * SLOT)],
        }
    }

    fn manager(&self, role: Role, auth: &Auth, fingerprint: &str) -> Manager {
        let mut config =
            ManagerConfig::new(role, TPP, (PAGES as u64) * u64::from(TPP), auth.clone())
                .fingerprint(fingerprint);
        config.release_verified = true;
        let kv = [KvBuffer {
            ptr: self.kv,
            len: PAGES * PAGE_BYTES,
            page_bytes: PAGE_BYTES,
        }];
        let aux = self.aux.map(|ptr| AuxBuffer {
            ptr,
            len: SLOTS * SLOT,
            item_len: SLOT,
        });
        // SAFETY: leaked buffers, live for the process, not overlapping; the test writes
        // only pages and slots kvwire does not hold.
        unsafe { Manager::with_aux(config, &kv, &aux) }.unwrap()
    }

    fn page(&self, p: u32) -> &'static mut [u8] {
        // SAFETY: in bounds of a leaked buffer (see `manager`).
        unsafe { std::slice::from_raw_parts_mut(self.kv.add(p as usize * PAGE_BYTES), PAGE_BYTES) }
    }

    fn slot(&self, buffer: usize, index: usize) -> &'static mut [u8] {
        // SAFETY: in bounds of a leaked buffer (see `manager`).
        unsafe { std::slice::from_raw_parts_mut(self.aux[buffer].add(index * SLOT), SLOT) }
    }
}

fn wait(poll: impl Fn() -> KvPoll, until: KvPoll) -> KvPoll {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let s = poll();
        if s == until || s.is_final() || std::time::Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn until(cond: impl Fn() -> bool) -> bool {
    let deadline = std::time::Instant::now() + WAIT;
    while !cond() {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

#[test]
fn aux_records_travel_by_aux_index_and_verified_pages_come_back_at_once() {
    let auth = Auth::ephemeral();
    let (pe, de) = (Engine::new(0), Engine::new(0xEE));
    let prefill = pe.manager(Role::Prefill, &auth, "m/tp0");
    let decode = de.manager(Role::Decode, &auth, "m/tp0");
    let addr = prefill.listen("127.0.0.1:0").unwrap().to_string();

    let room = TransferId(0x7000_0000_0000_0001);
    let rx = decode.receiver_at(room, &addr).unwrap();
    assert!(until(|| rx.connected()), "the dial did not come up");
    assert_eq!(rx.poll(), KvPoll::Bootstrapping);
    rx.init_with_aux(vec![20, 4], 32, WAIT, Some(5)).unwrap();
    assert_eq!(rx.poll(), KvPoll::WaitingForInput);

    for (o, p) in [(0u8, 1u32), (1, 2)] {
        pe.page(p).fill(0x40 + o);
    }
    pe.slot(0, 3).copy_from_slice(b"first-to");
    pe.slot(1, 3).copy_from_slice(b"ken:42\0\0");
    prefill.wait_for_peers(1, WAIT).unwrap();
    let tx = prefill.sender(room, None).unwrap();
    tx.init_with_aux(2, 32, Some(3)).unwrap();
    // Open once the decode's reservation reached the prefill.
    assert_eq!(
        wait(|| tx.poll(), KvPoll::WaitingForInput),
        KvPoll::WaitingForInput
    );
    tx.send(&[1], None).unwrap();
    assert_eq!(tx.pages_sent(), 1);
    tx.send(&[2], None).unwrap();

    assert_eq!(rx.wait(WAIT), KvPoll::Success, "{:?}", rx.failure());
    assert_eq!(tx.wait(WAIT), KvPoll::Success, "{:?}", tx.failure());
    assert!(de.page(20).iter().all(|&b| b == 0x40));
    assert!(de.page(4).iter().all(|&b| b == 0x41));
    assert_eq!(rx.aux().unwrap(), b"first-token:42\0\0");
    assert_eq!(de.slot(0, 5), b"first-to");
    assert_eq!(de.slot(1, 5), b"ken:42\0\0");
    assert!(
        de.slot(0, 4).iter().all(|&b| b == 0xEE),
        "another slot was written"
    );
    // Handed back at verification: kvwire holds nothing.
    assert_eq!(decode.held_pages(), Vec::<u32>::new());
    rx.release().unwrap();
    tx.clear().unwrap();
    assert_eq!(prefill.handshake_stats().established, 1);

    // A binding's own reason for ending a request is the one the transfer reports.
    let ended = prefill.sender(TransferId(8), None).unwrap();
    ended.abort_with(kvwire::polled::Error::new(
        ErrorKind::InvalidRequest,
        "chunk refused",
    ));
    assert_eq!(ended.poll(), KvPoll::Failed);
    assert_eq!(ended.failure().unwrap().kind(), ErrorKind::InvalidRequest);

    // An aux index outside the buffers is refused at init.
    let bad = decode.receiver_at(TransferId(9), &addr).unwrap();
    let e = bad
        .init_with_aux(vec![0], 16, WAIT, Some(SLOTS))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
    // A prompt over the decode's context (here also its pool) fails the transfer before
    // anything is reserved (tests/polled_routing.rs: the pool case, and the prefill told).
    bad.init_with_aux(vec![0], 16 * 33, WAIT, None).unwrap();
    assert_eq!(bad.poll(), KvPoll::Failed);
    let e = bad.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::Rejected);
    assert_eq!(
        e.wire_code(),
        Some(kvwire::ErrorCode::PROMPT_EXCEEDS_CONTEXT)
    );
}

#[test]
fn a_failed_dial_fails_the_receiver_and_a_later_one_dials_again() {
    let auth = Auth::ephemeral();
    let (pe, de) = (Engine::new(0), Engine::new(0));
    let decode = de.manager(Role::Decode, &auth, "m/tp0");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let addr = port.to_string();
    let rx = decode.receiver_at(TransferId(1), &addr).unwrap();
    assert_eq!(wait(|| rx.poll(), KvPoll::Failed), KvPoll::Failed);
    let e = rx.failure().unwrap();
    assert_eq!(e.kind(), ErrorKind::ConnectFailed, "{e}");
    assert!(e.is_retryable());
    assert!(!decode.link_up(&addr));

    let prefill = pe.manager(Role::Prefill, &auth, "m/tp0");
    prefill.listen(&addr).unwrap();
    let rx = decode.receiver_at(TransferId(2), &addr).unwrap();
    assert!(until(|| rx.connected()), "the second dial did not come up");
    assert_eq!(rx.poll(), KvPoll::Bootstrapping);
    assert!(decode.link_up(&addr));
    assert_eq!(decode.peers(), vec![prefill.node_id()]);
}

/// A peer that went away is never picked for a new transfer, even in the moment before the
/// manager's list of connections is pruned (a restarted prefill's decode resolved its cached
/// address as up and reserved on the dead connection: python/tests/test_discovery.py saw it).
#[test]
fn a_lost_connection_is_never_picked_for_a_new_transfer() {
    let auth = Auth::ephemeral();
    let (pe, de) = (Engine::new(0), Engine::new(0));
    let decode = de.manager(Role::Decode, &auth, "m/tp0");
    let prefill = pe.manager(Role::Prefill, &auth, "m/tp0");
    let addr = prefill.listen("127.0.0.1:0").unwrap().to_string();
    let first = decode.receiver_at(TransferId(1), &addr).unwrap();
    first.init(vec![0], 16, WAIT).unwrap();
    assert!(until(|| first.connected()), "the dial did not come up");
    assert!(!first.poll().is_final());
    assert!(decode.link_up(&addr));

    prefill.shutdown(WAIT).unwrap();
    // The decode's connection saw its peer go (the reservation on it failed, retryable) ...
    assert_eq!(wait(|| first.poll(), KvPoll::Failed), KvPoll::Failed);
    assert_eq!(first.failure().unwrap().kind(), ErrorKind::PeerLost);
    // ... so, at once, the address is down and a new transfer dials again (nobody listens:
    // ConnectFailed), instead of reserving on the dead connection (PeerLost).
    assert!(
        !decode.link_up(&addr),
        "a lost connection still counted as up"
    );
    let second = decode.receiver_at(TransferId(2), &addr).unwrap();
    second.init(vec![1], 16, WAIT).unwrap();
    assert_eq!(wait(|| second.poll(), KvPoll::Failed), KvPoll::Failed);
    assert_eq!(
        second.failure().unwrap().kind(),
        ErrorKind::ConnectFailed,
        "{:?}",
        second.failure()
    );
}

#[test]
fn discovery_publishes_resolves_and_refuses_another_layout() {
    let server = BootstrapServer::bind("127.0.0.1:0").unwrap();
    let backend = DiscoveryBackend::Bootstrap(server.local_addr().to_string());
    let auth = Auth::ephemeral();
    let (pe, de, oe) = (Engine::new(0), Engine::new(0), Engine::new(0));
    let prefill = pe.manager(Role::Prefill, &auth, "m/tp0");
    let addr = prefill.listen("127.0.0.1:0").unwrap();
    prefill
        .register(&backend, "c1", 3, Duration::from_secs(10), None)
        .unwrap();
    assert_eq!(server.record_count(), 1);

    let decode = de.manager(Role::Decode, &auth, "m/tp0");
    let found = decode
        .resolve(&backend, "c1", Role::Prefill, Some(3), true)
        .unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].address, addr.to_string());
    assert_eq!(found[0].node_id, prefill.node_id());
    assert_eq!(found[0].layout_fingerprint, decode.layout_fingerprint());
    assert!(decode
        .resolve(&backend, "c1", Role::Prefill, Some(4), true)
        .unwrap()
        .is_empty());

    let other = oe.manager(Role::Decode, &auth, "other-model");
    let e = other
        .resolve(&backend, "c1", Role::Prefill, Some(3), true)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LayoutMismatch, "{e}");
    assert_eq!(
        other
            .resolve(&backend, "c1", Role::Prefill, Some(3), false)
            .unwrap()
            .len(),
        1
    );

    prefill.deregister();
    assert_eq!(server.record_count(), 0);
    // A shutdown removes the node's records before it stops (no decode resolves a stopped
    // node until its TTL runs out).
    prefill
        .register(&backend, "c1", 3, Duration::from_secs(10), None)
        .unwrap();
    assert_eq!(server.record_count(), 1);
    prefill.shutdown(WAIT).unwrap();
    assert_eq!(server.record_count(), 0, "shutdown left the record");
    server.close();
    let e = decode
        .resolve(&backend, "c1", Role::Prefill, None, true)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::DiscoveryError, "{e}");
}
