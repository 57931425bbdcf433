"""kvwire as an SGLang disaggregation transfer backend (``--disaggregation-transfer-backend kvwire``).

Pinned to **sglang 0.5.23** (:data:`TESTED_SGLANG`): the classes subclass that version's
abstract bases (``sglang.srt.disaggregation.base.conn``) with its exact signatures, and
:func:`install` registers them as the transfer backend ``kvwire``. On any other SGLang
version :func:`install` raises :class:`SGLangVersionError` naming both versions.

Selecting it (docs/sglang.md):

* SGLang servers: kvwire's wheel declares an SGLang plugin (entry point group
  ``sglang.srt.plugins``, name ``kvwire``), which SGLang runs in every process it starts
  (launcher, scheduler, detokenizer) before it parses arguments or builds a scheduler; the
  plugin calls :func:`install`. ``python -m sglang.launch_server ...
  --disaggregation-transfer-backend kvwire`` then works unchanged. ``KVWIRE_SGLANG_PLUGIN=0``
  turns the plugin off; ``SGLANG_PLUGINS``, if set, must name ``kvwire``.
* In-process (``sglang.Engine``, tests): call ``kvwire.sglang.install()`` first.

What the classes do (SGLang's scheduler calls, in its order):

* ``KvwireKVBootstrapServer(host, port)``: kvwire's embedded bootstrap server, started by
  the prefill server's main process; prefill ranks register (rank, address, layout
  fingerprint), decode ranks resolve them.
* ``KvwireKVManager(args, disaggregation_mode, server_args, is_mla_backend)``: registers the
  engine's KV buffers, its aux (metadata) buffers and each state component
  (``args.state_*``: Mamba / SWA / ... buffers) with kvwire, each verified like KV pages.
  Features kvwire does not move correctly are refused here with :class:`UnsupportedLayout`
  naming them, never ignored. The layout fingerprint carries attention TP size, KV heads,
  layer ids, dtype, MLA and the model name, so a peer with another layout is refused at
  connect (the error names both fingerprints).
* ``KvwireKVSender`` (prefill): ``poll()`` is Bootstrapping until the decode reserved,
  ``init(num_kv_indices, aux_index)``, ``send(kv_indices, state_indices, num_kv_tokens)``
  per chunk (the final chunk carries the aux record and the state indices). No decode
  address is passed: kvwire routes a request to the decode whose reservation named its
  bootstrap room.
* ``KvwireKVReceiver`` (decode): ``init(prefill_dp_rank)`` resolves the prefill rank and
  connects; ``send_metadata(kv_indices, aux_index, state_indices, ...)`` reserves exactly
  these pages and state slots; ``poll()`` is Success only once every part (KV pages, aux
  record, each state component) was verified over the memory that landed.
* Failures: ``poll()`` returns ``KVPoll.Failed`` and ``failure_exception()`` raises kvwire's
  typed exception (:mod:`kvwire.errors`: ``code_name``, ``retryable``).

Configuration (environment, or keyword arguments of ``KvwireKVManager``): ``KVWIRE_PSK`` /
``KVWIRE_PSK_FILE`` (the pre-shared key, the same on every node; ``KVWIRE_INSECURE_NO_AUTH=1``
for none), ``KVWIRE_BOOTSTRAP`` (the bootstrap server, default the prefill server's
``host:disaggregation_bootstrap_port``), ``KVWIRE_LISTEN`` (where a prefill rank listens,
default ``host:0``), ``KVWIRE_ADVERTISE_HOST`` (the host decodes connect to when listening on
0.0.0.0), ``KVWIRE_CLUSTER`` (default ``sglang``), ``KVWIRE_TRANSPORT`` (tcp or rdma).
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import BootstrapServer, KVManager, KVPoll, _advertise_host, _insecure_from_env, _join_host_port, _role
from . import KVArgs as _KvwireArgs
from .errors import ConfigError, InvalidRequest, InvalidState, TransferError

logger = logging.getLogger("kvwire.sglang")

#: The SGLang release these classes were written against and tested with.
TESTED_SGLANG = "0.5.23"
#: The name of the transfer backend (``--disaggregation-transfer-backend kvwire``).
BACKEND = "kvwire"


class SGLangVersionError(ConfigError):
    """The installed SGLang is not the version kvwire's backend was tested with."""


class UnsupportedLayout(ConfigError):
    """SGLang asked for a KV layout or feature kvwire does not transfer correctly; the message
    names it. Raised when the manager is built, before any request."""


try:  # pragma: no cover - depends on the environment
    from sglang.srt.disaggregation.base.conn import (  # type: ignore
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        KVTransferDestination,
        KVTransferMetric,
    )

    HAVE_SGLANG = True
    _IMPORT_ERROR: Optional[BaseException] = None
except Exception as _e:  # sglang missing (or broken): the classes still import, unusable
    HAVE_SGLANG = False
    _IMPORT_ERROR = _e

    class _Missing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ConfigError(f"kvwire.sglang needs sglang=={TESTED_SGLANG}: {_IMPORT_ERROR!r}")

    BaseKVManager = BaseKVSender = BaseKVReceiver = BaseKVBootstrapServer = _Missing  # type: ignore

    class KVTransferDestination(str, enum.Enum):  # type: ignore[no-redef]
        DEVICE = "device"
        HOST = "host"

    @dataclass
    class KVTransferMetric:  # type: ignore[no-redef]
        transfer_latency_s: Optional[float] = None
        alloc_latency_s: Optional[float] = None
        transfer_total_bytes: Optional[int] = None


