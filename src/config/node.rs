//! A node's configuration: what every connection it opens is built from.

use std::sync::Arc;
use std::time::Duration;

use kvwire_proto::auth::{AuthChannel, Nonce, Psk};
use kvwire_proto::receiver::ReceiverConfig;
use kvwire_proto::sender::SenderConfig;
use kvwire_proto::wire::{DigestAlgorithm, Hello, Role};

use super::EngineConfig;
use crate::checksum::DigestMode;
use crate::memory::{PoolGeometry, Scrub};
use crate::metrics::Metrics;

/// Everything a node needs to open connections. Build one with [`NodeConfig::builder`] (which
/// checks it), or start from [`NodeConfig::example`] and set fields.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NodeConfig {
    /// This node's id (for logs).
    pub node_id: u64,
    /// The KV pool each connection gets: its geometry is the layout advertised in HELLO.
    pub pool: PoolGeometry,
    /// Context length and the undersized-pool override, checked against the pool as built.
    pub engine: EngineConfig,
    /// Opaque model / tensor-parallel fingerprint; peers must match exactly.
    pub fingerprint: Vec<u8>,
    /// Digest algorithms offered, preferred first.
    pub digests: Vec<DigestAlgorithm>,
    /// The longest auxiliary record (e.g. a first output token) this node accepts with a
    /// transfer it receives, announced in its hello (at most
    /// [`MAX_AUX`](kvwire_proto::wire::MAX_AUX); default 4096 bytes). Reservations are
    /// sized so a COMMIT with an aux record this long still fits one frame.
    pub max_aux: u32,
    /// Scrub policy of the pool.
    pub scrub: Scrub,
    /// How long the handshake may take.
    pub handshake_timeout: Duration,
    /// Heartbeats on every connection (SPEC §8.3): a PING every `liveness.interval`
    /// (default 250 ms); a peer from which nothing arrives for `liveness.timeout` (default
    /// 2 s) is declared unresponsive, its connection closed and its transfers failed with a
    /// retryable `PeerUnresponsive` (a committed one without a verdict: `Unconfirmed`).
    pub liveness: kvwire_proto::liveness::LivenessConfig,
    /// Sender session settings.
    pub sender: SenderConfig,
    /// Receiver session settings.
    pub receiver: ReceiverConfig,
    /// Page writes in flight per transfer on the sender.
    pub window: u32,
    /// Digest computation; anything but [`DigestMode::Verify`] delivers unverified data and
    /// exists only to measure the integrity tax.
    pub digest_mode: DigestMode,
    /// Where the node's connections count transfers, fences and pages; `None` for no metrics.
    pub metrics: Option<Arc<Metrics>>,
    /// Transfers of at least this many bytes are digested on tokio's blocking pool, so the
    /// connection keeps receiving (and sending) other transfers meanwhile; smaller ones
    /// inline, where a thread handoff costs more than it saves. `None` (the default): the
    /// transport's own threshold, [`TransportConfig::default_digest_offload_bytes`] (none
    /// over TCP, every transfer over RDMA).
    pub digest_offload_bytes: Option<u64>,
    /// Threads of the blocking pool one such transfer's digests may use at once: its pages
    /// are split into that many runs (each at least 1 MiB) digested in parallel and folded in
    /// order, the same digests. `1` (the default): every job on one thread; `0`: the cores
    /// this process may run on, at most 8. On the 2-core machine of docs/BENCHMARKS.md a
    /// split did not pay (an 8 MiB job took 1.2x as long in 2 parts); where cores are idle and
    /// the transport outruns one core's XXH3 (RDMA at tens of GB/s), measure it with
    /// `kvwire bench --digest-threads`.
    pub digest_threads: usize,
    /// Receivers digest each page right after it landed, while it is in cache, and verify
    /// from those digests once the fence closed the scope (SPEC §6, digests at landing); only transports that
    /// see landings can (TCP, loopback; RDMA always digests after the fence). Default on.
    /// Off, every transfer's memory is read again after its fence, which also catches a
    /// write into a leased page by something other than the transport (an engine bug).
    pub digest_at_landing: bool,
    /// Senders digest each source page as they hand it to the transport (right before it is
    /// sent, while in cache, and the first bytes leave before the last page is digested)
    /// instead of the whole chunk before its first write (SPEC §6, digests while sending).
    /// Only chunks that would be digested inline: one of at least `digest_offload_bytes`
    /// still goes to the blocking pool, where it runs beside the sending. Host memory only;
    /// device memory is digested where it is. Default on.
    pub digest_while_sending: bool,
    /// TCP streams per connection (SPEC §9.1, several streams; default 1, at most 64): the
    /// client opens the extra ones after the handshake and every transfer's records and
    /// frames travel on one of them, chosen by the receiver round robin, so several cores and
    /// NIC queues can carry one peer pair's transfers. Both ends must set the same; host
    /// memory only. A node with more than one accepts with a [`Listener`](crate::engine::Listener)
    /// (or one `accept` per connection).
    pub tcp_streams: u16,
    /// Peer authentication: a pre-shared key both ends must hold, or explicitly off.
    pub auth: Auth,
    /// The transport every connection of this node uses.
    pub transport: TransportConfig,
    /// Over TCP: whether the decode may copy pages straight out of the prefill's memory when
    /// both run on one host (SPEC §9.3, same-host pulls; docs/SAME_HOST.md). Default
    /// [`SameHost::Auto`].
    pub same_host: SameHost,
    /// Same-host pulls: threads that copy (and digest) pages out of the prefill's memory.
    /// `1`: on each connection's own task, one core for all its pulls; `n`: `n` threads of
    /// the node, started when a first connection pulls and shared by all, while each
    /// connection's task parses records, checks scopes and reports in stream order (a fence
    /// waits for the copies of its transfer in flight); `0` (the
    /// default): half the cores this process may run on (the prefill runs on the same host),
    /// at most 8, so one thread (the task) on a 2-core host, where measured threads lost as
    /// often as they won (docs/SAME_HOST.md).
    pub pull_threads: usize,
}

