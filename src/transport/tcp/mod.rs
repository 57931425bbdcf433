//! The TCP transport: one TCP connection per peer pair (or several, its lanes: below) carries
//! the handshake and then, in order, two kinds of record:
//!
//! * a **control record**: one protocol frame exactly as `proto/SPEC.md` §3 defines it
//!   (it starts with the frame magic `KVWR` and is self-delimiting), sealed by the
//!   connection's authentication channel where there is one;
//! * a **data record**: one page write (`proto/SPEC.md` §9.1) —
//!
//! ```text
//! offset size field
//! 0      4    magic        "KVDT"
//! 4      8    transfer_id  u64 LE
//! 12     8    nonce        u64 LE
//! 20     4    access key   u32 LE (from RESERVE's access descriptor)
//! 24     4    ordinal      u32 LE
//! 28     4    dst_page     u32 LE
//! 32     4    length       u32 LE = bytes per page index (sum over buffers)
//! 36     len  page bytes   buffer 0's page, then buffer 1's, ...
//! ```
//!
//! The sender ([`TcpSender`]) writes data records straight from its source pages with
//! vectored writes (no copy in user space) and reports a page write complete once its record
//! is on the stream; it writes a transfer's data records before its COMMIT, so the receiver
//! has consumed every byte of the transfer before it sees the commit: ordering is structural.
//! The receiver ([`TcpReceiver`]) reads page bytes straight into the destination page
//! slices, checking the access scope (its [`ScopeTable`](crate::memory::ScopeTable)) before
//! every read into a page; a write refused at its header, or whose scope closes part-way (the
//! fence), is read into a fixed scratch buffer and dropped.
//!
//! A connection may run over several TCP streams (`NodeConfig::tcp_streams`, SPEC §9.1, several
//! streams): the handshake's stream is lane 0, the client opens the others, each starting with a
//! [`JoinRecord`], and each stream is a [`TcpSender`] / [`TcpReceiver`] of its own under a
//! [`LaneSet`](crate::transport::LaneSet) ([`TcpSenderLanes`], [`TcpReceiverLanes`]), which keeps
//! every transfer on one stream.
//!
//! Over device (GPU) memory, both ends move records through pinned staging buffers and the
//! device's copy engines instead (`transport/staging.rs`; docs/GPU.md): a record is landed when
//! its copy into the page completed, and a fence waits for the copies into its pages.

mod pulls;
mod reader;
mod receiver;
mod records;
mod sender;

pub use pulls::PullThreads;
pub use reader::{ReadTarget, StreamReader};
pub use receiver::TcpReceiver;
pub use records::{DataHeader, Record, StreamError, StreamStats, DATA_HEADER_LEN, DATA_MAGIC};
pub use sender::TcpSender;

use crate::transport::same_host::HostIdentity;

/// Magic of a pull record (SPEC §9.3): a data record's header under this magic, then one u64 LE
/// source address per buffer, in the prefill's address space; the decode copies the page.
pub const PULL_MAGIC: [u8; 4] = *b"KVPL";

/// The length of an access descriptor that asks the sender for pull records (SPEC §9.3): the
/// 4-byte scope key, then [`PULL_FLAG`].
pub const PULL_DESCRIPTOR_LEN: usize = 5;
/// The last byte of an access descriptor that asks for pull records.
pub const PULL_FLAG: u8 = 1;

/// A TCP access descriptor's scope key, and whether it asks for pull records (SPEC §9.1,
/// §9.3): 4 bytes, the key; 5 bytes, the key and [`PULL_FLAG`]. `None` for anything else.
pub fn parse_access(access: &[u8]) -> Option<(crate::memory::AccessKey, bool)> {
    match access {
        [k0, k1, k2, k3] => Some((
            crate::memory::AccessKey(u32::from_le_bytes([*k0, *k1, *k2, *k3])),
            false,
        )),
        [k0, k1, k2, k3, PULL_FLAG] => Some((
            crate::memory::AccessKey(u32::from_le_bytes([*k0, *k1, *k2, *k3])),
            true,
        )),
        _ => None,
    }
}

