//! The prefill end of a TCP connection: frames and data records out, frames in.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvwire_proto::auth::{OpenError, Opener, Sealer};
use kvwire_proto::sender::PageWrite;
use kvwire_proto::wire::{Frame, TransferRef, HEADER_LEN, MAGIC, MAX_PAYLOAD, TRAILER_LEN};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::records::DataHeader;
use crate::memory::{AccessKey, PagePool, PageRef};
use crate::transport::staging::{Staging, StagingStats, STAGING_BUFFERS};
use crate::transport::{Closed, Gone, SenderTransport, Transport, TransportEvent};

/// Data records queued at most (their bytes stay in the source pages until written).
const MAX_QUEUED_RECORDS: usize = 256;
/// Slices handed to one vectored write.
const MAX_IOV: usize = 64;
/// Page bytes handed to one vectored write at most (one record's at least): the pages a write
/// copied are still in this core's cache when the sender digests them right after it
/// ([`SenderTransport::digests_after_writes`]). Measured on a 2-vCPU AMD EPYC guest
/// (1 MiB of L2 per core), 64 KiB pages, in samples of the sender's digest per sample of its
/// kernel copy: 0.24 after writes of 1 MiB, 0.34 after writes as large as the socket took,
/// 0.58 read before the copy; writes of 256 KiB cost more in system calls than that saved
/// (docs/BENCHMARKS.md, "The sender's digest after the kernel's copy").
const MAX_WRITE_PAGE_BYTES: usize = 1 << 20;

/// Something to write, in order.
#[derive(Debug)]
enum Out {
    /// A sealed control frame.
    Frame(Vec<u8>),
    /// A pull record (SPEC §9.3): its header and source addresses, whole; the decode copies
    /// the page out of this process's memory when it reads it.
    Pull {
        record: Vec<u8>,
        transfer: TransferRef,
    },
    /// A data record: header, then the source page of every buffer.
    Data {
        header: [u8; super::DATA_HEADER_LEN],
        transfer: TransferRef,
        src_page: u32,
        /// Device memory: the staging buffer its bytes are copied into.
        slot: Option<usize>,
    },
}

/// How many of the queued items, from the front, the next vectored write covers: at most
/// [`MAX_IOV`] slices (a data record takes one for its header and one per buffer) and
/// [`MAX_WRITE_PAGE_BYTES`] of page bytes, and always the front item.
fn items_per_write(out: &VecDeque<Out>, buffers: usize, record_len: usize) -> usize {
    let (mut items, mut slices, mut page_bytes) = (0, 0, 0);
    for item in out {
        let (item_slices, item_bytes) = match item {
            Out::Frame(_) | Out::Pull { .. } => (1, 0),
            Out::Data { .. } => (1 + buffers, record_len),
        };
        if items > 0
            && (slices + item_slices > MAX_IOV || page_bytes + item_bytes > MAX_WRITE_PAGE_BYTES)
        {
            break;
        }
        items += 1;
        slices += item_slices;
        page_bytes += item_bytes;
    }
    items
}

/// Counters of a TCP sender.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpSenderStats {
    /// Data records written.
    pub records: u64,
    /// Page bytes written.
    pub bytes: u64,
    /// Pull records written (SPEC §9.3): pages the decode copies out of this process.
    pub pulls: u64,
    /// Control frames written.
    pub frames: u64,
    /// Write system calls.
    pub writes: u64,
    /// Device memory: the staging pipeline's counters (zero for host memory).
    pub staging: StagingStats,
}

