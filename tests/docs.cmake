# docs.cmake - the documentation stays true to the code and inside the repository
# (tests/docs/check_flags.py): the flag table of docs/operations.md against
# `tqkv-server --help`, and every relative link of the Markdown files, with no file
# referring to a path outside the repository.
if(TARGET tqkv-server)
  add_test(NAME docs_flags
    COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/docs/check_flags.py flags
            ${PROJECT_SOURCE_DIR} $<TARGET_FILE:tqkv-server>)
  set_tests_properties(docs_flags PROPERTIES LABELS "unit" TIMEOUT 60)
endif()
add_test(NAME docs_links
  COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/docs/check_flags.py links
          ${PROJECT_SOURCE_DIR})
set_tests_properties(docs_links PROPERTIES LABELS "unit" TIMEOUT 60)
