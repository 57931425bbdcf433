//! RDMA tests. They skip, saying why, on hosts without an RDMA device, and fail when the
//! SoftRoCE lane requires a device (`KVWIRE_REQUIRE_RDMA=1`, set by `.ci/run` for the run
//! inside `scripts/softroce-vm.sh`).
//!
//! They check the device as kvwire sees it; the verbs primitives (`over_rdma`: verified
//! scattered transfers, the placeholder and stale-pages incidents, a late write after a
//! memory-window fence); the drivers (`driven`: concurrent transfers through per-reservation
//! windows, short transfer, stale pages, abort in flight, late write and recovery); and two
//! `kvwire bench --transport rdma` processes with a sender killed mid-transfer
//! (`two_processes`).

#[cfg(feature = "rdma")]
mod common;

use kvwire::host::{inspect, RdmaDevice};

/// The usable device, or `None` after printing why the test is skipped.
fn device(test: &str) -> Option<RdmaDevice> {
    let report = inspect();
    if let Some(d) = report.rdma.iter().find(|d| d.usable()) {
        return Some(d.clone());
    }
    let why = if report.rdma.is_empty() {
        "no RDMA device on this host".to_string()
    } else {
        format!(
            "no usable RDMA device (found {:?})",
            report.rdma.iter().map(|d| &d.name).collect::<Vec<_>>()
        )
    };
    if std::env::var_os("KVWIRE_REQUIRE_RDMA").is_some_and(|v| v == "1") {
        panic!("{test}: KVWIRE_REQUIRE_RDMA=1 but {why}");
    }
    println!(
        "SKIPPED {test}: {why} (run it under scripts/softroce-vm.sh with KVWIRE_REQUIRE_RDMA=1)"
    );
    None
}

#[test]
fn rdma_device_has_an_active_port_and_a_routable_roce_v2_gid() {
    let Some(d) = device("rdma_device_has_an_active_port_and_a_routable_roce_v2_gid") else {
        return;
    };
    // RoCE v2 over IPv4 needs an IPv4-mapped GID (::ffff:a.b.c.d) to address the peer.
    let mapped = d.gids.iter().any(|(_, _, gid, kind)| {
        kind == "RoCE v2" && gid.starts_with("0000:0000:0000:0000:0000:ffff:")
    });
    assert!(
        mapped,
        "{}: no IPv4-mapped RoCE v2 GID in {:?}",
        d.name, d.gids
    );
    let mtu_known = d
        .ports
        .iter()
        .any(|(_, state, mtu, _)| state.contains("ACTIVE") && mtu.parse::<u32>().is_ok());
    assert!(
        mtu_known,
        "{}: no active port with a known MTU: {:?}",
        d.name, d.ports
    );
}

#[test]
fn rdma_device_supports_type_2b_memory_windows() {
    let Some(d) = device("rdma_device_supports_type_2b_memory_windows") else {
        return;
    };
    match d.memory_windows {
        Some((type_2b, max_mw)) => assert!(
            type_2b && max_mw > 0,
            "{}: memory windows {:?}",
            d.name,
            d.memory_windows
        ),
        None => panic!(
            "{}: memory-window support unknown (ibv_devinfo missing?)",
            d.name
        ),
    }
}

/// Transfers over RDMA: the protocol's real sender and receiver sessions, driven by a small
/// synchronous driver over two RC queue pairs on one device (RDMA WRITEs for the pages,
/// SENDs for the frames, the COMMIT after the writes on the same queue pair).
#[cfg(feature = "rdma")]
mod over_rdma {
    use std::time::{Duration, Instant};

    use kvwire::checksum::{digest_transfer, DigestBinding};
    use kvwire::memory::{PageLease, PagePool, PoolGeometry, Scrub};
    use kvwire::proto::admission::{AdmissionPolicy, Request};
    use kvwire::proto::receiver::{
        ReceiverAction, ReceiverConfig, ReceiverEvent, ReceiverSession, ReservationRequest,
    };
    use kvwire::proto::sender::{
        SenderAction, SenderConfig, SenderEvent, SenderSession, WriteOutcome,
    };
    use kvwire::proto::wire::{DigestAlgorithm, Frame, Hello, Role};
    use kvwire::proto::FailureReason;
    use kvwire::testkit::{handshake, kv_pattern};
    use kvwire::transport::rdma::{RcLink, RdmaDevice, RdmaEvent, RdmaWrite, RegisteredMemory};

    const ID: u64 = 9;
    const PAGES: u32 = 8;

    fn geometry() -> PoolGeometry {
        PoolGeometry {
            tokens_per_page: 16,
            buffer_page_bytes: vec![4096, 8192, 4096],
            pages: 32,
        }
    }

    fn hello(role: Role) -> Hello {
        Hello {
            node_id: 1,
            role,
            layout: geometry().to_layout(b"rdma-test".to_vec()),
            digests: vec![DigestAlgorithm::XXH3_64],
            transport_params: vec![],
        }
    }

    fn digests(
        pool: &PagePool,
        pages: &[u32],
        t: kvwire::proto::wire::TransferRef,
        per_page: bool,
    ) -> kvwire::proto::wire::TransferDigests {
        let binding = DigestBinding {
            transfer_id: t.transfer_id,
            nonce: t.nonce,
        };
        let copies: Vec<Vec<Vec<u8>>> = (0..pool.buffers())
            .map(|b| {
                pages
                    .iter()
                    .map(|&p| pool.raw_page(p, b).unwrap().to_vec())
                    .collect()
            })
            .collect();
        digest_transfer(
            DigestAlgorithm::XXH3_64,
            binding,
            pool.buffers(),
            pages.len(),
            per_page,
            |b, o| &copies[b][o],
        )
        .unwrap()
    }

