//! A bounded memory of finished transfers, so late and duplicate frames for them are
//! recognised (SPEC.md §7.4) instead of being mistaken for unknown transfers.

use crate::wire::{TransferId, TransferIdMap};
use std::collections::VecDeque;

/// How a finished transfer ended, as remembered for late frames.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Finished {
    pub(crate) nonce: u64,
    /// `None` if it verified, else the code it failed with.
    pub(crate) failure: Option<(crate::wire::ErrorCode, String)>,
    /// Sender: the peer aborted this id's reservation while it was parked (no request was
    /// submitted yet); a later `submit`/`open` of the id fails at once with the abort's code
    /// (SPEC.md §5.1).
    pub(crate) aborted_while_parked: bool,
}

impl Finished {
    /// How a transfer ended, without a parked abort.
    pub(crate) fn ended(nonce: u64, failure: Option<(crate::wire::ErrorCode, String)>) -> Self {
        Self {
            nonce,
            failure,
            aborted_while_parked: false,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct History {
    capacity: usize,
    order: VecDeque<TransferId>,
    entries: TransferIdMap<Finished>,
}

impl History {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            order: VecDeque::new(),
            entries: TransferIdMap::default(),
        }
    }

    /// Records how a transfer ended. An id already remembered is updated **and** becomes the
    /// newest entry (SPEC.md §7.3): its eviction position is that of its latest end.
    pub(crate) fn insert(&mut self, transfer_id: TransferId, finished: Finished) {
        if self.entries.insert(transfer_id, finished).is_some() {
            self.order.retain(|&t| t != transfer_id);
        }
        self.order.push_back(transfer_id);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.entries.remove(&old);
            }
        }
    }

    pub(crate) fn get(&self, transfer_id: TransferId) -> Option<&Finished> {
        self.entries.get(&transfer_id)
    }

    pub(crate) fn remove(&mut self, transfer_id: TransferId) -> Option<Finished> {
        let f = self.entries.remove(&transfer_id)?;
        self.order.retain(|&t| t != transfer_id);
        Some(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC §7.3 (was Q15): re-inserting a remembered id refreshes its eviction position, so
    /// the entry of a transfer that just ended is not the next one forgotten.
    #[test]
    fn reinserting_an_id_makes_it_the_newest_entry() {
        let mut h = History::new(2);
        h.insert(TransferId(1), Finished::ended(1, None));
        h.insert(TransferId(2), Finished::ended(2, None));
        h.insert(TransferId(1), Finished::ended(3, None));
        h.insert(TransferId(3), Finished::ended(4, None));
        assert_eq!(h.get(TransferId(1)).map(|f| f.nonce), Some(3));
        assert!(
            h.get(TransferId(2)).is_none(),
            "the oldest end is forgotten first"
        );
        assert!(h.get(TransferId(3)).is_some());
    }
}
