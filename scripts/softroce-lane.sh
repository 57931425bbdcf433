#!/usr/bin/env bash
# The SoftRoCE lane: kvwire's RDMA tests (feature `rdma`) on a real verbs stack (rdma_rxe,
# device rxe0), where a missing device is a failure (KVWIRE_REQUIRE_RDMA=1): the device, the
# verbs primitives, the drivers (incidents, abort in flight, late write and recovery), two
# processes with a killed sender; the C example between two processes over RDMA; the Python package's verified-transfer test over RDMA (two
# processes, the same test that runs over TCP); then kvwire bench --transport rdma beside ib_write_bw, and
# their ratio (a failed bench case fails the lane).
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
cargo clippy --quiet -p kvwire -p kvwire-cli --features rdma --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --quiet --no-deps --workspace --features rdma
# Unit tests of the RDMA code that need no device (queue-pair and transport parameters, MTU).
cargo test --quiet -p kvwire --features rdma --lib -- transport::rdma
cargo build --quiet --features rdma --bin kvwire --example quickstart --example engine_integration
# The C ABI with the RDMA transport, and its example linked against it.
cargo build --quiet -p kvwire-capi --features rdma
cc -std=c11 -Wall -Wextra -Werror -Icapi/include capi/examples/transfer.c -Ltarget/debug \
  -lkvwire_capi -Wl,-rpath,"$PWD/target/debug" -o target/capi-transfer
# The RDMA bench is measured with the optimized binary; the rails test runs it and the
# poll-style manager's renewal example.
cargo build --quiet --release --features rdma --bin kvwire --example rails_renewal
# The Python wheel with the RDMA transport: .ci/run builds it (scripts/python-tests.sh with
# KVWIRE_PY_FEATURES=etcd,rdma) and tests it over TCP first; build it here when run alone.
pyvenv=target/python-venv
if ! "$pyvenv/bin/python" -c 'import kvwire' >/dev/null 2>&1; then
  KVWIRE_PY_FEATURES=etcd,rdma KVWIRE_PY_BUILD_ONLY=1 bash scripts/python-tests.sh
fi
out=target/softroce-bench
rm -rf "$out" && mkdir -p "$out"
# The library's RDMA tests, and the CLI's (two `kvwire bench` processes, cli/tests/).
test_binary() {
  cargo test --quiet --features rdma -p "$1" --test "$2" --no-run --message-format=json \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("executable") and m.get("target", {}).get("name") == sys.argv[1]: print(m["executable"])' "$2" | tail -n 1
}
tests=$(test_binary kvwire rdma)
cli_tests=$(test_binary kvwire-cli rdma_processes)
for t in "$tests" "$cli_tests"; do
  [ -x "$t" ] || { echo "softroce-lane: could not find an RDMA test binary ($t)" >&2; exit 1; }
done
KVWIRE_REQUIRE_RDMA=1 bash scripts/softroce-vm.sh "set -euo pipefail
echo '== kvwire doctor --require-rdma'
target/debug/kvwire doctor --require-rdma
echo '== RDMA tests (KVWIRE_REQUIRE_RDMA=1)'
$tests --test-threads 1
$cli_tests --test-threads 1
echo '== the README quickstart over RDMA, two processes'
export KVWIRE_PSK=\$(target/debug/kvwire gen-psk)
target/debug/examples/quickstart --listen 127.0.0.1:7411 --rdma rxe0 &
target/debug/examples/quickstart --connect 127.0.0.1:7411 --rdma rxe0
wait \$!
echo '== engine integration over RDMA: one decode and two prefill engines, their own allocators, chunked sends'
target/debug/examples/engine_integration --rdma rxe0
echo '== the C example over RDMA: decode and prefill processes, every byte and the aux record checked'
rm -f target/capi-addr
KVWIRE_RDMA_DEVICE=rxe0 target/capi-transfer decode target/capi-addr &
for _ in \$(seq 1 300); do [ -s target/capi-addr ] && break; sleep 0.1; done
KVWIRE_RDMA_DEVICE=rxe0 target/capi-transfer prefill \$(cat target/capi-addr)
wait \$!
echo '== Python: verified transfers between two processes over RDMA (one queue pair, three)'
KVWIRE_PY_TRANSPORT=rdma KVWIRE_PY_IB_DEVICE=rxe0 $pyvenv/bin/python -m pytest -q -rs \\
  python/tests/test_transfer.py \\
  -k 'test_chunked_transfer_every_byte_at_the_chosen_pages or test_over_three_lanes_every_byte_lands'
echo '== kvwire bench --transport rdma beside ib_write_bw (same VM run, same sizes and bytes)'
bash scripts/rdma-bench.sh $out"
python3 scripts/rdma-ratio.py "$out"
# Two hosts joined by two links (two VMs, rxe0 and rxe1 each): transfers striped over both
# rails, each carrying its share; one rail beside it and beside ib_write_bw; a rail taken down
# mid-run (nothing unverified, outcomes reconciled) and brought back.
bash scripts/rails-test.sh target/rails
