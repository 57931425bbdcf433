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

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::wire::Frame;

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
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LivenessStats {
    /// PINGs sent.
    pub pings_sent: u64,
    /// PONGs received that answered one of our PINGs.
    pub pongs_received: u64,
    /// PINGs received (each answered).
    pub pings_received: u64,
    /// Times the silence count was restarted because this node itself had not run.
    pub local_stalls: u64,
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
    transmit: VecDeque<Frame>,
    events: VecDeque<LivenessEvent>,
    stats: LivenessStats,
}

impl Liveness {
    /// Heartbeats for a connection established at `now` (the peer counts as heard then).
    pub fn new(now: Instant, mut config: LivenessConfig) -> Self {
        config.interval = config.interval.max(Duration::from_millis(1));
        config.timeout = config.timeout.max(config.interval * 2);
        Self {
            config,
            last_heard: now,
            next_ping: now,
            next_token: 1,
            outstanding: None,
            rtt: None,
            unresponsive: false,
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
                if !self.unresponsive {
                    self.transmit.push_back(Frame::Pong(token));
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

    /// When [`Liveness::handle_timeout`] must next be called; `None` once unresponsive.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.unresponsive {
            return None;
        }
        Some(self.next_ping.min(self.last_heard + self.config.timeout))
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
        }
        let silent_for = now.saturating_duration_since(self.last_heard);
        if silent_for >= self.config.timeout {
            self.unresponsive = true;
            self.transmit.clear();
            self.events
                .push_back(LivenessEvent::Unresponsive { silent_for });
            return;
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

    /// Whether the peer has been declared unresponsive.
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
}
