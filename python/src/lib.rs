//! `kvwire._native`: the Python binding of kvwire (pyo3), a thin layer over the crate's
//! poll-style facade, [`kvwire::polled`] (the same one the C ABI sits on). The Python package
//! `kvwire` (`python/kvwire/`) wraps these classes in the shape inference engines use
//! (SGLang's `KVManager`, `KVSender`, `KVReceiver`, `KVPoll`); this module only converts:
//!
//! * [`Engine`]: a [`Manager`] over the engine's KV and aux buffers registered by pointer,
//!   listening for decode peers (prefill) or dialling prefill peers by address (decode), and
//!   the discovery calls ([`Manager::register`], [`Manager::resolve`]);
//! * [`Sender`]: a [`SenderTransfer`] (the final chunk carries the record at its aux index);
//! * [`Receiver`]: a [`ReceiverTransfer`] into the engine's chosen pages, its verified aux
//!   record written at its aux index, its pages handed back as soon as it verified;
//! * [`BootstrapServer`]: the facade's bootstrap server, on a runtime of its own;
//! * errors: a [`kvwire::polled::Error`] becomes the exception class of its kind's name
//!   (`kvwire.errors`).
//!
//! `poll` never blocks; every call that waits (binding a port, a discovery round trip,
//! handing a chunk over) releases the GIL, and no runtime task ever takes it.

use std::sync::Arc;
use std::time::Duration;

use kvwire::polled::{
    AuxBuffer, DiscoveryBackend, Error, ErrorKind, KvBuffer, KvPoll, Manager, ManagerConfig,
    ReceiverTransfer, Role, SenderTransfer,
};
use kvwire::{Auth, TransferId, TransportConfig};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// The typed Python exception of `e` (`kvwire.errors._make` picks the class by kind name).
fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    let make = || -> PyResult<PyErr> {
        let module = py.import("kvwire.errors")?;
        let code = e.wire_code();
        let exc = module.getattr("_make")?.call1((
            e.kind().name(),
            e.message().to_owned(),
            e.is_retryable(),
            code.map(|c| c.0),
            code.map(|c| c.to_string()),
            e.cause().map(|k| k.name()),
        ))?;
        Ok(PyErr::from_value(exc))
    };
    make().unwrap_or_else(|err| err)
}

/// The exception object (not raised) of a failed transfer.
fn failure(py: Python<'_>, e: Option<Error>) -> Option<PyObject> {
    e.map(|e| to_py(py, &e).into_value(py).into_any())
}

fn secs(s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| PyValueError::new_err(format!("bad duration {s}")))
}

/// Page indices from the bytes of a numpy int32 / int64 array.
fn pages_from_bytes(raw: &[u8], width: usize) -> PyResult<Vec<u32>> {
    if width != 4 && width != 8 {
        return Err(PyValueError::new_err("page indices must be int32 or int64"));
    }
    if raw.len() % width != 0 {
        return Err(PyValueError::new_err(
            "page index bytes are not whole integers",
        ));
    }
    raw.chunks_exact(width)
        .map(|c| {
            let v = if width == 8 {
                i64::from_ne_bytes(c.try_into().unwrap_or([0; 8]))
            } else {
                i64::from(i32::from_ne_bytes(c.try_into().unwrap_or([0; 4])))
            };
            u32::try_from(v)
                .map_err(|_| PyValueError::new_err(format!("page index {v} out of range")))
        })
        .collect()
}

fn backend(
    server: Option<String>,
    etcd_endpoints: Option<Vec<String>>,
    etcd_prefix: String,
) -> PyResult<DiscoveryBackend> {
    match (etcd_endpoints, server) {
        (Some(endpoints), _) => Ok(DiscoveryBackend::Etcd {
            endpoints,
            prefix: etcd_prefix,
        }),
        (None, Some(server)) => Ok(DiscoveryBackend::Bootstrap(server)),
        (None, None) => Err(PyValueError::new_err(
            "a bootstrap server address or etcd endpoints are needed",
        )),
    }
}

