//! The protocol's endpoints over RC queue pairs: [`RdmaSender`] and [`RdmaReceiver`].
//!
//! Both are synchronous and polled: call `poll(now)` whenever there may be work (it posts
//! what the endpoint queued and takes what the completion queue holds; it never blocks).
//! Each queue pair's completion queue has exactly one poller (its driver). A connection has
//! one or more queue pairs ("lanes", SPEC.md §9.2); everything of one transfer travels on its
//! lane: the receiver's memory-window binds, then its RESERVE (a SEND); the sender's WRITEs,
//! then its COMMIT (a SEND), so RC ordering puts the commit after the data it describes and
//! the reservation after the windows it names. Reservations take the lanes in turn.
//!
//! **Per-reservation scope.** The receiver binds one type-2 memory window per run of
//! consecutive reserved pages and per buffer, and RESERVE carries their rkeys
//! ([`descriptor`](super::descriptor)). The fence invalidates them; only when every
//! invalidation has completed does the endpoint verify or release the pages. Devices
//! without memory windows fall back to the region's rkeys, with a warning and a counter.
//!
//! **Failure.** A write with an invalidated rkey fails at the NIC (a remote access error)
//! and puts both queue pairs in the error state. Every transfer of that link then fails with
//! [`FailureReason::PeerLost`](kvwire_proto::FailureReason::PeerLost), which is
//! [retryable](kvwire_proto::FailureReason::is_retryable); no page is released until no
//! work request can touch it any more (the queue pair is reset and every window
//! deallocated). `recover` rebuilds the queue pair and the session over the same memory;
//! reconnect both ends with each other's new [`QpParams`] and go on.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_proto::auth::{AuthChannel, Opener, Sealer};
use kvwire_proto::handshake::Established;
use kvwire_proto::receiver::ReceiverConfig;
use kvwire_proto::sender::{SenderConfig, SenderEvent};
use kvwire_proto::wire::{Frame, TransferRef};

use super::descriptor::{encoded_len, page_runs, AccessDescriptor, AccessKind, AccessRun};
use super::verbs::{
    MemoryWindow, QpParams, RcLink, RdmaDevice, RdmaError, RdmaEvent, RdmaWrite, RegisteredMemory,
};
use crate::config::{ConfigError, EngineConfig};
use crate::memory::PagePool;
use crate::receiver::{
    FenceCompletion, ReceiveError, ReceiveOutcome, ReceiverEndpoint, ReserveParams,
};
use crate::sender::SenderEndpoint;

/// Pages per signaled write: the last write of every `SIGNAL_EVERY`th page (and of every
/// posting round) asks for a completion; RC completes in order, so it covers the others.
pub const SIGNAL_EVERY: u32 = 16;

/// Why a driver could not be built or went wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// A verbs call failed.
    #[error(transparent)]
    Rdma(#[from] RdmaError),
    /// The endpoint refused to start.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// Where a link stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkState {
    /// Working.
    Up,
    /// The queue pair failed; its transfers were failed (retryable). Call `recover`.
    Broken,
}

/// Counters of an [`RdmaSender`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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

/// A transfer's access descriptor as received (compared by pointer) and as decoded
/// (`Err` if it was refused).
type CachedDescriptor = (TransferRef, Arc<[u8]>, Result<Arc<AccessDescriptor>, ()>);

/// Test-only fault knobs of an [`RdmaSender`]: a buggy or lying sender.
#[doc(hidden)]
#[derive(Default)]
pub struct SenderFaults {
    /// Rewrites (or drops, with `None`) each outgoing frame.
    pub rewrite_frame: Option<FrameRewrite>,
    /// Page writes for which this returns true are never posted but reported complete.
    pub skip_write: Option<WriteFilter>,
}

/// Rewrites or drops an outgoing frame (a [`SenderFaults`] knob).
#[doc(hidden)]
pub type FrameRewrite = Box<dyn FnMut(Frame) -> Option<Frame> + Send>;

/// Picks page writes to skip (a [`SenderFaults`] knob).
#[doc(hidden)]
pub type WriteFilter = Box<dyn FnMut(&kvwire_proto::sender::PageWrite) -> bool + Send>;

struct Signaled {
    lane: usize,
    transfer: TransferRef,
    pages: u32,
    wrs: u32,
}

/// One queue pair of a connection and what travels on it: its frames' outbox and its lane
/// of the connection's authentication channel (SPEC.md §3.11.1).
struct Lane {
    link: RcLink,
    outbox: VecDeque<Vec<u8>>,
    sealer: Option<Sealer>,
    opener: Option<Opener>,
    /// Sender: send-queue work requests posted and not yet retired by a completion.
    wrs_in_flight: u32,
}

impl Lane {
    fn new(link: RcLink) -> Self {
        Self {
            link,
            outbox: VecDeque::new(),
            sealer: None,
            opener: None,
            wrs_in_flight: 0,
        }
    }

