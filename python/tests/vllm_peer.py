"""One vLLM engine (vllm_common.Engine: vLLM 0.33.0's Scheduler, its connector machinery and
kvwire.vllm.KvwireConnector loaded by module path) in its own process, driven by the vLLM
tests over JSON lines on stdin/stdout.

    vllm_peer.py --role kv_producer|kv_consumer --kv-port N [--kv packed|split]
                 [--layout LBHNC] [--max-model-len N] [--policy recompute|fail]
                 [--extra JSON] [--fill F]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_common as vc  # noqa: E402


def out(**kw) -> None:
    sys.stdout.write(json.dumps(kw, default=str) + "\n")
    sys.stdout.flush()


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the tests dump stacks on a timeout
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", required=True)
    ap.add_argument("--kv-port", type=int, required=True)
    ap.add_argument("--kv", default="packed")
    ap.add_argument("--layout", default="LBHNC")
    ap.add_argument("--max-model-len", type=int, default=vc.MAX_MODEL_LEN)
    ap.add_argument("--policy", default="recompute")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--fill", type=float, default=0.0)
    a = ap.parse_args()
    # vLLM logs to stdout: keep it for our JSON lines.
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    try:
        eng = vc.Engine(a.role, a.kv_port, kv=a.kv, layout=a.layout, max_model_len=a.max_model_len,
                        policy=a.policy, extra=json.loads(a.extra), fill=a.fill)
    except Exception as e:
        traceback.print_exc()
        sys.stdout = real_stdout
        out(ready=False, kind=type(e).__name__, message=str(e), code_name=getattr(e, "code_name", None))
        return
    sys.stdout = real_stdout
    mgr = eng.connector.kvwire_manager
    out(ready=True, fingerprint=eng.connector.worker.fingerprint, address=mgr.address,
        regions=[(r.name, r.nbytes, r.item) for r in eng.connector.worker.layout.regions],
        free_blocks=eng.state()["free_blocks"], num_blocks=eng.num_blocks)

    # vLLM's engine core loop (EngineCore.run_busy_loop): step while the scheduler has work
    # (Scheduler.has_requests(), which counts the connector's pending push work), else wait.
    lock = threading.Lock()
    log: list = []
    stop = threading.Event()

    want = threading.Event()  # the command thread waits for the lock: let it have it

    def busy_loop() -> None:
        while not stop.is_set():
            while want.is_set() and not stop.is_set():
                time.sleep(0.0005)
            with lock:
                busy = eng.sched.has_requests()
                if busy:
                    ev = eng.step()
                    if ev["scheduled"] or ev["outputs"] or ev["finished_sending"] or ev["finished_recving"] \
                            or ev["invalid_block_ids"] or ev["failed_recving"]:
                        ev["t"] = time.monotonic()
                        log.append(ev)
            time.sleep(0.001 if busy else 0.005)

    threading.Thread(target=busy_loop, daemon=True).start()
    cursor = 0
    paused = [False]
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            sys.stdout = sys.stderr
            if op == "exit":
                stop.set()
                if paused[0]:
                    paused[0] = False
                    lock.release()
                with lock:
                    eng.connector.shutdown()
                sys.stdout = real_stdout
                out(ok=True)
                return
            if op in ("pause", "resume"):
                # Holds vLLM's engine loop (as a busy engine core between two steps), so a test
                # can add and abort a request before vLLM schedules it.
                if op == "pause" and not paused[0]:
                    want.set()
                    lock.acquire()
                    want.clear()
                    paused[0] = True
                elif op == "resume" and paused[0]:
                    paused[0] = False
                    lock.release()
                sys.stdout = real_stdout
                out(ok=True)
                continue
            if op == "wait":
                # Waits until `until` holds over the events since the last wait: "finished:<id>"
                # (an output with a finish reason), "sent:<id>" (finished_sending), "recv:<id>"
                # (finished_recving), "idle" (Scheduler.has_requests() is false).
                deadline = time.monotonic() + float(cmd.get("timeout", 30.0))
                while True:
                    if paused[0]:
                        raise RuntimeError("wait while paused")
                    want.set()
                    with lock:
                        want.clear()
                        events = log[cursor:]
                        done = _holds(eng, cmd["until"], events)
                    if done or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
                cursor += len(events)
                res = {"events": events, "done": done}
            elif paused[0]:
                res = handle(eng, op, cmd)  # the loop is held: this thread holds the lock
            else:
                want.set()
                with lock:
                    want.clear()
                    res = handle(eng, op, cmd)
        except Exception as e:
            res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        sys.stdout = real_stdout
        out(**res)


def handle(eng: "vc.Engine", op: str, cmd: dict) -> dict:
    if op == "add":
        eng.add(cmd["req_id"], cmd["prompt"], cmd.get("max_tokens", 1), cmd.get("params"))
        return {"ok": True}
    if op == "validate":
        return {"error_message": eng.validate(cmd["prompt"], cmd.get("max_tokens", 1))}
    if op == "abort":
        eng.abort(cmd["req_id"])
        return {"ok": True}
    if op == "state":
        return eng.state(cmd.get("req_id"))
    if op == "bad_blocks":
        return {"bad": eng.bad_blocks(cmd["req_id"], cmd.get("upto")), "blocks": eng.blocks_of(cmd["req_id"])}
    if op == "untouched":
        return {"untouched": eng.untouched(cmd["blocks"], cmd.get("fill", vc.SENTINEL))}
    raise ValueError(f"unknown op {op!r}")


def _holds(eng: "vc.Engine", until: str, events: list) -> bool:
    kind, _, arg = until.partition(":")
    if kind == "finished":
        return any(o["req_id"] == arg and o["finish_reason"] for e in events for o in e["outputs"])
    if kind == "sent":
        return any(arg in e["finished_sending"] for e in events)
    if kind == "recv":
        return any(arg in e["finished_recving"] for e in events)
    if kind == "idle":
        return not eng.sched.has_requests()
    raise ValueError(f"unknown condition {until!r}")


if __name__ == "__main__":
    main()
