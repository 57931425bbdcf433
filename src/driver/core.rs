//! What the drivers of both roles share: the session, the transport, the pool, where digests
//! run, and why the connection closed; and the handling of the inputs both roles get in the
//! same way (frames, the connection's end, finished digest jobs).

use kvwire_proto::wire::TransferId;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use kvwire_proto::liveness::{Liveness, LivenessConfig, LivenessEvent};
use kvwire_proto::receiver::ReceiverSession;
use kvwire_proto::sender::SenderSession;
use kvwire_proto::wire::{DigestAlgorithm, ErrorCode, Frame, TransferDigests, TransferRef};
use kvwire_proto::{FrameError, Scope};

use super::digest::{DigestExecution, Digests, JobOutcome};
use crate::checksum::DigestMode;
use crate::memory::PagePool;
use crate::transport::{Closed, Transport, TransportEvent};

/// The session calls both drivers make alike.
pub(crate) trait Session {
    fn abort(&mut self, now: Instant, transfer_id: TransferId, code: ErrorCode) -> bool;
    fn handle_digests(&mut self, now: Instant, transfer: TransferRef, digests: TransferDigests);
    /// A non-final chunk's digest job returned (only senders send in chunks).
    fn handle_chunk_digested(&mut self, _now: Instant, _transfer: TransferRef) {}
    fn handle_frame(&mut self, now: Instant, frame: Frame) -> Result<(), FrameError>;
    fn handle_peer_lost(&mut self, now: Instant);
    fn handle_peer_unresponsive(&mut self, now: Instant);
    /// Whether the transfer was open.
    fn handle_transfer_lost(&mut self, now: Instant, transfer_id: TransferId) -> bool;
    fn poll_timeout(&mut self) -> Option<Instant>;
}

macro_rules! session {
    ($t:ty $(, $extra:item)*) => {
        impl Session for $t {
            $($extra)*
            fn abort(&mut self, now: Instant, transfer_id: TransferId, code: ErrorCode) -> bool {
                <$t>::abort(self, now, transfer_id, code)
            }
            fn handle_digests(&mut self, now: Instant, t: TransferRef, d: TransferDigests) {
                <$t>::handle_digests(self, now, t, d)
            }
            fn handle_frame(&mut self, now: Instant, frame: Frame) -> Result<(), FrameError> {
                <$t>::handle_frame(self, now, frame)
            }
            fn handle_peer_lost(&mut self, now: Instant) {
                <$t>::handle_peer_lost(self, now)
            }
            fn handle_peer_unresponsive(&mut self, now: Instant) {
                <$t>::handle_peer_unresponsive(self, now)
            }
            fn handle_transfer_lost(&mut self, now: Instant, transfer_id: TransferId) -> bool {
                <$t>::handle_transfer_lost(self, now, transfer_id)
            }
            fn poll_timeout(&mut self) -> Option<Instant> {
                <$t>::poll_timeout(self)
            }
        }
    };
}
session!(
    SenderSession,
    fn handle_chunk_digested(&mut self, now: Instant, t: TransferRef) {
        SenderSession::handle_chunk_digested(self, now, t)
    }
);
session!(ReceiverSession);

/// The parts of a driver both roles have.
#[derive(Debug)]
pub(crate) struct Core<S, T> {
    pub(crate) session: S,
    pub(crate) transport: T,
    pub(crate) pool: Arc<PagePool>,
    pub(crate) digests: Digests,
    pub(crate) closed: Option<Closed>,
    /// Heartbeats (SPEC §8.3), when enabled.
    pub(crate) liveness: Option<Liveness>,
    /// The peer was declared unresponsive after this much silence; the connection is
    /// closing and its end is reported as [`Closed::Unresponsive`].
    unresponsive: Option<std::time::Duration>,
    /// The peer flooded PINGs (SPEC §8.3): the connection is closing and its end is
    /// reported as [`Closed::PingFlood`].
    flooded: Option<Closed>,
    /// The peer's HELLO_REJECT after HELLO_ACK (SPEC §4.2): the connection is closing and
    /// its end is reported as [`Closed::RefusedByPeer`].
    refused_by_peer: Option<kvwire_proto::wire::HelloReject>,
}

