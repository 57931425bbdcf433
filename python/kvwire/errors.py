"""Typed exceptions of kvwire transfers.

Every failure is a :class:`TransferError` (or a subclass), with

* ``retryable``: whether the same request may be sent again (on a new connection if this
  one is gone): the transfer failed in the transport (peer lost, a deadline, a write), not
  because of what was sent;
* ``code`` / ``code_name``: the wire error code (e.g. ``0x100`` / ``"PROMPT_EXCEEDS_POOL"``),
  for a rejection the *original* error of the request's admission;
* ``reason``: the failure kind (the class name).

They are built from kvwire's ``kvwire::polled::Error`` (the facade the C ABI shares): the
class is the one named after its kind (``ErrorKind::name``), else :class:`TransferError`.
"""

from __future__ import annotations

from typing import Optional


class TransferError(Exception):
    """Base of every kvwire failure."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        code: Optional[int] = None,
        code_name: Optional[str] = None,
        cause: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.code = code
        self.code_name = code_name
        self.cause = cause

    @property
    def reason(self) -> str:
        """The failure kind: the exception's class name."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code_name}, retryable={self.retryable})"


class Rejected(TransferError):
    """The request was rejected at admission (prefill: longer than its pool or context; decode:
    over its pool); ``code_name`` is the original error, e.g. PROMPT_EXCEEDS_POOL. On the
    decode node a prefill's rejection arrives as REJECT carrying that code."""


class ReservationRefused(TransferError):
    """Prefill: the decode node's reservation disagreed with the request (token or page count)."""


class CountMismatch(TransferError):
    """Decode: a count in the commit differs from what was reserved."""


class DigestMismatch(TransferError):
    """Decode: the digest of the memory that landed differs from the sender's."""


class AuxMismatch(DigestMismatch):
    """Decode: the aux record's digest differs from the sender's."""


class PagesMissing(TransferError):
    """Decode: a reserved page did not receive all its bytes (its contents may be stale)."""


class AuxTooLarge(TransferError):
    """The aux record is longer than the receiver accepts or its aux slot holds."""


class MissingDigest(TransferError):
    """Decode: the commit lacked a required digest (fail closed)."""


class StaleNonce(TransferError):
    """Decode: the commit named another reservation."""


class Timeout(TransferError):
    """A deadline passed (reservation, writes, commit, verdict)."""


class Aborted(TransferError):
    """The transfer was aborted (locally: ``abort()``)."""


class PeerAborted(Aborted):
    """The peer aborted the transfer."""


class Nacked(TransferError):
    """Prefill: the decode node refused the commit (its verification failed)."""


class WriteFailed(TransferError):
    """Prefill: a data write failed at the transport."""


class PeerLost(TransferError):
    """The connection to the peer was lost (e.g. the peer process died)."""


class PeerUnresponsive(PeerLost):
    """The peer stopped answering heartbeats within the liveness timeout."""


class Unconfirmed(TransferError):
    """Prefill: the commit was sent but no verdict came back (``cause`` says what ended the
    wait, e.g. ``"PeerLost"``); the decode node may have delivered. ``retryable`` is the
    cause's (the request itself is sound), but the prefill must not send it again on its own:
    only the decode knows whether it delivered, and it re-reserves if it did not (SPEC §7.6)."""


class ProtocolViolation(TransferError):
    """The peer broke the protocol."""


class Unauthenticated(TransferError):
    """The peer does not hold the same pre-shared key (AUTH_FAILED / AUTH_MISMATCH), or a
    frame failed authentication."""


class HandshakeRefused(TransferError):
    """The connection was refused at the handshake (``code_name`` says why)."""


class LayoutMismatch(HandshakeRefused):
    """The peers' KV layouts or model fingerprints differ."""


class ConnectFailed(TransferError):
    """The connection could not be opened (socket error, transport unavailable)."""


class ReservationFailed(TransferError):
    """Decode: the reservation could not be made (a page kvwire still holds, pool errors)."""


class InvalidRequest(TransferError):
    """The engine asked for something impossible (too many pages, a chunk refused)."""


class ConfigError(TransferError):
    """The configuration was refused (e.g. a pool smaller than the context length)."""


class InvalidArgument(TransferError, ValueError):
    """An argument is invalid (a page count that does not fit the tokens, an aux index out of
    range, ...)."""


class InvalidState(TransferError, RuntimeError):
    """The call does not fit the transfer's state (``send`` before the sender is ready,
    ``init`` twice, ...)."""


class WaitTimedOut(TransferError):
    """A bounded wait inside a call ran out (not a transfer's deadline: that is Timeout)."""


class Internal(TransferError):
    """A panic inside kvwire, caught at the boundary (a bug: please report it)."""


class DiscoveryError(TransferError):
    """Peer discovery failed (bootstrap server or etcd unreachable, bad record)."""


_LAYOUT_CODES = {"LAYOUT_MISMATCH", "FINGERPRINT_MISMATCH"}


def _make(
    kind: str,
    message: str,
    retryable: bool,
    code: Optional[int],
    code_name: Optional[str],
    cause: Optional[str],
) -> TransferError:
    """Builds the typed exception (called by the native module)."""
    cls = globals().get(kind)
    if not (isinstance(cls, type) and issubclass(cls, TransferError)):
        cls = TransferError
    if cls is HandshakeRefused and code_name in _LAYOUT_CODES:
        cls = LayoutMismatch
    return cls(message, retryable=retryable, code=code, code_name=code_name, cause=cause)


__all__ = [n for n, v in globals().items() if isinstance(v, type) and issubclass(v, TransferError)]
