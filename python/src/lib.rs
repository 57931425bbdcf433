//! `kvwire._native`: the Python binding of kvwire (pyo3), a thin layer over the crate's
//! engine API. The Python package `kvwire` (`python/kvwire/`) wraps these classes in the
//! shape inference engines use (SGLang's `KVManager`, `KVSender`, `KVReceiver`, `KVPoll`);
//! this module holds only what needs Rust:
//!
//! * [`Engine`]: one node (the engine's KV memory registered by pointer with
//!   `KvMemory::from_raw_parts`, its aux buffers, a background tokio runtime), listening for
//!   decode peers (prefill) or connecting to prefill peers (decode);
//! * [`Sender`]: one request sent in chunks (`SenderConn::admit` / `open`,
//!   `OutgoingTransfer::send_chunk`, the final chunk carrying the aux record);
//! * [`Receiver`]: one reservation into the engine's chosen pages (`ReserveParams::into_pages`),
//!   its verified aux record written into the engine's aux buffers;
//! * [`BootstrapServer`] and the discovery calls on [`Engine`] (`kvwire::discovery`).
//!
//! Nothing here blocks in `poll`: a transfer's state is an atomic that the runtime's tasks
//! advance. Every call that waits (binding a port, a discovery round trip, `wait`) releases
//! the GIL, and no runtime task ever takes it.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvwire::discovery::{
    node_layout_fingerprint, Discovery, DiscoveryError, EmbeddedDiscovery, PeerQuery, PeerRecord,
    Registration, Role as PeerRole,
};
use kvwire::engine::ListenerConfig;
use kvwire::proto::admission::AdmissionError;
use kvwire::{
    Auth, EngineError, ErrorCode, FailureReason, KvMemory, Listener, Node, NodeConfig,
    OutgoingTransfer, PoolGeometry, ReceiverConn, Request, ReserveParams, SenderConn,
    TransferError, TransferId, TransportConfig,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// SGLang's `KVPoll` values.
mod poll {
    pub const FAILED: u8 = 0;
    pub const BOOTSTRAPPING: u8 = 1;
    pub const WAITING_FOR_INPUT: u8 = 2;
    pub const TRANSFERRING: u8 = 3;
    pub const SUCCESS: u8 = 4;
}

// ---------------------------------------------------------------------------------------
// Errors: every failure crosses into Python as one `ErrInfo`, which `kvwire.errors._make`
// turns into the typed exception (one class per kind).

/// A failure, as the Python layer builds its exception from it.
#[derive(Clone, Debug)]
struct ErrInfo {
    /// The exception class (`kvwire.errors` name).
    kind: &'static str,
    message: String,
    retryable: bool,
    code: Option<u16>,
    /// For `Unconfirmed`: the kind of what ended the wait.
    cause: Option<&'static str>,
}

impl ErrInfo {
    fn new(kind: &'static str, message: impl Into<String>, retryable: bool) -> Self {
        Self {
            kind,
            message: message.into(),
            retryable,
            code: None,
            cause: None,
        }
    }

    fn code(mut self, code: ErrorCode) -> Self {
        self.code = Some(code.0);
        self
    }

    /// The typed Python exception.
    fn to_py(&self, py: Python<'_>) -> PyErr {
        let make = || -> PyResult<PyErr> {
            let module = py.import("kvwire.errors")?;
            let name = self.code.map(|c| ErrorCode(c).to_string());
            let exc = module.getattr("_make")?.call1((
                self.kind,
                self.message.clone(),
                self.retryable,
                self.code,
                name,
                self.cause,
            ))?;
            Ok(PyErr::from_value(exc))
        };
        make().unwrap_or_else(|e| e)
    }
}

fn reason_kind(r: &FailureReason) -> &'static str {
    use FailureReason as F;
    match r {
        // The prefill's engine cancelled the request before writing anything: kvwire answers
        // the reservation with REJECT carrying CANCELLED. To the decode engine that is the
        // peer's abort.
        F::Rejected { code, .. } if *code == ErrorCode::CANCELLED => "PeerAborted",
        F::Rejected { .. } => "Rejected",
        F::ReservationRefused { .. } => "ReservationRefused",
        F::CountMismatch { .. } => "CountMismatch",
        F::DigestMismatch { .. } => "DigestMismatch",
        F::AuxMismatch => "AuxMismatch",
        F::PagesMissing { .. } => "PagesMissing",
        F::AuxTooLarge { .. } => "AuxTooLarge",
        F::MissingDigest { .. } => "MissingDigest",
        F::StaleNonce { .. } => "StaleNonce",
        F::Timeout { .. } => "Timeout",
        F::PeerAbort { .. } => "PeerAborted",
        F::LocalAbort { .. } => "Aborted",
        F::Nacked { .. } => "Nacked",
        F::WriteFailed => "WriteFailed",
        F::PeerLost => "PeerLost",
        F::PeerUnresponsive => "PeerUnresponsive",
        F::Unconfirmed { .. } => "Unconfirmed",
        F::ProtocolViolation { .. } => "ProtocolViolation",
        _ => "TransferError",
    }
}

fn from_reason(r: &FailureReason) -> ErrInfo {
    let mut e = ErrInfo::new(reason_kind(r), r.to_string(), r.is_retryable()).code(r.code());
    if let FailureReason::Unconfirmed { cause } = r {
        e.cause = Some(reason_kind(cause));
        e.retryable = cause.is_retryable();
    }
    e
}

fn from_admission(a: &AdmissionError) -> ErrInfo {
    ErrInfo::new("Rejected", format!("rejected at admission: {a}"), false).code(a.code())
}

