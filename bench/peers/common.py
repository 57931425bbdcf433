"""Shared parts of the peer drivers (Mooncake TE, NIXL): the workload of
`kvwire bench --workload engine`, the page pattern and its check, the side channel
between the two processes, and the CPU clock.

The workload (cli/src/bench/engine.rs): each engine owns `memory` bytes of KV
memory as `buffers` buffers (layers x K/V); a page index p names page p of every buffer;
each engine's allocator hands out page indices from a seeded xorshift permutation of all
of them (the same permutation and seeds as kvwire's `Allocator`, SEND_SEED for the
prefill, RECEIVE_SEED for the decode), so source page i of a request lands at a random
destination page. A request is `pages` page indices x `buffers` buffers.

The byte check: before the timed window the initiator writes every source page slice
(request r, ordinal o, buffer b) with a pattern of 64-bit words that is a function of
(r, o, b) and the word's index; the target fills its whole memory with a poison byte. After
the timed window the target checks every destination page slice of every request against
the pattern, and every page no request wrote still holds the poison. Any difference fails
the run.
"""

import json
import os
import resource
import socket
import sys
import time

import numpy as np

SEND_SEED = 0x5EED_0001
RECEIVE_SEED = 0x5EED_0002
MASK64 = (1 << 64) - 1
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# Where every KV buffer starts: on a 4 KiB page (`alloc`).
PAGE_ALIGN = 4096
POISON = 0xA5


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(s[:-1]) * mult[s[-1]]
    return int(s)


def permutation(pages, seed):
    """kvwire's `Allocator::new`: a Fisher-Yates shuffle driven by xorshift64."""
    order = list(range(pages))
    x = seed | 1
    for i in range(pages - 1, 0, -1):
        x ^= (x << 13) & MASK64
        x ^= x >> 7
        x ^= (x << 17) & MASK64
        j = x % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


