//! The return codes: `KVWIRE_OK` and one `KVWIRE_ERR_*` per [`kvwire::polled::ErrorKind`].
//! Literal values, so that cbindgen writes them into the header; a unit test (`tests.rs`)
//! checks that each equals the facade's `ErrorKind::code`.

use std::ffi::c_int;

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

/// Same-host pulls (`kvwire_config_t::same_host`, docs/SAME_HOST.md): when both engines run
/// on one host, the decode copies each page out of the prefill's memory (the default).
pub const KVWIRE_SAME_HOST_AUTO: c_int = 0;
/// Same-host pulls off: page bytes always travel on the TCP stream.
pub const KVWIRE_SAME_HOST_OFF: c_int = 1;
/// Same-host pulls required: a connection without them is refused.
pub const KVWIRE_SAME_HOST_REQUIRE: c_int = 2;
