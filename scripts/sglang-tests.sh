#!/usr/bin/env bash
# kvwire as SGLang's transfer backend, tested against SGLang's own code (python/tests/test_sglang_*.py):
# the pinned sglang (python/requirements-sglang.txt) and torch from the registry, kvwire's wheel,
# SGLang's real ServerArgs / KVArgs / MetadataBuffers / Req / get_kv_class / queue classes with
# kvwire beneath them, a prefill engine and decode engines in separate processes, bytes compared.
#
# Self-installing on a fresh Debian 12 machine (CPU only): creates target/sglang-venv (reused when
# it already holds the pinned sglang), installs the requirements (a few GB, a few minutes), takes
# the wheel scripts/python-tests.sh built (target/python-wheels) or builds it when it is missing
# or older than the sources, and runs pytest with KVWIRE_REQUIRE_SGLANG=1: a missing or broken
# SGLang fails the tests instead of skipping them.
#
#   bash scripts/sglang-tests.sh
#   KVWIRE_SGLANG_VENV=/path bash scripts/sglang-tests.sh      # another venv
#   bash scripts/sglang-tests.sh -k incident                   # extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/engine-lane.sh
run_engine_lane sglang "${KVWIRE_SGLANG_VENV:-target/sglang-venv}" "$@"
