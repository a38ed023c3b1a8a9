#!/bin/bash
# disk_get_vs_fio.sh - issue 23's disk Get benchmark (docs/disk.md, "Disk Gets against
# fio"): a real tqkv-server with a disk tier and a small DRAM, filled so that the records
# are on disk; then CLIENTS clients x PER_GET pages per Get read the same records over
# the TCP data channel and over gRPC (tqkv-disk-get-bench), and fio --direct=1 reads the
# same (offset, length) list in the same order at the same queue depth (a job per client,
# iodepth = PER_GET, each job replaying its client's reads: tests/bench/disk_records.py).
# ROUNDS rounds, the three paths in a rotated order each round; the load average is
# taken before each measurement. The table gives MB/s of record bytes (what a disk Get
# reads: header, key and page, 4 KiB-aligned) for all three, and the ratios within
# each round. With --hog, a CPU hog (sh -c 'while :; do :; done') runs beside them.
#
# Usage: disk_get_vs_fio.sh BUILD_DIR OUT_DIR [--hog] [--rounds 3] [--count 2000]
#          [--passes 5] [--clients 4] [--per-get 4] [--tokens 256] [--dram 64MiB]
#          [--server-arg ARG]... [--server PATH] [--reuse]
# --server: the tqkv-server to run (default BUILD_DIR/service/tqkv-server); --reuse: keep
# OUT_DIR's disk tier from an earlier run with the same --count and --tokens (no fill).
# OUT_DIR holds the disk tier: put it on the disk to measure (not tmpfs). Needs fio.
# Exit status: 0 ran, 1 could not run (reason on stderr), 77 fio missing.
set -u
build=$1 out=$2
shift 2
server_bin="" reuse=0
hog=0 rounds=3 count=2000 passes=5 clients=4 per_get=4 tokens=256 dram=64MiB
sargs=()
while [ $# -gt 0 ]; do
    case $1 in
    --hog) hog=1 ;;
    --rounds) rounds=$2; shift ;;
    --count) count=$2; shift ;;
    --passes) passes=$2; shift ;;
    --clients) clients=$2; shift ;;
    --per-get) per_get=$2; shift ;;
    --tokens) tokens=$2; shift ;;
    --dram) dram=$2; shift ;;
    --server-arg) sargs+=("$2"); shift ;;
    --server) server_bin=$2; shift ;;
    --reuse) reuse=1 ;;
    *) echo "disk_get_vs_fio: unknown argument $1" >&2; exit 1 ;;
    esac
    shift
done
command -v fio > /dev/null || { echo "SKIPPED: fio is not installed (apt-get install fio)" >&2; exit 77; }
here=$(cd "$(dirname "$0")" && pwd)
[ -n "$server_bin" ] || server_bin=$build/service/tqkv-server
bench=$build/transport/bench/tqkv-disk-get-bench
if [ "$reuse" = 1 ] && [ -d "$out/disk" ]; then
    rm -f "$out"/*.lines "$out"/get.err
else
    reuse=0
    rm -rf "$out" && mkdir -p "$out" || exit 1
fi
port=$((30000 + RANDOM % 20000))
dport=$((port + 1))
target=127.0.0.1:$port
spid=""
hpid=""
cleanup() {
    [ -n "$spid" ] && kill "$spid" 2> /dev/null && wait "$spid" 2> /dev/null
    [ -n "$hpid" ] && kill "$hpid" 2> /dev/null
}
trap cleanup EXIT

start_server() {
    "$server_bin" --listen "$target" --data-listen "127.0.0.1:$dport" --dram-capacity "$dram" \
        --disk-path "$out/disk" --disk-capacity 8GiB "${sargs[@]}" > "$out/server.$1.out" 2> "$out/server.$1.err" &
    spid=$!
    for _ in $(seq 600); do
        grep -q "listening on" "$out/server.$1.out" "$out/server.$1.err" 2> /dev/null && return 0
        kill -0 "$spid" 2> /dev/null || break
        sleep 0.1
    done
    echo "disk_get_vs_fio: the server did not start:" >&2
    cat "$out/server.$1.err" >&2
    return 1
}
stop_server() {
    kill "$spid" && wait "$spid"
    spid=""
}

if [ "$reuse" = 0 ]; then
    start_server fill || exit 1
    "$bench" put --target "$target" --count "$count" --tokens "$tokens" || exit 1
    stop_server
fi
echo "server: $server_bin"
# A restart on the same directory: every block on disk only, DRAM empty.
start_server run || exit 1
grep "tqkv disk:" "$out/server.run.err" "$out/server.run.out" 2> /dev/null | sed 's/^[^:]*://' | head -3
info=$(python3 "$here/disk_records.py" "$out/disk" "$count" "$clients" "$passes" "$out/fio") || exit 1
rec_bytes=$(echo "$info" | sed 's/.*record_bytes_per_pass=\([0-9]*\).*/\1/')
echo "$info"

