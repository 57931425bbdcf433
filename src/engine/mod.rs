//! The public engine API over TCP: what an integrator codes against.
//!
//! A connection joins one prefill node (the [`SenderConn`] side) and one decode node (the
//! [`ReceiverConn`] side). Either side may listen; the connecting side is the handshake
//! client. Each connection is served by its own task, which owns that connection's page
//! pool and drives the sans-IO protocol session; the handles talk to it over channels.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::time::Duration;
//! use kvwire::engine::{NodeConfig, ReceiverConn, SenderConn};
//! use kvwire::proto::admission::Request;
//! use kvwire::receiver::ReserveParams;
//!
//! let config = NodeConfig::example();
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let addr = listener.local_addr()?;
//! let decode = tokio::spawn({
//!     let config = config.clone();
//!     async move { ReceiverConn::accept(&listener, &config).await }
//! });
//! let prefill = SenderConn::connect(addr, &config).await?;
//! let decode = decode.await??;
//!
//! // Decode side: reserve pages for request 7 (100 tokens) and wait for verified KV.
//! let params = ReserveParams { transfer_id: 7, tokens: 100, timeout: Duration::from_secs(5),
//!                              digest: None, page_digests: false };
//! let verified = decode.reserve(params);
//! // Prefill side: admit the request (a typed rejection otherwise), fill its pages, send.
//! let admitted = prefill.admit(Request { transfer_id: 7, tokens: 100 }).await?;
//! prefill.send(admitted, |ordinal, buffer, page| page.fill((ordinal + buffer as u32) as u8)).await?;
//! let kv = verified.await?;
//! let first = kv.read(|pages| pages.page(0, 0).to_vec()).await?;
//! assert_eq!(first[0], 0);
//! kv.release();
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(()) }).unwrap();
//! ```

mod receiver;
mod sender;
mod stream;

use std::sync::Arc;
use std::time::Duration;

use kvwire_proto::admission::AdmissionError;
use kvwire_proto::handshake::HandshakeError;
use kvwire_proto::receiver::ReceiverConfig;
use kvwire_proto::sender::SenderConfig;
use kvwire_proto::wire::{DigestAlgorithm, Hello, Role};
use kvwire_proto::FailureReason;

pub use receiver::{PagesView, ReceiverConn, ReceiverConnStats, Verified};
pub use sender::{SenderConn, SenderConnStats};

use crate::checksum::DigestMode;
use crate::config::{ConfigError, EngineConfig};
use crate::metrics::Metrics;
use crate::pool::{PoolError, PoolGeometry, Scrub};
use crate::receiver::ReceiveError;
use crate::sender::StartError;

/// Everything a node needs to open connections.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// This node's id (for logs).
    pub node_id: u64,
    /// The KV pool each connection gets: its geometry is the layout advertised in HELLO.
    pub pool: PoolGeometry,
    /// Context length and the undersized-pool override, checked against the pool as built.
    pub engine: EngineConfig,
    /// Opaque model / tensor-parallel fingerprint; peers must match exactly.
    pub fingerprint: Vec<u8>,
    /// Digest algorithms offered, preferred first.
    pub digests: Vec<DigestAlgorithm>,
    /// Scrub policy of the pool.
    pub scrub: Scrub,
    /// How long the handshake may take.
    pub handshake_timeout: Duration,
    /// Sender session settings.
    pub sender: SenderConfig,
    /// Receiver session settings.
    pub receiver: ReceiverConfig,
    /// Page writes in flight per transfer on the sender.
    pub window: u32,
    /// Digest computation; anything but [`DigestMode::Verify`] delivers unverified data and
    /// exists only to measure the integrity tax.
    pub digest_mode: DigestMode,
    /// Where the node's connections count transfers, fences and pages; `None` for no metrics.
    pub metrics: Option<Arc<Metrics>>,
    /// Transfers of at least this many bytes (default 8 MiB) are digested on tokio's blocking
    /// pool, so the connection keeps receiving (and sending) other transfers meanwhile;
    /// smaller ones inline, where a thread handoff costs more than it saves.
    pub digest_offload_bytes: u64,
}

