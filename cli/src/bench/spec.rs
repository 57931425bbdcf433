//! What a bench run is asked to do ([`BenchSpec`]) and what it reports ([`CaseResult`],
//! [`Report`]).

use std::sync::Arc;

use kvwire::proto::wire::DigestAlgorithm;
use serde::Serialize;
use std::collections::BTreeMap;

use kvwire::checksum::DigestMode;
use kvwire::config::{EngineConfig, TransportConfig};
use kvwire::memory::PoolGeometry;
use kvwire::NodeConfig;

/// The transport a bench runs over.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchTransport {
    /// TCP (the embedded default).
    Tcp,
    /// RDMA RC queue pairs.
    Rdma {
        /// The device (default: the first one), or several comma-separated (one rail each).
        device: Option<String>,
        /// Queue pairs per connection.
        queue_pairs: u16,
        /// Busy-poll the completion queues.
        busy_poll: bool,
        /// The queue pairs' local ACK timeout exponent.
        ack_timeout: u8,
        /// Pages per stripe at the decode (0: never striped).
        stripe_pages: u32,
        /// The decode keeps to the rails on its memory's NUMA node.
        rail_affinity: bool,
    },
    /// The in-process loopback wire.
    Loopback,
}

impl BenchTransport {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Rdma { .. } => "rdma",
            Self::Loopback => "loopback",
        }
    }
}

/// How transfers are verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verify {
    /// XXH3-64 page digests (the default).
    Xxh3,
    /// CRC-32 page digests.
    Crc32,
    /// No digests: **unverified**, only to measure the integrity tax.
    None,
}

/// Whose memory and pages a case moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Workload {
    /// kvwire's page pool chooses the pages on both sides (the default).
    Pool,
    /// Each engine's own registered memory of `memory` bytes, pages its allocator chose
    /// (a random permutation), sent and received in place, or copied in and out with
    /// `copy` (`engine.rs`).
    Engine {
        /// Bytes of KV memory per engine.
        memory: u64,
        /// Copy through kvwire's pool instead of in place (before zero copy).
        copy: bool,
    },
}

/// What to run.
#[derive(Clone, Debug, Serialize)]
pub struct BenchSpec {
    /// Whose memory and pages.
    pub workload: Workload,
    /// Bytes per page per buffer, one case each.
    pub page_sizes: Vec<u32>,
    /// Buffers (e.g. layers x K/V).
    pub buffers: u32,
    /// Pages per transfer.
    pub pages: u32,
    /// Tokens per page.
    pub tokens_per_page: u32,
    /// Payload bytes each case moves (sets the transfer count).
    pub bytes_per_case: u64,
    /// Transfers in flight.
    pub concurrency: u32,
    /// Verification.
    pub verify: Verify,
    /// Compare every delivered byte with what the sender wrote, too.
    pub check_bytes: bool,
    /// Transfers of at least this many bytes are digested on the blocking pool (`None`: the
    /// transport's threshold).
    pub digest_offload_bytes: Option<u64>,
    /// `NodeConfig::digest_threads` of both nodes.
    pub digest_threads: usize,
    /// `NodeConfig::tcp_streams` of both nodes.
    pub tcp_streams: u16,
    /// `NodeConfig::same_host` of both nodes (same-host pulls over TCP, SPEC §9.3).
    #[serde(serialize_with = "serialize_same_host")]
    pub same_host: kvwire::SameHost,
    /// `NodeConfig::pull_threads` of both nodes (threads copying one connection's pulls).
    pub pull_threads: usize,
    /// Receivers digest pages as they land (TCP, loopback); false: after the fence.
    pub digest_at_landing: bool,
    /// Senders digest pages as they hand them to the transport; false: before the first
    /// write.
    pub digest_while_sending: bool,
    /// Every buffer of the KV memory the run allocates (kvwire's, and the raw baselines')
    /// starts this many bytes past a 4 KiB boundary (0: on one, as `KvMemory::allocate`
    /// places it): to measure memory placed as an engine's allocator places it.
    pub buffer_offset: usize,
    /// Heartbeats of every connection of the run (SPEC §8.3).
    #[serde(skip)]
    pub liveness: kvwire::proto::liveness::LivenessConfig,
    /// Where every connection of the run counts transfers, fences and pages.
    #[serde(skip)]
    pub metrics: Option<Arc<kvwire::metrics::Metrics>>,
    /// Called after every transfer ends (e.g. to advance a progress bar).
    #[serde(skip)]
    pub on_transfer: Option<OnTransfer>,
    /// Peer authentication of every connection (reported as "psk (key id ...)" or "off",
    /// never the key). In one process, an ephemeral key serves both ends.
    #[serde(serialize_with = "serialize_auth")]
    pub auth: kvwire::Auth,
    /// The transport.
    pub transport: BenchTransport,
}

