//! Engine configuration and the invariants checked against the running engine.
//!
//! The incident kvwire answers began with a KV pool (sized at start from free GPU memory)
//! that was smaller than the configured maximum context length, and nothing noticed. Here the
//! check is made against the pool *as built*, not against the numbers that were configured
//! for it: call [`EngineConfig::validate`] at start and on every reconfiguration, and refuse
//! to serve when it fails.

pub mod auth;
pub mod file;
mod node;

pub use node::{
    random_bytes, Auth, NodeConfig, NodeConfigBuilder, SameHost, TransportConfig, ACK_TIMEOUTS,
    DEFAULT_ACK_TIMEOUT, DEFAULT_STRIPE_PAGES, MAX_QUEUE_PAIRS, MAX_STREAMS,
};

use std::fmt;

use crate::memory::PagePool;

/// The engine-level settings the pool must be able to honour.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineConfig {
    /// The longest context (prompt plus generated tokens) the engine advertises.
    pub max_context_tokens: u64,
    /// Start anyway (with a loud warning) when the pool cannot hold one maximum-length
    /// context. Such requests must then be rejected at admission; never set this to paper
    /// over a sizing mistake.
    pub allow_undersized_pool: bool,
}

/// A configuration the engine must not start (or keep running) with.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// The pool cannot hold even one maximum-length context.
    #[error(
        "KV pool holds {pool_tokens} tokens ({pages} pages x {tokens_per_page} tokens/page) \
         but the configured maximum context length is {context_tokens} tokens; a request \
         longer than the pool can never be served. Grow the pool or lower the context length \
         (or set allow_undersized_pool to downgrade this to a warning)"
    )]
    PoolSmallerThanContext {
        /// Tokens the pool holds, as built.
        pool_tokens: u64,
        /// The configured maximum context length.
        context_tokens: u64,
        /// Pages in the pool, as built.
        pages: u32,
        /// Tokens per page, as built.
        tokens_per_page: u32,
    },
    /// The configuration is inconsistent in another way (named).
    #[error("invalid configuration: {0}")]
    Invalid(String),
    /// The maximum context length is zero: no request could ever be served.
    #[error(
        "the configured maximum context length is 0 tokens; no request could ever be served. \
         Set max_context_tokens to the longest context the engine advertises"
    )]
    ZeroContext,
    /// The pool's geometry differs from the KV layout this node negotiated at the handshake:
    /// transfers would fail on counts or digests (or worse) instead of at start.
    #[error(
        "KV pool geometry ({pool_tokens_per_page} tokens/page, page bytes per buffer \
         {pool_page_bytes:?}) differs from the negotiated layout ({layout_tokens_per_page} \
         tokens/page, {layout_page_bytes:?})"
    )]
    PoolLayoutMismatch {
        /// Tokens per page of the pool.
        pool_tokens_per_page: u32,
        /// Bytes per page of each of the pool's buffers.
        pool_page_bytes: Vec<u32>,
        /// Tokens per page of the negotiated layout.
        layout_tokens_per_page: u32,
        /// Bytes per page of each buffer in the negotiated layout.
        layout_page_bytes: Vec<u32>,
    },
}

/// Checks that a pool, as built, has exactly the geometry of the KV layout negotiated at the
/// handshake (tokens per page, buffer count, bytes per page of each buffer).
pub fn check_layout(
    pool: &PagePool,
    layout: &kvwire_proto::wire::KvLayout,
) -> Result<(), ConfigError> {
    let g = pool.geometry();
    if g.tokens_per_page == layout.tokens_per_page
        && g.buffer_page_bytes == layout.buffer_page_bytes
    {
        return Ok(());
    }
    Err(ConfigError::PoolLayoutMismatch {
        pool_tokens_per_page: g.tokens_per_page,
        pool_page_bytes: g.buffer_page_bytes.clone(),
        layout_tokens_per_page: layout.tokens_per_page,
        layout_page_bytes: layout.buffer_page_bytes.clone(),
    })
}

