//! Two real sessions, a receiver and a sender, joined by a channel that may drop and
//! duplicate frames, with models of both drivers. Every nondeterministic step is an
//! [`Action`]; [`World::actions`] lists those enabled and [`World::apply`] takes one,
//! checking every safety invariant on the way (see [`crate::driver`]). A world with no
//! enabled action is quiescent: [`World::check_quiescent`] then checks that every transfer
//! reached a terminal state and every page came back.

use kvwire_proto::wire::TransferId;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvwire_proto::admission::{AdmissionPolicy, Request};
use kvwire_proto::receiver::{
    ReceiverAction, ReceiverConfig, ReceiverEvent, ReceiverSession, ReservationRequest,
    ReserveError,
};
use kvwire_proto::sender::{SenderConfig, SenderEvent, SenderSession, SubmitError, WriteOutcome};
use kvwire_proto::wire::{ErrorCode, Frame, Role, TransferRef};
use kvwire_proto::Scope;

use crate::digest;
use crate::driver::{self, RxDriver, RxOutcome, TxDriver, TxOutcome};
use crate::{ensure, established, Violation, TOKENS_PER_PAGE};

/// The nonce seed of the model's receiver sessions: fixed, so runs are deterministic (a real
/// driver draws a fresh one per connection, SPEC §5.2.1).
pub const MODEL_NONCE_SEED: u64 = 0x6b76_7769_7265_0001;

/// The bounds of one model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Bounds {
    /// Pages in the receiver's pool.
    pub pool_pages: usize,
    /// Token count of each transfer (ids 1, 2, ...).
    pub transfers: Vec<u32>,
    /// Frames the channel may drop.
    pub drops: u8,
    /// Frames the channel may duplicate.
    pub duplicates: u8,
    /// Writes the transport may lose silently (reported complete, never landing).
    pub lost_writes: u8,
    /// Local aborts (either side, any transfer).
    pub aborts: u8,
    /// Connection losses.
    pub peer_losses: u8,
    /// Reservations the receiver may make again for a transfer whose reservation ended.
    pub rereservations: u8,
    /// Timer expiries while something else could still make progress (a frame, write,
    /// fence or digest job in flight, an engine step left): the "slow peer" races. When
    /// nothing else can progress, time always may advance.
    pub early_timeouts: u8,
    /// Lane failures (SPEC §9.2): the lane of a reservation fails, losing its frames and
    /// writes; each end sees it later, in either order, and the transfer moves. Non-zero
    /// turns moves on in both sessions (an RDMA connection of several lanes).
    pub lane_failures: u8,
}

impl Bounds {
    /// Whether lane failures are the only fault these bounds allow.
    pub fn only_lane_faults(&self) -> bool {
        let others = [
            self.drops,
            self.duplicates,
            self.lost_writes,
            self.aborts,
            self.peer_losses,
            self.rereservations,
            self.early_timeouts,
        ];
        self.lane_failures > 0 && others.iter().all(|&n| n == 0)
    }

    /// The default bounds: 2 transfers (2 pages and 1 page) over a 3-page pool, one of each
    /// fault.
    pub fn small() -> Self {
        Self {
            pool_pages: 3,
            transfers: vec![2 * TOKENS_PER_PAGE, TOKENS_PER_PAGE],
            drops: 1,
            duplicates: 1,
            lost_writes: 1,
            aborts: 1,
            peer_losses: 1,
            rereservations: 1,
            early_timeouts: 1,
            lane_failures: 0,
        }
    }
}

/// Which way a frame travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dir {
    /// Sender to receiver.
    ToReceiver,
    /// Receiver to sender.
    ToSender,
}