fn serialize_same_host<S: serde::Serializer>(
    m: &kvwire::SameHost,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(match m {
        kvwire::SameHost::Off => "off",
        kvwire::SameHost::Require => "require",
        _ => "auto",
    })
}

fn serialize_auth<S: serde::Serializer>(a: &kvwire::Auth, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&a.describe())
}

/// A callback run after every transfer ends.
#[derive(Clone)]
pub struct OnTransfer(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for OnTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnTransfer")
    }
}

impl Default for BenchSpec {
    fn default() -> Self {
        Self {
            workload: Workload::Pool,
            page_sizes: vec![64 * 1024, 1024 * 1024],
            buffers: 4,
            pages: 8,
            tokens_per_page: 16,
            bytes_per_case: 1 << 30,
            concurrency: 4,
            verify: Verify::Xxh3,
            check_bytes: false,
            digest_offload_bytes: None,
            digest_threads: 1,
            tcp_streams: 1,
            same_host: kvwire::SameHost::Auto,
            pull_threads: 0,
            digest_at_landing: true,
            digest_while_sending: true,
            buffer_offset: 0,
            liveness: kvwire::proto::liveness::LivenessConfig::default(),
            metrics: None,
            on_transfer: None,
            auth: kvwire::Auth::ephemeral(),
            transport: BenchTransport::Tcp,
        }
    }
}

/// One case's figures.
#[derive(Clone, Debug, Serialize)]
pub struct CaseResult {
    /// Bytes per page per buffer.
    pub page_bytes: u32,
    /// Pages per transfer.
    pub pages: u32,
    /// Buffers.
    pub buffers: u32,
    /// Transfers attempted.
    pub transfers: u64,
    /// Transfers in flight.
    pub concurrency: u32,
    /// Payload bytes of verified transfers.
    pub bytes: u64,
    /// Wall time of the case.
    pub seconds: f64,
    /// Verified payload throughput, 10^9 bytes/s.
    pub gb_per_s: f64,
    /// Verified transfers per second.
    pub transfers_per_s: f64,
    /// Median latency, reservation to verified delivery, ms.
    pub p50_ms: f64,
    /// 99th percentile latency, ms.
    pub p99_ms: f64,
    /// 99.9th percentile latency, ms (the slowest transfer when fewer than 1,000 ran).
    pub p999_ms: f64,
    /// CPU-seconds this process used during the case (user + system, every thread; both
    /// roles when both run in this process).
    pub cpu_seconds: f64,
    /// `cpu_seconds` per 10^9 bytes of verified payload.
    pub cpu_s_per_gb: Option<f64>,
    /// Transfers verified (digests over the landed memory matched).
    pub verified: u64,
    /// Transfers whose bytes were compared and matched (`--check-bytes`).
    pub bytes_checked: u64,
    /// Failures by reason (code): transfers that did not deliver.
    pub failures: BTreeMap<String, u64>,
    /// Sender only: transfers whose COMMIT went out and whose verdict never came back, by
    /// what ended the wait (SPEC §7.6: the receiver may have delivered them; only it knows).
    /// Counted apart from the failures, never as one.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub unconfirmed: BTreeMap<String, u64>,
    /// Raw TCP loopback throughput for the same bytes in the same run, 10^9 bytes/s.
    pub raw_gb_per_s: Option<f64>,
    /// `gb_per_s / raw_gb_per_s`.
    pub ratio_to_raw: Option<f64>,
    /// The raw baseline's CPU-seconds per 10^9 bytes, counted the same way.
    pub raw_cpu_s_per_gb: Option<f64>,
    /// `cpu_s_per_gb / raw_cpu_s_per_gb` (1.2 means kvwire spent 20% more CPU per byte).
    pub cpu_ratio_to_raw: Option<f64>,
    /// Engine workload: raw TCP doing the same page writes with the case's requests in flight
    /// (each request acknowledged by one byte once it was read into its pages), 10^9
    /// bytes/s. The streaming baseline above is what the connection carries; this one is what
    /// requests of this size and depth cost with no protocol.
    pub raw_in_flight_gb_per_s: Option<f64>,
    /// `gb_per_s / raw_in_flight_gb_per_s`.
    pub ratio_to_raw_in_flight: Option<f64>,
    /// That baseline's CPU-seconds per 10^9 bytes.
    pub raw_in_flight_cpu_s_per_gb: Option<f64>,
    /// Receiver pool pages free once the case ended (decode side only).
    pub pages_free_after: Option<u32>,
    /// Receiver pool pages in all (decode side only).
    pub pages_total: Option<u32>,
    /// Receiving side: whether the decode copied the pages out of the prefill's memory
    /// (same-host pulls, SPEC §9.3) rather than receiving them on the stream.
    pub same_host_pulls: Option<bool>,
    /// Lanes of the connection that failed during the case and did not end it (RDMA over
    /// several rails, SPEC §9.2): either side.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed_lanes: Option<usize>,
    /// Transfers moved off a failed lane during the case and written again over a live one
    /// (SPEC §9.2, moving a transfer): either side.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moves: Option<u64>,
    /// Reservations the decode striped over several queue pairs during the case (RDMA, SPEC
    /// §9.2, striping a transfer over lanes; `--stripe-pages`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub striped: Option<u64>,
    /// A single-threaded memcpy of the same bytes, page index by page index, between two
    /// buffers of the run's placement, in the same run (the prefill side, TCP only), 10^9
    /// bytes/s: what one copy per byte costs on this host.
    pub memcpy_gb_per_s: Option<f64>,
    /// `gb_per_s` / `memcpy_gb_per_s`.
    pub ratio_to_memcpy: Option<f64>,
    /// Both roles in one process with same-host pulls: the same case again with page bytes
    /// on the TCP stream (`--same-host off`), in the same run, 10^9 bytes/s.
    pub tcp_stream_gb_per_s: Option<f64>,
    /// `gb_per_s` / `tcp_stream_gb_per_s`.
    pub ratio_to_tcp_stream: Option<f64>,
}