def sglang_version() -> Optional[str]:
    """The installed SGLang's version, or None if it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("sglang")
        except PackageNotFoundError:
            return None
    except Exception:  # pragma: no cover
        return None


# -- configuration ------------------------------------------------------------------------

# State components kvwire moves as whole items: each index names one item (a page, a slot,
# a row) of every tensor of the component, the same count on both sides.
_WHOLE_ITEM_STATES = {
    "mamba",
    "swa",
    "dsa",
    "qsa_pending",
    "qsa_compressed",
    "swa_ring",
    "c128_state",
    "request_row",
    "minimax_index_k",
    "minimax_dense_kv",
    "block_scale",
    "block_scale_swa",
}
# dsa_tail: its indices encode a live sub-range of a ring row, not whole items.


def _sv(server_args: Any, name: str, default: Any = None) -> Any:
    if server_args is None:
        return default
    try:
        v = getattr(server_args, name)
    except Exception:
        return default
    return default if v is None else v


def _attn_tp_size(server_args: Any) -> int:
    tp = int(_sv(server_args, "tp_size", 1))
    dp = int(_sv(server_args, "dp_size", 1))
    if _sv(server_args, "enable_dp_attention", False) and dp > 1:
        return max(1, tp // dp)
    return tp


def _cuda_available() -> bool:
    """Whether this process has a CUDA device (SGLang then allocates its KV pools there)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch missing or broken
        return False


def _refusals(args: Any, server_args: Any, is_prefill: bool) -> List[str]:
    """What of SGLang's configuration kvwire would not transfer correctly."""
    out = []
    if str(_sv(server_args, "device", "cuda")).startswith("cuda") and _cuda_available():
        # The pointers in KVArgs are device memory: registered as host memory, kvwire's CPU
        # would read and write them directly. The core moves device memory (docs/GPU.md), but
        # the Python binding cannot register it yet.
        out.append(
            "KV in GPU memory (--device cuda): kvwire's Python binding registers host memory "
            "only (the core's device-memory path, docs/GPU.md, is not exposed to Python yet)"
        )
    if _sv(server_args, "enable_dp_attention", False) and int(_sv(server_args, "dp_size", 1)) > 1:
        out.append(f"data-parallel attention (dp_size={_sv(server_args, 'dp_size')})")
    elif is_prefill and int(_sv(server_args, "dp_size", 1)) > 1:
        # Each replica would register as the same rank; a decode could not tell which one
        # holds its request.
        out.append(f"a data-parallel prefill server (dp_size={_sv(server_args, 'dp_size')})")
    if int(_sv(server_args, "attn_cp_size", 1)) > 1:
        out.append(f"attention context parallelism (attn_cp_size={_sv(server_args, 'attn_cp_size')})")
    if int(_sv(server_args, "dcp_size", 1)) > 1:
        out.append(f"decode context parallelism (dcp_size={_sv(server_args, 'dcp_size')})")
    if not is_prefill and _sv(server_args, "disaggregation_decode_enable_radix_cache", False):
        out.append("a decode radix cache (--disaggregation-decode-enable-radix-cache: a decode prefix the prefill skips)")
    if _sv(server_args, "enable_hisparse", False):
        out.append("HiSparse (--enable-hisparse)")
    if _sv(server_args, "enable_unified_memory", False):
        out.append("unified memory (--enable-unified-memory: virtual page ids)")
    if _sv(server_args, "enable_kv_cache_sharding", False):
        out.append("KV cache sharding (--enable-kv-cache-sharding)")
    if _sv(server_args, "disaggregation_decode_allocation_policy", "early") not in ("early", None):
        out.append(
            "decode allocation policy "
            f"{_sv(server_args, 'disaggregation_decode_allocation_policy')!r} (kvwire supports 'early')"
        )
    if os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "").lower() in ("1", "true", "yes"):
        out.append("staging buffers (SGLANG_DISAGG_STAGING_BUFFER)")
    if getattr(args, "host_kv_data_ptrs", None):
        out.append("host KV destinations (host_kv_data_ptrs)")
    for t in _state_types(args):
        if t not in _WHOLE_ITEM_STATES:
            out.append(f"state component {t!r} (its indices are not whole items)")
    return out


def _state_types(args: Any) -> List[str]:
    return [str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or [])]


