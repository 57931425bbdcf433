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
}

impl FrameError {
    pub(crate) fn frame(detail: impl Into<String>) -> Self {
        Self {
            scope: Scope::Frame,
            detail: detail.into(),
        }
    }
    pub(crate) fn transfer(detail: impl Into<String>) -> Self {
        Self {
            scope: Scope::Transfer,
            detail: detail.into(),
        }
    }
    pub(crate) fn connection(detail: impl Into<String>) -> Self {
        Self {
            scope: Scope::Connection,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}-scope frame error: {}", self.scope, self.detail)
    }
}

impl std::error::Error for FrameError {}