class Workload:
    """One case: page size, pages per request, requests, and both sides' page choices."""

    def __init__(self, memory, buffers, page, pages, total_bytes, concurrency, buffer_offset=0):
        self.memory, self.buffers, self.page, self.pages = memory, buffers, page, pages
        self.concurrency = concurrency
        # Every KV buffer starts this many bytes past a 4 KiB boundary (`alloc`).
        self.buffer_offset = buffer_offset % PAGE_ALIGN
        self.buffer_bytes = memory // buffers
        self.page_count = self.buffer_bytes // page  # page indices per buffer
        self.request_bytes = page * pages * buffers
        self.requests = max(1, total_bytes // self.request_bytes)
        self.bytes = self.requests * self.request_bytes
        if self.requests * pages > self.page_count:
            raise SystemExit(
                f"{self.requests} requests x {pages} pages need more than the {self.page_count} "
                "page indices of the memory: every destination page must be written once so "
                "that every one can be checked (raise --memory or lower --bytes)"
            )
        n = self.requests * pages
        # Allocators hand out their permutations in order; each side takes `pages` per request.
        self.src = np.array(permutation(self.page_count, SEND_SEED)[:n], dtype=np.int64).reshape(
            self.requests, pages
        )
        self.dst = np.array(
            permutation(self.page_count, RECEIVE_SEED)[:n], dtype=np.int64
        ).reshape(self.requests, pages)

    def describe(self):
        return dict(
            memory=self.memory,
            buffers=self.buffers,
            page_bytes=self.page,
            pages=self.pages,
            requests=self.requests,
            bytes=self.bytes,
            concurrency=self.concurrency,
        )

    def slices(self, r, src_bases, dst_bases):
        """(source addresses, destination addresses) of request r's page slices."""
        srcs, dsts = [], []
        for o in range(self.pages):
            sp, dp = int(self.src[r, o]) * self.page, int(self.dst[r, o]) * self.page
            for b in range(self.buffers):
                srcs.append(src_bases[b] + sp)
                dsts.append(dst_bases[b] + dp)
        return srcs, dsts

    def _tags(self, which, b):
        """Per page index of one buffer: the pattern's seed word, 0 where no request uses it."""
        tags = np.zeros(self.page_count, dtype=np.uint64)
        rr, oo = np.meshgrid(
            np.arange(self.requests, dtype=np.uint64),
            np.arange(self.pages, dtype=np.uint64),
            indexing="ij",
        )
        t = ((rr + np.uint64(1)) << np.uint64(32)) | (oo << np.uint64(8)) | np.uint64(b + 1)
        idx = self.src if which == "src" else self.dst
        tags[idx.reshape(-1)] = (t * GOLDEN).reshape(-1)
        return tags

    def fill_sources(self, arrays):
        """Write every source page slice with its (request, ordinal, buffer) pattern."""
        words = self.page // 8
        idx = np.arange(words, dtype=np.uint64)
        for b, arr in enumerate(arrays):
            view = arr.view(np.uint64).reshape(self.page_count, words)
            tags = self._tags("src", b)
            np.add(tags[:, None], idx[None, :], out=view)

    def check_destinations(self, arrays):
        """Every destination page of every request holds its pattern; every other page
        holds the poison. Returns (page slices checked, list of first mismatches)."""
        words = self.page // 8
        idx = np.arange(words, dtype=np.uint64)
        poison = np.frombuffer(bytes([POISON]) * 8, dtype=np.uint64)[0]
        used = np.zeros(self.page_count, dtype=bool)
        used[self.dst.reshape(-1)] = True
        where = {int(p): (r, o) for (r, o), p in np.ndenumerate(self.dst)}
        checked, bad = 0, []
        chunk = max(1, (8 << 20) // self.page)
        for b, arr in enumerate(arrays):
            view = arr.view(np.uint64).reshape(self.page_count, words)
            tags = self._tags("dst", b)
            for lo in range(0, self.page_count, chunk):
                hi = min(lo + chunk, self.page_count)
                expect = tags[lo:hi, None] + idx[None, :]
                expect[~used[lo:hi]] = poison
                same = (view[lo:hi] == expect).all(axis=1)
                checked += int(used[lo:hi].sum())
                for k in np.nonzero(~same)[0]:
                    if len(bad) >= 8:
                        break
                    p = lo + int(k)
                    what = "request %d ordinal %d" % where[p] if p in where else "unused page"
                    bad.append(f"buffer {b} page {p} ({what}) differs")
        return checked, bad


def cpu_seconds():
    """User + system CPU-seconds of this process (every thread) so far."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def percentile(sorted_ms, p):
    """kvwire's percentile: the nearest rank, (n - 1) * p rounded."""
    if not sorted_ms:
        return 0.0
    return sorted_ms[int(round((len(sorted_ms) - 1) * p))]


class Channel:
    """A line-of-JSON side channel between the two processes (setup, barrier, results)."""

    def __init__(self, sock):
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = sock.makefile("rwb")

    @staticmethod
    def listen(addr):
        host, port = addr.rsplit(":", 1)
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, int(port)))
        srv.listen(1)
        srv.settimeout(120)
        conn, _ = srv.accept()
        srv.close()
        conn.settimeout(600)
        return Channel(conn)

    @staticmethod
    def connect(addr, timeout=60):
        host, port = addr.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                s.settimeout(600)
                return Channel(s)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def send(self, **msg):
        self.file.write(json.dumps(msg).encode() + b"\n")
        self.file.flush()

    def recv(self, expect=None):
        line = self.file.readline()
        if not line:
            raise SystemExit("side channel: the peer process went away")
        msg = json.loads(line)
        if msg.get("error"):
            raise SystemExit(f"peer process failed: {msg['error']}")
        if expect is not None and msg.get("op") != expect:
            raise SystemExit(f"side channel: expected {expect!r}, got {msg!r}")
        return msg


def alloc(workload, fill):
    """The engine's KV memory: `buffers` numpy buffers, each starting `buffer_offset` bytes past
    a 4 KiB boundary (0: on one, as the memory `kvwire bench` allocates does; a plain `np.empty`
    of this size starts 16 bytes into a page, and where a buffer starts changes how fast the
    kernel's socket copies run on some CPUs: docs/BENCHMARKS.md, "Which offsets are slow"),
    every byte written once now (so no page is first touched inside the timed window)."""
    arrays = []
    for _ in range(workload.buffers):
        backing = np.empty(workload.buffer_bytes + PAGE_ALIGN, dtype=np.uint8)
        start = (workload.buffer_offset - backing.ctypes.data) % PAGE_ALIGN
        a = backing[start : start + workload.buffer_bytes]
        assert a.ctypes.data % PAGE_ALIGN == workload.buffer_offset
        a.fill(fill)
        arrays.append(a)
    return arrays


def add_args(p):
    p.add_argument("--role", choices=["target", "initiator"], required=True)
    p.add_argument("--side", default="127.0.0.1:7420", help="side channel address")
    p.add_argument("--memory", default="1G")
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--page-size", default="64K")
    p.add_argument("--pages", type=int, default=32)
    p.add_argument("--bytes", default="1G")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--buffer-offset", type=int, default=0,
                   help="every KV buffer starts this many bytes past a 4 KiB boundary (0-4095)")


