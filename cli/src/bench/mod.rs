//! `kvwire bench`: verified transfer throughput over any transport (TCP, RDMA, in-process
//! loopback), through the public engine API, one loop for all; over TCP against a raw TCP
//! baseline measured in the same run.
//!
//! Each case (one page size) gets its own connection, since the page geometry is part of
//! the layout the handshake pins. Source pools are filled once with a body pattern; each
//! transfer stamps the first 16 bytes of each page with (transfer id, ordinal, buffer), so
//! the sender does no per-byte work per transfer and the receiver can still check every byte
//! (`--check-bytes`). Every transfer is verified by digest unless `--verify none` is asked
//! for, which exists only to measure the integrity tax and says so.

pub mod chart;
mod cost;
mod engine;
mod raw;
mod spec;
mod table;

use cost::CpuClock;
use engine::EngineSide;
use raw::{engine_raw_read, engine_raw_write, raw_read, raw_write};
pub use raw::{memcpy_baseline, raw_engine_baseline, raw_tcp_baseline, RawRun};
pub use spec::{BenchSpec, BenchTransport, CaseResult, OnTransfer, Report, Verify, Workload};
pub use table::{human_bytes, table};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvwire::proto::admission::Request;
use kvwire::proto::wire::TransferId;
use tokio::net::{TcpListener, TcpStream};

use kvwire::engine::{Listener, ListenerConfig, Node, ReceiverConn, SenderConn, TransferError};
use kvwire::ReserveParams;

/// The body byte at `offset` of a page of `buffer`.
fn body(buffer: usize, offset: usize) -> u8 {
    (offset.wrapping_mul(31) ^ buffer.wrapping_mul(0x5d) ^ (offset >> 8)) as u8
}

fn fill_body(buffer: usize, page: &mut [u8]) {
    for (i, b) in page.iter_mut().enumerate() {
        *b = body(buffer, i);
    }
}

fn stamp(id: u64, ordinal: u32, buffer: usize) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[..8].copy_from_slice(&id.to_le_bytes());
    s[8..12].copy_from_slice(&ordinal.to_le_bytes());
    s[12..].copy_from_slice(&(buffer as u32).to_le_bytes());
    s
}

