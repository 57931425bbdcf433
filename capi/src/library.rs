//! The library: version, last error, code names, the configuration's defaults.

use std::ffi::{c_char, c_int, CStr, CString};

use kvwire::polled::ErrorKind;

use crate::*;

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
/// a random node id, 2 worker threads, 30 s call and 60 s release bounds, one TCP stream.
/// Role, tokens per page and context length are left 0: set them. Call it through the
/// `kvwire_config_init(config)` macro, which passes `sizeof *config`: only that many bytes
/// are written, and `config->size` records it. Fails with KVWIRE_ERR_INVALID_ARGUMENT when
/// `size` is below the smallest kvwire_config_t.
///
/// # Safety
/// `config` is null or valid for a write of `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvwire_config_init_sized(
    config: *mut kvwire_config_t,
    size: usize,
) -> c_int {
    guard(|| {
        if config.is_null() {
            return Err(invalid("config: null output pointer"));
        }
        if !config.is_aligned() {
            return Err(invalid("config: misaligned output pointer"));
        }
        if size < CONFIG_MIN_SIZE {
            return Err(invalid(format!(
                "config size {size}: a kvwire_config_t is at least {CONFIG_MIN_SIZE} bytes"
            )));
        }
        let mut c = kvwire_config_t::defaults();
        c.size = size;
        let n = size.min(std::mem::size_of::<kvwire_config_t>());
        // SAFETY: `config` is aligned and the caller promises `size` writable bytes; `n` is
        // at most `size` and at most the size of `c`, and the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                std::ptr::from_ref(&c).cast::<u8>(),
                config.cast::<u8>(),
                n,
            );
        }
        Ok(())
    })
}
