//! `kvwire bench --transport rdma`: both roles in this process over two RC queue pairs on
//! one RDMA device (what `ib_write_bw` does with a server and a client on one host), driven
//! by one polling thread.
//!
//! The receiver binds memory windows per reservation and invalidates them at every fence,
//! exactly as in production; page writes are RDMA WRITEs of one page of one buffer each (so
//! the message size to compare with `ib_write_bw -s` is the page size).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_proto::admission::Request;
use kvwire_proto::sender::SenderEvent;
use kvwire_proto::wire::Role;

use super::{fill_body, page_is_expected, stamp, BenchSpec, CaseResult, Report, Tally};
use crate::memory::{PagePool, Scrub};
use crate::receiver::{ReceiveOutcome, ReserveParams};
use crate::transport::rdma::driver::{LinkState, RdmaReceiver, RdmaSender};
use crate::transport::rdma::{bootstrap, RdmaDevice};

/// A case that makes no progress for this long fails (rather than hanging a CI lane).
const STALL: Duration = Duration::from_secs(60);

/// Runs every case over `device` (or the first RDMA device).
pub fn run_rdma(
    spec: &BenchSpec,
    device: Option<&str>,
    mut progress: impl FnMut(&str),
) -> Result<Report, String> {
    let dev = Arc::new(RdmaDevice::open(device).map_err(|e| e.to_string())?);
    progress(&format!(
        "device {} (GID index {})",
        dev.name, dev.gid_index
    ));
    let mut cases = Vec::new();
    for &page in &spec.page_sizes {
        progress(&format!(
            "case: {} pages/transfer x {} buffers x {} over rdma",
            spec.pages,
            spec.buffers,
            super::human_bytes(u64::from(page))
        ));
        let case = run_case(spec, page, &dev, &mut progress)?;
        cases.push(case);
    }
    Ok(Report {
        spec: spec.clone(),
        transport: "rdma",
        metrics: None,
        cases,
    })
}

fn run_case(
    spec: &BenchSpec,
    page: u32,
    dev: &Arc<RdmaDevice>,
    progress: &mut impl FnMut(&str),
) -> Result<CaseResult, String> {
    let config = spec.node_config(page);
    let (r_est, s_est) = handshake(
        Instant::now(),
        config.hello(Role::RECEIVER),
        config.hello(Role::SENDER),
    )?;
    let src = PagePool::new(config.pool.clone(), Scrub::None).map_err(|e| e.to_string())?;
    let dst = PagePool::new(config.pool.clone(), Scrub::None).map_err(|e| e.to_string())?;
    let bytes_registered = 2 * config.pool.total_bytes().unwrap_or(0);
    let t0 = Instant::now();
    let lanes = usize::from(config.rdma_queue_pairs.max(1));
    let mut sender = RdmaSender::with_queue_pairs(
        lanes,
        dev,
        &s_est,
        src,
        &config.engine,
        config.sender.clone(),
        config.window,
    )
    .map_err(|e| e.to_string())?;
    let mut receiver = RdmaReceiver::with_queue_pairs(
        lanes,
        Arc::clone(dev),
        &r_est,
        dst,
        &config.engine,
        config.receiver.clone(),
    )
    .map_err(|e| e.to_string())?;
    let registration = t0.elapsed();
    progress(&format!(
        "registered {} and created {} queue pairs in {:.1} ms; access scoping: {}",
        super::human_bytes(bytes_registered),
        2 * lanes,
        registration.as_secs_f64() * 1e3,
        if receiver.access_kind() == crate::transport::rdma::descriptor::AccessKind::WINDOWS {
            "memory windows per reservation"
        } else {
            "REGION RKEYS (no memory windows: no NIC fence)"
        }
    ));
    let (sp, rp) = (sender.params(), receiver.params());
    sender.connect(&rp).map_err(|e| e.to_string())?;
    receiver.connect(&sp).map_err(|e| e.to_string())?;
    sender.endpoint().set_digest_mode(config.digest_mode);
    receiver.endpoint().set_digest_mode(config.digest_mode);
    sender
        .endpoint()
        .fill_free_pages(|_, b, bytes| fill_body(b, bytes));

    let transfers = spec.transfers(page);
    let mut tally = Tally::default();
    let mut started: BTreeMap<u64, Instant> = BTreeMap::new();
    let (mut next, mut done) = (1u64, 0u64);
    let start = Instant::now();
    let mut last_progress = start;
    while done < transfers {
        while started.len() < spec.concurrency as usize && next <= transfers {
            let id = next;
            next += 1;
            let now = Instant::now();
            if !reserve_one(spec, &mut receiver, id, now, &mut tally) {
                done += 1;
                continue;
            }
            started.insert(id, now);
            if let Err(e) = submit_one(spec, &mut sender, id, now) {
                tracing::error!(transfer_id = id, error = %e, "admission or submit");
            }
        }
        let now = Instant::now();
        let mut moved = sender.poll(now).map_err(|e| e.to_string())?;
        moved |= receiver.poll(now).map_err(|e| e.to_string())?;
        let n = take_outcomes(spec, &mut receiver, &mut started, &mut tally)?;
        done += n;
        moved |= n > 0;
        while sender.poll_event().is_some() {}
        if sender.state() == LinkState::Broken || receiver.state() == LinkState::Broken {
            return Err("the RDMA link broke during the bench (see the log)".into());
        }
        if moved {
            last_progress = Instant::now();
        } else {
            // Nothing to do: let the other threads (and, on SoftRoCE, the kernel's) run.
            std::thread::yield_now();
        }
        if last_progress.elapsed() > STALL {
            return Err(format!(
                "no progress for {STALL:?} with {} transfers in flight",
                started.len()
            ));
        }
    }
    let rs = receiver.stats();
    progress(&format!(
        "windows bound {}, invalidated {}, mean fence {:.2} ms; sender: {} writes, {} signaled, {} doorbells",
        rs.binds,
        rs.invalidations,
        rs.fence_time.as_secs_f64() * 1e3 / done.max(1) as f64,
        sender.stats().writes_posted,
        sender.stats().signaled,
        sender.stats().doorbells
    ));
    let mut case = tally.result(spec, page, start.elapsed().as_secs_f64());
    let pool = receiver.endpoint().pool();
    case.pages_free_after = Some(pool.free_pages());
    case.pages_total = Some(pool.capacity_pages());
    Ok(case)
}

