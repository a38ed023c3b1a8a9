# client.cmake - libtqkv: unit suite (GetResponse reader, rendezvous placement,
# back-off), integration against a real tqkv-server (label server), sharding over
# three servers with one killed and restarted (label shard), and a tqkv-bench smoke
# run with eviction active (label bench-smoke).

tqkv_check_suite(check_client_unit
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_client_unit.c
  LIBS tqkv
  LABELS unit
  TIMEOUT 60)

if(TARGET tqkv-server)
  # TCP data channels (TQKV_CLIENT_TRANSPORT_TCP): pages byte-identical to gRPC's,
  # fallback without --data-listen, cancel mid-stream, concurrent Gets, server restart.
  tqkv_check_suite(check_client_dc
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_client_dc.c
    LIBS tqkv
    LABELS server
    TIMEOUT 300)
  set_tests_properties(check_client_dc PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>")

  tqkv_check_suite(check_client
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_client.c
    LIBS tqkv
    LABELS server
    TIMEOUT 300)
  set_tests_properties(check_client PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>")

  # gRPC 1.51's TLS endpoint leaks its read-buffer slice array at exit (not ours:
  # the stack is grpc_slice_buffer_add_indexed under ExecCtx::Flush in the endpoint's
  # read path). libgrpc has no frame pointers, so LSan's fast unwinder sees only
  # gpr_realloc (slice-array growth): suppressed by that frame, for the TLS binary only.
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/client_tls.lsan "leak:gpr_realloc\n")
  tqkv_check_suite(check_client_tls
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_client_tls.c
    LIBS tqkv
    LABELS server
    TIMEOUT 120)
  set_tests_properties(check_client_tls PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>;LSAN_OPTIONS=suppressions=${CMAKE_CURRENT_BINARY_DIR}/client_tls.lsan")

  # libtqkv's Get page CRC check: real servers behind an in-process proxy that flips one
  # bit inside pages on the wire (single target: TQKV_ECORRUPT; R = 2: the other replica).
  tqkv_check_suite(check_client_crc
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_client_crc.c
    LIBS tqkv
    LABELS server fault
    TIMEOUT 300)
  set_tests_properties(check_client_crc PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>")

  # libtqkv used adversarially by a new C user: NULL/zero arguments, duplicate,
  # unresolvable and refusing targets, servers SIGKILLed mid-Get and mid-Put and
  # restarted on the same port, callbacks that stop a Get, large Gets, open sessions.
  tqkv_check_suite(check_client_adversarial
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_client_adversarial.c
    LIBS tqkv
    LABELS server fault
    TIMEOUT 300)
  set_tests_properties(check_client_adversarial PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>")

  tqkv_check_suite(check_shard
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_shard.c
    LIBS tqkv
    LABELS shard
    TIMEOUT 300)
  set_tests_properties(check_shard PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>")

  if(TARGET tqkv-bench)
    # ~5 s mixed tiny-model run against a spawned server whose DRAM tier holds a few
    # MiB, so eviction runs; the bench exits 3 on any verify failure.
    add_test(NAME bench_smoke
      COMMAND tqkv-bench --spawn-server $<TARGET_FILE:tqkv-server> --dram-capacity 16MiB --lease-ms 500
              --model tiny --block-tokens 64 --duration 5 --concurrency 3 --phase mixed
              --prefix-reuse 0.5 --no-baselines --json -)
    set_tests_properties(bench_smoke PROPERTIES LABELS "bench-smoke;bench" TIMEOUT 120
      PASS_REGULAR_EXPRESSION "\"verify_failures\": 0,"
      FAIL_REGULAR_EXPRESSION "verify failure:")
    add_test(NAME bench_tls_smoke
      COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/bench/tls_smoke.py
              $<TARGET_FILE:tqkv-bench> $<TARGET_FILE:tqkv-server>)
    # gRPC 1.51 leaks a TLS endpoint buffer (gpr_realloc) at exit: suppressed under LSan,
    # as for check_client_tls
    set_tests_properties(bench_tls_smoke PROPERTIES LABELS "bench-smoke;bench;security" TIMEOUT 300
      ENVIRONMENT "LSAN_OPTIONS=suppressions=${CMAKE_CURRENT_BINARY_DIR}/client_tls.lsan")
  endif()
endif()