    /// The access descriptor of a reservation: per buffer, rkey (u32) and base address (u64).
    fn access(reg: &RegisteredMemory, buffers: usize) -> Vec<u8> {
        (0..buffers)
            .flat_map(|b| {
                [
                    reg.rkey(b).to_le_bytes().to_vec(),
                    reg.addr(b, 0).to_le_bytes().to_vec(),
                ]
                .concat()
            })
            .collect()
    }

    fn remote(access: &[u8], b: usize) -> (u32, u64) {
        let e = &access[b * 12..b * 12 + 12];
        (
            u32::from_le_bytes(e[..4].try_into().unwrap()),
            u64::from_le_bytes(e[4..].try_into().unwrap()),
        )
    }

    struct Outcome {
        delivered_bytes_ok: Option<bool>,
        receiver_failure: Option<FailureReason>,
        sender_verified: bool,
        dst_free_after: (u32, u32),
        writes_posted: usize,
        src_allocations: u64,
    }

    /// One transfer; `lost_page`: that page's writes are never posted but reported complete
    /// (the stale-pages incident); `placeholder`: the prompt is longer than the sender's pool,
    /// so admission rejects it (the placeholder incident).
    fn run(dev_name: &str, lost_page: Option<u32>, placeholder: bool) -> Outcome {
        let dev = RdmaDevice::open(Some(dev_name)).expect("open device");
        let g = geometry();
        let src = PagePool::new(g.clone(), Scrub::None).unwrap();
        let dst = PagePool::new(g.clone(), Scrub::None).unwrap();
        // The destination pages hold another tenant's bytes.
        for p in 0..g.pages {
            for b in 0..g.buffers() {
                dst.raw_page_mut(p, b).unwrap().fill(0xA5);
            }
        }
        let t0 = Instant::now();
        let src_reg = dev.register(src.memory()).unwrap();
        let dst_reg = dev.register(dst.memory()).unwrap();
        println!(
            "registered 2 x {} KiB in {:?}",
            g.total_bytes().unwrap() / 1024,
            t0.elapsed()
        );
        let mut a = RcLink::new(&dev, 256).unwrap();
        let mut b = RcLink::new(&dev, 64).unwrap();
        let (pa, pb) = (a.params(), b.params());
        a.connect(&pb).unwrap();
        b.connect(&pa).unwrap();

        let now = Instant::now();
        let (r_est, s_est) = handshake(now, hello(Role::RECEIVER), hello(Role::SENDER)).unwrap();
        let mut rs = ReceiverSession::new(&r_est, ReceiverConfig::default());
        let mut ss = SenderSession::new(&s_est, SenderConfig::default());

        // Scattered destination pages: every other page of 2 x PAGES.
        let mut all = dst.allocate(2 * PAGES).unwrap();
        let mut dst_leases: Vec<PageLease> = Vec::new();
        for (i, l) in all.drain(..).enumerate() {
            if i % 2 == 1 {
                dst_leases.push(l)
            } else {
                dst.release(l).unwrap()
            }
        }
        let dst_pages: Vec<u32> = dst_leases.iter().map(PageLease::page).collect();
        let tref = rs
            .reserve(
                now,
                ReservationRequest {
                    transfer_id: ID,
                    tokens: PAGES * 16,
                    pages: dst_pages.clone(),
                    digest: None,
                    page_digests: true,
                    timeout: Duration::from_secs(20),
                    access: access(&dst_reg, g.buffers()),
                },
            )
            .unwrap();

        // A placeholder run: the sender's pool (as admission sees it) is smaller than the prompt.
        let policy = AdmissionPolicy {
            tokens_per_page: 16,
            pool_pages: if placeholder { PAGES / 2 } else { g.pages },
            max_context_tokens: 512,
        };
        let mut sender_done = false;
        let mut src_leases = Vec::new();
        match policy.admit(Request {
            transfer_id: ID,
            tokens: u64::from(PAGES * 16),
        }) {
            Ok(admitted) => {
                src_leases = src.allocate(PAGES).unwrap();
                for (o, l) in src_leases.iter().enumerate() {
                    for buf in 0..g.buffers() {
                        kv_pattern(ID, o as u32, buf, &mut src.page_mut(l, buf).unwrap());
                    }
                }
                let pages = src_leases.iter().map(PageLease::page).collect();
                ss.submit(now, admitted, pages).unwrap();
            }
            Err(rejected) => {
                assert!(
                    placeholder,
                    "admission rejected a request that fits: {rejected:?}"
                );
                // Retired with its original error: no allocation, no data, ever.
                ss.retire(rejected);
                sender_done = true;
            }
        }
        let src_pages: Vec<u32> = src_leases.iter().map(PageLease::page).collect();

        let mut out = Outcome {
            delivered_bytes_ok: None,
            receiver_failure: None,
            sender_verified: false,
            dst_free_after: (0, 0),
            writes_posted: 0,
            src_allocations: 0,
        };
        let mut current = None;
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut events = Vec::new();
        while !(sender_done && (out.delivered_bytes_ok.is_some() || out.receiver_failure.is_some()))
        {
            assert!(Instant::now() < deadline, "RDMA transfer did not finish");
            let now = Instant::now();
            while let Some(f) = rs.poll_transmit() {
                b.post_frame(&f.to_bytes().unwrap()).unwrap();
            }
            while let Some(f) = ss.poll_transmit() {
                a.post_frame(&f.to_bytes().unwrap()).unwrap();
            }
            while let Some(act) = ss.poll_action() {
                match act {
                    SenderAction::ComputeDigests {
                        transfer,
                        page_digests,
                        ..
                    } => {
                        current = Some(transfer);
                        ss.handle_digests(
                            now,
                            transfer,
                            digests(&src, &src_pages, transfer, page_digests),
                        );
                    }
                    SenderAction::PostWrites {
                        transfer,
                        writes,
                        access,
                    } => {
                        let mut batch = Vec::new();
                        for w in &writes {
                            if Some(w.ordinal) == lost_page {
                                // A lying completion: the page never went out.
                                ss.handle_write_outcome(now, transfer, WriteOutcome::Completed, 1);
                                continue;
                            }
                            for buf in 0..g.buffers() {
                                let bytes = u64::from(g.buffer_page_bytes[buf]);
                                let (rkey, base) = remote(&access, buf);
                                batch.push(RdmaWrite {
                                    wr_id: u64::from(w.ordinal),
                                    local: (
                                        src_reg.lkey(buf),
                                        src_reg.addr(buf, u64::from(w.src_page) * bytes),
                                        bytes as u32,
                                    ),
                                    remote: (rkey, base + u64::from(w.dst_page) * bytes),
                                    signaled: buf + 1 == g.buffers(),
                                });
                            }
                        }
                        out.writes_posted += batch.len();
                        a.post_writes(&batch).unwrap();
                    }
                    SenderAction::CancelWrites(_) | SenderAction::ReleaseSource(_) => {}
                }
            }
            while let Some(act) = rs.poll_action() {
                match act {
                    // No memory windows yet: the region's rkey stays valid (see the module docs).
                    ReceiverAction::Fence(t) => rs.handle_fenced(now, t),
                    ReceiverAction::ComputeDigests {
                        transfer,
                        page_digests,
                        ..
                    } => rs.handle_digests(
                        now,
                        transfer,
                        digests(&dst, &dst_pages, transfer, page_digests),
                    ),
                    ReceiverAction::Quarantine(_) => {}
                    ReceiverAction::Release(_) => {
                        for l in dst_leases.drain(..) {
                            dst.release(l).unwrap();
                        }
                    }
                }
            }
            events.clear();
            a.poll(&mut events).unwrap();
            for e in events.drain(..) {
                match e {
                    RdmaEvent::WriteDone { ok, .. } => {
                        let t = current.expect("writes before digests");
                        let outcome = if ok {
                            WriteOutcome::Completed
                        } else {
                            WriteOutcome::Failed
                        };
                        ss.handle_write_outcome(now, t, outcome, 1);
                    }
                    RdmaEvent::Frame(bytes) => {
                        let (f, _) = Frame::decode(&bytes).unwrap();
                        let _ = ss.handle_frame(now, f);
                    }
                    RdmaEvent::SendFailed(s) => panic!("sender SEND failed: {s}"),
                    RdmaEvent::LocalDone { .. } => {}
                }
            }
            b.poll(&mut events).unwrap();
            for e in events.drain(..) {
                match e {
                    RdmaEvent::Frame(bytes) => {
                        let (f, _) = Frame::decode(&bytes).unwrap();
                        let _ = rs.handle_frame(now, f);
                    }
                    RdmaEvent::SendFailed(s) => panic!("receiver SEND failed: {s}"),
                    RdmaEvent::WriteDone { .. } | RdmaEvent::LocalDone { .. } => {}
                }
            }
            while let Some(e) = rs.poll_event() {
                match e {
                    ReceiverEvent::Delivered(d) => {
                        assert_eq!(d.transfer, tref);
                        let mut want = Vec::new();
                        let ok = dst_leases.iter().enumerate().all(|(o, l)| {
                            (0..g.buffers()).all(|buf| {
                                let page = dst.page(l, buf).unwrap();
                                want.resize(page.len(), 0);
                                kv_pattern(ID, o as u32, buf, &mut want);
                                page == want[..]
                            })
                        });
                        out.delivered_bytes_ok = Some(ok);
                        for l in dst_leases.drain(..) {
                            dst.release(l).unwrap();
                        }
                    }
                    ReceiverEvent::Failed { reason, .. } => out.receiver_failure = Some(reason),
                }
            }
            while let Some(e) = ss.poll_event() {
                sender_done = true;
                out.sender_verified |= matches!(e, SenderEvent::Verified(_));
            }
        }
        for l in src_leases {
            src.release(l).unwrap();
        }
        out.dst_free_after = (dst.free_pages(), dst.capacity_pages());
        out.src_allocations = src.stats().allocations;
        out
    }

