//! The decode end of a TCP connection: records in (page bytes straight into the destination
//! pages, under their access scopes), frames out.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvwire_proto::auth::{Opener, Sealer};
use kvwire_proto::wire::Frame;
use tokio::io::AsyncWrite;
use tokio::net::TcpStream;

use kvwire_proto::wire::TransferRef;

use super::pulls::{PullQueue, PullThreads};
use super::reader::StreamReader;
use super::records::{DataHeader, Record, StreamError, StreamStats};
use crate::memory::{PagePool, ScopeTable};
use crate::transport::staging::{Staging, StagingStats, STAGING_BUFFERS};
use crate::transport::{Closed, Gone, TableScoped, Transport, TransportEvent};

/// Frames handed to one vectored write.
const MAX_IOV: usize = 64;

/// The decode end of a TCP connection (after the handshake).
#[derive(Debug)]
pub struct TcpReceiver {
    stream: Option<TcpStream>,
    sealer: Sealer,
    reader: StreamReader,
    pool: Arc<PagePool>,
    scopes: ScopeTable,
    out: VecDeque<Vec<u8>>,
    /// Bytes of the front frame already written.
    front_written: usize,
    events: VecDeque<TransportEvent>,
    closed: bool,
    /// Device memory: records whose copy staging → device runs (in order), and their slot.
    copying: VecDeque<(DataHeader, usize)>,
    /// Device memory: fences waiting for those copies of their transfer to complete.
    fences: Vec<TransferRef>,
    /// Frames are held back until a batch's worth is queued ([`Transport::hold_writes`]).
    writes_held: bool,
    /// The driver's clock at the current `poll_event`.
    clock: Instant,
    /// Since when queued frames found no taker ([`Transport::write_blocked_since`]).
    blocked_since: Option<Instant>,
    /// When bytes last arrived ([`Transport::last_read`]).
    last_read: Option<Instant>,
    /// Same-host pulls on pull threads: the copies in flight and what waits behind them.
    pulls: Option<PullQueue>,
}

impl TcpReceiver {
    /// The decode end over `stream` (handshake done): frames sealed by `sealer` and opened
    /// by `opener` (the halves of the connection's authentication channel), page bytes
    /// landing in `pool`.
    pub fn new(stream: TcpStream, sealer: Sealer, opener: Opener, pool: Arc<PagePool>) -> Self {
        let mut reader = StreamReader::new(&pool.geometry().buffer_page_bytes).with_opener(opener);
        let record_len = pool.geometry().bytes_per_page_index() as usize;
        let staging = Staging::for_memory(pool.memory(), record_len, STAGING_BUFFERS);
        let failed = match staging {
            Ok(s) => {
                reader.staging = s;
                None
            }
            Err(e) => Some(e),
        };
        let mut receiver = Self {
            stream: Some(stream),
            sealer,
            reader,
            pool,
            scopes: ScopeTable::default(),
            out: VecDeque::new(),
            front_written: 0,
            events: VecDeque::new(),
            closed: false,
            copying: VecDeque::with_capacity(STAGING_BUFFERS),
            fences: Vec::new(),
            writes_held: false,
            clock: Instant::now(),
            blocked_since: None,
            last_read: None,
            pulls: None,
        };
        if let Some(e) = failed {
            receiver.shut(Closed::LinkFailed(format!("device staging: {e}")));
        }
        receiver
    }

    /// Lane `lane` of a connection over `lanes` TCP streams (SPEC §9.1, several streams):
    /// its access scopes take keys no other lane's table issues.
    pub fn with_lane(mut self, lane: u16, lanes: u16) -> Self {
        self.scopes = ScopeTable::with_key_space(u32::from(lane), u32::from(lanes));
        self
    }

    /// Same-host pulls (SPEC §9.3): the prefill's process was attested and may be read, so
    /// this end's reservations ask for pull records and copies their pages out of it with
    /// `puller`. Host memory only (ignored over device memory).
    pub fn with_pulls(mut self, puller: crate::transport::same_host::Puller) -> Self {
        if self.reader.staging.is_none() {
            self.reader.puller = Some(puller);
        }
        self
    }

