//! The fault injector: [`FaultySender`] and [`FaultyReceiver`], transports that wrap any other (loopback, TCP, RDMA) and
//! misbehaves on cue, at the seam every driver talks to.
//!
//! A [`FaultPlan`] shared by both ends of a connection holds the [`FaultRule`]s. Each rule
//! fires once per transfer it matches. Faults are of three kinds:
//!
//! * **data faults** on the sender's page writes: lost but reported complete (a lying
//!   completion), written twice, or (applied by the receiving end right after the bytes
//!   landed) corrupted or truncated;
//! * **ordering faults**: every write reported complete at once but sent only after the
//!   COMMIT (a notification that overtakes its data), or held until the receiver has given
//!   the transfer up and fenced it (late writes);
//! * **frame faults**: a frame lost or duplicated; delayed (the receiving end sees it, and
//!   everything that arrives after it on the ordered channel, that much later); or corrupted
//!   (the receiving end closes the connection, as a CRC error does);
//! * **triggers**: a side crashes, or its engine aborts the transfer, just before a protocol
//!   step. The harness that drives both ends acts on them ([`FaultPlan::take_requests`]).
//!
//! Faults that need the receiver to see landings (corruption, truncation) apply only over
//! transports that report [`TransportEvent::Landed`] (loopback, TCP), not over RDMA's
//! one-sided writes.

use kvwire_proto::wire::TransferId;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvwire_proto::sender::PageWrite;
use kvwire_proto::wire::{DigestAlgorithm, Frame, FrameType, TransferRef};

use crate::memory::PagePool;
mod receiver;

use crate::transport::{
    Closed, Fence, ReceiverTransport, ScopeError, SenderTransport, Transport, TransportEvent,
};

/// A side of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The prefill side.
    Sender,
    /// The decode side.
    Receiver,
}

/// A protocol step a trigger can be attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// A frame of this type is about to be sent (by whichever side sends it).
    Frame(FrameType),
    /// The first page write of a transfer is about to be posted.
    FirstWrite,
}

/// A fault to inject.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Write `ordinal` is lost, but reported complete.
    DropWrite {
        /// The page ordinal.
        ordinal: u32,
    },
    /// One byte of write `ordinal` is flipped after landing.
    CorruptByte {
        /// The page ordinal.
        ordinal: u32,
        /// The buffer.
        buffer: usize,
        /// Offset within the page.
        offset: usize,
    },
    /// Write `ordinal` lands only its first `keep` bytes per buffer (the rest is not what
    /// the sender wrote).
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
    /// A short transfer from a buggy sender: it writes only the first `pages` pages (the
    /// rest are reported complete but never sent) and commits counts for those pages alone.
    ShortTransfer {
        /// Pages written and committed.
        pages: u32,
    },
    /// Every write is reported complete when posted but sent only after the COMMIT: a
    /// notification that overtakes its data.
    CommitBeforeData,
    /// Every write is held until the receiver has given the transfer up (and so fenced it),
    /// then sent: late writes.
    LateWrites,
    /// The receiver's fence of the transfer completes this much later than the transport
    /// would complete it (an RDMA invalidation that takes its time): the driver sees
    /// `Fence::Pending`, then `Fenced`.
    SlowFence(Duration),
    /// The frame sent at this step is lost.
    DropFrame(FrameType),
    /// The frame sent at this step arrives twice.
    DuplicateFrame(FrameType),
    /// The frame sent at this step is corrupted on the way: the receiving end finds its CRC
    /// wrong and closes the connection.
    CorruptFrame(FrameType),
    /// The frame sent at this step arrives this much later, and so does everything behind
    /// it on the ordered channel (frames, and over loopback the write completions).
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
    pub transfer_id: Option<TransferId>,
    /// The fault.
    pub fault: Fault,
    /// Transfers it has fired for.
    fired: Vec<TransferId>,
}