    #[test]
    fn verified_transfer_of_scattered_pages_across_buffers_over_rdma() {
        let Some(d) =
            super::device("verified_transfer_of_scattered_pages_across_buffers_over_rdma")
        else {
            return;
        };
        let out = run(&d.name, None, false);
        assert_eq!(out.receiver_failure, None);
        assert_eq!(
            out.delivered_bytes_ok,
            Some(true),
            "delivered bytes differ from the sender's"
        );
        assert!(out.sender_verified);
        assert_eq!(
            out.dst_free_after.0, out.dst_free_after.1,
            "receiver pages leaked"
        );
    }

    #[test]
    fn stale_pages_over_rdma_fail_on_digest_and_deliver_nothing() {
        let Some(d) = super::device("stale_pages_over_rdma_fail_on_digest_and_deliver_nothing")
        else {
            return;
        };
        let out = run(&d.name, Some(2), false);
        assert_eq!(out.delivered_bytes_ok, None, "stale pages were delivered");
        assert_eq!(
            out.receiver_failure,
            Some(FailureReason::DigestMismatch {
                buffer: 0,
                page: Some(2)
            })
        );
        assert!(!out.sender_verified);
        assert_eq!(
            out.dst_free_after.0, out.dst_free_after.1,
            "receiver pages leaked"
        );
    }

