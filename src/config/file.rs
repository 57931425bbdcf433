//! The engine's TOML configuration file.
//!
//! ```toml
//! [node]
//! node_id = 1
//! listen = "0.0.0.0:7400"
//! fingerprint = "llama-3-70b/tp8/rank0"
//! digests = ["xxh3", "crc32"]
//!
//! [pool]
//! tokens_per_page = 16
//! buffers = 160               # e.g. 80 layers x K and V
//! page_bytes = 65536          # bytes per page in each buffer
//! # buffer_page_bytes = [...] # or one size per buffer
//! pages = 4096
//! scrub = "none"              # none | zero | poison
//!
//! [engine]
//! max_context_tokens = 65536
//! allow_undersized_pool = false
//!
//! [auth]
//! mode = "psk"                # psk (the default) | off
//! psk_file = "/etc/kvwire/psk" # hex key; else KVWIRE_PSK_FILE or KVWIRE_PSK
//!
//! [timeouts]
//! handshake_ms = 10000
//! reservation_ms = 30000
//! verdict_ms = 10000
//! abort_ack_ms = 5000
//! heartbeat_ms = 250           # PING interval (SPEC §8.3)
//! peer_timeout_ms = 2000       # silence after which a peer is unresponsive
//! ```

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use kvwire_proto::wire::DigestAlgorithm;
use serde::Deserialize;

use super::auth::KeySource;
use super::EngineConfig;
use super::{Auth, NodeConfig};
use crate::memory::{PoolGeometry, Scrub};

/// The file, as parsed. Unknown keys are refused, so a typo is an error, not a default.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// `[node]`.
    #[serde(default)]
    pub node: NodeSection,
    /// `[pool]`.
    pub pool: PoolSection,
    /// `[engine]`.
    pub engine: EngineSection,
    /// `[timeouts]`.
    #[serde(default)]
    pub timeouts: TimeoutSection,
    /// `[auth]`.
    #[serde(default)]
    pub auth: AuthSection,
}

/// `[auth]`: peer authentication with a pre-shared key (on unless `mode = "off"`).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthSection {
    /// "psk" (the default) or "off".
    pub mode: Option<String>,
    /// A file holding the key as hex; else `KVWIRE_PSK_FILE` or `KVWIRE_PSK`.
    pub psk_file: Option<std::path::PathBuf>,
}

/// `[node]`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// Node id.
    #[serde(default)]
    pub node_id: u64,
    /// Listen address.
    pub listen: Option<SocketAddr>,
    /// Model / tensor-parallel fingerprint.
    #[serde(default)]
    pub fingerprint: String,
    /// Digest algorithms, preferred first: "xxh3", "crc32".
    pub digests: Option<Vec<String>>,
    /// Same-host pulls over TCP: "auto" (the default), "off" or "require" (SPEC §9.3).
    pub same_host: Option<String>,
    /// Threads that copy the node's same-host pulls (`NodeConfig::pull_threads`; 0:
    /// half the cores, at most 8).
    pub pull_threads: Option<usize>,
}

/// `[pool]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSection {
    /// Tokens per page.
    pub tokens_per_page: u32,
    /// Buffer count (with `page_bytes`).
    pub buffers: Option<u32>,
    /// Bytes per page of every buffer (with `buffers`).
    pub page_bytes: Option<u32>,
    /// Bytes per page of each buffer (instead of `buffers` + `page_bytes`).
    pub buffer_page_bytes: Option<Vec<u32>>,
    /// Pages.
    pub pages: u32,
    /// "none", "zero" or "poison".
    #[serde(default)]
    pub scrub: Option<String>,
}

/// `[engine]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSection {
    /// The maximum context length the engine serves.
    pub max_context_tokens: u64,
    /// Downgrade an undersized pool to a warning.
    #[serde(default)]
    pub allow_undersized_pool: bool,
}

/// `[timeouts]`, in milliseconds.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutSection {
    /// Handshake.
    pub handshake_ms: Option<u64>,
    /// Admitted request waiting for its reservation.
    pub reservation_ms: Option<u64>,
    /// Commit to verdict.
    pub verdict_ms: Option<u64>,
    /// Abort to abort-ack.
    pub abort_ack_ms: Option<u64>,
    /// Heartbeat interval.
    pub heartbeat_ms: Option<u64>,
    /// Silence after which a peer is unresponsive.
    pub peer_timeout_ms: Option<u64>,
}

/// Why a configuration file is unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// It could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// It is not valid TOML for this schema.
    #[error("parsing: {0}")]
    Parse(#[from] toml::de::Error),
    /// A value is invalid.
    #[error("{0}")]
    Invalid(String),
}