impl FaultRule {
    /// A rule for one transfer.
    pub fn on(transfer_id: TransferId, fault: Fault) -> Self {
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

    fn applies(&self, transfer_id: TransferId) -> bool {
        self.transfer_id.is_none_or(|t| t == transfer_id) && !self.fired.contains(&transfer_id)
    }
}

/// What a trigger asks of the harness driving both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// The side crashed: it must do nothing more.
    Crash(Side),
    /// The side's engine aborts the transfer.
    Abort(Side, TransferId),
}

/// Damage to apply to a page once it has landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Damage {
    CorruptByte { buffer: usize, offset: usize },
    Truncated { keep: usize },
}

/// The rules of one connection and what they asked for, shared by both ends' wrappers.
#[derive(Debug, Default)]
pub struct FaultPlan {
    rules: Vec<FaultRule>,
    requests: Vec<Request>,
    /// Damage for the receiving end to apply to (transfer id, ordinal) when it lands.
    damage: Vec<(TransferId, u32, Damage)>,
    /// Frames for the receiving end to treat as corrupted: (to side, type, transfer id).
    corrupt: Vec<(Side, FrameType, TransferId)>,
    /// Frames for the receiving end to delay: (to side, type, transfer id, by).
    delay: Vec<(Side, FrameType, TransferId, Duration)>,
    /// Whether any side has crashed.
    crashed: Option<Side>,
}

impl FaultPlan {
    /// An empty plan, shared.
    pub fn shared() -> Arc<Mutex<Self>> {
        Arc::default()
    }

    /// Adds a rule.
    pub fn add(&mut self, rule: FaultRule) {
        self.rules.push(rule);
    }

    /// What triggers asked for since the last call.
    pub fn take_requests(&mut self) -> Vec<Request> {
        std::mem::take(&mut self.requests)
    }

    /// Fires the first rule matching `pred` for `transfer_id`, returning its fault.
    fn take(&mut self, transfer_id: TransferId, pred: impl Fn(&Fault) -> bool) -> Option<Fault> {
        let rule = self
            .rules
            .iter_mut()
            .find(|r| r.applies(transfer_id) && pred(&r.fault))?;
        rule.fired.push(transfer_id);
        Some(rule.fault.clone())
    }

    /// Whether a rule matching `pred` applies to `transfer_id` (without firing it).
    fn has(&self, transfer_id: TransferId, pred: impl Fn(&Fault) -> bool) -> bool {
        self.rules
            .iter()
            .any(|r| r.applies(transfer_id) && pred(&r.fault))
    }

    /// Fires every crash or abort trigger at `step` of `transfer_id`. Returns whether the
    /// `acting` side itself crashed (then it must not carry the step out).
    fn triggers(&mut self, step: Step, transfer_id: TransferId, acting: Side) -> bool {
        let hit = |f: &Fault| matches!(f, Fault::Crash(_, s) | Fault::Abort(_, s) if *s == step);
        let mut acting_crashed = false;
        while let Some(fault) = self.take(transfer_id, hit) {
            match fault {
                Fault::Crash(side, _) if self.crashed.is_none() => {
                    self.crashed = Some(side);
                    self.requests.push(Request::Crash(side));
                    acting_crashed |= side == acting;
                }
                Fault::Abort(side, _) if self.crashed != Some(side) => {
                    self.requests.push(Request::Abort(side, transfer_id));
                }
                _ => {}
            }
        }
        acting_crashed
    }
}

/// Why held writes wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    /// Until the transfer's COMMIT has been sent.
    CommitSent,
    /// Until the receiver gave the transfer up (a verdict or ABORT arrived for it).
    ReceiverDone,
}

/// A fence held back by [`Fault::SlowFence`].
#[derive(Debug)]
struct SlowFence {
    transfer: TransferRef,
    delay: Duration,
    at: Option<Instant>,
    inner_done: bool,
}

