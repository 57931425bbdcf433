//! Frames: the header, the payload of every frame type, encoding and decoding.
//!
//! Layout (SPEC.md §3), all integers little-endian:
//!
//! ```text
//! offset size field
//! 0      4    magic         "KVWR" (4B 56 57 52)
//! 4      2    version       2
//! 6      2    frame type    FrameType
//! 8      4    payload len   N <= MAX_PAYLOAD
//! 12     N    payload       per frame type
//! 12+N   4    crc32         CRC-32 (IEEE) of bytes 0 .. 12+N
//! ```

use super::codec::{Reader, Writer};
use super::error::{DecodeError, EncodeError};
use super::limits::{
    HEADER_LEN, MAGIC, MAX_ACCESS, MAX_AUX, MAX_BUFFERS, MAX_DETAIL, MAX_DIGEST_ALGORITHMS,
    MAX_FINGERPRINT, MAX_PAGES, MAX_PAGE_DIGESTS, MAX_PAYLOAD, MAX_TRANSPORT_PARAMS, TRAILER_LEN,
    VERSION,
};
use super::TransferId;
use super::{Digest128, DigestAlgorithm, ErrorCode, FrameType, KvLayout, Role};

/// The body of HELLO and HELLO_ACK: who a node is and what it can exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// A node identifier chosen by the node (for logs and accounting; not authenticated).
    pub node_id: u64,
    /// The role the sender of this hello plays on the connection.
    pub role: Role,
    /// The KV layout; must equal the peer's exactly.
    pub layout: KvLayout,
    /// Digest algorithms supported, most preferred first.
    pub digests: Vec<DigestAlgorithm>,
    /// Transport parameters, opaque to the protocol (e.g. RDMA GID, QPN, PSN, MTU).
    pub transport_params: Vec<u8>,
    /// The longest auxiliary record this node accepts in a COMMIT it receives (0: none), at
    /// most [`MAX_AUX`](super::MAX_AUX). A sender never commits a longer one to this node.
    pub max_aux: u32,
}

/// HELLO_REJECT: the connection is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelloReject {
    /// Why.
    pub code: ErrorCode,
    /// The exact mismatch, for humans.
    pub detail: String,
}

/// Names one reservation of one transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferRef {
    /// The transfer id both engines agreed on (the request id).
    pub transfer_id: TransferId,
    /// The reservation's nonce; 0 where no reservation is known yet.
    pub nonce: u64,
}

/// RESERVE: the receiver has reserved pages for a transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reserve {
    /// The transfer id.
    pub transfer_id: TransferId,
    /// A fresh, non-zero nonce for this reservation.
    pub nonce: u64,
    /// Tokens the receiver expects.
    pub tokens: u32,
    /// The digest algorithm the commit must use.
    pub digest: DigestAlgorithm,
    /// Whether the commit must carry per-page digests as well as per-buffer ones.
    pub page_digests: bool,
    /// Milliseconds the sender has, from receipt, to commit.
    pub deadline_ms: u32,
    /// Destination page indices, in transfer order; page ordinal `i` goes to `pages[i]`.
    pub pages: Vec<u32>,
    /// Transport-specific access descriptor scoped to exactly these pages (opaque).
    pub access: Vec<u8>,
}

/// REJECT: the sender will not serve the reservation; no data has been or will be written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reject {
    /// The reservation refused.
    pub transfer: TransferRef,
    /// The original error (e.g. the admission error that retired the request).
    pub code: ErrorCode,
    /// Details for humans.
    pub detail: String,
}

/// COMMIT: the sender's writes are complete; what it wrote, bound to the reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Commit {
    /// The reservation committed.
    pub transfer: TransferRef,
    /// Tokens written.
    pub tokens: u32,
    /// Pages written.
    pub pages: u32,
    /// Bytes written over all buffers.
    pub bytes: u64,
    /// Algorithm of the digests.
    pub digest: DigestAlgorithm,
    /// One digest per buffer.
    pub buffer_digests: Vec<Digest128>,
    /// Empty, or one digest per page per buffer, buffer-major.
    pub page_digests: Vec<u64>,
    /// The digest of `aux`, bound to the reservation (SPEC.md §6). All-zero = missing.
    pub aux_digest: Digest128,
    /// The auxiliary record delivered with the pages (e.g. the first output token), at most
    /// [`MAX_AUX`](super::MAX_AUX) bytes and at most the receiver's `max_aux`; may be empty.
    pub aux: Vec<u8>,
}