/// Reserves transfer `id` on the decode side; a refused reservation is tallied (false).
fn reserve_one(
    spec: &BenchSpec,
    r: &mut RdmaReceiver,
    id: u64,
    now: Instant,
    tally: &mut Tally,
) -> bool {
    let reserved = r.reserve(
        now,
        ReserveParams {
            transfer_id: id,
            tokens: spec.tokens(),
            // Generous: software RDMA under emulation moves a few MB/s.
            timeout: Duration::from_secs(120),
            digest: None,
            page_digests: false,
        },
    );
    match reserved {
        Ok(_) => true,
        Err(e) => {
            *tally.failures.entry(format!("reserve: {e}")).or_default() += 1;
            false
        }
    }
}

/// Admits transfer `id` on the prefill side and submits its stamped pages.
fn submit_one(spec: &BenchSpec, s: &mut RdmaSender, id: u64, now: Instant) -> Result<(), String> {
    let admitted = s
        .endpoint()
        .admit(Request {
            transfer_id: id,
            tokens: u64::from(spec.tokens()),
        })
        .map_err(|e| e.to_string())?;
    s.endpoint()
        .submit(now, admitted, |ord, b, page| {
            let n = page.len().min(16);
            page[..n].copy_from_slice(&stamp(id, ord, b)[..n]);
        })
        .map_err(|e| e.to_string())
}

/// Takes every finished transfer off the decode side: tallies it, compares its bytes when
/// asked, gives its pages back. Returns how many finished.
fn take_outcomes(
    spec: &BenchSpec,
    r: &mut RdmaReceiver,
    started: &mut BTreeMap<u64, Instant>,
    tally: &mut Tally,
) -> Result<u64, String> {
    let mut n = 0;
    while let Some(o) = r.poll_outcome() {
        n += 1;
        if let Some(tick) = &spec.on_transfer {
            (tick.0)();
        }
        match o {
            ReceiveOutcome::Verified(kv) => {
                let id = kv.transfer.transfer_id;
                if let Some(t) = started.remove(&id) {
                    tally.latencies.push(t.elapsed());
                }
                tally.verified += 1;
                if spec.check_bytes {
                    let pool = r.endpoint().pool();
                    let same = (0..kv.pages()).all(|o| {
                        (0..spec.buffers as usize).all(|b| {
                            kv.page(pool, o, b)
                                .is_ok_and(|p| page_is_expected(id, o as u32, b, &p))
                        })
                    });
                    if same {
                        tally.checked += 1;
                    } else {
                        *tally.failures.entry("BYTES_DIFFER".into()).or_default() += 1;
                    }
                }
                r.endpoint()
                    .release(kv)
                    .map_err(|e| format!("releasing verified pages: {e}"))?;
            }
            ReceiveOutcome::Failed { transfer, reason } => {
                started.remove(&transfer.transfer_id);
                *tally.failures.entry(reason.code().to_string()).or_default() += 1;
            }
        }
    }
    Ok(n)
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
}

