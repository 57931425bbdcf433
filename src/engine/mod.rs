//! The public engine API: what an integrator codes against, whatever the transport.
//!
//! A connection joins one prefill node (the [`SenderConn`] side) and one decode node (the
//! [`ReceiverConn`] side). Either side may listen; the connecting side is the handshake
//! client. Each connection is served by its own task, which runs the role's driver
//! (`crate::driver`) over the connection's transport; the handles talk to it over channels.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::time::Duration;
//! use kvwire::{Node, NodeConfig, ReceiverConn, SenderConn};
//! use kvwire::proto::admission::Request;
//! use kvwire::receiver::ReserveParams;
//! use kvwire::TransferId;
//!
//! let config = NodeConfig::example();
//! let (decode_node, prefill_node) = (Node::new(config.clone())?, Node::new(config)?);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let addr = listener.local_addr()?;
//! let decode = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode_node).await });
//! let prefill = SenderConn::connect(addr, &prefill_node).await?;
//! let decode = decode.await??;
//!
//! // Decode side: reserve pages for request 7 (100 tokens) and wait for verified KV.
//! let params = ReserveParams::new(TransferId(7), 100, Duration::from_secs(5));
//! let verified = decode.reserve(params);
//! // Prefill side: admit the request (a typed rejection otherwise), fill its pages, send.
//! let admitted = prefill.admit(Request { transfer_id: TransferId(7), tokens: 100 })?;
//! prefill.send(admitted, |ordinal, buffer, page| page.fill((ordinal + buffer as u32) as u8)).await?;
//! let kv = verified.await?;
//! assert_eq!(kv.page(0, 0)?[0], 0); // the pages, read in place
//! kv.release()?;
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(()) }).unwrap();
//! ```

mod discovery;
mod listener;
mod node;
mod open;
mod receiver;
mod rooms;
mod sender;
mod streams;

use crate::config::NodeConfig;

use kvwire_proto::admission::AdmissionError;
use kvwire_proto::auth::AuthError;
use kvwire_proto::handshake::HandshakeError;
use kvwire_proto::wire::Role;
use kvwire_proto::FailureReason;

pub use crate::receiver::{ReceiveError, ReserveParams};
pub use crate::sender::{ChunkStartError, StartError};
pub(crate) use listener::failure_class;
pub use listener::{Listener, ListenerConfig, ListenerStats};
pub use node::Node;
pub use open::loopback;
pub use receiver::{ReceiverConn, ReceiverConnStats, Verified};
pub use rooms::{Rooms, Route, ROOMS_REMEMBERED};
pub use sender::{OutgoingTransfer, SenderConn, SenderConnStats};