/// NACK: the receiver failed the transfer at verification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nack {
    /// The reservation failed.
    pub transfer: TransferRef,
    /// Why.
    pub code: ErrorCode,
    /// The first bad buffer, or [`NONE_INDEX`](super::NONE_INDEX).
    pub buffer: u32,
    /// The first bad page ordinal within that buffer, or [`NONE_INDEX`](super::NONE_INDEX).
    pub page: u32,
    /// Details for humans.
    pub detail: String,
}

/// ABORT: the transfer is abandoned by the side that sends it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Abort {
    /// The reservation abandoned: the aborting side's current TransferRef. A sender that
    /// aborts before any reservation sends no ABORT at all (the RESERVE that comes later is
    /// answered with REJECT carrying the abort's code, SPEC.md §5.3.5); a receiver still
    /// accepts an ABORT with nonce 0 from a sender as naming its open reservation (§7.4).
    pub transfer: TransferRef,
    /// Why.
    pub code: ErrorCode,
    /// From a sender: pages whose writes completed before it stopped. From a receiver: 0.
    pub completed_pages: u32,
    /// Details for humans.
    pub detail: String,
}

/// One protocol frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Client's hello.
    Hello(Hello),
    /// Server accepts, with its own hello body.
    HelloAck(Hello),
    /// Connection refused.
    HelloReject(HelloReject),
    /// Client's confirmation of an authenticated handshake (empty payload; only ever sent
    /// sealed, SPEC.md §4.8).
    HelloConfirm,
    /// Pages reserved.
    Reserve(Reserve),
    /// Reservation refused by the sender.
    Reject(Reject),
    /// Writes done; counts and digests.
    Commit(Commit),
    /// Transfer verified and delivered.
    Verified(TransferRef),
    /// Transfer failed verification.
    Nack(Nack),
    /// Transfer abandoned.
    Abort(Abort),
    /// Abort acknowledged.
    AbortAck(TransferRef),
    /// Heartbeat (either side, after the handshake): the peer answers [`Frame::Pong`] with
    /// the same token (SPEC.md §8.3).
    Ping(u64),
    /// The answer to a [`Frame::Ping`], echoing its token.
    Pong(u64),
}

fn check_len(field: &'static str, len: usize, max: usize) -> Result<(), EncodeError> {
    if len > max {
        Err(EncodeError::TooLarge { field, len, max })
    } else {
        Ok(())
    }
}

