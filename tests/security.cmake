# security.cmake - auth and TLS unit suites, replay of the fuzz corpora and recorded
# crashes, the security/fault tests against real tqkv-server processes (Python
# grpcio), and (TQKV_FUZZ=ON, clang) the libFuzzer targets in tests/fuzz/.

tqkv_check_suite(check_auth
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_auth.c ${PROJECT_SOURCE_DIR}/service/auth.c
  LIBS tqkv_kernels OpenSSL::Crypto
  LABELS unit
  TIMEOUT 120)

# The timing view of the constant-time token scan (check_auth counts its comparisons):
# built always, registered as a test only in a bench build (a ratio of two timings).
add_executable(auth_scan_bench ${PROJECT_SOURCE_DIR}/tests/bench/auth_scan_bench.c
  ${PROJECT_SOURCE_DIR}/service/auth.c)
target_link_libraries(auth_scan_bench PRIVATE tqkv_flags tqkv_kernels OpenSSL::Crypto)
if(TQKV_BENCH_TESTS)
  add_test(NAME auth_scan_bench COMMAND auth_scan_bench --max-ratio 2)
  set_tests_properties(auth_scan_bench PROPERTIES LABELS "bench" TIMEOUT 120)
endif()

tqkv_check_suite(check_tls
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_tls.c ${PROJECT_SOURCE_DIR}/service/tls.c
  LIBS tqkv_kernels PkgConfig::GRPC OpenSSL::Crypto
  LABELS unit
  TIMEOUT 120)

# A thread that ends while tqkv-server exits keeps its OpenSSL state freed once the
# server's start-up has run tqkv_tls_process_init (tls.h); LeakSanitizer is the judge, so
# it skips (77) in builds without it.
add_executable(openssl_exit ${PROJECT_SOURCE_DIR}/tests/security/openssl_exit.c
  ${PROJECT_SOURCE_DIR}/service/tls.c)
target_link_libraries(openssl_exit PRIVATE tqkv_flags tqkv_kernels PkgConfig::GRPC OpenSSL::Crypto
  Threads::Threads)
add_test(NAME security_openssl_exit COMMAND openssl_exit)
set_tests_properties(security_openssl_exit PROPERTIES LABELS "security" TIMEOUT 60
  SKIP_RETURN_CODE 77)

# ---- fuzz harnesses: replayed over seeds and regressions in every build ----
set(TQKV_FUZZ_DIR ${PROJECT_SOURCE_DIR}/tests/fuzz)
set(TQKV_FUZZ_KINDS put lookup get delete stats)
set(TQKV_FUZZ_SEEDS ${PROJECT_BINARY_DIR}/fuzz-seeds)