/// The prefill end of a TCP connection (after the handshake).
#[derive(Debug)]
pub struct TcpSender {
    stream: Option<TcpStream>,
    sealer: Sealer,
    opener: Opener,
    pool: Arc<PagePool>,
    record_len: u32,
    out: VecDeque<Out>,
    /// Bytes of the front item already written.
    front_written: usize,
    data_queued: usize,
    rbuf: Vec<u8>,
    /// `rbuf[rstart..rfilled]` is read and not yet parsed.
    rstart: usize,
    rfilled: usize,
    events: VecDeque<TransportEvent>,
    closed: bool,
    stats: TcpSenderStats,
    /// The receiver's page slots per buffer, from its transport parameters (SPEC §9.1).
    destination_pages: Option<u32>,
    /// Both ends offered same-host pulls (SPEC §9.3): a reservation whose descriptor asks for
    /// them gets pull records.
    pulls: bool,
    /// Device memory: records go device → pinned staging → socket.
    staging: Option<Staging>,
    /// Writes are held back until a batch's worth is queued ([`Transport::hold_writes`]).
    writes_held: bool,
    /// The driver's clock at the current `poll_event`.
    clock: Instant,
    /// Since when queued bytes found no taker ([`Transport::write_blocked_since`]).
    blocked_since: Option<Instant>,
}

impl TcpSender {
    /// The prefill end over `stream` (handshake done): frames sealed by `sealer` and opened
    /// by `opener` (the halves of the connection's authentication channel), page bytes from
    /// `pool`.
    pub fn new(stream: TcpStream, sealer: Sealer, opener: Opener, pool: Arc<PagePool>) -> Self {
        let record_len = pool.geometry().bytes_per_page_index() as u32;
        let staging = Staging::for_memory(pool.memory(), record_len as usize, STAGING_BUFFERS);
        let mut sender = Self {
            stream: Some(stream),
            sealer,
            opener,
            pool,
            record_len,
            out: VecDeque::new(),
            front_written: 0,
            data_queued: 0,
            rbuf: vec![0; 64 * 1024],
            rstart: 0,
            rfilled: 0,
            events: VecDeque::new(),
            closed: false,
            stats: TcpSenderStats::default(),
            destination_pages: None,
            pulls: false,
            staging: None,
            writes_held: false,
            clock: Instant::now(),
            blocked_since: None,
        };
        match staging {
            Ok(s) => sender.staging = s,
            Err(e) => sender.shut(Closed::LinkFailed(format!("device staging: {e}"))),
        }
        sender
    }

    /// The receiver advertised `pages` page slots per buffer (its TCP transport parameters,
    /// SPEC §9.1): reservations naming a page beyond them are refused (§5.3.1 #7).
    pub fn with_destination_pages(mut self, pages: u32) -> Self {
        self.destination_pages = Some(pages);
        self
    }

    /// Both ends offered same-host pulls (SPEC §9.3): reservations whose access descriptor
    /// asks for them ([`super::PULL_DESCRIPTOR_LEN`]) get pull records instead of data records.
    /// Host memory only (refused otherwise: the descriptor then fails its pages).
    pub fn with_pulls(mut self) -> Self {
        self.pulls = self.staging.is_none();
        self
    }

    /// Counters.
    pub fn stats(&self) -> TcpSenderStats {
        let mut s = self.stats;
        if let Some(st) = &self.staging {
            s.staging = st.stats;
        }
        s
    }

    /// Ends the connection: every data record not yet fully written fails, then `why`.
    fn shut(&mut self, why: Closed) {
        if self.closed {
            return;
        }
        self.closed = true;
        // Dropping the socket closes it; the peer sees the end of the stream.
        self.stream = None;
        // Copies out of source pages still in flight complete before their writes are
        // reported failed (after which the pages may go back to the engine).
        if let Some(st) = &mut self.staging {
            if let Err(e) = st.synchronize() {
                tracing::error!(error = %e, "staging copies failed at close");
            }
        }
        for item in std::mem::take(&mut self.out) {
            if let Out::Data { transfer, .. } | Out::Pull { transfer, .. } = item {
                self.complete(transfer, false);
            }
        }
        self.data_queued = 0;
        self.events.push_back(TransportEvent::Closed(why));
    }

    /// Reports one page write ended, merged with the previous report of the same transfer.
    fn complete(&mut self, transfer: TransferRef, ok: bool) {
        if let Some(TransportEvent::WritesDone {
            transfer: t,
            pages,
            ok: o,
        }) = self.events.back_mut()
        {
            if *t == transfer && *o == ok {
                *pages += 1;
                return;
            }
        }
        self.events.push_back(TransportEvent::WritesDone {
            transfer,
            pages: 1,
            ok,
        });
    }