/// Cuts `s` to at most `max` bytes at a character boundary.
fn truncate_detail(s: &str) -> &str {
    if s.len() <= MAX_DETAIL {
        return s;
    }
    let mut end = MAX_DETAIL;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Frame {
    /// The frame's type code.
    pub fn frame_type(&self) -> FrameType {
        match self {
            Self::Hello(_) => FrameType::HELLO,
            Self::HelloAck(_) => FrameType::HELLO_ACK,
            Self::HelloReject(_) => FrameType::HELLO_REJECT,
            Self::HelloConfirm => FrameType::HELLO_CONFIRM,
            Self::Reserve(_) => FrameType::RESERVE,
            Self::Reject(_) => FrameType::REJECT,
            Self::Commit(_) => FrameType::COMMIT,
            Self::Verified(_) => FrameType::VERIFIED,
            Self::Nack(_) => FrameType::NACK,
            Self::Abort(_) => FrameType::ABORT,
            Self::AbortAck(_) => FrameType::ABORT_ACK,
            Self::Ping(_) => FrameType::PING,
            Self::Pong(_) => FrameType::PONG,
        }
    }

    /// The transfer a per-transfer frame names; `None` for handshake frames.
    pub fn transfer(&self) -> Option<TransferRef> {
        match self {
            Self::Hello(_)
            | Self::HelloAck(_)
            | Self::HelloReject(_)
            | Self::HelloConfirm
            | Self::Ping(_)
            | Self::Pong(_) => None,
            Self::Reserve(r) => Some(TransferRef {
                transfer_id: r.transfer_id,
                nonce: r.nonce,
            }),
            Self::Reject(r) => Some(r.transfer),
            Self::Commit(c) => Some(c.transfer),
            Self::Verified(t) | Self::AbortAck(t) => Some(*t),
            Self::Nack(n) => Some(n.transfer),
            Self::Abort(a) => Some(a.transfer),
        }
    }

    /// Encodes the frame, appending it to `out`. On error `out` is left as it was.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let start = out.len();
        self.encode_without_crc(out)?;
        let crc = crc32fast::hash(&out[start..]);
        out.extend_from_slice(&crc.to_le_bytes());
        Ok(())
    }

    /// [`Frame::encode`] without the CRC trailer (the sealing channel appends its own
    /// trailer and tag before the CRC, which it computes once over all of it).
    pub(crate) fn encode_without_crc(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let start = out.len();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.frame_type().0.to_le_bytes());
        out.extend_from_slice(&[0; 4]); // payload length, patched below
        let result = self.encode_payload(&mut Writer { out });
        let payload_len = out.len() - start - HEADER_LEN;
        let result = result.and_then(|()| check_len("payload", payload_len, MAX_PAYLOAD as usize));
        if let Err(e) = result {
            out.truncate(start);
            return Err(e);
        }
        out[start + 8..start + 12].copy_from_slice(&(payload_len as u32).to_le_bytes());
        Ok(())
    }

    /// Encodes the frame into a new vector.
    pub fn to_bytes(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        self.encode(&mut out)?;
        Ok(out)
    }

    fn encode_payload(&self, w: &mut Writer<'_>) -> Result<(), EncodeError> {
        match self {
            Self::Hello(h) | Self::HelloAck(h) => encode_hello(h, w)?,
            Self::HelloReject(r) => {
                w.u16(r.code.0);
                put_detail(w, &r.detail);
            }
            Self::HelloConfirm => {}
            Self::Reserve(r) => {
                check_len("pages", r.pages.len(), MAX_PAGES)?;
                check_len("access", r.access.len(), MAX_ACCESS)?;
                w.u64(r.transfer_id.0);
                w.u64(r.nonce);
                w.u32(r.tokens);
                w.u8(r.digest.0);
                w.u8(u8::from(r.page_digests));
                w.u32(r.deadline_ms);
                w.u32(r.pages.len() as u32);
                for &p in &r.pages {
                    w.u32(p);
                }
                w.u16(r.access.len() as u16);
                w.bytes(&r.access);
            }
            Self::Reject(r) => {
                put_ref(w, r.transfer);
                w.u16(r.code.0);
                put_detail(w, &r.detail);
            }
            Self::Commit(c) => {
                check_len("buffer_digests", c.buffer_digests.len(), MAX_BUFFERS)?;
                check_len("page_digests", c.page_digests.len(), MAX_PAGE_DIGESTS)?;
                check_len("aux", c.aux.len(), MAX_AUX)?;
                put_ref(w, c.transfer);
                w.u32(c.tokens);
                w.u32(c.pages);
                w.u64(c.bytes);
                w.u8(c.digest.0);
                w.u16(c.buffer_digests.len() as u16);
                for d in &c.buffer_digests {
                    w.bytes(&d.0);
                }
                w.u32(c.page_digests.len() as u32);
                for &d in &c.page_digests {
                    w.u64(d);
                }
                w.bytes(&c.aux_digest.0);
                w.u32(c.aux.len() as u32);
                w.bytes(&c.aux);
            }
            Self::Verified(t) | Self::AbortAck(t) => put_ref(w, *t),
            Self::Ping(token) | Self::Pong(token) => w.u64(*token),
            Self::Nack(n) => {
                put_ref(w, n.transfer);
                w.u16(n.code.0);
                w.u32(n.buffer);
                w.u32(n.page);
                put_detail(w, &n.detail);
            }
            Self::Abort(a) => {
                put_ref(w, a.transfer);
                w.u16(a.code.0);
                w.u32(a.completed_pages);
                put_detail(w, &a.detail);
            }
        }
        Ok(())
    }

    /// Decodes one frame from the front of `buf`, returning it and the bytes it used.
    ///
    /// Never panics. `Err(DecodeError::Incomplete)` means `buf` holds a prefix of a frame
    /// that may still be valid; every other error means the bytes are not a valid frame.
    pub fn decode(buf: &[u8]) -> Result<(Frame, usize), DecodeError> {
        let (frame_type, payload, total) = split(buf)?;
        Ok((decode_body(frame_type, payload)?, total))
    }
}

