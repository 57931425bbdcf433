//! The decode end of an RDMA connection: memory windows bound per reservation (the access
//! scope) and invalidated as the fence, frames as SENDs.

use kvwire_proto::wire::TransferId;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvwire_proto::wire::{Frame, TransferRef, MAX_ACCESS};

use super::descriptor::{
    encoded_len, near_rails, page_runs, plan_stripes, prefer_near_rails, AccessDescriptor,
    AccessKind, AccessRun, DEFAULT_STRIPE_PAGES,
};
use super::lanes::{LaneEvent, LaneLoss, Lanes};
use super::verbs::{MemoryWindow, RdmaDevice, RegisteredMemory};
use crate::memory::PagePool;
use crate::transport::lanes::LaneMap;
use crate::transport::{Closed, Fence, ReceiverTransport, ScopeError, Transport, TransportEvent};

mod fences;

use fences::{Binding, Fencing, Stripe};

/// Send-queue depth of each of a receiver's queue pairs (binds, invalidations, frames).
pub const RECEIVER_QUEUE_DEPTH: u32 = 4096;

/// Invalidated windows kept for reuse at most (the rest are deallocated).
const SPARE_WINDOWS: usize = 4096;

/// Counters of an RDMA receiver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RdmaReceiverStats {
    /// Memory windows bound.
    pub binds: u64,
    /// Memory windows invalidated (fences at the NIC).
    pub invalidations: u64,
    /// Binds of a window invalidated earlier (no allocation; each bind takes a new key, so
    /// the rkeys of its earlier bindings stay dead).
    pub windows_reused: u64,
    /// Reservations scoped by the region's rkeys because the device has no memory windows.
    pub region_fallbacks: u64,
    /// Total time from posting a transfer's invalidations to the last completing.
    pub fence_time: Duration,
    /// Times the link broke.
    pub link_failures: u64,
    /// Pages overwritten with a reservation's unpredictable pattern before their access
    /// descriptor was published (the coverage scrub).
    pub pages_scrubbed: u64,
    /// Reservations striped over several lanes (SPEC §9.2, striping a transfer over lanes).
    pub striped: u64,
    /// Lanes those reservations took, together (`striped_lanes / striped` per reservation).
    pub striped_lanes: u64,
}

/// The decode end of an RDMA connection: one or more RC queue pairs (lanes) over the
/// registered destination memory.
pub struct RdmaReceiver {
    lanes: Lanes,
    lane_of: LaneMap,
    next_lane: usize,
    /// Each rail's device and the destination memory registered on it, in rail order: a
    /// lane's windows come from its rail's device and bind its rail's registration.
    devs: Vec<Arc<RdmaDevice>>,
    regs: Vec<Arc<RegisteredMemory>>,
    /// The pool over the registered memory: reserved pages are scrubbed through it.
    pool: Arc<PagePool>,
    page_bytes: Vec<u32>,
    kind: AccessKind,
    /// Windows of open scopes, per transfer id and lane (the reservation's own lane first).
    bound: BTreeMap<TransferId, Vec<Stripe>>,
    /// Striped reservations whose binds on other lanes are still executing.
    binding: BTreeMap<TransferId, Binding>,
    /// Signaled bind work request → transfer id.
    bind_wrs: BTreeMap<u64, TransferId>,
    /// Pages per stripe below which a reservation is not striped further (0: never).
    stripe_pages: u32,
    /// Per rail: its NIC is on the NUMA node of the KV memory (all false where unknown).
    near_rails: Vec<bool>,
    /// Whether reservations keep to the near rails while one lives.
    rail_affinity: bool,
    /// Invalidated windows with keys left, per rail, bound again by the next reservations on
    /// that rail.
    spare: Vec<Vec<MemoryWindow>>,
    /// Fences in progress, by fence number.
    fencing: BTreeMap<u64, Fencing>,
    next_fence: u64,
    /// Invalidation work request → fence number.
    fence_wrs: BTreeMap<u64, u64>,
    /// Transfers lost with a lane while they had windows on live lanes: their fence is not
    /// posted before this instant (`move_grace` after the loss).
    defer_fence: BTreeMap<TransferId, Instant>,
    next_wr: u64,
    events: VecDeque<TransportEvent>,
    closed: bool,
    /// How long a lane's SENDs may make no progress while another lane's do before the lane
    /// is taken as failed ([`Lanes::stalled_lane`]; half the liveness timeout).
    lane_timeout: std::time::Duration,
    /// The heartbeat interval (PINGs on every lane): how far apart the two ends' stall rules
    /// can see one lane fail.
    heartbeat: Duration,
    stats: RdmaReceiverStats,
}

