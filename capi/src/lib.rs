//! The C ABI of kvwire: a thin layer over [`kvwire::polled`] (see `capi/README.md` and the
//! header `capi/include/kvwire.h`, generated from this file by cbindgen).
//!
//! Conventions, for every function:
//!
//! * the return value is `KVWIRE_OK` (0) or a positive `KVWIRE_ERR_*` code (the stable
//!   codes of [`kvwire::polled::ErrorKind`]); after a failure [`kvwire_last_error`] gives
//!   the message, per thread;
//! * handles are opaque pointers made by a `_new` function and freed by its `_free`; a null
//!   handle, or one of another type, is refused with `KVWIRE_ERR_INVALID_ARGUMENT`
//!   (a freed one is undefined behaviour, as in C);
//! * a null pointer where an array of `n > 0` items or an output is expected is refused
//!   with `KVWIRE_ERR_INVALID_ARGUMENT`; strings are NUL-terminated UTF-8;
//! * no panic crosses the boundary: one is caught and reported as `KVWIRE_ERR_INTERNAL`;
//! * every handle may be used from any thread (a transfer's calls serialize).

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use kvwire::polled::{Error, ErrorKind, KvBuffer, KvPoll, Manager, ManagerConfig, Role};
use kvwire::proto::auth::Psk;
use kvwire::{Auth, TransferId, TransportConfig};

// ---------------------------------------------------------------------------------------
// Codes. Literal values, so that cbindgen writes them into the header; a unit test checks
// that each equals the facade's `ErrorKind::code`.

/// Success.
pub const KVWIRE_OK: c_int = 0;
/// An argument is invalid (a null pointer, a handle of another type, a page count that
/// does not fit the tokens, an address that does not parse, ...).
pub const KVWIRE_ERR_INVALID_ARGUMENT: c_int = 1;
/// The call does not fit the transfer's state (send before it is open, init twice, pages
/// asked for before Success).
pub const KVWIRE_ERR_INVALID_STATE: c_int = 2;
/// The caller's buffer is too small (the length needed was written to `*len`).
pub const KVWIRE_ERR_BUFFER_TOO_SMALL: c_int = 3;
/// The node refused to start (e.g. the KV pool holds fewer tokens than the context length,
/// or the transport is not in this build).
pub const KVWIRE_ERR_CONFIG: c_int = 4;
/// A connection could not be opened or accepted.
pub const KVWIRE_ERR_CONNECT_FAILED: c_int = 5;
/// The handshake was refused (layout, fingerprint or version mismatch).
pub const KVWIRE_ERR_HANDSHAKE_REFUSED: c_int = 6;
/// Authentication failed (wrong or missing pre-shared key, or a forged frame).
pub const KVWIRE_ERR_UNAUTHENTICATED: c_int = 7;
/// A bounded wait inside a call ran out.
pub const KVWIRE_ERR_WAIT_TIMED_OUT: c_int = 8;
/// A panic inside kvwire, caught at the boundary (a bug).
pub const KVWIRE_ERR_INTERNAL: c_int = 9;
/// Peer discovery failed (the bootstrap server or etcd unreachable, a bad record).
pub const KVWIRE_ERR_DISCOVERY: c_int = 10;
/// A peer found through discovery has another KV layout or model fingerprint.
pub const KVWIRE_ERR_LAYOUT_MISMATCH: c_int = 11;
/// Rejected at the sender's admission; the wire code is the original error.
pub const KVWIRE_ERR_REJECTED: c_int = 20;
/// The sender refused the reservation.
pub const KVWIRE_ERR_RESERVATION_REFUSED: c_int = 21;
/// A count in the commit differs from the reservation.
pub const KVWIRE_ERR_COUNT_MISMATCH: c_int = 22;
/// A digest of the landed memory differs from the sender's.
pub const KVWIRE_ERR_DIGEST_MISMATCH: c_int = 23;
/// The aux record's digest differs.
pub const KVWIRE_ERR_AUX_MISMATCH: c_int = 24;
/// A reserved page did not receive all its bytes.
pub const KVWIRE_ERR_PAGES_MISSING: c_int = 25;
/// The aux record is longer than the receiver accepts.
pub const KVWIRE_ERR_AUX_TOO_LARGE: c_int = 26;
/// The commit lacked a required digest (fail closed).
pub const KVWIRE_ERR_MISSING_DIGEST: c_int = 27;
/// The commit named another reservation's nonce.
pub const KVWIRE_ERR_STALE_NONCE: c_int = 28;
/// A transfer's deadline passed.
pub const KVWIRE_ERR_TIMEOUT: c_int = 29;
/// The peer aborted the transfer.
pub const KVWIRE_ERR_PEER_ABORTED: c_int = 30;
/// This engine aborted the transfer.
pub const KVWIRE_ERR_ABORTED: c_int = 31;
/// The receiver refused the commit.
pub const KVWIRE_ERR_NACKED: c_int = 32;
/// A data write failed at the transport.
pub const KVWIRE_ERR_WRITE_FAILED: c_int = 33;
/// The connection to the peer was lost.
pub const KVWIRE_ERR_PEER_LOST: c_int = 34;
/// The peer stopped answering heartbeats.
pub const KVWIRE_ERR_PEER_UNRESPONSIVE: c_int = 35;
/// Sender: committed, but no verdict came back (the receiver may have delivered).
pub const KVWIRE_ERR_UNCONFIRMED: c_int = 36;
/// The peer broke the protocol.
pub const KVWIRE_ERR_PROTOCOL_VIOLATION: c_int = 37;
/// The reservation could not be made here (a page already held, the pool full).
pub const KVWIRE_ERR_RESERVATION_FAILED: c_int = 38;
/// The transfer or a chunk could not start on the sender.
pub const KVWIRE_ERR_INVALID_REQUEST: c_int = 39;
/// Another transfer failure.
pub const KVWIRE_ERR_TRANSFER_FAILED: c_int = 40;

/// KVPoll: the transfer failed (final).
pub const KVWIRE_POLL_FAILED: c_int = 0;
/// KVPoll: waiting for a connection to the peer (or for init).
pub const KVWIRE_POLL_BOOTSTRAPPING: c_int = 1;
/// KVPoll: sender open and waiting for chunks; receiver reserved and waiting for data.
pub const KVWIRE_POLL_WAITING_FOR_INPUT: c_int = 2;
/// KVPoll: sender handed over every chunk, waiting for the verdict.
pub const KVWIRE_POLL_TRANSFERRING: c_int = 3;
/// KVPoll: verified (final).
pub const KVWIRE_POLL_SUCCESS: c_int = 4;

