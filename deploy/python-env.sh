#!/usr/bin/env bash
# python-env.sh - builds, or reuses, the Python virtual environment of one named package
# set. The set NAME is the file deploy/python/NAME.txt: exact `name==version` pins of every
# package, transitive dependencies included. The venv is
#   ${TQKV_VENV_ROOT:-$HOME/.cache/tqkv/venv}/NAME
# outside the repository, so fresh clones on the same machine (CI) reuse it.
#
#   deploy/python-env.sh NAME                  build it when missing or stale, then print
#                                              the venv's python on the last stdout line
#   deploy/python-env.sh --print-python NAME   print that path only if the venv is up to
#                                              date (exit 1 otherwise); never builds
#
# Up to date: its stamp holds the sha256 of NAME.txt and the base Python's version. A
# stale or half-built venv is removed and built anew with Debian's /usr/bin/python3
# (python3-venv; TQKV_VENV_PYTHON overrides it) and pip from PyPI (pip's own PIP_*
# variables apply). Fails loudly, with pip's output, when the install fails, and when pip
# installed a package the file does not pin (the set must stay reproducible).
# Progress goes to stderr. Concurrent calls for one set wait for each other (flock).
# A set file may carry lines "#tqkv-pip: ARGS", passed to pip install (e.g. --no-deps, for
# a complete freeze whose top package pins a version only another index serves).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
print_only=0
if [ "${1:-}" = --print-python ]; then
  print_only=1
  shift
fi
name=${1:-}
die() {
  echo "FAIL python-env${name:+ $name}: $*" >&2
  exit 1
}
[ $# -eq 1 ] || { echo "usage: $0 [--print-python] NAME   (NAME: a file deploy/python/NAME.txt)" >&2; exit 2; }
[[ $name =~ ^[a-z0-9][a-z0-9_-]*$ ]] || die "set name must be [a-z0-9][a-z0-9_-]*"
req=$here/python/$name.txt
[ -f "$req" ] || die "no requirements file $req"
base=${TQKV_VENV_PYTHON:-/usr/bin/python3}
[ -x "$base" ] || die "$base not found (deploy/install-deps.sh installs python3 and python3-venv)"
root=${TQKV_VENV_ROOT:-${HOME:?is unset: set TQKV_VENV_ROOT}/.cache/tqkv/venv}
venv=$root/$name
py=$venv/bin/python

want_stamp="format 1; $(sha256sum "$req" | cut -d' ' -f1); $("$base" -c 'import sys; print(sys.version.split()[0])')"
fresh() {
  [ -x "$py" ] && [ -f "$venv/.tqkv-stamp" ] && [ "$(cat "$venv/.tqkv-stamp")" = "$want_stamp" ]
}

if [ "$print_only" = 1 ]; then
  fresh || die "$venv is missing or stale: run deploy/python-env.sh $name"
  echo "$py"
  exit 0
fi

mkdir -p "$root"
exec 9>"$root/.$name.lock"
flock -w 1800 9 || die "waited 30 min for $root/.$name.lock"
if fresh; then
  echo "$py"
  exit 0
fi

t0=$(date +%s)
echo "python-env $name: building $venv from $req" >&2
rm -rf "$venv"
log=$root/$name.pip.log
if ! "$base" -m venv "$venv" >"$log" 2>&1; then
  cat "$log" >&2
  rm -rf "$venv"
  die "$base -m venv failed (Debian: apt-get install python3-venv, see deploy/install-deps.sh)"
fi
read -r -a pip_args <<<"$(sed -n 's/^#tqkv-pip:[[:space:]]*//p' "$req" | tr '\n' ' ')"
if ! "$py" -m pip install --disable-pip-version-check --no-input --progress-bar off \
  ${pip_args[@]+"${pip_args[@]}"} -r "$req" >>"$log" 2>&1; then
  tail -n 40 "$log" >&2
  rm -rf "$venv"
  die "pip install -r $req failed (output above; all of it in $log)"
fi
# Every installed distribution is pinned in the file, at that version (pip and setuptools,
# the venv's own, unless the file pins them).
if ! "$py" - "$req" >>"$log" 2>&1 <<'EOF'; then
import importlib.metadata as md
import re
import sys

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
want, bad = {}, []
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
    if not m:
        bad.append(f"not an exact name==version pin: {line}")
        continue
    want[norm(m[1])] = m[2]
have = {norm(d.metadata["Name"]): d.version for d in md.distributions()}
for n, v in sorted(have.items()):
    if n not in want and n not in ("pip", "setuptools"):
        bad.append(f"{n}=={v} installed but not pinned (add it to the file)")
    elif n in want and want[n] != v:
        bad.append(f"{n}: pinned {want[n]}, installed {v}")
for n in sorted(set(want) - set(have)):
    bad.append(f"{n}=={want[n]} pinned but not installed")
for b in bad:
    print(b)
sys.exit(1 if bad else 0)
EOF
  tail -n 20 "$log" >&2
  rm -rf "$venv"
  die "the installed packages differ from $req (above)"
fi
echo "$want_stamp" >"$venv/.tqkv-stamp"
echo "python-env $name: built in $(($(date +%s) - t0)) s" >&2
echo "$py"