fn page_is_expected(id: u64, ordinal: u32, buffer: usize, page: &[u8]) -> bool {
    let n = page.len().min(16);
    page[..n] == stamp(id, ordinal, buffer)[..n]
        && page
            .iter()
            .enumerate()
            .skip(16)
            .all(|(i, &b)| b == body(buffer, i))
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

#[derive(Default)]
pub(crate) struct Tally {
    latencies: Vec<Duration>,
    verified: u64,
    checked: u64,
    failures: BTreeMap<String, u64>,
    unconfirmed: BTreeMap<String, u64>,
}

impl Tally {
    /// The case's figures from this side's tally (pool state left for the caller).
    /// `seconds` of wall time and `cpu_seconds` of this process's CPU time in the case.
    pub(crate) fn result(
        mut self,
        spec: &BenchSpec,
        page: u32,
        seconds: f64,
        cpu_seconds: f64,
    ) -> CaseResult {
        self.latencies.sort_unstable();
        let bytes = self.verified * spec.transfer_bytes(page);
        CaseResult {
            page_bytes: page,
            pages: spec.pages,
            buffers: spec.buffers,
            transfers: spec.transfers(page),
            concurrency: spec.concurrency,
            bytes,
            seconds,
            gb_per_s: bytes as f64 / seconds / 1e9,
            transfers_per_s: self.verified as f64 / seconds,
            p50_ms: percentile(&self.latencies, 0.50),
            p99_ms: percentile(&self.latencies, 0.99),
            p999_ms: percentile(&self.latencies, 0.999),
            cpu_seconds,
            cpu_s_per_gb: cost::per_gb(cpu_seconds, bytes),
            raw_cpu_s_per_gb: None,
            cpu_ratio_to_raw: None,
            verified: self.verified,
            bytes_checked: self.checked,
            failures: self.failures,
            unconfirmed: self.unconfirmed,
            raw_gb_per_s: None,
            ratio_to_raw: None,
            raw_in_flight_gb_per_s: None,
            ratio_to_raw_in_flight: None,
            raw_in_flight_cpu_s_per_gb: None,
            pages_free_after: None,
            pages_total: None,
            tcp_stream_gb_per_s: None,
            ratio_to_tcp_stream: None,
            same_host_pulls: None,
            failed_lanes: None,
            moves: None,
            striped: None,
            memcpy_gb_per_s: None,
            ratio_to_memcpy: None,
        }
    }

    fn fail(&mut self, e: &TransferError) {
        if let Some(kvwire::FailureReason::Unconfirmed { cause }) = e.reason() {
            // Not a failure: the receiver may have delivered (SPEC §7.6).
            *self
                .unconfirmed
                .entry(cause.code().to_string())
                .or_default() += 1;
            return;
        }
        let key = match e.reason() {
            Some(r) => r.code().to_string(),
            None => e.to_string(),
        };
        *self.failures.entry(key).or_default() += 1;
    }
}

/// How one transfer ended, for the tally.
enum Outcome {
    /// Verified; `Some(ok)` if its bytes were also compared.
    Verified(Option<bool>),
    /// Failed.
    Failed(TransferError),
}

/// The decode side of one transfer: reserve, await verified KV, optionally compare bytes.
fn receive_one(
    r: &ReceiverConn,
    spec: &BenchSpec,
    id: u64,
) -> impl std::future::Future<Output = Outcome> + Send + 'static {
    let verified = r.reserve(ReserveParams::new(
        TransferId(id),
        spec.tokens(),
        Duration::from_secs(30),
    ));
    let check = spec.check_bytes;
    async move {
        let kv = match verified.await {
            Ok(kv) => kv,
            Err(e) => return Outcome::Failed(e),
        };
        if !check {
            return Outcome::Verified(None);
        }
        let same = (0..kv.pages()).all(|o| {
            (0..kv.buffers()).all(|b| {
                kv.page(o, b)
                    .is_ok_and(|page| page_is_expected(id, o as u32, b, &page))
            })
        });
        Outcome::Verified(Some(same))
    }
}

/// The prefill side of one transfer: admit, stamp the pages, send, await the verdict.
fn send_one(
    s: &SenderConn,
    tokens: u32,
    id: u64,
) -> impl std::future::Future<Output = Outcome> + Send + 'static {
    let s = s.clone();
    async move {
        let r = async {
            let admitted = s.admit(Request {
                transfer_id: TransferId(id),
                tokens: u64::from(tokens),
            })?;
            s.send(admitted, move |ord, b, page| {
                let n = page.len().min(16);
                page[..n].copy_from_slice(&stamp(id, ord, b)[..n]);
            })
            .await
        }
        .await;
        match r {
            Ok(()) => Outcome::Verified(None),
            Err(e) => Outcome::Failed(e),
        }
    }
}

/// Both roles of one case in this process.
async fn run_case_pair(
    spec: &BenchSpec,
    page: u32,
    sender: &SenderConn,
    receiver: &ReceiverConn,
) -> CaseResult {
    sender
        .fill_free_pages(|_, b, bytes| fill_body(b, bytes))
        .await
        .ok();
    let (s, r, spec2) = (sender.clone(), receiver.clone(), spec.clone());
    run_side(spec, page, move |id| {
        let (recv, send) = (
            receive_one(&r, &spec2, id),
            send_one(&s, spec2.tokens(), id),
        );
        async move {
            // The receiver's outcome is the one that counts: only it verifies.
            let (got, _) = tokio::join!(recv, send);
            got
        }
    })
    .await
}

/// The case with the memcpy baseline of its bytes, measured in this run.
fn with_memcpy(mut case: CaseResult, spec: &BenchSpec, page: u32) -> CaseResult {
    if spec.transport != BenchTransport::Tcp {
        return case;
    }
    let record = (u64::from(page) * u64::from(spec.buffers)) as usize;
    let run = memcpy_baseline(
        spec.transfer_bytes(page) * spec.transfers(page),
        record,
        spec.buffer_offset,
    );
    case.memcpy_gb_per_s = Some(run.gb_per_s);
    case.ratio_to_memcpy = (run.gb_per_s > 0.0).then(|| case.gb_per_s / run.gb_per_s);
    case
}

