#!/usr/bin/env python3
"""Checks what scripts/rails-test.sh left in OUT (default target/rails) and prints the
ratios: two rails against one, and each beside ib_write_bw on one rail. Exits non-zero on
any violation:

* both rails (striped, and not), one rail, and both rails after rail 1 came back: every
  transfer verified on both sides, every verified byte checked by the decode, and with two
  rails each device carried at least a quarter of the packets; where striped (SPEC §9.2,
  striping a transfer over lanes) the decode striped every reservation, where not none;
* rail 1 taken down mid-run: the transfers bound or striped on it move to rail 0 (SPEC §9.2,
  moving a transfer off a failed lane) and every transfer verifies at both ends: none failed, none
  Unconfirmed, the decode checked the bytes of every transfer it verified; the decode moved
  at least one reservation (the rail went down while it carried some) and both ends'
  connections report one failed lane (`failed_lanes`): the connection went on over rail 0;
  where it fails, the summary's `rail_down.diagnosis` carries both ends' warnings and both
  VMs' counters over the run (a CI's output is all that comes back from it); a run the
  liveness rule closed (rail 0 silent for 10 s, seen on the emulated links) was run again
  (`down-again`): the second is judged, the first reported under
  `rail_down_first_run_closed_by_liveness`;
* rail 1 still down when a new connection opens over both rails: rail 1's lane is left out at
  both ends (SPEC §9.2, a rail down when the connection opens; each side reports one failed
  lane), every transfer verifies and is checked, and rail 1 carried none of its packets;
* no other run reports a failed lane; the two runs with no fault, both rails (striped and not),
  run twice each: a lane failing in one of a pair is reported (with both VMs' hardware
  counters and the decode's reason) and fails the check only where the other run of the
  pair has one too (seen once on the emulated links: an rxe1 SEND that made no progress for
  5 s, its transfers moved and verified);
* the poll-style manager's run (examples/rails_renewal.rs), rail 1 down in VM a for 12 s: no
  verified byte differs, all but a few requests verify (those on the rail when it went down
  may fail), the decode renewed the connection at least once (the prefill accepted a second
  one; a renewal while the rail was still down, with it left out, comes when the decode saw
  the lane fail early enough), and VM a's rxe1 sent packets again after it came back (a
  renewed connection took the rail again).
"""
import json
import re
import sys
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else "target/rails")
problems = []


def case(name, side):
    try:
        return json.loads((out / f"{name}-{side}.json").read_text())["cases"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        problems.append(f"{name} {side}: no report ({e})")
        return None


def total(counts):
    return sum((counts or {}).values())


def all_verified(name, failed_lanes=0, lane_problems=None):
    """Every transfer of run `name` verified at both ends and checked by the decode, and each
    end reports `failed_lanes`; a wrong failed_lanes goes to `lane_problems` when given."""
    p, d = case(name, "prefill"), case(name, "decode")
    if p is None or d is None:
        return None
    for side, c in (("prefill", p), ("decode", d)):
        n = c.get("transfers")
        if not isinstance(n, int) or n <= 0 or c.get("verified") != n:
            problems.append(f"{name} {side}: {c.get('verified')} of {n} transfers verified")
        if c.get("failed_lanes") != failed_lanes:
            (problems if lane_problems is None else lane_problems).append(
                f"{name} {side}: failed_lanes = {c.get('failed_lanes')}, expected {failed_lanes}")
    if d.get("bytes_checked") != d.get("verified"):
        problems.append(f"{name}: the decode checked {d.get('bytes_checked')} of {d.get('verified')}")
    return p.get("gb_per_s")


def counters(vm):
    """(name, device) -> {counter: value}, from VM `vm`'s counters file (lines of
    NAME DEVICE key=value...)."""
    table = {}
    path = out / f"counters-{vm}.txt"
    if not path.exists():
        problems.append(f"no hardware counters from VM {vm}")
        return table
    for line in path.read_text().split("\n"):
        parts = line.split()
        if len(parts) >= 3:
            table[(parts[0], parts[1])] = {
                k: int(v) for k, v in (kv.split("=", 1) for kv in parts[2:] if "=" in kv) if v.isdigit()}
    return table


def delta(table, name, dev):
    """What device `dev`'s counters moved by over run `name`, the counters that moved."""
    before, after = table.get((f"before-{name}", dev)), table.get((f"after-{name}", dev))
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] != before.get(k, 0)}