impl<S: Session, T: Transport> Core<S, T> {
    pub(crate) fn new(session: S, transport: T, pool: Arc<PagePool>) -> Self {
        Self {
            session,
            transport,
            pool,
            digests: Digests::new(DigestMode::Verify, DigestExecution::Inline),
            closed: None,
            liveness: None,
            unresponsive: None,
            flooded: None,
            refused_by_peer: None,
        }
    }

    /// Starts heartbeats on the connection (SPEC §8.3): PING every `config.interval`, and
    /// a peer silent for `config.timeout` is declared unresponsive, the connection closed
    /// and every transfer failed with `PeerUnresponsive` (or `Unconfirmed` around it).
    pub(crate) fn enable_liveness(&mut self, now: Instant, config: LivenessConfig) {
        self.liveness = Some(Liveness::new(now, config));
    }

    /// The session's next deadline, the heartbeat's, or the transport's own wake-up,
    /// whichever is first.
    pub(crate) fn poll_timeout(&mut self) -> Option<Instant> {
        let session = self.session.poll_timeout();
        let transport = self.transport.poll_timeout();
        let liveness = match (&mut self.liveness, &self.closed) {
            (Some(l), None) => {
                l.handle_write_blocked(self.transport.write_blocked_since());
                l.poll_timeout()
            }
            _ => None,
        };
        session.into_iter().chain(transport).chain(liveness).min()
    }

    /// Heartbeat time: the next PING, or the verdict on a silent peer (then the connection
    /// is closed; its end fails every transfer with `PeerUnresponsive`).
    pub(crate) fn handle_liveness_timeout(&mut self, now: Instant) {
        if self.closed.is_some() {
            return;
        }
        let Some(l) = self.liveness.as_mut() else {
            return;
        };
        if let Some(t) = self.transport.last_read() {
            l.handle_activity(t);
        }
        l.handle_write_blocked(self.transport.write_blocked_since());
        l.handle_timeout(now);
        self.handle_liveness_events(now);
    }

    /// The heartbeat's verdicts: an unresponsive peer or a PING flood closes the connection.
    fn handle_liveness_events(&mut self, now: Instant) {
        let Some(l) = self.liveness.as_mut() else {
            return;
        };
        while let Some(event) = l.poll_event() {
            let silent_for = match event {
                LivenessEvent::Unresponsive { silent_for } => {
                    tracing::warn!(
                        silent_ms = silent_for.as_millis() as u64,
                        "peer unresponsive: nothing from it for {silent_for:?}; closing the connection"
                    );
                    silent_for
                }
                LivenessEvent::NotReading { blocked_for } => {
                    tracing::warn!(
                        blocked_ms = blocked_for.as_millis() as u64,
                        "peer unresponsive: it took none of this node's bytes for {blocked_for:?} (it does not read); closing the connection"
                    );
                    blocked_for
                }
                LivenessEvent::PingsUnanswered => {
                    tracing::warn!(
                        "the peer sends PINGs faster than this node answers ({} per interval); the rest go unanswered",
                        kvwire_proto::liveness::PONGS_PER_INTERVAL
                    );
                    continue;
                }
                LivenessEvent::PingFlood { pings, within } => {
                    let why = Closed::PingFlood { pings, within };
                    tracing::warn!("{why}; closing the connection");
                    if self.closed.is_none()
                        && self.unresponsive.is_none()
                        && self.flooded.is_none()
                    {
                        self.flooded = Some(why);
                        // As for an unresponsive peer: the session first, so that its
                        // transfers fail as on peer loss, not for the writes the close fails.
                        self.session.handle_peer_lost(now);
                        self.transport.close(now);
                    }
                    continue;
                }
                _ => continue,
            };
            if self.unresponsive.is_none() {
                self.unresponsive = Some(silent_for);
                self.transport.log_state();
                // The session first, so that its transfers fail for this reason rather than
                // for the writes the close is about to fail (it is told again, to no effect,
                // when the transport reports the end).
                self.session.handle_peer_unresponsive(now);
                self.transport.close(now);
            }
        }
    }

    /// Moves the heartbeat's PING / PONG frames to the transport. Whether any moved.
    pub(crate) fn flush_liveness(&mut self, now: Instant) -> bool {
        let Some(l) = self.liveness.as_mut() else {
            return false;
        };
        let mut moved = false;
        while let Some(frame) = l.poll_transmit() {
            moved = true;
            if self.closed.is_none() {
                self.transport.send_frame(now, &frame);
            }
        }
        moved
    }

