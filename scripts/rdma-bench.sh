#!/usr/bin/env bash
# kvwire's RDMA bench beside ib_write_bw, in one run where rxe0 exists (inside
# scripts/softroce-vm.sh; the lane calls it): the same message sizes and the same bytes.
# Writes ib_write_bw-SIZE.txt, rdma-{xxh3,digest,none,digest-8m}.json (+ .log), retries.txt (rxe's
# retransmissions and duplicate packets during each run) and rxe-counters.txt to OUT;
# scripts/rdma-ratio.py OUT prints the ratios. Needs target/release/kvwire (--features rdma).
set -euo pipefail
out=${1:-target/softroce-bench}
mib=${KVWIRE_RDMA_BENCH_MIB:-192}
dev=${KVWIRE_RDMA_DEVICE:-rxe0}
mkdir -p "$out"
# Retransmissions (rxe's completer_retry_err) and duplicate packets (duplicate_request) during
# one run: a run that resent much measured its ACK timeout as much as the link
# (docs/BENCHMARKS.md, "Retransmissions on SoftRoCE"). Devices without these counters: "-".
counters=/sys/class/infiniband/"$dev"/ports/1/hw_counters
count() { cat "$counters/$1" 2>/dev/null || echo -; }
: >"$out/retries.txt"
measured() { # NAME CMD...: runs CMD, then appends NAME's retries and duplicates to retries.txt
  local name=$1 r0 d0 rc=0
  shift
  r0=$(count completer_retry_err) d0=$(count duplicate_request)
  "$@" || rc=$?
  if [ "$r0" = - ] || [ "$d0" = - ]; then
    echo "$name - -" >>"$out/retries.txt"
  else
    echo "$name $(($(count completer_retry_err) - r0)) $(($(count duplicate_request) - d0))" >>"$out/retries.txt"
  fi
  return $rc
}
for size in 65536 1048576; do
  iters=$((mib * 1048576 / size))
  ibw() {
    ib_write_bw -d "$dev" -x 1 -s "$size" -n "$iters" -F >/dev/null 2>&1 &
    # The server may take a while to listen on a slow emulated CPU: retry the client.
    for _ in $(seq 1 30); do
      if ib_write_bw -d "$dev" -x 1 -s "$size" -n "$iters" -F localhost >"$out/ib_write_bw-$size.txt" 2>&1; then break; fi
      sleep 1
    done
    wait
  }
  measured "ib_write_bw-$size" ibw
  grep -A1 '#bytes' "$out/ib_write_bw-$size.txt"
done
# Heartbeats (SPEC §8.3) queue behind the WRITEs posted before them on the queue pair; under
# TCG emulation rxe moves ~25 MB/s, so 4 transfers of 8 MiB ahead of a PING take over a second
# (and more on a loaded host): a 10 s peer timeout keeps a slow link from passing for a dead peer.
live=(--peer-timeout-ms 10000)
measured rdma-xxh3 target/release/kvwire bench --transport rdma --device "$dev" --page-sizes 64K,1M --pages 2 \
  "${live[@]}" --bytes "${mib}M" --check-bytes --json >"$out/rdma-xxh3.json" 2>"$out/rdma-xxh3.log"
# Verified by digest only, as in production (no harness byte check): the integrity tax alone.
measured rdma-digest target/release/kvwire bench --transport rdma --device "$dev" --page-sizes 64K,1M --pages 2 \
  "${live[@]}" --bytes "${mib}M" --json >"$out/rdma-digest.json" 2>"$out/rdma-digest.log"
measured rdma-none target/release/kvwire bench --transport rdma --device "$dev" --page-sizes 64K,1M --pages 2 \
  "${live[@]}" --bytes "${mib}M" --verify none --json >"$out/rdma-none.json" 2>"$out/rdma-none.log"
# 64 KiB pages in the requests of issue 12's engine workload (8 MiB: 32 pages x 4 buffers; the
# 1 MiB case above is 8 MiB already), verified by digest: the per-transfer work (windows,
# RESERVE, COMMIT, the fence) spread over 128 WRITEs instead of 8.
measured rdma-digest-8m target/release/kvwire bench --transport rdma --device "$dev" --page-sizes 64K --pages 32 \
  "${live[@]}" --bytes "${mib}M" --json >"$out/rdma-digest-8m.json" 2>"$out/rdma-digest-8m.log"
for f in /sys/class/infiniband/"$dev"/ports/1/hw_counters/*; do
  echo "$(basename "$f") $(cat "$f")"
done >"$out/rxe-counters.txt" 2>/dev/null || true
