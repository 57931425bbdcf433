"""kvwire as a vLLM KV connector (prefill/decode disaggregation), loaded by module path.

Pinned to **vllm 0.33.0** (:data:`TESTED_VLLM`): :class:`KvwireConnector` subclasses that
version's ``KVConnectorBase_V1`` and follows what its in-tree NIXL connector does in push mode
(the prefill writes into the decode's blocks). On any other vLLM the connector refuses to start
with :class:`VLLMVersionError`, naming both versions.

Selecting it (docs/vllm.md), with no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "KvwireConnector",
                           "kv_connector_module_path": "kvwire.vllm",
                           "kv_role": "kv_producer", "kv_port": 14579,
                           "kv_connector_extra_config": {"host": "10.0.0.1"}}'

(``kv_consumer`` on the decode). vLLM's ``KVConnectorFactory`` imports ``kvwire.vllm`` and takes
``KvwireConnector`` from it.

The flow (one request; the proxy passes ``kv_transfer_params`` between the two servers as it
does for NIXL):

* Prefill (``kv_producer``): the proxy sends the request with
  ``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``. When vLLM finishes it,
  :meth:`request_finished` keeps its blocks (``delay_free``) and answers
  ``{"do_remote_prefill": true, "remote_bootstrap": ..., "remote_room": ..., ...}``. The
  worker starts a kvwire sender for exactly those blocks with no destination: kvwire sends
  them to the decode that reserves the room. The blocks are freed (``finished_sending``)
  once the decode verified them, refused them, or never came (``reservation_wait_s``).
* Decode (``kv_consumer``): :meth:`get_num_new_matched_tokens` reports the whole prompt as
  loaded asynchronously; after vLLM allocated the blocks, the worker resolves the prefill's
  rank at its bootstrap server and reserves exactly those blocks. The request is reported
  ``finished_recving`` when kvwire verified every byte that landed (digests over the decode's
  own memory). A transfer that fails verification, is aborted, is refused or whose peer died
  is reported through ``failed_recving`` and ``get_block_ids_with_load_errors()``, so vLLM
  recomputes the request or fails it (``kv_load_failure_policy``): it never decodes from what
  the blocks held before.
* Layouts: each worker's layout fingerprint (vLLM version, K/V packing, vLLM's
  ``KVCacheLayout``, dtype, block size, this rank's KV heads of the total, head size, layers,
  TP size, model) is kvwire's connection fingerprint: a peer with another one is refused at
  connect with :class:`kvwire.errors.LayoutMismatch`, the message naming both.

Configuration: ``kv_connector_extra_config`` keys (or the environment, as for kvwire.sglang):
``host`` (the address this server's kvwire engines listen on and publish, default 0.0.0.0 with
the default route's address published), ``bootstrap`` / ``KVWIRE_BOOTSTRAP`` (an external kvwire
bootstrap server; default: the prefill's rank-0 worker starts one on ``host:kv_port``), ``listen`` /
``KVWIRE_LISTEN``, ``advertise`` (the ``host:port`` decodes dial, for NAT or a proxy),
``KVWIRE_ADVERTISE_HOST``, ``cluster`` / ``KVWIRE_CLUSTER`` (default ``vllm``), ``transport`` /
``KVWIRE_TRANSPORT``, ``reservation_wait_s`` (default 120), ``reserve_timeout_s`` (30),
``liveness_timeout_s`` (2), ``KVWIRE_PSK`` / ``KVWIRE_PSK_FILE`` / ``KVWIRE_INSECURE_NO_AUTH=1``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import numpy as np

from . import BootstrapServer, KVManager, KVPoll, _advertise_host, _insecure_from_env, _join_host_port
from . import KVArgs as _KvwireArgs
from .errors import ConfigError, DiscoveryError, InvalidState, LayoutMismatch, TransferError

logger = logging.getLogger("kvwire.vllm")

#: The vLLM release this connector was written against and tested with.
TESTED_VLLM = "0.33.0"
#: ``kv_transfer_params["transfer"]`` of requests this connector handed off.
TRANSFER = "kvwire"


class VLLMVersionError(ConfigError):
    """The installed vLLM is not the version kvwire's connector was tested with."""


class UnsupportedLayout(ConfigError):
    """vLLM's configuration or KV cache layout is one kvwire's connector does not transfer
    correctly; the message names it. Raised when the connector starts, before any request."""