impl NodeConfig {
    /// A small configuration for examples: 2 buffers of 4 KiB pages, 16 tokens per page,
    /// 256 pages, 4096-token context.
    pub fn example() -> Self {
        Self {
            node_id: 1,
            pool: PoolGeometry {
                tokens_per_page: 16,
                buffer_page_bytes: vec![4096, 4096],
                pages: 256,
            },
            engine: EngineConfig::new(4096),
            fingerprint: b"example-model/tp0".to_vec(),
            digests: vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32],
            scrub: Scrub::None,
            handshake_timeout: Duration::from_secs(10),
            sender: SenderConfig::default(),
            receiver: ReceiverConfig::default(),
            window: 16,
            digest_mode: DigestMode::Verify,
            metrics: None,
            digest_offload_bytes: 8 << 20,
        }
    }

    pub(crate) fn hello(&self, role: Role) -> Hello {
        Hello {
            node_id: self.node_id,
            role,
            layout: self.pool.to_layout(self.fingerprint.clone()),
            digests: self.digests.clone(),
            transport_params: Vec::new(),
        }
    }
}

/// Why a connection could not be opened or stopped working.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// Socket I/O failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The handshake failed (refused, by us or the peer, with the exact reason).
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// The engine refused to start (e.g. pool smaller than the context length).
    #[error("engine refused to start: {0}")]
    Config(#[from] ConfigError),
    /// The pool could not be built.
    #[error("pool: {0}")]
    Pool(#[from] PoolError),
    /// The peer sent bytes that are not a frame during the handshake.
    #[error("handshake stream: {0}")]
    Stream(String),
}

/// Why a transfer did not deliver.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The protocol failed it, with the typed reason (count or digest mismatch, rejection
    /// carrying the sender's original error, timeout, abort, peer loss, ...).
    #[error("transfer failed: {0}")]
    Failed(FailureReason),
    /// The reservation could not be made.
    #[error("{0}")]
    Reserve(#[from] ReceiveError),
    /// Admission rejected the request (it never reaches the transfer stage; a reservation
    /// for it is answered with REJECT carrying this error).
    #[error("rejected at admission: {0}")]
    Rejected(AdmissionError),
    /// The transfer could not start on the sender.
    #[error("{0}")]
    Start(#[from] StartError),
    /// The connection task is gone.
    #[error("connection closed")]
    ConnectionClosed,
}

impl TransferError {
    /// The protocol's failure reason, if that is what this is.
    pub fn reason(&self) -> Option<&FailureReason> {
        match self {
            Self::Failed(r) => Some(r),
            _ => None,
        }
    }
}

/// A finished digest job: the transfer and its digests.
pub(crate) type DigestDone = (
    kvwire_proto::wire::TransferRef,
    Result<kvwire_proto::wire::TransferDigests, crate::checksum::UnsupportedAlgorithm>,
);

/// Runs a digest job: inline if small (returning the result), else on the blocking pool
/// (the result arrives on `done`). The job (and with it the pin on its pages) is dropped
/// before the result is reported.
pub(crate) fn run_digest_job(
    job: crate::checksum::DigestJob,
    offload_bytes: u64,
    done: &tokio::sync::mpsc::UnboundedSender<DigestDone>,
) -> Option<DigestDone> {
    let run = move |job: crate::checksum::DigestJob| {
        let transfer = job.transfer;
        let result = job.run();
        drop(job);
        (transfer, result)
    };
    if job.bytes() < offload_bytes {
        return Some(run(job));
    }
    let done = done.clone();
    tokio::task::spawn_blocking(move || {
        let _ = done.send(run(job));
    });
    None
}

/// Opens a connection on `stream`: no Nagle delay, the handshake as `role` (client or
/// server), and the connection's pool over `memory`.
pub(crate) async fn open(
    mut stream: tokio::net::TcpStream,
    config: &NodeConfig,
    client: bool,
    role: Role,
    memory: crate::memory::KvMemory,
) -> Result<
    (
        tokio::net::TcpStream,
        kvwire_proto::handshake::Established,
        crate::pool::PagePool,
    ),
    EngineError,
> {
    use kvwire_proto::handshake::Handshake;
    stream.set_nodelay(true)?;
    let now = std::time::Instant::now();
    let hello = config.hello(role);
    let hs = if client {
        Handshake::client(now, hello, config.handshake_timeout)
    } else {
        Handshake::server(now, hello, config.handshake_timeout)
    };
    let est = stream::handshake(&mut stream, hs, config.handshake_timeout).await?;
    let pool = crate::pool::PagePool::with_memory(config.pool.clone(), memory, config.scrub)?;
    Ok((stream, est, pool))
}
