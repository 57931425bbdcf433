"""The table of a peer-compare run: one row per case and engine, then kvwire's ratio to the
best of the peers per case. Reads the JSON that scripts/peer-compare.sh left in OUT.

    python table.py OUT            # Markdown table on stdout; OUT/results.json

Fails (exit 1) when any run in OUT did not check out: a kvwire transfer that was not verified
or whose bytes were not compared, or a peer run whose landed bytes differed.

Where OUT holds the raw TCP runs (rawtcp.PAGE.{block,poll}.txt, bench/raw-tcp-poll.c), a
third table sets each page size's engines beside what plain TCP moved in the same run.
"""

import glob
import json
import os
import sys

PEERS = ("mooncake", "nixl")


def last_json(path):
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lines = [l for l in text.splitlines() if l.startswith("{")]
        return json.loads(lines[-1])


def human(page):
    return f"{page // 1024} KiB" if page < 1 << 20 else f"{page >> 20} MiB"


def kvwire_row(out, name):
    decode = last_json(os.path.join(out, name + ".target.json"))["cases"][0]
    prefill = last_json(os.path.join(out, name + ".initiator.json"))["cases"][0]
    n = decode["transfers"]
    checked = decode["bytes_checked"]
    if decode["failures"] or decode["verified"] != n or checked not in (0, n):
        raise SystemExit(
            f"{name}: {decode['verified']}/{n} verified, {decode['bytes_checked']} byte-checked, "
            f"failures {decode['failures']}"
        )
    cpu = decode["cpu_seconds"] + prefill["cpu_seconds"]
    return dict(
        engine="kvwire",
        page_bytes=prefill["page_bytes"],
        concurrency=prefill["concurrency"],
        requests=n,
        bytes=prefill["bytes"],
        gb_per_s=prefill["gb_per_s"],
        p50_ms=prefill["p50_ms"],
        p99_ms=prefill["p99_ms"],
        cpu_s_per_gb=cpu / (prefill["bytes"] / 1e9),
        checks=f"{n}/{n} verified (xxh3 digests over the landed memory)"
        + (f", {n}/{n} byte-compared" if checked else ""),
        latency_to="VERIFIED back at the prefill",
        raw_gb_per_s=prefill.get("raw_gb_per_s"),
        raw_cpu_s_per_gb=None,
        decode_gb_per_s=decode["gb_per_s"],
    )


def peer_row(out, name):
    r = last_json(os.path.join(out, name + ".initiator.json"))
    want = r["requests"] * r["pages"] * r["buffers"]
    if not r["bytes_ok"] or r["slices_checked"] != want:
        raise SystemExit(f"{name}: landed bytes differ ({r['slices_checked']}/{want} page slices)")
    return dict(
        engine=r["engine"],
        page_bytes=r["page_bytes"],
        concurrency=r["concurrency"],
        requests=r["requests"],
        bytes=r["bytes"],
        gb_per_s=r["gb_per_s"],
        p50_ms=r["p50_ms"],
        p99_ms=r["p99_ms"],
        cpu_s_per_gb=r["cpu_s_per_gb"],
        checks=f"none by the engine; harness: {want}/{want} page slices byte-equal",
        latency_to=(
            "notification at the target"
            if "target" in r.get("completion", "")
            else "engine's completion at the initiator"
        ),
    )


def page_bytes(text):
    """64K, 1M or a number of bytes, as scripts/peer-compare.sh names a case's page."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def raw_runs(out):
    """{page bytes: {"block"|"poll": (GB/s, CPU s/GB of both ends)}} from the raw TCP runs."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "rawtcp.*.txt"))):
        _, page, mode, _ = os.path.basename(path).split(".")
        fields = {}
        for line in open(path):
            for word in line.split():
                key, _, value = word.partition("=")
                fields[key] = value
        cpu = float(fields["sender_cpu_s"]) + float(fields["receiver_cpu_s"])
        runs.setdefault(page_bytes(page), {})[mode] = (
            float(fields["GB/s"]),
            cpu / (int(fields["bytes"]) / 1e9),
        )
    return runs


