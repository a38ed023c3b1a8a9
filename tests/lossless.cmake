# lossless.cmake - the lossless page mode (TQKV_MODE_RAW): page format, decode, attention
# (check_lossless), and byte-identical round trips through real tqkv-server processes:
# Put/Get over gRPC and the TCP data channel, the disk tier across a restart, and hand-off
# on SIGTERM (tests/interop/test_lossless.py).
tqkv_check_suite(check_lossless SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_lossless.c
  LIBS tqkv_kernels LABELS unit TIMEOUT 300)
foreach(_isa avx2 scalar)
  add_test(NAME check_lossless_${_isa} COMMAND check_lossless)
  set_tests_properties(check_lossless_${_isa} PROPERTIES LABELS unit TIMEOUT 300
    ENVIRONMENT "TQKV_ISA=${_isa};CK_DEFAULT_TIMEOUT=600")
endforeach()
if(TARGET tqkv-server AND TARGET tqkv_shared AND TARGET tqkv-codec AND NOT TQKV_SANITIZE)
  add_test(NAME interop_lossless
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/interop/test_lossless.py)
  set_tests_properties(interop_lossless PROPERTIES LABELS "server;interop;disk" TIMEOUT 300
    ENVIRONMENT "PYTHONPATH=${PROJECT_SOURCE_DIR}/transport/python;TQKV_LIBRARY=$<TARGET_FILE:tqkv_shared>;TQKV_SERVER=$<TARGET_FILE:tqkv-server>;TQKV_CODEC=$<TARGET_FILE:tqkv-codec>")
endif()
# The device side (kernels/decode.cu, attention.cu, encode.cu): on a GPU (label gpu, exit 77
# without one) and on the CPU through the SIMT emulator of tests/gpu.cmake (label unit).
if(TARGET tqkv_kernels_cuda)
  tqkv_check_suite(check_gpu_lossless SOURCES gpu/check_gpu_lossless.c
    LIBS tqkv_kernels_cuda tqkv_kernels CUDA::cudart LABELS gpu TIMEOUT 300)
endif()
if(TQKV_HAVE_CUDA AND NOT TQKV_SANITIZE)
  tqkv_check_suite(check_gpu_lossless_emu SOURCES gpu/check_gpu_lossless.c gpu/simt_emu.cpp
    gpu/emu_common.cpp gpu/emu_encode.cpp gpu/emu_decode.cpp gpu/emu_attention.cpp
    LIBS tqkv_kernels LABELS unit TIMEOUT 300)
  target_compile_definitions(check_gpu_lossless_emu PRIVATE TQKV_SIMT_EMU=1)
  target_include_directories(check_gpu_lossless_emu PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  set_target_properties(check_gpu_lossless_emu PROPERTIES CXX_STANDARD 17
    CXX_STANDARD_REQUIRED ON)
endif()
