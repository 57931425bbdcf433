#!/usr/bin/env bash
# Fuzzes kvwire-proto with cargo-fuzz (libFuzzer) on the stable toolchain:
#   decode    Frame::decode never panics; decode -> encode gives back the same bytes
#   sender    the sender session under arbitrary peer frames and driver events
#   receiver  the receiver session under arbitrary peer frames, writes and driver events
# (harnesses and invariants: proto/model/src/single.rs). Each target runs for
# FUZZ_SECONDS (default 60) from a seed corpus made of the golden vectors in
# proto/vectors/*.hex, and the number of executions is printed. A crash fails the script;
# its input is left in fuzz/artifacts/TARGET/ (turn it into a test in proto/tests).
#   scripts/fuzz.sh [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO_FUZZ_VERSION=0.12.0
SECONDS_PER_TARGET=${FUZZ_SECONDS:-60}
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(decode sender receiver)

if ! cargo fuzz --version 2>/dev/null | grep -q " $CARGO_FUZZ_VERSION"; then
  echo "== installing cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi

# Stable toolchain: no sanitizer (ASan needs nightly); coverage instrumentation works.
FUZZ_FLAGS=(--sanitizer none -O --debug-assertions)

# Seed corpora from the golden vectors: the raw frames for the decoder; for the session
# targets a "decode this raw frame" operation wrapping each (opcode 7 for the sender,
# 6 for the receiver, then a length byte), plus the raw bytes as a program.
seeds=fuzz/seeds
rm -rf "$seeds"
mkdir -p "$seeds"/{decode,sender,receiver}
for f in proto/vectors/*.hex; do
  name=$(basename "$f" .hex)
  hex=$(grep -v '^[[:space:]]*#' "$f" | tr -d ' \t\r\n')
  esc=$(printf '%s' "$hex" | sed 's/../\\x&/g')
  printf '%b' "$esc" >"$seeds/decode/$name"
  len=$(( ${#hex} / 2 ))
  if [ "$len" -le 255 ]; then
    lenesc=$(printf '\\x%02x' "$len")
    printf '%b' "\\x07$lenesc$esc" >"$seeds/sender/$name"
    printf '%b' "\\x06$lenesc$esc" >"$seeds/receiver/$name"
  fi
  cp "$seeds/decode/$name" "$seeds/sender/raw-$name"
  cp "$seeds/decode/$name" "$seeds/receiver/raw-$name"
done

echo "== building fuzz targets (stable, ${FUZZ_FLAGS[*]})"
(cd fuzz && cargo fuzz build "${FUZZ_FLAGS[@]}")

for t in "${TARGETS[@]}"; do
  echo "== fuzz $t for ${SECONDS_PER_TARGET}s"
  mkdir -p "fuzz/corpus/$t"
  log=$(mktemp)
  if ! (cd fuzz && cargo fuzz run "${FUZZ_FLAGS[@]}" "$t" "corpus/$t" "seeds/$t" -- \
      -max_total_time="$SECONDS_PER_TARGET" -print_final_stats=1 -max_len=4096) >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz target $t FAILED; the input is in fuzz/artifacts/$t/"
    exit 1
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 || true)
  echo "$t: $execs executions in ${SECONDS_PER_TARGET}s ($cov, corpus $(ls "fuzz/corpus/$t" | wc -l) inputs)"
  rm -f "$log"
done
