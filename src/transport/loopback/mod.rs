//! The in-process loopback transport: a simulated wire between two page pools in one
//! process.
//!
//! Control frames travel encoded (so the codec and its CRC are exercised); page writes
//! travel as descriptions whose bytes are copied from the sender's pool into the receiver's
//! when they land, like RDMA WRITEs. Delivery is FIFO per direction (the RC ordering the
//! protocol relies on), with a fixed latency. The receiving side is the NIC: it checks each
//! write against its access scopes ([`ScopeTable`]) and refuses (never lands) a write under a
//! closed or foreign scope, acknowledging it as failed.
//!
//! The two ends share the wire and wake each other, so they can run as two tokio tasks with
//! real time (`kvwire bench --transport loopback`), or be polled by one harness with
//! simulated time (the `Pair` of the `testkit` feature), which asks [`Transport::poll_timeout`]
//! when the next packet is due.
//!
//! As evidence for the safety invariants the receiving side also records every write that
//! lands in a page that is not leased to that write's reservation ([`LandingRecord`]): the
//! defect every fence exists to prevent. It must stay empty.

mod wire;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvwire_proto::sender::PageWrite;
use kvwire_proto::wire::{Frame, TransferRef};

pub use self::wire::WireStats;
use self::wire::{Direction, Packet, Wire, WriteOp};
use super::{Closed, Gone, SenderTransport, TableScoped, Transport, TransportEvent};
use crate::memory::{AccessKey, PagePool, PageState, ScopeTable};

/// The two ends of one loopback connection: the sender writes from `source` into `dest`.
/// `latency` is the one-way delay of every packet.
pub fn connect(
    source: Arc<PagePool>,
    dest: Arc<PagePool>,
    latency: Duration,
) -> (LoopbackSender, LoopbackReceiver) {
    let wire = Wire::new(latency);
    (
        LoopbackSender {
            wire: wire.clone(),
            source,
            outstanding: BTreeMap::new(),
            events: VecDeque::new(),
            closed: false,
        },
        LoopbackReceiver {
            wire,
            dest,
            scopes: ScopeTable::default(),
            generations: HashMap::new(),
            landings: Arc::default(),
            events: VecDeque::new(),
            closed: false,
        },
    )
}

/// The sending end of a loopback connection.
#[derive(Debug)]
pub struct LoopbackSender {
    wire: Arc<Wire>,
    source: Arc<PagePool>,
    /// Page writes on the wire (or landed, acknowledgement on its way) per reservation.
    outstanding: BTreeMap<TransferRef, u32>,
    events: VecDeque<TransportEvent>,
    closed: bool,
}

impl LoopbackSender {
    /// What crossed the wire (both directions).
    pub fn stats(&self) -> WireStats {
        self.wire.stats()
    }

    /// Whether nothing is in flight either way.
    pub fn is_idle(&self) -> bool {
        self.wire.is_idle()
    }

    /// Ends the connection on this side: what is still on the wire from here is flushed
    /// (never lands), every outstanding write fails, and the peer learns of the close after
    /// the frames sent before it.
    fn shut(&mut self, why: Closed, now: Instant) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.wire.flush_writes();
        if why == Closed::Local {
            self.wire.push(Direction::ToReceiver, now, Packet::Closed);
        }
        for (transfer, pages) in std::mem::take(&mut self.outstanding) {
            self.events.push_back(TransportEvent::WritesDone {
                transfer,
                pages,
                ok: false,
            });
        }
        self.events.push_back(TransportEvent::Closed(why));
    }

    fn ended(&mut self, transfer: TransferRef, pages: u32) {
        if let Some(n) = self.outstanding.get_mut(&transfer) {
            *n = n.saturating_sub(pages);
            if *n == 0 {
                self.outstanding.remove(&transfer);
            }
        }
    }
}