fn with_baseline(
    mut case: CaseResult,
    raw: Option<RawRun>,
    raw_in_flight: Option<RawRun>,
) -> CaseResult {
    case.raw_in_flight_gb_per_s = raw_in_flight.map(|r| r.gb_per_s);
    case.ratio_to_raw_in_flight = case
        .raw_in_flight_gb_per_s
        .filter(|r| *r > 0.0)
        .map(|r| case.gb_per_s / r);
    case.raw_in_flight_cpu_s_per_gb = raw_in_flight.and_then(|r| r.cpu_s_per_gb);
    case.raw_gb_per_s = raw.map(|r| r.gb_per_s);
    case.ratio_to_raw = case
        .raw_gb_per_s
        .filter(|r| *r > 0.0)
        .map(|r| case.gb_per_s / r);
    case.raw_cpu_s_per_gb = raw.and_then(|r| r.cpu_s_per_gb);
    case.cpu_ratio_to_raw = case
        .cpu_s_per_gb
        .zip(case.raw_cpu_s_per_gb)
        .filter(|(_, r)| *r > 0.0)
        .map(|(c, r)| c / r);
    case
}

/// One case with both roles in this process, over two nodes of the case's configuration.
async fn in_process_case(spec: &BenchSpec, page: u32) -> Result<CaseResult, String> {
    Ok(match spec.workload {
        Workload::Pool => {
            // Two nodes, each with memory of its own: the prefill engine's and the
            // decode engine's.
            let config = spec.node_config(page);
            let prefill = spec.node(config.clone())?;
            let decode = spec.node(config)?;
            let (sender, receiver) = connect_in_process(spec, &prefill, &decode).await?;
            let case = run_case_pair(spec, page, &sender, &receiver).await;
            with_pool_state(case, &receiver).await
        }
        Workload::Engine { .. } => {
            let tx = EngineSide::new(spec, page, engine::SEND_SEED)?;
            let rx = EngineSide::new(spec, page, engine::RECEIVE_SEED)?;
            let (s, r) = connect_in_process(spec, &tx.node, &rx.node).await?;
            let (r2, spec2) = (r.clone(), spec.clone());
            let case = run_side(spec, page, move |id| {
                let (recv, send) = (rx.receive_one(&r2, &spec2, id), tx.send_one(&s, &spec2, id));
                async move {
                    // The receiver's outcome is the one that counts: only it verifies.
                    let (got, _) = tokio::join!(recv, send);
                    got
                }
            })
            .await;
            with_pool_state(case, &r).await
        }
    })
}

