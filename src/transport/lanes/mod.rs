//! Several independent ordered channels ("lanes") under one connection, each a whole
//! transport of its own (one TCP stream each, SPEC §9.1, several streams): [`LaneSet`] makes
//! them one [`Transport`] for the driver. Every frame and page write of a transfer travels on
//! the transfer's lane, so the ordering the protocol needs (a transfer's writes before its
//! COMMIT) holds per lane:
//!
//! * the **receiver** chooses a transfer's lane when it opens the reservation's access scope
//!   (round robin), and its RESERVE, fence and later frames use that lane;
//! * the **sender** learns it from the lane the RESERVE arrived on, and posts the transfer's
//!   writes and sends its frames there;
//! * a PING goes on every lane and a PONG on the lane of the PING it answers
//!   (`lanes/heartbeats.rs`), so a lane the peer went silent on is found; any other frame of
//!   no known transfer (or of a transfer with no lane yet) goes on lane 0.
//!
//! The connection is one: when any lane ends, every other lane is closed too (their
//! outstanding writes reported failed, as a lane's own close does; after a short grace when
//! the peer ended it, so that what the peer sent on the others before closing is still read),
//! and the first lane's reason is reported once, as the connection's.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvwire_proto::sender::PageWrite;
use kvwire_proto::wire::{DigestAlgorithm, Frame, TransferId, TransferRef};

mod heartbeats;

use heartbeats::LaneHeartbeats;

use super::{
    Closed, Fence, ReceiverTransport, ScopeError, SenderTransport, Transport, TransportEvent,
};

/// Remembers which lane each recent transfer uses, bounded: beyond [`LANE_MAP_CAPACITY`]
/// transfers the one whose lane was set longest ago goes first (arrival order, never by id:
/// ids are the engine's, often random). For routing frames and a sender's writes, where a
/// forgotten lane costs liveness (the transfer's writes go to lane 0, where the receiver does
/// not know the key) and never safety. A receiver's open scopes are tracked exactly
/// ([`LaneSet`]).
#[derive(Debug, Default)]
pub(crate) struct LaneMap {
    /// Each transfer's lane and the number of the `set` that gave it.
    lanes: HashMap<TransferId, (usize, u64)>,
    /// `set`s in order (entries of transfers set again since are skipped when they come up).
    order: VecDeque<(TransferId, u64)>,
    sets: u64,
}

/// Transfers a [`LaneMap`] remembers at most.
pub(crate) const LANE_MAP_CAPACITY: usize = 65_536;

impl LaneMap {
    pub(crate) fn set(&mut self, transfer_id: TransferId, lane: usize) {
        self.sets += 1;
        self.lanes.insert(transfer_id, (lane, self.sets));
        self.order.push_back((transfer_id, self.sets));
        while self.lanes.len() > LANE_MAP_CAPACITY || self.order.len() > 2 * LANE_MAP_CAPACITY {
            let Some((id, n)) = self.order.pop_front() else {
                break;
            };
            if self.lanes.get(&id).is_some_and(|&(_, m)| m == n) {
                self.lanes.remove(&id);
            }
        }
    }

    pub(crate) fn get(&self, transfer_id: TransferId) -> usize {
        self.lanes.get(&transfer_id).map_or(0, |&(lane, _)| lane)
    }

    /// The transfers remembered on `lane`, in id order (some may have ended).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn on_lane(&self, lane: usize) -> Vec<TransferId> {
        let mut ids: Vec<TransferId> = self
            .lanes
            .iter()
            .filter(|(_, &(l, _))| l == lane)
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The lane of a frame: its transfer's, or lane 0 for a frame of no live transfer.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn of(&self, f: &Frame) -> usize {
        f.transfer().map_or(0, |t| self.get(t.transfer_id))
    }
}

/// Which end of the connection a [`LaneSet`] is, which decides how it learns lanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Learns a transfer's lane from the lane its RESERVE arrived on.
    Sender,
    /// Chooses a transfer's lane when it opens the access scope.
    Receiver,
}

