# tests/server.cmake: tqkv-server. check_server (unit checks of config, status
# mapping, logs, encoder pool) and the Python grpcio interop test against the
# real server binary.
if(TARGET tqkv_service AND TARGET tqkv-server)
  tqkv_check_suite(check_server SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_server.c
    LIBS tqkv_service LABELS "unit;server" TIMEOUT 120)
  add_test(NAME interop_server
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/interop/test_server.py
            $<TARGET_FILE:tqkv-server> ${PROJECT_SOURCE_DIR}/proto)
  set_tests_properties(interop_server PROPERTIES LABELS "server;interop" TIMEOUT 300)
endif()

# Regression: a BF16 Get aborted the server when a read-ahead decode finished after
# its block had already been sent (a late WAKE in the STATUS state). Small blocks and
# several workers make that interleaving frequent; the bench fails on any error.
if(TARGET tqkv-server AND TARGET tqkv-bench)
  add_test(NAME regression_bf16_get_late_wake
    COMMAND tqkv-bench --spawn-server $<TARGET_FILE:tqkv-server> --model tiny --encoding bf16
            --block-tokens 32 --duration 4 --concurrency 3 --no-baselines --json -)
  set_tests_properties(regression_bf16_get_late_wake PROPERTIES LABELS "server" TIMEOUT 120
    PASS_REGULAR_EXPRESSION "\"verify_failures\": 0,"
    FAIL_REGULAR_EXPRESSION "verify failure:|unexpected event|\"errors\": [1-9]")
endif()

# Per-namespace codec policies (--namespace-policy): the spec parser (case "config",
# label unit) and a real server whose pages must carry each namespace's policy (case
# "server"). One binary, two CTest entries split by Check's CK_RUN_CASE.
if(TARGET tqkv_service AND TARGET tqkv-server)
  tqkv_check_suite(check_server_policy SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_server_policy.c
    LIBS tqkv_service LABELS "server" TIMEOUT 300)
  set_tests_properties(check_server_policy PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;CK_RUN_CASE=server;TQKV_SERVER=$<TARGET_FILE:tqkv-server>")
  add_test(NAME check_server_policy_config COMMAND check_server_policy)
  set_tests_properties(check_server_policy_config PROPERTIES LABELS "unit;server" TIMEOUT 120
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;CK_RUN_CASE=config")
endif()