/// Both roles in this process over TCP loopback; each case is followed by its raw baseline.
pub async fn run_in_process(
    spec: &BenchSpec,
    mut progress: impl FnMut(&str),
) -> Result<Report, String> {
    let mut cases = Vec::new();
    for &page in &spec.page_sizes {
        progress(&format!(
            "case: {} pages/transfer x {} buffers x {}{}",
            spec.pages,
            spec.buffers,
            human_bytes(u64::from(page)),
            match spec.workload {
                Workload::Pool => String::new(),
                Workload::Engine { memory, copy } => format!(
                    ", engine memory {} per node, {}",
                    human_bytes(memory),
                    if copy {
                        "copied through kvwire's pool"
                    } else {
                        "in place"
                    }
                ),
            }
        ));
        let mut case = in_process_case(spec, page).await?;
        if case.same_host_pulls == Some(true) {
            // The same case with page bytes on the stream, in the same run (SPEC §9.3).
            progress("case: again with page bytes on the TCP stream (--same-host off)");
            let stream = BenchSpec {
                same_host: kvwire::SameHost::Off,
                ..spec.clone()
            };
            let over_stream = in_process_case(&stream, page).await?;
            case.tcp_stream_gb_per_s = Some(over_stream.gb_per_s);
            case.ratio_to_tcp_stream =
                (over_stream.gb_per_s > 0.0).then(|| case.gb_per_s / over_stream.gb_per_s);
        }
        // The raw baselines are TCP programs: they compare with the TCP transport only (RDMA
        // is compared with ib_write_bw by scripts/rdma-bench.sh).
        let (mut raw, mut raw_in_flight) = (None, None);
        if spec.transport == BenchTransport::Tcp {
            let record = (u64::from(page) * u64::from(spec.buffers)) as usize;
            match spec.workload {
                Workload::Pool => {
                    raw = raw_tcp_baseline(case.bytes.max(1), record, spec.buffer_offset)
                        .await
                        .ok()
                }
                Workload::Engine { .. } => {
                    let (src, dst) =
                        engine::raw_pages(spec, page, spec.transfers(page) * u64::from(spec.pages));
                    for in_flight in [None, spec.in_flight()] {
                        let run = raw_engine_baseline(
                            page as usize,
                            spec.buffers as usize,
                            engine::memory_pages(spec, page),
                            spec.buffer_offset,
                            src.clone(),
                            dst.clone(),
                            in_flight,
                        )
                        .await
                        .ok();
                        match in_flight {
                            None => raw = run,
                            Some(_) => raw_in_flight = run,
                        }
                    }
                }
            }
        }
        cases.push(with_memcpy(
            with_baseline(case, raw, raw_in_flight),
            spec,
            page,
        ));
    }
    Ok(Report {
        spec: spec.clone(),
        transport: match spec.transport {
            BenchTransport::Tcp => "tcp-loopback".into(),
            ref t => t.name().into(),
        },
        metrics: spec.metrics.as_ref().map(|m| m.encode()),
        worker_threads: tokio::runtime::Handle::current().metrics().num_workers(),
        cases,
    })
}

/// A connection between two nodes of this process over the bench's transport.
async fn connect_in_process(
    spec: &BenchSpec,
    prefill: &Node,
    decode: &Node,
) -> Result<(SenderConn, ReceiverConn), String> {
    if spec.transport == BenchTransport::Loopback {
        return kvwire::engine::loopback(prefill, decode).map_err(|e| e.to_string());
    }
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let decode = decode.clone();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode).await });
    let sender = SenderConn::connect(addr, prefill)
        .await
        .map_err(|e| e.to_string())?;
    let receiver = accept
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    Ok((sender, receiver))
}