/// Steps 1-7 of SPEC.md §3.3: checks the header and the CRC of the frame at the front of
/// `buf` and returns its raw type, its payload and its total length.
pub(crate) fn split(buf: &[u8]) -> Result<(FrameType, &[u8], usize), DecodeError> {
    if buf.len() < HEADER_LEN {
        // Report a bad magic as soon as we can see it, rather than waiting for more.
        let seen = buf.len().min(4);
        if buf[..seen] != MAGIC[..seen] {
            let mut m = [0u8; 4];
            m[..seen].copy_from_slice(&buf[..seen]);
            return Err(DecodeError::BadMagic(m));
        }
        return Err(DecodeError::Incomplete { needed: HEADER_LEN });
    }
    let mut header = Reader::new(&buf[..HEADER_LEN]);
    let magic = header.bytes(4, "magic")?;
    if magic != MAGIC {
        let mut m = [0u8; 4];
        m.copy_from_slice(magic);
        return Err(DecodeError::BadMagic(m));
    }
    let version = header.u16("version")?;
    if version != VERSION {
        return Err(DecodeError::UnsupportedVersion(version));
    }
    let frame_type = FrameType(header.u16("frame_type")?);
    let len = header.u32("payload_len")?;
    if len > MAX_PAYLOAD {
        return Err(DecodeError::PayloadTooLarge { len });
    }
    let total = HEADER_LEN + len as usize + TRAILER_LEN;
    if buf.len() < total {
        return Err(DecodeError::Incomplete { needed: total });
    }
    let body_end = HEADER_LEN + len as usize;
    let carried = u32::from_le_bytes([
        buf[body_end],
        buf[body_end + 1],
        buf[body_end + 2],
        buf[body_end + 3],
    ]);
    let computed = crc32fast::hash(&buf[..body_end]);
    if carried != computed {
        return Err(DecodeError::BadCrc { carried, computed });
    }
    Ok((frame_type, &buf[HEADER_LEN..body_end], total))
}

/// Steps 8-10 of SPEC.md §3.3: the payload of a frame of type `frame_type`.
pub(crate) fn decode_body(frame_type: FrameType, payload: &[u8]) -> Result<Frame, DecodeError> {
    let mut r = Reader::new(payload);
    let frame = decode_payload(frame_type, &mut r)?;
    if r.remaining() != 0 {
        return Err(DecodeError::TrailingBytes {
            extra: r.remaining(),
        });
    }
    Ok(frame)
}

fn put_ref(w: &mut Writer<'_>, t: TransferRef) {
    w.u64(t.transfer_id.0);
    w.u64(t.nonce);
}

fn put_detail(w: &mut Writer<'_>, s: &str) {
    let s = truncate_detail(s);
    w.u16(s.len() as u16);
    w.bytes(s.as_bytes());
}

fn encode_hello(h: &Hello, w: &mut Writer<'_>) -> Result<(), EncodeError> {
    check_len("buffers", h.layout.buffer_page_bytes.len(), MAX_BUFFERS)?;
    check_len("fingerprint", h.layout.fingerprint.len(), MAX_FINGERPRINT)?;
    check_len("digests", h.digests.len(), MAX_DIGEST_ALGORITHMS)?;
    check_len(
        "transport_params",
        h.transport_params.len(),
        MAX_TRANSPORT_PARAMS,
    )?;
    check_len("max_aux", h.max_aux as usize, MAX_AUX)?;
    w.u64(h.node_id);
    w.u8(h.role.0);
    w.u32(h.layout.tokens_per_page);
    w.u16(h.layout.buffer_page_bytes.len() as u16);
    for &b in &h.layout.buffer_page_bytes {
        w.u32(b);
    }
    w.u8(h.layout.fingerprint.len() as u8);
    w.bytes(&h.layout.fingerprint);
    w.u8(h.digests.len() as u8);
    for d in &h.digests {
        w.u8(d.0);
    }
    w.u16(h.transport_params.len() as u16);
    w.bytes(&h.transport_params);
    w.u32(h.max_aux);
    Ok(())
}

fn get_ref(r: &mut Reader<'_>) -> Result<TransferRef, DecodeError> {
    Ok(TransferRef {
        transfer_id: TransferId(r.u64("transfer_id")?),
        nonce: r.u64("nonce")?,
    })
}

fn decode_hello(r: &mut Reader<'_>) -> Result<Hello, DecodeError> {
    let node_id = r.u64("node_id")?;
    let role = Role(r.u8("role")?);
    let tokens_per_page = r.u32("tokens_per_page")?;
    let raw = r.u16("buffers")?;
    let n = r.count(u64::from(raw), MAX_BUFFERS, 4, "buffers")?;
    let mut buffer_page_bytes = Vec::with_capacity(n);
    for _ in 0..n {
        buffer_page_bytes.push(r.u32("buffer_page_bytes")?);
    }
    let raw = r.u8("fingerprint")?;
    let fingerprint = r.blob(u64::from(raw), MAX_FINGERPRINT, "fingerprint")?;
    let raw = r.u8("digests")?;
    let n = r.count(u64::from(raw), MAX_DIGEST_ALGORITHMS, 1, "digests")?;
    let mut digests = Vec::with_capacity(n);
    for _ in 0..n {
        digests.push(DigestAlgorithm(r.u8("digests")?));
    }
    let raw = r.u16("transport_params")?;
    let transport_params = r.blob(u64::from(raw), MAX_TRANSPORT_PARAMS, "transport_params")?;
    let max_aux = r.u32("max_aux")?;
    if max_aux as usize > MAX_AUX {
        return Err(DecodeError::TooMany {
            field: "max_aux",
            count: u64::from(max_aux),
            max: MAX_AUX as u64,
        });
    }
    Ok(Hello {
        node_id,
        role,
        layout: KvLayout {
            tokens_per_page,
            buffer_page_bytes,
            fingerprint,
        },
        digests,
        transport_params,
        max_aux,
    })
}

