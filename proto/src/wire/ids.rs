//! Identifiers carried on the wire, as newtypes over their integers.

use std::fmt;

/// A transfer's id: the request id both engines agreed on (a u64 on the wire, SPEC §3).
/// Unique per connection among open transfers; the id of a finished transfer is remembered
/// for a while (SPEC §7.3) so that late frames for it are recognised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

impl TransferId {
    /// The integer carried on the wire.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl From<u64> for TransferId {
    fn from(id: u64) -> Self {
        Self(id)
    }
}

impl From<TransferId> for u64 {
    fn from(id: TransferId) -> Self {
        id.0
    }
}

/// A hash map keyed by transfer id, as the sessions and drivers keep their per-transfer state.
///
/// Hashed with foldhash: every frame looks its transfer up (several times per transfer), and
/// SipHash, std's default, cost 3.5-5% of a 4 KiB single-page transfer's CPU; foldhash
/// raised those transfers' rate by 1.19-1.28x at the median of three runs, every round above
/// 1 (docs/BENCHMARKS.md, 2026-12-04 and 2026-12-05). Ids are
/// chosen by the (authenticated) sending peer, so each map keeps foldhash's random state (a
/// process seed from addresses and the clock, varied per map): foldhash promises only
/// minimal resistance to chosen collisions, and the number of open transfers a peer can
/// hold is bounded by admission in any case.
pub type TransferIdMap<V> = std::collections::HashMap<TransferId, V, foldhash::fast::RandomState>;

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}
