# deploy.cmake - tests of the deploy part: the metrics registry (unit), the server's
# /metrics scraped with the Prometheus parser (server), and the Kubernetes manifests,
# Dockerfile and Grafana dashboard (deploy).

# check_metrics builds service/metrics.c (and metrics_text.c, its exposition text) on its
# own with a fake store, so it does not depend on the rest of the service library.
tqkv_check_suite(check_metrics
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_metrics.c ${PROJECT_SOURCE_DIR}/service/metrics.c
          ${PROJECT_SOURCE_DIR}/service/metrics_text.c
  LIBS PkgConfig::MHD
  LABELS unit concurrency
  TIMEOUT 120)

# The real server, driven over gRPC by Python grpcio, scraped with prometheus_client.
if(TARGET tqkv-server)
  add_test(NAME metrics_scrape
    COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/metrics_scrape.py
            $<TARGET_FILE:tqkv-server> ${PROJECT_SOURCE_DIR}/proto)
  set_tests_properties(metrics_scrape PROPERTIES LABELS "server" TIMEOUT 300)
endif()

# Deployment artefacts: Python with the pinned `k8s` package set (a venv that
# deploy/python-env.sh builds outside the repository, or reuses) + kubectl are required
# (the test fails, naming the missing tool, rather than passing without checking anything).
set(_k8s ${PROJECT_SOURCE_DIR}/tests/k8s/run.sh)
set(_k8s_env "TQKV_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
if(TARGET tqkv-server)
  list(APPEND _k8s_env "TQKV_SERVER=$<TARGET_FILE:tqkv-server>")
endif()
add_test(NAME deploy_k8s_venv COMMAND bash ${_k8s} install)
set_tests_properties(deploy_k8s_venv PROPERTIES LABELS "deploy" TIMEOUT 1200
  FIXTURES_SETUP deploy_venv)
add_test(NAME deploy_k8s COMMAND bash ${_k8s} k8s)
set_tests_properties(deploy_k8s PROPERTIES LABELS "deploy" TIMEOUT 300
  FIXTURES_REQUIRED deploy_venv ENVIRONMENT "${_k8s_env}")
# The schema and invariant checks must fail on broken copies of the rendered manifests.
add_test(NAME deploy_k8s_negative COMMAND bash ${_k8s} negative)
set_tests_properties(deploy_k8s_negative PROPERTIES LABELS "deploy" TIMEOUT 300
  FIXTURES_REQUIRED deploy_venv ENVIRONMENT "TQKV_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
add_test(NAME deploy_dockerfile COMMAND bash ${_k8s} dockerfile)
set_tests_properties(deploy_dockerfile PROPERTIES LABELS "deploy" TIMEOUT 120
  ENVIRONMENT "${_k8s_env}")
add_test(NAME deploy_grafana COMMAND bash ${_k8s} grafana)
set_tests_properties(deploy_grafana PROPERTIES LABELS "deploy" TIMEOUT 120
  ENVIRONMENT "${_k8s_env}")

# tqkv-bench as a Kubernetes Job runs it: stderr is a log file, not a terminal. It must
# write whole progress lines while it runs (one every 5 s and one at the end), never the
# \r-rewritten terminal line; and the raw-TCP baseline uses one connection per worker.
if(TARGET tqkv-bench AND TARGET tqkv-server)
  add_test(NAME bench_progress_log
    COMMAND sh -c "set -e; d=$(mktemp -d); trap 'rm -rf $d' EXIT; \
      $<TARGET_FILE:tqkv-bench> --spawn-server $<TARGET_FILE:tqkv-server> --dram-capacity 64MiB \
        --model tiny --block-tokens 64 --duration 6 --concurrency 2 --phase mixed \
        --no-baselines --json $d/j > $d/out 2> $d/err; \
      n=$(grep -c '^tqkv-bench: progress [0-9.]*s.* put .* ops [0-9]* verify-fail 0 err' $d/err); \
      e=$(grep -c '^tqkv-bench: progress [0-9.]*s (end) ' $d/err); \
      if grep -q \"$(printf '\\r')\" $d/err; then echo 'carriage return in a log'; exit 1; fi; \
      echo \"progress lines: $n (end: $e)\"; test $n -ge 2; test $e -eq 1; \
      $<TARGET_FILE:tqkv-bench> --spawn-server $<TARGET_FILE:tqkv-server> --dram-capacity 64MiB \
        --model tiny --block-tokens 64 --duration 1 --concurrency 3 --phase prefill \
        --json $d/j2 > $d/out2 2> $d/err2; \
      grep -o '\"raw_tcp_connections\": [0-9]*' $d/j2; \
      grep -q '\"raw_tcp_connections\": 3' $d/j2; grep -q 'raw TCP loopback GB/s, 3 conns' $d/out2")
  set_tests_properties(bench_progress_log PROPERTIES LABELS "bench" TIMEOUT 300)
endif()
