#!/usr/bin/env bash
# seed_sweep.sh - runs the seed-dependent Check suites (the ones whose inputs come from
# TQKV_TEST_SEED, tests/check_main.h) under many fresh seeds, on an idle machine and
# beside a CPU hog (one busy loop; the two kinds of run alternate while both are left),
# and prints one line per run and a summary. A statistical bound that fails for some honest seed is a bug in the bound (or the code):
# the failing seed is printed, so `TQKV_TEST_SEED=<seed> ctest -R <test>` replays it.
# Not registered in CTest (it takes minutes); docs/testing.md has the last table.
#
# Usage: tests/seed_sweep.sh [BUILD_DIR] [IDLE_RUNS] [HOG_RUNS]
#   BUILD_DIR  a configured and built tree (default build)
#   IDLE_RUNS  runs without the hog (default 20); HOG_RUNS beside it (default 10)
#   SEEDS="s1 s2 ..."  use these seeds first (then fresh ones from /dev/urandom)
#   TESTS=REGEX        the ctest -R regex (default: the suites below)
#   JOBS=N             ctest -j (default 2)
# Exit status: 0 when every run passed, 1 otherwise.
set -uo pipefail
BUILD=${1:-build}
IDLE=${2:-20}
HOG=${3:-10}
JOBS=${JOBS:-2}
TESTS=${TESTS:-'^check_(attention|codec_cli|codec_pack|codec_page|codec_quality|codec_rotation|codec_threads|cpu|lossless|policy|shard|store|store_export|store_stress|validate)$'}
read -r -a GIVEN <<<"${SEEDS:-}"
[ -d "$BUILD" ] || { echo "seed_sweep: no build directory $BUILD" >&2; exit 2; }

# Sets seed (not in a subshell: it consumes GIVEN).
next_seed() {
  if [ "${#GIVEN[@]}" -gt 0 ]; then
    seed=${GIVEN[0]}
    GIVEN=("${GIVEN[@]:1}")
  else
    seed=$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')
  fi
}

hog_pid=
stop_hog() { [ -n "$hog_pid" ] && kill "$hog_pid" 2>/dev/null; hog_pid=; }
trap stop_hog EXIT
trap 'exit 1' INT TERM

runs=0
bad=0
# Hog and idle runs alternate (while both are left), so a sweep cut short has some of each.
idle_left=$IDLE
hog_left=$HOG
for ((i = 0; i < IDLE + HOG; i++)); do
  mode=idle
  if [ "$hog_left" -gt 0 ] && { [ "$idle_left" -eq 0 ] || [ $((i % 2)) -eq 1 ]; }; then
    mode=hog
  fi
  if [ "$mode" = hog ]; then
    hog_left=$((hog_left - 1))
    [ -n "$hog_pid" ] || { sh -c 'while :; do :; done' & hog_pid=$!; }
  else
    idle_left=$((idle_left - 1))
    stop_hog
  fi
  next_seed
  log=$(mktemp)
  t0=$(date +%s)
  (cd "$BUILD" && TQKV_TEST_SEED=$seed ctest -R "$TESTS" -j"$JOBS" --output-on-failure) >"$log" 2>&1
  rc=$?
  t1=$(date +%s)
  total=$(grep -oE 'tests failed out of [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  failed=$(grep -E '^\s+[0-9]+ - ' "$log" | awk '{print $3}' | tr '\n' ' ')
  printf 'run %2d  %-4s  TQKV_TEST_SEED=%-20s  %s  %3ss  %s\n' "$((i + 1))" "$mode" "$seed" \
    "$([ "$rc" = 0 ] && echo pass || echo FAIL)" "$((t1 - t0))" \
    "${total:-?} tests${failed:+, failed: $failed}"
  if [ "$rc" != 0 ]; then
    bad=$((bad + 1))
    grep -E 'Assertion|:F:|:E:' "$log" | head -5
  fi
  runs=$((runs + 1))
  rm -f "$log"
done
stop_hog
echo "seed_sweep: $((runs - bad)) of $runs runs passed ($IDLE idle, $HOG beside a CPU hog)"
[ "$bad" = 0 ]