/// A whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The spec.
    pub spec: BenchSpec,
    /// The transport.
    pub transport: String,
    /// The cases.
    pub cases: Vec<CaseResult>,
    /// The run's counters, in the Prometheus text format (when metrics were on).
    pub metrics: Option<String>,
    /// Worker threads of the tokio runtime the run used (`--worker-threads`, else one per
    /// core).
    pub worker_threads: usize,
}

impl BenchSpec {
    /// The engine workload's requests in flight, as the raw baseline that keeps them runs
    /// them (`None` for the pool workload).
    pub(super) fn in_flight(&self) -> Option<super::raw::InFlight> {
        match self.workload {
            Workload::Pool => None,
            Workload::Engine { .. } => Some(super::raw::InFlight {
                pages: self.pages as usize,
                depth: self.concurrency.max(1) as usize,
            }),
        }
    }

    pub(super) fn transfer_bytes(&self, page: u32) -> u64 {
        u64::from(page) * u64::from(self.buffers) * u64::from(self.pages)
    }

    /// Transfers in all cases of one run.
    pub fn total_transfers(&self) -> u64 {
        self.page_sizes.iter().map(|&p| self.transfers(p)).sum()
    }

    pub(super) fn transfers(&self, page: u32) -> u64 {
        (self.bytes_per_case / self.transfer_bytes(page)).max(1)
    }

    /// The engine workload's memory per engine (0 for the pool workload).
    pub(super) fn engine_memory(&self) -> u64 {
        match self.workload {
            Workload::Engine { memory, .. } => memory,
            Workload::Pool => 0,
        }
    }

    /// Whether the engine workload copies through kvwire's pool.
    pub(super) fn engine_copy(&self) -> bool {
        matches!(self.workload, Workload::Engine { copy: true, .. })
    }

    /// A node over `config`, its KV memory allocated at the run's `buffer_offset`.
    pub(super) fn node(&self, config: NodeConfig) -> Result<kvwire::engine::Node, String> {
        let memory = kvwire::memory::KvMemory::allocate_at_offset(&config.pool, self.buffer_offset)
            .map_err(|e| e.to_string())?;
        kvwire::engine::Node::with_memory(config, memory).map_err(|e| e.to_string())
    }