/// Two-process mode over RDMA, decode side: accepts `connections` senders in turn on `addr`
/// (TCP bootstrap, then everything over RDMA) and runs every case as the receiver.
pub fn run_rdma_listen(
    spec: &BenchSpec,
    device: Option<&str>,
    addr: std::net::SocketAddr,
    connections: u32,
    mut progress: impl FnMut(&str),
) -> Result<Report, String> {
    let dev = Arc::new(RdmaDevice::open(device).map_err(|e| e.to_string())?);
    let rt = runtime()?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(addr))
        .map_err(|e| e.to_string())?;
    progress(&format!(
        "listening on {} (rdma device {})",
        listener.local_addr().map_err(|e| e.to_string())?,
        dev.name
    ));
    let mut cases = Vec::new();
    for _ in 0..connections.max(1) {
        for &page in &spec.page_sizes {
            let config = spec.node_config(page);
            let size = super::human_bytes(u64::from(page));
            let (mut r, mut live) = rt
                .block_on(async {
                    let (s, _) = listener.accept().await.map_err(|e| e.to_string())?;
                    bootstrap::receiver(s, &dev, &config)
                        .await
                        .map_err(|e| e.to_string())
                })
                .map_err(|e| format!("case {size}: {e}"))?;
            progress(&format!("case {size}: connected over rdma"));
            let case = receiver_side(spec, page, &mut r, &mut live)?;
            progress(&format!(
                "case {size}: {} verified, failures {:?}, pool {}/{} pages free",
                case.verified,
                case.failures,
                case.pages_free_after.unwrap_or(0),
                case.pages_total.unwrap_or(0)
            ));
            cases.push(case);
        }
    }
    Ok(Report {
        spec: spec.clone(),
        transport: "rdma",
        metrics: None,
        cases,
    })
}

fn receiver_side(
    spec: &BenchSpec,
    page: u32,
    r: &mut RdmaReceiver,
    live: &mut bootstrap::Liveness,
) -> Result<CaseResult, String> {
    let transfers = spec.transfers(page);
    let mut tally = Tally::default();
    let mut started: BTreeMap<u64, Instant> = BTreeMap::new();
    let (mut next, mut done) = (1u64, 0u64);
    let start = Instant::now();
    let mut lost = false;
    while done < transfers && !(lost && started.is_empty()) {
        while !lost && started.len() < spec.concurrency as usize && next <= transfers {
            let id = next;
            next += 1;
            let now = Instant::now();
            if reserve_one(spec, r, id, now, &mut tally) {
                started.insert(id, now);
            } else {
                done += 1;
            }
        }
        let now = Instant::now();
        let moved = r.poll(now).map_err(|e| e.to_string())?;
        if !lost && live.peer_gone() {
            // The sender's process is gone: fence (the queue pair is reset, every window
            // deallocated) and fail what it had in flight.
            lost = true;
            r.handle_peer_lost(now);
        }
        done += take_outcomes(spec, r, &mut started, &mut tally)?;
        if !moved {
            std::thread::yield_now();
        }
    }
    let mut case = tally.result(spec, page, start.elapsed().as_secs_f64());
    let pool = r.endpoint().pool();
    case.pages_free_after = Some(pool.free_pages());
    case.pages_total = Some(pool.capacity_pages());
    Ok(case)
}

