//! The receiving side of a TCP stream as an incremental, cancel-safe parser: records and frames
//! from a read-ahead buffer, the rest of a data record by vectored reads straight into its page.

use kvwire_proto::auth::{AuthChannel, OpenError, Opener};
use kvwire_proto::wire::{DecodeError, HEADER_LEN, MAGIC, TRAILER_LEN};

use super::pulls::{PullOutcome, DIGEST_PIECE};
use super::records::{DataHeader, Record, StreamError, StreamStats, DATA_HEADER_LEN, DATA_MAGIC};
use super::PULL_MAGIC;
use crate::checksum::Kind;
use crate::memory::{PagePool, ScopeTable};
use crate::transport::same_host::Puller;
use crate::transport::staging::Staging;
use crate::transport::{LandingDigests, TransportEvent};
use kvwire_proto::wire::DigestAlgorithm;

#[derive(Debug)]
enum ReadState {
    /// Between records: the next record's header is collected in the read-ahead buffer.
    Head,
    /// A control frame of `total` bytes, collected in the read-ahead buffer.
    Frame { total: usize },
    /// Landing a data record's payload in its page: `done` bytes so far.
    Land { header: DataHeader, done: usize },
    /// Dropping a refused data record's payload.
    Discard { header: DataHeader, done: usize },
    /// Device memory: a data record's payload into a staging buffer (`None`: none free yet;
    /// its bytes wait in the read-ahead buffer until one is).
    Stage {
        header: DataHeader,
        done: usize,
        slot: Option<usize>,
    },
}

impl ReadState {
    /// A landing record whose page anyone else holds (a digest reading it) cannot land now:
    /// the rest of it is dropped (the transfer then fails its coverage or digest check, and
    /// never verifies with bytes that did not land).
    fn busy(header: DataHeader, done: usize) -> Self {
        tracing::warn!(
            page = header.dst_page,
            "destination page busy: record dropped"
        );
        Self::Discard { header, done }
    }
}

/// The read-ahead buffer's size: records of at most [`SMALL_RECORD`] bytes are read many at
/// a time into it (one system call for many small records and frames), then copied into
/// their pages.
const AHEAD: usize = 64 * 1024;
/// Data records up to this long are read ahead whole; longer ones land by vectored reads
/// straight into their pages, with only [`LARGE_AHEAD`] bytes read ahead behind them (the
/// next record's header, and at most that many of its bytes copied).
const SMALL_RECORD: usize = 16 * 1024;
/// Bytes read ahead behind the payload of a large data record.
const LARGE_AHEAD: usize = 4 * 1024;

/// The page digests of the record landing now, taken as its bytes land (SPEC §6, digests
/// at landing): each buffer's slot digested whole, in one pass, read back from the page right
/// after the read or copy that wrote its last byte.
///
/// Whole and in one pass, as the sender digests its pages (`XxHash3_64::oneshot`), not piece by
/// piece in XXH3's streaming form: how fast the streaming loop runs depends on how the compiler
/// lays it out (it kept the accumulators in memory in some builds of the same source, and read
/// landed pages at 0.69-1.14 of the kernel copy's cost instead of 0.19-0.22), while a 1 MiB slot
/// digested once complete cost what its pieces did (docs/BENCHMARKS.md, "The receiver's digest
/// and the compiler").
#[derive(Debug)]
struct RowDigests {
    algorithm: DigestAlgorithm,
    kind: Kind,
    /// The page digests of the slots digested so far, in buffer order.
    digests: Vec<u64>,
    /// Where the next slot to digest starts in the record (its length once every slot is).
    slot_start: usize,
}

impl RowDigests {
    /// No digests yet, in `digests`' allocation (the last record's).
    fn new(algorithm: DigestAlgorithm, mut digests: Vec<u64>) -> Option<Self> {
        let kind = Kind::new(algorithm).ok()?;
        digests.clear();
        Some(Self {
            algorithm,
            kind,
            digests,
            slot_start: 0,
        })
    }

