# Sourced by scripts/sglang-tests.sh and scripts/vllm-tests.sh: one engine lane, the same steps
# for every engine. Makes (or reuses) a venv holding the engine's pinned version, installs the
# rest of its requirements, installs kvwire's wheel (the one scripts/python-tests.sh built in
# target/python-wheels, built again when it is missing or older than the sources), then runs
# the engine's pytest files with KVWIRE_REQUIRE_<ENGINE>=1 so a missing or broken engine fails
# the tests instead of skipping them. Run from the repository root.
#
#   run_engine_lane ENGINE VENV [PYTEST_ARGS...]
#
# ENGINE names the pin in python/requirements-ENGINE.txt (`ENGINE==VERSION`), the tests
# (python/tests/test_ENGINE_*.py) and the variable that requires it (KVWIRE_REQUIRE_ENGINE, in
# capitals). Exits with pytest's status (1 when it collected nothing).
. "$(dirname "${BASH_SOURCE[0]}")/engine-venv.sh"

run_engine_lane() {
  local engine=$1 venv=$2 start python req pin w stale rc
  shift 2
  start=$(date +%s)
  python=${PYTHON:-python3}
  case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac
  req=python/requirements-$engine.txt
  pin=$(sed -n "s/^$engine==//p" "$req")
  [ -n "$pin" ] || { echo "$engine-tests: $req pins no $engine==VERSION" >&2; return 1; }

  if [ "$(id -u)" = 0 ] && ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  fi

  if engine_pin_installed "$venv" "$engine" "$pin"; then
    echo "== $engine: reusing $venv ($engine==$pin)"
  else
    echo "== $engine: a new venv $venv ($("$python" --version))"
    "$python" -m venv "$venv"
    install_engine_requirements "$venv" "$req"
    engine_pin_installed "$venv" "$engine" "$pin" ||
      { echo "$engine-tests: $engine==$pin did not install into $venv" >&2; return 1; }
  fi
  # The rest of the pins (pytest) in an existing venv too; a no-op when they are there.
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"

  w=$(newest_kvwire_wheel)
  stale=""
  if [ -n "$w" ]; then
    stale=$(find python/kvwire python/src python/Cargo.toml python/pyproject.toml src proto Cargo.toml \
      -type f -newer "$w" 2>/dev/null | head -1)
  fi
  if [ -z "$w" ] || [ -n "$stale" ]; then
    echo "== $engine: building kvwire's wheel (${w:+$stale is newer than $w})"
    KVWIRE_PY_FEATURES=${KVWIRE_PY_FEATURES-etcd} KVWIRE_PY_BUILD_ONLY=1 bash scripts/python-tests.sh
    w=$(newest_kvwire_wheel)
  fi
  echo "== $engine: installing $w"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$w"

  echo "== $engine: pytest ($engine==$pin required)"
  export "KVWIRE_REQUIRE_${engine^^}=1"
  set +e
  # From the repository root: `import kvwire` is the installed wheel, not python/kvwire.
  "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider -W ignore::DeprecationWarning \
    -W ignore::UserWarning -W ignore::FutureWarning python/tests/test_"$engine"_*.py "$@"
  rc=$?
  set -e
  if [ $rc -eq 5 ]; then
    echo "$engine-tests: pytest collected no tests (exit 5): python/tests/test_${engine}_*.py is missing or broken" >&2
    rc=1
  fi
  echo "$engine-tests: exit $rc after $(( $(date +%s) - start )) s"
  return $rc
}

# Whether VENV's python has ENGINE at exactly VERSION.
#   engine_pin_installed VENV ENGINE VERSION
engine_pin_installed() {
  [ -x "$1/bin/python" ] && "$1/bin/python" - "$2" "$3" <<'PY' >/dev/null 2>&1
import sys, importlib.metadata as m
sys.exit(0 if m.version(sys.argv[1]) == sys.argv[2] else 1)
PY
}

# The newest wheel scripts/python-tests.sh built, or nothing (not a failure under pipefail: the
# lane builds one then).
newest_kvwire_wheel() { ls -t target/python-wheels/kvwire-*.whl 2>/dev/null | head -1 || true; }
