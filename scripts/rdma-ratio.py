#!/usr/bin/env python3
"""Prints kvwire's RDMA bench against ib_write_bw from one SoftRoCE lane run.

Reads DIR/ib_write_bw-SIZE.txt (perftest output) and DIR/rdma-{xxh3,digest,none,digest-8m}.json
(`kvwire bench --transport rdma --json`: verified with the harness's byte check, verified by
digest alone, unverified, and verified by digest in 8 MiB requests); prints one row per message
size, request size and mode with both throughputs and their ratio, then each run's
retransmissions from DIR/retries.txt where the run wrote one. Exits 1 if a file is missing
or a bench case failed. A run from before the digest-only or the 8 MiB case prints the others.
"""
import json
import sys
from pathlib import Path


def ib_write_bw(path: Path) -> float:
    """BW average in MB/s (10^6 bytes/s), perftest's 4th column."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("#bytes"):
            return float(lines[i + 1].split()[3])
    raise SystemExit(f"{path}: no result line")


def main() -> None:
    out = Path(sys.argv[1])
    rows = []
    for verify in ("xxh3", "digest", "none", "digest-8m"):
        path = out / f"rdma-{verify}.json"
        if verify.startswith("digest") and not path.exists():
            continue
        report = json.loads(path.read_text())
        for case in report["cases"]:
            if case["failures"] or case["verified"] < case["transfers"]:
                raise SystemExit(f"rdma bench case failed: {case}")
            size = case["page_bytes"]
            base = ib_write_bw(out / f"ib_write_bw-{size}.txt")
            request = size * case["pages"] * case["buffers"]
            mbs = case["gb_per_s"] * 1e3
            rows.append((size, request, verify.removesuffix("-8m"), mbs, base,
                         mbs / base if base else float("nan")))
    print(f"{'message':>8} {'request':>8} {'verify':>6} {'kvwire MB/s':>12} {'ib_write_bw MB/s':>17} {'ratio':>6}")
    for size, request, verify, mbs, base, ratio in rows:
        print(f"{size:>8} {request:>8} {verify:>6} {mbs:>12.1f} {base:>17.1f} {ratio:>6.2f}")
    retries = out / "retries.txt"
    if retries.exists():
        # rxe's retransmissions and duplicate packets during each run: a run that resent much
        # measured its ACK timeout as much as the link (docs/BENCHMARKS.md).
        print("retransmissions / duplicate packets per run: " + ", ".join(
            f"{name} {r} / {d}" for name, r, d in
            (line.split() for line in retries.read_text().splitlines() if line.strip())))


if __name__ == "__main__":
    main()
