//! Authenticated peers (SPEC.md §3.11, §4.8): a pre-shared key (PSK) and HMAC-SHA256 tags
//! over the handshake and over every frame after it, keyed per connection.
//!
//! An [`AuthChannel`] sits between the bytes of a connection and its [`Frame`]s: it seals
//! frames on the way out ([`AuthChannel::seal`]) and opens them on the way in
//! ([`AuthChannel::open`]). It is sans-IO like the rest of this crate: the driver supplies
//! the key and the node's random nonce; nothing here reads a clock or a random source.
//!
//! * The client's HELLO carries its nonce `Nc` and a tag under the PSK.
//! * The server's HELLO_ACK carries its nonce `Ns` and a tag under the connection's
//!   server-to-client key, which is derived from the PSK and both nonces and binds the
//!   client's HELLO tag.
//! * Every later frame in either direction (the client's HELLO_CONFIRM first) is sealed: a
//!   sequence number (0, 1, 2, ... per direction) and a tag under that direction's key. A
//!   frame replayed from this connection carries an old sequence number; one from another
//!   connection, or altered, does not verify.
//!
//! HELLO_REJECT always travels unauthenticated (a node refusing a peer may hold no key the
//! peer shares), and is accepted only during the handshake.

use core::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::wire::frame::{decode_body, split};
use crate::wire::{DecodeError, EncodeError, ErrorCode, Frame, FrameType, HEADER_LEN, MAX_PAYLOAD};

type HmacSha256 = Hmac<Sha256>;

/// Bit of the header's frame-type field that marks an authenticated frame.
pub const AUTH_FLAG: u16 = 0x8000;
/// Bytes of a nonce carried in an authenticated HELLO or HELLO_ACK.
pub const NONCE_LEN: usize = 32;
// The sealed-frame trailer sizes live with the other wire limits, since the frame codec
// needs them too (`commit_fits`); they keep their paths here.
pub use crate::wire::limits::{SEALED_OVERHEAD, SEQ_LEN, TAG_LEN};
/// Bytes authentication adds to the payload of a HELLO or HELLO_ACK.
pub const HELLO_OVERHEAD: usize = NONCE_LEN + TAG_LEN;
/// Shortest pre-shared key accepted (128 bits).
pub const MIN_PSK_LEN: usize = 16;

const HELLO_LABEL: &[u8] = b"kvwire v1 hello";
const ACK_LABEL: &[u8] = b"kvwire v1 hello-ack";
const CONN_LABEL: &[u8] = b"kvwire v1 conn";
const C2S_LABEL: &[u8] = b"kvwire v1 c2s";
const S2C_LABEL: &[u8] = b"kvwire v1 s2c";
const ID_LABEL: &[u8] = b"kvwire v1 key id";
const LANE_LABEL: &[u8] = b"kvwire v1 lane";

/// A node's random contribution to a connection's keys; MUST be fresh for every connection.
pub type Nonce = [u8; NONCE_LEN];

/// A pre-shared key. Its `Debug` form never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct Psk(Vec<u8>);

/// Why bytes are not a usable pre-shared key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PskError {
    /// Fewer than [`MIN_PSK_LEN`] bytes.
    TooShort {
        /// Bytes given.
        len: usize,
    },
    /// Key text that is not hexadecimal (or has an odd number of digits).
    NotHex,
}

impl fmt::Display for PskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooShort { len } => write!(
                f,
                "pre-shared key of {len} bytes; at least {MIN_PSK_LEN} are required"
            ),
            Self::NotHex => write!(f, "pre-shared key is not an even number of hex digits"),
        }
    }
}

impl std::error::Error for PskError {}

impl Psk {
    /// A key from raw bytes (at least [`MIN_PSK_LEN`]).
    pub fn new(key: Vec<u8>) -> Result<Self, PskError> {
        if key.len() < MIN_PSK_LEN {
            return Err(PskError::TooShort { len: key.len() });
        }
        Ok(Self(key))
    }

