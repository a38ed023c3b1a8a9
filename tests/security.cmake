# security.cmake - auth and TLS unit suites, the security/fault tests against real
# tqkv-server processes (Python grpcio), and (TQKV_FUZZ=ON, clang) the libFuzzer targets.

tqkv_check_suite(check_auth
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_auth.c ${PROJECT_SOURCE_DIR}/service/auth.c
  LIBS tqkv_kernels
  LABELS unit
  TIMEOUT 120)

tqkv_check_suite(check_tls
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_tls.c ${PROJECT_SOURCE_DIR}/service/tls.c
  LIBS tqkv_kernels PkgConfig::GRPC
  LABELS unit
  TIMEOUT 120)

if(TQKV_FUZZ)
  add_subdirectory(${PROJECT_SOURCE_DIR}/tests/fuzz ${PROJECT_BINARY_DIR}/fuzz)
endif()