fn role(name: &str) -> PyResult<Role> {
    match name {
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        r => Err(PyValueError::new_err(format!(
            "role {r:?}: prefill or decode"
        ))),
    }
}

// ---------------------------------------------------------------------------------------
// The engine.

/// What every object made from an engine shares. Fields drop in order: the manager (its
/// runtime, once its last clone is gone) before the Python objects that own the memory.
struct Shared {
    manager: Manager,
    address: Option<String>,
    reserve_timeout: Duration,
    /// The Python objects that own the registered memory (the engine's arrays).
    _keepalive: Option<PyObject>,
}

/// One engine's node: its KV and aux buffers registered by pointer, a background runtime,
/// and its connections (prefill: accepted from decode nodes; decode: to prefill nodes).
#[pyclass(module = "kvwire._native", frozen)]
struct Engine {
    inner: Arc<Shared>,
}

#[pymethods]
impl Engine {
    /// Registers the engine's KV buffers (one base pointer, length and bytes per page each;
    /// every buffer must hold the same number of pages) and aux buffers by address.
    ///
    /// The contract (unchecked; `Manager::with_aux`): every address is valid for reads and
    /// writes of its length for as long as this engine and everything made from it live, the
    /// buffers do not overlap, and the engine writes no page kvwire holds.
    #[new]
    #[pyo3(signature = (prefill, kv_data_ptrs, kv_data_lens, kv_item_lens, aux_data_ptrs, aux_data_lens, aux_item_lens, page_size, *, max_context_tokens=None, psk=None, insecure_no_auth=false, fingerprint="kvwire-python".to_string(), node_id=None, listen=None, transport="tcp".to_string(), ib_device=None, ib_queue_pairs=1, ib_busy_poll=false, ib_ack_timeout=14, ib_stripe_pages=16, ib_rail_affinity=true, liveness_timeout_s=2.0, reserve_timeout_s=30.0, reservation_wait_s=30.0, parked_reservation_s=30.0, worker_threads=2, tcp_streams=1, same_host="auto".to_string(), pull_threads=0, keepalive=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        prefill: bool,
        kv_data_ptrs: Vec<usize>,
        kv_data_lens: Vec<usize>,
        kv_item_lens: Vec<usize>,
        aux_data_ptrs: Vec<usize>,
        aux_data_lens: Vec<usize>,
        aux_item_lens: Vec<usize>,
        page_size: u32,
        max_context_tokens: Option<u64>,
        psk: Option<Vec<u8>>,
        insecure_no_auth: bool,
        fingerprint: String,
        node_id: Option<u64>,
        listen: Option<String>,
        transport: String,
        ib_device: Option<String>,
        ib_queue_pairs: u32,
        ib_busy_poll: bool,
        ib_ack_timeout: u32,
        ib_stripe_pages: i64,
        ib_rail_affinity: bool,
        liveness_timeout_s: f64,
        reserve_timeout_s: f64,
        reservation_wait_s: f64,
        parked_reservation_s: f64,
        worker_threads: usize,
        tcp_streams: u16,
        same_host: String,
        pull_threads: usize,
        keepalive: Option<PyObject>,
    ) -> PyResult<Self> {
        let n = kv_data_ptrs.len();
        if n == 0 || kv_data_lens.len() != n || kv_item_lens.len() != n {
            return Err(PyValueError::new_err(
                "kv_data_ptrs, kv_data_lens and kv_item_lens must be non-empty and of one length",
            ));
        }
        let m = aux_data_ptrs.len();
        if aux_data_lens.len() != m || aux_item_lens.len() != m {
            return Err(PyValueError::new_err(
                "aux_data_ptrs, aux_data_lens and aux_item_lens must be of one length",
            ));
        }
        let kv: Vec<KvBuffer> = (0..n)
            .map(|b| KvBuffer {
                ptr: kv_data_ptrs[b] as *mut u8,
                len: kv_data_lens[b],
                page_bytes: kv_item_lens[b],
            })
            .collect();
        let aux: Vec<AuxBuffer> = (0..m)
            .map(|b| AuxBuffer {
                ptr: aux_data_ptrs[b] as *mut u8,
                len: aux_data_lens[b],
                item_len: aux_item_lens[b],
            })
            .collect();
        let auth = match (psk, insecure_no_auth) {
            (Some(key), _) => Auth::psk(key)
                .map_err(|e| PyValueError::new_err(format!("pre-shared key: {e}")))?,
            (None, true) => Auth::Off,
            (None, false) => match kvwire::config::auth::find_psk(None) {
                Ok(Some((key, _))) => Auth::Psk(key),
                Ok(None) => {
                    return Err(PyValueError::new_err(
                        "no pre-shared key: pass psk=, set KVWIRE_PSK / KVWIRE_PSK_FILE, or insecure_no_auth=True",
                    ))
                }
                Err(e) => return Err(PyValueError::new_err(e.to_string())),
            },
        };
        let transport = match transport.as_str() {
            "tcp" => TransportConfig::Tcp,
            "rdma" => {
                // 147 to 65535 is refused when the manager starts, naming the value.
                let queue_pairs = u16::try_from(ib_queue_pairs).map_err(|_| {
                    let e = Error::new(
                        ErrorKind::ConfigError,
                        format!(
                            "ib_queue_pairs = {ib_queue_pairs}: 1 to {} per connection",
                            kvwire::config::MAX_QUEUE_PAIRS
                        ),
                    );
                    to_py(py, &e)
                })?;
                // 32 to 255 is refused when the manager starts, naming the value.
                let ack_timeout = u8::try_from(ib_ack_timeout).map_err(|_| {
                    let e = Error::new(
                        ErrorKind::ConfigError,
                        format!("ib_ack_timeout = {ib_ack_timeout}: the exponent is 1 to 31"),
                    );
                    to_py(py, &e)
                })?;
                let stripe_pages = u32::try_from(ib_stripe_pages).map_err(|_| {
                    let e = Error::new(
                        ErrorKind::ConfigError,
                        format!("ib_stripe_pages = {ib_stripe_pages}: 0 (never striped) or pages per stripe"),
                    );
                    to_py(py, &e)
                })?;
                // One device, or several comma-separated (one rail each, as Mooncake's
                // `ib_device`); at least one queue pair per rail.
                TransportConfig::rdma_devices(ib_device.as_deref().unwrap_or(""), queue_pairs)
                    .busy_poll(ib_busy_poll)
                    .ack_timeout(ack_timeout)
                    .stripe_pages(stripe_pages)
                    .rail_affinity(ib_rail_affinity)
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown transport {other:?} (tcp or rdma)"
                )))
            }
        };
        // The served context: by default what the pool holds (checked by the manager).
        let pages = kv_data_lens[0].checked_div(kv_item_lens[0]).unwrap_or(0) as u64;
        let context = max_context_tokens.unwrap_or(pages * u64::from(page_size));
        let role = if prefill { Role::Prefill } else { Role::Decode };
        let mut config = ManagerConfig::new(role, page_size, context, auth)
            .fingerprint(fingerprint.into_bytes())
            .transport(transport);
        config.node_id = node_id.unwrap_or(0);
        config.worker_threads = worker_threads;
        config.tcp_streams = tcp_streams;
        config.same_host = same_host.parse().map_err(PyValueError::new_err)?;
        config.pull_threads = pull_threads;
        // SGLang's contract: once `poll` said Success the engine owns the pages again.
        config.release_verified = true;
        // A decode node's reservation usually arrives before the prefill's scheduler calls
        // `init` (its queue may take a while): hold it `parked_reservation_s`.
        config = config
            .liveness_timeout(secs(liveness_timeout_s)?)
            .reservation_timeouts(secs(reservation_wait_s)?, secs(parked_reservation_s)?);
        let reserve_timeout = secs(reserve_timeout_s)?;
        // SAFETY: the caller's contract, stated in this constructor's documentation and in
        // `kvwire.KVManager`'s: each (pointer, length) is the engine's own buffer (a numpy
        // array or tensor the Python manager keeps a reference to, `keepalive`, dropped only
        // after the manager), valid for reads and writes of its length while the manager
        // lives; the buffers do not overlap (checked by the Python layer for arrays it is
        // given); the engine writes no page kvwire holds.
        let manager = unsafe { Manager::with_aux(config, &kv, &aux) }.map_err(|e| to_py(py, &e))?;
        let address = if prefill {
            let listen = listen.unwrap_or_else(|| "127.0.0.1:0".to_string());
            let local = py
                .allow_threads(|| manager.listen(&listen))
                .map_err(|e| to_py(py, &e))?;
            Some(local.to_string())
        } else {
            None
        };
        Ok(Self {
            inner: Arc::new(Shared {
                manager,
                address,
                reserve_timeout,
                _keepalive: keepalive,
            }),
        })
    }

    /// Where a prefill engine accepts decode connections (`host:port`); `None` on decode.
    #[getter]
    fn address(&self) -> Option<String> {
        self.inner.address.clone()
    }

    /// This node's id (in the handshake and discovery records).
    #[getter]
    fn node_id(&self) -> u64 {
        self.inner.manager.node_id()
    }

    /// Pages in every KV buffer.
    #[getter]
    fn pages(&self) -> u32 {
        self.inner.manager.pages()
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.inner.manager.config().tokens_per_page
    }

    /// The fingerprint of this node's KV layout and model fingerprint, as discovery records
    /// carry it.
    #[getter]
    fn layout_fingerprint(&self) -> String {
        self.inner.manager.layout_fingerprint()
    }

    /// Node ids of the peers connected now, oldest first.
    fn connected_peers(&self) -> Vec<u64> {
        self.inner.manager.peers()
    }

    /// Prefill: the listener's handshake counters (accepted, established, refused,
    /// malformed, failed).
    fn handshake_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.manager.handshake_stats();
        let d = PyDict::new(py);
        d.set_item("accepted", s.accepted)?;
        d.set_item("established", s.established)?;
        d.set_item("refused", s.refused)?;
        d.set_item("malformed", s.malformed)?;
        d.set_item("failed", s.failed)?;
        d.set_item("joined", s.joined)?;
        Ok(d)
    }

    /// Which pages kvwire holds now (leased to a transfer); the engine must not free them.
    fn held_pages(&self) -> Vec<u32> {
        self.inner.manager.held_pages()
    }

    /// Decode: starts connecting to the prefill node at `address` unless a connection is
    /// up or on its way (returns at once).
    fn connect(&self, address: String) {
        self.inner.manager.connect_in_background(&address, false);
    }

    /// Decode: whether a connection to `address` is up now.
    fn link_up(&self, address: &str) -> bool {
        self.inner.manager.link_up(address)
    }

    /// A sender for request `room` (prefill): to the decode node that reserves it (`peer`
    /// `None`: of every connected decode, the one whose reservation or refusal named
    /// `room`), or to decode node `peer` (its node id).
    #[pyo3(signature = (room, peer=None))]
    fn sender(&self, py: Python<'_>, room: u64, peer: Option<u64>) -> PyResult<Sender> {
        let transfer = self
            .inner
            .manager
            .sender(TransferId(room), peer)
            .map_err(|e| to_py(py, &e))?;
        Ok(Sender {
            transfer,
            engine: self.inner.clone(),
        })
    }

    /// A receiver for request `room` from the prefill node at `address` (decode).
    fn receiver(&self, py: Python<'_>, room: u64, address: String) -> PyResult<Receiver> {
        let transfer = self
            .inner
            .manager
            .receiver_at(TransferId(room), &address)
            .map_err(|e| to_py(py, &e))?;
        Ok(Receiver {
            transfer,
            engine: self.inner.clone(),
        })
    }

    /// Publishes this node (prefill: where it listens) with the embedded bootstrap server at
    /// `server` (`host:port`), or etcd when `etcd_endpoints` are given; the record lives
    /// while this engine does (refreshed), and expires `ttl_s` after the process dies.
    #[pyo3(signature = (server, cluster, rank, *, ttl_s=10.0, address=None, etcd_endpoints=None, etcd_prefix="kvwire".to_string()))]
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        py: Python<'_>,
        server: Option<String>,
        cluster: String,
        rank: u32,
        ttl_s: f64,
        address: Option<String>,
        etcd_endpoints: Option<Vec<String>>,
        etcd_prefix: String,
    ) -> PyResult<()> {
        let backend = backend(server, etcd_endpoints, etcd_prefix)?;
        let ttl = secs(ttl_s)?;
        let m = &self.inner.manager;
        py.allow_threads(|| m.register(&backend, &cluster, rank, ttl, address.as_deref()))
            .map_err(|e| to_py(py, &e))
    }

    /// Removes this node's records now and waits until they are gone (at most a few
    /// seconds; they also go, without waiting, when the engine is dropped).
    fn deregister(&self, py: Python<'_>) {
        py.allow_threads(|| self.inner.manager.deregister());
    }

    /// Stops kvwire on this node for good; returns once nothing of it touches the
    /// registered memory (the engine may free its buffers then). Raises `WaitTimedOut`
    /// after `timeout_s` (the memory must then stay valid; call again to wait more).
    #[pyo3(signature = (timeout_s=30.0))]
    fn shutdown(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = secs(timeout_s)?;
        py.allow_threads(|| self.inner.manager.shutdown(timeout))
            .map_err(|e| to_py(py, &e))
    }

    /// Whether `shutdown` was called.
    #[getter]
    fn is_shut_down(&self) -> bool {
        self.inner.manager.is_shut_down()
    }

    /// The peers of `role` ("prefill" or "decode") registered in `cluster` (optionally of
    /// one rank): a list of dicts (node_id, rank, address, transport, layout_fingerprint,
    /// cluster). With `check_layout`, a peer whose layout fingerprint differs from this
    /// node's raises `LayoutMismatch` (fail closed) instead of being returned.
    #[pyo3(signature = (server, cluster, role, rank=None, *, check_layout=true, etcd_endpoints=None, etcd_prefix="kvwire".to_string()))]
    #[allow(clippy::too_many_arguments)]
    fn resolve<'py>(
        &self,
        py: Python<'py>,
        server: Option<String>,
        cluster: String,
        role: String,
        rank: Option<u32>,
        check_layout: bool,
        etcd_endpoints: Option<Vec<String>>,
        etcd_prefix: String,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let role = self::role(&role)?;
        let backend = backend(server, etcd_endpoints, etcd_prefix)?;
        let m = &self.inner.manager;
        let found = py
            .allow_threads(|| m.resolve(&backend, &cluster, role, rank, check_layout))
            .map_err(|e| to_py(py, &e))?;
        found
            .into_iter()
            .map(|r| {
                let d = PyDict::new(py);
                d.set_item("node_id", r.node_id)?;
                d.set_item("rank", r.engine_rank)?;
                d.set_item("address", r.address)?;
                d.set_item("transport", r.transport)?;
                d.set_item("layout_fingerprint", r.layout_fingerprint)?;
                d.set_item("cluster", r.cluster)?;
                Ok(d)
            })
            .collect()
    }

    /// Whether this build includes etcd discovery (cargo feature `etcd`).
    #[staticmethod]
    fn has_etcd() -> bool {
        cfg!(feature = "etcd")
    }
}