    /// The node configuration for one case (both sides use the same one): a pool just
    /// large enough for the transfers in flight.
    pub fn node_config(&self, page: u32) -> NodeConfig {
        self.node_config_with_pages(page, self.pages * self.concurrency * 2)
    }

    /// The node configuration for one case, with a pool of `pages` pages.
    pub(super) fn node_config_with_pages(&self, page: u32, pages: u32) -> NodeConfig {
        let mut c = NodeConfig::example();
        c.pool = PoolGeometry {
            tokens_per_page: self.tokens_per_page,
            buffer_page_bytes: vec![page; self.buffers as usize],
            pages,
        };
        c.engine = EngineConfig::new(u64::from(pages) * u64::from(self.tokens_per_page));
        c.fingerprint = format!("kvwire-bench/{page}x{}x{}", self.buffers, self.pages).into_bytes();
        let (digests, mode) = match self.verify {
            Verify::Xxh3 => (vec![DigestAlgorithm::XXH3_64], DigestMode::Verify),
            Verify::Crc32 => (vec![DigestAlgorithm::CRC32], DigestMode::Verify),
            Verify::None => (
                vec![DigestAlgorithm::XXH3_64],
                DigestMode::UnverifiedBenchmarkOnly,
            ),
        };
        c.digests = digests;
        c.digest_mode = mode;
        c.window = self.pages.max(1);
        // Each decode worker reserves before its prefill counterpart submits: up to
        // `concurrency` reservations can arrive for requests the sender does not know yet
        // (SPEC §5.1); parking fewer would refuse the rest with PARKED_LIMIT.
        c.sender.max_parked = c.sender.max_parked.max(self.concurrency as usize);
        c.metrics = self.metrics.clone();
        c.digest_offload_bytes = self.digest_offload_bytes;
        c.digest_threads = self.digest_threads;
        c.tcp_streams = self.tcp_streams;
        c.same_host = self.same_host;
        c.pull_threads = self.pull_threads;
        c.digest_at_landing = self.digest_at_landing;
        c.digest_while_sending = self.digest_while_sending;
        c.liveness = self.liveness;
        c.auth = self.auth.clone();
        c.transport = match &self.transport {
            BenchTransport::Tcp | BenchTransport::Loopback => TransportConfig::Tcp,
            BenchTransport::Rdma {
                device,
                queue_pairs,
                busy_poll,
                ack_timeout,
                stripe_pages,
                rail_affinity,
            } => TransportConfig::rdma_devices(device.as_deref().unwrap_or(""), *queue_pairs)
                .busy_poll(*busy_poll)
                .ack_timeout(*ack_timeout)
                .stripe_pages(*stripe_pages)
                .rail_affinity(*rail_affinity),
        };
        c
    }

    pub(super) fn tokens(&self) -> u32 {
        self.pages * self.tokens_per_page
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nodes a run builds have their KV memory where `--buffer-offset` puts it (the CLI
    /// test sees only the reported value; this sees the memory).
    #[test]
    fn the_nodes_of_a_run_have_their_memory_at_the_buffer_offset() {
        for offset in [0, 16, 64] {
            let spec = BenchSpec {
                buffer_offset: offset,
                ..BenchSpec::default()
            };
            let node = spec.node(spec.node_config(4096)).unwrap();
            let memory = node.pool().memory();
            for b in 0..spec.buffers as usize {
                let (ptr, _) = memory.region(b).unwrap();
                assert_eq!(ptr.as_ptr() as usize % 4096, offset, "buffer {b}");
            }
        }
    }

    /// Regression: at `--concurrency` above the sender's default `max_parked` (256), the
    /// decode side's reservations for requests the prefill had not submitted yet were refused
    /// with PARKED_LIMIT, each refusal let that decode worker run further ahead, and a 1 GiB
    /// two-process run at 400 in flight failed 247,897 of 262,144 transfers.
    #[test]
    fn the_sender_parks_a_reservation_for_every_transfer_in_flight() {
        for concurrency in [1, 100, 400, 10_000] {
            let spec = BenchSpec {
                concurrency,
                ..BenchSpec::default()
            };
            let parked = spec.node_config(4096).sender.max_parked;
            assert!(parked >= concurrency as usize, "{concurrency}: {parked}");
            assert!(parked >= 256, "never below the default: {parked}");
        }
    }
}
