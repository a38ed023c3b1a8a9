#!/bin/bash
# deploy/python-env.sh NAME: makes (or reuses) the virtual environment NAME from the pinned
# requirements in deploy/python/NAME.txt, at ${TQKV_VENV_ROOT:-$HOME/.cache/tqkv/venv}/NAME
# (outside the repository, so CI and later runs reuse it), and prints its python's path on
# its last line. Reused while its stamp (the SHA-256 of NAME.txt) matches; rebuilt otherwise.
# A requirements file may carry a line "#tqkv-pip: ARGS" (e.g. --no-deps, for a complete
# freeze whose top package pins a wheel only its own index serves); ARGS go to pip install.
# Exit status: 0 with the path; non-zero with pip's error on stderr (callers that skip say so).
set -euo pipefail
name=${1:?usage: deploy/python-env.sh NAME}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
req=$here/python/$name.txt
[ -f "$req" ] || { echo "python-env: no $req" >&2; exit 2; }
root=${TQKV_VENV_ROOT:-$HOME/.cache/tqkv/venv}
venv=$root/$name
stamp=$(sha256sum "$req" | cut -c1-64)
mkdir -p "$root"
exec 9>"$root/.$name.lock"
flock 9
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.tqkv-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$venv/bin/python"
  exit 0
fi
py=${TQKV_VENV_PYTHON:-python3}
args=$(sed -n 's/^#tqkv-pip:[[:space:]]*//p' "$req" | tr '\n' ' ')
echo "python-env: building $venv from $req (pip args: ${args:-none})" >&2
start=$(date +%s)
rm -rf "$venv"
"$py" -m venv "$venv" >&2
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install --disable-pip-version-check --no-input --progress-bar off \
  $args -r "$req" >&2
echo "$stamp" >"$venv/.tqkv-stamp"
echo "python-env: $name ready in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)" >&2
echo "$venv/bin/python"
