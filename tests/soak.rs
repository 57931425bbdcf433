//! A bounded soak: 10,000 transfers (KVWIRE_SOAK_TRANSFERS) in total, seeded and
//! reproducible (KVWIRE_SOAK_SEED; the seed is printed), over
//!
//! * the loopback `Pair` with its fault knobs (lost, duplicated, corrupted, truncated writes;
//!   dropped, duplicated, delayed, corrupted frames; a commit overtaking its data; late
//!   writes; aborts from either side at any step; a crash of either peer), with random aborts
//!   from both sides and rejected requests mixed in; and
//! * the real tokio engine over TCP on 127.0.0.1 (authenticated), with random aborts from both
//!   sides, rejected requests, and the sender's connection dropped mid-batch.
//!
//! Accounting at the end, asserted: every transfer was verified with the sender's bytes
//! (checked against the pattern) or failed with a typed reason (tallied and printed); both
//! pools back to full; no write landed in an unleased page (the harness's landing record); no
//! tokio task left alive once the connections are dropped. No timed assertions: waits are
//! bounded by rounds, never by durations.

mod common;

use kvwire::TransferId;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{assert_invariants, try_reserve, try_send};
use kvwire::proto::admission::Request;
use kvwire::proto::wire::{ErrorCode, FrameType};
use kvwire::receiver::ReserveParams;
use kvwire::testkit::{kv_pattern, Pair, PairConfig};
use kvwire::testkit::{Fault, FaultRule, Side, Step};
use kvwire::{Node, NodeConfig, ReceiverConn, SenderConn, TransferError};

/// splitmix64: small, seedable, good enough to pick faults.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<T: Clone>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize].clone()
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| {
        let v = v.trim();
        v.strip_prefix("0x")
            .map_or_else(|| v.parse().ok(), |h| u64::from_str_radix(h, 16).ok())
    })
}

/// Outcomes by name: "verified", or the typed reason a transfer failed.
#[derive(Default)]
struct Tally(BTreeMap<String, u64>);

impl Tally {
    fn add(&mut self, what: impl Into<String>) {
        *self.0.entry(what.into()).or_default() += 1;
    }
    fn total(&self) -> u64 {
        self.0.values().sum()
    }
    fn get(&self, k: &str) -> u64 {
        self.0.get(k).copied().unwrap_or(0)
    }
}

// ---------------------------------------------------------------------------------------------
// Loopback.

const FRAMES: &[FrameType] = &[
    FrameType::RESERVE,
    FrameType::COMMIT,
    FrameType::VERIFIED,
    FrameType::NACK,
    FrameType::ABORT,
    FrameType::ABORT_ACK,
];

fn random_step(rng: &mut Rng) -> Step {
    if rng.chance(20) {
        Step::FirstWrite
    } else {
        Step::Frame(rng.pick(&[
            FrameType::RESERVE,
            FrameType::REJECT,
            FrameType::COMMIT,
            FrameType::VERIFIED,
            FrameType::NACK,
            FrameType::ABORT,
            FrameType::ABORT_ACK,
        ]))
    }
}

fn random_side(rng: &mut Rng) -> Side {
    if rng.chance(50) {
        Side::Sender
    } else {
        Side::Receiver
    }
}

/// A fault that leaves the connection up, or none (half the time).
fn random_fault(rng: &mut Rng) -> Option<Fault> {
    let ord = rng.below(6) as u32;
    Some(match rng.below(22) {
        0..=10 => return None,
        11 => Fault::DropWrite { ordinal: ord },
        12 => Fault::CorruptByte {
            ordinal: ord,
            buffer: rng.below(2) as usize,
            offset: rng.below(4096) as usize,
        },
        13 => Fault::TruncateWrite {
            ordinal: ord,
            keep: rng.below(300) as usize,
        },
        14 => Fault::DuplicateWrite { ordinal: ord },
        15 => Fault::CommitBeforeData,
        16 => Fault::LateWrites,
        17 => Fault::DropFrame(rng.pick(FRAMES)),
        18 => Fault::DuplicateFrame(rng.pick(FRAMES)),
        19 => Fault::DelayFrame(rng.pick(FRAMES), Duration::from_millis(rng.below(4000))),
        _ => Fault::Abort(random_side(rng), random_step(rng)),
    })
}