/// Same-host pulls over TCP (SPEC §9.3): when both ends run on one host, the decode copies
/// each page out of the prefill's memory with `process_vm_readv` (one copy per byte) and the
/// TCP stream carries only frames and pull records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum SameHost {
    /// Offered on connections whose peer address is this host's (loopback, or this end's own
    /// address), used when both ends offered them from the same boot and the decode attested
    /// the prefill's process and may read it; otherwise page bytes travel on the stream.
    #[default]
    Auto,
    /// Never offered: page bytes always travel on the stream.
    Off,
    /// Offered on every connection, and a connection without them is refused: a peer that
    /// does not offer them from this boot in its handshake (TRANSPORT_MISMATCH), or, at the
    /// decode, a prefill it cannot attest or read (closed before any transfer).
    Require,
}

impl std::str::FromStr for SameHost {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "off" => Ok(Self::Off),
            "require" => Ok(Self::Require),
            other => Err(format!("same_host = {other:?}: auto, off or require")),
        }
    }
}

/// Which transport a node's connections use. Both ends of a connection must use the same.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportConfig {
    /// One TCP connection carries frames and page bytes (the embedded default).
    #[default]
    Tcp,
    /// RDMA RC queue pairs (cargo feature `rdma`): one-sided WRITEs for the page bytes, SENDs
    /// for the frames, memory windows as the fence; a TCP connection carries the handshake
    /// and then watches the peer's liveness.
    Rdma {
        /// The RDMA devices (e.g. `mlx5_0`, `rxe0`), one per rail; empty for the first
        /// device. With several, the node registers its memory on each, and a connection's
        /// queue pairs take the rails in turn (queue pair `i` on device `i % devices.len()`;
        /// SPEC §9.2, several rails): transfers are spread over all of them, and a transfer
        /// of enough pages is striped over several at once (`stripe_pages`). Rail `i` of one
        /// node must reach rail `i` of its peers.
        devices: Vec<String>,
        /// RC queue pairs per connection (both ends must agree; transfers take them in turn),
        /// 1 to [`MAX_QUEUE_PAIRS`], and at least one per device.
        queue_pairs: u16,
        /// Poll completion queues in a loop instead of sleeping on the completion channel
        /// (lower latency, one core busy per connection).
        busy_poll: bool,
        /// The queue pairs' local ACK timeout, as the exponent verbs takes: a sent packet
        /// not acknowledged within 4.096 µs x 2^`ack_timeout` is sent again (with every
        /// packet after it), up to 7 times before the link fails. 1 to 31;
        /// [`DEFAULT_ACK_TIMEOUT`] (14, about 67 ms: perftest's) by default. Raise it (18 is
        /// about 1.1 s, the order of UCX's default) where queueing on the path can hold an
        /// acknowledgement longer: a timeout shorter than that retransmits data that was not
        /// lost (docs/BENCHMARKS.md, "Retransmissions on SoftRoCE"). A local setting; the two
        /// ends need not agree.
        ack_timeout: u8,
        /// Decode side: pages per stripe below which a reservation is not striped over one
        /// more queue pair (SPEC §9.2, striping a transfer over lanes): a reservation of `P`
        /// pages is written over `min(P / stripe_pages, live queue pairs)` of them at once,
        /// each rail once before any twice, its RESERVE and COMMIT on the first.
        /// [`DEFAULT_STRIPE_PAGES`] (16) by default; 0 never stripes (a transfer on one queue
        /// pair, as peers that predate striping expect). A local setting: the prefill follows
        /// the access descriptor.
        stripe_pages: u32,
        /// Decode side: reservations keep to the rails whose NIC sits on the NUMA node of
        /// the KV memory (sysfs `device/numa_node` of each device, `get_mempolicy` of the
        /// registered memory) while one of them is up, the others taking them only when none
        /// is (SPEC §9.2, striping). On by default; no effect where the topology is unknown
        /// (software devices, hosts without NUMA) or every rail is on that node.
        rail_affinity: bool,
    },
}

