//! RDMA tests. They skip, saying why, on hosts without an RDMA device, and fail when the
//! SoftRoCE lane requires a device (`KVWIRE_REQUIRE_RDMA=1`, set by `.ci/run` for the run
//! inside `scripts/softroce-vm.sh`).
//!
//! They check the device as kvwire sees it; the one NIC-level primitive below the driver
//! (`primitive`: a late write after a memory-window fence fails at the NIC); the production
//! drivers over the RDMA transport, driven by the `Pair` harness in real time (`driven`:
//! concurrent transfers through per-reservation windows, several queue pairs, the placeholder,
//! a short transfer, stale pages, abort in flight, a late write breaking the link and a new
//! connection over the same memory, the fault matrix's RDMA subset); the engine API over RDMA
//! (`engine`: the same integrator code as over TCP). Two `kvwire bench --transport rdma`
//! processes with a sender killed mid-transfer are the CLI's test (cli/tests/rdma_processes.rs).

#[cfg(feature = "rdma")]
mod common;

// What a test asserts kvwire logs.
#[cfg(feature = "rdma")]
#[path = "common/captured_log.rs"]
mod captured_log;

// `device()`: the usable device or a printed skip (shared with cli/tests/rdma_processes.rs).
#[path = "common/rdma_device.rs"]
mod rdma_device;
use rdma_device::device;

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

/// The verbs primitive under the fence, below the driver: a memory window over a
/// reservation's pages admits writes until it is invalidated; a late write with its rkey then
/// fails at the NIC (remote access error) and the page keeps its bytes.
#[cfg(feature = "rdma")]
mod primitive {
    use std::time::{Duration, Instant};

    use kvwire::memory::{PagePool, PoolGeometry, Scrub};
    use kvwire::transport::rdma::{RcLink, RdmaDevice, RdmaEvent, RdmaWrite, RegisteredMemory};

    fn geometry() -> PoolGeometry {
        PoolGeometry {
            tokens_per_page: 16,
            buffer_page_bytes: vec![4096, 8192, 4096],
            pages: 32,
        }
    }

    /// Two connected queue pairs on one device: `a` writes from `src` (every byte 0x11 in
    /// buffer 0) into `dst` (every byte 0xA5), whose windows `b` binds. Fields drop in
    /// order: the links, then the registrations, then the pools and the device.
    struct Linked {
        a: RcLink,
        b: RcLink,
        src_reg: RegisteredMemory,
        dst_reg: RegisteredMemory,
        src: PagePool,
        dst: PagePool,
        dev: RdmaDevice,
        /// Bytes of a page of buffer 0.
        page: u64,
    }

