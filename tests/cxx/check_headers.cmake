# check_headers.cmake - cmake -P script of the cxx_public_headers test (tests/cxx.cmake):
# compiles tests/cxx/public_headers.cpp with CXX (-std=c++17 -Wall -Wextra -Werror) and
# fails when it does not compile or when the object refers to a C++-mangled tqkv symbol
# (a public header without extern "C" guards).
# Inputs: -DCXX=<compiler> -DSRC=<repository root> -DOUT=<object file> -DNM=<nm>
if(NOT CXX)
  message(FATAL_ERROR "cxx_public_headers: no C++ compiler found (install g++: "
                      "apt-get install g++, part of build-essential)")
endif()
execute_process(
  COMMAND ${CXX} -std=c++17 -Wall -Wextra -Werror -I${SRC} -c ${SRC}/tests/cxx/public_headers.cpp
          -o ${OUT}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cxx_public_headers: a public header does not compile as C++17:\n${out}")
endif()
execute_process(COMMAND ${NM} -u ${OUT} RESULT_VARIABLE rc OUTPUT_VARIABLE syms ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cxx_public_headers: ${NM} -u ${OUT} failed: ${err}")
endif()
string(REGEX MATCHALL "_Z[A-Za-z0-9_]*tqkv[A-Za-z0-9_]*" mangled "${syms}")
if(mangled)
  message(FATAL_ERROR "cxx_public_headers: C++ linkage for libtqkv functions (a public "
                      "header lacks #ifdef __cplusplus extern \"C\" guards): ${mangled}")
endif()
string(REGEX MATCHALL "tqkv_[a-z_]+" plain "${syms}")
list(LENGTH plain n)
if(n LESS 11)
  message(FATAL_ERROR "cxx_public_headers: expected 11 tqkv symbols with C linkage, "
                      "found ${n}: ${plain}")
endif()
message(STATUS "cxx_public_headers: every public header compiles as C++17, ${n} symbols "
               "with C linkage")