/// The lanes of one connection as one transport (see the module documentation).
#[derive(Debug)]
pub struct LaneSet<T> {
    lanes: Vec<T>,
    end: End,
    /// The lane of each recent transfer, for its frames and writes: the lane its latest
    /// RESERVE arrived on (sender) or was sent on (receiver).
    recent: LaneMap,
    /// Receiver: the lane of each transfer with an open scope, exactly (entries leave at the
    /// fence or when the scope is abandoned), so a fence always reaches the lane whose table
    /// holds the scope however many transfers are open.
    scoped: HashMap<TransferId, usize>,
    /// The lane the next reservation gets (receiver).
    next_lane: usize,
    /// The lane polled first on the next pass (fairness).
    first: usize,
    /// Lanes that reported their end.
    ended: Vec<bool>,
    /// The first lane's reason for ending: the connection's.
    closing: Option<Closed>,
    /// After the peer ended a lane: when the lanes still open are closed.
    grace_until: Option<Instant>,
    /// Events taken from the lanes and not handed out yet.
    ready: VecDeque<TransportEvent>,
    /// Heartbeats per lane.
    heartbeats: LaneHeartbeats,
}

/// How long the other lanes are read on after the peer ended one ([`LaneSet`]).
pub const CLOSE_GRACE: Duration = Duration::from_millis(200);

impl<T: Transport> LaneSet<T> {
    fn new(lanes: Vec<T>, end: End) -> Self {
        assert!(!lanes.is_empty(), "a connection has at least one lane");
        let n = lanes.len();
        Self {
            lanes,
            end,
            recent: LaneMap::default(),
            scoped: HashMap::new(),
            next_lane: 0,
            first: 0,
            ended: vec![false; n],
            closing: None,
            grace_until: None,
            ready: VecDeque::new(),
            heartbeats: LaneHeartbeats::new(),
        }
    }

    /// The prefill end over `lanes` (lane 0 first, in the order both ends agreed).
    ///
    /// # Panics
    ///
    /// If `lanes` is empty.
    pub fn sender(lanes: Vec<T>) -> Self
    where
        T: SenderTransport,
    {
        Self::new(lanes, End::Sender)
    }

    /// The decode end over `lanes` (lane 0 first, in the order both ends agreed).
    ///
    /// # Panics
    ///
    /// If `lanes` is empty.
    pub fn receiver(lanes: Vec<T>) -> Self
    where
        T: ReceiverTransport,
    {
        Self::new(lanes, End::Receiver)
    }

    /// The first reservation takes lane `lane` (then round robin from there); lane 0 by
    /// default.
    pub fn with_first_lane(mut self, lane: usize) -> Self {
        self.next_lane = lane % self.lanes.len();
        self
    }

    /// Judges each lane by the liveness timeout `limit` (SPEC §9.1, several streams): a lane
    /// on which nothing arrived from the peer for `limit`, while another lane was heard
    /// since, closes the connection as unresponsive ([`Closed::Unresponsive`]).
    pub fn with_silence_limit(mut self, limit: Duration) -> Self {
        self.heartbeats.set_limit(limit);
        self
    }

    /// The lanes, lane 0 first (for their counters).
    pub fn lanes(&self) -> &[T] {
        &self.lanes
    }

    /// The lane of `transfer_id`'s frames and writes.
    fn lane_of(&self, transfer_id: TransferId) -> usize {
        match self.scoped.get(&transfer_id) {
            Some(&lane) => lane,
            None => self.recent.get(transfer_id),
        }
    }

    /// A lane ended: the first one's reason is the connection's. When the peer ended it (end
    /// of stream, a reset), the other lanes are read on for [`CLOSE_GRACE`]: a peer that
    /// closes its connection ends every lane, and what it sent on each before (a VERIFIED,
    /// a COMMIT) arrives ahead of that lane's end, so it is still handed out. Any other end
    /// (bytes that break the format, a frame that fails authentication, a local failure)
    /// closes every other lane at once. A closed lane reports its outstanding writes and
    /// fences before its own end; the connection's end is reported once, after all.
    fn lane_ended(&mut self, lane: usize, why: Closed, now: Instant) {
        self.ended[lane] = true;
        let by_peer = matches!(why, Closed::PeerGone(_));
        match &self.closing {
            None => self.closing = Some(why),
            // A worse reason during the grace (a frame that failed authentication, bytes
            // that break the format) is the connection's, and ends the grace now.
            Some(Closed::PeerGone(_)) if !by_peer => self.closing = Some(why),
            Some(_) => return,
        }
        if by_peer {
            self.grace_until = Some(now + CLOSE_GRACE);
            return;
        }
        self.grace_until = None;
        for (i, l) in self.lanes.iter_mut().enumerate() {
            if i != lane && !self.ended[i] {
                l.close(now);
            }
        }
    }
}

