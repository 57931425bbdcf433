//! Lanes: the queue pairs of one connection, each with its frames' outbox and its lane of
//! the connection's authentication channel (SPEC.md §3.11.1), and what both ends do with
//! them: poll their completions, wait on the completion channel, watch the bootstrap
//! connection, reset them all when one fails.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use kvwire_proto::auth::{AuthChannel, OpenError, Opener, Sealer};
use kvwire_proto::wire::Frame;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;

use super::events::EventChannel;
use super::link::{QpParams, RcLink, RdmaEvent};
use super::verbs::RdmaError;
use crate::transport::Closed;

/// One queue pair of a connection and what travels on it.
pub(crate) struct Lane {
    pub(crate) link: RcLink,
    /// The rail (the connection's device, in the order the node names its devices) whose
    /// queue pair this is.
    pub(crate) rail: usize,
    /// Frames waiting for a send slot, sealed only as they are posted (so a dead lane's
    /// frames can move to another lane and be sealed by it).
    outbox: VecDeque<Frame>,
    sealer: Option<Sealer>,
    opener: Option<Opener>,
    /// Send-queue work requests posted and not yet retired by a completion.
    pub(crate) wrs_in_flight: u32,
    /// The queue pair failed and was reset: nothing is posted on this lane any more for the
    /// rest of the connection (SPEC §9.2, several rails).
    pub(crate) dead: bool,
}

impl Lane {
    pub(crate) fn new(link: RcLink, rail: usize) -> Self {
        Self {
            link,
            rail,
            outbox: VecDeque::new(),
            sealer: None,
            opener: None,
            wrs_in_flight: 0,
            dead: false,
        }
    }

    /// Queues a frame for a SEND on this lane (sealed when it is posted).
    pub(crate) fn queue(&mut self, frame: &Frame) {
        self.outbox.push_back(frame.clone());
    }

    /// Opens (checks the tag of, when authenticated) and decodes a received SEND; on failure,
    /// why the connection must close.
    pub(crate) fn open(&mut self, bytes: &[u8]) -> Result<Frame, Closed> {
        let r = match &mut self.opener {
            Some(o) => o.open(bytes),
            None => Frame::decode(bytes).map_err(OpenError::Decode),
        };
        match r {
            Ok((f, _)) => Ok(f),
            Err(OpenError::Auth(e)) => Err(Closed::Unauthentic(e)),
            Err(e) => Err(Closed::Malformed(e.to_string())),
        }
    }

    /// Frames queued and not yet posted (waiting for a send slot).
    pub(crate) fn unsent(&self) -> usize {
        self.outbox.len()
    }

    /// Seals (authenticates, when the connection is) and posts queued frames while send
    /// slots are free.
    pub(crate) fn flush(&mut self) -> Result<(), RdmaError> {
        while self.link.send_slot_free() {
            let Some(f) = self.outbox.pop_front() else {
                break;
            };
            let sealed = match &mut self.sealer {
                Some(s) => s.seal_to_vec(&f),
                None => f.to_bytes(),
            };
            match sealed {
                Ok(b) => self.link.post_frame(&b)?,
                Err(e) => tracing::error!(error = %e, "frame could not be encoded; dropped"),
            }
        }
        Ok(())
    }
}

/// What [`Lanes::lose_one`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LaneLoss {
    /// The lane was lost before: nothing to do.
    AlreadyDead,
    /// It is the last live lane: its failure ends the connection.
    Last,
    /// It is lost; the connection goes on over the others.
    Lost,
}

/// The queue pairs of one connection, how the driver waits for them, and the bootstrap
/// connection kept as the liveness channel.
pub(crate) struct Lanes {
    pub(crate) lanes: Vec<Lane>,
    /// The completion channels the lanes report to, one per rail (a channel belongs to one
    /// device); none: busy polling.
    events: Vec<EventChannel>,
    /// Whether every lane's completion queue has been armed since the last event.
    armed: bool,
    liveness: Option<TcpStream>,
    scratch: Vec<RdmaEvent>,
    /// Lanes whose queue pair failed in the last pass, with why: the end decides whether
    /// the connection goes on without them ([`Lanes::take_failed`]).
    failed: Vec<(usize, String)>,
}

impl Lanes {
    /// Lanes over `links`, each with its rail; `events`: the rails' completion channels.
    pub(crate) fn new(links: Vec<(RcLink, usize)>, events: Vec<EventChannel>) -> Self {
        Self {
            lanes: links
                .into_iter()
                .map(|(link, rail)| Lane::new(link, rail))
                .collect(),
            events,
            armed: false,
            liveness: None,
            scratch: Vec::new(),
            failed: Vec::new(),
        }
    }