/// The prefill end of a connection over several TCP streams: one [`TcpSender`] per stream.
pub type TcpSenderLanes = crate::transport::LaneSet<TcpSender>;
/// The decode end of a connection over several TCP streams: one [`TcpReceiver`] per stream.
pub type TcpReceiverLanes = crate::transport::LaneSet<TcpReceiver>;

/// Queued items (frames and data records) at which held writes go out anyway
/// ([`Transport::hold_writes`](crate::transport::Transport::hold_writes)): the peer starts on
/// the first part of a large batch while this end still handles the rest.
const HELD_WRITE_ITEMS: usize = 16;

pub(crate) use super::MAX_UNSENT_FRAMES;
/// Queued page bytes at which held writes go out anyway (a 64 KiB page is never held).
const HELD_WRITE_BYTES: usize = 64 * 1024;

/// The `kind` of the TCP transport parameters (SPEC §9.1; RDMA's are kind 1, §9.2).
pub const TCP_PARAMS_KIND: u16 = 2;

/// The `kind` of the TCP transport parameters of a node that offers same-host pulls (SPEC
/// §9.3): TCP's, plus the node's pid and boot id.
pub const SAME_HOST_PARAMS_KIND: u16 = 3;

/// The length of the same-host form's body (SPEC §9.3): pages, streams, token, pid, boot id.
const SAME_HOST_PARAMS_LEN: u16 = 4 + 2 + 16 + 4 + 16;

/// The most TCP streams one connection may have (SPEC §9.1, several streams).
pub const MAX_STREAMS: u16 = 64;

/// What a TCP node's HELLO transport parameters say (SPEC §9.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpParams {
    /// The node's page slots per buffer: they bound the destination pages a reservation may
    /// name.
    pub pages: u32,
    /// TCP streams the connection runs over (1 ..= [`MAX_STREAMS`]); both ends must say the
    /// same.
    pub streams: u16,
    /// With several streams: 16 random bytes naming the connection; the client's is the one
    /// its extra streams present when they join ([`JoinRecord`]). Zero with one stream.
    pub token: [u8; 16],
    /// The node offers same-host pulls (SPEC §9.3, kind 3): who it is, on which boot.
    pub same_host: Option<HostIdentity>,
}

impl TcpParams {
    /// One stream: the 8-byte form.
    pub fn one_stream(pages: u32) -> Self {
        Self {
            pages,
            streams: 1,
            token: [0; 16],
            same_host: None,
        }
    }

    /// The bytes: kind 2, length 4, `pages` (one stream); or kind 2, length 22, `pages`,
    /// `streams` (u16 LE, at least 2), `token` (several streams); or, offering same-host
    /// pulls, kind 3, length 42, `pages`, `streams` (u16 LE, 1 or more), `token`, `pid` (u32
    /// LE), `boot_id` (16 bytes).
    pub fn encode(&self) -> Vec<u8> {
        if let Some(h) = &self.same_host {
            let mut b = Vec::with_capacity(4 + usize::from(SAME_HOST_PARAMS_LEN));
            b.extend_from_slice(&SAME_HOST_PARAMS_KIND.to_le_bytes());
            b.extend_from_slice(&SAME_HOST_PARAMS_LEN.to_le_bytes());
            b.extend_from_slice(&self.pages.to_le_bytes());
            b.extend_from_slice(&self.streams.to_le_bytes());
            b.extend_from_slice(&self.token);
            b.extend_from_slice(&h.pid.to_le_bytes());
            b.extend_from_slice(&h.boot_id);
            return b;
        }
        let long = self.streams > 1;
        let mut b = Vec::with_capacity(if long { 26 } else { 8 });
        b.extend_from_slice(&TCP_PARAMS_KIND.to_le_bytes());
        b.extend_from_slice(&(if long { 22u16 } else { 4 }).to_le_bytes());
        b.extend_from_slice(&self.pages.to_le_bytes());
        if long {
            b.extend_from_slice(&self.streams.to_le_bytes());
            b.extend_from_slice(&self.token);
        }
        b
    }