// ---------------------------------------------------------------------------------------
// Transfers.

/// The prefill side of one request (SGLang's KVSender core).
#[pyclass(module = "kvwire._native", frozen)]
struct Sender {
    transfer: SenderTransfer,
    /// Keeps the engine's memory alive while the transfer is (dropped after it).
    engine: Arc<Shared>,
}

#[pymethods]
impl Sender {
    /// The request (bootstrap room).
    #[getter]
    fn room(&self) -> u64 {
        self.transfer.room().0
    }

    /// Plans the request: `num_pages` pages (`num_tokens` tokens, default
    /// `num_pages * page_size`), the aux record at `aux_index` going with the final chunk.
    /// Admission runs now: a request it rejects fails with `Rejected` carrying the original
    /// code, and the reservation of whichever decode node names it is answered with the same
    /// error. The request opens once its decode node reserved it (now, or in the
    /// background when the reservation arrives).
    #[pyo3(signature = (num_pages, aux_index=None, num_tokens=None))]
    fn init(
        &self,
        py: Python<'_>,
        num_pages: u32,
        aux_index: Option<usize>,
        num_tokens: Option<u32>,
    ) -> PyResult<()> {
        if self.transfer.poll() == KvPoll::Failed {
            // As `send`: on a transfer that already ended (its decode refused it, say) this
            // does nothing; `poll` / `error` say why.
            return Ok(());
        }
        let tpp = self.engine.manager.config().tokens_per_page;
        let tokens = match num_tokens {
            Some(t) => t,
            None => num_pages
                .checked_mul(tpp)
                .ok_or_else(|| PyValueError::new_err("too many tokens"))?,
        };
        self.transfer
            .init_with_aux(num_pages, tokens, aux_index)
            .map_err(|e| to_py(py, &e))
    }

