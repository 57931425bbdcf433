//! [`Pair`]: a prefill driver and a decode driver joined by a transport, driven by one
//! harness, in the spirit of quinn-proto's test `Pair`.
//!
//! Both ends are the production drivers ([`SenderDriver`], [`ReceiverDriver`]) over
//! [`FaultySender`] / [`FaultyReceiver`] transports, so every fault of the shared [`FaultPlan`] can be injected at the
//! seam. Over the loopback transport ([`Pair::new`]) nothing reads a clock: time starts at an
//! arbitrary instant and advances only to the next packet or deadline ([`Pair::drive`]), so
//! every run is reproducible. Over a real transport (TCP, RDMA) the same pair runs in real
//! time ([`Pair::drive_live`]).
//!
//! The harness also keeps the evidence the safety invariants are checked against: every
//! outcome on both sides, the content of every verified transfer, and (loopback) every write
//! that landed where it must not.

use kvwire_proto::wire::TransferId;
use std::future::{poll_fn, Future};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use kvwire_proto::handshake::Established;
use kvwire_proto::receiver::ReceiverConfig;
use kvwire_proto::sender::{SenderConfig, SenderEvent};
use kvwire_proto::wire::{DigestAlgorithm, ErrorCode, Hello, Role};
use kvwire_proto::FailureReason;

use super::faults::{FaultPlan, FaultRule, FaultyReceiver, FaultySender, Request, Side};
use crate::config::{ConfigError, EngineConfig};
use crate::memory::{PagePool, PoolGeometry, Scrub};
use crate::receiver::{ReceiveOutcome, ReceiverDriver};
use crate::sender::SenderDriver;
use crate::transport::loopback::{
    self, LandingRecord, LoopbackReceiver, LoopbackSender, WireStats,
};
use crate::transport::{ReceiverTransport, SenderTransport};

/// The nonce seed of every [`Pair`]'s receiver: fixed, so a pair's runs (and the fault
/// matrix's pinned tables) are deterministic. Real connections draw a fresh seed each
/// (SPEC §5.2.1; the engine does).
pub const PAIR_NONCE_SEED: u64 = 0x6b76_7769_7265_0001;

/// How to build a [`Pair`].
#[derive(Clone, Debug)]
pub struct PairConfig {
    /// The sender's pool.
    pub sender_pool: PoolGeometry,
    /// The receiver's pool (same tokens per page and buffers; page count may differ).
    pub receiver_pool: PoolGeometry,
    /// The sender engine's configuration.
    pub sender_engine: EngineConfig,
    /// The receiver engine's configuration.
    pub receiver_engine: EngineConfig,
    /// Scrub policy of the receiver's pool.
    pub receiver_scrub: Scrub,
    /// One-way latency of the loopback wire.
    pub latency: Duration,
    /// Sender posting window (page writes outstanding per transfer).
    pub window: u32,
    /// Sender session settings.
    pub sender: SenderConfig,
    /// Receiver session settings.
    pub receiver: ReceiverConfig,
}

impl PairConfig {
    /// A small layout: 3 buffers of 512, 256 and 512 bytes per page, 16 tokens per page,
    /// 64 pages per pool (1024 tokens), context length 1024.
    pub fn small() -> Self {
        let geometry = PoolGeometry {
            tokens_per_page: 16,
            buffer_page_bytes: vec![512, 256, 512],
            pages: 64,
        };
        Self {
            sender_pool: geometry.clone(),
            receiver_pool: geometry,
            sender_engine: EngineConfig::new(1024),
            receiver_engine: EngineConfig::new(1024),
            receiver_scrub: Scrub::None,
            latency: Duration::from_micros(50),
            window: 4,
            sender: SenderConfig::default(),
            receiver: ReceiverConfig::default(),
        }
    }

