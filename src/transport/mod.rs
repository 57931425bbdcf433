//! Transports: how control frames and page bytes cross between two nodes, and how the
//! receiver fences them. This module is the **seam** every transport implements and every
//! driver (`crate::driver`) is written against, once.
//!
//! A transport is one connection's data path, for one role:
//!
//! * [`Transport`] (both roles): send control frames in order ([`Transport::send_frame`]),
//!   and report what happened ([`Transport::poll_event`]): frames from the peer, completions,
//!   fences done, the connection gone.
//! * [`SenderTransport`]: post the page writes of one transfer (a scatter list of source
//!   page → destination page), within the credit the transport has room for; each page's
//!   outcome comes back exactly once ([`TransportEvent::WritesDone`]), also after the
//!   connection is gone.
//! * [`ReceiverTransport`]: open an access scope over exactly a reservation's pages (the
//!   access descriptor RESERVE carries) and close it: the **fence**. After a fence has
//!   completed no write for that transfer can land any more (`proto/SPEC.md` §9).
//!
//! Implementations: [`loopback`] (in process, with a fault injector), [`tcp`] and, with the
//! `rdma` feature, [`rdma`] (RC queue pairs, memory windows as the fence). [`LaneSet`] makes
//! several transports of one kind (a connection's TCP streams) one, every transfer on one lane. Each guarantees
//! what the protocol relies on: a reliable ordered frame channel, scoped access, the fence,
//! one outcome per posted write, and a COMMIT that reaches the receiver only after the writes
//! it covers.
//!
//! Over KV memory in device (GPU) memory, TCP moves page bytes through a double-buffered
//! staging pipeline (`staging.rs`); loopback and RDMA refuse such memory for now.
//!
//! Transports are polled: [`Transport::poll_event`] never blocks; when it returns
//! `Poll::Pending` it has arranged for the task's waker to be woken when it may have more
//! (socket readiness, a completion channel's file descriptor, the loopback link).

pub mod lanes;
pub mod loopback;
pub mod rdma;
pub mod same_host;
pub(crate) mod staging;
pub(crate) mod stream;
pub mod tcp;

use kvwire_proto::wire::TransferId;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use kvwire_proto::auth::AuthError;
use kvwire_proto::sender::PageWrite;
use kvwire_proto::wire::{DigestAlgorithm, Frame, TransferRef};

pub use crate::memory::{AccessError, AccessKey, AccessScope, ScopeTable};
pub use lanes::LaneSet;
pub use staging::StagingStats;
pub use stream::ConnectError;

/// What a transport reports to its driver.
#[derive(Debug)]
#[non_exhaustive]
pub enum TransportEvent {
    /// A control frame from the peer (opened and authenticated, where the connection is).
    Frame(Frame),
    /// Sender: `pages` page writes of `transfer` ended; `ok` when their bytes are placed in
    /// the receiver's memory as far as the transport can tell (TCP: written to the stream
    /// ahead of anything sent later; RDMA: the RC completion).
    WritesDone {
        /// The reservation written into.
        transfer: TransferRef,
        /// Page writes (all buffers of one page index each) this covers.
        pages: u32,
        /// Completed, or failed.
        ok: bool,
    },
    /// Receiver: page `page` (ordinal `ordinal` of `transfer`) received all its bytes, under
    /// an open scope. Transports that cannot see landings (RDMA one-sided writes) never
    /// report this.
    Landed {
        /// The reservation.
        transfer: TransferRef,
        /// The page's ordinal in the transfer.
        ordinal: u32,
        /// The destination page index.
        page: u32,
        /// The page's digests, taken by the transport as its bytes landed, if it was asked
        /// to ([`ReceiverTransport::digest_landings`]) and could.
        digests: Option<LandingDigests>,
    },
    /// Receiver: the fence of `transfer` completed (after [`ReceiverTransport::fence`]
    /// returned [`Fence::Pending`]).
    Fenced(TransferRef),
    /// The path of one transfer is gone while the connection goes on: the lane it was bound
    /// to failed (RDMA, several rails: its queue pair errored; SPEC §9.2). The transport has
    /// already made sure nothing more can land through that lane (the receiver: its windows
    /// deallocated, a later fence completes at once) and reported that lane's outstanding
    /// writes failed (the sender). The session ends the transfer as on peer loss. An id that
    /// is not open is ignored.
    TransferLost(TransferId),
    /// The connection is gone: nothing more will be sent or received. Outcomes of writes
    /// still outstanding and fences still pending are reported (failed / done) before this.
    Closed(Closed),
}

