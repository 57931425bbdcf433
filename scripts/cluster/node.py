"""One engine of the chaos cluster (scripts/cluster/run.py): a prefill or decode kvwire node in its
own process, registered in etcd under its rank, serving many requests at once from one poll loop
the way an engine's scheduler does. The harness sends JSON commands on stdin; the node answers
with JSON events on stdout, one per line.

The node owns its KV memory and its page allocator, as an engine does: a page goes back to the
allocator only once the request is over and kvwire holds it no more. A decode checks every byte
of every page of a verified request and its aux record against the truth (the bytes are derived
from request, ordinal and buffer), and reports what differs.

    node.py prefill|decode --rank R --etcd URL --cluster C --psk HEX [--pages N]
            [--listen ADDR --advertise ADDR]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python", "tests"))

from kvwire import KVPoll, KVReceiver, KVSender  # noqa: E402

import kvwire  # noqa: E402
import common  # noqa: E402  (the byte pattern, the aux record, the buffers)

AUX_SLOTS = 128


def out(**kw: Any) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def code_of(t: Any) -> Optional[str]:
    e = t.error
    return None if e is None else (e.code_name or type(e).__name__)


class Node:
    def __init__(self, a: argparse.Namespace) -> None:
        self.role = a.role
        self.mgr, self.kv, self.aux = common.manager(
            a.role, bytes.fromhex(a.psk), pages=a.pages, aux_slots=AUX_SLOTS,
            etcd_endpoints=[a.etcd], cluster=a.cluster,
            max_context_tokens=a.context, liveness_timeout_s=a.liveness, reservation_wait_s=a.wait, parked_reservation_s=a.wait,
            **({"listen": a.listen} if a.role == "prefill" else {}),
        )
        if a.role == "prefill":  # decodes dial their prefills (resolved by rank); none dials a decode
            # Published at `--advertise` (the harness's proxy in front of it) if given.
            self.mgr.register(a.rank, ttl_s=a.ttl, address=a.advertise)
        self.free_pages: List[int] = list(range(a.pages))
        self.free_slots: List[int] = list(range(AUX_SLOTS))
        # Pages and slots of ended requests, back to the allocator once kvwire holds none.
        self.returning: List[int] = []
        self.returning_slots: List[int] = []
        self.live: Dict[int, Dict[str, Any]] = {}

    # -- the engine's allocator ---------------------------------------------------------
    def take(self, n: int) -> Optional[List[int]]:
        if n > len(self.free_pages) or not self.free_slots:
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages

    def give_back(self, r: Dict[str, Any]) -> None:
        self.returning.extend(r["pages"])
        if r.get("slot") is not None:
            self.returning_slots.append(r["slot"])

    def reclaim(self) -> None:
        if not self.returning:
            self.free_slots.extend(self.returning_slots)
            self.returning_slots = []
            return
        held = set(self.mgr.held_pages())
        keep = [p for p in self.returning if p in held]
        self.free_pages.extend(p for p in self.returning if p not in held)
        self.returning = keep
        if not keep:
            self.free_slots.extend(self.returning_slots)
            self.returning_slots = []

    # -- commands -------------------------------------------------------------------------
    def command(self, cmd: Dict[str, Any]) -> bool:
        op = cmd["op"]
        if op == "exit":
            return False
        if op == "state":
            self.reclaim()
            out(ev="state", held=len(self.mgr.held_pages()), live=len(self.live),
                free=len(self.free_pages), returning=len(self.returning))
            return True
        room = cmd["room"]
        if op == "cancel":
            r = self.live.get(room)
            if r is not None:
                r["t"].abort()
                r["cancelled"] = True
            return True
        pages = self.take(cmd["pages"])
        if pages is None:
            out(ev="end", room=room, role=self.role, state="no_pages")
            return True
        slot = self.free_slots.pop()
        r: Dict[str, Any] = {"pages": pages, "slot": slot, "tokens": cmd["tokens"], "sent": 0,
                             "chunks": cmd.get("chunks") or [len(pages)], "started": time.monotonic()}
        if op == "recv":
            r["t"] = KVReceiver(self.mgr, None, room, prefill_rank=cmd["prefill_rank"])
            r["t"].send_metadata(pages, aux_index=slot, num_tokens=cmd["tokens"])
        elif op == "send":
            common.fill_source(self.kv, self.aux, room, pages, slot)
            r["t"] = KVSender(self.mgr, None, room)
            r["init"] = False
        self.live[room] = r
        return True

    # -- the scheduler loop -----------------------------------------------------------------
    def step(self) -> None:
        for room in list(self.live):
            r = self.live[room]
            t = r["t"]
            state = t.poll()
            if self.role == "prefill" and state == KVPoll.WaitingForInput:
                began = time.monotonic()
                if not r["init"]:
                    t.init(len(r["pages"]), r["slot"], r["tokens"])
                    r["init"] = True
                    r["next"] = 0
                    slow(began, "init")
                # One chunk per loop turn: chunked prefill computes them one after another.
                if r["next"] < len(r["chunks"]) and t.poll() == KVPoll.WaitingForInput:
                    n = r["chunks"][r["next"]]
                    began = time.monotonic()
                    try:
                        t.send(r["pages"][r["sent"]:r["sent"] + n])
                    except kvwire.TransferError:
                        pass  # the transfer failed: its poll says so, typed
                    slow(began, "send")
                    r["sent"] += n
                    r["next"] += 1
                continue
            if state not in (KVPoll.Success, KVPoll.Failed):
                continue
            del self.live[room]
            ev: Dict[str, Any] = {"ev": "end", "room": room, "role": self.role,
                                  "state": "verified" if state == KVPoll.Success else "failed",
                                  "code": code_of(t), "ms": round((time.monotonic() - r["started"]) * 1000, 1),
                                  "cancelled": r.get("cancelled", False)}
            if self.role == "prefill":
                ev["sent_pages"] = r["sent"]
            elif state == KVPoll.Success:
                # What the engine would decode from: every byte, and the aux record.
                ev["bad"] = common.check_landed(self.kv, self.aux, room, r["pages"], r["slot"])
            out(**ev)
            self.give_back(r)
        self.reclaim()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--psk", required=True)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--ttl", type=float, default=2.0)
    ap.add_argument("--liveness", type=float, default=2.0)
    ap.add_argument("--wait", type=float, default=10.0)
    ap.add_argument("--context", type=int, help="tokens served (default: what the pool holds)")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--advertise")
    a = ap.parse_args()
    node = Node(a)
    out(ev="ready", role=a.role, rank=a.rank, address=node.mgr.address, node_id=node.mgr.node_id,
        context=a.context or a.pages * common.PAGE_SIZE)
    buf = ""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.002)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 1 << 16).decode()
            if not chunk:
                break
            buf += chunk
            while "\n" in buf:
                line, buf = buf.split("\n", 1)
                cmd = json.loads(line) if line.strip() else None
                began = time.monotonic()
                if cmd is not None and not node.command(cmd):
                    node.mgr.shutdown(10.0)
                    out(ev="bye")
                    return
                slow(began, cmd and cmd["op"])
        began = time.monotonic()
        node.step()
        slow(began, "step")


def slow(began: float, what: Any) -> None:
    """A call into kvwire that held the engine's loop for over 1 s: reported (an engine's
    scheduler must never stall on its transfer layer)."""
    took = time.monotonic() - began
    if took > 1.0:
        out(ev="slow", what=what, s=round(took, 2))


if __name__ == "__main__":
    main()
