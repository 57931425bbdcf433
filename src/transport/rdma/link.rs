//! RC queue pairs: one connection's lane to its peer, with its completion queue, the send and
//! receive slots of control frames, and the work requests both ends post (WRITEs, SENDs,
//! memory-window binds and invalidations).

use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionQueue, GenericCompletionQueue};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairAttributeMask,
    QueuePairState, SendOperationFlags, SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::events::EventChannel;
use super::verbs::{
    verbs, MemoryWindow, PortPath, RdmaDevice, RdmaError, RegisteredMemory, SEND_SLOTS, SLOT,
};

/// The path MTU for a local and a peer MTU in bytes: the smaller; `None` if the peer's is
/// not a valid IB MTU (peer data is never fed to sideway's panicking conversions).
fn path_mtu(local: u32, peer: u32) -> Option<Mtu> {
    Some(match local.min(peer) {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => return None,
    })
}

/// What a peer needs to connect its queue pair to ours (carried in HELLO's transport
/// parameters): 4 bytes QPN, 4 bytes PSN, 16 bytes GID, 4 bytes active MTU in bytes,
/// little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpParams {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// GID.
    pub gid: [u8; 16],
    /// Active MTU of the port, bytes (256..=4096, a power of two).
    pub mtu: u32,
}

impl QpParams {
    /// The record of a lane whose rail is down at this end when the connection opens: QPN 0
    /// (no RC queue pair has that number) and nothing else; the peer leaves its lane
    /// unconnected too (SPEC §9.2, "A rail down when the connection opens").
    pub const DOWN: Self = Self {
        qpn: 0,
        psn: 0,
        gid: [0; 16],
        mtu: 0,
    };

    /// Whether this is a down lane's record ([`QpParams::DOWN`]: QPN 0).
    pub fn is_down(&self) -> bool {
        self.qpn == 0
    }

    /// Encoded form.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(28);
        v.extend_from_slice(&self.qpn.to_le_bytes());
        v.extend_from_slice(&self.psn.to_le_bytes());
        v.extend_from_slice(&self.gid);
        v.extend_from_slice(&self.mtu.to_le_bytes());
        v
    }

    /// Decodes; `None` unless exactly 28 bytes.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != 28 {
            return None;
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        Some(Self {
            qpn: u32::from_le_bytes(b[0..4].try_into().ok()?),
            psn: u32::from_le_bytes(b[4..8].try_into().ok()?),
            gid,
            mtu: u32::from_le_bytes(b[24..28].try_into().ok()?),
        })
    }
}

/// A random 24-bit initial packet sequence number.
fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x6b76_7769_7265);
    (h.finish() as u32) & 0x00ff_ffff
}

const RECV_SLOTS: usize = 32;
/// SENDs per completion: every `SIGNAL_SENDS`th SEND asks for one, which retires it and the
/// unsignaled ones before it (RC completes in order). A SEND's completion needs no action
/// but freeing its slot, so the others would only wake the end that sent it.
const SIGNAL_SENDS: usize = SEND_SLOTS / 4;
/// Where a signaled SEND's work request id counts the SENDs its completion retires.
const SEND_COUNT_SHIFT: u32 = 16;
const TAG_RECV: u64 = 1 << 63;
const TAG_SEND: u64 = 1 << 62;
const TAG_LOCAL: u64 = 1 << 61;

/// One page write (one buffer of one page): from a local registered address to a remote one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdmaWrite {
    /// Caller's id, reported on completion if `signaled`.
    pub wr_id: u64,
    /// Local key, address, length.
    pub local: (u32, u64, u32),
    /// Remote key and address.
    pub remote: (u32, u64),
    /// Whether to request a completion.
    pub signaled: bool,
}

/// A completion.
#[derive(Debug, PartialEq, Eq)]
pub enum RdmaEvent {
    /// A signaled write completed (ok or in error).
    WriteDone {
        /// Its id.
        wr_id: u64,
        /// Whether it succeeded.
        ok: bool,
    },
    /// A control frame arrived.
    Frame(Vec<u8>),
    /// A SEND completed in error (the queue pair is broken).
    SendFailed(u32),
    /// A posted receive completed in error: the queue pair is in the error state (its
    /// receives are flushed); it is not posted again.
    RecvFailed(u32),
    /// A memory-window bind or invalidation completed (ok or in error).
    LocalDone {
        /// Its id.
        wr_id: u64,
        /// Whether it succeeded.
        ok: bool,
    },
}