    /// The record's bytes have landed up to `to`: `digest(b, kind)` returns the page digest
    /// under `kind` of buffer `b`'s whole slot (of `page_bytes[b]` bytes), read from the page,
    /// for every slot whose last byte is now in, or `None` when it could not: the record's
    /// digests are then not taken at landing (false).
    fn feed(
        &mut self,
        page_bytes: &[usize],
        to: usize,
        mut digest: impl FnMut(usize, Kind) -> Option<u64>,
    ) -> bool {
        while let Some(&len) = page_bytes.get(self.digests.len()) {
            let end = self.slot_start + len;
            if to < end {
                break;
            }
            match digest(self.digests.len(), self.kind) {
                Some(d) => self.digests.push(d),
                None => return false,
            }
            self.slot_start = end;
        }
        true
    }

    /// The page digests, if every slot of the record (of `len` bytes) was digested; and the
    /// digests' allocation, for the next record.
    fn finish(self, len: usize) -> (Option<LandingDigests>, Vec<u64>) {
        let digests = (self.slot_start == len).then(|| LandingDigests {
            algorithm: self.algorithm,
            per_buffer: self.digests.as_slice().into(),
        });
        (digests, self.digests)
    }
}

/// Where the next read lands: the rest of the current data record straight in its page (every
/// buffer's slice, under one write lock) or staging buffer, then the reader's read-ahead
/// buffer.
#[derive(Debug)]
pub struct ReadTarget<'a> {
    direct: Direct<'a>,
    ahead: &'a mut [u8],
}

#[derive(Debug)]
enum Direct<'a> {
    None,
    /// A destination page (every buffer) from this byte of the record, at most this many
    /// bytes.
    Row(crate::memory::PageRowMut<'a>, usize, usize),
    /// Device memory: the rest of a staging buffer.
    Staging(&'a mut [u8]),
}

impl ReadTarget<'_> {
    /// The slices to read into, in order (for a vectored read).
    pub fn slices(&mut self) -> Vec<std::io::IoSliceMut<'_>> {
        use std::io::IoSliceMut;
        let mut out = Vec::new();
        match &mut self.direct {
            Direct::None => {}
            Direct::Row(row, off, max) => {
                let (mut off, mut left) = (*off, *max);
                for b in row.buffers_mut().iter_mut() {
                    if left == 0 {
                        break;
                    }
                    if off >= b.len() {
                        off -= b.len();
                        continue;
                    }
                    let n = (b.len() - off).min(left);
                    out.push(IoSliceMut::new(&mut b[off..off + n]));
                    left -= n;
                    off = 0;
                }
            }
            Direct::Staging(s) => out.push(IoSliceMut::new(s)),
        }
        if !self.ahead.is_empty() {
            out.push(IoSliceMut::new(self.ahead));
        }
        out
    }
}

/// The receiving side of a stream, as an incremental, cancel-safe parser.
///
/// Records and frames are parsed from a read-ahead buffer ([`StreamReader::next_buffered`]);
/// once it is empty, [`StreamReader::target`] hands out the slices the next (vectored) read
/// fills: the rest of the current data record straight in its destination page, then the
/// read-ahead buffer. [`StreamReader::advance`] is told how many bytes arrived. Because a
/// single read either completes or does nothing, the caller may race it against timers and
/// commands. Before every read or copy into a page the scope is checked again, so a fence
/// between two of them sends the rest of the record to nowhere instead of into a released
/// page.
#[derive(Debug)]
pub struct StreamReader {
    state: ReadState,
    /// Read-ahead bytes: `ahead[start..end]` are unparsed.
    ahead: Vec<u8>,
    start: usize,
    end: usize,
    /// Bytes of read-ahead offered behind a record's payload (or between records).
    ahead_limit: usize,
    /// Bytes of the last target before its read-ahead part.
    direct_len: usize,
    record_len: usize,
    /// Bytes of each buffer's slot, in buffer order.
    page_bytes: Vec<usize>,
    /// The landing record's digests in progress, when its scope asked for them.
    digesting: Option<RowDigests>,
    /// The digests of the last record digested, kept for the next one (no allocation per
    /// record for them).
    spare_digests: Vec<u64>,
    opener: Opener,
    /// Same-host pulls (SPEC §9.3): where pull records copy pages from. `None`: a pull record
    /// ends the stream.
    pub(crate) puller: Option<Puller>,
    /// The source addresses of the pull record being handled (no allocation per record).
    pull_sources: Vec<u64>,
    /// Pull records that pass their checks are yielded as [`Record::Pull`] for pull threads
    /// to copy, instead of copied here.
    pub(crate) pulls_elsewhere: bool,
    /// Device memory: payloads go to staging buffers, then to the device.
    pub(crate) staging: Option<Staging>,
    /// Counters.
    pub stats: StreamStats,
}

