//! Heartbeats per lane (SPEC §9.1, several streams; §8.3): the connection's PING goes out on
//! every lane and each PONG goes back on the lane its PING came in on, so every lane carries
//! frames from the peer at least once per heartbeat interval, busy or not. A lane the peer has
//! not been heard on for the liveness timeout while another lane was heard since (one stream
//! black-holed: an ECMP path lost, a middlebox that dropped one flow) makes the connection
//! unresponsive. The driver's own heartbeat still judges the whole connection: a peer silent
//! on every lane is its verdict, with its rule for this node's own stalls.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// PINGs received and not answered yet, at most: a driver without heartbeats never answers,
/// and the oldest lanes are forgotten (their PONGs, if any, go on lane 0).
const PINGS_KEPT: usize = 1024;

/// The heartbeat state of a [`LaneSet`](super::LaneSet)'s lanes.
#[derive(Debug)]
pub(super) struct LaneHeartbeats {
    /// A lane not heard for this long while another was heard since is silent; `None`: no
    /// per-lane verdict (frames are still routed as above).
    limit: Option<Duration>,
    /// When the peer was last heard on each lane (`None` before the first pass).
    heard: Option<Vec<Instant>>,
    /// When the last pass over every lane ended.
    last_pass: Option<Instant>,
    /// The lanes of the peer's PINGs not answered yet, in the order they arrived.
    pings: VecDeque<usize>,
}

impl LaneHeartbeats {
    pub(super) fn new() -> Self {
        Self {
            limit: None,
            heard: None,
            last_pass: None,
            pings: VecDeque::new(),
        }
    }

    /// Judges each lane by `limit` (the liveness timeout).
    pub(super) fn set_limit(&mut self, limit: Duration) {
        self.limit = Some(limit);
    }

    /// The peer was heard on `lane` (a frame, or bytes of a data record, from it).
    pub(super) fn heard(&mut self, lane: usize, now: Instant) {
        if let Some(h) = self.heard.as_mut().and_then(|h| h.get_mut(lane)) {
            *h = (*h).max(now);
        }
    }

    /// A PING from the peer arrived on `lane`.
    pub(super) fn ping_from(&mut self, lane: usize) {
        if self.pings.len() == PINGS_KEPT {
            self.pings.pop_front();
        }
        self.pings.push_back(lane);
    }

    /// The lane for the next PONG: that of the oldest PING not answered (the driver answers
    /// PINGs in order), or lane 0.
    pub(super) fn pong_lane(&mut self) -> usize {
        self.pings.pop_front().unwrap_or(0)
    }

    /// A pass over every lane of `lanes` ended at `now`: the first lane silent for the limit
    /// while another was heard since, with how long it was silent. A pass that comes more
    /// than half the limit after the one before (this node did not run, so what the peer
    /// sent may be waiting unread on any lane) restarts every lane's count instead.
    pub(super) fn end_pass(
        &mut self,
        lanes: usize,
        ended: &[bool],
        now: Instant,
    ) -> Option<(usize, Duration)> {
        let limit = self.limit?;
        let stalled = self
            .last_pass
            .is_some_and(|t| now.saturating_duration_since(t) > limit / 2);
        self.last_pass = Some(now);
        let heard = self.heard.get_or_insert_with(|| vec![now; lanes]);
        if stalled {
            heard.iter_mut().for_each(|h| *h = now);
            return None;
        }
        let open = |i: &usize| !ended.get(*i).copied().unwrap_or(true);
        let newest = (0..lanes).filter(open).map(|i| heard[i]).max()?;
        (0..lanes).filter(open).find_map(|i| {
            let behind = newest.saturating_duration_since(heard[i]);
            (behind >= limit).then(|| (i, now.saturating_duration_since(heard[i])))
        })
    }
}
