"""Mooncake Transfer Engine on kvwire's engine workload, over TCP, two processes.

    python mooncake_bench.py --role target    --side 127.0.0.1:7420 [workload options]
    python mooncake_bench.py --role initiator --side 127.0.0.1:7420 [workload options]

The target (decode) registers its KV memory (4 buffers) with its TransferEngine
(metadata P2PHANDSHAKE, protocol tcp) and sends its RPC port and buffer addresses over the
side channel; the initiator (prefill) registers its own, and writes each request's page
slices (pages x buffers of them, each from a source page to its random destination page)
as one batch: `batch_transfer_async_write` of all the request's slices in one call, then
`get_batch_transfer_status` on the oldest batch in flight. Mooncake verifies nothing; the
target compares every landed byte after the timed window (common.py).
"""

import argparse
import importlib.metadata
import sys

import common


def engine(hostname):
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    ret = te.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
    if ret != 0:
        raise SystemExit(f"mooncake: TransferEngine.initialize(tcp, P2PHANDSHAKE) returned {ret}")
    return te


def register(te, arrays):
    for a in arrays:
        ret = te.register_memory(a.ctypes.data, a.nbytes)
        if ret != 0:
            raise SystemExit(f"mooncake: register_memory({a.nbytes} B) returned {ret}")


def main():
    p = argparse.ArgumentParser()
    common.add_args(p)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args()
    wl = common.workload_from(args)
    version = importlib.metadata.version("mooncake-transfer-engine-non-cuda")

    if args.role == "target":
        dst = common.alloc(wl, common.POISON)
        scratch = common.np.zeros(wl.page, dtype=common.np.uint8)
        te = engine(args.host)
        register(te, dst + [scratch])
        ch = common.Channel.listen(args.side)
        ch.send(
            op="hello",
            session=f"{args.host}:{te.get_rpc_port()}",
            bases=[a.ctypes.data for a in dst],
            scratch=scratch.ctypes.data,
        )
        ch.recv("ready")
        common.target_finish(ch, wl, dst, "mooncake")
        return

    src = common.alloc(wl, 0)
    wl.fill_sources(src)
    scratch = common.np.ones(wl.page, dtype=common.np.uint8)
    te = engine(args.host)
    register(te, src + [scratch])
    ch = common.Channel.connect(args.side)
    hello = ch.recv("hello")
    session, dst_bases = hello["session"], hello["bases"]
    src_bases = [a.ctypes.data for a in src]
    # Open the segment (handshake, connection) before the clock: one page into scratch.
    ret = te.batch_transfer_sync_write(session, [scratch.ctypes.data], [hello["scratch"]], [wl.page])
    if ret != 0:
        raise SystemExit(f"mooncake: warm-up write returned {ret}")
    ch.send(op="ready")
    lengths = [wl.page] * (wl.pages * wl.buffers)

    def post(r):
        srcs, dsts = wl.slices(r, src_bases, dst_bases)
        batch = te.batch_transfer_async_write(session, srcs, dsts, lengths)
        if batch == 0:
            raise SystemExit(f"mooncake: batch_transfer_async_write of request {r} failed")
        return batch

    def wait(handles):
        # Blocks (in C++, GIL released) until the oldest batch completed, and frees it.
        if te.get_batch_transfer_status([handles[0]]) != 0:
            raise SystemExit("mooncake: a batch write failed or timed out")
        return [0]

    common.initiator_run(ch, wl, "mooncake", post, wait, version)


if __name__ == "__main__":
    sys.exit(main())
