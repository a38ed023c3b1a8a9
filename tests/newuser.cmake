# tests/newuser.cmake: regressions found by using tqkv as a new user would (README,
# Python grpcio, bad flags and files). Request validation (unit), and the CLIs'
# handling of bad flags and damaged files (tqkv-codec, tqkv-bench).
if(TARGET tqkv_service)
  tqkv_check_suite(check_newuser_validate
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_newuser_validate.c
    LIBS tqkv_service LABELS "unit;server" TIMEOUT 120)
endif()
