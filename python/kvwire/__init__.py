"""kvwire: KV-cache transfer for disaggregated LLM inference, with an integrity protocol.

A thin binding over the Rust crate ``kvwire`` in the shape inference engines use (SGLang's
disaggregation ``KVManager`` / ``KVSender`` / ``KVReceiver`` / ``KVPoll``):

* :class:`KVManager` registers the engine's own KV buffers (numpy arrays, or anything with
  a data pointer such as torch tensors) once and owns a background runtime; a prefill
  manager listens for decode nodes, a decode manager connects to prefill nodes (TCP, or
  RDMA with ``transport="rdma"`` in a build with the ``rdma`` feature).
* :class:`KVSender` (prefill): ``init(num_kv_indices, aux_index)``, ``send(kv_indices)``
  once per chunk (the final chunk carries the aux record), ``poll()``, ``abort()``.
* :class:`KVReceiver` (decode): ``send_metadata(kv_indices, aux_index)`` reserves exactly
  the engine's chosen pages; ``poll()`` reports Success only for a transfer whose digests,
  computed over the memory that landed, matched the sender's; the verified aux record is
  written into the engine's aux buffers.
* :class:`KVPoll` (SGLang's values) and typed exceptions (:mod:`kvwire.errors`).

``poll()`` never blocks; every call that waits releases the GIL. Requests are keyed by the
bootstrap room (kvwire's transfer id).
"""

from __future__ import annotations

import enum
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import errors
from ._native import BootstrapServer, Engine as _Engine, gen_psk, sleep as _sleep
from .errors import *  # noqa: F401,F403  (the exception classes, re-exported)
from .errors import DiscoveryError, TransferError

__version__ = "0.1.0"


class KVPoll(enum.IntEnum):
    """A transfer's state, with SGLang's values."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass
class KVArgs:
    """SGLang's ``KVArgs``: the engine's buffers by address (one entry per buffer, e.g. one
    K and one V buffer per layer). ``kv_item_lens`` / ``aux_item_lens`` are bytes per page /
    per aux slot; every KV buffer must hold the same number of pages."""

    engine_rank: int = 0
    kv_data_ptrs: List[int] = field(default_factory=list)
    kv_data_lens: List[int] = field(default_factory=list)
    kv_item_lens: List[int] = field(default_factory=list)
    aux_data_ptrs: List[int] = field(default_factory=list)
    aux_data_lens: List[int] = field(default_factory=list)
    aux_item_lens: List[int] = field(default_factory=list)
    ib_device: Optional[str] = None
    gpu_id: int = 0
    page_size: int = 1


def buffer_address(obj: Any) -> Tuple[int, int]:
    """``(address, nbytes)`` of a C-contiguous numpy array, or of anything with a data
    pointer (torch tensors: ``data_ptr()``, ``numel() * element_size()``)."""
    if isinstance(obj, np.ndarray):
        if not obj.flags["C_CONTIGUOUS"] or not obj.flags["WRITEABLE"]:
            raise ValueError("KV buffers must be C-contiguous, writable arrays")
        return int(obj.__array_interface__["data"][0]), int(obj.nbytes)
    if hasattr(obj, "data_ptr"):
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise ValueError("KV tensors must be contiguous")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    raise TypeError(f"{type(obj).__name__} has no data pointer (numpy array or tensor expected)")


def _item_len(obj: Any) -> int:
    shape = getattr(obj, "shape", None)
    if not shape:
        raise ValueError("a buffer's first dimension is its pages (or aux slots)")
    n = int(shape[0])
    return buffer_address(obj)[1] // n


def _indices(kv_indices: Any) -> Tuple[bytes, int]:
    a = np.ascontiguousarray(kv_indices)
    if a.dtype not in (np.int32, np.int64):
        a = a.astype(np.int64)
    return a.ravel().tobytes(), a.dtype.itemsize


def _role(role: Any) -> bool:
    """True for prefill. Accepts "prefill"/"decode", a bool, or SGLang's DisaggregationMode."""
    if isinstance(role, bool):
        return role
    name = getattr(role, "name", None) or getattr(role, "value", None) or role
    name = str(name).lower()
    if name in ("prefill", "sender"):
        return True
    if name in ("decode", "receiver"):
        return False
    raise ValueError(f"role {role!r}: prefill or decode")