// The RDMA transport's bounds, where [`TransportConfig::Rdma`] is checked against them:
// `DEFAULT_ACK_TIMEOUT` (14, as perftest's `ib_write_bw`), `ACK_TIMEOUTS` (1 to 31) and
// `MAX_QUEUE_PAIRS` (146, SPEC §9.2).
pub use crate::transport::rdma::descriptor::DEFAULT_STRIPE_PAGES;
pub use crate::transport::rdma::{ACK_TIMEOUTS, DEFAULT_ACK_TIMEOUT, MAX_QUEUE_PAIRS};
/// The most TCP streams a connection may run (`NodeConfig::tcp_streams`, SPEC §9.1).
pub use crate::transport::tcp::MAX_STREAMS;

impl TransportConfig {
    /// RDMA on `device` (or the first device) with one queue pair, waiting on the completion
    /// channel.
    pub fn rdma(device: Option<&str>) -> Self {
        Self::Rdma {
            devices: device.map(str::to_owned).into_iter().collect(),
            queue_pairs: 1,
            busy_poll: false,
            ack_timeout: DEFAULT_ACK_TIMEOUT,
            stripe_pages: DEFAULT_STRIPE_PAGES,
            rail_affinity: true,
        }
    }

    /// RDMA over several devices, one rail each, with one queue pair per rail (raise
    /// `queue_pairs` for more), waiting on the completion channels.
    pub fn rdma_rails(devices: &[&str]) -> Self {
        Self::Rdma {
            devices: devices.iter().map(|d| (*d).to_owned()).collect(),
            queue_pairs: devices.len().clamp(1, usize::from(MAX_QUEUE_PAIRS)) as u16,
            busy_poll: false,
            ack_timeout: DEFAULT_ACK_TIMEOUT,
            stripe_pages: DEFAULT_STRIPE_PAGES,
            rail_affinity: true,
        }
    }

    /// RDMA devices named in one string, comma-separated (`"mlx5_0,mlx5_1"`, as Mooncake's
    /// `ib_device` takes them): one rail each, with `queue_pairs` queue pairs per connection
    /// raised to one per rail. An empty string names the first device. Zero queue pairs is
    /// kept, so the build refuses it rather than a typo turning into a working config.
    pub fn rdma_devices(devices: &str, queue_pairs: u16) -> Self {
        let devices: Vec<String> = devices
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(str::to_owned)
            .collect();
        let rails = u16::try_from(devices.len()).unwrap_or(u16::MAX);
        Self::Rdma {
            devices,
            queue_pairs: if queue_pairs == 0 {
                0
            } else {
                queue_pairs.max(rails)
            },
            busy_poll: false,
            ack_timeout: DEFAULT_ACK_TIMEOUT,
            stripe_pages: DEFAULT_STRIPE_PAGES,
            rail_affinity: true,
        }
    }

    /// RDMA only: poll the completion queues in a loop (`TransportConfig::Rdma::busy_poll`);
    /// TCP is returned as it is.
    pub fn busy_poll(mut self, on: bool) -> Self {
        if let Self::Rdma { busy_poll, .. } = &mut self {
            *busy_poll = on;
        }
        self
    }

    /// RDMA only: the queue pairs' local ACK timeout exponent
    /// (`TransportConfig::Rdma::ack_timeout`, checked when the config is built); TCP is
    /// returned as it is.
    pub fn ack_timeout(mut self, exponent: u8) -> Self {
        if let Self::Rdma { ack_timeout, .. } = &mut self {
            *ack_timeout = exponent;
        }
        self
    }