/// What both ends of a faulty connection keep.
#[derive(Debug)]
struct Core<T> {
    inner: T,
    side: Side,
    plan: Arc<Mutex<FaultPlan>>,
    /// The receiving end's pool, to damage landed pages.
    pool: Option<Arc<PagePool>>,
    /// Inbound events held back until this instant (a delayed frame and what follows it).
    stall: Option<(Instant, VecDeque<TransportEvent>)>,
    /// The connection is being closed because a frame arrived corrupted: the inner
    /// transport's own close is reported with this reason.
    corrupted: bool,
    /// Writes held back, per reservation.
    held: Vec<(Hold, TransferRef, Arc<[u8]>, PageWrite)>,
    /// Hold events that already happened, per transfer id: a write posted afterwards has
    /// nothing left to wait for.
    passed: Vec<(Hold, TransferId)>,
    /// Page completions already reported (a lying or early completion), to swallow when the
    /// real one comes.
    early: BTreeMap<TransferRef, u32>,
    /// Events this wrapper makes up.
    events: VecDeque<TransportEvent>,
    /// Slow fences: the transfer, how much later, when (set at the first poll after the
    /// fence), and whether the inner transport's fence completed.
    slow_fences: Vec<SlowFence>,
    /// This side crashed: nothing more leaves it.
    crashed: bool,
}

impl<T> Core<T> {
    fn new(inner: T, side: Side, plan: Arc<Mutex<FaultPlan>>, pool: Option<Arc<PagePool>>) -> Self {
        Self {
            inner,
            side,
            plan,
            pool,
            stall: None,
            corrupted: false,
            held: Vec::new(),
            passed: Vec::new(),
            early: BTreeMap::new(),
            events: VecDeque::new(),
            slow_fences: Vec::new(),
            crashed: false,
        }
    }

    fn plan(&self) -> MutexGuard<'_, FaultPlan> {
        self.plan.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn crash(&mut self) {
        self.crashed = true;
        self.held.clear();
    }
}

/// The prefill end of a connection, misbehaving as its [`FaultPlan`] says; otherwise it is
/// the sender transport `T`.
#[derive(Debug)]
pub struct FaultySender<T>(Core<T>);

/// The decode end of a connection, misbehaving as its [`FaultPlan`] says; otherwise it is
/// the receiver transport `T`.
#[derive(Debug)]
pub struct FaultyReceiver<T>(Core<T>);

impl<T> FaultySender<T> {
    /// Wraps the prefill end of a connection.
    pub fn new(inner: T, plan: Arc<Mutex<FaultPlan>>) -> Self {
        Self(Core::new(inner, Side::Sender, plan, None))
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.0.inner
    }

    /// The wrapped transport, mutably.
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.0.inner
    }

    /// Writes held back for `transfer_id`.
    pub fn held_writes(&self, transfer_id: TransferId) -> usize {
        self.0
            .held
            .iter()
            .filter(|(_, t, _, _)| t.transfer_id == transfer_id)
            .count()
    }

    /// Marks this side crashed: nothing more leaves it.
    pub fn crash(&mut self) {
        self.0.crash();
    }
}

impl<T> Core<T> {
    /// The connection is gone: writes still held back never land. Those not yet reported
    /// (late writes) are reported failed; those reported early are dropped.
    fn fail_held(&mut self) {
        for (hold, transfer, _, _) in std::mem::take(&mut self.held) {
            if hold == Hold::ReceiverDone {
                self.events.push_back(TransportEvent::WritesDone {
                    transfer,
                    pages: 1,
                    ok: false,
                });
            }
        }
    }
}

impl<T: SenderTransport> Core<T> {
    /// Posts the writes of `transfer_id` held for `hold`.
    fn release(&mut self, now: Instant, hold: Hold, transfer_id: TransferId) {
        self.passed.push((hold, transfer_id));
        let (go, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|(h, t, _, _)| *h == hold && t.transfer_id == transfer_id);
        self.held = keep;
        for (_, t, access, w) in go {
            self.inner.post_writes(now, t, &access, &[w]);
        }
    }
}

