//! The connection handshake: HELLO, then HELLO_ACK or HELLO_REJECT (SPEC.md §4).
//!
//! The client sends HELLO; the server checks it against its own hello and answers HELLO_ACK
//! (carrying its own body) or HELLO_REJECT with the exact mismatch. The client checks the
//! HELLO_ACK the same way and, on a mismatch, sends HELLO_REJECT and closes. Either way, a
//! mismatch is found at connect time, never later as garbage.

use std::time::{Duration, Instant};

use crate::error::{unexpected, UnexpectedFrame};
use crate::wire::{
    DigestAlgorithm, ErrorCode, Frame, FrameType, Hello, HelloReject, KvLayout, Role, VERSION,
};

/// A completed handshake: what both sides agreed on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Established {
    /// This node's hello.
    pub local: Hello,
    /// The peer's hello.
    pub peer: Hello,
    /// Digest algorithms both support, in the local node's order of preference.
    pub digests: Vec<DigestAlgorithm>,
}

impl Established {
    /// The layout both sides share.
    pub fn layout(&self) -> &KvLayout {
        &self.local.layout
    }
}

/// Why a handshake failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandshakeError {
    /// This node refused the peer (and sent the HELLO_REJECT it carries).
    Refused(HelloReject),
    /// The peer refused this node.
    RefusedByPeer(HelloReject),
    /// The peer sent a frame the handshake does not accept.
    Unexpected(UnexpectedFrame),
    /// No answer before the deadline.
    Timeout,
    /// The connection closed first.
    PeerLost,
}

impl std::fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(r) => write!(f, "refused the peer: {}: {}", r.code, r.detail),
            Self::RefusedByPeer(r) => write!(f, "refused by the peer: {}: {}", r.code, r.detail),
            Self::Unexpected(u) => write!(f, "{u}"),
            Self::Timeout => write!(f, "handshake timed out"),
            Self::PeerLost => write!(f, "connection lost during the handshake"),
        }
    }
}

impl std::error::Error for HandshakeError {}

/// Checks a peer's hello against ours. `Ok` holds the common digest algorithms in our order.
pub fn check_peer(local: &Hello, peer: &Hello) -> Result<Vec<DigestAlgorithm>, HelloReject> {
    let refuse = |code, detail: String| Err(HelloReject { code, detail });
    let want = match local.role {
        Role::SENDER => Role::RECEIVER,
        Role::RECEIVER => Role::SENDER,
        unknown => {
            return refuse(
                ErrorCode::ROLE_MISMATCH,
                format!(
                    "local role {unknown} is not a role this node can play; peer role {}",
                    peer.role
                ),
            )
        }
    };
    if peer.role != want {
        return refuse(
            ErrorCode::ROLE_MISMATCH,
            format!(
                "local role {}, peer role {} (expected {want})",
                local.role, peer.role
            ),
        );
    }
    let (l, p) = (&local.layout, &peer.layout);
    // A layout with nothing to verify would "verify" and deliver nothing: fail closed.
    for (who, layout) in [("local", l), ("peer", p)] {
        if layout.tokens_per_page == 0
            || layout.buffers() == 0
            || layout.buffer_page_bytes.contains(&0)
        {
            return refuse(
                ErrorCode::LAYOUT_MISMATCH,
                format!(
                    "{who} layout is degenerate: {} tokens per page, buffers {:?} (need >= 1 token per page, >= 1 buffer, >= 1 byte per page)",
                    layout.tokens_per_page, layout.buffer_page_bytes
                ),
            );
        }
    }
    // Every refusal names both sides' values in human form (SPEC.md §4.3).
    let layouts = || {
        format!(
            "local layout {}; peer layout {}",
            show_layout(l),
            show_layout(p)
        )
    };
    if l.tokens_per_page != p.tokens_per_page {
        return refuse(
            ErrorCode::LAYOUT_MISMATCH,
            format!(
                "tokens per page: local {}, peer {} ({})",
                l.tokens_per_page,
                p.tokens_per_page,
                layouts()
            ),
        );
    }
    if l.buffers() != p.buffers() {
        return refuse(
            ErrorCode::LAYOUT_MISMATCH,
            format!(
                "buffer count: local {}, peer {} ({})",
                l.buffers(),
                p.buffers(),
                layouts()
            ),
        );
    }
    if let Some((i, (a, b))) = l
        .buffer_page_bytes
        .iter()
        .zip(&p.buffer_page_bytes)
        .enumerate()
        .find(|(_, (a, b))| a != b)
    {
        return refuse(
            ErrorCode::LAYOUT_MISMATCH,
            format!(
                "bytes per page of buffer {i}: local {a}, peer {b} ({})",
                layouts()
            ),
        );
    }
    if l.fingerprint != p.fingerprint {
        return refuse(
            ErrorCode::FINGERPRINT_MISMATCH,
            format!(
                "model fingerprint: local {}, peer {}",
                show_fingerprint(&l.fingerprint),
                show_fingerprint(&p.fingerprint)
            ),
        );
    }
    let common: Vec<_> = local
        .digests
        .iter()
        .copied()
        .filter(|d| d.is_known() && peer.digests.contains(d))
        .collect();
    if common.is_empty() {
        return refuse(
            ErrorCode::NO_COMMON_DIGEST,
            format!(
                "no digest algorithm in common: local offers {}, peer offers {} (this node implements {})",
                show_digests(&local.digests),
                show_digests(&peer.digests),
                show_digests(
                    &local
                        .digests
                        .iter()
                        .copied()
                        .filter(|d| d.is_known())
                        .collect::<Vec<_>>()
                )
            ),
        );
    }
    Ok(common)
}

