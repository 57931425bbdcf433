//! How a [`Manager`](super::Manager) is set up: [`ManagerConfig`].

use std::time::Duration;

use super::Role;
use crate::config::{Auth, TransportConfig};
use kvwire_proto::liveness::LivenessConfig;
use kvwire_proto::sender::SenderConfig;

/// How a [`Manager`](super::Manager) is set up. Start from [`ManagerConfig::new`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ManagerConfig {
    /// Prefill (sender) or decode (receiver).
    pub role: Role,
    /// Tokens per page (the same on both engines).
    pub tokens_per_page: u32,
    /// The context length the engine serves: the registered pool must hold it (checked
    /// when the manager starts, as [`Node::with_memory`](crate::engine::Node::with_memory) does), and the prefill's admission
    /// rejects longer requests.
    pub max_context_tokens: u64,
    /// Opaque model / tensor-parallel fingerprint; both engines must match exactly.
    pub fingerprint: Vec<u8>,
    /// Peer authentication (a pre-shared key both engines hold, or explicitly off).
    pub auth: Auth,
    /// The transport: TCP, or RDMA in builds with the `rdma` feature.
    pub transport: TransportConfig,
    /// This node's id, as peers see it (`0`: a random one).
    pub node_id: u64,
    /// Start even if the pool holds fewer tokens than the context length (not advised).
    pub allow_undersized_pool: bool,
    /// Worker threads of the manager's runtime.
    pub worker_threads: usize,
    /// The bound of blocking calls: `connect`, `listen`, and the round trips of `send`.
    pub call_timeout: Duration,
    /// How long `release` and `clear` wait for kvwire to give the pages back (a fenced abort
    /// finishes long before; this bounds a stuck peer).
    pub release_timeout: Duration,
    /// Peer liveness (heartbeat interval and timeout); `None`: the node's default.
    pub liveness: Option<LivenessConfig>,
    /// The prefill's protocol timeouts (how long an opened request waits for its
    /// reservation, how long a reservation that came first is held); `None`: the defaults.
    pub sender: Option<SenderConfig>,
    /// Decode: hand a verified transfer's pages back to the engine as soon as it verified
    /// (its aux record copied first), instead of at [`ReceiverTransfer::release`](super::ReceiverTransfer::release). The
    /// engine may then reuse them once `poll` said Success (SGLang's contract).
    pub release_verified: bool,
    /// TCP streams per connection (`NodeConfig::tcp_streams`; both engines must set the
    /// same; default 1).
    pub tcp_streams: u16,
    /// Same-host pulls over TCP (`NodeConfig::same_host`, SPEC §9.3; default auto).
    pub same_host: crate::config::SameHost,
    /// Threads that copy same-host pulls (`NodeConfig::pull_threads`;
    /// default 0: half the cores, at most 8).
    pub pull_threads: usize,
}

impl ManagerConfig {
    /// A TCP manager for `role`, with pages of `tokens_per_page` tokens, serving contexts of
    /// up to `max_context_tokens`, authenticated by `auth`.
    pub fn new(role: Role, tokens_per_page: u32, max_context_tokens: u64, auth: Auth) -> Self {
        Self {
            role,
            tokens_per_page,
            max_context_tokens,
            fingerprint: Vec::new(),
            auth,
            transport: TransportConfig::Tcp,
            node_id: 0,
            allow_undersized_pool: false,
            worker_threads: 2,
            call_timeout: Duration::from_secs(30),
            release_timeout: Duration::from_secs(60),
            liveness: None,
            sender: None,
            release_verified: false,
            tcp_streams: 1,
            same_host: crate::config::SameHost::Auto,
            pull_threads: 0,
        }
    }

    /// With this model / tensor-parallel fingerprint.
    pub fn fingerprint(mut self, fingerprint: impl Into<Vec<u8>>) -> Self {
        self.fingerprint = fingerprint.into();
        self
    }

    /// Over this transport.
    pub fn transport(mut self, transport: TransportConfig) -> Self {
        self.transport = transport;
        self
    }

    /// A peer silent for `timeout` is declared lost (heartbeats every eighth of it).
    pub fn liveness_timeout(mut self, timeout: Duration) -> Self {
        self.liveness = Some(LivenessConfig {
            interval: timeout / 8,
            timeout,
        });
        self
    }

    /// Prefill: an opened request waits up to `wait` for its decode's reservation, and a
    /// reservation that came before the request was opened is held up to `parked` (each
    /// bounded further by the reservation's own deadline, SPEC §5.1).
    pub fn reservation_timeouts(mut self, wait: Duration, parked: Duration) -> Self {
        let mut sender = self.sender.take().unwrap_or_default();
        sender.reservation_timeout = wait;
        sender.parked_reservation_timeout = parked;
        self.sender = Some(sender);
        self
    }
}
