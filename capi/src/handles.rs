//! The types of the ABI: buffers, the configuration, a failure's description, and the
//! opaque handles (each with a magic number, so that a handle of another type is refused).

use std::ffi::{c_char, c_int, c_void};

use kvwire::polled::Manager;

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

/// One of the engine's aux buffers: base pointer, length in bytes, bytes per slot (SGLang's
/// `aux_data_ptrs[i]`, `aux_data_lens[i]`, `aux_item_lens[i]`); one slot per aux index. A
/// request's aux record is its slot in every buffer, concatenated.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_camel_case_types)]
pub struct kvwire_aux_buffer_t {
    /// The buffer's first byte.
    pub ptr: *mut c_void,
    /// Its length in bytes.
    pub len: usize,
    /// Bytes per slot.
    pub item_len: usize,
}

/// How a manager is set up. Fill it with kvwire_config_init (a macro: it passes the size
/// of the struct this program was compiled with), then set the fields. Fields are only ever
/// appended in later versions: the library reads only the first `size` bytes, and a field
/// beyond them keeps its default, so a program built against an older header runs with a
/// newer library (an older library ignores fields it does not know).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_camel_case_types)]
pub struct kvwire_config_t {
    /// The size of this struct as the program was compiled (kvwire_config_init sets it).
    /// Do not change it.
    pub size: usize,
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
    /// NULL: TCP. Otherwise RDMA on this device ("" for the first one), or on several
    /// comma-separated ("mlx5_0,mlx5_1"), one rail each with at least one queue pair; needs a
    /// library built with the `rdma` feature.
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
    /// TCP streams per connection, 1 to 64, the same on both engines (default 1; 0 reads as
    /// 1); transfers spread over them, each on one stream.
    pub tcp_streams: u32,
    /// RDMA: RC queue pairs per connection, 1 to 146, the same on both engines (default 1;
    /// 0 reads as 1; more: KVWIRE_ERR_CONFIG); transfers take them in turn. This field and
    /// the two after it follow `tcp_streams`: a program built against an older header keeps
    /// their defaults.
    pub rdma_queue_pairs: u32,
    /// RDMA: non-zero polls the completion queues in a loop instead of sleeping on the
    /// completion channel (lower latency, one core busy per connection). Default 0.
    pub rdma_busy_poll: c_int,
    /// RDMA: the queue pairs' local ACK timeout exponent, 1 to 31: a packet not
    /// acknowledged within 4.096 us x 2^n is sent again (up to 7 times before the link
    /// fails). Default 14 (about 67 ms); 0 reads as the default; 18 (about 1.1 s) where
    /// queueing on the path can exceed that. Out of range: KVWIRE_ERR_CONFIG.
    pub rdma_ack_timeout: u32,
    /// TCP: same-host pulls, KVWIRE_SAME_HOST_AUTO (the default), _OFF or _REQUIRE (anything
    /// else: KVWIRE_ERR_CONFIG). This field and the one after it follow `rdma_ack_timeout`:
    /// a program built against an older header keeps their defaults.
    pub same_host: c_int,
    /// Same-host pulls: threads that copy pages, shared by the manager's connections; 1
    /// on each connection's own task; 0 (the default) half the cores, at most 8.
    pub pull_threads: u32,
    /// RDMA, decode side: a transfer of P pages is written over min(P / n, queue pairs)
    /// queue pairs at once, each rail once before any twice (striping, SPEC §9.2). Default
    /// 16; 0 never stripes. This field follows `pull_threads`: a program built against an
    /// older header keeps the default.
    pub rdma_stripe_pages: u32,
    /// RDMA, decode side: non-zero (the default, kvwire_config_init) keeps reservations to
    /// the rails whose NIC is on the KV memory's NUMA node while one is up, where the kernel
    /// reports the nodes; 0 uses every rail alike. This field follows `rdma_stripe_pages`: a
    /// program built against an older header keeps the default.
    pub rdma_rail_affinity: c_int,
}

/// The smallest `size` a kvwire_config_t may declare: every field up to `tcp_streams`,
/// the struct of the first header that carried `size`.
pub(crate) const CONFIG_MIN_SIZE: usize =
    std::mem::offset_of!(kvwire_config_t, tcp_streams) + std::mem::size_of::<u32>();

impl kvwire_config_t {
    /// The defaults (kvwire_config_init), declaring this library's size.
    pub(crate) fn defaults() -> Self {
        Self {
            size: std::mem::size_of::<Self>(),
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
            tcp_streams: 1,
            rdma_queue_pairs: 1,
            rdma_busy_poll: 0,
            rdma_ack_timeout: kvwire::config::DEFAULT_ACK_TIMEOUT.into(),
            same_host: crate::codes::KVWIRE_SAME_HOST_AUTO,
            pull_threads: 0,
            rdma_stripe_pages: kvwire::config::DEFAULT_STRIPE_PAGES,
            rdma_rail_affinity: 1,
        }
    }
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

pub(crate) const MANAGER_MAGIC: u64 = 0x6b76_7769_7265_4d47;
pub(crate) const RECEIVER_MAGIC: u64 = 0x6b76_7769_7265_5258;
pub(crate) const SENDER_MAGIC: u64 = 0x6b76_7769_7265_5458;

/// A manager: one engine's registered KV memory, its background runtime and connections.
#[allow(non_camel_case_types)]
pub struct kvwire_manager_t {
    pub(crate) magic: u64,
    pub(crate) manager: Manager,
}

/// The decode side of one request.
#[allow(non_camel_case_types)]
pub struct kvwire_receiver_t {
    pub(crate) magic: u64,
    pub(crate) transfer: kvwire::polled::ReceiverTransfer,
}

/// The prefill side of one request.
#[allow(non_camel_case_types)]
pub struct kvwire_sender_t {
    pub(crate) magic: u64,
    pub(crate) transfer: kvwire::polled::SenderTransfer,
}

pub(crate) trait Handle {
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