    /// A key from hexadecimal text (surrounding whitespace ignored), as key files and the
    /// `KVWIRE_PSK` variable hold it.
    pub fn from_hex(text: &str) -> Result<Self, PskError> {
        let t = text.trim().as_bytes();
        if t.len() % 2 != 0 {
            return Err(PskError::NotHex);
        }
        let digit = |c: u8| (c as char).to_digit(16).ok_or(PskError::NotHex);
        let key = t
            .chunks(2)
            .map(|p| Ok((digit(p[0])? * 16 + digit(p[1])?) as u8))
            .collect::<Result<Vec<u8>, PskError>>()?;
        Self::new(key)
    }

    /// Key length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false (a key has at least [`MIN_PSK_LEN`] bytes).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A short identifier of the key, safe to print: the first 8 bytes of
    /// HMAC-SHA256(key, "kvwire v1 key id"), in hex. Equal keys have equal ids.
    pub fn id(&self) -> String {
        mac(&self.0, &[ID_LABEL])[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

impl fmt::Debug for Psk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Psk(<redacted>, {} bytes, id {})",
            self.0.len(),
            self.id()
        )
    }
}

/// Why an authenticated channel refused a frame. Every variant closes the connection
/// (SPEC.md §7.3); [`AuthError::code`] gives the code a HELLO_REJECT carries during the
/// handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuthError {
    /// This node authenticates; the peer sent an unauthenticated frame (it has no key, or
    /// authentication is off on its side).
    Missing {
        /// The frame's type.
        frame_type: FrameType,
    },
    /// The peer sent an authenticated frame; this node has authentication off.
    Unexpected {
        /// The frame's type (without the flag).
        frame_type: FrameType,
    },
    /// The tag does not verify: another key, altered bytes, or a frame of another
    /// connection.
    BadTag {
        /// The frame's type (without the flag).
        frame_type: FrameType,
    },
    /// The tag verifies but the sequence number is not the next one: the frame was replayed
    /// (or frames were removed).
    Sequence {
        /// The frame's type (without the flag).
        frame_type: FrameType,
        /// The sequence number expected.
        expected: u64,
        /// The sequence number carried.
        got: u64,
    },
    /// An authenticated frame the exchange does not allow at this point (a second HELLO, a
    /// sealed frame before the keys exist).
    OutOfOrder {
        /// The frame's type (without the flag).
        frame_type: FrameType,
    },
}

impl AuthError {
    /// The wire code: `AUTH_MISMATCH` when the nodes disagree on authentication,
    /// `AUTH_FAILED` otherwise.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Missing { .. } | Self::Unexpected { .. } => ErrorCode::AUTH_MISMATCH,
            _ => ErrorCode::AUTH_FAILED,
        }
    }
}

impl fmt::Display for AuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing { frame_type } => write!(
                f,
                "unauthenticated {frame_type} from the peer, but this node requires authentication"
            ),
            Self::Unexpected { frame_type } => write!(
                f,
                "authenticated {frame_type} from the peer, but authentication is off on this node"
            ),
            Self::BadTag { frame_type } => write!(
                f,
                "{frame_type} tag does not verify (another key, altered, or from another connection)"
            ),
            Self::Sequence {
                frame_type,
                expected,
                got,
            } => write!(
                f,
                "{frame_type} with sequence number {got}, expected {expected} (replayed or dropped frames)"
            ),
            Self::OutOfOrder { frame_type } => {
                write!(f, "authenticated {frame_type} out of order")
            }
        }
    }
}

impl std::error::Error for AuthError {}

/// Why [`AuthChannel::open`] returned no frame.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpenError {
    /// The bytes are not a frame (SPEC.md §3.3); `Incomplete` means: read more.
    Decode(DecodeError),
    /// The frame failed authentication.
    Auth(AuthError),
}

impl From<DecodeError> for OpenError {
    fn from(e: DecodeError) -> Self {
        Self::Decode(e)
    }
}

impl From<AuthError> for OpenError {
    fn from(e: AuthError) -> Self {
        Self::Auth(e)
    }
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Decode(e) => write!(f, "{e}"),
            Self::Auth(e) => write!(f, "authentication: {e}"),
        }
    }
}

impl std::error::Error for OpenError {}

fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; TAG_LEN] {
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Constant-time check of `tag` against HMAC(key, parts).
fn verify(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(p);
    }
    m.verify_slice(tag).is_ok()
}