impl<T: SenderTransport> Transport for FaultySender<T> {
    fn send_frame(&mut self, now: Instant, frame: &Frame) {
        send_frame(&mut self.0, now, frame, |s, now| {
            // A COMMIT releases the writes that wait for it, behind it.
            if let Frame::Commit(c) = frame {
                s.release(now, Hold::CommitSent, c.transfer.transfer_id);
            }
        });
    }

    fn poll_event(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<TransportEvent> {
        loop {
            if let Some(e) = self.0.events.pop_front() {
                // Made up here (a lying or early completion): passed on as it is.
                return Poll::Ready(e);
            }
            if let Some(e) = poll_common(&mut self.0, cx, now) {
                match e {
                    TransportEvent::WritesDone {
                        transfer,
                        pages,
                        ok,
                    } => {
                        let swallow = self.0.early.get(&transfer).copied().unwrap_or(0).min(pages);
                        if swallow > 0 {
                            let left = self.0.early.get_mut(&transfer).map(|n| {
                                *n -= swallow;
                                *n
                            });
                            if left == Some(0) {
                                self.0.early.remove(&transfer);
                            }
                        }
                        if pages > swallow {
                            return Poll::Ready(TransportEvent::WritesDone {
                                transfer,
                                pages: pages - swallow,
                                ok,
                            });
                        }
                    }
                    TransportEvent::Closed(why) => {
                        // Every write outcome comes before the end of the connection.
                        self.0.fail_held();
                        self.0.events.push_back(TransportEvent::Closed(why));
                    }
                    TransportEvent::Frame(f) => {
                        // The receiver gave the transfer up: late writes go now.
                        let done = match &f {
                            Frame::Abort(a) => Some(a.transfer.transfer_id),
                            Frame::Nack(n) => Some(n.transfer.transfer_id),
                            Frame::Verified(t) => Some(t.transfer_id),
                            _ => None,
                        };
                        if let Some(id) = done {
                            self.0.release(now, Hold::ReceiverDone, id);
                        }
                        return Poll::Ready(TransportEvent::Frame(f));
                    }
                    other => return Poll::Ready(other),
                }
            } else {
                return Poll::Pending;
            }
        }
    }

    fn close(&mut self, now: Instant) {
        self.0.fail_held();
        self.0.inner.close(now);
    }

    fn poll_timeout(&self) -> Option<Instant> {
        timeout(&self.0)
    }

    // What the wrapped transport knows of the peer's reading and writing reaches the driver's
    // liveness (SPEC §8.3) as it would without the wrapper.
    fn write_blocked_since(&self) -> Option<Instant> {
        self.0.inner.write_blocked_since()
    }

    fn last_read(&self) -> Option<Instant> {
        self.0.inner.last_read()
    }

    fn failed_lanes(&self) -> usize {
        self.0.inner.failed_lanes()
    }

    fn moves_transfers(&self) -> bool {
        self.0.inner.moves_transfers()
    }

    fn log_state(&self) {
        self.0.inner.log_state()
    }
}

impl<T: SenderTransport> SenderTransport for FaultySender<T> {
    fn write_credit(&self) -> usize {
        self.0.inner.write_credit()
    }

    fn destination_pages(&self) -> Option<u32> {
        self.0.inner.destination_pages()
    }

    fn digests_after_writes(&self) -> bool {
        self.0.inner.digests_after_writes()
    }