fn from_transfer(e: &TransferError) -> ErrInfo {
    let retryable = e.is_retryable();
    match e {
        TransferError::Failed(r) => from_reason(r),
        TransferError::Rejected(a) => from_admission(a),
        TransferError::Unauthenticated(_) => ErrInfo::new("Unauthenticated", e.to_string(), false),
        TransferError::ConnectionClosed => ErrInfo::new("PeerLost", e.to_string(), true),
        TransferError::Reserve(_) => ErrInfo::new("ReservationFailed", e.to_string(), retryable),
        TransferError::Start(_) | TransferError::Chunk(_) => {
            ErrInfo::new("InvalidRequest", e.to_string(), retryable)
        }
        _ => ErrInfo::new("TransferError", e.to_string(), retryable),
    }
}

fn from_engine(e: &EngineError) -> ErrInfo {
    let msg = e.to_string();
    match e.refusal_code() {
        Some(c) if c == ErrorCode::AUTH_FAILED || c == ErrorCode::AUTH_MISMATCH => {
            ErrInfo::new("Unauthenticated", msg, false).code(c)
        }
        Some(c) => ErrInfo::new("HandshakeRefused", msg, false).code(c),
        None => match e {
            EngineError::Io(_) => ErrInfo::new("ConnectFailed", msg, true),
            EngineError::Config(_) | EngineError::Pool(_) => {
                ErrInfo::new("ConfigError", msg, false)
            }
            _ => ErrInfo::new("ConnectFailed", msg, false),
        },
    }
}

fn from_discovery(e: &DiscoveryError) -> ErrInfo {
    ErrInfo::new("DiscoveryError", e.to_string(), false)
}

fn raise(py: Python<'_>, e: ErrInfo) -> PyErr {
    e.to_py(py)
}

// ---------------------------------------------------------------------------------------
// One transfer's state, shared with the runtime's tasks.

#[derive(Debug)]
struct State {
    status: AtomicU8,
    error: Mutex<Option<ErrInfo>>,
    /// The aux record as verified (decode side), for `Receiver.aux()`.
    aux: Mutex<Option<Vec<u8>>>,
    /// The destination pages the verified handle named (decode side).
    verified_pages: Mutex<Option<Vec<u32>>>,
}

impl State {
    fn new(status: u8) -> Arc<Self> {
        Arc::new(Self {
            status: AtomicU8::new(status),
            error: Mutex::new(None),
            aux: Mutex::new(None),
            verified_pages: Mutex::new(None),
        })
    }

    fn get(&self) -> u8 {
        self.status.load(Ordering::Acquire)
    }

    fn is_final(&self) -> bool {
        matches!(self.get(), poll::FAILED | poll::SUCCESS)
    }