impl std::fmt::Debug for RdmaReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaReceiver")
            .field("lanes", &self.lanes.lanes.len())
            .field("kind", &self.kind)
            .field("closed", &self.closed)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl RdmaReceiver {
    /// The decode end over connected `lanes` (each made with [`RECEIVER_QUEUE_DEPTH`]),
    /// landing in `regs` (the destination pool's memory registered on each rail's device in
    /// `devs`, in rail order). Checks every device for memory windows, falling back to the
    /// regions' rkeys with a loud warning where one has none.
    pub(crate) fn new(
        lanes: Lanes,
        devs: Vec<Arc<RdmaDevice>>,
        regs: Vec<Arc<RegisteredMemory>>,
        pool: Arc<PagePool>,
    ) -> Self {
        let page_bytes = pool.geometry().buffer_page_bytes.clone();
        let mut kind = AccessKind::WINDOWS;
        for dev in &devs {
            if let Err(e) = dev.alloc_window() {
                tracing::warn!(device = %dev.name, error = %e,
                    "NO MEMORY WINDOWS: reservations use the region's rkeys; a late write after a fence can still land (the protocol's fence holds, the NIC's does not)");
                kind = AccessKind::REGION;
            }
        }
        let rails = devs.len();
        // Rail affinity (SPEC §9.2, striping): which NICs share the KV memory's NUMA node.
        let memory_node = regs.first().and_then(|r| r.numa_node());
        let device_nodes: Vec<Option<u32>> = devs
            .iter()
            .map(|d| crate::host::device_numa_node(std::path::Path::new("/"), &d.name))
            .collect();
        let near_rails = near_rails(memory_node, &device_nodes);
        if near_rails.contains(&true) && near_rails.contains(&false) {
            tracing::info!(?memory_node, ?device_nodes,
                "reservations keep to the rails on the KV memory's NUMA node while one of them is up");
        }
        Self {
            lanes,
            lane_of: LaneMap::default(),
            next_lane: 0,
            devs,
            regs,
            pool,
            page_bytes,
            kind,
            bound: BTreeMap::new(),
            binding: BTreeMap::new(),
            bind_wrs: BTreeMap::new(),
            stripe_pages: DEFAULT_STRIPE_PAGES,
            near_rails,
            rail_affinity: true,
            spare: (0..rails).map(|_| Vec::new()).collect(),
            fencing: BTreeMap::new(),
            next_fence: 1,
            fence_wrs: BTreeMap::new(),
            defer_fence: BTreeMap::new(),
            next_wr: 1,
            events: VecDeque::new(),
            closed: false,
            lane_timeout: super::DEFAULT_LANE_TIMEOUT,
            heartbeat: Duration::from_millis(250),
            stats: RdmaReceiverStats::default(),
        }
    }

    /// Test-only fault: this end stops posting receives again once its queue pairs' posted
    /// ones are used (a peer process that keeps sending, its heartbeats included, but reads
    /// none of its completions). The other end's SENDs, and the WRITEs it posts after them,
    /// then wait in receiver-not-ready retries.
    #[doc(hidden)]
    pub fn stop_reposting_receives(&mut self) {
        for l in &mut self.lanes.lanes {
            l.link.stop_reposting_receives();
        }
    }

    /// Test-only fault: lane `lane`'s queue pair goes to the error state, as when its
    /// rail's link or port fails (SPEC §9.2, several rails).
    #[doc(hidden)]
    pub fn inject_lane_failure(&mut self, lane: usize) -> Result<(), super::RdmaError> {
        self.lanes.lanes[lane].link.force_error()
    }

    /// Lanes still alive (their queue pair has not failed).
    pub fn live_lanes(&self) -> usize {
        self.lanes.live()
    }

    /// Receives posted on every lane and not yet taken by a SEND of the peer.
    #[doc(hidden)]
    pub fn receives_posted(&self) -> usize {
        self.lanes
            .lanes
            .iter()
            .map(|l| l.link.receives_posted())
            .sum()
    }

    /// Control frames queued on every lane and not yet posted (waiting for a send slot or
    /// for the next poll).
    pub fn frames_unsent(&self) -> usize {
        self.lanes.lanes.iter().map(|l| l.unsent()).sum()
    }

    /// How access is scoped on this device.
    pub fn access_kind(&self) -> AccessKind {
        self.kind
    }

    /// The local ACK timeout exponent (`TransportConfig::Rdma::ack_timeout`) each queue pair
    /// of this connection holds, as the device reports it (`ibv_query_qp`), in lane order.
    pub fn ack_timeouts(&self) -> Result<Vec<u8>, super::RdmaError> {
        self.lanes.ack_timeouts()
    }

    /// How long a lane's SENDs may make no progress while another lane's do before the
    /// lane is taken as failed (SPEC §9.2, a lane that fails); the engine sets half its
    /// liveness timeout, so a lane is given up before the peer would be.
    pub fn set_lane_timeout(&mut self, timeout: std::time::Duration) {
        self.lane_timeout = timeout;
    }

    /// The heartbeat interval (the engine's liveness interval), which bounds how long a
    /// striped reservation moved off a failed lane keeps its windows on the live lanes before
    /// its fence invalidates them (SPEC §9.2, striping): as long as the peer's stall rule can
    /// lag this end's in seeing the lane fail. Two intervals when this end saw it by the
    /// stall rule too; the lane timeout and two intervals when it saw it at once (its own
    /// queue pair failed), the peer assumed to run the same liveness settings.
    pub fn set_heartbeat_interval(&mut self, interval: Duration) {
        self.heartbeat = interval;
    }

    /// Pages per stripe below which a reservation is not striped over one more lane
    /// (`TransportConfig::Rdma::stripe_pages`; 0: never striped): a reservation of `P` pages
    /// takes `min(P / stripe_pages, live lanes)` lanes, each rail once before any twice (SPEC
    /// §9.2, striping a transfer over lanes).
    pub fn set_stripe_pages(&mut self, pages: u32) {
        self.stripe_pages = pages;
    }

    /// Whether reservations keep to the rails whose NIC is on the KV memory's NUMA node
    /// while one of them is up (`TransportConfig::Rdma::rail_affinity`; on by default; no
    /// effect where the topology is unknown or every rail is on that node).
    pub fn set_rail_affinity(&mut self, on: bool) {
        self.rail_affinity = on;
    }

    /// Per rail, whether its NIC is on the KV memory's NUMA node (all false where either is
    /// unknown).
    pub fn near_rails(&self) -> &[bool] {
        &self.near_rails
    }

    /// Counters.
    pub fn stats(&self) -> RdmaReceiverStats {
        self.stats
    }

    /// Overwrites every buffer of `pages` with a fresh pattern from the operating system's
    /// random source (64 bytes, repeated), unknown to the peer.
    fn scrub(&mut self, pages: &[u32]) -> Result<(), String> {
        let mut pattern = [0u8; 64];
        getrandom::getrandom(&mut pattern)
            .map_err(|e| format!("no random source for the coverage scrub: {e}"))?;
        for &page in pages {
            for b in 0..self.page_bytes.len() {
                let mut bytes = self.pool.raw_page_mut(page, b).ok_or_else(|| {
                    format!("page {page} is in use: it cannot be scrubbed for a reservation")
                })?;
                for chunk in bytes.chunks_mut(pattern.len()) {
                    chunk.copy_from_slice(&pattern[..chunk.len()]);
                }
            }
        }
        self.stats.pages_scrubbed += pages.len() as u64;
        Ok(())
    }

    /// Binds one window per run of `pages` and per buffer on `lane` (its rail's device and
    /// registration) behind one doorbell, the last bind signaled with `signal` when given
    /// (else unsignaled: the RESERVE posted after them on the same queue pair cannot be
    /// executed before them; a bind that fails completes in error and breaks the link); the
    /// runs, naming `lane` when `striped`. Invalidated windows are bound again before new ones
    /// are allocated. Region rkeys (no memory windows) bind nothing.
    fn bind(
        &mut self,
        lane: usize,
        pages: &[u32],
        striped: bool,
        signal: Option<u64>,
        windows: &mut Vec<MemoryWindow>,
    ) -> Result<Vec<AccessRun>, String> {
        let runs = page_runs(pages);
        let b = self.page_bytes.len();
        let rail = self.lanes.lanes[lane].rail;
        let lane_id = striped.then_some(lane as u16);
        if self.kind == AccessKind::REGION {
            return Ok(runs
                .into_iter()
                .map(|(first, n)| AccessRun {
                    first_page: first,
                    pages: n,
                    lane: lane_id,
                    rkeys: (0..b).map(|i| self.regs[rail].rkey(i)).collect(),
                })
                .collect());
        }
        let mut ranges = Vec::with_capacity(runs.len() * b);
        let mark = windows.len();
        for &(first, n) in &runs {
            for (i, &bytes) in self.page_bytes.iter().enumerate() {
                let w = match self.spare[rail].pop() {
                    Some(w) => {
                        self.stats.windows_reused += 1;
                        w
                    }
                    None => self.devs[rail].alloc_window().map_err(|e| e.to_string())?,
                };
                windows.push(w);
                ranges.push((
                    i,
                    u64::from(first) * u64::from(bytes),
                    u64::from(n) * u64::from(bytes),
                ));
            }
        }
        let mine = &mut windows[mark..];
        self.lanes.lanes[lane]
            .link
            .bind_windows(mine, &self.regs[rail], &ranges, signal)
            .map_err(|e| e.to_string())?;
        self.stats.binds += mine.len() as u64;
        Ok(runs
            .into_iter()
            .enumerate()
            .map(|(r, (first, n))| AccessRun {
                first_page: first,
                pages: n,
                lane: lane_id,
                rkeys: mine[r * b..(r + 1) * b].iter().map(|w| w.rkey).collect(),
            })
            .collect())
    }

    /// The transfers with a scope, a fence or a bind on lane `i` (open scopes, fences in
    /// progress, and the transfers the lane carries frames for).
    fn on_lane(&self, i: usize) -> Vec<TransferId> {
        let mut ids = self.lane_of.on_lane(i);
        ids.extend(
            self.bound
                .iter()
                .filter(|(_, stripes)| stripes.iter().any(|s| s.lane == i))
                .map(|(id, _)| *id),
        );
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Lane `i`'s queue pair failed. With other lanes alive the connection goes on without
    /// it (SPEC §9.2, several rails): its queue pair is reset (nothing more lands through
    /// it, none of its work requests uses a window any more), the windows bound through it are
    /// deallocated, a fence's invalidations there count as done, its unsent frames move to a
    /// live lane, and the transfers it carries or stripes are reported lost. Their windows on
    /// live lanes stay bound until their fence, which waits for the peer's stall rule: a sender that
    /// has not yet seen the lane fail may still write those stripes, and a write into an
    /// invalidated window would fail its lane too (SPEC §9.2, striping). The last live lane's
    /// failure is the connection's.
    fn lose_lane(&mut self, i: usize, why: String, by_stall: bool) {
        if self.closed {
            return;
        }
        match self.lanes.lose_one(i, &why) {
            LaneLoss::AlreadyDead => return,
            LaneLoss::Last => return self.fail(Closed::LinkFailed(why)),
            LaneLoss::Lost => {}
        }
        let now = Instant::now();
        let ids = self.on_lane(i);
        // A RESERVE of a lost transfer not posted yet (queued on the failed lane and moved to
        // a live one, or waiting for a send slot) is never sent: its access names windows
        // that are gone, and the move reserves again.
        self.lanes
            .drop_unsent(|f| matches!(f, Frame::Reserve(r) if ids.contains(&r.transfer_id)));
        for id in &ids {
            // A RESERVE still waiting for its binds is never sent either: no peer saw the
            // reservation's windows, so their fence need not wait.
            let unseen = self.binding.remove(id).is_some();
            if let Some(stripes) = self.bound.get_mut(id) {
                // Deallocating a window invalidates it (its queue pair is reset: no bind
                // of it is pending any more).
                for s in stripes.iter_mut().filter(|s| s.lane == i) {
                    s.windows.clear();
                }
                if !unseen && stripes.iter().any(|s| !s.windows.is_empty()) {
                    // The peer may not have seen the lane fail yet, and may still write the
                    // live stripes: it has until it can have, by its stall rule.
                    let grace = if by_stall {
                        2 * self.heartbeat
                    } else {
                        self.lane_timeout + 2 * self.heartbeat
                    };
                    self.defer_fence.insert(*id, now + grace);
                }
            }
        }
        self.bind_wrs.retain(|_, tid| !ids.contains(tid));
        let mut done = Vec::new();
        for (&key, f) in self.fencing.iter_mut() {
            for s in f.stripes.iter_mut().filter(|s| s.lane == i) {
                s.windows.clear();
                if let Some(wr) = s.invalidating.take() {
                    self.fence_wrs.remove(&wr);
                    f.remaining -= 1;
                }
            }
            if f.remaining == 0 && f.post_at.is_none() {
                done.push(key);
            }
        }
        for key in done {
            self.complete_fence(key, now);
        }
        for id in ids {
            self.events.push_back(TransportEvent::TransferLost(id));
        }
    }

    /// A queue pair failed (or the peer is gone): every lane is reset (no remote access
    /// through them after this) and every window deallocated (the fence of every open
    /// reservation); fences in progress complete, then the end of the connection.
    fn fail(&mut self, why: Closed) {
        if self.closed {
            return;
        }
        self.closed = true;
        if matches!(why, Closed::LinkFailed(_)) {
            self.stats.link_failures += 1;
        }
        self.lanes.reset();
        // Deallocating a window invalidates it: no write through it can land any more.
        self.bound.clear();
        self.binding.clear();
        self.bind_wrs.clear();
        self.defer_fence.clear();
        for spare in &mut self.spare {
            spare.clear();
        }
        self.fence_wrs.clear();
        for (_, f) in std::mem::take(&mut self.fencing) {
            drop(f.stripes);
            if let Some(t) = f.transfer {
                self.events.push_back(TransportEvent::Fenced(t));
            }
        }
        self.events.push_back(TransportEvent::Closed(why));
    }
}

impl Transport for RdmaReceiver {
    fn send_frame(&mut self, _now: Instant, frame: &Frame) {
        if self.closed {
            return;
        }
        if let Frame::Reserve(r) = frame {
            if let Some(b) = self.binding.get_mut(&r.transfer_id) {
                // Its windows on other lanes are not valid yet: it goes when they are.
                b.reserve = Some(frame.clone());
                return;
            }
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

    fn striped_reservations(&self) -> u64 {
        self.stats.striped
    }

    fn moves_transfers(&self) -> bool {
        self.lanes.lanes.len() > 1
    }

    fn poll_timeout(&self) -> Option<Instant> {
        if self.closed {
            return None;
        }
        let deferred = self.fencing.values().filter_map(|f| f.post_at).min();
        match (self.lanes.next_stall_check(self.lane_timeout), deferred) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn poll_event(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<TransportEvent> {
        loop {
            if let Some(e) = self.events.pop_front() {
                return Poll::Ready(e);
            }
            if self.closed {
                return Poll::Pending;
            }
            if let Some((i, why)) = self.lanes.stalled_lane(Instant::now(), self.lane_timeout) {
                self.lose_lane(i, why, true);
                continue;
            }
            // Deferred fences whose time has come (SPEC §9.2, striping).
            let due: Vec<u64> = self
                .fencing
                .iter()
                .filter(|(_, f)| f.post_at.is_some_and(|t| t <= now))
                .map(|(k, _)| *k)
                .collect();
            if !due.is_empty() {
                for key in due {
                    self.post_fence(key, now);
                }
                continue;
            }
            let mut fenced: Vec<(u64, u64)> = Vec::new();
            let mut bound: Vec<TransferId> = Vec::new();
            let mut frames: Vec<Frame> = Vec::new();
            let (fence_wrs, bind_wrs) = (&mut self.fence_wrs, &mut self.bind_wrs);
            let pass = self.lanes.poll_pass(cx, |_, i, e| match e {
                LaneEvent::Frame(f) => {
                    frames.push(f);
                    None
                }
                LaneEvent::LocalDone { ok: false, .. } => Some(Closed::LinkFailed(format!(
                    "a memory window bind or invalidation on lane {i} failed"
                ))),
                LaneEvent::LocalDone { wr_id, ok: true } => {
                    // An invalidation of a fence, or the binds of a stripe (a reservation's
                    // binds on its own lane need nothing).
                    if let Some(key) = fence_wrs.remove(&wr_id) {
                        fenced.push((key, wr_id));
                    } else if let Some(tid) = bind_wrs.remove(&wr_id) {
                        bound.push(tid);
                    }
                    None
                }
                LaneEvent::WriteDone { .. } => None,
            });
            for (key, wr) in fenced {
                let done = self.fencing.get_mut(&key).is_some_and(|f| {
                    for s in &mut f.stripes {
                        if s.invalidating == Some(wr) {
                            s.invalidating = None;
                        }
                    }
                    f.remaining -= 1;
                    f.remaining == 0
                });
                if done {
                    self.complete_fence(key, now);
                }
            }
            // Frames before the failures of this pass (a COMMIT that came before its lane
            // failed is verified), and the failures before the RESERVEs whose binds completed
            // in it (one whose lane failed is not sent: its transfer is lost and moves).
            let committed: Vec<TransferId> = frames
                .iter()
                .filter_map(|f| match f {
                    Frame::Commit(c) => Some(c.transfer.transfer_id),
                    _ => None,
                })
                .collect();
            self.events
                .extend(frames.into_iter().map(TransportEvent::Frame));
            let failed = self.lanes.take_failed();
            if failed.len() < self.lanes.live() {
                for (i, why) in failed {
                    self.lose_lane(i, why, false);
                }
            } else if let Some((_, why)) = failed.into_iter().next() {
                // Every live lane failed: the connection's end.
                self.fail(Closed::LinkFailed(why));
            }
            // A COMMIT is sent after every write of its reservation completed: nothing of it
            // is left to land, and its fence need not wait.
            for id in committed {
                self.defer_fence.remove(&id);
            }
            for tid in bound {
                let ready = self.binding.get_mut(&tid).is_some_and(|b| {
                    b.remaining -= 1;
                    b.remaining == 0
                });
                if ready {
                    // Every stripe's windows are valid: the RESERVE goes (if the session has
                    // sent it yet; else send_frame posts it directly).
                    if let Some(reserve) = self.binding.remove(&tid).and_then(|b| b.reserve) {
                        self.send_frame(now, &reserve);
                    }
                }
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

impl ReceiverTransport for RdmaReceiver {
    fn open_scope(
        &mut self,
        transfer_id: TransferId,
        pages: &[u32],
    ) -> Result<Vec<u8>, ScopeError> {
        if self.closed {
            return Err(ScopeError("the link is down".into()));
        }
        if self.bound.contains_key(&transfer_id) || self.binding.contains_key(&transfer_id) {
            // A second scope would replace the open one's windows while their binds may still
            // execute (the driver refuses a duplicate reservation before this).
            return Err(ScopeError(format!(
                "transfer {} already has an open scope",
                transfer_id.0
            )));
        }
        // Coverage (SPEC §9.2): before any peer can write the pages, overwrite them with a
        // pattern only this receiver knows. A page the sender never wrote keeps it, so its
        // landed digest cannot match a COMMIT computed over anything the sender had, not
        // even over the page's stale contents.
        self.scrub(pages).map_err(ScopeError)?;
        // The live lanes in turn from the next one (a dead lane takes no reservation), those
        // of the rails near the KV memory while one lives; the reservation's own lane is the
        // first, its stripes (if any) the next, each rail once before any twice.
        let n = self.lanes.lanes.len();
        let mut live: Vec<(usize, usize)> = (0..n)
            .map(|k| (self.next_lane + k) % n)
            .filter(|&l| !self.lanes.lanes[l].dead)
            .map(|l| (l, self.lanes.lanes[l].rail))
            .collect();
        if self.rail_affinity {
            live = prefer_near_rails(&live, &self.near_rails);
        }
        let plan = plan_stripes(pages, &live, self.stripe_pages);
        let Some(&(lane, _)) = plan.first() else {
            return Err(ScopeError("every lane is down".into()));
        };
        let striped = plan.len() > 1;
        let b = self.page_bytes.len();
        let runs: usize = plan.iter().map(|(_, p)| page_runs(p).len()).sum();
        if encoded_len(b, runs, striped) > MAX_ACCESS {
            return Err(ScopeError(format!(
                "{runs} runs of pages do not fit one access descriptor"
            )));
        }
        // On failure no peer ever saw the rkeys of the windows bound so far; those whose binds
        // were posted are kept until the connection ends (a posted bind must find its window).
        let mut stripes: Vec<Stripe> = Vec::with_capacity(plan.len());
        let mut all_runs: Vec<AccessRun> = Vec::with_capacity(runs);
        let mut signals: Vec<u64> = Vec::new();
        for (k, (l, p)) in plan.iter().enumerate() {
            // The binds on other lanes than the RESERVE's are awaited before it is posted.
            let signal = (k > 0 && self.kind == AccessKind::WINDOWS).then(|| {
                let id = self.next_wr;
                self.next_wr += 1;
                id
            });
            let mut windows = Vec::new();
            match self.bind(*l, p, striped, signal, &mut windows) {
                Ok(runs) => all_runs.extend(runs),
                Err(e) => {
                    // This lane's windows were never posted (dropping deallocates them); the
                    // other lanes' binds were: their windows are invalidated behind them
                    // before they are reused or deallocated.
                    self.start_fence(None, stripes, None, Instant::now());
                    return Err(ScopeError(e));
                }
            }
            stripes.push(Stripe {
                lane: *l,
                rail: self.lanes.lanes[*l].rail,
                windows,
                invalidating: None,
            });
            signals.extend(signal);
        }
        all_runs.sort_unstable_by_key(|r| r.first_page);
        let base = (0..b)
            .map(|i| self.regs[self.lanes.lanes[lane].rail].addr(i, 0))
            .collect();
        let encoded = AccessDescriptor {
            kind: self.kind.striped(striped),
            base,
            runs: all_runs,
        }
        .encode();
        let access = match encoded {
            Ok(a) => a,
            Err(e) => {
                self.start_fence(None, stripes, None, Instant::now());
                return Err(ScopeError(e.to_string()));
            }
        };
        if self.kind == AccessKind::REGION {
            self.stats.region_fallbacks += 1;
        }
        if striped {
            self.stats.striped += 1;
            self.stats.striped_lanes += plan.len() as u64;
        }
        if !signals.is_empty() {
            for &id in &signals {
                self.bind_wrs.insert(id, transfer_id);
            }
            self.binding.insert(
                transfer_id,
                Binding {
                    remaining: signals.len(),
                    reserve: None,
                },
            );
        }
        self.next_lane = lane.wrapping_add(1);
        self.lane_of.set(transfer_id, lane);
        self.bound.insert(transfer_id, stripes);
        Ok(access)
    }

    fn bind_scope(&mut self, _transfer: TransferRef) {}

    fn abandon_scope(&mut self, transfer_id: TransferId) {
        self.forget_binds(transfer_id);
        self.defer_fence.remove(&transfer_id);
        if let Some(stripes) = self.bound.remove(&transfer_id) {
            // Its binds may still be executing: its windows are invalidated behind them
            // (nobody waits for it) before they are reused or deallocated.
            if !self.closed {
                self.start_fence(None, stripes, None, Instant::now());
            }
        }
    }

    fn open_scopes(&self) -> usize {
        self.bound.len()
    }

    fn fence(&mut self, transfer: TransferRef) -> Fence {
        let id = transfer.transfer_id;
        self.forget_binds(id);
        let now = Instant::now();
        let post_at = self.defer_fence.remove(&id).filter(|&t| t > now);
        let stripes: Vec<Stripe> = self
            .bound
            .remove(&id)
            .unwrap_or_default()
            .into_iter()
            .filter(|s| !s.windows.is_empty())
            .collect();
        if stripes.is_empty() || self.closed {
            // Region rkeys (no windows: only the protocol's fence), or a link already reset
            // (or a lane failed) with every window deallocated.
            return Fence::Done;
        }
        self.start_fence(Some(transfer), stripes, post_at, now);
        Fence::Pending
    }
}
