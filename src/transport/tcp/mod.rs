//! The TCP transport: one TCP connection per peer pair carries the handshake and then, in
//! order, two kinds of record:
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
//! Over device (GPU) memory, both ends move records through pinned staging buffers and the
//! device's copy engines instead (`transport/staging.rs`; docs/GPU.md): a record is landed when
//! its copy into the page completed, and a fence waits for the copies into its pages.

mod reader;
mod receiver;
mod records;
mod sender;

pub use reader::{ReadTarget, StreamReader, StreamStats};
pub use receiver::TcpReceiver;
pub use records::{DataHeader, Record, StreamError, DATA_HEADER_LEN, DATA_MAGIC};
pub use sender::TcpSender;

/// The `kind` of the TCP transport parameters (SPEC §9.1; RDMA's are kind 1, §9.2).
pub const TCP_PARAMS_KIND: u16 = 2;

/// A TCP node's HELLO transport parameters (SPEC §9.1): kind 2, length 4, then the node's
/// page slots per buffer (u32 LE), which bound the destination pages a reservation may name.
pub fn transport_params(pages: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(8);
    b.extend_from_slice(&TCP_PARAMS_KIND.to_le_bytes());
    b.extend_from_slice(&4u16.to_le_bytes());
    b.extend_from_slice(&pages.to_le_bytes());
    b
}

/// The page count a TCP peer advertised in its transport parameters (SPEC §9.1); an error
/// naming what is wrong with them otherwise.
pub fn parse_transport_params(b: &[u8]) -> Result<u32, String> {
    match b {
        [k0, k1, l0, l1, p @ ..] if u16::from_le_bytes([*k0, *k1]) == TCP_PARAMS_KIND => {
            let len = u16::from_le_bytes([*l0, *l1]);
            match <[u8; 4]>::try_from(p) {
                Ok(pages) if len == 4 => Ok(u32::from_le_bytes(pages)),
                _ => Err(format!(
                    "TCP transport parameters of length {len} with {} bytes after the header (expected length 4: the page count)",
                    p.len()
                )),
            }
        }
        [k0, k1, ..] => Err(format!(
            "transport parameters of kind {} (expected {TCP_PARAMS_KIND}, TCP)",
            u16::from_le_bytes([*k0, *k1])
        )),
        _ => Err(format!(
            "{} bytes of transport parameters (expected 8: kind 2, length 4, page count)",
            b.len()
        )),
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
}
