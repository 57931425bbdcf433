//! Fences and striped binds of the decode end: the windows of a scope per lane, the binds a
//! striped reservation's RESERVE waits for, and the fences in progress (posted now, or
//! deferred after a lane failure; SPEC §9.2, striping).

use std::time::Instant;

use kvwire_proto::wire::{Frame, TransferId, TransferRef};

use super::super::verbs::MemoryWindow;
use super::{RdmaReceiver, SPARE_WINDOWS};
use crate::transport::{Closed, TransportEvent};

/// The windows of one lane of a scope.
pub(super) struct Stripe {
    pub(super) lane: usize,
    /// The rail whose device the windows belong to.
    pub(super) rail: usize,
    pub(super) windows: Vec<MemoryWindow>,
    /// The invalidation work request of a fence posted on the lane and not yet completed.
    pub(super) invalidating: Option<u64>,
}

/// A striped reservation's binds on lanes other than its own, not yet completed: its RESERVE
/// waits for them (a window is valid for the peer's writes once its bind has executed, and
/// only the RESERVE's own queue pair orders its binds before it).
pub(super) struct Binding {
    pub(super) remaining: usize,
    pub(super) reserve: Option<Frame>,
}

/// A fence in progress: the invalidations not yet completed (one completion per lane).
pub(super) struct Fencing {
    /// The transfer whose fence it is (reported `Fenced` once complete); `None` for the
    /// windows of a scope no peer saw (abandoned), which are only recycled.
    pub(super) transfer: Option<TransferRef>,
    /// The windows, per lane whose queue pair posts their invalidations.
    pub(super) stripes: Vec<Stripe>,
    pub(super) remaining: usize,
    pub(super) since: Instant,
    /// Invalidations not posted before this instant: a moved striped reservation's windows
    /// on live lanes, left valid while the sender may not yet have seen the lane fail
    /// (SPEC §9.2, striping).
    pub(super) post_at: Option<Instant>,
}

impl RdmaReceiver {
    /// Posts the invalidations of fence `key`, one doorbell and one completion per lane with
    /// windows (the last invalidation's covers the others: a send queue completes in order;
    /// one that fails completes in error and breaks the lane). Completes it at once when
    /// nothing is left to invalidate.
    pub(super) fn post_fence(&mut self, key: u64, now: Instant) {
        let Some(f) = self.fencing.get_mut(&key) else {
            return;
        };
        f.post_at = None;
        let mut failed = false;
        for s in f.stripes.iter_mut().filter(|s| !s.windows.is_empty()) {
            let id = self.next_wr;
            self.next_wr += 1;
            let rkeys: Vec<u32> = s.windows.iter().map(|w| w.rkey).collect();
            match self.lanes.lanes[s.lane].link.invalidate_all(&rkeys, id) {
                Ok(()) => {
                    self.fence_wrs.insert(id, key);
                    self.stats.invalidations += rkeys.len() as u64;
                    s.invalidating = Some(id);
                    f.remaining += 1;
                }
                Err(e) => {
                    tracing::error!(error = %e, lane = s.lane, "invalidations could not be posted");
                    failed = true;
                }
            }
        }
        if failed {
            // A fence that cannot be posted: tear the link down (SPEC §8.2), which fences.
            self.fail(Closed::LinkFailed(
                "an invalidation could not be posted".into(),
            ));
        } else if f.remaining == 0 {
            self.complete_fence(key, now);
        }
    }

    /// Fence `key` is complete: reported (when it is a transfer's), its windows bound again
    /// (with new keys) by later reservations while they have keys left, else deallocated.
    pub(super) fn complete_fence(&mut self, key: u64, now: Instant) {
        let Some(f) = self.fencing.remove(&key) else {
            return;
        };
        if let Some(t) = f.transfer {
            self.stats.fence_time += now.saturating_duration_since(f.since);
            self.events.push_back(TransportEvent::Fenced(t));
        }
        for s in f.stripes {
            for w in s.windows {
                let spare = &mut self.spare[s.rail];
                if w.reusable() && spare.len() < SPARE_WINDOWS {
                    spare.push(w);
                }
            }
        }
    }

    /// Starts a fence over `stripes` (posted now, or at `post_at`).
    pub(super) fn start_fence(
        &mut self,
        transfer: Option<TransferRef>,
        stripes: Vec<Stripe>,
        post_at: Option<Instant>,
        now: Instant,
    ) {
        let key = self.next_fence;
        self.next_fence += 1;
        self.fencing.insert(
            key,
            Fencing {
                transfer,
                stripes,
                remaining: 0,
                since: now,
                post_at,
            },
        );
        if post_at.is_none() {
            self.post_fence(key, now);
        }
    }

    /// Forgets a reservation's binds still awaited (its RESERVE, if held, is never sent).
    pub(super) fn forget_binds(&mut self, transfer_id: TransferId) {
        if self.binding.remove(&transfer_id).is_some() {
            self.bind_wrs.retain(|_, tid| *tid != transfer_id);
        }
    }
}