def rail_shares(name, table, out_problems):
    sent = {}
    for d in ("rxe0", "rxe1"):
        moved = delta(table, name, d)
        if moved is None:
            problems.append(f"{name}: packet counters missing (the run did not finish)")
            return None
        sent[d] = moved.get("sent_pkts", 0)
    all_sent = sum(sent.values())
    for d, n in sent.items():
        if all_sent == 0 or n < all_sent / 4:
            out_problems.append(f"{name}: {d} sent {n} of {all_sent} packets (less than a quarter)")
    return sent


def striped(name, every, out_problems=None):
    """The decode striped every reservation of the run (`every`) or none."""
    out_problems = problems if out_problems is None else out_problems
    d = case(name, "decode")
    if d is None:
        return None
    n, s = d.get("transfers") or 0, d.get("striped")
    if every and (not isinstance(s, int) or s < n):
        out_problems.append(f"{name}: the decode striped {s} of {n} reservations, expected every one")
    if not every and s != 0:
        problems.append(f"{name}: the decode striped {s} reservations with --stripe-pages 0")
    return s


hw_a, hw_b = counters("a"), counters("b")
spontaneous = []


def no_fault_pair(name, every_striped):
    """Runs `name` and `name`-again, both rails and no fault: each verifies every transfer (and
    stripes none, where not striped). The rail checks (no failed lane at either end, each rail
    at least a quarter of the packets, every reservation striped where striped) hold in at
    least one of the two; a lane that failed in the other is reported with both VMs' counters.
    Returns (GB/s, packets per rail, reservations striped) of the first run they hold in."""
    runs = []
    for run in (name, f"{name}-again"):
        lane_problems = []
        gb = all_verified(run, lane_problems=lane_problems)
        s = striped(run, every_striped, lane_problems)
        sent = rail_shares(run, hw_a, lane_problems)
        runs.append((run, gb, sent, s, lane_problems))
    clean = [r for r in runs if not r[4]]
    for run, _, _, _, lane_problems in runs:
        if not lane_problems:
            continue
        log = out / f"{run}-decode.log"
        why = [line.split("WARN", 1)[-1].strip() for line in (log.read_text().splitlines() if log.exists() else [])
               if "queue pair failed" in line]
        spontaneous.append({
            "run": run, "problems": lane_problems, "decode_log": why,
            "counters_a": {d: delta(hw_a, run, d) for d in ("rxe0", "rxe1")},
            "counters_b": {d: delta(hw_b, run, d) for d in ("rxe0", "rxe1")},
        })
        if not clean:
            problems.extend(lane_problems)
    run, gb, sent, s, _ = (clean or runs)[0]
    return gb, sent, s


two, two_sent, two_striped = no_fault_pair("two", True)
flat, flat_sent, flat_striped = no_fault_pair("flat", False)
one = all_verified("one")
back = all_verified("back")
startdown = all_verified("startdown", failed_lanes=1)
stripes = {"two": two_striped, "flat": flat_striped, "back": striped("back", True)}
# (run, device) -> VM a's sent packets at that point.
sent_pkts = {k: v.get("sent_pkts", 0) for k, v in hw_a.items()}
shares = {"two": two_sent, "flat": flat_sent, "back": rail_shares("back", hw_a, problems)}
# Rail 1 down before the connection: rail 0 carried the run, rail 1 nothing.
keys = [(f"{when}-startdown", d) for when in ("before", "after") for d in ("rxe0", "rxe1")]
if any(k not in sent_pkts for k in keys):
    problems.append("startdown: packet counters missing (the run did not finish)")
    startdown_sent = None