    /// Parses a peer's parameters; what is wrong with them otherwise.
    pub fn parse(b: &[u8]) -> Result<Self, TcpParamsError> {
        let (kind, rest) = match b {
            [k0, k1, rest @ ..] => (u16::from_le_bytes([*k0, *k1]), rest),
            _ => return Err(TcpParamsError::Short(b.len())),
        };
        if kind != TCP_PARAMS_KIND && kind != SAME_HOST_PARAMS_KIND {
            return Err(TcpParamsError::Kind(kind));
        }
        let (len, body) = match rest {
            [l0, l1, body @ ..] => (u16::from_le_bytes([*l0, *l1]), body),
            _ => return Err(TcpParamsError::Short(b.len())),
        };
        if usize::from(len) != body.len() {
            return Err(TcpParamsError::LengthMismatch {
                declared: len,
                after_header: body.len(),
            });
        }
        if kind == SAME_HOST_PARAMS_KIND {
            return Self::parse_same_host(len, body);
        }
        match body {
            [p0, p1, p2, p3] => Ok(Self::one_stream(u32::from_le_bytes([*p0, *p1, *p2, *p3]))),
            [p0, p1, p2, p3, s0, s1, token @ ..] if token.len() == 16 => {
                let streams = u16::from_le_bytes([*s0, *s1]);
                if !(2..=MAX_STREAMS).contains(&streams) {
                    return Err(TcpParamsError::Streams(streams));
                }
                let mut t = [0u8; 16];
                t.copy_from_slice(token);
                Ok(Self {
                    pages: u32::from_le_bytes([*p0, *p1, *p2, *p3]),
                    streams,
                    token: t,
                    same_host: None,
                })
            }
            _ => Err(TcpParamsError::Length(len)),
        }
    }

    /// The body of the same-host form (kind 3, SPEC §9.3).
    fn parse_same_host(len: u16, body: &[u8]) -> Result<Self, TcpParamsError> {
        if len != SAME_HOST_PARAMS_LEN {
            return Err(TcpParamsError::Length(len));
        }
        let u32_at =
            |i: usize| u32::from_le_bytes([body[i], body[i + 1], body[i + 2], body[i + 3]]);
        let streams = u16::from_le_bytes([body[4], body[5]]);
        if !(1..=MAX_STREAMS).contains(&streams) {
            return Err(TcpParamsError::Streams(streams));
        }
        let mut token = [0u8; 16];
        token.copy_from_slice(&body[6..22]);
        let mut boot_id = [0u8; 16];
        boot_id.copy_from_slice(&body[26..42]);
        Ok(Self {
            pages: u32_at(0),
            streams,
            token,
            same_host: Some(HostIdentity {
                pid: u32_at(22),
                boot_id,
            }),
        })
    }

    /// Whether both ends offered same-host pulls from the same boot (SPEC §9.3): only then
    /// may the decode pull, once it attested the prefill's pid.
    pub fn same_host_with(&self, peer: &TcpParams) -> Option<HostIdentity> {
        let (ours, theirs) = (self.same_host?, peer.same_host?);
        ours.same_boot(&theirs).ok().map(|()| theirs)
    }
}

/// What is wrong with a peer's TCP transport parameters (SPEC §9.1).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TcpParamsError {
    /// Shorter than their 4-byte header.
    #[error("{0} bytes of transport parameters")]
    Short(usize),
    /// Another transport's kind.
    #[error("transport parameters of kind {0} (expected {TCP_PARAMS_KIND}, TCP, or {SAME_HOST_PARAMS_KIND}, TCP with same-host pulls)")]
    Kind(u16),
    /// The header's length is not what follows it.
    #[error(
        "TCP transport parameters of length {declared} with {after_header} bytes after the header"
    )]
    LengthMismatch {
        /// The length the header declares.
        declared: u16,
        /// The bytes after the header.
        after_header: usize,
    },
    /// The long form names a stream count outside 2 to [`MAX_STREAMS`].
    #[error(
        "TCP transport parameters naming {0} streams (the long form names 2 to {MAX_STREAMS})"
    )]
    Streams(u16),
    /// Neither form's length (or, of kind 3, not 42).
    #[error("TCP transport parameters of length {0} (expected 4: the page count, or 22: pages, streams, token; of kind 3, 42: pages, streams, token, pid, boot id)")]
    Length(u16),
}