/// The two keys of a connection, as (client-to-server, server-to-client).
fn derive(psk: &Psk, client_nonce: &Nonce, server_nonce: &Nonce) -> ([u8; 32], [u8; 32]) {
    let prk = mac(&psk.0, &[CONN_LABEL, client_nonce, server_nonce]);
    (mac(&prk, &[C2S_LABEL]), mac(&prk, &[S2C_LABEL]))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Client,
    Server,
}

#[derive(Clone)]
struct Keys {
    send: [u8; 32],
    recv: [u8; 32],
    /// HMAC keyed with `send` and `recv`, their key pads already hashed: each frame's tag
    /// starts from a clone of these instead of hashing the pads again.
    send_mac: HmacSha256,
    recv_mac: HmacSha256,
}

impl Keys {
    fn new(send: [u8; 32], recv: [u8; 32]) -> Self {
        let keyed = |k: &[u8; 32]| {
            <HmacSha256 as Mac>::new_from_slice(k).expect("HMAC takes keys of any length")
        };
        Self {
            send,
            recv,
            send_mac: keyed(&send),
            recv_mac: keyed(&recv),
        }
    }
}

#[derive(Clone)]
struct On {
    psk: Psk,
    side: Side,
    nonce: Nonce,
    /// The client's HELLO tag, once sent (client) or verified (server).
    hello_tag: Option<[u8; TAG_LEN]>,
    keys: Option<Keys>,
    /// Server: HELLO_ACK sealed.
    ack_sent: bool,
    /// The peer has proven the connection keys (client: HELLO_ACK opened; server:
    /// HELLO_CONFIRM opened). From then on an unauthenticated HELLO_REJECT is refused.
    peer_proven: bool,
    send_seq: u64,
    recv_seq: u64,
}

/// One connection's authentication state: seals outgoing and opens incoming frames.
#[derive(Clone)]
pub struct AuthChannel {
    on: Option<On>,
}

impl fmt::Debug for AuthChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.on {
            None => write!(f, "AuthChannel(off)"),
            Some(on) => write!(
                f,
                "AuthChannel({:?}, key id {}, send seq {}, recv seq {})",
                on.side,
                on.psk.id(),
                on.send_seq,
                on.recv_seq
            ),
        }
    }
}

impl AuthChannel {
    /// No authentication: frames are encoded and decoded as SPEC.md §3 says, and an
    /// authenticated frame from the peer is refused ([`AuthError::Unexpected`]).
    pub fn off() -> Self {
        Self { on: None }
    }

    /// The handshake client's channel: `nonce` MUST be fresh random bytes.
    pub fn client(psk: Psk, nonce: Nonce) -> Self {
        Self::on(psk, Side::Client, nonce)
    }

    /// The handshake server's channel: `nonce` MUST be fresh random bytes.
    pub fn server(psk: Psk, nonce: Nonce) -> Self {
        Self::on(psk, Side::Server, nonce)
    }

    fn on(psk: Psk, side: Side, nonce: Nonce) -> Self {
        Self {
            on: Some(On {
                psk,
                side,
                nonce,
                hello_tag: None,
                keys: None,
                ack_sent: false,
                peer_proven: false,
                send_seq: 0,
                recv_seq: 0,
            }),
        }
    }

    /// Whether this channel authenticates.
    pub fn is_authenticated(&self) -> bool {
        self.on.is_some()
    }

    /// The channels of `n` lanes (queue pairs) of one connection, after the handshake
    /// (SPEC.md §3.11.1). Lane 0 is this channel as it is; lane `i > 0` has the keys
    /// `HMAC(K, "kvwire v1 lane" || u16 LE i)` for each direction's key `K`, and its own
    /// sequence numbers from 0. Frames sealed on one lane open only on the same lane of the
    /// peer, so lanes may be delivered independently of each other. An unauthenticated
    /// channel gives `n` unauthenticated lanes.
    pub fn lanes(self, n: u16) -> Vec<AuthChannel> {
        let mut out = Vec::with_capacity(usize::from(n.max(1)));
        for i in 0..n.max(1) {
            let mut c = self.clone();
            if i > 0 {
                if let Some(on) = &mut c.on {
                    if let Some(k) = &mut on.keys {
                        let lane = i.to_le_bytes();
                        *k = Keys::new(
                            mac(&k.send, &[LANE_LABEL, &lane]),
                            mac(&k.recv, &[LANE_LABEL, &lane]),
                        );
                    }
                    on.send_seq = 0;
                    on.recv_seq = 0;
                }
            }
            out.push(c);
        }
        out
    }

