"""``python -m kvwire bench``: the workload of ``kvwire bench --workload engine``, from Python.

Two engines in this process, each with its own KV memory (``--memory`` per side, numpy
arrays registered by address), connected over TCP loopback with a pre-shared key. The
engine's allocator is a seeded random permutation of all pages (so requests land scattered
across the whole memory), every request is ``--pages`` pages of ``--buffers`` buffers,
``--concurrency`` requests are in flight. The prefill engine writes each request's KV into
its own pages (a stamp per page) and sends them in place; the decode engine reserves its
chosen pages and, once verified, compares every byte of them. GB/s counts the KV bytes of
verified, byte-checked requests over the wall-clock time, stamping and checking included
(the Python side's own cost is part of the figure).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List

import numpy as np

from . import KVManager, KVPoll, KVReceiver, KVSender, gen_psk
from ._native import sleep as _sleep


def _size(s: str) -> int:
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


class Allocator:
    """A seeded random permutation of the pages, handed out cyclically (the Rust bench's)."""

    def __init__(self, pages: int, seed: int) -> None:
        self.order = np.random.default_rng(seed).permutation(pages).astype(np.int64)
        self.next = 0

    def take(self, n: int) -> np.ndarray:
        idx = (self.next + np.arange(n)) % len(self.order)
        self.next = (self.next + n) % len(self.order)
        return self.order[idx]


def run_case(page_bytes: int, args: argparse.Namespace) -> dict:
    pages = args.memory // (args.buffers * page_bytes)
    if pages < args.pages * args.concurrency * 2:
        raise SystemExit(f"--memory too small for {args.concurrency} x {args.pages} pages of {page_bytes} bytes")
    words = page_bytes // 8
    psk = gen_psk()
    # Written once before the clock, so the memory is really backed (as kvwire's own
    # allocation is) and no page fault lands in the timed loop.
    pkv = [np.empty((pages, words), np.uint64) for _ in range(args.buffers)]
    dkv = [np.empty((pages, words), np.uint64) for _ in range(args.buffers)]
    for buf in pkv + dkv:
        buf.fill(0)
    common = dict(page_size=args.tokens_per_page, psk=psk, worker_threads=args.threads)
    pre = KVManager.from_arrays("prefill", pkv, **common)
    dec = KVManager.from_arrays("decode", dkv, **common)
    src_alloc, dst_alloc = Allocator(pages, 1), Allocator(pages, 2)
    req_bytes = args.pages * args.buffers * page_bytes
    total = max(1, args.bytes // req_bytes)
    inflight: List[list] = []
    done = failed = bad = 0
    next_room = 1
    start = time.perf_counter()
    while done + failed < total:
        while len(inflight) < args.concurrency and next_room <= total:
            room = next_room
            next_room += 1
            src, dst = src_alloc.take(args.pages), dst_alloc.take(args.pages)
            for o, p in enumerate(src):
                for b in range(args.buffers):
                    pkv[b][p].fill((room << 24) | (o << 8) | b)
            r = KVReceiver(dec, pre.address, room)
            r.send_metadata(dst)
            s = KVSender(pre, None, room)
            inflight.append([room, s, r, src, dst, False])
        still = []
        for t in inflight:
            room, s, r, src, dst, planned = t
            if not planned and s.poll() == KVPoll.WaitingForInput:
                s.init(args.pages)
                s.send(src)
                t[5] = True
            rs, ss = r.poll(), s.poll()
            if rs == KVPoll.Failed or ss == KVPoll.Failed:
                failed += 1
                print(f"request {room} failed: {r.error or s.error}", file=sys.stderr)
                continue
            if rs == KVPoll.Success and ss == KVPoll.Success:
                if args.check:
                    for o, p in enumerate(dst):
                        for b in range(args.buffers):
                            if not (dkv[b][p] == ((room << 24) | (o << 8) | b)).all():
                                bad += 1
                done += 1
                continue
            still.append(t)
        if len(still) == len(inflight) and len(inflight) >= args.concurrency:
            _sleep(args.poll_interval)  # nothing moved: yield the core, GIL released
        inflight = still
    secs = time.perf_counter() - start
    gb = done * req_bytes / 1e9
    return {
        "page_bytes": page_bytes,
        "buffers": args.buffers,
        "pages_per_request": args.pages,
        "concurrency": args.concurrency,
        "requests": done,
        "failed": failed,
        "byte_mismatches": bad,
        "checked": bool(args.check),
        "seconds": secs,
        "GB_per_s": gb / secs if secs else 0.0,
        "transfers_per_s": done / secs if secs else 0.0,
    }


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvwire bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-sizes", default="64K,1M", help="bytes per page per buffer (list)")
    ap.add_argument("--buffers", type=int, default=4)
    ap.add_argument("--pages", type=int, default=8, help="pages per request")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--bytes", type=_size, default=_size("1G"), help="KV bytes per case")
    ap.add_argument("--memory", type=_size, default=_size("1G"), help="KV memory per engine")
    ap.add_argument("--tokens-per-page", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="runtime threads per engine")
    ap.add_argument("--poll-interval", type=float, default=0.0001, help="seconds between polls when nothing moved")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the byte comparison")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = []
    if not args.json:
        print(f"{'page':>8} {'req':>6} {'GB/s':>8} {'xfer/s':>9} {'failed':>6} {'bad':>4}  (engine memory, scattered pages, "
              f"{args.buffers} buffers x {args.pages} pages, {args.concurrency} in flight, bytes checked: {args.check})")
    for ps in args.page_sizes.split(","):
        res = run_case(_size(ps), args)
        results.append(res)
        if not args.json:
            print(f"{ps:>8} {res['requests']:>6} {res['GB_per_s']:>8.3f} {res['transfers_per_s']:>9.1f} "
                  f"{res['failed']:>6} {res['byte_mismatches']:>4}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 1 if any(r["failed"] or r["byte_mismatches"] for r in results) else 0