    fn post_writes(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        access: &Arc<[u8]>,
        writes: &[PageWrite],
    ) {
        if self.0.crashed {
            return;
        }
        let id = transfer.transfer_id;
        let mut post = Vec::with_capacity(writes.len());
        let shared = self.0.plan.clone();
        for &w in writes {
            let mut plan = shared.lock().unwrap_or_else(|p| p.into_inner());
            if w.ordinal == 0 && plan.triggers(Step::FirstWrite, id, self.0.side) {
                drop(plan);
                self.0.crash();
                return;
            }
            let ord = w.ordinal;
            if let Some(Fault::ShortTransfer { pages }) = plan
                .rules
                .iter()
                .find(|r| r.applies(id) && matches!(r.fault, Fault::ShortTransfer { .. }))
                .map(|r| r.fault.clone())
            {
                if ord >= pages {
                    // Not written; reported complete anyway.
                    self.0.events.push_back(TransportEvent::WritesDone {
                        transfer,
                        pages: 1,
                        ok: true,
                    });
                    continue;
                }
            }
            let fault = plan.take(id, |f| match f {
                Fault::DropWrite { ordinal }
                | Fault::CorruptByte { ordinal, .. }
                | Fault::TruncateWrite { ordinal, .. }
                | Fault::DuplicateWrite { ordinal } => *ordinal == ord,
                _ => false,
            });
            // Ordering faults apply to every write of the transfer: checked, not fired.
            let hold = if plan.has(id, |f| matches!(f, Fault::CommitBeforeData)) {
                Some(Hold::CommitSent)
            } else if plan.has(id, |f| matches!(f, Fault::LateWrites)) {
                Some(Hold::ReceiverDone)
            } else {
                None
            };
            let hold = hold.filter(|h| !self.0.passed.contains(&(*h, id)));
            match fault {
                Some(Fault::DropWrite { .. }) => {
                    // Never sent; reported complete anyway.
                    self.0.events.push_back(TransportEvent::WritesDone {
                        transfer,
                        pages: 1,
                        ok: true,
                    });
                    continue;
                }
                Some(Fault::CorruptByte { buffer, offset, .. }) => {
                    plan.damage
                        .push((id, ord, Damage::CorruptByte { buffer, offset }));
                }
                Some(Fault::TruncateWrite { keep, .. }) => {
                    plan.damage.push((id, ord, Damage::Truncated { keep }));
                }
                Some(Fault::DuplicateWrite { .. }) => {
                    // Lands twice, completes once.
                    *self.0.early.entry(transfer).or_default() += 1;
                    post.push(w);
                }
                _ => {}
            }
            drop(plan);
            match hold {
                Some(Hold::CommitSent) => {
                    // Reported complete now, sent after the COMMIT.
                    *self.0.early.entry(transfer).or_default() += 1;
                    self.0.events.push_back(TransportEvent::WritesDone {
                        transfer,
                        pages: 1,
                        ok: true,
                    });
                    self.0
                        .held
                        .push((Hold::CommitSent, transfer, access.clone(), w));
                }
                Some(Hold::ReceiverDone) => {
                    self.0
                        .held
                        .push((Hold::ReceiverDone, transfer, access.clone(), w));
                }
                None => post.push(w),
            }
        }
        if !post.is_empty() {
            self.0.inner.post_writes(now, transfer, access, &post);
        }
    }
}

/// Sending a frame, for either role: triggers, then frame faults; `after` runs once the
/// frame (or its first copy) went out.
fn send_frame<T: Transport>(
    s: &mut Core<T>,
    now: Instant,
    frame: &Frame,
    after: impl FnOnce(&mut Core<T>, Instant),
) {
    if s.crashed {
        return;
    }
    if let Frame::Commit(c) = frame {
        let short = s.plan().take(c.transfer.transfer_id, |f| {
            matches!(f, Fault::ShortTransfer { .. })
        });
        if let Some(Fault::ShortTransfer { pages }) = short {
            // Counts for what the buggy sender wrote: `pages` pages of the same size.
            let mut c = c.clone();
            let tokens_per_page = c.tokens.div_ceil(c.pages.max(1));
            let bytes_per_page = c.bytes / u64::from(c.pages.max(1));
            c.tokens = tokens_per_page * pages;
            c.bytes = bytes_per_page * u64::from(pages);
            c.pages = pages;
            let f = Frame::Commit(c);
            return send_frame(s, now, &f, after);
        }
    }
    let ty = frame.frame_type();
    let Some(id) = frame.transfer().map(|t| t.transfer_id) else {
        s.inner.send_frame(now, frame);
        return;
    };
    let fault = {
        let mut plan = s.plan();
        if plan.triggers(Step::Frame(ty), id, s.side) {
            drop(plan);
            s.crash();
            return;
        }
        let fault = plan.take(id, |f| {
            matches!(f, Fault::DropFrame(t) | Fault::DuplicateFrame(t) | Fault::CorruptFrame(t) | Fault::DelayFrame(t, _) if *t == ty)
        });
        let to = match s.side {
            Side::Sender => Side::Receiver,
            Side::Receiver => Side::Sender,
        };
        match fault {
            Some(Fault::CorruptFrame(_)) => plan.corrupt.push((to, ty, id)),
            Some(Fault::DelayFrame(_, d)) => plan.delay.push((to, ty, id, d)),
            _ => {}
        }
        fault
    };
    match fault {
        Some(Fault::DropFrame(_)) => return,
        Some(Fault::DuplicateFrame(_)) => {
            s.inner.send_frame(now, frame);
            s.inner.send_frame(now, frame);
        }
        _ => s.inner.send_frame(now, frame),
    }
    after(s, now);
}

/// What both roles do when polled: the inner transport's next event, after the faults of the
/// receiving end: a frame marked corrupted closes the connection (the inner transport's
/// write failures, then its end, reported as a bad CRC); a frame marked delayed holds it and
/// everything after it back.
fn poll_common<T: Transport>(
    s: &mut Core<T>,
    cx: &mut Context<'_>,
    now: Instant,
) -> Option<TransportEvent> {
    if let Some((until, held)) = &mut s.stall {
        if now < *until {
            // Keep taking what arrives, behind the delayed frame.
            while let Poll::Ready(e) = s.inner.poll_event(cx, now) {
                held.push_back(e);
            }
            return None;
        }
        match held.pop_front() {
            Some(e) => return Some(e),
            None => s.stall = None,
        }
    }
    let e = match s.inner.poll_event(cx, now) {
        Poll::Ready(e) => e,
        Poll::Pending => return None,
    };
    match e {
        TransportEvent::Frame(f) => {
            let key = f
                .transfer()
                .map(|t| (s.side, f.frame_type(), t.transfer_id));
            let mut plan = s.plan();
            if let Some(key) = key {
                if let Some(i) = plan.corrupt.iter().position(|c| *c == key) {
                    plan.corrupt.swap_remove(i);
                    drop(plan);
                    // What a CRC error does: the stream cannot be trusted; close it.
                    s.corrupted = true;
                    s.inner.close(now);
                    return poll_common(s, cx, now);
                }
                let (side, ty, id) = key;
                if let Some(i) = plan
                    .delay
                    .iter()
                    .position(|&(sd, t, x, _)| (sd, t, x) == (side, ty, id))
                {
                    let (_, _, _, d) = plan.delay.swap_remove(i);
                    drop(plan);
                    s.stall = Some((now + d, VecDeque::from([TransportEvent::Frame(f)])));
                    return poll_common(s, cx, now);
                }
            }
            Some(TransportEvent::Frame(f))
        }
        TransportEvent::Closed(Closed::Local) if s.corrupted => {
            Some(TransportEvent::Closed(Closed::Malformed("bad CRC".into())))
        }
        other => Some(other),
    }
}

fn timeout<T: Transport>(s: &Core<T>) -> Option<Instant> {
    let stall = s.stall.as_ref().map(|(until, _)| *until);
    let fences = s.slow_fences.iter().filter_map(|f| f.at);
    stall
        .into_iter()
        .chain(fences)
        .chain(s.inner.poll_timeout())
        .min()
}
