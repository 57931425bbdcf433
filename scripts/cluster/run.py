"""A disaggregated cluster under chaos, on one machine: P prefill and D decode kvwire engines
(scripts/cluster/node.py, each its own process, through the Python package), a real etcd for
discovery, a router pairing each request with a prefill and a decode by bootstrap room (as
SGLang's router does), a workload whose bytes are known, a nemesis on a seeded schedule, and a
checker over the whole history. Exits non-zero on any violation; writes a JSON report.

    python scripts/cluster/run.py --seed 1 --seconds 60 [--prefills 3 --decodes 3] [--report F]

The workload: prompts from 1 token to the decode's context, some over a decode's context (the
seed incident: they must never reach a transfer), a few over the prefill's too; chunked sends
with aux records; user cancels on either side; requests to a prefill or a decode that is down.
The nemesis: kill -9 of a node and its restart under the same rank, SIGSTOP/SIGCONT of a node,
a proxy in front of a prefill flipping bits or cutting connections, etcd stopped; with each node
in a network namespace of its own (scripts/cluster/net.py; root): a node's link down and up, a
share of its packets dropped one way, its CPU capped at 5 %. The checker:
  - no request is delivered with a byte or an aux record other than its own;
  - every request ends, on each live side, verified or failed with a typed code, within a bound;
  - a request over the decode's context never reaches a transfer (its prefill sends no page);
  - a request is verified on the prefill only if its decode verified it (when the decode lived);
  - at quiesce every node holds no page (leased or quarantined).
A failing seed replays the same schedule (timing on a loaded host may still differ). Writes a JSON
report and an SVG timeline (throughput, failures by code, faults) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python", "tests"))
from ports import free_port  # noqa: E402

import kvwire  # noqa: E402
from net import Net  # noqa: E402
import timeline  # noqa: E402

PAGE_SIZE = 16  # tokens per page (python/tests/common.py)


class Proc:
    """A node process: its commands in, its events out (JSON lines)."""

    def __init__(self, role: str, rank: int, argv: List[str]) -> None:
        self.role, self.rank, self.argv = role, rank, argv
        self.stopped = False
        self.start()

    def start(self) -> None:
        self.p = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, bufsize=0)
        self.buf = b""
        self.ready: Optional[Dict[str, Any]] = None
        self.stopped = False
        self.started = time.monotonic()

    @property
    def name(self) -> str:
        return f"{self.role}{self.rank}"

    def alive(self) -> bool:
        return self.p.poll() is None

    def send(self, **cmd: Any) -> bool:
        if not self.alive() or self.ready is None:
            return False
        try:
            self.p.stdin.write((json.dumps(cmd) + "\n").encode())
            return True
        except (BrokenPipeError, OSError):
            return False

    def events(self) -> List[Dict[str, Any]]:
        evs = []
        try:
            chunk = os.read(self.p.stdout.fileno(), 1 << 16)
        except OSError:
            chunk = b""
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                evs.append(json.loads(line))
        return evs

    def kill(self) -> None:
        if self.alive():
            self.p.send_signal(signal.SIGKILL)
            self.p.wait()


def start_etcd(tmp: str, host: str) -> Tuple[subprocess.Popen, str]:
    binary = shutil.which("etcd")
    if binary is None:
        sys.exit("cluster: etcd is not installed (apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    endpoint = f"http://{host}:{client}"
    listen = endpoint if host == "127.0.0.1" else f"http://127.0.0.1:{client},{endpoint}"
    proc = subprocess.Popen(
        [binary, "--data-dir", os.path.join(tmp, "etcd"), "--listen-client-urls", listen,
         "--advertise-client-urls", endpoint, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer}",
         "--heartbeat-interval", "10", "--election-timeout", "100"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", client), timeout=0.5):
                return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("cluster: etcd did not start")
            time.sleep(0.1)


class Proxy:
    """A TCP proxy in front of one prefill: the address it registers in etcd, so every decode
    reaches it through here. Normally it passes bytes; the nemesis makes it flip a byte in the
    prefill-to-decode direction now and then, or cut connections after some bytes."""

    def __init__(self, target: str, host: str) -> None:
        self.target = target
        self.mode = "pass"
        self.rng = random.Random(0)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, free_port()))
        self.sock.listen(64)
        self.address = "%s:%d" % self.sock.getsockname()
        self.flipped = 0
        self.cut = 0
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            host, port = self.target.rsplit(":", 1)
            try:
                server = socket.create_connection((host, int(port)), timeout=2)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for a, b, down in ((client, server, False), (server, client, True)):
                threading.Thread(target=self.pump, args=(a, b, down), daemon=True).start()

    def pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                mode = self.mode
                if down and mode == "flip" and self.rng.random() < 0.2:
                    i = self.rng.randrange(len(data))
                    data = data[:i] + bytes([data[i] ^ (1 << self.rng.randrange(8))]) + data[i + 1:]
                    self.flipped += 1
                if down and mode == "cut" and sent > 0 and self.rng.random() < 0.3:
                    self.cut += 1
                    data = data[: self.rng.randrange(len(data))]
                    dst.sendall(data)
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s_ in (src, dst):
            try:
                s_.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s_.close()


class Request:
    def __init__(self, room: int, prefill: int, decode: int, tokens: int, chunks: List[int],
                 cancel: Optional[Tuple[str, float]], over_context: bool) -> None:
        self.room, self.prefill, self.decode, self.tokens = room, prefill, decode, tokens
        self.pages = -(-tokens // PAGE_SIZE)
        self.chunks, self.cancel, self.over_context = chunks, cancel, over_context
        self.sent_at = 0.0
        self.ends: Dict[str, Dict[str, Any]] = {}
        self.lost: set = set()  # sides whose node died (or stopped) while it was open
        self.cancelled_at: Dict[str, float] = {}

    def open_sides(self) -> List[str]:
        return [s for s in ("prefill", "decode") if s not in self.ends and s not in self.lost]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--prefills", type=int, default=3)
    ap.add_argument("--decodes", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=24)
    ap.add_argument("--fault-every", type=float, default=4.0, help="mean seconds between faults")
    ap.add_argument("--bound", type=float, default=30.0, help="seconds a request may stay open")
    ap.add_argument("--netns", choices=["auto", "on", "off"], default="auto",
                    help="each node in a network namespace of its own (root); auto: where the machine can; "
                         "KVWIRE_REQUIRE_NETNS=1 makes a machine that cannot fail")
    ap.add_argument("--report", default="target/cluster/report.json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    why_not = Net.unavailable() if a.netns != "off" else "--netns off"
    if why_not is not None and (a.netns == "on" or os.environ.get("KVWIRE_REQUIRE_NETNS") == "1"):
        sys.exit(f"cluster: network namespaces required but unavailable: {why_not}")
    if why_not is not None:
        print(f"cluster: nodes share the host's network (no link, loss or CPU faults): {why_not}", file=sys.stderr)
    net = Net(a.prefills + a.decodes) if why_not is None else None
    if net is not None:
        net.up()
    host = net.gateway if net else "127.0.0.1"
    tmp = tempfile.mkdtemp(prefix="kvwire-cluster-")
    etcd, endpoint = start_etcd(tmp, host)
    psk = kvwire.gen_psk().hex()
    cluster = f"chaos{a.seed}"
    # Decodes serve a shorter context than prefills, and shorter than their pool holds: prompts
    # between the two are the incident's case, accepted by the prefill, refused by the decode,
    # though its pool could hold them.
    prefill_pages, decode_pages = 256, 192
    decode_context, prefill_context = 128 * PAGE_SIZE, prefill_pages * PAGE_SIZE

    # Each prefill listens on a port of its own (kept across restarts) behind a proxy.
    listen = {i: f"{net.address(i) if net else '127.0.0.1'}:{free_port()}" for i in range(a.prefills)}
    proxies = {i: Proxy(listen[i], host) for i in range(a.prefills)}

    def index(role: str, rank: int) -> int:
        """The node's place among all nodes: its namespace and address."""
        return rank if role == "prefill" else a.prefills + rank

    def argv(role: str, rank: int) -> List[str]:
        v = [sys.executable, os.path.join(HERE, "node.py"), role, "--rank", str(rank),
             "--etcd", endpoint, "--cluster", cluster, "--psk", psk,
             "--pages", str(prefill_pages if role == "prefill" else decode_pages)]
        if role == "decode":
            v += ["--context", str(decode_context)]
        if role == "prefill":
            v += ["--listen", listen[rank], "--advertise", proxies[rank].address]
        return net.wrap(index(role, rank), v) if net else v

    nodes = {("prefill", i): Proc("prefill", i, argv("prefill", i)) for i in range(a.prefills)}
    nodes.update({("decode", i): Proc("decode", i, argv("decode", i)) for i in range(a.decodes)})
    requests: Dict[int, Request] = {}
    # The requests with a side still open: what the loop looks at each turn (the whole history
    # grows to hundreds of thousands in an hour; scanning it every turn slowed the router).
    live: Dict[int, Request] = {}
    violations: List[str] = []
    faults: List[Dict[str, Any]] = []
    counts = {"no_pages": 0}
    slow: List[Dict[str, Any]] = []
    t0 = time.monotonic()
    next_fault = t0 + 3.0 + rng.expovariate(1 / a.fault_every)
    pending_restart: List[Tuple[float, Proc]] = []
    pending_cont: List[Tuple[float, Proc]] = []
    room = 1000
    stop_at = t0 + a.seconds

    def violate(msg: str) -> None:
        violations.append(f"{time.monotonic() - t0:7.2f}s {msg}")

    def on_event(node: Proc, ev: Dict[str, Any]) -> None:
        if ev["ev"] == "ready":
            node.ready = ev
            return
        if ev["ev"] == "slow":
            slow.append({"at": round(time.monotonic() - t0, 2), "node": node.name, "call": ev["what"], "s": ev["s"]})
            return
        if ev["ev"] != "end":
            return
        r = requests.get(ev["room"])
        if r is None:
            return
        side = ev["role"]
        ev["at"] = time.monotonic() - t0
        r.ends[side] = ev
        if ev["state"] == "no_pages":
            # The engine could not schedule it (its pool is full): it gives the request up,
            # and the router cancels the other side.
            counts["no_pages"] += 1
            other = "decode" if side == "prefill" else "prefill"
            if other in r.open_sides():
                nodes[(other, r.prefill if other == "prefill" else r.decode)].send(op="cancel", room=r.room)
                r.cancelled_at[other] = time.monotonic()
        if ev["state"] == "verified" and side == "decode" and ev.get("bad"):
            violate(f"room {r.room}: decode {r.decode} verified wrong bytes: {ev['bad'][:3]}")
        if r.over_context and ev["state"] == "verified":
            violate(f"room {r.room}: {r.tokens} tokens over the decode's context verified on the {side}")
        if r.over_context and side == "prefill" and ev.get("sent_pages", 0) > 0:
            violate(f"room {r.room}: {r.tokens} tokens over the decode's context: the prefill sent {ev['sent_pages']} pages")
        if ev["state"] == "failed" and not ev.get("code"):
            violate(f"room {r.room}: the {side} failed without a typed code")

    def pump(timeout: float) -> None:
        procs = [n for n in nodes.values() if n.alive()]
        ready, _, _ = select.select([n.p.stdout for n in procs], [], [], timeout)
        for n in procs:
            if n.p.stdout in ready:
                for ev in n.events():
                    on_event(n, ev)

    def node_down(n: Proc) -> None:
        side = n.role
        for r in live.values():
            if side not in r.ends and (r.prefill if side == "prefill" else r.decode) == n.rank:
                r.lost.add(side)

    pending_heal: List[Tuple[float, Any]] = []
    etcd_state = {"proc": etcd}

    net_faulted: set = set()  # nodes under a link, loss or CPU fault now

    # Faults come in rounds, each kind once per round (kill twice) in a seeded order, so that
    # a short run sees every kind; a fault that cannot be injected now is tried again next.
    round_of_kinds: List[str] = []

    def fault(now: float) -> None:
        if not round_of_kinds:
            round_of_kinds.extend(["kill", "kill", "stop", "flip", "cut", "etcd"] + (["link", "loss", "starve"] if net else []))
            rng.shuffle(round_of_kinds)
        kind = round_of_kinds.pop(0)
        if not inject(now, kind):
            round_of_kinds.insert(0, kind)

    def inject(now: float, kind: str) -> bool:
        if kind in ("flip", "cut"):
            rank = rng.randrange(a.prefills)
            if proxies[rank].mode != "pass":
                return False
            d = rng.uniform(0.5, 2.0)
            faults.append({"at": round(now - t0, 2), "until": round(now + d - t0, 2), "kind": kind,
                           "node": f"prefill{rank}"})
            proxies[rank].mode = kind
            pending_heal.append((now + d, proxies[rank]))
            return True
        if kind == "etcd":
            if etcd_state["proc"] is None:
                return False
            # Discovery goes away for a while (its data stays): resolving fails typed, the
            # connections already up keep serving, registrations come back after it.
            d = rng.uniform(1.0, 3.0)
            faults.append({"at": round(now - t0, 2), "until": round(now + d - t0, 2), "kind": kind, "node": "etcd"})
            etcd_state["proc"].send_signal(signal.SIGSTOP)
            pending_heal.append((now + d, "etcd"))
            etcd_state["proc"] = None
            return True
        victim = nodes[rng.choice(sorted(nodes))]
        if not victim.alive() or victim.ready is None or victim.stopped or victim.name in net_faulted:
            return False
        f = {"at": round(now - t0, 2), "kind": kind, "node": victim.name}
        faults.append(f)
        i = index(victim.role, victim.rank)
        if kind in ("link", "loss", "starve"):
            assert net is not None
            if kind == "link":
                net.link(i, up=False)
                heal = ("link", i)
                until = rng.uniform(0.5, 3.0)
            elif kind == "loss":
                f["direction"], f["share"] = rng.choice(["in", "out"]), round(rng.uniform(0.1, 0.5), 2)
                net.loss(i, f["direction"], f["share"])
                heal = ("loss", i)
                until = rng.uniform(1.0, 4.0)
            else:
                net.starve(i, victim.p.pid, 0.05)
                heal = ("starve", i)
                until = rng.uniform(1.0, 4.0)
            net_faulted.add(victim.name)
            pending_heal.append((now + until, (heal, victim.name, f)))
            return True
        if kind == "kill":
            victim.kill()
            node_down(victim)
            d = rng.uniform(0.5, 2.0)
            pending_restart.append((now + d, victim))
        else:
            # Its requests stay open in the stopped process and must end once it runs again.
            victim.p.send_signal(signal.SIGSTOP)
            victim.stopped = True
            d = rng.uniform(0.5, 3.0)
            pending_cont.append((now + d, victim))
        f["until"] = round(now + d - t0, 2)
        return True

    try:
        while any(n.ready is None for n in nodes.values()):
            pump(1.0)
            if time.monotonic() - t0 > 60:
                sys.exit("cluster: nodes did not start")
        t0 = time.monotonic()
        stop_at = t0 + a.seconds
        next_fault = t0 + 3.0 + rng.expovariate(1 / a.fault_every)
        while True:
            now = time.monotonic()
            for when, n in list(pending_restart):
                if now >= when:
                    pending_restart.remove((when, n))
                    n.start()
            for when, what in list(pending_heal):
                if now >= when:
                    pending_heal.remove((when, what))
                    if what == "etcd":
                        etcd.send_signal(signal.SIGCONT)
                        etcd_state["proc"] = etcd
                    elif isinstance(what, tuple):
                        (kind, i), name, f = what
                        if kind == "link":
                            net.link(i, up=True)
                        elif kind == "loss":
                            net.loss(i, "out", None)
                        else:
                            net.starve(i, 0, None)
                        f["until"] = round(now - t0, 2)
                        net_faulted.discard(name)
                    else:
                        what.mode = "pass"
            for when, n in list(pending_cont):
                if now >= when:
                    pending_cont.remove((when, n))
                    n.p.send_signal(signal.SIGCONT)
                    n.stopped = False
            if now < stop_at and now >= next_fault:
                fault(now)
                next_fault = now + rng.expovariate(1 / a.fault_every)
            for done in [k for k, r in live.items() if not r.open_sides()]:
                del live[done]
            open_now = list(live.values())
            if now < stop_at:
                while len(open_now) < a.in_flight:
                    room += 1
                    shape = rng.random()
                    if shape < 0.08:
                        tokens = rng.randint(decode_context + 1, decode_pages * PAGE_SIZE)
                    elif shape < 0.09:
                        tokens = rng.randint(decode_pages * PAGE_SIZE + 1, prefill_context)
                    elif shape < 0.10:
                        tokens = rng.randint(prefill_context + 1, prefill_context + 512)
                    elif shape < 0.15:
                        tokens = 1
                    else:
                        tokens = rng.randint(2, decode_context // 4)
                    pages = -(-tokens // PAGE_SIZE)
                    if pages > decode_pages:
                        # Over the decode's pool too: never allocated for real (the decode
                        # refuses it before reserving); a few pages keep the pools free.
                        pages = min(pages, 8)
                    parts = rng.randint(1, min(3, pages))
                    cuts = sorted(rng.sample(range(1, pages), parts - 1)) if parts > 1 else []
                    chunks = [b - a_ for a_, b in zip([0] + cuts, cuts + [pages])]
                    cancel = None
                    if rng.random() < 0.05:
                        cancel = (rng.choice(["prefill", "decode"]), rng.uniform(0.0, 0.3))
                    r = Request(room, rng.randrange(a.prefills), rng.randrange(a.decodes), tokens,
                                chunks, cancel, over_context=tokens > decode_context)
                    r.sent_at = now
                    requests[room] = r
                    live[room] = r
                    p, d = nodes[("prefill", r.prefill)], nodes[("decode", r.decode)]
                    order = [(d, "recv"), (p, "send")] if rng.random() < 0.5 else [(p, "send"), (d, "recv")]
                    for n, op in order:
                        ok = n.send(op=op, room=room, tokens=tokens, pages=pages, chunks=chunks,
                                    prefill_rank=r.prefill)
                        if not ok:  # down (a stopped node reads it once it runs again)
                            r.lost.add(n.role)
                    if len(r.lost) == 1:
                        # The router saw the request fail on a node that is down: it cancels the
                        # other side at once, as it does when a node cannot schedule it.
                        other = "prefill" if "decode" in r.lost else "decode"
                        nodes[(other, r.prefill if other == "prefill" else r.decode)].send(op="cancel", room=room)
                        r.cancelled_at[other] = now
                    open_now.append(r)
            for r in list(live.values()):
                if not r.open_sides():
                    continue
                age = now - r.sent_at
                if r.cancel and r.cancel[0] not in r.cancelled_at and age >= r.cancel[1]:
                    side = r.cancel[0]
                    nodes[(side, r.prefill if side == "prefill" else r.decode)].send(op="cancel", room=r.room)
                    r.cancelled_at[side] = now
                # The engine's own timeout (SGLang's bootstrap timeout): a request still open
                # after 15 s is cancelled on each side still open; it must end then.
                if age >= 15.0:
                    for side in r.open_sides():
                        if side not in r.cancelled_at:
                            nodes[(side, r.prefill if side == "prefill" else r.decode)].send(op="cancel", room=r.room)
                            r.cancelled_at[side] = now
                if age >= a.bound:
                    for side in r.open_sides():
                        n = nodes[(side, r.prefill if side == "prefill" else r.decode)]
                        violate(f"room {r.room}: the {side} ({n.name}, alive {n.alive()}, stopped {n.stopped}) "
                                f"still open after {a.bound:.0f} s (cancelled: {sorted(r.cancelled_at)}, "
                                f"ended: {sorted(r.ends)})")
                        r.lost.add(side)  # reported once
            if now >= stop_at and not pending_restart and not pending_cont and not pending_heal and not any(r.open_sides() for r in live.values()):
                break
            pump(0.01)
        # Quiesce: every node holds no page.
        time.sleep(1.0)
        for n in nodes.values():
            n.send(op="state")
        deadline = time.monotonic() + 20
        states: Dict[str, Dict[str, Any]] = {}
        while len(states) < len(nodes) and time.monotonic() < deadline:
            procs = [n for n in nodes.values() if n.alive()]
            ready, _, _ = select.select([n.p.stdout for n in procs], [], [], 0.5)
            for n in procs:
                if n.p.stdout in ready:
                    for ev in n.events():
                        if ev["ev"] == "state":
                            states[n.name] = ev
                        else:
                            on_event(n, ev)
        for n in nodes.values():
            s = states.get(n.name)
            if s is None:
                violate(f"{n.name}: no state at quiesce")
            elif s["held"] or s["live"] or s["returning"]:
                violate(f"{n.name}: at quiesce holds {s['held']} pages, {s['live']} requests open, {s['returning']} pages not back")
        # A prefill's success is the decode's verdict: never without the decode's own.
        for r in requests.values():
            p, d = r.ends.get("prefill"), r.ends.get("decode")
            # An abort on the decode that crossed the verdict on its way (the harness
            # cancelled it) ends CANCELLED there while the prefill verified (kvwire's
            # ReceiverTransfer::abort says so); any other difference is a violation.
            crossed = d and d.get("code") == "CANCELLED" and "decode" in r.cancelled_at
            if p and p["state"] == "verified" and crossed:
                counts["crossed"] = counts.get("crossed", 0) + 1
            if p and p["state"] == "verified" and d and d["state"] != "verified" and not crossed:
                violate(f"room {r.room}: verified on the prefill, {d['state']} ({d.get('code')}) on the decode")
    finally:
        for n in nodes.values():
            if n.alive():
                if n.stopped:
                    n.p.send_signal(signal.SIGCONT)
                n.send(op="exit")
        time.sleep(0.5)
        for n in nodes.values():
            n.kill()
        etcd.send_signal(signal.SIGCONT)
        etcd.kill()
        etcd.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        if net is not None:
            net.down()

    # Recovery: from each fault's end (the restart, SIGCONT, the link up, ...) to the first
    # request through that node (any node, after etcd) sent after it and verified.
    # Verified requests by node, in the order sent, with the earliest verdict from each on.
    import bisect
    by_node: Dict[Any, List[Tuple[float, float]]] = {}
    for r in requests.values():
        d = r.ends.get("decode", {})
        if d.get("state") == "verified":
            for key in (("prefill", r.prefill), ("decode", r.decode), None):
                by_node.setdefault(key, []).append((r.sent_at - t0, d["at"]))
    suffix_min: Dict[Any, Tuple[List[float], List[float]]] = {}
    for key, xs in by_node.items():
        xs.sort()
        mins = [0.0] * len(xs)
        low = float("inf")
        for i in range(len(xs) - 1, -1, -1):
            low = min(low, xs[i][1])
            mins[i] = low
        suffix_min[key] = ([x[0] for x in xs], mins)
    for f in faults:
        key = None
        if f["node"] != "etcd":
            role, rank = f["node"].rstrip("0123456789"), int(f["node"].lstrip("prefilldecode"))
            key = (role, rank)
        sent, mins = suffix_min.get(key, ([], []))
        i = bisect.bisect_left(sent, f["until"])
        f["recovered_s"] = round(mins[i] - f["until"], 2) if i < len(sent) else None
    rec = sorted(f["recovered_s"] for f in faults if f["recovered_s"] is not None)
    # A fault that ended within 5 s of the workload's end may see no request after it.
    never = [f for f in faults if f["recovered_s"] is None and f["until"] < a.seconds - 5]

    def pct(q: float) -> Optional[float]:
        return rec[min(len(rec) - 1, int(q * len(rec)))] if rec else None

    # A slow call that overlaps a fault of its own node (stopped, CPU capped, link down) is
    # that fault's doing, not kvwire's: said so in the report.
    for c in slow:
        began = c["at"] - c["s"]
        c["during"] = sorted({f["kind"] for f in faults
                              if f["node"] == c["node"] and f["kind"] in ("stop", "starve", "link", "loss")
                              and f["at"] <= c["at"] and f.get("until", f["at"]) >= began})
    ends = [e for r in requests.values() for e in r.ends.values()]
    by_code: Dict[str, int] = {}
    for e in ends:
        if e["state"] == "failed":
            by_code[e["code"]] = by_code.get(e["code"], 0) + 1
    verified = sum(1 for r in requests.values() if r.ends.get("decode", {}).get("state") == "verified")
    report = {
        "seed": a.seed, "seconds": a.seconds, "prefills": a.prefills, "decodes": a.decodes,
        "requests": len(requests), "verified": verified,
        "over_context": sum(1 for r in requests.values() if r.over_context),
        "no_pages": counts["no_pages"], "aborts_crossing_verdict": counts.get("crossed", 0),
        "failures_by_code": dict(sorted(by_code.items())),
        "faults": faults,
        "netns": net is not None,
        "faults_by_kind": {k: sum(1 for f in faults if f["kind"] == k)
                           for k in ("kill", "stop", "flip", "cut", "etcd", "link", "loss", "starve")},
        "bytes_flipped": sum(p.flipped for p in proxies.values()),
        "connections_cut": sum(p.cut for p in proxies.values()),
        "recovery_s": {"p50": pct(0.5), "p99": pct(0.99),
                       "never": len(never)},
        "slow_calls": slow,
        "slow_calls_outside_own_faults": sum(1 for c in slow if not c["during"]),
        "violations": violations,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.report)), exist_ok=True)
    with open(a.report, "w") as f:
        json.dump(report, f, indent=1)
    svg = os.path.splitext(a.report)[0] + ".svg"
    with open(svg, "w") as f:
        f.write(timeline.svg(report, [(side, e) for r in requests.values() for side, e in r.ends.items()]))
    print(json.dumps({k: v for k, v in report.items() if k not in ("faults",)}, indent=1))
    if violations:
        print(f"cluster: {len(violations)} violations (seed {a.seed})", file=sys.stderr)
        sys.exit(1)
    print(f"cluster: no violations ({len(requests)} requests, {len(faults)} faults, seed {a.seed})")


if __name__ == "__main__":
    main()