    /// Seals (authenticates, when the connection is) and queues a frame for a SEND.
    fn queue(&mut self, frame: &Frame) {
        let r = match &mut self.sealer {
            Some(s) => s.seal_to_vec(frame),
            None => frame.to_bytes(),
        };
        match r {
            Ok(b) => self.outbox.push_back(b),
            Err(e) => tracing::error!(error = %e, "frame could not be encoded; dropped"),
        }
    }

    /// Opens (checks the tag of, when authenticated) and decodes a received SEND. `None`:
    /// the connection must close (not a frame, or not authentic).
    fn open(&mut self, bytes: &[u8]) -> Option<Frame> {
        let r = match &mut self.opener {
            Some(o) => o.open(bytes).map_err(|e| format!("{e:?}")),
            None => Frame::decode(bytes).map_err(|e| format!("{e:?}")),
        };
        match r {
            Ok((f, _)) => Some(f),
            Err(e) => {
                tracing::error!(error = %e, "a received frame is not a frame or not authentic: closing the link");
                None
            }
        }
    }

    /// Posts queued frames while send slots are free.
    fn flush(&mut self) -> Result<(), RdmaError> {
        while let Some(f) = self.outbox.front() {
            match self.link.post_frame(f) {
                Ok(()) => {
                    self.outbox.pop_front();
                }
                Err(RdmaError::SendSlotsBusy) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Sets each lane's authentication from the connection's channel.
fn set_lane_auth(lanes: &mut [Lane], channel: AuthChannel) {
    let n = lanes.len() as u16;
    for (lane, c) in lanes.iter_mut().zip(channel.lanes(n)) {
        let (s, o) = c.split();
        lane.sealer = Some(s);
        lane.opener = Some(o);
    }
}

fn params_of(lanes: &[Lane]) -> Vec<QpParams> {
    lanes.iter().map(|l| l.link.params()).collect()
}

fn connect_lanes(lanes: &mut [Lane], peer: &[QpParams]) -> Result<(), RdmaError> {
    if peer.len() != lanes.len() {
        return Err(RdmaError::Lanes {
            local: lanes.len(),
            peer: peer.len(),
        });
    }
    for (l, p) in lanes.iter_mut().zip(peer) {
        l.link.connect(p)?;
    }
    Ok(())
}

/// Resets every lane's queue pair (after which none of its work requests touches memory).
fn reset_lanes(lanes: &mut [Lane]) {
    for l in lanes {
        if let Err(e) = l.link.recover() {
            tracing::error!(error = %e, "queue pair reset failed");
        }
        l.outbox.clear();
        l.wrs_in_flight = 0;
    }
}

/// Remembers which lane each live transfer uses (bounded: the oldest entries go first).
#[derive(Default)]
struct LaneMap(BTreeMap<u64, usize>);

impl LaneMap {
    fn set(&mut self, transfer_id: u64, lane: usize) {
        if self.0.len() >= 65_536 {
            self.0.pop_first();
        }
        self.0.insert(transfer_id, lane);
    }

    fn get(&self, transfer_id: u64) -> usize {
        self.0.get(&transfer_id).copied().unwrap_or(0)
    }

    /// The lane of a frame: its transfer's, or lane 0 for a frame of no live transfer.
    fn of(&self, f: &Frame) -> usize {
        f.transfer().map_or(0, |t| self.get(t.transfer_id))
    }
}

/// The sender's side of an RDMA connection: the [`SenderEndpoint`] and its source memory,
/// over one or more RC queue pairs (lanes).
pub struct RdmaSender {
    endpoint: Option<SenderEndpoint>,
    lanes: Vec<Lane>,
    lane_of: LaneMap,
    reg: RegisteredMemory,
    page_bytes: Vec<u32>,
    max_wrs: u32,
    inflight: BTreeMap<u64, Signaled>,
    next_wr: u64,
    descriptors: VecDeque<CachedDescriptor>,
    carried: VecDeque<SenderEvent>,
    state: LinkState,
    window: u32,
    engine: EngineConfig,
    config: SenderConfig,
    stats: RdmaSenderStats,
    faults: SenderFaults,
}

impl std::fmt::Debug for RdmaSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaSender")
            .field("state", &self.state)
            .field("lanes", &self.lanes.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// Send-queue work requests an [`RdmaSender`] needs per queue pair for `window` pages of
/// `buffers` buffers per transfer in flight (the `max_send` of each of its [`RcLink`]s).
pub fn sender_queue_depth(window: u32, buffers: usize) -> u32 {
    (4 * window.max(1) * buffers as u32).clamp(64, 4096)
}

/// Send-queue depth of each of an [`RdmaReceiver`]'s queue pairs (binds, invalidations,
/// frames).
pub const RECEIVER_QUEUE_DEPTH: u32 = 4096;

impl RdmaSender {
    /// Registers the pool's memory on `dev` and creates one queue pair (in INIT; connect it
    /// with [`RdmaSender::connect`]). `window` bounds the pages of one transfer in flight.
    pub fn new(
        dev: &RdmaDevice,
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: SenderConfig,
        window: u32,
    ) -> Result<Self, DriverError> {
        Self::with_queue_pairs(1, dev, established, pool, engine, config, window)
    }

    /// [`RdmaSender::new`] with `n` queue pairs (lanes, at least 1): each transfer travels on
    /// the lane its reservation arrived on.
    pub fn with_queue_pairs(
        n: usize,
        dev: &RdmaDevice,
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: SenderConfig,
        window: u32,
    ) -> Result<Self, DriverError> {
        let depth = sender_queue_depth(window, pool.buffers());
        let links = (0..n.max(1))
            .map(|_| RcLink::new(dev, depth))
            .collect::<Result<Vec<_>, _>>()?;
        Self::with_links(links, dev, established, pool, engine, config, window)
    }

    /// [`RdmaSender::new`] over queue pairs created before the handshake (whose parameters
    /// travelled in HELLO), each made with [`sender_queue_depth`].
    pub fn with_links(
        links: Vec<RcLink>,
        dev: &RdmaDevice,
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: SenderConfig,
        window: u32,
    ) -> Result<Self, DriverError> {
        if links.is_empty() {
            return Err(DriverError::Rdma(RdmaError::Lanes { local: 0, peer: 0 }));
        }
        let page_bytes = pool.geometry().buffer_page_bytes.clone();
        let reg = dev.register(pool.memory())?;
        let window = window.max(1);
        let max_wrs = sender_queue_depth(window, page_bytes.len());
        let endpoint = SenderEndpoint::new(established, pool, engine, config.clone(), window)?;
        Ok(Self {
            endpoint: Some(endpoint),
            lanes: links.into_iter().map(Lane::new).collect(),
            lane_of: LaneMap::default(),
            reg,
            page_bytes,
            max_wrs,
            inflight: BTreeMap::new(),
            next_wr: 1,
            descriptors: VecDeque::new(),
            carried: VecDeque::new(),
            state: LinkState::Up,
            window,
            engine: engine.clone(),
            config,
            stats: RdmaSenderStats::default(),
            faults: SenderFaults::default(),
        })
    }

    /// Authenticates the control frames carried as SENDs with the connection's channel from
    /// the handshake, one lane per queue pair (SPEC.md §3.11); without it they travel
    /// unauthenticated.
    pub fn set_auth(&mut self, channel: AuthChannel) {
        set_lane_auth(&mut self.lanes, channel);
    }

    /// The peer is gone (its bootstrap connection closed, its process died): the queue pairs
    /// are reset and every transfer fails with a retryable reason, as on a link failure.
    pub fn handle_peer_lost(&mut self, now: Instant) {
        self.fail_link(now);
    }

    /// The page pool, after [`Self::handle_peer_lost`] (or a broken link): to serve the next
    /// connection over the same memory.
    pub fn into_pool(mut self) -> PagePool {
        self.endpoint.take().expect("endpoint").into_pool()
    }

    /// This side's queue pair parameters, lane 0 first, for the peer.
    pub fn params(&self) -> Vec<QpParams> {
        params_of(&self.lanes)
    }

    /// Connects lane `i` to the receiver's lane `i` (the counts must match).
    pub fn connect(&mut self, peer: &[QpParams]) -> Result<(), RdmaError> {
        connect_lanes(&mut self.lanes, peer)
    }

    /// The endpoint (admit, submit, abort).
    pub fn endpoint(&mut self) -> &mut SenderEndpoint {
        self.endpoint
            .as_mut()
            .expect("endpoint present outside recover")
    }

    /// The next event (verified or failed transfer), including those of a connection
    /// replaced by [`RdmaSender::recover`].
    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.carried
            .pop_front()
            .or_else(|| self.endpoint().poll_event())
    }

    /// Whether the link works.
    pub fn state(&self) -> LinkState {
        self.state
    }

    /// Counters.
    pub fn stats(&self) -> RdmaSenderStats {
        self.stats
    }

    /// Does all pending work once: frames out, writes posted, completions and frames in,
    /// timers. Returns whether anything happened.
    pub fn poll(&mut self, now: Instant) -> Result<bool, RdmaError> {
        if self.state == LinkState::Broken {
            return Ok(false);
        }
        let mut progress = false;
        let ep = self.endpoint.as_mut().expect("endpoint");
        if ep.poll_timeout().is_some_and(|t| t <= now) {
            ep.handle_timeout(now);
            progress = true;
        }
        progress |= self.post(now);
        let mut broken = false;
        let mut events = Vec::new();
        for lane in 0..self.lanes.len() {
            events.clear();
            if let Err(e) = self.lanes[lane].link.poll(&mut events) {
                tracing::error!(error = %e, lane, "rdma poll");
                broken = true;
                break;
            }
            progress |= !events.is_empty();
            for e in events.drain(..) {
                match e {
                    RdmaEvent::WriteDone { wr_id, ok } => {
                        let Some(s) = self.inflight.remove(&wr_id) else {
                            continue;
                        };
                        let l = &mut self.lanes[s.lane];
                        l.wrs_in_flight = l.wrs_in_flight.saturating_sub(s.wrs);
                        let ep = self.endpoint.as_mut().expect("endpoint");
                        for _ in 0..s.pages {
                            ep.handle_write_completion(now, s.transfer, ok);
                        }
                        broken |= !ok;
                    }
                    RdmaEvent::Frame(bytes) => match self.lanes[lane].open(&bytes) {
                        Some(f) => {
                            if let Frame::Reserve(r) = &f {
                                // The transfer's writes and COMMIT go back on this lane.
                                self.lane_of.set(r.transfer_id, lane);
                            }
                            let ep = self.endpoint.as_mut().expect("endpoint");
                            if let Err(e) = ep.handle_frame(now, f) {
                                tracing::warn!(error = ?e, "frame refused");
                            }
                        }
                        None => broken = true,
                    },
                    RdmaEvent::SendFailed(status) => {
                        tracing::error!(status, lane, "SEND failed: the queue pair is in error");
                        broken = true;
                    }
                    RdmaEvent::LocalDone { .. } => {}
                }
            }
        }
        if broken {
            self.fail_link(now);
            return Ok(true);
        }
        progress |= self.post(now);
        Ok(progress)
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
                tracing::error!(transfer_id = transfer.transfer_id, error = %e, "access descriptor refused");
            });
        if self.descriptors.len() == 256 {
            self.descriptors.pop_front();
        }
        self.descriptors
            .push_back((transfer, access.clone(), d.clone()));
        d
    }

    /// Frames out; as many queued page writes as the send queues take, behind one doorbell
    /// per lane.
    fn post(&mut self, now: Instant) -> bool {
        let mut progress = false;
        let ep = self.endpoint.as_mut().expect("endpoint");
        while let Some(mut f) = ep.poll_transmit() {
            if let Some(rewrite) = self.faults.rewrite_frame.as_mut() {
                match rewrite(f) {
                    Some(g) => f = g,
                    None => continue,
                }
            }
            let lane = self.lane_of.of(&f);
            self.lanes[lane].queue(&f);
        }
        let buffers = self.page_bytes.len() as u32;
        let n = self.lanes.len();
        let mut batches: Vec<Vec<RdmaWrite>> = vec![Vec::new(); n];
        let mut groups: Vec<Option<(TransferRef, u32)>> = vec![None; n];
        let mut refused = Vec::new();
        let mut lied = Vec::new();
        while let Some(head) = self.endpoint.as_ref().expect("endpoint").peek_write() {
            let lane = self.lane_of.get(head.transfer.transfer_id);
            // A lane whose send queue is full stops the round (writes are taken in order).
            if self.lanes[lane].wrs_in_flight + batches[lane].len() as u32 + buffers > self.max_wrs
            {
                break;
            }
            let Some(w) = self.endpoint.as_mut().expect("endpoint").poll_write() else {
                break;
            };
            progress = true;
            if self
                .faults
                .skip_write
                .as_mut()
                .is_some_and(|skip| skip(&w.write))
            {
                lied.push(w.transfer);
                continue;
            }
            let Ok(d) = self.descriptor(w.transfer, &w.access) else {
                refused.push(w.transfer);
                continue;
            };
            // Close the lane's previous transfer group with a signaled write.
            if let Some((t, k)) = groups[lane].filter(|(t, _)| *t != w.transfer) {
                self.signal(lane, &mut batches[lane], t, k);
                groups[lane] = None;
            }
            // One WRITE per buffer, straight into the batch (no allocation per page); a page
            // outside the descriptor takes its buffers back out and is refused.
            let mark = batches[lane].len();
            for (b, &bytes) in self.page_bytes.iter().enumerate() {
                match d.locate(w.write.dst_page, b, bytes) {
                    Ok((rkey, addr)) => batches[lane].push(RdmaWrite {
                        wr_id: 0,
                        local: (
                            self.reg.lkey(b),
                            self.reg
                                .addr(b, u64::from(w.write.src_page) * u64::from(bytes)),
                            bytes,
                        ),
                        remote: (rkey, addr),
                        signaled: false,
                    }),
                    Err(e) => {
                        tracing::error!(transfer_id = w.transfer.transfer_id, error = %e, "write refused");
                        batches[lane].truncate(mark);
                        break;
                    }
                }
            }
            if batches[lane].len() == mark {
                refused.push(w.transfer);
                continue;
            }
            let k = groups[lane].map_or(0, |(_, k)| k) + 1;
            groups[lane] = Some((w.transfer, k));
            if k == SIGNAL_EVERY {
                self.signal(lane, &mut batches[lane], w.transfer, k);
                groups[lane] = None;
            }
        }
        for lane in 0..n {
            if let Some((t, k)) = groups[lane] {
                self.signal(lane, &mut batches[lane], t, k);
            }
            let batch = &batches[lane];
            if batch.is_empty() {
                continue;
            }
            match self.lanes[lane].link.post_writes(batch) {
                Ok(()) => {
                    self.stats.doorbells += 1;
                    self.stats.writes_posted += batch.len() as u64;
                    self.lanes[lane].wrs_in_flight += batch.len() as u32;
                }
                Err(e) => {
                    tracing::error!(error = %e, lane, "posting writes failed");
                    // Nothing of the batch was posted: report each page failed.
                    for w in batch.iter().filter(|w| w.signaled) {
                        if let Some(s) = self.inflight.remove(&w.wr_id) {
                            let ep = self.endpoint.as_mut().expect("endpoint");
                            for _ in 0..s.pages {
                                ep.handle_write_completion(now, s.transfer, false);
                            }
                        }
                    }
                }
            }
        }
        for t in refused {
            self.stats.writes_refused += 1;
            self.endpoint().handle_write_completion(now, t, false);
        }
        for t in lied {
            self.endpoint().handle_write_completion(now, t, true);
        }
        // Frames after the writes of the same round, so a COMMIT follows its data.
        let ep = self.endpoint.as_mut().expect("endpoint");
        while let Some(f) = ep.poll_transmit() {
            let lane = self.lane_of.of(&f);
            self.lanes[lane].queue(&f);
        }
        for lane in 0..n {
            if let Err(e) = self.lanes[lane].flush() {
                tracing::error!(error = %e, lane, "posting a frame failed");
                self.fail_link(now);
                break;
            }
        }
        progress
    }

    /// Marks the last write in `batch` (of `lane`) signaled, covering `pages` pages of
    /// `transfer`.
    fn signal(&mut self, lane: usize, batch: &mut [RdmaWrite], transfer: TransferRef, pages: u32) {
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
                lane,
                transfer,
                pages,
                wrs: unsignaled_before + 1,
            },
        );
    }