    /// Lanes whose queue pair failed since the last call, with why (at most once each).
    pub(crate) fn take_failed(&mut self) -> Vec<(usize, String)> {
        let mut failed = std::mem::take(&mut self.failed);
        failed.sort_by_key(|(i, _)| *i);
        failed.dedup_by_key(|(i, _)| *i);
        failed.retain(|(i, _)| !self.lanes[*i].dead);
        failed
    }

    /// Lanes still alive.
    pub(crate) fn live(&self) -> usize {
        self.lanes.iter().filter(|l| !l.dead).count()
    }

    /// Where a frame meant for `lane` goes: that lane, or the lowest live one if it is dead
    /// (SPEC §9.2, several rails). `lane` when none is alive (the connection is ending).
    pub(crate) fn route(&self, lane: usize) -> usize {
        if !self.lanes[lane].dead {
            return lane;
        }
        self.lanes.iter().position(|l| !l.dead).unwrap_or(lane)
    }

    /// Lane `i`'s queue pair failed (`why`): [`LaneLoss::AlreadyDead`] if it was lost
    /// before, [`LaneLoss::Last`] if no other lane lives (the connection's failure, left to
    /// the caller), else it is lost ([`Lanes::lose`], with one log line) and the connection
    /// goes on over the others (SPEC §9.2, a lane that fails).
    pub(crate) fn lose_one(&mut self, i: usize, why: &str) -> LaneLoss {
        if self.lanes[i].dead {
            return LaneLoss::AlreadyDead;
        }
        if self.live() <= 1 {
            return LaneLoss::Last;
        }
        tracing::warn!(lane = i, rail = self.lanes[i].rail, why = %why,
            "a queue pair failed; the connection goes on over its other lanes");
        self.lose(i);
        LaneLoss::Lost
    }

    /// Lane `i` failed and the connection goes on without it: its queue pair is reset (none
    /// of its work requests touches memory after this, and nothing more arrives through it),
    /// it is marked dead, and its unsent frames move to the lowest live lane.
    fn lose(&mut self, i: usize) {
        if let Err(e) = self.lanes[i].link.recover() {
            tracing::error!(error = %e, lane = i, "queue pair reset failed");
        }
        let lane = &mut self.lanes[i];
        lane.dead = true;
        lane.wrs_in_flight = 0;
        let frames: Vec<Frame> = lane.outbox.drain(..).collect();
        let to = self.route(i);
        if to != i {
            self.lanes[to].outbox.extend(frames);
        }
    }

    /// Drops the frames queued on any lane and not yet posted that `stale` picks (a
    /// reservation's RESERVE once its transfer was lost: its access names windows that are
    /// gone).
    pub(crate) fn drop_unsent(&mut self, mut stale: impl FnMut(&Frame) -> bool) {
        for lane in &mut self.lanes {
            lane.outbox.retain(|f| !stale(f));
        }
    }

    /// Lane `i` takes no part in this connection from its start (its rail is down at this
    /// end, or at the peer's): it is dead before anything was posted on it, its queue pair
    /// never connected, and its record says so to the peer ([`QpParams::DOWN`]).
    pub(crate) fn leave_out(&mut self, i: usize, why: &str) {
        if self.lanes[i].dead {
            return;
        }
        tracing::warn!(lane = i, rail = self.lanes[i].rail, why = %why,
            "a lane is left out of the connection: its rail is down");
        self.lanes[i].dead = true;
    }

    /// Keeps the bootstrap connection: its end is the peer's end.
    pub(crate) fn watch(&mut self, stream: TcpStream) {
        self.liveness = Some(stream);
    }

    /// Authenticates the frames of each lane with its lane of the connection's channel.
    pub(crate) fn set_auth(&mut self, channel: AuthChannel) {
        let n = self.lanes.len() as u16;
        for (lane, c) in self.lanes.iter_mut().zip(channel.lanes(n)) {
            let (s, o) = c.split();
            lane.sealer = Some(s);
            lane.opener = Some(o);
        }
    }

    /// The local ACK timeout exponent each queue pair holds (`ibv_query_qp`), in lane order.
    pub(crate) fn ack_timeouts(&self) -> Result<Vec<u8>, RdmaError> {
        self.lanes.iter().map(|l| l.link.ack_timeout()).collect()
    }