    /// Whether queued writes go out now: not held, or a batch's worth is queued.
    fn write_now(&self) -> bool {
        !self.writes_held
            || self.out.len() >= super::HELD_WRITE_ITEMS
            || self.data_queued * self.record_len as usize >= super::HELD_WRITE_BYTES
    }

    /// Writes what is queued until the socket would block, or until the records written
    /// carried [`MAX_WRITE_PAGE_BYTES`] of page bytes (their completions are reported before
    /// the next write).
    fn poll_flush(&mut self, cx: &mut Context<'_>) {
        if self.staging.is_some() {
            return self.poll_flush_staged(cx);
        }
        let bytes_before = self.stats.bytes;
        while !self.out.is_empty() && !self.closed {
            let Some(stream) = self.stream.as_mut() else {
                return;
            };
            let written = {
                let pool = &self.pool;
                let buffers = pool.buffers();
                // Read locks on the source pages of the records about to be written (they are
                // leased to their transfers: the engine does not write them until the writes
                // completed, so the locks are always granted).
                let mut guards: Vec<PageRef<'_>> = Vec::new();
                let (mut covered, mut n_slices) = (0, 0);
                let items = items_per_write(&self.out, buffers, self.record_len as usize);
                for item in self.out.iter().take(items) {
                    if let Out::Data { src_page, .. } = item {
                        let start = guards.len();
                        for b in 0..buffers {
                            match pool.raw_page(*src_page, b) {
                                Some(g) => guards.push(g),
                                None => break,
                            }
                        }
                        if guards.len() - start < buffers {
                            guards.truncate(start);
                            break;
                        }
                        n_slices += 1 + buffers;
                    } else {
                        n_slices += 1;
                    }
                    covered += 1;
                }
                let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(n_slices);
                let mut skip = self.front_written;
                let mut pages = guards.iter();
                for item in self.out.iter().take(covered) {
                    match item {
                        Out::Frame(bytes) | Out::Pull { record: bytes, .. } => {
                            push_part(&mut slices, &mut skip, bytes)
                        }
                        Out::Data { header, .. } => {
                            push_part(&mut slices, &mut skip, header);
                            for page in pages.by_ref().take(buffers) {
                                push_part(&mut slices, &mut skip, page);
                            }
                        }
                    }
                }
                if covered == 0 {
                    // The front record's source page cannot be read: fail the connection
                    // rather than send a record with missing bytes.
                    None
                } else {
                    Some(Pin::new(stream).poll_write_vectored(cx, &slices))
                }
            };
            match written {
                None => {
                    self.shut(Closed::Malformed("a source page could not be read".into()));
                    return;
                }
                Some(Poll::Pending) => {
                    self.blocked_since.get_or_insert(self.clock);
                    return;
                }
                Some(Poll::Ready(Ok(0))) => {
                    self.shut(Closed::PeerGone(Gone::WriteZero));
                    return;
                }
                Some(Poll::Ready(Ok(n))) => {
                    self.blocked_since = None;
                    self.stats.writes += 1;
                    self.advance(n);
                    if self.stats.bytes - bytes_before >= MAX_WRITE_PAGE_BYTES as u64 {
                        // Report the records written so far before writing more, so the
                        // sender digests their pages while the copies left them in cache.
                        return;
                    }
                }
                Some(Poll::Ready(Err(e))) => {
                    self.shut(Closed::PeerGone(Gone::from(&e)));
                    return;
                }
            }
        }
    }

    /// Device memory: starts the copies of queued records into free staging buffers, in
    /// queue order.
    fn stage(&mut self) {
        let Some(staging) = self.staging.as_mut() else {
            return;
        };
        let mut failed = None;
        for item in self.out.iter_mut() {
            let Out::Data { src_page, slot, .. } = item else {
                continue;
            };
            if slot.is_some() {
                continue;
            }
            let Some(s) = staging.take_free() else {
                break;
            };
            if let Err(e) = staging.copy_out(s, &self.pool, *src_page) {
                staging.release(s);
                failed = Some(e);
                break;
            }
            *slot = Some(s);
        }
        if let Some(e) = failed {
            self.shut(Closed::LinkFailed(format!("device copy: {e}")));
        }
    }

