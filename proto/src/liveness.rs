//! Heartbeats: whether the peer of an established connection still answers (SPEC.md §8.3).
//!
//! Sans-IO like the sessions: time enters as `now`, PING / PONG frames enter and leave as
//! values. One [`Liveness`] per connection, beside the role's session:
//!
//! * every frame from the peer goes to [`Liveness::handle_frame`] first (it consumes PING
//!   and PONG; anything else only counts as "heard"), and other bytes known to come from the
//!   peer (a TCP data record) to [`Liveness::handle_activity`];
//! * [`Liveness::poll_transmit`] gives the PING / PONG frames to send;
//! * [`Liveness::handle_timeout`] at [`Liveness::poll_timeout`] sends the next PING and, once
//!   the peer has been silent for [`LivenessConfig::timeout`], declares it unresponsive
//!   ([`Liveness::poll_event`]); the driver then closes the connection and fails its
//!   transfers with [`FailureReason::PeerUnresponsive`](crate::FailureReason::PeerUnresponsive).
//!
//! Silence is counted only while this node runs: a `handle_timeout` that comes more than one
//! interval after the deadline [`Liveness::poll_timeout`] asked for (this process was stopped
//! or starved, so frames may be waiting unread) restarts the count instead of blaming the peer.
//!
//! A peer must also **read**: the driver tells [`Liveness::handle_write_blocked`] since when
//! the connection has taken none of the bytes waiting to go (a peer that keeps sending but
//! stopped reading fills the socket), and a block as long as the timeout makes the peer
//! unresponsive too ([`LivenessEvent::NotReading`]). PINGs are answered at most
//! [`PONGS_PER_INTERVAL`] per interval, so a peer sending them faster cannot make this node
//! queue PONGs without bound ([`LivenessEvent::PingsUnanswered`], reported once), and a peer
//! that sends more than [`PING_FLOOD_LIMIT`] within a second breaks the rule that bounds its
//! rate and is closed ([`LivenessEvent::PingFlood`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::wire::Frame;

/// PINGs answered per `interval` of this node's, at most (SPEC.md §8.3): a peer that sends
/// them faster has the rest left unanswered (its liveness needs none of them: any frame of
/// this node's counts as heard).
pub const PONGS_PER_INTERVAL: u32 = 16;

/// PINGs from the peer within [`PING_FLOOD_WINDOW`] beyond which this node closes the
/// connection (SPEC.md §8.3): a node sends at most one PING per `interval`, and `interval` is
/// at least [`MIN_INTERVAL`], so a peer within the rules sends at most 1,000 a second; this
/// allows ten seconds of those arriving at once (queued behind a stall of either side).
pub const PING_FLOOD_LIMIT: u32 = 10_000;

/// The window [`PING_FLOOD_LIMIT`] is counted over: one second from the first PING after the
/// previous window ended.
pub const PING_FLOOD_WINDOW: Duration = Duration::from_secs(1);

/// The shortest heartbeat interval (SPEC.md §8.3); [`Liveness::new`] raises a shorter one.
pub const MIN_INTERVAL: Duration = Duration::from_millis(1);

/// How often to send a heartbeat and how long a silent peer is tolerated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LivenessConfig {
    /// Time between PINGs (default 250 ms).
    pub interval: Duration,
    /// A peer from which nothing arrived for this long is unresponsive (default 2 s). Must be
    /// longer than `interval`; [`Liveness::new`] raises it to twice the interval otherwise.
    pub timeout: Duration,
}

impl Default for LivenessConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(250),
            timeout: Duration::from_secs(2),
        }
    }
}

