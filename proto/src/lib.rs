//! kvwire-proto: the kvwire wire format and its sans-IO state machines.
//!
//! Nothing in this crate performs I/O, reads a clock, or touches memory it does not own:
//! time enters as an argument (`now`), frames enter as values, and every effect (a write to
//! post, a digest to compute, a fence, pages to release) leaves as a value polled by the
//! driver. The normative description is `SPEC.md` beside this crate.
#![forbid(unsafe_code)]

pub mod auth;
pub mod error;
pub mod handshake;
mod history;
pub mod liveness;
mod open;
pub mod receiver;
mod scope;
mod timers;
pub mod wire;

pub use error::{CountField, FailureReason, Wait};
pub use scope::{FrameError, Scope};
pub mod admission;
pub mod sender;
