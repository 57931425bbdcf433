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
. scripts/lib/engine-lane.sh
run_engine_lane vllm "${KVWIRE_VLLM_VENV:-target/vllm-venv}" "$@"
