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