class KVManager:
    """One engine's kvwire node: its KV and aux buffers registered by address, a background
    runtime, and its connections.

    ``role`` is "prefill" (listens on ``listen``, default 127.0.0.1:0, for decode nodes) or
    "decode" (connects to prefill nodes). Authentication: ``psk`` (bytes, the same on every
    node), else ``KVWIRE_PSK_FILE`` / ``KVWIRE_PSK``, or ``insecure_no_auth=True``.

    Memory contract: the buffers must stay valid (and not move) while the manager lives;
    give the arrays/tensors as ``keepalive`` (``from_arrays`` does) so they outlive its
    runtime. kvwire writes only pages reserved for a transfer and reads only pages being
    sent; the engine must not write a page while kvwire holds it (``held_pages()``).
    Over TCP, KV buffers that start on a 4 KiB boundary are copied fastest: a large numpy
    array starts 16 bytes into a page, a PyTorch CPU tensor 64, and on some CPUs the kernel's
    socket copies run several times slower for some such placements (the README's "With the
    engine's own KV memory"; measure yours with ``kvwire bench --buffer-offset N``).

    Timeouts: ``reserve_timeout_s`` (decode: how long the prefill has to deliver a
    reservation), ``reservation_wait_s`` (prefill: how long an ``init``-ed request waits for
    the decode's reservation), ``parked_reservation_s`` (prefill: how long a reservation that
    arrived before ``init`` is held), ``liveness_timeout_s`` (a silent peer is lost).

    ``tcp_streams``: TCP streams per connection (1 to 64, the same on both engines; transfers
    spread over them, each on one stream).

    ``same_host``: ``"auto"`` (the default: when both engines run on one host, the decode
    copies each page straight out of the prefill's memory, one copy per byte; docs/SAME_HOST.md),
    ``"off"`` (page bytes on the TCP stream) or ``"require"`` (refuse a peer without it).
    ``pull_threads``: threads that copy the engine's pulls, shared by its connections (1: on
    each connection's own task; 0, the default: half the process's cores, at most 8).

    RDMA (``transport="rdma"``; the device is ``KVArgs.ib_device``, the first one if unset, or
    several comma-separated as Mooncake takes them, ``"mlx5_0,mlx5_1"``: one rail each, transfers
    spread over them; docs/INTEGRATION.md): ``ib_queue_pairs`` RC queue pairs per connection (1
    to 146, the same on both engines, raised to one per device; transfers take them in turn), ``ib_busy_poll`` (poll completion queues in a loop: lower
    latency, one core busy per connection), ``ib_ack_timeout`` (the queue pairs' local ACK
    timeout exponent, 1 to 31: 4.096 µs x 2^n before a packet is sent again; 14, about 67 ms,
    by default; 18, about 1.1 s, where queueing on the path can exceed that),
    ``ib_stripe_pages`` (decode side: a transfer of P pages is written over
    min(P / ib_stripe_pages, queue pairs) queue pairs at once, each rail once before any twice;
    16 by default, 0 never stripes), ``ib_rail_affinity`` (decode side: keep to the rails whose
    NIC is on the KV memory's NUMA node while one is up, where the kernel reports the nodes;
    True by default). A value out of range raises ``ConfigError`` naming it.

    Discovery: ``bootstrap`` (an embedded bootstrap server's ``host:port``) or
    ``etcd_endpoints``, with ``cluster``: a prefill manager registers itself
    (``register()``), and a decode manager's receivers resolve the prefill by rank.
    """

    def __init__(
        self,
        args: KVArgs,
        role: Any,
        *,
        psk: Optional[bytes] = None,
        insecure_no_auth: bool = False,
        fingerprint: str = "kvwire-python",
        listen: Optional[str] = None,
        transport: str = "tcp",
        max_context_tokens: Optional[int] = None,
        node_id: Optional[int] = None,
        liveness_timeout_s: float = 2.0,
        reserve_timeout_s: float = 30.0,
        reservation_wait_s: float = 30.0,
        parked_reservation_s: float = 30.0,
        worker_threads: int = 2,
        tcp_streams: int = 1,
        same_host: str = "auto",
        pull_threads: int = 0,
        ib_queue_pairs: int = 1,
        ib_busy_poll: bool = False,
        ib_ack_timeout: int = 14,
        ib_stripe_pages: int = 16,
        ib_rail_affinity: bool = True,
        bootstrap: Optional[str] = None,
        etcd_endpoints: Optional[Sequence[str]] = None,
        cluster: str = "kvwire",
        keepalive: Any = None,
    ) -> None:
        self.kv_args = args
        self.is_prefill = _role(role)
        self.bootstrap = bootstrap
        self.etcd_endpoints = list(etcd_endpoints) if etcd_endpoints else None
        self.cluster = cluster
        if psk is None and not insecure_no_auth:
            psk = _psk_from_env()
        self._engine = _Engine(
            self.is_prefill,
            [int(p) for p in args.kv_data_ptrs],
            [int(n) for n in args.kv_data_lens],
            [int(n) for n in args.kv_item_lens],
            [int(p) for p in args.aux_data_ptrs],
            [int(n) for n in args.aux_data_lens],
            [int(n) for n in args.aux_item_lens],
            int(getattr(args, "page_size", None) or 1),
            max_context_tokens=max_context_tokens,
            psk=psk,
            insecure_no_auth=insecure_no_auth,
            fingerprint=fingerprint,
            node_id=node_id,
            listen=listen,
            transport=transport,
            ib_device=getattr(args, "ib_device", None) or None,
            liveness_timeout_s=liveness_timeout_s,
            reserve_timeout_s=reserve_timeout_s,
            reservation_wait_s=reservation_wait_s,
            parked_reservation_s=parked_reservation_s,
            worker_threads=worker_threads,
            tcp_streams=tcp_streams,
            same_host=same_host,
            pull_threads=pull_threads,
            ib_queue_pairs=ib_queue_pairs,
            ib_busy_poll=ib_busy_poll,
            ib_ack_timeout=ib_ack_timeout,
            ib_stripe_pages=ib_stripe_pages,
            ib_rail_affinity=ib_rail_affinity,
            keepalive=keepalive,
        )
        self._resolved: Dict[Tuple[str, str, int], str] = {}

    @classmethod
    def from_arrays(
        cls,
        role: Any,
        kv_buffers: Sequence[Any],
        aux_buffers: Sequence[Any] = (),
        *,
        page_size: int = 1,
        engine_rank: int = 0,
        ib_device: Optional[str] = None,
        **kwargs: Any,
    ) -> "KVManager":
        """A manager over the engine's arrays: each KV buffer's first dimension is its pages,
        each aux buffer's first dimension its slots (one per request in flight)."""
        kv = list(kv_buffers)
        aux = list(aux_buffers)
        spans = sorted(
            (a, a + n) for a, n in (buffer_address(b) for b in kv + aux)
        )
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                raise ValueError("KV and aux buffers must not overlap")
        args = KVArgs(
            engine_rank=engine_rank,
            kv_data_ptrs=[buffer_address(b)[0] for b in kv],
            kv_data_lens=[buffer_address(b)[1] for b in kv],
            kv_item_lens=[_item_len(b) for b in kv],
            aux_data_ptrs=[buffer_address(b)[0] for b in aux],
            aux_data_lens=[buffer_address(b)[1] for b in aux],
            aux_item_lens=[_item_len(b) for b in aux],
            ib_device=ib_device,
            page_size=page_size,
        )
        return cls(args, role, keepalive=(kv, aux), **kwargs)

    # -- the node ---------------------------------------------------------------------------
    @property
    def address(self) -> Optional[str]:
        """Prefill: where decode nodes connect (``host:port``)."""
        return self._engine.address

    @property
    def node_id(self) -> int:
        return self._engine.node_id

    @property
    def pages(self) -> int:
        """Pages in every KV buffer."""
        return self._engine.pages

    @property
    def layout_fingerprint(self) -> str:
        return self._engine.layout_fingerprint

    def connected_peers(self) -> List[int]:
        """Prefill: node ids of the connected decode nodes."""
        return self._engine.connected_peers()

    def handshake_stats(self) -> Dict[str, int]:
        """Prefill: accepted / established / refused / malformed / failed handshakes."""
        return self._engine.handshake_stats()

    def held_pages(self) -> List[int]:
        """Pages kvwire holds now: the engine must not free or write them."""
        return self._engine.held_pages()

    # -- discovery --------------------------------------------------------------------------
    def register(self, rank: Optional[int] = None, *, ttl_s: float = 10.0, address: Optional[str] = None) -> None:
        """Publishes this node (rank, address, layout fingerprint) with the bootstrap server
        or etcd; refreshed while the manager lives, expiring ``ttl_s`` after it dies."""
        self._engine.register(
            self.bootstrap,
            self.cluster,
            getattr(self.kv_args, "engine_rank", 0) if rank is None else rank,
            ttl_s=ttl_s,
            address=address,
            etcd_endpoints=self.etcd_endpoints,
        )

    def deregister(self) -> None:
        self._engine.deregister()

    def resolve(
        self,
        role: str = "prefill",
        rank: Optional[int] = None,
        *,
        check_layout: bool = True,
        server: Optional[str] = None,
    ) -> List[Dict[str, Any]]:
        """Peers registered in this manager's cluster (dicts with node_id, rank, address, ...),
        through its bootstrap server or etcd (or the bootstrap server ``server``). A peer
        with another layout fingerprint raises :class:`LayoutMismatch`."""
        return self._engine.resolve(
            server or self.bootstrap,
            self.cluster,
            role,
            rank,
            check_layout=check_layout,
            etcd_endpoints=self.etcd_endpoints,
        )

    def resolve_prefill(self, rank: int = 0, *, cached: bool = True, server: Optional[str] = None) -> str:
        """The address of prefill ``rank``: its newest registration (a restarted prefill
        before its dead predecessor, whose record stays until its TTL runs out)."""
        key = (server or self.bootstrap or "", self.cluster, rank)
        # A cached address serves while kvwire's connection to it is up; a lost one (the
        # prefill died or moved) is resolved again.
        if cached and key in self._resolved and self._engine.link_up(self._resolved[key]):
            return self._resolved[key]
        peers = self.resolve("prefill", rank, server=server)
        if not peers:
            raise DiscoveryError(f"no prefill node of rank {rank} registered in cluster {self.cluster!r}")
        self._resolved[key] = peers[0]["address"]
        return peers[0]["address"]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops kvwire on this node for good and returns once nothing of it touches the
        registered buffers: the engine may free them afterwards, even with transfers still
        alive (they poll Failed, and release at once). Discovery records are removed and
        connections closed (peers fail their side, retryable). Raises
        :class:`WaitTimedOut` if that took longer than ``timeout_s`` (the buffers must
        then stay valid; call again to wait more). Releases the GIL."""
        self._engine.shutdown(timeout_s)

    def close(self) -> None:
        """Deregisters; the runtime and connections go when the last object using them does."""
        self._engine.deregister()


def _psk_from_env() -> Optional[bytes]:
    path = os.environ.get("KVWIRE_PSK_FILE")
    text = None
    if path:
        with open(path) as f:
            text = f.read().strip()
    elif os.environ.get("KVWIRE_PSK"):
        text = os.environ["KVWIRE_PSK"].strip()
    return bytes.fromhex(text) if text else None


# -- configuration the engine adapters (kvwire.sglang, kvwire.vllm) read alike ------------------


def _insecure_from_env(options: Dict[str, Any]) -> None:
    """Sets ``insecure_no_auth`` in an adapter's options when ``KVWIRE_INSECURE_NO_AUTH=1`` and no
    key is set (in the options or the environment)."""
    if "psk" in options or options.get("insecure_no_auth"):
        return
    if os.environ.get("KVWIRE_INSECURE_NO_AUTH") == "1" and not (
        os.environ.get("KVWIRE_PSK") or os.environ.get("KVWIRE_PSK_FILE")
    ):
        options["insecure_no_auth"] = True


def _advertise_host(listen_host: str) -> str:
    """The host other nodes reach a listener on ``listen_host`` at: ``KVWIRE_ADVERTISE_HOST``,
    else the listen host itself unless it is a wildcard, else the default route's address."""
    env = os.environ.get("KVWIRE_ADVERTISE_HOST")
    if env:
        return env
    if listen_host not in ("0.0.0.0", "::", ""):
        return listen_host
    try:  # the address another host reaches this one at (no packet is sent)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _join_host_port(host: Any, port: Any) -> str:
    """``host:port``, an IPv6 host in brackets."""
    host = str(host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class _Transfer:
    _native: Any

    def poll(self) -> KVPoll:
        """The state; never blocks."""
        return KVPoll(self._native.poll())

    @property
    def error(self) -> Optional[TransferError]:
        """The typed exception of a failed transfer (not raised), or None."""
        return self._native.error()

    def failure_exception(self) -> None:
        """Raises the typed exception of a failed transfer (SGLang's contract); does nothing
        otherwise."""
        e = self._native.error()
        if e is not None:
            raise e

    def wait(self, timeout: float = 30.0, interval: float = 0.001) -> KVPoll:
        """Polls until Success or Failed (or ``timeout``), sleeping with the GIL released."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.poll()
            if s in (KVPoll.Success, KVPoll.Failed) or time.monotonic() >= deadline:
                return s
            _sleep(interval)

    def abort(self) -> None:
        """Aborts the request; the peer is told, and this side fails with Aborted."""
        self._native.abort()

    def clear(self) -> None:
        """Drops nothing kvwire needs: pages are released at verification or failure."""

    @property
    def bootstrap_room(self) -> int:
        return self._native.room


class KVSender(_Transfer):
    """Prefill side of one request (bootstrap room), sent in chunks.

    The request goes to the decode node that reserves it: of every decode connected, the
    one whose reservation (or refusal) named ``bootstrap_room``; ``poll()`` is Bootstrapping
    until then and WaitingForInput once it reserved. A decode's refusal (its pool or context
    too small, its engine cancelled the request) fails it at once with the decode's code
    (:class:`PeerAborted`, not retryable). ``dest`` (a decode's node id) pins the request to
    that decode instead."""

    def __init__(self, mgr: KVManager, bootstrap_addr: Optional[str], bootstrap_room: int, dest: Optional[int] = None, **_: Any) -> None:
        self.mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self._native = mgr._engine.sender(int(bootstrap_room), dest)

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None, num_tokens: Optional[int] = None) -> None:
        """Plans ``num_kv_indices`` pages (``num_tokens`` tokens, default pages x page size);
        admission runs now or once the decode node is connected: a rejection fails the sender
        with :class:`Rejected` and reaches the decode node with the same code."""
        self._native.init(int(num_kv_indices), aux_index, num_tokens)

    def send(self, kv_indices: Any, index_slice: Any = None) -> None:
        """Sends the next chunk (page indices of the engine's KV memory, in order); the chunk
        that completes the request also sends the aux record at ``aux_index``. Never waits on
        the connection: a chunk it refuses (a page the pool cannot lend) fails the transfer,
        read from :meth:`poll` (Failed) and :attr:`error`."""
        raw, width = _indices(kv_indices)
        self._native.send(raw, width)


class KVReceiver(_Transfer):
    """Decode side of one request: ``bootstrap_addr`` is the prefill node's kvwire address,
    or, for a manager with discovery (``bootstrap=`` / ``etcd_endpoints=``), None or the
    bootstrap server, with ``prefill_rank`` resolved through it (``via_bootstrap=True``:
    ``bootstrap_addr`` is a bootstrap server even if the manager has none, as in SGLang)."""

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_addr: Optional[str],
        bootstrap_room: int,
        prefill_rank: Optional[int] = None,
        *,
        via_bootstrap: bool = False,
        **_: Any,
    ) -> None:
        self.mgr = mgr
        address = bootstrap_addr
        discovered = mgr.bootstrap is not None or mgr.etcd_endpoints is not None
        self._early: Optional[TransferError] = None
        if via_bootstrap or (discovered and (prefill_rank is not None or bootstrap_addr in (None, mgr.bootstrap))):
            try:
                server = bootstrap_addr if via_bootstrap else None
                address = mgr.resolve_prefill(prefill_rank or 0, server=server)
            except TransferError as e:
                self._early = e
                address = None
        self._native: Any
        if self._early is not None:
            self._native = _FailedNative(bootstrap_room, self._early)
        elif address is None:
            raise ValueError("no prefill address: pass bootstrap_addr or configure discovery")
        else:
            self._native = mgr._engine.receiver(int(bootstrap_room), address)

    def init(self, kv_indices: Any = None, aux_index: Optional[int] = None, num_tokens: Optional[int] = None) -> None:
        """SGLang's older entry point: with ``kv_indices``, the same as :meth:`send_metadata`."""
        if kv_indices is not None:
            self.send_metadata(kv_indices, aux_index, num_tokens=num_tokens)

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, num_tokens: Optional[int] = None, **_: Any) -> None:
        """Reserves exactly these destination pages (in transfer order) for the request; the
        verified aux record is written at ``aux_index``. A prompt over this node's pool fails
        here with :class:`Rejected` (PROMPT_EXCEEDS_POOL)."""
        raw, width = _indices(kv_indices)
        self._native.send_metadata(raw, width, aux_index, num_tokens)

    def aux(self) -> Optional[bytes]:
        """The verified aux record (after Success)."""
        return self._native.aux()

    def verified_pages(self) -> Optional[List[int]]:
        """The destination pages the verified transfer landed in (after Success)."""
        return self._native.verified_pages()


class _FailedNative:
    """A receiver whose prefill could not even be found."""

    def __init__(self, room: int, error: TransferError) -> None:
        self.room = int(room)
        self._e = error

    def poll(self) -> int:
        return int(KVPoll.Failed)

    def error(self) -> TransferError:
        return self._e

    def abort(self) -> None:
        pass

    def send_metadata(self, *_: Any) -> None:
        pass

    def aux(self) -> None:
        return None

    def verified_pages(self) -> None:
        return None


__all__ = [
    "KVPoll",
    "KVArgs",
    "KVManager",
    "KVSender",
    "KVReceiver",
    "BootstrapServer",
    "buffer_address",
    "gen_psk",
    "errors",
] + errors.__all__
