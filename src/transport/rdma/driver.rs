//! The protocol's endpoints over one RC queue pair: [`RdmaSender`] and [`RdmaReceiver`].
//!
//! Both are synchronous and polled: call `poll(now)` whenever there may be work (it posts
//! what the endpoint queued and takes what the completion queue holds; it never blocks).
//! Each link has exactly one poller (its driver). Everything travels on the one queue pair:
//! the receiver's memory-window binds, then its RESERVE (a SEND); the sender's WRITEs, then
//! its COMMIT (a SEND), so RC ordering puts the commit after the data it describes and the
//! reservation after the windows it names.
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

use kvwire_proto::auth::{Opener, Sealer};
use kvwire_proto::handshake::Established;
use kvwire_proto::receiver::ReceiverConfig;
use kvwire_proto::sender::{SenderConfig, SenderEvent};
use kvwire_proto::wire::{Frame, TransferRef};

use super::descriptor::{encoded_len, page_runs, AccessDescriptor, AccessKind, AccessRun};
use super::verbs::{
    MemoryWindow, QpParams, RcLink, RdmaDevice, RdmaError, RdmaEvent, RdmaWrite, RegisteredMemory,
};
use crate::config::{ConfigError, EngineConfig};
use crate::pool::PagePool;
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
    transfer: TransferRef,
    pages: u32,
    wrs: u32,
}

/// The sender's side of an RDMA link: the [`SenderEndpoint`] and its source memory.
pub struct RdmaSender {
    endpoint: Option<SenderEndpoint>,
    link: RcLink,
    reg: RegisteredMemory,
    page_bytes: Vec<u32>,
    max_wrs: u32,
    wrs_in_flight: u32,
    inflight: BTreeMap<u64, Signaled>,
    next_wr: u64,
    descriptors: VecDeque<CachedDescriptor>,
    outbox: VecDeque<Vec<u8>>,
    carried: VecDeque<SenderEvent>,
    state: LinkState,
    window: u32,
    engine: EngineConfig,
    config: SenderConfig,
    stats: RdmaSenderStats,
    batch: Vec<RdmaWrite>,
    faults: SenderFaults,
    sealer: Option<Sealer>,
    opener: Option<Opener>,
}

impl std::fmt::Debug for RdmaSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaSender")
            .field("state", &self.state)
            .field("wrs_in_flight", &self.wrs_in_flight)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// Seals (authenticates, when the connection is) and encodes a frame for a SEND.
fn encode(sealer: &mut Option<Sealer>, frame: &Frame) -> Option<Vec<u8>> {
    let r = match sealer {
        Some(s) => s.seal_to_vec(frame),
        None => frame.to_bytes(),
    };
    match r {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::error!(error = %e, "frame could not be encoded; dropped");
            None
        }
    }
}

