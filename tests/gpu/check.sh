#!/usr/bin/env bash
# tests/gpu/check.sh - everything to run on a machine with a GPU, in < 5 minutes:
# configure with CUDA, build the CUDA targets, run `ctest -L gpu`, run tqkv-gpu-bench
# (codec GB/s next to cudaMemcpy D2D measured in the same run, fused vs BF16 decode
# attention at 4K..128K tokens) and, when PyTorch is importable, SDPA at the same shapes.
# Prints a short summary table last. Usage: tests/gpu/check.sh [build-dir]
set -u
cd "$(dirname "$0")/../.."
BUILD=${1:-build-gpu}
JOBS=${JOBS:-$(nproc)}
LOG=$(mktemp -d)
export PATH=/usr/local/cuda/bin:$PATH
start=$(date +%s)

step() { printf '\n== %s\n' "$*"; }

step "configure ($BUILD, CUDA on)"
cmake -S . -B "$BUILD" -DTQKV_CUDA=ON -DCMAKE_BUILD_TYPE=Release >"$LOG/configure" 2>&1 ||
    { tail -30 "$LOG/configure"; exit 1; }
step "build"
cmake --build "$BUILD" -j"$JOBS" --target tqkv_kernels_cuda tqkv_cache check_gpu check_gpu_math \
    check_gpu_emu tqkv-gpu-bench >"$LOG/build" 2>&1 || { grep -E "error|Error" "$LOG/build" | head -40; exit 1; }

step "ctest -L gpu"
(cd "$BUILD" && timeout 200 ctest -L gpu --output-on-failure) | tee "$LOG/ctest"
ctest_rc=${PIPESTATUS[0]}
(cd "$BUILD" && ctest -R 'check_gpu_math|check_gpu_emu' --output-on-failure) >"$LOG/cpu" 2>&1
cpu_rc=$?

step "tqkv-gpu-bench"
bench=$(find "$BUILD" -name tqkv-gpu-bench -type f -perm -u+x | head -1)
timeout 150 "$bench" | tee "$LOG/bench"
bench_rc=${PIPESTATUS[0]}

sdpa_rc=skipped
if /usr/bin/python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null ||
    python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=python3
    /usr/bin/python3 -c "import torch" 2>/dev/null && PY=/usr/bin/python3
    step "PyTorch SDPA (bf16, same shapes: 32 q heads, 8 kv heads, d128, 1 query token)"
    timeout 60 $PY - <<'EOF' | tee "$LOG/sdpa"
import torch, torch.nn.functional as F
dev = "cuda"
print(f"{'tokens':<8} {'sdpa us':>10}")
for T in (4096, 16384, 32768, 65536, 131072):
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 8, T, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, 8, T, 128, device=dev, dtype=torch.bfloat16)
    # GQA: repeat kv heads (enable_gqa needs torch >= 2.5)
    try:
        f = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        f()
    except TypeError:
        k2, v2 = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        f = lambda: F.scaled_dot_product_attention(q, k2, v2)
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(20):
        s.record(); f(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    print(f"{T:<8} {ts[len(ts)//2]:>10.1f}")
EOF
    sdpa_rc=${PIPESTATUS[0]}
fi

step "summary ($(($(date +%s) - start)) s)"
printf '%-28s %s\n' "ctest -L gpu" "$([ "$ctest_rc" = 0 ] && echo pass || echo "FAIL ($ctest_rc)")"
printf '%-28s %s\n' "check_gpu_math/_emu (CPU)" "$([ "$cpu_rc" = 0 ] && echo pass || echo FAIL)"
case $bench_rc in 0) b=ok ;; 77) b="skipped (no device)" ;; *) b="FAIL ($bench_rc)" ;; esac
printf '%-28s %s\n' "tqkv-gpu-bench" "$b"
printf '%-28s %s\n' "pytorch sdpa" "$sdpa_rc"
grep -E "^cudaMemcpy" "$LOG/bench" || true
awk '/^codec \(/{f=1;next} f&&/^$/{f=0} f' "$LOG/bench" | head -7
awk '/^decode attention/{f=1} f' "$LOG/bench"
[ "$ctest_rc" = 0 ] && [ "$bench_rc" = 0 ]