def _pages_of(name: str, ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int]) -> int:
    """The item count every buffer of a group shares, or UnsupportedLayout naming the group."""
    if not (len(ptrs) == len(lens) == len(items)):
        raise UnsupportedLayout(f"{name}: {len(ptrs)} pointers, {len(lens)} lengths, {len(items)} item lengths")
    counts = []
    for i, (n, it) in enumerate(zip(lens, items)):
        if int(it) <= 0 or int(n) % int(it):
            raise UnsupportedLayout(f"{name}: buffer {i} of {n} bytes is not a whole number of {it}-byte items")
        counts.append(int(n) // int(it))
    if len(set(counts)) > 1:
        raise UnsupportedLayout(
            f"{name}: buffers hold different item counts {counts} (kvwire moves one index list "
            "over every buffer of a group)"
        )
    return counts[0] if counts else 0


def _layers(ids: Sequence[Any]) -> str:
    """Layer ids for the fingerprint: ``lo-hi`` (``xN`` when each appears N times, as K and V
    buffers do), else a count and a CRC of the list."""
    ids = [int(i) for i in ids or []]
    if not ids:
        return "-"
    uniq = sorted(set(ids))
    if uniq == list(range(uniq[0], uniq[-1] + 1)) and len(ids) % len(uniq) == 0 and all(
        ids.count(u) == len(ids) // len(uniq) for u in uniq
    ):
        rep = len(ids) // len(uniq)
        return f"{uniq[0]}-{uniq[-1]}" + (f"x{rep}" if rep > 1 else "")
    return f"{len(ids)}@{zlib.crc32(repr(ids).encode()):08x}"


def _model_name(server_args: Any) -> str:
    name = _sv(server_args, "served_model_name") or _sv(server_args, "model_path") or "model"
    return os.path.basename(str(name).rstrip("/")) or str(name)


def layout_fingerprint(args: Any, server_args: Any, is_mla_backend: bool) -> str:
    """The fingerprint both engines must share (kvwire refuses a peer with another at connect,
    naming both): attention TP size, KV heads of this rank / in total, the layer ids, the KV
    dtype and layout, MLA, the page size, and the model name. The first 64 characters are
    shown in errors."""
    heads = "mla" if is_mla_backend else f"h{getattr(args, 'kv_head_num', '?')}/{getattr(args, 'total_kv_head_num', '?')}"
    parts = [
        f"tp{_attn_tp_size(server_args)}",
        heads,
        f"L{_layers(getattr(args, 'kv_layer_ids', None) or [])}",
        f"p{int(getattr(args, 'page_size', 1) or 1)}",
        str(getattr(args, "kv_cache_dtype_str", None) or "?"),
    ]
    kv_layout = getattr(args, "kv_layout", None)
    if kv_layout:
        parts.append(str(kv_layout))
    drafts = int(getattr(args, "num_draft_entries", 0) or 0)
    if drafts:
        parts.append(f"d{drafts}")
    parts.append(_model_name(server_args))
    return "sglang " + " ".join(parts)


def _connect_host(host: Any) -> str:
    host = str(host or "127.0.0.1")
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


@dataclass
class KvwirePrefillInfo:
    """What a decode manager knows of a prefill server (``prefill_info_table``'s values; SGLang
    reads ``dp_size`` and ``follow_bootstrap_room``)."""

    bootstrap_addr: str
    dp_size: int = 1
    follow_bootstrap_room: bool = False
    ranks: Tuple[int, ...] = ()


def _rank_key(dp_rank: int, pp_rank: int, tp_rank: int) -> int:
    """The rank a prefill rank registers under: data-parallel, pipeline and attention-TP
    rank, so a decode rank looks up its own counterpart whatever the peer's TP size."""
    return int(dp_rank) * 1_000_000 + int(pp_rank) * 1_000 + int(tp_rank)


class KvwireKVBootstrapServer(BaseKVBootstrapServer):  # type: ignore[misc,valid-type]
    """kvwire's embedded bootstrap server on ``host:port`` (the prefill server's
    ``--disaggregation-bootstrap-port``); it serves from construction on."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = int(port)
        self.server = BootstrapServer(_join_host_port(host or "0.0.0.0", int(port)))

    @property
    def address(self) -> str:
        return self.server.address

    def run(self) -> None:
        """Serves from construction on: nothing to start."""

    def close(self) -> None:
        self.server.close()


class _Part:
    """One kvwire engine of a manager: the KV pages with the aux record, or one state
    component."""

    def __init__(self, name: str, cluster: str, mgr: KVManager, items: int) -> None:
        self.name = name
        self.cluster = cluster
        self.mgr = mgr
        self.items = items


class KvwireKVManager(BaseKVManager):  # type: ignore[misc,valid-type]
    """SGLang's KV manager over kvwire: one kvwire engine for the KV buffers (with the aux
    buffers) and one per state component, each with the layout fingerprint.

    Keyword arguments beyond SGLang's four go to :class:`kvwire.KVManager` (``psk``,
    ``insecure_no_auth``, ``listen``, ``bootstrap``, ``cluster``, ``transport``, timeouts...);
    SGLang passes none, so servers configure it through the environment (module docstring).
    """

    supports_host_destination = False
    enable_deferred_decode_kv_release = False
    supports_deferred_decode_kv_release = False

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: Optional[bool] = False,
        **options: Any,
    ) -> None:
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.is_prefill = _role(disaggregation_mode)
        self.prefill_info_table: Dict[str, KvwirePrefillInfo] = {}
        self.req_to_decode_prefix_len: Dict[int, int] = {}
        self.attn_tp_size = _attn_tp_size(server_args)
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.engine_rank = int(getattr(args, "engine_rank", 0) or 0)
        self.attn_tp_rank = self.engine_rank % self.attn_tp_size
        self.dp_rank = self.engine_rank // self.attn_tp_size if self.is_prefill else 0

        refused = _refusals(args, server_args, self.is_prefill)
        if refused:
            raise UnsupportedLayout(
                "kvwire's SGLang backend does not support: " + "; ".join(refused)
                + " (docs/sglang.md lists what it supports)"
            )
        page_size = int(getattr(args, "page_size", 0) or 0)
        if page_size <= 0:
            raise UnsupportedLayout(f"KVArgs.page_size must be set (got {getattr(args, 'page_size', None)!r})")
        self.fingerprint = options.pop("fingerprint", None) or layout_fingerprint(args, server_args, self.is_mla_backend)

        env_bootstrap = os.environ.get("KVWIRE_BOOTSTRAP")
        self.bootstrap: Optional[str] = options.pop("bootstrap", None) or env_bootstrap
        if self.bootstrap is None and self.is_prefill:
            port = _sv(server_args, "disaggregation_bootstrap_port")
            if port:
                self.bootstrap = _join_host_port(_connect_host(_sv(server_args, "host")), port)
        self.cluster: str = options.pop("cluster", None) or os.environ.get("KVWIRE_CLUSTER") or "sglang"
        self.register_ttl_s = float(options.pop("ttl_s", 10.0))
        _insecure_from_env(options)
        if "transport" not in options and os.environ.get("KVWIRE_TRANSPORT"):
            options["transport"] = os.environ["KVWIRE_TRANSPORT"]
        listen = options.pop("listen", None)
        if self.is_prefill and listen is None:
            listen = os.environ.get("KVWIRE_LISTEN") or _join_host_port(_sv(server_args, "host", "127.0.0.1"), 0)
        self._listen_host = listen.rsplit(":", 1)[0].strip("[]") if listen else None

        kv_ptrs = [int(p) for p in getattr(args, "kv_data_ptrs", [])]
        kv_lens = [int(n) for n in getattr(args, "kv_data_lens", [])]
        kv_items = [int(n) for n in getattr(args, "kv_item_lens", [])]
        pages = _pages_of("KV buffers", kv_ptrs, kv_lens, kv_items)
        if pages == 0:
            raise UnsupportedLayout("no KV buffers (KVArgs.kv_data_ptrs is empty)")
        aux_ptrs = [int(p) for p in getattr(args, "aux_data_ptrs", None) or []]
        aux_lens = [int(n) for n in getattr(args, "aux_data_lens", None) or []]
        aux_items = [int(n) for n in getattr(args, "aux_item_lens", None) or []]
        _pages_of("aux (metadata) buffers", aux_ptrs, aux_lens, aux_items)
        keep = options.pop("keepalive", None)

        def engine(ptrs, lens, items, a_ptrs, a_lens, a_items, psize, fingerprint, cluster, context=None) -> KVManager:
            a = _KvwireArgs(
                engine_rank=self.engine_rank,
                kv_data_ptrs=ptrs,
                kv_data_lens=lens,
                kv_item_lens=items,
                aux_data_ptrs=a_ptrs,
                aux_data_lens=a_lens,
                aux_item_lens=a_items,
                ib_device=getattr(args, "ib_device", None) or None,
                gpu_id=int(getattr(args, "gpu_id", 0) or 0),
                page_size=psize,
            )
            return KVManager(
                a,
                self.is_prefill,
                fingerprint=fingerprint,
                listen=listen,
                bootstrap=self.bootstrap,
                cluster=cluster,
                keepalive=keep,
                max_context_tokens=context,
                **options,
            )

        # The context length the server advertises, when set explicitly: kvwire refuses to
        # start with a pool that cannot hold one such prompt (the incident's first bug), and
        # refuses longer prompts at admission. Unset: the pool's own capacity.
        context = options.pop("max_context_tokens", None) or _sv(server_args, "context_length")
        types = _state_types(args)
        s_ptrs = getattr(args, "state_data_ptrs", None) or []
        s_lens = getattr(args, "state_data_lens", None) or []
        s_items = getattr(args, "state_item_lens", None) or []
        if not (len(types) == len(s_ptrs) == len(s_lens) == len(s_items)):
            raise UnsupportedLayout(
                f"state components: {len(types)} types, {len(s_ptrs)} pointer lists, "
                f"{len(s_lens)} length lists, {len(s_items)} item-length lists"
            )
        states = []
        for i, t in enumerate(types):
            ptrs = [int(p) for p in s_ptrs[i]]
            lens = [int(n) for n in s_lens[i]]
            items = [int(n) for n in s_items[i]]
            n = _pages_of(f"state component {i} ({t})", ptrs, lens, items)
            if n == 0:
                raise UnsupportedLayout(f"state component {i} ({t}) has no buffers")
            states.append((i, t, ptrs, lens, items, n))

        def build() -> List[_Part]:
            parts = [
                _Part("kv", self.cluster, engine(kv_ptrs, kv_lens, kv_items, aux_ptrs, aux_lens, aux_items, page_size,
                                                 self.fingerprint, self.cluster, int(context) if context else None), pages)
            ]
            for i, t, ptrs, lens, items, n in states:
                fp = f"{self.fingerprint} s{i}:{t}"
                cluster = f"{self.cluster}.s{i}"
                parts.append(_Part(f"state{i}:{t}", cluster, engine(ptrs, lens, items, [], [], [], 1, fp, cluster), n))
            return parts

        self._build = build
        self.parts: List[_Part] = build()
        self.inner = self.parts[0].mgr
        self.kv_item_lens_sum = sum(kv_items)
        self.state_item_lens_sum = [sum(int(x) for x in comp) for comp in s_items]
        if self.is_prefill and self.bootstrap is not None:
            self.register_to_bootstrap()

    # -- SGLang's manager API ---------------------------------------------------------------
    @property
    def rank_key(self) -> int:
        return _rank_key(self.dp_rank, self.pp_rank, self.attn_tp_rank)

    def register_to_bootstrap(self) -> None:
        """Prefill: publishes every part of this rank (address, layout fingerprint) with the
        bootstrap server; refreshed while the manager lives. Decode: nothing to publish."""
        if not self.is_prefill:
            return
        if self.bootstrap is None:
            raise ConfigError("no bootstrap server: set KVWIRE_BOOTSTRAP or --disaggregation-bootstrap-port")
        # SGLang starts the bootstrap server (in its tokenizer manager) while the scheduler
        # processes load the model, so a small model's scheduler can get here first: retry for
        # KVWIRE_REGISTER_TIMEOUT seconds (default 60), as SGLang's own backends retry.
        deadline = time.monotonic() + float(os.environ.get("KVWIRE_REGISTER_TIMEOUT", "60"))
        for p in self.parts:
            addr = p.mgr.address
            port = addr.rsplit(":", 1)[1]
            published = _join_host_port(_advertise_host(self._listen_host or ""), port)
            delay = 0.1
            while True:
                try:
                    p.mgr.register(self.rank_key, ttl_s=self.register_ttl_s, address=published)
                    break
                except TransferError as e:
                    if time.monotonic() + delay > deadline:
                        raise
                    logger.warning("kvwire: registering with %s: %s (retrying)", self.bootstrap, e)
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: one attempt to learn the prefill server at ``bootstrap_addr`` (True once a
        prefill rank is registered there; the result is kept in ``prefill_info_table``)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            peers = self.inner.resolve("prefill", None, check_layout=False, server=bootstrap_addr)
        except TransferError as e:
            logger.warning("kvwire: bootstrap server %s: %s", bootstrap_addr, e)
            return False
        if not peers:
            return False
        ranks = tuple(sorted({int(p["rank"]) for p in peers}))
        dp = max(r // 1_000_000 for r in ranks) + 1
        self.prefill_info_table[bootstrap_addr] = KvwirePrefillInfo(bootstrap_addr, dp_size=dp, ranks=ranks)
        return True

    def _resolve(self, part: _Part, bootstrap_addr: str, rank: int) -> str:
        """The address of prefill rank ``rank``'s engine for ``part`` (the newest record); no
        layout check here: the connection's handshake refuses a different layout, naming both."""
        peers = part.mgr.resolve("prefill", rank, check_layout=False, server=bootstrap_addr)
        if not peers:
            from .errors import DiscoveryError

            raise DiscoveryError(
                f"no prefill rank {rank} ({part.name}) registered at {bootstrap_addr} in cluster {part.cluster!r}"
            )
        return peers[0]["address"]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops kvwire for this rank and returns once nothing of it touches the registered
        buffers (KV, aux, state): the engine may free them. Transfers still alive fail."""
        for p in self.parts:
            # Deregister first and wait until the records are gone, so no decode resolves this
            # rank after it returns; then stop.
            p.mgr.deregister()
            p.mgr.shutdown(timeout_s)

    def deregister_buffer_to_engine(self) -> None:
        """SGLang's release_memory_occupation (prefill.py:560-564, decode.py:1008-1016) calls
        this before it frees the KV memory: returns once kvwire no longer touches it."""
        self.shutdown()

    def register_buffer_to_engine(self) -> None:
        """SGLang's resume_memory_occupation: the same buffers (same addresses) are back;
        kvwire registers them again (a prefill rank re-publishes itself)."""
        self.parts = self._build()
        self.inner = self.parts[0].mgr
        if self.is_prefill and self.bootstrap is not None:
            self.register_to_bootstrap()

    def close(self) -> None:
        """As :meth:`shutdown`: the buffers may be freed once it returned."""
        self.shutdown()

    def teardown(self) -> None:
        self.shutdown()


class _Parts:
    """The per-part native transfers of one request, polled as one."""

    def __init__(self) -> None:
        self.native: Dict[int, Any] = {}
        self.error: Optional[TransferError] = None

    def fail(self, e: TransferError) -> None:
        if self.error is None:
            self.error = e
        self.abort()

    def abort(self) -> None:
        for n in self.native.values():
            try:
                n.abort()
            except Exception:  # pragma: no cover
                pass

    def states(self) -> List[int]:
        out = []
        for n in self.native.values():
            s = int(n.poll())
            if s == KVPoll.Failed and self.error is None:
                self.error = n.error() or TransferError("a part of the transfer failed")
            out.append(s)
        return out


class KvwireKVSender(BaseKVSender):  # type: ignore[misc,valid-type]
    """SGLang's KVSender over kvwire (prefill), for one request (bootstrap room)."""

    def __init__(
        self,
        mgr: KvwireKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.conclude_state: Optional[int] = None
        self.aux_index: Optional[int] = None
        self._p = _Parts()
        self._pending: List[Tuple[int, np.ndarray]] = []
        self._num_pages: Optional[int] = None
        self._pages_sent = 0
        self._tokens_sent = 0
        self._state_items = 0
        self._final_sent = False
        self._state_plan: List[Tuple[int, np.ndarray]] = []
        self._states_started = False
        self._start: Optional[float] = None
        self._end: Optional[float] = None
        try:
            # No destination: kvwire sends the room to the decode whose reservation named it.
            self._p.native[0] = mgr.parts[0].mgr._engine.sender(self.bootstrap_room, None)
        except TransferError as e:
            self._p.fail(e)

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        """Admits the request: ``num_kv_indices`` pages, the aux record at ``aux_index``. A
        request kvwire's admission rejects fails (``poll()`` Failed, the decode told)."""
        self._num_pages = int(num_kv_indices)
        self.aux_index = aux_index
        if self._p.error is not None:
            return
        try:
            self._p.native[0].init(self._num_pages, aux_index, None)
        except TransferError as e:
            self._p.fail(e)

    def send(
        self,
        kv_indices: Any,
        state_indices: Optional[List] = None,
        num_kv_tokens: Optional[int] = None,
    ) -> None:
        """Hands over the next chunk of page indices (in order); the chunk that completes the
        request's pages carries the aux record, and its ``state_indices`` (one entry per state
        component, as SGLang's scheduler computes them) become each component's transfer,
        started once the decode verified the KV pages (a refused request moves no state)."""
        if self._start is None:
            self._start = time.monotonic()
        if self._p.error is not None:
            return
        if self._num_pages is None:
            self._p.fail(InvalidState("send() before init()"))
            return
        idx = np.ascontiguousarray(np.asarray(kv_indices).ravel(), dtype=np.int64)
        if num_kv_tokens is not None:
            self._tokens_sent += int(num_kv_tokens)
        if idx.size:
            self._pages_sent += int(idx.size)
            self._pending.append((0, idx))
        final = self._pages_sent >= self._num_pages
        if final and not self._final_sent:
            self._final_sent = True
            self._send_states(state_indices)
        elif state_indices is not None and any(s is not None for s in state_indices):
            self._p.fail(InvalidRequest("state indices before the chunk that completes the request's pages"))
            return
        self._flush()

    def _send_states(self, state_indices: Optional[List]) -> None:
        """Plans each state component's transfer; they start once the KV pages were verified
        (``poll``), so a request whose KV transfer is refused moves no state either."""
        parts = self.kv_mgr.parts
        given = list(state_indices or [])
        if len(given) > len(parts) - 1:
            self._p.fail(InvalidRequest(f"{len(given)} state index lists for {len(parts) - 1} state components"))
            return
        for i, ind in enumerate(given, start=1):
            if ind is None:
                continue
            a = np.ascontiguousarray(np.asarray(ind).ravel(), dtype=np.int64)
            if a.size:
                self._state_plan.append((i, a))

    def _start_states(self) -> None:
        plan, self._state_plan = self._state_plan, []
        self._states_started = True
        for i, a in plan:
            try:
                n = self.kv_mgr.parts[i].mgr._engine.sender(self.bootstrap_room, None)
                n.init(int(a.size), None, None)
            except TransferError as e:
                self._p.fail(e)
                return
            self._p.native[i] = n
            self._state_items += int(a.size)
            self._pending.append((i, a))

    def _flush(self) -> None:
        """Hands queued chunks to kvwire, in order per part; a part not open yet keeps its
        chunks for the next poll."""
        keep: List[Tuple[int, np.ndarray]] = []
        blocked = set()
        for part, a in self._pending:
            if part in blocked or self._p.error is not None:
                keep.append((part, a))
                continue
            n = self._p.native[part]
            try:
                n.send(a.tobytes(), 8)
            except InvalidState as e:
                if int(n.poll()) in (KVPoll.Bootstrapping, KVPoll.WaitingForInput) and "not open" in str(e):
                    blocked.add(part)
                    keep.append((part, a))
                else:
                    self._p.fail(e)
            except TransferError as e:
                self._p.fail(e)
        self._pending = keep if self._p.error is None else []

    def poll(self) -> int:
        """SGLang's KVPoll: Bootstrapping until the decode reserved, WaitingForInput until the
        final chunk, Transferring until every part was verified, then Success; Failed at once
        when any part failed (the others are aborted)."""
        if self.conclude_state is not None:
            return self.conclude_state
        for _ in range(2):
            if self._pending and self._p.error is None:
                self._flush()
            states = self._p.states() if self._p.error is None else [KVPoll.Failed]
            if self._p.error is not None or KVPoll.Failed in states:
                self._p.abort()
                return self._conclude(KVPoll.Failed)
            kv = int(states[0])
            if not self._final_sent:
                return kv
            if kv == KVPoll.Success and not self._states_started:
                self._start_states()  # the KV pages were verified: now the state
                continue
            break
        if self._states_started and not self._pending and all(s == KVPoll.Success for s in states):
            return self._conclude(KVPoll.Success)
        return int(KVPoll.Transferring)

    def _conclude(self, s: int) -> int:
        self.conclude_state = int(s)
        self._end = time.monotonic()
        return int(s)

    def failure_exception(self) -> None:
        """Raises the typed exception of a failed transfer (kvwire.errors)."""
        if self._p.error is not None:
            raise self._p.error

    @property
    def error(self) -> Optional[TransferError]:
        return self._p.error

    def abort(self) -> None:
        """Aborts every part; the decode is told (it fails with PeerAborted)."""
        if self.conclude_state is None:
            self._p.fail(_aborted())
            self._conclude(KVPoll.Failed)

    def clear(self) -> None:
        """Nothing to free: kvwire released its hold on the pages at the verdict."""

    def get_transfer_metric(self) -> KVTransferMetric:
        total = self._pages_sent * self.kv_mgr.kv_item_lens_sum
        for i, n in self._p.native.items():
            if i > 0:
                total += getattr(n, "pages_sent", 0) * self.kv_mgr.state_item_lens_sum[i - 1]
        latency = None
        if self._start is not None and self._end is not None and self.conclude_state == KVPoll.Success:
            latency = self._end - self._start
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=total)