    /// Sends the next chunk: page indices of the engine's KV memory (the bytes of a numpy
    /// int32/int64 array, `width` 4 or 8), in transfer order. The chunk that completes the
    /// request's pages carries the aux record. Waits (GIL released) only for the connection
    /// to take the chunk. A call that does not fit (before the sender is ready, more pages
    /// than planned) raises; a chunk the connection refuses ends the request: it is aborted
    /// and fails with the refusal (see `poll`). On a transfer that already failed it does
    /// nothing (`poll` / `error` say why).
    fn send(&self, py: Python<'_>, indices: &[u8], width: usize) -> PyResult<()> {
        let pages = pages_from_bytes(indices, width)?;
        if self.transfer.poll() == KvPoll::Failed {
            return Ok(());
        }
        match py.allow_threads(|| self.transfer.send(&pages, None)) {
            Ok(()) => Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::InvalidArgument | ErrorKind::InvalidState
                ) =>
            {
                Err(to_py(py, &e))
            }
            Err(e) => {
                self.transfer.abort_with(e);
                Ok(())
            }
        }
    }

    /// The state (a KVPoll value); never blocks. Bootstrapping until a decode node reserved
    /// the request (routed by its reservation, or to `peer`), WaitingForInput until the
    /// final chunk was handed over, Transferring until the decode node verified it
    /// (Success) or it failed (Failed).
    fn poll(&self) -> u8 {
        match self.transfer.poll() {
            // SGLang's sender waits for input once its decode reserved, before `init`.
            KvPoll::Bootstrapping if self.transfer.connected() => KvPoll::WaitingForInput as u8,
            p => p as u8,
        }
    }

    /// The typed exception of a failed transfer, or None.
    fn error(&self, py: Python<'_>) -> Option<PyObject> {
        failure(py, self.transfer.failure())
    }

    /// Aborts the request (stop posting, drain, ABORT to the decode node); it fails with
    /// `Aborted`.
    fn abort(&self) {
        self.transfer.abort();
    }

    /// Pages sent so far.
    #[getter]
    fn pages_sent(&self) -> usize {
        self.transfer.pages_sent()
    }
}