/// One nondeterministic step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Deliver the oldest frame in flight in this direction.
    Deliver(Dir),
    /// Drop the oldest frame in flight in this direction.
    Drop(Dir),
    /// Duplicate the oldest frame in flight in this direction.
    Duplicate(Dir),
    /// The `i`-th posted write reaches the receiver (lands if its scope is open).
    Write(usize),
    /// The `i`-th posted write is lost, though reported complete.
    LoseWrite(usize),
    /// The receiver's driver completes its `i`-th pending fence.
    Fence(usize),
    /// The receiver's driver finishes its `i`-th digest job.
    ReceiverDigests(usize),
    /// The sender's driver finishes its `i`-th digest job.
    SenderDigests(usize),
    /// Time advances to the earliest deadline of either session.
    Timeout,
    /// The receiver's engine reserves pages for transfer `i` (index into the bounds).
    Reserve(usize),
    /// The sender's engine submits transfer `i`.
    Submit(usize),
    /// The sender's engine aborts transfer `i`.
    AbortSender(usize),
    /// The receiver's engine aborts transfer `i`.
    AbortReceiver(usize),
    /// The connection is lost.
    PeerLost,
    /// The lane of the receiver's open reservation of transfer `i` fails: frames and writes
    /// of that reservation in flight, and those sent on it until each end sees the failure,
    /// are lost (SPEC §9.2).
    LaneFails(usize),
    /// The sender sees the failed lane of this reservation (its transport: the transfer
    /// lost, then its writes there failed).
    SenderSeesLane(TransferRef),
    /// The receiver sees the failed lane of this reservation.
    ReceiverSeesLane(TransferRef),
}

/// Fault budgets left.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Budget {
    drops: u8,
    duplicates: u8,
    lost_writes: u8,
    aborts: u8,
    peer_losses: u8,
    rereservations: u8,
    early_timeouts: u8,
    lane_failures: u8,
}

/// Both sessions, the channel, both drivers.
#[derive(Clone, Debug)]
pub struct World {
    now: Instant,
    transfers: Vec<u32>,
    sender: SenderSession,
    receiver: ReceiverSession,
    to_receiver: VecDeque<Frame>,
    to_sender: VecDeque<Frame>,
    rx: RxDriver,
    tx: TxDriver,
    budget: Budget,
    reservations: Vec<u8>,
    submitted: Vec<bool>,
    lost: bool,
    /// Reservations whose lane failed: nothing of theirs arrives any more.
    dead: std::collections::BTreeSet<TransferRef>,
    /// Dead reservations the sender, and the receiver, have not seen fail yet.
    sender_unaware: std::collections::BTreeSet<TransferRef>,
    receiver_unaware: std::collections::BTreeSet<TransferRef>,
    /// Only lane failures may happen (no other fault budget): then every transfer must end
    /// verified at both ends (a move loses no request, SPEC §9.2).
    only_lane_faults: bool,
    /// The actions that led here.
    pub trace: Vec<Action>,
}

fn transfer_id(i: usize) -> TransferId {
    TransferId(i as u64 + 1)
}

fn pages_for(tokens: u32) -> u32 {
    tokens.div_ceil(TOKENS_PER_PAGE)
}

impl World {
    /// The initial world for `bounds`.
    pub fn new(bounds: &Bounds) -> Self {
        let base = Instant::now();
        let sender_config = SenderConfig {
            reservation_timeout: Duration::from_millis(1000),
            parked_reservation_timeout: Duration::from_millis(300),
            verdict_timeout: Duration::from_millis(200),
            abort_ack_timeout: Duration::from_millis(50),
            history: 16,
            // One parked reservation at most: a second is refused with PARKED_LIMIT (Q10).
            // With lane failures, room for every transfer's: a moved reservation arriving
            // while another is parked is then served, so that a transfer lost with only lane
            // faults is the move's failure, not the parking bound's.
            max_parked: if bounds.lane_failures > 0 {
                bounds.transfers.len()
            } else {
                1
            },
        };
        let receiver_config = ReceiverConfig {
            abort_ack_timeout: Duration::from_millis(50),
            history: 16,
        };
        let buffers = crate::layout().buffers();
        let mut sender = SenderSession::new(&established(Role::SENDER), sender_config);
        let mut receiver = ReceiverSession::new(
            &established(Role::RECEIVER),
            receiver_config,
            MODEL_NONCE_SEED,
        );
        if bounds.lane_failures > 0 {
            sender.allow_moves();
            receiver.allow_moves();
        }
        Self {
            now: base,
            transfers: bounds.transfers.clone(),
            sender,
            receiver,
            to_receiver: VecDeque::new(),
            to_sender: VecDeque::new(),
            rx: RxDriver::new(bounds.pool_pages, buffers),
            tx: TxDriver::default(),
            budget: Budget {
                drops: bounds.drops,
                duplicates: bounds.duplicates,
                lost_writes: bounds.lost_writes,
                aborts: bounds.aborts,
                peer_losses: bounds.peer_losses,
                rereservations: bounds.rereservations,
                early_timeouts: bounds.early_timeouts,
                lane_failures: bounds.lane_failures,
            },
            reservations: vec![0; bounds.transfers.len()],
            submitted: vec![false; bounds.transfers.len()],
            lost: false,
            dead: Default::default(),
            sender_unaware: Default::default(),
            receiver_unaware: Default::default(),
            only_lane_faults: bounds.only_lane_faults(),
            trace: Vec::new(),
        }
    }

