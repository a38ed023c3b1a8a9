# readthru.cmake - owners read through (service/forward.c, tqkv__fwd_get_copy; docs/cluster.md
# "Read-through"): real tqkv-servers on 127.0.0.1.. found through dnsmasq, plain grpcio
# clients (no client-side read repair). restart: a pod SIGTERMed (hand-off) and restarted
# finds all 90 blocks through every pod, byte-identical, its Lookup asks each peer at most
# once, its copies are local afterwards, and a peer SIGKILLed during read-through costs
# neither errors nor time. scaleout: a 4th pod joining finds all 960 blocks (half over a
# TCP data channel: libtqkv's Python package with that one target, no read repair).
# Both also read through a sharding client ("tqkv-hop: 1": the Python package over every
# pod, read repair off; grpcio marked "1" in sanitizer builds) and check that peers'
# asks ("2", or an unknown value) are answered from the store, never forwarded (no loops).
# replicate: --replicate-bytes-per-s; a pod restarted empty gets every block it ranks
# first or second for back from its peers, with no client reading, within the rate.
# Skipped (77) without dnsmasq or 127.0.0.2.
if(TARGET tqkv-server AND EXISTS /usr/bin/python3)
  set(_rt_lib "")
  # scaleout: half the Gets over a TCP data channel, through the Python package; not in
  # sanitizer builds (an ASan libtqkv cannot load into Python): there, gRPC Gets only
  if(TARGET tqkv_shared AND NOT TQKV_SANITIZE)
    set(_rt_lib $<TARGET_FILE:tqkv_shared>)
  endif()
  foreach(mode restart scaleout replicate)
    add_test(NAME member_readthru_${mode}
      COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/member/readthru.py
              $<TARGET_FILE:tqkv-server> ${PROJECT_SOURCE_DIR}/proto ${mode} ${_rt_lib})
    set_tests_properties(member_readthru_${mode} PROPERTIES LABELS "shard;server;interop"
      TIMEOUT 300 SKIP_RETURN_CODE 77)
  endforeach()
endif()
