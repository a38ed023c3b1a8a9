# deploy.cmake - tests of the deploy part: the metrics registry (unit), the server's
# /metrics scraped with the Prometheus parser (server), and the Kubernetes manifests,
# Dockerfile and Grafana dashboard (deploy).

# check_metrics builds service/metrics.c on its own with a fake store, so it does not
# depend on the rest of the service library.
tqkv_check_suite(check_metrics
  SOURCES ${PROJECT_SOURCE_DIR}/tests/check_metrics.c ${PROJECT_SOURCE_DIR}/service/metrics.c
  LIBS PkgConfig::MHD
  LABELS unit concurrency
  TIMEOUT 120)