/// Room for any socket address as text, with its NUL (kvwire_manager_listen's `bound`).
pub const KVWIRE_ADDR_MAX: usize = 64;

/// The prefill side: sends KV pages.
pub const KVWIRE_ROLE_PREFILL: c_int = 1;
/// The decode side: reserves pages and verifies what lands.
pub const KVWIRE_ROLE_DECODE: c_int = 2;

// ---------------------------------------------------------------------------------------
// Types.

/// One of the engine's KV buffers: base pointer, length in bytes, bytes per page (SGLang's
/// `kv_data_ptrs[i]`, `kv_data_lens[i]`, `kv_item_lens[i]`). Every buffer holds the same number
/// of pages.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_camel_case_types)]
pub struct kvwire_buffer_t {
    /// The buffer's first byte.
    pub ptr: *mut c_void,
    /// Its length in bytes (a whole number of pages).
    pub len: usize,
    /// Bytes per page in this buffer.
    pub page_bytes: usize,
}

/// How a manager is set up. Fill it with kvwire_config_init, then set the fields. Fields
/// are only ever appended in later versions.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_camel_case_types)]
pub struct kvwire_config_t {
    /// KVWIRE_ROLE_PREFILL or KVWIRE_ROLE_DECODE.
    pub role: c_int,
    /// Tokens per page (the same on both engines).
    pub tokens_per_page: u32,
    /// The context length the engine serves; the registered pool must hold it.
    pub max_context_tokens: u64,
    /// The model / tensor-parallel fingerprint (NUL-terminated); both engines must match.
    /// NULL: empty.
    pub fingerprint: *const c_char,
    /// The pre-shared key as hex text (at least 32 hex digits; `kvwire gen-psk` writes
    /// one). NULL: the file named by KVWIRE_PSK_FILE, else KVWIRE_PSK, else an error.
    pub psk_hex: *const c_char,
    /// Non-zero: no authentication (any peer with the right layout can connect).
    pub insecure_no_auth: c_int,
    /// NULL: TCP. Otherwise RDMA on this device ("" for the first one); needs a library
    /// built with the `rdma` feature.
    pub rdma_device: *const c_char,
    /// This node's id as its peers see it; 0: a random one.
    pub node_id: u64,
    /// Worker threads of the manager's background runtime (default 2).
    pub worker_threads: u32,
    /// The bound of blocking calls (connect, listen, a chunk's hand-over), in ms (default
    /// 30000).
    pub call_timeout_ms: u32,
    /// How long release/clear wait for kvwire to give the pages back, in ms (default
    /// 60000).
    pub release_timeout_ms: u32,
}

/// Why a transfer failed (kvwire_receiver_failure, kvwire_sender_failure).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
#[allow(non_camel_case_types)]
pub struct kvwire_failure_t {
    /// A KVWIRE_ERR_* code; KVWIRE_OK if the transfer did not fail.
    pub code: c_int,
    /// Non-zero: the same request may be tried again (on a new connection if this one is
    /// gone).
    pub retryable: c_int,
    /// The protocol's wire error code that came with it (e.g. 0x0101
    /// PROMPT_EXCEEDS_CONTEXT for a rejection, 0x0401 CANCELLED for an abort); -1 if none.
    pub wire_code: i32,
    /// For KVWIRE_ERR_UNCONFIRMED: the code of what ended the wait; otherwise 0.
    pub cause: c_int,
}

const MANAGER_MAGIC: u64 = 0x6b76_7769_7265_4d47;
const RECEIVER_MAGIC: u64 = 0x6b76_7769_7265_5258;
const SENDER_MAGIC: u64 = 0x6b76_7769_7265_5458;

/// A manager: one engine's registered KV memory, its background runtime and connections.
#[allow(non_camel_case_types)]
pub struct kvwire_manager_t {
    magic: u64,
    manager: Manager,
}

/// The decode side of one request.
#[allow(non_camel_case_types)]
pub struct kvwire_receiver_t {
    magic: u64,
    transfer: kvwire::polled::ReceiverTransfer,
}

/// The prefill side of one request.
#[allow(non_camel_case_types)]
pub struct kvwire_sender_t {
    magic: u64,
    transfer: kvwire::polled::SenderTransfer,
}

trait Handle {
    const MAGIC: u64;
    const NAME: &'static str;
    fn magic(&self) -> u64;
}

macro_rules! handle {
    ($t:ty, $magic:expr, $name:expr) => {
        impl Handle for $t {
            const MAGIC: u64 = $magic;
            const NAME: &'static str = $name;
            fn magic(&self) -> u64 {
                self.magic
            }
        }
    };
}
handle!(kvwire_manager_t, MANAGER_MAGIC, "kvwire_manager_t");
handle!(kvwire_receiver_t, RECEIVER_MAGIC, "kvwire_receiver_t");
handle!(kvwire_sender_t, SENDER_MAGIC, "kvwire_sender_t");

// ---------------------------------------------------------------------------------------
// The boundary: errors, panics, pointers.

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Runs `f`, catching panics; the `int` the C caller gets.
fn guard(f: impl FnOnce() -> Result<(), Error>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => KVWIRE_OK,
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            e.code()
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_last_error(&format!("Internal: a panic inside kvwire: {what}"));
            KVWIRE_ERR_INTERNAL
        }
    }
}

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, message)
}

/// The handle behind `p`, checked for null and for its type.
///
/// # Safety
/// `p` is null or points to a handle made by this library and not freed.
unsafe fn handle<'a, T: Handle>(p: *const T) -> Result<&'a T, Error> {
    if p.is_null() {
        return Err(invalid(format!("null {} handle", T::NAME)));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("misaligned {} handle", T::NAME)));
    }
    // SAFETY: non-null and aligned; the caller promises it came from this library's `_new`
    // and was not freed (the magic check catches a handle of another type).
    let h = unsafe { &*p };
    if h.magic() != T::MAGIC {
        return Err(invalid(format!("not a live {} handle", T::NAME)));
    }
    Ok(h)
}

/// The `n` items at `p` (null is allowed only for `n == 0`).
///
/// # Safety
/// `p` is null or valid for reads of `n` items.
unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Error> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid(format!("{what}: null pointer with {n} items")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what}: misaligned pointer")));
    }
    // SAFETY: non-null, aligned, and the caller promises `n` readable items.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// The NUL-terminated UTF-8 string at `p`; `None` for null.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string.