    /// RDMA only: pages per stripe (`TransportConfig::Rdma::stripe_pages`; 0 never stripes);
    /// TCP is returned as it is.
    pub fn stripe_pages(mut self, pages: u32) -> Self {
        if let Self::Rdma { stripe_pages, .. } = &mut self {
            *stripe_pages = pages;
        }
        self
    }

    /// RDMA only: whether the decode keeps reservations to the rails on its KV memory's
    /// NUMA node (`TransportConfig::Rdma::rail_affinity`); TCP is returned as it is.
    pub fn rail_affinity(mut self, on: bool) -> Self {
        if let Self::Rdma { rail_affinity, .. } = &mut self {
            *rail_affinity = on;
        }
        self
    }

    /// Transfers of at least this many bytes are digested on the blocking pool when
    /// [`NodeConfig::digest_offload_bytes`] is `None`.
    ///
    /// * TCP: none (`u64::MAX`). The connection's own thread copies every byte in and out of
    ///   the socket, and digests each page right after that copy, from cache: the receiver as
    ///   it lands, the sender as its write completes
    ///   (the TCP sender transport's `digests_after_writes`).
    ///   A job on the pool reads the pages again from memory on another core. On 2 cores
    ///   inline beat the pool for 8 MiB and 32 MiB transfers alike (1.01-1.26x GB/s at
    ///   0.86-1.01x CPU; docs/BENCHMARKS.md, "The sender's digest after the kernel's copy").
    ///   Where idle cores matter more than CPU per byte, set
    ///   [`NodeConfig::digest_offload_bytes`] and measure.
    /// * RDMA: 1 byte, every transfer with page bytes. The NIC moves the bytes while the
    ///   connection's thread only posts and completes work requests; a digest on that thread
    ///   holds back the posting of every other transfer while the link idles. On SoftRoCE at
    ///   64 KiB pages (512 KiB transfers, four in flight) moving them to the pool gained 1.11x
    ///   (docs/BENCHMARKS.md, "RDMA digests on the blocking pool").
    pub fn default_digest_offload_bytes(&self) -> u64 {
        match self {
            Self::Tcp => u64::MAX,
            Self::Rdma { .. } => 1,
        }
    }

    /// The transport's name, as `kvwire bench` and logs print it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Rdma { .. } => "rdma",
        }
    }
}

/// Whether a node authenticates its peers (SPEC.md §3.11, §4.8). Its `Debug` form never
/// shows the key.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Auth {
    /// Peers must hold this pre-shared key: the handshake proves it both ways and every frame
    /// after it carries an HMAC-SHA256 tag under per-connection keys.
    Psk(Psk),
    /// No authentication (`auth.mode = "off"`, `--insecure-no-auth`): any peer that reaches
    /// the endpoint with the right layout can connect, and frames can be forged on the path.
    Off,
}

impl Auth {
    /// A fresh random 32-byte key, for the two ends of a connection in one process (the
    /// in-process bench, tests, examples).
    ///
    /// # Panics
    /// If the operating system has no random source.
    pub fn ephemeral() -> Self {
        let key: [u8; 32] = random_bytes().expect("the OS random source");
        Self::Psk(Psk::new(key.to_vec()).expect("32 bytes is a valid key length"))
    }

    /// Peers must hold `key` (raw bytes, at least 16 of them).
    pub fn psk(key: impl Into<Vec<u8>>) -> Result<Self, kvwire_proto::auth::PskError> {
        Psk::new(key.into()).map(Self::Psk)
    }

    /// Peers must hold the key written as hex text (what `kvwire gen-psk` prints).
    pub fn psk_hex(hex: &str) -> Result<Self, kvwire_proto::auth::PskError> {
        Psk::from_hex(hex).map(Self::Psk)
    }

    /// Whether peers are authenticated.
    pub fn is_on(&self) -> bool {
        matches!(self, Self::Psk(_))
    }

    /// What `kvwire doctor` and logs may print: "psk (key id ...)" or "off".
    pub fn describe(&self) -> String {
        match self {
            Self::Psk(k) => format!("psk (key id {}, {} bytes)", k.id(), k.len()),
            Self::Off => "off".into(),
        }
    }