def _aborted() -> TransferError:
    from .errors import Aborted

    return Aborted("aborted by SGLang's scheduler", code_name="CANCELLED")


class KvwireKVReceiver(BaseKVReceiver):  # type: ignore[misc,valid-type]
    """SGLang's KVReceiver over kvwire (decode), for one request. ``bootstrap_addr`` is the
    prefill server's bootstrap server (``bootstrap_host:bootstrap_port`` of the request)."""

    def __init__(
        self,
        mgr: KvwireKVManager,
        bootstrap_addr: str,
        bootstrap_room: Optional[int] = None,
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.conclude_state: Optional[int] = None
        self.require_staging = False
        self.abort_notified = False
        self.prefill_dp_rank: Optional[int] = None
        self._p = _Parts()
        self._addresses: List[str] = []
        self._inited = False
        self._reserved = False

    def init(self, prefill_dp_rank: int) -> None:
        """Resolves prefill rank (``prefill_dp_rank``, this rank's pipeline and attention-TP
        rank) at the bootstrap server, every part of it, and connects the KV part (state parts
        connect at ``send_metadata``, for the components the request has); Failed (typed) if
        it cannot."""
        self.prefill_dp_rank = int(prefill_dp_rank)
        self._inited = True
        if self._p.error is not None:
            return
        m = self.kv_mgr
        rank = _rank_key(self.prefill_dp_rank, m.pp_rank, m.attn_tp_rank)
        try:
            self._addresses = [m._resolve(part, self.bootstrap_addr, rank) for part in m.parts]
            self._p.native[0] = m.parts[0].mgr._engine.receiver(self.bootstrap_room, self._addresses[0])
        except TransferError as e:
            self._p.fail(e)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        decode_prefix_len: Optional[int] = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ) -> None:
        """Reserves exactly these destination pages (in transfer order), the aux slot
        ``aux_index`` and, per state component, the slots in ``state_indices``. A reservation
        kvwire refuses (a prompt over this node's pool, ...) fails the request at once and the
        prefill is told. A decode prefix (``decode_prefix_len`` > 0) or a host destination is
        refused (kvwire moves whole requests into device memory)."""
        if self._p.error is not None:
            return
        if not self._inited:
            self._p.fail(InvalidState("send_metadata() before init(prefill_dp_rank)"))
            return
        if decode_prefix_len:
            self._p.fail(InvalidRequest(f"decode_prefix_len={decode_prefix_len}: kvwire transfers whole requests (no decode prefix)"))
            return
        if str(getattr(destination, "value", destination)) != "device":
            self._p.fail(InvalidRequest(f"destination {destination!r}: kvwire writes device (registered) memory only"))
            return
        parts = self.kv_mgr.parts
        given = list(state_indices or [])
        if len(given) > len(parts) - 1:
            self._p.fail(InvalidRequest(f"{len(given)} state index lists for {len(parts) - 1} state components"))
            return
        self._reserved = True
        try:
            kv = np.ascontiguousarray(np.asarray(kv_indices).ravel(), dtype=np.int64)
            self._p.native[0].send_metadata(kv.tobytes(), 8, aux_index, None)
            if int(self._p.native[0].poll()) == KVPoll.Failed:
                # Refused here (pool, context): no state is reserved for it either.
                self._p.fail(self._p.native[0].error() or TransferError("the reservation was refused"))
                return
            for i in range(1, len(parts)):
                ind = given[i - 1] if i - 1 < len(given) else None
                a = None if ind is None else np.ascontiguousarray(np.asarray(ind).ravel(), dtype=np.int64)
                if a is None or a.size == 0:
                    # Nothing of this component for the request: no transfer (the prefill's
                    # scheduler computes the same empty list and sends none).
                    continue
                n = parts[i].mgr._engine.receiver(self.bootstrap_room, self._addresses[i])
                self._p.native[i] = n
                n.send_metadata(a.tobytes(), 8, None, None)
        except TransferError as e:
            self._p.fail(e)

    def poll(self) -> int:
        """Bootstrapping until the KV part is connected, WaitingForInput until
        ``send_metadata``, Transferring until every part was verified, then Success; Failed
        at once when any part failed (the others are aborted)."""
        if self.conclude_state is not None:
            return self.conclude_state
        if self._p.error is not None:
            return self._conclude(KVPoll.Failed)
        if not self._inited:
            return int(KVPoll.Bootstrapping)
        states = self._p.states()
        if self._p.error is not None or KVPoll.Failed in states:
            self._p.abort()
            return self._conclude(KVPoll.Failed)
        if not self._reserved:
            return int(min(states))
        if all(s == KVPoll.Success for s in states):
            return self._conclude(KVPoll.Success)
        return int(KVPoll.Transferring)

    def _conclude(self, s: int) -> int:
        self.conclude_state = int(s)
        return int(s)

    def failure_exception(self) -> None:
        if self._p.error is not None:
            raise self._p.error

    @property
    def error(self) -> Optional[TransferError]:
        return self._p.error

    def abort(self) -> None:
        """Aborts every part (fence, release, the prefill told)."""
        if self.conclude_state is None:
            self.abort_notified = True
            self._p.fail(_aborted())
            self._conclude(KVPoll.Failed)

    def clear(self) -> None:
        """Nothing to free: kvwire released the reserved pages at the verdict."""

    def verified_pages(self) -> Optional[List[int]]:
        n = self._p.native.get(0)
        return n.verified_pages() if n is not None else None