/// The page digests (SPEC §6) of one landed page, one per buffer, that the transport took as
/// the page's bytes landed: each slot's bytes were digested right after the read that wrote
/// them, in order, and no other write reached the slot before the record was whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LandingDigests {
    /// The algorithm they were taken under.
    pub algorithm: DigestAlgorithm,
    /// Buffer `b`'s page digest at index `b`.
    pub per_buffer: Box<[u64]>,
}

/// How the peer went ([`Closed::PeerGone`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Gone {
    /// The peer closed its end of the stream.
    #[error("end of stream")]
    EndOfStream,
    /// The socket accepts no more bytes.
    #[error("the socket accepts no more bytes")]
    WriteZero,
    /// The socket failed.
    #[error("socket: {0}")]
    Io(std::io::ErrorKind),
    /// The peer's end of an in-process wire closed.
    #[error("the peer's end closed")]
    PeerClosed,
    /// An RDMA connection's bootstrap stream (its liveness witness) closed.
    #[error("the bootstrap connection closed")]
    BootstrapClosed,
}

impl From<&std::io::Error> for Gone {
    fn from(e: &std::io::Error) -> Self {
        Self::Io(e.kind())
    }
}

/// Why a connection is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Closed {
    /// The peer closed the connection, its process died, or the socket failed.
    PeerGone(Gone),
    /// A frame failed authentication (altered, replayed, foreign, or unauthenticated): the
    /// connection was closed and nothing more is sent to that peer (SPEC §3.11).
    Unauthentic(AuthError),
    /// The peer sent bytes that break the transport's format.
    Malformed(String),
    /// The link failed under us (RDMA: a queue pair went to the error state). Every
    /// transfer on it fails with a retryable reason.
    LinkFailed(String),
    /// This side closed it.
    Local,
    /// The peer refused the handshake after this node (the server) had accepted it and sent
    /// HELLO_ACK (SPEC §4.2): its HELLO_REJECT's code and detail.
    RefusedByPeer(kvwire_proto::wire::HelloReject),
    /// This side closed it because nothing arrived from the peer for `silent_for`, longer
    /// than the liveness timeout (SPEC §8.3): the peer is unresponsive (stopped, partitioned,
    /// or its host is down). Every transfer on it fails with a retryable reason.
    Unresponsive {
        /// How long the peer had been silent.
        silent_for: std::time::Duration,
    },
    /// This side closed it because the peer sent more PINGs within a second than any peer
    /// within the rules does (SPEC §8.3, [`kvwire_proto::liveness::PING_FLOOD_LIMIT`]): a
    /// flood. Every transfer on it fails as on peer loss.
    PingFlood {
        /// PINGs counted in the window when it was declared.
        pings: u32,
        /// From the window's first PING to the one that crossed the limit.
        within: std::time::Duration,
    },
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PeerGone(why) => write!(f, "peer gone: {why}"),
            Self::Unauthentic(e) => write!(f, "a frame failed authentication: {e}"),
            Self::Malformed(why) => write!(f, "malformed bytes from the peer: {why}"),
            Self::LinkFailed(why) => write!(f, "link failed: {why}"),
            Self::Local => f.write_str("closed by this side"),
            Self::RefusedByPeer(r) => write!(
                f,
                "the peer refused the handshake after HELLO_ACK: {}: {}",
                r.code, r.detail
            ),
            Self::Unresponsive { silent_for } => write!(
                f,
                "peer unresponsive: nothing received for {} ms",
                silent_for.as_millis()
            ),
            Self::PingFlood { pings, within } => write!(
                f,
                "PING flood: the peer sent {pings} PINGs within {} ms (more than {} a second)",
                within.as_millis(),
                kvwire_proto::liveness::PING_FLOOD_LIMIT
            ),
        }
    }
}