fn decode_payload(t: FrameType, r: &mut Reader<'_>) -> Result<Frame, DecodeError> {
    Ok(match t {
        FrameType::HELLO => Frame::Hello(decode_hello(r)?),
        FrameType::HELLO_ACK => Frame::HelloAck(decode_hello(r)?),
        FrameType::HELLO_REJECT => Frame::HelloReject(HelloReject {
            code: ErrorCode(r.u16("code")?),
            detail: r.string(MAX_DETAIL, "detail")?,
        }),
        FrameType::HELLO_CONFIRM => Frame::HelloConfirm,
        FrameType::RESERVE => {
            let transfer_id = TransferId(r.u64("transfer_id")?);
            let nonce = r.u64("nonce")?;
            let tokens = r.u32("tokens")?;
            let digest = DigestAlgorithm(r.u8("digest")?);
            let page_digests = match r.u8("page_digests")? {
                0 => false,
                1 => true,
                v => {
                    return Err(DecodeError::InvalidValue {
                        field: "page_digests",
                        value: u64::from(v),
                    })
                }
            };
            let deadline_ms = r.u32("deadline_ms")?;
            let raw = r.u32("pages")?;
            let n = r.count(u64::from(raw), MAX_PAGES, 4, "pages")?;
            let mut pages = Vec::with_capacity(n);
            for _ in 0..n {
                pages.push(r.u32("pages")?);
            }
            let raw = r.u16("access")?;
            let access = r.blob(u64::from(raw), MAX_ACCESS, "access")?;
            Frame::Reserve(Reserve {
                transfer_id,
                nonce,
                tokens,
                digest,
                page_digests,
                deadline_ms,
                pages,
                access,
            })
        }
        FrameType::REJECT => Frame::Reject(Reject {
            transfer: get_ref(r)?,
            code: ErrorCode(r.u16("code")?),
            detail: r.string(MAX_DETAIL, "detail")?,
        }),
        FrameType::COMMIT => {
            let transfer = get_ref(r)?;
            let tokens = r.u32("tokens")?;
            let pages = r.u32("pages")?;
            let bytes = r.u64("bytes")?;
            let digest = DigestAlgorithm(r.u8("digest")?);
            let raw = r.u16("buffer_digests")?;
            let n = r.count(u64::from(raw), MAX_BUFFERS, 16, "buffer_digests")?;
            let mut buffer_digests = Vec::with_capacity(n);
            for _ in 0..n {
                buffer_digests.push(Digest128(r.array16("buffer_digests")?));
            }
            let raw = r.u32("page_digests")?;
            let n = r.count(u64::from(raw), MAX_PAGE_DIGESTS, 8, "page_digests")?;
            let mut page_digests = Vec::with_capacity(n);
            for _ in 0..n {
                page_digests.push(r.u64("page_digests")?);
            }
            let aux_digest = Digest128(r.array16("aux_digest")?);
            let raw = r.u32("aux")?;
            let aux = r.blob(u64::from(raw), MAX_AUX, "aux")?;
            Frame::Commit(Commit {
                transfer,
                tokens,
                pages,
                bytes,
                digest,
                buffer_digests,
                page_digests,
                aux_digest,
                aux,
            })
        }
        FrameType::VERIFIED => Frame::Verified(get_ref(r)?),
        FrameType::NACK => Frame::Nack(Nack {
            transfer: get_ref(r)?,
            code: ErrorCode(r.u16("code")?),
            buffer: r.u32("buffer")?,
            page: r.u32("page")?,
            detail: r.string(MAX_DETAIL, "detail")?,
        }),
        FrameType::ABORT => Frame::Abort(Abort {
            transfer: get_ref(r)?,
            code: ErrorCode(r.u16("code")?),
            completed_pages: r.u32("completed_pages")?,
            detail: r.string(MAX_DETAIL, "detail")?,
        }),
        FrameType::ABORT_ACK => Frame::AbortAck(get_ref(r)?),
        FrameType::PING => Frame::Ping(r.u64("token")?),
        FrameType::PONG => Frame::Pong(r.u64("token")?),
        other => return Err(DecodeError::UnknownFrameType(other)),
    })
}
