#!/usr/bin/env bash
# run.sh - libFuzzer stage of the test suite: builds the fuzz targets with clang
# (ASan+UBSan, in build-fuzz/), replays every recorded crash, fuzzes each target, and
# keeps any new crash as a regression input under tests/fuzz/regressions/<target>/.
#
#   tests/fuzz/run.sh [SECONDS]
#
# SECONDS (default 60) sets the time per target: each target (7, or 8 with
# fuzz_attention) fuzzes for SECONDS/3 (at least 2 s), up to $(nproc) (at most 4) at a
# time, so 60 gives 20 s per target: about 80 s of wall time on 2 cores, plus the
# first build (several minutes: ASan+UBSan+coverage of the SIMD kernels).
# Exits non-zero when the build fails, a recorded regression still crashes, or
# fuzzing finds a new crash (the input is saved for the next run and the replay tests).
# TQKV_FUZZ_BUILD overrides the build directory; the evolving corpus lives there too.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUDGET=${1:-60}
PER=$((BUDGET / 3))
[ "$PER" -lt 2 ] && PER=2
B=${TQKV_FUZZ_BUILD:-$ROOT/build-fuzz}
JOBS=$(nproc 2>/dev/null || echo 2)
[ "$JOBS" -gt 4 ] && JOBS=4
REG=$ROOT/tests/fuzz/regressions

command -v clang >/dev/null || { echo "fuzz: clang not found (apt-get install clang)"; exit 1; }
mkdir -p "$B"
echo "fuzz: building targets in $B"
if ! cmake -S . -B "$B" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DTQKV_FUZZ=ON \
  -DTQKV_CUDA=OFF -DTQKV_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS=-fsanitize=fuzzer-no-link >"$B.configure.log" 2>&1; then
  tail -30 "$B.configure.log"
  echo "fuzz: configure failed"
  exit 1
fi
if ! cmake --build "$B" -j"$JOBS" --target fuzz_all >"$B.build.log" 2>&1; then
  grep -E 'error|Error' "$B.build.log" | head -30
  echo "fuzz: build failed (log: $B.build.log)"
  exit 1
fi

TARGETS=()
for t in "$B"/fuzz/fuzz_*; do
  [ -x "$t" ] && TARGETS+=("$(basename "$t")")
done
[ "${#TARGETS[@]}" -gt 0 ] || { echo "fuzz: no targets built"; exit 1; }

SEEDS=$B/fuzz-seeds
rm -rf "$SEEDS"
if [ -x "$B/fuzz/tqkv-fuzz-corpus-gen" ]; then
  "$B/fuzz/tqkv-fuzz-corpus-gen" "$SEEDS" || { echo "fuzz: seed corpus generation failed"; exit 1; }
fi

export ASAN_OPTIONS=abort_on_error=1:detect_leaks=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

# fuzz_one TARGET: replay regressions, then fuzz; writes $B/fuzz-logs/TARGET.{log,rc}.
fuzz_one() {
  local t=$1 name=${1#fuzz_}
  local bin=$B/fuzz/$t log=$B/fuzz-logs/$t.log art=$B/fuzz-artifacts/$name
  local corpus=$B/fuzz-corpus/$name
  mkdir -p "$corpus" "$art"
  rm -f "$art"/*
  : >"$log"
  local regs=()
  if [ -d "$REG/$name" ]; then
    while IFS= read -r -d '' f; do regs+=("$f"); done < <(find "$REG/$name" -type f -print0 | sort -z)
  fi
  if [ "${#regs[@]}" -gt 0 ]; then
    if ! "$bin" -timeout=30 "${regs[@]}" >>"$log" 2>&1; then
      echo "replay" >"$B/fuzz-logs/$t.rc"
      return
    fi
  fi
  local dirs=("$corpus")
  [ -d "$SEEDS/$name" ] && dirs+=("$SEEDS/$name")
  "$bin" -max_total_time="$PER" -timeout=20 -rss_limit_mb=2560 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$art/" "${dirs[@]}" >>"$log" 2>&1
  echo $? >"$B/fuzz-logs/$t.rc"
}

rm -rf "$B/fuzz-logs"
mkdir -p "$B/fuzz-logs"
echo "fuzz: ${#TARGETS[@]} targets, ${PER}s each, $JOBS at a time"
running=0
for t in "${TARGETS[@]}"; do
  fuzz_one "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then
    wait -n
    running=$((running - 1))
  fi
done
wait

fail=0
printf '%-22s %10s %8s %s\n' target execs corpus result
for t in "${TARGETS[@]}"; do
  name=${t#fuzz_}
  rc=$(cat "$B/fuzz-logs/$t.rc" 2>/dev/null || echo missing)
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$B/fuzz-logs/$t.log" | grep -oE '[0-9]+$' | tail -1)
  cov=$(grep -oE 'cov: [0-9]+' "$B/fuzz-logs/$t.log" | tail -1 | grep -oE '[0-9]+')
  if [ "$rc" = 0 ]; then
    printf '%-22s %10s %8s %s\n' "$name" "${execs:-?}" "cov:${cov:-?}" ok
    continue
  fi
  fail=1
  if [ "$rc" = replay ]; then
    printf '%-22s %10s %8s %s\n' "$name" - - "FAIL: a recorded regression still crashes"
  else
    printf '%-22s %10s %8s %s\n' "$name" "${execs:-?}" "cov:${cov:-?}" "FAIL: crash (rc $rc)"
    mkdir -p "$REG/$name"
    for a in "$B/fuzz-artifacts/$name"/*; do
      [ -f "$a" ] || continue
      cp "$a" "$REG/$name/"
      echo "  new regression input: tests/fuzz/regressions/$name/$(basename "$a")"
    done
  fi
  grep -E 'ERROR: |SUMMARY: |property violated|runtime error' "$B/fuzz-logs/$t.log" | head -5 | sed 's/^/  /'
done
[ "$fail" -eq 0 ] && echo "fuzz: all targets ok" || echo "fuzz: FAILED (logs in $B/fuzz-logs/)"
exit "$fail"
