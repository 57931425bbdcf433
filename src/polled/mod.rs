//! A poll-style, synchronous facade over the [`engine`](crate::engine) API, for engines that
//! drive transfers from a scheduler loop instead of an async runtime, and for the bindings
//! that sit on it (the C ABI crate `kvwire-capi`; the shape is SGLang's `KVManager`,
//! `KVSender`, `KVReceiver` and `KVPoll`).
//!
//! * A [`Manager`] owns a background tokio runtime and one [`Node`] over the engine's own KV
//!   buffers, registered by pointer ([`KvBuffer`]: base pointer, length, bytes per page, as
//!   SGLang's `kv_data_ptrs`, `kv_data_lens`, `kv_item_lens`); it listens and accepts, or
//!   connects, over the node's transport (TCP, or RDMA in builds with the `rdma` feature).
//! * Per request (a room: a [`TransferId`] both engines know) a [`ReceiverTransfer`] on the
//!   decode side ([`ReceiverTransfer::init`] with the engine's destination pages reserves
//!   them) and a [`SenderTransfer`] on the prefill side ([`SenderTransfer::init`] admits and
//!   opens it, [`SenderTransfer::send`] sends each chunk from the engine's pages in place).
//! * `poll()` returns a [`KvPoll`] at once and never blocks; `wait(timeout)` blocks until the
//!   transfer ended or the timeout passed; `failure()` gives the typed [`Error`] of a failed
//!   transfer (a stable numeric code per reason, the wire code that came with it,
//!   retryable or not).
//!
//! Nothing here adds protocol logic: every call is one call of the engine API, run on the
//! manager's runtime. The engine's memory contract is [`Node`]'s: kvwire writes only pages
//! reserved by an open receiver transfer, reads only pages of an outgoing one, and the
//! engine must not write (or reuse) a page until [`ReceiverTransfer::release`] or
//! [`SenderTransfer::clear`] returned, which happens only once kvwire holds none of them.
//!
//! ```
//! use std::time::Duration;
//! use kvwire::polled::{KvBuffer, KvPoll, Manager, ManagerConfig, Role};
//! use kvwire::{Auth, TransferId};
//!
//! // Each engine's KV cache: 2 buffers of 64 pages of 4 KiB (leaked: it must outlive the
//! // manager and every transfer, as an engine's cache does).
//! fn cache() -> Vec<KvBuffer> {
//!     (0..2)
//!         .map(|_| {
//!             let b: &'static mut [u8] = Box::leak(vec![0u8; 64 * 4096].into_boxed_slice());
//!             KvBuffer { ptr: b.as_mut_ptr(), len: b.len(), page_bytes: 4096 }
//!         })
//!         .collect()
//! }
//! let auth = Auth::ephemeral(); // a pre-shared key both engines hold
//! let (prefill_kv, decode_kv) = (cache(), cache());
//! let config = |role| ManagerConfig::new(role, 16, 1024, auth.clone()).fingerprint("model/tp0");
//! // SAFETY: the buffers live for the whole process, do not overlap, and neither engine
//! // writes a page kvwire holds.
//! let decode = unsafe { Manager::new(config(Role::Decode), &decode_kv) }?;
//! let prefill = unsafe { Manager::new(config(Role::Prefill), &prefill_kv) }?;
//! let addr = decode.listen("127.0.0.1:0")?;
//! prefill.connect(&addr.to_string())?;
//!
//! // Request 7: 40 tokens = 3 pages, into decode pages 9, 2, 30, from prefill pages 0, 1, 2.
//! let room = TransferId(7);
//! let rx = decode.receiver(room, None)?;
//! rx.init(vec![9, 2, 30], 40, Duration::from_secs(10))?;
//! let tx = prefill.sender(room, None)?;
//! tx.init(3, 40)?;
//! tx.send(&[0, 1], None)?; // the first chunk
//! tx.send(&[2], Some(b"first-token:42"))?; // the final chunk, with the aux record
//! assert_eq!(rx.wait(Duration::from_secs(10)), KvPoll::Success);
//! assert_eq!(tx.wait(Duration::from_secs(10)), KvPoll::Success);
//! assert_eq!(rx.page_indices()?, vec![9, 2, 30]);
//! assert_eq!(rx.aux()?, b"first-token:42");
//! rx.release()?; // kvwire holds none of pages 9, 2, 30 any more
//! tx.clear()?;
//! # Ok::<(), kvwire::polled::Error>(())
//! ```