impl<T: Transport> Transport for LaneSet<T> {
    fn send_frame(&mut self, now: Instant, frame: &Frame) {
        let lane = match frame {
            Frame::Ping(_) => {
                for (l, ended) in self.lanes.iter_mut().zip(&self.ended) {
                    if !ended {
                        l.send_frame(now, frame);
                    }
                }
                return;
            }
            Frame::Pong(_) => self.heartbeats.pong_lane(),
            f => f.transfer().map_or(0, |t| self.lane_of(t.transfer_id)),
        };
        let lane = lane.min(self.lanes.len() - 1);
        self.lanes[lane].send_frame(now, frame);
    }

    fn hold_writes(&mut self, held: bool) {
        for l in &mut self.lanes {
            l.hold_writes(held);
        }
    }

    fn coalesces_writes(&self) -> bool {
        self.lanes.iter().any(Transport::coalesces_writes)
    }

    /// Polls every lane once per pass (each sends what it has queued, then reads), starting
    /// after the lane that last had something, and hands their events out in that order.
    fn poll_event(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<TransportEvent> {
        if let Some(e) = self.ready.pop_front() {
            return Poll::Ready(e);
        }
        if self.grace_until.is_some_and(|t| now >= t) {
            // The peer ended a lane and the others did not follow: close them.
            self.grace_until = None;
            for (l, ended) in self.lanes.iter_mut().zip(&self.ended) {
                if !ended {
                    l.close(now);
                }
            }
        }
        let n = self.lanes.len();
        let first = self.first;
        for k in 0..n {
            let i = (first + k) % n;
            if self.ended[i] {
                continue;
            }
            match self.lanes[i].poll_event(cx, now) {
                Poll::Ready(TransportEvent::Closed(why)) => self.lane_ended(i, why, now),
                Poll::Ready(event) => {
                    match (self.end, &event) {
                        (End::Sender, TransportEvent::Frame(Frame::Reserve(r))) => {
                            // The transfer's writes and COMMIT go back on this lane.
                            self.recent.set(r.transfer_id, i);
                        }
                        (_, TransportEvent::Frame(Frame::Ping(_))) => self.heartbeats.ping_from(i),
                        _ => {}
                    }
                    if matches!(
                        event,
                        TransportEvent::Frame(_) | TransportEvent::Landed { .. }
                    ) {
                        self.heartbeats.heard(i, now);
                    }
                    self.ready.push_back(event);
                    self.first = (i + 1) % n;
                }
                Poll::Pending => {}
            }
            if let Some(t) = self.lanes[i].last_read() {
                // Part of a record arrived on this lane: heard, whole record or not.
                self.heartbeats.heard(i, t);
            }
        }
        if self.closing.is_none() {
            if let Some((lane, silent_for)) = self.heartbeats.end_pass(n, &self.ended, now) {
                tracing::warn!(
                    lane,
                    silent_ms = silent_for.as_millis() as u64,
                    "nothing from the peer on one TCP stream of the connection while the others were heard; closing the connection"
                );
                self.closing = Some(Closed::Unresponsive { silent_for });
                self.grace_until = None;
                for l in &mut self.lanes {
                    l.close(now);
                }
                // The lanes report their ends on the next pass.
                cx.waker().wake_by_ref();
            }
        }
        if self.ended.iter().all(|&e| e) {
            if let Some(why) = self.closing.take() {
                self.grace_until = None;
                self.ready.push_back(TransportEvent::Closed(why));
            }
        }
        match self.ready.pop_front() {
            Some(e) => Poll::Ready(e),
            None => Poll::Pending,
        }
    }

    fn close(&mut self, now: Instant) {
        self.grace_until = None;
        for l in &mut self.lanes {
            l.close(now);
        }
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.lanes
            .iter()
            .filter_map(Transport::poll_timeout)
            .chain(self.grace_until)
            .min()
    }

    /// The longest block of any lane: a peer that stops reading one stream holds the
    /// transfers on it as surely as one that stops reading all.
    fn write_blocked_since(&self) -> Option<Instant> {
        self.lanes
            .iter()
            .zip(&self.ended)
            .filter(|(_, ended)| !**ended)
            .filter_map(|(l, _)| l.write_blocked_since())
            .min()
    }

    fn last_read(&self) -> Option<Instant> {
        self.lanes.iter().filter_map(Transport::last_read).max()
    }

    fn failed_lanes(&self) -> usize {
        self.lanes.iter().map(Transport::failed_lanes).sum()
    }

    fn log_state(&self) {
        self.lanes.iter().for_each(Transport::log_state)
    }
}

impl<T: SenderTransport> SenderTransport for LaneSet<T> {
    /// The least any lane has room for: the driver does not say which transfer it will post.
    fn write_credit(&self) -> usize {
        self.lanes
            .iter()
            .map(SenderTransport::write_credit)
            .min()
            .unwrap_or(0)
    }

