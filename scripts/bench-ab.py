#!/usr/bin/env python3
"""Interleaved A/B runs of `kvwire bench`: several binaries (or flag sets) over the same cases,
round by round, each run a fresh process with its own raw TCP baselines; prints every run and
the per-variant medians of GB/s, ratio to raw (streaming, and for the engine workload with the
case's requests in flight), CPU s/GB, CPU ratio and p50/p99 as Markdown.

    scripts/bench-ab.py --variant base=/tmp/kvwire-base --variant new=target/release/kvwire \
        --variant 'new-none=target/release/kvwire --verify none' \
        --case 'engine 1 64K 32' --case 'engine 4 1M 2' --rounds 3 --bytes 1G

A case is `WORKLOAD CONCURRENCY PAGE PAGES [BUFFERS]` (workload: engine or pool). Ratios are
only compared within a round: the machine drifts between rounds (docs/BENCHMARKS.md). The
variants' order rotates from round to round (`--fixed-order` keeps it): a run's position in
its round biased some cases by up to 1.3x on one host (docs/BENCHMARKS.md, 2026-12-05).
"""

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["cases"][0]


def num(v, digits):
    """A figure, or "-" where the case has none."""
    return "-" if v is None else f"{v:.{digits}f}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two(cmd, psk):
    """Decode (--listen) and prefill (--connect) as two processes; the prefill's figures with
    the CPU of both processes (and of both halves of the raw baseline) summed per GB."""
    addr = f"127.0.0.1:{free_port()}"
    listen = subprocess.Popen(cmd + ["--listen", addr, "--psk-file", psk], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    time.sleep(0.3)
    prefill = run(cmd + ["--connect", addr, "--psk-file", psk])
    out, _ = listen.communicate(timeout=600)
    if listen.returncode:
        raise SystemExit(f"the listening side exited {listen.returncode}")
    decode = json.loads(out)["cases"][0]
    gb = prefill["bytes"] / 1e9
    c = dict(prefill)
    c["cpu_s_per_gb"] = (prefill["cpu_seconds"] + decode["cpu_seconds"]) / gb
    if prefill.get("raw_cpu_s_per_gb") is not None:  # none with --no-raw
        c["raw_cpu_s_per_gb"] = prefill["raw_cpu_s_per_gb"] + decode["raw_cpu_s_per_gb"]
        c["cpu_ratio_to_raw"] = c["cpu_s_per_gb"] / c["raw_cpu_s_per_gb"]
    if prefill.get("raw_in_flight_cpu_s_per_gb") is not None:
        c["raw_in_flight_cpu_s_per_gb"] = (prefill["raw_in_flight_cpu_s_per_gb"]
                                           + decode["raw_in_flight_cpu_s_per_gb"])
    c["verified"] = decode["verified"]
    c["failures"] = prefill.get("failures") or decode.get("failures")
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME=BINARY [BENCH FLAGS...] (the flags go after `bench`)")
    ap.add_argument("--case", action="append", required=True, help="WORKLOAD CONC PAGE PAGES [BUFFERS]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bytes", default="1G")
    ap.add_argument("--json-out", help="write every run as JSON lines here")
    ap.add_argument("--two-process", action="store_true",
                    help="decode and prefill as two processes (--listen / --connect), CPU of both summed")
    ap.add_argument("--fixed-order", action="store_true",
                    help="run the variants in the given order every round (default: rotated, round r "
                         "starting with variant r-1, so that each takes every position equally often)")
    a = ap.parse_args()
    psk = None
    if a.two_process:
        fd, psk = tempfile.mkstemp(prefix="bench-ab-psk-")
        os.close(fd)
        key = subprocess.run([shlex.split(a.variant[0].partition("=")[2])[0], "gen-psk"],
                             check=True, capture_output=True, text=True).stdout
        with open(psk, "w") as f:
            f.write(key)
    variants = []
    for v in a.variant:
        name, _, cmd = v.partition("=")
        variants.append((name, shlex.split(cmd)))
    rows = []
    sink = open(a.json_out, "w") if a.json_out else None
    for r in range(1, a.rounds + 1):
        for case in a.case:
            parts = case.split()
            workload, conc, page, pages = parts[:4]
            buffers = parts[4] if len(parts) > 4 else "4"
            start = 0 if a.fixed_order else (r - 1) % len(variants)
            for position, (name, cmd) in enumerate(variants[start:] + variants[:start]):
                full = cmd[:1] + ["bench"] + cmd[1:] + ["--workload", workload, "--concurrency", conc,
                              "--page-sizes", page, "--pages", pages, "--buffers", buffers,
                              "--bytes", a.bytes, "--json"]
                c = run_two(full, psk) if a.two_process else run(full)
                row = dict(round=r, case=case, variant=name, position=position, **{k: c.get(k) for k in (
                    "gb_per_s", "raw_gb_per_s", "ratio_to_raw", "cpu_s_per_gb", "raw_cpu_s_per_gb",
                    "cpu_ratio_to_raw", "raw_in_flight_gb_per_s", "ratio_to_raw_in_flight",
                    "raw_in_flight_cpu_s_per_gb", "p50_ms", "p99_ms", "transfers_per_s", "verified",
                    "transfers")})
                if c.get("failures"):
                    print(f"failures in {name} {case}: {c['failures']}", file=sys.stderr)
                    sys.exit(1)
                rows.append(row)
                if sink:
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                print(f"round {r} {case:18s} {name:12s} {c['gb_per_s']:.3f} GB/s ratio "
                      f"{num(c.get('ratio_to_raw'), 2)} ({num(c.get('ratio_to_raw_in_flight'), 2)} in flight) "
                      f"cpu {c['cpu_s_per_gb']:.2f} ({num(c.get('cpu_ratio_to_raw'), 2)}) "
                      f"{c['transfers_per_s']:.0f}/s", file=sys.stderr)
    print("| round | case | variant | GB/s | raw GB/s | ratio | raw GB/s, same requests in flight | ratio "
          "| CPU s/GB | raw CPU | CPU ratio | transfers/s | p50 ms | p99 ms |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for x in rows:
        print(f"| {x['round']} | {x['case']} | {x['variant']} | {x['gb_per_s']:.3f} | {num(x.get('raw_gb_per_s'), 3)} | "
              f"{num(x.get('ratio_to_raw'), 2)} | {num(x.get('raw_in_flight_gb_per_s'), 3)} | "
              f"{num(x.get('ratio_to_raw_in_flight'), 2)} | {x['cpu_s_per_gb']:.2f} | {num(x.get('raw_cpu_s_per_gb'), 2)} | "
              f"{num(x.get('cpu_ratio_to_raw'), 2)} | {x['transfers_per_s']:.0f} | {x['p50_ms']:.2f} | {x['p99_ms']:.2f} |")
    print()
    print("Medians over the rounds (min-max of the ratio to raw):")
    print()
    print("| case | variant | GB/s | ratio to raw (min-max) | ratio to raw, same requests in flight (min-max) "
          "| CPU s/GB | CPU ratio | transfers/s | p50 ms |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|")
    med = statistics.median
    for case in a.case:
        for name, _ in variants:
            xs = [x for x in rows if x["case"] == case and x["variant"] == name]
            # Runs with --no-raw have no ratios to raw: "-" there.
            rs = [x["ratio_to_raw"] for x in xs if x.get("ratio_to_raw") is not None]
            fs = [x["ratio_to_raw_in_flight"] for x in xs if x.get("ratio_to_raw_in_flight") is not None]
            cs = [x["cpu_ratio_to_raw"] for x in xs if x.get("cpu_ratio_to_raw") is not None]
            spread = lambda v: f"{med(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "-"
            print(f"| {case} | {name} | {med(x['gb_per_s'] for x in xs):.3f} | {spread(rs)} | "
                  f"{spread(fs)} | "
                  f"{med(x['cpu_s_per_gb'] for x in xs):.2f} | {num(med(cs) if cs else None, 2)} | "
                  f"{med(x['transfers_per_s'] for x in xs):.0f} | {med(x['p50_ms'] for x in xs):.2f} |")
    if len(variants) > 1:
        base = variants[0][0]
        print()
        print(f"Per-round GB/s over `{base}`, median (min-max):")
        print()
        print("| case | variant | GB/s ÷ " + base + " | CPU s/GB ÷ " + base + " |")
        print("|---|---|---|---|")
        for case in a.case:
            for name, _ in variants[1:]:
                g, c = [], []
                for r in range(1, a.rounds + 1):
                    b = [x for x in rows if x["case"] == case and x["variant"] == base and x["round"] == r][0]
                    v = [x for x in rows if x["case"] == case and x["variant"] == name and x["round"] == r][0]
                    g.append(v["gb_per_s"] / b["gb_per_s"])
                    c.append(v["cpu_s_per_gb"] / b["cpu_s_per_gb"])
                print(f"| {case} | {name} | {med(g):.2f} ({min(g):.2f}-{max(g):.2f}) | {med(c):.2f} ({min(c):.2f}-{max(c):.2f}) |")


if __name__ == "__main__":
    main()
