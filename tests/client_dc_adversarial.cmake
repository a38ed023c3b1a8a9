# client_dc_adversarial.cmake - libtqkv's TCP data channel client against a broken or
# malicious server (tests/interop/fake_dc_server.py, Python grpcio, one process per
# scenario): bad acks and OpenChannel answers fall back to gRPC within the deadline;
# bad frames, CRCs, lengths, truncation, stalls, stray bytes and contradicting statuses
# fail with a message naming the problem, never deliver a wrong page, never outlast
# the deadline (label server).
if(TARGET tqkv-server)
  tqkv_check_suite(check_client_dc_adversarial
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_client_dc_adversarial.c
    LIBS tqkv
    LABELS server fault
    TIMEOUT 300)
  set_tests_properties(check_client_dc_adversarial PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;FAKE_DC_SERVER=${PROJECT_SOURCE_DIR}/tests/interop/fake_dc_server.py;PYTHON=/usr/bin/python3")
endif()
