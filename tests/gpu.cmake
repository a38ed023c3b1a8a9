# tests/gpu.cmake - the GPU path: CPU checks of the shared HD math (label unit, always
# built) and, when CUDA is enabled, GPU tests (label gpu; exit 77 without a device) and
# the tqkv-gpu-bench benchmark (run by tests/gpu/check.sh on a GPU machine).
tqkv_check_suite(check_gpu_math SOURCES gpu/check_gpu_math.c LIBS tqkv_kernels LABELS unit
  TIMEOUT 300)

if(TARGET tqkv_kernels_cuda AND TARGET tqkv_cache)
  tqkv_check_suite(check_gpu SOURCES gpu/check_gpu.c
    LIBS tqkv_kernels_cuda tqkv_cache tqkv_kernels CUDA::cudart LABELS gpu TIMEOUT 300)
  add_executable(tqkv-gpu-bench gpu/gpu_bench.c)
  target_link_libraries(tqkv-gpu-bench PRIVATE tqkv_flags tqkv_kernels_cuda tqkv_kernels
    CUDA::cudart Threads::Threads ${MATH_LIB})
endif()