/// What [`Liveness`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LivenessEvent {
    /// Nothing arrived from the peer for `silent_for` (at least the configured timeout): it
    /// is unresponsive. Reported once.
    Unresponsive {
        /// How long the peer had been silent when declared.
        silent_for: Duration,
    },
    /// The connection took none of this node's waiting bytes for `blocked_for` (at least the
    /// configured timeout): the peer does not read, and is unresponsive. Reported once, and
    /// never after [`LivenessEvent::Unresponsive`].
    NotReading {
        /// How long the bytes had waited with none taken.
        blocked_for: Duration,
    },
    /// The peer sent more PINGs in one interval than this node answers
    /// ([`PONGS_PER_INTERVAL`]); the rest go unanswered. Reported once per connection; the
    /// connection goes on.
    PingsUnanswered,
    /// The peer sent more than [`PING_FLOOD_LIMIT`] PINGs within `within` (one
    /// [`PING_FLOOD_WINDOW`] at most): a flood no peer within the rules sends. The driver
    /// closes the connection (SPEC.md §8.3). Reported once; nothing more goes out.
    PingFlood {
        /// PINGs counted in the window when it was declared.
        pings: u32,
        /// From the window's first PING to the one that crossed the limit.
        within: Duration,
    },
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LivenessStats {
    /// PINGs sent.
    pub pings_sent: u64,
    /// PONGs received that answered one of our PINGs.
    pub pongs_received: u64,
    /// PINGs received (answered or not).
    pub pings_received: u64,
    /// Times the silence count was restarted because this node itself had not run.
    pub local_stalls: u64,
    /// PINGs received and left unanswered (beyond [`PONGS_PER_INTERVAL`] per interval, or
    /// the one that crossed [`PING_FLOOD_LIMIT`]).
    pub pings_unanswered: u64,
}

/// The heartbeat state of one connection.
#[derive(Clone, Debug)]
pub struct Liveness {
    config: LivenessConfig,
    last_heard: Instant,
    next_ping: Instant,
    next_token: u64,
    /// The PING last sent and when, for the round-trip time.
    outstanding: Option<(u64, Instant)>,
    rtt: Option<Duration>,
    unresponsive: bool,
    /// Since when the connection has taken none of the bytes waiting to go (the driver's
    /// report), and the instant the count restarted after this node's own stall.
    write_blocked_since: Option<Instant>,
    write_count_from: Instant,
    /// PINGs that may still be answered before `pong_refill`.
    pong_budget: u32,
    pong_refill: Instant,
    unanswered_reported: bool,
    /// The current flood window: its first PING and the PINGs in it.
    flood_window: Option<(Instant, u32)>,
    transmit: VecDeque<Frame>,
    events: VecDeque<LivenessEvent>,
    stats: LivenessStats,
}

impl Liveness {
    /// Heartbeats for a connection established at `now` (the peer counts as heard then).
    pub fn new(now: Instant, mut config: LivenessConfig) -> Self {
        config.interval = config.interval.max(MIN_INTERVAL);
        config.timeout = config.timeout.max(config.interval * 2);
        Self {
            config,
            last_heard: now,
            next_ping: now,
            next_token: 1,
            outstanding: None,
            rtt: None,
            unresponsive: false,
            write_blocked_since: None,
            write_count_from: now,
            pong_budget: PONGS_PER_INTERVAL,
            pong_refill: now + config.interval,
            unanswered_reported: false,
            flood_window: None,
            transmit: VecDeque::new(),
            events: VecDeque::new(),
            stats: LivenessStats::default(),
        }
    }

    /// The configuration in force (after [`Liveness::new`]'s adjustment).
    pub fn config(&self) -> LivenessConfig {
        self.config
    }

    /// A frame arrived from the peer: the peer is heard. PING is answered with PONG and PONG
    /// recorded; both are consumed (`true`). Any other frame is left for the session (`false`).
    pub fn handle_frame(&mut self, now: Instant, frame: &Frame) -> bool {
        self.handle_activity(now);
        match *frame {
            Frame::Ping(token) => {
                self.stats.pings_received += 1;
                if now >= self.pong_refill {
                    self.pong_budget = PONGS_PER_INTERVAL;
                    self.pong_refill = now + self.config.interval;
                }
                let (first, pings) = match self.flood_window {
                    Some((first, n)) if now < first + PING_FLOOD_WINDOW => (first, n + 1),
                    _ => (now, 1),
                };
                self.flood_window = Some((first, pings));
                if self.unresponsive {
                    // Nothing more goes out.
                } else if pings > PING_FLOOD_LIMIT {
                    self.stats.pings_unanswered += 1;
                    self.declare(LivenessEvent::PingFlood {
                        pings,
                        within: now.saturating_duration_since(first),
                    });
                } else if self.pong_budget > 0 {
                    self.pong_budget -= 1;
                    self.transmit.push_back(Frame::Pong(token));
                } else {
                    self.stats.pings_unanswered += 1;
                    if !self.unanswered_reported {
                        self.unanswered_reported = true;
                        self.events.push_back(LivenessEvent::PingsUnanswered);
                    }
                }
                true
            }
            Frame::Pong(token) => {
                if let Some((sent, at)) = self.outstanding {
                    if sent == token {
                        self.stats.pongs_received += 1;
                        self.rtt = Some(now.saturating_duration_since(at));
                        self.outstanding = None;
                    }
                }
                true
            }
            _ => false,
        }
    }

