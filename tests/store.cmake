# store.cmake - the tiered page store (cache/): unit suite (its device tier part apart,
# label gpu), concurrent stress test
# (also run under TSan through the "concurrency" label) and the reuse-trace benchmark.

tqkv_check_suite(check_store
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_store.c
  LIBS tqkv_cache
  LABELS store unit
  TIMEOUT 120)
set_tests_properties(check_store PROPERTIES ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;CK_RUN_CASE=core")
# The same binary on a real CUDA device tier (label gpu): exits 77 (skipped) without one.
add_test(NAME check_store_device COMMAND check_store)
set_tests_properties(check_store_device PROPERTIES LABELS gpu TIMEOUT 120 SKIP_RETURN_CODE 77
  ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;CK_RUN_CASE=device")

tqkv_check_suite(check_store_stress
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_store_stress.c
  LIBS tqkv_cache
  LABELS store concurrency
  TIMEOUT 300)

# tqkv-store-bench: hit rate of LRU vs S3-FIFO on a Zipf + shared-prefix trace, and
# put/get/lookup ops/s at 1 and 2 threads. A command that prints tables, not a test.
add_executable(tqkv-store-bench ${PROJECT_SOURCE_DIR}/tests/store_bench.c)
target_link_libraries(tqkv-store-bench PRIVATE tqkv_flags tqkv_cache tqkv_test_support Threads::Threads ${MATH_LIB})
