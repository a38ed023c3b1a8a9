#!/bin/bash
# disk_soak.sh - the disk-tier soak of docs/disk.md: tqkv-bench Gets of a working set
# larger than DRAM (32 MiB) and smaller than the disk tier (4 GiB), with the spawned
# server's VmRSS and disk/DRAM metrics sampled every 10 s into OUT/samples.txt.
#
# Usage: disk_soak.sh BUILD_DIR OUT_DIR [SECONDS (600)] [WORKING_SET (96)] [bench args...]
# OUT_DIR holds the disk tier: put it on a real disk (not tmpfs). Exit status: the bench's.
set -u
build=$1 out=$2 dur=${3:-600} ws=${4:-96}
shift $(($# < 4 ? $# : 4))
rm -rf "$out" && mkdir -p "$out" || exit 1
port=$((39000 + RANDOM % 1000))
"$build/transport/bench/tqkv-bench" --spawn-server "$build/service/tqkv-server" \
    --dram-capacity 32MiB \
    --server-arg --disk-path --server-arg "$out/disk" \
    --server-arg --disk-capacity --server-arg 4GiB \
    --server-arg --metrics-listen --server-arg "127.0.0.1:$port" \
    --model llama3-8b --phase decode --working-set "$ws" --concurrency 4 --duration "$dur" \
    --json "$out/soak.json" "$@" > "$out/bench.out" 2> "$out/bench.err" &
bench=$!
server=""
for _ in $(seq 100); do
    server=$(grep -o '(pid [0-9]*' "$out/bench.err" 2>/dev/null | head -1 | tr -dc 0-9)
    [ -n "$server" ] && break
    sleep 1
done
echo "bench $bench server $server metrics 127.0.0.1:$port" > "$out/samples.txt"
t0=$(date +%s)
while kill -0 "$bench" 2> /dev/null; do
    rss=$(awk '/VmRSS/{print $2}' "/proc/$server/status" 2> /dev/null)
    m=$(curl -s --max-time 3 "http://127.0.0.1:$port/metrics" |
        grep -E '^tqkv_tier_(pages|bytes|hits_total|promotions_total|demotions_total|evictions_total|reads_total|io_errors_total|corrupt_records_total)\{tier="(disk|dram)"\}' |
        sed 's/^tqkv_tier_//' | tr '\n' ' ')
    echo "t=$(($(date +%s) - t0)) rss_kb=$rss $m" >> "$out/samples.txt"
    sleep 10
done
wait "$bench"
rc=$?
echo "bench rc=$rc" >> "$out/samples.txt"
grep -E "verify failures|errors|pages found|Get BF16" "$out/bench.out"
exit $rc
