//! The prefill end of an RDMA connection: page writes as RDMA WRITEs out of the registered
//! source memory, frames as SENDs, on the lane of each transfer.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use kvwire_proto::sender::PageWrite;
use kvwire_proto::wire::{Frame, TransferId, TransferRef};

use super::descriptor::AccessDescriptor;
use super::lanes::{LaneEvent, LaneLoss, Lanes};
use super::link::RdmaWrite;
use super::verbs::{RdmaError, RegisteredMemory};
use crate::transport::lanes::LaneMap;
use crate::transport::{Closed, SenderTransport, Transport, TransportEvent};

/// Pages per signaled write: the last write of every `SIGNAL_EVERY`th page (and of every
/// posting round) asks for a completion; RC completes in order, so it covers the others.
pub const SIGNAL_EVERY: u32 = 16;

/// Send-queue work requests a sender needs per queue pair for `window` pages of `buffers`
/// buffers per transfer in flight (the `max_send` of each of its queue pairs).
pub fn sender_queue_depth(window: u32, buffers: usize) -> u32 {
    (4 * window.max(1) * buffers as u32).clamp(64, 4096)
}

/// Counters of an RDMA sender.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RdmaSenderStats {
    /// Work requests (one per page and buffer) posted.
    pub writes_posted: u64,
    /// Signaled writes among them.
    pub signaled: u64,
    /// Doorbells (post calls).
    pub doorbells: u64,
    /// Page writes refused before posting: the destination is outside the reservation's
    /// access descriptor, or the descriptor is malformed.
    pub writes_refused: u64,
    /// Times the link broke.
    pub link_failures: u64,
}

/// A transfer's access descriptor as received (compared by pointer) and as decoded (`Err`
/// if it was refused).
type CachedDescriptor = (TransferRef, Arc<[u8]>, Result<Arc<AccessDescriptor>, ()>);

/// A signaled write: the completion that retires `wrs` work requests and `pages` pages.
struct Signaled {
    transfer: TransferRef,
    pages: u32,
    wrs: u32,
    /// The lane it was posted on.
    lane: usize,
}

/// The prefill end of an RDMA connection: one or more RC queue pairs (lanes).
pub struct RdmaSender {
    lanes: Lanes,
    lane_of: LaneMap,
    /// The source memory registered on each rail's device (a lane writes with its rail's
    /// local keys).
    regs: Vec<Arc<RegisteredMemory>>,
    page_bytes: Vec<u32>,
    max_wrs: u32,
    /// Writes not yet posted, per lane, with the group of pages the next signal covers.
    batches: Vec<Vec<RdmaWrite>>,
    groups: Vec<Option<(TransferRef, u32)>>,
    inflight: BTreeMap<u64, Signaled>,
    next_wr: u64,
    descriptors: VecDeque<CachedDescriptor>,
    /// The reservations seen, oldest first (transfer id, nonce), at most
    /// [`RESERVATIONS_REMEMBERED`]: a lane's failure loses a transfer only through its newest
    /// reservation ([`current_transfers`]).
    reservations: VecDeque<(TransferId, u64)>,
    events: VecDeque<TransportEvent>,
    closed: bool,
    /// How long a lane's SENDs may make no progress while another lane's do before the lane
    /// is taken as failed ([`Lanes::stalled_lane`]; half the liveness timeout).
    lane_timeout: std::time::Duration,
    stats: RdmaSenderStats,
}

