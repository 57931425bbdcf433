#!/usr/bin/env bash
# Peer comparison (issue 12): kvwire beside Mooncake Transfer Engine and NIXL on the same
# workload as `kvwire bench --workload engine`, over TCP on 127.0.0.1, every engine as two
# processes (decode/target and prefill/initiator), and one table at the end.
#
# Not part of CI (.ci/run does not call it): it installs third-party wheels from PyPI into a
# virtualenv under target/ and takes a few minutes of both cores.
#
#   scripts/peer-compare.sh                     # builds kvwire (release), 1 GiB per case
#   KVWIRE_BIN=/path/to/kvwire PEERS_BYTES=128M PEERS_MEMORY=256M scripts/peer-compare.sh
#
# Environment:
#   KVWIRE_BIN      kvwire binary (default: `cargo build --release`, target/release/kvwire)
#   PEERS_BYTES     payload per case (default 1G: 128 requests of 8 MiB)
#   PEERS_MEMORY    KV memory per process (default 1G, as 4 buffers)
#   PEERS_ENGINES   which engines, in run order (default "kvwire mooncake nixl")
#   PEERS_KVWIRE_CHECK_BYTES  1: kvwire also compares every byte (inside its window)
#   PEERS_CASES     "PAGE:PAGES:IN_FLIGHT ..." (default the four below)
#   PEERS_OUT       where the JSON of every run and the table go (default target/peer-compare/DATE)
#   PEERS_PYTHON    a CPython 3.11 (the wheels are cp311; default python3.11)
#   PEERS_RAW       0: skip the raw TCP runs (default 1: below)
#   PEERS_BUFFER_OFFSET  every engine's KV buffers (and the raw runs' region) start this many
#                   bytes past a 4 KiB boundary (default 0, on one, as kvwire allocates; a
#                   plain numpy array of this size starts at 16). Where buffers start changes
#                   how fast the kernel's socket copies run on some CPUs, and not alike for
#                   every engine (docs/BENCHMARKS.md, "Which offsets are slow")
#
# Workload per case (cli/src/bench/engine.rs): each process registers PEERS_MEMORY of
# its own memory as 4 buffers; a request is 4 buffers x 32 pages of 64 KiB (or 4 x 2 pages of
# 1 MiB) = 8 MiB, from source pages to destination pages chosen by seeded random permutations
# (kvwire's allocator and seeds); one request in flight, or four.
#
# Checks: kvwire verifies every transfer by digest over the landed memory, inside its timed
# window, as it runs in production (PEERS_KVWIRE_CHECK_BYTES=1 also compares every byte with
# --check-bytes, inside the window too, which charges kvwire for the test). Mooncake and NIXL verify
# nothing: their drivers (bench/peers/) compare every landed byte after the timed window, and
# any difference fails the run. Any failed run fails this script.
#
# Raw TCP (PEERS_RAW=1): before each page size's first case, bench/raw-tcp-poll.c (built with
# cc) moves the same bytes over one TCP connection with no protocol, page-sized sends and
# receives to and from random slots of PEERS_MEMORY, blocking on both ends and then polling on
# both (as NIXL's UCX does): what plain TCP moves on this host during the same run. Not a bound:
# an engine that writes several pages per call (kvwire) can pass it.
set -euo pipefail
cd "$(dirname "$0")/.."

MOONCAKE_PKG=mooncake-transfer-engine-non-cuda==0.3.13.post1
NIXL_PKG=nixl-cu12==1.5.1 # installed --no-deps: torch is only a type-checking import
NUMPY_PKG=numpy==2.4.6
VENV=target/peers-venv
BYTES=${PEERS_BYTES:-1G}
MEMORY=${PEERS_MEMORY:-1G}
ENGINES=${PEERS_ENGINES:-kvwire mooncake nixl}
CASES=${PEERS_CASES:-64K:32:1 1M:2:1 64K:32:4 1M:2:4}
OUT=${PEERS_OUT:-target/peer-compare/$(date -u +%Y%m%dT%H%M%SZ)}
PYTHON=${PEERS_PYTHON:-python3.11}
RUN_TIMEOUT=300
RAW=${PEERS_RAW:-1}
OFFSET=${PEERS_BUFFER_OFFSET:-0}

say() { echo "peer-compare: $*" >&2; }
die() { say "FAILED: $*"; exit 1; }

# --- kvwire
if [ -z "${KVWIRE_BIN:-}" ]; then
  say "building kvwire (cargo build --release --bin kvwire)"
  cargo build --quiet --release --bin kvwire
  KVWIRE_BIN=target/release/kvwire
fi
[ -x "$KVWIRE_BIN" ] || die "KVWIRE_BIN=$KVWIRE_BIN is not an executable"

# --- the peers' virtualenv (pinned), and the one system library Mooncake's engine.so needs
if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
  if [ "$(id -u)" = 0 ]; then
    say "installing libibverbs1 (Mooncake's engine.so links libibverbs.so.1, even for tcp)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    die "Mooncake needs libibverbs.so.1: apt-get install libibverbs1"
  fi
fi
want="$MOONCAKE_PKG $NIXL_PKG $NUMPY_PKG"
if [ "$(cat "$VENV/.pinned" 2>/dev/null)" != "$want" ]; then
  command -v "$PYTHON" >/dev/null || die "$PYTHON not found (the wheels are for CPython 3.11)"
  say "virtualenv $VENV: $want"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "$MOONCAKE_PKG" "$NUMPY_PKG"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "$NIXL_PKG"
  echo "$want" >"$VENV/.pinned"