    #[test]
    fn placeholder_over_rdma_is_rejected_before_any_write() {
        let Some(d) = super::device("placeholder_over_rdma_is_rejected_before_any_write") else {
            return;
        };
        let out = run(&d.name, None, true);
        match &out.receiver_failure {
            Some(FailureReason::Rejected { code, detail }) => {
                assert_eq!(*code, kvwire::proto::wire::ErrorCode::PROMPT_EXCEEDS_POOL);
                assert!(
                    detail.contains("128 tokens"),
                    "original error lost: {detail}"
                );
            }
            other => panic!("expected the original admission error over RDMA, got {other:?}"),
        }
        assert_eq!(
            out.writes_posted, 0,
            "a rejected request reached the transfer stage"
        );
        assert_eq!(
            out.src_allocations, 0,
            "a rejected request allocated source pages"
        );
        assert_eq!(out.delivered_bytes_ok, None);
        assert_eq!(
            out.dst_free_after.0, out.dst_free_after.1,
            "receiver pages leaked"
        );
    }

    /// Polls `link` until `pick` finds its event (or 20 s pass).
    fn wait_for(link: &mut RcLink, mut pick: impl FnMut(&RdmaEvent) -> bool) -> RdmaEvent {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut events = Vec::new();
        loop {
            link.poll(&mut events).unwrap();
            if let Some(i) = events.iter().position(&mut pick) {
                return events.swap_remove(i);
            }
            events.clear();
            assert!(Instant::now() < deadline, "no completion within 20 s");
        }
    }

    /// The fence on RDMA: the receiver's memory window over the reserved pages admits writes
    /// until it is invalidated; a late write with its rkey then fails at the NIC (remote access
    /// error) and the page keeps its bytes.
    #[test]
    fn late_write_after_the_fence_is_refused_at_the_nic_and_the_connection_recovers() {
        let Some(d) = super::device(
            "late_write_after_the_fence_is_refused_at_the_nic_and_the_connection_recovers",
        ) else {
            return;
        };
        let dev = RdmaDevice::open(Some(&d.name)).unwrap();
        let g = geometry();
        let src = PagePool::new(g.clone(), Scrub::None).unwrap();
        let dst = PagePool::new(g.clone(), Scrub::None).unwrap();
        for p in 0..g.pages {
            src.raw_page_mut(p, 0).unwrap().fill(0x11);
            dst.raw_page_mut(p, 0).unwrap().fill(0xA5);
        }
        let src_reg = dev.register(src.memory()).unwrap();
        let dst_reg = dev.register(dst.memory()).unwrap();
        let mut a = RcLink::new(&dev, 64).unwrap();
        let mut b = RcLink::new(&dev, 64).unwrap();
        let (pa, pb) = (a.params(), b.params());
        a.connect(&pb).unwrap();
        b.connect(&pa).unwrap();

        // A window over pages 4..8 of buffer 0 (a reservation's pages).
        let page = u64::from(g.buffer_page_bytes[0]);
        let mut window = dev.alloc_window().unwrap();
        let t = Instant::now();
        let rkey = b
            .bind_window(&mut window, &dst_reg, 0, 4 * page, 4 * page, 1)
            .unwrap();
        assert_eq!(
            wait_for(&mut b, |e| matches!(
                e,
                RdmaEvent::LocalDone { wr_id: 1, .. }
            )),
            RdmaEvent::LocalDone { wr_id: 1, ok: true }
        );
        let bind_cost = t.elapsed();

        let write = |a: &mut RcLink, id: u64, dst_page: u64| {
            a.post_writes(&[RdmaWrite {
                wr_id: id,
                local: (src_reg.lkey(0), src_reg.addr(0, 0), page as u32),
                remote: (rkey, dst_reg.addr(0, dst_page * page)),
                signaled: true,
            }])
            .unwrap();
            wait_for(
                a,
                |e| matches!(e, RdmaEvent::WriteDone { wr_id, .. } if *wr_id == id),
            )
        };
        // Inside the window, before the fence: lands.
        assert_eq!(
            write(&mut a, 10, 5),
            RdmaEvent::WriteDone {
                wr_id: 10,
                ok: true
            }
        );
        assert!(dst.raw_page(5, 0).unwrap().iter().all(|&x| x == 0x11));

        // The fence.
        let t = Instant::now();
        b.invalidate(rkey, 2).unwrap();
        assert_eq!(
            wait_for(&mut b, |e| matches!(
                e,
                RdmaEvent::LocalDone { wr_id: 2, .. }
            )),
            RdmaEvent::LocalDone { wr_id: 2, ok: true }
        );
        let invalidate_cost = t.elapsed();

        // A late write with the fenced rkey: refused at the NIC, the page untouched.
        assert_eq!(
            write(&mut a, 11, 6),
            RdmaEvent::WriteDone {
                wr_id: 11,
                ok: false
            }
        );
        assert!(
            dst.raw_page(6, 0).unwrap().iter().all(|&x| x == 0xA5),
            "a late write landed after the fence"
        );
        println!("memory window bind {bind_cost:?}, invalidate {invalidate_cost:?} (software RDMA under emulation)");

        // The connection recovers: both queue pairs are rebuilt and reconnected, a fresh
        // binding admits writes again, and the fenced rkey stays dead.
        let t = Instant::now();
        a.recover().unwrap();
        b.recover().unwrap();
        let (pa, pb) = (a.params(), b.params());
        a.connect(&pb).unwrap();
        b.connect(&pa).unwrap();
        // A fresh window (type-2 windows belong to the queue pair they were bound on, which
        // was rebuilt), as each new reservation gets.
        let mut window2 = dev.alloc_window().unwrap();
        let rkey2 = b
            .bind_window(&mut window2, &dst_reg, 0, 4 * page, 4 * page, 3)
            .unwrap();
        assert_eq!(
            wait_for(&mut b, |e| matches!(
                e,
                RdmaEvent::LocalDone { wr_id: 3, .. }
            )),
            RdmaEvent::LocalDone { wr_id: 3, ok: true }
        );
        assert_ne!(rkey2, rkey, "a rebind must not revive the fenced rkey");
        a.post_writes(&[RdmaWrite {
            wr_id: 12,
            local: (src_reg.lkey(0), src_reg.addr(0, 0), page as u32),
            remote: (rkey2, dst_reg.addr(0, 7 * page)),
            signaled: true,
        }])
        .unwrap();
        assert_eq!(
            wait_for(&mut a, |e| matches!(
                e,
                RdmaEvent::WriteDone { wr_id: 12, .. }
            )),
            RdmaEvent::WriteDone {
                wr_id: 12,
                ok: true
            }
        );
        assert!(dst.raw_page(7, 0).unwrap().iter().all(|&x| x == 0x11));
        assert!(dst.raw_page(6, 0).unwrap().iter().all(|&x| x == 0xA5));
        println!("recovery (reset, reconnect, rebind) {:?}", t.elapsed());
        drop((window, window2));
    }
}