impl StreamReader {
    /// A reader for pages of these per-buffer sizes.
    pub fn new(page_bytes: &[u32]) -> Self {
        let record_len = page_bytes.iter().map(|&b| b as usize).sum();
        Self {
            state: ReadState::Head,
            ahead: vec![0; AHEAD],
            start: 0,
            end: 0,
            ahead_limit: if record_len <= SMALL_RECORD {
                AHEAD
            } else {
                LARGE_AHEAD
            },
            direct_len: 0,
            record_len,
            page_bytes: page_bytes.iter().map(|&b| b as usize).collect(),
            digesting: None,
            spare_digests: Vec::new(),
            opener: AuthChannel::off().split().1,
            puller: None,
            pull_sources: Vec::new(),
            pulls_elsewhere: false,
            staging: None,
            stats: StreamStats::default(),
        }
    }

    /// Opens control records with `opener` (the receiving half of the connection's
    /// [`AuthChannel`], SPEC.md §3.11) instead of decoding them unauthenticated.
    pub fn with_opener(mut self, opener: Opener) -> Self {
        self.opener = opener;
        self
    }

    /// Device memory: whether the record being read waits for a free staging buffer (nothing
    /// more may be read from the stream until one is); takes one if it can.
    pub(crate) fn waits_for_staging(&mut self) -> bool {
        let ReadState::Stage { slot, .. } = &mut self.state else {
            return false;
        };
        if slot.is_some() {
            return false;
        }
        match self.staging.as_mut().and_then(Staging::take_free) {
            Some(s) => {
                *slot = Some(s);
                false
            }
            None => true,
        }
    }

    /// A fence since the last read or copy turns the rest of a landing record into a discard.
    fn refence(&mut self, scopes: &ScopeTable) {
        match self.state {
            ReadState::Land { header, done }
                if scopes.check(header.key, header.dst_page).is_err() =>
            {
                // Cut short: it covers nothing, and its partial digests are dropped.
                self.digesting = None;
                self.state = ReadState::Discard { header, done };
            }
            ReadState::Stage { header, done, slot }
                if scopes.check(header.key, header.dst_page).is_err() =>
            {
                if let (Some(s), Some(st)) = (slot, self.staging.as_mut()) {
                    st.release(s);
                }
                self.state = ReadState::Discard { header, done };
            }
            _ => {}
        }
    }

