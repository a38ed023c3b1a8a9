#!/bin/bash
# tests/python/run_in_venv.sh NAME SCRIPT [ARGS...]: runs SCRIPT with the python of the
# project's venv NAME (deploy/python-env.sh NAME, reused when built). When the venv cannot
# be built here, exits 77 (ctest SKIP) printing exactly what failed; without
# TQKV_BUILD_ENGINE_VENVS=1 it does not build a missing venv (77, saying so).
name=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log=$(mktemp)
if [ "${TQKV_BUILD_ENGINE_VENVS:-0}" != 1 ] &&
  ! bash "$here/../../deploy/python-env.sh" --print-python "$name" >/dev/null 2>&1; then
  echo "SKIPPED: the '$name' venv is not built (or is stale): it takes 27-65 minutes and ~6 GB"
  echo "on a 2-core machine, so the default run does not build it. Build it with"
  echo "'bash deploy/python-env.sh $name' (or run tests/engines.sh), then run this test again."
  rm -f "$log"
  exit 77
fi
if ! py=$(bash "$here/../../deploy/python-env.sh" "$name" 2>"$log" | tail -n 1) || [ ! -x "$py" ]; then
  echo "SKIPPED: the '$name' venv (deploy/python-env.sh $name) could not be built here:"
  tail -n 20 "$log"
  rm -f "$log"
  exit 77
fi
rm -f "$log"
exec "$py" "$@"