/// The RDMA drivers ([`RdmaSender`], [`RdmaReceiver`]): memory windows bound per reservation
/// and invalidated at every fence, frames as SENDs, recovery after a failed queue pair.
#[cfg(feature = "rdma")]
mod driven {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use kvwire::config::EngineConfig;
    use kvwire::memory::{PagePool, PoolGeometry, Scrub};
    use kvwire::proto::admission::Request;
    use kvwire::proto::handshake::Established;
    use kvwire::proto::receiver::ReceiverConfig;
    use kvwire::proto::sender::{SenderConfig, SenderEvent};
    use kvwire::proto::wire::{DigestAlgorithm, ErrorCode, Frame, Hello, Role, TransferRef};
    use kvwire::proto::{CountField, FailureReason};
    use kvwire::receiver::{ReceiveOutcome, ReserveParams};
    use kvwire::testkit::{handshake, kv_pattern};
    use kvwire::transport::rdma::driver::{LinkState, RdmaReceiver, RdmaSender, SenderFaults};
    use kvwire::transport::rdma::RdmaDevice;

    const TPP: u32 = 16;

    fn geometry() -> PoolGeometry {
        PoolGeometry {
            tokens_per_page: TPP,
            buffer_page_bytes: vec![4096, 8192, 4096],
            pages: 64,
        }
    }

    struct Link {
        s: RdmaSender,
        r: RdmaReceiver,
        s_est: Established,
        r_est: Established,
        /// Receiver outcomes and sender events seen so far, by transfer id.
        outcomes: Vec<ReceiveOutcome>,
        events: Vec<SenderEvent>,
    }

    impl Link {
        /// Both drivers on `dev`, connected; the receiver's pages hold 0xA5 (another tenant's
        /// bytes). With `held`, the receiver's pool is fragmented first: `held` leases of every
        /// other page stay taken, so reservations are scattered.
        fn new(dev: &str) -> Self {
            Self::with_lanes(dev, 1)
        }

        /// As [`Link::new`] with `lanes` queue pairs per side.
        fn with_lanes(dev: &str, lanes: usize) -> Self {
            let dev = Arc::new(RdmaDevice::open(Some(dev)).expect("open device"));
            let hello = |role| Hello {
                node_id: 1,
                role,
                layout: geometry().to_layout(b"rdma-driver".to_vec()),
                digests: vec![DigestAlgorithm::XXH3_64],
                transport_params: vec![],
            };
            let (r_est, s_est) =
                handshake(Instant::now(), hello(Role::RECEIVER), hello(Role::SENDER)).unwrap();
            let engine = EngineConfig::new(u64::from(64 * TPP));
            let src = PagePool::new(geometry(), Scrub::None).unwrap();
            let dst = PagePool::new(geometry(), Scrub::None).unwrap();
            for p in 0..64 {
                for b in 0..3 {
                    dst.raw_page_mut(p, b).unwrap().fill(0xA5);
                }
            }
            let mut s = RdmaSender::with_queue_pairs(
                lanes,
                &dev,
                &s_est,
                src,
                &engine,
                SenderConfig::default(),
                8,
            )
            .unwrap();
            let mut r = RdmaReceiver::with_queue_pairs(
                lanes,
                Arc::clone(&dev),
                &r_est,
                dst,
                &engine,
                ReceiverConfig::default(),
            )
            .unwrap();
            let (sp, rp) = (s.params(), r.params());
            s.connect(&rp).unwrap();
            r.connect(&sp).unwrap();
            Self {
                s,
                r,
                s_est,
                r_est,
                outcomes: Vec::new(),
                events: Vec::new(),
            }
        }

