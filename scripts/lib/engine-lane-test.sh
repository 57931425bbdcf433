#!/usr/bin/env bash
# Checks of scripts/lib/engine-lane.sh's helpers that need no engine (a step of .ci/run):
# under `set -euo pipefail`, as the lanes run, finding no kvwire wheel is an empty answer, not a
# failure (the lane exited with status 2 and no message when target/python-wheels was empty,
# instead of building the wheel), the newest of two wheels is found, and a venv that is not
# there holds no engine.
set -euo pipefail
lib="$(cd "$(dirname "$0")" && pwd)/engine-lane.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir"
. "$lib"
fail() { echo "engine-lane-test: $*" >&2; exit 1; }

w=$(newest_kvwire_wheel) || fail "newest_kvwire_wheel failed with no wheels"
[ -z "$w" ] || fail "newest_kvwire_wheel found '$w' with no wheels"

mkdir -p target/python-wheels
touch -d '2026-01-01' target/python-wheels/kvwire-0.1.0-old.whl
touch target/python-wheels/kvwire-0.1.0-new.whl
w=$(newest_kvwire_wheel)
[ "$w" = target/python-wheels/kvwire-0.1.0-new.whl ] || fail "newest_kvwire_wheel found '$w', not the newer wheel"

if engine_pin_installed "$dir/no-venv" sglang 0.5.23; then fail "a missing venv holds sglang"; fi
echo "engine-lane-test: ok"
