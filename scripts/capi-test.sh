#!/usr/bin/env bash
# The C ABI lane (issue 11): builds kvwire-capi (cdylib + staticlib), runs its tests (the
# header's drift check against cbindgen =0.29.4, the boundary's unit tests, and the C
# example across two processes with its negative control) and the polled facade's tests,
# then links the example statically and compiles the header as C++ too.
#   scripts/capi-test.sh            (CC overrides the C compiler, CXX the C++ one)
# `cargo test --workspace` already runs the capi tests; this adds the static link, the C++
# header check and a run of the statically linked example.
set -euo pipefail
cd "$(dirname "$0")/.."
CC=${CC:-cc}
CXX=${CXX:-c++}
TARGET_DIR=${CARGO_TARGET_DIR:-target}
LIB="$TARGET_DIR/debug"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

echo "== cargo build -p kvwire-capi"
cargo build -p kvwire-capi
echo "== cargo test -p kvwire-capi (header drift, boundary, C example across two processes)"
cargo test -p kvwire-capi
echo "== cargo test -p kvwire --test polled (the facade)"
cargo test -p kvwire --test polled

echo "== the header compiles as C++ (-Wall -Wextra -Werror)"
printf '#include "kvwire.h"\nint main() { kvwire_config_t c; return kvwire_config_init(&c); }\n' \
  > "$OUT/header.cpp"
"$CXX" -Wall -Wextra -Werror -Icapi/include -c "$OUT/header.cpp" -o "$OUT/header.o"

echo "== the example, linked statically, across two processes"
"$CC" -std=c11 -Wall -Wextra -Werror -Icapi/include capi/examples/transfer.c \
  "$LIB/libkvwire_capi.a" -lpthread -ldl -lm -o "$OUT/transfer"
KVWIRE_PSK=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
export KVWIRE_PSK
"$OUT/transfer" decode "$OUT/addr" &
DECODE=$!
for _ in $(seq 1 500); do [ -s "$OUT/addr" ] && break; sleep 0.02; done
[ -s "$OUT/addr" ] || { echo "decode never listened"; kill "$DECODE" 2>/dev/null; exit 1; }
timeout 60 "$OUT/transfer" prefill "$(cat "$OUT/addr")"
timeout 60 tail --pid="$DECODE" -f /dev/null || { kill "$DECODE"; exit 1; }
wait "$DECODE"
echo "capi lane: ok"