impl Transport for LoopbackSender {
    fn send_frame(&mut self, now: Instant, frame: &Frame) {
        if self.closed {
            return;
        }
        match frame.to_bytes() {
            Ok(bytes) => self
                .wire
                .push(Direction::ToReceiver, now, Packet::Frame(bytes)),
            Err(e) => tracing::error!(error = %e, "frame could not be encoded; dropped"),
        }
    }

    fn poll_event(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<TransportEvent> {
        loop {
            if let Some(e) = self.events.pop_front() {
                return Poll::Ready(e);
            }
            if self.closed {
                return Poll::Pending;
            }
            let Some(packet) = self.wire.pop(Direction::ToSender, now, cx.waker()) else {
                return Poll::Pending;
            };
            match packet {
                Packet::Frame(bytes) => match Frame::decode(&bytes) {
                    Ok((frame, _)) => return Poll::Ready(TransportEvent::Frame(frame)),
                    // A frame that does not decode breaks the stream: close the connection.
                    Err(e) => self.shut(Closed::Malformed(e.to_string()), now),
                },
                Packet::WriteAck { transfer, ok } => {
                    self.ended(transfer, 1);
                    return Poll::Ready(TransportEvent::WritesDone {
                        transfer,
                        pages: 1,
                        ok,
                    });
                }
                Packet::Closed => self.shut(Closed::PeerGone(Gone::PeerClosed), now),
                Packet::Write(_) => {}
            }
        }
    }

    fn close(&mut self, now: Instant) {
        self.shut(Closed::Local, now);
    }

    fn poll_timeout(&self) -> Option<Instant> {
        // A closed end takes nothing more off the wire.
        (!self.closed)
            .then(|| self.wire.next_due(Direction::ToSender))
            .flatten()
    }
}

impl SenderTransport for LoopbackSender {
    fn write_credit(&self) -> usize {
        if self.closed {
            0
        } else {
            usize::MAX
        }
    }

    fn post_writes(
        &mut self,
        now: Instant,
        transfer: TransferRef,
        access: &Arc<[u8]>,
        writes: &[PageWrite],
    ) {
        let key = AccessKey::from_descriptor(access);
        let n = writes.len() as u32;
        let Some(key) = key.filter(|_| !self.closed) else {
            // Not a loopback descriptor (or closed): refused before posting.
            self.events.push_back(TransportEvent::WritesDone {
                transfer,
                pages: n,
                ok: false,
            });
            return;
        };
        *self.outstanding.entry(transfer).or_default() += n;
        for w in writes {
            self.wire.push(
                Direction::ToReceiver,
                now,
                Packet::Write(WriteOp {
                    transfer,
                    key,
                    ordinal: w.ordinal,
                    src_page: w.src_page,
                    dst_page: w.dst_page,
                    src: self.source.clone(),
                }),
            );
        }
    }
}

/// Writes that landed in a page not leased to their reservation (must stay empty), shared
/// with whoever checks the invariants.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LandingRecord {
    /// (reservation, page) of each illegal landing.
    pub illegal: Vec<(TransferRef, u32)>,
}

/// The receiving end of a loopback connection: the NIC of the decode side.
#[derive(Debug)]
pub struct LoopbackReceiver {
    wire: Arc<Wire>,
    dest: Arc<PagePool>,
    scopes: ScopeTable,
    /// The generation of each page of an open scope when it was opened: a write may land
    /// only while the page is still leased under that generation.
    generations: HashMap<u32, u32>,
    landings: Arc<Mutex<LandingRecord>>,
    events: VecDeque<TransportEvent>,
    closed: bool,
}

impl LoopbackReceiver {
    /// Every write that landed where it must not (shared: it stays readable after the
    /// transport is gone).
    pub fn landings(&self) -> Arc<Mutex<LandingRecord>> {
        self.landings.clone()
    }

