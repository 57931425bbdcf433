//! Drivers: the one loop per role that runs a protocol session over a transport.
//!
//! A driver owns a sans-IO session (`kvwire_proto`), the memory it moves (a [`PagePool`]
//! shared with the node) and a transport (any implementation of the seam in
//! [`crate::transport`]). It carries out the session's effects (page writes, digests, fences,
//! releases), moves frames to the transport, and feeds every transport event and effect
//! result back into the session. It is synchronous and polled, like the session, so the same
//! driver runs:
//!
//! * inside the engine's connection task (`crate::engine`), which awaits
//!   [`SenderDriver::poll_input`] / [`ReceiverDriver::poll_input`] on tokio;
//! * under the in-process `Pair` harness with simulated time (feature `testkit`).
//!
//! [`PagePool`]: crate::memory::PagePool

mod digest;
mod receiver;
mod sender;

pub use digest::DigestExecution;
pub use receiver::{
    ReceiveError, ReceiveOutcome, ReceiverDriver, ReceiverDriverStats, ReserveParams, VerifiedKv,
};
pub use sender::{SenderDriver, SenderDriverStats, StartError};