        /// Reserves `pages` pages for `id` and submits the request with its KV pattern.
        fn start(&mut self, id: u64, pages: u32, page_digests: bool) -> TransferRef {
            let now = Instant::now();
            let t = self
                .r
                .reserve(
                    now,
                    ReserveParams {
                        transfer_id: id,
                        tokens: pages * TPP,
                        timeout: Duration::from_secs(30),
                        digest: None,
                        page_digests,
                    },
                )
                .expect("reserve");
            let admitted = self
                .s
                .endpoint()
                .admit(Request {
                    transfer_id: id,
                    tokens: u64::from(pages * TPP),
                })
                .expect("admit");
            self.s
                .endpoint()
                .submit(now, admitted, |o, b, page| kv_pattern(id, o, b, page))
                .expect("submit");
            t
        }

        /// Polls both sides once.
        fn poll(&mut self) {
            let now = Instant::now();
            self.s.poll(now).expect("sender poll");
            self.r.poll(now).expect("receiver poll");
            while let Some(o) = self.r.poll_outcome() {
                self.outcomes.push(o);
            }
            while let Some(e) = self.s.poll_event() {
                self.events.push(e);
            }
        }

        /// Polls until `done` holds (or 60 s pass: a failure, not a hang).
        fn until(&mut self, mut done: impl FnMut(&Self) -> bool) {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !done(self) {
                assert!(
                    Instant::now() < deadline,
                    "RDMA drivers made no progress in 60 s"
                );
                self.poll();
            }
        }

        fn finished(&self, id: u64) -> bool {
            self.outcomes.iter().any(|o| match o {
                ReceiveOutcome::Verified(kv) => kv.transfer.transfer_id == id,
                ReceiveOutcome::Failed { transfer, .. } => transfer.transfer_id == id,
            }) && self.events.iter().any(|e| event_id(e) == id)
        }

        /// Takes the outcome of `id`: for a verified transfer, whether every byte is the
        /// sender's (then the pages go back to the pool); else the failure.
        fn take(&mut self, id: u64) -> Result<bool, FailureReason> {
            let i = self
                .outcomes
                .iter()
                .position(|o| match o {
                    ReceiveOutcome::Verified(kv) => kv.transfer.transfer_id == id,
                    ReceiveOutcome::Failed { transfer, .. } => transfer.transfer_id == id,
                })
                .expect("an outcome");
            match self.outcomes.remove(i) {
                ReceiveOutcome::Verified(kv) => {
                    let pool = self.r.endpoint().pool();
                    let mut want = Vec::new();
                    let same = (0..kv.pages()).all(|o| {
                        (0..3).all(|b| {
                            let got = kv.page(pool, o, b).unwrap();
                            want.resize(got.len(), 0);
                            kv_pattern(id, o as u32, b, &mut want);
                            *got == want[..]
                        })
                    });
                    self.r.endpoint().release(kv).unwrap();
                    Ok(same)
                }
                ReceiveOutcome::Failed { reason, .. } => Err(reason),
            }
        }

        fn sender_event(&self, id: u64) -> &SenderEvent {
            self.events
                .iter()
                .find(|e| event_id(e) == id)
                .expect("a sender event")
        }

        fn pools_full(&mut self) -> bool {
            let r = self.r.endpoint().pool();
            let rf = r.free_pages() == r.capacity_pages();
            let s = self.s.endpoint().pool();
            rf && s.free_pages() == s.capacity_pages()
        }

        /// Rebuilds both queue pairs and sessions and reconnects them.
        fn recover(&mut self) {
            let now = Instant::now();
            let sp = self.s.recover(now, &self.s_est).unwrap();
            let rp = self.r.recover(now, &self.r_est).unwrap();
            self.s.connect(&rp).unwrap();
            self.r.connect(&sp).unwrap();
            self.poll();
        }
    }

    fn event_id(e: &SenderEvent) -> u64 {
        match e {
            SenderEvent::Verified(t) => t.transfer_id,
            SenderEvent::Failed { transfer, .. } => transfer.transfer_id,
            #[allow(unreachable_patterns)]
            _ => u64::MAX,
        }
    }