unsafe fn string<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Error> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null; the caller promises a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|_| invalid(format!("{what}: not UTF-8")))
}

/// Writes `v` to `*out`, refusing a null `out`.
///
/// # Safety
/// `out` is null or valid for a write of a `T`.
unsafe fn put<T>(out: *mut T, v: T, what: &str) -> Result<(), Error> {
    if out.is_null() {
        return Err(invalid(format!("{what}: null output pointer")));
    }
    if !out.is_aligned() {
        return Err(invalid(format!("{what}: misaligned output pointer")));
    }
    // SAFETY: non-null, aligned, and the caller promises it is writable.
    unsafe { out.write(v) };
    Ok(())
}

/// Copies `items` into the caller's `out[0..cap]` and their count to `*len`;
/// `KVWIRE_ERR_BUFFER_TOO_SMALL` (with `*len` set) when they do not fit.
///
/// # Safety
/// `len` is valid for a write; `out` is null or valid for writes of `cap` items.
unsafe fn copy_out<T: Copy>(
    items: &[T],
    out: *mut T,
    cap: usize,
    len: *mut usize,
    what: &str,
) -> Result<(), Error> {
    // SAFETY: the caller's contract.
    unsafe { put(len, items.len(), what)? };
    if items.len() > cap {
        return Err(Error::new(
            ErrorKind::BufferTooSmall,
            format!("{what}: {} items, room for {cap}", items.len()),
        ));
    }
    if items.is_empty() {
        return Ok(());
    }
    if out.is_null() || !out.is_aligned() {
        return Err(invalid(format!("{what}: null or misaligned buffer")));
    }
    // SAFETY: `out` is non-null, aligned and (the caller promises) valid for `cap >=
    // items.len()` writes; it cannot overlap `items`, which kvwire owns.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    Ok(())
}

fn poll_code(p: KvPoll) -> c_int {
    p as u8 as c_int
}

fn millis(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

// ---------------------------------------------------------------------------------------
// Library.

/// The library's version, e.g. "0.1.0" (a static string).
#[no_mangle]
pub extern "C" fn kvwire_version() -> *const c_char {
    static VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => c"unknown",
        };
    VERSION.as_ptr()
}

/// The message of the last call that failed on this thread ("" if none). Valid until the
/// next failing kvwire call on this thread; copy it to keep it.
#[no_mangle]
pub extern "C" fn kvwire_last_error() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// The name of a KVWIRE_ERR_* code ("DigestMismatch", ...; "Ok" for 0, "Unknown" for a
/// code this library does not know), a static string.
#[no_mangle]
pub extern "C" fn kvwire_error_name(code: c_int) -> *const c_char {
    if code == KVWIRE_OK {
        return c"Ok".as_ptr();
    }
    static NAMES: std::sync::OnceLock<Vec<(i32, CString)>> = std::sync::OnceLock::new();
    let names = NAMES.get_or_init(|| {
        ErrorKind::ALL
            .iter()
            .map(|k| (k.code(), CString::new(k.name()).unwrap_or_default()))
            .collect()
    });
    names
        .iter()
        .find(|(c, _)| *c == code)
        .map_or(c"Unknown".as_ptr(), |(_, n)| n.as_ptr())
}

/// Fills `*config` with the defaults: TCP, no fingerprint, the key from the environment,
/// a random node id, 2 worker threads, 30 s call and 60 s release bounds. Role, tokens per
/// page and context length are left 0: set them.
///
/// # Safety
/// `config` is null or valid for a write of a kvwire_config_t.
#[no_mangle]
pub unsafe extern "C" fn kvwire_config_init(config: *mut kvwire_config_t) -> c_int {
    guard(|| {
        let c = kvwire_config_t {
            role: 0,
            tokens_per_page: 0,
            max_context_tokens: 0,
            fingerprint: std::ptr::null(),
            psk_hex: std::ptr::null(),
            insecure_no_auth: 0,
            rdma_device: std::ptr::null(),
            node_id: 0,
            worker_threads: 2,
            call_timeout_ms: 30_000,
            release_timeout_ms: 60_000,
        };
        // SAFETY: the caller's contract.
        unsafe { put(config, c, "config") }
    })
}

// ---------------------------------------------------------------------------------------
// Manager.

/// Reads a C configuration.
///
/// # Safety
/// The strings of `c` are null or NUL-terminated.
unsafe fn manager_config(c: &kvwire_config_t) -> Result<ManagerConfig, Error> {
    let role = match c.role {
        KVWIRE_ROLE_PREFILL => Role::Prefill,
        KVWIRE_ROLE_DECODE => Role::Decode,
        r => {
            return Err(invalid(format!(
                "role {r}: KVWIRE_ROLE_PREFILL or KVWIRE_ROLE_DECODE"
            )))
        }
    };
    // SAFETY: the caller's contract, for each string.
    let (psk, fingerprint, rdma) = unsafe {
        (
            string(c.psk_hex, "psk_hex")?,
            string(c.fingerprint, "fingerprint")?,
            string(c.rdma_device, "rdma_device")?,
        )
    };
    let auth = match (c.insecure_no_auth != 0, psk) {
        (true, _) => Auth::Off,
        (false, Some(hex)) => {
            Auth::Psk(Psk::from_hex(hex).map_err(|e| invalid(format!("psk_hex: {e}")))?)
        }
        (false, None) => {
            kvwire::config::auth::resolve(false, None)
                .map_err(|e| Error::new(ErrorKind::ConfigError, e.to_string()))?
                .0
        }
    };
    let mut config = ManagerConfig::new(role, c.tokens_per_page, c.max_context_tokens, auth)
        .fingerprint(fingerprint.unwrap_or_default());
    if let Some(dev) = rdma {
        config = config.transport(TransportConfig::rdma((!dev.is_empty()).then_some(dev)));
    }
    config.node_id = c.node_id;
    config.worker_threads = (c.worker_threads as usize).max(1);
    if c.call_timeout_ms > 0 {
        config.call_timeout = millis(c.call_timeout_ms.into());
    }
    if c.release_timeout_ms > 0 {
        config.release_timeout = millis(c.release_timeout_ms.into());
    }
    Ok(config)
}

