//! The simulated wire between a loopback sender and receiver: one FIFO queue per direction,
//! a fixed one-way latency, and the wakers of the two sides.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::{Duration, Instant};

use kvwire_proto::wire::TransferRef;

use crate::memory::{AccessKey, PagePool};

/// One page write (all buffers of one page index) in flight. Like an RDMA WRITE it reads its
/// source memory when it lands, so the sender must not reuse the source page before the
/// write's completion.
#[derive(Clone, Debug)]
pub(crate) struct WriteOp {
    pub(crate) transfer: TransferRef,
    pub(crate) key: AccessKey,
    pub(crate) ordinal: u32,
    pub(crate) src_page: u32,
    pub(crate) dst_page: u32,
    pub(crate) src: Arc<PagePool>,
}

/// Something on the wire.
#[derive(Clone, Debug)]
pub(crate) enum Packet {
    /// An encoded control frame.
    Frame(Vec<u8>),
    /// A page write, sender to receiver.
    Write(WriteOp),
    /// A page write's completion, receiver to sender (the RC acknowledgement).
    WriteAck { transfer: TransferRef, ok: bool },
    /// The other side closed the connection; arrives after every packet sent before it.
    Closed,
}

/// Which way a packet travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Sender (prefill) to receiver (decode).
    ToReceiver,
    /// Receiver to sender.
    ToSender,
}

impl Direction {
    fn index(self) -> usize {
        match self {
            Self::ToReceiver => 0,
            Self::ToSender => 1,
        }
    }
}

/// Counters of what crossed the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WireStats {
    /// Frames sent (both ways).
    pub frames: u64,
    /// Page writes posted.
    pub writes_posted: u64,
    /// Page writes that landed.
    pub writes_landed: u64,
    /// Page writes refused at the receiver (no scope, or out of scope).
    pub writes_refused: u64,
    /// Bytes landed in the receiver's memory.
    pub bytes_landed: u64,
}

#[derive(Debug, Default)]
struct Queues {
    queues: [VecDeque<(Instant, Packet)>; 2],
    wakers: [Option<Waker>; 2],
    stats: WireStats,
}

/// The shared state of one loopback connection.
#[derive(Debug)]
pub(crate) struct Wire {
    latency: Duration,
    state: Mutex<Queues>,
}

impl Wire {
    pub(crate) fn new(latency: Duration) -> Arc<Self> {
        Arc::new(Self {
            latency,
            state: Mutex::new(Queues::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Queues> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Puts `packet` on the wire one way, due `latency` after `now` and never before a
    /// packet sent earlier the same way (FIFO), and wakes the side it travels to.
    pub(crate) fn push(&self, dir: Direction, now: Instant, packet: Packet) {
        let mut s = self.lock();
        match &packet {
            Packet::Frame(_) => s.stats.frames += 1,
            Packet::Write(_) => s.stats.writes_posted += 1,
            _ => {}
        }
        let q = &mut s.queues[dir.index()];
        let at = q.back().map_or(now + self.latency, |(last, _)| {
            (*last).max(now + self.latency)
        });
        q.push_back((at, packet));
        if let Some(w) = s.wakers[dir.index()].take() {
            w.wake();
        }
    }

    /// The next packet travelling `dir` that is due at `now`, or `None` having registered
    /// `waker` to be woken by the next push that way.
    pub(crate) fn pop(&self, dir: Direction, now: Instant, waker: &Waker) -> Option<Packet> {
        let mut s = self.lock();
        let due = s.queues[dir.index()]
            .front()
            .is_some_and(|(at, _)| *at <= now);
        if due {
            return s.queues[dir.index()].pop_front().map(|(_, p)| p);
        }
        s.wakers[dir.index()] = Some(waker.clone());
        None
    }

    /// When the next packet travelling `dir` is due.
    pub(crate) fn next_due(&self, dir: Direction) -> Option<Instant> {
        self.lock().queues[dir.index()].front().map(|(at, _)| *at)
    }

    /// Takes every write a closing sender still has on the wire (its queue is flushed: they
    /// never land and never read their source pages again).
    pub(crate) fn flush_writes(&self) -> Vec<WriteOp> {
        let mut s = self.lock();
        let q = &mut s.queues[Direction::ToReceiver.index()];
        let mut flushed = Vec::new();
        q.retain(|(_, p)| match p {
            Packet::Write(op) => {
                flushed.push(op.clone());
                false
            }
            _ => true,
        });
        flushed
    }

    pub(crate) fn count_landed(&self, bytes: u64) {
        let mut s = self.lock();
        s.stats.writes_landed += 1;
        s.stats.bytes_landed += bytes;
    }

    pub(crate) fn count_refused(&self) {
        self.lock().stats.writes_refused += 1;
    }

    pub(crate) fn stats(&self) -> WireStats {
        self.lock().stats
    }

    /// Whether nothing is in flight either way.
    pub(crate) fn is_idle(&self) -> bool {
        self.lock().queues.iter().all(VecDeque::is_empty)
    }
}
