"""kvwire as an SGLang disaggregation transfer backend (a thin adapter).

When SGLang is importable the classes subclass its abstract bases
(``sglang.srt.disaggregation.base.conn``: ``BaseKVManager``, ``BaseKVSender``,
``BaseKVReceiver``, ``BaseKVBootstrapServer``); otherwise they are plain classes with the
same methods. Everything delegates to :mod:`kvwire`:

* ``KvwireKVBootstrapServer(host, port)``: kvwire's embedded bootstrap server, where prefill
  managers register (rank, address, layout fingerprint) and decode receivers resolve them.
* ``KvwireKVManager(args, disaggregation_mode, server_args, ...)``: registers ``args``'
  buffers by address; a prefill manager listens and registers itself with the bootstrap
  server (``bootstrap=`` or ``KVWIRE_BOOTSTRAP``, else ``server_args.host`` and
  ``server_args.disaggregation_bootstrap_port``).
* ``KvwireKVSender`` / ``KvwireKVReceiver``: SGLang's per-request objects; ``poll()`` returns
  SGLang's ``KVPoll`` integers, ``failure_exception()`` raises kvwire's typed exception.

The pre-shared key comes from ``KVWIRE_PSK_FILE`` / ``KVWIRE_PSK`` (or ``psk=``).
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

from . import BootstrapServer, KVArgs, KVManager, KVPoll, KVReceiver, KVSender, _role

try:  # pragma: no cover - depends on the environment
    from sglang.srt.disaggregation.base.conn import (  # type: ignore
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
    )

    HAVE_SGLANG = True
except Exception:  # sglang missing, or a version without these bases
    BaseKVManager = BaseKVSender = BaseKVReceiver = BaseKVBootstrapServer = object  # type: ignore
    HAVE_SGLANG = False


def _bootstrap_of(server_args: Any) -> Optional[str]:
    env = os.environ.get("KVWIRE_BOOTSTRAP")
    if env:
        return env
    host = getattr(server_args, "host", None)
    port = getattr(server_args, "disaggregation_bootstrap_port", None)
    return f"{host}:{port}" if host and port else None


class KvwireKVBootstrapServer(BaseKVBootstrapServer):  # type: ignore[misc,valid-type]
    """kvwire's embedded bootstrap server on ``host:port``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *args: Any, **kwargs: Any) -> None:
        self.server = BootstrapServer(f"{host}:{port}")

    @property
    def address(self) -> str:
        return self.server.address

    def run(self) -> None:
        """SGLang starts bootstrap servers with ``run()``; this one runs from construction."""

    def close(self) -> None:
        self.server.close()


class KvwireKVManager(BaseKVManager):  # type: ignore[misc,valid-type]
    """SGLang's KV manager over kvwire."""

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: Any,
        server_args: Any = None,
        is_mla_backend: Optional[bool] = False,
        **kwargs: Any,
    ) -> None:
        self.kv_args = args
        self.is_mla_backend = is_mla_backend
        self.is_prefill = _role(disaggregation_mode)
        bootstrap = kwargs.pop("bootstrap", None) or _bootstrap_of(server_args)
        # SGLang's KVArgs carries no page size: it is the server's.
        if not getattr(args, "page_size", None):
            try:
                args.page_size = int(getattr(server_args, "page_size", None) or 1)
            except AttributeError:  # a frozen args object: wrap it
                args = KVArgs(**{k: getattr(args, k) for k in KVArgs.__dataclass_fields__ if hasattr(args, k) and k != "page_size"},
                              page_size=int(getattr(server_args, "page_size", None) or 1))
        self.inner = KVManager(args, self.is_prefill, bootstrap=bootstrap, **kwargs)
        if self.is_prefill and (bootstrap or self.inner.etcd_endpoints):
            self.inner.register(getattr(args, "engine_rank", 0))


class KvwireKVSender(BaseKVSender):  # type: ignore[misc,valid-type]
    """SGLang's KVSender over kvwire (prefill)."""

    def __init__(
        self,
        mgr: KvwireKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        dest_tp_ranks: Optional[List[int]] = None,
        pp_rank: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        self.t = KVSender(mgr.inner, bootstrap_addr, bootstrap_room, dest=kwargs.get("dest"))

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.t.init(num_kv_indices, aux_index)

    def send(self, kv_indices: Any, index_slice: Any = None) -> None:
        self.t.send(kv_indices)

    def poll(self) -> int:
        return int(self.t.poll())

    def failure_exception(self) -> None:
        self.t.failure_exception()

    def abort(self) -> None:
        self.t.abort()

    def clear(self) -> None:
        self.t.clear()


class KvwireKVReceiver(BaseKVReceiver):  # type: ignore[misc,valid-type]
    """SGLang's KVReceiver over kvwire (decode): ``bootstrap_addr`` is the bootstrap server
    where the prefill registered; its rank ``prefill_dp_rank`` (default the manager's
    engine rank) is resolved there, with the layout checked."""

    def __init__(
        self,
        mgr: KvwireKVManager,
        bootstrap_addr: str,
        bootstrap_room: Optional[int] = None,
        prefill_dp_rank: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        rank = getattr(mgr.kv_args, "engine_rank", 0) if prefill_dp_rank is None else prefill_dp_rank
        self.t = KVReceiver(mgr.inner, bootstrap_addr, int(bootstrap_room or 0), prefill_rank=rank, via_bootstrap=True)

    def init(self, kv_indices: Any = None, aux_index: Optional[int] = None) -> None:
        if kv_indices is not None:
            self.t.send_metadata(kv_indices, aux_index)

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Any = None) -> None:
        self.t.send_metadata(kv_indices, aux_index)

    def poll(self) -> int:
        return int(self.t.poll())

    def failure_exception(self) -> None:
        self.t.failure_exception()

    def abort(self) -> None:
        self.t.abort()

    def clear(self) -> None:
        self.t.clear()


__all__ = [
    "HAVE_SGLANG",
    "KVPoll",
    "KvwireKVBootstrapServer",
    "KvwireKVManager",
    "KvwireKVSender",
    "KvwireKVReceiver",
]
