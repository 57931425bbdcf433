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
pub(crate) mod stream;

use std::sync::Arc;
use std::time::Duration;

use kvwire_proto::admission::AdmissionError;
use kvwire_proto::auth::{AuthChannel, AuthError, Nonce, Opener, Psk, Sealer};
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
    /// Peer authentication: a pre-shared key both ends must hold, or explicitly off.
    pub auth: Auth,
    /// RDMA: RC queue pairs per connection (both ends must agree; transfers take them in
    /// turn). Ignored by TCP.
    pub rdma_queue_pairs: u16,
}

/// Whether a node authenticates its peers (SPEC.md §3.11, §4.8). Its `Debug` form never
/// shows the key.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Auth {
    /// Peers must hold this pre-shared key: the handshake proves it both ways and every frame
    /// after it carries an HMAC-SHA256 tag under per-connection keys.
    Psk(Psk),
    /// No authentication (`auth.mode = "off"`, `--insecure-no-auth`): any peer that reaches
    /// the endpoint with the right layout can connect, and frames can be forged on the path.
    Off,
}

impl Auth {
    /// A fresh random 32-byte key, for the two ends of a connection in one process (the
    /// in-process bench, tests, examples).
    ///
    /// # Panics
    /// If the operating system has no random source.
    pub fn ephemeral() -> Self {
        let key: [u8; 32] = random_bytes().expect("the OS random source");
        Self::Psk(Psk::new(key.to_vec()).expect("32 bytes is a valid key length"))
    }

    /// Whether peers are authenticated.
    pub fn is_on(&self) -> bool {
        matches!(self, Self::Psk(_))
    }

    /// What `kvwire doctor` and logs may print: "psk (key id ...)" or "off".
    pub fn describe(&self) -> String {
        match self {
            Self::Psk(k) => format!("psk (key id {}, {} bytes)", k.id(), k.len()),
            Self::Off => "off".into(),
        }
    }

    /// The channel for one new connection, with a fresh nonce.
    pub(crate) fn channel(&self, client: bool) -> std::io::Result<AuthChannel> {
        Ok(match self {
            Self::Off => AuthChannel::off(),
            Self::Psk(k) => {
                let nonce: Nonce = random_bytes()?;
                if client {
                    AuthChannel::client(k.clone(), nonce)
                } else {
                    AuthChannel::server(k.clone(), nonce)
                }
            }
        })
    }
}

/// `N` bytes from the operating system's random source.
pub fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(b)
}

impl NodeConfig {
    /// A small configuration for examples: 2 buffers of 4 KiB pages, 16 tokens per page,
    /// 256 pages, 4096-token context, authenticated with a fresh random key (so only clones
    /// of this configuration can connect to each other; set `auth` for real peers).
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
            auth: Auth::ephemeral(),
            rdma_queue_pairs: 1,
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

impl EngineError {
    /// The wire code of a handshake refusal (by either side), e.g. `AUTH_FAILED`.
    pub fn refusal_code(&self) -> Option<kvwire_proto::wire::ErrorCode> {
        match self {
            Self::Handshake(HandshakeError::Refused(r) | HandshakeError::RefusedByPeer(r)) => {
                Some(r.code)
            }
            _ => None,
        }
    }
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
    /// The peer sent a frame that failed authentication (altered, replayed, from another
    /// connection, or unauthenticated): the connection was closed and its open transfers
    /// failed safely (fenced, pages released).
    #[error("connection closed: {0}")]
    Unauthenticated(AuthError),
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
) -> Result<Opened, EngineError> {
    use kvwire_proto::handshake::Handshake;
    stream.set_nodelay(true)?;
    let now = std::time::Instant::now();
    let hello = config.hello(role);
    let mut hs = if client {
        Handshake::client(now, hello, config.handshake_timeout)
    } else {
        Handshake::server(now, hello, config.handshake_timeout)
    };
    let mut channel = config.auth.channel(client)?;
    if channel.is_authenticated() {
        hs = hs.with_confirmation();
    }
    let est = stream::handshake(&mut stream, hs, &mut channel, config.handshake_timeout).await?;
    let pool = crate::pool::PagePool::with_memory(config.pool.clone(), memory, config.scrub)?;
    let (sealer, opener) = channel.split();
    Ok(Opened {
        stream,
        est,
        pool,
        sealer,
        opener,
    })
}

/// A connection after its handshake.
pub(crate) struct Opened {
    pub(crate) stream: tokio::net::TcpStream,
    pub(crate) est: kvwire_proto::handshake::Established,
    pub(crate) pool: crate::pool::PagePool,
    /// Seals the frames this node sends.
    pub(crate) sealer: Sealer,
    /// Opens the frames the peer sends.
    pub(crate) opener: Opener,
}
