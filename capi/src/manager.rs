//! The manager: a background runtime and the engine's registered KV buffers, listening
//! or connecting, its peers.

use std::ffi::{c_char, c_int};

use kvwire::polled::{AuxBuffer, Error, ErrorKind, KvBuffer, Manager, ManagerConfig, Role};
use kvwire::{Auth, TransportConfig};

use crate::*;

/// Copies the caller's configuration: its first `size` bytes over the defaults, so a field
/// beyond the caller's struct (a program built against an older header) keeps its default.
///
/// # Safety
/// `config` is non-null and valid for reads of `config->size` bytes (its first field).
pub(crate) unsafe fn read_config(config: *const kvwire_config_t) -> Result<kvwire_config_t, Error> {
    if !config.is_aligned() {
        return Err(invalid("config: misaligned pointer"));
    }
    // SAFETY: aligned and readable: `size` is the first field of every version.
    let size = unsafe { std::ptr::addr_of!((*config).size).read() };
    if size < CONFIG_MIN_SIZE {
        return Err(invalid(format!(
            "config size {size}: fill the config with kvwire_config_init (a kvwire_config_t is at least {CONFIG_MIN_SIZE} bytes)"
        )));
    }
    let mut c = kvwire_config_t::defaults();
    let n = size.min(std::mem::size_of::<kvwire_config_t>());
    // SAFETY: the caller's `size` readable bytes, at most the size of `c`; no overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(
            config.cast::<u8>(),
            std::ptr::from_mut(&mut c).cast::<u8>(),
            n,
        );
    }
    Ok(c)
}

/// Reads a C configuration.
///
/// # Safety
/// The strings of `c` are null or NUL-terminated.
pub(crate) unsafe fn manager_config(c: &kvwire_config_t) -> Result<ManagerConfig, Error> {
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
        (false, Some(hex)) => Auth::psk_hex(hex).map_err(|e| invalid(format!("psk_hex: {e}")))?,
        (false, None) => {
            kvwire::config::auth::resolve(false, None)
                .map_err(|e| Error::new(ErrorKind::ConfigError, e.to_string()))?
                .0
        }
    };
    let mut config = ManagerConfig::new(role, c.tokens_per_page, c.max_context_tokens, auth)
        .fingerprint(fingerprint.unwrap_or_default());
    if let Some(dev) = rdma {
        let ack_timeout = match c.rdma_ack_timeout {
            0 => kvwire::config::DEFAULT_ACK_TIMEOUT,
            // 32 to 255 is refused when the manager starts, naming the value.
            n => u8::try_from(n).map_err(|_| {
                Error::new(
                    ErrorKind::ConfigError,
                    format!("rdma_ack_timeout = {n}: the exponent is 1 to 31 (0: the default)"),
                )
            })?,
        };
        // 147 to 65535 is refused when the manager starts, naming the value.
        let queue_pairs = u16::try_from(c.rdma_queue_pairs.max(1)).map_err(|_| {
            let n = c.rdma_queue_pairs;
            Error::new(
                ErrorKind::ConfigError,
                format!(
                    "rdma_queue_pairs = {n}: 1 to {} per connection",
                    kvwire::config::MAX_QUEUE_PAIRS
                ),
            )
        })?;
        // One device, or several comma-separated: one rail each, at least one queue pair
        // per rail.
        config = config.transport(
            TransportConfig::rdma_devices(dev, queue_pairs)
                .busy_poll(c.rdma_busy_poll != 0)
                .ack_timeout(ack_timeout)
                .stripe_pages(c.rdma_stripe_pages)
                .rail_affinity(c.rdma_rail_affinity != 0),
        );
    }
    config.node_id = c.node_id;
    config.worker_threads = (c.worker_threads as usize).max(1);
    if c.call_timeout_ms > 0 {
        config.call_timeout = millis(c.call_timeout_ms.into());
    }
    if c.release_timeout_ms > 0 {
        config.release_timeout = millis(c.release_timeout_ms.into());
    }
    // Out of range (above 64) is refused when the manager starts, naming the value.
    config.tcp_streams = u16::try_from(c.tcp_streams.max(1)).unwrap_or(u16::MAX);
    config.same_host = match c.same_host {
        crate::codes::KVWIRE_SAME_HOST_AUTO => kvwire::SameHost::Auto,
        crate::codes::KVWIRE_SAME_HOST_OFF => kvwire::SameHost::Off,
        crate::codes::KVWIRE_SAME_HOST_REQUIRE => kvwire::SameHost::Require,
        other => {
            return Err(invalid(format!(
                "same_host = {other}: KVWIRE_SAME_HOST_AUTO, _OFF or _REQUIRE"
            )))
        }
    };
    config.pull_threads = c.pull_threads as usize;
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
    // SAFETY: the caller's contract, with no aux buffers.
    unsafe { kvwire_manager_new_with_aux(config, buffers, n, std::ptr::null(), 0, out) }
}

