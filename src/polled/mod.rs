//! A poll-style, synchronous facade over the [`engine`](crate::engine) API, for engines that
//! drive transfers from a scheduler loop instead of an async runtime, and for the bindings
//! that sit on it (the C ABI crate `kvwire-capi` and the Python package `kvwire`, both thin
//! layers over this one; the shape is SGLang's `KVManager`, `KVSender`, `KVReceiver` and
//! `KVPoll`).
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
//! * What the bindings need besides: the engine's aux buffers ([`Manager::with_aux`]: a
//!   sender's final chunk carries the record at an aux index, a receiver writes the verified
//!   record at its own), a decode side that dials its prefill by address in the background
//!   ([`Manager::receiver_at`]: a failed dial fails the transfer, the next one dials again;
//!   connections whose peer is gone are forgotten), verified pages handed back at once
//!   ([`ManagerConfig::release_verified`]), and discovery ([`Manager::register`],
//!   [`Manager::resolve`] with the layout fingerprint check, [`BootstrapServer`]).
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

mod aux;
mod claims;
mod config;
mod discovery;
mod error;
mod peers;
mod receiver;
mod sender;
mod shutdown;
mod state;

pub use aux::AuxBuffer;
pub use config::ManagerConfig;
pub use discovery::{BootstrapServer, DiscoveryBackend};
pub use error::{Error, ErrorKind};
pub use receiver::ReceiverTransfer;
pub use sender::SenderTransfer;

use aux::AuxBuffers;
use claims::{Claimed, RoomClaim};
use peers::{Conn, Peers, Target};
use state::Shared;

use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;

use crate::config::{NodeConfig, TransportConfig};
use crate::discovery::Registration;
use crate::engine::{EngineError, ListenerStats, Node};
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

#[derive(Debug)]
struct Inner {
    node: Node,
    config: ManagerConfig,
    peers: Arc<Peers>,
    aux: Arc<AuxBuffers>,
    /// Where [`Manager::listen`] bound, for [`Manager::register`].
    listen_addr: Mutex<Option<SocketAddr>>,
    /// Discovery records published ([`Manager::register`]), removed when dropped.
    registrations: Mutex<Vec<Registration>>,
    /// Requests (and their peer, `None` when routed by the decode) with a sender on this
    /// manager ([`RoomClaim`]).
    claimed: Claimed,
    /// Taken by [`Manager::shutdown`] (or the drop).
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    /// While a shutdown's stop is under way: says when the runtime is gone.
    stopped: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    /// The runtime's handle; spawning on it after the shutdown does nothing.
    handle: tokio::runtime::Handle,
    /// Set by [`Manager::shutdown`].
    shut_down: std::sync::atomic::AtomicBool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The connections end once their handles are gone; the runtime's drop then waits
        // until every task (and every digest on its blocking pool) has stopped, so nothing
        // touches the engine's memory after the manager is gone.
        self.peers.lock().conns.clear();
        let runtime = self
            .runtime
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(rt) = &runtime {
            // A registration removes its record as it goes: a task on this runtime.
            let _guard = rt.enter();
            self.registrations
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
        }
        if let Some(rt) = runtime {
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
        // SAFETY: this function's contract, with no aux buffers.
        unsafe { Self::with_aux(config, buffers, &[]) }
    }

