//! The in-process loopback transport: a simulated wire between two page pools, with fault
//! injection.
//!
//! Control frames travel as encoded bytes (so the codec and its CRC are exercised); page
//! writes travel as [`WriteOp`]s whose bytes are copied from the sender's pool into the
//! receiver's pool when they land. Delivery is FIFO per direction (the RC ordering the
//! protocol relies on) unless a fault says otherwise. [`land`] is the receiving NIC: it
//! checks the access scope, copies, and records in a [`LandingRecord`] any write that lands
//! in a page not currently leased to that write's transfer — the defect every fence exists
//! to prevent.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvwire_proto::wire::{FrameType, TransferRef};

use super::{AccessError, AccessKey, ScopeTable};
use crate::memory::PagePool;

/// Damage a fault did to a write in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Damage {
    /// Intact.
    None,
    /// Lost on the wire, although its completion will report success (a lying completion:
    /// "transfer complete" without the data).
    Lost,
    /// One byte of one buffer is flipped after landing.
    CorruptByte {
        /// The buffer.
        buffer: usize,
        /// The offset within the page.
        offset: usize,
    },
    /// Only the first `keep` bytes of each buffer's page land.
    Truncated {
        /// Bytes kept per buffer.
        keep: usize,
    },
}

/// One page write (all buffers of one page index) in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteOp {
    /// The reservation it serves.
    pub transfer: TransferRef,
    /// The access key from RESERVE.
    pub key: AccessKey,
    /// Its ordinal in the transfer.
    pub ordinal: u32,
    /// Source page in the sender's pool.
    pub src_page: u32,
    /// Destination page in the receiver's pool.
    pub dst_page: u32,
    /// Fault damage.
    pub damage: Damage,
    /// Whether the sender was already told it completed (so no completion follows landing).
    pub acked_early: bool,
}

/// Something on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Packet {
    /// An encoded control frame.
    Frame(Vec<u8>),
    /// A page write, sender to receiver.
    Write(WriteOp),
    /// A write's completion, receiver to sender (RC acknowledgement).
    WriteAck {
        /// The reservation.
        transfer: TransferRef,
        /// Whether the write was accepted at the receiver.
        ok: bool,
    },
    /// The connection closed (the peer crashed or tore it down); arrives after every packet
    /// sent before it.
    Closed,
}

/// Which way a packet travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Sender (prefill) to receiver (decode).
    ToReceiver,
    /// Receiver to sender.
    ToSender,
}

/// What the harness must do when a trigger fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The prefill side.
    Sender,
    /// The decode side.
    Receiver,
}

/// A protocol step a fault can be attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// A frame of this type is about to be sent.
    Frame(FrameType),
    /// The first page write of a transfer is about to be posted.
    FirstWrite,
}

/// A fault to inject. Each rule fires once per transfer it matches.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Write `ordinal` is lost, but reported complete.
    DropWrite {
        /// The page ordinal.
        ordinal: u32,
    },
    /// One byte of write `ordinal` is corrupted after landing.
    CorruptByte {
        /// The page ordinal.
        ordinal: u32,
        /// The buffer.
        buffer: usize,
        /// Offset within the page.
        offset: usize,
    },
    /// Write `ordinal` lands only its first `keep` bytes per buffer.
    TruncateWrite {
        /// The page ordinal.
        ordinal: u32,
        /// Bytes kept.
        keep: usize,
    },
    /// Write `ordinal` lands twice.
    DuplicateWrite {
        /// The page ordinal.
        ordinal: u32,
    },
    /// Every write is reported complete when posted but lands only after the COMMIT has been
    /// delivered: a notification that overtakes its data.
    CommitBeforeData,
    /// Every write is held on the wire until after the receiver has fenced the transfer,
    /// then delivered (a late write).
    LateWrites,
    /// The frame sent at this step is lost.
    DropFrame(FrameType),
    /// The frame sent at this step arrives twice.
    DuplicateFrame(FrameType),
    /// One bit of the frame sent at this step is flipped (the receiver sees a CRC error).
    CorruptFrame(FrameType),
    /// The frame sent at this step arrives this much later than it would have.
    DelayFrame(FrameType, Duration),
    /// A side crashes just before this step (what it was about to send is never sent).
    Crash(Side, Step),
    /// A side's engine aborts the transfer just before this step.
    Abort(Side, Step),
}