    /// [`poll_flush`](Self::poll_flush) for device memory: a record goes on the socket from
    /// its staging buffer once its copy completed; meanwhile the next record's copy runs.
    fn poll_flush_staged(&mut self, cx: &mut Context<'_>) {
        while !self.out.is_empty() && !self.closed {
            self.stage();
            let Some(staging) = self.staging.as_mut() else {
                return;
            };
            // How many items from the front can be written now: frames, and records whose
            // copy completed.
            let mut ready = 0;
            let mut slices_n = 0;
            let mut failed = None;
            for item in self.out.iter() {
                if let Out::Data { slot, .. } = item {
                    let Some(s) = *slot else { break };
                    match staging.poll_slot(s, Some(cx.waker())) {
                        Ok(true) => {}
                        Ok(false) => break,
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                ready += 1;
                slices_n += 2;
                if slices_n >= MAX_IOV {
                    break;
                }
            }
            if let Some(e) = failed {
                self.shut(Closed::LinkFailed(format!("device copy: {e}")));
                return;
            }
            if ready == 0 {
                // The front record's copy has not completed: woken when it has.
                return;
            }
            if staging.in_flight() > 0 {
                staging.stats.overlapped += 1;
            }
            let record_len = self.record_len as usize;
            let written = {
                let staging = &*staging;
                let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * ready);
                let mut skip = self.front_written;
                for item in self.out.iter().take(ready) {
                    match item {
                        Out::Frame(bytes) | Out::Pull { record: bytes, .. } => {
                            push_part(&mut slices, &mut skip, bytes)
                        }
                        Out::Data { header, slot, .. } => {
                            push_part(&mut slices, &mut skip, header);
                            if let Some(s) = slot {
                                // Ready (checked above): no copy runs on it.
                                push_part(
                                    &mut slices,
                                    &mut skip,
                                    staging.ready_bytes(*s, record_len),
                                );
                            }
                        }
                    }
                }
                let Some(stream) = self.stream.as_mut() else {
                    return;
                };
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
                Poll::Ready(Ok(n)) => {
                    self.blocked_since = None;
                    self.stats.writes += 1;
                    self.advance(n);
                }
                Poll::Ready(Err(e)) => {
                    self.shut(Closed::PeerGone(Gone::from(&e)));
                    return;
                }
            }
        }
    }

    /// Accounts for `n` bytes written from the front of the queue.
    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let Some(front) = self.out.front() else {
                return;
            };
            let len = match front {
                Out::Frame(b) | Out::Pull { record: b, .. } => b.len(),
                Out::Data { .. } => super::DATA_HEADER_LEN + self.record_len as usize,
            };
            let left = len - self.front_written;
            if n < left {
                self.front_written += n;
                return;
            }
            n -= left;
            self.front_written = 0;
            match self.out.pop_front() {
                Some(Out::Data { transfer, slot, .. }) => {
                    if let (Some(s), Some(st)) = (slot, self.staging.as_mut()) {
                        st.release(s);
                    }
                    self.data_queued -= 1;
                    self.stats.records += 1;
                    self.stats.bytes += u64::from(self.record_len);
                    self.complete(transfer, true);
                }
                Some(Out::Pull { transfer, .. }) => {
                    self.data_queued -= 1;
                    self.stats.records += 1;
                    self.stats.pulls += 1;
                    self.complete(transfer, true);
                }
                Some(Out::Frame(_)) => self.stats.frames += 1,
                None => {}
            }
        }
    }

    /// Reads and opens control frames from the receiver.
    fn poll_read_frames(&mut self, cx: &mut Context<'_>) -> Option<TransportEvent> {
        loop {
            if let Some(e) = self.take_frame() {
                return Some(e);
            }
            // What is left of a frame goes to the front of the buffer.
            if self.rstart > 0 {
                self.rbuf.copy_within(self.rstart..self.rfilled, 0);
                self.rfilled -= self.rstart;
                self.rstart = 0;
            }
            let stream = self.stream.as_mut()?;
            let mut buf = ReadBuf::new(&mut self.rbuf[self.rfilled..]);
            match Pin::new(stream).poll_read(cx, &mut buf) {
                Poll::Pending => return None,
                Poll::Ready(Ok(())) if buf.filled().is_empty() => {
                    self.shut(Closed::PeerGone(Gone::EndOfStream));
                    return None;
                }
                Poll::Ready(Ok(())) => self.rfilled += buf.filled().len(),
                Poll::Ready(Err(e)) => {
                    self.shut(Closed::PeerGone(Gone::from(&e)));
                    return None;
                }
            }
        }
    }

    /// A whole frame from the read buffer, if one is there.
    fn take_frame(&mut self) -> Option<TransportEvent> {
        let b = &self.rbuf[self.rstart..self.rfilled];
        if b.len() < 4 {
            return None;
        }
        if b[..4] != MAGIC {
            let magic = [b[0], b[1], b[2], b[3]];
            self.shut(Closed::Malformed(format!(
                "a record from the receiver starts with {}, not a frame",
                kvwire_proto::wire::show_bytes(&magic)
            )));
            return None;
        }
        if b.len() < HEADER_LEN {
            return None;
        }
        let len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        if len > MAX_PAYLOAD {
            self.shut(Closed::Malformed(format!("frame payload of {len} bytes")));
            return None;
        }
        let total = HEADER_LEN + len as usize + TRAILER_LEN;
        if b.len() < total {
            if self.rbuf.len() < total {
                self.rbuf.resize(total, 0);
            }
            return None;
        }
        let opened = self
            .opener
            .open(&self.rbuf[self.rstart..self.rstart + total])
            .map(|(f, _)| f);
        self.rstart += total;
        if self.rstart == self.rfilled {
            (self.rstart, self.rfilled) = (0, 0);
        }
        match opened {
            Ok(f) => Some(TransportEvent::Frame(f)),
            Err(OpenError::Auth(e)) => {
                self.shut(Closed::Unauthentic(e));
                None
            }
            Err(e) => {
                self.shut(Closed::Malformed(e.to_string()));
                None
            }
        }
    }
}