mod error;
mod receiver;
mod sender;

pub use error::{Error, ErrorKind};
pub use receiver::ReceiverTransfer;
pub use sender::SenderTransfer;

use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;

use crate::config::{Auth, NodeConfig, TransportConfig};
use crate::engine::{Node, ReceiverConn, SenderConn};
use crate::memory::{Holder, KvMemory, PoolGeometry};
use kvwire_proto::wire::TransferId;

/// A transfer's state, as SGLang's `KVPoll` numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum KvPoll {
    /// The transfer failed (its [`Error`] says why); final.
    Failed = 0,
    /// Waiting for a connection to the peer (or, before `init`, for the engine).
    Bootstrapping = 1,
    /// Sender: open, waiting for the engine's chunks. Receiver: reserved, waiting for the
    /// sender's data and commit.
    WaitingForInput = 2,
    /// Sender: every chunk handed over, waiting for the receiver's verdict. (The receiver
    /// reports `WaitingForInput` until its verdict.)
    Transferring = 3,
    /// Verified: on the receiver, the pages hold the sender's bytes, checked by digest over
    /// the memory that landed; on the sender, the receiver said so. Final.
    Success = 4,
}

impl KvPoll {
    /// Whether the transfer ended (`Failed` or `Success`).
    pub fn is_final(self) -> bool {
        matches!(self, Self::Failed | Self::Success)
    }
}

/// Which side of the transfers a manager is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The prefill engine: sends its KV pages ([`SenderTransfer`]).
    Prefill,
    /// The decode engine: reserves pages and verifies what lands ([`ReceiverTransfer`]).
    Decode,
}

/// One of the engine's KV buffers (e.g. one layer's K or V), by pointer: SGLang's
/// `kv_data_ptrs[i]`, `kv_data_lens[i]`, `kv_item_lens[i]`. Every buffer holds the same
/// number of pages (`len / page_bytes`, exactly).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvBuffer {
    /// The buffer's first byte.
    pub ptr: *mut u8,
    /// Its length in bytes.
    pub len: usize,
    /// Bytes per page in this buffer.
    pub page_bytes: usize,
}

/// How a [`Manager`] is set up. Start from [`ManagerConfig::new`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ManagerConfig {
    /// Prefill (sender) or decode (receiver).
    pub role: Role,
    /// Tokens per page (the same on both engines).
    pub tokens_per_page: u32,
    /// The context length the engine serves: the registered pool must hold it (checked
    /// when the manager starts, as [`Node::with_memory`] does), and the prefill's admission
    /// rejects longer requests.
    pub max_context_tokens: u64,
    /// Opaque model / tensor-parallel fingerprint; both engines must match exactly.
    pub fingerprint: Vec<u8>,
    /// Peer authentication (a pre-shared key both engines hold, or explicitly off).
    pub auth: Auth,
    /// The transport: TCP, or RDMA in builds with the `rdma` feature.
    pub transport: TransportConfig,
    /// This node's id, as peers see it (`0`: a random one).
    pub node_id: u64,
    /// Start even if the pool holds fewer tokens than the context length (not advised).
    pub allow_undersized_pool: bool,
    /// Worker threads of the manager's runtime.
    pub worker_threads: usize,
    /// The bound of blocking calls: `connect`, `listen`, and the round trips of `send`.
    pub call_timeout: Duration,
    /// How long `release` and `clear` wait for kvwire to give the pages back (a fenced abort
    /// finishes long before; this bounds a stuck peer).
    pub release_timeout: Duration,
}

impl ManagerConfig {
    /// A TCP manager for `role`, with pages of `tokens_per_page` tokens, serving contexts of
    /// up to `max_context_tokens`, authenticated by `auth`.
    pub fn new(role: Role, tokens_per_page: u32, max_context_tokens: u64, auth: Auth) -> Self {
        Self {
            role,
            tokens_per_page,
            max_context_tokens,
            fingerprint: Vec::new(),
            auth,
            transport: TransportConfig::Tcp,
            node_id: 0,
            allow_undersized_pool: false,
            worker_threads: 2,
            call_timeout: Duration::from_secs(30),
            release_timeout: Duration::from_secs(60),
        }
    }

