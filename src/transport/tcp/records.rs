//! The TCP stream's records (control frames and data records) and the incremental parser of
//! its receiving side.

use kvwire_proto::auth::{AuthChannel, AuthError, OpenError, Opener};
use kvwire_proto::wire::TransferId;
use kvwire_proto::wire::{DecodeError, Frame, TransferRef, HEADER_LEN, MAGIC, TRAILER_LEN};

use crate::memory::{AccessKey, PageMut, PagePool, ScopeTable};
use crate::transport::staging::Staging;

/// Magic of a data record.
pub const DATA_MAGIC: [u8; 4] = *b"KVDT";
/// Length of a data record's header.
pub const DATA_HEADER_LEN: usize = 36;

/// The header of a data record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataHeader {
    /// The reservation written.
    pub transfer: TransferRef,
    /// The access key from RESERVE.
    pub key: AccessKey,
    /// The page's ordinal in the transfer.
    pub ordinal: u32,
    /// The destination page index.
    pub dst_page: u32,
    /// Payload bytes (all buffers of the page).
    pub len: u32,
}

impl DataHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; DATA_HEADER_LEN] {
        let mut b = [0u8; DATA_HEADER_LEN];
        b[0..4].copy_from_slice(&DATA_MAGIC);
        b[4..12].copy_from_slice(&self.transfer.transfer_id.0.to_le_bytes());
        b[12..20].copy_from_slice(&self.transfer.nonce.to_le_bytes());
        b[20..24].copy_from_slice(&self.key.0.to_le_bytes());
        b[24..28].copy_from_slice(&self.ordinal.to_le_bytes());
        b[28..32].copy_from_slice(&self.dst_page.to_le_bytes());
        b[32..36].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    fn decode(b: &[u8; DATA_HEADER_LEN]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        Self {
            transfer: TransferRef {
                transfer_id: TransferId(u64_at(4)),
                nonce: u64_at(12),
            },
            key: AccessKey(u32_at(20)),
            ordinal: u32_at(24),
            dst_page: u32_at(28),
            len: u32_at(32),
        }
    }
}

/// Why the stream can no longer be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// A control record did not decode.
    #[error("bad control frame: {0}")]
    Frame(#[from] DecodeError),
    /// A control record failed authentication (SPEC.md §3.11): the connection is closed.
    #[error("control frame refused: {0}")]
    Auth(AuthError),
    /// A control record could not be opened for another reason.
    #[error("control frame refused: {0}")]
    Open(OpenError),
    /// A record starts with neither magic.
    #[error(
        "unknown record magic {} (expected a frame, {}, or a data record, {})",
        kvwire_proto::wire::show_bytes(.0),
        kvwire_proto::wire::show_bytes(&MAGIC),
        kvwire_proto::wire::show_bytes(&DATA_MAGIC)
    )]
    BadMagic([u8; 4]),
    /// A data record whose access key names an open scope but which does not match that
    /// scope's reservation: another transfer id or nonce, an ordinal beyond its pages, or a
    /// destination page other than the one reserved at its ordinal (SPEC §9.1). A protocol
    /// violation: the connection is closed and every transfer fails safely.
    #[error(
        "data record for transfer {} nonce {:#x}, ordinal {} -> page {} under the access key of transfer {} nonce {:#x}, which reserved {} at that ordinal",
        .header.transfer.transfer_id.0,
        .header.transfer.nonce,
        .header.ordinal,
        .header.dst_page,
        .scope.transfer_id.0,
        .scope.nonce,
        .reserved.map_or("no page".to_string(), |p| format!("page {p}"))
    )]
    RecordMismatch {
        /// The record's header.
        header: DataHeader,
        /// The reservation the key belongs to.
        scope: TransferRef,
        /// The page that reservation has at the record's ordinal.
        reserved: Option<u32>,
    },
    /// A data record's length is not the layout's bytes per page index.
    #[error("data record of {got} bytes, the layout's pages are {expected} bytes")]
    BadDataLength {
        /// The record's length.
        got: u32,
        /// Bytes per page index.
        expected: u64,
    },
}

/// What a completed record was.
#[derive(Debug)]
pub enum Record {
    /// A control frame.
    Frame(Frame),
    /// A data record whose bytes landed in its destination page.
    Landed(DataHeader),
    /// A data record refused (no open scope or page out of scope): its bytes were dropped.
    Refused(DataHeader),
    /// Device memory: a data record whose bytes are all in staging buffer `slot`, its scope
    /// still open; it lands once they are copied into the page.
    Staged(DataHeader, usize),
}

