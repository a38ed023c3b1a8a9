# disk.cmake - the disk tier (cache/disk.c): unit suite (label store).
tqkv_check_suite(check_disk
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_disk.c
  LIBS tqkv_cache
  LABELS store unit disk
  TIMEOUT 300)