    /// Waits for the next input. A digest job finished elsewhere is handled here
    /// (`Ready(None)`); a transport event is handled here if both roles handle it alike, else
    /// returned.
    pub(crate) fn poll_input(
        &mut self,
        cx: &mut Context<'_>,
        now: Instant,
    ) -> Poll<Option<TransportEvent>> {
        if self.digests.poll_done(cx).is_ready() {
            self.finish_ready_digests(now);
            return Poll::Ready(None);
        }
        self.transport
            .poll_event(cx, now)
            .map(|ev| self.handle_common(now, ev))
    }

    /// Handles a frame or the connection's end; returns any other event.
    pub(crate) fn handle_common(
        &mut self,
        now: Instant,
        event: TransportEvent,
    ) -> Option<TransportEvent> {
        match event {
            TransportEvent::Frame(frame) => {
                if let Some(l) = self.liveness.as_mut() {
                    if l.handle_frame(now, &frame) {
                        // A PING may have been one too many (SPEC §8.3's flood).
                        self.handle_liveness_events(now);
                        return None;
                    }
                }
                if let Err(e) = self.session.handle_frame(now, frame) {
                    if e.scope == Scope::Connection {
                        tracing::warn!(error = %e, "protocol error on the connection: closing it");
                        if let Some(r) = e.refused_by_peer {
                            self.refused_by_peer = Some(r);
                        }
                        self.transport.close(now);
                    } else {
                        tracing::debug!(error = %e, "frame dropped");
                    }
                }
                None
            }
            TransportEvent::Closed(why) => {
                if self.closed.is_none() {
                    // The driver's verdict, or the transport's (one lane of several silent).
                    let unresponsive = self.unresponsive.or(match why {
                        Closed::Unresponsive { silent_for } => Some(silent_for),
                        _ => None,
                    });
                    if let Some(silent_for) = unresponsive {
                        self.closed = Some(Closed::Unresponsive { silent_for });
                        self.session.handle_peer_unresponsive(now);
                    } else if let Some(flood) = self.flooded.take() {
                        self.closed = Some(flood);
                        self.session.handle_peer_lost(now);
                    } else {
                        // A HELLO_REJECT after HELLO_ACK: report the peer's refusal (SPEC §4.2).
                        self.closed = Some(match self.refused_by_peer.take() {
                            Some(r) => Closed::RefusedByPeer(r),
                            None => why,
                        });
                        self.session.handle_peer_lost(now);
                    }
                }
                None
            }
            TransportEvent::TransferLost(transfer_id) => {
                // A lane's failure names every transfer it carried: only an open one fails.
                if self.session.handle_transfer_lost(now, transfer_id) {
                    tracing::warn!(
                        transfer_id = transfer_id.0,
                        "the lane of the transfer failed; the connection goes on over its other lanes"
                    );
                }
                None
            }
            TransportEvent::Landed { .. } => {
                // A whole data record: only the peer can have sent it.
                if let Some(l) = self.liveness.as_mut() {
                    l.handle_activity(now);
                }
                Some(event)
            }
            other => Some(other),
        }
    }

    /// Starts the digest job of one chunk of `transfer` over `pages` (ordinals `first ..`, in
    /// order; pinned while the job runs; `aux` is `Some` on the final chunk), and hands every
    /// result that is ready now to the session.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_digests(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        algorithm: DigestAlgorithm,
        page_digests: bool,
        first: u32,
        pages: Vec<u32>,
        aux: Option<Vec<u8>>,
    ) {
        let view = self.pool.share_pages(pages);
        self.digests
            .start(transfer, algorithm, page_digests, first, view, aux);
        self.finish_ready_digests(now);
    }

    /// Hands every finished digest job's outcome to the session; whether there was one.
    pub(crate) fn finish_ready_digests(&mut self, now: Instant) -> bool {
        let mut handed = false;
        while let Some((transfer, outcome)) = self.digests.take_ready() {
            handed = true;
            match outcome {
                JobOutcome::ChunkDigested => self.session.handle_chunk_digested(now, transfer),
                JobOutcome::Digests(d) => self.session.handle_digests(now, transfer, d),
                JobOutcome::Failed { final_chunk } => {
                    // No digest can be made: abort, then report the digest job as ended so
                    // the session may release the pages it was waiting on.
                    self.session
                        .abort(now, transfer.transfer_id, ErrorCode::DIGEST_UNSUPPORTED);
                    if final_chunk {
                        self.session
                            .handle_digests(now, transfer, TransferDigests::default());
                    } else {
                        self.session.handle_chunk_digested(now, transfer);
                    }
                }
            }
        }
        handed
    }
}

