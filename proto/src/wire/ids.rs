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

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}
