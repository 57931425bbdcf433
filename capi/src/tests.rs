//! Unit tests of the boundary and the codes.

use std::ffi::{c_char, c_int, CStr, CString};

use kvwire::polled::{ErrorKind, KvPoll};

use crate::*;

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
        assert_eq!(
            kvwire_config_init_sized(config.as_mut_ptr(), std::mem::size_of::<kvwire_config_t>()),
            KVWIRE_OK
        );
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
        assert_eq!(
            kvwire_config_init_sized(c.as_mut_ptr(), std::mem::size_of::<kvwire_config_t>()),
            KVWIRE_OK
        );
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

/// A manager with one aux buffer of 8-byte slots (8 of them) next to its KV cache.
///
/// # Safety
/// `psk` is a NUL-terminated string.
unsafe fn manager_with_aux(
    role: c_int,
    psk: *const c_char,
) -> (*mut kvwire_manager_t, &'static mut [u8], &'static mut [u8]) {
    let kv: &'static mut [u8] = Box::leak(vec![0u8; 64 * 4096].into_boxed_slice());
    let aux: &'static mut [u8] = Box::leak(vec![0u8; 64].into_boxed_slice());
    let buf = kvwire_buffer_t {
        ptr: kv.as_mut_ptr().cast(),
        len: kv.len(),
        page_bytes: 4096,
    };
    let abuf = kvwire_aux_buffer_t {
        ptr: aux.as_mut_ptr().cast(),
        len: aux.len(),
        item_len: 8,
    };
    let mut c = std::mem::MaybeUninit::<kvwire_config_t>::uninit();
    // SAFETY: every pointer is valid; the buffers are leaked (live for the process), and
    // the test touches only what kvwire does not hold.
    unsafe {
        assert_eq!(
            kvwire_config_init_sized(c.as_mut_ptr(), std::mem::size_of::<kvwire_config_t>()),
            KVWIRE_OK
        );
        let mut c = c.assume_init();
        c.role = role;
        c.tokens_per_page = 16;
        c.max_context_tokens = 1024;
        c.psk_hex = psk;
        let mut m = std::ptr::null_mut();
        assert_eq!(
            kvwire_manager_new_with_aux(&c, &buf, 1, &abuf, 1, &mut m),
            KVWIRE_OK,
            "{}",
            last_error()
        );
        (m, kv, aux)
    }
}