    /// The authentication channel for one new connection (client or server side), with a
    /// fresh nonce from the OS random source.
    pub fn channel(&self, client: bool) -> std::io::Result<AuthChannel> {
        Ok(match self {
            Self::Off => AuthChannel::off(),
            Self::Psk(k) => {
                let nonce: Nonce = random_bytes()?;
                if client {
                    AuthChannel::client(k.clone(), nonce)
                } else {
                    AuthChannel::server(k.clone(), nonce)
                }
            }
        })
    }
}

/// `N` bytes from the operating system's random source.
pub fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(b)
}

impl NodeConfig {
    /// A small configuration for examples: 2 buffers of 4 KiB pages, 16 tokens per page,
    /// 256 pages, 4096-token context, authenticated with a fresh random key (so only clones
    /// of this configuration can connect to each other; set `auth` for real peers).
    pub fn example() -> Self {
        Self {
            node_id: 1,
            pool: PoolGeometry {
                tokens_per_page: 16,
                buffer_page_bytes: vec![4096, 4096],
                pages: 256,
            },
            engine: EngineConfig::new(4096),
            fingerprint: b"example-model/tp0".to_vec(),
            digests: vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32],
            max_aux: 4096,
            scrub: Scrub::None,
            handshake_timeout: kvwire_proto::handshake::DEFAULT_HANDSHAKE_TIMEOUT,
            liveness: kvwire_proto::liveness::LivenessConfig::default(),
            sender: SenderConfig::default(),
            receiver: ReceiverConfig::default(),
            window: 16,
            digest_mode: DigestMode::Verify,
            metrics: None,
            digest_offload_bytes: None,
            digest_threads: 1,
            digest_at_landing: true,
            digest_while_sending: true,
            tcp_streams: 1,
            auth: Auth::ephemeral(),
            transport: TransportConfig::Tcp,
            same_host: SameHost::Auto,
            pull_threads: 0,
        }
    }

    /// A builder for a node whose KV pool has `pool`'s geometry and whose engine advertises
    /// contexts of up to `max_context_tokens` tokens. Everything else starts at the defaults
    /// of [`NodeConfig::example`], with authentication *required*: set a key with
    /// [`NodeConfigBuilder::auth`] (or turn it off explicitly).
    pub fn builder(pool: PoolGeometry, max_context_tokens: u64) -> NodeConfigBuilder {
        let mut c = Self::example();
        c.pool = pool;
        c.engine = EngineConfig::new(max_context_tokens);
        c.fingerprint = Vec::new();
        NodeConfigBuilder {
            config: c,
            auth_set: false,
        }
    }

    /// This node's hello body for a connection in `role` (no transport parameters).
    pub fn hello(&self, role: Role) -> Hello {
        Hello {
            node_id: self.node_id,
            role,
            layout: self.pool.to_layout(self.fingerprint.clone()),
            digests: self.digests.clone(),
            transport_params: Vec::new(),
            max_aux: self.max_aux.min(kvwire_proto::wire::MAX_AUX as u32),
        }
    }
}

/// Builds a [`NodeConfig`], checking it as a whole ([`NodeConfigBuilder::build`]).
#[derive(Debug)]
#[must_use = "a builder does nothing until built"]
pub struct NodeConfigBuilder {
    config: NodeConfig,
    auth_set: bool,
}

impl NodeConfigBuilder {
    /// This node's id (for logs and the peer's accounting).
    pub fn node_id(mut self, id: u64) -> Self {
        self.config.node_id = id;
        self
    }

    /// The model / tensor-parallel fingerprint peers must match exactly (at most 255 bytes).
    pub fn fingerprint(mut self, fingerprint: impl Into<Vec<u8>>) -> Self {
        self.config.fingerprint = fingerprint.into();
        self
    }

    /// Peer authentication: a pre-shared key, or [`Auth::Off`].
    pub fn auth(mut self, auth: Auth) -> Self {
        self.config.auth = auth;
        self.auth_set = true;
        self
    }

    /// The transport (TCP by default).
    pub fn transport(mut self, transport: TransportConfig) -> Self {
        self.config.transport = transport;
        self
    }

    /// Digest algorithms offered, preferred first.
    pub fn digests(mut self, digests: Vec<DigestAlgorithm>) -> Self {
        self.config.digests = digests;
        self
    }

    /// What the pool writes over a page's bytes when it is released.
    pub fn scrub(mut self, scrub: Scrub) -> Self {
        self.config.scrub = scrub;
        self
    }

    /// Page writes in flight per transfer on the sender.
    pub fn window(mut self, pages: u32) -> Self {
        self.config.window = pages.max(1);
        self
    }

