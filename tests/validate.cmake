# validate.cmake - request validation (service/validate.c): every request kind parsed
# and checked, each refusal naming its field (check_validate.c, label unit).
if(TARGET tqkv_service)
  tqkv_check_suite(check_validate
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_validate.c
    LIBS tqkv_service LABELS "unit;server" TIMEOUT 120)
endif()