/// One Pair round of `n` concurrent transfers; returns their outcomes.
fn loopback_round(rng: &mut Rng, first_id: u64, n: u64, tally: &mut Tally) {
    let mut cfg = PairConfig::small();
    cfg.sender_pool.pages = 128;
    cfg.receiver_pool.pages = 128;
    cfg.sender_engine.max_context_tokens = 1024;
    cfg.receiver_engine.max_context_tokens = 1024;
    let mut pair = Pair::new(cfg).unwrap();
    let ids: Vec<TransferId> = (first_id..first_id + n).map(TransferId).collect();
    for &id in &ids {
        if let Some(f) = random_fault(rng) {
            pair.fault(FaultRule::on(id, f));
        }
    }
    // Now and then a fault that ends the connection: a crash or a corrupted frame.
    if rng.chance(8) {
        let victim = rng.pick(&ids);
        let f = if rng.chance(50) {
            Fault::Crash(random_side(rng), random_step(rng))
        } else {
            Fault::CorruptFrame(rng.pick(FRAMES))
        };
        pair.fault(FaultRule::on(victim, f));
    }
    let mut started: Vec<(TransferId, bool)> = Vec::new(); // (id, reserved)
    for (i, &id) in ids.iter().enumerate() {
        let tokens = 1 + rng.below(199) as u32;
        let rejected = rng.chance(5);
        let tx_tokens = if rejected { 5000 } else { u64::from(tokens) };
        let reserve_first = rng.chance(50);
        let (reserved, admitted) = if reserve_first {
            let r = try_reserve(&mut pair, id, tokens);
            let a = try_send(&mut pair, id, tx_tokens);
            (r, a)
        } else {
            let a = try_send(&mut pair, id, tx_tokens);
            (try_reserve(&mut pair, id, tokens), a)
        };
        // A rejected request is counted once, by the receiver's outcome (REJECT with the
        // admission error's code).
        let _ = admitted;
        match reserved {
            Ok(_) => started.push((id, true)),
            Err(e) => {
                assert!(
                    pair.closed,
                    "reservation {id} refused on a live connection: {e}"
                );
                started.push((id, false));
            }
        }
        for _ in 0..(i % 3) * 5 {
            pair.step();
        }
    }
    // Random aborts from both sides, at random points.
    for _ in 0..rng.below(3) {
        for _ in 0..rng.below(40) {
            pair.step();
        }
        let id = rng.pick(&ids);
        let now = pair.now;
        match random_side(rng) {
            Side::Sender => pair.sender.abort(now, id, ErrorCode::CANCELLED),
            Side::Receiver => pair.receiver.abort(now, id, ErrorCode::CANCELLED),
        };
    }
    pair.drive();
    assert_invariants(&pair);
    for (id, reserved) in started {
        if !reserved {
            tally.add("receiver: reservation refused (connection lost)");
        } else if pair.verified.contains(&id) {
            tally.add("verified");
        } else if let Some(r) = pair.receiver_failure(id) {
            tally.add(format!("receiver: {}", r.code()));
        } else {
            assert_eq!(
                pair.crashed,
                Some(Side::Receiver),
                "transfer {id} never ended at the receiver"
            );
            tally.add("receiver: crashed");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// TCP.

fn tcp_config() -> NodeConfig {
    let mut c = NodeConfig::example();
    c.receiver.abort_ack_timeout = Duration::from_millis(200);
    c.sender.abort_ack_timeout = Duration::from_millis(200);
    c.sender.verdict_timeout = Duration::from_secs(5);
    c
}

fn tcp_reason(e: &TransferError) -> String {
    match e {
        TransferError::Failed(r) => format!("{}", r.code()),
        TransferError::Reserve(e) => format!("reserve refused: {e}"),
        TransferError::Rejected(e) => format!("rejected at admission: {e:?}"),
        TransferError::Start(e) => format!("start refused: {e}"),
        TransferError::ConnectionClosed => "connection closed".into(),
        TransferError::Unauthenticated(e) => format!("unauthenticated: {}", e.code()),
        other => panic!("untyped transfer error {other}"),
    }
}

/// One TCP connection, `n` transfers, up to 8 in flight; returns when every transfer ended.
/// Every batch opens new connections over the same two nodes (one registration each).
async fn tcp_batch(rng: &mut Rng, first_id: u64, n: u64, nodes: &(Node, Node), tally: &mut Tally) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let decode = nodes.1.clone();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode).await });
    let sender = SenderConn::connect(addr, &nodes.0).await.unwrap();
    let receiver = accept.await.unwrap().unwrap();
    // In some batches the sender's connection is dropped after `cut` transfers have started.
    let cut = rng.chance(15).then(|| rng.below(n));
    let mut sender = Some(sender);
    let mut rx_tasks = Vec::new();
    let mut tx_tasks = Vec::new();
    for i in 0..n {
        let id = TransferId(first_id + i);
        if cut == Some(i) {
            sender = None; // every handle gone: the engine closes the connection
        }
        let tokens = 1 + rng.below(199) as u32;
        let rejected = rng.chance(5);
        let abort_rx = rng.chance(5);
        let abort_tx = rng.chance(5);
        let v = receiver.reserve({
            let p = ReserveParams::new(id, tokens, Duration::from_secs(5));
            if rng.chance(50) {
                p.with_page_digests()
            } else {
                p
            }
        });
        rx_tasks.push(tokio::spawn(async move {
            match v.await {
                Ok(kv) => {
                    let ok = (0..kv.pages()).all(|o| {
                        (0..kv.buffers()).all(|b| {
                            let got = kv.page(o, b).unwrap();
                            let mut want = vec![0u8; got.len()];
                            kv_pattern(id, o as u32, b, &mut want);
                            *got == want[..]
                        })
                    });
                    kv.release().unwrap();
                    if !ok {
                        panic!("transfer {id} verified with the wrong bytes");
                    }
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }));
        if abort_rx {
            tokio::task::yield_now().await;
            receiver.abort(id, ErrorCode::CANCELLED);
        }
        if let Some(s) = &sender {
            let s = s.clone();
            let tx_tokens = if rejected { 1 << 20 } else { u64::from(tokens) };
            tx_tasks.push(tokio::spawn(async move {
                let a = s.admit(Request {
                    transfer_id: id,
                    tokens: tx_tokens,
                })?;
                let f = s.send(a, move |o, b, p| kv_pattern(id, o, b, p));
                if abort_tx {
                    tokio::task::yield_now().await;
                    s.abort(id, ErrorCode::CANCELLED);
                }
                // The handle goes now, so dropping the batch's own handle closes the
                // connection while transfers are still in flight.
                drop(s);
                f.await
            }));
        }
        if i % 8 == 7 {
            // Up to 8 in flight: wait for the oldest receiver outcomes.
            let start = rx_tasks.len().saturating_sub(8);
            for t in rx_tasks.drain(..start) {
                record(t.await.unwrap(), tally);
            }
        }
    }
    for t in rx_tasks {
        record(t.await.unwrap(), tally);
    }
    for t in tx_tasks {
        // The sender's own outcome must be typed too (it is not counted again).
        if let Err(e) = t.await.unwrap() {
            let _ = tcp_reason(&e);
        }
    }
    // Pools back to full: the receiver's now (a failure is reported after its release; the
    // last releases of verified handles travel on their own channel: bounded rounds).
    let mut s = receiver.stats().await.unwrap();
    for _ in 0..10_000 {
        if s.pages_free == s.pages_total {
            break;
        }
        tokio::task::yield_now().await;
        s = receiver.stats().await.unwrap();
    }
    assert_eq!(s.pages_free, s.pages_total, "receiver pages leaked: {s:?}");
    assert_eq!(s.pages_quarantined, 0, "{s:?}");
    if let Some(sender) = &sender {
        let t = sender.stats().await.unwrap();
        assert_eq!(t.pages_free, t.pages_total, "sender pages leaked: {t:?}");
    }
}

fn record(r: Result<(), TransferError>, tally: &mut Tally) {
    match r {
        Ok(()) => tally.add("verified"),
        Err(e) => tally.add(format!("receiver: {}", tcp_reason(&e))),
    }
}

#[test]
fn soak() {
    let seed = env_u64("KVWIRE_SOAK_SEED").unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        t ^ u64::from(std::process::id()).rotate_left(32)
    });
    let total = env_u64("KVWIRE_SOAK_TRANSFERS").unwrap_or(10_000).max(2);
    println!("soak: seed {seed:#x} (KVWIRE_SOAK_SEED={seed:#x} reproduces the fault plan), {total} transfers");
    let started = Instant::now();
    let mut rng = Rng(seed);
    let loopback_n = total * 6 / 10;
    let tcp_n = total - loopback_n;

    let mut lo = Tally::default();
    let mut id = 1;
    while id <= loopback_n {
        let n = (1 + rng.below(7)).min(loopback_n - id + 1);
        loopback_round(&mut rng, id, n, &mut lo);
        id += n;
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut tcp = Tally::default();
    rt.block_on(async {
        let config = tcp_config();
        let nodes = (
            Node::new(config.clone()).unwrap(),
            Node::new(config).unwrap(),
        );
        let base = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        let mut id = 1_000_000;
        let end = id + tcp_n;
        while id < end {
            let n = 50.min(end - id);
            tcp_batch(&mut rng, id, n, &nodes, &mut tcp).await;
            id += n;
        }
        // Every connection's handles are dropped: their tasks (connection, reader, writer)
        // must all end. Bounded rounds, not a duration.
        let metrics = tokio::runtime::Handle::current().metrics();
        let mut alive = metrics.num_alive_tasks();
        for _ in 0..100_000 {
            if alive <= base {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            alive = metrics.num_alive_tasks();
        }
        assert!(
            alive <= base,
            "{} tokio tasks still alive after every connection was dropped",
            alive - base
        );
        // Every page of both registrations came back, across all the connections.
        for node in [&nodes.0, &nodes.1] {
            assert!(
                node.pool().held_pages().is_empty(),
                "{:?}",
                node.pool().stats()
            );
        }
    });

    for (name, t) in [("loopback", &lo), ("tcp", &tcp)] {
        println!("soak: {name}: {} transfers", t.total());
        for (k, v) in &t.0 {
            println!("soak:   {k:<60} {v}");
        }
    }
    assert_eq!(
        lo.total() + tcp.total(),
        total,
        "every transfer accounted for"
    );
    assert!(
        lo.get("verified") > 0 && tcp.get("verified") > 0,
        "nothing verified"
    );
    println!(
        "soak: {} transfers, seed {seed:#x}: {} verified, {} failed with a typed reason, wall {:.1} s",
        total,
        lo.get("verified") + tcp.get("verified"),
        total - lo.get("verified") - tcp.get("verified"),
        started.elapsed().as_secs_f64()
    );
}