/// Whether a fence completed at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// Done: no write for the transfer can land any more.
    Done,
    /// Started; [`TransportEvent::Fenced`] follows when it completes.
    Pending,
}

/// Why a receiver transport could not open an access scope.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ScopeError(pub String);

/// What both roles of a transport do.
pub trait Transport: Send {
    /// Queues `frame` for the peer, after everything queued before it (frames and, on the
    /// sender, page writes of the same transfer). Sealed with the connection's
    /// authentication channel where there is one. After the connection closed, dropped.
    /// `now` is the driver's clock (every entry point takes it; most transports ignore it).
    fn send_frame(&mut self, now: Instant, frame: &Frame);

    /// Makes progress (sends what is queued, takes what arrived or completed) and returns the
    /// next event, or `Pending` having registered `cx`'s waker. `now` is the driver's clock.
    fn poll_event(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<TransportEvent>;

    /// Closes the connection from this side. Outcomes of writes still outstanding and
    /// fences still pending are then reported, then [`TransportEvent::Closed`]`(Local)`.
    fn close(&mut self, now: Instant);

    /// Holds queued writes back (`true`) or lets them go (`false`). While held, `poll_event`
    /// still reads and reports, but writes only once a batch's worth is queued; after
    /// release, the next `poll_event` writes the rest. The connection task holds writes
    /// while it handles one wake-up's inputs and the commands of the engine tasks those
    /// inputs woke, so that what they produce leaves in one system call instead of one per
    /// input (issue 12: 4 KiB transfers). Transports that post every write at once ignore it
    /// (and say so in [`Transport::coalesces_writes`]).
    fn hold_writes(&mut self, _held: bool) {}

    /// Whether [`Transport::hold_writes`] does anything: only then does the connection task
    /// spend a scheduler turn gathering the engine's next commands before releasing.
    fn coalesces_writes(&self) -> bool {
        false
    }

    /// When the transport must be polled again even if nothing wakes it (a simulated link's
    /// next delivery). Most transports never need this.
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }

    /// Since when bytes waiting to go to the peer have found no taker (the stream accepted
    /// none of them since), or `None` when nothing waits or the last write took some: the
    /// driver declares a peer that does not read unresponsive once this lasts its liveness
    /// timeout (SPEC §8.3). RDMA reports since when a queue pair's SENDs made no progress
    /// (a peer that posts no receives holds them, and the writes behind them, in
    /// receiver-not-ready retries). Transports whose writes never wait on the peer
    /// (loopback) report `None`.
    fn write_blocked_since(&self) -> Option<Instant> {
        None
    }

    /// Logs what this transport holds toward the peer (RDMA: each lane's queue pair state
    /// and what is outstanding on it): called once when the driver closes the connection
    /// for an unresponsive peer, so the log says where the connection stopped moving.
    /// Transports with nothing to add log nothing.
    fn log_state(&self) {}

    /// When bytes from the peer last arrived, part of a record included (SPEC §8.3: reading
    /// progress counts as the peer heard, so a record longer than the liveness timeout takes
    /// on a slow link does not make a live peer look silent). `None`: this transport reports
    /// only whole frames and records.
    fn last_read(&self) -> Option<Instant> {
        None
    }

    /// Lanes of this connection that failed while it went on (RDMA over several rails: a
    /// queue pair whose rail failed, SPEC §9.2 "A lane that fails"); its transfers were
    /// lost, later ones use the lanes left. A failed lane is not rebuilt within the
    /// connection: an engine that wants the rail back opens a new connection. Transports
    /// whose lanes cannot fail alone report 0.
    fn failed_lanes(&self) -> usize {
        0
    }

