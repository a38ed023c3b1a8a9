# peer_security.cmake - hand-off and forwarding between real tqkv-servers with TLS and
# bearer tokens on (tests/check_peer_security.c): mutual TLS hand-off, forwarding with the
# caller's token (the owner checks it), a peer of another CA refused. Needs the openssl
# tool (skipped, exit 77, without it).
if(TARGET tqkv-server)
  # Sanitized builds: gRPC 1.51's TLS endpoint leaks its read-buffer slice array at exit
  # (seen only as gpr_realloc, libgrpc has no frame pointers), as for check_client_tls.
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/peer_security.lsan "leak:gpr_realloc\n")
  tqkv_check_suite(check_peer_security
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_peer_security.c
    LIBS tqkv
    LABELS shard
    TIMEOUT 300)
  set_tests_properties(check_peer_security PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>;LSAN_OPTIONS=suppressions=${CMAKE_CURRENT_BINARY_DIR}/peer_security.lsan")
endif()
