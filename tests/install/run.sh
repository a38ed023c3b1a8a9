#!/usr/bin/env bash
# tests/install/run.sh BUILD_DIR TQKV_SERVER - libtqkv as an engine developer gets it:
# `cmake --install` into a temporary prefix, then, against the INSTALLED files only:
#   - libtqkv.so carries its soname (libtqkv.so.<major>) and exports tqkv_* functions
#     only (nm -D), none of the internal tqkv__ ones or of the libraries linked in;
#   - a C11 and a C++17 consumer build with `pkg-config --cflags --libs tqkv` and
#     -Wall -Werror alone, and a CMake project with find_package(tqkv) / tqkv::tqkv;
#   - the consumers run against a real tqkv-server on a free loopback port (with a TCP
#     data channel) with the installed library (ldd checked): Put, Lookup, Get packed,
#     decode, compare with the server's BF16 decode of the same pages.
#   - the installed Python package (when present) imports from the printed PYTHONPATH.
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SERVER=$2
HERE=$(cd "$(dirname "$0")" && pwd)
TMP=$(mktemp -d /tmp/tqkv-install.XXXXXX)
SPID=""
cleanup() {
  [ -n "$SPID" ] && kill "$SPID" 2>/dev/null && wait "$SPID" 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT
die() { echo "install test: FAIL: $*" >&2; exit 1; }

PREFIX=$TMP/prefix
cmake --install "$BUILD" --prefix "$PREFIX" > "$TMP/install.log" || { cat "$TMP/install.log"; die "cmake --install"; }
LIB=$(find "$PREFIX" -name 'libtqkv.so.*.*.*' | head -1)
[ -n "$LIB" ] || die "no libtqkv.so.X.Y.Z installed"
LIBDIR=$(dirname "$LIB")
for f in include/tqkv/client.h include/tqkv/client_bulk.h include/tqkv/kernels/page.h \
         include/tqkv/kernels/page_format.h include/tqkv/kernels/status.h \
         include/tqkv/kernels/version.h; do
  [ -f "$PREFIX/$f" ] || die "$f not installed"
done
[ -L "$LIBDIR/libtqkv.so" ] || die "no libtqkv.so link (the dev link)"
SONAME=$(objdump -p "$LIB" | awk '/SONAME/ {print $2}')
[[ "$SONAME" =~ ^libtqkv\.so\.[0-9]+$ ]] || die "soname '$SONAME'"
[ -e "$LIBDIR/$SONAME" ] || die "$SONAME link missing"
echo "install test: $LIB soname $SONAME"

# Exports: every defined dynamic symbol is a public tqkv_ function.
nm -D --defined-only "$LIB" | awk '$2 ~ /[TWDBR]/ {print $3}' | sed 's/@.*//' | sort -u > "$TMP/syms"
BAD=$(grep -v '^tqkv_[a-z0-9]' "$TMP/syms" || true)
BAD2=$(grep '^tqkv__' "$TMP/syms" || true)
[ -z "$BAD$BAD2" ] || die "non-API symbols exported: $(echo $BAD $BAD2 | head -c 400)"
for s in tqkv_client_create tqkv_client_get tqkv_client_get_into tqkv_client_put_many \
         tqkv_version tqkv_strerror tqkv_page_decode_bf16; do
  grep -qx "$s" "$TMP/syms" || die "$s not exported"
done
echo "install test: $(wc -l < "$TMP/syms") exported symbols, all tqkv_*"

export PKG_CONFIG_PATH=$LIBDIR/pkgconfig
FLAGS=$(pkg-config --cflags --libs tqkv)
echo "install test: pkg-config tqkv $(pkg-config --modversion tqkv): $FLAGS"
case "$FLAGS" in *"$BUILD"*|*"$(dirname "$HERE")"*) die "pkg-config flags point into the tree";; esac
cc -std=c11 -Wall -Werror -o "$TMP/consumer_c" "$HERE/consumer.c" $FLAGS || die "C consumer build"
c++ -std=c++17 -Wall -Werror -o "$TMP/consumer_cpp" "$HERE/consumer.cpp" $FLAGS || die "C++ consumer build"
# Also without C11 extensions: -pedantic on the C side catches non-portable headers.
cc -std=c11 -Wall -Wextra -pedantic -Werror -fsyntax-only "$HERE/consumer.c" $(pkg-config --cflags tqkv) \
  || die "C consumer with -Wextra -pedantic"