    /// This side's queue pair parameters, lane 0 first ([`QpParams::DOWN`] for a lane left
    /// out, [`Lanes::leave_out`]).
    pub(crate) fn params(&self) -> Vec<QpParams> {
        self.lanes
            .iter()
            .map(|l| {
                if l.dead {
                    QpParams::DOWN
                } else {
                    l.link.params()
                }
            })
            .collect()
    }

    /// Connects lane `i` to the peer's lane `i` (the counts must match); a lane left out at
    /// either end stays unconnected and dead, and at least one lane must be left.
    pub(crate) fn connect(&mut self, peer: &[QpParams]) -> Result<(), RdmaError> {
        if peer.len() != self.lanes.len() {
            return Err(RdmaError::Lanes {
                local: self.lanes.len(),
                peer: peer.len(),
            });
        }
        for (i, p) in peer.iter().enumerate() {
            if p.is_down() {
                self.leave_out(i, "the peer's rail for it is down");
            }
        }
        if self.live() == 0 {
            return Err(RdmaError::NoLiveLane {
                lanes: self.lanes.len(),
            });
        }
        // A lane that cannot connect (its rail went down after the parameters were taken:
        // RTR fails with "network unreachable") is dead from the start here while another
        // lane connects; the peer finds it failed as any failed lane (its SENDs there make no
        // progress), and moves what it reserved there (SPEC §9.2).
        let mut first_error = None;
        for (i, (l, p)) in self.lanes.iter_mut().zip(peer).enumerate() {
            if l.dead {
                continue;
            }
            if let Err(e) = l.link.connect(p) {
                tracing::warn!(lane = i, rail = l.rail, error = %e,
                    "a lane could not connect; the connection goes on without it");
                if let Err(r) = l.link.recover() {
                    tracing::error!(error = %r, lane = i, "queue pair reset failed");
                }
                l.dead = true;
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) if self.live() == 0 => Err(e),
            _ => Ok(()),
        }
    }

    /// Resets every lane's queue pair: after this none of their work requests touches
    /// memory any more. Queued frames are dropped.
    pub(crate) fn reset(&mut self) {
        for l in &mut self.lanes {
            if let Err(e) = l.link.recover() {
                tracing::error!(error = %e, "queue pair reset failed");
            }
            l.outbox.clear();
            l.wrs_in_flight = 0;
        }
        self.liveness = None;
    }

    /// Logs each lane's state (the queue pair as the device reports it, what is outstanding
    /// on it, since when its SENDs made no progress): the diagnostic of a connection closed
    /// for an unresponsive peer ([`Transport::log_state`]).
    ///
    /// [`Transport::log_state`]: crate::transport::Transport::log_state
    pub(crate) fn log_state(&self) {
        let now = std::time::Instant::now();
        for (i, l) in self.lanes.iter().enumerate() {
            let stalled_ms = l
                .link
                .sends_stalled_since()
                .map(|t| now.saturating_duration_since(t).as_millis() as u64);
            tracing::warn!(
                lane = i,
                rail = l.rail,
                dead = l.dead,
                writes_in_flight = l.wrs_in_flight,
                frames_unsent = l.unsent(),
                sends_stalled_ms = ?stalled_ms,
                "lane state: {}",
                l.link.describe()
            );
        }
    }

    /// Since when some lane's SENDs have made no progress ([`RcLink::sends_stalled_since`]),
    /// the earliest over the lanes: what [`Transport::write_blocked_since`] reports over RDMA
    /// (SPEC §8.3, a peer that does not read).
    ///
    /// [`Transport::write_blocked_since`]: crate::transport::Transport::write_blocked_since
    pub(crate) fn sends_stalled_since(&self) -> Option<std::time::Instant> {
        self.lanes
            .iter()
            .filter(|l| !l.dead)
            .filter_map(|l| l.link.sends_stalled_since())
            .min()
    }

    /// A live lane whose SENDs have made no progress for `after` while another live lane's
    /// did since (or has nothing outstanding), with why: the peer reads, but not through that
    /// queue pair, so the lane has failed (SPEC §9.2, a lane that fails). `None` with one live
    /// lane (the connection-wide rule of §8.3 judges it).
    pub(crate) fn stalled_lane(
        &self,
        now: std::time::Instant,
        after: std::time::Duration,
    ) -> Option<(usize, String)> {
        if self.live() < 2 {
            return None;
        }
        let i = self.lanes.iter().enumerate().find_map(|(i, l)| {
            let since = l.link.sends_stalled_since().filter(|_| !l.dead)?;
            if now.saturating_duration_since(since) < after {
                return None;
            }
            let others_move = self.lanes.iter().enumerate().any(|(j, m)| {
                j != i && !m.dead && m.link.sends_stalled_since().is_none_or(|t| t > since)
            });
            others_move.then_some(i)
        })?;
        let link = &self.lanes[i].link;
        let (sends, signaled) = link.sends_outstanding();
        Some((
            i,
            format!(
                "the SENDs of lane {i} made no progress for {after:?} while another lane's did \
                 ({sends} SENDs outstanding, {signaled} of them signaled; {} receives posted)",
                link.receives_posted()
            ),
        ))
    }