/// Opens (checks the tag of, when authenticated) and decodes a received SEND. `None`: the
/// connection must close (not a frame, or not authentic).
fn decode(opener: &mut Option<Opener>, bytes: &[u8]) -> Option<Frame> {
    let r = match opener {
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

/// Send-queue work requests an [`RdmaSender`] needs for `window` pages of `buffers` buffers
/// per transfer in flight (the `max_send` of its [`RcLink`]).
pub fn sender_queue_depth(window: u32, buffers: usize) -> u32 {
    (4 * window.max(1) * buffers as u32).clamp(64, 4096)
}

/// Send-queue depth of an [`RdmaReceiver`]'s link (binds, invalidations, frames).
pub const RECEIVER_QUEUE_DEPTH: u32 = 4096;

fn flush(link: &mut RcLink, outbox: &mut VecDeque<Vec<u8>>) -> Result<(), RdmaError> {
    while let Some(f) = outbox.front() {
        match link.post_frame(f) {
            Ok(()) => {
                outbox.pop_front();
            }
            Err(RdmaError::SendSlotsBusy) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl RdmaSender {
    /// Authenticates the control frames carried as SENDs with the connection's channel
    /// from the handshake (SPEC.md §3.11); without it they travel unauthenticated.
    pub fn set_auth(&mut self, sealer: Sealer, opener: Opener) {
        self.sealer = Some(sealer);
        self.opener = Some(opener);
    }

    /// The peer is gone (its bootstrap connection closed, its process died): the queue pair
    /// is reset and every transfer fails with a retryable reason, as on a link failure.
    pub fn handle_peer_lost(&mut self, now: Instant) {
        self.fail_link(now);
    }

    /// The page pool, after [`Self::handle_peer_lost`] (or a broken link): to serve the next
    /// connection over the same memory.
    pub fn into_pool(mut self) -> PagePool {
        self.endpoint.take().expect("endpoint").into_pool()
    }

    /// Registers the pool's memory on `dev` and creates the queue pair (in INIT; connect it
    /// with [`RdmaSender::connect`]). `window` bounds the pages of one transfer in flight.
    pub fn new(
        dev: &RdmaDevice,
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: SenderConfig,
        window: u32,
    ) -> Result<Self, DriverError> {
        let link = RcLink::new(dev, sender_queue_depth(window, pool.buffers()))?;
        Self::with_link(link, dev, established, pool, engine, config, window)
    }

    /// [`RdmaSender::new`] over a queue pair created before the handshake (whose parameters
    /// travelled in HELLO), made with [`sender_queue_depth`].
    pub fn with_link(
        link: RcLink,
        dev: &RdmaDevice,
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: SenderConfig,
        window: u32,
    ) -> Result<Self, DriverError> {
        let page_bytes = pool.geometry().buffer_page_bytes.clone();
        let reg = dev.register(pool.memory())?;
        let window = window.max(1);
        let max_wrs = sender_queue_depth(window, page_bytes.len());
        let endpoint = SenderEndpoint::new(established, pool, engine, config.clone(), window)?;
        Ok(Self {
            endpoint: Some(endpoint),
            link,
            reg,
            page_bytes,
            max_wrs,
            wrs_in_flight: 0,
            inflight: BTreeMap::new(),
            next_wr: 1,
            descriptors: VecDeque::new(),
            outbox: VecDeque::new(),
            carried: VecDeque::new(),
            state: LinkState::Up,
            window,
            engine: engine.clone(),
            config,
            stats: RdmaSenderStats::default(),
            batch: Vec::new(),
            faults: SenderFaults::default(),
            sealer: None,
            opener: None,
        })
    }

    /// This side's queue pair parameters, for the peer.
    pub fn params(&self) -> QpParams {
        self.link.params()
    }

    /// Connects the queue pair to the receiver's.
    pub fn connect(&mut self, peer: &QpParams) -> Result<(), RdmaError> {
        self.link.connect(peer)
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
        let mut events = Vec::new();
        if let Err(e) = self.link.poll(&mut events) {
            tracing::error!(error = %e, "rdma poll");
            self.fail_link(now);
            return Ok(true);
        }
        progress |= !events.is_empty();
        let mut broken = false;
        for e in events {
            let ep = self.endpoint.as_mut().expect("endpoint");
            match e {
                RdmaEvent::WriteDone { wr_id, ok } => {
                    let Some(s) = self.inflight.remove(&wr_id) else {
                        continue;
                    };
                    self.wrs_in_flight -= s.wrs;
                    for _ in 0..s.pages {
                        ep.handle_write_completion(now, s.transfer, ok);
                    }
                    broken |= !ok;
                }
                RdmaEvent::Frame(bytes) => match decode(&mut self.opener, &bytes) {
                    Some(f) => {
                        if let Err(e) = ep.handle_frame(now, f) {
                            tracing::warn!(error = ?e, "frame refused");
                        }
                    }
                    None => broken = true,
                },
                RdmaEvent::SendFailed(status) => {
                    tracing::error!(status, "SEND failed: the queue pair is in error");
                    broken = true;
                }
                RdmaEvent::LocalDone { .. } => {}
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

    /// Frames out; as many queued page writes as the send queue takes, behind one doorbell.
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
            if let Some(b) = encode(&mut self.sealer, &f) {
                self.outbox.push_back(b);
            }
        }
        let buffers = self.page_bytes.len() as u32;
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        let mut group: Option<(TransferRef, u32)> = None;
        let mut refused = Vec::new();
        let mut lied = Vec::new();
        while self.wrs_in_flight + batch.len() as u32 + buffers <= self.max_wrs {
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
            let mut located = Vec::with_capacity(self.page_bytes.len());
            for (b, &bytes) in self.page_bytes.iter().enumerate() {
                match d.locate(w.write.dst_page, b, bytes) {
                    Ok(r) => located.push(r),
                    Err(e) => {
                        tracing::error!(transfer_id = w.transfer.transfer_id, error = %e, "write refused");
                        break;
                    }
                }
            }
            if located.len() != self.page_bytes.len() {
                refused.push(w.transfer);
                continue;
            }
            // Close the previous transfer's group with a signaled write.
            if let Some((t, n)) = group.filter(|(t, _)| *t != w.transfer) {
                self.signal(&mut batch, t, n);
                group = None;
            }
            for (b, (rkey, addr)) in located.into_iter().enumerate() {
                let bytes = self.page_bytes[b];
                batch.push(RdmaWrite {
                    wr_id: 0,
                    local: (
                        self.reg.lkey(b),
                        self.reg
                            .addr(b, u64::from(w.write.src_page) * u64::from(bytes)),
                        bytes,
                    ),
                    remote: (rkey, addr),
                    signaled: false,
                });
            }
            let n = group.map_or(0, |(_, n)| n) + 1;
            group = Some((w.transfer, n));
            if n == SIGNAL_EVERY {
                self.signal(&mut batch, w.transfer, n);
                group = None;
            }
        }
        if let Some((t, n)) = group {
            self.signal(&mut batch, t, n);
        }
        if !batch.is_empty() {
            match self.link.post_writes(&batch) {
                Ok(()) => {
                    self.stats.doorbells += 1;
                    self.stats.writes_posted += batch.len() as u64;
                    self.wrs_in_flight += batch.len() as u32;
                }
                Err(e) => {
                    tracing::error!(error = %e, "posting writes failed");
                    // Nothing of the batch was posted: report each page failed.
                    let ids: Vec<u64> = batch
                        .iter()
                        .filter(|w| w.signaled)
                        .map(|w| w.wr_id)
                        .collect();
                    for id in ids {
                        if let Some(s) = self.inflight.remove(&id) {
                            for _ in 0..s.pages {
                                self.endpoint()
                                    .handle_write_completion(now, s.transfer, false);
                            }
                        }
                    }
                }
            }
        }
        self.batch = batch;
        for t in refused {
            self.stats.writes_refused += 1;
            self.endpoint().handle_write_completion(now, t, false);
        }
        for t in lied {
            self.endpoint().handle_write_completion(now, t, true);
        }
        if let Err(e) = flush(&mut self.link, &mut self.outbox) {
            tracing::error!(error = %e, "posting a frame failed");
            self.fail_link(now);
        }
        progress
    }

    /// Marks the last write in `batch` signaled, covering `pages` pages of `transfer`.
    fn signal(&mut self, batch: &mut [RdmaWrite], transfer: TransferRef, pages: u32) {
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
            },
        );
    }

    /// The queue pair failed: every write still in flight is reported failed (the queue
    /// pair is reset first, so none of them can still read the source pages), and every
    /// transfer fails with a retryable reason.
    fn fail_link(&mut self, now: Instant) {
        if self.state == LinkState::Broken {
            return;
        }
        self.state = LinkState::Broken;
        self.stats.link_failures += 1;
        // Reset now: after this no work request of the old queue pair touches memory.
        if let Err(e) = self.link.recover() {
            tracing::error!(error = %e, "queue pair reset failed");
        }
        self.wrs_in_flight = 0;
        self.outbox.clear();
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
    /// rebuilds the queue pair and starts a new session over the same source memory.
    /// Returns the new parameters; connect with the receiver's new ones.
    pub fn recover(
        &mut self,
        now: Instant,
        established: &Established,
    ) -> Result<QpParams, DriverError> {
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
        self.state = LinkState::Up;
        Ok(self.link.params())
    }

    /// Test-only: installs fault knobs (a buggy or lying sender).
    #[doc(hidden)]
    pub fn set_faults(&mut self, faults: SenderFaults) {
        self.faults = faults;
    }

    /// Test-only fault: posts one more write of source page 0 into the first destination
    /// page of `transfer`'s access descriptor, whatever state the transfer is in (a sender
    /// that keeps writing after the receiver fenced). Returns that page, or `None` if no
    /// descriptor of `transfer` is known.
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
        let id = self.next_wr;
        self.next_wr += 1;
        self.inflight.insert(
            id,
            Signaled {
                transfer,
                pages: 0,
                wrs: 1,
            },
        );
        self.wrs_in_flight += 1;
        self.link.post_writes(&[RdmaWrite {
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

/// The receiver's side of an RDMA link: the [`ReceiverEndpoint`] over registered
/// destination memory, with memory windows per reservation.
pub struct RdmaReceiver {
    endpoint: Option<ReceiverEndpoint>,
    link: RcLink,
    dev: Arc<RdmaDevice>,
    reg: RegisteredMemory,
    page_bytes: Vec<u32>,
    kind: AccessKind,
    bound: BTreeMap<u64, Vec<MemoryWindow>>,
    fencing: BTreeMap<u64, Fencing>,
    fence_wrs: BTreeMap<u64, u64>,
    next_wr: u64,
    outbox: VecDeque<Vec<u8>>,
    carried: VecDeque<ReceiveOutcome>,
    state: LinkState,
    engine: EngineConfig,
    config: ReceiverConfig,
    stats: RdmaReceiverStats,
    sealer: Option<Sealer>,
    opener: Option<Opener>,
}

impl std::fmt::Debug for RdmaReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaReceiver")
            .field("state", &self.state)
            .field("kind", &self.kind)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

const TAG_BIND: u64 = 1 << 40;

impl RdmaReceiver {
    /// Authenticates the control frames carried as SENDs with the connection's channel
    /// from the handshake (SPEC.md §3.11); without it they travel unauthenticated.
    pub fn set_auth(&mut self, sealer: Sealer, opener: Opener) {
        self.sealer = Some(sealer);
        self.opener = Some(opener);
    }

    /// The peer is gone (its bootstrap connection closed, its process died): the queue pair
    /// is reset and every transfer fails with a retryable reason, as on a link failure.
    pub fn handle_peer_lost(&mut self, now: Instant) {
        self.fail_link(now);
    }

    /// The page pool, after [`Self::handle_peer_lost`] (or a broken link): to serve the next
    /// connection over the same memory.
    pub fn into_pool(mut self) -> PagePool {
        self.endpoint.take().expect("endpoint").into_pool()
    }

    /// Registers the pool's memory on `dev`, checks for memory windows (falling back to the
    /// region's rkeys with a warning) and creates the queue pair.
    pub fn new(
        dev: Arc<RdmaDevice>,
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: ReceiverConfig,
    ) -> Result<Self, DriverError> {
        let link = RcLink::new(&dev, RECEIVER_QUEUE_DEPTH)?;
        Self::with_link(link, dev, established, pool, engine, config)
    }

    /// [`RdmaReceiver::new`] over a queue pair created before the handshake, made with
    /// [`RECEIVER_QUEUE_DEPTH`].
    pub fn with_link(
        link: RcLink,
        dev: Arc<RdmaDevice>,
        established: &Established,
        pool: PagePool,
        engine: &EngineConfig,
        config: ReceiverConfig,
    ) -> Result<Self, DriverError> {
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
            link,
            dev,
            reg,
            page_bytes,
            kind,
            bound: BTreeMap::new(),
            fencing: BTreeMap::new(),
            fence_wrs: BTreeMap::new(),
            next_wr: 1,
            outbox: VecDeque::new(),
            carried: VecDeque::new(),
            state: LinkState::Up,
            engine: engine.clone(),
            config,
            stats: RdmaReceiverStats::default(),
            sealer: None,
            opener: None,
        })
    }

    /// This side's queue pair parameters, for the peer.
    pub fn params(&self) -> QpParams {
        self.link.params()
    }

    /// Connects the queue pair to the sender's.
    pub fn connect(&mut self, peer: &QpParams) -> Result<(), RdmaError> {
        self.link.connect(peer)
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
    /// pages and buffer), and sends RESERVE with their rkeys after the binds on the same
    /// queue pair.
    pub fn reserve(&mut self, now: Instant, p: ReserveParams) -> Result<TransferRef, ReceiveError> {
        if self.state == LinkState::Broken {
            return Err(ReceiveError::Access(
                "the link is broken; recover it".into(),
            ));
        }
        let Self {
            endpoint,
            link,
            dev,
            reg,
            page_bytes,
            kind,
            next_wr,
            stats,
            ..
        } = self;
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
                self.bound.insert(t.transfer_id, windows);
                self.pump(now);
                Ok(t)
            }
            Err(e) => {
                // Windows bound for a reservation that was not made: never sent to anyone,
                // but invalidate them before reuse all the same, by dropping them.
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
                if let Some(b) = encode(&mut self.sealer, &f) {
                    self.outbox.push_back(b);
                }
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
            let mut posted = 0;
            for w in &windows {
                let id = self.next_wr;
                self.next_wr += 1;
                match self.link.invalidate(w.rkey, id) {
                    Ok(()) => {
                        self.fence_wrs.insert(id, t.transfer_id);
                        posted += 1;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "invalidate could not be posted");
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
        if let Err(e) = flush(&mut self.link, &mut self.outbox) {
            tracing::error!(error = %e, "posting a frame failed");
            self.fail_link(now);
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
        let mut events = Vec::new();
        if let Err(e) = self.link.poll(&mut events) {
            tracing::error!(error = %e, "rdma poll");
            self.fail_link(now);
            return Ok(true);
        }
        progress |= !events.is_empty();
        let mut broken = false;
        for e in events {
            match e {
                RdmaEvent::Frame(bytes) => match decode(&mut self.opener, &bytes) {
                    Some(f) => {
                        if let Err(e) = self.endpoint().handle_frame(now, f) {
                            tracing::warn!(error = ?e, "frame refused");
                        }
                    }
                    None => broken = true,
                },
                RdmaEvent::LocalDone { wr_id, ok } => {
                    if !ok {
                        tracing::error!(wr_id, "memory window bind or invalidation failed");
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
                            // Deallocated, not reused: rxe refuses to rebind an invalidated
                            // type-2 window (seen on rdma-core 44 / Linux 6.1).
                            drop(f.windows);
                            self.endpoint().handle_fence_complete(now, f.transfer);
                        }
                    }
                }
                RdmaEvent::SendFailed(status) => {
                    tracing::error!(status, "SEND failed: the queue pair is in error");
                    broken = true;
                }
                RdmaEvent::WriteDone { .. } => {}
            }
        }
        if broken {
            self.fail_link(now);
            return Ok(true);
        }
        self.pump(now);
        Ok(progress)
    }

    /// The queue pair failed: reset it (no remote access through it after this), deallocate
    /// every window (the fence of every open reservation), and fail every transfer.
    fn fail_link(&mut self, now: Instant) {
        if self.state == LinkState::Broken {
            return;
        }
        self.state = LinkState::Broken;
        self.stats.link_failures += 1;
        if let Err(e) = self.link.recover() {
            tracing::error!(error = %e, "queue pair reset failed");
        }
        // Deallocating a window invalidates it: no write through it can land any more.
        self.bound.clear();
        self.fence_wrs.clear();
        self.outbox.clear();
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
    /// rebuilds the queue pair and starts a new session over the same memory (verified
    /// pages the engine still holds stay valid). Returns the new parameters.
    pub fn recover(
        &mut self,
        now: Instant,
        established: &Established,
    ) -> Result<QpParams, DriverError> {
        self.fail_link(now);
        let pool = self.endpoint.take().expect("endpoint").into_pool();
        let mut endpoint =
            ReceiverEndpoint::new(established, pool, &self.engine, self.config.clone())?;
        endpoint.set_fence_completion(FenceCompletion::Transport);
        self.endpoint = Some(endpoint);
        self.state = LinkState::Up;
        Ok(self.link.params())
    }
}