/// A TCP node's HELLO transport parameters for one stream (SPEC §9.1): kind 2, length 4,
/// then the node's page slots per buffer (u32 LE), which bound the destination pages a
/// reservation may name.
pub fn transport_params(pages: u32) -> Vec<u8> {
    TcpParams::one_stream(pages).encode()
}

/// The page count a TCP peer advertised in its transport parameters (SPEC §9.1); an error
/// naming what is wrong with them otherwise.
pub fn parse_transport_params(b: &[u8]) -> Result<u32, TcpParamsError> {
    TcpParams::parse(b).map(|p| p.pages)
}

/// The magic that starts an extra stream of a connection (SPEC §9.1, several streams).
pub const JOIN_MAGIC: [u8; 4] = *b"KVJN";

/// The 24 bytes an extra TCP stream of a connection starts with, before anything else on it:
/// `KVJN`, the lane (u16 LE, 1 ..= streams - 1), the connection's stream count (u16 LE) and the
/// client's token from its HELLO (SPEC §9.1, several streams).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JoinRecord {
    /// The lane this stream is.
    pub lane: u16,
    /// The connection's streams.
    pub streams: u16,
    /// The client's token.
    pub token: [u8; 16],
}

impl JoinRecord {
    /// Its length on the stream.
    pub const LEN: usize = 24;

    /// The bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..4].copy_from_slice(&JOIN_MAGIC);
        b[4..6].copy_from_slice(&self.lane.to_le_bytes());
        b[6..8].copy_from_slice(&self.streams.to_le_bytes());
        b[8..].copy_from_slice(&self.token);
        b
    }

    /// Parses one; an error naming what is wrong otherwise (the lane must be an extra one of
    /// the stream count, which must be 2 ..= [`MAX_STREAMS`]).
    pub fn decode(b: &[u8; Self::LEN]) -> Result<Self, String> {
        if b[..4] != JOIN_MAGIC {
            return Err(format!(
                "a join record starting with {}",
                kvwire_proto::wire::show_bytes(&b[..4])
            ));
        }
        let lane = u16::from_le_bytes([b[4], b[5]]);
        let streams = u16::from_le_bytes([b[6], b[7]]);
        if !(2..=MAX_STREAMS).contains(&streams) || lane == 0 || lane >= streams {
            return Err(format!(
                "a join record for lane {lane} of {streams} streams"
            ));
        }
        let mut token = [0u8; 16];
        token.copy_from_slice(&b[8..]);
        Ok(Self {
            lane,
            streams,
            token,
        })
    }
}

#[cfg(test)]
mod params_tests {
    use super::*;

    /// SPEC §9.1: the TCP transport parameters round-trip, and anything else is refused
    /// naming what is wrong.
    #[test]
    fn tcp_transport_params_round_trip_and_refuse_malformed() {
        assert_eq!(transport_params(0x0102_0304), vec![2, 0, 4, 0, 4, 3, 2, 1]);
        assert_eq!(parse_transport_params(&transport_params(77)), Ok(77));
        for bad in [
            &[][..],
            &[2, 0, 4, 0, 1, 2, 3][..],
            &[2, 0, 5, 0, 1, 2, 3, 4][..],
            &[1, 0, 4, 0, 1, 2, 3, 4][..],
            &[2, 0, 4, 0, 1, 2, 3, 4, 5][..],
        ] {
            assert!(parse_transport_params(bad).is_err(), "{bad:?}");
        }
    }