fi
PY=$VENV/bin/python

mkdir -p "$OUT"
# mebibytes of a size written as kvwire's flags take it (1G, 256M, 1048576)
mib() {
  case $1 in
    *G) echo $((${1%G} * 1024)) ;;
    *M) echo "${1%M}" ;;
    *K) echo $((${1%K} / 1024)) ;;
    *) echo $(($1 / 1048576)) ;;
  esac
}
bytes_of() { case $1 in *K) echo $((${1%K} * 1024)) ;; *M) echo $((${1%M} * 1048576)) ;; *) echo "$1" ;; esac; }
if [ "$RAW" = 1 ]; then
  command -v cc >/dev/null || die "PEERS_RAW=1 needs a C compiler (cc); PEERS_RAW=0 skips the raw TCP runs"
  cc -O2 -o target/raw-tcp-poll bench/raw-tcp-poll.c
fi
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# run_pair NAME TARGET_CMD... -- INITIATOR_CMD...: both processes, target first; both must
# exit 0. stdout of each goes to $OUT/NAME.{target,initiator}.json, stderr to .log.
run_pair() {
  local name=$1; shift
  local tcmd=() icmd=()
  while [ "$1" != -- ]; do tcmd+=("$1"); shift; done; shift
  icmd=("$@")
  timeout "$RUN_TIMEOUT" "${tcmd[@]}" >"$OUT/$name.target.json" 2>"$OUT/$name.target.log" &
  local tpid=$!
  sleep 0.3
  local irc=0 trc=0
  timeout "$RUN_TIMEOUT" "${icmd[@]}" >"$OUT/$name.initiator.json" 2>"$OUT/$name.initiator.log" || irc=$?
  wait "$tpid" || trc=$?
  if [ "$irc" != 0 ] || [ "$trc" != 0 ]; then
    tail -n 5 "$OUT/$name.target.log" "$OUT/$name.initiator.log" >&2 || true
    die "$name: initiator exit $irc, target exit $trc (logs in $OUT)"
  fi
}

"$KVWIRE_BIN" gen-psk >"$OUT/kvwire.psk"
chmod 600 "$OUT/kvwire.psk"
export MC_LOG_LEVEL=WARNING          # Mooncake logs every completed batch at INFO otherwise
export UCX_TLS=tcp UCX_NET_DEVICES=lo # NIXL's UCX: TCP only, over loopback only
say "engines: $ENGINES; cases: $CASES; $BYTES per case, $MEMORY per process; out: $OUT"
say "kvwire verifies every transfer (digests over the landed memory$([ "${PEERS_KVWIRE_CHECK_BYTES:-0}" = 1 ] && echo ', and compares every byte')); Mooncake and NIXL verify nothing (this harness compares every landed byte after their runs)"

raw_done=" "
for case in $CASES; do
  IFS=: read -r page pages inflight <<<"$case"
  if [ "$RAW" = 1 ] && [ "${raw_done#* "$page" }" = "$raw_done" ]; then
    raw_done="$raw_done$page "
    for mode in block:0 poll:3; do
      name="rawtcp.$page.${mode%:*}"
      say "$name"
      timeout "$RUN_TIMEOUT" target/raw-tcp-poll "${mode#*:}" "$(bytes_of "$page")" "$(mib "$BYTES")" \
        "$(free_port)" "$(mib "$MEMORY")" "$OFFSET" >"$OUT/$name.txt" 2>"$OUT/$name.log" ||
        die "$name: exit $? (log in $OUT)"
    done
  fi
  for engine in $ENGINES; do
    name="$engine.$page.c$inflight"
    say "$name"
    case $engine in
      kvwire)
        port=$(free_port)
        common=(bench --workload engine --memory "$MEMORY" --bytes "$BYTES" --page-sizes "$page"
          --pages "$pages" --concurrency "$inflight" --buffer-offset "$OFFSET" --json
          --psk-file "$OUT/kvwire.psk")
        [ "${PEERS_KVWIRE_CHECK_BYTES:-0}" = 1 ] && common+=(--check-bytes)
        run_pair "$name" "$KVWIRE_BIN" "${common[@]}" --listen "127.0.0.1:$port" -- \
          "$KVWIRE_BIN" "${common[@]}" --connect "127.0.0.1:$port"
        ;;
      mooncake | nixl)
        side=127.0.0.1:$(free_port)
        args=(--memory "$MEMORY" --bytes "$BYTES" --page-size "$page" --pages "$pages"
          --concurrency "$inflight" --buffer-offset "$OFFSET" --side "$side")
        run_pair "$name" "$PY" "bench/peers/${engine}_bench.py" --role target "${args[@]}" -- \
          "$PY" "bench/peers/${engine}_bench.py" --role initiator "${args[@]}"
        ;;
      *) die "unknown engine $engine" ;;
    esac
  done
done

PEERS_BUFFER_OFFSET="$OFFSET" "$PY" bench/peers/versions.py "$KVWIRE_BIN" >"$OUT/versions.json"
"$PY" bench/peers/table.py "$OUT" | tee "$OUT/table.md"