    /// A queue pair failed: every lane is reset first (so none of their writes can still
    /// read the source pages), every write in flight is reported failed, and every transfer
    /// fails with a retryable reason.
    fn fail_link(&mut self, now: Instant) {
        if self.state == LinkState::Broken {
            return;
        }
        self.state = LinkState::Broken;
        self.stats.link_failures += 1;
        reset_lanes(&mut self.lanes);
        let ep = self.endpoint.as_mut().expect("endpoint");
        for (_, s) in std::mem::take(&mut self.inflight) {
            for _ in 0..s.pages {
                ep.handle_write_completion(now, s.transfer, false);
            }
        }
        ep.handle_peer_lost(now);
        while let Some(e) = ep.poll_event() {
            self.carried.push_back(e);
        }
    }

    /// After [`LinkState::Broken`] (or to replace a working link): fails what is left,
    /// rebuilds the queue pairs and starts a new session over the same source memory.
    /// Returns the new parameters; connect with the receiver's new ones.
    pub fn recover(
        &mut self,
        now: Instant,
        established: &Established,
    ) -> Result<Vec<QpParams>, DriverError> {
        self.fail_link(now);
        let pool = self.endpoint.take().expect("endpoint").into_pool();
        self.endpoint = Some(SenderEndpoint::new(
            established,
            pool,
            &self.engine,
            self.config.clone(),
            self.window,
        )?);
        self.descriptors.clear();
        self.lane_of = LaneMap::default();
        self.state = LinkState::Up;
        Ok(self.params())
    }

