#!/usr/bin/env bash
# run.sh - proves the README's two commands on a bare Debian 12, not on this machine.
#
# Builds a minimal Debian 12 root with mmdebstrap (--variant=minbase, the host's apt
# sources), clones this checkout's HEAD into it, and runs there, by chroot, the README's
# first command (bash deploy/quickstart.sh: install-deps, build, server, a short bench),
# then a short test stage (ctest -L unit). It prints what failed. Takes ~5-10 minutes,
# so it is not part of .ci/run: run it before every stop that touches dependencies,
# CMake or the deploy scripts (docs/testing.md).
#
# Needs root (chroot, bind mounts) and the network to the Debian mirror.
#   TQKV_FRESH_DIR       where the root is made (default: a new /tmp/tqkv-fresh.XXXXXX)
#   TQKV_FRESH_KEEP=1    keep the root afterwards (default: removed)
#   TQKV_FRESH_SECONDS   bench seconds in the quickstart (default 10)
#   TQKV_FRESH_STAGE     quickstart|all (default all: quickstart, then ctest -L unit)
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
[ "$(id -u)" -eq 0 ] || { echo "fresh: needs root (chroot, mounts)"; exit 2; }

if ! command -v mmdebstrap >/dev/null 2>&1; then
  echo "fresh: installing mmdebstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
fi

WORK=${TQKV_FRESH_DIR:-$(mktemp -d /tmp/tqkv-fresh.XXXXXX)}
mkdir -p "$WORK"
R=$WORK/root
MOUNTS=()
cleanup() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do umount -l "${MOUNTS[i]}" 2>/dev/null || true; done
  if [ "${TQKV_FRESH_KEEP:-0}" != 1 ]; then rm -rf "$WORK"; else echo "fresh: root kept in $R"; fi
}
trap cleanup EXIT INT TERM

# The host's apt sources, as they are (one-line and deb822 files alike).
SOURCES=()
[ -s /etc/apt/sources.list ] && SOURCES+=(/etc/apt/sources.list)
for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] && SOURCES+=("$f")
done
[ ${#SOURCES[@]} -gt 0 ] || { echo "fresh: no apt sources on this host"; exit 2; }

t0=$(date +%s)
echo "== fresh: mmdebstrap --variant=minbase bookworm $R"
# apt settings of the host (proxies, mirrors' date checks) go in too, as a user's would.
APTOPTS=()
for f in /etc/apt/apt.conf.d/*; do
  [ -f "$f" ] && APTOPTS+=(--aptopt="$f")
done
if ! mmdebstrap --variant=minbase --quiet "${APTOPTS[@]}" bookworm "$R" "${SOURCES[@]}"; then
  echo "fresh: FAILED: mmdebstrap could not build the root"
  exit 1
fi
echo "   root built in $(($(date +%s) - t0)) s: $(du -sh "$R" | cut -f1)"

echo "== fresh: git clone $SRC (HEAD $(git -C "$SRC" rev-parse --short HEAD)) into the root"
git clone -q --no-hardlinks "$SRC" "$R/src/tqkv"
[ -n "$(git -C "$SRC" status --porcelain --untracked-files=no)" ] &&
  echo "   note: uncommitted changes in $SRC are not in the clone (as in CI)"

for m in proc sys dev dev/pts; do
  mkdir -p "$R/$m"
  mount --bind "/$m" "$R/$m"
  MOUNTS+=("$R/$m")
done
cp /etc/resolv.conf "$R/etc/resolv.conf" 2>/dev/null || true

run_in_root() {
  chroot "$R" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 TERM=dumb TQKV_QUICKSTART_SECONDS="${TQKV_FRESH_SECONDS:-10}" /bin/bash -c "$1"
}

STAGE=${TQKV_FRESH_STAGE:-all}
failed=()
echo "== fresh: the README's first command: bash deploy/quickstart.sh"
t1=$(date +%s)
if run_in_root 'cd /src/tqkv && bash deploy/quickstart.sh'; then
  echo "   quickstart ok in $(($(date +%s) - t1)) s"
else
  echo "fresh: FAILED: bash deploy/quickstart.sh (exit $?) on a bare Debian 12"
  failed+=(quickstart)
fi

if [ "$STAGE" = all ] && [ ${#failed[@]} -eq 0 ]; then
  echo "== fresh: short test stage: build everything, ctest -L unit"
  t2=$(date +%s)
  if run_in_root 'cd /src/tqkv && cmake --build build -j"$(nproc)" >/tmp/build.log 2>&1 ||
                  { tail -40 /tmp/build.log; exit 1; }; cd build && ctest -L unit -j2 --output-on-failure'; then
    echo "   unit tests ok in $(($(date +%s) - t2)) s"
  else
    echo "fresh: FAILED: build or ctest -L unit in the fresh root"
    failed+=(unit)
  fi
fi

echo "== fresh: $(($(date +%s) - t0)) s in all"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fresh: FAILED stages: ${failed[*]}"
  exit 1
fi
echo "fresh: ok: the README's first command and ctest -L unit pass on a bare Debian 12"