    /// Splits the channel into its sending and receiving halves (after the handshake, for
    /// drivers that read and write in different places).
    pub fn split(self) -> (Sealer, Opener) {
        (Sealer(self.clone()), Opener(self))
    }

    /// Encodes `frame` and appends it to `out`, authenticated as the channel's state
    /// requires. On error `out` is left as it was and no sequence number is used up.
    pub fn seal(&mut self, frame: &Frame, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let Some(on) = &mut self.on else {
            return frame.encode(out);
        };
        let refuse = || EncodeError::AuthState {
            frame_type: frame.frame_type(),
        };
        match frame {
            Frame::HelloReject(_) => frame.encode(out),
            Frame::Hello(_) => {
                if on.side != Side::Client || on.hello_tag.is_some() {
                    return Err(refuse());
                }
                let psk = on.psk.clone();
                let tag = seal_with(frame, out, &on.nonce, |prefix| {
                    mac(&psk.0, &[HELLO_LABEL, prefix])
                })?;
                on.hello_tag = Some(tag);
                Ok(())
            }
            Frame::HelloAck(_) => {
                let (Side::Server, Some(keys), Some(hello_tag), false) =
                    (on.side, &on.keys, on.hello_tag, on.ack_sent)
                else {
                    return Err(refuse());
                };
                let key = keys.send;
                seal_with(frame, out, &on.nonce, |prefix| {
                    mac(&key, &[ACK_LABEL, &hello_tag, prefix])
                })?;
                on.ack_sent = true;
                Ok(())
            }
            _ => {
                let Some(keys) = &on.keys else {
                    return Err(refuse());
                };
                let mut m = keys.send_mac.clone();
                seal_with(frame, out, &on.send_seq.to_le_bytes(), |prefix| {
                    m.update(prefix);
                    m.finalize().into_bytes().into()
                })?;
                on.send_seq += 1;
                Ok(())
            }
        }
    }

    /// Encodes `frame` into a new vector (see [`AuthChannel::seal`]).
    pub fn seal_to_vec(&mut self, frame: &Frame) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::with_capacity(256);
        self.seal(frame, &mut out)?;
        Ok(out)
    }

    /// Decodes and authenticates one frame from the front of `buf`, returning it and the
    /// bytes it used. Checks, in order: SPEC.md §3.3 steps 1-7 (header, CRC), then the
    /// authentication of §3.11 (tag before sequence number, both before the payload is
    /// parsed), then §3.3 steps 8-10 on the inner payload.
    pub fn open(&mut self, buf: &[u8]) -> Result<(Frame, usize), OpenError> {
        let (raw, payload, total) = split(buf)?;
        let flagged = raw.0 & AUTH_FLAG != 0;
        let inner = FrameType(raw.0 & !AUTH_FLAG);
        let Some(on) = &mut self.on else {
            if flagged {
                return Err(AuthError::Unexpected { frame_type: inner }.into());
            }
            return Ok((decode_body(raw, payload)?, total));
        };
        if !flagged {
            if raw == FrameType::HELLO_REJECT && !on.peer_proven {
                return Ok((decode_body(raw, payload)?, total));
            }
            return Err(AuthError::Missing { frame_type: raw }.into());
        }
        let is_hello = inner == FrameType::HELLO || inner == FrameType::HELLO_ACK;
        let overhead = if is_hello {
            HELLO_OVERHEAD
        } else {
            SEALED_OVERHEAD
        };
        if payload.len() < overhead {
            return Err(DecodeError::Truncated {
                field: "auth_trailer",
            }
            .into());
        }
        let body = &payload[..payload.len() - overhead];
        let trailer = &payload[body.len()..payload.len() - TAG_LEN];
        let tag = &payload[payload.len() - TAG_LEN..];
        let prefix = &buf[..HEADER_LEN + payload.len() - TAG_LEN];
        let out_of_order = || AuthError::OutOfOrder { frame_type: inner };
        let bad_tag = || AuthError::BadTag { frame_type: inner };
        let mut nonce = [0u8; NONCE_LEN];
        if is_hello {
            nonce.copy_from_slice(trailer);
        }
        match (on.side, inner) {
            (Side::Server, FrameType::HELLO) => {
                if on.hello_tag.is_some() {
                    return Err(out_of_order().into());
                }
                if !verify(&on.psk.0, &[HELLO_LABEL, prefix], tag) {
                    return Err(bad_tag().into());
                }
                let frame = decode_body(inner, body)?;
                let (c2s, s2c) = derive(&on.psk, &nonce, &on.nonce);
                let mut t = [0u8; TAG_LEN];
                t.copy_from_slice(tag);
                on.hello_tag = Some(t);
                on.keys = Some(Keys::new(s2c, c2s));
                Ok((frame, total))
            }
            (Side::Client, FrameType::HELLO_ACK) => {
                let (Some(hello_tag), None) = (on.hello_tag, &on.keys) else {
                    return Err(out_of_order().into());
                };
                let (c2s, s2c) = derive(&on.psk, &on.nonce, &nonce);
                if !verify(&s2c, &[ACK_LABEL, &hello_tag, prefix], tag) {
                    return Err(bad_tag().into());
                }
                let frame = decode_body(inner, body)?;
                on.keys = Some(Keys::new(c2s, s2c));
                on.peer_proven = true;
                Ok((frame, total))
            }
            (_, FrameType::HELLO | FrameType::HELLO_ACK) => Err(out_of_order().into()),
            _ => {
                let Some(keys) = &on.keys else {
                    return Err(out_of_order().into());
                };
                let mut m = keys.recv_mac.clone();
                m.update(prefix);
                if m.verify_slice(tag).is_err() {
                    return Err(bad_tag().into());
                }
                let mut seq = [0u8; SEQ_LEN];
                seq.copy_from_slice(trailer);
                let got = u64::from_le_bytes(seq);
                if got != on.recv_seq {
                    return Err(AuthError::Sequence {
                        frame_type: inner,
                        expected: on.recv_seq,
                        got,
                    }
                    .into());
                }
                let frame = decode_body(inner, body)?;
                on.recv_seq += 1;
                on.peer_proven = true;
                Ok((frame, total))
            }
        }
    }
}