    /// How long a handshake may take.
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.config.handshake_timeout = timeout;
        self
    }

    /// Heartbeats: the PING interval and the silence after which a peer is unresponsive.
    pub fn liveness(mut self, liveness: kvwire_proto::liveness::LivenessConfig) -> Self {
        self.config.liveness = liveness;
        self
    }

    /// TCP streams per connection ([`NodeConfig::tcp_streams`], 1 to 64).
    pub fn tcp_streams(mut self, streams: u16) -> Self {
        self.config.tcp_streams = streams;
        self
    }

    /// Same-host pulls over TCP ([`NodeConfig::same_host`]).
    pub fn same_host(mut self, same_host: SameHost) -> Self {
        self.config.same_host = same_host;
        self
    }

    /// Threads that copy same-host pulls ([`NodeConfig::pull_threads`]).
    pub fn pull_threads(mut self, threads: usize) -> Self {
        self.config.pull_threads = threads;
        self
    }

    /// The sender sessions' timeouts and history.
    pub fn sender(mut self, sender: SenderConfig) -> Self {
        self.config.sender = sender;
        self
    }

    /// The receiver sessions' settings.
    pub fn receiver(mut self, receiver: ReceiverConfig) -> Self {
        self.config.receiver = receiver;
        self
    }

    /// Where the node's connections count transfers, fences and pages.
    pub fn metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.config.metrics = Some(metrics);
        self
    }

    /// Start even though the pool cannot hold one maximum-length context (with a loud
    /// warning); such requests are then rejected at admission. Never set this to paper over a
    /// sizing mistake.
    pub fn allow_undersized_pool(mut self) -> Self {
        self.config.engine.allow_undersized_pool = true;
        self
    }

    /// Checks the configuration and returns it: the pool's geometry is valid, it holds the
    /// advertised context length (the check the incident lacked), the fingerprint fits the
    /// wire, at least one digest algorithm is offered, and authentication was decided.
    pub fn build(self) -> Result<NodeConfig, super::ConfigError> {
        use super::ConfigError;
        let c = self.config;
        c.pool
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        c.engine.validate_geometry(&c.pool)?;
        if c.fingerprint.len() > usize::from(u8::MAX) {
            return Err(ConfigError::Invalid(format!(
                "the fingerprint is {} bytes; at most 255 travel in HELLO",
                c.fingerprint.len()
            )));
        }
        if !(1..=crate::transport::tcp::MAX_STREAMS).contains(&c.tcp_streams) {
            return Err(ConfigError::Invalid(format!(
                "tcp_streams = {}: 1 to {} TCP streams per connection",
                c.tcp_streams,
                crate::transport::tcp::MAX_STREAMS
            )));
        }
        if let TransportConfig::Rdma {
            ack_timeout,
            queue_pairs,
            ref devices,
            ..
        } = c.transport
        {
            if usize::from(queue_pairs) < devices.len() {
                return Err(ConfigError::Invalid(format!(
                    "queue_pairs = {queue_pairs} for {} devices: every rail needs at least one queue pair",
                    devices.len()
                )));
            }
            for (i, d) in devices.iter().enumerate() {
                if devices[..i].contains(d) {
                    return Err(ConfigError::Invalid(format!(
                        "the RDMA device {d} is named twice: one rail per device"
                    )));
                }
            }
            if !(1..=MAX_QUEUE_PAIRS).contains(&queue_pairs) {
                return Err(ConfigError::Invalid(format!(
                    "queue_pairs = {queue_pairs}: 1 to {MAX_QUEUE_PAIRS} RDMA queue pairs per connection (as many as a HELLO's transport parameters can list)"
                )));
            }
            if !ACK_TIMEOUTS.contains(&ack_timeout) {
                return Err(ConfigError::Invalid(format!(
                    "ack_timeout = {ack_timeout}: the exponent of the RDMA ACK timeout is {} to {} (0 would wait for ever)",
                    ACK_TIMEOUTS.start(),
                    ACK_TIMEOUTS.end()
                )));
            }
        }
        if c.digests.is_empty() {
            return Err(ConfigError::Invalid(
                "no digest algorithm offered (verification cannot be turned off)".into(),
            ));
        }
        if !self.auth_set {
            return Err(ConfigError::Invalid(
                "authentication not decided: set .auth(Auth::Psk(key)) (or Auth::Off explicitly)"
                    .into(),
            ));
        }
        Ok(c)
    }
}