def workload_from(args):
    return Workload(
        parse_size(args.memory),
        args.buffers,
        parse_size(args.page_size),
        args.pages,
        parse_size(args.bytes),
        args.concurrency,
        args.buffer_offset,
    )


def check_landed(wl, dst_arrays):
    """The byte check (outside the timed window): (page slices checked, mismatches, ok)."""
    if os.environ.get("PEERS_CORRUPT_ONE_BYTE") == "1":
        # Self-test of the check: one byte of one landed page changed; the run must fail.
        p = int(wl.dst[wl.requests // 2, wl.pages // 2])
        dst_arrays[-1][p * wl.page + wl.page // 2] ^= 0x01
    checked, bad = wl.check_destinations(dst_arrays)
    return checked, bad, not bad and checked == wl.requests * wl.pages * wl.buffers


def target_finish(ch, wl, dst_arrays, engine, during=None):
    """The target's timed window and check: start on the initiator's word, run `during()`
    (e.g. wait for the requests' notifications), stop on the initiator's word; then,
    outside the window, check every destination page and report."""
    ch.recv("start")
    c0 = cpu_seconds()
    ch.send(op="started")
    extra = during() if during is not None else None
    ch.recv("stop")
    c1 = cpu_seconds()
    checked, bad, ok = check_landed(wl, dst_arrays)
    ch.send(
        op="result",
        cpu_seconds=c1 - c0,
        slices_checked=checked,
        bytes_ok=ok,
        bad=bad,
        **(extra or {}),
    )
    if not ok:
        print(f"{engine} target: BYTE CHECK FAILED: {bad}", file=sys.stderr)
        sys.exit(1)


def initiator_run(ch, wl, engine, post, wait, version):
    """The initiator's timed window: `post(r)` starts request r and returns a handle;
    `wait(handles)` blocks until at least one of the handles (oldest first) is complete and
    returns the positions of the complete ones (it raises if a transfer failed). Keeps
    `wl.concurrency` requests in flight; a request's latency runs from its post to the
    moment its completion was seen, or, where the target reports when each request arrived
    (`arrivals`: NIXL's notifications), to that arrival (time.perf_counter is CLOCK_MONOTONIC,
    one clock for both processes), and the window then ends at the last arrival. Then asks
    the target to check and prints one JSON line."""
    ch.send(op="start")
    ch.recv("started")
    lat = []
    c0, t0 = cpu_seconds(), time.perf_counter()
    inflight = []  # (handle, posted at)
    posted = []
    nxt = 0
    while nxt < wl.requests or inflight:
        while nxt < wl.requests and len(inflight) < wl.concurrency:
            posted.append(time.perf_counter())
            inflight.append((post(nxt), posted[-1]))
            nxt += 1
        done = set(wait([h for h, _ in inflight]))
        now = time.perf_counter()
        lat.extend((now - t) * 1e3 for i, (_, t) in enumerate(inflight) if i in done)
        inflight = [x for i, x in enumerate(inflight) if i not in done]
    t1, c1 = time.perf_counter(), cpu_seconds()
    ch.send(op="stop", requests=wl.requests)
    res = ch.recv("result")
    completion = "at the initiator (the engine's own completion)"
    if res.get("arrivals"):
        arrivals = dict((int(r), t) for r, t in res["arrivals"])
        if len(arrivals) != wl.requests:
            raise SystemExit(f"{engine}: {len(arrivals)} of {wl.requests} arrivals reported")
        lat = [(arrivals[r] - posted[r]) * 1e3 for r in range(wl.requests)]
        t1 = max(t1, max(arrivals.values()))
        completion = "at the target (arrival of the request's notification)"
    lat.sort()
    seconds = t1 - t0
    cpu = (c1 - c0) + res["cpu_seconds"]
    out = dict(
        engine=engine,
        version=version,
        **wl.describe(),
        seconds=seconds,
        gb_per_s=wl.bytes / seconds / 1e9,
        p50_ms=percentile(lat, 0.50),
        p99_ms=percentile(lat, 0.99),
        cpu_seconds_initiator=c1 - c0,
        cpu_seconds_target=res["cpu_seconds"],
        cpu_s_per_gb=cpu / (wl.bytes / 1e9),
        completion=completion,
        slices_checked=res["slices_checked"],
        bytes_ok=res["bytes_ok"],
        verifies="nothing (no digests; the harness compared every byte after the run)",
    )
    print(json.dumps(out), flush=True)
    if not res["bytes_ok"]:
        print(f"{engine}: BYTE CHECK FAILED at the target: {res['bad']}", file=sys.stderr)
        sys.exit(1)
