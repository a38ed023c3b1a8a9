# tests/newuser.cmake: tqkv used as a new user would (README, Python grpcio, bad flags
# and files): the CLIs' handling of bad flags and damaged files (tqkv-codec,
# tqkv-bench), and awkward requests against a real server. The request validation
# these trials found gaps in is unit-tested in check_validate (validate.cmake).

if(TARGET tqkv-codec AND TARGET tqkv-bench AND TARGET tqkv-server)
  add_test(NAME newuser_cli
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/interop/test_newuser_cli.py
            $<TARGET_FILE:tqkv-codec> $<TARGET_FILE:tqkv-bench> $<TARGET_FILE:tqkv-server>)
  set_tests_properties(newuser_cli PROPERTIES LABELS "server" TIMEOUT 300)
endif()

# Adversarial new-user trial (Python grpcio against a real server): awkward shapes and
# codecs in both encodings, special BF16 values, bad overrides and Gets, cancelled and
# concurrent streams, oversize messages and responses, every flag and variable.
if(TARGET tqkv-server AND TARGET tqkv-codec)
  set(_adv_env "TQKV_SERVER=$<TARGET_FILE:tqkv-server>;TQKV_CODEC=$<TARGET_FILE:tqkv-codec>"
               "TQKV_SOURCE_DIR=${PROJECT_SOURCE_DIR};PYTHONDONTWRITEBYTECODE=1")
  if(TQKV_SANITIZE)
    list(APPEND _adv_env "TQKV_SANITIZED=1")
  endif()
  add_test(NAME newuser_adversarial
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/interop/test_adversarial.py)
  set_tests_properties(newuser_adversarial PROPERTIES LABELS "server" TIMEOUT 240
    ENVIRONMENT "${_adv_env}")
endif()

# Adversarial trial of the tools (tqkv-codec, tqkv-bench): outputs that cannot be
# written (a full device, a file size limit), one file twice, pipes as input, report
# paths that do not exist, conflicting flags, a TLS server without --tls-ca.
if(TARGET tqkv-server AND TARGET tqkv-codec AND TARGET tqkv-bench)
  add_test(NAME tools_adversarial
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/interop/test_tools_adversarial.py)
  set_tests_properties(tools_adversarial PROPERTIES LABELS "server" TIMEOUT 240
    SKIP_RETURN_CODE 77
    ENVIRONMENT "TQKV_SERVER=$<TARGET_FILE:tqkv-server>;TQKV_CODEC=$<TARGET_FILE:tqkv-codec>;TQKV_BENCH=$<TARGET_FILE:tqkv-bench>;PYTHONDONTWRITEBYTECODE=1")
endif()