impl ConfigFile {
    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<Self, FileError> {
        let text = std::fs::read_to_string(path).map_err(|source| FileError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Parses TOML text.
    pub fn parse(text: &str) -> Result<Self, FileError> {
        Ok(toml::from_str(text)?)
    }

    /// The pool geometry the file describes.
    pub fn geometry(&self) -> Result<PoolGeometry, FileError> {
        let p = &self.pool;
        let buffer_page_bytes = match (&p.buffer_page_bytes, p.buffers, p.page_bytes) {
            (Some(v), None, None) => v.clone(),
            (None, Some(n), Some(b)) => vec![b; n as usize],
            _ => {
                return Err(FileError::Invalid(
                    "[pool] needs either buffer_page_bytes, or buffers and page_bytes".into(),
                ))
            }
        };
        let g = PoolGeometry {
            tokens_per_page: p.tokens_per_page,
            buffer_page_bytes,
            pages: p.pages,
        };
        g.validate()
            .map_err(|e| FileError::Invalid(e.to_string()))?;
        Ok(g)
    }

    /// The engine configuration.
    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            max_context_tokens: self.engine.max_context_tokens,
            allow_undersized_pool: self.engine.allow_undersized_pool,
        }
    }

    /// Whether `[auth] mode` turns authentication off.
    pub fn auth_off(&self) -> Result<bool, FileError> {
        match self.auth.mode.as_deref() {
            None | Some("psk") => Ok(false),
            Some("off") => Ok(true),
            Some(other) => Err(FileError::Invalid(format!(
                "unknown auth mode {other:?} (psk, off)"
            ))),
        }
    }

    /// The node's authentication: off if `[auth] mode = "off"`, else the key from
    /// `[auth] psk_file`, `KVWIRE_PSK_FILE` or `KVWIRE_PSK` (an error if there is none).
    pub fn auth(&self) -> Result<(Auth, Option<KeySource>), FileError> {
        super::auth::resolve(self.auth_off()?, self.auth.psk_file.as_deref())
            .map_err(|e| FileError::Invalid(e.to_string()))
    }

    /// The full node configuration, with its key ([`ConfigFile::auth`]).
    pub fn node_config(&self) -> Result<NodeConfig, FileError> {
        let (auth, _) = self.auth()?;
        self.node_config_with(auth)
    }

    /// The node configuration with the given authentication (e.g. to check the rest of a
    /// file on a host that does not hold the key).
    pub fn node_config_with(&self, auth: Auth) -> Result<NodeConfig, FileError> {
        let mut c = NodeConfig::example();
        c.auth = auth;
        c.node_id = self.node.node_id;
        c.pool = self.geometry()?;
        c.engine = self.engine();
        c.fingerprint = self.node.fingerprint.clone().into_bytes();
        if let Some(d) = &self.node.digests {
            c.digests = d
                .iter()
                .map(|name| match name.as_str() {
                    "xxh3" => Ok(DigestAlgorithm::XXH3_64),
                    "crc32" => Ok(DigestAlgorithm::CRC32),
                    other => Err(FileError::Invalid(format!(
                        "unknown digest {other:?} (xxh3, crc32)"
                    ))),
                })
                .collect::<Result<_, _>>()?;
        }
        if let Some(m) = &self.node.same_host {
            c.same_host = m.parse().map_err(FileError::Invalid)?;
        }
        if let Some(n) = self.node.pull_threads {
            c.pull_threads = n;
        }
        c.scrub = match self.pool.scrub.as_deref() {
            None | Some("none") => Scrub::None,
            Some("zero") => Scrub::Zero,
            Some("poison") => Scrub::Poison,
            Some(other) => {
                return Err(FileError::Invalid(format!(
                    "unknown scrub {other:?} (none, zero, poison)"
                )))
            }
        };
        let t = &self.timeouts;
        let ms = Duration::from_millis;
        if let Some(v) = t.handshake_ms {
            c.handshake_timeout = ms(v);
        }
        if let Some(v) = t.reservation_ms {
            c.sender.reservation_timeout = ms(v);
        }
        if let Some(v) = t.verdict_ms {
            c.sender.verdict_timeout = ms(v);
        }
        if let Some(v) = t.abort_ack_ms {
            c.sender.abort_ack_timeout = ms(v);
            c.receiver.abort_ack_timeout = ms(v);
        }
        if let Some(v) = t.heartbeat_ms {
            c.liveness.interval = ms(v);
        }
        if let Some(v) = t.peer_timeout_ms {
            c.liveness.timeout = ms(v);
        }
        Ok(c)
    }
}
