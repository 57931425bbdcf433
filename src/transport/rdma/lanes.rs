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
    outbox: VecDeque<Vec<u8>>,
    sealer: Option<Sealer>,
    opener: Option<Opener>,
    /// Send-queue work requests posted and not yet retired by a completion.
    pub(crate) wrs_in_flight: u32,
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
        }
    }

    /// Seals (authenticates, when the connection is) and queues a frame for a SEND.
    pub(crate) fn queue(&mut self, frame: &Frame) {
        let r = match &mut self.sealer {
            Some(s) => s.seal_to_vec(frame),
            None => frame.to_bytes(),
        };
        match r {
            Ok(b) => self.outbox.push_back(b),
            Err(e) => tracing::error!(error = %e, "frame could not be encoded; dropped"),
        }
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

    /// Posts queued frames while send slots are free.
    pub(crate) fn flush(&mut self) -> Result<(), RdmaError> {
        while let Some(f) = self.outbox.front() {
            match self.link.post_frame(f) {
                Ok(()) => {
                    self.outbox.pop_front();
                }
                Err(RdmaError::SendSlotsBusy) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
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
        }
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

    /// This side's queue pair parameters, lane 0 first.
    pub(crate) fn params(&self) -> Vec<QpParams> {
        self.lanes.iter().map(|l| l.link.params()).collect()
    }

    /// Connects lane `i` to the peer's lane `i` (the counts must match).
    pub(crate) fn connect(&mut self, peer: &[QpParams]) -> Result<(), RdmaError> {
        if peer.len() != self.lanes.len() {
            return Err(RdmaError::Lanes {
                local: self.lanes.len(),
                peer: peer.len(),
            });
        }
        for (l, p) in self.lanes.iter_mut().zip(peer) {
            l.link.connect(p)?;
        }
        Ok(())
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

    /// Since when some lane's SENDs have made no progress ([`RcLink::sends_stalled_since`]),
    /// the earliest over the lanes: what [`Transport::write_blocked_since`] reports over RDMA
    /// (SPEC §8.3, a peer that does not read).
    ///
    /// [`Transport::write_blocked_since`]: crate::transport::Transport::write_blocked_since
    pub(crate) fn sends_stalled_since(&self) -> Option<std::time::Instant> {
        self.lanes
            .iter()
            .filter_map(|l| l.link.sends_stalled_since())
            .min()
    }

    /// Posts every lane's queued frames.
    pub(crate) fn flush_frames(&mut self) -> Result<(), RdmaError> {
        for l in &mut self.lanes {
            l.flush()?;
        }
        Ok(())
    }

    /// Takes the completions of every lane, `f(lane, event)` for each. Returns whether there
    /// were any.
    pub(crate) fn poll_completions(
        &mut self,
        mut f: impl FnMut(&mut Lane, usize, RdmaEvent),
    ) -> Result<bool, RdmaError> {
        let mut any = false;
        for i in 0..self.lanes.len() {
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
    /// One pass over the lanes: posts queued frames, takes every completion (`on(lane, i,
    /// event)` for each; an event that breaks the link returns why), watches the bootstrap
    /// connection, and waits on the completion channel when nothing happened. `Ready(Ok)`:
    /// something happened (poll again); `Ready(Err(why))`: the connection must end;
    /// `Pending`: nothing, the waker registered.
    pub(crate) fn poll_pass(
        &mut self,
        cx: &mut Context<'_>,
        mut on: impl FnMut(&mut Lane, usize, LaneEvent) -> Option<Closed>,
    ) -> Poll<Result<(), Closed>> {
        if let Err(e) = self.flush_frames() {
            return Poll::Ready(Err(Closed::LinkFailed(e.to_string())));
        }
        let mut broken: Option<Closed> = None;
        let polled = self.poll_completions(|lane, i, e| {
            let why = match e {
                RdmaEvent::Frame(bytes) => match lane.open(&bytes) {
                    Ok(f) => on(lane, i, LaneEvent::Frame(f)),
                    Err(why) => Some(why),
                },
                RdmaEvent::SendFailed(status) => Some(Closed::LinkFailed(format!(
                    "a SEND on lane {i} failed with status {status}"
                ))),
                RdmaEvent::WriteDone { wr_id, ok } => {
                    on(lane, i, LaneEvent::WriteDone { wr_id, ok })
                }
                RdmaEvent::LocalDone { wr_id, ok } => {
                    on(lane, i, LaneEvent::LocalDone { wr_id, ok })
                }
            };
            if let Some(why) = why {
                broken.get_or_insert(why);
            }
        });
        let polled = match polled {
            Ok(p) => p,
            Err(e) => return Poll::Ready(Err(Closed::LinkFailed(e.to_string()))),
        };
        if let Some(why) = broken.or_else(|| self.poll_peer_gone(cx)) {
            return Poll::Ready(Err(why));
        }
        if polled {
            return Poll::Ready(Ok(()));
        }
        match self.poll_wait(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(Closed::LinkFailed(e.to_string()))),
            Poll::Pending => Poll::Pending,
        }
    }
}