    #[test]
    fn concurrent_transfers_into_scattered_pages_verify_through_memory_windows() {
        let Some(d) = super::device(
            "concurrent_transfers_into_scattered_pages_verify_through_memory_windows",
        ) else {
            return;
        };
        let mut l = Link::new(&d.name);
        // Fragment the receiver's pool: take every page, give back every other one, so
        // each reservation is many runs (one window per run and buffer).
        let all =
            l.r.reserve(
                Instant::now(),
                ReserveParams {
                    transfer_id: 1000,
                    tokens: 64 * TPP,
                    timeout: Duration::from_secs(30),
                    digest: None,
                    page_digests: false,
                },
            )
            .unwrap();
        // Verify nothing of it: abort it at once; its pages come back after the fence.
        assert!(l
            .r
            .endpoint()
            .abort(Instant::now(), all.transfer_id, ErrorCode::CANCELLED));
        l.until(|l| !l.outcomes.is_empty());
        l.outcomes.clear();
        l.events.clear();
        let binds_before = l.r.stats().binds;
        // Six transfers, three in flight at a time.
        let mut next = 1u64;
        let mut done = 0;
        while done < 6 {
            while next <= 6 && next < done + 4 {
                l.start(next, 5, false);
                next += 1;
            }
            l.poll();
            for id in 1..next {
                if l.finished(id) && l.outcomes.iter().any(|o| matches!(o, ReceiveOutcome::Verified(kv) if kv.transfer.transfer_id == id) || matches!(o, ReceiveOutcome::Failed{transfer, ..} if transfer.transfer_id == id)) {
                    assert_eq!(l.take(id), Ok(true), "transfer {id}");
                    assert!(matches!(l.sender_event(id), SenderEvent::Verified(_)));
                    done += 1;
                }
            }
        }
        let st = l.r.stats();
        assert!(
            st.binds - binds_before >= 6 * 3,
            "one window per buffer at least"
        );
        assert_eq!(
            st.invalidations, st.binds,
            "every bound window was invalidated"
        );
        assert_eq!(st.link_failures, 0);
        assert!(l.pools_full(), "pages leaked");
    }

    /// Several queue pairs per connection: reservations take the lanes in turn, each
    /// transfer's windows, writes and COMMIT stay on its lane, and all verify.
    #[test]
    fn transfers_spread_over_three_queue_pairs_all_verify() {
        let Some(d) = super::device("transfers_spread_over_three_queue_pairs_all_verify") else {
            return;
        };
        let mut l = Link::with_lanes(&d.name, 3);
        assert_eq!(l.s.params().len(), 3);
        for id in 1..=6u64 {
            l.start(id, 3, id % 2 == 0);
        }
        l.until(|l| (1..=6).all(|id| l.finished(id)));
        for id in 1..=6u64 {
            assert_eq!(l.take(id), Ok(true), "transfer {id}");
            assert!(matches!(l.sender_event(id), SenderEvent::Verified(_)));
        }
        let st = l.r.stats();
        assert_eq!(st.invalidations, st.binds);
        assert_eq!(st.link_failures, 0);
        // Lane affinity is what this proves: a type-2 window admits writes only through the
        // queue pair it was bound on, so a transfer written on another lane than its
        // reservation's never verifies (checked: routing every write to lane 0 makes this
        // test fail with a commit timeout).
        assert!(l.pools_full(), "pages leaked");
    }

    #[test]
    fn short_transfer_over_rdma_fails_on_counts() {
        let Some(d) = super::device("short_transfer_over_rdma_fails_on_counts") else {
            return;
        };
        let mut l = Link::new(&d.name);
        // A buggy sender: writes page 0 of 8 and commits counts for one page.
        l.s.set_faults(SenderFaults {
            skip_write: Some(Box::new(|w| w.ordinal > 0)),
            rewrite_frame: Some(Box::new(|f| match f {
                Frame::Commit(mut c) => {
                    c.pages = 1;
                    c.tokens = TPP;
                    c.bytes = 4096 + 8192 + 4096;
                    Some(Frame::Commit(c))
                }
                other => Some(other),
            })),
        });
        l.start(3, 8, false);
        l.until(|l| l.finished(3));
        assert_eq!(
            l.take(3),
            Err(FailureReason::CountMismatch {
                field: CountField::Tokens,
                expected: u64::from(8 * TPP),
                got: u64::from(TPP)
            })
        );
        match l.sender_event(3) {
            SenderEvent::Failed { reason, .. } => assert!(
                matches!(reason, FailureReason::Nacked { code, .. } if *code == ErrorCode::COUNT_MISMATCH),
                "{reason:?}"
            ),
            other => panic!("the sender must learn why: {other:?}"),
        }
        assert_eq!(l.r.stats().invalidations, l.r.stats().binds);
        assert!(l.pools_full(), "pages leaked");
    }

    #[test]
    fn stale_pages_through_the_driver_fail_on_digest_naming_the_page() {
        let Some(d) =
            super::device("stale_pages_through_the_driver_fail_on_digest_naming_the_page")
        else {
            return;
        };
        let mut l = Link::new(&d.name);
        l.s.set_faults(SenderFaults {
            skip_write: Some(Box::new(|w| w.ordinal == 2)),
            rewrite_frame: None,
        });
        l.start(4, 6, true);
        l.until(|l| l.finished(4));
        assert_eq!(
            l.take(4),
            Err(FailureReason::DigestMismatch {
                buffer: 0,
                page: Some(2)
            })
        );
        assert!(l.pools_full(), "pages leaked");
    }