def vllm_version() -> Optional[str]:
    """The installed vLLM's version, or None if it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
    )

    HAVE_VLLM = True
    _IMPORT_ERROR: Optional[BaseException] = None
except Exception as _e:  # vllm missing or broken: the module still imports, the class refuses
    HAVE_VLLM = False
    _IMPORT_ERROR = _e

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise VLLMVersionError(
                f"kvwire's vLLM connector needs vllm=={TESTED_VLLM}: "
                + (f"vllm=={vllm_version()} does not import ({_IMPORT_ERROR!r})" if vllm_version()
                   else "vllm is not installed")
            )

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    KVConnectorRole = None  # type: ignore[assignment,misc]

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        finished_sending: Set[str] = field(default_factory=set)
        finished_recving: Set[str] = field(default_factory=set)
        failed_recving: Set[str] = field(default_factory=set)


if TYPE_CHECKING:  # pragma: no cover
    import torch


def check_version() -> None:
    """Raises :class:`VLLMVersionError` unless vllm==TESTED_VLLM is installed and imports."""
    found = vllm_version()
    if found != TESTED_VLLM:
        raise VLLMVersionError(
            f"kvwire's vLLM connector was tested with vllm=={TESTED_VLLM}; "
            + (f"vllm=={found} is installed" if found else "vllm is not installed")
            + " (kvwire.vllm refuses other versions: their connector API and KV layouts differ)"
        )
    if not HAVE_VLLM:
        raise VLLMVersionError(f"vllm=={found} is installed but its connector base does not import: {_IMPORT_ERROR!r}")


# -- small helpers -----------------------------------------------------------------------


def _layer_index(name: str) -> Tuple[int, ...]:
    """Sort key for layer names: their integers in order (layers.2 before layers.10)."""
    return tuple(int(x) for x in re.findall(r"\d+", name))


# -- the layout --------------------------------------------------------------------------


@dataclass
class Region:
    """One kvwire buffer: block ``b`` of it is ``[ptr + b*item, ptr + (b+1)*item)``."""

    name: str
    ptr: int
    nbytes: int
    item: int


@dataclass
class CacheLayout:
    """What :func:`describe_kv_caches` found in vLLM's cache tensors."""

    kind: str              # "packed" (K and V in one block page, vLLM >= 0.26) or "split"
    regions: List[Region]
    num_blocks: int
    layers: int
    dtype: str
    shape: str             # the first layer's shape, for messages


def _elem(t: Any) -> int:
    return int(t.element_size())