    /// With this model / tensor-parallel fingerprint.
    pub fn fingerprint(mut self, fingerprint: impl Into<Vec<u8>>) -> Self {
        self.fingerprint = fingerprint.into();
        self
    }

    /// Over this transport.
    pub fn transport(mut self, transport: TransportConfig) -> Self {
        self.transport = transport;
        self
    }
}

/// A connection to a peer.
#[derive(Clone, Debug)]
enum Conn {
    Sender(SenderConn),
    Receiver(ReceiverConn),
}

impl Conn {
    fn peer_id(&self) -> u64 {
        match self {
            Self::Sender(c) => c.peer().node_id,
            Self::Receiver(c) => c.peer().node_id,
        }
    }
}

#[derive(Debug, Default)]
struct PeerList {
    /// By peer node id; a new connection from the same peer replaces the old one.
    conns: Vec<(u64, Conn)>,
    /// The last accept or handshake failure of the listener.
    last_accept_error: Option<Error>,
}

#[derive(Debug, Default)]
struct Peers {
    list: Mutex<PeerList>,
    changed: Condvar,
}

impl Peers {
    fn lock(&self) -> MutexGuard<'_, PeerList> {
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, conn: Conn) -> u64 {
        let id = conn.peer_id();
        let mut l = self.lock();
        l.conns.retain(|(p, _)| *p != id);
        l.conns.push((id, conn));
        self.changed.notify_all();
        id
    }

    fn accept_failed(&self, e: Error) {
        tracing::warn!(error = %e, "polled: an incoming connection failed");
        self.lock().last_accept_error = Some(e);
        self.changed.notify_all();
    }
}

#[derive(Debug)]
struct Inner {
    node: Node,
    config: ManagerConfig,
    peers: Arc<Peers>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The connections end once their handles are gone; the runtime's drop then waits
        // until every task (and every digest on its blocking pool) has stopped, so nothing
        // touches the engine's memory after the manager is gone.
        self.peers.lock().conns.clear();
        if let Some(rt) = self.runtime.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                // Dropped inside some async context: a runtime cannot be dropped there.
                std::thread::scope(|s| {
                    s.spawn(move || drop(rt));
                });
            } else {
                drop(rt);
            }
        }
    }
}

/// One engine's kvwire: a background runtime, one [`Node`] over the engine's registered KV
/// buffers, its connections, and the transfers made from it. Cheap to clone (shared);
/// every method may be called from any thread.
#[derive(Clone, Debug)]
pub struct Manager {
    inner: Arc<Inner>,
}

