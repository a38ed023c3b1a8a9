#!/bin/bash
# tests/python/run_in_venv.sh NAME SCRIPT [ARGS...]: runs SCRIPT with the python of the
# project's venv NAME (deploy/python-env.sh NAME, reused when built). When the venv cannot
# be built here, exits 77 (ctest SKIP) printing exactly what failed.
name=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log=$(mktemp)
if ! py=$(bash "$here/../../deploy/python-env.sh" "$name" 2>"$log" | tail -n 1) || [ ! -x "$py" ]; then
  echo "SKIPPED: the '$name' venv (deploy/python-env.sh $name) could not be built here:"
  tail -n 20 "$log"
  rm -f "$log"
  exit 77
fi
rm -f "$log"
exec "$py" "$@"
