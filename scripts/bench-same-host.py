#!/usr/bin/env python3
"""Same-host pulls against a memcpy and against TCP loopback (issue 35; docs/SAME_HOST.md):
rounds of `kvwire bench` as two processes on this host (decode --listen, prefill --connect),
once with `--same-host auto` (the decode pulls the pages out of the prefill's memory, on its
pull threads: `--pull-threads 2`), once with `--pull-threads 1` (every pull on the
connection's task) and once with `--same-host off` (page bytes on the TCP stream), in rotating
order. Each run's prefill also measures a single-threaded memcpy of the same bytes
(`memcpy_gb_per_s`). Prints every run and, per round, same-host / memcpy (of the same run),
same-host / one thread and same-host / TCP (of the same round).

    scripts/bench-same-host.py [--binary target/release/kvwire] [--rounds 3] [--bytes 2G] \
        [--case 'engine 4 64K 32'] [--case 'engine 1 1M 8']

A case is `WORKLOAD CONCURRENCY PAGE PAGES [BUFFERS]` as in scripts/bench-ab.py. Exits
non-zero if a run had a failure, or if the `auto` run did not pull (or `off` did).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two(cmd, psk):
    addr = f"127.0.0.1:{free_port()}"
    listen = subprocess.Popen(cmd + ["--listen", addr, "--psk-file", psk], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    time.sleep(0.3)
    out = subprocess.run(cmd + ["--connect", addr, "--psk-file", psk], check=True,
                         capture_output=True, text=True).stdout
    prefill = json.loads(out)["cases"][0]
    dout, _ = listen.communicate(timeout=900)
    if listen.returncode:
        raise SystemExit(f"the listening side exited {listen.returncode}")
    decode = json.loads(dout)["cases"][0]
    return prefill, decode


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default="target/release/kvwire")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bytes", default="2G")
    ap.add_argument("--case", action="append")
    a = ap.parse_args()
    cases = a.case or ["engine 4 64K 32", "engine 1 1M 8"]
    fd, psk = tempfile.mkstemp(prefix="bench-same-host-psk-")
    os.close(fd)
    with open(psk, "w") as f:
        f.write(subprocess.run([a.binary, "gen-psk"], check=True, capture_output=True, text=True).stdout)
    # Pulls on the pull threads (the default: the cores), pulls on the connection's task, TCP.
    variants = [("same-host", "auto", "2"), ("one-thread", "auto", "1"), ("tcp", "off", "0")]
    rows = []
    for r in range(1, a.rounds + 1):
        for case in cases:
            workload, conc, page, pages, *rest = case.split()
            buffers = rest[0] if rest else "4"
            got = {}
            order = variants[r % 3:] + variants[:r % 3]
            for name, mode, threads in order:
                cmd = [a.binary, "bench", "--same-host", mode, "--pull-threads", threads, "--workload", workload,
                       "--concurrency", conc, "--page-sizes", page, "--pages", pages,
                       "--buffers", buffers, "--bytes", a.bytes, "--no-raw", "--json"]
                prefill, decode = run_two(cmd, psk)
                if prefill.get("failures") or decode.get("failures"):
                    raise SystemExit(f"failures in {name} {case}: {prefill.get('failures') or decode.get('failures')}")
                if decode.get("same_host_pulls") != (mode == "auto"):
                    raise SystemExit(f"{name} {case}: same_host_pulls = {decode.get('same_host_pulls')}")
                got[name] = (prefill, decode)
                print(f"round {r} {case:18s} {name:10s} {prefill['gb_per_s']:.3f} GB/s, memcpy "
                      f"{prefill['memcpy_gb_per_s']:.3f} GB/s, verified {decode['verified']}", file=sys.stderr)
            same, tcp, one = got["same-host"][0], got["tcp"][0], got["one-thread"][0]
            rows.append(dict(round=r, case=case, same=same["gb_per_s"], memcpy=same["memcpy_gb_per_s"],
                             one=one["gb_per_s"], vs_one=same["gb_per_s"] / one["gb_per_s"],
                             tcp=tcp["gb_per_s"], tcp_memcpy=tcp["memcpy_gb_per_s"],
                             vs_memcpy=same["gb_per_s"] / same["memcpy_gb_per_s"],
                             vs_tcp=same["gb_per_s"] / tcp["gb_per_s"],
                             cpu_same=same["cpu_s_per_gb"] + got["same-host"][1]["cpu_seconds"] * 1e9 / same["bytes"],
                             cpu_tcp=tcp["cpu_s_per_gb"] + got["tcp"][1]["cpu_seconds"] * 1e9 / tcp["bytes"]))
    print("| round | case | same-host GB/s | memcpy GB/s (same run) | same-host / memcpy | one thread GB/s | "
          "same-host / one thread | TCP loopback GB/s | same-host / TCP | CPU s/GB same-host | CPU s/GB TCP |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for x in rows:
        print(f"| {x['round']} | {x['case']} | {x['same']:.3f} | {x['memcpy']:.3f} | {x['vs_memcpy']:.2f} | "
              f"{x['one']:.3f} | {x['vs_one']:.2f} | "
              f"{x['tcp']:.3f} | {x['vs_tcp']:.2f} | {x['cpu_same']:.2f} | {x['cpu_tcp']:.2f} |")
    print()
    print("| case | same-host / memcpy, median (min-max) | same-host / one thread | same-host / TCP |")
    print("|---|---|---|---|")
    span = lambda v: f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
    for case in cases:
        mine = [x for x in rows if x["case"] == case]
        print(f"| {case} | {span([x['vs_memcpy'] for x in mine])} | {span([x['vs_one'] for x in mine])} | "
              f"{span([x['vs_tcp'] for x in mine])} |")
    os.unlink(psk)


if __name__ == "__main__":
    main()