/// A layout for humans: `16 tokens/page, 2 buffers of [65536, 32768] bytes/page`.
fn show_layout(l: &KvLayout) -> String {
    let b = &l.buffer_page_bytes;
    let bytes = match b.first() {
        None => "no buffers".to_string(),
        Some(first) if b.iter().all(|x| x == first) => {
            format!("{} buffers of {first} bytes/page", b.len())
        }
        Some(_) if b.len() <= 8 => format!("{} buffers of {b:?} bytes/page", b.len()),
        Some(_) => format!(
            "{} buffers of {:?}... bytes/page (sum {})",
            b.len(),
            &b[..8],
            b.iter().map(|&x| u64::from(x)).sum::<u64>()
        ),
    };
    format!("{} tokens/page, {bytes}", l.tokens_per_page)
}

/// A fingerprint for humans: its text when it is printable (at most 64 characters shown;
/// otherwise hex, at most 16 bytes shown), its length, and a digest of **all** its bytes (the first 8 bytes of its SHA-256), so two
/// fingerprints that differ anywhere, also past what is shown, are told apart.
pub fn show_fingerprint(f: &[u8]) -> String {
    use sha2::Digest;
    if f.is_empty() {
        return "(empty)".into();
    }
    let digest: String = sha2::Sha256::digest(f)[..8]
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect();
    match std::str::from_utf8(f) {
        Ok(t) if !t.chars().any(char::is_control) => {
            let shown: String = t.chars().take(64).collect();
            let more = if shown.len() < t.len() { "..." } else { "" };
            format!("\"{shown}{more}\" ({} bytes, sha256 {digest})", f.len())
        }
        _ => {
            let hex: String = f.iter().take(16).map(|x| format!("{x:02x}")).collect();
            let more = if f.len() > 16 { "..." } else { "" };
            format!("{hex}{more} ({} bytes, not text, sha256 {digest})", f.len())
        }
    }
}

/// Digest algorithms for humans: `[XXH3_64, CRC32]`, unknown ones as `Unknown(0x9)`.
fn show_digests(d: &[DigestAlgorithm]) -> String {
    if d.is_empty() {
        return "none".into();
    }
    format!("{d:?}")
}

/// The HELLO_REJECT a node sends when a frame arrives with a version it does not speak.
pub fn version_reject(peer_version: u16) -> HelloReject {
    HelloReject {
        code: ErrorCode::VERSION_MISMATCH,
        detail: format!(
            "protocol version: the peer sent a frame of version {peer_version}, this node speaks only version {VERSION}"
        ),
    }
}

/// Client: HELLO sent, waiting for HELLO_ACK.
#[derive(Debug)]
struct AwaitingAck {
    local: Hello,
    deadline: Instant,
    confirm: bool,
    transport: Option<TransportCheck>,
}

