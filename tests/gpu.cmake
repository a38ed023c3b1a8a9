# tests/gpu.cmake - the GPU path: CPU checks of the shared HD math (label unit, always
# built) and, when CUDA is enabled, GPU tests (label gpu; exit 77 without a device) and
# the tqkv-gpu-bench benchmark (run by tests/gpu/check.sh on a GPU machine).
tqkv_check_suite(check_gpu_math SOURCES gpu/check_gpu_math.c LIBS tqkv_kernels LABELS unit
  TIMEOUT 300)