    /// Test-only: installs fault knobs (a buggy or lying sender).
    #[doc(hidden)]
    pub fn set_faults(&mut self, faults: SenderFaults) {
        self.faults = faults;
    }

    /// Test-only fault: posts one more write of source page 0 into the first destination
    /// page of `transfer`'s access descriptor, on its lane, whatever state the transfer is in
    /// (a sender that keeps writing after the receiver fenced). Returns that page, or `None`
    /// if no descriptor of `transfer` is known.
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
        let lane = self.lane_of.get(transfer.transfer_id);
        let id = self.next_wr;
        self.next_wr += 1;
        self.inflight.insert(
            id,
            Signaled {
                lane,
                transfer,
                pages: 0,
                wrs: 1,
            },
        );
        self.lanes[lane].wrs_in_flight += 1;
        self.lanes[lane].link.post_writes(&[RdmaWrite {
            wr_id: id,
            local: (self.reg.lkey(0), self.reg.addr(0, 0), self.page_bytes[0]),
            remote: (rkey, addr),
            signaled: true,
        }])?;
        Ok(Some(page))
    }
}

/// Counters of an [`RdmaReceiver`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RdmaReceiverStats {
    /// Memory windows bound.
    pub binds: u64,
    /// Memory windows invalidated (fences at the NIC).
    pub invalidations: u64,
    /// Reservations scoped by the region's rkeys because the device has no memory windows.
    pub region_fallbacks: u64,
    /// Total time from posting a transfer's invalidations to the last completing.
    pub fence_time: Duration,
    /// Times the link broke.
    pub link_failures: u64,
}

