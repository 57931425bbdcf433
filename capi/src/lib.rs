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

mod boundary;
mod codes;
mod discovery;
mod handles;
mod library;
mod manager;
mod receiver;
mod sender;
#[cfg(test)]
mod tests;

use boundary::*;
pub use codes::*;
pub use discovery::*;
pub use handles::*;
pub use library::*;
pub use manager::*;
pub use receiver::*;
pub use sender::*;