    /// As [`Manager::new`], with the engine's aux buffers: a sender's final chunk can carry
    /// the record at an aux index ([`SenderTransfer::init_with_aux`]), and a receiver writes
    /// the verified record at its aux index ([`ReceiverTransfer::init_with_aux`]).
    ///
    /// # Safety
    ///
    /// As [`Manager::new`], for the aux buffers too: each valid for reads and writes of its
    /// length while the manager lives, overlapping no other buffer; the engine writes a
    /// slot only for a request it is not receiving into it, and a sender's slot only before
    /// its final `send`.
    pub unsafe fn with_aux(
        config: ManagerConfig,
        buffers: &[KvBuffer],
        aux: &[AuxBuffer],
    ) -> Result<Self, Error> {
        let aux = AuxBuffers::new(aux)?;
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
            .transport(config.transport.clone())
            .tcp_streams(config.tcp_streams)
            .same_host(config.same_host)
            .pull_threads(config.pull_threads);
        if config.allow_undersized_pool {
            builder = builder.allow_undersized_pool();
        }
        if let Some(l) = config.liveness {
            builder = builder.liveness(l);
        }
        if let Some(s) = &config.sender {
            builder = builder.sender(s.clone());
        }
        let mut node_config = builder
            .build()
            .map_err(|e| Error::new(ErrorKind::ConfigError, e.to_string()))?;
        // After the checks of every value (an invalid one is named in any build).
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
        node_config.max_aux = node_config.max_aux.max(aux.record_len() as u32);
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
        let peers: Arc<Peers> = Arc::default();
        runtime.spawn(peers.clone().prune(node.clone(), config.role));
        Ok(Self {
            inner: Arc::new(Inner {
                node,
                config,
                peers,
                aux: Arc::new(aux),
                listen_addr: Mutex::new(None),
                registrations: Mutex::new(Vec::new()),
                claimed: Arc::default(),
                handle: runtime.handle().clone(),
                runtime: Mutex::new(Some(runtime)),
                stopped: Mutex::new(None),
                shut_down: Default::default(),
            }),
        })
    }

    /// The runtime's handle (spawning on it after [`Manager::shutdown`] does nothing).
    fn handle(&self) -> &tokio::runtime::Handle {
        &self.inner.handle
    }