    /// Queues `frame` on `lane` (or on the lowest live lane if that one is dead). At the
    /// bound of frames held unsent for the peer (SPEC §8.3,
    /// [`MAX_UNSENT_FRAMES`](crate::transport::MAX_UNSENT_FRAMES)), why the connection must
    /// close: the peer takes none of the frames it asks for.
    pub(crate) fn queue(&mut self, lane: usize, frame: &Frame) -> Option<Closed> {
        let lane = self.route(lane);
        self.lanes[lane].queue(frame);
        let unsent = self.lanes[lane].unsent();
        if unsent < crate::transport::MAX_UNSENT_FRAMES {
            return None;
        }
        let blocked_for = self
            .sends_stalled_since()
            .map_or(std::time::Duration::ZERO, |t| {
                std::time::Instant::now().saturating_duration_since(t)
            });
        tracing::warn!(
            lane,
            frames = unsent,
            "the peer takes none of the frames it asks for; closing the connection"
        );
        Some(Closed::Unresponsive {
            silent_for: blocked_for,
        })
    }

    /// Queues `frame` on `lane`, or, for a PING while two lanes or more live, on every live
    /// lane (SPEC §9.2, a lane that fails): each lane then carries a SEND per heartbeat
    /// interval, so a lane that no longer delivers is found by [`Lanes::stalled_lane`] at
    /// this end too, not only at the end whose writes use it. Why the connection must close,
    /// as [`Lanes::queue`].
    pub(crate) fn queue_frame(&mut self, lane: usize, frame: &Frame) -> Option<Closed> {
        if !matches!(frame, Frame::Ping(_)) || self.live() < 2 {
            return self.queue(lane, frame);
        }
        let live: Vec<usize> = (0..self.lanes.len())
            .filter(|&i| !self.lanes[i].dead)
            .collect();
        live.into_iter().find_map(|i| self.queue(i, frame))
    }

    /// When [`Lanes::stalled_lane`] may next find a lane, with two lanes or more alive.
    pub(crate) fn next_stall_check(
        &self,
        after: std::time::Duration,
    ) -> Option<std::time::Instant> {
        if self.live() < 2 {
            return None;
        }
        self.lanes
            .iter()
            .filter(|l| !l.dead)
            .filter_map(|l| l.link.sends_stalled_since())
            .min()
            .map(|t| t + after)
    }

    /// Posts every live lane's queued frames; a lane that cannot post is recorded as failed
    /// ([`Lanes::take_failed`]).
    pub(crate) fn flush_frames(&mut self) {
        for (i, l) in self.lanes.iter_mut().enumerate() {
            if l.dead {
                continue;
            }
            if let Err(e) = l.flush() {
                self.failed
                    .push((i, format!("posting a SEND on lane {i}: {e}")));
            }
        }
    }

    /// Takes the completions of every lane, `f(lane, event)` for each. Returns whether there
    /// were any.
    pub(crate) fn poll_completions(
        &mut self,
        mut f: impl FnMut(&mut Lane, usize, RdmaEvent),
    ) -> Result<bool, RdmaError> {
        let mut any = false;
        for i in 0..self.lanes.len() {
            if self.lanes[i].dead {
                continue;
            }
            self.scratch.clear();
            self.lanes[i].link.poll(&mut self.scratch)?;
            any |= !self.scratch.is_empty();
            for e in self.scratch.drain(..) {
                f(&mut self.lanes[i], i, e);
            }
        }
        if any {
            self.armed = false;
        }
        Ok(any)
    }

