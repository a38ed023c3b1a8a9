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
#          [--server-arg ARG]...
# OUT_DIR holds the disk tier: put it on the disk to measure (not tmpfs). Needs fio.
# Exit status: 0 ran, 1 could not run (reason on stderr), 77 fio missing.
set -u
build=$1 out=$2
shift 2
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
    *) echo "disk_get_vs_fio: unknown argument $1" >&2; exit 1 ;;
    esac
    shift
done
command -v fio > /dev/null || { echo "SKIPPED: fio is not installed (apt-get install fio)" >&2; exit 77; }
here=$(cd "$(dirname "$0")" && pwd)
server_bin=$build/service/tqkv-server
bench=$build/transport/bench/tqkv-disk-get-bench
rm -rf "$out" && mkdir -p "$out" || exit 1
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

start_server fill || exit 1
"$bench" put --target "$target" --count "$count" --tokens "$tokens" || exit 1
stop_server
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

if [ "$hog" = 1 ]; then
    sh -c 'while :; do :; done' &
    hpid=$!
fi

load() { cut -d' ' -f1 /proc/loadavg; }
run_fio() {
    fio --output-format=json "$jobfile" > "$out/fio.json" 2> "$out/fio.err" || { cat "$out/fio.err" >&2; return 1; }
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
echo "| round | load avg | raw fio MB/s | DC MB/s | gRPC MB/s | DC/raw | gRPC/raw | disk-tier share DC, gRPC |"
echo "|---|---|---|---|---|---|---|---|"
best_dc=0 best_g=0
for r in $(seq "$rounds"); do
    raw="" dc="" g="" l=""
    order=("raw" "tcp" "grpc")
    case $((r % 3)) in
    2) order=("tcp" "grpc" "raw") ;;
    0) order=("grpc" "raw" "tcp") ;;
    esac
    for p in "${order[@]}"; do
        l="$l$(load)/"
        case $p in
        raw) raw=$(run_fio) || exit 1 ;;
        tcp) dc=$(run_get tcp) || exit 1 ;;
        grpc) g=$(run_get grpc) || exit 1 ;;
        esac
    done
    read -r dcm dcs <<< "$dc"
    read -r gm gs <<< "$g"
    rd=$(python3 -c "print('%.2f' % ($dcm / $raw))")
    rg=$(python3 -c "print('%.2f' % ($gm / $raw))")
    best_dc=$(python3 -c "print(max($best_dc, $rd))")
    best_g=$(python3 -c "print(max($best_g, $rg))")
    echo "| $r (${order[*]}) | ${l%/} | $raw | $dcm | $gm | $rd | $rg | $dcs, $gs |"
done
echo
echo "best of $rounds: DC/raw $best_dc, gRPC/raw $best_g (hog=$hog, $clients clients x $per_get pages per Get, $count records, $passes passes, fio $engine iodepth $per_get)"
