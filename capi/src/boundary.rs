//! The boundary: the per-thread last error, panics caught, pointers and strings checked.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use kvwire::polled::{Error, ErrorKind, KvPoll};

use crate::*;

thread_local! {
    pub(crate) static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Runs `f`, catching panics; the `int` the C caller gets.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Error>) -> c_int {
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

pub(crate) fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, message)
}

/// The handle behind `p`, checked for null and for its type.
///
/// # Safety
/// `p` is null or points to a handle made by this library and not freed.
pub(crate) unsafe fn handle<'a, T: Handle>(p: *const T) -> Result<&'a T, Error> {
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
pub(crate) unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Error> {
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
pub(crate) unsafe fn string<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Error> {
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
pub(crate) unsafe fn put<T>(out: *mut T, v: T, what: &str) -> Result<(), Error> {
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
pub(crate) unsafe fn copy_out<T: Copy>(
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

pub(crate) fn poll_code(p: KvPoll) -> c_int {
    p as u8 as c_int
}

pub(crate) fn millis(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// Writes why the transfer failed.
///
/// # Safety
/// `out` null or writable; `message` null or valid for `cap` bytes.
pub(crate) unsafe fn failure_out(
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