impl Transport for TcpSender {
    fn send_frame(&mut self, _now: Instant, frame: &Frame) {
        if self.closed {
            return;
        }
        match self.sealer.seal_to_vec(frame) {
            Ok(bytes) => self.out.push_back(Out::Frame(bytes)),
            Err(e) => tracing::error!(error = %e, "frame could not be encoded; dropped"),
        }
        if self.out.len() - self.data_queued >= super::MAX_UNSENT_FRAMES {
            let blocked_for = self
                .blocked_since
                .map_or(Duration::ZERO, |t| self.clock.saturating_duration_since(t));
            tracing::warn!(
                frames = self.out.len() - self.data_queued,
                "the peer reads none of the frames it asks for; closing the connection"
            );
            self.shut(Closed::Unresponsive {
                silent_for: blocked_for,
            });
        }
    }

    /// Frames already read are handed out before anything is written: what queues while the
    /// driver handles them (frames, data records) leaves in one vectored write, made before
    /// the socket is read again and before waiting. While writes are held
    /// ([`Transport::hold_writes`]), only once 16 items or 64 KiB of page bytes are queued.
    fn poll_event(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<TransportEvent> {
        self.clock = now;
        if let Some(e) = self.events.pop_front() {
            return Poll::Ready(e);
        }
        if let Some(e) = self.take_frame() {
            return Poll::Ready(e);
        }
        if self.write_now() {
            self.poll_flush(cx);
        }
        if let Some(e) = self.events.pop_front() {
            return Poll::Ready(e);
        }
        if let Some(e) = self.poll_read_frames(cx) {
            return Poll::Ready(e);
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

    fn hold_writes(&mut self, held: bool) {
        self.writes_held = held;
    }

    fn coalesces_writes(&self) -> bool {
        true
    }
}

impl SenderTransport for TcpSender {
    fn write_credit(&self) -> usize {
        if self.closed {
            0
        } else {
            MAX_QUEUED_RECORDS.saturating_sub(self.data_queued)
        }
    }

    fn destination_pages(&self) -> Option<u32> {
        self.destination_pages
    }

    /// Host memory: the kernel copies each data record's pages into the socket during the
    /// write that completes it, and [`TcpSender`] reports that write's records before the next
    /// one. With same-host pulls (SPEC §9.3) a write carries only pull records: the decode
    /// starts copying their pages as soon as they arrive, on its own core, while this one
    /// digests them. Measured on a 2-vCPU Intel Xeon guest, engine workloads, same-host ÷
    /// memcpy, medians of four rounds: 0.65 and 0.61 (64 KiB and 1 MiB pages) digesting
    /// before the pull records, 0.71 and 0.67 after (docs/BENCHMARKS-LOG.md, "The prefill's
    /// digest after its pull records").
    fn digests_after_writes(&self) -> bool {
        self.staging.is_none()
    }

    fn post_writes(
        &mut self,
        _now: Instant,
        transfer: TransferRef,
        access: &Arc<[u8]>,
        writes: &[PageWrite],
    ) {
        let (key, pull) = match super::parse_access(access) {
            Some((key, pull)) if !pull || self.pulls => (Some(key), pull),
            // A descriptor that asks for pulls on a connection without them.
            _ => (None, false),
        };
        for w in writes {
            match key {
                Some(key) if pull && !self.closed && w.src_page < self.pool.capacity_pages() => {
                    match self.pull_record(transfer, key, w) {
                        Some(record) => {
                            self.out.push_back(Out::Pull { record, transfer });
                            self.data_queued += 1;
                        }
                        None => self.complete(transfer, false),
                    }
                }
                Some(key) if !self.closed && w.src_page < self.pool.capacity_pages() => {
                    let header = DataHeader {
                        transfer,
                        key,
                        ordinal: w.ordinal,
                        dst_page: w.dst_page,
                        len: self.record_len,
                    };
                    self.out.push_back(Out::Data {
                        header: header.encode(),
                        transfer,
                        src_page: w.src_page,
                        slot: None,
                    });
                    self.data_queued += 1;
                }
                // A descriptor that is not a TCP scope key (SPEC §9.1: exactly 4 bytes, or 5
                // asking for pulls where both ends offered them, §9.3), a source page out of
                // range, or a closed connection: refused before sending.
                _ => self.complete(transfer, false),
            }
        }
    }
}

impl TcpSender {
    /// The pull record of page write `w` (SPEC §9.3): the data record's header under the pull
    /// magic, then the address of each buffer's slot of the source page in this process.
    fn pull_record(&self, transfer: TransferRef, key: AccessKey, w: &PageWrite) -> Option<Vec<u8>> {
        let memory = self.pool.memory();
        let mut header = DataHeader {
            transfer,
            key,
            ordinal: w.ordinal,
            dst_page: w.dst_page,
            len: self.record_len,
        }
        .encode();
        header[..4].copy_from_slice(&super::PULL_MAGIC);
        let mut record = Vec::with_capacity(header.len() + 8 * memory.buffers());
        record.extend_from_slice(&header);
        for b in 0..memory.buffers() {
            if !memory.is_host(b) {
                return None;
            }
            let (base, _) = memory.region(b)?;
            let addr = base.as_ptr() as u64 + memory.range(w.src_page, b).start as u64;
            record.extend_from_slice(&addr.to_le_bytes());
        }
        Some(record)
    }
}

/// Appends `part` to `slices`, less the `skip` bytes already written.
fn push_part<'a>(slices: &mut Vec<IoSlice<'a>>, skip: &mut usize, part: &'a [u8]) {
    if *skip >= part.len() {
        *skip -= part.len();
    } else {
        slices.push(IoSlice::new(&part[*skip..]));
        *skip = 0;
    }
}

#[cfg(test)]
mod tests;
