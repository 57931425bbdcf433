//! Counters and gauges of an engine, in the Prometheus text format.
//!
//! Shared by every connection of a node through [`crate::NodeConfig::metrics`];
//! [`serve`] exposes them over HTTP (`kvwire bench --metrics-addr`).

use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Labels of a transfer outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// "sender" or "receiver".
    pub role: String,
    /// "verified", or the failure's wire code (e.g. "DIGEST_MISMATCH").
    pub outcome: String,
}

/// Labels of a handshake a listener ran.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Handshake {
    /// "established", "refused", "malformed" (not kvwire frames) or "failed" (I/O, timeout,
    /// transport).
    pub outcome: String,
}

/// Labels of a connection's pool.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Connection {
    /// A per-process connection number.
    pub connection: String,
}

/// The node's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Transfers by role and outcome.
    pub transfers: Family<Outcome, Counter>,
    /// Payload bytes of verified transfers (receiver).
    pub bytes_verified: Counter,
    /// Requests rejected at admission (sender).
    pub rejected_at_admission: Counter,
    /// Aborts requested by the local engine.
    pub aborts: Counter,
    /// Fences carried out (receiver).
    pub fences: Counter,
    /// Free pages per connection pool.
    pub pages_free: Family<Connection, Gauge>,
    /// Quarantined pages per connection pool.
    pub pages_quarantined: Family<Connection, Gauge>,
    /// Lanes of a connection that failed while it went on (RDMA over several rails, SPEC
    /// §9.2: a rail down or its queue pair in error), per connection of either role; 0 while
    /// every lane lives. A connection above 0 runs on fewer rails until it is replaced.
    pub failed_lanes: Family<Connection, Gauge>,
    /// Handshakes run by listeners, by outcome.
    pub handshakes: Family<Handshake, Counter>,
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("kvwire");
        let m = Self {
            transfers: Family::default(),
            bytes_verified: Counter::default(),
            rejected_at_admission: Counter::default(),
            aborts: Counter::default(),
            fences: Counter::default(),
            pages_free: Family::default(),
            pages_quarantined: Family::default(),
            failed_lanes: Family::default(),
            handshakes: Family::default(),
            registry: Registry::default(),
        };
        macro_rules! register {
            ($($name:literal, $help:literal, $field:ident;)*) => {
                $(registry.register($name, $help, m.$field.clone());)*
            };
        }
        register! {
            "transfers", "Transfers by role and outcome", transfers;
            "verified_bytes", "Payload bytes of verified transfers", bytes_verified;
            "rejected_at_admission", "Requests rejected at admission", rejected_at_admission;
            "aborts", "Aborts requested by the local engine", aborts;
            "fences", "Fences carried out by receivers", fences;
            "pages_free", "Free pages per connection pool", pages_free;
            "pages_quarantined", "Quarantined pages per connection pool", pages_quarantined;
            "failed_lanes", "Lanes failed while the connection went on (RDMA rails), per connection", failed_lanes;
            "handshakes", "Handshakes run by listeners, by outcome", handshakes;
        }
        Arc::new(Self { registry, ..m })
    }

    /// Counts one transfer outcome.
    pub fn transfer(&self, role: &str, outcome: &str) {
        self.transfers
            .get_or_create(&Outcome {
                role: role.into(),
                outcome: outcome.into(),
            })
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Serves [`Metrics::encode`] to every HTTP request on `listener` (any path), until the
/// task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            // Read (and ignore) the request head; one request per connection.
            let mut buf = [0u8; 4096];
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), s.read(&mut buf)).await;
            let body = metrics.encode();
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(body.as_bytes()).await;
            let _ = s.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_appear_in_the_exposition() {
        let m = Metrics::new();
        m.transfer("receiver", "verified");
        m.transfer("receiver", "DIGEST_MISMATCH");
        m.transfer("receiver", "DIGEST_MISMATCH");
        m.fences.inc();
        m.pages_free
            .get_or_create(&Connection {
                connection: "1".into(),
            })
            .set(42);
        let text = m.encode();
        assert!(
            text.contains(r#"kvwire_transfers_total{role="receiver",outcome="DIGEST_MISMATCH"} 2"#),
            "{text}"
        );
        assert!(text.contains("kvwire_fences_total 1"), "{text}");
        assert!(
            text.contains(r#"kvwire_pages_free{connection="1"} 42"#),
            "{text}"
        );
    }
}