/// Registers the engine's KV buffers (`buffers[0..n]`) and starts a manager; `*out` gets
/// the handle. Fails with KVWIRE_ERR_CONFIG when the pool (pages x tokens per page) cannot
/// hold max_context_tokens, naming both numbers.
///
/// # Safety
/// `config` and `out` are valid; `buffers` holds `n` entries. Each buffer must stay valid
/// for reads and writes of its length until kvwire_manager_free returned, and the buffers
/// must not overlap. The engine must not write (or reuse) a page while kvwire holds it:
/// from kvwire_receiver_init until kvwire_receiver_release returned, and a sender's pages
/// from kvwire_sender_send until kvwire_sender_clear returned.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_new(
    config: *const kvwire_config_t,
    buffers: *const kvwire_buffer_t,
    n: usize,
    out: *mut *mut kvwire_manager_t,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(invalid("out: null output pointer"));
        }
        if config.is_null() {
            return Err(invalid("config: null pointer"));
        }
        // SAFETY: non-null; the caller promises a valid kvwire_config_t.
        let c = unsafe { &*config };
        // SAFETY: the caller's contract for its strings.
        let config = unsafe { manager_config(c)? };
        // SAFETY: the caller promises `n` entries.
        let bufs = unsafe { slice(buffers, n, "buffers")? };
        let bufs: Vec<KvBuffer> = bufs
            .iter()
            .map(|b| KvBuffer {
                ptr: b.ptr.cast::<u8>(),
                len: b.len,
                page_bytes: b.page_bytes,
            })
            .collect();
        // SAFETY: the caller's contract is Manager::new's (documented above).
        let manager = unsafe { Manager::new(config, &bufs)? };
        let h = Box::into_raw(Box::new(kvwire_manager_t {
            magic: MANAGER_MAGIC,
            manager,
        }));
        // SAFETY: `out` was checked non-null; the caller promises it is writable.
        unsafe { put(out, h, "out") }
    })
}

/// Frees a manager: free its transfers first. Its connections close, and it returns once
/// nothing of kvwire runs any more, so the engine may free its buffers afterwards. (A
/// transfer still alive keeps the manager's runtime and connections, and its use of the
/// buffers, until that transfer is freed.) NULL is ignored.
///
/// # Safety
/// `manager` is null or a live handle, not used again after this call.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_free(manager: *mut kvwire_manager_t) {
    let _ = guard(|| {
        if manager.is_null() {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        unsafe { handle(manager)? };
        // SAFETY: checked live above; made by Box::into_raw in kvwire_manager_new; the
        // caller gives it up.
        let mut h = unsafe { Box::from_raw(manager) };
        h.magic = 0;
        drop(h);
        Ok(())
    });
}

/// Listens on `addr` ("host:port"; port 0 for any) and accepts peers in the background;
/// writes the address bound (NUL-terminated) into `bound[0..cap]` unless `bound` is NULL
/// (`cap` at least KVWIRE_ADDR_MAX).
///
/// # Safety
/// `manager` is a live handle, `addr` a NUL-terminated string, `bound` null or valid for
/// `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_listen(
    manager: *const kvwire_manager_t,
    addr: *const c_char,
    bound: *mut c_char,
    cap: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let (m, addr) = unsafe { (handle(manager)?, string(addr, "addr")?) };
        let addr = addr.ok_or_else(|| invalid("addr: null pointer"))?;
        // Checked before listening, so that a short buffer does not leave a listener whose
        // address the caller never learns (the longest socket address text is 47 bytes).
        if !bound.is_null() && cap < KVWIRE_ADDR_MAX {
            return Err(invalid(format!(
                "bound: {cap} bytes; KVWIRE_ADDR_MAX ({KVWIRE_ADDR_MAX}) needed"
            )));
        }
        let local = m.manager.listen(addr)?.to_string();
        if bound.is_null() {
            return Ok(());
        }
        let mut bytes = local.into_bytes();
        bytes.push(0);
        let mut len = 0;
        // SAFETY: `bound` is valid for `cap` bytes (the caller's contract); `len` is ours.
        unsafe { copy_out(&bytes, bound.cast::<u8>(), cap, &mut len, "bound") }
    })
}

/// Connects to the peer listening at `addr` ("host:port") and runs the handshake;
/// `*peer` (unless NULL) gets the peer's node id. Blocks until connected or failed.
///
/// # Safety
/// `manager` is a live handle, `addr` a NUL-terminated string, `peer` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_connect(
    manager: *const kvwire_manager_t,
    addr: *const c_char,
    peer: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let (m, addr) = unsafe { (handle(manager)?, string(addr, "addr")?) };
        let addr = addr.ok_or_else(|| invalid("addr: null pointer"))?;
        let id = m.manager.connect(addr)?;
        if !peer.is_null() {
            // SAFETY: non-null; the caller promises it is writable.
            unsafe { put(peer, id, "peer")? };
        }
        Ok(())
    })
}

/// Waits until at least `n` peers are connected, at most `timeout_ms`
/// (KVWIRE_ERR_WAIT_TIMED_OUT otherwise, naming the last incoming failure).
///
/// # Safety
/// `manager` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_wait_peers(
    manager: *const kvwire_manager_t,
    n: usize,
    timeout_ms: u64,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let m = unsafe { handle(manager)? };
        m.manager.wait_for_peers(n, millis(timeout_ms)).map(|_| ())
    })
}

/// This node's id, as its peers see it.
///
/// # Safety
/// `manager` is a live handle, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_node_id(
    manager: *const kvwire_manager_t,
    out: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe {
            let m = handle(manager)?;
            put(out, m.manager.node_id(), "out")
        }
    })
}

/// Whether the engine may free (reuse) `pages[0..n]`: KVWIRE_OK if kvwire holds none of
/// them, KVWIRE_ERR_INVALID_STATE naming the first held page and its holder otherwise.
///
/// # Safety
/// `manager` is a live handle, `pages` holds `n` entries.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_check_free(
    manager: *const kvwire_manager_t,
    pages: *const u32,
    n: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let (m, pages) = unsafe { (handle(manager)?, slice(pages, n, "pages")?) };
        m.manager
            .node()
            .pool()
            .check_engine_free(pages)
            .map_err(|e| Error::new(ErrorKind::InvalidState, e.to_string()))
    })
}

// ---------------------------------------------------------------------------------------
// Receiver.