#[derive(Debug)]
enum ReadState {
    /// Collecting the first 4 bytes, or a whole frame header, or a whole data header.
    Head { filled: usize },
    /// Collecting the rest of a control frame (`total` bytes in all).
    Frame { total: usize, filled: usize },
    /// Reading a data record's payload into its page: `done` bytes so far.
    Land { header: DataHeader, done: usize },
    /// Reading a refused data record's payload into scratch.
    Discard { header: DataHeader, done: usize },
    /// Device memory: reading a data record's payload into a staging buffer (`None`: none
    /// free yet; nothing is read until one is).
    Stage {
        header: DataHeader,
        done: usize,
        slot: Option<usize>,
    },
}

/// Where the next read lands: the reader's own buffer, or a destination page from an offset
/// (write-locked while the target lives).
#[derive(Debug)]
pub enum ReadTarget<'a> {
    /// Header, frame or discarded bytes.
    Buf(&'a mut [u8]),
    /// A destination page's bytes from this offset.
    Page(PageMut<'a>, usize),
}

impl ReadTarget<'_> {
    /// The bytes to read into.
    pub fn bytes(&mut self) -> &mut [u8] {
        match self {
            Self::Buf(b) => b,
            Self::Page(p, off) => &mut p[*off..],
        }
    }
}

/// Counters of the receiving side of a stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Data records landed.
    pub writes_landed: u64,
    /// Data records refused.
    pub writes_refused: u64,
    /// Payload bytes landed in pages.
    pub bytes_landed: u64,
    /// Control frames received.
    pub frames: u64,
}

/// The receiving side of a stream, as an incremental, cancel-safe parser.
///
/// Each step hands out the exact slice the next `read` must fill ([`StreamReader::target`]),
/// then is told how many bytes arrived ([`StreamReader::advance`]). Because a single `read`
/// either completes or does nothing, the caller may race it against timers and commands.
/// Before every read into a page, the scope is checked again, so a fence that happens
/// between two reads sends the rest of the record to scratch instead of into a released page.
#[derive(Debug)]
pub struct StreamReader {
    state: ReadState,
    head: Vec<u8>,
    scratch: Vec<u8>,
    page_bytes: Vec<usize>,
    opener: Opener,
    /// Device memory: payloads go to staging buffers, then to the device.
    pub(crate) staging: Option<Staging>,
    /// Counters.
    pub stats: StreamStats,
}

