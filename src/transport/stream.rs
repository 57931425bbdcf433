//! The handshake over a byte stream (TCP, and the RDMA bootstrap connection), and reading
//! whole control frames from one.

use std::time::{Duration, Instant};

use kvwire_proto::auth::{AuthChannel, AuthError, OpenError};
use kvwire_proto::handshake::{Established, Handshake, HandshakeError};
use kvwire_proto::wire::{DecodeError, Frame, HEADER_LEN, MAX_PAYLOAD, TRAILER_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Why a connection could not be opened over a stream.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// Socket I/O failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The handshake failed (refused, by us or the peer, with the exact reason).
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// The peer sent bytes that are not a frame during the handshake.
    #[error("handshake stream: {0}")]
    Stream(String),
}

/// Why [`read_frame`] returned no frame.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// Socket I/O failed, or bytes that are not a frame arrived.
    Stream(ConnectError),
    /// A frame failed authentication.
    Auth(AuthError),
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        Self::Stream(e.into())
    }
}

/// Reads and opens one whole control frame. `Ok(None)` on a clean end of stream.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    open: &mut impl FnMut(&[u8]) -> Result<(Frame, usize), OpenError>,
) -> Result<Option<Frame>, ReadError> {
    buf.resize(HEADER_LEN, 0);
    match r.read_exact(&mut buf[..HEADER_LEN]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    // Let the decoder judge the header (magic, version, length) before reading on.
    match Frame::decode(&buf[..HEADER_LEN]) {
        Err(DecodeError::Incomplete { .. }) => {}
        Err(e) => return Err(ReadError::Stream(ConnectError::Stream(e.to_string()))),
        Ok(_) => unreachable!("a header alone is never a whole frame"),
    }
    let len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
    let total = HEADER_LEN + len.min(MAX_PAYLOAD) as usize + TRAILER_LEN;
    buf.resize(total, 0);
    r.read_exact(&mut buf[HEADER_LEN..]).await?;
    match open(buf) {
        Ok((frame, _)) => Ok(Some(frame)),
        Err(OpenError::Auth(e)) => Err(ReadError::Auth(e)),
        Err(e) => Err(ReadError::Stream(ConnectError::Stream(e.to_string()))),
    }
}

/// How long a node whose handshake timed out tries to send its HELLO_REJECT.
const REJECT_SEND_LIMIT: Duration = Duration::from_millis(200);

/// Runs a handshake on a fresh stream; `on_frame` sees each frame from the peer (opened and
/// decoded) before the handshake handles it.
pub(crate) async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    mut hs: Handshake,
    channel: &mut AuthChannel,
    timeout: Duration,
    on_frame: &mut (dyn FnMut(&kvwire_proto::wire::Frame) + Send),
) -> Result<Established, ConnectError> {
    let work = async {
        let mut buf = Vec::new();
        loop {
            while let Some(f) = hs.poll_transmit() {
                let bytes = channel
                    .seal_to_vec(&f)
                    .map_err(|e| ConnectError::Stream(e.to_string()))?;
                stream.write_all(&bytes).await?;
            }
            if let Some(outcome) = hs.poll_outcome() {
                stream.flush().await?;
                return outcome.map_err(ConnectError::from);
            }
            let header_version = |buf: &[u8]| {
                (buf.len() >= 6 && buf[..4] == kvwire_proto::wire::MAGIC)
                    .then(|| u16::from_le_bytes([buf[4], buf[5]]))
            };
            let mut open = |b: &[u8]| channel.open(b);
            match read_frame(stream, &mut buf, &mut open).await {
                Ok(Some(frame)) => {
                    on_frame(&frame);
                    hs.handle_frame(frame);
                }
                Ok(None) => hs.handle_peer_lost(),
                // Refused with HELLO_REJECT(AUTH_MISMATCH / AUTH_FAILED), then closed.
                Err(ReadError::Auth(e)) => hs.handle_auth_error(&e),
                Err(ReadError::Stream(ConnectError::Stream(e))) => match header_version(&buf) {
                    // A version we do not speak is refused with HELLO_REJECT, never a fallback.
                    Some(v) if v != kvwire_proto::wire::VERSION => hs.handle_unsupported_version(v),
                    _ => return Err(ConnectError::Stream(e)),
                },
                Err(ReadError::Stream(e)) => return Err(e),
            }
        }
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => {
            // SPEC §4.6: tell the peer why before closing (HELLO_REJECT(HANDSHAKE_TIMEOUT)),
            // without waiting long on a peer that does not read.
            hs.handle_timeout(Instant::now() + timeout);
            if let Some(f) = hs.poll_transmit() {
                if let Ok(bytes) = channel.seal_to_vec(&f) {
                    let send = async {
                        stream.write_all(&bytes).await?;
                        stream.flush().await
                    };
                    let _ = tokio::time::timeout(REJECT_SEND_LIMIT, send).await;
                }
            }
            Err(HandshakeError::Timeout.into())
        }
    }
}