/// A configuration problem the engine was told to tolerate; it still starts, loudly.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigWarning {
    /// The pool cannot hold one maximum-length context, and `allow_undersized_pool` is set.
    PoolSmallerThanContext {
        /// Tokens the pool holds, as built.
        pool_tokens: u64,
        /// The configured maximum context length.
        context_tokens: u64,
    },
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigWarning::PoolSmallerThanContext {
                pool_tokens,
                context_tokens,
            } => write!(
                f,
                "KV pool holds {pool_tokens} tokens but the configured maximum context length \
                 is {context_tokens} tokens (allowed by allow_undersized_pool): requests longer \
                 than {pool_tokens} tokens must be rejected at admission"
            ),
        }
    }
}

impl EngineConfig {
    /// A configuration advertising `max_context_tokens`, refusing an undersized pool.
    pub fn new(max_context_tokens: u64) -> Self {
        Self {
            max_context_tokens,
            allow_undersized_pool: false,
        }
    }

    /// Validated from the pool AS BUILT (not from configured numbers): the check the
    /// incident lacked. Call it at start and on every reconfiguration.
    ///
    /// Fails with [`ConfigError::PoolSmallerThanContext`] when the pool holds fewer tokens
    /// than `max_context_tokens` (a pool of exactly that size passes), unless
    /// `allow_undersized_pool` is set: then it logs a `tracing` warning with both numbers
    /// and returns [`ConfigWarning::PoolSmallerThanContext`].
    pub fn validate(&self, pool: &PagePool) -> Result<Vec<ConfigWarning>, ConfigError> {
        self.validate_geometry(pool.geometry())
    }

    /// The same check against the geometry a pool is (or will be) built from, without
    /// allocating it: what `kvwire check-config` runs before a deploy.
    pub fn validate_geometry(
        &self,
        geometry: &crate::memory::PoolGeometry,
    ) -> Result<Vec<ConfigWarning>, ConfigError> {
        if self.max_context_tokens == 0 {
            return Err(ConfigError::ZeroContext);
        }
        let mut warnings = Vec::new();
        let pool_tokens = geometry.capacity_tokens();
        let context_tokens = self.max_context_tokens;
        if pool_tokens < context_tokens {
            if !self.allow_undersized_pool {
                return Err(ConfigError::PoolSmallerThanContext {
                    pool_tokens,
                    context_tokens,
                    pages: geometry.pages,
                    tokens_per_page: geometry.tokens_per_page,
                });
            }
            let warning = ConfigWarning::PoolSmallerThanContext {
                pool_tokens,
                context_tokens,
            };
            tracing::warn!(
                pool_tokens,
                context_tokens,
                pages = geometry.pages,
                tokens_per_page = geometry.tokens_per_page,
                "UNDERSIZED KV POOL: {warning}"
            );
            warnings.push(warning);
        }
        Ok(warnings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{PoolGeometry, Scrub};
    use std::sync::{Arc, Mutex};
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::subscriber::Interest;
    use tracing::{Event, Level, Metadata, Subscriber};

    fn pool(pages: u32, tokens_per_page: u32) -> PagePool {
        PagePool::new(
            PoolGeometry {
                tokens_per_page,
                buffer_page_bytes: vec![1],
                pages,
            },
            Scrub::None,
        )
        .unwrap()
    }

    /// Records every event's level and fields, rendered as `name=value` text.
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<(Level, String)>>>);

    struct Fields(String);
    impl Visit for Fields {
        fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
            self.0.push_str(&format!("{}={:?} ", field.name(), value));
        }
    }