    #[test]
    fn abort_while_writes_are_in_flight_fences_then_the_link_serves_the_next_transfer() {
        let Some(d) = super::device(
            "abort_while_writes_are_in_flight_fences_then_the_link_serves_the_next_transfer",
        ) else {
            return;
        };
        let mut l = Link::new(&d.name);
        let t = l.start(5, 32, false);
        // Let the sender post its first writes, then abort on the receiver.
        l.until(|l| l.s.stats().writes_posted > 0);
        assert!(l
            .r
            .endpoint()
            .abort(Instant::now(), t.transfer_id, ErrorCode::CANCELLED));
        l.until(|l| {
            l.finished(5) || l.s.state() == LinkState::Broken || l.r.state() == LinkState::Broken
        });
        l.until(|l| l.outcomes.iter().any(|o| matches!(o, ReceiveOutcome::Failed { transfer, .. } if transfer.transfer_id == 5)));
        assert_eq!(
            l.take(5),
            Err(FailureReason::LocalAbort {
                code: ErrorCode::CANCELLED
            })
        );
        // Writes that reached the NIC after the invalidation failed there (a remote access
        // error breaks the link); either way nothing was delivered and no page is lost.
        let broke = l.s.state() == LinkState::Broken || l.r.state() == LinkState::Broken;
        println!(
            "abort in flight: link broke: {broke}, sender: {:?}",
            l.s.stats()
        );
        if broke {
            l.recover();
        }
        l.until(|l| l.events.iter().any(|e| event_id(e) == 5));
        assert!(
            !matches!(l.sender_event(5), SenderEvent::Verified(_)),
            "the sender reported an aborted transfer verified"
        );
        assert!(l.pools_full(), "pages leaked");
        l.start(6, 4, false);
        l.until(|l| l.finished(6));
        assert_eq!(l.take(6), Ok(true));
    }

    #[test]
    fn late_write_after_the_fence_fails_at_the_nic_leaves_the_page_and_the_link_recovers() {
        let Some(d) = super::device(
            "late_write_after_the_fence_fails_at_the_nic_leaves_the_page_and_the_link_recovers",
        ) else {
            return;
        };
        let mut l = Link::new(&d.name);
        let t = l.start(7, 4, false);
        l.until(|l| l.finished(7));
        assert_eq!(l.take(7), Ok(true));
        // The transfer is over: its windows are invalidated and its pages are free. A sender
        // that keeps writing with the old rkeys:
        let snapshot: Vec<Vec<u8>> = (0..64)
            .map(|p| l.r.endpoint().pool().raw_page(p, 0).unwrap().to_vec())
            .collect();
        let page = l.s.inject_late_write(t).unwrap().expect("descriptor known");
        l.until(|l| l.s.state() == LinkState::Broken);
        assert_eq!(l.s.stats().link_failures, 1);
        for p in 0..64u32 {
            assert_eq!(
                *l.r.endpoint().pool().raw_page(p, 0).unwrap(),
                snapshot[p as usize][..],
                "a late write landed in page {p} (aimed at {page})"
            );
        }
        assert!(l.pools_full(), "pages leaked");
        // The connection recovers and the next transfer verifies.
        l.recover();
        l.start(8, 4, false);
        l.until(|l| l.finished(8));
        assert_eq!(l.take(8), Ok(true));
        assert!(l.pools_full(), "pages leaked");
    }
}

/// Two `kvwire bench --transport rdma` processes (TCP bootstrap, then everything over RC
/// queue pairs on rxe0): a whole run verifies; a sender killed with SIGKILL mid-transfer
/// is noticed through the bootstrap connection, its transfers fail, every page comes back;
/// the next sender is served.
#[cfg(feature = "rdma")]
mod two_processes {
    use std::process::{Child, Command, Stdio};
    use std::time::Duration;

    use super::common::process::{assert_receiver_account, finish, wait_for_line, Reaped};

    fn kvwire(dev: &str, args: &[&str]) -> Child {
        Command::new(env!("CARGO_BIN_EXE_kvwire"))
            .args(["bench", "--transport", "rdma", "--device", dev])
            .args([
                "--page-sizes",
                "64K",
                "--buffers",
                "4",
                "--pages",
                "8",
                "--bytes",
                "64M",
                "--json",
            ])
            .args(args)
            .env("KVWIRE_PSK", "72646d612d74776f2d70726f6365737365732d6b6579")
            .env_remove("KVWIRE_PSK_FILE")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvwire")
    }

    #[test]
    fn two_processes_over_rdma_survive_a_killed_sender() {
        let Some(d) = super::device("two_processes_over_rdma_survive_a_killed_sender") else {
            return;
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        // Two queue pairs per connection, authenticated (KVWIRE_PSK): each lane has its own
        // channel.
        let mut receiver = Reaped(Some(kvwire(
            &d.name,
            &[
                "--listen",
                &addr,
                "--connections",
                "3",
                "--queue-pairs",
                "2",
            ],
        )));
        let sender = || kvwire(&d.name, &["--connect", &addr, "--queue-pairs", "2"]);

        let (code, json, err) = finish(sender(), Duration::from_secs(300));
        assert_eq!(code, Some(0), "first sender failed: {err} {json}");
        assert_eq!(json["transport"], "rdma");
        let case = &json["cases"][0];
        assert_eq!(case["verified"], case["transfers"], "{case}");

        let mut victim = sender();
        wait_for_line(&mut victim, "connected over rdma");
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            victim.try_wait().expect("wait").is_none(),
            "the sender finished before it could be killed; the case is too small"
        );
        victim.kill().expect("SIGKILL");
        let _ = victim.wait();

        let (code, json, err) = finish(sender(), Duration::from_secs(300));
        assert_eq!(code, Some(0), "sender after the kill failed: {err} {json}");
        let case = &json["cases"][0];
        assert_eq!(case["verified"], case["transfers"], "{case}");

        let (code, json, err) = finish(receiver.take(), Duration::from_secs(120));
        assert_receiver_account(code, &json, &err);
    }
}
