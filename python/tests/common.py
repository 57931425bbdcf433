"""Shared by the tests and their peer processes: the KV geometry, the byte pattern every
transferred page carries, and a peer process driven over stdin/stdout (JSON lines)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

import kvwire

PAGE_BYTES = 4096          # bytes per page per buffer
BUFFERS = 3                # e.g. K and V of a layer, and one more
PAGES = 64                 # pages per KV buffer
PAGE_SIZE = 16             # tokens per page
AUX_SLOTS = 8
AUX_BYTES = 24             # one aux record: 16 + 8 bytes over two aux buffers
SENTINEL = 0xEE            # what decode pages hold before anything landed
HERE = os.path.dirname(os.path.abspath(__file__))


def pattern(room: int, ordinal: int, buffer: int, nbytes: int = PAGE_BYTES) -> np.ndarray:
    """The bytes of page `ordinal` of request `room` in `buffer`: random, distinct per page."""
    seed = (room * 1_000_003 + ordinal * 101 + buffer) % (2**63)
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def aux_record(room: int) -> bytes:
    return bytes((room * 7 + i) % 256 for i in range(AUX_BYTES))


def buffers(pages: int = PAGES, fill: int = 0, aux_slots: int = AUX_SLOTS):
    kv = [np.full((pages, PAGE_BYTES), fill, dtype=np.uint8) for _ in range(BUFFERS)]
    aux = [np.zeros((aux_slots, 16), np.uint8), np.zeros((aux_slots, 8), np.uint8)]
    return kv, aux


# The transport every manager of a test run uses, and so every peer process (they inherit
# the environment): tcp by default; the SoftRoCE lane runs the verified-transfer test again
# with KVWIRE_PY_TRANSPORT=rdma KVWIRE_PY_IB_DEVICE=rxe0 (scripts/softroce-lane.sh).
TRANSPORT = os.environ.get("KVWIRE_PY_TRANSPORT", "tcp")
IB_DEVICE = os.environ.get("KVWIRE_PY_IB_DEVICE") or None


def manager(role: str, psk: Optional[bytes], pages: int = PAGES, fill: int = 0,
            aux_slots: int = AUX_SLOTS, **kw: Any):
    kv, aux = buffers(pages, fill, aux_slots)
    if psk is None:
        kw.setdefault("insecure_no_auth", True)
    if TRANSPORT != "tcp":
        kw.setdefault("transport", TRANSPORT)
        kw.setdefault("ib_device", IB_DEVICE)
        # Emulated RDMA (rxe under TCG) is slow and a PING waits behind the WRITEs queued
        # before it on its queue pair (SPEC §8.3): a generous peer timeout.
        kw.setdefault("liveness_timeout_s", 10.0)
    kw.setdefault("liveness_timeout_s", 1.0)
    mgr = kvwire.KVManager.from_arrays(role, kv, aux, page_size=PAGE_SIZE, psk=psk, **kw)
    return mgr, kv, aux


def fill_source(kv, aux, room: int, pages: List[int], aux_index: Optional[int]) -> None:
    for ordinal, p in enumerate(pages):
        for b in range(BUFFERS):
            kv[b][p] = pattern(room, ordinal, b)
    if aux_index is not None:
        rec = np.frombuffer(aux_record(room), np.uint8)
        aux[0][aux_index] = rec[:16]
        aux[1][aux_index] = rec[16:]


def check_landed(kv, aux, room: int, pages: List[int], aux_index: Optional[int]) -> List[str]:
    """Every byte of every destination page, and the aux slot: a list of what differs."""
    bad = []
    for ordinal, p in enumerate(pages):
        for b in range(BUFFERS):
            if not np.array_equal(kv[b][p], pattern(room, ordinal, b)):
                bad.append(f"page {p} (ordinal {ordinal}) buffer {b}")
    if aux_index is not None:
        got = bytes(aux[0][aux_index]) + bytes(aux[1][aux_index])
        if got != aux_record(room):
            bad.append(f"aux slot {aux_index}: {got.hex()} != {aux_record(room).hex()}")
    return bad


def untouched(kv, pages: List[int], fill: int = SENTINEL) -> bool:
    return all((kv[b][p] == fill).all() for p in pages for b in range(BUFFERS))


def describe(e: Optional[kvwire.TransferError]) -> Optional[Dict[str, Any]]:
    if e is None:
        return None
    return {
        "kind": type(e).__name__,
        "code_name": e.code_name,
        "retryable": e.retryable,
        "message": str(e),
        "cause": e.cause,
    }


class Peer:
    """A peer engine in its own OS process (tests/peer.py), driven by JSON lines."""

    def __init__(self, *args: str, env: Optional[Dict[str, str]] = None) -> None:
        e = dict(os.environ)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "peer.py"), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            env=e,
            text=True,
            bufsize=1,
        )
        self.hello = self._read(30.0)

    def _read(self, timeout: float) -> Dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("peer process did not answer in time")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process ended (exit {self.proc.wait()})")
        return json.loads(line)

    def call(self, timeout: float = 30.0, **cmd: Any) -> Dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(timeout=5.0, op="exit")
            except Exception:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_state(t, states, timeout: float = 10.0):
    """Polls a KVSender/KVReceiver until its state is in `states`; returns (state, seconds)."""
    start = time.monotonic()
    while True:
        s = t.poll()
        if s in states or time.monotonic() - start > timeout:
            return s, time.monotonic() - start
        time.sleep(0.002)
