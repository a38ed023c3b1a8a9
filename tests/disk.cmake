# disk.cmake - the disk tier (cache/disk.c): unit suite (label store).
tqkv_check_suite(check_disk
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_disk.c
  LIBS tqkv_cache
  LABELS store unit disk
  TIMEOUT 300)

# The disk tier against real tqkv-server processes (Python grpcio): tiering, the TCP data
# channel, warm restart, kill -9 during Puts (TQKV_DISK_KILL_ROUNDS rounds each, 3 here;
# the 100-round run is `TQKV_DISK_KILL_ROUNDS=100 python3 tests/interop/test_disk_tier.py
# build/service/tqkv-server proto DiskTierTest.test_kill9_always_loses_nothing_acknowledged`).
if(TARGET tqkv-server)
  add_test(NAME interop_disk_tier
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/interop/test_disk_tier.py
            $<TARGET_FILE:tqkv-server> ${PROJECT_SOURCE_DIR}/proto)
  set_tests_properties(interop_disk_tier PROPERTIES LABELS "store;server;interop;disk"
    TIMEOUT 600 ENVIRONMENT "TQKV_DISK_KILL_ROUNDS=3")
endif()

# tqkv-disk-bench: disk-tier Gets vs raw O_DIRECT reads of the same records, Put with room
# vs DRAM full, warm-restart rebuild GB/s, index bytes/page (docs/disk.md). Not a test.
add_executable(tqkv-disk-bench ${PROJECT_SOURCE_DIR}/tests/disk_bench.c)
target_link_libraries(tqkv-disk-bench PRIVATE tqkv_flags tqkv_cache Threads::Threads)
