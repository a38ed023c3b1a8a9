# dc_tls.cmake - the data channels' TLS record layer (transport/dc_tls.c: kTLS or the
# userspace TLS 1.3 records) against OpenSSL's own record layer over TCP loopback: large
# buffers over many records, reads that do not line up with records, key updates both
# ways, close_notify, a tampered record, the three suites.
tqkv_check_suite(check_dc_tls
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_dc_tls.c
  LIBS tqkv
  LABELS "unit;security"
  TIMEOUT 300)
