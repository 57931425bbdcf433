"""`python -m kvwire bench` runs its workload end to end (a small case), byte-checked."""

import json
import subprocess
import sys


def test_bench_small_case_is_byte_checked():
    out = subprocess.run(
        [sys.executable, "-m", "kvwire", "bench", "--page-sizes", "64K", "--bytes", "8M",
         "--memory", "32M", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (case,) = json.loads(out.stdout)
    assert case["requests"] == 8 * 2**20 // (4 * 8 * 65536)
    assert case["failed"] == 0 and case["byte_mismatches"] == 0 and case["checked"]
    assert case["GB_per_s"] > 0