def _dense(t: Any) -> bool:
    """True when the tensor's elements fill one contiguous run, in any dimension order (a
    block of a token-major or head-major layout)."""
    dims = sorted((int(st), int(sz)) for st, sz in zip(t.stride(), t.shape) if int(sz) != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def describe_kv_caches(kv_caches: Dict[str, Any], num_blocks: int) -> CacheLayout:
    """The kvwire buffers that cover vLLM's cache tensors, one item per block.

    vLLM 0.33 hands each attention layer a ``[B, H, N, C]`` view (K and V packed in C) into
    one backing allocation: layer-compact layouts (``LB*``) give each layer a block-major
    region of its own, block-outermost layouts (``B*``) interleave every layer's page in one
    row per block, registered once as a region whose item is the row. The legacy split shape
    ``[2, B, ...]`` (K and V in separate halves) is two regions per layer. Anything else (a
    block's bytes not contiguous, padding between pages) raises :class:`UnsupportedLayout`."""
    if not kv_caches:
        raise UnsupportedLayout("no KV cache tensors to register (attention-free model?)")
    names = sorted(kv_caches, key=lambda n: (_layer_index(n), n))
    regions: List[Region] = []
    seen: Set[Tuple[int, Tuple[int, ...], Tuple[int, ...]]] = set()
    kinds: Set[str] = set()
    rows: Dict[int, List[Tuple[str, Any, int, int]]] = {}  # storage -> (name, t, page, stride)
    dtypes: Set[str] = set()
    first = kv_caches[names[0]]
    for name in names:
        t = kv_caches[name]
        key = (int(t.data_ptr()), tuple(t.shape), tuple(t.stride()))
        if key in seen:  # a layer sharing another's cache (KV sharing): registered once
            continue
        seen.add(key)
        dev = getattr(getattr(t, "device", None), "type", "cpu")
        if dev != "cpu":
            # kvwire's Python binding registers buffers as host memory (the core's device
            # buffers, MemoryKind, are not exposed to Python yet): a device pointer must never
            # reach code that would dereference it on the host.
            raise UnsupportedLayout(
                f"layer {name}: KV cache in {t.device} memory; kvwire's Python binding registers "
                "host memory only (device buffers need the core's MemoryKind in KVArgs)"
            )
        dtypes.add(str(t.dtype).replace("torch.", ""))
        shape = tuple(int(s) for s in t.shape)
        e = _elem(t)
        if len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks:
            kinds.add("split")
            for half, label in ((t[0], "K"), (t[1], "V")):
                if not _dense(half):
                    raise UnsupportedLayout(f"layer {name}: the {label} half of {shape} is not contiguous")
                item = half.numel() * e // num_blocks
                regions.append(Region(f"{name}.{label}", int(half.data_ptr()), item * num_blocks, item))
            continue
        if len(shape) < 2 or shape[0] != num_blocks:
            raise UnsupportedLayout(
                f"layer {name}: cache shape {shape} has no block dimension of {num_blocks} blocks"
            )
        kinds.add("packed")
        page = t[0].numel() * e
        stride = int(t.stride(0)) * e
        extent = (sum((int(sz) - 1) * int(st) for sz, st in zip(t[0].shape, t[0].stride())) + 1) * e
        if _dense(t[0]) and stride == page:
            regions.append(Region(name, int(t.data_ptr()), page * num_blocks, page))
        elif stride >= page and extent <= stride:
            # Block-outermost: this layer's page lies within one row per block (a slice of it,
            # or interleaved with the other layers' pages); the rows are registered once.
            rows.setdefault(int(t.untyped_storage().data_ptr()), []).append((name, t, page, stride))
        else:
            raise UnsupportedLayout(
                f"layer {name}: a block's bytes are not contiguous (shape {shape}, strides "
                f"{tuple(t.stride())}): kvwire moves whole block pages"
            )
    for base, members in rows.items():
        strides = {s for _, _, _, s in members}
        if len(strides) != 1:
            raise UnsupportedLayout(f"layers {[m[0] for m in members]}: different block strides {sorted(strides)}")
        stride = strides.pop()
        start = min(int(t.data_ptr()) for _, t, _, _ in members)
        covered = sum(p for _, _, p, _ in members)
        if covered != stride:
            raise UnsupportedLayout(
                f"block rows of {stride} bytes hold {covered} bytes of layer pages "
                f"({len(members)} layers): padding or foreign data in the row"
            )
        regions.append(Region(f"rows@{len(members)}layers", start, stride * num_blocks, stride))
    if len(kinds) > 1:
        raise UnsupportedLayout(f"layers mix packed and split K/V caches ({sorted(kinds)})")
    if len(dtypes) > 1:
        raise UnsupportedLayout(f"layers of different dtypes {sorted(dtypes)}")
    return CacheLayout(
        kind=kinds.pop(),
        regions=regions,
        num_blocks=num_blocks,
        layers=len(seen),
        dtype=dtypes.pop(),
        shape="x".join(str(int(s)) for s in first.shape),
    )


def layout_fingerprint(vllm_config: Any, layout: CacheLayout, tp_size: int) -> str:
    """The fingerprint both servers must share (kvwire refuses a peer with another at connect,
    naming both; errors show its first 64 characters, so the decisive parts come first):
    vLLM version, K/V packing, vLLM's KVCacheLayout, cache dtype, block size, KV heads of this
    rank / in total, head size, layers, TP size, model."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    try:
        total = int(mc.get_total_num_kv_heads())
    except Exception:
        total = -1
    try:
        local = int(mc.get_num_kv_heads(vllm_config.parallel_config))
    except Exception:
        local = -1
    try:
        head = int(mc.get_head_size())
    except Exception:
        head = -1
    use_mla = bool(getattr(mc, "use_mla", False))
    heads = "mla" if use_mla else f"h{local}/{total}"
    kv_layout = getattr(cc, "kv_cache_layout", None) or "?"
    cache_dtype = str(getattr(cc, "cache_dtype", "auto") or "auto")
    dtype = layout.dtype if cache_dtype == "auto" else f"{layout.dtype}/{cache_dtype}"
    model = os.path.basename(str(getattr(mc, "served_model_name", None) or mc.model).rstrip("/"))
    return (
        f"vllm{vllm_version()} kv={layout.kind} {kv_layout} {dtype} bs{cc.block_size} {heads} "
        f"d{head} L{layout.layers} tp{tp_size} {model}"
    )


# -- metadata (scheduler -> worker) --------------------------------------------------------


@dataclass
class SendSpec:
    """Prefill: send these blocks (``num_tokens`` tokens) to the decode reserving ``room``."""

    room: int
    block_ids: List[int]
    num_tokens: int


@dataclass
class RecvSpec:
    """Decode: reserve ``block_ids`` for ``room`` of the prefill at ``bootstrap``/``cluster``."""

    room: int
    block_ids: List[int]
    num_tokens: int
    bootstrap: str
    cluster: str
    remote_layouts: Optional[Dict[str, str]] = None  # the prefill's fingerprints by TP rank


@dataclass
class KvwireConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    sends: Dict[str, SendSpec] = field(default_factory=dict)
    recvs: Dict[str, RecvSpec] = field(default_factory=dict)
    # Decode: requests vLLM aborted while their load was in flight (abort, fence, release).
    aborts: Set[str] = field(default_factory=set)
    # Decode: requests handed off by a prefill that this decode will not load (aborted
    # before allocation, or a local prefix hit): the prefill is told at once and frees.
    releases: Dict[str, RecvSpec] = field(default_factory=dict)


try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata  # type: ignore
except Exception:
    class KVConnectorHandshakeMetadata:  # type: ignore[no-redef]
        pass


@dataclass
class KvwireHandshakeMetadata(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells its scheduler after registering its caches (vLLM's handshake
    metadata path): its layout fingerprint, handed to decodes in kv_transfer_params so that a
    refused connection names both vLLM layouts."""

    tp_rank: int
    fingerprint: str


def _params_of(request: Any) -> Optional[Dict[str, Any]]:
    p = getattr(request, "kv_transfer_params", None)
    return p if isinstance(p, dict) else None


def _ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


class _Settings:
    def __init__(self, vllm_config: Any) -> None:
        kvc = vllm_config.kv_transfer_config
        extra = dict(getattr(kvc, "kv_connector_extra_config", None) or {})
        self.extra = extra
        self.engine_id = str(kvc.engine_id)
        self.role = str(kvc.kv_role)
        self.is_producer = self.role == "kv_producer"
        self.is_consumer = self.role == "kv_consumer"
        # Where this server's kvwire engines listen and its bootstrap server runs (the
        # prefill's rank-0 worker starts it on host:kv_port unless an external one is named).
        self.host = str(extra.get("host") or "0.0.0.0")
        external = extra.get("bootstrap") or os.environ.get("KVWIRE_BOOTSTRAP")
        self.start_bootstrap = bool(extra.get("start_bootstrap", not external))
        self.bootstrap_listen = _join_host_port(self.host, kvc.kv_port)
        #: The bootstrap server as decodes reach it (in kv_transfer_params) and as this
        #: server's workers register with it.
        self.bootstrap = str(external or _join_host_port(_advertise_host(self.host), kvc.kv_port))
        self.cluster = f"{extra.get('cluster') or os.environ.get('KVWIRE_CLUSTER') or 'vllm'}.{self.engine_id}"
        self.block_size = int(vllm_config.cache_config.block_size)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        pc = vllm_config.parallel_config
        self.tp_size = int(pc.tensor_parallel_size)
        self.pp_size = int(pc.pipeline_parallel_size)
        self.dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)


