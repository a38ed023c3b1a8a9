# layout.cmake - docs/design.md's Layout section names every source file of proto,
# service, cache, kernels and transport, and nothing that does not exist
# (tests/docs/check_layout.py).
add_test(NAME docs_layout
  COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/docs/check_layout.py
          ${PROJECT_SOURCE_DIR})
set_tests_properties(docs_layout PROPERTIES LABELS "unit" TIMEOUT 60)
