//! A deterministic two-endpoint simulation, in the spirit of quinn-proto's test `Pair`.
//!
//! A [`Pair`] holds a prefill [`SenderEndpoint`] and a decode [`ReceiverEndpoint`], each with
//! its own [`PagePool`], joined by a loopback [`Link`] with simulated time. Nothing reads a
//! clock: time starts at an arbitrary instant and advances only to the next packet or
//! deadline, so every run is reproducible. Fault rules on the link drop, duplicate, corrupt,
//! delay or reorder frames and writes, deliver writes late, crash a side or abort a transfer
//! at any protocol step; [`Pair::drive`] runs until nothing is left to happen.
//!
//! The harness also keeps the evidence the safety invariants are checked against: every
//! outcome on both sides, every frame error, and the [`LandingRecord`] of writes that landed
//! where they must not.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvwire_proto::handshake::{Established, Handshake};
use kvwire_proto::receiver::ReceiverConfig;
use kvwire_proto::sender::{SenderConfig, SenderEvent};
use kvwire_proto::wire::{DigestAlgorithm, ErrorCode, Frame, Hello, Role};
use kvwire_proto::{FrameError, Scope};

use crate::config::{ConfigError, EngineConfig};
use crate::memory::{PagePool, PoolGeometry, Scrub};
use crate::receiver::{ReceiveOutcome, ReceiverEndpoint};
use crate::sender::SenderEndpoint;
use crate::transport::loopback::{
    land, Direction, Fault, HoldUntil, LandingRecord, Link, Packet, Side, Step, WriteOp,
};
use crate::transport::AccessKey;

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
    /// One-way latency.
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
pub fn kv_pattern(transfer_id: u64, ordinal: u32, buffer: usize, page: &mut [u8]) {
    let mut x = transfer_id
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

/// Two endpoints over a simulated wire.
#[derive(Debug)]
pub struct Pair {
    /// Simulated time.
    pub now: Instant,
    /// The prefill side.
    pub sender: SenderEndpoint,
    /// The decode side.
    pub receiver: ReceiverEndpoint,
    /// The wire, with its fault rules.
    pub link: Link,
    /// Writes that landed in a page not leased to their transfer (must stay empty).
    pub landings: LandingRecord,
    /// Everything the sender's engine was told.
    pub sender_events: Vec<SenderEvent>,
    /// Transfers the receiver verified (their content was checked, then released).
    pub verified: Vec<u64>,
    /// Verified transfers whose bytes differed from what the sender wrote (must be empty).
    pub wrong_content: Vec<u64>,
    /// Transfers the receiver failed, with the reason.
    pub receiver_failures: Vec<(u64, kvwire_proto::FailureReason)>,
    /// Frame errors each side saw.
    pub frame_errors: Vec<(Side, FrameError)>,
    /// The side that crashed, if any.
    pub crashed: Option<Side>,
    /// Whether the connection was torn down (by a crash or a connection-scope error).
    pub closed: bool,
    /// Page writes posted but not yet completed, per transfer.
    outstanding: BTreeMap<kvwire_proto::wire::TransferRef, u32>,
}

fn hello(role: Role, geometry: &PoolGeometry) -> Hello {
    Hello {
        node_id: u64::from(role.0),
        role,
        layout: geometry.to_layout(b"test-model/tp0".to_vec()),
        digests: vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32],
        transport_params: Vec::new(),
    }
}

