#!/usr/bin/env bash
# kvwire as vLLM's KV connector, tested against vLLM's own code (python/tests/test_vllm_*.py):
# the pinned vllm (python/requirements-vllm.txt) and torch from the registry, kvwire's wheel,
# vLLM's real Scheduler, KV cache planner and allocator, KVConnectorFactory (loading kvwire.vllm
# by module path) and the model runner's connector lifecycle, a prefill engine and a decode
# engine in separate processes, every block compared.
#
# Self-installing on a fresh Debian 12 machine (CPU only): creates target/vllm-venv (reused when
# it already holds the pinned vllm), installs the requirements (a few GB, a few minutes), takes
# the wheel scripts/python-tests.sh built (target/python-wheels) or builds it when it is missing
# or older than the sources, and runs pytest with KVWIRE_REQUIRE_VLLM=1: a missing or broken
# vLLM fails the tests instead of skipping them.
#
#   bash scripts/vllm-tests.sh
#   KVWIRE_VLLM_VENV=/path bash scripts/vllm-tests.sh      # another venv
#   bash scripts/vllm-tests.sh -k layout                     # extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/engine-venv.sh
start=$(date +%s)

PYTHON=${PYTHON:-python3}
VENV=${KVWIRE_VLLM_VENV:-target/vllm-venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
REQ=python/requirements-vllm.txt
VLLM_PIN=$(sed -n 's/^vllm==//p' "$REQ")

if [ "$(id -u)" = 0 ] && ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
fi

have_pin() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_PIN" <<'PY' >/dev/null 2>&1
import sys, importlib.metadata as m
sys.exit(0 if m.version("vllm") == sys.argv[1] else 1)
PY
}

if have_pin; then
  echo "== vllm: reusing $VENV (vllm==$VLLM_PIN)"
else
  echo "== vllm: a new venv $VENV ($("$PYTHON" --version))"
  "$PYTHON" -m venv "$VENV"
  install_engine_requirements "$VENV" "$REQ"
  have_pin || { echo "vllm-tests: vllm==$VLLM_PIN did not install into $VENV" >&2; exit 1; }
fi
# The rest of the pins (pytest) in an existing venv too; a no-op when they are there.
"$VENV/bin/pip" install -q --disable-pip-version-check -r "$REQ"

wheel() { ls -t target/python-wheels/kvwire-*.whl 2>/dev/null | head -1; }
W=$(wheel)
stale=""
if [ -n "$W" ]; then
  stale=$(find python/kvwire python/src python/Cargo.toml python/pyproject.toml src proto Cargo.toml \
    -type f -newer "$W" 2>/dev/null | head -1)
fi
if [ -z "$W" ] || [ -n "$stale" ]; then
  echo "== vllm: building kvwire's wheel (${W:+$stale is newer than $W})"
  KVWIRE_PY_FEATURES=${KVWIRE_PY_FEATURES-etcd} KVWIRE_PY_BUILD_ONLY=1 bash scripts/python-tests.sh
  W=$(wheel)
fi
echo "== vllm: installing $W"
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$W"

echo "== vllm: pytest (vllm==$VLLM_PIN required)"
export KVWIRE_REQUIRE_VLLM=1
set +e
# From the repository root: `import kvwire` is the installed wheel, not python/kvwire.
"$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider -W ignore::DeprecationWarning \
  -W ignore::UserWarning -W ignore::FutureWarning python/tests/test_vllm_*.py "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "vllm-tests: pytest collected no tests (exit 5): python/tests/test_vllm_*.py is missing or broken" >&2
  rc=1
fi
echo "vllm-tests: exit $rc after $(( $(date +%s) - start )) s"
exit $rc
