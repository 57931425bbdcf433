//! kvwire: a KV-cache transfer engine for disaggregated LLM inference, with an integrity
//! protocol (`proto/SPEC.md`): a decode engine reserves pages, a prefill engine writes its
//! KV pages into them over TCP, RDMA or an in-process loopback, and the decode side hands
//! out only transfers whose digests, computed over the memory that actually landed after a
//! fence, match the sender's.
//!
//! What an integrator uses is re-exported here: open connections with a [`NodeConfig`]
//! ([`ReceiverConn`] on the decode side, [`SenderConn`] on the prefill side), reserve with
//! [`ReserveParams`], admit a [`Request`], and get a [`Verified`] handle (read in place) or a
//! typed [`TransferError`].
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::time::Duration;
//! use kvwire::{Auth, Node, NodeConfig, PoolGeometry, ReceiverConn, Request, ReserveParams, SenderConn, TransferId};
//!
//! // Both nodes: the same KV layout (2 buffers of 4 KiB pages, 16 tokens per page), a pool
//! // that holds the advertised context, and the same pre-shared key.
//! let pool = PoolGeometry { tokens_per_page: 16, buffer_page_bytes: vec![4096, 4096], pages: 256 };
//! let config = NodeConfig::builder(pool, 4096)
//!     .fingerprint("example-model/tp0")
//!     .auth(Auth::ephemeral())
//!     .build()?;
//!
//! // Each engine registers its KV memory once (here kvwire allocates it); every connection
//! // of the node shares it.
//! let decode_node = Node::new(config.clone())?;
//! let prefill_node = Node::new(config)?;
//!
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let addr = listener.local_addr()?;
//! let decode = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode_node).await });
//! let prefill = SenderConn::connect(addr, &prefill_node).await?;
//! let decode = decode.await??;
//!
//! // Decode: reserve pages for request 7 (100 tokens) and wait for verified KV.
//! let id = TransferId(7);
//! let verified = decode.reserve(ReserveParams::new(id, 100, Duration::from_secs(5)));
//! // Prefill: admit the request (a typed rejection otherwise), fill its pages, send.
//! let admitted = prefill.admit(Request { transfer_id: id, tokens: 100 })?;
//! prefill.send(admitted, |ordinal, buffer, page| page.fill((ordinal + buffer as u32) as u8)).await?;
//! let kv = verified.await?;
//! assert_eq!(kv.page(0, 1)?[0], 1); // read in place, no copy
//! kv.release()?; // the pages are back in the pool when this returns
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(()) }).unwrap();
//! ```
//!
//! The layers, bottom up (each imports only those below it): [`proto`] (wire format and
//! sans-IO sessions), [`memory`] (registered KV memory, the page pool, access scopes) and
//! [`checksum`], `transport` (the seam, and the loopback, TCP and RDMA transports),
//! `driver` (the drivers' shared core), `sender` and `receiver` (each role's driver),
//! [`engine`] (the async API), [`polled`] (a poll-style synchronous facade over it, for
//! scheduler loops and the C ABI); [`config`] describes a node; [`discovery`] finds peers (an
//! embedded bootstrap server, or etcd with the `etcd` feature); [`gpu`] computes the same
//! digests on a GPU (feature `cuda` for the device side; the kernel source and its CPU test
//! are always built).
//!
//! The transport seam, the drivers and the transports' own types are public only with the
//! feature `unstable` (no stability promise: for kvwire's own tests, the `Pair` harness of
//! the feature `testkit`, and new transports); an integrator needs none of them.
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
// Without `unstable`, the seam's and the drivers' items that only tests and the harness use
// are unreachable; with it (as every test build has it) they are public and linted as such.
#![cfg_attr(not(feature = "unstable"), allow(dead_code, unused_imports))]

pub use kvwire_proto as proto;

pub mod checksum;
pub mod config;
pub mod discovery;
#[cfg(feature = "unstable")]
pub mod driver;
#[cfg(not(feature = "unstable"))]
pub(crate) mod driver;
pub mod engine;
pub mod gpu;
pub mod host;
pub mod memory;
pub mod metrics;
pub mod polled;
#[cfg(feature = "unstable")]
pub mod receiver;
#[cfg(not(feature = "unstable"))]
pub(crate) mod receiver;
#[cfg(feature = "unstable")]
pub mod sender;
#[cfg(not(feature = "unstable"))]
pub(crate) mod sender;
#[cfg(feature = "testkit")]
pub mod testkit;
#[cfg(feature = "unstable")]
pub mod transport;
#[cfg(not(feature = "unstable"))]
pub(crate) mod transport;

pub use config::{
    Auth, ConfigError, EngineConfig, NodeConfig, NodeConfigBuilder, SameHost, TransportConfig,
};
pub use engine::{
    loopback, ChunkStartError, EngineError, Listener, ListenerConfig, Node, OutgoingTransfer,
    ReceiveError, ReceiverConn, ReceiverConnStats, ReserveParams, SenderConn, SenderConnStats,
    SetupError, StartError, TransferError, Verified,
};
pub use memory::{Holder, KvMemory, PagePool, PoolError, PoolGeometry, Scrub};
pub use proto::admission::{AdmissionError, Admitted, Request};
pub use proto::wire::{DigestAlgorithm, ErrorCode, TransferId, TransferRef};
pub use proto::FailureReason;