def _refusals(vllm_config: Any, s: _Settings, kv_cache_config: Any) -> List[str]:
    out = []
    if not (s.is_producer or s.is_consumer):
        out.append(f"kv_role={s.role!r} (kvwire's connector is kv_producer on the prefill, kv_consumer on the decode)")
    if s.pp_size > 1:
        out.append(f"pipeline parallelism (pipeline_parallel_size={s.pp_size})")
    if s.dp_size > 1:
        out.append(f"data parallelism (data_parallel_size={s.dp_size}): run one server per DP rank")
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    if dcp > 1:
        out.append(f"decode context parallelism (decode_context_parallel_size={dcp})")
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        out.append(f"{len(groups)} KV cache groups (hybrid models: sliding window / Mamba with the hybrid allocator)")
    return out


# -- scheduler side ------------------------------------------------------------------------


class _Scheduler:
    def __init__(self, vllm_config: Any, s: _Settings) -> None:
        self.vllm_config = vllm_config
        self.s = s
        self._sends: Dict[str, SendSpec] = {}
        self._recvs: Dict[str, RecvSpec] = {}
        self._aborts: Set[str] = set()
        self._releases: Dict[str, RecvSpec] = {}
        self.layouts: Dict[int, str] = {}  # prefill: each worker's fingerprint, by TP rank
        self._sending: Set[str] = set()   # prefill: blocks held until finished_sending
        self._recving: Set[str] = set()   # decode: loads in flight until finished_recving

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        p = _params_of(request)
        if not p or not p.get("do_remote_prefill") or p.get("transfer", TRANSFER) != TRANSFER:
            return 0, False
        n = len(request.prompt_token_ids or [])
        if num_computed_tokens > 0 or n == 0:
            # kvwire moves whole requests: with a local prefix hit the decode computes the
            # rest itself, and update_state_after_alloc tells the prefill to free its copy.
            return 0, False
        return n, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        p = _params_of(request)
        if not p or not p.get("do_remote_prefill"):
            return
        p["do_remote_prefill"] = False  # processed: a second call (after the load) is a no-op
        spec = self._spec(request, p, [], 0)
        if spec is None:
            return
        if num_external_tokens <= 0:
            self._releases[request.request_id] = spec
            return
        (ids,) = blocks.get_block_ids()
        n = _ceil_div(num_external_tokens, self.s.block_size)
        spec.block_ids = [int(b) for b in ids[:n]]
        spec.num_tokens = int(num_external_tokens)
        self._recvs[request.request_id] = spec
        self._recving.add(request.request_id)

    def _spec(self, request: Any, p: Dict[str, Any], ids: List[int], n: int) -> Optional[RecvSpec]:
        try:
            layouts = p.get("remote_layouts") or {}
            return RecvSpec(int(p["remote_room"]), ids, n, str(p["remote_bootstrap"]), str(p["remote_cluster"]),
                            dict(layouts) if isinstance(layouts, dict) else None)
        except (KeyError, TypeError, ValueError):
            logger.error("kvwire: request %s: kv_transfer_params %r lack kvwire's remote_room/"
                         "remote_bootstrap/remote_cluster (not handed off by KvwireConnector?)",
                         request.request_id, p)
            return None

    def build_connector_meta(self, scheduler_output: Any) -> KvwireConnectorMetadata:
        meta = KvwireConnectorMetadata(self._sends, self._recvs, self._aborts, self._releases)
        self._sends, self._recvs, self._aborts, self._releases = {}, {}, set(), {}
        return meta

    def update_connector_output(self, out: Any) -> None:
        for r in out.finished_sending or ():
            self._sending.discard(r)
        for r in out.finished_recving or ():
            self._recving.discard(r)

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        from vllm.v1.request import RequestStatus

        p = _params_of(request)
        if not p:
            return False, None
        rid = request.request_id
        if p.get("do_remote_prefill"):
            # Decode: finished before its blocks were allocated (aborted while waiting):
            # tell the prefill so it frees the blocks it holds for this request.
            p["do_remote_prefill"] = False
            spec = self._spec(request, p, [], 0)
            if spec is not None:
                self._releases[rid] = spec
            return False, None
        if rid in self._recving:
            # Decode: aborted while the load is in flight. vLLM keeps the blocks until the
            # worker reports the request (after kvwire fenced the transfer).
            self._aborts.add(rid)
            return False, None
        if not p.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or failed on the prefill: nothing to hand off
        if not block_ids:
            return False, None
        room = secrets.randbits(52) | 1  # fits a JSON number in any proxy language
        self._sends[rid] = SendSpec(room, [int(b) for b in block_ids], int(request.num_computed_tokens))
        self._sending.add(rid)
        host, port = self.s.bootstrap.rsplit(":", 1)
        return True, dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            transfer=TRANSFER,
            remote_engine_id=self.s.engine_id,
            remote_request_id=rid,
            remote_bootstrap=self.s.bootstrap,
            remote_cluster=self.s.cluster,
            remote_room=room,
            remote_host=host.strip("[]"),
            remote_port=int(port),
            remote_num_tokens=int(request.num_computed_tokens),
            remote_block_ids=[int(b) for b in block_ids],
            remote_layouts={str(r): fp for r, fp in sorted(self.layouts.items())},
            tp_size=self.s.tp_size,
        )

    def has_pending_push_work(self) -> bool:
        return bool(self._sending or self._sends or self._releases or self._aborts or self._recving)