# The page encoder (codec part) may not be in the tree yet: the page target and the
# seed generator need it.
set(_tqkv_have_page_codec OFF)
file(GLOB _k_srcs ${PROJECT_SOURCE_DIR}/kernels/*.c)
foreach(f IN LISTS _k_srcs)
  file(STRINGS ${f} _hit REGEX "^tqkv_page_encode\\(")
  if(_hit)
    set(_tqkv_have_page_codec ON)
  endif()
endforeach()

function(tqkv_fuzz_replay name)
  cmake_parse_arguments(A "" "" "SOURCES;LIBS;DEFS;DIRS" ${ARGN})
  add_executable(fuzz-replay-${name} ${TQKV_FUZZ_DIR}/replay_main.c ${A_SOURCES})
  target_compile_definitions(fuzz-replay-${name} PRIVATE ${A_DEFS})
  target_link_libraries(fuzz-replay-${name} PRIVATE tqkv_flags ${A_LIBS})
  add_test(NAME fuzz_replay_${name} COMMAND fuzz-replay-${name}
    ${TQKV_FUZZ_DIR}/regressions/${name} ${TQKV_FUZZ_SEEDS}/${name})
  # Regressions and seeds, plus random mutants of each (a coverage-blind mini fuzzer;
  # the mutant being run is kept in fuzz-last-<target> for a crash).
  set(_mut 2000)
  if(TQKV_SANITIZE)
    set(_mut 300)
  endif()
  set_tests_properties(fuzz_replay_${name} PROPERTIES LABELS "unit;fuzz" TIMEOUT 300
    ENVIRONMENT "TQKV_FUZZ_MUTATIONS=${_mut};TQKV_FUZZ_LAST=${CMAKE_CURRENT_BINARY_DIR}/fuzz-last-${name}")
  if(_tqkv_have_page_codec)
    set_tests_properties(fuzz_replay_${name} PROPERTIES FIXTURES_REQUIRED fuzz_seeds)
  endif()
endfunction()

if(_tqkv_have_page_codec)
  add_executable(tqkv-fuzz-corpus ${TQKV_FUZZ_DIR}/gen_corpus.c)
  target_link_libraries(tqkv-fuzz-corpus PRIVATE tqkv_flags tqkv_kernels tqkv_proto)
  add_test(NAME fuzz_seed_corpus COMMAND tqkv-fuzz-corpus ${TQKV_FUZZ_SEEDS})
  set_tests_properties(fuzz_seed_corpus PROPERTIES LABELS "unit;fuzz" FIXTURES_SETUP fuzz_seeds
    TIMEOUT 300)
  tqkv_fuzz_replay(page SOURCES ${TQKV_FUZZ_DIR}/fuzz_page.c LIBS tqkv_kernels)
  if(EXISTS ${PROJECT_SOURCE_DIR}/kernels/attention.h)
    tqkv_fuzz_replay(attention SOURCES ${TQKV_FUZZ_DIR}/fuzz_attention.c LIBS tqkv_kernels)
  endif()
endif()
if(EXISTS ${PROJECT_SOURCE_DIR}/service/validate.c)
  foreach(kind IN LISTS TQKV_FUZZ_KINDS)
    list(FIND TQKV_FUZZ_KINDS ${kind} _i)
    math(EXPR _k "${_i} + 1")
    tqkv_fuzz_replay(validate_${kind}
      SOURCES ${TQKV_FUZZ_DIR}/fuzz_validate.c ${PROJECT_SOURCE_DIR}/service/validate.c
      LIBS tqkv_kernels tqkv_proto DEFS FUZZ_KIND=${_k})
  endforeach()
endif()
if(TARGET tqkv AND EXISTS ${PROJECT_SOURCE_DIR}/transport/client.c)
  tqkv_fuzz_replay(client_get SOURCES ${TQKV_FUZZ_DIR}/fuzz_client_get.c LIBS tqkv)
endif()
tqkv_fuzz_replay(auth SOURCES ${TQKV_FUZZ_DIR}/fuzz_auth.c ${PROJECT_SOURCE_DIR}/service/auth.c
  LIBS tqkv_kernels OpenSSL::Crypto)

if(TQKV_FUZZ)
  add_subdirectory(${TQKV_FUZZ_DIR} ${PROJECT_BINARY_DIR}/fuzz)
endif()

# ---- security and fault tests against real tqkv-server processes ----
# /usr/bin/python3 (Debian's, with grpcio and numpy), stubs generated at test time.
if(TARGET tqkv-server)
  function(tqkv_server_pytest name script labels timeout)
    add_test(NAME ${name} COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/${script})
    set_tests_properties(${name} PROPERTIES LABELS "${labels}" TIMEOUT ${timeout}
      ENVIRONMENT "TQKV_SERVER=$<TARGET_FILE:tqkv-server>;TQKV_SOURCE_DIR=${PROJECT_SOURCE_DIR};PYTHONDONTWRITEBYTECODE=1")
  endfunction()
  tqkv_server_pytest(security_auth tests/security/test_auth.py security 180)
  tqkv_server_pytest(security_tls tests/security/test_tls.py security 180)
  tqkv_server_pytest(security_dc_tls tests/security/test_dc_tls.py security 180)
  tqkv_server_pytest(security_reload tests/security/test_reload.py security 240)
  tqkv_server_pytest(security_limits tests/security/test_limits.py security 240)
  tqkv_server_pytest(fault_clients tests/fault/test_faults.py fault 300)
endif()
