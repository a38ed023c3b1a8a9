# tests/install.cmake: libtqkv as installed (issue 17). `cmake --install` into a
# temporary prefix; a C11 and a C++17 program built against the installed headers and
# libtqkv.so with pkg-config alone (-Wall -Werror) and a find_package(tqkv) project,
# run against a real tqkv-server; the soname and the exported symbols are checked.
# Not in sanitizer builds: the consumers are built without the sanitizer runtime.
if(TARGET tqkv-server AND TARGET tqkv_shared AND NOT TQKV_SANITIZE)
  add_test(NAME install_consumers
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/install/run.sh ${PROJECT_BINARY_DIR}
            $<TARGET_FILE:tqkv-server>)
  set_tests_properties(install_consumers PROPERTIES LABELS "unit;interop" TIMEOUT 300)
endif()