/// Two-process mode, decode side: listens and runs each case as the receiver; the other
/// process runs [`run_connect`] with the same spec.
///
/// It serves `connections` sender connections in turn (each running every case), so a
/// sender that dies mid-run can be followed by a new one. With `raw`, each case first
/// measures a raw TCP baseline over the same address pair.
pub async fn run_listen(
    spec: &BenchSpec,
    addr: SocketAddr,
    connections: u32,
    raw: bool,
    mut progress: impl FnMut(&str),
) -> Result<Report, String> {
    let listener = Arc::new(TcpListener::bind(addr).await.map_err(|e| e.to_string())?);
    progress(&format!(
        "listening on {}",
        listener.local_addr().map_err(|e| e.to_string())?
    ));
    let mut cases = Vec::new();
    for _ in 0..connections.max(1) {
        for &page in &spec.page_sizes {
            let (mut raw_run, mut raw_in_flight) = (None, None);
            if raw && spec.transport == BenchTransport::Tcp {
                raw_run = Some(listen_raw(spec, page, &listener, None).await?);
                if let Some(f) = spec.in_flight() {
                    raw_in_flight = Some(listen_raw(spec, page, &listener, Some(f)).await?);
                }
            }
            let engine = match spec.workload {
                Workload::Pool => None,
                Workload::Engine { .. } => Some(EngineSide::new(spec, page, engine::RECEIVE_SEED)?),
            };
            let node = match &engine {
                Some(e) => e.node.clone(),
                None => spec.node(spec.node_config(page))?,
            };
            // The next good connection, whatever else connects (port scans, HTTP, wrong keys,
            // stalled clients are logged, counted and dropped); then stop accepting until the
            // next case.
            let mut good =
                Listener::receivers_on(listener.clone(), &node, ListenerConfig::default())
                    .map_err(|e| e.to_string())?;
            let receiver = good.accept().await.ok_or("the listening socket failed")?;
            let st = good.stats();
            drop(good);
            // Streams that joined the connection (several TCP streams) are not failures. The
            // dropped ones are the sum of their causes; connections accepted and counted in
            // none (still in their handshake when this one was handed out) are said apart.
            let dropped = st.refused + st.malformed + st.failed;
            let pending = st
                .accepted
                .saturating_sub(st.established + st.joined + dropped);
            if dropped > 0 {
                progress(&format!(
                    "dropped {dropped} connections whose handshake failed ({} refused, {} not kvwire, {} stalled or lost)",
                    st.refused, st.malformed, st.failed
                ));
            }
            if pending > 0 {
                progress(&format!(
                    "{pending} other connections were still in their handshake (not served)"
                ));
            }
            let size = human_bytes(u64::from(page));
            progress(&format!(
                "case {size}: connected to node {} over {}",
                receiver.peer().node_id,
                spec.transport.name()
            ));
            let case = match engine {
                None => run_receiver_side(spec, page, &receiver).await,
                Some(rx) => {
                    let (r, spec2) = (receiver.clone(), spec.clone());
                    let case = run_side(spec, page, move |id| rx.receive_one(&r, &spec2, id)).await;
                    with_pool_state(case, &receiver).await
                }
            };
            progress(&format!(
                "case {size}: {} verified, failures {:?}, pool {}/{} pages free",
                case.verified,
                case.failures,
                case.pages_free_after.unwrap_or(0),
                case.pages_total.unwrap_or(0)
            ));
            if case.same_host_pulls == Some(true) {
                progress(&format!(
                    "case {size}: pages pulled from the prefill's memory (same host)"
                ));
            }
            // The prefill ends the connection once every verdict reached it: closing from this
            // side first could drop the last VERIFIED still on its way (over RDMA a closed
            // queue pair flushes the SENDs it had posted), and that transfer would count as
            // Unconfirmed there. Bounded: a prefill that never closes is left after 10 s.
            let waited = std::time::Instant::now();
            while waited.elapsed() < std::time::Duration::from_secs(10) {
                match receiver.stats().await {
                    Ok(st) if !st.peer_lost => {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await
                    }
                    _ => break,
                }
            }
            cases.push(with_baseline(case, raw_run, raw_in_flight));
        }
    }
    Ok(Report {
        spec: spec.clone(),
        transport: spec.transport.name().into(),
        metrics: spec.metrics.as_ref().map(|m| m.encode()),
        worker_threads: tokio::runtime::Handle::current().metrics().num_workers(),
        cases,
    })
}

/// Which end of a two-process raw baseline this process is.
#[derive(Clone, Copy)]
enum RawSide {
    /// Writes the source pages.
    Prefill,
    /// Reads into the destination pages.
    Decode,
}

/// The engine workload's memory for one end of a raw baseline (written through) and that
/// end's page indices in stream order; `None` for the pool workload.
fn raw_engine_memory(
    spec: &BenchSpec,
    page: u32,
    side: RawSide,
) -> Option<(raw::RawMemory, Vec<u32>)> {
    match spec.workload {
        Workload::Pool => None,
        Workload::Engine { .. } => {
            let (src, dst) =
                engine::raw_pages(spec, page, spec.transfers(page) * u64::from(spec.pages));
            let (pages, fill) = match side {
                RawSide::Prefill => (src, 0x5a),
                RawSide::Decode => (dst, 0xa5),
            };
            let memory = raw::RawMemory::new(
                page as usize,
                spec.buffers as usize,
                engine::memory_pages(spec, page),
                fill,
                spec.buffer_offset,
            );
            Some((memory, pages))
        }
    }
}

