#!/usr/bin/env bash
# run.sh - runs validate.py (k8s | negative | dockerfile | grafana) for CTest with the
# Python of the pinned `k8s` package set (deploy/python/k8s.txt), which
# deploy/python-env.sh builds outside the repository, or reuses when it is up to date;
# "install" only builds it (and the CRD schemas validate.py makes from it, once). Fails loudly when a tool is missing: a deployment check that
# silently passes is worse than none.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
mode=${1:-k8s}

need() {
  command -v "$1" >/dev/null 2>&1 || { echo "FAIL tools: $1 not found ($2)"; exit 1; }
}

case "$mode" in
  install | k8s | negative)
    py=$(bash "$repo/deploy/python-env.sh" k8s | tail -n 1) ||
      { echo "FAIL tools: deploy/python-env.sh k8s failed (its output is above)"; exit 1; }
    if [ "$mode" = install ]; then
      echo "k8s venv: $py"
      exec "$py" -B "$here/validate.py" schemas
    fi
    need "${KUBECTL:-kubectl}" "install kubectl (deploy/install-deps.sh installs kubernetes-client)"
    ;;
  dockerfile | grafana)
    # No third-party package needed: Debian's python3.
    py=/usr/bin/python3
    [ -x "$py" ] || py=$(command -v python3) || { echo "FAIL tools: python3 not found (deploy/install-deps.sh)"; exit 1; }
    ;;
  *)
    echo "usage: $0 install|k8s|negative|dockerfile|grafana"
    exit 2
    ;;
esac
exec "$py" -B "$here/validate.py" "$mode"
