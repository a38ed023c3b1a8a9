# membership.cmake - live membership (transport/membership.c) against a real DNS server:
# dnsmasq on 127.0.0.1 at a free port, records rewritten + SIGHUP (skipped, exit 77,
# where dnsmasq is not installed: apt-get install dnsmasq-base).
tqkv_check_suite(check_membership
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_membership.c
  LIBS tqkv
  LABELS unit
  TIMEOUT 300)

if(TARGET tqkv-server)
  # --node-id: what a client learns at connect time (Stats identity_only, no token),
  # the default (host name), TQKV_NODE_ID, the tqkv_node_info metric, a bad value.
  tqkv_check_suite(check_node_id
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_node_id.c
    LIBS tqkv
    LABELS server
    TIMEOUT 300)
  set_tests_properties(check_node_id PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>")
endif()
