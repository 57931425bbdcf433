#!/usr/bin/env bash
# The SoftRoCE lane: kvwire's RDMA tests (feature `rdma`) on a real verbs stack (rdma_rxe,
# device rxe0), where a missing device is a failure (KVWIRE_REQUIRE_RDMA=1): the device,
# verified transfers over RC queue pairs, the stale-pages incident; plus ib_write_bw baselines.
# Runs the host-built binaries inside scripts/softroce-vm.sh (or on the host when its kernel
# has rdma_rxe).
set -euo pipefail
cd "$(dirname "$0")/.."
# Building the verbs bindings (feature `rdma`) needs cmake and libclang.
need=()
for p in cmake libclang-dev python3; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
cargo clippy --quiet -p kvwire --features rdma --all-targets -- -D warnings
cargo build --quiet --features rdma --bin kvwire
# The RDMA bench is measured with the optimized binary.
cargo build --quiet --release --features rdma --bin kvwire
out=target/softroce-bench
rm -rf "$out" && mkdir -p "$out"
tests=$(cargo test --quiet --features rdma --test rdma --no-run --message-format=json \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("executable") and m.get("target", {}).get("name") == "rdma": print(m["executable"])' | tail -n 1)
[ -x "$tests" ] || { echo "softroce-lane: could not find the rdma test binary" >&2; exit 1; }
KVWIRE_REQUIRE_RDMA=1 bash scripts/softroce-vm.sh "set -euo pipefail
echo '== kvwire doctor --require-rdma'
target/debug/kvwire doctor --require-rdma
echo '== RDMA tests (KVWIRE_REQUIRE_RDMA=1)'
$tests --test-threads 1
echo '== ib_write_bw baselines (rxe0, GID index 1, software emulation)'
for size in 65536 1048576; do
  ib_write_bw -d rxe0 -x 1 -s \$size -n 200 -F >/dev/null 2>&1 &
  # The server may take a while to listen on a slow emulated CPU: retry the client.
  for try in \$(seq 1 30); do
    if ib_write_bw -d rxe0 -x 1 -s \$size -n 200 -F localhost > $out/ib_write_bw-\$size.txt 2>&1; then break; fi
    sleep 1
  done
  grep -A1 '#bytes' $out/ib_write_bw-\$size.txt
  wait
done
echo '== kvwire bench --transport rdma (same VM run; verify xxh3, then none)'
target/release/kvwire bench --transport rdma --device rxe0 --page-sizes 64K,1M --pages 2 --bytes \${KVWIRE_RDMA_BENCH_BYTES:-192M} --check-bytes --json > $out/rdma-xxh3.json 2> $out/rdma-xxh3.log
target/release/kvwire bench --transport rdma --device rxe0 --page-sizes 64K,1M --pages 2 --bytes \${KVWIRE_RDMA_BENCH_BYTES:-192M} --verify none --json > $out/rdma-none.json 2> $out/rdma-none.log"
python3 scripts/rdma-ratio.py "$out"