/// Runs a handshake between two machines over encoded bytes.
pub fn handshake(
    now: Instant,
    client_hello: Hello,
    server_hello: Hello,
) -> Result<(Established, Established), String> {
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

const MAX_STEPS: usize = 1_000_000;

impl Pair {
    /// Builds both endpoints (each validating its engine configuration against its pool as
    /// built) and connects them with a handshake: the decode side is the client.
    pub fn new(config: PairConfig) -> Result<Self, PairError> {
        let now = Instant::now();
        let s_pool = PagePool::new(config.sender_pool.clone(), Scrub::None)?;
        let r_pool = PagePool::new(config.receiver_pool.clone(), config.receiver_scrub)?;
        // The receiver's pages start out holding another tenant's data: pages are not zeroed
        // between requests, exactly as in the incident.
        for p in 0..r_pool.capacity_pages() {
            for b in 0..r_pool.buffers() {
                if let Some(mut page) = r_pool.raw_page_mut(p, b) {
                    page.fill(0xA0 | (p as u8 & 0x0f));
                }
            }
        }
        let (r_est, s_est) = handshake(
            now,
            hello(Role::RECEIVER, &config.receiver_pool),
            hello(Role::SENDER, &config.sender_pool),
        )
        .map_err(PairError::Handshake)?;
        let sender = SenderEndpoint::new(
            &s_est,
            s_pool,
            &config.sender_engine,
            config.sender,
            config.window,
        )?;
        let receiver =
            ReceiverEndpoint::new(&r_est, r_pool, &config.receiver_engine, config.receiver)?;
        Ok(Self {
            now,
            sender,
            receiver,
            link: Link::new(config.latency),
            landings: LandingRecord::default(),
            sender_events: Vec::new(),
            verified: Vec::new(),
            wrong_content: Vec::new(),
            receiver_failures: Vec::new(),
            frame_errors: Vec::new(),
            crashed: None,
            closed: false,
            outstanding: BTreeMap::new(),
        })
    }

    /// Adds a fault rule.
    pub fn fault(&mut self, rule: crate::transport::loopback::FaultRule) -> &mut Self {
        self.link.rules.push(rule);
        self
    }

    fn alive(&self, side: Side) -> bool {
        self.crashed != Some(side)
    }

    /// Crashes a side now: it does nothing more, and what it had not sent is never sent.
    /// Packets already on the wire keep travelling; the survivor learns of the loss after
    /// them.
    pub fn crash(&mut self, side: Side) {
        if self.crashed.is_some() || self.closed {
            return;
        }
        self.crashed = Some(side);
        self.closed = true;
        match side {
            Side::Sender => {
                self.link.drop_direction(Direction::ToSender);
                self.link.drop_held();
                self.link.send_closed(Direction::ToReceiver, self.now);
            }
            Side::Receiver => {
                self.link.drop_direction(Direction::ToReceiver);
                self.link.drop_held();
                self.link.send_closed(Direction::ToSender, self.now);
            }
        }
    }

    /// Tears the connection down now (both sides alive): nothing more crosses the wire.
    pub fn close_connection(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.link.drop_direction(Direction::ToReceiver);
        self.link.drop_direction(Direction::ToSender);
        self.link.drop_held();
        let now = self.now;
        self.receiver.handle_peer_lost(now);
        self.flush_outstanding_writes();
        self.sender.handle_peer_lost(now);
    }

    /// Fails every write the sender still waits for (a torn-down QP flushes its queue).
    fn flush_outstanding_writes(&mut self) {
        let now = self.now;
        for (t, n) in std::mem::take(&mut self.outstanding) {
            for _ in 0..n {
                self.sender.handle_write_completion(now, t, false);
            }
        }
    }

    /// Fires crash and abort triggers for `step` of `transfer_id`. Returns whether `sender`
    /// (the side about to act) crashed.
    fn triggers(&mut self, step: Step, transfer_id: u64, acting: Side) -> bool {
        let hit = |f: &Fault| matches!(f, Fault::Crash(_, s) | Fault::Abort(_, s) if *s == step);
        while let Some(fault) = self.link.take_fault(transfer_id, hit) {
            match fault {
                Fault::Crash(side, _) => {
                    self.crash(side);
                    if side == acting {
                        return true;
                    }
                }
                Fault::Abort(side, _) if self.alive(side) => {
                    let now = self.now;
                    match side {
                        Side::Sender => self.sender.abort(now, transfer_id, ErrorCode::CANCELLED),
                        Side::Receiver => {
                            self.receiver.abort(now, transfer_id, ErrorCode::CANCELLED)
                        }
                    };
                }
                _ => {}
            }
        }
        false
    }

    fn send_frame(&mut self, from: Side, frame: Frame) {
        let ty = frame.frame_type();
        let id = frame.transfer().map(|t| t.transfer_id);
        if let Some(id) = id {
            if self.triggers(Step::Frame(ty), id, from) {
                return;
            }
        }
        if self.closed && self.crashed.is_none() {
            return;
        }
        let Ok(bytes) = frame.to_bytes() else { return };
        let dir = match from {
            Side::Sender => Direction::ToReceiver,
            Side::Receiver => Direction::ToSender,
        };
        self.link.send_frame(dir, self.now, ty, id, bytes);
    }

    /// Moves every output of both endpoints onto the wire. Returns whether anything moved.
    fn flush(&mut self) -> bool {
        let mut moved = false;
        loop {
            let mut any = false;
            if self.alive(Side::Sender) {
                while let Some(f) = self.sender.poll_transmit() {
                    any = true;
                    self.send_frame(Side::Sender, f);
                }
                while let Some(w) = self.sender.poll_write() {
                    any = true;
                    let id = w.transfer.transfer_id;
                    if w.write.ordinal == 0 && self.triggers(Step::FirstWrite, id, Side::Sender) {
                        break;
                    }
                    if !self.alive(Side::Sender) {
                        break;
                    }
                    let op = WriteOp {
                        transfer: w.transfer,
                        key: AccessKey::from_descriptor(&w.access).unwrap_or(AccessKey(0)),
                        ordinal: w.write.ordinal,
                        src_page: w.write.src_page,
                        dst_page: w.write.dst_page,
                        damage: crate::transport::loopback::Damage::None,
                        acked_early: false,
                    };
                    if self.closed {
                        // The connection is gone: the write fails at once.
                        self.sender
                            .handle_write_completion(self.now, w.transfer, false);
                    } else if self.link.post_write(self.now, op) {
                        self.sender
                            .handle_write_completion(self.now, w.transfer, true);
                    } else {
                        *self.outstanding.entry(w.transfer).or_default() += 1;
                    }
                }
                while let Some(e) = self.sender.poll_event() {
                    any = true;
                    self.sender_events.push(e);
                }
            }
            if self.alive(Side::Receiver) {
                while let Some(f) = self.receiver.poll_transmit() {
                    any = true;
                    self.send_frame(Side::Receiver, f);
                }
                while let Some(t) = self.receiver.poll_fenced() {
                    any = true;
                    self.link.release_held(self.now, t, HoldUntil::Fenced);
                }
                while let Some(o) = self.receiver.poll_outcome() {
                    any = true;
                    self.consume(o);
                }
            }
            if !any {
                return moved;
            }
            moved = true;
        }
    }

    fn deliver(&mut self, dir: Direction, packet: Packet) {
        let now = self.now;
        let to = match dir {
            Direction::ToReceiver => Side::Receiver,
            Direction::ToSender => Side::Sender,
        };
        if !self.alive(to) {
            return;
        }
        match packet {
            Packet::Frame(bytes) => {
                let frame = match Frame::decode(&bytes) {
                    Ok((frame, _)) => frame,
                    Err(e) => {
                        // A frame that does not decode breaks the stream: close the connection.
                        self.frame_errors.push((
                            to,
                            FrameError {
                                scope: Scope::Connection,
                                detail: e.to_string(),
                            },
                        ));
                        self.close_connection();
                        return;
                    }
                };
                let commit_of = match &frame {
                    Frame::Commit(c) => Some(c.transfer),
                    _ => None,
                };
                let result = match to {
                    Side::Receiver => self.receiver.handle_frame(now, frame),
                    Side::Sender => self.sender.handle_frame(now, frame),
                };
                if let Some(id) = commit_of {
                    self.link.release_held(now, id, HoldUntil::CommitDelivered);
                }
                if let Err(e) = result {
                    let fatal = e.scope == Scope::Connection;
                    self.frame_errors.push((to, e));
                    if fatal {
                        self.close_connection();
                    }
                }
            }
            Packet::Write(op) => {
                let leased = self.receiver.is_leased_to(op.transfer, op.dst_page);
                let (pool, scopes) = self.receiver.landing_parts();
                let result = land(
                    &op,
                    self.sender.pool(),
                    pool,
                    scopes,
                    |_, _| leased,
                    &mut self.landings,
                    &mut self.link.stats,
                );
                if !op.acked_early && self.alive(Side::Sender) {
                    self.link.send_ack(now, op.transfer, result.is_ok());
                }
            }
            Packet::WriteAck { transfer, ok } => {
                if let Some(n) = self.outstanding.get_mut(&transfer) {
                    *n -= 1;
                    if *n == 0 {
                        self.outstanding.remove(&transfer);
                    }
                }
                self.sender.handle_write_completion(now, transfer, ok);
            }
            Packet::Closed => match to {
                Side::Receiver => self.receiver.handle_peer_lost(now),
                Side::Sender => {
                    self.flush_outstanding_writes();
                    self.sender.handle_peer_lost(now);
                }
            },
        }
    }

    /// One step: move outputs to the wire, deliver one due packet, or advance time to the
    /// next packet or deadline. Returns false when nothing is left to happen.
    pub fn step(&mut self) -> bool {
        if self.flush() {
            return true;
        }
        if let Some((dir, p)) = self.link.pop_due(self.now) {
            self.deliver(dir, p);
            return true;
        }
        let mut next = self.link.next_due();
        if self.alive(Side::Sender) {
            next = next.into_iter().chain(self.sender.poll_timeout()).min();
        }
        if self.alive(Side::Receiver) {
            next = next.into_iter().chain(self.receiver.poll_timeout()).min();
        }
        let Some(at) = next else { return false };
        self.now = self.now.max(at);
        let now = self.now;
        if self.alive(Side::Sender) {
            self.sender.handle_timeout(now);
        }
        if self.alive(Side::Receiver) {
            self.receiver.handle_timeout(now);
        }
        true
    }

    /// Steps until nothing is left to happen.
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

    /// Steps until `pred` holds or nothing is left to happen; returns whether it held.
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

    /// The engine's side of a verified transfer: check every page holds exactly
    /// [`kv_pattern`], record it, and give the pages back.
    fn consume(&mut self, outcome: ReceiveOutcome) {
        match outcome {
            ReceiveOutcome::Verified(kv) => {
                let id = kv.transfer.transfer_id;
                let pool = self.receiver.pool();
                let mut expected = Vec::new();
                let ok = (0..kv.pages()).all(|ord| {
                    (0..pool.buffers()).all(|b| match kv.page(pool, ord, b) {
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
    pub fn receiver_failure(&self, transfer_id: u64) -> Option<&kvwire_proto::FailureReason> {
        self.receiver_failures
            .iter()
            .find(|(id, _)| *id == transfer_id)
            .map(|(_, r)| r)
    }

    /// The sender's failure reason for a transfer, if it failed.
    pub fn sender_failure(&self, transfer_id: u64) -> Option<&kvwire_proto::FailureReason> {
        self.sender_events.iter().find_map(|e| match e {
            SenderEvent::Failed { transfer, reason } if transfer.transfer_id == transfer_id => {
                Some(reason)
            }
            _ => None,
        })
    }

    /// Whether the sender was told the receiver verified the transfer.
    pub fn sender_verified(&self, transfer_id: u64) -> bool {
        self.sender_events
            .iter()
            .any(|e| matches!(e, SenderEvent::Verified(t) if t.transfer_id == transfer_id))
    }
}