/// A fault restricted to one transfer (or all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRule {
    /// The transfer it applies to; `None` for all.
    pub transfer_id: Option<u64>,
    /// The fault.
    pub fault: Fault,
    /// Transfers it has fired for.
    fired: Vec<u64>,
}

impl FaultRule {
    /// A rule for one transfer.
    pub fn on(transfer_id: u64, fault: Fault) -> Self {
        Self {
            transfer_id: Some(transfer_id),
            fault,
            fired: Vec::new(),
        }
    }

    /// A rule for every transfer.
    pub fn all(fault: Fault) -> Self {
        Self {
            transfer_id: None,
            fault,
            fired: Vec::new(),
        }
    }

    fn applies(&self, transfer_id: u64) -> bool {
        self.transfer_id.is_none_or(|t| t == transfer_id) && !self.fired.contains(&transfer_id)
    }
}

/// Why a held write is waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldUntil {
    /// Until the COMMIT of the transfer has been delivered.
    CommitDelivered,
    /// Until the receiver has fenced the transfer.
    Fenced,
}

#[derive(Clone, Debug)]
struct InFlight {
    at: Instant,
    packet: Packet,
}

/// Counters of what crossed the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Frames sent.
    pub frames: u64,
    /// Page writes posted.
    pub writes_posted: u64,
    /// Page writes that landed (all or part of their bytes).
    pub writes_landed: u64,
    /// Page writes refused at the receiver (no scope or out of scope).
    pub writes_refused: u64,
    /// Bytes landed in the receiver's memory.
    pub bytes_landed: u64,
}

/// What happened to writes at the receiving end, for the safety invariants.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LandingRecord {
    /// Writes that landed in a page not leased to their transfer (must stay empty).
    pub illegal: Vec<(TransferRef, u32)>,
}

/// The simulated wire between two endpoints.
#[derive(Debug)]
pub struct Link {
    latency: Duration,
    to_receiver: VecDeque<InFlight>,
    to_sender: VecDeque<InFlight>,
    held: Vec<(HoldUntil, WriteOp)>,
    /// Transfers whose hold events already happened: a write posted afterwards is not held.
    passed: Vec<(HoldUntil, TransferRef)>,
    /// Fault rules.
    pub rules: Vec<FaultRule>,
    /// Counters.
    pub stats: LinkStats,
}

impl Link {
    /// A link with one-way latency `latency` and no faults.
    pub fn new(latency: Duration) -> Self {
        Self {
            latency,
            to_receiver: VecDeque::new(),
            to_sender: VecDeque::new(),
            held: Vec::new(),
            passed: Vec::new(),
            rules: Vec::new(),
            stats: LinkStats::default(),
        }
    }

    fn queue(&mut self, dir: Direction) -> &mut VecDeque<InFlight> {
        match dir {
            Direction::ToReceiver => &mut self.to_receiver,
            Direction::ToSender => &mut self.to_sender,
        }
    }

    /// Fires the first rule matching `pred` for `transfer_id`, returning its fault.
    pub fn take_fault(&mut self, transfer_id: u64, pred: impl Fn(&Fault) -> bool) -> Option<Fault> {
        let rule = self
            .rules
            .iter_mut()
            .find(|r| r.applies(transfer_id) && pred(&r.fault))?;
        rule.fired.push(transfer_id);
        Some(rule.fault.clone())
    }

    /// Whether a rule matching `pred` would fire for `transfer_id` (without firing it).
    pub fn has_fault(&self, transfer_id: u64, pred: impl Fn(&Fault) -> bool) -> bool {
        self.rules
            .iter()
            .any(|r| r.applies(transfer_id) && pred(&r.fault))
    }