struct Fencing {
    transfer: TransferRef,
    remaining: usize,
    windows: Vec<MemoryWindow>,
    since: Instant,
}

/// The receiver's side of an RDMA connection: the [`ReceiverEndpoint`] over registered
/// destination memory, with memory windows per reservation, over one or more RC queue pairs
/// (lanes).
pub struct RdmaReceiver {
    endpoint: Option<ReceiverEndpoint>,
    lanes: Vec<Lane>,
    lane_of: LaneMap,
    next_lane: usize,
    dev: Arc<RdmaDevice>,
    reg: RegisteredMemory,
    page_bytes: Vec<u32>,
    kind: AccessKind,
    bound: BTreeMap<u64, Vec<MemoryWindow>>,
    fencing: BTreeMap<u64, Fencing>,
    fence_wrs: BTreeMap<u64, u64>,
    next_wr: u64,
    carried: VecDeque<ReceiveOutcome>,
    state: LinkState,
    engine: EngineConfig,
    config: ReceiverConfig,
    stats: RdmaReceiverStats,
}

impl std::fmt::Debug for RdmaReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaReceiver")
            .field("state", &self.state)
            .field("lanes", &self.lanes.len())
            .field("kind", &self.kind)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

const TAG_BIND: u64 = 1 << 40;