impl std::fmt::Debug for RdmaSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaSender")
            .field("lanes", &self.lanes.lanes.len())
            .field("closed", &self.closed)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl RdmaSender {
    /// The prefill end over connected `lanes` (each made with [`sender_queue_depth`]`(window,
    /// buffers)`), writing out of `regs` (the source pool's memory registered on each rail's
    /// device, in rail order).
    pub(crate) fn new(
        lanes: Lanes,
        regs: Vec<Arc<RegisteredMemory>>,
        page_bytes: Vec<u32>,
        window: u32,
    ) -> Self {
        let n = lanes.lanes.len();
        Self {
            lanes,
            lane_of: LaneMap::default(),
            regs,
            max_wrs: sender_queue_depth(window, page_bytes.len()),
            page_bytes,
            batches: vec![Vec::new(); n],
            groups: vec![None; n],
            inflight: BTreeMap::new(),
            next_wr: 1,
            descriptors: VecDeque::new(),
            reservations: VecDeque::new(),
            events: VecDeque::new(),
            closed: false,
            lane_timeout: super::DEFAULT_LANE_TIMEOUT,
            stats: RdmaSenderStats::default(),
        }
    }

    /// The local ACK timeout exponent (`TransportConfig::Rdma::ack_timeout`) each queue pair
    /// of this connection holds, as the device reports it (`ibv_query_qp`), in lane order.
    pub fn ack_timeouts(&self) -> Result<Vec<u8>, RdmaError> {
        self.lanes.ack_timeouts()
    }

    /// Control frames queued on every lane and not yet posted (waiting for a send slot).
    pub fn frames_unsent(&self) -> usize {
        self.lanes.lanes.iter().map(|l| l.unsent()).sum()
    }

    /// How long a lane's SENDs may make no progress while another lane's do before the
    /// lane is taken as failed (SPEC §9.2, a lane that fails); the engine sets half its
    /// liveness timeout, so a lane is given up before the peer would be.
    pub fn set_lane_timeout(&mut self, timeout: std::time::Duration) {
        self.lane_timeout = timeout;
    }

    /// Counters.
    pub fn stats(&self) -> RdmaSenderStats {
        self.stats
    }

    fn descriptor(
        &mut self,
        transfer: TransferRef,
        access: &Arc<[u8]>,
    ) -> Result<Arc<AccessDescriptor>, ()> {
        if let Some((_, _, d)) = self
            .descriptors
            .iter()
            .rev() // the transfer being written is almost always among the newest
            .find(|(t, a, _)| *t == transfer && Arc::ptr_eq(a, access))
        {
            return d.clone();
        }
        let d = AccessDescriptor::decode(access, self.page_bytes.len())
            .map(Arc::new)
            .map_err(|e| {
                tracing::error!(transfer_id = transfer.transfer_id.0, error = %e, "access descriptor refused");
            });
        if self.descriptors.len() == 256 {
            self.descriptors.pop_front();
        }
        self.descriptors
            .push_back((transfer, access.clone(), d.clone()));
        d
    }

    /// Reports `pages` page writes of `transfer` ended, merged with the previous report of the
    /// same transfer.
    fn done(&mut self, transfer: TransferRef, pages: u32, ok: bool) {
        if pages == 0 {
            return;
        }
        if let Some(TransportEvent::WritesDone {
            transfer: t,
            pages: p,
            ok: o,
        }) = self.events.back_mut()
        {
            if *t == transfer && *o == ok {
                *p += pages;
                return;
            }
        }
        self.events.push_back(TransportEvent::WritesDone {
            transfer,
            pages,
            ok,
        });
    }

    /// Marks the last write of `lane`'s batch signaled, covering the pages of its group.
    fn signal(&mut self, lane: usize) {
        let Some((transfer, pages)) = self.groups[lane].take() else {
            return;
        };
        let batch = &mut self.batches[lane];
        let unsignaled_before = batch
            .iter()
            .rev()
            .skip(1)
            .take_while(|w| !w.signaled)
            .count() as u32;
        let Some(last) = batch.last_mut() else {
            return;
        };
        let id = self.next_wr;
        self.next_wr += 1;
        last.wr_id = id;
        last.signaled = true;
        self.stats.signaled += 1;
        self.inflight.insert(
            id,
            Signaled {
                transfer,
                pages,
                wrs: unsignaled_before + 1,
                lane,
            },
        );
    }

    /// Posts every lane's batch behind one doorbell each.
    fn post_batches(&mut self) -> Result<(), RdmaError> {
        for lane in 0..self.batches.len() {
            self.signal(lane);
            if self.batches[lane].is_empty() {
                continue;
            }
            let batch = std::mem::take(&mut self.batches[lane]);
            if let Err(e) = self.lanes.lanes[lane].link.post_writes(&batch) {
                // The lane's failure, not necessarily the connection's: its writes are
                // failed with it (Self::lose_lane).
                self.batches[lane] = batch;
                self.lose_lane(lane, format!("posting WRITEs on lane {lane}: {e}"));
                continue;
            }
            self.stats.doorbells += 1;
            self.stats.writes_posted += batch.len() as u64;
            self.lanes.lanes[lane].wrs_in_flight += batch.len() as u32;
            self.batches[lane] = batch;
            self.batches[lane].clear();
        }
        Ok(())
    }

    /// Lane `i`'s queue pair failed. With other lanes alive the connection goes on without
    /// it (SPEC §9.2, several rails): its queue pair is reset (none of its writes reads the
    /// source pages after this), its unsent frames move to a live lane, the transfers bound
    /// to it are reported lost, then its outstanding writes failed. The last live lane's
    /// failure is the connection's ([`Self::fail`]).
    fn lose_lane(&mut self, i: usize, why: String) {
        if self.closed {
            return;
        }
        match self.lanes.lose_one(i, &why) {
            LaneLoss::AlreadyDead => return,
            LaneLoss::Last => return self.fail(Closed::LinkFailed(why)),
            LaneLoss::Lost => {}
        }
        // Lost first, so each transfer ends as on peer loss (no ABORT for the failed writes):
        // those the lane carries frames for, and those striped over it (their descriptor
        // names it, or writes of theirs are on it) through their current reservation.
        let mut ids = self.lane_of.on_lane(i);
        let mut naming_lane: Vec<TransferRef> = self
            .descriptors
            .iter()
            .filter(|(_, _, d)| {
                d.as_ref()
                    .is_ok_and(|d| d.runs.iter().any(|r| r.lane == Some(i as u16)))
            })
            .map(|(t, _, _)| *t)
            .collect();
        naming_lane.extend(
            self.inflight
                .values()
                .filter(|s| s.lane == i)
                .map(|s| s.transfer),
        );
        naming_lane.extend(self.groups[i].map(|(t, _)| t));
        ids.extend(current_transfers(&naming_lane, &self.reservations));
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            self.events.push_back(TransportEvent::TransferLost(id));
        }
        let posted: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(_, s)| s.lane == i)
            .map(|(id, _)| *id)
            .collect();
        for id in posted {
            if let Some(s) = self.inflight.remove(&id) {
                self.done(s.transfer, s.pages, false);
            }
        }
        self.batches[i].clear();
        if let Some((t, pages)) = self.groups[i].take() {
            self.done(t, pages, false);
        }
    }

    /// A queue pair failed (or the peer is gone): every lane is reset first, so none of their
    /// writes can still read the source pages; then every write not completed is reported
    /// failed, then the end of the connection.
    fn fail(&mut self, why: Closed) {
        if self.closed {
            return;
        }
        self.closed = true;
        if matches!(why, Closed::LinkFailed(_)) {
            self.stats.link_failures += 1;
        }
        self.lanes.reset();
        for (_, s) in std::mem::take(&mut self.inflight) {
            self.done(s.transfer, s.pages, false);
        }
        // Writes batched but never posted: their groups were not signaled yet.
        for lane in 0..self.batches.len() {
            self.batches[lane].clear();
            if let Some((t, pages)) = self.groups[lane].take() {
                self.done(t, pages, false);
            }
        }
        self.events.push_back(TransportEvent::Closed(why));
    }

    /// Test-only fault: lane `lane`'s queue pair goes to the error state, as when its
    /// rail's link or port fails (SPEC §9.2, several rails).
    #[doc(hidden)]
    pub fn inject_lane_failure(&mut self, lane: usize) -> Result<(), RdmaError> {
        self.lanes.lanes[lane].link.force_error()
    }

    /// Lanes still alive (their queue pair has not failed).
    pub fn live_lanes(&self) -> usize {
        self.lanes.live()
    }

    /// Test-only fault: posts one more write of source page 0 into the first destination
    /// page of `transfer`'s access descriptor, on its lane, whatever state the transfer is in
    /// (a sender that keeps writing after the receiver fenced). Returns that page, or `None`
    /// if no descriptor of `transfer` is known. Its completion is not reported as a page.
    #[doc(hidden)]
    pub fn inject_late_write(&mut self, transfer: TransferRef) -> Result<Option<u32>, RdmaError> {
        let Some(d) = self
            .descriptors
            .iter()
            .find(|(t, _, _)| *t == transfer)
            .and_then(|(_, _, d)| d.clone().ok())
        else {
            return Ok(None);
        };
        let Some(page) = d.runs.first().map(|r| r.first_page) else {
            return Ok(None);
        };
        let Ok((rkey, addr)) = d.locate(page, 0, self.page_bytes[0]) else {
            return Ok(None);
        };
        let lane = match d.lane_of(page) {
            Ok(Some(l)) => usize::from(l),
            _ => self.lane_of.get(transfer.transfer_id),
        };
        let id = self.next_wr;
        self.next_wr += 1;
        self.inflight.insert(
            id,
            Signaled {
                transfer,
                pages: 0,
                wrs: 1,
                lane,
            },
        );
        self.lanes.lanes[lane].wrs_in_flight += 1;
        let reg = &self.regs[self.lanes.lanes[lane].rail];
        self.lanes.lanes[lane].link.post_writes(&[RdmaWrite {
            wr_id: id,
            local: (reg.lkey(0), reg.addr(0, 0), self.page_bytes[0]),
            remote: (rkey, addr),
            signaled: true,
        }])?;
        Ok(Some(page))
    }
}

