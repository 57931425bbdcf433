//! The built-in discovery backends, chosen by configuration ([`DiscoveryBackend`]) and opened
//! by [`connect`].

use std::sync::Arc;
use std::time::Duration;

use super::{Discovery, DiscoveryError, EmbeddedDiscovery};

/// Where a node publishes itself and finds its peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiscoveryBackend {
    /// kvwire's embedded bootstrap server at `host:port` ([`BootstrapServer`](super::BootstrapServer)).
    Bootstrap(String),
    /// etcd at these endpoints, under this key prefix (builds with the feature `etcd`).
    Etcd {
        /// `http://host:port` of each member.
        endpoints: Vec<String>,
        /// The key prefix (`"kvwire"` by default elsewhere).
        prefix: String,
    },
}

/// A client of `backend` whose registrations live `ttl` after their process died (etcd:
/// connects first; a build without the feature `etcd` refuses it).
pub async fn connect(
    backend: &DiscoveryBackend,
    ttl: Duration,
) -> Result<Arc<dyn Discovery>, DiscoveryError> {
    match backend {
        DiscoveryBackend::Bootstrap(server) => Ok(Arc::new(
            EmbeddedDiscovery::from_host(server.clone()).with_ttl(ttl),
        )),
        #[cfg(feature = "etcd")]
        DiscoveryBackend::Etcd { endpoints, prefix } => {
            use super::{EtcdDiscovery, EtcdOptions};
            let options = EtcdOptions::default()
                .with_prefix(prefix.clone())
                .with_ttl(ttl);
            Ok(Arc::new(
                EtcdDiscovery::connect(endpoints.clone(), options).await?,
            ))
        }
        #[cfg(not(feature = "etcd"))]
        DiscoveryBackend::Etcd { .. } => Err(DiscoveryError::Unsupported(
            "this kvwire was built without etcd (build with --features etcd)",
        )),
    }
}