else:
    startdown_sent = {
        d: sent_pkts[("after-startdown", d)] - sent_pkts[("before-startdown", d)] for d in ("rxe0", "rxe1")
    }
    if startdown_sent["rxe1"] != 0 or startdown_sent["rxe0"] == 0:
        problems.append(f"startdown: packets sent per rail {startdown_sent}, expected rail 0 only")

# Rail 1 down mid-run.
def liveness_closed(name):
    """Whether either end of run `name` closed its connection by the liveness rule (SPEC
    §8.3: nothing heard from the peer, or it took none of this end's SENDs, for the liveness
    timeout): the rail left up stopped carrying one direction."""
    return any(
        "peer unresponsive:" in (out / f"{name}-{side}.log").read_text()
        for side in ("prefill", "decode") if (out / f"{name}-{side}.log").exists())


def rail_down(name):
    """Judges run `name` (rail 1 taken down mid-run): its summary and its problems."""
    found = []
    p, d = case(name, "prefill"), case(name, "decode")
    if p is None or d is None:
        return {}, [f"{name}: no report"]
    verified_p, unconfirmed = p.get("verified", 0), total(p.get("unconfirmed"))
    failed = total(p.get("failures"))
    summary = {
        "transfers": p.get("transfers"),
        "prefill_verified": verified_p,
        "prefill_failed": p.get("failures"),
        "prefill_unconfirmed": p.get("unconfirmed"),
        "decode_verified": d.get("verified"),
        "decode_bytes_checked": d.get("bytes_checked"),
        "failed_lanes": {"prefill": p.get("failed_lanes"), "decode": d.get("failed_lanes")},
        "moves": {"prefill": p.get("moves"), "decode": d.get("moves")},
        "decode_striped": d.get("striped"),
    }
    if (d.get("striped") or 0) < 1:
        found.append(f"{name}: the decode striped {d.get('striped')} reservations")
    # Both ends saw the lane fail and said so (SenderConnStats/ReceiverConnStats::failed_lanes):
    # the decode's PINGs on every lane make its own SENDs there stall too.
    if p.get("failed_lanes") != 1 or d.get("failed_lanes") != 1:
        found.append(f"{name}: failed_lanes {summary['failed_lanes']}, expected 1 at each end")
    if not (out / f"{name}-at.txt").exists():
        found.append(f"{name}: rail 1 was never taken down")
    if (d.get("moves") or 0) < 1:
        found.append(f"{name}: the decode moved no reservation off rail 1 ({summary['moves']})")
    if d.get("bytes_checked") != d.get("verified"):
        found.append(f"{name}: the decode checked {d.get('bytes_checked')} of {d.get('verified')} verified")
    n = p.get("transfers")
    if failed or unconfirmed or verified_p != n or d.get("verified") != n:
        found.append(
            f"{name}: {verified_p} of {n} verified at the prefill ({failed} failed, {unconfirmed} unconfirmed), "
            f"{d.get('verified')} at the decode: a transfer on the failed rail did not move"
        )
    if found:
        # What the CI's output must carry to tell why (its files do not come back): both
        # ends' warnings (each transfer's own failure line left out), when the rail went
        # down, and what each device's counters moved by.
        def warnings(side):
            log = out / f"{name}-{side}.log"
            lines = [line for line in (log.read_text().splitlines() if log.exists() else [])
                     if (" WARN " in line or " ERROR " in line) and "transfer failed" not in line]
            return lines[:12] + ([f"... {len(lines) - 24} more ..."] if len(lines) > 24 else []) + lines[12:][-12:]
        summary["diagnosis"] = {
            "rail_1_down": (out / f"{name}-at.txt").read_text().strip() if (out / f"{name}-at.txt").exists() else None,
            "liveness_closed": liveness_closed(name),
            "prefill_log": warnings("prefill"),
            "decode_log": warnings("decode"),
            "counters_a": {dev: delta(hw_a, name, dev) for dev in ("rxe0", "rxe1")},
            "counters_b": {dev: delta(hw_b, name, dev) for dev in ("rxe0", "rxe1")},
        }
    return summary, found


