//! What a node publishes about itself ([`PeerRecord`]), the key it is published under
//! ([`PeerKey`]), what a node asks for ([`PeerQuery`]), and the layout fingerprint that lets a
//! decode node refuse a mismatched prefill node before connecting.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::NodeConfig;
use crate::proto::wire::KvLayout;

use super::DiscoveryError;

/// `transport` of a node that listens for kvwire connections over TCP.
pub const TRANSPORT_TCP: &str = "tcp";
/// `transport` of a node whose connections carry pages over RDMA (TCP bootstrap at
/// `address`).
pub const TRANSPORT_RDMA: &str = "rdma";

/// Longest cluster name (bytes).
pub const MAX_CLUSTER_LEN: usize = 128;
/// Longest `address` (bytes).
pub const MAX_ADDRESS_LEN: usize = 255;
/// Longest `transport` name (bytes).
pub const MAX_TRANSPORT_LEN: usize = 32;
/// Longest `transport_params` (bytes).
pub const MAX_TRANSPORT_PARAMS_LEN: usize = 8192;
/// Longest `layout_fingerprint` (hex digits).
pub const MAX_FINGERPRINT_LEN: usize = 128;
/// Most entries in `extra`.
pub const MAX_EXTRA_ENTRIES: usize = 64;
/// Longest key of an `extra` entry (bytes).
pub const MAX_EXTRA_KEY_LEN: usize = 128;
/// Longest value of an `extra` entry (bytes).
pub const MAX_EXTRA_VALUE_LEN: usize = 1024;

/// The role a node plays in disaggregated inference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Runs prefill and sends KV pages (a kvwire sender).
    Prefill,
    /// Runs decode and receives KV pages into its own memory (a kvwire receiver).
    Decode,
}

impl Role {
    /// The lower-case name used in JSON, etcd keys and URLs: `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = DiscoveryError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(DiscoveryError::InvalidQuery(format!(
                "role {other:?} is neither \"prefill\" nor \"decode\""
            ))),
        }
    }
}

/// What a node publishes about itself: where it listens and what it can exchange.
///
/// Serialised as JSON (the bootstrap server's bodies, etcd values). Unknown fields are
/// ignored when reading, so newer nodes can add fields. A record is identified by its
/// [`PeerKey`] (cluster, role, engine rank, node id): registering a record with the key of
/// another one replaces it. Records of one role and rank under different node ids co-exist
/// (a node restarted under a new id before its predecessor's record expired, two nodes of a
/// rank during a rolling restart); resolving them gives the newest registration first
/// ([`PeerRecord::registered`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PeerRecord {
    /// The node's id (kvwire's `NodeConfig::node_id`), unique within its cluster and role.
    pub node_id: u64,
    /// Prefill or decode.
    pub role: Role,
    /// The rank of the engine instance this node belongs to.
    pub engine_rank: u32,
    /// Data-parallel rank, if the engine has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    /// Tensor-parallel rank, if the engine has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_rank: Option<u32>,
    /// `host:port` where the node accepts kvwire connections.
    pub address: String,
    /// The transport: [`TRANSPORT_TCP`] or [`TRANSPORT_RDMA`] (other lower-case names are
    /// accepted for forward compatibility).
    pub transport: String,
    /// Transport parameters, opaque to discovery (e.g. hex); may be empty.
    #[serde(default)]
    pub transport_params: String,
    /// Lower-case hex digest of the KV layout and model fingerprint ([`layout_fingerprint`]);
    /// see [`PeerRecord::check_layout`].
    #[serde(default)]
    pub layout_fingerprint: String,
    /// The namespace the node belongs to (`[A-Za-z0-9._-]`, not `.` or `..`).
    pub cluster: String,
    /// Free-form extra attributes.
    #[serde(default)]
    pub extra: BTreeMap<String, String>,
    /// When the backend took this registration, as an order: of two records one backend
    /// returns, the one with the larger value was registered later, and
    /// [`Discovery::resolve`](super::Discovery::resolve) puts the newest registration of
    /// each role and rank first ([`sort_newest_first`]). Set by the backend, never by the
    /// node (what is passed to `register` is ignored): the embedded bootstrap server writes
    /// the time it took the registration, in Unix milliseconds on its own clock (strictly
    /// increasing; a record re-created after a server restart keeps its age), etcd the key's
    /// modification revision. Compare it only between records of one backend. 0 where the
    /// backend did not say (a bootstrap server older than this field); absent from the JSON
    /// when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub registered: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Puts records in the order [`Discovery::resolve`](super::Discovery::resolve) returns them:
/// by cluster, role and engine rank, and within one rank the newest registration first
/// (larger [`PeerRecord::registered`]), then by node id. A node restarted under a new node id
/// while its predecessor's record has not expired yet is first of its rank at once; so is a
/// node registered during a rolling restart while the one it replaces still runs. For
/// records collected from a [`PeerWatch`](super::PeerWatch).
pub fn sort_newest_first(records: &mut [PeerRecord]) {
    records.sort_by(|a, b| {
        (&a.cluster, a.role, a.engine_rank)
            .cmp(&(&b.cluster, b.role, b.engine_rank))
            .then(b.registered.cmp(&a.registered))
            .then(a.node_id.cmp(&b.node_id))
    });
}

impl PeerRecord {
    /// A record for a node listening at `address` over TCP, with no ranks beyond the engine
    /// rank, no transport parameters, no layout fingerprint and no extras (set the public
    /// fields to add them).
    pub fn new(
        cluster: impl Into<String>,
        role: Role,
        engine_rank: u32,
        node_id: u64,
        address: impl Into<String>,
    ) -> Self {
        PeerRecord {
            node_id,
            role,
            engine_rank,
            dp_rank: None,
            tp_rank: None,
            address: address.into(),
            transport: TRANSPORT_TCP.to_owned(),
            transport_params: String::new(),
            layout_fingerprint: String::new(),
            cluster: cluster.into(),
            extra: BTreeMap::new(),
            registered: 0,
        }
    }

    /// The key this record is registered under.
    pub fn key(&self) -> PeerKey {
        PeerKey {
            cluster: self.cluster.clone(),
            role: self.role,
            engine_rank: self.engine_rank,
            node_id: self.node_id,
        }
    }

    /// Sets [`PeerRecord::layout_fingerprint`] to the fingerprint of `config`'s KV layout
    /// and model fingerprint ([`node_layout_fingerprint`]).
    pub fn with_layout_of(mut self, config: &NodeConfig) -> Self {
        self.layout_fingerprint = node_layout_fingerprint(config);
        self
    }

    /// Refuses a peer whose layout fingerprint is not `expected` (the caller's own,
    /// [`node_layout_fingerprint`]); an empty fingerprint on either side is a mismatch (fail
    /// closed). Meant for a decode node before it connects to a prefill node it resolved;
    /// the handshake still checks the layout itself.
    pub fn check_layout(&self, expected: &str) -> Result<(), DiscoveryError> {
        if !expected.is_empty() && self.layout_fingerprint.eq_ignore_ascii_case(expected) {
            return Ok(());
        }
        Err(DiscoveryError::LayoutMismatch {
            peer: self.key(),
            expected: expected.to_owned(),
            found: self.layout_fingerprint.clone(),
        })
    }