    /// SPEC §9.1, several streams: the long form (golden bytes) round-trips; a stream count
    /// outside 2..=64 in it, or a length other than 22, is refused.
    #[test]
    fn tcp_params_with_streams_round_trip_and_refuse_bad_counts() {
        let p = TcpParams {
            pages: 0x0102_0304,
            streams: 4,
            token: [0xAB; 16],
            same_host: None,
        };
        let b = p.encode();
        let mut want = vec![2, 0, 22, 0, 4, 3, 2, 1, 4, 0];
        want.extend_from_slice(&[0xAB; 16]);
        assert_eq!(b, want);
        assert_eq!(TcpParams::parse(&b), Ok(p));
        assert_eq!(TcpParams::one_stream(9).encode(), transport_params(9));
        for streams in [0u16, 1, 65] {
            let mut bad = b.clone();
            bad[8..10].copy_from_slice(&streams.to_le_bytes());
            assert!(TcpParams::parse(&bad).is_err(), "{streams} streams");
        }
        let mut short = b.clone();
        short.pop();
        short[2] = 21;
        assert!(TcpParams::parse(&short).is_err());
    }

    /// SPEC §9.3: the same-host form (kind 3, golden bytes) round-trips with one stream and
    /// several; another length or a stream count outside 1..=64 is refused; both ends' kind 3
    /// from one boot settle on pulls, and a kind 2 peer or another boot on none.
    #[test]
    fn same_host_params_round_trip_and_settle_only_on_one_boot() {
        let me = HostIdentity {
            pid: 0x0A0B_0C0D,
            boot_id: [0x42; 16],
        };
        let p = TcpParams {
            pages: 9,
            streams: 1,
            token: [0; 16],
            same_host: Some(me),
        };
        let b = p.encode();
        let mut want = vec![3, 0, 42, 0, 9, 0, 0, 0, 1, 0];
        want.extend_from_slice(&[0; 16]);
        want.extend_from_slice(&[0x0D, 0x0C, 0x0B, 0x0A]);
        want.extend_from_slice(&[0x42; 16]);
        assert_eq!(b, want);
        assert_eq!(TcpParams::parse(&b), Ok(p));
        let several = TcpParams {
            streams: 4,
            token: [7; 16],
            ..p
        };
        assert_eq!(TcpParams::parse(&several.encode()), Ok(several));
        for streams in [0u16, 65] {
            let mut bad = b.clone();
            bad[8..10].copy_from_slice(&streams.to_le_bytes());
            assert!(TcpParams::parse(&bad).is_err(), "{streams} streams");
        }
        let mut short = b.clone();
        short.pop();
        short[2] = 41;
        assert!(TcpParams::parse(&short).is_err());
        assert_eq!(p.same_host_with(&p), Some(me));
        assert_eq!(p.same_host_with(&TcpParams::one_stream(9)), None);
        let elsewhere = TcpParams {
            same_host: Some(HostIdentity {
                boot_id: [0x43; 16],
                ..me
            }),
            ..p
        };
        assert_eq!(p.same_host_with(&elsewhere), None);
        assert_eq!(
            parse_access(&[1, 0, 0, 0]),
            Some((crate::memory::AccessKey(1), false))
        );
        assert_eq!(
            parse_access(&[1, 0, 0, 0, 1]),
            Some((crate::memory::AccessKey(1), true))
        );
        assert_eq!(parse_access(&[1, 0, 0, 0, 2]), None);
    }

    /// The join record (golden bytes) round-trips; lane 0, a lane beyond the count, or a
    /// count outside 2..=64 is refused.
    #[test]
    fn join_records_round_trip_and_refuse_bad_lanes() {
        let j = JoinRecord {
            lane: 3,
            streams: 4,
            token: [7; 16],
        };
        let b = j.encode();
        assert_eq!(&b[..8], b"KVJN\x03\x00\x04\x00");
        assert_eq!(JoinRecord::decode(&b), Ok(j));
        for (lane, streams) in [(0u16, 4u16), (4, 4), (1, 1), (1, 65)] {
            let bad = JoinRecord {
                lane,
                streams,
                token: [7; 16],
            }
            .encode();
            assert!(
                JoinRecord::decode(&bad).is_err(),
                "lane {lane} of {streams}"
            );
        }
        let mut bad = b;
        bad[0] = b'X';
        assert!(JoinRecord::decode(&bad).is_err());
    }
}