# A first run whose connection the liveness rule closed (rail 0 stopped carrying one
# direction for 10 s: seen on the emulated links, BENCHMARKS-LOG) was run once more
# (down-again); the check then holds if the second run passes it, the first reported.
down, down_problems = rail_down("down")
down_stalled = None
if down_problems and liveness_closed("down") and (out / "down-again-prefill.json").exists():
    again, again_problems = rail_down("down-again")
    if again_problems:
        problems.extend(down_problems + again_problems)
        down = {"first": down, "again": again}
    else:
        down_stalled = {"run": down, "problems": down_problems}
        down = again
else:
    problems.extend(down_problems)


# The poll-style manager's renewal run.
renew = {}
try:
    rp = json.loads((out / "renew-prefill.json").read_text())
    rd = json.loads((out / "renew-decode.json").read_text())
except (OSError, ValueError) as e:
    problems.append(f"renew: no report ({e})")
    rp = rd = None
if rp is not None and rd is not None:
    renew = {"prefill": rp, "decode": rd}
    n = rd.get("transfers") or 0
    if rd.get("corrupt") != 0:
        problems.append(f"renew: {rd.get('corrupt')} verified pages differ")
    if rd.get("verified", 0) + 8 < n or rd.get("verified", 0) == 0:
        problems.append(f"renew: the decode verified {rd.get('verified')} of {n}")
    # At least one renewal: a second connection, and the decode's log line. Whether one also
    # came while the rail was still down (then with it left out) depends on when the decode
    # saw the lane fail (SoftRoCE: up to half the liveness timeout), so it is not required.
    if (rp.get("connections") or 0) < 2:
        problems.append(f"renew: the prefill accepted {rp.get('connections')} connection(s): never renewed")
    if not (out / "renew-up-at.txt").exists():
        problems.append("renew: rail 1 was never brought back")
    up, end = ("renew-up", "rxe1"), ("after-renew", "rxe1")
    if up in sent_pkts and end in sent_pkts:
        renew["rxe1_sent_after_the_rail_came_back"] = sent_pkts[end] - sent_pkts[up]
        if sent_pkts[end] - sent_pkts[up] < 1000:
            problems.append(f"renew: rxe1 sent {sent_pkts[end] - sent_pkts[up]} packets after the rail came back: not taken again")
    else:
        problems.append("renew: packet counters missing")
    renew["renewals_logged"] = sum(
        1 for line in (out / "renew-decode.log").read_text().splitlines() if "renewing it" in line
    ) if (out / "renew-decode.log").exists() else 0
    if renew["renewals_logged"] < 1:
        problems.append("renew: the decode logged no renewal")


def ib_write_bw(dev):
    path = out / f"ib_write_bw-{dev}.txt"
    if not path.exists():
        problems.append(f"no ib_write_bw run on {dev}")
        return None
    text = path.read_text()
    m = re.search(r"^\s*65536\s+\d+\s+[\d.]+\s+([\d.]+)", text, re.M)
    return float(m.group(1)) / 1000 if m else None  # MB/s -> GB/s


ibw = {dev: ib_write_bw(dev) for dev in ("rxe0", "rxe1")}
summary = {
    "two_rails_gb_per_s": two,
    "two_rails_unstriped_gb_per_s": flat,
    "one_rail_gb_per_s": one,
    "two_over_one": two / one if two and one else None,
    "two_unstriped_over_one": flat / one if flat and one else None,
    "striped_over_unstriped": two / flat if two and flat else None,
    "reservations_striped": stripes,
    "ib_write_bw_gb_per_s": ibw,
    "one_rail_over_ib_write_bw_rxe0": one / ibw["rxe0"] if one and ibw["rxe0"] else None,
    "packets_sent_per_rail": shares,
    "rail_down": down,
    "rail_down_first_run_closed_by_liveness": down_stalled,
    "rail_down_at_connect_gb_per_s": startdown,
    "rail_down_at_connect_packets_sent": startdown_sent,
    "after_rail_back_gb_per_s": back,
    "renewal": renew,
    "lanes_failed_without_a_fault": spontaneous,
}
print(json.dumps(summary, indent=2))
for problem in problems:
    print(f"rails-check: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