/// The decode side of request `room` from peer `peer` (a node id; 0: the only peer).
///
/// # Safety
/// `manager` is a live handle, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_new(
    manager: *const kvwire_manager_t,
    room: u64,
    peer: u64,
    out: *mut *mut kvwire_receiver_t,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(invalid("out: null output pointer"));
        }
        // SAFETY: the caller's contract.
        let m = unsafe { handle(manager)? };
        let transfer = m
            .manager
            .receiver(TransferId(room), (peer != 0).then_some(peer))?;
        let h = Box::into_raw(Box::new(kvwire_receiver_t {
            magic: RECEIVER_MAGIC,
            transfer,
        }));
        // SAFETY: checked non-null; the caller promises it is writable.
        unsafe { put(out, h, "out") }
    })
}

/// Reserves the engine's destination pages `pages[0..n]` (one per tokens_per_page
/// tokens, in transfer order) for `tokens` tokens; the sender must commit within
/// `timeout_ms`. kvwire holds the pages until kvwire_receiver_release returned.
///
/// # Safety
/// `receiver` is a live handle, `pages` holds `n` entries.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_init(
    receiver: *const kvwire_receiver_t,
    pages: *const u32,
    n: usize,
    tokens: u32,
    timeout_ms: u64,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let (r, pages) = unsafe { (handle(receiver)?, slice(pages, n, "pages")?) };
        r.transfer.init(pages.to_vec(), tokens, millis(timeout_ms))
    })
}

/// The state (a KVWIRE_POLL_* value) into `*state`, at once; never blocks.
///
/// # Safety
/// `receiver` is a live handle, `state` writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_poll(
    receiver: *const kvwire_receiver_t,
    state: *mut c_int,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe {
            let r = handle(receiver)?;
            put(state, poll_code(r.transfer.poll()), "state")
        }
    })
}

/// Blocks until the transfer ended (KVWIRE_POLL_SUCCESS or KVWIRE_POLL_FAILED) or
/// `timeout_ms` passed; `*state` gets the state then.
///
/// # Safety
/// `receiver` is a live handle, `state` writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_wait(
    receiver: *const kvwire_receiver_t,
    timeout_ms: u64,
    state: *mut c_int,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let r = unsafe { handle(receiver)? };
        let s = r.transfer.wait(millis(timeout_ms));
        // SAFETY: the caller's contract.
        unsafe { put(state, poll_code(s), "state") }
    })
}

/// Writes why the transfer failed.
///
/// # Safety
/// `out` null or writable; `message` null or valid for `cap` bytes.
unsafe fn failure_out(
    e: Option<Error>,
    out: *mut kvwire_failure_t,
    message: *mut c_char,
    cap: usize,
) -> Result<(), Error> {
    let f = match &e {
        None => kvwire_failure_t {
            wire_code: -1,
            ..Default::default()
        },
        Some(e) => kvwire_failure_t {
            code: e.code(),
            retryable: e.is_retryable().into(),
            wire_code: e.wire_code().map_or(-1, |c| c.0.into()),
            cause: e.cause().map_or(0, ErrorKind::code),
        },
    };
    if !out.is_null() {
        // SAFETY: non-null; the caller promises it is writable.
        unsafe { put(out, f, "failure")? };
    }
    if !message.is_null() && cap > 0 {
        let text = e.map(|e| e.to_string()).unwrap_or_default();
        let bytes = text.as_bytes();
        // Truncated to fit, on a character boundary, always NUL-terminated.
        let mut n = bytes.len().min(cap - 1);
        while !text.is_char_boundary(n) {
            n -= 1;
        }
        // SAFETY: `message` is valid for `cap > n` bytes (the caller's contract) and does
        // not overlap `text`, which is ours.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), message.cast::<u8>(), n);
            message.add(n).write(0);
        }
    }
    Ok(())
}

/// Why the transfer failed: `*failure` (unless NULL) gets the code (KVWIRE_OK if it did
/// not fail), whether it is retryable and the wire code; `message[0..cap]` (unless NULL)
/// the message, truncated and NUL-terminated.
///
/// # Safety
/// `receiver` is a live handle; `failure` null or writable; `message` null or valid for
/// `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_failure(
    receiver: *const kvwire_receiver_t,
    failure: *mut kvwire_failure_t,
    message: *mut c_char,
    cap: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe {
            let r = handle(receiver)?;
            failure_out(r.transfer.failure(), failure, message, cap)
        }
    })
}

/// Aborts the transfer: it fails at once with KVWIRE_ERR_ABORTED; kvwire fences the
/// reservation and tells the sender. Nothing happens to a transfer that already ended.
///
/// # Safety
/// `receiver` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_abort(receiver: *const kvwire_receiver_t) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let r = unsafe { handle(receiver)? };
        r.transfer.abort();
        Ok(())
    })
}

/// After KVWIRE_POLL_SUCCESS: the destination pages that hold the verified KV, in
/// transfer order, into `out[0..cap]`; `*len` gets their count.
///
/// # Safety
/// `receiver` is a live handle; `out` null or valid for `cap` entries; `len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_page_indices(
    receiver: *const kvwire_receiver_t,
    out: *mut u32,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let r = unsafe { handle(receiver)? };
        let pages = r.transfer.page_indices()?;
        // SAFETY: the caller's contract.
        unsafe { copy_out(&pages, out, cap, len, "page indices") }
    })
}

/// After KVWIRE_POLL_SUCCESS: the verified aux record (e.g. the first output token) into
/// `out[0..cap]` (the engine's aux buffer); `*len` gets its length (0 if none was sent).
///
/// # Safety
/// `receiver` is a live handle; `out` null or valid for `cap` bytes; `len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_aux(
    receiver: *const kvwire_receiver_t,
    out: *mut u8,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let r = unsafe { handle(receiver)? };
        let aux = r.transfer.aux()?;
        // SAFETY: the caller's contract.
        unsafe { copy_out(&aux, out, cap, len, "aux") }
    })
}

/// Gives the pages back to the engine: returns only once kvwire holds none of them (a
/// transfer still open is aborted first). Afterwards the engine may write and reuse them.
///
/// # Safety
/// `receiver` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_release(receiver: *const kvwire_receiver_t) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let r = unsafe { handle(receiver)? };
        r.transfer.release()
    })
}

