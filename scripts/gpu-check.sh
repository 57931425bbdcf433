#!/usr/bin/env bash
# The GPU checks of issue 14 as one prepared script, for a machine with an NVIDIA GPU lent
# for a few minutes (docs/GPU.md "What the GPU check runs").
#
#   bash scripts/gpu-check.sh build   # here, without CUDA: release test binaries and the
#                                     # example into target/gpu-check/ (the folder to carry)
#   bash scripts/gpu-check.sh run     # on the GPU machine, from the repository root: runs
#                                     # them (KVWIRE_REQUIRE_GPU=1: no driver/device fails)
#
# `run` needs only the NVIDIA driver and NVRTC (libcuda.so.1, libnvrtc.so*), loaded at run
# time by cudarc; no Rust toolchain. Output goes to stdout and, when $OUT is set, to
# $OUT/gpu-check.log. Exit status: non-zero if any check failed.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/gpu-check

build() {
  mkdir -p "$dir"
  for t in gpu_cuda gpu_tcp; do
    exe=$(cargo test --release --features cuda --test "$t" --no-run --message-format=json \
      | python3 -c 'import json,sys
name=sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("executable") and m.get("target", {}).get("name") == name: print(m["executable"])' "$t" \
      | tail -n 1)
    [ -x "$exe" ] || { echo "gpu-check: no test binary for $t" >&2; exit 1; }
    cp "$exe" "$dir/$t"
  done
  cargo build --release --features cuda --example gpu_digest
  cp target/release/examples/gpu_digest "$dir/gpu_digest"
  ls -l "$dir"
}

run() {
  [ -d "$dir" ] || { echo "gpu-check: $dir missing: run 'bash scripts/gpu-check.sh build' first" >&2; exit 1; }
  export KVWIRE_REQUIRE_GPU=1
  status=0
  nvidia-smi -L 2>/dev/null || echo "gpu-check: nvidia-smi not found (the checks say what they find)"
  echo "== the digest kernels against every golden vector and the CPU (tests/gpu_cuda.rs)"
  "$dir/gpu_cuda" --nocapture --test-threads 1 || status=1
  echo "== TCP between two nodes with KV in GPU memory: verified, landed bytes compared (tests/gpu_tcp.rs)"
  "$dir/gpu_tcp" --nocapture --test-threads 1 || status=1
  echo "== digest throughput over >= 1 GiB of pages in HBM beside a device-to-device copy (examples/gpu_digest.rs)"
  "$dir/gpu_digest" --gib 1 --page-kib 32 --buffers 2 --iters 10 || status=1
  "$dir/gpu_digest" --gib 1 --page-kib 1024 --buffers 2 --iters 10 || status=1
  echo "gpu-check: $([ $status = 0 ] && echo ok || echo FAILED)"
  return $status
}

case "${1:-}" in
  build) build ;;
  run)
    if [ -n "${OUT:-}" ]; then
      run 2>&1 | tee "$OUT/gpu-check.log"
      exit "${PIPESTATUS[0]}"
    fi
    run
    ;;
  *) echo "usage: bash scripts/gpu-check.sh build|run" >&2; exit 2 ;;
esac