    impl Subscriber for Capture {
        fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
            Interest::always()
        }
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            let mut fields = Fields(String::new());
            event.record(&mut fields);
            self.0
                .lock()
                .unwrap()
                .push((*event.metadata().level(), fields.0));
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    #[test]
    fn pool_smaller_than_context_refuses_to_start() {
        let p = pool(100, 16); // 1600 tokens
        let err = EngineConfig::new(4096).validate(&p).unwrap_err();
        assert_eq!(
            err,
            ConfigError::PoolSmallerThanContext {
                pool_tokens: 1600,
                context_tokens: 4096,
                pages: 100,
                tokens_per_page: 16
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("1600") && msg.contains("4096"), "{msg}");
        assert!(msg.contains("100 pages x 16 tokens/page"), "{msg}");
    }

    #[test]
    fn one_token_short_refuses() {
        let p = pool(100, 16);
        assert!(matches!(
            EngineConfig::new(1601).validate(&p),
            Err(ConfigError::PoolSmallerThanContext { .. })
        ));
    }

    #[test]
    fn exact_capacity_passes() {
        let p = pool(100, 16);
        assert_eq!(EngineConfig::new(1600).validate(&p), Ok(vec![]));
        assert_eq!(EngineConfig::new(1).validate(&p), Ok(vec![]));
    }

    #[test]
    fn zero_context_is_refused() {
        let p = pool(1, 1);
        let err = EngineConfig::new(0).validate(&p).unwrap_err();
        assert_eq!(err, ConfigError::ZeroContext);
        assert!(err.to_string().contains("0 tokens"));
    }

    #[test]
    fn override_returns_warning_and_logs_it_loudly() {
        let p = pool(100, 16);
        let config = EngineConfig {
            max_context_tokens: 4096,
            allow_undersized_pool: true,
        };
        let capture = Capture::default();
        let result = tracing::subscriber::with_default(capture.clone(), || config.validate(&p));
        assert_eq!(
            result,
            Ok(vec![ConfigWarning::PoolSmallerThanContext {
                pool_tokens: 1600,
                context_tokens: 4096
            }])
        );
        let events = capture.0.lock().unwrap();
        let warn = events
            .iter()
            .find(|(level, _)| *level == Level::WARN)
            .unwrap_or_else(|| panic!("no warning logged: {events:?}"));
        assert!(warn.1.contains("pool_tokens=1600"), "{}", warn.1);
        assert!(warn.1.contains("context_tokens=4096"), "{}", warn.1);
        let text = result.unwrap()[0].to_string();
        assert!(text.contains("1600") && text.contains("4096"), "{text}");
    }

    #[test]
    fn override_is_silent_when_pool_is_big_enough() {
        let p = pool(256, 16);
        let config = EngineConfig {
            max_context_tokens: 4096,
            allow_undersized_pool: true,
        };
        let capture = Capture::default();
        let result = tracing::subscriber::with_default(capture.clone(), || config.validate(&p));
        assert_eq!(result, Ok(vec![]));
        assert!(capture.0.lock().unwrap().is_empty());
    }

    #[test]
    fn validates_the_pool_as_built() {
        // The check reads the built pool's geometry: a pool that came out smaller than
        // planned is caught even though the plan would have passed.
        let planned = PoolGeometry {
            tokens_per_page: 16,
            buffer_page_bytes: vec![1],
            pages: 256,
        };
        assert!(planned.capacity_tokens() >= 4096);
        let built = pool(255, 16);
        assert!(EngineConfig::new(4096).validate(&built).is_err());
    }

    /// A node config over RDMA with these queue pairs and ACK timeout, as built.
    fn rdma_config(queue_pairs: u16, ack_timeout: u8) -> Result<NodeConfig, ConfigError> {
        let geometry = PoolGeometry {
            tokens_per_page: 16,
            buffer_page_bytes: vec![1],
            pages: 256,
        };
        NodeConfig::builder(geometry, 4096)
            .auth(Auth::Off)
            .transport(TransportConfig::Rdma {
                devices: Vec::new(),
                queue_pairs,
                busy_poll: false,
                ack_timeout,
                stripe_pages: DEFAULT_STRIPE_PAGES,
                rail_affinity: true,
            })
            .build()
    }

    /// Queue pairs beyond what a HELLO can list (or none) are refused when the config is
    /// built, naming the count, instead of failing the handshake of every connection.
    #[test]
    fn the_rdma_queue_pair_count_is_checked_when_built() {
        let with = |queue_pairs: u16| rdma_config(queue_pairs, DEFAULT_ACK_TIMEOUT);
        // The bound is the HELLO's: 4-byte header plus 28 bytes per queue pair.
        let params = |n: usize| 4 + 28 * n;
        let max = usize::from(MAX_QUEUE_PAIRS);
        assert!(params(max) <= kvwire_proto::wire::MAX_TRANSPORT_PARAMS);
        assert!(params(max + 1) > kvwire_proto::wire::MAX_TRANSPORT_PARAMS);
        for ok in [1, 2, MAX_QUEUE_PAIRS] {
            assert!(with(ok).is_ok(), "queue_pairs {ok}");
        }
        for bad in [0, MAX_QUEUE_PAIRS + 1, u16::MAX] {
            match with(bad) {
                Err(ConfigError::Invalid(m)) => {
                    assert!(m.contains(&format!("queue_pairs = {bad}")), "{m}")
                }
                other => panic!("queue_pairs {bad}: {other:?}"),
            }
        }
    }

    /// Several devices are several rails: named in one comma-separated string (as Mooncake's
    /// `ib_device`), each needs a queue pair, and a device named twice is refused.
    #[test]
    fn rdma_rails_are_parsed_and_checked_when_built() {
        let t = TransportConfig::rdma_devices(" rxe0, rxe1 ,", 1);
        assert_eq!(t, TransportConfig::rdma_rails(&["rxe0", "rxe1"]));
        assert!(
            matches!(&t, TransportConfig::Rdma { devices, queue_pairs: 2, .. } if devices.len() == 2)
        );
        assert!(matches!(
            TransportConfig::rdma_devices("rxe0,rxe1", 6),
            TransportConfig::Rdma { queue_pairs: 6, .. }
        ));
        assert_eq!(
            TransportConfig::rdma_devices("", 1),
            TransportConfig::rdma(None)
        );
        let build = |t: TransportConfig| {
            let geometry = PoolGeometry {
                tokens_per_page: 16,
                buffer_page_bytes: vec![1],
                pages: 256,
            };
            NodeConfig::builder(geometry, 4096)
                .auth(Auth::Off)
                .transport(t)
                .build()
        };
        assert!(build(TransportConfig::rdma_rails(&["rxe0", "rxe1"])).is_ok());
        let mut too_few = TransportConfig::rdma_rails(&["rxe0", "rxe1", "rxe2"]);
        if let TransportConfig::Rdma { queue_pairs, .. } = &mut too_few {
            *queue_pairs = 2;
        }
        match build(too_few) {
            Err(ConfigError::Invalid(m)) => {
                assert!(m.contains("queue_pairs = 2 for 3 devices"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        // Zero is not raised to one per rail: it is refused (the Python and C fronts pass it on).
        for devices in ["", "rxe0,rxe1"] {
            match build(TransportConfig::rdma_devices(devices, 0)) {
                Err(ConfigError::Invalid(m)) => assert!(m.contains("queue_pairs = 0"), "{m}"),
                other => panic!("{devices}: {other:?}"),
            }
        }
        match build(TransportConfig::rdma_rails(&["rxe0", "rxe1", "rxe0"])) {
            Err(ConfigError::Invalid(m)) => assert!(m.contains("rxe0 is named twice"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_rdma_ack_timeout_is_checked_when_built() {
        // The default is TransportConfig::rdma's.
        assert_eq!(
            TransportConfig::rdma(None),
            rdma_config(1, DEFAULT_ACK_TIMEOUT).unwrap().transport
        );
        let with = |ack: Option<u8>| rdma_config(1, ack.unwrap_or(DEFAULT_ACK_TIMEOUT));
        let default = with(None).unwrap();
        assert!(matches!(
            default.transport,
            TransportConfig::Rdma {
                ack_timeout: DEFAULT_ACK_TIMEOUT,
                ..
            }
        ));
        assert_eq!(
            DEFAULT_ACK_TIMEOUT, 14,
            "ib_write_bw's default, which the lane compares with"
        );
        for ok in [1, 18, 31] {
            assert!(with(Some(ok)).is_ok(), "ack_timeout {ok}");
        }
        for bad in [0, 32, u8::MAX] {
            match with(Some(bad)) {
                Err(ConfigError::Invalid(m)) => assert!(m.contains("ack_timeout"), "{m}"),
                other => panic!("ack_timeout {bad}: {other:?}"),
            }
        }
    }
}