/// Frees a receiver (aborting it if still open; call kvwire_receiver_release first to
/// know when the pages are free). NULL is ignored.
///
/// # Safety
/// `receiver` is null or a live handle, not used again after this call.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_free(receiver: *mut kvwire_receiver_t) {
    let _ = guard(|| {
        if receiver.is_null() {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        unsafe { handle(receiver)? };
        // SAFETY: checked live; made by Box::into_raw in kvwire_receiver_new; given up.
        let mut h = unsafe { Box::from_raw(receiver) };
        h.magic = 0;
        drop(h);
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------
// Sender.

/// The prefill side of request `room` to peer `peer` (a node id; 0: the only peer).
///
/// # Safety
/// `manager` is a live handle, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_sender_new(
    manager: *const kvwire_manager_t,
    room: u64,
    peer: u64,
    out: *mut *mut kvwire_sender_t,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(invalid("out: null output pointer"));
        }
        // SAFETY: the caller's contract.
        let m = unsafe { handle(manager)? };
        let transfer = m
            .manager
            .sender(TransferId(room), (peer != 0).then_some(peer))?;
        let h = Box::into_raw(Box::new(kvwire_sender_t {
            magic: SENDER_MAGIC,
            transfer,
        }));
        // SAFETY: checked non-null; the caller promises it is writable.
        unsafe { put(out, h, "out") }
    })
}

/// Admits and opens the request: `tokens` tokens in `num_pages` pages. A request admission
/// rejects fails the transfer with KVWIRE_ERR_REJECTED and the original wire code (see
/// kvwire_sender_failure); the decode side gets the same.
///
/// # Safety
/// `sender` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvwire_sender_init(
    sender: *const kvwire_sender_t,
    num_pages: u32,
    tokens: u32,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { handle(sender)? };
        s.transfer.init(num_pages, tokens)
    })
}

/// Hands over the next chunk: the engine's pages `pages[0..n]`, in transfer order, read in
/// place (not written by the engine until kvwire_sender_clear returned); `aux[0..aux_len]`
/// (NULL: none) goes with the final chunk only. Returns once the connection took the chunk.
///
/// # Safety
/// `sender` is a live handle; `pages` holds `n` entries; `aux` null or `aux_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvwire_sender_send(
    sender: *const kvwire_sender_t,
    pages: *const u32,
    n: usize,
    aux: *const u8,
    aux_len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let (s, pages) = unsafe { (handle(sender)?, slice(pages, n, "pages")?) };
        let aux = if aux.is_null() {
            if aux_len > 0 {
                return Err(invalid("aux: null pointer with a length"));
            }
            None
        } else {
            // SAFETY: non-null; the caller promises `aux_len` readable bytes.
            Some(unsafe { slice(aux, aux_len, "aux")? })
        };
        s.transfer.send(pages, aux)
    })
}

/// The state (a KVWIRE_POLL_* value) into `*state`, at once; never blocks.
///
/// # Safety
/// `sender` is a live handle, `state` writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_sender_poll(
    sender: *const kvwire_sender_t,
    state: *mut c_int,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe {
            let s = handle(sender)?;
            put(state, poll_code(s.transfer.poll()), "state")
        }
    })
}

/// Blocks until the transfer ended or `timeout_ms` passed; `*state` gets the state then.
///
/// # Safety
/// `sender` is a live handle, `state` writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_sender_wait(
    sender: *const kvwire_sender_t,
    timeout_ms: u64,
    state: *mut c_int,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { handle(sender)? };
        let p = s.transfer.wait(millis(timeout_ms));
        // SAFETY: the caller's contract.
        unsafe { put(state, poll_code(p), "state") }
    })
}

/// Why the transfer failed (as kvwire_receiver_failure).
///
/// # Safety
/// `sender` is a live handle; `failure` null or writable; `message` null or valid for
/// `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvwire_sender_failure(
    sender: *const kvwire_sender_t,
    failure: *mut kvwire_failure_t,
    message: *mut c_char,
    cap: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe {
            let s = handle(sender)?;
            failure_out(s.transfer.failure(), failure, message, cap)
        }
    })
}

/// Aborts the transfer: it fails at once with KVWIRE_ERR_ABORTED; kvwire stops posting,
/// drains and tells the receiver. Nothing happens to a transfer that already ended.
///
/// # Safety
/// `sender` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvwire_sender_abort(sender: *const kvwire_sender_t) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { handle(sender)? };
        s.transfer.abort();
        Ok(())
    })
}

/// Ends the request here (aborting it if still open); returns once kvwire reads none of
/// its pages any more, so the engine may write and reuse them.
///
/// # Safety
/// `sender` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvwire_sender_clear(sender: *const kvwire_sender_t) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { handle(sender)? };
        s.transfer.clear()
    })
}