jobfile=$out/fio.job
engine=io_uring
fio --enghelp 2> /dev/null | grep -q io_uring || engine=libaio
{
    printf '[global]\nioengine=%s\ndirect=1\niodepth=%s\nreplay_no_stall=1\n' "$engine" "$per_get"
    for c in $(seq 0 $((clients - 1))); do
        printf '[client%d]\nread_iolog=%s\n' "$c" "$out/fio.$c.log"
    done
} > "$jobfile"
# The same reads as a synchronous Get client issues them: PER_GET submitted together,
# all PER_GET awaited before the next batch (the column "raw batch").
sed "s/^iodepth=.*/&\\niodepth_batch_submit=$per_get\\niodepth_batch_complete_min=$per_get/" "$jobfile" > "$out/fio_batch.job"

if [ "$hog" = 1 ]; then
    sh -c 'while :; do :; done' &
    hpid=$!
fi

load() { cut -d' ' -f1 /proc/loadavg; }
run_fio() {
    fio --output-format=json "$1" > "$out/fio.json" 2> "$out/fio.err" || { cat "$out/fio.err" >&2; return 1; }
    # fio's io_bytes leaves out the first completions of a replayed log (3 of 8 reads of
    # a log at iodepth 4 here), so the bytes are the list's, checked by the count of
    # reads the jobs issued; the time is the longest job's runtime (they run side by side).
    python3 - "$out/fio.json" "$rec_bytes" "$passes" "$count" << 'EOF'
import json, sys
jobs = json.load(open(sys.argv[1]))["jobs"]
ios = sum(j["read"]["total_ios"] for j in jobs)
want = int(sys.argv[3]) * int(sys.argv[4])
if ios != want or any(j["error"] for j in jobs):
    print("fio issued %d reads, expected %d" % (ios, want), file=sys.stderr)
    sys.exit(1)
secs = max(j["read"]["runtime"] for j in jobs) / 1000.0
print("%.1f" % (int(sys.argv[2]) * int(sys.argv[3]) / secs / 1e6))
EOF
}
run_get() {
    local line
    line=$("$bench" get --target "$target" --transport "$1" --count "$count" --clients "$clients" \
        --per-get "$per_get" --passes "$passes" 2>> "$out/get.err") || { echo "$line" >&2; return 1; }
    echo "$line" >> "$out/get.lines"
    local secs pages disk
    secs=$(echo "$line" | sed 's/.*seconds=\([0-9.]*\).*/\1/')
    pages=$(echo "$line" | sed 's/.* pages=\([0-9]*\).*/\1/')
    disk=$(echo "$line" | sed 's/.* disk=\([0-9]*\).*/\1/')
    python3 -c "print('%.1f %.3f' % ($rec_bytes * $passes / $secs / 1e6, $disk / $pages))"
}

