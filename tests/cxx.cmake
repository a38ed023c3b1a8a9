# cxx.cmake - libtqkv's public headers (transport/client.h and the kernels/ headers it
# and its users include) compile as C++17 under g++ -Wall -Wextra -Werror and give C
# linkage (extern "C" guards). Label unit.
find_program(TQKV_CXX NAMES g++ c++)
find_program(TQKV_NM NAMES nm)
add_test(NAME cxx_public_headers
  COMMAND ${CMAKE_COMMAND} -DCXX=${TQKV_CXX} -DNM=${TQKV_NM} -DSRC=${PROJECT_SOURCE_DIR}
          -DOUT=${CMAKE_CURRENT_BINARY_DIR}/cxx_public_headers.o
          -P ${PROJECT_SOURCE_DIR}/tests/cxx/check_headers.cmake)
set_tests_properties(cxx_public_headers PROPERTIES LABELS "unit" TIMEOUT 120)
