#!/usr/bin/env bash
# The Python binding's tests (python/, package `kvwire`): builds the wheel with maturin in a
# virtual environment and runs pytest (prefill and decode engines in separate processes over
# TCP, discovery through the embedded bootstrap server and a real etcd).
#
# Self-installing on a fresh Debian 12 machine with a Rust toolchain (as root it installs the
# Debian packages it lacks: python3-venv, protobuf-compiler for etcd-client, etcd-server).
#
#   bash scripts/python-tests.sh            # release wheel with etcd; etcd tests required
#   KVWIRE_PY_FEATURES= bash scripts/...    # without etcd (its test skips with a reason)
#   KVWIRE_PY_PROFILE=debug bash scripts/...
#   KVWIRE_PY_FEATURES=etcd,rdma bash ...   # also the RDMA transport (needs cmake, libclang-dev);
#                                           # the SoftRoCE lane runs a test with it in its VM
#   KVWIRE_PY_BUILD_ONLY=1 bash scripts/... # the venv and the wheel, no pytest
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
FEATURES=${KVWIRE_PY_FEATURES-etcd}
PROFILE=${KVWIRE_PY_PROFILE:-release}
VENV=${KVWIRE_PY_VENV:-target/python-venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
# Pinned: the build backend (also pinned in python/pyproject.toml), numpy, pytest.
MATURIN=maturin==1.8.3
NUMPY=numpy==2.1.3
PYTEST=pytest==8.3.4

need=()
"$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
if [[ ",$FEATURES," == *",etcd,"* ]]; then
  command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
  command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
fi
if [[ ",$FEATURES," == *",rdma,"* ]]; then
  for p in cmake libclang-dev; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "python-tests: missing Debian packages (${need[*]}); install them or run as root" >&2
    exit 1
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

echo "== python: venv $VENV ($("$PYTHON" --version)), $MATURIN $NUMPY $PYTEST"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "$MATURIN" "$NUMPY" "$PYTEST"

echo "== python: wheel (profile $PROFILE, features '${FEATURES}')"
OUT="$PWD/target/python-wheels"
args=(build --locked -i "$VENV/bin/python" -o "$OUT")
[ "$PROFILE" = release ] && args+=(--release)
[ -n "$FEATURES" ] && args+=(--features "$FEATURES")
rm -rf "$OUT"
(cd python && "$VENV/bin/maturin" "${args[@]}")
"$VENV/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$OUT"/kvwire-*.whl

if [ -n "${KVWIRE_PY_BUILD_ONLY:-}" ]; then
  echo "python-tests: built and installed into $VENV (KVWIRE_PY_BUILD_ONLY: no pytest)"
  exit 0
fi

echo "== python: pytest"
if [[ ",$FEATURES," == *",etcd,"* ]]; then
  export KVWIRE_REQUIRE_ETCD=1   # built with etcd and etcd installed: its test must run
fi
set +e
# From the repository root: `import kvwire` is the installed wheel, not python/kvwire. The
# engine adapters' tests run in their own lanes, with the pinned engines installed
# (scripts/sglang-tests.sh, scripts/vllm-tests.sh): here they would only skip.
"$VENV/bin/python" -m pytest -q -rs --ignore-glob='python/tests/test_sglang_*' \
  --ignore-glob='python/tests/test_vllm_*' python/tests
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "python-tests: pytest collected no tests (exit 5): python/tests is missing or broken" >&2
  exit 1
fi
exit $rc