/// The decode side of one request (SGLang's KVReceiver core).
#[pyclass(module = "kvwire._native", frozen)]
struct Receiver {
    transfer: ReceiverTransfer,
    /// Keeps the engine's memory alive while the transfer is (dropped after it).
    engine: Arc<Shared>,
}

#[pymethods]
impl Receiver {
    /// The request (bootstrap room).
    #[getter]
    fn room(&self) -> u64 {
        self.transfer.room().0
    }

    /// Reserves the engine's pages for the request: `indices` are the destination page
    /// indices (the bytes of a numpy int32/int64 array, `width` 4 or 8) in transfer order,
    /// `num_tokens` the prompt's tokens (default `pages * page_size`), and the verified aux
    /// record is written at `aux_index` of the aux buffers. A prompt over this node's pool is
    /// rejected here (`Rejected`, PROMPT_EXCEEDS_POOL) before anything goes out. Returns at
    /// once.
    #[pyo3(signature = (indices, width, aux_index=None, num_tokens=None))]
    fn send_metadata(
        &self,
        py: Python<'_>,
        indices: &[u8],
        width: usize,
        aux_index: Option<usize>,
        num_tokens: Option<u64>,
    ) -> PyResult<()> {
        let pages = pages_from_bytes(indices, width)?;
        let tpp = self.engine.manager.config().tokens_per_page;
        let tokens = num_tokens.unwrap_or(pages.len() as u64 * u64::from(tpp));
        let tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
        self.transfer
            .init_with_aux(pages, tokens, self.engine.reserve_timeout, aux_index)
            .map_err(|e| to_py(py, &e))
    }

