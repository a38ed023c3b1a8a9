# layout.cmake - docs/design.md's Layout section names every source file of proto,
# service, cache, kernels and transport, and nothing that does not exist
# (tests/docs/check_layout.py); tests/layout/func_len.py: the size limits.
add_test(NAME docs_layout
  COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/docs/check_layout.py
          ${PROJECT_SOURCE_DIR})
set_tests_properties(docs_layout PROPERTIES LABELS "unit" TIMEOUT 60)

# No product function over 150 lines and no product .c file over 1,200 (issue 24's must
# hold), and the checker's own parser on a synthetic long function and file.
add_test(NAME layout_func_len
  COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/layout/func_len.py ${PROJECT_SOURCE_DIR})
add_test(NAME layout_func_len_self
  COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/layout/func_len.py --self-test)
set_tests_properties(layout_func_len layout_func_len_self PROPERTIES LABELS "unit" TIMEOUT 60)
