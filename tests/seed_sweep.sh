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
#   JOBS=N             tests run at once (default 2)
#   SIZES=full|sanitized|both  the tests' sizes: full (the Release stage's), sanitized
#                      (TQKV_SANITIZED=1: the smaller counts and wider bounds the ASan and
#                      TSan stages run, here on this build's binaries), or both (default:
#                      runs 1-2 full, 3-4 sanitized, and so on; 1 and 3 idle, 2 and 4 hog)
# The tests' commands and environments come from CTest (ctest --show-only=json-v1); they
# run without CTest's TIMEOUT and with Check's timeouts x10 (CK_TIMEOUT_MULTIPLIER), so a
# slow loaded machine shows as slow runs, not as failures.
# Exit status: 0 when every run passed, 1 otherwise.
set -uo pipefail
BUILD=${1:-build}
IDLE=${2:-20}
HOG=${3:-10}
JOBS=${JOBS:-2}
SIZES=${SIZES:-both}
# Default: every seeded suite that takes seconds (check_gpu_math included: it emulates the
# CUDA encoder on the CPU); the slower server suites check_client, check_client_adversarial,
# check_client_dc_adversarial, check_disk and check_member_cluster are left to the full run.
TESTS=${TESTS:-'^check_(attention|auth|client_crc|client_dc|client_tls|client_unit|codec_cli|codec_pack|codec_page|codec_quality|codec_rotation|codec_threads|cpu|gpu_math|lossless|membership|metrics|nccl|peer_security|policy|server_policy|shard|store|store_export|store_stress|tls|validate)$'}
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
  san=0
  case $SIZES in
    sanitized) san=1 ;;
    both) san=$(((i / 2) % 2)) ;;
  esac
  next_seed
  log=$(mktemp)
  t0=$(date +%s)
  TQKV_SANITIZED=$san TQKV_TEST_SEED=$seed python3 - "$BUILD" "$TESTS" "$JOBS" >"$log" 2>&1 <<'PY'
# The matching tests' commands and environments from CTest, run here without CTest's
# TIMEOUT (a loaded machine is slow, not wrong: Check's own timeouts are stretched by
# CK_TIMEOUT_MULTIPLIER=10); prints "name pass|FAIL|skip" and a failure's assertions.
import concurrent.futures, json, os, re, subprocess, sys
build, rx, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3])
info = json.loads(subprocess.run(["ctest", "--show-only=json-v1"], cwd=build, check=True,
                                 capture_output=True, text=True).stdout)
tests = [t for t in info["tests"] if re.search(rx, t["name"])]
def run(t):
    env = dict(os.environ, CK_TIMEOUT_MULTIPLIER="10")
    wd = build
    for p in t.get("properties", []):
        if p["name"] == "ENVIRONMENT":
            env.update(kv.split("=", 1) for kv in p["value"])
        elif p["name"] == "WORKING_DIRECTORY":
            wd = p["value"]
    r = subprocess.run(t["command"], cwd=wd, env=env, capture_output=True, text=True)
    out = r.stdout + r.stderr
    st = "pass" if r.returncode == 0 else "skip" if r.returncode == 77 else "FAIL"
    why = [l for l in out.splitlines() if re.search(r":[FE]:", l)][:5]
    return t["name"], st, r.returncode, why
with concurrent.futures.ThreadPoolExecutor(jobs) as ex:
    for name, st, rc, why in ex.map(run, tests):
        print("%s %s %d" % (name, st, rc))
        for w in why:
            print("  " + w)
PY
  t1=$(date +%s)
  total=$(grep -cE '^check_\S+ (pass|FAIL|skip) ' "$log")
  failed=$(awk '$2 == "FAIL" {print $1}' "$log" | tr '\n' ' ')
  rc=0
  { [ -n "$failed" ] || [ "$total" = 0 ]; } && rc=1
  printf 'run %2d  %-4s %-9s TQKV_TEST_SEED=%-20s  %s  %3ss  %s\n' "$((i + 1))" "$mode" \
    "$([ "$san" = 1 ] && echo sanitized || echo full)" "$seed" \
    "$([ "$rc" = 0 ] && echo pass || echo FAIL)" "$((t1 - t0))" \
    "${total} tests${failed:+, failed: $failed}"
  if [ "$rc" != 0 ]; then
    bad=$((bad + 1))
    grep -E '^  ' "$log" | head -5
  fi
  runs=$((runs + 1))
  rm -f "$log"
done
stop_hog
echo "seed_sweep: $((runs - bad)) of $runs runs passed ($IDLE idle, $HOG beside a CPU hog)"
[ "$bad" = 0 ]
