//! Deadlines of many transfers: a lazy min-heap, O(log n) per arm and per expiry.

use crate::wire::TransferId;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

/// Armed deadlines keyed by transfer id. An entry is live only while the transfer's current
/// deadline equals it; stale entries are discarded when they reach the top.
#[derive(Clone, Debug, Default)]
pub(crate) struct Timers {
    heap: BinaryHeap<Reverse<(Instant, TransferId)>>,
}

impl Timers {
    pub(crate) fn arm(&mut self, at: Instant, transfer_id: TransferId) {
        self.heap.push(Reverse((at, transfer_id)));
    }

    /// The earliest live deadline; `current(id)` returns a transfer's armed deadline.
    pub(crate) fn next(
        &mut self,
        current: impl Fn(TransferId) -> Option<Instant>,
    ) -> Option<Instant> {
        while let Some(&Reverse((at, id))) = self.heap.peek() {
            if current(id) == Some(at) {
                return Some(at);
            }
            self.heap.pop();
        }
        None
    }

    /// Pops every live deadline at or before `now`, returning the transfer ids in deadline order.
    pub(crate) fn expired(
        &mut self,
        now: Instant,
        current: impl Fn(TransferId) -> Option<Instant>,
    ) -> Vec<TransferId> {
        let mut out = Vec::new();
        while let Some(&Reverse((at, id))) = self.heap.peek() {
            if at > now {
                break;
            }
            self.heap.pop();
            // A deadline re-armed unchanged sits in the heap more than once: fire it once.
            if current(id) == Some(at) && !out.contains(&id) {
                out.push(id);
            }
        }
        out
    }
}
