# wire.cmake - what tqkv-server and libtqkv share on the wire, defined once: the
# GetResponse field table (transport/wire.h) against protobuf-c's descriptor, and the
# status table (transport/status_grpc.h) both ways (unit).
tqkv_check_suite(check_wire
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_wire.c ${PROJECT_SOURCE_DIR}/service/status_map.c
  LIBS tqkv
  LABELS unit
  TIMEOUT 60)
