# attention.cmake - fused decode attention, BF16/KIVI baselines and the KV policy (attn).
tqkv_check_suite(check_attention SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_attention.c
  LIBS tqkv_kernels LABELS unit TIMEOUT 300)
tqkv_check_suite(check_policy SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_policy.c
  LIBS tqkv_kernels LABELS unit TIMEOUT 60)
