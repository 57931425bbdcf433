//! The RDMA transport over verbs (feature `rdma`, through `sideway`).
//!
//! [`descriptor`] (always built) encodes the access descriptor a reservation carries over
//! RDMA. The rest needs the `rdma` feature (and is documented with it): `verbs` wraps the device, registration, memory
//! windows, RC queue pairs and their completion channel; `RdmaSender` and `RdmaReceiver`
//! are the two ends of a connection, implementing the transport seam
//! ([`SenderTransport`](crate::transport::SenderTransport),
//! [`ReceiverTransport`](crate::transport::ReceiverTransport)); `bootstrap` sets them up
//! between two processes over a TCP connection.
//!
//! A connection has one or more RC queue pairs ("lanes", SPEC.md §9.2). The frames of one
//! transfer travel on its lane: the receiver's memory-window binds, then its RESERVE (a
//! SEND); the sender's WRITEs, then its COMMIT (a SEND), so RC ordering puts the commit after
//! the data it describes and the reservation after the windows it names. Reservations take
//! the lanes in turn. A reservation of enough pages is **striped** over several lanes
//! ([`descriptor::plan_stripes`], each rail once before any twice): each lane binds the
//! windows of its share of the pages and the sender writes that share through it; the
//! RESERVE waits for the other lanes' binds to complete, the COMMIT for every WRITE's
//! completion (RC orders nothing across queue pairs), and the fence invalidates on every
//! lane.
//!
//! **Data path.** Page writes are RDMA WRITEs (one per page and buffer) from the sender's
//! registered pages into the receiver's, batched behind one doorbell per lane per round,
//! unsignaled except for the last of every `SIGNAL_EVERY` pages and of each round (RC
//! completes in order, so that completion covers the others). Completions are waited for on
//! the connection's completion channel, registered with tokio (`AsyncFd`): the driver's task
//! sleeps until the NIC has something, instead of spinning (a busy-poll mode exists).
//!
//! **Scope and fence.** The receiver binds one type-2 `MemoryWindow` per run of consecutive
//! reserved pages and per buffer, and RESERVE carries their rkeys. The binds of a reservation
//! go behind one doorbell, unsignaled, right before its RESERVE on the same queue pair: the
//! receiver never waits for them (the send queue executes them before the RESERVE; a bind
//! that fails completes in error and breaks the link). The fence invalidates the windows,
//! behind one doorbell with only the last invalidation signaled (the send queue completes in
//! order); only when it has completed is the fence reported. A write with an invalidated rkey
//! fails at the NIC (a remote access error) and lands nowhere. Invalidated windows are bound
//! again by later reservations instead of being deallocated: each bind takes the window's next
//! key (the rkey's low byte), so the rkeys of its earlier bindings stay dead, and a window is
//! deallocated after `MemoryWindow::MAX_BINDS` binds, before its key could repeat. Devices
//! without memory windows fall back to the region's rkeys, with a warning and a counter.
//!
//! **Signaling.** Only the completions something waits for are asked for: the write that
//! closes a group of pages, the last invalidation of a fence, and every eighth control-frame
//! SEND (which frees its slot and the slots of the SENDs before it). A work request that fails
//! completes in error whether it asked for a completion or not.
//!
//! **Failure.** A failed work request or a frame that cannot be opened breaks the link: every
//! queue pair is reset at once (after which none of its work requests touches memory), every
//! window deallocated (the fence of every open reservation), every outstanding write
//! reported failed, and the connection ends with
//! [`Closed::LinkFailed`](crate::transport::Closed::LinkFailed); its transfers fail with a
//! retryable reason.
//!
//! Ownership encodes teardown order: a `RegisteredMemory` holds its memory regions, each of
//! which holds the protection domain, which holds the device context; an `RcLink` holds its
//! queue pair and completion queue. Dropping in any order is safe.

/// How long a lane's SENDs may make no progress while another lane's do before it is taken
/// as failed, unless the engine sets it (half of the default 2 s liveness timeout).
pub const DEFAULT_LANE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Bytes one queue pair takes in a HELLO's RDMA transport parameters (SPEC §9.2: qpn, psn,
/// gid, mtu).
pub const QP_PARAMS_LEN: usize = 28;

/// The most queue pairs a connection may have: what a HELLO's transport parameters (at most
/// `MAX_TRANSPORT_PARAMS`, 4 096 bytes) can list after their 4-byte header (SPEC §9.2): 146.
pub const MAX_QUEUE_PAIRS: u16 =
    ((kvwire_proto::wire::MAX_TRANSPORT_PARAMS - 4) / QP_PARAMS_LEN) as u16;

/// The default local ACK timeout exponent of a queue pair: 14, 4.096 µs x 2^14 (about
/// 67 ms), as perftest's `ib_write_bw`.
pub const DEFAULT_ACK_TIMEOUT: u8 = 14;

/// The ACK timeout exponents a queue pair may take: 0 would wait for ever, and verbs' field
/// holds 5 bits.
pub const ACK_TIMEOUTS: std::ops::RangeInclusive<u8> = 1..=31;

#[cfg(feature = "rdma")]
pub mod bootstrap;
pub mod descriptor;
#[cfg(feature = "rdma")]
mod events;
#[cfg(feature = "rdma")]
mod lanes;
#[cfg(feature = "rdma")]
mod link;
#[cfg(feature = "rdma")]
mod receiver;
#[cfg(feature = "rdma")]
mod sender;
#[cfg(feature = "rdma")]
pub mod verbs;

#[cfg(feature = "rdma")]
pub use events::EventChannel;
#[cfg(feature = "rdma")]
pub use link::{QpParams, RcLink, RdmaEvent, RdmaWrite};
#[cfg(feature = "rdma")]
pub use receiver::{RdmaReceiver, RdmaReceiverStats, RECEIVER_QUEUE_DEPTH};
#[cfg(feature = "rdma")]
pub use sender::{sender_queue_depth, RdmaSender, RdmaSenderStats, SIGNAL_EVERY};
#[cfg(feature = "rdma")]
pub use verbs::{MemoryWindow, RdmaDevice, RdmaError, RegisteredMemory, SEND_SLOTS, SLOT};
