#!/usr/bin/env bash
# quickstart.sh - the README's first command: install dependencies, build, start a
# tqkv-server with its embedded defaults on a free loopback port, run ~30 s of
# tqkv-bench against it (mixed prefill/decode, Llama-3-8B shape, 4 workers, raw
# TCP and Redis baselines in the same run), print the summary, stop the server.
#
#   TQKV_QUICKSTART_SECONDS   bench duration (default 30)
#   TQKV_QUICKSTART_BUILD     build directory (default build)
#   TQKV_QUICKSTART_SKIP_DEPS 1: do not run deploy/install-deps.sh
#   TQKV_QUICKSTART_JSON      also write the bench JSON here
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_RUN=${TQKV_QUICKSTART_SECONDS:-30}
BUILD=${TQKV_QUICKSTART_BUILD:-build}
JOBS=$(nproc 2>/dev/null || echo 2)

if [ "${TQKV_QUICKSTART_SKIP_DEPS:-0}" != 1 ]; then
  echo "== installing dependencies (deploy/install-deps.sh)"
  bash deploy/install-deps.sh
fi

echo "== building ($BUILD, Release)"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$JOBS" --target tqkv-server tqkv-bench >/dev/null

SERVER=$BUILD/service/tqkv-server
BENCH=$BUILD/transport/bench/tqkv-bench
LOG=$(mktemp -t tqkv-quickstart.XXXXXX)
SERVER_PID=""

cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do
      kill -0 "$SERVER_PID" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -f "$LOG"
}
trap cleanup EXIT INT TERM

echo "== starting tqkv-server (embedded defaults, TCP data channels on, free loopback ports)"
"$SERVER" --listen 127.0.0.1:0 --data-listen 127.0.0.1:0 >"$LOG" 2>&1 &
SERVER_PID=$!
ADDR=""
for _ in $(seq 1 300); do
  ADDR=$(grep -o 'listening on [^ ]*' "$LOG" | head -1 | awk '{print $3}' || true)
  [ -n "$ADDR" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$LOG"; echo "quickstart: tqkv-server exited"; exit 1; }
  sleep 0.1
done
[ -n "$ADDR" ] || { cat "$LOG"; echo "quickstart: tqkv-server did not start"; exit 1; }
echo "   tqkv-server pid $SERVER_PID listening on $ADDR"

echo "== tqkv-bench: ${SECONDS_RUN}s mixed, llama3-8b, concurrency 4, baselines on"
JSON_ARGS=()
[ -n "${TQKV_QUICKSTART_JSON:-}" ] && JSON_ARGS=(--json "$TQKV_QUICKSTART_JSON")
BENCH_RC=0
"$BENCH" --target "$ADDR" --duration "$SECONDS_RUN" --phase mixed --model llama3-8b \
  --concurrency 4 "${JSON_ARGS[@]}" || BENCH_RC=$?
case $BENCH_RC in
0)
  echo
  echo "Reading it: 'Get BF16-equivalent GB/s' is KV delivered as if it were BF16 (the packed"
  echo "pages are 'server compression ratio' times smaller; 'Get wire GB/s' is what crossed the"
  echo "socket); 'verify failures' (CRC and content checks of returned pages) and 'errors'"
  echo "(failed RPCs) must be 0. Baselines on this machine: raw TCP in messages of the mean Get"
  echo "message size (and of the 1 MiB BF16 block), Redis GET of the blocks as raw BF16. This run"
  echo "mixes Puts and Gets, so the Get ratios are low; docs/benchmarks.md's decode-only command"
  echo "(--phase decode) measures Get against them."
  ;;
3) echo "quickstart: FAILED: tqkv-bench found pages that came back wrong (verify failures)" ;;
4) echo "quickstart: FAILED: RPCs failed (the 'tqkv-bench:' lines above say which and why)" ;;
*) echo "quickstart: FAILED: tqkv-bench exited $BENCH_RC" ;;
esac
if [ "$BENCH_RC" != 0 ]; then
  echo "-- last lines of the tqkv-server log:"
  tail -n 20 "$LOG"
fi
exit "$BENCH_RC"