/// Two-process mode, decode side: one raw baseline run (streaming, or with the case's
/// requests in flight), reading into memory written through before the clock starts and
/// freed after it stopped.
async fn listen_raw(
    spec: &BenchSpec,
    page: u32,
    listener: &TcpListener,
    in_flight: Option<raw::InFlight>,
) -> Result<RawRun, String> {
    let record = (u64::from(page) * u64::from(spec.buffers)) as usize;
    let total = spec.transfers(page) * spec.transfer_bytes(page);
    let engine_memory = raw_engine_memory(spec, page, RawSide::Decode);
    let mut s = raw::accept_raw(listener).await;
    let (start, cpu) = (Instant::now(), CpuClock::start());
    let landed = match engine_memory {
        None => raw_read(&mut s, total, record, spec.buffer_offset)
            .await
            .map(|()| None),
        Some((memory, dst)) => engine_raw_read(s, memory, dst, in_flight).await.map(Some),
    }
    .map_err(|e| e.to_string())?;
    let run = RawRun::since(start, cpu, total);
    drop(landed);
    Ok(run)
}

/// Two-process mode, prefill side: one raw baseline run against [`listen_raw`].
async fn connect_raw(
    spec: &BenchSpec,
    page: u32,
    addr: SocketAddr,
    in_flight: Option<raw::InFlight>,
) -> Result<RawRun, String> {
    let record = (u64::from(page) * u64::from(spec.buffers)) as usize;
    let total = spec.transfers(page) * spec.transfer_bytes(page);
    let engine_memory = raw_engine_memory(spec, page, RawSide::Prefill);
    let mut s = connect_retry(addr).await?;
    raw::announce_raw(&mut s).await.map_err(|e| e.to_string())?;
    let (start, cpu) = (Instant::now(), CpuClock::start());
    let sent = match engine_memory {
        None => raw_write(&mut s, total, record, spec.buffer_offset)
            .await
            .map(|()| None),
        Some((memory, src)) => engine_raw_write(s, memory, src, in_flight).await.map(Some),
    }
    .map_err(|e| e.to_string())?;
    let run = RawRun::since(start, cpu, total);
    drop(sent);
    Ok(run)
}

/// Two-process mode, prefill side: connects to [`run_listen`] and sends every case.
pub async fn run_connect(
    spec: &BenchSpec,
    addr: SocketAddr,
    raw: bool,
    mut progress: impl FnMut(&str),
) -> Result<Report, String> {
    let mut cases = Vec::new();
    for &page in &spec.page_sizes {
        let (mut raw_run, mut raw_in_flight) = (None, None);
        if raw && spec.transport == BenchTransport::Tcp {
            raw_run = Some(connect_raw(spec, page, addr, None).await?);
            if let Some(f) = spec.in_flight() {
                raw_in_flight = Some(connect_raw(spec, page, addr, Some(f)).await?);
            }
        }
        let engine = match spec.workload {
            Workload::Pool => None,
            Workload::Engine { .. } => Some(EngineSide::new(spec, page, engine::SEND_SEED)?),
        };
        let node = match &engine {
            Some(e) => e.node.clone(),
            None => spec.node(spec.node_config(page))?,
        };
        let stream = connect_retry(addr).await?;
        let sender = SenderConn::start(stream, &node, true)
            .await
            .map_err(|e| e.to_string())?;
        progress(&format!(
            "case {}: connected over {}",
            human_bytes(u64::from(page)),
            spec.transport.name()
        ));
        let case = match engine {
            None => run_sender_side(spec, page, &sender).await,
            Some(tx) => {
                let (s, spec2) = (sender.clone(), spec.clone());
                run_side(spec, page, move |id| tx.send_one(&s, &spec2, id)).await
            }
        };
        cases.push(with_memcpy(
            with_baseline(case, raw_run, raw_in_flight),
            spec,
            page,
        ));
    }
    Ok(Report {
        spec: spec.clone(),
        transport: spec.transport.name().into(),
        metrics: spec.metrics.as_ref().map(|m| m.encode()),
        worker_threads: tokio::runtime::Handle::current().metrics().num_workers(),
        cases,
    })
}

