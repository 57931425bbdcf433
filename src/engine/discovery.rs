//! Peer discovery from the engine API: a [`Node`] publishes itself (its address, rank, layout
//! fingerprint and transport) and finds its peers, a peer whose layout fingerprint differs
//! from its own refused before anyone dials it (fail closed). Any [`Discovery`] serves: the
//! embedded bootstrap server's client, etcd (feature `etcd`), or one of the engine's own
//! ([`connect`](crate::discovery::connect) opens the built-in ones by
//! [`DiscoveryBackend`](crate::discovery::DiscoveryBackend)).

use super::Node;
use crate::config::TransportConfig;
use crate::discovery::{
    node_layout_fingerprint, Discovery, DiscoveryError, PeerQuery, PeerRecord, Registration, Role,
};

impl Node {
    /// The fingerprint of this node's KV layout and model fingerprint, as discovery records
    /// carry it.
    pub fn layout_fingerprint(&self) -> String {
        node_layout_fingerprint(self.config())
    }

    /// This node's record: engine rank `rank` of `role` in `cluster`, reachable at
    /// `address`, with its node id, layout fingerprint and transport.
    pub fn peer_record(
        &self,
        cluster: &str,
        role: Role,
        rank: u32,
        address: impl Into<String>,
    ) -> PeerRecord {
        let config = self.config();
        let mut record = PeerRecord::new(cluster, role, rank, config.node_id, address.into())
            .with_layout_of(config);
        if matches!(config.transport, TransportConfig::Rdma { .. }) {
            record.transport = "rdma".to_owned();
        }
        record
    }

    /// Publishes this node ([`Node::peer_record`]) with `discovery`: the record lives while
    /// the returned [`Registration`] does (refreshed), and expires the discovery's TTL after
    /// the process died.
    pub async fn register(
        &self,
        discovery: &dyn Discovery,
        cluster: &str,
        role: Role,
        rank: u32,
        address: impl Into<String>,
    ) -> Result<Registration, DiscoveryError> {
        discovery
            .register(self.peer_record(cluster, role, rank, address))
            .await
    }

    /// The peers `query` selects, by rank and, within a rank, the newest registration first
    /// (a node restarted under a new node id comes before its dead predecessor's record, which
    /// stays until its TTL runs out). With `check_layout`, a peer whose layout fingerprint
    /// differs from this node's fails the call with [`DiscoveryError::LayoutMismatch`]
    /// instead of being returned.
    pub async fn resolve(
        &self,
        discovery: &dyn Discovery,
        query: PeerQuery,
        check_layout: bool,
    ) -> Result<Vec<PeerRecord>, DiscoveryError> {
        let found = discovery.resolve(query).await?;
        if check_layout {
            let mine = self.layout_fingerprint();
            for r in &found {
                r.check_layout(&mine)?;
            }
        }
        Ok(found)
    }
}