/// One RC queue pair with its completion queue, send slots and posted receives.
pub struct RcLink {
    qp: ExtendedQueuePair,
    cq: Arc<BasicCompletionQueue>,
    slots: Vec<u8>,
    slots_mr: Arc<MemoryRegion>,
    next_send: usize,
    sends_in_flight: usize,
    /// SENDs posted since the last signaled one.
    unsignaled_sends: usize,
    /// Send-queue work requests posted since the last signaled one, and the count at which
    /// the next one asks for a completion anyway (half the send queue): some devices free
    /// send-queue entries only when a completion after them is polled.
    unsignaled: u32,
    signal_at: u32,
    psn: u32,
    gid: Gid,
    gid_index: u8,
    mtu: u32,
    /// The local ACK timeout exponent set when connecting ([`RcLink::set_ack_timeout`]).
    ack_timeout: u8,
    /// Signaled SENDs posted and not completed yet.
    signaled_sends_out: u32,
    /// Since when a signaled SEND has been outstanding with no SEND completing: when the
    /// first of them was posted, moved on by every completion while others remain
    /// ([`RcLink::sends_stalled_since`]).
    sends_stalled_since: Option<Instant>,
    /// Test-only fault: receives taken are not posted again ([`RcLink::stop_reposting_receives`]).
    receives_stopped: bool,
    /// Receives posted and not completed yet.
    receives_posted: usize,
}

impl RcLink {
    /// A queue pair in INIT with its receives posted, addressed by the device's port as it
    /// is now ([`RdmaDevice::port_path`]: an error if the port is down). With `events`, its
    /// completion queue reports to that channel (see [`RcLink::arm`]); without, it can only
    /// be busy-polled.
    pub fn new(
        dev: &RdmaDevice,
        max_send: u32,
        events: Option<&EventChannel>,
    ) -> Result<Self, RdmaError> {
        let path = dev.port_path()?;
        Self::on_path(dev, &path, max_send, events)
    }