pub(crate) async fn connect_retry(addr: SocketAddr) -> Result<TcpStream, String> {
    let mut last = String::new();
    for _ in 0..100 {
        match TcpStream::connect(addr).await {
            Ok(s) => return Ok(s),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("could not connect to {addr}: {last}"))
}

/// One role of a case: runs `one(id)` for every transfer at the spec's concurrency.
async fn run_side<F, Fut>(spec: &BenchSpec, page: u32, one: F) -> CaseResult
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Outcome> + Send,
{
    let transfers = spec.transfers(page);
    let next = Arc::new(AtomicU64::new(1));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let one = Arc::new(one);
    let tick = spec.on_transfer.clone();
    let (start, cpu) = (Instant::now(), CpuClock::start());
    let mut workers = Vec::new();
    for _ in 0..spec.concurrency {
        let (next, tally, one, tick) = (next.clone(), tally.clone(), one.clone(), tick.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let id = next.fetch_add(1, Ordering::Relaxed);
                if id > transfers {
                    return;
                }
                let t0 = Instant::now();
                let outcome = one(id).await;
                if let Some(t) = &tick {
                    (t.0)();
                }
                let mut t = tally.lock().unwrap_or_else(|p| p.into_inner());
                match outcome {
                    Outcome::Verified(checked) => {
                        t.verified += 1;
                        t.latencies.push(t0.elapsed());
                        match checked {
                            Some(true) => t.checked += 1,
                            Some(false) => {
                                *t.failures.entry("BYTES_DIFFER".into()).or_default() += 1
                            }
                            None => {}
                        }
                    }
                    Outcome::Failed(e) => t.fail(&e),
                }
            }
        }));
    }
    for w in workers {
        let _ = w.await;
    }
    let (seconds, cpu_seconds) = (start.elapsed().as_secs_f64(), cpu.seconds());
    let t = std::mem::take(&mut *tally.lock().unwrap_or_else(|p| p.into_inner()));
    t.result(spec, page, seconds, cpu_seconds)
}

async fn run_receiver_side(spec: &BenchSpec, page: u32, receiver: &ReceiverConn) -> CaseResult {
    let (r, spec2) = (receiver.clone(), spec.clone());
    let case = run_side(spec, page, move |id| receive_one(&r, &spec2, id)).await;
    with_pool_state(case, receiver).await
}

/// Records the receiver's pool once every page has come back (releases travel on
/// channels), or after 5 s, whichever is first; and whether the connection pulled its pages
/// (same-host pulls).
async fn with_pool_state(mut case: CaseResult, receiver: &ReceiverConn) -> CaseResult {
    for _ in 0..500 {
        if let Ok(s) = receiver.stats().await {
            case.pages_free_after = Some(s.pages_free);
            case.pages_total = Some(s.pages_total);
            case.same_host_pulls = Some(s.same_host_pulls);
            case.failed_lanes = Some(s.failed_lanes);
            case.moves = Some(s.moves);
            case.striped = Some(s.striped);
            if s.pages_free == s.pages_total {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    case
}

async fn run_sender_side(spec: &BenchSpec, page: u32, sender: &SenderConn) -> CaseResult {
    sender
        .fill_free_pages(|_, b, bytes| fill_body(b, bytes))
        .await
        .ok();
    let (s, tokens) = (sender.clone(), spec.tokens());
    let mut case = run_side(spec, page, move |id| send_one(&s, tokens, id)).await;
    if let Ok(s) = sender.stats().await {
        case.failed_lanes = Some(s.failed_lanes);
        case.moves = Some(s.moves);
    }
    case
}

#[cfg(test)]
mod tests {
    use super::Tally;
    use kvwire::{FailureReason, TransferError};

    /// SPEC §7.6: a transfer whose verdict never came back may have been delivered; the bench
    /// counts it apart, by what ended the wait, never as a failure of that code.
    #[test]
    fn unconfirmed_transfers_are_counted_apart_from_failures() {
        let mut t = Tally::default();
        t.fail(&TransferError::Failed(FailureReason::Unconfirmed {
            cause: Box::new(FailureReason::PeerUnresponsive),
        }));
        t.fail(&TransferError::Failed(FailureReason::PeerUnresponsive));
        assert_eq!(t.unconfirmed.get("PEER_UNRESPONSIVE"), Some(&1));
        assert_eq!(t.failures.get("PEER_UNRESPONSIVE"), Some(&1));
        assert_eq!(t.failures.len(), 1);
    }
}