/// As kvwire_manager_new, with the engine's aux buffers (`aux[0..n_aux]`): a sender's
/// final chunk can carry the record at an aux index (kvwire_sender_init_aux), and a
/// receiver writes the verified record at its aux index (kvwire_receiver_init_aux).
///
/// # Safety
/// As kvwire_manager_new, for the aux buffers too (`aux` holds `n_aux` entries, each valid
/// for reads and writes of its length until kvwire_manager_free returned, overlapping no
/// other buffer).
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_new_with_aux(
    config: *const kvwire_config_t,
    buffers: *const kvwire_buffer_t,
    n: usize,
    aux: *const kvwire_aux_buffer_t,
    n_aux: usize,
    out: *mut *mut kvwire_manager_t,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(invalid("out: null output pointer"));
        }
        if config.is_null() {
            return Err(invalid("config: null pointer"));
        }
        // SAFETY: non-null; the caller promises a kvwire_config_t filled by
        // kvwire_config_init, whose `size` (the first field, in every version) says how
        // many bytes of it there are.
        let c = unsafe { read_config(config)? };
        let c = &c;
        // SAFETY: the caller's contract for its strings.
        let config = unsafe { manager_config(c)? };
        // SAFETY: the caller promises `n` and `n_aux` entries.
        let (bufs, aux) = unsafe { (slice(buffers, n, "buffers")?, slice(aux, n_aux, "aux")?) };
        let bufs: Vec<KvBuffer> = bufs
            .iter()
            .map(|b| KvBuffer {
                ptr: b.ptr.cast::<u8>(),
                len: b.len,
                page_bytes: b.page_bytes,
            })
            .collect();
        let aux: Vec<AuxBuffer> = aux
            .iter()
            .map(|b| AuxBuffer {
                ptr: b.ptr.cast::<u8>(),
                len: b.len,
                item_len: b.item_len,
            })
            .collect();
        // SAFETY: the caller's contract is Manager::with_aux's (documented above).
        let manager = unsafe { Manager::with_aux(config, &bufs, &aux)? };
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

/// Stops kvwire on this node for good and returns once nothing of kvwire touches the
/// registered memory any more: the engine may then free every buffer it registered, even
/// with transfers still alive (they report KVWIRE_POLL_FAILED, KVWIRE_ERR_INVALID_STATE,
/// and their release / clear return at once). Discovery records are removed, connections
/// closed (peers fail their side, retryable), the background runtime stopped.
/// KVWIRE_ERR_WAIT_TIMED_OUT if that took longer than `timeout_ms`: the memory must stay
/// valid then; call it again to wait more. The handle stays valid until
/// kvwire_manager_free.
///
/// # Safety
/// `manager` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_shutdown(
    manager: *const kvwire_manager_t,
    timeout_ms: u64,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let m = unsafe { handle(manager)? };
        m.manager.shutdown(millis(timeout_ms))
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

/// The pages kvwire holds now (leased to a transfer, or verified and not yet released),
/// into `out[0..cap]`, their count into `*len` (KVWIRE_ERR_BUFFER_TOO_SMALL, with `*len`
/// set, when they do not fit). The engine must not free or write them.
///
/// # Safety
/// `manager` is a live handle, `len` writable, `out` null or valid for `cap` entries.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_held_pages(
    manager: *const kvwire_manager_t,
    out: *mut u32,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let m = unsafe { handle(manager)? };
        let held = m.manager.held_pages();
        // SAFETY: the caller's contract.
        unsafe { copy_out(&held, out, cap, len, "out") }
    })
}
