# membership.cmake - live membership (transport/membership.c) against a real DNS server:
# dnsmasq on 127.0.0.1 at a free port, records rewritten + SIGHUP (skipped, exit 77,
# where dnsmasq is not installed: apt-get install dnsmasq-base).
tqkv_check_suite(check_membership
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_membership.c
  LIBS tqkv
  LABELS unit
  TIMEOUT 300)

if(TARGET tqkv-server)
  # --node-id: what a client learns at connect time (Stats identity_only, no token),
  # the default (host name), TQKV_NODE_ID, the tqkv_node_info metric, a bad value.
  tqkv_check_suite(check_node_id
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_node_id.c
    LIBS tqkv
    LABELS server
    TIMEOUT 300)
  set_tests_properties(check_node_id PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>")
endif()

if(TARGET tqkv-server)
  # A long-lived client follows servers added, removed (SIGTERM), killed (SIGKILL) and
  # restarted on a new port with the same --node-id, through dnsmasq SRV records.
  tqkv_check_suite(check_member_cluster
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_member_cluster.c
    LIBS tqkv
    LABELS shard
    TIMEOUT 300)
  set_tests_properties(check_member_cluster PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>")
endif()

if(TARGET tqkv-server AND TARGET tqkv-bench)
  # A rolling restart of 3 servers under a steady tqkv-bench (--target a DNS name it
  # follows), with and without hand-off on drain; gnuplot draws both hit-rate series
  # (deploy/bench/hit-rate.gp) into the build tree.
  if(EXISTS /usr/bin/python3)
    add_test(NAME member_rolling_restart_bench
      COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/member/rolling_restart_bench.py
              $<TARGET_FILE:tqkv-server> $<TARGET_FILE:tqkv-bench>
              ${CMAKE_CURRENT_BINARY_DIR}/member-bench)
    set_tests_properties(member_rolling_restart_bench PROPERTIES LABELS "shard;bench"
      TIMEOUT 300 SKIP_RETURN_CODE 77)
  endif()
endif()

if(TARGET tqkv-server AND EXISTS /usr/bin/python3)
  # grpcio clients through single pods (the load-balanced Service) see one cache: the
  # servers forward blocks they do not own to their owners (one hop); not with
  # --no-forward.
  add_test(NAME member_thin_grpcio
    COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/member/thin_grpcio.py
            $<TARGET_FILE:tqkv-server> ${PROJECT_SOURCE_DIR}/proto)
  set_tests_properties(member_thin_grpcio PROPERTIES LABELS "server;interop" TIMEOUT 180
    SKIP_RETURN_CODE 77)
endif()

if(TARGET tqkv-cluster-sim)
  # 1,000 servers on paper (docs/cluster.md "At 1,000 servers"): moves on a join and a
  # leave, balance, ranking cost (two-level vs flat), and 1,000 SRV records through
  # dnsmasq and c-ares (TCP after truncation) into libtqkv's membership.
  add_test(NAME cluster_sim_1000
    COMMAND $<TARGET_FILE:tqkv-cluster-sim> --servers 1000 --blocks 100000 --check)
  set_tests_properties(cluster_sim_1000 PROPERTIES LABELS "shard;unit" TIMEOUT 300)
endif()

if(TARGET tqkv-server AND TARGET tqkv-bench AND EXISTS /usr/bin/python3)
  # The nemesis, short: 8 servers, each in its own network namespace on a bridge, found
  # through dnsmasq; tqkv-bench (R = 2) and thin grpcio clients while one fault at a time
  # is applied (SIGKILL+restart, a black-holed port, a partition, a SIGTERM rollout, a
  # join, a leave). Asserts 0 wrong pages, 0 errors outside fault windows, hit rate back
  # within 10 s, at most 2 s without progress per fault for tqkv-bench and the Python
  # client (libtqkv's failure detection, client_health.c); plots the hit rate with the
  # faults shaded. The servers re-replicate (--replicate-bytes-per-s 32M), as deployed
  # clusters with R = 2 should. Needs root (ip netns, tc): skipped (77) otherwise.
  # The 10-minute version: docs/cluster.md.
  add_test(NAME member_nemesis
    COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/member/nemesis.py
            $<TARGET_FILE:tqkv-server> $<TARGET_FILE:tqkv-bench> ${PROJECT_SOURCE_DIR}/proto
            ${CMAKE_CURRENT_BINARY_DIR}/nemesis --servers 8 --duration 150 --expect-stall-s 2
            --replicate-bytes-per-s 32M)
  set_tests_properties(member_nemesis PROPERTIES LABELS "nemesis;shard" TIMEOUT 480
    SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
  if(TARGET tqkv_shared)
    set_property(TEST member_nemesis APPEND PROPERTY ENVIRONMENT
      "TQKV_LIBRARY=$<TARGET_FILE:tqkv_shared>")
  endif()
endif()

if(TARGET tqkv-server AND TARGET tqkv-bench AND TARGET tqkv_shared AND EXISTS /usr/bin/python3
   AND NOT TQKV_SANITIZE)
  # (Not in sanitizer builds: its Python client loads libtqkv, which an ASan build of it
  # cannot do.) A silent server (issue 22): server 0 of three behind a TCP proxy that swallows every
  # byte for 10 s (no RST; no root needed). tqkv-bench and the Python client (R = 2) must
  # see 0 errors, 0 wrong pages and at most 2 s without an operation completing
  # (libtqkv's hedged reads and keepalive; docs/cluster.md "A silent server").
  add_test(NAME member_blackhole
    COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/member/blackhole.py
            $<TARGET_FILE:tqkv-server> $<TARGET_FILE:tqkv-bench>
            ${CMAKE_CURRENT_BINARY_DIR}/blackhole)
  set_tests_properties(member_blackhole PROPERTIES LABELS "shard;bench" TIMEOUT 240
    SKIP_RETURN_CODE 77 ENVIRONMENT "TQKV_LIBRARY=$<TARGET_FILE:tqkv_shared>")
endif()