    fn queue(&mut self, dir: Dir) -> &mut VecDeque<Frame> {
        match dir {
            Dir::ToReceiver => &mut self.to_receiver,
            Dir::ToSender => &mut self.to_sender,
        }
    }

    /// The receiver's open reservation of transfer `i`, if any.
    fn rx_open(&self, i: usize) -> Option<TransferRef> {
        let id = transfer_id(i);
        self.rx
            .reserved
            .keys()
            .find(|t| t.transfer_id == id && !self.rx.outcomes.contains_key(t))
            .copied()
    }

    /// Whether the sender's transfer `i` was submitted and has not ended.
    fn tx_open(&self, i: usize) -> bool {
        let id = transfer_id(i);
        let n = self.tx.submissions.get(&id).copied().unwrap_or(0);
        let ended = self.tx.outcomes.get(&id).map_or(0, |o| o.0);
        n > ended
    }

    /// Whether `t` is the receiver's open reservation of its transfer.
    fn rx_open_ref(&self, t: TransferRef) -> bool {
        self.rx.reserved.contains_key(&t) && !self.rx.outcomes.contains_key(&t)
    }

    /// Reports every posted write of dead reservation `t` failed (its queue pair flushed).
    fn fail_dead_writes(&mut self, now: Instant, t: TransferRef) {
        while let Some(k) = self.tx.writes.iter().position(|w| w.transfer == t) {
            let w = self.tx.take_write(k);
            self.sender
                .handle_write_outcome(now, w.transfer, WriteOutcome::Failed, 1);
        }
    }

