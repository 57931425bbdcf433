//! How far the consequences of a bad or unexpected frame reach (SPEC.md §7).

use core::fmt;

/// The reach of a frame error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// The frame was dropped; nothing else changed.
    Frame,
    /// The frame failed the transfer it names (reported through the session's events).
    Transfer,
    /// The connection can no longer be trusted: the driver must close it and call
    /// `handle_peer_lost`, which fails every open transfer safely.
    Connection,
}

/// A frame the session could not accept, and the reach of the damage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameError {
    /// The reach.
    pub scope: Scope,
    /// What happened.
    pub detail: String,
    /// The frame was the peer's HELLO_REJECT after this node's HELLO_ACK: the client refused
    /// the handshake the server had already accepted (SPEC.md §4.2). The connection closes
    /// ([`Scope::Connection`]); this is the peer's reason, to report as a refusal.
    pub refused_by_peer: Option<crate::wire::HelloReject>,
}

impl FrameError {
    pub(crate) fn frame(detail: impl Into<String>) -> Self {
        Self {
            scope: Scope::Frame,
            detail: detail.into(),
            refused_by_peer: None,
        }
    }
    pub(crate) fn transfer(detail: impl Into<String>) -> Self {
        Self {
            scope: Scope::Transfer,
            detail: detail.into(),
            refused_by_peer: None,
        }
    }
    pub(crate) fn connection(detail: impl Into<String>) -> Self {
        Self {
            scope: Scope::Connection,
            detail: detail.into(),
            refused_by_peer: None,
        }
    }
    /// Any frame without a transfer reaching an established session: a handshake frame or a
    /// PING / PONG the driver did not take. HELLO_REJECT is the peer refusing the handshake
    /// after HELLO_ACK (SPEC.md §4.2); every handshake frame closes the connection.
    pub(crate) fn without_transfer(frame: &crate::wire::Frame) -> Self {
        match frame {
            crate::wire::Frame::HelloReject(r) => Self {
                scope: Scope::Connection,
                detail: format!(
                    "the peer refused the handshake after HELLO_ACK: {}: {}",
                    r.code, r.detail
                ),
                refused_by_peer: Some(r.clone()),
            },
            f => Self::connection(format!("{} after the handshake", f.frame_type())),
        }
    }
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}-scope frame error: {}", self.scope, self.detail)
    }
}

impl std::error::Error for FrameError {}