    /// Reservations this end (a receiver) striped over several lanes so far (RDMA, SPEC §9.2
    /// "Striping a transfer over lanes"); 0 for transports that never stripe.
    fn striped_reservations(&self) -> u64 {
        0
    }

    /// Whether a transfer whose lane fails moves to a live lane of the connection instead
    /// of failing (SPEC §9.2, "Moving a transfer off a failed lane"): both ends of a
    /// connection whose lanes can fail one by one (several RDMA queue pairs) do. The
    /// drivers turn the sessions' moves on by it.
    fn moves_transfers(&self) -> bool {
        false
    }
}

/// Frames one end holds unsent for its peer, at most, on one TCP stream or one RDMA queue
/// pair (SPEC §8.3): a peer that keeps asking for answers (PINGs, ABORTs, COMMITs, RESERVEs)
/// while it reads none of them would otherwise grow this queue for as long as the not-reading
/// verdict takes; at the limit the connection ends at once, as unresponsive.
pub(crate) const MAX_UNSENT_FRAMES: usize = 65_536;

/// The prefill side's transport: page writes out of the source memory.
pub trait SenderTransport: Transport {
    /// Page writes that may be posted now without overrunning the transport's queues.
    fn write_credit(&self) -> usize;

    /// The receiver's page slots per buffer, when its transport parameters advertise them
    /// (TCP, SPEC §9.1): the sender then refuses a reservation naming a page beyond them
    /// (§5.3.1 #7).
    fn destination_pages(&self) -> Option<u32> {
        None
    }

    /// Whether the sender driver should digest each page right after its write is reported
    /// done instead of right before it is posted (SPEC §6, digests while sending; chunks of at
    /// least [`DIGEST_AFTER_WRITE_MIN_BYTES`](crate::sender::DIGEST_AFTER_WRITE_MIN_BYTES)).
    /// Yes where that is cheaper: where a write reads its source pages on the connection's
    /// own thread and leaves them in that core's cache by the time it is reported done (TCP
    /// from host memory: the kernel copies them into the socket), the digest reads them from
    /// cache instead of memory; where a write only names the pages (a same-host pull record,
    /// SPEC §9.3), the decode copies them on its own core while this one digests them, instead
    /// of waiting for the digest before its copy can start. The driver takes a transfer's
    /// writes as done in the order it posted them (TCP's one ordered stream does that); a
    /// transport that did not would only move when each page is read, not what its digest is
    /// (the pages are pinned until the job ends). Default: no (RDMA reads the pages by DMA;
    /// device memory is digested where it is).
    fn digests_after_writes(&self) -> bool {
        false
    }

    /// Posts page writes of `transfer` into the destinations its receiver's `access`
    /// descriptor (from RESERVE) grants. Every page's outcome is reported exactly once as
    /// [`TransportEvent::WritesDone`] (refused pages, e.g. outside the descriptor, as failed).
    fn post_writes(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        access: &Arc<[u8]>,
        writes: &[PageWrite],
    );
}

/// The decode side's transport: scoped remote access to its pages, and the fence.
pub trait ReceiverTransport: Transport {
    /// Opens remote access to exactly `pages` (every buffer's slot of each) for a
    /// reservation of `transfer_id` about to be made, and returns the access descriptor
    /// RESERVE carries. On error nothing stays open.
    fn open_scope(&mut self, transfer_id: TransferId, pages: &[u32])
        -> Result<Vec<u8>, ScopeError>;

    /// The reservation for the scope last opened for `transfer.transfer_id` was made with
    /// this nonce.
    fn bind_scope(&mut self, transfer: TransferRef);

    /// The reservation was not made after all: close its scope (no peer ever saw it).
    fn abandon_scope(&mut self, transfer_id: TransferId);