echo
echo "| round (order) | load avg before each | raw fio MB/s | raw batch MB/s | DC MB/s | gRPC MB/s | DC/raw | gRPC/raw | DC/raw batch | gRPC/raw batch | disk-tier share DC, gRPC |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
best_dc=0 best_g=0 best_dcb=0 best_gb=0
all_dc="" all_g=""
for r in $(seq "$rounds"); do
    raw="" rawb="" dc="" g="" l=""
    order=("raw" "tcp" "batch" "grpc")
    case $((r % 3)) in
    2) order=("tcp" "batch" "grpc" "raw") ;;
    0) order=("grpc" "raw" "tcp" "batch") ;;
    esac
    for p in "${order[@]}"; do
        l="$l$(load)/"
        case $p in
        raw) raw=$(run_fio "$jobfile") || exit 1 ;;
        batch) rawb=$(run_fio "$out/fio_batch.job") || exit 1 ;;
        tcp) dc=$(run_get tcp) || exit 1 ;;
        grpc) g=$(run_get grpc) || exit 1 ;;
        esac
    done
    read -r dcm dcs <<< "$dc"
    read -r gm gs <<< "$g"
    rd=$(python3 -c "print('%.2f' % ($dcm / $raw))")
    rg=$(python3 -c "print('%.2f' % ($gm / $raw))")
    best_dc=$(python3 -c "print(max($best_dc, $rd))")
    rdb=$(python3 -c "print('%.2f' % ($dcm / $rawb))")
    rgb=$(python3 -c "print('%.2f' % ($gm / $rawb))")
    best_g=$(python3 -c "print(max($best_g, $rg))")
    all_dc="$all_dc $rd" all_g="$all_g $rg"
    best_dcb=$(python3 -c "print(max($best_dcb, $rdb))")
    best_gb=$(python3 -c "print(max($best_gb, $rgb))")
    echo "| $r (${order[*]}) | ${l%/} | $raw | $rawb | $dcm | $gm | $rd | $rg | $rdb | $rgb | $dcs, $gs |"
done
echo
med() { python3 -c "import statistics,sys; print('%.2f' % statistics.median(map(float, sys.argv[1:])))" $1; }
echo "median of $rounds: DC/raw $(med "$all_dc"), gRPC/raw $(med "$all_g")"
echo "best of $rounds: DC/raw $best_dc, gRPC/raw $best_g; DC/raw batch $best_dcb, gRPC/raw batch $best_gb (hog=$hog, $clients clients x $per_get pages per Get, $count records, $passes passes, fio $engine iodepth $per_get)"

# The serving path without the disk: the same Gets (4 clients x PER_GET pages, the first
# DRAM_REF_COUNT records) from a server whose DRAM holds them (a restart on the same
# directory with --dram-capacity 512MiB, two warm-up passes). A synchronous client's Get
# costs its disk reads plus this path's time, so DC/raw is at most about
# 1 / (1 + raw / DRAM-served rate).
stop_server
dram=512MiB
start_server dramref || exit 1
refn=$((count < 400 ? count : 400))
echo
echo "| served from DRAM ($refn records, same page size, ${clients} clients x ${per_get} pages per Get) | load avg | DC MB/s | gRPC MB/s |"
echo "|---|---|---|---|"
rec_bytes_ref=$(python3 -c "print($rec_bytes * $refn // $count)")
for r in $(seq "$rounds"); do
    l=$(load)
    out1=$("$bench" get --target "$target" --transport tcp --count "$refn" --clients "$clients" --per-get "$per_get" --passes 10 --warmup 2)
    out2=$("$bench" get --target "$target" --transport grpc --count "$refn" --clients "$clients" --per-get "$per_get" --passes 10 --warmup 2)
    s1=$(echo "$out1" | sed 's/.*seconds=\([0-9.]*\).*/\1/')
    s2=$(echo "$out2" | sed 's/.*seconds=\([0-9.]*\).*/\1/')
    d1=$(echo "$out1" | sed 's/.* dram=\([0-9]*\).*/\1/')
    echo "| round $r (DRAM-tier pages: $d1 of $((refn * 10))) | $l | $(python3 -c "print('%.1f' % ($rec_bytes_ref * 10 / $s1 / 1e6))") | $(python3 -c "print('%.1f' % ($rec_bytes_ref * 10 / $s2 / 1e6))") |"
done
