//! Peer discovery through kvwire's embedded bootstrap server: publish this manager, find a
//! peer's address (its layout fingerprint checked against this manager's), withdraw.

use std::ffi::{c_char, c_int};

use kvwire::polled::{DiscoveryBackend, Error, ErrorKind, Role};

use crate::*;

/// Publishes this manager in `cluster` as engine rank `rank` with the bootstrap server at
/// `server` ("host:port"), reachable at `address` (NULL: where kvwire_manager_listen
/// bound); refreshed while the manager lives, the record expires `ttl_ms` after the
/// process died. Blocks for the round trip.
///
/// # Safety
/// `manager` is a live handle; `server` and `cluster` NUL-terminated strings, `address`
/// null or one.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_register(
    manager: *const kvwire_manager_t,
    server: *const c_char,
    cluster: *const c_char,
    rank: u32,
    ttl_ms: u64,
    address: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let (m, server, cluster, address) = unsafe {
            (
                handle(manager)?,
                string(server, "server")?,
                string(cluster, "cluster")?,
                string(address, "address")?,
            )
        };
        let server = server.ok_or_else(|| invalid("server: null pointer"))?;
        let cluster = cluster.ok_or_else(|| invalid("cluster: null pointer"))?;
        let backend = DiscoveryBackend::Bootstrap(server.to_owned());
        m.manager
            .register(&backend, cluster, rank, millis(ttl_ms), address)
    })
}

/// Withdraws this manager's records now (waiting at most 5 s for each).
///
/// # Safety
/// `manager` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_deregister(manager: *const kvwire_manager_t) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let m = unsafe { handle(manager)? };
        m.manager.deregister();
        Ok(())
    })
}

/// The address of the first peer of `role` (KVWIRE_ROLE_*) and engine rank `rank`
/// registered in `cluster` with the bootstrap server at `server`, NUL-terminated into
/// `address[0..cap]` (`cap` at least KVWIRE_ADDR_MAX). KVWIRE_ERR_LAYOUT_MISMATCH when a
/// peer there has another KV layout or model fingerprint (fail closed),
/// KVWIRE_ERR_DISCOVERY when none is registered or the server cannot be reached.
///
/// # Safety
/// `manager` is a live handle; `server` and `cluster` NUL-terminated strings; `address`
/// valid for `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvwire_manager_resolve(
    manager: *const kvwire_manager_t,
    server: *const c_char,
    cluster: *const c_char,
    role: c_int,
    rank: u32,
    address: *mut c_char,
    cap: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let (m, server, cluster) = unsafe {
            (
                handle(manager)?,
                string(server, "server")?,
                string(cluster, "cluster")?,
            )
        };
        let server = server.ok_or_else(|| invalid("server: null pointer"))?;
        let cluster = cluster.ok_or_else(|| invalid("cluster: null pointer"))?;
        let role = match role {
            KVWIRE_ROLE_PREFILL => Role::Prefill,
            KVWIRE_ROLE_DECODE => Role::Decode,
            r => return Err(invalid(format!("role {r}: KVWIRE_ROLE_PREFILL or _DECODE"))),
        };
        let backend = DiscoveryBackend::Bootstrap(server.to_owned());
        let found = m
            .manager
            .resolve(&backend, cluster, role, Some(rank), true)?;
        let first = found.into_iter().next().ok_or_else(|| {
            Error::new(
                ErrorKind::DiscoveryError,
                format!("no peer of rank {rank} registered in cluster {cluster:?}"),
            )
        })?;
        let mut bytes = first.address.into_bytes();
        bytes.push(0);
        let mut len = 0;
        // SAFETY: `address` is valid for `cap` bytes (the caller's contract); `len` is ours.
        unsafe { copy_out(&bytes, address.cast::<u8>(), cap, &mut len, "address") }
    })
}