# -- registering the backend with SGLang ----------------------------------------------------

_installed = False


def _add_enum_member(cls: Any, name: str, value: str) -> Any:
    """Adds ``name = value`` to the Enum ``cls`` (Python 3.9-3.12 Enum internals)."""
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls
    try:
        member._sort_order_ = len(cls._member_names_)
    except Exception:  # pragma: no cover
        pass
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    type.__setattr__(cls, name, member)
    return member


def install() -> None:
    """Registers ``kvwire`` as a transfer backend of the installed SGLang, without editing
    its files: adds ``TransferBackend.KVWIRE``, wraps ``get_kv_class`` (rebinding it in every
    module that imported it) and adds ``kvwire`` to ``--disaggregation-transfer-backend``'s
    choices. Idempotent. Raises :class:`SGLangVersionError` on an SGLang other than
    :data:`TESTED_SGLANG` (or none)."""
    global _installed
    found = sglang_version()
    if found != TESTED_SGLANG:
        raise SGLangVersionError(
            f"kvwire's SGLang backend was tested with sglang=={TESTED_SGLANG}; "
            + (f"sglang=={found} is installed" if found else "sglang is not installed")
            + (f" ({_IMPORT_ERROR!r})" if found and not HAVE_SGLANG else "")
        )
    if not HAVE_SGLANG:
        raise SGLangVersionError(f"sglang=={found} is installed but its base classes do not import: {_IMPORT_ERROR!r}")
    if _installed:
        return
    from sglang.srt.disaggregation import utils as du

    kvwire_member = _add_enum_member(du.TransferBackend, "KVWIRE", BACKEND)
    original = du.get_kv_class
    if getattr(original, "_kvwire_wrapped", None) is None:
        KVClassType = du.KVClassType

        def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
            if transfer_backend is kvwire_member or getattr(transfer_backend, "value", transfer_backend) == BACKEND:
                if class_type == KVClassType.KVARGS:
                    from sglang.srt.disaggregation.base import KVArgs

                    return KVArgs
                return {
                    KVClassType.MANAGER: KvwireKVManager,
                    KVClassType.SENDER: KvwireKVSender,
                    KVClassType.RECEIVER: KvwireKVReceiver,
                    KVClassType.BOOTSTRAP_SERVER: KvwireKVBootstrapServer,
                }.get(class_type)
            return original(transfer_backend, class_type)

        get_kv_class._kvwire_wrapped = original  # type: ignore[attr-defined]
        get_kv_class.__doc__ = original.__doc__
        for mod in list(sys.modules.values()):
            try:
                if getattr(mod, "get_kv_class", None) is original:
                    setattr(mod, "get_kv_class", get_kv_class)
            except Exception:  # pragma: no cover - exotic module objects
                pass
        du.get_kv_class = get_kv_class
    try:
        from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES

        if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
            DISAGG_TRANSFER_BACKEND_CHOICES.append(BACKEND)
    except ImportError:  # pragma: no cover - 0.5.23 has it
        pass
    _installed = True


def sglang_plugin() -> None:
    """SGLang's plugin hook (entry point ``sglang.srt.plugins: kvwire``): runs
    :func:`install` in every SGLang process unless ``KVWIRE_SGLANG_PLUGIN=0``."""
    if os.environ.get("KVWIRE_SGLANG_PLUGIN", "1") == "0":
        return
    install()


__all__ = [
    "BACKEND",
    "HAVE_SGLANG",
    "TESTED_SGLANG",
    "KVPoll",
    "KvwireKVBootstrapServer",
    "KvwireKVManager",
    "KvwireKVReceiver",
    "KvwireKVSender",
    "KvwirePrefillInfo",
    "SGLangVersionError",
    "UnsupportedLayout",
    "install",
    "layout_fingerprint",
    "sglang_plugin",
    "sglang_version",
]
