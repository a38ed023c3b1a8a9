#!/usr/bin/env bash
# run.sh - the whole tqkv test suite on a fresh Debian 12 machine:
# installs dependencies, builds (Release, CUDA when nvcc is present), runs every
# CTest test, then every label again under ASan+UBSan, the concurrency tests under
# TSan, and short libFuzzer runs. Prints "N passed, N failed, N skipped" last.
#
#   TQKV_TEST_QUICK=1   skip the sanitizer and fuzz stages (local iteration)
#   TQKV_FUZZ_SECONDS   seconds per fuzz target (default 60)
#   TQKV_TEST_SEED      seed of every seeded test: N, or "random" (each test draws its
#                       own); unset: TQKV_TEST_DEFAULT_SEED in tests/check_main.h.
#                       Printed first and last; every seeded test prints it again.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=$(nproc 2>/dev/null || echo 2)
export TQKV_SOURCE_DIR=$ROOT

if [ -n "${TQKV_TEST_SEED:-}" ]; then
  SEED_LINE="seed: TQKV_TEST_SEED=$TQKV_TEST_SEED (from the environment)"
else
  SEED_LINE="seed: TQKV_TEST_SEED=$(sed -n 's/^#define TQKV_TEST_DEFAULT_SEED \([0-9]*\)u$/\1/p' tests/check_main.h) (the default; set TQKV_TEST_SEED to change it)"
fi
echo "$SEED_LINE"

bash deploy/install-deps.sh || { echo "run.sh: dependency install failed"; exit 1; }

PASS=0
FAIL=0
SKIP=0
FAILED_STAGES=()

# Every process a test starts inherits TQKV_TEST_RUN. One still running after its ctest
# stage that is not this script's own descendant was left behind by a test (a dnsmasq or
# a tqkv-server it never stopped: readthru.py left its dnsmasq running until 2026-12-03):
# the stage fails, naming it, and the process is killed.
export TQKV_TEST_RUN="$$.$(date +%s%N)"
is_ours() { # PID: succeeds when PID is this script or one of its descendants
  local p=$1
  while [ -n "$p" ] && [ "$p" -gt 1 ]; do
    [ "$p" = $$ ] && return 0
    p=$(awk '/^PPid:/ {print $2}' "/proc/$p/status" 2>/dev/null)
  done
  return 1
}
left_behind() { # STAGE
  local e pid n=0
  for e in /proc/[0-9]*/environ; do
    pid=${e#/proc/}
    pid=${pid%/environ}
    tr '\0' '\n' 2>/dev/null <"$e" | grep -qxF "TQKV_TEST_RUN=$TQKV_TEST_RUN" || continue
    is_ours "$pid" && continue
    echo "run.sh: [$1] a test left process $pid running: $(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | cut -c1-300)"
    kill -9 "$pid" 2>/dev/null
    n=$((n + 1))
  done
  if [ "$n" -gt 0 ]; then
    FAIL=$((FAIL + 1))
    FAILED_STAGES+=("$1-left-processes")
  fi
}

# stage NAME BUILD_DIR CTEST_ARGS...: runs ctest and adds up its results.
ctest_stage() {
  local name=$1 dir=$2
  shift 2
  echo "=== [$name] ctest $*"
  local log
  log=$(mktemp)
  (cd "$dir" && ctest --output-on-failure --no-tests=ignore "$@") 2>&1 | tee "$log"
  local total failed skipped
  total=$(grep -oE 'tests failed out of [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  failed=$(grep -oE '[0-9]+ tests failed out of' "$log" | grep -oE '^[0-9]+' | tail -1)
  skipped=$(grep -cE '\*\*\*Skipped|Not Run' "$log")
  total=${total:-0}
  failed=${failed:-0}
  PASS=$((PASS + total - failed - skipped))
  FAIL=$((FAIL + failed))
  SKIP=$((SKIP + skipped))
  [ "$failed" -gt 0 ] && FAILED_STAGES+=("$name")
  rm -f "$log"
  left_behind "$name"
}

build() {
  local dir=$1
  shift
  cmake -S . -B "$dir" "$@" >"$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; return 1; }
  if ! cmake --build "$dir" -j"$JOBS" >"$dir.build.log" 2>&1; then
    grep -E 'error|Error' "$dir.build.log" | head -40
    return 1
  fi
  grep -E 'warning: ' "$dir.build.log" | sort -u | head -20 || true
}

mkdir -p build
echo "=== build (Release)"
if build build -DCMAKE_BUILD_TYPE=Release; then
  ctest_stage release build -j2 --timeout 900
else
  echo "run.sh: Release build failed"; FAIL=$((FAIL + 1)); FAILED_STAGES+=("build")
fi

if [ "${TQKV_TEST_QUICK:-0}" != 1 ]; then
  mkdir -p build-asan
  echo "=== build (ASan+UBSan)"
  if build build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTQKV_SANITIZE=address,undefined -DTQKV_CUDA=OFF; then
    # Every label but deploy (manifest, Dockerfile and dashboard checks: no C code of
    # ours runs in them), engine (vLLM/SGLang/LMCache in Python: an ASan libtqkv cannot
    # load into them) and nemesis (8 servers under faults with stall bounds in seconds:
    # a timing test, run in the Release stage). The suites that cannot load an ASan
    # library into Python (python_*, install) are not registered in a sanitizer build.
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      TQKV_SANITIZED=1 ctest_stage asan build-asan -j2 -LE 'deploy|engine|nemesis' --timeout 900
  else
    echo "run.sh: ASan build failed"; FAIL=$((FAIL + 1)); FAILED_STAGES+=("asan-build")
  fi
  mkdir -p build-tsan
  echo "=== build (TSan)"
  if build build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTQKV_SANITIZE=thread -DTQKV_CUDA=OFF; then
    TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 TQKV_SANITIZED=1 \
      ctest_stage tsan build-tsan -L 'concurrency' --timeout 900
  else
    echo "run.sh: TSan build failed"; FAIL=$((FAIL + 1)); FAILED_STAGES+=("tsan-build")
  fi
  if [ -x tests/fuzz/run.sh ]; then
    echo "=== fuzz"
    if bash tests/fuzz/run.sh "${TQKV_FUZZ_SECONDS:-60}"; then PASS=$((PASS + 1)); else
      FAIL=$((FAIL + 1)); FAILED_STAGES+=("fuzz"); fi
  fi
fi

echo
[ "${#FAILED_STAGES[@]}" -gt 0 ] && echo "failed stages: ${FAILED_STAGES[*]}"
echo "$SEED_LINE"
echo "tests: $PASS passed, $FAIL failed, $SKIP skipped"
[ "$FAIL" -eq 0 ]