# -- worker side ---------------------------------------------------------------------------


@dataclass
class _Recv:
    spec: RecvSpec
    native: Any
    aborted: bool = False


class _Worker:
    def __init__(self, vllm_config: Any, s: _Settings) -> None:
        self.vllm_config = vllm_config
        self.s = s
        self.tp_rank = self._tp_rank()
        self.mgr: Optional[KVManager] = None
        self.server: Optional[BootstrapServer] = None
        self.layout: Optional[CacheLayout] = None
        self.fingerprint: Optional[str] = None
        self._senders: Dict[str, Any] = {}
        self._send_errors: Dict[str, TransferError] = {}
        self._unsent: Dict[str, Any] = {}
        self._recvs: Dict[str, _Recv] = {}
        self._finished_reqs: Set[str] = set()
        self._load_errors: Set[int] = set()
        self._resolved: Dict[Tuple[str, str], str] = {}
        #: Typed errors of failed loads, by request id (kept for logs and tests).
        self.recv_errors: Dict[str, TransferError] = {}

    @staticmethod
    def _tp_rank() -> int:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:  # no TP group (single process, tests)
            return 0

    def register_kv_caches(self, kv_caches: Dict[str, Any], num_blocks: int) -> None:
        s = self.s
        layout = describe_kv_caches(kv_caches, num_blocks)
        self.layout = layout
        self.fingerprint = layout_fingerprint(self.vllm_config, layout, s.tp_size)
        extra = s.extra
        options: Dict[str, Any] = {}
        _insecure_from_env(options)
        transport = extra.get("transport") or os.environ.get("KVWIRE_TRANSPORT")
        if transport:
            options["transport"] = transport
        listen = None
        if s.is_producer:
            listen = extra.get("listen") or os.environ.get("KVWIRE_LISTEN") or _join_host_port(s.host, 0)
        args = _KvwireArgs(
            engine_rank=self.tp_rank,
            kv_data_ptrs=[r.ptr for r in layout.regions],
            kv_data_lens=[r.nbytes for r in layout.regions],
            kv_item_lens=[r.item for r in layout.regions],
            page_size=s.block_size,
        )
        if s.is_producer and s.start_bootstrap and self.tp_rank == 0:
            try:
                self.server = BootstrapServer(s.bootstrap_listen)
            except TransferError as e:
                raise ConfigError(f"kvwire: cannot start the bootstrap server on {s.bootstrap_listen} (host:kv_port): {e}") from e
        # The pool must hold one prompt of max_model_len (kvwire checks it here, and refuses
        # longer prompts at admission on both sides).
        self.mgr = KVManager(
            args,
            "prefill" if s.is_producer else "decode",
            fingerprint=self.fingerprint,
            listen=listen,
            bootstrap=s.bootstrap,
            cluster=s.cluster,
            max_context_tokens=s.max_model_len,
            liveness_timeout_s=float(extra.get("liveness_timeout_s", 2.0)),
            reserve_timeout_s=float(extra.get("reserve_timeout_s", 30.0)),
            reservation_wait_s=float(extra.get("reservation_wait_s", 120.0)),
            keepalive=list(kv_caches.values()),
            **options,
        )
        logger.info("kvwire: %s rank %d registered %d regions x %d blocks; fingerprint %r",
                    s.role, self.tp_rank, len(layout.regions), num_blocks, self.fingerprint)
        if s.is_producer:
            self._register()

    def _register(self) -> None:
        assert self.mgr is not None
        addr = self.mgr.address
        published = self.s.extra.get("advertise")
        if not published:
            listen_host = addr.rsplit(":", 1)[0].strip("[]")
            published = _join_host_port(_advertise_host(listen_host), addr.rsplit(":", 1)[1])
        deadline = time.monotonic() + float(os.environ.get("KVWIRE_REGISTER_TIMEOUT", "60"))
        delay = 0.1
        while True:  # rank 0 starts the bootstrap server concurrently with the other ranks
            try:
                self.mgr.register(self.tp_rank, address=str(published))
                return
            except TransferError as e:
                if time.monotonic() + delay > deadline:
                    raise
                logger.warning("kvwire: registering with %s: %s (retrying)", self.s.bootstrap, e)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    # -- per step ----------------------------------------------------------------------------
    def start(self, meta: KvwireConnectorMetadata) -> None:
        if self.mgr is None:
            raise ConfigError("kvwire: KV caches were not registered (register_kv_caches)")
        for rid, spec in meta.sends.items():
            self._start_send(rid, spec)
        for rid, spec in meta.recvs.items():
            self._start_recv(rid, spec)
        for rid in meta.aborts:
            r = self._recvs.get(rid)
            if r is not None and not r.aborted:
                r.aborted = True
                r.native.abort()
        for rid, spec in meta.releases.items():
            self._release(rid, spec)

    def _start_send(self, rid: str, spec: SendSpec) -> None:
        """Admits the request (kvwire refuses one longer than max_model_len here, and the
        decode that reserves it is told) and hands its blocks over once the decode reserved."""
        assert self.mgr is not None
        try:
            n = self.mgr._engine.sender(int(spec.room), None)
            self._senders[rid] = n
            n.init(len(spec.block_ids), None, int(spec.num_tokens))
        except TransferError as e:
            self._send_failed(rid, e)
            return
        self._unsent[rid] = np.ascontiguousarray(spec.block_ids, dtype=np.int64)
        self._flush(rid)

    def _flush(self, rid: str) -> None:
        """Sends the blocks of ``rid`` if the decode has reserved them (else on a later poll)."""
        n = self._senders.get(rid)
        ids = self._unsent.get(rid)
        if n is None or ids is None:
            return
        try:
            n.send(ids.tobytes(), 8)
            del self._unsent[rid]
        except InvalidState as e:
            if int(n.poll()) in (KVPoll.Bootstrapping, KVPoll.WaitingForInput) and "not open" in str(e):
                return  # the decode has not reserved yet
            self._send_failed(rid, e)
        except TransferError as e:
            self._send_failed(rid, e)

    def _send_failed(self, rid: str, e: TransferError) -> None:
        logger.warning("kvwire: request %s: send failed: %r", rid, e)
        self._send_errors[rid] = e
        self._unsent.pop(rid, None)
        n = self._senders.get(rid)
        if n is not None:
            try:
                n.abort()
            except Exception:  # pragma: no cover
                pass

    def _address(self, spec: RecvSpec) -> str:
        assert self.mgr is not None
        key = (spec.bootstrap, spec.cluster)
        cached = self._resolved.get(key)
        if cached is not None and self.mgr._engine.link_up(cached):
            return cached
        peers = self.mgr._engine.resolve(spec.bootstrap, spec.cluster, "prefill", self.tp_rank,
                                         check_layout=False, etcd_endpoints=None)
        if not peers:
            raise DiscoveryError(
                f"no prefill rank {self.tp_rank} registered at {spec.bootstrap} in cluster {spec.cluster!r}"
            )
        self._resolved[key] = peers[0]["address"]
        return peers[0]["address"]

    def _start_recv(self, rid: str, spec: RecvSpec) -> None:
        assert self.mgr is not None
        try:
            n = self.mgr._engine.receiver(int(spec.room), self._address(spec))
        except TransferError as e:
            n = _Failed(e)
        self._recvs[rid] = _Recv(spec, n)
        if isinstance(n, _Failed):
            return
        try:
            ids = np.ascontiguousarray(spec.block_ids, dtype=np.int64)
            n.send_metadata(ids.tobytes(), 8, None, int(spec.num_tokens))
        except TransferError as e:
            self._recvs[rid] = _Recv(spec, _Failed(e, n))

    def _release(self, rid: str, spec: RecvSpec) -> None:
        """Tells the prefill this decode will not take the request (it frees its blocks)."""
        assert self.mgr is not None
        try:
            n = self.mgr._engine.receiver(int(spec.room), self._address(spec))
            n.abort()
        except TransferError as e:
            logger.warning("kvwire: request %s: could not tell the prefill to release it: %r "
                           "(it frees the blocks after reservation_wait_s)", rid, e)

    def results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        # vLLM names a request finished in the same step that carries its send (both come from
        # the scheduler output after request_finished): keep only the ids of our sends.
        self._finished_reqs |= {r for r in (finished_req_ids or ()) if r in self._senders or r in self._send_errors}
        res = KVConnectorTransferResults()
        for rid in list(self._send_errors):
            if rid in self._finished_reqs:
                self._send_errors.pop(rid)
                self._senders.pop(rid, None)
                self._finished_reqs.discard(rid)
                res.finished_sending.add(rid)
        for rid in list(self._unsent):
            self._flush(rid)
        for rid, n in list(self._senders.items()):
            if rid in self._send_errors:
                continue
            st = int(n.poll())
            if st in (KVPoll.Success, KVPoll.Failed) and rid in self._finished_reqs:
                if st == KVPoll.Failed:
                    logger.warning("kvwire: request %s: send failed: %r", rid, n.error())
                del self._senders[rid]
                self._finished_reqs.discard(rid)
                res.finished_sending.add(rid)
        held: Optional[Set[int]] = None
        for rid, r in list(self._recvs.items()):
            st = int(r.native.poll())
            if st == KVPoll.Success:
                del self._recvs[rid]
                res.finished_recving.add(rid)
            elif st == KVPoll.Failed:
                if held is None and self.mgr is not None:
                    held = set(self.mgr.held_pages())
                if held and any(b in held for b in r.spec.block_ids):
                    continue  # not fenced yet: vLLM must not reuse the blocks
                del self._recvs[rid]
                res.finished_recving.add(rid)
                if r.aborted:
                    continue  # vLLM aborted the request: it frees the blocks, no load error
                err = self._named(r.spec, r.native.error() or TransferError("transfer failed"))
                self.recv_errors[rid] = err
                logger.warning("kvwire: request %s: KV load failed, blocks %s reported as load errors: %r",
                               rid, r.spec.block_ids, err)
                res.failed_recving.add(rid)
                self._load_errors.update(r.spec.block_ids)
        return res

    def _named(self, spec: RecvSpec, err: TransferError) -> TransferError:
        """A layout refusal names both vLLM layouts (kvwire's handshake may have refused on
        buffer count or bytes before it compared fingerprints)."""
        if not isinstance(err, LayoutMismatch):
            return err
        theirs = (spec.remote_layouts or {}).get(str(self.tp_rank), "unknown (not reported by the prefill)")
        return LayoutMismatch(
            f"the prefill's vLLM KV layout {theirs!r} differs from this decode's {self.fingerprint!r}: "
            f"kvwire refused the connection ({err})",
            retryable=False, code=err.code, code_name=err.code_name, cause=err.cause,
        )

    def handshake_metadata(self) -> Optional[KvwireHandshakeMetadata]:
        if self.fingerprint is None:
            return None
        return KvwireHandshakeMetadata(self.tp_rank, self.fingerprint)

    def load_errors(self) -> Set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self.mgr is not None:
            try:
                self.mgr.shutdown()
            except TransferError as e:  # pragma: no cover
                logger.warning("kvwire: shutdown: %r", e)
        if self.server is not None:
            self.server.close()
            self.server = None


