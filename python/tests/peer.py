"""A prefill or decode engine in its own process, for the tests (driven by tests/common.Peer).

    peer.py prefill|decode [--psk HEX] [--pages N] [--fill B] [--bootstrap ADDR --rank R --ttl S]
                           [--etcd URL] [--fingerprint F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import kvwire
from kvwire import KVPoll, KVReceiver, KVSender

import common


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--psk")
    ap.add_argument("--pages", type=int, default=common.PAGES)
    ap.add_argument("--fill", type=int, default=0)
    ap.add_argument("--bootstrap")
    ap.add_argument("--etcd")
    ap.add_argument("--cluster", default="test")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ttl", type=float, default=10.0)
    ap.add_argument("--fingerprint", default="kvwire-python")
    ap.add_argument("--tcp-streams", type=int, default=1)
    ap.add_argument("--ib-queue-pairs", type=int, default=1)
    a = ap.parse_args()
    psk = bytes.fromhex(a.psk) if a.psk else None
    mgr, kv, aux = common.manager(
        a.role, psk, pages=a.pages, fill=a.fill, bootstrap=a.bootstrap,
        etcd_endpoints=[a.etcd] if a.etcd else None, cluster=a.cluster, fingerprint=a.fingerprint,
        tcp_streams=a.tcp_streams, ib_queue_pairs=a.ib_queue_pairs,
        **({"listen": os.environ["KVWIRE_TEST_LISTEN"]} if a.role == "prefill" and os.environ.get("KVWIRE_TEST_LISTEN") else {}),
    )
    if a.bootstrap or a.etcd:
        mgr.register(a.rank, ttl_s=a.ttl)
    out(address=mgr.address, node_id=mgr.node_id)
    transfers = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        room = cmd.get("room")
        if op == "exit":
            out(ok=True)
            return
        if op == "send":  # prefill: fill, init, send chunks (all, or the first `stop_after`)
            src = cmd["src"]
            aux_index = cmd.get("aux_index")
            common.fill_source(kv, aux, room, src, aux_index)
            s = KVSender(mgr, None, room)
            transfers[room] = s
            common.wait_state(s, {KVPoll.WaitingForInput, KVPoll.Failed}, 10)
            s.init(cmd.get("num_pages", len(src)), aux_index, cmd.get("num_tokens"))
            chunks = cmd.get("chunks", [len(src)])
            if s.poll() != KVPoll.Failed:
                start = 0
                for i, n in enumerate(chunks):
                    if cmd.get("stop_after") is not None and i >= cmd["stop_after"]:
                        break
                    s.send(src[start:start + n])
                    start += n
            report(s)
        elif op == "recv":  # decode: reserve these pages
            r = KVReceiver(mgr, cmd.get("address"), room, prefill_rank=cmd.get("prefill_rank"))
            transfers[room] = r
            common.wait_state(r, {KVPoll.WaitingForInput, KVPoll.Failed}, 10)
            r.send_metadata(cmd["dst"], cmd.get("aux_index"), num_tokens=cmd.get("num_tokens"))
            report(r)
        elif op == "wait":
            t = transfers[room]
            t.wait(cmd.get("timeout", 10.0))
            extra = {}
            if isinstance(t, KVReceiver) and t.poll() == KVPoll.Success:
                extra["bad"] = common.check_landed(kv, aux, room, cmd["dst"], cmd.get("aux_index"))
            report(t, **extra)
        elif op == "poll":
            report(transfers[room])
        elif op == "abort":
            transfers[room].abort()
            report(transfers[room])
        elif op == "held":
            out(held=mgr.held_pages())
        else:
            out(error=f"unknown op {op}")


def report(t, **extra) -> None:
    out(state=int(t.poll()), error=common.describe(t.error), **extra)


def out(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