/// Server: waiting for HELLO.
#[derive(Debug)]
struct AwaitingHello {
    local: Hello,
    deadline: Instant,
    confirm: bool,
    transport: Option<TransportCheck>,
}

/// A transport's check of the peer's `transport_params` against this node's (SPEC.md §4.3
/// #7): `Err` with a detail naming both sides' values refuses the connection with
/// HELLO_REJECT(TRANSPORT_MISMATCH) instead of a bare close after the handshake.
pub type TransportCheck = fn(local: &[u8], peer: &[u8]) -> Result<(), String>;

/// [`check_peer`], then the transport's check of the peer's parameters, if any.
fn check_hello(
    local: &Hello,
    peer: &Hello,
    transport: Option<TransportCheck>,
) -> Result<Vec<DigestAlgorithm>, HelloReject> {
    let digests = check_peer(local, peer)?;
    if let Some(check) = transport {
        check(&local.transport_params, &peer.transport_params).map_err(|detail| HelloReject {
            code: ErrorCode::TRANSPORT_MISMATCH,
            detail,
        })?;
    }
    Ok(digests)
}

/// Server of an authenticated handshake: HELLO_ACK sent, waiting for HELLO_CONFIRM.
#[derive(Debug)]
struct AwaitingConfirm {
    established: Established,
    deadline: Instant,
}

#[derive(Debug)]
enum State {
    AwaitingAck(AwaitingAck),
    AwaitingHello(AwaitingHello),
    AwaitingConfirm(AwaitingConfirm),
    Done,
}

const CLIENT_EXPECTS: &[FrameType] = &[FrameType::HELLO_ACK, FrameType::HELLO_REJECT];
const SERVER_EXPECTS: &[FrameType] = &[FrameType::HELLO];
const CONFIRM_EXPECTS: &[FrameType] = &[FrameType::HELLO_CONFIRM, FrameType::HELLO_REJECT];

/// What a frame did to the handshake: the outcome (if it ended), the reply, the next state.
type Step = (
    Option<Result<Established, HandshakeError>>,
    Option<Frame>,
    State,
);

impl AwaitingAck {
    fn handle_frame(self, frame: Frame) -> Step {
        match frame {
            Frame::HelloAck(peer) => match check_hello(&self.local, &peer, self.transport) {
                Ok(digests) => (
                    Some(Ok(Established {
                        local: self.local,
                        peer,
                        digests,
                    })),
                    self.confirm.then_some(Frame::HelloConfirm),
                    State::Done,
                ),
                Err(r) => (
                    Some(Err(HandshakeError::Refused(r.clone()))),
                    Some(Frame::HelloReject(r)),
                    State::Done,
                ),
            },
            Frame::HelloReject(r) => (
                Some(Err(HandshakeError::RefusedByPeer(r))),
                None,
                State::Done,
            ),
            other => (
                Some(Err(HandshakeError::Unexpected(unexpected(
                    &other,
                    "AwaitingAck",
                    CLIENT_EXPECTS,
                )))),
                None,
                State::Done,
            ),
        }
    }
}

impl AwaitingHello {
    fn handle_frame(self, frame: Frame) -> Step {
        match frame {
            Frame::Hello(peer) => match check_hello(&self.local, &peer, self.transport) {
                Ok(digests) => {
                    let ack = Frame::HelloAck(self.local.clone());
                    let established = Established {
                        local: self.local,
                        peer,
                        digests,
                    };
                    if self.confirm {
                        (
                            None,
                            Some(ack),
                            State::AwaitingConfirm(AwaitingConfirm {
                                established,
                                deadline: self.deadline,
                            }),
                        )
                    } else {
                        (Some(Ok(established)), Some(ack), State::Done)
                    }
                }
                Err(r) => (
                    Some(Err(HandshakeError::Refused(r.clone()))),
                    Some(Frame::HelloReject(r)),
                    State::Done,
                ),
            },
            other => (
                Some(Err(HandshakeError::Unexpected(unexpected(
                    &other,
                    "AwaitingHello",
                    SERVER_EXPECTS,
                )))),
                None,
                State::Done,
            ),
        }
    }
}

