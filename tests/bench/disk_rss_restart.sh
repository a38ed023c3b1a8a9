#!/bin/bash
# disk_rss_restart.sh - issue 23's warm-restart RSS (docs/disk.md, "RSS after a warm
# restart"): server A puts COUNT small pages (one 4 KiB record each) into a disk tier;
# its VmRSS after IDLE seconds without traffic is the reference ("a server that put them
# itself"). A is stopped and server B started on the same directory (a warm restart:
# the start-up scan rebuilds the index); B's VmRSS is sampled every 0.5 s for SECONDS
# seconds without traffic. Prints the samples' summary and B's RSS at the end / A's.
#
# Usage: disk_rss_restart.sh BUILD_DIR OUT_DIR [COUNT (400000)] [SECONDS (60)] [IDLE (10)]
#          [DRAM (4MiB)] [server args...]
# Both servers get --dram-capacity DRAM: a small DRAM keeps A's reference close to
# what both hold for the disk tier (the index), rather than A's full DRAM.
# Exit status: 0 when B's RSS at SECONDS is <= 1.1 x A's, 3 when above, 1 could not run.
set -u
build=$1 out=$2 count=${3:-400000} secs=${4:-60} idle=${5:-10} dram=${6:-4MiB}
shift $(($# < 6 ? $# : 6))
sargs=("$@")
server_bin=$build/service/tqkv-server
bench=$build/transport/bench/tqkv-disk-get-bench
rm -rf "$out" && mkdir -p "$out" || exit 1
port=$((30000 + RANDOM % 20000))
target=127.0.0.1:$port
spid=""
trap '[ -n "$spid" ] && kill "$spid" 2> /dev/null' EXIT

launch() {
    "$server_bin" --listen "$target" --dram-capacity "$dram" --disk-path "$out/disk" \
        --disk-capacity 8GiB "${sargs[@]}" > "$out/server.$1.out" 2> "$out/server.$1.err" &
    spid=$!
}
start_server() {
    launch "$1"
    for _ in $(seq 1200); do
        grep -q "listening on" "$out/server.$1.out" 2> /dev/null && return 0
        kill -0 "$spid" 2> /dev/null || break
        sleep 0.05
    done
    echo "disk_rss_restart: the server did not start:" >&2
    cat "$out/server.$1.err" >&2
    return 1
}
rss() { awk '/VmRSS/{print $2}' "/proc/$spid/status"; }
hwm() { awk '/VmHWM/{print $2}' "/proc/$spid/status"; }

start_server put || exit 1
"$bench" put --target "$target" --count "$count" --tokens 16 --heads 1 --dim 16 || exit 1
sleep "$idle"
rss_a=$(rss) hwm_a=$(hwm)
echo "A (put $count pages itself): VmRSS $((rss_a / 1024)) MiB after ${idle} s idle (VmHWM $((hwm_a / 1024)) MiB)"
kill "$spid" && wait "$spid"
du -sh "$out/disk" | cut -f1 | sed 's/^/disk tier: /'

# B: sampled from its start (the scan runs before it listens), every 0.2 s.
: > "$out/rss_b.txt"
t0=$(date +%s%N)
launch restart
ready=""
while :; do
    now=$(date +%s%N)
    ms=$(((now - t0) / 1000000))
    [ "$ms" -ge $((secs * 1000)) ] && break
    kill -0 "$spid" 2> /dev/null || { echo "disk_rss_restart: server B died" >&2; cat "$out/server.restart.err" >&2; exit 1; }
    [ -z "$ready" ] && grep -q "listening on" "$out/server.restart.out" 2> /dev/null && ready=$ms
    echo "$((ms / 1000)).$(printf %03d $((ms % 1000))) $(rss)" >> "$out/rss_b.txt"
    sleep 0.2
done
echo "B listening (scan done) at t = $((ready / 1000)).$(printf %03d $((ready % 1000))) s"
rss_b=$(rss) hwm_b=$(hwm)
grep "tqkv disk:" "$out/server.restart.err" "$out/server.restart.out" 2> /dev/null | sed 's/^[^:]*://' | head -2
python3 - "$out/rss_b.txt" "$rss_a" "$rss_b" "$hwm_b" << 'EOF'
import sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1]) if len(l.split()) == 2]
print("B VmRSS samples: %d, every ~0.2 s" % len(rows))
a, b, hb = float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
peak = max(r[1] for r in rows)
def at(t):
    c = [r for r in rows if r[0] >= t]
    return c[0] if c else rows[-1]
print("B (warm restart): VmRSS MiB at t = " + ", ".join(
    "%g s: %.0f" % (t, at(t)[1] / 1024) for t in (0.5, 1, 2, 3, 5, 10, 20, 30, 45)) +
    "; end (%.0f s): %.0f; peak sampled %.0f, VmHWM %.0f" % (rows[-1][0], b / 1024, peak / 1024, hb / 1024))
above = [r[0] for r in rows if r[1] > 1.1 * a]
back = "%.1f s" % next(r[0] for r in rows if r[0] > above[-1]) if above else "the first sample"
print("B/A at the end: %.3f (must be <= 1.1); B <= 1.1 x A for good from t = %s" % (b / a, back))
sys.exit(0 if b <= 1.1 * a else 3)
EOF