    /// Same-host pulls copied on `threads` (the node's pull threads, shared by its
    /// connections and their streams; `crate::NodeConfig::pull_threads`) instead of on this
    /// stream's task: the task parses records, checks scopes and reports in stream order
    /// (see `pulls.rs`). Only after [`TcpReceiver::with_pulls`]; ignored otherwise.
    pub fn with_pull_threads(mut self, threads: Arc<PullThreads>) -> Self {
        if let Some(puller) = self.reader.puller {
            self.reader.pulls_elsewhere = true;
            self.pulls = Some(PullQueue::new(threads, puller, self.pool.clone()));
        }
        self
    }

    /// What the stream carried.
    pub fn stats(&self) -> StreamStats {
        self.reader.stats
    }

    /// Device memory: the staging pipeline's counters (`None` for host memory).
    pub fn staging_stats(&self) -> Option<StagingStats> {
        self.reader.staging.as_ref().map(|s| s.stats)
    }

    /// Device memory: reports the records whose copies into their pages completed, in
    /// order, as landed (a page has landed when its copy completed), and the fences that
    /// waited for them. Registers the waker for the first copy still running.
    fn poll_copies(&mut self, cx: &mut Context<'_>) {
        let Some(staging) = self.reader.staging.as_mut() else {
            return;
        };
        let mut failed = None;
        while let Some(&(header, slot)) = self.copying.front() {
            match staging.poll_slot(slot, Some(cx.waker())) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
            staging.release(slot);
            self.copying.pop_front();
            self.events.push_back(TransportEvent::Landed {
                transfer: header.transfer,
                ordinal: header.ordinal,
                page: header.dst_page,
                digests: None,
            });
        }
        if let Some(e) = failed {
            self.shut(Closed::LinkFailed(format!("device copy: {e}")));
            return;
        }
        self.report_fences();
    }

    /// Reports the fences no copy holds back any more.
    fn report_fences(&mut self) {
        let copying = &self.copying;
        let events = &mut self.events;
        self.fences.retain(|t| {
            let waits = copying
                .iter()
                .any(|(h, _)| h.transfer.transfer_id == t.transfer_id);
            if !waits {
                events.push_back(TransportEvent::Fenced(*t));
            }
            waits
        });
    }

    fn shut(&mut self, why: Closed) {
        if self.closed {
            return;
        }
        self.closed = true;
        // Dropping the socket closes it: nothing more is read into any page.
        self.stream = None;
        self.out.clear();
        // Copies into pages still in flight complete before anyone learns the connection
        // is gone (the driver then releases the pages); pending fences are then done.
        if let Some(st) = self.reader.staging.as_mut() {
            if let Err(e) = st.synchronize() {
                tracing::error!(error = %e, "staging copies failed at close");
            }
            for (_, slot) in self.copying.drain(..) {
                st.release(slot);
            }
        }
        // Likewise the pulls on pull threads; what was read before the close is reported
        // before it, in order, as on the inline path.
        if let Some(p) = self.pulls.as_mut() {
            p.finish(&mut self.events, &mut self.reader.stats);
        }
        self.report_fences();
        self.events.push_back(TransportEvent::Closed(why));
    }

    /// Whether queued frames go out now: not held, or a batch's worth is queued.
    fn write_now(&self) -> bool {
        !self.writes_held || self.out.len() >= super::HELD_WRITE_ITEMS
    }

    /// Writes queued frames until the socket would block, many per system call.
    fn poll_flush(&mut self, cx: &mut Context<'_>) {
        while !self.out.is_empty() {
            let Some(stream) = self.stream.as_mut() else {
                return;
            };
            let written = {
                let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(self.out.len().min(MAX_IOV));
                for (i, frame) in self.out.iter().take(MAX_IOV).enumerate() {
                    let skip = if i == 0 { self.front_written } else { 0 };
                    slices.push(IoSlice::new(&frame[skip..]));
                }
                Pin::new(stream).poll_write_vectored(cx, &slices)
            };
            match written {
                Poll::Pending => {
                    self.blocked_since.get_or_insert(self.clock);
                    return;
                }
                Poll::Ready(Ok(0)) => {
                    self.shut(Closed::PeerGone(Gone::WriteZero));
                    return;
                }
                Poll::Ready(Ok(mut n)) => {
                    self.blocked_since = None;
                    while let Some(front) = self.out.front() {
                        let left = front.len() - self.front_written;
                        if n < left {
                            self.front_written += n;
                            break;
                        }
                        n -= left;
                        self.front_written = 0;
                        self.out.pop_front();
                    }
                }
                Poll::Ready(Err(e)) => {
                    self.shut(Closed::PeerGone(Gone::from(&e)));
                    return;
                }
            }
        }
    }