impl AwaitingConfirm {
    fn handle_frame(self, frame: Frame) -> Step {
        match frame {
            Frame::HelloConfirm => (Some(Ok(self.established)), None, State::Done),
            Frame::HelloReject(r) => (
                Some(Err(HandshakeError::RefusedByPeer(r))),
                None,
                State::Done,
            ),
            other => (
                Some(Err(HandshakeError::Unexpected(unexpected(
                    &other,
                    "AwaitingConfirm",
                    CONFIRM_EXPECTS,
                )))),
                None,
                State::Done,
            ),
        }
    }
}

/// The handshake of one connection, as a sans-IO machine.
///
/// Feed it frames with [`Handshake::handle_frame`] and time with
/// [`Handshake::handle_timeout`]; send what [`Handshake::poll_transmit`] returns; the
/// outcome appears once in [`Handshake::poll_outcome`].
#[derive(Debug)]
pub struct Handshake {
    state: State,
    transmit: Option<Frame>,
    outcome: Option<Result<Established, HandshakeError>>,
    timeout: Duration,
}

/// The default handshake timeout (SPEC.md §4.6): how long a node waits for the handshake to
/// finish, from its start. The engine's `NodeConfig::handshake_timeout` defaults to it.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl Handshake {
    /// Starts a client handshake: the HELLO is ready to transmit.
    pub fn client(now: Instant, local: Hello, timeout: Duration) -> Self {
        Self {
            transmit: Some(Frame::Hello(local.clone())),
            state: State::AwaitingAck(AwaitingAck {
                local,
                deadline: now + timeout,
                confirm: false,
                transport: None,
            }),
            outcome: None,
            timeout,
        }
    }

    /// Starts a server handshake, waiting for the client's HELLO.
    pub fn server(now: Instant, local: Hello, timeout: Duration) -> Self {
        Self {
            transmit: None,
            state: State::AwaitingHello(AwaitingHello {
                local,
                deadline: now + timeout,
                confirm: false,
                transport: None,
            }),
            outcome: None,
            timeout,
        }
    }

    /// The handshake timeout its HELLO_REJECT(`HANDSHAKE_TIMEOUT`) names, when the deadline
    /// given at the start was what was left of it (the connection had already spent some:
    /// "within the handshake timeout of 10000 ms", not "9999 ms").
    pub fn naming_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Checks the peer's transport parameters in the handshake (SPEC.md §4.3 #7): a peer
    /// whose parameters `check` refuses gets HELLO_REJECT(TRANSPORT_MISMATCH) naming why.
    pub fn checking_transport(mut self, check: TransportCheck) -> Self {
        match &mut self.state {
            State::AwaitingAck(s) => s.transport = Some(check),
            State::AwaitingHello(s) => s.transport = Some(check),
            State::AwaitingConfirm(_) | State::Done => {}
        }
        self
    }

    /// Makes this an authenticated handshake (SPEC.md §4.8): the client answers an accepted
    /// HELLO_ACK with HELLO_CONFIRM, and the server is established only once it has received
    /// HELLO_CONFIRM. Use exactly when the connection's frames pass through an
    /// authenticating [`crate::auth::AuthChannel`], which proves who sent HELLO_CONFIRM.
    pub fn with_confirmation(mut self) -> Self {
        match &mut self.state {
            State::AwaitingAck(s) => s.confirm = true,
            State::AwaitingHello(s) => s.confirm = true,
            State::AwaitingConfirm(_) | State::Done => {}
        }
        self
    }

    /// Handles a frame from the peer.
    pub fn handle_frame(&mut self, frame: Frame) {
        let (outcome, reply, next) = match std::mem::replace(&mut self.state, State::Done) {
            State::AwaitingAck(s) => s.handle_frame(frame),
            State::AwaitingHello(s) => s.handle_frame(frame),
            State::AwaitingConfirm(s) => s.handle_frame(frame),
            State::Done => return,
        };
        self.state = next;
        self.transmit = reply;
        self.outcome = outcome;
    }

    /// Handles a frame that failed authentication (the connection's
    /// [`crate::auth::AuthChannel`] refused it): the handshake fails and a HELLO_REJECT
    /// with the error's code (`AUTH_MISMATCH` or `AUTH_FAILED`) is queued.
    pub fn handle_auth_error(&mut self, error: &crate::auth::AuthError) {
        if matches!(self.state, State::Done) {
            return;
        }
        self.state = State::Done;
        let r = HelloReject {
            code: error.code(),
            detail: error.to_string(),
        };
        self.transmit = Some(Frame::HelloReject(r.clone()));
        self.outcome = Some(Err(HandshakeError::Refused(r)));
    }

    /// Handles a frame the peer sent with a protocol version this node does not speak: the
    /// handshake fails and a HELLO_REJECT with `VERSION_MISMATCH` is queued.
    pub fn handle_unsupported_version(&mut self, peer_version: u16) {
        if matches!(self.state, State::Done) {
            return;
        }
        self.state = State::Done;
        let r = version_reject(peer_version);
        self.transmit = Some(Frame::HelloReject(r.clone()));
        self.outcome = Some(Err(HandshakeError::Refused(r)));
    }

    /// Handles the passage of time. At the deadline the handshake fails with
    /// [`HandshakeError::Timeout`] and a HELLO_REJECT(`HANDSHAKE_TIMEOUT`) naming what it
    /// waited for is queued (SPEC.md §4.6): send it, then close.
    pub fn handle_timeout(&mut self, now: Instant) {
        let waited_for = match &self.state {
            State::AwaitingAck(s) if now >= s.deadline => "HELLO_ACK",
            State::AwaitingHello(s) if now >= s.deadline => "HELLO",
            State::AwaitingConfirm(s) if now >= s.deadline => "HELLO_CONFIRM",
            _ => return,
        };
        self.state = State::Done;
        self.transmit = Some(Frame::HelloReject(HelloReject {
            code: ErrorCode::HANDSHAKE_TIMEOUT,
            detail: format!(
                "no {waited_for} within the handshake timeout of {} ms",
                self.timeout.as_millis()
            ),
        }));
        self.outcome = Some(Err(HandshakeError::Timeout));
    }

    /// Handles the loss of the connection.
    pub fn handle_peer_lost(&mut self) {
        if !matches!(self.state, State::Done) {
            self.state = State::Done;
            self.outcome = Some(Err(HandshakeError::PeerLost));
        }
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        self.transmit.take()
    }

    /// When [`Handshake::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::AwaitingAck(s) => Some(s.deadline),
            State::AwaitingHello(s) => Some(s.deadline),
            State::AwaitingConfirm(s) => Some(s.deadline),
            State::Done => None,
        }
    }

    /// The outcome, once (after any frame in [`Handshake::poll_transmit`] has been taken).
    pub fn poll_outcome(&mut self) -> Option<Result<Established, HandshakeError>> {
        if self.transmit.is_some() {
            return None;
        }
        self.outcome.take()
    }
}