    /// The slices the next read fills. Call it once [`StreamReader::next_buffered`] returned
    /// `None`.
    pub fn target<'a>(&'a mut self, pool: &'a PagePool, scopes: &ScopeTable) -> ReadTarget<'a> {
        self.refence(scopes);
        // What is left of the read-ahead goes to the front.
        if self.start > 0 {
            self.ahead.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let buffered = self.end;
        let limit = self.ahead_limit;
        let record_len = self.record_len;
        let (direct, want) = match &mut self.state {
            // A frame longer than the buffer grows it (frames are bounded by MAX_PAYLOAD).
            ReadState::Frame { total } => (Direct::None, total.saturating_sub(buffered) + limit),
            ReadState::Head => (Direct::None, limit.max(HEADER_LEN.max(DATA_HEADER_LEN))),
            ReadState::Discard { header, done } => (
                Direct::None,
                (header.len as usize - *done).min(limit.max(AHEAD)),
            ),
            // Unparsed bytes wait for a page to be copied into (next_buffered copies them).
            ReadState::Land { .. } | ReadState::Stage { .. } if buffered > 0 => (Direct::None, 0),
            ReadState::Land { header, done } => match pool.raw_row_mut(header.dst_page) {
                // A page digested as it lands is read in pieces that are digested at once,
                // and with nothing read ahead behind a piece short of the record's end.
                Some(row) if self.digesting.is_some() && record_len - *done > DIGEST_PIECE => {
                    (Direct::Row(row, *done, DIGEST_PIECE), 0)
                }
                Some(row) => (Direct::Row(row, *done, record_len - *done), limit),
                None => {
                    self.state = ReadState::busy(*header, *done);
                    self.digesting = None;
                    return self.target(pool, scopes);
                }
            },
            ReadState::Stage { done, slot, .. } => match (slot, self.staging.as_mut()) {
                // The slot is the host's (Filling) until the record is complete.
                (Some(s), Some(st)) => (Direct::Staging(&mut st.bytes(*s, record_len)[*done..]), 0),
                // No slot yet: read ahead (copied once one is free).
                _ => (Direct::None, limit),
            },
        };
        self.direct_len = match &direct {
            Direct::None => 0,
            Direct::Row(_, _, max) => *max,
            Direct::Staging(s) => s.len(),
        };
        let want = want.max(usize::from(self.direct_len == 0));
        if self.ahead.len() < buffered + want {
            self.ahead.resize(buffered + want, 0);
        }
        ReadTarget {
            direct,
            ahead: &mut self.ahead[buffered..buffered + want],
        }
    }

    /// Accounts for `n` bytes read into the last target; returns the data record they
    /// completed, if they did. Bytes read ahead are parsed by
    /// [`StreamReader::next_buffered`].
    pub fn advance(&mut self, n: usize, pool: &PagePool, scopes: &ScopeTable) -> Option<Record> {
        self.stats.reads += 1;
        let direct = n.min(self.direct_len);
        self.direct_len = 0;
        self.end += n - direct;
        match &mut self.state {
            ReadState::Land { header, done } => {
                *done += direct;
                if let Some(d) = &mut self.digesting {
                    // A slot this read completed is digested now, from the page, while in cache.
                    let page = header.dst_page;
                    let ok = d.feed(&self.page_bytes, *done, |b, kind| {
                        pool.raw_page(page, b).map(|bytes| kind.page_digest(&bytes))
                    });
                    if !ok {
                        self.digesting = None;
                    }
                }
                (*done == header.len as usize).then(|| self.landed())
            }
            ReadState::Stage { header, done, .. } => {
                *done += direct;
                (*done == header.len as usize).then(|| self.staged(scopes))
            }
            _ => None,
        }
    }

    /// The record in `Land` state has all its bytes.
    fn landed(&mut self) -> Record {
        let ReadState::Land { header, .. } = std::mem::replace(&mut self.state, ReadState::Head)
        else {
            unreachable!("landed() outside Land");
        };
        self.stats.writes_landed += 1;
        self.stats.bytes_landed += u64::from(header.len);
        let digests = self.digesting.take().and_then(|d| {
            let (digests, spare) = d.finish(header.len as usize);
            self.spare_digests = spare;
            digests
        });
        self.stats.digested_at_landing += u64::from(digests.is_some());
        Record::Landed(header, digests)
    }

    /// The record in `Stage` state has all its bytes in its staging buffer. The scope is
    /// checked again now: a fence while the payload was read means it lands nowhere.
    fn staged(&mut self, scopes: &ScopeTable) -> Record {
        let ReadState::Stage { header, slot, .. } =
            std::mem::replace(&mut self.state, ReadState::Head)
        else {
            unreachable!("staged() outside Stage");
        };
        match slot {
            Some(s) if scopes.check(header.key, header.dst_page).is_ok() => {
                self.stats.writes_landed += 1;
                self.stats.bytes_landed += u64::from(header.len);
                Record::Staged(header, s)
            }
            _ => {
                if let (Some(s), Some(st)) = (slot, self.staging.as_mut()) {
                    st.release(s);
                }
                self.stats.writes_refused += 1;
                Record::Refused(header)
            }
        }
    }

    /// Parses what the read-ahead buffer holds: the next whole record it completes (copying
    /// data bytes into their page or staging buffer on the way), or `None` once it needs
    /// more bytes from the stream.
    ///
    /// # Errors
    ///
    /// A [`StreamError`] when the stream cannot be read on: the connection ends.
    pub fn next_buffered(
        &mut self,
        pool: &PagePool,
        scopes: &ScopeTable,
    ) -> Result<Option<Record>, StreamError> {
        loop {
            self.refence(scopes);
            let avail = self.end - self.start;
            let at = self.start;
            match &mut self.state {
                ReadState::Head => {
                    if avail < 4 {
                        return Ok(None);
                    }
                    let magic: [u8; 4] = [
                        self.ahead[at],
                        self.ahead[at + 1],
                        self.ahead[at + 2],
                        self.ahead[at + 3],
                    ];
                    if magic == MAGIC {
                        if avail < HEADER_LEN {
                            return Ok(None);
                        }
                        // The frame header gives the payload length: take the whole frame.
                        let h = &self.ahead[at + 8..at + 12];
                        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
                        if len > kvwire_proto::wire::MAX_PAYLOAD {
                            return Err(DecodeError::PayloadTooLarge { len }.into());
                        }
                        let total = HEADER_LEN + len as usize + TRAILER_LEN;
                        self.state = ReadState::Frame { total };
                        continue;
                    }
                    if magic == PULL_MAGIC && self.puller.is_some() {
                        let len = DATA_HEADER_LEN + 8 * self.page_bytes.len();
                        if avail < len {
                            return Ok(None);
                        }
                        let mut h = [0u8; DATA_HEADER_LEN];
                        h.copy_from_slice(&self.ahead[at..at + DATA_HEADER_LEN]);
                        self.pull_sources.clear();
                        self.pull_sources.extend(
                            self.ahead[at + DATA_HEADER_LEN..at + len]
                                .chunks_exact(8)
                                .map(|a| u64::from_le_bytes(a.try_into().unwrap_or([0; 8]))),
                        );
                        self.start += len;
                        return self.pull(DataHeader::decode(&h), pool, scopes).map(Some);
                    }
                    if magic != DATA_MAGIC {
                        return Err(StreamError::BadMagic(magic));
                    }
                    if avail < DATA_HEADER_LEN {
                        return Ok(None);
                    }
                    let mut h = [0u8; DATA_HEADER_LEN];
                    h.copy_from_slice(&self.ahead[at..at + DATA_HEADER_LEN]);
                    self.start += DATA_HEADER_LEN;
                    self.state = self.data_state(DataHeader::decode(&h), scopes)?;
                }
                ReadState::Frame { total } => {
                    let total = *total;
                    if avail < total {
                        return Ok(None);
                    }
                    let (frame, _) =
                        self.opener
                            .open(&self.ahead[at..at + total])
                            .map_err(|e| match e {
                                OpenError::Auth(e) => StreamError::Auth(e),
                                OpenError::Decode(e) => StreamError::Frame(e),
                                other => StreamError::Open(other),
                            })?;
                    self.start += total;
                    self.state = ReadState::Head;
                    self.stats.frames += 1;
                    return Ok(Some(Record::Frame(frame)));
                }
                ReadState::Discard { header, done } => {
                    let k = avail.min(header.len as usize - *done);
                    *done += k;
                    self.start += k;
                    if *done < header.len as usize {
                        return Ok(None);
                    }
                    let header = *header;
                    self.state = ReadState::Head;
                    self.stats.writes_refused += 1;
                    return Ok(Some(Record::Refused(header)));
                }
                ReadState::Land { header, done } => {
                    if avail == 0 {
                        return Ok(None);
                    }
                    let Some(mut row) = pool.raw_row_mut(header.dst_page) else {
                        self.state = ReadState::busy(*header, *done);
                        self.digesting = None;
                        continue;
                    };
                    let k = avail.min(header.len as usize - *done);
                    let mut src = &self.ahead[at..at + k];
                    let mut off = *done;
                    for b in row.buffers_mut().iter_mut() {
                        if src.is_empty() {
                            break;
                        }
                        if off >= b.len() {
                            off -= b.len();
                            continue;
                        }
                        let n = src.len().min(b.len() - off);
                        b[off..off + n].copy_from_slice(&src[..n]);
                        src = &src[n..];
                        off = 0;
                    }
                    if let Some(d) = &mut self.digesting {
                        let slots = row.buffers_mut();
                        let ok = d.feed(&self.page_bytes, *done + k, |b, kind| {
                            Some(kind.page_digest(slots[b]))
                        });
                        if !ok {
                            self.digesting = None;
                        }
                    }
                    drop(row);
                    *done += k;
                    self.start += k;
                    self.stats.bytes_copied += k as u64;
                    if *done == header.len as usize {
                        return Ok(Some(self.landed()));
                    }
                    return Ok(None);
                }
                ReadState::Stage { header, done, slot } => {
                    if avail == 0 {
                        return Ok(None);
                    }
                    let Some(st) = self.staging.as_mut() else {
                        return Ok(None);
                    };
                    if slot.is_none() {
                        *slot = st.take_free();
                    }
                    let Some(s) = *slot else {
                        // Every staging buffer is being copied: wait for one.
                        return Ok(None);
                    };
                    let k = avail.min(header.len as usize - *done);
                    st.bytes(s, self.record_len)[*done..*done + k]
                        .copy_from_slice(&self.ahead[at..at + k]);
                    *done += k;
                    self.start += k;
                    self.stats.bytes_copied += k as u64;
                    if *done == header.len as usize {
                        return Ok(Some(self.staged(scopes)));
                    }
                    return Ok(None);
                }
            }
        }
    }

    /// A pull record (SPEC §9.3), whole in `record`: the data record's checks at its header,
    /// then each buffer's slot of the reserved page copied out of the prefill's memory,
    /// digested right after its copy when the scope asks for digests at landing. The copy runs
    /// here, on the stream's own task, after the scope check and before anything else of the
    /// connection: a fence (which closes the scope on this task) lets no pull start after it.
    /// With pull threads ([`StreamReader::pulls_elsewhere`]) the record passes its checks
    /// here and comes back as [`Record::Pull`] for the stream's owner to hand to a thread.
    fn pull(
        &mut self,
        header: DataHeader,
        pool: &PagePool,
        scopes: &ScopeTable,
    ) -> Result<Record, StreamError> {
        let landing = match self.data_state(header, scopes)? {
            ReadState::Land { .. } => scopes.get(header.key).and_then(|s| s.landing_digest()),
            _ => {
                self.stats.writes_refused += 1;
                return Ok(Record::Refused(header));
            }
        };
        // `data_state` may have started a streaming digest for a large record: pulls digest
        // each slot whole instead; its allocation goes back to the spare.
        if let Some(d) = self.digesting.take() {
            self.spare_digests = d.finish(0).1;
        }
        let Some(puller) = self.puller else {
            self.stats.writes_refused += 1;
            return Ok(Record::Refused(header));
        };
        if self.pulls_elsewhere {
            return Ok(Record::Pull {
                header,
                sources: self.pull_sources.clone(),
                landing,
            });
        }
        let mut taken = std::mem::take(&mut self.spare_digests);
        let outcome = PullOutcome::run(
            puller,
            pool,
            header,
            &self.pull_sources,
            landing,
            &mut taken,
        );
        self.spare_digests = taken;
        Ok(match outcome.report(header, &mut self.stats) {
            Some(TransportEvent::Landed { digests, .. }) => Record::Landed(header, digests),
            _ => Record::Refused(header),
        })
    }

    /// What a data record's header leads to: landing, staging, or discarding its payload;
    /// or the end of the connection when it breaks the rules of SPEC §9.1.
    fn data_state(
        &mut self,
        header: DataHeader,
        scopes: &ScopeTable,
    ) -> Result<ReadState, StreamError> {
        if header.len as usize != self.record_len {
            return Err(StreamError::BadDataLength {
                got: header.len,
                expected: self.record_len as u64,
            });
        }
        self.digesting = None;
        // A key naming no open scope is a late record (its transfer was fenced) or a stray
        // one: its bytes are discarded. Under an open scope the record MUST be that
        // reservation's, at the page reserved for its ordinal (SPEC §9.1).
        Ok(match scopes.get(header.key) {
            None => ReadState::Discard { header, done: 0 },
            Some(scope) => {
                let reserved = scope.page_at(header.ordinal);
                if scope.transfer != header.transfer || reserved != Some(header.dst_page) {
                    return Err(StreamError::RecordMismatch {
                        header,
                        scope: scope.transfer,
                        reserved,
                    });
                }
                if self.staging.is_some() {
                    // Device memory: the record lands in staging first (SPEC §9.1).
                    ReadState::Stage {
                        header,
                        done: 0,
                        slot: self.staging.as_mut().and_then(Staging::take_free),
                    }
                } else {
                    // Pages of large records are digested as they land, when the scope asks
                    // for that; small ones are whole after one copy and still in cache when
                    // the driver digests them on their landing.
                    if self.record_len > SMALL_RECORD {
                        let spare = std::mem::take(&mut self.spare_digests);
                        self.digesting = scope
                            .landing_digest()
                            .and_then(|alg| RowDigests::new(alg, spare));
                    }
                    ReadState::Land { header, done: 0 }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests;