/// Frees a sender (aborting it if still open). NULL is ignored.
///
/// # Safety
/// `sender` is null or a live handle, not used again after this call.
#[no_mangle]
pub unsafe extern "C" fn kvwire_sender_free(sender: *mut kvwire_sender_t) {
    let _ = guard(|| {
        if sender.is_null() {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        unsafe { handle(sender)? };
        // SAFETY: checked live; made by Box::into_raw in kvwire_sender_new; given up.
        let mut h = unsafe { Box::from_raw(sender) };
        h.magic = 0;
        drop(h);
        Ok(())
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_c_codes_are_the_facades() {
        let c = [
            (KVWIRE_ERR_INVALID_ARGUMENT, ErrorKind::InvalidArgument),
            (KVWIRE_ERR_INVALID_STATE, ErrorKind::InvalidState),
            (KVWIRE_ERR_BUFFER_TOO_SMALL, ErrorKind::BufferTooSmall),
            (KVWIRE_ERR_CONFIG, ErrorKind::ConfigError),
            (KVWIRE_ERR_CONNECT_FAILED, ErrorKind::ConnectFailed),
            (KVWIRE_ERR_HANDSHAKE_REFUSED, ErrorKind::HandshakeRefused),
            (KVWIRE_ERR_UNAUTHENTICATED, ErrorKind::Unauthenticated),
            (KVWIRE_ERR_WAIT_TIMED_OUT, ErrorKind::WaitTimedOut),
            (KVWIRE_ERR_INTERNAL, ErrorKind::Internal),
            (KVWIRE_ERR_REJECTED, ErrorKind::Rejected),
            (
                KVWIRE_ERR_RESERVATION_REFUSED,
                ErrorKind::ReservationRefused,
            ),
            (KVWIRE_ERR_COUNT_MISMATCH, ErrorKind::CountMismatch),
            (KVWIRE_ERR_DIGEST_MISMATCH, ErrorKind::DigestMismatch),
            (KVWIRE_ERR_AUX_MISMATCH, ErrorKind::AuxMismatch),
            (KVWIRE_ERR_PAGES_MISSING, ErrorKind::PagesMissing),
            (KVWIRE_ERR_AUX_TOO_LARGE, ErrorKind::AuxTooLarge),
            (KVWIRE_ERR_MISSING_DIGEST, ErrorKind::MissingDigest),
            (KVWIRE_ERR_STALE_NONCE, ErrorKind::StaleNonce),
            (KVWIRE_ERR_TIMEOUT, ErrorKind::Timeout),
            (KVWIRE_ERR_PEER_ABORTED, ErrorKind::PeerAborted),
            (KVWIRE_ERR_ABORTED, ErrorKind::Aborted),
            (KVWIRE_ERR_NACKED, ErrorKind::Nacked),
            (KVWIRE_ERR_WRITE_FAILED, ErrorKind::WriteFailed),
            (KVWIRE_ERR_PEER_LOST, ErrorKind::PeerLost),
            (KVWIRE_ERR_PEER_UNRESPONSIVE, ErrorKind::PeerUnresponsive),
            (KVWIRE_ERR_UNCONFIRMED, ErrorKind::Unconfirmed),
            (KVWIRE_ERR_PROTOCOL_VIOLATION, ErrorKind::ProtocolViolation),
            (KVWIRE_ERR_RESERVATION_FAILED, ErrorKind::ReservationFailed),
            (KVWIRE_ERR_INVALID_REQUEST, ErrorKind::InvalidRequest),
            (KVWIRE_ERR_TRANSFER_FAILED, ErrorKind::TransferFailed),
            (KVWIRE_ERR_DISCOVERY, ErrorKind::DiscoveryError),
            (KVWIRE_ERR_LAYOUT_MISMATCH, ErrorKind::LayoutMismatch),
        ];
        for (code, kind) in c {
            assert_eq!(code, kind.code(), "{kind}");
        }
        assert_eq!(
            c.len(),
            ErrorKind::ALL.len(),
            "a kind without a KVWIRE_ERR_ constant"
        );
        for (code, p) in [
            (KVWIRE_POLL_FAILED, KvPoll::Failed),
            (KVWIRE_POLL_BOOTSTRAPPING, KvPoll::Bootstrapping),
            (KVWIRE_POLL_WAITING_FOR_INPUT, KvPoll::WaitingForInput),
            (KVWIRE_POLL_TRANSFERRING, KvPoll::Transferring),
            (KVWIRE_POLL_SUCCESS, KvPoll::Success),
        ] {
            assert_eq!(code, poll_code(p));
        }
    }

    fn last_error() -> String {
        // SAFETY: kvwire_last_error returns a NUL-terminated string of this thread.
        unsafe { CStr::from_ptr(kvwire_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn null_and_foreign_pointers_get_an_error_code() {
        let mut state = 0;
        // SAFETY: every pointer is null or valid; the functions must refuse the nulls.
        unsafe {
            assert_eq!(
                kvwire_receiver_poll(std::ptr::null(), &mut state),
                KVWIRE_ERR_INVALID_ARGUMENT
            );
            assert!(
                last_error().contains("null kvwire_receiver_t"),
                "{}",
                last_error()
            );
            assert_eq!(
                kvwire_manager_new(std::ptr::null(), std::ptr::null(), 0, std::ptr::null_mut()),
                KVWIRE_ERR_INVALID_ARGUMENT
            );
            let mut config = std::mem::MaybeUninit::<kvwire_config_t>::uninit();
            assert_eq!(kvwire_config_init(config.as_mut_ptr()), KVWIRE_OK);
            let mut config = config.assume_init();
            config.role = KVWIRE_ROLE_DECODE;
            config.tokens_per_page = 16;
            config.max_context_tokens = 64;
            config.insecure_no_auth = 1;
            let mut m = std::ptr::null_mut();
            // No buffers.
            assert_eq!(
                kvwire_manager_new(&config, std::ptr::null(), 0, &mut m),
                KVWIRE_ERR_INVALID_ARGUMENT
            );
            // Buffers too small for the context: refused naming both numbers.
            let mem: &'static mut [u8] = Box::leak(vec![0u8; 2 * 4096].into_boxed_slice());
            let buf = kvwire_buffer_t {
                ptr: mem.as_mut_ptr().cast(),
                len: mem.len(),
                page_bytes: 4096,
            };
            assert_eq!(
                kvwire_manager_new(&config, &buf, 1, &mut m),
                KVWIRE_ERR_CONFIG
            );
            assert!(last_error().contains("64"), "{}", last_error());
            config.max_context_tokens = 32;
            assert_eq!(kvwire_manager_new(&config, &buf, 1, &mut m), KVWIRE_OK);
            // A buffer too short for the address is refused before listening.
            let mut short = [0 as c_char; 8];
            assert_eq!(
                kvwire_manager_listen(m, c"127.0.0.1:0".as_ptr(), short.as_mut_ptr(), 8),
                KVWIRE_ERR_INVALID_ARGUMENT
            );
            let mut node = 0;
            assert_eq!(kvwire_manager_node_id(m, &mut node), KVWIRE_OK);
            assert_ne!(node, 0);
            // A manager handle passed as a receiver is refused.
            assert_eq!(
                kvwire_receiver_poll(m.cast::<kvwire_receiver_t>(), &mut state),
                KVWIRE_ERR_INVALID_ARGUMENT
            );
            let mut r = std::ptr::null_mut();
            assert_eq!(kvwire_receiver_new(m, 1, 0, &mut r), KVWIRE_OK);
            assert_eq!(
                kvwire_receiver_poll(r, std::ptr::null_mut()),
                KVWIRE_ERR_INVALID_ARGUMENT
            );
            assert_eq!(kvwire_receiver_poll(r, &mut state), KVWIRE_OK);
            assert_eq!(state, KVWIRE_POLL_BOOTSTRAPPING);
            // Pages: null with a count, or a count that does not fit the tokens.
            assert_eq!(
                kvwire_receiver_init(r, std::ptr::null(), 2, 32, 1000),
                KVWIRE_ERR_INVALID_ARGUMENT
            );
            let pages = [1u32, 0];
            assert_eq!(
                kvwire_receiver_init(r, pages.as_ptr(), 1, 32, 1000),
                KVWIRE_ERR_INVALID_ARGUMENT
            );
            let mut len = 0;
            assert_eq!(
                kvwire_receiver_page_indices(r, std::ptr::null_mut(), 0, &mut len),
                KVWIRE_ERR_INVALID_STATE
            );
            let mut f = kvwire_failure_t::default();
            let mut msg = [0 as c_char; 8];
            assert_eq!(kvwire_receiver_abort(r), KVWIRE_OK);
            assert_eq!(
                kvwire_receiver_failure(r, &mut f, msg.as_mut_ptr(), msg.len()),
                KVWIRE_OK
            );
            assert_eq!(f.code, KVWIRE_ERR_ABORTED);
            assert_eq!(f.wire_code, 0x0401);
            assert_eq!(CStr::from_ptr(msg.as_ptr()).to_bytes(), b"Aborted");
            assert_eq!(kvwire_receiver_release(r), KVWIRE_OK);
            kvwire_receiver_free(r);
            kvwire_receiver_free(std::ptr::null_mut());
            let mut s = std::ptr::null_mut();
            assert_eq!(
                kvwire_sender_new(m, 1, 0, &mut s),
                KVWIRE_ERR_INVALID_ARGUMENT
            );
            assert!(last_error().contains("no senders"), "{}", last_error());
            kvwire_manager_free(m);
            let name = CStr::from_ptr(kvwire_error_name(KVWIRE_ERR_DIGEST_MISMATCH));
            assert_eq!(name.to_bytes(), b"DigestMismatch");
        }
    }

    /// A manager over a fresh leaked cache of 64 pages x 2 buffers of 4 KiB.
    ///
    /// # Safety
    /// `psk` is a NUL-terminated string.
    unsafe fn manager(role: c_int, context: u64, psk: *const c_char) -> *mut kvwire_manager_t {
        let bufs: Vec<kvwire_buffer_t> = (0..2)
            .map(|_| {
                let mem: &'static mut [u8] = Box::leak(vec![0u8; 64 * 4096].into_boxed_slice());
                kvwire_buffer_t {
                    ptr: mem.as_mut_ptr().cast(),
                    len: mem.len(),
                    page_bytes: 4096,
                }
            })
            .collect();
        let mut c = std::mem::MaybeUninit::<kvwire_config_t>::uninit();
        // SAFETY: every pointer is valid; the buffers are leaked (live for the process).
        unsafe {
            assert_eq!(kvwire_config_init(c.as_mut_ptr()), KVWIRE_OK);
            let mut c = c.assume_init();
            c.role = role;
            c.tokens_per_page = 16;
            c.max_context_tokens = context;
            c.psk_hex = psk;
            let mut m = std::ptr::null_mut();
            assert_eq!(
                kvwire_manager_new(&c, bufs.as_ptr(), 2, &mut m),
                KVWIRE_OK,
                "{}",
                last_error()
            );
            m
        }
    }

    #[test]
    fn a_rejection_reaches_both_c_callers_with_the_original_wire_code() {
        let psk = CString::new(kvwire::config::auth::generate_hex().unwrap()).unwrap();
        // SAFETY: every pointer is valid or a live handle of this test.
        unsafe {
            let decode = manager(KVWIRE_ROLE_DECODE, 1024, psk.as_ptr());
            let prefill = manager(KVWIRE_ROLE_PREFILL, 512, psk.as_ptr());
            let mut bound = [0 as c_char; KVWIRE_ADDR_MAX];
            assert_eq!(
                kvwire_manager_listen(
                    decode,
                    c"127.0.0.1:0".as_ptr(),
                    bound.as_mut_ptr(),
                    bound.len()
                ),
                KVWIRE_OK
            );
            let mut peer = 0;
            assert_eq!(
                kvwire_manager_connect(prefill, bound.as_ptr(), &mut peer),
                KVWIRE_OK
            );
            let mut decode_id = 0;
            assert_eq!(kvwire_manager_node_id(decode, &mut decode_id), KVWIRE_OK);
            assert_eq!(peer, decode_id);
            assert_eq!(kvwire_manager_wait_peers(decode, 1, 10_000), KVWIRE_OK);
            // 600 tokens: more than the prefill's 512-token context.
            let pages: Vec<u32> = (0..38).collect();
            let mut r = std::ptr::null_mut();
            assert_eq!(kvwire_receiver_new(decode, 9, 0, &mut r), KVWIRE_OK);
            assert_eq!(
                kvwire_receiver_init(r, pages.as_ptr(), pages.len(), 600, 10_000),
                KVWIRE_OK
            );
            let mut s = std::ptr::null_mut();
            assert_eq!(kvwire_sender_new(prefill, 9, 0, &mut s), KVWIRE_OK);
            assert_eq!(kvwire_sender_init(s, 38, 600), KVWIRE_OK);
            let mut state = -1;
            assert_eq!(kvwire_sender_poll(s, &mut state), KVWIRE_OK);
            assert_eq!(state, KVWIRE_POLL_FAILED);
            assert_eq!(
                kvwire_sender_send(s, pages.as_ptr(), 1, std::ptr::null(), 0),
                KVWIRE_ERR_REJECTED
            );
            let mut f = kvwire_failure_t::default();
            assert_eq!(
                kvwire_sender_failure(s, &mut f, std::ptr::null_mut(), 0),
                KVWIRE_OK
            );
            assert_eq!(
                (f.code, f.wire_code, f.retryable),
                (KVWIRE_ERR_REJECTED, 0x0101, 0)
            );
            assert_eq!(kvwire_receiver_wait(r, 10_000, &mut state), KVWIRE_OK);
            assert_eq!(state, KVWIRE_POLL_FAILED);
            let mut msg = [0 as c_char; 256];
            assert_eq!(
                kvwire_receiver_failure(r, &mut f, msg.as_mut_ptr(), msg.len()),
                KVWIRE_OK
            );
            assert_eq!(
                (f.code, f.wire_code, f.retryable),
                (KVWIRE_ERR_REJECTED, 0x0101, 0)
            );
            let msg = CStr::from_ptr(msg.as_ptr()).to_string_lossy();
            assert!(msg.contains("PROMPT_EXCEEDS_CONTEXT"), "{msg}");
            let mut len = 0;
            assert_eq!(
                kvwire_receiver_aux(r, std::ptr::null_mut(), 0, &mut len),
                KVWIRE_ERR_INVALID_STATE
            );
            assert_eq!(kvwire_receiver_release(r), KVWIRE_OK);
            assert_eq!(
                kvwire_manager_check_free(decode, pages.as_ptr(), pages.len()),
                KVWIRE_OK
            );
            assert_eq!(kvwire_sender_clear(s), KVWIRE_OK);
            kvwire_receiver_free(r);
            kvwire_sender_free(s);
            kvwire_manager_free(prefill);
            kvwire_manager_free(decode);
        }
    }
}