    /// Moves `from` -> `to` (only from that state).
    fn advance(&self, from: u8, to: u8) -> bool {
        self.status
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Fails the transfer unless it already ended (the first verdict stands).
    fn fail(&self, e: ErrInfo) -> bool {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if self.is_final() {
            return false;
        }
        *slot = Some(e);
        self.status.store(poll::FAILED, Ordering::Release);
        true
    }

    fn succeed(&self) -> bool {
        let _slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if self.is_final() {
            return false;
        }
        self.status.store(poll::SUCCESS, Ordering::Release);
        true
    }

    fn error(&self) -> Option<ErrInfo> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

// ---------------------------------------------------------------------------------------
// The engine's aux buffers: small per-request records (e.g. the first output token), one
// slot of `item_len` bytes per aux index in each buffer. The record sent with the final
// chunk is the concatenation of the slot in every buffer.

#[derive(Debug)]
struct AuxBuffers {
    /// (base address, length, item length) per buffer.
    buffers: Vec<(usize, usize, usize)>,
}

impl AuxBuffers {
    fn record_len(&self) -> usize {
        self.buffers.iter().map(|b| b.2).sum()
    }

    fn check_index(&self, index: usize) -> Result<(), ErrInfo> {
        for (b, &(_, len, item)) in self.buffers.iter().enumerate() {
            let end = index.checked_add(1).and_then(|n| n.checked_mul(item));
            if end.is_none_or(|end| end > len) {
                return Err(ErrInfo::new(
                    "InvalidRequest",
                    format!("aux index {index} out of range of aux buffer {b} ({len} bytes, {item} per item)"),
                    false,
                ));
            }
        }
        Ok(())
    }

    /// The record at `index` (a copy of a few bytes).
    fn read(&self, index: usize) -> Result<Vec<u8>, ErrInfo> {
        self.check_index(index)?;
        let mut out = Vec::with_capacity(self.record_len());
        for &(base, _, item) in &self.buffers {
            // SAFETY: `check_index` put [index*item, index*item+item) inside the buffer, and
            // the engine promised (KVManager's contract, `Engine::new`) that each aux buffer is
            // valid for reads and writes of its length while the manager lives. The engine
            // writes the record before `send` of the final chunk and not while it is read.
            let bytes =
                unsafe { std::slice::from_raw_parts((base + index * item) as *const u8, item) };
            out.extend_from_slice(bytes);
        }
        Ok(out)
    }

    /// Writes `record` into slot `index` (shorter records leave the rest of the slot zeroed).
    fn write(&self, index: usize, record: &[u8]) -> Result<(), ErrInfo> {
        self.check_index(index)?;
        if record.len() > self.record_len() {
            return Err(ErrInfo::new(
                "AuxTooLarge",
                format!(
                    "the verified aux record has {} bytes, the aux slot {}",
                    record.len(),
                    self.record_len()
                ),
                false,
            ));
        }
        let mut rest = record;
        for &(base, _, item) in &self.buffers {
            let (now, later) = rest.split_at(rest.len().min(item));
            rest = later;
            // SAFETY: in bounds as in `read`; the engine reads this slot only after `poll`
            // reported Success (an acquire of the state this write happens before), and
            // writes it only for a request it is not receiving.
            let slot =
                unsafe { std::slice::from_raw_parts_mut((base + index * item) as *mut u8, item) };
            slot[..now.len()].copy_from_slice(now);
            slot[now.len()..].fill(0);
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// The engine.

/// A decode engine's connection to one prefill address.
#[derive(Clone, Debug)]
enum Link {
    Connecting,
    Up(ReceiverConn),
    Failed(ErrInfo),
}

#[derive(Default, Debug)]
struct Peers {
    /// Prefill: accepted connections from decode nodes, by the peer's node id, in order.
    senders: Vec<(u64, SenderConn)>,
    /// Decode: connections to prefill nodes, by address.
    links: HashMap<String, Link>,
}

struct Inner {
    rt: tokio::runtime::Runtime,
    node: Node,
    prefill: bool,
    aux: Arc<AuxBuffers>,
    peers: Arc<Mutex<Peers>>,
    address: Option<String>,
    accept_task: Option<tokio::task::JoinHandle<()>>,
    listener_stats: Arc<Mutex<kvwire::engine::ListenerStats>>,
    registrations: Mutex<Vec<Registration>>,
    reserve_timeout: Duration,
    /// The Python objects that own the registered memory (the engine's arrays), released
    /// only after the runtime (declared first) stopped every task that could touch them.
    _keepalive: Option<PyObject>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(t) = self.accept_task.take() {
            t.abort();
        }
        // Registrations remove their record as they go (a task on this runtime).
        let _guard = self.rt.enter();
        self.registrations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

impl Inner {
    fn peers(&self) -> std::sync::MutexGuard<'_, Peers> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One engine's node: its KV memory registered by pointer, its aux buffers, a background
/// runtime, and its connections (prefill: accepted from decode nodes; decode: to prefill
/// nodes).
#[pyclass(module = "kvwire._native", frozen)]
struct Engine {
    inner: Arc<Inner>,
}

fn pages_from_bytes(raw: &[u8], width: usize) -> PyResult<Vec<u32>> {
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

#[pymethods]
impl Engine {
    /// Registers the engine's KV buffers (one base pointer, length and bytes per page each;
    /// every buffer must hold the same number of pages) and aux buffers by address.
    ///
    /// The contract (unchecked; `KvMemory::from_raw_parts`): every address is valid for
    /// reads and writes of its length for as long as this engine and everything made from
    /// it live, the buffers do not overlap, and the engine writes no page kvwire holds.
    #[new]
    #[pyo3(signature = (prefill, kv_data_ptrs, kv_data_lens, kv_item_lens, aux_data_ptrs, aux_data_lens, aux_item_lens, page_size, *, max_context_tokens=None, psk=None, insecure_no_auth=false, fingerprint="kvwire-python".to_string(), node_id=None, listen=None, transport="tcp".to_string(), ib_device=None, liveness_timeout_s=2.0, reserve_timeout_s=30.0, reservation_wait_s=30.0, parked_reservation_s=30.0, worker_threads=2, keepalive=None))]
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
        liveness_timeout_s: f64,
        reserve_timeout_s: f64,
        reservation_wait_s: f64,
        parked_reservation_s: f64,
        worker_threads: usize,
        keepalive: Option<PyObject>,
    ) -> PyResult<Self> {
        let n = kv_data_ptrs.len();
        if n == 0 || kv_data_lens.len() != n || kv_item_lens.len() != n {
            return Err(PyValueError::new_err(
                "kv_data_ptrs, kv_data_lens and kv_item_lens must be non-empty and of one length",
            ));
        }
        let mut pages = None;
        for b in 0..n {
            let (len, item) = (kv_data_lens[b], kv_item_lens[b]);
            if item == 0 || len % item != 0 {
                return Err(PyValueError::new_err(format!(
                    "kv buffer {b}: {len} bytes is not a whole number of {item}-byte pages"
                )));
            }
            let p = len / item;
            if *pages.get_or_insert(p) != p {
                return Err(PyValueError::new_err(format!(
                    "kv buffer {b} holds {p} pages, buffer 0 holds {}: every buffer must hold the same pages",
                    pages.unwrap_or(0)
                )));
            }
        }
        let pages = u32::try_from(pages.unwrap_or(0))
            .map_err(|_| PyValueError::new_err("too many pages"))?;
        let geometry = PoolGeometry {
            tokens_per_page: page_size,
            buffer_page_bytes: kv_item_lens
                .iter()
                .map(|&b| u32::try_from(b).map_err(|_| PyValueError::new_err("page too large")))
                .collect::<PyResult<_>>()?,
            pages,
        };
        let capacity = geometry.capacity_tokens();
        let auth = match (psk, insecure_no_auth) {
            (Some(key), _) => Auth::Psk(
                kvwire::proto::auth::Psk::new(key)
                    .map_err(|e| PyValueError::new_err(format!("pre-shared key: {e}")))?,
            ),
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
            "rdma" => TransportConfig::rdma(ib_device.as_deref()),
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown transport {other:?} (tcp or rdma)"
                )))
            }
        };
        // SenderConfig is non-exhaustive: start from its defaults and set one field.
        #[allow(clippy::field_reassign_with_default)]
        let sender = {
            let mut c = kvwire::proto::sender::SenderConfig::default();
            c.reservation_timeout = secs(reservation_wait_s)?;
            // A decode node's reservation usually arrives before the prefill's scheduler
            // calls `init` (its queue may take a while): hold it that long.
            c.parked_reservation_timeout = secs(parked_reservation_s)?;
            c
        };
        let liveness = kvwire::proto::liveness::LivenessConfig {
            interval: secs(liveness_timeout_s / 8.0)?,
            timeout: secs(liveness_timeout_s)?,
        };
        let mut builder =
            NodeConfig::builder(geometry.clone(), max_context_tokens.unwrap_or(capacity))
                .fingerprint(fingerprint.into_bytes())
                .auth(auth)
                .transport(transport)
                .sender(sender)
                .liveness(liveness);
        // Node ids tell a prefill's decode peers apart: random unless given.
        let node_id = match node_id {
            Some(id) => id,
            None => u64::from_ne_bytes(
                kvwire::engine::random_bytes()
                    .map_err(|e| PyRuntimeError::new_err(format!("random source: {e}")))?,
            ),
        };
        builder = builder.node_id(node_id);
        let mut config = builder
            .build()
            .map_err(|e| raise(py, ErrInfo::new("ConfigError", e.to_string(), false)))?;
        if aux_data_ptrs.len() != aux_data_lens.len() || aux_item_lens.len() != aux_data_ptrs.len()
        {
            return Err(PyValueError::new_err(
                "aux_data_ptrs, aux_data_lens and aux_item_lens must be of one length",
            ));
        }
        let aux = AuxBuffers {
            buffers: (0..aux_data_ptrs.len())
                .map(|i| (aux_data_ptrs[i], aux_data_lens[i], aux_item_lens[i]))
                .collect(),
        };
        if aux.record_len() > kvwire::proto::wire::MAX_AUX {
            return Err(PyValueError::new_err(format!(
                "an aux record of {} bytes exceeds kvwire's limit of {}",
                aux.record_len(),
                kvwire::proto::wire::MAX_AUX
            )));
        }
        config.max_aux = config.max_aux.max(aux.record_len() as u32);
        let mut regions = Vec::with_capacity(n);
        for b in 0..n {
            let ptr = NonNull::new(kv_data_ptrs[b] as *mut u8).ok_or_else(|| {
                PyValueError::new_err(format!("kv buffer {b} has a null pointer"))
            })?;
            regions.push((ptr, kv_data_lens[b]));
        }
        // SAFETY: the caller's contract, stated in this constructor's documentation and in
        // `kvwire.KVManager`'s: each (pointer, length) is the engine's own buffer (a numpy
        // array or tensor the Python manager keeps a reference to), valid for reads and
        // writes of its length while the manager lives; the buffers do not overlap (checked
        // by the Python layer for arrays it is given); the engine writes no page kvwire holds.
        let memory = unsafe { KvMemory::from_raw_parts(&geometry, regions) }
            .map_err(|e| raise(py, ErrInfo::new("ConfigError", e.to_string(), false)))?;
        let node = Node::with_memory(config, memory).map_err(|e| raise(py, from_engine(&e)))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(worker_threads.max(1))
            .thread_name("kvwire")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("tokio runtime: {e}")))?;
        let peers = Arc::new(Mutex::new(Peers::default()));
        let listener_stats = Arc::new(Mutex::new(kvwire::engine::ListenerStats::default()));
        let (address, accept_task) = if prefill {
            let listen = listen.unwrap_or_else(|| "127.0.0.1:0".to_string());
            let node2 = node.clone();
            let mut listener = py
                .allow_threads(|| {
                    rt.block_on(Listener::senders(
                        listen.as_str(),
                        &node2,
                        ListenerConfig::default(),
                    ))
                })
                .map_err(|e| {
                    raise(
                        py,
                        ErrInfo::new("ConnectFailed", format!("listen on {listen}: {e}"), false),
                    )
                })?;
            let addr = listener.local_addr().to_string();
            let (peers2, stats2) = (peers.clone(), listener_stats.clone());
            let task = rt.spawn(async move {
                loop {
                    let next =
                        tokio::time::timeout(Duration::from_millis(100), listener.accept()).await;
                    *stats2.lock().unwrap_or_else(|p| p.into_inner()) = listener.stats();
                    match next {
                        Ok(Some(conn)) => {
                            let id = conn.peer().node_id;
                            let mut p = peers2.lock().unwrap_or_else(|p| p.into_inner());
                            p.senders.retain(|(i, _)| *i != id);
                            p.senders.push((id, conn));
                        }
                        Ok(None) => return,
                        Err(_) => {
                            // Forget connections whose peer is gone (a restarted decode node
                            // comes back as a new connection).
                            let conns: Vec<(u64, SenderConn)> = peers2
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .senders
                                .clone();
                            for (id, c) in conns {
                                if c.stats().await.map_or(true, |s| s.peer_lost) {
                                    peers2
                                        .lock()
                                        .unwrap_or_else(|p| p.into_inner())
                                        .senders
                                        .retain(|(i, _)| *i != id);
                                }
                            }
                        }
                    }
                }
            });
            (Some(addr), Some(task))
        } else {
            // Forget connections whose peer is gone, so the next receiver reconnects (or
            // re-resolves the prefill through discovery).
            let peers2 = peers.clone();
            let task = rt.spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let up: Vec<(String, ReceiverConn)> = peers2
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .links
                        .iter()
                        .filter_map(|(a, l)| match l {
                            Link::Up(c) => Some((a.clone(), c.clone())),
                            _ => None,
                        })
                        .collect();
                    for (address, c) in up {
                        if c.stats().await.map_or(true, |s| s.peer_lost) {
                            forget(&peers2, &address);
                        }
                    }
                }
            });
            (None, Some(task))
        };
        Ok(Self {
            inner: Arc::new(Inner {
                rt,
                node,
                prefill,
                aux: Arc::new(aux),
                peers,
                address,
                accept_task,
                listener_stats,
                registrations: Mutex::new(Vec::new()),
                reserve_timeout: secs(reserve_timeout_s)?,
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
        self.inner.node.config().node_id
    }

    /// Pages in every KV buffer.
    #[getter]
    fn pages(&self) -> u32 {
        self.inner.node.config().pool.pages
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.inner.node.config().pool.tokens_per_page
    }

    /// The fingerprint of this node's KV layout and model fingerprint, as discovery records
    /// carry it.
    #[getter]
    fn layout_fingerprint(&self) -> String {
        node_layout_fingerprint(self.inner.node.config())
    }

    /// Prefill: node ids of the decode nodes connected now, oldest first.
    fn connected_peers(&self) -> Vec<u64> {
        self.inner
            .peers()
            .senders
            .iter()
            .map(|(id, _)| *id)
            .collect()
    }

    /// Prefill: the listener's handshake counters (accepted, established, refused,
    /// malformed, failed).
    fn handshake_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = *self
            .inner
            .listener_stats
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let d = PyDict::new(py);
        d.set_item("accepted", s.accepted)?;
        d.set_item("established", s.established)?;
        d.set_item("refused", s.refused)?;
        d.set_item("malformed", s.malformed)?;
        d.set_item("failed", s.failed)?;
        Ok(d)
    }

    /// Which pages kvwire holds now (leased to a transfer); the engine must not free them.
    fn held_pages(&self) -> Vec<u32> {
        self.inner
            .node
            .pool()
            .held_pages()
            .into_iter()
            .map(|(p, _)| p)
            .collect()
    }

    /// Decode: starts connecting to the prefill node at `address` unless a connection is
    /// up or on its way (returns at once).
    fn connect(&self, address: String) {
        connect(&self.inner, &address, false);
    }

    /// Decode: whether a connection to `address` is up now.
    fn link_up(&self, address: &str) -> bool {
        matches!(self.inner.peers().links.get(address), Some(Link::Up(_)))
    }

    /// A sender for request `room` (prefill).
    #[pyo3(signature = (room, peer=None))]
    fn sender(&self, room: u64, peer: Option<u64>) -> PyResult<Sender> {
        if !self.inner.prefill {
            return Err(PyValueError::new_err("a decode engine has no senders"));
        }
        Ok(Sender {
            inner: self.inner.clone(),
            room,
            peer,
            state: State::new(poll::BOOTSTRAPPING),
            tx: Mutex::new(SenderSlot::default()),
        })
    }

    /// A receiver for request `room` from the prefill node at `address` (decode).
    fn receiver(&self, room: u64, address: String) -> PyResult<Receiver> {
        if self.inner.prefill {
            return Err(PyValueError::new_err("a prefill engine has no receivers"));
        }
        connect(&self.inner, &address, true);
        Ok(Receiver {
            inner: self.inner.clone(),
            room,
            address,
            state: State::new(poll::BOOTSTRAPPING),
            pending: Mutex::new(None),
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
        let inner = &self.inner;
        let address = address.or_else(|| inner.address.clone()).ok_or_else(|| {
            PyValueError::new_err("no address to publish (a decode engine must pass address=)")
        })?;
        let role = if inner.prefill {
            PeerRole::Prefill
        } else {
            PeerRole::Decode
        };
        let mut record = PeerRecord::new(cluster, role, rank, inner.node.config().node_id, address)
            .with_layout_of(inner.node.config());
        if matches!(inner.node.config().transport, TransportConfig::Rdma { .. }) {
            record.transport = "rdma".to_string();
        }
        let ttl = secs(ttl_s)?;
        let disc = backend(py, inner, server, etcd_endpoints, etcd_prefix, ttl)?;
        let reg = py
            .allow_threads(|| inner.rt.block_on(disc.register(record)))
            .map_err(|e| raise(py, from_discovery(&e)))?;
        inner
            .registrations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(reg);
        Ok(())
    }

    /// Removes this node's records now and waits until they are gone (at most a few
    /// seconds; they also go, without waiting, when the engine is dropped).
    fn deregister(&self, py: Python<'_>) {
        let regs: Vec<Registration> = std::mem::take(
            &mut *self
                .inner
                .registrations
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        py.allow_threads(|| {
            self.inner.rt.block_on(async {
                for r in regs {
                    let _ = tokio::time::timeout(Duration::from_secs(5), r.deregister()).await;
                }
            })
        });
    }

    /// The peers of `role` ("prefill" or "decode") registered in `cluster` (optionally of
    /// one rank): a list of dicts (node_id, rank, address, transport, layout_fingerprint).
    /// With `check_layout`, a peer whose layout fingerprint differs from this node's raises
    /// `LayoutMismatch` (fail closed) instead of being returned.
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
        let inner = &self.inner;
        let role = match role.as_str() {
            "prefill" => PeerRole::Prefill,
            "decode" => PeerRole::Decode,
            r => {
                return Err(PyValueError::new_err(format!(
                    "role {r:?}: prefill or decode"
                )))
            }
        };
        let mut query = PeerQuery::cluster(cluster).role(role);
        if let Some(r) = rank {
            query = query.rank(r);
        }
        let disc = backend(
            py,
            inner,
            server,
            etcd_endpoints,
            etcd_prefix,
            Duration::from_secs(10),
        )?;
        let found = py
            .allow_threads(|| inner.rt.block_on(disc.resolve(query)))
            .map_err(|e| raise(py, from_discovery(&e)))?;
        let mine = node_layout_fingerprint(inner.node.config());
        let mut out = Vec::new();
        for r in found {
            if check_layout {
                r.check_layout(&mine).map_err(|e| {
                    raise(
                        py,
                        ErrInfo::new(
                            "LayoutMismatch",
                            format!("peer {} at {}: {e}", r.node_id, r.address),
                            false,
                        ),
                    )
                })?;
            }
            let d = PyDict::new(py);
            d.set_item("node_id", r.node_id)?;
            d.set_item("rank", r.engine_rank)?;
            d.set_item("address", r.address.clone())?;
            d.set_item("transport", r.transport.clone())?;
            d.set_item("layout_fingerprint", r.layout_fingerprint.clone())?;
            d.set_item("cluster", r.cluster.clone())?;
            out.push(d);
        }
        Ok(out)
    }

    /// Whether this build includes etcd discovery (cargo feature `etcd`).
    #[staticmethod]
    fn has_etcd() -> bool {
        cfg!(feature = "etcd")
    }
}

fn secs(s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| PyValueError::new_err(format!("bad duration {s}")))
}

fn backend(
    py: Python<'_>,
    inner: &Inner,
    server: Option<String>,
    etcd_endpoints: Option<Vec<String>>,
    etcd_prefix: String,
    ttl: Duration,
) -> PyResult<Arc<dyn Discovery>> {
    if let Some(endpoints) = etcd_endpoints {
        #[cfg(feature = "etcd")]
        {
            use kvwire::discovery::{EtcdDiscovery, EtcdOptions};
            let options = EtcdOptions::default()
                .with_prefix(etcd_prefix)
                .with_ttl(ttl);
            let d = py
                .allow_threads(|| {
                    inner
                        .rt
                        .block_on(EtcdDiscovery::connect(endpoints, options))
                })
                .map_err(|e| raise(py, from_discovery(&e)))?;
            return Ok(Arc::new(d));
        }
        #[cfg(not(feature = "etcd"))]
        {
            let _ = (endpoints, etcd_prefix, inner);
            return Err(raise(
                py,
                ErrInfo::new(
                    "DiscoveryError",
                    "this kvwire was built without etcd (build with --features etcd)",
                    false,
                ),
            ));
        }
    }
    let _ = &etcd_prefix;
    let server = server.ok_or_else(|| {
        PyValueError::new_err("a bootstrap server address or etcd endpoints are needed")
    })?;
    Ok(Arc::new(EmbeddedDiscovery::from_host(server).with_ttl(ttl)))
}

/// Decode: a connection to `address` is up, on its way, or started now (`retry`: also
/// replace one that failed to open, for a new receiver; the receivers that saw it fail keep
/// their failure).
fn connect(inner: &Arc<Inner>, address: &str, retry: bool) {
    let mut peers = inner.peers();
    match peers.links.get(address) {
        Some(Link::Connecting) | Some(Link::Up(_)) => return,
        Some(Link::Failed(_)) if !retry => return,
        _ => {}
    }
    peers.links.insert(address.to_string(), Link::Connecting);
    let (node, addr, links) = (inner.node.clone(), address.to_string(), inner.peers.clone());
    inner.rt.spawn(async move {
        let link = match ReceiverConn::connect(addr.as_str(), &node).await {
            Ok(conn) => Link::Up(conn),
            Err(e) => Link::Failed(from_engine(&e)),
        };
        links
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .links
            .insert(addr, link);
    });
}

/// Decode: forget a connection that lost its peer, so the next receiver reconnects.
fn forget(peers: &Mutex<Peers>, address: &str) {
    let mut p = peers.lock().unwrap_or_else(|p| p.into_inner());
    if matches!(p.links.get(address), Some(Link::Up(_))) {
        p.links.remove(address);
    }
}

// ---------------------------------------------------------------------------------------
// Prefill: one request, sent in chunks.

#[derive(Default)]
struct SenderSlot {
    /// What `init` asked for: (pages, tokens, aux index), until a connection is there.
    planned: Option<(u32, u32, Option<usize>)>,
    conn: Option<SenderConn>,
    tx: Option<OutgoingTransfer>,
    pages_total: u32,
    pages_sent: u32,
    aux_index: Option<usize>,
}

/// The prefill side of one request (SGLang's KVSender core).
#[pyclass(module = "kvwire._native", frozen)]
struct Sender {
    inner: Arc<Inner>,
    room: u64,
    peer: Option<u64>,
    state: Arc<State>,
    tx: Mutex<SenderSlot>,
}

impl Sender {
    fn slot(&self) -> std::sync::MutexGuard<'_, SenderSlot> {
        self.tx.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The connection to the decode node this request goes to: the one named, or the only
    /// one (several without a name fail the request).
    fn connection(&self) -> Option<SenderConn> {
        let peers = self.inner.peers();
        match self.peer {
            Some(id) => peers
                .senders
                .iter()
                .find(|(i, _)| *i == id)
                .map(|(_, c)| c.clone()),
            None => match peers.senders.len() {
                1 => Some(peers.senders[0].1.clone()),
                0 => None,
                _ => {
                    drop(peers);
                    self.state.fail(ErrInfo::new(
                        "InvalidRequest",
                        "several decode nodes are connected: name the destination (peer=node id)",
                        false,
                    ));
                    None
                }
            },
        }
    }

    /// Opens the transfer once a connection to the decode node exists.
    fn try_open(&self, slot: &mut SenderSlot) {
        if slot.tx.is_some() || self.state.is_final() {
            return;
        }
        let Some(conn) = self.connection() else {
            return;
        };
        // Connected: ready for `init` (SGLang's WaitingForInput), and opened once planned.
        self.state
            .advance(poll::BOOTSTRAPPING, poll::WAITING_FOR_INPUT);
        let Some((pages, tokens, _)) = slot.planned else {
            return;
        };
        let id = TransferId(self.room);
        let admitted = match conn.admit(Request {
            transfer_id: id,
            tokens: u64::from(tokens),
        }) {
            Ok(a) => a,
            Err(e) => {
                self.state.fail(from_transfer(&e));
                return;
            }
        };
        if admitted.pages() != pages {
            let e = ErrInfo::new(
                "InvalidRequest",
                format!(
                    "{tokens} tokens occupy {} pages, init said {pages}",
                    admitted.pages()
                ),
                false,
            );
            conn.abort(id, ErrorCode::CANCELLED);
            self.state.fail(e);
            return;
        }
        let mut tx = conn.open(admitted);
        let outcome = tx.take_outcome();
        let state = self.state.clone();
        self.inner.rt.spawn(async move {
            match outcome.await {
                Ok(()) => state.succeed(),
                Err(e) => state.fail(from_transfer(&e)),
            };
        });
        slot.tx = Some(tx);
        slot.conn = Some(conn);
        slot.pages_total = pages;
        self.state
            .advance(poll::BOOTSTRAPPING, poll::WAITING_FOR_INPUT);
    }
}

#[pymethods]
impl Sender {
    /// The request (bootstrap room).
    #[getter]
    fn room(&self) -> u64 {
        self.room
    }

    /// Plans the request: `num_pages` pages (`num_tokens` tokens, default
    /// `num_pages * page_size`), the aux record at `aux_index` going with the final chunk.
    /// Admission runs as soon as a connection to the decode node exists (now, or at a later
    /// `poll`): a request it rejects fails with `Rejected` carrying the original code, and the
    /// decode node's reservation for it is answered with the same error.
    #[pyo3(signature = (num_pages, aux_index=None, num_tokens=None))]
    fn init(
        &self,
        num_pages: u32,
        aux_index: Option<usize>,
        num_tokens: Option<u32>,
    ) -> PyResult<()> {
        let tokens = match num_tokens {
            Some(t) => t,
            None => num_pages
                .checked_mul(self.inner.node.config().pool.tokens_per_page)
                .ok_or_else(|| PyValueError::new_err("too many tokens"))?,
        };
        if let Some(i) = aux_index {
            self.inner
                .aux
                .check_index(i)
                .map_err(|e| PyValueError::new_err(e.message))?;
        }
        let mut slot = self.slot();
        if slot.planned.is_some() {
            return Err(PyValueError::new_err("init was called already"));
        }
        slot.planned = Some((num_pages, tokens, aux_index));
        slot.aux_index = aux_index;
        self.try_open(&mut slot);
        Ok(())
    }

    /// Sends the next chunk: page indices of the engine's KV memory (the bytes of a numpy
    /// int32/int64 array, `width` 4 or 8), in transfer order. The chunk that completes the
    /// request's pages carries the aux record. Returns at once; a refused chunk fails the
    /// transfer (see `poll`).
    fn send(&self, py: Python<'_>, indices: &[u8], width: usize) -> PyResult<()> {
        if width != 4 && width != 8 {
            return Err(PyValueError::new_err("page indices must be int32 or int64"));
        }
        let pages = pages_from_bytes(indices, width)?;
        let mut slot = self.slot();
        self.try_open(&mut slot);
        if self.state.get() == poll::FAILED {
            return Ok(()); // the engine learns why from poll / failure_exception
        }
        let Some(tx) = slot.tx.as_ref() else {
            return Err(PyRuntimeError::new_err(
                "send before the sender is ready (poll() is not WaitingForInput yet)",
            ));
        };
        let total = slot.pages_sent as u64 + pages.len() as u64;
        if total > u64::from(slot.pages_total) {
            let msg = format!("{total} pages sent, init planned {}", slot.pages_total);
            return Err(raise(py, ErrInfo::new("InvalidRequest", msg, false)));
        }
        let last = total == u64::from(slot.pages_total);
        let aux = match (last, slot.aux_index) {
            (true, Some(i)) => Some(self.inner.aux.read(i).map_err(|e| raise(py, e))?),
            _ => None,
        };
        let chunk = tx.send_chunk(pages, aux);
        slot.pages_sent = total as u32;
        let (state, id) = (self.state.clone(), TransferId(self.room));
        let conn = slot.conn.clone();
        self.inner.rt.spawn(async move {
            if let Err(e) = chunk.await {
                // A refused chunk changes nothing in kvwire; the request cannot complete, so
                // it is aborted and reported failed.
                if let Some(c) = conn {
                    c.abort(id, ErrorCode::CANCELLED);
                }
                state.fail(from_transfer(&e));
            }
        });
        if last {
            self.state
                .advance(poll::WAITING_FOR_INPUT, poll::TRANSFERRING);
        }
        Ok(())
    }

    /// The state (a KVPoll value); never blocks. Bootstrapping until a connection to the
    /// decode node exists, WaitingForInput until the final chunk was handed over,
    /// Transferring until the decode node verified it (Success) or it failed (Failed).
    fn poll(&self) -> u8 {
        if self.state.get() == poll::BOOTSTRAPPING {
            let mut slot = self.slot();
            self.try_open(&mut slot);
        }
        self.state.get()
    }

    /// The typed exception of a failed transfer, or None.
    fn error(&self, py: Python<'_>) -> Option<PyObject> {
        self.state
            .error()
            .map(|e| e.to_py(py).into_value(py).into_any())
    }

    /// Aborts the request (stop posting, drain, ABORT to the decode node); it fails with
    /// `Aborted`.
    fn abort(&self) {
        let slot = self.slot();
        if let Some(c) = &slot.conn {
            c.abort(TransferId(self.room), ErrorCode::CANCELLED);
        }
        self.state.fail(
            ErrInfo::new("Aborted", "aborted locally: CANCELLED", false).code(ErrorCode::CANCELLED),
        );
    }

    /// Pages sent so far.
    #[getter]
    fn pages_sent(&self) -> u32 {
        self.slot().pages_sent
    }
}

// ---------------------------------------------------------------------------------------
// Decode: one reservation into the engine's pages.

/// Destination pages, tokens and aux index of a reservation not made yet.
type Metadata = (Vec<u32>, u32, Option<usize>);

/// The decode side of one request (SGLang's KVReceiver core).
#[pyclass(module = "kvwire._native", frozen)]
struct Receiver {
    inner: Arc<Inner>,
    room: u64,
    address: String,
    state: Arc<State>,
    /// Metadata given before the connection was up: (pages, tokens, aux index).
    pending: Mutex<Option<Metadata>>,
}

impl Receiver {
    /// Follows the connection; reserves once it is up and metadata was given.
    fn progress(&self) {
        // Once reserved (Transferring) or ended, the reservation's own future decides.
        if self.state.get() >= poll::TRANSFERRING || self.state.is_final() {
            return;
        }
        let link = self.inner.peers().links.get(&self.address).cloned();
        match link {
            None => connect(&self.inner, &self.address, false),
            Some(Link::Connecting) => {}
            Some(Link::Failed(e)) => {
                self.state.fail(e);
            }
            Some(Link::Up(conn)) => {
                self.state
                    .advance(poll::BOOTSTRAPPING, poll::WAITING_FOR_INPUT);
                let pending = self
                    .pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take();
                if let Some((pages, tokens, aux_index)) = pending {
                    self.reserve(conn, pages, tokens, aux_index);
                }
            }
        }
    }

    fn reserve(&self, conn: ReceiverConn, pages: Vec<u32>, tokens: u32, aux_index: Option<usize>) {
        let id = TransferId(self.room);
        let params =
            ReserveParams::new(id, tokens, self.inner.reserve_timeout).into_pages(pages.clone());
        let verified = conn.reserve(params);
        self.state
            .advance(poll::WAITING_FOR_INPUT, poll::TRANSFERRING);
        let (state, address) = (self.state.clone(), self.address.clone());
        // The task holds no `Inner` (dropping the last one there would drop the runtime
        // inside itself): only the aux buffers' description and the connection map.
        let (peers, aux, aux_target) =
            (self.inner.peers.clone(), self.inner.aux.clone(), aux_index);
        self.inner.rt.spawn(async move {
            match verified.await {
                Ok(kv) => {
                    let landed = kv.page_indices();
                    if landed != pages {
                        state.fail(ErrInfo::new(
                            "ProtocolViolation",
                            format!("verified pages {landed:?} are not the reserved {pages:?}"),
                            false,
                        ));
                        return;
                    }
                    let record = kv.aux().to_vec();
                    let written = match aux_target {
                        Some(i) => aux.write(i, &record),
                        None => Ok(()),
                    };
                    // The pages go back to the engine now: kvwire holds none of them once
                    // this returns, so the engine may read, write and reuse them.
                    if let Err(e) = kv.release() {
                        state.fail(ErrInfo::new(
                            "TransferError",
                            format!("release: {e}"),
                            false,
                        ));
                        return;
                    }
                    *state.aux.lock().unwrap_or_else(|p| p.into_inner()) = Some(record);
                    *state
                        .verified_pages
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = Some(landed);
                    match written {
                        Ok(()) => state.succeed(),
                        Err(e) => state.fail(e),
                    };
                }
                Err(e) => {
                    if matches!(
                        e,
                        TransferError::ConnectionClosed | TransferError::Unauthenticated(_)
                    ) || e.reason().is_some_and(|r| {
                        matches!(r, FailureReason::PeerLost | FailureReason::PeerUnresponsive)
                    }) {
                        forget(&peers, &address);
                    }
                    state.fail(from_transfer(&e));
                }
            }
        });
    }
}

#[pymethods]
impl Receiver {
    /// The request (bootstrap room).
    #[getter]
    fn room(&self) -> u64 {
        self.room
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
        if width != 4 && width != 8 {
            return Err(PyValueError::new_err("page indices must be int32 or int64"));
        }
        let pages = pages_from_bytes(indices, width)?;
        let pool = &self.inner.node.config().pool;
        let tokens = num_tokens.unwrap_or(pages.len() as u64 * u64::from(pool.tokens_per_page));
        if let Some(i) = aux_index {
            self.inner.aux.check_index(i).map_err(|e| raise(py, e))?;
        }
        let capacity = pool.capacity_tokens();
        if tokens > capacity || tokens > u64::from(u32::MAX) {
            let needed = tokens.div_ceil(u64::from(pool.tokens_per_page));
            let e = ErrInfo::new(
                "Rejected",
                format!(
                    "rejected at the decode node: prompt of {tokens} tokens needs {needed} pages but the decode KV pool has {} pages ({capacity} tokens)",
                    pool.pages
                ),
                false,
            )
            .code(ErrorCode::PROMPT_EXCEEDS_POOL);
            self.state.fail(e);
            return Ok(());
        }
        {
            let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            if p.is_some() || self.state.get() >= poll::TRANSFERRING {
                return Err(PyValueError::new_err("send_metadata was called already"));
            }
            *p = Some((pages, tokens as u32, aux_index));
        }
        self.progress();
        Ok(())
    }

    /// The state (a KVPoll value); never blocks.
    fn poll(&self) -> u8 {
        self.progress();
        self.state.get()
    }

    /// The typed exception of a failed transfer, or None.
    fn error(&self, py: Python<'_>) -> Option<PyObject> {
        self.state
            .error()
            .map(|e| e.to_py(py).into_value(py).into_any())
    }

    /// The verified aux record (after Success), or None.
    fn aux<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        let a = self.state.aux.lock().unwrap_or_else(|p| p.into_inner());
        a.as_ref().map(|a| PyBytes::new(py, a))
    }

    /// The destination pages of the verified transfer (after Success), or None.
    fn verified_pages(&self) -> Option<Vec<u32>> {
        self.state
            .verified_pages
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Aborts the request (fence, release, ABORT to the prefill node); it fails with
    /// `Aborted`.
    fn abort(&self) {
        if let Some(Link::Up(conn)) = self.inner.peers().links.get(&self.address) {
            conn.abort(TransferId(self.room), ErrorCode::CANCELLED);
        }
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.state.fail(
            ErrInfo::new("Aborted", "aborted locally: CANCELLED", false).code(ErrorCode::CANCELLED),
        );
    }
}

// ---------------------------------------------------------------------------------------
// The embedded bootstrap server.

/// kvwire's embedded bootstrap server (HTTP/1.1 + JSON), on its own small runtime.
#[pyclass(module = "kvwire._native", frozen)]
struct BootstrapServer {
    rt: tokio::runtime::Runtime,
    server: Mutex<Option<kvwire::discovery::BootstrapServer>>,
    address: String,
}

#[pymethods]
impl BootstrapServer {
    /// Binds the server on `address` (`host:port`; port 0 picks one).
    #[new]
    #[pyo3(signature = (address="127.0.0.1:0".to_string()))]
    fn new(py: Python<'_>, address: String) -> PyResult<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvwire-bootstrap")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("tokio runtime: {e}")))?;
        let (server, addr) = py
            .allow_threads(|| {
                rt.block_on(kvwire::discovery::BootstrapServer::bind(address.as_str()))
            })
            .map_err(|e| PyRuntimeError::new_err(format!("bootstrap server on {address}: {e}")))?;
        Ok(Self {
            rt,
            server: Mutex::new(Some(server)),
            address: addr.to_string(),
        })
    }

    /// `host:port` it listens on.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    /// Records held now.
    fn record_count(&self) -> usize {
        self.server
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(0, |s| s.record_count())
    }

    /// Stops the server.
    fn close(&self, py: Python<'_>) {
        let server = self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(s) = server {
            py.allow_threads(|| self.rt.block_on(s.shutdown()));
        }
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
    let key: [u8; 32] = kvwire::engine::random_bytes()
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