/// The methods both drivers have alike (in `impl<T: ...Transport> XDriver<T>` blocks with a
/// `core: Core<_, T>` field and a `process(now)` method).
macro_rules! driver_common {
    () => {
        /// Sets the digest mode. [`DigestMode::UnverifiedBenchmarkOnly`] delivers unverified
        /// data and exists only to measure the integrity tax.
        pub fn set_digest_mode(&mut self, mode: DigestMode) {
            self.core.digests.mode = mode;
        }

        /// Sets where digests are computed (inline by default).
        pub fn set_digest_execution(&mut self, execution: DigestExecution) {
            self.core.digests.execution = execution;
        }

        /// Handles the passage of time (protocol deadlines and heartbeats).
        pub fn handle_timeout(&mut self, now: Instant) {
            self.core.handle_liveness_timeout(now);
            self.core.session.handle_timeout(now);
            self.process(now);
        }

        /// Starts heartbeats on the connection (SPEC §8.3): a PING every
        /// `config.interval`; a peer from which nothing arrives for `config.timeout` is
        /// declared unresponsive, the connection is closed and every open transfer fails
        /// safely with [`FailureReason::PeerUnresponsive`](kvwire_proto::FailureReason::PeerUnresponsive)
        /// (a committed one without a verdict: `Unconfirmed`).
        pub fn enable_liveness(
            &mut self,
            now: Instant,
            config: kvwire_proto::liveness::LivenessConfig,
        ) {
            self.core.enable_liveness(now, config);
        }

        /// The heartbeat state, when enabled.
        pub fn liveness(&self) -> Option<&kvwire_proto::liveness::Liveness> {
            self.core.liveness.as_ref()
        }

        /// When `handle_timeout` must next be called (the session's deadlines and the
        /// transport's own wake-up, whichever is first).
        pub fn poll_timeout(&mut self) -> Option<Instant> {
            self.core.poll_timeout()
        }

        /// Closes the connection from this side: every open transfer fails safely (fenced
        /// and released, or drained) as the transport reports its end.
        pub fn close(&mut self, now: Instant) {
            self.core.transport.close(now);
        }

        /// Waits for the next input (a transport event or a digest job finished elsewhere)
        /// and handles it. `Ready` when something was handled.
        pub fn poll_input(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<()> {
            match self.core.poll_input(cx, now) {
                Poll::Ready(Some(ev)) => {
                    self.handle_event(now, ev);
                    Poll::Ready(())
                }
                Poll::Ready(None) => {
                    self.process(now);
                    Poll::Ready(())
                }
                Poll::Pending => Poll::Pending,
            }
        }

        /// Why the connection closed, once it has.
        pub fn closed(&self) -> Option<&Closed> {
            self.core.closed.as_ref()
        }

        /// The transport.
        pub fn transport(&self) -> &T {
            &self.core.transport
        }

        /// The transport, mutably (harnesses reach their fault injectors through it).
        pub fn transport_mut(&mut self) -> &mut T {
            &mut self.core.transport
        }
    };
}
pub(crate) use driver_common;

/// Implements [`Driver`](super::Driver) for a driver type with the `driver_common` methods.
macro_rules! impl_driver {
    ($driver:ident, $transport:ident) => {
        impl<T: $transport> crate::driver::Driver for $driver<T> {
            fn poll_input(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<()> {
                $driver::poll_input(self, cx, now)
            }
            fn hold_writes(&mut self, held: bool) {
                self.core.transport.hold_writes(held)
            }
            fn coalesces_writes(&self) -> bool {
                self.core.transport.coalesces_writes()
            }
            fn poll_timeout(&mut self) -> Option<Instant> {
                $driver::poll_timeout(self)
            }
            fn handle_timeout(&mut self, now: Instant) {
                $driver::handle_timeout(self, now)
            }
            fn close(&mut self, now: Instant) {
                $driver::close(self, now)
            }
            fn open_transfers(&self) -> usize {
                self.core.session.open_transfers()
            }
            fn failed_lanes(&self) -> usize {
                self.core.transport.failed_lanes()
            }
            fn closed(&self) -> Option<&Closed> {
                $driver::closed(self)
            }
        }
    };
}
pub(crate) use impl_driver;