    /// The hello of the end in `role`, for this configuration's layout.
    pub fn hello(&self, role: Role) -> Hello {
        let geometry = if role == Role::SENDER {
            &self.sender_pool
        } else {
            &self.receiver_pool
        };
        Hello {
            node_id: u64::from(role.0),
            role,
            layout: geometry.to_layout(b"test-model/tp0".to_vec()),
            digests: vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32],
            transport_params: Vec::new(),
            max_aux: 4096,
        }
    }

    /// Both pools, the receiver's pre-filled with another tenant's bytes: pages are not
    /// zeroed between requests, exactly as in the incident.
    pub fn pools(&self) -> Result<(Arc<PagePool>, Arc<PagePool>), PairError> {
        let s_pool = PagePool::new(self.sender_pool.clone(), Scrub::None)?;
        let r_pool = PagePool::new(self.receiver_pool.clone(), self.receiver_scrub)?;
        for p in 0..r_pool.capacity_pages() {
            for b in 0..r_pool.buffers() {
                if let Some(mut page) = r_pool.raw_page_mut(p, b) {
                    page.fill(0xA0 | (p as u8 & 0x0f));
                }
            }
        }
        Ok((Arc::new(s_pool), Arc::new(r_pool)))
    }
}

/// Why a [`Pair`] could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PairError {
    /// A pool could not be built.
    #[error("pool: {0}")]
    Pool(#[from] crate::memory::PoolError),
    /// An engine refused to start.
    #[error("engine refused to start: {0}")]
    Config(#[from] ConfigError),
    /// The handshake failed.
    #[error("handshake: {0}")]
    Handshake(String),
}

/// The deterministic KV content of page `ordinal`, buffer `buffer` of `transfer_id`: what
/// the prefill engine "computed". Tests compare delivered bytes against it.
pub fn kv_pattern(transfer_id: TransferId, ordinal: u32, buffer: usize, page: &mut [u8]) {
    let mut x = transfer_id
        .0
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(ordinal) << 20)
        .wrapping_add(buffer as u64)
        | 1;
    for chunk in page.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// The first page (ordinal, buffer) of a delivered transfer whose bytes differ from
/// [`kv_pattern`] of `transfer_id` (or cannot be read), if any: what tests check a verified
/// transfer against.
pub fn first_pattern_mismatch(
    kv: &crate::engine::Verified,
    transfer_id: TransferId,
) -> Option<(usize, usize)> {
    let mut want = Vec::new();
    (0..kv.pages())
        .flat_map(|o| (0..kv.buffers()).map(move |b| (o, b)))
        .find(|&(o, b)| match kv.page(o, b) {
            Ok(page) => {
                want.resize(page.len(), 0);
                kv_pattern(transfer_id, o as u32, b, &mut want);
                *page != want[..]
            }
            Err(_) => true,
        })
}

/// Runs a handshake between two machines over encoded bytes, in memory.
pub fn handshake(
    now: Instant,
    client_hello: Hello,
    server_hello: Hello,
) -> Result<(Established, Established), String> {
    kvwire_proto::handshake::in_memory(now, client_hello, server_hello).map_err(|e| e.to_string())
}

const MAX_STEPS: usize = 1_000_000;

/// A prefill driver and a decode driver over one connection, with a fault plan.
#[derive(Debug)]
pub struct Pair<S = LoopbackSender, R = LoopbackReceiver> {
    /// The harness's clock (simulated over loopback).
    pub now: Instant,
    /// The prefill side.
    pub sender: SenderDriver<FaultySender<S>>,
    /// The decode side.
    pub receiver: ReceiverDriver<FaultyReceiver<R>>,
    /// The fault rules of both ends.
    pub plan: Arc<Mutex<FaultPlan>>,
    /// Everything the sender's engine was told.
    pub sender_events: Vec<SenderEvent>,
    /// Transfers the receiver verified (their content was checked, then released).
    pub verified: Vec<TransferId>,
    /// Verified transfers whose bytes differed from what the sender wrote (must be empty).
    pub wrong_content: Vec<TransferId>,
    /// Transfers the receiver failed, with the reason.
    pub receiver_failures: Vec<(TransferId, FailureReason)>,
    /// The side that crashed, if any.
    pub crashed: Option<Side>,
    /// Whether the connection was torn down (a crash, or either side closed it).
    pub closed: bool,
    landings: Option<Arc<Mutex<LandingRecord>>>,
}

impl Pair {
    /// Both drivers over a loopback wire with simulated time, each validating its engine
    /// configuration against its pool as built, after an in-memory handshake (the decode
    /// side is the client).
    pub fn new(config: PairConfig) -> Result<Self, PairError> {
        let now = Instant::now();
        let (s_pool, r_pool) = config.pools()?;
        let (s, r) = loopback::connect(s_pool.clone(), r_pool.clone(), config.latency);
        let landings = r.landings();
        let mut pair = Self::with_transports(&config, now, (s_pool, s), (r_pool, r))?;
        pair.landings = Some(landings);
        Ok(pair)
    }

    /// What crossed the wire.
    pub fn wire_stats(&self) -> WireStats {
        self.sender.transport().inner().stats()
    }

    /// Whether nothing is in flight on the wire.
    pub fn wire_idle(&self) -> bool {
        self.sender.transport().inner().is_idle()
    }
}

impl<S: SenderTransport, R: ReceiverTransport> Pair<S, R> {
    /// Both drivers over the two ends of a connection already made (`(pool, transport)` of
    /// each side), after an in-memory handshake of `config`'s hellos.
    pub fn with_transports(
        config: &PairConfig,
        now: Instant,
        sender: (Arc<PagePool>, S),
        receiver: (Arc<PagePool>, R),
    ) -> Result<Self, PairError> {
        let (r_est, s_est) = handshake(
            now,
            config.hello(Role::RECEIVER),
            config.hello(Role::SENDER),
        )
        .map_err(PairError::Handshake)?;
        let plan = FaultPlan::shared();
        let (s_pool, s) = sender;
        let (r_pool, r) = receiver;
        let s = FaultySender::new(s, plan.clone());
        let r = FaultyReceiver::new(r, plan.clone(), r_pool.clone());
        let sender = SenderDriver::new(
            &s_est,
            s_pool,
            &config.sender_engine,
            config.sender.clone(),
            config.window,
            s,
        )?;
        let receiver = ReceiverDriver::new(
            &r_est,
            r_pool,
            &config.receiver_engine,
            config.receiver.clone(),
            PAIR_NONCE_SEED,
            r,
        )?;
        Ok(Self {
            now,
            sender,
            receiver,
            plan,
            sender_events: Vec::new(),
            verified: Vec::new(),
            wrong_content: Vec::new(),
            receiver_failures: Vec::new(),
            crashed: None,
            closed: false,
            landings: None,
        })
    }

    /// Adds a fault rule.
    pub fn fault(&mut self, rule: FaultRule) -> &mut Self {
        self.plan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .add(rule);
        self
    }

    /// Writes that landed in a page not leased to their transfer (loopback; must stay
    /// empty).
    pub fn illegal_landings(&self) -> Vec<(kvwire_proto::wire::TransferRef, u32)> {
        self.landings.as_ref().map_or_else(Vec::new, |l| {
            l.lock().unwrap_or_else(|p| p.into_inner()).illegal.clone()
        })
    }

    /// Access scopes the receiver's transport has open.
    pub fn open_scopes(&self) -> usize {
        self.receiver.transport().open_scopes()
    }

    /// Writes the sender's fault injector holds back for `transfer_id`.
    pub fn held_writes(&self, transfer_id: TransferId) -> usize {
        self.sender.transport().held_writes(transfer_id)
    }

    fn alive(&self, side: Side) -> bool {
        self.crashed != Some(side)
    }

    /// Crashes a side now: it does nothing more, and what it had not sent is never sent.
    /// Its end of the connection closes; the survivor learns of it after what was already
    /// on its way.
    pub fn crash(&mut self, side: Side) {
        if self.crashed.is_some() {
            return;
        }
        self.crashed = Some(side);
        self.closed = true;
        let now = self.now;
        match side {
            Side::Sender => {
                self.sender.transport_mut().crash();
                self.sender.transport_mut().inner_mut().close(now);
            }
            Side::Receiver => {
                self.receiver.transport_mut().crash();
                self.receiver.transport_mut().inner_mut().close(now);
            }
        }
    }

    /// Tears the connection down now from both sides (both alive).
    pub fn close_connection(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let now = self.now;
        self.receiver.close(now);
        self.sender.close(now);
    }

    /// Acts on what fault triggers asked for. Returns whether there was anything.
    fn serve_requests(&mut self) -> bool {
        let requests = self
            .plan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take_requests();
        let any = !requests.is_empty();
        let now = self.now;
        for r in requests {
            match r {
                Request::Crash(side) => self.crash(side),
                Request::Abort(side, id) if self.alive(side) => {
                    match side {
                        Side::Sender => self.sender.abort(now, id, ErrorCode::CANCELLED),
                        Side::Receiver => self.receiver.abort(now, id, ErrorCode::CANCELLED),
                    };
                }
                Request::Abort(..) => {}
            }
        }
        any
    }

    /// Polls both live drivers once each (at `self.now`, waking `cx` later), takes their
    /// outcomes and serves fault triggers. Returns whether anything happened.
    fn poll_round(&mut self, cx: &mut Context<'_>) -> bool {
        let now = self.now;
        let mut progress = self.serve_requests();
        if self.alive(Side::Sender) && self.sender.poll_input(cx, now).is_ready() {
            progress = true;
        }
        progress |= self.serve_requests();
        if self.alive(Side::Receiver) && self.receiver.poll_input(cx, now).is_ready() {
            progress = true;
        }
        progress |= self.serve_requests();
        if self.alive(Side::Sender) {
            while let Some(e) = self.sender.poll_event() {
                progress = true;
                self.sender_events.push(e);
            }
        }
        if self.alive(Side::Receiver) {
            while let Some(o) = self.receiver.poll_outcome() {
                progress = true;
                self.consume(o);
            }
        }
        if self.sender.closed().is_some() || self.receiver.closed().is_some() {
            self.closed = true;
        }
        progress
    }

    /// When the next deadline or packet of a live side is due.
    fn next_deadline(&mut self) -> Option<Instant> {
        let mut next = None;
        if self.alive(Side::Sender) {
            next = self.sender.poll_timeout();
        }
        if self.alive(Side::Receiver) {
            next = next.into_iter().chain(self.receiver.poll_timeout()).min();
        }
        next
    }

    fn handle_timeouts(&mut self) {
        let now = self.now;
        if self.alive(Side::Sender) {
            self.sender.handle_timeout(now);
        }
        if self.alive(Side::Receiver) {
            self.receiver.handle_timeout(now);
        }
    }

    /// Simulated time: one step, i.e. one round of polls, or time advanced to the next packet
    /// or deadline. Returns false when nothing is left to happen.
    pub fn step(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        if self.poll_round(&mut cx) {
            return true;
        }
        let Some(at) = self.next_deadline() else {
            return false;
        };
        self.now = self.now.max(at);
        self.handle_timeouts();
        true
    }

    /// Simulated time: steps until nothing is left to happen.
    ///
    /// # Panics
    /// If the simulation does not settle within a million steps (a livelock is a bug).
    pub fn drive(&mut self) {
        for _ in 0..MAX_STEPS {
            if !self.step() {
                return;
            }
        }
        panic!("pair did not settle within {MAX_STEPS} steps");
    }

    /// Simulated time: steps until `pred` holds or nothing is left to happen; returns
    /// whether it held.
    pub fn drive_until(&mut self, mut pred: impl FnMut(&Self) -> bool) -> bool {
        for _ in 0..MAX_STEPS {
            if pred(self) {
                return true;
            }
            if !self.step() {
                return pred(self);
            }
        }
        false
    }

    /// Whether every live side has ended every transfer it had.
    pub fn settled(&self) -> bool {
        (!self.alive(Side::Sender) || self.sender.session().open_transfers() == 0)
            && (!self.alive(Side::Receiver) || self.receiver.session().open_transfers() == 0)
    }

    /// Real time (TCP, RDMA): drives both ends until [`Pair::settled`] holds, or `limit`
    /// passes. Returns whether it settled.
    pub async fn drive_live(&mut self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        loop {
            self.now = Instant::now();
            if self.now >= end {
                return false;
            }
            let wake = self.next_deadline().map_or(end, |d| d.min(end));
            let sleep = tokio::time::sleep_until(tokio::time::Instant::from_std(wake));
            tokio::pin!(sleep);
            // Settled once nothing more happens at once; after progress the next deadline
            // may have moved (recompute it); otherwise wait for a wake-up or the deadline.
            enum Next {
                Settled,
                Progress,
                Deadline,
            }
            let next = poll_fn(|cx| {
                self.now = Instant::now();
                let mut any = false;
                while self.poll_round(cx) {
                    any = true;
                }
                if self.settled() {
                    return Poll::Ready(Next::Settled);
                }
                if any {
                    return Poll::Ready(Next::Progress);
                }
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Next::Deadline),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match next {
                Next::Settled => return true,
                Next::Progress => {}
                Next::Deadline => {
                    self.now = Instant::now();
                    self.handle_timeouts();
                }
            }
        }
    }

    /// The engine's side of a verified transfer: check every page holds exactly
    /// [`kv_pattern`], record it, and give the pages back.
    fn consume(&mut self, outcome: ReceiveOutcome) {
        match outcome {
            ReceiveOutcome::Verified(kv) => {
                let id = kv.transfer.transfer_id;
                let pool = self.receiver.pool().clone();
                let mut expected = Vec::new();
                let ok = (0..kv.pages()).all(|ord| {
                    (0..pool.buffers()).all(|b| match kv.page(&pool, ord, b) {
                        Ok(bytes) => {
                            expected.resize(bytes.len(), 0);
                            kv_pattern(id, ord as u32, b, &mut expected);
                            *bytes == expected[..]
                        }
                        Err(_) => false,
                    })
                });
                if !ok {
                    self.wrong_content.push(id);
                }
                self.verified.push(id);
                if let Err(e) = self.receiver.release(kv) {
                    panic!("releasing verified pages of transfer {id}: {e}");
                }
            }
            ReceiveOutcome::Failed { transfer, reason } => {
                self.receiver_failures.push((transfer.transfer_id, reason))
            }
        }
    }

    /// The receiver's failure reason for a transfer, if it failed.
    pub fn receiver_failure(&self, transfer_id: TransferId) -> Option<&FailureReason> {
        self.receiver_failures
            .iter()
            .find(|(id, _)| *id == transfer_id)
            .map(|(_, r)| r)
    }

    /// The sender's failure reason for a transfer, if it failed.
    pub fn sender_failure(&self, transfer_id: TransferId) -> Option<&FailureReason> {
        self.sender_events.iter().find_map(|e| match e {
            SenderEvent::Failed { transfer, reason } if transfer.transfer_id == transfer_id => {
                Some(reason)
            }
            _ => None,
        })
    }

    /// Whether the sender was told the receiver verified the transfer.
    pub fn sender_verified(&self, transfer_id: TransferId) -> bool {
        self.sender_events
            .iter()
            .any(|e| matches!(e, SenderEvent::Verified(t) if t.transfer_id == transfer_id))
    }
}