/// Two-process mode over RDMA, prefill side: connects to [`run_rdma_listen`] for every case
/// and sends.
pub fn run_rdma_connect(
    spec: &BenchSpec,
    device: Option<&str>,
    addr: std::net::SocketAddr,
    mut progress: impl FnMut(&str),
) -> Result<Report, String> {
    let dev = Arc::new(RdmaDevice::open(device).map_err(|e| e.to_string())?);
    let rt = runtime()?;
    let mut cases = Vec::new();
    for &page in &spec.page_sizes {
        let config = spec.node_config(page);
        let size = super::human_bytes(u64::from(page));
        let (mut s, mut live) = rt
            .block_on(async {
                let stream = super::connect_retry(addr).await?;
                bootstrap::sender(stream, &dev, &config)
                    .await
                    .map_err(|e| e.to_string())
            })
            .map_err(|e| format!("case {size}: {e}"))?;
        progress(&format!("case {size}: connected over rdma"));
        cases.push(sender_side(spec, page, &mut s, &mut live)?);
    }
    Ok(Report {
        spec: spec.clone(),
        transport: "rdma",
        metrics: None,
        cases,
    })
}

fn sender_side(
    spec: &BenchSpec,
    page: u32,
    s: &mut RdmaSender,
    live: &mut bootstrap::Liveness,
) -> Result<CaseResult, String> {
    s.endpoint()
        .fill_free_pages(|_, b, bytes| fill_body(b, bytes));
    let transfers = spec.transfers(page);
    let mut tally = Tally::default();
    let mut started: BTreeMap<u64, Instant> = BTreeMap::new();
    let (mut next, mut done) = (1u64, 0u64);
    let start = Instant::now();
    let mut lost = false;
    while done < transfers && !(lost && started.is_empty()) {
        while !lost && started.len() < spec.concurrency as usize && next <= transfers {
            let id = next;
            next += 1;
            let now = Instant::now();
            let r = submit_one(spec, s, id, now);
            match r {
                Ok(()) => {
                    started.insert(id, now);
                }
                Err(e) => {
                    *tally.failures.entry(e).or_default() += 1;
                    done += 1;
                }
            }
        }
        let now = Instant::now();
        let moved = s.poll(now).map_err(|e| e.to_string())?;
        if !lost && live.peer_gone() {
            lost = true;
            s.handle_peer_lost(now);
        }
        while let Some(e) = s.poll_event() {
            done += 1;
            if let Some(tick) = &spec.on_transfer {
                (tick.0)();
            }
            match e {
                SenderEvent::Verified(t) => {
                    if let Some(t0) = started.remove(&t.transfer_id) {
                        tally.latencies.push(t0.elapsed());
                    }
                    tally.verified += 1;
                }
                SenderEvent::Failed { transfer, reason } => {
                    started.remove(&transfer.transfer_id);
                    *tally.failures.entry(reason.code().to_string()).or_default() += 1;
                }
                #[allow(unreachable_patterns)]
                _ => {}
            }
        }
        if !moved {
            std::thread::yield_now();
        }
    }
    Ok(tally.result(spec, page, start.elapsed().as_secs_f64()))
}

/// Runs a handshake between two machines over encoded bytes, in memory.
fn handshake(
    now: Instant,
    client_hello: kvwire_proto::wire::Hello,
    server_hello: kvwire_proto::wire::Hello,
) -> Result<
    (
        kvwire_proto::handshake::Established,
        kvwire_proto::handshake::Established,
    ),
    String,
> {
    use kvwire_proto::handshake::Handshake;
    use kvwire_proto::wire::Frame;
    let timeout = Duration::from_secs(5);
    let mut client = Handshake::client(now, client_hello, timeout);
    let mut server = Handshake::server(now, server_hello, timeout);
    let mut outcomes = (None, None);
    for _ in 0..8 {
        fn pass(from: &mut Handshake, to: &mut Handshake) -> Result<(), String> {
            while let Some(f) = from.poll_transmit() {
                let bytes = f.to_bytes().map_err(|e| e.to_string())?;
                let (frame, _) = Frame::decode(&bytes).map_err(|e| e.to_string())?;
                to.handle_frame(frame);
            }
            Ok(())
        }
        pass(&mut client, &mut server)?;
        pass(&mut server, &mut client)?;
        outcomes.0 = outcomes.0.or_else(|| client.poll_outcome());
        outcomes.1 = outcomes.1.or_else(|| server.poll_outcome());
        if let (Some(c), Some(s)) = &outcomes {
            return match (c, s) {
                (Ok(c), Ok(s)) => Ok((c.clone(), s.clone())),
                (c, s) => Err(format!("client {c:?}, server {s:?}")),
            };
        }
    }
    Err("handshake did not finish".into())
}