    /// Lands one write: checks its scope (a fenced or foreign key is refused, nothing is
    /// written), copies the page of every buffer, and records a landing in a page no longer
    /// leased under the generation its scope was opened with.
    fn land(&mut self, op: &WriteOp) -> bool {
        if self.scopes.check(op.key, op.dst_page).is_err() {
            self.wire.count_refused();
            return false;
        }
        let leased = self.generations.get(&op.dst_page).is_some_and(|&g| {
            matches!(self.dest.state(op.dst_page),
                Some(PageState::Leased { generation } | PageState::Quarantined { generation })
                    if generation == g)
        });
        if !leased {
            let mut record = self.landings.lock().unwrap_or_else(|p| p.into_inner());
            record.illegal.push((op.transfer, op.dst_page));
        }
        let mut bytes = 0;
        for b in 0..self.dest.buffers() {
            let (Some(from), Some(mut to)) = (
                op.src.raw_page(op.src_page, b),
                self.dest.raw_page_mut(op.dst_page, b),
            ) else {
                continue;
            };
            let n = from.len().min(to.len());
            to[..n].copy_from_slice(&from[..n]);
            bytes += n as u64;
        }
        self.wire.count_landed(bytes);
        true
    }

    fn shut(&mut self, why: Closed, now: Instant) {
        if self.closed {
            return;
        }
        self.closed = true;
        if why == Closed::Local {
            self.wire.push(Direction::ToSender, now, Packet::Closed);
        }
        self.events.push_back(TransportEvent::Closed(why));
    }
}

impl Transport for LoopbackReceiver {
    fn send_frame(&mut self, now: Instant, frame: &Frame) {
        if self.closed {
            return;
        }
        match frame.to_bytes() {
            Ok(bytes) => self
                .wire
                .push(Direction::ToSender, now, Packet::Frame(bytes)),
            Err(e) => tracing::error!(error = %e, "frame could not be encoded; dropped"),
        }
    }

    fn poll_event(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<TransportEvent> {
        loop {
            if let Some(e) = self.events.pop_front() {
                return Poll::Ready(e);
            }
            if self.closed {
                return Poll::Pending;
            }
            let Some(packet) = self.wire.pop(Direction::ToReceiver, now, cx.waker()) else {
                return Poll::Pending;
            };
            match packet {
                Packet::Frame(bytes) => match Frame::decode(&bytes) {
                    Ok((frame, _)) => return Poll::Ready(TransportEvent::Frame(frame)),
                    Err(e) => self.shut(Closed::Malformed(e.to_string()), now),
                },
                Packet::Write(op) => {
                    let ok = self.land(&op);
                    self.wire.push(
                        Direction::ToSender,
                        now,
                        Packet::WriteAck {
                            transfer: op.transfer,
                            ok,
                        },
                    );
                    if ok {
                        return Poll::Ready(TransportEvent::Landed {
                            transfer: op.transfer,
                            ordinal: op.ordinal,
                            page: op.dst_page,
                            digests: None,
                        });
                    }
                }
                Packet::Closed => self.shut(Closed::PeerGone(Gone::PeerClosed), now),
                Packet::WriteAck { .. } => {}
            }
        }
    }

    fn close(&mut self, now: Instant) {
        self.shut(Closed::Local, now);
    }

    fn poll_timeout(&self) -> Option<Instant> {
        (!self.closed)
            .then(|| self.wire.next_due(Direction::ToReceiver))
            .flatten()
    }
}

impl TableScoped for LoopbackReceiver {
    fn scopes(&self) -> &ScopeTable {
        &self.scopes
    }

    fn scopes_mut(&mut self) -> &mut ScopeTable {
        &mut self.scopes
    }

    fn scope_opening(&mut self, pages: &[u32]) {
        // Remember each page's lease generation: a landing under another is illegal.
        for &p in pages {
            if let Some(PageState::Leased { generation }) = self.dest.state(p) {
                self.generations.insert(p, generation);
            }
        }
    }
}
