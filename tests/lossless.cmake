# lossless.cmake - the lossless page mode (TQKV_MODE_RAW): page format, decode, attention
# (check_lossless), at every SIMD level.
tqkv_check_suite(check_lossless SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_lossless.c
  LIBS tqkv_kernels LABELS unit TIMEOUT 300)
foreach(_isa avx2 scalar)
  add_test(NAME check_lossless_${_isa} COMMAND check_lossless)
  set_tests_properties(check_lossless_${_isa} PROPERTIES LABELS unit TIMEOUT 300
    ENVIRONMENT "TQKV_ISA=${_isa};CK_DEFAULT_TIMEOUT=600")
endforeach()
