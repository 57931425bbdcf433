//! The RDMA transport over verbs (feature `rdma`, through `sideway`).
//!
//! [`descriptor`] (always built) encodes the access descriptor a reservation carries over
//! RDMA; the rest needs the `rdma` feature: [`verbs`] wraps the device, registration, memory
//! windows and RC queue pairs, and [`driver`] runs the protocol's endpoints over them.
//!
//! Ownership encodes teardown order: a [`RegisteredMemory`] holds its memory regions, each of
//! which holds the protection domain, which holds the device context; an [`RcLink`] holds its
//! queue pair and completion queue. Dropping in any order is safe.
//!
//! Data path: page writes are RDMA WRITEs from the sender's registered pages into the
//! receiver's, posted in batches behind one doorbell, unsignaled except for the last write of
//! each page (RC completes in order, so that completion covers the page). Control frames are
//! SENDs on the **same** queue pair, so a COMMIT posted after a transfer's writes is delivered
//! after they have landed (RC ordering). The receiver keeps RECVs posted.
//!
//! Fencing: the receiver binds type-2 [`MemoryWindow`]s over a reservation's pages (on its own
//! queue pair) and hands their rkeys to the sender; [`RcLink::invalidate`] is the fence. Once
//! the invalidation completes, a write with that rkey fails at the NIC with a remote access
//! error and lands nowhere (on rxe the sender's queue pair then goes to the error state).
//! [`RcLink::recover`] rebuilds a queue pair after such an error; windows bound before the
//! reset must be replaced by freshly allocated ones (rxe refuses to rebind them).
//!
//! Not yet here: several QPs per peer, and a tokio driver (the drivers here are synchronous
//! and polled).

#[cfg(feature = "rdma")]
pub mod bootstrap;
pub mod descriptor;
#[cfg(feature = "rdma")]
pub mod driver;
#[cfg(feature = "rdma")]
pub mod verbs;

#[cfg(feature = "rdma")]
pub use verbs::{
    MemoryWindow, QpParams, RcLink, RdmaDevice, RdmaError, RdmaEvent, RdmaWrite, RegisteredMemory,
    SLOT,
};