    /// [`RcLink::new`] addressed by `path` ([`PortPath::down`] for a lane whose rail is down,
    /// which is never connected).
    pub(super) fn on_path(
        dev: &RdmaDevice,
        path: &PortPath,
        max_send: u32,
        events: Option<&EventChannel>,
    ) -> Result<Self, RdmaError> {
        let mut builder = dev.ctx.create_cq_builder();
        if let Some(ch) = events {
            builder.setup_comp_channel(&ch.channel, 0);
        }
        let cq = builder
            .setup_cqe(max_send + 2 * RECV_SLOTS as u32 + SEND_SLOTS as u32)
            // A basic CQ (ibv_poll_cq), not an extended one: the rxe provider in rdma-core 44
            // advances the CQ consumer index twice when ibv_next_poll finds the queue empty and
            // ibv_end_poll follows (as it must), after which the CQ yields phantom completions.
            .build()
            .map_err(verbs("ibv_create_cq"))?;
        let cqh = GenericCompletionQueue::from(Arc::clone(&cq));
        let mut qp = dev
            .pd
            .create_qp_builder()
            .setup_send_cq(cqh.clone())
            .setup_recv_cq(cqh)
            .setup_max_send_wr(max_send + SEND_SLOTS as u32)
            .setup_max_recv_wr(RECV_SLOTS as u32)
            .setup_send_ops_flags(
                SendOperationFlags::Write
                    | SendOperationFlags::Send
                    | SendOperationFlags::BindMemoryWindow
                    | SendOperationFlags::LocalInvalidate,
            )
            .build_ex()
            .map_err(verbs("ibv_create_qp_ex"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(1)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        qp.modify(&attr).map_err(verbs("ibv_modify_qp(INIT)"))?;
        let slots = vec![0u8; SLOT * (RECV_SLOTS + SEND_SLOTS)];
        // SAFETY: `slots` is a heap buffer owned by the link, never reallocated, and the MR is
        // dropped with it (fields drop in order after the queue pair).
        let slots_mr = unsafe {
            dev.pd
                .reg_mr(
                    slots.as_ptr() as usize,
                    slots.len(),
                    AccessFlags::LocalWrite,
                )
                .map_err(verbs("ibv_reg_mr(slots)"))?
        };
        let psn = random_psn();
        let mut link = Self {
            qp,
            cq,
            slots,
            slots_mr,
            next_send: 0,
            sends_in_flight: 0,
            unsignaled_sends: 0,
            unsignaled: 0,
            signal_at: (max_send / 2).max(1),
            psn,
            gid: path.gid,
            gid_index: path.gid_index,
            mtu: path.mtu,
            ack_timeout: super::DEFAULT_ACK_TIMEOUT,
            signaled_sends_out: 0,
            sends_stalled_since: None,
            receives_stopped: false,
            receives_posted: 0,
        };
        for i in 0..RECV_SLOTS {
            link.post_recv(i)?;
        }
        Ok(link)
    }

    /// Since when this queue pair's SENDs have made no progress: the moment the oldest signaled
    /// SEND still outstanding was posted, or the last completion of its send queue (a SEND, a
    /// write, a bind or invalidation) if later; `None` when no signaled SEND is outstanding. A SEND completes once the peer's adapter took it, which
    /// needs a receive the peer's process posted: a peer that posts none (it stopped reading
    /// its completions) holds every SEND, and every WRITE posted after one (RC order), in
    /// receiver-not-ready retries for ever (`rnr_retry` 7). At most `SIGNAL_SENDS - 1` SENDs
    /// go unsignaled after the last signaled one, so a connection sending heartbeats has a
    /// signaled SEND out within that many heartbeat intervals.
    pub fn sends_stalled_since(&self) -> Option<Instant> {
        self.sends_stalled_since
    }

    /// Test-only fault: moves the queue pair to the error state, as a failed link or port
    /// does: its outstanding work requests and posted receives complete in error (flushed)
    /// and the peer's packets are no longer acknowledged.
    #[doc(hidden)]
    pub fn force_error(&mut self) -> Result<(), RdmaError> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        self.qp.modify(&attr).map_err(verbs("ibv_modify_qp(ERR)"))
    }

    /// Test-only fault: the receives this queue pair takes are not posted again, as when the
    /// peer process stops reading its completion queue while it keeps sending. Once the
    /// receives posted are used up, the peer's SENDs wait in receiver-not-ready retries.
    #[doc(hidden)]
    pub fn stop_reposting_receives(&mut self) {
        self.receives_stopped = true;
    }

    /// SENDs posted and not yet retired by a completion, and how many of them asked for one:
    /// what a lane declared stalled was waiting on.
    pub fn sends_outstanding(&self) -> (usize, u32) {
        (self.sends_in_flight, self.signaled_sends_out)
    }

    /// Receives posted and not yet taken by a SEND of the peer.
    pub fn receives_posted(&self) -> usize {
        self.receives_posted
    }

    fn post_recv(&mut self, slot: usize) -> Result<(), RdmaError> {
        if self.receives_stopped {
            return Ok(());
        }
        self.receives_posted += 1;
        let addr = self.slots.as_ptr() as u64 + (slot * SLOT) as u64;
        let mut g = self.qp.start_post_recv();
        let h = g.construct_wr(TAG_RECV | slot as u64);
        // SAFETY: the slot lies in the registered `slots` buffer, which outlives the QP.
        unsafe { h.setup_sge(self.slots_mr.lkey(), addr, SLOT as u32) };
        g.post().map_err(verbs("ibv_post_recv"))
    }

    /// Asks for one event on the completion channel at the next completion: call when a
    /// poll found nothing, then poll once more (a completion that raced the request is
    /// there), then wait for the channel.
    pub fn arm(&self) -> Result<(), RdmaError> {
        // SAFETY: the CQ is live while `self.cq` is; ibv_req_notify_cq only sets its arm bit.
        let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr().cast(), 0) };
        if rc != 0 {
            return Err(RdmaError::Verbs {
                call: "ibv_req_notify_cq",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }

    /// This side's connection parameters.
    pub fn params(&self) -> QpParams {
        QpParams {
            qpn: self.qp.qp_number(),
            psn: self.psn,
            gid: self.gid.raw,
            mtu: self.mtu,
        }
    }

    /// Sets the local ACK timeout the queue pair gets when it connects: 4.096 µs x
    /// 2^`exponent`, 1 to 31 (`TransportConfig::Rdma::ack_timeout`).
    pub fn set_ack_timeout(&mut self, exponent: u8) -> Result<(), RdmaError> {
        let range = super::ACK_TIMEOUTS;
        if !range.contains(&exponent) {
            return Err(RdmaError::Verbs {
                call: "ack timeout",
                detail: format!(
                    "exponent {exponent} is outside {} to {}",
                    range.start(),
                    range.end()
                ),
            });
        }
        self.ack_timeout = exponent;
        Ok(())
    }

    /// What this queue pair holds, for a diagnostic log: its state and next send and expected
    /// receive PSNs as the device reports them (`ibv_query_qp`), and the SENDs and receives
    /// it has outstanding.
    pub fn describe(&self) -> String {
        let (sends, signaled) = self.sends_outstanding();
        let device = match self.qp.query(
            QueuePairAttributeMask::State
                | QueuePairAttributeMask::SendQueuePacketSequenceNumber
                | QueuePairAttributeMask::ReceiveQueuePacketSequenceNumber,
        ) {
            Ok((attr, _)) => format!(
                "state {:?}, send PSN {}, expected receive PSN {}",
                attr.state(),
                attr.sq_psn(),
                attr.rq_psn()
            ),
            Err(e) => format!("ibv_query_qp failed: {e}"),
        };
        format!(
            "{device}; {sends} SENDs outstanding ({signaled} signaled), {} receives posted",
            self.receives_posted
        )
    }

    /// The local ACK timeout exponent the device holds for this queue pair (`ibv_query_qp`):
    /// what [`RcLink::set_ack_timeout`] asked for, once connected.
    pub fn ack_timeout(&self) -> Result<u8, RdmaError> {
        let (attr, _) = self
            .qp
            .query(QueuePairAttributeMask::Timeout)
            .map_err(verbs("ibv_query_qp"))?;
        Ok(attr.timeout())
    }

    /// Connects to the peer (RTR, then RTS), at the smaller of both ports' active MTUs.
    pub fn connect(&mut self, peer: &QpParams) -> Result<(), RdmaError> {
        let mtu = path_mtu(self.mtu, peer.mtu).ok_or(RdmaError::Mtu {
            local: self.mtu,
            peer: peer.mtu,
        })?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(peer.qpn)
            .setup_rq_psn(peer.psn)
            .setup_max_dest_read_atomic(0)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        let gid = Gid { raw: peer.gid };
        ah.setup_dest_lid(1)
            .setup_port(1)
            .setup_service_level(0)
            .setup_grh_src_gid_index(self.gid_index)
            .setup_grh_dest_gid(&gid)
            .setup_grh_hop_limit(1);
        attr.setup_address_vector(&ah);
        self.qp.modify(&attr).map_err(verbs("ibv_modify_qp(RTR)"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(self.ack_timeout)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(0);
        self.qp.modify(&attr).map_err(verbs("ibv_modify_qp(RTS)"))
    }

    /// Posts a batch of writes behind one doorbell.
    pub fn post_writes(&mut self, writes: &[RdmaWrite]) -> Result<(), RdmaError> {
        if writes.is_empty() {
            return Ok(());
        }
        let mut g = self.qp.start_post_send();
        for w in writes {
            let flags = if w.signaled {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let h = g
                .construct_wr(w.wr_id, flags)
                .setup_write(w.remote.0, w.remote.1);
            // SAFETY: the local range lies in memory registered under `local.0`; the caller's
            // pages stay leased (and are not released) until the write completes.
            unsafe { h.setup_sge(w.local.0, w.local.1, w.local.2) };
        }
        g.post().map_err(verbs("ibv_post_send(WRITE)"))?;
        self.unsignaled = match writes.iter().rposition(|w| w.signaled) {
            Some(i) => (writes.len() - 1 - i) as u32,
            None => self.unsignaled + writes.len() as u32,
        };
        Ok(())
    }

    /// Whether a SEND can be posted now ([`RcLink::post_frame`] would not find every send
    /// slot busy).
    pub fn send_slot_free(&self) -> bool {
        self.sends_in_flight < SEND_SLOTS
    }

    /// Sends a control frame (a SEND on this queue pair, after everything posted before it).
    /// Only every `SIGNAL_SENDS`th SEND asks for a completion (it retires the slots of the
    /// ones before it); a SEND that fails completes in error whether signaled or not.
    pub fn post_frame(&mut self, frame: &[u8]) -> Result<(), RdmaError> {
        if frame.len() > SLOT {
            return Err(RdmaError::FrameTooLarge(frame.len()));
        }
        if self.sends_in_flight == SEND_SLOTS {
            return Err(RdmaError::SendSlotsBusy);
        }
        let slot = RECV_SLOTS + self.next_send;
        self.next_send = (self.next_send + 1) % SEND_SLOTS;
        let off = slot * SLOT;
        self.slots[off..off + frame.len()].copy_from_slice(frame);
        let addr = self.slots.as_ptr() as u64 + off as u64;
        let retires = self.unsignaled_sends + 1;
        // The first SEND with no signaled one outstanding asks for a completion too: a lane
        // with SENDs in flight always has one whose completion shows progress (or its lack:
        // RcLink::sends_stalled_since).
        let signaled = retires >= SIGNAL_SENDS
            || self.unsignaled + 1 >= self.signal_at
            || self.signaled_sends_out == 0;
        let (wr_id, flags) = if signaled {
            (
                TAG_SEND | ((retires as u64) << SEND_COUNT_SHIFT) | slot as u64,
                WorkRequestFlags::Signaled,
            )
        } else {
            (TAG_SEND | slot as u64, WorkRequestFlags::none())
        };
        let mut g = self.qp.start_post_send();
        let h = g.construct_wr(wr_id, flags).setup_send();
        // SAFETY: the slot lies in the registered `slots` buffer; it is rewritten only after
        // its SEND completed: slots are used in rotation, SENDs complete in order (RC), and at
        // most SEND_SLOTS are in flight (counted down in `poll` when a signaled SEND
        // completes, for it and every SEND before it).
        unsafe { h.setup_sge(self.slots_mr.lkey(), addr, frame.len() as u32) };
        g.post().map_err(verbs("ibv_post_send(SEND)"))?;
        self.sends_in_flight += 1;
        if signaled {
            if self.signaled_sends_out == 0 {
                self.sends_stalled_since = Some(Instant::now());
            }
            self.signaled_sends_out += 1;
        }
        (self.unsignaled_sends, self.unsignaled) = if signaled {
            (0, 0)
        } else {
            (retires, self.unsignaled + 1)
        };
        Ok(())
    }

    /// Rebuilds the queue pair after an error (e.g. the remote access error a late write
    /// causes after a fence): drains the completion queue, moves the QP to RESET and INIT,
    /// reposts the receives and takes a fresh PSN. Reconnect with [`RcLink::connect`] and the
    /// peer's new [`RcLink::params`]; anything posted before the error is gone.
    pub fn recover(&mut self) -> Result<(), RdmaError> {
        let mut drained = Vec::new();
        self.poll(&mut drained)?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Reset);
        self.qp
            .modify(&attr)
            .map_err(verbs("ibv_modify_qp(RESET)"))?;
        // Completions of the flushed work requests may still be queued: drop them.
        while let Ok(p) = self.cq.start_poll() {
            for _ in p {}
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(1)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        self.qp
            .modify(&attr)
            .map_err(verbs("ibv_modify_qp(INIT)"))?;
        self.psn = random_psn();
        self.next_send = 0;
        self.sends_in_flight = 0;
        self.unsignaled_sends = 0;
        self.unsignaled = 0;
        self.signaled_sends_out = 0;
        self.sends_stalled_since = None;
        self.receives_posted = 0;
        for i in 0..RECV_SLOTS {
            self.post_recv(i)?;
        }
        Ok(())
    }

    /// Binds `window` over `len` bytes at `offset` of buffer `b` of `memory`, with remote write
    /// access only, on this (the receiver's) queue pair; returns the rkey to hand the sender.
    /// Completion: [`RdmaEvent::LocalDone`] with `wr_id`.
    pub fn bind_window(
        &mut self,
        window: &mut MemoryWindow,
        memory: &RegisteredMemory,
        b: usize,
        offset: u64,
        len: u64,
        wr_id: u64,
    ) -> Result<u32, RdmaError> {
        self.bind_windows(
            std::slice::from_mut(window),
            memory,
            &[(b, offset, len)],
            Some(wr_id),
        )?;
        Ok(window.rkey)
    }

    /// Binds `windows[i]` over `ranges[i]` (buffer, byte offset, bytes) of `memory`, remote
    /// write only, behind one doorbell on this queue pair; each window's new rkey is in its
    /// [`MemoryWindow::rkey`]. With `signal`, the last bind asks for a completion
    /// ([`RdmaEvent::LocalDone`] with that id); the others never do unless they fail (a
    /// failed work request always completes, in error). Without `signal` the last asks for
    /// one anyway (id 0) when half the send queue has been posted unsignaled since the last
    /// completion asked for. A window may have been bound and
    /// invalidated before: each bind takes the next key. Nothing is posted on error.
    pub fn bind_windows(
        &mut self,
        windows: &mut [MemoryWindow],
        memory: &RegisteredMemory,
        ranges: &[(usize, u64, u64)],
        signal: Option<u64>,
    ) -> Result<(), RdmaError> {
        assert_eq!(windows.len(), ranges.len(), "one range per window");
        if windows.is_empty() {
            return Ok(());
        }
        let mut rkeys = Vec::with_capacity(windows.len());
        let last = windows.len() - 1;
        // Signaled when asked, or when the send queue needs a completion (id 0: no action).
        let signal =
            signal.or((self.unsignaled + windows.len() as u32 >= self.signal_at).then_some(0));
        // SAFETY: the QP was created with bind support (send_ops_flags); qpx is its extended
        // handle; every window and the MRs outlive the posted binds (the caller holds them
        // until the binds completed or the queue pair was reset). Writing `ibv_mw::rkey`
        // tells the provider the window's current key (it does not track type-2 binds), which
        // the device checks a rebind against.
        let rc = unsafe {
            let qpx = rdma_mummy_sys::ibv_qp_to_qp_ex(self.qp.qp().as_ptr());
            rdma_mummy_sys::ibv_wr_start(qpx);
            for (i, (w, &(b, offset, len))) in windows.iter().zip(ranges).enumerate() {
                // A rebind must change the key byte of the window's current rkey, or the
                // device refuses it (and the old rkey must never come back to life).
                let current = w.current_rkey();
                (*w.mw.as_ptr()).rkey = current;
                let rkey = rdma_mummy_sys::ibv_inc_rkey(current);
                let info = rdma_mummy_sys::ibv_mw_bind_info {
                    mr: memory.mr_ptr(b),
                    addr: memory.addr(b, offset),
                    length: len,
                    mw_access_flags: rdma_mummy_sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
                        as _,
                };
                match signal.filter(|_| i == last) {
                    Some(id) => {
                        (*qpx).wr_id = TAG_LOCAL | id;
                        (*qpx).wr_flags = rdma_mummy_sys::ibv_send_flags::IBV_SEND_SIGNALED.0 as _;
                    }
                    None => {
                        (*qpx).wr_id = TAG_LOCAL;
                        (*qpx).wr_flags = 0;
                    }
                }
                rdma_mummy_sys::ibv_wr_bind_mw(qpx, w.mw.as_ptr(), rkey, &info);
                rkeys.push(rkey);
            }
            rdma_mummy_sys::ibv_wr_complete(qpx)
        };
        if rc != 0 {
            return Err(RdmaError::Verbs {
                call: "ibv_wr_bind_mw",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        for (w, rkey) in windows.iter_mut().zip(rkeys) {
            w.rkey = rkey;
            w.binds += 1;
        }
        self.unsignaled = match signal {
            Some(_) => 0,
            None => self.unsignaled + windows.len() as u32,
        };
        Ok(())
    }

    /// Invalidates the window with `rkey` (the fence): once [`RdmaEvent::LocalDone`] for
    /// `wr_id` arrives, no write with that rkey can land.
    pub fn invalidate(&mut self, rkey: u32, wr_id: u64) -> Result<(), RdmaError> {
        self.invalidate_all(&[rkey], wr_id)
    }

    /// Invalidates the windows with `rkeys` behind one doorbell; only the last asks for a
    /// completion ([`RdmaEvent::LocalDone`] with `wr_id`). The send queue completes in order,
    /// so when it arrives (ok) every one of them has completed: no write with any of those
    /// rkeys can land any more. One that fails completes in error on its own.
    pub fn invalidate_all(&mut self, rkeys: &[u32], wr_id: u64) -> Result<(), RdmaError> {
        let Some(last) = rkeys.len().checked_sub(1) else {
            return Ok(());
        };
        // SAFETY: the QP was created with local-invalidate support; qpx is its extended handle.
        let rc = unsafe {
            let qpx = rdma_mummy_sys::ibv_qp_to_qp_ex(self.qp.qp().as_ptr());
            rdma_mummy_sys::ibv_wr_start(qpx);
            for (i, &rkey) in rkeys.iter().enumerate() {
                (*qpx).wr_id = TAG_LOCAL | wr_id;
                (*qpx).wr_flags = if i == last {
                    rdma_mummy_sys::ibv_send_flags::IBV_SEND_SIGNALED.0 as _
                } else {
                    0
                };
                rdma_mummy_sys::ibv_wr_local_inv(qpx, rkey);
            }
            rdma_mummy_sys::ibv_wr_complete(qpx)
        };
        if rc != 0 {
            return Err(RdmaError::Verbs {
                call: "ibv_wr_local_inv",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        self.unsignaled = 0;
        Ok(())
    }

    /// Polls the completion queue once (the only poller of this CQ), appending events.
    pub fn poll(&mut self, out: &mut Vec<RdmaEvent>) -> Result<(), RdmaError> {
        let mut repost = Vec::new();
        // Whether a work request of the send queue completed: a SEND waiting behind the
        // writes of a large transfer is not stalled while they complete.
        let mut moved = false;
        if let Ok(poller) = self.cq.start_poll() {
            for wc in poller {
                let (id, ok, len) = (wc.wr_id(), wc.status() == 0, wc.byte_len() as usize);
                if id & TAG_RECV != 0 {
                    self.receives_posted = self.receives_posted.saturating_sub(1);
                    let slot = (id & !TAG_RECV) as usize;
                    if ok {
                        let off = slot * SLOT;
                        out.push(RdmaEvent::Frame(
                            self.slots[off..off + len.min(SLOT)].to_vec(),
                        ));
                        repost.push(slot);
                    } else {
                        // Flushed: the queue pair is in error, and a receive posted again
                        // would only be flushed again.
                        out.push(RdmaEvent::RecvFailed(wc.status()));
                    }
                } else if id & TAG_LOCAL != 0 {
                    moved |= ok;
                    out.push(RdmaEvent::LocalDone {
                        wr_id: id & !TAG_LOCAL,
                        ok,
                    });
                } else if id & TAG_SEND != 0 {
                    // A signaled SEND retires itself and the unsignaled ones before it.
                    let retired = ((id & !TAG_SEND) >> SEND_COUNT_SHIFT) as usize;
                    if ok {
                        self.sends_in_flight = self.sends_in_flight.saturating_sub(retired);
                        self.signaled_sends_out = self.signaled_sends_out.saturating_sub(1);
                        self.sends_stalled_since = (self.signaled_sends_out > 0).then(Instant::now);
                    } else {
                        out.push(RdmaEvent::SendFailed(wc.status()));
                    }
                } else {
                    moved |= ok;
                    out.push(RdmaEvent::WriteDone { wr_id: id, ok });
                }
            }
        }
        if moved && self.signaled_sends_out > 0 {
            self.sends_stalled_since = Some(Instant::now());
        }
        for slot in repost {
            self.post_recv(slot)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_params_round_trip_and_refuse_other_lengths() {
        let p = QpParams {
            qpn: 0x0011_2233,
            psn: 0x00ab_cdef,
            gid: [7; 16],
            mtu: 4096,
        };
        let b = p.encode();
        assert_eq!(b.len(), 28);
        assert_eq!(QpParams::decode(&b), Some(p));
        assert_eq!(QpParams::decode(&b[..27]), None);
        assert_eq!(QpParams::decode(&[b.clone(), vec![0]].concat()), None);
    }

    #[test]
    fn path_mtu_is_the_smaller_and_refuses_invalid_peer_values() {
        assert_eq!(path_mtu(4096, 1024), Some(Mtu::Mtu1024));
        assert_eq!(path_mtu(1024, 4096), Some(Mtu::Mtu1024));
        assert_eq!(path_mtu(4096, 4096), Some(Mtu::Mtu4096));
        for bad in [0, 255, 1000, 3000] {
            assert_eq!(path_mtu(4096, bad), None, "{bad}");
        }
        // A peer advertising more than the local port gets the local MTU.
        assert_eq!(path_mtu(2048, 1 << 20), Some(Mtu::Mtu2048));
    }
}