def main():
    out = sys.argv[1]
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*.initiator.json"))):
        name = os.path.basename(path)[: -len(".initiator.json")]
        engine = name.split(".", 1)[0]
        rows.append(kvwire_row(out, name) if engine == "kvwire" else peer_row(out, name))
    order = {"kvwire": 0, "mooncake": 1, "nixl": 2}
    rows.sort(key=lambda r: (r["concurrency"], r["page_bytes"], order.get(r["engine"], 9)))
    versions = {}
    vpath = os.path.join(out, "versions.json")
    if os.path.exists(vpath):
        versions = json.load(open(vpath))
    tcp = raw_runs(out)
    raw_json = [
        dict(page_bytes=p, mode=m, gb_per_s=g, cpu_s_per_gb=c) for p in sorted(tcp) for m, (g, c) in tcp[p].items()
    ]
    json.dump(
        {"versions": versions, "rows": rows, "raw_tcp": raw_json},
        open(os.path.join(out, "results.json"), "w"),
        indent=1,
    )

    if versions:
        print(
            f"{versions.get('date')}; {versions.get('kvwire')} ({versions.get('kvwire_bin')}), "
            f"Mooncake TE {versions.get('mooncake')}, NIXL {versions.get('nixl')} "
            f"(UCX {versions.get('ucx')}); {versions.get('nproc')} CPUs, {versions.get('cpu')}; "
            f"load average before the run {' '.join(versions.get('loadavg', []))}; "
            f"KV buffers {versions.get('buffer_offset', 0)} bytes past a 4 KiB boundary"
        )
        print()
    print("| in flight | page | engine | GB/s | p50 ms | p99 ms | CPU s/GB (both processes) | latency until | what was checked |")
    print("|---:|---|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {human(r['page_bytes'])} | {r['engine']} | {r['gb_per_s']:.3f} | "
            f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['cpu_s_per_gb']:.2f} | {r['latency_to']} | {r['checks']} |"
        )
    cases = sorted({(r["concurrency"], r["page_bytes"]) for r in rows})
    lines = []
    for c, p in cases:
        here = {r["engine"]: r for r in rows if (r["concurrency"], r["page_bytes"]) == (c, p)}
        peers = [here[e] for e in PEERS if e in here]
        if "kvwire" not in here or not peers:
            continue
        k = here["kvwire"]
        fast = max(peers, key=lambda r: r["gb_per_s"])
        lean = min(peers, key=lambda r: r["cpu_s_per_gb"])
        raw = k.get("raw_gb_per_s")
        lines.append(
            f"| {c} | {human(p)} | {k['gb_per_s'] / fast['gb_per_s']:.2f} ({fast['engine']}) | "
            f"{k['cpu_s_per_gb'] / lean['cpu_s_per_gb']:.2f} ({lean['engine']}) | "
            + (f"{raw:.3f} |" if raw else "- |")
        )
    if lines:
        print()
        print(
            "| in flight | page | kvwire verified GB/s / best peer GB/s | kvwire CPU s/GB / leanest peer's | raw TCP GB/s (kvwire's writev baseline, same kvwire run) |"
        )
        print("|---:|---|---:|---:|---:|")
        print("\n".join(lines))
    if tcp:
        print()
        print(
            "| page | raw TCP GB/s, both ends blocking | both ends polling | CPU s/GB, blocking / polling "
            "| fastest engine run | kvwire's best ÷ faster raw | best peer's ÷ faster raw |"
        )
        print("|---|---:|---:|---:|---|---:|---:|")
        for p in sorted(tcp):
            block, poll = tcp[p].get("block"), tcp[p].get("poll")
            faster = max(x[0] for x in (block, poll) if x)
            here = [r for r in rows if r["page_bytes"] == p]
            best = max(here, key=lambda r: r["gb_per_s"], default=None)
            kv = max((r["gb_per_s"] for r in here if r["engine"] == "kvwire"), default=None)
            peer = max((r["gb_per_s"] for r in here if r["engine"] in PEERS), default=None)
            cells = [
                human(p),
                f"{block[0]:.3f}" if block else "-",
                f"{poll[0]:.3f}" if poll else "-",
                " / ".join(f"{x[1]:.2f}" if x else "-" for x in (block, poll)),
                f"{best['engine']}, {best['concurrency']} in flight ({best['gb_per_s']:.3f})" if best else "-",
                f"{kv / faster:.2f}" if kv else "-",
                f"{peer / faster:.2f}" if peer else "-",
            ]
            print("| " + " | ".join(cells) + " |")
        print()
        print(
            "Raw TCP: bench/raw-tcp-poll.c, one connection, the same bytes in page-sized sends and "
            "receives to and from random slots of the same memory size, no protocol; polling is "
            "MSG_DONTWAIT with sched_yield after EAGAIN (UCX's progress loop). One run of each: "
            "what plain TCP moved on this host during this run, not a bound (an engine that "
            "writes several pages per call can pass it)."
        )
    print()
    print(
        "kvwire verifies every transfer (xxh3 digests over the landed memory, inside its timed "
        "window; with PEERS_KVWIRE_CHECK_BYTES=1 it also compares every byte there). "
        "Mooncake TE and NIXL verify nothing: "
        "the harness compared every landed byte after their timed windows. Mooncake's TCP "
        "transport completes a write once its bytes are written to the socket (no "
        "acknowledgment); NIXL's completes UCX puts locally, so its latency and window run "
        "to the notifications' arrival at the target."
    )


if __name__ == "__main__":
    main()