impl RdmaReceiver {
    /// Registers the pool's memory on `dev`, checks for memory windows (falling back to the
    /// region's rkeys with a warning) and creates one queue pair.
    pub fn new(
        dev: Arc<RdmaDevice>,
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: ReceiverConfig,
    ) -> Result<Self, DriverError> {
        Self::with_queue_pairs(1, dev, established, pool, engine, config)
    }

    /// [`RdmaReceiver::new`] with `n` queue pairs (lanes, at least 1); reservations take
    /// them in turn.
    pub fn with_queue_pairs(
        n: usize,
        dev: Arc<RdmaDevice>,
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: ReceiverConfig,
    ) -> Result<Self, DriverError> {
        let links = (0..n.max(1))
            .map(|_| RcLink::new(&dev, RECEIVER_QUEUE_DEPTH))
            .collect::<Result<Vec<_>, _>>()?;
        Self::with_links(links, dev, established, pool, engine, config)
    }

    /// [`RdmaReceiver::new`] over queue pairs created before the handshake, each made with
    /// [`RECEIVER_QUEUE_DEPTH`].
    pub fn with_links(
        links: Vec<RcLink>,
        dev: Arc<RdmaDevice>,
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: ReceiverConfig,
    ) -> Result<Self, DriverError> {
        if links.is_empty() {
            return Err(DriverError::Rdma(RdmaError::Lanes { local: 0, peer: 0 }));
        }
        let page_bytes = pool.geometry().buffer_page_bytes.clone();
        let reg = dev.register(pool.memory())?;
        let kind = match dev.alloc_window() {
            Ok(w) => {
                drop(w);
                AccessKind::WINDOWS
            }
            Err(e) => {
                tracing::warn!(device = %dev.name, error = %e,
                    "NO MEMORY WINDOWS: reservations use the region's rkeys; a late write after a fence can still land (the protocol's fence holds, the NIC's does not)");
                AccessKind::REGION
            }
        };
        let mut endpoint = ReceiverEndpoint::new(established, pool, engine, config.clone())?;
        endpoint.set_fence_completion(FenceCompletion::Transport);
        Ok(Self {
            endpoint: Some(endpoint),
            lanes: links.into_iter().map(Lane::new).collect(),
            lane_of: LaneMap::default(),
            next_lane: 0,
            dev,
            reg,
            page_bytes,
            kind,
            bound: BTreeMap::new(),
            fencing: BTreeMap::new(),
            fence_wrs: BTreeMap::new(),
            next_wr: 1,
            carried: VecDeque::new(),
            state: LinkState::Up,
            engine: engine.clone(),
            config,
            stats: RdmaReceiverStats::default(),
        })
    }

    /// Authenticates the control frames carried as SENDs with the connection's channel from
    /// the handshake, one lane per queue pair (SPEC.md §3.11); without it they travel
    /// unauthenticated.
    pub fn set_auth(&mut self, channel: AuthChannel) {
        set_lane_auth(&mut self.lanes, channel);
    }

    /// The peer is gone (its bootstrap connection closed, its process died): the queue pairs
    /// are reset, every window deallocated, and every transfer fails with a retryable reason.
    pub fn handle_peer_lost(&mut self, now: Instant) {
        self.fail_link(now);
    }

    /// The page pool, after [`Self::handle_peer_lost`] (or a broken link): to serve the next
    /// connection over the same memory.
    pub fn into_pool(mut self) -> PagePool {
        self.endpoint.take().expect("endpoint").into_pool()
    }

    /// This side's queue pair parameters, lane 0 first, for the peer.
    pub fn params(&self) -> Vec<QpParams> {
        params_of(&self.lanes)
    }