impl Transport for RdmaSender {
    fn send_frame(&mut self, _now: Instant, frame: &Frame) {
        if self.closed {
            return;
        }
        let lane = self.lane_of.of(frame);
        if let Some(why) = self.lanes.queue_frame(lane, frame) {
            self.fail(why);
        }
    }

    fn write_blocked_since(&self) -> Option<Instant> {
        if self.closed {
            None
        } else {
            self.lanes.sends_stalled_since()
        }
    }

    fn log_state(&self) {
        if !self.closed {
            self.lanes.log_state();
        }
    }

    fn failed_lanes(&self) -> usize {
        self.lanes.lanes.len() - self.lanes.live()
    }

    fn moves_transfers(&self) -> bool {
        self.lanes.lanes.len() > 1
    }

    fn poll_timeout(&self) -> Option<Instant> {
        if self.closed {
            None
        } else {
            self.lanes.next_stall_check(self.lane_timeout)
        }
    }

    fn poll_event(&mut self, cx: &mut Context<'_>, _now: Instant) -> Poll<TransportEvent> {
        loop {
            if let Some(e) = self.events.pop_front() {
                return Poll::Ready(e);
            }
            if self.closed {
                return Poll::Pending;
            }
            if let Some((i, why)) = self.lanes.stalled_lane(Instant::now(), self.lane_timeout) {
                self.lose_lane(i, why);
                continue;
            }
            // Writes first, then frames, so a COMMIT queued with them follows them.
            if let Err(e) = self.post_batches() {
                self.fail(Closed::LinkFailed(e.to_string()));
                continue;
            }
            let mut completed: Vec<(TransferRef, u32, bool)> = Vec::new();
            let mut frames: Vec<Frame> = Vec::new();
            let mut reserved: Vec<(TransferId, u64)> = Vec::new();
            let (inflight, lane_of) = (&mut self.inflight, &mut self.lane_of);
            let pass = self.lanes.poll_pass(cx, |lane, i, e| match e {
                LaneEvent::WriteDone { wr_id, ok } => {
                    let s = inflight.remove(&wr_id)?;
                    lane.wrs_in_flight = lane.wrs_in_flight.saturating_sub(s.wrs);
                    completed.push((s.transfer, s.pages, ok));
                    (!ok).then(|| {
                        Closed::LinkFailed(format!(
                            "a write on lane {i} completed in error (e.g. a remote access error after the receiver's fence)"
                        ))
                    })
                }
                LaneEvent::Frame(f) => {
                    if let Frame::Reserve(r) = &f {
                        // The transfer's writes and COMMIT go back on this lane.
                        lane_of.set(r.transfer_id, i);
                        reserved.push((r.transfer_id, r.nonce));
                    }
                    frames.push(f);
                    None
                }
                LaneEvent::LocalDone { .. } => None,
            });
            // A reservation of a transfer makes its earlier ones' descriptors stale (a move):
            // a later lane failure must not lose the transfer for lanes it no longer uses.
            for (id, nonce) in reserved {
                self.descriptors
                    .retain(|(t, _, _)| t.transfer_id != id || t.nonce == nonce);
                if self.reservations.len() == RESERVATIONS_REMEMBERED {
                    self.reservations.pop_front();
                }
                self.reservations.push_back((id, nonce));
            }
            // A failed lane's transfers are reported lost before its writes' outcomes (so
            // each ends as on peer loss); completions before the frames that came with them
            // (a VERIFIED after the writes it covers).
            let failed = self.lanes.take_failed();
            let survives = failed.len() < self.lanes.live();
            let mut last_why = None;
            for (i, why) in failed {
                if survives {
                    self.lose_lane(i, why);
                } else {
                    last_why.get_or_insert(why);
                }
            }
            for (t, pages, ok) in completed {
                self.done(t, pages, ok);
            }
            self.events
                .extend(frames.into_iter().map(TransportEvent::Frame));
            if let Some(why) = last_why {
                // Every live lane failed: the connection's end, after the outcomes.
                self.fail(Closed::LinkFailed(why));
            }
            match pass {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(why)) => self.fail(why),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn close(&mut self, _now: Instant) {
        self.fail(Closed::Local);
    }
}

impl SenderTransport for RdmaSender {
    fn write_credit(&self) -> usize {
        if self.closed {
            return 0;
        }
        let buffers = self.page_bytes.len().max(1) as u32;
        self.lanes
            .lanes
            .iter()
            .zip(&self.batches)
            .map(|(l, b)| {
                (self
                    .max_wrs
                    .saturating_sub(l.wrs_in_flight + b.len() as u32)
                    / buffers) as usize
            })
            .min()
            .unwrap_or(0)
    }

    fn post_writes(
        &mut self,
        _now: Instant,
        transfer: TransferRef,
        access: &Arc<[u8]>,
        writes: &[PageWrite],
    ) {
        if self.closed {
            self.done(transfer, writes.len() as u32, false);
            return;
        }
        let Ok(d) = self.descriptor(transfer, access) else {
            self.stats.writes_refused += writes.len() as u64;
            self.done(transfer, writes.len() as u32, false);
            return;
        };
        // Each page on its run's lane (a striped descriptor), else on the transfer's. A lane of
        // the transfer that has failed loses it before any of these writes is posted (its
        // stripes on live lanes are not written further: the receiver moves it whole).
        let own = self.lane_of.get(transfer.transfer_id);
        let dead = |l: usize| self.lanes.lanes.get(l).is_some_and(|x| x.dead);
        let mut lost = dead(own) || d.lanes().into_iter().any(|l| dead(usize::from(l)));
        if lost {
            self.events
                .push_back(TransportEvent::TransferLost(transfer.transfer_id));
        }
        for w in writes {
            if lost {
                self.done(transfer, 1, false);
                continue;
            }
            let lane = match d.lane_of(w.dst_page) {
                Ok(None) => own,
                Ok(Some(l)) if usize::from(l) < self.lanes.lanes.len() => usize::from(l),
                Ok(Some(l)) => {
                    tracing::error!(
                        transfer_id = transfer.transfer_id.0,
                        lane = l,
                        "write refused: the descriptor names a lane the connection does not have"
                    );
                    self.stats.writes_refused += 1;
                    self.done(transfer, 1, false);
                    continue;
                }
                Err(e) => {
                    tracing::error!(transfer_id = transfer.transfer_id.0, error = %e, "write refused");
                    self.stats.writes_refused += 1;
                    self.done(transfer, 1, false);
                    continue;
                }
            };
            if self.lanes.lanes[lane].dead {
                // Its reservation came on (or was striped over) a lane that has failed since
                // (a parked one taken now, or a chunk): the transfer is lost with it (before
                // its writes' outcomes, so it ends, or waits to be moved, as on the lane's
                // failure; SPEC §9.2).
                if !lost {
                    lost = true;
                    self.events
                        .push_back(TransportEvent::TransferLost(transfer.transfer_id));
                }
                self.done(transfer, 1, false);
                continue;
            }
            let rail = self.lanes.lanes[lane].rail;
            // Close the lane's previous transfer group with a signaled write.
            if self.groups[lane].is_some_and(|(t, _)| t != transfer) {
                self.signal(lane);
            }
            // One WRITE per buffer, straight into the batch (no allocation per page); a page
            // outside the descriptor takes its buffers back out and is refused.
            let mark = self.batches[lane].len();
            let mut refused = false;
            for (b, &bytes) in self.page_bytes.iter().enumerate() {
                match d.locate(w.dst_page, b, bytes) {
                    Ok((rkey, addr)) => self.batches[lane].push(RdmaWrite {
                        wr_id: 0,
                        local: (
                            self.regs[rail].lkey(b),
                            self.regs[rail].addr(b, u64::from(w.src_page) * u64::from(bytes)),
                            bytes,
                        ),
                        remote: (rkey, addr),
                        signaled: false,
                    }),
                    Err(e) => {
                        tracing::error!(transfer_id = transfer.transfer_id.0, error = %e, "write refused");
                        self.batches[lane].truncate(mark);
                        refused = true;
                        break;
                    }
                }
            }
            if refused {
                self.stats.writes_refused += 1;
                self.done(transfer, 1, false);
                continue;
            }
            let k = self.groups[lane].map_or(0, |(_, k)| k) + 1;
            self.groups[lane] = Some((transfer, k));
            if k == SIGNAL_EVERY {
                self.signal(lane);
            }
        }
    }
}

/// Reservations an [`RdmaSender`] remembers, newest last. A reservation older than this many
/// others is forgotten; a write or descriptor still naming it is then taken as current, as
/// before moves were told apart (a transfer with that many reservations after it has long
/// ended or moved again).
const RESERVATIONS_REMEMBERED: usize = 4096;

/// The transfers of `refs` (references a failed lane's writes or cached descriptors name)
/// whose nonce is the newest reservation of that transfer in `reservations` (oldest first),
/// or of which none is remembered. A reference under an older nonce is a moved transfer's
/// old reservation (SPEC §9.2, moving a transfer): a late write under it (in flight, or
/// whose descriptor was cached again after the move) must not lose the transfer, which no
/// longer uses that lane.
fn current_transfers(
    refs: &[TransferRef],
    reservations: &VecDeque<(TransferId, u64)>,
) -> Vec<TransferId> {
    refs.iter()
        .filter(|t| {
            reservations
                .iter()
                .rev()
                .find(|(id, _)| *id == t.transfer_id)
                .is_none_or(|&(_, nonce)| nonce == t.nonce)
        })
        .map(|t| t.transfer_id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(id: u64, nonce: u64) -> TransferRef {
        TransferRef {
            transfer_id: TransferId(id),
            nonce,
        }
    }

    /// A failed lane loses a transfer through its newest reservation, or one never seen
    /// reserved; not through a reservation it moved off (writes or a descriptor of the old
    /// nonce still naming the lane).
    #[test]
    fn a_lane_loses_only_the_current_reservations_of_its_transfers() {
        let seen: VecDeque<(TransferId, u64)> = [
            (TransferId(1), 10),
            (TransferId(2), 20),
            (TransferId(1), 11), // transfer 1 moved: 10 -> 11
            (TransferId(3), 30),
        ]
        .into();
        let refs = [r(1, 10), r(1, 11), r(2, 20), r(3, 31), r(4, 40)];
        assert_eq!(
            current_transfers(&refs, &seen),
            vec![TransferId(1), TransferId(2), TransferId(4)],
            "1 through nonce 11 only, 2 as reserved, not 3 under a nonce it never had here, 4 unknown"
        );
        assert!(current_transfers(&[r(1, 10)], &seen).is_empty());
    }
}
