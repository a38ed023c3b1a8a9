# tests/gpu.cmake - the GPU path: CPU checks of the shared HD math (label unit, always
# built) and, when CUDA is enabled, GPU tests (label gpu; exit 77 without a device) and
# the tqkv-gpu-bench benchmark (run by tests/gpu/check.sh on a GPU machine).
tqkv_check_suite(check_gpu_math SOURCES gpu/check_gpu_math.c LIBS tqkv_kernels LABELS unit
  TIMEOUT 300)

if(TARGET tqkv_kernels_cuda AND TARGET tqkv_cache)
  tqkv_check_suite(check_gpu SOURCES gpu/check_gpu.c
    LIBS tqkv_kernels_cuda tqkv_cache tqkv_kernels CUDA::cudart LABELS gpu TIMEOUT 300)
  tqkv_check_suite(check_gpu_put SOURCES gpu/check_gpu_put.c ${PROJECT_SOURCE_DIR}/service/gpu_encode.c
    LIBS tqkv_kernels_cuda tqkv_kernels CUDA::cudart Threads::Threads LABELS gpu TIMEOUT 300)
  add_executable(tqkv-gpu-bench gpu/gpu_bench.c)
  target_link_libraries(tqkv-gpu-bench PRIVATE tqkv_flags tqkv_kernels_cuda tqkv_kernels
    CUDA::cudart Threads::Threads ${MATH_LIB})
endif()

# The same GPU suite on the CPU: kernels/*.cu built as host C++ and run by a SIMT
# emulator (tests/gpu/simt_emu.cpp) that also stands in for the CUDA runtime. Needs
# the CUDA headers only; not under sanitizers (coroutine stacks confuse them).
if(TQKV_HAVE_CUDA AND TARGET tqkv_cache AND NOT TQKV_SANITIZE)
  # The emulator's stand-ins for the CUDA device API, force-included into the host
  # builds of kernels/*.cu (gpu/emu_*.cpp), so kernels/ never includes tests/.
  set_source_files_properties(gpu/emu_common.cpp gpu/emu_encode.cpp gpu/emu_decode.cpp
    gpu/emu_attention.cpp PROPERTIES
    COMPILE_OPTIONS "-include;${CMAKE_CURRENT_SOURCE_DIR}/gpu/simt_emu.h")
  tqkv_check_suite(check_gpu_emu SOURCES gpu/check_gpu.c gpu/simt_emu.cpp gpu/emu_common.cpp
    gpu/emu_encode.cpp gpu/emu_decode.cpp gpu/emu_attention.cpp
    LIBS tqkv_cache tqkv_kernels LABELS unit TIMEOUT 300)
  target_compile_definitions(check_gpu_emu PRIVATE TQKV_SIMT_EMU=1)
  # the server's Put encode on the GPU (service/gpu_encode.c) on the emulator
  tqkv_check_suite(check_gpu_put_emu SOURCES gpu/check_gpu_put.c
    ${PROJECT_SOURCE_DIR}/service/gpu_encode.c gpu/simt_emu.cpp gpu/emu_common.cpp
    gpu/emu_encode.cpp gpu/emu_decode.cpp gpu/emu_attention.cpp
    LIBS tqkv_kernels Threads::Threads LABELS unit TIMEOUT 300)
  target_compile_definitions(check_gpu_put_emu PRIVATE TQKV_SIMT_EMU=1 TQKV_HAVE_CUDA=1)
  target_include_directories(check_gpu_put_emu PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  set_target_properties(check_gpu_put_emu PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON)
  target_include_directories(check_gpu_emu PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  set_target_properties(check_gpu_emu PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON)

  # tqkv-gpu-bench end to end on the emulator with tiny sizes: its code paths, not speed.
  add_executable(tqkv-gpu-bench-emu gpu/gpu_bench.c gpu/simt_emu.cpp gpu/emu_common.cpp
    gpu/emu_encode.cpp gpu/emu_decode.cpp gpu/emu_attention.cpp)
  target_link_libraries(tqkv-gpu-bench-emu PRIVATE tqkv_flags tqkv_kernels Threads::Threads
    ${MATH_LIB})
  target_compile_definitions(tqkv-gpu-bench-emu PRIVATE TQKV_SIMT_EMU=1)
  target_include_directories(tqkv-gpu-bench-emu PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  set_target_properties(tqkv-gpu-bench-emu PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON)
  add_test(NAME gpu_bench_emu_smoke COMMAND tqkv-gpu-bench-emu --blocks 1 --block-tokens 16
    --max-context 32 --reps 1)
  set_tests_properties(gpu_bench_emu_smoke PROPERTIES LABELS bench-smoke TIMEOUT 120)
endif()
