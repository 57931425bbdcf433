//! The prefill side of one request: admit, send chunk by chunk, poll, clear.

use std::ffi::{c_char, c_int};

use kvwire::TransferId;

use crate::*;

/// The prefill side of request `room`: with `peer` 0 it goes to the decode node that
/// reserves it (of all connected decodes, the one whose reservation or refusal named `room`;
/// Bootstrapping until then); with a node id, to that peer.
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

/// As kvwire_sender_init, and the final chunk carries the record at `aux_index` of the aux
/// buffers (kvwire_manager_new_with_aux), read when it is sent (a kvwire_sender_send that
/// passes its own aux record sends that one instead).
///
/// # Safety
/// `sender` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvwire_sender_init_aux(
    sender: *const kvwire_sender_t,
    num_pages: u32,
    tokens: u32,
    aux_index: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { handle(sender)? };
        s.transfer.init_with_aux(num_pages, tokens, Some(aux_index))
    })
}

/// Hands over the next chunk: the engine's pages `pages[0..n]`, in transfer order, read in
/// place (not written by the engine until kvwire_sender_clear returned); `aux[0..aux_len]`
/// (NULL: none) goes with the final chunk only. Never waits on the connection: a chunk it
/// refuses (a page the pool cannot lend) fails the transfer, read from kvwire_sender_poll.
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