    /// Connects lane `i` to the sender's lane `i` (the counts must match).
    pub fn connect(&mut self, peer: &[QpParams]) -> Result<(), RdmaError> {
        connect_lanes(&mut self.lanes, peer)
    }

    /// How access is scoped on this device.
    pub fn access_kind(&self) -> AccessKind {
        self.kind
    }

    /// The endpoint (release verified pages, abort, inspect the pool).
    pub fn endpoint(&mut self) -> &mut ReceiverEndpoint {
        self.endpoint
            .as_mut()
            .expect("endpoint present outside recover")
    }

    /// Whether the link works.
    pub fn state(&self) -> LinkState {
        self.state
    }

    /// Counters.
    pub fn stats(&self) -> RdmaReceiverStats {
        self.stats
    }

    /// The next finished transfer, including those of a connection replaced by
    /// [`RdmaReceiver::recover`].
    pub fn poll_outcome(&mut self) -> Option<ReceiveOutcome> {
        self.carried
            .pop_front()
            .or_else(|| self.endpoint().poll_outcome())
    }

    /// Reserves pages, binds memory windows over exactly them (one per run of consecutive
    /// pages and buffer) on the next lane's queue pair, and sends RESERVE with their rkeys
    /// after the binds on that queue pair.
    pub fn reserve(&mut self, now: Instant, p: ReserveParams) -> Result<TransferRef, ReceiveError> {
        if self.state == LinkState::Broken {
            return Err(ReceiveError::Access(
                "the link is broken; recover it".into(),
            ));
        }
        let lane = self.next_lane % self.lanes.len();
        let transfer_id = p.transfer_id;
        let Self {
            endpoint,
            lanes,
            dev,
            reg,
            page_bytes,
            kind,
            next_wr,
            stats,
            ..
        } = self;
        let link = &mut lanes[lane].link;
        let mut windows = Vec::new();
        let kind = *kind;
        let r = endpoint
            .as_mut()
            .expect("endpoint")
            .reserve_with(now, p, |pages, _| {
                let runs = page_runs(pages);
                let b = page_bytes.len();
                if encoded_len(b, runs.len()) > kvwire_proto::wire::MAX_ACCESS {
                    return Err(format!(
                        "{} runs of pages do not fit one access descriptor",
                        runs.len()
                    ));
                }
                let base = (0..b).map(|i| reg.addr(i, 0)).collect();
                let mut out = Vec::with_capacity(runs.len());
                for (first, n) in runs {
                    let mut rkeys = Vec::with_capacity(b);
                    for (i, &bytes) in page_bytes.iter().enumerate() {
                        if kind == AccessKind::REGION {
                            rkeys.push(reg.rkey(i));
                            continue;
                        }
                        let mut w = dev.alloc_window().map_err(|e| e.to_string())?;
                        let id = TAG_BIND | *next_wr;
                        *next_wr += 1;
                        let rkey = link
                            .bind_window(
                                &mut w,
                                reg,
                                i,
                                u64::from(first) * u64::from(bytes),
                                u64::from(n) * u64::from(bytes),
                                id,
                            )
                            .map_err(|e| e.to_string())?;
                        stats.binds += 1;
                        rkeys.push(rkey);
                        windows.push(w);
                    }
                    out.push(AccessRun {
                        first_page: first,
                        pages: n,
                        rkeys,
                    });
                }
                AccessDescriptor {
                    kind,
                    base,
                    runs: out,
                }
                .encode()
                .map_err(|e| e.to_string())
            });
        match r {
            Ok(t) => {
                if kind == AccessKind::REGION {
                    self.stats.region_fallbacks += 1;
                }
                self.next_lane = self.next_lane.wrapping_add(1);
                self.lane_of.set(transfer_id, lane);
                self.bound.insert(t.transfer_id, windows);
                self.pump(now);
                Ok(t)
            }
            Err(e) => {
                // Windows bound for a reservation that was not made: never sent to anyone;
                // deallocating them invalidates them.
                drop(windows);
                Err(e)
            }
        }
    }

