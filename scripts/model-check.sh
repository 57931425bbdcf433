#!/usr/bin/env bash
# Exhaustive model check of the real kvwire-proto sender and receiver sessions (crate
# proto/model): every interleaving of delivery, drop, duplication, write landing/loss,
# fences, digest jobs, timer expiry, local aborts and connection loss, for small bounds.
# Prints states explored and depth per configuration; exits non-zero with a counterexample
# trace if a property fails. About a minute on 2 cores (release build).
#   scripts/model-check.sh            all configurations
#   scripts/model-check.sh --quick    the fault-free one only
#   scripts/model-check.sh NAME...    the named configurations
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p kvwire-model --bin model-check
exec ./target/release/model-check "$@"
