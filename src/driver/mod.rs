//! The drivers' shared core: what the one loop per role (`crate::sender::SenderDriver`,
//! `crate::receiver::ReceiverDriver`) has in common, whatever its role.
//!
//! A driver owns a sans-IO session (`kvwire_proto`), the memory it moves (a [`PagePool`]
//! shared with the node) and a transport (any implementation of the seam in
//! [`crate::transport`]). It carries out the session's effects (page writes, digests, fences,
//! releases), moves frames to the transport, and feeds every transport event and effect
//! result back into the session. It is synchronous and polled, like the session, so the same
//! driver runs:
//!
//! * inside the engine's connection task (`crate::engine`), which awaits
//!   [`Driver::poll_input`] on tokio;
//! * under the in-process `Pair` harness with simulated time (feature `testkit`).
//!
//! [`PagePool`]: crate::memory::PagePool

pub(crate) mod core;
mod digest;

pub use digest::{default_digest_threads, DigestExecution, MIN_PART_BYTES};

use std::task::{Context, Poll};
use std::time::Instant;

use crate::transport::Closed;

/// What every driver does, whatever its role: what its connection's task (or a harness)
/// calls to run it.
pub trait Driver {
    /// Waits for the next input (a transport event, or a digest job finished elsewhere) and
    /// handles it; `Ready` when something was handled.
    fn poll_input(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<()>;
    /// Holds the transport's queued writes back, or lets them go at the next
    /// [`Driver::poll_input`] ([`crate::transport::Transport::hold_writes`]).
    fn hold_writes(&mut self, held: bool);
    /// Whether the transport coalesces held writes
    /// ([`crate::transport::Transport::coalesces_writes`]).
    fn coalesces_writes(&self) -> bool;
    /// When [`Driver::handle_timeout`] must next be called.
    fn poll_timeout(&mut self) -> Option<Instant>;
    /// Handles the passage of time.
    fn handle_timeout(&mut self, now: Instant);
    /// Closes the connection from this side; open transfers fail safely as it ends.
    fn close(&mut self, now: Instant);
    /// Transfers still open.
    fn open_transfers(&self) -> usize;
    /// Lanes that failed while the connection went on
    /// ([`crate::transport::Transport::failed_lanes`]).
    fn failed_lanes(&self) -> usize;
    /// Why the connection closed, once it has.
    fn closed(&self) -> Option<&Closed>;
}
