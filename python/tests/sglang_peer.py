"""An SGLang decode engine in its own process, for the SGLang tests (driven by
tests/common.Peer over JSON lines): kvwire.sglang.install(), SGLang's real ServerArgs,
KVArgs, MetadataBuffers and Req, and the decode scheduler's calls on the classes that
get_kv_class(TransferBackend.KVWIRE, ...) returns, in decode.py's order and with its arguments.

    sglang_peer.py [--pages N] [--fill B] [--no-states] [--tp-size N] [--heads H,T]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

import sglang_common as sc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=sc.PAGES)
    ap.add_argument("--fill", type=int, default=sc.SENTINEL)
    ap.add_argument("--no-states", action="store_true")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--heads", default="2,2")
    a = ap.parse_args()

    from kvwire import sglang as ks

    ks.install()
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    extra = ["--tp-size", str(a.tp_size)] if a.tp_size != 1 else []
    server_args = sc.server_args("decode", 0, *extra)
    eng = sc.Engine(pages=a.pages, fill=a.fill, states=not a.no_states)
    heads = tuple(int(x) for x in a.heads.split(","))
    backend = TransferBackend(server_args.disaggregation_transfer_backend)  # scheduler.py:1513
    # decode.py:765-771
    mgr = get_kv_class(backend, KVClassType.MANAGER)(
        eng.kv_args(ks, heads=heads), DisaggregationMode.DECODE, server_args, False
    )
    # DecodePreallocQueue's own dp-rank resolution (decode.py:879-898) over this manager.
    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
    queue.kv_manager = mgr
    out(ready=True, fingerprint=mgr.fingerprint)

    receivers, reqs = {}, {}
    # The decode scheduler's event loop polls every request in its queues on each iteration
    # (decode.py:1138 _update_handshake_waiters, 2849 pop_transferred), whatever the test
    # asks: so does this thread.
    mu = threading.Lock()

    def scheduler_loop() -> None:
        while True:
            with mu:
                for r in list(receivers.values()):
                    r.poll()
            time.sleep(0.002)

    threading.Thread(target=scheduler_loop, daemon=True).start()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        room = cmd.get("room")
        with mu:
            handle(cmd, op, room, mgr, queue, eng, receivers, reqs, backend)


def handle(cmd, op, room, mgr, queue, eng, receivers, reqs, backend) -> None:
    try:
        if op == "exit":
            out(ok=True)
            sys.stdout.flush()
            os._exit(0)
        if op == "recv":
            out(**recv(cmd, mgr, queue, eng, receivers, backend, reqs))
        elif op == "pop_transferred":
            out(**pop_transferred(cmd, eng, receivers[room], reqs[room]))
        elif op == "wait":
            r = receivers[room]
            sc.wait(r, {0, 4}, cmd.get("wait_s", 20.0))
            report(r, eng, cmd)
        elif op == "poll":
            report(receivers[room], eng, cmd)
        elif op == "abort":
            receivers[room].abort()  # scheduler.py:5765 (abort_request)
            report(receivers[room], eng, cmd)
        elif op == "snapshot":  # a digest of every KV page and state slot of this engine
            import hashlib

            h = hashlib.sha256()
            for b in eng.kv + [t for comp in eng.states for t in comp]:
                h.update(b.tobytes())
            out(digest=h.hexdigest())
        elif op == "untouched":
            out(untouched=eng.untouched(cmd["dst"], cmd.get("state_dst") or []))
        else:
            out(error=f"unknown op {op}")
    except Exception as e:  # the test sees what went wrong
        out(exception=f"{type(e).__name__}: {e}")


def recv(cmd, mgr, queue, eng, receivers, backend, reqs):
    from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

    room = cmd["room"]
    host, port = cmd["bootstrap_addr"].rsplit(":", 1)
    req = sc.make_req(room, cmd.get("prompt_tokens", len(cmd["dst"]) * sc.PAGE_SIZE), 0, host, int(port))
    # decode.py:900-910 (_create_receiver_and_enqueue)
    r = get_kv_class(backend, KVClassType.RECEIVER)(
        mgr=mgr, bootstrap_addr=cmd["bootstrap_addr"], bootstrap_room=req.bootstrap_room
    )
    receivers[room] = r
    req.output_ids = []
    reqs[room] = req
    # decode.py:1176-1200 (_ensure_prefill_info): one attempt per scheduling cycle
    deadline = time.monotonic() + 15
    while not mgr.try_ensure_parallel_info(cmd["bootstrap_addr"]):
        if time.monotonic() > deadline:
            return {"exception": "try_ensure_parallel_info never succeeded"}
        time.sleep(0.1)
    prefill_dp_rank = queue._resolve_prefill_dp_rank(req)  # decode.py:879
    r.init(prefill_dp_rank)  # decode.py:1105 (_init_receiver)
    # decode.py:1138-1146 (_update_handshake_waiters): WaitingForInput, then preallocation
    state, _ = sc.wait(r, {0, 2}, 15)
    if state == 2 and not cmd.get("no_metadata"):
        state_dst = cmd.get("state_dst") or []
        state_indices = [None if s is None else np.array(s, np.int32) for s in state_dst] if state_dst else None
        kwargs = {"decode_prefix_len": cmd.get("decode_prefix_len", 0)}  # decode.py:1806
        if cmd.get("destination"):
            from sglang.srt.disaggregation.base.conn import KVTransferDestination

            kwargs["destination"] = KVTransferDestination(cmd["destination"])
        # decode.py:1863 (_send_kv_metadata)
        r.send_metadata(np.array(cmd["dst"], np.int32), cmd["aux_index"], state_indices, **kwargs)
    return {"state": int(r.poll()), "prefill_dp_rank": prefill_dp_rank, "error": sc.describe(r.error)}


def pop_transferred(cmd, eng, r, req):
    """SGLang's DecodeTransferQueue.pop_transferred (decode.py:2832-2980) over this receiver:
    it polls through the metadata gate (utils.py:245-260) and, on Success, commits the aux
    record to the request (_commit_transfer_to_req, decode.py:2600-2776). Stand-ins only for
    the scheduler's GPU-side parts."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    if not dist.is_initialized():
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    q = DecodeTransferQueue.__new__(DecodeTransferQueue)
    q.gloo_group = dist.group.WORLD
    q.metadata_buffers = eng.meta
    q.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(sc.AUX_SLOTS)
    q.req_to_metadata_buffer_idx_allocator.free_slots.remove(cmd["aux_index"])
    q.enable_staging, q.enable_host_receive, q.enable_deferred_kv_release = False, False, False
    q.staging_handler, q.tree_cache, q._deferred_releases = None, None, []
    q.spec_algorithm = SimpleNamespace(is_none=lambda: True)
    q.scheduler = SimpleNamespace(
        enable_decode_hicache=False, kv_checksum_computer=None, enable_hisparse=False,
        batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a: None),
        output_streamer=SimpleNamespace(stream_output=lambda *a: None),
    )
    q.queue = [DecodeRequest(req=req, kv_receiver=r, metadata_buffer_index=cmd["aux_index"])]
    deadline = time.monotonic() + cmd.get("wait_s", 20.0)
    done = []
    while not done and q.queue and time.monotonic() < deadline:
        done = q.pop_transferred()
        time.sleep(0.005)
    return {
        "committed": [x.rid for x in done],
        "output_ids": list(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finished_reason": repr(req.finished_reason),
        "bad": eng.check_request(cmd["room"], cmd["dst"], cmd.get("state_dst") or []),
        "slot_freed": cmd["aux_index"] in q.req_to_metadata_buffer_idx_allocator.free_slots,
    }


def report(r, eng, cmd) -> None:
    extra = {}
    if int(r.poll()) == 4:
        extra["bad"] = eng.check_request(cmd["room"], cmd["dst"], cmd.get("state_dst") or [])
        # decode.py:2614-2630 (_commit_transfer_to_req): what the scheduler reads back
        buf = eng.meta.get_buf(cmd["aux_index"])
        extra["aux"] = {"output_id": int(buf[0][0].item()), "cached_tokens": int(buf[1][0].item()),
                        "bootstrap_room": int(buf[-1][0].item())}
    try:
        r.failure_exception()
        raised = None
    except Exception as e:
        raised = type(e).__name__
    out(state=int(r.poll()), error=sc.describe(r.error), raised=raised, **extra)


def out(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