impl StreamReader {
    /// A reader for pages of these per-buffer sizes.
    pub fn new(page_bytes: &[u32]) -> Self {
        Self {
            state: ReadState::Head { filled: 0 },
            head: vec![0; HEADER_LEN.max(DATA_HEADER_LEN)],
            scratch: vec![0; 64 * 1024],
            page_bytes: page_bytes.iter().map(|&b| b as usize).collect(),
            opener: AuthChannel::off().split().1,
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

    fn record_len(&self) -> usize {
        self.page_bytes.iter().sum()
    }

    /// Device memory: whether the record being read waits for a free staging buffer (nothing
    /// may be read from the stream until one is); takes one if it can.
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

    /// The slice the next read must fill.
    pub fn target<'a>(&'a mut self, pool: &'a PagePool, scopes: &ScopeTable) -> ReadTarget<'a> {
        // A fence since the last read turns the rest of a landing record into a discard.
        if let ReadState::Land { header, done } = self.state {
            if scopes.check(header.key, header.dst_page).is_err() {
                self.state = ReadState::Discard { header, done };
            }
        }
        if let ReadState::Stage { header, done, slot } = self.state {
            if scopes.check(header.key, header.dst_page).is_err() {
                if let (Some(s), Some(st)) = (slot, self.staging.as_mut()) {
                    st.release(s);
                }
                self.state = ReadState::Discard { header, done };
            }
        }
        let record_len = self.record_len();
        match &mut self.state {
            ReadState::Head { filled } => {
                let want = if *filled < 4 {
                    4
                } else if self.head[..4] == MAGIC {
                    HEADER_LEN
                } else {
                    DATA_HEADER_LEN
                };
                ReadTarget::Buf(&mut self.head[*filled..want])
            }
            ReadState::Frame { total, filled } => {
                let (f, t) = (*filled, *total);
                ReadTarget::Buf(&mut self.head[f..t])
            }
            ReadState::Land { header, done } => {
                let (mut b, mut off) = (0, *done);
                while b < self.page_bytes.len() && off >= self.page_bytes[b] {
                    off -= self.page_bytes[b];
                    b += 1;
                }
                match pool.raw_page_mut(header.dst_page, b) {
                    Some(page) => ReadTarget::Page(page, off),
                    None => ReadTarget::Buf(&mut self.scratch[..1]),
                }
            }
            ReadState::Discard { header, done } => {
                let left = header.len as usize - *done;
                let n = left.min(self.scratch.len());
                ReadTarget::Buf(&mut self.scratch[..n])
            }
            ReadState::Stage { done, slot, .. } => match (slot, self.staging.as_mut()) {
                // The slot is the host's (Filling) until the record is complete.
                (Some(s), Some(st)) => ReadTarget::Buf(&mut st.bytes(*s, record_len)[*done..]),
                // `waits_for_staging` is asked first; should it not have been, read one byte
                // of the record nowhere rather than hand out an empty target.
                _ => ReadTarget::Buf(&mut self.scratch[..0]),
            },
        }
    }

    /// Accounts for `n` bytes read into the last target; returns a record once complete.
    pub fn advance(
        &mut self,
        n: usize,
        scopes: &ScopeTable,
    ) -> Result<Option<Record>, StreamError> {
        match &mut self.state {
            ReadState::Head { filled } => {
                *filled += n;
                let f = *filled;
                if f < 4 {
                    return Ok(None);
                }
                let magic: [u8; 4] = [self.head[0], self.head[1], self.head[2], self.head[3]];
                if magic == MAGIC {
                    if f < HEADER_LEN {
                        return Ok(None);
                    }
                    // The frame header gives the payload length; take the rest of the frame.
                    let len = u32::from_le_bytes([
                        self.head[8],
                        self.head[9],
                        self.head[10],
                        self.head[11],
                    ]);
                    if len > kvwire_proto::wire::MAX_PAYLOAD {
                        return Err(DecodeError::PayloadTooLarge { len }.into());
                    }
                    let total = HEADER_LEN + len as usize + TRAILER_LEN;
                    self.head.resize(total.max(DATA_HEADER_LEN), 0);
                    self.state = ReadState::Frame { total, filled: f };
                    return self.advance(0, scopes);
                }
                if magic != DATA_MAGIC {
                    return Err(StreamError::BadMagic(magic));
                }
                if f < DATA_HEADER_LEN {
                    return Ok(None);
                }
                let mut h = [0u8; DATA_HEADER_LEN];
                h.copy_from_slice(&self.head[..DATA_HEADER_LEN]);
                let header = DataHeader::decode(&h);
                let expected = self.record_len();
                if header.len as usize != expected {
                    return Err(StreamError::BadDataLength {
                        got: header.len,
                        expected: expected as u64,
                    });
                }
                // A key naming no open scope is a late record (its transfer was fenced) or a
                // stray one: its bytes are discarded. Under an open scope the record MUST be
                // that reservation's, at the page reserved for its ordinal (SPEC §9.1).
                self.state = match scopes.get(header.key) {
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
                            ReadState::Land { header, done: 0 }
                        }
                    }
                };
                Ok(None)
            }
            ReadState::Frame { total, filled } => {
                *filled += n;
                if *filled < *total {
                    return Ok(None);
                }
                let total = *total;
                let (frame, _) = self.opener.open(&self.head[..total]).map_err(|e| match e {
                    OpenError::Auth(e) => StreamError::Auth(e),
                    OpenError::Decode(e) => StreamError::Frame(e),
                    other => StreamError::Open(other),
                })?;
                self.head.truncate(HEADER_LEN.max(DATA_HEADER_LEN));
                self.state = ReadState::Head { filled: 0 };
                self.stats.frames += 1;
                Ok(Some(Record::Frame(frame)))
            }
            ReadState::Land { header, done } => {
                *done += n;
                if *done < header.len as usize {
                    return Ok(None);
                }
                let header = *header;
                self.state = ReadState::Head { filled: 0 };
                self.stats.writes_landed += 1;
                self.stats.bytes_landed += u64::from(header.len);
                Ok(Some(Record::Landed(header)))
            }
            ReadState::Discard { header, done } => {
                *done += n;
                if *done < header.len as usize {
                    return Ok(None);
                }
                let header = *header;
                self.state = ReadState::Head { filled: 0 };
                self.stats.writes_refused += 1;
                Ok(Some(Record::Refused(header)))
            }
            ReadState::Stage { header, done, slot } => {
                *done += n;
                if *done < header.len as usize {
                    return Ok(None);
                }
                let (header, slot) = (*header, *slot);
                self.state = ReadState::Head { filled: 0 };
                // The scope is checked again now: a fence while the payload was read means
                // the record lands nowhere.
                match slot {
                    Some(s) if scopes.check(header.key, header.dst_page).is_ok() => {
                        self.stats.writes_landed += 1;
                        self.stats.bytes_landed += u64::from(header.len);
                        Ok(Some(Record::Staged(header, s)))
                    }
                    _ => {
                        if let (Some(s), Some(st)) = (slot, self.staging.as_mut()) {
                            st.release(s);
                        }
                        self.stats.writes_refused += 1;
                        Ok(Some(Record::Refused(header)))
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{PoolGeometry, Scrub};

    /// Feeds `bytes` to the reader as a stream would, collecting whole records.
    fn feed(
        reader: &mut StreamReader,
        pool: &PagePool,
        scopes: &ScopeTable,
        mut bytes: &[u8],
    ) -> Result<Vec<Record>, StreamError> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let n = {
                let mut target = reader.target(pool, scopes);
                let t = target.bytes();
                let n = t.len().min(bytes.len());
                t[..n].copy_from_slice(&bytes[..n]);
                n
            };
            bytes = &bytes[n..];
            if let Some(r) = reader.advance(n, scopes)? {
                out.push(r);
            }
        }
        Ok(out)
    }

    /// SPEC §7.2 / §9.1: a record with neither magic ends the connection, its bytes named
    /// as hex and ASCII.
    #[test]
    fn an_unknown_record_magic_is_named_in_hex_and_ascii() {
        let pool = PagePool::new(
            PoolGeometry {
                tokens_per_page: 1,
                buffer_page_bytes: vec![8],
                pages: 1,
            },
            Scrub::None,
        )
        .unwrap();
        let mut reader = StreamReader::new(&[8]);
        let e = feed(
            &mut reader,
            &pool,
            &ScopeTable::default(),
            b"GET / HTTP/1.0\r\n",
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(text.contains(r#"47 45 54 20 "GET ""#), "{text}");
        assert!(text.contains(r#"4b 56 44 54 "KVDT""#), "{text}");
    }

    /// SPEC §9.1: under an open scope a data record MUST be that reservation's (transfer id
    /// and nonce) and write the page reserved at its ordinal; one that is not is a protocol
    /// violation that ends the connection, before any of its bytes lands. A record under a
    /// closed (fenced) key is discarded.
    #[test]
    fn a_record_that_does_not_match_its_scopes_reservation_ends_the_connection() {
        let pool = PagePool::new(
            PoolGeometry {
                tokens_per_page: 1,
                buffer_page_bytes: vec![8],
                pages: 8,
            },
            Scrub::None,
        )
        .unwrap();
        let t = TransferRef {
            transfer_id: TransferId(7),
            nonce: 0x1234,
        };
        let mut scopes = ScopeTable::default();
        let key = scopes.open(t.transfer_id, &[5, 2]);
        scopes.bind(t);
        let record = |transfer, ordinal, dst_page| {
            let mut b = DataHeader {
                transfer,
                key,
                ordinal,
                dst_page,
                len: 8,
            }
            .encode()
            .to_vec();
            b.extend_from_slice(&[0xAB; 8]);
            b
        };
        // The reservation's own record lands.
        let mut reader = StreamReader::new(&[8]);
        let got = feed(&mut reader, &pool, &scopes, &record(t, 1, 2)).unwrap();
        assert!(matches!(&got[..], [Record::Landed(h)] if h.dst_page == 2));
        for (transfer, ordinal, dst_page) in [
            (TransferRef { nonce: 0x9999, ..t }, 1, 2),
            (
                TransferRef {
                    transfer_id: TransferId(8),
                    ..t
                },
                1,
                2,
            ),
            (t, 0, 2), // a page of the scope, but not the one reserved at ordinal 0
            (t, 2, 2), // an ordinal beyond the reservation
            (t, 0, 6), // a page outside the scope
        ] {
            let mut reader = StreamReader::new(&[8]);
            let e = feed(
                &mut reader,
                &pool,
                &scopes,
                &record(transfer, ordinal, dst_page),
            )
            .unwrap_err();
            assert!(
                matches!(e, StreamError::RecordMismatch { scope, .. } if scope == t),
                "{e}"
            );
        }
        // After the fence the key is dead: a late record is discarded, not an error.
        scopes.close(t.transfer_id);
        let mut reader = StreamReader::new(&[8]);
        let got = feed(&mut reader, &pool, &scopes, &record(t, 0, 5)).unwrap();
        assert!(matches!(&got[..], [Record::Refused(_)]));
    }
}