    /// What a completed record means for the driver: an event, or nothing (a refused
    /// record; a staged one, whose copy into its page starts now).
    fn on_record(&mut self, record: Record) -> Option<TransportEvent> {
        let event = self.record_event(record)?;
        match self.pulls.as_mut() {
            Some(p) => p.hold(event),
            None => Some(event),
        }
    }

    /// The event a record makes, before it is held behind copies still running.
    fn record_event(&mut self, record: Record) -> Option<TransportEvent> {
        match record {
            Record::Frame(f) => Some(TransportEvent::Frame(f)),
            Record::Landed(h, digests) => Some(TransportEvent::Landed {
                transfer: h.transfer,
                ordinal: h.ordinal,
                page: h.dst_page,
                digests,
            }),
            Record::Pull {
                header,
                sources,
                landing,
            } => {
                match self.pulls.as_mut() {
                    Some(p) => p.submit(header, sources, landing),
                    None => tracing::error!(
                        page = header.dst_page,
                        "pull record for pull threads on a stream without them: dropped"
                    ),
                }
                None
            }
            Record::Staged(h, slot) => {
                let st = self.reader.staging.as_mut()?;
                if st.in_flight() > 0 {
                    st.stats.overlapped += 1;
                }
                if let Err(e) = st.copy_in(slot, &self.pool, h.dst_page) {
                    st.release(slot);
                    self.shut(Closed::LinkFailed(format!("device copy: {e}")));
                    return None;
                }
                self.copying.push_back((h, slot));
                None
            }
            Record::Refused(h) => {
                tracing::debug!(
                    transfer_id = h.transfer.transfer_id.0,
                    page = h.dst_page,
                    "write refused (fenced or out of scope)"
                );
                None
            }
        }
    }

    /// Ends the connection for a stream that cannot be read on.
    fn stream_failed(&mut self, e: StreamError) {
        match e {
            StreamError::Auth(e) => self.shut(Closed::Unauthentic(e)),
            e => self.shut(Closed::Malformed(e.to_string())),
        }
    }

