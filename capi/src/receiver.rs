//! The decode side of one request: reserve the engine's pages, poll, verify, release.

use std::ffi::{c_char, c_int};

use kvwire::TransferId;

use crate::*;

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

/// The decode side of request `room` from the peer listening at `addr` ("host:port"):
/// dialled in the background now (again if an earlier attempt failed or its peer was
/// lost); the transfer is KVWIRE_POLL_BOOTSTRAPPING until the connection is up, and fails
/// with the dial's error if it fails.
///
/// # Safety
/// `manager` is a live handle, `addr` a NUL-terminated string, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_new_at(
    manager: *const kvwire_manager_t,
    room: u64,
    addr: *const c_char,
    out: *mut *mut kvwire_receiver_t,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(invalid("out: null output pointer"));
        }
        // SAFETY: the caller's contract.
        let (m, addr) = unsafe { (handle(manager)?, string(addr, "addr")?) };
        let addr = addr.ok_or_else(|| invalid("addr: null pointer"))?;
        let transfer = m.manager.receiver_at(TransferId(room), addr)?;
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

/// As kvwire_receiver_init, and the verified aux record is written at `aux_index` of the
/// aux buffers (kvwire_manager_new_with_aux) before the transfer reports Success.
///
/// # Safety
/// `receiver` is a live handle, `pages` holds `n` entries.
#[no_mangle]
pub unsafe extern "C" fn kvwire_receiver_init_aux(
    receiver: *const kvwire_receiver_t,
    pages: *const u32,
    n: usize,
    tokens: u32,
    timeout_ms: u64,
    aux_index: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let (r, pages) = unsafe { (handle(receiver)?, slice(pages, n, "pages")?) };
        r.transfer
            .init_with_aux(pages.to_vec(), tokens, millis(timeout_ms), Some(aux_index))
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
