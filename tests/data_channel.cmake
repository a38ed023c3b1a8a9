# tests/data_channel.cmake: the TCP data channel (--data-listen, OpenChannel and Get with
# transport TCP) driven from Python grpcio and a plain socket against the real server:
# pages byte-identical to a PACKED gRPC Get, refused hellos, Get errors, clients that
# vanish or stall, auth ownership of channels, the channel limit, SIGTERM with a stalled
# channel, and the start-up checks of --data-listen.
if(TARGET tqkv-server)
  add_test(NAME interop_data_channel
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/interop/test_data_channel.py
            $<TARGET_FILE:tqkv-server> ${PROJECT_SOURCE_DIR}/proto)
  set_tests_properties(interop_data_channel PROPERTIES LABELS "server;interop" TIMEOUT 300)
  if(TQKV_SANITIZE)
    set_tests_properties(interop_data_channel PROPERTIES ENVIRONMENT "TQKV_SANITIZED=1")
  endif()
endif()
