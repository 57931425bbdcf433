//! The test kit (cargo feature `testkit`): what tests, fuzzers and benchmarks of kvwire and of
//! integrations use to drive both ends of a connection and make them misbehave. Not for
//! production builds.
//!
//! * [`FaultySender`] / [`FaultyReceiver`] wrap any transport and injects the faults of a shared [`FaultPlan`] at the
//!   seam every driver talks to: lost, duplicated, corrupted, truncated, reordered or late
//!   page writes; lost, duplicated, delayed or corrupted frames; a side that crashes or
//!   aborts just before a protocol step.
//! * [`Pair`] runs the production drivers of both roles over such transports: over loopback
//!   with simulated time (deterministic), over TCP or RDMA in real time.
//! * [`conformance`] plays a scripted prefill against any implementation's listening decode,
//!   and a scripted decode for its connecting prefill (`kvwire conform`).

pub mod conformance;
mod faults;
mod pair;

pub use faults::{Fault, FaultPlan, FaultRule, FaultyReceiver, FaultySender, Request, Side, Step};
pub use pair::{first_pattern_mismatch, handshake, kv_pattern, Pair, PairConfig, PairError};
