"""The chaos cluster's timeline as an SVG (no plotting package needed): the faults injected, by
kind, as bars over time; requests verified per second; failed request ends per second by code.
scripts/cluster/run.py writes it beside its JSON report."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple
from xml.sax.saxutils import escape

KINDS = ["kill", "stop", "flip", "cut", "etcd", "link", "loss", "starve"]
COLORS = ["#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#7f7f7f", "#1f77b4", "#17becf", "#bcbd22"]
CODE_COLORS = ["#d62728", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]

W, LEFT, RIGHT = 1000, 150, 20
PLOT_W = W - LEFT - RIGHT


def svg(report: Dict[str, Any], ends: List[Tuple[str, Dict[str, Any]]]) -> str:
    faults = report.get("faults", [])
    span = max([report["seconds"]] + [e["at"] for _, e in ends] + [f.get("until", f["at"]) for f in faults])
    span = max(span, 1.0)
    step = max(1, math.ceil(span / 400))  # seconds per bin
    bins = int(span // step) + 1

    def x(t: float) -> float:
        return LEFT + PLOT_W * t / span

    verified = [0.0] * bins
    failed: Dict[str, List[float]] = {}
    for side, e in ends:
        b = int(e["at"] // step)
        if side == "decode" and e["state"] == "verified":
            verified[b] += 1 / step
        elif e["state"] == "failed":
            failed.setdefault(e.get("code") or "?", [0.0] * bins)[b] += 1 / step
    ranked = sorted(failed, key=lambda c: -sum(failed[c]))
    shown = ranked[:6]
    if len(ranked) > 6:
        other = [sum(failed[c][i] for c in ranked[6:]) for i in range(bins)]
        failed["other"] = other
        shown.append("other")

    out: List[str] = []
    y = 40
    out.append(f'<text x="{LEFT}" y="22" font-size="15" font-weight="bold">kvwire chaos cluster: seed {report["seed"]}, '
               f'{report["prefills"]} prefill x {report["decodes"]} decode, {report["requests"]:,} requests, '
               f'{len(faults)} faults, {len(report["violations"])} violations</text>')

    # Faults: one row per kind.
    row = 12
    for k, kind in enumerate(KINDS):
        ry = y + k * row
        out.append(f'<text x="{LEFT - 8}" y="{ry + row - 3}" font-size="10" text-anchor="end">{kind}</text>')
        out.append(f'<line x1="{LEFT}" y1="{ry + row / 2}" x2="{W - RIGHT}" y2="{ry + row / 2}" stroke="#eee"/>')
        for f in faults:
            if f["kind"] != kind:
                continue
            x0, x1 = x(f["at"]), x(f.get("until", f["at"]))
            title = escape(f'{kind} {f["node"]} at {f["at"]} s' + (f', recovered in {f["recovered_s"]} s' if f.get("recovered_s") is not None else ""))
            out.append(f'<rect x="{x0:.1f}" y="{ry + 1}" width="{max(1.5, x1 - x0):.1f}" height="{row - 2}" '
                       f'fill="{COLORS[k]}"><title>{title}</title></rect>')
    y += len(KINDS) * row + 20

    def panel(title: str, series: List[Tuple[str, List[float], str]], height: int) -> None:
        nonlocal y
        top = max([1.0] + [max(v) for _, v, _ in series])
        top = nice(top)
        out.append(f'<text x="{LEFT}" y="{y - 4}" font-size="12">{escape(title)}</text>')
        out.append(f'<rect x="{LEFT}" y="{y}" width="{PLOT_W}" height="{height}" fill="none" stroke="#999"/>')
        for q in (0, 0.5, 1):
            gy = y + height - height * q
            out.append(f'<text x="{LEFT - 6}" y="{gy + 4:.1f}" font-size="10" text-anchor="end">{top * q:g}</text>')
            if q:
                out.append(f'<line x1="{LEFT}" y1="{gy:.1f}" x2="{W - RIGHT}" y2="{gy:.1f}" stroke="#eee"/>')
        for f in faults:  # faint bands under the lines
            out.append(f'<rect x="{x(f["at"]):.1f}" y="{y}" width="{max(1.0, x(f.get("until", f["at"])) - x(f["at"])):.1f}" '
                       f'height="{height}" fill="{COLORS[KINDS.index(f["kind"])]}" opacity="0.08"/>')
        for n, (name, values, color) in enumerate(series):
            pts = " ".join(f"{x(i * step + step / 2):.1f},{y + height - height * v / top:.1f}" for i, v in enumerate(values))
            out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.2"/>')
            lx = LEFT + 10 + (n % 4) * 200
            ly = y + height + 16 + (n // 4) * 14
            out.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="3" fill="{color}"/>'
                       f'<text x="{lx + 14}" y="{ly - 3}" font-size="10">{escape(name)} ({sum(values) * step:,.0f})</text>')
        y += height + 24 + ((len(series) - 1) // 4 + 1) * 14

    panel(f"requests verified per second (decode), {step} s bins", [("verified", verified, "#2ca02c")], 150)
    panel(f"failed request ends per second, by code (both sides), {step} s bins",
          [(c, failed[c], CODE_COLORS[i % len(CODE_COLORS)]) for i, c in enumerate(shown)], 150)
    # Time axis.
    tick = nice(span / 8)
    t = 0.0
    while t <= span + 1e-9:
        out.append(f'<text x="{x(t):.1f}" y="{y + 4}" font-size="10" text-anchor="middle">{t:g} s</text>')
        t += tick
    y += 16
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{y}" viewBox="0 0 {W} {y}" '
            f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>' + "".join(out) + "</svg>\n")


def nice(v: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above v."""
    if v <= 0:
        return 1.0
    p = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 5, 10):
        if m * p >= v:
            return m * p
    return 10 * p
