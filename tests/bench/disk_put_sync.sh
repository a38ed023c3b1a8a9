#!/bin/bash
# disk_put_sync.sh - one row of docs/disk.md "Put RPCs with --disk-sync always": a
# tqkv-server with a disk tier in OUT_DIR (--disk-sync MODE), tqkv-bench prefill of OPS Put
# RPCs (pages encoded by the bench, 4 workers), then the server's fdatasync count and the
# bench's Put throughput.
#
# Usage: disk_put_sync.sh BUILD_DIR OUT_DIR none|batch|always [OPS (200)]
set -u
build=$1 out=$2 mode=$3 ops=${4:-200}
rm -rf "$out" && mkdir -p "$out" || exit 1
p=$((40000 + RANDOM % 1000))
m=$((p + 1000))
"$build/service/tqkv-server" --listen "127.0.0.1:$p" --dram-capacity 256MiB \
    --disk-path "$out/disk" --disk-capacity 8GiB --disk-sync "$mode" \
    --metrics-listen "127.0.0.1:$m" > "$out/server.log" 2>&1 &
server=$!
for _ in $(seq 50); do
    curl -s "http://127.0.0.1:$m/metrics" > /dev/null && break
    sleep 0.2
done
"$build/transport/bench/tqkv-bench" --target "127.0.0.1:$p" --model llama3-8b --phase prefill \
    --client-encode --concurrency 4 --ops "$ops" --duration 300 --no-baselines > "$out/bench.out" 2>&1
rc=$?
curl -s "http://127.0.0.1:$m/metrics" |
    grep -E '^tqkv_tier_(syncs_total|writes_total|pages)\{tier="disk"\}|^tqkv_requests_total\{method="Put"'
grep -E "Put BF16|errors|^tqkv-bench: 1 target" "$out/bench.out"
kill "$server"
wait "$server"
exit $rc