    fn destination_pages(&self) -> Option<u32> {
        self.lanes[0].destination_pages()
    }

    fn digests_after_writes(&self) -> bool {
        self.lanes.iter().all(T::digests_after_writes)
    }

    fn post_writes(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        access: &Arc<[u8]>,
        writes: &[PageWrite],
    ) {
        let lane = self.lane_of(transfer.transfer_id);
        self.lanes[lane].post_writes(now, transfer, access, writes);
    }
}

impl<T: ReceiverTransport> ReceiverTransport for LaneSet<T> {
    fn open_scope(
        &mut self,
        transfer_id: TransferId,
        pages: &[u32],
    ) -> Result<Vec<u8>, ScopeError> {
        let lane = self.next_lane % self.lanes.len();
        // A scope still open for this transfer on another lane closes first, as one table
        // closes a transfer's old scope when it opens a new one.
        if let Some(old) = self.scoped.remove(&transfer_id) {
            if old != lane {
                self.lanes[old].abandon_scope(transfer_id);
            }
        }
        let access = self.lanes[lane].open_scope(transfer_id, pages)?;
        self.next_lane = self.next_lane.wrapping_add(1);
        self.scoped.insert(transfer_id, lane);
        self.recent.set(transfer_id, lane);
        Ok(access)
    }

    fn bind_scope(&mut self, transfer: TransferRef) {
        let lane = self.lane_of(transfer.transfer_id);
        self.lanes[lane].bind_scope(transfer);
    }

    fn abandon_scope(&mut self, transfer_id: TransferId) {
        if let Some(lane) = self.scoped.remove(&transfer_id) {
            self.lanes[lane].abandon_scope(transfer_id);
        }
    }

    fn open_scopes(&self) -> usize {
        self.lanes.iter().map(ReceiverTransport::open_scopes).sum()
    }

    fn reports_landings(&self) -> bool {
        self.lanes.iter().all(ReceiverTransport::reports_landings)
    }

    fn pulls_pages(&self) -> bool {
        self.lanes.iter().all(ReceiverTransport::pulls_pages)
    }

    fn digest_landings(&mut self, transfer_id: TransferId, alg: DigestAlgorithm) {
        if let Some(&lane) = self.scoped.get(&transfer_id) {
            self.lanes[lane].digest_landings(transfer_id, alg);
        }
    }

    fn fence(&mut self, transfer: TransferRef) -> Fence {
        // The frames that follow the fence (VERIFIED, NACK, ABORT_ACK) still go on the
        // transfer's lane, which `recent` keeps.
        let lane = self
            .scoped
            .remove(&transfer.transfer_id)
            .unwrap_or_else(|| self.recent.get(transfer.transfer_id));
        self.lanes[lane].fence(transfer)
    }
}

#[cfg(test)]
mod tests;