class _Failed:
    """A transfer that failed before kvwire had one (discovery, connect, reservation)."""

    def __init__(self, e: TransferError, native: Any = None) -> None:
        self._e = e
        self._n = native

    def poll(self) -> int:
        return int(KVPoll.Failed)

    def error(self) -> TransferError:
        return self._e

    def abort(self) -> None:
        if self._n is not None:
            self._n.abort()


# -- the connector -------------------------------------------------------------------------


class KvwireConnector(KVConnectorBase_V1):  # type: ignore[misc,valid-type]
    """vLLM's KV connector over kvwire: ``kv_producer`` (prefill) pushes a finished
    request's blocks to the ``kv_consumer`` (decode) that reserved them; the decode loads
    only verified blocks and reports every other outcome as a load error."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        check_version()
        super().__init__(vllm_config, role, kv_cache_config)
        self.s = _Settings(vllm_config)
        refused = _refusals(vllm_config, self.s, kv_cache_config)
        if refused:
            raise UnsupportedLayout(
                "kvwire's vLLM connector does not support: " + "; ".join(refused)
                + " (docs/vllm.md lists what it supports)"
            )
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self.sched: Optional[_Scheduler] = None
        self.worker: Optional[_Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self.sched = _Scheduler(vllm_config, self.s)
        else:
            self.worker = _Worker(vllm_config, self.s)

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Dict[str, "torch.Tensor"]) -> None:
        assert self.worker is not None
        if self.num_blocks <= 0:
            raise UnsupportedLayout("kv_cache_config.num_blocks is not set")
        self.worker.register_kv_caches(kv_caches, self.num_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvwireConnectorMetadata), type(meta)
        self.worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous (whole requests between steps): nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """The prefill sends a request's blocks once vLLM finished it (request_finished):
        nothing per layer."""

    def wait_for_save(self) -> None:
        """Sends run in kvwire's runtime; the blocks stay held until finished_sending."""

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        return self.worker.results(finished_req_ids)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def get_handshake_metadata(self) -> Optional[KvwireHandshakeMetadata]:
        return self.worker.handshake_metadata() if self.worker is not None else None

    def set_xfer_handshake_metadata(self, metadata: Dict[int, Any]) -> None:
        if self.sched is not None:
            for rank, m in (metadata or {}).items():
                fp = getattr(m, "fingerprint", None)
                if fp:
                    self.sched.layouts[int(rank)] = str(fp)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    @property
    def kvwire_manager(self) -> Optional[KVManager]:
        """The worker's kvwire manager (None on the scheduler side)."""
        return self.worker.mgr if self.worker is not None else None

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        assert self.sched is not None
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvwireConnectorMetadata:
        assert self.sched is not None
        return self.sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.sched is not None
        self.sched.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self.sched is not None
        return self.sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.sched is not None and self.sched.has_pending_push_work()

    @property
    def requires_kv_delivery(self) -> bool:
        return self.s.is_producer

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        return None


__all__ = [
    "HAVE_VLLM",
    "TESTED_VLLM",
    "TRANSFER",
    "CacheLayout",
    "KvwireConnector",
    "KvwireConnectorMetadata",
    "RecvSpec",
    "Region",
    "SendSpec",
    "UnsupportedLayout",
    "VLLMVersionError",
    "check_version",
    "describe_kv_caches",
    "layout_fingerprint",
    "vllm_version",
]