    fn push(&mut self, dir: Direction, now: Instant, extra: Duration, packet: Packet) {
        let at = now + self.latency + extra;
        let q = self.queue(dir);
        // FIFO: a packet never overtakes one sent before it unless it was delayed on purpose.
        let at = q.back().map_or(
            at,
            |last| if extra.is_zero() { at.max(last.at) } else { at },
        );
        let pos = q.iter().position(|p| p.at > at).unwrap_or(q.len());
        q.insert(pos, InFlight { at, packet });
    }

    /// Sends an encoded frame of type `ty` for `transfer_id`, applying frame faults.
    pub fn send_frame(
        &mut self,
        dir: Direction,
        now: Instant,
        ty: FrameType,
        transfer_id: Option<u64>,
        mut bytes: Vec<u8>,
    ) {
        self.stats.frames += 1;
        let fault = transfer_id.and_then(|id| {
            self.take_fault(id, |f| {
                matches!(f, Fault::DropFrame(t) | Fault::DuplicateFrame(t) | Fault::CorruptFrame(t) | Fault::DelayFrame(t, _) if *t == ty)
            })
        });
        match fault {
            Some(Fault::DropFrame(_)) => {}
            Some(Fault::DuplicateFrame(_)) => {
                self.push(dir, now, Duration::ZERO, Packet::Frame(bytes.clone()));
                self.push(dir, now, Duration::ZERO, Packet::Frame(bytes));
            }
            Some(Fault::CorruptFrame(_)) => {
                let i = bytes.len() / 2;
                bytes[i] ^= 0x10;
                self.push(dir, now, Duration::ZERO, Packet::Frame(bytes));
            }
            Some(Fault::DelayFrame(_, d)) => self.push(dir, now, d, Packet::Frame(bytes)),
            _ => self.push(dir, now, Duration::ZERO, Packet::Frame(bytes)),
        }
    }

    /// Posts a page write, applying data faults. Returns whether the sender must be told at
    /// once that it completed (a completion that does not wait for the data).
    pub fn post_write(&mut self, now: Instant, mut op: WriteOp) -> bool {
        self.stats.writes_posted += 1;
        let id = op.transfer.transfer_id;
        let ord = op.ordinal;
        let fault = self.take_fault(id, |f| match f {
            Fault::DropWrite { ordinal }
            | Fault::CorruptByte { ordinal, .. }
            | Fault::TruncateWrite { ordinal, .. }
            | Fault::DuplicateWrite { ordinal } => *ordinal == ord,
            _ => false,
        });
        let mut copies = 1;
        match fault {
            Some(Fault::DropWrite { .. }) => op.damage = Damage::Lost,
            Some(Fault::CorruptByte { buffer, offset, .. }) => {
                op.damage = Damage::CorruptByte { buffer, offset }
            }
            Some(Fault::TruncateWrite { keep, .. }) => op.damage = Damage::Truncated { keep },
            Some(Fault::DuplicateWrite { .. }) => copies = 2,
            _ => {}
        }
        // Holding faults apply to every write of the transfer, so they are checked, not fired.
        let hold = if self.has_fault(id, |f| matches!(f, Fault::CommitBeforeData)) {
            Some(HoldUntil::CommitDelivered)
        } else if self.has_fault(id, |f| matches!(f, Fault::LateWrites)) {
            Some(HoldUntil::Fenced)
        } else {
            None
        };
        // A write posted after its hold event has nothing left to wait for.
        let hold = hold.filter(|until| !self.passed.contains(&(*until, op.transfer)));
        if op.damage == Damage::Lost {
            // Never arrives; its completion reports success anyway.
            return true;
        }
        match hold {
            Some(until) => {
                op.acked_early = until == HoldUntil::CommitDelivered;
                for _ in 0..copies {
                    self.held.push((until, op));
                }
                op.acked_early
            }
            None => {
                for _ in 0..copies {
                    self.push(
                        Direction::ToReceiver,
                        now,
                        Duration::ZERO,
                        Packet::Write(op),
                    );
                    // A duplicate lands twice but completes once.
                    op.acked_early = true;
                }
                false
            }
        }
    }

    /// Sends a write completion back to the sender.
    pub fn send_ack(&mut self, now: Instant, transfer: TransferRef, ok: bool) {
        self.push(
            Direction::ToSender,
            now,
            Duration::ZERO,
            Packet::WriteAck { transfer, ok },
        );
    }