    fn linked(name: &str) -> Linked {
        let dev = RdmaDevice::open(Some(name)).unwrap();
        let g = geometry();
        let src = PagePool::new(g.clone(), Scrub::None).unwrap();
        let dst = PagePool::new(g.clone(), Scrub::None).unwrap();
        for p in 0..g.pages {
            src.raw_page_mut(p, 0).unwrap().fill(0x11);
            dst.raw_page_mut(p, 0).unwrap().fill(0xA5);
        }
        let src_reg = dev.register(src.memory()).unwrap();
        let dst_reg = dev.register(dst.memory()).unwrap();
        let mut a = RcLink::new(&dev, 64, None).unwrap();
        let mut b = RcLink::new(&dev, 64, None).unwrap();
        let (pa, pb) = (a.params(), b.params());
        a.connect(&pb).unwrap();
        b.connect(&pa).unwrap();
        Linked {
            a,
            b,
            src_reg,
            dst_reg,
            src,
            dst,
            dev,
            page: u64::from(g.buffer_page_bytes[0]),
        }
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

    /// `TransportConfig::Rdma::ack_timeout` reaches the device: each end's queue pair holds
    /// the exponent it was given (or the default, 14) once connected, as `ibv_query_qp`
    /// reports it; an exponent outside 1 to 31 is refused before it could reach a queue pair.
    #[test]
    fn each_queue_pair_connects_with_the_ack_timeout_it_was_given() {
        let Some(d) = super::device("each_queue_pair_connects_with_the_ack_timeout_it_was_given")
        else {
            return;
        };
        let dev = RdmaDevice::open(Some(&d.name)).unwrap();
        let mut a = RcLink::new(&dev, 64, None).unwrap();
        let mut b = RcLink::new(&dev, 64, None).unwrap();
        for bad in [0, 32] {
            assert!(a.set_ack_timeout(bad).is_err(), "exponent {bad} accepted");
        }
        a.set_ack_timeout(18).unwrap();
        let (pa, pb) = (a.params(), b.params());
        a.connect(&pb).unwrap();
        b.connect(&pa).unwrap();
        assert_eq!(a.ack_timeout().unwrap(), 18);
        assert_eq!(
            b.ack_timeout().unwrap(),
            kvwire::config::DEFAULT_ACK_TIMEOUT
        );
    }

    /// The lane-state log of a connection closed for an unresponsive peer names each queue
    /// pair's state as the device holds it (`ibv_query_qp`): INIT before connecting, RTS
    /// once connected, ERR after a failure; with its receives posted.
    #[test]
    fn a_queue_pairs_description_names_the_state_the_device_holds() {
        let Some(d) = super::device("a_queue_pairs_description_names_the_state_the_device_holds")
        else {
            return;
        };
        let dev = RdmaDevice::open(Some(&d.name)).unwrap();
        let mut a = RcLink::new(&dev, 64, None).unwrap();
        let mut b = RcLink::new(&dev, 64, None).unwrap();
        let before = a.describe();
        assert!(before.starts_with("state Init,"), "{before}");
        let (pa, pb) = (a.params(), b.params());
        a.connect(&pb).unwrap();
        b.connect(&pa).unwrap();
        let connected = a.describe();
        assert!(connected.starts_with("state ReadyToSend,"), "{connected}");
        assert!(
            connected.ends_with("0 SENDs outstanding (0 signaled), 32 receives posted"),
            "{connected}"
        );
        a.force_error().unwrap();
        let failed = a.describe();
        assert!(failed.starts_with("state Error,"), "{failed}");
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
        let Linked {
            dev,
            src: _src,
            dst,
            src_reg,
            dst_reg,
            mut a,
            mut b,
            page,
        } = linked(&d.name);

        // A window over pages 4..8 of buffer 0 (a reservation's pages).
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

    /// Control frames keep their bytes when many more are sent than there are send slots:
    /// only every eighth SEND asks for a completion, and a slot is written again only after
    /// a completion has retired its SEND (a slot rewritten early would send the later
    /// frame's bytes, or a mix, in place of the earlier one).
    #[test]
    fn frames_beyond_the_send_slots_arrive_intact_and_in_order() {
        let Some(d) = super::device("frames_beyond_the_send_slots_arrive_intact_and_in_order")
        else {
            return;
        };
        let dev = RdmaDevice::open(Some(&d.name)).unwrap();
        let mut a = RcLink::new(&dev, 64, None).unwrap();
        let mut b = RcLink::new(&dev, 64, None).unwrap();
        let (pa, pb) = (a.params(), b.params());
        a.connect(&pb).unwrap();
        b.connect(&pa).unwrap();
        let frame = |i: u32| -> Vec<u8> {
            (0..(64 + i % 300))
                .map(|k| (i.wrapping_mul(31) ^ k) as u8)
                .collect()
        };
        let total = 40 * kvwire::transport::rdma::SEND_SLOTS as u32;
        let (mut sent, mut got) = (0u32, Vec::new());
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut events = Vec::new();
        while got.len() < total as usize {
            assert!(
                Instant::now() < deadline,
                "{} of {total} frames arrived",
                got.len()
            );
            // As many as the slots take, then poll both ends (a busy slot is retried later).
            while sent < total {
                match a.post_frame(&frame(sent)) {
                    Ok(()) => sent += 1,
                    Err(kvwire::transport::rdma::RdmaError::SendSlotsBusy) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            a.poll(&mut events).unwrap();
            assert!(
                !events.iter().any(|e| matches!(e, RdmaEvent::SendFailed(_))),
                "{events:?}"
            );
            events.clear();
            b.poll(&mut events).unwrap();
            for e in events.drain(..) {
                if let RdmaEvent::Frame(bytes) = e {
                    got.push(bytes);
                }
            }
        }
        for (i, bytes) in got.iter().enumerate() {
            assert_eq!(bytes, &frame(i as u32), "frame {i} arrived changed");
        }
    }

    /// A window is bound again after its invalidation (the receiver reuses windows): the
    /// rebind takes a new key, the rkey of its fenced binding stays dead (a late write with it
    /// fails at the NIC and lands nowhere, not even in the range the window now covers), and
    /// the new rkey admits writes into the new range only.
    #[test]
    fn a_window_bound_again_after_its_fence_refuses_the_fenced_rkey() {
        let Some(d) = super::device("a_window_bound_again_after_its_fence_refuses_the_fenced_rkey")
        else {
            return;
        };
        let Linked {
            dev,
            src: _src,
            dst,
            src_reg,
            dst_reg,
            mut a,
            mut b,
            page,
        } = linked(&d.name);
        let write = |a: &mut RcLink, id: u64, rkey: u32, dst_page: u64| {
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
        let done = |id: u64, ok: bool| RdmaEvent::WriteDone { wr_id: id, ok };

        // Bound over pages 4..8 (unsignaled, behind one doorbell), used, fenced.
        let mut windows = vec![dev.alloc_window().unwrap()];
        b.bind_windows(&mut windows, &dst_reg, &[(0, 4 * page, 4 * page)], None)
            .unwrap();
        let old = windows[0].rkey;
        assert_eq!(write(&mut a, 10, old, 4), done(10, true));
        b.invalidate_all(&[old], 1).unwrap();
        assert_eq!(
            wait_for(&mut b, |e| matches!(
                e,
                RdmaEvent::LocalDone { wr_id: 1, .. }
            )),
            RdmaEvent::LocalDone { wr_id: 1, ok: true }
        );
        // The same window bound again, over pages 8..12 this time.
        b.bind_windows(&mut windows, &dst_reg, &[(0, 8 * page, 4 * page)], Some(2))
            .unwrap();
        assert_eq!(
            wait_for(&mut b, |e| matches!(
                e,
                RdmaEvent::LocalDone { wr_id: 2, .. }
            )),
            RdmaEvent::LocalDone { wr_id: 2, ok: true },
            "the device refused to bind an invalidated window again"
        );
        let new = windows[0].rkey;
        assert_ne!(new, old, "a rebind must take a new key");
        assert_eq!(new >> 8, old >> 8, "the same window");
        // The new rkey writes into the new range.
        assert_eq!(write(&mut a, 11, new, 9), done(11, true));
        assert!(dst.raw_page(9, 0).unwrap().iter().all(|&x| x == 0x11));
        // A late write with the fenced rkey, aimed at the range the window covers now and at
        // its old range: refused at the NIC; neither page changes.
        assert_eq!(write(&mut a, 12, old, 10), done(12, false));
        assert!(
            dst.raw_page(10, 0).unwrap().iter().all(|&x| x == 0xA5),
            "a write with the fenced rkey landed through the window's new binding"
        );
        assert!(dst.raw_page(5, 0).unwrap().iter().all(|&x| x == 0xA5));
        drop(windows);
    }
}

/// The production drivers over the RDMA transport, both ends in this process on one device
/// (two sets of RC queue pairs connected to each other), driven by the `Pair` harness in real
/// time with its fault injector at the seam.
#[cfg(feature = "rdma")]
mod driven {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::common::{assert_invariants, reserve, send, transfer};
    use kvwire::memory::{PageLease, PagePool};
    use kvwire::proto::liveness::LivenessConfig;
    use kvwire::proto::wire::ErrorCode;
    use kvwire::proto::wire::Frame;
    use kvwire::proto::{CountField, FailureReason};
    use kvwire::testkit::{Fault, FaultRule, Pair, PairConfig, Side, Step};
    use kvwire::transport::rdma::descriptor::AccessKind;
    use kvwire::transport::rdma::{bootstrap, RdmaDevice, RdmaReceiver, RdmaSender};
    use kvwire::transport::{Closed, Transport, TransportEvent};
    use kvwire::TransferId;

    type RdmaPair = Pair<RdmaSender, RdmaReceiver>;

    /// Software RDMA under emulation moves a few MB/s: generous.
    const LIMIT: Duration = Duration::from_secs(60);

    fn config() -> PairConfig {
        let mut cfg = PairConfig::small();
        // Commit deadlines long enough for emulated RDMA.
        cfg.sender.verdict_timeout = Duration::from_secs(30);
        cfg
    }

    /// Both ends over `lanes` queue pairs on `dev`, over the given pools.
    fn pair_over(
        dev: &Arc<RdmaDevice>,
        cfg: &PairConfig,
        pools: (Arc<PagePool>, Arc<PagePool>),
        lanes: u16,
    ) -> RdmaPair {
        let (s_pool, r_pool) = pools;
        let ack = kvwire::config::DEFAULT_ACK_TIMEOUT;
        let (s, r) =
            bootstrap::in_process(dev, &s_pool, &r_pool, lanes, cfg.window, false, ack).unwrap();
        assert_eq!(
            r.access_kind(),
            AccessKind::WINDOWS,
            "rxe has memory windows"
        );
        Pair::with_transports(cfg, Instant::now(), (s_pool, s), (r_pool, r)).unwrap()
    }

    fn pair(name: &str, lanes: u16) -> (Arc<RdmaDevice>, RdmaPair) {
        let dev = Arc::new(RdmaDevice::open(Some(name)).unwrap());
        let cfg = config();
        let pools = cfg.pools().unwrap();
        let p = pair_over(&dev, &cfg, pools, lanes);
        (dev, p)
    }

    /// Two lanes on `name`, with short ABORT_ACK waits (moves and aborts end in seconds).
    fn moving_pair(name: &str) -> RdmaPair {
        let mut cfg = config();
        cfg.sender.abort_ack_timeout = Duration::from_secs(2);
        cfg.receiver.abort_ack_timeout = Duration::from_secs(2);
        let dev = Arc::new(RdmaDevice::open(Some(name)).unwrap());
        let pools = cfg.pools().unwrap();
        pair_over(&dev, &cfg, pools, 2)
    }

    /// The receiver reserves `ids` (`tokens` each, page digests) before the sender has any of
    /// them; returns once every RESERVE reached the sender (announced: parked).
    async fn reserve_until_announced(
        pair: &mut RdmaPair,
        ids: std::ops::RangeInclusive<u64>,
        tokens: u32,
    ) {
        let n = ids.clone().count();
        for id in ids {
            let now = pair.now;
            let params =
                kvwire::ReserveParams::new(TransferId(id), tokens, LIMIT).with_page_digests();
            pair.receiver.reserve(now, params).unwrap();
        }
        let start = Instant::now();
        while pair
            .sender_events
            .iter()
            .filter(|e| matches!(e, kvwire::proto::sender::SenderEvent::Announced { .. }))
            .count()
            < n
        {
            assert!(start.elapsed() < LIMIT, "{:?}", pair.sender_events);
            pair.drive_live(Duration::from_millis(20)).await;
        }
    }

    /// Lane `lane`'s queue pairs fail under both ends (as a port or link going down does).
    fn fail_lane_at_both_ends(pair: &mut RdmaPair, lane: usize) {
        pair.sender
            .transport_mut()
            .inner_mut()
            .inject_lane_failure(lane)
            .unwrap();
        pair.receiver
            .transport_mut()
            .inner_mut()
            .inject_lane_failure(lane)
            .unwrap();
    }

    /// `bootstrap::prepare` (which every connection's ends go through) gives each queue pair
    /// of a connection the configured ACK timeout: both ends of a two-lane connection hold it
    /// once connected, as `ibv_query_qp` reports it.
    #[test]
    fn every_lane_of_a_connection_holds_the_configured_ack_timeout() {
        let Some(d) = super::device("every_lane_of_a_connection_holds_the_configured_ack_timeout")
        else {
            return;
        };
        let dev = Arc::new(RdmaDevice::open(Some(&d.name)).unwrap());
        let cfg = config();
        let (s_pool, r_pool) = cfg.pools().unwrap();
        assert_ne!(kvwire::config::DEFAULT_ACK_TIMEOUT, 18);
        let (s, r) =
            bootstrap::in_process(&dev, &s_pool, &r_pool, 2, cfg.window, true, 18).unwrap();
        assert_eq!(s.ack_timeouts().unwrap(), [18, 18], "the sender's lanes");
        assert_eq!(r.ack_timeouts().unwrap(), [18, 18], "the receiver's lanes");
    }

    /// Every window bound was invalidated (every reservation fenced at the NIC).
    fn assert_all_fenced(pair: &RdmaPair) {
        let st = pair.receiver.transport().inner().stats();
        assert!(st.binds > 0, "no memory window was bound");
        assert_eq!(st.invalidations, st.binds, "{st:?}");
        assert_eq!(pair.open_scopes(), 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn concurrent_transfers_into_scattered_pages_verify_through_memory_windows() {
        let Some(d) = super::device(
            "concurrent_transfers_into_scattered_pages_verify_through_memory_windows",
        ) else {
            return;
        };
        let (_dev, mut pair) = pair(&d.name, 1);
        // Every other destination page taken: each reservation's pages are scattered, one
        // window per page and buffer.
        let holes: Vec<PageLease> = pair
            .receiver
            .pool()
            .lease_pages(&(0..64).filter(|p| p % 2 == 1).collect::<Vec<_>>())
            .unwrap();
        // 2 to 6 pages each: 20 of the 32 free pages.
        for id in 1..=5u64 {
            transfer(&mut pair, id, 16 * (id as u32 + 1));
        }
        assert!(pair.drive_live(LIMIT).await, "did not settle");
        assert_eq!(pair.verified.len(), 5, "{:?}", pair.receiver_failures);
        for id in 1..=5 {
            assert!(pair.sender_verified(TransferId(id)));
        }
        for l in holes {
            pair.receiver.pool().release(l).unwrap();
        }
        assert_all_fenced(&pair);
        assert_invariants(&pair);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn transfers_spread_over_three_queue_pairs_all_verify() {
        let Some(d) = super::device("transfers_spread_over_three_queue_pairs_all_verify") else {
            return;
        };
        let (_dev, mut pair) = pair(&d.name, 3);
        for id in 1..=6u64 {
            transfer(&mut pair, id, 64);
        }
        assert!(pair.drive_live(LIMIT).await, "did not settle");
        // A window admits writes only through the queue pair it was bound on: every
        // transfer verifying proves its writes and COMMIT kept to its lane.
        assert_eq!(pair.verified.len(), 6, "{:?}", pair.receiver_failures);
        assert_all_fenced(&pair);
        assert_invariants(&pair);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn placeholder_over_rdma_is_rejected_before_any_write() {
        let Some(d) = super::device("placeholder_over_rdma_is_rejected_before_any_write") else {
            return;
        };
        let (_dev, mut pair) = pair(&d.name, 1);
        // Longer than the prefill's context: rejected at admission, retired with its error.
        assert!(send(&mut pair, 5, 5000).is_err());
        reserve(&mut pair, 5, 96);
        assert!(pair.drive_live(LIMIT).await);
        assert!(pair.verified.is_empty());
        assert!(matches!(
            pair.receiver_failure(TransferId(5)),
            Some(FailureReason::Rejected { code, .. }) if *code == ErrorCode::PROMPT_EXCEEDS_CONTEXT
        ));
        assert_eq!(pair.sender.transport().inner().stats().writes_posted, 0);
        assert_all_fenced(&pair);
        assert_invariants(&pair);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn short_transfer_over_rdma_fails_on_counts() {
        let Some(d) = super::device("short_transfer_over_rdma_fails_on_counts") else {
            return;
        };
        let (_dev, mut pair) = pair(&d.name, 1);
        // A buggy sender: writes page 0 of 8 and commits counts for one page.
        pair.fault(FaultRule::on(
            TransferId(3),
            Fault::ShortTransfer { pages: 1 },
        ));
        transfer(&mut pair, 3, 8 * 16);
        assert!(pair.drive_live(LIMIT).await);
        assert_eq!(
            pair.receiver_failure(TransferId(3)),
            Some(&FailureReason::CountMismatch {
                field: CountField::Tokens,
                expected: 128,
                got: 16
            })
        );
        assert!(matches!(
            pair.sender_failure(TransferId(3)),
            Some(FailureReason::Nacked { code, .. }) if *code == ErrorCode::COUNT_MISMATCH
        ));
        assert_all_fenced(&pair);
        assert_invariants(&pair);
    }

    /// Coverage: a COMMIT for a page that received no bytes does not verify even when its
    /// digests match the page's stale contents. Transfer 2 sends transfer 1's KV again into
    /// exactly the same destination pages, and its write of ordinal 1 is lost (reported
    /// complete): the stale page holds the very bytes the sender digested. The receiver
    /// scrubbed the reserved pages with a pattern of its own before publishing their rkeys,
    /// so the unwritten page no longer holds them.
    #[tokio::test(flavor = "current_thread")]
    async fn a_commit_for_a_page_that_got_no_bytes_fails_even_when_stale_contents_match() {
        let Some(d) = super::device(
            "a_commit_for_a_page_that_got_no_bytes_fails_even_when_stale_contents_match",
        ) else {
            return;
        };
        let (_dev, mut pair) = pair(&d.name, 1);
        let tpp = pair.receiver.pool().geometry().tokens_per_page;
        let pages = vec![9, 3, 14, 6];
        for id in [1, 2].map(TransferId) {
            if id == TransferId(2) {
                pair.fault(FaultRule::on(id, Fault::DropWrite { ordinal: 1 }));
            }
            let now = pair.now;
            let params = kvwire::ReserveParams::new(id, 4 * tpp, LIMIT)
                .into_pages(pages.clone())
                .with_page_digests();
            pair.receiver.reserve(now, params).unwrap();
            let admitted = pair
                .sender
                .admit(
                    now,
                    kvwire::Request {
                        transfer_id: id,
                        tokens: u64::from(4 * tpp),
                    },
                )
                .unwrap();
            // The same KV both times: transfer 1's.
            pair.sender
                .submit(now, admitted, |o, b, p| {
                    kvwire::testkit::kv_pattern(TransferId(1), o, b, p)
                })
                .unwrap();
            assert!(pair.drive_live(LIMIT).await);
        }
        assert_eq!(
            pair.verified,
            vec![TransferId(1)],
            "{:?}",
            pair.receiver_failures
        );
        assert_eq!(
            pair.receiver_failure(TransferId(2)),
            Some(&FailureReason::DigestMismatch {
                buffer: 0,
                page: Some(1)
            })
        );
        assert!(pair.receiver.transport().inner().stats().pages_scrubbed >= 8);
        assert_all_fenced(&pair);
        assert_invariants(&pair);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn stale_pages_over_rdma_fail_on_digest_naming_the_page() {
        let Some(d) = super::device("stale_pages_over_rdma_fail_on_digest_naming_the_page") else {
            return;
        };
        let (_dev, mut pair) = pair(&d.name, 1);
        // A lying completion: page 2 is never written but reported complete.
        pair.fault(FaultRule::on(
            TransferId(4),
            Fault::DropWrite { ordinal: 2 },
        ));
        transfer(&mut pair, 4, 6 * 16);
        assert!(pair.drive_live(LIMIT).await);
        assert!(pair.verified.is_empty(), "stale pages were delivered");
        assert_eq!(
            pair.receiver_failure(TransferId(4)),
            Some(&FailureReason::DigestMismatch {
                buffer: 0,
                page: Some(2)
            })
        );
        assert_all_fenced(&pair);
        assert_invariants(&pair);
    }

    /// SPEC §8.3 over RDMA: a decode that keeps sending (its PINGs reach the prefill, so it is
    /// never silent) but stops posting receives. Once the receives it had posted are used, the
    /// prefill's SENDs (PINGs, COMMITs) wait in receiver-not-ready retries for ever, and so do
    /// the WRITEs posted behind them on the queue pair: a transfer sent then holds its source
    /// pages in the drain, where no protocol deadline runs. The prefill declares the peer
    /// unresponsive once its SENDs made no progress for its liveness timeout: the connection
    /// closes, every transfer fails safely, every source page comes back; nothing verifies.
    /// At that close the prefill logs its lane's state once: the queue pair as the device
    /// holds it, with the SENDs stuck on it.
    #[tokio::test(flavor = "current_thread")]
    async fn a_peer_that_sends_but_posts_no_receives_is_declared_unresponsive() {
        let Some(d) =
            super::device("a_peer_that_sends_but_posts_no_receives_is_declared_unresponsive")
        else {
            return;
        };
        let logs = crate::captured_log::CapturedLog::default();
        let _logging = tracing::subscriber::set_default(logs.warn_subscriber());
        let mut cfg = config();
        // No protocol deadline may end these transfers first: only the liveness rule can.
        cfg.sender.verdict_timeout = Duration::from_secs(600);
        cfg.sender.reservation_timeout = Duration::from_secs(600);
        let dev = Arc::new(RdmaDevice::open(Some(&d.name)).unwrap());
        let pools = cfg.pools().unwrap();
        let mut pair = pair_over(&dev, &cfg, pools, 1);
        let now = Instant::now();
        let quick = Duration::from_millis(100);
        pair.sender.enable_liveness(
            now,
            LivenessConfig {
                interval: quick,
                timeout: Duration::from_secs(2),
            },
        );
        // The decode hears nothing once its receives are used: it must not give up first.
        pair.receiver.enable_liveness(
            now,
            LivenessConfig {
                interval: quick,
                timeout: Duration::from_secs(600),
            },
        );
        pair.receiver
            .transport_mut()
            .inner_mut()
            .stop_reposting_receives();
        let tpp = pair.receiver.pool().geometry().tokens_per_page;
        let reserve = |pair: &mut RdmaPair, id: u64| {
            let now = pair.now;
            let params =
                kvwire::ReserveParams::new(TransferId(id), 4 * tpp, Duration::from_secs(600))
                    .with_page_digests();
            pair.receiver.reserve(now, params).unwrap();
        };
        // The prefill's PINGs use up the decode's receives; a reservation keeps the pair from
        // settling meanwhile.
        reserve(&mut pair, 1);
        let start = Instant::now();
        while pair.receiver.transport().inner().receives_posted() > 0 {
            assert!(
                start.elapsed() < LIMIT,
                "the decode's receives were never used"
            );
            assert!(!pair.drive_live(Duration::from_millis(500)).await);
        }
        assert!(pair.sender.closed().is_none(), "{:?}", pair.sender.closed());
        // Transfer 1's writes go out, then its COMMIT, which waits; transfer 2's writes are
        // posted behind that COMMIT and wait with it.
        send(&mut pair, 1, u64::from(4 * tpp)).unwrap();
        assert!(!pair.drive_live(Duration::from_millis(100)).await);
        reserve(&mut pair, 2);
        send(&mut pair, 2, u64::from(4 * tpp)).unwrap();
        let start = Instant::now();
        while pair.sender.session().open_transfers() > 0 {
            assert!(
                start.elapsed() < LIMIT,
                "the prefill still waits on a peer that takes nothing: {:?}",
                pair.sender_events
            );
            pair.drive_live(Duration::from_millis(500)).await;
        }
        assert!(
            matches!(pair.sender.closed(), Some(Closed::Unresponsive { .. })),
            "{:?}",
            pair.sender.closed()
        );
        for id in [1, 2].map(TransferId) {
            assert!(
                matches!(
                    pair.sender_failure(id),
                    Some(FailureReason::PeerUnresponsive | FailureReason::Unconfirmed { .. })
                ),
                "transfer {id}: {:?}",
                pair.sender_failure(id)
            );
        }
        assert!(
            pair.sender.pool().held_pages().is_empty(),
            "source pages held"
        );
        let text = logs.text();
        let lane_states: Vec<&str> = text.lines().filter(|l| l.contains("lane state:")).collect();
        assert_eq!(lane_states.len(), 1, "one lane, logged once:\n{text}");
        let line = lane_states[0];
        assert!(
            line.contains("lane state: state ReadyToSend,") && line.contains("lane=0"),
            "{line}"
        );
        assert!(
            !line.contains("; 0 SENDs outstanding"),
            "no SEND stuck: {line}"
        );
        // In-process, the decode has no bootstrap connection whose end would tell it: its
        // process closes it, as that end would.
        let now = Instant::now();
        pair.receiver.close(now);
        assert!(pair.drive_live(LIMIT).await);
        assert!(pair.verified.is_empty(), "{:?}", pair.verified);
        assert_invariants(&pair);
    }

    /// SPEC §9.2, several rails: one lane's queue pairs fail mid-run (moved to the error
    /// state at both ends, as when its rail's port goes down) while the other lane works. The
    /// transfers bound to the failed lane move (SPEC §9.2, moving a transfer): the receiver
    /// fences their reservations, scrubs and binds the same pages on the live lane and
    /// reserves them again; the sender writes them there. Every transfer verifies, nothing
    /// unverified is delivered, every page comes back, and the connection goes on: later
    /// transfers all take the live lane and verify.
    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_lanes_transfers_move_to_the_live_lane_and_the_connection_goes_on() {
        let Some(d) = super::device(
            "a_failed_lanes_transfers_move_to_the_live_lane_and_the_connection_goes_on",
        ) else {
            return;
        };
        let mut pair = moving_pair(&d.name);
        // The receiver takes the lanes in turn: 1 and 3 on lane 0, 2 and 4 on lane 1. Every
        // reservation reaches the sender (announced: nothing submitted yet) before lane 1
        // fails; the sender submits 1 and 2 before the failure, 3 and 4 after it.
        reserve_until_announced(&mut pair, 1..=4, 4 * 16).await;
        for id in 1..=2u64 {
            send(&mut pair, id, 4 * 16).unwrap();
        }
        fail_lane_at_both_ends(&mut pair, 1);
        let start = Instant::now();
        while pair.sender.transport().inner().live_lanes() > 1
            || pair.receiver.transport().inner().live_lanes() > 1
        {
            assert!(start.elapsed() < LIMIT, "a failed lane went unnoticed");
            pair.drive_live(Duration::from_millis(20)).await;
        }
        for id in 3..=4u64 {
            send(&mut pair, id, 4 * 16).unwrap();
        }
        assert!(pair.drive_live(LIMIT).await, "did not settle");
        assert!(pair.sender.closed().is_none(), "{:?}", pair.sender.closed());
        assert_eq!(pair.sender.transport().inner().live_lanes(), 1);
        // What the connection's stats report (SenderConnStats/ReceiverConnStats::failed_lanes),
        // through the fault injector as through the engine.
        use kvwire::transport::Transport;
        assert_eq!(pair.sender.transport().failed_lanes(), 1);
        assert_eq!(pair.receiver.transport().failed_lanes(), 1);
        for id in (1..=4).map(TransferId) {
            assert!(
                pair.sender_verified(id) && pair.verified.contains(&id),
                "transfer {id}: {:?}",
                pair.sender_failure(id)
            );
        }
        // Both reservations of lane 1 moved; at the sender 2 was open (its writes posted) and
        // moved, 4 was parked and its new reservation superseded the old one.
        assert_eq!(pair.receiver.stats().moves, 2);
        assert_eq!(pair.sender.session().stats().moves, 1);
        assert_invariants(&pair);
        // Every later reservation takes the live lane, and verifies.
        for id in 5..=8u64 {
            let now = pair.now;
            let params =
                kvwire::ReserveParams::new(TransferId(id), 4 * 16, LIMIT).with_page_digests();
            pair.receiver.reserve(now, params).unwrap();
            send(&mut pair, id, 4 * 16).unwrap();
        }
        assert!(pair.drive_live(LIMIT).await, "did not settle");
        for id in (5..=8).map(TransferId) {
            assert!(
                pair.sender_verified(id),
                "transfer {id}: {:?}",
                pair.sender_failure(id)
            );
        }
        assert!(pair.sender.closed().is_none() && pair.receiver.closed().is_none());
        assert!(kvwire::transport::Transport::failed_lanes(pair.sender.transport()) >= 1);
        assert_invariants(&pair);
    }

    /// SPEC §9.2, striping a transfer over lanes: with two pages per stripe, each 12-page
    /// reservation is bound over both lanes (half its pages' windows on each queue pair), its
    /// RESERVE sent once the other lane's binds completed, and the sender writes each half
    /// through the lane its windows were bound on (a window admits writes through no other
    /// queue pair: a write routed wrongly fails at the NIC and fails the lane). Every
    /// transfer verifies at both ends with both lanes alive and nothing moved, and each
    /// reservation's windows are invalidated on both lanes at its fence.
    #[tokio::test(flavor = "current_thread")]
    async fn transfers_striped_over_two_lanes_verify_and_every_lane_fences_its_windows() {
        let Some(d) = super::device(
            "transfers_striped_over_two_lanes_verify_and_every_lane_fences_its_windows",
        ) else {
            return;
        };
        let (_dev, mut pair) = pair(&d.name, 2);
        pair.receiver
            .transport_mut()
            .inner_mut()
            .set_stripe_pages(2);
        for id in 1..=4u64 {
            transfer(&mut pair, id, 12 * 16);
        }
        // Two pages: not striped (one stripe's worth).
        transfer(&mut pair, 5, 2 * 16);
        assert!(pair.drive_live(LIMIT).await, "did not settle");
        for id in (1..=5).map(TransferId) {
            assert!(
                pair.sender_verified(id) && pair.verified.contains(&id),
                "transfer {id}: {:?} / {:?}",
                pair.sender_failure(id),
                pair.receiver_failures
            );
        }
        let st = pair.receiver.transport().inner().stats();
        assert_eq!((st.striped, st.striped_lanes), (4, 8), "{st:?}");
        assert_eq!(pair.sender.transport().inner().live_lanes(), 2);
        assert_eq!(pair.receiver.transport().inner().live_lanes(), 2);
        assert_eq!(pair.receiver.stats().moves, 0);
        assert_eq!(pair.sender.transport().inner().stats().writes_refused, 0);
        assert_all_fenced(&pair);
        assert_invariants(&pair);
    }

    /// SPEC §9.2, striping and moving: the second lane fails under both ends while striped
    /// transfers are being written over both. Every reservation with a stripe on it moves
    /// whole (its windows on the live lane deallocated too; reserved again, unstriped, on
    /// the live lane) and verifies; nothing unverified is delivered and every page comes
    /// back.
    #[tokio::test(flavor = "current_thread")]
    async fn striped_transfers_move_whole_when_one_of_their_lanes_fails() {
        let Some(d) = super::device("striped_transfers_move_whole_when_one_of_their_lanes_fails")
        else {
            return;
        };
        let mut pair = moving_pair(&d.name);
        pair.receiver
            .transport_mut()
            .inner_mut()
            .set_stripe_pages(2);
        reserve_until_announced(&mut pair, 1..=3, 12 * 16).await;
        // 1 and 2 written (over both lanes) before the failure, 3 after it.
        for id in 1..=2u64 {
            send(&mut pair, id, 12 * 16).unwrap();
        }
        fail_lane_at_both_ends(&mut pair, 1);
        send(&mut pair, 3, 12 * 16).unwrap();
        assert!(pair.drive_live(LIMIT).await, "did not settle");
        assert!(pair.sender.closed().is_none(), "{:?}", pair.sender.closed());
        assert_eq!(pair.sender.transport().inner().live_lanes(), 1);
        assert_eq!(pair.receiver.transport().inner().live_lanes(), 1);
        for id in (1..=3).map(TransferId) {
            assert!(
                pair.sender_verified(id) && pair.verified.contains(&id),
                "transfer {id}: {:?} / {:?}",
                pair.sender_failure(id),
                pair.receiver_failures
            );
        }
        let st = pair.receiver.transport().inner().stats();
        assert_eq!(st.striped, 3, "every first reservation striped: {st:?}");
        // Each had a stripe on the failed lane and none had its COMMIT yet when it failed
        // (3 was not even submitted): all three moved, onto the one live lane, unstriped.
        assert_eq!(pair.receiver.stats().moves, 3);
        assert_invariants(&pair);
        // Later reservations take the live lane alone, and verify.
        for id in 4..=5u64 {
            transfer(&mut pair, id, 12 * 16);
        }
        assert!(pair.drive_live(LIMIT).await, "did not settle");
        for id in (4..=5).map(TransferId) {
            assert!(
                pair.sender_verified(id) && pair.verified.contains(&id),
                "transfer {id}"
            );
        }
        assert_eq!(pair.receiver.transport().inner().stats().striped, 3);
        assert_invariants(&pair);
    }

    /// SPEC §9.2, striping and moving, the decode first: lane 1 fails under the decode only;
    /// the prefill, which has not seen it, then writes its striped transfers over both
    /// lanes. The decode, which saw its own queue pair fail, leaves the transfers' windows on
    /// the live lane bound for its lane timeout and two heartbeat intervals before it fences
    /// them (a write into an invalidated window would fail lane 0
    /// too, and with it the connection): the prefill's writes there land, its writes on lane
    /// 1 fail and it sees the lane fail, and then the transfers move whole to lane 0 and
    /// verify. The connection goes on over lane 0.
    #[tokio::test(flavor = "current_thread")]
    async fn a_striped_transfers_live_stripes_stay_writable_until_the_sender_can_have_seen_the_lane_fail(
    ) {
        let Some(d) = super::device(
            "a_striped_transfers_live_stripes_stay_writable_until_the_sender_can_have_seen_the_lane_fail",
        ) else {
            return;
        };
        let mut pair = moving_pair(&d.name);
        pair.receiver
            .transport_mut()
            .inner_mut()
            .set_stripe_pages(2);
        // Heartbeats on every lane, as engines run them: the prefill's PINGs on lane 1 making
        // no progress while lane 0's do is how it sees the lane fail (on SoftRoCE its writes
        // there retry for ever).
        let now = Instant::now();
        let heartbeats = LivenessConfig {
            interval: Duration::from_millis(250),
            timeout: Duration::from_secs(10),
        };
        pair.sender.enable_liveness(now, heartbeats);
        pair.receiver.enable_liveness(now, heartbeats);
        reserve_until_announced(&mut pair, 1..=3, 12 * 16).await;
        pair.receiver
            .transport_mut()
            .inner_mut()
            .inject_lane_failure(1)
            .unwrap();
        let start = Instant::now();
        while pair.receiver.transport().inner().live_lanes() > 1 {
            assert!(
                start.elapsed() < LIMIT,
                "the decode did not see its lane fail"
            );
            pair.drive_live(Duration::from_millis(5)).await;
        }
        assert_eq!(
            pair.sender.transport().inner().live_lanes(),
            2,
            "the prefill saw the lane fail already: the race this test needs did not happen"
        );
        for id in 1..=3u64 {
            send(&mut pair, id, 12 * 16).unwrap();
        }
        let settled = pair.drive_live(LIMIT).await;
        assert!(
            settled,
            "did not settle: prefill {:?}, decode failures {:?}, verified {:?}, live lanes {} / {}, closed {:?} / {:?}",
            pair.sender_events,
            pair.receiver_failures,
            pair.verified,
            pair.sender.transport().inner().live_lanes(),
            pair.receiver.transport().inner().live_lanes(),
            pair.sender.closed(),
            pair.receiver.closed()
        );
        assert!(pair.sender.closed().is_none(), "{:?}", pair.sender.closed());
        assert!(
            pair.receiver.closed().is_none(),
            "{:?}",
            pair.receiver.closed()
        );
        assert_eq!(pair.sender.transport().inner().live_lanes(), 1);
        assert_eq!(pair.receiver.transport().inner().live_lanes(), 1);
        for id in (1..=3).map(TransferId) {
            assert!(
                pair.sender_verified(id) && pair.verified.contains(&id),
                "transfer {id}: {:?} / {:?}",
                pair.sender_failure(id),
                pair.receiver_failures
            );
        }
        assert_eq!(pair.receiver.stats().moves, 3);
        assert_invariants(&pair);
    }

    /// Regression (SPEC §9.2, a lane that fails): a RESERVE still queued on a lane when the
    /// lane fails was moved with the lane's other unsent frames to a live lane, though its
    /// access names windows deallocated with the failed lane; the sender then wrote through
    /// the live lane with those rkeys, failed it too, and lost the connection. Such a RESERVE
    /// is now never sent: the transfer moves, and its new RESERVE is the one the sender sees.
    ///
    /// Lane 1 breaks silently under the decode (the prefill's queue pair goes to the error
    /// state): the decode's SENDs there are never acknowledged, fill its send slots, and the
    /// RESERVEs bound on lane 1 beyond them wait until the decode finds the lane stalled.
    #[tokio::test(flavor = "current_thread")]
    async fn a_reserve_queued_on_a_lane_that_fails_is_not_sent_on_another() {
        let Some(d) = super::device("a_reserve_queued_on_a_lane_that_fails_is_not_sent_on_another")
        else {
            return;
        };
        let mut cfg = config();
        cfg.sender.abort_ack_timeout = Duration::from_secs(2);
        cfg.receiver.abort_ack_timeout = Duration::from_secs(2);
        cfg.sender.reservation_timeout = Duration::from_secs(30);
        // One-page transfers, more on each lane than it has send slots.
        let n = 2 * (kvwire::transport::rdma::SEND_SLOTS as u64 + 8);
        cfg.sender_pool.pages = n as u32 + 16;
        cfg.receiver_pool.pages = n as u32 + 16;
        let dev = Arc::new(RdmaDevice::open(Some(&d.name)).unwrap());
        let pools = cfg.pools().unwrap();
        let mut pair = pair_over(&dev, &cfg, pools, 2);
        let now = Instant::now();
        let heartbeats = LivenessConfig {
            interval: Duration::from_millis(250),
            timeout: Duration::from_secs(30),
        };
        pair.sender.enable_liveness(now, heartbeats);
        pair.receiver.enable_liveness(now, heartbeats);
        pair.sender
            .transport_mut()
            .inner_mut()
            .inject_lane_failure(1)
            .unwrap();
        // Odd ids on lane 0, even ids on lane 1 (the receiver takes the lanes in turn).
        for id in 1..=n {
            let now = pair.now;
            let params = kvwire::ReserveParams::new(TransferId(id), 16, LIMIT).with_page_digests();
            pair.receiver.reserve(now, params).unwrap();
        }
        for id in 1..=n {
            send(&mut pair, id, 16).unwrap();
        }
        assert!(pair.drive_live(LIMIT).await, "did not settle");
        assert!(
            pair.sender.closed().is_none() && pair.receiver.closed().is_none(),
            "closed {:?} / {:?}; prefill {:?}, decode failures {:?}, verified {:?}, live lanes {} / {}, decode moves {}",
            pair.sender.closed(),
            pair.receiver.closed(),
            pair.sender_events,
            pair.receiver_failures,
            pair.verified,
            pair.sender.transport().inner().live_lanes(),
            pair.receiver.transport().inner().live_lanes(),
            pair.receiver.stats().moves
        );
        assert_eq!(pair.receiver.transport().inner().live_lanes(), 1);
        for id in (1..=n).map(TransferId) {
            assert!(
                pair.sender_verified(id) && pair.verified.contains(&id),
                "transfer {id}: {:?} / {:?}",
                pair.sender_failure(id),
                pair.receiver_failures
            );
        }
        assert_eq!(pair.receiver.stats().moves, n / 2);
        assert_invariants(&pair);
    }

    /// SPEC §8.3, frames held unsent are bounded over RDMA too: a queue pair holding
    /// `MAX_UNSENT_FRAMES` (65,536) frames it could not post ends the connection as
    /// unresponsive at once, instead of growing for as long as the not-reading verdict takes.
    #[tokio::test(flavor = "current_thread")]
    async fn frames_held_unsent_on_a_queue_pair_are_bounded() {
        let Some(d) = super::device("frames_held_unsent_on_a_queue_pair_are_bounded") else {
            return;
        };
        let (_dev, mut pair) = pair(&d.name, 1);
        let now = pair.now;
        let t = pair.sender.transport_mut().inner_mut();
        // Queued without polling: none is posted yet.
        for n in 0..65_535u64 {
            t.send_frame(now, &Frame::Ping(n));
        }
        assert_eq!(t.frames_unsent(), 65_535, "closed before the bound");
        t.send_frame(now, &Frame::Ping(u64::MAX));
        assert_eq!(t.frames_unsent(), 0, "the queue is kept at the bound");
        let ev = std::future::poll_fn(|cx| t.poll_event(cx, Instant::now())).await;
        assert!(
            matches!(ev, TransportEvent::Closed(Closed::Unresponsive { .. })),
            "{ev:?}"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn abort_while_writes_are_in_flight_fences_then_the_memory_serves_the_next_transfer() {
        let Some(d) = super::device(
            "abort_while_writes_are_in_flight_fences_then_the_memory_serves_the_next_transfer",
        ) else {
            return;
        };
        let (dev, mut pair) = pair(&d.name, 1);
        pair.fault(FaultRule::on(
            TransferId(6),
            Fault::Abort(Side::Receiver, Step::FirstWrite),
        ));
        transfer(&mut pair, 6, 32 * 16);
        assert!(pair.drive_live(LIMIT).await);
        assert!(matches!(
            pair.receiver_failure(TransferId(6)),
            Some(FailureReason::LocalAbort { .. })
        ));
        assert!(pair.verified.is_empty());
        assert_eq!(pair.open_scopes(), 0);
        assert_invariants(&pair);
        // The writes that were in flight either landed before the fence or failed at the NIC
        // after it; a failed one breaks the link (a remote access error puts the sender's
        // queue pair in error), which ends this connection: the next transfer goes over a
        // new one, over the same memory. Either way it verifies.
        if let Some(why) = pair.sender.closed() {
            assert!(matches!(why, Closed::LinkFailed(_)), "{why}");
            let cfg = config();
            let pools = (pair.sender.pool().clone(), pair.receiver.pool().clone());
            drop(pair);
            pair = pair_over(&dev, &cfg, pools, 1);
        }
        transfer(&mut pair, 7, 64);
        assert!(pair.drive_live(LIMIT).await);
        assert_eq!(
            pair.verified,
            vec![TransferId(7)],
            "{:?}",
            pair.receiver_failures
        );
        assert_invariants(&pair);
    }

    /// The reference (id and nonce) of `id`, which the sender saw verified.
    fn verified_ref(pair: &RdmaPair, id: TransferId) -> kvwire::proto::wire::TransferRef {
        kvwire::proto::wire::TransferRef {
            transfer_id: id,
            nonce: pair
                .sender_events
                .iter()
                .find_map(|e| match e {
                    kvwire::proto::sender::SenderEvent::Verified(t) if t.transfer_id == id => {
                        Some(t.nonce)
                    }
                    _ => None,
                })
                .expect("the transfer verified at the sender"),
        }
    }

    /// The sender writes again with `t`'s (fenced) rkeys: the write must fail at the NIC
    /// (the link fails) and none of the receiver's first 64 pages of buffer 0 may change.
    async fn late_write_fails_at_the_nic(
        pair: &mut RdmaPair,
        t: kvwire::proto::wire::TransferRef,
        pool: &PagePool,
    ) {
        let snapshot: Vec<Vec<u8>> = (0..64)
            .map(|p| pool.raw_page(p, 0).unwrap().to_vec())
            .collect();
        let page = pair
            .sender
            .transport_mut()
            .inner_mut()
            .inject_late_write(t)
            .unwrap()
            .expect("descriptor known");
        let end = Instant::now() + LIMIT;
        while pair.sender.closed().is_none() && Instant::now() < end {
            pair.drive_live(Duration::from_millis(200)).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            matches!(pair.sender.closed(), Some(Closed::LinkFailed(_))),
            "{:?}",
            pair.sender.closed()
        );
        for p in 0..64u32 {
            assert_eq!(
                *pool.raw_page(p, 0).unwrap(),
                snapshot[p as usize][..],
                "a late write landed in page {p} (aimed at {page})"
            );
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn late_write_after_the_fence_fails_at_the_nic_and_a_new_connection_serves_the_memory() {
        let Some(d) = super::device(
            "late_write_after_the_fence_fails_at_the_nic_and_a_new_connection_serves_the_memory",
        ) else {
            return;
        };
        let (dev, mut pair) = pair(&d.name, 1);
        transfer(&mut pair, 7, 64);
        assert!(pair.drive_live(LIMIT).await);
        assert_eq!(pair.verified, vec![TransferId(7)]);
        // The transfer is over: its windows are invalidated and its pages are free. A sender
        // that keeps writing with the old rkeys:
        let pool = pair.receiver.pool().clone();
        let t = verified_ref(&pair, TransferId(7));
        late_write_fails_at_the_nic(&mut pair, t, &pool).await;
        // A new connection over the same memory serves the next transfer.
        let cfg = config();
        let pools = (pair.sender.pool().clone(), pool.clone());
        drop(pair);
        let mut pair = pair_over(&dev, &cfg, pools, 1);
        transfer(&mut pair, 8, 64);
        assert!(pair.drive_live(LIMIT).await);
        assert_eq!(
            pair.verified,
            vec![TransferId(8)],
            "{:?}",
            pair.receiver_failures
        );
        assert_invariants(&pair);
    }

    /// The receiver binds the windows of a fenced transfer again for the next reservation
    /// (new keys): a sender that keeps writing with the fenced transfer's rkeys while those
    /// windows are bound over the next reservation's pages is refused at the NIC, and neither
    /// reservation's pages change.
    #[tokio::test(flavor = "current_thread")]
    async fn a_late_write_with_a_reused_windows_old_rkey_fails_at_the_nic() {
        let Some(d) = super::device("a_late_write_with_a_reused_windows_old_rkey_fails_at_the_nic")
        else {
            return;
        };
        let (_dev, mut pair) = pair(&d.name, 1);
        transfer(&mut pair, 7, 64);
        assert!(pair.drive_live(LIMIT).await);
        assert_eq!(pair.verified, vec![TransferId(7)]);
        let t = verified_ref(&pair, TransferId(7));
        // The next reservation (its request not admitted yet: the sender parks the RESERVE)
        // is scoped by the windows transfer 7 used, bound again.
        let before = pair.receiver.transport().inner().stats();
        reserve(&mut pair, 8, 64);
        pair.drive_live(Duration::from_millis(500)).await;
        let after = pair.receiver.transport().inner().stats();
        assert!(
            after.windows_reused > before.windows_reused,
            "the reservation did not reuse the fenced windows: {after:?}"
        );
        let pool = pair.receiver.pool().clone();
        late_write_fails_at_the_nic(&mut pair, t, &pool).await;
    }

    /// The fault matrix's cells that apply to one-sided writes (no landing events, so no
    /// corruption after landing), each checked for the invariants and a typed outcome.
    #[tokio::test(flavor = "current_thread")]
    async fn fault_matrix_subset_over_rdma_keeps_the_invariants() {
        let Some(d) = super::device("fault_matrix_subset_over_rdma_keeps_the_invariants") else {
            return;
        };
        use kvwire::proto::wire::FrameType as F;
        // RUST_LOG=kvwire=debug shows what each cell does.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let dev = Arc::new(RdmaDevice::open(Some(&d.name)).unwrap());
        // (fault, whether the transfer is delivered; None: either, with the right bytes).
        let cells: Vec<(Fault, Option<bool>)> = vec![
            (Fault::DropWrite { ordinal: 2 }, Some(false)),
            (Fault::DuplicateWrite { ordinal: 4 }, Some(true)),
            // The writes follow the COMMIT on the queue pair: those that land before the
            // receiver's fence completes are digested; the rest fail at the NIC. Delivered
            // only if all landed (then the bytes are right).
            (Fault::CommitBeforeData, None),
            (Fault::DropFrame(F::VERIFIED), Some(true)),
            (Fault::DuplicateFrame(F::COMMIT), Some(true)),
            (Fault::Abort(Side::Sender, Step::FirstWrite), Some(false)),
            (
                Fault::Abort(Side::Receiver, Step::Frame(F::COMMIT)),
                Some(false),
            ),
            (
                Fault::Crash(Side::Sender, Step::Frame(F::COMMIT)),
                Some(false),
            ),
            (Fault::CorruptFrame(F::RESERVE), Some(false)),
        ];
        for (fault, delivers) in cells {
            let mut cfg = config();
            cfg.receiver.abort_ack_timeout = Duration::from_secs(2);
            cfg.sender.abort_ack_timeout = Duration::from_secs(2);
            cfg.sender.verdict_timeout = Duration::from_secs(5);
            let pools = cfg.pools().unwrap();
            let mut pair = pair_over(&dev, &cfg, pools, 1);
            pair.fault(FaultRule::on(TransferId(77), fault.clone()));
            transfer(&mut pair, 77, 96);
            let settled = pair.drive_live(LIMIT).await;
            assert!(
                settled,
                "{fault:?}: did not settle: receiver {:?} {:?} {:?} closed {:?}, sender closed {:?}",
                pair.receiver.session().stats(),
                pair.receiver.stats(),
                pair.receiver.transport().inner().stats(),
                pair.receiver.closed(),
                pair.sender.closed()
            );
            let verified = pair.verified.contains(&TransferId(77));
            if let Some(delivers) = delivers {
                assert_eq!(
                    verified, delivers,
                    "{fault:?}: {:?}",
                    pair.receiver_failures
                );
            }
            if !verified && pair.crashed != Some(Side::Receiver) {
                assert!(
                    pair.receiver_failure(TransferId(77)).is_some(),
                    "{fault:?}: no outcome"
                );
            }
            assert!(pair.wrong_content.is_empty(), "{fault:?}");
            println!(
                "{fault:?}: receiver {:?}",
                pair.receiver_failure(TransferId(77))
            );
            assert_invariants(&pair);
        }
    }
}

/// The engine API over RDMA: the same integrator code as over TCP (`SenderConn`,
/// `ReceiverConn`), the TCP bootstrap on the loopback address, then everything over queue
/// pairs.
#[cfg(feature = "rdma")]
mod engine {
    use std::time::Duration;

    use kvwire::config::TransportConfig;
    use kvwire::proto::admission::Request;
    use kvwire::receiver::ReserveParams;
    use kvwire::testkit::kv_pattern;
    use kvwire::TransferId;
    use kvwire::{Node, NodeConfig, ReceiverConn, SenderConn};

    /// Two connections one after the other over the same two nodes: the second reuses each
    /// node's registration (the way a connection recovers after its link failed).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_engine_api_moves_verified_kv_over_rdma() {
        let Some(d) = super::device("the_engine_api_moves_verified_kv_over_rdma") else {
            return;
        };
        let mut config = NodeConfig::example();
        config.transport = TransportConfig::rdma(Some(&d.name));
        let decode_node = Node::new(config.clone()).unwrap();
        let prefill_node = Node::new(config).unwrap();
        for round in 0..2u64 {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let node = decode_node.clone();
            let decode = tokio::spawn(async move { ReceiverConn::accept(&listener, &node).await });
            let prefill = SenderConn::connect(addr, &prefill_node).await.unwrap();
            let decode = decode.await.unwrap().unwrap();
            for id in (1..=3u64).map(|i| TransferId(round * 10 + i)) {
                let verified = decode.reserve(ReserveParams::new(id, 100, Duration::from_secs(60)));
                let admitted = prefill
                    .admit(Request {
                        transfer_id: id,
                        tokens: 100,
                    })
                    .unwrap();
                prefill
                    .send(admitted, move |o, b, page| kv_pattern(id, o, b, page))
                    .await
                    .unwrap();
                let kv = verified.await.unwrap();
                for o in 0..kv.pages() {
                    for b in 0..kv.buffers() {
                        let got = kv.page(o, b).unwrap();
                        let mut want = vec![0u8; got.len()];
                        kv_pattern(id, o as u32, b, &mut want);
                        assert!(*got == want[..], "transfer {id} page {o} buffer {b}");
                    }
                }
                kv.release().unwrap();
            }
            let s = decode.stats().await.unwrap();
            assert_eq!((s.verified, s.pages_free), (3, s.pages_total));
            // RDMA digests every transfer on the blocking pool by default (the connection's
            // thread only posts and completes work requests): the receiver's one pass after
            // each fence, and the sender's chunks.
            assert_eq!(s.digest_jobs_offloaded, 3, "{s:?}");
            let p = prefill.stats().await.unwrap();
            assert!(p.digest_jobs_offloaded >= 3, "{p:?}");
        }
        for node in [&decode_node, &prefill_node] {
            assert!(node.pool().held_pages().is_empty());
        }
    }
}