/// Encodes `frame` with its type flagged, `trailer` after its payload and the tag that
/// `tag_of` computes over everything before the tag; then the CRC.
fn seal_with(
    frame: &Frame,
    out: &mut Vec<u8>,
    trailer: &[u8],
    tag_of: impl FnOnce(&[u8]) -> [u8; TAG_LEN],
) -> Result<[u8; TAG_LEN], EncodeError> {
    let start = out.len();
    frame.encode_without_crc(out)?;
    let payload_len = out.len() - start - HEADER_LEN + trailer.len() + TAG_LEN;
    if payload_len > MAX_PAYLOAD as usize {
        out.truncate(start);
        return Err(EncodeError::TooLarge {
            field: "payload",
            len: payload_len,
            max: MAX_PAYLOAD as usize,
        });
    }
    let raw = frame.frame_type().0 | AUTH_FLAG;
    out[start + 6..start + 8].copy_from_slice(&raw.to_le_bytes());
    out[start + 8..start + 12].copy_from_slice(&(payload_len as u32).to_le_bytes());
    out.extend_from_slice(trailer);
    let tag = tag_of(&out[start..]);
    out.extend_from_slice(&tag);
    let crc = crc32fast::hash(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(tag)
}

/// The sending half of an [`AuthChannel`].
#[derive(Clone, Debug)]
pub struct Sealer(AuthChannel);

impl Sealer {
    /// See [`AuthChannel::seal`].
    pub fn seal(&mut self, frame: &Frame, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        self.0.seal(frame, out)
    }

    /// See [`AuthChannel::seal_to_vec`].
    pub fn seal_to_vec(&mut self, frame: &Frame) -> Result<Vec<u8>, EncodeError> {
        self.0.seal_to_vec(frame)
    }
}

/// The receiving half of an [`AuthChannel`].
#[derive(Clone, Debug)]
pub struct Opener(AuthChannel);

impl Opener {
    /// See [`AuthChannel::open`].
    pub fn open(&mut self, buf: &[u8]) -> Result<(Frame, usize), OpenError> {
        self.0.open(buf)
    }
}