    /// The state (a KVPoll value); never blocks: Bootstrapping until the connection to the
    /// prefill node is up, WaitingForInput until `send_metadata` reserved the pages,
    /// Transferring until the verdict, then Success or Failed.
    fn poll(&self) -> u8 {
        match self.transfer.poll() {
            KvPoll::Bootstrapping if self.transfer.connected() => KvPoll::WaitingForInput as u8,
            // The facade's receiver waits for the sender's input once reserved: to SGLang
            // that is a transfer under way.
            KvPoll::WaitingForInput => KvPoll::Transferring as u8,
            p => p as u8,
        }
    }

    /// The typed exception of a failed transfer, or None.
    fn error(&self, py: Python<'_>) -> Option<PyObject> {
        failure(py, self.transfer.failure())
    }

    /// The verified aux record (after Success), or None.
    fn aux<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.transfer.aux().ok().map(|a| PyBytes::new(py, &a))
    }

    /// The destination pages of the verified transfer (after Success), or None.
    fn verified_pages(&self) -> Option<Vec<u32>> {
        self.transfer.page_indices().ok()
    }

    /// Aborts the request (fence, release, ABORT to the prefill node); it fails with
    /// `Aborted`.
    fn abort(&self) {
        self.transfer.abort();
    }
}

// ---------------------------------------------------------------------------------------
// The embedded bootstrap server, and two helpers.

