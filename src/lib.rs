//! kvwire: a KV-cache transfer engine for disaggregated LLM inference.
//!
//! See the crate README and `proto/SPEC.md`.
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub use kvwire_proto as proto;

pub mod checksum;
pub mod config;
pub mod driver;
pub mod engine;
pub mod host;
pub mod memory;
pub mod metrics;
pub mod receiver;
pub mod sender;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod transport;