#[test]
fn a_decode_caller_finds_its_prefill_dials_it_and_gets_the_aux_record_in_its_slot() {
    let psk = CString::new(kvwire::config::auth::generate_hex().unwrap()).unwrap();
    let server = kvwire::polled::BootstrapServer::bind("127.0.0.1:0").unwrap();
    let server_addr = CString::new(server.local_addr().to_string()).unwrap();
    // SAFETY: every pointer is valid or a live handle of this test.
    unsafe {
        let (prefill, pkv, paux) = manager_with_aux(KVWIRE_ROLE_PREFILL, psk.as_ptr());
        let (decode, dkv, daux) = manager_with_aux(KVWIRE_ROLE_DECODE, psk.as_ptr());
        let mut bound = [0 as c_char; KVWIRE_ADDR_MAX];
        assert_eq!(
            kvwire_manager_listen(prefill, c"127.0.0.1:0".as_ptr(), bound.as_mut_ptr(), 64),
            KVWIRE_OK
        );
        assert_eq!(
            kvwire_manager_register(
                prefill,
                server_addr.as_ptr(),
                c"c1".as_ptr(),
                2,
                10_000,
                std::ptr::null()
            ),
            KVWIRE_OK,
            "{}",
            last_error()
        );
        let mut found = [0 as c_char; KVWIRE_ADDR_MAX];
        assert_eq!(
            kvwire_manager_resolve(
                decode,
                server_addr.as_ptr(),
                c"c1".as_ptr(),
                KVWIRE_ROLE_PREFILL,
                2,
                found.as_mut_ptr(),
                found.len()
            ),
            KVWIRE_OK,
            "{}",
            last_error()
        );
        assert_eq!(
            CStr::from_ptr(found.as_ptr()),
            CStr::from_ptr(bound.as_ptr())
        );
        assert_eq!(
            kvwire_manager_resolve(
                decode,
                server_addr.as_ptr(),
                c"c1".as_ptr(),
                KVWIRE_ROLE_PREFILL,
                3,
                found.as_mut_ptr(),
                found.len()
            ),
            KVWIRE_ERR_DISCOVERY
        );

        pkv[4096..8192].fill(0x5A);
        paux[8..16].copy_from_slice(b"token:42");
        let mut r = std::ptr::null_mut();
        assert_eq!(
            kvwire_receiver_new_at(decode, 5, found.as_ptr(), &mut r),
            KVWIRE_OK
        );
        let page = [7u32];
        assert_eq!(
            kvwire_receiver_init_aux(r, page.as_ptr(), 1, 16, 10_000, 3),
            KVWIRE_OK
        );
        let mut state = -1;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while state != KVWIRE_POLL_WAITING_FOR_INPUT && std::time::Instant::now() < deadline {
            assert_eq!(kvwire_receiver_poll(r, &mut state), KVWIRE_OK);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert_eq!(state, KVWIRE_POLL_WAITING_FOR_INPUT, "{}", last_error());
        let (mut held, mut len) = ([0u32; 4], 0);
        assert_eq!(
            kvwire_manager_held_pages(decode, held.as_mut_ptr(), held.len(), &mut len),
            KVWIRE_OK
        );
        assert_eq!(&held[..len], &[7]);
        assert_eq!(kvwire_manager_wait_peers(prefill, 1, 10_000), KVWIRE_OK);
        let mut s = std::ptr::null_mut();
        assert_eq!(kvwire_sender_new(prefill, 5, 0, &mut s), KVWIRE_OK);
        assert_eq!(kvwire_sender_init_aux(s, 1, 16, 1), KVWIRE_OK);
        let src = [1u32];
        assert_eq!(
            kvwire_sender_send(s, src.as_ptr(), 1, std::ptr::null(), 0),
            KVWIRE_OK,
            "{}",
            last_error()
        );
        assert_eq!(kvwire_receiver_wait(r, 10_000, &mut state), KVWIRE_OK);
        assert_eq!(state, KVWIRE_POLL_SUCCESS, "{}", last_error());
        assert!(dkv[7 * 4096..8 * 4096].iter().all(|&b| b == 0x5A));
        assert_eq!(&daux[24..32], b"token:42");
        assert_eq!(kvwire_receiver_release(r), KVWIRE_OK);
        assert_eq!(kvwire_sender_clear(s), KVWIRE_OK);
        assert_eq!(kvwire_manager_deregister(prefill), KVWIRE_OK);
        assert_eq!(server.record_count(), 0);
        kvwire_receiver_free(r);
        kvwire_sender_free(s);
        kvwire_manager_free(prefill);
        kvwire_manager_free(decode);
    }
}

/// kvwire_config_init writes only the size the program declares and records it there; a
/// config whose size is below the smallest struct (never filled by kvwire_config_init) is
/// refused by init and by kvwire_manager_new, naming the size.
#[test]
fn a_config_declares_its_size_and_nothing_beyond_it_is_written() {
    let ours = std::mem::size_of::<kvwire_config_t>();
    // A program built against a newer header: its struct is 16 bytes longer.
    #[repr(C, align(8))]
    struct Newer([u8; std::mem::size_of::<kvwire_config_t>() + 16]);
    let mut newer = Newer([0xAB; std::mem::size_of::<kvwire_config_t>() + 16]);
    let p = newer.0.as_mut_ptr().cast::<kvwire_config_t>();
    // SAFETY: `newer` is aligned and writable for the size passed.
    unsafe {
        assert_eq!(kvwire_config_init_sized(p, ours + 16), KVWIRE_OK);
        assert_eq!((*p).size, ours + 16);
        assert_eq!((*p).tcp_streams, 1);
        assert_eq!((*p).worker_threads, 2);
    }
    assert!(
        newer.0[ours..].iter().all(|&b| b == 0xAB),
        "bytes beyond this library's struct were written"
    );
    let mut small = std::mem::MaybeUninit::<kvwire_config_t>::zeroed();
    // SAFETY: valid pointers; sizes below the smallest struct must be refused.
    unsafe {
        assert_eq!(
            kvwire_config_init_sized(small.as_mut_ptr(), CONFIG_MIN_SIZE - 4),
            KVWIRE_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("config size"), "{}", last_error());
        // Zeroed, never filled: size 0.
        let c = small.assume_init();
        let mem: &'static mut [u8] = Box::leak(vec![0u8; 64 * 4096].into_boxed_slice());
        let buf = kvwire_buffer_t {
            ptr: mem.as_mut_ptr().cast(),
            len: mem.len(),
            page_bytes: 4096,
        };
        let mut m = std::ptr::null_mut();
        assert_eq!(
            kvwire_manager_new(&c, &buf, 1, &mut m),
            KVWIRE_ERR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("fill the config with kvwire_config_init"),
            "{}",
            last_error()
        );
    }
}

/// The RDMA fields: read into the transport (0 reads as the default), kept at their defaults
/// for a program built before them (its struct ends at `tcp_streams`), and a queue pair count
/// above 146 or an ACK timeout outside 1 to 31 refused by kvwire_manager_new naming the
/// value, in any build (values are checked before the transport is looked for).
#[test]
fn rdma_settings_are_read_defaulted_and_checked() {
    use kvwire::TransportConfig;
    let mut c = kvwire_config_t::defaults();
    c.role = KVWIRE_ROLE_DECODE;
    c.insecure_no_auth = 1;
    c.rdma_device = c"rxe9".as_ptr();
    c.rdma_queue_pairs = 3;
    c.rdma_busy_poll = 1;
    c.rdma_ack_timeout = 18;
    c.rdma_stripe_pages = 4;
    c.rdma_rail_affinity = 0;
    // SAFETY: a complete config whose strings are NUL-terminated or null.
    let read = unsafe { crate::manager::manager_config(&c) }.unwrap();
    assert_eq!(
        read.transport,
        TransportConfig::Rdma {
            devices: vec!["rxe9".into()],
            queue_pairs: 3,
            busy_poll: true,
            ack_timeout: 18,
            stripe_pages: 4,
            rail_affinity: false,
        }
    );
    c.rdma_device = c"".as_ptr();
    c.rdma_queue_pairs = 0;
    c.rdma_busy_poll = 0;
    c.rdma_ack_timeout = 0;
    c.rdma_stripe_pages = kvwire::config::DEFAULT_STRIPE_PAGES;
    c.rdma_rail_affinity = 1;
    // SAFETY: as above.
    let read = unsafe { crate::manager::manager_config(&c) }.unwrap();
    assert_eq!(
        read.transport,
        TransportConfig::rdma(None),
        "0 reads as the default"
    );
    // Striping off is 0 itself, not the default.
    c.rdma_stripe_pages = 0;
    // SAFETY: as above.
    let read = unsafe { crate::manager::manager_config(&c) }.unwrap();
    assert_eq!(read.transport, TransportConfig::rdma(None).stripe_pages(0));

    // An older program's struct: the fields beyond its size keep their defaults.
    let mut old = kvwire_config_t::defaults();
    old.size = CONFIG_MIN_SIZE;
    old.rdma_queue_pairs = 7;
    old.rdma_busy_poll = 1;
    old.rdma_ack_timeout = 99;
    // SAFETY: valid for reads of its whole size.
    let copied = unsafe { crate::manager::read_config(&old) }.unwrap();
    assert_eq!(
        (
            copied.rdma_queue_pairs,
            copied.rdma_busy_poll,
            copied.rdma_ack_timeout
        ),
        (1, 0, u32::from(kvwire::config::DEFAULT_ACK_TIMEOUT))
    );

    let mem: &'static mut [u8] = Box::leak(vec![0u8; 64 * 4096].into_boxed_slice());
    let buf = kvwire_buffer_t {
        ptr: mem.as_mut_ptr().cast(),
        len: mem.len(),
        page_bytes: 4096,
    };
    let mut config = kvwire_config_t::defaults();
    config.role = KVWIRE_ROLE_DECODE;
    config.tokens_per_page = 1;
    config.max_context_tokens = 64;
    config.insecure_no_auth = 1;
    config.rdma_device = c"".as_ptr();
    // Refused with KVWIRE_ERR_CONFIG, no manager made, the message naming the value.
    let refused = |config: &kvwire_config_t, named: String| {
        let mut m = std::ptr::null_mut();
        // SAFETY: valid config, buffer and out pointer.
        let rc = unsafe { kvwire_manager_new(config, &buf, 1, &mut m) };
        assert_eq!(rc, KVWIRE_ERR_CONFIG, "{named}");
        assert!(m.is_null());
        assert!(last_error().contains(&named), "{}", last_error());
    };
    for bad in [147, 70_000] {
        config.rdma_queue_pairs = bad;
        refused(&config, format!("queue_pairs = {bad}"));
    }
    config.rdma_queue_pairs = 1;
    for bad in [32, 300] {
        config.rdma_ack_timeout = bad;
        refused(&config, format!("ack_timeout = {bad}"));
    }
}

/// The same-host fields: read into the manager's config, kept at their defaults for a
/// program built before them (its struct ends at `rdma_ack_timeout`), and a same_host value
/// that names no mode refused naming it.
#[test]
fn same_host_settings_are_read_defaulted_and_checked() {
    let mut c = kvwire_config_t::defaults();
    c.role = KVWIRE_ROLE_DECODE;
    c.insecure_no_auth = 1;
    assert_eq!((c.same_host, c.pull_threads), (KVWIRE_SAME_HOST_AUTO, 0));
    c.same_host = KVWIRE_SAME_HOST_REQUIRE;
    c.pull_threads = 3;
    // SAFETY: a complete config whose strings are NUL-terminated or null.
    let read = unsafe { crate::manager::manager_config(&c) }.unwrap();
    assert_eq!(
        (read.same_host, read.pull_threads),
        (kvwire::SameHost::Require, 3)
    );
    c.same_host = KVWIRE_SAME_HOST_OFF;
    // SAFETY: as above.
    let read = unsafe { crate::manager::manager_config(&c) }.unwrap();
    assert_eq!(read.same_host, kvwire::SameHost::Off);

    // An older program's struct: the fields beyond its size keep their defaults.
    let mut old = c;
    old.size = std::mem::offset_of!(kvwire_config_t, same_host);
    old.same_host = 77;
    old.pull_threads = 9;
    old.rdma_stripe_pages = 0;
    old.rdma_rail_affinity = 0;
    // SAFETY: valid for reads of its whole size.
    let copied = unsafe { crate::manager::read_config(&old) }.unwrap();
    assert_eq!(
        (
            copied.same_host,
            copied.pull_threads,
            copied.rdma_stripe_pages,
            copied.rdma_rail_affinity
        ),
        (
            KVWIRE_SAME_HOST_AUTO,
            0,
            kvwire::config::DEFAULT_STRIPE_PAGES,
            1
        )
    );

    c.same_host = 7;
    // SAFETY: as above.
    let e = unsafe { crate::manager::manager_config(&c) }.unwrap_err();
    assert!(format!("{e}").contains("same_host = 7"), "{e}");
}