    /// Runs `fut` on the manager's runtime and waits for it, at most `timeout`.
    pub(crate) fn block<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = T> + Send + 'static,
        timeout: Duration,
    ) -> Result<T, Error> {
        if self.is_shut_down() {
            return Err(Self::shut_down_error());
        }
        let (tx, rx) = std::sync::mpsc::channel();
        self.handle().spawn(async move {
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
        if !self.is_shut_down() {
            self.handle().spawn(fut);
        }
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
                        peers.accepted(Err(EngineError::Io(e)));
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let (node, peers) = (node.clone(), peers.clone());
                tokio::spawn(async move {
                    peers.accepted(peers::open(stream, &node, role, false).await);
                });
            }
        });
        *self
            .inner
            .listen_addr
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(local);
        Ok(local)
    }

    /// Where [`Manager::listen`] bound last (`None` before).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        *self
            .inner
            .listen_addr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The listener's handshake counters (accepted, established, refused, failed).
    pub fn handshake_stats(&self) -> ListenerStats {
        self.inner.peers.lock().stats
    }

    /// Connects to the peer listening at `addr` (`host:port`) and runs the handshake;
    /// returns the peer's node id. Blocks until the connection is up or failed (at most
    /// `call_timeout`).
    pub fn connect(&self, addr: &str) -> Result<u64, Error> {
        let (a, node, role) = (addr.to_owned(), self.inner.node.clone(), self.role());
        let conn = self.block(peers::dial(a, node, role), self.inner.config.call_timeout)??;
        Ok(self.inner.peers.add(conn))
    }

    /// Starts dialling `addr` in the background unless a connection dialled there is up
    /// or on its way (`retry`: also when its last attempt failed); returns at once. The
    /// transfers of [`Manager::receiver_at`] / [`Manager::sender_at`] go over it.
    pub fn connect_in_background(&self, addr: &str, retry: bool) {
        let mut l = self.inner.peers.lock();
        if !l.needs_dial(addr, retry) {
            return;
        }
        l.links.insert(addr.to_owned(), peers::Link::Connecting);
        drop(l);
        let (a, node, role, peers) = (
            addr.to_owned(),
            self.inner.node.clone(),
            self.role(),
            self.inner.peers.clone(),
        );
        self.spawn(async move {
            let outcome = peers::dial(a.clone(), node, role).await;
            peers.dialled(a, outcome);
        });
    }

    /// Renews the connection dialled at `addr`: no new transfer takes it from now on (those
    /// made meanwhile wait for its successor), its open transfers finish on it, and then
    /// `addr` is dialled again. The manager does this by itself to a connection that has
    /// run with failed lanes (RDMA rails lost or left out, SPEC §9.2) for a while, so that a
    /// rail back up is taken again (waits of 5 s, doubling to 5 min while the new connection
    /// still has failed lanes); call it to do it now. Whether a connection dialled there was
    /// up.
    pub fn renew(&self, addr: &str) -> bool {
        self.inner.peers.renew(addr)
    }

    /// Whether a connection dialled at `addr` is up now.
    pub fn link_up(&self, addr: &str) -> bool {
        matches!(
            self.inner
                .peers
                .lock()
                .find(&Target::Address(addr.to_owned())),
            Ok(Some(_))
        )
    }

    /// Which pages kvwire holds now (leased to a transfer, or a verified transfer not yet
    /// released): the engine must not free or write them.
    pub fn held_pages(&self) -> Vec<u32> {
        self.inner
            .node
            .pool()
            .held_pages()
            .into_iter()
            .map(|(p, _)| p)
            .collect()
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
        self.check_role(Role::Decode)?;
        let target = peer.map_or(Target::Only, Target::Node);
        Ok(ReceiverTransfer::new(self.clone(), room, target))
    }

    /// The decode side of request `room`, from the peer listening at `addr`: dialled in
    /// the background now (again if an earlier attempt failed or its peer was lost); the
    /// transfer fails with the dial's error if it fails.
    pub fn receiver_at(&self, room: TransferId, addr: &str) -> Result<ReceiverTransfer, Error> {
        self.check_role(Role::Decode)?;
        Ok(ReceiverTransfer::new(self.clone(), room, self.dial(addr)))
    }

    /// The prefill side of request `room`. With `peer` `None` it goes to the decode node
    /// that reserves it: of all connected decodes, the one whose reservation (or refusal)
    /// named `room`; it is [`KvPoll::Bootstrapping`] until [`SenderTransfer::init`] was
    /// called and that decode reserved. With `peer` (a node id) it goes to that peer,
    /// opened as soon as `init` was called and the connection exists.
    pub fn sender(&self, room: TransferId, peer: Option<u64>) -> Result<SenderTransfer, Error> {
        self.check_role(Role::Prefill)?;
        let target = peer.map_or(Target::Room(room), Target::Node);
        Ok(SenderTransfer::new(self.clone(), room, target))
    }

    /// As [`Manager::sender`], to the peer listening at `addr` (dialled as
    /// [`Manager::receiver_at`] does; a prefill that dials its decode peers).
    pub fn sender_at(&self, room: TransferId, addr: &str) -> Result<SenderTransfer, Error> {
        self.check_role(Role::Prefill)?;
        Ok(SenderTransfer::new(self.clone(), room, self.dial(addr)))
    }

    fn check_role(&self, role: Role) -> Result<(), Error> {
        match (self.role(), role) {
            (Role::Prefill, Role::Decode) => {
                Err(Error::invalid("a prefill manager has no receivers"))
            }
            (Role::Decode, Role::Prefill) => Err(Error::invalid("a decode manager has no senders")),
            _ => Ok(()),
        }
    }

    /// The target of a transfer to the peer at `addr`, dialled (again) now.
    fn dial(&self, addr: &str) -> Target {
        self.connect_in_background(addr, true);
        Target::Address(addr.to_owned())
    }

    /// The connection a transfer goes over; `None` while there is none yet.
    ///
    /// Lock order: a transfer's slot, then the peer list (a transfer calls this holding its
    /// slot); code that holds the peer list never takes a slot.
    fn conn(&self, target: &Target) -> Result<Option<Conn>, Error> {
        match target {
            // Its peer was lost since (or it was never dialled): dial again.
            Target::Address(a) => self.connect_in_background(a, false),
            Target::Room(room) => {
                return match self.inner.node.rooms().peer_of(*room) {
                    Some(peer) => self.inner.peers.lock().find(&Target::Node(peer)),
                    None => Ok(None),
                };
            }
            Target::Only | Target::Node(_) => {}
        }
        self.inner.peers.lock().find(target)
    }

    fn peer_list(&self) -> &Arc<Peers> {
        &self.inner.peers
    }

    fn aux(&self) -> &Arc<AuxBuffers> {
        &self.inner.aux
    }

    fn registrations(&self) -> MutexGuard<'_, Vec<Registration>> {
        self.inner
            .registrations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
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

/// Every handle may be shared between threads (the C ABI's promise rests on this).
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Manager>();
    send_sync::<ReceiverTransfer>();
    send_sync::<SenderTransfer>();
    send_sync::<Error>();
};