/// kvwire's embedded bootstrap server (HTTP/1.1 + JSON), on its own small runtime.
#[pyclass(module = "kvwire._native", frozen)]
struct BootstrapServer {
    server: kvwire::polled::BootstrapServer,
}

#[pymethods]
impl BootstrapServer {
    /// Binds the server on `address` (`host:port`; port 0 picks one).
    #[new]
    #[pyo3(signature = (address="127.0.0.1:0".to_string()))]
    fn new(py: Python<'_>, address: String) -> PyResult<Self> {
        let server = py
            .allow_threads(|| kvwire::polled::BootstrapServer::bind(&address))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(Self { server })
    }

    /// `host:port` it listens on.
    #[getter]
    fn address(&self) -> String {
        self.server.local_addr().to_string()
    }

    /// Records held now.
    fn record_count(&self) -> usize {
        self.server.record_count()
    }

    /// Stops the server.
    fn close(&self, py: Python<'_>) {
        py.allow_threads(|| self.server.close());
    }
}

/// Sleeps `seconds` with the GIL released (for tests and polling loops).
#[pyfunction]
fn sleep(py: Python<'_>, seconds: f64) -> PyResult<()> {
    let d = secs(seconds)?;
    py.allow_threads(|| std::thread::sleep(d));
    Ok(())
}

/// A fresh pre-shared key (32 random bytes).
#[pyfunction]
fn gen_psk<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
    let key = kvwire::config::auth::generate_key()
        .map_err(|e| PyRuntimeError::new_err(format!("random source: {e}")))?;
    Ok(PyBytes::new(py, &key))
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_class::<Sender>()?;
    m.add_class::<Receiver>()?;
    m.add_class::<BootstrapServer>()?;
    m.add_function(wrap_pyfunction!(sleep, m)?)?;
    m.add_function(wrap_pyfunction!(gen_psk, m)?)?;
    m.add("KVWIRE_VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