    /// Parses records from what was read ahead, and reads more (landing page bytes as they
    /// come) until one is complete. Frames queued meanwhile are written before each read,
    /// so the answers to a whole read's worth of records leave in one write.
    fn poll_read_records(&mut self, cx: &mut Context<'_>) -> Option<TransportEvent> {
        loop {
            if self.reader.staging.is_some() {
                self.poll_copies(cx);
                if let Some(e) = self.events.pop_front() {
                    return Some(e);
                }
            }
            if let Some(p) = self.pulls.as_mut() {
                p.poll(cx.waker(), &mut self.events, &mut self.reader.stats);
                if let Some(e) = self.events.pop_front() {
                    return Some(e);
                }
                if p.full() && !self.closed {
                    // Every pull thread has its share: the stream waits (woken when a copy
                    // returned).
                    return None;
                }
            }
            if self.closed {
                return None;
            }
            match self.reader.next_buffered(&self.pool, &self.scopes) {
                Ok(Some(record)) => {
                    if let Some(e) = self.on_record(record) {
                        return Some(e);
                    }
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    self.stream_failed(e);
                    return None;
                }
            }
            // Everything parsed: the copies queued go to the pull threads before the stream
            // is read again (or waits).
            if let Some(p) = self.pulls.as_mut() {
                p.flush();
            }
            if self.reader.staging.is_some() && self.reader.waits_for_staging() {
                // Every staging buffer is being copied: the socket waits (woken when a
                // copy completed).
                return None;
            }
            if self.write_now() {
                self.poll_flush(cx);
            }
            let stream = self.stream.as_mut()?;
            let read = {
                let mut target = self.reader.target(&self.pool, &self.scopes);
                let mut slices = target.slices();
                loop {
                    match stream.try_read_vectored(&mut slices) {
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            match stream.poll_read_ready(cx) {
                                Poll::Pending => return None,
                                Poll::Ready(Ok(())) => continue,
                                Poll::Ready(Err(e)) => break Err(e),
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        other => break other,
                    }
                }
            };
            let n = match read {
                Ok(n) => n,
                Err(e) => {
                    self.shut(Closed::PeerGone(Gone::from(&e)));
                    return None;
                }
            };
            if n == 0 {
                self.shut(Closed::PeerGone(Gone::EndOfStream));
                return None;
            }
            self.last_read = Some(self.clock);
            if let Some(record) = self.reader.advance(n, &self.pool, &self.scopes) {
                if let Some(e) = self.on_record(record) {
                    return Some(e);
                }
            }
        }
    }
}

impl Transport for TcpReceiver {
    fn send_frame(&mut self, _now: Instant, frame: &Frame) {
        if self.closed {
            return;
        }
        match self.sealer.seal_to_vec(frame) {
            Ok(bytes) => self.out.push_back(bytes),
            Err(e) => tracing::error!(error = %e, "frame could not be encoded; dropped"),
        }
        if self.out.len() >= super::MAX_UNSENT_FRAMES {
            let blocked_for = self
                .blocked_since
                .map_or(Duration::ZERO, |t| self.clock.saturating_duration_since(t));
            tracing::warn!(
                frames = self.out.len(),
                "the peer reads none of the frames it asks for; closing the connection"
            );
            self.shut(Closed::Unresponsive {
                silent_for: blocked_for,
            });
        }
    }

    /// Queued frames are written before the stream is read and before waiting, not after
    /// every event: the frames a burst of records produces leave together. While writes are
    /// held ([`Transport::hold_writes`]), only once 16 frames are queued.
    fn poll_event(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<TransportEvent> {
        self.clock = now;
        if let Some(e) = self.events.pop_front() {
            return Poll::Ready(e);
        }
        if let Some(e) = self.poll_read_records(cx) {
            return Poll::Ready(e);
        }
        if self.write_now() {
            self.poll_flush(cx);
        }
        match self.events.pop_front() {
            Some(e) => Poll::Ready(e),
            None => Poll::Pending,
        }
    }

    fn close(&mut self, _now: Instant) {
        self.shut(Closed::Local);
    }

    fn write_blocked_since(&self) -> Option<Instant> {
        if self.out.is_empty() || self.closed {
            None
        } else {
            self.blocked_since
        }
    }

    fn last_read(&self) -> Option<Instant> {
        self.last_read
    }

    fn hold_writes(&mut self, held: bool) {
        self.writes_held = held;
    }

    fn coalesces_writes(&self) -> bool {
        true
    }
}

/// The reader checks the scope before every read into a page: once it is closed, the rest
/// of any record for that transfer goes to scratch (the fence).
impl TableScoped for TcpReceiver {
    fn scopes(&self) -> &ScopeTable {
        &self.scopes
    }

    fn scopes_mut(&mut self) -> &mut ScopeTable {
        &mut self.scopes
    }

    /// With same-host pulls, the scope key and [`PULL_FLAG`](super::PULL_FLAG): the sender
    /// sends pull records for the reservation (SPEC §9.3).
    fn access_descriptor(&self, key: crate::memory::AccessKey) -> Vec<u8> {
        let mut d = key.to_descriptor();
        if self.reader.puller.is_some() {
            d.push(super::PULL_FLAG);
        }
        d
    }

    fn pulls_pages(&self) -> bool {
        self.reader.puller.is_some()
    }

    /// Device memory: the fence of a transfer with copies into its pages still running
    /// completes once they did (SPEC §9.1, device memory).
    fn fence_pending(&mut self, transfer: TransferRef) -> bool {
        if let Some(p) = self.pulls.as_mut() {
            return p.fence_pending(transfer);
        }
        let waits = self
            .copying
            .iter()
            .any(|(h, _)| h.transfer.transfer_id == transfer.transfer_id);
        if waits {
            self.fences.push(transfer);
        }
        waits
    }
}
