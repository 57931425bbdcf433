# Sourced by scripts/lib/engine-lane.sh (the SGLang and vLLM lanes): install an engine's pinned
# requirements into a venv with as little disk as the install can take.
#
# An engine venv is ~10.5 GB installed (torch and its CUDA libraries alone ~6 GB), and one pip
# command downloads every wheel before it installs any: installing SGLang's requirements in
# one command peaked at 14.6 GB of disk on 2026-12-07, and a CI machine with 13 GB free failed
# with ENOSPC. So: pip's downloads go to /dev/shm when it has room (they never touch the
# disk: peak ≈ the venv), and torch (with its CUDA libraries, most of the bytes) is installed
# by itself first, so a download directory on disk holds at most half of the wheels at once.
#
#   install_engine_requirements VENV REQUIREMENTS_FILE
install_engine_requirements() {
  local venv=$1 req=$2 tmp torch_pin shm_gb
  shm_gb=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ' || true)
  if [ -n "$shm_gb" ] && [ "$shm_gb" -ge 8 ] 2>/dev/null; then
    tmp=$(mktemp -d /dev/shm/kvwire-pip.XXXXXX)
  else
    mkdir -p target && tmp=$(mktemp -d "$PWD/target/pip-tmp.XXXXXX")
  fi
  echo "== installing $req into $venv (pip's downloads in $tmp)"
  torch_pin=$(grep -E '^torch==' "$req" || true)
  local rc=0
  (
    export TMPDIR=$tmp PIP_NO_CACHE_DIR=1
    set -e
    if [ -n "$torch_pin" ]; then
      "$venv/bin/pip" install -q --disable-pip-version-check "$torch_pin"
    fi
    "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
  ) || rc=$?
  rm -rf "$tmp"
  return $rc
}