    /// Releases held writes of `transfer` waiting for `event`; they land after `now`. Writes
    /// of that reservation posted later are not held.
    pub fn release_held(&mut self, now: Instant, transfer: TransferRef, event: HoldUntil) {
        self.passed.push((event, transfer));
        let transfer_id = transfer.transfer_id;
        let (go, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|(until, op)| *until == event && op.transfer.transfer_id == transfer_id);
        self.held = keep;
        for (_, op) in go {
            self.push(
                Direction::ToReceiver,
                now,
                Duration::ZERO,
                Packet::Write(op),
            );
        }
    }

    /// Writes still held for `transfer_id`.
    pub fn held_writes(&self, transfer_id: u64) -> usize {
        self.held
            .iter()
            .filter(|(_, op)| op.transfer.transfer_id == transfer_id)
            .count()
    }

    /// The next packet due at or before `now` in either direction (receiver-bound first).
    pub fn pop_due(&mut self, now: Instant) -> Option<(Direction, Packet)> {
        for dir in [Direction::ToReceiver, Direction::ToSender] {
            let q = self.queue(dir);
            if q.front().is_some_and(|p| p.at <= now) {
                return q.pop_front().map(|p| (dir, p.packet));
            }
        }
        None
    }

    /// When the next packet is due.
    pub fn next_due(&self) -> Option<Instant> {
        let a = self.to_receiver.front().map(|p| p.at);
        let b = self.to_sender.front().map(|p| p.at);
        a.into_iter().chain(b).min()
    }

    /// Sends the connection-closed marker one way, behind everything already in flight.
    pub fn send_closed(&mut self, dir: Direction, now: Instant) {
        self.push(dir, now, Duration::ZERO, Packet::Closed);
    }

    /// Drops every packet in flight one way (the connection is torn down).
    pub fn drop_direction(&mut self, dir: Direction) {
        self.queue(dir).clear();
    }

    /// Whether nothing is in flight or held.
    pub fn is_idle(&self) -> bool {
        self.to_receiver.is_empty() && self.to_sender.is_empty() && self.held.is_empty()
    }

    /// Drops every held write (a crashed sender's writes that never left its NIC).
    pub fn drop_held(&mut self) {
        self.held.clear();
    }
}

/// Lands one write in the receiver's memory: the receiving NIC.
///
/// Checks the access scope (a fenced or foreign key is refused, nothing is written), copies
/// the page of every buffer from `src` to `dst` (as damaged by faults), and records in
/// `record` any write that lands in a page that `leased_to(transfer, page)` says is not
/// currently leased to that transfer. Returns the transfer the write was accepted for.
pub fn land(
    op: &WriteOp,
    src: &PagePool,
    dst: &PagePool,
    scopes: &ScopeTable,
    leased_to: impl Fn(TransferRef, u32) -> bool,
    record: &mut LandingRecord,
    stats: &mut LinkStats,
) -> Result<TransferRef, AccessError> {
    let transfer = match scopes.check(op.key, op.dst_page) {
        Ok(t) => t,
        Err(e) => {
            stats.writes_refused += 1;
            return Err(e);
        }
    };
    if !leased_to(op.transfer, op.dst_page) {
        record.illegal.push((op.transfer, op.dst_page));
    }
    stats.writes_landed += 1;
    for b in 0..dst.buffers() {
        let (Some(from), Some(mut to)) = (
            src.raw_page(op.src_page, b),
            dst.raw_page_mut(op.dst_page, b),
        ) else {
            continue;
        };
        let n = match op.damage {
            Damage::Truncated { keep } => keep.min(from.len()).min(to.len()),
            _ => from.len().min(to.len()),
        };
        to[..n].copy_from_slice(&from[..n]);
        stats.bytes_landed += n as u64;
        if let Damage::CorruptByte { buffer, offset } = op.damage {
            if buffer == b && offset < to.len() {
                to[offset] ^= 0x01;
            }
        }
    }
    Ok(transfer)
}