    /// Access scopes open now (reserved and not fenced), for diagnostics and invariants.
    fn open_scopes(&self) -> usize;

    /// Whether this transport reports every page write that received all its bytes under
    /// an open scope as [`TransportEvent::Landed`] (TCP, loopback), so the driver can tell
    /// a reserved page that did not (SPEC §6, coverage). RDMA's one-sided writes cannot.
    fn reports_landings(&self) -> bool {
        false
    }

    /// Asks the transport to digest each page of `transfer_id`'s open scope under `alg` as
    /// its bytes land, while they are in cache, and to report the digests with
    /// [`TransportEvent::Landed`] (SPEC §6, digests at landing). A transport may ignore it
    /// (the default): the driver then digests each page when its landing is reported.
    fn digest_landings(&mut self, _transfer_id: TransferId, _alg: DigestAlgorithm) {}

    /// Closes `transfer`'s scope: the fence. After [`Fence::Done`], or once
    /// [`TransportEvent::Fenced`] is reported, no write for it can land any more.
    fn fence(&mut self, transfer: TransferRef) -> Fence;

    /// Whether this end copies its pages out of the prefill's memory itself (same-host pulls,
    /// SPEC §9.3) instead of receiving their bytes. Default: no.
    fn pulls_pages(&self) -> bool {
        false
    }
}

/// A receiver transport whose access scopes and fence are a [`ScopeTable`] it checks before
/// every landing (loopback, TCP): implementing this makes it a [`ReceiverTransport`], whose
/// fence completes at once (closing the scope turns every later byte of the transfer away).
pub trait TableScoped: Transport {
    /// The table.
    fn scopes(&self) -> &ScopeTable;

    /// The table, mutably.
    fn scopes_mut(&mut self) -> &mut ScopeTable;

    /// Called with a reservation's pages just before its scope opens.
    fn scope_opening(&mut self, _pages: &[u32]) {}

    /// The access descriptor RESERVE carries for a scope opened with `key` (default: the
    /// 4-byte key, SPEC §9.1).
    fn access_descriptor(&self, key: AccessKey) -> Vec<u8> {
        key.to_descriptor()
    }

    /// [`ReceiverTransport::pulls_pages`].
    fn pulls_pages(&self) -> bool {
        false
    }

    /// Called when `transfer`'s scope was just closed (the fence): whether writes already
    /// accepted under it are still being placed in its pages (a staging pipeline's copies
    /// into device memory). If so the fence is [`Fence::Pending`] and the transport reports
    /// [`TransportEvent::Fenced`] once they completed.
    fn fence_pending(&mut self, _transfer: TransferRef) -> bool {
        false
    }
}

impl<T: TableScoped> ReceiverTransport for T {
    fn open_scope(
        &mut self,
        transfer_id: TransferId,
        pages: &[u32],
    ) -> Result<Vec<u8>, ScopeError> {
        self.scope_opening(pages);
        let key = self.scopes_mut().open(transfer_id, pages);
        Ok(self.access_descriptor(key))
    }

    fn bind_scope(&mut self, transfer: TransferRef) {
        self.scopes_mut().bind(transfer);
    }

    fn abandon_scope(&mut self, transfer_id: TransferId) {
        self.scopes_mut().close(transfer_id);
    }

    fn open_scopes(&self) -> usize {
        self.scopes().open_scopes()
    }

    fn reports_landings(&self) -> bool {
        true
    }

    fn digest_landings(&mut self, transfer_id: TransferId, alg: DigestAlgorithm) {
        self.scopes_mut().digest_landings(transfer_id, alg);
    }

    fn pulls_pages(&self) -> bool {
        TableScoped::pulls_pages(self)
    }

    fn fence(&mut self, transfer: TransferRef) -> Fence {
        self.scopes_mut().close(transfer.transfer_id);
        if self.fence_pending(transfer) {
            Fence::Pending
        } else {
            Fence::Done
        }
    }
}