    /// Checks the record's fields against the limits above (cluster name characters,
    /// `host:port` address, lower-case transport name, hex fingerprint, sizes).
    pub fn validate(&self) -> Result<(), DiscoveryError> {
        let bad = |msg: String| Err(DiscoveryError::InvalidRecord(msg));
        check_cluster(&self.cluster).map_err(DiscoveryError::InvalidRecord)?;
        check_address(&self.address).map_err(DiscoveryError::InvalidRecord)?;
        if self.transport.is_empty()
            || self.transport.len() > MAX_TRANSPORT_LEN
            || !self
                .transport
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        {
            return bad(format!(
                "transport {:?} is not a lower-case name of 1..={MAX_TRANSPORT_LEN} characters \
                 (\"tcp\" or \"rdma\")",
                self.transport
            ));
        }
        if self.transport_params.len() > MAX_TRANSPORT_PARAMS_LEN {
            return bad(format!(
                "transport_params is {} bytes, over the limit of {MAX_TRANSPORT_PARAMS_LEN}",
                self.transport_params.len()
            ));
        }
        if self.layout_fingerprint.len() > MAX_FINGERPRINT_LEN
            || !self
                .layout_fingerprint
                .bytes()
                .all(|b| b.is_ascii_hexdigit())
        {
            return bad(format!(
                "layout_fingerprint {:?} is not hex of at most {MAX_FINGERPRINT_LEN} digits",
                self.layout_fingerprint
            ));
        }
        if self.extra.len() > MAX_EXTRA_ENTRIES {
            return bad(format!(
                "extra has {} entries, over the limit of {MAX_EXTRA_ENTRIES}",
                self.extra.len()
            ));
        }
        for (k, v) in &self.extra {
            if k.is_empty() || k.len() > MAX_EXTRA_KEY_LEN || v.len() > MAX_EXTRA_VALUE_LEN {
                return bad(format!(
                    "extra entry {k:?}: keys are 1..={MAX_EXTRA_KEY_LEN} bytes, values at most \
                     {MAX_EXTRA_VALUE_LEN}"
                ));
            }
        }
        Ok(())
    }
}

/// The identity of a registration: a record registered under the key of another replaces it.
/// Its path form is `<cluster>/<role>/<engine_rank>/<node_id>` (the etcd key below the
/// prefix, the bootstrap server's URL path below `/v1/peers/`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PeerKey {
    /// The record's cluster.
    pub cluster: String,
    /// The record's role.
    pub role: Role,
    /// The record's engine rank.
    pub engine_rank: u32,
    /// The record's node id.
    pub node_id: u64,
}

impl PeerKey {
    /// Parses the path form `<cluster>/<role>/<engine_rank>/<node_id>`.
    pub fn parse_path(path: &str) -> Result<Self, DiscoveryError> {
        let bad =
            || DiscoveryError::InvalidQuery(format!("{path:?} is not cluster/role/rank/node"));
        let mut parts = path.split('/');
        let (Some(cluster), Some(role), Some(rank), Some(node), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(bad());
        };
        check_cluster(cluster).map_err(DiscoveryError::InvalidQuery)?;
        Ok(PeerKey {
            cluster: cluster.to_owned(),
            role: role.parse()?,
            engine_rank: parse_decimal(rank).ok_or_else(bad)?,
            node_id: parse_decimal(node).ok_or_else(bad)?,
        })
    }
}

impl fmt::Display for PeerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}",
            self.cluster, self.role, self.engine_rank, self.node_id
        )
    }
}

/// Plain decimal digits only (no sign, no spaces), as written by `Display` for integers.
pub(crate) fn parse_decimal<T: FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Which records to resolve or watch: every record of a cluster, optionally only one role,
/// optionally only one engine rank.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerQuery {
    /// The cluster to look in.
    pub cluster: String,
    /// Only this role, if set.
    pub role: Option<Role>,
    /// Only this engine rank, if set.
    pub engine_rank: Option<u32>,
}

impl PeerQuery {
    /// Every record of `cluster`.
    pub fn cluster(cluster: impl Into<String>) -> Self {
        PeerQuery {
            cluster: cluster.into(),
            role: None,
            engine_rank: None,
        }
    }

    /// Only records of `role`.
    pub fn role(mut self, role: Role) -> Self {
        self.role = Some(role);
        self
    }

    /// Only records of engine rank `rank`.
    pub fn rank(mut self, rank: u32) -> Self {
        self.engine_rank = Some(rank);
        self
    }

    /// Whether `record` is one this query asks for.
    pub fn matches(&self, record: &PeerRecord) -> bool {
        self.matches_key(&record.key())
    }

    /// Whether a record with `key` is one this query asks for.
    pub fn matches_key(&self, key: &PeerKey) -> bool {
        key.cluster == self.cluster
            && self.role.is_none_or(|r| r == key.role)
            && self.engine_rank.is_none_or(|r| r == key.engine_rank)
    }