    /// Frames out and fences started.
    fn pump(&mut self, now: Instant) {
        loop {
            let ep = self.endpoint.as_mut().expect("endpoint");
            while let Some(f) = ep.poll_transmit() {
                let lane = self.lane_of.of(&f);
                self.lanes[lane].queue(&f);
            }
            let Some(t) = ep.poll_fenced() else {
                break;
            };
            let windows = self.bound.remove(&t.transfer_id).unwrap_or_default();
            if windows.is_empty() {
                // Region rkeys (no windows): only the protocol's fence.
                ep.handle_fence_complete(now, t);
                continue;
            }
            let lane = self.lane_of.get(t.transfer_id);
            let mut posted = 0;
            for w in &windows {
                let id = self.next_wr;
                self.next_wr += 1;
                match self.lanes[lane].link.invalidate(w.rkey, id) {
                    Ok(()) => {
                        self.fence_wrs.insert(id, t.transfer_id);
                        posted += 1;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, lane, "invalidate could not be posted");
                        break;
                    }
                }
            }
            self.stats.invalidations += posted as u64;
            let all = posted == windows.len();
            self.fencing.insert(
                t.transfer_id,
                Fencing {
                    transfer: t,
                    remaining: posted,
                    windows,
                    since: now,
                },
            );
            if !all {
                self.fail_link(now);
                return;
            }
        }
        for lane in 0..self.lanes.len() {
            if let Err(e) = self.lanes[lane].flush() {
                tracing::error!(error = %e, lane, "posting a frame failed");
                self.fail_link(now);
                return;
            }
        }
    }

    /// Does all pending work once. Returns whether anything happened.
    pub fn poll(&mut self, now: Instant) -> Result<bool, RdmaError> {
        if self.state == LinkState::Broken {
            return Ok(false);
        }
        let ep = self.endpoint.as_mut().expect("endpoint");
        let mut progress = false;
        if ep.poll_timeout().is_some_and(|t| t <= now) {
            ep.handle_timeout(now);
            progress = true;
        }
        self.pump(now);
        if self.state == LinkState::Broken {
            return Ok(true);
        }
        let mut broken = false;
        let mut events = Vec::new();
        for lane in 0..self.lanes.len() {
            events.clear();
            if let Err(e) = self.lanes[lane].link.poll(&mut events) {
                tracing::error!(error = %e, lane, "rdma poll");
                broken = true;
                break;
            }
            progress |= !events.is_empty();
            for e in events.drain(..) {
                match e {
                    RdmaEvent::Frame(bytes) => match self.lanes[lane].open(&bytes) {
                        Some(f) => {
                            if let Err(e) = self.endpoint().handle_frame(now, f) {
                                tracing::warn!(error = ?e, "frame refused");
                            }
                        }
                        None => broken = true,
                    },
                    RdmaEvent::LocalDone { wr_id, ok } => {
                        if !ok {
                            tracing::error!(
                                wr_id,
                                lane,
                                "memory window bind or invalidation failed"
                            );
                            broken = true;
                            continue;
                        }
                        let Some(tid) = self.fence_wrs.remove(&wr_id) else {
                            continue; // a bind
                        };
                        let done = self.fencing.get_mut(&tid).is_some_and(|f| {
                            f.remaining -= 1;
                            f.remaining == 0
                        });
                        if done {
                            if let Some(f) = self.fencing.remove(&tid) {
                                self.stats.fence_time += now.saturating_duration_since(f.since);
                                // Deallocated, not reused: rxe refuses to rebind an
                                // invalidated type-2 window (seen on rdma-core 44 / Linux 6.1).
                                drop(f.windows);
                                self.endpoint().handle_fence_complete(now, f.transfer);
                            }
                        }
                    }
                    RdmaEvent::SendFailed(status) => {
                        tracing::error!(status, lane, "SEND failed: the queue pair is in error");
                        broken = true;
                    }
                    RdmaEvent::WriteDone { .. } => {}
                }
            }
        }
        if broken {
            self.fail_link(now);
            return Ok(true);
        }
        self.pump(now);
        Ok(progress)
    }

    /// A queue pair failed: reset every lane (no remote access through them after this),
    /// deallocate every window (the fence of every open reservation), fail every transfer.
    fn fail_link(&mut self, now: Instant) {
        if self.state == LinkState::Broken {
            return;
        }
        self.state = LinkState::Broken;
        self.stats.link_failures += 1;
        reset_lanes(&mut self.lanes);
        // Deallocating a window invalidates it: no write through it can land any more.
        self.bound.clear();
        self.fence_wrs.clear();
        let ep = self.endpoint.as_mut().expect("endpoint");
        for (_, f) in std::mem::take(&mut self.fencing) {
            drop(f.windows);
            ep.handle_fence_complete(now, f.transfer);
        }
        ep.handle_peer_lost(now);
        while let Some(t) = ep.poll_fenced() {
            ep.handle_fence_complete(now, t);
        }
        while let Some(o) = ep.poll_outcome() {
            self.carried.push_back(o);
        }
    }

    /// After [`LinkState::Broken`] (or to replace a working link): fails what is left,
    /// rebuilds the queue pairs and starts a new session over the same memory (verified
    /// pages the engine still holds stay valid). Returns the new parameters.
    pub fn recover(
        &mut self,
        now: Instant,
        established: &Established,
    ) -> Result<Vec<QpParams>, DriverError> {
        self.fail_link(now);
        let pool = self.endpoint.take().expect("endpoint").into_pool();
        let mut endpoint =
            ReceiverEndpoint::new(established, pool, &self.engine, self.config.clone())?;
        endpoint.set_fence_completion(FenceCompletion::Transport);
        self.endpoint = Some(endpoint);
        self.lane_of = LaneMap::default();
        self.state = LinkState::Up;
        Ok(self.params())
    }
}