    fn next_deadline(&mut self) -> Option<Instant> {
        match (self.sender.poll_timeout(), self.receiver.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether a step other than a fault or a timer expiry is possible.
    fn progress_possible(&mut self) -> bool {
        self.actions().iter().any(|a| {
            matches!(
                a,
                Action::Deliver(_)
                    | Action::Write(_)
                    | Action::Fence(_)
                    | Action::ReceiverDigests(_)
                    | Action::SenderDigests(_)
                    | Action::Reserve(_)
                    | Action::Submit(_)
                    | Action::SenderSeesLane(_)
                    | Action::ReceiverSeesLane(_)
            )
        })
    }

    /// Every action enabled in this state.
    pub fn actions(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        for dir in [Dir::ToReceiver, Dir::ToSender] {
            if !self.queue(dir).is_empty() {
                out.push(Action::Deliver(dir));
                if self.budget.drops > 0 {
                    out.push(Action::Drop(dir));
                }
                if self.budget.duplicates > 0 {
                    out.push(Action::Duplicate(dir));
                }
            }
        }
        for i in 0..self.tx.writes.len() {
            if self.dead.contains(&self.tx.writes[i].transfer) {
                // On the failed lane: reported failed once the sender sees it.
                continue;
            }
            out.push(Action::Write(i));
            if self.budget.lost_writes > 0 {
                out.push(Action::LoseWrite(i));
            }
        }
        if !self.lost {
            out.extend(
                self.sender_unaware
                    .iter()
                    .copied()
                    .map(Action::SenderSeesLane),
            );
            out.extend(
                self.receiver_unaware
                    .iter()
                    .copied()
                    .map(Action::ReceiverSeesLane),
            );
        }
        out.extend((0..self.rx.fences.len()).map(Action::Fence));
        out.extend((0..self.rx.digest_jobs.len()).map(Action::ReceiverDigests));
        out.extend((0..self.tx.digest_jobs.len()).map(Action::SenderDigests));
        // Everything above, and the engine steps below, make progress without time passing.
        let mut progress = !out.is_empty();
        if !self.lost {
            for i in 0..self.transfers.len() {
                let again = self.reservations[i] > 0;
                if self.rx_open(i).is_none()
                    && (!again || self.budget.rereservations > 0)
                    && self
                        .rx
                        .free_pages(pages_for(self.transfers[i]) as usize)
                        .is_some()
                {
                    out.push(Action::Reserve(i));
                }
                if !self.submitted[i] {
                    out.push(Action::Submit(i));
                }
            }
            progress = progress
                || out
                    .iter()
                    .any(|a| matches!(a, Action::Reserve(_) | Action::Submit(_)));
            if self.budget.peer_losses > 0 {
                out.push(Action::PeerLost);
            }
            if self.budget.lane_failures > 0 {
                for i in 0..self.transfers.len() {
                    if self.rx_open(i).is_some_and(|t| !self.dead.contains(&t)) {
                        out.push(Action::LaneFails(i));
                    }
                }
            }
        }
        if (!progress || self.budget.early_timeouts > 0) && self.next_deadline().is_some() {
            out.push(Action::Timeout);
        }
        if self.budget.aborts > 0 {
            for i in 0..self.transfers.len() {
                if self.tx_open(i) {
                    out.push(Action::AbortSender(i));
                }
                if self.rx_open(i).is_some() {
                    out.push(Action::AbortReceiver(i));
                }
            }
        }
        out
    }

    /// Takes one action, then runs both sessions' outputs through the drivers.
    pub fn apply(&mut self, action: Action) -> Result<(), Violation> {
        self.trace.push(action);
        let now = self.now;
        match action {
            Action::Deliver(dir) => {
                let Some(frame) = self.queue(dir).pop_front() else {
                    return Ok(());
                };
                let result = match dir {
                    Dir::ToReceiver => {
                        let commit = match &frame {
                            Frame::Commit(c) => Some(c.clone()),
                            _ => None,
                        };
                        let r = self.receiver.handle_frame(now, frame.clone());
                        self.pump_receiver(commit)?;
                        r
                    }
                    Dir::ToSender => self.sender.handle_frame(now, frame.clone()),
                };
                if let Err(e) = result {
                    ensure!(
                        e.scope != Scope::Connection,
                        "two honest sessions tripped a connection-scope error on {frame:?}: {e}"
                    );
                }
            }
            Action::Drop(dir) => {
                self.budget.drops -= 1;
                self.queue(dir).pop_front();
            }
            Action::Duplicate(dir) => {
                self.budget.duplicates -= 1;
                let q = self.queue(dir);
                if let Some(f) = q.front().cloned() {
                    q.push_front(f);
                }
            }
            Action::Write(i) | Action::LoseWrite(i) => {
                let w = self.tx.take_write(i);
                let landed = if matches!(action, Action::LoseWrite(_)) {
                    self.budget.lost_writes -= 1;
                    true
                } else {
                    let content = Some((w.transfer.transfer_id, w.write.ordinal));
                    self.rx
                        .land(w.transfer, w.write.ordinal, w.write.dst_page, content)?
                };
                self.sender
                    .handle_write_outcome(now, w.transfer, driver::outcome(landed), 1);
            }
            Action::Fence(i) => {
                let t = self.rx.complete_fence(i);
                self.receiver.handle_fenced(now, t);
            }
            Action::ReceiverDigests(i) => {
                let (t, d) = self.rx.complete_digests(i);
                self.receiver.handle_digests(now, t, d);
            }
            Action::SenderDigests(i) => match self.tx.complete_digests(i, self.rx.buffers) {
                (t, Some(d)) => self.sender.handle_digests(now, t, d),
                (t, None) => self.sender.handle_chunk_digested(now, t),
            },
            Action::Timeout => {
                if self.progress_possible() {
                    self.budget.early_timeouts -= 1;
                }
                if let Some(at) = self.next_deadline() {
                    self.now = self.now.max(at);
                    self.sender.handle_timeout(self.now);
                    self.receiver.handle_timeout(self.now);
                }
            }
            Action::Reserve(i) => {
                let tokens = self.transfers[i];
                let pages = self
                    .rx
                    .free_pages(pages_for(tokens) as usize)
                    .ok_or_else(|| Violation("Reserve enabled without free pages".into()))?;
                let req = ReservationRequest {
                    transfer_id: transfer_id(i),
                    tokens,
                    pages: pages.clone(),
                    digest: None,
                    page_digests: i % 2 == 1,
                    timeout: Duration::from_millis(100),
                    access: vec![],
                };
                match self.receiver.reserve(now, req) {
                    Ok(t) => {
                        if self.reservations[i] > 0 {
                            self.budget.rereservations -= 1;
                        }
                        self.reservations[i] += 1;
                        self.rx.lease(t, &pages)?;
                    }
                    // Still waiting for the ABORT_ACK of its last reservation (its outcome
                    // is reported, its pages are back): the engine retries later. The state
                    // is unchanged, so the explorer sees a state it already has.
                    Err(ReserveError::DuplicateTransfer(_)) => {}
                    Err(e) => return Err(Violation(format!("reserve refused: {e}"))),
                }
            }
            Action::Submit(i) => {
                self.submitted[i] = true;
                let policy = AdmissionPolicy {
                    tokens_per_page: TOKENS_PER_PAGE,
                    pool_pages: 64,
                    max_context_tokens: 4096,
                };
                let id = transfer_id(i);
                let admitted = policy
                    .admit(Request {
                        transfer_id: id,
                        tokens: u64::from(self.transfers[i]),
                    })
                    .map_err(|r| Violation(format!("admission refused: {r:?}")))?;
                let pages = admitted.pages();
                let source = (0..pages).map(|p| p + 10 * i as u32).collect();
                match self.sender.submit(now, admitted, source) {
                    Ok(()) => self.tx.submit(id, pages),
                    // The receiver aborted the reservation while it was parked (Q9): the
                    // engine learns it at once and nothing is written.
                    Err(SubmitError::AbortedByPeer { .. }) => {}
                    Err(e) => return Err(Violation(format!("submit refused: {e:?}"))),
                }
            }
            Action::AbortSender(i) => {
                self.budget.aborts -= 1;
                self.sender.abort(now, transfer_id(i), ErrorCode::CANCELLED);
            }
            Action::AbortReceiver(i) => {
                self.budget.aborts -= 1;
                self.receiver
                    .abort(now, transfer_id(i), ErrorCode::CANCELLED);
            }
            Action::PeerLost => {
                self.budget.peer_losses -= 1;
                self.lost = true;
                self.to_receiver.clear();
                self.to_sender.clear();
                self.sender.handle_peer_lost(now);
                self.receiver.handle_peer_lost(now);
                self.sender_unaware.clear();
                self.receiver_unaware.clear();
                for t in std::mem::take(&mut self.dead) {
                    self.fail_dead_writes(now, t);
                }
            }
            Action::LaneFails(i) => {
                self.budget.lane_failures -= 1;
                let t = self
                    .rx_open(i)
                    .ok_or_else(|| Violation("LaneFails enabled without a reservation".into()))?;
                self.dead.insert(t);
                self.sender_unaware.insert(t);
                self.receiver_unaware.insert(t);
                // Its frames in flight are lost with it.
                self.to_receiver.retain(|f| f.transfer() != Some(t));
                self.to_sender.retain(|f| f.transfer() != Some(t));
            }
            Action::SenderSeesLane(t) => {
                self.sender_unaware.remove(&t);
                // The transport names the transfer if the failed lane is its lane now.
                if self.sender.transfer_ref(t.transfer_id) == Some(t) {
                    self.sender.handle_transfer_lost(now, t.transfer_id);
                }
                self.fail_dead_writes(now, t);
            }
            Action::ReceiverSeesLane(t) => {
                self.receiver_unaware.remove(&t);
                if self.rx_open_ref(t) {
                    self.receiver.handle_transfer_lost(now, t.transfer_id);
                }
            }
        }
        self.pump_receiver(None)?;
        self.pump_sender()
    }

    /// Runs the receiver's effects, events and frames. `commit` is the COMMIT just handed
    /// to it, to recognise the one it accepts.
    fn pump_receiver(
        &mut self,
        commit: Option<kvwire_proto::wire::Commit>,
    ) -> Result<(), Violation> {
        let mut actions: Vec<ReceiverAction> =
            std::iter::from_fn(|| self.receiver.poll_action()).collect();
        if let Some(c) = commit {
            let t = c.transfer;
            let fenced = actions.contains(&ReceiverAction::Fence(t));
            let quarantined = actions.contains(&ReceiverAction::Quarantine(t));
            if fenced && !quarantined {
                self.rx.accept(c);
            }
        }
        while !actions.is_empty() {
            for a in actions {
                match a {
                    // A move (SPEC §9.2): the same pages, a new scope, reserved again.
                    ReceiverAction::Reopen(old) => {
                        let pages = self.rx.reopen_pages(old)?;
                        if let Some(new) =
                            self.receiver.handle_reopened(self.now, old, pages, vec![])
                        {
                            self.rx.moved(old, new)?;
                        }
                    }
                    a => self.rx.apply(a)?,
                }
            }
            actions = std::iter::from_fn(|| self.receiver.poll_action()).collect();
        }
        while let Some(e) = self.receiver.poll_event() {
            let truth = match &e {
                ReceiverEvent::Delivered(d) => {
                    Some(digest::source_contents(d.transfer.transfer_id, d.pages))
                }
                ReceiverEvent::Failed { .. } => None,
            };
            self.rx.event(&e, truth.as_deref())?;
        }
        while let Some(f) = self.receiver.poll_transmit() {
            ensure!(
                !self.lost,
                "receiver sent {f:?} after the connection was lost"
            );
            if f.transfer()
                .is_some_and(|t| self.receiver_unaware.contains(&t))
            {
                continue; // sent on the failed lane
            }
            self.to_sender.push_back(f);
        }
        Ok(())
    }

    fn pump_sender(&mut self) -> Result<(), Violation> {
        loop {
            while let Some(a) = self.sender.poll_action() {
                self.tx.apply(a)?;
            }
            // Writes posted under a reservation whose lane the sender already saw fail (it
            // took a parked RESERVE that came on it): the transport reports the transfer
            // lost, then the writes failed, at once.
            let Some(t) = self
                .tx
                .writes
                .iter()
                .map(|w| w.transfer)
                .find(|t| self.dead.contains(t) && !self.sender_unaware.contains(t))
            else {
                break;
            };
            let now = self.now;
            if self.sender.transfer_ref(t.transfer_id) == Some(t) {
                self.sender.handle_transfer_lost(now, t.transfer_id);
            }
            self.fail_dead_writes(now, t);
        }
        while let Some(e) = self.sender.poll_event() {
            self.tx.event(&e)?;
            if let SenderEvent::Verified(t) = e {
                ensure!(
                    self.rx.outcomes.get(&t) == Some(&RxOutcome::Delivered),
                    "the sender reports {t:?} verified, the receiver did not deliver it"
                );
            }
        }
        while let Some(f) = self.sender.poll_transmit() {
            ensure!(
                !self.lost,
                "sender sent {f:?} after the connection was lost"
            );
            if f.transfer()
                .is_some_and(|t| self.sender_unaware.contains(&t))
            {
                continue; // sent on the failed lane
            }
            self.to_receiver.push_back(f);
        }
        Ok(())
    }

    /// With nothing left to happen: every transfer ended on both sides, every page and
    /// every source came back.
    pub fn check_quiescent(&self) -> Result<(), Violation> {
        ensure!(
            self.receiver.open_transfers() == 0,
            "receiver has {} open transfers with nothing left to happen",
            self.receiver.open_transfers()
        );
        ensure!(
            self.sender.open_transfers() == 0,
            "sender has {} open transfers with nothing left to happen",
            self.sender.open_transfers()
        );
        self.rx.check_quiescent()?;
        self.tx.check_quiescent()?;
        if !self.lost {
            for i in 0..self.transfers.len() {
                ensure!(self.reservations[i] > 0, "transfer {i} never reserved");
            }
        }
        if self.only_lane_faults {
            for i in 0..self.transfers.len() {
                let id = transfer_id(i);
                let delivered = self
                    .rx
                    .outcomes
                    .iter()
                    .any(|(t, o)| t.transfer_id == id && *o == RxOutcome::Delivered);
                let verified = self.tx.outcomes.get(&id).map(|o| o.1) == Some(TxOutcome::Verified);
                ensure!(
                    delivered && verified,
                    "transfer {i} lost to a lane failure with no other fault (delivered: {delivered}, verified at the sender: {verified})"
                );
            }
        }
        // Both sides agree whenever the sender says verified (checked as it happens); note
        // the converse (receiver delivered, sender failed) is allowed only after peer loss
        // or a lost VERIFIED plus its ABORT's answer (SPEC Q3): not asserted here.
        let _ = TxOutcome::Verified;
        Ok(())
    }

    /// A canonical description of the state, for deduplication: counters and the timer
    /// heap's stale entries (which never change behaviour) are left out, times are
    /// relative to the start.
    pub fn fingerprint(&self) -> u128 {
        use std::fmt::Write;
        let mut s = String::with_capacity(4096);
        let _ = write!(
            s,
            "{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}",
            self.sender,
            self.receiver,
            self.to_receiver,
            self.to_sender,
            self.rx,
            self.tx,
            self.budget,
            self.reservations,
            self.submitted,
            self.lost,
            self.dead,
            self.sender_unaware,
            self.receiver_unaware
        );
        let s = strip(&s, "timers: Timers {");
        let s = strip(&s, "stats: SenderStats {");
        let s = strip(&s, "stats: ReceiverStats {");
        let s = relative_times(&s, self.now);
        fingerprint_str(&s)
    }
}

/// A 128-bit hash of a string.
pub fn fingerprint_str(s: &str) -> u128 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut a = DefaultHasher::new();
    s.hash(&mut a);
    let mut b = DefaultHasher::new();
    0xa5u8.hash(&mut b);
    s.hash(&mut b);
    (u128::from(a.finish()) << 64) | u128::from(b.finish())
}

/// Rewrites every `Instant { tv_sec: S, tv_nsec: N }` as its offset from `now`: the
/// sessions compare times only with each other, so states that differ by a shift of time
/// behave alike.
fn relative_times(s: &str, now: Instant) -> String {
    const OPEN: &str = "Instant { tv_sec: ";
    let now_ns = instant_ns(&format!("{now:?}")).unwrap_or(0);
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(OPEN) {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        let end = tail.find('}').map_or(tail.len(), |e| e + 1);
        match instant_ns(&tail[..end]) {
            Some(ns) => out.push_str(&format!("T{:+}", ns - now_ns)),
            None => out.push_str(&tail[..end]),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// Nanoseconds of an `Instant`'s Debug form (`Instant { tv_sec: S, tv_nsec: N }`).
fn instant_ns(s: &str) -> Option<i128> {
    let digits = |from: &str| -> Option<i128> {
        let at = s.find(from)? + from.len();
        let n: String = s[at..].chars().take_while(char::is_ascii_digit).collect();
        n.parse().ok()
    };
    Some(digits("tv_sec: ")? * 1_000_000_000 + digits("tv_nsec: ")?)
}

/// Removes every `prefix { ... }` (braces balanced) from `s`.
fn strip(s: &str, prefix: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(prefix) {
        out.push_str(&rest[..at]);
        let after = &rest[at + prefix.len()..];
        let mut depth = 1usize;
        let mut end = after.len();
        for (i, c) in after.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}