    /// After a poll found nothing: whether the completion queues may have completions again
    /// (`Ready`: poll them), having armed them and registered `cx` with the completion
    /// channel. Busy polling wakes the task at once.
    pub(crate) fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), RdmaError>> {
        if self.events.is_empty() {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if !self.armed {
            for l in &self.lanes {
                l.link.arm()?;
            }
            self.armed = true;
            // A completion that came before the arm raised no event: poll once more.
            return Poll::Ready(Ok(()));
        }
        // Every rail's channel registers the waker; any event means: poll the lanes.
        let mut ready = false;
        for ch in &self.events {
            match ch.poll_events(cx) {
                Poll::Ready(Ok(())) => ready = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        if ready {
            self.armed = false;
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    /// Whether the peer closed the bootstrap connection (or its process died). Never blocks.
    /// Nothing is sent on it after the ready byte, so any byte counts as the peer being gone
    /// too (a protocol violation).
    pub(crate) fn poll_peer_gone(&mut self, cx: &mut Context<'_>) -> Option<Closed> {
        let stream = self.liveness.as_mut()?;
        let mut b = [0u8; 16];
        let mut buf = ReadBuf::new(&mut b);
        match Pin::new(stream).poll_read(cx, &mut buf) {
            Poll::Pending => None,
            Poll::Ready(Ok(())) if buf.filled().is_empty() => {
                Some(Closed::PeerGone(crate::transport::Gone::BootstrapClosed))
            }
            Poll::Ready(Ok(())) => Some(Closed::Malformed(
                "bytes on the RDMA bootstrap connection after the handshake".into(),
            )),
            Poll::Ready(Err(e)) => Some(Closed::PeerGone(crate::transport::Gone::from(&e))),
        }
    }
}

/// What a lane reports to its end of the connection, after the work both ends do alike
/// (opening frames, noticing a failed SEND).
pub(crate) enum LaneEvent {
    /// A control frame, opened.
    Frame(Frame),
    /// A signaled write completed.
    WriteDone { wr_id: u64, ok: bool },
    /// A memory-window bind or invalidation completed.
    LocalDone { wr_id: u64, ok: bool },
}

impl Lanes {
    /// One pass over the live lanes: posts queued frames, takes every completion (`on(lane,
    /// i, event)` for each; an event that breaks something returns why: a queue pair's
    /// failure, [`Closed::LinkFailed`], is recorded as its lane's for [`Lanes::take_failed`],
    /// anything else ends the connection), watches the bootstrap connection, and waits on the
    /// completion channels when nothing happened. `Ready(Ok)`: something happened (poll
    /// again, and take the failed lanes); `Ready(Err(why))`: the connection must end;
    /// `Pending`: nothing, the waker registered.
    pub(crate) fn poll_pass(
        &mut self,
        cx: &mut Context<'_>,
        mut on: impl FnMut(&mut Lane, usize, LaneEvent) -> Option<Closed>,
    ) -> Poll<Result<(), Closed>> {
        self.flush_frames();
        let mut broken: Option<Closed> = None;
        let mut failed = Vec::new();
        let polled = self.poll_completions(|lane, i, e| {
            let why = match e {
                RdmaEvent::Frame(bytes) => match lane.open(&bytes) {
                    Ok(f) => on(lane, i, LaneEvent::Frame(f)),
                    Err(why) => Some(why),
                },
                RdmaEvent::SendFailed(status) => Some(Closed::LinkFailed(format!(
                    "a SEND on lane {i} failed with status {status}"
                ))),
                RdmaEvent::RecvFailed(status) => Some(Closed::LinkFailed(format!(
                    "a receive on lane {i} completed with status {status}: the queue pair is in error"
                ))),
                RdmaEvent::WriteDone { wr_id, ok } => {
                    on(lane, i, LaneEvent::WriteDone { wr_id, ok })
                }
                RdmaEvent::LocalDone { wr_id, ok } => {
                    on(lane, i, LaneEvent::LocalDone { wr_id, ok })
                }
            };
            match why {
                // A queue pair's failure is the lane's: the end decides whether the
                // connection goes on without it (Lanes::take_failed).
                Some(Closed::LinkFailed(m)) => failed.push((i, m)),
                Some(why) => {
                    broken.get_or_insert(why);
                }
                None => {}
            }
        });
        self.failed.extend(failed);
        let polled = match polled {
            Ok(p) => p,
            Err(e) => return Poll::Ready(Err(Closed::LinkFailed(e.to_string()))),
        };
        if let Some(why) = broken.or_else(|| self.poll_peer_gone(cx)) {
            return Poll::Ready(Err(why));
        }
        if polled || !self.failed.is_empty() {
            return Poll::Ready(Ok(()));
        }
        match self.poll_wait(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(Closed::LinkFailed(e.to_string()))),
            Poll::Pending => Poll::Pending,
        }
    }
}
