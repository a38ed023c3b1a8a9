# tests/server.cmake: tqkv-server. check_server (unit checks of config, validation,
# status mapping, logs, encoder pool) and the Python grpcio interop test against the
# real server binary.
if(TARGET tqkv_service AND TARGET tqkv-server)
  tqkv_check_suite(check_server SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_server.c
    LIBS tqkv_service LABELS "unit;server" TIMEOUT 120)
  add_test(NAME interop_server
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/interop/test_server.py
            $<TARGET_FILE:tqkv-server> ${PROJECT_SOURCE_DIR}/proto)
  set_tests_properties(interop_server PROPERTIES LABELS "server;interop" TIMEOUT 300)
endif()
