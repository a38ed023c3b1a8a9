# attention.cmake - fused decode attention, BF16/KIVI baselines and the KV policy (attn).
tqkv_check_suite(check_attention SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_attention.c
  LIBS tqkv_kernels LABELS unit TIMEOUT 300)
tqkv_check_suite(check_policy SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_policy.c
  LIBS tqkv_kernels LABELS unit TIMEOUT 60)
# The multi-threaded split-K case alone, for the ThreadSanitizer run (ctest -L concurrency).
add_test(NAME check_attention_threads COMMAND check_attention)
set_tests_properties(check_attention_threads PROPERTIES LABELS "concurrency" TIMEOUT 300
  ENVIRONMENT "CK_RUN_CASE=threads;CK_DEFAULT_TIMEOUT=600")