# find_package(tqkv) -> tqkv::tqkv.
mkdir -p "$TMP/cmk"
cat > "$TMP/cmk/CMakeLists.txt" <<CMK
cmake_minimum_required(VERSION 3.16)
project(tqkv_consumer C)
find_package(tqkv 0.1 REQUIRED)
add_executable(consumer_cmake $HERE/consumer.c)
target_compile_options(consumer_cmake PRIVATE -Wall -Werror)
target_link_libraries(consumer_cmake PRIVATE tqkv::tqkv)
CMK
cmake -S "$TMP/cmk" -B "$TMP/cmk/build" -DCMAKE_PREFIX_PATH="$PREFIX" > "$TMP/cmk.log" 2>&1 \
  || { cat "$TMP/cmk.log"; die "find_package(tqkv)"; }
cmake --build "$TMP/cmk/build" > "$TMP/cmkb.log" 2>&1 || { cat "$TMP/cmkb.log"; die "tqkv::tqkv build"; }

export LD_LIBRARY_PATH=$LIBDIR
for b in consumer_c consumer_cpp cmk/build/consumer_cmake; do
  DEPS=$(ldd "$TMP/$b")
  grep -q "libtqkv.so.* => $LIBDIR/" <<< "$DEPS" || { echo "$DEPS" | grep tqkv; die "$b does not load the installed libtqkv"; }
done

"$SERVER" --listen 127.0.0.1:0 --data-listen 127.0.0.1:0 --threads 2 --encoder-threads 1 \
  --dram-capacity 64M > "$TMP/server.out" 2> "$TMP/server.err" &
SPID=$!
PORT=""
for _ in $(seq 300); do
  PORT=$(sed -n 's/.*listening on .*:\([0-9][0-9]*\)$/\1/p' "$TMP/server.out" | head -1)
  [ -n "$PORT" ] && break
  kill -0 "$SPID" 2>/dev/null || { cat "$TMP/server.err"; die "tqkv-server did not start"; }
  sleep 0.1
done
[ -n "$PORT" ] || die "tqkv-server printed no port"
"$TMP/consumer_c" "127.0.0.1:$PORT" || die "C consumer run"
"$TMP/consumer_cpp" "127.0.0.1:$PORT" || die "C++ consumer run"
"$TMP/cmk/build/consumer_cmake" "127.0.0.1:$PORT" || die "find_package consumer run"

# The Python package, when the install step put one there.
PYDIR=$(find "$PREFIX" -type d -path '*dist-packages/tqkv' | head -1)
if [ -n "$PYDIR" ]; then
  env -u LD_LIBRARY_PATH -u TQKV_LIBRARY PYTHONPATH=$(dirname "$PYDIR") /usr/bin/python3 -c "
import numpy as np, tqkv
assert tqkv.__file__.startswith('$PREFIX') and tqkv.library_path.startswith('$PREFIX'), tqkv.library_path
c = tqkv.Client(['127.0.0.1:$PORT'])
h = [bytes([7]) * 32]
k = tqkv.bf16_from_float32(np.random.default_rng(1).standard_normal((1, 1, 16, 8, 128)))
c.put('install-py', h, k, k)
kk, vv, found = c.get('install-py', h, shape=(16, 8, 128))
assert found.all() and np.array_equal(kk, c.get('install-py', h, shape=(16, 8, 128), encoding='bf16')[0])
print('install test: python', tqkv.version(), tqkv.library_path)" || die "installed Python package"
  EX=$PREFIX/share/tqkv/examples/put_get.py
  [ -x "$EX" ] || die "put_get.py example not installed"
  env -u LD_LIBRARY_PATH -u TQKV_LIBRARY PYTHONPATH=$(dirname "$PYDIR") /usr/bin/python3 "$EX" \
    "127.0.0.1:$PORT" || die "the installed Python example"
fi
echo "install test: ok"
