#!/usr/bin/env bash
# run.sh - runs validate.mjs (k8s | dockerfile | grafana) for CTest; "install" only
# installs the pinned npm packages (npm ci from package-lock.json) when they are
# missing or older than the lock file. Fails loudly when a tool is missing: a
# deployment check that silently passes is worse than none.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mode=${1:-k8s}

need() {
  command -v "$1" >/dev/null 2>&1 || { echo "FAIL tools: $1 not found ($2)"; exit 1; }
}
need node "install nodejs: deploy/install-deps.sh"
major=$(node -p 'process.versions.node.split(".")[0]')
[ "$major" -ge 18 ] || { echo "FAIL tools: node >= 18 needed, found $(node --version)"; exit 1; }

if [ "$mode" = install ] || [ "$mode" = k8s ]; then
  stamp=$here/node_modules/.package-lock.json
  if [ ! -f "$stamp" ] || [ "$here/package-lock.json" -nt "$stamp" ]; then
    need npm "install npm: deploy/install-deps.sh"
    (cd "$here" && npm ci --no-audit --no-fund --prefer-offline --loglevel=error)
  fi
  [ "$mode" = install ] && exit 0
  need "${KUBECTL:-kubectl}" "install kubectl (deploy/install-deps.sh installs kubernetes-client)"
fi
exec node "$here/validate.mjs" "$mode"
