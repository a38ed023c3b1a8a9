# tests/newuser.cmake: regressions found by using tqkv as a new user would (README,
# Python grpcio, bad flags and files). Request validation (unit), and the CLIs'
# handling of bad flags and damaged files (tqkv-codec, tqkv-bench).
if(TARGET tqkv_service)
  tqkv_check_suite(check_newuser_validate
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_newuser_validate.c
    LIBS tqkv_service LABELS "unit;server" TIMEOUT 120)
endif()

if(TARGET tqkv-codec AND TARGET tqkv-bench AND TARGET tqkv-server)
  add_test(NAME newuser_cli
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/interop/test_newuser_cli.py
            $<TARGET_FILE:tqkv-codec> $<TARGET_FILE:tqkv-bench> $<TARGET_FILE:tqkv-server>)
  set_tests_properties(newuser_cli PROPERTIES LABELS "server" TIMEOUT 300)
endif()