    /// Checks the cluster name.
    pub fn validate(&self) -> Result<(), DiscoveryError> {
        check_cluster(&self.cluster).map_err(DiscoveryError::InvalidQuery)
    }
}

/// A cluster name is a path segment: 1..=128 of `[A-Za-z0-9._-]`, not `.` or `..`.
pub(crate) fn check_cluster(cluster: &str) -> Result<(), String> {
    let ok = !cluster.is_empty()
        && cluster.len() <= MAX_CLUSTER_LEN
        && cluster != "."
        && cluster != ".."
        && cluster
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "cluster {cluster:?} is not 1..={MAX_CLUSTER_LEN} of [A-Za-z0-9._-] (and not . or ..)"
        ))
    }
}

/// `host:port` with a non-empty host, a decimal port and no whitespace or `/`.
fn check_address(address: &str) -> Result<(), String> {
    let bad = || {
        Err(format!(
            "address {address:?} is not host:port (at most {MAX_ADDRESS_LEN} bytes)"
        ))
    };
    if address.len() > MAX_ADDRESS_LEN
        || address
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b == b'/')
    {
        return bad();
    }
    match address.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && parse_decimal::<u16>(port).is_some() => Ok(()),
        _ => bad(),
    }
}

/// Lower-case hex SHA-256 of a KV layout: tokens per page, bytes per page of every buffer
/// and the model/TP fingerprint (the fields the handshake compares), in a fixed encoding.
/// Two nodes whose handshake would refuse each other's layout get different fingerprints.
pub fn layout_fingerprint(layout: &KvLayout) -> String {
    let mut h = Sha256::new();
    h.update(b"kvwire-layout-v1\0");
    h.update(layout.tokens_per_page.to_be_bytes());
    h.update((layout.buffer_page_bytes.len() as u64).to_be_bytes());
    for b in &layout.buffer_page_bytes {
        h.update(b.to_be_bytes());
    }
    h.update((layout.fingerprint.len() as u64).to_be_bytes());
    h.update(&layout.fingerprint);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// [`layout_fingerprint`] of the layout a node with `config` announces in its handshake.
pub fn node_layout_fingerprint(config: &NodeConfig) -> String {
    layout_fingerprint(&config.pool.to_layout(config.fingerprint.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> PeerRecord {
        PeerRecord::new("c-1", Role::Prefill, 3, 42, "10.0.0.1:7400")
    }

    #[test]
    fn json_round_trip_and_defaults() {
        let mut r = record();
        r.tp_rank = Some(1);
        r.extra.insert("zone".into(), "a".into());
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains("\"role\":\"prefill\""), "{text}");
        assert!(!text.contains("dp_rank"), "{text}");
        assert_eq!(serde_json::from_str::<PeerRecord>(&text).unwrap(), r);
        // Optional fields may be absent, unknown ones are ignored.
        let minimal = r#"{"node_id":1,"role":"decode","engine_rank":0,"address":"h:1",
            "transport":"rdma","cluster":"c","future":true}"#;
        let m: PeerRecord = serde_json::from_str(minimal).unwrap();
        assert_eq!(m.role, Role::Decode);
        assert!(m.extra.is_empty() && m.layout_fingerprint.is_empty());
        m.validate().unwrap();
    }

    #[test]
    fn registration_stamp_is_optional_on_the_wire() {
        let mut r = record();
        let text = serde_json::to_string(&r).unwrap();
        assert!(!text.contains("registered"), "absent when 0: {text}");
        r.registered = 1_700_000_000_123;
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains("\"registered\":1700000000123"), "{text}");
        assert_eq!(serde_json::from_str::<PeerRecord>(&text).unwrap(), r);
    }

    #[test]
    fn newest_registration_first_within_each_rank() {
        let rec = |role, rank, node, registered| {
            let mut r = PeerRecord::new("c", role, rank, node, "h:1");
            r.registered = registered;
            r
        };
        let mut records = vec![
            rec(Role::Decode, 0, 1, 50),
            rec(Role::Prefill, 1, 7, 10),
            rec(Role::Prefill, 0, 1, 10),
            rec(Role::Prefill, 0, 9, 30),
            rec(Role::Prefill, 0, 2, 20),
            rec(Role::Prefill, 1, 3, 40),
            // Unstamped (an older server): node id order, as before stamps.
            rec(Role::Prefill, 2, 5, 0),
            rec(Role::Prefill, 2, 4, 0),
        ];
        sort_newest_first(&mut records);
        let order: Vec<(Role, u32, u64)> = records
            .iter()
            .map(|r| (r.role, r.engine_rank, r.node_id))
            .collect();
        assert_eq!(
            order,
            vec![
                (Role::Prefill, 0, 9),
                (Role::Prefill, 0, 2),
                (Role::Prefill, 0, 1),
                (Role::Prefill, 1, 3),
                (Role::Prefill, 1, 7),
                (Role::Prefill, 2, 4),
                (Role::Prefill, 2, 5),
                (Role::Decode, 0, 1),
            ]
        );
    }

    #[test]
    fn validation() {
        record().validate().unwrap();
        let cases: Vec<fn(&mut PeerRecord)> = vec![
            |r| r.cluster = String::new(),
            |r| r.cluster = "a/b".into(),
            |r| r.cluster = "..".into(),
            |r| r.cluster = "x".repeat(MAX_CLUSTER_LEN + 1),
            |r| r.address = "nohost".into(),
            |r| r.address = ":80".into(),
            |r| r.address = "h:99999".into(),
            |r| r.address = "h :80".into(),
            |r| r.transport = "TCP".into(),
            |r| r.transport = String::new(),
            |r| r.layout_fingerprint = "xyz".into(),
            |r| r.transport_params = "0".repeat(MAX_TRANSPORT_PARAMS_LEN + 1),
            |r| {
                r.extra.insert(String::new(), "v".into());
            },
        ];
        for (i, break_it) in cases.into_iter().enumerate() {
            let mut r = record();
            break_it(&mut r);
            assert!(r.validate().is_err(), "case {i} passed: {r:?}");
        }
    }

    #[test]
    fn key_path_round_trip() {
        let k = record().key();
        assert_eq!(k.to_string(), "c-1/prefill/3/42");
        assert_eq!(PeerKey::parse_path(&k.to_string()).unwrap(), k);
        for bad in [
            "c/prefill/3",
            "c/prefill/3/4/5",
            "c/x/3/4",
            "c/decode/-1/4",
            "/decode/1/4",
        ] {
            assert!(PeerKey::parse_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn query_matching() {
        let r = record();
        assert!(PeerQuery::cluster("c-1").matches(&r));
        assert!(PeerQuery::cluster("c-1")
            .role(Role::Prefill)
            .rank(3)
            .matches(&r));
        assert!(!PeerQuery::cluster("c-1").role(Role::Decode).matches(&r));
        assert!(!PeerQuery::cluster("c-1").rank(4).matches(&r));
        assert!(!PeerQuery::cluster("c-2").matches(&r));
    }

    #[test]
    fn layout_fingerprints_differ_where_the_handshake_would_refuse() {
        let base = KvLayout {
            tokens_per_page: 16,
            buffer_page_bytes: vec![4096, 4096],
            fingerprint: b"model/tp0".to_vec(),
        };
        let fp = layout_fingerprint(&base);
        assert_eq!(fp.len(), 64);
        assert_eq!(fp, layout_fingerprint(&base.clone()));
        let mut variants = vec![base.clone(), base.clone(), base.clone(), base.clone()];
        variants[0].tokens_per_page = 32;
        variants[1].buffer_page_bytes = vec![4096];
        variants[2].buffer_page_bytes = vec![4096, 8192];
        variants[3].fingerprint = b"model/tp1".to_vec();
        for v in &variants {
            assert_ne!(layout_fingerprint(v), fp, "{v:?}");
        }
        let mut r = record();
        assert!(
            r.check_layout(&fp).is_err(),
            "an empty fingerprint is a mismatch"
        );
        r.layout_fingerprint = fp.clone();
        r.validate().unwrap();
        r.check_layout(&fp).unwrap();
        assert!(r.check_layout(&layout_fingerprint(&variants[3])).is_err());
        assert!(r.check_layout("").is_err());
    }
}
