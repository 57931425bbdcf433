"""NIXL (UCX backend, TCP transport) on kvwire's engine workload, two processes.

    UCX_TLS=tcp python nixl_bench.py --role target    --side 127.0.0.1:7420 [workload options]
    UCX_TLS=tcp python nixl_bench.py --role initiator --side 127.0.0.1:7420 [workload options]

Both agents register their KV memory (4 buffers, DRAM) with the UCX backend and swap agent
metadata over the side channel. Before the clock the initiator prepares two descriptor
lists once (every page slice of its memory, and every page slice of the target's); each
request is then `make_prepped_xfer("WRITE", ...)` with the request's indices (a source
page to its random destination page, for every buffer), `transfer`, and `check_xfer_state`
until DONE, with a notification per request. NIXL's DONE at the initiator can come long
before the data landed (UCX over TCP completes puts locally), so a request's latency runs to
the arrival of its notification at the target, and the window ends at the last one.
NIXL verifies nothing; the target compares every landed byte after the timed window
(common.py).
"""

import argparse
import base64
import importlib.metadata
import os
import sys
import time

import numpy as np

import common


def agent(name):
    from nixl_cu12 import nixl_agent, nixl_agent_config

    prog = os.environ.get("PEERS_NIXL_PROGRESS_THREAD", "0") == "1"
    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=prog, backends=["UCX"]))
    if "UCX" not in a.backends:
        raise SystemExit("nixl: the UCX backend did not start (see the log above)")
    return a


def add_peer(a, md_b64):
    name = a.add_remote_agent(base64.b64decode(md_b64))
    # loadRemoteMD gives bytes; notifications are keyed by str.
    return name.decode() if isinstance(name, bytes) else name


def register(a, arrays):
    a.register_memory([(x.ctypes.data, x.nbytes, 0, "") for x in arrays], "DRAM")


def slice_table(wl, bases):
    """Nx3 (address, length, device): buffer b's page p at row b * page_count + p."""
    rows = np.zeros((wl.buffers * wl.page_count, 3), dtype=np.uint64)
    for b, base in enumerate(bases):
        lo = b * wl.page_count
        rows[lo : lo + wl.page_count, 0] = base + np.arange(wl.page_count, dtype=np.uint64) * wl.page
        rows[lo : lo + wl.page_count, 1] = wl.page
    return rows


def indices(wl, pages):
    """Rows of request's page slices, in (ordinal, buffer) order."""
    b = np.arange(wl.buffers, dtype=np.int64) * wl.page_count
    return (pages[:, None] + b[None, :]).reshape(-1).astype(np.int32)


def main():
    p = argparse.ArgumentParser()
    common.add_args(p)
    args = p.parse_args()
    wl = common.workload_from(args)
    version = importlib.metadata.version("nixl-cu12")

    if args.role == "target":
        dst = common.alloc(wl, common.POISON)
        scratch = np.zeros(wl.page, dtype=np.uint8)
        a = agent("decode")
        register(a, dst + [scratch])
        ch = common.Channel.listen(args.side)
        ch.send(
            op="hello",
            md=base64.b64encode(a.get_agent_metadata()).decode(),
            bases=[x.ctypes.data for x in dst],
            scratch=scratch.ctypes.data,
        )
        peer = add_peer(a, ch.recv("md")["md"])
        # The warm-up write's notification (before the clock).
        while not a.check_remote_xfer_done(peer, b"warm"):
            time.sleep(0.001)
        ch.send(op="ready")
        idle = float(os.environ.get("PEERS_NIXL_TARGET_IDLE_S", "0"))

        def notifications():
            # Polling for notifications also progresses the UCX worker that receives the
            # data; the target is done when every request's notification came.
            arrivals = []
            while len(arrivals) < wl.requests:
                notes = a.get_new_notifs()
                now = time.perf_counter()
                for msgs in notes.values():
                    arrivals.extend([int(m[1:]), now] for m in msgs)
                if idle:
                    time.sleep(idle)
            return {"arrivals": arrivals}

        common.target_finish(ch, wl, dst, "nixl", notifications)
        return

    src = common.alloc(wl, 0)
    wl.fill_sources(src)
    scratch = np.ones(wl.page, dtype=np.uint8)
    a = agent("prefill")
    register(a, src + [scratch])
    ch = common.Channel.connect(args.side)
    hello = ch.recv("hello")
    peer = add_peer(a, hello["md"])
    ch.send(op="md", md=base64.b64encode(a.get_agent_metadata()).decode())
    local = a.prep_xfer_dlist(
        "NIXL_INIT_AGENT",
        np.vstack([slice_table(wl, [x.ctypes.data for x in src]), [[scratch.ctypes.data, wl.page, 0]]]).astype(np.uint64),
        "DRAM",
    )
    remote = a.prep_xfer_dlist(
        peer,
        np.vstack([slice_table(wl, hello["bases"]), [[hello["scratch"], wl.page, 0]]]).astype(np.uint64),
        "DRAM",
    )
    last = wl.buffers * wl.page_count  # the scratch row
    # Connect and warm up before the clock: one page into the target's scratch.
    a.make_connection(peer)
    h = a.make_prepped_xfer("WRITE", local, [last], remote, [last], b"warm")
    state = a.transfer(h)
    while state == "PROC":
        state = a.check_xfer_state(h)
    if state != "DONE":
        raise SystemExit(f"nixl: warm-up write ended {state}")
    h.release()
    ch.recv("ready")
    src_idx = [indices(wl, wl.src[r]) for r in range(wl.requests)]
    dst_idx = [indices(wl, wl.dst[r]) for r in range(wl.requests)]

    def post(r):
        h = a.make_prepped_xfer("WRITE", local, src_idx[r], remote, dst_idx[r], b"r%d" % r)
        if a.transfer(h) == "ERR":
            raise SystemExit(f"nixl: posting request {r} failed")
        return h

    def wait(handles):
        while True:
            done = []
            for i, h in enumerate(handles):
                s = a.check_xfer_state(h)
                if s == "DONE":
                    done.append(i)
                elif s == "ERR":
                    raise SystemExit("nixl: a transfer failed")
            if done:
                for i in done:
                    handles[i].release()
                return done

    common.initiator_run(ch, wl, "nixl", post, wait, version)


if __name__ == "__main__":
    # NIXL 1.5.1 crashes (SIGSEGV) in its teardown at interpreter exit once a peer was
    # connected: leave with os._exit, keeping the exit status.
    code = 0
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