impl Manager {
    /// Registers the engine's KV buffers and starts the manager's runtime.
    ///
    /// Fails with [`ErrorKind::InvalidArgument`] when the buffers disagree (no buffer, a
    /// null pointer, a length that is not a whole number of pages, buffers with different
    /// page counts), and with [`ErrorKind::ConfigError`] when the pool cannot hold
    /// `max_context_tokens` (naming both numbers) or the transport is not in this build.
    ///
    /// # Safety
    ///
    /// As [`KvMemory::from_raw_parts`]: each buffer must be valid for reads and writes of
    /// its length for as long as the manager or any transfer made from it lives, the
    /// buffers must not overlap, and the engine must not write (or reuse) a page while
    /// kvwire holds it (from a receiver's `init` until its `release` returned; a sender's
    /// pages from `send` until its `clear` returned).
    pub unsafe fn new(config: ManagerConfig, buffers: &[KvBuffer]) -> Result<Self, Error> {
        let first = buffers
            .first()
            .ok_or_else(|| Error::invalid("no KV buffers given"))?;
        let mut regions = Vec::with_capacity(buffers.len());
        let mut page_bytes = Vec::with_capacity(buffers.len());
        let mut pages = None;
        for (i, b) in buffers.iter().enumerate() {
            let ptr = NonNull::new(b.ptr)
                .ok_or_else(|| Error::invalid(format!("KV buffer {i}: null pointer")))?;
            if b.page_bytes == 0 || b.len % b.page_bytes != 0 {
                return Err(Error::invalid(format!(
                    "KV buffer {i}: length {} is not a whole number of {}-byte pages",
                    b.len, b.page_bytes
                )));
            }
            let n = b.len / b.page_bytes;
            if *pages.get_or_insert(n) != n {
                return Err(Error::invalid(format!(
                    "KV buffer {i} holds {n} pages, buffer 0 holds {} ({} bytes of {})",
                    first.len / first.page_bytes,
                    first.len,
                    first.page_bytes
                )));
            }
            let pb = u32::try_from(b.page_bytes)
                .map_err(|_| Error::invalid(format!("KV buffer {i}: pages too large")))?;
            page_bytes.push(pb);
            regions.push((ptr, b.len));
        }
        let pages = u32::try_from(pages.unwrap_or(0))
            .map_err(|_| Error::invalid("more than 2^32 pages"))?;
        if cfg!(not(feature = "rdma")) && config.transport != TransportConfig::Tcp {
            return Err(Error::new(
                ErrorKind::ConfigError,
                format!(
                    "this kvwire was built without the {} transport (rebuild with `--features {}`)",
                    config.transport.name(),
                    config.transport.name()
                ),
            ));
        }
        let pool = PoolGeometry {
            tokens_per_page: config.tokens_per_page,
            buffer_page_bytes: page_bytes,
            pages,
        };
        let node_id = match config.node_id {
            0 => u64::from_le_bytes(
                crate::config::random_bytes()
                    .map_err(|e| Error::new(ErrorKind::ConfigError, e.to_string()))?,
            )
            .max(1),
            id => id,
        };
        let mut builder = NodeConfig::builder(pool, config.max_context_tokens)
            .node_id(node_id)
            .fingerprint(config.fingerprint.clone())
            .auth(config.auth.clone())
            .transport(config.transport.clone());
        if config.allow_undersized_pool {
            builder = builder.allow_undersized_pool();
        }
        let node_config = builder
            .build()
            .map_err(|e| Error::new(ErrorKind::ConfigError, e.to_string()))?;
        // SAFETY: the caller's contract (this function's) is from_raw_parts' contract.
        let memory = unsafe { KvMemory::from_raw_parts(&node_config.pool, regions) }
            .map_err(|e| Error::invalid(e.to_string()))?;
        let node = Node::with_memory(node_config, memory).map_err(|e| Error::from_engine(&e))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads.max(1))
            .thread_name("kvwire-polled")
            .enable_all()
            .build()
            .map_err(|e| Error::new(ErrorKind::ConfigError, format!("runtime: {e}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                node,
                config,
                peers: Arc::default(),
                runtime: Some(runtime),
            }),
        })
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        // Taken only in Drop.
        self.inner
            .runtime
            .as_ref()
            .expect("the runtime lives as long as the manager")
    }

    /// Runs `fut` on the manager's runtime and waits for it, at most `timeout`.
    pub(crate) fn block<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = T> + Send + 'static,
        timeout: Duration,
    ) -> Result<T, Error> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.runtime().spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv_timeout(timeout).map_err(|_| {
            Error::new(
                ErrorKind::WaitTimedOut,
                format!("no answer within {timeout:?}"),
            )
        })
    }

    pub(crate) fn spawn(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        self.runtime().spawn(fut);
    }

    /// The node: its configuration, and its page pool (which pages kvwire holds, and for
    /// which transfer).
    pub fn node(&self) -> &Node {
        &self.inner.node
    }

    /// The manager's configuration.
    pub fn config(&self) -> &ManagerConfig {
        &self.inner.config
    }

    /// This node's id, as its peers see it.
    pub fn node_id(&self) -> u64 {
        self.inner.node.config().node_id
    }

    /// The role.
    pub fn role(&self) -> Role {
        self.inner.config.role
    }

    /// Pages per buffer in the registered memory.
    pub fn pages(&self) -> u32 {
        self.inner.node.config().pool.pages
    }

    /// Listens on `addr` (`host:port`; port 0 for any) and accepts peers in the background
    /// for as long as the manager lives; returns the address bound. A connection that fails
    /// its handshake is dropped ([`Manager::last_accept_error`] says why).
    pub fn listen(&self, addr: &str) -> Result<SocketAddr, Error> {
        let a = addr.to_owned();
        let listener = self
            .block(TcpListener::bind(a), self.inner.config.call_timeout)?
            .map_err(|e| {
                Error::new(
                    ErrorKind::ConnectFailed,
                    format!("cannot listen on {addr}: {e}"),
                )
            })?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::new(ErrorKind::ConnectFailed, e.to_string()))?;
        let (node, peers, role) = (
            self.inner.node.clone(),
            self.inner.peers.clone(),
            self.role(),
        );
        self.spawn(async move {
            loop {
                let stream = match listener.accept().await {
                    Ok((s, _)) => s,
                    Err(e) => {
                        peers.accept_failed(Error::new(ErrorKind::ConnectFailed, e.to_string()));
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let (node, peers) = (node.clone(), peers.clone());
                tokio::spawn(async move {
                    match open(stream, &node, role, false).await {
                        Ok(c) => {
                            peers.add(c);
                        }
                        Err(e) => peers.accept_failed(e),
                    }
                });
            }
        });
        Ok(local)
    }

    /// Connects to the peer listening at `addr` (`host:port`) and runs the handshake;
    /// returns the peer's node id. Blocks until the connection is up or failed (at most
    /// `call_timeout`).
    pub fn connect(&self, addr: &str) -> Result<u64, Error> {
        let (a, node, role) = (addr.to_owned(), self.inner.node.clone(), self.role());
        let conn = self.block(
            async move {
                let stream = tokio::net::TcpStream::connect(a).await.map_err(|e| {
                    Error::new(ErrorKind::ConnectFailed, format!("connect: {e}")).retryable(true)
                })?;
                open(stream, &node, role, true).await
            },
            self.inner.config.call_timeout,
        )??;
        Ok(self.inner.peers.add(conn))
    }

    /// The node ids of the peers connected (oldest first).
    pub fn peers(&self) -> Vec<u64> {
        self.inner
            .peers
            .lock()
            .conns
            .iter()
            .map(|(p, _)| *p)
            .collect()
    }

    /// Waits until at least `n` peers are connected, at most `timeout`; returns how many
    /// are.
    pub fn wait_for_peers(&self, n: usize, timeout: Duration) -> Result<usize, Error> {
        let deadline = Instant::now() + timeout;
        let mut l = self.inner.peers.lock();
        loop {
            if l.conns.len() >= n {
                return Ok(l.conns.len());
            }
            let now = Instant::now();
            if now >= deadline {
                let why = l
                    .last_accept_error
                    .as_ref()
                    .map(|e| format!(" (last incoming failure: {e})"))
                    .unwrap_or_default();
                return Err(Error::new(
                    ErrorKind::WaitTimedOut,
                    format!(
                        "{} of {n} peers connected after {timeout:?}{why}",
                        l.conns.len()
                    ),
                ));
            }
            l = self
                .inner
                .peers
                .changed
                .wait_timeout(l, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The last failure of an incoming connection (a handshake refused, a wrong key, ...).
    pub fn last_accept_error(&self) -> Option<Error> {
        self.inner.peers.lock().last_accept_error.clone()
    }

    /// The decode side of request `room`, from peer `peer` (a node id; `None`: the only
    /// peer). It is [`KvPoll::Bootstrapping`] until [`ReceiverTransfer::init`] and a
    /// connection to the peer exist.
    pub fn receiver(&self, room: TransferId, peer: Option<u64>) -> Result<ReceiverTransfer, Error> {
        if self.role() != Role::Decode {
            return Err(Error::invalid("a prefill manager has no receivers"));
        }
        Ok(ReceiverTransfer::new(self.clone(), room, peer))
    }

    /// The prefill side of request `room`, to peer `peer` (a node id; `None`: the only
    /// peer). It is [`KvPoll::Bootstrapping`] until [`SenderTransfer::init`] and a
    /// connection to the peer exist.
    pub fn sender(&self, room: TransferId, peer: Option<u64>) -> Result<SenderTransfer, Error> {
        if self.role() != Role::Prefill {
            return Err(Error::invalid("a decode manager has no senders"));
        }
        Ok(SenderTransfer::new(self.clone(), room, peer))
    }

    /// The connection a transfer goes over: `peer`'s, or the only one; `None` while there
    /// is none yet.
    fn conn(&self, peer: Option<u64>) -> Result<Option<Conn>, Error> {
        let l = self.inner.peers.lock();
        match peer {
            Some(p) => Ok(l
                .conns
                .iter()
                .find(|(id, _)| *id == p)
                .map(|(_, c)| c.clone())),
            None => match l.conns.as_slice() {
                [] => Ok(None),
                [(_, c)] => Ok(Some(c.clone())),
                _ => Err(Error::invalid(
                    "several peers are connected: name the transfer's peer (its node id)",
                )),
            },
        }
    }

    /// Waits until kvwire holds none of `pages` (or, with `None`, no page at all) for
    /// `holder`, at most `release_timeout`.
    fn wait_pages_free(&self, holder: Holder, pages: Option<&[u32]>) -> Result<(), Error> {
        let pool = self.inner.node.pool();
        let deadline = Instant::now() + self.inner.config.release_timeout;
        loop {
            let held: Vec<u32> = match pages {
                Some(pages) => pages
                    .iter()
                    .copied()
                    .filter(|&p| pool.holders(p).contains(&holder))
                    .collect(),
                None => pool
                    .held_pages()
                    .into_iter()
                    .filter(|(_, h)| h.contains(&holder))
                    .map(|(p, _)| p)
                    .collect(),
            };
            if held.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::WaitTimedOut,
                    format!("kvwire still holds pages {held:?} for the {holder}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Opens one end of a connection for `role` on `stream`.
async fn open(
    stream: tokio::net::TcpStream,
    node: &Node,
    role: Role,
    client: bool,
) -> Result<Conn, Error> {
    let r = match role {
        Role::Prefill => SenderConn::start(stream, node, client)
            .await
            .map(Conn::Sender),
        Role::Decode => ReceiverConn::start(stream, node, client)
            .await
            .map(Conn::Receiver),
    };
    r.map_err(|e| Error::from_engine(&e))
}

/// A transfer's state, shared with the runtime's tasks that advance it.
#[derive(Debug)]
struct Shared<T> {
    st: Mutex<State<T>>,
    changed: Condvar,
}

#[derive(Debug)]
struct State<T> {
    poll: KvPoll,
    error: Option<Error>,
    /// Whether the engine API's outcome arrived (or nothing was ever started): only then
    /// can the pages be checked for release.
    settled: bool,
    /// What a verified transfer delivered.
    result: Option<T>,
}

impl<T> Shared<T> {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            st: Mutex::new(State {
                poll: KvPoll::Bootstrapping,
                error: None,
                settled: true,
                result: None,
            }),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn poll(&self) -> KvPoll {
        self.lock().poll
    }

    /// Moves to `to` unless the transfer already ended.
    fn advance(&self, to: KvPoll) {
        let mut s = self.lock();
        if !s.poll.is_final() {
            s.poll = to;
            self.changed.notify_all();
        }
    }

    /// Fails the transfer unless it already ended (the first verdict stands).
    fn fail(&self, e: Error) {
        let mut s = self.lock();
        if !s.poll.is_final() {
            s.poll = KvPoll::Failed;
            s.error = Some(e);
        }
        self.changed.notify_all();
    }

    /// The engine API's outcome arrived: `Ok` with what was delivered, or the failure.
    /// What arrives after the transfer already ended (an abort won) is dropped.
    fn settle(&self, outcome: Result<T, Error>) {
        let mut s = self.lock();
        s.settled = true;
        if !s.poll.is_final() {
            match outcome {
                Ok(v) => {
                    s.poll = KvPoll::Success;
                    s.result = Some(v);
                }
                Err(e) => {
                    s.poll = KvPoll::Failed;
                    s.error = Some(e);
                }
            }
        }
        self.changed.notify_all();
    }

    /// Waits until `done(state)` or `timeout`; `tick` (if any) is called between waits
    /// of at most 5 ms (to advance a transfer still bootstrapping).
    fn wait_until(
        &self,
        timeout: Duration,
        done: impl Fn(&State<T>) -> bool,
        tick: &dyn Fn(),
    ) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            tick();
            let s = self.lock();
            if done(&s) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            let step = if s.poll == KvPoll::Bootstrapping {
                Duration::from_millis(5).min(deadline - now)
            } else {
                deadline - now
            };
            let (s, _) = self
                .changed
                .wait_timeout(s, step)
                .unwrap_or_else(|p| p.into_inner());
            if done(&s) {
                return true;
            }
        }
    }
}

/// Every handle may be shared between threads (the C ABI's promise rests on this).
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Manager>();
    send_sync::<ReceiverTransfer>();
    send_sync::<SenderTransfer>();
    send_sync::<Error>();
};
