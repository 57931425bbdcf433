//! A node: one engine's KV memory, registered once, and the configuration every connection
//! it opens is built from.
//!
//! An inference engine owns its KV cache. It registers it with kvwire once
//! ([`Node::with_memory`]), and every connection it opens, to any number of peers, over any
//! transport, leases pages of that one registration: a decode engine with N prefill peers
//! does not split its cache. With RDMA the memory is registered with each device once (one
//! memory region per buffer), on the first connection over that device, and shared by the
//! connections after it; memory windows are still bound per reservation.
//!
//! KV memory may be GPU memory: register device buffers with
//! [`KvMemory::from_buffers_in`] (a [`MemoryKind`](crate::memory::MemoryKind) per buffer, and
//! the device's [`DeviceMemoryOps`](crate::memory::DeviceMemoryOps)). kvwire never dereferences
//! them on the host; TCP moves them through pinned staging buffers and the receiver digests
//! them in device memory (docs/GPU.md). Loopback and RDMA refuse device memory for now.
//!
//! Engines without an allocator of their own let kvwire allocate and choose pages
//! ([`Node::new`]; the embedded page pool).
//!
//! # The contract with the engine
//!
//! * kvwire writes only pages leased to an open reservation (a decode-side transfer that
//!   reserved them and has not fenced yet); it reads only pages leased to an outgoing
//!   transfer (or to a verified one the engine still holds).
//! * The engine may read any page at any time. A page leased to an open reservation reads
//!   as unspecified bytes until its transfer is verified.
//! * The engine must not write a page kvwire holds, and must not reuse (free) one:
//!   [`PagePool::holders`] says which transfer holds a page, and
//!   [`PagePool::check_engine_free`] refuses a free of a held page with a typed error.
//!
//! A node is cheap to clone (one shared registration).

use std::sync::Arc;

use super::{EngineError, Rooms};
use crate::config::NodeConfig;
use crate::memory::{KvMemory, PagePool};

/// One engine's registered KV memory and configuration, shared by all its connections.
#[derive(Clone, Debug)]
pub struct Node {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: NodeConfig,
    pool: Arc<PagePool>,
    /// Extra TCP streams joining the node's connections (`NodeConfig::tcp_streams`).
    joins: super::streams::Joins,
    /// Which decode peer named each request not opened yet (its sender connections report).
    rooms: Arc<Rooms>,
    /// The threads that copy same-host pulls (`NodeConfig::pull_threads`), started when the
    /// first connection pulls and shared by all (`None` inside: one thread asked for, or
    /// the OS refused one).
    pull_threads: std::sync::OnceLock<Option<Arc<crate::transport::tcp::PullThreads>>>,
    #[cfg(feature = "rdma")]
    rdma: std::sync::Mutex<Vec<rdma::Registration>>,
}

impl Node {
    /// A node whose KV memory kvwire allocates (zeroed, faulted in) for `config.pool`, with
    /// kvwire's page pool choosing pages.
    ///
    /// Fails like [`Node::with_memory`], and when the memory cannot be allocated.
    pub fn new(config: NodeConfig) -> Result<Self, EngineError> {
        let memory = KvMemory::allocate(&config.pool)?;
        Self::with_memory(config, memory)
    }

    /// Registers the engine's own KV memory ([`KvMemory::from_raw_parts`] over its cache,
    /// or [`KvMemory::from_buffers`]), which must have exactly the geometry of
    /// `config.pool`.
    ///
    /// The registration states the engine's served context length
    /// (`config.engine.max_context_tokens`): a memory that cannot hold it (pages × tokens
    /// per page below it) is refused with
    /// [`ConfigError::PoolSmallerThanContext`](crate::ConfigError::PoolSmallerThanContext),
    /// naming both numbers, unless the configuration explicitly allows an undersized pool.
    pub fn with_memory(config: NodeConfig, memory: KvMemory) -> Result<Self, EngineError> {
        let pool = PagePool::with_memory(config.pool.clone(), memory, config.scrub)?;
        config.engine.validate(&pool)?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                pool: Arc::new(pool),
                joins: Default::default(),
                rooms: Arc::default(),
                pull_threads: std::sync::OnceLock::new(),
                #[cfg(feature = "rdma")]
                rdma: std::sync::Mutex::new(Vec::new()),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &NodeConfig {
        &self.inner.config
    }

    /// The page pool over the node's memory: which pages kvwire holds and for which
    /// transfer ([`PagePool::holders`], [`PagePool::held_pages`]), the engine's free check
    /// ([`PagePool::check_engine_free`]), counters.
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.inner.pool
    }

    /// Which decode peer named each request this (prefill) node has not opened yet: where
    /// the request's KV goes ([`Rooms`]).
    pub fn rooms(&self) -> &Arc<Rooms> {
        &self.inner.rooms
    }

    /// The admission policy of this node's connections (its pool, context length and page
    /// size): what a prefill checks a request against before it reaches a transfer.
    pub fn admission_policy(&self) -> kvwire_proto::admission::AdmissionPolicy {
        crate::sender::admission_policy(self.pool(), &self.config().engine)
    }

    /// The node's pull threads (`NodeConfig::pull_threads`), started on first use and
    /// shared by every connection that pulls: `None` where pulls run on each connection's
    /// task.
    pub(crate) fn pull_threads(&self) -> Option<Arc<crate::transport::tcp::PullThreads>> {
        self.inner
            .pull_threads
            .get_or_init(|| {
                crate::transport::tcp::PullThreads::configured(self.inner.config.pull_threads)
            })
            .clone()
    }

    /// Where the extra TCP streams of the node's connections wait to be claimed.
    pub(crate) fn joins(&self) -> &super::streams::Joins {
        &self.inner.joins
    }

    /// The node's memory registered with RDMA `device` (or the first device): opened and
    /// registered on first use, shared by every later connection over that device.
    #[cfg(feature = "rdma")]
    pub(crate) fn rdma(&self, device: Option<&str>) -> Result<rdma::Registration, EngineError> {
        let mut cache = self.inner.rdma.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = cache.iter().find(|r| r.asked == device.map(str::to_owned)) {
            return Ok(r.clone());
        }
        let r = rdma::Registration::open(device, &self.inner.pool)?;
        cache.push(r.clone());
        Ok(r)
    }
}

#[cfg(feature = "rdma")]
pub(crate) mod rdma {
    use std::sync::Arc;

    use crate::engine::EngineError;
    use crate::memory::PagePool;
    use crate::transport::rdma::{RdmaDevice, RegisteredMemory};

    /// An RDMA device and the node's memory registered with it.
    #[derive(Clone)]
    pub(crate) struct Registration {
        /// The device name the node was asked for (`None`: the first).
        pub(crate) asked: Option<String>,
        pub(crate) device: Arc<RdmaDevice>,
        pub(crate) memory: Arc<RegisteredMemory>,
    }

    impl std::fmt::Debug for Registration {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Registration")
                .field("device", &self.device.name)
                .finish_non_exhaustive()
        }
    }

    impl Registration {
        pub(crate) fn open(device: Option<&str>, pool: &PagePool) -> Result<Self, EngineError> {
            let dev = Arc::new(RdmaDevice::open(device).map_err(transport)?);
            let memory = Arc::new(dev.register(pool.memory()).map_err(transport)?);
            Ok(Self {
                asked: device.map(str::to_owned),
                device: dev,
                memory,
            })
        }
    }

    pub(crate) fn transport(
        e: impl Into<crate::transport::rdma::bootstrap::BootstrapError>,
    ) -> EngineError {
        super::super::SetupError::Rdma(e.into()).into()
    }
}