/// Runs a whole unauthenticated handshake between a client and a server in memory (every
/// frame encoded and decoded, as on a wire): for two ends in one process (the in-process
/// loopback transport, tests). Returns the client's and the server's [`Established`], or the
/// refusal as either side saw it.
pub fn in_memory(
    now: Instant,
    client_hello: Hello,
    server_hello: Hello,
) -> Result<(Established, Established), HandshakeError> {
    let timeout = Duration::from_secs(5);
    let mut client = Handshake::client(now, client_hello, timeout);
    let mut server = Handshake::server(now, server_hello, timeout);
    let (mut c, mut s) = (None, None);
    fn pass(from: &mut Handshake, to: &mut Handshake) {
        while let Some(f) = from.poll_transmit() {
            match f.to_bytes().map(|b| Frame::decode(&b).map(|(f, _)| f)) {
                Ok(Ok(frame)) => to.handle_frame(frame),
                _ => to.handle_peer_lost(),
            }
        }
    }
    for _ in 0..4 {
        pass(&mut client, &mut server);
        pass(&mut server, &mut client);
        c = c.or_else(|| client.poll_outcome());
        s = s.or_else(|| server.poll_outcome());
        if let (Some(c), Some(s)) = (&c, &s) {
            return match (c, s) {
                (Ok(c), Ok(s)) => Ok((c.clone(), s.clone())),
                (Err(e), _) | (_, Err(e)) => Err(e.clone()),
            };
        }
    }
    Err(HandshakeError::PeerLost)
}