use crate::config::ConfigError;
use crate::memory::PoolError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    /// The transport could not be set up (e.g. no RDMA device, a registration refused, the
    /// peer's queue pairs unusable, or a transport this build does not include).
    #[error("transport: {0}")]
    Transport(#[from] SetupError),
    /// The accepted stream is not a connection of its own: it joined another one as one of
    /// its extra TCP streams (SPEC §9.1, several streams; `NodeConfig::tcp_streams`). Not a
    /// failure: a listener accepting it goes on to the next.
    #[error("the stream joined another connection as one of its TCP streams")]
    StreamJoined,
    /// The accepted stream began with a join record naming no connection of this node (or
    /// one that had all its streams already): closed at once (SPEC §9.1, several streams).
    #[error("a joining TCP stream names no connection of this node ({0})")]
    StrayJoin(&'static str),
}

/// Why a connection's transport could not be set up ([`EngineError::Transport`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The node's transport is not in this build.
    #[error("this kvwire was built without the {0} transport (rebuild with `--features {0}`)")]
    NotBuilt(&'static str),
    /// `tcp_streams` beyond what a connection may run.
    #[error("tcp_streams = {asked}: at most {max} TCP streams per connection")]
    TooManyStreams {
        /// The configured count.
        asked: u16,
        /// The bound ([`MAX_STREAMS`](crate::config::MAX_STREAMS)).
        max: u16,
    },
    /// Several TCP streams over device memory (they move host memory only).
    #[error(
        "several TCP streams per connection move host memory only (device memory: tcp_streams = 1)"
    )]
    StreamsNeedHostMemory,
    /// The peer's TCP transport parameters are malformed.
    #[error("the peer's TCP transport parameters: {0}")]
    PeerParams(#[from] crate::transport::tcp::TcpParamsError),
    /// `same_host = require` and same-host pulls cannot be used with this peer (SPEC §9.3).
    #[error("same_host = require: {0}")]
    SameHost(#[from] crate::transport::same_host::SameHostError),
    /// `same_host = require` over device memory (pulls read host memory only).
    #[error("same_host = require: same-host pulls read host memory only (this node's KV memory is on a device)")]
    SameHostNeedsHostMemory,
    /// The two ends run different stream counts.
    #[error("this node runs {ours} TCP streams per connection, the peer {peer} (both ends must set the same tcp_streams)")]
    StreamCount {
        /// This node's `tcp_streams`.
        ours: u16,
        /// The peer's.
        peer: u16,
    },
    /// The client could not open its extra streams in time.
    #[error("the connection's {streams} TCP streams could not be opened within {} ms", within.as_millis())]
    StreamsNotOpened {
        /// The connection's streams.
        streams: u16,
        /// The handshake timeout.
        within: std::time::Duration,
    },
    /// The server did not see every extra stream join in time.
    #[error("{joined} of the connection's {expected} extra TCP streams joined within {} ms", within.as_millis())]
    StreamsNotJoined {
        /// How many joined.
        joined: usize,
        /// How many were expected.
        expected: usize,
        /// The handshake timeout.
        within: std::time::Duration,
    },
    /// Another connection of this node already uses the client's stream token.
    #[error("another connection already uses this client's stream token")]
    TokenInUse,
    /// A stream of the connection is missing.
    #[error("a TCP stream of the connection did not join")]
    StreamMissing,
    /// A loopback connection between a node and itself.
    #[error("loopback needs two nodes: a node cannot send into its own memory")]
    LoopbackSameNode,
    /// A loopback connection over device memory.
    #[error("loopback moves host memory only: a node with device memory connects over TCP")]
    LoopbackDeviceMemory,
    /// An RDMA device, registration or queue pair failed, or the peer's queue pair
    /// parameters are unusable.
    #[cfg(feature = "rdma")]
    #[error(transparent)]
    Rdma(#[from] crate::transport::rdma::bootstrap::BootstrapError),
}

impl From<crate::transport::ConnectError> for EngineError {
    fn from(e: crate::transport::ConnectError) -> Self {
        use crate::transport::ConnectError as C;
        match e {
            C::Io(e) => Self::Io(e),
            C::Handshake(e) => Self::Handshake(e),
            C::Stream(s) => Self::Stream(s),
        }
    }
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
    /// A chunk of a transfer sent in chunks was refused (the transfer goes on).
    #[error("{0}")]
    Chunk(crate::sender::ChunkStartError),
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

    /// Whether the same request may be tried again, on a new connection if this one is
    /// gone (open it over the same [`Node`]: the memory stays registered): the transfer
    /// failed in the transport (the connection or queue pair was lost, a write failed, a
    /// deadline passed) or the pool was momentarily full, not because of what was sent.
    /// Rejections, digest mismatches, aborts and authentication failures are not.
    pub fn is_retryable(&self) -> bool {
        use crate::receiver::ReceiveError as R;
        use crate::sender::StartError as S;
        use kvwire_proto::receiver::ReserveError;
        use kvwire_proto::sender::SubmitError;
        match self {
            Self::Failed(r) => r.is_retryable(),
            Self::ConnectionClosed => true,
            Self::Reserve(R::Reserve(ReserveError::PeerLost) | R::Pool(_)) => true,
            Self::Start(S::OutOfPages { .. } | S::Session(SubmitError::PeerLost(_))) => true,
            Self::Chunk(crate::sender::ChunkStartError::Session(
                kvwire_proto::sender::ChunkError::PeerLost,
            )) => true,
            _ => false,
        }
    }
}

/// Where a connection of a node with `config` digests (both roles alike): jobs of at least
/// `digest_offload_bytes` (or the transport's threshold) on the blocking pool, over up to
/// `digest_threads` threads each.
fn digest_execution(config: &NodeConfig) -> crate::driver::DigestExecution {
    crate::driver::DigestExecution::Offload {
        min_bytes: config
            .digest_offload_bytes
            .unwrap_or_else(|| config.transport.default_digest_offload_bytes()),
        threads: match config.digest_threads {
            0 => crate::driver::default_digest_threads(),
            n => n,
        },
    }
}

/// A stream whose handshake completed: the stream, the session parameters and the
/// connection's authentication channel.
pub(crate) type Handshaken = (
    tokio::net::TcpStream,
    kvwire_proto::handshake::Established,
    kvwire_proto::auth::AuthChannel,
);

/// The handshake on a fresh stream as `role` (client or server), with this node's hello
/// carrying `transport_params` and the peer's checked by `transport_check` (SPEC §4.3 #7),
/// within `timeout` (the node's handshake timeout, less what the connection already spent);
/// returns the established session parameters and the
/// connection's authentication channel.
pub(crate) async fn handshake(
    stream: tokio::net::TcpStream,
    config: &NodeConfig,
    client: bool,
    role: Role,
    (transport_params, transport_check): (Vec<u8>, Option<kvwire_proto::handshake::TransportCheck>),
    timeout: std::time::Duration,
    on_frame: &mut (dyn FnMut(&kvwire_proto::wire::Frame) + Send),
) -> Result<Handshaken, EngineError> {
    let mut hello = config.hello(role);
    hello.transport_params = transport_params;
    handshake_hello(
        stream,
        config,
        client,
        hello,
        transport_check,
        timeout,
        on_frame,
    )
    .await
}

/// [`handshake`] with `hello` as this node's (the conformance kit's misbehaving HELLOs).
pub(crate) async fn handshake_hello(
    mut stream: tokio::net::TcpStream,
    config: &NodeConfig,
    client: bool,
    hello: kvwire_proto::wire::Hello,
    transport_check: Option<kvwire_proto::handshake::TransportCheck>,
    timeout: std::time::Duration,
    on_frame: &mut (dyn FnMut(&kvwire_proto::wire::Frame) + Send),
) -> Result<Handshaken, EngineError> {
    use kvwire_proto::handshake::Handshake;
    stream.set_nodelay(true)?;
    let now = std::time::Instant::now();
    let mut hs = if client {
        Handshake::client(now, hello, timeout)
    } else {
        Handshake::server(now, hello, timeout)
    }
    .naming_timeout(config.handshake_timeout);
    if let Some(check) = transport_check {
        hs = hs.checking_transport(check);
    }
    let mut channel = config.auth.channel(client)?;
    if channel.is_authenticated() {
        hs = hs.with_confirmation();
    }
    let est = crate::transport::stream::handshake(&mut stream, hs, &mut channel, timeout, on_frame)
        .await?;
    Ok((stream, est, channel))
}

/// The failure an engine reports for a transfer the protocol failed: an authentication
/// failure that closed the connection is reported as such rather than as a peer loss.
pub(crate) fn transfer_error(
    reason: FailureReason,
    closed: Option<&crate::transport::Closed>,
) -> TransferError {
    match (&reason, closed) {
        (FailureReason::PeerLost, Some(crate::transport::Closed::Unauthentic(e))) => {
            TransferError::Unauthenticated(e.clone())
        }
        _ => TransferError::Failed(reason),
    }
}

/// How a connection's task logs failed transfers: while the connection is up, each at WARN;
/// once it is gone, each at DEBUG, and one WARN line for the loss with the transfers it
/// took, counted by reason (a killed peer with a thousand queued transfers is one line).
#[derive(Debug)]
pub(crate) struct FailureLog {
    role: &'static str,
    peer: u64,
    lost: std::collections::BTreeMap<String, u64>,
    summarized: bool,
}

impl FailureLog {
    pub(crate) fn new(role: &'static str, peer: u64) -> Self {
        Self {
            role,
            peer,
            lost: std::collections::BTreeMap::new(),
            summarized: false,
        }
    }

    /// A transfer failed; `closed` says whether the connection is gone.
    pub(crate) fn failed(
        &mut self,
        span: &tracing::Span,
        transfer: kvwire_proto::wire::TransferRef,
        reason: &FailureReason,
        closed: bool,
    ) {
        let (id, peer) = (transfer.transfer_id.0, self.peer);
        if closed {
            *self.lost.entry(reason.code().to_string()).or_default() += 1;
            span.in_scope(|| tracing::debug!(transfer_id = id, peer, %reason, "transfer failed"));
        } else {
            span.in_scope(|| tracing::warn!(transfer_id = id, peer, %reason, "transfer failed"));
        }
    }

    /// Once the connection is gone and nothing is open any more: the one summary line.
    pub(crate) fn summarize(&mut self, closed: Option<&crate::transport::Closed>, open: usize) {
        let Some(why) = closed else { return };
        if self.summarized || open > 0 {
            return;
        }
        self.summarized = true;
        let failed: u64 = self.lost.values().sum();
        let by_reason = self
            .lost
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        if failed > 0 {
            tracing::warn!(role = self.role, peer = self.peer, %why, failed, "connection lost; {failed} open transfers failed ({by_reason})");
        } else {
            tracing::info!(role = self.role, peer = self.peer, %why, "connection ended with nothing open");
        }
    }
}

/// A connection's task: a driver, and the engine's side of it (who waits for what).
pub(crate) trait ConnectionTask {
    /// A command from the engine's handles.
    type Command;
    /// The driver.
    type Driver: crate::driver::Driver;
    /// The driver.
    fn driver(&mut self) -> &mut Self::Driver;
    /// Hands finished transfers to whoever waits for them (and publishes metrics).
    fn report(&mut self);
    /// Carries out a command.
    fn command(&mut self, command: Self::Command);
}

/// Inputs a connection task handles per wake-up at most (then it reports and polls again).
const INPUT_BATCH: usize = 64;

/// Handles up to [`INPUT_BATCH`] inputs; `Ready` if any was handled. With `hold`, the
/// transport's writes are held from the first input on (what the rest produce joins it).
fn poll_inputs<D: crate::driver::Driver>(
    driver: &mut D,
    cx: &mut std::task::Context<'_>,
    hold: bool,
) -> std::task::Poll<()> {
    let mut handled = false;
    for _ in 0..INPUT_BATCH {
        if driver
            .poll_input(cx, std::time::Instant::now())
            .is_pending()
        {
            break;
        }
        if hold && !handled {
            driver.hold_writes(true);
        }
        handled = true;
    }
    if handled {
        std::task::Poll::Ready(())
    } else {
        std::task::Poll::Pending
    }
}

/// Runs a connection's task until every engine handle is gone and nothing is open: waits for
/// the driver's next input, an engine command, or the driver's deadline, whichever first.
///
/// **Write coalescing.** What one wake-up produces leaves in one write: while the task handles
/// a batch of inputs the transport holds its writes; then the task reports (waking the engine
/// tasks whose transfers finished), yields once (when two or more transfers are open and the
/// transport coalesces: TCP; RDMA and loopback post every write at once) so that
/// those tasks run and queue their next commands, takes those commands, and only then lets
/// the writes go. With 100 single-page transfers in flight this cut the system calls per
/// transfer several-fold (docs/BENCHMARKS.md); a large batch still goes out in parts
/// ([`crate::transport::Transport::hold_writes`]) so that the peer is never idle for long.
/// Hands finished transfers over; first, if the connection ended, says so to the handles
/// (`is_closed`), so that no transfer reported failed by it can see it still up: a transfer
/// about to pick a connection never picks one whose peer is already gone.
fn report<T: ConnectionTask>(task: &mut T, shared: &TaskReport) {
    use crate::driver::Driver;
    if let Some(why) = Driver::closed(task.driver()) {
        shared.why.get_or_init(|| why.clone());
        shared.flag.store(true, Ordering::Release);
    }
    shared
        .failed_lanes
        .store(Driver::failed_lanes(task.driver()), Ordering::Relaxed);
    shared
        .open
        .store(Driver::open_transfers(task.driver()), Ordering::Relaxed);
    task.report();
}

/// A per-process connection number for metric labels, unique across both roles.
pub(crate) fn next_connection_label() -> crate::metrics::Connection {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    crate::metrics::Connection {
        connection: NEXT.fetch_add(1, Ordering::Relaxed).to_string(),
    }
}

/// What a connection's task last reported, shared with the engine handles: whether the
/// connection ended and why, its failed lanes and its open transfers.
#[derive(Debug, Default)]
pub(crate) struct TaskReport {
    flag: AtomicBool,
    why: std::sync::OnceLock<crate::transport::Closed>,
    /// The connection's failed lanes and open transfers as its task last reported them.
    failed_lanes: std::sync::atomic::AtomicUsize,
    open: std::sync::atomic::AtomicUsize,
}

impl TaskReport {
    /// Whether the connection ended (its peer lost, it closed, or its task finished).
    pub(crate) fn is_set(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Why the connection ended, once it has.
    pub(crate) fn why(&self) -> Option<crate::transport::Closed> {
        self.why.get().cloned()
    }

    /// The connection's failed lanes, as its task last reported.
    pub(crate) fn failed_lanes(&self) -> usize {
        self.failed_lanes.load(Ordering::Relaxed)
    }

    /// The connection's open transfers, as its task last reported.
    pub(crate) fn open_transfers(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }
}

pub(crate) async fn run_task<T: ConnectionTask>(
    mut task: T,
    mut commands: tokio::sync::mpsc::UnboundedReceiver<T::Command>,
    shared: Arc<TaskReport>,
) {
    use crate::driver::Driver;
    use std::time::Instant;
    let far = std::time::Duration::from_secs(3600);
    let mut engine_open = true;
    // One timer for the task's life, moved when the deadline moves (not one per wake-up).
    let sleep = tokio::time::sleep(far);
    tokio::pin!(sleep);
    // Writes are held (or commands were handled) since the last release.
    let mut held = false;
    loop {
        report(&mut task, &shared);
        if held {
            held = false;
            // Only worth a scheduler turn when the transport coalesces what it holds and other
            // transfers are under way: with one (or none) in flight nothing would join the
            // write, and the answer goes out at once.
            if task.driver().coalesces_writes() && task.driver().open_transfers() >= 2 {
                tokio::task::yield_now().await;
            }
            for _ in 0..INPUT_BATCH {
                match commands.try_recv() {
                    Ok(c) => task.command(c),
                    // Empty, or every handle gone (the next `recv` sees it).
                    Err(_) => break,
                }
            }
            task.driver().hold_writes(false);
            // Released: this pass writes what is queued (and handles whatever came in).
            let _ = std::future::poll_fn(|cx| {
                let _ = poll_inputs(task.driver(), cx, false);
                std::task::Poll::Ready(())
            })
            .await;
            report(&mut task, &shared);
        }
        // Checked before waiting: once every engine handle is gone and nothing is open,
        // nothing more can happen on this connection (its pool lives on in the verified
        // handles the engine still holds).
        if !engine_open && task.driver().open_transfers() == 0 {
            shared.flag.store(true, Ordering::Release);
            return;
        }
        let wake = task
            .driver()
            .poll_timeout()
            .map(tokio::time::Instant::from_std)
            .unwrap_or_else(|| tokio::time::Instant::now() + far);
        if sleep.deadline() != wake {
            sleep.as_mut().reset(wake);
        }
        enum Wake<C> {
            Input,
            Command(Option<C>),
            Deadline,
        }
        let woke = tokio::select! {
            // Inputs first: the first poll after a release writes what was held.
            biased;
            // Up to INPUT_BATCH inputs per wake-up: what arrived together is handled together
            // (and the transport writes the answers together) before the task reports.
            _ = std::future::poll_fn(|cx| poll_inputs(task.driver(), cx, true)) => Wake::Input,
            c = commands.recv(), if engine_open => Wake::Command(c),
            _ = &mut sleep => Wake::Deadline,
        };
        match woke {
            Wake::Input => held = true,
            Wake::Command(Some(c)) => {
                held = true;
                task.command(c);
                // Commands that queued meanwhile, in order (a disconnection is seen by the
                // next `recv`).
                for _ in 1..INPUT_BATCH {
                    match commands.try_recv() {
                        Ok(c) => task.command(c),
                        Err(_) => break,
                    }
                }
            }
            Wake::Command(None) => {
                // Every engine handle is gone: close the connection; open transfers fail
                // safely (fenced and released, or drained) as it ends.
                engine_open = false;
                task.driver().close(Instant::now());
            }
            Wake::Deadline => task.driver().handle_timeout(Instant::now()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::digest_execution;
    use crate::config::{NodeConfig, TransportConfig};
    use crate::driver::DigestExecution;

    fn threshold(config: &NodeConfig) -> u64 {
        match digest_execution(config) {
            DigestExecution::Offload { min_bytes, .. } => min_bytes,
            DigestExecution::Inline => panic!("a node's connections always may offload"),
        }
    }

    /// Unset, the threshold is the transport's: RDMA digests every transfer on the blocking
    /// pool (the connection's thread only posts and completes work requests), TCP none (it
    /// digests each page right after the connection's thread copied it); a threshold the
    /// node sets wins on both.
    #[test]
    fn the_digest_offload_threshold_is_the_transports_unless_the_node_sets_one() {
        let mut tcp = NodeConfig::example();
        assert_eq!(tcp.digest_offload_bytes, None);
        assert_eq!(threshold(&tcp), u64::MAX, "inline, after each copy");
        let mut rdma = NodeConfig::example();
        rdma.transport = TransportConfig::rdma(Some("rxe0"));
        assert_eq!(threshold(&rdma), 1, "every transfer with page bytes");
        tcp.digest_offload_bytes = Some(1 << 20);
        rdma.digest_offload_bytes = Some(32 << 20);
        assert_eq!(threshold(&tcp), 1 << 20);
        assert_eq!(threshold(&rdma), 32 << 20);
    }
}