    /// Bytes that only the peer can have sent arrived (e.g. a TCP data record): the peer is
    /// heard.
    pub fn handle_activity(&mut self, now: Instant) {
        if now > self.last_heard {
            self.last_heard = now;
        }
    }

    /// The driver's report of its outgoing bytes: since when the connection has taken none
    /// of those waiting to go, or `None` when nothing waits or the last write took some. A
    /// block that lasts the timeout makes the peer unresponsive
    /// ([`LivenessEvent::NotReading`]); call before [`Liveness::poll_timeout`] and
    /// [`Liveness::handle_timeout`].
    pub fn handle_write_blocked(&mut self, since: Option<Instant>) {
        self.write_blocked_since = since;
    }

    /// When the current write block is judged from (after a stall of this node, from then).
    fn blocked_from(&self) -> Option<Instant> {
        self.write_blocked_since
            .map(|since| since.max(self.write_count_from))
    }

    /// When [`Liveness::handle_timeout`] must next be called; `None` once unresponsive.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.unresponsive {
            return None;
        }
        let silent = self.last_heard + self.config.timeout;
        let blocked = self.blocked_from().map(|t| t + self.config.timeout);
        [Some(self.next_ping), Some(silent), blocked]
            .into_iter()
            .flatten()
            .min()
    }

    /// The peer is unresponsive: nothing more goes out, and `event` says why (once).
    fn declare(&mut self, event: LivenessEvent) {
        self.unresponsive = true;
        self.transmit.clear();
        self.events.push_back(event);
    }

    /// Handles the passage of time: the next PING, or the verdict on a silent peer.
    pub fn handle_timeout(&mut self, now: Instant) {
        let Some(due) = self.poll_timeout() else {
            return;
        };
        if now < due {
            return;
        }
        if now > due + self.config.interval {
            // This node did not run for a while: whatever the peer sent may still be unread.
            // Count the silence from now instead of blaming the peer.
            self.stats.local_stalls += 1;
            self.last_heard = now;
            self.write_count_from = now;
            // PINGs that queued up while this node did not run are not a flood.
            self.flood_window = None;
        }
        let silent_for = now.saturating_duration_since(self.last_heard);
        if silent_for >= self.config.timeout {
            return self.declare(LivenessEvent::Unresponsive { silent_for });
        }
        if let Some(from) = self.blocked_from() {
            let blocked_for = now.saturating_duration_since(from);
            if blocked_for >= self.config.timeout {
                return self.declare(LivenessEvent::NotReading { blocked_for });
            }
        }
        if now >= self.next_ping {
            let token = self.next_token;
            self.next_token = self.next_token.wrapping_add(1);
            self.transmit.push_back(Frame::Ping(token));
            self.outstanding = Some((token, now));
            self.stats.pings_sent += 1;
            self.next_ping = now + self.config.interval;
        }
    }

    /// The next PING or PONG to send.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        self.transmit.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<LivenessEvent> {
        self.events.pop_front()
    }

    /// Whether the peer has been declared unresponsive (or flooding, [`LivenessEvent::PingFlood`]):
    /// nothing more goes out.
    pub fn is_unresponsive(&self) -> bool {
        self.unresponsive
    }

    /// How long nothing has arrived from the peer.
    pub fn silent_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last_heard)
    }

    /// The round-trip time of the last answered PING.
    pub fn rtt(&self) -> Option<Duration> {
        self.rtt
    }

    /// Counters.
    pub fn stats(&self) -> LivenessStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LivenessConfig {
        LivenessConfig {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(500),
        }
    }

    #[test]
    fn a_silent_peer_is_unresponsive_at_the_timeout_and_not_before() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, cfg());
        let mut now = t0;
        let mut pings = 0;
        while l.poll_event().is_none() {
            now = l.poll_timeout().unwrap();
            l.handle_timeout(now);
            while let Some(f) = l.poll_transmit() {
                assert!(matches!(f, Frame::Ping(_)));
                pings += 1;
            }
        }
        assert_eq!(now - t0, Duration::from_millis(500));
        assert!(l.is_unresponsive());
        assert_eq!(pings, 5, "one PING per interval while waiting");
        assert_eq!(l.poll_timeout(), None);
    }

    #[test]
    fn any_frame_from_the_peer_keeps_it_alive_and_pings_are_answered() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, cfg());
        for i in 1..=20u64 {
            let now = t0 + Duration::from_millis(100 * i);
            l.handle_timeout(now);
            assert!(l.handle_frame(now, &Frame::Ping(i)));
            let out: Vec<_> = std::iter::from_fn(|| l.poll_transmit()).collect();
            assert!(out.contains(&Frame::Pong(i)), "{out:?}");
        }
        assert!(!l.is_unresponsive());
        assert!(l.poll_event().is_none());
        assert!(!l.handle_frame(
            t0,
            &Frame::AbortAck(crate::wire::TransferRef {
                transfer_id: crate::wire::TransferId(1),
                nonce: 1
            })
        ));
    }

    #[test]
    fn a_pong_gives_the_round_trip_time() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, cfg());
        l.handle_timeout(t0);
        let Some(Frame::Ping(token)) = l.poll_transmit() else {
            panic!("no ping")
        };
        l.handle_frame(t0 + Duration::from_millis(7), &Frame::Pong(token));
        assert_eq!(l.rtt(), Some(Duration::from_millis(7)));
        assert_eq!(l.stats().pongs_received, 1);
    }

    #[test]
    fn a_late_timer_restarts_the_count_instead_of_blaming_the_peer() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, cfg());
        // This process was stopped for 10 s: its frames may be waiting unread.
        let now = t0 + Duration::from_secs(10);
        l.handle_timeout(now);
        assert!(!l.is_unresponsive());
        assert_eq!(l.stats().local_stalls, 1);
        // Silent for the timeout again, counted while running: unresponsive.
        let mut now = now;
        while !l.is_unresponsive() {
            now = l.poll_timeout().unwrap();
            l.handle_timeout(now);
        }
        assert_eq!(
            now - (t0 + Duration::from_secs(10)),
            Duration::from_millis(500)
        );
    }

    #[test]
    fn a_peer_that_does_not_read_is_unresponsive_after_the_timeout_of_blocked_writes() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, cfg());
        // The peer keeps talking (a PING every interval) but took none of our bytes since
        // 200 ms in.
        let blocked = t0 + Duration::from_millis(200);
        let mut now = t0;
        loop {
            now += Duration::from_millis(100);
            l.handle_frame(now, &Frame::Ping(now.duration_since(t0).as_millis() as u64));
            l.handle_write_blocked((now >= blocked).then_some(blocked));
            assert!(l.poll_timeout().unwrap() <= blocked.max(now) + cfg().timeout);
            l.handle_timeout(now);
            if let Some(e) = l.poll_event() {
                assert_eq!(
                    e,
                    LivenessEvent::NotReading {
                        blocked_for: Duration::from_millis(500)
                    }
                );
                break;
            }
            assert!(now < t0 + Duration::from_secs(5), "never declared");
        }
        assert_eq!(now, blocked + cfg().timeout);
        assert!(l.is_unresponsive());
        assert_eq!(l.poll_timeout(), None);
    }

    #[test]
    fn writes_that_progress_keep_a_slow_reader_alive_and_a_stall_of_this_node_restarts_the_count() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, cfg());
        // Blocked 400 ms at a time, then some bytes go: never the 500 ms timeout.
        for i in 0..20u64 {
            let now = t0 + Duration::from_millis(100 * i);
            l.handle_frame(now, &Frame::Ping(i));
            l.handle_write_blocked(Some(t0 + Duration::from_millis(400 * (i / 4))));
            l.handle_timeout(now);
            assert_eq!(l.poll_event(), None, "at {i}");
        }
        // Blocked since 2.0 s; this node then did not run until 4.0 s (stopped): the count
        // restarts at 4.0 s instead of blaming the peer.
        let mut l = Liveness::new(t0, cfg());
        l.handle_write_blocked(Some(t0 + Duration::from_millis(100)));
        l.handle_frame(t0 + Duration::from_millis(100), &Frame::Ping(1));
        l.handle_timeout(t0 + Duration::from_millis(100));
        let late = t0 + Duration::from_secs(4);
        l.handle_frame(late, &Frame::Ping(2));
        l.handle_timeout(late);
        assert_eq!(l.poll_event(), None);
        assert_eq!(l.stats().local_stalls, 1);
        // From then on this node runs on time, the peer talks, and the block goes on.
        let (declared, now) = loop {
            let now = l.poll_timeout().unwrap();
            l.handle_frame(now, &Frame::Ping(4));
            l.handle_timeout(now);
            if let Some(e) = l.poll_event() {
                break (e, now);
            }
        };
        assert_eq!(
            declared,
            LivenessEvent::NotReading {
                blocked_for: Duration::from_millis(500)
            }
        );
        assert_eq!(now, late + Duration::from_millis(500));
    }

    /// `n` PINGs at `now`; the PONGs they got.
    fn pings(l: &mut Liveness, now: Instant, n: u64) -> usize {
        for i in 0..n {
            assert!(l.handle_frame(now, &Frame::Ping(i)));
        }
        std::iter::from_fn(|| l.poll_transmit())
            .filter(|f| matches!(f, Frame::Pong(_)))
            .count()
    }

    #[test]
    fn a_ping_flood_gets_a_bounded_number_of_pongs() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, cfg());
        // Half the flood limit within one interval, then the other half within the next:
        // both in one flood window, so at the limit and not beyond it.
        let half = u64::from(PING_FLOOD_LIMIT / 2);
        let pongs = pings(&mut l, t0 + Duration::from_millis(50), half)
            + pings(&mut l, t0 + Duration::from_millis(150), half);
        assert_eq!(pongs, 2 * PONGS_PER_INTERVAL as usize);
        assert_eq!(l.stats().pings_received, 2 * half);
        assert_eq!(
            l.stats().pings_unanswered,
            2 * half - 2 * PONGS_PER_INTERVAL as u64
        );
        assert_eq!(l.poll_event(), Some(LivenessEvent::PingsUnanswered));
        assert_eq!(
            l.poll_event(),
            None,
            "reported once, and no flood at the limit"
        );
        assert!(!l.is_unresponsive());
    }

    #[test]
    fn pings_beyond_the_flood_limit_within_a_second_close_the_connection() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, cfg());
        let limit = u64::from(PING_FLOOD_LIMIT);
        // The limit in one window, then one more 900 ms after the window's first PING.
        assert_eq!(
            pings(&mut l, t0 + Duration::from_millis(100), limit),
            PONGS_PER_INTERVAL as usize
        );
        assert_eq!(l.poll_event(), Some(LivenessEvent::PingsUnanswered));
        assert!(l.handle_frame(t0 + Duration::from_millis(1000), &Frame::Ping(0)));
        assert_eq!(
            l.poll_event(),
            Some(LivenessEvent::PingFlood {
                pings: PING_FLOOD_LIMIT + 1,
                within: Duration::from_millis(900)
            })
        );
        assert!(l.is_unresponsive());
        assert_eq!(l.poll_timeout(), None, "nothing more to do");
        assert_eq!(pings(&mut l, t0 + Duration::from_millis(1001), 10), 0);
        assert_eq!(l.poll_event(), None, "declared once");
    }

    #[test]
    fn the_flood_window_restarts_each_second_and_after_a_stall_of_this_node() {
        let t0 = Instant::now();
        // A timeout longer than the second between the bursts, which are all that is heard.
        let config = LivenessConfig {
            timeout: Duration::from_secs(5),
            ..cfg()
        };
        let mut l = Liveness::new(t0, config);
        let most = u64::from(PING_FLOOD_LIMIT) - 1;
        // This node's timer fires when asked, up to `until`.
        let run_until = |l: &mut Liveness, until: Instant| {
            while let Some(due) = l.poll_timeout().filter(|&due| due <= until) {
                l.handle_timeout(due);
                while l.poll_transmit().is_some() {}
            }
        };
        // Just under the limit in each of three windows a second apart.
        for s in 0..3u64 {
            let now = t0 + Duration::from_millis(1000 * s + 10);
            run_until(&mut l, now);
            pings(&mut l, now, most);
        }
        // Just under it again; then this node stalls (its timer fires late), and PINGs
        // queued behind the stall arrive at once: a new window, not a flood.
        let before = t0 + Duration::from_millis(3010);
        run_until(&mut l, before);
        pings(&mut l, before, most);
        assert_eq!(l.stats().local_stalls, 0);
        let late = l.poll_timeout().unwrap() + Duration::from_millis(300);
        l.handle_timeout(late);
        assert_eq!(l.stats().local_stalls, 1);
        pings(&mut l, late, most);
        assert!(!l.is_unresponsive());
        let events: Vec<_> = std::iter::from_fn(|| l.poll_event()).collect();
        assert_eq!(events, vec![LivenessEvent::PingsUnanswered]);
    }
}
